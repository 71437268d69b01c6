//! The terms each window is judged by: every configuration of its pool in force while it ran, from
//! the pool's history in the ledger, not the one in force today. An operator who lowers a pool's
//! fallback allowance after a partition (as the runbook says) must not turn the partition's
//! windows, within their bound when they ran, into violations.
//!
//! A change reaches the agents at their next look at the pool's terms (every
//! `TERMS_REFRESH_MS`, 30 s, while they reach the allocator), so a configuration counts as in
//! force from its change until [`TERMS_REACH_MS`] after the next one. Where several were in force
//! during a window, it is held to the most generous of each term: the highest limit (with its
//! overrides), the largest fallback and settle-debt allowances, and every region any of them
//! named. [`window_terms`] is the arithmetic, pure; [`Ledger::terms_history`] reads the history.

use std::collections::BTreeSet;

use allot_shared::ids::{PoolId, RegionId, TenantId};
use allot_shared::lease::{OvershootBound, PoolConfig};
use allot_shared::overrides::{PoolOverride, window_limit};
use allot_shared::window::Window;
use sea_query::{Expr, Order, PostgresQueryBuilder, Query, SqliteQueryBuilder};
use sea_query_binder::SqlxBinder;

use super::schema::PoolConfigHistory;
use super::{Database, Ledger, LedgerError, i64_of, u64_of};

/// How long after a change of a pool's configuration the agents may still act on the one before,
/// ms: twice the agents' terms refresh (30 s), so a window is judged by what any agent could have
/// held during it. An agent cut off from the allocator keeps its terms until it reaches it again:
/// a change made during a partition reaches that region's agents only after the heal.
pub const TERMS_REACH_MS: u64 = 60_000;

/// Most configuration changes read for one windows query (I10): a pool changed more often than
/// this over the windows read is judged by the newest changes only.
pub const MAX_TERMS_CHANGES_READ: u64 = 1_000;

/// One change in a pool's history: when, and the configuration it left (`None`: the pool was
/// deleted, or its stored spec no longer validates).
#[derive(Debug, Clone, PartialEq)]
pub struct TermsChange {
    /// When the change was made (the allocator's clock), epoch ms.
    pub changed_at_ms: u64,
    /// The configuration from then on.
    pub config: Option<PoolConfig>,
}

/// The pool's history around some windows: the changes from a little before the oldest to the
/// newest's end, and whether any came after it.
#[derive(Debug, Clone, Default, PartialEq)]
pub struct TermsHistory {
    /// Changes, oldest first: the last one before the span (when there is one), then every one in
    /// it (at most [`MAX_TERMS_CHANGES_READ`], the newest).
    pub changes: Vec<TermsChange>,
    /// The first change at or after the span's end, epoch ms, if any: the configuration in force
    /// today took over then, so it was not in force before.
    pub next_change_ms: Option<u64>,
}

/// What a window is held to: the most generous of each term among the configurations in force
/// while it ran.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WindowTerms {
    /// `G`, tokens: the highest limit in force (overrides included).
    pub limit_tokens: u64,
    /// Tokens each region may admit in fallback (all its agents together).
    pub fallback_per_region_tokens: u64,
    /// Debt each region may carry from settled metered requests, tokens.
    pub settle_debt_per_region_tokens: u64,
    /// Every region a configuration in force named.
    pub regions: BTreeSet<RegionId>,
}

impl WindowTerms {
    /// The terms of one configuration, its limit as overrides made it during `window`.
    fn of(config: &PoolConfig, overrides: &[PoolOverride], window: Window) -> Self {
        Self {
            limit_tokens: window_limit(config.limit_tokens(), overrides, window),
            fallback_per_region_tokens: config.fallback_per_region_tokens(),
            settle_debt_per_region_tokens: config.settle_debt_per_region_tokens(),
            regions: config.regions().iter().cloned().collect(),
        }
    }

    /// The most generous of each term of `self` and `other`.
    fn widen(mut self, other: Self) -> Self {
        self.limit_tokens = self.limit_tokens.max(other.limit_tokens);
        self.fallback_per_region_tokens = self
            .fallback_per_region_tokens
            .max(other.fallback_per_region_tokens);
        self.settle_debt_per_region_tokens = self
            .settle_debt_per_region_tokens
            .max(other.settle_debt_per_region_tokens);
        self.regions.extend(other.regions);
        self
    }

    /// The design's bound for these terms: leases clamped to their window and grant records that
    /// survive a failover (etcd), so only `G`, the fallback and the settle-debt terms remain.
    pub fn bound(&self) -> OvershootBound {
        let regions = self.regions.len() as u64;
        OvershootBound {
            limit_tokens: self.limit_tokens,
            // The allocator clamps every lease to its window's end.
            unclamped_carry_over_tokens: 0,
            fallback_allowance_tokens: self.fallback_per_region_tokens.saturating_mul(regions),
            lost_grant_record_tokens: 0,
            settle_debt_tokens: self.settle_debt_per_region_tokens.saturating_mul(regions),
        }
    }

