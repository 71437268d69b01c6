//! Prometheus metrics of the allocator.
//!
//! Label values are bounded sets only: outcomes, and tenant and pool ids (configured by operators,
//! validated charset). Never principals, tokens or lease ids.

use allot_net::metrics::AtStart;
use metrics_exporter_prometheus::PrometheusHandle;

/// Webhook crossings found, by `outcome`: `recorded` (queued for delivery) or `dropped` (the queue
/// was full).
pub const WEBHOOK_EVENTS: &str = "allot_webhook_events_total";
/// Webhook delivery attempts, by `outcome`: `delivered`, `retried` or `failed` (the last attempt).
pub const WEBHOOK_DELIVERIES: &str = "allot_webhook_deliveries_total";
/// Webhook events awaiting delivery.
pub const WEBHOOK_PENDING: &str = "allot_webhook_pending_events";
/// Grant requests by outcome: `granted`, `partial`, `exhausted`, `not_leader`, `unknown_pool`,
/// `refused`, `overloaded`, `unavailable`.
pub const GRANTS: &str = "allot_grants_total";
/// Tokens granted.
pub const TOKENS_GRANTED: &str = "allot_tokens_granted_total";
/// Tokens taken back from leases that ended unspent (grantable again in their window).
pub const TOKENS_RETURNED: &str = "allot_tokens_returned_total";
/// Grant latency, seconds, as seen by the API.
pub const GRANT_SECONDS: &str = "allot_grant_seconds";
/// Grants of one pool committed together.
pub const GRANT_BATCH: &str = "allot_grant_batch_size";
/// Pool commits merged into one store transaction.
pub const POOLS_PER_TXN: &str = "allot_pools_per_txn";
/// Cold pools whose configuration and window were read together in one store read.
pub const POOLS_PER_LOAD: &str = "allot_pools_per_load";
/// Store operations that failed, by `op`.
pub const STORE_ERRORS: &str = "allot_store_errors_total";
/// This node's epoch while it leads, 0 otherwise.
pub const LEADER_EPOCH: &str = "allot_leader_epoch";
/// 1 while this node leads shard 0 (with one shard, every pool; with several, also the store's
/// once-a-round duties); `allot_leader_epoch` is that shard's epoch.
pub const IS_LEADER: &str = "allot_is_leader";
/// How many shards this node leads.
pub const SHARDS_LED: &str = "allot_shards_led";
/// Tokens not yet granted in the current window, by `tenant` and `pool`.
pub const POOL_REMAINING: &str = "allot_pool_remaining_tokens";
/// Committed grants the ledger feed could not take (reconciliation copies them later).
pub const LEDGER_FEED_FULL: &str = "allot_ledger_feed_full_total";
/// Ledger rounds that read the store's grant records to copy those the ledger lacks: a new lead,
/// or a feed that missed grants (full, or the ledger refused them). A round reads none otherwise.
pub const LEDGER_RECONCILIATIONS: &str = "allot_ledger_reconciliations_total";
/// Changes applied whose ledger or audit record could not be written (each also logged as an error).
pub const AUDIT_WRITE_FAILURES: &str = "allot_audit_write_failures_total";
/// Stored token records this allocator could not read at its last refresh (skipped).
pub const TOKEN_RECORDS_UNREADABLE: &str = "allot_token_records_unreadable";
/// API calls refused for their credentials, by `status` (401, 403).
pub const AUTH_REFUSALS: &str = "allot_auth_refusals_total";
/// Distinct pepper fingerprints among a region's live agents, by `region` (more than 1: the
/// region's agents key principals differently; expected only during a pepper rotation).
pub const REGION_PEPPER_FINGERPRINTS: &str = "allot_region_pepper_fingerprints";
/// The bundle version every region should run (the rollout's current version).
pub const POLICY_CURRENT_VERSION: &str = "allot_policy_current_version";
/// Tokens admitted in a pool's latest settled window, by `tenant` and `pool` (from the ledger:
/// spent from leases plus fallback admits).
pub const WINDOW_ADMITTED: &str = "allot_pool_window_admitted_tokens";
/// The stated bound of that window (G + carry-over + fallback terms), by `tenant` and `pool`.
pub const WINDOW_BOUND: &str = "allot_pool_window_bound_tokens";
/// Each etcd member's database file, bytes (`member`: its id in hex), from the leader's upkeep.
pub const ETCD_DB_SIZE: &str = "allot_etcd_db_size_bytes";
/// The part of each etcd member's database in use, bytes (the rest is freed by defragmenting).
pub const ETCD_DB_IN_USE: &str = "allot_etcd_db_in_use_bytes";
/// Each etcd member's quota, bytes: past it etcd refuses writes (`NOSPACE`).
pub const ETCD_DB_QUOTA: &str = "allot_etcd_db_quota_bytes";
/// Compactions of etcd's key history the leader made.
pub const ETCD_COMPACTIONS: &str = "allot_etcd_compactions_total";
/// etcd members the leader defragmented.
pub const ETCD_DEFRAGMENTATIONS: &str = "allot_etcd_defragmentations_total";
/// Upkeep rounds that failed (no member answered, or a compaction was refused).
pub const ETCD_HOUSEKEEPING_FAILURES: &str = "allot_etcd_housekeeping_failures_total";
/// Rows the ledger's retention removed, by table.
pub const LEDGER_ROWS_REMOVED: &str = "allot_ledger_rows_removed_total";
/// Windows whose raw rows the ledger rolled up into one row a region (and removed).
pub const LEDGER_WINDOWS_ROLLED_UP: &str = "allot_ledger_windows_rolled_up_total";
/// Pools the leader's last ledger round found with windows to check or publish (a window with
/// figures that ended within the re-check span, or has not ended): the only ones it visits.
pub const LEDGER_ROUND_POOLS_ACTIVE: &str = "allot_ledger_round_pools_active";
/// Windows checked against their overshoot bound once they settled (each window once, ledger-wide).
pub const BOUND_WINDOWS_CHECKED: &str = "allot_bound_windows_checked_total";
/// Checked windows that broke their bound: admitted more than it, or a region admitted more than
/// its fallback allowance. The design's promise broken (page).
pub const BOUND_VIOLATIONS: &str = "allot_bound_violations_total";
/// Windows in which a region's agents together admitted more fallback than the region's
/// allowance, by `region` (each such window once): agents each taking a larger share than the
/// region's agent count leaves them (`--region-agents` too low), or agents sharing an id.
pub const FALLBACK_OVER_ALLOWANCE: &str = "allot_region_fallback_over_allowance_total";
/// Violations the ledger holds, over all time and every allocator (gauge, set by the leader).
pub const BOUND_VIOLATIONS_RECORDED: &str = "allot_bound_violations_recorded";
/// Tokens admitted beyond G in that window, by `tenant` and `pool`.
pub const WINDOW_OVERSHOOT: &str = "allot_pool_window_overshoot_tokens";
/// Agent runs that started after a run of the same agent that did not end cleanly (a crash, or a
/// stop with fallback admits unreported), by `region`: each counts its start window's fallback
/// allowance as used.
pub const AGENT_UNCLEAN_RESTARTS: &str = "allot_agent_unclean_restarts_total";

