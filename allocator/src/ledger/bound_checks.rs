//! The overshoot bound, checked for every window once it has ended: a row a window, written once,
//! so the counts are the ledger's (the same after a restart or a failover), not one process's.

use std::collections::BTreeMap;

use allot_shared::ids::{PoolId, TenantId};
use sea_query::{Expr, OnConflict, Order, PostgresQueryBuilder, Query, SqliteQueryBuilder};
use sea_query_binder::SqlxBinder;
use serde::{Deserialize, Serialize};

use super::schema::BoundChecks;
use super::{Database, Ledger, LedgerError, WindowRow, i64_of, u64_of};

/// Every column of a check, in the order rows are written and read.
const CHECK_COLUMNS: [BoundChecks; 7] = [
    BoundChecks::Tenant,
    BoundChecks::Pool,
    BoundChecks::WindowStartMs,
    BoundChecks::WindowEndMs,
    BoundChecks::Admitted,
    BoundChecks::Bound,
    BoundChecks::CheckedAtMs,
];

/// A check whose window admitted more than its bound.
fn violated() -> sea_query::SimpleExpr {
    Expr::col(BoundChecks::Admitted).gt(Expr::col(BoundChecks::Bound))
}

/// Most recent violations a summary lists (I10).
pub const MAX_RECENT_VIOLATIONS: u64 = 100;

/// One window that admitted more than its bound.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct BoundViolation {
    /// The pool's tenant.
    pub tenant: String,
    /// The pool.
    pub pool: String,
    /// Window start, epoch ms.
    #[sqlx(try_from = "i64")]
    pub window_start_ms: u64,
    /// Window end, epoch ms.
    #[sqlx(try_from = "i64")]
    pub window_end_ms: u64,
    /// Tokens admitted in it (spent from leases and admitted in fallback).
    #[sqlx(try_from = "i64")]
    pub admitted: u64,
    /// Its stated bound.
    #[sqlx(try_from = "i64")]
    pub bound: u64,
    /// When it was checked, epoch ms.
    #[sqlx(try_from = "i64")]
    pub checked_at_ms: u64,
}

/// What the checks have found, over every window checked so far.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct BoundCheckSummary {
    /// Windows checked.
    pub windows_checked: u64,
    /// Windows that admitted more than their bound.
    pub violations: u64,
    /// The newest violations, newest first (at most [`MAX_RECENT_VIOLATIONS`]).
    pub recent_violations: Vec<BoundViolation>,
}

/// What one round of checks added.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ChecksAdded {
    /// Windows checked for the first time.
    pub windows: u64,
    /// Windows found over their bound, on their first check or on a later one that crossed it.
    pub violations: u64,
}

impl Ledger {
    /// Records the check of each of `rows` (windows of `tenant`'s `pool` that have ended and
    /// settled): a window checked for the first time is added; one checked before is updated when
    /// its figures moved (reports that came late, after a partition healed), and counted as a
    /// violation when it crosses its bound then. What it added.
    pub async fn record_bound_checks(
        &self,
        tenant: &TenantId,
        pool: &PoolId,
        rows: &[WindowRow],
        now_ms: u64,
    ) -> Result<ChecksAdded, LedgerError> {
        let Some(oldest_ms) = rows.iter().map(|row| row.window_start_ms).min() else {
            return Ok(ChecksAdded::default());
        };
        // One read of the pool's checks from the oldest row on, not one a window.
        let checked = self.checked_since(tenant, pool, oldest_ms).await?;
        let mut added = ChecksAdded::default();
        for row in rows {
            let over = row.admitted_tokens > row.bound_tokens;
            match checked.get(&row.window_start_ms) {
                None => {
                    self.write_check(tenant, pool, row, now_ms).await?;
                    added.windows += 1;
                    added.violations += u64::from(over);
                }
                Some(&(admitted, bound))
                    if (admitted, bound) != (row.admitted_tokens, row.bound_tokens) =>
                {
                    self.write_check(tenant, pool, row, now_ms).await?;
                    added.violations += u64::from(over && admitted <= bound);
                }
                Some(_) => {}
            }
        }
        Ok(added)
    }

