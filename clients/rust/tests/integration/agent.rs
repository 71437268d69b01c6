//! The client and the layer against a real agent on a real Redis: every endpoint, refusals as the
//! caller sees them, slots given back and metered costs settled when responses end, retries that
//! keep their request id, and the fail modes without an agent.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::common::{GATEWAY, listener, start_agent};
use allot_client::{
    Admission, AdmissionRequest, AgentClient, AllotLayer, ClientError, FailMode, MeteredCost,
    Principal, PrincipalType, QuotaQuery, RouteGroup, SettleRequest, TenantId,
};
use allot_shared::ids::DecisionId;
use allot_testkit::RedisServer;
use axum::extract::{Extension, State};

fn client(url: &str) -> AgentClient {
    AgentClient::builder(url, GATEWAY)
        .call_timeout(Duration::from_secs(2))
        .build()
        .expect("client")
}

fn user(id: &str) -> Principal {
    Principal {
        kind: PrincipalType::User,
        id: id.to_owned(),
        api_key_id: None,
    }
}

fn request(id: &str, who: &str, route: &str) -> AdmissionRequest {
    AdmissionRequest {
        request_id: DecisionId::parse(id).expect("id"),
        tenant_id: TenantId::parse("atlas").expect("tenant"),
        principal: user(who),
        route_group: RouteGroup::parse(route).expect("route"),
        method: "GET".to_owned(),
        cost_hint: 1,
        policy_epoch: None,
        dry_run: false,
        metered: false,
    }
}

/// What is left of `who`'s quota under `rule`, as the agent says.
async fn remaining(client: &AgentClient, who: &str, rule: &str) -> Option<u64> {
    let status = client
        .quota(&QuotaQuery {
            tenant_id: TenantId::parse("atlas").expect("tenant"),
            principal_type: PrincipalType::User,
            principal_id: who.to_owned(),
            route_group: None,
        })
        .await
        .expect("quota");
    status
        .quotas
        .iter()
        .find(|line| line.policy_id == rule)
        .and_then(|line| line.remaining_units)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_client_speaks_every_endpoint() {
    let redis = RedisServer::start();
    let url = start_agent(&redis).await;
    let agent = client(&url);

    let decision = agent
        .admit(&request("c-1", "U-1", "read"))
        .await
        .expect("admit");
    assert!(decision.allowed, "{decision:?}");
    assert_eq!(decision.decision_id.as_str(), "c-1");
    let checked = agent
        .check(&request("c-2", "U-1", "read"))
        .await
        .expect("check");
    assert_eq!((checked.status, checked.allowed), (200, true));
    assert!(checked.caller_headers.contains_key("ratelimit-policy"));
    let refused = agent
        .check(&request("c-3", "U-1", "read"))
        .await
        .expect("check");
    assert_eq!((refused.status, refused.allowed), (429, false));
    // The minute's window, plus up to 1 s of jitter.
    assert!((1..=61).contains(&refused.retry_after_seconds().expect("Retry-After")));
    assert_eq!(
        refused.problem.as_ref().map(|p| p.status),
        Some(429),
        "the caller's problem"
    );
    assert_eq!(remaining(&agent, "U-1", "reads").await, Some(0));

    let export = request("c-4", "U-1", "export");
    assert!(agent.admit(&export).await.expect("admit").allowed);
    let renewal = agent.renew(&export).await.expect("renew");
    assert_eq!((renewal.renewed, renewal.lapsed), (1, 0));
    agent.release(&export).await.expect("release");
    assert_eq!(
        agent.renew(&export).await.expect("renew").lapsed,
        1,
        "released"
    );

    let metered = AdmissionRequest {
        cost_hint: 5,
        metered: true,
        ..request("c-5", "U-1", "summarize")
    };
    let admitted = agent.admit(&metered).await.expect("admit");
    assert!(admitted.settle_by_ms.is_some(), "{admitted:?}");
    let settlement = SettleRequest {
        decision_id: metered.request_id.clone(),
        tenant_id: metered.tenant_id.clone(),
        actual_cost_units: 12,
    };
    let answer = agent.settle(&settlement).await.expect("settle");
    assert_eq!((answer.estimate_units, answer.extra_units), (5, 7));
    assert_eq!(remaining(&agent, "U-1", "summaries").await, Some(88));
    let unknown = SettleRequest {
        decision_id: DecisionId::parse("never-admitted").expect("id"),
        ..settlement.clone()
    };
    assert_eq!(
        agent
            .settle(&unknown)
            .await
            .expect_err("nothing open")
            .refused_status(),
        Some(404)
    );

    // Bad input is refused before it is sent; a wrong token is the agent's refusal.
    let bad = AdmissionRequest {
        cost_hint: 0,
        ..request("c-6", "U-1", "read")
    };
    match agent.admit(&bad).await {
        Err(ClientError::Invalid(error)) => assert_eq!(error.field, "costHint"),
        other => panic!("sent: {other:?}"),
    }
    let stranger = AgentClient::builder(&url, "not-the-gateway-token-01")
        .build()
        .expect("client");
    assert_eq!(
        stranger
            .admit(&request("c-7", "U-1", "read"))
            .await
            .expect_err("refused")
            .refused_status(),
        Some(401)
    );
}

/// What the service behind the layer counted.
#[derive(Clone, Default)]
struct Served(Arc<Mutex<u64>>);

impl Served {
    fn count(&self) -> u64 {
        *self.0.lock().expect("count")
    }
}

/// Identity as the service's own authentication would leave it; here, for the test, a header.
fn identify(parts: &http::request::Parts) -> Option<Admission> {
    let who = parts.headers.get("x-test-user")?.to_str().ok()?;
    let route = parts.uri.path().trim_start_matches('/');
    let admission = Admission::new(
        TenantId::parse("atlas").ok()?,
        user(who),
        RouteGroup::parse(route).ok()?,
    );
    Some(match route {
        "export" => admission.releases_slots(),
        "summarize" => admission.metered(1),
        _ => admission,
    })
}

/// The service: `/read`; `/export`, whose body stays open until the test says; `/summarize`, which
/// states a cost of 30. Behind the layer, on `client`'s agent.
async fn start_service(
    client: AgentClient,
    mode: FailMode,
) -> (
    String,
    Served,
    tokio::sync::mpsc::Sender<tokio::sync::oneshot::Receiver<()>>,
) {
    use axum::routing::get;
    let served = Served::default();
    let (opens, open_rx) = tokio::sync::mpsc::channel::<tokio::sync::oneshot::Receiver<()>>(8);
    let open_rx = Arc::new(tokio::sync::Mutex::new(open_rx));
    async fn read(State(served): State<Served>) -> &'static str {
        *served.0.lock().expect("count") += 1;
        "read\n"
    }
    let export = {
        let served = served.clone();
        move || {
            let served = served.clone();
            let open_rx = open_rx.clone();
            async move {
                *served.0.lock().expect("count") += 1;
                // The body ends when the test closes it.
                let until = open_rx.lock().await.recv().await.expect("a close");
                let stream = futures::stream::once(async move {
                    let _ = until.await;
                    Ok::<_, std::io::Error>(bytes::Bytes::from_static(b"export done\n"))
                });
                axum::body::Body::from_stream(stream)
            }
        }
    };
    async fn summarize(
        State(served): State<Served>,
        Extension(cost): Extension<MeteredCost>,
    ) -> &'static str {
        *served.0.lock().expect("count") += 1;
        cost.set(30);
        "summary\n"
    }
    let app = axum::Router::new()
        .route("/read", get(read))
        .route("/export", get(export))
        .route("/summarize", get(summarize))
        .with_state(served.clone())
        .layer(AllotLayer::new(client, identify).when_undecided(mode));
    let (listener, url) = listener().await;
    tokio::spawn(async move { axum::serve(listener, app).await });
    (url, served, opens)
}

