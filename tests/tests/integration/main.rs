//! Allot's whole-system tests: real allocators, agents, etcd, Redis, nginx and a browser, one
//! module per scenario, in one binary (a binary per file compiled and linked everything again for
//! each of them).

mod stack;
mod topology;

mod agents_per_region;
mod architecture;
mod console;
mod harness;
mod nginx;
mod northstar_trace;
mod overrides;
mod partition;
mod quota_products;
mod real_drill;
mod rlqs;
mod shards;
mod soak;
mod tls;
mod two_regions;
