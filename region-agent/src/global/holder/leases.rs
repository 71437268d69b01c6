//! The leases a holder holds: live ones, spent first-ending first, and ended ones that owe the
//! ledger their final line. Tokens of a lease are spent, reserved for a request being decided,
//! withheld (a gateway's sub-lease that ended unspent), or remaining; never more than granted.

use allot_shared::ids::{Epoch, LeaseId};
use allot_shared::window::Window;

use super::types::{JournaledLease, LeaseGrant, LeaseLine, MAX_LIVE_LEASES, MAX_UNREPORTED_LEASES};

/// A lease this agent holds.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct HeldLease {
    /// The grant.
    pub grant: LeaseGrant,
    /// Tokens spent from it.
    pub spent_tokens: u64,
    /// Tokens reserved for requests being decided (neither spendable nor spent).
    pub reserved_tokens: u64,
    /// Tokens of sub-leases that ended unspent ([`PoolHolder::withhold`]): a gateway may have
    /// admitted them unreported, so they are never spendable again (stranded).
    ///
    /// [`PoolHolder::withhold`]: super::PoolHolder::withhold
    pub withheld_tokens: u64,
    reported_spent_tokens: u64,
}

impl HeldLease {
    /// A lease just granted: nothing spent, reserved, withheld or reported.
    pub(super) fn granted(grant: LeaseGrant) -> Self {
        Self {
            grant,
            spent_tokens: 0,
            reserved_tokens: 0,
            withheld_tokens: 0,
            reported_spent_tokens: 0,
        }
    }

    pub(super) fn remaining_tokens(&self) -> u64 {
        self.grant.granted_tokens - self.spent_tokens - self.reserved_tokens - self.withheld_tokens
    }

    /// The last instant (exclusive) at which a token may be spent.
    pub(super) fn usable_until_ms(&self, margin_ms: u64) -> u64 {
        self.grant.expires_at_ms.saturating_sub(margin_ms)
    }

    fn line(&self, final_line: bool) -> LeaseLine {
        // A final line is sent once nothing is reserved: what remains then is never spent.
        debug_assert!(!final_line || self.reserved_tokens == 0);
        let unspent_tokens = if final_line && self.grant.returnable {
            self.remaining_tokens()
        } else {
            0
        };
        LeaseLine {
            lease_id: self.grant.lease_id,
            window_start_ms: self.grant.window.start_ms,
            spent_tokens: self.spent_tokens,
            final_line,
            unspent_tokens,
        }
    }
}

/// What moving leases to the ended list cost: tokens stranded, report lines dropped.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub(super) struct Losses {
    /// Tokens unspent at a lease's end (or reserved on an ended lease and given back).
    pub(super) stranded_tokens: u64,
    /// Report lines dropped past the bounds.
    pub(super) dropped_reports: u64,
}

/// The live leases, sorted by end, and the ended ones owed a final report; with the highest
/// allocator epoch seen.
#[derive(Debug, Clone, Default, PartialEq, Eq, Hash)]
pub(super) struct Leases {
    live: Vec<HeldLease>,
    ended: Vec<HeldLease>,
    highest_epoch: Epoch,
}

impl Leases {
    /// The highest allocator epoch seen.
    pub(super) fn highest_epoch(&self) -> Epoch {
        self.highest_epoch
    }

    /// Notes a grant's epoch: whether it is the highest seen (a lower one is from a deposed
    /// allocator).
    pub(super) fn note_epoch(&mut self, epoch: Epoch) -> bool {
        if epoch < self.highest_epoch {
            return false;
        }
        self.highest_epoch = epoch;
        true
    }

    /// Whether a lease of this id is held, live or ended.
    pub(super) fn holds(&self, lease_id: LeaseId) -> bool {
        self.live
            .iter()
            .chain(&self.ended)
            .any(|l| l.grant.lease_id == lease_id)
    }

    /// Whether no lease is held, live or ended.
    pub(super) fn is_empty(&self) -> bool {
        self.live.is_empty() && self.ended.is_empty()
    }

    /// Whether no lease is live.
    pub(super) fn none_live(&self) -> bool {
        self.live.is_empty()
    }

    /// Moves leases past their usable end (`margin` before it) to the ended list; their unspent
    /// tokens are stranded. Past [`MAX_UNREPORTED_LEASES`] ended leases, the oldest without
    /// reservations are dropped.
    pub(super) fn expire(&mut self, now_ms: u64, margin_ms: u64) -> Losses {
        // `live` is sorted by end (see `hold`): the ended leases are a prefix, and the common
        // case (none ended) allocates nothing.
        debug_assert!(
            self.live
                .windows(2)
                .all(|w| w[0].grant.expires_at_ms <= w[1].grant.expires_at_ms)
        );
        let mut losses = Losses::default();
        let ended = self
            .live
            .partition_point(|l| now_ms >= l.usable_until_ms(margin_ms));
        for lease in self.live.drain(..ended) {
            losses.stranded_tokens += lease.remaining_tokens();
            self.ended.push(lease);
        }
        if self.ended.len() > MAX_UNREPORTED_LEASES {
            let excess = self.ended.len() - MAX_UNREPORTED_LEASES;
            let before = self.ended.len();
            // The oldest go first; a lease with tokens still reserved stays until they settle.
            let mut dropped = 0;
            self.ended.retain(|lease| {
                let drop = dropped < excess && lease.reserved_tokens == 0;
                dropped += usize::from(drop);
                !drop
            });
            losses.dropped_reports += (before - self.ended.len()) as u64;
        }
        losses
    }

