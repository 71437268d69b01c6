//! Calendar windows: days, ISO weeks and months in IANA time zones, across month ends, leap years
//! and daylight-saving switches (including a zone whose clocks skip midnight). Windows tile time:
//! each contains its instants, starts where the previous ended, and lasts between the spec's
//! shortest and longest.

use allot_shared::window::{CalendarUnit, CalendarWindow, Window, WindowSpec};
use proptest::prelude::*;

/// Epoch ms of a UTC instant written as RFC 3339.
fn at(text: &str) -> u64 {
    let stamp: jiff::Timestamp = text.parse().expect("an RFC 3339 instant");
    u64::try_from(stamp.as_millisecond()).expect("after 1970")
}

fn window(unit: CalendarUnit, zone: &str, now: &str) -> Window {
    CalendarWindow::new(unit, zone)
        .expect("a known zone")
        .containing(at(now))
}

const HOUR: u64 = 3_600_000;
const DAY: u64 = 24 * HOUR;

#[test]
fn a_berlin_month_runs_from_local_midnight_of_the_first_to_the_next() {
    let january = window(CalendarUnit::Month, "Europe/Berlin", "2026-01-15T12:00:00Z");
    assert_eq!(
        january.start_ms,
        at("2025-12-31T23:00:00Z"),
        "midnight at UTC+1"
    );
    assert_eq!(january.end_ms, at("2026-01-31T23:00:00Z"));
    // The last instant of January in Berlin is still January; the next is February.
    let last = window(
        CalendarUnit::Month,
        "Europe/Berlin",
        "2026-01-31T22:59:59.999Z",
    );
    assert_eq!(last, january);
    let february = window(CalendarUnit::Month, "Europe/Berlin", "2026-01-31T23:00:00Z");
    assert_eq!(february.start_ms, january.end_ms);
    assert_eq!(february.length_ms(), 28 * DAY);
}

#[test]
fn leap_februaries_have_29_days_and_others_28() {
    let leap = window(CalendarUnit::Month, "UTC", "2028-02-10T00:00:00Z");
    assert_eq!(leap.length_ms(), 29 * DAY);
    assert_eq!(leap.end_ms, at("2028-03-01T00:00:00Z"));
    let common = window(CalendarUnit::Month, "UTC", "2027-02-10T00:00:00Z");
    assert_eq!(common.length_ms(), 28 * DAY);
    let century = window(CalendarUnit::Month, "UTC", "2100-02-10T00:00:00Z");
    assert_eq!(century.length_ms(), 28 * DAY, "2100 is not a leap year");
}

#[test]
fn daylight_saving_switches_make_23_and_25_hour_days_and_uneven_months() {
    // Berlin: clocks go forward on 2026-03-29 and back on 2026-10-25.
    let spring = window(CalendarUnit::Day, "Europe/Berlin", "2026-03-29T12:00:00Z");
    assert_eq!(spring.length_ms(), 23 * HOUR);
    assert_eq!(spring.start_ms, at("2026-03-28T23:00:00Z"));
    let autumn = window(CalendarUnit::Day, "Europe/Berlin", "2026-10-25T12:00:00Z");
    assert_eq!(autumn.length_ms(), 25 * HOUR);
    let march = window(CalendarUnit::Month, "Europe/Berlin", "2026-03-10T00:00:00Z");
    assert_eq!(march.length_ms(), 31 * DAY - HOUR);
    let october = window(CalendarUnit::Month, "Europe/Berlin", "2026-10-10T00:00:00Z");
    assert_eq!(october.length_ms(), 31 * DAY + HOUR);
    // New York's week of its spring switch (Sunday 2026-03-08) is an hour short.
    let week = window(
        CalendarUnit::Week,
        "America/New_York",
        "2026-03-05T12:00:00Z",
    );
    assert_eq!(week.length_ms(), 7 * DAY - HOUR);
    assert_eq!(
        week.start_ms,
        at("2026-03-02T05:00:00Z"),
        "Monday 00:00 at UTC-5"
    );
    assert_eq!(
        week.end_ms,
        at("2026-03-09T04:00:00Z"),
        "the next Monday 00:00 at UTC-4"
    );
}

