//! The audit log: every operator change, newest first, filtered by action, actor or target.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use maud::html;
use serde::Deserialize;

use super::layout::{Section, html_response, page as shell, utc};
use super::{ConsoleState, SignedIn};
use crate::http::AuditList;

/// Entries read from the API (its maximum).
const ENTRIES_READ: u64 = 1_000;
/// Longest filter text.
const MAX_FILTER_LEN: usize = 200;

/// `GET /console/audit` query.
#[derive(Debug, Default, Deserialize)]
pub struct AuditFilter {
    #[serde(default)]
    action: String,
    #[serde(default)]
    text: String,
}

pub async fn page(
    State(console): State<ConsoleState>,
    query: Result<Query<AuditFilter>, QueryRejection>,
    signed_in: SignedIn,
) -> Response {
    let SignedIn { session, api, .. } = &signed_in;
    let Query(filter) = query.unwrap_or_default();
    let action: String = filter.action.trim().chars().take(MAX_FILTER_LEN).collect();
    let text: String = filter.text.trim().chars().take(MAX_FILTER_LEN).collect();
    let list = match api
        .get::<AuditList>(&format!("/v1/audit?last={ENTRIES_READ}"))
        .await
    {
        Ok(list) => list,
        Err(problem) => {
            return console.failed(&signed_in, Section::Audit, &problem);
        }
    };
    let mut actions: Vec<&str> = list.entries.iter().map(|e| e.action.as_str()).collect();
    actions.sort_unstable();
    actions.dedup();
    let shown: Vec<_> = list
        .entries
        .iter()
        .filter(|e| action.is_empty() || e.action == action)
        .filter(|e| {
            text.is_empty()
                || e.actor.contains(&text)
                || e.target.contains(&text)
                || e.detail.contains(&text)
        })
        .collect();
    let body = html! {
        form.toolbar method="get" action="/console/audit" role="search" {
            div {
                label for="action" { "Action" }
                select id="action" name="action" {
                    option value="" { "any" }
                    @for each in &actions { option value=(each) selected[*each == action] { (each) } }
                }
            }
            div { label for="text" { "Actor, target or detail contains" } input id="text" name="text" value=(text); }
            button type="submit" { "Filter" }
        }
        p.muted { (shown.len()) " of the last " (list.entries.len()) " changes" }
        div.table-wrap { table id="audit" {
            thead { tr { th { "When (UTC)" } th { "Actor" } th { "Action" } th { "Target" } th.num { "Version" } th.wide { "Detail" } } }
            tbody {
                @for entry in &shown {
                    tr {
                        td { (utc(entry.at_ms)) }
                        td { code { (entry.actor) } }
                        td { (entry.action) }
                        td { (entry.target) }
                        td.num { (entry.version) }
                        td.wide { code { (entry.detail) } }
                    }
                }
            }
        } }
    };
    html_response(
        StatusCode::OK,
        shell(session, Section::Audit, "Audit", body),
    )
}