/// The process-wide Prometheus recorder (installed on first use, `allot_net::metrics`) and its
/// handle for `/metrics`: the grant batch, pools-per-transaction and pools-per-load sizes count
/// items. Every counter and gauge of [`AT_START`] is exported from then on, at 0 until it moves.
pub fn handle() -> Option<PrometheusHandle> {
    let handle = allot_net::metrics::prometheus(&[GRANT_BATCH, POOLS_PER_TXN, POOLS_PER_LOAD])?;
    static EXPORTED: std::sync::Once = std::sync::Once::new();
    EXPORTED.call_once(|| allot_net::metrics::export_at_zero(AT_START));
    Some(handle)
}

/// The counters and gauges whose labels are all known before anything happened, each with its
/// label sets: exported at 0 from the start, so a dashboard or an alert tells 0 from absent.
/// The rest appear with their subject ([`WITH_THEIR_SUBJECT`]), and histograms with their first
/// observation ([`HISTOGRAMS`]).
pub const AT_START: &[AtStart] = &[
    AtStart::counter(WEBHOOK_EVENTS, &[("outcome", &["recorded", "dropped"])]),
    AtStart::counter(
        WEBHOOK_DELIVERIES,
        &[("outcome", &["delivered", "retried", "failed"])],
    ),
    AtStart::gauge(WEBHOOK_PENDING, &[]),
    AtStart::counter(
        GRANTS,
        &[(
            "outcome",
            &[
                "granted",
                "partial",
                "exhausted",
                "not_leader",
                "unknown_pool",
                "refused",
                "overloaded",
                "unavailable",
            ],
        )],
    ),
    AtStart::counter(TOKENS_GRANTED, &[]),
    AtStart::counter(TOKENS_RETURNED, &[]),
    AtStart::counter(STORE_ERRORS, &[("op", &["grant_txn"])]),
    AtStart::gauge(LEADER_EPOCH, &[]),
    AtStart::gauge(IS_LEADER, &[]),
    AtStart::gauge(SHARDS_LED, &[]),
    AtStart::counter(LEDGER_FEED_FULL, &[]),
    AtStart::counter(LEDGER_RECONCILIATIONS, &[]),
    AtStart::counter(AUDIT_WRITE_FAILURES, &[]),
    AtStart::gauge(TOKEN_RECORDS_UNREADABLE, &[]),
    AtStart::counter(AUTH_REFUSALS, &[("status", &["401", "403"])]),
    AtStart::gauge(POLICY_CURRENT_VERSION, &[]),
    AtStart::counter(ETCD_COMPACTIONS, &[]),
    AtStart::counter(ETCD_DEFRAGMENTATIONS, &[]),
    AtStart::counter(ETCD_HOUSEKEEPING_FAILURES, &[]),
    AtStart::counter(
        LEDGER_ROWS_REMOVED,
        &[(
            "table",
            &[
                "lease_reports",
                "window_amounts",
                "bound_checks",
                "agent_sessions",
                "lease_spend",
                "grants",
                "fallback_admits",
                "shadow_admits",
                "settle_debts",
                "written_off",
            ],
        )],
    ),
    AtStart::counter(LEDGER_WINDOWS_ROLLED_UP, &[]),
    AtStart::gauge(LEDGER_ROUND_POOLS_ACTIVE, &[]),
    AtStart::counter(BOUND_WINDOWS_CHECKED, &[]),
    AtStart::counter(BOUND_VIOLATIONS, &[]),
    AtStart::gauge(BOUND_VIOLATIONS_RECORDED, &[]),
];

