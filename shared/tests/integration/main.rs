//! The pure core's integration tests: properties, worked numbers, policies and calendars, one
//! module each, in one binary.

mod calendar_windows;
mod overlay;
mod policy;
mod properties;
mod worked_numbers;
