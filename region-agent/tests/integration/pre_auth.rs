//! Pre-authentication traffic (principal `ip`: the gateway has not verified who is calling) spends
//! only its own per-address buckets. It never debits a tenant's, a route's or a global budget unless
//! a rule explicitly targets `principalType: ip`: an unverified caller cannot drain what the
//! tenant's real users share.

use std::sync::Arc;

use allot_region_agent::clock::SystemClock;
use allot_shared::contract::{AdmissionRequest, DeniedScope, Principal, PrincipalType};
use allot_shared::ids::{DecisionId, RouteGroup, TenantId};

use crate::common;

const BUNDLE: &str = r#"{ "rules": [
    { "id": "anon", "scope": "user", "principalType": "ip", "algorithm": "fixed_window",
      "limit": 100, "windowMs": 3600000, "failMode": "closed" },
    { "id": "tenant-all", "scope": "tenant", "algorithm": "fixed_window",
      "limit": 5, "windowMs": 3600000, "failMode": "closed" },
    { "id": "login-anon-route", "scope": "route", "routeGroup": "login", "principalType": "ip",
      "algorithm": "fixed_window", "limit": 3, "windowMs": 3600000, "failMode": "closed" },
    { "id": "global-api", "scope": "global", "pool": "api", "failMode": "closed" } ] }"#;

fn request(n: u64, kind: PrincipalType, who: &str, route: &str) -> AdmissionRequest {
    AdmissionRequest {
        request_id: DecisionId::parse(&format!("a-{n}")).expect("id"),
        tenant_id: TenantId::parse("atlas").expect("tenant"),
        principal: Principal {
            kind,
            id: who.to_owned(),
            api_key_id: None,
        },
        route_group: RouteGroup::parse(route).expect("route"),
        method: "GET".to_owned(),
        cost_hint: 1,
        policy_epoch: None,
        dry_run: false,
        metered: false,
    }
}

#[tokio::test]
async fn unauthenticated_callers_never_spend_the_tenants_shared_budgets_by_default() {
    // No allocator: a global rule that applied would fail closed, so every admit below also shows
    // that the global pool was not consulted for `ip` callers.
    let agent = common::agent(
        common::settings(),
        Arc::new(SystemClock),
        None,
        Some(common::bundle(BUNDLE)),
    );
    for n in 0..20 {
        let decision = agent
            .admit(&request(n, PrincipalType::Ip, "203.0.113.9", "read"))
            .await
            .expect("decision");
        assert!(decision.allowed, "{decision:?}");
        assert_eq!(decision.policy_id.as_deref(), Some("anon"));
    }
    // The tenant's window of 5 is untouched: a verified user's request sees all of it. (It is
    // denied by the global rule, which needs an allocator: proof that it applies to users.)
    let user = agent
        .admit(&request(100, PrincipalType::User, "U-17", "read"))
        .await
        .expect("decision");
    assert_eq!(user.denied_scope, Some(DeniedScope::Global), "{user:?}");

    // A rule that targets `principalType: ip` explicitly does apply: the login route's budget of 3
    // for anonymous callers.
    let mut admitted = 0;
    for n in 0..6 {
        let decision = agent
            .admit(&request(
                200 + n,
                PrincipalType::Ip,
                "198.51.100.7",
                "login",
            ))
            .await
            .expect("decision");
        if decision.allowed {
            admitted += 1;
        } else {
            assert_eq!(
                decision.policy_id.as_deref(),
                Some("login-anon-route"),
                "{decision:?}"
            );
            assert_eq!(decision.denied_scope, Some(DeniedScope::Route));
        }
    }
    assert_eq!(admitted, 3);
}

