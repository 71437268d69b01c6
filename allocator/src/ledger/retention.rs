//! Retention: what the ledger stops keeping, and when. The leader removes it each ledger round in
//! batches of [`RETENTION_BATCH_ROWS`] rows, each its own short statement, so reports written
//! meanwhile never wait behind a long delete; at most [`MAX_RETENTION_BATCHES`] batches a table a
//! round (I10), the rest the next round.
//!
//! - raw reports (`lease_reports`, each with the JSON an agent sent) after the raw retention: their
//!   amounts live on in `lease_spend` and `fallback_admits`, and a retried report older than that
//!   is applied again harmlessly (every amount kept is the largest reported);
//! - the raw rows of windows that ended before the raw retention (grants, each lease's spend, the
//!   per-window admits), once rolled up into `window_amounts` ([`super::rollup`]), at most
//!   [`MAX_ROLLUP_WINDOWS_PER_ROUND`](super::rollup::MAX_ROLLUP_WINDOWS_PER_ROUND) windows a
//!   round;
//! - rolled-up windows (`window_amounts`) and window checks (`bound_checks`) whose window ended
//!   before the rollup retention;
//! - agent sessions (`agent_sessions`) whose run ended, or started, before the rollup retention
//!   and whose unclean start is as old: the region's mark in `agent_session_regions` stays, so the
//!   agent's next run is judged as after an unclean end (it presumes its window's fallback used),
//!   never as the region's first.

use std::collections::BTreeMap;

use serde::{Deserialize, Serialize};

use super::{Database, Ledger, LedgerError, i64_of};

/// Raw reports are kept this many days by default.
pub const DEFAULT_RAW_RETENTION_DAYS: u64 = 7;
/// Window checks and agent sessions are kept this many days by default: a yearly invoice can be
/// checked against its windows, and no session is forgotten while a window it could taint (a
/// calendar month, or a fixed window of up to a year) is open.
pub const DEFAULT_ROLLUP_RETENTION_DAYS: u64 = 400;
/// The longest retention either can be set to, days.
pub const MAX_RETENTION_DAYS: u64 = 36_500;
/// Rows one removal statement takes at most.
pub const RETENTION_BATCH_ROWS: u64 = 1_000;
/// Removal statements per table per round at most.
pub const MAX_RETENTION_BATCHES: u64 = 100;

const DAY_MS: u64 = 86_400_000;

/// How long the ledger keeps what, days (0: for ever).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Retention {
    /// Raw reports, grants, lease spend and per-window admits.
    pub raw_days: u64,
    /// Rolled-up windows, window checks and agent sessions.
    pub rollup_days: u64,
}

impl Default for Retention {
    fn default() -> Self {
        Self {
            raw_days: DEFAULT_RAW_RETENTION_DAYS,
            rollup_days: DEFAULT_ROLLUP_RETENTION_DAYS,
        }
    }
}

impl Retention {
    /// Rows older than this (epoch ms) are removed; `None` keeps them for ever.
    fn cutoff_ms(days: u64, now_ms: u64) -> Option<u64> {
        (days > 0).then(|| now_ms.saturating_sub(days.saturating_mul(DAY_MS)))
    }
}

/// What one round removed.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct Removed {
    /// Windows rolled up, their raw rows removed.
    pub windows_rolled_up: u64,
    /// Rows removed, by table.
    pub rows: BTreeMap<&'static str, u64>,
}

impl Removed {
    /// Rows removed from `table`.
    pub fn from(&self, table: &str) -> u64 {
        self.rows.get(table).copied().unwrap_or(0)
    }
}

/// Each table's removal: a batch of the oldest rows past `$1`, at most `$2` of them, by key.
const REMOVE_REPORTS_SQL: &str = "\
DELETE FROM lease_reports WHERE report_id IN (
    SELECT report_id FROM lease_reports WHERE received_at_ms < $1 LIMIT $2)";
const REMOVE_BOUND_CHECKS_SQL: &str = "\
DELETE FROM bound_checks WHERE (tenant, pool, window_start_ms) IN (
    SELECT tenant, pool, window_start_ms FROM bound_checks WHERE window_end_ms < $1 LIMIT $2)";
const REMOVE_WINDOW_AMOUNTS_SQL: &str = "\
DELETE FROM window_amounts WHERE (tenant, pool, window_start_ms, region) IN (
    SELECT tenant, pool, window_start_ms, region FROM window_amounts WHERE window_end_ms < $1
    LIMIT $2)";
const REMOVE_AGENT_SESSIONS_SQL: &str = "\
DELETE FROM agent_sessions WHERE (region, agent_id) IN (
    SELECT region, agent_id FROM agent_sessions
    WHERE COALESCE(ended_at_ms, started_at_ms) < $1 AND COALESCE(unclean_start_ms, 0) < $1
    LIMIT $2)";

impl Ledger {
    /// Removes, at `now_ms`, what `retention` no longer keeps: at most [`MAX_RETENTION_BATCHES`]
    /// batches a table. What it removed.
    pub async fn remove_expired(
        &self,
        retention: Retention,
        now_ms: u64,
    ) -> Result<Removed, LedgerError> {
        let raw = Retention::cutoff_ms(retention.raw_days, now_ms);
        let rollup = Retention::cutoff_ms(retention.rollup_days, now_ms);
        let mut removed = Removed::default();
        if let Some(cutoff_ms) = raw {
            let rolled = self.roll_up_windows(cutoff_ms, now_ms).await?;
            removed.windows_rolled_up = rolled.windows;
            removed.rows = rolled.rows_removed;
        }
        for (table, sql, cutoff) in [
            ("lease_reports", REMOVE_REPORTS_SQL, raw),
            ("window_amounts", REMOVE_WINDOW_AMOUNTS_SQL, rollup),
            ("bound_checks", REMOVE_BOUND_CHECKS_SQL, rollup),
            ("agent_sessions", REMOVE_AGENT_SESSIONS_SQL, rollup),
        ] {
            let rows = self.remove_in_batches(sql, cutoff).await?;
            *removed.rows.entry(table).or_default() += rows;
        }
        Ok(removed)
    }

    /// Runs `sql` (`$1` the cutoff, `$2` the batch) until a batch removes less than a whole one,
    /// or [`MAX_RETENTION_BATCHES`] times. Rows removed.
    async fn remove_in_batches(
        &self,
        sql: &str,
        cutoff_ms: Option<u64>,
    ) -> Result<u64, LedgerError> {
        let Some(cutoff_ms) = cutoff_ms else {
            return Ok(0);
        };
        let mut removed = 0;
        for _ in 0..MAX_RETENTION_BATCHES {
            macro_rules! remove {
                ($pool:expr) => {
                    sqlx::query(sql)
                        .bind(i64_of(cutoff_ms))
                        .bind(i64_of(RETENTION_BATCH_ROWS))
                        .execute($pool)
                        .await?
                        .rows_affected()
                };
            }
            let batch = match &self.database {
                Database::Sqlite(pool) => remove!(pool),
                Database::Postgres(pool) => remove!(pool),
            };
            removed += batch;
            if batch < RETENTION_BATCH_ROWS {
                break;
            }
        }
        Ok(removed)
    }
}
