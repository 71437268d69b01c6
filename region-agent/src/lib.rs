//! The region agent.
//!
//! Gateways call it for every request. It will spend leased global quota locally, run the region's
//! per-user, per-route and per-tenant rules on Redis, and fall back to a bounded allowance when the
//! allocator is unreachable. The decision arithmetic it relies on is pure and lives in `allot_shared`.
//!
//! Architecture invariant: this crate never depends on `allot-allocator`.
