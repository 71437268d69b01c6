//! `allot dev`: the whole system in one process on the embedded stores, for trying Allot out.
//!
//! An allocator on the in-process store (with a SQLite ledger in `--data-dir`) and two region agents
//! (`eu`, `us`) on in-process limiter stores, on loopback ports; an example tenant pool
//! (`atlas`/`api`: 1,000 per minute, chunk 100, fallback 100 per region) and the dev policy bundle
//! (`deploy/examples/dev-bundle.json`: the example rules, a per-user burst guard being dark-launched
//! in shadow mode and the tenant's soft plan), and a monthly plan of model tokens (`atlas`/`llm`: a
//! month in Europe/Berlin) spent by a metered chat route. With `--demo` it drives synthetic traffic,
//! 90% through EU and 10% through US, and prints a live per-window table: what was admitted and
//! denied, what the shadow and soft rules would have denied, what one user is told of their quota,
//! and the chat route's requests, estimated at admission and settled after the response. Nothing here
//! is for production: every store forgets everything when the process ends, and it says so.

use std::fmt::Write as _;
use std::io::{IsTerminal as _, Write as _};
use std::net::SocketAddr;
use std::path::PathBuf;
use std::pin::Pin;
use std::sync::Arc;
use std::time::Duration;

use allot_allocator::http::Tokens;
use allot_allocator::kv::Kv;
use allot_allocator::kv::memory::MemoryKv;
use allot_allocator::ledger::Ledger;
use allot_allocator::pools::{PoolSpec, put_pool};
use allot_allocator::server::{Settings, run};
use allot_region_agent::allocator_client::AllocatorClient;
use allot_region_agent::limiter::{
    DEFAULT_IN_PROCESS_MAX_KEYS, InProcessStore, Limiter, LimiterConfig,
};
use allot_region_agent::service::{Agent, AgentSettings};
use allot_shared::clock::Clock;
use allot_shared::contract::{
    AdmissionRequest, AdvisoryMode, Principal, PrincipalType, QuotaQuery,
};
use allot_shared::ids::{AgentId, DecisionId, PoolId, RegionId, RouteGroup, TenantId};
use allot_shared::keys::Pepper;
use tokio::sync::watch;

/// The dev bundle, compiled in.
pub const DEV_BUNDLE: &str = include_str!("../../deploy/examples/dev-bundle.json");

/// Settings of `allot dev`.
#[derive(Debug, Clone)]
pub struct DevOptions {
    /// The allocator's port; the agents take the next two.
    pub base_port: u16,
    /// Where the SQLite ledger goes.
    pub data_dir: PathBuf,
    /// Drive synthetic traffic and print a live table.
    pub demo: bool,
    /// Demo requests per second (all regions).
    pub demo_rate_per_s: u64,
}

/// The regions `allot dev` runs an agent for.
const DEV_REGIONS: [&str; 2] = ["eu", "us"];

fn token() -> String {
    hex::encode(rand::random::<[u8; 16]>())
}

fn id<T>(
    text: &str,
    parse: fn(&str) -> Result<T, allot_shared::ids::IdError>,
) -> Result<T, String> {
    parse(text).map_err(|e| e.to_string())
}

/// What [`run_dev`] returns: the running system, finished when `shutdown` resolves.
pub type DevRun = Pin<Box<dyn Future<Output = Result<(), String>> + Send>>;

/// Runs until `shutdown` resolves.
///
/// Boxed and without a type parameter on purpose: this crate is optimised, and optimised crates
/// share no monomorphised code, so a caller that polled the `async fn` itself would compile the
/// whole allocator and agent again. Through the box, they are compiled once, here.
pub fn run_dev(options: DevOptions, shutdown: Pin<Box<dyn Future<Output = ()> + Send>>) -> DevRun {
    Box::pin(run_dev_until(options, shutdown))
}

