//! Accuracy against an ideal global limiter, through real agents.
//!
//! Two regions share one global pool: a real allocator on a real etcd (SQLite ledger), two region
//! agents with the shipped limiter defaults, each on its own real Redis (a roomy per-user rule puts
//! the regional script call on every decision), gateways calling the agents' HTTP API on loopback.
//! The load is open-loop and drawn from a seed: each window's demand is 0.4x to 2.5x the pool's
//! limit, 80 % of it at the hot region, which changes with probability 0.3 at each window; within a
//! window each region's requests bunch into bursts (tenths of the window four times as busy as the
//! rest, chosen at random per region).
//!
//! The ideal is one perfectly informed global counter deciding the same requests: per window, the
//! first `limit` requests in the order they were sent are admitted, the rest denied. A decision is
//! wrong when the agent's differs from the ideal's: a false deny (a token was left in the window's
//! limit and the agent said no) or a false admit (the ideal spent the limit on earlier requests,
//! which the agents refused; a window overshoots only where its false admits outnumber its false
//! denies). A request the agent failed to answer counts as a denial. The per-window error is
//! (admitted - ideal admitted) / limit.
//! Beside it, computed on the same requests (not run): a static split, each region deciding alone
//! against its fixed half of the limit, the usual alternative to leasing.
//!
//! Requests are assigned to windows by when they were sent; one that was answered in the next window
//! is straddling (the agent may have decided it in either): counted, and judged in neither (the
//! ideal does not see it either). The first window is a warm-up and is not judged. Once the last
//! lease has ended the agents report, and the ledger's count of admits and its overshoot column
//! are printed beside the bench's own count.
//!
//! Prints a table and `BENCH {json}` lines: bench = "accuracy" per shape, "accuracy_window" per
//! judged window. `python3 scripts/bench-report.py accuracy` renders docs/accuracy.md from them.
//! `ALLOT_BENCH_SEED` picks the load (default 1).

use std::sync::{Arc, Mutex};
use std::time::Duration;

use allot_region_agent::clock::monotonic_now;
use allot_region_agent::limiter::{LimiterConfig, RedisStoreConfig};
use allot_testkit::{EtcdCluster, RedisServer};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use serde_json::{Value, json};

#[path = "../tests/integration/stack/mod.rs"]
mod stack;

/// One pool configuration under the same kind of load.
struct Shape {
    name: &'static str,
    window_ms: u64,
    limit: u64,
    chunk: u64,
    lease_ttl_ms: u64,
    /// Judged windows (after one of warm-up).
    windows: u64,
}

const SHAPES: [Shape; 3] = [
    Shape {
        name: "1s-chunk50",
        window_ms: 1_000,
        limit: 500,
        chunk: 50,
        lease_ttl_ms: 1_000,
        windows: 20,
    },
    Shape {
        name: "1s-chunk10",
        window_ms: 1_000,
        limit: 500,
        chunk: 10,
        lease_ttl_ms: 1_000,
        windows: 20,
    },
    Shape {
        name: "5s-chunk100",
        window_ms: 5_000,
        limit: 2_500,
        chunk: 100,
        lease_ttl_ms: 5_000,
        windows: 6,
    },
];

const REGIONS: [&str; 2] = ["eu", "us"];
/// Window demand as a multiple of the limit, drawn uniformly.
const DEMAND_LEVELS: [f64; 4] = [0.4, 0.9, 1.3, 2.5];
/// The hot region's share of a window's demand.
const HOT_SHARE: f64 = 0.8;
/// The chance the hot region changes at a window's start.
const HOT_CHANGE: f64 = 0.3;
/// Bursts: a window is cut into this many slots; a busy slot gets `BURST_WEIGHT` times the requests
/// of a quiet one; a slot is busy with probability `BURST_CHANCE`.
const SLOTS: u64 = 10;
const BURST_WEIGHT: f64 = 4.0;
const BURST_CHANCE: f64 = 0.3;
/// Requests in flight at once (the gateways' connections).
const IN_FLIGHT: usize = 256;

/// A request to send: when (µs after the first window's start) and to which region.
#[derive(Clone, Copy)]
struct Planned {
    offset_us: u64,
    region: usize,
}

/// What the agent said.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Verdict {
    Admitted,
    /// Denied: the pool (or a rule) had nothing left.
    Denied,
    /// 503 `LIMITER_UNAVAILABLE`: the store or the pool could not be reached in time.
    Unavailable,
    /// Any other answer, or none.
    NoDecision,
}

