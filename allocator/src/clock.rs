//! The allocator's clocks: the OS's (`allot-clock`, the one reader of it) behind the [`Clock`] seam.

pub use allot_clock::{Clock, ManualClock, Stopwatch, SystemClock};
