//! The accounting ledger (SQL, through sqlx): pool configuration history, every grant, every report,
//! what each lease spent and what each region admitted in fallback, and the per-window accounting
//! computed from them.
//!
//! SQLite is the default (a file in the data directory), PostgreSQL the production choice; the schema
//! in `migrations/` is portable SQL applied at startup to either. Queries are built with sea-query's
//! typed builder for the connected dialect and bound as parameters: no SQL is assembled from strings.
//! etcd stays the authority for live state; the ledger is the durable history (I12: metrics are not a
//! ledger, and neither is etcd, whose grant records expire).

use std::collections::BTreeMap;

use allot_shared::ids::{LeaseId, PoolId, RegionId, TenantId};
use allot_shared::lease::{LeaseClamping, OvershootBound, PoolConfig, overshoot_tokens};
use sea_query::{
    Alias, Cond, Expr, Func, Iden, JoinType, OnConflict, Order, PostgresQueryBuilder, Query,
    SqliteQueryBuilder,
};
use sea_query_binder::SqlxBinder;
use serde::{Deserialize, Serialize};
use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use sqlx::{PgPool, SqlitePool};

use crate::pools::GrantRecord;
pub use allot_shared::wire::{Report, ReportLease, ReportReceipt};

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

/// Most windows one `windows` query returns.
pub const MAX_WINDOWS: u64 = 1_000;
/// Most leases one report may carry.
pub const MAX_LEASES_PER_REPORT: usize = 10_000;
/// Largest pool of connections to the ledger database.
pub const MAX_CONNECTIONS: u32 = 8;

