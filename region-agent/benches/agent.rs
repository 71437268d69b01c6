//! Admissions per second through the agent's HTTP API, beside the ceilings measured in the same run.
//!
//! - `trivial`: an axum endpoint that takes the same POST as an admit (method, bearer header, JSON
//!   body) and answers a constant JSON body: the HTTP stack's limit here for this request.
//! - `lease-only`: a policy with one global rule: tokens come from leases held in memory.
//! - `lease+3-redis`: the same plus three regional rules decided in one Redis script call, through
//!   an agent with the store's defaults: a tenant's decisions that arrive while its call is in
//!   flight share its next call (the three rules share the tenant's slot, and its route and tenant
//!   keys are shared by every caller).
//! - `grpc+3-redis`: the same decisions through Envoy's rate limit service (gRPC, tonic).
//! - `lease+3-redis alone`: `lease+3-redis` through an agent whose store sends every decision in
//!   a call of its own (`--coalesce-hot-keys false`).
//! - `raw-evalsha`: the same decision function and arguments sent straight to Redis, one call per
//!   decision (the store's ceiling; the name is kept for the report's history).
//! - `trivial uds`, `lease-only uds`, `lease+3-redis uds`: the same endpoints and agents over a
//!   Unix domain socket (a gateway on the agent's host), past the kernel's loopback TCP path. Every
//!   row also gives the agent's CPU per decision over `trivial`'s on the same transport.
//! - `open 0.5x`, `open 0.65x`, `open 0.8x`: `lease+3-redis` offered open loop, evenly spaced,
//!   at those fractions of what it decided closed loop at 64 callers: below capacity, where every
//!   request should be decided (64 closed-loop callers are at capacity by construction: by Little's
//!   law their mean wait is 64 over the throughput, past the 10 ms budget whenever fewer than 6,400
//!   are decided per second). Each row also says how busy the whole machine was and how many
//!   requests the load generator sent late (after waiting for a core itself: a burst). These rows
//!   give the agent's thread a core of its own ([`give_the_agent_a_core`]).
//!
//! The allocator is a stub in this process that grants chunks of at most [`CHUNK_TOKENS`] (the agent's hot
//! path is what is measured; allocator throughput has its own bench). It counts grant calls, to show
//! how many allocator calls the admits cost (renewals are prefetched off the request path). Keep-alive HTTP clients, 1 and 64 concurrent callers; each figure is three 1 s slices, taken round-robin with the other figures of its table ([`RUN`]).
//!
//! The agents and the `trivial` endpoint run in this process on a runtime of their own (one worker
//! thread, named [`common::AGENT_THREADS`]; the Redis agent's store connection too, as in the
//! agent), the stub allocator on another. The load generators run in a process of their own: this
//! binary again, started with [`LOAD_ENV`] naming one run ([`Load`]), which prints `START` when its
//! timed run begins and then one `RESULT {json}` line ([`Outcome`]). So no caller shares the
//! agent's process (its allocator, its runtime's threads, its memory), and each row also reports
//! the agent's CPU per decision (user + system of the agent's threads over the timed run, from
//! `/proc/self/task/*/stat`: steadier than throughput on a shared machine) and decisions per
//! second per agent core (decisions over that CPU time). The processes still share the machine's
//! cores with each other and with Redis. HTTP callers are hyper client connections without a pool
//! ([`AdmitConnection`]): the cheapest caller takes the least of the cores the agent shares.
//! Prints a table and `BENCH {json}` lines with bench = "agent", and per caller count one with
//! bench = "agent_limiter": why the Redis agent's limiter did not decide (shed, waited in vain,
//! refused by an open breaker). `ALLOT_BENCH_LOG=1` prints the agent's log (info and above) to
//! stderr.

use std::process::Stdio;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::Duration;

use allot_region_agent::clock::{Stopwatch, SystemClock, monotonic_now};
use allot_region_agent::http::AgentApi;
use allot_region_agent::limiter::{
    InProcessStore, LimiterStats, LimiterStore, RedisStore, RedisStoreConfig, decide_reply_admits,
    plan_request,
};
use allot_shared::keys::{IpPrefixes, Pepper};
use axum::Json;
use axum::routing::post;
use serde::{Deserialize, Serialize};
use serde_json::json;
use tokio::io::AsyncBufReadExt;

/// mimalloc: fewer cycles per allocation than the system allocator on the request path (measured
/// by the agent benchmark, docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// One timed slice of load. Every figure is [`ROUNDS`] slices, taken round-robin with the other
/// figures of its table (a slice of each, then again), so that a machine that slows down or speeds
/// up during the bench moves every figure alike and a ratio compares like with like.
const RUN: Duration = Duration::from_secs(1);

/// Slices per figure (see [`RUN`]).
const ROUNDS: usize = 3;

/// Set in the load generator's process: the [`Load`] it runs, as JSON.
const LOAD_ENV: &str = "ALLOT_BENCH_AGENT_LOAD";

/// One timed run of load, made by the load generator's process.
#[derive(Serialize, Deserialize)]
enum Load {
    /// `callers` keep-alive HTTP clients posting an admit to `url`/`path`.
    Closed {
        url: String,
        path: String,
        callers: u64,
    },
    /// `callers` tonic clients calling Envoy's RLS at `url`.
    Grpc { url: String, callers: u64 },
    /// `callers` tasks sending the decision function straight to the Redis at `redis_url`.
    Raw { redis_url: String, callers: u64 },
    /// Admits posted to `url` open loop at `per_second`.
    Open { url: String, per_second: f64 },
}

/// Answers that were not admits, by why.
#[derive(Debug, Clone, Copy, Default, Serialize, Deserialize)]
struct Refusals {
    /// LIMITER_UNAVAILABLE (gRPC: UNAVAILABLE): the store did not decide within the budget.
    unavailable: u64,
    /// Denied by the global rule although the stand-in allocator always has tokens: the agent's
    /// lease ran dry while its renewal was on the way (what the operations guide's
    /// `AllotRegionDepletedWhilePoolHadTokens` alert watches).
    depleted: u64,
}

impl Refusals {
    fn count(&mut self, answer: Answer) {
        match answer {
            Answer::Admitted => {}
            Answer::Unavailable => self.unavailable += 1,
            Answer::Depleted => self.depleted += 1,
        }
    }

    fn add(&mut self, other: Refusals) {
        self.unavailable += other.unavailable;
        self.depleted += other.depleted;
    }
}

