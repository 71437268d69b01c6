//! Which pools the ledger saw lately: the leader's rounds visit those, not every pool, so an idle
//! pool costs a round nothing.

use std::collections::BTreeMap;

use allot_shared::ids::{PoolId, TenantId};
use sea_query::{Alias, Expr, Func, PostgresQueryBuilder, Query, SqliteQueryBuilder};
use sea_query_binder::SqlxBinder;

use super::schema::{Grants, LeaseReports};
use super::{Database, Ledger, LedgerError, i64_of, u64_of};

/// What the ledger last saw of one pool, within what [`Ledger::recent_activity`] was asked for.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct PoolActivity {
    /// The latest end of a window the pool granted in, epoch ms.
    pub latest_grant_window_end_ms: Option<u64>,
    /// The latest start of a window a report of the pool was for, epoch ms.
    pub latest_report_window_start_ms: Option<u64>,
    /// When the ledger last received a report of the pool, epoch ms.
    pub latest_report_received_ms: Option<u64>,
}

impl PoolActivity {
    /// Whether the pool may have a window with figures that ends at or after `from_ms`, its
    /// windows lasting at most `longest_window_ms`.
    pub fn has_window_ending_from(&self, from_ms: u64, longest_window_ms: u64) -> bool {
        self.latest_grant_window_end_ms
            .is_some_and(|end_ms| end_ms >= from_ms)
            || self
                .latest_report_window_start_ms
                .is_some_and(|start_ms| start_ms.saturating_add(longest_window_ms) >= from_ms)
    }

    /// Whether a report of the pool arrived at or after `from_ms`.
    pub fn reported_from(&self, from_ms: u64) -> bool {
        self.latest_report_received_ms
            .is_some_and(|received_ms| received_ms >= from_ms)
    }
}

/// Which latest instant a read of [`Ledger::recent_activity`] gives.
#[derive(Clone, Copy)]
enum Latest {
    GrantWindowEnd,
    ReportWindowStart,
    ReportReceived,
}

#[derive(sqlx::FromRow)]
struct LatestRow {
    tenant: String,
    pool: String,
    latest_ms: i64,
}

impl Ledger {
    /// Every pool with a grant in a window ending at or after `grant_window_end_from_ms`, or a
    /// report received at or after `report_received_from_ms`, and the latest of each. Three reads,
    /// by indexed times: their cost follows the recent rows, not the pools configured.
    pub async fn recent_activity(
        &self,
        grant_window_end_from_ms: u64,
        report_received_from_ms: u64,
    ) -> Result<BTreeMap<(TenantId, PoolId), PoolActivity>, LedgerError> {
        let granted = self
            .latest_per_pool(
                Grants::Table,
                [Grants::Tenant, Grants::Pool],
                Grants::WindowEndMs,
                (Grants::WindowEndMs, grant_window_end_from_ms),
            )
            .await?;
        let reported = self
            .latest_per_pool(
                LeaseReports::Table,
                [LeaseReports::Tenant, LeaseReports::Pool],
                LeaseReports::WindowStartMs,
                (LeaseReports::ReceivedAtMs, report_received_from_ms),
            )
            .await?;
        let received = self
            .latest_per_pool(
                LeaseReports::Table,
                [LeaseReports::Tenant, LeaseReports::Pool],
                LeaseReports::ReceivedAtMs,
                (LeaseReports::ReceivedAtMs, report_received_from_ms),
            )
            .await?;
        let mut activity: BTreeMap<(TenantId, PoolId), PoolActivity> = BTreeMap::new();
        for (rows, field) in [
            (granted, Latest::GrantWindowEnd),
            (reported, Latest::ReportWindowStart),
            (received, Latest::ReportReceived),
        ] {
            for row in rows {
                // Rows the ledger took were checked on the way in; one that no longer parses
                // names no pool a round could visit.
                let (Ok(tenant), Ok(pool)) =
                    (TenantId::parse(&row.tenant), PoolId::parse(&row.pool))
                else {
                    continue;
                };
                let entry = activity.entry((tenant, pool)).or_default();
                let latest_ms = Some(u64_of(row.latest_ms));
                match field {
                    Latest::GrantWindowEnd => entry.latest_grant_window_end_ms = latest_ms,
                    Latest::ReportWindowStart => entry.latest_report_window_start_ms = latest_ms,
                    Latest::ReportReceived => entry.latest_report_received_ms = latest_ms,
                }
            }
        }
        Ok(activity)
    }
}

impl Ledger {
    /// Per pool of `table` (its `[tenant, pool]` columns), the largest `latest` among the rows
    /// whose `since.0` is at least `since.1` ms.
    async fn latest_per_pool<T: sea_query::Iden + Copy + 'static>(
        &self,
        table: T,
        tenant_and_pool: [T; 2],
        latest: T,
        since: (T, u64),
    ) -> Result<Vec<LatestRow>, LedgerError> {
        let statement = Query::select()
            .columns(tenant_and_pool)
            .expr_as(
                Func::cast_as(Func::max(Expr::col(latest)), Alias::new("BIGINT")),
                Alias::new("latest_ms"),
            )
            .from(table)
            .and_where(Expr::col(since.0).gte(i64_of(since.1)))
            .group_by_columns(tenant_and_pool)
            .to_owned();
        Ok(on_db!(self, statement, |sql, values, db| {
            sqlx::query_as_with(&sql, values).fetch_all(db).await?
        }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_pool_is_active_while_a_window_with_figures_may_end_from_the_instant() {
        let idle = PoolActivity::default();
        assert!(!idle.has_window_ending_from(0, u64::MAX));
        let granted = PoolActivity {
            latest_grant_window_end_ms: Some(60_000),
            ..PoolActivity::default()
        };
        assert!(granted.has_window_ending_from(60_000, 60_000));
        assert!(!granted.has_window_ending_from(60_001, 60_000));
        // A report names its window's start: the window may last up to the longest.
        let reported = PoolActivity {
            latest_report_window_start_ms: Some(0),
            latest_report_received_ms: Some(5_000),
            ..PoolActivity::default()
        };
        assert!(reported.reported_from(5_000) && !reported.reported_from(5_001));
        assert!(reported.has_window_ending_from(60_000, 60_000));
        assert!(!reported.has_window_ending_from(60_001, 60_000));
        assert!(reported.has_window_ending_from(u64::MAX, u64::MAX));
    }
}
