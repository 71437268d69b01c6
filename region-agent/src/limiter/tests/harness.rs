//! Stores under test, their clocks, and direct views of their keys.
//!
//! Redis tests drive time through the scripts' test clock, set far ahead of the real clock
//! ([`FUTURE_BASE_MS`]): the scripts set expiries on that clock (`PEXPIREAT now + ttl`), so Redis's own
//! expiry never fires during a test, and [`Subject::expire`] applies expiry on the test clock instead,
//! exactly as the in-process store does (a key is gone once `now > expires_at`). That makes expiry
//! part of what the stores are compared on, read back through `PEXPIRETIME`.

use std::sync::Arc;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::time::Duration;

use allot_shared::clock::{Clock, ManualClock};
use allot_shared::ids::{DecisionId, TenantId};
use allot_shared::limit::concurrency::{HeldLease, SemaphoreState};
use allot_shared::limit::fixed_window::FixedWindowState;
use allot_shared::limit::gcra::GcraState;
use allot_shared::limit::multi::State;
use allot_shared::limit::sliding_counter::SlidingCounterState;
use allot_shared::limit::sliding_log::{LogEntry, SlidingLogState};
use allot_shared::limit::token_bucket::TokenBucketState;
use allot_testkit::{RedisCluster, RedisServer};

use crate::limiter::batch::{BatchRule, RuleBatch, RuleParams};
use crate::limiter::coalescing::DEFAULT_CALLS_IN_FLIGHT_PER_SLOT;
use crate::limiter::in_process::{InProcessStore, Stored};
use crate::limiter::redis_store::{Connection, RedisStore, RedisStoreConfig, StateLayout};
use crate::limiter::store::{BatchDecision, LeaseCall, LeaseOutcome, LimiterStore, StoreError};

/// 2^42 ms, in the year 2109: test clocks start here, far ahead of the real clock.
pub(super) const FUTURE_BASE_MS: u64 = 1 << 42;

/// Generous deadlines: tests run on small, busy machines; nothing here asserts latency.
pub(super) const TEST_CONFIG: RedisStoreConfig = RedisStoreConfig {
    call_timeout: Duration::from_secs(10),
    connect_timeout: Duration::from_secs(10),
    coalesce: true,
    coalesced_calls_in_flight: DEFAULT_CALLS_IN_FLIGHT_PER_SLOT,
    state_layout: StateLayout::Strings,
};

/// How long tests wait for a restarted server to answer before failing.
pub(super) const RECOVERY_DEADLINE: Duration = Duration::from_secs(20);

pub(super) fn tenant(name: &str) -> TenantId {
    TenantId::parse(name).expect("a valid tenant id")
}

pub(super) fn decision_id(text: &str) -> DecisionId {
    DecisionId::parse(text).expect("a valid decision id")
}

/// The key of a rule named `name` under `tenant`'s hash tag.
pub(super) fn rule_key(tenant: &TenantId, name: &str) -> String {
    format!("rl:v1:{{t:{tenant}}}:{name}")
}

/// A batch of `(key name, params, cost)` rules for `tenant`.
pub(super) fn batch(
    tenant: &TenantId,
    id: &str,
    record_ttl_ms: u64,
    rules: &[(&str, RuleParams, u64)],
) -> RuleBatch {
    let rules = rules
        .iter()
        .map(|(name, params, cost)| {
            BatchRule::new(rule_key(tenant, name), *params, *cost).expect("valid parameters")
        })
        .collect();
    RuleBatch::new(tenant, decision_id(id), record_ttl_ms, rules).expect("a valid batch")
}

/// P-READ: 20 tokens, refilling 2 per second, 5 s TTL slack.
pub(super) const P_READ: RuleParams = RuleParams::TokenBucket {
    capacity_millitokens: 20_000,
    refill_millitokens: 2_000,
    period_ms: 1_000,
    slack_ms: 5_000,
};

/// P-TENANT: 1,000 tokens per minute.
pub(super) const P_TENANT: RuleParams = RuleParams::TokenBucket {
    capacity_millitokens: 1_000_000,
    refill_millitokens: 1_000_000,
    period_ms: 60_000,
    slack_ms: 5_000,
};

/// Two stores on one server taking decisions in turns (leases go to the first).
struct Alternating {
    stores: [Arc<RedisStore>; 2],
    next: AtomicUsize,
}

#[async_trait::async_trait]
impl LimiterStore for Alternating {
    async fn decide(&self, batch: &RuleBatch) -> Result<BatchDecision, StoreError> {
        let turn = self.next.fetch_add(1, Ordering::Relaxed) % 2;
        self.stores[turn].decide(batch).await
    }

