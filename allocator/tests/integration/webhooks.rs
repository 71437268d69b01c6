//! Threshold webhooks end to end, on a real etcd: a real HTTPS receiver (the test PKI's certificate, which the
//! allocator trusts through its webhook CA) hears each threshold of a pool's window once, signed
//! with the webhook's secret; while it is down the delivery is retried with backoff, and once back
//! it gets the event exactly once, signed by both secrets after a rotation.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use allot_testkit::TestPki;
use axum::http::HeaderMap;
use hmac::{Hmac, KeyInit, Mac};
use serde_json::{Value, json};
use sha2::Sha256;

use crate::common;

use crate::common::{AGENT, OPERATOR};

/// What the receiver got: each delivery's headers and body.
type Received = Arc<Mutex<Vec<(HeaderMap, String)>>>;

/// Serves the receiver on `listener` over TLS until `stop` fires.
fn serve_receiver(
    listener: tokio::net::TcpListener,
    pki: &TestPki,
    received: Received,
    stop: tokio::sync::oneshot::Receiver<()>,
) {
    let tls = allot_net::ServerTls {
        cert: pki.server_cert(),
        key: pki.server_key(),
        client_ca: None,
    }
    .acceptor()
    .expect("tls");
    let app = axum::Router::new().route(
        "/hook",
        axum::routing::post(move |headers: HeaderMap, body: String| {
            let received = received.clone();
            async move {
                received.lock().expect("received").push((headers, body));
                "thanks"
            }
        }),
    );
    tokio::spawn(allot_net::serve(
        listener,
        app,
        Some(tls),
        allot_net::ServeLimits::default(),
        async move {
            let _ = stop.await;
        },
    ));
}

/// An allocator on `etcd` whose deliveries trust `pki` (reaching loopback receivers only when
/// `allow_private`), with the pool `acme/api`: 10 tokens an hour in chunks of 5, served to `eu`
/// with `fallback_per_region` tokens of fallback.
async fn allocator_with_pool(
    etcd: &allot_testkit::EtcdCluster,
    pki: &TestPki,
    allow_private: bool,
    fallback_per_region: u64,
) -> common::Server {
    let server = common::start_with(common::Options {
        webhook_ca: Some(pki.ca()),
        webhook_allow_private: allow_private,
        etcd: etcd.endpoints(),
        ..Default::default()
    })
    .await;
    let put = server
        .client
        .put(format!("{}/v1/pools/acme/api", server.url))
        .bearer_auth(OPERATOR)
        .json(
            &json!({ "limit": 10, "windowMs": 3_600_000, "chunk": 5, "leaseTtlMs": 60_000,
                       "fallbackPerRegion": fallback_per_region, "regions": ["eu"] }),
        )
        .send()
        .await
        .expect("put pool");
    assert_eq!(put.status(), 200);
    server
}

/// A receiver on a free loopback port: its address, what it hears, and the sender that stops it.
async fn receiver(
    pki: &TestPki,
) -> (
    std::net::SocketAddr,
    Received,
    tokio::sync::oneshot::Sender<()>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let address = listener.local_addr().expect("addr");
    let received: Received = Arc::default();
    let (stop, stopped) = tokio::sync::oneshot::channel();
    serve_receiver(listener, pki, received.clone(), stopped);
    (address, received, stop)
}

/// Whether `header` (`t=<ms>,v1=<hex>...`) holds a valid signature of `body` by `secret`.
fn signed_by(header: &str, body: &str, secret: &str) -> bool {
    let mut parts = header.split(',');
    let Some(timestamp) = parts.next().and_then(|t| t.strip_prefix("t=")) else {
        return false;
    };
    parts
        .filter_map(|p| p.strip_prefix("v1="))
        .any(|signature| {
            let mut mac =
                <Hmac<Sha256> as KeyInit>::new_from_slice(secret.as_bytes()).expect("key");
            mac.update(format!("{timestamp}.{body}").as_bytes());
            hex::encode(mac.finalize().into_bytes()) == signature
        })
}

async fn grant(server: &common::Server, lease: u128, want: u64) -> u64 {
    let body = json!({ "leaseId": allot_shared::ids::LeaseId::from_parts(1, lease),
                       "tenant": "acme", "pool": "api", "region": "eu", "want": want });
    let answer: Value = server
        .client
        .post(format!("{}/v1/grants", server.url))
        .bearer_auth(AGENT)
        .json(&body)
        .send()
        .await
        .expect("grant")
        .json()
        .await
        .expect("json");
    answer["granted"].as_u64().expect("granted")
}

