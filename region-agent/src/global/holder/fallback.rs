//! What a holder admits while the allocator is unreachable: per window, the fallback allowance
//! used (admitted, reserved, of unknown fate after a restart, or presumed used after an unclean
//! one), what was reported of it, and, with a state directory, what is durably claimed.

use std::collections::BTreeMap;

use allot_shared::window::Window;

use super::types::{FallbackLine, JournaledFallback, MAX_FALLBACK_WINDOWS};

#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
struct FallbackCount {
    admitted_tokens: u64,
    reserved_tokens: u64,
    reported_tokens: u64,
    /// Allowance an earlier incarnation of this agent may have admitted without the journal
    /// showing it (it claimed it durably): counted as used, never reported.
    unknown_tokens: u64,
    /// Allowance counted as used because an earlier run of the agent ended uncleanly and left no
    /// journal (the allocator keeps that fact for every later run: this run owes no report of it).
    presumed_tokens: u64,
    /// Durably claimed for this window (with claims on): admits + reservations + unknown stay
    /// within it.
    claimed_tokens: u64,
}

impl FallbackCount {
    /// Allowance taken: admitted, reserved, or possibly admitted before a restart.
    fn used_tokens(&self) -> u64 {
        self.admitted_tokens + self.reserved_tokens + self.unknown_tokens + self.presumed_tokens
    }
}

/// Why fallback cannot be reserved now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(super) enum NoFallback {
    /// The window's allowance is used up.
    Spent,
    /// The allowance has room, but beyond what is durably claimed.
    Unclaimed,
}

/// The fallback counts of the windows that still matter, by window start.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub(super) struct FallbackBook {
    windows: BTreeMap<u64, FallbackCount>,
}

impl FallbackBook {
    /// Reserves `cost_tokens` of the window starting at `window_start_ms`, within `allowance`
    /// and, with `claims` on, within what is claimed. Past [`MAX_FALLBACK_WINDOWS`], the oldest
    /// window without reservations is forgotten: whether one was (a report line dropped).
    pub(super) fn reserve(
        &mut self,
        window_start_ms: u64,
        cost_tokens: u64,
        allowance: u64,
        claims: bool,
    ) -> Result<bool, NoFallback> {
        let count = self.windows.entry(window_start_ms).or_default();
        if count.used_tokens() + cost_tokens > allowance {
            return Err(NoFallback::Spent);
        }
        if claims && count.used_tokens() + cost_tokens > count.claimed_tokens {
            return Err(NoFallback::Unclaimed);
        }
        count.reserved_tokens += cost_tokens;
        debug_assert!(count.used_tokens() <= allowance);
        debug_assert!(!claims || count.used_tokens() <= count.claimed_tokens);
        if self.windows.len() > MAX_FALLBACK_WINDOWS
            && let Some((&oldest, _)) = self.windows.iter().find(|(_, c)| c.reserved_tokens == 0)
        {
            self.windows.remove(&oldest);
            return Ok(true);
        }
        Ok(false)
    }

    /// `tokens` reserved in the window are admitted (a commit, or a gateway's draw).
    pub(super) fn admit(&mut self, window_start_ms: u64, tokens: u64) -> u64 {
        let count = self.windows.entry(window_start_ms).or_default();
        count.reserved_tokens = count.reserved_tokens.saturating_sub(tokens);
        count.admitted_tokens += tokens;
        count.admitted_tokens
    }

    /// The window's fallback used so far (admitted, reserved, unknown or presumed).
    pub(super) fn used(&self, window_start_ms: u64) -> u64 {
        self.windows
            .get(&window_start_ms)
            .map_or(0, FallbackCount::used_tokens)
    }

    /// `tokens` reserved in the window go back to its allowance (the request was denied).
    pub(super) fn release(&mut self, window_start_ms: u64, tokens: u64) {
        if let Some(count) = self.windows.get_mut(&window_start_ms) {
            count.reserved_tokens = count.reserved_tokens.saturating_sub(tokens);
        }
    }

    /// `tokens` reserved in the window for a sub-lease that ended stay used, never reported as
    /// admitted (its gateway may have admitted them unreported).
    pub(super) fn withhold(&mut self, window_start_ms: u64, tokens: u64) {
        let count = self.windows.entry(window_start_ms).or_default();
        count.reserved_tokens = count.reserved_tokens.saturating_sub(tokens);
        count.unknown_tokens += tokens;
    }

    /// The claim to make durable in the window before `cost_tokens` more can be reserved there,
    /// as the tokens to claim in all: what is used plus the cost plus one `block`, within the
    /// `allowance`. `None` when the request fits what is claimed.
    pub(super) fn claim_wanted(
        &self,
        window_start_ms: u64,
        cost_tokens: u64,
        block: u64,
        allowance: u64,
    ) -> Option<u64> {
        let count = self
            .windows
            .get(&window_start_ms)
            .copied()
            .unwrap_or_default();
        let needed = count.used_tokens() + cost_tokens.max(1);
        (needed > count.claimed_tokens).then(|| {
            needed
                .saturating_add(block)
                .min(allowance)
                .max(count.claimed_tokens)
        })
    }

    /// A claim of `claimed_tokens` in the window is durable.
    pub(super) fn claim_durable(&mut self, window_start_ms: u64, claimed_tokens: u64) {
        let count = self.windows.entry(window_start_ms).or_default();
        count.claimed_tokens = count.claimed_tokens.max(claimed_tokens);
    }

