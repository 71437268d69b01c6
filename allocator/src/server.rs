//! Assembling and running an allocator: store, election, grant service, the ledger sync
//! ([`crate::ledger_sync`]) and HTTP API.
//!
//! `run` takes a bound listener and a shutdown future, so `main` and the tests drive the same code:
//! tests bind port 0 and start real allocators in-process.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use allot_shared::keys::Pepper;
use allot_shared::lease::LeaseClamping;
use clap::Parser;
use futures::FutureExt;
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::auth::{TokenBook, Tokens};
use crate::clock::{Clock, SystemClock};
use crate::grants::Grantor;
use crate::http::ApiState;
use crate::kv::Kv;
use crate::kv::etcd::EtcdKv;
use crate::kv::housekeeping::{DEFAULT_HISTORY_MS, HousekeepingSettings};
use crate::kv::memory::MemoryKv;
use crate::leader::{ElectionConfig, Roles, agree_shard_count, run_election};
use crate::ledger::Ledger;
use crate::ledger::retention::{
    DEFAULT_RAW_RETENTION_DAYS, DEFAULT_ROLLUP_RETENTION_DAYS, MAX_RETENTION_DAYS, Retention,
};
use crate::ledger_sync::{feed_ledger, ledger_feed};
use allot_shared::shards::ShardCount;

pub use crate::auth::MIN_TOKEN_LEN;

