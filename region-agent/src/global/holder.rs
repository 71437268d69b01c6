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

use std::collections::BTreeMap;

use allot_shared::ids::{Epoch, LeaseId};
use allot_shared::window::{Window, WindowSpec};
use allot_shared::wire::GrantAnswer;

/// How long past the end of its window the allocator keeps a grant's record at the least, ms:
/// a window, and never less than two of its ledger rounds and an election (over a minute,
/// `allot_allocator::grants::record_min_lifetime_ms`). A lost answer is recovered from it.
pub const GRANT_RECORD_KEPT_MIN_MS: u64 = 60_000;
/// What the agent's clock may be off the allocator's when it judges whether a grant's record is
/// still kept, ms (the most `--clock-margin-ms` allows).
pub const GRANT_RECORD_CLOCK_ALLOWANCE_MS: u64 = 10_000;

/// Until when a renewal asked with `lease` (made on this agent's clock) can still be asked again
/// for its lost answer: while the allocator surely keeps the record of any grant it committed
/// for it. A grant is committed after the id was made, so in its window or a later one, and its
/// record is kept a window, and at least [`GRANT_RECORD_KEPT_MIN_MS`], past that window's end.
pub fn lost_answer_recoverable_until_ms(window: &WindowSpec, lease: LeaseId) -> u64 {
    let made_in = window.containing(lease.unix_ms());
    made_in
        .end_ms
        .saturating_add(made_in.length_ms().max(GRANT_RECORD_KEPT_MIN_MS))
        .saturating_sub(GRANT_RECORD_CLOCK_ALLOWANCE_MS)
}

/// Leases held at once per pool (the current one and a prefetched renewal, with room to spare).
pub const MAX_LIVE_LEASES: usize = 4;
/// Ended leases whose final report has not been acknowledged, kept per pool (I10). Past it the oldest
/// is dropped (counted; the ledger shows it as unreported).
pub const MAX_UNREPORTED_LEASES: usize = 1_024;
/// Windows of fallback admits kept until reported.
pub const MAX_FALLBACK_WINDOWS: usize = 64;
/// Demand is measured in buckets of this many ms.
const RATE_BUCKET_MS: u64 = 1_000;
/// The spend rate is kept in 1/1024 tokens per second, for precision in integers: a pool spending a
/// token every few seconds must not be sized as if it spent one every second (with a long lease
/// TTL that over-asks by the TTL in seconds, and strands it).
const RATE_SCALE: u64 = 1_024;

/// What the holder needs to know about its pool (from the last pool configuration the agent saw).
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HolderConfig {
    /// How the pool's windows are cut.
    pub window: WindowSpec,
    /// Largest grant the pool gives, tokens: the most a renewal asks for.
    pub chunk_tokens: u64,
    /// Lease TTL before clamping, ms: how long a renewal should last at the current rate.
    pub lease_ttl_ms: u64,
    /// Tokens this region may admit per window while the allocator is unreachable; 0 fails closed.
    pub fallback_per_region_tokens: u64,
    /// Tokens are never spent within this many ms of a lease's end (clock-rate error between the
    /// agent and the allocator).
    pub expiry_margin_ms: u64,
    /// The most the agent's clock may be off the allocator's, ms. Fallback windows are cut on the
    /// agent's clock: no fallback is reserved within this long of a window's start, nor within
    /// this plus `expiry_margin_ms` of its end ([`PoolHolder::fallback_span`]), so a fallback admit
    /// lands in the same window on the allocator's clock as on the agent's. 0: clocks agree.
    pub clock_margin_ms: u64,
    /// The allocator round trip the agent assumes, ms: sizes the renewal watermark, and no lease is
    /// asked for (or waited for) within `expiry_margin_ms + round_trip_ms` of a window's end.
    pub round_trip_ms: u64,
    /// A renewal unanswered for this long, ms, counts as an unreachable allocator: with nothing
    /// held, requests are admitted from the fallback allowance until an answer (or the call's
    /// failure) arrives, so a blackholed allocator costs at most this long without quota. 0: only
    /// a failed call counts.
    pub renewal_patience_ms: u64,
    /// With a state directory, fallback tokens are admitted only within a durable *claim*: the
    /// agent writes (and syncs) a claim of this many tokens more before it admits beyond the last
    /// one, so a crashed and restarted agent starts its count at what was claimed and never
    /// re-opens the window's allowance. 0: no claims (nothing survives a restart but the ledger's
    /// count).
    pub fallback_claim_block_tokens: u64,
    /// Debt this holder may carry from metered requests settled above their estimate, tokens
    /// (this agent's share of the pool's `settleDebtPerRegion`); beyond it, extra cost is written
    /// off. 0: what the leases cannot pay at once is written off.
    pub settle_debt_tokens: u64,
}

/// How a settled metered request's extra cost was taken ([`PoolHolder::charge`]), tokens.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct DebtCharge {
    /// Spent at once from held leases.
    pub paid_tokens: u64,
    /// Added to the holder's debt: paid first from the next tokens held.
    pub owed_tokens: u64,
    /// Beyond the debt the holder may carry: never charged.
    pub written_off_tokens: u64,
}

/// A grant as the allocator answered it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct LeaseGrant {
    /// The lease id the agent asked with.
    pub lease_id: LeaseId,
    /// The granting allocator's epoch.
    pub epoch: Epoch,
    /// Tokens granted (0 when the pool is exhausted).
    pub granted_tokens: u64,
    /// The window the tokens belong to.
    pub window: Window,
    /// No token may be spent at or after this instant, epoch ms.
    pub expires_at_ms: u64,
    /// With nothing granted: ms until the pool refills (the next window).
    pub retry_after_ms: u64,
}

impl LeaseGrant {
    /// The grant an allocator's answer makes, on the agent's clock: the agent asked at
    /// `asked_at_ms` (its clock) and the lease lasts what was left of it when the allocator answered
    /// ([`on_agent_clock`](Self::on_agent_clock)).
    pub fn from_answer(answer: &GrantAnswer, asked_at_ms: u64) -> Self {
        Self {
            lease_id: answer.lease_id,
            epoch: answer.epoch,
            granted_tokens: answer.granted_tokens,
            window: Window {
                start_ms: answer.window_start_ms,
                end_ms: answer.window_end_ms,
            },
            expires_at_ms: answer.expires_at_ms,
            retry_after_ms: answer.retry_after_ms,
        }
        .on_agent_clock(answer.answered_at_ms(), asked_at_ms)
    }

    /// The grant with its end moved onto the agent's clock: what is left of the lease when the
    /// allocator answered (`expires_at_ms - answered_at_ms`, the allocator's own measure) counts
    /// from `asked_at_ms`, when the agent asked, on the agent's clock. The answer was made after
    /// the agent asked, so the lease ends on the agent's clock no later than on the allocator's,
    /// whatever the offset between the two clocks: only their rates must agree, within the expiry
    /// margin over a lease. A lease id asked again after a lost answer gets the original grant
    /// back, answered later than it was issued: it is timed from the second ask, with what was
    /// left of it then. `answered_at_ms` 0 (an allocator that does not say) leaves the grant as it
    /// is.
    pub fn on_agent_clock(self, answered_at_ms: u64, asked_at_ms: u64) -> Self {
        if answered_at_ms == 0 {
            return self;
        }
        let left_ms = self.expires_at_ms.saturating_sub(answered_at_ms);
        Self {
            expires_at_ms: asked_at_ms.saturating_add(left_ms),
            ..self
        }
    }
}

