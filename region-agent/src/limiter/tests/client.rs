//! The client path ([`Limiter`]) against real Redis (single and cluster) and, for pure timing, the
//! in-process store under tokio's paused clock.
//!
//! The limiter's breakers, caches, fallback buckets and windows run on a [`ManualMonotonicClock`]
//! that the tests step; the Redis scripts use the server's `TIME`, as in production.

use std::future::Future;
use std::pin::Pin;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::task::Poll;
use std::time::Duration;

use allot_shared::contract::{
    AdmissionRequest, AdvisoryMode, DeniedScope, Principal, PrincipalType, Reason, http_status,
};
use allot_shared::ids::{DecisionId, RouteGroup, TenantId};
use allot_shared::keys::{IpPrefixes, Pepper};
use allot_shared::limit::RetryAfter;
use allot_shared::policy::{PolicyBundle, parse_bundle};
use allot_testkit::{RedisCluster, RedisServer};

use super::harness::{RECOVERY_DEADLINE, TEST_CONFIG, redis_query};
use crate::clock::{ManualClock, ManualMonotonicClock, monotonic_now};
use crate::limiter::batch::{PlannedBatch, RuleBatch, plan_request};
use crate::limiter::breaker::{BreakerConfig, BreakerState};
use crate::limiter::cardinality::{CardinalityConfig, DEFAULT_SOURCE_PREFIXES, SourceId};
use crate::limiter::client::{
    DEFAULT_ACQUIRE_WAIT, DegradeCause, LeaseOp, LimitDecision, Limiter, LimiterConfig, Verdict,
};
use crate::limiter::hot_tenants::HotTenants;
use crate::limiter::in_process::InProcessStore;
use crate::limiter::redis_store::{RedisStore, RedisStoreConfig};
use crate::limiter::store::{
    BatchDecision, LeaseCall, LeaseOutcome, LimiterStore, Rejection, StoreError,
};

/// The rules the client tests run. Local buckets: 5 tokens, refilling 0.25 per second.
const BUNDLE: &str = r#"{
    "bundleVersion": 3,
    "rules": [
        {"id": "read-user", "scope": "user", "routeGroup": "read", "algorithm": "token_bucket",
         "capacityMillis": 20000, "refillMillis": 2000, "periodMs": 1000,
         "failMode": "local_bounded", "localCapacityMillis": 5000, "localRefillMillis": 250},
        {"id": "slow-user", "scope": "user", "routeGroup": "slow", "algorithm": "token_bucket",
         "capacityMillis": 5000, "refillMillis": 1000, "periodMs": 3600000,
         "failMode": "local_bounded", "localCapacityMillis": 5000, "localRefillMillis": 250},
        {"id": "export-user", "scope": "user", "routeGroup": "export", "algorithm": "token_bucket",
         "capacityMillis": 20000, "refillMillis": 2000, "periodMs": 1000,
         "failMode": "local_bounded", "localCapacityMillis": 5000, "localRefillMillis": 250},
        {"id": "export-tenant", "scope": "tenant", "routeGroup": "export",
         "algorithm": "token_bucket", "capacityMillis": 100000, "refillMillis": 1000,
         "periodMs": 3600000, "failMode": "closed", "idempotent": true},
        {"id": "anon-ip", "scope": "user", "principalType": "ip", "routeGroup": "login",
         "algorithm": "fixed_window", "limit": 20, "windowMs": 10000,
         "failMode": "local_bounded", "localCapacityMillis": 5000, "localRefillMillis": 500},
        {"id": "hot-bulk", "scope": "tenant", "tenant": "hot", "routeGroup": "bulk",
         "algorithm": "token_bucket", "capacityMillis": 50000, "refillMillis": 1000,
         "periodMs": 3600000, "failMode": "closed"}
    ]
}"#;

fn bundle() -> PolicyBundle {
    parse_bundle(BUNDLE)
        .expect("a valid bundle")
        .into_file_bundle()
        .expect("sealed")
}

fn pepper() -> Pepper {
    Pepper::new(b"client-test-pepper-0123".to_vec()).expect("long enough")
}

/// A request by `principal` (of `kind`) on `route` of `tenant`, with decision id `id`.
fn plan<'b>(
    bundle: &'b PolicyBundle,
    tenant: &str,
    kind: PrincipalType,
    principal: &str,
    route: &str,
    id: &str,
) -> PlannedBatch<'b> {
    let request = AdmissionRequest {
        request_id: DecisionId::parse(id).expect("a valid decision id"),
        tenant_id: TenantId::parse(tenant).expect("a valid tenant"),
        principal: Principal {
            kind,
            id: principal.to_owned(),
            api_key_id: None,
        },
        route_group: RouteGroup::parse(route).expect("a valid route group"),
        method: "GET".to_owned(),
        cost_hint: 1,
        policy_epoch: None,
        dry_run: false,
        metered: false,
    };
    request.validate().expect("a valid request");
    plan_request(bundle, &request, &pepper(), IpPrefixes::default(), 30_000)
        .expect("plannable")
        .expect("rules apply")
}

fn user<'b>(bundle: &'b PolicyBundle, route: &str, id: &str) -> PlannedBatch<'b> {
    plan(bundle, "atlas", PrincipalType::User, "U-17", route, id)
}

/// A store wrapper that counts calls, remembers their decision ids, and can lose replies, hang or
/// reject.
struct Instrumented {
    inner: Arc<dyn LimiterStore>,
    calls: AtomicU64,
    /// The next this many calls run on the inner store, then report `Ambiguous` (a lost reply).
    lose_replies: AtomicU64,
    /// Calls never answer (a hung shard).
    hang: AtomicBool,
    /// Calls whose decision id starts `hang-` never answer; the others do (a shard slow for some).
    hang_marked: AtomicBool,
    /// Every call takes this long before it answers, ms (a saturated shard that still answers).
    delay_ms: AtomicU64,
    /// Calls whose decision id starts `late-` take this long, ms, then report `Ambiguous`: the
    /// store's own call timeout, noticing a missed reply before the limiter's deadline does.
    late_ambiguous_ms: AtomicU64,
    /// Calls are rejected as invalid arguments (a policy fault).
    reject: AtomicBool,
    decision_ids: Mutex<Vec<String>>,
    /// Concurrency lease calls that reached the store.
    lease_calls: AtomicU64,
}

impl Instrumented {
    fn new(inner: Arc<dyn LimiterStore>) -> Arc<Self> {
        Arc::new(Self {
            inner,
            calls: AtomicU64::new(0),
            lose_replies: AtomicU64::new(0),
            hang: AtomicBool::new(false),
            hang_marked: AtomicBool::new(false),
            delay_ms: AtomicU64::new(0),
            late_ambiguous_ms: AtomicU64::new(0),
            reject: AtomicBool::new(false),
            decision_ids: Mutex::new(Vec::new()),
            lease_calls: AtomicU64::new(0),
        })
    }

    fn calls(&self) -> u64 {
        self.calls.load(Ordering::SeqCst)
    }

    fn decision_ids(&self) -> Vec<String> {
        self.decision_ids
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .clone()
    }
}

