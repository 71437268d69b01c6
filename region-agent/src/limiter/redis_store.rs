//! The Redis limiter store: the Lua code on a single Redis or a Redis Cluster (Redis 7 or later).
//!
//! The decision is a function library (`scripts/decide.lua`), loaded with `FUNCTION LOAD` when the
//! store connects and called with `FCALL`: the library's code runs once when it is loaded, so a
//! call pays only for the decision, and it keeps the arguments it has validated (docs/limiter.md).
//! Its name carries the first 16 hex digits of its text's SHA-1, so agents of two versions each
//! call their own. The concurrency script is loaded with `SCRIPT LOAD` and called with `EVALSHA`.
//! Both can be lost (a restart without persistence, a flush), so a reply saying the function or
//! script is unknown loads it again and retries once: such a reply means nothing ran, so the retry
//! cannot double-debit. On a cluster the reload goes only to the node that owns the call's slot, so
//! a shard that is down elsewhere cannot fail it.
//!
//! Every call runs under one deadline (`call_timeout`, a tokio timeout) covering the reload and the
//! retry too. What a failure means is classified in [`StoreError`].
//!
//! The cluster client never re-sends a command by itself (`retries(0)`): after a dropped connection
//! the script may have run, and re-sending a non-idempotent decision would debit twice (I6). Such a
//! failure is returned as [`StoreError::Ambiguous`] for the caller to handle with its decision record;
//! a redirect (`MOVED`/`ASK`, after resharding) is returned as [`StoreError::NotExecuted`] and the
//! client refreshes its slot map for the next call.
//!
//! Production calls always let the script read the server's clock (`TIME`). Only this crate's tests
//! can make the store send a time of its own.
//!
//! **Shards.** The client path keeps a circuit breaker per shard ([`LimiterStore::shard_of`]). A
//! single server is one shard. On a cluster the store reads `CLUSTER SLOTS` when it connects and
//! maps each slot to its master (shard `i` is the `i`-th distinct master in that reply), so a dead
//! master opens only its own breaker. The map is not refreshed: after a resharding some slots are
//! grouped with their former master, which only makes breakers coarser (a failover keeps the slot
//! ranges, so their shard index stays right). If the reply cannot be read, the cluster is one shard.

use std::sync::Arc;
use std::sync::atomic::{AtomicU64, Ordering};
use std::time::Duration;

#[cfg(test)]
use allot_shared::clock::Clock;
use redis::aio::{ConnectionManager, ConnectionManagerConfig};
use redis::cluster::ClusterClientBuilder;
use redis::{Cmd, RedisError, RedisResult};

use allot_shared::keys;

use super::batch::RuleBatch;
use super::coalescing::{Coalescer, DEFAULT_CALLS_IN_FLIGHT_PER_SLOT};
pub(crate) use super::redis_calls::Connection;
use super::redis_calls::{Calls, Code, Library, Script};
pub use super::scripts::StateLayout;
use super::scripts::{
    CONCURRENCY_SOURCE, SERVER_TIME, decide_args, decide_keys, decide_library, lease_args,
    parse_decide_reply, parse_lease_reply,
};
use super::store::{
    BatchDecision, LeaseCall, LeaseOperation, LeaseOutcome, LimiterStore, StoreError,
};

/// Default budget of one store call (`FCALL` or `EVALSHA`, and a reload and retry): the
/// limiter sits on every request's path, so a slow store must turn into a degraded decision quickly.
pub const DEFAULT_CALL_TIMEOUT: Duration = Duration::from_millis(25);

/// Default budget for opening a connection.
pub const DEFAULT_CONNECT_TIMEOUT: Duration = Duration::from_secs(1);

