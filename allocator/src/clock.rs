//! The allocator's only reader of the OS clock. Everything else takes a [`Clock`].

use std::time::{SystemTime, UNIX_EPOCH};

pub use allot_shared::clock::{Clock, ManualClock};

/// Wall-clock time from the OS. The allocator's clock is the single authority on window boundaries.
#[derive(Debug, Default, Clone, Copy)]
pub struct SystemClock;

impl Clock for SystemClock {
    #[allow(clippy::disallowed_methods)]
    fn now_ms(&self) -> u64 {
        SystemTime::now()
            .duration_since(UNIX_EPOCH)
            .map_or(0, |d| u64::try_from(d.as_millis()).unwrap_or(u64::MAX))
    }
}

/// Measures elapsed time for metrics (monotonic). Never used for decisions.
#[derive(Debug, Clone, Copy)]
pub struct Stopwatch(std::time::Instant);

impl Stopwatch {
    /// Starts measuring.
    #[allow(clippy::disallowed_methods)]
    pub fn start() -> Self {
        Self(std::time::Instant::now())
    }

    /// Seconds since start.
    pub fn elapsed_seconds(&self) -> f64 {
        self.0.elapsed().as_secs_f64()
    }
}
