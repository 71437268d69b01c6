//! Real etcd: one member or a cluster, each member a child process.

use std::path::Path;
use std::sync::atomic::{AtomicU32, Ordering};
use std::time::Duration;

use serde_json::Value;
use tempfile::TempDir;

use crate::binary::Binary;
use crate::net::{free_ports, http};
use crate::process::{Launch, Probe, ServerProcess, lost_port_race, wait_for};

/// How long a cluster may take to become healthy or elect a leader.
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// Raft timings far shorter than etcd's defaults (100 ms / 1000 ms), so losing
/// the leader costs a test about half a second. Loopback has sub-millisecond
/// round trips, so these are still comfortably above the 10x heartbeat rule.
const HEARTBEAT_MS: &str = "50";
const ELECTION_TIMEOUT_MS: &str = "500";

/// An etcd cluster of real `etcd` processes on loopback, in a temp dir.
///
/// Dropping it kills every member and deletes the data.
#[derive(Debug)]
pub struct EtcdCluster {
    // Invariant: declared before `dir`, so members are killed before their data
    // dirs are deleted (fields drop in declaration order).
    members: Vec<Member>,
    dir: TempDir,
}

#[derive(Debug)]
struct Member {
    client_port: u16,
    launch: Launch,
    /// `None` while stopped.
    process: Option<ServerProcess>,
}

impl Member {
    fn endpoint(&self) -> String {
        format!("http://127.0.0.1:{}", self.client_port)
    }
}

impl EtcdCluster {
    /// One member: the cheapest real etcd.
    ///
    /// # Panics
    /// If `etcd` is missing (with the install hint) or does not become healthy,
    /// quoting its log.
    #[must_use]
    pub fn single() -> Self {
        Self::start(1)
    }

    /// `n` members that form one cluster (3 for failover tests); returns once every
    /// member is healthy, which implies a leader has been elected.
    ///
    /// # Panics
    /// If `n` is 0, if `etcd` is missing (with the install hint), or if the cluster
    /// does not become healthy within 20 s, quoting the members' logs.
    #[must_use]
    pub fn start(n: usize) -> Self {
        assert!(n > 0, "an etcd cluster needs at least one member");
        let etcd = Binary::Etcd.require();
        match Self::try_start(&etcd, n) {
            Ok(cluster) => cluster,
            // Another process took a port between `free_ports` and etcd's bind.
            // Fresh ports make a second clash vanishingly unlikely.
            Err(failure) if lost_port_race(&failure) => {
                Self::try_start(&etcd, n).unwrap_or_else(|failure| panic!("{failure}"))
            }
            Err(failure) => panic!("{failure}"),
        }
    }

    fn try_start(etcd: &Path, n: usize) -> Result<Self, String> {
        let dir = tempfile::Builder::new()
            .prefix("allot-etcd-")
            .tempdir()
            .map_err(|e| format!("allot-testkit: cannot create a temp dir for etcd: {e}"))?;
        let ports = free_ports(2 * n);
        let (client_ports, peer_ports) = ports.split_at(n);
        let name = |i: usize| format!("m{}", i + 1);
        let peer_url = |i: usize| format!("http://127.0.0.1:{}", peer_ports[i]);
        let initial_cluster = (0..n)
            .map(|i| format!("{}={}", name(i), peer_url(i)))
            .collect::<Vec<_>>()
            .join(",");
        // Unique per cluster, so a member can never join another test's cluster
        // that happens to reuse one of these ports.
        static CLUSTERS: AtomicU32 = AtomicU32::new(0);
        let token = format!(
            "allot-{}-{}",
            std::process::id(),
            CLUSTERS.fetch_add(1, Ordering::Relaxed)
        );

        let members = (0..n)
            .map(|i| {
                let name = name(i);
                let client_url = format!("http://127.0.0.1:{}", client_ports[i]);
                let peer_url = peer_url(i);
                let data_dir = dir.path().join(&name);
                let flags: [(&str, &str); 13] = [
                    ("--name", &name),
                    ("--data-dir", &data_dir.to_string_lossy()),
                    ("--listen-client-urls", &client_url),
                    ("--advertise-client-urls", &client_url),
                    ("--listen-peer-urls", &peer_url),
                    ("--initial-advertise-peer-urls", &peer_url),
                    ("--initial-cluster", &initial_cluster),
                    // Only read on first boot: a restart finds the data dir and
                    // rejoins with the membership recorded there.
                    ("--initial-cluster-state", "new"),
                    ("--initial-cluster-token", &token),
                    ("--heartbeat-interval", HEARTBEAT_MS),
                    ("--election-timeout", ELECTION_TIMEOUT_MS),
                    // zap instead of 3.4's deprecated default (capnslog), to stderr,
                    // which goes to the log file.
                    ("--logger", "zap"),
                    ("--log-outputs", "stderr"),
                ];
                let args = flags
                    .iter()
                    .flat_map(|(flag, value)| [(*flag).to_owned(), (*value).to_owned()])
                    .collect();
                let launch = Launch {
                    label: format!("etcd {name} (client port {})", client_ports[i]),
                    program: etcd.to_owned(),
                    args,
                    log: dir.path().join(format!("{name}.log")),
                };
                Member {
                    client_port: client_ports[i],
                    process: Some(launch.spawn()),
                    launch,
                }
            })
            .collect();

        let mut cluster = Self { members, dir };
        cluster.try_wait_healthy()?;
        Ok(cluster)
    }

