//! Human tables for `allotctl`: every answer is read into the API's own type (the one the server
//! serialises) before it is shown, so a changed or foreign answer is a clear error, never a table of
//! dashes.

use std::fmt::Write as _;

use allot_shared::policy::{PolicyBundle, parse_bundle};
use allot_shared::window::rfc3339_utc;
use allot_shared::wire::{GrantAnswer, ShardMap};
use serde::de::DeserializeOwned;
use serde_json::Value;

use crate::http::{
    AuditList, MintAnswer, OverrideList, PolicyStatus, PoolList, PoolView, TokenList, WindowList,
};
use crate::ledger::BoundCheckSummary;
use crate::overrides::Override;
use crate::policies::Rollout;

/// What an API call answers.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Answer {
    /// `GET /v1/pools`.
    Pools,
    /// `PUT` or `GET /v1/pools/{tenant}/{pool}`.
    Pool,
    /// `POST /v1/pools/bulk` (its totals, summed over every call of a file).
    Bulk,
    /// `GET /v1/pools/{tenant}/{pool}/windows`.
    Windows,
    /// `GET /v1/tokens`.
    Tokens,
    /// `POST /v1/tokens`.
    Minted,
    /// `GET /v1/audit`.
    Audit,
    /// `GET /v1/bound-checks`.
    BoundChecks,
    /// `PUT /v1/policies`, `GET /v1/policies/{version}`, `POST /v1/policies/{version}/rollback`.
    Bundle,
    /// `POST /v1/policies/{version}/promote`.
    Rollout,
    /// `GET /v1/policies/status`.
    PolicyStatus,
    /// `POST /v1/grants`.
    Grant,
    /// `GET /v1/shards`.
    Shards,
    /// `GET /v1/overrides`.
    Overrides,
    /// `POST /v1/overrides`, `GET` or `DELETE /v1/overrides/{tenant}/{id}`.
    Override,
    /// An empty answer (deletions, revocations).
    Nothing,
}

impl Answer {
    /// What the answer is called in an error.
    fn noun(self) -> &'static str {
        match self {
            Self::Pools => "a pool list",
            Self::Pool => "a pool",
            Self::Bulk => "a bulk write's outcome",
            Self::Windows => "a window list",
            Self::Tokens => "a token list",
            Self::Minted => "a minted token",
            Self::Audit => "an audit list",
            Self::BoundChecks => "a bound check summary",
            Self::Shards => "a shard map",
            Self::Overrides => "an override list",
            Self::Override => "an override",
            Self::Bundle => "a policy bundle",
            Self::Rollout => "a rollout",
            Self::PolicyStatus => "a policy status",
            Self::Grant => "a grant",
            Self::Nothing => "an empty answer",
        }
    }
}

/// Renders `value`, the answer to a call that answers `answer`, for humans; an answer that is not
/// of its type is an error naming what was expected.
pub fn render(answer: Answer, value: &Value) -> Result<String, String> {
    Ok(match answer {
        Answer::Pools => {
            let list = read::<PoolList>(answer, value)?;
            let mut text = pools_table(&list.pools);
            if let Some(next) = &list.next {
                text.push_str(&format!("more: the next page is --after {next}\n"));
            }
            text
        }
        Answer::Pool => pool_detail(&read::<PoolView>(answer, value)?),
        Answer::Bulk => {
            let total = read::<BulkTotals>(answer, value)?;
            format!(
                "created {}, updated {}, unchanged {}\n",
                total.created, total.updated, total.unchanged
            )
        }
        Answer::Windows => windows_table(&read::<WindowList>(answer, value)?),
        Answer::Tokens => tokens_table(&read::<TokenList>(answer, value)?),
        Answer::Minted => minted(&read::<MintAnswer>(answer, value)?),
        Answer::Audit => audit_table(&read::<AuditList>(answer, value)?),
        Answer::BoundChecks => bound_checks(&read::<BoundCheckSummary>(answer, value)?),
        Answer::Bundle => bundle_line(&read_bundle(value)?),
        Answer::Rollout => format!("{}\n", rollout_line(&read::<Rollout>(answer, value)?)),
        Answer::PolicyStatus => policy_status(&read::<PolicyStatus>(answer, value)?),
        Answer::Grant => grant_lines(&read::<GrantAnswer>(answer, value)?),
        Answer::Shards => shards_table(&read::<ShardMap>(answer, value)?),
        Answer::Overrides => {
            let list = read::<OverrideList>(answer, value)?;
            let mut text = overrides_table(&list.overrides);
            if let Some(next) = &list.next {
                text.push_str(&format!("more: the next page is --after {next}\n"));
            }
            text
        }
        Answer::Override => overrides_table(&[read::<Override>(answer, value)?]),
        Answer::Nothing => "ok\n".to_owned(),
    })
}

