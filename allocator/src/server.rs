//! Assembling and running an allocator: store, election, grant service and HTTP API.
//!
//! `run` takes a bound listener and a shutdown future, so `main` and the tests drive the same code:
//! tests bind port 0 and start real allocators in-process.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use allot_shared::lease::LeaseClamping;
use clap::Parser;
use futures::FutureExt;
use serde::Deserialize;
use tokio::net::TcpListener;
use tokio::sync::watch;

use crate::auth::{TokenBook, Tokens};
use crate::clock::{Clock, SystemClock};
use crate::grants::{CommittedGrants, Grantor};
use crate::http::ApiState;
use crate::kv::Kv;
use crate::kv::etcd::EtcdKv;
use crate::kv::memory::MemoryKv;
use crate::leader::{ElectionConfig, Role, run_election};
use crate::ledger::{Ledger, WindowRow};
use crate::pools::{StoredPool, list_grants, list_pools};
use allot_shared::ids::{PoolId, TenantId};

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
    ledger: Option<String>,
    data_dir: Option<PathBuf>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    tls_client_ca: Option<PathBuf>,
}

/// Resolved settings.
#[derive(Debug, Clone)]
pub struct Settings {
    /// Where to listen.
    pub listen: SocketAddr,
    /// etcd endpoints; empty for the embedded store.
    pub etcd: Vec<String>,
    /// Accepted tokens.
    pub tokens: Tokens,
    /// Election id.
    pub node_id: String,
    /// Advertised URL.
    pub advertise_url: String,
    /// Leader lease TTL, seconds.
    pub leader_lease_ttl_s: i64,
    /// The ledger URL.
    pub ledger_url: String,
    /// TLS for the API (none: plain TCP).
    pub tls: Option<allot_net::ServerTls>,
}

fn read_token_lines(flag: &str, path: Option<&Path>) -> Result<Vec<String>, String> {
    let path = path.ok_or_else(|| format!("--{flag} is required"))?;
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("--{flag} {}: {e}", path.display()))?;
    Ok(text.lines().map(str::to_owned).collect())
}

