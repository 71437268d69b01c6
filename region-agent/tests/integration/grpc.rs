//! Envoy's rate limit service over gRPC, end to end: an agent on the in-process store served on a
//! loopback port, called with a tonic client generated from the same proto subset.

use std::sync::Arc;

use allot_region_agent::clock::SystemClock;
use allot_region_agent::grpc::DECISION_ID_HEADER;
use allot_region_agent::grpc::proto::envoy::extensions::common::ratelimit::v3::{
    RateLimitDescriptor, rate_limit_descriptor::Entry,
};
use allot_region_agent::grpc::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
use allot_region_agent::grpc::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use allot_region_agent::grpc::proto::envoy::service::ratelimit::v3::{
    RateLimitRequest, RateLimitResponse,
};
use allot_region_agent::limiter::{InProcessStore, Limiter, LimiterConfig};
use allot_region_agent::service::{Agent, AgentSettings};
use allot_shared::ids::RegionId;
use allot_shared::keys::Pepper;
use tonic::transport::Channel;

use crate::common;

const TOKEN: &str = "gateway-token-1";

/// Two tokens per user, refilling one a minute.
const BUNDLE: &str = r#"{
    "bundleVersion": 1,
    "rules": [
        {"id": "read-user", "scope": "user", "routeGroup": "read", "algorithm": "token_bucket",
         "capacityMillis": 2000, "refillMillis": 1000, "periodMs": 60000, "failMode": "closed"}
    ]
}"#;

struct Served {
    client: RateLimitServiceClient<Channel>,
    stop: Option<tokio::sync::oneshot::Sender<()>>,
}

impl Drop for Served {
    fn drop(&mut self) {
        if let Some(stop) = self.stop.take() {
            let _ = stop.send(());
        }
    }
}

async fn serve(with_bundle: bool) -> Served {
    serve_bundle(with_bundle.then_some(BUNDLE)).await
}

async fn serve_bundle(bundle: Option<&str>) -> Served {
    serve_with(bundle, None).await
}

/// An agent serving `bundle`, taking leases from `allocator` when given.
async fn serve_with(
    bundle: Option<&str>,
    allocator: Option<Arc<allot_region_agent::allocator_client::AllocatorClient>>,
) -> Served {
    let clock = Arc::new(SystemClock);
    let store = Arc::new(InProcessStore::new(clock.clone(), 1_000));
    let limiter = Limiter::new(store, LimiterConfig::default()).expect("limiter");
    let bundle = bundle.map(|text| {
        allot_shared::policy::parse_bundle(text)
            .and_then(|draft| draft.into_file_bundle())
            .expect("a valid bundle")
    });
    let settings = AgentSettings {
        decision_record_ttl_ms: 60_000,
        ..AgentSettings::new(
            RegionId::parse("eu").expect("region"),
            allot_shared::ids::AgentId::parse("eu-test").expect("agent id"),
            Pepper::new(b"a pepper of at least sixteen bytes".to_vec()).expect("pepper"),
        )
    };
    let agent = Agent::new(settings, clock, limiter, allocator, bundle);
    let (addr, stop) = common::serve_grpc(agent, TOKEN).await;
    let client = RateLimitServiceClient::connect(format!("http://{addr}"))
        .await
        .expect("connect");
    Served {
        client,
        stop: Some(stop),
    }
}

fn descriptor(entries: &[(&str, &str)]) -> RateLimitDescriptor {
    RateLimitDescriptor {
        entries: entries
            .iter()
            .map(|(key, value)| Entry {
                key: (*key).to_owned(),
                value: (*value).to_owned(),
            })
            .collect(),
        hits_addend: None,
        is_negative_hits: false,
    }
}

fn user(name: &str) -> RateLimitDescriptor {
    descriptor(&[("tenant", "acme"), ("user", name), ("route_group", "read")])
}

