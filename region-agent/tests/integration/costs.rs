//! What a request costs. The seed: `costHint` is "in cost units; policy may override by route
//! group". A rule that states its cost (`costMillis`) charges it whatever the hint says; a rule that
//! states none charges the caller's hint (1,000 millitokens a unit); a rule may instead declare
//! `chargesCostHint: true` to charge its stated cost per unit of the hint (token-metered APIs: the
//! gateway sends the request's tokens as the hint).

use std::sync::Arc;

use allot_region_agent::clock::SystemClock;
use allot_shared::contract::{AdmissionRequest, Principal, PrincipalType};
use allot_shared::ids::{DecisionId, RouteGroup, TenantId};

use crate::common;

/// Three per-user windows of 100 units an hour, one per route group, each costed its own way.
const BUNDLE: &str = r#"{ "rules": [
    { "id": "stated", "scope": "user", "routeGroup": "search", "algorithm": "fixed_window",
      "limit": 100, "windowMs": 3600000, "costMillis": 5000, "failMode": "closed" },
    { "id": "hinted", "scope": "user", "routeGroup": "read", "algorithm": "fixed_window",
      "limit": 100, "windowMs": 3600000, "failMode": "closed" },
    { "id": "metered", "scope": "user", "routeGroup": "complete", "algorithm": "fixed_window",
      "limit": 100, "windowMs": 3600000, "costMillis": 2000, "chargesCostHint": true,
      "failMode": "closed" } ] }"#;

fn request(n: u64, route: &str, cost_hint: u64) -> AdmissionRequest {
    AdmissionRequest {
        request_id: DecisionId::parse(&format!("c-{n}")).expect("id"),
        tenant_id: TenantId::parse("atlas").expect("tenant"),
        principal: Principal {
            kind: PrincipalType::User,
            id: "U-17".to_owned(),
            api_key_id: None,
        },
        route_group: RouteGroup::parse(route).expect("route"),
        method: "POST".to_owned(),
        cost_hint,
        policy_epoch: None,
        dry_run: false,
        metered: false,
    }
}

#[tokio::test]
async fn a_stated_cost_is_charged_and_a_rule_may_charge_the_callers_hint_instead() {
    let agent = common::agent(
        common::settings(),
        Arc::new(SystemClock),
        None,
        Some(common::bundle(BUNDLE)),
    );
    let remaining = async |n: u64, route: &str, hint: u64| {
        let decision = agent
            .admit(&request(n, route, hint))
            .await
            .expect("decision");
        assert!(decision.allowed, "{decision:?}");
        decision.remaining_units
    };
    // The rule states 5 units: a hint of 7 does not change it.
    assert_eq!(remaining(1, "search", 7).await, 95);
    assert_eq!(remaining(2, "search", 1).await, 90);
    // No stated cost: the caller's hint is the cost.
    assert_eq!(remaining(3, "read", 7).await, 93);
    assert_eq!(remaining(4, "read", 1).await, 92);
    // Declared per unit of the hint: 2 units x 7.
    assert_eq!(remaining(5, "complete", 7).await, 86);
    assert_eq!(remaining(6, "complete", 1).await, 84);
    // A metered request larger than what is left is denied, and debits nothing.
    let big = agent
        .admit(&request(7, "complete", 50))
        .await
        .expect("decision");
    assert!(!big.allowed);
    assert_eq!(remaining(8, "complete", 1).await, 82);
}

#[test]
fn the_canonical_form_states_which_cost_a_rule_charges() {
    let bundle = common::bundle(BUNDLE);
    let charges: Vec<(String, bool)> = bundle
        .rules()
        .iter()
        .map(|rule| {
            (
                rule.id.to_string(),
                rule.to_json()["chargesCostHint"] == true,
            )
        })
        .collect();
    assert_eq!(
        charges,
        [
            ("stated".to_owned(), false),
            ("hinted".to_owned(), true),
            ("metered".to_owned(), true)
        ]
    );
    let text = BUNDLE.replace(r#""chargesCostHint": true"#, r#""chargesCostHint": "yes""#);
    let error = allot_shared::policy::parse_bundle(&text).expect_err("not a boolean");
    assert_eq!(error.field, "rules[2].chargesCostHint");
}

/// A cost no state of a rule could admit is the client's error, known from the bundle alone: 429
/// `COST_TOO_HIGH`, never to be retried, naming the rule, and nothing is spent. The largest hint a
/// request may carry (2^30) included, whose cost the store would refuse as an argument (once a 503
/// `POLICY_ERROR` that paged on-call).
#[tokio::test]
async fn a_cost_no_rule_could_ever_admit_is_refused_as_too_high_whatever_the_hint() {
    use allot_shared::contract::{Reason, http_status};
    let agent = common::agent(
        common::settings(),
        Arc::new(SystemClock),
        None,
        Some(common::bundle(BUNDLE)),
    );
    let cases = [
        ("read", 101),
        ("complete", 51),
        ("read", 1 << 30),
        ("complete", 1 << 30),
    ];
    for (n, (route, hint)) in (0u64..).zip(cases) {
        let decision = agent
            .admit(&request(100 + n, route, hint))
            .await
            .expect("decision");
        assert!(!decision.allowed, "{route} x {hint}: {decision:?}");
        assert_eq!(decision.reason, Some(Reason::CostTooHigh), "{decision:?}");
        assert_eq!(http_status(&decision), 429);
        assert_eq!(decision.retry_after_ms, -1, "never admissible as it is");
        assert_eq!(decision.limit_units, 100, "{decision:?}");
        assert!(decision.policy_id.is_some(), "names the rule: {decision:?}");
    }
    // Nothing was spent: the whole window is left for what fits.
    let fits = agent
        .admit(&request(200, "complete", 50))
        .await
        .expect("decision");
    assert!(fits.allowed && fits.remaining_units == 0, "{fits:?}");
}
