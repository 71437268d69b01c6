//! The leader's ledger sync: what keeps the SQL ledger in step with the store, and what it learns
//! from it. Committed grants are fed to the ledger as they happen; every
//! [`LEDGER_RECONCILE_INTERVAL`] the leader copies any grant the feed missed, publishes each pool's
//! latest settled window as gauges, and checks every window that settled against its bound, once.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};

use allot_shared::ids::{PoolId, TenantId};
use tokio::sync::watch;

use crate::clock::Clock;
use crate::kv::Kv;
use crate::leader::{Role, Roles};
use crate::ledger::{Ledger, Retention, WindowRow};
use crate::pools::{GrantRecord, StoredPool, list_all_grants_page, list_pools, pool_key};

/// Grants just committed to the store, for the ledger: what the grantor sends down the feed.
#[derive(Debug, Clone)]
pub struct CommittedGrants {
    /// The tenant.
    pub tenant: TenantId,
    /// The pool.
    pub pool: PoolId,
    /// The new grant records.
    pub records: Vec<GrantRecord>,
}

/// Grants copied to the ledger per batch of the feed, and the feed's capacity in batches (I10).
pub const LEDGER_FEED_BATCHES: usize = 1_024;

/// The grantor's end of the ledger feed: committed grants go down it, and a batch it could not
/// take (full) marks the feed as having missed some, for the next ledger round to reconcile.
#[derive(Debug, Clone)]
pub struct LedgerFeed {
    sender: tokio::sync::mpsc::Sender<CommittedGrants>,
    missed: Arc<AtomicBool>,
}

/// The ledger's end of the feed: the grants, and whether any were missed on the way (the feed
/// full, or the ledger refused a batch) since the last reconciliation.
#[derive(Debug)]
pub struct LedgerFeedReceiver {
    grants: tokio::sync::mpsc::Receiver<CommittedGrants>,
    missed: Arc<AtomicBool>,
}

/// A ledger feed of [`LEDGER_FEED_BATCHES`] batches. It starts as having missed grants: the first
/// round a leader runs reconciles whatever is in the store.
pub fn ledger_feed() -> (LedgerFeed, LedgerFeedReceiver) {
    let (sender, grants) = tokio::sync::mpsc::channel(LEDGER_FEED_BATCHES);
    let missed = Arc::new(AtomicBool::new(true));
    (
        LedgerFeed {
            sender,
            missed: missed.clone(),
        },
        LedgerFeedReceiver { grants, missed },
    )
}

impl LedgerFeed {
    /// Sends `committed` to the ledger, or, the feed being full, marks it missed (counted and
    /// logged): the next ledger round copies it from the store.
    pub fn send(&self, committed: CommittedGrants) {
        use tokio::sync::mpsc::error::TrySendError;
        if let Err(TrySendError::Full(missed) | TrySendError::Closed(missed)) =
            self.sender.try_send(committed)
        {
            self.missed.store(true, Ordering::Release);
            metrics::counter!(crate::metrics::LEDGER_FEED_FULL).increment(1);
            tracing::warn!(tenant = %missed.tenant, pool = %missed.pool,
                "ledger feed full; these grants reach the ledger at the next reconciliation");
        }
    }
}
/// How often every pool's grant records in the store are reconciled into the ledger, unless
/// `--ledger-round-seconds` says otherwise.
pub const LEDGER_RECONCILE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);
/// The longest ledger round an operator may set, seconds: grant records outlive their commit by
/// more than a round and an election (`grants::record_min_lifetime_ms`), so a round may not grow
/// past what that lifetime covers.
pub const MAX_LEDGER_ROUND_SECONDS: u64 = 30;

/// What the leader's ledger rounds do, and how often.
#[derive(Debug, Clone, Copy)]
pub struct LedgerRounds {
    /// What the ledger keeps, and how long.
    pub retention: Retention,
    /// How often a round runs (at most [`MAX_LEDGER_ROUND_SECONDS`]).
    pub every: std::time::Duration,
}

impl Default for LedgerRounds {
    fn default() -> Self {
        Self {
            retention: Retention::default(),
            every: LEDGER_RECONCILE_INTERVAL,
        }
    }
}

