//! The state directory at work (`--state-dir`, [`crate::state_dir`]): what the agent keeps so that
//! a restart while the allocator is unreachable keeps its region up (I13), and a killed agent's
//! admits still reach the ledger.
//!
//! - **Restore** ([`Agent::restore_state`], once, before serving): the last verified bundle when
//!   none was given (aged from when the allocator last confirmed it, so `strict` rules keep their
//!   maximum age); every journaled pool with its terms, so global rules are decided at once (from
//!   the fallback allowance while the allocator stays away); each pool's journaled leases as ended
//!   ones owing a final report, and its fallback counts and claims; the last verified set of
//!   operators' rule overrides, laid over the bundle until the allocator sends a newer one.
//! - **Journal** (every [`JOURNAL_INTERVAL`] when anything changed): every pool's terms and holder
//!   snapshot. Batched: admits between two writes are what a crash can lose from the ledger.
//! - **Fallback claims**: admits from a fallback allowance never go beyond a claim that is
//!   durable. Before admitting past it, a request asks for a claim one block larger
//!   (`fallbackPerRegion / 8`, at least one token) and waits for the sync, at most
//!   [`CLAIM_WRITE_TIMEOUT`]; a restarted agent counts the window's allowance as used up to the
//!   claim. So a restart never re-opens an allowance; it can lose at most one block of it. A claim
//!   not durable in time refuses the request (503 `LIMITER_UNAVAILABLE`): never an overshoot
//!   nobody can see.
//!
//! One writer at a time, on a task of its own from the snapshot to the end of the write: a caller
//! that stops waiting never cuts a write short or lets another writer in before it (which could
//! put an older snapshot on disk after a newer claim). Claims are group-committed: a writer takes
//! every claim wanted when it starts.

use std::sync::Arc;
use std::time::Duration;

use allot_shared::ids::{PoolId, TenantId};
use allot_shared::overrides::OverrideSet;

use super::Agent;
use super::pool_slot::PoolSlot;
use crate::global::{PoolAgent, PoolJournal};
use crate::state_dir::{Journal, JournaledPool, SavedBundle, StateDir, StateFile};

/// How often the journal is written when something changed. A killed agent's ledger misses at most
/// the admits of one interval.
pub const JOURNAL_INTERVAL: Duration = Duration::from_millis(250);
/// A fallback claim grows by the allowance divided by this (at least one token): what a restart can
/// leave unused of a window's allowance, and how many syncs a window's fallback costs at most.
pub use crate::global::terms::FALLBACK_CLAIM_BLOCKS;
/// Longest a request waits for a fallback claim to be written and synced.
pub const CLAIM_WRITE_TIMEOUT: Duration = Duration::from_millis(200);

/// What [`Agent::restore_state`] took over.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct Restored {
    /// The bundle's version, when one was installed from the directory.
    pub bundle_version: Option<u64>,
    /// The override set's version, when one was taken from the directory.
    pub override_version: Option<u64>,
    /// Pools held again, with their terms.
    pub pools: usize,
    /// Leases owing a final report.
    pub leases: usize,
    /// Fallback windows counted.
    pub fallback_windows: usize,
}

impl Agent {
    /// Keeps state in `dir` from now on. Once per agent, before it serves (pools created before
    /// it take no fallback claims).
    pub fn set_state_dir(&self, dir: StateDir) {
        if !self.journaling.set_dir(dir) {
            tracing::warn!("a state directory is already set; the new one is ignored");
        }
    }

    /// The state directory, if any.
    pub fn state_dir(&self) -> Option<&StateDir> {
        self.journaling.dir()
    }

