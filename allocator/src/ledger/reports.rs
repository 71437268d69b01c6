//! Grants copied from etcd and the agents' reports: what each lease spent and what each region
//! admitted in fallback, taken once per report id.

use std::collections::BTreeMap;

use allot_shared::FieldError;
use allot_shared::ids::{AgentId, LeaseId, PoolId, RegionId, TenantId};
use allot_shared::wire::{Report, ReportReceipt};
use sea_query::{Alias, Expr, OnConflict, PostgresQueryBuilder, Query, SqliteQueryBuilder};
use sea_query_binder::SqlxBinder;

use super::schema::{
    FallbackAdmits, Grants, LeaseReports, LeaseSpend, SettleDebts, ShadowAdmits, UNNAMED_AGENT,
    WrittenOff, keep_larger, sum_as_bigint,
};
use super::{Database, Ledger, LedgerError, i64_of, u64_of};
use crate::pools::GrantRecord;

/// Most leases one report may carry.
pub const MAX_LEASES_PER_REPORT: usize = 10_000;

#[derive(sqlx::FromRow)]
struct GrantRow {
    lease_id: String,
    tenant: String,
    pool: String,
    region: String,
    granted: i64,
}

/// The ledger's grants of the leases some reports name ([`Ledger::known_grants`]).
pub struct KnownGrants {
    rows: BTreeMap<String, GrantRow>,
    /// Every lease the reports name, with the tenant and pool the report names it under.
    named: Vec<(TenantId, PoolId, LeaseId)>,
}

impl KnownGrants {
    /// The leases named that the ledger has no grant for, each once.
    pub fn missing(&self) -> Vec<(TenantId, PoolId, LeaseId)> {
        let mut seen = std::collections::BTreeSet::new();
        self.named
            .iter()
            .filter(|(_, _, lease)| !self.rows.contains_key(&lease.to_string()))
            .filter(|(_, _, lease)| seen.insert(*lease))
            .cloned()
            .collect()
    }

    /// Whether `report` passes the checks [`Ledger::record_reports_known`] makes against these
    /// grants (its error names the field at fault).
    pub fn check(&self, report: &Report) -> Result<(), FieldError> {
        check_report(report, &self.rows)
    }

    /// Counts `records`, grants of `tenant`'s `pool` just copied into the ledger, as known.
    pub fn add(&mut self, tenant: &TenantId, pool: &PoolId, records: &[GrantRecord]) {
        for record in records {
            self.rows.insert(
                record.lease_id.to_string(),
                GrantRow {
                    lease_id: record.lease_id.to_string(),
                    tenant: tenant.to_string(),
                    pool: pool.to_string(),
                    region: record.region.to_string(),
                    granted: i64_of(record.granted_tokens),
                },
            );
        }
    }
}

#[derive(sqlx::FromRow)]
struct RegionAmount {
    amount: i64,
}

impl Ledger {
    /// Copies committed grants into the ledger; grants already there are left as they are.
    pub async fn record_grants(
        &self,
        tenant: &TenantId,
        pool: &PoolId,
        records: &[GrantRecord],
    ) -> Result<(), LedgerError> {
        for chunk in records.chunks(200) {
            let mut insert = Query::insert();
            insert.into_table(Grants::Table).columns([
                Grants::LeaseId,
                Grants::Tenant,
                Grants::Pool,
                Grants::Region,
                Grants::Epoch,
                Grants::WindowStartMs,
                Grants::WindowEndMs,
                Grants::Granted,
                Grants::ExpiresAtMs,
            ]);
            for record in chunk {
                insert.values_panic([
                    record.lease_id.to_string().into(),
                    tenant.as_str().into(),
                    pool.as_str().into(),
                    record.region.as_str().into(),
                    i64_of(record.epoch.0).into(),
                    i64_of(record.window_start_ms).into(),
                    i64_of(record.window_end_ms).into(),
                    i64_of(record.granted_tokens).into(),
                    i64_of(record.expires_at_ms).into(),
                ]);
            }
            insert.on_conflict(OnConflict::column(Grants::LeaseId).do_nothing().to_owned());
            on_db!(self, insert, |sql, values, pool| {
                sqlx::query_with(&sql, values).execute(pool).await?;
            });
        }
        Ok(())
    }

