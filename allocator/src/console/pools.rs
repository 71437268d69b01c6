//! Pools: the list (search, paging, this window against its bound), one pool's live windows, and
//! the forms that create, edit and delete pools.

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{HeaderValue, Method, StatusCode, header};
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};
use serde::Deserialize;
use serde_json::{Map, Value};

use super::api::ApiProblem;
use super::chart::window_chart_svg;
use super::layout::{
    Section, csrf_field, duration, html_response, page, problem_banner, query_escape, utc,
};
use super::{CarriesCsrf, Change, ConsoleState, CsrfForm, SignedIn};
use crate::auth::OperatorRole;
use crate::http::{PoolList, PoolView, WindowList};
use crate::ledger::BoundCheckSummary;
use crate::ledger::WindowRow;

/// Pools per page of the list.
pub const POOLS_PER_PAGE: usize = 50;
/// Windows shown on a pool's page and drawn in its chart.
pub const WINDOWS_SHOWN: u64 = 20;
/// Longest search text.
const MAX_SEARCH_LEN: usize = 200;

/// `GET /console/pools` query. Pages are read from the API one at a time after a cursor, so a
/// page costs the same however many pools there are.
#[derive(Debug, Default, Deserialize)]
pub struct ListQuery {
    /// Pools whose `tenant/pool` starts with this text.
    #[serde(default)]
    q: String,
    /// The page starts after this `tenant/pool` (the API's `next`); the first page without it.
    after: Option<String>,
}

/// The API's address of a pool, its segments escaped as typed (the API names an invalid one).
fn api_pool_path(tenant: &str, pool: &str) -> String {
    format!("/v1/pools/{}/{}", query_escape(tenant), query_escape(pool))
}

fn pool_href(tenant: &str, pool: &str) -> String {
    format!("/console/pools/{tenant}/{pool}")
}

/// What a window's admitted count says against its limit and bound.
fn standing(row: &WindowRow) -> Markup {
    if row.admitted_tokens > row.bound_tokens {
        html! { span.over { "over its bound" } }
    } else if !row.fallback_over_allowance_tokens_by_region.is_empty() {
        let regions: Vec<&str> = row
            .fallback_over_allowance_tokens_by_region
            .keys()
            .map(|r| r.as_str())
            .collect();
        html! { span.over { "fallback over the allowance in " (regions.join(", ")) } }
    } else if row.admitted_tokens > row.limit_tokens {
        html! { span { "within bound (fallback in use)" } }
    } else {
        html! { span.ok { "within limit" } }
    }
}

