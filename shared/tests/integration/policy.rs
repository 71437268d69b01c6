//! Policy bundles: the reference design's example parses, every validation rule rejects with the rule
//! id and the field, the checksum is canonical, and matching orders rules user -> route -> tenant.

use allot_shared::contract::PrincipalType;
use allot_shared::ids::{RouteGroup, TenantId};
use allot_shared::policy::{FailMode, Limit, PolicyError, Scope, parse_bundle};
use serde_json::{Value, json};

const NORTHSTAR: &str = include_str!("../../../deploy/examples/northstar-bundle.json");

fn northstar() -> Value {
    serde_json::from_str(NORTHSTAR).expect("the example is JSON")
}

/// The example bundle with rule `index` changed by `edit`.
fn with_rule(index: usize, edit: impl FnOnce(&mut serde_json::Map<String, Value>)) -> String {
    let mut bundle = northstar();
    let rule = bundle["rules"][index]
        .as_object_mut()
        .expect("rules are objects");
    edit(rule);
    bundle.to_string()
}

fn rejected(json: &str) -> PolicyError {
    parse_bundle(json).expect_err("the bundle must be rejected")
}

/// The bundle `clients/rust/examples/service.rs` needs (docs/gateways.md): a rule for each route group
/// it sends, `export` holding one slot at a time.
#[test]
fn the_client_example_bundle_covers_every_route_group_the_example_sends() {
    let draft = parse_bundle(include_str!(
        "../../../deploy/examples/client-service-bundle.json"
    ))
    .expect("valid");
    for group in ["read", "export", "summarize"] {
        let group = RouteGroup::parse(group).expect("group");
        assert!(
            draft
                .rules
                .iter()
                .any(|rule| rule.matcher.route_group.as_ref() == Some(&group)),
            "no rule for {group:?}"
        );
    }
    let export = draft
        .rules
        .iter()
        .find(|rule| rule.matcher.route_group.as_ref().map(RouteGroup::as_str) == Some("export"))
        .expect("export rule");
    assert_eq!(export.concurrency.map(|c| c.max_in_flight()), Some(1));
}

#[test]
fn the_reference_example_parses() {
    let draft = parse_bundle(NORTHSTAR).expect("valid");
    assert_eq!(draft.version, Some(42));
    assert_eq!(draft.rules.len(), 5);
    let export = &draft.rules[2];
    assert_eq!(export.id.as_str(), "export-tenant");
    assert_eq!(export.scope, Scope::Tenant);
    assert_eq!(export.cost_millitokens, 10_000);
    assert!(export.idempotent);
    assert_eq!(export.fail_mode, FailMode::Closed);
    assert_eq!(export.concurrency.map(|c| c.max_in_flight()), Some(3));
    assert!(matches!(draft.rules[4].limit, Limit::Global(ref pool) if pool.as_str() == "api"));
}

