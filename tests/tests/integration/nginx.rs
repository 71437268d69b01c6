//! nginx as a second real gateway: the shipped `deploy/nginx/allot.conf.template`, rendered as
//! envsubst would, in a real nginx in front of an application, asking a real agent (over TLS, on a
//! real Redis, spending a real allocator's pool on a real etcd) about every request through
//! `auth_request`.
//!
//! What a caller sees: the application's answer while the quota lasts; then 429 problem+json with
//! a whole-seconds Retry-After; 503 when a fail-closed rule cannot be decided; the chosen fail mode
//! when the agent cannot be reached. Identity comes only from the keys file: forged `X-Allot-*`
//! headers change nothing.

use std::sync::{Arc, Mutex};

use allot_region_agent::http::serve;
use allot_testkit::{EtcdCluster, Nginx, RedisServer, TEST_SERVER_NAME, TestPki};
use axum::extract::State;
use axum::http::HeaderMap;
use serde_json::{Value, json};

use crate::stack;

use crate::stack::{GATEWAY, put_pool, start_allocator};

/// G: the global pool's tokens per (hour-long) window.
const POOL_LIMIT: u64 = 6;
/// Requests an anonymous address may make a minute.
const ANONYMOUS_LIMIT: u64 = 2;

const TEMPLATE: &str = include_str!("../../../deploy/nginx/allot.conf.template");
const APP_PROXY: &str = include_str!("../../../deploy/nginx/allot-app-proxy.conf");

/// The verified callers: API key, then client id.
const KEYS: &str = "key-of-ci-client-0001 ci-client;\n";
const KEY: &str = "key-of-ci-client-0001";

/// What the application saw of one request it served.
#[derive(Debug, Clone)]
struct Served {
    client: Option<String>,
    api_key: Option<String>,
    method: String,
    body: String,
}

type Log = Arc<Mutex<Vec<Served>>>;

/// The application behind nginx: answers 200 and records what reached it.
async fn start_app() -> (String, Log) {
    async fn serve_one(
        State(log): State<Log>,
        method: axum::http::Method,
        headers: HeaderMap,
        body: String,
    ) -> &'static str {
        let header = |name: &str| {
            headers
                .get(name)
                .and_then(|v| v.to_str().ok())
                .map(str::to_owned)
        };
        log.lock().expect("log").push(Served {
            client: header("x-allot-client"),
            api_key: header("x-api-key"),
            method: method.to_string(),
            body,
        });
        "from the app\n"
    }
    let log: Log = Arc::default();
    let app = axum::Router::new()
        .fallback(serve_one)
        .with_state(log.clone());
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let address = listener.local_addr().expect("addr").to_string();
    tokio::spawn(async move { axum::serve(listener, app).await });
    (address, log)
}

/// What the template's `${NAME}`s are set to.
struct Render<'a> {
    app: &'a str,
    agent: &'a str,
    ca: &'a std::path::Path,
    gateway_token: &'a str,
    when_undecided: &'a str,
}

/// Starts nginx with the shipped template rendered as envsubst does (only the `ALLOT_*` names;
/// nginx's own `$variables` stay), after checking no placeholder is left.
fn start_nginx(render: &Render<'_>) -> Nginx {
    let files = [
        ("allot-app-proxy.conf", APP_PROXY.to_owned()),
        ("api-keys.map", KEYS.to_owned()),
    ];
    let ca = render.ca.display().to_string();
    Nginx::start(&files, |port| {
        let listen = format!("127.0.0.1:{port}");
        let values = [
            ("ALLOT_LISTEN", listen.as_str()),
            ("ALLOT_APP", render.app),
            ("ALLOT_AGENT", render.agent),
            ("ALLOT_AGENT_TLS_NAME", TEST_SERVER_NAME),
            ("ALLOT_AGENT_CA", ca.as_str()),
            ("ALLOT_GATEWAY_TOKEN", render.gateway_token),
            ("ALLOT_TENANT", "atlas"),
            ("ALLOT_API_KEYS", "api-keys.map"),
            ("ALLOT_WHEN_UNDECIDED", render.when_undecided),
        ];
        let mut conf = TEMPLATE.to_owned();
        for (name, value) in values {
            let placeholder = format!("${{{name}}}");
            assert!(
                conf.contains(&placeholder),
                "the template uses {placeholder}"
            );
            conf = conf.replace(&placeholder, value);
        }
        assert!(
            !conf.contains("${ALLOT_"),
            "a placeholder the test does not know is left"
        );
        conf
    })
}