/// The pool list: a search by tenant/pool prefix, a page of pools each with its current window
/// against its bound, and the bound checks of settled windows.
///
/// Long by design: most of it is one `html!` template in the order the page reads (search, bound
/// checks, table, pager), its parts sharing the search and the cursor; split, the page's markup
/// would be spread over fragments that are never shown alone.
pub async fn list(
    State(console): State<ConsoleState>,
    query: Result<Query<ListQuery>, QueryRejection>,
    signed_in: SignedIn,
) -> Response {
    let SignedIn { session, api, .. } = &signed_in;
    let Query(query) = query.unwrap_or_default();
    let search: String = query.q.trim().chars().take(MAX_SEARCH_LEN).collect();
    let after = query.after.filter(|after| !after.is_empty());
    // A search no pool's name can start with matches nothing; it is not an error.
    let unmatchable = crate::pools::PoolPrefix::parse(&search).err();
    let (shown, next) = if unmatchable.is_some() {
        (Vec::new(), None)
    } else {
        let mut path = format!(
            "/v1/pools?limit={POOLS_PER_PAGE}&prefix={}",
            query_escape(&search)
        );
        if let Some(after) = &after {
            path.push_str(&format!("&after={}", query_escape(after)));
        }
        match api.get::<PoolList>(&path).await {
            Ok(list) => (list.pools, list.next),
            Err(problem) => {
                return console.failed(&signed_in, Section::Pools, &problem);
            }
        }
    };
    let mut rows = Vec::new();
    for pool in &shown {
        let path = format!("/v1/pools/{}/{}/windows?last=1", pool.tenant, pool.pool);
        let window = api
            .get::<WindowList>(&path)
            .await
            .ok()
            .and_then(|list| list.windows.into_iter().next());
        rows.push((pool, window));
    }
    // The bound checks of every settled window: a line, and the newest violations if any.
    let checks = api
        .get::<BoundCheckSummary>("/v1/bound-checks?recent=5")
        .await
        .ok();
    let may_edit = session.role >= OperatorRole::Author;
    let first_href = format!("/console/pools?q={}", query_escape(&search));
    let next_href = next
        .as_ref()
        .map(|next| format!("{first_href}&after={}", query_escape(next)));
    let reach = if search.is_empty() {
        "pools".to_owned()
    } else {
        format!("pools starting with “{search}”")
    };
    let body = html! {
        form.toolbar method="get" action="/console/pools" role="search" {
            div {
                label for="q" { "Tenant/pool starts with" }
                input id="q" name="q" type="search" value=(search);
            }
            button type="submit" { "Search" }
            @if may_edit { a.button.secondary href="/console/pools/new" { "New pool" } }
        }
        @if let Some(checks) = &checks {
            @if checks.violations == 0 {
                p.muted id="bound-checks" {
                    (checks.windows_checked) " windows checked against their bound, none over it"
                }
            } @else {
                p.error id="bound-checks" role="alert" {
                    (checks.violations) " of " (checks.windows_checked)
                    " checked windows broke their bound (a correctness defect, or agents of a \
                    region over its fallback allowance): "
                    @for (i, violation) in checks.recent_violations.iter().enumerate() {
                        @if i > 0 { ", " }
                        a href=(pool_href(&violation.tenant, &violation.pool)) {
                            (violation.tenant) "/" (violation.pool)
                        }
                        " from " (utc(violation.window_start_ms)) " (" (violation.admitted)
                        " of " (violation.bound)
                        @if !violation.regions_over_allowance.is_empty() {
                            "; " (violation.regions_over_allowance.join(", ")) " "
                            (violation.fallback_over_allowance) " over the fallback allowance"
                        }
                        ")"
                    }
                }
            }
        }
        p.muted id="reach" {
            @match &unmatchable {
                Some(reason) => { "No pool starts with “" (search) "”: " (reason) }
                None => {
                    (shown.len()) " " (reach)
                    @match &after { Some(after) => { " after " (after) } None => { " from the first" } }
                }
            }
        }
        div.table-wrap {
            table {
                thead { tr {
                    th { "Tenant" } th { "Pool" } th.num { "G" } th { "Window" } th.num.wide { "Chunk" }
                    th.wide { "Regions" } th.num { "Admitted" } th.num { "Bound" } th { "State" }
                } }
                tbody {
                    @for (pool, window) in &rows {
                        tr {
                            td { (pool.tenant) }
                            td { a href=(pool_href(pool.tenant.as_str(), pool.pool.as_str())) { (pool.pool) } }
                            td.num { (pool.spec.limit_tokens) }
                            td { (window_words(&pool.spec)) }
                            td.num.wide { (pool.spec.chunk_tokens) }
                            td.wide { (join(&pool.spec.regions)) }
                            @match window {
                                Some(row) => {
                                    td.num { (row.admitted_tokens) }
                                    td.num { (row.bound_tokens) }
                                    td { (standing(row)) }
                                }
                                None => { td.num { "–" } td.num { "–" } td.muted { "no window yet" } }
                            }
                        }
                    }
                }
            }
        }
        nav.pager aria-label="Pages" {
            @if after.is_some() { a href=(first_href) rel="first" { "← First page" } }
            @if let Some(next_href) = &next_href { a href=(next_href) rel="next" { "Next →" } }
        }
    };
    html_response(StatusCode::OK, page(session, Section::Pools, "Pools", body))
}

/// A pool's windows in words: `1 min`, or `month in Europe/Berlin`.
fn window_words(spec: &crate::pools::PoolSpec) -> String {
    match &spec.window {
        Some(calendar) => format!("{} in {}", calendar.calendar, calendar.time_zone),
        None => duration(spec.window_ms),
    }
}

