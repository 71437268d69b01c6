//! What one grant exchange says of the agent's clock against the allocator's. The allocator
//! stamps its answer (`answeredAtMs`, its clock) somewhere between the agent's ask and the
//! answer's arrival (both on the agent's clock), so the agent's clock less the allocator's lies
//! between `asked - answered` and `received - answered`. Fallback windows are cut on the agent's
//! clock, within a margin of that offset ([`HolderConfig::clock_margin_ms`]); this is how the
//! agent sees whether the margin holds.
//!
//! [`HolderConfig::clock_margin_ms`]: super::HolderConfig::clock_margin_ms

/// The agent's clock less the allocator's, as one exchange bounds it, ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ClockOffset {
    /// The least the offset can be.
    pub low_ms: i64,
    /// The most the offset can be.
    pub high_ms: i64,
}

impl ClockOffset {
    /// The offset an exchange bounds: asked at `asked_at_ms` and received at `received_at_ms` on
    /// the agent's clock, answered at `answered_at_ms` on the allocator's. `None` when the agent's
    /// clock ran backwards over the exchange (nothing can be said).
    pub fn from_exchange(
        asked_at_ms: u64,
        received_at_ms: u64,
        answered_at_ms: u64,
    ) -> Option<Self> {
        if received_at_ms < asked_at_ms {
            return None;
        }
        let signed = |ms: u64| i64::try_from(ms).unwrap_or(i64::MAX);
        let answered = signed(answered_at_ms);
        Some(Self {
            low_ms: signed(asked_at_ms).saturating_sub(answered),
            high_ms: signed(received_at_ms).saturating_sub(answered),
        })
    }

    /// The middle of the bounds: the estimate, ms.
    pub fn estimate_ms(&self) -> i64 {
        self.low_ms + (self.high_ms - self.low_ms) / 2
    }

    /// Whether the offset is certainly larger than `margin_ms` either way: even the bound
    /// nearest zero lies beyond it.
    pub fn beyond(&self, margin_ms: u64) -> bool {
        let margin = i64::try_from(margin_ms).unwrap_or(i64::MAX);
        self.low_ms > margin || self.high_ms < -margin
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[test]
    fn an_agent_ahead_by_more_than_the_round_trip_is_seen_beyond_the_margin() {
        // Asked at 10,000 and received at 10,040 on the agent's clock, answered at 9,500 on the
        // allocator's: the agent is 500 to 540 ms ahead.
        let offset = ClockOffset::from_exchange(10_000, 10_040, 9_500).expect("an offset");
        assert_eq!((offset.low_ms, offset.high_ms), (500, 540));
        assert_eq!(offset.estimate_ms(), 520);
        assert!(offset.beyond(100));
        assert!(!offset.beyond(500), "500 is within reach of the bounds");
    }

    #[test]
    fn a_slow_exchange_proves_nothing() {
        let offset = ClockOffset::from_exchange(10_000, 11_000, 10_400).expect("an offset");
        assert_eq!((offset.low_ms, offset.high_ms), (-400, 600));
        assert!(!offset.beyond(100));
        assert_eq!(ClockOffset::from_exchange(10_000, 9_999, 10_000), None);
    }

    proptest! {
        /// Whatever the true offset and wherever in the exchange the allocator answered, the
        /// bounds hold it, and `beyond` is never said of an offset within the margin.
        #[test]
        fn the_bounds_hold_the_true_offset(
            asked in 1_000_000u64..2_000_000,
            round_trip in 0u64..5_000,
            answered_after in 0u64..5_000,
            offset in -100_000i64..100_000,
            margin in 0u64..10_000,
        ) {
            let answered_after = answered_after.min(round_trip);
            let received = asked + round_trip;
            // The allocator's clock at the answer: the agent's then, less the offset.
            let answered = (asked + answered_after).saturating_add_signed(-offset);
            let bounds = ClockOffset::from_exchange(asked, received, answered).expect("an offset");
            prop_assert!(bounds.low_ms <= offset && offset <= bounds.high_ms);
            if offset.unsigned_abs() <= margin {
                prop_assert!(!bounds.beyond(margin));
            }
        }
    }
}
