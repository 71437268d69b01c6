//! Owning a server process: spawn it tied to the test process, kill it on drop,
//! and wait for conditions by polling against a deadline.

use std::fs::{File, OpenOptions};
use std::io;
use std::os::unix::process::CommandExt;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::thread;
use std::time::{Duration, Instant};

/// How often [`wait_for`] probes. Small enough to add no visible latency, large
/// enough not to steal a core from the servers on a 2-core machine.
const POLL_INTERVAL: Duration = Duration::from_millis(25);

/// How much of a server's log a failure message quotes.
const LOG_TAIL_LINES: usize = 40;

/// How a program is (re)started: everything needed to spawn it again with the
/// same data dir and ports.
#[derive(Debug, Clone)]
pub(crate) struct Launch {
    /// Human name for messages, e.g. `etcd m2 (client port 41234)`.
    pub(crate) label: String,
    pub(crate) program: PathBuf,
    pub(crate) args: Vec<String>,
    /// Receives the program's stdout and stderr (appended, so restarts keep the
    /// earlier runs' lines).
    pub(crate) log: PathBuf,
}

impl Launch {
    /// Spawns the program. The child is killed when the returned value drops, and
    /// by the kernel if this process dies first (see [`die_with_parent`]).
    pub(crate) fn spawn(&self) -> ServerProcess {
        let log = open_log(&self.log);
        let stderr = log.try_clone().unwrap_or_else(|e| {
            panic!("allot-testkit: cannot dup log {}: {e}", self.log.display())
        });
        let mut command = Command::new(&self.program);
        command
            .args(&self.args)
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(stderr);
        die_with_parent(&mut command);
        let child = command
            .spawn()
            .unwrap_or_else(|e| panic!("allot-testkit: cannot start {}: {e}", self.label));
        ServerProcess {
            label: self.label.clone(),
            child,
        }
    }

    /// The last lines of the log, for failure messages.
    pub(crate) fn log_tail(&self) -> String {
        log_tail(&self.log)
    }
}

fn open_log(path: &Path) -> File {
    OpenOptions::new()
        .create(true)
        .append(true)
        .open(path)
        .unwrap_or_else(|e| panic!("allot-testkit: cannot open log {}: {e}", path.display()))
}

/// Asks the kernel to SIGKILL the child when the thread that spawned it exits,
/// so servers never outlive a test process that was killed outright (where no
/// `Drop` runs).
///
/// Linux ties `PR_SET_PDEATHSIG` to the spawning *thread*, not the process:
/// servers must be started from a thread that lives as long as they do (a test's
/// own thread does; a `spawn_blocking` worker may not).
#[allow(unsafe_code)]
fn die_with_parent(command: &mut Command) {
    let parent = libc::pid_t::try_from(std::process::id()).expect("a pid fits in pid_t");
    let signal =
        libc::c_ulong::try_from(libc::SIGKILL).expect("SIGKILL is a small positive number");
    // SAFETY: the closure runs in the forked child before `exec`, where only
    // async-signal-safe work is allowed. It makes two raw syscalls, `prctl` and
    // `getppid` (both async-signal-safe, neither allocates nor takes locks), reads
    // two captured `Copy` integers, and builds `io::Error`s from OS error codes,
    // which does not allocate. It touches no memory shared with the parent.
    unsafe {
        command.pre_exec(move || {
            if libc::prctl(libc::PR_SET_PDEATHSIG, signal) == -1 {
                return Err(io::Error::last_os_error());
            }
            // The parent may have died between fork and prctl; then the signal
            // was never going to come. Fail the spawn instead of leaking a server.
            if libc::getppid() != parent {
                return Err(io::Error::from_raw_os_error(libc::ESRCH));
            }
            Ok(())
        });
    }
}

/// A running server. Invariant: while this value exists, the child is either
/// running or exited-but-unreaped; dropping it kills and reaps the child.
#[derive(Debug)]
pub(crate) struct ServerProcess {
    label: String,
    child: Child,
}

impl ServerProcess {
    /// CPU seconds (user and system) the process has used so far, in clock ticks (10 ms).
    pub(crate) fn cpu_seconds(&self) -> f64 {
        stat_cpu_seconds(&format!("/proc/{}/stat", self.child.id()))
    }

    /// `Some(description)` if the process has exited (it should not have).
    pub(crate) fn exited(&mut self) -> Option<String> {
        match self.child.try_wait() {
            Ok(Some(status)) => Some(format!("{} exited with {status}", self.label)),
            Ok(None) => None,
            Err(e) => Some(format!("cannot poll {}: {e}", self.label)),
        }
    }
}