fn join<T: std::fmt::Display>(items: &[T]) -> String {
    items
        .iter()
        .map(ToString::to_string)
        .collect::<Vec<_>>()
        .join(", ")
}

/// The pool form, as typed. Numbers stay text until the API reads them, so a mistyped number is
/// named by the API like any other invalid field.
#[derive(Debug, Default, Deserialize)]
pub struct PoolForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    tenant: String,
    #[serde(default)]
    pool: String,
    #[serde(default)]
    limit: String,
    #[serde(default, rename = "windowMs")]
    window_ms: String,
    /// Calendar windows: day, week or month (blank: windowMs).
    #[serde(default)]
    calendar: String,
    #[serde(default, rename = "timeZone")]
    time_zone: String,
    #[serde(default)]
    chunk: String,
    #[serde(default, rename = "leaseTtlMs")]
    lease_ttl_ms: String,
    #[serde(default, rename = "fallbackPerRegion")]
    fallback_per_region: String,
    /// Blank: none (0).
    #[serde(default, rename = "settleDebtPerRegion")]
    settle_debt_per_region: String,
    #[serde(default)]
    regions: String,
}

impl CarriesCsrf for PoolForm {
    fn csrf(&self) -> &str {
        &self.csrf
    }
}

/// Calendar windows, instead of a window length: (form name, label, hint).
const CALENDAR_FIELDS: [(&str, &str, &str); 2] = [
    (
        "calendar",
        "Calendar window",
        "day, week or month instead of a length in ms (leave the window length blank)",
    ),
    (
        "timeZone",
        "Time zone",
        "where the calendar is read, e.g. Europe/Berlin or UTC",
    ),
];

/// The form's fields: (JSON name, label, hint).
const SPEC_FIELDS: [(&str, &str, &str); 6] = [
    ("limit", "G, tokens per window", "the tenant's global quota"),
    ("windowMs", "Window, ms", "e.g. 60000 for a minute"),
    ("chunk", "Chunk, tokens", "what one lease grants; at most G"),
    (
        "leaseTtlMs",
        "Lease TTL, ms",
        "how long a lease may be spent",
    ),
    (
        "fallbackPerRegion",
        "Fallback per region, tokens",
        "what a cut-off region may admit on its own per window (a term of the bound)",
    ),
    (
        "settleDebtPerRegion",
        "Settle debt per region, tokens",
        "what metered requests may cost beyond their estimates before it is paid, per region (a term of the bound; blank: 0)",
    ),
];

impl PoolForm {
    fn from_view(view: &PoolView) -> Self {
        Self {
            csrf: String::new(),
            tenant: view.tenant.to_string(),
            pool: view.pool.to_string(),
            limit: view.spec.limit_tokens.to_string(),
            window_ms: if view.spec.window.is_some() {
                String::new()
            } else {
                view.spec.window_ms.to_string()
            },
            calendar: view
                .spec
                .window
                .as_ref()
                .map(|w| w.calendar.clone())
                .unwrap_or_default(),
            time_zone: view
                .spec
                .window
                .as_ref()
                .map(|w| w.time_zone.clone())
                .unwrap_or_default(),
            chunk: view.spec.chunk_tokens.to_string(),
            lease_ttl_ms: view.spec.lease_ttl_ms.to_string(),
            fallback_per_region: view.spec.fallback_per_region_tokens.to_string(),
            settle_debt_per_region: view.spec.settle_debt_per_region_tokens.to_string(),
            regions: join(&view.spec.regions),
        }
    }

    fn value_of(&self, field: &str) -> &str {
        match field {
            "tenant" => &self.tenant,
            "pool" => &self.pool,
            "limit" => &self.limit,
            "windowMs" => &self.window_ms,
            "calendar" => &self.calendar,
            "timeZone" => &self.time_zone,
            "chunk" => &self.chunk,
            "leaseTtlMs" => &self.lease_ttl_ms,
            "fallbackPerRegion" => &self.fallback_per_region,
            "settleDebtPerRegion" => &self.settle_debt_per_region,
            _ => &self.regions,
        }
    }