/// A ledger failure.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// The input is inconsistent with the ledger (a client error; nothing was written).
    #[error("{field}: {message}")]
    Invalid {
        /// The field at fault.
        field: String,
        /// What is wrong.
        message: String,
    },
    /// The database failed.
    #[error("ledger database error: {0}")]
    Database(#[from] sqlx::Error),
    /// Migrations failed.
    #[error("ledger migration failed: {0}")]
    Migration(#[from] sqlx::migrate::MigrateError),
    /// The URL names no supported database.
    #[error("unsupported ledger URL {0:?}: use sqlite://<file> or postgres://...")]
    UnsupportedUrl(String),
}

#[derive(Iden, Clone, Copy)]
enum PoolConfigHistory {
    Table,
    ChangeId,
    Tenant,
    Pool,
    Version,
    Actor,
    ChangedAtMs,
    ConfigJson,
}

#[derive(Iden, Clone, Copy)]
enum PolicyBundles {
    Table,
    Version,
    Checksum,
    PublishedAt,
    Actor,
    StoredAtMs,
    BundleJson,
}

#[derive(Iden, Clone, Copy)]
enum AuditLog {
    Table,
    EntryId,
    AtMs,
    Actor,
    Action,
    Target,
    Version,
    Detail,
}

/// The audit log's columns, in the order entries are written and read.
const AUDIT_COLUMNS: [AuditLog; 7] = [
    AuditLog::EntryId,
    AuditLog::AtMs,
    AuditLog::Actor,
    AuditLog::Action,
    AuditLog::Target,
    AuditLog::Version,
    AuditLog::Detail,
];

/// Most audit entries one read returns.
pub const MAX_AUDIT_ENTRIES: u64 = 1_000;

/// One operator change, as the audit log keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow)]
#[serde(rename_all = "camelCase")]
pub struct AuditEntry {
    /// UUID v7.
    pub entry_id: String,
    /// When, epoch ms (allocator clock).
    #[sqlx(try_from = "i64")]
    pub at_ms: u64,
    /// `<role>:<token id>`.
    pub actor: String,
    /// `pool.put`, `pool.delete`, `policy.publish`, `policy.promote`, `token.mint`, `token.revoke`.
    pub action: String,
    /// What changed: `tenant/pool`, a policy version, a token id.
    pub target: String,
    /// The version after the change (0 when none applies).
    #[sqlx(try_from = "i64")]
    pub version: u64,
    /// Short JSON with the change's particulars (never a secret).
    pub detail: String,
}

#[derive(Iden, Clone, Copy)]
enum Grants {
    Table,
    LeaseId,
    Tenant,
    Pool,
    Region,
    Epoch,
    WindowStartMs,
    WindowEndMs,
    Granted,
    ExpiresAtMs,
}

#[derive(Iden, Clone, Copy)]
enum LeaseReports {
    Table,
    ReportId,
    Region,
    Tenant,
    Pool,
    WindowStartMs,
    ReceivedAtMs,
    FallbackAdmitted,
    LeasesJson,
}

#[derive(Iden, Clone, Copy)]
enum LeaseSpend {
    Table,
    LeaseId,
    Spent,
    FinalReport,
    UpdatedAtMs,
}

#[derive(Iden, Clone, Copy)]
enum FallbackAdmits {
    Table,
    Tenant,
    Pool,
    Region,
    WindowStartMs,
    Admitted,
}

#[derive(Clone)]
enum Database {
    Sqlite(SqlitePool),
    Postgres(PgPool),
}

/// Runs a sea-query statement on whichever database is connected. `$run` is a closure-like pair of
/// (sql, values) -> future, applied with the dialect's pool.
macro_rules! on_db {
    ($ledger:expr, $statement:expr, |$sql:ident, $values:ident, $pool:ident| $body:expr) => {
        match &$ledger.database {
            Database::Sqlite($pool) => {
                let ($sql, $values) = $statement.build_sqlx(SqliteQueryBuilder);
                $body
            }
            Database::Postgres($pool) => {
                let ($sql, $values) = $statement.build_sqlx(PostgresQueryBuilder);
                $body
            }
        }
    };
}

/// The ledger.
#[derive(Clone)]
pub struct Ledger {
    database: Database,
}

fn i64_of(value: u64) -> i64 {
    i64::try_from(value).unwrap_or(i64::MAX)
}

fn u64_of(value: i64) -> u64 {
    u64::try_from(value).unwrap_or(0)
}

/// One change of a pool's configuration.
#[derive(Debug, Clone, Copy)]
pub struct PoolChange<'a> {
    /// Unique id of the change (a UUID v7).
    pub change_id: &'a str,
    /// The tenant.
    pub tenant: &'a TenantId,
    /// The pool.
    pub pool: &'a PoolId,
    /// The pool's version after the change; 0 for a deletion.
    pub version: u64,
    /// Who made it (role and token fingerprint).
    pub actor: &'a str,
    /// When, epoch ms.
    pub changed_at_ms: u64,
    /// The configuration as stored; `{}` for a deletion.
    pub config_json: &'a str,
}

/// One window of a pool, as the ledger accounts for it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct WindowRow {
    /// Window start, epoch ms.
    pub window_start_ms: u64,
    /// Window end, epoch ms.
    pub window_end_ms: u64,
    /// `G` (from the pool's current configuration).
    pub limit: u64,
    /// Tokens granted in the window.
    pub granted: u64,
    /// Tokens granted per region.
    pub granted_by_region: BTreeMap<RegionId, u64>,
    /// Tokens reported spent from the window's leases.
    pub spent: u64,
    /// Granted minus spent, over expired leases whose final report arrived.
    pub stranded: u64,
    /// Granted minus reported spend, over expired leases whose final report never arrived.
    pub unreported: u64,
    /// Tokens admitted in fallback, all regions.
    pub fallback_admitted: u64,
    /// Fallback admits per region.
    pub fallback_admitted_by_region: BTreeMap<RegionId, u64>,
    /// spent + fallbackAdmitted.
    pub admitted: u64,
    /// max(0, admitted - limit).
    pub overshoot: u64,
    /// The design's bound for this pool's configuration.
    pub bound: u64,
}

#[derive(sqlx::FromRow)]
struct WindowKey {
    window_start_ms: i64,
    window_end_ms: i64,
}

#[derive(sqlx::FromRow)]
struct RegionAmount {
    window_start_ms: i64,
    region: String,
    amount: i64,
}