/// Copies committed grants into the ledger, and reconciles the ledger with the store at once
/// when this node takes the lead and at the next round (every [`LEDGER_RECONCILE_INTERVAL`]) after
/// the feed missed grants, so that a grant the feed dropped (full, the database down, or a leader
/// killed with grants still in its feed) still arrives. While the feed misses nothing, a round
/// reads no grant records: an idle store costs it nothing. Grant records outlive their commit by
/// [`crate::grants::record_min_lifetime_ms`]: longer than a round's period plus an election, so
/// some leader's round always sees each one.
pub async fn feed_ledger(
    ledger: Ledger,
    rounds: LedgerRounds,
    kv: Arc<dyn Kv>,
    clock: Arc<dyn Clock>,
    mut role: watch::Receiver<Roles>,
    feed: LedgerFeedReceiver,
    shutdown: impl Future<Output = ()>,
) {
    let LedgerFeedReceiver {
        grants: mut feed,
        missed,
    } = feed;
    tokio::pin!(shutdown);
    let LedgerRounds {
        retention,
        every: round,
    } = rounds;
    let mut reconcile = tokio::time::interval(round);
    // Every shard's term as last seen while this node coordinated: a new term of any shard (this
    // node's lead of shard 0, even one reached through a lapse that a long round hid, or another
    // shard's failover or hand-over) may leave a predecessor's unfed grants, copied at once.
    let (mut seen_terms, mut election_over) = (Vec::new(), false);
    // The terms of the shards this node led when it last looked: a shard leader that is not the
    // coordinator copies its predecessor's unfed grants itself when it takes a shard, and the
    // grants its own feed missed at its next round.
    let mut led_terms: Vec<allot_shared::ids::Epoch> = Vec::new();
    let mut rotation = CheckRotation::default();
    loop {
        tokio::select! {
            () = &mut shutdown => return,
            committed = feed.recv() => {
                let Some(committed) = committed else { return };
                if let Err(error) = ledger
                    .record_grants(&committed.tenant, &committed.pool, &committed.records)
                    .await
                {
                    missed.store(true, Ordering::Release);
                    tracing::warn!(%error, "could not copy grants to the ledger; reconciliation will");
                }
            }
            changed = role.changed(), if !election_over => {
                if changed.is_err() {
                    // The election ended (shutdown): only the feed is left to drain.
                    election_over = true;
                    continue;
                }
                let roles = role.borrow_and_update().clone();
                let leading: Vec<_> = roles.leading().map(|l| l.epoch).collect();
                let took_a_shard = leading.iter().any(|term| !led_terms.contains(term));
                led_terms = leading;
                if roles.coordinating().is_some() && new_terms(&mut seen_terms, &roles) {
                    // The last leader may have died with grants in its feed: copy them while
                    // their records are still in the store.
                    missed.store(true, Ordering::Release);
                    ledger_round(&ledger, retention, &*kv, &*clock, &mut rotation, &missed).await;
                    reconcile.reset();
                } else if took_a_shard {
                    missed.store(true, Ordering::Release);
                    reconcile_if_missed(&ledger, &*kv, &missed).await;
                }
            }
            _ = reconcile.tick() => {
                // The leader's ledger is the one reports reach; a follower would re-read every
                // pool's grants for nothing.
                let (coordinating, leads_any) = {
                    let roles = role.borrow();
                    (roles.coordinating().is_some(), roles.leading().next().is_some())
                };
                if coordinating {
                    ledger_round(&ledger, retention, &*kv, &*clock, &mut rotation, &missed).await;
                } else if leads_any {
                    reconcile_if_missed(&ledger, &*kv, &missed).await;
                }
            }
        }
    }
}

/// Whether any shard has a leader term unlike the one in `seen` (each shard's last known term),
/// which it updates.
fn new_terms(seen: &mut Vec<Option<allot_shared::ids::Epoch>>, roles: &Roles) -> bool {
    seen.resize(roles.all().len(), None);
    let mut any_new = false;
    for (seen, role) in seen.iter_mut().zip(roles.all()) {
        let term = match role {
            Role::Leader(leadership) => Some(leadership.epoch),
            Role::Follower(Some(leader)) => Some(leader.epoch),
            Role::Follower(None) | Role::Unknown => None,
        };
        if term.is_some() && term != *seen {
            *seen = term;
            any_new = true;
        }
    }
    any_new
}