/// What a run of load saw: every answer's latency, how many were refused and why, how long
/// the run took, (open loop) how many were due but not sent and how late the sent ones left, and
/// the CPU the load generator's process spent on the run.
#[derive(Serialize, Deserialize)]
struct Outcome {
    latencies_us: Vec<u64>,
    refusals: Refusals,
    seconds: f64,
    unsent: u64,
    load_cpu_s: f64,
    /// Open loop: requests sent more than [`LATE_SEND`] after they were due (closed loop: 0).
    late_sends: u64,
    /// Open loop: the latest a request was sent after it was due, µs (closed loop: 0).
    max_late_us: u64,
}

mod common;

use allot_testkit::process_cpu_seconds;
use common::{
    AGENT_THREADS, GATEWAY, agent_and_load_runtimes, bundle, envoy_channels, logging_as_deployed,
    machine_cpu_ticks, redis_cpu_seconds, request, rls_request, serve_on_free_port, start_agent,
    stub_allocator, thread_cpu_seconds, threads_named,
};

/// Serves Envoy's RLS v3 for `api` on the agents' runtime; its URL.
async fn serve_grpc_on(agents: &tokio::runtime::Handle, api: AgentApi) -> String {
    agents
        .spawn(async move {
            let listener = tokio::net::TcpListener::bind("127.0.0.1:0")
                .await
                .expect("bind");
            let url = format!("http://{}", listener.local_addr().expect("addr"));
            tokio::spawn(allot_region_agent::grpc::serve_grpc(
                listener,
                api,
                None,
                std::future::pending(),
            ));
            url
        })
        .await
        .expect("the agents' runtime")
}

/// Envoy's RLS v3 path: the agent served over gRPC at `url`, called by `callers` tonic clients
/// over an Envoy's connections ([`envoy_channels`]).
async fn drive_grpc(url: String, callers: u64) -> Outcome {
    use allot_region_agent::grpc::proto::envoy::service::ratelimit::v3::rate_limit_response::Code;
    use allot_region_agent::grpc::proto::envoy::service::ratelimit::v3::rate_limit_service_client::RateLimitServiceClient;
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    let channels = envoy_channels(&url, callers).await;
    for caller in 0..callers {
        let stop = stop.clone();
        let channel = channels[caller as usize % channels.len()].clone();
        tasks.push(tokio::spawn(async move {
            let mut client = RateLimitServiceClient::new(channel);
            let mut latencies = Vec::new();
            let mut refusals = Refusals::default();
            let mut n = caller;
            while !stop.load(Ordering::Relaxed) {
                let request = rls_request(n, 1_000);
                let stopwatch = Stopwatch::start();
                match client.should_rate_limit(request).await {
                    Ok(answer) => {
                        assert_eq!(answer.into_inner().overall_code, Code::Ok as i32);
                    }
                    // A Redis call past the decision budget under a fail-closed rule: counted.
                    Err(status) if status.code() == tonic::Code::Unavailable => {
                        refusals.count(Answer::Unavailable);
                    }
                    Err(status) => panic!("answer: {status:?}"),
                }
                latencies.push(stopwatch.elapsed().as_micros() as u64);
                n += callers;
            }
            (latencies, refusals)
        }));
    }
    collect(tasks, stop).await
}

/// Tells the agents' process that the timed run begins (it reads the agents' and Redis's CPU
/// now); answers the load generator's own CPU seconds so far.
fn announce_start() -> f64 {
    println!("START");
    process_cpu_seconds()
}

/// Lets `tasks` run for [`RUN`], stops them, and gathers what they saw.
async fn collect(
    tasks: Vec<tokio::task::JoinHandle<(Vec<u64>, Refusals)>>,
    stop: Arc<AtomicBool>,
) -> Outcome {
    let load_cpu_before = announce_start();
    let stopwatch = Stopwatch::start();
    tokio::time::sleep(RUN).await;
    stop.store(true, Ordering::Relaxed);
    let seconds = stopwatch.elapsed().as_secs_f64();
    let mut latencies_us = Vec::new();
    let mut refusals = Refusals::default();
    for task in tasks {
        let (caller_latencies, caller_refusals) = task.await.expect("caller");
        latencies_us.extend(caller_latencies);
        refusals.add(caller_refusals);
    }
    Outcome {
        latencies_us,
        refusals,
        seconds,
        unsent: 0,
        load_cpu_s: process_cpu_seconds() - load_cpu_before,
        late_sends: 0,
        max_late_us: 0,
    }
}

/// The longest the agents' process waits for a line from the load generator (I10): its run plus
/// room for starting up and connecting. A generator that overruns it fails the bench.
const LOAD_LINE_TIMEOUT: Duration = Duration::from_secs(60);

/// Runs `load` in a process of its own (this binary, with [`LOAD_ENV`] set) and makes its figure,
/// with the agents' and Redis's CPU (`redis_info`: a connection to the bench's Redis) from the
/// run's start to its result.
async fn measure(load: &Load, redis_info: &mut redis::aio::MultiplexedConnection) -> Sample {
    let this_binary = std::env::current_exe().expect("this binary");
    // Below capacity the load generator stands in for gateways on other hosts: on the core the
    // agent does not have ([`give_the_agent_a_core`]), at a lower priority than Redis there (at
    // capacity, the closed loops, it shares the cores evenly, as the ceilings' load generators do).
    let mut command = if matches!(load, Load::Open { .. }) {
        let mut pinned = tokio::process::Command::new("taskset");
        pinned
            .args(["-c", &OTHER_CORE.to_string(), "nice", "-n"])
            .arg(OPEN_LOOP_NICENESS.to_string())
            .arg(this_binary);
        pinned
    } else {
        tokio::process::Command::new(this_binary)
    };
    let mut child = command
        .env(LOAD_ENV, serde_json::to_string(load).expect("load as JSON"))
        .stdout(Stdio::piped())
        .kill_on_drop(true)
        .spawn()
        .expect("the load generator's process");
    let stdout = child.stdout.take().expect("its stdout");
    let mut lines = tokio::io::BufReader::new(stdout).lines();
    let mut next_line = async || {
        tokio::time::timeout(LOAD_LINE_TIMEOUT, lines.next_line())
            .await
            .expect("the load generator answers within the timeout")
            .expect("the load generator's stdout")
            .expect("a line from the load generator")
    };
    assert_eq!(next_line().await, "START");
    let machine_before = machine_cpu_ticks();
    let agent_cpu_before = thread_cpu_seconds(AGENT_THREADS);
    let redis_cpu_before = redis_cpu_seconds(redis_info).await;
    let result = next_line().await;
    let machine_after = machine_cpu_ticks();
    let redis_cpu_s = redis_cpu_seconds(redis_info).await - redis_cpu_before;
    // The raw store path runs nothing of the agents': what their idle threads spent is not its.
    let agent_cpu_s = match load {
        Load::Raw { .. } => 0.0,
        _ => thread_cpu_seconds(AGENT_THREADS) - agent_cpu_before,
    };
    let status = child.wait().await.expect("the load generator's exit");
    assert!(status.success(), "the load generator failed: {status}");
    let outcome: Outcome = serde_json::from_str(result.strip_prefix("RESULT ").expect("RESULT"))
        .expect("the load generator's result");
    Sample {
        outcome,
        agent_cpu_s,
        redis_cpu_s,
        busy_ticks: machine_after.0.saturating_sub(machine_before.0),
        all_ticks: machine_after.1.saturating_sub(machine_before.1),
    }
}

