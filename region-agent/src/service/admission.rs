//! The request path: one admission decision per gateway request.

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::Duration;

use allot_shared::contract::{AdmissionRequest, Decision, DeniedScope, PrincipalType, Reason};
use allot_shared::ids::{PoolId, TenantId};
use allot_shared::policy::{Limit, Rule};

use super::pools::TERMS_RETRY_MS;
use super::{Agent, RequestRejected, lock};
use crate::global::{Denial, Spend};
use crate::limiter::{DEFAULT_SOURCE_PREFIXES, LeaseCall, LeaseOp, SourceId, plan_request};

/// Longest a request waits for the first grant of a pool it triggered.
pub const FIRST_GRANT_WAIT: Duration = Duration::from_millis(200);
/// Retry hint of a concurrency denial, ms: a slot frees when a holder finishes, at no known time.
pub const CONCURRENCY_RETRY_MS: u64 = 1_000;

impl Agent {
    /// Decides one request, and counts the decision.
    pub async fn admit(
        self: &Arc<Self>,
        request: &AdmissionRequest,
    ) -> Result<Decision, RequestRejected> {
        let decision = self.decide(request).await?;
        let scope = decision.denied_scope.map_or("none", |s| match s {
            DeniedScope::User => "user",
            DeniedScope::Tenant => "tenant",
            DeniedScope::Route => "route",
            DeniedScope::Global => "global",
            DeniedScope::Concurrency => "concurrency",
        });
        let reason = decision.reason.map_or("none", |r| match r {
            Reason::RateExceeded => "rate_exceeded",
            Reason::ConcurrencyExceeded => "concurrency_exceeded",
            Reason::LimiterUnavailable => "limiter_unavailable",
            Reason::PolicyError => "policy_error",
        });
        let outcome = if decision.allowed {
            "allowed"
        } else {
            "denied"
        };
        self.decision_counters
            .counter(
                outcome,
                scope,
                reason,
                decision.policy_id.as_deref().unwrap_or_default(),
                decision.policy_version,
            )
            .increment(1);
        if let Some(log) = self.decision_log.get() {
            log.record(self.clock.now_ms(), request, &decision);
        }
        Ok(decision)
    }