/// Long by design: the whole system assembled in the order it comes up (stores, allocator, ledger,
/// agents, gateways), each step a few lines that read best in sequence.
async fn run_dev_until(
    options: DevOptions,
    shutdown: Pin<Box<dyn Future<Output = ()> + Send>>,
) -> Result<(), String> {
    let clock = allot_allocator::server::system_clock();
    let (operator, gateway) = (token(), token());
    // Each region's agents get a token scoped to their region, as a deployment should give them.
    let agent_tokens: Vec<(&str, String)> = DEV_REGIONS
        .iter()
        .map(|region| (*region, token()))
        .collect();
    std::fs::create_dir_all(&options.data_dir)
        .map_err(|e| format!("--data-dir {}: {e}", options.data_dir.display()))?;
    let allocator_addr = SocketAddr::from(([127, 0, 0, 1], options.base_port));
    let tokens = Tokens {
        operator: vec![operator.clone()],
        agent: agent_tokens
            .iter()
            .map(|(region, token)| format!("{region} {token}"))
            .collect(),
    };
    let settings = Settings {
        ledger_url: format!(
            "sqlite://{}",
            options.data_dir.join("allot-dev.db").display()
        ),
        ..Settings::local(allocator_addr, tokens, "dev")
    };
    let kv: Arc<dyn Kv> = Arc::new(MemoryKv::new(clock.clone()));
    let ledger = Ledger::connect(&settings.ledger_url)
        .await
        .map_err(|e| e.to_string())?;
    let demo_ledger = ledger.clone();
    let (tenant, pool) = (id("atlas", TenantId::parse)?, id("api", PoolId::parse)?);
    let regions = DEV_REGIONS
        .iter()
        .map(|region| id(region, RegionId::parse))
        .collect::<Result<Vec<_>, _>>()?;
    let spec = PoolSpec {
        limit_tokens: 1_000,
        window_ms: 60_000,
        window: None,
        chunk_tokens: 100,
        lease_ttl_ms: 15_000,
        fallback_per_region_tokens: 100,
        settle_debt_per_region_tokens: 0,
        regions: regions.clone(),
    };
    let pool_config = spec.validate().map_err(|e| e.to_string())?;
    put_pool(&*kv, &tenant, &pool, spec, clock.now_ms())
        .await
        .map_err(|e| e.to_string())?;
    let llm_pool = id(LLM_POOL, PoolId::parse)?;
    let llm_config = llm_spec(regions.clone())
        .validate()
        .map_err(|e| e.to_string())?;
    put_pool(
        &*kv,
        &tenant,
        &llm_pool,
        llm_spec(regions.clone()),
        clock.now_ms(),
    )
    .await
    .map_err(|e| e.to_string())?;
    let draft = allot_shared::policy::parse_bundle(DEV_BUNDLE).map_err(|e| e.to_string())?;
    allot_allocator::policies::publish(
        &*kv,
        draft,
        allot_shared::window::rfc3339_utc(clock.now_ms()),
        None,
    )
    .await
    .map_err(|e| e.to_string())?;
    let listener = tokio::net::TcpListener::bind(allocator_addr)
        .await
        .map_err(|e| format!("cannot listen on {allocator_addr}: {e}"))?;
    // The agents stop first, so their last reports still reach the allocator.
    let (stop_agents, agents_stopped) = watch::channel(false);
    let agents_stop_signal = move || {
        let mut stopped = agents_stopped.clone();
        async move {
            let _ = stopped.wait_for(|s| *s).await;
        }
    };
    let mut agent_tasks = Vec::new();
    let (stop, stopped) = watch::channel(false);
    let stop_signal = move || {
        let mut stopped = stopped.clone();
        async move {
            let _ = stopped.wait_for(|s| *s).await;
        }
    };
    let allocator_task = tokio::spawn(run(
        settings,
        kv.clone(),
        ledger,
        clock.clone(),
        listener,
        stop_signal(),
    ));
    let allocator_url = format!("http://{allocator_addr}");
    let pepper = Pepper::new(rand::random::<[u8; 32]>().to_vec()).map_err(|e| e.to_string())?;
    let mut agents = Vec::new();
    for (offset, region) in regions.iter().enumerate() {
        let port = options.base_port + 1 + u16::try_from(offset).unwrap_or(0);
        let addr = SocketAddr::from(([127, 0, 0, 1], port));
        let agent_clock = Arc::new(allot_region_agent::clock::SystemClock);
        let store = InProcessStore::new(agent_clock.clone(), DEFAULT_IN_PROCESS_MAX_KEYS);
        let limiter =
            Limiter::new(Arc::new(store), LimiterConfig::default()).map_err(|e| e.to_string())?;
        let agent_token = agent_tokens
            .iter()
            .find(|(name, _)| *name == region.as_str())
            .map(|(_, token)| token.clone())
            .ok_or_else(|| format!("no agent token for {region}"))?;
        let client = AllocatorClient::new(vec![allocator_url.clone()], agent_token)
            .map_err(|e| e.to_string())?;
        let agent = Agent::new(
            AgentSettings {
                allocator_round_trip_ms: 5,
                ..AgentSettings::new(
                    region.clone(),
                    AgentId::parse(&format!("{region}-dev")).map_err(|e| e.to_string())?,
                    pepper.clone(),
                )
            },
            agent_clock,
            limiter,
            Some(Arc::new(client)),
            None,
        );
        let listener = tokio::net::TcpListener::bind(addr)
            .await
            .map_err(|e| format!("cannot listen on {addr}: {e}"))?;
        let serving = allot_region_agent::server::Serving {
            gateway_tokens: vec![gateway.clone()],
            tls: None,
            // The allocator in this process installed the recorder; its registry holds both.
            metrics: allot_allocator::metrics::handle(),
        };
        let listeners = allot_region_agent::server::Listeners {
            http: listener.into(),
            grpc: None,
        };
        agent_tasks.push(tokio::spawn(allot_region_agent::server::run(
            agent.clone(),
            listeners,
            serving,
            agents_stop_signal(),
        )));
        agents.push((region.clone(), addr, agent));
    }
    // Load the bundle now rather than at the first background tick.
    for (_, _, agent) in &agents {
        agent.refresh_policy().await;
    }
    println!(
        "allot dev: everything in this process on in-process stores (NOT durable, not for production)"
    );
    println!("  allocator  {allocator_url}   operator token {operator}");
    println!("  console    {allocator_url}/console/   (sign in with the operator token)");
    for (region, addr, _) in &agents {
        println!("  agent {region:<4} http://{addr}");
    }
    println!("  gateway token {gateway}");
    println!(
        "  pool atlas/api: 1000 per minute, chunk 100, fallback 100 per region, regions eu,us"
    );
    println!(
        "  pool atlas/llm: {LLM_LIMIT_TOKENS} model tokens a month (Europe/Berlin), chunk {LLM_CHUNK_TOKENS}, settle debt {LLM_SETTLE_DEBT_TOKENS} per region: the metered route chat"
    );
    println!();
    println!("try:");
    println!(
        "  curl -s -X POST http://{}/v1/admit -H 'authorization: Bearer {gateway}' -H 'content-type: application/json' \\",
        agents[0].1
    );
    println!(
        "    -d '{{\"requestId\":\"r-1\",\"tenantId\":\"atlas\",\"principal\":{{\"type\":\"user\",\"id\":\"U-17\"}},\"routeGroup\":\"read\",\"method\":\"GET\"}}'"
    );
    println!(
        "  {} --server {allocator_url} --token {operator} windows atlas api",
        allotctl_command()
    );
    println!();
    if options.demo {
        let demo = tokio::spawn(demo(
            agents
                .iter()
                .map(|(r, _, a)| (r.clone(), a.clone()))
                .collect(),
            demo_ledger,
            [pool_config, llm_config],
            clock.clone(),
            options.demo_rate_per_s,
        ));
        shutdown.await;
        demo.abort();
    } else {
        shutdown.await;
    }
    println!("allot dev: stopping");
    let _ = stop_agents.send(true);
    for task in agent_tasks {
        let _ = task.await;
    }
    let _ = stop.send(true);
    let _ = allocator_task.await;
    Ok(())
}