/// Timeouts of a [`RedisStore`], and whether it coalesces.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RedisStoreConfig {
    /// Deadline of one call, reload and retry included.
    pub call_timeout: Duration,
    /// Deadline for opening a connection, and for the setup on it (loading the Lua code, which
    /// Redis compiles; reading a cluster's slots).
    pub connect_timeout: Duration,
    /// Decisions of one slot that arrive while the slot's calls are in flight go together in the
    /// next call ([`super::coalescing`]). On by default: on a hot tenant it saves more than half
    /// of Redis's CPU per decision and lowers the p99, and a decision of a slot with nothing in
    /// flight is sent at once either way (docs/limiter.md). Off, every decision is a call of its
    /// own.
    pub coalesce: bool,
    /// With `coalesce`, calls of one slot in flight at once (1 to
    /// [`super::coalescing::MAX_CALLS_IN_FLIGHT_PER_SLOT`]; default
    /// [`super::coalescing::DEFAULT_CALLS_IN_FLIGHT_PER_SLOT`]).
    pub coalesced_calls_in_flight: usize,
    /// How rule state is written (strings by default; hashes for the length of a rolling upgrade
    /// from agents that wrote hashes). Both are read either way.
    pub state_layout: StateLayout,
}

/// PEM certificates for a limiter store reached over TLS (`rediss://`).
#[derive(Clone, Default, PartialEq, Eq)]
pub struct RedisTls {
    /// CA certificates to trust (PEM); `None`: the system's roots.
    pub ca_pem: Option<Vec<u8>>,
    /// Client certificate chain and private key (PEM), for mutual TLS.
    pub client_pem: Option<(Vec<u8>, Vec<u8>)>,
}

impl std::fmt::Debug for RedisTls {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RedisTls")
            .field("ca", &self.ca_pem.is_some())
            .field("client_certificate", &self.client_pem.is_some())
            .finish()
    }
}

impl RedisTls {
    /// Whether anything is configured (otherwise `rediss://` trusts the system's roots).
    fn is_set(&self) -> bool {
        self.ca_pem.is_some() || self.client_pem.is_some()
    }

    fn certificates(&self) -> redis::TlsCertificates {
        redis::TlsCertificates {
            client_tls: self.client_pem.clone().map(|(client_cert, client_key)| {
                redis::ClientTlsConfig {
                    client_cert,
                    client_key,
                }
            }),
            root_cert: self.ca_pem.clone(),
        }
    }
}

impl Default for RedisStoreConfig {
    fn default() -> Self {
        Self {
            call_timeout: DEFAULT_CALL_TIMEOUT,
            connect_timeout: DEFAULT_CONNECT_TIMEOUT,
            coalesce: true,
            coalesced_calls_in_flight: DEFAULT_CALLS_IN_FLIGHT_PER_SLOT,
            state_layout: StateLayout::Strings,
        }
    }
}

/// Hash slots in a Redis Cluster.
const CLUSTER_SLOTS: usize = 16_384;

/// CRC16/XMODEM (polynomial 0x1021, initial value 0), the checksum Redis Cluster slots use.
fn crc16(bytes: &[u8]) -> u16 {
    let mut crc: u16 = 0;
    for &byte in bytes {
        crc ^= u16::from(byte) << 8;
        for _ in 0..8 {
            crc = if crc & 0x8000 != 0 {
                (crc << 1) ^ 0x1021
            } else {
                crc << 1
            };
        }
    }
    crc
}

/// The cluster slot of `key`: of its hash tag when it has a non-empty one, as Redis computes it.
pub(crate) fn key_slot(key: &str) -> usize {
    let hashed = keys::key_hash_tag(key).unwrap_or(key);
    usize::from(crc16(hashed.as_bytes())) % CLUSTER_SLOTS
}

/// Which shard owns each slot.
#[derive(Debug, Clone, PartialEq, Eq)]
enum ShardMap {
    /// One shard: a single server, or a cluster whose slot map could not be read.
    One,
    /// A cluster: `slot_shard[slot]` is an index into `masters`.
    Masters {
        masters: Vec<String>,
        slot_shard: Vec<u16>,
    },
}