    async fn decide(
        self: &Arc<Self>,
        request: &AdmissionRequest,
    ) -> Result<Decision, RequestRejected> {
        request.validate().map_err(|e| RequestRejected {
            field: e.field.to_owned(),
            message: e.message.to_owned(),
        })?;
        let Some(bundle) = self.bundle.load_full() else {
            return Ok(unavailable(request, 0, None, Reason::PolicyError, 1_000));
        };
        let version = bundle.version();
        let mut fallback = false;
        let tenant = &request.tenant_id;
        let kind = request.principal.kind;
        if self.bundle_is_stale() {
            let strict = bundle
                .regional_rules_for(tenant, &request.route_group, kind)
                .into_iter()
                .chain(bundle.global_rules_for(tenant, &request.route_group, kind))
                .find(|rule| rule.strict);
            if let Some(rule) = strict {
                return Ok(unavailable(
                    request,
                    version,
                    Some(rule),
                    Reason::LimiterUnavailable,
                    1_000,
                ));
            }
        }
        for rule in bundle.global_rules_for(tenant, &request.route_group, kind) {
            let Limit::Global(pool) = &rule.limit else {
                continue;
            };
            let cost = (rule.cost_millitokens / 1_000)
                .saturating_mul(request.cost_hint)
                .max(1);
            match self.spend_global(tenant, pool, cost).await {
                Ok(from_fallback) => {
                    if from_fallback {
                        metrics::counter!(crate::metrics::FALLBACK_ADMITS,
                            "tenant" => tenant.to_string(), "pool" => pool.to_string())
                        .increment(1);
                    }
                    fallback |= from_fallback;
                }
                Err((denial, retry_after_ms, limit)) => {
                    return Ok(global_denial(
                        request,
                        version,
                        rule,
                        denial,
                        retry_after_ms,
                        limit,
                    ));
                }
            }
        }
        let planned = match plan_request(
            &bundle,
            request,
            &self.settings.pepper,
            self.settings.ip_prefixes,
            self.settings.decision_record_ttl_ms,
        ) {
            Ok(planned) => planned,
            Err(error) => {
                tracing::error!(%error, "the bundle cannot be evaluated for a request");
                return Ok(unavailable(
                    request,
                    version,
                    None,
                    Reason::PolicyError,
                    1_000,
                ));
            }
        };
        let Some(planned) = planned else {
            return Ok(Decision {
                allowed: true,
                decision_id: request.request_id.clone(),
                policy_id: None,
                policy_version: version,
                denied_scope: None,
                reason: None,
                limit: 0,
                remaining: 0,
                retry_after_ms: 0,
                fallback,
            });
        };
        // Concurrency caps: a slot per rule that has one, taken before the rate decision and given
        // back (idempotently) if the request is not admitted. The gateway releases it when the
        // request ends (`release`); a crashed holder's slot lapses with its lease TTL.
        let mut held = Vec::new();
        for (index, rule) in planned.rules.iter().enumerate() {
            let Some(semaphore) = rule.concurrency else {
                continue;
            };
            let Some(batch_rule) = planned.batch.rules().get(index) else {
                continue;
            };
            let Ok(call) = LeaseCall::new(
                allot_shared::keys::concurrency_key(batch_rule.key()),
                semaphore.max_in_flight(),
                semaphore.lease_ttl_ms(),
                request.request_id.clone(),
            ) else {
                continue;
            };
            match self.limiter.lease(LeaseOp::Acquire, &call).await {
                Ok(outcome) if outcome.held => held.push(call),
                Ok(_) => {
                    self.release_all(&held).await;
                    return Ok(crate::limiter::concurrency_denial(
                        &planned,
                        index,
                        CONCURRENCY_RETRY_MS,
                    ));
                }
                Err(error) => {
                    tracing::warn!(%error, rule = %rule.id, "concurrency lease call failed");
                    if matches!(rule.fail_mode, allot_shared::policy::FailMode::Closed) {
                        self.release_all(&held).await;
                        return Ok(unavailable(
                            request,
                            version,
                            Some(rule),
                            Reason::LimiterUnavailable,
                            1_000,
                        ));
                    }
                    // local_bounded: the rate rule's local bucket still bounds the request.
                    fallback = true;
                }
            }
        }
        // Pre-authentication requests count against the cardinality cap of their source: the
        // coarse prefix of the client address (/24, /48), so the addresses one party controls share
        // one count. Authenticated principals are not capped.
        let source = (kind == PrincipalType::Ip).then(|| {
            SourceId::for_address(
                &self.settings.pepper,
                &request.principal.id,
                DEFAULT_SOURCE_PREFIXES,
            )
        });
        let decided = self.limiter.decide(&planned, source.as_ref()).await;
        let mut decision = decided.to_contract(&planned);
        decision.fallback |= fallback;
        if !decision.allowed {
            self.release_all(&held).await;
        }
        Ok(decision)
    }

    async fn release_all(&self, calls: &[LeaseCall]) {
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
        request.validate().map_err(|e| RequestRejected {
            field: e.field.to_owned(),
            message: e.message.to_owned(),
        })?;
        let Some(bundle) = self.bundle.load_full() else {
            return Ok(());
        };
        let Ok(Some(planned)) = plan_request(
            &bundle,
            request,
            &self.settings.pepper,
            self.settings.ip_prefixes,
            self.settings.decision_record_ttl_ms,
        ) else {
            return Ok(());
        };
        let calls: Vec<LeaseCall> = planned
            .rules
            .iter()
            .zip(planned.batch.rules())
            .filter_map(|(rule, batch_rule)| {
                let semaphore = rule.concurrency?;
                LeaseCall::new(
                    allot_shared::keys::concurrency_key(batch_rule.key()),
                    semaphore.max_in_flight(),
                    semaphore.lease_ttl_ms(),
                    request.request_id.clone(),
                )
                .ok()
            })
            .collect();
        self.release_all(&calls).await;
        Ok(())
    }

