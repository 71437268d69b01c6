//! The agent's settings: flags, `ALLOT_*` environment variables and an optional TOML file
//! (`--config`), in that order of precedence, then defaults.

use std::net::SocketAddr;
use std::path::PathBuf;

use allot_net::ListenAddr;
use clap::Parser;
use serde::Deserialize;

use allot_shared::ids::TenantId;

use crate::limiter::hot_tenants::MAX_SUB_SLOTS;
use crate::limiter::{HotTenants, RedisStoreConfig};

/// Flags; each also reads an `ALLOT_*` environment variable, and any left unset falls back to the
/// TOML file given with `--config` (keys as the flags, with underscores).
#[derive(Debug, Clone, Default, Parser)]
#[command(
    name = "region-agent",
    version,
    about = "Allot's region agent: admission decisions for gateways."
)]
pub struct AgentArgs {
    /// This agent's region, e.g. eu (required).
    #[arg(long, env = "ALLOT_REGION")]
    pub region: Option<String>,
    /// Address to serve gateways on: host:port, or unix:/path for a Unix domain socket (default
    /// 127.0.0.1:7700).
    #[arg(long, env = "ALLOT_LISTEN")]
    pub listen: Option<ListenAddr>,
    /// Address to serve Envoy's rate limit service (gRPC, RLS v3) on: host:port or unix:/path
    /// (default 127.0.0.1:8081).
    #[arg(long, env = "ALLOT_GRPC_LISTEN")]
    pub grpc_listen: Option<ListenAddr>,
    /// Allocator URLs, comma-separated. Without it only policies without global rules can be served.
    #[arg(long, env = "ALLOT_ALLOCATOR", value_delimiter = ',')]
    pub allocator: Option<Vec<String>>,
    /// File with this agent's allocator token (first line).
    #[arg(long, env = "ALLOT_AGENT_TOKEN_FILE")]
    pub agent_token_file: Option<PathBuf>,
    /// File with the tokens gateways present, one per line (required).
    #[arg(long, env = "ALLOT_GATEWAY_TOKEN_FILE")]
    pub gateway_token_file: Option<PathBuf>,
    /// File with the HMAC pepper for principal keys (at least 16 bytes; required).
    #[arg(long, env = "ALLOT_PEPPER_FILE")]
    pub pepper_file: Option<PathBuf>,
    /// Redis URL of the region's limiter store. Without it the in-process store is used (announced).
    #[arg(long, env = "ALLOT_REDIS")]
    pub redis: Option<String>,
    /// Redis Cluster seed URLs, comma-separated (instead of --redis).
    #[arg(long, env = "ALLOT_REDIS_CLUSTER", value_delimiter = ',')]
    pub redis_cluster: Option<Vec<String>>,
    /// PEM CA certificates to trust for a `rediss://` limiter store (default: the system's roots).
    #[arg(long, env = "ALLOT_REDIS_CA")]
    pub redis_ca: Option<PathBuf>,
    /// PEM client certificate to present to a `rediss://` limiter store (mutual TLS); needs
    /// --redis-client-key.
    #[arg(long, env = "ALLOT_REDIS_CLIENT_CERT")]
    pub redis_client_cert: Option<PathBuf>,
    /// PEM private key of --redis-client-cert.
    #[arg(long, env = "ALLOT_REDIS_CLIENT_KEY")]
    pub redis_client_key: Option<PathBuf>,
    /// A policy bundle file. Without it the bundle is fetched from the allocator.
    #[arg(long, env = "ALLOT_POLICY_FILE")]
    pub policy_file: Option<PathBuf>,
    /// Append sampled decisions to this JSON-lines file (input of `allotctl policies replay`).
    #[arg(long, env = "ALLOT_DECISION_LOG")]
    pub decision_log: Option<PathBuf>,
    /// Share of allowed decisions logged (default 0.01).
    #[arg(long, env = "ALLOT_DECISION_LOG_ALLOWED_RATE")]
    pub decision_log_allowed_rate: Option<f64>,
    /// Share of denied and fallback decisions logged (default 1.0).
    #[arg(long, env = "ALLOT_DECISION_LOG_DENIED_RATE")]
    pub decision_log_denied_rate: Option<f64>,
    /// The decision log stops growing at this many bytes (default 1 GiB).
    #[arg(long, env = "ALLOT_DECISION_LOG_MAX_BYTES")]
    pub decision_log_max_bytes: Option<u64>,
    /// Once the allocator has not confirmed the bundle for this many ms, rules marked strict fail
    /// closed (0: never; default 3,600,000).
    #[arg(long, env = "ALLOT_POLICY_MAX_AGE_MS")]
    pub policy_max_age_ms: Option<u64>,
    /// How many agents serve this region (default 1). Each takes `fallbackPerRegion / N` per window
    /// in a partition, so the region as a whole stays within its allowance.
    #[arg(long, env = "ALLOT_REGION_AGENTS")]
    pub region_agents: Option<u64>,
    /// How long a metered admission may be settled (`POST /v1/settle`) after its decision, ms
    /// (1,000 to 3,600,000; default 300,000). Unsettled, the estimate stands.
    #[arg(long, env = "ALLOT_SETTLE_WINDOW_MS")]
    pub settle_window_ms: Option<u64>,
    /// The most this agent's clock may be off the allocator's, ms (0 to 10,000; default 100). No
    /// fallback is admitted within this long of a window's edges, so fallback stays within its
    /// allowance per window on the allocator's clock; `allot_agent_clock_offset_ms` shows the
    /// offset measured.
    #[arg(long, env = "ALLOT_CLOCK_MARGIN_MS")]
    pub clock_margin_ms: Option<u64>,
    /// Most pools held at once (1 to 1,000,000; default 10,000). A pool idle for 10 minutes is
    /// forgotten; past the most, a request for a new pool fails as its rule's fail mode says
    /// (`allot_agent_pools` shows the count; docs/operations.md sizes the memory per pool).
    #[arg(long, env = "ALLOT_MAX_POOLS")]
    pub max_pools: Option<usize>,
    /// Longest one regional decision may wait for the limiter store, ms (1 to 1,000; default 10).
    /// Past it the rule's fail mode answers (local bucket or 503). Raise it on slow hosts or links.
    #[arg(long, env = "ALLOT_DECISION_BUDGET_MS")]
    pub decision_budget_ms: Option<u64>,
    /// Send a tenant's decisions that arrive while its Redis call is in flight together in its next
    /// call (on a hot tenant, less Redis CPU per decision and a lower p99; on by default, see
    /// docs/limiter.md). `false` sends every decision in a call of its own.
    #[arg(long, env = "ALLOT_COALESCE_HOT_KEYS")]
    pub coalesce_hot_keys: Option<bool>,
    /// `true`: write regional rule state as hashes, which agents before string state read, for
    /// the length of a rolling upgrade from such a version; off by default (strings, which cost
    /// Redis less). Both are read either way.
    #[arg(long, env = "ALLOT_WRITE_STATE_AS_HASHES")]
    pub write_state_as_hashes: Option<bool>,
    /// Prefix length anonymous (`ip`) IPv4 callers are keyed by (1 to 32; default 32). The HMAC
    /// input is the prefix, not the address; a rule's own `ipPrefixV4` overrides it.
    #[arg(long, env = "ALLOT_IP_PREFIX_V4")]
    pub ip_prefix_v4: Option<u8>,
    /// Prefix length anonymous (`ip`) IPv6 callers are keyed by (1 to 128; default 64); a rule's
    /// own `ipPrefixV6` overrides it.
    #[arg(long, env = "ALLOT_IP_PREFIX_V6")]
    pub ip_prefix_v6: Option<u8>,
    /// A tenant whose regional keys spread over `K` sub-slots (Redis Cluster slots) instead of
    /// one, `TENANT=K` with `K` in [2, 64]; repeat, or comma-separate in the variable. Its tenant
    /// and route budgets are split `K` ways (see docs/limiter.md); every agent of a region must
    /// say the same. Spread the gateway's pseudo-tenant of unauthenticated traffic this way too.
    #[arg(
        long = "hot-tenant",
        env = "ALLOT_HOT_TENANTS",
        value_delimiter = ',',
        value_name = "TENANT=K"
    )]
    pub hot_tenants: Option<Vec<String>>,
    /// This agent's id in policy status and agent sessions (default: `<region>-<host name>-<listen
    /// port>`).
    #[arg(long, env = "ALLOT_AGENT_ID")]
    pub agent_id: Option<String>,
    /// PEM certificate chain to serve gateways with TLS (HTTP and gRPC); needs --tls-key.
    #[arg(long, env = "ALLOT_TLS_CERT")]
    pub tls_cert: Option<PathBuf>,
    /// PEM private key of --tls-cert.
    #[arg(long, env = "ALLOT_TLS_KEY")]
    pub tls_key: Option<PathBuf>,
    /// PEM CA certificates: gateways must present a client certificate signed by one (mutual TLS).
    #[arg(long, env = "ALLOT_TLS_CLIENT_CA")]
    pub tls_client_ca: Option<PathBuf>,
    /// PEM CA certificates to trust for https:// allocator URLs (default: the system's roots).
    #[arg(long, env = "ALLOT_ALLOCATOR_CA")]
    pub allocator_ca: Option<PathBuf>,
    /// PEM client certificate to present to the allocator (mutual TLS); needs --allocator-client-key.
    #[arg(long, env = "ALLOT_ALLOCATOR_CLIENT_CERT")]
    pub allocator_client_cert: Option<PathBuf>,
    /// PEM private key of --allocator-client-cert.
    #[arg(long, env = "ALLOT_ALLOCATOR_CLIENT_KEY")]
    pub allocator_client_key: Option<PathBuf>,
    /// Directory for the state a restart needs (the last bundle, pool terms, pending reports,
    /// fallback claims), so an agent restarted while the allocator is unreachable keeps its region
    /// up and a killed agent's admits still reach the ledger. Default: none (announced at start).
    #[arg(long, env = "ALLOT_STATE_DIR")]
    pub state_dir: Option<PathBuf>,
    /// TOML file with any of the settings above.
    #[arg(long, env = "ALLOT_CONFIG")]
    pub config: Option<PathBuf>,
}