impl ShardMap {
    /// Reads a `CLUSTER SLOTS` reply: `[[start, end, [host, port, ...], replicas...], ...]`.
    fn from_cluster_slots(reply: &redis::Value) -> Option<Self> {
        let int = |value: &redis::Value| match value {
            redis::Value::Int(n) => usize::try_from(*n).ok(),
            _ => None,
        };
        let text = |value: &redis::Value| match value {
            redis::Value::BulkString(bytes) => String::from_utf8(bytes.clone()).ok(),
            redis::Value::SimpleString(text) => Some(text.clone()),
            _ => None,
        };
        let redis::Value::Array(ranges) = reply else {
            return None;
        };
        let mut masters: Vec<String> = Vec::new();
        let mut slot_shard = vec![0u16; CLUSTER_SLOTS];
        for range in ranges {
            let redis::Value::Array(fields) = range else {
                return None;
            };
            let (start, end) = (int(fields.first()?)?, int(fields.get(1)?)?);
            let redis::Value::Array(master) = fields.get(2)? else {
                return None;
            };
            let name = format!("{}:{}", text(master.first()?)?, int(master.get(1)?)?);
            let index = match masters.iter().position(|known| *known == name) {
                Some(index) => index,
                None => {
                    masters.push(name);
                    masters.len() - 1
                }
            };
            let index = u16::try_from(index).ok()?;
            if start > end || end >= CLUSTER_SLOTS {
                return None;
            }
            slot_shard[start..=end].fill(index);
        }
        (!masters.is_empty()).then_some(ShardMap::Masters {
            masters,
            slot_shard,
        })
    }
}

/// Where the scripts take `now` from.
#[derive(Clone)]
enum ScriptTime {
    /// The server's `TIME`: always, in production.
    Server,
    /// A test clock, sent as the scripts' `now_ms` argument.
    #[cfg(test)]
    Driven(Arc<dyn Clock>),
}

/// A limiter store on Redis (single server or cluster). See the module docs.
pub struct RedisStore {
    calls: Arc<Calls>,
    /// Decisions of one slot that arrive while a call of that slot is in flight go together in the
    /// next call (`None`: every decision is a call of its own).
    coalescer: Option<Arc<Coalescer>>,
    time: ScriptTime,
    state_layout: StateLayout,
    /// Which master owns each slot, for per-shard breakers.
    shards: ShardMap,
}

impl std::fmt::Debug for RedisStore {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let topology = match self.calls.connection {
            Connection::Single(_) => "single",
            Connection::Cluster(_) => "cluster",
        };
        f.debug_struct("RedisStore")
            .field("topology", &topology)
            .field("call_timeout", &self.calls.call_timeout)
            .field("script_reloads", &self.script_reloads())
            .field("coalescing", &self.coalescer.is_some())
            .finish_non_exhaustive()
    }
}

impl RedisStore {
    /// Connects to one Redis at `url` (`redis://host:port`, or `rediss://` over TLS trusting
    /// the system's roots) and loads the scripts.
    pub async fn connect(url: &str, config: RedisStoreConfig) -> Result<Self, StoreError> {
        Self::connect_with_tls(url, config, &RedisTls::default()).await
    }

    /// [`connect`](Self::connect), with `tls`'s certificates for a `rediss://` URL.
    pub async fn connect_with_tls(
        url: &str,
        config: RedisStoreConfig,
        tls: &RedisTls,
    ) -> Result<Self, StoreError> {
        let client = if tls.is_set() {
            redis::Client::build_with_tls(url, tls.certificates())
        } else {
            redis::Client::open(url)
        }
        .map_err(not_connected)?;
        // The connection's own reply timeout bounds the setup (loading the library, which Redis
        // compiles); every decision call runs under `call_timeout` in `Calls::run`.
        let manager_config = ConnectionManagerConfig::new()
            .set_connection_timeout(Some(config.connect_timeout))
            .set_response_timeout(Some(config.connect_timeout));
        let manager = ConnectionManager::new_with_config(client, manager_config)
            .await
            .map_err(not_connected)?;
        Self::load_scripts(Connection::Single(manager), config).await
    }

    /// Connects to a Redis Cluster through any of `seed_urls` and loads the scripts on every node.
    pub async fn connect_cluster(
        seed_urls: &[String],
        config: RedisStoreConfig,
    ) -> Result<Self, StoreError> {
        Self::connect_cluster_with_tls(seed_urls, config, &RedisTls::default()).await
    }

