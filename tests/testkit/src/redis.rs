//! Real Redis: a single server, or a Redis Cluster of masters.
//!
//! Nothing is persisted (`--save ""`, no AOF): a restarted server or node comes
//! back empty. A cluster node does keep its identity and slots across a restart,
//! because its `nodes-PORT.conf` survives in the temp dir.

use std::path::Path;
use std::time::Duration;

use tempfile::TempDir;

use crate::binary::Binary;
use crate::net::{Reply, free_ports, redis_command};
use crate::process::{Launch, Probe, ServerProcess, lost_port_race, run_to_completion, wait_for};

/// How long a server may take to answer PING, or a cluster to reach `ok`.
const READY_TIMEOUT: Duration = Duration::from_secs(20);

/// How long `redis-cli --cluster create` may take.
const CREATE_TIMEOUT: Duration = Duration::from_secs(30);

/// Redis Cluster has this many hash slots; a ready cluster assigns them all.
const CLUSTER_SLOTS: u32 = 16_384;

/// How long a cluster node may be unreachable before the others mark it failed.
/// Short so tests that stop a node see the cluster react quickly.
const NODE_TIMEOUT_MS: &str = "2000";

/// One `redis-server` process, as much of it as both topologies share.
#[derive(Debug)]
struct Node {
    port: u16,
    launch: Launch,
    /// `None` while stopped.
    process: Option<ServerProcess>,
}

impl Node {
    /// Builds the launch for a server on `port` keeping its files in `dir`;
    /// `extra` flags are appended.
    fn new(redis_server: &Path, dir: &Path, port: u16, extra: &[(&str, &str)]) -> Self {
        let log = dir.join(format!("redis-{port}.log"));
        let port_arg = port.to_string();
        let base: [(&str, &str); 6] = [
            ("--port", &port_arg),
            ("--bind", "127.0.0.1"),
            // Neither RDB snapshots nor AOF: test data lives and dies in memory.
            ("--save", ""),
            ("--appendonly", "no"),
            ("--dir", &dir.to_string_lossy()),
            ("--logfile", &log.to_string_lossy()),
        ];
        let args = base
            .iter()
            .chain(extra)
            .flat_map(|(flag, value)| [(*flag).to_owned(), (*value).to_owned()])
            .collect();
        Self {
            port,
            launch: Launch {
                label: format!("redis-server on port {port}"),
                program: redis_server.to_owned(),
                args,
                log,
            },
            process: None,
        }
    }

    fn url(&self) -> String {
        format!("redis://127.0.0.1:{}", self.port)
    }

    fn start(&mut self) {
        assert!(
            self.process.is_none(),
            "{} is already running",
            self.launch.label
        );
        self.process = Some(self.launch.spawn());
    }

    /// Kills (SIGKILL) and reaps the server.
    fn stop(&mut self) {
        assert!(
            self.process.is_some(),
            "{} is already stopped",
            self.launch.label
        );
        self.process = None; // drop kills and reaps: see `ServerProcess::drop`
    }

    /// One readiness probe: the process is alive and `check` accepts the reply to
    /// `command`.
    fn probe(
        &mut self,
        command: &[&str],
        check: impl Fn(&Reply) -> Result<(), String>,
    ) -> Probe<()> {
        let Some(process) = self.process.as_mut() else {
            return Probe::Ready(()); // a stopped node has nothing to wait for
        };
        if let Some(exit) = process.exited() {
            return Probe::Fatal(exit);
        }
        match redis_command(self.port, command) {
            Ok(reply) => match check(&reply) {
                Ok(()) => Probe::Ready(()),
                Err(seen) => Probe::NotYet(format!("{}: {seen}", self.launch.label)),
            },
            Err(e) => Probe::NotYet(format!("{}: {e}", self.launch.label)),
        }
    }
}

fn answers_pong(reply: &Reply) -> Result<(), String> {
    match reply {
        Reply::Status(s) if s == "PONG" => Ok(()),
        other => Err(format!("PING answered {other:?}")),
    }
}

/// What a server listens on besides its plain loopback port.
enum Also<'a> {
    /// Nothing more.
    Nothing,
    /// TLS on a second port, with `pki`'s server certificate.
    Tls {
        pki: &'a crate::TestPki,
        client_certificates: bool,
    },
    /// A Unix domain socket in its dir.
    Unix,
}