fn request(
    descriptors: Vec<RateLimitDescriptor>,
    token: Option<&str>,
) -> tonic::Request<RateLimitRequest> {
    let mut request = tonic::Request::new(RateLimitRequest {
        domain: "envoy".to_owned(),
        descriptors,
        hits_addend: 0,
    });
    if let Some(token) = token {
        request.metadata_mut().insert(
            "authorization",
            format!("Bearer {token}").parse().expect("metadata value"),
        );
    }
    request
}

async fn ask(served: &mut Served, descriptors: Vec<RateLimitDescriptor>) -> RateLimitResponse {
    served
        .client
        .should_rate_limit(request(descriptors, Some(TOKEN)))
        .await
        .expect("an answer")
        .into_inner()
}

#[tokio::test]
async fn two_calls_pass_and_the_third_is_over_limit_with_its_limit_and_reset() {
    // This test's process owns the global recorder (nextest runs each test in its own process).
    let metrics = allot_region_agent::metrics::install().expect("the recorder");
    let mut served = serve(true).await;
    for _ in 0..2 {
        let answer = ask(&mut served, vec![user("alice")]).await;
        assert_eq!(answer.overall_code, Code::Ok as i32);
        assert_eq!(answer.statuses.len(), 1);
        assert_eq!(answer.statuses[0].code, Code::Ok as i32);
        assert!(
            answer
                .response_headers_to_add
                .iter()
                .any(|h| h.key == DECISION_ID_HEADER && h.value.starts_with("rls-")),
            "the decision id is added: {:?}",
            answer.response_headers_to_add
        );
    }
    let answer = ask(&mut served, vec![user("alice")]).await;
    assert_eq!(answer.overall_code, Code::OverLimit as i32);
    let status = &answer.statuses[0];
    assert_eq!(status.code, Code::OverLimit as i32);
    let reset = status.duration_until_reset.expect("a reset");
    assert!(reset.seconds > 0 || reset.nanos > 0, "reset {reset:?}");
    let limit = status.current_limit.as_ref().expect("the user's own limit");
    assert_eq!(limit.requests_per_unit, 2);
    assert_eq!(limit.name, "read-user");
    assert_eq!(status.limit_remaining, 0);
    let rendered = metrics.render();
    assert!(
        rendered.contains("allot_agent_rls_requests_total{code=\"ok\"} 2"),
        "{rendered}"
    );
    assert!(
        rendered.contains("allot_agent_rls_requests_total{code=\"over_limit\"} 1"),
        "{rendered}"
    );
    assert!(
        rendered.contains("allot_agent_rls_seconds_count 3"),
        "{rendered}"
    );
}

#[tokio::test]
async fn one_descriptor_over_makes_the_whole_request_over() {
    let mut served = serve(true).await;
    let cost_two = RateLimitDescriptor {
        hits_addend: Some(2),
        ..user("bob")
    };
    assert_eq!(
        ask(&mut served, vec![cost_two]).await.overall_code,
        Code::Ok as i32
    );
    let answer = ask(&mut served, vec![user("carol"), user("bob")]).await;
    assert_eq!(answer.overall_code, Code::OverLimit as i32);
    let codes: Vec<i32> = answer.statuses.iter().map(|s| s.code).collect();
    assert_eq!(
        codes,
        vec![Code::OverLimit as i32, Code::OverLimit as i32],
        "a call denied is denied for every descriptor"
    );
}

/// A call's descriptors are all or none: denied by one, it debits none. U-a has quota left and
/// U-b has none; the call is over, and U-a still has every token (envoyproxy/ratelimit would have
/// counted U-a's hit).
#[tokio::test]
async fn a_call_denied_by_one_descriptor_debits_none_of_the_others() {
    let mut served = serve(true).await;
    for _ in 0..2 {
        assert_eq!(
            ask(&mut served, vec![user("U-b")]).await.overall_code,
            Code::Ok as i32
        );
    }
    for _ in 0..5 {
        let answer = ask(&mut served, vec![user("U-a"), user("U-b")]).await;
        assert_eq!(answer.overall_code, Code::OverLimit as i32);
    }
    for n in 0..2 {
        let answer = ask(&mut served, vec![user("U-a")]).await;
        assert_eq!(answer.overall_code, Code::Ok as i32, "U-a's token {n}");
    }
    assert_eq!(
        ask(&mut served, vec![user("U-a")]).await.overall_code,
        Code::OverLimit as i32,
        "and only its two"
    );
}

