//! One tenant's pool in one region's agent during one tick: grant answers delivered, requests
//! reserved and committed or cancelled as the agent service does, renewals and reports as its pool
//! agent asks, and what a crash loses.

use allot_region_agent::allocator_client::CALL_TIMEOUT;
use allot_region_agent::global::driver::{Inherited, RenewalOutcome};
use allot_region_agent::global::holder::{DebtCharge, Denial, HolderConfig, Spend};
use allot_region_agent::global::{GrantCall, PoolAgent};
use allot_shared::ids::{LeaseId, RegionId};
use allot_shared::wire::FallbackInWindow;
use rand::Rng;
use rand::rngs::StdRng;

use super::allocator::DrillAllocator;
use super::conditions::{RegionConditions, ms};
use super::{DrillError, HeldPool, InFlight, ROUND_TRIP_MS, RegionAgent};
use crate::drill::check::TenantChecker;
use crate::drill::gateways::{Decided, Gateways};
use crate::drill::scenario::{GatewayPlan, RegionPlan};

/// Region `r`'s agent crashes: everything in its memory is gone. What its holders held is
/// stranded, what it admitted since its last report is unreported.
pub(super) fn crash(
    agent: &mut RegionAgent,
    checker: &mut TenantChecker,
    r: usize,
    agent_now_ms: u64,
) {
    for (t, held) in agent.pools.iter_mut().enumerate() {
        let record = checker.record(t, r);
        if let Some(agent) = &held.agent {
            record.stranded_tokens += agent.holder().available_tokens(agent_now_ms);
        }
        if let Some(InFlight {
            answer: Some(answer),
            ..
        }) = &held.in_flight
        {
            record.stranded_tokens += answer.granted_tokens;
        }
        record.unreported_tokens += held.admitted_since_report;
        let mut gateways = held.gateways.take();
        if let Some(gateways) = gateways.as_mut() {
            gateways.agent_crashed();
        }
        *held = HeldPool {
            gateways,
            ..HeldPool::default()
        };
    }
    agent.believes_reachable = true;
}

/// Counts a gateway's decision on one request at `now_ms` (true time) in the window starting at
/// `window_start_ms`.
pub(super) fn record_gateway_decision(
    record: &mut crate::drill::results::RegionWindow,
    decided: Decided,
    now_ms: u64,
    window_start_ms: u64,
) {
    record.demand += 1;
    match decided {
        Decided::Admitted(source) => {
            if source.fallback {
                record.fallback += 1;
            } else if source
                .lease_window_start_ms
                .is_some_and(|start| start < window_start_ms)
            {
                record.carried_over += 1;
            } else {
                record.leased += 1;
            }
            if now_ms >= source.true_until_ms {
                record.spent_after_lease_end += 1;
            }
        }
        Decided::Denied => record.denied_by_gateway += 1,
    }
}

/// What a request is, besides its pool: decided once, before its first try.
#[derive(Debug, Clone, Copy)]
struct RequestKind {
    /// A regional rule denies it after its global reservation.
    denied_regionally: bool,
    /// Tokens it costs beyond its estimate, settled after the response (0: not metered).
    extra_tokens: u64,
}

/// What became of one request at its agent.
enum Served {
    /// Decided on the pool: admitted from a lease or in fallback, or denied; with what settling
    /// a metered one charged the pool.
    Pool(Spend, Option<DebtCharge>),
    /// Its reservation held, but a regional rule denied it: cancelled (`debited`: the holder was
    /// left other than before the reservation, which must never be).
    DeniedRegionally { debited: bool },
}

/// What a holder has spent (leases and fallback) and can spend at `now_ms`: a denial must leave
/// both as they were.
fn what_is_held(holder: &allot_region_agent::global::PoolHolder, now_ms: u64) -> (u64, u64) {
    let snapshot = holder.snapshot(None);
    let spent: u64 = snapshot.leases.iter().map(|l| l.spent_tokens).sum::<u64>()
        + snapshot
            .fallback
            .iter()
            .map(|f| f.admitted_tokens)
            .sum::<u64>();
    (spent, holder.available_tokens(now_ms))
}

