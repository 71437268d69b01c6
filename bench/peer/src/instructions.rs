//! `--instructions`: the peer comparison in instructions the Redis process executes per decision.
//!
//! Redis runs under valgrind's callgrind; before each path its counters are zeroed
//! (`callgrind_control -z`), then exactly [`DECISIONS`] decisions are made by [`CALLERS`] callers,
//! then they are dumped (`callgrind_control -d`) and read. Instructions count what the server does
//! for the decisions, its event loop included: unlike CPU time they do not move with what else the
//! machine runs, so two runs of one build give nearly the same figure.

use std::process::{Child, Command, Stdio};
use std::time::Duration;

use super::{Path, Shape, Subjects, planned, subjects};
use limitador::limit::{Context, Namespace};

/// Decisions measured per path and shape.
const DECISIONS: usize = 4_000;
/// Concurrent callers (each one user; the shapes' users are one tenant's).
const CALLERS: usize = 32;

/// Redis under callgrind, killed on drop.
struct Profiled {
    child: Child,
    dir: tempfile::TempDir,
    port: u16,
}

impl Drop for Profiled {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

impl Profiled {
    fn start() -> Self {
        let dir = tempfile::tempdir().expect("temp dir");
        let port = std::net::TcpListener::bind("127.0.0.1:0")
            .and_then(|listener| listener.local_addr())
            .map(|addr| addr.port())
            .expect("a free port");
        let child = Command::new("valgrind")
            .arg("--tool=callgrind")
            .arg(format!(
                "--callgrind-out-file={}/callgrind.%p",
                dir.path().display()
            ))
            .args([
                "redis-server",
                "--port",
                &port.to_string(),
                "--bind",
                "127.0.0.1",
            ])
            .args(["--save", "", "--appendonly", "no"])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("valgrind runs (apt-get install valgrind)");
        Self { child, dir, port }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn control(&self, flag: &str) {
        let status = Command::new("callgrind_control")
            .args([flag, &self.child.id().to_string()])
            .stdout(Stdio::null())
            .status()
            .expect("callgrind_control runs");
        assert!(status.success(), "callgrind_control {flag}");
    }

    /// The instructions counted since the last zeroing, from the newest dump.
    fn dumped_instructions(&self) -> u64 {
        self.control("-d");
        let newest = std::fs::read_dir(self.dir.path())
            .expect("the dump directory")
            .flatten()
            .max_by_key(|entry| entry.metadata().and_then(|m| m.modified()).ok())
            .expect("a dump");
        let text = std::fs::read_to_string(newest.path()).expect("the dump");
        text.lines()
            .find_map(|line| line.strip_prefix("summary: "))
            .and_then(|value| value.trim().parse().ok())
            .expect("the dump's summary line")
    }
}

async fn wait_until_ready(url: &str) {
    for _ in 0..600 {
        if let Ok(client) = redis::Client::open(url)
            && let Ok(mut connection) = client.get_multiplexed_async_connection().await
            && redis::cmd("PING")
                .query_async::<String>(&mut connection)
                .await
                .is_ok()
        {
            return;
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    panic!("Redis under callgrind did not answer within a minute");
}

/// Exactly `DECISIONS` decisions of `shape` on `path`, from `CALLERS` callers.
async fn decide(shape: Shape, path: Path, subjects: &Subjects) {
    let mut tasks = Vec::new();
    for caller in 0..CALLERS {
        let Subjects {
            limiter,
            coalescing,
            store,
            mut raw,
            bundle,
            limitador,
        } = subjects.clone();
        tasks.push(tokio::spawn(async move {
            let bundle = bundle.of(shape);
            let planned = planned(&bundle, caller);
            let fcall = store.decide_command(&planned.batch);
            let namespace = Namespace::from(shape.namespace());
            let values = std::collections::HashMap::from([
                ("user".to_owned(), format!("U-{caller}")),
                ("route".to_owned(), "read".to_owned()),
                ("tenant".to_owned(), "atlas".to_owned()),
            ]);
            for _ in 0..DECISIONS / CALLERS {
                match path {
                    Path::Raw => {
                        let _: redis::Value = fcall.query_async(&mut raw).await.expect("FCALL");
                    }
                    Path::Allot => {
                        let _ = limiter.decide(&planned, None).await;
                    }
                    Path::AllotCoalescing => {
                        let _ = coalescing.decide(&planned, None).await;
                    }
                    Path::Limitador => {
                        let context = Context::from(values.clone());
                        let _ = limitador
                            .check_rate_limited_and_update(&namespace, &context, 1)
                            .await;
                    }
                }
            }
        }));
    }
    for task in tasks {
        task.await.expect("the caller finishes");
    }
}

/// The comparison in instructions: a table and `BENCH` lines (bench = "peer_instructions").
pub async fn run() {
    let redis = Profiled::start();
    wait_until_ready(&redis.url()).await;
    let subjects = subjects(&redis.url(), true).await;
    println!(
        "{:>6} {:>8} {:>12} {:>22} {:>12}",
        "rules", "callers", "path", "Redis instr./decision", "x limitador"
    );
    for shape in [Shape::OneRule, Shape::ThreeRules] {
        let paths = Path::ALL;
        // Every path's keys exist before anything is counted (a first write costs more).
        for path in paths {
            decide(shape, path, &subjects).await;
        }
        let mut per_decision = Vec::new();
        for path in paths {
            redis.control("-z");
            decide(shape, path, &subjects).await;
            per_decision.push(redis.dumped_instructions() as f64 / DECISIONS as f64);
        }
        let limitador = per_decision[paths.len() - 1].max(1.0);
        for (path, instructions) in paths.iter().zip(&per_decision) {
            let versus = instructions / limitador;
            println!(
                "{:>6} {CALLERS:>8} {:>12} {instructions:>22.0} {versus:>12.2}",
                shape.rules(),
                path.name()
            );
            println!(
                "BENCH {}",
                serde_json::json!({
                    "bench": "peer_instructions", "rules": shape.rules(), "callers": CALLERS,
                    "path": path.name(), "redisInstructionsPerDecision": instructions.round(),
                    "ratioToLimitador": (versus * 100.0).round() / 100.0,
                })
            );
        }
    }
}
