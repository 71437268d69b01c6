//! What the ledger says about regions lately: when each last reported, and what each admitted in
//! fallback in recent windows (for the regions view: is a region cut off from the allocator now?).

use std::collections::BTreeMap;

use allot_shared::ids::{PoolId, RegionId, TenantId};
use sea_query::{Alias, Expr, Func, PostgresQueryBuilder, Query, SqliteQueryBuilder};
use sea_query_binder::SqlxBinder;

use super::schema::{FallbackAdmits, LeaseReports, sum_as_bigint};
use super::{Database, Ledger, LedgerError, i64_of, u64_of};

/// Most fallback rows one read returns (regions x pools in recent windows).
pub const MAX_RECENT_FALLBACK_ROWS: u64 = 100_000;

/// A region's fallback admits from one pool in one window.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct FallbackRow {
    /// The tenant.
    pub tenant: TenantId,
    /// The pool.
    pub pool: PoolId,
    /// The region that admitted them.
    pub region: RegionId,
    /// The window's start, epoch ms.
    pub window_start_ms: u64,
    /// Tokens admitted in fallback (cumulative over the window; every agent of the region).
    pub admitted_tokens: u64,
}

#[derive(sqlx::FromRow)]
struct LastReport {
    region: String,
    at_ms: i64,
}

#[derive(sqlx::FromRow)]
struct StoredFallback {
    tenant: String,
    pool: String,
    region: String,
    window_start_ms: i64,
    admitted: i64,
}

impl Ledger {
    /// Each region's latest report received at or after `since_ms`.
    pub async fn last_reports(
        &self,
        since_ms: u64,
    ) -> Result<BTreeMap<RegionId, u64>, LedgerError> {
        let statement = Query::select()
            .expr_as(Expr::col(LeaseReports::Region), Alias::new("region"))
            .expr_as(
                Func::cast_as(
                    Func::max(Expr::col(LeaseReports::ReceivedAtMs)),
                    Alias::new("BIGINT"),
                ),
                Alias::new("at_ms"),
            )
            .from(LeaseReports::Table)
            .and_where(Expr::col(LeaseReports::ReceivedAtMs).gte(i64_of(since_ms)))
            .group_by_col(LeaseReports::Region)
            .to_owned();
        let rows: Vec<LastReport> = on_db!(self, statement, |sql, values, db| {
            sqlx::query_as_with(&sql, values).fetch_all(db).await?
        });
        Ok(rows
            .into_iter()
            .filter_map(|row| Some((RegionId::parse(&row.region).ok()?, u64_of(row.at_ms))))
            .collect())
    }

    /// Fallback admits in windows starting at or after `since_window_start_ms`, at most
    /// [`MAX_RECENT_FALLBACK_ROWS`] of them.
    pub async fn recent_fallback(
        &self,
        since_window_start_ms: u64,
    ) -> Result<Vec<FallbackRow>, LedgerError> {
        let statement = Query::select()
            .columns([
                FallbackAdmits::Tenant,
                FallbackAdmits::Pool,
                FallbackAdmits::Region,
                FallbackAdmits::WindowStartMs,
            ])
            .expr_as(
                sum_as_bigint(Expr::col(FallbackAdmits::Admitted)),
                Alias::new("admitted"),
            )
            .from(FallbackAdmits::Table)
            .and_where(Expr::col(FallbackAdmits::WindowStartMs).gte(i64_of(since_window_start_ms)))
            .and_where(Expr::col(FallbackAdmits::Admitted).gt(0i64))
            .group_by_col(FallbackAdmits::Tenant)
            .group_by_col(FallbackAdmits::Pool)
            .group_by_col(FallbackAdmits::Region)
            .group_by_col(FallbackAdmits::WindowStartMs)
            .limit(MAX_RECENT_FALLBACK_ROWS)
            .to_owned();
        let rows: Vec<StoredFallback> = on_db!(self, statement, |sql, values, db| {
            sqlx::query_as_with(&sql, values).fetch_all(db).await?
        });
        Ok(rows
            .into_iter()
            .filter_map(|row| {
                Some(FallbackRow {
                    tenant: TenantId::parse(&row.tenant).ok()?,
                    pool: PoolId::parse(&row.pool).ok()?,
                    region: RegionId::parse(&row.region).ok()?,
                    window_start_ms: u64_of(row.window_start_ms),
                    admitted_tokens: u64_of(row.admitted),
                })
            })
            .collect())
    }
}
