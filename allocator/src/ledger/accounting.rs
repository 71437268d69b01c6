//! Per-window accounting: what a pool granted, what was spent, stranded, left unreported and
//! admitted in fallback, against its limit and the design's bound. The SQL gathers the amounts;
//! [`account`] is the arithmetic, pure.

use std::collections::BTreeMap;

use allot_shared::ids::{PoolId, RegionId, TenantId};
use allot_shared::lease::{LeaseClamping, OvershootBound, PoolConfig, overshoot_tokens};
use sea_query::{
    Alias, Cond, Expr, Func, JoinType, Order, PostgresQueryBuilder, Query, SqliteQueryBuilder,
};
use sea_query_binder::SqlxBinder;
use serde::{Deserialize, Serialize};

use super::schema::{FallbackAdmits, Grants, LeaseSpend, sum_as_bigint};
use super::{Database, Ledger, LedgerError, i64_of, u64_of};

/// Most windows one `windows` query returns.
pub const MAX_WINDOWS: u64 = 1_000;

/// One window of a pool, as the ledger accounts for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WindowRow {
    /// Window start, epoch ms.
    pub window_start_ms: u64,
    /// Window end, epoch ms.
    pub window_end_ms: u64,
    /// `G` (from the pool's current configuration).
    pub limit: u64,
    /// Tokens granted in the window.
    pub granted: u64,
    /// Tokens granted per region.
    pub granted_by_region: BTreeMap<RegionId, u64>,
    /// Tokens reported spent from the window's leases.
    pub spent: u64,
    /// Granted minus spent, over expired leases whose final report arrived.
    pub stranded: u64,
    /// Granted minus reported spend, over expired leases whose final report never arrived.
    pub unreported: u64,
    /// Tokens admitted in fallback, all regions.
    pub fallback_admitted: u64,
    /// Fallback admits per region.
    pub fallback_admitted_by_region: BTreeMap<RegionId, u64>,
    /// spent + fallbackAdmitted.
    pub admitted: u64,
    /// max(0, admitted - limit).
    pub overshoot: u64,
    /// The design's bound for this pool's configuration.
    pub bound: u64,
}

#[derive(sqlx::FromRow)]
struct WindowKey {
    window_start_ms: i64,
    window_end_ms: i64,
}

#[derive(sqlx::FromRow)]
struct RegionAmount {
    window_start_ms: i64,
    region: String,
    amount: i64,
}

#[derive(sqlx::FromRow)]
struct LeaseAmounts {
    window_start_ms: i64,
    spent: i64,
    stranded: i64,
    unreported: i64,
}

/// What the ledger holds for one window, as the queries gather it: the input of [`account`].
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WindowAmounts {
    /// Window start, epoch ms.
    pub window_start_ms: u64,
    /// Window end, epoch ms.
    pub window_end_ms: u64,
    /// Tokens granted per region.
    pub granted_tokens_by_region: BTreeMap<RegionId, u64>,
    /// Tokens reported spent from the window's leases.
    pub spent_tokens: u64,
    /// Granted minus spent, over expired leases whose final report arrived.
    pub stranded_tokens: u64,
    /// Granted minus reported spend, over expired leases whose final report never arrived.
    pub unreported_tokens: u64,
    /// Tokens admitted in fallback per region.
    pub fallback_admitted_tokens_by_region: BTreeMap<RegionId, u64>,
}

/// A window's accounts from its amounts: everything granted, everything admitted (spent from
/// leases plus admitted in fallback), and the overshoot beyond `limit_tokens`; `bound_tokens` is
/// the design's bound it is held to.
pub fn account(amounts: WindowAmounts, limit_tokens: u64, bound_tokens: u64) -> WindowRow {
    let fallback_admitted = amounts.fallback_admitted_tokens_by_region.values().sum();
    let admitted = amounts.spent_tokens.saturating_add(fallback_admitted);
    WindowRow {
        window_start_ms: amounts.window_start_ms,
        window_end_ms: amounts.window_end_ms,
        limit: limit_tokens,
        granted: amounts.granted_tokens_by_region.values().sum(),
        granted_by_region: amounts.granted_tokens_by_region,
        spent: amounts.spent_tokens,
        stranded: amounts.stranded_tokens,
        unreported: amounts.unreported_tokens,
        fallback_admitted,
        fallback_admitted_by_region: amounts.fallback_admitted_tokens_by_region,
        admitted,
        overshoot: overshoot_tokens(admitted, limit_tokens),
        bound: bound_tokens,
    }
}

