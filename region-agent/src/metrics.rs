//! Prometheus metrics of the region agent.
//!
//! Label values come from bounded sets only: outcomes, scopes, reasons, rule ids and policy versions
//! (from the published bundle), tenant and pool ids (operator-configured). Never principals, keys,
//! addresses or decision ids (those appear nowhere but in keyed hashes).

use allot_net::metrics::AtStart;
use metrics_exporter_prometheus::PrometheusHandle;

/// Decisions by `outcome` (allowed, denied), `scope`, `reason`, `rule` and `policy_version`.
pub const DECISIONS: &str = "allot_agent_decisions_total";
/// Requests a shadow or soft rule would have denied (it denied none), by `rule` and `mode`.
pub const ADVISORY_DENIALS: &str = "allot_agent_advisory_denials_total";
/// Sub-slots of a hot tenant, by `tenant` (gauge; only tenants given with `--hot-tenant`): its
/// tenant and route budgets are split this many ways, which may admit up to `sub_slots - 1` units
/// of rounding above each (docs/limiter.md).
pub const HOT_TENANT_SUB_SLOTS: &str = "allot_agent_hot_tenant_sub_slots";
/// Tokens a shadow global rule counted without spending, by `tenant` and `pool`.
pub const SHADOW_ADMITTED_TOKENS: &str = "allot_agent_shadow_admitted_tokens_total";
/// Dry runs (`dryRun`, an RLS `hits_addend` of 0: checks that spend nothing) by `outcome`
/// (allowed, denied); not counted in [`DECISIONS`].
pub const DRY_RUNS: &str = "allot_agent_dry_runs_total";
/// Retries of admitted idempotent requests answered with the admission already made (nothing
/// reserved, spent or settled again), by `tier`: `agent` (remembered by the agent) or `store` (the
/// regional store replayed its decision record; the request's global reservation was cancelled).
pub const REPLAYED_ADMISSIONS: &str = "allot_agent_replayed_admissions_total";
/// Admitted idempotent requests the agent forgot before their retention ended, to stay within
/// `MAX_REMEMBERED_ADMISSIONS`: a retry of one is decided again (the store's record still keeps
/// its regional rules to one debit).
pub const IDEMPOTENCY_FORGOTTEN_EARLY: &str = "allot_agent_idempotency_forgotten_early_total";
/// Metered admissions by how they ended, `outcome`: `exact`, `under` (actual above the estimate:
/// extra charged or owed), `over` (actual below it: the rest stays spent), `expired` (not settled
/// within the settle window: the estimate stands), `evicted` (pushed out of a full table early:
/// the estimate stands), `after_response` (charged after the response over RLS, unestimated).
pub const SETTLEMENTS: &str = "allot_agent_settlements_total";
/// Metered admissions open for settlement (gauge; at most `MAX_OPEN_SETTLEMENTS`).
pub const OPEN_SETTLEMENTS: &str = "allot_agent_open_settlements";
/// Units estimated and not used (actual below the estimate; spent all the same).
pub const SETTLE_UNUSED_UNITS: &str = "allot_agent_settle_unused_units_total";
/// Extra cost of settlements on global pools, tokens, by `tenant`, `pool` and `outcome`: `paid`
/// (from held leases at once), `owed` (debt, paid first from the next leases), `written_off`
/// (beyond the pool's settle debt per region: never charged).
pub const SETTLE_GLOBAL_TOKENS: &str = "allot_agent_settle_global_tokens_total";
/// Debt a pool's holder owes now, tokens, by `tenant` and `pool` (gauge).
pub const SETTLE_DEBT: &str = "allot_agent_settle_debt_tokens";
/// Debt a pool's holder may carry, tokens (`settleDebtPerRegion / region agents`), by `tenant`
/// and `pool` (gauge): the agent's share of the bound's settle-debt term.
pub const SETTLE_DEBT_LIMIT: &str = "allot_agent_settle_debt_limit_tokens";
/// Extra cost of settlements on regional rules, units, by `outcome`: `paid` (at settlement),
/// `owed` (debt), `repaid` (debt paid by a later admission), `written_off` (beyond what the
/// principal may owe, or owed too long).
pub const SETTLE_REGIONAL_UNITS: &str = "allot_agent_settle_regional_units_total";
/// Principals owing regional debt (gauge; at most `MAX_REGIONAL_DEBTORS`).
pub const REGIONAL_DEBTORS: &str = "allot_agent_regional_debtors";
/// Quota reads (`GET /v1/quota`) by `outcome` (answered, refused).
pub const QUOTA_READS: &str = "allot_agent_quota_reads_total";
/// Requests admitted from a pool's fallback allowance, by `tenant` and `pool`.
pub const FALLBACK_ADMITS: &str = "allot_agent_fallback_admits_total";
/// Lease renewals by `outcome` (granted, partial, exhausted, stale_epoch, expired, gone, failed).
pub const RENEWALS: &str = "allot_agent_renewals_total";
/// Tokens granted to this agent.
pub const TOKENS_GRANTED: &str = "allot_agent_tokens_granted_total";
/// Tokens this agent's leases left unspent, by `tenant` and `pool` (cumulative); the allocator may
/// have taken some of them back ([`TOKENS_RETURNED`]).
pub const TOKENS_STRANDED: &str = "allot_agent_tokens_stranded";
/// Tokens the allocator took back of what this agent's ended leases left unspent (grantable
/// again in their windows): not stranded after all.
pub const TOKENS_RETURNED: &str = "allot_agent_tokens_returned_total";
/// Allocator call latency, seconds, by `call`.
pub const ALLOCATOR_SECONDS: &str = "allot_agent_allocator_seconds";
/// Allocator calls that failed, by `call`.
pub const ALLOCATOR_ERRORS: &str = "allot_agent_allocator_errors_total";
/// Whether the allocator answered the last call (1) or not (0).
pub const ALLOCATOR_REACHABLE: &str = "allot_agent_allocator_reachable";
/// Each limiter shard's breaker: 0 closed, 1 half-open, 2 open, by `shard`.
pub const BREAKER_STATE: &str = "allot_agent_breaker_state";
/// The policy bundle version in force.
pub const POLICY_VERSION: &str = "allot_agent_policy_version";
/// Seconds since the bundle in force was installed.
pub const POLICY_AGE_SECONDS: &str = "allot_agent_policy_age_seconds";
/// The limiter's counters since start, by `path`: decisions, store_calls, store_retries,
/// negative_cache_hits, cardinality_refusals, fallback, unavailable, policy_errors, breaker_refusals,
/// in_flight_exhausted (waited for a place in flight in vain), shed (refused at once: the shard's
/// waiting line was full), slow_calls (overran the deadline while the shard answered others),
/// breaker_failures (calls counted against their shard's breaker), held_up (waits and calls that
/// ran out while the agent's own thread was held up: it needs CPU, not the store), coalesced
/// (decisions sent together in Redis calls of more than one) and coalesced_calls (those calls:
/// coalesced / coalesced_calls is how many decisions share a call). The paths overlap (held_up is
/// part of in_flight_exhausted and slow_calls; slow_calls counts calls, some of them retried and
/// decided; coalesced and coalesced_calls are store work, not outcomes): read each on its own,
/// never their sum.
pub const LIMITER_DECISIONS: &str = "allot_agent_limiter_decisions";
/// Each limiter shard's adaptive in-flight bound (calls), by `shard`.
pub const STORE_IN_FLIGHT_LIMIT: &str = "allot_agent_store_in_flight_limit";
/// Calls in flight to each limiter shard, by `shard`.
pub const STORE_IN_FLIGHT: &str = "allot_agent_store_in_flight";
/// Decisions waiting for a place among each shard's calls in flight, by `shard`.
pub const STORE_WAITING: &str = "allot_agent_store_waiting";
/// Tokens this agent may admit per window of a pool while cut off from the allocator:
/// `fallbackPerRegion / region agents`.
pub const FALLBACK_ALLOWANCE: &str = "allot_agent_fallback_allowance_tokens";
/// Latency of one limiter store call (a script call, each retry counted alone), seconds, by
/// `shard`.
pub const STORE_SECONDS: &str = "allot_agent_store_seconds";
/// Requests that needed a global token when the agent held none, by `tenant`, `pool` and
/// `pool_state`: `available` (the allocator had not said the pool is exhausted: the region ran dry
/// before its renewal arrived) or `exhausted`.
pub const LEASE_DEPLETIONS: &str = "allot_agent_lease_depletions_total";
/// Envoy RLS `ShouldRateLimit` calls by `code`: ok, over_limit, invalid_argument,
/// unauthenticated, unavailable, other_error.
pub const RLS_REQUESTS: &str = "allot_agent_rls_requests_total";
/// Latency of one `ShouldRateLimit` call (all its descriptors), seconds.
pub const RLS_SECONDS: &str = "allot_agent_rls_seconds";
/// Pools the agent holds terms and leases for.
pub const POOLS_HELD: &str = "allot_agent_pools";
/// Pools touched since a report round last found them settled (nothing owed, no lease live, no
/// renewal asked): the only ones the background rounds and the scrape's pool gauges visit.
pub const POOLS_BUSY: &str = "allot_agent_pools_busy";
/// Pools the background rounds looked at, by `round` (`reports`, `upkeep`): busy pools and, in
/// upkeep, settled ones due to be forgotten. An idle agent's rounds look at none.
pub const POOLS_VISITED: &str = "allot_agent_pools_visited_total";
/// Report lines dropped since start because the allocator stayed unreachable past the holders'
/// bounds (leases then show as unreported in the ledger; fallback windows go unaccounted).
pub const REPORT_LINES_DROPPED: &str = "allot_agent_report_lines_dropped";
/// State files not used at start, by file and reason (corrupt, foreign, other_region, too_large,
/// unreadable): the agent started without them.
pub const STATE_FILES_IGNORED: &str = "allot_agent_state_files_ignored_total";
/// State file writes, by file and outcome (ok, failed).
pub const STATE_WRITES: &str = "allot_agent_state_writes_total";
/// Pools whose current window's fallback allowance this run counted as used when it took them
/// up, by `tenant` and `pool`: the previous run of the agent did not end cleanly and left no
/// journal, so it may have admitted that allowance unreported.
pub const FALLBACK_PRESUMED_USED: &str = "allot_agent_fallback_presumed_used_total";
/// The agent's clock less the allocator's, ms (gauge): the middle of what the last grant exchange
/// bounds it to. Fallback windows are cut on the agent's clock within `--clock-margin-ms` of it.
pub const CLOCK_OFFSET_MS: &str = "allot_agent_clock_offset_ms";
/// Grant exchanges that showed the agent's clock certainly further off the allocator's than
/// `--clock-margin-ms`: fallback may then fall in a neighbouring window of the allocator's clock.
pub const CLOCK_BEYOND_MARGIN: &str = "allot_agent_clock_beyond_margin_total";
/// Fallback claims made durable before admitting beyond the last one, by outcome (ok, failed).
pub const FALLBACK_CLAIMS: &str = "allot_agent_fallback_claims_total";
/// What a restarted agent took over from its state directory, by what (bundle, pools, leases,
/// fallback_windows).
pub const STATE_RESTORED: &str = "allot_agent_state_restored";
/// RLQS streams open (gauge).
pub const RLQS_STREAMS: &str = "allot_agent_rlqs_streams";
/// RLQS buckets subscribed, over all streams (gauge).
pub const RLQS_BUCKETS: &str = "allot_agent_rlqs_buckets";
/// RLQS bucket actions sent, by `action` (`token_bucket`, `allow_all`, `deny_all`, `abandon`).
pub const RLQS_ACTIONS: &str = "allot_agent_rlqs_actions_total";
/// Global tokens carved into gateways' assignments, by `tenant` and `pool`.
pub const RLQS_TOKENS_SUBLEASED: &str = "allot_agent_rlqs_tokens_subleased_total";
/// Sub-leased tokens that ended unspent (stranded, never given back), by `tenant` and `pool`.
pub const RLQS_TOKENS_EXPIRED_UNUSED: &str = "allot_agent_rlqs_tokens_expired_unused_total";
/// Requests gateways reported admitted beyond every assignment they held, by `backed` (`true`:
/// spent from what the agent held; `false`: admitted without any quota behind them, an overshoot
/// term of its own).
pub const RLQS_ADMITTED_BEYOND_ASSIGNMENT: &str =
    "allot_agent_rlqs_admitted_beyond_assignment_total";
