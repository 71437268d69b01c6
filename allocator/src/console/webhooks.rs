//! Threshold webhooks: every registration, and each one's latest deliveries (pending, delivered,
//! failed; attempts, the endpoint's last answer). Registering and rotating are API calls, so a
//! secret is never rendered into a page.

use axum::extract::State;
use axum::http::StatusCode;
use axum::response::Response;
use maud::html;

use super::layout::{Section, html_response, page as shell, utc};
use super::{ConsoleState, SignedIn};
use crate::http::{DeliveryList, WebhookList};

/// Deliveries shown per webhook.
const DELIVERIES_SHOWN: u32 = 10;

pub async fn page(State(console): State<ConsoleState>, signed_in: SignedIn) -> Response {
    let SignedIn { session, api, .. } = &signed_in;
    let list = match api.get::<WebhookList>("/v1/webhooks").await {
        Ok(list) => list,
        Err(problem) => return console.failed(&signed_in, Section::Webhooks, &problem),
    };
    let mut deliveries = Vec::with_capacity(list.webhooks.len());
    for webhook in &list.webhooks {
        let path = format!(
            "/v1/webhooks/{}/deliveries?last={DELIVERIES_SHOWN}",
            webhook.id
        );
        match api.get::<DeliveryList>(&path).await {
            Ok(answer) => deliveries.push(answer.deliveries),
            Err(problem) => return console.failed(&signed_in, Section::Webhooks, &problem),
        }
    }
    let body = html! {
        p.muted {
            (list.webhooks.len()) " webhooks. Register, rotate and delete them through the API "
            code { "/v1/webhooks" } " (a secret is shown once, to its caller)."
        }
        @for (webhook, deliveries) in list.webhooks.iter().zip(&deliveries) {
            section.webhook id=(webhook.id) {
                h2 { code { (webhook.id) } }
                p {
                    code { (webhook.url) } " — " (webhook.tenant) "/"
                    (webhook.pool.as_ref().map_or("*".to_owned(), ToString::to_string))
                    " at "
                    (webhook.thresholds_pct.iter().map(|t| format!("{t} %")).collect::<Vec<_>>().join(", "))
                    @if let Some(until_ms) = webhook.previous_secret_until_ms {
                        " · the previous secret signs until " (utc(until_ms))
                    }
                }
                div.table-wrap { table {
                    thead { tr {
                        th { "Found (UTC)" } th { "Pool" } th.num { "Threshold" } th { "State" }
                        th.num { "Attempts" } th { "Last answer" }
                    } }
                    tbody {
                        @for delivery in deliveries {
                            tr {
                                td { (utc(delivery.created_at_ms)) }
                                td { (delivery.event.tenant) "/" (delivery.event.pool) }
                                td.num { (delivery.event.threshold_pct) " %" }
                                td { (delivery.state) }
                                td.num { (delivery.attempts) }
                                td {
                                    @if let Some(status) = delivery.last_status { (status) " " }
                                    @if let Some(error) = &delivery.last_error { span.muted { (error) } }
                                }
                            }
                        }
                    }
                } }
            }
        }
    };
    html_response(
        StatusCode::OK,
        shell(session, Section::Webhooks, "Webhooks", body),
    )
}
