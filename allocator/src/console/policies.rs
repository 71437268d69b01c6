//! Policy bundles: the rollout, recent versions, a readable diff between two, publishing a pasted
//! bundle (the API's validation errors shown with the rule and field they name), promotion of newer
//! versions and rollback to older ones (agents never go back to a lower version, so an older
//! version's content comes back as a new version).

use axum::extract::rejection::QueryRejection;
use axum::extract::{Path, Query, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};
use serde::Deserialize;
use similar::{ChangeTag, TextDiff};

use super::api::{Api, ApiProblem};
use super::layout::{
    Section, csrf_field, html_response, page as shell, problem_banner, query_escape,
};
use super::session::Session;
use super::{CarriesCsrf, Change, ConsoleState, CsrfForm, SignedIn};
use crate::auth::OperatorRole;
use crate::http::PolicyStatus;

/// Versions listed on the page.
const VERSIONS_LISTED: u64 = 10;
/// Longest bundle text diffed, in bytes (bundles are capped far below this by the API).
const MAX_DIFF_BYTES: usize = 512 * 1024;

/// A bundle as pretty JSON, one key per line, so a diff reads rule by rule.
async fn bundle_text(api: &Api, version: u64) -> Result<String, ApiProblem> {
    let text = api.get_text(&format!("/v1/policies/{version}")).await?;
    Ok(serde_json::from_str::<serde_json::Value>(&text)
        .ok()
        .and_then(|value| serde_json::to_string_pretty(&value).ok())
        .unwrap_or(text))
}

fn publish_form(
    session: &Session,
    text: &str,
    canary: &str,
    problem: Option<&ApiProblem>,
) -> Markup {
    let invalid = problem.is_some();
    html! {
        h2 { "Publish a bundle" }
        form.stack method="post" action="/console/policies/publish" {
            (csrf_field(session))
            label for="bundle-file" { "Bundle file" }
            input id="bundle-file" type="file" accept=".json,application/json" data-load-into="bundle";
            p.hint { "or paste it below" }
            label for="bundle" { "Bundle (JSON)" }
            textarea id="bundle" name="bundle" spellcheck="false" aria-invalid=[invalid.then_some("true")]
                aria-describedby=[invalid.then_some("bundle-error")] { (text) }
            @if let Some(problem) = problem {
                p.error id="bundle-error" role="alert" {
                    @if let Some(field) = problem.field() { "At " code { (field) } ": " }
                    (problem.detail())
                }
            }
            label for="canary" { "Canary regions (optional)" }
            input id="canary" name="canary" value=(canary);
            p.hint { "comma-separated; these regions run the new version until you promote it" }
            div { button type="submit" { "Publish" } }
        }
    }
}

async fn page_body(session: &Session, api: &Api, publish: Markup) -> Result<Markup, ApiProblem> {
    let status = api.get::<PolicyStatus>("/v1/policies/status").await?;
    let rollout = &status.rollout;
    let first_listed = rollout.latest.saturating_sub(VERSIONS_LISTED - 1).max(1);
    let may_author = session.role >= OperatorRole::Author;
    Ok(html! {
        div.cards {
            div.card { div.muted { "Current" } div.value id="current-version" { (rollout.current) } }
            div.card { div.muted { "Canary" } div.value {
                @match &rollout.canary { Some(c) => { (c.version) } None => { "none" } }
            } }
            div.card { div.muted { "Latest published" } div.value { (rollout.latest) } }
        }
        h2 { "Versions" }
        @if rollout.latest == 0 {
            p.muted { "No bundle has been published yet." }
        } @else {
            table id="versions" {
                thead { tr { th.num { "Version" } th { "State" } th { "" } } }
                tbody {
                    @for version in (first_listed..=rollout.latest).rev() {
                        tr {
                            td.num { (version) }
                            td {
                                @if version == rollout.current { "current" }
                                @else if rollout.canary.as_ref().is_some_and(|c| c.version == version) { "canary" }
                                @else if version > rollout.current { "published" }
                                @else { "previous" }
                            }
                            td {
                                @if version > 1 {
                                    a href=(format!("/console/policies/diff?from={}&to={version}", version - 1)) { "diff with " (version - 1) }
                                }
                                @if may_author && version > rollout.current {
                                    " "
                                    form.inline method="post" action=(format!("/console/policies/{version}/promote")) {
                                        (csrf_field(session))
                                        button.secondary type="submit" { "Promote " (version) }
                                    }
                                }
                                @if may_author && version < rollout.current {
                                    " "
                                    form.inline method="post" action=(format!("/console/policies/{version}/rollback")) {
                                        (csrf_field(session))
                                        button.secondary type="submit"
                                            title=(format!("publish version {version}'s content as a new version, current everywhere")) {
                                            "Roll back to " (version)
                                        }
                                    }
                                }
                            }
                        }
                    }
                }
            }
            form.toolbar method="get" action="/console/policies/diff" {
                div { label for="from" { "From" } input id="from" name="from" inputmode="numeric" value=(rollout.current.max(1)); }
                div { label for="to" { "To" } input id="to" name="to" inputmode="numeric" value=(rollout.latest); }
                button type="submit" { "Compare" }
            }
        }
        @if may_author { (publish) }
        (replay_form(session, rollout.current, rollout.latest, "", None))
    })
}