#[test]
fn every_validation_rule_names_the_rule_and_the_field() {
    let cases: Vec<(String, &str, &str)> = vec![
        (
            with_rule(0, |r| {
                r.insert("costMillis".into(), json!(30_000));
            }),
            "rules[0].costMillis",
            "could never be admitted",
        ),
        (
            with_rule(0, |r| {
                r.insert("refillMillis".into(), json!(0));
            }),
            "rules[0].refillMillis",
            "never refills",
        ),
        (
            with_rule(1, |r| {
                r.insert("capacityMillis".into(), json!(1u64 << 41));
            }),
            "rules[1].capacityMillis",
            "[0, 2^40]",
        ),
        (
            with_rule(1, |r| {
                r.insert("capacityMillis".into(), json!(-5));
            }),
            "rules[1].capacityMillis",
            "got -5",
        ),
        (
            with_rule(1, |r| {
                r.insert("periodMs".into(), json!(1.5));
            }),
            "rules[1].periodMs",
            "got 1.5",
        ),
        (
            with_rule(1, |r| {
                r.insert("capacityMillis".into(), json!("nan"));
            }),
            "rules[1].capacityMillis",
            "integer",
        ),
        (
            with_rule(1, |r| {
                r.insert("capacityMillis".into(), json!(1u64 << 40));
                r.insert("periodMs".into(), json!(1u64 << 13));
            }),
            "rules[1].capacityMillis",
            "2^52",
        ),
        (
            with_rule(2, |r| {
                r.remove("failMode");
            }),
            "rules[2].failMode",
            "is required",
        ),
        (
            with_rule(0, |r| {
                r.remove("localCapacityMillis");
            }),
            "rules[0].localCapacityMillis",
            "local_bounded",
        ),
        (
            with_rule(2, |r| {
                r.insert("capacityMilis".into(), json!(1));
            }),
            "rules[2].capacityMilis",
            "unknown field",
        ),
        (
            with_rule(4, |r| {
                r.remove("pool");
            }),
            "rules[4].pool",
            "hash tag",
        ),
        (
            with_rule(1, |r| {
                r.insert("id".into(), json!("read-user-v3"));
            }),
            "rules[1].id",
            "duplicates the id",
        ),
        (
            with_rule(1, |r| {
                r.insert("tenant".into(), json!("at}las"));
            }),
            "rules[1].tenant",
            "tenant id may only contain",
        ),
        (
            with_rule(3, |r| {
                r.insert("costMillis".into(), json!(1_500));
            }),
            "rules[3].costMillis",
            "multiple of 1000",
        ),
    ];
    for (json, field, needle) in cases {
        let err = rejected(&json);
        assert_eq!(err.field, field, "{err}");
        assert!(err.message.contains(needle), "{field}: {err}");
        assert!(err.rule_id.is_some(), "{field}: the rule is named: {err}");
        assert!(err.to_string().starts_with("rule "), "{err}");
    }
}

#[test]
fn duplicate_keys_are_rejected() {
    // A second per-user rule on route group read would write the same key as read-user-v3.
    let mut bundle = northstar();
    let mut copy = bundle["rules"][0].clone();
    copy["id"] = json!("read-user-v4");
    bundle["rules"].as_array_mut().expect("array").push(copy);
    let err = rejected(&bundle.to_string());
    assert!(err.message.contains("share a store key"), "{err}");

    // A route-scope rule writes the same tenant key as a tenant-scope rule on that route group.
    let mut route = northstar();
    route["rules"].as_array_mut().expect("array").push(json!({
        "id": "export-route", "scope": "route", "routeGroup": "export", "algorithm": "gcra",
        "capacityMillis": 10000, "refillMillis": 1000, "periodMs": 1000, "costMillis": 10000,
        "failMode": "closed" }));
    let err = rejected(&route.to_string());
    assert!(err.message.contains("rule export-tenant"), "{err}");

    // The same rule limited to another route group has its own key.
    bundle["rules"][5]["routeGroup"] = json!("search");
    assert!(parse_bundle(&bundle.to_string()).is_ok());

    // An exemption for one tenant may reuse the shape: it replaces the rule for that tenant.
    bundle["rules"][5]["routeGroup"] = json!("read");
    bundle["rules"][5]["tenant"] = json!("birch");
    bundle["rules"][5]["exempt"] = json!(true);
    bundle["rules"][5]["owner"] = json!("partner-team");
    let draft = parse_bundle(&bundle.to_string()).expect("an exemption is not a duplicate");
    let sealed = draft.seal(43, None);
    let birch = TenantId::parse("birch").expect("tenant");
    let atlas = TenantId::parse("atlas").expect("tenant");
    let read = RouteGroup::parse("read").expect("route");
    let ids = |tenant: &TenantId| -> Vec<String> {
        sealed
            .regional_rules_for(tenant, &read, PrincipalType::User)
            .iter()
            .map(|r| r.id.to_string())
            .collect()
    };
    assert_eq!(ids(&birch), vec!["read-user-v4"]);
    assert_eq!(ids(&atlas), vec!["read-user-v3", "tenant-atlas-minute"]);
}

