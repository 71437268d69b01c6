//! The overshoot bound, checked for every window once it has ended: a row a window, written once,
//! so the counts are the ledger's (the same after a restart or a failover), not one process's.

use std::collections::BTreeMap;

use allot_shared::ids::{PoolId, RegionId, TenantId};
use sea_query::{Expr, OnConflict, Order, PostgresQueryBuilder, Query, SqliteQueryBuilder};
use sea_query_binder::SqlxBinder;
use serde::{Deserialize, Serialize};

use super::schema::BoundChecks;
use super::{Database, Ledger, LedgerError, WindowRow, i64_of, u64_of};

/// Every column of a check, in the order rows are written and read.
const CHECK_COLUMNS: [BoundChecks; 9] = [
    BoundChecks::Tenant,
    BoundChecks::Pool,
    BoundChecks::WindowStartMs,
    BoundChecks::WindowEndMs,
    BoundChecks::Admitted,
    BoundChecks::Bound,
    BoundChecks::CheckedAtMs,
    BoundChecks::FallbackExcess,
    BoundChecks::ExcessRegions,
];

/// A check whose window admitted more than its bound, or one of whose regions admitted more than
/// its fallback allowance (the partial index's predicate).
fn violated() -> sea_query::SimpleExpr {
    Expr::col(BoundChecks::Admitted)
        .gt(Expr::col(BoundChecks::Bound))
        .or(Expr::col(BoundChecks::FallbackExcess).gt(0i64))
}

/// Most recent violations a summary lists (I10).
pub const MAX_RECENT_VIOLATIONS: u64 = 100;

/// One window that broke its bound: admitted more than it, or one of its regions' agents together
/// admitted more than the region's fallback allowance.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct BoundViolation {
    /// The pool's tenant.
    pub tenant: String,
    /// The pool.
    pub pool: String,
    /// Window start, epoch ms.
    pub window_start_ms: u64,
    /// Window end, epoch ms.
    pub window_end_ms: u64,
    /// Tokens admitted in it (spent from leases and admitted in fallback).
    pub admitted: u64,
    /// Its stated bound (for the terms in force while it ran).
    pub bound: u64,
    /// Fallback its regions admitted beyond their allowances, tokens (0: none).
    #[serde(default)]
    pub fallback_over_allowance: u64,
    /// The regions whose agents together admitted more than the region's fallback allowance:
    /// most likely agents that each took a larger share than the region's number of agents leaves
    /// them (`--region-agents` set too low), or agents sharing an id.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub regions_over_allowance: Vec<String>,
    /// When it was checked, epoch ms.
    pub checked_at_ms: u64,
}

#[derive(sqlx::FromRow)]
struct CheckRow {
    tenant: String,
    pool: String,
    window_start_ms: i64,
    window_end_ms: i64,
    admitted: i64,
    bound: i64,
    checked_at_ms: i64,
    fallback_excess: i64,
    excess_regions: String,
}

impl From<CheckRow> for BoundViolation {
    fn from(row: CheckRow) -> Self {
        Self {
            tenant: row.tenant,
            pool: row.pool,
            window_start_ms: u64_of(row.window_start_ms),
            window_end_ms: u64_of(row.window_end_ms),
            admitted: u64_of(row.admitted),
            bound: u64_of(row.bound),
            fallback_over_allowance: u64_of(row.fallback_excess),
            regions_over_allowance: row
                .excess_regions
                .split(',')
                .filter(|region| !region.is_empty())
                .map(str::to_owned)
                .collect(),
            checked_at_ms: u64_of(row.checked_at_ms),
        }
    }
}

/// What the checks have found, over every window checked so far.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct BoundCheckSummary {
    /// Windows checked.
    pub windows_checked: u64,
    /// Windows that broke their bound.
    pub violations: u64,
    /// The newest violations, newest first (at most [`MAX_RECENT_VIOLATIONS`]).
    pub recent_violations: Vec<BoundViolation>,
}

/// What one round of checks added.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ChecksAdded {
    /// Windows checked for the first time.
    pub windows: u64,
    /// Windows found over their bound, on their first check or on a later one that crossed it.
    pub violations: u64,
    /// Regions found over their fallback allowance in a window, once a window each (a window
    /// found so on a later check counts then).
    pub regions_over_allowance: Vec<RegionId>,
}

/// What a check stores of a window: admitted, bound, and fallback beyond the allowances.
type Figures = (u64, u64, u64);

fn figures(row: &WindowRow) -> Figures {
    (
        row.admitted_tokens,
        row.bound_tokens,
        row.fallback_over_allowance_tokens(),
    )
}

fn violates((admitted, bound, excess): Figures) -> bool {
    admitted > bound || excess > 0
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
            debug_assert_eq!(violates(figures(row)), row.violates_bound());
            let previous = checked.get(&row.window_start_ms).copied();
            if previous == Some(figures(row)) {
                continue;
            }
            self.write_check(tenant, pool, row, now_ms).await?;
            added.windows += u64::from(previous.is_none());
            let was_violation = previous.is_some_and(violates);
            if row.violates_bound() && !was_violation {
                added.violations += 1;
            }
            let was_over = previous.is_some_and(|(_, _, excess)| excess > 0);
            if !was_over {
                added
                    .regions_over_allowance
                    .extend(row.fallback_over_allowance_tokens_by_region.keys().cloned());
            }
        }
        Ok(added)
    }

    /// The figures each window of `tenant`'s `pool` from `oldest_ms` on was last checked with, by
    /// window start.
    async fn checked_since(
        &self,
        tenant: &TenantId,
        pool: &PoolId,
        oldest_ms: u64,
    ) -> Result<BTreeMap<u64, Figures>, LedgerError> {
        let select = Query::select()
            .columns([
                BoundChecks::WindowStartMs,
                BoundChecks::Admitted,
                BoundChecks::Bound,
                BoundChecks::FallbackExcess,
            ])
            .from(BoundChecks::Table)
            .and_where(Expr::col(BoundChecks::Tenant).eq(tenant.as_str()))
            .and_where(Expr::col(BoundChecks::Pool).eq(pool.as_str()))
            .and_where(Expr::col(BoundChecks::WindowStartMs).gte(i64_of(oldest_ms)))
            .to_owned();
        let found: Vec<(i64, i64, i64, i64)> = on_db!(self, select, |sql, values, pool| {
            sqlx::query_as_with(&sql, values).fetch_all(pool).await?
        });
        Ok(found
            .into_iter()
            .map(|(start, admitted, bound, excess)| {
                (
                    u64_of(start),
                    (u64_of(admitted), u64_of(bound), u64_of(excess)),
                )
            })
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
                i64_of(row.fallback_over_allowance_tokens()).into(),
                row.fallback_over_allowance_tokens_by_region
                    .keys()
                    .map(RegionId::as_str)
                    .collect::<Vec<_>>()
                    .join(",")
                    .into(),
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
                    BoundChecks::FallbackExcess,
                    BoundChecks::ExcessRegions,
                ])
                .to_owned(),
            )
            .to_owned();
        on_db!(self, upsert, |sql, values, pool| {
            sqlx::query_with(&sql, values).execute(pool).await?;
        });
        Ok(())
    }

    /// Windows checked so far that broke their bound (the partial index's rows).
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
            let rows: Vec<CheckRow> = on_db!(self, newest, |sql, values, pool| {
                sqlx::query_as_with(&sql, values).fetch_all(pool).await?
            });
            rows.into_iter().map(BoundViolation::from).collect()
        };
        Ok(BoundCheckSummary {
            windows_checked: u64_of(windows_checked),
            violations,
            recent_violations,
        })
    }
}