/// RLQS streams ended, by `cause`.
pub const RLQS_STREAMS_ENDED: &str = "allot_agent_rlqs_streams_ended_total";
/// Operators' rule overrides laid over the bundle in force.
pub const OVERRIDES_LAID: &str = "allot_agent_overrides_laid";
/// Overrides in force that could not be laid over the bundle (an unknown rule, amounts its
/// algorithm has not): each changes nothing and is logged.
pub const OVERRIDES_NOT_LAID: &str = "allot_agent_overrides_not_laid";
/// The version of the override set held (0: none).
pub const OVERRIDE_VERSION: &str = "allot_agent_override_version";

/// Installs the process-wide Prometheus recorder on first use and returns its handle; `None` when
/// another recorder is already installed (then pass that recorder's handle around instead). Every
/// counter and gauge of [`AT_START`] is exported from then on, at 0 until it moves.
pub fn install() -> Option<PrometheusHandle> {
    let handle = allot_net::metrics::prometheus(&[])?;
    static EXPORTED: std::sync::Once = std::sync::Once::new();
    EXPORTED.call_once(|| allot_net::metrics::export_at_zero(AT_START));
    Some(handle)
}

/// The counters and gauges whose labels are all known before anything happened, each with its
/// label values: exported at 0 from the start, so a dashboard or an alert tells 0 from absent.
/// The rest appear with their subject ([`WITH_THEIR_SUBJECT`]), and histograms with their first
/// observation ([`HISTOGRAMS`]).
pub const AT_START: &[AtStart] = &[
    AtStart::counter(DRY_RUNS, &[("outcome", &["allowed", "denied"])]),
    AtStart::counter(REPLAYED_ADMISSIONS, &[("tier", &["agent", "store"])]),
    AtStart::counter(IDEMPOTENCY_FORGOTTEN_EARLY, &[]),
    AtStart::counter(
        SETTLEMENTS,
        &[(
            "outcome",
            &[
                "exact",
                "under",
                "over",
                "expired",
                "evicted",
                "after_response",
            ],
        )],
    ),
    AtStart::gauge(OPEN_SETTLEMENTS, &[]),
    AtStart::counter(SETTLE_UNUSED_UNITS, &[]),
    AtStart::counter(
        SETTLE_REGIONAL_UNITS,
        &[("outcome", &["paid", "owed", "repaid", "written_off"])],
    ),
    AtStart::gauge(REGIONAL_DEBTORS, &[]),
    AtStart::counter(QUOTA_READS, &[("outcome", &["answered", "refused"])]),
    AtStart::counter(
        RENEWALS,
        &[(
            "outcome",
            &[
                "granted",
                "partial",
                "exhausted",
                "stale_epoch",
                "expired",
                "gone",
                "failed",
            ],
        )],
    ),
    AtStart::counter(TOKENS_GRANTED, &[]),
    AtStart::counter(TOKENS_RETURNED, &[]),
    AtStart::counter(ALLOCATOR_ERRORS, &[("call", &["terms", "grant"])]),
    AtStart::gauge(ALLOCATOR_REACHABLE, &[]),
    AtStart::gauge(POLICY_VERSION, &[]),
    AtStart::gauge(
        LIMITER_DECISIONS,
        &[(
            "path",
            &[
                "decisions",
                "store_calls",
                "store_retries",
                "negative_cache_hits",
                "cardinality_refusals",
                "fallback",
                "unavailable",
                "policy_errors",
                "breaker_refusals",
                "in_flight_exhausted",
                "shed",
                "slow_calls",
                "breaker_failures",
                "held_up",
                "coalesced",
                "coalesced_calls",
            ],
        )],
    ),
    AtStart::counter(
        RLS_REQUESTS,
        &[(
            "code",
            &[
                "ok",
                "over_limit",
                "invalid_argument",
                "unauthenticated",
                "unavailable",
                "other_error",
            ],
        )],
    ),
    AtStart::gauge(POOLS_HELD, &[]),
    AtStart::gauge(POOLS_BUSY, &[]),
    AtStart::counter(POOLS_VISITED, &[("round", &["reports", "upkeep"])]),
    AtStart::gauge(REPORT_LINES_DROPPED, &[]),
    AtStart::counter(
        STATE_FILES_IGNORED,
        &[
            (
                "file",
                &["bundle.state", "journal.state", "overrides.state"],
            ),
            (
                "reason",
                &[
                    "unreadable",
                    "too_large",
                    "foreign",
                    "other_region",
                    "corrupt",
                ],
            ),
        ],
    ),
    AtStart::counter(
        STATE_WRITES,
        &[
            (
                "file",
                &["bundle.state", "journal.state", "overrides.state"],
            ),
            ("outcome", &["ok", "failed"]),
        ],
    ),
    AtStart::counter(CLOCK_BEYOND_MARGIN, &[]),
    AtStart::counter(FALLBACK_CLAIMS, &[("outcome", &["ok", "failed"])]),
    AtStart::gauge(
        STATE_RESTORED,
        &[("what", &["bundle", "pools", "leases", "fallback_windows"])],
    ),
    AtStart::gauge(RLQS_STREAMS, &[]),
    AtStart::gauge(RLQS_BUCKETS, &[]),
    AtStart::counter(
        RLQS_ACTIONS,
        &[(
            "action",
            &["token_bucket", "allow_all", "deny_all", "abandon"],
        )],
    ),
    AtStart::counter(
        RLQS_ADMITTED_BEYOND_ASSIGNMENT,
        &[("backed", &["true", "false"])],
    ),
    AtStart::counter(
        RLQS_STREAMS_ENDED,
        &[(
            "cause",
            &["invalid_argument", "closed", "broken", "not_reading"],
        )],
    ),
    AtStart::gauge(OVERRIDES_LAID, &[]),
    AtStart::gauge(OVERRIDES_NOT_LAID, &[]),
    AtStart::gauge(OVERRIDE_VERSION, &[]),
    AtStart::counter(crate::decision_log::DROPPED, &[]),
];

