//! Leases of global quota: pool configuration, the grant arithmetic, and the overshoot bound.
//!
//! The allocator holds each tenant pool's global quota `G` (whole tokens) for the current window and
//! grants regions chunks of it. This module is the pure part of that: given a pool's configuration, its
//! window state and a request, what is granted, until when, and what the window has left. The allocator
//! adds persistence, idempotency by lease id (a retry returns the stored grant and calls nothing here),
//! and epoch fencing around it; the simulator runs the same functions.
//!
//! Invariants enforced here:
//! - grants in one window never exceed `G`: `granted = min(want, chunk, remaining)`;
//! - a clamped lease never outlives its window: `expires_at = min(now + lease_ttl, window_end)`.

use std::collections::BTreeMap;
use std::num::NonZeroU64;

use crate::MAX_RULE_PARAMETER;
use crate::ids::{Epoch, LeaseId, RegionId};
use crate::window::{Window, WindowSpec};

/// A pool configuration that failed validation, naming the field as the wire does (`limit`,
/// `windowMs`, ...).
pub type PoolConfigError = crate::FieldError;

fn config_error(field: &'static str, message: impl Into<String>) -> PoolConfigError {
    crate::FieldError::new(field, message)
}

/// Smallest window length, in ms.
pub const MIN_WINDOW_MS: u64 = 1_000;
/// Smallest lease TTL, in ms.
pub const MIN_LEASE_TTL_MS: u64 = 100;
/// Most regions one pool may span (I10).
pub const MAX_REGIONS_PER_POOL: usize = 64;

/// A validated pool configuration: the value grants, holders and bounds are computed from, its
/// invariants held by construction. Operators write it as the allocator's `PoolSpec` and agents
/// receive it as [`PoolTerms`](crate::wire::PoolTerms); both become this before anything uses
/// them.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolConfig {
    limit_tokens: u64,
    window: WindowSpec,
    chunk_tokens: u64,
    lease_ttl_ms: u64,
    fallback_per_region_tokens: u64,
    settle_debt_per_region_tokens: u64,
    regions: Vec<RegionId>,
}

impl PoolConfig {
    /// Validates: limit in `[1, 2^40]`, `windowMs >= 1000` (and at most 2^40), `1 <= chunk <= limit`,
    /// `100 <= leaseTtlMs <= windowMs`, `fallbackPerRegion <= 2^40`, regions non-empty, unique, at most
    /// [`MAX_REGIONS_PER_POOL`].
    pub fn new(
        limit_tokens: u64,
        window_ms: u64,
        chunk_tokens: u64,
        lease_ttl_ms: u64,
        fallback_per_region_tokens: u64,
        regions: Vec<RegionId>,
    ) -> Result<Self, PoolConfigError> {
        let window = NonZeroU64::new(window_ms)
            .filter(|w| (MIN_WINDOW_MS..=MAX_RULE_PARAMETER).contains(&w.get()))
            .ok_or_else(|| config_error("windowMs", "must be an integer in [1000, 2^40]"))?;
        Self::with_window(
            limit_tokens,
            WindowSpec::Fixed(window),
            chunk_tokens,
            lease_ttl_ms,
            fallback_per_region_tokens,
            regions,
        )
    }

    /// [`new`](Self::new) with any window spec: a calendar window's lease TTL must fit in its
    /// shortest window (a day of 22 hours, allowing for daylight saving).
    pub fn with_window(
        limit_tokens: u64,
        window: WindowSpec,
        chunk_tokens: u64,
        lease_ttl_ms: u64,
        fallback_per_region_tokens: u64,
        regions: Vec<RegionId>,
    ) -> Result<Self, PoolConfigError> {
        if !(1..=MAX_RULE_PARAMETER).contains(&limit_tokens) {
            return Err(config_error("limit", "must be an integer in [1, 2^40]"));
        }
        if chunk_tokens < 1 || chunk_tokens > limit_tokens {
            return Err(config_error(
                "chunk",
                "must be at least 1 and at most limit",
            ));
        }
        if lease_ttl_ms < MIN_LEASE_TTL_MS || lease_ttl_ms > window.shortest_ms() {
            return Err(config_error(
                "leaseTtlMs",
                match window {
                    WindowSpec::Fixed(_) => "must be at least 100 and at most windowMs".to_owned(),
                    WindowSpec::Calendar(_) => format!(
                        "must be at least 100 and at most {} (the shortest window)",
                        window.shortest_ms()
                    ),
                },
            ));
        }
        if fallback_per_region_tokens > MAX_RULE_PARAMETER {
            return Err(config_error(
                "fallbackPerRegion",
                "must be an integer in [0, 2^40]",
            ));
        }
        if regions.is_empty() {
            return Err(config_error("regions", "must name at least one region"));
        }
        if regions.len() > MAX_REGIONS_PER_POOL {
            return Err(config_error("regions", "must name at most 64 regions"));
        }
        let mut seen = std::collections::BTreeSet::new();
        if let Some(dup) = regions.iter().find(|r| !seen.insert(*r)) {
            return Err(config_error(
                "regions",
                format!("region {dup} is listed twice"),
            ));
        }
        Ok(Self {
            limit_tokens,
            window,
            chunk_tokens,
            lease_ttl_ms,
            fallback_per_region_tokens,
            settle_debt_per_region_tokens: 0,
            regions,
        })
    }

