//! The allocator's store seam: a small, etcd-shaped key-value interface.
//!
//! The allocator's promises (no grant lost or duplicated in a failover, no grant from a deposed leader)
//! rest on four etcd properties, and this trait exposes exactly those: linearizable reads with a
//! per-key modification revision, multi-key transactions guarded by revision or value comparisons,
//! keys attached to leases that expire, and a revision that strictly increases. Two implementations:
//! [`etcd::EtcdKv`] (production) and [`memory::MemoryKv`] (the embedded default and the simulator),
//! held to the same behaviour by one contract test suite run against both.

pub mod etcd;
pub mod housekeeping;
pub mod memory;

use async_trait::async_trait;

/// A stored value and the revision of its last modification.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Versioned {
    /// The value bytes.
    pub value: Vec<u8>,
    /// The store revision at which the key was last written. Never 0 for a present key.
    pub mod_revision: i64,
}

/// A transaction guard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Compare {
    /// The key's modification revision equals `revision`; `0` means "the key is absent".
    ModRevision {
        /// The key.
        key: String,
        /// The expected revision, or 0 for absent.
        revision: i64,
    },
    /// The key is present and holds exactly `value`.
    Value {
        /// The key.
        key: String,
        /// The expected bytes.
        value: Vec<u8>,
    },
}

/// A transaction write.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Op {
    /// Writes `value` at `key`, attached to `lease` when given (the key is deleted when the lease
    /// expires or is revoked).
    Put {
        /// The key.
        key: String,
        /// The value bytes.
        value: Vec<u8>,
        /// The lease to attach, if any.
        lease: Option<i64>,
    },
    /// Deletes `key` (no effect when absent).
    Delete {
        /// The key.
        key: String,
    },
}

/// The result of a transaction.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TxnOutcome {
    /// Whether every compare held and the ops were applied.
    pub succeeded: bool,
    /// The store revision after the transaction; when it succeeded with ops, the `mod_revision` of every
    /// key it wrote.
    pub revision: i64,
}

/// A store failure.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// The store could not be reached or did not answer in time; the outcome of a write is unknown.
    #[error("store unavailable: {0}")]
    Unavailable(String),
    /// The lease does not exist (expired or revoked).
    #[error("lease {0} not found")]
    LeaseNotFound(i64),
    /// The request was refused by the store (too large, malformed).
    #[error("store refused the request: {0}")]
    Refused(String),
}

/// Largest number of keys one prefix read returns (I10).
pub const MAX_PREFIX_KEYS: usize = 10_000;

/// Most compares, and most ops, in one transaction: etcd's default `--max-txn-ops`. Both stores
/// refuse a larger transaction.
pub const MAX_TXN_OPS: usize = 128;

/// What both stores refuse of a transaction before it is tried: more than [`MAX_TXN_OPS`]
/// compares or ops, or one key written twice (etcd refuses that, and its refusal would read as an
/// unknown outcome; the embedded store would apply both).
pub fn check_txn(compares: &[Compare], ops: &[Op]) -> Result<(), KvError> {
    if compares.len() > MAX_TXN_OPS || ops.len() > MAX_TXN_OPS {
        return Err(KvError::Refused(
            "too many operations in txn request".to_owned(),
        ));
    }
    let mut written = std::collections::HashSet::with_capacity(ops.len());
    for op in ops {
        let key = match op {
            Op::Put { key, .. } | Op::Delete { key } => key,
        };
        if !written.insert(key.as_str()) {
            return Err(KvError::Refused(format!(
                "duplicate key given in txn request: {key}"
            )));
        }
    }
    Ok(())
}

/// The operations the allocator needs from its store.
#[async_trait]
pub trait Kv: Send + Sync + 'static {
    /// Reads one key (linearizable).
    async fn get(&self, key: &str) -> Result<Option<Versioned>, KvError>;

    /// Reads up to [`MAX_TXN_OPS`] keys at one revision in one round trip (linearizable), each
    /// answer at its key's place: a cold start's reads of many pools cost one call, not one each.
    async fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Versioned>>, KvError>;

    /// Reads up to `limit` keys starting with `prefix`, in key order: the first page.
    async fn get_prefix(
        &self,
        prefix: &str,
        limit: usize,
    ) -> Result<Vec<(String, Versioned)>, KvError> {
        self.get_prefix_after(prefix, "", limit).await
    }

    /// Reads up to `limit` keys starting with `prefix`, the last in key order first: where keys
    /// sort by time (UUID v7 lease ids), the newest, which a capped listing must not drop.
    async fn get_prefix_newest(
        &self,
        prefix: &str,
        limit: usize,
    ) -> Result<Vec<(String, Versioned)>, KvError>;

    /// Reads up to `limit` keys starting with `prefix` that sort after `after` (from the first when
    /// `after` is empty), in key order: one page of a listing too long for one read, whatever its
    /// length. A page costs its own size, not the listing's.
    async fn get_prefix_after(
        &self,
        prefix: &str,
        after: &str,
        limit: usize,
    ) -> Result<Vec<(String, Versioned)>, KvError>;

    /// Applies `ops` atomically if every compare holds.
    async fn txn(&self, compares: Vec<Compare>, ops: Vec<Op>) -> Result<TxnOutcome, KvError>;

    /// Creates a lease that expires after `ttl_s` seconds unless kept alive. Returns its id.
    async fn grant_lease(&self, ttl_s: i64) -> Result<i64, KvError>;

    /// Renews a lease for its full TTL. Returns the TTL in seconds; [`KvError::LeaseNotFound`] when it
    /// has already expired.
    async fn keep_alive(&self, lease: i64) -> Result<i64, KvError>;

    /// Revokes a lease, deleting its keys. Revoking an unknown lease is not an error.
    async fn revoke(&self, lease: i64) -> Result<(), KvError>;
}
