//! The region agent's only reader of the OS clock. Everything else takes a [`Clock`].
//!
//! Redis decisions do not use it at all: the scripts read the store's own `TIME`, so gateway clock skew
//! cannot influence refill. It serves the in-process store (the embedded default and its tests).

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