/// The totals of a bulk write.
#[derive(serde::Deserialize)]
struct BulkTotals {
    created: u64,
    updated: u64,
    unchanged: u64,
}

fn read<T: DeserializeOwned>(answer: Answer, value: &Value) -> Result<T, String> {
    T::deserialize(value).map_err(|e| {
        format!(
            "the allocator's answer is not {}: {e} (--json shows it as it came)",
            answer.noun()
        )
    })
}

fn read_bundle(value: &Value) -> Result<PolicyBundle, String> {
    parse_bundle(&value.to_string())
        .and_then(|draft| draft.into_verified())
        .map_err(|e| format!("the allocator's answer is not a verified policy bundle: {e}"))
}

const POOL_HEADER: &str = "tenant                   pool                          limit  window                    chunk fallback  version  regions";

fn pool_row(out: &mut String, pool: &PoolView) {
    let _ = writeln!(
        out,
        "{:<24} {:<24} {:>10}  {:<22} {:>8} {:>8} {:>8}  {}",
        pool.tenant.as_str(),
        pool.pool.as_str(),
        pool.spec.limit_tokens,
        pool.spec.window_text(),
        pool.spec.chunk_tokens,
        pool.spec.fallback_per_region_tokens,
        pool.version,
        pool.spec
            .regions
            .iter()
            .map(|r| r.as_str())
            .collect::<Vec<_>>()
            .join(",")
    );
}

fn pools_table(pools: &[PoolView]) -> String {
    let mut out = format!("{POOL_HEADER}\n");
    for pool in pools {
        pool_row(&mut out, pool);
    }
    out
}

fn pool_detail(pool: &PoolView) -> String {
    let mut out = pools_table(std::slice::from_ref(pool));
    let _ = writeln!(
        out,
        "version {}, lease ttl {} ms, updated {}",
        pool.version,
        pool.spec.lease_ttl_ms,
        rfc3339_utc(pool.updated_at_ms)
    );
    if let Some(window) = &pool.window {
        let granted = window
            .granted_tokens_by_region
            .iter()
            .map(|(region, tokens)| format!("{region} {tokens}"))
            .collect::<Vec<_>>();
        let _ = writeln!(
            out,
            "window {} to {}: {} tokens left, {} leases outstanding, granted: {}",
            rfc3339_utc(window.window_start_ms),
            rfc3339_utc(window.window_end_ms),
            window.remaining_tokens,
            window.leases_outstanding,
            if granted.is_empty() {
                "none".to_owned()
            } else {
                granted.join(", ")
            }
        );
    }
    out
}

fn windows_table(list: &WindowList) -> String {
    // Pools with metered requests show what they owed and wrote off; others keep the short table.
    let metered = list
        .windows
        .iter()
        .any(|w| w.settle_debt_tokens > 0 || w.written_off_tokens > 0);
    let mut out = String::new();
    let _ = write!(
        out,
        "{:<24} {:>8} {:>8} {:>8} {:>9} {:>10} {:>9} {:>9} {:>7}",
        "window start",
        "limit",
        "granted",
        "spent",
        "stranded",
        "unreported",
        "fallback",
        "overshoot",
        "bound"
    );
    if metered {
        let _ = write!(out, " {:>7} {:>11}", "debt", "written off");
    }
    out.push('\n');
    for window in &list.windows {
        let _ = write!(
            out,
            "{:<24} {:>8} {:>8} {:>8} {:>9} {:>10} {:>9} {:>9} {:>7}",
            rfc3339_utc(window.window_start_ms),
            window.limit_tokens,
            window.granted_tokens,
            window.spent_tokens,
            window.stranded_tokens,
            window.unreported_tokens,
            window.fallback_admitted_tokens,
            window.overshoot_tokens,
            window.bound_tokens
        );
        if metered {
            let _ = write!(
                out,
                " {:>7} {:>11}",
                window.settle_debt_tokens, window.written_off_tokens
            );
        }
        out.push('\n');
    }
    out
}

fn tokens_table(list: &TokenList) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<22} {:<8} {:<10} {:<6} name",
        "id", "role", "region", "source"
    );
    for token in &list.tokens {
        let _ = writeln!(
            out,
            "{:<22} {:<8} {:<10} {:<6} {}",
            token.id,
            token.role,
            token.region.as_ref().map_or("*", |r| r.as_str()),
            token.source,
            token.name
        );
    }
    out
}

