//! The limiter store seam: one narrow async trait, what it answers, and how it fails.
//!
//! Two implementations answer identically (the differential tests hold them to it): [`RedisStore`]
//! runs the Lua scripts on a single Redis or a Redis Cluster, [`InProcessStore`] calls the pure core
//! under a mutex for the embedded default and for tests.
//!
//! Failures are classified by what the caller knows afterwards, because that decides what is safe:
//!
//! | phase | variant | did the decision happen? | safe action |
//! | --- | --- | --- | --- |
//! | before send: no connection, connection refused | [`StoreError::NotExecuted`] | no | degrade, or retry |
//! | the server refused the call (busy, loading, read-only replica, out of memory on the first write, cluster redirect or down) | [`StoreError::NotExecuted`] | no | degrade, or retry |
//! | `NOSCRIPT` | handled inside [`RedisStore`]: load, retry once | | |
//! | the script rejected its arguments or the stored state | [`StoreError::Rejected`] | no | no retry; alert (a policy or client defect) |
//! | timeout or reset after the command was sent | [`StoreError::Ambiguous`] | unknown | retry only with a decision record and the same decision id; never refund |
//! | a reply that breaks the script's contract | [`StoreError::MalformedReply`] | yes, possibly with writes | treat as ambiguous; alert |
//! | the in-process store is full of live keys | [`StoreError::KeyCapReached`] | no | degrade |
//!
//! [`RedisStore`]: super::RedisStore
//! [`InProcessStore`]: super::InProcessStore

use allot_shared::ids::DecisionId;
use allot_shared::limit::ParamError;
use allot_shared::limit::RetryAfter;
use allot_shared::limit::concurrency::Semaphore;
use allot_shared::limit::multi::MultiDecision;

use super::batch::RuleBatch;

/// The decisions, leases and failures of a limiter store.
#[async_trait::async_trait]
pub trait LimiterStore: Send + Sync {
    /// Decides every rule of `batch` atomically at the store's time: all debited, or none.
    ///
    /// With a decision record (`batch.record_ttl_ms() > 0`) a second call with the same decision id
    /// within the record's TTL returns the recorded admission with `replayed = true` and debits
    /// nothing. Only admissions are recorded: a denial debited nothing, so deciding a retried denial
    /// again cannot double-debit, and a flood of denials creates no keys.
    async fn decide(&self, batch: &RuleBatch) -> Result<BatchDecision, StoreError>;

    /// Acquires `call.lease_id` (idempotent: a held lease is answered `held` again, with no second
    /// slot and no extension).
    async fn acquire_lease(&self, call: &LeaseCall) -> Result<LeaseOutcome, StoreError>;

    /// Extends a live lease to at least `now + lease_ttl`; a lapsed or unknown lease is not renewed.
    async fn renew_lease(&self, call: &LeaseCall) -> Result<LeaseOutcome, StoreError>;

    /// Releases the lease (idempotent). `held` says whether it was live before the call.
    async fn release_lease(&self, call: &LeaseCall) -> Result<LeaseOutcome, StoreError>;

    /// How many independently failing shards the store's calls spread over (at least 1). The client
    /// path keeps a circuit breaker and an in-flight bound per shard.
    fn shard_count(&self) -> usize {
        1
    }

    /// The shard that decides `batch`, in `0..shard_count()`.
    fn shard_of(&self, batch: &RuleBatch) -> usize {
        let _ = batch;
        0
    }

    /// The shard that holds `key` (a concurrency lease's key), in `0..shard_count()`.
    fn shard_of_key(&self, key: &str) -> usize {
        let _ = key;
        0
    }

    /// Decisions sent together in coalesced calls of more than one, and such calls, since the
    /// store was made: (0, 0) for a store that sends every decision alone.
    fn coalesced(&self) -> (u64, u64) {
        (0, 0)
    }
}

/// The outcome of [`LimiterStore::decide`]: [`MultiDecision`] without the writes (the store made
/// them), plus whether it is a replay.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct BatchDecision {
    /// True only when every rule admitted the request.
    pub allowed: bool,
    /// Index (0-based, evaluation order) of the first denying (enforced) rule.
    pub denied_by: Option<usize>,
    /// Indexes of the advisory (shadow or soft) rules that would have denied the request; none in
    /// a replay.
    pub advisory_denials: Vec<usize>,
    /// `Ms(0)` when allowed; otherwise the maximum over denying rules, [`RetryAfter::Never`]
    /// dominating.
    pub retry: RetryAfter,
    /// Per rule, what is left in its own unit (millitokens or units): after the debit when allowed,
    /// untouched when denied. A replay returns the recorded decision's values.
    pub remaining: Vec<u64>,
    /// True when this is a recorded admission returned again for the same decision id.
    pub replayed: bool,
}