#[derive(Debug, Default, Deserialize)]
#[serde(deny_unknown_fields)]
struct FileSettings {
    region: Option<String>,
    listen: Option<String>,
    grpc_listen: Option<String>,
    allocator: Option<Vec<String>>,
    agent_token_file: Option<PathBuf>,
    gateway_token_file: Option<PathBuf>,
    pepper_file: Option<PathBuf>,
    redis: Option<String>,
    redis_cluster: Option<Vec<String>>,
    redis_ca: Option<PathBuf>,
    redis_client_cert: Option<PathBuf>,
    redis_client_key: Option<PathBuf>,
    policy_file: Option<PathBuf>,
    decision_log: Option<PathBuf>,
    decision_log_allowed_rate: Option<f64>,
    decision_log_denied_rate: Option<f64>,
    decision_log_max_bytes: Option<u64>,
    policy_max_age_ms: Option<u64>,
    region_agents: Option<u64>,
    settle_window_ms: Option<u64>,
    clock_margin_ms: Option<u64>,
    max_pools: Option<usize>,
    decision_budget_ms: Option<u64>,
    coalesce_hot_keys: Option<bool>,
    write_state_as_hashes: Option<bool>,
    ip_prefix_v4: Option<u8>,
    ip_prefix_v6: Option<u8>,
    hot_tenants: Option<std::collections::BTreeMap<String, u32>>,
    agent_id: Option<String>,
    tls_cert: Option<PathBuf>,
    tls_key: Option<PathBuf>,
    tls_client_ca: Option<PathBuf>,
    allocator_ca: Option<PathBuf>,
    allocator_client_cert: Option<PathBuf>,
    allocator_client_key: Option<PathBuf>,
    state_dir: Option<PathBuf>,
}