#[async_trait::async_trait]
impl LimiterStore for Instrumented {
    async fn decide(&self, batch: &RuleBatch) -> Result<BatchDecision, StoreError> {
        self.calls.fetch_add(1, Ordering::SeqCst);
        self.decision_ids
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .push(batch.decision_id().to_string());
        let marked = batch.decision_id().to_string().starts_with("hang-");
        if self.hang.load(Ordering::SeqCst) || (marked && self.hang_marked.load(Ordering::SeqCst)) {
            std::future::pending::<()>().await;
        }
        let late_ambiguous_ms = self.late_ambiguous_ms.load(Ordering::SeqCst);
        if late_ambiguous_ms > 0 && batch.decision_id().to_string().starts_with("late-") {
            tokio::time::sleep(Duration::from_millis(late_ambiguous_ms)).await;
            return Err(StoreError::Ambiguous {
                detail: "no reply within the store's call timeout (test)".to_owned(),
            });
        }
        let delay_ms = self.delay_ms.load(Ordering::SeqCst);
        if delay_ms > 0 {
            tokio::time::sleep(Duration::from_millis(delay_ms)).await;
        }
        if self.reject.load(Ordering::SeqCst) {
            return Err(StoreError::Rejected {
                kind: Rejection::InvalidArgument,
                detail: "test".to_owned(),
            });
        }
        let decision = self.inner.decide(batch).await?;
        let lose = self
            .lose_replies
            .fetch_update(Ordering::SeqCst, Ordering::SeqCst, |n| n.checked_sub(1))
            .is_ok();
        if lose {
            return Err(StoreError::Ambiguous {
                detail: "the reply was lost (test)".to_owned(),
            });
        }
        Ok(decision)
    }

    async fn acquire_lease(&self, call: &LeaseCall) -> Result<LeaseOutcome, StoreError> {
        self.lease_calls.fetch_add(1, Ordering::SeqCst);
        if self.hang.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.inner.acquire_lease(call).await
    }

    async fn renew_lease(&self, call: &LeaseCall) -> Result<LeaseOutcome, StoreError> {
        self.inner.renew_lease(call).await
    }

    async fn release_lease(&self, call: &LeaseCall) -> Result<LeaseOutcome, StoreError> {
        self.inner.release_lease(call).await
    }

    fn shard_count(&self) -> usize {
        self.inner.shard_count()
    }

    fn shard_of(&self, batch: &RuleBatch) -> usize {
        self.inner.shard_of(batch)
    }

    fn shard_of_key(&self, key: &str) -> usize {
        self.inner.shard_of_key(key)
    }

    fn coalesced(&self) -> (u64, u64) {
        self.inner.coalesced()
    }
}

/// Budgets generous enough for a busy 2-core machine; the breaker opens after 3 failures within
/// 10 s and cools down for 1 s (on the manual clock).
fn config() -> LimiterConfig {
    LimiterConfig {
        decision_budget: Duration::from_secs(2),
        breaker: BreakerConfig {
            failure_threshold: 3,
            failure_window_ms: 10_000,
            open_ms: 1_000,
            half_open_probes: 1,
        },
        ..LimiterConfig::default()
    }
}

/// For tests that stop Redis: a call to a stopped server can wait for the client's reconnection
/// until the deadline, so the deadline is short (still far above a healthy local round trip).
fn outage_config() -> LimiterConfig {
    LimiterConfig {
        decision_budget: Duration::from_millis(250),
        ..config()
    }
}

struct Setup {
    limiter: Limiter,
    store: Arc<Instrumented>,
    clock: Arc<ManualMonotonicClock>,
}

fn limiter_over(inner: Arc<dyn LimiterStore>, config: LimiterConfig) -> Setup {
    let store = Instrumented::new(inner);
    let clock = Arc::new(ManualMonotonicClock::new(0));
    let limiter =
        Limiter::with_clock(store.clone(), config, clock.clone()).expect("a valid config");
    Setup {
        limiter,
        store,
        clock,
    }
}

async fn redis_store(server: &RedisServer) -> Arc<RedisStore> {
    Arc::new(
        RedisStore::connect(&server.url(), TEST_CONFIG)
            .await
            .expect("connects"),
    )
}

/// A token bucket's tokens on Redis: the first number of its state, "t<tokens> <updated at>".
async fn redis_tokens(store: &RedisStore, key: &str) -> Option<u64> {
    let state: Option<String> = redis_query(&store.connection(), redis::cmd("GET").arg(key)).await;
    let tokens = state?.strip_prefix('t')?.split(' ').next()?.parse();
    Some(tokens.expect("a token bucket's state"))
}

fn store_decision(decision: &LimitDecision) -> &BatchDecision {
    match &decision.verdict {
        Verdict::Store(store) => store,
        other => panic!("expected a store decision, got {other:?}"),
    }
}

#[tokio::test]
async fn with_redis_stopped_local_bounded_rules_answer_within_their_local_bound_and_closed_rules_503()
 {
    let mut server = RedisServer::start();
    let redis = redis_store(&server).await;
    let s = limiter_over(redis.clone(), outage_config());
    let bundle = bundle();
    let before = s.limiter.decide(&user(&bundle, "read", "r-0"), None).await;
    assert!(before.allowed() && !before.fallback(), "{before:?}");

    server.stop();
    let mut admitted = 0;
    for n in 1..=20 {
        let planned = user(&bundle, "read", &format!("r-{n}"));
        let decision = s.limiter.decide(&planned, None).await;
        assert!(decision.fallback(), "{n}: {decision:?}");
        assert!(decision.degraded.is_some(), "{n}: the store did not decide");
        let contract = decision.to_contract(&planned);
        assert!(contract.fallback);
        if contract.allowed {
            admitted += 1;
        } else {
            assert_eq!(contract.reason, Some(Reason::RateExceeded));
            assert_eq!(contract.policy_id.as_deref(), Some("read-user"));
            assert_eq!((contract.limit_units, contract.remaining_units), (5, 0));
            assert_eq!(contract.retry_after_ms, 4_000, "0.25 tokens per second");
        }
    }
    assert_eq!(
        admitted, 5,
        "exactly the local capacity: the clock stood still"
    );

    // Export has a closed tenant rule beside a local_bounded user rule: closed wins.
    let export = user(&bundle, "export", "e-1");
    let decision = s.limiter.decide(&export, None).await;
    let contract = decision.to_contract(&export);
    assert!(!contract.allowed && !contract.fallback);
    assert_eq!(contract.reason, Some(Reason::LimiterUnavailable));
    assert_eq!(contract.policy_id.as_deref(), Some("export-tenant"));
    assert_eq!(contract.denied_scope, Some(DeniedScope::Tenant));
    assert_eq!(http_status(&contract), 503);
    assert_eq!(contract.retry_after_ms, 1_000);
    assert!(s.limiter.stats().unavailable >= 1);
}