    /// Takes over what the state directory holds (module docs). Call once, before serving.
    ///
    /// Long by design: the journal is loaded once and read by more than one step (the bundle is
    /// aged from the confirmation it records, the pools are restored from it), and every step
    /// counts into the one `Restored` reported at the end; split, the journal and that count would
    /// be passed through every step.
    pub fn restore_state(&self) -> Restored {
        let mut restored = Restored::default();
        let Some(dir) = self.journaling.dir() else {
            return restored;
        };
        let journal: Option<Journal> = dir.load(StateFile::Journal);
        if journal.is_some() {
            self.session.note_journal_restored();
        }
        if self.bundle.load().is_none()
            && let Some(saved) = dir.load::<SavedBundle>(StateFile::Bundle)
        {
            match allot_shared::policy::parse_bundle(&saved.bundle.to_string())
                .and_then(|draft| draft.into_verified())
            {
                Ok(bundle) => {
                    let version = bundle.version();
                    // Aged from the allocator's last confirmation (never: already stale).
                    let confirmed = journal.as_ref().map_or(0, |j| j.bundle_confirmed_at_ms);
                    if self.bundle.restore(bundle, confirmed, self.clock.now_ms()) {
                        restored.bundle_version = Some(version);
                    }
                }
                Err(error) => dir.ignored(StateFile::Bundle, "corrupt", &error),
            }
        }
        // The overrides as last verified: laid over the bundle until the allocator sends newer.
        if let Some(saved) = dir.load::<OverrideSet>(StateFile::Overrides) {
            match saved.verify() {
                Ok(set) => {
                    let version = set.version;
                    if self.bundle.offer_overrides(set, self.clock.now_ms()) {
                        restored.override_version = Some(version);
                    }
                }
                Err(error) => dir.ignored(StateFile::Overrides, "corrupt", &error),
            }
        }
        for saved in journal.iter().flat_map(|j| &j.pools) {
            let Some(config) = self.holder_config(&saved.terms) else {
                continue;
            };
            let mut pools = self.pools.slots();
            if pools.len() >= self.settings.max_pools {
                break;
            }
            if pools.get(&saved.tenant, &saved.pool).is_some() {
                continue;
            }
            let journaled = PoolJournal {
                holder: saved.holder.clone(),
                shadow: saved.shadow.clone(),
                settle_debt: saved.settle_debt.clone(),
                written_off: saved.written_off.clone(),
            };
            let key = (saved.tenant.clone(), saved.pool.clone());
            pools.get_or_insert_with(key, || {
                crate::metrics::pool_held(&saved.tenant, &saved.pool);
                Arc::new(PoolSlot::new(
                    (saved.tenant.clone(), saved.pool.clone()),
                    PoolAgent::restored(config, &journaled),
                    saved.terms.clone(),
                    saved.terms_fetched_at_ms,
                    self.pools.busy().clone(),
                ))
            });
            restored.pools += 1;
            restored.leases += saved.holder.leases.len();
            restored.fallback_windows += saved.holder.fallback.len();
        }
        for (what, count) in [
            ("bundle", u64::from(restored.bundle_version.is_some())),
            ("pools", restored.pools as u64),
            ("leases", restored.leases as u64),
            ("fallback_windows", restored.fallback_windows as u64),
        ] {
            metrics::gauge!(crate::metrics::STATE_RESTORED, "what" => what).set(count as f64);
        }
        tracing::info!(dir = %dir.path().display(), bundle = ?restored.bundle_version,
            pools = restored.pools, leases = restored.leases,
            fallback_windows = restored.fallback_windows, "state restored");
        restored
    }

    /// Writes the journal if anything changed since the last write. The write runs on a task of
    /// its own holding the writer: a caller that stops waiting (a round's deadline, shutdown) does
    /// not cut it short or let another writer in before it is done.
    pub async fn write_journal_if_changed(self: &Arc<Self>) {
        let Some(generation) = self.journaling.unwritten() else {
            return;
        };
        let agent = self.clone();
        let written = tokio::spawn(async move {
            let _writer = agent.journaling.writer().await;
            let journal = agent.journal(&[]);
            agent.write_journal(journal).await
        })
        .await;
        if matches!(written, Ok(Ok(()))) {
            self.journaling.mark_written(generation);
        }
    }

    /// Writes `journal` (the caller holds the writer). Errors are logged and counted.
    async fn write_journal(&self, journal: Journal) -> std::io::Result<()> {
        let Some(dir) = self.journaling.dir().cloned() else {
            return Ok(());
        };
        let written = tokio::task::spawn_blocking(move || dir.write(StateFile::Journal, &journal))
            .await
            .unwrap_or_else(|joined| Err(std::io::Error::other(joined)));
        let outcome = if written.is_ok() { "ok" } else { "failed" };
        metrics::counter!(crate::metrics::STATE_WRITES,
            "file" => StateFile::Journal.name(), "outcome" => outcome)
        .increment(1);
        if let Err(error) = &written {
            tracing::warn!(%error, "journal not written");
        }
        written
    }

