//! One pool as the agent holds it: its [`PoolAgent`] (holder, renewal, tallies) under one lock,
//! the terms in force and when they were fetched, `G` read lock-free, the signal a renewal's end
//! gives its waiters, whether the pool was forgotten, and the allocator's last view of its window.
//!
//! Lock order: the terms' lock before the agent's (new terms retune the holder), the agent's before
//! the view's (a figure read under the agent's lock matches the grant it follows). A slot is marked forgotten only
//! under its agent's lock, so a request that reserved under that lock spends on a holder that is
//! still reported. Whether the background rounds visit the pool ([`super::busy`]) changes only
//! under its agent's lock too.

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use allot_shared::ids::{PoolId, RecordId, TenantId};
use allot_shared::overrides::PoolOverride;
use allot_shared::window::Window;
use tokio::sync::Notify;
use tokio::sync::futures::Notified;

use super::busy::{BusyPools, PoolKey};
use super::lock;
use crate::allocator_client::PoolTerms;
use crate::global::{HolderConfig, PoolAgent};

/// A pool held.
pub(super) struct PoolSlot {
    /// The pool's tenant.
    tenant: TenantId,
    /// The pool: named in metrics without a copy per request.
    pool: PoolId,
    /// The pools the background rounds visit, and whether this one is among them (changed only
    /// under the agent's lock).
    busy: Arc<BusyPools>,
    /// This slot's number (a successor under the same key has another).
    id: u64,
    listed: AtomicBool,
    /// When a report round last found the pool settled and unlisted it, epoch ms.
    settled_at_ms: AtomicU64,
    /// Whether the settled queue holds an entry of the pool (at most one: the queue is bounded by
    /// the pools held).
    queued: AtomicBool,
    /// The pool's agent: its holder, the renewal in flight, its tallies for the ledger.
    agent: Mutex<PoolAgent>,
    /// `G` of the terms in force, and its override (read on every global denial).
    limit: PoolLimit,
    /// The terms in force and when they were last fetched, epoch ms.
    terms: Mutex<(PoolTerms, u64)>,
    renewed: Notify,
    /// Set under the agent's lock when the slot is forgotten: a request that still holds it looks
    /// the pool up again instead of spending on a holder nobody reports.
    evicted: AtomicBool,
    /// The allocator's view of the pool's window from its last grant answer (`GET /v1/quota`).
    allocator_view: Mutex<Option<AllocatorView>>,
}

/// What the allocator said was left of a pool's window, and when.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) struct AllocatorView {
    /// Tokens the window had left to grant.
    pub(super) ungranted_tokens: u64,
    /// The window it was said of.
    pub(super) window: Window,
    /// When it was true, on the agent's clock, epoch ms.
    pub(super) as_of_ms: u64,
}

/// A pool as this agent sees it at one moment: what `GET /v1/quota` shows, and what a decision by
/// global rules alone reports.
#[derive(Debug, Clone, Copy)]
pub(super) struct PoolFigures {
    /// The pool's `G`.
    pub limit_tokens: u64,
    /// What the window had left to grant when the allocator last answered, plus what this agent
    /// holds unspent (at most `G`); `None` without an answer in this window.
    pub remaining_tokens: Option<u64>,
    /// What this agent holds unspent.
    pub held_tokens: u64,
    /// The window's own length, ms (a calendar window's: this month's, this day's).
    pub window_ms: u64,
    /// Until the window ends, ms.
    pub reset_ms: u64,
    /// The age of the allocator's figure, ms.
    pub age_ms: Option<u64>,
}

impl PoolSlot {
    /// A slot for `key`'s pool, run by `agent` on `terms` fetched at `fetched_at_ms`, listed in
    /// `busy` from the start.
    pub(super) fn new(
        (tenant, pool): PoolKey,
        agent: PoolAgent,
        terms: PoolTerms,
        fetched_at_ms: u64,
        busy: Arc<BusyPools>,
    ) -> Self {
        busy.list(&(tenant.clone(), pool.clone()));
        Self {
            tenant,
            pool,
            id: busy.new_slot_id(),
            busy,
            listed: AtomicBool::new(true),
            settled_at_ms: AtomicU64::new(0),
            queued: AtomicBool::new(false),
            agent: Mutex::new(agent),
            limit: PoolLimit::new(&terms),
            terms: Mutex::new((terms, fetched_at_ms)),
            renewed: Notify::new(),
            evicted: AtomicBool::new(false),
            allocator_view: Mutex::new(None),
        }
    }

