//! `allotctl`: operate Allot's allocator. Parses arguments and calls `allot_allocator::ctl`.

use std::path::{Path, PathBuf};
use std::process::ExitCode;

use allot_allocator::ctl::{
    Answer, Call, Target, bundle_file, exchange, perform, render, replay_comparison, sample_file,
};
use allot_allocator::http::{
    BulkPool, BulkPools, MAX_POOLS_PER_BULK, MAX_POOLS_PER_PAGE, MAX_USAGE_PAGE, MintBody,
};
use allot_allocator::pools::PoolSpec;
use allot_shared::ids::{LeaseId, PoolId, RegionId, TenantId};
use allot_shared::replay::ReplayOptions;
use allot_shared::wire::CalendarWindowSpec;
use allot_shared::wire::GrantBody;
use clap::{Parser, Subcommand};
use reqwest::Method;
use serde::Serialize;
use serde_json::Value;

#[derive(Parser)]
#[command(
    name = "allotctl",
    version,
    about = "Operate Allot's allocator: pools, windows, policies, tokens, audit, grants."
)]
struct Cli {
    /// The allocator's URL.
    #[arg(
        long,
        global = true,
        env = "ALLOT_SERVER",
        default_value = "http://127.0.0.1:7600"
    )]
    server: String,
    /// Bearer token (operator token for most commands, agent token for `grant`).
    #[arg(long, global = true, env = "ALLOT_TOKEN", hide_env_values = true)]
    token: Option<String>,
    /// File holding the bearer token: its first token line (a role before the token is skipped, so
    /// the allocator's `--operator-token-file` works as it is).
    #[arg(long, global = true, env = "ALLOT_TOKEN_FILE")]
    token_file: Option<PathBuf>,
    /// PEM CA certificates to trust for an https:// server (default: the system's roots).
    #[arg(long, global = true, env = "ALLOT_CA_FILE")]
    ca_file: Option<PathBuf>,
    /// PEM client certificate for a server that requires mutual TLS (needs --client-key).
    #[arg(long, global = true, env = "ALLOT_CLIENT_CERT")]
    client_cert: Option<PathBuf>,
    /// PEM private key of --client-cert.
    #[arg(long, global = true, env = "ALLOT_CLIENT_KEY")]
    client_key: Option<PathBuf>,
    /// Print the API's JSON instead of a table.
    #[arg(long, global = true)]
    json: bool,
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Tenant pools.
    Pools {
        #[command(subcommand)]
        command: PoolsCommand,
    },
    /// Per-window accounting of a pool, newest first.
    Windows {
        tenant: String,
        pool: String,
        /// How many windows.
        #[arg(long, default_value_t = 10)]
        last: u64,
    },
    /// Policy bundles.
    Policies {
        #[command(subcommand)]
        command: PoliciesCommand,
    },
    /// API tokens (needs an admin token), and the digest of a token for a token file.
    Tokens {
        #[command(subcommand)]
        command: TokensCommand,
    },
    /// Overrides: a different limit for one tenant, user or API key, until a set time.
    Overrides {
        #[command(subcommand)]
        command: OverridesCommand,
    },
    /// Print the keyed hash agents key a user or API key by (offline; needs the agents' pepper).
    PrincipalHash {
        /// `user` or `api_key`.
        #[arg(long = "type")]
        kind: String,
        /// The agents' `--pepper-file`.
        #[arg(long)]
        pepper_file: PathBuf,
        /// The user id or API key id, as gateways send it.
        id: String,
    },
    /// Usage for billing, from the ledger.
    Usage {
        #[command(subcommand)]
        command: UsageCommand,
    },
    /// The audit log of operator changes, newest first.
    Audit {
        /// How many entries.
        #[arg(long, default_value_t = 50)]
        last: u64,
    },
    /// Every window checked against its overshoot bound so far, and the newest violations.
    BoundChecks {
        /// How many of the newest violations to list (0 to 100).
        #[arg(long, default_value_t = 20)]
        recent: u64,
    },
    /// How the pools are split into shards, and which allocator leads each.
    Shards,
    /// Take a grant, as an agent would (for drills). Needs an agent token.
    Grant {
        tenant: String,
        pool: String,
        /// The asking region.
        #[arg(long)]
        region: String,
        /// Tokens wanted.
        #[arg(long)]
        want: u64,
        /// Repeat an earlier request by its lease id (default: a new one).
        #[arg(long)]
        lease_id: Option<String>,
    },
}

