//! Sub-leases for gateways that enforce quota themselves (Envoy's rate limit quota service).
//!
//! A gateway's assignment for one bucket of requests is a *carve*: the requests it may admit,
//! taken at once from every pool the bucket's global rules draw on (a reservation on each pool's
//! holder, from its leases or, with the allocator unreachable, from the window's fallback
//! allowance) and from its regional rules (one store call charged for all of them). Then:
//! - what the gateway reports admitted is *drawn* from the carve: spent, and reported to the
//!   ledger like any admission;
//! - a carve cut short (its assignment replaced) gives back what its gateway can no longer admit;
//! - a carve whose gateway reported past its end gives back what it still holds (it was not used);
//! - a carve that ended with no such report in time *withholds* what it still holds: the gateway
//!   may have admitted some of it unreported, so it is never spendable again (stranded, counted);
//! - a carve dropped unsettled (its stream went away) withholds too.
//!
//! So the sum of what live assignments can admit never exceeds what the agent holds plus the
//! fallback allowance left in the window, and a denial (of any rule, at any step) debits nothing:
//! global reservations are cancelled, the store call debits nothing when it denies.
//!
//! Concurrency caps do not apply to sub-leased buckets: a gateway enforcing a token bucket has no
//! notion of requests in flight. They apply on the HTTP and RLS paths.

use std::sync::Arc;

use allot_shared::contract::AdmissionRequest;
use allot_shared::ids::{DecisionId, PoolId, TenantId};
use allot_shared::policy::{Limit, Rule};

use super::pool_slot::PoolSlot;
use super::pools::TERMS_RETRY_MS;
use super::pools::global_cost_tokens;
use super::settings::POLICY_UNAVAILABLE_RETRY_MS;
pub use super::sublease_demand::{DEMAND_FRESH_MS, MAX_SUBSCRIPTIONS};
use super::{Agent, lock};
use crate::global::sublease::{
    CarveKind, DELIVERY_MARGIN_MS, MIN_ASSIGNMENT_REQUESTS, MIN_ASSIGNMENT_TTL_MS, carve_kind,
    share,
};
use crate::global::{Denial, Reservation};
use crate::limiter::plan_request;

/// The longest a bucket is told to wait before it is looked at again, ms.
pub const MAX_RETRY_MS: u64 = 60_000;

/// One pool's part of a carve.
struct CarvedPool {
    tenant: TenantId,
    pool: PoolId,
    slot: Arc<PoolSlot>,
    /// `None` once settled.
    reservation: Option<Reservation>,
    tokens_per_request: u64,
}

impl Drop for CarvedPool {
    fn drop(&mut self) {
        if let Some(reservation) = self.reservation.take() {
            let left = reservation.tokens();
            self.slot.agent().holder_mut().withhold(reservation);
            if left > 0 {
                metrics::counter!(crate::metrics::RLQS_TOKENS_EXPIRED_UNUSED,
                    "tenant" => self.tenant.to_string(), "pool" => self.pool.to_string())
                .increment(left);
            }
        }
    }
}

/// Requests carved for one gateway's assignment. Settle it with [`Agent::end_carve`]; dropped
/// unsettled, it withholds what it holds.
pub struct Carve {
    requests: u64,
    used_requests: u64,
    usable_until_ms: u64,
    /// Per pool, where its tokens come from.
    kinds: Vec<CarveKind>,
    pools: Vec<CarvedPool>,
}

impl Carve {
    /// Requests it may admit (what its assignment was sized for).
    pub fn requests(&self) -> u64 {
        self.requests
    }

    /// Requests reported admitted against it.
    pub fn used_requests(&self) -> u64 {
        self.used_requests
    }

    /// Requests it still holds.
    pub fn left_requests(&self) -> u64 {
        self.requests - self.used_requests
    }

    /// Where its tokens come from, per pool of the bucket's global rules (empty with none): a
    /// carve of other kinds is handed only once this one is settled.
    pub fn kinds(&self) -> &[CarveKind] {
        &self.kinds
    }

    /// By when (epoch ms, agent clock) its assignment must have ended: the end of the first-ending
    /// lease (or fallback window) it holds tokens of; [`u64::MAX`] with no global rule.
    pub fn usable_until_ms(&self) -> u64 {
        self.usable_until_ms
    }
}

