//! Proves each topology allot-testkit starts is real: the servers answer real
//! clients, enforce their real semantics (etcd transactions, Redis Cluster slot
//! rules), and survive the stops and restarts the testkit offers.

use std::ffi::OsStr;
use std::process::Command;
use std::time::Duration;

use allot_testkit::{Binary, EtcdCluster, RedisCluster, RedisServer};
use etcd_client::{Client as EtcdClient, Compare, CompareOp, ConnectOptions, Txn, TxnOp};
use redis::cluster::{ClusterClient, ClusterClientBuilder};

const CLIENT_TIMEOUT: Duration = Duration::from_secs(5);

async fn etcd_client(endpoints: &[String]) -> EtcdClient {
    let options = ConnectOptions::new()
        .with_connect_timeout(CLIENT_TIMEOUT)
        .with_timeout(CLIENT_TIMEOUT);
    EtcdClient::connect(endpoints, Some(options))
        .await
        .unwrap_or_else(|e| panic!("connect to etcd at {endpoints:?}: {e}"))
}

/// A linearizable (etcd's default) read of `key` as UTF-8.
async fn etcd_get(client: &mut EtcdClient, key: &str) -> Option<String> {
    let response = client.get(key, None).await.expect("etcd get");
    response
        .kvs()
        .first()
        .map(|kv| kv.value_str().expect("value is UTF-8").to_owned())
}

/// Sets `key` to `new` only if it currently holds `expected`.
fn compare_and_put(key: &str, expected: &str, new: &str) -> Txn {
    Txn::new()
        .when([Compare::value(key, CompareOp::Equal, expected)])
        .and_then([TxnOp::put(key, new, None)])
}

#[tokio::test]
async fn single_etcd_serves_reads_writes_and_compare_and_put() {
    let etcd = EtcdCluster::single();
    let mut client = etcd_client(&etcd.endpoints()).await;

    client.put("allot/epoch", "1", None).await.expect("put");
    assert_eq!(
        etcd_get(&mut client, "allot/epoch").await.as_deref(),
        Some("1")
    );

    let swapped = client
        .txn(compare_and_put("allot/epoch", "1", "2"))
        .await
        .expect("txn");
    assert!(swapped.succeeded(), "epoch was 1, so 1 -> 2 must apply");

    let stale = client
        .txn(compare_and_put("allot/epoch", "1", "3"))
        .await
        .expect("txn");
    assert!(
        !stale.succeeded(),
        "epoch is 2 now, so a swap expecting 1 must not apply"
    );
    assert_eq!(
        etcd_get(&mut client, "allot/epoch").await.as_deref(),
        Some("2")
    );
}

#[tokio::test]
async fn etcd_cluster_elects_a_new_leader_and_a_restarted_member_catches_up() {
    let mut etcd = EtcdCluster::start(3);
    assert_eq!(etcd.endpoints().len(), 3);
    let old_leader = etcd.leader_index();
    let (writer, reader) = ((old_leader + 1) % 3, (old_leader + 2) % 3);

    // Written through one member, read (linearizably) through another.
    let mut via_writer = etcd_client(&[etcd.member_endpoint(writer)]).await;
    let mut via_reader = etcd_client(&[etcd.member_endpoint(reader)]).await;
    via_writer
        .put("allot/epoch", "1", None)
        .await
        .expect("put through a follower");
    assert_eq!(
        etcd_get(&mut via_reader, "allot/epoch").await.as_deref(),
        Some("1")
    );

    etcd.stop_member(old_leader);
    assert_eq!(etcd.endpoints().len(), 2);
    let new_leader = etcd.leader_index();
    assert_ne!(new_leader, old_leader, "a stopped member cannot still lead");

    let mut survivors = etcd_client(&etcd.endpoints()).await;
    survivors
        .put("allot/epoch", "2", None)
        .await
        .expect("two of three members still form a quorum");
    assert_eq!(
        etcd_get(&mut via_reader, "allot/epoch").await.as_deref(),
        Some("2")
    );

    etcd.restart_member(old_leader);
    assert_eq!(etcd.endpoints().len(), 3);
    let mut via_restarted = etcd_client(&[etcd.member_endpoint(old_leader)]).await;
    assert_eq!(
        etcd_get(&mut via_restarted, "allot/epoch").await.as_deref(),
        Some("2"),
        "the restarted member must serve the write made while it was down"
    );
}

