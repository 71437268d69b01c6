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

/// Formats epoch milliseconds as an RFC 3339 UTC timestamp, e.g. `2026-11-06T09:30:00.000Z`.
pub fn rfc3339_utc(epoch_ms: u64) -> String {
    let seconds = epoch_ms / 1_000;
    let (days, second_of_day) = (seconds / 86_400, seconds % 86_400);
    // Civil date from days since 1970-01-01 (the proleptic Gregorian calendar), after H. Hinnant.
    let z = days + 719_468;
    let era = z / 146_097;
    let day_of_era = z % 146_097;
    let year_of_era =
        (day_of_era - day_of_era / 1_460 + day_of_era / 36_524 - day_of_era / 146_096) / 365;
    let day_of_year = day_of_era - (365 * year_of_era + year_of_era / 4 - year_of_era / 100);
    let shifted_month = (5 * day_of_year + 2) / 153;
    let day = day_of_year - (153 * shifted_month + 2) / 5 + 1;
    let month = if shifted_month < 10 {
        shifted_month + 3
    } else {
        shifted_month - 9
    };
    let year = year_of_era + era * 400 + u64::from(month <= 2);
    format!(
        "{year:04}-{month:02}-{day:02}T{:02}:{:02}:{:02}.{:03}Z",
        second_of_day / 3_600,
        second_of_day / 60 % 60,
        second_of_day % 60,
        epoch_ms % 1_000
    )
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

    #[test]
    fn rfc3339_formatting() {
        assert_eq!(rfc3339_utc(0), "1970-01-01T00:00:00.000Z");
        assert_eq!(rfc3339_utc(1_762_421_400_000), "2025-11-06T09:30:00.000Z");
        assert_eq!(rfc3339_utc(951_782_400_123), "2000-02-29T00:00:00.123Z");
        assert_eq!(rfc3339_utc(1_767_225_599_999), "2025-12-31T23:59:59.999Z");
    }
}