    /// The API's pool body: whole numbers as numbers, anything else as typed text (which the API
    /// refuses naming the field).
    fn spec_json(&self) -> Value {
        let mut body = Map::new();
        let calendar = self.calendar.trim();
        for (field, _, _) in SPEC_FIELDS {
            let typed = self.value_of(field).trim();
            let optional = match field {
                "windowMs" => !calendar.is_empty(),
                "settleDebtPerRegion" => true,
                _ => false,
            };
            if optional && typed.is_empty() {
                continue;
            }
            let value = typed
                .parse::<u64>()
                .map(Value::from)
                .unwrap_or_else(|_| Value::from(typed));
            body.insert(field.to_owned(), value);
        }
        let regions: Vec<Value> = self
            .regions
            .split([',', ' '])
            .map(str::trim)
            .filter(|r| !r.is_empty())
            .map(Value::from)
            .collect();
        body.insert("regions".to_owned(), Value::Array(regions));
        if !calendar.is_empty() {
            body.insert(
                "window".to_owned(),
                serde_json::json!({ "calendar": calendar, "timeZone": self.time_zone.trim() }),
            );
        }
        Value::Object(body)
    }
}

/// The field a problem names, as the form calls it (`regions[1]` is the regions box).
fn form_field(problem: &ApiProblem) -> Option<&str> {
    let field = problem.field()?;
    let base = field.split(['[', '.']).next().unwrap_or(field);
    Some(match (base, field) {
        ("window", "window.timeZone") => "timeZone",
        ("window", _) => "calendar",
        ("" | "body", _) => "limit",
        (other, _) => other,
    })
}

/// The form that creates a pool (`editing` false) or edits one, its fields marked where `problem`
/// names one of them.
///
/// Long by design: it is one `html!` template of the form's fields in the order they are shown,
/// each marking itself from the one field the problem names; split, the form would be read in
/// pieces that are never shown alone.
fn pool_form(
    session: &super::session::Session,
    form: &PoolForm,
    editing: bool,
    problem: Option<&ApiProblem>,
) -> Markup {
    let action = if editing {
        format!("{}/edit", pool_href(&form.tenant, &form.pool))
    } else {
        "/console/pools/new".to_owned()
    };
    let at_fault = problem.and_then(form_field);
    let field = |name: &'static str, label: &'static str, hint: &'static str| {
        let invalid = at_fault == Some(name);
        let error_id = format!("{name}-error");
        html! {
            div {
                label for=(name) { (label) }
                input id=(name) name=(name) value=(form.value_of(name)) inputmode="numeric"
                    aria-invalid=[invalid.then_some("true")]
                    aria-describedby=[invalid.then_some(error_id.as_str())];
                @if let (true, Some(problem)) = (invalid, problem) {
                    p.error id=(error_id) role="alert" { (problem.detail()) }
                } @else {
                    p.hint { (hint) }
                }
            }
        }
    };
    html! {
        @if let (Some(problem), None) = (problem, at_fault) { (problem_banner(problem)) }
        form.stack method="post" action=(action) novalidate {
            (csrf_field(session))
            @if editing {
                input type="hidden" name="tenant" value=(form.tenant);
                input type="hidden" name="pool" value=(form.pool);
            } @else {
                @for (name, label) in [("tenant", "Tenant"), ("pool", "Pool")] {
                    @let invalid = at_fault == Some(name);
                    div {
                        label for=(name) { (label) }
                        input id=(name) name=(name) value=(form.value_of(name)) required
                            aria-invalid=[invalid.then_some("true")];
                        @if let (true, Some(problem)) = (invalid, problem) {
                            p.error role="alert" { (problem.detail()) }
                        }
                    }
                }
            }
            @for (name, label, hint) in SPEC_FIELDS { (field(name, label, hint)) }
            @for (name, label, hint) in CALENDAR_FIELDS {
                @let invalid = at_fault == Some(name);
                div {
                    label for=(name) { (label) }
                    input id=(name) name=(name) value=(form.value_of(name))
                        aria-invalid=[invalid.then_some("true")];
                    @if let (true, Some(problem)) = (invalid, problem) {
                        p.error role="alert" { (problem.detail()) }
                    } @else {
                        p.hint { (hint) }
                    }
                }
            }
            div {
                @let invalid = at_fault == Some("regions");
                label for="regions" { "Regions" }
                input id="regions" name="regions" value=(form.regions) aria-invalid=[invalid.then_some("true")];
                @if let (true, Some(problem)) = (invalid, problem) {
                    p.error role="alert" { (problem.detail()) }
                } @else {
                    p.hint { "comma-separated region ids, e.g. eu, us" }
                }
            }
            div { button type="submit" { @if editing { "Save" } @else { "Create pool" } } }
        }
    }
}

