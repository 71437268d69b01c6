//! What a caller may be told about its limits, on every surface (HTTP `RateLimit` fields, Envoy RLS
//! descriptor statuses): the rule a decision names, only when the rule is visible to the caller
//! ([`Rule::visible_to`](allot_shared::policy::Rule::visible_to): an authenticated caller, and a rule
//! of its own scope unless the rule's `expose` says otherwise). An admission names its most
//! constraining rule, which can be the tenant's: unless exposed, it is not shown either. A global
//! rule's pool is not shown in headers (its window is the allocator's); `GET /v1/quota` shows it.

use allot_shared::contract::{Decision, PrincipalType, QuotaView, retry_after_header};
use allot_shared::limit::multi::Algorithm;
use allot_shared::policy::{Limit, PolicyBundle};

/// The rule `decision` names as the caller may see it, or `None`. A token bucket has no window, so
/// the view's window is its time to refill from empty: an approximation the RateLimit header draft
/// allows.
pub fn caller_view(
    bundle: &PolicyBundle,
    caller: PrincipalType,
    decision: &Decision,
) -> Option<QuotaView> {
    let rule_id = decision.policy_id.as_deref()?;
    let rule = bundle.rules().iter().find(|r| r.id.as_str() == rule_id)?;
    if !rule.visible_to(caller) {
        return None;
    }
    let Limit::Regional(algorithm) = &rule.limit else {
        return None;
    };
    Some(QuotaView {
        policy_name: rule_id.to_owned(),
        quota_units: decision.limit_units,
        window_seconds: window_ms(algorithm).div_ceil(1_000).max(1),
        remaining_units: decision.remaining_units,
        reset_seconds: retry_after_header(decision).unwrap_or(0),
    })
}

/// The window a quota of `algorithm` is stated over, ms: a window algorithm's window; a rate
/// algorithm's time to refill from empty.
pub fn window_ms(algorithm: &Algorithm) -> u64 {
    match algorithm {
        Algorithm::TokenBucket(b) => b.full_refill_ms(),
        Algorithm::Gcra(g) => g.burst_tolerance_ms(),
        Algorithm::FixedWindow(w) => w.window_ms(),
        Algorithm::SlidingCounter(c) => c.window_ms(),
        Algorithm::SlidingLog(l) => l.window_ms(),
    }
}