/// What one or more slices of a load measured, summed.
struct Sample {
    outcome: Outcome,
    agent_cpu_s: f64,
    redis_cpu_s: f64,
    /// The whole machine's busy and total CPU ticks over the slices (`/proc/stat`).
    busy_ticks: u64,
    all_ticks: u64,
}

impl Sample {
    /// Adds `other` to this sample: counts and times added, the latest send the later.
    fn add(&mut self, other: Sample) {
        let (mine, theirs) = (&mut self.outcome, other.outcome);
        mine.latencies_us.extend(theirs.latencies_us);
        mine.refusals.add(theirs.refusals);
        mine.seconds += theirs.seconds;
        mine.unsent += theirs.unsent;
        mine.load_cpu_s += theirs.load_cpu_s;
        mine.late_sends += theirs.late_sends;
        mine.max_late_us = mine.max_late_us.max(theirs.max_late_us);
        self.agent_cpu_s += other.agent_cpu_s;
        self.redis_cpu_s += other.redis_cpu_s;
        self.busy_ticks += other.busy_ticks;
        self.all_ticks += other.all_ticks;
    }

    fn figure(self) -> Figure {
        let Outcome {
            latencies_us: mut latencies,
            refusals,
            seconds,
            unsent,
            load_cpu_s,
            late_sends,
            max_late_us,
        } = self.outcome;
        latencies.sort_unstable();
        let at = |fraction: f64| {
            latencies[((latencies.len() as f64 * fraction) as usize).min(latencies.len() - 1)]
        };
        let decisions = latencies.len().max(1) as f64;
        Figure {
            per_second: latencies.len() as f64 / seconds,
            p50_us: at(0.5),
            p99_us: at(0.99),
            unavailable_share: refusals.unavailable as f64 / decisions,
            depleted_share: refusals.depleted as f64 / decisions,
            agent_cpu_us_per_decision: self.agent_cpu_s * 1e6 / decisions,
            load_cpu_us_per_decision: load_cpu_s * 1e6 / decisions,
            redis_cpu_us_per_decision: self.redis_cpu_s * 1e6 / decisions,
            unsent,
            late_share: late_sends as f64 / decisions,
            max_late_us,
            machine_busy: self.busy_ticks as f64 / self.all_ticks.max(1) as f64,
        }
    }
}

/// Each of `loads` measured [`ROUNDS`] times, round-robin (see [`RUN`]); their figures in order.
/// `between` runs after every slice with the slice's load index (to read counters per load).
async fn measure_in_rounds(
    loads: &[Load],
    redis_info: &mut redis::aio::MultiplexedConnection,
    mut between: impl FnMut(usize),
) -> Vec<Figure> {
    let mut sums: Vec<Sample> = Vec::with_capacity(loads.len());
    for round in 0..ROUNDS {
        for (index, load) in loads.iter().enumerate() {
            let sample = measure(load, redis_info).await;
            between(index);
            if round == 0 {
                sums.push(sample);
            } else {
                sums[index].add(sample);
            }
        }
    }
    sums.into_iter().map(Sample::figure).collect()
}

/// The load generator's process: runs the [`Load`] in `json` and prints its `RESULT`.
fn generate_load(json: &str) {
    let load: Load = serde_json::from_str(json).expect("the load to run");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .expect("the load generator's runtime");
    let outcome = runtime.block_on(async {
        match load {
            Load::Closed { url, path, callers } => drive(url, path, callers).await,
            Load::Grpc { url, callers } => drive_grpc(url, callers).await,
            Load::Raw { redis_url, callers } => raw_evalsha(&redis_url, callers).await,
            Load::Open { url, per_second } => drive_open(url, per_second).await,
        }
    });
    println!(
        "RESULT {}",
        serde_json::to_string(&outcome).expect("outcome as JSON")
    );
}

struct Figure {
    per_second: f64,
    p50_us: u64,
    p99_us: u64,
    /// Share of answers that were LIMITER_UNAVAILABLE (a store call past the decision budget).
    unavailable_share: f64,
    /// Share of answers denied by the global rule while the lease was renewed ([`Refusals::depleted`]).
    depleted_share: f64,
    /// CPU of the agents' threads per decision, µs (the raw store path runs none of them: 0).
    agent_cpu_us_per_decision: f64,
    /// CPU of the load generator's process per decision, µs.
    load_cpu_us_per_decision: f64,
    /// CPU of Redis per decision, µs (`INFO cpu`; about 0 on paths that do not call it).
    redis_cpu_us_per_decision: f64,
    /// Open loop: requests due while every connection was busy, not sent (closed loop: 0).
    unsent: u64,
    /// Open loop: share of the requests sent more than [`LATE_SEND`] after they were due.
    late_share: f64,
    /// Open loop: the latest a request was sent after it was due, µs.
    max_late_us: u64,
    /// Share of the machine's CPU (every core, every process) busy over the run.
    machine_busy: f64,
}

/// Drives `callers` keep-alive clients posting admits to `url`/`path` for [`RUN`]; every answer is
/// an admit, or a refusal counted by why ([`answer_of`]).
async fn drive(url: String, path: String, callers: u64) -> Outcome {
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    // Opened before the timed run, so none is connected in it.
    let mut connections = Vec::new();
    for _ in 0..callers {
        connections.push(AdmitConnection::open(&url, &path).await);
    }
    for (caller, mut connection) in (0..callers).zip(connections) {
        let stop = stop.clone();
        tasks.push(tokio::spawn(async move {
            let mut latencies = Vec::new();
            let mut refusals = Refusals::default();
            let mut n = caller;
            while !stop.load(Ordering::Relaxed) {
                let stopwatch = Stopwatch::start();
                refusals.count(connection.post(n).await);
                latencies.push(stopwatch.elapsed().as_micros() as u64);
                n += callers;
            }
            (latencies, refusals)
        }));
    }
    collect(tasks, stop).await
}

