//! A client for Allot's region agent, for Rust services that no gateway in front of them limits.
//!
//! - [`AgentClient`]: one typed method per endpoint of the agent's gateway API (`admit`, `check`,
//!   `release`, `renew`, `settle`, `quota`), each bounded in time and attempts; a call that gets no
//!   answer is retried with the same body, so an admission keeps its request id.
//! - [`AllotLayer`]: a tower layer for axum or hyper services. It admits each request before the
//!   service sees it, answers refusals with the agent's 429 or 503 problem+json and `Retry-After`,
//!   adds the `RateLimit` fields the caller may see, and when the response ends gives back the
//!   request's concurrency slots and settles its metered cost. Without a decision it fails as
//!   told ([`FailMode`], closed by default).
//!
//! The wire types are Allot's own ([`allot_shared::contract`]), re-exported here.
//!
//! ```no_run
//! use allot_client::{Admission, AgentClient, AllotLayer, Principal, PrincipalType, RouteGroup, TenantId};
//!
//! # fn main() -> Result<(), allot_client::ClientError> {
//! let client = AgentClient::builder("https://agent.eu.internal:7701", "gateway-token")
//!     .ca_file("/etc/allot/ca.pem")
//!     .build()?;
//! // Identity from what the service's own authentication verified (here an extension it set).
//! let layer = AllotLayer::new(client, |parts: &http::request::Parts| {
//!     let user = parts.extensions.get::<VerifiedUser>()?;
//!     Some(Admission::new(
//!         TenantId::parse(&user.tenant).ok()?,
//!         Principal { kind: PrincipalType::User, id: user.id.clone(), api_key_id: None },
//!         RouteGroup::parse("read").ok()?,
//!     ))
//! });
//! # let _ = layer;
//! # Ok(())
//! # }
//! # #[derive(Clone)] struct VerifiedUser { tenant: String, id: String }
//! ```

mod body;
mod client;
mod layer;

pub use allot_shared::contract::{
    AdmissionRequest, Decision, Principal, PrincipalType, Problem, QuotaQuery, QuotaStatus,
    SettleAnswer, SettleRequest, SlotRenewal,
};
pub use allot_shared::ids::{DecisionId, RouteGroup, TenantId};
pub use body::{AllotBody, COMPLETION_FAILURES, Completion, MeteredCost};
pub use client::{
    AgentClient, Checked, ClientBuilder, ClientError, DEFAULT_CALL_TIMEOUT, DEFAULT_MAX_ATTEMPTS,
    DEFAULT_RETRY_BACKOFF, MAX_ATTEMPTS, MAX_CALL_TIMEOUT, RETRIES,
};
pub use layer::{Admission, Allot, AllotLayer, FailMode, UNDECIDED};
