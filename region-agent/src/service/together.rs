//! Several requests decided as one, all or none: the descriptors of one Envoy `ShouldRateLimit`
//! call, which Envoy admits only if every one of them is `OK`.
//!
//! Allot's promise is that a denial anywhere debits nothing anywhere, so a call denied by one
//! descriptor must spend nothing for the others either. The requests go through the admission
//! pipeline's steps together ([`admission`](super::admission) explains each):
//! 1. **Refusals from memory**, each request's (and each principal's regional debt paid first, as
//!    for any admission: a debt is what an earlier admitted request owes, not this call's cost).
//! 2. **Global rules**: every request's reservations, held together.
//! 3. **Regional rules**, within one regional hold: every request's concurrency slots, then **one**
//!    store call for every request's rate rules ([`combine_batches`]): each distinct key once, a
//!    key two requests share (a tenant-wide budget) charged their summed cost, decided all or
//!    nothing by the store's one atomic call.
//! 4. **Settle**: only if every request was admitted are the reservations committed and the slots
//!    kept; otherwise everything is cancelled and released, and every request is answered with the
//!    denial that decided the call.
//!
//! What cannot be one store call is refused before anything is reserved, naming the requests:
//! requests of two tenants (or, for a hot tenant, principals in two sub-slots), one sliding-log
//! key spent twice, or more than [`MAX_RULES_PER_REQUEST`] distinct regional rules.

use std::sync::Arc;

use allot_shared::FieldError;
use allot_shared::contract::{AdmissionRequest, Decision, Reason};
use allot_shared::limit::multi::MAX_RULES_PER_REQUEST;
use allot_shared::policy::{PolicyBundle, Rule};

use super::Agent;
use super::admission::{admitted_by_global_rules_only, global_rules_of, inadmissible_cost};
use super::global_holds::GlobalHold;
use super::regional::refused;
use super::regional::{SlotCall, SlotsHeld, concurrency_calls};
use super::settings::POLICY_UNAVAILABLE_RETRY_MS;
use crate::limiter::{
    LeaseCall, LimitDecision, PlannedBatch, Screened, Verdict, combine_batches, plan_request,
};

/// Why requests could not be decided together: the request at fault (its index) and why.
pub type TogetherRejected = (usize, FieldError);

/// One request as it goes through the steps.
struct Member<'b> {
    request: &'b AdmissionRequest,
    planned: Option<(PlannedBatch<'b>, Screened)>,
    global_rules: Vec<&'b Rule>,
    shadow_rules: Vec<&'b Rule>,
}

impl Agent {
    /// Decides `requests` all or none (module docs) and counts each decision. None may be a dry
    /// run (a dry run spends nothing, so it is decided on its own). `Err` names the request that
    /// cannot be decided, or cannot be decided together with the others; nothing was spent.
    pub async fn admit_together(
        self: &Arc<Self>,
        requests: &[AdmissionRequest],
    ) -> Result<Vec<Decision>, TogetherRejected> {
        if let [only] = requests {
            return Ok(vec![self.admit(only).await.map_err(|e| (0, e))?]);
        }
        for (index, request) in requests.iter().enumerate() {
            request.validate().map_err(|e| (index, e))?;
            if request.dry_run {
                return Err((index, FieldError::new("dryRun", "decided on its own")));
            }
        }
        let decisions = self.decide_together(requests).await?;
        for (request, decision) in requests.iter().zip(&decisions) {
            self.count_decision(request, decision);
        }
        Ok(decisions)
    }

    async fn decide_together(
        self: &Arc<Self>,
        requests: &[AdmissionRequest],
    ) -> Result<Vec<Decision>, TogetherRejected> {
        let Some(bundle) = self.bundle() else {
            let denial = refused(
                &requests[0],
                0,
                None,
                Reason::PolicyError,
                POLICY_UNAVAILABLE_RETRY_MS,
            );
            return Ok(for_every(requests, &denial));
        };
        // 1. Refusals from memory; nothing is reserved yet.
        let members = match self.screen_together(&bundle, requests).await? {
            Ok(members) => members,
            Err(denial) => return Ok(for_every(requests, &denial)),
        };
        let combined = combine(&members, bundle.version())?;
        // 2. Global rules, reserved together in one pass (nothing held across a wait).
        let asks: Vec<(&AdmissionRequest, &[&Rule])> = members
            .iter()
            .map(|member| (member.request, member.global_rules.as_slice()))
            .collect();
        let holds = match self.reserve_global_all(&asks, bundle.version()).await {
            Ok(holds) => holds,
            Err(denial) => return Ok(for_every(requests, &denial)),
        };
        // 3. Regional rules, within one hold.
        let decisions = self
            .decide_regional_together(&members, combined.as_ref(), &holds, bundle.version())
            .await;
        // 4. Settle: all admitted, or nothing spent. Every hold is committed before anything is
        // awaited, so a call dropped midway cannot leave part of it committed.
        if decisions.iter().all(|decision| decision.allowed) {
            let mut decisions = decisions;
            for ((member, hold), decision) in members.iter().zip(holds).zip(&mut decisions) {
                decision.fallback |= self.commit_global(member.request, hold);
            }
            for member in &members {
                self.count_shadow_usage(member.request, &member.shadow_rules)
                    .await;
            }
            return Ok(decisions);
        }
        Ok(decisions)
    }

