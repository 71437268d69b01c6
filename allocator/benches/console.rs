//! The operator console's pool list at 10,000 pools, beside its ceiling: the API's `GET /v1/pools`
//! that every list page reads (a page then reads the ledger's current window of its 50 pools and
//! renders). Served by the real allocator in this process (embedded store, SQLite ledger), called
//! over loopback HTTP one request at a time. Run with `scripts/bench` (or
//! `cargo bench -p allot-allocator --bench console`). Prints one JSON object per line for the
//! report, and a table.

use std::sync::Arc;
use std::time::Duration;

use allot_allocator::clock::{Clock, Stopwatch, SystemClock};
use allot_allocator::http::Tokens;
use allot_allocator::kv::memory::MemoryKv;
use allot_allocator::ledger::Ledger;
use allot_allocator::pools::{PoolSpec, put_pool};
use allot_allocator::server::{Settings, run};
use allot_shared::ids::{PoolId, RegionId, TenantId};

const OPERATOR: &str = "operator-token-for-the-bench-01";
const POOLS: usize = 10_000;
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

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
        .await
        .expect("bind");
    let addr = listener.local_addr().expect("addr");
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let kv = Arc::new(MemoryKv::new(clock.clone()));
    let dir = tempfile::tempdir().expect("temp dir");
    let ledger = Ledger::connect(&format!(
        "sqlite://{}",
        dir.path().join("ledger.db").display()
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
    for n in 0..POOLS {
        let tenant = TenantId::parse(&format!("tenant-{n:05}")).expect("tenant");
        put_pool(&*kv, &tenant, &pool, spec.clone(), clock.now_ms())
            .await
            .expect("pool");
    }
    let settings = Settings {
        listen: addr,
        etcd: vec![],
        tokens: Tokens {
            operator: vec![OPERATOR.to_owned()],
            // The allocator refuses to start without an agent token; no agent calls here.
            agent: vec!["agent-token-for-the-bench-001".to_owned()],
        },
        node_id: "bench".to_owned(),
        advertise_url: format!("http://{addr}"),
        leader_lease_ttl_s: 5,
        tls: None,
        etcd_history_minutes: 60,
        etcd_defragment: true,
        retention: Default::default(),
        ledger_url: String::new(),
    };
    let (_stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let server = tokio::spawn(run(settings, kv, ledger, clock, listener, async move {
        let _ = stopped.await;
    }));
    let base = format!("http://{addr}");
    let client = reqwest::Client::builder()
        .redirect(reqwest::redirect::Policy::none())
        .timeout(Duration::from_secs(30))
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
        assert!(
            !server.is_finished(),
            "the allocator stopped: {:?}",
            server.await
        );
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

    let api = timed(|| client.get(format!("{base}/v1/pools")).bearer_auth(OPERATOR)).await;
    let shapes = [
        ("first page", "/console/pools".to_owned()),
        ("page 150 of 200", "/console/pools?page=150".to_owned()),
        (
            "search, 10 matches",
            "/console/pools?q=tenant-0999".to_owned(),
        ),
    ];
    let (api_p50, api_p99) = quantiles(api);
    println!(
        "{:<22} {:>9} {:>9} {:>8}",
        "path", "p50 ms", "p99 ms", "x api"
    );
    println!(
        "{:<22} {:>9.1} {:>9.1} {:>8}",
        "api list (ceiling)", api_p50, api_p99, "1.00"
    );
    println!(
        "BENCH {}",
        serde_json::json!({ "path": "api list (ceiling)", "pools": POOLS, "p50Ms": api_p50,
            "p99Ms": api_p99, "xApi": 1.0 })
    );
    for (name, path) in shapes {
        let samples = timed(|| {
            client
                .get(format!("{base}{path}"))
                .header("cookie", &cookie)
        })
        .await;
        let (p50, p99) = quantiles(samples);
        // The ceiling's time over the page's: 1.0 means the page costs no more than its API read.
        let x_api = api_p50 / p50;
        println!("{name:<22} {p50:>9.1} {p99:>9.1} {x_api:>8.2}");
        println!(
            "BENCH {}",
            serde_json::json!({ "path": name, "pools": POOLS, "p50Ms": p50, "p99Ms": p99,
                "xApi": x_api })
        );
    }
}
