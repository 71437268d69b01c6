//! The model as the checker explores it: initial states, the actions each state allows, the next
//! state of each, and the properties.

use std::collections::BTreeMap;

use allot_region_agent::global::driver::Inherited;
use allot_region_agent::global::{PoolAgent, PoolJournal};
use allot_shared::ids::Epoch;
use stateright::{Model, Property};

use super::state::{Action, Allocator, Breach, Leader, Message, ModelState, Region};
use super::{
    ADMITS_IN_FALLBACK, DENIAL_DEBITS_NOTHING, FALLBACK_WITHIN_ALLOWANCE, GIVES_BACK,
    HOLDS_AFTER_FAILOVER, LeaseModel, NO_STALE_EPOCH, REACHES_LIMIT, RESUMES_AFTER_HEAL, SAFETY,
    SPENT_IN_LEASE_LIFE, SPENT_IN_WINDOW, WITHIN_BOUND,
};

impl Model for LeaseModel {
    type State = ModelState;
    type Action = Action;

    fn init_states(&self) -> Vec<ModelState> {
        let agents = self
            .holders
            .iter()
            .map(|holder| Region {
                agent: PoolAgent::taking_over(holder.clone(), Inherited::default(), self.origin_ms)
                    .0,
                call: None,
                reachable: true,
                next_lease: 0,
                journal: PoolJournal::default(),
                spends_this_step: 0,
                highest_epoch_held: Epoch(0),
            })
            .collect();
        vec![ModelState {
            step: 0,
            allocator: Allocator {
                epoch: Epoch(1),
                window: None,
                window_revision: 0,
                records: BTreeMap::new(),
                returned: std::collections::BTreeSet::new(),
                leaders: vec![Leader {
                    epoch: Epoch(1),
                    window: None,
                    revision: 0,
                }],
            },
            regions: agents,
            network: Vec::new(),
            losses: self.config.losses,
            duplicates: self.config.duplicates,
            failovers: self.config.failovers,
            restarts: self.config.restarts,
            regional_denials: self.config.regional_denials,
            charges: self.config.charges,
            admitted: BTreeMap::new(),
            fallback_admitted: BTreeMap::new(),
            ledger_fallback: BTreeMap::new(),
            breaches: 0,
        }]
    }

    /// Every action the checker may take from `state`: time moving on, spends, deliveries, and the
    /// faults still allowed before the heal; none once a checked property is broken.
    ///
    /// Long by design: it is the model's whole list of what can happen next, each action guarded by
    /// the same two facts (whether the heal has come, what fault budget is left); split, those
    /// guards would be read in several places, and an action allowed after the heal would be harder
    /// to spot.
    fn actions(&self, state: &ModelState, actions: &mut Vec<Action>) {
        let broken = SAFETY
            .iter()
            .any(|&(name, breach)| self.checks(name) && !self.keeps(breach, state));
        if broken {
            // A breach of a checked property ends the behaviour: its trace is the shortest one
            // that shows it, and the states past it are not worth exploring.
            return;
        }
        let healed = self.healed(state);
        let demand_met = state
            .regions
            .iter()
            .all(|r| r.spends_this_step >= self.config.spends_per_step);
        if state.step < self.config.steps && demand_met && (!healed || state.network.is_empty()) {
            actions.push(Action::Tick);
        }
        for (r, region) in state.regions.iter().enumerate() {
            if region.spends_this_step < self.config.spends_per_step {
                actions.push(Action::Spend(r as u8));
                if state.regional_denials > 0 {
                    actions.push(Action::DenyRegionally(r as u8));
                }
            }
            if state.charges > 0 {
                actions.push(Action::Charge(r as u8));
            }
        }
        let asks = state
            .network
            .iter()
            .filter(|m| matches!(m, Message::Ask { .. }))
            .count();
        if self.config.batches && asks > 1 {
            for leader in 0..state.allocator.leaders.len() as u8 {
                actions.push(Action::RoundTripAll { leader });
            }
        }
        let leaders = state.allocator.leaders.len() as u8;
        for (index, message) in state.network.iter().enumerate() {
            // Equal messages lead to equal states: try the first of a run only.
            if index > 0 && state.network[index - 1] == *message {
                continue;
            }
            let index = index as u8;
            match message {
                Message::Ask { .. } => {
                    for leader in 0..leaders {
                        actions.push(Action::RoundTrip { index, leader });
                        if !healed {
                            // Served now, answered later (or never).
                            actions.push(Action::Deliver { index, leader });
                        }
                    }
                    if !healed && state.duplicates > 0 {
                        actions.push(Action::Duplicate(index));
                    }
                }
                Message::Answer { .. } => actions.push(Action::Deliver { index, leader: 0 }),
                Message::GiveBack { .. } => {
                    for leader in 0..leaders {
                        actions.push(Action::Deliver { index, leader });
                    }
                    if !healed && state.duplicates > 0 {
                        actions.push(Action::Duplicate(index));
                    }
                }
            }
            if !healed && state.losses > 0 {
                actions.push(Action::Lose(index));
            }
        }
        if !healed && state.failovers > 0 {
            actions.push(Action::FailOver);
        }
        if !healed && state.restarts > 0 {
            for r in 0..state.regions.len() {
                actions.push(Action::Restart(r as u8));
            }
        }
    }