pub async fn new_form(SignedIn { session, .. }: SignedIn) -> Response {
    let defaults = PoolForm {
        window_ms: "60000".to_owned(),
        lease_ttl_ms: "10000".to_owned(),
        fallback_per_region: "0".to_owned(),
        ..PoolForm::default()
    };
    let body = pool_form(&session, &defaults, false, None);
    html_response(
        StatusCode::OK,
        page(&session, Section::Pools, "New pool", body),
    )
}

async fn save(
    console: ConsoleState,
    signed_in: SignedIn,
    form: PoolForm,
    editing: bool,
) -> Response {
    let SignedIn { session, api, .. } = &signed_in;
    let path = api_pool_path(form.tenant.trim(), form.pool.trim());
    let saved = if form.tenant.trim().is_empty() || form.pool.trim().is_empty() {
        let field = if form.tenant.trim().is_empty() {
            "tenant"
        } else {
            "pool"
        };
        Err(ApiProblem::invalid(field, "required"))
    } else {
        api.send(Method::PUT, &path, &form.spec_json()).await
    };
    match saved {
        Ok(_) => Redirect::to(&pool_href(form.tenant.trim(), form.pool.trim())).into_response(),
        Err(problem) => {
            if let Some(redirect) = console.end_if_refused(&signed_in, &problem) {
                return redirect;
            }
            let title = if editing { "Edit pool" } else { "New pool" };
            let body = pool_form(session, &form, editing, Some(&problem));
            html_response(problem.status(), page(session, Section::Pools, title, body))
        }
    }
}

pub async fn create(
    State(console): State<ConsoleState>,
    Change { signed_in, form }: Change<PoolForm>,
) -> Response {
    save(console, signed_in, form, false).await
}

pub async fn edit_form(
    State(console): State<ConsoleState>,
    Path((tenant, pool)): Path<(String, String)>,
    signed_in: SignedIn,
) -> Response {
    let SignedIn { session, api, .. } = &signed_in;
    match api.get::<PoolView>(&api_pool_path(&tenant, &pool)).await {
        Ok(view) => {
            let body = pool_form(session, &PoolForm::from_view(&view), true, None);
            let title = format!("Edit {tenant}/{pool}");
            html_response(StatusCode::OK, page(session, Section::Pools, &title, body))
        }
        Err(problem) => console.failed(&signed_in, Section::Pools, &problem),
    }
}

pub async fn update(
    State(console): State<ConsoleState>,
    Path((tenant, pool)): Path<(String, String)>,
    Change { signed_in, form }: Change<PoolForm>,
) -> Response {
    let form = PoolForm {
        tenant,
        pool,
        ..form
    };
    save(console, signed_in, form, true).await
}

pub async fn delete_confirm(
    Path((tenant, pool)): Path<(String, String)>,
    SignedIn { session, .. }: SignedIn,
) -> Response {
    let title = format!("Delete {tenant}/{pool}?");
    let body = html! {
        p { "Agents stop getting leases for this pool; its ledger history stays. This cannot be undone." }
        form.inline method="post" action=(format!("{}/delete", pool_href(&tenant, &pool))) {
            (csrf_field(&session))
            button.danger type="submit" { "Delete " (tenant) "/" (pool) }
        }
        " "
        a.button.secondary href=(pool_href(&tenant, &pool)) { "Keep it" }
    };
    html_response(StatusCode::OK, page(&session, Section::Pools, &title, body))
}