#[tokio::test]
async fn single_redis_serves_commands_and_scripts() {
    let server = RedisServer::start();
    assert_eq!(server.url(), format!("redis://127.0.0.1:{}", server.port()));
    let client = redis::Client::open(server.url()).expect("redis url");
    let mut con = client
        .get_multiplexed_async_connection()
        .await
        .expect("connect");

    let () = redis::cmd("SET")
        .arg("allot:tokens")
        .arg(41)
        .query_async(&mut con)
        .await
        .expect("SET");
    let tokens: i64 = redis::cmd("GET")
        .arg("allot:tokens")
        .query_async(&mut con)
        .await
        .expect("GET");
    assert_eq!(tokens, 41);

    let spend = redis::Script::new(
        "local left = redis.call('DECRBY', KEYS[1], ARGV[1]) \
         if left < 0 then redis.call('INCRBY', KEYS[1], ARGV[1]) return -1 end \
         return left",
    );
    let left: i64 = spend
        .key("allot:tokens")
        .arg(40)
        .invoke_async(&mut con)
        .await
        .expect("EVAL");
    assert_eq!(left, 1);
    let refused: i64 = spend
        .key("allot:tokens")
        .arg(2)
        .invoke_async(&mut con)
        .await
        .expect("EVAL");
    assert_eq!(refused, -1, "the script refuses to overspend");
}

#[test]
fn single_redis_restarts_empty_on_the_same_port() {
    let mut server = RedisServer::start();
    let port = server.port();
    let client = redis::Client::open(server.url()).expect("redis url");
    let mut con = client.get_connection().expect("connect");
    let () = redis::cmd("SET")
        .arg("k")
        .arg("v")
        .query(&mut con)
        .expect("SET");

    server.stop();
    assert!(
        client.get_connection().is_err(),
        "a stopped server must refuse connections"
    );

    server.restart();
    assert_eq!(server.port(), port);
    let mut con = client.get_connection().expect("reconnect on the same port");
    let value: Option<String> = redis::cmd("GET").arg("k").query(&mut con).expect("GET");
    assert_eq!(value, None, "nothing is persisted across a restart");
}

fn cluster_client(cluster: &RedisCluster) -> ClusterClient {
    ClusterClientBuilder::new(cluster.seed_urls())
        .connection_timeout(Duration::from_secs(1))
        .response_timeout(Duration::from_secs(2))
        .retries(2)
        .build()
        .expect("cluster client")
}

/// A connection to node `i` alone, bypassing cluster routing.
fn node_connection(cluster: &RedisCluster, i: usize) -> redis::Connection {
    redis::Client::open(cluster.node_url(i))
        .expect("node url")
        .get_connection()
        .unwrap_or_else(|e| panic!("connect to node {i}: {e}"))
}

fn keyslot(con: &mut redis::Connection, key: &str) -> u16 {
    redis::cmd("CLUSTER")
        .arg("KEYSLOT")
        .arg(key)
        .query(con)
        .expect("CLUSTER KEYSLOT")
}

fn dbsize_of_each_node(cluster: &RedisCluster) -> Vec<u64> {
    (0..3)
        .map(|i| {
            redis::cmd("DBSIZE")
                .query(&mut node_connection(cluster, i))
                .expect("DBSIZE")
        })
        .collect()
}