/// Polls `condition` every 100 ms for up to `seconds`.
async fn within(seconds: u64, what: &str, mut condition: impl AsyncFnMut() -> bool) {
    for _ in 0..seconds * 10 {
        if condition().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("not within {seconds} s: {what}");
}

async fn deliveries(server: &common::Server, id: &str) -> Vec<Value> {
    let answer: Value = server
        .client
        .get(format!("{}/v1/webhooks/{id}/deliveries", server.url))
        .bearer_auth(OPERATOR)
        .send()
        .await
        .expect("deliveries")
        .json()
        .await
        .expect("json");
    answer["deliveries"].as_array().cloned().unwrap_or_default()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn thresholds_are_delivered_once_signed_and_retried_while_the_receiver_is_down() {
    let pki = TestPki::generate();
    let etcd = allot_testkit::EtcdCluster::single();
    let server = allocator_with_pool(&etcd, &pki, true, 0).await;
    let (address, received, stop) = receiver(&pki).await;

    let created = server
        .client
        .post(format!("{}/v1/webhooks", server.url))
        .bearer_auth(OPERATOR)
        .json(
            &json!({ "url": format!("https://{address}/hook"), "tenant": "acme",
                       "thresholdsPct": [100, 50] }),
        )
        .send()
        .await
        .expect("create");
    assert_eq!(created.status(), 201);
    let created: Value = created.json().await.expect("json");
    let id = created["id"].as_str().expect("id").to_owned();
    let first_secret = created["secret"].as_str().expect("secret").to_owned();
    assert_eq!(created["thresholdsPct"], json!([50, 100]));
    let listed: Value = server
        .client
        .get(format!("{}/v1/webhooks", server.url))
        .bearer_auth(OPERATOR)
        .send()
        .await
        .expect("list")
        .json()
        .await
        .expect("json");
    assert!(
        !listed.to_string().contains(&first_secret),
        "a list never shows the secret"
    );

    // Half the pool granted: the 50 % event, once, signed.
    assert_eq!(grant(&server, 1, 5).await, 5);
    within(15, "the 50 % event delivered", async || {
        !received.lock().expect("received").is_empty()
    })
    .await;
    {
        let received = received.lock().expect("received");
        let (headers, body) = &received[0];
        let event: Value = serde_json::from_str(body).expect("event json");
        assert_eq!(event["type"], "quota.threshold");
        assert_eq!(event["thresholdPct"], 50);
        assert_eq!(
            (event["tenant"].as_str(), event["pool"].as_str()),
            (Some("acme"), Some("api"))
        );
        assert_eq!(
            (event["granted"].as_u64(), event["limit"].as_u64()),
            (Some(5), Some(10))
        );
        assert_eq!(
            headers["allot-event-id"],
            event["eventId"].as_str().expect("id")
        );
        let signature = headers["allot-signature"].to_str().expect("ascii");
        assert!(signed_by(signature, body, &first_secret), "{signature}");
        assert!(!signed_by(signature, body, "whsec_someone-else"));
    }

    // The receiver goes away; the pool runs out: the 100 % event is retried, with backoff.
    stop.send(()).expect("stop");
    tokio::time::sleep(Duration::from_millis(200)).await;
    assert_eq!(grant(&server, 2, 5).await, 5);
    within(
        20,
        "the 100 % event tried twice and still pending",
        async || {
            deliveries(&server, &id).await.iter().any(|d| {
                d["event"]["thresholdPct"] == 100
                    && d["state"] == "pending"
                    && d["attempts"].as_u64() >= Some(2)
                    && d["lastError"].is_string()
            })
        },
    )
    .await;

    // A rotation meanwhile: both secrets sign until the old one's overlap ends.
    let rotated: Value = server
        .client
        .post(format!("{}/v1/webhooks/{id}/rotate-secret", server.url))
        .bearer_auth(OPERATOR)
        .send()
        .await
        .expect("rotate")
        .json()
        .await
        .expect("json");
    let second_secret = rotated["secret"].as_str().expect("secret").to_owned();
    assert_ne!(second_secret, first_secret);
    assert!(rotated["previousSecretUntilMs"].as_u64().is_some());

    // Back on the same address: delivered once.
    let listener = tokio::net::TcpListener::bind(address)
        .await
        .expect("rebind");
    let (_stop, stopped) = tokio::sync::oneshot::channel();
    serve_receiver(listener, &pki, received.clone(), stopped);
    within(
        40,
        "the 100 % event delivered after the receiver came back",
        async || received.lock().expect("received").len() >= 2,
    )
    .await;
    // Two more sweeps find the same crossings: nothing is delivered again.
    tokio::time::sleep(Duration::from_secs(11)).await;
    let received = received.lock().expect("received").clone();
    assert_eq!(received.len(), 2, "each threshold once");
    let (headers, body) = &received[1];
    let event: Value = serde_json::from_str(body).expect("event json");
    assert_eq!(event["thresholdPct"], 100);
    let signature = headers["allot-signature"].to_str().expect("ascii");
    assert!(signed_by(signature, body, &second_secret), "{signature}");
    assert!(
        signed_by(signature, body, &first_secret),
        "the old secret still signs"
    );
    let states: Vec<Value> = deliveries(&server, &id).await;
    assert_eq!(states.len(), 2);
    assert!(
        states.iter().all(|d| d["state"] == "delivered"),
        "{states:?}"
    );
    let retried = states
        .iter()
        .find(|d| d["event"]["thresholdPct"] == 100)
        .expect("100 %");
    assert!(retried["attempts"].as_u64() >= Some(3), "{retried}");

    // Deleting the webhook removes it and its events.
    let deleted = server
        .client
        .delete(format!("{}/v1/webhooks/{id}", server.url))
        .bearer_auth(OPERATOR)
        .send()
        .await
        .expect("delete");
    assert_eq!(deleted.status(), 204);
    let gone = server
        .client
        .get(format!("{}/v1/webhooks/{id}/deliveries", server.url))
        .bearer_auth(OPERATOR)
        .send()
        .await
        .expect("deliveries");
    assert_eq!(gone.status(), 404);
}

#[tokio::test]
async fn registrations_are_checked_and_bounded_by_role() {
    let server = common::start().await;
    let post = |token: &'static str, body: Value| {
        server
            .client
            .post(format!("{}/v1/webhooks", server.url))
            .bearer_auth(token)
            .json(&body)
            .send()
    };
    for (body, field) in [
        (
            json!({ "url": "http://hooks.example/", "tenant": "acme" }),
            "url",
        ),
        (
            json!({ "url": "https://hooks.example/", "tenant": "Acme" }),
            "tenant",
        ),
        (
            json!({ "url": "https://hooks.example/", "tenant": "acme", "thresholdsPct": [0] }),
            "thresholdsPct[0]",
        ),
        (
            json!({ "url": "https://hooks.example/", "tenant": "acme", "thresholdsPct": [90, 90] }),
            "thresholdsPct",
        ),
    ] {
        let refused = post(OPERATOR, body).await.expect("post");
        assert_eq!(refused.status(), 400);
        let problem: Value = refused.json().await.expect("problem");
        assert_eq!(problem["field"], field);
    }
    let viewer = post(
        common::VIEWER,
        json!({ "url": "https://hooks.example/", "tenant": "acme" }),
    )
    .await
    .expect("post");
    assert_eq!(viewer.status(), 403, "a viewer registers nothing");
    let ahead_of_its_pool = post(
        OPERATOR,
        json!({ "url": "https://hooks.example/", "tenant": "acme", "pool": "nowhere" }),
    )
    .await
    .expect("post");
    assert_eq!(
        ahead_of_its_pool.status(),
        404,
        "a webhook on a pool that does not exist"
    );
    let problem: Value = ahead_of_its_pool.json().await.expect("problem");
    assert_eq!(problem["field"], "pool");
    let listed: Value = server
        .client
        .get(format!("{}/v1/webhooks", server.url))
        .bearer_auth(OPERATOR)
        .send()
        .await
        .expect("list")
        .json()
        .await
        .expect("list");
    assert_eq!(
        listed["webhooks"].as_array().map(Vec::len),
        Some(0),
        "nothing refused is registered: {listed}"
    );
    let tenant_wide = post(
        OPERATOR,
        json!({ "url": "https://hooks.example/", "tenant": "newcomer" }),
    )
    .await
    .expect("post");
    assert_eq!(
        tenant_wide.status(),
        201,
        "a webhook on every pool of a tenant needs no pool yet"
    );
    let malformed = server
        .client
        .delete(format!("{}/v1/webhooks/not-an-id", server.url))
        .bearer_auth(OPERATOR)
        .send()
        .await
        .expect("delete");
    assert_eq!(malformed.status(), 400);
}

/// A region cut off from the allocator admits beyond its grants: what its agents admitted in
/// fallback, every agent's counted, reaches a threshold as grants do.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn fallback_admits_of_every_agent_count_towards_a_threshold() {
    let pki = TestPki::generate();
    let etcd = allot_testkit::EtcdCluster::single();
    let server = allocator_with_pool(&etcd, &pki, true, 8).await;
    let (address, received, _stop) = receiver(&pki).await;
    let created = server
        .client
        .post(format!("{}/v1/webhooks", server.url))
        .bearer_auth(OPERATOR)
        .json(
            &json!({ "url": format!("https://{address}/hook"), "tenant": "acme",
                       "thresholdsPct": [80] }),
        )
        .send()
        .await
        .expect("create");
    assert_eq!(created.status(), 201);

    // Nothing granted; eu's two agents each report 4 admitted in fallback: 8 of 10.
    let now_ms = allot_allocator::clock::Clock::now_ms(&allot_allocator::clock::SystemClock);
    let window_start_ms = now_ms - now_ms % 3_600_000;
    for agent in ["eu-a", "eu-b"] {
        let report = json!({ "reportId": format!("r-{agent}"), "region": "eu", "tenant": "acme",
            "pool": "api", "windowStartMs": window_start_ms, "fallbackAdmitted": 4,
            "agentId": agent,
            "incarnation": allot_shared::ids::AgentIncarnation::from_parts(now_ms, 1) });
        let answer = server
            .client
            .post(format!("{}/v1/reports", server.url))
            .bearer_auth(AGENT)
            .json(&report)
            .send()
            .await
            .expect("report");
        assert_eq!(
            answer.status(),
            200,
            "{}",
            answer.text().await.unwrap_or_default()
        );
    }
    within(15, "the 80 % event delivered", async || {
        !received.lock().expect("received").is_empty()
    })
    .await;
    let received = received.lock().expect("received").clone();
    let event: Value = serde_json::from_str(&received[0].1).expect("event json");
    assert_eq!(event["thresholdPct"], 80);
    assert_eq!(
        (
            event["granted"].as_u64(),
            event["fallbackAdmitted"].as_u64()
        ),
        (Some(0), Some(8)),
        "{event}"
    );
}