/// Metrics labelled by what they are about: a tenant's pool (its counters appear at 0 when the
/// agent first holds the pool, [`pool_held`]; its gauges at the next scrape), a limiter shard, a
/// hot tenant, a rule or a bundle version (with the first decision). The policy age appears once
/// a bundle is installed, the clock offset once a grant measured it: 0 would claim either.
pub const WITH_THEIR_SUBJECT: &[&str] = &[
    DECISIONS,
    ADVISORY_DENIALS,
    HOT_TENANT_SUB_SLOTS,
    SHADOW_ADMITTED_TOKENS,
    SETTLE_GLOBAL_TOKENS,
    SETTLE_DEBT,
    SETTLE_DEBT_LIMIT,
    FALLBACK_ADMITS,
    TOKENS_STRANDED,
    BREAKER_STATE,
    POLICY_AGE_SECONDS,
    STORE_IN_FLIGHT_LIMIT,
    STORE_IN_FLIGHT,
    STORE_WAITING,
    FALLBACK_ALLOWANCE,
    LEASE_DEPLETIONS,
    FALLBACK_PRESUMED_USED,
    CLOCK_OFFSET_MS,
    RLQS_TOKENS_SUBLEASED,
    RLQS_TOKENS_EXPIRED_UNUSED,
];