/// One keep-alive HTTP/1.1 connection posting admits: hyper's client connection, with no pool,
/// no URL parsed per request and the body serialised straight to bytes. The load generator stands
/// in for gateways on other hosts, yet shares this machine's cores with the agent and Redis: the
/// less CPU it takes a request, the more the figures measure the agent (reqwest took 19 to 25 us a
/// decision here, over twice what the agent's HTTP server takes for the same exchange).
struct AdmitConnection {
    sender: hyper::client::conn::http1::SendRequest<http_body_util::Full<bytes::Bytes>>,
    path: hyper::Uri,
    host: hyper::header::HeaderValue,
    authorization: hyper::header::HeaderValue,
}

impl AdmitConnection {
    /// Connects to `url` (`http://host:port`, or `unix:/path` for a Unix domain socket) for posts
    /// to `path`.
    async fn open(url: &str, path: &str) -> Self {
        let (sender, authority) = match url.strip_prefix("unix:") {
            Some(socket) => {
                let stream = tokio::net::UnixStream::connect(socket)
                    .await
                    .expect("connect");
                (Self::handshake(stream).await, "localhost")
            }
            None => {
                let authority = url.strip_prefix("http://").expect("an http:// URL");
                let stream = tokio::net::TcpStream::connect(authority)
                    .await
                    .expect("connect");
                stream.set_nodelay(true).expect("TCP_NODELAY");
                (Self::handshake(stream).await, authority)
            }
        };
        Self {
            sender,
            path: format!("/{path}").parse().expect("path"),
            host: authority.parse().expect("host header"),
            authorization: format!("Bearer {GATEWAY}")
                .parse()
                .expect("authorization header"),
        }
    }

    /// An HTTP/1.1 client connection over `stream`, driven on a task of its own until its sender
    /// is dropped.
    async fn handshake(
        stream: impl tokio::io::AsyncRead + tokio::io::AsyncWrite + Send + Unpin + 'static,
    ) -> hyper::client::conn::http1::SendRequest<http_body_util::Full<bytes::Bytes>> {
        let (sender, connection) =
            hyper::client::conn::http1::handshake(hyper_util::rt::TokioIo::new(stream))
                .await
                .expect("HTTP/1.1 handshake");
        tokio::spawn(connection);
        sender
    }

    /// Posts admit `n` and says how it was answered (see [`answer_of`]).
    async fn post(&mut self, n: u64) -> Answer {
        use hyper::header::{AUTHORIZATION, CONTENT_TYPE, HOST};
        let body = serde_json::to_vec(&request(n)).expect("admit as JSON");
        let request = hyper::Request::post(self.path.clone())
            .header(HOST, self.host.clone())
            .header(AUTHORIZATION, self.authorization.clone())
            .header(CONTENT_TYPE, "application/json")
            .body(http_body_util::Full::new(bytes::Bytes::from(body)))
            .expect("request");
        // The connection takes the next request once it has read the last answer's end.
        self.sender
            .ready()
            .await
            .expect("the connection stays open");
        let response = self.sender.send_request(request).await.expect("answer");
        let body = http_body_util::BodyExt::collect(http_body_util::Limited::new(
            response.into_body(),
            common::MAX_ANSWER_BYTES,
        ))
        .await
        .expect("an answer body within its bound")
        .to_bytes();
        answer_of(&body)
    }
}

/// An admit's answer, as far as the bench reads it.
#[derive(Deserialize)]
#[serde(rename_all = "camelCase")]
struct AdmitAnswer<'a> {
    allowed: bool,
    #[serde(borrow, default)]
    reason: Option<&'a str>,
    #[serde(borrow, default)]
    denied_scope: Option<&'a str>,
}

/// How an admit was answered: an admit, LIMITER_UNAVAILABLE (a Redis call past the decision budget
/// under a fail-closed rule), or a global denial (a lease run dry); any other answer fails the
/// bench.
fn answer_of(body: &[u8]) -> Answer {
    let answer: AdmitAnswer<'_> = serde_json::from_slice(body).unwrap_or_else(|error| {
        panic!(
            "an admit answer ({error}): {}",
            String::from_utf8_lossy(body)
        )
    });
    if answer.allowed {
        Answer::Admitted
    } else if answer.reason == Some("LIMITER_UNAVAILABLE") {
        Answer::Unavailable
    } else {
        assert_eq!(
            answer.denied_scope,
            Some("global"),
            "{}",
            String::from_utf8_lossy(body)
        );
        Answer::Depleted
    }
}

/// How an admit was answered (see [`answer_of`]).
enum Answer {
    Admitted,
    /// See [`Refusals::unavailable`].
    Unavailable,
    /// See [`Refusals::depleted`].
    Depleted,
}

/// Connections an open-loop run may hold at once; a request due while all are busy is not sent
/// (counted: it would have waited, so the offered rate was not met).
const OPEN_LOOP_CONNECTIONS: usize = 256;

/// The offered rates of the open-loop runs, as fractions of the closed-loop peak at 64 callers
/// (below capacity: every request should be decided).
const OPEN_LOOP_FRACTIONS: [f64; 3] = [0.5, 0.65, 0.8];

/// The open-loop load generator's niceness (see [`measure`]).
const OPEN_LOOP_NICENESS: u32 = 10;

/// Below capacity, the core the agent's thread has to itself ([`give_the_agent_a_core`]).
const AGENT_CORE: usize = 0;

/// Below capacity, the core Redis, the load generator and the rest of this process share.
const OTHER_CORE: usize = 1;

/// Below capacity the agent runs as on a host of its own: its runtime's thread alone on
/// [`AGENT_CORE`]; the rest of this process and Redis (`redis_pid`) on [`OTHER_CORE`], with the
/// load generators [`measure`] starts. At capacity, three processes share two cores and a burst
/// the agent would decide in time waits for a core instead: a figure of the machine, not of the
/// agent. The open loop is the bench's last table, so nothing after it runs pinned.
fn give_the_agent_a_core(redis_pid: u32) {
    let status = std::fs::read_to_string("/proc/self/status").expect("this process's status");
    let allowed = status
        .lines()
        .find_map(|line| line.strip_prefix("Cpus_allowed_list:"))
        .map(str::trim)
        .unwrap_or_default();
    assert!(
        [AGENT_CORE, OTHER_CORE]
            .iter()
            .all(|core| cpu_list_has(allowed, *core)),
        "the open loop gives the agent core {AGENT_CORE} and the rest core {OTHER_CORE}: this \
         process may run on cores {allowed}"
    );
    pin(OTHER_CORE, std::process::id().to_string(), true);
    pin(OTHER_CORE, redis_pid.to_string(), true);
    let agent_threads = threads_named(AGENT_THREADS);
    assert!(
        !agent_threads.is_empty(),
        "no thread named {AGENT_THREADS} to pin"
    );
    for task in agent_threads {
        pin(AGENT_CORE, task_id(&task), false);
    }
}

