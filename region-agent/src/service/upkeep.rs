//! Pool upkeep (idle pools forgotten, terms refreshed) and lease renewals.
//!
//! Renewals are queued and sent by one sender, every pool that wants one in the same call
//! (`POST /v1/grants/batch`, up to [`MAX_GRANTS_PER_BATCH`]), one call at a time: an agent's cost
//! to the allocator grows with its rounds, not with its pools. Each renewal keeps its own lease id
//! and outcome: one the call did not answer is asked again alone, with the same id, when its pool
//! next wants tokens.

use std::sync::atomic::Ordering;
use std::sync::{Arc, MutexGuard};

use allot_shared::ids::{LeaseId, PoolId, TenantId};
use allot_shared::wire::{GrantAnswer, GrantBatch, GrantBody, MAX_GRANTS_PER_BATCH};

use super::Agent;
use super::busy::MAX_SETTLED_CHECKS_PER_ROUND;
use super::pool_slot::{AllocatorView, PoolSlot};
use super::pools::{
    MAX_TERMS_REFRESH_PER_ROUND, POOL_IDLE_MS, PoolKey, PoolSlots, TERMS_REFRESH_MS,
};
use crate::allocator_client::{AllocatorClient, ClientError, GrantOutcome};
use crate::global::clock_offset::ClockOffset;
use crate::global::driver::{RenewalAsk, RenewalOutcome};
use crate::global::{GrantCall, PoolAgent};

