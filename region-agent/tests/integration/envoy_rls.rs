//! The rate limit service as Envoy's own filter calls it, through Envoy's own generated API
//! (`envoy-types`: the full data-plane protos, not the agent's subset). The calls are what the
//! configuration in docs/agent.md makes Envoy send: at the request's start one descriptor built by
//! the route's actions, Envoy's `x-request-id` among them (`request_id`); when the stream is done
//! (`apply_on_stream_done`) the same entries and `allot_release: stream_done`, whose answer Envoy
//! ignores. A request-level `hits_addend` of 0 (Envoy's default) and the domain on every call.

use std::sync::Arc;

use allot_region_agent::clock::SystemClock;
use envoy_types::pb::envoy::extensions::common::ratelimit::v3::rate_limit_descriptor::Entry;
use envoy_types::pb::envoy::service::ratelimit::v3::RateLimitRequest;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_response::Code;
use envoy_types::pb::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
use tonic::transport::Channel;

use crate::common;

const TOKEN: &str = "gateway-token-1";

/// Two exports of a user in flight at once; the rate itself is generous.
const BUNDLE: &str = r#"{ "rules": [
    { "id": "export-user", "scope": "user", "routeGroup": "export", "algorithm": "token_bucket",
      "capacityMillis": 1000000, "refillMillis": 1000000, "periodMs": 1000,
      "concurrencyMax": 2, "failMode": "closed" } ] }"#;

async fn serve() -> (
    RateLimitServiceClient<Channel>,
    tokio::sync::oneshot::Sender<()>,
) {
    let agent = common::agent(
        common::settings(),
        Arc::new(SystemClock),
        None,
        Some(common::bundle(BUNDLE)),
    );
    let (address, stop) = common::serve_grpc(agent, TOKEN).await;
    let client = RateLimitServiceClient::connect(format!("http://{address}"))
        .await
        .expect("connect");
    (client, stop)
}

/// What Envoy's `request_headers` and `generic_key` actions build for the export route.
fn entries(user: &str, request_id: Option<&str>, on_stream_done: bool) -> Vec<Entry> {
    let mut entries = vec![
        ("tenant", "atlas"),
        ("user", user),
        ("route_group", "export"),
    ];
    entries.extend(request_id.map(|id| ("request_id", id)));
    if on_stream_done {
        entries.push(("allot_release", "stream_done"));
    }
    common::rls_entries(&entries)
}

fn envoy_call(entries: Vec<Entry>) -> tonic::Request<RateLimitRequest> {
    common::rls_call(TOKEN, entries)
}

/// The request's start: Envoy admits it when the overall code is not `OVER_LIMIT`.
async fn start(client: &mut RateLimitServiceClient<Channel>, user: &str, request_id: &str) -> bool {
    let answer = client
        .should_rate_limit(envoy_call(entries(user, Some(request_id), false)))
        .await
        .expect("answered")
        .into_inner();
    answer.overall_code != Code::OverLimit as i32
}

/// The stream is done: Envoy sends the release and ignores the answer (it must not fail).
async fn done(client: &mut RateLimitServiceClient<Channel>, user: &str, request_id: &str) {
    let answer = client
        .should_rate_limit(envoy_call(entries(user, Some(request_id), true)))
        .await
        .expect("answered")
        .into_inner();
    assert_eq!(answer.overall_code, Code::Ok as i32);
}

/// `concurrencyMax: 2` over RLS means two in flight, not two per slot lease: each request's slot
/// is held under its `x-request-id` and freed when Envoy's stream is done. A denied request's
/// stream-done call frees nothing of the others.
#[tokio::test]
async fn slots_taken_over_rls_are_freed_when_envoys_stream_is_done() {
    let (mut client, _stop) = serve().await;
    let id = |n: u32| format!("7f1c6a52-0d3e-4b8a-9c41-{n:012}");
    assert!(start(&mut client, "U-1", &id(1)).await);
    assert!(start(&mut client, "U-1", &id(2)).await);
    assert!(!start(&mut client, "U-1", &id(3)).await, "two in flight");
    done(&mut client, "U-1", &id(3)).await;
    assert!(
        !start(&mut client, "U-1", &id(4)).await,
        "a denied request's stream frees no one else's slot"
    );
    done(&mut client, "U-1", &id(4)).await;
    done(&mut client, "U-1", &id(1)).await;
    assert!(
        start(&mut client, "U-1", &id(5)).await,
        "the first one's slot is free"
    );
    assert!(!start(&mut client, "U-1", &id(6)).await);
    done(&mut client, "U-1", &id(6)).await;
    done(&mut client, "U-1", &id(2)).await;
    done(&mut client, "U-1", &id(5)).await;
    // A hundred requests one after another, each done before the next: none is ever refused.
    for n in 100..200 {
        assert!(start(&mut client, "U-1", &id(n)).await, "request {n}");
        done(&mut client, "U-1", &id(n)).await;
    }
    // Another user's release of the same id frees nothing of U-1's.
    assert!(start(&mut client, "U-1", &id(7)).await);
    assert!(start(&mut client, "U-1", &id(8)).await);
    done(&mut client, "U-2", &id(7)).await;
    assert!(!start(&mut client, "U-1", &id(9)).await);
}

/// A release that cannot say whose slots it frees, an id that is not one, and a refund Envoy
/// can ask for (`is_negative_hits`) are refused naming the entry; nothing is freed or spent.
#[tokio::test]
async fn releases_and_ids_that_cannot_be_honoured_say_which_entry() {
    let (mut client, _stop) = serve().await;
    let refused = |status: Result<tonic::Response<_>, tonic::Status>| match status {
        Err(status) if status.code() == tonic::Code::InvalidArgument => status.message().to_owned(),
        other => panic!("not refused: {other:?}"),
    };
    let no_id = refused(
        client
            .should_rate_limit(envoy_call(entries("U-1", None, true)))
            .await,
    );
    assert!(
        no_id.starts_with("descriptors[0].request_id: missing"),
        "{no_id}"
    );
    let mut wrong_value = entries("U-1", Some("r-1"), true);
    if let Some(entry) = wrong_value.iter_mut().find(|e| e.key == "allot_release") {
        entry.value = "now".to_owned();
    }
    let wrong = refused(client.should_rate_limit(envoy_call(wrong_value)).await);
    assert!(
        wrong.starts_with("descriptors[0].allot_release: must be stream_done"),
        "{wrong}"
    );
    let bad_id = refused(
        client
            .should_rate_limit(envoy_call(entries("U-1", Some("not an id!"), false)))
            .await,
    );
    assert!(
        bad_id.starts_with("descriptors[0].request_id: "),
        "{bad_id}"
    );
    let mut negative = envoy_call(entries("U-1", Some("r-2"), false));
    negative.get_mut().descriptors[0].is_negative_hits = true;
    let refund = refused(client.should_rate_limit(negative).await);
    assert!(
        refund.starts_with("descriptors[0].is_negative_hits: "),
        "{refund}"
    );
    // Nothing was taken by any of them: both slots are there.
    assert!(start(&mut client, "U-1", "r-3").await);
    assert!(start(&mut client, "U-1", "r-4").await);
    assert!(!start(&mut client, "U-1", "r-5").await);
}
