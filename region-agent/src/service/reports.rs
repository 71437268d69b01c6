//! Reports to the ledger: what each pool's agent owes (its leases' spend, its fallback admits,
//! its shadow counts, settle debt and write-offs), one report per (pool, window), named by this
//! agent and run.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use allot_shared::ids::LeaseId;

use super::Agent;
use super::pool_slot::PoolSlot;
use crate::allocator_client::{
    AllocatorClient, ClientError, MAX_LEASE_LINES_PER_BATCH, MAX_REPORT_BATCH_BYTES,
    MAX_REPORTS_PER_BATCH, Report, ReportBatch,
};
use crate::global::PoolReport;

/// One report owed: the pool's slot, the part its agent owes, and the part as the wire says it.
struct Owed {
    slot: Arc<PoolSlot>,
    part: PoolReport,
    body: Report,
    /// Pools of the round visited up to and including this one: where the next round starts when
    /// this round stops after this report's call.
    pools_visited: usize,
}

/// A round's reports, in the order of the pools, and where the round started in that order.
struct Round {
    owed: Vec<Owed>,
    start: usize,
    pools: usize,
}

impl Agent {
    /// Sends every pool's pending report parts, one report per (pool, window), in as few calls as
    /// the batch bounds allow, and acknowledges what the allocator took. Parts that fail stay
    /// pending for the next round. An allocator without the batch route gets them one by one.
    pub async fn send_reports(&self) {
        let Some(allocator) = self.allocator.as_ref() else {
            return;
        };
        let round = self.reports_owed();
        for batch in batches(round.owed) {
            if self.report_batch_route.is_missing(self.clock.now_ms()) {
                self.send_one_by_one(allocator, &batch).await;
                self.advance_report_cursor(round.start, &batch);
                continue;
            }
            let call = ReportBatch {
                reports: batch.iter().map(|owed| owed.body.clone()).collect(),
            };
            let sent = allocator.report_batch(&call).await;
            self.note_allocator(&sent);
            match sent {
                Ok(results) => {
                    for (owed, result) in batch.iter().zip(results) {
                        match (result.receipt, result.problem) {
                            (Some(receipt), _) => self.reported(owed, receipt.returned_tokens),
                            (None, problem) => tracing::warn!(
                                tenant = %owed.body.tenant,
                                pool = %owed.body.pool,
                                problem = ?problem,
                                "report refused; kept for the next round"
                            ),
                        }
                    }
                }
                Err(ClientError::Refused {
                    status: 404 | 405, ..
                }) => {
                    tracing::info!(
                        "the allocator has no batch route for reports: one call per report"
                    );
                    self.report_batch_route.note_missing(self.clock.now_ms());
                    self.send_one_by_one(allocator, &batch).await;
                }
                Err(error) => {
                    tracing::warn!(%error, reports = batch.len(), "reports not taken; kept for the next round");
                    return;
                }
            }
            self.advance_report_cursor(round.start, &batch);
        }
        self.report_cursor
            .store(round.start + round.pools, Ordering::Relaxed);
    }

    /// The next round starts after the pools `batch` carried (of a round that started at
    /// `round_start`), should this round stop here.
    fn advance_report_cursor(&self, round_start: usize, batch: &[Owed]) {
        if let Some(last) = batch.last() {
            self.report_cursor
                .store(round_start + last.pools_visited, Ordering::Relaxed);
        }
    }

    /// What the busy pools owe, starting where the last round stopped: a round cut short by its
    /// deadline must not leave the same pools unreported every time. A pool found settled is
    /// unlisted (its gauges set a last time): idle pools cost a round nothing.
    fn reports_owed(&self) -> Round {
        let mut slots = self.pools.busy_slots();
        let pools = slots.len();
        if slots.is_empty() {
            return Round {
                owed: Vec::new(),
                start: 0,
                pools,
            };
        }
        let start = self.report_cursor.load(Ordering::Relaxed) % slots.len();
        slots.rotate_left(start);
        let mut owed = Vec::new();
        for (index, ((tenant, pool), slot)) in slots.into_iter().enumerate() {
            let parts = {
                let mut agent = slot.agent_quietly();
                let now_ms = self.clock.now_ms();
                let parts = if agent.owes_report(now_ms) {
                    agent.report(now_ms)
                } else {
                    Vec::new()
                };
                self.pools
                    .note_dropped_reports(agent.take_dropped_reports());
                if parts.is_empty() && agent.settled() {
                    crate::metrics::set_pool_gauges(&tenant, &pool, agent.holder());
                    slot.unlist(&agent, now_ms);
                }
                parts
            };
            for part in parts {
                let body = self.report_body(&tenant, &pool, &part);
                owed.push(Owed {
                    slot: slot.clone(),
                    part,
                    body,
                    pools_visited: index + 1,
                });
            }
        }
        metrics::counter!(crate::metrics::POOLS_VISITED, "round" => "reports")
            .increment(pools as u64);
        Round { owed, start, pools }
    }

