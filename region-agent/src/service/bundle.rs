//! The policy bundle in force: which one, when it was installed and when the allocator last
//! confirmed it, with the operators' rule overrides laid over it. Read lock-free on every
//! decision; replaced only by a higher version (I13), and so is the override set.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};

use allot_shared::contract::Principal;
use allot_shared::ids::TenantId;
use allot_shared::keys;
use allot_shared::overrides::OverrideSet;
use allot_shared::policy::{PolicyBundle, Rule};

use super::Agent;
use super::settings::AgentSettings;
use arc_swap::ArcSwapOption;

/// The bundle slot.
pub(super) struct BundleSlot {
    /// The bundle in force, with `overrides` laid over it.
    current: ArcSwapOption<PolicyBundle>,
    /// The latest override set received (version 0: none yet).
    overrides: Mutex<Arc<OverrideSet>>,
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
            overrides: Mutex::new(Arc::new(OverrideSet::default())),
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
        let bundle = self.laid(&bundle, installed_at_ms);
        self.current.store(Some(Arc::new(bundle)));
        self.installed_at_ms
            .store(installed_at_ms, Ordering::Relaxed);
        self.confirmed_at_ms
            .store(confirmed_at_ms, Ordering::Relaxed);
    }

    /// Takes `set` if it is newer than the set held, and lays it over the bundle in force.
    pub(super) fn offer_overrides(&self, set: OverrideSet, now_ms: u64) -> bool {
        {
            let mut held = self
                .overrides
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if set.version <= held.version {
                return false;
            }
            tracing::info!(
                version = set.version,
                count = set.overrides.len(),
                "override set received"
            );
            *held = Arc::new(set);
        }
        self.lay_again(now_ms);
        true
    }

    /// Lays the held overrides over the bundle in force again when one of them has ended by
    /// `now_ms`.
    pub(super) fn expire_overrides(&self, now_ms: u64) {
        let ended = self.current.load().as_ref().is_some_and(|bundle| {
            bundle
                .overlay()
                .next_expiry_ms()
                .is_some_and(|end| end <= now_ms)
        });
        if ended {
            self.lay_again(now_ms);
        }
    }

    /// The override set held.
    pub(super) fn overrides(&self) -> Arc<OverrideSet> {
        Arc::clone(
            &self
                .overrides
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        )
    }

    /// The held override set's version (0: none).
    pub(super) fn override_version(&self) -> u64 {
        self.overrides
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
            .version
    }

    fn lay_again(&self, now_ms: u64) {
        if let Some(bundle) = self.current.load_full() {
            self.current
                .store(Some(Arc::new(self.laid(&bundle, now_ms))));
        }
    }

    /// `bundle` with the held overrides in force at `now_ms` laid over it; those that cannot be
    /// laid are logged and counted.
    fn laid(&self, bundle: &PolicyBundle, now_ms: u64) -> PolicyBundle {
        let set = Arc::clone(
            &self
                .overrides
                .lock()
                .unwrap_or_else(std::sync::PoisonError::into_inner),
        );
        let (laid, problems) = bundle.with_overrides(&set, now_ms);
        for problem in &problems {
            tracing::warn!(id = %problem.id, problem = %problem.message, "override not laid");
        }
        metrics::gauge!(crate::metrics::OVERRIDES_LAID).set(laid.overlay().len() as f64);
        metrics::gauge!(crate::metrics::OVERRIDES_NOT_LAID).set(problems.len() as f64);
        metrics::gauge!(crate::metrics::OVERRIDE_VERSION).set(set.version as f64);
        laid
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

/// Replaces each per-principal rule of `rules` (from `bundle`, for `tenant`) with `principal`'s
/// own override of it, if an operator set one ([`PolicyBundle::lay_principal_overrides`], keyed
/// with this agent's pepper).
pub(super) fn lay_principal_overrides<'b>(
    bundle: &'b PolicyBundle,
    rules: &mut [&'b Rule],
    tenant: &TenantId,
    principal: &Principal,
    settings: &AgentSettings,
) {
    bundle.lay_principal_overrides(rules, tenant, principal.kind, || {
        keys::principal_hash(
            &settings.pepper,
            principal.kind,
            &principal.id,
            settings.ip_prefixes,
        )
    });
}

impl Agent {
    /// The bundle in force.
    pub fn bundle(&self) -> Option<Arc<PolicyBundle>> {
        self.bundle.load()
    }

    /// Installs `candidate` if it is newer than the bundle in force (only higher versions, I13).
    pub fn offer_bundle(&self, candidate: PolicyBundle) -> bool {
        self.bundle.offer(candidate, self.clock.now_ms())
    }

    /// Takes `set` (verified) if it is newer than the override set held, and lays it over the
    /// bundle in force.
    pub fn offer_overrides(&self, set: allot_shared::overrides::OverrideSet) -> bool {
        self.bundle.offer_overrides(set, self.clock.now_ms())
    }

    /// Whether the bundle in force is past its maximum age (strict rules then fail closed).
    pub fn bundle_is_stale(&self) -> bool {
        let max_age_ms = self.settings.policy_max_age_ms;
        if max_age_ms == 0 || self.allocator.is_none() {
            return false;
        }
        let confirmed = self.bundle.confirmed_at_ms();
        self.clock.now_ms().saturating_sub(confirmed) > max_age_ms
    }
}