/// A lease this agent holds.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HeldLease {
    /// The grant.
    pub grant: LeaseGrant,
    /// Tokens spent from it.
    pub spent_tokens: u64,
    /// Tokens reserved for requests being decided (neither spendable nor spent).
    pub reserved_tokens: u64,
    /// Tokens of sub-leases that ended unspent ([`PoolHolder::withhold`]): a gateway may have
    /// admitted them unreported, so they are never spendable again (stranded).
    pub withheld_tokens: u64,
    reported_spent_tokens: u64,
}

impl HeldLease {
    fn remaining_tokens(&self) -> u64 {
        self.grant.granted_tokens - self.spent_tokens - self.reserved_tokens - self.withheld_tokens
    }

    /// The last instant (exclusive) at which a token may be spent.
    fn usable_until_ms(&self, margin_ms: u64) -> u64 {
        self.grant.expires_at_ms.saturating_sub(margin_ms)
    }
}

/// What became of a grant.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GrantVerdict {
    /// Held and spendable.
    Accepted,
    /// Nothing was granted: the pool is exhausted until this instant.
    Exhausted {
        /// Epoch ms.
        until_ms: u64,
    },
    /// From an epoch below the highest seen: ignored (and to be logged).
    StaleEpoch {
        /// The highest epoch seen.
        highest: Epoch,
    },
    /// Already past its usable end on arrival: never spent; reported final with nothing spent, so
    /// the ledger counts its tokens as stranded (not as unreported).
    AlreadyExpired,
    /// The same lease id is already held.
    Duplicate,
}

/// Why a request was not admitted.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Denial {
    /// The allocator said the pool is exhausted.
    PoolExhausted,
    /// The allocator is unreachable and this window's fallback allowance is spent.
    FallbackSpent,
    /// The allocator is unreachable and the pool has no fallback allowance (fails closed).
    FailClosed,
    /// The allocator is reachable but no lease is held yet: renew and try again.
    AwaitingGrant,
    /// No lease is held and the window ends within the expiry margin plus a round trip: a lease
    /// asked for now would end before it could be spent. The pool refills when the window ends.
    WindowEnding,
    /// The request costs more than one chunk, the most a lease of this pool can hold: it can never
    /// be admitted from leases.
    CostAboveChunk,
    /// The fallback allowance has room, but beyond what is durably claimed
    /// ([`HolderConfig::fallback_claim_block_tokens`]): claim more
    /// ([`PoolHolder::fallback_claim_wanted`]), then reserve again.
    FallbackUnclaimed,
    /// The allocator is unreachable and the agent's clock is within the clock margin of a window's
    /// edge, where it cannot tell which window the allocator's clock is in: no fallback until the
    /// retry hint (the edge zone's end).
    FallbackAtWindowEdge,
}

/// A request the holder could not reserve for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Refusal {
    /// Why.
    pub denial: Denial,
    /// When to retry, ms (`u64::MAX`: never, for [`Denial::CostAboveChunk`]).
    pub retry_after_ms: u64,
}

/// Where a reservation's tokens come from: up to [`MAX_LIVE_LEASES`] leases (the first-ending
/// first), or one window's fallback allowance.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum ReservedFrom {
    Leases {
        parts: [(LeaseId, u64); MAX_LIVE_LEASES],
        len: usize,
    },
    Fallback {
        window_start_ms: u64,
    },
}

/// Tokens held back for one request while its other rules are decided. Settle it with
/// [`PoolHolder::commit`] (admitted) or [`PoolHolder::cancel`] (denied) on the holder that made it:
/// both take it by value, and it is neither `Clone` nor `Copy`, so it is settled once.
#[derive(Debug, PartialEq, Eq)]
#[must_use = "a reservation must be committed or cancelled"]
pub struct Reservation {
    from: ReservedFrom,
    cost_tokens: u64,
    /// When it was made: the demand it recorded belongs to the rate bucket of this instant.
    reserved_at_ms: u64,
    /// Whether it counts as demand (a cancel takes that back); a sub-lease's does not.
    demand_counted: bool,
}

impl Reservation {
    /// Whether the tokens come from the fallback allowance (the allocator is unreachable).
    pub fn is_fallback(&self) -> bool {
        matches!(self.from, ReservedFrom::Fallback { .. })
    }

    /// Tokens reserved.
    pub fn tokens(&self) -> u64 {
        self.cost_tokens
    }

    /// The start of the fallback window it holds tokens of (`None` from leases).
    pub fn fallback_window_start_ms(&self) -> Option<u64> {
        match self.from {
            ReservedFrom::Fallback { window_start_ms } => Some(window_start_ms),
            ReservedFrom::Leases { .. } => None,
        }
    }

    /// The leases it holds tokens of, and how many of each (empty in fallback).
    pub fn lease_parts(&self) -> &[(LeaseId, u64)] {
        match &self.from {
            ReservedFrom::Leases { parts, len } => &parts[..*len],
            ReservedFrom::Fallback { .. } => &[],
        }
    }
}

/// The outcome of spending.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Spend {
    /// Admitted from this lease.
    Leased(LeaseId),
    /// Admitted from the fallback allowance of the window starting at this instant.
    Fallback {
        /// The window's start, epoch ms.
        window_start_ms: u64,
    },
    /// Not admitted.
    Denied {
        /// Why.
        denial: Denial,
        /// When to retry, ms.
        retry_after_ms: u64,
    },
}

/// One lease's line in a report.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeaseLine {
    /// The lease.
    pub lease_id: LeaseId,
    /// Its window's start, epoch ms.
    pub window_start_ms: u64,
    /// Tokens spent so far (cumulative).
    pub spent_tokens: u64,
    /// The lease has ended: this is its final line.
    pub final_line: bool,
}

/// One window's fallback admits in a report (cumulative).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct FallbackLine {
    /// The window's start, epoch ms.
    pub window_start_ms: u64,
    /// Tokens admitted in fallback so far in that window.
    pub admitted_tokens: u64,
}

/// What the holder owes the ledger since the last acknowledged report.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PendingReport {
    /// Leases whose spend changed, and ended leases not yet reported final.
    pub leases: Vec<LeaseLine>,
    /// Windows whose fallback admits changed.
    pub fallback: Vec<FallbackLine>,
}

impl PendingReport {
    /// Whether there is nothing to report.
    pub fn is_empty(&self) -> bool {
        self.leases.is_empty() && self.fallback.is_empty()
    }
}

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
struct FallbackCount {
    admitted_tokens: u64,
    reserved_tokens: u64,
    reported_tokens: u64,
    /// Allowance an earlier incarnation of this agent may have admitted without the journal
    /// showing it (it claimed it durably): counted as used, never reported.
    unknown_tokens: u64,
    /// Allowance counted as used because an earlier run of the agent ended uncleanly and left no
    /// journal (the allocator keeps that fact for every later run: this run owes no report of it).
    presumed_tokens: u64,
    /// Durably claimed for this window (with claims on): admits + reservations + unknown stay
    /// within it.
    claimed_tokens: u64,
}

impl FallbackCount {
    /// Allowance taken: admitted, reserved, or possibly admitted before a restart.
    fn used_tokens(&self) -> u64 {
        self.admitted_tokens + self.reserved_tokens + self.unknown_tokens + self.presumed_tokens
    }
}

/// What a holder must not lose in a crash, for a journal: the leases it holds or owes a final
/// report (a restarted agent reports them final with the spend journaled), and each window's
/// fallback admits and durable claims.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct HolderSnapshot {
    /// Leases live or ended and not yet acknowledged final.
    pub leases: Vec<JournaledLease>,
    /// Windows with fallback admits or claims.
    pub fallback: Vec<JournaledFallback>,
    /// Debt owed by settled metered requests, tokens.
    #[serde(default, skip_serializing_if = "allot_shared::wire::is_zero")]
    pub debt_tokens: u64,
}