/// Histograms: they appear with their first observation.
pub const HISTOGRAMS: &[&str] = &[ALLOCATOR_SECONDS, STORE_SECONDS, RLS_SECONDS];

/// The gauges of `tenant`'s pool `pool` as its `holder` stands: set at each scrape while the pool
/// is busy, and once more when it settles (they then stay as they are until it is touched).
pub fn set_pool_gauges(
    tenant: &allot_shared::ids::TenantId,
    pool: &allot_shared::ids::PoolId,
    holder: &crate::global::PoolHolder,
) {
    let (tenant, pool) = (tenant.to_string(), pool.to_string());
    metrics::gauge!(TOKENS_STRANDED, "tenant" => tenant.clone(), "pool" => pool.clone())
        .set(holder.stranded_tokens() as f64);
    metrics::gauge!(FALLBACK_ALLOWANCE, "tenant" => tenant.clone(), "pool" => pool.clone())
        .set(holder.config().fallback_per_region_tokens as f64);
    metrics::gauge!(SETTLE_DEBT, "tenant" => tenant.clone(), "pool" => pool.clone())
        .set(holder.debt_tokens() as f64);
    metrics::gauge!(SETTLE_DEBT_LIMIT, "tenant" => tenant, "pool" => pool)
        .set(holder.config().settle_debt_tokens as f64);
}