fn http() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("http")
}

async fn get(http: &reqwest::Client, url: &str, path: &str, who: &str) -> reqwest::Response {
    http.get(format!("{url}{path}"))
        .header("x-test-user", who)
        .send()
        .await
        .expect("service")
}

/// Polls `condition` every 20 ms for up to 5 s (completions run after the response ends).
async fn eventually(what: &str, mut condition: impl AsyncFnMut() -> bool) {
    for _ in 0..250 {
        if condition().await {
            return;
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    panic!("not within 5 s: {what}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_admits_and_answers_refusals_as_the_agent_words_them() {
    let redis = RedisServer::start();
    let agent_url = start_agent(&redis).await;
    let (url, served, _opens) = start_service(client(&agent_url), FailMode::Closed).await;
    let http = http();
    for _ in 0..2 {
        let admitted = get(&http, &url, "/read", "U-2").await;
        assert_eq!(admitted.status(), 200);
        assert_eq!(admitted.headers()["ratelimit-policy"], "\"reads\";q=2;w=60");
        assert!(admitted.headers().get("retry-after").is_none());
    }
    let refused = get(&http, &url, "/read", "U-2").await;
    assert_eq!(refused.status(), 429);
    assert_eq!(
        refused.headers()["content-type"],
        "application/problem+json"
    );
    let seconds: u64 = refused.headers()["retry-after"]
        .to_str()
        .expect("ascii")
        .parse()
        .expect("whole seconds");
    assert!(
        (1..=61).contains(&seconds),
        "the minute's window, plus up to 1 s of jitter"
    );
    assert!(refused.headers().contains_key("ratelimit"));
    let problem: serde_json::Value = refused.json().await.expect("problem");
    assert_eq!(problem["status"], 429);
    assert_eq!(served.count(), 2, "the service saw only admissions");
    // A request the identify function does not limit goes straight through.
    let anonymous = http
        .get(format!("{url}/read"))
        .send()
        .await
        .expect("service");
    assert_eq!(anonymous.status(), 200);
    assert_eq!(served.count(), 3);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_gives_slots_back_when_responses_end_or_are_abandoned() {
    let redis = RedisServer::start();
    let agent_url = start_agent(&redis).await;
    let (url, _served, opens) = start_service(client(&agent_url), FailMode::Closed).await;
    let http = http();

    // The first export holds the user's one slot while its body is open.
    let (close, until) = tokio::sync::oneshot::channel();
    opens.send(until).await.expect("open");
    let first = get(&http, &url, "/export", "U-3").await;
    assert_eq!(first.status(), 200);
    let second = get(&http, &url, "/export", "U-3").await;
    assert_eq!(second.status(), 429, "one at a time");
    // The body ends: the slot comes back.
    close.send(()).expect("close");
    assert_eq!(first.text().await.expect("body"), "export done\n");
    let (close, until) = tokio::sync::oneshot::channel();
    opens.send(until).await.expect("open");
    let mut third = None;
    eventually("the slot given back when the body ended", async || {
        let answer = get(&http, &url, "/export", "U-3").await;
        let admitted = answer.status() == 200;
        if admitted {
            third = Some(answer);
        }
        admitted
    })
    .await;
    // Abandoned mid-body (the caller goes away while the service would still send): the slot
    // comes back too.
    let _still_open = close;
    drop(third);
    let (_close, until) = tokio::sync::oneshot::channel();
    opens.send(until).await.expect("open");
    eventually(
        "the slot given back when the caller went away",
        async || get(&http, &url, "/export", "U-3").await.status() == 200,
    )
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_layer_settles_the_cost_a_service_states() {
    let redis = RedisServer::start();
    let agent_url = start_agent(&redis).await;
    let agent = client(&agent_url);
    let (url, served, _opens) = start_service(agent.clone(), FailMode::Closed).await;
    let answer = get(&http(), &url, "/summarize", "U-4").await;
    assert_eq!(answer.status(), 200);
    assert_eq!(answer.text().await.expect("body"), "summary\n");
    assert_eq!(served.count(), 1);
    // Estimated 1, stated 30: 70 of 100 left once settled.
    eventually("the stated cost settled", async || {
        remaining(&agent, "U-4", "summaries").await == Some(70)
    })
    .await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_an_agent_the_layer_fails_as_told() {
    let (dead_listener, dead) = listener().await;
    drop(dead_listener);
    let unreachable = AgentClient::builder(&dead, GATEWAY)
        .call_timeout(Duration::from_millis(300))
        .max_attempts(2)
        .build()
        .expect("client");
    let http = http();

    let (closed, served, _opens) = start_service(unreachable.clone(), FailMode::Closed).await;
    let refused = get(&http, &closed, "/read", "U-5").await;
    assert_eq!(refused.status(), 503);
    assert_eq!(refused.headers()["retry-after"], "1");
    assert_eq!(
        refused.headers()["content-type"],
        "application/problem+json"
    );
    assert_eq!(served.count(), 0);

    let (open, served, _opens) = start_service(unreachable, FailMode::Open).await;
    assert_eq!(get(&http, &open, "/read", "U-5").await.status(), 200);
    assert_eq!(served.count(), 1);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_retry_keeps_its_request_id_so_an_idempotent_rule_charges_once() {
    let redis = RedisServer::start();
    let agent_url = start_agent(&redis).await;
    // Between the client and the agent: passes every call on, but loses the agent's first answer
    // (502), after the agent has decided it.
    let seen: Arc<Mutex<Vec<String>>> = Arc::default();
    let front = {
        let seen = seen.clone();
        let agent_url = agent_url.clone();
        let forward = reqwest::Client::new();
        axum::Router::new().fallback(
            move |method: http::Method,
                  uri: http::Uri,
                  headers: http::HeaderMap,
                  body: bytes::Bytes| {
                let seen = seen.clone();
                let agent_url = agent_url.clone();
                let forward = forward.clone();
                async move {
                    let mut call = forward.request(method, format!("{agent_url}{uri}"));
                    for (name, value) in &headers {
                        if name != http::header::HOST {
                            call = call.header(name, value);
                        }
                    }
                    let answer = call.body(body.clone()).send().await.expect("agent");
                    let status = answer.status();
                    let text = answer.text().await.expect("answer");
                    let mut seen = seen.lock().expect("seen");
                    if let Ok(request) = serde_json::from_slice::<AdmissionRequest>(&body) {
                        seen.push(request.request_id.as_str().to_owned());
                    }
                    if seen.len() == 1 {
                        (http::StatusCode::BAD_GATEWAY, String::new())
                    } else {
                        (status, text)
                    }
                }
            },
        )
    };
    let (listener, front_url) = listener().await;
    tokio::spawn(async move { axum::serve(listener, front).await });
    let agent = AgentClient::builder(&front_url, GATEWAY)
        .call_timeout(Duration::from_secs(2))
        .max_attempts(2)
        .build()
        .expect("client");

    let decision = agent
        .admit(&request("o-1", "U-6", "orders"))
        .await
        .expect("admit");
    assert!(decision.allowed);
    let seen = seen.lock().expect("seen").clone();
    assert_eq!(seen, ["o-1", "o-1"], "the retry kept the request id");
    assert_eq!(
        remaining(&client(&agent_url), "U-6", "orders").await,
        Some(9),
        "charged once"
    );
}