/// One request's outcome, times in µs since the Unix epoch.
#[derive(Clone, Copy)]
struct Outcome {
    sent_us: u64,
    answered_us: u64,
    region: usize,
    verdict: Verdict,
}

/// Wall-clock µs since the Unix epoch, at µs resolution: the agents' wall clock when the bench
/// started, advanced by the monotonic clock.
#[derive(Clone, Copy)]
struct MicroClock {
    base: tokio::time::Instant,
    base_us: u64,
}

impl MicroClock {
    // The agents' clock reads whole ms; windows are judged in µs, so the base is read at µs
    // resolution (a base up to 1 ms behind would count a window's first requests in the one
    // before).
    #[expect(
        clippy::disallowed_methods,
        reason = "the bench times requests against the agents' wall clock"
    )]
    fn start() -> Self {
        let since_epoch = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .unwrap_or_default();
        Self {
            base: monotonic_now(),
            base_us: u64::try_from(since_epoch.as_micros()).unwrap_or(u64::MAX),
        }
    }

    fn now_us(&self) -> u64 {
        let elapsed = monotonic_now().saturating_duration_since(self.base);
        self.base_us + u64::try_from(elapsed.as_micros()).unwrap_or(u64::MAX)
    }

    /// The monotonic instant of wall-clock `us`.
    fn instant_at(&self, us: u64) -> tokio::time::Instant {
        self.base + Duration::from_micros(us.saturating_sub(self.base_us))
    }
}

/// The shape's load: warm-up window and judged windows, sorted by send time.
fn plan(shape: &Shape, rng: &mut StdRng) -> Vec<Planned> {
    let window_us = shape.window_ms * 1_000;
    let slot_us = window_us / SLOTS;
    let mut hot = 0usize;
    let mut planned = Vec::new();
    for window in 0..=shape.windows {
        let level = DEMAND_LEVELS[rng.random_range(0..DEMAND_LEVELS.len())];
        if rng.random_bool(HOT_CHANGE) {
            hot = 1 - hot;
        }
        let demand = shape.limit as f64 * level;
        for region in 0..REGIONS.len() {
            let share = if region == hot {
                HOT_SHARE
            } else {
                1.0 - HOT_SHARE
            };
            let weights: Vec<f64> = (0..SLOTS)
                .map(|_| {
                    if rng.random_bool(BURST_CHANCE) {
                        BURST_WEIGHT
                    } else {
                        1.0
                    }
                })
                .collect();
            let total_weight: f64 = weights.iter().sum();
            let requests = (demand * share).round() as u64;
            for _ in 0..requests {
                let mut pick = rng.random_range(0.0..total_weight);
                let slot = weights
                    .iter()
                    .position(|w| {
                        pick -= w;
                        pick < 0.0
                    })
                    .unwrap_or(weights.len() - 1) as u64;
                let offset_us = window * window_us + slot * slot_us + rng.random_range(0..slot_us);
                planned.push(Planned { offset_us, region });
            }
        }
    }
    planned.sort_by_key(|p| p.offset_us);
    planned
}

/// The gateways: the agents' URLs by region, one HTTP client, the clock requests are timed by.
struct Gateways {
    agents: [String; 2],
    http: reqwest::Client,
    clock: MicroClock,
}

/// Sends `planned` at their times from `start_us` (a window's start), open loop; every outcome.
async fn run(
    planned: Vec<Planned>,
    start_us: u64,
    tenant: &str,
    gateways: &Gateways,
) -> Vec<Outcome> {
    let outcomes = Arc::new(Mutex::new(Vec::with_capacity(planned.len())));
    let in_flight = Arc::new(tokio::sync::Semaphore::new(IN_FLIGHT));
    let clock = gateways.clock;
    let mut tasks = tokio::task::JoinSet::new();
    for (n, request) in planned.into_iter().enumerate() {
        tokio::time::sleep_until(clock.instant_at(start_us + request.offset_us)).await;
        let permit = in_flight.clone().acquire_owned().await.expect("semaphore");
        let (http, url, outcomes) = (
            gateways.http.clone(),
            gateways.agents[request.region].clone(),
            outcomes.clone(),
        );
        let body = json!({ "requestId": format!("{tenant}-{n}"), "tenantId": tenant,
            "principal": { "type": "user", "id": format!("U-{}", n % 97) },
            "routeGroup": "read", "method": "GET" });
        tasks.spawn(async move {
            let sent_us = clock.now_us();
            let verdict = admit(&http, &url, &body).await;
            let answered_us = clock.now_us();
            drop(permit);
            outcomes.lock().expect("outcomes").push(Outcome {
                sent_us,
                answered_us,
                region: request.region,
                verdict,
            });
        });
    }
    while tasks.join_next().await.is_some() {}
    std::mem::take(&mut *outcomes.lock().expect("outcomes"))
}