    /// The admitted and bound each window of `tenant`'s `pool` from `oldest_ms` on was last
    /// checked with, by window start.
    async fn checked_since(
        &self,
        tenant: &TenantId,
        pool: &PoolId,
        oldest_ms: u64,
    ) -> Result<BTreeMap<u64, (u64, u64)>, LedgerError> {
        let select = Query::select()
            .columns([
                BoundChecks::WindowStartMs,
                BoundChecks::Admitted,
                BoundChecks::Bound,
            ])
            .from(BoundChecks::Table)
            .and_where(Expr::col(BoundChecks::Tenant).eq(tenant.as_str()))
            .and_where(Expr::col(BoundChecks::Pool).eq(pool.as_str()))
            .and_where(Expr::col(BoundChecks::WindowStartMs).gte(i64_of(oldest_ms)))
            .to_owned();
        let found: Vec<(i64, i64, i64)> = on_db!(self, select, |sql, values, pool| {
            sqlx::query_as_with(&sql, values).fetch_all(pool).await?
        });
        Ok(found
            .into_iter()
            .map(|(start, admitted, bound)| (u64_of(start), (u64_of(admitted), u64_of(bound))))
            .collect())
    }

    /// Writes the check of `row`: added, or its figures updated (late reports moved them). A
    /// check another leader wrote meanwhile is overwritten with figures at least as new.
    async fn write_check(
        &self,
        tenant: &TenantId,
        pool: &PoolId,
        row: &WindowRow,
        now_ms: u64,
    ) -> Result<(), LedgerError> {
        let upsert = Query::insert()
            .into_table(BoundChecks::Table)
            .columns(CHECK_COLUMNS)
            .values_panic([
                tenant.as_str().into(),
                pool.as_str().into(),
                i64_of(row.window_start_ms).into(),
                i64_of(row.window_end_ms).into(),
                i64_of(row.admitted_tokens).into(),
                i64_of(row.bound_tokens).into(),
                i64_of(now_ms).into(),
            ])
            .on_conflict(
                OnConflict::columns([
                    BoundChecks::Tenant,
                    BoundChecks::Pool,
                    BoundChecks::WindowStartMs,
                ])
                .update_columns([
                    BoundChecks::Admitted,
                    BoundChecks::Bound,
                    BoundChecks::CheckedAtMs,
                ])
                .to_owned(),
            )
            .to_owned();
        on_db!(self, upsert, |sql, values, pool| {
            sqlx::query_with(&sql, values).execute(pool).await?;
        });
        Ok(())
    }

    /// Windows checked so far that admitted more than their bound (the partial index's rows).
    pub async fn bound_violations_recorded(&self) -> Result<u64, LedgerError> {
        let count = Query::select()
            .expr(Expr::col(BoundChecks::Tenant).count())
            .from(BoundChecks::Table)
            .and_where(violated())
            .to_owned();
        let violations: i64 = on_db!(self, count, |sql, values, pool| {
            sqlx::query_scalar_with(&sql, values)
                .fetch_one(pool)
                .await?
        });
        Ok(u64_of(violations))
    }

    /// Every window checked so far, its violations, and the newest `recent` of them (at most
    /// [`MAX_RECENT_VIOLATIONS`]).
    pub async fn bound_check_summary(&self, recent: u64) -> Result<BoundCheckSummary, LedgerError> {
        let count_all = Query::select()
            .expr(Expr::col(BoundChecks::Tenant).count())
            .from(BoundChecks::Table)
            .to_owned();
        let newest = Query::select()
            .columns(CHECK_COLUMNS)
            .from(BoundChecks::Table)
            .and_where(violated())
            .order_by(BoundChecks::CheckedAtMs, Order::Desc)
            .order_by(BoundChecks::WindowStartMs, Order::Desc)
            .limit(recent.min(MAX_RECENT_VIOLATIONS))
            .to_owned();
        let windows_checked: i64 = on_db!(self, count_all, |sql, values, pool| {
            sqlx::query_scalar_with(&sql, values)
                .fetch_one(pool)
                .await?
        });
        let violations = self.bound_violations_recorded().await?;
        let recent_violations: Vec<BoundViolation> = if recent == 0 {
            Vec::new()
        } else {
            on_db!(self, newest, |sql, values, pool| {
                sqlx::query_as_with(&sql, values).fetch_all(pool).await?
            })
        };
        Ok(BoundCheckSummary {
            windows_checked: u64_of(windows_checked),
            violations,
            recent_violations,
        })
    }
}
