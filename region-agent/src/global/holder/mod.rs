//! One pool held by the agent: the leases it holds for one (tenant, pool), how a request spends
//! them, when to ask the allocator for more and how much, what may be admitted while the allocator is
//! unreachable, and what is owed to the ledger.
//!
//! Pure and deterministic: time (`now_ms`) and reachability are arguments, so the agent, the tests and
//! the partition drills run exactly this code. The agent serialises access (one holder per pool); the
//! hot path (`spend`) is a handful of integer operations and never waits for the allocator.
//!
//! Promises, each asserted in debug builds and held by property tests:
//! - no token is spent at or after its lease's `expiresAtMs` (less a safety margin for clock-rate
//!   error), so a clamped lease never admits in the next window;
//! - a grant from an epoch below the highest seen is ignored (a deposed allocator is fenced off here
//!   too);
//! - admits from leases never exceed what the leases granted; admits in fallback never exceed the
//!   pool's `fallbackPerRegion` per window; so per window and region:
//!   admitted <= granted to this region + fallbackPerRegion;
//! - fallback windows are cut on the agent's clock, so no fallback is admitted within the clock
//!   margin of a window's edges: with the agent's clock within that margin of the allocator's,
//!   every fallback admit falls in the same window on both clocks, and the per-window allowance
//!   holds on the allocator's clock too;
//! - nothing is refunded: what a lease did not spend by its end is stranded, and reported as such;
//! - a reservation ([`PoolHolder::reserve`]) takes tokens out of what may be spent until it is
//!   committed (the request was admitted: the tokens are spent) or cancelled (another rule denied:
//!   the tokens go back to the same lease while it lives, are stranded if it has ended, and go back
//!   to the window's allowance in fallback). No token is reserved twice, none is lost, and a lease
//!   is reserved from only before its usable end. Nothing remote is involved: this is bookkeeping
//!   in the agent's memory, not a refund to the allocator.
//!
//! The holder composes its parts, each owning its state: the leases (live ones, and ended ones
//! owed a final line), the fallback book (per window: used, reported, claimed), the demand
//! (spend rate), the renewal state (in flight, lost answer, exhaustion); it keeps the running
//! total of reserved tokens, the settle debt and two counters for metrics. The gateways' carving
//! (sub-leases) and what the holder reports and journals are `impl` blocks of their own.

mod demand;
mod fallback;
mod gateway;
mod journal;
mod leases;
mod renewal;
mod types;

use allot_shared::ids::{Epoch, LeaseId};
use allot_shared::window::Window;

use demand::{Demand, RATE_BUCKET_MS, RATE_SCALE, slow_buckets};
use fallback::{FallbackBook, NoFallback};
use leases::{Leases, Losses};
use renewal::Renewal;

pub use leases::HeldLease;
pub use renewal::{
    GRANT_RECORD_CLOCK_ALLOWANCE_MS, GRANT_RECORD_KEPT_MIN_MS, lost_answer_recoverable_until_ms,
};
use types::ReservedFrom;
pub use types::{
    DebtCharge, Denial, FallbackLine, GrantVerdict, HolderConfig, HolderSnapshot,
    JournaledFallback, JournaledLease, LeaseGrant, LeaseLine, MAX_FALLBACK_WINDOWS,
    MAX_LIVE_LEASES, MAX_UNREPORTED_LEASES, PendingReport, Refusal, Reservation, Spend,
};

/// The holder of one pool.
///
/// Two holders are equal when they decide alike: equality and hashing leave out the counters
/// kept only for metrics (stranded tokens, dropped reports), so the model checker does not tell
/// apart states that differ only in their history.
#[derive(Debug, Clone)]
pub struct PoolHolder {
    config: HolderConfig,
    leases: Leases,
    fallback: FallbackBook,
    demand: Demand,
    renewal: Renewal,
    /// Tokens in outstanding reservations, leases and fallback together.
    reserved_tokens: u64,
    /// Tokens settled metered requests consumed that no lease has paid yet (at most
    /// `config.settle_debt_tokens`, but for a lowered limit): paid before anything is reserved.
    debt_tokens: u64,
    dropped_reports: u64,
    stranded_tokens: u64,
}

