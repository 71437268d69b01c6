//! The pool registry: the pools an agent holds (one [`PoolAgent`] each, with the terms in force),
//! how a request finds its pool, and the single-flight lookup of a pool's terms.

use std::collections::HashMap;
use std::sync::atomic::AtomicU64;
use std::sync::{Arc, Mutex};

use allot_shared::ids::{PoolId, TenantId};

use super::batch_queue::BatchQueue;
use super::busy::BusyPools;
use super::pool_slot::PoolSlot;
use super::settings::FIRST_GRANT_WAIT;
use super::{Agent, lock};
use crate::allocator_client::{
    AllocatorClient, ClientError, MAX_TERMS_PER_BATCH, TermsAsk, TermsBatch, TermsOutcome,
};
use crate::global::PoolAgent;

/// After a pool's terms could not be fetched (allocator unreachable), requests for it fail closed
/// from memory for this long, ms, instead of each calling the allocator again.
pub const TERMS_RETRY_MS: u64 = 1_000;
/// After the allocator said a pool does not exist, requests for it are denied from memory for this
/// long, ms.
pub const UNKNOWN_POOL_RETRY_MS: u64 = 5_000;
/// A held pool's terms are fetched again at most this often, ms (a pool update reaches the agent
/// within about this long).
pub const TERMS_REFRESH_MS: u64 = 30_000;
/// Most pool terms fetched again in one upkeep round (the rest wait for the next round).
pub const MAX_TERMS_REFRESH_PER_ROUND: usize = 64;
/// A pool with no demand for this long, and nothing held or owed, is forgotten, ms (looked at
/// once this long after a report round found it settled).
pub const POOL_IDLE_MS: u64 = 600_000;

/// A pool whose terms the agent does not hold.
enum Lookup {
    /// Being fetched; the sender is dropped when the fetch ends (single flight).
    Fetching(tokio::sync::watch::Receiver<()>),
    /// Could not be had; requests fail closed from memory until then, epoch ms.
    Missing { retry_at_ms: u64 },
}

pub(super) use super::busy::PoolKey;

/// The pools an agent holds, by tenant then pool: a request finds its pool from the ids it already
/// has, without building (allocating) a key.
#[derive(Default)]
pub(super) struct PoolSlots {
    by_tenant: HashMap<TenantId, HashMap<PoolId, Arc<PoolSlot>>>,
    len: usize,
}

/// The pools an agent holds, those the background rounds visit, the lookups of pools' terms under
/// way or remembered, and the report lines holders dropped. Lock order: lookups before slots, and
/// a slot's own locks after both; the busy pools' lock last.
#[derive(Default)]
pub(super) struct PoolRegistry {
    slots: Mutex<PoolSlots>,
    /// The pools touched since they settled, which the background rounds visit.
    busy: Arc<BusyPools>,
    /// Pools being looked up, or recently not found (at most the settings' `max_pools`).
    lookups: Mutex<HashMap<PoolKey, Lookup>>,
    /// Report lines dropped by holders, as the report rounds and evictions counted them.
    dropped_reports: AtomicU64,
    /// Fallback claims requests are waiting for the journal to make durable: (the pool's slot,
    /// the request's cost). Taken whole by the one writer.
    claims_wanted: Mutex<Vec<(Arc<PoolSlot>, u64)>>,
    /// Lookups waiting for the terms sender: each pool's key and the sender its waiting requests
    /// watch (dropped when the lookup is settled). At most one per lookup under way.
    lookup_queue: BatchQueue<(PoolKey, tokio::sync::watch::Sender<()>)>,
}