pub async fn delete(
    State(console): State<ConsoleState>,
    Path((tenant, pool)): Path<(String, String)>,
    Change { signed_in, .. }: Change<CsrfForm>,
) -> Response {
    let SignedIn { api, .. } = &signed_in;
    let path = api_pool_path(&tenant, &pool);
    match api.act(Method::DELETE, &path).await {
        Ok(_) => Redirect::to("/console/pools").into_response(),
        Err(problem) => console.failed(&signed_in, Section::Pools, &problem),
    }
}

pub async fn detail(
    State(console): State<ConsoleState>,
    Path((tenant, pool)): Path<(String, String)>,
    signed_in: SignedIn,
) -> Response {
    let SignedIn { session, api, .. } = &signed_in;
    let view = match api.get::<PoolView>(&api_pool_path(&tenant, &pool)).await {
        Ok(view) => view,
        Err(problem) => {
            return console.failed(&signed_in, Section::Pools, &problem);
        }
    };
    let live = live_fragment(api, &view).await;
    let href = pool_href(&tenant, &pool);
    let spec = &view.spec;
    let regions = spec.regions.len() as u64;
    let fallback_total = spec.fallback_per_region_tokens.saturating_mul(regions);
    let debt_total = spec.settle_debt_per_region_tokens.saturating_mul(regions);
    let bound_total = spec
        .limit_tokens
        .saturating_add(fallback_total)
        .saturating_add(debt_total);
    let body = html! {
        @if session.role >= OperatorRole::Author {
            p {
                a.button.secondary href=(format!("{href}/edit")) { "Edit" } " "
                a.button.secondary href=(format!("{href}/delete")) { "Delete" }
            }
        }
        p.muted {
            "G " (spec.limit_tokens) " tokens per " (window_words(spec))
            " · chunk " (spec.chunk_tokens) " · lease TTL " (duration(spec.lease_ttl_ms))
            " · regions " (join(&spec.regions)) " · version " (view.version)
            " · updated " (utc(view.updated_at_ms))
        }
        section id="live" data-live=(format!("{href}/live")) data-every="2000" aria-live="polite" {
            (live)
        }
        h2 { "The bound, term by term" }
        ul {
            li { "The allocator grants at most " strong { "G = " (spec.limit_tokens) } " tokens per window." }
            li { "Leases end no later than their window does, so nothing granted in one window is spent in the next: " strong { "carry-over 0" } "." }
            li { "Each of the " (regions) " regions may admit up to " (spec.fallback_per_region_tokens)
                 " tokens on its own per window while it cannot reach the allocator: " strong { "fallback " (fallback_total) } "." }
            li { "Grants are committed in etcd before they are answered, so a failover re-grants nothing: " strong { "lost grants 0" } "." }
            li { "Each region may owe up to " (spec.settle_debt_per_region_tokens)
                 " tokens that metered requests cost beyond their estimates, paid from its next leases: " strong { "settle debt " (debt_total) } "." }
            li { "Bound = " (spec.limit_tokens) " + 0 + " (fallback_total) " + 0 + " (debt_total) " = " strong { (bound_total) } " tokens per window." }
        }
    };
    let title = format!("{tenant}/{pool}");
    html_response(StatusCode::OK, page(session, Section::Pools, &title, body))
}