/// Two descriptors on one tenant-wide budget are charged together: with one unit left, a call
/// needing two is over and spends nothing; a call needing one is admitted.
#[tokio::test]
async fn descriptors_sharing_a_budget_are_charged_their_sum_in_one_call() {
    let mut served = serve_bundle(Some(
        r#"{ "bundleVersion": 1, "rules": [
            {"id": "tenant-read", "scope": "tenant", "routeGroup": "read",
             "algorithm": "fixed_window", "limit": 3, "windowMs": 3600000, "failMode": "closed"} ] }"#,
    ))
    .await;
    assert_eq!(
        ask(&mut served, vec![user("A"), user("B")])
            .await
            .overall_code,
        Code::Ok as i32,
        "two of three"
    );
    let over = ask(&mut served, vec![user("C"), user("D")]).await;
    assert_eq!(
        over.overall_code,
        Code::OverLimit as i32,
        "two more do not fit"
    );
    assert_eq!(
        ask(&mut served, vec![user("E")]).await.overall_code,
        Code::Ok as i32,
        "the last one is still there"
    );
}

/// What one store call cannot decide all or none is refused, naming the descriptor: two tenants
/// in one call.
#[tokio::test]
async fn descriptors_of_two_tenants_in_one_call_are_an_invalid_argument() {
    let mut served = serve(true).await;
    let other_tenant = descriptor(&[
        ("tenant", "globex"),
        ("user", "U-a"),
        ("route_group", "read"),
    ]);
    let status = served
        .client
        .should_rate_limit(request(vec![user("U-a"), other_tenant], Some(TOKEN)))
        .await
        .expect_err("refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status.message().contains("descriptors[1]") && status.message().contains("all or none"),
        "{}",
        status.message()
    );
    for _ in 0..2 {
        assert_eq!(
            ask(&mut served, vec![user("U-a")]).await.overall_code,
            Code::Ok as i32,
            "nothing was spent"
        );
    }
}

#[tokio::test]
async fn a_descriptor_without_tenant_is_an_invalid_argument_naming_it() {
    let mut served = serve(true).await;
    let status = served
        .client
        .should_rate_limit(request(
            vec![
                user("dave"),
                descriptor(&[("user", "dave"), ("route_group", "read")]),
            ],
            Some(TOKEN),
        ))
        .await
        .expect_err("rejected");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status.message().contains("descriptors[1].tenant"),
        "{}",
        status.message()
    );
    // Nothing was debited for the valid first descriptor: dave still has both tokens.
    for _ in 0..2 {
        assert_eq!(
            ask(&mut served, vec![user("dave")]).await.overall_code,
            Code::Ok as i32
        );
    }
}

#[tokio::test]
async fn too_many_descriptors_are_an_invalid_argument() {
    let mut served = serve(true).await;
    let status = served
        .client
        .should_rate_limit(request(vec![user("erin"); 17], Some(TOKEN)))
        .await
        .expect_err("rejected");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
}

#[tokio::test]
async fn a_call_without_a_known_token_is_unauthenticated() {
    let mut served = serve(true).await;
    for token in [None, Some("wrong-token")] {
        let status = served
            .client
            .should_rate_limit(request(vec![user("frank")], token))
            .await
            .expect_err("rejected");
        assert_eq!(status.code(), tonic::Code::Unauthenticated);
    }
}

#[tokio::test]
async fn a_fail_closed_outage_is_unavailable_so_failure_mode_deny_decides() {
    // No policy bundle: every decision is a POLICY_ERROR.
    let mut served = serve(false).await;
    let status = served
        .client
        .should_rate_limit(request(vec![user("grace")], Some(TOKEN)))
        .await
        .expect_err("unavailable");
    assert_eq!(status.code(), tonic::Code::Unavailable);
}