async fn admit(http: &reqwest::Client, url: &str, body: &Value) -> Verdict {
    let Ok(response) = http
        .post(format!("{url}/v1/admit"))
        .bearer_auth(stack::GATEWAY)
        .json(body)
        .send()
        .await
    else {
        return Verdict::NoDecision;
    };
    let Ok(decision) = response.json::<Value>().await else {
        return Verdict::NoDecision;
    };
    match (&decision["allowed"], decision["reason"].as_str()) {
        (Value::Bool(true), _) => Verdict::Admitted,
        (Value::Bool(false), Some("RATE_EXCEEDED")) => Verdict::Denied,
        (Value::Bool(false), Some("LIMITER_UNAVAILABLE")) => Verdict::Unavailable,
        _ => Verdict::NoDecision,
    }
}

/// One judged window.
#[derive(Default, Clone)]
struct WindowTally {
    demand: [u64; 2],
    admitted: [u64; 2],
}

impl WindowTally {
    /// What the ideal admitted: the first `limit` requests.
    fn ideal(&self, limit: u64) -> u64 {
        (self.demand[0] + self.demand[1]).min(limit)
    }

    /// What the static split admitted: each region the first of its `halves`.
    fn static_split(&self, halves: [u64; 2]) -> u64 {
        self.demand[0].min(halves[0]) + self.demand[1].min(halves[1])
    }
}

/// The static split's halves of `limit`, by region.
fn halves(limit: u64) -> [u64; 2] {
    [limit.div_ceil(2), limit / 2]
}

/// How a shape's decisions compare with the ideal's.
#[derive(Default)]
struct Judgement {
    requests: u64,
    false_admits: u64,
    false_denies: u64,
    failed: u64,
    unavailable: u64,
    straddling: u64,
    static_false_admits: u64,
    static_false_denies: u64,
    /// Every request the agents admitted, judged or not (the ledger's count to compare).
    admitted_all: u64,
    /// False denies by when in its window the request was sent, in tenths of the window.
    false_denies_by_tenth: [u64; 10],
    windows: Vec<WindowTally>,
}

/// Judges `outcomes` (sent from `start_us`, a window's start) against the ideal and the static
/// split, skipping the warm-up window.
fn judge(mut outcomes: Vec<Outcome>, start_us: u64, shape: &Shape) -> Judgement {
    outcomes.sort_by_key(|o| o.sent_us);
    let window_us = shape.window_ms * 1_000;
    let window_of = |us: u64| us.saturating_sub(start_us) / window_us;
    let half = halves(shape.limit);
    let mut judgement = Judgement {
        windows: vec![WindowTally::default(); shape.windows as usize],
        ..Judgement::default()
    };
    for outcome in outcomes {
        judgement.admitted_all += u64::from(outcome.verdict == Verdict::Admitted);
        let window = window_of(outcome.sent_us);
        // The warm-up window, and anything sent late past the last window, is not judged.
        let Some(tally) = window
            .checked_sub(1)
            .and_then(|w| judgement.windows.get_mut(w as usize))
        else {
            continue;
        };
        // Decided in this window or the next one, by the agent's clock: judged in neither, and
        // left out of the ideal's count too.
        if window_of(outcome.answered_us) != window {
            judgement.straddling += 1;
            continue;
        }
        judgement.requests += 1;
        let region = outcome.region;
        let sent_before = tally.demand[0] + tally.demand[1];
        let ideal = sent_before < shape.limit;
        let static_split = tally.demand[region] < half[region];
        tally.demand[region] += 1;
        let admitted = outcome.verdict == Verdict::Admitted;
        tally.admitted[region] += u64::from(admitted);
        judgement.failed += u64::from(matches!(
            outcome.verdict,
            Verdict::Unavailable | Verdict::NoDecision
        ));
        judgement.unavailable += u64::from(outcome.verdict == Verdict::Unavailable);
        match (admitted, ideal) {
            (true, false) => judgement.false_admits += 1,
            (false, true) => {
                judgement.false_denies += 1;
                let tenth = (outcome.sent_us.saturating_sub(start_us) % window_us) * 10 / window_us;
                judgement.false_denies_by_tenth[tenth as usize] += 1;
            }
            _ => {}
        }
        match (static_split, ideal) {
            (true, false) => judgement.static_false_admits += 1,
            (false, true) => judgement.static_false_denies += 1,
            _ => {}
        }
    }
    judgement
}

