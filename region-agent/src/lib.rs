//! The region agent.
//!
//! Gateways call it for every request. It will spend leased global quota locally, run the region's
//! per-user, per-route and per-tenant rules on Redis, and fall back to a bounded allowance when the
//! allocator is unreachable. The decision arithmetic it relies on is pure and lives in `allot_shared`.
//!
//! ## Map
//! - [`clock`]: the agent's only reader of the OS clock (wall and monotonic).
//! - [`global`]: the global tier: leases of allocator pools held and spent in memory, renewals sized
//!   by demand, the bounded fallback allowance, and what is owed to the ledger.
//! - [`grpc`]: Envoy's rate limit service (v3) over gRPC, from Allot's own wire-compatible proto
//!   subset; the descriptor mapping and `failure_mode_deny` semantics are documented there.
//! - [`limiter`]: the regional limiter: one atomic store call decides every regional rule of a request
//!   (Lua scripts on Redis, or the in-process store that behaves identically), and the client path
//!   around it (`limiter::Limiter`: deadlines, breakers, fail modes, negative cache, hot tenants,
//!   cardinality caps).
//!
//! Architecture invariant: this crate never depends on `allot-allocator`.

pub mod allocator_client;
pub mod clock;
pub mod config;
pub mod decision_log;
pub mod global;
pub mod grpc;
pub mod http;
pub mod limiter;
pub mod metrics;
pub mod service;
pub mod state_dir;
pub mod visibility;
