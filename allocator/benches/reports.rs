//! An agent's report round into the ledger: one call per pool (`POST /v1/reports`, the ceiling)
//! beside the whole round in as few calls as the batch bounds allow (`POST /v1/reports/batch`).
//! The real allocator in this process (embedded store, SQLite ledger), `REPORT_POOLS` pools (default
//! 1,000) each with a lease granted, each round reporting every pool once, over loopback HTTP one
//! call at a time as an agent sends them. CPU is the allocator's alone: its runtime's threads and
//! the SQLite ledger's workers, not the calling client's; `x one by one`: CPU per report over the
//! ceiling's, in the same run. Run with `cargo bench -p allot-allocator --bench reports`. Prints one JSON object
//! per line for the report, and a table.

mod common;

use allot_shared::ids::{LeaseId, TenantId};
use allot_shared::wire::MAX_REPORTS_PER_BATCH;
use serde_json::{Value, json};

use common::{
    AGENT, OPERATOR, ROUNDS, agent_post, alternate, measured, print_shapes, serve, tenant,
};

/// One lease per pool, granted: (tenant, lease, window start).
async fn grant_each(
    base: &str,
    client: &reqwest::Client,
    pools: usize,
) -> Vec<(TenantId, LeaseId, u64)> {
    let mut leases = Vec::with_capacity(pools);
    for n in 0..pools {
        let lease = LeaseId::from_parts(1, n as u128 + 1);
        let answer = agent_post(client, base, "/v1/grants", &json!({ "leaseId": lease, "tenant": tenant(n), "pool": "api", "region": "eu", "want": 100 })).await;
        let window_start = answer["windowStartMs"].as_u64().expect("a grant");
        leases.push((tenant(n), lease, window_start));
    }
    leases
}

fn report(
    round: usize,
    tenant: &TenantId,
    lease: LeaseId,
    window_start_ms: u64,
    spent: u64,
) -> Value {
    json!({ "reportId": format!("r{round}-{tenant}"), "region": "eu", "tenant": tenant, "pool": "api",
            "windowStartMs": window_start_ms, "leases": [{ "leaseId": lease, "spent": spent }],
            "fallbackAdmitted": round, "agentId": "eu-bench",
            "incarnation": LeaseId::from_parts(1, u128::MAX) })
}

/// One round, every pool reported once: (CPU seconds, wall seconds).
async fn round(
    base: &str,
    client: &reqwest::Client,
    leases: &[(TenantId, LeaseId, u64)],
    number: usize,
    batched: bool,
) -> (f64, f64) {
    let reports: Vec<Value> = leases
        .iter()
        .map(|(tenant, lease, start)| report(number, tenant, *lease, *start, number as u64))
        .collect();
    measured(async {
        if batched {
            for batch in reports.chunks(MAX_REPORTS_PER_BATCH) {
                let answer = agent_post(
                    client,
                    base,
                    "/v1/reports/batch",
                    &json!({ "reports": batch }),
                )
                .await;
                let taken = answer["results"]
                    .as_array()
                    .expect("results")
                    .iter()
                    .filter(|result| result["receipt"]["duplicate"] == false)
                    .count();
                assert_eq!(taken, batch.len(), "{answer}");
            }
        } else {
            for report in &reports {
                let answer = client
                    .post(format!("{base}/v1/reports"))
                    .bearer_auth(AGENT)
                    .json(report)
                    .send()
                    .await
                    .expect("report");
                let status = answer.status();
                assert!(
                    status.is_success(),
                    "{status}: {}",
                    answer.text().await.unwrap_or_default()
                );
            }
        }
    })
    .await
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let pools: usize = std::env::var("REPORT_POOLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000);
    let (base, client, _stop) = serve(pools).await;
    let leases = grant_each(&base, &client, pools).await;
    let totals = alternate(|number, batched| round(&base, &client, &leases, number, batched)).await;
    // Every round reached the ledger: the last (a batch) is what a pool's window shows.
    let (status, windows) = {
        let answer = client
            .get(format!("{base}/v1/pools/{}/api/windows?last=1", tenant(0)))
            .bearer_auth(OPERATOR)
            .send()
            .await
            .expect("windows");
        (answer.status(), answer.json::<Value>().await.expect("json"))
    };
    assert!(status.is_success(), "{windows}");
    assert_eq!(
        windows["windows"][0]["spent"],
        2 * ROUNDS as u64,
        "{windows}"
    );

    print_shapes(
        "reports",
        "report",
        "one call per report (ceiling)",
        pools,
        (pools * ROUNDS) as f64,
        totals,
    );
}