impl Ledger {
    /// The last `last` windows of a pool that saw grants or fallback admits, newest first.
    pub async fn windows(
        &self,
        tenant: &TenantId,
        pool: &PoolId,
        config: &PoolConfig,
        last: u64,
        now_ms: u64,
    ) -> Result<Vec<WindowRow>, LedgerError> {
        let last = last.clamp(1, MAX_WINDOWS);
        let of_pool = |table: Alias| {
            Cond::all()
                .add(Expr::col((table.clone(), Alias::new("tenant"))).eq(tenant.as_str()))
                .add(Expr::col((table, Alias::new("pool"))).eq(pool.as_str()))
        };
        let windows_statement = Query::select()
            .distinct()
            .columns([Grants::WindowStartMs, Grants::WindowEndMs])
            .from(Grants::Table)
            .cond_where(of_pool(Alias::new("grants")))
            .order_by(Grants::WindowStartMs, Order::Desc)
            .limit(last)
            .to_owned();
        let mut keys: Vec<WindowKey> = on_db!(self, windows_statement, |sql, values, db| {
            sqlx::query_as_with(&sql, values).fetch_all(db).await?
        });
        let fallback_statement = Query::select()
            .column(FallbackAdmits::WindowStartMs)
            .expr_as(Expr::col(FallbackAdmits::Region), Alias::new("region"))
            .expr_as(Expr::col(FallbackAdmits::Admitted), Alias::new("amount"))
            .from(FallbackAdmits::Table)
            .cond_where(of_pool(Alias::new("fallback_admits")))
            .order_by(FallbackAdmits::WindowStartMs, Order::Desc)
            .limit(last * 64)
            .to_owned();
        let fallback_rows: Vec<RegionAmount> =
            on_db!(self, fallback_statement, |sql, values, db| {
                sqlx::query_as_with(&sql, values).fetch_all(db).await?
            });
        let window_ms = i64_of(config.window_ms().get());
        for row in &fallback_rows {
            if !keys
                .iter()
                .any(|k| k.window_start_ms == row.window_start_ms)
            {
                keys.push(WindowKey {
                    window_start_ms: row.window_start_ms,
                    window_end_ms: row.window_start_ms + window_ms,
                });
            }
        }
        keys.sort_by_key(|k| std::cmp::Reverse(k.window_start_ms));
        keys.truncate(usize::try_from(last).unwrap_or(usize::MAX));
        let Some(oldest) = keys.last().map(|k| k.window_start_ms) else {
            return Ok(Vec::new());
        };
        let in_range = of_pool(Alias::new("grants"))
            .add(Expr::col((Grants::Table, Grants::WindowStartMs)).gte(oldest));
        let granted_statement = Query::select()
            .column(Grants::WindowStartMs)
            .column(Grants::Region)
            .expr_as(
                sum_as_bigint(Expr::col(Grants::Granted)),
                Alias::new("amount"),
            )
            .from(Grants::Table)
            .cond_where(in_range.clone())
            .group_by_col(Grants::WindowStartMs)
            .group_by_col(Grants::Region)
            .to_owned();
        let granted_rows: Vec<RegionAmount> = on_db!(self, granted_statement, |sql, values, db| {
            sqlx::query_as_with(&sql, values).fetch_all(db).await?
        });
        let expired = Expr::col((Grants::Table, Grants::ExpiresAtMs)).lte(i64_of(now_ms));
        let spent = Expr::col((LeaseSpend::Table, LeaseSpend::Spent));
        let granted = Expr::col((Grants::Table, Grants::Granted));
        let is_final = Expr::col((LeaseSpend::Table, LeaseSpend::FinalReport)).eq(1i64);
        let stranded_case = Expr::case(
            Cond::all().add(expired.clone()).add(is_final.clone()),
            granted.clone().sub(Func::coalesce([
                spent.clone().into(),
                Expr::val(0i64).into(),
            ])),
        )
        .finally(0i64);
        let unreported_case = Expr::case(
            Cond::all().add(expired).add(
                Cond::any()
                    .add(Expr::col((LeaseSpend::Table, LeaseSpend::FinalReport)).is_null())
                    .add(is_final.not()),
            ),
            granted.sub(Func::coalesce([
                spent.clone().into(),
                Expr::val(0i64).into(),
            ])),
        )
        .finally(0i64);
        let amounts_statement = Query::select()
            .expr_as(
                Expr::col((Grants::Table, Grants::WindowStartMs)),
                Alias::new("window_start_ms"),
            )
            .expr_as(sum_as_bigint(spent), Alias::new("spent"))
            .expr_as(sum_as_bigint(stranded_case), Alias::new("stranded"))
            .expr_as(sum_as_bigint(unreported_case), Alias::new("unreported"))
            .from(Grants::Table)
            .join(
                JoinType::LeftJoin,
                LeaseSpend::Table,
                Expr::col((LeaseSpend::Table, LeaseSpend::LeaseId))
                    .equals((Grants::Table, Grants::LeaseId)),
            )
            .cond_where(in_range)
            .group_by_col((Grants::Table, Grants::WindowStartMs))
            .to_owned();
        let amounts: Vec<LeaseAmounts> = on_db!(self, amounts_statement, |sql, values, db| {
            sqlx::query_as_with(&sql, values).fetch_all(db).await?
        });
        let bound = OvershootBound::for_design(config, LeaseClamping::Clamped, 1, 0).total_tokens();
        let limit = config.limit_tokens();
        let by_region = |rows: &[RegionAmount], window_start_ms: i64| -> BTreeMap<RegionId, u64> {
            rows.iter()
                .filter(|r| r.window_start_ms == window_start_ms)
                .filter_map(|r| Some((RegionId::parse(&r.region).ok()?, u64_of(r.amount))))
                .collect()
        };
        let rows = keys
            .into_iter()
            .map(|key| {
                let lease_amounts = amounts
                    .iter()
                    .find(|a| a.window_start_ms == key.window_start_ms);
                let amounts = WindowAmounts {
                    window_start_ms: u64_of(key.window_start_ms),
                    window_end_ms: u64_of(key.window_end_ms),
                    granted_tokens_by_region: by_region(&granted_rows, key.window_start_ms),
                    spent_tokens: lease_amounts.map_or(0, |a| u64_of(a.spent)),
                    stranded_tokens: lease_amounts.map_or(0, |a| u64_of(a.stranded)),
                    unreported_tokens: lease_amounts.map_or(0, |a| u64_of(a.unreported)),
                    fallback_admitted_tokens_by_region: by_region(
                        &fallback_rows,
                        key.window_start_ms,
                    ),
                };
                account(amounts, limit, bound)
            })
            .collect();
        Ok(rows)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(name: &str) -> RegionId {
        RegionId::parse(name).expect("region")
    }

    #[test]
    fn a_window_admits_what_its_leases_spent_and_its_regions_admitted_in_fallback() {
        let amounts = WindowAmounts {
            window_start_ms: 60_000,
            window_end_ms: 120_000,
            granted_tokens_by_region: [(region("eu"), 700), (region("us"), 300)].into(),
            spent_tokens: 950,
            stranded_tokens: 40,
            unreported_tokens: 10,
            fallback_admitted_tokens_by_region: [(region("eu"), 80), (region("us"), 20)].into(),
        };
        let row = account(amounts, 1_000, 1_200);
        assert_eq!(row.granted, 1_000);
        assert_eq!(row.fallback_admitted, 100);
        assert_eq!(row.admitted, 1_050);
        assert_eq!(row.overshoot, 50, "admitted beyond G");
        assert_eq!((row.limit, row.bound), (1_000, 1_200));
        assert_eq!((row.stranded, row.unreported), (40, 10));
        assert_eq!(row.granted_by_region[&region("eu")], 700);
        // Within the limit, no overshoot; an empty window is all zeros but for its terms.
        let quiet = account(
            WindowAmounts {
                spent_tokens: 400,
                ..WindowAmounts::default()
            },
            1_000,
            1_200,
        );
        assert_eq!((quiet.admitted, quiet.overshoot), (400, 0));
        let empty = account(WindowAmounts::default(), 1_000, 1_200);
        assert_eq!((empty.granted, empty.admitted, empty.overshoot), (0, 0, 0));
        // Saturating, never wrapping, on absurd stored amounts.
        let huge = account(
            WindowAmounts {
                spent_tokens: u64::MAX,
                fallback_admitted_tokens_by_region: [(region("eu"), 5)].into(),
                ..WindowAmounts::default()
            },
            1_000,
            1_200,
        );
        assert_eq!(huge.admitted, u64::MAX);
    }
}
