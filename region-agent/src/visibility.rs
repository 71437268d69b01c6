//! What a caller may be told about its limits, on every surface (HTTP `RateLimit` fields, Envoy RLS
//! descriptor statuses): the rule a decision names, only when the rule is visible to the caller
//! ([`Rule::visible_to`](allot_shared::policy::Rule::visible_to): an authenticated caller, and a rule
//! of its own scope unless the rule's `expose` says otherwise). An admission names its most
//! constraining rule, which can be the tenant's: unless exposed, it is not shown either. A global
//! rule (shown only when it says `"expose": true`) shows its pool's figures as `GET /v1/quota`
//! does: the pool's limit, what is left of it, and the pool's window, once the agent holds the
//! pool.

use allot_shared::contract::{
    AdvisoryMode, Decision, PrincipalType, QuotaView, Reason, rate_limit_fields, retry_after_header,
};
use allot_shared::ids::PoolId;
use allot_shared::limit::multi::Algorithm;
use allot_shared::policy::{Limit, PolicyBundle};

/// The rule `decision` names as the caller may see it, or `None`. A token bucket has no window, so
/// the view's window is its time to refill from empty: an approximation the RateLimit header draft
/// allows. The reset (`t`) is the retry hint of a denial; a request that will not be admitted again
/// soon (none left after an admission, or a denial with no hint, such as `COST_TOO_HIGH`) says the
/// whole window, the most it may wait, never `t=0`. An outage has no view (see
/// [`rate_limit_headers`]). `pool_window_ms` is the window of a pool of the caller's tenant, when
/// the agent holds it.
pub fn caller_view(
    bundle: &PolicyBundle,
    caller: PrincipalType,
    decision: &Decision,
    pool_window_ms: &dyn Fn(&PoolId) -> Option<u64>,
) -> Option<QuotaView> {
    let rule_id = decision.policy_id.as_deref()?;
    let rule = bundle.rules().iter().find(|r| r.id.as_str() == rule_id)?;
    if !rule.visible_to(caller) {
        return None;
    }
    let window_ms = match &rule.limit {
        Limit::Regional(algorithm) => window_ms(algorithm),
        // The decision carries the pool's figures when a global rule decided it; without them
        // (a denial before the pool was held) there is nothing true to show.
        Limit::Global(pool) if decision.limit_units > 0 => pool_window_ms(pool)?,
        Limit::Global(_) => return None,
    };
    let window_seconds = window_ms.div_ceil(1_000).max(1);
    Some(QuotaView {
        policy_name: rule_id.to_owned(),
        quota_units: decision.limit_units,
        window_seconds,
        remaining_units: decision.remaining_units,
        reset_seconds: reset_seconds(decision, window_seconds),
    })
}

/// Seconds until `decision`'s caller may expect more quota, for the `t` parameter.
fn reset_seconds(decision: &Decision, window_seconds: u64) -> u64 {
    match retry_after_header(decision) {
        Some(seconds) => seconds,
        None if decision.allowed && decision.remaining_units > 0 => 0,
        None => window_seconds,
    }
}

/// The `RateLimit-Policy` and `RateLimit` field values for `decision`, as the caller may see them
/// (each `None` to send no field). An outage (`LIMITER_UNAVAILABLE`, `POLICY_ERROR`) knows the
/// policy but not what is left of it: it sends the policy alone, never a made-up `r=0`.
pub fn rate_limit_headers(
    bundle: &PolicyBundle,
    caller: PrincipalType,
    decision: &Decision,
    pool_window_ms: &dyn Fn(&PoolId) -> Option<u64>,
) -> (Option<String>, Option<String>) {
    let Some(view) = caller_view(bundle, caller, decision, pool_window_ms) else {
        return (None, None);
    };
    let (policy, current) = rate_limit_fields(&view);
    let outage = !decision.allowed
        && matches!(
            decision.reason,
            Some(Reason::LimiterUnavailable | Reason::PolicyError)
        );
    (Some(policy), (!outage).then_some(current))
}

/// The header a soft rule's violation is flagged to the caller in (HTTP `/v1/check`, Envoy's
/// `response_headers_to_add`).
pub const SOFT_LIMIT_HEADER: &str = "x-allot-soft-limit-exceeded";
/// The header a shadow rule's would-be denial is told to the gateway in (HTTP `/v1/check`) and to
/// the upstream service (Envoy's `request_headers_to_add`), never to the caller.
pub const SHADOW_DENIED_HEADER: &str = "x-allot-shadow-denied";

/// The headers that say which shadow and soft rules would have denied `decision`:
/// [`SOFT_LIMIT_HEADER`] with the soft rules the caller may see (Structured Fields strings), or
/// `?1` when it may see none of them; [`SHADOW_DENIED_HEADER`] with the shadow rules' ids (for
/// the gateway's own logs). Each is absent when no such rule would have denied.
pub fn violation_headers(
    bundle: &PolicyBundle,
    caller: PrincipalType,
    decision: &Decision,
) -> (Option<String>, Option<String>) {
    let named = |mode: AdvisoryMode| {
        decision
            .violations
            .iter()
            .filter(move |v| v.mode == mode)
            .map(|v| v.policy_id.as_str())
    };
    let soft = named(AdvisoryMode::Soft).next().map(|_| {
        let visible: Vec<String> = named(AdvisoryMode::Soft)
            .filter(|id| {
                bundle
                    .rules()
                    .iter()
                    .any(|rule| rule.id.as_str() == *id && rule.visible_to(caller))
            })
            .map(|id| format!("\"{id}\""))
            .collect();
        if visible.is_empty() {
            "?1".to_owned()
        } else {
            visible.join(", ")
        }
    });
    let shadow = named(AdvisoryMode::Shadow)
        .next()
        .map(|_| named(AdvisoryMode::Shadow).collect::<Vec<_>>().join(", "));
    (soft, shadow)
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