    /// Spends `cost` tokens of a global pool. `Ok(true)` when admitted from the fallback allowance.
    async fn spend_global(
        self: &Arc<Self>,
        tenant: &TenantId,
        pool: &PoolId,
        cost: u64,
    ) -> Result<bool, (Denial, u64, u64)> {
        let Some(mut slot) = self.slot(tenant, pool).await else {
            return Err((Denial::FailClosed, TERMS_RETRY_MS, 0));
        };
        for attempt in 0..2 {
            let now_ms = self.clock.now_ms();
            let spend = {
                let mut holder = lock(&slot.holder);
                if slot.evicted.load(Ordering::Acquire) {
                    drop(holder);
                    // Forgotten between the lookup and now (idle for minutes): look it up again.
                    match self.slot(tenant, pool).await {
                        Some(fresh) => slot = fresh,
                        None => return Err((Denial::FailClosed, TERMS_RETRY_MS, 0)),
                    }
                    lock(&slot.holder).spend(cost, now_ms, self.allocator_reachable())
                } else {
                    holder.spend(cost, now_ms, self.allocator_reachable())
                }
            };
            let limit = slot.limit.load(Ordering::Relaxed);
            // Registered before the renewal can start, so its end cannot be missed.
            let renewed = slot.renewed.notified();
            tokio::pin!(renewed);
            renewed.as_mut().enable();
            self.renew_if_wanted(tenant, pool, &slot);
            let depleted = match spend {
                Spend::Denied {
                    denial: Denial::AwaitingGrant,
                    ..
                } if attempt == 0 => Some("available"),
                Spend::Denied {
                    denial: Denial::PoolExhausted,
                    ..
                } => Some("exhausted"),
                _ => None,
            };
            if let Some(pool_state) = depleted {
                metrics::counter!(crate::metrics::LEASE_DEPLETIONS,
                    "tenant" => tenant.to_string(), "pool" => pool.to_string(),
                    "pool_state" => pool_state)
                .increment(1);
            }
            match spend {
                Spend::Leased(_) => return Ok(false),
                Spend::Fallback { .. } => return Ok(true),
                Spend::Denied {
                    denial: Denial::AwaitingGrant,
                    ..
                } if attempt == 0 => {
                    // Wait for the renewal in flight, if any (none: it already ended, or none was
                    // wanted; try again at once).
                    if lock(&slot.holder).renewal_in_flight() {
                        let _ = tokio::time::timeout(FIRST_GRANT_WAIT, renewed).await;
                    }
                }
                Spend::Denied {
                    denial,
                    retry_after_ms,
                } => return Err((denial, retry_after_ms, limit)),
            }
        }
        Err((
            Denial::AwaitingGrant,
            100,
            slot.limit.load(Ordering::Relaxed),
        ))
    }
}

fn unavailable(
    request: &AdmissionRequest,
    version: u64,
    rule: Option<&Rule>,
    reason: Reason,
    retry_after_ms: i64,
) -> Decision {
    Decision {
        allowed: false,
        decision_id: request.request_id.clone(),
        policy_id: rule.map(|r| r.id.to_string()),
        policy_version: version,
        denied_scope: rule.map(|r| r.scope.denied_scope()),
        reason: Some(reason),
        limit: 0,
        remaining: 0,
        retry_after_ms,
        fallback: false,
    }
}

fn global_denial(
    request: &AdmissionRequest,
    version: u64,
    rule: &Rule,
    denial: Denial,
    retry_after_ms: u64,
    limit: u64,
) -> Decision {
    let (reason, fallback) = match denial {
        Denial::PoolExhausted => (Reason::RateExceeded, false),
        Denial::FallbackSpent => (Reason::RateExceeded, true),
        // The window's quota can no longer be leased; the pool refills when it ends.
        Denial::WindowEnding => (Reason::RateExceeded, false),
        Denial::FailClosed | Denial::AwaitingGrant => (Reason::LimiterUnavailable, false),
    };
    Decision {
        allowed: false,
        decision_id: request.request_id.clone(),
        policy_id: Some(rule.id.to_string()),
        policy_version: version,
        denied_scope: Some(DeniedScope::Global),
        reason: Some(reason),
        limit,
        remaining: 0,
        retry_after_ms: i64::try_from(retry_after_ms).unwrap_or(i64::MAX),
        fallback,
    }
}
