//! Per-window accounting: what a pool granted, what was spent, stranded, left unreported and
//! admitted in fallback, against its limit and the design's bound. The SQL gathers the amounts,
//! from the raw rows of recent windows and the rollup of older ones ([`super::rollup`]);
//! [`account`] is the arithmetic, pure.

use std::collections::BTreeMap;

use allot_shared::ids::{PoolId, RegionId, TenantId};
use allot_shared::lease::{PoolConfig, overshoot_tokens};
use allot_shared::overrides::PoolOverride;
use allot_shared::window::Window;
use sea_query::{
    Alias, Cond, Expr, Func, JoinType, Order, PostgresQueryBuilder, Query, SqliteQueryBuilder,
};
use sea_query_binder::SqlxBinder;
use serde::{Deserialize, Serialize};

use super::schema::{
    FallbackAdmits, Grants, LeaseSpend, SettleDebts, ShadowAdmits, UNNAMED_AGENT, WrittenOff,
    sum_as_bigint,
};
use super::terms::{WindowTerms, window_terms};
use super::{Database, Ledger, LedgerError, i64_of, u64_of};

/// Most windows one `windows` query returns.
pub const MAX_WINDOWS: u64 = 1_000;

/// What a pool's windows are accounted against: its configuration today, and the overrides of its
/// limit (in force or ended). Each window is held to the terms in force while it ran
/// ([`super::terms`]): the pool's history in the ledger, with these overrides laid over it.
#[derive(Debug, Clone, Copy)]
pub struct PoolLimits<'a> {
    /// The configuration.
    pub config: &'a PoolConfig,
    /// Its limit's overrides.
    pub overrides: &'a [PoolOverride],
}

impl<'a> From<&'a PoolConfig> for PoolLimits<'a> {
    fn from(config: &'a PoolConfig) -> Self {
        Self {
            config,
            overrides: &[],
        }
    }
}

/// How the windows view names the agent of reports that named none.
pub const UNNAMED_AGENT_LABEL: &str = "(unnamed)";

/// Most agents' fallback rows read per window for the view's breakdown by agent (I10); a window
/// with more shows its regions' sums only.
pub const MAX_AGENT_ROWS_PER_WINDOW: u64 = 1_024;