/// Without `--webhook-allow-private`, a webhook reaches only public addresses: one naming a
/// loopback address is refused at registration, and one naming a host that resolves to loopback
/// is registered but never sent, its attempts saying why, the receiver hearing nothing.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn webhooks_reach_only_public_addresses_unless_the_operator_allows_private_ones() {
    let pki = TestPki::generate();
    let etcd = allot_testkit::EtcdCluster::single();
    let server = allocator_with_pool(&etcd, &pki, false, 0).await;
    let (address, received, _stop) = receiver(&pki).await;
    let port = address.port();
    let register = |url: String| {
        server
            .client
            .post(format!("{}/v1/webhooks", server.url))
            .bearer_auth(OPERATOR)
            .json(&json!({ "url": url, "tenant": "acme", "pool": "api", "thresholdsPct": [50] }))
            .send()
    };

    for literal in [
        format!("https://127.0.0.1:{port}/hook"),
        format!("https://[::1]:{port}/hook"),
    ] {
        let refused = register(literal.clone()).await.expect("post");
        assert_eq!(refused.status(), 400, "{literal}");
        let problem: Value = refused.json().await.expect("problem");
        assert_eq!(problem["field"], "url", "{literal}");
    }
    let by_name = register(format!("https://localhost:{port}/hook"))
        .await
        .expect("post");
    assert_eq!(
        by_name.status(),
        201,
        "a name is checked when it is resolved"
    );
    let id = by_name.json::<Value>().await.expect("json")["id"]
        .as_str()
        .expect("id")
        .to_owned();

    assert_eq!(grant(&server, 1, 5).await, 5);
    within(20, "a delivery attempted and refused", async || {
        deliveries(&server, &id).await.iter().any(|delivery| {
            delivery["attempts"].as_u64() >= Some(1)
                && delivery["lastError"]
                    .as_str()
                    .is_some_and(|error| error.contains("no public address"))
        })
    })
    .await;
    let attempted = deliveries(&server, &id).await;
    assert!(
        attempted
            .iter()
            .all(|delivery| delivery["state"] != "delivered"),
        "{attempted:?}"
    );
    assert!(
        received.lock().expect("received").is_empty(),
        "nothing reaches a loopback receiver"
    );
}