/// The counters of a pool the agent now holds, at 0 (unless they count already).
pub fn pool_held(tenant: &allot_shared::ids::TenantId, pool: &allot_shared::ids::PoolId) {
    let (tenant, pool) = (tenant.to_string(), pool.to_string());
    for name in [
        FALLBACK_ADMITS,
        SHADOW_ADMITTED_TOKENS,
        FALLBACK_PRESUMED_USED,
        RLQS_TOKENS_SUBLEASED,
        RLQS_TOKENS_EXPIRED_UNUSED,
    ] {
        metrics::counter!(name, "tenant" => tenant.clone(), "pool" => pool.clone()).increment(0);
    }
    for state in ["available", "exhausted"] {
        metrics::counter!(LEASE_DEPLETIONS,
            "tenant" => tenant.clone(), "pool" => pool.clone(), "pool_state" => state)
        .increment(0);
    }
    for outcome in ["paid", "owed", "written_off"] {
        metrics::counter!(SETTLE_GLOBAL_TOKENS,
            "tenant" => tenant.clone(), "pool" => pool.clone(), "outcome" => outcome)
        .increment(0);
    }
}

/// Most label sets [`DecisionCounters`] keeps handles for (I10): outcomes x scopes x reasons x
/// rules x bundle versions seen; past it, labels are built on each decision (correct, slower).
pub const MAX_DECISION_COUNTERS: usize = 4_096;