#[derive(Subcommand)]
enum UsageCommand {
    /// Every record of windows starting in [--from, --to), per tenant, pool, region and window,
    /// read a page at a time and printed as JSON lines or CSV. Each record has a stable
    /// `recordId`: load by it, and an export run twice counts nothing twice.
    Export {
        /// Windows that start at or after this instant, epoch ms.
        #[arg(long)]
        from: u64,
        /// Windows that start before this instant, epoch ms.
        #[arg(long)]
        to: u64,
        /// Only pools whose tenant/pool starts with this.
        #[arg(long, default_value = "")]
        prefix: String,
        /// jsonl or csv.
        #[arg(long, default_value = "jsonl")]
        format: String,
    },
}

#[derive(Subcommand)]
enum PoolsCommand {
    /// Create or replace a pool.
    Set {
        tenant: String,
        pool: String,
        /// G: tokens per window.
        #[arg(long)]
        limit: u64,
        /// Window length, ms (without --calendar).
        #[arg(long, default_value_t = 60_000, conflicts_with = "calendar")]
        window_ms: u64,
        /// Calendar windows instead: day, week (from Monday) or month, read in --time-zone.
        #[arg(long, requires = "time_zone")]
        calendar: Option<String>,
        /// The IANA time zone of --calendar windows, e.g. Europe/Berlin.
        #[arg(long, requires = "calendar")]
        time_zone: Option<String>,
        /// Largest grant, tokens.
        #[arg(long)]
        chunk: u64,
        /// Lease TTL, ms.
        #[arg(long, default_value_t = 15_000)]
        lease_ttl_ms: u64,
        /// Fallback allowance per region per window, tokens.
        #[arg(long, default_value_t = 0)]
        fallback: u64,
        /// Debt from metered requests settled above their estimate that each region may carry
        /// per window, tokens (a term of the overshoot bound).
        #[arg(long, default_value_t = 0)]
        settle_debt: u64,
        /// Regions, comma-separated.
        #[arg(long, value_delimiter = ',', required = true)]
        regions: Vec<String>,
    },
    /// Create or replace many pools from a file of JSON lines, each
    /// {"tenant": ..., "pool": ..., "spec": {the body of `pools set`'s PUT}}; sent 1,000 a call.
    /// Pools already at their spec are left alone, so applying a file again changes nothing.
    Apply {
        /// The JSON lines file.
        #[arg(long)]
        file: PathBuf,
    },
    /// Show a pool and its live window.
    Get { tenant: String, pool: String },
    /// List pools: every one, read a page of 1,000 at a time, or with --limit one page.
    List {
        /// Only pools whose tenant/pool starts with this (acme, acme/ or acme/api).
        #[arg(long, default_value = "")]
        prefix: String,
        /// One page of at most this many pools (1 to 1,000); it ends with the next page's cursor.
        #[arg(long)]
        limit: Option<usize>,
        /// With --limit: the page after this tenant/pool (the cursor a page ends with).
        #[arg(long, requires = "limit")]
        after: Option<String>,
    },
    /// Delete a pool.
    Delete { tenant: String, pool: String },
}