#[test]
fn a_day_whose_midnight_does_not_exist_starts_when_the_clocks_resume() {
    // Sao Paulo moved its clocks from 00:00 to 01:00 on 2018-11-04: that day began at 01:00 local
    // (03:00 UTC) and lasted 23 hours.
    let day = window(
        CalendarUnit::Day,
        "America/Sao_Paulo",
        "2018-11-04T12:00:00Z",
    );
    assert_eq!(day.start_ms, at("2018-11-04T03:00:00Z"));
    assert_eq!(day.length_ms(), 23 * HOUR);
    let before = window(
        CalendarUnit::Day,
        "America/Sao_Paulo",
        "2018-11-04T02:59:59.999Z",
    );
    assert_eq!(
        before.end_ms, day.start_ms,
        "the day before ends where it begins"
    );
}

#[test]
fn weeks_start_on_monday() {
    // 2026-12-01 is a Tuesday.
    let week = window(CalendarUnit::Week, "UTC", "2026-12-01T09:00:00Z");
    assert_eq!(week.start_ms, at("2026-11-30T00:00:00Z"));
    assert_eq!(week.end_ms, at("2026-12-07T00:00:00Z"));
    // The week of the epoch began before it (Monday 1969-12-29): for this clock it starts at 0.
    let first = window(CalendarUnit::Week, "UTC", "1970-01-01T00:00:00Z");
    assert_eq!(
        (first.start_ms, first.end_ms),
        (0, at("1970-01-05T00:00:00Z"))
    );
    let monday = window(CalendarUnit::Week, "UTC", "2026-11-30T00:00:00Z");
    assert_eq!(monday, week, "a window contains its first instant");
}

#[test]
fn only_iana_names_are_time_zones() {
    for name in [
        "Mars/Olympus_Mons",
        "",
        "+02:00",
        "UTC+2",
        "EST5EDT,M3.2.0,M11.1.0",
        "../etc",
        "Etc/GMT-5",
    ] {
        let error = CalendarWindow::new(CalendarUnit::Month, name).expect_err(name);
        assert!(error.to_string().contains("IANA"), "{error}");
    }
    for name in [
        "UTC",
        "Europe/Berlin",
        "Asia/Kolkata",
        "Australia/Lord_Howe",
        "Pacific/Chatham",
    ] {
        assert!(
            CalendarWindow::new(CalendarUnit::Day, name).is_ok(),
            "{name}"
        );
    }
}

const ZONES: &[&str] = &[
    "UTC",
    "Europe/Berlin",
    "America/New_York",
    "America/Sao_Paulo",
    "Australia/Lord_Howe",
    "Asia/Kathmandu",
    "Pacific/Apia",
    "America/Santiago",
];

proptest! {
    /// Windows tile time in every zone and unit: the window of an instant contains it, the window
    /// of its end starts there, and its length lies within the spec's shortest and longest.
    #[test]
    fn calendar_windows_tile_time(
        zone in prop::sample::select(ZONES),
        unit in prop::sample::select(&[CalendarUnit::Day, CalendarUnit::Week, CalendarUnit::Month][..]),
        now in 0u64..4_102_444_800_000,
    ) {
        let spec = WindowSpec::Calendar(CalendarWindow::new(unit, zone).expect("known"));
        let w = spec.containing(now);
        prop_assert!(w.contains(now), "{:?} and {}", w, now);
        prop_assert_eq!(spec.containing(w.start_ms), w);
        prop_assert_eq!(spec.containing(w.end_ms - 1), w);
        let next = spec.after(&w);
        prop_assert_eq!(next.start_ms, w.end_ms);
        prop_assert!(
            (spec.shortest_ms()..=spec.longest_ms()).contains(&w.length_ms()),
            "{} ms in {} {:?}", w.length_ms(), zone, unit
        );
    }
}

proptest! {
    /// One calendar spec asked about many instants, in any order (it remembers the last window it
    /// computed), answers as a fresh spec asked about each alone.
    #[test]
    fn a_spec_asked_again_and_again_answers_as_a_fresh_one(
        zone in prop::sample::select(ZONES),
        unit in prop::sample::select(&[CalendarUnit::Day, CalendarUnit::Week, CalendarUnit::Month][..]),
        start in 0u64..4_102_444_800_000,
        steps in prop::collection::vec(-3_000_000_000i64..3_000_000_000, 1..40),
    ) {
        let reused = CalendarWindow::new(unit, zone).expect("known");
        let mut now = start;
        for step in steps {
            now = now.saturating_add_signed(step);
            let fresh = CalendarWindow::new(unit, zone).expect("known").containing(now);
            prop_assert_eq!(reused.containing(now), fresh, "at {}", now);
            prop_assert_eq!(reused.clone().containing(now), fresh, "a clone, at {}", now);
        }
    }
}
