//! The ledger's size after 30 simulated days, with retention on (the defaults: raw rows 7 days,
//! rolled-up windows 400) and off, and what each kind of row costs. A generator writes what the
//! allocator and its agents would, through the ledger's own calls: each day, for every pool and
//! each of 3 regions, a lease granted and its final report; the leader's bound check of every
//! pool's closed window; and, with retention on, the leader's retention rounds (rollup and removal)
//! until they have nothing left to do, as its 30-second rounds would over a day. On PostgreSQL each
//! day ends with a VACUUM, as autovacuum would run over a day.
//!
//! The pools have daily windows (a quiet plan: one lease a region a day), so the figures per row
//! are what scales: a busier pool writes more grants and reports a window, and the sizing table in
//! docs/operations.md multiplies them out. Run with `scripts/bench` (or
//! `cargo bench -p allot-allocator --bench ledger_size`); `LEDGER_POOLS` and `LEDGER_DAYS` change
//! the scale (defaults 1,000 and 30), `ALLOT_BENCH_POSTGRES_URL` (a server, e.g.
//! `postgres://postgres@127.0.0.1:5432`) adds the same run on a fresh PostgreSQL database. Prints
//! one JSON object per line for the report, and a table.

use std::collections::BTreeMap;

use allot_allocator::clock::Stopwatch;
use allot_allocator::ledger::{Ledger, Retention};
use allot_allocator::pools::{GrantRecord, PoolSpec};
use allot_shared::ids::{LeaseId, PoolId, RegionId, TenantId};
use allot_shared::wire::{Report, ReportLease};
use sqlx::Connection;

/// 2028-01-01T00:00:00Z: the simulated days start here.
const T0_MS: u64 = 1_830_297_600_000;
const DAY_MS: u64 = 86_400_000;
const REGIONS: [&str; 3] = ["eu", "us", "ap"];
/// The ledger's tables, for their sizes.
const TABLES: [&str; 9] = [
    "grants",
    "lease_reports",
    "lease_spend",
    "fallback_admits",
    "window_amounts",
    "bound_checks",
    "shadow_admits",
    "settle_debts",
    "written_off",
];

fn env_number(name: &str, default: u64) -> u64 {
    std::env::var(name)
        .ok()
        .and_then(|v| v.parse().ok())
        .unwrap_or(default)
}

/// Where a ledger lives, to measure it from outside.
enum Store {
    Sqlite(String),
    Postgres(String),
}

impl Store {
    /// Bytes each table (with its indexes) holds, and rows.
    async fn tables(&self) -> BTreeMap<&'static str, (u64, u64)> {
        let mut sizes = BTreeMap::new();
        match self {
            Store::Sqlite(url) => {
                let mut db = sqlx::SqliteConnection::connect(url).await.expect("sqlite");
                sqlx::query("PRAGMA wal_checkpoint(TRUNCATE)")
                    .execute(&mut db)
                    .await
                    .expect("checkpoint");
                for table in TABLES {
                    // dbstat names each index by itself: a table's bytes are its own pages and
                    // its indexes'.
                    let (bytes,): (i64,) = sqlx::query_as(
                        "SELECT COALESCE(SUM(pgsize), 0) FROM dbstat WHERE name = ?1 OR name IN \
                         (SELECT name FROM sqlite_master WHERE type = 'index' AND tbl_name = ?1)",
                    )
                    .bind(table)
                    .fetch_one(&mut db)
                    .await
                    .expect("dbstat");
                    let (rows,): (i64,) = sqlx::query_as(&format!("SELECT COUNT(*) FROM {table}"))
                        .fetch_one(&mut db)
                        .await
                        .expect("count");
                    sizes.insert(table, (bytes as u64, rows as u64));
                }
            }
            Store::Postgres(url) => {
                let mut db = sqlx::PgConnection::connect(url).await.expect("postgres");
                for table in TABLES {
                    // VACUUM makes removed rows' space reusable; a relation's size (its table,
                    // indexes and TOAST) still counts those pages, as the disk does.
                    sqlx::query(&format!("VACUUM {table}"))
                        .execute(&mut db)
                        .await
                        .expect("vacuum");
                    let (bytes, rows): (i64, i64) = sqlx::query_as(&format!(
                        "SELECT pg_total_relation_size('{table}'), (SELECT COUNT(*) FROM {table})"
                    ))
                    .fetch_one(&mut db)
                    .await
                    .expect("size");
                    sizes.insert(table, (bytes as u64, rows as u64));
                }
            }
        }
        sizes
    }

    /// The file (SQLite) or database (PostgreSQL) on disk, bytes: what the disk must hold, free
    /// pages included.
    async fn on_disk(&self) -> u64 {
        match self {
            Store::Sqlite(url) => {
                let path = url.trim_start_matches("sqlite://");
                std::fs::metadata(path).map_or(0, |m| m.len())
            }
            Store::Postgres(url) => {
                let mut db = sqlx::PgConnection::connect(url).await.expect("postgres");
                let (bytes,): (i64,) =
                    sqlx::query_as("SELECT pg_database_size(current_database())")
                        .fetch_one(&mut db)
                        .await
                        .expect("size");
                bytes as u64
            }
        }
    }
}