/// Most demo requests awaiting an answer at once.
const MAX_DEMO_IN_FLIGHT: usize = 1_024;

/// The demo's monthly plan of model tokens, spent by the metered chat route.
const LLM_POOL: &str = "llm";
const LLM_LIMIT_TOKENS: u64 = 50_000_000;
const LLM_CHUNK_TOKENS: u64 = 20_000;
const LLM_SETTLE_DEBT_TOKENS: u64 = 5_000;
/// What the demo's gateway estimates a chat request costs; the responses use 100 to 1,000 tokens
/// (550 on average), so most settle above the estimate and the extra is charged after them.
const CHAT_ESTIMATE_TOKENS: u64 = 400;
const CHAT_ACTUAL_TOKENS: std::ops::RangeInclusive<u64> = 100..=1_000;

fn llm_spec(regions: Vec<RegionId>) -> PoolSpec {
    PoolSpec {
        limit_tokens: LLM_LIMIT_TOKENS,
        window_ms: 0,
        window: Some(allot_shared::wire::CalendarWindowSpec {
            calendar: "month".to_owned(),
            time_zone: "Europe/Berlin".to_owned(),
        }),
        chunk_tokens: LLM_CHUNK_TOKENS,
        lease_ttl_ms: 15_000,
        fallback_per_region_tokens: 10_000,
        settle_debt_per_region_tokens: LLM_SETTLE_DEBT_TOKENS,
        regions,
    }
}

