//! How Allot's servers face the network.
//!
//! The allocator and the region agent serve HTTP (and the agent gRPC) to callers they do not control,
//! so both need the same two things, kept here once:
//! - [`tls`]: rustls server configs from PEM files (optionally requiring client certificates signed
//!   by a given CA: mutual TLS), and the matching client settings for `reqwest`;
//! - [`listen`]: where a server listens, a TCP address or a Unix domain socket;
//! - [`mod@serve`]: an accept loop with a bound on everything a client can hold open (I10): connections,
//!   the TLS handshake, the time to send the first bytes and request headers (slow and silent
//!   clients are cut off), idle connections, and a graceful shutdown with a deadline;
//! - [`problem`]: every error a client sees as problem+json, including those layers answer;
//! - [`router`]: the bounds every router gets (body size, concurrency, request time);
//! - [`deadline`]: request deadlines on a coarse shared tick, not a timer per request;
//! - [`mod@metrics`]: the process-wide Prometheus recorder, set up once.
//!
//! Architecture invariant: this crate depends on nothing of ours; it knows no Allot type.

pub mod deadline;
pub mod listen;
pub mod metrics;
pub mod problem;
pub mod router;
pub mod serve;
pub mod tls;

pub use deadline::{CoarseDeadlines, DeadlinePassed};
pub use listen::{Accepted, ListenAddr, Listener};
pub use problem::problem_for_plain_errors;
pub use router::{RouterLimits, bounded_router};
pub use serve::{PROBE_PATHS, ServeLimits, serve};
pub use tls::{ClientTls, ServerTls, TlsError, TlsServing};