    /// [`connect_cluster`](Self::connect_cluster), with `tls`'s certificates for `rediss://`
    /// seeds.
    pub async fn connect_cluster_with_tls(
        seed_urls: &[String],
        config: RedisStoreConfig,
        tls: &RedisTls,
    ) -> Result<Self, StoreError> {
        let mut builder = ClusterClientBuilder::new(seed_urls.iter().map(String::as_str));
        if tls.is_set() {
            builder = builder.certs(tls.certificates());
        }
        let client = builder
            // Never re-send: a command re-sent after a dropped connection may debit twice (I6).
            .retries(0)
            .connection_timeout(config.connect_timeout)
            // As for one server: the setup's bound; each call has its own deadline.
            .response_timeout(config.connect_timeout)
            .build()
            .map_err(not_connected)?;
        let mut connection = client.get_async_connection().await.map_err(not_connected)?;
        let mut store = Self::load_scripts(Connection::Cluster(connection.clone()), config).await?;
        let slots: RedisResult<redis::Value> = redis::cmd("CLUSTER")
            .arg("SLOTS")
            .query_async(&mut connection)
            .await;
        match slots.map(|reply| ShardMap::from_cluster_slots(&reply)) {
            Ok(Some(shards)) => store.shards = shards,
            Ok(None) => {
                tracing::warn!("unreadable CLUSTER SLOTS reply: one breaker for the cluster")
            }
            Err(error) => {
                tracing::warn!(%error, "CLUSTER SLOTS failed: one breaker for the cluster")
            }
        }
        Ok(store)
    }

    async fn load_scripts(
        mut connection: Connection,
        config: RedisStoreConfig,
    ) -> Result<Self, StoreError> {
        let store = Self {
            calls: Arc::new(Calls {
                connection: connection.clone(),
                decide_library: Library::new(&decide_library()),
                concurrency_script: Script::new(CONCURRENCY_SOURCE),
                call_timeout: config.call_timeout,
                script_reloads: AtomicU64::new(0),
            }),
            coalescer: config
                .coalesce
                .then(|| Arc::new(Coalescer::new(config.coalesced_calls_in_flight))),
            time: ScriptTime::Server,
            state_layout: config.state_layout,
            shards: ShardMap::One,
        };
        for code in [
            Code::Library(&store.calls.decide_library),
            Code::Script(&store.calls.concurrency_script),
        ] {
            connection
                .load_everywhere(code)
                .await
                .map_err(not_connected)?;
        }
        Ok(store)
    }

    /// The masters the client path keeps a breaker for, by shard index (`host:port`); empty for a
    /// single server.
    pub fn shard_masters(&self) -> Vec<String> {
        match &self.shards {
            ShardMap::One => Vec::new(),
            ShardMap::Masters { masters, .. } => masters.clone(),
        }
    }

    /// The exact `FCALL` this store sends to decide `batch`, for benchmarks that compare the client
    /// path with a raw call of the same function (it must be loaded: connecting loads it).
    pub fn decide_command(&self, batch: &RuleBatch) -> Cmd {
        let args = decide_args(batch, self.now_arg(), self.state_layout);
        self.calls.decide_library.fcall(&decide_keys(batch), &args)
    }

    /// The coalescer's most calls of one slot in flight at once, and slots with calls in flight
    /// now ((0, 0) without coalescing).
    #[cfg(test)]
    pub(crate) fn coalesced_calls_in_flight(&self) -> (usize, usize) {
        self.coalescer
            .as_ref()
            .map_or((0, 0), |c| c.calls_in_flight())
    }

    /// How many replies saying the library or a script was unknown were answered by loading it
    /// again.
    pub fn script_reloads(&self) -> u64 {
        self.calls.script_reloads.load(Ordering::Relaxed)
    }

    /// Makes the scripts take `now` from `clock` instead of the server's `TIME`, so differential
    /// tests can drive time. Keys then expire on that clock too (`PEXPIREAT now + ttl`): tests keep
    /// it ahead of the real clock, where Redis's own expiry cannot interfere.
    #[cfg(test)]
    pub(crate) fn with_test_clock(mut self, clock: Arc<dyn Clock>) -> Self {
        self.time = ScriptTime::Driven(clock);
        self
    }

