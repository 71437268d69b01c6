//! The home-region allocator.
//!
//! It owns each tenant pool's global quota per window and hands regions chunks of it as leases. The grant
//! arithmetic is pure and lives in `allot_shared::lease`; this crate adds what makes it safe to run as a
//! service: state in etcd behind the [`kv::Kv`] seam, leadership with a strictly increasing epoch that
//! fences off a deposed leader, per-pool serialised grants committed in groups, and the HTTP API.
//!
//! Architecture invariant: this crate never depends on `allot-region-agent`.

pub mod auth;
pub mod clock;
pub mod console;
pub mod ctl;
pub mod etcd_upkeep;
pub mod grants;
pub mod http;
pub mod kv;
pub mod leader;
pub mod ledger;
pub mod ledger_sync;
pub mod metrics;
pub mod overrides;
pub mod policies;
pub mod pools;
pub mod server;
pub mod webhooks;
