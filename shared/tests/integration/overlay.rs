//! Overrides laid over a bundle: a tenant's or one principal's amounts of a regional rule, and
//! nobody else's; what cannot be laid is said, and changes nothing.

use allot_shared::contract::PrincipalType;
use allot_shared::ids::{RecordId, RuleId, TenantId};
use allot_shared::keys::PrincipalHash;
use allot_shared::overrides::{OverridePrincipal, OverrideSet, RuleAmounts, RuleOverride};
use allot_shared::policy::Rule;

fn id(n: u64) -> RecordId {
    RecordId::from_parts(1_000 + n, u128::from(n))
}

const BUNDLE: &str = r#"{"bundleVersion": 4, "rules": [
    {"id": "read-user", "scope": "user", "routeGroup": "read", "algorithm": "token_bucket",
     "capacityMillis": 20000, "refillMillis": 2000, "periodMs": 1000, "failMode": "closed"},
    {"id": "tenant-all", "scope": "tenant", "algorithm": "fixed_window",
     "limit": 100, "windowMs": 60000, "failMode": "closed"},
    {"id": "global", "scope": "global", "pool": "api", "failMode": "closed"}
]}"#;

fn bundle() -> allot_shared::policy::PolicyBundle {
    allot_shared::policy::parse_bundle(BUNDLE)
        .expect("bundle")
        .into_file_bundle()
        .expect("sealed")
}

fn laid(n: u64, rule: &str, principal: Option<&str>, amounts: RuleAmounts) -> RuleOverride {
    RuleOverride {
        id: id(n),
        tenant: TenantId::parse("acme").expect("tenant"),
        rule: RuleId::parse(rule).expect("rule"),
        principal: principal.map(|hash| OverridePrincipal {
            kind: PrincipalType::User,
            hash: PrincipalHash::parse(hash).expect("hash"),
        }),
        amounts,
        expires_at_ms: Some(10_000 + n),
    }
}

fn limit(units: u64) -> RuleAmounts {
    RuleAmounts {
        limit: Some(units),
        ..RuleAmounts::default()
    }
}

fn capacity(millis: u64) -> RuleAmounts {
    RuleAmounts {
        capacity_millis: Some(millis),
        ..RuleAmounts::default()
    }
}

#[test]
fn overrides_change_the_tenants_or_the_principals_rule_and_nobody_elses() {
    use allot_shared::limit::multi::Algorithm;
    use allot_shared::policy::Limit;
    let acme = TenantId::parse("acme").expect("tenant");
    let other = TenantId::parse("other").expect("tenant");
    let read = allot_shared::ids::RouteGroup::parse("read").expect("group");
    let alice = PrincipalHash::parse("00000000000000aa").expect("hash");
    let bob = PrincipalHash::parse("00000000000000bb").expect("hash");
    let set = OverrideSet::seal(
        7,
        vec![
            laid(1, "tenant-all", None, limit(500)),
            laid(2, "read-user", Some("00000000000000aa"), capacity(90_000)),
            // Problems: an unknown rule, a global rule, amounts of another algorithm, a
            // principal on a tenant-wide rule, and a cost the rule could never admit.
            laid(3, "nope", None, limit(5)),
            laid(4, "global", None, limit(5)),
            laid(5, "read-user", None, limit(5)),
            laid(6, "tenant-all", Some("00000000000000bb"), limit(5)),
            laid(7, "tenant-all", None, limit(0)),
            // Laid before the principal's (whatever the ids): alice's starts from it.
            laid(
                8,
                "read-user",
                None,
                RuleAmounts {
                    refill_millis: Some(5_000),
                    ..RuleAmounts::default()
                },
            ),
        ],
    );
    let (laid_bundle, problems) = bundle().with_overrides(&set, 5_000);
    let failed: Vec<RecordId> = problems.iter().map(|p| p.id).collect();
    assert_eq!(
        failed,
        // Tenant-wide ones are laid first, then principals'.
        vec![id(3), id(4), id(5), id(7), id(6)],
        "{problems:?}"
    );
    assert_eq!(laid_bundle.overlay().len(), 3);
    assert_eq!(laid_bundle.overlay().version(), 7);
    assert_eq!(laid_bundle.overlay().next_expiry_ms(), Some(10_001));
    assert_eq!(
        laid_bundle.checksum(),
        bundle().checksum(),
        "content unchanged"
    );

    let window_limit = |rules: Vec<&Rule>, id: &str| {
        rules
            .into_iter()
            .find(|r| r.id.as_str() == id)
            .map(|r| match &r.limit {
                Limit::Regional(Algorithm::FixedWindow(w)) => w.limit_units(),
                Limit::Regional(Algorithm::TokenBucket(b)) => b.capacity_millitokens(),
                other => panic!("unexpected {other:?}"),
            })
    };
    let kind = PrincipalType::User;
    let acme_rules = laid_bundle.regional_rules_for(&acme, &read, kind);
    assert_eq!(window_limit(acme_rules.clone(), "tenant-all"), Some(500));
    let other_rules = laid_bundle.regional_rules_for(&other, &read, kind);
    assert_eq!(window_limit(other_rules, "tenant-all"), Some(100));
    let read_user = acme_rules[0];
    let for_alice = laid_bundle.rule_for_principal(read_user, &acme, kind, &alice);
    let for_bob = laid_bundle.rule_for_principal(read_user, &acme, kind, &bob);
    let as_key = laid_bundle.rule_for_principal(read_user, &acme, PrincipalType::ApiKey, &alice);
    assert_eq!(window_limit(vec![for_alice], "read-user"), Some(90_000));
    assert_eq!(window_limit(vec![for_bob], "read-user"), Some(20_000));
    assert_eq!(window_limit(vec![as_key], "read-user"), Some(20_000));
    assert_eq!(for_alice.to_json()["capacityMillis"], 90_000);
    assert_eq!(
        for_alice.to_json()["refillMillis"],
        5_000,
        "on top of the tenant's"
    );
    assert_eq!(read_user.to_json()["refillMillis"], 5_000);
    assert_eq!(read_user.to_json()["capacityMillis"], 20_000);
    assert_eq!(
        (for_alice.override_id, for_bob.override_id),
        (Some(id(2)), Some(id(8)))
    );

    // Past their end they are not laid.
    let (later, problems) = bundle().with_overrides(&set, 10_008);
    assert!(
        later.overlay().is_empty() && problems.is_empty(),
        "{problems:?}"
    );
}