#[tokio::test]
async fn redis_cluster_enforces_slots_and_spreads_keys() {
    let cluster = RedisCluster::start(3);
    assert_eq!(cluster.seed_urls().len(), 3);
    let mut node0 = node_connection(&cluster, 0);
    let mut con = cluster_client(&cluster)
        .get_async_connection()
        .await
        .expect("cluster connect");

    // A shared hash tag puts keys in one slot, so one script may touch both.
    assert_eq!(
        keyslot(&mut node0, "{t:atlas}:a"),
        keyslot(&mut node0, "{t:atlas}:b")
    );
    let move_tokens = redis::Script::new(
        "redis.call('SET', KEYS[1], ARGV[1]) redis.call('SET', KEYS[2], ARGV[2]) \
         return redis.call('MGET', KEYS[1], KEYS[2])",
    );
    let both: Vec<String> = move_tokens
        .key("{t:atlas}:a")
        .key("{t:atlas}:b")
        .arg("7")
        .arg("3")
        .invoke_async(&mut con)
        .await
        .expect("a two-key script over one slot");
    assert_eq!(both, ["7", "3"]);

    // Untagged `a` and `b` live in different slots: multi-key commands fail.
    assert_ne!(keyslot(&mut node0, "a"), keyslot(&mut node0, "b"));
    let cross = move_tokens
        .key("a")
        .key("b")
        .arg("1")
        .arg("2")
        .invoke_async::<Vec<String>>(&mut con)
        .await;
    let error = cross.expect_err("a script over two slots must fail");
    assert_eq!(error.code(), Some("CROSSSLOT"), "{error}");
    let direct: redis::RedisResult<()> = redis::cmd("MSET")
        .arg(&["a", "1", "b", "2"])
        .query(&mut node0);
    let error = direct.expect_err("MSET over two slots sent to one node must fail");
    assert_eq!(error.code(), Some("CROSSSLOT"), "{error}");

    // Keys without a tag spread over all three masters.
    for i in 0..60 {
        let () = redis::cmd("SET")
            .arg(format!("spread:{i}"))
            .arg(i)
            .query_async(&mut con)
            .await
            .expect("SET");
    }
    let sizes = dbsize_of_each_node(&cluster);
    assert!(
        sizes.iter().all(|&n| n > 0),
        "every master holds some keys: {sizes:?}"
    );
    assert_eq!(
        sizes.iter().sum::<u64>(),
        60 + 2,
        "spread keys plus the two tagged keys: {sizes:?}"
    );
}

#[tokio::test]
async fn redis_cluster_serves_a_restarted_nodes_slots_again() {
    let mut cluster = RedisCluster::start(3);
    let mut con = cluster_client(&cluster)
        .get_async_connection()
        .await
        .expect("cluster connect");
    for i in 0..30 {
        let () = redis::cmd("SET")
            .arg(format!("k{i}"))
            .arg(i)
            .query_async(&mut con)
            .await
            .expect("SET");
    }
    // A key node 1 holds, and one node 0 holds.
    let on_node1: String = redis::cmd("RANDOMKEY")
        .query(&mut node_connection(&cluster, 1))
        .expect("RANDOMKEY");
    let on_node0: String = redis::cmd("RANDOMKEY")
        .query(&mut node_connection(&cluster, 0))
        .expect("RANDOMKEY");

    cluster.stop_node(1);
    assert_eq!(cluster.seed_urls().len(), 2);
    assert!(
        redis::Client::open(cluster.node_url(1))
            .expect("url")
            .get_connection()
            .is_err()
    );
    let unserved: redis::RedisResult<Option<String>> =
        redis::cmd("GET").arg(&on_node1).query_async(&mut con).await;
    assert!(
        unserved.is_err(),
        "{on_node1} lives on the stopped node, got {unserved:?}"
    );

    cluster.restart_node(1);
    assert_eq!(cluster.seed_urls().len(), 3);
    let mut con = cluster_client(&cluster)
        .get_async_connection()
        .await
        .expect("cluster reconnect");
    let lost: Option<String> = redis::cmd("GET")
        .arg(&on_node1)
        .query_async(&mut con)
        .await
        .expect("GET");
    assert_eq!(
        lost, None,
        "the node came back without its keys: nothing is persisted"
    );
    let () = redis::cmd("SET")
        .arg(&on_node1)
        .arg("again")
        .query_async(&mut con)
        .await
        .expect("SET");
    let again: String = redis::cmd("GET")
        .arg(&on_node1)
        .query_async(&mut con)
        .await
        .expect("GET");
    assert_eq!(again, "again");
    let kept: Option<String> = redis::cmd("GET")
        .arg(&on_node0)
        .query_async(&mut con)
        .await
        .expect("GET");
    assert!(
        kept.is_some(),
        "{on_node0} on a node that never stopped keeps its value"
    );
}

/// Set only in the child process of `a_missing_etcd_binary_fails_naming_the_package`.
const CHILD_MARKER: &str = "ALLOT_TESTS_MISSING_BINARY_CHILD";