/// Whether a CPU list as Linux writes it (`0-3,6`) names `core`.
fn cpu_list_has(list: &str, core: usize) -> bool {
    list.split(',').any(|range| {
        let (first, last) = range.split_once('-').unwrap_or((range, range));
        match (first.trim().parse::<usize>(), last.trim().parse::<usize>()) {
            (Ok(first), Ok(last)) => (first..=last).contains(&core),
            _ => false,
        }
    })
}

/// The thread id a `/proc/<pid>/task/<id>` (or `/proc/thread-self`) path names.
fn task_id(task: &std::path::Path) -> String {
    task.file_name()
        .expect("a task id")
        .to_string_lossy()
        .into_owned()
}

/// Pins process or thread `pid` (with `all_threads`, every thread of the process) to `core`.
fn pin(core: usize, pid: String, all_threads: bool) {
    let mut taskset = std::process::Command::new("taskset");
    if all_threads {
        taskset.arg("-a");
    }
    let status = taskset
        .args(["-p", "-c", &core.to_string(), &pid])
        .stdout(Stdio::null())
        .status()
        .expect("taskset (util-linux)");
    assert!(status.success(), "taskset -p -c {core} {pid}: {status}");
}

/// How long the stall probe watches the agent's core.
const STALL_PROBE: Duration = Duration::from_secs(2);

/// A gap between two clock reads of a spinning thread at least this long is a stall.
const STALL_AT_LEAST: Duration = Duration::from_millis(1);

/// Stalls of [`AGENT_CORE`] while the agents on it are idle: a thread pinned there reads the clock
/// in a loop for [`STALL_PROBE`] and counts the gaps of [`STALL_AT_LEAST`] or more (the core given
/// to something else: the hypervisor's other guests, the kernel). A stall of the agent's core
/// holds up every decision in flight on it, however the agent waits. Returns how many a second,
/// and the longest.
fn stalls_of_the_agent_core() -> (f64, Duration) {
    std::thread::spawn(|| {
        let this_thread = std::fs::read_link("/proc/thread-self").expect("this thread's id");
        pin(AGENT_CORE, task_id(&this_thread), false);
        let (start, mut last) = (monotonic_now(), monotonic_now());
        let (mut stalls, mut longest) = (0u64, Duration::ZERO);
        while last.duration_since(start) < STALL_PROBE {
            let now = monotonic_now();
            let gap = now.duration_since(last);
            stalls += u64::from(gap >= STALL_AT_LEAST);
            longest = longest.max(gap);
            last = now;
        }
        (stalls as f64 / STALL_PROBE.as_secs_f64(), longest)
    })
    .join()
    .expect("the stall probe")
}

/// The stand-in allocator's chunk. One renewal of a pool is in flight at a time, so an agent
/// admits at most about a chunk per grant round trip: 100 tokens (the reference design's chunk
/// for a pool of 1,000 a minute) last 3 ms at this bench's 30,000 admits a second, less than a
/// renewal takes on a loaded 2-core machine, and the agent would deny while a grant is on its
/// way (docs/operations.md: `AllotRegionDepletedWhilePoolHadTokens`). A pool sized for this
/// demand holds more per grant.
const CHUNK_TOKENS: u64 = 1_000;

/// An open-loop request sent later than this after it was due counts as sent late.
const LATE_SEND: Duration = Duration::from_millis(2);

/// Open loop: admits sent to `url` at `per_second`, evenly spaced, for [`RUN`], whatever the answers
/// take (up to [`OPEN_LOOP_CONNECTIONS`] at once), counting those due but not sent.
async fn drive_open(url: String, per_second: f64) -> Outcome {
    // Opened before the timed run, so none is connected in it.
    let mut connections = Vec::with_capacity(OPEN_LOOP_CONNECTIONS);
    for _ in 0..OPEN_LOOP_CONNECTIONS {
        connections.push(AdmitConnection::open(&url, "v1/admit").await);
    }
    let idle = Arc::new(std::sync::Mutex::new(connections));
    let mut tasks = tokio::task::JoinSet::new();
    let load_cpu_before = announce_start();
    let (start, stopwatch) = (monotonic_now(), Stopwatch::start());
    let (mut n, mut unsent) = (0u64, 0u64);
    let (mut late_sends, mut max_late) = (0u64, Duration::ZERO);
    while stopwatch.elapsed() < RUN {
        let due = start + Duration::from_secs_f64(n as f64 / per_second);
        tokio::time::sleep_until(due).await;
        // A generator that wakes late sends what fell due meanwhile at once: a burst, not the
        // even spacing it offers.
        let late = monotonic_now().saturating_duration_since(due);
        late_sends += u64::from(late > LATE_SEND);
        max_late = max_late.max(late);
        n += 1;
        let Some(mut connection) = idle.lock().expect("idle connections").pop() else {
            unsent += 1;
            continue;
        };
        let idle = idle.clone();
        tasks.spawn(async move {
            let stopwatch = Stopwatch::start();
            let answer = connection.post(n).await;
            idle.lock().expect("idle connections").push(connection);
            (stopwatch.elapsed().as_micros() as u64, answer)
        });
    }
    let mut latencies_us = Vec::new();
    let mut refusals = Refusals::default();
    while let Some(answer) = tasks.join_next().await {
        let (latency_us, answer) = answer.expect("request");
        latencies_us.push(latency_us);
        refusals.count(answer);
    }
    Outcome {
        latencies_us,
        refusals,
        seconds: stopwatch.elapsed().as_secs_f64(),
        unsent,
        load_cpu_s: process_cpu_seconds() - load_cpu_before,
        late_sends,
        max_late_us: u64::try_from(max_late.as_micros()).unwrap_or(u64::MAX),
    }
}