// Parsed once per run: the size of the enum costs nothing worth a box.
#[allow(clippy::large_enum_variant)]
#[derive(Subcommand)]
enum OverridesCommand {
    /// Put an override in force from now: a pool's limit, or a rule's amounts for the tenant or
    /// one of its users or API keys.
    Set {
        tenant: String,
        /// The pool whose limit (`--limit`, tokens per window) it replaces.
        #[arg(long, conflicts_with = "rule")]
        pool: Option<String>,
        /// The regional rule whose amounts it replaces.
        #[arg(long)]
        rule: Option<String>,
        /// Only this user (hashed by the allocator; needs its `--pepper-file`).
        #[arg(long, conflicts_with_all = ["api_key", "principal_hash"])]
        user: Option<String>,
        /// Only this API key (hashed by the allocator; needs its `--pepper-file`).
        #[arg(long, conflicts_with = "principal_hash")]
        api_key: Option<String>,
        /// Only the principal with this hash (`allotctl principal-hash`); with --principal-type.
        #[arg(long, requires = "principal_type")]
        principal_hash: Option<String>,
        /// `user` or `api_key`, for --principal-hash.
        #[arg(long)]
        principal_type: Option<String>,
        /// A pool's limit, or a window rule's.
        #[arg(long)]
        limit: Option<u64>,
        /// A rate rule's capacity, millitokens.
        #[arg(long)]
        capacity_millis: Option<u64>,
        /// A rate rule's refill per period, millitokens.
        #[arg(long)]
        refill_millis: Option<u64>,
        /// How long it lasts: 90s, 30m, 12h or 7d (default: until ended).
        #[arg(long = "for")]
        lasts: Option<String>,
        /// Why.
        #[arg(long)]
        reason: String,
    },
    /// List overrides, in force and ended.
    List {
        /// Only this tenant's.
        #[arg(long)]
        tenant: Option<String>,
        /// Overrides per page (1 to 1,000).
        #[arg(long, default_value_t = 100)]
        limit: usize,
        /// The page after this `tenant/id` (the `next` of the page before).
        #[arg(long)]
        after: Option<String>,
    },
    /// One override.
    Get { tenant: String, id: String },
    /// End an override now.
    End { tenant: String, id: String },
}

#[derive(Subcommand)]
enum TokensCommand {
    /// Mint a token; it is printed once and only its digest is stored.
    Mint {
        /// viewer, author, admin or agent.
        #[arg(long)]
        role: String,
        /// The region an agent token may act for (required for agent tokens).
        #[arg(long)]
        region: Option<String>,
        /// A name for humans.
        #[arg(long, default_value = "")]
        name: String,
    },
    /// List tokens (ids, roles and regions; never tokens or digests).
    List,
    /// Revoke a minted token by id.
    Revoke { id: String },
    /// Print `sha256:<hex>` of the token read from standard input, for a token file line.
    Digest,
}

#[derive(Subcommand)]
enum PoliciesCommand {
    /// Publish a bundle file as the next version (optionally to canary regions first).
    Publish {
        file: PathBuf,
        /// Regions to stage it to, comma-separated.
        #[arg(long)]
        canary: Option<String>,
    },
    /// Make a version current everywhere (the current one or a newer one: agents never go back).
    Promote { version: u64 },
    /// Publish an earlier version's content as the next version, current everywhere at once.
    Rollback { version: u64 },
    /// Show a bundle: `current` (optionally for a region) or a version.
    Get {
        #[arg(default_value = "current")]
        version: String,
        /// The region asking (canary regions get the staged bundle).
        #[arg(long)]
        region: Option<String>,
    },
    /// The rollout and the version every agent runs.
    Status,
    /// Replay recorded requests against a candidate bundle, beside the current one.
    Replay {
        /// The candidate bundle file.
        #[arg(long)]
        bundle: PathBuf,
        /// JSON lines of {"atMs", "request"} (the agents' decision log).
        #[arg(long)]
        sample: PathBuf,
        /// Compare with this file instead of the allocator's current bundle.
        #[arg(long)]
        current: Option<PathBuf>,
        /// Replay the candidate's shadow and soft rules as if enforced: who would be denied.
        #[arg(long)]
        enforce: bool,
    },
}

fn pool_path(tenant: &str, pool: &str) -> String {
    format!("/v1/pools/{}/{}", encode(tenant), encode(pool))
}