/// Aborts a task when dropped (the demo's traffic driver stops with the demo).
struct AbortOnDrop(tokio::task::JoinHandle<()>);

impl Drop for AbortOnDrop {
    fn drop(&mut self) {
        self.0.abort();
    }
}

/// What the demo's own gateways saw in one window and region.
#[derive(Debug, Clone, Copy, Default)]
struct Seen {
    admitted: u64,
    denied: u64,
    /// Decisions a shadow rule would have denied (admitted; the caller not told).
    shadow: u64,
    /// Decisions a soft rule flagged to the caller (admitted).
    soft: u64,
}

/// What the demo's gateways saw, per window and region.
type WindowCounts = Arc<std::sync::Mutex<std::collections::BTreeMap<(u64, usize), Seen>>>;

/// What the metered chat route's gateway saw in one minute, model tokens.
#[derive(Debug, Default, Clone, Copy)]
struct Metered {
    settled: u64,
    denied: u64,
    estimated_tokens: u64,
    used_tokens: u64,
    /// Extra cost charged at once to the plan.
    paid_tokens: u64,
    /// Extra cost the region owes the plan, paid from its next leases.
    owed_tokens: u64,
    written_off_tokens: u64,
}

/// The metered route's counts per minute (its start, epoch ms).
type MeteredCounts = Arc<std::sync::Mutex<std::collections::BTreeMap<u64, Metered>>>;

/// The metered chat route: a request every 100 ms per 10 demo requests a second, through EU,
/// admitted with an estimate and settled with what the response used once it is done.
///
/// Long by design: one chat request's life (admitted with the estimate, the model's answer, settled
/// with what it used, counted in its minute) is one spawned task that carries its decision id from
/// the admission to the settlement; split, that id and the minute's counts would be passed between
/// pieces that each mean nothing alone.
async fn metered_chat(
    agent: Arc<Agent>,
    counts: MeteredCounts,
    clock: Arc<dyn Clock>,
    rate_per_s: u64,
) {
    let interval = Duration::from_micros(10_000_000 / rate_per_s.max(1));
    let mut tick = tokio::time::interval(interval);
    let mut in_flight = tokio::task::JoinSet::new();
    let mut n: u64 = 0;
    loop {
        tick.tick().await;
        while in_flight.try_join_next().is_some() {}
        if in_flight.len() >= MAX_DEMO_IN_FLIGHT {
            continue;
        }
        n += 1;
        let (Ok(request_id), Ok(tenant), Ok(route_group)) = (
            DecisionId::parse(&format!("chat-{n}")),
            TenantId::parse("atlas"),
            RouteGroup::parse("chat"),
        ) else {
            continue;
        };
        let request = AdmissionRequest {
            request_id: request_id.clone(),
            tenant_id: tenant.clone(),
            principal: Principal {
                kind: PrincipalType::User,
                id: format!("U-{}", n % 50),
                api_key_id: None,
            },
            route_group,
            method: "POST".to_owned(),
            cost_hint: CHAT_ESTIMATE_TOKENS,
            policy_epoch: None,
            dry_run: false,
            metered: true,
        };
        let (agent, counts, clock) = (agent.clone(), counts.clone(), clock.clone());
        in_flight.spawn(async move {
            let minute = |clock: &Arc<dyn Clock>| clock.now_ms() / 60_000 * 60_000;
            let Ok(decision) = agent.admit(&request).await else {
                return;
            };
            if !decision.allowed {
                lock_counts(&counts)
                    .entry(minute(&clock))
                    .or_default()
                    .denied += 1;
                return;
            }
            // The model answers, then the gateway settles what it used.
            tokio::time::sleep(Duration::from_millis(rand::random_range(50..400))).await;
            let actual = rand::random_range(CHAT_ACTUAL_TOKENS);
            let settle = allot_shared::contract::SettleRequest {
                decision_id: request_id,
                tenant_id: tenant,
                actual_cost_units: actual,
            };
            let Ok(answer) = agent.settle(&settle).await else {
                return;
            };
            let mut counts = lock_counts(&counts);
            let seen = counts.entry(minute(&clock)).or_default();
            seen.settled += 1;
            seen.estimated_tokens += answer.estimate_units;
            seen.used_tokens += answer.actual_cost_units;
            for pool in &answer.pools {
                seen.paid_tokens += pool.paid;
                seen.owed_tokens += pool.owed;
                seen.written_off_tokens += pool.written_off;
            }
            while counts.len() > 4 {
                counts.pop_first();
            }
        });
    }
}

