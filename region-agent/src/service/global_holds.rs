//! A request's global rules: each rule's cost reserved from its pool's agent (from leases, or in
//! fallback), all or none across a request's rules (and an Envoy call's several requests); a
//! hold settled once, committed when the request is admitted, cancelled otherwise; what waits a
//! reservation pass may make (a renewal under way, a fallback claim), and the decision a refusal
//! becomes.

use std::sync::Arc;

use allot_shared::contract::{AdmissionRequest, Decision, DeniedScope, Reason};
use allot_shared::ids::{PoolId, RuleId, TenantId};
use allot_shared::policy::{Limit, Rule};

use super::Agent;
use super::pool_slot::PoolSlot;
use super::pools::{TERMS_RETRY_MS, global_cost_tokens};
use super::settings::FIRST_GRANT_WAIT;
use super::settings::{AWAITING_GRANT_RETRY_MS, RETRY_JITTER_MAX_MS};
use crate::global::{Denial, Refusal, Reservation};

/// Most reservation passes over a request's global rules: one per kind of wait (a renewal, a
/// fallback claim), one more for a pool forgotten meanwhile, and the last.
const MAX_RESERVATION_PASSES: usize = 4;

/// One reservation attempt.
enum Attempt {
    Reserved(Reservation),
    Refused(Refusal),
    /// The pool was forgotten since it was looked up.
    Evicted,
}

/// What a reservation pass must wait for before the next.
#[derive(Debug, Clone, Copy)]
enum Wait {
    /// The pool's slot again.
    Lookup,
    /// The renewal under way.
    Grant,
    /// A durable fallback claim for this many tokens.
    Claim(u64),
}

/// The refusal of a pool whose terms cannot be had (or whose fallback claim cannot be written).
fn fail_closed() -> GlobalRefusal {
    GlobalRefusal {
        refusal: Refusal {
            denial: Denial::FailClosed,
            retry_after_ms: TERMS_RETRY_MS,
        },
        limit_tokens: 0,
    }
}

/// Why a global rule refused, with what the decision reports.
#[derive(Debug, Clone, Copy)]
struct GlobalRefusal {
    refusal: Refusal,
    /// `G` of the pool's terms in force (0 when unknown).
    limit_tokens: u64,
}

/// The global reservations of one request. Settled once: committed when the request is admitted,
/// cancelled otherwise, and cancelled when dropped unsettled (a gateway that went away
/// mid-decision must not leave tokens reserved).
#[derive(Default)]
pub(super) struct GlobalHold {
    /// (the pool's slot, the reservation, the rule it is for).
    held: Vec<(Arc<PoolSlot>, Reservation, RuleId)>,
    /// A dry run's: a rule would have been admitted from a fallback allowance not yet claimed.
    would_claim_fallback: bool,
}

impl GlobalHold {
    /// Whether any reservation came (or, for a dry run, would come) from a fallback allowance.
    pub(super) fn uses_fallback(&self) -> bool {
        self.would_claim_fallback || self.held.iter().any(|(_, r, _)| r.is_fallback())
    }

    /// Spends every reservation. Returns whether any came from a fallback allowance.
    fn commit(mut self, tenant: &TenantId) -> bool {
        let mut fallback = false;
        for (slot, reservation, _) in self.held.drain(..) {
            if reservation.is_fallback() {
                fallback = true;
                metrics::counter!(crate::metrics::FALLBACK_ADMITS,
                    "tenant" => tenant.to_string(), "pool" => slot.pool().to_string())
                .increment(1);
            }
            slot.agent().commit(reservation);
        }
        fallback
    }
}

impl Drop for GlobalHold {
    fn drop(&mut self) {
        for (slot, reservation, _) in self.held.drain(..) {
            slot.agent().cancel(reservation);
        }
    }
}

impl Agent {
    /// Reserves every global rule's cost, in bundle order; the first refusal cancels what was
    /// reserved and is the decision. See [`reserve_global_all`](Self::reserve_global_all).
    pub(super) async fn reserve_global(
        self: &Arc<Self>,
        request: &AdmissionRequest,
        version: u64,
        rules: &[&Rule],
    ) -> Result<GlobalHold, Decision> {
        // Most requests have no global rule: nothing to look up, nothing to allocate.
        if rules.is_empty() {
            return Ok(GlobalHold::default());
        }
        let mut holds = self
            .reserve_global_all(&[(request, rules)], version)
            .await?;
        Ok(holds.pop().unwrap_or_default())
    }

