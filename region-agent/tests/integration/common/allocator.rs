//! A stand-in allocator for agent tests: one pool per tenant (hour-long windows on the wall
//! clock), granted from a real remaining count; reports recorded as the ledger keeps them (the
//! largest cumulative line wins).

#![allow(dead_code)]

use std::collections::HashMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use allot_region_agent::allocator_client::AllocatorClient;
use allot_region_agent::clock::{Clock, SystemClock};
use axum::Json;
use axum::extract::State;
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};

/// The stand-in allocator: one pool, granted from what is left of `G`, reports recorded.
pub struct Allocator {
    pub limit_tokens: u64,
    pub chunk_tokens: u64,
    pub fallback_per_region_tokens: u64,
    pub remaining: AtomicU64,
    /// Grants never answer (a blackholed allocator).
    pub hang_grants: AtomicBool,
    /// Grants answer this late, ms (a slow allocator).
    pub grant_delay_ms: AtomicU64,
    /// The tokens asked for by each grant.
    pub wants: Mutex<Vec<u64>>,
    /// Reported spent per lease (cumulative: the largest line wins, as in the ledger).
    pub spent_by_lease: Mutex<HashMap<String, u64>>,
    /// Reported fallback admits per window (cumulative: the largest wins).
    pub fallback_by_window: Mutex<HashMap<u64, u64>>,
    /// Reported shadow admits per window (cumulative: the largest wins).
    pub shadow_by_window: Mutex<HashMap<u64, u64>>,
    /// The pool's `settleDebtPerRegion`.
    pub settle_debt_per_region_tokens: AtomicU64,
    /// Reported settle debt (the most carried) and written-off tokens per window (largest wins).
    pub settle_debt_by_window: Mutex<HashMap<u64, u64>>,
    pub written_off_by_window: Mutex<HashMap<u64, u64>>,
    /// The agent's latest run as the session record keeps it: (incarnation, verdict given to it,
    /// ended cleanly), and the start of the latest run that followed an unclean end.
    pub session: Mutex<Option<(String, bool, bool)>>,
    pub unclean_since_ms: Mutex<Option<u64>>,
    /// Its clock (the agents' under test should read the same one).
    pub clock: Arc<dyn Clock>,
    /// Calls to `GET .../terms` and `POST /v1/reports`.
    pub terms_calls: AtomicU64,
    pub report_calls: AtomicU64,
    /// How long its leases last, ms.
    pub lease_ms: AtomicU64,
    /// The version of its terms, and whether grants say it (`termsVersion`).
    pub terms_version: AtomicU64,
    pub grants_say_terms_version: AtomicBool,
}

impl Allocator {
    pub fn new(limit_tokens: u64, chunk_tokens: u64, fallback_per_region_tokens: u64) -> Arc<Self> {
        Arc::new(Self {
            limit_tokens,
            chunk_tokens,
            fallback_per_region_tokens,
            remaining: AtomicU64::new(limit_tokens),
            hang_grants: AtomicBool::new(false),
            grant_delay_ms: AtomicU64::new(0),
            wants: Mutex::new(Vec::new()),
            spent_by_lease: Mutex::new(HashMap::new()),
            fallback_by_window: Mutex::new(HashMap::new()),
            shadow_by_window: Mutex::new(HashMap::new()),
            settle_debt_per_region_tokens: AtomicU64::new(0),
            settle_debt_by_window: Mutex::new(HashMap::new()),
            written_off_by_window: Mutex::new(HashMap::new()),
            session: Mutex::new(None),
            unclean_since_ms: Mutex::new(None),
            clock: Arc::new(SystemClock),
            terms_calls: AtomicU64::new(0),
            report_calls: AtomicU64::new(0),
            lease_ms: AtomicU64::new(600_000),
            terms_version: AtomicU64::new(1),
            grants_say_terms_version: AtomicBool::new(false),
        })
    }

    /// The same stand-in on `clock`.
    pub fn with_clock(
        limit_tokens: u64,
        chunk_tokens: u64,
        fallback_per_region_tokens: u64,
        clock: Arc<dyn Clock>,
    ) -> Arc<Self> {
        let fake = Self::new(limit_tokens, chunk_tokens, fallback_per_region_tokens);
        Arc::new(Self {
            clock,
            ..Arc::into_inner(fake).expect("sole owner")
        })
    }

    pub fn reported_spent(&self) -> u64 {
        self.spent_by_lease.lock().expect("lock").values().sum()
    }

    pub fn reported_fallback(&self) -> u64 {
        self.fallback_by_window.lock().expect("lock").values().sum()
    }

    pub fn reported_shadow(&self) -> u64 {
        self.shadow_by_window.lock().expect("lock").values().sum()
    }

    pub fn reported_settle_debt(&self) -> u64 {
        self.settle_debt_by_window
            .lock()
            .expect("lock")
            .values()
            .sum()
    }

    pub fn reported_written_off(&self) -> u64 {
        self.written_off_by_window
            .lock()
            .expect("lock")
            .values()
            .sum()
    }
}

async fn terms(State(fake): State<Arc<Allocator>>) -> Response {
    fake.terms_calls.fetch_add(1, Ordering::SeqCst);
    Json(serde_json::json!({
        "limit": fake.limit_tokens, "windowMs": 3_600_000, "chunk": fake.chunk_tokens, "leaseTtlMs": 600_000,
        "fallbackPerRegion": fake.fallback_per_region_tokens, "regions": ["eu"],
        "version": fake.terms_version.load(Ordering::SeqCst),
        "settleDebtPerRegion": fake.settle_debt_per_region_tokens.load(Ordering::SeqCst),
    }))
    .into_response()
}

