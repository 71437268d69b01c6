//! The region agent.
//!
//! Gateways call it for every request. It spends leased global quota locally, runs the region's
//! per-user, per-route and per-tenant rules on Redis in one atomic call, and falls back to a bounded
//! allowance when the allocator is unreachable; a denial anywhere debits nothing anywhere. The
//! decision arithmetic it relies on is pure and lives in `allot_shared`.
//!
//! ## Map
//! - [`service`]: the agent itself, a module per job: the request path (refusals from memory, global
//!   reservations, regional rules, settle), the pools held, renewals, reports, persistence and the
//!   background loops.
//! - [`http`]: the gateway API; [`grpc`]: Envoy's rate limit service (v3) over gRPC, from Allot's own
//!   wire-compatible proto subset; [`rlqs`]: Envoy's rate limit quota service, assignments carved
//!   from what the agent holds for gateways that decide themselves; [`visibility`]: what a caller
//!   may be told of its limits.
//! - [`global`]: the global tier: leases of allocator pools held and spent in memory, renewals sized
//!   by demand, the bounded fallback allowance, and what is owed to the ledger.
//! - [`limiter`]: the regional limiter: one atomic store call decides every regional rule of a request
//!   (Lua scripts on Redis, or the in-process store that behaves identically), and the client path
//!   around it (`limiter::Limiter`: deadlines, breakers, fail modes, negative cache, hot tenants,
//!   cardinality caps).
//! - [`allocator_client`]: the allocator client; [`state_dir`]: the state directory's files;
//!   [`decision_log`]: the sampled decision log; [`config`], [`metrics`], [`clock`].
//!
//! Architecture invariant: this crate never depends on `allot-allocator`.

pub mod allocator_client;
pub mod clock;
pub mod config;
pub mod decision_log;
pub mod envoy;
pub mod global;
pub mod grpc;
pub mod http;
pub mod limiter;
pub mod metrics;
pub mod openapi;
pub mod rlqs;
pub mod server;
pub mod service;
pub mod state_dir;
pub mod visibility;