impl PoolRegistry {
    pub(super) fn slots(&self) -> std::sync::MutexGuard<'_, PoolSlots> {
        lock(&self.slots)
    }

    fn lookups(&self) -> std::sync::MutexGuard<'_, HashMap<PoolKey, Lookup>> {
        lock(&self.lookups)
    }

    /// The slot of `tenant`'s `pool`, if held.
    pub(super) fn get(&self, tenant: &TenantId, pool: &PoolId) -> Option<Arc<PoolSlot>> {
        self.slots().get(tenant, pool).cloned()
    }

    /// Every slot with its key, for work done outside the lock.
    pub(super) fn snapshot(&self) -> Vec<(PoolKey, Arc<PoolSlot>)> {
        self.slots().snapshot()
    }

    /// The pools the background rounds visit.
    pub(super) fn busy(&self) -> &Arc<BusyPools> {
        &self.busy
    }

    /// The slots of the pools the background rounds visit now, in key order. A key whose slot is
    /// gone (a forgotten pool acted on by a request that still held it) is unlisted.
    pub(super) fn busy_slots(&self) -> Vec<(PoolKey, Arc<PoolSlot>)> {
        let keys = self.busy.listed();
        let slots = self.slots();
        keys.into_iter()
            .filter_map(|key| match slots.get(&key.0, &key.1) {
                Some(slot) => Some((key, slot.clone())),
                None => {
                    self.busy.forget(&key);
                    None
                }
            })
            .collect()
    }

    /// Holders dropped `lines` more report lines.
    pub(super) fn note_dropped_reports(&self, lines: u64) {
        if lines > 0 {
            self.dropped_reports
                .fetch_add(lines, std::sync::atomic::Ordering::Relaxed);
        }
    }

    /// Report lines holders dropped, as counted so far.
    pub(super) fn dropped_reports(&self) -> u64 {
        self.dropped_reports
            .load(std::sync::atomic::Ordering::Relaxed)
    }

    /// A request waits for a fallback claim of `cost_tokens` on `slot`.
    pub(super) fn want_claim(&self, slot: &Arc<PoolSlot>, cost_tokens: u64) {
        lock(&self.claims_wanted).push((slot.clone(), cost_tokens));
    }

    /// Every fallback claim wanted so far, for one journal write.
    pub(super) fn take_claims_wanted(&self) -> Vec<(Arc<PoolSlot>, u64)> {
        std::mem::take(&mut *lock(&self.claims_wanted))
    }

    /// Pools held, and pools being looked up or recently not found.
    pub(super) fn counts(&self) -> (usize, usize) {
        (self.slots().len(), self.lookups().len())
    }
}

impl PoolSlots {
    pub(super) fn get(&self, tenant: &TenantId, pool: &PoolId) -> Option<&Arc<PoolSlot>> {
        self.by_tenant.get(tenant)?.get(pool)
    }

    pub(super) fn len(&self) -> usize {
        self.len
    }

    /// The slot of `key`, made by `make` when absent.
    pub(super) fn get_or_insert_with(
        &mut self,
        key: PoolKey,
        make: impl FnOnce() -> Arc<PoolSlot>,
    ) {
        let pools = self.by_tenant.entry(key.0).or_default();
        if let std::collections::hash_map::Entry::Vacant(vacant) = pools.entry(key.1) {
            vacant.insert(make());
            self.len += 1;
        }
    }

    pub(super) fn remove(&mut self, (tenant, pool): &PoolKey) {
        let Some(pools) = self.by_tenant.get_mut(tenant) else {
            return;
        };
        if pools.remove(pool).is_some() {
            self.len -= 1;
        }
        if pools.is_empty() {
            self.by_tenant.remove(tenant);
        }
    }

    pub(super) fn iter(&self) -> impl Iterator<Item = ((&TenantId, &PoolId), &Arc<PoolSlot>)> {
        self.by_tenant.iter().flat_map(|(tenant, pools)| {
            pools.iter().map(move |(pool, slot)| ((tenant, pool), slot))
        })
    }

    /// Every slot with its key, for work done outside the lock.
    pub(super) fn snapshot(&self) -> Vec<(PoolKey, Arc<PoolSlot>)> {
        self.iter()
            .map(|((tenant, pool), slot)| ((tenant.clone(), pool.clone()), slot.clone()))
            .collect()
    }
}

impl Agent {
    /// The length of the window of `tenant`'s pool `pool` in force now, ms, when the agent holds
    /// the pool (no fetch: for what a caller is told of a decision already made).
    pub fn pool_window_ms(&self, tenant: &TenantId, pool: &PoolId) -> Option<u64> {
        let slot = self.pools.get(tenant, pool)?;
        let now_ms = self.clock.now_ms();
        let length_ms = slot
            .agent_quietly()
            .config()
            .window
            .containing(now_ms)
            .length_ms();
        Some(length_ms)
    }