    fn next_state(&self, last: &ModelState, action: Action) -> Option<ModelState> {
        let mut state = last.clone();
        match action {
            Action::Tick => self.tick(&mut state),
            Action::Spend(r) => self.spend(&mut state, usize::from(r)),
            Action::RoundTrip { index, leader } => {
                self.deliver(&mut state, usize::from(index), usize::from(leader), true)
            }
            Action::Deliver { index, leader } => {
                self.deliver(&mut state, usize::from(index), usize::from(leader), false)
            }
            Action::Lose(index) => {
                state.losses -= 1;
                state.network.remove(usize::from(index));
            }
            Action::Duplicate(index) => {
                state.duplicates -= 1;
                let copy = state.network[usize::from(index)].clone();
                state.network.push(copy);
                state.network.sort();
            }
            Action::FailOver => {
                state.failovers -= 1;
                self.fail_over(&mut state);
            }
            Action::Restart(r) => {
                state.restarts -= 1;
                self.restart(&mut state, usize::from(r));
            }
            Action::DenyRegionally(r) => {
                state.regional_denials -= 1;
                self.deny_regionally(&mut state, usize::from(r));
            }
            Action::Charge(r) => {
                state.charges -= 1;
                self.charge(&mut state, usize::from(r));
            }
            Action::RoundTripAll { leader } => {
                self.round_trip_all(&mut state, usize::from(leader));
            }
        }
        Some(state)
    }

    fn properties(&self) -> Vec<Property<Self>> {
        let always = |name, keeps: fn(&Self, &ModelState) -> bool| Property::always(name, keeps);
        let mut properties = vec![
            always(WITHIN_BOUND, |m, s| m.keeps(Breach::OverBound, s)),
            always(SPENT_IN_LEASE_LIFE, |m, s| {
                m.keeps(Breach::SpentPastLeaseEnd, s)
            }),
            always(SPENT_IN_WINDOW, |m, s| {
                m.keeps(Breach::SpentOutsideWindow, s)
            }),
            always(NO_STALE_EPOCH, |m, s| m.keeps(Breach::StaleEpochHeld, s)),
            always(DENIAL_DEBITS_NOTHING, |m, s| {
                m.keeps(Breach::DenialDebited, s)
            }),
            always(RESUMES_AFTER_HEAL, |m, s| {
                m.keeps(Breach::RenewalUnansweredAfterHeal, s)
            }),
            always(FALLBACK_WITHIN_ALLOWANCE, |m, s| {
                m.keeps(Breach::FallbackOverAllowance, s)
            }),
            Property::sometimes(REACHES_LIMIT, |model: &Self, state: &ModelState| {
                state
                    .admitted
                    .values()
                    .any(|&a| a >= model.config.limit_tokens)
            }),
            Property::sometimes(HOLDS_AFTER_FAILOVER, |_: &Self, state: &ModelState| {
                state
                    .regions
                    .iter()
                    .any(|r| r.highest_epoch_held > Epoch(1))
            }),
            Property::sometimes(GIVES_BACK, |_: &Self, state: &ModelState| {
                !state.allocator.returned.is_empty()
            }),
            Property::sometimes(ADMITS_IN_FALLBACK, |_: &Self, state: &ModelState| {
                state.regions.iter().any(|r| {
                    r.agent
                        .holder()
                        .snapshot(None)
                        .fallback
                        .iter()
                        .any(|f| f.admitted_tokens > 0)
                })
            }),
        ];
        properties.retain(|p| self.checks(p.name));
        properties
    }
}

impl LeaseModel {
    /// Whether `state` keeps the property `breach` would break.
    fn keeps(&self, breach: Breach, state: &ModelState) -> bool {
        !state.breached(breach)
            && (breach != Breach::OverBound
                || state.admitted.values().all(|&a| a <= self.bound_tokens))
    }

    /// Whether the property `name` is checked: all are, unless the model is
    /// [`checking_only`](Self::checking_only) one.
    fn checks(&self, name: &str) -> bool {
        self.only.is_none_or(|only| only == name)
    }
}