/// Overrides, one a line: what they limit, to what, until when, and why.
fn overrides_table(overrides: &[Override]) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<36} {:<12} {:<28} {:<30} {:<20} reason",
        "id", "tenant", "limits", "to", "until"
    );
    for o in overrides {
        let what = match (&o.pool, &o.rule, &o.principal) {
            (Some(pool), _, _) => format!("pool {pool}"),
            (_, Some(rule), Some(p)) => format!("rule {rule} for {}", p.hash),
            (_, Some(rule), None) => format!("rule {rule}"),
            _ => "?".to_owned(),
        };
        let amounts = [
            ("limit", o.limit),
            ("capacityMillis", o.capacity_millis),
            ("refillMillis", o.refill_millis),
        ]
        .iter()
        .filter_map(|(name, value)| value.map(|v| format!("{name} {v}")))
        .collect::<Vec<_>>()
        .join(", ");
        let until = o
            .expires_at_ms
            .map_or_else(|| "until ended".to_owned(), rfc3339_utc);
        let _ = writeln!(
            out,
            "{:<36} {:<12} {:<28} {:<30} {:<20} {}",
            o.id, o.tenant, what, amounts, until, o.reason
        );
    }
    out
}

fn minted(answer: &MintAnswer) -> String {
    format!(
        "minted {} ({}{}); the token is shown only now:\n{}\n",
        answer.view.id,
        answer.view.role,
        answer
            .view
            .region
            .as_ref()
            .map(|r| format!(", region {r}"))
            .unwrap_or_default(),
        answer.token
    )
}

fn audit_table(list: &AuditList) -> String {
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{:<24} {:<28} {:<15} {:<24} {:>7}  detail",
        "at", "actor", "action", "target", "version"
    );
    for entry in &list.entries {
        let _ = writeln!(
            out,
            "{:<24} {:<28} {:<15} {:<24} {:>7}  {}",
            rfc3339_utc(entry.at_ms),
            entry.actor,
            entry.action,
            entry.target,
            entry.version,
            entry.detail
        );
    }
    out
}

/// Who leads each shard, and how many each allocator leads.
fn shards_table(map: &ShardMap) -> String {
    let mut out = format!("{} shards\n", map.shard_count);
    let _ = writeln!(out, "{:>5}  {:<24} {:>6}  url", "shard", "leader", "epoch");
    for lead in &map.shards {
        match &lead.leader {
            Some(leader) => {
                let _ = writeln!(
                    out,
                    "{:>5}  {:<24} {:>6}  {}",
                    lead.shard, leader.node_id, leader.epoch, leader.url
                );
            }
            None => {
                let _ = writeln!(
                    out,
                    "{:>5}  {:<24} {:>6}  -",
                    lead.shard, "(none: changing hands)", "-"
                );
            }
        }
    }
    for (node, count) in map.led_by() {
        let _ = writeln!(out, "{node} leads {count}");
    }
    out
}

fn bound_checks(summary: &BoundCheckSummary) -> String {
    let mut out = format!(
        "{} windows checked against their bound, {} over it\n",
        summary.windows_checked, summary.violations
    );
    if summary.recent_violations.is_empty() {
        return out;
    }
    let _ = writeln!(
        out,
        "{:<24} {:<16} {:<16} {:>10} {:>10} {:>14} regions over their fallback allowance",
        "window start", "tenant", "pool", "admitted", "bound", "over allowance"
    );
    for violation in &summary.recent_violations {
        let _ = writeln!(
            out,
            "{:<24} {:<16} {:<16} {:>10} {:>10} {:>14} {}",
            rfc3339_utc(violation.window_start_ms),
            violation.tenant,
            violation.pool,
            violation.admitted,
            violation.bound,
            violation.fallback_over_allowance,
            violation.regions_over_allowance.join(",")
        );
    }
    out
}

fn bundle_line(bundle: &PolicyBundle) -> String {
    format!(
        "bundle version {} ({} rules), {}, published {}\n",
        bundle.version(),
        bundle.rules().len(),
        bundle.checksum(),
        bundle.published_at().unwrap_or("-")
    )
}

fn rollout_line(rollout: &Rollout) -> String {
    let canary = rollout
        .canary
        .as_ref()
        .map(|canary| {
            let regions = canary
                .regions
                .iter()
                .map(|r| r.as_str())
                .collect::<Vec<_>>()
                .join(",");
            format!(", canary v{} in {regions}", canary.version)
        })
        .unwrap_or_default();
    format!(
        "current v{}, latest v{}{canary}",
        rollout.current, rollout.latest
    )
}

fn policy_status(status: &PolicyStatus) -> String {
    let mut out = format!("{}\n", rollout_line(&status.rollout));
    let _ = writeln!(out, "agents behind: {}", status.agents_behind);
    for agent in &status.agents {
        let _ = writeln!(
            out,
            "  {:<8} {:<36} v{}",
            agent.region.as_str(),
            agent.agent_id.as_str(),
            agent.version
        );
    }
    for (region, fingerprints) in &status.pepper_fingerprints {
        if fingerprints.len() > 1 {
            let _ = writeln!(
                out,
                "region {region}: agents key principals with {} different peppers",
                fingerprints.len()
            );
        }
    }
    out
}