/// A single real `redis-server` on loopback, in a temp dir.
///
/// Dropping it kills the server and deletes the dir.
#[derive(Debug)]
pub struct RedisServer {
    // Invariant: declared before `_dir`, so the server is killed before its dir
    // is deleted (fields drop in declaration order).
    node: Node,
    /// The TLS port, for a server started with [`RedisServer::start_tls`].
    tls_port: Option<u16>,
    /// The Unix socket, for a server started with [`RedisServer::start_unix`].
    unix_socket: Option<std::path::PathBuf>,
    _dir: TempDir,
}

impl RedisServer {
    /// Starts a server and waits until it answers PING.
    ///
    /// # Panics
    /// If `redis-server` is missing (with the install hint) or does not answer
    /// within 20 s, quoting its log.
    #[must_use]
    pub fn start() -> Self {
        Self::launch(&Also::Nothing)
    }

    /// Starts a server that also serves TLS ([`RedisServer::tls_url`]) with `pki`'s server
    /// certificate; with `client_certificates`, TLS clients must present a certificate `pki`'s CA
    /// signed. Its plain port stays open for readiness probes and test inspection.
    ///
    /// # Panics
    /// As [`RedisServer::start`]; also if this `redis-server` was built without TLS.
    #[must_use]
    pub fn start_tls(pki: &crate::TestPki, client_certificates: bool) -> Self {
        Self::launch(&Also::Tls {
            pki,
            client_certificates,
        })
    }

    /// Starts a server that also listens on a Unix domain socket in its temp dir
    /// ([`RedisServer::unix_url`]), readable by this user only. Its TCP port stays open for
    /// readiness probes and test inspection.
    ///
    /// # Panics
    /// As [`RedisServer::start`].
    #[must_use]
    pub fn start_unix() -> Self {
        Self::launch(&Also::Unix)
    }

    /// Starts a server listening on `also` besides its plain port; once more on a fresh port
    /// when another process took the one it was given (see `free_ports`).
    fn launch(also: &Also<'_>) -> Self {
        let redis_server = Binary::RedisServer.require();
        match Self::try_launch(&redis_server, also) {
            Ok(server) => server,
            Err(failure) if lost_port_race(&failure) => {
                Self::try_launch(&redis_server, also).unwrap_or_else(|failure| panic!("{failure}"))
            }
            Err(failure) => panic!("{failure}"),
        }
    }

    fn try_launch(redis_server: &Path, also: &Also<'_>) -> Result<Self, String> {
        let dir = temp_dir()?;
        let ports = free_ports(if matches!(also, Also::Tls { .. }) {
            2
        } else {
            1
        });
        let port = ports[0];
        let (mut tls_port, mut unix_socket) = (None, None);
        let extra: Vec<(&str, String)> = match also {
            Also::Nothing => Vec::new(),
            Also::Tls {
                pki,
                client_certificates,
            } => {
                tls_port = Some(ports[1]);
                let path = |path: std::path::PathBuf| path.to_string_lossy().into_owned();
                let auth = if *client_certificates { "yes" } else { "no" };
                vec![
                    ("--tls-port", ports[1].to_string()),
                    ("--tls-cert-file", path(pki.server_cert())),
                    ("--tls-key-file", path(pki.server_key())),
                    ("--tls-ca-cert-file", path(pki.ca())),
                    ("--tls-auth-clients", auth.to_owned()),
                ]
            }
            Also::Unix => {
                let socket = dir.path().join("redis.sock");
                let arg = socket.to_string_lossy().into_owned();
                unix_socket = Some(socket);
                vec![
                    ("--unixsocket", arg),
                    ("--unixsocketperm", "700".to_owned()),
                ]
            }
        };
        let extra: Vec<(&str, &str)> = extra.iter().map(|(k, v)| (*k, v.as_str())).collect();
        let mut server = Self {
            node: Node::new(redis_server, dir.path(), port, &extra),
            tls_port,
            unix_socket,
            _dir: dir,
        };
        server.node.start();
        server.try_wait_ready()?;
        Ok(server)
    }