/// The statuses follow the HTTP API's rule: a caller is told only its own (per-user) limit. An
/// admission whose most constraining rule is the tenant's shows no limit at all, nor does a denial
/// by the tenant's rule; the user's own rule, when it is the one named, is shown.
#[tokio::test]
async fn a_tenant_wide_limit_is_never_shown_even_as_the_most_constraining_rule_of_an_admission() {
    const TENANT_TIGHTER: &str = r#"{
        "bundleVersion": 1,
        "rules": [
            {"id": "read-user", "scope": "user", "routeGroup": "read", "algorithm": "token_bucket",
             "capacityMillis": 100000, "refillMillis": 1000, "periodMs": 60000, "failMode": "closed"},
            {"id": "tenant-all", "scope": "tenant", "algorithm": "fixed_window", "limit": 3,
             "windowMs": 3600000, "failMode": "closed"}
        ]
    }"#;
    let mut served = serve_bundle(Some(TENANT_TIGHTER)).await;
    for n in 0..3 {
        let answer = ask(&mut served, vec![user(&format!("u-{n}"))]).await;
        let status = &answer.statuses[0];
        assert_eq!(status.code, Code::Ok as i32);
        // The tenant's window (3, then 2, 1 left) is the most constraining: not shown.
        assert_eq!(status.current_limit, None, "{status:?}");
        assert_eq!(status.limit_remaining, 0);
    }
    let answer = ask(&mut served, vec![user("u-9")]).await;
    let status = &answer.statuses[0];
    assert_eq!(status.code, Code::OverLimit as i32);
    assert_eq!(status.current_limit, None, "a tenant denial: {status:?}");

    // With the user's own rule the tighter one, it is what is shown.
    let mut served = serve(true).await;
    let answer = ask(&mut served, vec![user("alice")]).await;
    let limit = answer.statuses[0]
        .current_limit
        .as_ref()
        .expect("own limit");
    assert_eq!(limit.name, "read-user");
    assert_eq!(answer.statuses[0].limit_remaining, 1);
}

/// A descriptor `hits_addend` of 0 is a dry run: answered as a request of one would be, with the
/// limit and what would be left, and nothing spent, however often it is asked.
#[tokio::test]
async fn a_descriptor_hits_addend_of_zero_checks_without_spending() {
    let mut served = serve(true).await;
    let check = |name: &str| RateLimitDescriptor {
        hits_addend: Some(0),
        ..user(name)
    };
    for _ in 0..5 {
        let answer = ask(&mut served, vec![check("carol")]).await;
        assert_eq!(answer.overall_code, Code::Ok as i32, "{answer:?}");
        assert_eq!(
            answer.statuses[0].limit_remaining, 1,
            "2 held, 1 left after one"
        );
    }
    // Both of the user's two tokens are still there.
    for _ in 0..2 {
        let answer = ask(&mut served, vec![user("carol")]).await;
        assert_eq!(answer.overall_code, Code::Ok as i32, "{answer:?}");
    }
    let answer = ask(&mut served, vec![check("carol")]).await;
    assert_eq!(answer.overall_code, Code::OverLimit as i32, "{answer:?}");
    assert!(
        answer.statuses[0]
            .duration_until_reset
            .is_some_and(|d| d.seconds > 0 || d.nanos > 0),
        "{answer:?}"
    );
}

