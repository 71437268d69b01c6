//! The agents' side: time, renewals, requests reserved and committed, denied regionally after
//! their reservation or charged after their response, messages delivered, failovers and restarts,
//! each run through the shipped pool agent.

use allot_allocator::grants::LeaseReturn;
use allot_region_agent::global::driver::{Inherited, RenewalAnswer};
use allot_region_agent::global::{Denial, GrantCall, HolderSnapshot, PoolAgent, Refusal, Spend};
use allot_shared::ids::{Epoch, LeaseId};
use allot_shared::lease::GrantRequest;
use allot_shared::wire::{FallbackInWindow, GrantAnswer};

use super::state::{Breach, Call, GivenBack, Leader, Message, ModelState, Reply};
use super::{LeaseModel, Variant};

/// Tokens a holder has spent or admitted in fallback, as its snapshot would say.
fn used_tokens(snapshot: &HolderSnapshot) -> u64 {
    let leased: u64 = snapshot.leases.iter().map(|l| l.spent_tokens).sum();
    let fallback: u64 = snapshot.fallback.iter().map(|f| f.admitted_tokens).sum();
    leased + fallback
}

/// What an agent has spent and what it could still spend at `agent_ms`: a denial must leave both
/// as they were.
fn spent_and_spendable(agent: &PoolAgent, agent_ms: u64) -> (u64, u64) {
    (
        used_tokens(&agent.holder().snapshot(None)),
        agent.holder().available_tokens(agent_ms),
    )
}

/// Region `r`'s call is over (it gave up, or the agent restarted): its answer, if one is on its
/// way, goes nowhere, and an ask still on its way is served without one.
fn end_call(state: &mut ModelState, r: usize) {
    state.regions[r].call = None;
    let region = r as u8;
    state
        .network
        .retain(|m| !matches!(m, Message::Answer { region: to, .. } if *to == region));
    for message in &mut state.network {
        if let Message::Ask {
            region: from,
            orphan,
            ..
        } = message
            && *from == region
        {
            *orphan = true;
        }
    }
    state.network.sort();
}

impl LeaseModel {
    /// Region `region`'s `n`th lease id. Every id carries the run's start as when it was made: a
    /// run is shorter than a grant record is kept, so no lost answer is ever given up for age
    /// (`lost_answer_recoverable_until_ms`), and ids made at different steps stay one state.
    fn lease_id(&self, region: usize, n: u32) -> LeaseId {
        LeaseId::from_parts(
            self.origin_ms,
            ((region as u128) << 32) | u128::from(n) | (1 << 64),
        )
    }

    /// The agent's upkeep: start a renewal if the holder wants one and no call is out.
    fn renew(&self, state: &mut ModelState, r: usize) {
        let now_ms = self.agent_ms(state, r);
        let Some(region) = state.regions.get_mut(r) else {
            return;
        };
        if region.call.is_some() {
            return;
        }
        let fresh = self.lease_id(r, region.next_lease);
        if let Some(ask) = region.agent.renewal_to_ask(now_ms, fresh) {
            if ask.lease_id == fresh {
                region.next_lease += 1;
            }
            region.call = Some(Call {
                lease_id: ask.lease_id,
                asked_at_ms: now_ms,
            });
            state.network.push(Message::Ask {
                region: r as u8,
                orphan: false,
                lease_id: ask.lease_id,
                want_tokens: ask.want_tokens,
            });
            state.network.sort();
        }
    }

    pub(super) fn tick(&self, state: &mut ModelState) {
        let healed_before = self.healed(state);
        state.step += 1;
        for r in 0..state.regions.len() {
            let now_ms = self.agent_ms(state, r);
            let region = &mut state.regions[r];
            region.spends_this_step = 0;
            if let Some(call) = region.call
                && now_ms.saturating_sub(call.asked_at_ms) >= self.config.step_ms
            {
                if healed_before && call.asked_at_ms >= self.heal_ms(r) {
                    state.breaches |= Breach::RenewalUnansweredAfterHeal.bit();
                }
                // The call times out: no answer, so the grant may exist and the id is kept.
                let timed_out = GrantCall::Unanswered;
                region.agent.renewal_answered(&timed_out, now_ms);
                region.reachable = timed_out.answer().reached_allocator();
                end_call(state, r);
            }
            let region = &mut state.regions[r];
            if region.reachable {
                // The agent's report round: what the allocator acknowledges is done with.
                for part in region.agent.report(now_ms) {
                    region.agent.reported(&part, now_ms);
                    if self.config.give_back {
                        for line in part.lease_lines() {
                            if line.final_report && line.unspent_tokens > 0 {
                                state.network.push(Message::GiveBack {
                                    region: r as u8,
                                    line: GivenBack {
                                        lease_id: line.lease_id,
                                        spent_tokens: line.spent_tokens,
                                        unspent_tokens: line.unspent_tokens,
                                    },
                                });
                            }
                        }
                        state.network.sort();
                    }
                    let admitted = part.fallback_admitted_tokens();
                    if self.tracks_fallback() && admitted > 0 {
                        let held = state
                            .ledger_fallback
                            .entry((part.window_start_ms(), r as u8))
                            .or_default();
                        *held = (*held).max(admitted);
                    }
                }
            }
            region.journal = region.agent.journal(None);
            self.renew(state, r);
        }
        self.close_windows(state, self.now_ms(state));
    }