#[derive(sqlx::FromRow)]
struct WindowAmounts {
    window_start_ms: i64,
    spent: i64,
    stranded: i64,
    unreported: i64,
}

#[derive(sqlx::FromRow)]
struct GrantRow {
    lease_id: String,
    tenant: String,
    pool: String,
    region: String,
    granted: i64,
}

fn sum_as_bigint(expr: impl Into<sea_query::SimpleExpr>) -> sea_query::SimpleExpr {
    Func::cast_as(
        Func::coalesce([Func::sum(expr).into(), Expr::val(0i64).into()]),
        Alias::new("BIGINT"),
    )
    .into()
}

impl Ledger {
    /// Connects to `url` (`sqlite://<file>` creates the file; `postgres://...`) and applies the
    /// migrations.
    pub async fn connect(url: &str) -> Result<Self, LedgerError> {
        let database = if let Some(path) = url.strip_prefix("sqlite://") {
            let options = SqliteConnectOptions::new()
                .filename(path)
                .create_if_missing(true)
                .journal_mode(sqlx::sqlite::SqliteJournalMode::Wal)
                .busy_timeout(std::time::Duration::from_secs(5));
            let pool = SqlitePoolOptions::new()
                .max_connections(MAX_CONNECTIONS)
                .connect_with(options)
                .await?;
            MIGRATOR.run(&pool).await?;
            Database::Sqlite(pool)
        } else if url.starts_with("postgres://") || url.starts_with("postgresql://") {
            let pool = PgPoolOptions::new()
                .max_connections(MAX_CONNECTIONS)
                .acquire_timeout(std::time::Duration::from_secs(5))
                .connect(url)
                .await?;
            MIGRATOR.run(&pool).await?;
            Database::Postgres(pool)
        } else {
            return Err(LedgerError::UnsupportedUrl(url.to_owned()));
        };
        Ok(Self { database })
    }

    /// Records a pool configuration change.
    pub async fn record_pool_change(&self, change: &PoolChange<'_>) -> Result<(), LedgerError> {
        let statement = Query::insert()
            .into_table(PoolConfigHistory::Table)
            .columns([
                PoolConfigHistory::ChangeId,
                PoolConfigHistory::Tenant,
                PoolConfigHistory::Pool,
                PoolConfigHistory::Version,
                PoolConfigHistory::Actor,
                PoolConfigHistory::ChangedAtMs,
                PoolConfigHistory::ConfigJson,
            ])
            .values_panic([
                change.change_id.into(),
                change.tenant.as_str().into(),
                change.pool.as_str().into(),
                i64_of(change.version).into(),
                change.actor.into(),
                i64_of(change.changed_at_ms).into(),
                change.config_json.into(),
            ])
            .to_owned();
        on_db!(self, statement, |sql, values, pool| {
            sqlx::query_with(&sql, values).execute(pool).await?;
        });
        Ok(())
    }

    /// Appends `entry` to the audit log.
    pub async fn record_audit(&self, entry: &AuditEntry) -> Result<(), LedgerError> {
        let statement = Query::insert()
            .into_table(AuditLog::Table)
            .columns(AUDIT_COLUMNS)
            .values_panic([
                entry.entry_id.as_str().into(),
                i64_of(entry.at_ms).into(),
                entry.actor.as_str().into(),
                entry.action.as_str().into(),
                entry.target.as_str().into(),
                i64_of(entry.version).into(),
                entry.detail.as_str().into(),
            ])
            .to_owned();
        on_db!(self, statement, |sql, values, pool| {
            sqlx::query_with(&sql, values).execute(pool).await?;
        });
        Ok(())
    }

