//! The ledger's tables and columns as sea-query identifiers (the schema itself is `migrations/`),
//! and the expressions several queries share.

use sea_query::{Alias, Expr, Func, Iden};

#[derive(Iden, Clone, Copy)]
pub(super) enum PoolConfigHistory {
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
pub(super) enum PolicyBundles {
    Table,
    Version,
    Checksum,
    PublishedAt,
    Actor,
    StoredAtMs,
    BundleJson,
}

#[derive(Iden, Clone, Copy)]
pub(super) enum AuditLog {
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
pub(super) const AUDIT_COLUMNS: [AuditLog; 7] = [
    AuditLog::EntryId,
    AuditLog::AtMs,
    AuditLog::Actor,
    AuditLog::Action,
    AuditLog::Target,
    AuditLog::Version,
    AuditLog::Detail,
];

#[derive(Iden, Clone, Copy)]
pub(super) enum BoundChecks {
    Table,
    Tenant,
    Pool,
    WindowStartMs,
    WindowEndMs,
    Admitted,
    Bound,
    CheckedAtMs,
    FallbackExcess,
    ExcessRegions,
}

#[derive(Iden, Clone, Copy)]
pub(super) enum Grants {
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
pub(super) enum LeaseReports {
    Table,
    ReportId,
    Region,
    Tenant,
    Pool,
    WindowStartMs,
    ReceivedAtMs,
    FallbackAdmitted,
    LeasesJson,
    AgentId,
    Incarnation,
}

#[derive(Iden, Clone, Copy)]
pub(super) enum LeaseSpend {
    Table,
    LeaseId,
    Spent,
    FinalReport,
    UpdatedAtMs,
    Returned,
}

/// Fallback admits per agent and window (`agent_id` '' for reports that name no agent); a
/// region's figure is the sum over its agents.
#[derive(Iden, Clone, Copy)]
pub(super) enum FallbackAdmits {
    Table,
    Tenant,
    Pool,
    Region,
    WindowStartMs,
    AgentId,
    Admitted,
}

/// The `agent_id` of rows from reports that name no agent.
pub(super) const UNNAMED_AGENT: &str = "";

/// Shadow admits per agent and window: the same columns as [`FallbackAdmits`].
#[derive(Iden, Clone, Copy)]
pub(super) enum ShadowAdmits {
    Table,
}

/// The most settle debt an agent carried per window: the same columns as [`FallbackAdmits`].
#[derive(Iden, Clone, Copy)]
pub(super) enum SettleDebts {
    Table,
}

/// Tokens written off per agent and window: the same columns as [`FallbackAdmits`].
#[derive(Iden, Clone, Copy)]
pub(super) enum WrittenOff {
    Table,
}

pub(super) fn sum_as_bigint(expr: impl Into<sea_query::SimpleExpr>) -> sea_query::SimpleExpr {
    Func::cast_as(
        Func::coalesce([Func::sum(expr).into(), Expr::val(0i64).into()]),
        Alias::new("BIGINT"),
    )
    .into()
}

/// `CASE WHEN excluded.col > table.col THEN excluded.col ELSE table.col END`: an upsert that keeps
/// the larger of the stored and the reported value (reports are cumulative and may arrive out of
/// order).
pub(super) fn keep_larger<T: Iden + Copy + 'static, C: Iden + Copy + 'static>(
    table: T,
    column: C,
) -> sea_query::SimpleExpr {
    let excluded = Expr::col((Alias::new("excluded"), column));
    let stored = Expr::col((table, column));
    Expr::case(excluded.clone().gt(stored.clone()), excluded)
        .finally(stored)
        .into()
}