    /// Windows that ended are checked against the bound and forgotten, and grant records past
    /// their retention (a window past the window's end) vanish, as the store's lease removes
    /// them: states that differ only in history become one.
    fn close_windows(&self, state: &mut ModelState, now_ms: u64) {
        let current_start_ms = self.pool.window_at(now_ms).start_ms;
        let bound_tokens = self.bound_tokens;
        let mut over = false;
        state.admitted.retain(|&start_ms, &mut admitted| {
            over |= admitted > bound_tokens;
            start_ms >= current_start_ms
        });
        state
            .fallback_admitted
            .retain(|&(start_ms, _), _| start_ms >= current_start_ms);
        state
            .ledger_fallback
            .retain(|&(start_ms, _), _| start_ms >= current_start_ms);
        if over {
            state.breaches |= Breach::OverBound.bit();
        }
        state.allocator.records.retain(|_, record| {
            let length_ms = record.window_end_ms - record.window_start_ms;
            record.window_end_ms + length_ms > now_ms
        });
        // A mark lives on its grant record's store lease.
        let records = &state.allocator.records;
        state
            .allocator
            .returned
            .retain(|lease| records.contains_key(lease));
    }

    /// The heal, on agent `a`'s clock.
    fn heal_ms(&self, a: usize) -> u64 {
        (self.origin_ms + u64::from(self.config.heal_at_step) * self.config.step_ms)
            .saturating_add_signed(self.clock_offset_ms(a))
    }

    /// Agent `r` admits one request as the service does (reserving, claiming fallback durably when
    /// it must, committing), records which of the model's properties the outcome breaks, then
    /// renews if it wants to.
    ///
    /// Long by design: the properties it checks need the moments around the spend in one place: the
    /// holder's figures taken before the reservation are compared after a denial, and the request
    /// is decided on the agent's clock but judged on the allocator's; split, those figures and both
    /// clocks would be passed to every check.
    pub(super) fn spend(&self, state: &mut ModelState, r: usize) {
        // The request is decided on the agent's clock and checked on the allocator's.
        let now_ms = self.now_ms(state);
        let agent_ms = self.agent_ms(state, r);
        let Some(region) = state.regions.get_mut(r) else {
            return;
        };
        region.spends_this_step += 1;
        let before = spent_and_spendable(&region.agent, agent_ms);
        let mut reserved = region.agent.reserve(1, agent_ms, region.reachable, false);
        if let Err(Refusal {
            denial: Denial::FallbackUnclaimed,
            ..
        }) = reserved
            && let Some((window_start_ms, claimed)) =
                region.agent.fallback_claim_wanted(1, agent_ms)
        {
            // The agent makes the claim durable (journal written and synced), then admits.
            region.journal = region.agent.journal(Some((window_start_ms, claimed)));
            region.agent.claim_durable(window_start_ms, claimed);
            reserved = region.agent.reserve(1, agent_ms, region.reachable, false);
        }
        // The pool is the request's only rule: admitted, what it reserved is committed.
        let outcome = match reserved {
            Ok(reservation) => region.agent.commit(reservation),
            Err(refusal) => Spend::Denied {
                denial: refusal.denial,
                retry_after_ms: refusal.retry_after_ms,
            },
        };
        let window_start_ms = self.pool.window_at(now_ms).start_ms;
        match outcome {
            Spend::Leased(lease_id) => {
                match state.allocator.records.get(&lease_id) {
                    Some(record) => {
                        if now_ms >= record.expires_at_ms {
                            state.breaches |= Breach::SpentPastLeaseEnd.bit();
                        }
                        if !(record.window_start_ms..record.window_end_ms).contains(&now_ms) {
                            state.breaches |= Breach::SpentOutsideWindow.bit();
                        }
                    }
                    None => state.breaches |= Breach::SpentPastLeaseEnd.bit(),
                }
                *state.admitted.entry(window_start_ms).or_default() += 1;
            }
            Spend::Fallback { .. } => {
                *state.admitted.entry(window_start_ms).or_default() += 1;
                if self.tracks_fallback() {
                    *state
                        .fallback_admitted
                        .entry((window_start_ms, r as u8))
                        .or_default() += 1;
                    // The region's agents together, against the region's allowance.
                    let region = self.agent_regions[r];
                    let regions_admits: u64 = state
                        .fallback_admitted
                        .iter()
                        .filter(|&(&(start_ms, agent), _)| {
                            start_ms == window_start_ms
                                && self.agent_regions[usize::from(agent)] == region
                        })
                        .map(|(_, admitted)| *admitted)
                        .sum();
                    if regions_admits > self.config.fallback_per_region_tokens {
                        state.breaches |= Breach::FallbackOverAllowance.bit();
                    }
                }
            }
            Spend::Denied { .. } => {
                let region = &mut state.regions[r];
                let after = spent_and_spendable(&region.agent, agent_ms);
                if after != before {
                    state.breaches |= Breach::DenialDebited.bit();
                }
            }
        }
        self.renew(state, r);
    }