fn share_pct(part: u64, whole: u64) -> f64 {
    if whole == 0 {
        0.0
    } else {
        100.0 * part as f64 / whole as f64
    }
}

fn report(shape: &Shape, seed: u64, judgement: &Judgement, ledger: &LedgerTally) {
    let limit = shape.limit as f64;
    let error = |admitted: u64, ideal: u64| (admitted as f64 - ideal as f64) / limit;
    let agent_errors: Vec<f64> = judgement
        .windows
        .iter()
        .map(|w| error(w.admitted[0] + w.admitted[1], w.ideal(shape.limit)))
        .collect();
    let static_errors: Vec<f64> = judgement
        .windows
        .iter()
        .map(|w| error(w.static_split(halves(shape.limit)), w.ideal(shape.limit)))
        .collect();
    let mean_abs = |errors: &[f64]| {
        100.0 * errors.iter().map(|e| e.abs()).sum::<f64>() / errors.len().max(1) as f64
    };
    let worst_under = |errors: &[f64]| 100.0 * errors.iter().copied().fold(0.0f64, f64::min);
    let worst_over = |errors: &[f64]| 100.0 * errors.iter().copied().fold(0.0f64, f64::max);
    let max_overshoot = judgement
        .windows
        .iter()
        .map(|w| (w.admitted[0] + w.admitted[1]).saturating_sub(shape.limit))
        .max()
        .unwrap_or(0);
    let wrong = judgement.false_admits + judgement.false_denies;
    let static_wrong = judgement.static_false_admits + judgement.static_false_denies;
    println!(
        "{:<12} {:>8} {:>7.2}% {:>7} {:>7} {:>6} {:>9.2}% {:>9.2}% {:>7} | static {:>6.2}% {:>8.2}%",
        shape.name,
        judgement.requests,
        share_pct(wrong, judgement.requests),
        judgement.false_admits,
        judgement.false_denies,
        judgement.failed,
        mean_abs(&agent_errors),
        worst_under(&agent_errors),
        max_overshoot,
        share_pct(static_wrong, judgement.requests),
        mean_abs(&static_errors),
    );
    let line = json!({
        "bench": "accuracy", "shape": shape.name, "seed": seed,
        "windowMs": shape.window_ms, "limit": shape.limit, "chunk": shape.chunk,
        "leaseTtlMs": shape.lease_ttl_ms, "windows": shape.windows,
        "requests": judgement.requests, "wrongPct": share_pct(wrong, judgement.requests),
        "falseAdmits": judgement.false_admits, "falseDenies": judgement.false_denies,
        "falseDeniesByTenth": judgement.false_denies_by_tenth,
        "failed": judgement.failed, "unavailable": judgement.unavailable, "straddling": judgement.straddling,
        "meanAbsWindowErrorPct": mean_abs(&agent_errors),
        "worstWindowUnderPct": worst_under(&agent_errors),
        "worstWindowOverPct": worst_over(&agent_errors),
        "maxOvershootTokens": max_overshoot,
        "admittedByAgents": judgement.admitted_all, "ledgerAdmitted": ledger.admitted,
        "ledgerMaxOvershoot": ledger.max_overshoot,
        "staticWrongPct": share_pct(static_wrong, judgement.requests),
        "staticFalseAdmits": judgement.static_false_admits,
        "staticFalseDenies": judgement.static_false_denies,
        "staticMeanAbsWindowErrorPct": mean_abs(&static_errors),
        "staticWorstWindowUnderPct": worst_under(&static_errors),
    });
    println!("BENCH {line}");
    if ledger.admitted != judgement.admitted_all || ledger.max_overshoot > 0 {
        println!(
            "  the ledger counts {} admits (the agents answered {}), overshoot up to {}",
            ledger.admitted, judgement.admitted_all, ledger.max_overshoot
        );
    }
    for (n, w) in judgement.windows.iter().enumerate() {
        let line = json!({
            "bench": "accuracy_window", "shape": shape.name, "window": n + 1,
            "limit": shape.limit, "demand": w.demand, "admitted": w.admitted,
            "ideal": w.ideal(shape.limit), "staticSplit": w.static_split(halves(shape.limit)),
        });
        println!("BENCH {line}");
    }
}

