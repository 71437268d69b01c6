//! The policy bundle in force: which one, when it was installed and when the allocator last
//! confirmed it. Read lock-free on every decision; replaced only by a higher version (I13).

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};

use allot_shared::policy::PolicyBundle;
use arc_swap::ArcSwapOption;

/// The bundle slot.
pub(super) struct BundleSlot {
    current: ArcSwapOption<PolicyBundle>,
    /// When the bundle in force was installed, epoch ms (0: none).
    installed_at_ms: AtomicU64,
    /// When the allocator last confirmed the bundle in force (installed it, or answered the same
    /// or an older version), epoch ms.
    confirmed_at_ms: AtomicU64,
}

impl BundleSlot {
    /// A slot holding `bundle` (if any) installed and confirmed at `now_ms`.
    pub(super) fn new(bundle: Option<PolicyBundle>, now_ms: u64) -> Self {
        let installed_at_ms = if bundle.is_some() { now_ms } else { 0 };
        Self {
            current: ArcSwapOption::from(bundle.map(Arc::new)),
            installed_at_ms: AtomicU64::new(installed_at_ms),
            confirmed_at_ms: AtomicU64::new(installed_at_ms),
        }
    }

    /// The bundle in force.
    pub(super) fn load(&self) -> Option<Arc<PolicyBundle>> {
        self.current.load_full()
    }

    /// The version in force (0: none).
    pub(super) fn version(&self) -> u64 {
        self.current.load().as_ref().map_or(0, |b| b.version())
    }

    /// Installs `candidate` at `now_ms` if it supersedes the bundle in force (a higher version).
    pub(super) fn offer(&self, candidate: PolicyBundle, now_ms: u64) -> bool {
        let current = self.current.load_full();
        if current
            .as_ref()
            .is_some_and(|c| !c.is_superseded_by(&candidate))
        {
            return false;
        }
        tracing::info!(version = candidate.version(), "policy bundle installed");
        self.install(candidate, now_ms, now_ms);
        true
    }

    /// Installs a bundle saved by an earlier incarnation, at `now_ms`, aged from the allocator's
    /// last confirmation of it (`confirmed_at_ms`; 0, never: already stale). Only into an empty
    /// slot: a bundle already in force came from the allocator since.
    pub(super) fn restore(&self, saved: PolicyBundle, confirmed_at_ms: u64, now_ms: u64) -> bool {
        if self.current.load().is_some() {
            return false;
        }
        self.install(saved, now_ms, confirmed_at_ms);
        true
    }

    fn install(&self, bundle: PolicyBundle, installed_at_ms: u64, confirmed_at_ms: u64) {
        self.current.store(Some(Arc::new(bundle)));
        self.installed_at_ms
            .store(installed_at_ms, Ordering::Relaxed);
        self.confirmed_at_ms
            .store(confirmed_at_ms, Ordering::Relaxed);
    }

    /// The allocator confirmed the bundle in force at `now_ms`.
    pub(super) fn confirm(&self, now_ms: u64) {
        self.confirmed_at_ms.store(now_ms, Ordering::Relaxed);
    }

    /// When the bundle in force was installed, epoch ms (0: none).
    pub(super) fn installed_at_ms(&self) -> u64 {
        self.installed_at_ms.load(Ordering::Relaxed)
    }

    /// When the allocator last confirmed the bundle in force, epoch ms.
    pub(super) fn confirmed_at_ms(&self) -> u64 {
        self.confirmed_at_ms.load(Ordering::Relaxed)
    }
}
