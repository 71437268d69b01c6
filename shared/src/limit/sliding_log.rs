//! Sliding-window log: one entry per admitted request, counted over the trailing window
//! `(now - window, now]`. Exact, with no boundary burst, at a memory price of O(limit) per key.
//!
//! The member is the decision id, never the timestamp: two requests in the same millisecond are two
//! entries, and a retry of an already admitted request finds its entry and is answered "allowed" without
//! counting twice (idempotent replay within the window).

use super::{Decision, ParamError, RetryAfter, check_capacity_times_period, check_param};

/// Validated sliding-log parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlidingLog {
    limit_units: u64,
    window_ms: u64,
}

/// One admitted request.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct LogEntry {
    /// When it was admitted, epoch ms.
    pub admitted_at_ms: u64,
    /// Its unique member, the decision id.
    pub member: String,
}

/// Stored log: entries ordered by admission time. Holds at most `limit` live entries (bounded, I10).
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct SlidingLogState {
    /// Admitted requests, oldest first.
    pub entries: Vec<LogEntry>,
}

impl SlidingLog {
    /// Validates: limit and window in `[1, 2^40]`, `limit * window <= 2^52`.
    pub fn new(limit_units: u64, window_ms: u64) -> Result<Self, ParamError> {
        check_param("limit", limit_units, 1)?;
        check_param("windowMs", window_ms, 1)?;
        check_capacity_times_period("limit", limit_units, window_ms)?;
        Ok(Self {
            limit_units,
            window_ms,
        })
    }

    /// The limit, in units.
    pub fn limit_units(&self) -> u64 {
        self.limit_units
    }

    /// The window length, in ms.
    pub fn window_ms(&self) -> u64 {
        self.window_ms
    }

    /// Units left in the trailing window of `now_ms` without admitting anything.
    pub fn available_units(&self, state: Option<&SlidingLogState>, now_ms: u64) -> u64 {
        let live = state.map_or(0, |s| {
            s.entries
                .iter()
                .filter(|e| e.admitted_at_ms.saturating_add(self.window_ms) > now_ms)
                .count()
        });
        self.limit_units.saturating_sub(live as u64)
    }

    /// Decides the request `member` (unit cost) at `now_ms`. Expired entries are trimmed from the
    /// state that is written; a denial writes nothing (trimming is invisible to later decisions).
    pub fn decide(
        &self,
        state: Option<&SlidingLogState>,
        now_ms: u64,
        member: &str,
    ) -> Result<Decision<SlidingLogState>, ParamError> {
        // An entry is live while `admitted_at > now - window`: one admitted exactly a window ago has
        // just left.
        let live: Vec<&LogEntry> = state
            .map(|s| {
                s.entries
                    .iter()
                    .filter(|e| e.admitted_at_ms.saturating_add(self.window_ms) > now_ms)
                    .collect()
            })
            .unwrap_or_default();
        let count = live.len() as u64;
        if live.iter().any(|e| e.member == member) {
            // Replay of an admitted request: same answer, nothing counted again.
            return Ok(Decision {
                allowed: true,
                remaining: self.limit_units.saturating_sub(count),
                retry: RetryAfter::Ms(0),
                write: None,
            });
        }
        if count >= self.limit_units {
            let oldest_ms = live
                .iter()
                .map(|e| e.admitted_at_ms)
                .min()
                .unwrap_or(now_ms);
            let retry_ms = (oldest_ms + self.window_ms).saturating_sub(now_ms).max(1);
            return Ok(Decision::deny(0, RetryAfter::Ms(retry_ms)));
        }
        let mut entries: Vec<LogEntry> = live.into_iter().cloned().collect();
        let at = entries.partition_point(|e| e.admitted_at_ms <= now_ms);
        entries.insert(
            at,
            LogEntry {
                admitted_at_ms: now_ms,
                member: member.to_owned(),
            },
        );
        debug_assert!(entries.len() as u64 <= self.limit_units);
        let remaining = self.limit_units - entries.len() as u64;
        // The key must live until its newest entry leaves the window; after a clock step back that
        // entry can be later than now.
        let newest_ms = entries
            .last()
            .map_or(now_ms, |e| e.admitted_at_ms.max(now_ms));
        let ttl_ms = newest_ms + self.window_ms - now_ms;
        Ok(Decision::allow(
            remaining,
            SlidingLogState { entries },
            ttl_ms,
        ))
    }
}

/// Checks a cost for the sliding log: only unit cost is supported (one entry per request).
pub fn check_unit_cost(cost_units: u64) -> Result<(), ParamError> {
    if cost_units != 1 {
        return Err(ParamError {
            field: "costMillis",
            value: cost_units,
            expected: "exactly 1,000 (one unit) for sliding_log",
        });
    }
    check_param("cost", cost_units, 1).map(|_| ())
}
