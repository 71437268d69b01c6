//! Windows rolled up: once a window ended more than the raw retention ago, its raw rows (every
//! grant, each lease's spend, the per-window admits of each region) become one row a region in
//! `window_amounts`, and go, in one transaction a window. The windows view reads both as one
//! ([`RolledWindow::merge_into`]): a rolled window's lease figures come from its rollup (its
//! grants are gone, so a report naming one of its leases is refused as of an unknown lease), its
//! admits from the larger of the rollup and a raw row a late report wrote since, which the next
//! round rolls up again. Every figure of a rollup row is the larger of what it held and what is
//! rolled, so rolling a window twice changes nothing.

use std::collections::BTreeMap;
use std::sync::LazyLock;

use allot_shared::ids::{PoolId, RegionId, TenantId};

use super::accounting::WindowAmounts;
use super::{Database, Ledger, LedgerError, i64_of, u64_of};

/// Windows rolled up per round at most (I10); the rest the next round.
pub const MAX_ROLLUP_WINDOWS_PER_ROUND: u64 = 500;
/// A window's grant records leave the store a window's length after its end, and no sooner than
/// their least lifetime after their commit (65 s by default): a window is rolled up only this much
/// later still, ms.
pub const RECORDS_GONE_MARGIN_MS: u64 = 300_000;

/// A window of a pool with raw rows past the raw retention.
#[derive(Debug, Clone, PartialEq, Eq, sqlx::FromRow)]
struct RawWindow {
    tenant: String,
    pool: String,
    window_start_ms: i64,
    /// Its end, or its start for a window with admits only (the ledger knows no end for it).
    window_end_ms: i64,
}

/// Windows with grants that ended before `$1`, and windows with admits only that started before
/// it, at most `$2` windows of each table, the oldest first. A window with grants waits, besides, until its grant records have left
/// the store (a window's length after its end, `$3` the instant that must be past), or the
/// leader's reconciliation would copy them back into `grants`.
static RAW_WINDOWS_SQL: LazyLock<String> = LazyLock::new(|| {
    // Each branch lists windows, oldest first, not rows: a window of many grants is one of `$2`.
    // A window that still has grants is left to the grants branch, whose guard keeps it until
    // its records are gone, whatever admits it also has.
    let admitted: Vec<String> = ADMITS_TABLES
        .iter()
        .map(|(table, _)| {
            format!(
                "SELECT * FROM (SELECT tenant, pool, window_start_ms FROM {table} a \
                 WHERE window_start_ms < $1 AND NOT EXISTS (SELECT 1 FROM grants g \
                 WHERE g.tenant = a.tenant AND g.pool = a.pool \
                 AND g.window_start_ms = a.window_start_ms) \
                 GROUP BY tenant, pool, window_start_ms ORDER BY window_start_ms LIMIT $2) \
                 AS {table}"
            )
        })
        .collect();
    format!(
        "SELECT DISTINCT tenant, pool, window_start_ms, window_end_ms FROM (\
         SELECT tenant, pool, window_start_ms, window_end_ms FROM grants \
         WHERE window_end_ms < $1 AND 2 * window_end_ms - window_start_ms < $3 \
         GROUP BY tenant, pool, window_start_ms, window_end_ms ORDER BY window_end_ms LIMIT $2\
         ) AS granted \
         UNION \
         SELECT DISTINCT tenant, pool, window_start_ms, window_start_ms AS window_end_ms \
         FROM ({}) AS admitted",
        admitted.join(" UNION ALL ")
    )
});

/// Each per-window admits table, with the figure of `window_amounts` it is rolled into.
const ADMITS_TABLES: [(&str, &str); 4] = [
    ("fallback_admits", "fallback_admitted"),
    ("shadow_admits", "shadow_admitted"),
    ("settle_debts", "settle_debt"),
    ("written_off", "written_off"),
];

/// One window's rows of a table: `$1` tenant, `$2` pool, `$3` window start.
const OF_WINDOW: &str = "tenant = $1 AND pool = $2 AND window_start_ms = $3";

/// One window's lease figures per region (`$1` tenant, `$2` pool, `$3` window start). Every
/// lease of a window past the raw retention has expired: what its final report says it left is
/// stranded (less what the allocator took back), what no final report accounts for is unreported.
const LEASE_FIGURES_SQL: &str = "\
SELECT g.region AS region,
       CAST(SUM(g.granted) AS BIGINT) AS granted,
       CAST(SUM(COALESCE(s.spent, 0)) AS BIGINT) AS spent,
       CAST(SUM(CASE WHEN s.final_report = 1
                     THEN g.granted - COALESCE(s.spent, 0) - COALESCE(s.returned, 0) ELSE 0 END)
            AS BIGINT) AS stranded,
       CAST(SUM(CASE WHEN s.final_report = 1 THEN 0 ELSE g.granted - COALESCE(s.spent, 0) END)
            AS BIGINT) AS unreported,
       CAST(COALESCE(SUM(s.returned), 0) AS BIGINT) AS returned
