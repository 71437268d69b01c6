//! Reports to the ledger: each pool's pending lines, its shadow rule's counts and its settle debt
//! and write-offs, one report per (pool, window).

use std::sync::atomic::Ordering;

use allot_shared::ids::LeaseId;

use super::{Agent, lock};
use crate::allocator_client::{Report, ReportLease};
use crate::global::driver::{self, ReportPart};

impl Agent {
    /// Sends every pool's pending report lines, one report per (pool, window), and acknowledges what
    /// the allocator took. Lines that fail stay pending for the next round.
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
            let now_ms = self.clock.now_ms();
            let (parts, debt_tokens) = {
                let mut holder = lock(&slot.holder);
                (
                    driver::start_report(&mut holder, now_ms),
                    holder.debt_tokens(),
                )
            };
            // Debt carried into a window is that window's too, settled there or not.
            lock(&slot.settle_debt).raise(slot.window_at(now_ms).start_ms, debt_tokens);
            let shadow = lock(&slot.shadow).unreported();
            let settle_debt = lock(&slot.settle_debt).unreported();
            let written_off = lock(&slot.written_off).unreported();
            if parts.is_empty()
                && shadow.is_empty()
                && settle_debt.is_empty()
                && written_off.is_empty()
            {
                continue;
            }
            let mut windows: Vec<u64> = parts
                .iter()
                .map(|p| p.window_start_ms)
                .chain(
                    [&shadow, &settle_debt, &written_off]
                        .into_iter()
                        .flatten()
                        .map(|(start_ms, _)| *start_ms),
                )
                .collect();
            windows.sort_unstable();
            windows.dedup();
            for window_start_ms in windows {
                let part = parts
                    .iter()
                    .find(|p| p.window_start_ms == window_start_ms)
                    .cloned()
                    .unwrap_or(ReportPart {
                        window_start_ms,
                        ..ReportPart::default()
                    });
                let body = Report {
                    report_id: LeaseId::from_parts(now_ms, rand::random()).to_string(),
                    region: self.settings.region.clone(),
                    tenant: tenant.clone(),
                    pool: pool.clone(),
                    window_start_ms,
                    leases: part
                        .lines
                        .leases
                        .iter()
                        .map(|l| ReportLease {
                            lease_id: l.lease_id,
                            spent_tokens: l.spent_tokens,
                            final_report: l.final_line,
                        })
                        .collect(),
                    fallback_admitted_tokens: part
                        .lines
                        .fallback
                        .first()
                        .map_or(0, |f| f.admitted_tokens),
                    shadow_admitted_tokens: in_window(&shadow, window_start_ms),
                    settle_debt_tokens: in_window(&settle_debt, window_start_ms),
                    written_off_tokens: in_window(&written_off, window_start_ms),
                    // The ledger keeps each agent's figures apart and sums the region's.
                    agent_id: Some(self.settings.agent_id.clone()),
                    incarnation: Some(self.incarnation()),
                };
                let sent = allocator.report(&body).await;
                self.note_allocator(&sent);
                match sent {
                    Ok(()) => {
                        let now_ms = self.clock.now_ms();
                        driver::finish_report(&mut lock(&slot.holder), &part, now_ms);
                        let current_start_ms = slot.window_at(now_ms).start_ms;
                        for (tally, tokens) in [
                            (&slot.shadow, body.shadow_admitted_tokens),
                            (&slot.settle_debt, body.settle_debt_tokens),
                            (&slot.written_off, body.written_off_tokens),
                        ] {
                            lock(tally).acknowledge(window_start_ms, tokens, current_start_ms);
                        }
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

/// A tally's amount in the window starting at `window_start_ms` (0: none).
fn in_window(tally: &[(u64, u64)], window_start_ms: u64) -> u64 {
    tally
        .iter()
        .find(|(start_ms, _)| *start_ms == window_start_ms)
        .map_or(0, |(_, tokens)| *tokens)
}