#[test]
fn exemptions_need_a_cap_an_owner_and_a_tenant() {
    let exempt = |edit: fn(&mut serde_json::Map<String, Value>)| {
        with_rule(0, |r| {
            r.insert("exempt".into(), json!(true));
            r.insert("owner".into(), json!("sre"));
            r.insert("tenant".into(), json!("atlas"));
            edit(r);
        })
    };
    assert!(parse_bundle(&exempt(|_| {})).is_ok());
    let err = rejected(&exempt(|r| {
        r.remove("owner");
    }));
    assert_eq!(err.field, "rules[0].owner");
    let err = rejected(&exempt(|r| {
        r.remove("tenant");
    }));
    assert!(err.message.contains("may not match every tenant"), "{err}");
    let err = rejected(&exempt(|r| {
        r.remove("capacityMillis");
    }));
    assert_eq!(
        err.field, "rules[0].capacityMillis",
        "an exemption without a cap: {err}"
    );
}

#[test]
fn more_than_eight_rules_for_one_request_are_rejected() {
    let rules: Vec<Value> = (0..9)
        .map(|n| {
            json!({ "id": format!("r{n}"), "scope": "route", "routeGroup": format!("g{n}"),
                    "algorithm": "gcra", "capacityMillis": 1000, "refillMillis": 1000, "periodMs": 1000,
                    "failMode": "closed" })
        })
        .collect();
    // Nine rules on nine route groups: any one request matches one of them.
    assert!(parse_bundle(&json!({ "rules": rules }).to_string()).is_ok());
    // Nine tenant-specific route rules never meet in one request (one tenant each), plus eight
    // per-user rules on distinct route groups.
    let overlapping: Vec<Value> = (0..9)
        .map(|n| {
            json!({ "id": format!("r{n}"), "scope": "route", "routeGroup": "read", "tenant": format!("t{n}"),
                    "algorithm": "gcra", "capacityMillis": 1000, "refillMillis": 1000, "periodMs": 1000,
                    "failMode": "closed" })
        })
        .chain((0..8).map(|n| {
            json!({ "id": format!("u{n}"), "scope": "user", "routeGroup": format!("x{n}"),
                    "algorithm": "gcra", "capacityMillis": 1000, "refillMillis": 1000, "periodMs": 1000,
                    "failMode": "closed" })
        }))
        .collect();
    assert!(parse_bundle(&json!({ "rules": overlapping }).to_string()).is_ok());
    // Nine per-user rules that all apply to a request on route group read.
    let too_many: Vec<Value> = (0..9)
        .map(|n| {
            json!({ "id": format!("u{n}"), "scope": "user", "routeGroup": "read",
                    "algorithm": "gcra", "capacityMillis": 1000, "refillMillis": 1000, "periodMs": 1000,
                    "failMode": "closed" })
        })
        .collect();
    let err = rejected(&json!({ "rules": too_many }).to_string());
    assert!(
        err.message.contains("9 rules would apply to one request"),
        "{err}"
    );
    assert!(err.message.contains("at most 8"), "{err}");
}