    /// The debt each region may carry per window from metered requests whose settled cost was
    /// above their estimate (`settleDebtPerRegion`, tokens, at most 2^40; 0 by default: what the
    /// region's leases cannot pay at once is written off, and counted). Debt is paid first from
    /// the region's next leases; what is unpaid at a window's end is consumption beyond the
    /// ledger's admits, so it is a term of the overshoot bound.
    pub fn with_settle_debt_per_region(
        mut self,
        settle_debt_per_region_tokens: u64,
    ) -> Result<Self, PoolConfigError> {
        if settle_debt_per_region_tokens > MAX_RULE_PARAMETER {
            return Err(config_error(
                "settleDebtPerRegion",
                "must be an integer in [0, 2^40]",
            ));
        }
        self.settle_debt_per_region_tokens = settle_debt_per_region_tokens;
        Ok(self)
    }

    /// This configuration with `G` replaced by `limit_tokens` (an override in force, see
    /// `crate::overrides`), its chunk cut to fit: everything else, the bound's other terms
    /// included, unchanged. A limit out of `[1, 2^40]` is brought into it. Borrowed, not
    /// copied, when the limit is the configuration's own (no override: every grant's case).
    pub fn limited_to(&self, limit_tokens: u64) -> std::borrow::Cow<'_, Self> {
        let limit_tokens = limit_tokens.clamp(1, MAX_RULE_PARAMETER);
        if limit_tokens == self.limit_tokens {
            return std::borrow::Cow::Borrowed(self);
        }
        std::borrow::Cow::Owned(Self {
            limit_tokens,
            chunk_tokens: self.chunk_tokens.min(limit_tokens),
            ..self.clone()
        })
    }

    /// The global quota `G` per window, in tokens.
    pub fn limit_tokens(&self) -> u64 {
        self.limit_tokens
    }
    /// How the windows are cut.
    pub fn window(&self) -> &WindowSpec {
        &self.window
    }
    /// Largest grant, in tokens.
    pub fn chunk_tokens(&self) -> u64 {
        self.chunk_tokens
    }
    /// Lease time to live before clamping, in ms.
    pub fn lease_ttl_ms(&self) -> u64 {
        self.lease_ttl_ms
    }
    /// Tokens each region may admit per window when it cannot reach the allocator.
    pub fn fallback_per_region_tokens(&self) -> u64 {
        self.fallback_per_region_tokens
    }
    /// Debt each region may carry from settled metered requests, tokens.
    pub fn settle_debt_per_region_tokens(&self) -> u64 {
        self.settle_debt_per_region_tokens
    }
    /// The regions allowed to take grants from this pool.
    pub fn regions(&self) -> &[RegionId] {
        &self.regions
    }
    /// The window containing `now_ms`.
    pub fn window_at(&self, now_ms: u64) -> Window {
        self.window.containing(now_ms)
    }
}

/// Longest a grant's record is kept after its commit, whatever its window's length, ms (it is
/// kept less when its window and one more window end sooner). A record answers an ask asked again
/// after a lost answer, and a lease's give-back; an hour covers any retry an agent makes with an
/// unanswered lease id (it gives the id up by then) and a lease's final report, while 10,000
/// monthly pools renewed every 10 minutes in 3 regions keep some 200,000 records, not the 260
/// million that a window's length of them would be. The allocator refuses an ask whose lease id
/// was made longer ago than this in a window that outlives it ([`lease_id_outlived`]).
pub const GRANT_RECORD_MAX_LIFETIME_MS: u64 = 3_600_000;

