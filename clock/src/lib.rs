//! The one reader of the OS clock for Allot's services (architecture invariant 1): everything else
//! takes a [`Clock`] (`allot_shared::clock`), which the simulator and the tests replace.
//!
//! - [`SystemClock`]: wall-clock time in epoch ms. The allocator's is the single authority on
//!   window boundaries; an agent measures lease time on its own (offset-proof, not step-proof).
//! - [`Stopwatch`]: elapsed monotonic time for telemetry and benchmarks, never for decisions.
//!
//! Architecture invariant: this crate depends on `allot-shared` only, and reads the clock only here.

use std::time::{SystemTime, UNIX_EPOCH};

pub use allot_shared::clock::{Clock, ManualClock};

/// Wall-clock time from the OS, in epoch ms.
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

/// Measures elapsed real time (monotonic), for telemetry and benchmarks. Never used for decisions.
#[derive(Debug, Clone, Copy)]
pub struct Stopwatch(std::time::Instant);

impl Stopwatch {
    /// Starts measuring.
    #[allow(clippy::disallowed_methods)]
    pub fn start() -> Self {
        Self(std::time::Instant::now())
    }

    /// Time since [`Stopwatch::start`].
    pub fn elapsed(&self) -> std::time::Duration {
        self.0.elapsed()
    }

    /// Seconds since [`Stopwatch::start`].
    pub fn elapsed_seconds(&self) -> f64 {
        self.0.elapsed().as_secs_f64()
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_wall_clock_reads_after_2026_and_the_stopwatch_moves_forward() {
        assert!(SystemClock.now_ms() > 1_767_225_600_000);
        let stopwatch = Stopwatch::start();
        let spin: u64 = (0..10_000u64).sum();
        assert!(spin > 0);
        assert!(stopwatch.elapsed_seconds() >= 0.0);
        let first = stopwatch.elapsed().as_secs_f64();
        assert!(first <= stopwatch.elapsed_seconds(), "monotonic");
    }
}
