//! The region agent's integration tests, one module per capability, in one binary: a binary
//! per file compiled and linked the agent's dependencies again for each of them.

mod common;

mod advisory_rules;
mod busy_pools;
mod cardinality;
mod checks_and_quotas;
mod concurrency;
mod costs;
mod decision_log;
mod envoy_rls;
mod gateway_http;
mod grpc;
mod holder;
mod hostile;
mod metered;
mod openapi;
mod policy_changes;
mod pool_terms;
mod pre_auth;
mod redis_tls;
mod reservations;
mod retries;
mod rlqs;
mod state_dir;
mod strict_max_age;
mod sublease;
mod unix_sockets;