/// The raw store ceiling: the same function and arguments, one FCALL per decision from `callers`
/// tasks.
async fn raw_evalsha(redis_url: &str, callers: u64) -> Outcome {
    // Only to build the command: the store names the function its library was loaded as.
    let store = Arc::new(
        RedisStore::connect(redis_url, RedisStoreConfig::default())
            .await
            .expect("redis"),
    );
    let bundle = bundle(true);
    let pepper = Pepper::new(b"bench-pepper-0123456789".to_vec()).expect("pepper");
    let stop = Arc::new(AtomicBool::new(false));
    let mut tasks = Vec::new();
    for caller in 0..callers {
        let (store, stop, bundle, pepper) =
            (store.clone(), stop.clone(), bundle.clone(), pepper.clone());
        let client = redis::Client::open(redis_url).expect("client");
        tasks.push(tokio::spawn(async move {
            let mut connection = client
                .get_multiplexed_async_connection()
                .await
                .expect("connection");
            let mut latencies = Vec::new();
            let mut n = caller;
            while !stop.load(Ordering::Relaxed) {
                let planned =
                    plan_request(&bundle, &request(n), &pepper, IpPrefixes::default(), 30_000)
                        .expect("plan")
                        .expect("regional rules");
                let command = store.decide_command(&planned.batch);
                let stopwatch = Stopwatch::start();
                let reply: redis::Value =
                    command.query_async(&mut connection).await.expect("FCALL");
                assert!(decide_reply_admits(&reply), "admitted: {reply:?}");
                latencies.push(stopwatch.elapsed().as_micros() as u64);
                n += callers;
            }
            (latencies, Refusals::default())
        }));
    }
    collect(tasks, stop).await
}

fn main() {
    logging_as_deployed();
    if let Ok(load) = std::env::var(LOAD_ENV) {
        return generate_load(&load);
    }
    let (agents, load) = agent_and_load_runtimes();
    load.block_on(run(agents.handle().clone()));
}

