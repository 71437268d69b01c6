//! The allocator's integration tests, one module per capability, in one binary: a binary per
//! file compiled and linked the allocator's dependencies again for each of them.

mod common;

mod access;
mod api;
mod cli;
mod console;
mod election;
mod etcd_housekeeping;
mod failover;
mod grants;
mod hostile;
mod kv_contract;
mod ledger;
mod openapi;
mod overrides;
mod webhooks;