/// One window of a pool, as the ledger accounts for it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct WindowRow {
    /// Window start, epoch ms.
    pub window_start_ms: u64,
    /// Window end, epoch ms.
    pub window_end_ms: u64,
    /// `G`: the highest limit in force while the window ran (its overrides included).
    #[serde(rename = "limit")]
    pub limit_tokens: u64,
    /// Tokens granted in the window.
    #[serde(rename = "granted")]
    pub granted_tokens: u64,
    /// Tokens granted per region.
    #[serde(rename = "grantedByRegion")]
    pub granted_tokens_by_region: BTreeMap<RegionId, u64>,
    /// Tokens reported spent from the window's leases.
    #[serde(rename = "spent")]
    pub spent_tokens: u64,
    /// Tokens reported spent per region.
    #[serde(rename = "spentByRegion", default)]
    pub spent_tokens_by_region: BTreeMap<RegionId, u64>,
    /// Granted minus spent minus given back, over expired leases whose final report arrived.
    #[serde(rename = "stranded")]
    pub stranded_tokens: u64,
    /// Tokens leases gave back unspent at their end (grantable again in the window): granted
    /// counts them, and what was granted again, so granted is spent + stranded + unreported +
    /// returned (+ what live leases hold).
    #[serde(rename = "returned", default)]
    pub returned_tokens: u64,
    /// Granted minus reported spend, over expired leases whose final report never arrived.
    #[serde(rename = "unreported")]
    pub unreported_tokens: u64,
    /// Tokens admitted in fallback, all regions.
    #[serde(rename = "fallbackAdmitted")]
    pub fallback_admitted_tokens: u64,
    /// Fallback admits per region: the sum over the region's agents.
    #[serde(rename = "fallbackAdmittedByRegion")]
    pub fallback_admitted_tokens_by_region: BTreeMap<RegionId, u64>,
    /// Fallback admits per region and agent, as each agent reported them (`(unnamed)`: reports
    /// that named no agent; regions without fallback left out).
    #[serde(
        rename = "fallbackAdmittedByAgent",
        default,
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub fallback_admitted_tokens_by_agent: BTreeMap<RegionId, BTreeMap<String, u64>>,
    /// What each region's agents together may admit in fallback in the window, tokens: the
    /// largest `fallbackPerRegion` in force while it ran.
    #[serde(rename = "fallbackPerRegion", default)]
    pub fallback_per_region_tokens: u64,
    /// Fallback each region admitted beyond that allowance, tokens (regions within it left out):
    /// its agents together took more than the region's share, a violation of the bound's
    /// fallback term even when the window's total stays within the bound.
    #[serde(
        rename = "fallbackOverAllowanceByRegion",
        default,
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub fallback_over_allowance_tokens_by_region: BTreeMap<RegionId, u64>,
    /// spent + fallbackAdmitted.
    #[serde(rename = "admitted")]
    pub admitted_tokens: u64,
    /// What each region admitted: its spent plus its fallback admits.
    #[serde(rename = "admittedByRegion", default)]
    pub admitted_tokens_by_region: BTreeMap<RegionId, u64>,
    /// max(0, admitted - limit).
    #[serde(rename = "overshoot")]
    pub overshoot_tokens: u64,
    /// The design's bound for the terms in force while the window ran.
    #[serde(rename = "bound")]
    pub bound_tokens: u64,
    /// Tokens a shadow global rule counted without spending, all regions: what enforcing the pool
    /// would have spent (beyond `limit`, what it would have denied).
    #[serde(rename = "shadowAdmitted", default)]
    pub shadow_admitted_tokens: u64,
    /// Shadow admits per region.
    #[serde(rename = "shadowAdmittedByRegion", default)]
    pub shadow_admitted_tokens_by_region: BTreeMap<RegionId, u64>,
    /// The most debt from settled metered requests each region carried in the window, summed:
    /// consumed beyond `admitted` until later leases pay it (at most the bound's settle-debt
    /// term, `settleDebtPerRegion x regions`).
    #[serde(rename = "settleDebt", default)]
    pub settle_debt_tokens: u64,
    /// Tokens metered requests consumed beyond the debt their region could carry: never charged.
    #[serde(rename = "writtenOff", default)]
    pub written_off_tokens: u64,
    /// Settle debt per region (regions with none left out).
    #[serde(
        rename = "settleDebtByRegion",
        default,
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub settle_debt_tokens_by_region: BTreeMap<RegionId, u64>,
    /// Tokens written off per region (regions with none left out).
    #[serde(
        rename = "writtenOffByRegion",
        default,
        skip_serializing_if = "BTreeMap::is_empty"
    )]
    pub written_off_tokens_by_region: BTreeMap<RegionId, u64>,
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
struct AgentAmount {
    window_start_ms: i64,
    region: String,
    agent_id: String,
    amount: i64,
}

#[derive(sqlx::FromRow)]
struct LeaseAmounts {
    window_start_ms: i64,
    region: String,
    spent: i64,
    stranded: i64,
    unreported: i64,
    returned: i64,
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
    /// Tokens reported spent from the window's leases, per region.
    pub spent_tokens_by_region: BTreeMap<RegionId, u64>,
    /// Granted minus spent minus given back, over expired leases whose final report arrived.
    pub stranded_tokens: u64,
    /// Granted minus reported spend, over expired leases whose final report never arrived.
    pub unreported_tokens: u64,
    /// Tokens leases gave back unspent at their end.
    pub returned_tokens: u64,
    /// Tokens admitted in fallback per region (all its agents).
    pub fallback_admitted_tokens_by_region: BTreeMap<RegionId, u64>,
    /// Tokens admitted in fallback per region and agent, where known.
    pub fallback_admitted_tokens_by_agent: BTreeMap<RegionId, BTreeMap<String, u64>>,
    /// Tokens a shadow global rule counted per region.
    pub shadow_admitted_tokens_by_region: BTreeMap<RegionId, u64>,
    /// The most settle debt each region carried.
    pub settle_debt_tokens_by_region: BTreeMap<RegionId, u64>,
    /// Tokens written off per region.
    pub written_off_tokens_by_region: BTreeMap<RegionId, u64>,
}