/// What a carve attempt came to.
pub enum Carving {
    /// Requests carved.
    Carved(Carve),
    /// No rule limits the bucket's requests.
    Unlimited,
    /// Nothing can be carved now: deny the bucket's requests until `retry_after_ms` from now.
    Denied {
        /// Ms.
        retry_after_ms: u64,
    },
    /// Tokens are on their way (a renewal, a fallback claim): ask again shortly.
    Awaiting,
}

/// What a gateway asks a carve for.
#[derive(Debug, Clone)]
pub struct CarveAsk {
    /// The stream and bucket asking, for the demand its pools weigh.
    pub subscription: u64,
    /// Requests wanted.
    pub wanted_requests: u64,
    /// The kinds of the bucket's carves not yet settled: a carve of other kinds waits
    /// ([`CarveKind`]). Empty: any.
    pub kinds_in_use: Vec<CarveKind>,
}

/// A global rule of a bucket, with its pool looked up.
struct GlobalPart<'b> {
    pool: &'b PoolId,
    slot: Arc<PoolSlot>,
    tokens_per_request: u64,
}

impl Agent {
    /// Carves up to `ask.wanted_requests` of `request`'s bucket for one gateway: as much as every
    /// pool of its global rules can give (its share when the pool's gateways want more than it
    /// holds, at most one chunk), then its regional rules in one store call (less when they hold
    /// less). `request` stands for one request of the bucket (its cost hint is 1).
    ///
    /// Long by design: its steps are the carve's order of commitments: the global pools reserved
    /// first, the carve given up before any regional charge if it could not be handed now, the
    /// regional rules charged last and their refusal cancelling the global reservations; split,
    /// each piece would have to know what the others had reserved to give it back.
    pub async fn carve(self: &Arc<Self>, request: &AdmissionRequest, ask: CarveAsk) -> Carving {
        let Some(bundle) = self.bundle.load() else {
            return Carving::Denied {
                retry_after_ms: POLICY_UNAVAILABLE_RETRY_MS,
            };
        };
        if self.stale_strict_rule(&bundle, request).is_some() {
            return Carving::Denied {
                retry_after_ms: POLICY_UNAVAILABLE_RETRY_MS,
            };
        }
        let tenant = &request.tenant_id;
        let global_rules =
            bundle.global_rules_for(tenant, &request.route_group, request.principal.kind);
        let planned = match plan_request(
            &bundle,
            request,
            &self.settings.pepper,
            self.settings.ip_prefixes,
            self.settings.decision_record_ttl_ms,
        ) {
            Ok(planned) => planned,
            Err(error) => {
                tracing::error!(%error, "the bundle cannot be evaluated for a sub-leased bucket");
                return Carving::Denied {
                    retry_after_ms: POLICY_UNAVAILABLE_RETRY_MS,
                };
            }
        };
        if global_rules.is_empty() && planned.is_none() {
            return Carving::Unlimited;
        }
        let Some(parts) = self.look_up_global_parts(request, &global_rules).await else {
            return Carving::Denied {
                retry_after_ms: TERMS_RETRY_MS,
            };
        };
        let mut carve = match self.carve_global(tenant, &parts, &ask) {
            Ok(carve) => carve,
            Err(carving) => return self.after_refusal(tenant, &parts, carving).await,
        };
        // Before the regional rules are charged (nothing is given back to them): a carve that
        // could not be handed now waits.
        let usable_ms = carve.usable_until_ms.saturating_sub(self.clock.now_ms());
        let other_kind = !ask.kinds_in_use.is_empty() && ask.kinds_in_use != carve.kinds;
        if other_kind || usable_ms < MIN_ASSIGNMENT_TTL_MS + DELIVERY_MARGIN_MS {
            self.cancel_carve(carve);
            return Carving::Awaiting;
        }
        if let Some(planned) = &planned {
            let regional = tokio::time::timeout(
                self.regional_hold(),
                self.carve_regional(request, planned, carve.requests),
            )
            .await
            .unwrap_or(Err(POLICY_UNAVAILABLE_RETRY_MS));
            match regional {
                Ok(requests) => self.shrink(&mut carve, requests),
                // The global reservations are cancelled: nothing was spent.
                Err(retry_after_ms) => {
                    self.cancel_carve(carve);
                    return Carving::Denied { retry_after_ms };
                }
            }
        }
        for part in &carve.pools {
            let tokens = carve.requests * part.tokens_per_request;
            metrics::counter!(crate::metrics::RLQS_TOKENS_SUBLEASED,
                "tenant" => part.tenant.to_string(), "pool" => part.pool.to_string())
            .increment(tokens);
        }
        Carving::Carved(carve)
    }