FROM grants g LEFT JOIN lease_spend s ON s.lease_id = g.lease_id
WHERE g.tenant = $1 AND g.pool = $2 AND g.window_start_ms = $3
GROUP BY g.region";

/// One window's admits per region from each admits table (the sum over the region's agents),
/// tagged with the table's figure in `window_amounts`. The rollup keeps regions, not agents.
static ADMITS_SQL: LazyLock<String> = LazyLock::new(|| {
    ADMITS_TABLES
        .iter()
        .map(|(table, figure)| {
            format!(
                "SELECT '{figure}' AS figure, region, CAST(SUM(admitted) AS BIGINT) AS admitted \
                 FROM {table} WHERE {OF_WINDOW} GROUP BY region"
            )
        })
        .collect::<Vec<_>>()
        .join(" UNION ALL ")
});

/// A `window_amounts` row's figures, each kept at the larger of what it held and what is rolled.
const KEPT_LARGER: [&str; 10] = [
    "window_end_ms",
    "granted",
    "spent",
    "stranded",
    "unreported",
    "returned",
    "fallback_admitted",
    "shadow_admitted",
    "settle_debt",
    "written_off",
];

/// Keeps the larger of each figure: rolling up again never lowers one.
static UPSERT_SQL: LazyLock<String> = LazyLock::new(|| {
    let larger: Vec<String> = KEPT_LARGER
        .iter()
        .map(|c| {
            format!(
                "{c} = CASE WHEN excluded.{c} > window_amounts.{c} \
                 THEN excluded.{c} ELSE window_amounts.{c} END"
            )
        })
        .collect();
    format!(
        "INSERT INTO window_amounts (tenant, pool, window_start_ms, region, {}, rolled_at_ms) \
         VALUES ($1, $2, $3, $4, $5, $6, $7, $8, $9, $10, $11, $12, $13, $14, $15) \
         ON CONFLICT (tenant, pool, window_start_ms, region) DO UPDATE SET {}, \
         rolled_at_ms = excluded.rolled_at_ms",
        KEPT_LARGER.join(", "),
        larger.join(", ")
    )
});

/// The raw rows of one window, table by table, each spend before the grant it joins on.
static REMOVE_RAW_SQL: LazyLock<Vec<(&'static str, String)>> = LazyLock::new(|| {
    let mut statements = vec![
        (
            "lease_spend",
            format!(
                "DELETE FROM lease_spend WHERE lease_id IN (SELECT lease_id FROM grants WHERE {OF_WINDOW})"
            ),
        ),
        ("grants", format!("DELETE FROM grants WHERE {OF_WINDOW}")),
    ];
    statements.extend(
        ADMITS_TABLES
            .iter()
            .map(|(table, _)| (*table, format!("DELETE FROM {table} WHERE {OF_WINDOW}"))),
    );
    statements
});

/// A pool's rolled-up windows, newest first (`$1` tenant, `$2` pool, `$3` rows at most).
const ROLLED_SQL: &str = "\
SELECT window_start_ms, window_end_ms, region, granted, spent, stranded, unreported, returned,
       fallback_admitted, shadow_admitted, settle_debt, written_off
FROM window_amounts WHERE tenant = $1 AND pool = $2 AND window_start_ms < $4
ORDER BY window_start_ms DESC LIMIT $3";

#[derive(Debug, Clone, Default, sqlx::FromRow)]
struct RegionFigures {
    region: String,
    granted: i64,
    spent: i64,
    stranded: i64,
    unreported: i64,
    returned: i64,
}

#[derive(Debug, Clone, sqlx::FromRow)]
struct AdmitFigure {
    figure: String,
    region: String,
    admitted: i64,
}

#[derive(Debug, Clone, sqlx::FromRow)]
struct RolledRow {
    window_start_ms: i64,
    window_end_ms: i64,
    region: String,
    granted: i64,
    spent: i64,
    stranded: i64,
    unreported: i64,
    returned: i64,
    fallback_admitted: i64,
    shadow_admitted: i64,
    settle_debt: i64,
    written_off: i64,
}

/// What rolling windows up did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RolledUp {
    /// Windows rolled up.
    pub windows: u64,
    /// Raw rows removed, by table.
    pub rows_removed: BTreeMap<&'static str, u64>,
}

/// One region's figures of a window, as `window_amounts` holds them.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
struct Figures {
    granted: u64,
    spent: u64,
    stranded: u64,
    unreported: u64,
    returned: u64,
    fallback_admitted: u64,
    shadow_admitted: u64,
    settle_debt: u64,
    written_off: u64,
}

