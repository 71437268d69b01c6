//! What a holder owes the ledger and keeps for a restart: its report lines and their
//! acknowledgement, its journal snapshot and what a restart takes over from one, fallback claims
//! made durable, and the ledger's count of a window taken over at start.

use super::PoolHolder;
use super::types::{HolderSnapshot, PendingReport};

impl PoolHolder {
    /// The claim to make durable for the fallback window containing `now_ms` before a request of
    /// `cost_tokens` can be reserved there, as (window start, claimed tokens): what is used plus
    /// the cost plus one claim block, within the allowance. `None` when claims are off or the
    /// request fits what is claimed.
    pub fn fallback_claim_wanted(&self, cost_tokens: u64, now_ms: u64) -> Option<(u64, u64)> {
        let block = self.config.fallback_claim_block_tokens;
        if block == 0 {
            return None;
        }
        let window_start_ms = self.config.window.containing(now_ms).start_ms;
        let claim = self.fallback.claim_wanted(
            window_start_ms,
            cost_tokens,
            block,
            self.config.fallback_per_region_tokens,
        )?;
        Some((window_start_ms, claim))
    }

    /// Records that a claim of `claimed_tokens` for the window starting at `window_start_ms` is
    /// durable (written and synced): fallback may be reserved up to it.
    pub fn claim_durable(&mut self, window_start_ms: u64, claimed_tokens: u64) {
        self.fallback.claim_durable(
            window_start_ms,
            claimed_tokens.min(self.config.fallback_per_region_tokens),
        );
    }

    /// What a journal must keep of this holder. `claim` adds a claim being made durable with this
    /// snapshot: (window start, claimed tokens).
    pub fn snapshot(&self, claim: Option<(u64, u64)>) -> HolderSnapshot {
        HolderSnapshot {
            leases: self.leases.journal(),
            fallback: self.fallback.journal(claim),
            debt_tokens: self.debt_tokens,
        }
    }

    /// Takes over what a crashed incarnation journaled: its leases become ended ones owing a final
    /// report with the spend journaled (this process cannot know what was spent after the
    /// snapshot, so it spends none of them); each window's fallback count starts at what was used
    /// (admitted, or claimed without being journaled as admitted), and reports what was journaled
    /// as admitted.
    pub fn restore(&mut self, snapshot: &HolderSnapshot) {
        // What was owed is owed still (the new incarnation's debt cannot be smaller).
        self.debt_tokens = self.debt_tokens.max(snapshot.debt_tokens);
        self.leases.restore(&snapshot.leases);
        self.fallback.restore(&snapshot.fallback);
    }

    /// What to report since the last acknowledged report.
    pub fn pending_report(&mut self, now_ms: u64) -> PendingReport {
        self.expire(now_ms);
        PendingReport {
            leases: self.leases.pending_lines(),
            fallback: self.fallback.pending_lines(),
        }
    }

    /// Records that the allocator acknowledged `report`: final lines are done with; fallback windows
    /// that are over and fully reported are forgotten.
    pub fn acknowledge(&mut self, report: &PendingReport, now_ms: u64) {
        self.leases.acknowledge(&report.leases);
        let current = self.config.window.containing(now_ms).start_ms;
        self.fallback.acknowledge(&report.fallback, current);
    }

    /// Starts the fallback count of the window starting at `window_start_ms` at `admitted_tokens`
    /// (already reported): what this agent admitted in fallback in that window before this holder
    /// existed, as the ledger holds it. A restarted agent thus cannot admit the window's allowance
    /// a second time.
    pub fn seed_fallback(&mut self, window_start_ms: u64, admitted_tokens: u64) {
        if admitted_tokens == 0 {
            return;
        }
        self.fallback.seed(window_start_ms, admitted_tokens);
    }

    /// Counts the whole allowance of the window starting at `window_start_ms` as used: an earlier
    /// run of this agent may have admitted it in fallback without the ledger or this holder
    /// knowing. What is counted so beyond the admits is never reported (nobody knows it was
    /// admitted); it only keeps this run from admitting it again.
    pub fn presume_fallback_used(&mut self, window_start_ms: u64) {
        self.fallback
            .presume_used(window_start_ms, self.config.fallback_per_region_tokens);
    }

    /// Whether every fallback admit of windows starting at or after `window_start_ms` is reported
    /// and none is reserved or of unknown fate: what the ledger holds of them, with what the
    /// allocator already knows was presumed, is all there is.
    pub fn fallback_settled_from(&self, window_start_ms: u64) -> bool {
        self.fallback.settled_from(window_start_ms)
    }
}
