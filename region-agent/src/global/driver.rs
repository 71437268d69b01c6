//! The lease protocol's steps, in one place: what an agent does about a pool's leases, whoever
//! carries its messages. The agent service (over HTTP to the allocator) and the drills (in virtual
//! time, with lost, late and refused answers) take exactly these steps; the [`PoolHolder`] keeps
//! the state. Pure: no I/O, no clock.
//!
//! A renewal is two steps with one message between them:
//! 1. [`start_renewal`]: when the holder wants tokens and none is on its way, the lease id to ask
//!    with and how many. The id is the last unanswered one when there is one: grants are
//!    idempotent by lease id, so asking again recovers a grant whose answer was lost instead of
//!    taking a second one.
//! 2. [`finish_renewal`]: what came back (a grant, the pool gone, a refusal, or nothing), taken
//!    into the holder; it says how the renewal ended. Only an answer that may hide a committed
//!    grant (none, or a server error) keeps the id for the next renewal.
//!
//! Between the two, the holder has a renewal in flight and starts no other (single flight).
//!
//! A report round is two steps too: [`start_report`] says what the holder owes the ledger, one
//! part per window (the ledger takes reports per pool and window), and [`finish_report`] takes
//! in that the allocator took a part. A part not taken stays owed, whole, for the next round.
//!
//! A holder starts with [`take_over_window`]: an agent that comes up counts what its region already
//! admitted in fallback in the current window (the ledger's count) and, without a journal, the
//! whole of its allowance in a window containing the start of the latest run that followed an
//! unclean end (a crashed run may have admitted it unreported). So no run re-opens an allowance.

use allot_shared::ids::LeaseId;

use super::holder::{GrantVerdict, LeaseGrant, PendingReport, PoolHolder};
use allot_shared::wire::FallbackInWindow;

/// A renewal to send: `want_tokens` of the pool, asked with `lease_id`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct RenewalAsk {
    /// The id to ask with (the grant is idempotent by it).
    pub lease_id: LeaseId,
    /// Tokens wanted.
    pub want_tokens: u64,
}

/// What came back for a renewal.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RenewalAnswer {
    /// The allocator answered with a grant (possibly of nothing: the pool is exhausted).
    Granted(LeaseGrant),
    /// The pool no longer exists.
    PoolGone,
    /// A definite refusal: nothing was granted, and asking again with the same id is pointless.
    Refused,
    /// No answer, or a server error: the grant may have been committed, so the next renewal asks
    /// with the same id.
    Unanswered,
}

impl RenewalAnswer {
    /// Whether the answer came from the allocator. Fallback applies while the last call did not
    /// reach it (with nothing held, [`PoolHolder::reserve`] then admits from the window's
    /// allowance), and ends with the first answer that did: a refusal reached it too.
    pub fn reached_allocator(&self) -> bool {
        !matches!(self, Self::Unanswered)
    }
}

/// How a renewal ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum RenewalOutcome {
    /// Granted all that was wanted, and held.
    Granted,
    /// Granted less than was wanted, and held.
    Partial,
    /// Nothing granted: the pool is exhausted until the holder may ask again.
    Exhausted,
    /// From an allocator epoch older than one already seen: ignored.
    StaleEpoch,
    /// Arrived past its usable end, or already held: nothing to spend.
    Expired,
    /// The pool no longer exists.
    PoolGone,
    /// Refused or unanswered.
    Failed,
}

impl RenewalOutcome {
    /// Its name in metrics and logs.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Granted => "granted",
            Self::Partial => "partial",
            Self::Exhausted => "exhausted",
            Self::StaleEpoch => "stale_epoch",
            Self::Expired => "expired",
            Self::PoolGone => "gone",
            Self::Failed => "failed",
        }
    }

    /// Whether the grant is now held (spendable).
    pub fn held(self) -> bool {
        matches!(self, Self::Granted | Self::Partial)
    }
}

/// Step 1: the renewal to send now, if the holder wants one and none is in flight; `fresh` is
/// the id to use when no earlier renewal went unanswered. The renewal is in flight from here
/// until [`finish_renewal`].
pub fn start_renewal(holder: &mut PoolHolder, now_ms: u64, fresh: LeaseId) -> Option<RenewalAsk> {
    let want_tokens = holder.wants(now_ms)?;
    holder.begin_renewal(now_ms);
    Some(RenewalAsk {
        lease_id: holder.renewal_lease_id(fresh, now_ms),
        want_tokens,
    })
}