    /// Which of `leases` the ledger has no grant for.
    pub async fn missing_grants(&self, leases: &[LeaseId]) -> Result<Vec<LeaseId>, LedgerError> {
        let known = self.grants_of(leases).await?;
        Ok(leases
            .iter()
            .filter(|l| !known.contains_key(&l.to_string()))
            .copied()
            .collect())
    }

    async fn grants_of(
        &self,
        leases: &[LeaseId],
    ) -> Result<BTreeMap<String, GrantRow>, LedgerError> {
        let mut found = BTreeMap::new();
        for chunk in leases.chunks(500) {
            let ids: Vec<String> = chunk.iter().map(ToString::to_string).collect();
            let statement = Query::select()
                .columns([
                    Grants::LeaseId,
                    Grants::Tenant,
                    Grants::Pool,
                    Grants::Region,
                    Grants::Granted,
                ])
                .from(Grants::Table)
                .and_where(Expr::col(Grants::LeaseId).is_in(ids))
                .to_owned();
            let rows: Vec<GrantRow> = on_db!(self, statement, |sql, values, pool| {
                sqlx::query_as_with(&sql, values).fetch_all(pool).await?
            });
            for row in rows {
                found.insert(row.lease_id.clone(), row);
            }
        }
        Ok(found)
    }

    /// Applies a report once per report id. Every lease must be a grant of the report's tenant, pool
    /// and region, and may not report more spent than it was granted; otherwise nothing is written.
    pub async fn record_report(
        &self,
        report: &Report,
        received_at_ms: u64,
    ) -> Result<ReportReceipt, LedgerError> {
        let known = self.known_grants(&[report]).await?;
        let results = self
            .record_reports_known(&[report], &known, received_at_ms, &BTreeMap::new())
            .await?;
        only_result(results)
    }

    /// The ledger's grants of every lease `reports` name, read once: what checks them, and which of
    /// them the ledger lacks (a report may overtake its grant's copy from the store).
    pub async fn known_grants(&self, reports: &[&Report]) -> Result<KnownGrants, LedgerError> {
        let named: Vec<(TenantId, PoolId, LeaseId)> = reports
            .iter()
            .flat_map(|report| {
                report
                    .leases
                    .iter()
                    .map(|lease| (report.tenant.clone(), report.pool.clone(), lease.lease_id))
            })
            .collect();
        let ids: Vec<LeaseId> = named.iter().map(|(_, _, lease)| *lease).collect();
        let rows = self.grants_of(&ids).await?;
        Ok(KnownGrants { rows, named })
    }

