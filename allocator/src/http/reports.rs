//! Agents' reports to the ledger, for their own region only: one at a time (`POST /v1/reports`) or
//! a round in one call (`POST /v1/reports/batch`), each taken once per report id.

use std::collections::BTreeMap;

use allot_shared::contract::Problem;
use allot_shared::ids::{LeaseId, PoolId, TenantId};
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
    copy_grants_reported(&state, std::slice::from_ref(&report)).await?;
    let receipt = state
        .ledger
        .record_report(&report, state.clock.now_ms())
        .await?;
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
    let reports: Vec<Report> = taken.iter().map(|(_, report)| (*report).clone()).collect();
    copy_grants_reported(&state, &reports).await?;
    let recorded = state
        .ledger
        .record_reports(&reports, state.clock.now_ms())
        .await?;
    for ((index, _), result) in taken.iter().zip(recorded) {
        results[*index] = Some(match result {
            Ok(receipt) => ReportResult {
                receipt: Some(receipt),
                problem: None,
            },
            Err(invalid) => {
                refused_entry(*index, ApiError::invalid(invalid.field, invalid.message))
            }
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
        // Characters, as the schema counts them (`maxLength`), not bytes.
        if report.report_id.is_empty() || report.report_id.chars().count() > 64 {
            return Err(ApiError::invalid(
                format!("reports[{index}].reportId"),
                "must be 1 to 64 characters",
            ));
        }
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

/// The result of report `index` refused alone: its problem, the field named within the batch.
fn refused_entry(index: usize, refused: ApiError) -> ReportResult {
    let mut problem: Problem = refused.into_problem();
    problem.field = Some(match problem.field.take() {
        Some(field) => format!("reports[{index}].{field}"),
        None => format!("reports[{index}]"),
    });
    ReportResult {
        receipt: None,
        problem: Some(problem),
    }
}

/// Grants reach the ledger asynchronously and a report may overtake them. etcd is the authority:
/// copies what the ledger lacks of the leases `reports` name from there before they are checked.
async fn copy_grants_reported(state: &ApiState, reports: &[Report]) -> Result<(), ApiError> {
    let pool_of: BTreeMap<LeaseId, (&TenantId, &PoolId)> = reports
        .iter()
        .flat_map(|report| {
            report
                .leases
                .iter()
                .map(move |lease| (lease.lease_id, (&report.tenant, &report.pool)))
        })
        .collect();
    let ids: Vec<LeaseId> = pool_of.keys().copied().collect();
    let missing = state.ledger.missing_grants(&ids).await?;
    let mut found: BTreeMap<(&TenantId, &PoolId), Vec<pools::GrantRecord>> = BTreeMap::new();
    for lease in missing {
        let Some(&(tenant, pool)) = pool_of.get(&lease) else {
            continue;
        };
        if let Some(record) = pools::get_grant(&*state.kv, tenant, pool, &lease).await? {
            found.entry((tenant, pool)).or_default().push(record);
        }
    }
    for ((tenant, pool), records) in found {
        state.ledger.record_grants(tenant, pool, &records).await?;
    }
    Ok(())
}