#[test]
fn the_checksum_is_canonical_and_verified() {
    let draft = parse_bundle(NORTHSTAR).expect("valid");
    let sealed = draft
        .clone()
        .seal(42, Some("2026-11-06T09:30:00Z".to_owned()));
    assert!(sealed.checksum().starts_with("sha256:"));
    assert_eq!(sealed.checksum().len(), "sha256:".len() + 64);

    // Reformatted, keys reordered, defaults written out: the same checksum.
    let mut reordered = northstar();
    for rule in reordered["rules"].as_array_mut().expect("array") {
        let object = rule.as_object_mut().expect("object");
        let mut keys: Vec<String> = object.keys().cloned().collect();
        keys.reverse();
        let reversed: serde_json::Map<String, Value> = keys
            .into_iter()
            .map(|k| (k.clone(), object[&k].clone()))
            .collect();
        *object = reversed;
    }
    // The default cost written out: 1,000 per unit of the caller's costHint.
    reordered["rules"][3]["costMillis"] = json!(1000);
    reordered["rules"][3]["chargesCostHint"] = json!(true);
    let pretty = serde_json::to_string_pretty(&reordered).expect("json");
    let again = parse_bundle(&pretty)
        .expect("valid")
        .seal(42, Some("2026-11-06T09:30:00Z".to_owned()));
    assert_eq!(sealed.checksum(), again.checksum());

    // A published bundle round-trips through its wire form and verifies.
    let wire = sealed.to_json().to_string();
    let verified = parse_bundle(&wire)
        .expect("valid")
        .into_verified()
        .expect("checksum matches");
    assert_eq!(verified, sealed);

    // Any change to the content breaks the checksum.
    let mut tampered = sealed.to_json();
    tampered["rules"][0]["capacityMillis"] = json!(40000);
    let err = parse_bundle(&tampered.to_string())
        .expect("still a valid policy")
        .into_verified()
        .expect_err("the checksum no longer matches");
    assert_eq!(err.field, "checksum");
    let mut bumped = sealed.to_json();
    bumped["bundleVersion"] = json!(43);
    assert!(
        parse_bundle(&bumped.to_string())
            .expect("valid")
            .into_verified()
            .is_err()
    );
}

#[test]
fn versions_only_go_up() {
    let v42 = parse_bundle(NORTHSTAR).expect("valid").seal(42, None);
    let v41 = parse_bundle(NORTHSTAR).expect("valid").seal(41, None);
    let v43 = parse_bundle(NORTHSTAR).expect("valid").seal(43, None);
    assert!(v42.is_superseded_by(&v43));
    assert!(
        !v42.is_superseded_by(&v41),
        "a late old snapshot never overwrites a newer one"
    );
    assert!(!v42.is_superseded_by(&v42.clone()));
    // A rollback is a new, higher version with the old content.
    assert!(v43.is_superseded_by(&parse_bundle(NORTHSTAR).expect("valid").seal(44, None)));
}

#[test]
fn file_bundles_get_a_version_and_a_checksum() {
    let file = r#"{ "rules": [ { "id": "read", "scope": "user", "algorithm": "token_bucket",
        "capacityMillis": 20000, "refillMillis": 2000, "periodMs": 1000, "failMode": "closed" } ] }"#;
    let bundle = parse_bundle(file)
        .expect("valid")
        .into_file_bundle()
        .expect("sealed");
    assert_eq!(bundle.version(), 1);
    assert!(bundle.checksum().starts_with("sha256:"));
    let wrong = file.replacen("{ \"rules\"", "{ \"checksum\": \"sha256:00\", \"rules\"", 1);
    assert!(
        parse_bundle(&wrong)
            .expect("valid")
            .into_file_bundle()
            .is_err()
    );
}

#[test]
fn matching_orders_user_route_tenant_and_separates_global_rules() {
    let bundle = parse_bundle(NORTHSTAR).expect("valid").seal(42, None);
    let atlas = TenantId::parse("atlas").expect("tenant");
    let birch = TenantId::parse("birch").expect("tenant");
    let read = RouteGroup::parse("read").expect("route");
    let export = RouteGroup::parse("export").expect("route");
    let ids = |rules: Vec<&allot_shared::policy::Rule>| -> Vec<String> {
        rules.iter().map(|r| r.id.to_string()).collect()
    };
    assert_eq!(
        ids(bundle.regional_rules_for(&atlas, &read, PrincipalType::User)),
        vec!["read-user-v3", "tenant-atlas-minute"]
    );
    assert_eq!(
        ids(bundle.regional_rules_for(&atlas, &export, PrincipalType::ApiKey)),
        vec!["export-tenant", "tenant-atlas-minute"]
    );
    assert_eq!(
        ids(bundle.regional_rules_for(&birch, &read, PrincipalType::Ip)),
        vec!["read-user-v3", "anon-ip"]
    );
    assert_eq!(
        ids(bundle.global_rules_for(&birch, &read, PrincipalType::User)),
        vec!["global-catalog"]
    );
    assert!(
        bundle
            .global_rules_for(&birch, &export, PrincipalType::User)
            .is_empty()
    );
}