/// One leader's round: copy the grants the ledger lacks (when the feed `missed` some), publish
/// gauges, check settled windows, remove what the ledger no longer keeps, and the overrides the
/// store no longer keeps.
async fn ledger_round(
    ledger: &Ledger,
    retention: Retention,
    kv: &dyn Kv,
    clock: &dyn Clock,
    rotation: &mut CheckRotation,
    missed: &AtomicBool,
) {
    // One listing of the pools serves both passes.
    let pools = match list_pools(kv).await {
        Ok(pools) => pools,
        Err(error) => {
            tracing::warn!(%error, "ledger round skipped: pools not listed");
            return;
        }
    };
    reconcile_if_missed(ledger, kv, missed).await;
    if let Err(error) = publish_ledger_gauges(ledger, kv, &pools, rotation, clock.now_ms()).await {
        tracing::warn!(%error, "ledger gauges not updated");
    }
    match ledger.remove_expired(retention, clock.now_ms()).await {
        Ok(removed) => {
            metrics::counter!(crate::metrics::LEDGER_WINDOWS_ROLLED_UP)
                .increment(removed.windows_rolled_up);
            for (table, rows) in removed.rows {
                metrics::counter!(crate::metrics::LEDGER_ROWS_REMOVED, "table" => table)
                    .increment(rows);
            }
        }
        Err(error) => tracing::warn!(%error, "ledger retention round failed; the next one retries"),
    }
    // Overrides ended long enough ago leave the store (one read until the first is due).
    match crate::overrides::remove_ended(kv, clock.now_ms()).await {
        Ok(0) => {}
        Ok(removed) => tracing::info!(removed, "ended overrides removed"),
        Err(error) => tracing::warn!(%error, "ended overrides not removed; the next round retries"),
    }
}

/// Reconciles the ledger with the store when the feed `missed` grants (or a new lead says it may
/// have). The flag is taken before the read: a grant missed while it runs marks the feed again.
async fn reconcile_if_missed(ledger: &Ledger, kv: &dyn Kv, missed: &AtomicBool) {
    if missed.swap(false, Ordering::AcqRel) {
        metrics::counter!(crate::metrics::LEDGER_RECONCILIATIONS).increment(1);
        if let Err(error) = reconcile_grants(ledger, kv).await {
            missed.store(true, Ordering::Release);
            tracing::warn!(%error, "ledger reconciliation failed; the next round retries");
        }
    }
}

/// Copies every grant record in the store that the ledger lacks, reading the records of all pools
/// a page of [`MAX_PREFIX_KEYS`](crate::kv::MAX_PREFIX_KEYS) at a time: a round costs one store
/// read per page of records, not one per pool, and no listing is cut short at a cap.
pub async fn reconcile_grants(ledger: &Ledger, kv: &dyn Kv) -> Result<(), String> {
    let mut after = String::new();
    loop {
        let (records, next) = list_all_grants_page(kv, &after, crate::kv::MAX_PREFIX_KEYS)
            .await
            .map_err(|e| e.to_string())?;
        // Most records are in the ledger already (the feed copied them): one read says which are
        // not, and only those are written, so a round is reads, not a rewrite of every record.
        let leases: Vec<_> = records
            .iter()
            .map(|(_, _, record)| record.lease_id)
            .collect();
        let missing: std::collections::HashSet<_> = ledger
            .missing_grants(&leases)
            .await
            .map_err(|e| e.to_string())?
            .into_iter()
            .collect();
        // A page is in key order, so each pool's records are one run of it.
        for run in records.chunk_by(|a, b| (&a.0, &a.1) == (&b.0, &b.1)) {
            let (tenant, pool, _) = &run[0];
            let grants: Vec<GrantRecord> = run
                .iter()
                .filter(|(_, _, record)| missing.contains(&record.lease_id))
                .map(|(_, _, record)| record.clone())
                .collect();
            if !grants.is_empty() {
                ledger
                    .record_grants(tenant, pool, &grants)
                    .await
                    .map_err(|e| e.to_string())?;
            }
        }
        match next {
            Some(last) => after = last,
            None => return Ok(()),
        }
    }
}