fn lock_counts<T>(counts: &std::sync::Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    counts.lock().unwrap_or_else(|p| p.into_inner())
}

/// The metered route's line under the table: this minute's settlements, and the month's plan.
async fn metered_line(
    counts: &MeteredCounts,
    ledger: &Ledger,
    config: &allot_shared::lease::PoolConfig,
    now_ms: u64,
) -> String {
    let seen = lock_counts(counts)
        .get(&(now_ms / 60_000 * 60_000))
        .copied()
        .unwrap_or_default();
    let (Ok(tenant), Ok(pool)) = (TenantId::parse("atlas"), PoolId::parse(LLM_POOL)) else {
        return String::new();
    };
    let month = ledger
        .windows(&tenant, &pool, config, 1, now_ms)
        .await
        .ok()
        .and_then(|rows| rows.into_iter().next());
    format!(
        "chat (metered, estimated {CHAT_ESTIMATE_TOKENS} model tokens, settled after the response), this minute: \
         {} settled, {} denied; {} estimated, {} used: {} extra charged at once, {} owed, {} written off\n\
         atlas/llm this month (Europe/Berlin): {} of {} spent, the region's debt at most {}\n",
        seen.settled,
        seen.denied,
        seen.estimated_tokens,
        seen.used_tokens,
        seen.paid_tokens,
        seen.owed_tokens,
        seen.written_off_tokens,
        month.as_ref().map_or(0, |w| w.spent_tokens),
        config.limit_tokens(),
        month.as_ref().map_or(0, |w| w.settle_debt_tokens),
    )
}