/// Default `--decision-budget-ms`: the limiter's own default budget.
#[allow(clippy::cast_possible_truncation)]
pub const DEFAULT_DECISION_BUDGET_MS: u64 =
    crate::limiter::client::DEFAULT_DECISION_BUDGET.as_millis() as u64;

/// Resolved settings.
#[derive(Debug, Clone, PartialEq)]
pub struct AgentConfig {
    /// The region.
    pub region: String,
    /// Gateway HTTP address.
    pub listen: ListenAddr,
    /// gRPC address.
    pub grpc_listen: ListenAddr,
    /// Allocator URLs (empty: none).
    pub allocator: Vec<String>,
    /// The agent token file.
    pub agent_token_file: Option<PathBuf>,
    /// The gateway token file.
    pub gateway_token_file: PathBuf,
    /// The pepper file.
    pub pepper_file: PathBuf,
    /// Single Redis URL.
    pub redis: Option<String>,
    /// Redis Cluster seeds (empty: none).
    pub redis_cluster: Vec<String>,
    /// Certificates for a `rediss://` store, read at start.
    pub redis_tls: crate::limiter::RedisTls,
    /// A bundle file.
    pub policy_file: Option<PathBuf>,
    /// The decision log file.
    pub decision_log: Option<PathBuf>,
    /// Sampling of allowed decisions.
    pub decision_log_allowed_rate: f64,
    /// Sampling of denied and fallback decisions.
    pub decision_log_denied_rate: f64,
    /// Decision log size cap, bytes.
    pub decision_log_max_bytes: u64,
    /// Bundle maximum age, ms (0: never).
    pub policy_max_age_ms: u64,
    /// Agents serving this region (at least 1).
    pub region_agents: u64,
    /// The settle window of metered admissions, ms.
    pub settle_window_ms: u64,
    /// The most the agent's clock may be off the allocator's, ms.
    pub clock_margin_ms: u64,
    /// Most pools held at once.
    pub max_pools: usize,
    /// The limiter's decision budget, ms.
    pub decision_budget_ms: u64,
    /// Whether the Redis store coalesces a tenant's decisions.
    pub coalesce_hot_keys: bool,
    /// Whether the Redis store writes rule state as hashes (for a rolling upgrade).
    pub write_state_as_hashes: bool,
    /// Prefix lengths anonymous callers are keyed by.
    pub ip_prefixes: allot_shared::keys::IpPrefixes,
    /// Tenants spread over sub-slots.
    pub hot_tenants: HotTenants,
    /// The agent id.
    pub agent_id: String,
    /// TLS for the gateway-facing servers (none: plain TCP).
    pub tls: Option<allot_net::ServerTls>,
    /// How to reach an https:// allocator.
    pub allocator_tls: allot_net::ClientTls,
    /// The state directory, if any.
    pub state_dir: Option<PathBuf>,
}

