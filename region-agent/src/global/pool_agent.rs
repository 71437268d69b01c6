//! One pool's agent: the lease loop around a [`PoolHolder`], written once. The agent service
//! (over HTTP, on the wall clock), the drill engine (in virtual time, with faults at its
//! transport) and the model checker (over every interleaving) all run it, and nothing else: each
//! step of the loop is a method here, fed what happened (a request's reservation, its commit or
//! cancel, a settled charge, an allocator call's outcome, a report taken, a restart) and answering
//! with what to do next (a renewal to ask, the reports to send, the journal's record). No I/O and
//! no clock: every step is given the agent's `now_ms`.
//!
//! The loop's choices, made here for all three:
//! - **Renewals follow demand.** A renewal is wanted only when a request reserves (or a charge
//!   spends) and the holder's watermark says so; a pool nobody asks of asks the allocator
//!   nothing. At most one is in flight; [`PoolAgent::renewal_to_ask`] gives it, with the
//!   unanswered lease id again when the last answer may hide a committed grant.
//! - **A call's outcome becomes an answer in one place** ([`GrantCall::answer`]): an answer is a
//!   grant; a pool the allocator does not know is gone; a refusal is final; no answer, a server
//!   error or a deposed leader leave the id to be asked again.
//! - **A report is one part per window**, the holder's lines with the pool's tallies (shadow
//!   counts, the most settle debt carried, write-offs) of that window; a part the allocator did
//!   not take stays owed, whole.
//! - **A pool taken up without a journal takes over its window** from the ledger's count of this
//!   agent's fallback and the allocator's session record ([`driver::take_over_window`]); one
//!   restored from a journal takes over what the journal says.

use allot_shared::ids::LeaseId;
use allot_shared::wire::{GrantAnswer, ReportLease};

use super::driver::{self, Inherited, RenewalAnswer, RenewalAsk, RenewalOutcome, ReportPart};
use super::holder::{
    DebtCharge, HolderConfig, HolderSnapshot, LeaseGrant, PendingReport, PoolHolder, Refusal,
    Reservation, Spend,
};
use super::tallies::{Tallies, TallyWindow};

/// One pool's agent: its holder, the renewal it has asked for, and its tallies.
#[derive(Debug, Clone)]
pub struct PoolAgent {
    holder: PoolHolder,
    /// The renewal asked and not answered yet.
    asked: Option<RenewalAsk>,
    tallies: Tallies,
    /// Whether anything changed since a report round found nothing owed: the loop visits only
    /// such pools (and those whose lease has ended since), so an idle pool costs a report round
    /// nothing. Decides nothing else: left out of equality.
    changed: bool,
    /// The holder's dropped report lines already counted in the agent's total
    /// ([`take_dropped_reports`](Self::take_dropped_reports)). Decides nothing: left out of
    /// equality.
    dropped_reports_counted: u64,
}

impl PartialEq for PoolAgent {
    fn eq(&self, other: &Self) -> bool {
        (&self.holder, &self.asked, &self.tallies) == (&other.holder, &other.asked, &other.tallies)
    }
}

impl Eq for PoolAgent {}

impl std::hash::Hash for PoolAgent {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        (&self.holder, &self.asked, &self.tallies).hash(state);
    }
}

/// How an allocator grant call ended, as the transport saw it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum GrantCall {
    /// The allocator answered with a grant (possibly of nothing), to a call asked at
    /// `asked_at_ms` on the agent's clock.
    Answered {
        /// The answer.
        answer: GrantAnswer,
        /// When the call was made, the agent's clock, epoch ms.
        asked_at_ms: u64,
    },
    /// The allocator does not know the pool.
    PoolGone,
    /// A definite refusal (a client error): nothing was granted, the id is not asked again.
    Refused,
    /// No answer: the call failed, timed out, met a server error or a deposed leader. The grant
    /// may have been committed, so the next renewal asks with the same id.
    Unanswered,
}

impl GrantCall {
    /// The protocol's answer: a grant is timed from the agent's own ask, with what was left of the
    /// lease when the allocator answered.
    pub fn answer(&self) -> RenewalAnswer {
        match self {
            Self::Answered {
                answer,
                asked_at_ms,
            } => RenewalAnswer::Granted(LeaseGrant::from_answer(answer, *asked_at_ms)),
            Self::PoolGone => RenewalAnswer::PoolGone,
            Self::Refused => RenewalAnswer::Refused,
            Self::Unanswered => RenewalAnswer::Unanswered,
        }
    }
}

