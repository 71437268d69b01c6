//! How the agent learns a pool's terms: one allocator call per pool however many requests arrive at
//! once, failures remembered instead of retried per request, terms refreshed in the background, and
//! idle pools forgotten. Against a stand-in allocator that counts its calls.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use allot_region_agent::allocator_client::AllocatorClient;
use allot_region_agent::service::{
    Agent, AgentSettings, POOL_IDLE_MS, TERMS_REFRESH_MS, TERMS_RETRY_MS, UNKNOWN_POOL_RETRY_MS,
};
use allot_shared::clock::ManualClock;
use allot_shared::contract::{
    AdmissionRequest, Decision, DeniedScope, Principal, PrincipalType, Reason,
};
use allot_shared::ids::{DecisionId, RouteGroup, TenantId};
use axum::Json;
use axum::extract::State;
use axum::http::StatusCode;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

use crate::common;

const GLOBAL_ONLY: &str = r#"{ "rules": [
    { "id": "global-read", "scope": "global", "routeGroup": "read", "pool": "api",
      "failMode": "closed" } ] }"#;

/// What the stand-in allocator answers, and what it was asked.
struct Fake {
    /// `G` of the terms it serves; `None`: the pool does not exist.
    limit_tokens: Mutex<Option<u64>>,
    /// How long a terms answer takes.
    terms_delay: Duration,
    terms_calls: AtomicU64,
    /// `fallbackPerRegion` of the terms.
    fallback_per_region_tokens: u64,
    /// Grants answer 503 (the allocator has lost its store): the agent is cut off from quota.
    grants_unavailable: bool,
    /// What the region already admitted in fallback this window, per the ledger.
    fallback_in_window_tokens: u64,
    /// How the agent's previous run ended, as the allocator's session record says, and when the
    /// latest run that followed an unclean end started.
    predecessor_ended_cleanly: bool,
    unclean_since_ms: Option<u64>,
    session_starts: AtomicU64,
    session_ends: AtomicU64,
    /// Whether it serves `POST /v1/reports/batch` (an older allocator does not).
    takes_batches: bool,
    /// Calls to `POST /v1/reports/batch` and `POST /v1/reports`, and the tenants reported.
    batch_calls: AtomicU64,
    single_calls: AtomicU64,
    reported_tenants: Mutex<Vec<String>>,
    /// Whether it serves `POST /v1/grants/batch` (an older allocator does not), and how long a
    /// batch takes to answer.
    takes_grant_batches: bool,
    grant_batch_delay: Duration,
    /// Calls to `POST /v1/grants/batch` and `POST /v1/grants`, and the tenants asked for.
    grant_batch_calls: AtomicU64,
    grant_calls: AtomicU64,
    granted_tenants: Mutex<Vec<String>>,
    /// Calls to routes it does not serve (answered 404), but for the shard map's.
    not_found_calls: AtomicU64,
    /// Reads of the shard map (`GET /v1/shards`, answered 404: it does not split its pools).
    shard_map_reads: AtomicU64,
    /// The `POST /v1/reports/batch` call (counted from 1) that hangs for a minute; 0: none.
    stalled_report_batch: AtomicU64,
    /// Whether it serves `POST /v1/terms/batch` (an older allocator does not); its calls, and the
    /// pools asked for by either terms route.
    takes_terms_batches: bool,
    terms_batch_calls: AtomicU64,
    terms_asked: Mutex<Vec<String>>,
}

async fn not_found(State(fake): State<Arc<Fake>>, uri: axum::http::Uri) -> Response {
    if uri.path() == "/v1/shards" {
        fake.shard_map_reads.fetch_add(1, Ordering::SeqCst);
    } else {
        fake.not_found_calls.fetch_add(1, Ordering::SeqCst);
    }
    StatusCode::NOT_FOUND.into_response()
}

async fn session_start(State(fake): State<Arc<Fake>>) -> Response {
    fake.session_starts.fetch_add(1, Ordering::SeqCst);
    Json(serde_json::json!({
        "predecessorEndedCleanly": fake.predecessor_ended_cleanly, "startedAtMs": 1_000_000,
        "uncleanSinceMs": fake.unclean_since_ms,
    }))
    .into_response()
}