#[test]
fn which_rules_apply_to_an_unauthenticated_caller() {
    let bundle = common::bundle(BUNDLE);
    let atlas = TenantId::parse("atlas").expect("tenant");
    let ids = |kind: PrincipalType, route: &str| -> Vec<String> {
        let route = RouteGroup::parse(route).expect("route");
        bundle
            .regional_rules_for(&atlas, &route, kind)
            .into_iter()
            .chain(bundle.global_rules_for(&atlas, &route, kind))
            .map(|rule| rule.id.to_string())
            .collect()
    };
    assert_eq!(ids(PrincipalType::Ip, "read"), ["anon"]);
    assert_eq!(
        ids(PrincipalType::Ip, "login"),
        ["anon", "login-anon-route"]
    );
    assert_eq!(
        ids(PrincipalType::User, "read"),
        ["tenant-all", "global-api"]
    );
    assert_eq!(
        ids(PrincipalType::ApiKey, "login"),
        ["tenant-all", "global-api"]
    );
}

/// Two addresses of one `/24` each get their own `ip` limit when the agent keys at /32 (its
/// default), and share one when it keys at /24 (`--ip-prefix-v4 24`).
#[tokio::test]
async fn the_agents_prefix_length_decides_which_addresses_share_a_limit() {
    const ANON_TWO: &str = r#"{ "rules": [
        { "id": "anon", "scope": "user", "principalType": "ip", "algorithm": "fixed_window",
          "limit": 2, "windowMs": 3600000, "failMode": "closed" } ] }"#;
    for (v4_bits, admitted_together) in [(32, 4), (24, 2)] {
        let mut settings = common::settings();
        settings.ip_prefixes.v4_bits = v4_bits;
        let agent = common::agent(
            settings,
            Arc::new(SystemClock),
            None,
            Some(common::bundle(ANON_TWO)),
        );
        let mut admitted = 0;
        for n in 0..6 {
            let address = if n % 2 == 0 {
                "198.51.100.7"
            } else {
                "198.51.100.200"
            };
            let decision = agent
                .admit(&request(n, PrincipalType::Ip, address, "read"))
                .await
                .expect("decision");
            admitted += u64::from(decision.allowed);
        }
        assert_eq!(admitted, admitted_together, "keyed at /{v4_bits}");
    }
}

/// A rule's own prefix length keys it apart: a narrow per-address limit under a broader ceiling
/// over the whole `/24` (and the `/48` of IPv6), as the reference design advises where abuse is
/// the concern. One host rotating through its /24 meets the ceiling; each address meets its own.
#[tokio::test]
async fn a_rule_over_a_broader_prefix_is_a_ceiling_over_the_narrow_one() {
    const NARROW_AND_CEILING: &str = r#"{ "rules": [
        { "id": "anon-address", "scope": "user", "principalType": "ip", "algorithm": "fixed_window",
          "limit": 3, "windowMs": 3600000, "failMode": "closed" },
        { "id": "anon-block", "scope": "user", "principalType": "ip", "algorithm": "fixed_window",
          "limit": 5, "windowMs": 3600000, "failMode": "closed",
          "ipPrefixV4": 24, "ipPrefixV6": 48 } ] }"#;
    let agent = common::agent(
        common::settings(),
        Arc::new(SystemClock),
        None,
        Some(common::bundle(NARROW_AND_CEILING)),
    );
    let mut denied_by = Vec::new();
    for n in 0..8 {
        let decision = agent
            .admit(&request(n, PrincipalType::Ip, "198.51.100.7", "read"))
            .await
            .expect("decision");
        if !decision.allowed {
            denied_by.push(decision.policy_id.clone().unwrap_or_default());
        }
    }
    assert_eq!(denied_by.len(), 5, "the address's own 3: {denied_by:?}");
    assert!(denied_by.iter().all(|rule| rule == "anon-address"));
    // Fresh addresses of the same /24: the block has 2 of its 5 left.
    let mut admitted = 0;
    for n in 0..6 {
        let decision = agent
            .admit(&request(
                100 + n,
                PrincipalType::Ip,
                &format!("198.51.100.{}", 10 + n),
                "read",
            ))
            .await
            .expect("decision");
        if decision.allowed {
            admitted += 1;
        } else {
            assert_eq!(
                decision.policy_id.as_deref(),
                Some("anon-block"),
                "{decision:?}"
            );
        }
    }
    assert_eq!(admitted, 2, "the ceiling caps the whole /24");
    // Another /24 is another block.
    let other = agent
        .admit(&request(200, PrincipalType::Ip, "198.51.101.1", "read"))
        .await
        .expect("decision");
    assert!(other.allowed, "{other:?}");
    // IPv6: the ceiling is the /48, the narrow limit the agent's /64.
    let mut v6_admitted = 0;
    for n in 0..7 {
        let address = format!("2001:db8:7:{n:x}::1");
        let decision = agent
            .admit(&request(300 + n, PrincipalType::Ip, &address, "read"))
            .await
            .expect("decision");
        v6_admitted += u64::from(decision.allowed);
    }
    assert_eq!(v6_admitted, 5, "seven /64s of one /48 share its ceiling");
}