    /// Applies a round's reports in one transaction, each once per report id and checked as
    /// [`Ledger::record_report`] checks it against `known` (from [`Ledger::known_grants`], with what
    /// was copied since added). A report that fails its checks is refused alone (its error in its
    /// place, nothing of it written); the others are written. A report id seen before, in an
    /// earlier call or earlier in this one, is a duplicate and changes nothing. `returned` is what
    /// the allocator took back of the leases' unspent tokens, by lease.
    pub async fn record_reports_known(
        &self,
        reports: &[&Report],
        known: &KnownGrants,
        received_at_ms: u64,
        returned: &BTreeMap<LeaseId, u64>,
    ) -> Result<Vec<Result<ReportReceipt, FieldError>>, LedgerError> {
        let grants = &known.rows;
        let mut results: Vec<Result<ReportReceipt, FieldError>> = reports
            .iter()
            .map(|report| {
                check_report(report, grants).map(|()| ReportReceipt {
                    duplicate: false,
                    returned_tokens: 0,
                })
            })
            .collect();
        let checked: Vec<&Report> = reports
            .iter()
            .enumerate()
            .filter(|(index, _)| results[*index].is_ok())
            .map(|(_, report)| *report)
            .collect();
        if checked.is_empty() {
            return Ok(results);
        }
        macro_rules! apply {
            ($pool:expr, $builder:expr) => {{
                let mut tx = $pool.begin().await?;
                let mut inserted_ids = std::collections::BTreeSet::new();
                for statement in insert_reports(&checked, received_at_ms) {
                    let (sql, values) = statement.build_sqlx($builder);
                    let rows: Vec<(String,)> = sqlx::query_as_with(&sql, values)
                        .fetch_all(&mut *tx)
                        .await?;
                    inserted_ids.extend(rows.into_iter().map(|(id,)| id));
                }
                // The first report of each id inserted is new; every other is a duplicate,
                // whether taken before or earlier in this call.
                let mut new_reports = Vec::new();
                for (index, report) in reports.iter().enumerate() {
                    if results[index].is_ok() {
                        if inserted_ids.remove(&report.report_id) {
                            new_reports.push(*report);
                        } else {
                            results[index] = Ok(ReportReceipt {
                                duplicate: true,
                                returned_tokens: 0,
                            });
                        }
                    }
                }
                for statement in report_effects(&new_reports, received_at_ms, returned) {
                    let (sql, values) = statement.build_sqlx($builder);
                    sqlx::query_with(&sql, values).execute(&mut *tx).await?;
                }
                tx.commit().await?;
            }};
        }
        match &self.database {
            Database::Sqlite(pool) => apply!(pool, SqliteQueryBuilder),
            Database::Postgres(pool) => apply!(pool, PostgresQueryBuilder),
        }
        Ok(results)
    }

    /// Tokens reported admitted in fallback from `pool` in the window starting at
    /// `window_start_ms` (0 when none): by `agent` when one is named, else by every agent of
    /// `region` together. A restarting agent starts its count for the window here, so a restart
    /// does not re-open its allowance.
    pub async fn fallback_admitted(
        &self,
        tenant: &TenantId,
        pool: &PoolId,
        region: &RegionId,
        agent: Option<&AgentId>,
        window_start_ms: u64,
    ) -> Result<u64, LedgerError> {
        let mut statement = Query::select()
            .expr_as(
                sum_as_bigint(Expr::col(FallbackAdmits::Admitted)),
                Alias::new("amount"),
            )
            .from(FallbackAdmits::Table)
            .and_where(Expr::col(FallbackAdmits::Tenant).eq(tenant.as_str()))
            .and_where(Expr::col(FallbackAdmits::Pool).eq(pool.as_str()))
            .and_where(Expr::col(FallbackAdmits::Region).eq(region.as_str()))
            .and_where(Expr::col(FallbackAdmits::WindowStartMs).eq(i64_of(window_start_ms)))
            .to_owned();
        if let Some(agent) = agent {
            statement.and_where(Expr::col(FallbackAdmits::AgentId).eq(agent.as_str()));
        }
        let rows: Vec<RegionAmount> = on_db!(self, statement, |sql, values, db| {
            sqlx::query_as_with(&sql, values).fetch_all(db).await?
        });
        Ok(rows.iter().map(|row| u64_of(row.amount)).sum())
    }
}