/// One window's part of a pool's report: what the ledger takes per pool and window.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct PoolReport {
    /// The window and the holder's lines of it: its leases' spend and its fallback admits.
    pub part: ReportPart,
    /// What a shadow global rule counted in the window (cumulative).
    pub shadow_admitted_tokens: u64,
    /// The most settle debt carried in the window.
    pub settle_debt_tokens: u64,
    /// Tokens written off in the window (cumulative).
    pub written_off_tokens: u64,
}

impl PoolReport {
    /// The window's start, epoch ms.
    pub fn window_start_ms(&self) -> u64 {
        self.part.window_start_ms
    }

    /// Fallback admitted in the window so far (cumulative; 0: none to report).
    pub fn fallback_admitted_tokens(&self) -> u64 {
        self.part
            .lines
            .fallback
            .first()
            .map_or(0, |f| f.admitted_tokens)
    }

    /// The lease lines as the wire carries them.
    pub fn lease_lines(&self) -> Vec<ReportLease> {
        self.part
            .lines
            .leases
            .iter()
            .map(|l| ReportLease {
                lease_id: l.lease_id,
                spent_tokens: l.spent_tokens,
                final_report: l.final_line,
                unspent_tokens: l.unspent_tokens,
            })
            .collect()
    }
}

/// What a journal keeps of a pool's agent: its holder's snapshot and its tallies.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub struct PoolJournal {
    /// The holder's snapshot.
    pub holder: HolderSnapshot,
    /// What a shadow global rule counted per window.
    pub shadow: Vec<TallyWindow>,
    /// The most settle debt carried per window.
    pub settle_debt: Vec<TallyWindow>,
    /// Tokens written off per window.
    pub written_off: Vec<TallyWindow>,
}

impl PoolAgent {
    /// A pool taken up now, without a journal: it takes over its window from what `inherited`
    /// says (the ledger's count of this agent's fallback, the session record). With whether the
    /// window's allowance was presumed used.
    pub fn taking_over(config: HolderConfig, inherited: Inherited, now_ms: u64) -> (Self, bool) {
        let mut agent = Self::new(config);
        let presumed = driver::take_over_window(&mut agent.holder, inherited, now_ms);
        agent.changed = true;
        (agent, presumed)
    }

    /// A pool taken up from a journal: its holder and tallies as a crashed or stopped run left
    /// them (leases to report final, fallback counts and claims).
    pub fn restored(config: HolderConfig, journal: &PoolJournal) -> Self {
        let mut agent = Self::new(config);
        agent.holder.restore(&journal.holder);
        agent.tallies.shadow.restore(&journal.shadow);
        agent.tallies.settle_debt.restore(&journal.settle_debt);
        agent.tallies.written_off.restore(&journal.written_off);
        agent.changed = true;
        agent
    }

    fn new(config: HolderConfig) -> Self {
        Self {
            holder: PoolHolder::new(config),
            asked: None,
            tallies: Tallies::default(),
            changed: false,
            dropped_reports_counted: 0,
        }
    }

    /// The holder, to read.
    pub fn holder(&self) -> &PoolHolder {
        &self.holder
    }

    /// The holder, for the gateways' carving (sub-leases), which the holder keeps itself.
    pub fn holder_mut(&mut self) -> &mut PoolHolder {
        self.changed = true;
        &mut self.holder
    }

    /// The holder's configuration.
    pub fn config(&self) -> &HolderConfig {
        self.holder.config()
    }

    /// The start of the pool's window containing `now_ms`, epoch ms.
    pub fn window_start_ms(&self, now_ms: u64) -> u64 {
        self.holder.config().window.containing(now_ms).start_ms
    }

    /// A request reserves `cost_tokens` at `now_ms` (`reachable`: whether the allocator answered
    /// the agent's last call). A dry run that is refused takes its demand back: it wanted nothing.
    pub fn reserve(
        &mut self,
        cost_tokens: u64,
        now_ms: u64,
        reachable: bool,
        dry_run: bool,
    ) -> Result<Reservation, Refusal> {
        self.changed = true;
        let reserved = self.holder.reserve(cost_tokens, now_ms, reachable);
        if dry_run && reserved.is_err() {
            self.holder.withdraw_demand(now_ms, cost_tokens);
        }
        reserved
    }

