//! Allot's regional limiter beside a peer, Kuadrant's Limitador (the `limitador` library, 0.14, its
//! `AsyncRedisStorage` through `AsyncRateLimiter::check_rate_limited_and_update`), with the same
//! limits, the same Redis and the same concurrency, in the same run, and both against the store's
//! ceiling: a raw `FCALL` of Allot's decision function with the same keys and arguments.
//!
//! Two shapes. `1 rule`: per user, N requests per 60 s window. `3 rules`: the same per user, per
//! route and per tenant (all callers share the route's and the tenant's counters). N is so large
//! that every decision admits (the bench measures the cost of a decision, not denials). Allot
//! enforces each limit as a `fixed_window` rule (the same semantics as Limitador's counters), all of
//! a request's rules in one atomic call; Limitador checks and then updates its counters (not atomic
//! together). Each caller is one user.
//!
//! Per path and concurrency: decisions/s, p50 and p99 latency, CPU per decision of this process
//! (the client side: `/proc/self/stat`) and of Redis (`INFO cpu`), and Redis commands per decision
//! (`INFO commandstats`). Paths run in alternating rounds so load that comes and goes hits all alike.
//!
//! `--instructions` measures the same paths in instructions the Redis process executes per decision,
//! with Redis under valgrind's callgrind ([`instructions`]): a count that does not move with the
//! machine's load, as CPU time does on a shared machine.
//!
//! Run with `scripts/bench-peer` (installs libclang-dev, which Limitador's bundled RocksDB needs to
//! build, and valgrind). Not a test: nothing asserts a timing.

use std::collections::HashMap;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use allot_region_agent::clock::Stopwatch;
use allot_region_agent::limiter::{
    Limiter, LimiterConfig, PlannedBatch, RedisStore, RedisStoreConfig, plan_request,
};
use allot_shared::contract::{AdmissionRequest, Principal, PrincipalType};
use allot_shared::ids::{DecisionId, RouteGroup, TenantId};
use allot_shared::keys::{IpPrefixes, Pepper};
use allot_shared::policy::{PolicyBundle, parse_bundle};
use limitador::AsyncRateLimiter;
use limitador::limit::{Context, Expression, Limit, Namespace};
use limitador::storage::redis::AsyncRedisStorage;

mod instructions;

/// Requests per user per window: never reached in a run.
const LIMIT: u64 = 10_000_000_000;
const WINDOW_S: u64 = 60;
/// One measuring round of one path, rounds per path, and the warm-up.
const ROUND: Duration = Duration::from_millis(500);
const ROUNDS: usize = 6;
const WARM_UP: Duration = Duration::from_millis(300);
/// Latencies kept per caller and round (I10).
const MAX_SAMPLES_PER_CALLER: usize = 1_000_000;

/// What one decision enforces.
#[derive(Clone, Copy, PartialEq, Eq)]
enum Shape {
    /// Per user.
    OneRule,
    /// Per user, per route and per tenant.
    ThreeRules,
}

impl Shape {
    fn rules(self) -> usize {
        match self {
            Shape::OneRule => 1,
            Shape::ThreeRules => 3,
        }
    }

    /// Limitador's namespace for the shape: its limits apply to every check in it.
    fn namespace(self) -> &'static str {
        match self {
            Shape::OneRule => "bench-1",
            Shape::ThreeRules => "bench-3",
        }
    }

    /// Allot's bundle for the shape.
    fn bundle(self) -> Arc<PolicyBundle> {
        let window_ms = WINDOW_S * 1_000;
        let rule = |id: &str, scope: &str| {
            let mut rule = serde_json::json!({ "id": id, "scope": scope,
                "algorithm": "fixed_window", "limit": LIMIT, "windowMs": window_ms,
                "failMode": "closed" });
            // The tenant's own limit covers every route.
            if scope != "tenant" {
                rule["routeGroup"] = serde_json::json!("read");
            }
            rule
        };
        let rules = match self {
            Shape::OneRule => vec![rule("per-user", "user")],
            Shape::ThreeRules => vec![
                rule("per-user", "user"),
                rule("per-route", "route"),
                rule("per-tenant", "tenant"),
            ],
        };
        let text = serde_json::json!({ "rules": rules }).to_string();
        Arc::new(
            parse_bundle(&text)
                .expect("valid")
                .into_file_bundle()
                .expect("sealed"),
        )
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
enum Path {
    Raw,
    /// The client path with every decision in a call of its own (`--coalesce-hot-keys false`).
    Allot,
    /// The client path as configured by default: coalescing on (a tenant's decisions share calls).
    AllotCoalescing,
    Limitador,
}

impl Path {
    fn name(self) -> &'static str {
        match self {
            Path::Raw => "raw FCALL",
            Path::Allot => "allot",
            Path::AllotCoalescing => "allot coalescing",
            Path::Limitador => "limitador",
        }
    }

    /// Every path, the ceiling first and the peer last.
    const ALL: [Path; 4] = [
        Path::Raw,
        Path::Allot,
        Path::AllotCoalescing,
        Path::Limitador,
    ];
}