    /// Holds a lease that arrived past its usable end: never spent, but owed a final line like
    /// any ended lease. Its tokens are stranded.
    pub(super) fn hold_ended(&mut self, lease: HeldLease) -> u64 {
        let stranded = lease.grant.granted_tokens;
        self.ended.push(lease);
        stranded
    }

    /// Holds a live lease, at most [`MAX_LIVE_LEASES`]: past it the oldest ends early. What that
    /// strands.
    pub(super) fn hold(&mut self, lease: HeldLease) -> u64 {
        let mut stranded = 0;
        if self.live.len() >= MAX_LIVE_LEASES {
            let oldest = self.live.remove(0);
            stranded += oldest.remaining_tokens();
            self.ended.push(oldest);
        }
        self.live.push(lease);
        // Spend the lease that ends first first.
        self.live.sort_by_key(|l| l.grant.expires_at_ms);
        stranded
    }

    /// Spends up to `tokens` from live leases, first-ending first, at once. Returns how many.
    pub(super) fn spend(&mut self, tokens: u64, now_ms: u64, margin_ms: u64) -> u64 {
        let mut left = tokens;
        for lease in &mut self.live {
            if left == 0 {
                break;
            }
            if now_ms >= lease.usable_until_ms(margin_ms) {
                continue;
            }
            let take = left.min(lease.remaining_tokens());
            lease.spent_tokens += take;
            debug_assert!(
                lease.spent_tokens + lease.reserved_tokens + lease.withheld_tokens
                    <= lease.grant.granted_tokens
            );
            left -= take;
        }
        tokens - left
    }

    /// Reserves `cost_tokens` across live leases, first-ending first, when they hold that much:
    /// the parts, as (lease, tokens), and how many there are. After `expire`, every live lease
    /// is usable now.
    pub(super) fn reserve(
        &mut self,
        cost_tokens: u64,
        now_ms: u64,
        margin_ms: u64,
    ) -> Option<([(LeaseId, u64); MAX_LIVE_LEASES], usize)> {
        let held: u64 = self.live.iter().map(HeldLease::remaining_tokens).sum();
        if held < cost_tokens {
            return None;
        }
        // Unused places repeat the first lease with 0 tokens; `len` says how many are parts.
        let first = self.live.first()?.grant.lease_id;
        let mut parts = [(first, 0); MAX_LIVE_LEASES];
        let mut len = 0;
        let mut left = cost_tokens;
        for lease in &mut self.live {
            let take = left.min(lease.remaining_tokens());
            if take == 0 {
                continue;
            }
            debug_assert!(
                now_ms < lease.usable_until_ms(margin_ms),
                "no reservation at or after a lease's end"
            );
            lease.reserved_tokens += take;
            debug_assert!(lease.spent_tokens + lease.reserved_tokens <= lease.grant.granted_tokens);
            parts[len] = (lease.grant.lease_id, take);
            len += 1;
            left -= take;
            if left == 0 {
                break;
            }
        }
        debug_assert_eq!(left, 0);
        Some((parts, len))
    }

    fn find_mut(&mut self, lease_id: LeaseId) -> Option<&mut HeldLease> {
        self.live
            .iter_mut()
            .chain(self.ended.iter_mut())
            .find(|l| l.grant.lease_id == lease_id)
    }

    /// Spends `tokens` a reservation holds of lease `lease_id` (the request was admitted, or a
    /// gateway reported them). `false` when the lease is gone (only past the ended leases' bound,
    /// which keeps those with reservations: the caller counts it).
    pub(super) fn spend_reserved(&mut self, lease_id: LeaseId, tokens: u64) -> bool {
        let Some(lease) = self.find_mut(lease_id) else {
            return false;
        };
        debug_assert!(lease.reserved_tokens >= tokens);
        lease.reserved_tokens -= tokens;
        lease.spent_tokens += tokens;
        debug_assert!(
            lease.spent_tokens + lease.reserved_tokens + lease.withheld_tokens
                <= lease.grant.granted_tokens
        );
        true
    }

    /// Gives back `tokens` a reservation holds of lease `lease_id`: to the lease while it lives;
    /// an ended lease strands them. What is stranded.
    pub(super) fn release(&mut self, lease_id: LeaseId, tokens: u64) -> u64 {
        if let Some(lease) = self.live.iter_mut().find(|l| l.grant.lease_id == lease_id) {
            debug_assert!(lease.reserved_tokens >= tokens);
            lease.reserved_tokens -= tokens;
            0
        } else if let Some(lease) = self.ended.iter_mut().find(|l| l.grant.lease_id == lease_id) {
            debug_assert!(lease.reserved_tokens >= tokens);
            lease.reserved_tokens -= tokens;
            tokens
        } else {
            0
        }
    }