/// `expose` decides what Envoy may be shown: a tenant-wide rule that says `expose: true` is shown
/// as the most constraining rule; a per-user rule that says `expose: false` never is.
#[tokio::test]
async fn rules_say_whether_envoy_may_show_them() {
    const EXPOSED: &str = r#"{
        "bundleVersion": 1,
        "rules": [
            {"id": "read-user", "scope": "user", "routeGroup": "read", "algorithm": "token_bucket",
             "capacityMillis": 100000, "refillMillis": 1000, "periodMs": 60000, "failMode": "closed",
             "expose": false},
            {"id": "tenant-plan", "scope": "tenant", "algorithm": "fixed_window", "limit": 3,
             "windowMs": 3600000, "failMode": "closed", "expose": true}
        ]
    }"#;
    const HIDDEN_USER: &str = r#"{
        "bundleVersion": 1,
        "rules": [
            {"id": "flood-guard", "scope": "user", "routeGroup": "read", "algorithm": "token_bucket",
             "capacityMillis": 2000, "refillMillis": 1000, "periodMs": 60000, "failMode": "closed",
             "expose": false}
        ]
    }"#;
    let mut served = serve_bundle(Some(EXPOSED)).await;
    let answer = ask(&mut served, vec![user("dave")]).await;
    let limit = answer.statuses[0]
        .current_limit
        .as_ref()
        .expect("the exposed tenant plan");
    assert_eq!(
        (limit.name.as_str(), limit.requests_per_unit),
        ("tenant-plan", 3)
    );
    assert_eq!(answer.statuses[0].limit_remaining, 2);

    let mut served = serve_bundle(Some(HIDDEN_USER)).await;
    for _ in 0..3 {
        let answer = ask(&mut served, vec![user("erin")]).await;
        assert_eq!(answer.statuses[0].current_limit, None, "{answer:?}");
        assert_eq!(answer.statuses[0].limit_remaining, 0);
    }
}

/// A soft rule's violation is told to the caller (`response_headers_to_add`), a shadow rule's to
/// the upstream service only (`request_headers_to_add`); both admit.
#[tokio::test]
async fn advisory_rules_answer_ok_and_flag_their_would_be_denials_in_headers() {
    const ADVISORY: &str = r#"{
        "bundleVersion": 1,
        "rules": [
            {"id": "guard", "scope": "user", "routeGroup": "read", "algorithm": "fixed_window",
             "limit": 1, "windowMs": 3600000, "failMode": "closed", "mode": "shadow"},
            {"id": "plan", "scope": "user", "algorithm": "token_bucket",
             "capacityMillis": 1000, "refillMillis": 1000, "periodMs": 3600000,
             "failMode": "closed", "mode": "soft"}
        ]
    }"#;
    let mut served = serve_bundle(Some(ADVISORY)).await;
    let first = ask(&mut served, vec![user("frank")]).await;
    assert!(first.request_headers_to_add.is_empty(), "{first:?}");
    let second = ask(&mut served, vec![user("frank")]).await;
    assert_eq!(second.overall_code, Code::Ok as i32, "{second:?}");
    let headers =
        |list: &[allot_region_agent::grpc::proto::envoy::config::core::v3::HeaderValue]| {
            list.iter()
                .map(|h| (h.key.clone(), h.value.clone()))
                .collect::<Vec<_>>()
        };
    assert_eq!(
        headers(&second.request_headers_to_add),
        [("x-allot-shadow-denied".to_owned(), "guard".to_owned())]
    );
    assert!(
        headers(&second.response_headers_to_add).contains(&(
            "x-allot-soft-limit-exceeded".to_owned(),
            "\"plan\"".to_owned()
        )),
        "{second:?}"
    );
    assert!(
        !headers(&second.response_headers_to_add)
            .iter()
            .any(|(key, _)| key == "x-allot-shadow-denied"),
        "the caller is never told of a shadow rule"
    );
}