/// One lease in a [`HolderSnapshot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JournaledLease {
    /// The lease.
    pub lease_id: LeaseId,
    /// Its epoch.
    pub epoch: Epoch,
    /// Its window.
    pub window_start_ms: u64,
    /// Its window's end.
    pub window_end_ms: u64,
    /// Tokens granted.
    pub granted_tokens: u64,
    /// Tokens spent (committed) when the snapshot was taken.
    pub spent_tokens: u64,
}

/// One window's fallback in a [`HolderSnapshot`].
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "camelCase", deny_unknown_fields)]
pub struct JournaledFallback {
    /// The window's start, epoch ms.
    pub window_start_ms: u64,
    /// Admitted (committed) when the snapshot was taken, including what a previous incarnation
    /// journaled.
    pub admitted_tokens: u64,
    /// Used, admitted or not, as far as any incarnation knows: admitted plus what a previous
    /// incarnation claimed but did not journal as admitted.
    pub used_tokens: u64,
    /// Durably claimed (0 without claims).
    pub claimed_tokens: u64,
    /// Counted as used because an earlier run may have admitted it unreported (apart from
    /// `usedTokens`: it never needs reporting, so it does not keep a run from ending cleanly).
    #[serde(default, skip_serializing_if = "is_zero")]
    pub presumed_tokens: u64,
}

fn is_zero(tokens: &u64) -> bool {
    *tokens == 0
}

/// Demand, as two integer EWMAs over one-second buckets: a fast one (alpha 1/4) that says how soon
/// what is held runs out, and a slow one that sizes leases.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
struct SpendRate {
    bucket_start_ms: u64,
    bucket_tokens: u64,
    /// Tokens per second x [`RATE_SCALE`] (alpha 1/4: follows demand within seconds).
    scaled_per_s: u64,
    /// The same, averaged over about one lease TTL, at most a minute (alpha 1/`slow_buckets`):
    /// steady enough to size a lease even when tokens are seconds apart. (Longer spans strand less
    /// but follow a demand rise so slowly that leases come out small and renewals double: measured
    /// with the 24-hour drill, docs/drills.md.)
    slow_scaled_per_s: u64,
    /// Buckets the slow average spans: the lease TTL in seconds, 4 to 64.
    slow_buckets: u64,
}

/// Buckets the slow demand average spans for a lease TTL: the TTL in seconds, 4 to 64.
fn slow_buckets(lease_ttl_ms: u64) -> u64 {
    (lease_ttl_ms / RATE_BUCKET_MS).clamp(4, 64)
}

/// Most buckets one roll decays (a quiet spell longer than this leaves both averages near zero).
const MAX_ROLLED_BUCKETS: u32 = 1_024;

impl SpendRate {
    fn new(lease_ttl_ms: u64) -> Self {
        Self {
            bucket_start_ms: 0,
            bucket_tokens: 0,
            scaled_per_s: 0,
            slow_scaled_per_s: 0,
            slow_buckets: slow_buckets(lease_ttl_ms),
        }
    }

    fn roll(&mut self, now_ms: u64) {
        if now_ms < self.bucket_start_ms + RATE_BUCKET_MS {
            return;
        }
        let n = self.slow_buckets;
        for _ in 0..MAX_ROLLED_BUCKETS {
            if now_ms < self.bucket_start_ms + RATE_BUCKET_MS {
                return;
            }
            let bucket = self.bucket_tokens.saturating_mul(RATE_SCALE);
            self.scaled_per_s = (self.scaled_per_s * 3 + bucket) / 4;
            self.slow_scaled_per_s = (self.slow_scaled_per_s.saturating_mul(n - 1) + bucket) / n;
            self.bucket_tokens = 0;
            self.bucket_start_ms += RATE_BUCKET_MS;
            if self.scaled_per_s == 0 && self.slow_scaled_per_s == 0 {
                break;
            }
        }
        self.bucket_start_ms = now_ms - now_ms % RATE_BUCKET_MS;
    }

    fn record(&mut self, now_ms: u64, tokens: u64) {
        self.roll(now_ms);
        self.bucket_tokens = self.bucket_tokens.saturating_add(tokens);
    }

    /// Takes back demand recorded at `recorded_at_ms` that turned out not to be the pool's (a
    /// request another rule denied), if its bucket is still open.
    fn unrecord(&mut self, recorded_at_ms: u64, tokens: u64) {
        if recorded_at_ms >= self.bucket_start_ms {
            self.bucket_tokens = self.bucket_tokens.saturating_sub(tokens);
        }
    }

    /// Tokens per second x [`RATE_SCALE`], at least 1, as if the bucket in progress closed now: how
    /// soon what is held runs out (a burst counts at once). Sets the renewal watermark.
    fn urgency(&self) -> u64 {
        let with_bucket = (self.scaled_per_s.saturating_mul(3)
            + self.bucket_tokens.saturating_mul(RATE_SCALE))
            / 4;
        with_bucket.max(self.scaled_per_s).max(1)
    }

    /// Tokens per second x [`RATE_SCALE`], at least 1, over closed buckets only: what a lease should
    /// hold. Renewals are asked right after a spend, so counting the bucket in progress would size
    /// every lease of a sparse pool as if a token a second were spent (and strand the excess);
    /// with no closed bucket yet, the bucket in progress is all there is.
    fn sizing(&self) -> u64 {
        if self.scaled_per_s == 0 {
            return self.urgency();
        }
        // A demand rise shows in the fast average first: follow it up at once, down slowly.
        self.slow_scaled_per_s
            .max(self.scaled_per_s.min(self.slow_scaled_per_s * 2))
            .max(1)
    }
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

/// The holder of one pool.
///
/// Two holders are equal when they decide alike: equality and hashing leave out the counters
/// kept only for metrics (stranded tokens, dropped reports), so the model checker does not tell
/// apart states that differ only in their history.
#[derive(Debug, Clone)]
pub struct PoolHolder {
    config: HolderConfig,
    live: Vec<HeldLease>,
    ended: Vec<HeldLease>,
    highest_epoch: Epoch,
    exhausted_until_ms: u64,
    fallback: BTreeMap<u64, FallbackCount>,
    rate: SpendRate,
    last_demand_ms: Option<u64>,
    renewal_in_flight: bool,
    /// When the renewal in flight was asked, epoch ms.
    renewal_started_at_ms: u64,
    /// The largest request cost that found too little held since the last grant: the next renewal
    /// asks for at least this (within the chunk), so a request above the usual lease size is
    /// satisfiable instead of waiting for ever.
    wanted_for_request_tokens: u64,
    /// Tokens in outstanding reservations, leases and fallback together.
    reserved_tokens: u64,
    /// The lease id of a renewal whose answer never arrived: the allocator may have granted it, so
    /// the next renewal asks with the same id and gets that grant back instead of stranding it.
    unanswered_lease: Option<LeaseId>,
    dropped_reports: u64,
    stranded_tokens: u64,
    /// Tokens settled metered requests consumed that no lease has paid yet (at most
    /// `config.settle_debt_tokens`, but for a lowered limit): paid before anything is reserved.
    debt_tokens: u64,
}

impl PoolHolder {
    /// Everything that decides what the holder does next (all but the metrics counters). The
    /// exhaustive pattern makes a new field a compile error here until it is placed.
    #[allow(clippy::type_complexity)]
    fn deciding_state(
        &self,
    ) -> (
        (&HolderConfig, &[HeldLease], &[HeldLease], Epoch, u64),
        (
            &BTreeMap<u64, FallbackCount>,
            &SpendRate,
            Option<u64>,
            bool,
            u64,
        ),
        (u64, u64, Option<LeaseId>, u64),
    ) {
        let Self {
            config,
            live,
            ended,
            highest_epoch,
            exhausted_until_ms,
            fallback,
            rate,
            last_demand_ms,
            renewal_in_flight,
            renewal_started_at_ms,
            wanted_for_request_tokens,
            reserved_tokens,
            unanswered_lease,
            dropped_reports: _,
            stranded_tokens: _,
            debt_tokens,
        } = self;
        (
            (config, live, ended, *highest_epoch, *exhausted_until_ms),
            (
                fallback,
                rate,
                *last_demand_ms,
                *renewal_in_flight,
                *renewal_started_at_ms,
            ),
            (
                *wanted_for_request_tokens,
                *reserved_tokens,
                *unanswered_lease,
                *debt_tokens,
            ),
        )
    }