/// Whether an ask with `lease`'s id, at `now_ms` (the allocator's clock) in windows of at most
/// `window_length_ms`, may find its grant's record gone: the id was made longer ago than a
/// record is kept ([`GRANT_RECORD_MAX_LIFETIME_MS`], less `clock_allowance_ms` for the asker's
/// clock) and the windows outlive that (in shorter ones a record outlives its window by one more,
/// and the asker gives the id up by then). Granted again, it could be granted twice: it is refused
/// instead, and the asker asks afresh. An id stamped more than the allowance ahead of `now_ms` is
/// refused too: its age would read short by as much, and a clock that far ahead is not one the
/// allowance covers.
pub fn lease_id_outlived(
    lease: LeaseId,
    window_length_ms: u64,
    now_ms: u64,
    clock_allowance_ms: u64,
) -> bool {
    let made_ms = lease.unix_ms();
    window_length_ms > GRANT_RECORD_MAX_LIFETIME_MS
        && (now_ms.saturating_sub(made_ms)
            > GRANT_RECORD_MAX_LIFETIME_MS.saturating_sub(clock_allowance_ms)
            || made_ms > now_ms.saturating_add(clock_allowance_ms))
}

/// Whether lease expiry is clamped to the end of its window. Production always clamps; the simulator
/// turns it off to show the carry-over term of the bound.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum LeaseClamping {
    /// `expires_at = min(now + ttl, window_end)`: tokens of one window cannot be spent in the next.
    Clamped,
    /// `expires_at = now + ttl`: up to a chunk per region can carry over into the next window.
    Unclamped,
}

/// A pool's accounting for one window: what each region was granted, and what leases gave back.
/// What remains is derived from the limit in force, never stored, so an operator changing the
/// limit mid-window takes effect at once (a lowered limit below what is outstanding leaves
/// nothing, it never goes negative).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct PoolWindowState {
    /// The window this state belongs to.
    pub window: Window,
    /// Tokens granted in this window, per region.
    pub granted_by_region: BTreeMap<RegionId, u64>,
    /// Tokens given back in this window ([`PoolWindowState::take_back`]): unspent at the end of
    /// leases whose holders will never spend them, and so grantable again. At most what was
    /// granted.
    pub returned_tokens: u64,
}

impl PoolWindowState {
    /// A fresh window: nothing granted.
    pub fn fresh(window: Window) -> Self {
        Self {
            window,
            granted_by_region: BTreeMap::new(),
            returned_tokens: 0,
        }
    }

    /// Tokens granted so far in the window (what was given back and granted again counts twice).
    pub fn granted_tokens(&self) -> u64 {
        self.granted_by_region
            .values()
            .fold(0u64, |sum, granted| sum.saturating_add(*granted))
    }

    /// Tokens granted and not given back: what leases of this window may still spend or have
    /// spent. Never above the limit in force when they were granted.
    pub fn outstanding_tokens(&self) -> u64 {
        self.granted_tokens().saturating_sub(self.returned_tokens)
    }

    /// Tokens not yet granted (or given back) under `config`'s limit.
    pub fn remaining_tokens(&self, config: &PoolConfig) -> u64 {
        config
            .limit_tokens
            .saturating_sub(self.outstanding_tokens())
    }

    /// Takes back `tokens` a lease granted in `lease_window` will never spend, so they can be
    /// granted again: only while this state is that window's (given back later, they are
    /// stranded). Returns how many were taken back.
    ///
    /// The bound holds because what leases of the window may spend stays at most what is
    /// outstanding: the caller passes no more than [`returnable_tokens`] of a lease whose holder
    /// has ended it, and takes a lease's tokens back once.
    pub fn take_back(&mut self, lease_window: Window, tokens: u64) -> u64 {
        if lease_window != self.window {
            return 0;
        }
        let taken = tokens.min(self.outstanding_tokens());
        self.returned_tokens += taken;
        debug_assert!(self.returned_tokens <= self.granted_tokens());
        taken
    }
}