impl BatchDecision {
    /// The store-facing view of the pure core's decision (not a replay).
    pub fn from_multi(decision: &MultiDecision) -> Self {
        Self {
            allowed: decision.allowed,
            denied_by: decision.denied_by,
            advisory_denials: decision.advisory_denials.clone(),
            retry: decision.retry,
            remaining: decision.remaining.clone(),
            replayed: false,
        }
    }
}

/// One concurrency-lease operation: which lease set, its semaphore, and whose lease.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseCall {
    key: String,
    max_in_flight: u64,
    lease_ttl_ms: u64,
    semaphore: Semaphore,
    lease_id: DecisionId,
}

impl LeaseCall {
    /// A call on the lease set `key` (see `allot_shared::keys::concurrency_key`), allowing
    /// `max_in_flight` live leases of `lease_ttl_ms` each. The lease id is in practice the decision
    /// id of the admitted request. Parameters are validated like [`Semaphore::new`].
    pub fn new(
        key: String,
        max_in_flight: u64,
        lease_ttl_ms: u64,
        lease_id: DecisionId,
    ) -> Result<Self, ParamError> {
        let semaphore = Semaphore::new(max_in_flight, lease_ttl_ms)?;
        Ok(Self {
            key,
            max_in_flight,
            lease_ttl_ms,
            semaphore,
            lease_id,
        })
    }

    /// The lease set's key.
    pub fn key(&self) -> &str {
        &self.key
    }

    /// The cap on live leases.
    pub fn max_in_flight(&self) -> u64 {
        self.max_in_flight
    }

    /// How long a lease lives unless renewed, in ms.
    pub fn lease_ttl_ms(&self) -> u64 {
        self.lease_ttl_ms
    }

    /// The validated semaphore, for stores that run the pure core.
    pub fn semaphore(&self) -> &Semaphore {
        &self.semaphore
    }

    /// The lease's id.
    pub fn lease_id(&self) -> &DecisionId {
        &self.lease_id
    }
}

/// The three lease operations, for stores that implement them in one place.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum LeaseOperation {
    Acquire,
    Renew,
    Release,
}

/// The answer to a lease operation.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseOutcome {
    /// Acquire: the lease is held. Renew: it was live and was extended. Release: it was live.
    pub held: bool,
    /// Live leases after the operation.
    pub in_flight: u64,
}

/// Why the script refused a call. Nothing was written.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Rejection {
    /// An argument is out of bounds (e.g. a cost above 2^40 millitokens): a policy or client defect.
    InvalidArgument,
    /// A key holds the state of another algorithm, or a corrupt value (e.g. a rule's algorithm
    /// changed while its key lived).
    StateMismatch,
    /// The script failed in a way its contract does not name (a script defect).
    ScriptDefect,
}

/// A store call that did not produce a decision. See the module docs for what each means.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The decision did not happen: the call never reached the store, or the store refused it
    /// before the script changed anything. Safe to degrade or to retry.
    #[error("not executed: {detail}")]
    NotExecuted {
        /// What happened, for logs.
        detail: String,
    },
    /// The script refused the call and wrote nothing. Retrying cannot help; alert.
    #[error("rejected ({kind:?}): {detail}")]
    Rejected {
        /// Why.
        kind: Rejection,
        /// The script's message, for logs.
        detail: String,
    },
    /// The call was sent, but no reply arrived in time or the connection broke: the script may have
    /// run and debited. Retry only with a decision record (same decision id); never refund.
    #[error("ambiguous: {detail}")]
    Ambiguous {
        /// What happened, for logs.
        detail: String,
    },
    /// The script ran (and may have written) but its reply does not match its contract: the client
    /// and the loaded script disagree. Treat as ambiguous; alert.
    #[error("malformed reply: {detail}")]
    MalformedReply {
        /// What was wrong with the reply.
        detail: String,
    },
    /// The in-process store holds its maximum number of live keys (I10); nothing was written.
    #[error("the in-process limiter store holds its maximum of {max_keys} live keys")]
    KeyCapReached {
        /// The configured cap.
        max_keys: usize,
    },
}