#[test]
fn hostile_documents_are_rejected_without_panicking() {
    for doc in [
        "",
        "null",
        "[]",
        "{\"rules\": {}}",
        "{\"rules\": [1]}",
        "{\"rules\": [{}]}",
        "{\"bundleVersion\": 0, \"rules\": []}",
        "{\"rules\": [], \"extra\": 1}",
        "{\"rules\": [{\"id\": \"\\u0000\"}]}",
        "{\"rules\": [{\"id\": \"x\", \"scope\": \"galaxy\"}]}",
    ] {
        let err = rejected(doc);
        assert!(!err.message.is_empty(), "{doc}: {err}");
    }
    let huge: Vec<Value> = (0..1_001)
        .map(|n| json!({ "id": format!("r{n}") }))
        .collect();
    assert!(
        rejected(&json!({ "rules": huge }).to_string())
            .message
            .contains("at most 1000")
    );
}

#[test]
fn replay_counts_denials_per_rule() {
    use allot_shared::contract::{AdmissionRequest, Principal};
    use allot_shared::ids::DecisionId;
    use allot_shared::keys::Pepper;
    use allot_shared::replay::{ReplaySample, replay};

    let samples: Vec<ReplaySample> = (0..25)
        .map(|n| ReplaySample {
            at_ms: 1_000_000,
            request: AdmissionRequest {
                request_id: DecisionId::parse(&format!("r-{n}")).expect("id"),
                tenant_id: TenantId::parse("birch").expect("tenant"),
                principal: Principal {
                    kind: PrincipalType::User,
                    id: "U-17".to_owned(),
                    api_key_id: None,
                },
                route_group: RouteGroup::parse("read").expect("route"),
                method: "GET".to_owned(),
                cost_hint: 1,
                policy_epoch: None,
                dry_run: false,
                metered: false,
            },
        })
        .collect();
    let pepper = Pepper::new(b"replay-pepper-0123456789".to_vec()).expect("pepper");
    let current = parse_bundle(NORTHSTAR).expect("valid").seal(42, None);
    let report = replay(&current, &samples, &pepper);
    assert_eq!(
        (report.requests, report.denied),
        (25, 5),
        "P-READ admits a burst of 20"
    );
    assert_eq!(report.rules["read-user-v3"].evaluated, 25);
    assert_eq!(report.rules["read-user-v3"].denied, 5);
    assert_eq!(report.not_replayed.get("global-catalog"), Some(&25));

    let looser = NORTHSTAR.replacen("\"capacityMillis\": 20000", "\"capacityMillis\": 30000", 1);
    let candidate = parse_bundle(&looser).expect("valid").seal(43, None);
    assert_eq!(replay(&candidate, &samples, &pepper).denied, 0);
}

/// A bundle published before rules stated `chargesCostHint` (this checksum is what that version of
/// Allot computed for it) still verifies, and means what it meant then: every rule charges its
/// cost per unit of the caller's `costHint`, the stated 10 tokens of `export-tenant` included.
#[test]
fn a_bundle_published_before_charges_cost_hint_verifies_and_keeps_its_meaning() {
    let published = r#"{"bundleVersion":9,"checksum":"sha256:3edd302821943f59a69dc7d20cc3fbdfc7e49b6f58b5c4b12627bdca92aebcc7","rules":[{"algorithm":"fixed_window","costMillis":10000,"exempt":false,"failMode":"closed","id":"export-tenant","idempotent":false,"limit":100,"routeGroup":"export","scope":"tenant","strict":false,"windowMs":60000},{"algorithm":"fixed_window","costMillis":1000,"exempt":false,"failMode":"closed","id":"read-user","idempotent":false,"limit":100,"routeGroup":"read","scope":"user","strict":false,"windowMs":60000}]}"#;
    let bundle = parse_bundle(published)
        .expect("valid")
        .into_verified()
        .expect("the old checksum verifies");
    assert!(bundle.rules().iter().all(|rule| rule.charges_cost_hint));
    assert_eq!(bundle.rules()[0].cost_millitokens_for(3), Some(30_000));
    // Its wire form now states the field, and verifies again (as an agent receives it).
    let again = parse_bundle(&bundle.to_json().to_string())
        .expect("valid")
        .into_verified()
        .expect("verifies");
    assert_eq!(again, bundle);
    // Tampered content fails either form.
    let tampered = published.replace(
        "\"limit\":100,\"routeGroup\":\"export\"",
        "\"limit\":101,\"routeGroup\":\"export\"",
    );
    assert_ne!(tampered, published);
    let err = parse_bundle(&tampered)
        .expect("valid")
        .into_verified()
        .expect_err("tampered");
    assert_eq!(err.field, "checksum");
}