    /// The request was admitted: what it reserved is spent (from a lease, or in fallback).
    pub fn commit(&mut self, reservation: Reservation) -> Spend {
        self.changed = true;
        self.holder.commit(reservation)
    }

    /// The request was denied (by a regional rule, a later pool, the hold's end) or was a dry
    /// run: what it reserved goes back to where it came from, and nothing was debited.
    pub fn cancel(&mut self, reservation: Reservation) {
        self.changed = true;
        self.holder.cancel(reservation);
    }

    /// A metered request settled `extra_tokens` above its estimate: charged to the pool (paid,
    /// owed within the agent's share of the settle debt, or written off), and tallied for the
    /// ledger.
    pub fn charge(&mut self, extra_tokens: u64, now_ms: u64) -> DebtCharge {
        self.changed = true;
        let charged = self.holder.charge(extra_tokens, now_ms);
        let window_start_ms = self.window_start_ms(now_ms);
        self.tallies
            .settle_debt
            .raise(window_start_ms, self.holder.debt_tokens());
        self.tallies
            .written_off
            .count(window_start_ms, charged.written_off_tokens);
        charged
    }

    /// A shadow global rule of the pool counted `tokens` of an admitted request.
    pub fn count_shadow(&mut self, tokens: u64, now_ms: u64) {
        self.changed = true;
        let window_start_ms = self.window_start_ms(now_ms);
        self.tallies.shadow.count(window_start_ms, tokens);
    }

    /// The renewal to ask now, if the holder wants one and none is in flight; `fresh` is the id
    /// to use when no earlier renewal went unanswered. In flight until
    /// [`renewal_answered`](Self::renewal_answered).
    pub fn renewal_to_ask(&mut self, now_ms: u64, fresh: LeaseId) -> Option<RenewalAsk> {
        let ask = driver::start_renewal(&mut self.holder, now_ms, fresh)?;
        self.asked = Some(ask);
        Some(ask)
    }

    /// The renewal in flight, if any.
    pub fn renewal_asked(&self) -> Option<RenewalAsk> {
        self.asked
    }

    /// Whether a renewal is in flight.
    pub fn renewal_in_flight(&self) -> bool {
        self.holder.renewal_in_flight()
    }

    /// The renewal in flight ended with `call` at `now_ms`: taken into the holder. `None` when no
    /// renewal was in flight (an answer of a call given up on, or of a holder since replaced).
    pub fn renewal_answered(&mut self, call: &GrantCall, now_ms: u64) -> Option<RenewalOutcome> {
        let ask = self.asked.take()?;
        // A grant may pay settle debt from its lease at once: a spend to report.
        self.changed = true;
        Some(driver::finish_renewal(
            &mut self.holder,
            &ask,
            call.answer(),
            now_ms,
        ))
    }

    /// Whether the pool may owe the ledger a report at `now_ms`: something changed since a
    /// report round found nothing owed, or a lease has ended since (its final line is owed). A
    /// round need not ask the others.
    pub fn owes_report(&self, now_ms: u64) -> bool {
        self.changed
            || self
                .holder
                .next_lease_end_ms()
                .is_some_and(|end_ms| now_ms >= end_ms)
    }

    /// Whether a background round has nothing to do for the pool until something acts on it
    /// again: nothing changed since a report round found nothing owed, no lease live (its end
    /// would owe a final line), and no renewal asked. Time alone changes none of these.
    pub fn settled(&self) -> bool {
        !self.changed && self.holder.next_lease_end_ms().is_none() && self.asked.is_none()
    }

    /// Report lines the holder dropped since this was last asked (the agent keeps the total
    /// without visiting every pool).
    pub fn take_dropped_reports(&mut self) -> u64 {
        let dropped = self.holder.dropped_reports();
        let new = dropped.saturating_sub(self.dropped_reports_counted);
        self.dropped_reports_counted = dropped;
        new
    }