impl AgentArgs {
    /// Merges flags and environment (already in `self`), the TOML file and the defaults, or says in
    /// one line what is missing or wrong. Long by design: one setting merged per statement.
    pub fn resolve(self) -> Result<AgentConfig, String> {
        let file: FileSettings = match &self.config {
            None => FileSettings::default(),
            Some(path) => {
                let text = std::fs::read_to_string(path)
                    .map_err(|e| format!("--config {}: {e}", path.display()))?;
                toml::from_str(&text)
                    .map_err(|e| format!("--config {}: {}", path.display(), e.message()))?
            }
        };
        let region = self.region.or(file.region).ok_or("--region is required")?;
        let from_file = |key: &str, text: Option<String>| {
            text.map(|text| {
                text.parse::<ListenAddr>()
                    .map_err(|e| format!("--config: {key}: {e}"))
            })
            .transpose()
        };
        let listen = match self.listen {
            Some(listen) => listen,
            None => from_file("listen", file.listen)?
                .unwrap_or(ListenAddr::Tcp(SocketAddr::from(([127, 0, 0, 1], 7700)))),
        };
        let grpc_listen = match self.grpc_listen {
            Some(listen) => listen,
            None => from_file("grpc_listen", file.grpc_listen)?
                .unwrap_or(ListenAddr::Tcp(SocketAddr::from(([127, 0, 0, 1], 8081)))),
        };
        let tls = allot_net::ServerTls::from_flags(
            self.tls_cert.or(file.tls_cert),
            self.tls_key.or(file.tls_key),
            self.tls_client_ca.or(file.tls_client_ca),
        )?;
        let allocator_tls = allot_net::ClientTls {
            ca: self.allocator_ca.or(file.allocator_ca),
            cert: self.allocator_client_cert.or(file.allocator_client_cert),
            key: self.allocator_client_key.or(file.allocator_client_key),
        };
        // Read now, so a bad file stops the start naming it.
        let _checked = allocator_tls
            .configure(reqwest::Client::builder())
            .map_err(|e| format!("allocator TLS: {e}"))?;
        let rate = |flag: &str, value: f64| {
            if (0.0..=1.0).contains(&value) {
                Ok(value)
            } else {
                Err(format!("--{flag} must be within [0, 1], got {value}"))
            }
        };
        let defaults = allot_shared::keys::IpPrefixes::default();
        let prefix = |flag: &str, value: Option<u8>, max: u8, default: u8| match value {
            None => Ok(default),
            Some(bits @ 1..) if bits <= max => Ok(bits),
            Some(bits) => Err(format!("--{flag} must be in [1, {max}], got {bits}")),
        };
        let ip_prefixes = allot_shared::keys::IpPrefixes {
            v4_bits: prefix(
                "ip-prefix-v4",
                self.ip_prefix_v4.or(file.ip_prefix_v4),
                32,
                defaults.v4_bits,
            )?,
            v6_bits: prefix(
                "ip-prefix-v6",
                self.ip_prefix_v6.or(file.ip_prefix_v6),
                128,
                defaults.v6_bits,
            )?,
        };
        let hot_tenants = match self.hot_tenants {
            // An empty variable (`ALLOT_HOT_TENANTS=`) names no tenant.
            Some(flags) => hot_tenants(flags.iter().filter(|flag| !flag.trim().is_empty()).map(
                |flag| {
                    flag.split_once('=')
                        .map(|(tenant, k)| (tenant.trim().to_owned(), k.trim().parse::<u32>()))
                        .ok_or_else(|| format!("--hot-tenant {flag}: expected TENANT=K"))
                },
            ))?,
            None => hot_tenants(
                file.hot_tenants
                    .unwrap_or_default()
                    .into_iter()
                    .map(|(tenant, k)| Ok((tenant, Ok(k)))),
            )?,
        };
        let redis_tls = redis_tls(
            self.redis_ca.or(file.redis_ca),
            self.redis_client_cert.or(file.redis_client_cert),
            self.redis_client_key.or(file.redis_client_key),
        )?;
        Ok(AgentConfig {
            tls,
            allocator_tls,
            ip_prefixes,
            hot_tenants,
            redis_tls,
            state_dir: self.state_dir.or(file.state_dir),
            agent_id: self
                .agent_id
                .or(file.agent_id)
                .unwrap_or_else(|| default_agent_id(&region, &host_name(), listen_suffix(&listen))),
            region,
            listen,
            grpc_listen,
            allocator: self.allocator.or(file.allocator).unwrap_or_default(),
            agent_token_file: self.agent_token_file.or(file.agent_token_file),
            gateway_token_file: self
                .gateway_token_file
                .or(file.gateway_token_file)
                .ok_or("--gateway-token-file is required")?,
            pepper_file: self
                .pepper_file
                .or(file.pepper_file)
                .ok_or("--pepper-file is required")?,
            redis: self.redis.or(file.redis),
            redis_cluster: self
                .redis_cluster
                .or(file.redis_cluster)
                .unwrap_or_default(),
            policy_file: self.policy_file.or(file.policy_file),
            decision_log: self.decision_log.or(file.decision_log),
            decision_log_allowed_rate: rate(
                "decision-log-allowed-rate",
                self.decision_log_allowed_rate
                    .or(file.decision_log_allowed_rate)
                    .unwrap_or(0.01),
            )?,
            decision_log_denied_rate: rate(
                "decision-log-denied-rate",
                self.decision_log_denied_rate
                    .or(file.decision_log_denied_rate)
                    .unwrap_or(1.0),
            )?,
            decision_log_max_bytes: self
                .decision_log_max_bytes
                .or(file.decision_log_max_bytes)
                .unwrap_or(1 << 30),
            policy_max_age_ms: self
                .policy_max_age_ms
                .or(file.policy_max_age_ms)
                .unwrap_or(3_600_000),
            settle_window_ms: match self
                .settle_window_ms
                .or(file.settle_window_ms)
                .unwrap_or(crate::service::settings::DEFAULT_SETTLE_WINDOW_MS)
            {
                window @ 1_000..=crate::service::settings::MAX_SETTLE_WINDOW_MS => window,
                other => {
                    return Err(format!(
                        "--settle-window-ms must be in [1000, 3600000], got {other}"
                    ));
                }
            },
            clock_margin_ms: match self
                .clock_margin_ms
                .or(file.clock_margin_ms)
                .unwrap_or(crate::service::settings::DEFAULT_CLOCK_MARGIN_MS)
            {
                margin @ 0..=crate::service::settings::MAX_CLOCK_MARGIN_MS => margin,
                other => {
                    return Err(format!(
                        "--clock-margin-ms must be in [0, {}], got {other}",
                        crate::service::settings::MAX_CLOCK_MARGIN_MS
                    ));
                }
            },
            max_pools: match self
                .max_pools
                .or(file.max_pools)
                .unwrap_or(crate::service::settings::DEFAULT_MAX_POOLS)
            {
                most @ 1..=crate::service::settings::MAX_MAX_POOLS => most,
                other => {
                    return Err(format!(
                        "--max-pools must be in [1, {}], got {other}",
                        crate::service::settings::MAX_MAX_POOLS
                    ));
                }
            },
            decision_budget_ms: match self
                .decision_budget_ms
                .or(file.decision_budget_ms)
                .unwrap_or(DEFAULT_DECISION_BUDGET_MS)
            {
                budget @ 1..=1_000 => budget,
                other => {
                    return Err(format!(
                        "--decision-budget-ms must be in [1, 1000], got {other}"
                    ));
                }
            },
            coalesce_hot_keys: self
                .coalesce_hot_keys
                .or(file.coalesce_hot_keys)
                .unwrap_or(RedisStoreConfig::default().coalesce),
            write_state_as_hashes: self
                .write_state_as_hashes
                .or(file.write_state_as_hashes)
                .unwrap_or(false),
            region_agents: match self.region_agents.or(file.region_agents).unwrap_or(1) {
                0 => return Err("--region-agents: must be at least 1".to_owned()),
                n => n,
            },
        })
    }
}