#[tokio::test]
async fn the_breaker_opens_on_a_stopped_redis_stops_calling_it_and_recovers_after_a_restart() {
    let mut server = RedisServer::start();
    let redis = redis_store(&server).await;
    let s = limiter_over(redis.clone(), outage_config());
    let bundle = bundle();
    assert!(
        s.limiter
            .decide(&user(&bundle, "slow", "r-0"), None)
            .await
            .allowed()
    );
    assert_eq!(s.store.calls(), 1);

    server.stop();
    // Refused connections count at once; overruns once nothing has answered for ten budgets (a
    // shard that answered lately is slow, not down): open within fifteen decisions either way.
    let mut failing = 0;
    while s.limiter.breakers()[0].state != BreakerState::Open {
        failing += 1;
        assert!(
            failing <= 15,
            "still closed after {failing} failing decisions"
        );
        let decision = s
            .limiter
            .decide(&user(&bundle, "slow", &format!("r-{failing}")), None)
            .await;
        assert!(
            matches!(
                decision.degraded,
                Some(
                    DegradeCause::NotExecuted
                        | DegradeCause::Ambiguous
                        | DegradeCause::DeadlineExceeded
                )
            ),
            "{decision:?}"
        );
    }
    assert_eq!(s.store.calls(), 1 + failing);
    // Open: decisions degrade at once and the store sees nothing.
    for n in 1..=47 {
        let decision = s
            .limiter
            .decide(&user(&bundle, "slow", &format!("o-{n}")), None)
            .await;
        assert_eq!(decision.degraded, Some(DegradeCause::BreakerOpen));
        assert_eq!(decision.store_calls, 0);
    }
    assert_eq!(
        s.store.calls(),
        1 + failing,
        "no call reached the stopped store"
    );
    assert_eq!(s.limiter.stats().breaker_refusals, 47);

    server.restart();
    let reloads_before = redis.script_reloads();
    let started = monotonic_now();
    let recovered = loop {
        // Each round is a new cool-down: one probe goes through.
        s.clock.advance(1_000);
        let probe = s
            .limiter
            .decide(&user(&bundle, "slow", "r-probe"), None)
            .await;
        if matches!(probe.verdict, Verdict::Store(_)) {
            break probe;
        }
        assert!(
            monotonic_now().duration_since(started) < RECOVERY_DEADLINE,
            "the breaker did not recover: {:?}",
            s.limiter.breakers()
        );
        tokio::time::sleep(Duration::from_millis(20)).await;
    };
    assert!(recovered.allowed() && !recovered.fallback());
    assert_eq!(
        store_decision(&recovered).remaining,
        [4_000],
        "a fresh bucket: the restarted server kept nothing"
    );
    assert_eq!(s.limiter.breakers()[0].state, BreakerState::Closed);
    assert!(
        redis.script_reloads() > reloads_before,
        "NOSCRIPT after the restart was answered by a reload"
    );
    let after = s
        .limiter
        .decide(&user(&bundle, "slow", "r-after"), None)
        .await;
    assert_eq!(store_decision(&after).remaining, [3_000]);
}

#[tokio::test]
async fn a_lost_reply_on_an_idempotent_batch_is_retried_with_the_same_id_and_debits_once() {
    let server = RedisServer::start();
    let redis = redis_store(&server).await;
    let s = limiter_over(redis.clone(), config());
    let bundle = bundle();
    let export = user(&bundle, "export", "e-1");
    assert!(
        export.batch.record_ttl_ms() > 0,
        "export-tenant is idempotent"
    );
    s.store.lose_replies.store(1, Ordering::SeqCst);
    let decision = s.limiter.decide(&export, None).await;
    let store = store_decision(&decision);
    assert!(store.allowed && store.replayed, "{decision:?}");
    assert_eq!(store.remaining, [19_000, 99_000]);
    assert_eq!(decision.store_calls, 2);
    assert_eq!(s.store.decision_ids(), ["e-1", "e-1"], "same decision id");
    assert_eq!(s.limiter.stats().store_retries, 1);
    let keys: Vec<&str> = export.batch.rules().iter().map(|r| r.key()).collect();
    assert_eq!(redis_tokens(&redis, keys[0]).await, Some(19_000));
    assert_eq!(
        redis_tokens(&redis, keys[1]).await,
        Some(99_000),
        "debited once"
    );
}

#[tokio::test]
async fn a_lost_reply_without_a_record_degrades_and_accepts_one_extra_unit_without_refund() {
    let server = RedisServer::start();
    let redis = redis_store(&server).await;
    let s = limiter_over(redis.clone(), config());
    let bundle = bundle();
    // slow-user: 5 tokens, one more per hour; not idempotent.
    let slow = user(&bundle, "slow", "s-1");
    assert_eq!(slow.batch.record_ttl_ms(), 0);
    s.store.lose_replies.store(1, Ordering::SeqCst);
    let decision = s.limiter.decide(&slow, None).await;
    assert_eq!(decision.degraded, Some(DegradeCause::Ambiguous));
    assert_eq!(decision.store_calls, 1, "no blind retry");
    assert!(decision.allowed() && decision.fallback(), "{decision:?}");
    // The script ran: its debit stands (the one extra unit), and nothing gave it back.
    let key = slow.batch.rules()[0].key();
    assert_eq!(redis_tokens(&redis, key).await, Some(4_000));
    let next = s.limiter.decide(&user(&bundle, "slow", "s-2"), None).await;
    assert_eq!(store_decision(&next).remaining, [3_000], "no refund");
}

#[tokio::test]
async fn the_negative_cache_answers_a_flood_against_an_exhausted_key_with_one_store_call() {
    let server = RedisServer::start();
    let redis = redis_store(&server).await;
    let s = limiter_over(redis, config());
    let bundle = bundle();
    // slow-user: 5 tokens, one more per hour.
    for n in 0..5 {
        assert!(
            s.limiter
                .decide(&user(&bundle, "slow", &format!("s-{n}")), None)
                .await
                .allowed()
        );
    }
    assert_eq!(s.store.calls(), 5);
    let mut cached = 0;
    for n in 5..105 {
        let planned = user(&bundle, "slow", &format!("s-{n}"));
        let decision = s.limiter.decide(&planned, None).await;
        let contract = decision.to_contract(&planned);
        assert!(!contract.allowed);
        assert_eq!(contract.reason, Some(Reason::RateExceeded));
        assert!(
            contract.retry_after_ms > 3_000_000,
            "the store's hint, not 250 ms"
        );
        cached += usize::from(matches!(decision.verdict, Verdict::CachedDenial(_)));
    }
    assert_eq!(s.store.calls(), 6, "one store call for 100 denied attempts");
    assert_eq!(cached, 99);
    // Another principal is not affected.
    let other = plan(&bundle, "atlas", PrincipalType::User, "U-18", "slow", "o-1");
    assert!(s.limiter.decide(&other, None).await.allowed());
    assert_eq!(s.store.calls(), 7);
    // After 250 ms the next attempt reaches the store again (and is denied again).
    s.clock.advance(249);
    s.limiter.decide(&user(&bundle, "slow", "s-a"), None).await;
    assert_eq!(s.store.calls(), 7);
    s.clock.advance(1);
    let decision = s.limiter.decide(&user(&bundle, "slow", "s-b"), None).await;
    assert!(!store_decision(&decision).allowed);
    assert_eq!(s.store.calls(), 8);
}