fn spec() -> PoolSpec {
    serde_json::from_value(
        serde_json::json!({ "limit": 3000, "window": { "calendar": "day",
        "timeZone": "UTC" }, "chunk": 1000, "leaseTtlMs": 60000, "fallbackPerRegion": 0,
        "regions": REGIONS }),
    )
    .expect("a pool spec")
}

/// One simulated day: grants, reports, the leader's bound checks, and with `retention` its rounds.
async fn day(ledger: &Ledger, pools: &[(TenantId, PoolId)], day: u64, retention: bool) {
    let start_ms = T0_MS + day * DAY_MS;
    let config = spec().validate().expect("valid");
    for (n, (tenant, pool)) in pools.iter().enumerate() {
        let leases: Vec<(RegionId, LeaseId)> = REGIONS
            .iter()
            .enumerate()
            .map(|(r, region)| {
                let at_ms = start_ms + 1_000 + (n * REGIONS.len() + r) as u64;
                (
                    RegionId::parse(region).expect("region"),
                    LeaseId::from_parts(at_ms, rand::random()),
                )
            })
            .collect();
        let records: Vec<GrantRecord> = leases
            .iter()
            .map(|(region, lease_id)| {
                serde_json::from_value(serde_json::json!({
                    "leaseId": lease_id.to_string(), "region": region.to_string(),
                    "granted": 1000, "epoch": 1, "windowStartMs": start_ms,
                    "windowEndMs": start_ms + DAY_MS, "expiresAtMs": start_ms + 61_000,
                    "retryAfterMs": 0, "issuedAtMs": start_ms + 1_000 }))
                .expect("a grant record")
            })
            .collect();
        ledger
            .record_grants(tenant, pool, &records)
            .await
            .expect("grants");
        for (region, lease_id) in &leases {
            let report = Report {
                report_id: format!("{lease_id}-final"),
                region: region.clone(),
                tenant: tenant.clone(),
                pool: pool.clone(),
                window_start_ms: start_ms,
                leases: vec![ReportLease {
                    lease_id: *lease_id,
                    spent_tokens: 800,
                    final_report: true,
                    unspent_tokens: 0,
                }],
                fallback_admitted_tokens: 0,
                shadow_admitted_tokens: 0,
                settle_debt_tokens: 0,
                written_off_tokens: 0,
                agent_id: None,
                incarnation: None,
            };
            ledger
                .record_report(&report, start_ms + 62_000)
                .await
                .expect("report");
        }
    }
    // The leader's round after the day's window closed: its bound check, then retention.
    let end_ms = start_ms + DAY_MS + 10_000;
    for (tenant, pool) in pools {
        let rows = ledger
            .windows(tenant, pool, &config, 1, end_ms)
            .await
            .expect("windows");
        ledger
            .record_bound_checks(tenant, pool, &rows, end_ms)
            .await
            .expect("checks");
    }
    if retention {
        loop {
            let removed = ledger
                .remove_expired(Retention::default(), end_ms)
                .await
                .expect("retention");
            if removed.windows_rolled_up == 0 && removed.rows.values().all(|&rows| rows == 0) {
                break;
            }
        }
    }
}

struct Run {
    backend: &'static str,
    retention: bool,
    tables: BTreeMap<&'static str, (u64, u64)>,
    on_disk_bytes: u64,
    seconds: f64,
    first_day: BTreeMap<&'static str, (u64, u64)>,
}

async fn run(
    backend: &'static str,
    store: Store,
    url: &str,
    pools: u64,
    days: u64,
    retention: bool,
) -> Run {
    let ledger = Ledger::connect(url).await.expect("ledger");
    let names: Vec<(TenantId, PoolId)> = (0..pools)
        .map(|n| {
            (
                TenantId::parse(&format!("tenant-{n:05}")).expect("tenant"),
                PoolId::parse("api").expect("pool"),
            )
        })
        .collect();
    let stopwatch = Stopwatch::start();
    let mut first_day = BTreeMap::new();
    for d in 0..days {
        day(&ledger, &names, d, retention).await;
        // Measuring runs PostgreSQL's VACUUM, as autovacuum would over a day: the space of
        // removed rows is reused by the next day's, as in a real month.
        let tables = store.tables().await;
        if d == 0 {
            first_day = tables;
        }
    }
    Run {
        backend,
        retention,
        tables: store.tables().await,
        on_disk_bytes: store.on_disk().await,
        seconds: stopwatch.elapsed_seconds(),
        first_day,
    }
}

