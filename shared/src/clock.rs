//! The clock seam.
//!
//! Decision code takes `now_ms` as an argument; services read it from a [`Clock`] so the simulator and
//! tests can drive time. This crate defines the seam and a manual clock; the system clock lives in
//! `allot-clock`, the services' one reader of the OS clock.

use std::sync::atomic::{AtomicU64, Ordering};

/// A source of wall-clock time in epoch milliseconds.
pub trait Clock: Send + Sync + 'static {
    /// Now, in epoch ms.
    fn now_ms(&self) -> u64;
}

/// A clock that moves only when told to: for tests and simulations.
#[derive(Debug, Default)]
pub struct ManualClock {
    now_ms: AtomicU64,
}

impl ManualClock {
    /// A clock reading `now_ms`.
    pub fn new(now_ms: u64) -> Self {
        Self {
            now_ms: AtomicU64::new(now_ms),
        }
    }

    /// Moves the clock forward by `delta_ms`.
    pub fn advance(&self, delta_ms: u64) {
        self.now_ms.fetch_add(delta_ms, Ordering::SeqCst);
    }

    /// Sets the clock, forwards or backwards.
    pub fn set(&self, now_ms: u64) {
        self.now_ms.store(now_ms, Ordering::SeqCst);
    }
}

impl Clock for ManualClock {
    fn now_ms(&self) -> u64 {
        self.now_ms.load(Ordering::SeqCst)
    }
}