#[test]
fn expose_says_who_may_see_a_rule_and_changes_no_checksum_when_absent() {
    use allot_shared::policy::Exposure;
    let bundle = |expose: Option<Value>| {
        let mut rule = json!({ "id": "r", "scope": "tenant", "algorithm": "fixed_window",
                               "limit": 5, "windowMs": 1000, "failMode": "closed" });
        if let Some(expose) = expose {
            rule["expose"] = expose;
        }
        json!({ "bundleVersion": 1, "rules": [rule] }).to_string()
    };
    let sealed = |text: String| {
        parse_bundle(&text)
            .and_then(|draft| draft.into_file_bundle())
            .expect("valid")
    };
    let default = sealed(bundle(None));
    let rule = &default.rules()[0];
    assert_eq!(rule.exposure, Exposure::OwnScope);
    assert!(
        rule.to_json().get("expose").is_none(),
        "not written out when absent, so older bundles keep their checksums"
    );
    assert!(
        !rule.visible_to(PrincipalType::User),
        "a tenant rule by default"
    );
    let shown = sealed(bundle(Some(json!(true))));
    assert_eq!(shown.rules()[0].exposure, Exposure::Shown);
    assert!(shown.rules()[0].visible_to(PrincipalType::User));
    assert!(shown.rules()[0].visible_to(PrincipalType::ApiKey));
    assert!(
        !shown.rules()[0].visible_to(PrincipalType::Ip),
        "never to a caller that did not authenticate"
    );
    assert_ne!(shown.checksum(), default.checksum());
    let hidden = sealed(bundle(Some(json!(false))));
    assert_eq!(hidden.rules()[0].exposure, Exposure::Hidden);
    assert_eq!(hidden.rules()[0].to_json()["expose"], false);
    let error = rejected(&bundle(Some(json!("yes"))));
    assert_eq!(error.field, "rules[0].expose");
    assert_eq!(error.rule_id.as_deref(), Some("r"));
    // A per-user rule is its user's own unless it says otherwise.
    let own = sealed(bundle(None).replace("\"tenant\"", "\"user\""));
    assert!(own.rules()[0].visible_to(PrincipalType::User));
    assert!(!own.rules()[0].visible_to(PrincipalType::Ip));
    let guard = sealed(bundle(Some(json!(false))).replace("\"tenant\"", "\"user\""));
    assert!(!guard.rules()[0].visible_to(PrincipalType::User));
}

