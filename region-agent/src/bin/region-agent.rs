//! `region-agent`: parses settings, opens the limiter store, loads or fetches the policy, and serves
//! gateways until SIGTERM or Ctrl-C.

use std::path::Path;
use std::process::ExitCode;
use std::sync::Arc;

use allot_region_agent::allocator_client::AllocatorClient;
use allot_region_agent::clock::SystemClock;
use allot_region_agent::config::{AgentArgs, AgentConfig};
use allot_region_agent::limiter::{
    DEFAULT_IN_PROCESS_MAX_KEYS, InProcessStore, Limiter, LimiterConfig, LimiterStore, RedisStore,
    RedisStoreConfig, StateLayout,
};
use allot_region_agent::server::{Listeners, Serving};
use allot_region_agent::service::{Agent, AgentSettings};
use allot_shared::ids::{AgentId, RegionId};
use allot_shared::keys::Pepper;
use clap::Parser;

/// mimalloc: fewer cycles per allocation than the system allocator on the request path (measured
/// by the agent benchmark, docs/benchmarks.md).
#[global_allocator]
static ALLOCATOR: mimalloc::MiMalloc = mimalloc::MiMalloc;

/// This agent's allocator token: the first line that is either a bare token or `<region> <token>`
/// naming this agent's region (so the allocator's `--agent-token-file` format works here too; lines
/// for other regions are skipped). A digest is refused: the agent must present the token itself.
fn agent_token(path: &Path, region: &RegionId) -> Result<String, String> {
    let text = std::fs::read_to_string(path)
        .map_err(|e| format!("--agent-token-file {}: {e}", path.display()))?;
    for line in text.lines().map(str::trim) {
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let fields: Vec<&str> = line.split_whitespace().collect();
        let token = match fields.as_slice() {
            [token] => *token,
            [scope, token] if *scope == region.as_str() || *scope == "*" => *token,
            [_, _] => continue,
            _ => {
                return Err(format!(
                    "--agent-token-file {}: expected `[region] <token>` lines",
                    path.display()
                ));
            }
        };
        if token.starts_with("sha256:") {
            return Err(format!(
                "--agent-token-file {}: holds a digest; the agent needs the token itself",
                path.display()
            ));
        }
        return Ok(token.to_owned());
    }
    Err(format!(
        "--agent-token-file {}: no token for region {region}",
        path.display()
    ))
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

/// Assembles and runs the agent. Long by design: each flag turned into its part (pepper, tokens,
/// TLS, stores, limiter, allocator client, state directory, servers) in the order they come up.
async fn start(args: AgentConfig) -> Result<(), String> {
    let region = RegionId::parse(&args.region).map_err(|e| format!("--region: {e}"))?;
    let region_id = region.clone();
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
    let store_config = RedisStoreConfig {
        coalesce: args.coalesce_hot_keys,
        state_layout: if args.write_state_as_hashes {
            StateLayout::Hashes
        } else {
            StateLayout::Strings
        },
        ..RedisStoreConfig::default()
    };
    let store: Arc<dyn LimiterStore> = if !args.redis_cluster.is_empty() {
        Arc::new(
            RedisStore::connect_cluster_with_tls(
                &args.redis_cluster,
                store_config,
                &args.redis_tls,
            )
            .await
            .map_err(|e| format!("--redis-cluster: {e}"))?,
        )
    } else if let Some(url) = &args.redis {
        Arc::new(
            RedisStore::connect_with_tls(url, store_config, &args.redis_tls)
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
    let limiter = Limiter::new(
        store,
        LimiterConfig {
            decision_budget: std::time::Duration::from_millis(args.decision_budget_ms),
            hot_tenants: args.hot_tenants.clone(),
            ..LimiterConfig::default()
        },
    )
    .map_err(|e| format!("limiter: {e}"))?;
    let allocator = if args.allocator.is_empty() {
        eprintln!("region-agent: no --allocator: global (leased) rules fail closed");
        None
    } else {
        let token_file = args
            .agent_token_file
            .as_deref()
            .ok_or("--agent-token-file is required with --allocator")?;
        let token = agent_token(token_file, &region)?;
        Some(Arc::new(
            AllocatorClient::with_tls(args.allocator.clone(), token, &args.allocator_tls)
                .map_err(|e| e.to_string())?,
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
    let agent_id = AgentId::parse(&args.agent_id).map_err(|e| format!("--agent-id: {e}"))?;
    let settings = AgentSettings {
        ip_prefixes: args.ip_prefixes,
        policy_max_age_ms: args.policy_max_age_ms,
        region_agents: args.region_agents,
        settle_window_ms: args.settle_window_ms,
        clock_margin_ms: args.clock_margin_ms,
        max_pools: args.max_pools,
        ..AgentSettings::new(region, agent_id, pepper)
    };
    let log_pepper = settings.pepper.clone();
    let agent = Agent::new(settings, clock, limiter, allocator, bundle);
    match &args.state_dir {
        Some(path) => {
            let dir = allot_region_agent::state_dir::StateDir::open(path, region_id.clone())
                .map_err(|e| format!("--state-dir {}: {e}", path.display()))?;
            agent.set_state_dir(dir);
            let restored = agent.restore_state();
            eprintln!(
                "region-agent: state directory {}: restored bundle {}, {} pools, {} leases owing a \
                 final report, {} fallback windows",
                path.display(),
                restored
                    .bundle_version
                    .map_or("none".to_owned(), |v| format!("v{v}")),
                restored.pools,
                restored.leases,
                restored.fallback_windows
            );
        }
        None => eprintln!(
            "region-agent: no --state-dir: an agent restarted while the allocator is unreachable \
             serves no policy or global rules until it is back, and a killed agent's unreported \
             admits never reach the ledger"
        ),
    }
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
            args.ip_prefixes,
        )
        .map_err(|e| format!("--decision-log {}: {e}", path.display()))?;
        agent.set_decision_log(log);
    }
    let listener = allot_net::Listener::bind(&args.listen)
        .await
        .map_err(|e| format!("cannot listen on {}: {e}", args.listen))?;
    let grpc_listener = allot_net::Listener::bind(&args.grpc_listen)
        .await
        .map_err(|e| format!("cannot listen on {} (--grpc-listen): {e}", args.grpc_listen))?;
    let acceptor = args
        .tls
        .as_ref()
        .map(allot_net::ServerTls::acceptor)
        .transpose()
        .map_err(|e| format!("TLS: {e}"))?;
    tracing::info!(listen = %args.listen, grpc_listen = %args.grpc_listen, "region agent serving");
    allot_region_agent::server::run(
        agent,
        Listeners {
            http: listener,
            grpc: Some(grpc_listener),
        },
        Serving {
            gateway_tokens,
            tls: acceptor,
            metrics: allot_region_agent::metrics::install(),
        },
        shutdown_signal(),
    )
    .await
}

#[tokio::main]
async fn main() -> ExitCode {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ALLOT_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("info")),
        )
        .init();
    let config = match AgentArgs::parse().resolve() {
        Ok(config) => config,
        Err(message) => {
            eprintln!("region-agent: {message}");
            return ExitCode::from(2);
        }
    };
    match start(config).await {
        Ok(()) => ExitCode::SUCCESS,
        Err(message) => {
            eprintln!("region-agent: {message}");
            ExitCode::from(2)
        }
    }
}
