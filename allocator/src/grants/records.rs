//! Where grant records live: the store leases that carry them, one per window (records kept a
//! window past it), or, in windows longer than a record is kept, one per ten minutes of commits.

use allot_shared::lease::{GRANT_RECORD_MAX_LIFETIME_MS, PoolWindowState};

use super::{PoolWorker, RECORD_LEASE_BUCKET_MS};

/// Kept beyond the lifetime and the bucket, ms: for two leaders' clocks apart and a slow commit.
const RECORD_LEASE_SLACK_MS: u64 = 300_000;
use crate::kv::KvError;

impl PoolWorker {
    /// The store lease for grant records of `window`: it outlives the window's end by one window
    /// length, so records are kept at least that long and then vanish (bounded retention). In a
    /// window longer than [`GRANT_RECORD_MAX_LIFETIME_MS`] a record is kept that long after its
    /// commit instead, whatever the window's length (asks with older ids are refused): commits
    /// share a store lease per [`RECORD_LEASE_BUCKET_MS`] that lasts the lifetime and a bucket.
    pub(super) async fn record_lease(
        &self,
        window: &PoolWindowState,
        now_ms: u64,
    ) -> Result<i64, KvError> {
        let capped = window.window.length_ms() > GRANT_RECORD_MAX_LIFETIME_MS;
        let bucket = if capped {
            now_ms / RECORD_LEASE_BUCKET_MS
        } else {
            0
        };
        let key = (window.window.end_ms, window.window.length_ms(), bucket);
        if let Some(&lease) = self
            .shared
            .record_leases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .get(&key)
        {
            return Ok(lease);
        }
        // Every grant of the window is committed by its end, and its record must outlive the
        // commit by a window (retries are answered from it) and by the least lifetime (some
        // leader's ledger round copies it).
        let after_end_ms = window
            .window
            .length_ms()
            .max(self.shared.record_min_lifetime_ms);
        let ttl_ms = if capped {
            // Every commit of the bucket is at or after now: each record outlives its commit by
            // the lifetime.
            GRANT_RECORD_MAX_LIFETIME_MS.max(self.shared.record_min_lifetime_ms)
                + RECORD_LEASE_BUCKET_MS
                + RECORD_LEASE_SLACK_MS
        } else {
            window.window.end_ms.saturating_sub(now_ms) + after_end_ms
        };
        let ttl_s = i64::try_from(ttl_ms.div_ceil(1_000)).unwrap_or(i64::MAX);
        let lease = self.shared.kv.grant_lease(ttl_s).await?;
        let mut leases = self
            .shared
            .record_leases
            .lock()
            .unwrap_or_else(|p| p.into_inner());
        leases.retain(|&(end, length, bucket), _| {
            if bucket == 0 {
                end.saturating_add(length) > now_ms
            } else {
                bucket == now_ms / RECORD_LEASE_BUCKET_MS
            }
        });
        leases.insert(key, lease);
        Ok(lease)
    }

    pub(super) fn forget_record_lease(&self, window: &PoolWindowState) {
        self.shared
            .record_leases
            .lock()
            .unwrap_or_else(|p| p.into_inner())
            .retain(|&(end, length, _), _| {
                (end, length) != (window.window.end_ms, window.window.length_ms())
            });
    }
}
