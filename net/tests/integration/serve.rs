//! The accept loop against real sockets: TLS and mutual TLS with a generated PKI, slow clients cut
//! off, the connection cap, graceful shutdown, and setup errors that name the file.

use std::net::SocketAddr;
use std::time::Duration;

use allot_net::{ClientTls, ServeLimits, ServerTls, serve};
use allot_testkit::{TEST_SERVER_NAME, TestPki};
use axum::Router;
use axum::routing::get;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

fn app() -> Router {
    Router::new()
        .route("/", get(|| async { "ok" }))
        .route("/healthz", get(|| async { "healthy" }))
        .route(
            "/slow",
            get(|| async {
                tokio::time::sleep(Duration::from_millis(400)).await;
                "slow ok"
            }),
        )
        .route(
            "/forever",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(3_600)).await;
                "never"
            }),
        )
}

struct Running {
    addr: SocketAddr,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
    served: tokio::task::JoinHandle<std::io::Result<()>>,
}

async fn start(tls: Option<&ServerTls>, limits: ServeLimits) -> Running {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let acceptor = tls.map(|tls| tls.acceptor().expect("TLS config"));
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let served = tokio::spawn(serve(listener, app(), acceptor, limits, async move {
        let _ = stopped.await;
    }));
    Running {
        addr,
        stop: Some(stop),
        served,
    }
}

fn client(addr: SocketAddr, tls: &ClientTls) -> reqwest::Client {
    tls.configure(
        reqwest::Client::builder()
            .resolve(TEST_SERVER_NAME, addr)
            .timeout(Duration::from_secs(5)),
    )
    .expect("client TLS")
    .build()
    .expect("client")
}

fn url(addr: SocketAddr, path: &str) -> String {
    format!("https://{TEST_SERVER_NAME}:{}{path}", addr.port())
}

#[tokio::test]
async fn tls_is_served_to_clients_that_trust_the_ca() {
    let pki = TestPki::generate();
    let server_tls = ServerTls {
        cert: pki.server_cert(),
        key: pki.server_key(),
        client_ca: None,
    };
    let running = start(Some(&server_tls), ServeLimits::default()).await;
    let trusting = client(
        running.addr,
        &ClientTls {
            ca: Some(pki.ca()),
            ..ClientTls::default()
        },
    );
    let answer = trusting
        .get(url(running.addr, "/"))
        .send()
        .await
        .expect("TLS request");
    assert_eq!(answer.text().await.expect("body"), "ok");
    // HTTP/2 is negotiated over TLS (ALPN), and HTTP/1.1 still works.
    let h2 = trusting
        .get(url(running.addr, "/"))
        .version(reqwest::Version::HTTP_2)
        .send()
        .await
        .expect("h2");
    assert_eq!(h2.version(), reqwest::Version::HTTP_2);
    // A client that does not trust the CA refuses the server.
    let system_roots = client(running.addr, &ClientTls::default());
    assert!(
        system_roots
            .get(url(running.addr, "/"))
            .send()
            .await
            .is_err()
    );
    // Plain HTTP to a TLS port gets nowhere.
    let plain = reqwest::Client::new()
        .get(format!("http://{}/", running.addr))
        .timeout(Duration::from_secs(5))
        .send()
        .await;
    assert!(plain.is_err() || plain.is_ok_and(|r| !r.status().is_success()));
}