    /// An empty holder.
    pub fn new(config: HolderConfig) -> Self {
        let rate = SpendRate::new(config.lease_ttl_ms);
        Self {
            config,
            live: Vec::new(),
            ended: Vec::new(),
            highest_epoch: Epoch(0),
            exhausted_until_ms: 0,
            fallback: BTreeMap::new(),
            rate,
            last_demand_ms: None,
            renewal_in_flight: false,
            renewal_started_at_ms: 0,
            wanted_for_request_tokens: 0,
            reserved_tokens: 0,
            unanswered_lease: None,
            dropped_reports: 0,
            stranded_tokens: 0,
            debt_tokens: 0,
        }
    }

    /// Replaces the configuration (a pool update). Held leases are unaffected.
    pub fn reconfigure(&mut self, config: HolderConfig) {
        self.rate.slow_buckets = slow_buckets(config.lease_ttl_ms);
        self.config = config;
    }

    /// The pool's terms changed (an operator raised or lowered its limit, say): a window the
    /// allocator said was spent may have tokens again, so the next request asks for them instead
    /// of waiting for the window's end.
    pub fn forget_exhaustion(&mut self) {
        self.exhausted_until_ms = 0;
    }

    /// The configuration in force.
    pub fn config(&self) -> &HolderConfig {
        &self.config
    }

    /// Moves leases past their usable end to the ended list; their unspent tokens are stranded.
    fn expire(&mut self, now_ms: u64) {
        let margin = self.config.expiry_margin_ms;
        // `live` is sorted by end (see `accept`): the ended leases are a prefix, and the common
        // case (none ended) allocates nothing.
        debug_assert!(
            self.live
                .windows(2)
                .all(|w| w[0].grant.expires_at_ms <= w[1].grant.expires_at_ms)
        );
        let ended = self
            .live
            .partition_point(|l| now_ms >= l.usable_until_ms(margin));
        for lease in self.live.drain(..ended) {
            self.stranded_tokens += lease.remaining_tokens();
            self.ended.push(lease);
        }
        if self.ended.len() > MAX_UNREPORTED_LEASES {
            let excess = self.ended.len() - MAX_UNREPORTED_LEASES;
            let before = self.ended.len();
            // The oldest go first; a lease with tokens still reserved stays until they settle.
            let mut dropped = 0;
            self.ended.retain(|lease| {
                let drop = dropped < excess && lease.reserved_tokens == 0;
                dropped += usize::from(drop);
                !drop
            });
            self.dropped_reports += (before - self.ended.len()) as u64;
        }
    }

    /// When the first live lease ends (its usable end, past which it is owed a final report
    /// line), epoch ms; `None` with none live.
    pub fn next_lease_end_ms(&self) -> Option<u64> {
        let margin = self.config.expiry_margin_ms;
        self.live.first().map(|lease| lease.usable_until_ms(margin))
    }