    /// Makes the store call the decide library as written, its marked steps called rather than
    /// inlined: for the differential test that holds the two texts to the same decisions.
    #[cfg(test)]
    pub(crate) async fn with_decide_library_as_written(mut self) -> Self {
        let calls = Arc::get_mut(&mut self.calls).expect("the store is not shared yet");
        calls.decide_library = Library::new(super::scripts::DECIDE_SOURCE);
        let mut connection = calls.connection.clone();
        connection
            .load_everywhere(Code::Library(&calls.decide_library))
            .await
            .expect("loads the library as written");
        self
    }

    fn now_arg(&self) -> u64 {
        match &self.time {
            ScriptTime::Server => SERVER_TIME,
            #[cfg(test)]
            ScriptTime::Driven(clock) => clock.now_ms(),
        }
    }

    /// The store's connection, for tests that inspect keys directly.
    #[cfg(test)]
    pub(crate) fn connection(&self) -> Connection {
        self.calls.connection.clone()
    }

    /// Runs the decide script with raw arguments: for tests of the script's own validation.
    #[cfg(test)]
    pub(crate) async fn run_decide_raw(
        &self,
        keys: &[&str],
        args: &[String],
    ) -> Result<Vec<i64>, StoreError> {
        self.calls.decide_one(keys, args).await
    }

    /// Runs the coalesced decide function with raw arguments: for tests of its own validation.
    #[cfg(test)]
    pub(crate) async fn run_decide_many_raw(
        &self,
        keys: &[&str],
        args: &[String],
    ) -> Result<Vec<Result<Vec<i64>, StoreError>>, StoreError> {
        self.calls.decide_many_raw(keys, args).await
    }

    /// Decides `requests` (lone calls' keys and arguments, of one slot, in order) as a coalescing
    /// store sends them: for tests of what goes in a coalesced call and what is refused alone.
    #[cfg(test)]
    pub(crate) async fn decide_many_requests(
        &self,
        requests: &[(&[String], &[String])],
    ) -> Result<Vec<Result<Vec<i64>, StoreError>>, StoreError> {
        self.calls.decide_many(requests).await
    }

    /// Decides `batches` (requests of one slot, in order) in one coalesced call, at the store's
    /// clock: for tests that hold coalesced calls to lone ones.
    #[cfg(test)]
    pub(crate) async fn decide_coalesced_raw(
        &self,
        batches: &[RuleBatch],
    ) -> Result<Vec<Result<BatchDecision, StoreError>>, StoreError> {
        let now_ms = self.now_arg();
        let owned: Vec<(Vec<String>, Vec<String>)> = batches
            .iter()
            .map(|batch| {
                let keys = decide_keys(batch).into_iter().map(str::to_owned).collect();
                (keys, decide_args(batch, now_ms, self.state_layout))
            })
            .collect();
        let requests: Vec<(&[String], &[String])> = owned
            .iter()
            .map(|(keys, args)| (&keys[..], &args[..]))
            .collect();
        let replies = self.calls.decide_many(&requests).await?;
        Ok(replies
            .into_iter()
            .zip(batches)
            .map(|(reply, batch)| {
                reply.and_then(|reply| {
                    parse_decide_reply(batch, &reply)
                        .map_err(|detail| StoreError::MalformedReply { detail })
                })
            })
            .collect())
    }

    async fn lease(
        &self,
        call: &LeaseCall,
        operation: LeaseOperation,
    ) -> Result<LeaseOutcome, StoreError> {
        let args = lease_args(operation, call, self.now_arg());
        let reply: Vec<i64> = self
            .calls
            .run(
                Code::Script(&self.calls.concurrency_script),
                &[call.key()],
                &args,
            )
            .await?;
        parse_lease_reply(&reply).map_err(|detail| StoreError::MalformedReply { detail })
    }
}