async fn session_end(State(fake): State<Arc<Fake>>) -> Response {
    fake.session_ends.fetch_add(1, Ordering::SeqCst);
    Json(serde_json::json!({ "ended": true })).into_response()
}

async fn terms(
    State(fake): State<Arc<Fake>>,
    axum::extract::Path((tenant, pool)): axum::extract::Path<(String, String)>,
) -> Response {
    fake.terms_calls.fetch_add(1, Ordering::SeqCst);
    tokio::time::sleep(fake.terms_delay).await;
    match terms_of(&fake, &tenant, &pool) {
        None => StatusCode::NOT_FOUND.into_response(),
        Some(terms) => Json(terms).into_response(),
    }
}

/// The terms every pool has (`None`: no pool exists), the pool noted as asked for.
fn terms_of(fake: &Fake, tenant: &str, pool: &str) -> Option<serde_json::Value> {
    fake.terms_asked
        .lock()
        .expect("lock")
        .push(format!("{tenant}/{pool}"));
    let limit = (*fake.limit_tokens.lock().expect("lock"))?;
    Some(serde_json::json!({
        "limit": limit, "windowMs": 60_000, "chunk": 100, "leaseTtlMs": 15_000,
        "fallbackPerRegion": fake.fallback_per_region_tokens, "regions": ["eu"], "version": limit,
        // The agent's clock starts at 1,000,000 ms: its minute window starts at 960,000.
        "fallbackInWindow": { "windowStartMs": 960_000, "admitted": fake.fallback_in_window_tokens },
    }))
}

async fn terms_batch(
    State(fake): State<Arc<Fake>>,
    Json(body): Json<serde_json::Value>,
) -> Response {
    fake.terms_batch_calls.fetch_add(1, Ordering::SeqCst);
    tokio::time::sleep(fake.terms_delay).await;
    assert_eq!(body["region"], "eu", "asked as the agent's region: {body}");
    let results: Vec<serde_json::Value> = body["pools"]
        .as_array()
        .cloned()
        .unwrap_or_default()
        .iter()
        .map(|ask| {
            let (tenant, pool) = (ask["tenant"].as_str(), ask["pool"].as_str());
            match terms_of(&fake, tenant.unwrap_or_default(), pool.unwrap_or_default()) {
                Some(terms) => serde_json::json!({ "terms": terms }),
                None => serde_json::json!({ "problem": {
                    "type": "about:blank", "title": "Not Found", "status": 404,
                    "detail": "no such pool" } }),
            }
        })
        .collect();
    Json(serde_json::json!({ "results": results })).into_response()
}

