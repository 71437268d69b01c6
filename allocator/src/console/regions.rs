//! Regions and their agents: which agents report, what bundle each runs against what its region
//! should run (a canary's progress), and whether a region's agents agree on their pepper. Below
//! them, the allocators: which leads each shard of the pools.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use maud::{Markup, html};

use super::layout::{Section, html_response, problem_banner, utc};
use super::{ConsoleState, SignedIn};
use crate::http::{PolicyStatus, RegionList};
use allot_shared::wire::ShardMap;

/// An agent whose last status is older than this is shown as late (agents report every few
/// seconds; their status keys expire soon after they stop).
const LATE_AFTER_MS: u64 = 15_000;

/// The regions page's status: the rollout's cards, a row per region (its agents, pools, fallback,
/// the version it should run and its peppers) and a row per agent.
///
/// Long by design: it is one `html!` template whose cards and tables all read the same rollout (the
/// version each region should run, whether each agent is current), its region rows being the list
/// merged above it from the agents and the ledger; split, the rollout and that list would be passed
/// to every part.
fn status_fragment(status: &PolicyStatus, ledger: &RegionList, now_ms: u64) -> Markup {
    let mut regions: Vec<_> = status
        .agents
        .iter()
        .map(|a| a.region.clone())
        .chain(ledger.regions.iter().map(|r| r.region.clone()))
        .collect();
    regions.sort();
    regions.dedup();
    let rollout = &status.rollout;
    html! {
        div.cards {
            div.card { div.muted { "Current version" } div.value { (rollout.current) } }
            div.card { div.muted { "Canary" } div.value {
                @match &rollout.canary {
                    Some(canary) => { (canary.version) " in " (canary.regions.iter().map(ToString::to_string).collect::<Vec<_>>().join(", ")) }
                    None => { "none" }
                }
            } }
            div.card { div.muted { "Agents reporting" } div.value id="agents-reporting" { (status.agents.len()) } }
            div.card { div.muted { "Agents behind" } div.value { (status.agents_behind) } }
        }
        h2 { "Regions" }
        div.table-wrap { table id="regions" {
            thead { tr {
                th { "Region" } th.num { "Agents" } th.num.wide { "Pools" } th { "Last report to the ledger (UTC)" }
                th { "Fallback in use" } th { "Should run" } th { "Running" } th.wide { "Pepper fingerprints" }
            } }
            tbody {
                @for region in &regions {
                    @let agents: Vec<_> = status.agents.iter().filter(|a| &a.region == region).collect();
                    @let should = rollout.version_for(Some(region));
                    @let on_target = agents.iter().filter(|a| a.version == should).count();
                    @let peppers = status.pepper_fingerprints.get(region);
                    @let seen = ledger.regions.iter().find(|r| &r.region == region);
                    tr {
                        td { (region) }
                        td.num { (agents.len()) }
                        td.num.wide { (seen.map_or(0, |r| r.pools)) }
                        td {
                            @match seen.and_then(|r| r.last_report_at_ms) {
                                Some(at_ms) => { (utc(at_ms)) }
                                None => { span.muted { "none in 15 min" } }
                            }
                        }
                        td {
                            @match seen.filter(|r| r.pools_in_fallback > 0) {
                                Some(r) => { span.over { (r.fallback_admitted_tokens) " tokens in " (r.pools_in_fallback) " pool(s) this window" } }
                                None => { span.ok { "no" } }
                            }
                        }
                        td { (should) }
                        td { (on_target) " of " (agents.len()) " on it" }
                        td.wide {
                            @match peppers {
                                Some(set) if set.len() > 1 => { span.over { "skew: " (set.iter().cloned().collect::<Vec<_>>().join(", ")) } }
                                Some(set) => { (set.iter().cloned().collect::<Vec<_>>().join(", ")) }
                                None => { span.muted { "none reported" } }
                            }
                        }
                    }
                }
                @if regions.is_empty() { tr { td.muted colspan="8" { "no pool names a region and no agent has reported yet" } } }
            }
        } }
        h2 { "Agents" }
        div.table-wrap { table id="agents" {
            thead { tr { th { "Region" } th { "Agent" } th.num { "Version" } th { "Last report (UTC)" } th { "State" } } }
            tbody {
                @for agent in &status.agents {
                    @let age_ms = now_ms.saturating_sub(agent.reported_at_ms);
                    tr {
                        td { (agent.region) }
                        td { code { (agent.agent_id) } }
                        td.num { (agent.version) }
                        td { (utc(agent.reported_at_ms)) }
                        td {
                            @if age_ms > LATE_AFTER_MS { span.over { "late (" (age_ms / 1_000) " s)" } }
                            @else if agent.version != rollout.version_for(Some(&agent.region)) { "updating" }
                            @else { span.ok { "current" } }
                        }
                    }
                }
            }
        } }
    }
}

/// The allocators: how many shards each leads, and each shard's leader (a shard without one is
/// changing hands).
fn shards_fragment(map: &ShardMap) -> Markup {
    let url_of = |node: &str| {
        map.shards
            .iter()
            .filter_map(|s| s.leader.as_ref())
            .find(|leader| leader.node_id == node)
            .map_or("", |leader| leader.url.as_str())
    };
    html! {
        h2 { "Allocators" }
        p.muted { "The pools are split into " (map.shard_count) " shard(s); each is led by one allocator at a time, which alone grants its pools." }
        div.table-wrap { table id="allocators" {
            thead { tr { th { "Allocator" } th { "URL" } th.num { "Shards led" } } }
            tbody {
                @for (node, count) in map.led_by() {
                    tr { td { code { (node) } } td { (url_of(node)) } td.num { (count) " of " (map.shard_count) } }
                }
            }
        } }
        div.table-wrap { table id="shards" {
            thead { tr { th.num { "Shard" } th { "Leader" } th.num { "Epoch" } } }
            tbody {
                @for shard in &map.shards {
                    tr {
                        td.num { (shard.shard) }
                        @match &shard.leader {
                            Some(leader) => { td { code { (leader.node_id) } } td.num { (leader.epoch) } }
                            None => { td { span.over { "none: changing hands" } } td.num { "-" } }
                        }
                    }
                }
            }
        } }
    }
}

async fn fragment(console: &ConsoleState, signed_in: &SignedIn) -> Markup {
    let status = signed_in
        .api
        .get::<PolicyStatus>("/v1/policies/status")
        .await;
    let ledger = signed_in.api.get::<RegionList>("/v1/regions").await;
    let shards = signed_in.api.get::<ShardMap>("/v1/shards").await;
    match (status, ledger, shards) {
        (Ok(status), Ok(ledger), Ok(shards)) => html! {
            (status_fragment(&status, &ledger, console.clock.now_ms()))
            (shards_fragment(&shards))
        },
        (Err(problem), _, _) | (_, Err(problem), _) | (_, _, Err(problem)) => {
            problem_banner(&problem)
        }
    }
}

pub async fn page(State(console): State<ConsoleState>, signed_in: SignedIn) -> Response {
    let live = fragment(&console, &signed_in).await;
    let body = html! {
        p.muted { "Agents report what they run every few seconds; one that stops reporting drops off this page." }
        section data-live="/console/regions/live" data-every="3000" aria-live="polite" { (live) }
    };
    html_response(
        StatusCode::OK,
        super::layout::page(
            &signed_in.session,
            Section::Regions,
            "Regions, agents and allocators",
            body,
        ),
    )
}

pub async fn live(State(console): State<ConsoleState>, signed_in: SignedIn) -> Response {
    html_response(StatusCode::OK, fragment(&console, &signed_in).await)
}