    /// The pool's slot, fetching its terms on first use. `None` when the terms cannot be had (no
    /// allocator, unknown pool, unreachable, or too many pools).
    ///
    /// Off the hot path by construction: one fetch per pool at a time (the others wait for it, up
    /// to [`FIRST_GRANT_WAIT`]), the fetch runs on its own task with the client's deadline, and a
    /// failed lookup is remembered ([`TERMS_RETRY_MS`], [`UNKNOWN_POOL_RETRY_MS`]) so a flood of
    /// requests for a missing pool costs one allocator call per interval, not one per request.
    pub(super) async fn slot(
        self: &Arc<Self>,
        tenant: &TenantId,
        pool: &PoolId,
    ) -> Option<Arc<PoolSlot>> {
        if let Some(slot) = self.pools.slots().get(tenant, pool) {
            return Some(slot.clone());
        }
        let allocator = self.allocator.clone()?;
        let key = (tenant.clone(), pool.clone());
        let mut fetched = {
            let mut lookups = self.pools.lookups();
            // The fetch may have finished since the first look (it installs, then forgets).
            if let Some(slot) = self.pools.slots().get(tenant, pool) {
                return Some(slot.clone());
            }
            let now_ms = self.clock.now_ms();
            match lookups.get(&key) {
                Some(Lookup::Missing { retry_at_ms }) if now_ms < *retry_at_ms => return None,
                Some(Lookup::Fetching(fetched)) => fetched.clone(),
                _ => {
                    if lookups.len() >= self.settings.max_pools {
                        lookups.retain(|_, lookup| {
                            !matches!(lookup, Lookup::Missing { retry_at_ms } if *retry_at_ms <= now_ms)
                        });
                        if lookups.len() >= self.settings.max_pools {
                            return None;
                        }
                    }
                    let (done, fetched) = tokio::sync::watch::channel(());
                    lookups.insert(key.clone(), Lookup::Fetching(fetched.clone()));
                    if self.pools.lookup_queue.push((key.clone(), done)) {
                        tokio::spawn(self.clone().send_lookups(allocator));
                    }
                    fetched
                }
            }
        };
        // Ends when the fetch's sender is dropped; the fetch goes on without a caller who stops
        // waiting.
        let _ = tokio::time::timeout(FIRST_GRANT_WAIT, fetched.changed()).await;
        self.pools.get(tenant, pool)
    }

    /// The terms sender: takes the queued lookups, at most a batch's worth a call, one call at a
    /// time, until none waits; settles every lookup it takes, whatever the call did. Pools met at
    /// once (a cold start) cost a call per batch, not one each.
    async fn send_lookups(self: Arc<Self>, allocator: Arc<AllocatorClient>) {
        loop {
            let batch = self.pools.lookup_queue.take(MAX_TERMS_PER_BATCH);
            if batch.is_empty() {
                if self.pools.lookup_queue.stop_sender() {
                    return;
                }
                continue;
            }
            let keys: Vec<&PoolKey> = batch.iter().map(|(key, _)| key).collect();
            let answers = self.ask_terms(&allocator, &keys).await;
            debug_assert_eq!(answers.len(), batch.len(), "one answer per lookup");
            for ((key, done), answer) in batch.into_iter().zip(answers) {
                self.settle_lookup(key, answer, done);
            }
        }
    }

    /// The terms of `keys`' pools, one answer each in order: in one batch call, or one call each
    /// (concurrently) for a single pool or from an allocator without the batch route. This run's
    /// session starts before its first holder (the holder takes over how the last run ended).
    async fn ask_terms(&self, allocator: &AllocatorClient, keys: &[&PoolKey]) -> Vec<TermsOutcome> {
        if let Err(error) = self.start_session(allocator).await {
            self.note_allocator::<()>(&Err(error.clone()));
            return vec![Err(error); keys.len()];
        }
        let asker = (&self.settings.region, &self.settings.agent_id);
        let route_missing = self
            .pools
            .lookup_queue
            .batch_route
            .is_missing(self.clock.now_ms());
        if keys.len() > 1 && !route_missing {
            let call = TermsBatch {
                region: Some(asker.0.clone()),
                agent_id: Some(asker.1.clone()),
                pools: keys
                    .iter()
                    .map(|(tenant, pool)| TermsAsk {
                        tenant: tenant.clone(),
                        pool: pool.clone(),
                    })
                    .collect(),
            };
            let stopwatch = crate::clock::Stopwatch::start();
            let called = allocator.pool_terms_batch(&call).await;
            metrics::histogram!(crate::metrics::ALLOCATOR_SECONDS, "call" => "terms_batch")
                .record(stopwatch.elapsed().as_secs_f64());
            self.note_allocator(&called);
            match called {
                Ok(outcomes) => return outcomes,
                Err(ClientError::Refused {
                    status: 404 | 405, ..
                }) => {
                    tracing::info!("the allocator has no batch route for terms: one call per pool");
                    self.pools
                        .lookup_queue
                        .batch_route
                        .note_missing(self.clock.now_ms());
                }
                Err(error) => return vec![Err(error); keys.len()],
            }
        }
        futures::future::join_all(keys.iter().map(|(tenant, pool)| async move {
            let stopwatch = crate::clock::Stopwatch::start();
            let terms = allocator.pool_terms(tenant, pool, Some(asker)).await;
            metrics::histogram!(crate::metrics::ALLOCATOR_SECONDS, "call" => "terms")
                .record(stopwatch.elapsed().as_secs_f64());
            self.note_allocator(&terms);
            terms
        }))
        .await
    }