/// Command-line flags; each also reads an `ALLOT_*` environment variable, and any flag left unset
/// falls back to the TOML file given with `--config`. Precedence: flag, environment, file, default.
#[derive(Debug, Clone, Default, Parser)]
#[command(
    name = "allocator",
    version,
    about = "Allot's home-region allocator: grants regions leases of each tenant pool's global quota."
)]
pub struct Args {
    /// Address to serve the HTTP API on [default: 127.0.0.1:7600].
    #[arg(long, env = "ALLOT_LISTEN")]
    pub listen: Option<SocketAddr>,
    /// etcd endpoints, comma-separated (e.g. http://10.0.0.1:2379,http://10.0.0.2:2379). Without it the
    /// allocator runs on an embedded in-process store that forgets everything on restart: not for
    /// production.
    #[arg(long, env = "ALLOT_ETCD", value_delimiter = ',')]
    pub etcd: Option<Vec<String>>,
    /// File with the operator bearer tokens, one per line, each `[admin|author|viewer] <token>` (no
    /// role = admin); a token may be given as its digest, `sha256:<hex>` (required).
    #[arg(long, env = "ALLOT_OPERATOR_TOKEN_FILE")]
    pub operator_token_file: Option<PathBuf>,
    /// File with the agent bearer tokens, one per line, each `<region> <token>` (the region the
    /// agent may act for; `*` or none = any region); a token may be given as `sha256:<hex>` (required).
    #[arg(long, env = "ALLOT_AGENT_TOKEN_FILE")]
    pub agent_token_file: Option<PathBuf>,
    /// This node's id in leader election [default: the listen address].
    #[arg(long, env = "ALLOT_NODE_ID")]
    pub node_id: Option<String>,
    /// URL that agents and followers use to reach this node (default: `http://<listen>`).
    #[arg(long, env = "ALLOT_ADVERTISE_URL")]
    pub advertise_url: Option<String>,
    /// Leader lease TTL in seconds: how long a crashed leader holds on before a successor takes over
    /// [default: 5].
    #[arg(long, env = "ALLOT_LEADER_LEASE_TTL_S")]
    pub leader_lease_ttl_s: Option<i64>,
    /// How many shards the pools are split into, each led by one allocator at a time, 1 to 256
    /// [default: what the store holds; 1 for a new store]. Fixed for a store: the first allocator
    /// writes it, and one started with another count refuses to start.
    #[arg(long, env = "ALLOT_SHARDS")]
    pub shards: Option<u32>,
    /// The accounting ledger: `sqlite://<file>` or `postgres://...` (default: `sqlite://<data-dir>/allot.db`).
    #[arg(long, env = "ALLOT_LEDGER")]
    pub ledger: Option<String>,
    /// Directory for local files (the default SQLite ledger) [default: ./allot-data].
    #[arg(long, env = "ALLOT_DATA_DIR")]
    pub data_dir: Option<PathBuf>,
    /// PEM certificate chain to serve the API with TLS; needs --tls-key.
    #[arg(long, env = "ALLOT_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "ALLOT_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificates: every client (agents, operators) must present a certificate signed by
    /// one of them (mutual TLS), in addition to its bearer token.
    #[arg(long, env = "ALLOT_TLS_CLIENT_CA")]
    pub tls_client_ca: Option<PathBuf>,
    /// Days the ledger keeps raw reports (the JSON agents sent) and a window's raw rows after it
    /// ended [default: 7; 0 keeps them for ever]; then the window is rolled up, one row a region.
    #[arg(long, env = "ALLOT_LEDGER_RAW_RETENTION_DAYS")]
    pub ledger_raw_retention_days: Option<u64>,
    /// Days the ledger keeps rolled-up windows, window checks and inactive agents' sessions
    /// [default: 400, so a yearly invoice can be checked; 0 keeps them for ever].
    #[arg(long, env = "ALLOT_LEDGER_ROLLUP_RETENTION_DAYS")]
    pub ledger_rollup_retention_days: Option<u64>,
    /// Seconds between the leader's ledger rounds: grants reconciled, settled windows checked
    /// against their bound and published as gauges, retention [default: 30; 1 to 300].
    #[arg(long, env = "ALLOT_LEDGER_ROUND_SECONDS")]
    pub ledger_round_seconds: Option<u64>,
    /// Minutes of etcd key history the leader keeps when it compacts [default: 60].
    #[arg(long, env = "ALLOT_ETCD_HISTORY_MINUTES")]
    pub etcd_history_minutes: Option<u64>,
    /// Whether the leader defragments etcd members whose files are mostly free space, one at a
    /// time, followers first [default: true].
    #[arg(long, env = "ALLOT_ETCD_DEFRAGMENT")]
    pub etcd_defragment: Option<bool>,
    /// PEM file of the CAs webhook endpoints' certificates are checked against [default: the
    /// system's].
    #[arg(long, env = "ALLOT_WEBHOOK_CA")]
    pub webhook_ca: Option<PathBuf>,
    /// Whether webhooks may be registered for, and delivered to, loopback, private, link-local
    /// and unique-local addresses (by default they reach public addresses only, checked after
    /// every resolution) [default: false].
    #[arg(long, env = "ALLOT_WEBHOOK_ALLOW_PRIVATE", num_args = 0..=1, default_missing_value = "true")]
    pub webhook_allow_private: Option<bool>,
    /// The agents' HMAC pepper file (at least 16 bytes), to hash the user or API key an override
    /// names as agents do; without it, such overrides must give the principal's hash.
    #[arg(long, env = "ALLOT_PEPPER_FILE")]
    pub pepper_file: Option<PathBuf>,
    /// TOML file with any of the settings above (keys as the flags, with underscores).
    #[arg(long, env = "ALLOT_CONFIG")]
    pub config: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSettings {
    listen: Option<SocketAddr>,
    etcd: Option<Vec<String>>,
    operator_token_file: Option<PathBuf>,
    agent_token_file: Option<PathBuf>,
    node_id: Option<String>,
    advertise_url: Option<String>,
    leader_lease_ttl_s: Option<i64>,
    shards: Option<u32>,
    ledger: Option<String>,
    data_dir: Option<PathBuf>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    tls_client_ca: Option<PathBuf>,
    ledger_raw_retention_days: Option<u64>,
    ledger_rollup_retention_days: Option<u64>,
    ledger_round_seconds: Option<u64>,
    etcd_history_minutes: Option<u64>,
    etcd_defragment: Option<bool>,
    webhook_ca: Option<PathBuf>,
    webhook_allow_private: Option<bool>,
    pepper_file: Option<PathBuf>,
}

/// Resolved settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where to listen.
    pub listen: SocketAddr,
    /// etcd endpoints; empty for the embedded store.
    pub etcd: Vec<String>,
    /// Minutes of etcd key history kept when compacting.
    pub etcd_history_minutes: u64,
    /// Whether mostly free etcd files are defragmented.
    pub etcd_defragment: bool,
    /// Accepted tokens.
    pub tokens: Tokens,
    /// Election id.
    pub node_id: String,
    /// Advertised URL.
    pub advertise_url: String,
    /// Leader lease TTL, seconds.
    pub leader_lease_ttl_s: i64,
    /// The shard count asked for (`None`: the store's).
    pub shards: Option<ShardCount>,
    /// The ledger URL.
    pub ledger_url: String,
    /// What the ledger keeps, and how long.
    pub retention: Retention,
    /// How often the leader's ledger round runs.
    pub ledger_round: std::time::Duration,
    /// TLS for the API (none: plain TCP).
    pub tls: Option<allot_net::ServerTls>,
    /// The CAs webhook deliveries trust instead of the system's.
    pub webhook_ca: Option<PathBuf>,
    /// Whether webhooks may reach non-public addresses.
    pub webhook_allow_private: bool,
    /// The agents' pepper, to hash principals that overrides name.
    pub pepper: Option<Pepper>,
}

