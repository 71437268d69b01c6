//! Partition drills and the `allot` command.
//!
//! Drills ([`drill`]) run the shipped allocator and agent logic under virtual time and injected
//! faults, measuring overshoot and stranded tokens against the stated bound. The crate also hosts the
//! `allot` binary: [`dev`] (the whole system in one process) and [`tools`] (policy check, bound).
//!
//! Architecture invariant: drills run the real crates through their store, clock and transport seams;
//! they never re-implement the algorithms. This is the only crate that may depend on both the allocator
//! and the region agent.

pub mod dev;
pub mod drill;
pub mod model;
pub mod tools;