/// The fixed labels of a decision: outcome, scope, reason, policy version.
type DecisionLabels = (&'static str, &'static str, &'static str, u64);
/// Counter handles by rule id.
type CountersByRule = std::collections::HashMap<String, metrics::Counter>;

/// The handles of [`DECISIONS`] by label set, so that counting a decision neither formats nor
/// allocates its labels (the registry lookup and the label strings cost more than the rest of a
/// lease-only decision). Handles are made on first use, after the recorder is installed.
#[derive(Debug, Default)]
pub struct DecisionCounters {
    /// `(outcome, scope, reason, policy version)` -> rule -> counter.
    handles: std::sync::RwLock<std::collections::HashMap<DecisionLabels, CountersByRule>>,
    /// Handles kept, over all label sets.
    kept: std::sync::atomic::AtomicUsize,
}

impl DecisionCounters {
    /// The counter of one label set.
    pub fn counter(
        &self,
        outcome: &'static str,
        scope: &'static str,
        reason: &'static str,
        rule: &str,
        policy_version: u64,
    ) -> metrics::Counter {
        let key = (outcome, scope, reason, policy_version);
        {
            let handles = self
                .handles
                .read()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            if let Some(counter) = handles.get(&key).and_then(|rules| rules.get(rule)) {
                return counter.clone();
            }
        }
        let counter = metrics::counter!(DECISIONS,
            "outcome" => outcome,
            "scope" => scope,
            "reason" => reason,
            "rule" => rule.to_owned(),
            "policy_version" => policy_version.to_string());
        use std::sync::atomic::Ordering;
        if self.kept.load(Ordering::Relaxed) < MAX_DECISION_COUNTERS {
            let mut handles = self
                .handles
                .write()
                .unwrap_or_else(std::sync::PoisonError::into_inner);
            let rules = handles.entry(key).or_default();
            if !rules.contains_key(rule) {
                rules.insert(rule.to_owned(), counter.clone());
                self.kept.fetch_add(1, Ordering::Relaxed);
            }
        }
        counter
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Every metric name the module declares (its `pub const ...: &str = "allot_..."` lines).
    fn declared(source: &str) -> Vec<String> {
        source
            .lines()
            .filter_map(|line| line.trim().strip_prefix("pub const "))
            .filter_map(|line| line.split_once(": &str = \"")?.1.split_once('"'))
            .map(|(name, _)| name.to_owned())
            .filter(|name| name.starts_with("allot_"))
            .collect()
    }

    #[test]
    fn every_counter_and_gauge_is_exported_from_the_start_at_zero() {
        let handle = install().expect("the recorder");
        let rendered = handle.render();
        for metric in AT_START {
            for labels in metric.label_sets() {
                let shown: Vec<String> = labels
                    .iter()
                    .map(|l| format!("{}=\"{}\"", l.key(), l.value()))
                    .collect();
                let series = if shown.is_empty() {
                    metric.name.to_owned()
                } else {
                    format!("{}{{{}}}", metric.name, shown.join(","))
                };
                assert!(
                    rendered.lines().any(|line| line == format!("{series} 0")),
                    "{series} is exported at 0 from the start:\n{rendered}"
                );
            }
        }
        // And every metric declared is exported at start, or documented as appearing later.
        let later: Vec<&str> = WITH_THEIR_SUBJECT
            .iter()
            .chain(HISTOGRAMS)
            .copied()
            .collect();
        for name in [include_str!("metrics.rs"), include_str!("decision_log.rs")]
            .iter()
            .flat_map(|source| declared(source))
        {
            let at_start = AT_START.iter().any(|metric| metric.name == name);
            assert!(
                at_start != later.contains(&name.as_str()),
                "{name}: exported at start, or listed as appearing with its subject or first \
                 observation (exactly one)"
            );
        }
    }
}
