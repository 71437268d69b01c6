//! The home-region allocator.
//!
//! It owns each tenant pool's global quota per window and hands regions chunks of it as leases. The grant
//! arithmetic itself is pure and lives in `allot_shared::lease`; this crate will hold the etcd-backed
//! store, leadership and epoch fencing, the operator HTTP API and the SQL ledger around it.
//!
//! Architecture invariant: this crate never depends on `allot-region-agent`.