    async fn acquire_lease(&self, call: &LeaseCall) -> Result<LeaseOutcome, StoreError> {
        self.stores[0].acquire_lease(call).await
    }

    async fn renew_lease(&self, call: &LeaseCall) -> Result<LeaseOutcome, StoreError> {
        self.stores[0].renew_lease(call).await
    }

    async fn release_lease(&self, call: &LeaseCall) -> Result<LeaseOutcome, StoreError> {
        self.stores[0].release_lease(call).await
    }

    fn coalesced(&self) -> (u64, u64) {
        let [(a_decisions, a_calls), (b_decisions, b_calls)] =
            [self.stores[0].coalesced(), self.stores[1].coalesced()];
        (a_decisions + b_decisions, a_calls + b_calls)
    }
}

/// Where a subject's keys can be inspected.
enum Keys {
    InProcess(Arc<InProcessStore>),
    Redis {
        store: Arc<RedisStore>,
        connection: Connection,
    },
}

/// One store under test, with the clock that drives it and a direct view of its keys.
pub(super) struct Subject {
    // Invariant: the store is declared before the servers it talks to, so it drops first.
    pub(super) store: Arc<dyn LimiterStore>,
    pub(super) clock: Arc<ManualClock>,
    keys: Keys,
    pub(super) redis: Option<RedisServer>,
    pub(super) cluster: Option<RedisCluster>,
}

impl Subject {
    pub(super) fn in_process() -> Self {
        let clock = Arc::new(ManualClock::new(FUTURE_BASE_MS));
        let store = Arc::new(InProcessStore::new(clock.clone(), 1_000_000));
        Self {
            store: store.clone(),
            clock,
            keys: Keys::InProcess(store),
            redis: None,
            cluster: None,
        }
    }

    /// A fresh Redis server with a store on it, driven by the test clock. Call it on the test's own
    /// thread: the server dies with the thread that started it.
    pub(super) async fn redis_single() -> Self {
        Self::redis_single_with(TEST_CONFIG).await
    }

    /// A fresh Redis server and a store on it with `config`.
    pub(super) async fn redis_single_with(config: RedisStoreConfig) -> Self {
        let server = RedisServer::start();
        let store = RedisStore::connect(&server.url(), config)
            .await
            .expect("connects");
        Self::redis(store, Some(server), None)
    }

    /// A fresh Redis server and a store on it that calls the decide library as written (its marked
    /// steps called, not inlined).
    pub(super) async fn redis_single_as_written() -> Self {
        let server = RedisServer::start();
        let store = RedisStore::connect(&server.url(), TEST_CONFIG)
            .await
            .expect("connects")
            .with_decide_library_as_written()
            .await;
        Self::redis(store, Some(server), None)
    }

    /// A fresh Redis server shared, as in a rolling upgrade, by a store that writes rule state as
    /// strings and one that writes it as hashes: decisions alternate between them, so each finds
    /// the other's layout. Key inspection and coalesced calls use the hash-writing store.
    pub(super) async fn redis_rolling_upgrade() -> Self {
        let server = RedisServer::start();
        let clock = Arc::new(ManualClock::new(FUTURE_BASE_MS));
        let connect = async |state_layout| {
            let config = RedisStoreConfig {
                state_layout,
                ..TEST_CONFIG
            };
            let store = RedisStore::connect(&server.url(), config)
                .await
                .expect("connects");
            Arc::new(store.with_test_clock(clock.clone()))
        };
        let strings = connect(StateLayout::Strings).await;
        let hashes = connect(StateLayout::Hashes).await;
        Self {
            keys: Keys::Redis {
                connection: hashes.connection(),
                store: hashes.clone(),
            },
            store: Arc::new(Alternating {
                stores: [strings, hashes],
                next: AtomicUsize::new(0),
            }),
            clock,
            redis: Some(server),
            cluster: None,
        }
    }

    /// A fresh 3-master cluster with a store on it, driven by the test clock.
    pub(super) async fn redis_cluster() -> Self {
        let cluster = RedisCluster::start(3);
        let store = RedisStore::connect_cluster(&cluster.seed_urls(), TEST_CONFIG)
            .await
            .expect("connects");
        Self::redis(store, None, Some(cluster))
    }