/// A window's accounts from its amounts: everything granted, everything admitted (spent from
/// leases plus admitted in fallback), the overshoot beyond the window's limit, and each region's
/// fallback beyond its allowance; `terms` are what the window is held to.
pub fn account(amounts: WindowAmounts, terms: &WindowTerms) -> WindowRow {
    let total = |by_region: &BTreeMap<RegionId, u64>| {
        by_region
            .values()
            .fold(0u64, |sum, tokens| sum.saturating_add(*tokens))
    };
    let fallback_admitted_tokens = total(&amounts.fallback_admitted_tokens_by_region);
    let spent_tokens = total(&amounts.spent_tokens_by_region);
    let admitted_tokens = spent_tokens.saturating_add(fallback_admitted_tokens);
    let mut admitted_tokens_by_region = amounts.spent_tokens_by_region.clone();
    for (region, tokens) in &amounts.fallback_admitted_tokens_by_region {
        let admitted = admitted_tokens_by_region.entry(region.clone()).or_default();
        *admitted = admitted.saturating_add(*tokens);
    }
    debug_assert!(
        admitted_tokens == u64::MAX || total(&admitted_tokens_by_region) == admitted_tokens,
        "the regions' admits add up to the window's"
    );
    let fallback_over_allowance_tokens_by_region = amounts
        .fallback_admitted_tokens_by_region
        .iter()
        .map(|(region, tokens)| {
            let over = tokens.saturating_sub(terms.fallback_allowance(region));
            (region.clone(), over)
        })
        .filter(|(_, over)| *over > 0)
        .collect();
    WindowRow {
        window_start_ms: amounts.window_start_ms,
        window_end_ms: amounts.window_end_ms,
        limit_tokens: terms.limit_tokens,
        granted_tokens: total(&amounts.granted_tokens_by_region),
        granted_tokens_by_region: amounts.granted_tokens_by_region,
        spent_tokens,
        spent_tokens_by_region: amounts.spent_tokens_by_region,
        stranded_tokens: amounts.stranded_tokens,
        returned_tokens: amounts.returned_tokens,
        unreported_tokens: amounts.unreported_tokens,
        fallback_admitted_tokens,
        fallback_admitted_tokens_by_region: amounts.fallback_admitted_tokens_by_region,
        fallback_admitted_tokens_by_agent: amounts.fallback_admitted_tokens_by_agent,
        fallback_per_region_tokens: terms.fallback_per_region_tokens,
        fallback_over_allowance_tokens_by_region,
        admitted_tokens,
        admitted_tokens_by_region,
        overshoot_tokens: overshoot_tokens(admitted_tokens, terms.limit_tokens),
        bound_tokens: terms.bound().total_tokens(),
        shadow_admitted_tokens: total(&amounts.shadow_admitted_tokens_by_region),
        shadow_admitted_tokens_by_region: amounts.shadow_admitted_tokens_by_region,
        settle_debt_tokens: total(&amounts.settle_debt_tokens_by_region),
        written_off_tokens: total(&amounts.written_off_tokens_by_region),
        settle_debt_tokens_by_region: nonzero(amounts.settle_debt_tokens_by_region),
        written_off_tokens_by_region: nonzero(amounts.written_off_tokens_by_region),
    }
}

impl WindowRow {
    /// Fallback admitted beyond the regions' allowances, tokens, over every region.
    pub fn fallback_over_allowance_tokens(&self) -> u64 {
        self.fallback_over_allowance_tokens_by_region
            .values()
            .fold(0, |sum, tokens| sum.saturating_add(*tokens))
    }

    /// Whether the window broke its bound: admitted more than it, or a region's agents admitted
    /// more than its fallback allowance.
    pub fn violates_bound(&self) -> bool {
        self.admitted_tokens > self.bound_tokens || self.fallback_over_allowance_tokens() > 0
    }
}

/// `by_region` without its zero entries.
fn nonzero(mut by_region: BTreeMap<RegionId, u64>) -> BTreeMap<RegionId, u64> {
    by_region.retain(|_, tokens| *tokens > 0);
    by_region
}