    /// The latest `last` audit entries (at most [`MAX_AUDIT_ENTRIES`]), newest first.
    pub async fn audit_entries(&self, last: u64) -> Result<Vec<AuditEntry>, LedgerError> {
        let statement = Query::select()
            .columns(AUDIT_COLUMNS)
            .from(AuditLog::Table)
            // Entry ids are UUID v7 in canonical text: they sort in the order they were written.
            .order_by(AuditLog::EntryId, Order::Desc)
            .limit(last.min(MAX_AUDIT_ENTRIES))
            .to_owned();
        let rows: Vec<AuditEntry> = on_db!(self, statement, |sql, values, db| {
            sqlx::query_as_with(&sql, values).fetch_all(db).await?
        });
        Ok(rows)
    }

    /// Records a published policy bundle (once per version).
    pub async fn record_bundle(
        &self,
        bundle: &allot_shared::policy::PolicyBundle,
        actor: &str,
        stored_at_ms: u64,
    ) -> Result<(), LedgerError> {
        let statement = Query::insert()
            .into_table(PolicyBundles::Table)
            .columns([
                PolicyBundles::Version,
                PolicyBundles::Checksum,
                PolicyBundles::PublishedAt,
                PolicyBundles::Actor,
                PolicyBundles::StoredAtMs,
                PolicyBundles::BundleJson,
            ])
            .values_panic([
                i64_of(bundle.version()).into(),
                bundle.checksum().into(),
                bundle.published_at().unwrap_or_default().into(),
                actor.into(),
                i64_of(stored_at_ms).into(),
                bundle.to_json().to_string().into(),
            ])
            .on_conflict(
                OnConflict::column(PolicyBundles::Version)
                    .do_nothing()
                    .to_owned(),
            )
            .to_owned();
        on_db!(self, statement, |sql, values, pool| {
            sqlx::query_with(&sql, values).execute(pool).await?;
        });
        Ok(())
    }

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
                    i64_of(record.granted).into(),
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
        let invalid = |field: String, message: String| LedgerError::Invalid { field, message };
        if report.report_id.is_empty() || report.report_id.len() > 64 {
            return Err(invalid(
                "reportId".into(),
                "must be 1 to 64 characters".into(),
            ));
        }
        if report.leases.len() > MAX_LEASES_PER_REPORT {
            return Err(invalid(
                "leases".into(),
                format!("at most {MAX_LEASES_PER_REPORT} leases per report"),
            ));
        }
        let ids: Vec<LeaseId> = report.leases.iter().map(|l| l.lease_id).collect();
        let grants = self.grants_of(&ids).await?;
        for (index, lease) in report.leases.iter().enumerate() {
            let field = format!("leases[{index}]");
            let Some(grant) = grants.get(&lease.lease_id.to_string()) else {
                return Err(invalid(field, "no such lease was granted".into()));
            };
            if grant.tenant != report.tenant.as_str()
                || grant.pool != report.pool.as_str()
                || grant.region != report.region.as_str()
            {
                return Err(invalid(
                    field,
                    "the lease belongs to another tenant, pool or region".into(),
                ));
            }
            if lease.spent_tokens > u64_of(grant.granted) {
                return Err(invalid(
                    format!("{field}.spent"),
                    format!(
                        "{} exceeds the {} tokens granted to the lease",
                        lease.spent_tokens, grant.granted
                    ),
                ));
            }
        }
        let leases_json = serde_json::to_string(&report.leases).unwrap_or_default();
        let insert_report = Query::insert()
            .into_table(LeaseReports::Table)
            .columns([
                LeaseReports::ReportId,
                LeaseReports::Region,
                LeaseReports::Tenant,
                LeaseReports::Pool,
                LeaseReports::WindowStartMs,
                LeaseReports::ReceivedAtMs,
                LeaseReports::FallbackAdmitted,
                LeaseReports::LeasesJson,
            ])
            .values_panic([
                report.report_id.as_str().into(),
                report.region.as_str().into(),
                report.tenant.as_str().into(),
                report.pool.as_str().into(),
                i64_of(report.window_start_ms).into(),
                i64_of(received_at_ms).into(),
                i64_of(report.fallback_admitted_tokens).into(),
                leases_json.into(),
            ])
            .on_conflict(
                OnConflict::column(LeaseReports::ReportId)
                    .do_nothing()
                    .to_owned(),
            )
            .to_owned();
        let mut spends = Vec::new();
        for lease in &report.leases {
            spends.push(
                Query::insert()
                    .into_table(LeaseSpend::Table)
                    .columns([
                        LeaseSpend::LeaseId,
                        LeaseSpend::Spent,
                        LeaseSpend::FinalReport,
                        LeaseSpend::UpdatedAtMs,
                    ])
                    .values_panic([
                        lease.lease_id.to_string().into(),
                        i64_of(lease.spent_tokens).into(),
                        i64::from(lease.final_report).into(),
                        i64_of(received_at_ms).into(),
                    ])
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
                                    LeaseSpend::UpdatedAtMs,
                                    Expr::col((Alias::new("excluded"), LeaseSpend::UpdatedAtMs))
                                        .into(),
                                ),
                            ])
                            .to_owned(),
                    )
                    .to_owned(),
            );
        }
        let fallback = Query::insert()
            .into_table(FallbackAdmits::Table)
            .columns([
                FallbackAdmits::Tenant,
                FallbackAdmits::Pool,
                FallbackAdmits::Region,
                FallbackAdmits::WindowStartMs,
                FallbackAdmits::Admitted,
            ])
            .values_panic([
                report.tenant.as_str().into(),
                report.pool.as_str().into(),
                report.region.as_str().into(),
                i64_of(report.window_start_ms).into(),
                i64_of(report.fallback_admitted_tokens).into(),
            ])
            .on_conflict(
                OnConflict::columns([
                    FallbackAdmits::Tenant,
                    FallbackAdmits::Pool,
                    FallbackAdmits::Region,
                    FallbackAdmits::WindowStartMs,
                ])
                .value(
                    FallbackAdmits::Admitted,
                    keep_larger(FallbackAdmits::Table, FallbackAdmits::Admitted),
                )
                .to_owned(),
            )
            .to_owned();
        macro_rules! apply {
            ($pool:expr, $builder:expr) => {{
                let mut tx = $pool.begin().await?;
                let (sql, values) = insert_report.build_sqlx($builder);
                let inserted = sqlx::query_with(&sql, values).execute(&mut *tx).await?;
                if inserted.rows_affected() == 0 {
                    tx.rollback().await?;
                    return Ok(ReportReceipt { duplicate: true });
                }
                for spend in &spends {
                    let (sql, values) = spend.build_sqlx($builder);
                    sqlx::query_with(&sql, values).execute(&mut *tx).await?;
                }
                if report.fallback_admitted_tokens > 0 {
                    let (sql, values) = fallback.build_sqlx($builder);
                    sqlx::query_with(&sql, values).execute(&mut *tx).await?;
                }
                tx.commit().await?;
            }};
        }
        match &self.database {
            Database::Sqlite(pool) => apply!(pool, SqliteQueryBuilder),
            Database::Postgres(pool) => apply!(pool, PostgresQueryBuilder),
        }
        Ok(ReportReceipt { duplicate: false })
    }

    /// Tokens `region` has reported admitting in fallback from `pool` in the window starting at
    /// `window_start_ms` (0 when none). A restarting agent starts its count for the window here,
    /// so a restart does not re-open the region's allowance.
    pub async fn fallback_admitted(
        &self,
        tenant: &TenantId,
        pool: &PoolId,
        region: &RegionId,
        window_start_ms: u64,
    ) -> Result<u64, LedgerError> {
        let statement = Query::select()
            .column(FallbackAdmits::WindowStartMs)
            .expr_as(Expr::col(FallbackAdmits::Region), Alias::new("region"))
            .expr_as(Expr::col(FallbackAdmits::Admitted), Alias::new("amount"))
            .from(FallbackAdmits::Table)
            .and_where(Expr::col(FallbackAdmits::Tenant).eq(tenant.as_str()))
            .and_where(Expr::col(FallbackAdmits::Pool).eq(pool.as_str()))
            .and_where(Expr::col(FallbackAdmits::Region).eq(region.as_str()))
            .and_where(Expr::col(FallbackAdmits::WindowStartMs).eq(i64_of(window_start_ms)))
            .to_owned();
        let rows: Vec<RegionAmount> = on_db!(self, statement, |sql, values, db| {
            sqlx::query_as_with(&sql, values).fetch_all(db).await?
        });
        Ok(rows
            .iter()
            .map(|row| u64::try_from(row.amount).unwrap_or(0))
            .max()
            .unwrap_or(0))
    }

    /// The last `last` windows of a pool that saw grants or fallback admits, newest first.
    pub async fn windows(
        &self,
        tenant: &TenantId,
        pool: &PoolId,
        config: &PoolConfig,
        last: u64,
        now_ms: u64,
    ) -> Result<Vec<WindowRow>, LedgerError> {
        let last = last.clamp(1, MAX_WINDOWS);
        let of_pool = |table: Alias| {
            Cond::all()
                .add(Expr::col((table.clone(), Alias::new("tenant"))).eq(tenant.as_str()))
                .add(Expr::col((table, Alias::new("pool"))).eq(pool.as_str()))
        };
        let windows_statement = Query::select()
            .distinct()
            .columns([Grants::WindowStartMs, Grants::WindowEndMs])
            .from(Grants::Table)
            .cond_where(of_pool(Alias::new("grants")))
            .order_by(Grants::WindowStartMs, Order::Desc)
            .limit(last)
            .to_owned();
        let mut keys: Vec<WindowKey> = on_db!(self, windows_statement, |sql, values, db| {
            sqlx::query_as_with(&sql, values).fetch_all(db).await?
        });
        let fallback_statement = Query::select()
            .column(FallbackAdmits::WindowStartMs)
            .expr_as(Expr::col(FallbackAdmits::Region), Alias::new("region"))
            .expr_as(Expr::col(FallbackAdmits::Admitted), Alias::new("amount"))
            .from(FallbackAdmits::Table)
            .cond_where(of_pool(Alias::new("fallback_admits")))
            .order_by(FallbackAdmits::WindowStartMs, Order::Desc)
            .limit(last * 64)
            .to_owned();
        let fallback_rows: Vec<RegionAmount> =
            on_db!(self, fallback_statement, |sql, values, db| {
                sqlx::query_as_with(&sql, values).fetch_all(db).await?
            });
        let window_ms = i64_of(config.window_ms().get());
        for row in &fallback_rows {
            if !keys
                .iter()
                .any(|k| k.window_start_ms == row.window_start_ms)
            {
                keys.push(WindowKey {
                    window_start_ms: row.window_start_ms,
                    window_end_ms: row.window_start_ms + window_ms,
                });
            }
        }
        keys.sort_by_key(|k| std::cmp::Reverse(k.window_start_ms));
        keys.truncate(usize::try_from(last).unwrap_or(usize::MAX));
        let Some(oldest) = keys.last().map(|k| k.window_start_ms) else {
            return Ok(Vec::new());
        };
        let in_range = of_pool(Alias::new("grants"))
            .add(Expr::col((Grants::Table, Grants::WindowStartMs)).gte(oldest));
        let granted_statement = Query::select()
            .column(Grants::WindowStartMs)
            .column(Grants::Region)
            .expr_as(
                sum_as_bigint(Expr::col(Grants::Granted)),
                Alias::new("amount"),
            )
            .from(Grants::Table)
            .cond_where(in_range.clone())
            .group_by_col(Grants::WindowStartMs)
            .group_by_col(Grants::Region)
            .to_owned();
        let granted_rows: Vec<RegionAmount> = on_db!(self, granted_statement, |sql, values, db| {
            sqlx::query_as_with(&sql, values).fetch_all(db).await?
        });
        let expired = Expr::col((Grants::Table, Grants::ExpiresAtMs)).lte(i64_of(now_ms));
        let spent = Expr::col((LeaseSpend::Table, LeaseSpend::Spent));
        let granted = Expr::col((Grants::Table, Grants::Granted));
        let is_final = Expr::col((LeaseSpend::Table, LeaseSpend::FinalReport)).eq(1i64);
        let stranded_case = Expr::case(
            Cond::all().add(expired.clone()).add(is_final.clone()),
            granted.clone().sub(Func::coalesce([
                spent.clone().into(),
                Expr::val(0i64).into(),
            ])),
        )
        .finally(0i64);
        let unreported_case = Expr::case(
            Cond::all().add(expired).add(
                Cond::any()
                    .add(Expr::col((LeaseSpend::Table, LeaseSpend::FinalReport)).is_null())
                    .add(is_final.not()),
            ),
            granted.sub(Func::coalesce([
                spent.clone().into(),
                Expr::val(0i64).into(),
            ])),
        )
        .finally(0i64);
        let amounts_statement = Query::select()
            .expr_as(
                Expr::col((Grants::Table, Grants::WindowStartMs)),
                Alias::new("window_start_ms"),
            )
            .expr_as(sum_as_bigint(spent), Alias::new("spent"))
            .expr_as(sum_as_bigint(stranded_case), Alias::new("stranded"))
            .expr_as(sum_as_bigint(unreported_case), Alias::new("unreported"))
            .from(Grants::Table)
            .join(
                JoinType::LeftJoin,
                LeaseSpend::Table,
                Expr::col((LeaseSpend::Table, LeaseSpend::LeaseId))
                    .equals((Grants::Table, Grants::LeaseId)),
            )
            .cond_where(in_range)
            .group_by_col((Grants::Table, Grants::WindowStartMs))
            .to_owned();
        let amounts: Vec<WindowAmounts> = on_db!(self, amounts_statement, |sql, values, db| {
            sqlx::query_as_with(&sql, values).fetch_all(db).await?
        });
        let bound = OvershootBound::for_design(config, LeaseClamping::Clamped, 1, 0).total_tokens();
        let limit = config.limit_tokens();
        let region = |name: &str| RegionId::parse(name).ok();
        let rows = keys
            .into_iter()
            .map(|key| {
                let granted_by_region: BTreeMap<RegionId, u64> = granted_rows
                    .iter()
                    .filter(|r| r.window_start_ms == key.window_start_ms)
                    .filter_map(|r| Some((region(&r.region)?, u64_of(r.amount))))
                    .collect();
                let fallback_admitted_by_region: BTreeMap<RegionId, u64> = fallback_rows
                    .iter()
                    .filter(|r| r.window_start_ms == key.window_start_ms)
                    .filter_map(|r| Some((region(&r.region)?, u64_of(r.amount))))
                    .collect();
                let amount = amounts
                    .iter()
                    .find(|a| a.window_start_ms == key.window_start_ms);
                let spent = amount.map_or(0, |a| u64_of(a.spent));
                let fallback_admitted = fallback_admitted_by_region.values().sum();
                let admitted = spent + fallback_admitted;
                WindowRow {
                    window_start_ms: u64_of(key.window_start_ms),
                    window_end_ms: u64_of(key.window_end_ms),
                    limit,
                    granted: granted_by_region.values().sum(),
                    granted_by_region,
                    spent,
                    stranded: amount.map_or(0, |a| u64_of(a.stranded)),
                    unreported: amount.map_or(0, |a| u64_of(a.unreported)),
                    fallback_admitted,
                    fallback_admitted_by_region,
                    admitted,
                    overshoot: overshoot_tokens(admitted, limit),
                    bound,
                }
            })
            .collect();
        Ok(rows)
    }
}

/// `CASE WHEN excluded.col > table.col THEN excluded.col ELSE table.col END`: an upsert that keeps
/// the larger of the stored and the reported value (reports are cumulative and may arrive out of
/// order).
fn keep_larger<T: Iden + Copy + 'static, C: Iden + Copy + 'static>(
    table: T,
    column: C,
) -> sea_query::SimpleExpr {
    let excluded = Expr::col((Alias::new("excluded"), column));
    let stored = Expr::col((table, column));
    Expr::case(excluded.clone().gt(stored.clone()), excluded)
        .finally(stored)
        .into()
}
