//! A request's regional rules: its concurrency slots taken (and given back, renewed), then one
//! atomic store call for every rate rule, within the regional hold; and the jitter a window
//! rule's denial at its edge gets.

use allot_shared::contract::{AdmissionRequest, Decision, Reason};
use allot_shared::limit::multi::Algorithm;
use allot_shared::policy::Rule;
use allot_shared::policy::{FailMode, Limit};

use super::global_holds::jittered;
use super::settings::{CONCURRENCY_RETRY_MS, POLICY_UNAVAILABLE_RETRY_MS};
use super::{Agent, RequestRejected};
use crate::limiter::{LeaseCall, LeaseOp, PlannedBatch, Screened, Verdict, plan_request};
use allot_shared::contract::SlotRenewal;

/// A concurrency slot to take: the request, its plan, the rule's index in it, the lease call.
pub(super) type SlotCall<'c, 'b> = (
    &'c AdmissionRequest,
    &'c PlannedBatch<'b>,
    usize,
    &'c LeaseCall,
);

/// The concurrency slots taken for a decision, and whether a `local_bounded` rule's slot could
/// not be asked for (the answer is then a fallback's).
pub(super) struct SlotsHeld<'c> {
    /// The slots taken, to release if the decision is a denial.
    pub(super) held: Vec<&'c LeaseCall>,
    /// A `local_bounded` rule's lease call failed.
    pub(super) fallback: bool,
}

impl Agent {
    /// The regional rules, answered `LIMITER_UNAVAILABLE` past the [regional
    /// hold](Self::regional_hold) (concurrency slots that may have been taken are released); with
    /// whether the store replayed a recorded admission of the same request id.
    pub(super) async fn decide_regional_in_time(
        &self,
        request: &AdmissionRequest,
        planned: &PlannedBatch<'_>,
        screened: Screened,
    ) -> (Decision, bool) {
        // A dry run takes no slot (module docs).
        let slots = if request.dry_run {
            Vec::new()
        } else {
            concurrency_calls(planned, request)
        };
        match tokio::time::timeout(
            self.regional_hold(),
            self.decide_regional(request, planned, screened, &slots),
        )
        .await
        {
            Ok(decision) => decision,
            Err(_elapsed) => {
                tracing::warn!("regional rules not decided within the hold");
                let calls: Vec<&LeaseCall> = slots.iter().map(|(_, call)| call).collect();
                self.release_all(&calls).await;
                let decision = refused(
                    request,
                    planned.policy_version,
                    None,
                    Reason::LimiterUnavailable,
                    POLICY_UNAVAILABLE_RETRY_MS,
                );
                (decision, false)
            }
        }
    }

    /// Concurrency slots (a slot per rule that has a cap, given back if the request is not
    /// admitted; the gateway releases them when the request ends, a crashed holder's slot lapses
    /// with its TTL), then one store call for the rate rules.
    async fn decide_regional(
        &self,
        request: &AdmissionRequest,
        planned: &PlannedBatch<'_>,
        screened: Screened,
        slots: &[(usize, LeaseCall)],
    ) -> (Decision, bool) {
        let store_deadline = self.store_deadline();
        let slots: Vec<SlotCall<'_, '_>> = slots
            .iter()
            .map(|(rule_index, call)| (request, planned, *rule_index, call))
            .collect();
        let SlotsHeld { held, fallback } = match self.acquire_slots(&slots, store_deadline).await {
            Ok(taken) => taken,
            Err(denial) => return (denial, false),
        };
        let decided = self
            .limiter
            .decide_screened_until(planned, screened, store_deadline)
            .await;
        let replayed = matches!(&decided.verdict, Verdict::Store(store) if store.replayed);
        let mut decision = self.with_jitter(decided.to_contract(planned), planned);
        decision.fallback |= fallback;
        if !decision.allowed {
            self.release_all(&held).await;
        }
        (decision, replayed)
    }

    /// When every store call of a decision must end: early enough for the fail modes to answer
    /// within the hold (half a budget to spare, for a thread that runs late), so a hung store costs
    /// a local_bounded rule its local bucket's answer, never a 503.
    pub(super) fn store_deadline(&self) -> tokio::time::Instant {
        crate::clock::monotonic_now() + self.regional_hold() - self.limiter.decision_budget() / 2
    }