    fn redis(
        store: RedisStore,
        server: Option<RedisServer>,
        cluster: Option<RedisCluster>,
    ) -> Self {
        let clock = Arc::new(ManualClock::new(FUTURE_BASE_MS));
        let store = Arc::new(store.with_test_clock(clock.clone()));
        Self {
            keys: Keys::Redis {
                connection: store.connection(),
                store: store.clone(),
            },
            store,
            clock,
            redis: server,
            cluster,
        }
    }

    pub(super) fn now(&self) -> u64 {
        self.clock.now_ms()
    }

    pub(super) fn set_now(&self, now_ms: u64) {
        assert!(
            now_ms >= FUTURE_BASE_MS / 2,
            "test clocks stay far ahead of the real clock"
        );
        self.clock.set(now_ms);
    }

    pub(super) async fn decide(&self, batch: &RuleBatch) -> Result<BatchDecision, StoreError> {
        self.expire(
            &std::iter::once(batch.record_key())
                .chain(batch.rules().iter().map(BatchRule::key))
                .collect::<Vec<_>>(),
        )
        .await;
        self.store.decide(batch).await
    }

    /// Applies expiry at the test clock's now to `keys` (Redis only: the in-process store does it
    /// itself). A key without a TTL fails the test: every write must set one.
    pub(super) async fn expire(&self, keys: &[&str]) {
        let Keys::Redis { connection, .. } = &self.keys else {
            return;
        };
        let now_ms = self.now();
        for key in keys {
            let expires_at: i64 = redis_query(connection, redis::cmd("PEXPIRETIME").arg(key)).await;
            assert_ne!(expires_at, -1, "{key} has no TTL");
            if u64::try_from(expires_at).is_ok_and(|at| at < now_ms) {
                let _: i64 = redis_query(connection, redis::cmd("DEL").arg(key)).await;
            }
        }
    }

    /// The key's expiry (epoch ms on the store's clock), or `None` when it does not exist.
    pub(super) async fn expires_at(&self, key: &str) -> Option<u64> {
        match &self.keys {
            Keys::InProcess(store) => store.peek(key).map(|(_, at)| at),
            Keys::Redis { connection, .. } => {
                let at: i64 = redis_query(connection, redis::cmd("PEXPIRETIME").arg(key)).await;
                assert_ne!(at, -1, "{key} has no TTL");
                u64::try_from(at).ok()
            }
        }
    }

    /// A token bucket's stored state; on Redis read with `GET key`.
    pub(super) async fn token_bucket(&self, key: &str) -> Option<TokenBucketState> {
        match self.rule_state(key, &P_READ).await {
            Some(State::TokenBucket(state)) => Some(state),
            None => None,
            Some(other) => panic!("{key} holds {other:?}"),
        }
    }

    /// The stored state of a rule with `params` under `key`, in the pure core's terms. Sliding-log
    /// entries are ordered by (time, member), whatever the store's own order.
    pub(super) async fn rule_state(&self, key: &str, params: &RuleParams) -> Option<State> {
        let mut state = match &self.keys {
            Keys::InProcess(store) => match store.peek(key)? {
                (Stored::Rule(state), _) => state,
                (other, _) => panic!("{key} holds {other:?}"),
            },
            Keys::Redis { connection, .. } => redis_rule_state(connection, key, params).await?,
        };
        if let State::SlidingLog(log) = &mut state {
            log.entries
                .sort_by(|a, b| (a.admitted_at_ms, &a.member).cmp(&(b.admitted_at_ms, &b.member)));
        }
        Some(state)
    }

    /// The stored remaining values of a decision record.
    pub(super) async fn record(&self, key: &str) -> Option<Vec<u64>> {
        match &self.keys {
            Keys::InProcess(store) => match store.peek(key)? {
                (Stored::Record(decision), _) => Some(decision.remaining),
                (other, _) => panic!("{key} holds {other:?}"),
            },
            Keys::Redis { connection, .. } => {
                let text: Option<String> =
                    redis_query(connection, redis::cmd("GET").arg(key)).await;
                text.map(|text| {
                    text.split(' ')
                        .map(|n| n.parse().expect("integers"))
                        .collect()
                })
            }
        }
    }

