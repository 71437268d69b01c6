//! The limiter's tests against real Redis (started per test by `allot-testkit`) and the pure core.
//!
//! - `client`: the client path (`Limiter`): fail modes with Redis stopped, the breaker, ambiguous
//!   replies, the negative cache, the cardinality cap, hot tenants on a cluster, deadlines.
//! - `contract`: one suite run against every store (the reference design's worked outcomes, replay,
//!   tightening, refused faults).
//! - `differential`: random sequences through the pure core, the in-process store and the scripts.
//! - `redis`: what only Redis has: `NOSCRIPT`, contention between connections, the server clock,
//!   the script's own argument validation, a cluster.

mod client;
mod contract;
mod differential;
mod harness;
mod redis;
