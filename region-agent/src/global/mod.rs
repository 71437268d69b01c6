//! The global tier: leased chunks of an allocator pool, spent locally.
//!
//! Global (cross-tenant or cross-region) budgets cannot share a script with a tenant's regional keys,
//! so the agent holds leases of them and spends those in memory: no network call on the request path.
//! [`holder`] is the per-pool state machine (reserve, commit or cancel, renew, fall back, report);
//! [`pool_agent`] the lease loop around it, written once, that the agent service, the drills and
//! the model checker all run; [`tallies`] the per-window amounts a pool reports beside its leases;
//! [`driver`] the protocol's steps on it (a renewal started and finished), which the agent service
//! (`crate::service`, with the allocator client, its clock and its reachability) and the drills
//! both take; [`terms`] what a pool's terms become in one agent (its share of the region's
//! allowances, the margins); [`clock_offset`] what a grant exchange says of the agent's clock
//! against the allocator's.

pub mod clock_offset;
pub mod driver;
pub mod holder;
pub mod pool_agent;
pub mod sublease;
pub mod tallies;
pub mod terms;

pub use holder::{
    DebtCharge, Denial, FallbackLine, GrantVerdict, HeldLease, HolderConfig, HolderSnapshot,
    JournaledFallback, JournaledLease, LeaseGrant, LeaseLine, PendingReport, PoolHolder, Refusal,
    Reservation, Spend,
};
pub use pool_agent::{GrantCall, PoolAgent, PoolJournal, PoolReport};