/// What the rounds of one path measured.
#[derive(Default)]
struct Samples {
    latencies_us: Vec<u64>,
    seconds: f64,
    process_cpu_s: f64,
    redis_cpu_s: f64,
    redis_commands: u64,
    /// Commands by name (`INFO` itself left out), scripts' inner calls included.
    redis_by_command: std::collections::BTreeMap<String, u64>,
    refused: u64,
}

impl Samples {
    fn decisions(&self) -> f64 {
        (self.latencies_us.len() as f64).max(1.0)
    }

    fn per_second(&self) -> f64 {
        self.latencies_us.len() as f64 / self.seconds.max(f64::MIN_POSITIVE)
    }

    fn percentile(&mut self, fraction: f64) -> u64 {
        if self.latencies_us.is_empty() {
            return 0;
        }
        self.latencies_us.sort_unstable();
        let last = self.latencies_us.len() - 1;
        self.latencies_us[(((last as f64) * fraction).round() as usize).min(last)]
    }
}

#[derive(Clone)]
struct Subjects {
    limiter: Arc<Limiter>,
    coalescing: Arc<Limiter>,
    store: Arc<RedisStore>,
    raw: redis::aio::MultiplexedConnection,
    bundle: Bundles,
    limitador: Arc<AsyncRateLimiter>,
}

/// Allot's bundle of each shape.
#[derive(Clone)]
struct Bundles {
    one_rule: Arc<PolicyBundle>,
    three_rules: Arc<PolicyBundle>,
}

impl Bundles {
    fn of(&self, shape: Shape) -> Arc<PolicyBundle> {
        match shape {
            Shape::OneRule => self.one_rule.clone(),
            Shape::ThreeRules => self.three_rules.clone(),
        }
    }
}

fn planned(bundle: &PolicyBundle, caller: usize) -> PlannedBatch<'_> {
    let request = AdmissionRequest {
        request_id: DecisionId::parse(&format!("peer-{caller}")).expect("id"),
        tenant_id: TenantId::parse("atlas").expect("tenant"),
        principal: Principal {
            kind: PrincipalType::User,
            id: format!("U-{caller}"),
            api_key_id: None,
        },
        route_group: RouteGroup::parse("read").expect("route"),
        method: "GET".to_owned(),
        cost_hint: 1,
        policy_epoch: None,
        dry_run: false,
        metered: false,
    };
    let pepper = Pepper::new(b"peer-bench-pepper-0123".to_vec()).expect("pepper");
    plan_request(bundle, &request, &pepper, IpPrefixes::default(), 30_000)
        .expect("plannable")
        .expect("the rule applies")
}

/// This process's CPU time so far, seconds (user + system, from `/proc/self/stat`).
fn process_cpu_seconds() -> f64 {
    let stat = std::fs::read_to_string("/proc/self/stat").unwrap_or_default();
    // Fields after the command name (which may hold spaces) start after the last ')'.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    // utime and stime are fields 14 and 15 of the whole line: 12 and 13 after the name.
    let ticks: u64 = [11, 12]
        .iter()
        .filter_map(|i| fields.get(*i).and_then(|f| f.parse::<u64>().ok()))
        .sum();
    let per_second = clock_ticks_per_second();
    ticks as f64 / per_second
}

fn clock_ticks_per_second() -> f64 {
    std::process::Command::new("getconf")
        .arg("CLK_TCK")
        .output()
        .ok()
        .and_then(|o| String::from_utf8(o.stdout).ok())
        .and_then(|s| s.trim().parse::<f64>().ok())
        .unwrap_or(100.0)
}

/// Redis's CPU seconds, total commands and commands by name so far (`INFO`).
async fn redis_totals(
    connection: &mut redis::aio::MultiplexedConnection,
) -> (f64, u64, std::collections::BTreeMap<String, u64>) {
    let info: String = redis::cmd("INFO")
        .arg("everything")
        .query_async(connection)
        .await
        .expect("INFO");
    let mut cpu = 0.0;
    let mut commands = 0;
    let mut by_command = std::collections::BTreeMap::new();
    for line in info.lines() {
        if let Some(value) = line
            .strip_prefix("used_cpu_sys:")
            .or_else(|| line.strip_prefix("used_cpu_user:"))
        {
            cpu += value.trim().parse::<f64>().unwrap_or(0.0);
        }
        if let Some(stat) = line.strip_prefix("cmdstat_")
            && let Some((name, rest)) = stat.split_once(':')
            && let Some(calls) = rest
                .split(',')
                .find_map(|field| field.strip_prefix("calls="))
        {
            let calls = calls.parse::<u64>().unwrap_or(0);
            commands += calls;
            if name != "info" {
                by_command.insert(name.to_owned(), calls);
            }
        }
    }
    (cpu, commands, by_command)
}