/// Percent-encodes a path segment (ids are validated server-side; this only keeps the URL intact).
fn encode(segment: &str) -> String {
    segment
        .bytes()
        .map(|b| match b {
            b'a'..=b'z' | b'A'..=b'Z' | b'0'..=b'9' | b'-' | b'_' | b'.' => (b as char).to_string(),
            other => format!("%{other:02X}"),
        })
        .collect()
}

fn call(method: Method, path: String, answer: Answer) -> Call {
    Call {
        method,
        path,
        body: None,
        answer,
    }
}

/// A call with `body` as its JSON, written from the API's own request type.
fn call_with<T: Serialize>(
    method: Method,
    path: String,
    body: &T,
    answer: Answer,
) -> Result<Call, String> {
    let body = serde_json::to_string(body).map_err(|e| format!("writing the request: {e}"))?;
    Ok(Call {
        body: Some(body),
        ..call(method, path, answer)
    })
}

/// Parses an id argument, naming it in the error.
fn id<T>(
    name: &str,
    text: &str,
    parse: impl FnOnce(&str) -> Result<T, allot_shared::ids::IdError>,
) -> Result<T, String> {
    parse(text).map_err(|e| format!("{name}: {e}"))
}

/// The bearer token: `--token`, or the first token line of `--token-file`.
fn bearer_token(cli: &Cli) -> Result<Option<String>, String> {
    match (&cli.token, &cli.token_file) {
        (Some(token), _) => Ok(Some(token.clone())),
        (None, Some(path)) => Ok(Some(
            std::fs::read_to_string(path)
                .map_err(|e| format!("--token-file {}: {e}", path.display()))?
                .lines()
                .map(str::trim)
                .find(|line| !line.is_empty() && !line.starts_with('#'))
                // A token file line may put a role before the token.
                .and_then(|line| line.split_whitespace().last())
                .unwrap_or_default()
                .to_owned(),
        )),
        (None, None) => Ok(None),
    }
}

fn target_of(cli: &Cli) -> Result<Target, String> {
    Ok(Target {
        server: cli.server.clone(),
        token: bearer_token(cli)?,
        tls: allot_allocator::ctl::ClientTls {
            ca: cli.ca_file.clone(),
            cert: cli.client_cert.clone(),
            key: cli.client_key.clone(),
        },
    })
}

fn pools_call(command: PoolsCommand) -> Result<Call, String> {
    Ok(match command {
        PoolsCommand::Set {
            tenant,
            pool,
            limit,
            window_ms,
            calendar,
            time_zone,
            chunk,
            lease_ttl_ms,
            fallback,
            settle_debt,
            regions,
        } => {
            let window = match (calendar, time_zone) {
                (Some(calendar), Some(time_zone)) => Some(CalendarWindowSpec {
                    calendar,
                    time_zone,
                }),
                _ => None,
            };
            let spec = PoolSpec {
                limit_tokens: limit,
                // The server checks the calendar and the zone, and says which is wrong.
                window_ms: if window.is_some() { 0 } else { window_ms },
                window,
                chunk_tokens: chunk,
                lease_ttl_ms,
                fallback_per_region_tokens: fallback,
                settle_debt_per_region_tokens: settle_debt,
                regions: regions
                    .iter()
                    .map(|region| id("--regions", region, RegionId::parse))
                    .collect::<Result<_, _>>()?,
            };
            call_with(Method::PUT, pool_path(&tenant, &pool), &spec, Answer::Pool)?
        }
        PoolsCommand::Apply { .. } => {
            return Err("pools apply sends its file in calls of its own".to_owned());
        }
        PoolsCommand::Get { tenant, pool } => {
            call(Method::GET, pool_path(&tenant, &pool), Answer::Pool)
        }
        PoolsCommand::List {
            prefix,
            limit,
            after,
        } => {
            let limit = limit.unwrap_or(MAX_POOLS_PER_PAGE);
            let mut path = format!("/v1/pools?limit={limit}&prefix={}", encode(&prefix));
            if let Some(after) = after {
                path.push_str(&format!("&after={}", encode(&after)));
            }
            call(Method::GET, path, Answer::Pools)
        }
        PoolsCommand::Delete { tenant, pool } => {
            call(Method::DELETE, pool_path(&tenant, &pool), Answer::Nothing)
        }
    })
}