/// Most pools whose windows are checked and published as gauges per round (I10); with more pools,
/// each round takes the next ones ([`CheckRotation`]).
pub const MAX_WINDOW_GAUGE_POOLS: usize = 1_000;

/// Where the bound checks go on next round. A round checks at most [`MAX_WINDOW_GAUGE_POOLS`]
/// pools: the ones after the last round's, in key order, wrapping around; so with `n` pools each
/// is visited every `ceil(n / MAX_WINDOW_GAUGE_POOLS)` rounds, and the windows it re-checks on a
/// visit reach back over the gap since the last one. No pool is left out, however many there are.
#[derive(Debug, Default, Clone)]
pub struct CheckRotation {
    /// The store key of the last pool checked.
    after_key: Option<String>,
    /// How many pools the last round found active: how many rounds a rotation takes.
    last_active: usize,
}

impl CheckRotation {
    /// The pools of `pools` (all of them, in key order, as [`list_pools`] gives them) this round
    /// checks; and moves on past them.
    pub fn next_round<'a>(
        &mut self,
        pools: &'a [(TenantId, PoolId, StoredPool)],
    ) -> Vec<&'a (TenantId, PoolId, StoredPool)> {
        let start = self.after_key.as_ref().map_or(0, |after| {
            pools.partition_point(|(tenant, pool, _)| pool_key(tenant, pool) <= *after)
        });
        let visited: Vec<_> = pools
            .iter()
            .cycle()
            .skip(start)
            .take(pools.len().min(MAX_WINDOW_GAUGE_POOLS))
            .collect();
        self.after_key = visited
            .last()
            .map(|(tenant, pool, _)| pool_key(tenant, pool));
        visited
    }

    /// Rounds between two visits of a pool when there are `pool_count` pools.
    pub fn rounds_per_visit(pool_count: usize) -> u64 {
        pool_count.div_ceil(MAX_WINDOW_GAUGE_POOLS).max(1) as u64
    }
}
/// A window's row is published once it ended this long ago, ms: its last reports (every second,
/// and a final one at lease expiry) have arrived by then.
pub const WINDOW_GAUGE_SETTLE_MS: u64 = 5_000;