fn grant_lines(grant: &GrantAnswer) -> String {
    if grant.granted_tokens == 0 {
        return format!(
            "nothing granted: the pool is exhausted for {} ms (lease {})\n",
            grant.retry_after_ms, grant.lease_id
        );
    }
    format!(
        "granted {} tokens to {} (lease {}, epoch {})\nspend before {}; window {} to {}\n",
        grant.granted_tokens,
        grant.region,
        grant.lease_id,
        grant.epoch,
        rfc3339_utc(grant.expires_at_ms),
        rfc3339_utc(grant.window_start_ms),
        rfc3339_utc(grant.window_end_ms)
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn pools_and_windows_render_as_tables() {
        let pools = json!({ "pools": [{ "tenant": "atlas", "pool": "api", "limit": 1000, "windowMs": 60000,
            "chunk": 100, "leaseTtlMs": 15000, "fallbackPerRegion": 0, "regions": ["eu", "us"],
            "version": 3, "updatedAtMs": 0 }] });
        let text = render(Answer::Pools, &pools).expect("a pool list");
        assert!(
            text.lines()
                .nth(1)
                .is_some_and(|l| l.starts_with("atlas") && l.ends_with("eu,us")),
            "{text}"
        );
        let windows = json!({ "windows": [{ "windowStartMs": 0, "windowEndMs": 60000, "limit": 1000,
            "granted": 900, "grantedByRegion": {}, "spent": 850, "stranded": 50, "unreported": 0,
            "fallbackAdmitted": 0, "fallbackAdmittedByRegion": {}, "admitted": 850, "overshoot": 0,
            "bound": 1200 }] });
        let text = render(Answer::Windows, &windows).expect("a window list");
        assert!(text.contains("1970-01-01T00:00:00.000Z"), "{text}");
        assert!(text.contains("1200"), "{text}");
        assert_eq!(render(Answer::Nothing, &Value::Null).as_deref(), Ok("ok\n"));
    }

    #[test]
    fn a_violation_names_the_regions_over_their_allowance() {
        let summary = json!({ "windowsChecked": 4, "violations": 1, "recentViolations": [{
            "tenant": "atlas", "pool": "api", "windowStartMs": 0, "windowEndMs": 6000,
            "admitted": 60, "bound": 1036, "fallbackOverAllowance": 12,
            "regionsOverAllowance": ["ap"], "checkedAtMs": 7000 }] });
        let text = render(Answer::BoundChecks, &summary).expect("a summary");
        let row = text.lines().nth(2).expect("a violation row");
        assert!(
            row.contains("1036") && row.trim_end().ends_with("12 ap"),
            "{text}"
        );
    }

    #[test]
    fn an_answer_of_another_type_is_an_error_naming_the_expected_one() {
        let pools = json!({ "pools": [] });
        let error = render(Answer::Windows, &pools).expect_err("not a window list");
        assert!(error.contains("not a window list"), "{error}");
        let error = render(Answer::Grant, &json!({ "granted": "lots" })).expect_err("not a grant");
        assert!(error.contains("not a grant"), "{error}");
    }

    #[test]
    fn a_shard_map_shows_each_leader_and_a_shard_without_one() {
        let map = json!({ "shardCount": 3, "shards": [
            { "shard": 0, "leader": { "nodeId": "alloc-a", "url": "http://a:7600", "epoch": 7 } },
            { "shard": 1 },
            { "shard": 2, "leader": { "nodeId": "alloc-a", "url": "http://a:7600", "epoch": 9 } } ] });
        let text = render(Answer::Shards, &map).expect("a shard map");
        assert!(text.starts_with("3 shards\n"), "{text}");
        assert!(text.contains("changing hands"), "{text}");
        assert!(text.trim_end().ends_with("alloc-a leads 2"), "{text}");
        assert!(render(Answer::Shards, &json!({ "shards": "none" })).is_err());
    }

    #[test]
    fn an_exhausted_grant_says_when_to_ask_again() {
        let grant = json!({ "leaseId": "018f0a6e-0000-7000-8000-000000000001", "region": "eu",
            "granted": 0, "epoch": 4, "windowStartMs": 0, "windowEndMs": 60000, "expiresAtMs": 0,
            "retryAfterMs": 1234 });
        let text = render(Answer::Grant, &grant).expect("a grant");
        assert!(text.contains("exhausted for 1234 ms"), "{text}");
    }
}
