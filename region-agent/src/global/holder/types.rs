//! The holder's vocabulary: its configuration, what a grant, a request's reservation and a spend
//! are, why a request is refused, and what it reports and journals. Data only; the holder and its
//! parts act on them.

use allot_shared::ids::{Epoch, LeaseId};
use allot_shared::window::{Window, WindowSpec};
use allot_shared::wire::GrantAnswer;

#[cfg(doc)]
use super::PoolHolder;

/// Leases held at once per pool (the current one and a prefetched renewal, with room to spare).
pub const MAX_LIVE_LEASES: usize = 4;
/// Ended leases whose final report has not been acknowledged, kept per pool (I10). Past it the oldest
/// is dropped (counted; the ledger shows it as unreported).
pub const MAX_UNREPORTED_LEASES: usize = 1_024;
/// Windows of fallback admits kept until reported.
pub const MAX_FALLBACK_WINDOWS: usize = 64;
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
    /// The allocator takes back what the lease leaves unspent, and the lease ends before its
    /// window does (so what it gives back can be granted again): its final line says how many
    /// tokens are left.
    pub returnable: bool,
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
            // Both instants on the allocator's clock.
            returnable: answer.returnable && answer.expires_at_ms < answer.window_end_ms,
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
pub(super) enum ReservedFrom {
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
    pub(super) from: ReservedFrom,
    pub(super) cost_tokens: u64,
    /// When it was made: the demand it recorded belongs to the rate bucket of this instant.
    pub(super) reserved_at_ms: u64,
    /// Whether it counts as demand (a cancel takes that back); a sub-lease's does not.
    pub(super) demand_counted: bool,
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
    /// In a final line of a returnable lease: the tokens left unspent, none reserved or withheld,
    /// that this agent will never spend (given back to the lease's window).
    pub unspent_tokens: u64,
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