/// `90s`, `30m`, `12h` or `7d` in ms.
fn duration_ms(text: &str) -> Result<u64, String> {
    let refused = || format!("--for: {text:?} is not a duration such as 90s, 30m, 12h or 7d");
    let (number, unit_ms) = match text.char_indices().last() {
        Some((at, 's')) => (&text[..at], 1_000),
        Some((at, 'm')) => (&text[..at], 60_000),
        Some((at, 'h')) => (&text[..at], 3_600_000),
        Some((at, 'd')) => (&text[..at], 86_400_000),
        _ => return Err(refused()),
    };
    number
        .parse::<u64>()
        .ok()
        .filter(|n| *n > 0)
        .and_then(|n| n.checked_mul(unit_ms))
        .ok_or_else(refused)
}

/// Every overrides command as the API call it makes.
///
/// Long by design: it is one match over the overrides commands, each arm turning its flags into
/// that command's call; most of its length is `set`, whose flags become one body with absent fields
/// left out, and split, that body would be built away from the flags it is made of.
fn overrides_call(command: OverridesCommand) -> Result<Call, String> {
    let path = |tenant: &str, id: &str| format!("/v1/overrides/{}/{}", encode(tenant), encode(id));
    Ok(match command {
        OverridesCommand::Set {
            tenant,
            pool,
            rule,
            user,
            api_key,
            principal_hash,
            principal_type,
            limit,
            capacity_millis,
            refill_millis,
            lasts,
            reason,
        } => {
            let principal = match (user, api_key, principal_hash) {
                (Some(id), _, _) => Some(serde_json::json!({"type": "user", "id": id})),
                (_, Some(id), _) => Some(serde_json::json!({"type": "api_key", "id": id})),
                (_, _, Some(hash)) => {
                    Some(serde_json::json!({"type": principal_type, "hash": hash}))
                }
                _ => None,
            };
            let expires_at_ms = lasts
                .map(|text| {
                    let now_ms =
                        allot_allocator::clock::Clock::now_ms(&allot_allocator::clock::SystemClock);
                    duration_ms(&text).map(|ms| now_ms.saturating_add(ms))
                })
                .transpose()?;
            let body = serde_json::json!({
                "tenant": tenant, "pool": pool, "rule": rule, "principal": principal,
                "limit": limit, "capacityMillis": capacity_millis, "refillMillis": refill_millis,
                "expiresAtMs": expires_at_ms, "reason": reason,
            });
            // Absent, not null: the server reads only what is given.
            let body: serde_json::Map<String, Value> = body
                .as_object()
                .into_iter()
                .flatten()
                .filter(|(_, value)| !value.is_null())
                .map(|(key, value)| (key.clone(), value.clone()))
                .collect();
            call_with(
                Method::POST,
                "/v1/overrides".to_owned(),
                &body,
                Answer::Override,
            )?
        }
        OverridesCommand::List {
            tenant,
            limit,
            after,
        } => {
            let mut query = format!("/v1/overrides?limit={limit}");
            if let Some(tenant) = tenant {
                query.push_str(&format!("&tenant={}", encode(&tenant)));
            }
            if let Some(after) = after {
                query.push_str(&format!("&after={}", encode(&after)));
            }
            call(Method::GET, query, Answer::Overrides)
        }
        OverridesCommand::Get { tenant, id } => {
            call(Method::GET, path(&tenant, &id), Answer::Override)
        }
        OverridesCommand::End { tenant, id } => {
            call(Method::DELETE, path(&tenant, &id), Answer::Override)
        }
    })
}