    /// `redis+unix:///path/to/redis.sock`, for a server started with [`RedisServer::start_unix`].
    ///
    /// # Panics
    /// If it was started without a Unix socket.
    #[must_use]
    pub fn unix_url(&self) -> String {
        let socket = self
            .unix_socket
            .as_ref()
            .expect("a server started with start_unix");
        format!("redis+unix://{}", socket.display())
    }

    /// `rediss://localhost:TLS_PORT` (the server certificate's name), for a server started with
    /// [`RedisServer::start_tls`].
    ///
    /// # Panics
    /// If it was started without TLS.
    #[must_use]
    pub fn tls_url(&self) -> String {
        let port = self.tls_port.expect("a server started with start_tls");
        format!("rediss://localhost:{port}")
    }

    /// `redis://127.0.0.1:PORT`.
    #[must_use]
    pub fn url(&self) -> String {
        self.node.url()
    }

    /// The server's port; stays the same across [`RedisServer::restart`].
    #[must_use]
    pub fn port(&self) -> u16 {
        self.node.port
    }

    /// Kills the server (SIGKILL) and waits for it to exit.
    ///
    /// # Panics
    /// If it is already stopped.
    pub fn stop(&mut self) {
        self.node.stop();
    }

    /// Starts the stopped server again on the same port (empty: nothing was
    /// persisted) and waits until it answers PING.
    ///
    /// # Panics
    /// If it is running, or does not answer within 20 s.
    pub fn restart(&mut self) {
        self.node.start();
        self.try_wait_ready()
            .unwrap_or_else(|failure| panic!("{failure}"));
    }

    fn try_wait_ready(&mut self) -> Result<(), String> {
        let node = &mut self.node;
        wait_for("redis-server answers PING", READY_TIMEOUT, || {
            node.probe(&["PING"], answers_pong)
        })
        .map_err(|why| format!("allot-testkit: {why}\n{}", self.node.launch.log_tail()))
    }
}

/// A Redis Cluster of real `redis-server` masters (no replicas) on loopback.
///
/// Dropping it kills every node and deletes the temp dir.
#[derive(Debug)]
pub struct RedisCluster {
    // Invariant: declared before `dir`, so nodes are killed before their files
    // are deleted (fields drop in declaration order).
    nodes: Vec<Node>,
    dir: TempDir,
}

impl RedisCluster {
    /// Starts `n` masters, joins them with `redis-cli --cluster create` (slots
    /// spread evenly), and waits until every node reports `cluster_state:ok`,
    /// all 16384 slots assigned and every node known.
    ///
    /// # Panics
    /// If `n < 3` (the minimum `redis-cli` accepts for masters), if a binary is
    /// missing (with the install hint), or if the cluster is not ready in time,
    /// quoting the logs.
    #[must_use]
    pub fn start(n: usize) -> Self {
        assert!(
            n >= 3,
            "redis-cli --cluster create needs at least 3 masters, got {n}"
        );
        let redis_server = Binary::RedisServer.require();
        let redis_cli = Binary::RedisCli.require();
        match Self::try_start(&redis_server, &redis_cli, n) {
            Ok(cluster) => cluster,
            // Lost the race for a port (see `free_ports`): once more, fresh ports.
            Err(failure) if lost_port_race(&failure) => {
                Self::try_start(&redis_server, &redis_cli, n)
                    .unwrap_or_else(|failure| panic!("{failure}"))
            }
            Err(failure) => panic!("{failure}"),
        }
    }