/// What a lease's final line may give back at `now_ms`, the lease granted `granted_tokens` at
/// `issued_at_ms` in `window`: [`returnable_tokens`] while the window runs and, in windows longer
/// than a record is kept ([`GRANT_RECORD_MAX_LIFETIME_MS`]), while the grant's record surely is
/// (so the lease's give-back mark, which outlives its own commit as long, is too: a line replayed
/// later never finds the record without the mark); nothing after.
pub fn returnable_tokens_at(
    granted_tokens: u64,
    issued_at_ms: u64,
    window: Window,
    spent_tokens: u64,
    unspent_tokens: u64,
    now_ms: u64,
) -> u64 {
    let capped = window.length_ms() > GRANT_RECORD_MAX_LIFETIME_MS;
    let record_kept = now_ms < issued_at_ms.saturating_add(GRANT_RECORD_MAX_LIFETIME_MS);
    if now_ms >= window.end_ms || (capped && !record_kept) {
        return 0;
    }
    returnable_tokens(granted_tokens, spent_tokens, unspent_tokens)
}

/// What of a lease granted `granted_tokens` can be given back when its holder ends it having spent
/// `spent_tokens` and says `unspent_tokens` are left that it will never spend: never more than the
/// grant less the spend, whatever the holder says.
pub fn returnable_tokens(granted_tokens: u64, spent_tokens: u64, unspent_tokens: u64) -> u64 {
    unspent_tokens.min(granted_tokens.saturating_sub(spent_tokens))
}

/// What a region asks for.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct GrantRequest {
    /// Idempotency key chosen by the agent.
    pub lease_id: LeaseId,
    /// The asking region.
    pub region: RegionId,
    /// Tokens wanted (at least 1).
    pub want_tokens: u64,
}

/// A grant: the answer to a [`GrantRequest`], and the record the allocator stores under its lease id.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Grant {
    /// The request's lease id.
    pub lease_id: LeaseId,
    /// The region the lease belongs to.
    pub region: RegionId,
    /// Tokens granted: `min(want, chunk, remaining)`, 0 when the window is exhausted.
    pub granted_tokens: u64,
    /// The allocator epoch that granted it.
    pub epoch: Epoch,
    /// The window the tokens belong to.
    pub window: Window,
    /// No token of this lease may be spent at or after this instant, epoch ms.
    pub expires_at_ms: u64,
    /// When nothing was granted, the time to the next window in ms; otherwise 0.
    pub retry_after_ms: u64,
    /// When it was granted (the allocator's clock), epoch ms: with `expires_at_ms`, how long the
    /// lease lasts, which an agent measures on its own monotonic clock.
    pub issued_at_ms: u64,
    /// What the window had left to grant after this grant, tokens: the allocator's view of the
    /// pool's remaining quota at `issued_at_ms` (agents show it to callers, with its age).
    pub ungranted_tokens: u64,
}

/// Why a grant request was refused outright.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrantError {
    /// The region is not configured on the pool.
    #[error("region {0} may not take grants from this pool")]
    RegionNotInPool(RegionId),
    /// `want` was zero.
    #[error("want must be at least 1")]
    ZeroWant,
}

/// Grants from a pool at `now_ms`. `state` is the pool's stored window state, if any; a state of an
/// earlier window is replaced by a fresh window (unspent quota never carries over).
pub fn grant(
    config: &PoolConfig,
    state: Option<&PoolWindowState>,
    epoch: Epoch,
    now_ms: u64,
    request: &GrantRequest,
    clamping: LeaseClamping,
) -> Result<(Grant, PoolWindowState), GrantError> {
    if !config.regions.contains(&request.region) {
        return Err(GrantError::RegionNotInPool(request.region.clone()));
    }
    if request.want_tokens == 0 {
        return Err(GrantError::ZeroWant);
    }
    let window = config.window_at(now_ms);
    let mut next = match state {
        // A stored window at or after now's (the allocator's clock stepped back) is kept: never refill
        // a window that was already handed out.
        Some(s) if s.window.start_ms >= window.start_ms => s.clone(),
        _ => PoolWindowState::fresh(window),
    };
    let granted_tokens = request
        .want_tokens
        .min(config.chunk_tokens)
        .min(next.remaining_tokens(config));
    if granted_tokens > 0 {
        *next
            .granted_by_region
            .entry(request.region.clone())
            .or_insert(0) += granted_tokens;
    }
    debug_assert!(
        granted_tokens == 0 || next.outstanding_tokens() <= config.limit_tokens,
        "a grant never takes a window past its limit"
    );
    let unclamped_expiry_ms = now_ms.saturating_add(config.lease_ttl_ms);
    let expires_at_ms = match (granted_tokens, clamping) {
        (0, _) => now_ms,
        (_, LeaseClamping::Clamped) => unclamped_expiry_ms.min(next.window.end_ms),
        (_, LeaseClamping::Unclamped) => unclamped_expiry_ms,
    };
    debug_assert!(clamping == LeaseClamping::Unclamped || expires_at_ms <= next.window.end_ms);
    let retry_after_ms = if granted_tokens == 0 {
        next.window.ms_until_end(now_ms).max(1)
    } else {
        0
    };
    let grant = Grant {
        lease_id: request.lease_id,
        region: request.region.clone(),
        granted_tokens,
        epoch,
        window: next.window,
        expires_at_ms,
        retry_after_ms,
        issued_at_ms: now_ms,
        ungranted_tokens: next.remaining_tokens(config),
    };
    debug_assert!(grant.expires_at_ms >= grant.issued_at_ms || grant.granted_tokens == 0);
    Ok((grant, next))
}