    /// Each request's refusals from memory, its plan and its screening. `Ok(Err(denial))` when one
    /// is refused (the call's answer).
    async fn screen_together<'b>(
        &self,
        bundle: &'b PolicyBundle,
        requests: &'b [AdmissionRequest],
    ) -> Result<Result<Vec<Member<'b>>, Decision>, TogetherRejected> {
        let version = bundle.version();
        let mut members = Vec::with_capacity(requests.len());
        for (index, request) in requests.iter().enumerate() {
            if let Some(rule) = self.stale_strict_rule(bundle, request) {
                return Ok(Err(refused(
                    request,
                    version,
                    Some(rule),
                    Reason::LimiterUnavailable,
                    POLICY_UNAVAILABLE_RETRY_MS,
                )));
            }
            if let Some(denied) = inadmissible_cost(bundle, request, version, &self.settings) {
                return Ok(Err(denied));
            }
            if let Some(denied) = self.pay_regional_debt(request, bundle).await {
                return Ok(Err(denied));
            }
            let planned = plan_request(
                bundle,
                request,
                &self.settings.pepper,
                self.settings.ip_prefixes,
                0,
            )
            .map_err(|error| (index, FieldError::new("descriptors", error.to_string())))?;
            let planned = match planned {
                None => None,
                Some(planned) => match self
                    .limiter
                    .screen(&planned, self.source_of(request).as_ref())
                {
                    Ok(screened) => Some((planned, screened)),
                    Err(denied) => {
                        return Ok(Err(self.with_jitter(denied.to_contract(&planned), &planned)));
                    }
                },
            };
            let (shadow_rules, global_rules) = global_rules_of(bundle, request);
            members.push(Member {
                request,
                planned,
                global_rules,
                shadow_rules,
            });
        }
        Ok(Ok(members))
    }

    /// Every member's slots, then one store call for all their rate rules, within the regional
    /// hold; a decision per member. Denied or out of time, every slot taken is released.
    async fn decide_regional_together(
        &self,
        members: &[Member<'_>],
        combined: Option<&Combined<'_>>,
        holds: &[GlobalHold],
        version: u64,
    ) -> Vec<Decision> {
        let slots: Vec<(usize, usize, LeaseCall)> = members
            .iter()
            .enumerate()
            .filter_map(|(member, m)| Some((member, m.planned.as_ref()?)))
            .flat_map(|(member, (planned, _))| {
                concurrency_calls(planned, members[member].request)
                    .into_iter()
                    .map(move |(rule, call)| (member, rule, call))
            })
            .collect();
        let decided = tokio::time::timeout(
            self.regional_hold(),
            self.decide_slots_and_rules(members, combined, &slots),
        )
        .await;
        let decisions = match decided {
            Ok(decisions) => decisions,
            Err(_elapsed) => {
                tracing::warn!("regional rules of a call not decided within the hold");
                let calls: Vec<&LeaseCall> = slots.iter().map(|(_, _, call)| call).collect();
                self.release_all(&calls).await;
                let denial = refused(
                    members[0].request,
                    version,
                    None,
                    Reason::LimiterUnavailable,
                    POLICY_UNAVAILABLE_RETRY_MS,
                );
                return for_every(members.iter().map(|m| m.request), &denial);
            }
        };
        // Every admission named by its most constraining rule, its pools included; requests with
        // no regional rule by their pools alone.
        decisions
            .into_iter()
            .zip(members.iter().zip(holds))
            .map(|(decision, (member, hold))| {
                let decision = decision
                    .unwrap_or_else(|| admitted_by_global_rules_only(member.request, version));
                self.with_pool_figures(decision, hold)
            })
            .collect()
    }

    async fn decide_slots_and_rules(
        &self,
        members: &[Member<'_>],
        combined: Option<&Combined<'_>>,
        slots: &[(usize, usize, LeaseCall)],
    ) -> Vec<Option<Decision>> {
        let store_deadline = self.store_deadline();
        let slots: Vec<SlotCall<'_, '_>> = slots
            .iter()
            .filter_map(|(member, rule_index, call)| {
                let (planned, _) = members[*member].planned.as_ref()?;
                Some((members[*member].request, planned, *rule_index, call))
            })
            .collect();
        let SlotsHeld { held, fallback } = match self.acquire_slots(&slots, store_deadline).await {
            Ok(taken) => taken,
            Err(denial) => return every_member_denied(members, &denial),
        };
        let Some(combined) = combined else {
            return members.iter().map(|_| None).collect();
        };
        let decided = self
            .limiter
            .decide_combined_until(&combined.planned, store_deadline)
            .await;
        let call_decision =
            self.with_jitter(decided.to_contract(&combined.planned), &combined.planned);
        if !call_decision.allowed {
            self.release_all(&held).await;
            return every_member_denied(members, &call_decision);
        }
        members
            .iter()
            .zip(&combined.indexes)
            .map(|(member, indexes)| {
                let (planned, _) = member.planned.as_ref()?;
                let mut decision = own_decision(&decided, planned, indexes)
                    .unwrap_or_else(|| call_decision.clone());
                decision.decision_id = member.request.request_id.clone();
                decision.fallback |= fallback;
                Some(decision)
            })
            .collect()
    }
}

/// The members' regional rules as one store call.
struct Combined<'b> {
    planned: PlannedBatch<'b>,
    /// Per member, the combined indexes of its rules (empty for one with none).
    indexes: Vec<Vec<usize>>,
}