/// A rolled-up window of a pool: its end and each region's figures.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RolledWindow {
    /// Window end, epoch ms (its start, for a window with admits only).
    pub window_end_ms: u64,
    regions: BTreeMap<RegionId, Figures>,
}

impl RolledWindow {
    /// Folds this rollup into `amounts` (the same window as its raw rows give it, if any): every
    /// figure the larger of the two, per region. A rolled window's raw lease figures are gone (0),
    /// so they are the rollup's; its admits may have grown since in a late report's raw row.
    pub fn merge_into(&self, amounts: &mut WindowAmounts) {
        let larger = |map: &mut BTreeMap<RegionId, u64>, region: &RegionId, value: u64| {
            if value > 0 {
                let entry = map.entry(region.clone()).or_default();
                *entry = (*entry).max(value);
            }
        };
        let (mut stranded, mut unreported, mut returned) = (0u64, 0u64, 0u64);
        for (region, figures) in &self.regions {
            larger(
                &mut amounts.granted_tokens_by_region,
                region,
                figures.granted,
            );
            if figures.granted > 0 {
                // A region with grants has a spend figure, 0 included, as its raw rows give it.
                let spent = amounts
                    .spent_tokens_by_region
                    .entry(region.clone())
                    .or_default();
                *spent = (*spent).max(figures.spent);
            }
            larger(
                &mut amounts.fallback_admitted_tokens_by_region,
                region,
                figures.fallback_admitted,
            );
            larger(
                &mut amounts.shadow_admitted_tokens_by_region,
                region,
                figures.shadow_admitted,
            );
            larger(
                &mut amounts.settle_debt_tokens_by_region,
                region,
                figures.settle_debt,
            );
            larger(
                &mut amounts.written_off_tokens_by_region,
                region,
                figures.written_off,
            );
            stranded = stranded.saturating_add(figures.stranded);
            unreported = unreported.saturating_add(figures.unreported);
            returned = returned.saturating_add(figures.returned);
        }
        amounts.stranded_tokens = amounts.stranded_tokens.max(stranded);
        amounts.returned_tokens = amounts.returned_tokens.max(returned);
        amounts.unreported_tokens = amounts.unreported_tokens.max(unreported);
        amounts.window_end_ms = amounts.window_end_ms.max(self.window_end_ms);
    }
}

impl Ledger {
    /// Rolls up, at `now_ms`, at most [`MAX_ROLLUP_WINDOWS_PER_ROUND`] windows whose raw rows are
    /// older than `cutoff_ms` (grants of windows that ended before it, admits of windows that
    /// started before it), removing those rows.
    ///
    /// Long by design: each window's figures are read, its rollup written and its raw rows removed
    /// in one transaction, inside the `on_pool!` body that runs it on either database; split, the
    /// transaction would be passed between functions generic over both databases, and that a
    /// window's raw rows go only with its rollup would no longer be seen in one place.
    pub async fn roll_up_windows(
        &self,
        cutoff_ms: u64,
        now_ms: u64,
    ) -> Result<RolledUp, LedgerError> {
        let windows: Vec<RawWindow> = on_pool!(self, |pool| {
            sqlx::query_as(RAW_WINDOWS_SQL.as_str())
                .bind(i64_of(cutoff_ms))
                .bind(i64_of(MAX_ROLLUP_WINDOWS_PER_ROUND))
                .bind(i64_of(now_ms.saturating_sub(RECORDS_GONE_MARGIN_MS)))
                .fetch_all(pool)
                .await?
        });
        // A window with grants and admits is listed twice (once with its end, once with its
        // start as its end): roll it once, with its end.
        let mut by_key: BTreeMap<(String, String, i64), i64> = BTreeMap::new();
        for window in windows {
            let end = by_key
                .entry((window.tenant, window.pool, window.window_start_ms))
                .or_insert(window.window_end_ms);
            *end = (*end).max(window.window_end_ms);
        }
        let mut rolled = RolledUp::default();
        for ((tenant, pool, window_start_ms), window_end_ms) in by_key
            .into_iter()
            .take(usize::try_from(MAX_ROLLUP_WINDOWS_PER_ROUND).unwrap_or(usize::MAX))
        {
            let removed = on_pool!(self, |db| {
                let mut transaction = db.begin().await?;
                let leases: Vec<RegionFigures> = sqlx::query_as(LEASE_FIGURES_SQL)
                    .bind(&tenant)
                    .bind(&pool)
                    .bind(window_start_ms)
                    .fetch_all(&mut *transaction)
                    .await?;
                let admits: Vec<AdmitFigure> = sqlx::query_as(ADMITS_SQL.as_str())
                    .bind(&tenant)
                    .bind(&pool)
                    .bind(window_start_ms)
                    .fetch_all(&mut *transaction)
                    .await?;
                for (region, figures) in figures_by_region(leases, admits) {
                    sqlx::query(UPSERT_SQL.as_str())
                        .bind(&tenant)
                        .bind(&pool)
                        .bind(window_start_ms)
                        .bind(region)
                        .bind(window_end_ms)
                        .bind(i64_of(figures.granted))
                        .bind(i64_of(figures.spent))
                        .bind(i64_of(figures.stranded))
                        .bind(i64_of(figures.unreported))
                        .bind(i64_of(figures.returned))
                        .bind(i64_of(figures.fallback_admitted))
                        .bind(i64_of(figures.shadow_admitted))
                        .bind(i64_of(figures.settle_debt))
                        .bind(i64_of(figures.written_off))
                        .bind(i64_of(now_ms))
                        .execute(&mut *transaction)
                        .await?;
                }
                let mut removed = Vec::with_capacity(REMOVE_RAW_SQL.len());
                for (table, sql) in REMOVE_RAW_SQL.iter() {
                    let rows = sqlx::query(sql)
                        .bind(&tenant)
                        .bind(&pool)
                        .bind(window_start_ms)
                        .execute(&mut *transaction)
                        .await?
                        .rows_affected();
                    removed.push((*table, rows));
                }
                transaction.commit().await?;
                removed
            });
            rolled.windows += 1;
            for (table, rows) in removed {
                *rolled.rows_removed.entry(table).or_default() += rows;
            }
        }
        Ok(rolled)
    }

