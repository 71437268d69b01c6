//! What a caller may be told about its limits, on every surface (HTTP `RateLimit` fields, Envoy RLS
//! descriptor statuses): the rule a decision names, only when the caller authenticated and the rule
//! is of the caller's own scope (`contract::caller_may_see`). An admission names its most
//! constraining rule, which can be the tenant's: it is not shown either.

use allot_shared::contract::{
    Decision, DeniedScope, PrincipalType, QuotaView, caller_may_see, retry_after_header,
};
use allot_shared::limit::multi::Algorithm;
use allot_shared::policy::{Limit, PolicyBundle};

/// The rule `decision` names as the caller may see it (its scope and its quota), or `None`. A token
/// bucket has no window, so the view's window is its time to refill from empty: an approximation
/// the RateLimit header draft allows.
pub fn caller_view(
    bundle: &PolicyBundle,
    caller: PrincipalType,
    decision: &Decision,
) -> Option<(DeniedScope, QuotaView)> {
    let rule_id = decision.policy_id.as_deref()?;
    let rule = bundle.rules().iter().find(|r| r.id.as_str() == rule_id)?;
    let scope = rule.scope.denied_scope();
    if !caller_may_see(caller, scope) {
        return None;
    }
    let window_ms = match &rule.limit {
        Limit::Regional(Algorithm::TokenBucket(b)) => b.full_refill_ms(),
        Limit::Regional(Algorithm::Gcra(g)) => g.burst_tolerance_ms(),
        Limit::Regional(Algorithm::FixedWindow(w)) => w.window_ms(),
        Limit::Regional(Algorithm::SlidingCounter(c)) => c.window_ms(),
        Limit::Regional(Algorithm::SlidingLog(l)) => l.window_ms(),
        Limit::Global(_) => return None,
    };
    Some((
        scope,
        QuotaView {
            policy_name: rule_id.to_owned(),
            quota_units: decision.limit_units,
            window_seconds: window_ms.div_ceil(1_000).max(1),
            remaining_units: decision.remaining_units,
            reset_seconds: retry_after_header(decision).unwrap_or(0),
        },
    ))
}