    /// Message `index` arrives (an ask at `leader`); with `round_trip`, an ask's answer arrives at
    /// once too.
    pub(super) fn deliver(
        &self,
        state: &mut ModelState,
        index: usize,
        leader: usize,
        round_trip: bool,
    ) {
        let now_ms = self.now_ms(state);
        let message = state.network.remove(index);
        match message {
            Message::Ask {
                region,
                orphan,
                lease_id,
                want_tokens,
            } => {
                let request = GrantRequest {
                    lease_id,
                    region: self.regions[self.agent_regions[usize::from(region)]].clone(),
                    want_tokens,
                };
                let reply = state.allocator.serve(self, leader, &request, now_ms);
                if !orphan {
                    state.network.push(Message::Answer {
                        region,
                        lease_id,
                        reply,
                    });
                    state.network.sort();
                    if round_trip
                        && let Some(index) = state.network.iter().position(|m| {
                            matches!(m, Message::Answer { region: to, lease_id: id, .. }
                                if *to == region && *id == lease_id)
                        })
                    {
                        self.deliver(state, index, 0, false);
                    }
                }
            }
            Message::Answer {
                region: r,
                lease_id,
                reply,
            } => {
                let r = usize::from(r);
                let now_ms = self.agent_ms(state, r);
                let region = &mut state.regions[r];
                // Answers of calls that ended are dropped with them (see `end_call`).
                let Some(call) = region.call.filter(|c| c.lease_id == lease_id) else {
                    return;
                };
                let grant_call = match &reply {
                    Reply::Grant(answer) => self.grant_call(answer, call.asked_at_ms, now_ms),
                    Reply::Refused => GrantCall::Refused,
                    Reply::NotLeader => GrantCall::Unanswered,
                };
                let answer = grant_call.answer();
                let Some(outcome) = region.agent.renewal_answered(&grant_call, now_ms) else {
                    return;
                };
                if let (true, RenewalAnswer::Granted(grant)) = (outcome.held(), answer) {
                    if grant.epoch < region.highest_epoch_held {
                        state.breaches |= Breach::StaleEpochHeld.bit();
                    }
                    region.highest_epoch_held = region.highest_epoch_held.max(grant.epoch);
                }
                region.reachable = answer.reached_allocator();
                end_call(state, r);
                self.renew(state, r);
            }
            Message::GiveBack { region, line } => self.give_back(state, leader, region, line),
        }
    }

    /// Agent `region`'s final `line` reaches leader `leader`, which takes back what it gives.
    fn give_back(&self, state: &mut ModelState, leader: usize, region: u8, line: GivenBack) {
        let lease = LeaseReturn {
            lease_id: line.lease_id,
            region: self.regions[self.agent_regions[usize::from(region)]].clone(),
            spent_tokens: line.spent_tokens,
            unspent_tokens: line.unspent_tokens,
        };
        let now_ms = self.now_ms(state);
        state.allocator.take_back(self, leader, &lease, now_ms);
    }

    /// The call's outcome as the agent's transport gives it: `answer`, to a call asked at
    /// `asked_at_ms`, arriving at `now_ms`.
    fn grant_call(&self, answer: &GrantAnswer, asked_at_ms: u64, now_ms: u64) -> GrantCall {
        match self.config.variant {
            // Timed as if new: from its arrival, for the lease's whole original length.
            Variant::RecoveredTimedFromReceipt => GrantCall::Answered {
                answer: GrantAnswer {
                    answered_at_ms: answer.issued_at_ms,
                    ..answer.clone()
                },
                asked_at_ms: now_ms,
            },
            _ => GrantCall::Answered {
                answer: answer.clone(),
                asked_at_ms,
            },
        }
    }