    /// Client URLs (`http://127.0.0.1:PORT`) of the running members.
    #[must_use]
    pub fn endpoints(&self) -> Vec<String> {
        self.members
            .iter()
            .filter(|m| m.process.is_some())
            .map(Member::endpoint)
            .collect()
    }

    /// Client URL of member `i` (0-based), whether or not it is running.
    ///
    /// # Panics
    /// If there is no member `i`.
    #[must_use]
    pub fn member_endpoint(&self, i: usize) -> String {
        self.member(i).endpoint()
    }

    /// CPU seconds (user and system) member `i` has used so far: what a benchmark charges to
    /// etcd; 0 while it is stopped.
    ///
    /// # Panics
    /// If there is no member `i`.
    #[must_use]
    pub fn member_cpu_seconds(&self, i: usize) -> f64 {
        self.member(i)
            .process
            .as_ref()
            .map_or(0.0, crate::process::ServerProcess::cpu_seconds)
    }

    /// Kills member `i` with SIGKILL (a crash, not a graceful leave: it stays in
    /// the membership) and waits for it to exit.
    ///
    /// # Panics
    /// If there is no member `i` or it is already stopped.
    pub fn stop_member(&mut self, i: usize) {
        let process = self.member_mut(i).process.take();
        assert!(process.is_some(), "etcd member {i} is already stopped");
        drop(process); // kills and reaps: see `ServerProcess::drop`
    }

    /// Starts stopped member `i` again with its data dir and ports, and waits until
    /// every running member is healthy.
    ///
    /// # Panics
    /// If there is no member `i`, it is running, or the cluster does not become
    /// healthy within 20 s.
    pub fn restart_member(&mut self, i: usize) {
        let member = self.member_mut(i);
        assert!(
            member.process.is_none(),
            "etcd member {i} is already running"
        );
        member.process = Some(member.launch.spawn());
        self.wait_healthy();
    }

    /// Waits until every running member answers `GET /health` with
    /// `"health":"true"` (it has a leader and can serve a read).
    ///
    /// # Panics
    /// If that does not happen within 20 s, or a member exits; quotes the logs.
    pub fn wait_healthy(&mut self) {
        self.try_wait_healthy()
            .unwrap_or_else(|failure| panic!("{failure}"));
    }

    fn try_wait_healthy(&mut self) -> Result<(), String> {
        let waited = wait_for("etcd members healthy", READY_TIMEOUT, || {
            let mut unhealthy = Vec::new();
            for member in &mut self.members {
                let Some(process) = member.process.as_mut() else {
                    continue;
                };
                if let Some(exit) = process.exited() {
                    return Probe::Fatal(exit);
                }
                match http(member.client_port, "GET", "/health", None) {
                    Ok(body) if is_healthy(&body) => {}
                    Ok(body) => unhealthy.push(format!("{}: {}", member.launch.label, body.trim())),
                    Err(e) => unhealthy.push(format!("{}: {e}", member.launch.label)),
                }
            }
            if unhealthy.is_empty() {
                Probe::Ready(())
            } else {
                Probe::NotYet(unhealthy.join("; "))
            }
        });
        waited.map_err(|why| format!("allot-testkit: {why}\n{}", self.logs()))
    }

    /// Index of the member that is leader, as agreed by every running member.
    /// Waits (up to 20 s) through an election in progress.
    ///
    /// # Panics
    /// If the running members do not agree on a running leader in time.
    #[must_use]
    pub fn leader_index(&self) -> usize {
        wait_for(
            "an etcd leader all running members agree on",
            READY_TIMEOUT,
            || {
                let mut views = Vec::new();
                for (i, member) in self.members.iter().enumerate() {
                    if member.process.is_none() {
                        continue;
                    }
                    let status = http(
                        member.client_port,
                        "POST",
                        "/v3/maintenance/status",
                        Some("{}"),
                    );
                    match status.as_deref().map(parse_status) {
                        Ok(Some(view)) => views.push((i, view)),
                        Ok(None) => {
                            return Probe::NotYet(format!(
                                "{}: unexpected status {status:?}",
                                member.launch.label
                            ));
                        }
                        Err(e) => return Probe::NotYet(format!("{}: {e}", member.launch.label)),
                    }
                }
                match agreed_leader(&views) {
                    Some(i) => Probe::Ready(i),
                    None => Probe::NotYet(format!("(member index, status) = {views:?}")),
                }
            },
        )
        .unwrap_or_else(|why| panic!("allot-testkit: {why}\n{}", self.logs()))
    }

