//! Per-window amounts a pool reports to the ledger beside its leases: what a shadow global rule
//! counted, the most settle debt its holder carried, and what was written off. The ledger keeps
//! the largest figure reported of each (per agent and window), so each is cumulative within its
//! window, and kept until the ledger has taken it. Pure.

use serde::{Deserialize, Serialize};

/// One window of a per-window amount the ledger keeps the largest report of, and how much of it
/// the ledger has taken, tokens: journaled so that a restarted agent goes on counting from it
/// rather than from zero (which the ledger, keeping the larger report, would never see).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct TallyWindow {
    /// The window's start, epoch ms.
    pub start_ms: u64,
    /// The amount counted (cumulative, or a peak).
    pub counted_tokens: u64,
    /// The most the ledger has acknowledged.
    pub reported_tokens: u64,
}

/// Most windows a per-window tally keeps unreported: the current one and those the allocator has
/// not taken yet (I10). Past it, the oldest window's count is dropped (and logged).
pub const MAX_TALLY_WINDOWS: usize = 4;

/// An amount per window that the ledger keeps the largest report of (a shadow rule's count, the
/// most settle debt carried, tokens written off), and how much of it the ledger has taken.
#[derive(Debug, Default, Clone, PartialEq, Eq, Hash)]
pub struct WindowTally {
    windows: Vec<TallyWindow>,
}

impl WindowTally {
    /// Its windows, for the journal.
    pub fn snapshot(&self) -> Vec<TallyWindow> {
        self.windows.clone()
    }

    /// Takes over what a crashed incarnation journaled: per window, the larger of its count and
    /// this one's (both count the same window's admissions from its start), at most
    /// [`MAX_TALLY_WINDOWS`] windows.
    pub fn restore(&mut self, journaled: &[TallyWindow]) {
        for saved in journaled.iter().take(MAX_TALLY_WINDOWS) {
            let window = self.window(saved.start_ms);
            window.counted_tokens = window.counted_tokens.max(saved.counted_tokens);
            window.reported_tokens = window.reported_tokens.max(saved.reported_tokens);
        }
    }

    /// Counts `tokens` more in the window starting at `start_ms`.
    pub fn count(&mut self, start_ms: u64, tokens: u64) {
        let window = self.window(start_ms);
        window.counted_tokens = window.counted_tokens.saturating_add(tokens);
    }

    /// Raises the window's amount to at least `tokens` (a peak).
    pub fn raise(&mut self, start_ms: u64, tokens: u64) {
        if tokens > 0 {
            let window = self.window(start_ms);
            window.counted_tokens = window.counted_tokens.max(tokens);
        }
    }

    fn window(&mut self, start_ms: u64) -> &mut TallyWindow {
        if let Some(index) = self.windows.iter().position(|w| w.start_ms == start_ms) {
            return &mut self.windows[index];
        }
        if self.windows.len() >= MAX_TALLY_WINDOWS {
            self.windows.sort_by_key(|w| w.start_ms);
            let dropped = self.windows.remove(0);
            tracing::warn!(
                window_start_ms = dropped.start_ms,
                "a pool's per-window count was dropped: the allocator took no report for it"
            );
        }
        self.windows.push(TallyWindow {
            start_ms,
            counted_tokens: 0,
            reported_tokens: 0,
        });
        let last = self.windows.len() - 1;
        &mut self.windows[last]
    }

    /// (window start, cumulative count) of every window with counts the ledger has not taken.
    pub fn unreported(&self) -> Vec<(u64, u64)> {
        self.windows
            .iter()
            .filter(|w| w.counted_tokens > w.reported_tokens)
            .map(|w| (w.start_ms, w.counted_tokens))
            .collect()
    }

    /// The ledger took `tokens` (cumulative) for the window at `start_ms`. Windows fully reported
    /// and older than `now_window_start_ms` are forgotten.
    pub fn acknowledge(&mut self, start_ms: u64, tokens: u64, now_window_start_ms: u64) {
        if let Some(window) = self.windows.iter_mut().find(|w| w.start_ms == start_ms) {
            window.reported_tokens = window.reported_tokens.max(tokens);
        }
        self.windows
            .retain(|w| w.start_ms >= now_window_start_ms || w.counted_tokens > w.reported_tokens);
    }

    /// Whether the slot may be forgotten: the ledger has been told everything, and nothing was
    /// counted in the window that starts at `current_start_ms` (a fresh tally would count that
    /// window again from zero, and the ledger keeps the larger count).
    pub fn may_forget(&self, current_start_ms: u64) -> bool {
        self.windows
            .iter()
            .all(|w| w.counted_tokens <= w.reported_tokens && w.start_ms < current_start_ms)
    }
}

/// A pool's three tallies.
#[derive(Debug, Default, Clone, PartialEq, Eq, Hash)]
pub struct Tallies {
    /// What a shadow global rule of the pool counted.
    pub shadow: WindowTally,
    /// The most debt from settled metered requests the holder carried.
    pub settle_debt: WindowTally,
    /// Extra cost of settled metered requests written off.
    pub written_off: WindowTally,
}

impl Tallies {
    /// Whether all three may be forgotten (see [`WindowTally::may_forget`]).
    pub fn may_forget(&self, current_start_ms: u64) -> bool {
        self.shadow.may_forget(current_start_ms)
            && self.settle_debt.may_forget(current_start_ms)
            && self.written_off.may_forget(current_start_ms)
    }
}
