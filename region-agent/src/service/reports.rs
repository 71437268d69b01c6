//! Reports to the ledger: each pool's pending lines and its shadow rule's counts, one report per
//! (pool, window).

use std::sync::atomic::Ordering;

use allot_shared::ids::LeaseId;

use super::{Agent, lock};
use crate::allocator_client::{Report, ReportLease};
use crate::global::PendingReport;

impl Agent {
    /// Sends every pool's pending report lines, one report per (pool, window), and acknowledges what
    /// the allocator took. Lines that fail stay pending for the next round.
    pub async fn send_reports(&self) {
        let Some(allocator) = self.allocator.as_ref() else {
            return;
        };
        let mut slots = lock(&self.pools).snapshot();
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
            let now_ms = self.clock.now_ms();
            let pending = lock(&slot.holder).pending_report(now_ms);
            let shadow = lock(&slot.shadow).unreported();
            if pending.is_empty() && shadow.is_empty() {
                continue;
            }
            let mut windows: Vec<u64> = pending
                .leases
                .iter()
                .map(|l| l.window_start_ms)
                .chain(pending.fallback.iter().map(|f| f.window_start_ms))
                .chain(shadow.iter().map(|(start_ms, _)| *start_ms))
                .collect();
            windows.sort_unstable();
            windows.dedup();
            for window_start_ms in windows {
                let part = PendingReport {
                    leases: pending
                        .leases
                        .iter()
                        .filter(|l| l.window_start_ms == window_start_ms)
                        .copied()
                        .collect(),
                    fallback: pending
                        .fallback
                        .iter()
                        .filter(|f| f.window_start_ms == window_start_ms)
                        .copied()
                        .collect(),
                };
                let body = Report {
                    report_id: LeaseId::from_parts(now_ms, rand::random()).to_string(),
                    region: self.settings.region.clone(),
                    tenant: tenant.clone(),
                    pool: pool.clone(),
                    window_start_ms,
                    leases: part
                        .leases
                        .iter()
                        .map(|l| ReportLease {
                            lease_id: l.lease_id,
                            spent_tokens: l.spent_tokens,
                            final_report: l.final_line,
                        })
                        .collect(),
                    fallback_admitted_tokens: part
                        .fallback
                        .first()
                        .map_or(0, |f| f.admitted_tokens),
                    shadow_admitted_tokens: shadow
                        .iter()
                        .find(|(start_ms, _)| *start_ms == window_start_ms)
                        .map_or(0, |(_, tokens)| *tokens),
                };
                let sent = allocator.report(&body).await;
                self.note_allocator(&sent);
                match sent {
                    Ok(()) => {
                        let now_ms = self.clock.now_ms();
                        lock(&slot.holder).acknowledge(&part, now_ms);
                        let current_start_ms = slot.window_at(now_ms).start_ms;
                        lock(&slot.shadow).acknowledge(
                            window_start_ms,
                            body.shadow_admitted_tokens,
                            current_start_ms,
                        );
                        self.note_change();
                    }
                    Err(error) => {
                        tracing::warn!(%error, %tenant, %pool, "report not taken; kept for the next round");
                    }
                }
            }
        }
    }
}