/// What the ledger counted for a shape once the agents reported: the requests admitted over its
/// windows (warm-up included) and the most any window admitted past its limit (its `overshoot`).
struct LedgerTally {
    admitted: u64,
    max_overshoot: u64,
}

/// Waits for the shape's last lease to end (window-clamped leases end with their window), has the
/// agents report, and reads the ledger's rows of the shape's windows.
async fn ledger(
    allocator: &str,
    tenant: &str,
    agents: &[Arc<allot_region_agent::service::Agent>],
    shape: &Shape,
    end_us: u64,
    clock: &MicroClock,
) -> LedgerTally {
    tokio::time::sleep_until(clock.instant_at(end_us) + Duration::from_millis(200)).await;
    for agent in agents {
        agent.send_reports().await;
    }
    let rows = stack::windows(allocator, tenant, "api", shape.windows + 2).await;
    let column = |name: &'static str| rows.iter().filter_map(move |row| row[name].as_u64());
    LedgerTally {
        admitted: column("admitted").sum(),
        max_overshoot: column("overshoot").max().unwrap_or(0),
    }
}

/// The pool's spec on the allocator.
fn pool(shape: &Shape) -> Value {
    json!({ "limit": shape.limit, "windowMs": shape.window_ms, "chunk": shape.chunk,
            "leaseTtlMs": shape.lease_ttl_ms, "fallbackPerRegion": 0, "regions": REGIONS })
}

fn bundle() -> allot_shared::policy::PolicyBundle {
    stack::bundle(&json!({ "rules": [
        { "id": "user-roomy", "scope": "user", "algorithm": "token_bucket",
          "capacityMillis": 100_000_000u64, "refillMillis": 100_000_000u64, "periodMs": 1000,
          "failMode": "closed" },
        { "id": "global-api", "scope": "global", "pool": "api", "failMode": "closed" }
    ]}))
}

/// The first window start at least `lead_ms` from now, µs since the epoch.
fn next_window_start_us(clock: &MicroClock, window_ms: u64, lead_ms: u64) -> u64 {
    let window_us = window_ms * 1_000;
    let earliest = clock.now_us() + lead_ms * 1_000;
    earliest.div_ceil(window_us) * window_us
}

#[tokio::main(flavor = "multi_thread")]
async fn main() {
    let seed = std::env::var("ALLOT_BENCH_SEED")
        .ok()
        .and_then(|s| s.parse().ok())
        .unwrap_or(1u64);
    let etcd = EtcdCluster::single();
    let redis = [RedisServer::start(), RedisServer::start()];
    let dir = tempfile::tempdir().expect("temp dir");
    let allocator = stack::start_allocator(&etcd, dir.path()).await;
    let start_agent = |region: usize| {
        let (allocator, redis) = (&allocator, &redis[region]);
        stack::agent_with(
            REGIONS[region],
            allocator,
            redis,
            bundle(),
            RedisStoreConfig::default(),
            LimiterConfig::default(),
        )
    };
    let agents = [start_agent(0).await, start_agent(1).await];
    let gateways = Gateways {
        agents: [
            stack::serve_agent(agents[0].clone()).await,
            stack::serve_agent(agents[1].clone()).await,
        ],
        http: reqwest::Client::builder()
            .timeout(Duration::from_secs(2))
            .pool_max_idle_per_host(IN_FLIGHT)
            .build()
            .expect("http client"),
        clock: MicroClock::start(),
    };

    println!("accuracy against an ideal global limiter, two regions, seed {seed}");
    println!(
        "{:<12} {:>8} {:>8} {:>7} {:>7} {:>6} {:>10} {:>10} {:>7} | static {:>7} {:>9}",
        "shape",
        "requests",
        "wrong",
        "f.admit",
        "f.deny",
        "failed",
        "mean|err|",
        "worst<",
        "over",
        "wrong",
        "mean|err|"
    );
    let mut rng = StdRng::seed_from_u64(seed);
    for (n, shape) in SHAPES.iter().enumerate() {
        let tenant = format!("acc-{n}");
        stack::put_pool(&allocator, &tenant, "api", &pool(shape)).await;
        let planned = plan(shape, &mut rng);
        let start_us = next_window_start_us(&gateways.clock, shape.window_ms, 500);
        let outcomes = run(planned, start_us, &tenant, &gateways).await;
        let end_us = start_us + (shape.windows + 1) * shape.window_ms * 1_000;
        let ledger = ledger(&allocator, &tenant, &agents, shape, end_us, &gateways.clock).await;
        report(shape, seed, &judge(outcomes, start_us, shape), &ledger);
    }
}
