//! Tokens (admins only): the list, minting (the token is shown once, with a copy button) and
//! revoking.

use axum::extract::{Path, State};
use axum::http::{Method, StatusCode};
use axum::response::{IntoResponse, Redirect, Response};
use maud::{Markup, html};
use serde::Deserialize;

use super::api::{Api, ApiProblem};
use super::layout::{
    Section, csrf_field, html_response, page as shell, problem_banner, query_escape, utc,
};
use super::session::Session;
use super::{CarriesCsrf, Change, ConsoleState, CsrfForm, SignedIn};
use crate::http::{MintAnswer, TokenList};

/// The mint form.
#[derive(Debug, Default, Deserialize)]
pub struct MintForm {
    #[serde(default)]
    csrf: String,
    #[serde(default)]
    role: String,
    #[serde(default)]
    region: String,
    #[serde(default)]
    name: String,
}

impl CarriesCsrf for MintForm {
    fn csrf(&self) -> &str {
        &self.csrf
    }
}

const ROLES: [&str; 4] = ["viewer", "author", "admin", "agent"];

fn mint_form(session: &Session, form: &MintForm, problem: Option<&ApiProblem>) -> Markup {
    let at_fault = problem.and_then(ApiProblem::field);
    let error = |field: &str| {
        html! {
            @if let (true, Some(problem)) = (at_fault == Some(field), problem) {
                p.error role="alert" { (problem.detail()) }
            }
        }
    };
    html! {
        h2 { "Mint a token" }
        @if let (Some(problem), None) = (problem, at_fault) { (problem_banner(problem)) }
        form.stack method="post" action="/console/tokens" {
            (csrf_field(session))
            div {
                label for="name" { "Name" }
                input id="name" name="name" value=(form.name) required aria-invalid=[(at_fault == Some("name")).then_some("true")];
                (error("name"))
            }
            div {
                label for="role" { "Role" }
                select id="role" name="role" {
                    @for role in ROLES { option value=(role) selected[form.role == role] { (role) } }
                }
                (error("role"))
            }
            div {
                label for="region" { "Region (agent tokens)" }
                input id="region" name="region" value=(form.region) aria-invalid=[(at_fault == Some("region")).then_some("true")];
                (error("region"))
            }
            div { button type="submit" { "Mint" } }
        }
    }
}

async fn token_table(session: &Session, api: &Api) -> Result<Markup, ApiProblem> {
    let list = api.get::<TokenList>("/v1/tokens").await?;
    Ok(html! {
        div.table-wrap { table id="tokens" {
            thead { tr { th { "Id" } th { "Name" } th { "Role" } th { "Region" } th { "Source" } th.wide { "Created" } th { "" } } }
            tbody {
                @for token in &list.tokens {
                    tr {
                        td { code { (token.id) } }
                        td { (token.name) }
                        td { (token.role) }
                        td { (token.region.as_ref().map(ToString::to_string).unwrap_or_default()) }
                        td { (token.source) }
                        td.wide { (token.created_at_ms.map(utc).unwrap_or_default()) (token.created_by.as_ref().map(|by| format!(" by {by}")).unwrap_or_default()) }
                        td {
                            @if token.source != "file" && token.id != session.token_id {
                                form.inline method="post" action=(format!("/console/tokens/{}/revoke", token.id))
                                    data-confirm=(format!("Revoke {}? Whoever holds it loses access at once.", token.name)) {
                                    (csrf_field(session))
                                    button.danger type="submit" { "Revoke" }
                                }
                            }
                        }
                    }
                }
            }
        } }
    })
}

async fn render(
    session: &Session,
    api: &Api,
    status: StatusCode,
    top: Markup,
    form: &MintForm,
    problem: Option<&ApiProblem>,
) -> Response {
    let table = token_table(session, api)
        .await
        .unwrap_or_else(|p| problem_banner(&p));
    let body = html! { (top) (table) (mint_form(session, form, problem)) };
    html_response(status, shell(session, Section::Tokens, "Tokens", body))
}

pub async fn page(State(console): State<ConsoleState>, signed_in: SignedIn) -> Response {
    let SignedIn { session, api, .. } = &signed_in;
    // Listing is admin-only in the API: a lesser role sees the API's refusal.
    if let Err(problem) = api.get::<TokenList>("/v1/tokens").await {
        return console.failed(&signed_in, Section::Tokens, &problem);
    }
    let form = MintForm {
        role: "viewer".to_owned(),
        ..MintForm::default()
    };
    render(session, api, StatusCode::OK, html! {}, &form, None).await
}

pub async fn mint(
    State(console): State<ConsoleState>,
    Change { signed_in, form }: Change<MintForm>,
) -> Response {
    let SignedIn { session, api, .. } = &signed_in;
    let mut body = serde_json::json!({ "role": form.role.trim(), "name": form.name.trim() });
    if !form.region.trim().is_empty() {
        body["region"] = serde_json::Value::from(form.region.trim());
    }
    let minted = api
        .send(Method::POST, "/v1/tokens", &body)
        .await
        .and_then(|bytes| {
            serde_json::from_slice::<MintAnswer>(&bytes)
                .map_err(|e| ApiProblem::local(StatusCode::BAD_GATEWAY, e.to_string()))
        });
    match minted {
        Ok(answer) => {
            let top = html! {
                div.notice role="status" {
                    p { "Token " strong { (answer.view.name) } " (" (answer.view.role) ") minted. It is shown once: copy it now." }
                    p { code.secret id="minted-token" { (answer.token) } }
                    button.secondary type="button" data-copy="minted-token" { "Copy" }
                }
            };
            let fresh = MintForm {
                role: "viewer".to_owned(),
                ..MintForm::default()
            };
            let mut response = render(session, api, StatusCode::OK, top, &fresh, None).await;
            response.headers_mut().insert(
                axum::http::header::CACHE_CONTROL,
                axum::http::HeaderValue::from_static("no-store"),
            );
            response
        }
        Err(problem) => {
            if let Some(redirect) = console.end_if_refused(&signed_in, &problem) {
                return redirect;
            }
            render(
                session,
                api,
                problem.status(),
                html! {},
                &form,
                Some(&problem),
            )
            .await
        }
    }
}

pub async fn revoke(
    State(console): State<ConsoleState>,
    Path(id): Path<String>,
    Change { signed_in, .. }: Change<CsrfForm>,
) -> Response {
    let SignedIn { api, .. } = &signed_in;
    match api
        .act(Method::DELETE, &format!("/v1/tokens/{}", query_escape(&id)))
        .await
    {
        Ok(_) => Redirect::to("/console/tokens").into_response(),
        Err(problem) => console.failed(&signed_in, Section::Tokens, &problem),
    }
}
