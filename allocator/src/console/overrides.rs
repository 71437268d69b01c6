//! Overrides: a page of them, in force and ended, a tenant's or everyone's, paged after a cursor
//! as the API pages them. Creating and ending are API calls (`/v1/overrides`, `allotctl
//! overrides`), audited there.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Query, State};
use axum::http::StatusCode;
use axum::response::Response;
use maud::html;
use serde::Deserialize;

use super::layout::{Section, html_response, page as shell, query_escape, utc};
use super::{ConsoleState, SignedIn};
use crate::http::OverrideList;

/// Overrides per page.
const OVERRIDES_PER_PAGE: usize = 100;

/// `GET /console/overrides` query.
#[derive(Debug, Default, Deserialize)]
pub struct ListQuery {
    /// Only this tenant's (empty: everyone's).
    #[serde(default)]
    tenant: String,
    /// The page starts after this `tenant/id` (the API's `next`).
    after: Option<String>,
}

/// The overrides page: a tenant's overrides or everyone's, in force and ended, paged after a cursor
/// as the API pages them.
///
/// Long by design: most of it is one `html!` template in the order the page reads (search, table,
/// pager), a row cell per field of an override, the search and the cursor shared by the query sent
/// to the API and the page's links; split, the page's markup would be spread over fragments that
/// are never shown alone.
pub async fn page(
    State(console): State<ConsoleState>,
    query: Result<Query<ListQuery>, QueryRejection>,
    signed_in: SignedIn,
) -> Response {
    let SignedIn { session, api, .. } = &signed_in;
    let Query(query) = query.unwrap_or_default();
    let tenant = query.tenant.trim().to_owned();
    let after = query.after.filter(|after| !after.is_empty());
    let mut path = format!("/v1/overrides?limit={OVERRIDES_PER_PAGE}");
    if !tenant.is_empty() {
        path.push_str(&format!("&tenant={}", query_escape(&tenant)));
    }
    if let Some(after) = &after {
        path.push_str(&format!("&after={}", query_escape(after)));
    }
    let list = match api.get::<OverrideList>(&path).await {
        Ok(list) => list,
        Err(problem) => return console.failed(&signed_in, Section::Overrides, &problem),
    };
    let now_ms = console.clock.now_ms();
    let first_href = format!("/console/overrides?tenant={}", query_escape(&tenant));
    let next_href = list
        .next
        .as_ref()
        .map(|next| format!("{first_href}&after={}", query_escape(next)));
    let body = html! {
        form.search method="get" action="/console/overrides" {
            label { "Tenant " input type="search" name="tenant" value=(tenant); }
            button type="submit" { "Show" }
        }
        p.muted {
            (list.overrides.len()) " overrides on this page. Create and end them through the API "
            code { "/v1/overrides" } " or " code { "allotctl overrides" } "."
        }
        div.table-wrap { table {
            thead { tr {
                th { "Tenant" } th { "Limits" } th { "To" } th { "State" } th { "From (UTC)" }
                th { "Until (UTC)" } th { "Reason" } th { "By" }
            } }
            tbody {
                @for o in &list.overrides {
                    tr id=(o.id) {
                        td { (o.tenant) }
                        td {
                            @if let Some(pool) = &o.pool { "pool " (pool) }
                            @if let Some(rule) = &o.rule { "rule " (rule) }
                            @if let Some(principal) = &o.principal {
                                " for " code { (principal.hash) }
                            }
                        }
                        td {
                            @if let Some(limit) = o.limit { "limit " (limit) " " }
                            @if let Some(capacity) = o.capacity_millis { "capacityMillis " (capacity) " " }
                            @if let Some(refill) = o.refill_millis { "refillMillis " (refill) }
                        }
                        td {
                            @if o.in_force_at(now_ms) { span.ok { "in force" } }
                            @else { span.muted { "ended" } }
                        }
                        td { (utc(o.starts_at_ms)) }
                        td {
                            @match o.expires_at_ms {
                                Some(end) => { (utc(end)) }
                                None => { span.muted { "until ended" } }
                            }
                        }
                        td { (o.reason) }
                        td { (o.created_by) }
                    }
                }
            }
        } }
        nav.pages {
            @if after.is_some() { a href=(first_href) rel="first" { "← First page" } }
            @if let Some(next_href) = &next_href { a href=(next_href) rel="next" { "Next →" } }
        }
    };
    html_response(
        StatusCode::OK,
        shell(session, Section::Overrides, "Overrides", body),
    )
}
