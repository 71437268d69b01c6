//! The gateways' carving: sub-leases of a holder for gateways that decide requests themselves
//! (Envoy's rate limit quota service). A sub-lease is a reservation that stays open while its
//! gateway draws on it, gives part of it back, or ends with what it still holds withheld.

use super::types::{Denial, Refusal, Reservation, ReservedFrom};
use super::{FallbackBook, PoolHolder};

impl PoolHolder {
    /// Spends `tokens` of a reservation that stays open (a gateway's sub-lease reporting what it
    /// admitted at `now_ms`, counted as demand then): from its leases first-ending first, or
    /// admitted in its fallback window. Returns how many were drawn (at most what it still holds).
    pub fn draw(&mut self, reservation: &mut Reservation, tokens: u64, now_ms: u64) -> u64 {
        let drawn = tokens.min(reservation.cost_tokens);
        if drawn == 0 {
            return 0;
        }
        reservation.cost_tokens -= drawn;
        self.reserved_tokens = self.reserved_tokens.saturating_sub(drawn);
        self.note_demand(now_ms, drawn);
        match &mut reservation.from {
            ReservedFrom::Fallback { window_start_ms } => {
                self.fallback.admit(*window_start_ms, drawn);
                debug_assert!(
                    self.fallback.used(*window_start_ms) <= self.config.fallback_per_region_tokens
                );
            }
            ReservedFrom::Leases { parts, len } => {
                let mut left = drawn;
                for part in parts[..*len].iter_mut() {
                    let take = left.min(part.1);
                    if take == 0 {
                        continue;
                    }
                    part.1 -= take;
                    left -= take;
                    if !self.leases.spend_reserved(part.0, take) {
                        self.dropped_reports += 1;
                    }
                    if left == 0 {
                        break;
                    }
                }
            }
        }
        drawn
    }

    /// [`reserve`](Self::reserve) for a sub-lease: the same, but the reservation is not counted
    /// as demand (a gateway's assignment holds more than it will spend soon; its gateway's reported
    /// use is counted instead, with [`note_demand`](Self::note_demand) and
    /// [`draw`](Self::draw)).
    pub fn reserve_for_sublease(
        &mut self,
        cost_tokens: u64,
        now_ms: u64,
        allocator_reachable: bool,
    ) -> Result<Reservation, Refusal> {
        let reserved = self.reserve(cost_tokens, now_ms, allocator_reachable);
        if !matches!(
            reserved,
            Err(Refusal {
                denial: Denial::CostAboveChunk,
                ..
            })
        ) {
            self.demand.rate.unrecord(now_ms, cost_tokens.max(1));
        }
        reserved.map(|mut reservation| {
            // Cancelling must not take the demand back a second time.
            reservation.demand_counted = false;
            reservation
        })
    }

    /// Counts `tokens` of demand at `now_ms` that no reservation stands for (requests a gateway
    /// denied on its own, for lack of assignment), so renewals are sized for it.
    pub fn note_demand(&mut self, now_ms: u64, tokens: u64) {
        if tokens > 0 {
            self.demand.record(now_ms, tokens);
        }
    }

    /// Gives back `tokens` of a reservation that stays open (a sub-lease cut short before its
    /// gateway could spend them): to their lease while it lives (an ended one strands them), or
    /// to their window's fallback allowance; the last-ending lease's part first. Returns how many
    /// were given back (at most what it holds).
    pub fn give_back(&mut self, reservation: &mut Reservation, tokens: u64) -> u64 {
        let given = tokens.min(reservation.cost_tokens);
        if given == 0 {
            return 0;
        }
        reservation.cost_tokens -= given;
        self.reserved_tokens = self.reserved_tokens.saturating_sub(given);
        match &mut reservation.from {
            ReservedFrom::Fallback { window_start_ms } => {
                self.fallback.release(*window_start_ms, given);
            }
            ReservedFrom::Leases { parts, len } => {
                let mut left = given;
                for part in parts[..*len].iter_mut().rev() {
                    let take = left.min(part.1);
                    if take == 0 {
                        continue;
                    }
                    part.1 -= take;
                    left -= take;
                    self.stranded_tokens += self.leases.release(part.0, take);
                    if left == 0 {
                        break;
                    }
                }
            }
        }
        given
    }

    /// Tokens a reservation could take now: what the held leases have left, or, when none is
    /// held and the allocator is unreachable (or silent past the renewal patience), what is left
    /// of the window's fallback allowance (durable claims aside: [`reserve`](Self::reserve) says
    /// when one must be made first).
    pub fn spendable_tokens(&mut self, now_ms: u64, allocator_reachable: bool) -> u64 {
        self.expire(now_ms);
        let leased = self.available_tokens(now_ms);
        if leased > 0 || (allocator_reachable && !self.allocator_silent(now_ms)) {
            return leased;
        }
        let window = self.config.window.containing(now_ms);
        if !self.fallback_span(window).contains(&now_ms) {
            return 0;
        }
        let used = FallbackBook::used(&self.fallback, window.start_ms);
        self.config.fallback_per_region_tokens.saturating_sub(used)
    }

    /// Ends a sub-lease: what its reservation still holds is never spendable again (its gateway
    /// may have admitted some of it without reporting it). From leases it is stranded; in fallback
    /// it stays used in its window, never reported as admitted.
    pub fn withhold(&mut self, reservation: Reservation) {
        self.settle(&reservation);
        match reservation.from {
            ReservedFrom::Fallback { window_start_ms } => {
                self.fallback
                    .withhold(window_start_ms, reservation.cost_tokens);
            }
            ReservedFrom::Leases { .. } => {
                for &(lease_id, tokens) in reservation.lease_parts() {
                    if tokens == 0 {
                        continue;
                    }
                    self.leases.withhold(lease_id, tokens);
                    self.stranded_tokens += tokens;
                }
            }
        }
    }

    /// The instant (epoch ms, exclusive) by which what `reservation` holds must be spent: the end
    /// of the first-ending lease it holds tokens of (less the expiry margin), or the end of its
    /// window's [fallback span](Self::fallback_span).
    pub fn usable_until_ms(&self, reservation: &Reservation) -> u64 {
        match &reservation.from {
            ReservedFrom::Fallback { window_start_ms } => {
                self.fallback_span(self.config.window.containing(*window_start_ms))
                    .end
            }
            ReservedFrom::Leases { .. } => self
                .leases
                .usable_until_ms(reservation.lease_parts(), self.config.expiry_margin_ms),
        }
    }
}