/// Synthetic traffic, 90/10 over the first two agents, and every 5 s a per-window table: what each
/// region admitted (from the gateways' side), `G`, and the ledger's view of the window (fallback,
/// stranded, overshoot and the bound). Long by design: the demo's load loop and its table in one
/// place.
async fn demo(
    agents: Vec<(RegionId, Arc<Agent>)>,
    ledger: Ledger,
    [config, llm_config]: [allot_shared::lease::PoolConfig; 2],
    clock: Arc<dyn Clock>,
    rate_per_s: u64,
) {
    let counts: WindowCounts = Arc::default();
    let metered: MeteredCounts = Arc::default();
    let _chat = agents.first().map(|(_, agent)| {
        AbortOnDrop(tokio::spawn(metered_chat(
            agent.clone(),
            metered.clone(),
            clock.clone(),
            rate_per_s,
        )))
    });
    let interval = Duration::from_micros(1_000_000 / rate_per_s.max(1));
    let (driver_counts, driver_agents, driver_clock) =
        (counts.clone(), agents.clone(), clock.clone());
    let window_spec = config.window().clone();
    // Aborted with the demo; its requests live in a bounded set that is aborted with it.
    let _driver = AbortOnDrop(tokio::spawn(async move {
        let mut tick = tokio::time::interval(interval);
        let mut in_flight = tokio::task::JoinSet::new();
        let mut n: u64 = 0;
        loop {
            tick.tick().await;
            while in_flight.try_join_next().is_some() {}
            if in_flight.len() >= MAX_DEMO_IN_FLIGHT {
                // The agents are slower than the demo rate: skip this request (I10).
                continue;
            }
            n += 1;
            let index = usize::from(n.is_multiple_of(10) && driver_agents.len() > 1);
            let agent = driver_agents[index].1.clone();
            let counts = driver_counts.clone();
            let clock = driver_clock.clone();
            let (Ok(request_id), Ok(tenant), Ok(route_group)) = (
                DecisionId::parse(&format!("demo-{n}")),
                TenantId::parse("atlas"),
                RouteGroup::parse("read"),
            ) else {
                continue;
            };
            let request = AdmissionRequest {
                request_id,
                tenant_id: tenant,
                principal: Principal {
                    kind: PrincipalType::User,
                    id: format!("U-{}", n % 200),
                    api_key_id: None,
                },
                route_group,
                method: "GET".to_owned(),
                cost_hint: 1,
                policy_epoch: None,
                dry_run: false,
                metered: false,
            };
            let window_spec = window_spec.clone();
            in_flight.spawn(async move {
                if let Ok(decision) = agent.admit(&request).await {
                    let window = window_spec.containing(clock.now_ms());
                    let mut counts = counts.lock().unwrap_or_else(|p| p.into_inner());
                    let entry = counts.entry((window.start_ms, index)).or_default();
                    if decision.allowed {
                        entry.admitted += 1;
                    } else {
                        entry.denied += 1;
                    }
                    for violation in &decision.violations {
                        match violation.mode {
                            AdvisoryMode::Shadow => entry.shadow += 1,
                            AdvisoryMode::Soft => entry.soft += 1,
                        }
                    }
                    // Keep the last few windows only.
                    while counts.len() > 16 {
                        counts.pop_first();
                    }
                }
            });
        }
    }));
    let (Ok(tenant), Ok(pool)) = (TenantId::parse("atlas"), PoolId::parse("api")) else {
        return;
    };
    let mut screen = TableScreen::new(std::io::stdout().is_terminal());
    let mut table = tokio::time::interval(if screen.in_place {
        Duration::from_secs(1)
    } else {
        Duration::from_secs(5)
    });
    table.tick().await;
    loop {
        table.tick().await;
        let rows = ledger
            .windows(&tenant, &pool, &config, 2, clock.now_ms())
            .await
            .unwrap_or_default();
        let counts = counts.lock().unwrap_or_else(|p| p.into_inner()).clone();
        let mut out = String::new();
        let _ = writeln!(
            out,
            "{:<26} {:>6} {:>9} {:>7} {:>7} {:>6} {:>6} {:>9} {:>9} {:>10} {:>6}",
            "window (UTC)",
            "region",
            "admitted",
            "denied",
            "shadow",
            "soft",
            "G",
            "fallback",
            "stranded",
            "overshoot",
            "bound"
        );
        let mut starts: Vec<u64> = counts.keys().map(|(start, _)| *start).collect();
        starts.dedup();
        for start in starts.iter().rev().take(2).rev() {
            let row = rows.iter().find(|r| r.window_start_ms == *start);
            for (index, (region, _)) in agents.iter().enumerate() {
                let seen = counts.get(&(*start, index)).copied().unwrap_or_default();
                let fallback = row
                    .and_then(|r| r.fallback_admitted_tokens_by_region.get(region).copied())
                    .unwrap_or(0);
                let _ = writeln!(
                    out,
                    "{:<26} {:>6} {:>9} {:>7} {:>7} {:>6} {:>6} {:>9} {:>9} {:>10} {:>6}",
                    allot_shared::window::rfc3339_utc(*start),
                    region.as_str(),
                    seen.admitted,
                    seen.denied,
                    seen.shadow,
                    seen.soft,
                    config.limit_tokens(),
                    fallback,
                    row.map_or(0, |r| r.stranded_tokens),
                    row.map_or(0, |r| r.overshoot_tokens),
                    row.map_or(0, |r| r.bound_tokens),
                );
            }
        }
        if let Some((_, agent)) = agents.first() {
            out.push_str(&what_a_user_is_told(agent).await);
        }
        out.push_str(&metered_line(&metered, &ledger, &llm_config, clock.now_ms()).await);
        screen.show(&out);
    }
}