/// `principal-hash`: the keyed hash agents compute, worked out here with the pepper file.
fn principal_hash(kind: &str, pepper_file: &Path, id: &str) -> Result<String, String> {
    let kind = match kind {
        "user" => allot_shared::contract::PrincipalType::User,
        "api_key" => allot_shared::contract::PrincipalType::ApiKey,
        other => return Err(format!("--type must be user or api_key, got {other:?}")),
    };
    let bytes = std::fs::read(pepper_file)
        .map_err(|e| format!("--pepper-file {}: {e}", pepper_file.display()))?;
    let pepper =
        allot_shared::keys::Pepper::new(bytes).map_err(|e| format!("--pepper-file: {e}"))?;
    let hash = allot_shared::keys::principal_hash(
        &pepper,
        kind,
        id,
        allot_shared::keys::IpPrefixes::default(),
    );
    Ok(format!(
        "{hash}
"
    ))
}

/// What a token command does: a call, or (the digest) text worked out here.
enum TokensStep {
    Call(Call),
    Printed(String),
}

fn tokens_step(command: TokensCommand) -> Result<TokensStep, String> {
    Ok(TokensStep::Call(match command {
        TokensCommand::Mint { role, region, name } => call_with(
            Method::POST,
            "/v1/tokens".to_owned(),
            &MintBody { role, region, name },
            Answer::Minted,
        )?,
        TokensCommand::List => call(Method::GET, "/v1/tokens".to_owned(), Answer::Tokens),
        TokensCommand::Revoke { id } => call(
            Method::DELETE,
            format!("/v1/tokens/{}", encode(&id)),
            Answer::Nothing,
        ),
        TokensCommand::Digest => {
            let mut line = String::new();
            std::io::stdin()
                .read_line(&mut line)
                .map_err(|e| format!("reading the token from standard input: {e}"))?;
            let token = line.trim();
            allot_allocator::auth::check_token_shape(token)
                .map_err(|e| format!("the token on standard input is {e}"))?;
            return Ok(TokensStep::Printed(format!(
                "{}\n",
                allot_allocator::auth::TokenDigest::of(token)
            )));
        }
    }))
}

fn grant_call(
    tenant: &str,
    pool: &str,
    region: &str,
    want_tokens: u64,
    lease_id: Option<String>,
) -> Result<Call, String> {
    let lease_id = match lease_id {
        Some(text) => LeaseId::parse(&text).map_err(|e| format!("--lease-id: {e}"))?,
        None => LeaseId::from_parts(
            allot_allocator::clock::Clock::now_ms(&allot_allocator::clock::SystemClock),
            rand::random(),
        ),
    };
    let body = GrantBody {
        lease_id,
        tenant: id("tenant", tenant, TenantId::parse)?,
        pool: id("pool", pool, PoolId::parse)?,
        region: id("--region", region, RegionId::parse)?,
        want_tokens,
    };
    call_with(Method::POST, "/v1/grants".to_owned(), &body, Answer::Grant)
}

/// Every policy command but `replay`, which runs offline.
fn policies_call(command: PoliciesCommand) -> Result<Call, String> {
    Ok(match command {
        PoliciesCommand::Publish { file, canary } => {
            let text = allot_allocator::ctl::read_input(&file)?;
            let query = canary
                .map(|c| format!("?canary={}", encode(&c).replace("%2C", ",")))
                .unwrap_or_default();
            Call {
                body: Some(text),
                ..call(Method::PUT, format!("/v1/policies{query}"), Answer::Bundle)
            }
        }
        PoliciesCommand::Promote { version } => call(
            Method::POST,
            format!("/v1/policies/{version}/promote"),
            Answer::Rollout,
        ),
        PoliciesCommand::Rollback { version } => call(
            Method::POST,
            format!("/v1/policies/{version}/rollback"),
            Answer::Bundle,
        ),
        PoliciesCommand::Get { version, region } => {
            let query = region
                .map(|r| format!("?region={}", encode(&r)))
                .unwrap_or_default();
            call(
                Method::GET,
                format!("/v1/policies/{}{query}", encode(&version)),
                Answer::Bundle,
            )
        }
        PoliciesCommand::Status => call(
            Method::GET,
            "/v1/policies/status".to_owned(),
            Answer::PolicyStatus,
        ),
        PoliciesCommand::Replay { .. } => {
            return Err("policies replay runs offline, not as a call".to_owned());
        }
    })
}

