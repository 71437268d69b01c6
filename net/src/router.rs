//! The bounds every router of ours gets (I10), in one place: the body size, how many requests run
//! at once (the rest wait for a place), how long one may take, its wait for a place included (then
//! 503), and problem+json for what those layers answer on their own.

use std::time::Duration;

use axum::Router;
use axum::extract::DefaultBodyLimit;

/// A router's bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RouterLimits {
    /// Largest request body, bytes (past it: 413).
    pub max_body_bytes: usize,
    /// Most requests served at once, over every route together.
    pub max_concurrent_requests: usize,
    /// Longest a request may take (past it: 503).
    pub request_timeout: Duration,
}

/// `router` with `limits`. The concurrency limit is one for the whole router (a per-route limit
/// would multiply it by the routes).
pub fn bounded_router<S>(router: Router<S>, limits: RouterLimits) -> Router<S>
where
    S: Clone + Send + Sync + 'static,
{
    // One stack, applied once: each `Router::layer` call boxes every route again, a box cloned and
    // a future boxed per layer and request. Listed outermost first.
    let stack = tower::ServiceBuilder::new()
        // Outermost, so body-limit and timeout answers are problem+json too.
        .layer(axum::middleware::map_response(
            crate::problem::problem_for_plain_errors,
        ))
        // Not a timer per request: see `deadline`.
        .layer(crate::deadline::DeadlineLayer::new(limits.request_timeout))
        .layer(tower::limit::GlobalConcurrencyLimitLayer::new(
            limits.max_concurrent_requests,
        ))
        .layer(DefaultBodyLimit::max(limits.max_body_bytes));
    router.layer(stack)
}