#[test]
fn a_missing_etcd_binary_fails_naming_the_package() {
    // The child half: this same test, re-run alone in a process of its own with the override set.
    if std::env::var_os(CHILD_MARKER).is_some() {
        let _etcd = EtcdCluster::single();
        return;
    }
    let missing = Binary::Etcd
        .locate_in(Some(OsStr::new("/nonexistent/etcd")), None)
        .expect_err("the override points nowhere");
    assert!(missing.to_string().contains("`etcd-server`"), "{missing}");

    // End to end: `EtcdCluster::single()` with ALLOT_ETCD_BIN pointing nowhere.
    // The environment is process-global, so only a child process gets that
    // override: this test binary, running this test alone.
    let output = Command::new(std::env::current_exe().expect("test binary path"))
        .args([
            "--exact",
            // Its name in this binary: its module's path without the crate's.
            &format!(
                "{}::a_missing_etcd_binary_fails_naming_the_package",
                module_path!()
                    .split_once("::")
                    .map_or(module_path!(), |(_, module)| module)
            ),
            "--nocapture",
        ])
        .env("ALLOT_ETCD_BIN", "/nonexistent/etcd")
        .env(CHILD_MARKER, "1")
        .output()
        .expect("run the child test");
    let printed = format!(
        "{}{}",
        String::from_utf8_lossy(&output.stdout),
        String::from_utf8_lossy(&output.stderr)
    );
    assert!(
        !output.status.success(),
        "starting etcd must fail:\n{printed}"
    );
    assert!(
        printed.contains("1 failed"),
        "the child test must have run:\n{printed}"
    );
    for needle in [
        "ALLOT_ETCD_BIN=/nonexistent/etcd",
        "`etcd-server`",
        "scripts/ensure-deps",
    ] {
        assert!(
            printed.contains(needle),
            "missing {needle:?} in:\n{printed}"
        );
    }
}

/// An echo server on a loopback port, for the proxy test.
fn echo_server() -> std::net::SocketAddr {
    use std::io::{Read, Write};
    let listener = std::net::TcpListener::bind("127.0.0.1:0").expect("bind");
    let address = listener.local_addr().expect("address");
    std::thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(mut stream) = stream else { continue };
            std::thread::spawn(move || {
                let mut buffer = [0u8; 1024];
                while let Ok(n) = stream.read(&mut buffer) {
                    if n == 0 || stream.write_all(&buffer[..n]).is_err() {
                        break;
                    }
                }
            });
        }
    });
    address
}

/// Sends `message` through a new connection to `address` and reads the echo; `None` when the
/// connection is closed or nothing comes back within `timeout`.
fn echo_through(
    address: std::net::SocketAddr,
    message: &[u8],
    timeout: Duration,
) -> Option<Vec<u8>> {
    use std::io::{Read, Write};
    let mut stream = std::net::TcpStream::connect(address).ok()?;
    stream.set_read_timeout(Some(timeout)).ok()?;
    stream.write_all(message).ok()?;
    let mut answer = vec![0u8; message.len()];
    stream.read_exact(&mut answer).ok()?;
    Some(answer)
}

#[test]
// The proxy's hold and latency are about wall-clock time; this test measures them on it.
#[allow(clippy::disallowed_methods)]
fn the_fault_proxy_passes_refuses_holds_and_delays_traffic() {
    use allot_testkit::{FaultProxy, ProxyMode};
    let proxy = FaultProxy::start(echo_server());
    let timeout = Duration::from_millis(300);
    assert_eq!(
        echo_through(proxy.address(), b"ping", timeout).as_deref(),
        Some(&b"ping"[..])
    );
    // A connection open across a cut is shut down.
    let mut open = std::net::TcpStream::connect(proxy.address()).expect("connects");
    proxy.set_mode(ProxyMode::Refuse);
    assert_eq!(
        echo_through(proxy.address(), b"ping", timeout),
        None,
        "refused"
    );
    {
        use std::io::{Read, Write};
        open.set_read_timeout(Some(timeout)).expect("timeout");
        let _ = open.write_all(b"ping");
        let mut buffer = [0u8; 4];
        assert!(
            matches!(open.read(&mut buffer), Ok(0) | Err(_)),
            "the open connection was cut"
        );
    }
    proxy.set_mode(ProxyMode::Hold);
    let started = std::time::Instant::now();
    assert_eq!(
        echo_through(proxy.address(), b"ping", timeout),
        None,
        "held"
    );
    assert!(
        started.elapsed() >= timeout,
        "a held connection is silent, not closed"
    );
    proxy.set_mode(ProxyMode::Pass);
    assert_eq!(
        echo_through(proxy.address(), b"pong", timeout).as_deref(),
        Some(&b"pong"[..])
    );
    proxy.set_latency(Duration::from_millis(150));
    let started = std::time::Instant::now();
    assert_eq!(
        echo_through(proxy.address(), b"late", Duration::from_secs(2)).as_deref(),
        Some(&b"late"[..])
    );
    assert!(
        started.elapsed() >= Duration::from_millis(300),
        "150 ms each way"
    );
}