/// `policies replay`: the candidate beside `current` (a file, or the allocator's current bundle).
async fn replay(
    target: &Target,
    bundle: &Path,
    sample: &Path,
    current: Option<PathBuf>,
    json: bool,
    options: ReplayOptions,
) -> Result<String, String> {
    let candidate = bundle_file(bundle)?;
    let samples = sample_file(sample)?;
    let current = match current {
        Some(path) => bundle_file(&path)?,
        None => {
            let value = perform(
                target,
                call(
                    Method::GET,
                    "/v1/policies/current".to_owned(),
                    Answer::Bundle,
                ),
            )
            .await?;
            allot_shared::policy::parse_bundle(&value.to_string())
                .and_then(|d| d.into_verified())
                .map_err(|e| format!("the current bundle: {e}"))?
        }
    };
    Ok(replay_comparison(
        &current, &candidate, &samples, json, options,
    ))
}

/// Every pool `prefix` reaches, read a page at a time (each answer stays bounded however many
/// pools there are), as one list.
async fn every_pool(target: &Target, prefix: &str) -> Result<Value, String> {
    let mut pools = Vec::new();
    let mut after: Option<String> = None;
    loop {
        let page = perform(
            target,
            pools_call(PoolsCommand::List {
                prefix: prefix.to_owned(),
                limit: Some(MAX_POOLS_PER_PAGE),
                after: after.take(),
            })?,
        )
        .await?;
        if let Some(listed) = page.get("pools").and_then(Value::as_array) {
            pools.extend(listed.iter().cloned());
        }
        match page.get("next").and_then(Value::as_str) {
            Some(next) => after = Some(next.to_owned()),
            None => return Ok(serde_json::json!({ "pools": pools })),
        }
    }
}

/// The pools of a `pools apply` file, each line checked (its spec validated) before any is sent,
/// so a bad line changes nothing.
fn bulk_file(path: &Path) -> Result<Vec<BulkPool>, String> {
    let text =
        std::fs::read_to_string(path).map_err(|e| format!("--file {}: {e}", path.display()))?;
    let mut pools = Vec::new();
    let mut seen = std::collections::HashSet::new();
    for (index, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let at = |what: String| format!("{} line {}: {what}", path.display(), index + 1);
        let pool: BulkPool = allot_shared::FieldError::parse_json(line.as_bytes(), "line")
            .map_err(|e| at(format!("{} (field {})", e.message, e.field)))?;
        pool.spec
            .validate()
            .map_err(|e| at(format!("{} (field spec.{})", e.message, e.field)))?;
        if !seen.insert((pool.tenant.clone(), pool.pool.clone())) {
            return Err(at(format!("{}/{} is listed twice", pool.tenant, pool.pool)));
        }
        pools.push(pool);
    }
    if pools.is_empty() {
        return Err(format!("--file {}: no pools in it", path.display()));
    }
    Ok(pools)
}

/// `pools apply`: the file's pools, [`MAX_POOLS_PER_BULK`] a call; the totals of every call.
async fn apply(target: &Target, file: &Path) -> Result<Value, String> {
    let pools = bulk_file(file)?;
    let (mut created, mut updated, mut unchanged) = (0u64, 0u64, 0u64);
    for chunk in pools.chunks(MAX_POOLS_PER_BULK) {
        let body = BulkPools {
            pools: chunk.to_vec(),
        };
        let answer = perform(
            target,
            call_with(
                Method::POST,
                "/v1/pools/bulk".to_owned(),
                &body,
                Answer::Bulk,
            )?,
        )
        .await?;
        let count = |field: &str| answer.get(field).and_then(Value::as_u64).unwrap_or(0);
        created += count("created");
        updated += count("updated");
        unchanged += count("unchanged");
    }
    Ok(serde_json::json!({ "created": created, "updated": updated, "unchanged": unchanged }))
}