/// The agent id when none is given: `<region>-<host>-<port>` (for a Unix socket, its file name
/// instead of the port), the same across the agent's restarts on one host and distinct between
/// agents of a region on different hosts (the allocator's agent sessions tell one agent's runs
/// apart by it). At most 64 characters of `[A-Za-z0-9._-]`.
pub fn default_agent_id(region: &str, host: &str, listen: impl std::fmt::Display) -> String {
    let safe = |text: &str| -> String {
        text.chars()
            .map(|c| {
                if c.is_ascii_alphanumeric() || matches!(c, '.' | '_' | '-') {
                    c
                } else {
                    '-'
                }
            })
            .collect()
    };
    let host = safe(host);
    let suffix: String = format!("-{}", safe(&listen.to_string()))
        .chars()
        .take(32)
        .collect();
    let room = 64usize.saturating_sub(region.len() + 1 + suffix.len());
    let host: String = host.chars().take(room).collect();
    if host.is_empty() {
        format!("{region}{suffix}")
    } else {
        format!("{region}-{host}{suffix}")
    }
}

/// What tells one listener of a host from another in a default agent id: the port, or a Unix
/// socket's file name.
fn listen_suffix(listen: &ListenAddr) -> String {
    match listen {
        ListenAddr::Tcp(address) => address.port().to_string(),
        ListenAddr::Unix(path) => path.file_stem().map_or_else(
            || "unix".to_owned(),
            |stem| stem.to_string_lossy().into_owned(),
        ),
    }
}

