//! Agents' reports to the ledger, for their own region only: one at a time (`POST /v1/reports`) or
//! a round in one call (`POST /v1/reports/batch`), each taken once per report id.

use std::collections::BTreeMap;

use allot_shared::FieldError;
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
use crate::grants::GrantFailure;
use crate::ledger::LedgerError;
use crate::ledger::reports::KnownGrants;
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
    let receipt = record(&state, &[&report])
        .await?
        .into_iter()
        .next()
        .unwrap_or_else(|| {
            Err(
                LedgerError::Invalid(FieldError::new("reportId", "the report was not applied"))
                    .into(),
            )
        })?;
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
            Err(refused) => refused_entry(*index, refused),
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

/// Checks and writes `reports` in the ledger, one result each, in order, after the allocator
/// took back what their final lines give back. Grants reach the ledger asynchronously and a report
/// may overtake them; etcd is the authority: what the ledger lacks of the leases the reports name
/// is copied from there first (the ledger's grants read once, the store's in round trips of many).
async fn record(
    state: &ApiState,
    reports: &[&Report],
) -> Result<Vec<Result<ReportReceipt, ApiError>>, ApiError> {
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
    let taken_back = take_back(state, reports, &known).await;
    // A report whose tokens may or may not have been taken back is not written: asked again
    // with the same report id, it is answered from the store's marks.
    let writable: Vec<&Report> = reports
        .iter()
        .zip(&taken_back)
        .filter(|(_, taken)| taken.is_ok())
        .map(|(report, _)| *report)
        .collect();
    let returned: BTreeMap<LeaseId, u64> = taken_back
        .iter()
        .filter_map(|taken| taken.as_ref().ok())
        .flatten()
        .copied()
        .collect();
    let mut written = state
        .ledger
        .record_reports_known(&writable, &known, state.clock.now_ms(), &returned)
        .await?
        .into_iter();
    Ok(taken_back
        .into_iter()
        .map(|taken| {
            let taken = taken?;
            let mut receipt = written
                .next()
                .unwrap_or_else(|| Err(FieldError::new("reportId", "the report was not applied")))
                .map_err(|invalid| ApiError::from(LedgerError::Invalid(invalid)))?;
            receipt.returned_tokens = taken.iter().map(|(_, tokens)| tokens).sum();
            Ok(receipt)
        })
        .collect())
}

/// Has the allocator take back what each checked report's final lines give back: per report, the
/// tokens taken back by lease, or why it cannot be known whether they were (a store failure; the
/// report is to be sent again). Where this node does not lead nothing is taken back now, but an
/// earlier call may have been (its mark says how much, and the ledger records that).
async fn take_back(
    state: &ApiState,
    reports: &[&Report],
    known: &KnownGrants,
) -> Vec<Result<Vec<(LeaseId, u64)>, ApiError>> {
    let per_report = reports.iter().map(|report| async move {
        if known.check(report).is_err() {
            // Refused by the ledger's checks, which say why.
            return Ok(Vec::new());
        }
        let returns = crate::ledger::reports::lease_returns(report);
        let taken = futures::future::join_all(returns.into_iter().map(|lease| async move {
            let lease_id = lease.lease_id;
            match state
                .grantor
                .take_back(&report.tenant, &report.pool, lease)
                .await
            {
                Ok(tokens) => Ok((lease_id, tokens)),
                Err(GrantFailure::NotLeader(_) | GrantFailure::UnknownPool) => {
                    let marked =
                        pools::get_return(&*state.kv, &report.tenant, &report.pool, &lease_id)
                            .await?;
                    Ok((lease_id, marked.unwrap_or(0)))
                }
                Err(failure) => Err(ApiError::from(failure)),
            }
        }))
        .await;
        taken.into_iter().collect()
    });
    futures::future::join_all(per_report).await
}