/// A fresh PostgreSQL database on `server`: its URL.
async fn fresh_postgres(server: &str) -> String {
    let server = server.trim_end_matches('/');
    let name = format!(
        "allot_bench_{}_{}",
        std::process::id(),
        rand::random::<u32>()
    );
    let mut admin = sqlx::PgConnection::connect(&format!("{server}/postgres"))
        .await
        .expect("connect to PostgreSQL");
    sqlx::query(&format!("CREATE DATABASE {name}"))
        .execute(&mut admin)
        .await
        .expect("create the database");
    format!("{server}/{name}")
}

/// Drops the database at `url` on `server`, its connections too.
async fn drop_postgres(server: &str, url: &str) {
    let name = url.rsplit('/').next().unwrap_or_default();
    let server = server.trim_end_matches('/');
    let mut admin = sqlx::PgConnection::connect(&format!("{server}/postgres"))
        .await
        .expect("connect to PostgreSQL");
    sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
        .execute(&mut admin)
        .await
        .expect("drop the database");
}

#[tokio::main(flavor = "multi_thread", worker_threads = 2)]
async fn main() {
    let pools = env_number("LEDGER_POOLS", 1_000);
    let days = env_number("LEDGER_DAYS", 30);
    let dir = tempfile::tempdir().expect("temp dir");
    let mut runs = Vec::new();
    for retention in [false, true] {
        let path = dir.path().join(format!("ledger-{retention}.db"));
        let url = format!("sqlite://{}", path.display());
        runs.push(
            run(
                "sqlite",
                Store::Sqlite(url.clone()),
                &url,
                pools,
                days,
                retention,
            )
            .await,
        );
    }
    if let Ok(server) = std::env::var("ALLOT_BENCH_POSTGRES_URL") {
        for retention in [false, true] {
            let url = fresh_postgres(&server).await;
            runs.push(
                run(
                    "postgres",
                    Store::Postgres(url.clone()),
                    &url,
                    pools,
                    days,
                    retention,
                )
                .await,
            );
            drop_postgres(&server, &url).await;
        }
    }
    println!(
        "{pools} pools, 3 regions, daily windows, {days} days: one lease and its final report a region a day"
    );
    println!(
        "{:<9} {:<9} {:>12} {:>12} {:>9} {:>10} {:>10} {:>10} {:>10}",
        "backend",
        "retention",
        "in use B",
        "on disk B",
        "seconds",
        "grant B",
        "report B",
        "check B",
        "rollup B"
    );
    for run in &runs {
        // Per row, from the first day (every raw row still there): a grant with its index, a
        // report with its lease's spend row, a window's bound check.
        let per = |tables: &BTreeMap<&str, (u64, u64)>, table: &str| {
            let (bytes, rows) = tables.get(table).copied().unwrap_or((0, 0));
            bytes as f64 / rows.max(1) as f64
        };
        let grant = per(&run.first_day, "grants");
        let report = per(&run.first_day, "lease_reports") + per(&run.first_day, "lease_spend");
        let check = per(&run.first_day, "bound_checks");
        // A rolled-up window: one row a region (none without retention).
        let rollup = per(&run.tables, "window_amounts")
            * REGIONS.len() as f64
            * f64::from(u8::from(run.retention));
        let in_use: u64 = run.tables.values().map(|(bytes, _)| bytes).sum();
        println!(
            "{:<9} {:<9} {:>12} {:>12} {:>9.1} {:>10.0} {:>10.0} {:>10.0} {:>10.0}",
            run.backend,
            if run.retention { "on" } else { "off" },
            in_use,
            run.on_disk_bytes,
            run.seconds,
            grant,
            report,
            check,
            rollup
        );
        let rows: BTreeMap<&str, u64> = run
            .tables
            .iter()
            .map(|(t, (_, rows))| (*t, *rows))
            .collect();
        let bytes: BTreeMap<&str, u64> = run.tables.iter().map(|(t, (b, _))| (*t, *b)).collect();
        println!(
            "BENCH {}",
            serde_json::json!({ "bench": "ledger_size", "backend": run.backend, "pools": pools,
                "regions": REGIONS.len(), "days": days, "retention": run.retention,
                "inUseBytes": in_use, "onDiskBytes": run.on_disk_bytes, "seconds": run.seconds,
                "grantBytes": grant, "reportBytes": report, "checkBytes": check,
                "rolledUpWindowBytes": rollup, "rows": rows, "bytesByTable": bytes })
        );
    }
}