#[test]
fn modes_are_enforce_shadow_or_soft_and_soft_is_for_regional_rules() {
    use allot_shared::policy::Mode;
    let one = |rule: Value| json!({ "bundleVersion": 1, "rules": [rule] }).to_string();
    let window = |extra: Value| {
        let mut rule = json!({ "id": "w", "scope": "tenant", "algorithm": "fixed_window",
                               "limit": 5, "windowMs": 1000, "failMode": "closed" });
        for (key, value) in extra.as_object().expect("object") {
            rule[key] = value.clone();
        }
        one(rule)
    };
    let mode_of = |text: String| {
        parse_bundle(&text)
            .and_then(|draft| draft.into_file_bundle())
            .expect("valid")
            .rules()[0]
            .mode
    };
    assert_eq!(mode_of(window(json!({}))), Mode::Enforce);
    assert_eq!(mode_of(window(json!({ "mode": "enforce" }))), Mode::Enforce);
    assert_eq!(mode_of(window(json!({ "mode": "shadow" }))), Mode::Shadow);
    assert_eq!(mode_of(window(json!({ "mode": "soft" }))), Mode::Soft);
    let absent = parse_bundle(&window(json!({})))
        .and_then(|draft| draft.into_file_bundle())
        .expect("valid");
    assert!(
        absent.rules()[0].to_json().get("mode").is_none(),
        "not written out when absent, so older bundles keep their checksums"
    );
    let error = rejected(&window(json!({ "mode": "warn" })));
    assert_eq!(
        (error.field.as_str(), error.rule_id.as_deref()),
        ("rules[0].mode", Some("w"))
    );
    let error = rejected(&window(json!({ "mode": "shadow", "concurrencyMax": 2 })));
    assert_eq!(error.field, "rules[0].concurrencyMax");
    let error = rejected(&window(
        json!({ "mode": "soft", "exempt": true, "tenant": "atlas", "owner": "ops" }),
    ));
    assert_eq!(error.field, "rules[0].mode", "an exemption is enforced");
    let global = |mode: &str| {
        one(
            json!({ "id": "g", "scope": "global", "pool": "api", "failMode": "closed",
                    "mode": mode }),
        )
    };
    assert_eq!(mode_of(global("shadow")), Mode::Shadow);
    let error = rejected(&global("soft"));
    assert_eq!(error.field, "rules[0].mode");
    assert!(error.message.contains("regional"), "{error}");
}

#[test]
fn replay_answers_who_an_enforced_shadow_rule_would_deny_and_what_pools_would_not_spend() {
    use allot_shared::contract::{AdmissionRequest, Principal};
    use allot_shared::ids::DecisionId;
    use allot_shared::keys::Pepper;
    use allot_shared::replay::{ReplayOptions, ReplaySample, replay_with};

    // 25 requests by U-17 and 3 by U-18, all at once: the per-user burst of 20 holds for U-18.
    let samples: Vec<ReplaySample> = (0..28)
        .map(|n| ReplaySample {
            at_ms: 1_000_000,
            request: AdmissionRequest {
                request_id: DecisionId::parse(&format!("r-{n}")).expect("id"),
                tenant_id: TenantId::parse("birch").expect("tenant"),
                principal: Principal {
                    kind: PrincipalType::User,
                    id: if n < 25 { "U-17" } else { "U-18" }.to_owned(),
                    api_key_id: None,
                },
                route_group: RouteGroup::parse("read").expect("route"),
                method: "GET".to_owned(),
                cost_hint: 1,
                policy_epoch: None,
                dry_run: false,
                metered: false,
            },
        })
        .collect();
    let pepper = Pepper::new(b"replay-pepper-0123456789".to_vec()).expect("pepper");
    let shadowed = with_rule(0, |rule| {
        rule.insert("mode".to_owned(), json!("shadow"));
    });
    let candidate = parse_bundle(&shadowed).expect("valid").seal(44, None);
    let as_it_runs = replay_with(&candidate, &samples, &pepper, ReplayOptions::default());
    assert_eq!(as_it_runs.denied, 0, "a shadow rule denies nothing");
    assert_eq!(as_it_runs.rules["read-user-v3"].would_deny, 5);
    assert!(as_it_runs.top_denied.is_empty());
    let enforced = replay_with(
        &candidate,
        &samples,
        &pepper,
        ReplayOptions {
            enforce_advisory: true,
        },
    );
    assert_eq!((enforced.denied, enforced.principals_denied), (5, 1));
    assert_eq!(enforced.rules["read-user-v3"].denied, 5);
    let who = &enforced.top_denied[0];
    assert_eq!(
        (who.tenant.as_str(), who.principal.as_str(), who.denied),
        ("birch", "U-17", 5)
    );
    assert_eq!(
        enforced.unspent_global_tokens.values().sum::<u64>(),
        5,
        "the global pool's tokens those five would have spent: {:?}",
        enforced.unspent_global_tokens
    );
}