/// The live part of a pool's page: this window, the chart and the last windows.
///
/// Long by design: it is one `html!` template whose parts (cards, this window by region, chart,
/// windows, fallback by agent) all come from the one list of windows fetched at its top, and are
/// refreshed together as one fragment; split, each part would take the same list and the page would
/// be read in pieces.
async fn live_fragment(api: &super::api::Api, view: &PoolView) -> Markup {
    let path = format!(
        "/v1/pools/{}/{}/windows?last={WINDOWS_SHOWN}",
        view.tenant, view.pool
    );
    let windows = match api.get::<WindowList>(&path).await {
        Ok(list) => list.windows,
        Err(problem) => return problem_banner(&problem),
    };
    let href = pool_href(view.tenant.as_str(), view.pool.as_str());
    let current = view.window.as_ref();
    let newest = windows.first();
    // The chart's address changes with what it draws, so a live refresh loads it only then.
    let version = newest.map_or_else(String::new, |w| {
        format!(
            "{}-{}-{}-{}",
            w.window_start_ms, w.admitted_tokens, w.granted_tokens, w.stranded_tokens
        )
    });
    let by_region = this_window_by_region(current, newest);
    // Metered pools show what their regions owed and wrote off; others keep the short table.
    let metered = view.spec.settle_debt_per_region_tokens > 0
        || windows
            .iter()
            .any(|w| w.settle_debt_tokens > 0 || w.written_off_tokens > 0);
    let columns = if metered { 12 } else { 10 };
    html! {
        div.cards {
            div.card { div.muted { "Admitted this window" } div.value id="admitted" { (newest.map_or(0, |w| w.admitted_tokens)) } }
            div.card { div.muted { "Bound" } div.value { (newest.map_or(0, |w| w.bound_tokens)) } }
            div.card { div.muted { "Not yet granted" } div.value { (current.map_or(0, |w| w.remaining_tokens)) } }
            div.card { div.muted { "Leases outstanding" } div.value { (current.map_or(0, |w| w.leases_outstanding)) } }
        }
        @if current.is_some() {
            h2 { "This window, by region" }
            table id="regions-now" {
                thead { tr {
                    th { "Region" } th.num { "Leases outstanding" } th.num { "Granted" } th.num { "Admitted" }
                    th.num { "of which in fallback" }
                } }
                tbody {
                    @for now in &by_region {
                        tr {
                            td { (now.region) } td.num { (now.leases) } td.num { (now.granted_tokens) }
                            td.num { (now.admitted_tokens) } td.num { (now.fallback_tokens) }
                        }
                    }
                    @if by_region.is_empty() {
                        tr { td.muted colspan="5" { "no grants yet in this window" } }
                    }
                }
            }
        }
        h2 { "Windows" }
        img.chart src=(format!("{href}/chart.svg?v={version}")) width="960" height="320"
            alt="Admitted tokens per window (spent and fallback), granted and stranded, against the limit and the bound";
        div.table-wrap {
            table id="windows" {
                thead { tr {
                    th { "Window start (UTC)" } th.num { "Granted" } th.num { "Spent" } th.num { "Fallback" }
                    th.num { "Admitted" } th.num { "Stranded" } th.num.wide { "Unreported" }
                    th.num { "Overshoot" } th.num { "Bound" }
                    @if metered { th.num { "Settle debt" } th.num { "Written off" } }
                    th { "State" }
                } }
                tbody {
                    @for row in &windows {
                        tr {
                            td { (utc(row.window_start_ms)) }
                            td.num { (row.granted_tokens) }
                            td.num { (row.spent_tokens) }
                            td.num { (row.fallback_admitted_tokens) }
                            td.num { (row.admitted_tokens) }
                            td.num { (row.stranded_tokens) }
                            td.num.wide { (row.unreported_tokens) }
                            td.num { (row.overshoot_tokens) }
                            td.num { (row.bound_tokens) }
                            @if metered {
                                td.num { (row.settle_debt_tokens) }
                                td.num { (row.written_off_tokens) }
                            }
                            td { (standing(row)) }
                        }
                    }
                    @if windows.is_empty() { tr { td.muted colspan=(columns) { "no windows yet" } } }
                }
            }
        }
        @let by_agent: Vec<&WindowRow> = windows
            .iter()
            .filter(|w| !w.fallback_admitted_tokens_by_agent.is_empty())
            .collect();
        @if !by_agent.is_empty() {
            h2 { "Fallback by agent" }
            p.muted {
                "Each agent of a region admits at most the region's allowance divided by "
                code { "--region-agents" } "; together they stay within the allowance."
            }
            div.table-wrap {
                table id="fallback-by-agent" {
                    thead { tr {
                        th { "Window start (UTC)" } th { "Region" } th { "Agent" }
                        th.num { "Fallback" } th.num { "Region's allowance" }
                    } }
                    tbody {
                        @for row in &by_agent {
                            @for (region, agents) in &row.fallback_admitted_tokens_by_agent {
                                @for (agent, tokens) in agents {
                                    tr {
                                        td { (utc(row.window_start_ms)) } td { (region) } td { (agent) }
                                        td.num { (tokens) } td.num { (row.fallback_per_region_tokens) }
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
}

/// One region in the current window.
struct RegionNow {
    region: allot_shared::ids::RegionId,
    /// Its leases that have not expired.
    leases: u64,
    granted_tokens: u64,
    admitted_tokens: u64,
    fallback_tokens: u64,
}

/// Per region of the current window: leases outstanding, granted, admitted, and admitted in
/// fallback (the ledger's newest row, when it is this window's).
fn this_window_by_region(
    current: Option<&crate::http::LiveWindow>,
    newest: Option<&WindowRow>,
) -> Vec<RegionNow> {
    let Some(window) = current else {
        return Vec::new();
    };
    let row = newest.filter(|row| row.window_start_ms == window.window_start_ms);
    let mut regions: Vec<_> = window
        .granted_tokens_by_region
        .keys()
        .chain(window.leases_outstanding_by_region.keys())
        .chain(
            row.into_iter()
                .flat_map(|r| r.admitted_tokens_by_region.keys()),
        )
        .cloned()
        .collect();
    regions.sort();
    regions.dedup();
    fn of(
        map: Option<&std::collections::BTreeMap<allot_shared::ids::RegionId, u64>>,
        region: &allot_shared::ids::RegionId,
    ) -> u64 {
        map.and_then(|m| m.get(region)).copied().unwrap_or(0)
    }
    regions
        .into_iter()
        .map(|region| RegionNow {
            leases: of(Some(&window.leases_outstanding_by_region), &region),
            granted_tokens: of(Some(&window.granted_tokens_by_region), &region),
            admitted_tokens: of(row.map(|r| &r.admitted_tokens_by_region), &region),
            fallback_tokens: of(row.map(|r| &r.fallback_admitted_tokens_by_region), &region),
            region,
        })
        .collect()
}

pub async fn live(
    State(console): State<ConsoleState>,
    Path((tenant, pool)): Path<(String, String)>,
    signed_in: SignedIn,
) -> Response {
    let SignedIn { api, .. } = &signed_in;
    match api.get::<PoolView>(&api_pool_path(&tenant, &pool)).await {
        Ok(view) => html_response(StatusCode::OK, live_fragment(api, &view).await),
        Err(problem) => console.failed_fragment(&signed_in, &problem),
    }
}

pub async fn chart(
    State(console): State<ConsoleState>,
    Path((tenant, pool)): Path<(String, String)>,
    signed_in: SignedIn,
) -> Response {
    let SignedIn { api, .. } = &signed_in;
    let path = format!(
        "{}/windows?last={WINDOWS_SHOWN}",
        api_pool_path(&tenant, &pool)
    );
    match api.get::<WindowList>(&path).await {
        Ok(list) => {
            let mut response = window_chart_svg(&list.windows).into_response();
            response.headers_mut().insert(
                header::CONTENT_TYPE,
                HeaderValue::from_static("image/svg+xml"),
            );
            response
        }
        Err(problem) => console.failed_fragment(&signed_in, &problem),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_form_sends_numbers_as_numbers_and_anything_else_as_typed() {
        let form = PoolForm {
            limit: "1000".into(),
            window_ms: " 60000 ".into(),
            chunk: "ten".into(),
            lease_ttl_ms: "10000".into(),
            fallback_per_region: String::new(),
            settle_debt_per_region: " ".into(),
            regions: "eu, us,,ap".into(),
            ..PoolForm::default()
        };
        let json = form.spec_json();
        assert_eq!(json["limit"], 1000);
        assert_eq!(json["windowMs"], 60000);
        assert_eq!(json["chunk"], "ten");
        assert_eq!(json["fallbackPerRegion"], "");
        assert!(
            json.get("settleDebtPerRegion").is_none(),
            "a blank settle debt is left to the API's default: {json}"
        );
        assert_eq!(json["regions"], serde_json::json!(["eu", "us", "ap"]));
    }
}