async fn measure(
    shape: Shape,
    path: Path,
    callers: usize,
    run: Duration,
    subjects: &Subjects,
    samples: &mut Samples,
) {
    let mut info = subjects.raw.clone();
    let (redis_cpu_before, commands_before, by_command_before) = redis_totals(&mut info).await;
    let process_before = process_cpu_seconds();
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for caller in 0..callers {
        let subjects = subjects.clone();
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let Subjects {
                limiter,
                coalescing,
                store,
                mut raw,
                bundle,
                limitador,
            } = subjects;
            let bundle = bundle.of(shape);
            let planned = planned(&bundle, caller);
            assert_eq!(
                planned.batch.rules().len(),
                shape.rules(),
                "every rule applies"
            );
            let fcall = store.decide_command(&planned.batch);
            let namespace = Namespace::from(shape.namespace());
            let values = HashMap::from([
                ("user".to_owned(), format!("U-{caller}")),
                ("route".to_owned(), "read".to_owned()),
                ("tenant".to_owned(), "atlas".to_owned()),
            ]);
            let mut latencies_us = Vec::with_capacity(50_000);
            let mut refused = 0u64;
            while !stop.load(Ordering::Relaxed) {
                let stopwatch = Stopwatch::start();
                let admitted = match path {
                    Path::Raw => {
                        let reply: redis::Value = fcall.query_async(&mut raw).await.expect("FCALL");
                        allot_region_agent::limiter::decide_reply_admits(&reply)
                    }
                    Path::Allot | Path::AllotCoalescing => {
                        let client = if path == Path::Allot {
                            &limiter
                        } else {
                            &coalescing
                        };
                        let decision = client.decide(&planned, None).await;
                        decision.allowed() && decision.degraded.is_none()
                    }
                    Path::Limitador => {
                        let context = Context::from(values.clone());
                        limitador
                            .check_rate_limited_and_update(&namespace, &context, 1)
                            .await
                            .is_ok_and(|result| !result.limited)
                    }
                };
                if !admitted {
                    refused += 1;
                    tokio::task::yield_now().await;
                }
                if latencies_us.len() < MAX_SAMPLES_PER_CALLER {
                    latencies_us
                        .push(u64::try_from(stopwatch.elapsed().as_micros()).unwrap_or(u64::MAX));
                }
            }
            (latencies_us, refused)
        }));
    }
    let stopwatch = Stopwatch::start();
    tokio::time::sleep(run).await;
    stop.store(true, Ordering::Relaxed);
    for task in tasks {
        let (latencies, refused) = task.await.expect("the caller finishes");
        samples.latencies_us.extend(latencies);
        samples.refused += refused;
    }
    samples.seconds += stopwatch.elapsed().as_secs_f64();
    samples.process_cpu_s += process_cpu_seconds() - process_before;
    let (redis_cpu_after, commands_after, by_command_after) = redis_totals(&mut info).await;
    samples.redis_cpu_s += redis_cpu_after - redis_cpu_before;
    for (name, calls) in by_command_after {
        let before = by_command_before.get(&name).copied().unwrap_or(0);
        *samples.redis_by_command.entry(name).or_default() += calls.saturating_sub(before);
    }
    // The first INFO is itself counted.
    samples.redis_commands += commands_after.saturating_sub(commands_before + 1);
}