    /// Spends `request`'s admitted hold: its reservations committed, the report loop told.
    /// Whether any came from a fallback allowance. No await: a call dropped after the decision
    /// cannot leave part of it committed.
    pub(super) fn commit_global(&self, request: &AdmissionRequest, hold: GlobalHold) -> bool {
        if hold.held.is_empty() {
            return false;
        }
        let fallback = hold.commit(&request.tenant_id);
        self.note_change();
        fallback
    }

    /// Reserves the global rules of several requests, all or none: a hold per request, or the
    /// first refusal (of the request it names), with everything reserved cancelled.
    ///
    /// Nothing is held while anything is awaited, so a reservation never outlives the regional
    /// hold: every rule's pool is looked up first; then one pass reserves every rule of every
    /// request with no wait in between. A rule that must wait (for a renewal under way, or for a
    /// fallback claim to be written) ends the pass: everything held is cancelled, the wait happens,
    /// and the pass starts again (each kind of wait at most once).
    ///
    /// Long by design: the rule that nothing is held across an await is kept by the shape of one
    /// loop: a pass reserves without awaiting and breaks out on the first wait, the holds are
    /// dropped, and only then does it wait, with each kind of wait allowed once across passes;
    /// split, the holds would cross a function boundary, where an await could be added while they
    /// are still held.
    pub(super) async fn reserve_global_all(
        self: &Arc<Self>,
        requests: &[(&AdmissionRequest, &[&Rule])],
        version: u64,
    ) -> Result<Vec<GlobalHold>, Decision> {
        // (the request's index, its rule, the rule's pool and slot), in order.
        let mut pools: Vec<(usize, &Rule, &PoolId, Arc<PoolSlot>)> = Vec::new();
        for (index, (request, rules)) in requests.iter().enumerate() {
            for rule in rules.iter() {
                let Limit::Global(pool) = &rule.limit else {
                    continue;
                };
                match self.slot(&request.tenant_id, pool).await {
                    Some(slot) => pools.push((index, rule, pool, slot)),
                    None => return Err(self.global_denial(request, version, rule, fail_closed())),
                }
            }
        }
        let (mut waited_for_grant, mut claimed) = (false, false);
        for _pass in 0..MAX_RESERVATION_PASSES {
            let mut holds: Vec<GlobalHold> =
                requests.iter().map(|_| GlobalHold::default()).collect();
            let mut wait = None;
            for (at, (index, rule, pool, slot)) in pools.iter().enumerate() {
                let request = requests[*index].0;
                let tenant = &request.tenant_id;
                let cost_tokens = global_cost_tokens(rule, request);
                match self.try_reserve(tenant, pool, slot, cost_tokens, request.dry_run) {
                    Attempt::Reserved(reservation) => {
                        holds[*index]
                            .held
                            .push((slot.clone(), reservation, rule.id.clone()));
                    }
                    Attempt::Evicted => {
                        wait = Some((at, Wait::Lookup));
                        break;
                    }
                    Attempt::Refused(refusal)
                        if request.dry_run && refusal.denial == Denial::FallbackUnclaimed =>
                    {
                        // Would be admitted once claimed; a dry run claims nothing.
                        holds[*index].would_claim_fallback = true;
                    }
                    Attempt::Refused(refusal) => {
                        if !waited_for_grant && !request.dry_run {
                            count_depletion(tenant, pool, refusal.denial);
                        }
                        let next = match refusal.denial {
                            Denial::AwaitingGrant if !waited_for_grant => Some(Wait::Grant),
                            Denial::FallbackUnclaimed if !claimed => Some(Wait::Claim(cost_tokens)),
                            _ => None,
                        };
                        let Some(next) = next else {
                            let limit_tokens = slot.limit_at(self.clock.now_ms());
                            let refused = GlobalRefusal {
                                refusal,
                                limit_tokens,
                            };
                            return Err(self.global_denial(request, version, rule, refused));
                        };
                        wait = Some((at, next));
                        break;
                    }
                }
            }
            let Some((at, wait)) = wait else {
                return Ok(holds);
            };
            // Nothing stays reserved while this request waits.
            drop(holds);
            let (index, rule, pool, slot) = &mut pools[at];
            let request = requests[*index].0;
            let tenant = &request.tenant_id;
            match wait {
                Wait::Lookup => match self.slot(tenant, pool).await {
                    Some(fresh) => *slot = fresh,
                    None => return Err(self.global_denial(request, version, rule, fail_closed())),
                },
                Wait::Grant => {
                    waited_for_grant = true;
                    self.wait_for_renewal(tenant, pool, slot).await;
                }
                Wait::Claim(cost_tokens) => {
                    claimed = true;
                    if !self.claim_fallback(tenant, pool, slot, cost_tokens).await {
                        return Err(self.global_denial(request, version, rule, fail_closed()));
                    }
                }
            }
        }
        let Some((index, rule, _, slot)) = pools.last() else {
            return Ok(requests.iter().map(|_| GlobalHold::default()).collect());
        };
        let refused = GlobalRefusal {
            refusal: Refusal {
                denial: Denial::AwaitingGrant,
                retry_after_ms: AWAITING_GRANT_RETRY_MS,
            },
            limit_tokens: slot.limit_at(self.clock.now_ms()),
        };
        Err(self.global_denial(requests[*index].0, version, rule, refused))
    }