/// Decides `requests` concurrently on this task: each is polled once, in order, before any is
/// polled again, so every decision has reached the store before the first reply is read (the
/// first reply is read only when the first decision is polled again).
async fn decide_together(limiter: &Limiter, requests: &[PlannedBatch<'_>]) -> Vec<LimitDecision> {
    type Deciding<'a> = Pin<Box<dyn Future<Output = LimitDecision> + Send + 'a>>;
    let mut deciding: Vec<Deciding<'_>> = requests
        .iter()
        .map(|planned| Box::pin(limiter.decide(planned, None)) as Deciding<'_>)
        .collect();
    let mut decided: Vec<Option<LimitDecision>> = requests.iter().map(|_| None).collect();
    std::future::poll_fn(|cx| {
        for (future, slot) in deciding.iter_mut().zip(decided.iter_mut()) {
            if slot.is_none()
                && let Poll::Ready(decision) = future.as_mut().poll(cx)
            {
                *slot = Some(decision);
            }
        }
        if decided.iter().all(Option::is_some) {
            Poll::Ready(())
        } else {
            Poll::Pending
        }
    })
    .await;
    decided.into_iter().flatten().collect()
}

/// `FCALL`s the Redis server behind `store` has run so far (`INFO commandstats`): lone and
/// coalesced decide calls alike.
async fn fcalls(store: &RedisStore) -> u64 {
    let info: String =
        redis_query(&store.connection(), redis::cmd("INFO").arg("commandstats")).await;
    info.lines()
        .find_map(|line| line.strip_prefix("cmdstat_fcall:calls="))
        .and_then(|rest| rest.split(',').next())
        .map_or(0, |calls| calls.parse().expect("a count"))
}

/// A tenant's decisions that reach the store while its call is in flight go together in its next
/// call, each answered on its own, and the limiter's stats count them (the agent exports them as
/// `allot_agent_limiter_decisions{path="coalesced"}` and `{path="coalesced_calls"}`); a store
/// that sends every decision alone makes a call each and counts none.
///
/// Exact, not statistical: [`decide_together`] has all 32 in the store before the first reply is
/// read; the first finds its slot free and goes alone; with one call of a slot in flight the
/// other 31 wait for it, and they fit one call (at most 64) and the in-flight bound (128 at first).
#[tokio::test]
async fn a_tenants_decisions_that_wait_for_its_call_share_the_next_and_are_counted() {
    let server = RedisServer::start();
    let bundle = bundle();
    // export: each user's bucket (20) and the tenant's (100), which every request shares.
    let requests = |prefix: &str| -> Vec<PlannedBatch<'_>> {
        (0..32)
            .map(|n| {
                let user = format!("U-{n}");
                let id = format!("{prefix}-{n}");
                plan(&bundle, "atlas", PrincipalType::User, &user, "export", &id)
            })
            .collect()
    };
    let connect = async |coalesce| {
        let config = RedisStoreConfig {
            coalesce,
            coalesced_calls_in_flight: 1,
            ..TEST_CONFIG
        };
        Arc::new(
            RedisStore::connect(&server.url(), config)
                .await
                .expect("connects"),
        )
    };

    // Decides the requests together through a limiter over a fresh store: the limiter, the
    // decisions, and the FCALLs Redis ran for them.
    let decide_round = async |coalesce, prefix| {
        let store = connect(coalesce).await;
        let setup = limiter_over(store.clone(), config());
        let fcalls_before = fcalls(&store).await;
        let decisions = decide_together(&setup.limiter, &requests(prefix)).await;
        assert!(decisions.iter().all(LimitDecision::allowed));
        let fcalls_run = fcalls(&store).await - fcalls_before;
        (setup, decisions, fcalls_run)
    };

    let (coalescing, _, fcalls_run) = decide_round(true, "c").await;
    assert_eq!(
        fcalls_run, 2,
        "Redis ran one lone call and one coalesced call"
    );
    let stats = coalescing.limiter.stats();
    assert_eq!(
        (stats.coalesced_decisions, stats.coalesced_calls),
        (31, 1),
        "the first went alone; the 31 that waited for it went in one call"
    );

    let (alone, decisions, fcalls_run) = decide_round(false, "a").await;
    assert_eq!(fcalls_run, 32, "a call each");
    let stats = alone.limiter.stats();
    assert_eq!((stats.coalesced_decisions, stats.coalesced_calls), (0, 0));
    // Both took from the tenant's one bucket: 64 of its 100 tokens (in millitokens; it refills one
    // an hour, nothing within the test).
    let left: Vec<u64> = decisions
        .iter()
        .map(|decision| store_decision(decision).remaining[1])
        .collect();
    assert_eq!(left.iter().min(), Some(&36_000), "{left:?}");
}

#[tokio::test]
async fn the_cardinality_cap_refuses_a_sources_new_key_past_its_cap_without_a_store_call() {
    let server = RedisServer::start();
    let redis = redis_store(&server).await;
    let s = limiter_over(
        redis,
        LimiterConfig {
            cardinality: CardinalityConfig {
                max_keys_per_source: 3,
                interval_ms: 60_000,
                max_sources: 100,
            },
            ..config()
        },
    );
    let bundle = bundle();
    let login =
        |address: &str, id: &str| plan(&bundle, "atlas", PrincipalType::Ip, address, "login", id);
    let source = |address: &str| SourceId::for_address(&pepper(), address, DEFAULT_SOURCE_PREFIXES);
    for n in 1..=3 {
        let address = format!("203.0.113.{n}");
        let decision = s
            .limiter
            .decide(&login(&address, &format!("l-{n}")), Some(&source(&address)))
            .await;
        assert!(decision.allowed(), "{n}: {decision:?}");
    }
    assert_eq!(s.store.calls(), 3);
    let fourth = login("203.0.113.4", "l-4");
    let refused = s
        .limiter
        .decide(&fourth, Some(&source("203.0.113.4")))
        .await;
    assert!(
        matches!(refused.verdict, Verdict::CardinalityCapped { rule: 0, .. }),
        "{refused:?}"
    );
    let contract = refused.to_contract(&fourth);
    assert_eq!(
        (contract.reason, contract.denied_scope),
        (Some(Reason::RateExceeded), Some(DeniedScope::User))
    );
    assert_eq!(contract.retry_after_ms, 60_000);
    assert_eq!(http_status(&contract), 429);
    assert_eq!(
        s.store.calls(),
        3,
        "the refused key never reached the store"
    );
    // A key the source already made, and another source, are served.
    assert!(
        s.limiter
            .decide(&login("203.0.113.1", "l-5"), Some(&source("203.0.113.1")))
            .await
            .allowed()
    );
    assert!(
        s.limiter
            .decide(&login("198.51.100.7", "l-6"), Some(&source("198.51.100.7")))
            .await
            .allowed()
    );
    assert_eq!(s.store.calls(), 5);
    assert_eq!(s.limiter.stats().cardinality_refusals, 1);
    // The next interval.
    s.clock.advance(60_000);
    assert!(
        s.limiter
            .decide(&login("203.0.113.4", "l-7"), Some(&source("203.0.113.4")))
            .await
            .allowed()
    );
}

#[tokio::test]
async fn a_hot_tenant_spreads_over_k_sub_slots_on_three_masters_and_its_split_budget_holds() {
    const K: u32 = 8;
    const ATTEMPTS: usize = 200;
    let cluster = RedisCluster::start(3);
    let redis = Arc::new(
        RedisStore::connect_cluster(&cluster.seed_urls(), TEST_CONFIG)
            .await
            .expect("connects"),
    );
    let hot = TenantId::parse("hot").expect("tenant");
    let s = limiter_over(
        redis.clone(),
        LimiterConfig {
            hot_tenants: HotTenants::new()
                .with_tenant(hot.clone(), K)
                .expect("valid"),
            ..config()
        },
    );
    let bundle = bundle();
    let mut admitted = 0u64;
    let mut per_slot = [0u64; K as usize];
    for n in 0..ATTEMPTS {
        let planned = plan(
            &bundle,
            "hot",
            PrincipalType::User,
            &format!("U-{n}"),
            "bulk",
            &format!("b-{n}"),
        );
        let decision = s.limiter.decide(&planned, None).await;
        let slot = decision
            .sub_slot
            .expect("a hot tenant's request has a sub-slot");
        assert_eq!(slot.count, K);
        // Denials come from the store or, for a sub-slot denied < 250 ms ago, the negative cache.
        assert!(
            matches!(
                decision.verdict,
                Verdict::Store(_) | Verdict::CachedDenial(_)
            ),
            "{decision:?}"
        );
        if decision.allowed() {
            admitted += 1;
            per_slot[slot.index as usize] += 1;
        }
        assert_eq!(
            decision.to_contract(&planned).limit_units,
            6,
            "50 tokens / 8, rounded down to whole tokens"
        );
    }
    // Each part is ceil(50,000 / 8) = 6,250 millitokens: 6 whole requests, 48 in all; the split
    // can exceed the whole budget by at most k - 1 millitokens of rounding, never a whole request.
    assert!(admitted <= 50, "{admitted} admitted over a budget of 50");
    assert_eq!(
        per_slot, [6; K as usize],
        "every sub-slot was used up, none overspent"
    );

    // The sub-slot keys live in k distinct slots, spread over all three masters.
    let connection = redis.connection();
    let mut slots = Vec::new();
    for index in 0..K {
        let key = format!("rl:v1:{{t:hot:{index}}}:tenant:hot:bulk:tb");
        let exists: i64 = redis_query(&connection, redis::cmd("EXISTS").arg(&key)).await;
        assert_eq!(exists, 1, "{key}");
        let slot: i64 =
            redis_query(&connection, redis::cmd("CLUSTER").arg("KEYSLOT").arg(&key)).await;
        slots.push(slot);
    }
    slots.sort_unstable();
    slots.dedup();
    assert_eq!(slots.len(), K as usize, "k distinct slots");
    for node in 0..3 {
        let client = redis::Client::open(cluster.node_url(node)).expect("a node url");
        let mut direct = client
            .get_multiplexed_async_connection()
            .await
            .expect("connects");
        let keys: Vec<String> = redis::cmd("KEYS")
            .arg("rl:v1:{t:hot:*")
            .query_async(&mut direct)
            .await
            .expect("KEYS");
        assert!(
            !keys.is_empty(),
            "master {node} holds none of the hot tenant's sub-slots"
        );
    }
    let plain: i64 = redis_query(
        &connection,
        redis::cmd("EXISTS").arg("rl:v1:{t:hot}:tenant:hot:bulk:tb"),
    )
    .await;
    assert_eq!(plain, 0, "the un-split key is never used");
}

#[tokio::test]
async fn a_hot_tenants_principal_always_lands_in_one_sub_slot_and_its_record_too() {
    let clock = Arc::new(ManualClock::new(1 << 42));
    let s = limiter_over(
        Arc::new(InProcessStore::new(clock, 10_000)),
        LimiterConfig {
            hot_tenants: HotTenants::new()
                .with_tenant(TenantId::parse("atlas").expect("tenant"), 4)
                .expect("valid"),
            ..config()
        },
    );
    let bundle = bundle();
    let mut slots = Vec::new();
    for n in 0..10 {
        let decision = s
            .limiter
            .decide(&user(&bundle, "export", &format!("e-{n}")), None)
            .await;
        assert!(decision.allowed());
        slots.push(decision.sub_slot.expect("spread").index);
    }
    slots.dedup();
    assert_eq!(slots.len(), 1, "one principal, one sub-slot: {slots:?}");
    // A retry of an admitted idempotent request finds its record in the same sub-slot.
    let replay = s
        .limiter
        .decide(&user(&bundle, "export", "e-0"), None)
        .await;
    assert!(store_decision(&replay).replayed, "{replay:?}");
}

#[tokio::test(start_paused = true)]
async fn a_saturated_shard_degrades_after_its_wait_and_a_hung_call_at_the_deadline() {
    let clock = Arc::new(ManualClock::new(1 << 42));
    let s = limiter_over(
        Arc::new(InProcessStore::new(clock, 10_000)),
        LimiterConfig {
            decision_budget: Duration::from_millis(50),
            max_in_flight_per_shard: 1,
            ..config()
        },
    );
    s.store.hang.store(true, Ordering::SeqCst);
    let s = Arc::new(s);
    let bundle = Arc::new(bundle());
    let started = monotonic_now();
    let hung = {
        let (s, bundle) = (s.clone(), bundle.clone());
        tokio::spawn(async move { s.limiter.decide(&user(&bundle, "read", "r-1"), None).await })
    };
    // Let the first call take the only permit.
    while s.store.calls() == 0 {
        tokio::task::yield_now().await;
    }
    let saturated = s.limiter.decide(&user(&bundle, "read", "r-2"), None).await;
    assert_eq!(saturated.degraded, Some(DegradeCause::PoolExhausted));
    assert_eq!(saturated.store_calls, 0);
    assert!(saturated.fallback() && saturated.allowed(), "{saturated:?}");
    assert_eq!(
        monotonic_now().duration_since(started),
        DEFAULT_ACQUIRE_WAIT,
        "waited for a place, no longer"
    );

    let hung = hung.await.expect("the task ends");
    assert_eq!(hung.degraded, Some(DegradeCause::DeadlineExceeded));
    assert!(hung.fallback(), "{hung:?}");
    assert_eq!(
        monotonic_now().duration_since(started),
        Duration::from_millis(50),
        "one deadline for the whole decision"
    );
    assert_eq!(s.store.calls(), 1);
    assert_eq!(s.limiter.stats().pool_exhausted, 1);
    assert_eq!(
        s.limiter.stats().held_up,
        0,
        "both timers fired on time: nothing held this thread up"
    );
}

/// A wait or a call that runs out because this agent's own thread was held up (both fell due
/// while it was) is counted apart from the store's slowness: the agent needs CPU, not the store.
#[tokio::test(start_paused = true)]
async fn waits_and_calls_that_run_out_while_the_agent_is_held_up_are_counted_as_such() {
    let clock = Arc::new(ManualClock::new(1 << 42));
    let budget = Duration::from_millis(50);
    let s = limiter_over(
        Arc::new(InProcessStore::new(clock, 10_000)),
        LimiterConfig {
            decision_budget: budget,
            max_in_flight_per_shard: 1,
            ..config()
        },
    );
    s.store.hang.store(true, Ordering::SeqCst);
    let s = Arc::new(s);
    let bundle = Arc::new(bundle());
    let one = |prefix| {
        spawn_decisions(&s, &bundle, "read", prefix, 1)
            .pop()
            .expect("one")
    };
    let hung = one("hung-");
    while s.store.calls() == 0 {
        tokio::task::yield_now().await;
    }
    let waiting = one("waiting-");
    while s.limiter.shard_loads().first().map(|load| load.waiting) != Some(1) {
        tokio::task::yield_now().await;
    }
    // Past the wait (not the budget) in one step, as a thread that could not run sees time pass.
    tokio::time::advance(Duration::from_millis(20)).await;
    let waited = waiting.await.expect("ends");
    assert_eq!(waited.degraded, Some(DegradeCause::PoolExhausted));
    assert_eq!(s.limiter.stats().held_up, 1, "the wait");
    // Then past the hung call's deadline the same way.
    tokio::time::advance(budget * 2).await;
    let hung = hung.await.expect("ends");
    assert_eq!(hung.degraded, Some(DegradeCause::DeadlineExceeded));
    let stats = s.limiter.stats();
    assert_eq!(stats.pool_exhausted, 1);
    assert_eq!(stats.held_up, 2, "the wait and the call: {stats:?}");
    assert_eq!(
        stats.slow_calls, 1,
        "a held-up overrun is the agent's, not a dead shard's"
    );
    assert_eq!(stats.breaker_failures, 0);
}

/// Under overload a shard keeps answering, only slower: its breaker must stay closed, its in-flight
/// bound shrinks to what answers within the latency target, and once the waiting line is as long as
/// the shard serves within the wait, the excess is shed at once instead of timing out late.
#[tokio::test(start_paused = true)]
async fn an_overloaded_shard_stays_closed_shrinks_its_bound_and_sheds_the_excess_at_once() {
    let clock = Arc::new(ManualClock::new(1 << 42));
    let budget = Duration::from_millis(40);
    let s = Arc::new(limiter_over(
        Arc::new(InProcessStore::new(clock, 10_000)),
        LimiterConfig {
            decision_budget: budget,
            max_in_flight_per_shard: 64,
            // Below the bound's start, so that slow replies have room to cut it.
            min_in_flight_per_shard: 8,
            ..config()
        },
    ));
    // Replies take 20 ms, above the 13.3 ms latency target (a third of the budget).
    s.store.delay_ms.store(20, Ordering::SeqCst);
    let bundle = Arc::new(bundle());
    let wave = |size: usize, round: usize| {
        let tasks: Vec<_> = (0..size)
            .map(|n| {
                let (s, bundle) = (s.clone(), bundle.clone());
                tokio::spawn(async move {
                    let started = monotonic_now();
                    let id = format!("w{round}-{n}");
                    let principal = format!("U-{n}");
                    let planned = plan(
                        &bundle,
                        "atlas",
                        PrincipalType::User,
                        &principal,
                        "read",
                        &id,
                    );
                    let decision = s.limiter.decide(&planned, None).await;
                    (decision, monotonic_now().duration_since(started))
                })
            })
            .collect();
        async move {
            let mut outcomes = Vec::new();
            for task in tasks {
                outcomes.push(task.await.expect("ends"));
            }
            outcomes
        }
    };
    for round in 0..5 {
        let outcomes = wave(64, round).await;
        assert!(
            outcomes.iter().all(|(d, took)| {
                *took <= budget
                    && matches!(
                        d.degraded,
                        None | Some(DegradeCause::PoolExhausted | DegradeCause::Shed)
                    )
            }),
            "round {round}: decided, or refused without a call, within the budget: {outcomes:?}"
        );
    }
    let load = s.limiter.shard_loads()[0];
    assert!(load.limit < 64, "slow replies cut the bound: {load:?}");
    assert_eq!(load.latency_us, 20_000);

    let shed_before = s.limiter.stats().shed;
    let outcomes = wave(400, 9).await;
    let shed: Vec<_> = outcomes
        .iter()
        .filter(|(d, _)| d.degraded == Some(DegradeCause::Shed))
        .collect();
    assert!(!shed.is_empty(), "the excess is shed");
    assert!(
        shed.iter()
            .all(|(d, took)| took.is_zero() && d.store_calls == 0 && d.fallback()),
        "at once, nothing sent, the local buckets answer"
    );
    let decided = outcomes
        .iter()
        .filter(|(d, _)| d.degraded.is_none())
        .count();
    assert!(
        decided >= load.limit,
        "{decided} decided with a bound of {}",
        load.limit
    );
    assert!(
        outcomes.iter().all(|(_, took)| *took <= budget),
        "every decision answers within its budget"
    );
    assert_eq!(s.limiter.breakers()[0].state, BreakerState::Closed);
    assert_eq!(s.limiter.breakers()[0].opened_total, 0);
    let stats = s.limiter.stats();
    assert!(
        (stats.shed - shed_before) as usize == shed.len() && stats.pool_exhausted > 0,
        "{stats:?}"
    );
    assert_eq!(stats.slow_calls, 0);
}

/// `count` decisions on `route` for users `{prefix}{n}` (also their decision ids, which the
/// instrumented store reads), each in a task of its own.
fn spawn_decisions(
    s: &Arc<Setup>,
    bundle: &Arc<PolicyBundle>,
    route: &'static str,
    prefix: &str,
    count: usize,
) -> Vec<tokio::task::JoinHandle<LimitDecision>> {
    (0..count)
        .map(|n| {
            let (s, bundle) = (s.clone(), bundle.clone());
            let id = format!("{prefix}{n}");
            tokio::spawn(async move { s.limiter.decide(&user(&bundle, route, &id), None).await })
        })
        .collect()
}

/// Decisions the shard answers, one a millisecond for `span`: the shard is seen answering while
/// other calls wait.
async fn answer_others_for(s: &Setup, bundle: &PolicyBundle, span: Duration) {
    let started = monotonic_now();
    let mut fast = 0;
    while monotonic_now().duration_since(started) < span {
        let id = format!("fast-{fast}");
        let planned = plan(bundle, "atlas", PrincipalType::User, &id, "read", &id);
        assert!(s.limiter.decide(&planned, None).await.degraded.is_none());
        fast += 1;
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
}

/// A call that overruns its deadline while the shard answers other calls met a slow shard, not a
/// dead one: no breaker failure. When nothing has answered for ten budgets, the same overruns open
/// it.
#[tokio::test(start_paused = true)]
async fn overruns_while_the_shard_answers_others_do_not_open_its_breaker() {
    let clock = Arc::new(ManualClock::new(1 << 42));
    let s = Arc::new(limiter_over(
        Arc::new(InProcessStore::new(clock, 10_000)),
        LimiterConfig {
            decision_budget: Duration::from_millis(50),
            ..config()
        },
    ));
    s.store.hang_marked.store(true, Ordering::SeqCst);
    let bundle = Arc::new(bundle());
    // Decisions the store never answers.
    let hung = spawn_decisions(&s, &bundle, "read", "hang-", 5);
    answer_others_for(&s, &bundle, Duration::from_millis(60)).await;
    for task in hung {
        let decision = task.await.expect("ends");
        assert_eq!(decision.degraded, Some(DegradeCause::DeadlineExceeded));
    }
    assert_eq!(s.limiter.stats().slow_calls, 5);
    assert_eq!(s.limiter.breakers()[0].state, BreakerState::Closed);
    assert_eq!(s.limiter.breakers()[0].recent_failures, 0);

    // Nothing answered for ten budgets: three overruns are three failures, and the breaker opens.
    tokio::time::sleep(Duration::from_millis(500)).await;
    for task in spawn_decisions(&s, &bundle, "read", "hang-alone-", 3) {
        task.await.expect("ends");
    }
    assert_eq!(s.limiter.breakers()[0].state, BreakerState::Open);
    assert_eq!(s.limiter.stats().slow_calls, 5, "none of these was slow");
}

/// The store's own call timeout can notice a missed reply before the limiter's deadline does (both
/// fire together when the agent's thread ran late past them): such an `Ambiguous` past the
/// deadline is judged as an overrun, so it opens no breaker while the shard answers others, and
/// still counts as a failure when nothing has answered.
#[tokio::test(start_paused = true)]
async fn an_ambiguous_reply_past_the_deadline_is_judged_as_an_overrun() {
    let budget = Duration::from_millis(50);
    let clock = Arc::new(ManualClock::new(1 << 42));
    let s = Arc::new(limiter_over(
        Arc::new(InProcessStore::new(clock, 10_000)),
        LimiterConfig {
            decision_budget: budget,
            ..config()
        },
    ));
    let budget_ms = u64::try_from(budget.as_millis()).expect("ms");
    s.store.late_ambiguous_ms.store(budget_ms, Ordering::SeqCst);
    let bundle = Arc::new(bundle());
    // Not idempotent, so each decision is one call whose deadline is the decision's.
    let late = spawn_decisions(&s, &bundle, "slow", "late-", 5);
    answer_others_for(&s, &bundle, budget + budget / 5).await;
    for task in late {
        let decision = task.await.expect("ends");
        assert_eq!(decision.degraded, Some(DegradeCause::Ambiguous));
    }
    assert_eq!(s.limiter.stats().slow_calls, 5);
    assert_eq!(s.limiter.stats().breaker_failures, 0);
    assert_eq!(s.limiter.breakers()[0].state, BreakerState::Closed);
    assert_eq!(s.limiter.breakers()[0].recent_failures, 0);

    // Nothing answered for ten budgets: the same replies are failures, and the breaker opens.
    tokio::time::sleep(budget * 11).await;
    for task in spawn_decisions(&s, &bundle, "slow", "late-alone-", 3) {
        task.await.expect("ends");
    }
    assert_eq!(s.limiter.breakers()[0].state, BreakerState::Open);
    assert_eq!(s.limiter.stats().slow_calls, 5, "none of these was slow");
    assert_eq!(s.limiter.stats().breaker_failures, 3);
}

#[tokio::test(start_paused = true)]
async fn concurrency_lease_calls_share_the_shards_breaker_and_stop_calling_a_hung_store() {
    let clock = Arc::new(ManualClock::new(1 << 42));
    let s = limiter_over(
        Arc::new(InProcessStore::new(clock, 10_000)),
        LimiterConfig {
            decision_budget: Duration::from_millis(50),
            ..config()
        },
    );
    let call = |n: u32| {
        LeaseCall::new(
            "{t:atlas}:c:export".to_owned(),
            3,
            60_000,
            DecisionId::parse(&format!("lease-{n}")).expect("id"),
        )
        .expect("a valid lease call")
    };
    s.store.hang.store(true, Ordering::SeqCst);
    for n in 0..3 {
        let started = monotonic_now();
        let failed = s.limiter.lease(LeaseOp::Acquire, &call(n)).await;
        assert!(
            matches!(failed, Err(StoreError::Ambiguous { .. })),
            "{failed:?}"
        );
        assert_eq!(
            monotonic_now().duration_since(started),
            Duration::from_millis(50),
            "a lease call has the decision budget"
        );
    }
    assert_eq!(s.store.lease_calls.load(Ordering::SeqCst), 3);
    // Three failures open the shard's breaker: lease calls and decisions are refused unsent.
    let refused = s.limiter.lease(LeaseOp::Acquire, &call(3)).await;
    assert!(
        matches!(refused, Err(StoreError::NotExecuted { .. })),
        "{refused:?}"
    );
    assert_eq!(
        s.store.lease_calls.load(Ordering::SeqCst),
        3,
        "nothing sent"
    );
    let bundle = bundle();
    let decision = s.limiter.decide(&user(&bundle, "read", "r-1"), None).await;
    assert_eq!(decision.degraded, Some(DegradeCause::BreakerOpen));
    assert_eq!(s.store.calls(), 0);
    assert_eq!(s.limiter.stats().breaker_refusals, 2);
    // After the cool-down a probe goes through and closes the breaker again.
    s.store.hang.store(false, Ordering::SeqCst);
    s.clock.advance(1_000);
    let held = s
        .limiter
        .lease(LeaseOp::Acquire, &call(4))
        .await
        .expect("the probe reaches the store");
    assert!(held.held);
    assert_eq!(s.limiter.breakers()[0].state, BreakerState::Closed);
}

#[tokio::test(start_paused = true)]
async fn a_hung_idempotent_call_is_retried_once_within_the_same_deadline() {
    let clock = Arc::new(ManualClock::new(1 << 42));
    let s = limiter_over(
        Arc::new(InProcessStore::new(clock, 10_000)),
        LimiterConfig {
            decision_budget: Duration::from_millis(40),
            ..config()
        },
    );
    s.store.hang.store(true, Ordering::SeqCst);
    let bundle = bundle();
    let started = monotonic_now();
    let decision = s
        .limiter
        .decide(&user(&bundle, "export", "e-1"), None)
        .await;
    assert_eq!(decision.degraded, Some(DegradeCause::DeadlineExceeded));
    assert_eq!(
        decision.store_calls, 2,
        "the first attempt had half the budget"
    );
    assert_eq!(s.store.decision_ids(), ["e-1", "e-1"]);
    assert_eq!(
        monotonic_now().duration_since(started),
        Duration::from_millis(40)
    );
    assert_eq!(
        decision.verdict,
        Verdict::Unavailable {
            rule: 1,
            retry_ms: 1_000
        }
    );
}

#[tokio::test]
async fn a_script_rejection_is_a_policy_error_and_is_never_retried() {
    let clock = Arc::new(ManualClock::new(1 << 42));
    let s = limiter_over(Arc::new(InProcessStore::new(clock, 10_000)), config());
    s.store.reject.store(true, Ordering::SeqCst);
    let bundle = bundle();
    let export = user(&bundle, "export", "e-1");
    let decision = s.limiter.decide(&export, None).await;
    assert_eq!(decision.verdict, Verdict::PolicyError);
    assert_eq!(decision.store_calls, 1, "idempotent, yet not retried");
    let contract = decision.to_contract(&export);
    assert_eq!(contract.reason, Some(Reason::PolicyError));
    assert_eq!(http_status(&contract), 503);
    // A policy fault says nothing about the shard's health.
    for n in 0..10 {
        s.limiter
            .decide(&user(&bundle, "export", &format!("e-{n}")), None)
            .await;
    }
    assert_eq!(s.limiter.breakers()[0].state, BreakerState::Closed);
    assert_eq!(s.limiter.stats().policy_errors, 11);
    assert_eq!(RetryAfter::Never.as_wire_ms(), contract.retry_after_ms);
}

#[tokio::test]
async fn a_dead_master_opens_only_its_own_breaker_and_the_other_masters_keep_deciding() {
    let mut cluster = RedisCluster::start(3);
    // Let the live masters serve their slots while one is down (the limiter's deployment setting).
    for node in 0..3 {
        let client = redis::Client::open(cluster.node_url(node)).expect("a node url");
        let mut direct = client
            .get_multiplexed_async_connection()
            .await
            .expect("connects");
        let _: () = redis::cmd("CONFIG")
            .arg("SET")
            .arg("cluster-require-full-coverage")
            .arg("no")
            .query_async(&mut direct)
            .await
            .expect("CONFIG SET");
    }
    let redis = Arc::new(
        RedisStore::connect_cluster(&cluster.seed_urls(), TEST_CONFIG)
            .await
            .expect("connects"),
    );
    assert_eq!(redis.shard_count(), 3, "one shard per master");
    let masters = redis.shard_masters();
    let s = limiter_over(redis.clone(), outage_config());
    assert_eq!(s.limiter.breakers().len(), 3);
    let bundle = bundle();
    // A tenant on each shard; the slot map agrees with the servers' own.
    let connection = redis.connection();
    let mut tenant_of_shard: Vec<Option<String>> = vec![None; 3];
    for n in 0..100 {
        let tenant = format!("tenant-{n}");
        let planned = plan(&bundle, &tenant, PrincipalType::User, "U-1", "read", "r-0");
        let slot: i64 = redis_query(
            &connection,
            redis::cmd("CLUSTER")
                .arg("KEYSLOT")
                .arg(planned.batch.record_key()),
        )
        .await;
        assert_eq!(
            usize::try_from(slot).expect("a slot"),
            crate::limiter::redis_store::key_slot(planned.batch.record_key())
        );
        tenant_of_shard[redis.shard_of(&planned.batch)].get_or_insert(tenant);
    }
    let tenants: Vec<String> = tenant_of_shard
        .into_iter()
        .map(|tenant| tenant.expect("100 tenants cover 3 masters"))
        .collect();

    // Stop the master of shard 0.
    let port = masters[0].rsplit(':').next().expect("host:port");
    let victim = (0..3)
        .find(|&node| cluster.node_url(node).ends_with(&format!(":{port}")))
        .expect("shard 0's master is a node of the cluster");
    cluster.stop_node(victim);
    for n in 0..10 {
        let id = format!("r-{n}");
        let down = plan(
            &bundle,
            &tenants[0],
            PrincipalType::User,
            "U-1",
            "read",
            &id,
        );
        let decision = s.limiter.decide(&down, None).await;
        assert!(decision.fallback(), "{n}: {decision:?}");
        for tenant in &tenants[1..] {
            let up = plan(&bundle, tenant, PrincipalType::User, "U-1", "read", &id);
            let decision = s.limiter.decide(&up, None).await;
            assert!(
                matches!(decision.verdict, Verdict::Store(_)),
                "{tenant}: {decision:?}"
            );
        }
    }
    let states: Vec<BreakerState> = s.limiter.breakers().iter().map(|b| b.state).collect();
    assert_eq!(
        states,
        [
            BreakerState::Open,
            BreakerState::Closed,
            BreakerState::Closed
        ]
    );
}

/// Shadow and soft rules never deny, and an outage of their store must not either: a `closed`
/// shadow rule does not turn the request into `LIMITER_UNAVAILABLE`, and the local fallback decides
/// by the enforced rules alone. Healthy, the advisory rules that would deny are named, in
/// evaluation order.
#[tokio::test(start_paused = true)]
async fn in_an_outage_shadow_rules_neither_deny_nor_fail_the_request_closed() {
    const ADVISORY: &str = r#"{ "bundleVersion": 1, "rules": [
        {"id": "read-user", "scope": "user", "routeGroup": "read", "algorithm": "token_bucket",
         "capacityMillis": 20000, "refillMillis": 2000, "periodMs": 1000,
         "failMode": "local_bounded", "localCapacityMillis": 2000, "localRefillMillis": 250},
        {"id": "plan-shadow", "scope": "tenant", "algorithm": "fixed_window", "limit": 1,
         "windowMs": 60000, "failMode": "closed", "mode": "shadow"},
        {"id": "plan-soft", "scope": "route", "routeGroup": "read", "algorithm": "fixed_window",
         "limit": 1, "windowMs": 60000, "mode": "soft",
         "failMode": "local_bounded", "localCapacityMillis": 1000, "localRefillMillis": 1} ] }"#;
    let bundle = parse_bundle(ADVISORY)
        .and_then(|draft| draft.into_file_bundle())
        .expect("valid");
    let clock = Arc::new(ManualClock::new(1 << 42));
    let s = limiter_over(
        Arc::new(InProcessStore::new(clock, 10_000)),
        LimiterConfig {
            decision_budget: Duration::from_millis(50),
            ..config()
        },
    );
    // Healthy: the second request would be denied by both plans, and is admitted.
    for n in 0..2 {
        let planned = user(&bundle, "read", &format!("ok-{n}"));
        let contract = s.limiter.decide(&planned, None).await.to_contract(&planned);
        assert!(contract.allowed && !contract.fallback, "{contract:?}");
        assert_eq!(
            contract.policy_id.as_deref(),
            Some("read-user"),
            "never an advisory rule"
        );
        let named: Vec<(&str, AdvisoryMode)> = contract
            .violations
            .iter()
            .map(|v| (v.policy_id.as_str(), v.mode))
            .collect();
        if n == 0 {
            assert!(named.is_empty(), "{contract:?}");
        } else {
            assert_eq!(
                named,
                [
                    ("plan-soft", AdvisoryMode::Soft),
                    ("plan-shadow", AdvisoryMode::Shadow)
                ],
                "in evaluation order: route, then tenant"
            );
        }
    }
    // Hung: the enforced rule's local bucket decides, 2 tokens; the closed advisory rules do not
    // fail the request.
    s.store.hang.store(true, Ordering::SeqCst);
    let mut admitted = 0;
    for n in 0..4 {
        let planned = user(&bundle, "read", &format!("hung-{n}"));
        let contract = s.limiter.decide(&planned, None).await.to_contract(&planned);
        assert!(contract.fallback, "{contract:?}");
        assert_ne!(
            contract.reason,
            Some(Reason::LimiterUnavailable),
            "{contract:?}"
        );
        assert_eq!(
            contract.policy_id.as_deref(),
            Some("read-user"),
            "an advisory rule, local_bounded or not, is never the one named: {contract:?}"
        );
        if contract.allowed {
            admitted += 1;
        } else {
            assert_eq!(
                contract.policy_id.as_deref(),
                Some("read-user"),
                "{contract:?}"
            );
        }
    }
    assert_eq!(
        admitted, 2,
        "the enforced rule's local bucket, and nothing else"
    );
}
