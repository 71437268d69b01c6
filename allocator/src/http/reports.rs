//! Agents' reports to the ledger, for their own region only: one at a time (`POST /v1/reports`) or
//! a round in one call (`POST /v1/reports/batch`), each taken once per report id.

use std::collections::BTreeMap;

use allot_shared::FieldError;
use allot_shared::ids::{PoolId, TenantId};
use allot_shared::wire::{
    MAX_LEASE_LINES_PER_BATCH, MAX_REPORTS_PER_BATCH, Report, ReportBatch, ReportBatchAnswer,
    ReportReceipt, ReportResult,
};
use axum::body::Bytes;
use axum::extract::State;
use axum::http::{HeaderMap, StatusCode};
use axum::response::Response;

use super::ApiState;
use super::access::{Needs, authorize, check_region};
use super::errors::ApiError;
use super::io::{json_response, parse_json};
use crate::ledger::LedgerError;
use crate::pools;

#[utoipa::path(post, path = "/v1/reports", tag = "agents",
    request_body = Report,
    responses(
        (status = 200, description = "The report, recorded once", body = ReportReceipt),
        crate::http::errors::Refused,
        crate::http::errors::BodyRefused,
    ))]
pub async fn post_report(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Agent)?;
    let report: Report = parse_json(&headers, &body)?;
    check_region(&credential, &report.region)?;
    let receipt = crate::ledger::reports::only_result(record(&state, &[&report]).await?)?;
    Ok(json_response(StatusCode::OK, &receipt))
}

#[utoipa::path(post, path = "/v1/reports/batch", tag = "agents",
    request_body = ReportBatch,
    responses(
        (status = 200, description = "One result per report, in order: its receipt (taken once per \
            report id), or the problem that refused it alone (its field prefixed `reports[i].`)",
            body = ReportBatchAnswer),
        crate::http::errors::Refused,
        crate::http::errors::BodyRefused,
    ))]
pub async fn post_report_batch(
    State(state): State<ApiState>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let credential = authorize(&state, &headers, Needs::Agent)?;
    let batch: ReportBatch = parse_json(&headers, &body)?;
    check_bounds(&batch)?;
    // Reports for a region this agent may not act for are refused alone, as `POST /v1/reports`
    // would refuse each.
    let mut results: Vec<Option<ReportResult>> = batch
        .reports
        .iter()
        .enumerate()
        .map(|(index, report)| {
            check_region(&credential, &report.region)
                .err()
                .map(|refused| refused_entry(index, refused))
        })
        .collect();
    let taken: Vec<(usize, &Report)> = batch
        .reports
        .iter()
        .enumerate()
        .filter(|(index, _)| results[*index].is_none())
        .collect();
    let reports: Vec<&Report> = taken.iter().map(|(_, report)| *report).collect();
    let recorded = record(&state, &reports).await?;
    for ((index, _), result) in taken.iter().zip(recorded) {
        results[*index] = Some(match result {
            Ok(receipt) => ReportResult {
                receipt: Some(receipt),
                problem: None,
            },
            Err(invalid) => refused_entry(*index, LedgerError::Invalid(invalid).into()),
        });
    }
    let results = results.into_iter().flatten().collect();
    Ok(json_response(
        StatusCode::OK,
        &ReportBatchAnswer { results },
    ))
}

/// A batch's bounds, reports and lease lines among them (I10), and each report's fields as the
/// schema states them: a call that breaks the schema is refused whole, naming the field.
fn check_bounds(batch: &ReportBatch) -> Result<(), ApiError> {
    for (index, report) in batch.reports.iter().enumerate() {
        report.check_report_id().map_err(|invalid| {
            ApiError::invalid(
                format!("reports[{index}].{}", invalid.field),
                invalid.message,
            )
        })?;
    }
    if batch.reports.len() > MAX_REPORTS_PER_BATCH {
        return Err(ApiError::invalid(
            "reports",
            format!("at most {MAX_REPORTS_PER_BATCH} reports per call"),
        ));
    }
    let lines: usize = batch.reports.iter().map(|r| r.leases.len()).sum();
    if lines > MAX_LEASE_LINES_PER_BATCH {
        return Err(ApiError::invalid(
            "reports",
            format!("at most {MAX_LEASE_LINES_PER_BATCH} lease lines per call, not {lines}"),
        ));
    }
    Ok(())
}

/// The result of report `index` refused alone.
fn refused_entry(index: usize, refused: ApiError) -> ReportResult {
    ReportResult {
        receipt: None,
        problem: Some(refused.into_entry_problem("reports", index)),
    }
}

/// Checks and writes `reports` in the ledger, one result each, in order. Grants reach the ledger
/// asynchronously and a report may overtake them; etcd is the authority: what the ledger lacks of
/// the leases the reports name is copied from there first (the ledger's grants read once, the
/// store's in round trips of many).
async fn record(
    state: &ApiState,
    reports: &[&Report],
) -> Result<Vec<Result<ReportReceipt, FieldError>>, ApiError> {
    let mut known = state.ledger.known_grants(reports).await?;
    let copied = pools::get_grants(&*state.kv, &known.missing()).await?;
    let mut by_pool: BTreeMap<(&TenantId, &PoolId), Vec<pools::GrantRecord>> = BTreeMap::new();
    for (tenant, pool, record) in &copied {
        by_pool
            .entry((tenant, pool))
            .or_default()
            .push(record.clone());
    }
    for ((tenant, pool), records) in by_pool {
        state.ledger.record_grants(tenant, pool, &records).await?;
        known.add(tenant, pool, &records);
    }
    Ok(state
        .ledger
        .record_reports_known(reports, &known, state.clock.now_ms())
        .await?)
}