/// The site's rules: anonymous addresses limited on the region's Redis, and each client's requests
/// spending the global pool `api` (when `global`; else limited per client on Redis).
fn bundle(global: bool) -> allot_shared::policy::PolicyBundle {
    let clients = if global {
        // Idempotent, as docs/gateways.md advises: nginx retries a subrequest with the same id.
        json!({ "id": "global-api", "scope": "global", "pool": "api", "failMode": "closed",
                "expose": true, "idempotent": true })
    } else {
        json!({ "id": "per-client", "scope": "user", "principalType": "api_key",
                "algorithm": "token_bucket", "capacityMillis": 100_000, "refillMillis": 100_000,
                "periodMs": 1000, "failMode": "closed" })
    };
    stack::bundle(&json!({ "rules": [
        { "id": "anonymous", "scope": "user", "principalType": "ip", "algorithm": "fixed_window",
          "limit": ANONYMOUS_LIMIT, "windowMs": 60_000, "failMode": "closed" },
        clients
    ]}))
}

/// The agent's HTTP API over TLS with the test PKI's server certificate; its `host:port`.
async fn serve_agent_tls(agent: Arc<allot_region_agent::service::Agent>, pki: &TestPki) -> String {
    let tls = allot_net::ServerTls {
        cert: pki.server_cert(),
        key: pki.server_key(),
        client_ca: None,
    }
    .acceptor()
    .expect("tls");
    let (listener, url) = stack::listener().await;
    tokio::spawn(serve(
        listener,
        stack::api(agent),
        Some(tls),
        std::future::pending(),
    ));
    url.trim_start_matches("http://").to_owned()
}

/// What a caller saw of one request through nginx.
#[derive(Debug)]
struct Answer {
    status: u16,
    retry_after: Option<String>,
    content_type: Option<String>,
    rate_limit_policy: Option<String>,
    body: String,
}

/// One GET through nginx, with the API key `key` if any and `extra` headers.
async fn call(
    http: &reqwest::Client,
    url: &str,
    key: Option<&str>,
    extra: &[(&str, &str)],
) -> Answer {
    let mut request = http.get(format!("{url}/orders"));
    if let Some(key) = key {
        request = request.header("x-api-key", key);
    }
    for (name, value) in extra {
        request = request.header(*name, *value);
    }
    let answer = request.send().await.expect("through nginx");
    let header = |name: &str| {
        answer
            .headers()
            .get(name)
            .and_then(|v| v.to_str().ok())
            .map(str::to_owned)
    };
    Answer {
        status: answer.status().as_u16(),
        retry_after: header("retry-after"),
        content_type: header("content-type"),
        rate_limit_policy: header("ratelimit-policy"),
        body: answer.text().await.unwrap_or_default(),
    }
}

