//! Epoch-aligned fixed window: a counter per window `[w, w + window_ms)` with `w = now - now % window_ms`.
//!
//! The cheapest algorithm, kept for coarse rules (pre-authentication IP limits). Its known weakness is
//! the boundary burst: up to `2 * limit` requests within a span straddling a window boundary. The window
//! start is stored with the count, so even a lost TTL cannot carry a count into the next window.

use super::{Decision, ParamError, RetryAfter, check_capacity_times_period, check_param};

/// Validated fixed-window parameters.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FixedWindow {
    limit_units: u64,
    window_ms: u64,
}

/// Stored fixed-window state.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct FixedWindowState {
    /// Start of the window the count belongs to, epoch ms.
    pub window_start_ms: u64,
    /// Units admitted in that window.
    pub count_units: u64,
}

impl FixedWindow {
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

    /// The limit per window, in units.
    pub fn limit_units(&self) -> u64 {
        self.limit_units
    }

    /// The window length, in ms.
    pub fn window_ms(&self) -> u64 {
        self.window_ms
    }

    /// Units left in the window of `now_ms` without admitting anything.
    pub fn available_units(&self, state: Option<&FixedWindowState>, now_ms: u64) -> u64 {
        let current_start_ms = now_ms - now_ms % self.window_ms;
        match state {
            Some(s) if s.window_start_ms >= current_start_ms => {
                self.limit_units.saturating_sub(s.count_units)
            }
            _ => self.limit_units,
        }
    }

    /// Decides a request of `cost_units` at `now_ms`.
    pub fn decide(
        &self,
        state: Option<&FixedWindowState>,
        now_ms: u64,
        cost_units: u64,
    ) -> Result<Decision<FixedWindowState>, ParamError> {
        check_param("cost", cost_units, 1)?;
        if cost_units > self.limit_units {
            return Ok(Decision::deny(0, RetryAfter::Never));
        }
        let current_start_ms = now_ms - now_ms % self.window_ms;
        // A stored window later than now's means the clock moved backwards: stay in the stored window
        // (stricter) rather than start a fresh count.
        let (window_start_ms, count_units) = match state {
            Some(s) if s.window_start_ms >= current_start_ms => (s.window_start_ms, s.count_units),
            _ => (current_start_ms, 0),
        };
        let window_end_ms = window_start_ms + self.window_ms;
        let left_ms = window_end_ms - now_ms;
        if count_units.saturating_add(cost_units) > self.limit_units {
            let remaining = self.limit_units.saturating_sub(count_units);
            return Ok(Decision::deny(remaining, RetryAfter::Ms(left_ms)));
        }
        let count_units = count_units + cost_units;
        Ok(Decision::allow(
            self.limit_units - count_units,
            FixedWindowState {
                window_start_ms,
                count_units,
            },
            left_ms,
        ))
    }
}
