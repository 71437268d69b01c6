//! The region agent's clocks: wall time and the stopwatch from `allot-clock` (the one reader of the
//! OS clock), and the monotonic clock of the limiter's client path. Everything else takes a
//! [`Clock`] or a [`MonotonicClock`].
//!
//! Redis decisions do not use the wall clock at all: the scripts read the store's own `TIME`, so
//! gateway clock skew cannot influence refill. [`SystemClock`] serves the in-process store (the
//! embedded default and its tests).
//!
//! The limiter's client path needs elapsed time, never the date: a decision's deadline, breaker
//! cool-downs, negative-cache entries, fallback buckets and cardinality windows. Those read a
//! [`MonotonicClock`] (milliseconds since an arbitrary origin), which never steps back when the wall
//! clock is corrected. Deadlines are `tokio` instants from [`monotonic_now`], so a test that pauses
//! the runtime's clock controls them too.

use std::sync::atomic::Ordering;

pub use allot_clock::{Clock, ManualClock, Stopwatch, SystemClock};

/// Elapsed time in ms since an arbitrary origin; never goes backwards.
pub trait MonotonicClock: Send + Sync + 'static {
    /// Milliseconds since the clock's origin.
    fn elapsed_ms(&self) -> u64;
}

/// The runtime's monotonic clock (`tokio::time::Instant`), counted from when this value was made.
/// Under a paused test runtime it moves only when the test advances it.
#[derive(Debug, Clone, Copy)]
pub struct SystemMonotonicClock {
    origin: tokio::time::Instant,
}

impl SystemMonotonicClock {
    /// A clock whose origin is now.
    pub fn new() -> Self {
        Self {
            origin: monotonic_now(),
        }
    }
}

impl Default for SystemMonotonicClock {
    fn default() -> Self {
        Self::new()
    }
}

impl MonotonicClock for SystemMonotonicClock {
    fn elapsed_ms(&self) -> u64 {
        let elapsed = monotonic_now().duration_since(self.origin);
        u64::try_from(elapsed.as_millis()).unwrap_or(u64::MAX)
    }
}

/// A monotonic clock that stands still until told to move: tests of breakers, caches and windows.
#[derive(Debug, Default)]
pub struct ManualMonotonicClock {
    elapsed_ms: std::sync::atomic::AtomicU64,
}

impl ManualMonotonicClock {
    /// A clock reading `elapsed_ms`.
    pub fn new(elapsed_ms: u64) -> Self {
        Self {
            elapsed_ms: std::sync::atomic::AtomicU64::new(elapsed_ms),
        }
    }

    /// Moves the clock forward by `delta_ms`.
    pub fn advance(&self, delta_ms: u64) {
        self.elapsed_ms.fetch_add(delta_ms, Ordering::SeqCst);
    }
}

impl MonotonicClock for ManualMonotonicClock {
    fn elapsed_ms(&self) -> u64 {
        self.elapsed_ms.load(Ordering::SeqCst)
    }
}

/// Now on the runtime's monotonic clock: the base of every decision deadline.
#[allow(clippy::disallowed_methods)]
pub fn monotonic_now() -> tokio::time::Instant {
    tokio::time::Instant::now()
}