    /// A lease set, ordered by (expiry, id).
    pub(super) async fn leases(&self, key: &str) -> Option<SemaphoreState> {
        let mut leases = match &self.keys {
            Keys::InProcess(store) => match store.peek(key)? {
                (Stored::Leases(state), _) => state,
                (other, _) => panic!("{key} holds {other:?}"),
            },
            Keys::Redis { connection, .. } => {
                let members: Vec<(String, u64)> = redis_query(
                    connection,
                    redis::cmd("ZRANGE")
                        .arg(key)
                        .arg(0)
                        .arg(-1)
                        .arg("WITHSCORES"),
                )
                .await;
                if members.is_empty() {
                    return None;
                }
                SemaphoreState {
                    leases: members
                        .into_iter()
                        .map(|(lease_id, expires_at_ms)| HeldLease {
                            lease_id,
                            expires_at_ms,
                        })
                        .collect(),
                }
            }
        };
        leases
            .leases
            .sort_by(|a, b| (a.expires_at_ms, &a.lease_id).cmp(&(b.expires_at_ms, &b.lease_id)));
        Some(leases)
    }

    /// A direct connection to the store's Redis (panics for the in-process store).
    pub(super) fn redis_connection(&self) -> Connection {
        match &self.keys {
            Keys::Redis { connection, .. } => connection.clone(),
            Keys::InProcess(_) => panic!("not a Redis subject"),
        }
    }

    /// The Redis store itself (panics for the in-process store).
    pub(super) fn redis_store(&self) -> &RedisStore {
        match &self.keys {
            Keys::Redis { store, .. } => store,
            Keys::InProcess(_) => panic!("not a Redis subject"),
        }
    }
}

pub(super) async fn redis_query<T: redis::FromRedisValue>(
    connection: &Connection,
    cmd: &redis::Cmd,
) -> T {
    connection
        .clone()
        .query(cmd)
        .await
        .unwrap_or_else(|e| panic!("{cmd:?}: {e}"))
}

/// Reads a rule's Redis key into the pure core's state, by the layout documented in decide.lua.
async fn redis_rule_state(
    connection: &Connection,
    key: &str,
    params: &RuleParams,
) -> Option<State> {
    // A tb, fw or sc state: its algorithm's letter, then its numbers one space apart; or the hash
    // of those `fields`.
    let numbers = async |letter: char, fields: &[&str]| -> Option<Vec<u64>> {
        let count = fields.len();
        let layout: String = redis_query(connection, redis::cmd("TYPE").arg(key)).await;
        if layout == "hash" {
            let values: Vec<Option<u64>> =
                redis_query(connection, redis::cmd("HMGET").arg(key).arg(fields)).await;
            let values: Option<Vec<u64>> = values.into_iter().collect();
            return Some(values.unwrap_or_else(|| panic!("{key}: a field is missing")));
        }
        let stored: Option<String> = redis_query(connection, redis::cmd("GET").arg(key)).await;
        let stored = stored?;
        let body = stored
            .strip_prefix(letter)
            .unwrap_or_else(|| panic!("{key}: {stored:?} is not a {letter} state"));
        let numbers: Vec<u64> = body
            .split(' ')
            .map(|n| n.parse().unwrap_or_else(|_| panic!("{key}: {stored:?}")))
            .collect();
        assert_eq!(numbers.len(), count, "{key}: {stored:?}");
        Some(numbers)
    };
    Some(match params {
        RuleParams::TokenBucket { .. } => {
            let n = numbers('t', &["tk", "ts"]).await?;
            State::TokenBucket(TokenBucketState {
                tokens_millitokens: n[0],
                updated_at_ms: n[1],
            })
        }
        RuleParams::Gcra { .. } => {
            let tat: Option<u64> = redis_query(connection, redis::cmd("GET").arg(key)).await;
            State::Gcra(GcraState { tat_ms: tat? })
        }
        RuleParams::FixedWindow { .. } => {
            let n = numbers('f', &["w", "n"]).await?;
            State::FixedWindow(FixedWindowState {
                window_start_ms: n[0],
                count_units: n[1],
            })
        }
        RuleParams::SlidingCounter { .. } => {
            let n = numbers('s', &["w", "cur", "prev"]).await?;
            State::SlidingCounter(SlidingCounterState {
                window_start_ms: n[0],
                current_units: n[1],
                previous_units: n[2],
            })
        }
        RuleParams::SlidingLog { .. } => {
            let members: Vec<(String, u64)> = redis_query(
                connection,
                redis::cmd("ZRANGE")
                    .arg(key)
                    .arg(0)
                    .arg(-1)
                    .arg("WITHSCORES"),
            )
            .await;
            if members.is_empty() {
                return None;
            }
            State::SlidingLog(SlidingLogState {
                entries: members
                    .into_iter()
                    .map(|(member, admitted_at_ms)| LogEntry {
                        admitted_at_ms,
                        member,
                    })
                    .collect(),
            })
        }
    })
}
