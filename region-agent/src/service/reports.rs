//! Reports to the ledger: what each pool's agent owes (its leases' spend, its fallback admits,
//! its shadow counts, settle debt and write-offs), one report per (pool, window), named by this
//! agent and run.

use std::sync::Arc;
use std::sync::atomic::Ordering;

use allot_shared::ids::LeaseId;

use super::Agent;
use crate::allocator_client::Report;
use crate::global::PoolReport;

impl Agent {
    /// Sends every pool's pending report parts, one report per (pool, window), and acknowledges
    /// what the allocator took. Parts that fail stay pending for the next round.
    pub async fn send_reports(&self) {
        let Some(allocator) = self.allocator.as_ref() else {
            return;
        };
        let mut slots = self.pools.snapshot();
        if slots.is_empty() {
            return;
        }
        // Start where the last round stopped: a round cut short by its deadline must not leave
        // the same pools unreported every time.
        slots.sort_by(|a, b| a.0.cmp(&b.0));
        let start = self.report_cursor.load(Ordering::Relaxed) % slots.len();
        slots.rotate_left(start);
        for ((tenant, pool), slot) in slots {
            self.report_cursor.fetch_add(1, Ordering::Relaxed);
            let parts = {
                let mut agent = slot.agent();
                let now_ms = self.clock.now_ms();
                if !agent.owes_report(now_ms) {
                    continue;
                }
                agent.report(now_ms)
            };
            for part in parts {
                let body = self.report_body(&tenant, &pool, &part);
                let sent = allocator.report(&body).await;
                self.note_allocator(&sent);
                match sent {
                    Ok(()) => {
                        slot.agent().reported(&part, self.clock.now_ms());
                        self.note_change();
                    }
                    Err(error) => {
                        tracing::warn!(%error, %tenant, %pool, "report not taken; kept for the next round");
                    }
                }
            }
        }
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
            slot.agent()
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