    /// Takes every concurrency slot of `slots` (the request, its plan, the rule's index in it, the
    /// call) by `deadline`. A slot refused, or a `closed` rule's lease call failed, ends it: what
    /// was taken is released and `Err` is the denial. A `local_bounded` rule's failed call is
    /// passed over (its rate rule's local bucket still bounds the request) and marks the answer as
    /// fallback.
    pub(super) async fn acquire_slots<'c>(
        &self,
        slots: &[SlotCall<'c, '_>],
        deadline: tokio::time::Instant,
    ) -> Result<SlotsHeld<'c>, Decision> {
        let mut taken = SlotsHeld {
            held: Vec::new(),
            fallback: false,
        };
        for &(request, planned, rule_index, call) in slots {
            let Some(rule) = planned.rules.get(rule_index) else {
                continue;
            };
            let refusal = match self
                .limiter
                .lease_until(LeaseOp::Acquire, call, deadline)
                .await
            {
                Ok(outcome) if outcome.held => {
                    taken.held.push(call);
                    continue;
                }
                Ok(_) => {
                    crate::limiter::concurrency_denial(planned, rule_index, CONCURRENCY_RETRY_MS)
                }
                Err(error) => {
                    tracing::warn!(%error, rule = %rule.id, "concurrency lease call failed");
                    if !matches!(rule.fail_mode, FailMode::Closed) {
                        taken.fallback = true;
                        continue;
                    }
                    refused(
                        request,
                        planned.policy_version,
                        Some(rule),
                        Reason::LimiterUnavailable,
                        POLICY_UNAVAILABLE_RETRY_MS,
                    )
                }
            };
            self.release_all(&taken.held).await;
            return Err(refusal);
        }
        Ok(taken)
    }

    pub(super) async fn release_all(&self, calls: &[&LeaseCall]) {
        for call in calls {
            if let Err(error) = self.limiter.lease(LeaseOp::Release, call).await {
                // The slot lapses with its lease TTL anyway.
                tracing::warn!(%error, "concurrency lease not released");
            }
        }
    }

    /// Gives back the concurrency slots `request` holds (call when the request has finished).
    /// Idempotent: releasing twice, or a slot that lapsed, changes nothing.
    pub async fn release(&self, request: &AdmissionRequest) -> Result<(), RequestRejected> {
        request.validate()?;
        let slots = self.slots_of(request);
        let calls: Vec<&LeaseCall> = slots.iter().collect();
        self.release_all(&calls).await;
        Ok(())
    }

    /// The concurrency slots `request` holds under the bundle in force: none without a bundle, or
    /// when the request cannot be planned against it (it could not have taken one either).
    fn slots_of(&self, request: &AdmissionRequest) -> Vec<LeaseCall> {
        let Some(bundle) = self.bundle.load() else {
            return Vec::new();
        };
        let Ok(Some(planned)) = plan_request(
            &bundle,
            request,
            &self.settings.pepper,
            self.settings.ip_prefixes,
            self.settings.decision_record_ttl_ms,
        ) else {
            return Vec::new();
        };
        concurrency_calls(&planned, request)
            .into_iter()
            .map(|(_, call)| call)
            .collect()
    }

    /// Extends the concurrency slots `request` holds by their lease TTL: a heartbeat for a long
    /// request (an export) that must keep its slot past the TTL. Call it more often than the TTL.
    /// A slot that already lapsed is not taken again (the cap may be full by now): it counts as
    /// lapsed.
    pub async fn renew(&self, request: &AdmissionRequest) -> Result<SlotRenewal, RequestRejected> {
        request.validate()?;
        let mut renewal = SlotRenewal::default();
        for call in self.slots_of(request) {
            match self.limiter.lease(LeaseOp::Renew, &call).await {
                Ok(outcome) if outcome.held => renewal.renewed += 1,
                Ok(_) => renewal.lapsed += 1,
                Err(error) => {
                    tracing::warn!(%error, "concurrency slot not renewed");
                    renewal.failed += 1;
                }
            }
        }
        Ok(renewal)
    }

    /// `decision` with jitter on its retry hint when a window rule denied it at its edge (I5).
    pub(super) fn with_jitter(
        &self,
        mut decision: Decision,
        planned: &PlannedBatch<'_>,
    ) -> Decision {
        if decision.allowed || decision.reason != Some(Reason::RateExceeded) {
            return decision;
        }
        let windowed = planned.rules.iter().any(|rule| {
            Some(rule.id.as_str()) == decision.policy_id.as_deref()
                && matches!(
                    rule.limit,
                    Limit::Regional(Algorithm::FixedWindow(_) | Algorithm::SlidingCounter(_))
                )
        });
        if windowed && let Ok(retry_ms) = u64::try_from(decision.retry_after_ms) {
            decision.retry_after_ms = jittered(retry_ms);
        }
        decision
    }
}

/// The concurrency slot calls of a planned request: (rule index, call), one per rule with a cap.
pub(super) fn concurrency_calls(
    planned: &PlannedBatch<'_>,
    request: &AdmissionRequest,
) -> Vec<(usize, LeaseCall)> {
    planned
        .rules
        .iter()
        .zip(planned.batch.rules())
        .enumerate()
        .filter_map(|(index, (rule, batch_rule))| {
            let semaphore = rule.concurrency?;
            LeaseCall::new(
                allot_shared::keys::concurrency_key(batch_rule.key()),
                semaphore.max_in_flight(),
                semaphore.lease_ttl_ms(),
                request.request_id.clone(),
            )
            .ok()
            .map(|call| (index, call))
        })
        .collect()
}

/// A refusal that no budget decided (no bundle, policy error, an outage).
pub(super) fn refused(
    request: &AdmissionRequest,
    version: u64,
    rule: Option<&Rule>,
    reason: Reason,
    retry_after_ms: u64,
) -> Decision {
    Decision {
        allowed: false,
        decision_id: request.request_id.clone(),
        policy_id: rule.map(|r| r.id.to_string()),
        policy_version: version,
        denied_scope: rule.map(|r| r.scope.denied_scope()),
        reason: Some(reason),
        limit_units: 0,
        remaining_units: 0,
        retry_after_ms: i64::try_from(retry_after_ms).unwrap_or(i64::MAX),
        fallback: false,
        dry_run: false,
        violations: Vec::new(),
        settle_by_ms: None,
    }
}