impl Ledger {
    /// The last `last` windows of a pool that saw grants or fallback admits, newest first, each
    /// accounted for ([`account`]) against the pool's limit and the design's bound.
    pub async fn windows<'a>(
        &self,
        tenant: &TenantId,
        pool: &PoolId,
        limits: impl Into<PoolLimits<'a>>,
        last: u64,
        now_ms: u64,
    ) -> Result<Vec<WindowRow>, LedgerError> {
        self.windows_before(tenant, pool, limits, last, now_ms, u64::MAX)
            .await
    }

    /// The same, of the windows that start before `before_ms`: the page of a pool's windows that
    /// follows one whose oldest window started there.
    ///
    /// Long by design: the page's windows are chosen only once every source has been read (raw
    /// rows, rollups past the retention), and each window's amounts are then taken from all of
    /// those sources by the same start; split, the sources would be handed between pieces, and
    /// which windows make the page would be decided away from the reads that find them.
    pub async fn windows_before<'a>(
        &self,
        tenant: &TenantId,
        pool: &PoolId,
        limits: impl Into<PoolLimits<'a>>,
        last: u64,
        now_ms: u64,
        before_ms: u64,
    ) -> Result<Vec<WindowRow>, LedgerError> {
        let limits = limits.into();
        let config = limits.config;
        let last = last.clamp(1, MAX_WINDOWS);
        let before = i64_of(before_ms);
        let fallback_rows = self
            .admits_rows(FallbackAdmits::Table, tenant, pool, last, before)
            .await?;
        let shadow_rows = self
            .admits_rows(ShadowAdmits::Table, tenant, pool, last, before)
            .await?;
        let debt_rows = self
            .admits_rows(SettleDebts::Table, tenant, pool, last, before)
            .await?;
        let written_off_rows = self
            .admits_rows(WrittenOff::Table, tenant, pool, last, before)
            .await?;
        let mut keys = self
            .window_keys(
                tenant,
                pool,
                config,
                (last, before),
                &[&fallback_rows, &shadow_rows, &debt_rows, &written_off_rows],
            )
            .await?;
        // Windows past the raw retention are read from their rollup (and merged with any raw row
        // a late report wrote since).
        let rolled = self
            .rolled_windows_before(tenant, pool, last, before_ms)
            .await?;
        for (&window_start_ms, window) in &rolled {
            let start = i64_of(window_start_ms);
            if !keys.iter().any(|k| k.window_start_ms == start) {
                let end_ms = if window.window_end_ms > window_start_ms {
                    window.window_end_ms
                } else {
                    config.window_at(window_start_ms).end_ms
                };
                keys.push(WindowKey {
                    window_start_ms: start,
                    window_end_ms: i64_of(end_ms),
                });
            }
        }
        keys.sort_by_key(|k| std::cmp::Reverse(k.window_start_ms));
        keys.truncate(usize::try_from(last).unwrap_or(usize::MAX));
        let Some(oldest) = keys.last().map(|k| k.window_start_ms) else {
            return Ok(Vec::new());
        };
        let granted_rows = self.granted_rows(tenant, pool, oldest).await?;
        let amounts = self.lease_amounts(tenant, pool, oldest, now_ms).await?;
        let by_agent = self
            .fallback_by_agent(tenant, pool, oldest, before, keys.len())
            .await?;
        let newest_end_ms = keys.iter().map(|k| u64_of(k.window_end_ms)).max();
        let history = self
            .terms_history(
                tenant,
                pool,
                u64_of(oldest),
                newest_end_ms.unwrap_or(u64::MAX),
            )
            .await?;
        let by_region = |rows: &[RegionAmount], window_start_ms: i64| -> BTreeMap<RegionId, u64> {
            rows.iter()
                .filter(|r| r.window_start_ms == window_start_ms)
                .filter_map(|r| Some((RegionId::parse(&r.region).ok()?, u64_of(r.amount))))
                .collect()
        };
        let rows = keys
            .into_iter()
            .map(|key| {
                let in_window: Vec<&LeaseAmounts> = amounts
                    .iter()
                    .filter(|a| a.window_start_ms == key.window_start_ms)
                    .collect();
                let sum = |of: fn(&LeaseAmounts) -> i64| {
                    in_window
                        .iter()
                        .fold(0u64, |total, a| total.saturating_add(u64_of(of(a))))
                };
                let mut amounts = WindowAmounts {
                    window_start_ms: u64_of(key.window_start_ms),
                    window_end_ms: u64_of(key.window_end_ms),
                    granted_tokens_by_region: by_region(&granted_rows, key.window_start_ms),
                    spent_tokens_by_region: in_window
                        .iter()
                        .filter_map(|a| Some((RegionId::parse(&a.region).ok()?, u64_of(a.spent))))
                        .collect(),
                    stranded_tokens: sum(|a| a.stranded),
                    unreported_tokens: sum(|a| a.unreported),
                    returned_tokens: sum(|a| a.returned),
                    fallback_admitted_tokens_by_region: by_region(
                        &fallback_rows,
                        key.window_start_ms,
                    ),
                    fallback_admitted_tokens_by_agent: by_agent
                        .get(&key.window_start_ms)
                        .cloned()
                        .unwrap_or_default(),
                    shadow_admitted_tokens_by_region: by_region(&shadow_rows, key.window_start_ms),
                    settle_debt_tokens_by_region: by_region(&debt_rows, key.window_start_ms),
                    written_off_tokens_by_region: by_region(&written_off_rows, key.window_start_ms),
                };
                if let Some(window) = rolled.get(&amounts.window_start_ms) {
                    window.merge_into(&mut amounts);
                }
                let terms = window_terms(
                    config,
                    limits.overrides,
                    &history,
                    Window {
                        start_ms: amounts.window_start_ms,
                        end_ms: amounts.window_end_ms,
                    },
                );
                account(amounts, &terms)
            })
            .collect();
        Ok(rows)
    }

    /// Fallback (or shadow, settle debt, written-off) amounts per region of the pool's latest
    /// windows, from `table`: each region's the sum over its agents (at most 64 regions a
    /// window).
    async fn admits_rows<T: sea_query::Iden + Copy + 'static>(
        &self,
        table: T,
        tenant: &TenantId,
        pool: &PoolId,
        last: u64,
        before: i64,
    ) -> Result<Vec<RegionAmount>, LedgerError> {
        let statement = Query::select()
            .column(FallbackAdmits::WindowStartMs)
            .expr_as(Expr::col(FallbackAdmits::Region), Alias::new("region"))
            .expr_as(
                sum_as_bigint(Expr::col(FallbackAdmits::Admitted)),
                Alias::new("amount"),
            )
            .from(table)
            .cond_where(
                of_pool(table, tenant, pool)
                    .add(Expr::col((table, Alias::new("window_start_ms"))).lt(before)),
            )
            .group_by_col(FallbackAdmits::WindowStartMs)
            .group_by_col(FallbackAdmits::Region)
            .order_by(FallbackAdmits::WindowStartMs, Order::Desc)
            .limit(last * 64)
            .to_owned();
        Ok(on_db!(self, statement, |sql, values, db| {
            sqlx::query_as_with(&sql, values).fetch_all(db).await?
        }))
    }

    /// Each agent's fallback admits in the pool's windows from `oldest` to before `before`
    /// (`windows` of them), by window start, region and agent. At most
    /// [`MAX_AGENT_ROWS_PER_WINDOW`] rows a window are read; when the read is cut short, its oldest
    /// window (perhaps partly read) is left out.
    async fn fallback_by_agent(
        &self,
        tenant: &TenantId,
        pool: &PoolId,
        oldest: i64,
        before: i64,
        windows: usize,
    ) -> Result<BTreeMap<i64, BTreeMap<RegionId, BTreeMap<String, u64>>>, LedgerError> {
        let limit = (windows as u64).max(1) * MAX_AGENT_ROWS_PER_WINDOW;
        let statement = Query::select()
            .column(FallbackAdmits::WindowStartMs)
            .expr_as(Expr::col(FallbackAdmits::Region), Alias::new("region"))
            .expr_as(Expr::col(FallbackAdmits::AgentId), Alias::new("agent_id"))
            .expr_as(Expr::col(FallbackAdmits::Admitted), Alias::new("amount"))
            .from(FallbackAdmits::Table)
            .cond_where(
                of_pool(FallbackAdmits::Table, tenant, pool)
                    .add(Expr::col(FallbackAdmits::WindowStartMs).gte(oldest))
                    .add(Expr::col(FallbackAdmits::WindowStartMs).lt(before))
                    .add(Expr::col(FallbackAdmits::Admitted).gt(0i64)),
            )
            .order_by(FallbackAdmits::WindowStartMs, Order::Desc)
            .limit(limit)
            .to_owned();
        let rows: Vec<AgentAmount> = on_db!(self, statement, |sql, values, db| {
            sqlx::query_as_with(&sql, values).fetch_all(db).await?
        });
        let cut_short = rows.len() as u64 >= limit;
        let cut_window = rows.last().map(|row| row.window_start_ms);
        let mut by_window: BTreeMap<i64, BTreeMap<RegionId, BTreeMap<String, u64>>> =
            BTreeMap::new();
        for row in rows {
            let Ok(region) = RegionId::parse(&row.region) else {
                continue;
            };
            let agent = if row.agent_id == UNNAMED_AGENT {
                UNNAMED_AGENT_LABEL.to_owned()
            } else {
                row.agent_id
            };
            by_window
                .entry(row.window_start_ms)
                .or_default()
                .entry(region)
                .or_default()
                .insert(agent, u64_of(row.amount));
        }
        if cut_short && let Some(window) = cut_window {
            by_window.remove(&window);
        }
        Ok(by_window)
    }

    /// The latest `last` windows starting before `before` with grants, fallback or shadow admits,
    /// newest first.
    async fn window_keys(
        &self,
        tenant: &TenantId,
        pool: &PoolId,
        config: &PoolConfig,
        (last, before): (u64, i64),
        admits_rows: &[&[RegionAmount]],
    ) -> Result<Vec<WindowKey>, LedgerError> {
        let statement = Query::select()
            .distinct()
            .columns([Grants::WindowStartMs, Grants::WindowEndMs])
            .from(Grants::Table)
            .cond_where(
                of_pool(Alias::new("grants"), tenant, pool)
                    .add(Expr::col((Grants::Table, Grants::WindowStartMs)).lt(before)),
            )
            .order_by(Grants::WindowStartMs, Order::Desc)
            .limit(last)
            .to_owned();
        let mut keys: Vec<WindowKey> = on_db!(self, statement, |sql, values, db| {
            sqlx::query_as_with(&sql, values).fetch_all(db).await?
        });
        // A window with fallback admits and no grant (a region cut off all window long), or with
        // shadow admits only (a pool in shadow mode grants nothing).
        for row in admits_rows.iter().flat_map(|rows| rows.iter()) {
            if !keys
                .iter()
                .any(|k| k.window_start_ms == row.window_start_ms)
            {
                let window = config.window_at(u64_of(row.window_start_ms));
                keys.push(WindowKey {
                    window_start_ms: row.window_start_ms,
                    window_end_ms: i64_of(window.end_ms),
                });
            }
        }
        keys.sort_by_key(|k| std::cmp::Reverse(k.window_start_ms));
        keys.truncate(usize::try_from(last).unwrap_or(usize::MAX));
        Ok(keys)
    }

    /// Tokens granted per window and region, from window `oldest` on.
    async fn granted_rows(
        &self,
        tenant: &TenantId,
        pool: &PoolId,
        oldest: i64,
    ) -> Result<Vec<RegionAmount>, LedgerError> {
        let statement = Query::select()
            .column(Grants::WindowStartMs)
            .column(Grants::Region)
            .expr_as(
                sum_as_bigint(Expr::col(Grants::Granted)),
                Alias::new("amount"),
            )
            .from(Grants::Table)
            .cond_where(since(tenant, pool, oldest))
            .group_by_col(Grants::WindowStartMs)
            .group_by_col(Grants::Region)
            .to_owned();
        Ok(on_db!(self, statement, |sql, values, db| {
            sqlx::query_as_with(&sql, values).fetch_all(db).await?
        }))
    }

    /// Per window and region from `oldest` on: what leases spent, and, over leases ended by
    /// `now_ms`, what they stranded (final report in) or left unreported (none).
    async fn lease_amounts(
        &self,
        tenant: &TenantId,
        pool: &PoolId,
        oldest: i64,
        now_ms: u64,
    ) -> Result<Vec<LeaseAmounts>, LedgerError> {
        let expired = Expr::col((Grants::Table, Grants::ExpiresAtMs)).lte(i64_of(now_ms));
        let spent = Expr::col((LeaseSpend::Table, LeaseSpend::Spent));
        let returned = Expr::col((LeaseSpend::Table, LeaseSpend::Returned));
        let granted = Expr::col((Grants::Table, Grants::Granted));
        let is_final = Expr::col((LeaseSpend::Table, LeaseSpend::FinalReport)).eq(1i64);
        let unspent = || {
            granted.clone().sub(Func::coalesce([
                spent.clone().into(),
                Expr::val(0i64).into(),
            ]))
        };
        // What a final report left unspent and the allocator did not take back.
        let stranded_case = Expr::case(
            Cond::all().add(expired.clone()).add(is_final.clone()),
            unspent().sub(Func::coalesce([
                returned.clone().into(),
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
            unspent(),
        )
        .finally(0i64);
        let statement = Query::select()
            .expr_as(
                Expr::col((Grants::Table, Grants::WindowStartMs)),
                Alias::new("window_start_ms"),
            )
            .expr_as(
                Expr::col((Grants::Table, Grants::Region)),
                Alias::new("region"),
            )
            .expr_as(sum_as_bigint(spent.clone()), Alias::new("spent"))
            .expr_as(sum_as_bigint(stranded_case), Alias::new("stranded"))
            .expr_as(sum_as_bigint(unreported_case), Alias::new("unreported"))
            .expr_as(sum_as_bigint(returned), Alias::new("returned"))
            .from(Grants::Table)
            .join(
                JoinType::LeftJoin,
                LeaseSpend::Table,
                Expr::col((LeaseSpend::Table, LeaseSpend::LeaseId))
                    .equals((Grants::Table, Grants::LeaseId)),
            )
            .cond_where(since(tenant, pool, oldest))
            .group_by_col((Grants::Table, Grants::WindowStartMs))
            .group_by_col((Grants::Table, Grants::Region))
            .to_owned();
        Ok(on_db!(self, statement, |sql, values, db| {
            sqlx::query_as_with(&sql, values).fetch_all(db).await?
        }))
    }
}

/// Rows of `table` that belong to `tenant`/`pool`.
fn of_pool<T: sea_query::Iden + Clone + 'static>(
    table: T,
    tenant: &TenantId,
    pool: &PoolId,
) -> Cond {
    Cond::all()
        .add(Expr::col((table.clone(), Alias::new("tenant"))).eq(tenant.as_str()))
        .add(Expr::col((table, Alias::new("pool"))).eq(pool.as_str()))
}

/// Grants of `tenant`/`pool` in windows from `oldest` on.
fn since(tenant: &TenantId, pool: &PoolId, oldest: i64) -> Cond {
    of_pool(Alias::new("grants"), tenant, pool)
        .add(Expr::col((Grants::Table, Grants::WindowStartMs)).gte(oldest))
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(name: &str) -> RegionId {
        RegionId::parse(name).expect("region")
    }

    /// `G` 1,000 and 100 tokens of fallback for each of eu and us: a bound of 1,200.
    fn terms() -> WindowTerms {
        WindowTerms {
            limit_tokens: 1_000,
            fallback_per_region_tokens: 100,
            settle_debt_per_region_tokens: 0,
            regions: [region("eu"), region("us")].into(),
        }
    }

    #[test]
    fn a_window_admits_what_its_leases_spent_and_its_regions_admitted_in_fallback() {
        let amounts = WindowAmounts {
            window_start_ms: 60_000,
            window_end_ms: 120_000,
            granted_tokens_by_region: [(region("eu"), 700), (region("us"), 300)].into(),
            spent_tokens_by_region: [(region("eu"), 650), (region("us"), 300)].into(),
            stranded_tokens: 40,
            unreported_tokens: 10,
            returned_tokens: 0,
            fallback_admitted_tokens_by_region: [(region("eu"), 80), (region("us"), 20)].into(),
            fallback_admitted_tokens_by_agent: BTreeMap::new(),
            shadow_admitted_tokens_by_region: [(region("eu"), 1_500), (region("us"), 200)].into(),
            settle_debt_tokens_by_region: [(region("eu"), 30), (region("us"), 5)].into(),
            written_off_tokens_by_region: [(region("us"), 7)].into(),
        };
        let row = account(amounts, &terms());
        assert_eq!(
            (row.settle_debt_tokens, row.written_off_tokens),
            (35, 7),
            "settle debt and write-offs are told apart, never admitted"
        );
        assert_eq!(
            row.shadow_admitted_tokens, 1_700,
            "a shadow rule's count is told apart, never admitted or overshoot"
        );
        assert_eq!(row.granted_tokens, 1_000);
        assert_eq!(row.fallback_admitted_tokens, 100);
        assert_eq!(row.admitted_tokens, 1_050);
        assert_eq!(row.overshoot_tokens, 50, "admitted beyond G");
        assert_eq!((row.limit_tokens, row.bound_tokens), (1_000, 1_200));
        assert_eq!((row.stranded_tokens, row.unreported_tokens), (40, 10));
        assert_eq!(row.granted_tokens_by_region[&region("eu")], 700);
        assert_eq!(row.spent_tokens, 950);
        assert_eq!(
            row.admitted_tokens_by_region,
            [(region("eu"), 730), (region("us"), 320)].into(),
            "each region's spent plus its fallback admits"
        );
        // Within the limit, no overshoot; an empty window is all zeros but for its terms.
        let quiet = account(
            WindowAmounts {
                spent_tokens_by_region: [(region("eu"), 400)].into(),
                ..WindowAmounts::default()
            },
            &terms(),
        );
        assert_eq!((quiet.admitted_tokens, quiet.overshoot_tokens), (400, 0));
        let empty = account(WindowAmounts::default(), &terms());
        assert_eq!(
            (
                empty.granted_tokens,
                empty.admitted_tokens,
                empty.overshoot_tokens
            ),
            (0, 0, 0)
        );
        // Saturating, never wrapping, on absurd stored amounts.
        let huge = account(
            WindowAmounts {
                spent_tokens_by_region: [(region("eu"), u64::MAX), (region("us"), 1)].into(),
                fallback_admitted_tokens_by_region: [(region("eu"), 5)].into(),
                ..WindowAmounts::default()
            },
            &terms(),
        );
        assert_eq!(huge.admitted_tokens, u64::MAX);
    }

    #[test]
    fn a_region_whose_agents_took_more_than_its_allowance_breaks_the_bound_within_the_total() {
        // Two agents of eu each admitted the region's whole allowance: 200 of 100. The window's
        // total (400 + 200 = 600) is far within its bound of 1,200.
        let amounts = WindowAmounts {
            spent_tokens_by_region: [(region("eu"), 400)].into(),
            fallback_admitted_tokens_by_region: [(region("eu"), 200), (region("us"), 100)].into(),
            ..WindowAmounts::default()
        };
        let row = account(amounts, &terms());
        assert!(row.admitted_tokens <= row.bound_tokens);
        assert_eq!(
            row.fallback_over_allowance_tokens_by_region,
            [(region("eu"), 100)].into(),
            "us used exactly its allowance: not over"
        );
        assert_eq!(row.fallback_over_allowance_tokens(), 100);
        assert!(row.violates_bound());
        // A region no configuration in force named has no allowance at all.
        let stranger = account(
            WindowAmounts {
                fallback_admitted_tokens_by_region: [(region("ap"), 1)].into(),
                ..WindowAmounts::default()
            },
            &terms(),
        );
        assert_eq!(stranger.fallback_over_allowance_tokens(), 1);
        let within = account(
            WindowAmounts {
                fallback_admitted_tokens_by_region: [(region("eu"), 100)].into(),
                ..WindowAmounts::default()
            },
            &terms(),
        );
        assert!(!within.violates_bound());
    }
}