    /// The fallback `region`'s agents may admit together in the window, tokens: its allowance if
    /// a configuration in force named it, else none.
    pub fn fallback_allowance(&self, region: &RegionId) -> u64 {
        if self.regions.contains(region) {
            self.fallback_per_region_tokens
        } else {
            0
        }
    }
}

/// The terms `window` is judged by: the configurations in force from [`TERMS_REACH_MS`] before it
/// started to its end, widened together (the most generous of each term). `current` is the pool's
/// configuration today, in force unless `history` records a change at or after the window's end;
/// with no history at all (a pool older than its ledger), it alone.
pub fn window_terms(
    current: &PoolConfig,
    overrides: &[PoolOverride],
    history: &TermsHistory,
    window: Window,
) -> WindowTerms {
    let reach_from_ms = window.start_ms.saturating_sub(TERMS_REACH_MS);
    let before = history
        .changes
        .iter()
        .rev()
        .find(|change| change.changed_at_ms <= reach_from_ms);
    let during = history.changes.iter().filter(|change| {
        change.changed_at_ms > reach_from_ms && change.changed_at_ms < window.end_ms
    });
    let changed_after = history.next_change_ms.is_some()
        || history
            .changes
            .iter()
            .any(|change| change.changed_at_ms >= window.end_ms);
    let today = (!changed_after).then_some(current);
    before
        .into_iter()
        .chain(during)
        .filter_map(|change| change.config.as_ref())
        .chain(today)
        .map(|config| WindowTerms::of(config, overrides, window))
        .reduce(WindowTerms::widen)
        .unwrap_or_else(|| WindowTerms::of(current, overrides, window))
}

#[derive(sqlx::FromRow)]
struct ChangeRow {
    changed_at_ms: i64,
    config_json: String,
}

impl Ledger {
    /// The history of `tenant`'s `pool` around windows from `oldest_start_ms` to `newest_end_ms`:
    /// the change in force [`TERMS_REACH_MS`] before the oldest began, every change until the
    /// newest ended, and when the first one after it was made.
    pub async fn terms_history(
        &self,
        tenant: &TenantId,
        pool: &PoolId,
        oldest_start_ms: u64,
        newest_end_ms: u64,
    ) -> Result<TermsHistory, LedgerError> {
        let reach_from = i64_of(oldest_start_ms.saturating_sub(TERMS_REACH_MS));
        let end = i64_of(newest_end_ms);
        let of_pool = || {
            Query::select()
                .columns([
                    PoolConfigHistory::ChangedAtMs,
                    PoolConfigHistory::ConfigJson,
                ])
                .from(PoolConfigHistory::Table)
                .and_where(Expr::col(PoolConfigHistory::Tenant).eq(tenant.as_str()))
                .and_where(Expr::col(PoolConfigHistory::Pool).eq(pool.as_str()))
                .to_owned()
        };
        let before = of_pool()
            .and_where(Expr::col(PoolConfigHistory::ChangedAtMs).lte(reach_from))
            .order_by(PoolConfigHistory::ChangedAtMs, Order::Desc)
            .limit(1)
            .to_owned();
        let during = of_pool()
            .and_where(Expr::col(PoolConfigHistory::ChangedAtMs).gt(reach_from))
            .and_where(Expr::col(PoolConfigHistory::ChangedAtMs).lt(end))
            .order_by(PoolConfigHistory::ChangedAtMs, Order::Desc)
            .limit(MAX_TERMS_CHANGES_READ)
            .to_owned();
        let after = of_pool()
            .and_where(Expr::col(PoolConfigHistory::ChangedAtMs).gte(end))
            .order_by(PoolConfigHistory::ChangedAtMs, Order::Asc)
            .limit(1)
            .to_owned();
        let mut rows: Vec<ChangeRow> = Vec::new();
        for statement in [before, during] {
            let found: Vec<ChangeRow> = on_db!(self, statement, |sql, values, db| {
                sqlx::query_as_with(&sql, values).fetch_all(db).await?
            });
            rows.extend(found);
        }
        let next: Vec<ChangeRow> = on_db!(self, after, |sql, values, db| {
            sqlx::query_as_with(&sql, values).fetch_all(db).await?
        });
        rows.sort_by_key(|row| row.changed_at_ms);
        Ok(TermsHistory {
            changes: rows
                .into_iter()
                .map(|row| TermsChange {
                    changed_at_ms: u64_of(row.changed_at_ms),
                    config: stored_config(&row.config_json),
                })
                .collect(),
            next_change_ms: next.first().map(|row| u64_of(row.changed_at_ms)),
        })
    }
}