#[async_trait::async_trait]
impl LimiterStore for RedisStore {
    async fn decide(&self, batch: &RuleBatch) -> Result<BatchDecision, StoreError> {
        let args = decide_args(batch, self.now_arg(), self.state_layout);
        let keys = decide_keys(batch);
        let tag = keys::key_hash_tag(batch.record_key());
        let reply = match (&self.coalescer, tag) {
            (Some(coalescer), Some(tag)) => coalescer.decide(&self.calls, tag, &keys, args).await,
            _ => self.calls.decide_one(&keys, &args).await,
        }?;
        parse_decide_reply(batch, &reply).map_err(|detail| StoreError::MalformedReply { detail })
    }

    async fn acquire_lease(&self, call: &LeaseCall) -> Result<LeaseOutcome, StoreError> {
        self.lease(call, LeaseOperation::Acquire).await
    }

    async fn renew_lease(&self, call: &LeaseCall) -> Result<LeaseOutcome, StoreError> {
        self.lease(call, LeaseOperation::Renew).await
    }

    async fn release_lease(&self, call: &LeaseCall) -> Result<LeaseOutcome, StoreError> {
        self.lease(call, LeaseOperation::Release).await
    }

    fn coalesced(&self) -> (u64, u64) {
        self.coalescer.as_ref().map_or((0, 0), |c| c.counts())
    }

    fn shard_count(&self) -> usize {
        match &self.shards {
            ShardMap::One => 1,
            ShardMap::Masters { masters, .. } => masters.len(),
        }
    }

    fn shard_of(&self, batch: &RuleBatch) -> usize {
        match &self.shards {
            ShardMap::One => 0,
            ShardMap::Masters { slot_shard, .. } => slot_shard
                .get(key_slot(batch.record_key()))
                .map_or(0, |&shard| usize::from(shard)),
        }
    }

    fn shard_of_key(&self, key: &str) -> usize {
        match &self.shards {
            ShardMap::One => 0,
            ShardMap::Masters { slot_shard, .. } => slot_shard
                .get(key_slot(key))
                .map_or(0, |&shard| usize::from(shard)),
        }
    }
}

fn not_connected(error: RedisError) -> StoreError {
    StoreError::NotExecuted {
        detail: format!("connecting: {error}"),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slots_are_crc16_xmodem_of_the_hash_tag() {
        assert_eq!(crc16(b"123456789"), 0x31c3, "the CRC16/XMODEM check value");
        // Values from the Redis Cluster specification and `CLUSTER KEYSLOT`.
        assert_eq!(key_slot("foo"), 12_182);
        assert_eq!(
            key_slot("{user1000}.following"),
            key_slot("{user1000}.followers")
        );
        // An empty first tag: the whole key is hashed.
        assert_eq!(
            key_slot("foo{}{bar}"),
            usize::from(crc16(b"foo{}{bar}")) % CLUSTER_SLOTS
        );
        assert_eq!(key_slot("rl:v1:{t:atlas}:d:r-1"), key_slot("t:atlas"));
    }

    #[test]
    fn a_cluster_slots_reply_maps_each_slot_to_its_master() {
        use redis::Value::{Array, BulkString, Int};
        let node = |port: i64| {
            Array(vec![
                BulkString(b"127.0.0.1".to_vec()),
                Int(port),
                BulkString(b"id".to_vec()),
            ])
        };
        let reply = Array(vec![
            Array(vec![Int(0), Int(5_460), node(7000)]),
            Array(vec![Int(5_461), Int(10_922), node(7001), node(7004)]),
            Array(vec![Int(10_923), Int(16_383), node(7002)]),
        ]);
        let Some(ShardMap::Masters {
            masters,
            slot_shard,
        }) = ShardMap::from_cluster_slots(&reply)
        else {
            panic!("a readable reply");
        };
        assert_eq!(
            masters,
            ["127.0.0.1:7000", "127.0.0.1:7001", "127.0.0.1:7002"]
        );
        assert_eq!(
            (slot_shard[0], slot_shard[5_461], slot_shard[16_383]),
            (0, 1, 2)
        );
        assert_eq!(ShardMap::from_cluster_slots(&Array(vec![Int(1)])), None);
        assert_eq!(
            ShardMap::from_cluster_slots(&Array(vec![Array(vec![Int(0), Int(16_384), node(1)])])),
            None,
            "a slot out of range"
        );
    }
}
