//! The operator console's pool list, at 100 pools and at 100,000, beside its ceiling: the API's
//! own page read (`GET /v1/pools?limit=50`) at the same size. A console page reads one API page
//! after a cursor, then the ledger's current window of its 50 pools, and renders; so a page should
//! cost the same whatever the number of pools (`x at 100`: a page's median at this size over the
//! same page's at 100 pools). The API's whole list is timed too, for what paging saves. Served by
//! the real allocator in this process (embedded store, SQLite ledger), called over loopback HTTP
//! one request at a time. Run with `scripts/bench` (or
//! `cargo bench -p allot-allocator --bench console`). Prints one JSON object per line for the
//! report, and a table.

use std::sync::Arc;
use std::time::Duration;

use allot_allocator::clock::{Clock, Stopwatch, SystemClock};
use allot_allocator::http::Tokens;
use allot_allocator::kv::memory::MemoryKv;
use allot_allocator::ledger::Ledger;
use allot_allocator::pools::{PoolSpec, put_pools};
use allot_allocator::server::{Settings, run};
use allot_shared::ids::{PoolId, RegionId, TenantId};

const OPERATOR: &str = "operator-token-for-the-bench-01";
/// The store sizes compared: a page should cost the same at both (the smaller is the least whose
/// pages are full, so both render the same number of rows).
const SIZES: [usize; 2] = [100, 100_000];
/// Pools a console page shows.
const PAGE: usize = 50;
const ROUNDS: usize = 30;

/// Median and 99th percentile of `samples_ms`.
fn quantiles(mut samples_ms: Vec<f64>) -> (f64, f64) {
    samples_ms.sort_by(f64::total_cmp);
    let at = |q: f64| samples_ms[((samples_ms.len() - 1) as f64 * q).round() as usize];
    (at(0.5), at(0.99))
}

async fn timed(request: impl Fn() -> reqwest::RequestBuilder) -> Vec<f64> {
    let mut samples_ms = Vec::with_capacity(ROUNDS);
    for _ in 0..ROUNDS {
        let stopwatch = Stopwatch::start();
        let response = request().send().await.expect("request");
        assert!(response.status().is_success(), "{}", response.status());
        let body = response.bytes().await.expect("body");
        assert!(!body.is_empty());
        samples_ms.push(stopwatch.elapsed().as_secs_f64() * 1_000.0);
    }
    samples_ms
}

/// The allocator serving `pools` pools, and a signed-in console session: (base URL, cookie, client).
async fn serve(
    pools: usize,
) -> (
    String,
    String,
    reqwest::Client,
    tokio::sync::oneshot::Sender<()>,
) {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let kv = Arc::new(MemoryKv::new(clock.clone()));
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger = Ledger::connect(&format!(
        "sqlite://{}",
        dir.keep().join("ledger.db").display()
    ))
    .await
    .expect("ledger");
    let spec = PoolSpec {
        limit_tokens: 1_000,
        window_ms: 60_000,
        window: None,
        chunk_tokens: 100,
        lease_ttl_ms: 10_000,
        fallback_per_region_tokens: 50,
        settle_debt_per_region_tokens: 0,
        regions: vec![RegionId::parse("eu").expect("region")],
    };
    let pool = PoolId::parse("api").expect("pool");
    let all: Vec<_> = (0..pools)
        .map(|n| {
            let tenant = TenantId::parse(&format!("tenant-{n:05}")).expect("tenant");
            (tenant, pool.clone(), spec.clone())
        })
        .collect();
    put_pools(&*kv, &all, clock.now_ms()).await.expect("pools");
    let tokens = Tokens {
        operator: vec![OPERATOR.to_owned()],
        // The allocator refuses to start without an agent token; no agent calls here.
        agent: vec!["agent-token-for-the-bench-001".to_owned()],
    };
    let settings = Settings::local(addr, tokens, "bench");
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(run(settings, kv, ledger, clock, listener, async move {
        let _ = stopped.await;
    }));
    let base = format!("http://{addr}");
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(60))
        .build()
        .expect("client");
    for _ in 0..200 {
        if client
            .get(format!("{base}/readyz"))
            .send()
            .await
            .is_ok_and(|r| r.status().is_success())
        {
            break;
        }
        assert!(!server.is_finished(), "the allocator stopped");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    let signed_in = client
        .post(format!("{base}/console/sign-in"))
        .header("content-type", "application/x-www-form-urlencoded")
        .body(format!("token={OPERATOR}"))
        .send()
        .await
        .expect("sign in");
    let cookie = signed_in
        .headers()
        .get("set-cookie")
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.split(';').next())
        .expect("session cookie")
        .to_owned();
    (base, cookie, client, stop)
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    println!(
        "{:<26} {:>7} {:>9} {:>9} {:>8} {:>8}",
        "path", "pools", "p50 ms", "p99 ms", "x api", "x at 100"
    );
    let mut at_smallest: std::collections::HashMap<&str, f64> = std::collections::HashMap::new();
    for pools in SIZES {
        let (base, cookie, client, _stop) = serve(pools).await;
        let api_page = timed(|| {
            client
                .get(format!("{base}/v1/pools?limit={PAGE}"))
                .bearer_auth(OPERATOR)
        })
        .await;
        let (api_p50, api_p99) = quantiles(api_page);
        let whole = timed(|| client.get(format!("{base}/v1/pools")).bearer_auth(OPERATOR)).await;
        let (whole_p50, whole_p99) = quantiles(whole);
        let middle = format!("tenant-{:05}%2Fapi", pools / 2);
        let shapes = [
            (
                "api page (ceiling)",
                None,
                format!("/v1/pools?limit={PAGE}"),
            ),
            ("api whole list", None, "/v1/pools".to_owned()),
            ("first page", Some(()), "/console/pools".to_owned()),
            (
                "a page mid-list",
                Some(()),
                format!("/console/pools?after={middle}"),
            ),
            (
                "search, 10 matches",
                Some(()),
                "/console/pools?q=tenant-0000".to_owned(),
            ),
        ];
        for (name, console, path) in shapes {
            let (p50, p99) = match (name, console) {
                ("api page (ceiling)", _) => (api_p50, api_p99),
                ("api whole list", _) => (whole_p50, whole_p99),
                _ => quantiles(
                    timed(|| {
                        client
                            .get(format!("{base}{path}"))
                            .header("cookie", &cookie)
                    })
                    .await,
                ),
            };
            // The ceiling's time over the page's: 1.0 means the page costs no more than its API read.
            let x_api = api_p50 / p50;
            if pools == SIZES[0] {
                at_smallest.insert(name, p50);
            }
            let x_at_smallest = at_smallest.get(name).map_or(1.0, |ten| p50 / ten);
            println!(
                "{name:<26} {pools:>7} {p50:>9.1} {p99:>9.1} {x_api:>8.2} {x_at_smallest:>8.2}"
            );
            println!(
                "BENCH {}",
                serde_json::json!({ "path": name, "pools": pools, "p50Ms": p50, "p99Ms": p99,
                    "xApi": x_api, "xAtSmallest": x_at_smallest })
            );
        }
    }
}
