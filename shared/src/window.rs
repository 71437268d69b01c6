//! Quota windows: consecutive spans `[start, end)` in epoch ms, cut one of two ways ([`WindowSpec`]).
//!
//! - **Fixed** windows are aligned to multiples of their length from the Unix epoch.
//! - **Calendar** windows start at local midnight of each day, of each Monday (ISO weeks), or of the
//!   first of each month, in an IANA time zone: their lengths vary (28 to 31 days; 23 or 25 hours
//!   on a daylight-saving switch), and a window ends exactly where the next begins.
//!
//! Either way every process that knows the spec agrees on the boundaries without coordination (the
//! time zone rules are compiled in, so two processes of one build never disagree); the allocator's
//! clock is the single authority on which window is current.

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

    /// Milliseconds from `now_ms` to the end of the window (0 once it has ended).
    pub fn ms_until_end(&self, now_ms: u64) -> u64 {
        self.end_ms.saturating_sub(now_ms)
    }
}

/// How a pool's windows are cut.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum WindowSpec {
    /// Fixed-length windows aligned to the epoch (`windowMs`).
    Fixed(NonZeroU64),
    /// Calendar windows in a time zone (`window: {"calendar", "timeZone"}`).
    Calendar(CalendarWindow),
}

impl WindowSpec {
    /// The window that contains `now_ms`.
    pub fn containing(&self, now_ms: u64) -> Window {
        match self {
            WindowSpec::Fixed(length_ms) => Window::containing(now_ms, *length_ms),
            WindowSpec::Calendar(calendar) => calendar.containing(now_ms),
        }
    }

    /// The window right after `window` (which must be one of this spec's).
    pub fn after(&self, window: &Window) -> Window {
        self.containing(window.end_ms)
    }

    /// The shortest a window can be, ms: a lease may not outlive it.
    pub fn shortest_ms(&self) -> u64 {
        match self {
            WindowSpec::Fixed(length_ms) => length_ms.get(),
            WindowSpec::Calendar(calendar) => calendar.unit.shortest_ms(),
        }
    }

    /// The longest a window can be, ms (a fixed window's length; a 31-day month with an hour gained).
    pub fn longest_ms(&self) -> u64 {
        match self {
            WindowSpec::Fixed(length_ms) => length_ms.get(),
            WindowSpec::Calendar(calendar) => calendar.unit.longest_ms(),
        }
    }
}

/// A calendar unit a window can span.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum CalendarUnit {
    /// From local midnight to the next.
    Day,
    /// From Monday's local midnight to the next Monday's (ISO weeks).
    Week,
    /// From the first of the month's local midnight to the next month's.
    Month,
}

const HOUR_MS: u64 = 3_600_000;
const DAY_MS: u64 = 24 * HOUR_MS;

impl CalendarUnit {
    /// The unit's name in a pool spec.
    pub fn as_str(self) -> &'static str {
        match self {
            CalendarUnit::Day => "day",
            CalendarUnit::Week => "week",
            CalendarUnit::Month => "month",
        }
    }

    /// The unit named `text`, if any.
    pub fn parse(text: &str) -> Option<Self> {
        Some(match text {
            "day" => CalendarUnit::Day,
            "week" => CalendarUnit::Week,
            "month" => CalendarUnit::Month,
            _ => return None,
        })
    }

    /// Shortest length, ms: an hour lost to daylight saving time in the shortest span. (No zone
    /// moves its clocks by more than two hours at once; two are allowed for.)
    fn shortest_ms(self) -> u64 {
        let days = match self {
            CalendarUnit::Day => 1,
            CalendarUnit::Week => 7,
            CalendarUnit::Month => 28,
        };
        days * DAY_MS - 2 * HOUR_MS
    }

    /// Longest length, ms: two hours gained in the longest span.
    fn longest_ms(self) -> u64 {
        let days = match self {
            CalendarUnit::Day => 1,
            CalendarUnit::Week => 7,
            CalendarUnit::Month => 31,
        };
        days * DAY_MS + 2 * HOUR_MS
    }
}

/// Calendar windows: a unit in an IANA time zone.
#[derive(Debug)]
pub struct CalendarWindow {
    unit: CalendarUnit,
    time_zone_name: String,
    time_zone: jiff::tz::TimeZone,
    /// The window last computed: a zone's windows never change (its rules are compiled in), and
    /// most calls ask about the same one, so the time-zone arithmetic runs once per window.
    last: std::sync::Mutex<Option<Window>>,
}