/// Every grant answers "exhausted": the request is denied with the pool's `G` as its limit, which
/// shows the terms in force.
async fn grant(State(fake): State<Arc<Fake>>, Json(body): Json<serde_json::Value>) -> Response {
    fake.grant_calls.fetch_add(1, Ordering::SeqCst);
    if fake.grants_unavailable {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    Json(exhausted(&fake, &body)).into_response()
}

/// Nothing left: the answer to an ask, and the tenant noted.
fn exhausted(fake: &Fake, ask: &serde_json::Value) -> serde_json::Value {
    fake.granted_tenants
        .lock()
        .expect("lock")
        .push(ask["tenant"].as_str().unwrap_or_default().to_owned());
    serde_json::json!({
        "leaseId": ask["leaseId"], "region": ask["region"], "granted": 0, "epoch": 1,
        "windowStartMs": 0, "windowEndMs": 60_000, "expiresAtMs": 0, "retryAfterMs": 1_000,
    })
}

async fn grant_batch(
    State(fake): State<Arc<Fake>>,
    Json(body): Json<serde_json::Value>,
) -> Response {
    fake.grant_batch_calls.fetch_add(1, Ordering::SeqCst);
    if fake.grants_unavailable {
        return StatusCode::SERVICE_UNAVAILABLE.into_response();
    }
    tokio::time::sleep(fake.grant_batch_delay).await;
    let asks = body["grants"].as_array().cloned().unwrap_or_default();
    let results: Vec<serde_json::Value> = asks
        .iter()
        .map(|ask| serde_json::json!({ "grant": exhausted(&fake, ask) }))
        .collect();
    Json(serde_json::json!({ "results": results })).into_response()
}

async fn report(State(fake): State<Arc<Fake>>, Json(body): Json<serde_json::Value>) -> Response {
    fake.single_calls.fetch_add(1, Ordering::SeqCst);
    fake.reported_tenants
        .lock()
        .expect("lock")
        .push(body["tenant"].as_str().unwrap_or_default().to_owned());
    Json(serde_json::json!({ "duplicate": false })).into_response()
}

async fn report_batch(
    State(fake): State<Arc<Fake>>,
    Json(body): Json<serde_json::Value>,
) -> Response {
    let call = fake.batch_calls.fetch_add(1, Ordering::SeqCst) + 1;
    if call == fake.stalled_report_batch.load(Ordering::SeqCst) {
        tokio::time::sleep(Duration::from_secs(60)).await;
    }
    let reports = body["reports"].as_array().cloned().unwrap_or_default();
    let mut results = Vec::new();
    for report in &reports {
        fake.reported_tenants
            .lock()
            .expect("lock")
            .push(report["tenant"].as_str().unwrap_or_default().to_owned());
        results.push(serde_json::json!({ "receipt": { "duplicate": false } }));
    }
    Json(serde_json::json!({ "results": results })).into_response()
}

async fn allocator(fake: Arc<Fake>) -> Arc<AllocatorClient> {
    let mut app = axum::Router::new()
        .route("/v1/pools/{tenant}/{pool}/terms", get(terms))
        .route("/v1/grants", post(grant))
        .route("/v1/reports", post(report))
        .route("/v1/agent-sessions", post(session_start))
        .route("/v1/agent-sessions/end", post(session_end));
    if fake.takes_batches {
        app = app.route("/v1/reports/batch", post(report_batch));
    }
    if fake.takes_grant_batches {
        app = app.route("/v1/grants/batch", post(grant_batch));
    }
    if fake.takes_terms_batches {
        app = app.route("/v1/terms/batch", post(terms_batch));
    }
    let app = app.fallback(not_found);
    let app = app.with_state(fake);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let address = listener.local_addr().expect("address");
    tokio::spawn(async move { axum::serve(listener, app).await });
    Arc::new(
        AllocatorClient::new(
            vec![format!("http://{address}")],
            "agent-token-0123456789".to_owned(),
        )
        .expect("client"),
    )
}

fn fake(limit: Option<u64>, terms_delay: Duration) -> Arc<Fake> {
    Arc::new(Fake {
        limit_tokens: Mutex::new(limit),
        terms_delay,
        terms_calls: AtomicU64::new(0),
        fallback_per_region_tokens: 0,
        grants_unavailable: false,
        fallback_in_window_tokens: 0,
        predecessor_ended_cleanly: true,
        unclean_since_ms: None,
        session_starts: AtomicU64::new(0),
        session_ends: AtomicU64::new(0),
        takes_batches: true,
        batch_calls: AtomicU64::new(0),
        single_calls: AtomicU64::new(0),
        reported_tenants: Mutex::new(Vec::new()),
        takes_grant_batches: true,
        grant_batch_delay: Duration::ZERO,
        grant_batch_calls: AtomicU64::new(0),
        grant_calls: AtomicU64::new(0),
        granted_tenants: Mutex::new(Vec::new()),
        not_found_calls: AtomicU64::new(0),
        shard_map_reads: AtomicU64::new(0),
        stalled_report_batch: AtomicU64::new(0),
        takes_terms_batches: true,
        terms_batch_calls: AtomicU64::new(0),
        terms_asked: Mutex::new(Vec::new()),
    })
}

fn request(n: u64) -> AdmissionRequest {
    request_of("atlas", n)
}

fn request_of(tenant: &str, n: u64) -> AdmissionRequest {
    AdmissionRequest {
        request_id: DecisionId::parse(&format!("t-{tenant}-{n}")).expect("id"),
        tenant_id: TenantId::parse(tenant).expect("tenant"),
        principal: Principal {
            kind: PrincipalType::User,
            id: "U-1".to_owned(),
            api_key_id: None,
        },
        route_group: RouteGroup::parse("read").expect("route"),
        method: "GET".to_owned(),
        cost_hint: 1,
        policy_epoch: None,
        dry_run: false,
        metered: false,
    }
}

async fn setup(fake: &Arc<Fake>) -> (Arc<Agent>, Arc<ManualClock>) {
    setup_with(fake, common::settings()).await
}

async fn setup_with(fake: &Arc<Fake>, settings: AgentSettings) -> (Arc<Agent>, Arc<ManualClock>) {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let agent = common::agent(
        settings,
        clock.clone(),
        Some(allocator(fake.clone()).await),
        Some(common::bundle(GLOBAL_ONLY)),
    );
    (agent, clock)
}

async fn admit(agent: &Arc<Agent>, n: u64) -> Decision {
    agent.admit(&request(n)).await.expect("decision")
}

#[tokio::test]
async fn concurrent_requests_for_a_new_pool_fetch_its_terms_once() {
    let fake = fake(Some(1_000), Duration::from_millis(100));
    let (agent, _clock) = setup(&fake).await;
    let mut requests = tokio::task::JoinSet::new();
    for n in 0..32 {
        let agent = agent.clone();
        requests.spawn(async move { admit(&agent, n).await });
    }
    let decisions: Vec<Decision> = requests.join_all().await;
    assert_eq!(fake.terms_calls.load(Ordering::SeqCst), 1, "single flight");
    assert!(
        decisions.iter().any(|d| d.limit_units == 1_000),
        "the pool's terms were installed: {decisions:?}"
    );
    assert_eq!(agent.pool_counts(), (1, 0), "one pool held, no lookup left");
}

/// Forty pools met at once (a cold agent): their terms come a batch at a time, each pool asked for
/// once; an allocator without the batch route is asked one call per pool, after one 404.
#[tokio::test]
async fn pools_met_at_once_are_looked_up_a_batch_at_a_time() {
    for takes_terms_batches in [true, false] {
        let fake = Arc::new(Fake {
            takes_terms_batches,
            ..Arc::into_inner(fake(Some(1_000), Duration::from_millis(50))).expect("one owner")
        });
        let (agent, _clock) = setup(&fake).await;
        let mut requests = tokio::task::JoinSet::new();
        for tenant in 0..40 {
            let agent = agent.clone();
            requests.spawn(async move {
                let request = request_of(&format!("t{tenant:02}"), tenant);
                agent.admit(&request).await.expect("decision")
            });
        }
        let decisions: Vec<Decision> = requests.join_all().await;
        assert!(
            decisions.iter().all(|d| d.limit_units == 1_000),
            "every pool's terms installed: {decisions:?}"
        );
        assert_eq!(agent.pool_counts(), (40, 0));
        let mut asked = fake.terms_asked.lock().expect("lock").clone();
        asked.sort();
        asked.dedup();
        assert_eq!(asked.len(), 40, "each pool asked for");
        assert_eq!(
            fake.terms_asked.lock().expect("lock").len(),
            40,
            "and only once"
        );
        let (singles, batches) = (
            fake.terms_calls.load(Ordering::SeqCst),
            fake.terms_batch_calls.load(Ordering::SeqCst),
        );
        if takes_terms_batches {
            assert!(
                singles + batches <= 2,
                "{singles} single, {batches} batch calls"
            );
        } else {
            assert_eq!(singles, 40);
            assert_eq!(fake.not_found_calls.load(Ordering::SeqCst), 1, "one 404");
        }
    }
}

#[tokio::test]
async fn an_unknown_pool_is_asked_for_once_per_interval_not_per_request() {
    let fake = fake(None, Duration::ZERO);
    let (agent, clock) = setup(&fake).await;
    for n in 0..20 {
        let decision = admit(&agent, n).await;
        assert!(!decision.allowed);
        assert_eq!(decision.denied_scope, Some(DeniedScope::Global));
        assert_eq!(decision.reason, Some(Reason::LimiterUnavailable));
        assert_eq!(decision.retry_after_ms, TERMS_RETRY_MS as i64);
    }
    assert_eq!(fake.terms_calls.load(Ordering::SeqCst), 1);
    clock.advance(UNKNOWN_POOL_RETRY_MS - 1);
    admit(&agent, 20).await;
    assert_eq!(fake.terms_calls.load(Ordering::SeqCst), 1);
    // The pool is created; the next look after the interval finds it.
    *fake.limit_tokens.lock().expect("lock") = Some(700);
    clock.advance(1);
    let decision = admit(&agent, 21).await;
    assert_eq!(fake.terms_calls.load(Ordering::SeqCst), 2);
    assert_eq!(decision.limit_units, 700);
    assert_eq!(decision.reason, Some(Reason::RateExceeded));
}

#[tokio::test]
async fn held_terms_are_refreshed_in_the_background_and_idle_pools_forgotten() {
    let fake = fake(Some(1_000), Duration::ZERO);
    let (agent, clock) = setup(&fake).await;
    assert_eq!(admit(&agent, 0).await.limit_units, 1_000);
    assert_eq!(fake.terms_calls.load(Ordering::SeqCst), 1);

    // The operator halves the pool. Upkeep before the refresh interval asks nothing.
    *fake.limit_tokens.lock().expect("lock") = Some(500);
    clock.advance(TERMS_REFRESH_MS - 1);
    agent.maintain_pools().await;
    assert_eq!(fake.terms_calls.load(Ordering::SeqCst), 1);
    assert_eq!(admit(&agent, 1).await.limit_units, 1_000);
    clock.advance(1);
    agent.maintain_pools().await;
    assert_eq!(fake.terms_calls.load(Ordering::SeqCst), 2);
    assert_eq!(
        admit(&agent, 2).await.limit_units,
        500,
        "the update reached the holder"
    );

    // Demand stops: the pool is kept until it has been idle for POOL_IDLE_MS, then forgotten.
    clock.advance(POOL_IDLE_MS - 1);
    agent.maintain_pools().await;
    assert_eq!(agent.pool_counts().0, 1);
    clock.advance(1);
    agent.maintain_pools().await;
    assert_eq!(agent.pool_counts(), (0, 0));
    // A request after that looks the pool up again.
    let calls = fake.terms_calls.load(Ordering::SeqCst);
    assert_eq!(admit(&agent, 3).await.limit_units, 500);
    assert_eq!(fake.terms_calls.load(Ordering::SeqCst), calls + 1);
}

#[tokio::test]
async fn several_agents_in_a_region_share_its_fallback_allowance() {
    let fake = Arc::new(Fake {
        fallback_per_region_tokens: 10,
        grants_unavailable: true,
        ..Arc::into_inner(fake(Some(1_000), Duration::ZERO)).expect("sole owner")
    });
    let settings = AgentSettings {
        region_agents: 3,
        ..common::settings()
    };
    let (agent, _clock) = setup_with(&fake, settings).await;
    let decisions: Vec<Decision> = {
        let mut decisions = Vec::new();
        for n in 0..10 {
            decisions.push(admit(&agent, n).await);
        }
        decisions
    };
    let fallback_admits = decisions.iter().filter(|d| d.allowed && d.fallback).count();
    assert_eq!(
        fallback_admits, 3,
        "10 / 3 agents, rounded down: {decisions:?}"
    );
    let last = decisions.last().expect("ten decisions");
    assert!(!last.allowed && last.fallback);
    assert_eq!(last.reason, Some(Reason::RateExceeded));
}

#[tokio::test]
async fn a_restarted_agent_counts_the_fallback_its_region_already_admitted_this_window() {
    let fake = Arc::new(Fake {
        fallback_per_region_tokens: 10,
        grants_unavailable: true,
        fallback_in_window_tokens: 8,
        ..Arc::into_inner(fake(Some(1_000), Duration::ZERO)).expect("sole owner")
    });
    let (agent, _clock) = setup(&fake).await;
    let mut fallback_admits = 0;
    for n in 0..10 {
        let decision = admit(&agent, n).await;
        if decision.allowed && decision.fallback {
            fallback_admits += 1;
        }
    }
    assert_eq!(
        fallback_admits, 2,
        "10 allowed, 8 already admitted before the restart"
    );
}

/// The previous run of this agent crashed (the allocator's session record never saw it end), and
/// this run has no journal: that run may have admitted its whole fallback allowance of this window
/// unreported, so this run admits none in it; the next window has its allowance again.
#[tokio::test]
async fn after_an_unclean_end_the_start_window_admits_no_fallback() {
    let fake = Arc::new(Fake {
        fallback_per_region_tokens: 10,
        grants_unavailable: true,
        predecessor_ended_cleanly: false,
        unclean_since_ms: Some(1_000_000),
        ..Arc::into_inner(fake(Some(1_000), Duration::ZERO)).expect("sole owner")
    });
    let (agent, clock) = setup(&fake).await;
    for n in 0..5 {
        let decision = admit(&agent, n).await;
        assert!(
            !decision.allowed && decision.fallback,
            "the allowance counts as used: {decision:?}"
        );
        assert_eq!(decision.reason, Some(Reason::RateExceeded));
    }
    assert_eq!(
        fake.session_starts.load(Ordering::SeqCst),
        1,
        "started once"
    );
    // The next minute window (the agent's clock started at 1,000,000 ms, in the window from
    // 960,000), past the clock margin at its start.
    clock.set(1_020_000 + allot_region_agent::service::DEFAULT_CLOCK_MARGIN_MS);
    let fallback_admits = {
        let mut admitted = 0;
        for n in 5..20 {
            let decision = admit(&agent, n).await;
            admitted += u64::from(decision.allowed && decision.fallback);
        }
        admitted
    };
    assert_eq!(fallback_admits, 10, "a whole allowance in the next window");
}

/// A run ends its session when it stops with every fallback admit reported; with one unreported it
/// does not, so its successor counts the window as used.
#[tokio::test]
async fn a_session_ends_only_with_every_fallback_admit_reported() {
    let cut_off = Arc::new(Fake {
        fallback_per_region_tokens: 10,
        grants_unavailable: true,
        ..Arc::into_inner(fake(Some(1_000), Duration::ZERO)).expect("sole owner")
    });
    let (agent, _clock) = setup(&cut_off).await;
    let decision = admit(&agent, 0).await;
    assert!(decision.allowed && decision.fallback, "{decision:?}");
    assert!(
        !agent.end_session().await,
        "a fallback admit is unreported (the stand-in takes no reports)"
    );
    assert_eq!(cut_off.session_ends.load(Ordering::SeqCst), 0);

    let quiet = fake(Some(1_000), Duration::ZERO);
    let (agent, _clock) = setup(&quiet).await;
    assert_eq!(admit(&agent, 0).await.limit_units, 1_000);
    assert!(
        agent.end_session().await,
        "nothing in fallback: ends cleanly"
    );
    assert_eq!(quiet.session_ends.load(Ordering::SeqCst), 1);
}

/// The previous run ended cleanly, but the one before it crashed earlier in this window and the
/// run in between never took this pool up: nobody knows what the crashed run admitted of it. The
/// allocator names when the latest run after an unclean end started, and a window containing that
/// instant counts its allowance as used.
#[tokio::test]
async fn a_clean_end_does_not_vouch_for_an_earlier_crash_in_the_window() {
    let tainted = Arc::new(Fake {
        fallback_per_region_tokens: 10,
        grants_unavailable: true,
        predecessor_ended_cleanly: true,
        // 10 s before this run, in the same minute window (from 960,000).
        unclean_since_ms: Some(990_000),
        ..Arc::into_inner(fake(Some(1_000), Duration::ZERO)).expect("sole owner")
    });
    let (agent, _clock) = setup(&tainted).await;
    let decision = admit(&agent, 0).await;
    assert!(!decision.allowed && decision.fallback, "{decision:?}");
    // A taint from an earlier window leaves this one whole.
    let earlier = Arc::new(Fake {
        fallback_per_region_tokens: 10,
        grants_unavailable: true,
        unclean_since_ms: Some(950_000),
        ..Arc::into_inner(fake(Some(1_000), Duration::ZERO)).expect("sole owner")
    });
    let (agent, _) = setup(&earlier).await;
    let decision = admit(&agent, 0).await;
    assert!(decision.allowed && decision.fallback, "{decision:?}");
}

#[tokio::test]
async fn an_agent_holds_at_most_max_pools_and_takes_a_new_one_once_an_idle_one_is_forgotten() {
    let fake = fake(Some(1_000), Duration::ZERO);
    let settings = AgentSettings {
        max_pools: 2,
        ..common::settings()
    };
    let (agent, clock) = setup_with(&fake, settings).await;
    let for_tenant = |tenant: &str, n: u64| {
        let mut request = request(n);
        request.tenant_id = TenantId::parse(tenant).expect("tenant");
        request
    };
    for (n, tenant) in ["a", "b"].into_iter().enumerate() {
        let decision = agent
            .admit(&for_tenant(tenant, n as u64))
            .await
            .expect("decision");
        assert_eq!(decision.limit_units, 1_000, "pool {tenant} is held");
    }
    assert_eq!(agent.pool_counts().0, 2);
    // A third pool: refused as its rule fails (closed), and not held.
    let third = agent.admit(&for_tenant("c", 2)).await.expect("decision");
    assert!(!third.allowed, "{third:?}");
    assert_eq!(agent.pool_counts().0, 2, "never more than --max-pools");
    // Once the held pools have gone idle and are forgotten, the new pool is taken.
    clock.advance(POOL_IDLE_MS + TERMS_RETRY_MS);
    agent.maintain_pools().await;
    assert_eq!(agent.pool_counts().0, 0);
    let later = agent.admit(&for_tenant("c", 3)).await.expect("decision");
    assert_eq!(later.limit_units, 1_000, "{later:?}");
    assert_eq!(agent.pool_counts().0, 1);
}

/// A report round is one call for every pool that owes a report; an allocator without the batch
/// route gets the same reports one by one.
#[tokio::test]
async fn a_report_round_is_one_call_or_one_by_one_for_an_older_allocator() {
    for takes_batches in [true, false] {
        let cut_off = Arc::new(Fake {
            fallback_per_region_tokens: 10,
            grants_unavailable: true,
            takes_batches,
            ..Arc::into_inner(fake(Some(1_000), Duration::ZERO)).expect("sole owner")
        });
        let (agent, _clock) = setup(&cut_off).await;
        for tenant in ["atlas", "birch", "cedar"] {
            let decision = agent.admit(&request_of(tenant, 0)).await.expect("decision");
            assert!(decision.allowed && decision.fallback, "{decision:?}");
        }
        agent.send_reports().await;
        let mut reported = cut_off.reported_tenants.lock().expect("lock").clone();
        reported.sort();
        assert_eq!(
            reported,
            ["atlas", "birch", "cedar"],
            "every pool's fallback admit"
        );
        let calls = (
            cut_off.batch_calls.load(Ordering::SeqCst),
            cut_off.single_calls.load(Ordering::SeqCst),
        );
        if takes_batches {
            assert_eq!(calls, (1, 0), "one call for the round");
        } else {
            assert_eq!(
                calls,
                (0, 3),
                "the batch route missing: one call per report"
            );
        }
        assert!(
            agent.end_session().await,
            "every fallback admit reported: the session ends cleanly"
        );
        agent.send_reports().await;
        assert_eq!(
            cut_off.reported_tenants.lock().expect("lock").len(),
            3,
            "reports taken are not sent again"
        );
        // A later round: an older allocator is not asked for the batch route again.
        let decision = agent
            .admit(&request_of("atlas", 1))
            .await
            .expect("decision");
        assert!(decision.allowed && decision.fallback, "{decision:?}");
        agent.send_reports().await;
        assert_eq!(cut_off.reported_tenants.lock().expect("lock").len(), 4);
        if !takes_batches {
            assert_eq!(
                (
                    cut_off.single_calls.load(Ordering::SeqCst),
                    cut_off.not_found_calls.load(Ordering::SeqCst)
                ),
                (4, 1),
                "one 404, then one call per report"
            );
        }
    }
}

/// Renewals of many pools wanted at once go in a few calls, not one each, every pool asked for
/// once; an allocator without the batch route gets one call per renewal.
#[tokio::test]
async fn renewals_of_many_pools_share_calls_or_go_one_by_one_to_an_older_allocator() {
    const TENANTS: u64 = 20;
    for takes_grant_batches in [true, false] {
        let fake = Arc::new(Fake {
            takes_grant_batches,
            // While one call is answered, the other pools' renewals queue for the next.
            grant_batch_delay: Duration::from_millis(150),
            ..Arc::into_inner(fake(Some(1_000), Duration::ZERO)).expect("sole owner")
        });
        let (agent, _clock) = setup(&fake).await;
        let mut requests = tokio::task::JoinSet::new();
        for n in 0..TENANTS {
            let agent = agent.clone();
            requests.spawn(async move {
                let tenant = format!("tenant{n:02}");
                agent
                    .admit(&request_of(&tenant, n))
                    .await
                    .expect("decision")
            });
        }
        for decision in requests.join_all().await {
            assert!(!decision.allowed, "nothing granted: {decision:?}");
            assert_eq!(
                decision.limit_units, 1_000,
                "the pool's terms: {decision:?}"
            );
        }
        // An admit waits for its grant a bounded time; a renewal may be answered after it.
        for _ in 0..100 {
            if fake.granted_tenants.lock().expect("lock").len() >= TENANTS as usize {
                break;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
        let mut asked = fake.granted_tenants.lock().expect("lock").clone();
        asked.sort();
        let expected: Vec<String> = (0..TENANTS).map(|n| format!("tenant{n:02}")).collect();
        assert_eq!(asked, expected, "every pool's renewal asked for once");
        let calls = (
            fake.grant_batch_calls.load(Ordering::SeqCst),
            fake.grant_calls.load(Ordering::SeqCst),
        );
        if takes_grant_batches {
            assert!(
                (1..=4).contains(&calls.0) && calls.1 == 0,
                "{TENANTS} pools' renewals in a few batch calls: {calls:?}"
            );
        } else {
            assert_eq!(
                calls,
                (0, TENANTS),
                "the batch route missing: one call per renewal"
            );
            assert_eq!(
                fake.not_found_calls.load(Ordering::SeqCst),
                1,
                "the missing route is asked for once, not per call"
            );
        }
        // An allocator that does not split its pools answers the shard map 404: the agent reads
        // it once per 30 s however many calls it makes, and routes as before.
        assert_eq!(fake.shard_map_reads.load(Ordering::SeqCst), 1);
    }
}

/// A report round cut short (its deadline) after its first call: the next round starts with the
/// pools the cut round did not reach, so a round that never finishes does not starve the same
/// pools every time.
#[tokio::test]
async fn a_round_cut_short_is_resumed_where_it_stopped() {
    let pools = allot_shared::wire::MAX_REPORTS_PER_BATCH + 20;
    let cut_off = Arc::new(Fake {
        fallback_per_region_tokens: 10,
        grants_unavailable: true,
        ..Arc::into_inner(fake(Some(1_000), Duration::ZERO)).expect("sole owner")
    });
    let (agent, _clock) = setup(&cut_off).await;
    let tenants: Vec<String> = (0..pools).map(|n| format!("t{n:04}")).collect();
    let admit_everywhere = async |n: u64| {
        for tenant in &tenants {
            let decision = agent.admit(&request_of(tenant, n)).await.expect("decision");
            assert!(decision.allowed && decision.fallback, "{decision:?}");
        }
    };
    admit_everywhere(0).await;
    // The second call of the round hangs: the round's deadline cuts it there.
    cut_off.stalled_report_batch.store(2, Ordering::SeqCst);
    let cut = tokio::time::timeout(Duration::from_secs(2), agent.send_reports()).await;
    assert!(cut.is_err(), "the round was cut short");
    let first_round: Vec<String> = cut_off.reported_tenants.lock().expect("lock").clone();
    assert_eq!(
        first_round,
        tenants[..allot_shared::wire::MAX_REPORTS_PER_BATCH],
        "the first call carried the first pools, in order"
    );

    // Every pool owes again; the next round starts with the pools the cut one did not reach.
    admit_everywhere(1).await;
    cut_off.reported_tenants.lock().expect("lock").clear();
    agent.send_reports().await;
    let second_round: Vec<String> = cut_off.reported_tenants.lock().expect("lock").clone();
    let resumed: Vec<String> = tenants[allot_shared::wire::MAX_REPORTS_PER_BATCH..]
        .iter()
        .chain(&tenants[..allot_shared::wire::MAX_REPORTS_PER_BATCH])
        .cloned()
        .collect();
    assert_eq!(
        second_round, resumed,
        "resumed where the cut round stopped, then the rest"
    );
}