    /// One reservation attempt on a pool's holder, without waiting for anything; starts a renewal
    /// when the holder wants one.
    fn try_reserve(
        self: &Arc<Self>,
        tenant: &TenantId,
        pool: &PoolId,
        slot: &Arc<PoolSlot>,
        cost_tokens: u64,
        dry_run: bool,
    ) -> Attempt {
        let now_ms = self.clock.now_ms();
        let reserved = {
            let mut agent = slot.agent();
            // Forgotten since it was looked up (idle for minutes): look it up again.
            if slot.is_evicted() {
                return Attempt::Evicted;
            }
            agent.reserve(cost_tokens, now_ms, self.allocator_reachable(), dry_run)
        };
        self.renew_if_wanted(tenant, pool, slot);
        match reserved {
            Ok(reservation) => Attempt::Reserved(reservation),
            Err(refusal) => Attempt::Refused(refusal),
        }
    }

    /// Waits (up to [`FIRST_GRANT_WAIT`]) for the renewal under way for `slot`, if any.
    async fn wait_for_renewal(
        self: &Arc<Self>,
        tenant: &TenantId,
        pool: &PoolId,
        slot: &Arc<PoolSlot>,
    ) {
        // Registered before a renewal can start (or be seen as under way), so its end cannot be
        // missed.
        let renewed = slot.renewal_ended();
        tokio::pin!(renewed);
        renewed.as_mut().enable();
        self.renew_if_wanted(tenant, pool, slot);
        // None under way: it already ended, or none was wanted; try again at once. One unanswered
        // past the holder's patience makes the next try fall back.
        if slot.agent().renewal_in_flight() {
            let _ = tokio::time::timeout(FIRST_GRANT_WAIT, renewed).await;
        }
    }