    /// The journal as of now, with `claims` (slot, (window start, claimed tokens)) added. Taken
    /// under the writer, so a later snapshot holds every claim made durable before it.
    fn journal(&self, claims: &[(Arc<PoolSlot>, (u64, u64))]) -> Journal {
        let slots = self.pools.snapshot();
        let pools = slots
            .into_iter()
            .map(|((tenant, pool), slot)| {
                let claimed = claims
                    .iter()
                    .filter(|(claiming, _)| Arc::ptr_eq(claiming, &slot))
                    .map(|(_, claim)| *claim)
                    .max_by_key(|(_, tokens)| *tokens);
                let (terms, fetched_at_ms) = slot.terms();
                let PoolJournal {
                    holder,
                    shadow,
                    settle_debt,
                    written_off,
                } = slot.agent_quietly().journal(claimed);
                JournaledPool {
                    tenant,
                    pool,
                    terms,
                    terms_fetched_at_ms: fetched_at_ms,
                    holder,
                    shadow,
                    settle_debt,
                    written_off,
                }
            })
            .collect();
        Journal {
            written_at_ms: self.clock.now_ms(),
            bundle_confirmed_at_ms: self.bundle.confirmed_at_ms(),
            pools,
        }
    }

    /// Makes a fallback claim durable so `cost_tokens` can be reserved from `slot`'s allowance
    /// (module docs). `false` when it was not durable within [`CLAIM_WRITE_TIMEOUT`].
    ///
    /// Group commit: the claim joins the claims wanted; one task at a time takes every claim
    /// wanted, writes them in one journal and records them in their holders before it lets the
    /// next writer in. A request that stops waiting leaves that task to finish.
    pub(super) async fn claim_fallback(
        self: &Arc<Self>,
        tenant: &TenantId,
        pool: &PoolId,
        slot: &Arc<PoolSlot>,
        cost_tokens: u64,
    ) -> bool {
        self.pools.want_claim(slot, cost_tokens);
        let agent = self.clone();
        let flush = tokio::spawn(async move { agent.flush_claims().await });
        let _ = tokio::time::timeout(CLAIM_WRITE_TIMEOUT, flush).await;
        let claimed = slot
            .agent()
            .fallback_claim_wanted(cost_tokens, self.clock.now_ms())
            .is_none();
        let outcome = if claimed { "ok" } else { "failed" };
        metrics::counter!(crate::metrics::FALLBACK_CLAIMS, "outcome" => outcome).increment(1);
        if !claimed {
            tracing::warn!(%tenant, %pool, "fallback claim not made durable in time; request refused");
        }
        claimed
    }

    /// Writes every claim wanted in one journal, then records them as durable.
    async fn flush_claims(self: Arc<Self>) {
        let _writer = self.journaling.writer().await;
        let wanted = self.pools.take_claims_wanted();
        let now_ms = self.clock.now_ms();
        let claims: Vec<(Arc<PoolSlot>, (u64, u64))> = wanted
            .into_iter()
            .filter_map(|(slot, cost_tokens)| {
                let claim = slot.agent().fallback_claim_wanted(cost_tokens, now_ms)?;
                Some((slot, claim))
            })
            .collect();
        // Nothing left to claim: a writer before this one took these claims too.
        if claims.is_empty() {
            return;
        }
        let journal = self.journal(&claims);
        if self.write_journal(journal).await.is_ok() {
            for (slot, (window_start_ms, claimed_tokens)) in claims {
                slot.agent().claim_durable(window_start_ms, claimed_tokens);
            }
        }
    }

    /// Keeps the override set held in the state directory (the background refresh does so for
    /// every set it takes from the allocator).
    pub async fn save_overrides(&self) {
        let Some(dir) = self.journaling.dir().cloned() else {
            return;
        };
        let set = self.bundle.overrides();
        let written = tokio::task::spawn_blocking(move || dir.write(StateFile::Overrides, &*set))
            .await
            .unwrap_or_else(|joined| Err(std::io::Error::other(joined)));
        let outcome = if written.is_ok() { "ok" } else { "failed" };
        metrics::counter!(crate::metrics::STATE_WRITES,
            "file" => StateFile::Overrides.name(), "outcome" => outcome)
        .increment(1);
        if let Err(error) = written {
            tracing::warn!(%error, "overrides not saved to the state directory");
        }
    }

    /// Keeps the bundle in force in the state directory (the background refresh does so for every
    /// bundle it installs from the allocator).
    pub async fn save_bundle(&self) {
        let (Some(dir), Some(bundle)) = (self.journaling.dir().cloned(), self.bundle.load()) else {
            return;
        };
        let saved = SavedBundle {
            bundle: bundle.to_json(),
        };
        let written = tokio::task::spawn_blocking(move || dir.write(StateFile::Bundle, &saved))
            .await
            .unwrap_or_else(|joined| Err(std::io::Error::other(joined)));
        let outcome = if written.is_ok() { "ok" } else { "failed" };
        metrics::counter!(crate::metrics::STATE_WRITES,
            "file" => StateFile::Bundle.name(), "outcome" => outcome)
        .increment(1);
        if let Err(error) = written {
            tracing::warn!(%error, "bundle not saved to the state directory");
        }
    }
}