impl PartialEq for PoolHolder {
    fn eq(&self, other: &Self) -> bool {
        self.deciding_state() == other.deciding_state()
    }
}

impl Eq for PoolHolder {}

impl std::hash::Hash for PoolHolder {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.deciding_state().hash(state);
    }
}

/// Everything of a holder that decides what it does next.
type DecidingState<'a> = (
    &'a HolderConfig,
    &'a Leases,
    &'a FallbackBook,
    &'a Demand,
    &'a Renewal,
    u64,
    u64,
);

impl PoolHolder {
    /// Everything that decides what the holder does next (all but the metrics counters). The
    /// exhaustive pattern makes a new field a compile error here until it is placed.
    fn deciding_state(&self) -> DecidingState<'_> {
        let Self {
            config,
            leases,
            fallback,
            demand,
            renewal,
            reserved_tokens,
            debt_tokens,
            dropped_reports: _,
            stranded_tokens: _,
        } = self;
        (
            config,
            leases,
            fallback,
            demand,
            renewal,
            *reserved_tokens,
            *debt_tokens,
        )
    }

    /// An empty holder.
    pub fn new(config: HolderConfig) -> Self {
        let demand = Demand::new(config.lease_ttl_ms);
        Self {
            config,
            leases: Leases::default(),
            fallback: FallbackBook::default(),
            demand,
            renewal: Renewal::default(),
            reserved_tokens: 0,
            debt_tokens: 0,
            dropped_reports: 0,
            stranded_tokens: 0,
        }
    }

    /// Replaces the configuration (a pool update). Held leases are unaffected.
    pub fn reconfigure(&mut self, config: HolderConfig) {
        self.demand.rate.slow_buckets = slow_buckets(config.lease_ttl_ms);
        self.config = config;
    }

    /// The pool's terms changed (an operator raised or lowered its limit, say): a window the
    /// allocator said was spent may have tokens again, so the next request asks for them instead
    /// of waiting for the window's end.
    pub fn forget_exhaustion(&mut self) {
        self.renewal.exhausted_until_ms = 0;
    }

    /// The configuration.
    pub fn config(&self) -> &HolderConfig {
        &self.config
    }

    /// Counts what the leases lost: stranded tokens and dropped report lines.
    fn count(&mut self, losses: Losses) {
        self.stranded_tokens += losses.stranded_tokens;
        self.dropped_reports += losses.dropped_reports;
    }

    /// Moves leases past their usable end to the ended list; their unspent tokens are stranded.
    fn expire(&mut self, now_ms: u64) {
        let losses = self.leases.expire(now_ms, self.config.expiry_margin_ms);
        self.count(losses);
    }

    /// When the first live lease ends (its usable end, past which it is owed a final report
    /// line), epoch ms; `None` with none live.
    pub fn next_lease_end_ms(&self) -> Option<u64> {
        self.leases.next_end_ms(self.config.expiry_margin_ms)
    }

    /// Takes a grant from the allocator.
    pub fn accept(&mut self, grant: LeaseGrant, now_ms: u64) -> GrantVerdict {
        if self.renewal.unanswered_lease == Some(grant.lease_id) {
            self.renewal.unanswered_lease = None;
        }
        if !self.leases.note_epoch(grant.epoch) {
            return GrantVerdict::StaleEpoch {
                highest: self.leases.highest_epoch(),
            };
        }
        if grant.granted_tokens == 0 {
            // The pool refills at the next window at the latest.
            let until_ms = now_ms.saturating_add(grant.retry_after_ms.max(1));
            self.renewal.exhausted_until_ms = self.renewal.exhausted_until_ms.max(until_ms);
            return GrantVerdict::Exhausted { until_ms };
        }
        if self.leases.holds(grant.lease_id) {
            return GrantVerdict::Duplicate;
        }
        let lease = HeldLease::granted(grant);
        if now_ms >= lease.usable_until_ms(self.config.expiry_margin_ms) {
            // Answered too late to spend (a lost answer asked again after a failover longer than
            // the TTL): never spent, but granted, so it owes the ledger a final line like any
            // ended lease, or the ledger would count its tokens as unreported.
            self.stranded_tokens += self.leases.hold_ended(lease);
            return GrantVerdict::AlreadyExpired;
        }
        self.renewal.exhausted_until_ms = 0;
        self.expire(now_ms);
        if grant.granted_tokens >= self.renewal.wanted_for_request_tokens {
            self.renewal.wanted_for_request_tokens = 0;
        }
        // Hold at most a few leases: the oldest one ends early (its rest is stranded).
        self.stranded_tokens += self.leases.hold(lease);
        self.pay_debt(now_ms);
        GrantVerdict::Accepted
    }

    /// Spends `cost_tokens` (at least 1) at `now_ms` at once: a reservation committed in the same
    /// instant (for a pool that is the request's only rule). `allocator_reachable` says whether the
    /// agent can currently reach the allocator (it decides whether fallback applies).
    pub fn spend(&mut self, cost_tokens: u64, now_ms: u64, allocator_reachable: bool) -> Spend {
        match self.reserve(cost_tokens, now_ms, allocator_reachable) {
            Ok(reservation) => self.commit(reservation),
            Err(Refusal {
                denial,
                retry_after_ms,
            }) => Spend::Denied {
                denial,
                retry_after_ms,
            },
        }
    }

    /// Whether a renewal has been unanswered for longer than the configured patience: the
    /// allocator is treated as unreachable until it answers.
    pub fn allocator_silent(&self, now_ms: u64) -> bool {
        self.renewal.silent(now_ms, self.config.renewal_patience_ms)
    }

    /// Reserves `cost_tokens` (at least 1) at `now_ms` for a request whose other rules are still
    /// to be decided: from held leases (the first-ending first, across leases when one holds too
    /// little), else, with the allocator unreachable (or silent past the renewal patience), from
    /// the window's fallback allowance. Reserved tokens can be neither spent nor reserved again
    /// until [`commit`](Self::commit) or [`cancel`](Self::cancel).
    pub fn reserve(
        &mut self,
        cost_tokens: u64,
        now_ms: u64,
        allocator_reachable: bool,
    ) -> Result<Reservation, Refusal> {
        let cost_tokens = cost_tokens.max(1);
        if cost_tokens > self.config.chunk_tokens.max(1) {
            return Err(Refusal {
                denial: Denial::CostAboveChunk,
                retry_after_ms: u64::MAX,
            });
        }
        self.expire(now_ms);
        self.pay_debt(now_ms);
        self.demand.record(now_ms, cost_tokens);
        if let Some((parts, len)) =
            self.leases
                .reserve(cost_tokens, now_ms, self.config.expiry_margin_ms)
        {
            self.reserved_tokens += cost_tokens;
            return Ok(Reservation {
                from: ReservedFrom::Leases { parts, len },
                cost_tokens,
                reserved_at_ms: now_ms,
                demand_counted: true,
            });
        }
        if self.renewal.exhausted_at(now_ms) {
            return Err(Refusal {
                denial: Denial::PoolExhausted,
                retry_after_ms: self.renewal.exhausted_until_ms - now_ms,
            });
        }
        let window = self.config.window.containing(now_ms);
        let until_window_end_ms = window.ms_until_end(now_ms).max(1);
        if allocator_reachable && !self.allocator_silent(now_ms) {
            if window.ms_until_end(now_ms)
                <= self.config.expiry_margin_ms + self.config.round_trip_ms
            {
                return Err(Refusal {
                    denial: Denial::WindowEnding,
                    retry_after_ms: until_window_end_ms,
                });
            }
            // Ask the next renewal for at least this much, so the request can be met.
            self.renewal.want_at_least(cost_tokens);
            return Err(Refusal {
                denial: Denial::AwaitingGrant,
                retry_after_ms: 1,
            });
        }
        self.reserve_from_fallback(cost_tokens, now_ms, window, until_window_end_ms)
    }

    fn reserve_from_fallback(
        &mut self,
        cost_tokens: u64,
        now_ms: u64,
        window: Window,
        until_window_end_ms: u64,
    ) -> Result<Reservation, Refusal> {
        let allowance = self.config.fallback_per_region_tokens;
        if allowance == 0 {
            return Err(Refusal {
                denial: Denial::FailClosed,
                retry_after_ms: until_window_end_ms,
            });
        }
        let span = self.fallback_span(window);
        if !span.contains(&now_ms) {
            // Before the span it opens at its start; after it, the next window's span opens the
            // clock margin after this window's end.
            let usable_from_ms = if now_ms < span.start {
                span.start
            } else {
                window.end_ms.saturating_add(self.config.clock_margin_ms)
            };
            return Err(Refusal {
                denial: Denial::FallbackAtWindowEdge,
                retry_after_ms: usable_from_ms.saturating_sub(now_ms).max(1),
            });
        }
        let claims = self.config.fallback_claim_block_tokens > 0;
        match self
            .fallback
            .reserve(window.start_ms, cost_tokens, allowance, claims)
        {
            Err(NoFallback::Spent) => Err(Refusal {
                denial: Denial::FallbackSpent,
                retry_after_ms: until_window_end_ms,
            }),
            Err(NoFallback::Unclaimed) => Err(Refusal {
                denial: Denial::FallbackUnclaimed,
                retry_after_ms: 1,
            }),
            Ok(window_dropped) => {
                self.dropped_reports += u64::from(window_dropped);
                self.reserved_tokens += cost_tokens;
                Ok(Reservation {
                    from: ReservedFrom::Fallback {
                        window_start_ms: window.start_ms,
                    },
                    cost_tokens,
                    reserved_at_ms: now_ms,
                    demand_counted: true,
                })
            }
        }
    }

    /// Charges `extra_tokens` that a settled metered request consumed beyond its estimate, at
    /// `now_ms`: spent at once from held leases (first-ending first) as far as they go, after any
    /// debt already owed; the rest is owed, up to the debt the holder may carry; beyond it,
    /// written off (the caller counts it). Counted as demand, so renewals grow to pay it.
    pub fn charge(&mut self, extra_tokens: u64, now_ms: u64) -> DebtCharge {
        if extra_tokens == 0 {
            return DebtCharge::default();
        }
        self.expire(now_ms);
        self.pay_debt(now_ms);
        self.demand.record(now_ms, extra_tokens);
        let paid_tokens = if self.debt_tokens == 0 {
            self.leases
                .spend(extra_tokens, now_ms, self.config.expiry_margin_ms)
        } else {
            0
        };
        let unpaid = extra_tokens - paid_tokens;
        let room = self
            .config
            .settle_debt_tokens
            .saturating_sub(self.debt_tokens);
        let owed_tokens = unpaid.min(room);
        self.debt_tokens += owed_tokens;
        if self.debt_tokens > 0 {
            // The next renewal asks for enough to pay the debt (within the chunk).
            self.renewal
                .want_at_least(self.debt_tokens.min(self.config.chunk_tokens.max(1)));
        }
        let charge = DebtCharge {
            paid_tokens,
            owed_tokens,
            written_off_tokens: unpaid - owed_tokens,
        };
        debug_assert_eq!(
            charge.paid_tokens + charge.owed_tokens + charge.written_off_tokens,
            extra_tokens,
            "every extra token is paid, owed or written off"
        );
        charge
    }

    /// Tokens owed by settled metered requests, not yet paid from a lease.
    pub fn debt_tokens(&self) -> u64 {
        self.debt_tokens
    }

    /// Pays what is owed from held leases, before anything else is reserved from them.
    fn pay_debt(&mut self, now_ms: u64) {
        if self.debt_tokens > 0 {
            let paid = self
                .leases
                .spend(self.debt_tokens, now_ms, self.config.expiry_margin_ms);
            self.debt_tokens -= paid;
        }
    }

    /// Spends what `reservation` holds: the request was admitted. The tokens count as spent from
    /// their leases (or admitted in fallback in their window) whenever the commit comes; a lease
    /// that ended meanwhile reports them with its final line.
    pub fn commit(&mut self, reservation: Reservation) -> Spend {
        self.settle(&reservation);
        match reservation.from {
            ReservedFrom::Fallback { window_start_ms } => {
                let admitted = self
                    .fallback
                    .admit(window_start_ms, reservation.cost_tokens);
                debug_assert!(
                    admitted <= self.config.fallback_per_region_tokens,
                    "fallback admits stay within the allowance"
                );
                Spend::Fallback { window_start_ms }
            }
            ReservedFrom::Leases { parts, .. } => {
                for &(lease_id, tokens) in reservation.lease_parts() {
                    // A lease is gone only past MAX_UNREPORTED_LEASES ended leases, which keeps
                    // those with reservations: counted, never silent.
                    if !self.leases.spend_reserved(lease_id, tokens) {
                        self.dropped_reports += 1;
                    }
                }
                Spend::Leased(parts[0].0)
            }
        }
    }

    /// Takes back the demand a refused reservation recorded (at `reserved_at_ms`): a dry run's
    /// refusal must not size the next renewal as if it were traffic.
    pub fn withdraw_demand(&mut self, reserved_at_ms: u64, cost_tokens: u64) {
        self.demand
            .rate
            .unrecord(reserved_at_ms, cost_tokens.max(1));
    }

    /// Gives back what `reservation` holds: the request was denied by another rule (or not
    /// decided). Tokens go back to their lease while it lives (an ended lease strands them, as
    /// it strands the rest of what it held) or to their window's fallback allowance; the demand
    /// they stood for is taken back.
    pub fn cancel(&mut self, reservation: Reservation) {
        self.settle(&reservation);
        if reservation.demand_counted {
            self.demand
                .rate
                .unrecord(reservation.reserved_at_ms, reservation.cost_tokens);
        }
        match reservation.from {
            ReservedFrom::Fallback { window_start_ms } => {
                self.fallback
                    .release(window_start_ms, reservation.cost_tokens);
            }
            ReservedFrom::Leases { .. } => {
                for &(lease_id, tokens) in reservation.lease_parts() {
                    self.stranded_tokens += self.leases.release(lease_id, tokens);
                }
            }
        }
    }

    /// When, on the agent's clock, fallback may be reserved in `window` (start inclusive, end
    /// exclusive): the window less the clock margin at its start, and less the clock margin and
    /// the expiry margin (within which a reservation is committed) at its end. An agent whose
    /// clock is within the margin of the allocator's admits fallback only when both clocks are in
    /// `window`. Empty when the margins take the whole window (fallback then never applies).
    pub fn fallback_span(&self, window: Window) -> std::ops::Range<u64> {
        fallback::span(
            window,
            self.config.clock_margin_ms,
            self.config.expiry_margin_ms,
        )
    }

    fn settle(&mut self, reservation: &Reservation) {
        debug_assert!(
            self.reserved_tokens >= reservation.cost_tokens,
            "a reservation is settled once, on the holder that made it"
        );
        self.reserved_tokens = self.reserved_tokens.saturating_sub(reservation.cost_tokens);
    }

    /// Tokens in reservations not yet settled.
    pub fn reserved_tokens(&self) -> u64 {
        self.reserved_tokens
    }

    /// Tokens spendable now from held leases.
    pub fn available_tokens(&self, now_ms: u64) -> u64 {
        self.leases.available(now_ms, self.config.expiry_margin_ms)
    }

    /// How many tokens to ask the allocator for now, if any: when what is held would run out within
    /// about two allocator round trips at the current rate (the low watermark, at most one chunk), ask
    /// for what the rate spends in a lease TTL, between 1 and the pool's chunk. `None` while a renewal is in flight,
    /// while the pool is exhausted, or when the pool has seen no demand for a window.
    pub fn wants(&mut self, now_ms: u64) -> Option<u64> {
        if self.renewal.in_flight || self.renewal.exhausted_at(now_ms) {
            return None;
        }
        let round_trip_ms = self.config.round_trip_ms;
        let last_demand_ms = self.demand.last_ms?;
        // Leases are clamped to their window: one asked for this close to the window's end would end
        // before this agent may spend from it and be stranded whole. Wait for the next window.
        let window = self.config.window.containing(now_ms);
        if window.ms_until_end(now_ms) <= self.config.expiry_margin_ms + round_trip_ms {
            return None;
        }
        self.expire(now_ms);
        self.demand.rate.roll(now_ms);
        if self.leases.none_live()
            && now_ms.saturating_sub(last_demand_ms) > self.config.window.longest_ms()
        {
            return None;
        }
        let per_ms = RATE_SCALE * 1_000;
        let horizon_ms = 2 * round_trip_ms + self.config.expiry_margin_ms + RATE_BUCKET_MS;
        // Never prefetch while a whole chunk is held: a busy pool with a small chunk would otherwise
        // ask on every spend and hold (and strand) more leases than it can use.
        let watermark = self
            .demand
            .rate
            .urgency()
            .saturating_mul(horizon_ms)
            .div_ceil(per_ms)
            .min(self.config.chunk_tokens.max(1));
        let available = self.available_tokens(now_ms);
        if available >= self.renewal.wanted_for_request_tokens {
            // What a waiting request needed is held now.
            self.renewal.wanted_for_request_tokens = 0;
        }
        if available >= watermark
            && !self.leases.none_live()
            && self.renewal.wanted_for_request_tokens == 0
        {
            return None;
        }
        let want = self
            .demand
            .rate
            .sizing()
            .saturating_mul(self.config.lease_ttl_ms)
            .div_ceil(per_ms)
            .max(self.renewal.wanted_for_request_tokens);
        Some(want.clamp(1, self.config.chunk_tokens.max(1)))
    }

    /// Marks a renewal as started at `now_ms` (single flight per pool).
    pub fn begin_renewal(&mut self, now_ms: u64) {
        self.renewal.in_flight = true;
        self.renewal.started_at_ms = now_ms;
    }

    /// Whether a renewal is in flight.
    pub fn renewal_in_flight(&self) -> bool {
        self.renewal.in_flight
    }

    /// Marks the renewal as finished (with or without a grant).
    pub fn end_renewal(&mut self) {
        self.renewal.in_flight = false;
        // Meaningful only while a renewal is in flight.
        self.renewal.started_at_ms = 0;
    }

    /// The lease id to ask the next renewal with at `now_ms`: the id of a renewal whose answer was
    /// lost, if any (idempotent by lease id, the allocator answers it with what it granted then),
    /// else `fresh`. A lost id is given up once the allocator may have forgotten its grant
    /// ([`lost_answer_recoverable_until_ms`]): asked again then, it could be granted twice, once
    /// in each window. What it may have granted is never spent (the ledger counts it unreported).
    pub fn renewal_lease_id(&mut self, fresh: LeaseId, now_ms: u64) -> LeaseId {
        if let Some(lost) = self.renewal.unanswered_lease
            && now_ms >= lost_answer_recoverable_until_ms(&self.config.window, lost)
        {
            self.renewal.unanswered_lease = None;
        }
        self.renewal.unanswered_lease.unwrap_or(fresh)
    }

    /// Records how the renewal asked with `lease_id` failed: `ambiguous` (no answer: the allocator
    /// may have granted) keeps the id for the next renewal; a refusal forgets it.
    pub fn renewal_failed(&mut self, lease_id: LeaseId, ambiguous: bool) {
        self.renewal.unanswered_lease = ambiguous.then_some(lease_id);
    }

    /// Whether forgetting this holder loses nothing: no lease held or owed a final report, no
    /// renewal in flight, every fallback admit reported and none counted in the current window
    /// (forgetting that count would re-open the window's allowance), and no demand for `idle_ms`.
    pub fn is_idle(&mut self, now_ms: u64, idle_ms: u64) -> bool {
        self.expire(now_ms);
        let current = self.config.window.containing(now_ms).start_ms;
        self.demand.quiet_for(now_ms, idle_ms)
            && self.reserved_tokens == 0
            && !self.renewal.in_flight
            && self.leases.is_empty()
            && self.debt_tokens == 0
            && self.fallback.idle(current)
    }

    /// Tokens stranded so far (granted to this agent, unspent at the lease's end).
    pub fn stranded_tokens(&self) -> u64 {
        self.stranded_tokens
    }

    /// Report lines dropped because the allocator stayed unreachable past the bounds.
    pub fn dropped_reports(&self) -> u64 {
        self.dropped_reports
    }

    /// The window start (epoch ms) of a lease this holder still knows (live or awaiting its final
    /// report).
    pub fn lease_window_start_ms(&self, lease_id: LeaseId) -> Option<u64> {
        self.leases.window_start_ms(lease_id)
    }

    /// The highest allocator epoch seen.
    pub fn highest_epoch(&self) -> Epoch {
        self.leases.highest_epoch()
    }
}
