//! The bounds every router gets, against a real socket: a request past its deadline answers 503
//! problem+json, its wait for a place under the concurrency limit included; one within it is
//! answered, and a body past the limit answers 413 problem+json.

use std::time::Duration;

use allot_net::{RouterLimits, bounded_router};
use axum::Router;
use axum::routing::{get, post};

const REQUEST_TIMEOUT: Duration = Duration::from_millis(300);

async fn serve_bounded() -> String {
    serve_with(RouterLimits {
        max_body_bytes: 1_024,
        max_concurrent_requests: 8,
        request_timeout: REQUEST_TIMEOUT,
    })
    .await
}

async fn serve_with(limits: RouterLimits) -> String {
    let routes = Router::new()
        .route(
            "/forever",
            get(|| async {
                tokio::time::sleep(Duration::from_secs(3_600)).await;
                "never"
            }),
        )
        .route(
            "/prompt",
            get(|| async {
                tokio::time::sleep(REQUEST_TIMEOUT / 3).await;
                "prompt"
            }),
        )
        .route("/echo", post(|body: String| async move { body }));
    let router = bounded_router(routes, limits);
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    tokio::spawn(async move { axum::serve(listener, router).await });
    format!("http://{addr}")
}

/// Asserts `answer` is a problem+json answer of `status`.
async fn assert_problem(answer: reqwest::Response, status: reqwest::StatusCode) {
    assert_eq!(answer.status(), status);
    assert_eq!(
        answer.headers()["content-type"],
        allot_net::problem::PROBLEM_CONTENT_TYPE
    );
    let problem: serde_json::Value = answer.json().await.expect("problem+json");
    assert_eq!(problem["status"], status.as_u16());
}

fn client() -> reqwest::Client {
    reqwest::Client::builder()
        .timeout(Duration::from_secs(10))
        .build()
        .expect("client")
}

#[tokio::test]
#[allow(clippy::disallowed_methods)] // a test measuring how long the server held the request
async fn a_request_past_its_deadline_answers_503_problem_json_once_the_deadline_passed() {
    let base = serve_bounded().await;
    let started = std::time::Instant::now();
    let answer = client()
        .get(format!("{base}/forever"))
        .send()
        .await
        .expect("an answer, not the client's own timeout");
    let waited = started.elapsed();
    assert_problem(answer, reqwest::StatusCode::SERVICE_UNAVAILABLE).await;
    assert!(
        waited >= REQUEST_TIMEOUT,
        "cut off after {waited:?}, before its {REQUEST_TIMEOUT:?}"
    );
}

#[tokio::test]
async fn requests_within_their_deadline_are_answered() {
    let base = serve_bounded().await;
    let http = client();
    for _ in 0..3 {
        let answer = http
            .get(format!("{base}/prompt"))
            .send()
            .await
            .expect("answer");
        assert_eq!(answer.status(), reqwest::StatusCode::OK);
        assert_eq!(answer.text().await.expect("body"), "prompt");
    }
}

#[tokio::test]
async fn a_body_past_the_limit_answers_413_problem_json() {
    let base = serve_bounded().await;
    let http = client();
    let echo = |body_bytes: usize| {
        http.post(format!("{base}/echo"))
            .body("x".repeat(body_bytes))
            .send()
    };
    let small = echo(1_000).await.expect("answer");
    assert_eq!(small.status(), reqwest::StatusCode::OK);
    let large = echo(2_000).await.expect("answer");
    assert_problem(large, reqwest::StatusCode::PAYLOAD_TOO_LARGE).await;
}

/// The deadline covers the wait for a place: with one place, held by a request that runs until
/// its own deadline, a second request is cut off at its deadline too, not one deadline after it
/// got the place.
#[tokio::test]
#[allow(clippy::disallowed_methods)] // a test measuring how long the server held the request
async fn a_request_waiting_for_a_place_is_cut_off_at_its_deadline() {
    let request_timeout = Duration::from_secs(1);
    let base = serve_with(RouterLimits {
        max_body_bytes: 1_024,
        max_concurrent_requests: 1,
        request_timeout,
    })
    .await;
    let http = client();
    let holder = tokio::spawn(http.get(format!("{base}/forever")).send());
    // The holder takes the one place first.
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = std::time::Instant::now();
    let queued = http
        .get(format!("{base}/forever"))
        .send()
        .await
        .expect("an answer, not the client's own timeout");
    let waited = started.elapsed();
    assert_problem(queued, reqwest::StatusCode::SERVICE_UNAVAILABLE).await;
    // Cut off after its own deadline (plus at most two ticks), not after the holder's deadline
    // and then a whole one of its own (about 1.9 s).
    assert!(
        waited >= request_timeout && waited < request_timeout * 3 / 2,
        "the queued request was answered after {waited:?} (deadline {request_timeout:?})"
    );
    let held = holder.await.expect("joins").expect("an answer");
    assert_eq!(held.status(), reqwest::StatusCode::SERVICE_UNAVAILABLE);
}
