//! `region-agent`: parses settings, opens the limiter store, loads or fetches the policy, and serves
//! gateways until SIGTERM or Ctrl-C.

use std::net::SocketAddr;
use std::path::{Path, PathBuf};
use std::process::ExitCode;
use std::sync::Arc;
use std::time::Duration;

use allot_region_agent::allocator_client::AllocatorClient;
use allot_region_agent::clock::SystemClock;
use allot_region_agent::grpc::serve_grpc;
use allot_region_agent::http::{AgentApi, serve};
use allot_region_agent::limiter::{
    DEFAULT_DECISION_RECORD_TTL_MS, DEFAULT_IN_PROCESS_MAX_KEYS, InProcessStore, Limiter,
    LimiterConfig, LimiterStore, RedisStore, RedisStoreConfig,
};
use allot_region_agent::service::{Agent, AgentSettings};
use allot_shared::ids::RegionId;
use allot_shared::keys::{IpPrefixes, Pepper};
use clap::Parser;

/// Flags; each also reads an `ALLOT_*` environment variable.
#[derive(Debug, Parser)]
#[command(
    name = "region-agent",
    version,
    about = "Allot's region agent: admission decisions for gateways."
)]
struct Args {
    /// This agent's region, e.g. eu.
    #[arg(long, env = "ALLOT_REGION")]
    region: String,
    /// Address to serve gateways on.
    #[arg(long, env = "ALLOT_LISTEN", default_value = "127.0.0.1:7700")]
    listen: SocketAddr,
    /// Address to serve Envoy's rate limit service (gRPC, RLS v3) on.
    #[arg(long, env = "ALLOT_GRPC_LISTEN", default_value = "127.0.0.1:8081")]
    grpc_listen: SocketAddr,
    /// Allocator URLs, comma-separated. Without it only policies without global rules can be served.
    #[arg(long, env = "ALLOT_ALLOCATOR", value_delimiter = ',')]
    allocator: Vec<String>,
    /// File with this agent's allocator token (first line).
    #[arg(long, env = "ALLOT_AGENT_TOKEN_FILE")]
    agent_token_file: Option<PathBuf>,
    /// File with the tokens gateways present, one per line (required).
    #[arg(long, env = "ALLOT_GATEWAY_TOKEN_FILE")]
    gateway_token_file: PathBuf,
    /// File with the HMAC pepper for principal keys (at least 16 bytes; required).
    #[arg(long, env = "ALLOT_PEPPER_FILE")]
    pepper_file: PathBuf,
    /// Redis URL of the region's limiter store. Without it the in-process store is used (announced).
    #[arg(long, env = "ALLOT_REDIS")]
    redis: Option<String>,
    /// Redis Cluster seed URLs, comma-separated (instead of --redis).
    #[arg(long, env = "ALLOT_REDIS_CLUSTER", value_delimiter = ',')]
    redis_cluster: Vec<String>,
    /// A policy bundle file. Without it the bundle is fetched from the allocator.
    #[arg(long, env = "ALLOT_POLICY_FILE")]
    policy_file: Option<PathBuf>,
    /// Append sampled decisions to this JSON-lines file (input of `allotctl policies replay`).
    #[arg(long, env = "ALLOT_DECISION_LOG")]
    decision_log: Option<PathBuf>,
    /// Share of allowed decisions logged.
    #[arg(long, env = "ALLOT_DECISION_LOG_ALLOWED_RATE", default_value_t = 0.01)]
    decision_log_allowed_rate: f64,
    /// Share of denied and fallback decisions logged.
    #[arg(long, env = "ALLOT_DECISION_LOG_DENIED_RATE", default_value_t = 1.0)]
    decision_log_denied_rate: f64,
    /// The decision log stops growing at this many bytes.
    #[arg(long, env = "ALLOT_DECISION_LOG_MAX_BYTES", default_value_t = 1 << 30)]
    decision_log_max_bytes: u64,
    /// Once the bundle has not been confirmed by the allocator for this many ms, rules marked strict
    /// fail closed (0: never).
    #[arg(long, env = "ALLOT_POLICY_MAX_AGE_MS", default_value_t = 3_600_000)]
    policy_max_age_ms: u64,
    /// This agent's id in policy status (default: `<region>-<listen port>`).
    #[arg(long, env = "ALLOT_AGENT_ID")]
    agent_id: Option<String>,
}