impl Args {
    /// Resolves flags, environment, the TOML file and defaults into settings, or a one-line error.
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
        Ok(Settings {
            ledger_url,
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
            tls,
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

/// Grants copied to the ledger per batch of the feed, and the feed's capacity in batches (I10).
pub const LEDGER_FEED_BATCHES: usize = 1_024;
/// How often every pool's grant records in the store are reconciled into the ledger.
pub const LEDGER_RECONCILE_INTERVAL: std::time::Duration = std::time::Duration::from_secs(30);

/// Copies committed grants into the ledger, and periodically reconciles the ledger with the store
/// so that a grant the feed dropped (full, or the database was down) still arrives.
async fn feed_ledger(
    ledger: Ledger,
    kv: Arc<dyn Kv>,
    clock: Arc<dyn Clock>,
    role: watch::Receiver<Role>,
    mut feed: tokio::sync::mpsc::Receiver<CommittedGrants>,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let mut reconcile = tokio::time::interval(LEDGER_RECONCILE_INTERVAL);
    loop {
        tokio::select! {
            () = &mut shutdown => return,
            committed = feed.recv() => {
                let Some(committed) = committed else { return };
                if let Err(error) = ledger
                    .record_grants(&committed.tenant, &committed.pool, &committed.records)
                    .await
                {
                    tracing::warn!(%error, "could not copy grants to the ledger; reconciliation will");
                }
            }
            _ = reconcile.tick() => {
                // The leader's ledger is the one reports reach; a follower would re-read every
                // pool's grants for nothing.
                if !matches!(*role.borrow(), Role::Leader(_)) {
                    continue;
                }
                // One listing of the pools serves both passes.
                let pools = match list_pools(&*kv).await {
                    Ok(pools) => pools,
                    Err(error) => {
                        tracing::warn!(%error, "ledger round skipped: pools not listed");
                        continue;
                    }
                };
                if let Err(error) = reconcile_grants(&ledger, &*kv, &pools).await {
                    tracing::warn!(%error, "ledger reconciliation failed");
                }
                if let Err(error) =
                    publish_ledger_gauges(&ledger, &*kv, &pools, clock.now_ms()).await
                {
                    tracing::warn!(%error, "ledger gauges not updated");
                }
            }
        }
    }
}

/// Copies every grant record of `pools` (as [`list_pools`] returns them) that the ledger lacks.
/// Listings stop at [`MAX_PREFIX_KEYS`](crate::kv::MAX_PREFIX_KEYS) keys (I10); reaching that is
/// logged and counted (`allot_ledger_reconcile_truncated_total`), never silent.
pub async fn reconcile_grants(
    ledger: &Ledger,
    kv: &dyn Kv,
    pools: &[(TenantId, PoolId, StoredPool)],
) -> Result<(), String> {
    let truncated = |what: &str| {
        tracing::warn!(
            what,
            max = crate::kv::MAX_PREFIX_KEYS,
            "ledger reconciliation read a listing at its cap; the rest waits for a later round"
        );
        metrics::counter!(crate::metrics::LEDGER_RECONCILE_TRUNCATED, "listing" => what.to_owned())
            .increment(1);
    };
    if pools.len() >= crate::kv::MAX_PREFIX_KEYS {
        truncated("pools");
    }
    for (tenant, pool, _) in pools {
        let records = list_grants(kv, tenant, pool)
            .await
            .map_err(|e| e.to_string())?;
        if records.len() >= crate::kv::MAX_PREFIX_KEYS {
            truncated("grants");
        }
        ledger
            .record_grants(tenant, pool, &records)
            .await
            .map_err(|e| e.to_string())?;
    }
    Ok(())
}

/// Most pools whose last window is published as gauges per round (I10).
pub const MAX_WINDOW_GAUGE_POOLS: usize = 1_000;
/// A window's row is published once it ended this long ago, ms: its last reports (every second,
/// and a final one at lease expiry) have arrived by then.
pub const WINDOW_GAUGE_SETTLE_MS: u64 = 5_000;

/// Publishes the ledger's view as gauges: the rollout's current bundle version, and for each pool
/// (at most [`MAX_WINDOW_GAUGE_POOLS`]) the admitted tokens and the bound of its latest settled
/// window. On the way, checks every window that settled since the last round against its bound,
/// once (the ledger's `bound_checks`), counting windows checked and violations.
pub async fn publish_ledger_gauges(
    ledger: &Ledger,
    kv: &dyn Kv,
    pools: &[(TenantId, PoolId, StoredPool)],
    now_ms: u64,
) -> Result<(), String> {
    let rollout = crate::policies::rollout(kv)
        .await
        .map_err(|e| e.to_string())?;
    metrics::gauge!(crate::metrics::POLICY_CURRENT_VERSION).set(rollout.current as f64);
    let agents = crate::policies::agent_statuses(kv, now_ms)
        .await
        .map_err(|e| e.to_string())?;
    // Regions whose agents went away are set to 0, not left at their last count (a stale 2 would
    // page for ever).
    static REPORTED: std::sync::Mutex<std::collections::BTreeSet<String>> =
        std::sync::Mutex::new(std::collections::BTreeSet::new());
    let by_region = crate::policies::pepper_fingerprints(&agents);
    {
        let mut reported = REPORTED
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        for region in reported.iter() {
            if !by_region.keys().any(|r| r.as_str() == region) {
                metrics::gauge!(crate::metrics::REGION_PEPPER_FINGERPRINTS, "region" => region.clone())
                    .set(0.0);
            }
        }
        reported.clear();
        for (region, fingerprints) in by_region {
            metrics::gauge!(crate::metrics::REGION_PEPPER_FINGERPRINTS, "region" => region.to_string())
                .set(fingerprints.len() as f64);
            reported.insert(region.to_string());
        }
    }
    for (tenant, pool, stored) in pools.iter().take(MAX_WINDOW_GAUGE_POOLS) {
        let Ok(config) = stored.spec.validate() else {
            continue;
        };
        let rows = ledger
            .windows(tenant, pool, &config, CHECKED_WINDOWS_PER_ROUND, now_ms)
            .await
            .map_err(|e| e.to_string())?;
        let settled: Vec<WindowRow> = settled_windows(&rows, now_ms).cloned().collect();
        let added = ledger
            .record_bound_checks(tenant, pool, &settled, now_ms)
            .await
            .map_err(|e| e.to_string())?;
        metrics::counter!(crate::metrics::BOUND_WINDOWS_CHECKED).increment(added.windows);
        if added.violations > 0 {
            tracing::error!(
                %tenant, %pool, windows = added.violations,
                "a window admitted more than its overshoot bound"
            );
            metrics::counter!(crate::metrics::BOUND_VIOLATIONS).increment(added.violations);
        }
        if let Some(row) = settled.first() {
            let labels = [("tenant", tenant.to_string()), ("pool", pool.to_string())];
            metrics::gauge!(crate::metrics::WINDOW_ADMITTED, &labels)
                .set(row.admitted_tokens as f64);
            metrics::gauge!(crate::metrics::WINDOW_BOUND, &labels).set(row.bound_tokens as f64);
            metrics::gauge!(crate::metrics::WINDOW_OVERSHOOT, &labels)
                .set(row.overshoot_tokens as f64);
        }
    }
    let summary = ledger
        .bound_check_summary(0)
        .await
        .map_err(|e| e.to_string())?;
    metrics::gauge!(crate::metrics::BOUND_VIOLATIONS_RECORDED).set(summary.violations as f64);
    Ok(())
}

/// Windows read per pool per round ([`LEDGER_RECONCILE_INTERVAL`]): every window that closed
/// since the last round, for windows of 2 s or longer.
pub const CHECKED_WINDOWS_PER_ROUND: u64 = 16;

/// The windows of `rows` (newest first, as the ledger gives them) that ended
/// [`WINDOW_GAUGE_SETTLE_MS`] ago or more: their last reports are in, so their figures are final.
pub fn settled_windows(rows: &[WindowRow], now_ms: u64) -> impl Iterator<Item = &WindowRow> {
    rows.iter()
        .filter(move |row| row.window_end_ms.saturating_add(WINDOW_GAUGE_SETTLE_MS) <= now_ms)
}

/// Serves the allocator on `listener` over `kv` until `shutdown` resolves, then stops taking requests,
/// finishes those in flight and gives up leadership.
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
    let (role_sender, role) = watch::channel(Role::Unknown);
    let shutdown = shutdown.shared();
    let election = tokio::spawn(run_election(
        kv.clone(),
        clock.clone(),
        ElectionConfig {
            node_id: settings.node_id.clone(),
            advertise_url: settings.advertise_url.clone(),
            lease_ttl_s: settings.leader_lease_ttl_s,
        },
        role_sender,
        shutdown.clone(),
    ));
    let (feed_sender, feed) = tokio::sync::mpsc::channel(LEDGER_FEED_BATCHES);
    let ledger_task = tokio::spawn(feed_ledger(
        ledger.clone(),
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
    );
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