impl Ledger {
    /// Tokens reported admitted in fallback from `pool` in the window starting at
    /// `window_start_ms`, by every agent of every region (0 when none).
    pub async fn pool_fallback_admitted(
        &self,
        tenant: &TenantId,
        pool: &PoolId,
        window_start_ms: u64,
    ) -> Result<u64, LedgerError> {
        let statement = Query::select()
            .expr_as(
                sum_as_bigint(Expr::col(FallbackAdmits::Admitted)),
                Alias::new("amount"),
            )
            .from(FallbackAdmits::Table)
            .and_where(Expr::col(FallbackAdmits::Tenant).eq(tenant.as_str()))
            .and_where(Expr::col(FallbackAdmits::Pool).eq(pool.as_str()))
            .and_where(Expr::col(FallbackAdmits::WindowStartMs).eq(i64_of(window_start_ms)))
            .to_owned();
        let rows: Vec<RegionAmount> = on_db!(self, statement, |sql, values, db| {
            sqlx::query_as_with(&sql, values).fetch_all(db).await?
        });
        Ok(rows.iter().map(|row| u64_of(row.amount)).sum())
    }
}

/// The result of a call to [`Ledger::record_reports_known`] with one report: there is one result
/// per report, so its absence is the ledger's failure, never a receipt.
pub fn only_result(
    results: Vec<Result<ReportReceipt, FieldError>>,
) -> Result<ReportReceipt, LedgerError> {
    debug_assert_eq!(results.len(), 1, "one result per report");
    match results.into_iter().next() {
        Some(result) => result.map_err(LedgerError::Invalid),
        None => Err(LedgerError::Invalid(FieldError::new(
            "reportId",
            "the report was not applied",
        ))),
    }
}

/// A report's bounds, and its leases against `grants`, the ledger's grants by lease id.
fn check_report(report: &Report, grants: &BTreeMap<String, GrantRow>) -> Result<(), FieldError> {
    report.check_report_id()?;
    if report.incarnation.is_some() && report.agent_id.is_none() {
        return Err(FieldError::new(
            "incarnation",
            "names a run of an agent: send agentId with it",
        ));
    }
    if report.leases.len() > MAX_LEASES_PER_REPORT {
        return Err(FieldError::new(
            "leases",
            format!("at most {MAX_LEASES_PER_REPORT} leases per report"),
        ));
    }
    for (index, lease) in report.leases.iter().enumerate() {
        let field = format!("leases[{index}]");
        let Some(grant) = grants.get(&lease.lease_id.to_string()) else {
            return Err(FieldError::new(field, "no such lease was granted"));
        };
        if grant.tenant != report.tenant.as_str()
            || grant.pool != report.pool.as_str()
            || grant.region != report.region.as_str()
        {
            return Err(FieldError::new(
                field,
                "the lease belongs to another tenant, pool or region",
            ));
        }
        if lease.spent_tokens > u64_of(grant.granted) {
            return Err(FieldError::new(
                format!("{field}.spent"),
                format!(
                    "{} exceeds the {} tokens granted to the lease",
                    lease.spent_tokens, grant.granted
                ),
            ));
        }
        if lease.unspent_tokens > 0 && !lease.final_report {
            return Err(FieldError::new(
                format!("{field}.unspent"),
                "only a final line may give tokens back: the lease must have ended",
            ));
        }
        if lease.spent_tokens.saturating_add(lease.unspent_tokens) > u64_of(grant.granted) {
            return Err(FieldError::new(
                format!("{field}.unspent"),
                format!(
                    "spent {} and unspent {} exceed the {} tokens granted to the lease",
                    lease.spent_tokens, lease.unspent_tokens, grant.granted
                ),
            ));
        }
    }
    Ok(())
}

/// The leases `report` gives tokens back from, as the grant worker takes them: its final lines
/// with unspent tokens (checked against the grants first: [`KnownGrants::check`]).
pub fn lease_returns(report: &Report) -> Vec<crate::grants::LeaseReturn> {
    report
        .leases
        .iter()
        .filter(|lease| lease.final_report && lease.unspent_tokens > 0)
        .map(|lease| crate::grants::LeaseReturn {
            lease_id: lease.lease_id,
            region: report.region.clone(),
            spent_tokens: lease.spent_tokens,
            unspent_tokens: lease.unspent_tokens,
        })
        .collect()
}