    pub(super) fn pool(&self) -> &PoolId {
        &self.pool
    }

    /// The pool's agent, under its lock, to act on it: the pool is listed for the background
    /// rounds if it was not.
    pub(super) fn agent(&self) -> MutexGuard<'_, PoolAgent> {
        let agent = lock(&self.agent);
        // Read and written under the agent's lock only: the lock orders them.
        if !self.listed.load(Ordering::Relaxed) {
            self.listed.store(true, Ordering::Relaxed);
            self.busy.list(&self.key());
        }
        agent
    }

    /// The pool's agent, under its lock, for a background round's look: the pool's listing is
    /// left as it is (a round that looked at every pool would otherwise list them all).
    pub(super) fn agent_quietly(&self) -> MutexGuard<'_, PoolAgent> {
        lock(&self.agent)
    }

    /// This slot's number.
    pub(super) fn id(&self) -> u64 {
        self.id
    }

    /// The pool's key.
    pub(super) fn key(&self) -> PoolKey {
        (self.tenant.clone(), self.pool.clone())
    }

    /// A round found the pool settled at `now_ms` (`agent` is its agent's lock, held): the rounds
    /// stop visiting it until something acts on it again, and it waits to be forgotten.
    pub(super) fn unlist(&self, agent: &MutexGuard<'_, PoolAgent>, now_ms: u64) {
        debug_assert!(self.agent.try_lock().is_err(), "its agent's lock is held");
        debug_assert!(agent.settled(), "only a settled pool is unlisted");
        if self.listed.swap(false, Ordering::Relaxed) {
            self.settled_at_ms.store(now_ms, Ordering::Relaxed);
            self.busy.settle(&self.key());
            if !self.queued.swap(true, Ordering::Relaxed) {
                self.busy.queue(self.key(), self.id, now_ms);
            }
        }
    }

    /// The pool's entry left the settled queue (`agent` is its agent's lock, held): when it
    /// settled, if it is settled still.
    pub(super) fn dequeued(&self, _agent: &MutexGuard<'_, PoolAgent>) -> Option<u64> {
        self.queued.store(false, Ordering::Relaxed);
        (!self.listed.load(Ordering::Relaxed)).then(|| self.settled_at_ms.load(Ordering::Relaxed))
    }

    /// Queues the settled pool again (`agent` is its agent's lock, held), as settled at
    /// `settled_at_ms`.
    pub(super) fn queue_again(&self, _agent: &MutexGuard<'_, PoolAgent>, settled_at_ms: u64) {
        self.settled_at_ms.store(settled_at_ms, Ordering::Relaxed);
        self.queued.store(true, Ordering::Relaxed);
        self.busy.queue(self.key(), self.id, settled_at_ms);
    }

    /// The pool's window containing `now_ms`, as its holder cuts windows (from the terms in force,
    /// parsed once when they arrived).
    pub(super) fn window_at(&self, now_ms: u64) -> Window {
        self.agent_quietly().config().window.containing(now_ms)
    }

    /// `G` at `now_ms`: the base limit, or the override in force then.
    pub(super) fn limit_at(&self, now_ms: u64) -> u64 {
        self.limit.at(now_ms)
    }

    /// The terms in force and when they were last fetched, epoch ms.
    pub(super) fn terms(&self) -> (PoolTerms, u64) {
        lock(&self.terms).clone()
    }

    /// When the terms in force were last fetched, epoch ms.
    pub(super) fn terms_fetched_at_ms(&self) -> u64 {
        lock(&self.terms).1
    }

    /// The id of the terms' override in force at `now_ms`, if any.
    pub(super) fn override_in_force(&self, now_ms: u64) -> Option<RecordId> {
        lock(&self.terms)
            .0
            .limit_override
            .as_ref()
            .filter(|o| o.in_force_at(now_ms))
            .map(|o| o.id)
    }

    /// Takes `terms` fetched at `now_ms` (its holder retuned to `config`) when they differ from
    /// those in force; whether they did.
    pub(super) fn take_terms(&self, terms: PoolTerms, config: HolderConfig, now_ms: u64) -> bool {
        let mut in_force = lock(&self.terms);
        in_force.1 = now_ms;
        if in_force.0 == terms {
            return false;
        }
        self.agent().retune(config);
        self.limit.set(&terms);
        in_force.0 = terms;
        true
    }

    /// A grant answered at `now_ms` under the pool's terms of version `terms_version` (0: the
    /// allocator did not say): the version in force is confirmed, so a busy pool renewing often
    /// needs no fetch of its terms; another version is fetched at the next upkeep round.
    pub(super) fn note_terms_version(&self, terms_version: u64, now_ms: u64) {
        if terms_version == 0 {
            return;
        }
        let mut in_force = lock(&self.terms);
        in_force.1 = if in_force.0.version == terms_version {
            in_force.1.max(now_ms)
        } else {
            0
        };
    }

    /// The allocator answered about the pool at `now_ms` without new terms (it no longer holds
    /// the pool): asked again a refresh later.
    pub(super) fn terms_checked(&self, now_ms: u64) {
        lock(&self.terms).1 = now_ms;
    }

    /// Resolves when the renewal under way ends. Register it (`enable`) before a renewal can start
    /// so its end cannot be missed.
    pub(super) fn renewal_ended(&self) -> Notified<'_> {
        self.renewed.notified()
    }

    /// A renewal ended: its waiters try again.
    pub(super) fn note_renewal_ended(&self) {
        self.renewed.notify_waiters();
    }

    /// Whether the slot was forgotten (read under its agent's lock).
    pub(super) fn is_evicted(&self) -> bool {
        self.evicted.load(Ordering::Acquire)
    }

    /// Marks the slot forgotten; `agent` is its agent's lock, held.
    pub(super) fn mark_evicted(&self, _agent: &MutexGuard<'_, PoolAgent>) {
        debug_assert!(self.agent.try_lock().is_err(), "its agent's lock is held");
        self.evicted.store(true, Ordering::Release);
    }

    /// Keeps what the allocator said was left of the pool's window.
    pub(super) fn set_allocator_view(&self, view: AllocatorView) {
        *lock(&self.allocator_view) = Some(view);
    }

    /// The pool's figures at `now_ms`.
    pub(super) fn figures(&self, now_ms: u64) -> PoolFigures {
        let limit_tokens = self.limit_at(now_ms);
        // The agent's lock first, as a grant takes them: the figure and the grant it follows.
        let agent = self.agent_quietly();
        let holder = agent.holder();
        let window = holder.config().window.containing(now_ms);
        let held_tokens = holder.available_tokens(now_ms);
        let view = (*lock(&self.allocator_view)).filter(|view| view.window == window);
        PoolFigures {
            limit_tokens,
            remaining_tokens: view.map(|view| {
                view.ungranted_tokens
                    .saturating_add(held_tokens)
                    .min(limit_tokens)
            }),
            held_tokens,
            window_ms: window.length_ms(),
            reset_ms: window.end_ms.saturating_sub(now_ms),
            age_ms: view.map(|view| now_ms.saturating_sub(view.as_of_ms)),
        }
    }
}

/// A pool's `G` as its terms state it, read lock-free and whole: the base limit, and the
/// override in force when the terms were fetched (its limit between its start and end).
struct PoolLimit(arc_swap::ArcSwap<(u64, Option<PoolOverride>)>);

impl PoolLimit {
    fn new(terms: &PoolTerms) -> Self {
        Self(arc_swap::ArcSwap::from_pointee((
            terms.limit_tokens,
            terms.limit_override.clone(),
        )))
    }

    /// Takes `terms`' limit and override.
    fn set(&self, terms: &PoolTerms) {
        self.0
            .store(Arc::new((terms.limit_tokens, terms.limit_override.clone())));
    }

    /// `G` at `now_ms`.
    fn at(&self, now_ms: u64) -> u64 {
        let limits = self.0.load();
        allot_shared::overrides::limit_at(limits.0, limits.1.as_slice(), now_ms)
    }
}