/// The one store call for every member's regional rules; `None` when none has any. Refused,
/// naming the member, when they cannot be one call.
fn combine<'b>(
    members: &[Member<'b>],
    version: u64,
) -> Result<Option<Combined<'b>>, TogetherRejected> {
    let with_rules: Vec<(usize, &PlannedBatch<'b>, &Screened)> = members
        .iter()
        .enumerate()
        .filter_map(|(index, member)| {
            member
                .planned
                .as_ref()
                .map(|(planned, screened)| (index, planned, screened))
        })
        .collect();
    let Some(&(first, first_planned, _)) = with_rules.first() else {
        return Ok(None);
    };
    let batches: Vec<_> = with_rules
        .iter()
        .map(|(_, planned, screened)| screened.batch(planned))
        .collect();
    let (batch, part_indexes) = combine_batches(&batches).map_err(|error| {
        let at = match &error {
            crate::limiter::CombineError::ForeignTag(part) => with_rules[*part].0,
            crate::limiter::CombineError::SharedKey { later, .. } => with_rules[*later].0,
            _ => first,
        };
        (
            at,
            FieldError::new(
                "descriptors",
                format!(
                    "cannot be decided all or none with the others in one store call: {error} \
                     (one tenant a call, each sliding-log key once, at most \
                     {MAX_RULES_PER_REQUEST} distinct regional rules)"
                ),
            ),
        )
    })?;
    let mut rules: Vec<&'b Rule> = vec![first_planned.rules[0]; batch.rules().len()];
    for ((_, planned, _), indexes) in with_rules.iter().zip(&part_indexes) {
        for (own, &at) in indexes.iter().enumerate() {
            if let (Some(rule), Some(slot)) = (planned.rules.get(own), rules.get_mut(at)) {
                *slot = rule;
            }
        }
    }
    let mut indexes = vec![Vec::new(); members.len()];
    for ((member, _, _), part) in with_rules.iter().zip(part_indexes) {
        indexes[*member] = part;
    }
    Ok(Some(Combined {
        planned: PlannedBatch {
            batch,
            rules,
            tenant: first_planned.tenant.clone(),
            principal_type: first_planned.principal_type,
            principal_hash: first_planned.principal_hash.clone(),
            policy_version: version,
        },
        indexes,
    }))
}

/// An admitted member's own decision from the call's: its own rules' remaining, naming its most
/// constraining one. `None` when the call was not decided by the store (the call's decision then
/// stands for every member).
fn own_decision(
    decided: &LimitDecision,
    planned: &PlannedBatch<'_>,
    indexes: &[usize],
) -> Option<Decision> {
    let Verdict::Store(store) = &decided.verdict else {
        return None;
    };
    let mut own = store.clone();
    own.denied_by = None;
    own.advisory_denials = store
        .advisory_denials
        .iter()
        .filter_map(|at| indexes.iter().position(|index| index == at))
        .collect();
    own.remaining = indexes
        .iter()
        .map(|&at| store.remaining.get(at).copied())
        .collect::<Option<Vec<u64>>>()?;
    let own = LimitDecision {
        verdict: Verdict::Store(own),
        ..decided.clone()
    };
    Some(own.to_contract(planned))
}

/// The call's denial as every request's answer (each under its own decision id).
fn for_every<'r>(
    requests: impl IntoIterator<Item = &'r AdmissionRequest>,
    denial: &Decision,
) -> Vec<Decision> {
    requests
        .into_iter()
        .map(|request| Decision {
            decision_id: request.request_id.clone(),
            ..denial.clone()
        })
        .collect()
}

/// [`for_every`] member, as the regional step answers (every member decided).
fn every_member_denied(members: &[Member<'_>], denial: &Decision) -> Vec<Option<Decision>> {
    for_every(members.iter().map(|member| member.request), denial)
        .into_iter()
        .map(Some)
        .collect()
}