/// The replay form, with what the last replay printed or why it could not run.
fn replay_form(
    session: &Session,
    current: u64,
    candidate: u64,
    sample: &str,
    outcome: Option<Result<&str, &str>>,
) -> Markup {
    html! {
        h2 id="replay" { "Replay a decision log" }
        p.hint { "Recorded requests (the agents' sampled decision log: JSON lines of atMs and request) against the current bundle and a candidate, side by side, as " code { "allotctl policies replay" } " prints it. Global leases and concurrency caps are not replayed." }
        @match outcome {
            Some(Ok(printed)) => { pre id="replay-result" { (printed) } }
            Some(Err(problem)) => { p.error id="replay-error" role="alert" { (problem) } }
            None => {}
        }
        form.stack method="post" action="/console/policies/replay" {
            (csrf_field(session))
            div {
                label for="candidate" { "Candidate version (current is " (current) ")" }
                input id="candidate" name="candidate" inputmode="numeric" value=(candidate.max(1));
            }
            div {
                label for="sample" { "Decision log lines" }
                textarea id="sample" name="sample" spellcheck="false" { (sample) }
            }
            div {
                label.inline {
                    input type="checkbox" id="enforce" name="enforce" value="on";
                    " Replay the candidate's shadow and soft rules as if enforced"
                }
            }
            div { button type="submit" { "Replay" } }
        }
    }
}

/// The replay form's fields.
#[derive(Debug, Default, Deserialize)]
pub struct ReplayForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    candidate: String,
    #[serde(default)]
    sample: String,
    /// "on" when the candidate's shadow and soft rules are replayed as if enforced.
    #[serde(default)]
    enforce: Option<String>,
}

impl CarriesCsrf for ReplayForm {
    fn csrf(&self) -> &str {
        &self.csrf
    }
}

/// A published bundle, verified as agents verify it.
async fn bundle(api: &Api, version: u64) -> Result<allot_shared::policy::PolicyBundle, String> {
    let text = api
        .get_text(&format!("/v1/policies/{version}"))
        .await
        .map_err(|p| format!("version {version}: {}", p.detail()))?;
    allot_shared::policy::parse_bundle(&text)
        .and_then(|draft| draft.into_verified())
        .map_err(|e| format!("version {version}: {e}"))
}

/// Replays are read-only, but they are POSTs (the log is too large for a URL), so they carry the
/// CSRF token like every form.
pub async fn replay(
    State(console): State<ConsoleState>,
    Change { signed_in, form }: Change<ReplayForm>,
) -> Response {
    let SignedIn { session, api, .. } = &signed_in;
    let status = match api.get::<PolicyStatus>("/v1/policies/status").await {
        Ok(status) => status,
        Err(problem) => {
            return console.failed(&signed_in, Section::Policies, &problem);
        }
    };
    let current = status.rollout.current;
    let candidate = form.candidate.trim().parse::<u64>().unwrap_or(0);
    let printed = async {
        if current == 0 {
            return Err(
                "no bundle is current yet: publish one (or promote a canary) first".to_owned(),
            );
        }
        if candidate == 0 {
            return Err("candidate: must be a published version".to_owned());
        }
        let samples = crate::ctl::samples_from_text(&form.sample, "decision log line")?;
        if samples.is_empty() {
            return Err("decision log: paste at least one line".to_owned());
        }
        let current_bundle = bundle(api, current).await?;
        let candidate_bundle = bundle(api, candidate).await?;
        let options = allot_shared::replay::ReplayOptions {
            enforce_advisory: form.enforce.as_deref() == Some("on"),
        };
        Ok(crate::ctl::replay_comparison(
            &current_bundle,
            &candidate_bundle,
            &samples,
            false,
            options,
        ))
    }
    .await;
    let (code, outcome) = match &printed {
        Ok(text) => (StatusCode::OK, Some(Ok(text.as_str()))),
        Err(problem) => (StatusCode::BAD_REQUEST, Some(Err(problem.as_str()))),
    };
    let body = html! {
        p { a href="/console/policies" { "← Policies" } }
        (replay_form(session, current, candidate, &form.sample, outcome))
    };
    html_response(code, shell(session, Section::Policies, "Replay", body))
}

pub async fn page(State(console): State<ConsoleState>, signed_in: SignedIn) -> Response {
    let SignedIn { session, api, .. } = &signed_in;
    let publish = publish_form(session, "", "", None);
    match page_body(session, api, publish).await {
        Ok(body) => html_response(
            StatusCode::OK,
            shell(session, Section::Policies, "Policies", body),
        ),
        Err(problem) => console.failed(&signed_in, Section::Policies, &problem),
    }
}