    fn try_start(redis_server: &Path, redis_cli: &Path, n: usize) -> Result<Self, String> {
        let dir = temp_dir()?;
        // Two ports per node: clients, and the cluster bus. Redis defaults the bus
        // to port + 10000, which for a kernel-chosen port can exceed 65535 or be
        // taken, so it is chosen explicitly (`--cluster-port`, Redis >= 7.0).
        let ports = free_ports(2 * n);
        let (client_ports, bus_ports) = ports.split_at(n);
        let nodes = client_ports
            .iter()
            .zip(bus_ports)
            .map(|(&port, &bus_port)| {
                let config_file = dir.path().join(format!("nodes-{port}.conf"));
                let cluster_flags: [(&str, &str); 4] = [
                    ("--cluster-enabled", "yes"),
                    ("--cluster-config-file", &config_file.to_string_lossy()),
                    ("--cluster-node-timeout", NODE_TIMEOUT_MS),
                    ("--cluster-port", &bus_port.to_string()),
                ];
                Node::new(redis_server, dir.path(), port, &cluster_flags)
            })
            .collect();
        let mut cluster = Self { nodes, dir };
        for node in &mut cluster.nodes {
            node.start();
        }
        let pinged = wait_for("cluster nodes answer PING", READY_TIMEOUT, || {
            all_nodes(&mut cluster.nodes, |node| {
                node.probe(&["PING"], answers_pong)
            })
        });
        pinged.map_err(|why| format!("allot-testkit: {why}\n{}", cluster.logs()))?;

        let mut args = vec!["--cluster".to_owned(), "create".to_owned()];
        args.extend(client_ports.iter().map(|port| format!("127.0.0.1:{port}")));
        args.extend(["--cluster-replicas", "0", "--cluster-yes"].map(str::to_owned));
        let create = Launch {
            label: "redis-cli --cluster create".into(),
            program: redis_cli.to_owned(),
            args,
            log: cluster.dir.path().join("cluster-create.log"),
        };
        run_to_completion(&create, CREATE_TIMEOUT)
            .map_err(|why| format!("allot-testkit: {why}\n{}", cluster.logs()))?;

        cluster.try_wait_ready()?;
        Ok(cluster)
    }

    /// URLs of the running nodes, to seed a cluster client with.
    #[must_use]
    pub fn seed_urls(&self) -> Vec<String> {
        self.nodes
            .iter()
            .filter(|node| node.process.is_some())
            .map(Node::url)
            .collect()
    }

    /// URL of node `i` (0-based), whether or not it is running. Commands sent
    /// straight to it (not through a cluster client) act on that node only.
    ///
    /// # Panics
    /// If there is no node `i`.
    #[must_use]
    pub fn node_url(&self, i: usize) -> String {
        self.node(i).url()
    }

    /// Kills node `i` (SIGKILL) and waits for it to exit. The other nodes keep
    /// it in their tables and, after the node timeout (2 s), mark it failed: its
    /// slots are unserved and the cluster reports `cluster_state:fail`.
    ///
    /// # Panics
    /// If there is no node `i` or it is already stopped.
    pub fn stop_node(&mut self, i: usize) {
        self.node_mut(i).stop();
    }

    /// Starts stopped node `i` again on the same ports with the same
    /// `nodes-PORT.conf`, so it rejoins with its identity and slots (but no keys:
    /// nothing was persisted), and waits until the cluster is ready again.
    ///
    /// # Panics
    /// If there is no node `i`, it is running, or the cluster is not ready again
    /// within 20 s.
    pub fn restart_node(&mut self, i: usize) {
        self.node_mut(i).start();
        self.wait_ready();
    }

    /// Waits until every running node reports `cluster_state:ok`, all 16384
    /// slots assigned and served, and knows every node.
    ///
    /// # Panics
    /// If that does not happen within 20 s, or a node exits; quotes the logs.
    pub fn wait_ready(&mut self) {
        self.try_wait_ready()
            .unwrap_or_else(|failure| panic!("{failure}"));
    }

    fn try_wait_ready(&mut self) -> Result<(), String> {
        let n = self.nodes.len();
        let ready = wait_for("redis cluster ready", READY_TIMEOUT, || {
            all_nodes(&mut self.nodes, |node| {
                node.probe(&["CLUSTER", "INFO"], |reply| match reply {
                    Reply::Bulk(Some(info)) => ClusterInfo::parse(info).ready(n),
                    other => Err(format!("CLUSTER INFO answered {other:?}")),
                })
            })
        });
        ready.map_err(|why| format!("allot-testkit: {why}\n{}", self.logs()))
    }

    fn node(&self, i: usize) -> &Node {
        let n = self.nodes.len();
        self.nodes
            .get(i)
            .unwrap_or_else(|| panic!("no redis cluster node {i}: the cluster has {n}"))
    }