#[test]
fn a_shadow_rule_is_a_dark_launch_unless_it_says_expose() {
    let rule = |extra: &str| {
        let text = format!(
            r#"{{"bundleVersion":1,"rules":[{{"id":"u","scope":"user","algorithm":"fixed_window","limit":5,"windowMs":1000,"failMode":"closed"{extra}}}]}}"#
        );
        parse_bundle(&text)
            .and_then(|draft| draft.into_file_bundle())
            .expect("valid")
    };
    assert!(rule("").rules()[0].visible_to(PrincipalType::User));
    assert!(!rule(r#","mode":"shadow""#).rules()[0].visible_to(PrincipalType::User));
    assert!(rule(r#","mode":"soft""#).rules()[0].visible_to(PrincipalType::User));
    assert!(rule(r#","mode":"shadow","expose":true"#).rules()[0].visible_to(PrincipalType::User));
}

/// `ipPrefixV4` / `ipPrefixV6` give an anonymous per-principal rule its own prefix lengths: in
/// range, only where an address is keyed, and a rule with its own lengths may sit beside one at
/// the agent's (a ceiling), but not beside another with the same lengths.
#[test]
fn a_rules_own_ip_prefix_is_checked_and_keys_it_apart() {
    let rule = |extra: &str| {
        format!(
            r#"{{ "id": "anon-{n}", "scope": "user", "principalType": "ip", "algorithm": "fixed_window",
                 "limit": 5, "windowMs": 60000, "failMode": "closed"{extra} }}"#,
            n = extra.len()
        )
    };
    let bundle = |rules: &[String]| {
        allot_shared::policy::parse_bundle(&format!(r#"{{ "rules": [{}] }}"#, rules.join(",")))
    };
    let parsed = bundle(&[rule(""), rule(r#", "ipPrefixV4": 24, "ipPrefixV6": 48"#)])
        .expect("a narrow rule and its ceiling");
    let ceiling = &parsed.rules[1];
    assert_eq!(
        ceiling.ip_prefixes.map(|p| (p.v4_bits, p.v6_bits)),
        Some((Some(24), Some(48)))
    );
    assert_eq!(ceiling.to_json()["ipPrefixV4"], 24, "canonical when stated");
    assert!(
        parsed.rules[0].to_json().get("ipPrefixV4").is_none(),
        "absent otherwise"
    );
    for (extra, field, says) in [
        (r#", "ipPrefixV4": 0"#, "ipPrefixV4", "[1, 32]"),
        (r#", "ipPrefixV4": 33"#, "ipPrefixV4", "[1, 32]"),
        (r#", "ipPrefixV6": 129"#, "ipPrefixV6", "[1, 128]"),
    ] {
        let error = bundle(&[rule(extra)]).expect_err(extra);
        assert!(
            error.field.ends_with(field) && error.message.contains(says),
            "{extra}: {error:?}"
        );
    }
    let on_users = bundle(&[r#"{ "id": "u", "scope": "user", "principalType": "user",
        "algorithm": "fixed_window", "limit": 5, "windowMs": 60000, "failMode": "closed",
        "ipPrefixV4": 24 }"#
        .to_owned()])
    .expect_err("users have no address");
    assert!(on_users.field.ends_with("ipPrefixV4"), "{on_users:?}");
    assert!(
        on_users.message.contains("principalType ip"),
        "{on_users:?}"
    );
    let same_twice = bundle(&[
        rule(r#", "ipPrefixV4": 24"#),
        rule(r#", "ipPrefixV4": 24 "#),
    ])
    .expect_err("one key twice");
    assert!(
        same_twice.message.contains("share a store key"),
        "{same_twice:?}"
    );
}