/// The terms of the overshoot bound for one window:
/// `consumed <= G + unclamped carry-over + fallback allowances + lost grant records + settle debt`.
///
/// Every design choice that can admit more than `G` adds exactly one term, so the bound is a design
/// output that operators tune with chunk, TTL and fallback, and that the simulator and the ledger check
/// recorded windows against.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct OvershootBound {
    /// `G`, the pool's limit per window, in tokens.
    pub limit_tokens: u64,
    /// Tokens granted in an earlier window that may be spent in this one (0 when leases are clamped).
    pub unclamped_carry_over_tokens: u64,
    /// Tokens regions may admit on their own while the allocator is unreachable.
    pub fallback_allowance_tokens: u64,
    /// Tokens re-granted because an allocator failover lost grant records (0 on a consensus store).
    pub lost_grant_record_tokens: u64,
    /// Tokens metered requests consumed beyond their estimates that regions may still owe at the
    /// window's end (`settleDebtPerRegion x regions`): paid from later leases, so never in this
    /// window's admits.
    pub settle_debt_tokens: u64,
}

impl OvershootBound {
    /// The worst case a design admits in one window, from the pool's configuration:
    /// carry-over is `chunk x regions x max_leases_per_region` when unclamped, fallback is
    /// `fallbackPerRegion x regions`, settle debt is `settleDebtPerRegion x regions`, and
    /// `lost_grant_record_tokens` is supplied by the caller (0 for an etcd-backed allocator, whose
    /// committed grants survive failover).
    pub fn for_design(
        config: &PoolConfig,
        clamping: LeaseClamping,
        max_leases_per_region: u64,
        lost_grant_record_tokens: u64,
    ) -> Self {
        let regions = config.regions.len() as u64;
        let unclamped_carry_over_tokens = match clamping {
            LeaseClamping::Clamped => 0,
            LeaseClamping::Unclamped => config
                .chunk_tokens
                .saturating_mul(regions)
                .saturating_mul(max_leases_per_region),
        };
        Self {
            limit_tokens: config.limit_tokens,
            unclamped_carry_over_tokens,
            fallback_allowance_tokens: config.fallback_per_region_tokens.saturating_mul(regions),
            lost_grant_record_tokens,
            settle_debt_tokens: config.settle_debt_per_region_tokens.saturating_mul(regions),
        }
    }

    /// The bound: the sum of all terms, in tokens.
    pub fn total_tokens(&self) -> u64 {
        self.limit_tokens
            .saturating_add(self.unclamped_carry_over_tokens)
            .saturating_add(self.fallback_allowance_tokens)
            .saturating_add(self.lost_grant_record_tokens)
            .saturating_add(self.settle_debt_tokens)
    }

    /// Whether `admitted_tokens` in a window is within the bound.
    pub fn holds(&self, admitted_tokens: u64) -> bool {
        admitted_tokens <= self.total_tokens()
    }
}

/// Admitted tokens beyond the limit: `max(0, admitted - limit)`.
pub fn overshoot_tokens(admitted_tokens: u64, limit_tokens: u64) -> u64 {
    admitted_tokens.saturating_sub(limit_tokens)
}
