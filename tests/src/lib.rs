//! Allot's end-to-end tests. They live in `tests/*.rs` and run against real etcd
//! and Redis servers started by [`allot_testkit`]; this library is empty.
//!
//! `tests/harness.rs` proves every topology the testkit offers before other
//! tests build on it.

pub use allot_testkit;