/// Both limiters, the raw connection and the bundles, on the Redis at `url`; `patient`: deadlines
/// for a Redis that runs tens of times slower than usual (under callgrind), so that nothing
/// degrades.
async fn subjects(url: &str, patient: bool) -> Subjects {
    let (store_config, limiter_config) = if patient {
        let long = Duration::from_secs(30);
        (
            RedisStoreConfig {
                call_timeout: long,
                connect_timeout: long,
                ..RedisStoreConfig::default()
            },
            LimiterConfig {
                decision_budget: long,
                acquire_wait: long,
                ..LimiterConfig::default()
            },
        )
    } else {
        (RedisStoreConfig::default(), LimiterConfig::default())
    };
    let store = Arc::new(
        RedisStore::connect(
            url,
            RedisStoreConfig {
                coalesce: false,
                ..store_config
            },
        )
        .await
        .expect("connects"),
    );
    let limiter =
        Arc::new(Limiter::new(store.clone(), limiter_config.clone()).expect("the config is valid"));
    let coalescing_store = Arc::new(
        RedisStore::connect(
            url,
            RedisStoreConfig {
                coalesce: true,
                ..store_config
            },
        )
        .await
        .expect("connects"),
    );
    let coalescing =
        Arc::new(Limiter::new(coalescing_store, limiter_config).expect("the config is valid"));
    let raw = redis::Client::open(url)
        .expect("url")
        .get_multiplexed_async_connection()
        .await
        .expect("connects");
    let bundle = Bundles {
        one_rule: Shape::OneRule.bundle(),
        three_rules: Shape::ThreeRules.bundle(),
    };
    let limitador = AsyncRateLimiter::new_with_storage(Box::new(
        AsyncRedisStorage::new(url)
            .await
            .expect("Limitador connects"),
    ));
    for (shape, variables) in [
        (Shape::OneRule, &["user"][..]),
        (Shape::ThreeRules, &["user", "route", "tenant"][..]),
    ] {
        for variable in variables {
            limitador.add_limit(Limit::new(
                shape.namespace(),
                LIMIT,
                WINDOW_S,
                [],
                [Expression::parse(variable).expect("a CEL variable")],
            ));
        }
    }
    Subjects {
        limiter,
        coalescing,
        store,
        raw,
        bundle,
        limitador: Arc::new(limitador),
    }
}

/// The comparison, start to end. Long by design: a benchmark script whose steps (start Redis, set up
/// both limiters, run each shape, print the table) read in order. With `--instructions`, instead,
/// Redis runs under callgrind and each path is measured in instructions per decision.
#[tokio::main(flavor = "multi_thread")]
async fn main() {
    if std::env::args().any(|arg| arg == "--instructions") {
        instructions::run().await;
        return;
    }
    let server = allot_testkit::RedisServer::start();
    let subjects = subjects(&server.url(), false).await;
    println!(
        "{:>6} {:>8} {:>12} {:>12} {:>7} {:>7} {:>6} {:>13} {:>13} {:>12} {:>8}",
        "rules",
        "callers",
        "path",
        "decisions/s",
        "p50 µs",
        "p99 µs",
        "ratio",
        "client µs CPU",
        "Redis µs CPU",
        "Redis cmds",
        "refused"
    );
    for (shape, callers) in [
        (Shape::OneRule, 1usize),
        (Shape::OneRule, 32),
        (Shape::ThreeRules, 1),
        (Shape::ThreeRules, 32),
    ] {
        let rules = shape.rules();
        let paths = Path::ALL;
        let mut warm_up = Samples::default();
        for path in paths {
            measure(shape, path, callers, WARM_UP, &subjects, &mut warm_up).await;
        }
        let mut samples: Vec<Samples> = paths.iter().map(|_| Samples::default()).collect();
        for _ in 0..ROUNDS {
            for (path, samples) in paths.iter().zip(samples.iter_mut()) {
                measure(shape, *path, callers, ROUND, &subjects, samples).await;
            }
        }
        let raw_per_second = samples[0].per_second().max(1.0);
        for (path, samples) in paths.iter().zip(samples.iter_mut()) {
            let per_second = samples.per_second();
            let ratio = per_second / raw_per_second;
            let (p50, p99) = (samples.percentile(0.50), samples.percentile(0.99));
            let decisions = samples.decisions();
            let client_cpu_us = samples.process_cpu_s * 1e6 / decisions;
            let redis_cpu_us = samples.redis_cpu_s * 1e6 / decisions;
            let commands = samples.redis_commands as f64 / decisions;
            let by_command = samples
                .redis_by_command
                .iter()
                .filter(|(_, calls)| **calls as f64 / decisions >= 0.01)
                .map(|(name, calls)| format!("{name} {:.2}", *calls as f64 / decisions))
                .collect::<Vec<_>>()
                .join(", ");
            println!(
                "{rules:>6} {callers:>8} {:>12} {per_second:>12.0} {p50:>7} {p99:>7} {ratio:>6.2} {client_cpu_us:>13.1} {redis_cpu_us:>13.1} {commands:>12.2} {:>8}  {by_command}",
                path.name(),
                samples.refused
            );
            println!(
                "BENCH {}",
                serde_json::json!({
                    "bench": "peer", "rules": rules, "callers": callers, "path": path.name(),
                    "decisionsPerSecond": per_second.round(), "p50Us": p50, "p99Us": p99,
                    "ratio": (ratio * 100.0).round() / 100.0,
                    "clientCpuUsPerDecision": (client_cpu_us * 10.0).round() / 10.0,
                    "redisCpuUsPerDecision": (redis_cpu_us * 10.0).round() / 10.0,
                    "redisCommandsPerDecision": (commands * 100.0).round() / 100.0,
                    "redisCommandsByName": by_command,
                    "refused": samples.refused,
                })
            );
        }
    }
}
