//! Quota windows: consecutive, epoch-aligned spans `[start, start + length)` in ms.
//!
//! Windows are aligned to multiples of their length from the Unix epoch, so every process that knows
//! the length agrees on the boundaries without coordination; the allocator's clock is the single
//! authority on which window is current.

use std::num::NonZeroU64;

/// One window, `[start_ms, end_ms)`, epoch ms.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub struct Window {
    /// First millisecond of the window, a multiple of its length.
    pub start_ms: u64,
    /// First millisecond after the window.
    pub end_ms: u64,
}

impl Window {
    /// The window of length `length_ms` that contains `now_ms`.
    pub fn containing(now_ms: u64, length_ms: NonZeroU64) -> Self {
        let length_ms = length_ms.get();
        let start_ms = now_ms - now_ms % length_ms;
        Self {
            start_ms,
            end_ms: start_ms.saturating_add(length_ms),
        }
    }

    /// Length in ms.
    pub fn length_ms(&self) -> u64 {
        self.end_ms - self.start_ms
    }

    /// Whether `t_ms` lies inside the window.
    pub fn contains(&self, t_ms: u64) -> bool {
        self.start_ms <= t_ms && t_ms < self.end_ms
    }

    /// The window right after this one.
    pub fn next(&self) -> Self {
        Self {
            start_ms: self.end_ms,
            end_ms: self.end_ms.saturating_add(self.length_ms()),
        }
    }

    /// Milliseconds from `now_ms` to the end of the window (0 once it has ended).
    pub fn ms_until_end(&self, now_ms: u64) -> u64 {
        self.end_ms.saturating_sub(now_ms)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn len(ms: u64) -> NonZeroU64 {
        NonZeroU64::new(ms).expect("non-zero")
    }

    #[test]
    fn windows_are_epoch_aligned() {
        let w = Window::containing(61_234, len(60_000));
        assert_eq!(
            w,
            Window {
                start_ms: 60_000,
                end_ms: 120_000
            }
        );
        assert!(w.contains(60_000) && w.contains(119_999) && !w.contains(120_000));
        assert_eq!(w.next().start_ms, 120_000);
        assert_eq!(w.ms_until_end(110_000), 10_000);
        assert_eq!(Window::containing(120_000, len(60_000)).start_ms, 120_000);
    }
}
