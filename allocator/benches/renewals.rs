//! An agent's renewal round: every pool asking for its next lease, one call per pool
//! (`POST /v1/grants`, the ceiling, how agents renewed before) beside the round in as few calls as
//! the batch bound allows (`POST /v1/grants/batch`). The real allocator in this process (embedded
//! store, SQLite ledger), `RENEWAL_POOLS` pools (default 1,000), each round asking every pool once
//! with a fresh lease id, over loopback HTTP one call at a time as an agent's sender does. CPU is
//! the allocator's alone: its runtime's threads and the SQLite ledger's workers (grants are fed to
//! the ledger), not the calling client's; `x one by one`: CPU per grant over the ceiling's, in the
//! same run. Run with `cargo bench -p allot-allocator --bench renewals`. Prints one JSON object per
//! line for the report, and a table.

mod common;

use allot_shared::ids::LeaseId;
use allot_shared::wire::MAX_GRANTS_PER_BATCH;
use serde_json::{Value, json};

use common::{OPERATOR, ROUNDS, agent_post, alternate, measured, print_shapes, serve, tenant};

/// Tokens each renewal asks for (the pools' chunk).
const WANT_TOKENS: u64 = 100;

fn ask(round: usize, pool: usize) -> Value {
    let lease = LeaseId::from_parts(1, ((round as u128) << 32) | pool as u128);
    json!({ "leaseId": lease, "tenant": tenant(pool), "pool": "api", "region": "eu",
            "want": WANT_TOKENS })
}

/// One round, every pool renewed once: (CPU seconds, wall seconds).
async fn round(
    base: &str,
    client: &reqwest::Client,
    pools: usize,
    number: usize,
    batched: bool,
) -> (f64, f64) {
    let asks: Vec<Value> = (0..pools).map(|pool| ask(number, pool)).collect();
    measured(async {
        if batched {
            for batch in asks.chunks(MAX_GRANTS_PER_BATCH) {
                let answer = agent_post(
                    client,
                    base,
                    "/v1/grants/batch",
                    &json!({ "grants": batch }),
                )
                .await;
                let granted = answer["results"]
                    .as_array()
                    .expect("results")
                    .iter()
                    .filter(|result| result["grant"]["granted"] == WANT_TOKENS)
                    .count();
                assert_eq!(granted, batch.len(), "{answer}");
            }
        } else {
            for ask in &asks {
                let answer = agent_post(client, base, "/v1/grants", ask).await;
                assert_eq!(answer["granted"], WANT_TOKENS, "{answer}");
            }
        }
    })
    .await
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let pools: usize = std::env::var("RENEWAL_POOLS")
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(1_000);
    let (base, client, _stop) = serve(pools).await;
    // Every pool's worker warm, as in an agent's steady state.
    round(&base, &client, pools, 0, true).await;
    let totals = alternate(|number, batched| round(&base, &client, pools, number, batched)).await;
    // Every round was granted: the first pool's window shows each renewal.
    let answer: Value = client
        .get(format!("{base}/v1/pools/{}/api", tenant(0)))
        .bearer_auth(OPERATOR)
        .send()
        .await
        .expect("pool")
        .json()
        .await
        .expect("json");
    let granted = answer["window"]["grantedByRegion"]["eu"].as_u64();
    assert_eq!(
        granted,
        Some((2 * ROUNDS as u64 + 1) * WANT_TOKENS),
        "{answer}"
    );

    print_shapes(
        "renewals",
        "grant",
        "one call per renewal (ceiling)",
        pools,
        (pools * ROUNDS) as f64,
        totals,
    );
}