/// Asserts a refusal nginx built: `status`, a whole number of seconds to wait, problem+json.
fn assert_refused(answer: &Answer, status: u16) {
    assert_eq!(answer.status, status, "{answer:?}");
    let seconds: u64 = answer
        .retry_after
        .as_deref()
        .and_then(|s| s.parse().ok())
        .expect("a Retry-After in whole seconds");
    assert!(seconds >= 1, "Retry-After {seconds}");
    assert_eq!(
        answer.content_type.as_deref(),
        Some("application/problem+json")
    );
    let problem: Value = serde_json::from_str(&answer.body).expect("problem json");
    assert_eq!(problem["status"], status);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_admits_until_the_global_pool_is_spent_then_answers_429() {
    let etcd = EtcdCluster::single();
    let redis = RedisServer::start();
    let pki = TestPki::generate();
    let dir = tempfile::tempdir().expect("temp dir");
    let allocator = start_allocator(&etcd, dir.path()).await;
    put_pool(
        &allocator,
        "atlas",
        "api",
        &json!({ "limit": POOL_LIMIT, "windowMs": 3_600_000, "chunk": 2, "leaseTtlMs": 60_000,
                 "fallbackPerRegion": 0, "regions": ["eu"] }),
    )
    .await;
    let agent = stack::agent("eu", &allocator, &redis, bundle(true)).await;
    let agent_address = serve_agent_tls(agent, &pki).await;
    let (app, served) = start_app().await;
    let nginx = start_nginx(&Render {
        app: &app,
        agent: &agent_address,
        ca: &pki.ca(),
        gateway_token: GATEWAY,
        when_undecided: "@allot_fail_closed",
    });
    let http = stack::http();
    let url = nginx.url();

    // A verified client spends the global pool; a forged identity header changes nothing, and a
    // POST's body reaches the application whole.
    let forged = [
        ("x-allot-tenant", "someone-else"),
        ("x-allot-client", "admin"),
    ];
    let mut admitted = 0;
    for _ in 0..POOL_LIMIT {
        let answer = call(&http, &url, Some(KEY), &forged).await;
        assert_eq!(answer.status, 200, "{answer:?}\n{}", nginx.log());
        assert_eq!(answer.body, "from the app\n");
        // The pool's quota, which the rule exposes, reaches the caller.
        let policy = answer.rate_limit_policy.expect("RateLimit-Policy");
        assert!(policy.contains(&format!("q={POOL_LIMIT}")), "{policy}");
        admitted += 1;
    }
    let refused = call(&http, &url, Some(KEY), &[]).await;
    assert_refused(&refused, 429);
    let posted = http
        .post(format!("{url}/orders"))
        .header("x-api-key", KEY)
        .body("an order")
        .send()
        .await
        .expect("post");
    assert_eq!(posted.status(), 429, "writes spend the same pool");
    {
        let served = served.lock().expect("log");
        assert_eq!(
            served.len(),
            admitted,
            "the application saw only admissions"
        );
        assert!(
            served
                .iter()
                .all(|s| s.client.as_deref() == Some("ci-client"))
        );
        assert!(
            served.iter().all(|s| s.api_key.is_none()),
            "the key stops at nginx"
        );
    }

    // Anonymous callers are limited by address before they are known; an unknown key is anonymous,
    // and a forged client header does not make it known.
    for i in 0..ANONYMOUS_LIMIT {
        let key = (i == 0).then_some("not-a-key");
        let answer = call(&http, &url, key, &[("x-allot-client", "admin")]).await;
        assert_eq!(answer.status, 200, "{answer:?}");
        assert!(
            answer.rate_limit_policy.is_none(),
            "anonymous callers learn no limits"
        );
    }
    assert_refused(&call(&http, &url, None, &[]).await, 429);
    {
        let served = served.lock().expect("log");
        let anonymous = &served[admitted..];
        assert_eq!(anonymous.len() as u64, ANONYMOUS_LIMIT);
        assert!(
            anonymous.iter().all(|s| s.client.is_none()),
            "{anonymous:?}"
        );
        assert!(
            anonymous
                .iter()
                .all(|s| s.method == "GET" && s.body.is_empty())
        );
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_answers_503_when_a_fail_closed_rule_cannot_be_decided() {
    let pki = TestPki::generate();
    let mut redis = RedisServer::start();
    let (app, served) = start_app().await;
    // Regional rules only: no allocator is needed (nothing listens at its address).
    let agent = stack::agent("eu", "http://127.0.0.1:9", &redis, bundle(false)).await;
    let agent_address = serve_agent_tls(agent, &pki).await;
    let nginx = start_nginx(&Render {
        app: &app,
        agent: &agent_address,
        ca: &pki.ca(),
        gateway_token: GATEWAY,
        when_undecided: "@allot_fail_closed",
    });
    let http = stack::http();
    let answer = call(&http, &nginx.url(), Some(KEY), &[]).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    // The store gone: the fail-closed rule cannot be decided, and nginx says 503 with a wait.
    redis.stop();
    assert_refused(&call(&http, &nginx.url(), Some(KEY), &[]).await, 503);
    assert_refused(&call(&http, &nginx.url(), None, &[]).await, 503);
    assert_eq!(served.lock().expect("log").len(), 1, "nothing let through");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_without_an_answer_from_the_agent_fails_as_configured() {
    let pki = TestPki::generate();
    let (app, served) = start_app().await;
    // An address nothing listens on.
    let (listener, dead) = stack::listener().await;
    drop(listener);
    let dead = dead.trim_start_matches("http://").to_owned();
    let http = stack::http();

    let closed = start_nginx(&Render {
        app: &app,
        agent: &dead,
        ca: &pki.ca(),
        gateway_token: GATEWAY,
        when_undecided: "@allot_fail_closed",
    });
    let answer = call(&http, &closed.url(), Some(KEY), &[]).await;
    assert_refused(&answer, 503);
    assert_eq!(answer.retry_after.as_deref(), Some("1"));
    assert!(served.lock().expect("log").is_empty());

    let open = start_nginx(&Render {
        app: &app,
        agent: &dead,
        ca: &pki.ca(),
        gateway_token: GATEWAY,
        when_undecided: "@allot_fail_open",
    });
    let answer = call(&http, &open.url(), Some(KEY), &[]).await;
    assert_eq!(answer.status, 200, "{answer:?}");
    assert_eq!(served.lock().expect("log").len(), 1);
    assert!(
        open.log().contains("auth request unexpected status"),
        "a fail-open admission is in nginx's log: {}",
        open.log()
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn nginx_with_a_wrong_gateway_token_never_admits() {
    let pki = TestPki::generate();
    let redis = RedisServer::start();
    let (app, served) = start_app().await;
    let agent = stack::agent("eu", "http://127.0.0.1:9", &redis, bundle(false)).await;
    let agent_address = serve_agent_tls(agent, &pki).await;
    let nginx = start_nginx(&Render {
        app: &app,
        agent: &agent_address,
        ca: &pki.ca(),
        gateway_token: "not-the-gateway-token-0001",
        when_undecided: "@allot_fail_closed",
    });
    let answer = call(&stack::http(), &nginx.url(), Some(KEY), &[]).await;
    assert_refused(&answer, 503);
    assert!(served.lock().expect("log").is_empty());
}