impl Settings {
    /// A single allocator listening on `listen` in plain HTTP, on the embedded store, accepting
    /// `tokens`, every other setting at its default: what tests, benchmarks and `allot dev` start
    /// from (changing what they need with `..Settings::local(..)`).
    pub fn local(listen: SocketAddr, tokens: Tokens, node_id: &str) -> Self {
        Self {
            listen,
            etcd: Vec::new(),
            etcd_history_minutes: 60,
            etcd_defragment: true,
            tokens,
            node_id: node_id.to_owned(),
            advertise_url: format!("http://{listen}"),
            leader_lease_ttl_s: 5,
            shards: None,
            ledger_url: String::new(),
            retention: Retention::default(),
            ledger_round: crate::ledger_sync::LEDGER_RECONCILE_INTERVAL,
            tls: None,
            webhook_ca: None,
            webhook_allow_private: false,
            pepper: None,
        }
    }
}

fn read_token_lines(flag: &str, path: Option<&Path>) -> Result<Vec<String>, String> {
    let path = path.ok_or_else(|| format!("--{flag} is required"))?;
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("--{flag} {}: {e}", path.display()))?;
    Ok(text.lines().map(str::to_owned).collect())
}

impl Args {
    /// Resolves flags, environment, the TOML file and defaults into settings, or a one-line error.
    ///
    /// Long by design: it fills the one `Settings` literal, each setting taking the flag, else the
    /// file, else the default, with its range checked beside it, and some settings follow from
    /// others resolved before them (the advertised URL's scheme from TLS, the ledger's file from
    /// the data directory); split, those would be passed between the pieces.
    pub fn resolve(self) -> Result<Settings, String> {
        let file: FileSettings = match &self.config {
            None => FileSettings::default(),
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| format!("--config {}: {e}", path.display()))?;
                toml::from_str(&text)
                    .map_err(|e| format!("--config {}: {}", path.display(), e.message()))?
            }
        };
        let listen = self
            .listen
            .or(file.listen)
            .unwrap_or(SocketAddr::from(([127, 0, 0, 1], 7600)));
        let operator_token_file = self.operator_token_file.or(file.operator_token_file);
        let agent_token_file = self.agent_token_file.or(file.agent_token_file);
        let tokens = Tokens {
            operator: read_token_lines("operator-token-file", operator_token_file.as_deref())?,
            agent: read_token_lines("agent-token-file", agent_token_file.as_deref())?,
        };
        // Validated now so a bad line stops the start with its file and line.
        TokenBook::from_files(&tokens).map_err(|e| {
            let file = if e.starts_with("--operator") {
                operator_token_file.as_deref()
            } else {
                agent_token_file.as_deref()
            };
            match file {
                Some(path) => e.replacen(": ", &format!(" {}: ", path.display()), 1),
                None => e,
            }
        })?;
        let tls = allot_net::ServerTls::from_flags(
            self.tls_cert.or(file.tls_cert),
            self.tls_key.or(file.tls_key),
            self.tls_client_ca.or(file.tls_client_ca),
        )?;
        let scheme = if tls.is_some() { "https" } else { "http" };
        let leader_lease_ttl_s = self
            .leader_lease_ttl_s
            .or(file.leader_lease_ttl_s)
            .unwrap_or(5);
        if !(1..=600).contains(&leader_lease_ttl_s) {
            return Err(format!(
                "--leader-lease-ttl-s must be in [1, 600], got {leader_lease_ttl_s}"
            ));
        }
        let data_dir = self
            .data_dir
            .or(file.data_dir)
            .unwrap_or_else(|| PathBuf::from("allot-data"));
        let ledger_url = match self.ledger.or(file.ledger) {
            Some(url) => url,
            None => {
                std::fs::create_dir_all(&data_dir)
                    .map_err(|e| format!("--data-dir {}: {e}", data_dir.display()))?;
                format!("sqlite://{}", data_dir.join("allot.db").display())
            }
        };
        let retention_days =
            |flag: &str, value: Option<u64>, default: u64| match value.unwrap_or(default) {
                days @ 0..=MAX_RETENTION_DAYS => Ok(days),
                other => Err(format!(
                    "--{flag} must be in [0, {MAX_RETENTION_DAYS}], got {other}"
                )),
            };
        let retention = Retention {
            raw_days: retention_days(
                "ledger-raw-retention-days",
                self.ledger_raw_retention_days
                    .or(file.ledger_raw_retention_days),
                DEFAULT_RAW_RETENTION_DAYS,
            )?,
            rollup_days: retention_days(
                "ledger-rollup-retention-days",
                self.ledger_rollup_retention_days
                    .or(file.ledger_rollup_retention_days),
                DEFAULT_ROLLUP_RETENTION_DAYS,
            )?,
        };
        let ledger_round_seconds = match self
            .ledger_round_seconds
            .or(file.ledger_round_seconds)
            .unwrap_or(crate::ledger_sync::LEDGER_RECONCILE_INTERVAL.as_secs())
        {
            seconds @ 1..=crate::ledger_sync::MAX_LEDGER_ROUND_SECONDS => seconds,
            other => {
                return Err(format!(
                    "--ledger-round-seconds must be in [1, {}], got {other}",
                    crate::ledger_sync::MAX_LEDGER_ROUND_SECONDS
                ));
            }
        };
        let etcd_history_minutes = match self
            .etcd_history_minutes
            .or(file.etcd_history_minutes)
            .unwrap_or(DEFAULT_HISTORY_MS / 60_000)
        {
            minutes @ 1..=10_080 => minutes,
            other => {
                return Err(format!(
                    "--etcd-history-minutes must be in [1, 10080], got {other}"
                ));
            }
        };
        Ok(Settings {
            ledger_url,
            retention,
            ledger_round: std::time::Duration::from_secs(ledger_round_seconds),
            etcd_history_minutes,
            etcd_defragment: self
                .etcd_defragment
                .or(file.etcd_defragment)
                .unwrap_or(true),
            listen,
            etcd: self.etcd.or(file.etcd).unwrap_or_default(),
            tokens,
            node_id: self
                .node_id
                .or(file.node_id)
                .unwrap_or_else(|| listen.to_string()),
            advertise_url: self
                .advertise_url
                .or(file.advertise_url)
                .unwrap_or_else(|| format!("{scheme}://{listen}")),
            leader_lease_ttl_s,
            shards: self
                .shards
                .or(file.shards)
                .map(|count| ShardCount::new(count).map_err(|e| format!("--shards: {e}")))
                .transpose()?,
            tls,
            webhook_ca: self.webhook_ca.or(file.webhook_ca),
            webhook_allow_private: self
                .webhook_allow_private
                .or(file.webhook_allow_private)
                .unwrap_or(false),
            pepper: self
                .pepper_file
                .or(file.pepper_file)
                .map(|path| {
                    let bytes = std::fs::read(&path)
                        .map_err(|e| format!("--pepper-file {}: {e}", path.display()))?;
                    Pepper::new(bytes).map_err(|e| format!("--pepper-file: {e}"))
                })
                .transpose()?,
        })
    }
}