fn first_line(flag: &str, path: &Path) -> Result<String, String> {
    std::fs::read_to_string(path)
        .map_err(|e| format!("--{flag} {}: {e}", path.display()))?
        .lines()
        .map(str::trim)
        .find(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .ok_or_else(|| format!("--{flag} {}: empty", path.display()))
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    let terminate = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut signal) => {
                signal.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    tokio::select! {
        () = ctrl_c => {}
        () = terminate => {}
    }
}

async fn start(args: Args) -> Result<(), String> {
    let region = RegionId::parse(&args.region).map_err(|e| format!("--region: {e}"))?;
    let pepper_bytes = std::fs::read(&args.pepper_file)
        .map_err(|e| format!("--pepper-file {}: {e}", args.pepper_file.display()))?;
    let pepper = Pepper::new(pepper_bytes).map_err(|e| format!("--pepper-file: {e}"))?;
    let gateway_tokens: Vec<String> = std::fs::read_to_string(&args.gateway_token_file)
        .map_err(|e| format!("--gateway-token-file: {e}"))?
        .lines()
        .map(str::trim)
        .filter(|l| !l.is_empty() && !l.starts_with('#'))
        .map(str::to_owned)
        .collect();
    if gateway_tokens.is_empty() {
        return Err("--gateway-token-file: no token".to_owned());
    }
    let clock = Arc::new(SystemClock);
    let store: Arc<dyn LimiterStore> = if !args.redis_cluster.is_empty() {
        Arc::new(
            RedisStore::connect_cluster(&args.redis_cluster, RedisStoreConfig::default())
                .await
                .map_err(|e| format!("--redis-cluster: {e}"))?,
        )
    } else if let Some(url) = &args.redis {
        Arc::new(
            RedisStore::connect(url, RedisStoreConfig::default())
                .await
                .map_err(|e| format!("--redis {url}: {e}"))?,
        )
    } else {
        eprintln!(
            "region-agent: WARNING: no --redis given: regional rules run on the IN-PROCESS store of \
             this agent only (not shared with other agents of the region)."
        );
        Arc::new(InProcessStore::new(
            clock.clone(),
            DEFAULT_IN_PROCESS_MAX_KEYS,
        ))
    };
    let limiter =
        Limiter::new(store, LimiterConfig::default()).map_err(|e| format!("limiter: {e}"))?;
    let allocator = if args.allocator.is_empty() {
        eprintln!("region-agent: no --allocator: global (leased) rules fail closed");
        None
    } else {
        let token_file = args
            .agent_token_file
            .as_deref()
            .ok_or("--agent-token-file is required with --allocator")?;
        let token = first_line("agent-token-file", token_file)?;
        Some(Arc::new(
            AllocatorClient::new(args.allocator.clone(), token).map_err(|e| e.to_string())?,
        ))
    };
    let bundle = match &args.policy_file {
        Some(path) => Some(
            allot_shared::policy::parse_bundle(
                &std::fs::read_to_string(path)
                    .map_err(|e| format!("--policy-file {}: {e}", path.display()))?,
            )
            .and_then(|draft| draft.into_file_bundle())
            .map_err(|e| format!("--policy-file {}: {e}", path.display()))?,
        ),
        None => None,
    };
    let agent_id = args
        .agent_id
        .unwrap_or_else(|| format!("{region}-{}", args.listen.port()));
    let settings = AgentSettings {
        region,
        agent_id,
        pepper,
        ip_prefixes: IpPrefixes::default(),
        decision_record_ttl_ms: DEFAULT_DECISION_RECORD_TTL_MS,
        expiry_margin_ms: 50,
        allocator_round_trip_ms: 20,
        policy_max_age_ms: args.policy_max_age_ms,
    };
    let log_pepper = settings.pepper.clone();
    let agent = Agent::new(settings, clock, limiter, allocator, bundle);
    if let Some(path) = args.decision_log {
        let config = allot_region_agent::decision_log::DecisionLogConfig {
            path: path.clone(),
            allowed_rate: args.decision_log_allowed_rate,
            denied_rate: args.decision_log_denied_rate,
            max_bytes: args.decision_log_max_bytes,
        };
        let log = allot_region_agent::decision_log::DecisionLog::open(
            config,
            log_pepper,
            IpPrefixes::default(),
        )
        .map_err(|e| format!("--decision-log {}: {e}", path.display()))?;
        agent.set_decision_log(log);
    }
    let listener = tokio::net::TcpListener::bind(args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let grpc_listener = tokio::net::TcpListener::bind(args.grpc_listen)
        .await
        .map_err(|e| format!("cannot listen on {} (--grpc-listen): {e}", args.grpc_listen))?;
    let (stop, stopped) = tokio::sync::watch::channel(false);
    let background = tokio::spawn(agent.clone().run_background(
        Duration::from_secs(1),
        Duration::from_secs(5),
        async move {
            let mut stopped = stopped;
            let _ = stopped.wait_for(|s| *s).await;
        },
    ));
    let api = AgentApi {
        agent,
        gateway_tokens: Arc::new(gateway_tokens),
        metrics: allot_region_agent::metrics::install(),
    };
    tracing::info!(listen = %args.listen, grpc_listen = %args.grpc_listen, "region agent serving");
    // One signal stops both servers (and, after them, the background work).
    let (signal_tx, signal_rx) = tokio::sync::watch::channel(false);
    tokio::spawn(async move {
        shutdown_signal().await;
        let _ = signal_tx.send(true);
    });
    let signalled = move || {
        let mut rx = signal_rx.clone();
        async move {
            let _ = rx.wait_for(|s| *s).await;
        }
    };
    let served = tokio::try_join!(
        async {
            serve(listener, api.clone(), signalled())
                .await
                .map_err(|e| format!("http: {e}"))
        },
        async {
            serve_grpc(grpc_listener, api.clone(), signalled())
                .await
                .map_err(|e| format!("grpc: {e}"))
        },
    );
    let _ = stop.send(true);
    let _ = background.await;
    served.map(|_| ())
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ALLOT_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    match start(Args::parse()).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("region-agent: {message}");
            ExitCode::from(2)
        }
    }
}