/// What user U-0 of the demo tenant would be told: its quotas (`GET /v1/quota`) and a check
/// without spending (`dryRun`), as lines under the table.
async fn what_a_user_is_told(agent: &Arc<Agent>) -> String {
    let (Ok(tenant), Ok(route), Ok(check_id)) = (
        TenantId::parse("atlas"),
        RouteGroup::parse("read"),
        DecisionId::parse("demo-check"),
    ) else {
        return String::new();
    };
    let mut out = String::from("U-0's quotas (GET /v1/quota):");
    let query = QuotaQuery {
        tenant_id: tenant.clone(),
        principal_type: PrincipalType::User,
        principal_id: "U-0".to_owned(),
        route_group: Some(route.clone()),
    };
    if let Ok(Some(status)) = agent.quota(&query).await {
        for quota in &status.quotas {
            let remaining = quota
                .remaining_units
                .map_or("?".to_owned(), |left| left.to_string());
            let _ = write!(
                out,
                " {} {remaining}/{}",
                quota.policy_id, quota.limit_units
            );
        }
    }
    let check = AdmissionRequest {
        request_id: check_id,
        tenant_id: tenant,
        principal: Principal {
            kind: PrincipalType::User,
            id: "U-0".to_owned(),
            api_key_id: None,
        },
        route_group: route,
        method: "GET".to_owned(),
        cost_hint: 1,
        policy_epoch: None,
        dry_run: true,
        metered: false,
    };
    let verdict = match agent.admit(&check).await {
        Ok(decision) if decision.allowed => "would be admitted",
        Ok(_) => "would be denied",
        Err(_) => "could not be checked",
    };
    let _ = writeln!(
        out,
        "\nA check without spending (dryRun) for U-0: {verdict}."
    );
    out
}

/// How to run `allotctl` from here: the binary beside this one when it was built (`scripts/dev`
/// builds both), else through cargo.
fn allotctl_command() -> String {
    std::env::current_exe()
        .ok()
        .map(|exe| exe.with_file_name("allotctl"))
        .filter(|path| path.is_file())
        .map(|path| path.display().to_string())
        .unwrap_or_else(|| "cargo run -q -p allot-allocator --bin allotctl --".to_owned())
}

/// The demo's table: redrawn in place on a terminal (one table, like `top`), one table after
/// another when piped (line-oriented, for logs and `grep`).
struct TableScreen {
    in_place: bool,
    lines_shown: usize,
}

impl TableScreen {
    fn new(in_place: bool) -> Self {
        Self {
            in_place,
            lines_shown: 0,
        }
    }

    fn show(&mut self, table: &str) {
        let text = self.frame(table);
        let mut stdout = std::io::stdout().lock();
        let _ = stdout.write_all(text.as_bytes());
        let _ = stdout.flush();
    }

    /// What to write for `table`: on a terminal, first move up over the last table and clear it.
    fn frame(&mut self, table: &str) -> String {
        if !self.in_place {
            return table.to_owned();
        }
        let erase = match self.lines_shown {
            0 => String::new(),
            lines => format!("\x1b[{lines}A\x1b[J"),
        };
        self.lines_shown = table.lines().count();
        format!("{erase}{table}")
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_terminal_table_is_redrawn_over_the_last_one() {
        let mut screen = TableScreen::new(true);
        assert_eq!(screen.frame("a\nb\n"), "a\nb\n");
        assert_eq!(screen.frame("c\nd\ne\n"), "\x1b[2A\x1b[Jc\nd\ne\n");
        assert_eq!(screen.frame("f\n"), "\x1b[3A\x1b[Jf\n");
    }

    #[test]
    fn a_piped_table_is_plain_lines() {
        let mut screen = TableScreen::new(false);
        assert_eq!(screen.frame("a\nb\n"), "a\nb\n");
        assert_eq!(screen.frame("c\n"), "c\n");
    }
}