/// Opens the store the settings name: etcd, or the embedded store (announced loudly).
pub async fn open_store(settings: &Settings, clock: Arc<dyn Clock>) -> Result<Arc<dyn Kv>, String> {
    if settings.etcd.is_empty() {
        let warning = "no --etcd given: running on the EMBEDDED in-process store. It is not durable \
                       and not shared: a restart forgets every pool and grant. Not for production.";
        tracing::warn!("{warning}");
        eprintln!("allocator: WARNING: {warning}");
        return Ok(Arc::new(MemoryKv::new(clock)));
    }
    let kv = EtcdKv::connect(&settings.etcd)
        .await
        .map_err(|e| format!("cannot connect to etcd at {}: {e}", settings.etcd.join(",")))?;
    Ok(Arc::new(kv))
}

/// Serves the allocator on `listener` over `kv` until `shutdown` resolves, then stops taking requests,
/// finishes those in flight and gives up leadership.
///
/// Long by design: the background tasks it starts (election, ledger feed, etcd upkeep, webhooks,
/// tokens) share its role channel and shutdown, and it ends each one once serving stops: the
/// election and the ledger feed awaited, so leadership is given up and the feed drained, the rest
/// aborted; split, how a task ends would be read away from where it starts.
pub async fn run(
    settings: Settings,
    kv: Arc<dyn Kv>,
    ledger: Ledger,
    clock: Arc<dyn Clock>,
    listener: TcpListener,
    shutdown: impl Future<Output = ()> + Send + 'static,
) -> std::io::Result<()> {
    // Install the recorder before anything records.
    let _ = crate::metrics::handle();
    let shard_count = agree_shard_count(&*kv, settings.shards)
        .await
        .map_err(std::io::Error::other)?;
    let (role_sender, role) = watch::channel(Roles::unknown(shard_count));
    let shutdown = shutdown.shared();
    let election = tokio::spawn(run_election(
        kv.clone(),
        clock.clone(),
        ElectionConfig {
            node_id: settings.node_id.clone(),
            advertise_url: settings.advertise_url.clone(),
            lease_ttl_s: settings.leader_lease_ttl_s,
            shard_count,
        },
        role_sender,
        shutdown.clone(),
    ));
    let (feed_sender, feed) = ledger_feed();
    let ledger_task = tokio::spawn(feed_ledger(
        ledger.clone(),
        crate::ledger_sync::LedgerRounds {
            retention: settings.retention,
            every: settings.ledger_round,
        },
        kv.clone(),
        clock.clone(),
        role.clone(),
        feed,
        shutdown.clone(),
    ));
    let grantor = Grantor::new(
        kv.clone(),
        clock.clone(),
        role.clone(),
        LeaseClamping::Clamped,
        Some(feed_sender),
    )
    .with_leader_lease_ttl_ms(u64::try_from(settings.leader_lease_ttl_s).unwrap_or(0) * 1_000);
    let tokens = Arc::new(TokenBook::from_files(&settings.tokens).map_err(std::io::Error::other)?);
    if tokens.unscoped_agent_tokens > 0 {
        tracing::warn!(
            count = tokens.unscoped_agent_tokens,
            "agent tokens without a region may act for every region; scope them with `<region> <token>` lines"
        );
    }
    if let Err(error) = crate::auth::refresh(&*kv, &tokens).await {
        tracing::warn!(%error, "stored tokens not read at start; retrying in the background");
    }
    // On etcd, the leader keeps its history compacted and its files defragmented.
    let etcd_task = (!settings.etcd.is_empty()).then(|| {
        tokio::spawn(crate::etcd_upkeep::keep_etcd(
            HousekeepingSettings {
                history_ms: settings.etcd_history_minutes.saturating_mul(60_000),
                defragment: settings.etcd_defragment,
                ..HousekeepingSettings::new(settings.etcd.clone())
            },
            clock.clone(),
            role.clone(),
            shutdown.clone(),
        ))
    });
    let webhook_delivery =
        crate::webhooks::Delivery::new(settings.webhook_ca.clone(), settings.webhook_allow_private)
            .map_err(|e| std::io::Error::other(format!("--webhook-ca: {e}")))?;
    let webhook_task = tokio::spawn(crate::webhooks::keep_webhooks(
        ledger.clone(),
        kv.clone(),
        clock.clone(),
        role.clone(),
        webhook_delivery,
        shutdown.clone(),
    ));
    let token_task = tokio::spawn(crate::auth::keep_fresh(
        kv.clone(),
        tokens.clone(),
        shutdown.clone(),
    ));
    let state = ApiState {
        kv,
        grantor,
        role,
        clock,
        tokens,
        ledger,
        status_leases: Arc::default(),
        overrides: Arc::new(crate::http::OverrideService::new(settings.pepper.clone())),
        pool_listing: Arc::default(),
        webhook_allow_private: settings.webhook_allow_private,
    };
    tracing::info!(listen = %settings.listen, node = %settings.node_id, "allocator serving");
    let acceptor = settings
        .tls
        .as_ref()
        .map(allot_net::ServerTls::acceptor)
        .transpose()
        .map_err(std::io::Error::other)?;
    let served = allot_net::serve(
        listener,
        listener_routes(state, settings.tls.is_some()),
        acceptor,
        allot_net::ServeLimits::default(),
        shutdown,
    )
    .await;
    if let Err(error) = election.await {
        tracing::warn!(%error, "election task ended abnormally");
    }
    if let Err(error) = ledger_task.await {
        tracing::warn!(%error, "ledger task ended abnormally");
    }
    token_task.abort();
    webhook_task.abort();
    if let Some(task) = etcd_task {
        task.abort();
    }
    served
}

/// The production clock.
pub fn system_clock() -> Arc<dyn Clock> {
    Arc::new(SystemClock)
}

/// Everything the listener serves, within its bounds: the API and the operator console, which
/// calls the API's routes in-process as the signed-in operator.
fn listener_routes(state: ApiState, serves_tls: bool) -> axum::Router {
    let console = crate::console::router(crate::console::ConsoleState {
        api: crate::http::routes(state.clone()),
        tokens: state.tokens.clone(),
        sessions: Arc::default(),
        clock: state.clock.clone(),
        secure_cookies: serves_tls,
    });
    allot_net::bounded_router(
        crate::http::routes(state).merge(console),
        crate::http::listener_limits(),
    )
}