/// `allot_charge: after_response` charges a cost known only once the response is done (Envoy's
/// filter applied on stream done): never denied, `OK` when it fit, `OVER_LIMIT` when the rest is
/// owed, and what is owed is paid before the user's next request is admitted.
#[tokio::test]
async fn a_charge_after_the_response_is_never_denied_and_what_does_not_fit_is_owed() {
    let mut served = serve(true).await;
    let charge = |name: &str, cost: u64| {
        let mut descriptor = user(name);
        descriptor.entries.push(Entry {
            key: "allot_charge".to_owned(),
            value: "after_response".to_owned(),
        });
        descriptor.hits_addend = Some(cost);
        descriptor
    };
    let check = |name: &str| RateLimitDescriptor {
        hits_addend: Some(0),
        ..user(name)
    };
    // Dave's bucket holds 2: a charge of 1 fits, and 1 is left.
    let answer = ask(&mut served, vec![charge("dave", 1)]).await;
    assert_eq!(answer.overall_code, Code::Ok as i32, "{answer:?}");
    let left = ask(&mut served, vec![check("dave")]).await;
    assert_eq!(
        (left.overall_code, left.statuses[0].limit_remaining),
        (Code::Ok as i32, 0),
        "the charge was spent: {left:?}"
    );
    // A charge of 5 does not fit: owed (at most one full limit), so Dave's next request waits.
    let answer = ask(&mut served, vec![charge("dave", 5)]).await;
    assert_eq!(answer.overall_code, Code::OverLimit as i32, "{answer:?}");
    let next = ask(&mut served, vec![user("dave")]).await;
    assert_eq!(next.overall_code, Code::OverLimit as i32, "{next:?}");
    // Erin owes nothing: her requests are untouched.
    let erin = ask(&mut served, vec![user("erin")]).await;
    assert_eq!(erin.overall_code, Code::Ok as i32, "{erin:?}");
    // The entry's one value, and a cost to charge.
    let mut wrong = charge("dave", 1);
    wrong.entries.last_mut().expect("entry").value = "later".to_owned();
    let status = served
        .client
        .should_rate_limit(request(vec![wrong], Some(TOKEN)))
        .await
        .expect_err("refused");
    assert_eq!(status.code(), tonic::Code::InvalidArgument);
    assert!(
        status.message().contains("descriptors[0].allot_charge"),
        "{status:?}"
    );
    let status = served
        .client
        .should_rate_limit(request(vec![charge("dave", 0)], Some(TOKEN)))
        .await
        .expect_err("refused");
    assert!(
        status.message().contains("descriptors[0].hits_addend"),
        "{status:?}"
    );
}

/// Envoy is shown the same most constraining rule as the HTTP API: the tightest of all a
/// request's rules, its global pool included, in a call of one descriptor or of several decided
/// together. A pool of 5 under a user rule of 500 is named, down to 0 left on its fifth admission.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn envoy_is_shown_the_pool_when_it_is_the_most_constraining_rule() {
    const POOLED: &str = r#"{
        "bundleVersion": 1,
        "rules": [
            {"id": "read-user", "scope": "user", "routeGroup": "read", "algorithm": "fixed_window",
             "limit": 500, "windowMs": 3600000, "failMode": "closed"},
            {"id": "global-api", "scope": "global", "pool": "api", "failMode": "closed",
             "expose": true}
        ]
    }"#;
    let fake = common::allocator::Allocator::new(5, 5, 0);
    let mut served = serve_with(
        Some(POOLED),
        Some(common::allocator::client(fake.clone()).await),
    )
    .await;
    // Two descriptors in one call, decided together: each names the pool.
    let answer = ask(&mut served, vec![user("p-a"), user("p-b")]).await;
    assert_eq!(answer.overall_code, Code::Ok as i32, "{answer:?}");
    for status in &answer.statuses {
        let limit = status.current_limit.as_ref().expect("a limit shown");
        assert_eq!(limit.name, "global-api", "{status:?}");
    }
    let mut shown = Vec::new();
    for n in 0..3 {
        let answer = ask(&mut served, vec![user(&format!("p-{n}"))]).await;
        let status = &answer.statuses[0];
        assert_eq!(status.code, Code::Ok as i32, "{status:?}");
        let limit = status.current_limit.as_ref().expect("a limit shown");
        shown.push((
            limit.name.clone(),
            limit.requests_per_unit,
            status.limit_remaining,
        ));
    }
    let pool = |left| ("global-api".to_owned(), 5, left);
    assert_eq!(
        shown,
        [pool(2), pool(1), pool(0)],
        "not the user rule's 499..497"
    );
}
