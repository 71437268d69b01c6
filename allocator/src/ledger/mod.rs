//! The accounting ledger (SQL, through sqlx): pool configuration history, every grant, every report,
//! what each lease spent and what each region admitted in fallback, and the per-window accounting
//! computed from them.
//!
//! SQLite is the default (a file in the data directory), PostgreSQL the production choice; the schema
//! in `migrations/` is portable SQL applied at startup to either. Queries are built with sea-query's
//! typed builder for the connected dialect and bound as parameters: no SQL is assembled from strings.
//! etcd stays the authority for live state; the ledger is the durable history (I12: metrics are not a
//! ledger, and neither is etcd, whose grant records expire).
//!
//! A file per job: `schema` (tables and columns), [`audit`] (the change history: audit log, pool
//! configurations, bundles), [`reports`] (grants and reports), [`accounting`] (per-window accounts,
//! the arithmetic pure and tested without SQL), [`terms`] (the terms each window is judged by,
//! from the pool's history), [`rollup`] (old windows' raw rows as one row a
//! region), [`retention`] (what is removed, and when).

use sqlx::postgres::PgPoolOptions;
use sqlx::sqlite::{SqliteConnectOptions, SqlitePoolOptions};
use sqlx::{PgPool, SqlitePool};

/// Runs `$body` with `$pool` bound to whichever database's pool is connected.
macro_rules! on_pool {
    ($ledger:expr, |$pool:ident| $body:expr) => {
        match &$ledger.database {
            Database::Sqlite($pool) => $body,
            Database::Postgres($pool) => $body,
        }
    };
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

pub mod accounting;
pub mod activity;
pub mod agent_sessions;
pub mod audit;
pub mod bound_checks;
pub mod regions;
pub mod reports;
pub mod retention;
pub mod rollup;
mod schema;
pub mod terms;
pub mod webhooks;

pub use accounting::{
    MAX_WINDOWS, PoolLimits, UNNAMED_AGENT_LABEL, WindowAmounts, WindowRow, account,
};
pub use allot_shared::wire::{Report, ReportLease, ReportReceipt};
pub use audit::{AuditEntry, MAX_AUDIT_ENTRIES, PoolChange};
pub use bound_checks::{BoundCheckSummary, BoundViolation, MAX_RECENT_VIOLATIONS};
pub use regions::{FallbackRow, MAX_RECENT_FALLBACK_ROWS};
pub use reports::{KnownGrants, MAX_LEASES_PER_REPORT};
pub use retention::{Removed, Retention};
pub use terms::{TERMS_REACH_MS, TermsChange, TermsHistory, WindowTerms, window_terms};
pub use webhooks::{DeliveryView, EventRecorded, PendingEvent, StoredWebhook};

static MIGRATOR: sqlx::migrate::Migrator = sqlx::migrate!("../migrations");

/// Largest pool of connections to the ledger database.
pub const MAX_CONNECTIONS: u32 = 8;

/// A ledger failure.
#[derive(Debug, thiserror::Error)]
pub enum LedgerError {
    /// The input is inconsistent with the ledger (a client error; nothing was written).
    #[error(transparent)]
    Invalid(#[from] allot_shared::FieldError),
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

#[derive(Clone)]
enum Database {
    Sqlite(SqlitePool),
    Postgres(PgPool),
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
}