    /// The latest `last` rolled-up windows of `tenant`'s `pool`, by window start.
    pub async fn rolled_windows(
        &self,
        tenant: &TenantId,
        pool: &PoolId,
        last: u64,
    ) -> Result<BTreeMap<u64, RolledWindow>, LedgerError> {
        self.rolled_windows_before(tenant, pool, last, u64::MAX)
            .await
    }

    /// The same, of the windows that start before `before_ms`.
    pub async fn rolled_windows_before(
        &self,
        tenant: &TenantId,
        pool: &PoolId,
        last: u64,
        before_ms: u64,
    ) -> Result<BTreeMap<u64, RolledWindow>, LedgerError> {
        let rows: Vec<RolledRow> = on_pool!(self, |db| {
            sqlx::query_as(ROLLED_SQL)
                .bind(tenant.as_str())
                .bind(pool.as_str())
                .bind(i64_of(last.saturating_mul(64)))
                .bind(i64_of(before_ms))
                .fetch_all(db)
                .await?
        });
        let limit_reached = rows.len() as u64 >= last.saturating_mul(64);
        let mut windows: BTreeMap<u64, RolledWindow> = BTreeMap::new();
        for row in rows {
            let Ok(region) = RegionId::parse(&row.region) else {
                continue;
            };
            let window = windows.entry(u64_of(row.window_start_ms)).or_default();
            window.window_end_ms = window.window_end_ms.max(u64_of(row.window_end_ms));
            window.regions.insert(
                region,
                Figures {
                    granted: u64_of(row.granted),
                    spent: u64_of(row.spent),
                    stranded: u64_of(row.stranded),
                    unreported: u64_of(row.unreported),
                    returned: u64_of(row.returned),
                    fallback_admitted: u64_of(row.fallback_admitted),
                    shadow_admitted: u64_of(row.shadow_admitted),
                    settle_debt: u64_of(row.settle_debt),
                    written_off: u64_of(row.written_off),
                },
            );
        }
        // The oldest window may have been cut short by the row limit: only whole windows count.
        if limit_reached {
            windows.pop_first();
        }
        while windows.len() as u64 > last {
            windows.pop_first();
        }
        Ok(windows)
    }
}

/// Each region's figures of a window from its lease and admits rows.
fn figures_by_region(
    leases: Vec<RegionFigures>,
    admits: Vec<AdmitFigure>,
) -> BTreeMap<String, Figures> {
    let mut by_region: BTreeMap<String, Figures> = BTreeMap::new();
    for lease in leases {
        let figures = by_region.entry(lease.region).or_default();
        figures.granted = u64_of(lease.granted);
        figures.spent = u64_of(lease.spent);
        figures.stranded = u64_of(lease.stranded);
        figures.unreported = u64_of(lease.unreported);
        figures.returned = u64_of(lease.returned);
    }
    for admit in admits {
        let figures = by_region.entry(admit.region).or_default();
        let amount = u64_of(admit.admitted);
        match admit.figure.as_str() {
            "fallback_admitted" => figures.fallback_admitted = amount,
            "shadow_admitted" => figures.shadow_admitted = amount,
            "settle_debt" => figures.settle_debt = amount,
            _ => figures.written_off = amount,
        }
    }
    by_region
}