/// The publish form.
#[derive(Debug, Default, Deserialize)]
pub struct PublishForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    bundle: String,
    #[serde(default)]
    canary: String,
}

impl CarriesCsrf for PublishForm {
    fn csrf(&self) -> &str {
        &self.csrf
    }
}

pub async fn publish(
    State(console): State<ConsoleState>,
    Change { signed_in, form }: Change<PublishForm>,
) -> Response {
    let SignedIn { session, api, .. } = &signed_in;
    let canary: Vec<&str> = form
        .canary
        .split(',')
        .map(str::trim)
        .filter(|r| !r.is_empty())
        .collect();
    let path = if canary.is_empty() {
        "/v1/policies".to_owned()
    } else {
        format!("/v1/policies?canary={}", query_escape(&canary.join(",")))
    };
    match api
        .send_raw(Method::PUT, &path, form.bundle.clone().into_bytes())
        .await
    {
        Ok(_) => Redirect::to("/console/policies").into_response(),
        Err(problem) => {
            if let Some(redirect) = console.end_if_refused(&signed_in, &problem) {
                return redirect;
            }
            let publish = publish_form(session, &form.bundle, &form.canary, Some(&problem));
            let body = page_body(session, api, publish)
                .await
                .unwrap_or_else(|other| problem_banner(&other));
            html_response(
                problem.status(),
                shell(session, Section::Policies, "Policies", body),
            )
        }
    }
}

pub async fn promote(
    State(console): State<ConsoleState>,
    Path(version): Path<String>,
    Change { signed_in, .. }: Change<CsrfForm>,
) -> Response {
    let SignedIn { api, .. } = &signed_in;
    let path = format!("/v1/policies/{}/promote", query_escape(version.trim()));
    match api.act(Method::POST, &path).await {
        Ok(_) => Redirect::to("/console/policies").into_response(),
        Err(problem) => console.failed(&signed_in, Section::Policies, &problem),
    }
}

pub async fn rollback(
    State(console): State<ConsoleState>,
    Path(version): Path<String>,
    Change { signed_in, .. }: Change<CsrfForm>,
) -> Response {
    let SignedIn { api, .. } = &signed_in;
    let path = format!("/v1/policies/{}/rollback", query_escape(version.trim()));
    match api.act(Method::POST, &path).await {
        Ok(_) => Redirect::to("/console/policies").into_response(),
        Err(problem) => console.failed(&signed_in, Section::Policies, &problem),
    }
}

/// `GET /console/policies/diff` query.
#[derive(Debug, Deserialize)]
pub struct DiffQuery {
    from: String,
    to: String,
}

fn parse_version(field: &str, text: &str) -> Result<u64, ApiProblem> {
    text.trim()
        .parse::<u64>()
        .ok()
        .filter(|v| *v > 0)
        .ok_or_else(|| ApiProblem::invalid(field, "must be a positive integer"))
}

/// A line diff of two texts: unchanged lines plain, removed and added lines marked.
pub fn diff_markup(old: &str, new: &str) -> Markup {
    if old.len() > MAX_DIFF_BYTES || new.len() > MAX_DIFF_BYTES {
        return html! { p.problem { "These bundles are too large to compare here." } };
    }
    let diff = TextDiff::from_lines(old, new);
    html! {
        pre.diff {
            @for change in diff.iter_all_changes() {
                @match change.tag() {
                    ChangeTag::Delete => { span.removed { "- " (change.value()) } }
                    ChangeTag::Insert => { span.added { "+ " (change.value()) } }
                    ChangeTag::Equal => { span { "  " (change.value()) } }
                }
            }
        }
    }
}

pub async fn diff(
    State(console): State<ConsoleState>,
    query: Result<Query<DiffQuery>, QueryRejection>,
    signed_in: SignedIn,
) -> Response {
    let SignedIn { session, api, .. } = &signed_in;
    let compared = async {
        let Query(query) = query.map_err(|e| ApiProblem::invalid("from", e.body_text()))?;
        let from = parse_version("from", &query.from)?;
        let to = parse_version("to", &query.to)?;
        let old = bundle_text(api, from).await?;
        let new = bundle_text(api, to).await?;
        Ok::<_, ApiProblem>((from, to, diff_markup(&old, &new)))
    }
    .await;
    match compared {
        Ok((from, to, markup)) => {
            let title = format!("Version {from} → {to}");
            let body = html! { p { a href="/console/policies" { "← Policies" } } (markup) };
            html_response(
                StatusCode::OK,
                shell(session, Section::Policies, &title, body),
            )
        }
        Err(problem) => console.failed(&signed_in, Section::Policies, &problem),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_diff_marks_removed_and_added_lines_and_escapes_them() {
        let markup = diff_markup("a\nb <x>\nc\n", "a\nB\nc\n").into_string();
        assert!(
            markup.contains(r#"<span class="removed">- b &lt;x&gt;"#),
            "{markup}"
        );
        assert!(markup.contains(r#"<span class="added">+ B"#), "{markup}");
        assert!(markup.contains("<span>  a"), "{markup}");
    }
}