async fn grant(
    State(fake): State<Arc<Allocator>>,
    Json(body): Json<serde_json::Value>,
) -> Response {
    if fake.hang_grants.load(Ordering::SeqCst) {
        std::future::pending::<()>().await;
    }
    let delay_ms = fake.grant_delay_ms.load(Ordering::SeqCst);
    if delay_ms > 0 {
        tokio::time::sleep(std::time::Duration::from_millis(delay_ms)).await;
    }
    let want = body["want"].as_u64().unwrap_or(0).min(fake.chunk_tokens);
    fake.wants.lock().expect("lock").push(want);
    let granted = fake
        .remaining
        .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |left| {
            Some(left - want.min(left))
        })
        .map(|left| want.min(left))
        .unwrap_or(0);
    let ungranted = fake.remaining.load(Ordering::SeqCst);
    // The agent's clock reads the wall clock here: one hour-long window around now.
    let now_ms = fake.clock.now_ms();
    let window_start_ms = now_ms - now_ms % 3_600_000;
    Json(serde_json::json!({
        "leaseId": body["leaseId"], "region": body["region"], "granted": granted, "epoch": 1,
        "windowStartMs": window_start_ms, "windowEndMs": window_start_ms + 3_600_000,
        "expiresAtMs": now_ms + fake.lease_ms.load(Ordering::SeqCst), "retryAfterMs": if granted == 0 { 60_000 } else { 0 },
        "issuedAtMs": now_ms, "answeredAtMs": now_ms, "ungranted": ungranted,
        "termsVersion": if fake.grants_say_terms_version.load(Ordering::SeqCst) {
            fake.terms_version.load(Ordering::SeqCst)
        } else {
            0
        },
    }))
    .into_response()
}

async fn report(
    State(fake): State<Arc<Allocator>>,
    Json(body): Json<serde_json::Value>,
) -> Response {
    fake.report_calls.fetch_add(1, Ordering::SeqCst);
    let mut spent = fake.spent_by_lease.lock().expect("lock");
    for line in body["leases"].as_array().into_iter().flatten() {
        let id = line["leaseId"].as_str().unwrap_or_default().to_owned();
        let tokens = line["spent"].as_u64().unwrap_or(0);
        let entry = spent.entry(id).or_default();
        *entry = (*entry).max(tokens);
    }
    let window = body["windowStartMs"].as_u64().unwrap_or(0);
    let admitted = body["fallbackAdmitted"].as_u64().unwrap_or(0);
    let mut fallback = fake.fallback_by_window.lock().expect("lock");
    let entry = fallback.entry(window).or_default();
    *entry = (*entry).max(admitted);
    for (field, by_window) in [
        ("shadowAdmitted", &fake.shadow_by_window),
        ("settleDebt", &fake.settle_debt_by_window),
        ("writtenOff", &fake.written_off_by_window),
    ] {
        let amount = body[field].as_u64().unwrap_or(0);
        let mut by_window = by_window.lock().expect("lock");
        let entry = by_window.entry(window).or_default();
        *entry = (*entry).max(amount);
    }
    Json(serde_json::json!({ "duplicate": false })).into_response()
}

/// As the allocator's session record: the first run is clean, a retried start keeps its verdict,
/// a new run learns whether the one before ended.
async fn session_start(
    State(fake): State<Arc<Allocator>>,
    Json(body): Json<serde_json::Value>,
) -> Response {
    let incarnation = body["incarnation"].as_str().unwrap_or_default().to_owned();
    let mut session = fake.session.lock().expect("lock");
    let clean = match session.as_ref() {
        None => true,
        Some((latest, verdict, _)) if *latest == incarnation => *verdict,
        Some((_, _, ended)) => *ended,
    };
    let retried = session
        .as_ref()
        .is_some_and(|(latest, _, _)| *latest == incarnation);
    let mut unclean_since_ms = fake.unclean_since_ms.lock().expect("lock");
    if !clean && !retried {
        *unclean_since_ms = Some(fake.clock.now_ms());
    }
    if !retried {
        *session = Some((incarnation, clean, false));
    }
    Json(serde_json::json!({
        "predecessorEndedCleanly": clean, "startedAtMs": fake.clock.now_ms(),
        "uncleanSinceMs": *unclean_since_ms,
    }))
    .into_response()
}

async fn session_end(
    State(fake): State<Arc<Allocator>>,
    Json(body): Json<serde_json::Value>,
) -> Response {
    let incarnation = body["incarnation"].as_str().unwrap_or_default();
    let mut session = fake.session.lock().expect("lock");
    let ended = match session.as_mut() {
        Some((latest, _, ended)) if latest == incarnation => {
            *ended = true;
            true
        }
        _ => false,
    };
    Json(serde_json::json!({ "ended": ended })).into_response()
}

pub async fn client(fake: Arc<Allocator>) -> Arc<AllocatorClient> {
    let app = axum::Router::new()
        .route("/v1/pools/{tenant}/{pool}/terms", get(terms))
        .route("/v1/grants", post(grant))
        .route("/v1/reports", post(report))
        .route("/v1/agent-sessions", post(session_start))
        .route("/v1/agent-sessions/end", post(session_end))
        .with_state(fake);
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