#[tokio::test]
async fn mutual_tls_requires_a_client_certificate_from_the_ca() {
    let pki = TestPki::generate();
    let server_tls = ServerTls {
        cert: pki.server_cert(),
        key: pki.server_key(),
        client_ca: Some(pki.ca()),
    };
    let running = start(Some(&server_tls), ServeLimits::default()).await;
    let with = |cert, key| {
        client(
            running.addr,
            &ClientTls {
                ca: Some(pki.ca()),
                cert,
                key,
            },
        )
    };
    // Without a certificate: probes are served, everything else is refused.
    let anonymous = with(None, None);
    let refused = anonymous
        .get(url(running.addr, "/"))
        .send()
        .await
        .expect("connects without a certificate");
    assert_eq!(refused.status(), 401);
    assert_eq!(
        refused.headers()["content-type"],
        "application/problem+json"
    );
    assert!(
        refused
            .text()
            .await
            .expect("body")
            .contains("client certificate")
    );
    let probe = anonymous
        .get(url(running.addr, "/healthz"))
        .send()
        .await
        .expect("probe");
    let status = probe.status();
    assert_eq!(
        (status.as_u16(), probe.text().await.expect("body")),
        (200, "healthy".to_owned())
    );
    let stranger = with(Some(pki.stranger_cert()), Some(pki.stranger_key()));
    assert!(stranger.get(url(running.addr, "/")).send().await.is_err());
    let member = with(Some(pki.client_cert()), Some(pki.client_key()));
    let answer = member
        .get(url(running.addr, "/"))
        .send()
        .await
        .expect("mutual TLS");
    assert_eq!(answer.status(), 200);
}

#[tokio::test]
async fn a_client_that_never_finishes_its_headers_is_cut_off() {
    let limits = ServeLimits {
        header_read_timeout: Duration::from_millis(300),
        ..ServeLimits::default()
    };
    let running = start(None, limits).await;
    let mut slow = tokio::net::TcpStream::connect(running.addr)
        .await
        .expect("connect");
    slow.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n")
        .await
        .expect("partial headers");
    let mut buffer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), slow.read_to_end(&mut buffer)).await;
    assert!(
        read.is_ok(),
        "the server kept a slow client's connection open"
    );
    let text = String::from_utf8_lossy(&buffer);
    assert!(
        buffer.is_empty() || text.starts_with("HTTP/1.1 408"),
        "{text}"
    );

    // The same happens over TLS to a client that never starts its handshake.
    let pki = TestPki::generate();
    let server_tls = ServerTls {
        cert: pki.server_cert(),
        key: pki.server_key(),
        client_ca: None,
    };
    let limits = ServeLimits {
        tls_handshake_timeout: Duration::from_millis(300),
        ..ServeLimits::default()
    };
    let running = start(Some(&server_tls), limits).await;
    let mut silent = tokio::net::TcpStream::connect(running.addr)
        .await
        .expect("connect");
    let mut buffer = Vec::new();
    let read = tokio::time::timeout(Duration::from_secs(5), silent.read_to_end(&mut buffer)).await;
    assert!(read.is_ok(), "the server kept a silent TLS client open");
}

#[tokio::test]
async fn silent_and_idle_connections_are_closed() {
    let limits = ServeLimits {
        header_read_timeout: Duration::from_millis(300),
        idle_timeout: Duration::from_millis(600),
        ..ServeLimits::default()
    };
    let running = start(None, limits).await;
    // Connects and says nothing: closed at the first-bytes deadline.
    let mut silent = tokio::net::TcpStream::connect(running.addr)
        .await
        .expect("connect");
    let mut buffer = Vec::new();
    let closed =
        tokio::time::timeout(Duration::from_secs(5), silent.read_to_end(&mut buffer)).await;
    assert!(closed.is_ok(), "a silent client kept its connection");
    // HTTP/2 prior knowledge, then nothing: closed too (no pings keep it alive).
    let mut h2 = tokio::net::TcpStream::connect(running.addr)
        .await
        .expect("connect");
    h2.write_all(b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n\x00\x00\x00\x04\x00\x00\x00\x00\x00")
        .await
        .expect("preface and empty SETTINGS");
    let mut sink = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), h2.read_to_end(&mut sink)).await;
    assert!(closed.is_ok(), "an idle HTTP/2 connection stayed open");
    // A kept-alive HTTP/1 connection, idle after its answer: closed after the idle timeout.
    let mut kept = tokio::net::TcpStream::connect(running.addr)
        .await
        .expect("connect");
    kept.write_all(b"GET / HTTP/1.1\r\nHost: x\r\n\r\n")
        .await
        .expect("request");
    let mut answer = [0u8; 12];
    kept.read_exact(&mut answer).await.expect("answer");
    assert_eq!(&answer, b"HTTP/1.1 200");
    let mut rest = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), kept.read_to_end(&mut rest)).await;
    assert!(closed.is_ok(), "an idle keep-alive connection stayed open");
}