async fn run(agents: tokio::runtime::Handle) {
    let redis = allot_testkit::RedisServer::start();
    let grants = Arc::new(AtomicU64::new(0));
    let allocator = stub_allocator(grants.clone(), CHUNK_TOKENS).await;
    let mut redis_info = redis::Client::open(redis.url())
        .expect("redis url")
        .get_multiplexed_async_connection()
        .await
        .expect("redis");
    // The Unix domain sockets the same endpoints also listen on (gateways on the agent's host).
    let sockets = tempfile::tempdir().expect("a folder for the sockets");
    let socket = |name: &str| sockets.path().join(format!("{name}.sock"));
    let (trivial_socket, lease_socket, redis_socket) =
        (socket("trivial"), socket("lease"), socket("redis"));
    let on_agents = {
        let (allocator, redis_url) = (allocator.clone(), redis.url());
        let (trivial_socket, lease_socket, redis_socket) = (
            trivial_socket.clone(),
            lease_socket.clone(),
            redis_socket.clone(),
        );
        agents.spawn(async move {
            // Connected here, so that the connection's task (which writes the calls and reads the
            // replies) runs on the agent's thread, as in the agent, and its CPU is the agent's.
            let redis_store = Arc::new(
                RedisStore::connect(&redis_url, RedisStoreConfig::default())
                    .await
                    .expect("redis"),
            );
            let alone_store = Arc::new(
                RedisStore::connect(
                    &redis_url,
                    RedisStoreConfig {
                        coalesce: false,
                        ..RedisStoreConfig::default()
                    },
                )
                .await
                .expect("redis"),
            );
            // Reads the request's body (as any handler must) and answers a constant decision.
            let app = axum::Router::new().route(
                "/constant",
                post(|_body: axum::body::Bytes| async { Json(json!({ "allowed": true })) }),
            );
            let trivial = serve_on_free_port(app.clone()).await;
            let in_process: Arc<dyn LimiterStore> =
                Arc::new(InProcessStore::new(Arc::new(SystemClock), 100_000));
            let (lease_only, lease_only_api) = start_agent(in_process, &allocator, false).await;
            let (with_redis, with_redis_api) = start_agent(redis_store, &allocator, true).await;
            let (alone, _) = start_agent(alone_store, &allocator, true).await;
            let bind = async |path: &std::path::Path| {
                allot_net::Listener::bind(&allot_net::ListenAddr::Unix(path.to_owned()))
                    .await
                    .expect("bind a Unix socket")
            };
            tokio::spawn(allot_net::serve(
                bind(&trivial_socket).await,
                app,
                None,
                allot_net::ServeLimits::default(),
                std::future::pending(),
            ));
            for (path, api) in [
                (&lease_socket, lease_only_api),
                (&redis_socket, with_redis_api.clone()),
            ] {
                tokio::spawn(allot_region_agent::http::serve(
                    bind(path).await,
                    api,
                    None,
                    std::future::pending(),
                ));
            }
            (trivial, lease_only, with_redis, with_redis_api, alone)
        })
    };
    let (trivial, lease_only, with_redis, with_redis_api, alone) =
        on_agents.await.expect("the agents' runtime");
    let over_unix = |path: &std::path::Path| format!("unix:{}", path.display());
    let (trivial_uds, lease_only_uds, with_redis_uds) = (
        over_unix(&trivial_socket),
        over_unix(&lease_socket),
        over_unix(&redis_socket),
    );
    let grpc_url = serve_grpc_on(&agents, with_redis_api.clone()).await;
    println!(
        "{:<24} {:>8} {:>12} {:>8} {:>8} {:>12} {:>14} {:>16} {:>12} {:>12}",
        "path",
        "callers",
        "admits/s",
        "p50 us",
        "p99 us",
        "x ceiling",
        "agent us/dec",
        "per agent core",
        "load us/dec",
        "Redis us/dec"
    );
    let mut peak_decided = 0.0;
    for callers in [1u64, 64] {
        let limiter_before = with_redis_api.agent.limiter_stats();
        // The ceiling gets the very request an admit is (same method, headers and body), so the
        // ratio measures what the agent does with it, not the client's extra work.
        let closed = |url: &str, path: &str| Load::Closed {
            url: url.to_owned(),
            path: path.to_owned(),
            callers,
        };
        let loads = [
            closed(&trivial, "constant"),
            Load::Raw {
                redis_url: redis.url(),
                callers,
            },
            closed(&lease_only, "v1/admit"),
            closed(&with_redis, "v1/admit"),
            Load::Grpc {
                url: grpc_url.clone(),
                callers,
            },
            closed(&alone, "v1/admit"),
            closed(&trivial_uds, "constant"),
            closed(&lease_only_uds, "v1/admit"),
            closed(&with_redis_uds, "v1/admit"),
        ];
        // Only the agent paths take grants; the ceilings' slices add none.
        let admits_before = grants.load(Ordering::Relaxed);
        let figures = measure_in_rounds(&loads, &mut redis_info, |_| {}).await;
        let [
            ceiling,
            raw,
            lease,
            redis_path,
            grpc_path,
            alone_path,
            ceiling_uds,
            lease_uds,
            redis_uds,
        ] = <[Figure; 9]>::try_from(figures).unwrap_or_else(|_| panic!("nine figures"));
        let admits = (lease.per_second
            + redis_path.per_second
            + grpc_path.per_second
            + alone_path.per_second
            + lease_uds.per_second
            + redis_uds.per_second)
            * RUN.as_secs_f64()
            * ROUNDS as f64;
        let calls = grants.load(Ordering::Relaxed) - admits_before;
        // Why the Redis agent's limiter did not decide (both of its paths, HTTP and gRPC).
        let limiter = with_redis_api.agent.limiter_stats();
        let refusals = LimiterRefusals::between(&limiter_before, &limiter);
        println!(
            "BENCH {}",
            json!({ "bench": "agent_limiter", "callers": callers,
                "decisions": limiter.decisions - limiter_before.decisions,
                "unavailable": limiter.unavailable - limiter_before.unavailable,
                "breakerRefusals": refusals.breaker,
                "waitedOut": refusals.waited_out,
                "shed": refusals.shed,
                "slowCalls": refusals.overran,
                "heldUp": refusals.held_up,
                "breakerFailures": refusals.breaker_failures,
                "coalescedDecisions": limiter.coalesced_decisions - limiter_before.coalesced_decisions,
                "coalescedCalls": limiter.coalesced_calls - limiter_before.coalesced_calls })
        );
        // Each path's agent CPU per decision over the trivial endpoint's on the same transport.
        for (path, figure, against, trivial_cpu) in [
            ("trivial", &ceiling, ceiling.per_second, &ceiling),
            ("raw-evalsha", &raw, raw.per_second, &ceiling),
            ("lease-only", &lease, ceiling.per_second, &ceiling),
            ("lease+3-redis", &redis_path, raw.per_second, &ceiling),
            ("grpc+3-redis", &grpc_path, raw.per_second, &ceiling),
            ("lease+3-redis alone", &alone_path, raw.per_second, &ceiling),
            (
                "trivial uds",
                &ceiling_uds,
                ceiling_uds.per_second,
                &ceiling_uds,
            ),
            (
                "lease-only uds",
                &lease_uds,
                ceiling_uds.per_second,
                &ceiling_uds,
            ),
            (
                "lease+3-redis uds",
                &redis_uds,
                raw.per_second,
                &ceiling_uds,
            ),
        ] {
            let ratio = figure.per_second / against.max(1.0);
            let agent_cpu_us = figure.agent_cpu_us_per_decision;
            let cpu_x_trivial = agent_cpu_us / trivial_cpu.agent_cpu_us_per_decision.max(0.001);
            // Decisions one agent core decides per second at this CPU per decision.
            let per_agent_core = if agent_cpu_us > 0.0 {
                1e6 / agent_cpu_us
            } else {
                0.0
            };
            println!(
                "{path:<24} {callers:>8} {:>12.0} {:>8} {:>8} {ratio:>12.2} {agent_cpu_us:>14.1} {per_agent_core:>16.0} {:>12.1} {:>12.1}",
                figure.per_second,
                figure.p50_us,
                figure.p99_us,
                figure.load_cpu_us_per_decision,
                figure.redis_cpu_us_per_decision
            );
            println!(
                "BENCH {}",
                json!({ "bench": "agent", "path": path, "callers": callers,
                    "admitsPerSecond": figure.per_second.round(), "p50Us": figure.p50_us,
                    "p99Us": figure.p99_us, "ratio": (ratio * 100.0).round() / 100.0,
                    "agentCpuUsPerDecision": (agent_cpu_us * 10.0).round() / 10.0,
                    "agentCpuXTrivial": (cpu_x_trivial * 100.0).round() / 100.0,
                    "decisionsPerAgentCoreSecond": per_agent_core.round(),
                    "loadCpuUsPerDecision": (figure.load_cpu_us_per_decision * 10.0).round() / 10.0,
                    "redisCpuUsPerDecision": (figure.redis_cpu_us_per_decision * 10.0).round() / 10.0,
                    "unavailablePercent": (figure.unavailable_share * 10_000.0).round() / 100.0,
                    "depletedPercent": (figure.depleted_share * 10_000.0).round() / 100.0,
                    "machineBusyPercent": (figure.machine_busy * 1_000.0).round() / 10.0,
                    "allocatorCallsPer1000Admits": if admits > 0.0 { (calls as f64 * 1000.0 / admits * 100.0).round() / 100.0 } else { 0.0 } })
            );
        }
        if callers == 64 {
            // Below capacity: what the closed loop decided (fast refusals left out), offered in part.
            peak_decided = redis_path.per_second * (1.0 - redis_path.unavailable_share);
            cpu_account(&ceiling, &raw, &lease, &redis_path, &alone_path);
        }
    }
    open_loop(&with_redis, &with_redis_api, peak_decided, &mut redis_info).await;
}

/// What a target ratio would cost this machine, from the CPU the same run measured: per path, the
/// CPU one decision takes in all three processes (load generator, agent, Redis), and the cores
/// the path would need to decide at its target share of its ceiling (`lease-only` at 0.8 of
/// `trivial`, `lease+3-redis` at 0.9 of `raw-evalsha`; the ceilings at their own rate). A path
/// that needs more cores than the machine has cannot reach its target here, however the work is
/// scheduled. A table, and one `BENCH` line with bench = "agent_cpu" per path.
fn cpu_account(
    ceiling: &Figure,
    raw: &Figure,
    lease: &Figure,
    redis_path: &Figure,
    alone_path: &Figure,
) {
    let cores = std::thread::available_parallelism().map_or(1, usize::from);
    println!();
    println!(
        "{:<24} {:>12} {:>10} {:>10} {:>10} {:>10} {:>12}",
        "at 64 callers", "target/s", "load us", "agent us", "Redis us", "total us", "cores needed"
    );
    for (path, figure, target_per_second) in [
        ("trivial", ceiling, ceiling.per_second),
        ("raw-evalsha", raw, raw.per_second),
        ("lease-only", lease, ceiling.per_second * 0.8),
        ("lease+3-redis", redis_path, raw.per_second * 0.9),
        ("lease+3-redis alone", alone_path, raw.per_second * 0.9),
    ] {
        let total_us = figure.load_cpu_us_per_decision
            + figure.agent_cpu_us_per_decision
            + figure.redis_cpu_us_per_decision;
        let cores_needed = target_per_second * total_us / 1e6;
        println!(
            "{path:<24} {target_per_second:>12.0} {:>10.1} {:>10.1} {:>10.1} {total_us:>10.1} {cores_needed:>12.2}",
            figure.load_cpu_us_per_decision,
            figure.agent_cpu_us_per_decision,
            figure.redis_cpu_us_per_decision
        );
        println!(
            "BENCH {}",
            json!({ "bench": "agent_cpu", "path": path, "callers": 64, "cores": cores,
                "targetPerSecond": target_per_second.round(),
                "loadCpuUsPerDecision": (figure.load_cpu_us_per_decision * 10.0).round() / 10.0,
                "agentCpuUsPerDecision": (figure.agent_cpu_us_per_decision * 10.0).round() / 10.0,
                "redisCpuUsPerDecision": (figure.redis_cpu_us_per_decision * 10.0).round() / 10.0,
                "totalCpuUsPerDecision": (total_us * 10.0).round() / 10.0,
                "coresNeeded": (cores_needed * 100.0).round() / 100.0 })
        );
    }
}

