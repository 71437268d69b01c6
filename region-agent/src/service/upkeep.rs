//! Pool upkeep (idle pools forgotten, terms refreshed) and lease renewals.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use allot_shared::ids::{LeaseId, PoolId, TenantId};
use allot_shared::wire::GrantAnswer;

use super::Agent;
use super::pool_slot::{AllocatorView, PoolSlot};
use super::pools::{MAX_TERMS_REFRESH_PER_ROUND, POOL_IDLE_MS, TERMS_REFRESH_MS};
use crate::global::GrantCall;
use crate::global::clock_offset::ClockOffset;
use crate::global::driver::RenewalOutcome;

impl Agent {
    /// Pool upkeep: forgets pools idle for [`POOL_IDLE_MS`] with nothing held or owed, and fetches
    /// the terms of pools last fetched [`TERMS_REFRESH_MS`] ago or more (at most
    /// [`MAX_TERMS_REFRESH_PER_ROUND`] per call), so pool updates reach the holders.
    pub async fn maintain_pools(&self) {
        let now_ms = self.clock.now_ms();
        let slots = self.pools.snapshot();
        let mut stale = Vec::new();
        for (key, slot) in slots {
            let mut pools = self.pools.slots();
            let mut agent = slot.agent();
            let current = pools
                .get(&key.0, &key.1)
                .is_some_and(|s| Arc::ptr_eq(s, &slot));
            if current && agent.is_idle(now_ms, POOL_IDLE_MS) {
                slot.mark_evicted(&agent);
                self.pools
                    .note_evicted_drops(agent.holder().dropped_reports());
                pools.remove(&key);
                continue;
            }
            drop((agent, pools));
            let fetched_at_ms = slot.terms_fetched_at_ms();
            if now_ms.saturating_sub(fetched_at_ms) >= TERMS_REFRESH_MS {
                stale.push((fetched_at_ms, key, slot));
            }
        }
        let Some(allocator) = self.allocator.as_ref() else {
            return;
        };
        // Longest unrefreshed first.
        stale.sort_by_key(|(fetched_at_ms, _, _)| *fetched_at_ms);
        for (_, (tenant, pool), slot) in stale.into_iter().take(MAX_TERMS_REFRESH_PER_ROUND) {
            let answer = allocator.pool_terms(&tenant, &pool, None).await;
            self.note_allocator(&answer);
            match answer {
                Ok(Some(terms)) => {
                    let Some(config) = self.holder_config(&terms) else {
                        continue;
                    };
                    let version = terms.version;
                    if slot.take_terms(terms, config, self.clock.now_ms()) {
                        tracing::info!(%tenant, %pool, version, "pool terms updated");
                        self.note_change();
                    }
                }
                Ok(None) => {
                    // Deleted: its leases run out, renewals answer nothing; it is forgotten when idle.
                    tracing::warn!(%tenant, %pool, "a held pool no longer exists at the allocator");
                    slot.terms_checked(self.clock.now_ms());
                }
                Err(error) => {
                    tracing::debug!(%error, "pool terms not refreshed; next round");
                    return;
                }
            }
        }
    }