/// A gateway's pseudo-tenant of unauthenticated traffic (`edge`) given with `--hot-tenant edge=4`
/// spreads its keys over four hash tags (four Cluster slots) instead of one, and an address's own
/// bucket stays whole: it lives in one sub-slot, chosen by the address's keyed hash.
#[tokio::test]
async fn a_hot_pseudo_tenant_spreads_pre_authentication_keys_and_keeps_each_addresss_bucket_whole()
{
    use allot_region_agent::config::AgentArgs;
    use allot_region_agent::limiter::LimiterConfig;
    use clap::Parser;

    let args = AgentArgs::try_parse_from([
        "region-agent",
        "--region",
        "eu",
        "--gateway-token-file",
        "/unused",
        "--pepper-file",
        "/unused",
        "--hot-tenant",
        "edge=4",
    ])
    .expect("flags");
    let hot_tenants = args.resolve().expect("valid").hot_tenants;
    let redis = allot_testkit::RedisServer::start();
    let agent = common::agent_on_redis(
        &redis,
        LimiterConfig {
            hot_tenants,
            ..LimiterConfig::default()
        },
        r#"{ "rules": [ { "id": "anon", "scope": "user", "principalType": "ip",
            "algorithm": "fixed_window", "limit": 3, "windowMs": 3600000,
            "failMode": "closed" } ] }"#,
    )
    .await;
    let edge = |n: u64, address: &str| AdmissionRequest {
        tenant_id: TenantId::parse("edge").expect("tenant"),
        ..request(n, PrincipalType::Ip, address, "read")
    };
    for n in 0..32 {
        let decision = agent
            .admit(&edge(n, &format!("198.51.100.{n}")))
            .await
            .expect("decision");
        assert!(decision.allowed, "{decision:?}");
    }
    let mut connection = redis::Client::open(redis.url())
        .expect("client")
        .get_multiplexed_async_connection()
        .await
        .expect("connection");
    let keys: Vec<String> = redis::cmd("KEYS")
        .arg("*")
        .query_async(&mut connection)
        .await
        .expect("keys");
    let tags: std::collections::BTreeSet<&str> = keys
        .iter()
        .filter_map(|key| Some(&key[key.find('{')?..=key.find('}')?]))
        .collect();
    assert_eq!(
        tags.into_iter().collect::<Vec<_>>(),
        ["{t:edge:0}", "{t:edge:1}", "{t:edge:2}", "{t:edge:3}"],
        "32 addresses over the four sub-slots, none in the plain tag: {keys:?}"
    );
    // One address's own limit of 3 is whole, not split four ways: two more, then denied.
    for n in 100..102 {
        let again = agent
            .admit(&edge(n, "198.51.100.7"))
            .await
            .expect("decision");
        assert!(again.allowed, "{again:?}");
    }
    let over = agent
        .admit(&edge(102, "198.51.100.7"))
        .await
        .expect("decision");
    assert!(!over.allowed, "{over:?}");
    assert_eq!(over.policy_id.as_deref(), Some("anon"));
}
