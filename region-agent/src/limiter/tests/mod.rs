//! The limiter's tests against real Redis (started per test by `allot-testkit`) and the pure core.
//!
//! - `contract`: one suite run against every store (the reference design's worked outcomes, replay,
//!   tightening, refused faults).
//! - `differential`: random sequences through the pure core, the in-process store and the scripts.
//! - `redis`: what only Redis has: `NOSCRIPT`, contention between connections, the server clock,
//!   the script's own argument validation, a cluster.

mod contract;
mod differential;
mod harness;
mod redis;