impl Clone for CalendarWindow {
    fn clone(&self) -> Self {
        Self {
            unit: self.unit,
            time_zone_name: self.time_zone_name.clone(),
            time_zone: self.time_zone.clone(),
            last: std::sync::Mutex::new(self.cached()),
        }
    }
}

impl PartialEq for CalendarWindow {
    fn eq(&self, other: &Self) -> bool {
        self.unit == other.unit && self.time_zone_name == other.time_zone_name
    }
}

impl Eq for CalendarWindow {}

impl std::hash::Hash for CalendarWindow {
    fn hash<H: std::hash::Hasher>(&self, state: &mut H) {
        self.unit.hash(state);
        self.time_zone_name.hash(state);
    }
}

/// A time zone name that is not in the compiled-in IANA database.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("unknown time zone {0:?}: use an IANA name such as Europe/Berlin or UTC")]
pub struct UnknownTimeZone(pub String);

impl CalendarWindow {
    /// `unit` windows in the IANA time zone `time_zone` (e.g. `Europe/Berlin`, `UTC`).
    pub fn new(unit: CalendarUnit, time_zone: &str) -> Result<Self, UnknownTimeZone> {
        let unknown = || UnknownTimeZone(time_zone.to_owned());
        // Names only: a fixed offset or a POSIX rule would not follow its region's changes.
        let fixed_offset = time_zone.contains(['+', ','])
            || (time_zone.starts_with("Etc/GMT") && time_zone != "Etc/GMT");
        if time_zone.is_empty() || time_zone.len() > 64 || fixed_offset {
            return Err(unknown());
        }
        let zone = jiff::tz::db().get(time_zone).map_err(|_| unknown())?;
        Ok(Self {
            unit,
            time_zone_name: time_zone.to_owned(),
            time_zone: zone,
            last: std::sync::Mutex::new(None),
        })
    }

    fn cached(&self) -> Option<Window> {
        *self.last()
    }

    fn last(&self) -> std::sync::MutexGuard<'_, Option<Window>> {
        // A window is two numbers written at once: a poisoned lock still holds a whole one.
        self.last
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner)
    }

    /// The calendar unit.
    pub fn unit(&self) -> CalendarUnit {
        self.unit
    }

    /// The IANA time zone's name, as given.
    pub fn time_zone(&self) -> &str {
        &self.time_zone_name
    }

    /// The window containing `now_ms`: from the local start of `now`'s day, week or month to the
    /// next one's. An instant jiff cannot represent (beyond the year 9999) falls in one window that
    /// ends at `u64::MAX`.
    pub fn containing(&self, now_ms: u64) -> Window {
        if let Some(window) = self.cached().filter(|window| window.contains(now_ms)) {
            return window;
        }
        match self.bounds(now_ms) {
            Some(window) => {
                *self.last() = Some(window);
                window
            }
            None => Window {
                start_ms: now_ms,
                end_ms: u64::MAX,
            },
        }
    }

    fn bounds(&self, now_ms: u64) -> Option<Window> {
        use jiff::ToSpan as _;
        let now = jiff::Timestamp::from_millisecond(i64::try_from(now_ms).ok()?).ok()?;
        let date = now.to_zoned(self.time_zone.clone()).date();
        let first = match self.unit {
            CalendarUnit::Day => date,
            CalendarUnit::Week => date
                .checked_sub(i64::from(date.weekday().to_monday_zero_offset()).days())
                .ok()?,
            CalendarUnit::Month => date.first_of_month(),
        };
        let next = match self.unit {
            CalendarUnit::Day => first.checked_add(1.day()),
            CalendarUnit::Week => first.checked_add(7.days()),
            CalendarUnit::Month => first.checked_add(1.month()),
        }
        .ok()?;
        // The first instant of a local date: midnight, or the end of a gap that swallows it.
        let start_of = |day: jiff::civil::Date| -> Option<u64> {
            let zoned = day.to_zoned(self.time_zone.clone()).ok()?;
            // A window that began before the epoch starts, for this clock, at the epoch.
            u64::try_from(zoned.timestamp().as_millisecond().max(0)).ok()
        };
        let window = Window {
            start_ms: start_of(first)?,
            end_ms: start_of(next)?,
        };
        debug_assert!(window.contains(now_ms), "{window:?} must contain {now_ms}");
        Some(window)
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
