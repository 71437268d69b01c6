//! An admit through the agent's HTTP router in process (no sockets), beside a bare axum route that
//! takes the same request and answers a constant body: what the agent's bounds (body limit,
//! concurrency limit, deadline, problem+json), parsing, deciding (`lease-only`: one global rule,
//! tokens from a lease in memory) and encoding add to the HTTP framework's own work. Each figure
//! is the mean of 50,000 requests, three rounds taken in turn. Prints a table and `BENCH {json}`
//! lines with bench = "router".

mod common;

use std::sync::Arc;
use std::sync::atomic::AtomicU64;

use allot_region_agent::clock::{Stopwatch, SystemClock};
use allot_region_agent::limiter::{InProcessStore, LimiterStore};
use axum::body::Body;
use serde_json::json;
use tower::ServiceExt;

/// mimalloc, as in the agent's binary.
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// Requests per figure and round.
const REQUESTS: u64 = 50_000;

/// Rounds, each taking every figure once.
const ROUNDS: u64 = 3;

fn admit_request(path: &str, n: u64) -> axum::http::Request<Body> {
    axum::http::Request::post(path)
        .header("authorization", format!("Bearer {}", common::GATEWAY))
        .header("content-type", "application/json")
        .body(Body::from(
            serde_json::to_vec(&common::request(n)).expect("admit as JSON"),
        ))
        .expect("request")
}

/// Mean ns per request of `router` answering `REQUESTS` admits to `path`, numbered from `first`.
async fn mean_ns(router: &axum::Router, path: &str, first: u64) -> f64 {
    let requests: Vec<_> = (first..first + REQUESTS)
        .map(|n| admit_request(path, n))
        .collect();
    let stopwatch = Stopwatch::start();
    for request in requests {
        let answer = router.clone().oneshot(request).await.expect("infallible");
        assert!(answer.status().is_success(), "{}", answer.status());
        axum::body::to_bytes(answer.into_body(), common::MAX_ANSWER_BYTES)
            .await
            .expect("answer body");
    }
    stopwatch.elapsed().as_nanos() as f64 / REQUESTS as f64
}

fn main() {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    runtime.block_on(async {
        let allocator = common::stub_allocator(Arc::new(AtomicU64::new(0)), 1 << 30).await;
        let store: Arc<dyn LimiterStore> =
            Arc::new(InProcessStore::new(Arc::new(SystemClock), 100_000));
        let (_url, api) = common::start_agent(store, &allocator, false).await;
        let agent = allot_region_agent::http::router(api);
        let trivial = axum::Router::new().route(
            "/constant",
            axum::routing::post(|_body: axum::body::Bytes| async {
                axum::Json(json!({ "allowed": true }))
            }),
        );
        // Warm: the lease is held, the counters exist.
        mean_ns(&agent, "/v1/admit", 0).await;
        let (mut agent_ns, mut trivial_ns) = (0.0, 0.0);
        for round in 1..=ROUNDS {
            agent_ns += mean_ns(&agent, "/v1/admit", round * 2 * REQUESTS).await;
            trivial_ns += mean_ns(&trivial, "/constant", (round * 2 + 1) * REQUESTS).await;
        }
        let (agent_ns, trivial_ns) = (agent_ns / ROUNDS as f64, trivial_ns / ROUNDS as f64);
        println!("{:<12} {:>10}", "route", "ns/request");
        println!("{:<12} {:>10.0}", "trivial", trivial_ns);
        println!("{:<12} {:>10.0}", "lease-only", agent_ns);
        for (route, ns) in [("trivial", trivial_ns), ("lease-only", agent_ns)] {
            println!(
                "BENCH {}",
                json!({ "bench": "router", "route": route, "nsPerRequest": ns.round(),
                    "xTrivial": (ns / trivial_ns * 100.0).round() / 100.0 })
            );
        }
    });
}