/// Publishes the ledger's view as gauges: the rollout's current bundle version, and for each pool
/// this round visits (`rotation`'s next, out of the pools of `pools` with windows to check or
/// publish: `active_pools`) the admitted tokens and the bound of its latest settled window.
/// Returns how many pools it visited. On the way, checks every window that settled against its
/// bound (the ledger's `bound_checks`), again on each visit for [`BOUND_RECHECK_MS`] after it ended
/// (and over the gap between visits), counting windows checked and violations.
///
/// Long by design: it is one round of the ledger's gauges, and each pool visited reads its windows
/// once for both uses, the bound checks and the gauges of its latest settled window; split, the
/// windows would be read twice a visit or handed between functions, and the round's metrics would
/// no longer be listed in one place.
pub async fn publish_ledger_gauges(
    ledger: &Ledger,
    kv: &dyn Kv,
    pools: &[(TenantId, PoolId, StoredPool)],
    rotation: &mut CheckRotation,
    now_ms: u64,
) -> Result<usize, String> {
    let rollout = crate::policies::rollout(kv)
        .await
        .map_err(|e| e.to_string())?;
    metrics::gauge!(crate::metrics::POLICY_CURRENT_VERSION).set(rollout.current as f64);
    let agents = crate::policies::agent_statuses(kv, now_ms)
        .await
        .map_err(|e| e.to_string())?;
    // Regions whose agents went away are set to 0, not left at their last count (a stale 2 would
    // page for ever).
    static REPORTED: std::sync::Mutex<std::collections::BTreeSet<String>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let by_region = crate::policies::pepper_fingerprints(&agents);
    {
        let mut reported = REPORTED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for region in reported.iter() {
            if !by_region.keys().any(|r| r.as_str() == region) {
                metrics::gauge!(crate::metrics::REGION_PEPPER_FINGERPRINTS, "region" => region.clone())
                    .set(0.0);
            }
        }
        reported.clear();
        for (region, fingerprints) in by_region {
            metrics::gauge!(crate::metrics::REGION_PEPPER_FINGERPRINTS, "region" => region.to_string())
                .set(fingerprints.len() as f64);
            reported.insert(region.to_string());
        }
    }
    let lookback_ms = activity_lookback_ms(CheckRotation::rounds_per_visit(rotation.last_active));
    let active = active_pools(ledger, pools, lookback_ms, now_ms).await?;
    rotation.last_active = active.len();
    let recheck_ms = recheck_span_ms(CheckRotation::rounds_per_visit(active.len()));
    metrics::gauge!(crate::metrics::LEDGER_ROUND_POOLS_ACTIVE).set(active.len() as f64);
    let visiting = rotation.next_round(&active);
    let visited = visiting.len();
    for (tenant, pool, stored) in visiting {
        let Ok(config) = stored.spec.validate() else {
            continue;
        };
        for region in config.regions() {
            crate::metrics::region_named(region);
        }
        let rows = ledger
            .windows(
                tenant,
                pool,
                crate::ledger::PoolLimits {
                    config: &config,
                    overrides: &stored.overrides,
                },
                windows_to_read(&config, recheck_ms),
                now_ms,
            )
            .await
            .map_err(|e| e.to_string())?;
        let to_check: Vec<WindowRow> = settled_windows(&rows, now_ms)
            .filter(|row| row.window_end_ms.saturating_add(recheck_ms) >= now_ms)
            .cloned()
            .collect();
        let added = ledger
            .record_bound_checks(tenant, pool, &to_check, now_ms)
            .await
            .map_err(|e| e.to_string())?;
        metrics::counter!(crate::metrics::BOUND_WINDOWS_CHECKED).increment(added.windows);
        if added.violations > 0 {
            tracing::error!(
                %tenant, %pool, windows = added.violations,
                "a window broke its overshoot bound"
            );
            metrics::counter!(crate::metrics::BOUND_VIOLATIONS).increment(added.violations);
        }
        for region in &added.regions_over_allowance {
            tracing::error!(
                %tenant, %pool, %region,
                "a region's agents together admitted more fallback than the region's allowance: \
                 --region-agents set below the region's agent count, or agents sharing an id"
            );
            metrics::counter!(crate::metrics::FALLBACK_OVER_ALLOWANCE, "region" => region.to_string())
                .increment(1);
        }
        if let Some(row) = settled_windows(&rows, now_ms).next() {
            let labels = [("tenant", tenant.to_string()), ("pool", pool.to_string())];
            metrics::gauge!(crate::metrics::WINDOW_ADMITTED, &labels)
                .set(row.admitted_tokens as f64);
            metrics::gauge!(crate::metrics::WINDOW_BOUND, &labels).set(row.bound_tokens as f64);
            metrics::gauge!(crate::metrics::WINDOW_OVERSHOOT, &labels)
                .set(row.overshoot_tokens as f64);
        }
    }
    // The violations only: counting every window checked would read the whole table a round.
    let violations = ledger
        .bound_violations_recorded()
        .await
        .map_err(|e| e.to_string())?;
    metrics::gauge!(crate::metrics::BOUND_VIOLATIONS_RECORDED).set(violations as f64);
    Ok(visited)
}

/// How far back a round looks for pools' activity, ms, when a rotation takes `rounds_per_visit`
/// rounds: the rotation's rounds and one more, and the settling time. A pool active in that span
/// is visited at least once after its activity.
pub fn activity_lookback_ms(rounds_per_visit: u64) -> u64 {
    let round_ms = u64::try_from(LEDGER_RECONCILE_INTERVAL.as_millis()).unwrap_or(u64::MAX);
    round_ms
        .saturating_mul(rounds_per_visit.saturating_add(1))
        .saturating_add(WINDOW_GAUGE_SETTLE_MS)
}