/// A configuration as the history stores it (the pool's spec; `{}` for a deletion).
fn stored_config(config_json: &str) -> Option<PoolConfig> {
    serde_json::from_str::<crate::pools::PoolSpec>(config_json)
        .ok()?
        .validate()
        .ok()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn region(name: &str) -> RegionId {
        RegionId::parse(name).expect("region")
    }

    fn config(limit: u64, fallback: u64, regions: &[&str]) -> PoolConfig {
        PoolConfig::new(
            limit,
            60_000,
            1,
            10_000,
            fallback,
            regions.iter().map(|r| region(r)).collect(),
        )
        .expect("config")
    }

    fn change(at_ms: u64, config: PoolConfig) -> TermsChange {
        TermsChange {
            changed_at_ms: at_ms,
            config: Some(config),
        }
    }

    const W: Window = Window {
        start_ms: 600_000,
        end_ms: 660_000,
    };

    #[test]
    fn a_window_is_judged_by_the_terms_in_force_while_it_ran_not_by_todays() {
        // The allowance was 8 a region during the window; lowered to 0 long after it ended.
        let then = config(10, 8, &["eu", "us"]);
        let today = config(10, 0, &["eu", "us"]);
        let history = TermsHistory {
            changes: vec![change(0, then.clone()), change(900_000, today.clone())],
            next_change_ms: None,
        };
        let terms = window_terms(&today, &[], &history, W);
        assert_eq!(terms.fallback_per_region_tokens, 8);
        assert_eq!(terms.bound().total_tokens(), 10 + 8 * 2);
        // A window after the change (and its reach) is judged by today's.
        let later = Window {
            start_ms: 1_200_000,
            end_ms: 1_260_000,
        };
        assert_eq!(
            window_terms(&today, &[], &history, later)
                .bound()
                .total_tokens(),
            10
        );
    }

    #[test]
    fn a_change_counts_until_the_agents_can_have_taken_it_up() {
        let generous = config(10, 8, &["eu"]);
        let strict = config(10, 0, &["eu"]);
        // Lowered 30 s before the window began: agents may still hold the old terms in it.
        let history = TermsHistory {
            changes: vec![
                change(0, generous.clone()),
                change(W.start_ms - 30_000, strict.clone()),
            ],
            next_change_ms: None,
        };
        assert_eq!(
            window_terms(&strict, &[], &history, W).fallback_per_region_tokens,
            8
        );
        // Lowered more than the reach before: only the new terms.
        let long_before = TermsHistory {
            changes: vec![
                change(0, generous),
                change(W.start_ms - TERMS_REACH_MS - 1, strict.clone()),
            ],
            next_change_ms: None,
        };
        assert_eq!(
            window_terms(&strict, &[], &long_before, W).fallback_per_region_tokens,
            0
        );
    }

    #[test]
    fn changes_during_a_window_widen_every_term_and_join_their_regions() {
        let first = config(10, 2, &["eu"]);
        let second = config(20, 1, &["us"]);
        let history = TermsHistory {
            changes: vec![
                change(0, first),
                change(W.start_ms + 10_000, second.clone()),
            ],
            next_change_ms: None,
        };
        let terms = window_terms(&second, &[], &history, W);
        assert_eq!(terms.limit_tokens, 20);
        assert_eq!(terms.fallback_per_region_tokens, 2);
        assert_eq!(terms.regions, [region("eu"), region("us")].into());
        assert_eq!(terms.fallback_allowance(&region("eu")), 2);
        assert_eq!(terms.fallback_allowance(&region("ap")), 0);
    }

    #[test]
    fn todays_terms_count_only_when_no_change_followed_the_window() {
        let then = config(10, 4, &["eu"]);
        let today = config(50, 40, &["eu"]);
        let history = TermsHistory {
            changes: vec![change(0, then)],
            next_change_ms: Some(W.end_ms + 5),
        };
        let terms = window_terms(&today, &[], &history, W);
        assert_eq!(
            (terms.limit_tokens, terms.fallback_per_region_tokens),
            (10, 4)
        );
        // No history at all: today's terms, as before the ledger kept any.
        let none = window_terms(&today, &[], &TermsHistory::default(), W);
        assert_eq!(
            (none.limit_tokens, none.fallback_per_region_tokens),
            (50, 40)
        );
        // A deletion in force leaves nothing of its own: the terms around it judge the window.
        let deleted = TermsHistory {
            changes: vec![TermsChange {
                changed_at_ms: 0,
                config: None,
            }],
            next_change_ms: None,
        };
        assert_eq!(window_terms(&today, &[], &deleted, W).limit_tokens, 50);
    }
}