    /// A request at agent `r` reserves its token, and a regional rule denies it: the reservation
    /// is cancelled, and nothing spent or spendable may have moved.
    pub(super) fn deny_regionally(&self, state: &mut ModelState, r: usize) {
        let agent_ms = self.agent_ms(state, r);
        let Some(region) = state.regions.get_mut(r) else {
            return;
        };
        region.spends_this_step += 1;
        let before = spent_and_spendable(&region.agent, agent_ms);
        if let Ok(reservation) = region.agent.reserve(1, agent_ms, region.reachable, false) {
            region.agent.cancel(reservation);
        }
        let after = spent_and_spendable(&region.agent, agent_ms);
        if after != before {
            state.breaches |= Breach::DenialDebited.bit();
        }
        self.renew(state, r);
    }

    /// A metered request agent `r` admitted is settled a token above its estimate: what its
    /// leases pay and what it owes are consumed in the window (the bound's settle-debt term
    /// covers what is owed); what is written off was never charged, and is outside the bound.
    pub(super) fn charge(&self, state: &mut ModelState, r: usize) {
        let now_ms = self.now_ms(state);
        let agent_ms = self.agent_ms(state, r);
        let Some(region) = state.regions.get_mut(r) else {
            return;
        };
        let charged = region.agent.charge(1, agent_ms);
        let window_start_ms = self.pool.window_at(now_ms).start_ms;
        *state.admitted.entry(window_start_ms).or_default() +=
            charged.paid_tokens + charged.owed_tokens;
        self.renew(state, r);
    }

    /// Every ask in flight served by `leader` in one batch and committed together; the answers
    /// arrive at once, in the asks' order.
    pub(super) fn round_trip_all(&self, state: &mut ModelState, leader: usize) {
        let now_ms = self.now_ms(state);
        let (asks, rest): (Vec<Message>, Vec<Message>) = std::mem::take(&mut state.network)
            .into_iter()
            .partition(|m| matches!(m, Message::Ask { .. }));
        state.network = rest;
        let requests: Vec<GrantRequest> = asks
            .iter()
            .filter_map(|m| match m {
                Message::Ask {
                    region,
                    lease_id,
                    want_tokens,
                    ..
                } => Some(GrantRequest {
                    lease_id: *lease_id,
                    region: self.regions[self.agent_regions[usize::from(*region)]].clone(),
                    want_tokens: *want_tokens,
                }),
                Message::Answer { .. } | Message::GiveBack { .. } => None,
            })
            .collect();
        let replies = state.allocator.serve_batch(self, leader, &requests, now_ms);
        let mut answered = Vec::new();
        for (ask, reply) in asks.into_iter().zip(replies) {
            if let Message::Ask {
                region,
                orphan: false,
                lease_id,
                ..
            } = ask
            {
                answered.push((region, lease_id));
                state.network.push(Message::Answer {
                    region,
                    lease_id,
                    reply,
                });
            }
        }
        state.network.sort();
        // The batch's answers arrive at once, each where its call waits.
        for (to, id) in answered {
            if let Some(index) = state.network.iter().position(|m| {
                matches!(m, Message::Answer { region, lease_id, .. } if *region == to && *lease_id == id)
            }) {
                self.deliver(state, index, 0, false);
            }
        }
    }

    pub(super) fn fail_over(&self, state: &mut ModelState) {
        let allocator = &mut state.allocator;
        allocator.epoch = Epoch(allocator.epoch.0 + 1);
        let leader = Leader {
            epoch: allocator.epoch,
            window: allocator.window.clone(),
            revision: allocator.window_revision,
        };
        allocator.leaders.push(leader);
        if allocator.leaders.len() > 2 {
            allocator.leaders.remove(0);
        }
    }

    pub(super) fn restart(&self, state: &mut ModelState, r: usize) {
        // The session record is stamped on the allocator's clock; the new run takes over the
        // window it is in on its own.
        let allocator_ms = self.now_ms(state);
        let now_ms = self.agent_ms(state, r);
        let Some(region) = state.regions.get_mut(r) else {
            return;
        };
        let config = self.holders[r].clone();
        region.agent =
            if self.config.state_dir {
                PoolAgent::restored(config, &region.journal)
            } else {
                // A crash never ends the run's session: the new run is told so, and takes over the
                // window from the ledger's count of its own fallback (the ledger keeps each agent's).
                let window_start_ms = self.pool.window_at(now_ms).start_ms;
                let ledger_fallback = state.ledger_fallback.get(&(window_start_ms, r as u8)).map(
                    |&admitted_tokens| FallbackInWindow {
                        window_start_ms,
                        admitted_tokens,
                    },
                );
                let unclean_start_ms =
                    (self.config.variant != Variant::UncleanRestartTrusted).then_some(allocator_ms);
                let inherited = Inherited {
                    ledger_fallback,
                    unclean_start_ms,
                };
                PoolAgent::taking_over(config, inherited, now_ms).0
            };
        region.reachable = true;
        region.highest_epoch_held = region.agent.holder().highest_epoch();
        end_call(state, r);
    }
}