/// Metrics labelled by what they are about (a tenant's pool, a region, an etcd member): each
/// appears, at 0 where it counts, once its subject is first seen. The region counters appear for
/// every region a pool names at the leader's first ledger round.
pub const WITH_THEIR_SUBJECT: &[&str] = &[
    POOL_REMAINING,
    REGION_PEPPER_FINGERPRINTS,
    WINDOW_ADMITTED,
    WINDOW_BOUND,
    WINDOW_OVERSHOOT,
    ETCD_DB_SIZE,
    ETCD_DB_IN_USE,
    ETCD_DB_QUOTA,
    FALLBACK_OVER_ALLOWANCE,
    AGENT_UNCLEAN_RESTARTS,
];

/// Histograms: they appear with their first observation.
pub const HISTOGRAMS: &[&str] = &[GRANT_SECONDS, GRANT_BATCH, POOLS_PER_TXN, POOLS_PER_LOAD];

/// The region counters of `region` at 0 (unless they count already): called for every region a
/// pool names, so a region's counters are there before anything happens in it.
pub fn region_named(region: &allot_shared::ids::RegionId) {
    for name in [FALLBACK_OVER_ALLOWANCE, AGENT_UNCLEAN_RESTARTS] {
        metrics::counter!(name, "region" => region.to_string()).increment(0);
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
        let handle = handle().expect("the recorder");
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
        for name in [include_str!("metrics.rs")]
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
