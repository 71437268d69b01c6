//! The TypeScript and Python clients' own test suites (`node --test`, `pytest`), each run against
//! a real agent on a real Redis, with the bundle `common::bundle` describes. Their dependencies are
//! installed by `scripts/ensure-deps`; a missing one fails here with what to run.

use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::time::Duration;

use crate::common::{GATEWAY, start_agent};
use allot_testkit::{Binary, RedisServer};

/// Longest a suite may run (both take seconds; a hang is a failure, not a stuck CI).
const SUITE_TIMEOUT: Duration = Duration::from_secs(180);
/// How often the suite is looked at.
const POLL: Duration = Duration::from_millis(100);

fn clients_dir(language: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .parent()
        .expect("clients/")
        .join(language)
}

/// Runs `program args` in `dir` with the agent's URL and token in its environment; panics with its
/// output unless it exits 0 within [`SUITE_TIMEOUT`].
fn run_suite(label: &str, program: Binary, args: &[&str], dir: &Path, agent_url: &str) {
    let program = program.require();
    let log_dir = tempfile::tempdir().expect("temp dir");
    let log_path = log_dir.path().join("suite.log");
    let log = std::fs::File::create(&log_path).expect("log");
    let mut child = Command::new(&program)
        .args(args)
        .current_dir(dir)
        .env("ALLOT_AGENT_URL", agent_url)
        .env("ALLOT_GATEWAY_TOKEN", GATEWAY)
        .stdin(Stdio::null())
        .stdout(log.try_clone().expect("log"))
        .stderr(log)
        .spawn()
        .unwrap_or_else(|e| panic!("{label}: cannot start {}: {e}", program.display()));
    let mut status = None;
    for _ in 0..SUITE_TIMEOUT.as_millis() / POLL.as_millis() {
        status = child.try_wait().expect("poll");
        if status.is_some() {
            break;
        }
        std::thread::sleep(POLL);
    }
    if status.is_none() {
        let _ = child.kill();
        let _ = child.wait();
    }
    let output = std::fs::read_to_string(&log_path).unwrap_or_default();
    match status {
        Some(status) if status.success() => println!("{label}:\n{output}"),
        Some(status) => panic!("{label} failed ({status}):\n{output}"),
        None => panic!("{label} did not end within {SUITE_TIMEOUT:?}:\n{output}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_typescript_client_passes_its_suite_against_a_real_agent() {
    let dir = clients_dir("typescript");
    assert!(
        dir.join("node_modules/.bin/tsc").exists(),
        "the TypeScript client's dependencies are not installed in {}: run scripts/ensure-deps (npm ci)",
        dir.display()
    );
    let redis = RedisServer::start();
    let agent_url = start_agent(&redis).await;
    tokio::task::spawn_blocking(move || {
        run_suite(
            "npm test",
            Binary::Npm,
            &["test", "--silent"],
            &dir,
            &agent_url,
        );
    })
    .await
    .expect("suite");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_python_client_passes_its_suite_against_a_real_agent() {
    let dir = clients_dir("python");
    let redis = RedisServer::start();
    let agent_url = start_agent(&redis).await;
    tokio::task::spawn_blocking(move || {
        run_suite(
            "pytest",
            Binary::Python,
            &[
                "-m",
                "pytest",
                "-q",
                "-p",
                "no:cacheprovider",
                "--durations=5",
                "tests",
            ],
            &dir,
            &agent_url,
        );
    })
    .await
    .expect("suite");
}