    /// What the pool owes the ledger at `now_ms`, one part per window, oldest first (empty:
    /// nothing). Debt carried into a window is that window's too, settled there or not. Nothing
    /// is marked reported until [`reported`](Self::reported).
    pub fn report(&mut self, now_ms: u64) -> Vec<PoolReport> {
        let current_start_ms = self.window_start_ms(now_ms);
        self.tallies
            .settle_debt
            .raise(current_start_ms, self.holder.debt_tokens());
        let mut parts = driver::start_report(&mut self.holder, now_ms);
        let shadow = self.tallies.shadow.unreported();
        let settle_debt = self.tallies.settle_debt.unreported();
        let written_off = self.tallies.written_off.unreported();
        // The tallies' windows without lines of their own get parts of their own.
        for (start_ms, _) in [&shadow, &settle_debt, &written_off].into_iter().flatten() {
            if !parts.iter().any(|p| p.window_start_ms == *start_ms) {
                parts.push(ReportPart {
                    window_start_ms: *start_ms,
                    lines: PendingReport::default(),
                });
            }
        }
        if parts.is_empty() {
            self.changed = false;
        }
        parts.sort_by_key(|p| p.window_start_ms);
        parts
            .into_iter()
            .map(|part| PoolReport {
                shadow_admitted_tokens: in_window(&shadow, part.window_start_ms),
                settle_debt_tokens: in_window(&settle_debt, part.window_start_ms),
                written_off_tokens: in_window(&written_off, part.window_start_ms),
                part,
            })
            .collect()
    }

    /// The allocator took `part` at `now_ms`: its final lines are done with, its counts reported.
    pub fn reported(&mut self, part: &PoolReport, now_ms: u64) {
        driver::finish_report(&mut self.holder, &part.part, now_ms);
        let current_start_ms = self.window_start_ms(now_ms);
        for (tally, tokens) in [
            (&mut self.tallies.shadow, part.shadow_admitted_tokens),
            (&mut self.tallies.settle_debt, part.settle_debt_tokens),
            (&mut self.tallies.written_off, part.written_off_tokens),
        ] {
            tally.acknowledge(part.window_start_ms(), tokens, current_start_ms);
        }
    }

    /// The pool's terms changed: the holder takes the new configuration, and a window it was told
    /// was spent is asked for again (a raised limit may have room).
    pub fn retune(&mut self, config: HolderConfig) {
        self.changed = true;
        self.holder.reconfigure(config);
        self.holder.forget_exhaustion();
    }

    /// Whether forgetting the pool loses nothing: nothing held, owed or in flight, every count
    /// reported, none in the current window, and no demand for `idle_ms`.
    pub fn is_idle(&mut self, now_ms: u64, idle_ms: u64) -> bool {
        let current_start_ms = self.window_start_ms(now_ms);
        self.holder.is_idle(now_ms, idle_ms) && self.tallies.may_forget(current_start_ms)
    }

    /// The fallback claim (window start, tokens claimed in all) to make durable before
    /// `cost_tokens` more can be admitted in fallback at `now_ms`, if one is wanted.
    pub fn fallback_claim_wanted(&self, cost_tokens: u64, now_ms: u64) -> Option<(u64, u64)> {
        self.holder.fallback_claim_wanted(cost_tokens, now_ms)
    }

    /// The claim of `claimed_tokens` in the window starting at `window_start_ms` is durable (the
    /// journal holding it is written and synced): fallback may be admitted within it.
    pub fn claim_durable(&mut self, window_start_ms: u64, claimed_tokens: u64) {
        self.changed = true;
        self.holder.claim_durable(window_start_ms, claimed_tokens);
    }

    /// What the journal keeps of the pool; with `claim`, a fallback claim of (window start,
    /// tokens) about to be made durable.
    pub fn journal(&self, claim: Option<(u64, u64)>) -> PoolJournal {
        PoolJournal {
            holder: self.holder.snapshot(claim),
            shadow: self.tallies.shadow.snapshot(),
            settle_debt: self.tallies.settle_debt.snapshot(),
            written_off: self.tallies.written_off.snapshot(),
        }
    }
}

/// A tally's amount in the window starting at `window_start_ms` (0: none).
fn in_window(tally: &[(u64, u64)], window_start_ms: u64) -> u64 {
    tally
        .iter()
        .find(|(start_ms, _)| *start_ms == window_start_ms)
        .map_or(0, |(_, tokens)| *tokens)
}