#[tokio::test]
async fn shutdown_drops_what_outlives_the_grace() {
    let limits = ServeLimits {
        shutdown_grace: Duration::from_millis(300),
        ..ServeLimits::default()
    };
    let mut running = start(None, limits).await;
    let client = reqwest::Client::new();
    let hung = tokio::spawn({
        let url = format!("http://{}/forever", running.addr);
        async move { client.get(url).send().await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let _ = running.stop.take().expect("stop").send(());
    tokio::time::timeout(Duration::from_secs(5), running.served)
        .await
        .expect("serve returned after the grace")
        .expect("task")
        .expect("served");
    let answer = tokio::time::timeout(Duration::from_secs(5), hung)
        .await
        .expect("the hung request ended")
        .expect("task");
    match answer {
        Err(_) => {}
        Ok(response) => panic!(
            "the connection was dropped, not answered: {} {:?}",
            response.status(),
            response.text().await
        ),
    }
}

#[tokio::test]
async fn connections_past_the_cap_wait_until_one_closes() {
    let limits = ServeLimits {
        max_connections: 2,
        ..ServeLimits::default()
    };
    let running = start(None, limits).await;
    let request = b"GET / HTTP/1.1\r\nHost: x\r\n\r\n";
    let mut open = Vec::new();
    for _ in 0..2 {
        let mut stream = tokio::net::TcpStream::connect(running.addr)
            .await
            .expect("connect");
        stream.write_all(request).await.expect("request");
        let mut answer = [0u8; 12];
        stream.read_exact(&mut answer).await.expect("answer");
        assert_eq!(&answer, b"HTTP/1.1 200");
        open.push(stream);
    }
    // The third connects (the kernel's backlog) but is not served while two are open.
    let mut third = tokio::net::TcpStream::connect(running.addr)
        .await
        .expect("connect");
    third.write_all(request).await.expect("request");
    let mut answer = [0u8; 12];
    let early =
        tokio::time::timeout(Duration::from_millis(500), third.read_exact(&mut answer)).await;
    assert!(early.is_err(), "served past the connection cap");
    drop(open.pop());
    tokio::time::timeout(Duration::from_secs(5), third.read_exact(&mut answer))
        .await
        .expect("served once a connection closed")
        .expect("read");
    assert_eq!(&answer, b"HTTP/1.1 200");
}

#[tokio::test]
async fn shutdown_lets_requests_in_flight_finish() {
    let mut running = start(None, ServeLimits::default()).await;
    let client = reqwest::Client::new();
    let in_flight = tokio::spawn({
        let url = format!("http://{}/slow", running.addr);
        async move { client.get(url).send().await?.text().await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let _ = running.stop.take().expect("stop").send(());
    let body = in_flight.await.expect("task").expect("finished");
    assert_eq!(body, "slow ok");
    tokio::time::timeout(Duration::from_secs(5), running.served)
        .await
        .expect("serve returned")
        .expect("task")
        .expect("served");
    assert!(
        tokio::net::TcpStream::connect(running.addr).await.is_err(),
        "the listener is closed"
    );
}

#[test]
fn bad_tls_files_are_named() {
    let pki = TestPki::generate();
    let missing = ServerTls {
        cert: pki.dir().join("nope.pem"),
        key: pki.server_key(),
        client_ca: None,
    };
    let error = missing
        .server_config()
        .expect_err("missing file")
        .to_string();
    assert!(error.contains("nope.pem"), "{error}");
    let not_a_key = ServerTls {
        cert: pki.server_cert(),
        key: pki.server_cert(),
        client_ca: None,
    };
    let error = not_a_key.server_config().expect_err("no key").to_string();
    assert!(
        error.contains("server.pem") && error.contains("private key"),
        "{error}"
    );
    let mismatched = ServerTls {
        cert: pki.server_cert(),
        key: pki.client_key(),
        client_ca: None,
    };
    assert!(
        mismatched.server_config().is_err(),
        "key of another certificate"
    );
    let half = ClientTls {
        ca: None,
        cert: Some(pki.client_cert()),
        key: None,
    };
    assert!(half.configure(reqwest::Client::builder()).is_err());
}