impl Agent {
    /// Pool upkeep: forgets pools idle for [`POOL_IDLE_MS`] with nothing held or owed, and fetches
    /// the terms of busy pools last fetched [`TERMS_REFRESH_MS`] ago or more (at most
    /// [`MAX_TERMS_REFRESH_PER_ROUND`] per call), so pool updates reach the holders. It looks at
    /// busy pools and at settled ones due to be forgotten, never at every pool held: a pool
    /// touched after a long quiet is busy again, and its terms are fetched at the next round.
    pub async fn maintain_pools(&self) {
        let now_ms = self.clock.now_ms();
        self.forget_idle_pools(now_ms);
        let busy = self.pools.busy_slots();
        metrics::counter!(crate::metrics::POOLS_VISITED, "round" => "upkeep")
            .increment(busy.len() as u64);
        let mut stale = Vec::new();
        for (key, slot) in busy {
            if self.forget_if_idle(&key, &slot, now_ms) {
                continue;
            }
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

    /// Forgets the pools that settled [`POOL_IDLE_MS`] ago or more and are idle (at most
    /// [`MAX_SETTLED_CHECKS_PER_ROUND`] looked at); one touched since is busy again and left
    /// alone, one that may not be forgotten yet (its window still counts) is looked at again
    /// later.
    fn forget_idle_pools(&self, now_ms: u64) {
        let due = self.pools.busy().take_settled(
            now_ms.saturating_sub(POOL_IDLE_MS),
            MAX_SETTLED_CHECKS_PER_ROUND,
        );
        metrics::counter!(crate::metrics::POOLS_VISITED, "round" => "upkeep")
            .increment(due.len() as u64);
        for (_, key, slot_id) in due {
            let mut pools = self.pools.slots();
            // Gone, or a successor's: the entry was the forgotten slot's.
            let Some(slot) = pools
                .get(&key.0, &key.1)
                .filter(|slot| slot.id() == slot_id)
                .cloned()
            else {
                continue;
            };
            let mut agent = slot.agent_quietly();
            let Some(settled_at_ms) = slot.dequeued(&agent) else {
                // Busy again: queued afresh when it settles.
                continue;
            };
            if settled_at_ms.saturating_add(POOL_IDLE_MS) > now_ms {
                // Settled again since it was queued.
                slot.queue_again(&agent, settled_at_ms);
            } else if agent.is_idle(now_ms, POOL_IDLE_MS) {
                self.evict(&mut pools, &key, &slot, &mut agent);
            } else {
                // Its window still counts: looked at again later.
                slot.queue_again(&agent, now_ms);
            }
        }
    }

    /// Forgets `key`'s pool if it is still `slot` and idle for [`POOL_IDLE_MS`] with nothing
    /// held or owed; whether it did.
    fn forget_if_idle(&self, key: &PoolKey, slot: &Arc<PoolSlot>, now_ms: u64) -> bool {
        let mut pools = self.pools.slots();
        let mut agent = slot.agent_quietly();
        let current = pools
            .get(&key.0, &key.1)
            .is_some_and(|held| Arc::ptr_eq(held, slot));
        if !current || !agent.is_idle(now_ms, POOL_IDLE_MS) {
            return false;
        }
        self.evict(&mut pools, key, slot, &mut agent);
        true
    }

    /// Forgets `key`'s pool, held in `slot` (`pools` and `agent`: the registry's and its agent's
    /// locks, held).
    fn evict(
        &self,
        pools: &mut PoolSlots,
        key: &PoolKey,
        slot: &PoolSlot,
        agent: &mut MutexGuard<'_, PoolAgent>,
    ) {
        slot.mark_evicted(agent);
        self.pools
            .note_dropped_reports(agent.take_dropped_reports());
        pools.remove(key);
        self.pools.busy().forget(key);
    }

    /// Queues a renewal (single flight per pool) when the holder wants one, and starts the sender
    /// when none runs.
    pub(super) fn renew_if_wanted(
        self: &Arc<Self>,
        tenant: &TenantId,
        pool: &PoolId,
        slot: &Arc<PoolSlot>,
    ) {
        if self.allocator.is_none() {
            return;
        }
        let asked = {
            let now_ms = self.clock.now_ms();
            let fresh = LeaseId::from_parts(now_ms, rand::random());
            slot.agent().renewal_to_ask(now_ms, fresh)
        };
        let Some(ask) = asked else {
            return;
        };
        let renewal = QueuedRenewal {
            tenant: tenant.clone(),
            pool: pool.clone(),
            slot: slot.clone(),
            ask,
        };
        if self.renewals.push(renewal) {
            let agent = self.clone();
            tokio::spawn(async move { agent.send_renewals().await });
        }
    }

    /// The sender: takes the queued renewals, at most a batch's worth a call, one call at a time,
    /// until none waits. Every renewal taken is answered (its flight ended), whatever the call did.
    async fn send_renewals(self: Arc<Self>) {
        let Some(allocator) = self.allocator.clone() else {
            return;
        };
        loop {
            let batch = self.renewals.take(MAX_GRANTS_PER_BATCH);
            if batch.is_empty() {
                if self.renewals.stop_sender() {
                    return;
                }
                continue;
            }
            let asked_at_ms = self.clock.now_ms();
            let answers = self.ask_allocator(&allocator, &batch).await;
            debug_assert_eq!(answers.len(), batch.len(), "one answer per renewal");
            for (renewal, called) in batch.into_iter().zip(answers) {
                self.renewal_answered(renewal, asked_at_ms, called);
            }
        }
    }

    /// Asks the allocator for `batch` in one call, or one call each (concurrently) from an
    /// allocator without the batch route; one answer per renewal, in order: `Ok(None)` when the
    /// pool does not exist.
    async fn ask_allocator(
        &self,
        allocator: &AllocatorClient,
        batch: &[QueuedRenewal],
    ) -> Vec<GrantOutcome> {
        if self.renewals.batch_route.is_missing(self.clock.now_ms()) {
            return self.ask_one_by_one(allocator, batch).await;
        }
        let call = GrantBatch {
            grants: batch
                .iter()
                .map(|renewal| GrantBody {
                    lease_id: renewal.ask.lease_id,
                    tenant: renewal.tenant.clone(),
                    pool: renewal.pool.clone(),
                    region: self.settings.region.clone(),
                    want_tokens: renewal.ask.want_tokens,
                })
                .collect(),
        };
        let stopwatch = crate::clock::Stopwatch::start();
        let called = allocator.grant_batch(&call).await;
        metrics::histogram!(crate::metrics::ALLOCATOR_SECONDS, "call" => "grant_batch")
            .record(stopwatch.elapsed().as_secs_f64());
        self.note_allocator(&called);
        match called {
            Ok(outcomes) => outcomes,
            Err(ClientError::Refused {
                status: 404 | 405, ..
            }) => {
                tracing::info!("the allocator has no batch route for grants: one call per renewal");
                self.renewals.batch_route.note_missing(self.clock.now_ms());
                self.ask_one_by_one(allocator, batch).await
            }
            Err(error) => vec![Err(error); batch.len()],
        }
    }

    /// One `POST /v1/grants` per renewal, all at once, as an allocator without the batch route
    /// takes them.
    async fn ask_one_by_one(
        &self,
        allocator: &AllocatorClient,
        batch: &[QueuedRenewal],
    ) -> Vec<GrantOutcome> {
        futures::future::join_all(batch.iter().map(|renewal| async move {
            let stopwatch = crate::clock::Stopwatch::start();
            let called = allocator
                .grant(
                    &renewal.tenant,
                    &renewal.pool,
                    &self.settings.region,
                    renewal.ask.lease_id,
                    renewal.ask.want_tokens,
                )
                .await;
            metrics::histogram!(crate::metrics::ALLOCATOR_SECONDS, "call" => "grant")
                .record(stopwatch.elapsed().as_secs_f64());
            self.note_allocator(&called);
            called
        }))
        .await
    }

    /// Takes what came back for one renewal, asked at `asked_at_ms`, into its pool and ends the
    /// flight: under the pool agent's lock, so that a quota read sees the grant and the
    /// allocator's figure after it together.
    fn renewal_answered(&self, renewal: QueuedRenewal, asked_at_ms: u64, called: GrantOutcome) {
        let QueuedRenewal {
            tenant, pool, slot, ..
        } = renewal;
        if let Ok(Some(answer)) = &called {
            self.note_clock_offset(asked_at_ms, answer);
            slot.note_terms_version(answer.terms_version, self.clock.now_ms());
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
        let outcome = {
            let mut pool_agent = slot.agent();
            let Some(outcome) = pool_agent.renewal_answered(&call, self.clock.now_ms()) else {
                return;
            };
            if let (Ok(Some(answer)), false) = (&called, outcome == RenewalOutcome::StaleEpoch) {
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
                metrics::counter!(crate::metrics::TOKENS_GRANTED).increment(answer.granted_tokens);
            }
            (Ok(None), _) => tracing::warn!(%tenant, %pool, "the pool no longer exists"),
            (Err(error), _) => {
                metrics::counter!(crate::metrics::ALLOCATOR_ERRORS, "call" => "grant").increment(1);
                tracing::warn!(%error, %tenant, %pool, "renewal failed");
            }
            _ => {}
        }
        if called.as_ref().is_ok_and(Option::is_some) {
            self.note_change();
        }
        slot.note_renewal_ended();
    }
}

/// A renewal waiting for the sender: the pool, its slot, and what its agent asks.
pub(super) struct QueuedRenewal {
    tenant: TenantId,
    pool: PoolId,
    slot: Arc<PoolSlot>,
    ask: RenewalAsk,
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