/// The pools of `pools` (in key order) a round has anything to check or publish for: those with
/// a window that has figures in the ledger and has not ended, or ended within `lookback_ms` (it
/// settled since the pool was last visited), and those a report arrived for within it (a late
/// report moves a settled window's figures; a visit re-checks the windows of the re-check span).
/// An idle pool is visited once more after its last window settles, and then no longer: its
/// windows' checks stand until a report moves them.
async fn active_pools(
    ledger: &Ledger,
    pools: &[(TenantId, PoolId, StoredPool)],
    lookback_ms: u64,
    now_ms: u64,
) -> Result<Vec<(TenantId, PoolId, StoredPool)>, String> {
    let from_ms = now_ms.saturating_sub(lookback_ms);
    let longest_ms = |stored: &StoredPool| {
        stored
            .spec
            .validate()
            .map_or(0, |config| config.window().longest_ms())
    };
    // A report names its window's start: one received as early as the longest window before
    // `from_ms` may be for a window that ends after it.
    let longest_of_all_ms = pools
        .iter()
        .map(|(_, _, stored)| longest_ms(stored))
        .max()
        .unwrap_or(0);
    let activity = ledger
        .recent_activity(from_ms, from_ms.saturating_sub(longest_of_all_ms))
        .await
        .map_err(|e| e.to_string())?;
    Ok(pools
        .iter()
        .filter(|(tenant, pool, stored)| {
            activity
                .get(&(tenant.clone(), pool.clone()))
                .is_some_and(|seen| {
                    seen.has_window_ending_from(from_ms, longest_ms(stored))
                        || seen.reported_from(from_ms)
                })
        })
        .cloned()
        .collect())
}

/// How long after its end a window is checked again each round, ms: reports that come late
/// (a region's, after a partition heals) still move its figures, and a window they take over its
/// bound is counted then. Later reports are in the ledger's windows view but not re-checked.
pub const BOUND_RECHECK_MS: u64 = 600_000;

/// Most windows read per pool per round (I10): windows shorter than about 2.5 s are re-checked
/// for less than [`BOUND_RECHECK_MS`].
pub const MAX_CHECKED_WINDOWS_PER_ROUND: u64 = 256;

/// How far back a pool's visit re-checks windows, ms, when it is visited every
/// `rounds_per_visit` rounds: [`BOUND_RECHECK_MS`], and the gap since its last visit.
pub fn recheck_span_ms(rounds_per_visit: u64) -> u64 {
    let round_ms = u64::try_from(LEDGER_RECONCILE_INTERVAL.as_millis()).unwrap_or(u64::MAX);
    BOUND_RECHECK_MS.saturating_add(round_ms.saturating_mul(rounds_per_visit.saturating_sub(1)))
}

/// Windows to read per pool per visit: every window that ended within the re-check span
/// (`recheck_ms`), the round and the settling time, and the ones not settled yet.
pub fn windows_to_read(config: &allot_shared::lease::PoolConfig, recheck_ms: u64) -> u64 {
    let span_ms = recheck_ms
        + u64::try_from(LEDGER_RECONCILE_INTERVAL.as_millis()).unwrap_or(u64::MAX)
        + WINDOW_GAUGE_SETTLE_MS;
    let shortest_ms = config.window().shortest_ms().max(1);
    (span_ms.div_ceil(shortest_ms) + 2).clamp(3, MAX_CHECKED_WINDOWS_PER_ROUND)
}

/// The windows of `rows` (newest first, as the ledger gives them) that ended
/// [`WINDOW_GAUGE_SETTLE_MS`] ago or more: their last reports are in, so their figures are final.
pub fn settled_windows(rows: &[WindowRow], now_ms: u64) -> impl Iterator<Item = &WindowRow> {
    rows.iter()
        .filter(move |row| row.window_end_ms.saturating_add(WINDOW_GAUGE_SETTLE_MS) <= now_ms)
}

#[cfg(test)]
mod tests {
    use super::*;
    use allot_shared::ids::RegionId;
    use allot_shared::lease::PoolConfig;

    fn config(window_ms: u64) -> PoolConfig {
        let regions = vec![RegionId::parse("eu").expect("region")];
        PoolConfig::new(1_000, window_ms, 100, 1_000, 0, regions).expect("valid")
    }

