//! The change history: every operator change in the audit log, every pool configuration and every
//! published bundle as it was.

use allot_shared::ids::{PoolId, TenantId};
use sea_query::{OnConflict, Order, PostgresQueryBuilder, Query, SqliteQueryBuilder};
use sea_query_binder::SqlxBinder;
use serde::{Deserialize, Serialize};

use super::schema::{AUDIT_COLUMNS, AuditLog, PolicyBundles, PoolConfigHistory};
use super::{Database, Ledger, LedgerError, i64_of};

/// Most audit entries one read returns.
pub const MAX_AUDIT_ENTRIES: u64 = 1_000;

/// One operator change, as the audit log keeps it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, sqlx::FromRow, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct AuditEntry {
    /// UUID v7.
    pub entry_id: String,
    /// When, epoch ms (allocator clock).
    #[sqlx(try_from = "i64")]
    pub at_ms: u64,
    /// `<role>:<token id>`.
    pub actor: String,
    /// `pool.put`, `pool.delete`, `policy.publish`, `policy.promote`,
    /// `policy.rollback`, `token.mint`, `token.revoke`.
    pub action: String,
    /// What changed: `tenant/pool`, a policy version, a token id.
    pub target: String,
    /// The version after the change (0 when none applies).
    #[sqlx(try_from = "i64")]
    pub version: u64,
    /// Short JSON with the change's particulars (never a secret).
    pub detail: String,
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

/// Pool changes one insert statement writes: 7 parameters each, well under SQLite's and
/// PostgreSQL's limits on a statement's parameters.
pub const POOL_CHANGES_PER_STATEMENT: usize = 100;

impl Ledger {
    /// Records a pool configuration change.
    pub async fn record_pool_change(&self, change: &PoolChange<'_>) -> Result<(), LedgerError> {
        self.record_pool_changes(std::slice::from_ref(change)).await
    }

    /// Records many pool configuration changes, [`POOL_CHANGES_PER_STATEMENT`] rows a statement.
    pub async fn record_pool_changes(&self, changes: &[PoolChange<'_>]) -> Result<(), LedgerError> {
        for chunk in changes.chunks(POOL_CHANGES_PER_STATEMENT) {
            let mut statement = Query::insert()
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
                .to_owned();
            for change in chunk {
                statement.values_panic([
                    change.change_id.into(),
                    change.tenant.as_str().into(),
                    change.pool.as_str().into(),
                    i64_of(change.version).into(),
                    change.actor.into(),
                    i64_of(change.changed_at_ms).into(),
                    change.config_json.into(),
                ]);
            }
            on_db!(self, statement, |sql, values, pool| {
                sqlx::query_with(&sql, values).execute(pool).await?;
            });
        }
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
}