    /// Starts the window's count at `admitted_tokens`, already reported (the ledger's count).
    pub(super) fn seed(&mut self, window_start_ms: u64, admitted_tokens: u64) {
        let count = self.windows.entry(window_start_ms).or_default();
        let used = count.admitted_tokens + count.unknown_tokens;
        count.admitted_tokens = count.admitted_tokens.max(admitted_tokens);
        count.reported_tokens = count.reported_tokens.max(admitted_tokens);
        count.unknown_tokens = used.saturating_sub(count.admitted_tokens);
    }

    /// Counts the window's whole `allowance` as used.
    pub(super) fn presume_used(&mut self, window_start_ms: u64, allowance: u64) {
        let count = self.windows.entry(window_start_ms).or_default();
        let used = count.used_tokens();
        count.presumed_tokens += allowance.saturating_sub(used);
        debug_assert!(count.used_tokens() >= allowance, "the allowance is used up");
    }

    /// Whether every admit of the windows from `window_start_ms` on is reported, and none is
    /// reserved or of unknown fate.
    pub(super) fn settled_from(&self, window_start_ms: u64) -> bool {
        self.windows.range(window_start_ms..).all(|(_, count)| {
            count.admitted_tokens == count.reported_tokens
                && count.reserved_tokens == 0
                && count.unknown_tokens == 0
        })
    }

    /// Whether forgetting the book loses nothing at `current_start_ms`: every window over and
    /// fully reported.
    pub(super) fn idle(&self, current_start_ms: u64) -> bool {
        self.windows
            .iter()
            .all(|(&start, c)| start < current_start_ms && c.admitted_tokens == c.reported_tokens)
    }

    /// The windows whose admits changed since the ledger took them.
    pub(super) fn pending_lines(&self) -> Vec<FallbackLine> {
        self.windows
            .iter()
            .filter(|(_, c)| c.admitted_tokens != c.reported_tokens)
            .map(|(&window_start_ms, c)| FallbackLine {
                window_start_ms,
                admitted_tokens: c.admitted_tokens,
            })
            .collect()
    }

    /// The ledger took `lines`; windows over (before `current_start_ms`), fully reported and
    /// without reservations are forgotten.
    pub(super) fn acknowledge(&mut self, lines: &[FallbackLine], current_start_ms: u64) {
        for line in lines {
            if let Some(count) = self.windows.get_mut(&line.window_start_ms) {
                count.reported_tokens = count.reported_tokens.max(line.admitted_tokens);
            }
        }
        self.windows.retain(|&start, c| {
            start >= current_start_ms
                || c.admitted_tokens != c.reported_tokens
                || c.reserved_tokens > 0
        });
    }

    /// Every window as a journal keeps it; with `claim`, (window start, tokens) claimed with it.
    pub(super) fn journal(&self, claim: Option<(u64, u64)>) -> Vec<JournaledFallback> {
        let mut lines: Vec<JournaledFallback> = self
            .windows
            .iter()
            .map(|(&window_start_ms, count)| JournaledFallback {
                window_start_ms,
                admitted_tokens: count.admitted_tokens,
                used_tokens: count.admitted_tokens + count.unknown_tokens,
                claimed_tokens: count.claimed_tokens,
                presumed_tokens: count.presumed_tokens,
            })
            .collect();
        if let Some((window_start_ms, claimed_tokens)) = claim {
            match lines
                .iter_mut()
                .find(|f| f.window_start_ms == window_start_ms)
            {
                Some(line) => line.claimed_tokens = line.claimed_tokens.max(claimed_tokens),
                None => lines.push(JournaledFallback {
                    window_start_ms,
                    admitted_tokens: 0,
                    used_tokens: 0,
                    claimed_tokens,
                    presumed_tokens: 0,
                }),
            }
        }
        lines
    }

    /// Takes over what a crashed incarnation journaled: each window's count starts at what was
    /// used (admitted, or claimed without being journaled as admitted), and reports what was
    /// journaled as admitted. The newest [`MAX_FALLBACK_WINDOWS`] windows, so the current one is
    /// never the one left out.
    pub(super) fn restore(&mut self, journaled: &[JournaledFallback]) {
        let mut windows: Vec<&JournaledFallback> = journaled.iter().collect();
        windows.sort_by_key(|line| std::cmp::Reverse(line.window_start_ms));
        for line in windows.into_iter().take(MAX_FALLBACK_WINDOWS) {
            let count = self.windows.entry(line.window_start_ms).or_default();
            count.admitted_tokens = count.admitted_tokens.max(line.admitted_tokens);
            // Whatever was claimed may have been admitted after the last journal.
            let used = line
                .used_tokens
                .max(line.claimed_tokens)
                .max(line.admitted_tokens);
            count.unknown_tokens = used.saturating_sub(count.admitted_tokens);
            count.claimed_tokens = count.claimed_tokens.max(line.claimed_tokens);
            count.presumed_tokens = count.presumed_tokens.max(line.presumed_tokens);
        }
    }
}

/// When, on the agent's clock, fallback may be reserved in `window`: the window less
/// `clock_margin_ms` at its start, and less the clock margin and `expiry_margin_ms` at its end
/// (see `PoolHolder::fallback_span`).
pub(super) fn span(
    window: Window,
    clock_margin_ms: u64,
    expiry_margin_ms: u64,
) -> std::ops::Range<u64> {
    let start = window.start_ms.saturating_add(clock_margin_ms);
    let end = window
        .end_ms
        .saturating_sub(clock_margin_ms.saturating_add(expiry_margin_ms));
    start..end.max(start)
}