/// Step 2: takes what came back for `ask` into the holder at `now_ms` and ends the renewal.
pub fn finish_renewal(
    holder: &mut PoolHolder,
    ask: &RenewalAsk,
    answer: RenewalAnswer,
    now_ms: u64,
) -> RenewalOutcome {
    let outcome = match answer {
        RenewalAnswer::Granted(grant) => {
            debug_assert_eq!(grant.lease_id, ask.lease_id, "an answer to another renewal");
            match holder.accept(grant, now_ms) {
                GrantVerdict::Accepted if grant.granted_tokens < ask.want_tokens => {
                    RenewalOutcome::Partial
                }
                GrantVerdict::Accepted => RenewalOutcome::Granted,
                GrantVerdict::Exhausted { .. } => RenewalOutcome::Exhausted,
                GrantVerdict::StaleEpoch { .. } => RenewalOutcome::StaleEpoch,
                GrantVerdict::AlreadyExpired | GrantVerdict::Duplicate => RenewalOutcome::Expired,
            }
        }
        RenewalAnswer::PoolGone => {
            holder.renewal_failed(ask.lease_id, false);
            RenewalOutcome::PoolGone
        }
        RenewalAnswer::Refused => {
            holder.renewal_failed(ask.lease_id, false);
            RenewalOutcome::Failed
        }
        RenewalAnswer::Unanswered => {
            holder.renewal_failed(ask.lease_id, true);
            RenewalOutcome::Failed
        }
    };
    holder.end_renewal();
    outcome
}

/// One window's part of a report round.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct ReportPart {
    /// The window's start, epoch ms.
    pub window_start_ms: u64,
    /// The holder's lines of that window: its leases' spend and its fallback admits.
    pub lines: PendingReport,
}

/// Reporting, step 1: what the holder owes the ledger at `now_ms`, one part per window, oldest
/// first (empty: nothing owed). Nothing is marked reported until [`finish_report`].
pub fn start_report(holder: &mut PoolHolder, now_ms: u64) -> Vec<ReportPart> {
    let pending = holder.pending_report(now_ms);
    let mut windows: Vec<u64> = pending
        .leases
        .iter()
        .map(|l| l.window_start_ms)
        .chain(pending.fallback.iter().map(|f| f.window_start_ms))
        .collect();
    windows.sort_unstable();
    windows.dedup();
    let parts: Vec<ReportPart> = windows
        .into_iter()
        .map(|window_start_ms| ReportPart {
            window_start_ms,
            lines: PendingReport {
                leases: pending
                    .leases
                    .iter()
                    .filter(|l| l.window_start_ms == window_start_ms)
                    .copied()
                    .collect(),
                fallback: pending
                    .fallback
                    .iter()
                    .filter(|f| f.window_start_ms == window_start_ms)
                    .copied()
                    .collect(),
            },
        })
        .collect();
    debug_assert_eq!(
        parts
            .iter()
            .map(|p| p.lines.leases.len() + p.lines.fallback.len())
            .sum::<usize>(),
        pending.leases.len() + pending.fallback.len(),
        "every line goes in exactly one part"
    );
    parts
}

/// Reporting, step 2: the allocator took `part` at `now_ms`: its final lines are done with, its
/// counts reported.
pub fn finish_report(holder: &mut PoolHolder, part: &ReportPart, now_ms: u64) {
    holder.acknowledge(&part.lines, now_ms);
}

/// What a new holder takes over of the window it starts in.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub struct Inherited {
    /// What the region admitted in fallback in the current window, as the ledger holds it.
    pub ledger_fallback: Option<FallbackInWindow>,
    /// When the latest run of the agent that followed an unclean end started, epoch ms, if this
    /// run has no journal to cover it: a window containing that instant may hold fallback nobody
    /// reported, up to the allowance.
    pub unclean_start_ms: Option<u64>,
}

/// A new holder's first step, at `now_ms`: takes over what its window already used (see the
/// module docs). Returns whether the window's allowance was presumed used.
pub fn take_over_window(holder: &mut PoolHolder, inherited: Inherited, now_ms: u64) -> bool {
    let window = holder.config().window.containing(now_ms);
    if let Some(fallback) = inherited.ledger_fallback {
        holder.seed_fallback(fallback.window_start_ms, fallback.admitted_tokens);
    }
    let presumed = inherited
        .unclean_start_ms
        .is_some_and(|started_ms| window.contains(started_ms));
    if presumed {
        holder.presume_fallback_used(window.start_ms);
    }
    presumed
}