/// Rows a multi-row statement carries: well inside SQLite's and PostgreSQL's bound parameters.
const ROWS_PER_STATEMENT: usize = 500;

/// The reports' own rows, once only by id: multi-row inserts that answer which ids they inserted.
fn insert_reports(reports: &[&Report], received_at_ms: u64) -> Vec<sea_query::InsertStatement> {
    reports
        .chunks(ROWS_PER_STATEMENT)
        .map(|chunk| {
            let mut insert = Query::insert();
            insert.into_table(LeaseReports::Table).columns([
                LeaseReports::ReportId,
                LeaseReports::Region,
                LeaseReports::Tenant,
                LeaseReports::Pool,
                LeaseReports::WindowStartMs,
                LeaseReports::ReceivedAtMs,
                LeaseReports::FallbackAdmitted,
                LeaseReports::LeasesJson,
                LeaseReports::AgentId,
                LeaseReports::Incarnation,
            ]);
            for report in chunk {
                let leases_json = serde_json::to_string(&report.leases).unwrap_or_default();
                insert.values_panic([
                    report.report_id.as_str().into(),
                    report.region.as_str().into(),
                    report.tenant.as_str().into(),
                    report.pool.as_str().into(),
                    i64_of(report.window_start_ms).into(),
                    i64_of(received_at_ms).into(),
                    i64_of(report.fallback_admitted_tokens).into(),
                    leases_json.into(),
                    report
                        .agent_id
                        .as_ref()
                        .map(|a| a.as_str().to_owned())
                        .into(),
                    report.incarnation.map(|i| i.to_string()).into(),
                ]);
            }
            insert
                .on_conflict(
                    OnConflict::column(LeaseReports::ReportId)
                        .do_nothing()
                        .to_owned(),
                )
                .returning_col(LeaseReports::ReportId)
                .to_owned()
        })
        .collect()
}

/// What new reports change, as multi-row upserts: each lease's cumulative spend, finality and
/// what was taken back of it (`returned`, by lease), and each agent's cumulative fallback, shadow, settle-debt and written-off figures per window, the
/// larger value kept (reports are cumulative and may arrive out of order). Keys are merged first:
/// one statement may not touch a row twice.
fn report_effects(
    reports: &[&Report],
    received_at_ms: u64,
    returned: &BTreeMap<LeaseId, u64>,
) -> Vec<sea_query::InsertStatement> {
    let mut statements = upsert_spends(reports, received_at_ms, returned);
    statements.extend(upsert_figures(FallbackAdmits::Table, reports, |r| {
        r.fallback_admitted_tokens
    }));
    statements.extend(upsert_figures(ShadowAdmits::Table, reports, |r| {
        r.shadow_admitted_tokens
    }));
    statements.extend(upsert_figures(SettleDebts::Table, reports, |r| {
        r.settle_debt_tokens
    }));
    statements.extend(upsert_figures(WrittenOff::Table, reports, |r| {
        r.written_off_tokens
    }));
    statements
}