/// `usage export`: every page, following each page's `Allot-Next-After`; a CSV header once.
async fn usage_export(
    target: &Target,
    (from, to): (u64, u64),
    prefix: &str,
    format: &str,
) -> Result<String, String> {
    let mut out = String::new();
    let mut after: Option<String> = None;
    loop {
        let mut path = format!(
            "/v1/usage?from={from}&to={to}&format={}&limit={MAX_USAGE_PAGE}&prefix={}",
            encode(format),
            encode(prefix)
        );
        if let Some(after) = &after {
            path.push_str(&format!("&after={}", encode(after)));
        }
        let (headers, text) = exchange(target, call(Method::GET, path, Answer::Nothing)).await?;
        let mut lines = text.lines();
        if format == "csv" && !out.is_empty() {
            lines.next();
        }
        for line in lines {
            out.push_str(line);
            out.push('\n');
        }
        match headers
            .get("allot-next-after")
            .and_then(|value| value.to_str().ok())
        {
            Some(next) => after = Some(next.to_owned()),
            None => return Ok(out),
        }
    }
}

/// Runs the command against the allocator the flags name: most commands are one API call, performed
/// and shown here; the others (paging, files, local work) answer on their own.
///
/// Long by design: it is one match over every command, read as the table of what each command does:
/// an arm returns its own answer or gives the one call that is performed and shown at the end;
/// split, which commands take the shared path would be read in several places.
async fn execute(cli: Cli) -> Result<String, String> {
    let target = target_of(&cli)?;
    let json = cli.json;
    let request = match cli.command {
        Command::Pools {
            command:
                PoolsCommand::List {
                    prefix,
                    limit: None,
                    ..
                },
        } => {
            return shown(json, Answer::Pools, &every_pool(&target, &prefix).await?);
        }
        Command::Pools {
            command: PoolsCommand::Apply { file },
        } => {
            return shown(json, Answer::Bulk, &apply(&target, &file).await?);
        }
        Command::Pools { command } => pools_call(command)?,
        Command::Overrides { command } => overrides_call(command)?,
        Command::PrincipalHash {
            kind,
            pepper_file,
            id,
        } => return principal_hash(&kind, &pepper_file, &id),
        Command::Tokens { command } => match tokens_step(command)? {
            TokensStep::Call(call) => call,
            TokensStep::Printed(text) => return Ok(text),
        },
        Command::Usage {
            command:
                UsageCommand::Export {
                    from,
                    to,
                    prefix,
                    format,
                },
        } => return usage_export(&target, (from, to), &prefix, &format).await,
        Command::Audit { last } => {
            call(Method::GET, format!("/v1/audit?last={last}"), Answer::Audit)
        }
        Command::BoundChecks { recent } => call(
            Method::GET,
            format!("/v1/bound-checks?recent={recent}"),
            Answer::BoundChecks,
        ),
        Command::Shards => call(Method::GET, "/v1/shards".to_owned(), Answer::Shards),
        Command::Windows { tenant, pool, last } => call(
            Method::GET,
            format!("{}/windows?last={last}", pool_path(&tenant, &pool)),
            Answer::Windows,
        ),
        Command::Grant {
            tenant,
            pool,
            region,
            want,
            lease_id,
        } => grant_call(&tenant, &pool, &region, want, lease_id)?,
        Command::Policies {
            command:
                PoliciesCommand::Replay {
                    bundle,
                    sample,
                    current,
                    enforce,
                },
        } => {
            let options = ReplayOptions {
                enforce_advisory: enforce,
            };
            return replay(&target, &bundle, &sample, current, json, options).await;
        }
        Command::Policies { command } => policies_call(command)?,
    };
    let answer = request.answer;
    shown(json, answer, &perform(&target, request).await?)
}

/// An answer as printed: its JSON with `--json`, else rendered for humans.
fn shown(json: bool, answer: Answer, value: &Value) -> Result<String, String> {
    if json {
        Ok(format!("{value}\n"))
    } else {
        render(answer, value)
    }
}

#[tokio::main(flavor = "current_thread")]
async fn main() -> ExitCode {
    let cli = Cli::parse();
    match execute(cli).await {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("allotctl: {message}");
            ExitCode::from(1)
        }
    }
}