    /// Every global rule's pool, looked up (awaiting terms at most once per pool); `None` when one
    /// cannot be had.
    async fn look_up_global_parts<'b>(
        self: &Arc<Self>,
        request: &AdmissionRequest,
        rules: &[&'b Rule],
    ) -> Option<Vec<GlobalPart<'b>>> {
        let mut parts = Vec::with_capacity(rules.len());
        for rule in rules {
            let Limit::Global(pool) = &rule.limit else {
                continue;
            };
            let slot = self.slot(&request.tenant_id, pool).await?;
            parts.push(GlobalPart {
                pool,
                slot,
                tokens_per_request: global_cost_tokens(rule, request),
            });
        }
        Some(parts)
    }

    /// Reserves the same number of requests from every pool, with no wait in between: the least
    /// any pool can give (its share of what it holds, within one chunk). `Err` says why nothing
    /// could be reserved.
    ///
    /// Long by design: its two passes share what the first reads: the least every pool can give,
    /// which the second reserves from each pool, and what each pool's gateways want, which the
    /// second asks for as a probe when there is nothing to give; split, both would be carried from
    /// one function to the other, and the "same number from every pool" would rest on the caller
    /// passing the count through.
    fn carve_global(
        self: &Arc<Self>,
        tenant: &TenantId,
        parts: &[GlobalPart<'_>],
        ask: &CarveAsk,
    ) -> Result<Carve, Carving> {
        let now_ms = self.clock.now_ms();
        let reachable = self.allocator_reachable();
        let mut requests = ask.wanted_requests.max(1);
        let mut totals_wanted = Vec::with_capacity(parts.len());
        for part in parts {
            let key = (tenant.clone(), part.pool.clone());
            let total_wanted = lock(&self.subleases).want(
                &key,
                ask.subscription,
                ask.wanted_requests.saturating_mul(part.tokens_per_request),
                now_ms,
            );
            let mut agent = part.slot.agent();
            let holder = agent.holder_mut();
            let chunk_tokens = holder.config().chunk_tokens.max(1);
            let spendable = holder.spendable_tokens(now_ms, reachable).min(chunk_tokens);
            let wanted_tokens = ask.wanted_requests.saturating_mul(part.tokens_per_request);
            let given_tokens = share(
                spendable,
                wanted_tokens,
                total_wanted,
                MIN_ASSIGNMENT_REQUESTS.saturating_mul(part.tokens_per_request),
            );
            requests = requests.min(given_tokens / part.tokens_per_request);
            totals_wanted.push(total_wanted);
        }
        let mut carve = Carve {
            requests,
            used_requests: 0,
            usable_until_ms: u64::MAX,
            kinds: Vec::with_capacity(parts.len()),
            pools: Vec::with_capacity(parts.len()),
        };
        for (part, total_wanted) in parts.iter().zip(totals_wanted) {
            // With nothing to give, a probe for what the pool's gateways want: its refusal says
            // why, and asks the next renewal for that much (within a chunk).
            let cost_tokens = if requests > 0 {
                requests * part.tokens_per_request
            } else {
                total_wanted.max(part.tokens_per_request)
            };
            let reserved = {
                let mut agent = part.slot.agent();
                let holder = agent.holder_mut();
                if part.slot.is_evicted() {
                    None
                } else {
                    let cost_tokens = cost_tokens.min(holder.config().chunk_tokens.max(1));
                    Some(holder.reserve_for_sublease(cost_tokens, now_ms, reachable))
                }
            };
            self.renew_if_wanted(tenant, part.pool, &part.slot);
            match reserved {
                Some(Ok(reservation)) if requests > 0 => {
                    let agent = part.slot.agent();
                    let holder = agent.holder();
                    carve.usable_until_ms = carve
                        .usable_until_ms
                        .min(holder.usable_until_ms(&reservation));
                    carve.kinds.push(carve_kind(holder, &reservation));
                    drop(agent);
                    carve.pools.push(CarvedPool {
                        tenant: tenant.clone(),
                        pool: part.pool.clone(),
                        slot: part.slot.clone(),
                        reservation: Some(reservation),
                        tokens_per_request: part.tokens_per_request,
                    });
                }
                // Nothing to give, yet a request's worth was reservable (it came meanwhile):
                // ask again.
                Some(Ok(reservation)) => {
                    part.slot.agent().cancel(reservation);
                    self.cancel_carve(carve);
                    return Err(Carving::Awaiting);
                }
                Some(Err(refusal)) => {
                    self.cancel_carve(carve);
                    return Err(match refusal.denial {
                        Denial::AwaitingGrant | Denial::FallbackUnclaimed => Carving::Awaiting,
                        _ => Carving::Denied {
                            retry_after_ms: refusal.retry_after_ms.min(MAX_RETRY_MS),
                        },
                    });
                }
                None => {
                    self.cancel_carve(carve);
                    return Err(Carving::Awaiting);
                }
            }
        }
        Ok(carve)
    }

    /// After a refusal: a fallback claim is made (so the next ask can be carved), a renewal is
    /// under way already.
    async fn after_refusal(
        self: &Arc<Self>,
        tenant: &TenantId,
        parts: &[GlobalPart<'_>],
        carving: Carving,
    ) -> Carving {
        if matches!(carving, Carving::Awaiting) {
            let now_ms = self.clock.now_ms();
            for part in parts {
                let wanted = part
                    .slot
                    .agent()
                    .fallback_claim_wanted(part.tokens_per_request, now_ms)
                    .is_some()
                    && self.journaling.keeps_state()
                    && !self.allocator_reachable();
                if wanted
                    && !self
                        .claim_fallback(tenant, part.pool, &part.slot, part.tokens_per_request)
                        .await
                {
                    return Carving::Denied {
                        retry_after_ms: TERMS_RETRY_MS,
                    };
                }
            }
        }
        carving
    }

    /// The regional rules' share: `requests` charged in one store call; when denied, again for
    /// what the deciding rule can hold (its capacity, then what it has left). `Err` is when to retry, ms: nothing could be carved
    /// (and nothing was debited).
    async fn carve_regional(
        &self,
        request: &AdmissionRequest,
        planned: &crate::limiter::PlannedBatch<'_>,
        requests: u64,
    ) -> Result<u64, u64> {
        let source = self.source_of(request);
        let mut asked = requests.max(1);
        let mut retry_after_ms = POLICY_UNAVAILABLE_RETRY_MS;
        for _attempt in 0..3 {
            let id = DecisionId::parse(&format!("rlqs-{:032x}", rand::random::<u128>()))
                .map_err(|_| POLICY_UNAVAILABLE_RETRY_MS)?;
            let charged = planned
                .times(asked, id)
                .map_err(|_| POLICY_UNAVAILABLE_RETRY_MS)?;
            let decision = self
                .limiter
                .decide(&charged, source.as_ref())
                .await
                .to_contract(&charged);
            if decision.allowed {
                return Ok(asked);
            }
            retry_after_ms = u64::try_from(decision.retry_after_ms).unwrap_or(MAX_RETRY_MS);
            // What the deciding rule has left, in requests of this bucket.
            let per_request_units = decision
                .policy_id
                .as_deref()
                .and_then(|id| planned.rules.iter().find(|rule| rule.id.as_str() == id))
                .and_then(|rule| rule.cost_millitokens_for(1))
                .map_or(1, |millitokens| {
                    millitokens
                        .div_ceil(allot_shared::MILLITOKENS_PER_TOKEN)
                        .max(1)
                });
            // A carve above the rule's capacity can never fit (and is told nothing of what is
            // left): ask for the capacity, then for what is left.
            let fits = if decision.retry_after_ms < 0 {
                decision.limit_units / per_request_units
            } else {
                decision.remaining_units / per_request_units
            };
            if fits == 0 || fits >= asked {
                break;
            }
            asked = fits;
        }
        Err(retry_after_ms.clamp(1, MAX_RETRY_MS))
    }

    /// Cuts `carve` down to `requests`, giving back the rest to its pools.
    fn shrink(&self, carve: &mut Carve, requests: u64) {
        let excess = carve.requests.saturating_sub(requests);
        if excess == 0 {
            return;
        }
        for part in &mut carve.pools {
            if let Some(reservation) = part.reservation.as_mut() {
                part.slot
                    .agent()
                    .holder_mut()
                    .give_back(reservation, excess * part.tokens_per_request);
            }
        }
        carve.requests = requests;
    }

    /// Gives everything `carve` holds back: it was never handed to a gateway.
    pub fn cancel_carve(&self, mut carve: Carve) {
        for part in &mut carve.pools {
            if let Some(reservation) = part.reservation.take() {
                part.slot.agent().cancel(reservation);
            }
        }
    }

    /// Spends `requests` a gateway reported admitted from `carve` (at most what it holds); returns
    /// how many it held.
    pub fn spend_carved(&self, carve: &mut Carve, requests: u64) -> u64 {
        let drawn = requests.min(carve.left_requests());
        if drawn == 0 {
            return 0;
        }
        let now_ms = self.clock.now_ms();
        for part in &mut carve.pools {
            if let Some(reservation) = part.reservation.as_mut() {
                part.slot.agent().holder_mut().draw(
                    reservation,
                    drawn * part.tokens_per_request,
                    now_ms,
                );
            }
        }
        carve.used_requests += drawn;
        self.note_change();
        drawn
    }

    /// Counts `requests` a gateway denied on its own as demand on `carve`'s pools, so their
    /// renewals are sized for what the gateway would admit.
    pub fn note_denied(&self, carve: &Carve, requests: u64) {
        let now_ms = self.clock.now_ms();
        for part in &carve.pools {
            part.slot
                .agent()
                .holder_mut()
                .note_demand(now_ms, requests * part.tokens_per_request);
        }
    }

    /// Cuts a carve whose assignment was replaced down to what its gateway could have admitted
    /// (`admissible_requests`, at least what it already reported): the rest goes back.
    pub fn cut_carve(&self, carve: &mut Carve, admissible_requests: u64) {
        self.shrink(carve, admissible_requests.max(carve.used_requests));
    }

    /// Ends `carve` whose gateway reported past its end: what it still holds was not used, and
    /// goes back to its pools.
    pub fn return_carve(&self, carve: Carve) {
        let left = carve.left_requests();
        self.cancel_carve(carve);
        if left > 0 {
            self.note_change();
        }
    }

    /// Ends `carve`: what it still holds is withheld (stranded), never given back.
    pub fn end_carve(&self, carve: Carve) {
        drop(carve);
        self.note_change();
    }

    /// Spends `requests` a gateway admitted beyond every assignment it held (it applied its own
    /// behaviour while it had none), from what the agent holds when it can. Returns how many were
    /// backed by quota; the rest were admitted with none behind them.
    pub async fn spend_beyond_assignment(
        self: &Arc<Self>,
        request: &AdmissionRequest,
        requests: u64,
    ) -> u64 {
        let Some(bundle) = self.bundle.load() else {
            return 0;
        };
        let rules = bundle.global_rules_for(
            &request.tenant_id,
            &request.route_group,
            request.principal.kind,
        );
        let Some(parts) = self.look_up_global_parts(request, &rules).await else {
            return 0;
        };
        let now_ms = self.clock.now_ms();
        let reachable = self.allocator_reachable();
        let mut backed = requests;
        for part in &parts {
            let mut agent = part.slot.agent();
            let holder = agent.holder_mut();
            let spendable = holder
                .spendable_tokens(now_ms, reachable)
                .min(holder.config().chunk_tokens.max(1));
            backed = backed.min(spendable / part.tokens_per_request);
        }
        if backed > 0 {
            for part in &parts {
                let mut agent = part.slot.agent();
                let holder = agent.holder_mut();
                let _ = holder.spend(backed * part.tokens_per_request, now_ms, reachable);
            }
            self.note_change();
        }
        backed
    }

    /// Forgets a subscription's demand (its stream ended, or the bucket was abandoned).
    pub fn forget_subscription(&self, subscription: u64) {
        lock(&self.subleases).forget(subscription);
    }
}