/// Each lease's cumulative spend, finality and tokens taken back: the larger values kept.
fn upsert_spends(
    reports: &[&Report],
    received_at_ms: u64,
    returned: &BTreeMap<LeaseId, u64>,
) -> Vec<sea_query::InsertStatement> {
    let mut merged: BTreeMap<LeaseId, (u64, bool, u64)> = BTreeMap::new();
    for lease in reports.iter().flat_map(|report| &report.leases) {
        let entry = merged.entry(lease.lease_id).or_default();
        *entry = (
            entry.0.max(lease.spent_tokens),
            entry.1 || lease.final_report,
            returned.get(&lease.lease_id).copied().unwrap_or(0),
        );
    }
    let rows: Vec<(LeaseId, (u64, bool, u64))> = merged.into_iter().collect();
    rows.chunks(ROWS_PER_STATEMENT)
        .map(|chunk| {
            let mut insert = Query::insert();
            insert.into_table(LeaseSpend::Table).columns([
                LeaseSpend::LeaseId,
                LeaseSpend::Spent,
                LeaseSpend::FinalReport,
                LeaseSpend::UpdatedAtMs,
                LeaseSpend::Returned,
            ]);
            for (lease_id, (spent_tokens, final_report, returned_tokens)) in chunk {
                insert.values_panic([
                    lease_id.to_string().into(),
                    i64_of(*spent_tokens).into(),
                    i64::from(*final_report).into(),
                    i64_of(received_at_ms).into(),
                    i64_of(*returned_tokens).into(),
                ]);
            }
            insert
                .on_conflict(
                    OnConflict::column(LeaseSpend::LeaseId)
                        .values([
                            (
                                LeaseSpend::Spent,
                                keep_larger(LeaseSpend::Table, LeaseSpend::Spent),
                            ),
                            (
                                LeaseSpend::FinalReport,
                                keep_larger(LeaseSpend::Table, LeaseSpend::FinalReport),
                            ),
                            (
                                LeaseSpend::Returned,
                                keep_larger(LeaseSpend::Table, LeaseSpend::Returned),
                            ),
                            (
                                LeaseSpend::UpdatedAtMs,
                                Expr::col((Alias::new("excluded"), LeaseSpend::UpdatedAtMs)).into(),
                            ),
                        ])
                        .to_owned(),
                )
                .to_owned()
        })
        .collect()
}

/// The reporting agents' cumulative figure (`figure` of each report: fallback, shadow, settle debt
/// or written-off tokens) per window, into `table` (all four have the same columns): the larger
/// value kept, zeros not written. A report naming no agent writes the region's unnamed agent.
fn upsert_figures<T: sea_query::Iden + Copy + 'static>(
    table: T,
    reports: &[&Report],
    figure: impl Fn(&Report) -> u64,
) -> Vec<sea_query::InsertStatement> {
    type Key<'a> = (&'a str, &'a str, &'a str, u64, &'a str);
    let mut merged: BTreeMap<Key<'_>, u64> = BTreeMap::new();
    for report in reports {
        let tokens = figure(report);
        if tokens == 0 {
            continue;
        }
        let agent = report
            .agent_id
            .as_ref()
            .map_or(UNNAMED_AGENT, AgentId::as_str);
        let key = (
            report.tenant.as_str(),
            report.pool.as_str(),
            report.region.as_str(),
            report.window_start_ms,
            agent,
        );
        let entry = merged.entry(key).or_default();
        *entry = (*entry).max(tokens);
    }
    let rows: Vec<(Key<'_>, u64)> = merged.into_iter().collect();
    rows.chunks(ROWS_PER_STATEMENT)
        .map(|chunk| {
            let mut insert = Query::insert();
            insert.into_table(table).columns([
                FallbackAdmits::Tenant,
                FallbackAdmits::Pool,
                FallbackAdmits::Region,
                FallbackAdmits::WindowStartMs,
                FallbackAdmits::AgentId,
                FallbackAdmits::Admitted,
            ]);
            for ((tenant, pool, region, window_start_ms, agent), tokens) in chunk {
                insert.values_panic([
                    (*tenant).into(),
                    (*pool).into(),
                    (*region).into(),
                    i64_of(*window_start_ms).into(),
                    (*agent).into(),
                    i64_of(*tokens).into(),
                ]);
            }
            insert
                .on_conflict(
                    OnConflict::columns([
                        FallbackAdmits::Tenant,
                        FallbackAdmits::Pool,
                        FallbackAdmits::Region,
                        FallbackAdmits::WindowStartMs,
                        FallbackAdmits::AgentId,
                    ])
                    .value(
                        FallbackAdmits::Admitted,
                        keep_larger(table, FallbackAdmits::Admitted),
                    )
                    .to_owned(),
                )
                .to_owned()
        })
        .collect()
}