    /// Takes a grant from the allocator.
    pub fn accept(&mut self, grant: LeaseGrant, now_ms: u64) -> GrantVerdict {
        if self.unanswered_lease == Some(grant.lease_id) {
            self.unanswered_lease = None;
        }
        if grant.epoch < self.highest_epoch {
            return GrantVerdict::StaleEpoch {
                highest: self.highest_epoch,
            };
        }
        self.highest_epoch = grant.epoch;
        if grant.granted_tokens == 0 {
            // The pool refills at the next window at the latest.
            let until_ms = now_ms.saturating_add(grant.retry_after_ms.max(1));
            self.exhausted_until_ms = self.exhausted_until_ms.max(until_ms);
            return GrantVerdict::Exhausted { until_ms };
        }
        let held = self
            .live
            .iter()
            .chain(&self.ended)
            .any(|l| l.grant.lease_id == grant.lease_id);
        if held {
            return GrantVerdict::Duplicate;
        }
        let lease = HeldLease {
            grant,
            spent_tokens: 0,
            reserved_tokens: 0,
            withheld_tokens: 0,
            reported_spent_tokens: 0,
        };
        if now_ms >= lease.usable_until_ms(self.config.expiry_margin_ms) {
            // Answered too late to spend (a lost answer asked again after a failover longer than
            // the TTL): never spent, but granted, so it owes the ledger a final line like any
            // ended lease, or the ledger would count its tokens as unreported.
            self.stranded_tokens += grant.granted_tokens;
            self.ended.push(lease);
            return GrantVerdict::AlreadyExpired;
        }
        self.exhausted_until_ms = 0;
        self.expire(now_ms);
        if self.live.len() >= MAX_LIVE_LEASES {
            // Hold at most a few leases: the oldest one ends early (its rest is stranded).
            let oldest = self.live.remove(0);
            self.stranded_tokens += oldest.remaining_tokens();
            self.ended.push(oldest);
        }
        if grant.granted_tokens >= self.wanted_for_request_tokens {
            self.wanted_for_request_tokens = 0;
        }
        self.live.push(lease);
        // Spend the lease that ends first first.
        self.live.sort_by_key(|l| l.grant.expires_at_ms);
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
        let patience_ms = self.config.renewal_patience_ms;
        self.renewal_in_flight
            && patience_ms > 0
            && now_ms.saturating_sub(self.renewal_started_at_ms) >= patience_ms
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
        self.last_demand_ms = Some(now_ms);
        self.rate.record(now_ms, cost_tokens);
        if let Some(reservation) = self.reserve_from_leases(cost_tokens, now_ms) {
            return Ok(reservation);
        }
        if self.exhausted_until_ms > now_ms {
            return Err(Refusal {
                denial: Denial::PoolExhausted,
                retry_after_ms: self.exhausted_until_ms - now_ms,
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
            self.wanted_for_request_tokens = self.wanted_for_request_tokens.max(cost_tokens);
            return Err(Refusal {
                denial: Denial::AwaitingGrant,
                retry_after_ms: 1,
            });
        }
        self.reserve_from_fallback(cost_tokens, now_ms, window, until_window_end_ms)
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
        self.last_demand_ms = Some(now_ms);
        self.rate.record(now_ms, extra_tokens);
        let paid_tokens = if self.debt_tokens == 0 {
            self.spend_from_live(extra_tokens, now_ms)
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
            self.wanted_for_request_tokens = self
                .wanted_for_request_tokens
                .max(self.debt_tokens.min(self.config.chunk_tokens.max(1)));
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
            let paid = self.spend_from_live(self.debt_tokens, now_ms);
            self.debt_tokens -= paid;
        }
    }

    /// Spends up to `tokens` from live leases, first-ending first, at once. Returns how many.
    fn spend_from_live(&mut self, tokens: u64, now_ms: u64) -> u64 {
        let margin = self.config.expiry_margin_ms;
        let mut left = tokens;
        for lease in &mut self.live {
            if left == 0 {
                break;
            }
            if now_ms >= lease.usable_until_ms(margin) {
                continue;
            }
            let take = left.min(lease.remaining_tokens());
            lease.spent_tokens += take;
            debug_assert!(
                lease.spent_tokens + lease.reserved_tokens + lease.withheld_tokens
                    <= lease.grant.granted_tokens
            );
            left -= take;
        }
        tokens - left
    }

    fn reserve_from_leases(&mut self, cost_tokens: u64, now_ms: u64) -> Option<Reservation> {
        let margin = self.config.expiry_margin_ms;
        // After `expire`, every live lease is usable now.
        let held: u64 = self.live.iter().map(HeldLease::remaining_tokens).sum();
        if held < cost_tokens {
            return None;
        }
        // Unused places repeat the first lease with 0 tokens; `len` says how many are parts.
        let first = self.live.first()?.grant.lease_id;
        let mut parts = [(first, 0); MAX_LIVE_LEASES];
        let mut len = 0;
        let mut left = cost_tokens;
        for lease in &mut self.live {
            let take = left.min(lease.remaining_tokens());
            if take == 0 {
                continue;
            }
            debug_assert!(
                now_ms < lease.usable_until_ms(margin),
                "no reservation at or after a lease's end"
            );
            lease.reserved_tokens += take;
            debug_assert!(lease.spent_tokens + lease.reserved_tokens <= lease.grant.granted_tokens);
            parts[len] = (lease.grant.lease_id, take);
            len += 1;
            left -= take;
            if left == 0 {
                break;
            }
        }
        debug_assert_eq!(left, 0);
        self.reserved_tokens += cost_tokens;
        Some(Reservation {
            from: ReservedFrom::Leases { parts, len },
            cost_tokens,
            reserved_at_ms: now_ms,
            demand_counted: true,
        })
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
        let count = self.fallback.entry(window.start_ms).or_default();
        if count.used_tokens() + cost_tokens > allowance {
            return Err(Refusal {
                denial: Denial::FallbackSpent,
                retry_after_ms: until_window_end_ms,
            });
        }
        if claims && count.used_tokens() + cost_tokens > count.claimed_tokens {
            return Err(Refusal {
                denial: Denial::FallbackUnclaimed,
                retry_after_ms: 1,
            });
        }
        count.reserved_tokens += cost_tokens;
        debug_assert!(count.used_tokens() <= allowance);
        debug_assert!(!claims || count.used_tokens() <= count.claimed_tokens);
        if self.fallback.len() > MAX_FALLBACK_WINDOWS
            && let Some((&oldest, _)) = self.fallback.iter().find(|(_, c)| c.reserved_tokens == 0)
        {
            self.fallback.remove(&oldest);
            self.dropped_reports += 1;
        }
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

    /// Spends what `reservation` holds: the request was admitted. The tokens count as spent from
    /// their leases (or admitted in fallback in their window) whenever the commit comes; a lease
    /// that ended meanwhile reports them with its final line.
    pub fn commit(&mut self, reservation: Reservation) -> Spend {
        self.settle(&reservation);
        match reservation.from {
            ReservedFrom::Fallback { window_start_ms } => {
                let count = self.fallback.entry(window_start_ms).or_default();
                count.reserved_tokens = count
                    .reserved_tokens
                    .saturating_sub(reservation.cost_tokens);
                count.admitted_tokens += reservation.cost_tokens;
                debug_assert!(
                    count.admitted_tokens <= self.config.fallback_per_region_tokens,
                    "fallback admits stay within the allowance"
                );
                Spend::Fallback { window_start_ms }
            }
            ReservedFrom::Leases { parts, .. } => {
                for &(lease_id, tokens) in reservation.lease_parts() {
                    match self.lease_mut(lease_id) {
                        Some(lease) => {
                            debug_assert!(lease.reserved_tokens >= tokens);
                            lease.reserved_tokens -= tokens;
                            lease.spent_tokens += tokens;
                            debug_assert!(lease.spent_tokens <= lease.grant.granted_tokens);
                        }
                        // Only past MAX_UNREPORTED_LEASES ended leases, which keeps those with
                        // reservations: counted, never silent.
                        None => self.dropped_reports += 1,
                    }
                }
                Spend::Leased(parts[0].0)
            }
        }
    }

    /// Takes back the demand a refused reservation recorded (at `reserved_at_ms`): a dry run's
    /// refusal must not size the next renewal as if it were traffic.
    pub fn withdraw_demand(&mut self, reserved_at_ms: u64, cost_tokens: u64) {
        self.rate.unrecord(reserved_at_ms, cost_tokens.max(1));
    }

    /// Gives back what `reservation` holds: the request was denied by another rule (or not
    /// decided). Tokens go back to their lease while it lives (an ended lease strands them, as
    /// it strands the rest of what it held) or to their window's fallback allowance; the demand
    /// they stood for is taken back.
    pub fn cancel(&mut self, reservation: Reservation) {
        self.settle(&reservation);
        if reservation.demand_counted {
            self.rate
                .unrecord(reservation.reserved_at_ms, reservation.cost_tokens);
        }
        match reservation.from {
            ReservedFrom::Fallback { window_start_ms } => {
                if let Some(count) = self.fallback.get_mut(&window_start_ms) {
                    count.reserved_tokens = count
                        .reserved_tokens
                        .saturating_sub(reservation.cost_tokens);
                }
            }
            ReservedFrom::Leases { .. } => {
                for &(lease_id, tokens) in reservation.lease_parts() {
                    if let Some(lease) = self.live.iter_mut().find(|l| l.grant.lease_id == lease_id)
                    {
                        debug_assert!(lease.reserved_tokens >= tokens);
                        lease.reserved_tokens -= tokens;
                    } else if let Some(lease) =
                        self.ended.iter_mut().find(|l| l.grant.lease_id == lease_id)
                    {
                        debug_assert!(lease.reserved_tokens >= tokens);
                        lease.reserved_tokens -= tokens;
                        self.stranded_tokens += tokens;
                    }
                }
            }
        }
    }

    /// Spends `tokens` of a reservation that stays open (a gateway's sub-lease reporting what it
    /// admitted at `now_ms`, counted as demand then): from its leases first-ending first, or
    /// admitted in its fallback window. Returns how many were drawn (at most what it still holds).
    pub fn draw(&mut self, reservation: &mut Reservation, tokens: u64, now_ms: u64) -> u64 {
        let drawn = tokens.min(reservation.cost_tokens);
        if drawn == 0 {
            return 0;
        }
        reservation.cost_tokens -= drawn;
        self.reserved_tokens = self.reserved_tokens.saturating_sub(drawn);
        self.note_demand(now_ms, drawn);
        match &mut reservation.from {
            ReservedFrom::Fallback { window_start_ms } => {
                let count = self.fallback.entry(*window_start_ms).or_default();
                count.reserved_tokens = count.reserved_tokens.saturating_sub(drawn);
                count.admitted_tokens += drawn;
                debug_assert!(count.used_tokens() <= self.config.fallback_per_region_tokens);
            }
            ReservedFrom::Leases { parts, len } => {
                let mut left = drawn;
                for part in parts[..*len].iter_mut() {
                    let take = left.min(part.1);
                    if take == 0 {
                        continue;
                    }
                    part.1 -= take;
                    left -= take;
                    match self
                        .live
                        .iter_mut()
                        .chain(self.ended.iter_mut())
                        .find(|l| l.grant.lease_id == part.0)
                    {
                        Some(lease) => {
                            debug_assert!(lease.reserved_tokens >= take);
                            lease.reserved_tokens -= take;
                            lease.spent_tokens += take;
                            debug_assert!(
                                lease.spent_tokens + lease.reserved_tokens + lease.withheld_tokens
                                    <= lease.grant.granted_tokens
                            );
                        }
                        None => self.dropped_reports += 1,
                    }
                    if left == 0 {
                        break;
                    }
                }
            }
        }
        drawn
    }

    /// [`reserve`](Self::reserve) for a sub-lease: the same, but the reservation is not counted
    /// as demand (a gateway's assignment holds more than it will spend soon; its gateway's reported
    /// use is counted instead, with [`note_demand`](Self::note_demand) and
    /// [`draw`](Self::draw)).
    pub fn reserve_for_sublease(
        &mut self,
        cost_tokens: u64,
        now_ms: u64,
        allocator_reachable: bool,
    ) -> Result<Reservation, Refusal> {
        let reserved = self.reserve(cost_tokens, now_ms, allocator_reachable);
        if !matches!(
            reserved,
            Err(Refusal {
                denial: Denial::CostAboveChunk,
                ..
            })
        ) {
            self.rate.unrecord(now_ms, cost_tokens.max(1));
        }
        reserved.map(|mut reservation| {
            // Cancelling must not take the demand back a second time.
            reservation.demand_counted = false;
            reservation
        })
    }

    /// Counts `tokens` of demand at `now_ms` that no reservation stands for (requests a gateway
    /// denied on its own, for lack of assignment), so renewals are sized for it.
    pub fn note_demand(&mut self, now_ms: u64, tokens: u64) {
        if tokens > 0 {
            self.last_demand_ms = Some(now_ms);
            self.rate.record(now_ms, tokens);
        }
    }

    /// Gives back `tokens` of a reservation that stays open (a sub-lease cut short before its
    /// gateway could spend them): to their lease while it lives (an ended one strands them), or
    /// to their window's fallback allowance; the last-ending lease's part first. Returns how many
    /// were given back (at most what it holds).
    pub fn give_back(&mut self, reservation: &mut Reservation, tokens: u64) -> u64 {
        let given = tokens.min(reservation.cost_tokens);
        if given == 0 {
            return 0;
        }
        reservation.cost_tokens -= given;
        self.reserved_tokens = self.reserved_tokens.saturating_sub(given);
        match &mut reservation.from {
            ReservedFrom::Fallback { window_start_ms } => {
                if let Some(count) = self.fallback.get_mut(window_start_ms) {
                    count.reserved_tokens = count.reserved_tokens.saturating_sub(given);
                }
            }
            ReservedFrom::Leases { parts, len } => {
                let mut left = given;
                for part in parts[..*len].iter_mut().rev() {
                    let take = left.min(part.1);
                    if take == 0 {
                        continue;
                    }
                    part.1 -= take;
                    left -= take;
                    if let Some(lease) = self.live.iter_mut().find(|l| l.grant.lease_id == part.0) {
                        debug_assert!(lease.reserved_tokens >= take);
                        lease.reserved_tokens -= take;
                    } else if let Some(lease) =
                        self.ended.iter_mut().find(|l| l.grant.lease_id == part.0)
                    {
                        debug_assert!(lease.reserved_tokens >= take);
                        lease.reserved_tokens -= take;
                        self.stranded_tokens += take;
                    }
                    if left == 0 {
                        break;
                    }
                }
            }
        }
        given
    }

    /// Tokens a reservation could take now: what the held leases have left, or, when none is
    /// held and the allocator is unreachable (or silent past the renewal patience), what is left
    /// of the window's fallback allowance (durable claims aside: [`reserve`](Self::reserve) says
    /// when one must be made first).
    pub fn spendable_tokens(&mut self, now_ms: u64, allocator_reachable: bool) -> u64 {
        self.expire(now_ms);
        let leased = self.available_tokens(now_ms);
        if leased > 0 || (allocator_reachable && !self.allocator_silent(now_ms)) {
            return leased;
        }
        let window = self.config.window.containing(now_ms);
        if !self.fallback_span(window).contains(&now_ms) {
            return 0;
        }
        let used = self
            .fallback
            .get(&window.start_ms)
            .map_or(0, FallbackCount::used_tokens);
        self.config.fallback_per_region_tokens.saturating_sub(used)
    }

    /// When, on the agent's clock, fallback may be reserved in `window` (start inclusive, end
    /// exclusive): the window less the clock margin at its start, and less the clock margin and
    /// the expiry margin (within which a reservation is committed) at its end. An agent whose
    /// clock is within the margin of the allocator's admits fallback only when both clocks are in
    /// `window`. Empty when the margins take the whole window (fallback then never applies).
    pub fn fallback_span(&self, window: Window) -> std::ops::Range<u64> {
        let clock_ms = self.config.clock_margin_ms;
        let start = window.start_ms.saturating_add(clock_ms);
        let end = window
            .end_ms
            .saturating_sub(clock_ms.saturating_add(self.config.expiry_margin_ms));
        start..end.max(start)
    }

    /// Ends a sub-lease: what its reservation still holds is never spendable again (its gateway
    /// may have admitted some of it without reporting it). From leases it is stranded; in fallback
    /// it stays used in its window, never reported as admitted.
    pub fn withhold(&mut self, reservation: Reservation) {
        self.settle(&reservation);
        match reservation.from {
            ReservedFrom::Fallback { window_start_ms } => {
                let count = self.fallback.entry(window_start_ms).or_default();
                count.reserved_tokens = count
                    .reserved_tokens
                    .saturating_sub(reservation.cost_tokens);
                count.unknown_tokens += reservation.cost_tokens;
            }
            ReservedFrom::Leases { .. } => {
                for &(lease_id, tokens) in reservation.lease_parts() {
                    if tokens == 0 {
                        continue;
                    }
                    if let Some(lease) = self.lease_mut(lease_id) {
                        debug_assert!(lease.reserved_tokens >= tokens);
                        lease.reserved_tokens -= tokens;
                        lease.withheld_tokens += tokens;
                    }
                    self.stranded_tokens += tokens;
                }
            }
        }
    }

    /// The instant (epoch ms, exclusive) by which what `reservation` holds must be spent: the end
    /// of the first-ending lease it holds tokens of (less the expiry margin), or the end of its
    /// window's [fallback span](Self::fallback_span).
    pub fn usable_until_ms(&self, reservation: &Reservation) -> u64 {
        match &reservation.from {
            ReservedFrom::Fallback { window_start_ms } => {
                self.fallback_span(self.config.window.containing(*window_start_ms))
                    .end
            }
            ReservedFrom::Leases { .. } => reservation
                .lease_parts()
                .iter()
                .filter(|(_, tokens)| *tokens > 0)
                .filter_map(|(lease_id, _)| {
                    self.live
                        .iter()
                        .chain(&self.ended)
                        .find(|l| l.grant.lease_id == *lease_id)
                })
                .map(|lease| lease.usable_until_ms(self.config.expiry_margin_ms))
                .min()
                .unwrap_or(0),
        }
    }

    fn settle(&mut self, reservation: &Reservation) {
        debug_assert!(
            self.reserved_tokens >= reservation.cost_tokens,
            "a reservation is settled once, on the holder that made it"
        );
        self.reserved_tokens = self.reserved_tokens.saturating_sub(reservation.cost_tokens);
    }

    fn lease_mut(&mut self, lease_id: LeaseId) -> Option<&mut HeldLease> {
        self.live
            .iter_mut()
            .chain(self.ended.iter_mut())
            .find(|l| l.grant.lease_id == lease_id)
    }

    /// Tokens in reservations not yet settled.
    pub fn reserved_tokens(&self) -> u64 {
        self.reserved_tokens
    }

    /// The claim to make durable for the fallback window containing `now_ms` before a request of
    /// `cost_tokens` can be reserved there, as (window start, claimed tokens): what is used plus
    /// the cost plus one claim block, within the allowance. `None` when claims are off or the
    /// request fits what is claimed.
    pub fn fallback_claim_wanted(&self, cost_tokens: u64, now_ms: u64) -> Option<(u64, u64)> {
        let block = self.config.fallback_claim_block_tokens;
        if block == 0 {
            return None;
        }
        let window_start_ms = self.config.window.containing(now_ms).start_ms;
        let count = self
            .fallback
            .get(&window_start_ms)
            .copied()
            .unwrap_or_default();
        let needed = count.used_tokens() + cost_tokens.max(1);
        (needed > count.claimed_tokens).then(|| {
            let claim = needed
                .saturating_add(block)
                .min(self.config.fallback_per_region_tokens)
                .max(count.claimed_tokens);
            (window_start_ms, claim)
        })
    }

    /// Records that a claim of `claimed_tokens` for the window starting at `window_start_ms` is
    /// durable (written and synced): fallback may be reserved up to it.
    pub fn claim_durable(&mut self, window_start_ms: u64, claimed_tokens: u64) {
        let count = self.fallback.entry(window_start_ms).or_default();
        count.claimed_tokens = count
            .claimed_tokens
            .max(claimed_tokens.min(self.config.fallback_per_region_tokens));
    }

    /// What a journal must keep of this holder. `claim` adds a claim being made durable with this
    /// snapshot: (window start, claimed tokens).
    pub fn snapshot(&self, claim: Option<(u64, u64)>) -> HolderSnapshot {
        let leases = self
            .live
            .iter()
            .chain(&self.ended)
            .map(|lease| JournaledLease {
                lease_id: lease.grant.lease_id,
                epoch: lease.grant.epoch,
                window_start_ms: lease.grant.window.start_ms,
                window_end_ms: lease.grant.window.end_ms,
                granted_tokens: lease.grant.granted_tokens,
                spent_tokens: lease.spent_tokens,
            })
            .collect();
        let mut fallback: Vec<JournaledFallback> = self
            .fallback
            .iter()
            .map(|(&window_start_ms, count)| JournaledFallback {
                window_start_ms,
                admitted_tokens: count.admitted_tokens,
                used_tokens: count.admitted_tokens + count.unknown_tokens,
                claimed_tokens: count.claimed_tokens,
                presumed_tokens: count.presumed_tokens,
            })
            .collect();
        if let Some((window_start_ms, claimed_tokens)) = claim {
            match fallback
                .iter_mut()
                .find(|f| f.window_start_ms == window_start_ms)
            {
                Some(line) => line.claimed_tokens = line.claimed_tokens.max(claimed_tokens),
                None => fallback.push(JournaledFallback {
                    window_start_ms,
                    admitted_tokens: 0,
                    used_tokens: 0,
                    claimed_tokens,
                    presumed_tokens: 0,
                }),
            }
        }
        HolderSnapshot {
            leases,
            fallback,
            debt_tokens: self.debt_tokens,
        }
    }

    /// Takes over what a crashed incarnation journaled: its leases become ended ones owing a final
    /// report with the spend journaled (this process cannot know what was spent after the
    /// snapshot, so it spends none of them); each window's fallback count starts at what was used
    /// (admitted, or claimed without being journaled as admitted), and reports what was journaled
    /// as admitted.
    pub fn restore(&mut self, snapshot: &HolderSnapshot) {
        // What was owed is owed still (the new incarnation's debt cannot be smaller).
        self.debt_tokens = self.debt_tokens.max(snapshot.debt_tokens);
        for lease in &snapshot.leases {
            let known = self
                .live
                .iter()
                .chain(&self.ended)
                .any(|held| held.grant.lease_id == lease.lease_id);
            if known || self.ended.len() >= MAX_UNREPORTED_LEASES {
                continue;
            }
            let spent_tokens = lease.spent_tokens.min(lease.granted_tokens);
            self.highest_epoch = self.highest_epoch.max(lease.epoch);
            self.ended.push(HeldLease {
                grant: LeaseGrant {
                    lease_id: lease.lease_id,
                    epoch: lease.epoch,
                    granted_tokens: lease.granted_tokens,
                    window: Window {
                        start_ms: lease.window_start_ms,
                        end_ms: lease.window_end_ms,
                    },
                    expires_at_ms: 0,
                    retry_after_ms: 0,
                },
                spent_tokens,
                reserved_tokens: 0,
                withheld_tokens: 0,
                reported_spent_tokens: 0,
            });
        }
        // The newest windows first: the current one must never be the one left out.
        let mut windows: Vec<&JournaledFallback> = snapshot.fallback.iter().collect();
        windows.sort_by_key(|line| std::cmp::Reverse(line.window_start_ms));
        for line in windows.into_iter().take(MAX_FALLBACK_WINDOWS) {
            let count = self.fallback.entry(line.window_start_ms).or_default();
            count.admitted_tokens = count.admitted_tokens.max(line.admitted_tokens);
            // Whatever was claimed may have been admitted after the last journal.
            let used = line
                .used_tokens
                .max(line.claimed_tokens)
                .max(line.admitted_tokens);
            count.unknown_tokens = used.saturating_sub(count.admitted_tokens);
            count.claimed_tokens = count.claimed_tokens.max(line.claimed_tokens);
            count.presumed_tokens = count.presumed_tokens.max(line.presumed_tokens);
        }
    }

    /// Tokens spendable now from held leases.
    pub fn available_tokens(&self, now_ms: u64) -> u64 {
        let margin = self.config.expiry_margin_ms;
        self.live
            .iter()
            .filter(|l| now_ms < l.usable_until_ms(margin))
            .map(HeldLease::remaining_tokens)
            .sum()
    }

    /// How many tokens to ask the allocator for now, if any: when what is held would run out within
    /// about two allocator round trips at the current rate (the low watermark, at most one chunk), ask
    /// for what the rate spends in a lease TTL, between 1 and the pool's chunk. `None` while a renewal is in flight,
    /// while the pool is exhausted, or when the pool has seen no demand for a window.
    pub fn wants(&mut self, now_ms: u64) -> Option<u64> {
        if self.renewal_in_flight || self.exhausted_until_ms > now_ms {
            return None;
        }
        let round_trip_ms = self.config.round_trip_ms;
        let last_demand_ms = self.last_demand_ms?;
        // Leases are clamped to their window: one asked for this close to the window's end would end
        // before this agent may spend from it and be stranded whole. Wait for the next window.
        let window = self.config.window.containing(now_ms);
        if window.ms_until_end(now_ms) <= self.config.expiry_margin_ms + round_trip_ms {
            return None;
        }
        self.expire(now_ms);
        self.rate.roll(now_ms);
        if self.live.is_empty()
            && now_ms.saturating_sub(last_demand_ms) > self.config.window.longest_ms()
        {
            return None;
        }
        let per_ms = RATE_SCALE * 1_000;
        let horizon_ms = 2 * round_trip_ms + self.config.expiry_margin_ms + RATE_BUCKET_MS;
        // Never prefetch while a whole chunk is held: a busy pool with a small chunk would otherwise
        // ask on every spend and hold (and strand) more leases than it can use.
        let watermark = self
            .rate
            .urgency()
            .saturating_mul(horizon_ms)
            .div_ceil(per_ms)
            .min(self.config.chunk_tokens.max(1));
        let available = self.available_tokens(now_ms);
        if available >= self.wanted_for_request_tokens {
            // What a waiting request needed is held now.
            self.wanted_for_request_tokens = 0;
        }
        if available >= watermark && !self.live.is_empty() && self.wanted_for_request_tokens == 0 {
            return None;
        }
        let want = self
            .rate
            .sizing()
            .saturating_mul(self.config.lease_ttl_ms)
            .div_ceil(per_ms)
            .max(self.wanted_for_request_tokens);
        Some(want.clamp(1, self.config.chunk_tokens.max(1)))
    }

    /// Marks a renewal as started at `now_ms` (single flight per pool).
    pub fn begin_renewal(&mut self, now_ms: u64) {
        self.renewal_in_flight = true;
        self.renewal_started_at_ms = now_ms;
    }

    /// Whether a renewal is in flight.
    pub fn renewal_in_flight(&self) -> bool {
        self.renewal_in_flight
    }

    /// Marks the renewal as finished (with or without a grant).
    pub fn end_renewal(&mut self) {
        self.renewal_in_flight = false;
        // Meaningful only while a renewal is in flight.
        self.renewal_started_at_ms = 0;
    }

    /// The lease id to ask the next renewal with at `now_ms`: the id of a renewal whose answer was
    /// lost, if any (idempotent by lease id, the allocator answers it with what it granted then),
    /// else `fresh`. A lost id is given up once the allocator may have forgotten its grant
    /// ([`lost_answer_recoverable_until_ms`]): asked again then, it could be granted twice, once
    /// in each window. What it may have granted is never spent (the ledger counts it unreported).
    pub fn renewal_lease_id(&mut self, fresh: LeaseId, now_ms: u64) -> LeaseId {
        if let Some(lost) = self.unanswered_lease
            && now_ms >= lost_answer_recoverable_until_ms(&self.config.window, lost)
        {
            self.unanswered_lease = None;
        }
        self.unanswered_lease.unwrap_or(fresh)
    }

    /// Records how the renewal asked with `lease_id` failed: `ambiguous` (no answer: the allocator
    /// may have granted) keeps the id for the next renewal; a refusal forgets it.
    pub fn renewal_failed(&mut self, lease_id: LeaseId, ambiguous: bool) {
        self.unanswered_lease = ambiguous.then_some(lease_id);
    }

    /// What to report since the last acknowledged report.
    pub fn pending_report(&mut self, now_ms: u64) -> PendingReport {
        self.expire(now_ms);
        let line = |lease: &HeldLease, final_line: bool| LeaseLine {
            lease_id: lease.grant.lease_id,
            window_start_ms: lease.grant.window.start_ms,
            spent_tokens: lease.spent_tokens,
            final_line,
        };
        let mut leases: Vec<LeaseLine> = self
            .live
            .iter()
            .filter(|l| l.spent_tokens != l.reported_spent_tokens)
            .map(|l| line(l, false))
            .collect();
        // An ended lease's final line waits until its reservations settle (a commit still adds to
        // what it spent); meanwhile it reports as a live one does.
        leases.extend(self.ended.iter().filter_map(|l| {
            if l.reserved_tokens == 0 {
                Some(line(l, true))
            } else {
                (l.spent_tokens != l.reported_spent_tokens).then(|| line(l, false))
            }
        }));
        let fallback = self
            .fallback
            .iter()
            .filter(|(_, c)| c.admitted_tokens != c.reported_tokens)
            .map(|(&window_start_ms, c)| FallbackLine {
                window_start_ms,
                admitted_tokens: c.admitted_tokens,
            })
            .collect();
        PendingReport { leases, fallback }
    }

    /// Records that the allocator acknowledged `report`: final lines are done with; fallback windows
    /// that are over and fully reported are forgotten.
    pub fn acknowledge(&mut self, report: &PendingReport, now_ms: u64) {
        for line in &report.leases {
            if line.final_line {
                self.ended.retain(|l| l.grant.lease_id != line.lease_id);
            } else if let Some(lease) = self.lease_mut(line.lease_id) {
                lease.reported_spent_tokens = lease.reported_spent_tokens.max(line.spent_tokens);
            }
        }
        for line in &report.fallback {
            if let Some(count) = self.fallback.get_mut(&line.window_start_ms) {
                count.reported_tokens = count.reported_tokens.max(line.admitted_tokens);
            }
        }
        let current = self.config.window.containing(now_ms).start_ms;
        self.fallback.retain(|&start, c| {
            start >= current || c.admitted_tokens != c.reported_tokens || c.reserved_tokens > 0
        });
    }

    /// Whether forgetting this holder loses nothing: no lease held or owed a final report, no
    /// renewal in flight, every fallback admit reported and none counted in the current window
    /// (forgetting that count would re-open the window's allowance), and no demand for `idle_ms`.
    pub fn is_idle(&mut self, now_ms: u64, idle_ms: u64) -> bool {
        self.expire(now_ms);
        let current = self.config.window.containing(now_ms).start_ms;
        let quiet = self
            .last_demand_ms
            .is_none_or(|last| now_ms.saturating_sub(last) >= idle_ms);
        quiet
            && self.reserved_tokens == 0
            && !self.renewal_in_flight
            && self.live.is_empty()
            && self.ended.is_empty()
            && self.debt_tokens == 0
            && self
                .fallback
                .iter()
                .all(|(&start, c)| start < current && c.admitted_tokens == c.reported_tokens)
    }

    /// Starts the fallback count of the window starting at `window_start_ms` at `admitted_tokens`
    /// (already reported): what the region's agents admitted in fallback in that window before this
    /// holder existed, as the ledger holds it. A restarted agent thus cannot admit the window's
    /// allowance a second time.
    pub fn seed_fallback(&mut self, window_start_ms: u64, admitted_tokens: u64) {
        if admitted_tokens == 0 {
            return;
        }
        let count = self.fallback.entry(window_start_ms).or_default();
        let used = count.admitted_tokens + count.unknown_tokens;
        count.admitted_tokens = count.admitted_tokens.max(admitted_tokens);
        count.reported_tokens = count.reported_tokens.max(admitted_tokens);
        count.unknown_tokens = used.saturating_sub(count.admitted_tokens);
    }

    /// Counts the whole allowance of the window starting at `window_start_ms` as used: an earlier
    /// run of this agent may have admitted it in fallback without the ledger or this holder
    /// knowing. What is counted so beyond the admits is never reported (nobody knows it was
    /// admitted); it only keeps this run from admitting it again.
    pub fn presume_fallback_used(&mut self, window_start_ms: u64) {
        let allowance = self.config.fallback_per_region_tokens;
        let count = self.fallback.entry(window_start_ms).or_default();
        let used = count.used_tokens();
        count.presumed_tokens += allowance.saturating_sub(used);
        debug_assert!(count.used_tokens() >= allowance, "the allowance is used up");
    }

    /// Whether every fallback admit of windows starting at or after `window_start_ms` is reported
    /// and none is reserved or of unknown fate: what the ledger holds of them, with what the
    /// allocator already knows was presumed, is all there is.
    pub fn fallback_settled_from(&self, window_start_ms: u64) -> bool {
        self.fallback.range(window_start_ms..).all(|(_, count)| {
            count.admitted_tokens == count.reported_tokens
                && count.reserved_tokens == 0
                && count.unknown_tokens == 0
        })
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
        self.live
            .iter()
            .chain(&self.ended)
            .find(|l| l.grant.lease_id == lease_id)
            .map(|l| l.grant.window.start_ms)
    }

    /// The highest allocator epoch seen.
    pub fn highest_epoch(&self) -> Epoch {
        self.highest_epoch
    }
}
