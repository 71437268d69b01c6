//! A holder's renewals: the one in flight (single flight per pool), the lease id to ask again
//! when an answer was lost, whether the allocator said the pool is exhausted, and what a waiting
//! request needs the next renewal to bring.

use allot_shared::ids::LeaseId;
use allot_shared::lease::GRANT_RECORD_MAX_LIFETIME_MS;
use allot_shared::window::WindowSpec;

/// How long past the end of its window the allocator keeps a grant's record at the least, ms:
/// a window, and never less than two of its ledger rounds and an election (over a minute,
/// `allot_allocator::grants::record_min_lifetime_ms`). A lost answer is recovered from it.
pub const GRANT_RECORD_KEPT_MIN_MS: u64 = 60_000;
/// What the agent's clock may be off the allocator's when it judges whether a grant's record is
/// still kept, ms (the most `--clock-margin-ms` allows).
pub const GRANT_RECORD_CLOCK_ALLOWANCE_MS: u64 = 10_000;

/// Until when a renewal asked with `lease` (made on this agent's clock) can still be asked again
/// for its lost answer: while the allocator surely keeps the record of any grant it committed
/// for it. A grant is committed after the id was made, so in its window or a later one, and its
/// record is kept a window, and at least [`GRANT_RECORD_KEPT_MIN_MS`], past that window's end; in
/// windows longer than [`GRANT_RECORD_MAX_LIFETIME_MS`], that long after its commit (the
/// allocator refuses older ids there).
pub fn lost_answer_recoverable_until_ms(window: &WindowSpec, lease: LeaseId) -> u64 {
    let made_in = window.containing(lease.unix_ms());
    let by_window_ms = made_in
        .end_ms
        .saturating_add(made_in.length_ms().max(GRANT_RECORD_KEPT_MIN_MS));
    let kept_until_ms = if window.longest_ms() > GRANT_RECORD_MAX_LIFETIME_MS {
        by_window_ms.min(lease.unix_ms().saturating_add(GRANT_RECORD_MAX_LIFETIME_MS))
    } else {
        by_window_ms
    };
    kept_until_ms.saturating_sub(GRANT_RECORD_CLOCK_ALLOWANCE_MS)
}

/// The renewal state of a holder.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Hash)]
pub(super) struct Renewal {
    pub(super) in_flight: bool,
    /// When the renewal in flight was asked, epoch ms (meaningful only while in flight).
    pub(super) started_at_ms: u64,
    /// The lease id of a renewal whose answer never arrived: the allocator may have granted it,
    /// so the next renewal asks with the same id and gets that grant back instead of stranding it.
    pub(super) unanswered_lease: Option<LeaseId>,
    /// Until when the allocator said the pool is exhausted, epoch ms (0: it did not).
    pub(super) exhausted_until_ms: u64,
    /// The largest request cost that found too little held since the last grant: the next
    /// renewal asks for at least this (within the chunk), so a request above the usual lease size
    /// is satisfiable instead of waiting for ever.
    pub(super) wanted_for_request_tokens: u64,
}

impl Renewal {
    /// Whether the renewal in flight has gone unanswered `patience_ms` or longer at `now_ms`
    /// (0: never).
    pub(super) fn silent(&self, now_ms: u64, patience_ms: u64) -> bool {
        self.in_flight
            && patience_ms > 0
            && now_ms.saturating_sub(self.started_at_ms) >= patience_ms
    }

    /// Whether the allocator said the pool is exhausted until after `now_ms`.
    pub(super) fn exhausted_at(&self, now_ms: u64) -> bool {
        self.exhausted_until_ms > now_ms
    }

    /// The next renewal must bring at least `tokens` (within the chunk).
    pub(super) fn want_at_least(&mut self, tokens: u64) {
        self.wanted_for_request_tokens = self.wanted_for_request_tokens.max(tokens);
    }
}