    fn node_mut(&mut self, i: usize) -> &mut Node {
        let n = self.nodes.len();
        self.nodes
            .get_mut(i)
            .unwrap_or_else(|| panic!("no redis cluster node {i}: the cluster has {n}"))
    }

    /// Every node's log tail, the cluster-create output, and where the files are.
    fn logs(&self) -> String {
        let mut tails: Vec<String> = self
            .nodes
            .iter()
            .map(|node| node.launch.log_tail())
            .collect();
        let create_log = self.dir.path().join("cluster-create.log");
        if create_log.exists() {
            tails.push(std::fs::read_to_string(&create_log).unwrap_or_default());
        }
        format!(
            "{}\n(full logs in {})",
            tails.join("\n"),
            self.dir.path().display()
        )
    }
}

/// Ready when every node's probe is; otherwise the first node's complaint.
fn all_nodes(nodes: &mut [Node], mut probe: impl FnMut(&mut Node) -> Probe<()>) -> Probe<()> {
    for node in nodes {
        match probe(node) {
            Probe::Ready(()) => {}
            not_ready => return not_ready,
        }
    }
    Probe::Ready(())
}

fn temp_dir() -> Result<TempDir, String> {
    tempfile::Builder::new()
        .prefix("allot-redis-")
        .tempdir()
        .map_err(|e| format!("allot-testkit: cannot create a temp dir for redis: {e}"))
}

/// The fields of `CLUSTER INFO` that readiness depends on.
#[derive(Debug, Default, PartialEq, Eq)]
struct ClusterInfo {
    state_ok: bool,
    slots_assigned: u32,
    slots_ok: u32,
    known_nodes: usize,
}

impl ClusterInfo {
    /// Parses the `field:value` lines of `CLUSTER INFO`; absent fields stay 0.
    fn parse(text: &str) -> Self {
        let mut info = Self::default();
        for (field, value) in text.lines().filter_map(|line| line.trim().split_once(':')) {
            match field {
                "cluster_state" => info.state_ok = value == "ok",
                "cluster_slots_assigned" => info.slots_assigned = value.parse().unwrap_or(0),
                "cluster_slots_ok" => info.slots_ok = value.parse().unwrap_or(0),
                "cluster_known_nodes" => info.known_nodes = value.parse().unwrap_or(0),
                _ => {}
            }
        }
        info
    }

    /// `Ok` when this node sees an `ok` cluster of `n` nodes serving every slot.
    fn ready(&self, n: usize) -> Result<(), String> {
        if self.state_ok
            && self.slots_assigned == CLUSTER_SLOTS
            && self.slots_ok == CLUSTER_SLOTS
            && self.known_nodes == n
        {
            Ok(())
        } else {
            Err(format!(
                "{self:?}, want state ok, {CLUSTER_SLOTS} slots assigned and ok, {n} nodes known"
            ))
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const FORMED: &str = "cluster_state:ok\r\ncluster_slots_assigned:16384\r\ncluster_slots_ok:16384\r\n\
        cluster_slots_pfail:0\r\ncluster_slots_fail:0\r\ncluster_known_nodes:3\r\ncluster_size:3\r\n";

    #[test]
    fn a_formed_cluster_is_ready() {
        let info = ClusterInfo::parse(FORMED);
        assert_eq!(
            info,
            ClusterInfo {
                state_ok: true,
                slots_assigned: 16_384,
                slots_ok: 16_384,
                known_nodes: 3
            }
        );
        assert_eq!(info.ready(3), Ok(()));
    }

    #[test]
    fn a_fresh_node_is_not_ready() {
        let fresh = "cluster_enabled:1\r\ncluster_state:fail\r\ncluster_slots_assigned:0\r\n\
            cluster_slots_ok:0\r\ncluster_known_nodes:1\r\n";
        assert!(ClusterInfo::parse(fresh).ready(3).is_err());
    }

    #[test]
    fn a_cluster_with_a_failed_node_or_a_missing_member_is_not_ready() {
        let failed = FORMED
            .replace("cluster_state:ok", "cluster_state:fail")
            .replace("slots_ok:16384", "slots_ok:10923");
        assert!(ClusterInfo::parse(&failed).ready(3).is_err());
        assert!(ClusterInfo::parse(FORMED).ready(4).is_err());
    }
}