    fn member(&self, i: usize) -> &Member {
        let n = self.members.len();
        self.members
            .get(i)
            .unwrap_or_else(|| panic!("no etcd member {i}: the cluster has {n}"))
    }

    fn member_mut(&mut self, i: usize) -> &mut Member {
        let n = self.members.len();
        self.members
            .get_mut(i)
            .unwrap_or_else(|| panic!("no etcd member {i}: the cluster has {n}"))
    }

    /// Every member's log tail plus where the full logs are, for failure messages.
    fn logs(&self) -> String {
        let tails: Vec<String> = self.members.iter().map(|m| m.launch.log_tail()).collect();
        format!(
            "{}\n(full logs in {})",
            tails.join("\n"),
            self.dir.path().display()
        )
    }
}

/// One member's view from `/v3/maintenance/status`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct StatusView {
    member_id: u64,
    /// 0 while the member knows no leader.
    leader: u64,
}

/// Whether a `/health` body says the member is healthy. etcd 3.4 answers
/// `{"health":"true"}` (a string), later versions add a `reason`.
fn is_healthy(body: &str) -> bool {
    serde_json::from_str::<Value>(body).is_ok_and(|v| {
        matches!(&v["health"], Value::String(s) if s == "true") || v["health"] == Value::Bool(true)
    })
}

/// Parses a `/v3/maintenance/status` body. The JSON gateway renders uint64s as
/// strings; numbers are accepted too.
fn parse_status(body: &str) -> Option<StatusView> {
    let json: Value = serde_json::from_str(body).ok()?;
    let id = |v: &Value| match v {
        Value::String(s) => s.parse().ok(),
        Value::Number(n) => n.as_u64(),
        _ => None,
    };
    Some(StatusView {
        member_id: id(&json["header"]["member_id"])?,
        leader: id(&json["leader"]).unwrap_or(0),
    })
}

/// The index of the leader if every view names the same leader and that leader
/// is among the views (so it is running and says so itself).
fn agreed_leader(views: &[(usize, StatusView)]) -> Option<usize> {
    let leader = views.first()?.1.leader;
    if leader == 0 || views.iter().any(|(_, v)| v.leader != leader) {
        return None;
    }
    views
        .iter()
        .find(|(_, v)| v.member_id == leader)
        .map(|(i, _)| *i)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reads_health_as_etcd_34_and_later_write_it() {
        assert!(is_healthy(r#"{"health":"true"}"#));
        assert!(is_healthy(r#"{"health":"true","reason":""}"#));
        assert!(!is_healthy(r#"{"health":"false"}"#));
        assert!(!is_healthy(
            r#"{"health":"false","reason":"RAFT NO LEADER"}"#
        ));
        assert!(!is_healthy("404 page not found"));
    }

    #[test]
    fn parses_the_status_gateway_json() {
        let body = r#"{"header":{"cluster_id":"14841639068965178418","member_id":"10276657743932975437",
            "revision":"1","raft_term":"2"},"version":"3.4.23","dbSize":"20480",
            "leader":"10276657743932975437","raftIndex":"4","raftTerm":"2"}"#;
        assert_eq!(
            parse_status(body),
            Some(StatusView {
                member_id: 10_276_657_743_932_975_437,
                leader: 10_276_657_743_932_975_437
            })
        );
        assert_eq!(
            parse_status(r#"{"header":{"member_id":"7"}}"#),
            Some(StatusView {
                member_id: 7,
                leader: 0
            })
        );
        assert_eq!(parse_status(r#"{"error":"etcdserver: no leader"}"#), None);
    }

    #[test]
    fn a_leader_counts_only_when_all_agree_and_it_is_running() {
        let view = |member_id, leader| StatusView { member_id, leader };
        assert_eq!(
            agreed_leader(&[(0, view(1, 2)), (1, view(2, 2)), (2, view(3, 2))]),
            Some(1)
        );
        // Mid-election: one member has not heard of the new leader yet.
        assert_eq!(agreed_leader(&[(0, view(1, 0)), (2, view(3, 3))]), None);
        // Both remaining members still name the killed leader (member 2).
        assert_eq!(agreed_leader(&[(0, view(1, 2)), (2, view(3, 2))]), None);
        assert_eq!(agreed_leader(&[]), None);
    }
}