impl Drop for ServerProcess {
    /// SIGKILL, then reap, so the port and data dir are released when this
    /// returns. Runs during unwinding too, so a panicking test leaves no server.
    fn drop(&mut self) {
        // Errors mean the child already exited; `wait` then just reaps it.
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

/// The last lines of the log at `path`, headed by its path, for failure messages.
pub fn log_tail(path: &Path) -> String {
    match std::fs::read_to_string(path) {
        Ok(text) => {
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(LOG_TAIL_LINES)..];
            format!(
                "--- last {} lines of {} ---\n{}",
                tail.len(),
                path.display(),
                tail.join("\n")
            )
        }
        Err(e) => format!("--- cannot read {}: {e} ---", path.display()),
    }
}

/// Whether a server's log shows it lost the race for its port (see
/// [`crate::net::free_ports`]), in which case starting again on fresh ports is
/// the right response.
pub(crate) fn lost_port_race(log_tail: &str) -> bool {
    log_tail
        .to_ascii_lowercase()
        .contains("address already in use")
}

/// What one probe of a condition saw.
pub(crate) enum Probe<T> {
    /// The condition holds.
    Ready(T),
    /// Not yet; says what was seen, for the timeout message.
    NotYet(String),
    /// It never will (say, the server exited): stop waiting now.
    Fatal(String),
}

/// Probes until `probe` is ready, fails fatally, or `timeout` passes. The sleep
/// here is the poll interval, not the wait: the wait ends as soon as the
/// condition holds. (The harness waits on real servers in real time, so it reads
/// the monotonic clock itself; the project's time rule is for decision code.)
#[allow(clippy::disallowed_methods)]
pub(crate) fn wait_for<T>(
    what: &str,
    timeout: Duration,
    mut probe: impl FnMut() -> Probe<T>,
) -> Result<T, String> {
    let deadline = Instant::now() + timeout;
    loop {
        match probe() {
            Probe::Ready(value) => return Ok(value),
            Probe::Fatal(why) => return Err(format!("{what}: {why}")),
            Probe::NotYet(seen) if Instant::now() >= deadline => {
                return Err(format!("{what}: not within {timeout:?}; last seen: {seen}"));
            }
            Probe::NotYet(_) => thread::sleep(POLL_INTERVAL),
        }
    }
}

/// Runs a short-lived program (a CLI) to completion within `timeout`, with its
/// output appended to the launch's log. Returns the log tail on failure.
pub(crate) fn run_to_completion(launch: &Launch, timeout: Duration) -> Result<(), String> {
    let mut process = launch.spawn();
    let status = wait_for(&launch.label, timeout, || match process.child.try_wait() {
        Ok(Some(status)) => Probe::Ready(status),
        Ok(None) => Probe::NotYet("still running".into()),
        Err(e) => Probe::Fatal(format!("cannot poll: {e}")),
    });
    match status {
        Ok(status) if status.success() => Ok(()),
        Ok(status) => Err(format!(
            "{} failed with {status}\n{}",
            launch.label,
            launch.log_tail()
        )),
        Err(why) => Err(format!("{why}\n{}", launch.log_tail())),
    }
}

/// This process's resident memory, bytes (`VmRSS` in `/proc/self/status`; 0 where there is none):
/// what the benchmarks divide by the pools they hold.
#[must_use]
pub fn resident_bytes() -> u64 {
    std::fs::read_to_string("/proc/self/status")
        .ok()
        .and_then(|status| {
            let line = status.lines().find(|line| line.starts_with("VmRSS:"))?;
            line.split_whitespace().nth(1)?.parse::<u64>().ok()
        })
        .map_or(0, |kib| kib * 1_024)
}

/// The kernel's clock ticks per second in `/proc` (`USER_HZ`, 100 on Linux).
const TICKS_PER_SECOND: f64 = 100.0;

/// User plus system CPU ticks in a `/proc/.../stat` line.
fn stat_cpu_ticks(stat: &str) -> u64 {
    // Fields after the parenthesised command: state is field 3; utime 14, stime 15.
    let after = stat.rsplit_once(')').map_or("", |(_, rest)| rest);
    let fields: Vec<&str> = after.split_whitespace().collect();
    let field = |n: usize| {
        fields
            .get(n - 3)
            .and_then(|f| f.parse::<u64>().ok())
            .unwrap_or(0)
    };
    field(14) + field(15)
}

/// CPU seconds (user + system) of this whole process so far, every thread: what benchmarks divide
/// by the work they did.
#[must_use]
pub fn process_cpu_seconds() -> f64 {
    stat_cpu_seconds("/proc/self/stat")
}

/// CPU seconds (user + system) a process's `stat` file (at `path`) says it has used, in clock
/// ticks; 0 when it cannot be read.
fn stat_cpu_seconds(path: &str) -> f64 {
    let stat = std::fs::read_to_string(path).unwrap_or_default();
    stat_cpu_ticks(&stat) as f64 / TICKS_PER_SECOND
}

/// CPU seconds so far of this process's live threads whose name starts with one of `prefixes`: a
/// server's share of a process that also runs its clients. Read in nanoseconds from each thread's
/// `schedstat` (time on a CPU), where the kernel keeps it; else in clock ticks from its `stat`
/// (10 ms each, too coarse for a short run).
#[must_use]
pub fn threads_cpu_seconds(prefixes: &[&str]) -> f64 {
    let Ok(tasks) = std::fs::read_dir("/proc/self/task") else {
        return 0.0;
    };
    tasks
        .flatten()
        .map(|task| task.path())
        .filter(|task| {
            std::fs::read_to_string(task.join("comm"))
                .is_ok_and(|comm| prefixes.iter().any(|p| comm.trim().starts_with(p)))
        })
        .map(|task| thread_cpu_seconds(&task))
        .sum()
}

/// One thread's CPU seconds so far (`task`: its `/proc/self/task/<tid>` directory).
fn thread_cpu_seconds(task: &std::path::Path) -> f64 {
    let on_cpu_ns = std::fs::read_to_string(task.join("schedstat"))
        .ok()
        .and_then(|line| line.split_whitespace().next()?.parse::<u64>().ok());
    match on_cpu_ns {
        Some(ns) => ns as f64 / 1e9,
        None => {
            let stat = std::fs::read_to_string(task.join("stat")).unwrap_or_default();
            stat_cpu_ticks(&stat) as f64 / TICKS_PER_SECOND
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_named_threads_cpu_is_counted_and_no_one_elses() {
        let (done, worked) = std::sync::mpsc::channel();
        let (stop, stopped) = std::sync::mpsc::channel::<()>();
        let spinner = std::thread::Builder::new()
            .name("cpu-probe-spin".to_owned())
            .spawn(move || {
                let mut sum = 0u64;
                for n in 0..50_000_000u64 {
                    sum = std::hint::black_box(sum.wrapping_add(n));
                }
                done.send(sum).expect("send");
                // Alive until read: only live threads are counted.
                let _ = stopped.recv();
            })
            .expect("spawn");
        worked.recv().expect("worked");
        let spun = threads_cpu_seconds(&["cpu-probe-spin"]);
        assert!(spun > 0.01, "the spinning thread's CPU: {spun} s");
        assert!(spun <= process_cpu_seconds() + 0.01, "within the process's");
        assert_eq!(threads_cpu_seconds(&["no-such-thread"]), 0.0);
        stop.send(()).expect("stop");
        spinner.join().expect("join");
    }

    #[test]
    fn wait_for_returns_as_soon_as_ready() {
        let mut probes = 0;
        let result = wait_for("third probe", Duration::from_secs(5), || {
            probes += 1;
            if probes == 3 {
                Probe::Ready(probes)
            } else {
                Probe::NotYet(format!("probe {probes}"))
            }
        });
        assert_eq!(result, Ok(3));
    }

    #[test]
    fn wait_for_reports_the_last_observation_on_timeout() {
        let result: Result<(), String> =
            wait_for("never", Duration::ZERO, || Probe::NotYet("still 0".into()));
        let message = result.expect_err("times out");
        assert!(
            message.contains("never") && message.contains("still 0"),
            "{message}"
        );
    }

    #[test]
    fn wait_for_stops_on_fatal() {
        let result: Result<(), String> = wait_for("doomed", Duration::from_secs(60), || {
            Probe::Fatal("exited".into())
        });
        assert_eq!(result, Err("doomed: exited".into()));
    }

    #[test]
    fn recognises_a_lost_port_race_in_either_servers_words() {
        assert!(lost_port_race(
            "listen tcp 127.0.0.1:4001: bind: address already in use"
        ));
        assert!(lost_port_race(
            "Warning: Could not create server TCP listening socket 127.0.0.1:7000: bind: Address already in use"
        ));
        assert!(!lost_port_race("ready to serve client requests"));
    }

    #[test]
    fn a_dropped_process_is_killed_and_reaped() {
        let dir = tempfile::tempdir().expect("temp dir");
        let launch = Launch {
            label: "sleep".into(),
            program: "sleep".into(),
            args: vec!["60".into()],
            log: dir.path().join("sleep.log"),
        };
        let process = launch.spawn();
        let pid = process.child.id();
        drop(process);
        // Killed and reaped: the pid names no process any more, so `kill -0` fails.
        let reaped = std::process::Command::new("kill")
            .args(["-0", &pid.to_string()])
            .stderr(Stdio::null())
            .status()
            .expect("run kill -0");
        assert!(!reaped.success(), "pid {pid} is still alive after drop");
    }

    #[test]
    fn a_failed_cli_run_quotes_its_output() {
        let dir = tempfile::tempdir().expect("temp dir");
        let launch = Launch {
            label: "sh".into(),
            program: "sh".into(),
            args: vec!["-c".into(), "echo boom-marker; exit 3".into()],
            log: dir.path().join("sh.log"),
        };
        let message =
            run_to_completion(&launch, Duration::from_secs(10)).expect_err("exit 3 fails");
        assert!(message.contains("boom-marker"), "{message}");
    }
}
