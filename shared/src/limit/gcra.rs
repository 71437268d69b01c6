//! GCRA (the generic cell rate algorithm): the token bucket's meter stated as arithmetic on one stored
//! integer, the theoretical arrival time (TAT).
//!
//! With emission interval `T = period / refill` (ms per millitoken) and burst tolerance
//! `B = capacity * T`, a request of cost `c` is admitted when `max(TAT, now) + c * T - now <= B`, and then
//! `TAT = max(TAT, now) + c * T`. Parameters are given exactly like a token bucket's; fractional
//! intervals are rounded in the strict direction (the increment up, the tolerance down). When
//! `refill / period` is a whole number of millitokens per ms that divides 1,000 and divides the capacity,
//! and costs are whole tokens, no rounding happens and GCRA admits exactly the sequences the token bucket
//! admits, with the same retry hints (a property test holds us to that).

use super::{Decision, ParamError, RetryAfter, check_capacity_times_period, check_param, div_ceil};

/// Validated GCRA parameters, given as a token bucket's (millitokens and ms).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct Gcra {
    capacity_millitokens: u64,
    refill_millitokens: u64,
    period_ms: u64,
}

/// Stored GCRA state: the theoretical arrival time, epoch ms. Never moves backwards.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct GcraState {
    /// When the meter would be completely drained if no more requests came, epoch ms.
    pub tat_ms: u64,
}

impl Gcra {
    /// Validates like [`super::token_bucket::TokenBucket::new`].
    pub fn new(
        capacity_millitokens: u64,
        refill_millitokens: u64,
        period_ms: u64,
    ) -> Result<Self, ParamError> {
        check_param("capacityMillis", capacity_millitokens, 1)?;
        check_param("refillMillis", refill_millitokens, 1)?;
        check_param("periodMs", period_ms, 1)?;
        check_capacity_times_period("capacityMillis", capacity_millitokens, period_ms)?;
        Ok(Self {
            capacity_millitokens,
            refill_millitokens,
            period_ms,
        })
    }

    /// Capacity in millitokens.
    pub fn capacity_millitokens(&self) -> u64 {
        self.capacity_millitokens
    }

    /// Refill amount per period, in millitokens.
    pub fn refill_millitokens(&self) -> u64 {
        self.refill_millitokens
    }

    /// Refill period, in ms.
    pub fn period_ms(&self) -> u64 {
        self.period_ms
    }

    /// Burst tolerance `B`, in ms: `floor(capacity * period / refill)`.
    pub fn burst_tolerance_ms(&self) -> u64 {
        self.capacity_millitokens * self.period_ms / self.refill_millitokens
    }

    /// TAT increment for a request, in ms: `ceil(cost * period / refill)`.
    pub fn increment_ms(&self, cost_millitokens: u64) -> u64 {
        div_ceil(cost_millitokens * self.period_ms, self.refill_millitokens)
    }

    /// Converts a span of unused tolerance (ms) into millitokens, rounding down.
    fn millitokens_in(&self, span_ms: u64) -> u64 {
        span_ms * self.refill_millitokens / self.period_ms
    }

    /// Millitokens available at `now_ms` without admitting anything, rounded down.
    pub fn available_millitokens(&self, state: Option<&GcraState>, now_ms: u64) -> u64 {
        let burst_ms = self.burst_tolerance_ms();
        let used_ms = state
            .map_or(0, |s| s.tat_ms.saturating_sub(now_ms))
            .min(burst_ms);
        self.millitokens_in(burst_ms - used_ms)
    }

    /// Decides a request of `cost_millitokens` at `now_ms`.
    pub fn decide(
        &self,
        state: Option<&GcraState>,
        now_ms: u64,
        cost_millitokens: u64,
    ) -> Result<Decision<GcraState>, ParamError> {
        check_param("costMillis", cost_millitokens, 1)?;
        if cost_millitokens > self.capacity_millitokens {
            return Ok(Decision::deny(0, RetryAfter::Never));
        }
        let burst_ms = self.burst_tolerance_ms();
        let tat_ms = state.map_or(now_ms, |s| s.tat_ms);
        let start_ms = tat_ms.max(now_ms);
        let new_tat_ms = start_ms + self.increment_ms(cost_millitokens);
        let ahead_ms = new_tat_ms - now_ms;
        if ahead_ms > burst_ms {
            let used_ms = (start_ms - now_ms).min(burst_ms);
            let remaining = self.millitokens_in(burst_ms - used_ms);
            return Ok(Decision::deny(
                remaining,
                RetryAfter::Ms(ahead_ms - burst_ms),
            ));
        }
        let remaining = self.millitokens_in(burst_ms - ahead_ms);
        Ok(Decision::allow(
            remaining,
            GcraState { tat_ms: new_tat_ms },
            ahead_ms,
        ))
    }
}