    /// Starts a renewal (single flight) when the holder wants one.
    ///
    /// Long by design: most of it is the one spawned task of a renewal, from the call to the
    /// allocator to the end of the flight, its answer applied under the agent's lock so that a
    /// quota read sees the grant and the allocator's figure together; split, the task's captured
    /// agent, slot and ask would be passed between functions, and the flight's end would be read
    /// apart from its start.
    pub(super) fn renew_if_wanted(
        self: &Arc<Self>,
        tenant: &TenantId,
        pool: &PoolId,
        slot: &Arc<PoolSlot>,
    ) {
        let Some(allocator) = self.allocator.clone() else {
            return;
        };
        let asked = {
            let now_ms = self.clock.now_ms();
            let fresh = LeaseId::from_parts(now_ms, rand::random());
            slot.agent().renewal_to_ask(now_ms, fresh)
        };
        let Some(ask) = asked else {
            return;
        };
        let (agent, slot, tenant, pool) =
            (self.clone(), slot.clone(), tenant.clone(), pool.clone());
        tokio::spawn(async move {
            let asked_at_ms = agent.clock.now_ms();
            let stopwatch = crate::clock::Stopwatch::start();
            let called = allocator
                .grant(
                    &tenant,
                    &pool,
                    &agent.settings.region,
                    ask.lease_id,
                    ask.want_tokens,
                )
                .await;
            metrics::histogram!(crate::metrics::ALLOCATOR_SECONDS, "call" => "grant")
                .record(stopwatch.elapsed().as_secs_f64());
            agent.note_allocator(&called);
            if let Ok(Some(answer)) = &called {
                agent.note_clock_offset(asked_at_ms, answer);
            }
            let call = match &called {
                Ok(Some(answer)) => GrantCall::Answered {
                    answer: answer.clone(),
                    asked_at_ms,
                },
                Ok(None) => GrantCall::PoolGone,
                // No answer (or a 5xx): the grant may have been committed. A refusal is final.
                Err(error) if error.is_unreachable() => GrantCall::Unanswered,
                Err(_) => GrantCall::Refused,
            };
            // Under the agent's lock, so that a quota read sees the grant and the allocator's
            // figure after it together.
            let outcome = {
                let mut pool_agent = slot.agent();
                let Some(outcome) = pool_agent.renewal_answered(&call, agent.clock.now_ms()) else {
                    return;
                };
                if let (Ok(Some(answer)), false) = (&called, outcome == RenewalOutcome::StaleEpoch)
                {
                    note_allocator_view(&slot, answer, asked_at_ms);
                }
                outcome
            };
            metrics::counter!(crate::metrics::RENEWALS, "outcome" => outcome.as_str()).increment(1);
            match (&called, outcome) {
                (Ok(Some(answer)), RenewalOutcome::StaleEpoch) => {
                    tracing::warn!(epoch = %answer.epoch, %tenant, %pool,
                        "grant from a stale allocator epoch ignored");
                }
                (Ok(Some(answer)), outcome) if outcome.held() => {
                    metrics::counter!(crate::metrics::TOKENS_GRANTED)
                        .increment(answer.granted_tokens);
                }
                (Ok(None), _) => tracing::warn!(%tenant, %pool, "the pool no longer exists"),
                (Err(error), _) => {
                    metrics::counter!(crate::metrics::ALLOCATOR_ERRORS, "call" => "grant")
                        .increment(1);
                    tracing::warn!(%error, %tenant, %pool, "renewal failed");
                }
                _ => {}
            }
            if called.as_ref().is_ok_and(Option::is_some) {
                agent.note_change();
            }
            slot.note_renewal_ended();
        });
    }
}

impl Agent {
    /// Notes what a grant answer, asked at `asked_at_ms` and received now, says of this agent's
    /// clock against the allocator's: the estimate as a gauge, and a count (and a warning, once a
    /// run) when it is certainly beyond the clock margin.
    fn note_clock_offset(&self, asked_at_ms: u64, answer: &GrantAnswer) {
        let received_at_ms = self.clock.now_ms();
        let Some(offset) =
            ClockOffset::from_exchange(asked_at_ms, received_at_ms, answer.answered_at_ms())
        else {
            return;
        };
        metrics::gauge!(crate::metrics::CLOCK_OFFSET_MS).set(offset.estimate_ms() as f64);
        let margin_ms = self.settings.clock_margin_ms;
        if offset.beyond(margin_ms) {
            metrics::counter!(crate::metrics::CLOCK_BEYOND_MARGIN).increment(1);
            if !self.clock_warned.swap(true, Ordering::Relaxed) {
                tracing::warn!(
                    offset_low_ms = offset.low_ms,
                    offset_high_ms = offset.high_ms,
                    margin_ms,
                    "this agent's clock is further off the allocator's than --clock-margin-ms: \
                     fallback admits may land in a neighbouring window; fix the clock (NTP) or \
                     raise the margin"
                );
            }
        }
    }
}

/// Keeps what the allocator said was left of the pool's window, timed on the agent's clock: a
/// replayed answer speaks of when the grant was issued, that long before it was answered.
fn note_allocator_view(slot: &PoolSlot, answer: &GrantAnswer, asked_at_ms: u64) {
    let Some(ungranted_tokens) = answer.ungranted_tokens else {
        return;
    };
    let answered_late_ms = answer.answered_at_ms().saturating_sub(answer.issued_at_ms);
    slot.set_allocator_view(AllocatorView {
        ungranted_tokens,
        window: allot_shared::window::Window {
            start_ms: answer.window_start_ms,
            end_ms: answer.window_end_ms,
        },
        as_of_ms: asked_at_ms.saturating_sub(answered_late_ms),
    });
}