/// Decisions the limiter did not make, by why.
#[derive(Debug, Clone, Copy, Default)]
struct LimiterRefusals {
    shed: u64,
    waited_out: u64,
    /// Calls that ran past their deadline while the shard answered others (slow, not down).
    overran: u64,
    /// Waits and calls that ran out while the agent's own thread was held up.
    held_up: u64,
    breaker: u64,
    /// Calls counted against the breaker (what opens it).
    breaker_failures: u64,
}

impl LimiterRefusals {
    /// What the limiter's counters say happened from `before` to `after`.
    fn between(before: &LimiterStats, after: &LimiterStats) -> Self {
        Self {
            shed: after.shed - before.shed,
            waited_out: after.pool_exhausted - before.pool_exhausted,
            overran: after.slow_calls - before.slow_calls,
            held_up: after.held_up - before.held_up,
            breaker: after.breaker_refusals - before.breaker_refusals,
            breaker_failures: after.breaker_failures - before.breaker_failures,
        }
    }

    fn add(&mut self, other: Self) {
        self.shed += other.shed;
        self.waited_out += other.waited_out;
        self.overran += other.overran;
        self.held_up += other.held_up;
        self.breaker += other.breaker;
        self.breaker_failures += other.breaker_failures;
    }
}

/// `lease+3-redis` offered open loop below the closed-loop peak: the fractions of
/// [`OPEN_LOOP_FRACTIONS`], each a table row and a `BENCH` line with bench = "agent_open".
async fn open_loop(
    url: &str,
    api: &AgentApi,
    peak_decided: f64,
    redis_info: &mut redis::aio::MultiplexedConnection,
) {
    let loads: Vec<Load> = OPEN_LOOP_FRACTIONS
        .iter()
        .map(|fraction| Load::Open {
            url: url.to_owned(),
            per_second: peak_decided * fraction,
        })
        .collect();
    let info: String = redis::cmd("INFO")
        .arg("server")
        .query_async(redis_info)
        .await
        .expect("INFO server");
    let redis_pid = info
        .lines()
        .find_map(|line| line.strip_prefix("process_id:"))
        .and_then(|pid| pid.trim().parse().ok())
        .expect("Redis's process id");
    give_the_agent_a_core(redis_pid);
    let (stalls_per_second, longest_stall) = stalls_of_the_agent_core();
    println!(
        "agent core idle: {stalls_per_second:.1} stalls/s of {} ms or more, longest {:.1} ms",
        STALL_AT_LEAST.as_millis(),
        longest_stall.as_secs_f64() * 1_000.0
    );
    println!(
        "BENCH {}",
        json!({ "bench": "agent_core_stalls", "probeSeconds": STALL_PROBE.as_secs_f64(),
            "stallAtLeastMs": STALL_AT_LEAST.as_millis(),
            "stallsPerSecond": (stalls_per_second * 10.0).round() / 10.0,
            "longestMs": (longest_stall.as_secs_f64() * 10_000.0).round() / 10.0 })
    );
    // Why the limiter did not decide, per fraction: each slice's change of its counters.
    let mut refusals = [LimiterRefusals::default(); OPEN_LOOP_FRACTIONS.len()];
    let mut last = api.agent.limiter_stats();
    let figures = measure_in_rounds(&loads, redis_info, |index| {
        let now = api.agent.limiter_stats();
        refusals[index].add(LimiterRefusals::between(&last, &now));
        last = now;
    })
    .await;
    for ((fraction, figure), refusals) in OPEN_LOOP_FRACTIONS.into_iter().zip(figures).zip(refusals)
    {
        let offered = peak_decided * fraction;
        let label = format!("open {fraction}x");
        println!(
            "{label:<24} {:>8} {:>12.0} {:>8} {:>8} {:>12} {:>14.1} {:>16}",
            "-",
            figure.per_second,
            figure.p50_us,
            figure.p99_us,
            format!("{:.2}% unav", figure.unavailable_share * 100.0),
            figure.agent_cpu_us_per_decision,
            format!(
                "busy {:.0}%, late {:.1}% (max {:.1} ms)",
                figure.machine_busy * 100.0,
                figure.late_share * 100.0,
                figure.max_late_us as f64 / 1_000.0
            )
        );
        println!(
            "BENCH {}",
            json!({ "bench": "agent_open", "path": "lease+3-redis", "fraction": fraction,
                "offeredPerSecond": offered.round(), "decidedPerSecond": figure.per_second.round(),
                "unsent": figure.unsent, "p50Us": figure.p50_us, "p99Us": figure.p99_us,
                "unavailablePercent": (figure.unavailable_share * 10_000.0).round() / 100.0,
                "depletedPercent": (figure.depleted_share * 10_000.0).round() / 100.0,
                "shed": refusals.shed,
                "waitedOut": refusals.waited_out,
                "overran": refusals.overran,
                "heldUp": refusals.held_up,
                "breakerRefusals": refusals.breaker,
                "breakerFailures": refusals.breaker_failures,
                "machineBusyPercent": (figure.machine_busy * 1_000.0).round() / 10.0,
                "lateSendPercent": (figure.late_share * 1_000.0).round() / 10.0,
                "maxLateMs": (figure.max_late_us as f64 / 100.0).round() / 10.0,
                "agentCpuUsPerDecision": (figure.agent_cpu_us_per_decision * 10.0).round() / 10.0 })
        );
    }
}