    /// The decision for a global rule's refusal.
    fn global_denial(
        &self,
        request: &AdmissionRequest,
        version: u64,
        rule: &Rule,
        refused: GlobalRefusal,
    ) -> Decision {
        let Refusal {
            denial,
            retry_after_ms,
        } = refused.refusal;
        let (reason, fallback, retry_after_ms) = match denial {
            Denial::PoolExhausted => (Reason::RateExceeded, false, jittered(retry_after_ms)),
            Denial::FallbackSpent => (Reason::RateExceeded, true, jittered(retry_after_ms)),
            // The window's quota can no longer be leased; the pool refills when it ends.
            Denial::WindowEnding => (Reason::RateExceeded, false, jittered(retry_after_ms)),
            // Tokens are on their way: a burst beyond what is held, not an outage.
            Denial::AwaitingGrant => (
                Reason::RateExceeded,
                false,
                jittered(retry_after_ms.max(AWAITING_GRANT_RETRY_MS)),
            ),
            Denial::CostAboveChunk => (Reason::CostTooHigh, false, -1),
            // A fallback claim that could not be made durable: refused rather than admitted
            // beyond what a restart would know. At a window's edge, the agent cannot tell which
            // window the allocator's clock is in: refused until the edge has passed.
            Denial::FailClosed | Denial::FallbackUnclaimed | Denial::FallbackAtWindowEdge => (
                Reason::LimiterUnavailable,
                false,
                i64::try_from(retry_after_ms).unwrap_or(i64::MAX),
            ),
        };
        Decision {
            allowed: false,
            decision_id: request.request_id.clone(),
            policy_id: Some(rule.id.to_string()),
            policy_version: version,
            denied_scope: Some(DeniedScope::Global),
            reason: Some(reason),
            limit_units: refused.limit_tokens,
            remaining_units: 0,
            retry_after_ms,
            fallback,
            dry_run: false,
            violations: Vec::new(),
            settle_by_ms: None,
        }
    }

    /// An admission named by its most constraining rule, pools included: the one with the smallest
    /// share left (`remaining / limit`). A pool's figures are those `GET /v1/quota` shows: `G`,
    /// and what is left as the allocator last said plus what this agent holds (what it holds,
    /// before the allocator's first answer in the window), after this request. A rule the
    /// decision already names (the regional rules' most constraining) keeps its place on a tie,
    /// and against a pool the allocator has said nothing of in this window (in fallback, or
    /// before its first answer, what the agent holds is no measure of what the pool has left); a
    /// denial is left as it is (it names the rule that denied). Most admissions hold no pool:
    /// they return at once.
    pub(super) fn with_pool_figures(&self, mut decision: Decision, hold: &GlobalHold) -> Decision {
        if !decision.allowed || hold.held.is_empty() {
            return decision;
        }
        let now_ms = self.clock.now_ms();
        let regional = decision
            .policy_id
            .as_ref()
            .filter(|_| decision.limit_units > 0)
            .map(|_| (decision.remaining_units, decision.limit_units));
        let mut most_constraining: Option<(Option<&RuleId>, u64, u64)> =
            regional.map(|(remaining, limit)| (None, remaining, limit));
        for (slot, _, rule_id) in &hold.held {
            let figures = slot.figures(now_ms);
            if regional.is_some() && figures.remaining_tokens.is_none() {
                continue;
            }
            let remaining_tokens = figures
                .remaining_tokens
                .unwrap_or(figures.held_tokens)
                .min(figures.limit_tokens);
            let tighter = most_constraining.is_none_or(|(_, remaining, limit)| {
                u128::from(remaining_tokens) * u128::from(limit)
                    < u128::from(remaining) * u128::from(figures.limit_tokens)
            });
            if tighter {
                most_constraining = Some((Some(rule_id), remaining_tokens, figures.limit_tokens));
            }
        }
        if let Some((Some(rule_id), remaining_tokens, limit_tokens)) = most_constraining {
            decision.policy_id = Some(rule_id.to_string());
            decision.limit_units = limit_tokens;
            decision.remaining_units = remaining_tokens;
        }
        decision
    }
}

/// Counts a request that found its pool's leases empty: while tokens may still be had
/// (`available`) or because the pool is exhausted.
fn count_depletion(tenant: &TenantId, pool: &PoolId, denial: Denial) {
    let pool_state = match denial {
        Denial::AwaitingGrant => "available",
        Denial::PoolExhausted => "exhausted",
        _ => return,
    };
    metrics::counter!(crate::metrics::LEASE_DEPLETIONS,
        "tenant" => tenant.to_string(), "pool" => pool.to_string(),
        "pool_state" => pool_state)
    .increment(1);
}

/// `retry_ms` plus a uniform random delay of up to [`RETRY_JITTER_MAX_MS`], as a wire hint.
pub(super) fn jittered(retry_ms: u64) -> i64 {
    let jitter_ms = rand::random_range(0..=RETRY_JITTER_MAX_MS);
    i64::try_from(retry_ms.saturating_add(jitter_ms)).unwrap_or(i64::MAX)
}