/// This machine's host name (Linux), or empty when it cannot be read.
pub fn host_name() -> String {
    std::fs::read_to_string("/proc/sys/kernel/hostname")
        .or_else(|_| std::fs::read_to_string("/etc/hostname"))
        .map(|name| name.trim().to_owned())
        .unwrap_or_default()
}

/// `--hot-tenant` entries (or the file's `hot_tenants` table) as the limiter's [`HotTenants`], or
/// one line naming the entry that is wrong.
fn hot_tenants(
    entries: impl Iterator<Item = Result<(String, Result<u32, std::num::ParseIntError>), String>>,
) -> Result<HotTenants, String> {
    let mut hot = HotTenants::new();
    for entry in entries {
        let (tenant, k) = entry?;
        let k = k.map_err(|e| format!("--hot-tenant {tenant}: K is not a count: {e}"))?;
        let id = TenantId::parse(&tenant).map_err(|e| format!("--hot-tenant {tenant}: {e}"))?;
        if hot.sub_slots(&id).is_some() {
            return Err(format!("--hot-tenant {tenant}: given twice"));
        }
        hot = hot
            .with_tenant(id, k)
            .map_err(|_| format!("--hot-tenant {tenant}={k}: K must be in [2, {MAX_SUB_SLOTS}]"))?;
    }
    Ok(hot)
}