    /// Reports to an allocator that takes them one at a time (`POST /v1/reports`).
    async fn send_one_by_one(&self, allocator: &AllocatorClient, batch: &[Owed]) {
        for owed in batch {
            let sent = allocator.report(&owed.body).await;
            self.note_allocator(&sent);
            match sent {
                Ok(receipt) => {
                    self.reported(owed, receipt.map_or(0, |r| r.returned_tokens));
                }
                Err(error) => {
                    tracing::warn!(%error, tenant = %owed.body.tenant, pool = %owed.body.pool, "report not taken; kept for the next round");
                }
            }
        }
    }

    /// The allocator took `owed`, and took back `returned_tokens` of what its final lines left.
    fn reported(&self, owed: &Owed, returned_tokens: u64) {
        owed.slot.agent().reported(&owed.part, self.clock.now_ms());
        metrics::counter!(crate::metrics::TOKENS_RETURNED).increment(returned_tokens);
        self.note_change();
    }

    /// The wire report of one pool's `part`, named by this agent and run (the ledger keeps each
    /// agent's figures apart and sums the region's), under a fresh report id.
    fn report_body(
        &self,
        tenant: &allot_shared::ids::TenantId,
        pool: &allot_shared::ids::PoolId,
        part: &PoolReport,
    ) -> Report {
        Report {
            report_id: LeaseId::from_parts(self.clock.now_ms(), rand::random()).to_string(),
            region: self.settings.region.clone(),
            tenant: tenant.clone(),
            pool: pool.clone(),
            window_start_ms: part.window_start_ms(),
            leases: part.lease_lines(),
            fallback_admitted_tokens: part.fallback_admitted_tokens(),
            shadow_admitted_tokens: part.shadow_admitted_tokens,
            settle_debt_tokens: part.settle_debt_tokens,
            written_off_tokens: part.written_off_tokens,
            agent_id: Some(self.settings.agent_id.clone()),
            incarnation: Some(self.incarnation()),
        }
    }

    /// Ends this run's session if it started and every fallback admit of every pool's current
    /// window and after is reported: the next run may then trust the ledger's count. Whether it
    /// ended.
    pub async fn end_session(self: &Arc<Self>) -> bool {
        if self.allocator.is_none() || !self.session_started() {
            return false;
        }
        let now_ms = self.clock.now_ms();
        let settled = self.pools.snapshot().iter().all(|(_, slot)| {
            let current_start_ms = slot.window_at(now_ms).start_ms;
            slot.agent_quietly()
                .holder()
                .fallback_settled_from(current_start_ms)
        });
        if !settled {
            tracing::warn!(
                "fallback admits are unreported at shutdown: the next run counts this window's \
                 allowance as used"
            );
            return false;
        }
        self.close_session().await
    }
}

/// `owed` in calls within the batch bounds: reports, lease lines and bytes (a report over a bound
/// alone goes in a call of its own, for the allocator to refuse by name).
fn batches(owed: Vec<Owed>) -> Vec<Vec<Owed>> {
    /// Room for the envelope and separators, bytes.
    const ENVELOPE_BYTES: usize = 64;
    let mut batches: Vec<Vec<Owed>> = Vec::new();
    let (mut lines, mut bytes) = (0usize, ENVELOPE_BYTES);
    for report in owed {
        let report_lines = report.body.leases.len();
        let report_bytes = serde_json::to_vec(&report.body).map_or(0, |json| json.len()) + 1;
        let fits = batches.last().is_some_and(|batch| {
            batch.len() < MAX_REPORTS_PER_BATCH
                && lines + report_lines <= MAX_LEASE_LINES_PER_BATCH
                && bytes + report_bytes <= MAX_REPORT_BATCH_BYTES
        });
        if !fits {
            batches.push(Vec::new());
            (lines, bytes) = (0, ENVELOPE_BYTES);
        }
        lines += report_lines;
        bytes += report_bytes;
        if let Some(batch) = batches.last_mut() {
            batch.push(report);
        }
    }
    batches
}