    #[test]
    fn the_feed_marks_itself_missed_only_when_a_batch_does_not_fit() {
        let (feed, receiver) = ledger_feed();
        assert!(
            receiver.missed.load(Ordering::Acquire),
            "a new feed reconciles first"
        );
        receiver.missed.store(false, Ordering::Release);
        let batch = || CommittedGrants {
            tenant: TenantId::parse("atlas").expect("tenant"),
            pool: PoolId::parse("api").expect("pool"),
            records: Vec::new(),
        };
        for _ in 0..LEDGER_FEED_BATCHES {
            feed.send(batch());
        }
        assert!(
            !receiver.missed.load(Ordering::Acquire),
            "every batch that fits is carried: no round needs to read the store"
        );
        feed.send(batch());
        assert!(
            receiver.missed.load(Ordering::Acquire),
            "a batch the full feed could not take is left for the next round to copy"
        );
    }

    #[test]
    fn every_window_of_the_recheck_span_is_read_within_the_bound() {
        // A minute: the 10-minute span, the round and the settling time, and two more.
        let one_round = recheck_span_ms(1);
        assert_eq!(one_round, BOUND_RECHECK_MS);
        assert_eq!(windows_to_read(&config(60_000), one_round), 13);
        // Visited every 10 rounds: 9 more rounds of 30 s reach back 4.5 minutes further.
        assert_eq!(windows_to_read(&config(60_000), recheck_span_ms(10)), 18);
        // An hour or a day: the newest three.
        assert_eq!(windows_to_read(&config(3_600_000), one_round), 3);
        // A second: at most the bound, a shorter span re-checked.
        assert_eq!(
            windows_to_read(&config(1_000), one_round),
            MAX_CHECKED_WINDOWS_PER_ROUND
        );
    }

    fn named(count: usize) -> Vec<(TenantId, PoolId, StoredPool)> {
        let spec: crate::pools::PoolSpec = serde_json::from_value(serde_json::json!({
            "limit": 10, "windowMs": 60000, "chunk": 1, "leaseTtlMs": 1000,
            "fallbackPerRegion": 0, "regions": ["eu"] }))
        .expect("spec");
        let mut pools: Vec<_> = (0..count)
            .map(|n| {
                (
                    TenantId::parse(&format!("t{}", n % 7)).expect("tenant"),
                    PoolId::parse(&format!("p{n}")).expect("pool"),
                    StoredPool {
                        spec: spec.clone(),
                        version: 1,
                        updated_at_ms: 0,
                        overrides: Vec::new(),
                    },
                )
            })
            .collect();
        pools.sort_by_key(|(tenant, pool, _)| pool_key(tenant, pool));
        pools
    }

    #[test]
    fn the_rotation_visits_every_pool_once_per_cycle_whatever_their_number() {
        for count in [0, 1, 999, 1_000, 1_001, 2_500, 10_000] {
            let pools = named(count);
            let mut rotation = CheckRotation::default();
            let rounds = CheckRotation::rounds_per_visit(count);
            let mut visits = std::collections::HashMap::new();
            for _ in 0..rounds {
                let round = rotation.next_round(&pools);
                assert!(round.len() <= MAX_WINDOW_GAUGE_POOLS);
                for (tenant, pool, _) in round {
                    *visits.entry((tenant.clone(), pool.clone())).or_insert(0) += 1;
                }
            }
            assert_eq!(
                visits.len(),
                count,
                "{count} pools: every one visited in a cycle"
            );
        }
        // A pool removed between rounds: the rotation goes on after the last pool it checked,
        // found by its key, not by a position the removal shifted.
        let pools = named(2_500);
        let mut rotation = CheckRotation::default();
        let first = rotation.next_round(&pools);
        let last_checked = first.last().map(|(t, p, _)| pool_key(t, p));
        let mut fewer = pools.clone();
        fewer.remove(10);
        let second = rotation.next_round(&fewer);
        let resumed = second.first().map(|(t, p, _)| pool_key(t, p));
        assert_eq!(
            resumed.as_deref(),
            Some(
                pool_key(
                    &pools[MAX_WINDOW_GAUGE_POOLS].0,
                    &pools[MAX_WINDOW_GAUGE_POOLS].1
                )
                .as_str()
            )
        );
        assert!(resumed > last_checked);
    }
}