/// The certificates of a `rediss://` store, read now so that a bad file stops the start naming it.
fn redis_tls(
    ca: Option<PathBuf>,
    cert: Option<PathBuf>,
    key: Option<PathBuf>,
) -> Result<crate::limiter::RedisTls, String> {
    let read = |flag: &str, path: &PathBuf| {
        let pem = std::fs::read(path).map_err(|e| format!("--{flag} {}: {e}", path.display()))?;
        if !pem.starts_with(b"-----BEGIN") {
            return Err(format!("--{flag} {}: not a PEM file", path.display()));
        }
        Ok(pem)
    };
    let client_pem = match (cert, key) {
        (None, None) => None,
        (Some(cert), Some(key)) => Some((
            read("redis-client-cert", &cert)?,
            read("redis-client-key", &key)?,
        )),
        (Some(_), None) => return Err("--redis-client-cert needs --redis-client-key".to_owned()),
        (None, Some(_)) => return Err("--redis-client-key needs --redis-client-cert".to_owned()),
    };
    Ok(crate::limiter::RedisTls {
        ca_pem: ca.map(|path| read("redis-ca", &path)).transpose()?,
        client_pem,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn flags_beat_the_file_and_the_file_beats_defaults() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("agent.toml");
        std::fs::write(
            &path,
            "region = \"us\"\nlisten = \"127.0.0.1:9700\"\ngateway_token_file = \"/etc/g\"\npepper_file = \"/etc/p\"\npolicy_max_age_ms = 5\n",
        )
        .expect("write");
        let args = AgentArgs {
            region: Some("eu".to_owned()),
            config: Some(path.clone()),
            ..AgentArgs::default()
        };
        let config = args.resolve().expect("valid");
        assert_eq!(config.region, "eu", "the flag wins");
        assert_eq!(
            config.listen.to_string(),
            "127.0.0.1:9700",
            "the file fills what flags leave"
        );
        assert_eq!(config.policy_max_age_ms, 5);
        assert_eq!(
            config.grpc_listen.to_string(),
            "127.0.0.1:8081",
            "defaults fill the rest"
        );
        assert_eq!(
            listen_suffix(&"unix:/run/allot/agent-eu.sock".parse().expect("unix")),
            "agent-eu"
        );
        assert_eq!(config.agent_id, default_agent_id("eu", &host_name(), 9700));
        assert_eq!(
            default_agent_id("eu", "node-7.example", 9700),
            "eu-node-7.example-9700"
        );
        assert_eq!(
            default_agent_id("eu", "odd host/name", 1),
            "eu-odd-host-name-1"
        );
        assert_eq!(default_agent_id("eu", "", 9700), "eu-9700");
        assert_eq!(default_agent_id("eu", &"h".repeat(100), 9700).len(), 64);
        assert_eq!(config.decision_budget_ms, DEFAULT_DECISION_BUDGET_MS);
        assert!(config.coalesce_hot_keys, "coalescing is on by default");
        let alone = AgentArgs {
            region: Some("eu".to_owned()),
            config: Some(path.clone()),
            coalesce_hot_keys: Some(false),
            ..AgentArgs::default()
        };
        assert!(!alone.resolve().expect("valid").coalesce_hot_keys);
        let alone_by_file = dir.path().join("alone.toml");
        std::fs::write(
            &alone_by_file,
            "region = \"us\"\ngateway_token_file = \"/etc/g\"\npepper_file = \"/etc/p\"\ncoalesce_hot_keys = false\n",
        )
        .expect("write");
        let alone = AgentArgs {
            config: Some(alone_by_file),
            ..AgentArgs::default()
        };
        assert!(
            !alone.resolve().expect("valid").coalesce_hot_keys,
            "the file turns the default off"
        );
        assert!(
            !config.write_state_as_hashes,
            "rule state is written as strings by default"
        );
        let upgrading = AgentArgs {
            region: Some("eu".to_owned()),
            config: Some(path.clone()),
            write_state_as_hashes: Some(true),
            ..AgentArgs::default()
        };
        assert!(upgrading.resolve().expect("valid").write_state_as_hashes);
        let slow = AgentArgs {
            region: Some("eu".to_owned()),
            config: Some(path.clone()),
            decision_budget_ms: Some(0),
            ..AgentArgs::default()
        };
        assert_eq!(
            slow.resolve().expect_err("out of range"),
            "--decision-budget-ms must be in [1, 1000], got 0"
        );
        assert_eq!(config.max_pools, crate::service::DEFAULT_MAX_POOLS);
        for (most, answer) in [
            (1, Ok(1)),
            (100_000, Ok(100_000)),
            (0, Err("--max-pools must be in [1, 1000000], got 0")),
            (
                1_000_001,
                Err("--max-pools must be in [1, 1000000], got 1000001"),
            ),
        ] {
            let sized = AgentArgs {
                region: Some("eu".to_owned()),
                config: Some(path.clone()),
                max_pools: Some(most),
                ..AgentArgs::default()
            };
            assert_eq!(
                sized.resolve().map(|c| c.max_pools),
                answer.map_err(str::to_owned)
            );
        }

        assert_eq!(
            config.ip_prefixes,
            allot_shared::keys::IpPrefixes::default(),
            "/32 and /64 unless told"
        );
        let coarse = AgentArgs {
            region: Some("eu".to_owned()),
            config: Some(path.clone()),
            ip_prefix_v4: Some(24),
            ip_prefix_v6: Some(48),
            ..AgentArgs::default()
        };
        let prefixes = coarse.resolve().expect("valid").ip_prefixes;
        assert_eq!((prefixes.v4_bits, prefixes.v6_bits), (24, 48));
        for (v4, v6, message) in [
            (Some(0), None, "--ip-prefix-v4 must be in [1, 32], got 0"),
            (Some(33), None, "--ip-prefix-v4 must be in [1, 32], got 33"),
            (
                None,
                Some(129),
                "--ip-prefix-v6 must be in [1, 128], got 129",
            ),
        ] {
            let wrong = AgentArgs {
                region: Some("eu".to_owned()),
                config: Some(path.clone()),
                ip_prefix_v4: v4,
                ip_prefix_v6: v6,
                ..AgentArgs::default()
            };
            assert_eq!(wrong.resolve().expect_err("out of range"), message);
        }

        std::fs::write(&path, "regoin = \"us\"\n").expect("write");
        let typo = AgentArgs {
            config: Some(path.clone()),
            ..AgentArgs::default()
        };
        let error = typo.resolve().expect_err("unknown key");
        assert!(error.contains("unknown field"), "{error}");
        assert_eq!(
            AgentArgs::default().resolve().expect_err("missing"),
            "--region is required"
        );
    }

    #[test]
    fn hot_tenants_come_from_flags_or_the_file_and_bad_entries_say_which() {
        let dir = tempfile::tempdir().expect("temp dir");
        let path = dir.path().join("agent.toml");
        std::fs::write(
            &path,
            "region = \"us\"\ngateway_token_file = \"/etc/g\"\npepper_file = \"/etc/p\"\n[hot_tenants]\nedge = 16\natlas = 4\n",
        )
        .expect("write");
        let with = |flags: Option<Vec<&str>>| AgentArgs {
            config: Some(path.clone()),
            hot_tenants: flags.map(|flags| flags.into_iter().map(str::to_owned).collect()),
            ..AgentArgs::default()
        };
        let tenant = |id: &str| TenantId::parse(id).expect("tenant");
        let from_file = with(None).resolve().expect("valid").hot_tenants;
        assert_eq!(from_file.sub_slots(&tenant("edge")), Some(16));
        assert_eq!(from_file.sub_slots(&tenant("atlas")), Some(4));
        let from_flags = with(Some(vec!["birch=8"]))
            .resolve()
            .expect("valid")
            .hot_tenants;
        assert_eq!(from_flags.sub_slots(&tenant("birch")), Some(8));
        assert_eq!(
            from_flags.sub_slots(&tenant("edge")),
            None,
            "flags replace the file's table"
        );
        for (flag, message) in [
            ("birch", "--hot-tenant birch: expected TENANT=K"),
            ("birch=1", "--hot-tenant birch=1: K must be in [2, 64]"),
            ("birch=65", "--hot-tenant birch=65: K must be in [2, 64]"),
        ] {
            assert_eq!(
                with(Some(vec![flag])).resolve().expect_err("wrong"),
                message
            );
        }
        let error = with(Some(vec!["birch=many"]))
            .resolve()
            .expect_err("not a count");
        assert!(
            error.starts_with("--hot-tenant birch: K is not a count"),
            "{error}"
        );
        let error = with(Some(vec!["a:b=4"])).resolve().expect_err("bad id");
        assert!(error.starts_with("--hot-tenant a:b: "), "{error}");
        assert_eq!(
            with(Some(vec![""])).resolve().expect("valid").hot_tenants,
            HotTenants::new(),
            "an empty variable names no tenant"
        );
        assert_eq!(
            with(Some(vec!["birch=4", "birch=8"]))
                .resolve()
                .expect_err("twice"),
            "--hot-tenant birch: given twice"
        );
        assert_eq!(
            AgentArgs {
                region: Some("eu".to_owned()),
                gateway_token_file: Some("/etc/g".into()),
                pepper_file: Some("/etc/p".into()),
                ..AgentArgs::default()
            }
            .resolve()
            .expect("valid")
            .hot_tenants,
            HotTenants::new(),
            "no tenant is spread unless told"
        );
    }
}
