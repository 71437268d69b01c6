//! Sliding-window approximate counter: two counts per key, the current and the previous window, with
//! the previous weighted by how much of it still overlaps the trailing window:
//! `estimate = prev * (window - elapsed) / window + cur`.
//!
//! The comparison is done multiplied through by the window length, in integers (no floats anywhere):
//! admit when `prev * (window - elapsed) + (cur + cost) * window <= limit * window`. It is an estimate
//! by construction: it assumes the previous window's requests were spread evenly, and it is wrong in both
//! directions by at most the previous window's count when they were not.

use super::{Decision, ParamError, RetryAfter, check_capacity_times_period, check_param};

/// Validated sliding-counter parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlidingCounter {
    limit_units: u64,
    window_ms: u64,
}

/// Stored sliding-counter state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct SlidingCounterState {
    /// Start of the current window, epoch ms.
    pub window_start_ms: u64,
    /// Units admitted in the current window.
    pub current_units: u64,
    /// Units admitted in the window before it.
    pub previous_units: u64,
}

impl SlidingCounter {
    /// Validates: limit and window in `[1, 2^40]`, `limit * window <= 2^52`.
    pub fn new(limit_units: u64, window_ms: u64) -> Result<Self, ParamError> {
        check_param("limit", limit_units, 1)?;
        check_param("windowMs", window_ms, 1)?;
        check_capacity_times_period("limit", limit_units, window_ms)?;
        Ok(Self {
            limit_units,
            window_ms,
        })
    }

    /// The limit, in units.
    pub fn limit_units(&self) -> u64 {
        self.limit_units
    }

    /// The window length, in ms.
    pub fn window_ms(&self) -> u64 {
        self.window_ms
    }

    /// Rolls the stored state forward to the window of `now_ms`. Returns the state and the effective
    /// time: a stored window later than now's (the clock moved backwards) is kept, and the decision is
    /// taken as if at that window's start, which weighs the previous window fully (stricter).
    fn roll(&self, state: Option<&SlidingCounterState>, now_ms: u64) -> (SlidingCounterState, u64) {
        let w = self.window_ms;
        let start_ms = now_ms - now_ms % w;
        let fresh = SlidingCounterState {
            window_start_ms: start_ms,
            current_units: 0,
            previous_units: 0,
        };
        match state {
            None => (fresh, now_ms),
            Some(s) if s.window_start_ms > start_ms => (*s, s.window_start_ms),
            Some(s) if s.window_start_ms == start_ms => (*s, now_ms),
            Some(s) if start_ms - s.window_start_ms == w => (
                SlidingCounterState {
                    window_start_ms: start_ms,
                    current_units: 0,
                    previous_units: s.current_units,
                },
                now_ms,
            ),
            Some(_) => (fresh, now_ms),
        }
    }

    /// Whole units the estimate would still admit at `now_ms`, without admitting anything.
    pub fn available_units(&self, state: Option<&SlidingCounterState>, now_ms: u64) -> u64 {
        let (rolled, effective_now_ms) = self.roll(state, now_ms);
        let w = u128::from(self.window_ms);
        let elapsed = u128::from(effective_now_ms - rolled.window_start_ms);
        let scaled = u128::from(rolled.previous_units) * (w - elapsed)
            + u128::from(rolled.current_units) * w;
        to_u64((u128::from(self.limit_units) * w).saturating_sub(scaled) / w)
    }

    /// Decides a request of `cost_units` at `now_ms`.
    pub fn decide(
        &self,
        state: Option<&SlidingCounterState>,
        now_ms: u64,
        cost_units: u64,
    ) -> Result<Decision<SlidingCounterState>, ParamError> {
        check_param("cost", cost_units, 1)?;
        if cost_units > self.limit_units {
            return Ok(Decision::deny(0, RetryAfter::Never));
        }
        let (rolled, effective_now_ms) = self.roll(state, now_ms);
        let w = u128::from(self.window_ms);
        let limit = u128::from(self.limit_units);
        let cost = u128::from(cost_units);
        let prev = u128::from(rolled.previous_units);
        let cur = u128::from(rolled.current_units);
        let elapsed = u128::from(effective_now_ms - rolled.window_start_ms);
        debug_assert!(elapsed < w);
        let scaled = prev * (w - elapsed) + cur * w;
        let budget = limit * w;
        if scaled + cost * w <= budget {
            let remaining = (budget - scaled - cost * w) / w;
            let next = SlidingCounterState {
                current_units: rolled.current_units + cost_units,
                ..rolled
            };
            // The state matters until the end of the next window, when both counts have aged out.
            let ttl_ms = rolled.window_start_ms + 2 * self.window_ms - now_ms;
            return Ok(Decision::allow(to_u64(remaining), next, ttl_ms));
        }
        let remaining = budget.saturating_sub(scaled) / w;
        // The earliest elapsed time e (ms into a window) at which the estimate admits the request,
        // assuming no other traffic: smallest integer e with weight * (w - e) <= slack.
        let earliest = |weight: u128, slack: u128| w - slack / weight;
        let wait = if cur + cost <= limit {
            // Within this window, once enough of the previous window has slid out (prev > 0 here,
            // otherwise the request would have been admitted).
            earliest(prev, (limit - cur - cost) * w) - elapsed
        } else {
            // Only in the next window, where the current count becomes the weighted one (cur > 0).
            (w - elapsed) + earliest(cur, (limit - cost) * w)
        };
        // The wait counts from the effective time; a stored window that starts after `now` (the clock
        // stepped back) adds the gap, one that started before `now` (its length changed) takes it
        // off. Signed, and at least 1 ms.
        let retry_ms = (wait as i128 + i128::from(effective_now_ms) - i128::from(now_ms)).max(1);
        Ok(Decision::deny(
            to_u64(remaining),
            RetryAfter::Ms(u64::try_from(retry_ms).unwrap_or(u64::MAX)),
        ))
    }
}

/// Values here are bounded by `limit * window <= 2^52`, so the conversion never saturates in practice.
fn to_u64(value: u128) -> u64 {
    u64::try_from(value).unwrap_or(u64::MAX)
}