    /// Installs the slot of `key`'s pool from `answer`, or remembers why not. Dropping `done`
    /// wakes the requests waiting for it.
    ///
    /// Long by design: every outcome of the lookup (slot installed, pool cap reached, unusable
    /// terms, no such pool, allocator error) comes down to one retry time, which is written to the
    /// lookups before `done` is dropped, so a woken request always finds the pool's slot or why it
    /// is missing; split, that order would rest on each piece's caller.
    fn settle_lookup(
        &self,
        key: PoolKey,
        answer: TermsOutcome,
        done: tokio::sync::watch::Sender<()>,
    ) {
        let (tenant, pool) = &key;
        let now_ms = self.clock.now_ms();
        let retry_in_ms = match answer {
            Ok(Some(mut terms)) => {
                // What this agent already admitted in fallback this window, as its reports named
                // it (a restart must not re-open its allowance); not part of the terms kept and
                // compared.
                let fallback_in_window = terms.fallback_in_window.take();
                match self.holder_config(&terms) {
                    Some(config) => {
                        let mut pools = self.pools.slots();
                        if pools.len() < self.settings.max_pools {
                            let inherited = self.inherited(fallback_in_window);
                            pools.get_or_insert_with(key.clone(), || {
                                crate::metrics::pool_held(&key.0, &key.1);
                                let (agent, presumed) =
                                    PoolAgent::taking_over(config, inherited, now_ms);
                                let slot = PoolSlot::new(
                                    key.clone(),
                                    agent,
                                    terms,
                                    now_ms,
                                    self.pools.busy().clone(),
                                );
                                if presumed {
                                    metrics::counter!(
                                        crate::metrics::FALLBACK_PRESUMED_USED,
                                        "tenant" => key.0.to_string(),
                                        "pool" => key.1.to_string()
                                    )
                                    .increment(1);
                                }
                                Arc::new(slot)
                            });
                            self.note_change();
                            None
                        } else {
                            tracing::warn!(
                                max = self.settings.max_pools,
                                "agent holds its maximum of pools (--max-pools)"
                            );
                            Some(TERMS_RETRY_MS)
                        }
                    }
                    None => {
                        tracing::error!(%tenant, %pool, "pool terms with a zero window ignored");
                        Some(UNKNOWN_POOL_RETRY_MS)
                    }
                }
            }
            Ok(None) => {
                tracing::debug!(%tenant, %pool, "no such pool at the allocator");
                Some(UNKNOWN_POOL_RETRY_MS)
            }
            Err(error) => {
                metrics::counter!(crate::metrics::ALLOCATOR_ERRORS, "call" => "terms").increment(1);
                tracing::warn!(%error, %tenant, %pool, "pool terms not fetched");
                Some(TERMS_RETRY_MS)
            }
        };
        let mut lookups = self.pools.lookups();
        match retry_in_ms {
            None => lookups.remove(&key),
            Some(retry_ms) => lookups.insert(
                key,
                Lookup::Missing {
                    retry_at_ms: now_ms.saturating_add(retry_ms),
                },
            ),
        };
        drop(lookups);
        drop(done);
    }
}

/// A global rule's cost for `request`, whole tokens (pools count whole tokens; policy validation
/// keeps a global rule's cost a multiple of 1,000 millitokens), at least 1.
pub(super) fn global_cost_tokens(
    rule: &allot_shared::policy::Rule,
    request: &allot_shared::contract::AdmissionRequest,
) -> u64 {
    rule.cost_millitokens_for(request.cost_hint)
        .map_or(u64::MAX, |millitokens| {
            millitokens / allot_shared::MILLITOKENS_PER_TOKEN
        })
        .max(1)
}

impl Agent {
    /// Pools held now (with terms), and pools being looked up or recently not found.
    pub fn pool_counts(&self) -> (usize, usize) {
        self.pools.counts()
    }

    /// Pools touched since a report round last found them settled: the ones the background
    /// rounds visit.
    pub fn busy_pools(&self) -> usize {
        self.pools.busy().listed_count()
    }
}