/// One tenant's pool in one region's agent during one tick.
pub(super) struct Step<'a> {
    pub(super) allocator: &'a mut DrillAllocator,
    pub(super) rng: &'a mut StdRng,
    pub(super) kinds: &'a mut StdRng,
    /// The region's demand: which of its requests are denied regionally or metered.
    pub(super) plan: &'a RegionPlan,
    pub(super) checker: &'a mut TenantChecker,
    pub(super) region: &'a RegionId,
    pub(super) believes_reachable: &'a mut bool,
    pub(super) held: &'a mut HeldPool,
    pub(super) ledger_fallback: &'a mut (u64, u64),
    pub(super) unclean_start_ms: Option<u64>,
    pub(super) tenant: usize,
    pub(super) region_index: usize,
    pub(super) conditions: RegionConditions,
    pub(super) now_ms: u64,
    pub(super) agent_now_ms: u64,
    pub(super) window_start_ms: u64,
    pub(super) tick_ms: u64,
    pub(super) first_grant_wait_ms: u64,
    pub(super) limit_tokens: u64,
}

impl Step<'_> {
    /// Hands over the allocator's answer in flight once it has arrived; a call past its deadline
    /// is handed over as a lost answer (the agent's call timed out).
    fn deliver_due_answer(&mut self) -> Result<(), DrillError> {
        let due = self
            .held
            .in_flight
            .as_ref()
            .is_some_and(|f| f.deliver_at_ms <= self.now_ms || f.gives_up_at_ms <= self.now_ms);
        if !due {
            return Ok(());
        }
        let Some(f) = self.held.in_flight.take() else {
            return Ok(());
        };
        if f.deliver_at_ms <= self.now_ms {
            self.deliver(f)?;
        } else {
            self.deliver(InFlight { answer: None, ..f })?;
        }
        Ok(())
    }

    /// Serves `arrivals` requests; returns whether any decision was abnormal (fallback, waiting
    /// for or lacking a grant): the terms looked up, an answer that arrived handed over, each
    /// request served, then the report and the strands of the tick.
    pub(super) async fn run(
        &mut self,
        arrivals: u64,
        config: HolderConfig,
        report_due: bool,
    ) -> Result<bool, DrillError> {
        self.look_up_terms(config);
        self.deliver_due_answer()?;
        if self.held.agent.is_none() {
            let record = self.checker.record(self.tenant, self.region_index);
            record.demand += arrivals;
            record.denied_unavailable += arrivals;
            return Ok(arrivals > 0);
        }
        let mut abnormal = false;
        for _ in 0..arrivals {
            abnormal |= self.serve_one().await?;
        }
        if report_due {
            self.report().await?;
        }
        self.tally_strands();
        Ok(abnormal)
    }

    /// The tick's requests decided by the region's gateways on their own, then the agent's side:
    /// their reports spent, ended carves settled, due assignments carved (with a renewal when the
    /// holder wants one), the ledger report and the strands. Returns whether any decision was
    /// abnormal (a fallback admit, or no pool terms).
    pub(super) async fn run_gateways(
        &mut self,
        arrivals: u64,
        config: HolderConfig,
        report_due: bool,
        plan: GatewayPlan,
    ) -> Result<bool, DrillError> {
        self.look_up_terms(config);
        self.deliver_due_answer()?;
        let gateways = self.held.gateways.get_or_insert_with(|| {
            Gateways::new(plan.per_region, plan.report_interval_ms, self.agent_now_ms)
        });
        let mut abnormal = false;
        let record = self.checker.record(self.tenant, self.region_index);
        for _ in 0..arrivals {
            let decided = gateways.decide(self.agent_now_ms);
            abnormal |= matches!(decided, Decided::Admitted(source) if source.fallback);
            if matches!(decided, Decided::Admitted(_)) {
                self.held.admitted_since_report += 1;
            }
            record_gateway_decision(record, decided, self.now_ms, self.window_start_ms);
        }
        if let Some(agent) = self.held.agent.as_mut() {
            let lease_ends = &self.held.lease_ends;
            let tended = gateways.tend(
                agent.holder_mut(),
                self.agent_now_ms,
                *self.believes_reachable,
                |id| {
                    lease_ends
                        .iter()
                        .find(|(lease, _)| *lease == id)
                        .map(|(_, end)| *end)
                },
            );
            // Waiting for a renewal is how carving keeps up with demand, not a fault: only
            // fallback admits (and no terms at all) are abnormal here.
            let _ = tended;
        } else {
            abnormal |= arrivals > 0;
        }
        self.renew().await?;
        if report_due {
            self.report().await?;
        }
        self.tally_strands();
        Ok(abnormal)
    }

    /// The agent fetches the pool's terms on first use (not while cut off), with what its region
    /// already admitted in fallback this window (as the ledger holds it), and takes over the
    /// window as the shipped agent does.
    fn look_up_terms(&mut self, config: HolderConfig) {
        if self.held.agent.is_some() || self.conditions.partitioned {
            return;
        }
        let (window_start_ms, admitted_tokens) = *self.ledger_fallback;
        let inherited = Inherited {
            ledger_fallback: (window_start_ms == self.window_start_ms).then_some(
                FallbackInWindow {
                    window_start_ms,
                    admitted_tokens,
                },
            ),
            unclean_start_ms: self.unclean_start_ms,
        };
        let (agent, _presumed) = PoolAgent::taking_over(config, inherited, self.agent_now_ms);
        self.held.agent = Some(agent);
    }

    /// One request, as the agent serves it: spend; if no lease is held, start a renewal and wait
    /// for the one in flight (up to FIRST_GRANT_WAIT), then spend again; record the outcome.
    /// Returns whether it was abnormal.
    async fn serve_one(&mut self) -> Result<bool, DrillError> {
        let kind = self.request_kind();
        let mut outcome = self.spend(0, kind);
        let mut wait_ms = 0;
        if matches!(
            outcome,
            Served::Pool(
                Spend::Denied {
                    denial: Denial::AwaitingGrant,
                    ..
                },
                _
            )
        ) {
            let answered_in_ms = self.renew().await?;
            wait_ms = match (self.held.in_flight.clone(), answered_in_ms) {
                (Some(f), _) => {
                    let arrives_in_ms = f.deliver_at_ms.saturating_sub(self.now_ms);
                    if arrives_in_ms <= self.first_grant_wait_ms {
                        self.deliver(f)?;
                        arrives_in_ms
                    } else {
                        self.first_grant_wait_ms
                    }
                }
                // Answered within the call; or nothing asked, or the call failed at once.
                (None, Some(ms)) => ms,
                (None, None) => 0,
            };
            // Spent again after the wait (a renewal unanswered past the holder's patience now
            // means fallback).
            outcome = self.spend(wait_ms, kind);
        }
        let abnormal = self.record_outcome(outcome, wait_ms);
        // As the agent: every spend may start a renewal.
        self.renew().await?;
        Ok(abnormal)
    }

    /// What a request of this region is: denied by a regional rule after its reservation, and
    /// metered beyond its estimate by how many tokens (0: not metered), drawn from the drill's
    /// own stream only when the region has either.
    fn request_kind(&mut self) -> RequestKind {
        let mut draw = |percent: u64| percent > 0 && self.kinds.random_range(0..100) < percent;
        let denied_regionally = draw(self.plan.regional_deny_percent);
        let metered = draw(self.plan.metered_percent);
        RequestKind {
            denied_regionally,
            extra_tokens: if metered { self.plan.metered_extra } else { 0 },
        }
    }

    /// Counts one request's outcome in the window's record. Returns whether it was abnormal.
    ///
    /// Long by design: it is one exhaustive match over every way a request is served and every
    /// denial a pool gives, each arm naming the counter it moves and whether the outcome is
    /// abnormal; split, a new denial could be counted in one place and judged in another, and the
    /// table of outcomes would be read in pieces.
    fn record_outcome(&mut self, served: Served, wait_ms: u64) -> bool {
        let (granted_in_window, returned_in_window) = self.checker.granted_in_window(self.tenant);
        let record = self.checker.record(self.tenant, self.region_index);
        record.demand += 1;
        if wait_ms > 0 {
            record.waited += 1;
            record.max_wait_ms = record.max_wait_ms.max(wait_ms);
        }
        let outcome = match served {
            Served::DeniedRegionally { debited } => {
                record.denied_regional += 1;
                record.denials_that_debited += u64::from(debited);
                return false;
            }
            Served::Pool(outcome, charged) => {
                if let Some(charged) = charged {
                    record.charged_extra_tokens += charged.paid_tokens + charged.owed_tokens;
                    record.written_off_tokens += charged.written_off_tokens;
                }
                outcome
            }
        };
        match outcome {
            Spend::Leased(lease) => {
                let agent = self.held.agent.as_ref();
                if agent
                    .and_then(|a| a.holder().lease_window_start_ms(lease))
                    .is_some_and(|start| start < self.window_start_ms)
                {
                    record.carried_over += 1;
                } else {
                    record.leased += 1;
                }
                if self
                    .held
                    .lease_ends
                    .iter()
                    .any(|&(id, end)| self.now_ms + wait_ms >= end && id == lease)
                {
                    record.spent_after_lease_end += 1;
                }
                self.held.admitted_since_report += 1;
                false
            }
            Spend::Fallback { .. } => {
                record.fallback += 1;
                self.held.admitted_since_report += 1;
                true
            }
            Spend::Denied { denial, .. } => match denial {
                Denial::PoolExhausted => {
                    record.denied_exhausted += 1;
                    // Tokens never granted: a region told the pool is exhausted asks again when
                    // the allocator said it may be refilled (the next window). Tokens taken back
                    // since are unheld too, and may wait for that: they count in the next figure.
                    if granted_in_window < self.limit_tokens {
                        record.denied_while_tokens_left += 1;
                    }
                    let outstanding = granted_in_window.saturating_sub(returned_in_window);
                    if self.limit_tokens.saturating_sub(outstanding) > self.limit_tokens / 20 {
                        record.denied_while_a_twentieth_left += 1;
                    }
                    false
                }
                Denial::FallbackSpent | Denial::FailClosed | Denial::FallbackAtWindowEdge => {
                    record.denied_fallback_spent += 1;
                    true
                }
                Denial::AwaitingGrant => {
                    record.denied_awaiting += 1;
                    true
                }
                Denial::WindowEnding => {
                    record.denied_window_end += 1;
                    false
                }
                // Every drill request costs 1 token (never above a chunk), and the drills' agents
                // keep no state directory (no claims).
                Denial::CostAboveChunk | Denial::FallbackUnclaimed => {
                    record.denied_unavailable += 1;
                    false
                }
            },
        }
    }

    /// The agent reports what its pool owes, as the shipped agent does, every
    /// [`REPORT_EVERY_MS`]: cut off (or slower than the call's deadline) the report fails and
    /// stays owed; taken, the ledger keeps this agent's fallback count. Either way the agent
    /// learns from it whether the allocator is reachable, as from any call. What the report's
    /// final lines leave unspent is given back through the shipped grant service, as the
    /// allocator's report route does.
    async fn report(&mut self) -> Result<(), DrillError> {
        let Some(agent) = self.held.agent.as_mut() else {
            return Ok(());
        };
        if !agent.owes_report(self.agent_now_ms) {
            return Ok(());
        }
        let parts = agent.report(self.agent_now_ms);
        if parts.is_empty() {
            return Ok(());
        }
        let answered = !self.conditions.partitioned
            && ROUND_TRIP_MS + self.conditions.added_ms < ms(CALL_TIMEOUT);
        *self.believes_reachable = answered;
        if !answered {
            return Ok(());
        }
        for part in &parts {
            for line in part.lease_lines() {
                if !line.final_report || line.unspent_tokens == 0 {
                    continue;
                }
                let taken = self
                    .allocator
                    .take_back(self.tenant, self.region_index, self.region, &line)
                    .await?;
                self.checker
                    .record(self.tenant, self.region_index)
                    .returned_tokens += taken;
            }
        }
        let Some(agent) = self.held.agent.as_mut() else {
            return Ok(());
        };
        for part in parts {
            let admitted = part.fallback_admitted_tokens();
            if admitted > 0 {
                let (window_start_ms, held) = self.ledger_fallback;
                if part.window_start_ms() > *window_start_ms {
                    *self.ledger_fallback = (part.window_start_ms(), admitted);
                } else if part.window_start_ms() == *window_start_ms {
                    *held = (*held).max(admitted);
                }
            }
            agent.reported(&part, self.agent_now_ms);
        }
        self.held.admitted_since_report = 0;
        Ok(())
    }

    /// Counts what the holder stranded this tick, and forgets lease ends long past.
    fn tally_strands(&mut self) {
        let Some(agent) = self.held.agent.as_ref() else {
            return;
        };
        let stranded = agent.holder().stranded_tokens();
        self.checker
            .record(self.tenant, self.region_index)
            .stranded_tokens += stranded - self.held.stranded_seen;
        self.held.stranded_seen = stranded;
        let horizon = self.now_ms.saturating_sub(self.tick_ms);
        self.held.lease_ends.retain(|&(_, end)| end >= horizon);
    }

    /// Spends a token `after_ms` into the tick (after a wait for a grant).
    fn spend(&mut self, after_ms: u64, kind: RequestKind) -> Served {
        let Some(agent) = self.held.agent.as_mut() else {
            return Served::Pool(
                Spend::Denied {
                    denial: Denial::FailClosed,
                    retry_after_ms: 1_000,
                },
                None,
            );
        };
        // As the agent admits a request whose global rule is the pool: reserved; then, its
        // regional rules decided, committed or cancelled.
        let at_ms = self.agent_now_ms + after_ms;
        let before = kind
            .denied_regionally
            .then(|| what_is_held(agent.holder(), at_ms));
        let reservation = match agent.reserve(1, at_ms, *self.believes_reachable, false) {
            Ok(reservation) => reservation,
            Err(refusal) => {
                let denied = Spend::Denied {
                    denial: refusal.denial,
                    retry_after_ms: refusal.retry_after_ms,
                };
                return Served::Pool(denied, None);
            }
        };
        if let Some(before) = before {
            agent.cancel(reservation);
            let debited = what_is_held(agent.holder(), at_ms) != before;
            return Served::DeniedRegionally { debited };
        }
        let spend = agent.commit(reservation);
        // A metered request settled after its response above its estimate.
        let charged = (kind.extra_tokens > 0).then(|| agent.charge(kind.extra_tokens, at_ms));
        Served::Pool(spend, charged)
    }

    /// Starts a renewal when the holder wants one and none is in flight. Returns the answer's
    /// delay, ms, when the allocator was reached (the answer is delivered at once when it arrives
    /// before the next tick).
    async fn renew(&mut self) -> Result<Option<u64>, DrillError> {
        let Some(agent) = self.held.agent.as_mut() else {
            return Ok(None);
        };
        // Lease ids are made from the agent's clock and a counter of renewals asked
        // (reproducible).
        let fresh = LeaseId::from_parts(self.agent_now_ms, self.allocator.leases_asked + 1);
        let Some(ask) = agent.renewal_to_ask(self.agent_now_ms, fresh) else {
            return Ok(None);
        };
        self.allocator.leases_asked += 1;
        let (lease_id, want_tokens) = (ask.lease_id, ask.want_tokens);
        if self.conditions.partitioned {
            // The call fails at once: nothing reached the allocator.
            let call = GrantCall::Unanswered;
            agent.renewal_answered(&call, self.agent_now_ms);
            *self.believes_reachable = call.answer().reached_allocator();
            return Ok(None);
        }
        let record = self
            .allocator
            .grant(
                self.tenant,
                self.region_index,
                self.region,
                lease_id,
                want_tokens,
            )
            .await?;
        let retry_of_committed = self.held.committed_unanswered == Some(lease_id);
        if !retry_of_committed {
            let window_start_ms = record.window_start_ms;
            self.checker.add_granted(
                self.tenant,
                self.region_index,
                window_start_ms,
                record.granted_tokens,
            );
        }
        let lost = self.conditions.loss_percent > 0
            && self.rng.random_range(0..100) < self.conditions.loss_percent;
        let gives_up_at_ms = self.now_ms + ms(CALL_TIMEOUT);
        let flight = InFlight {
            true_expires_at_ms: record.expires_at_ms,
            // A lost answer ends the call only when the agent gives up on it, as its client does.
            deliver_at_ms: if lost {
                gives_up_at_ms
            } else {
                self.now_ms + ROUND_TRIP_MS + self.conditions.added_ms
            },
            gives_up_at_ms,
            // As the agent: what is left of the lease is measured on the agent's clock from when
            // it asked.
            asked_at_ms: self.agent_now_ms,
            answer: (!lost).then_some(record),
        };
        if lost {
            self.checker
                .record(self.tenant, self.region_index)
                .answers_lost += 1;
        }
        // An answer (or, lost, the call's failure) due before the next tick is in hand for the
        // next tick's requests.
        let delay_ms = flight.deliver_at_ms - self.now_ms;
        self.held.in_flight = Some(flight.clone());
        if delay_ms < self.tick_ms {
            self.deliver(flight)?;
        }
        Ok(Some(delay_ms))
    }

    /// Hands an answer (or its loss) to the pool's agent.
    fn deliver(&mut self, flight: InFlight) -> Result<(), DrillError> {
        self.held.in_flight = None;
        let Some(agent) = self.held.agent.as_mut() else {
            return Ok(());
        };
        let Some(answer) = flight.answer else {
            let call = GrantCall::Unanswered;
            if let Some(ask) = agent.renewal_asked() {
                self.held.committed_unanswered = Some(ask.lease_id);
            }
            agent.renewal_answered(&call, self.agent_now_ms);
            *self.believes_reachable = call.answer().reached_allocator();
            return Ok(());
        };
        let call = GrantCall::Answered {
            answer: answer.clone(),
            asked_at_ms: flight.asked_at_ms,
        };
        *self.believes_reachable = call.answer().reached_allocator();
        let recovered = self.held.committed_unanswered == Some(answer.lease_id);
        if recovered {
            self.held.committed_unanswered = None;
        }
        let Some(outcome) = agent.renewal_answered(&call, self.agent_now_ms) else {
            return Ok(());
        };
        if outcome == RenewalOutcome::StaleEpoch {
            return Err(DrillError::Broken(format!(
                "a grant from a stale epoch reached the holder ({answer:?})"
            )));
        }
        if outcome.held() {
            self.held
                .lease_ends
                .push((answer.lease_id, flight.true_expires_at_ms));
            if recovered {
                self.checker
                    .record(self.tenant, self.region_index)
                    .recovered_tokens += answer.granted_tokens;
            }
        }
        Ok(())
    }
}