    /// Withholds `tokens` a sub-lease's reservation holds of lease `lease_id`: never spendable
    /// again (the caller counts them stranded, the lease found or not).
    pub(super) fn withhold(&mut self, lease_id: LeaseId, tokens: u64) {
        if let Some(lease) = self.find_mut(lease_id) {
            debug_assert!(lease.reserved_tokens >= tokens);
            lease.reserved_tokens -= tokens;
            lease.withheld_tokens += tokens;
        }
    }

    /// The instant (exclusive) by which tokens of the leases `parts` names must be spent: the
    /// first-ending one's usable end (0: none is held).
    pub(super) fn usable_until_ms(&self, parts: &[(LeaseId, u64)], margin_ms: u64) -> u64 {
        parts
            .iter()
            .filter(|(_, tokens)| *tokens > 0)
            .filter_map(|(lease_id, _)| {
                self.live
                    .iter()
                    .chain(&self.ended)
                    .find(|l| l.grant.lease_id == *lease_id)
            })
            .map(|lease| lease.usable_until_ms(margin_ms))
            .min()
            .unwrap_or(0)
    }

    /// Tokens spendable now from live leases.
    pub(super) fn available(&self, now_ms: u64, margin_ms: u64) -> u64 {
        self.live
            .iter()
            .filter(|l| now_ms < l.usable_until_ms(margin_ms))
            .map(HeldLease::remaining_tokens)
            .sum()
    }

    /// When the first live lease ends (its usable end), epoch ms.
    pub(super) fn next_end_ms(&self, margin_ms: u64) -> Option<u64> {
        self.live
            .first()
            .map(|lease| lease.usable_until_ms(margin_ms))
    }

    /// The window start of a lease held, live or ended.
    pub(super) fn window_start_ms(&self, lease_id: LeaseId) -> Option<u64> {
        self.live
            .iter()
            .chain(&self.ended)
            .find(|l| l.grant.lease_id == lease_id)
            .map(|l| l.grant.window.start_ms)
    }

    /// The lines owed the ledger: live leases whose spend changed, and ended leases' final lines
    /// (an ended lease's final line waits until its reservations settle, as a commit still adds
    /// to what it spent; meanwhile it reports as a live one does).
    pub(super) fn pending_lines(&self) -> Vec<LeaseLine> {
        let mut lines: Vec<LeaseLine> = self
            .live
            .iter()
            .filter(|l| l.spent_tokens != l.reported_spent_tokens)
            .map(|l| l.line(false))
            .collect();
        lines.extend(self.ended.iter().filter_map(|l| {
            if l.reserved_tokens == 0 {
                Some(l.line(true))
            } else {
                (l.spent_tokens != l.reported_spent_tokens).then(|| l.line(false))
            }
        }));
        lines
    }

    /// The ledger took `lines`: final lines are done with, the others' spend is reported.
    pub(super) fn acknowledge(&mut self, lines: &[LeaseLine]) {
        for line in lines {
            if line.final_line {
                self.ended.retain(|l| l.grant.lease_id != line.lease_id);
            } else if let Some(lease) = self.find_mut(line.lease_id) {
                lease.reported_spent_tokens = lease.reported_spent_tokens.max(line.spent_tokens);
            }
        }
    }

    /// Every lease as a journal keeps it.
    pub(super) fn journal(&self) -> Vec<JournaledLease> {
        self.live
            .iter()
            .chain(&self.ended)
            .map(|lease| JournaledLease {
                lease_id: lease.grant.lease_id,
                epoch: lease.grant.epoch,
                window_start_ms: lease.grant.window.start_ms,
                window_end_ms: lease.grant.window.end_ms,
                granted_tokens: lease.grant.granted_tokens,
                spent_tokens: lease.spent_tokens,
            })
            .collect()
    }

    /// Takes over the leases a crashed incarnation journaled, as ended ones owing a final report
    /// with the spend journaled (at most [`MAX_UNREPORTED_LEASES`]).
    pub(super) fn restore(&mut self, journaled: &[JournaledLease]) {
        for lease in journaled {
            if self.holds(lease.lease_id) || self.ended.len() >= MAX_UNREPORTED_LEASES {
                continue;
            }
            let spent_tokens = lease.spent_tokens.min(lease.granted_tokens);
            self.highest_epoch = self.highest_epoch.max(lease.epoch);
            self.ended.push(HeldLease {
                spent_tokens,
                ..HeldLease::granted(LeaseGrant {
                    lease_id: lease.lease_id,
                    epoch: lease.epoch,
                    granted_tokens: lease.granted_tokens,
                    window: Window {
                        start_ms: lease.window_start_ms,
                        end_ms: lease.window_end_ms,
                    },
                    expires_at_ms: 0,
                    retry_after_ms: 0,
                    // What the crashed run spent after its snapshot is unknown: nothing is
                    // given back.
                    returnable: false,
                })
            });
        }
    }
}
