//! The ledger on SQLite and on PostgreSQL: migrations, idempotent grants and reports, validation that
//! writes nothing, and per-window accounting (spent, stranded, unreported, fallback, overshoot, bound).
//!
//! PostgreSQL tests use the server named by `ALLOT_TEST_POSTGRES_URL` (scripts/test sets it), each
//! in a database of its own, created and dropped by the test.

use allot_allocator::ledger::{
    AuditEntry, Ledger, LedgerError, PoolChange, Report, ReportLease, WindowRow,
};
use allot_allocator::pools::GrantRecord;
use allot_shared::ids::{AgentId, Epoch, LeaseId, PoolId, RegionId, TenantId};
use allot_shared::lease::PoolConfig;
use sqlx::Connection;

const WINDOW_MS: u64 = 60_000;
const W0: u64 = 1_767_225_600_000;

fn tenant() -> TenantId {
    TenantId::parse("atlas").expect("tenant")
}
fn pool() -> PoolId {
    PoolId::parse("api").expect("pool")
}
fn region(name: &str) -> RegionId {
    RegionId::parse(name).expect("region")
}
fn lease(n: u128) -> LeaseId {
    LeaseId::from_parts(W0, n)
}

fn config() -> PoolConfig {
    PoolConfig::new(
        1_000,
        WINDOW_MS,
        100,
        15_000,
        100,
        vec![region("eu"), region("us")],
    )
    .expect("valid")
}

fn grant(
    n: u128,
    region_name: &str,
    window_start_ms: u64,
    granted_tokens: u64,
    expires_at_ms: u64,
) -> GrantRecord {
    GrantRecord {
        lease_id: lease(n),
        region: region(region_name),
        granted_tokens,
        epoch: Epoch(1),
        window_start_ms,
        window_end_ms: window_start_ms + WINDOW_MS,
        expires_at_ms,
        retry_after_ms: 0,
        issued_at_ms: window_start_ms,
        ungranted_tokens: None,
    }
}

fn report(
    id: &str,
    region_name: &str,
    window_start_ms: u64,
    leases: Vec<(u128, u64, bool)>,
    fallback: u64,
) -> Report {
    Report {
        report_id: id.to_owned(),
        region: region(region_name),
        tenant: tenant(),
        pool: pool(),
        window_start_ms,
        leases: leases
            .into_iter()
            .map(|(n, spent, final_report)| ReportLease {
                lease_id: lease(n),
                spent_tokens: spent,
                final_report,
                unspent_tokens: 0,
            })
            .collect(),
        fallback_admitted_tokens: fallback,
        shadow_admitted_tokens: 0,
        settle_debt_tokens: 0,
        written_off_tokens: 0,
        agent_id: None,
        incarnation: None,
    }
}

async fn accounting(ledger: Ledger) {
    ledger
        .record_pool_change(&PoolChange {
            change_id: "c-1",
            tenant: &tenant(),
            pool: &pool(),
            version: 1,
            actor: "operator:test",
            changed_at_ms: W0,
            config_json: "{}",
        })
        .await
        .expect("pool change");
    let grants = vec![
        grant(1, "eu", W0, 100, W0 + 15_000),
        grant(2, "eu", W0, 100, W0 + 30_000),
        grant(3, "us", W0, 50, W0 + 60_000),
        grant(4, "eu", W0 + WINDOW_MS, 100, W0 + WINDOW_MS + 15_000),
    ];
    ledger
        .record_grants(&tenant(), &pool(), &grants)
        .await
        .expect("grants");
    ledger
        .record_grants(&tenant(), &pool(), &grants[..1])
        .await
        .expect("a repeated grant is ignored");
    assert_eq!(
        ledger
            .missing_grants(&[lease(1), lease(9)])
            .await
            .expect("lookup"),
        vec![lease(9)]
    );

    // Bad reports are refused, naming the field, and write nothing.
    let cases = [
        (
            report("r-bad-1", "eu", W0, vec![(9, 1, false)], 0),
            "leases[0]",
        ),
        (
            report("r-bad-2", "eu", W0, vec![(1, 101, false)], 0),
            "leases[0].spent",
        ),
        (
            report("r-bad-3", "us", W0, vec![(1, 10, false)], 0),
            "leases[0]",
        ),
    ];
    for (bad, field) in cases {
        match ledger.record_report(&bad, W0).await {
            Err(LedgerError::Invalid(invalid)) => assert_eq!(invalid.field, field),
            other => panic!("{field}: expected a refusal, got {other:?}"),
        }
    }
    let before = ledger
        .windows(&tenant(), &pool(), &config(), 10, W0 + 1)
        .await
        .expect("windows");
    assert!(
        before.iter().all(|w| w.spent_tokens == 0),
        "refused reports wrote nothing"
    );

    // Cumulative spends: the largest value counts, a replayed report id is not applied again.
    let first = ledger
        .record_report(
            &report("r-1", "eu", W0, vec![(1, 40, false), (2, 10, false)], 30),
            W0 + 1_000,
        )
        .await
        .expect("report");
    assert!(!first.duplicate);
    let again = ledger
        .record_report(
            &report("r-1", "eu", W0, vec![(1, 40, false), (2, 10, false)], 30),
            W0 + 1_000,
        )
        .await
        .expect("report");
    assert!(again.duplicate);
    ledger
        .record_report(
            &report("r-2", "eu", W0, vec![(1, 90, true)], 50),
            W0 + 16_000,
        )
        .await
        .expect("report");
    ledger
        .record_report(
            &report("r-3", "eu", W0, vec![(1, 80, false)], 20),
            W0 + 17_000,
        )
        .await
        .expect("a late, smaller report changes nothing");
    ledger
        .record_report(
            &report("r-4", "us", W0, vec![(3, 50, true)], 5),
            W0 + 61_000,
        )
        .await
        .expect("report");

    // At W0 + 61 s, window 0 is over: lease 1 (final, 90 of 100) strands 10; lease 2 expired without
    // a final report: 90 unreported; lease 3 spent all of it.
    let windows = ledger
        .windows(&tenant(), &pool(), &config(), 10, W0 + 61_000)
        .await
        .expect("windows");
    assert_eq!(windows.len(), 2);
    assert_eq!(windows[0].window_start_ms, W0 + WINDOW_MS, "newest first");
    let w0 = &windows[1];
    assert_eq!(w0.granted_tokens, 250);
    assert_eq!(w0.granted_tokens_by_region.get(&region("eu")), Some(&200));
    assert_eq!(w0.spent_tokens, 90 + 10 + 50);
    assert_eq!(w0.stranded_tokens, 10);
    assert_eq!(w0.unreported_tokens, 90);
    assert_eq!(w0.fallback_admitted_tokens, 55);
    assert_eq!(
        w0.fallback_admitted_tokens_by_region.get(&region("eu")),
        Some(&50)
    );
    assert_eq!(w0.admitted_tokens, 205);
    assert_eq!(
        w0.spent_tokens_by_region,
        [(region("eu"), 100), (region("us"), 50)].into(),
        "each region's leases' spends"
    );
    assert_eq!(
        w0.admitted_tokens_by_region,
        [(region("eu"), 150), (region("us"), 55)].into(),
        "each region's spends and fallback admits"
    );
    assert_eq!(w0.overshoot_tokens, 0);
    assert_eq!((w0.limit_tokens, w0.bound_tokens), (1_000, 1_200));
    let only_last = ledger
        .windows(&tenant(), &pool(), &config(), 1, W0 + 61_000)
        .await
        .expect("windows");
    assert_eq!(only_last.len(), 1);

    // A pool in shadow mode grants nothing: its regions report what its shadow rule counted,
    // cumulatively and possibly out of order; the window is listed, the larger count kept, and
    // nothing of it is admitted or overshoot.
    let w2 = W0 + 2 * WINDOW_MS;
    for (id, region_name, counted) in [
        ("s-eu-2", "eu", 1_400),
        ("s-eu-1", "eu", 900),
        ("s-us-1", "us", 100),
    ] {
        let shadow = Report {
            shadow_admitted_tokens: counted,
            ..report(id, region_name, w2, vec![], 0)
        };
        ledger
            .record_report(&shadow, w2 + 1)
            .await
            .expect("shadow report");
    }
    let windows = ledger
        .windows(&tenant(), &pool(), &config(), 10, w2 + 1_000)
        .await
        .expect("windows");
    let shadowed = windows
        .iter()
        .find(|w| w.window_start_ms == w2)
        .expect("the shadow window is listed");
    assert_eq!(shadowed.shadow_admitted_tokens, 1_500);
    assert_eq!(
        shadowed.shadow_admitted_tokens_by_region,
        [(region("eu"), 1_400), (region("us"), 100)].into()
    );
    assert_eq!(
        (shadowed.admitted_tokens, shadowed.overshoot_tokens),
        (0, 0)
    );
    assert_eq!(
        windows
            .iter()
            .find(|w| w.window_start_ms == W0)
            .map(|w| w.shadow_admitted_tokens),
        Some(0)
    );

    // The audit log keeps entries as written and reads the newest first, at most as many as asked.
    let entries: Vec<AuditEntry> = (0..3u64)
        .map(|n| AuditEntry {
            entry_id: lease(900 + u128::from(n)).to_string(),
            at_ms: W0 + n,
            actor: "author:tok-0123456789abcdef".to_owned(),
            action: "pool.put".to_owned(),
            target: "atlas/api".to_owned(),
            version: n + 1,
            detail: "{}".to_owned(),
        })
        .collect();
    for entry in &entries {
        ledger.record_audit(entry).await.expect("audit");
    }
    let newest = ledger.audit_entries(2).await.expect("audit read");
    assert_eq!(newest, vec![entries[2].clone(), entries[1].clone()]);
    assert!(
        ledger.record_audit(&entries[0]).await.is_err(),
        "entry ids are unique"
    );
}

async fn sqlite_ledger() -> (Ledger, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("ledger.db").display());
    (Ledger::connect(&url).await.expect("sqlite ledger"), dir)
}

/// A fresh PostgreSQL database, dropped when the guard goes.
struct PostgresDatabase {
    server: String,
    name: String,
}

impl PostgresDatabase {
    async fn create() -> (Self, String) {
        let server = std::env::var("ALLOT_TEST_POSTGRES_URL").expect(
            "ALLOT_TEST_POSTGRES_URL must name a PostgreSQL server (scripts/test sets it, e.g. \
             postgres://postgres@127.0.0.1:5432)",
        );
        let server = server.trim_end_matches('/').to_owned();
        let name = format!(
            "allot_test_{}_{}",
            std::process::id(),
            rand::random::<u32>()
        );
        let mut admin = sqlx::PgConnection::connect(&format!("{server}/postgres"))
            .await
            .expect("connect to the PostgreSQL server");
        sqlx::query(&format!("CREATE DATABASE {name}"))
            .execute(&mut admin)
            .await
            .expect("create the test database");
        let url = format!("{server}/{name}");
        (Self { server, name }, url)
    }
}

impl Drop for PostgresDatabase {
    fn drop(&mut self) {
        let (server, name) = (self.server.clone(), self.name.clone());
        // Drop on a fresh runtime in a thread: Drop cannot await, and the test's runtime may be gone.
        let _ = std::thread::spawn(move || {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .ok()?;
            runtime.block_on(async {
                let mut admin = sqlx::PgConnection::connect(&format!("{server}/postgres"))
                    .await
                    .ok()?;
                sqlx::query(&format!("DROP DATABASE IF EXISTS {name} WITH (FORCE)"))
                    .execute(&mut admin)
                    .await
                    .ok()
            })
        })
        .join();
    }
}

/// A window row as the ledger's accounting gives it, with what matters to the bound check.
fn checked_window(window_start_ms: u64, admitted_tokens: u64, bound_tokens: u64) -> WindowRow {
    WindowRow {
        window_start_ms,
        window_end_ms: window_start_ms + WINDOW_MS,
        limit_tokens: 1_000,
        admitted_tokens,
        bound_tokens,
        overshoot_tokens: admitted_tokens.saturating_sub(1_000),
        ..WindowRow::default()
    }
}

/// Each window is checked once, whoever checks it again; a window over its bound is a violation,
/// listed newest first with its figures.
async fn bound_checks(ledger: Ledger) {
    let fine = checked_window(W0, 990, 1_200);
    let over = checked_window(W0 + WINDOW_MS, 1_250, 1_200);
    let added = ledger
        .record_bound_checks(
            &tenant(),
            &pool(),
            &[over.clone(), fine.clone()],
            W0 + 200_000,
        )
        .await
        .expect("checked");
    assert_eq!((added.windows, added.violations), (2, 1));
    let again = ledger
        .record_bound_checks(&tenant(), &pool(), &[over, fine], W0 + 230_000)
        .await
        .expect("checked again");
    assert_eq!(
        (again.windows, again.violations),
        (0, 0),
        "each window once"
    );
    let summary = ledger.bound_check_summary(10).await.expect("summary");
    assert_eq!((summary.windows_checked, summary.violations), (2, 1));
    let [violation] = summary.recent_violations.as_slice() else {
        panic!("one violation: {summary:?}");
    };
    assert_eq!(
        (
            violation.tenant.as_str(),
            violation.pool.as_str(),
            violation.window_start_ms,
            violation.admitted,
            violation.bound,
            violation.checked_at_ms
        ),
        ("atlas", "api", W0 + WINDOW_MS, 1_250, 1_200, W0 + 200_000)
    );
    assert!(
        ledger
            .bound_check_summary(0)
            .await
            .expect("summary")
            .recent_violations
            .is_empty()
    );
    // Reports that come late (a region's, after a partition) move a checked window: checked again,
    // it is updated, and counted as a violation when it crosses its bound then, once.
    let late = checked_window(W0 + 2 * WINDOW_MS, 1_100, 1_200);
    let first = ledger
        .record_bound_checks(&tenant(), &pool(), &[late], W0 + 300_000)
        .await
        .expect("checked");
    assert_eq!((first.windows, first.violations), (1, 0));
    let crossed = checked_window(W0 + 2 * WINDOW_MS, 1_230, 1_200);
    let mut counted = Vec::new();
    for _ in 0..2 {
        let added = ledger
            .record_bound_checks(
                &tenant(),
                &pool(),
                std::slice::from_ref(&crossed),
                W0 + 330_000,
            )
            .await
            .expect("checked again");
        assert_eq!(added.windows, 0, "not a new window");
        counted.push(added.violations);
    }
    assert_eq!(counted, [1, 0], "counted when it crossed, once");
    let summary = ledger.bound_check_summary(10).await.expect("summary");
    assert_eq!((summary.windows_checked, summary.violations), (3, 2));
    assert_eq!(summary.recent_violations[0].admitted, 1_230, "{summary:?}");
}

#[tokio::test]
async fn sqlite_bound_checks() {
    let (ledger, _dir) = sqlite_ledger().await;
    bound_checks(ledger).await;
}

#[tokio::test]
async fn postgres_bound_checks() {
    let (_database, url) = PostgresDatabase::create().await;
    let ledger = Ledger::connect(&url).await.expect("postgres ledger");
    bound_checks(ledger).await;
}

/// A round of reports from a seed: several windows, leases reported in several reports (cumulative,
/// some late and smaller, some final), report ids repeated within the round and across rounds, a
/// report refused (a lease it may not report), and two agents and an unnamed one per region.
fn round_of_reports(seed: u64, round: u64) -> Vec<Report> {
    let mut state = seed
        .wrapping_mul(6_364_136_223_846_793_005)
        .wrapping_add(round + 1);
    let mut next = |bound: u64| {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) % bound
    };
    (0..12)
        .map(|_| {
            let window = next(2);
            let region_name = if next(2) == 0 { "eu" } else { "us" };
            let leases = (0..next(3))
                .map(|_| {
                    // Leases 1-4 are EU's in window 0, 5-8 US's; 9-12 and 13-16 in window 1.
                    let base = window * 8 + if region_name == "eu" { 1 } else { 5 };
                    let n = if next(10) == 0 { 99 } else { base + next(4) };
                    (u128::from(n), next(60), next(4) == 0)
                })
                .collect();
            let mut report = report(
                &format!("r-{seed}-{}", next(16)),
                region_name,
                W0 + window * WINDOW_MS,
                leases,
                next(40),
            );
            report.shadow_admitted_tokens = next(5);
            report.settle_debt_tokens = next(3);
            report.agent_id = match next(3) {
                0 => None,
                n => Some(AgentId::parse(&format!("{region_name}-{n}")).expect("agent")),
            };
            report
        })
        .collect()
}

/// Batched and one by one, the same reports leave the same ledger and get the same answers.
async fn batch_is_one_by_one(batched: Ledger, one_by_one: Ledger) {
    for ledger in [&batched, &one_by_one] {
        let grants: Vec<GrantRecord> = (1..=16u128)
            .map(|n| {
                let window = u64::from(n > 8);
                let region_name = if (n - 1) % 8 < 4 { "eu" } else { "us" };
                grant(
                    n,
                    region_name,
                    W0 + window * WINDOW_MS,
                    50,
                    W0 + (window + 1) * WINDOW_MS,
                )
            })
            .collect();
        ledger
            .record_grants(&tenant(), &pool(), &grants)
            .await
            .expect("grants");
    }
    for seed in 0..8 {
        for round in 0..3 {
            let reports = round_of_reports(seed, round);
            let now_ms = W0 + 1_000 * (round + 1);
            let refs: Vec<&Report> = reports.iter().collect();
            let known = batched.known_grants(&refs).await.expect("grants");
            assert!(
                known
                    .missing()
                    .iter()
                    .all(|(_, _, missing)| *missing == lease(99)),
                "only lease 99 was never granted"
            );
            let answers = batched
                .record_reports_known(&refs, &known, now_ms, &Default::default())
                .await
                .expect("a batch");
            assert_eq!(answers.len(), reports.len());
            for (report, answer) in reports.iter().zip(answers) {
                let alone = match one_by_one.record_report(report, now_ms).await {
                    Ok(receipt) => Ok(receipt),
                    Err(LedgerError::Invalid(invalid)) => Err(invalid),
                    Err(other) => panic!("{other}"),
                };
                assert_eq!(answer, alone, "seed {seed}, round {round}: {report:?}");
            }
        }
        let at_ms = W0 + 3 * WINDOW_MS;
        let windows = |ledger: &Ledger| {
            let ledger = ledger.clone();
            async move {
                let rows = ledger
                    .windows(&tenant(), &pool(), &config(), 10, at_ms)
                    .await
                    .expect("windows");
                format!("{rows:?}")
            }
        };
        assert_eq!(
            windows(&batched).await,
            windows(&one_by_one).await,
            "seed {seed}"
        );
        for region_name in ["eu", "us"] {
            for agent in [None, Some("1"), Some("2")] {
                let agent =
                    agent.map(|n| AgentId::parse(&format!("{region_name}-{n}")).expect("agent"));
                let fallback = async |ledger: &Ledger| {
                    ledger
                        .fallback_admitted(
                            &tenant(),
                            &pool(),
                            &region(region_name),
                            agent.as_ref(),
                            W0,
                        )
                        .await
                        .expect("fallback")
                };
                assert_eq!(
                    fallback(&batched).await,
                    fallback(&one_by_one).await,
                    "seed {seed}"
                );
            }
        }
    }
}

#[tokio::test]
async fn sqlite_batch_is_one_by_one() {
    let (batched, _first) = sqlite_ledger().await;
    let (one_by_one, _second) = sqlite_ledger().await;
    batch_is_one_by_one(batched, one_by_one).await;
}

#[tokio::test]
async fn postgres_batch_is_one_by_one() {
    let (_first, url) = PostgresDatabase::create().await;
    let batched = Ledger::connect(&url).await.expect("postgres ledger");
    let (_second, url) = PostgresDatabase::create().await;
    let one_by_one = Ledger::connect(&url).await.expect("postgres ledger");
    batch_is_one_by_one(batched, one_by_one).await;
}

#[tokio::test]
async fn sqlite_accounting() {
    let (ledger, _dir) = sqlite_ledger().await;
    accounting(ledger).await;
}

#[tokio::test]
async fn postgres_accounting() {
    let (_database, url) = PostgresDatabase::create().await;
    let ledger = Ledger::connect(&url).await.expect("postgres ledger");
    accounting(ledger).await;
}

#[tokio::test]
async fn migrations_are_idempotent_and_urls_are_checked() {
    let dir = tempfile::tempdir().expect("temp dir");
    let url = format!("sqlite://{}", dir.path().join("ledger.db").display());
    Ledger::connect(&url).await.expect("first start");
    Ledger::connect(&url)
        .await
        .expect("second start applies nothing new");
    assert!(matches!(
        Ledger::connect("mysql://localhost/x").await,
        Err(LedgerError::UnsupportedUrl(_))
    ));
}

/// Agent sessions: the first agent of a region starts clean; a run that never ended makes the next
/// run of its agent id unclean; a clean end makes it clean; a retried start gets its first answer;
/// an end by a run that is no longer the latest changes nothing; a new agent id in a region that
/// had agents starts unclean (its history is unknown).
async fn agent_sessions(ledger: Ledger) {
    use allot_shared::ids::{AgentId, AgentIncarnation};
    use allot_shared::wire::AgentSession;
    let session = |region_name: &str, agent: &str, run: u128| AgentSession {
        region: region(region_name),
        agent_id: AgentId::parse(agent).expect("agent id"),
        incarnation: AgentIncarnation::from_parts(W0, run),
    };
    let start = async |s: &AgentSession, at_ms: u64| {
        ledger.start_agent_session(s, at_ms).await.expect("started")
    };
    let first = start(&session("eu", "eu-1", 1), W0).await;
    assert!(first.predecessor_ended_cleanly, "the region's first agent");
    assert_eq!(first.started_at_ms, W0);
    assert_eq!(first.unclean_since_ms, None);
    let retried = start(&session("eu", "eu-1", 1), W0 + 500).await;
    assert_eq!(retried, first, "a retried start gets its first answer");
    // The first run crashes: the second learns it.
    let second = start(&session("eu", "eu-1", 2), W0 + 1_000).await;
    assert!(
        !second.predecessor_ended_cleanly,
        "the run before never ended"
    );
    assert_eq!(
        second.unclean_since_ms,
        Some(W0 + 1_000),
        "this run follows an unclean end"
    );
    assert_eq!(
        start(&session("eu", "eu-1", 2), W0 + 1_500).await,
        second,
        "the verdict is kept for its run"
    );
    assert!(
        !ledger
            .end_agent_session(&session("eu", "eu-1", 1), W0 + 2_000)
            .await
            .expect("end"),
        "a run that is no longer the latest cannot end the agent's session"
    );
    assert!(
        ledger
            .end_agent_session(&session("eu", "eu-1", 2), W0 + 2_000)
            .await
            .expect("end"),
        "the latest run ends"
    );
    let third = start(&session("eu", "eu-1", 3), W0 + 3_000).await;
    assert!(
        third.predecessor_ended_cleanly,
        "the run before ended cleanly"
    );
    assert_eq!(
        third.unclean_since_ms,
        Some(W0 + 1_000),
        "a clean end does not vouch for the crash before it"
    );
    // Another agent id in a region that already had agents: nobody knows how its last run ended.
    let renamed = start(&session("eu", "eu-7", 1), W0 + 3_000).await;
    assert!(
        !renamed.predecessor_ended_cleanly,
        "an unknown history is unclean"
    );
    assert_eq!(renamed.unclean_since_ms, Some(W0 + 3_000));
    // Regions are apart: the first agent of another region starts clean.
    assert!(
        start(&session("us", "us-1", 1), W0)
            .await
            .predecessor_ended_cleanly
    );
    assert!(
        !ledger
            .end_agent_session(&session("ap", "ap-1", 1), W0)
            .await
            .expect("end"),
        "a run never started does not end"
    );
}

#[tokio::test]
async fn sqlite_agent_sessions() {
    let (ledger, _dir) = sqlite_ledger().await;
    agent_sessions(ledger).await;
}

#[tokio::test]
async fn postgres_agent_sessions() {
    let (_database, url) = PostgresDatabase::create().await;
    let ledger = Ledger::connect(&url).await.expect("postgres ledger");
    agent_sessions(ledger).await;
}

/// Retention: a window past the raw retention is rolled up (its grants, spend and admits become one
/// row a region) and reads exactly as before; raw reports go after the raw retention; rolled-up
/// windows, window checks and inactive agents' sessions after the rollup retention; all in batches.
/// An agent whose session row went is never taken for its region's first.
async fn retention(ledger: Ledger) {
    use allot_allocator::ledger::Retention;
    use allot_allocator::ledger::retention::RETENTION_BATCH_ROWS;
    use allot_shared::ids::{AgentId, AgentIncarnation};
    use allot_shared::wire::AgentSession;
    const DAY_MS: u64 = 86_400_000;
    let retention = Retention {
        raw_days: 7,
        rollup_days: 30,
    };
    let now = W0 + 10 * DAY_MS;
    let recent = now - DAY_MS - (now - DAY_MS) % WINDOW_MS;
    // An old window (W0) with two regions' grants, spend, a final report and fallback, and a
    // recent one.
    ledger
        .record_grants(
            &tenant(),
            &pool(),
            &[
                grant(1, "eu", W0, 500, W0 + 15_000),
                grant(2, "us", W0, 200, W0 + 15_000),
                grant(3, "eu", recent, 300, recent + 15_000),
            ],
        )
        .await
        .expect("granted");
    // More old reports than a batch, sent in W0; eu's lease 1 ends at 400 spent (final).
    let old_reports = RETENTION_BATCH_ROWS + 250;
    for n in 0..old_reports {
        let last = n + 1 == old_reports;
        ledger
            .record_report(
                &report(
                    &format!("old-{n}"),
                    "eu",
                    W0,
                    vec![(1, n.min(400), last)],
                    0,
                ),
                W0 + n,
            )
            .await
            .expect("reported");
    }
    ledger
        .record_report(
            &report("us-old", "us", W0, vec![(2, 150, false)], 3),
            W0 + 9_000,
        )
        .await
        .expect("reported");
    ledger
        .record_report(
            &report("recent", "eu", recent, vec![(3, 120, false)], 0),
            now - DAY_MS,
        )
        .await
        .expect("reported");
    // Window checks: one of a window that ended 40 days before now, one 20 days before.
    let old_check = checked_window(now - 40 * DAY_MS - WINDOW_MS, 10, 1_200);
    let young_check = checked_window(now - 20 * DAY_MS - WINDOW_MS, 20, 1_200);
    ledger
        .record_bound_checks(&tenant(), &pool(), &[old_check, young_check], now)
        .await
        .expect("checked");
    // Agent sessions: one ended 40 days ago, one started 40 days ago and never ended (a crash),
    // one recent.
    let session = |region_name: &str, agent: &str| AgentSession {
        region: region(region_name),
        agent_id: AgentId::parse(agent).expect("agent id"),
        incarnation: AgentIncarnation::from_parts(W0, 7),
    };
    let long_ago = now - 40 * DAY_MS;
    ledger
        .start_agent_session(&session("ap", "ap-1"), long_ago)
        .await
        .expect("started");
    assert!(
        ledger
            .end_agent_session(&session("ap", "ap-1"), long_ago + 1_000)
            .await
            .expect("ended")
    );
    ledger
        .start_agent_session(&session("sa", "sa-1"), long_ago)
        .await
        .expect("started");
    ledger
        .start_agent_session(&session("us", "us-1"), now - DAY_MS)
        .await
        .expect("started");
    let windows = async || {
        ledger
            .windows(&tenant(), &pool(), &config(), 10, now)
            .await
            .expect("windows")
    };
    let before = windows().await;
    assert_eq!(before.len(), 2);

    let removed = ledger
        .remove_expired(retention, now)
        .await
        .expect("removed");
    assert_eq!(
        removed.windows_rolled_up, 1,
        "only the old window: {removed:?}"
    );
    assert_eq!(removed.from("grants"), 2);
    assert_eq!(removed.from("lease_spend"), 2);
    assert_eq!(removed.from("fallback_admits"), 1);
    assert_eq!(
        removed.from("lease_reports"),
        old_reports + 1,
        "every old report, over several batches"
    );
    assert_eq!(
        removed.from("bound_checks"),
        1,
        "the window that ended 40 days ago"
    );
    assert_eq!(
        removed.from("agent_sessions"),
        2,
        "the two runs inactive for 40 days"
    );
    assert_eq!(
        windows().await,
        by_region_only(&before),
        "a rolled-up window reads exactly as before, but for its breakdown by agent"
    );
    let old = &before[1];
    assert_eq!(
        (
            old.granted_tokens,
            old.spent_tokens,
            old.stranded_tokens,
            old.unreported_tokens
        ),
        (700, 550, 100, 50)
    );
    assert_eq!(old.fallback_admitted_tokens, 3);
    let again = ledger
        .remove_expired(retention, now)
        .await
        .expect("removed");
    assert_eq!(again.windows_rolled_up, 0);
    assert!(
        again.rows.values().all(|&rows| rows == 0),
        "nothing twice: {again:?}"
    );

    // A report naming a rolled-up lease is refused and changes nothing; a late fallback report of
    // the old window raises its figure, read at once and rolled up again the next round.
    assert!(matches!(
        ledger
            .record_report(&report("late", "eu", W0, vec![(1, 450, true)], 0), now)
            .await,
        Err(LedgerError::Invalid(_))
    ));
    ledger
        .record_report(&report("late-us", "us", W0, vec![], 5), now)
        .await
        .expect("a fallback line of an old window");
    assert_eq!(windows().await[1].fallback_admitted_tokens, 5);
    let rolled_again = ledger
        .remove_expired(retention, now)
        .await
        .expect("removed");
    assert_eq!(rolled_again.windows_rolled_up, 1);
    let after = windows().await;
    assert_eq!(after[1].fallback_admitted_tokens, 5);
    assert_eq!(after[1].spent_tokens, 550, "rolling again lowers nothing");

    // What stays: the recent report, the younger check, the recent session.
    let reports = ledger.last_reports(0).await.expect("last reports");
    assert_eq!(reports.get(&region("eu")), Some(&(now - DAY_MS)));
    let summary = ledger.bound_check_summary(10).await.expect("summary");
    assert_eq!(summary.windows_checked, 1);
    // The agent whose row went is judged as after an unclean end, not as its region's first.
    let back = ledger
        .start_agent_session(
            &AgentSession {
                incarnation: AgentIncarnation::from_parts(W0, 8),
                ..session("ap", "ap-1")
            },
            now,
        )
        .await
        .expect("started");
    assert!(!back.predecessor_ended_cleanly, "its region had agents");
    assert_eq!(back.unclean_since_ms, Some(now));

    // Past the rollup retention the old window is gone, while the recent one, rolled up by then,
    // stays; retention 0 keeps everything.
    let much_later = now + 25 * DAY_MS;
    let forever = Retention {
        raw_days: 0,
        rollup_days: 0,
    };
    let kept = ledger
        .remove_expired(forever, much_later)
        .await
        .expect("removed");
    assert!(kept.rows.values().all(|&rows| rows == 0), "{kept:?}");
    let removed = ledger
        .remove_expired(retention, much_later)
        .await
        .expect("removed");
    assert_eq!(
        removed.from("window_amounts"),
        2,
        "eu's and us's rows of the old window"
    );
    let left = ledger
        .windows(&tenant(), &pool(), &config(), 10, much_later)
        .await
        .expect("windows");
    assert_eq!(
        left.iter().map(|w| w.window_start_ms).collect::<Vec<_>>(),
        [recent],
        "{left:?}"
    );
    assert_eq!((left[0].granted_tokens, left[0].spent_tokens), (300, 120));
}

#[tokio::test]
async fn sqlite_retention() {
    let (ledger, _dir) = sqlite_ledger().await;
    retention(ledger).await;
}

#[tokio::test]
async fn postgres_retention() {
    let (_database, url) = PostgresDatabase::create().await;
    let ledger = Ledger::connect(&url).await.expect("postgres ledger");
    retention(ledger).await;
}

/// Over random histories (grants, spend, final reports, fallback, shadow, debt and write-offs in
/// several windows and regions), every window reads the same after its raw rows are rolled up.
async fn rollup_reads_as_raw(ledger: Ledger, seed: u64) {
    use allot_allocator::ledger::Retention;
    const DAY_MS: u64 = 86_400_000;
    let mut state = seed.wrapping_mul(6_364_136_223_846_793_005).wrapping_add(1);
    let mut next = |below: u64| {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        (state >> 33) % below.max(1)
    };
    let mut lease_n = 0u128;
    for w in 0..6u64 {
        let window_start_ms = W0 + w * WINDOW_MS;
        for region_name in ["eu", "us"] {
            let mut leases = Vec::new();
            for _ in 0..next(4) {
                lease_n += 1;
                let granted = 1 + next(100);
                ledger
                    .record_grants(
                        &tenant(),
                        &pool(),
                        &[grant(
                            lease_n,
                            region_name,
                            window_start_ms,
                            granted,
                            window_start_ms + 15_000,
                        )],
                    )
                    .await
                    .expect("granted");
                if next(3) > 0 {
                    leases.push((lease_n, next(granted + 1), next(2) == 1));
                }
            }
            let mut line = report(
                &format!("r-{seed}-{w}-{region_name}"),
                region_name,
                window_start_ms,
                leases,
                next(3) * next(20),
            );
            line.shadow_admitted_tokens = next(2) * next(50);
            line.settle_debt_tokens = next(2) * next(10);
            line.written_off_tokens = next(2) * next(5);
            // Named or not; and sometimes a second agent of the region with figures of its own.
            line.agent_id = [None, Some(agent("a1"))][next(2) as usize].clone();
            ledger
                .record_report(&line, window_start_ms + 20_000)
                .await
                .expect("reported");
            if next(2) == 1 {
                let other = Report {
                    shadow_admitted_tokens: next(2) * next(50),
                    settle_debt_tokens: next(2) * next(10),
                    written_off_tokens: next(2) * next(5),
                    agent_id: Some(agent("a2")),
                    ..report(
                        &format!("r2-{seed}-{w}-{region_name}"),
                        region_name,
                        window_start_ms,
                        vec![],
                        next(3) * next(20),
                    )
                };
                ledger
                    .record_report(&other, window_start_ms + 21_000)
                    .await
                    .expect("reported");
            }
        }
    }
    let now = W0 + 30 * DAY_MS;
    let before = ledger
        .windows(&tenant(), &pool(), &config(), 10, now)
        .await
        .expect("windows");
    assert_eq!(
        paged_windows(&ledger, now).await,
        before,
        "seed {seed}: pages of two windows, each before the last page's oldest, are the whole"
    );
    let removed = ledger
        .remove_expired(
            Retention {
                raw_days: 7,
                rollup_days: 0,
            },
            now,
        )
        .await
        .expect("rolled up");
    assert_eq!(
        removed.windows_rolled_up,
        before.len() as u64,
        "seed {seed}"
    );
    let after = ledger
        .windows(&tenant(), &pool(), &config(), 10, now)
        .await
        .expect("windows");
    assert_eq!(after, by_region_only(&before), "seed {seed}");
    assert_eq!(
        paged_windows(&ledger, now).await,
        by_region_only(&before),
        "seed {seed}: rolled up too"
    );
}

/// `rows` as a rolled-up window reads: every figure, each region's the sum over its agents, but
/// not the breakdown by agent, which the rollup does not keep.
fn by_region_only(rows: &[WindowRow]) -> Vec<WindowRow> {
    rows.iter()
        .map(|row| WindowRow {
            fallback_admitted_tokens_by_agent: Default::default(),
            ..row.clone()
        })
        .collect()
}

fn agent(name: &str) -> AgentId {
    AgentId::parse(name).expect("agent id")
}

/// Every window of the pool, read two at a time, each page the windows before the last one's
/// oldest (`windows_before`).
async fn paged_windows(ledger: &Ledger, now_ms: u64) -> Vec<WindowRow> {
    let mut all = Vec::new();
    let mut before_ms = u64::MAX;
    loop {
        let page = ledger
            .windows_before(&tenant(), &pool(), &config(), 2, now_ms, before_ms)
            .await
            .expect("windows");
        let Some(oldest) = page.last().map(|row| row.window_start_ms) else {
            return all;
        };
        assert!(page.iter().all(|row| row.window_start_ms < before_ms));
        all.extend(page);
        before_ms = oldest;
    }
}

#[tokio::test]
async fn sqlite_rollup_reads_as_raw_over_random_histories() {
    for seed in 0..64 {
        let (ledger, _dir) = sqlite_ledger().await;
        rollup_reads_as_raw(ledger, seed).await;
    }
}

#[tokio::test]
async fn postgres_rollup_reads_as_raw_over_random_histories() {
    for seed in 0..4 {
        let (_database, url) = PostgresDatabase::create().await;
        let ledger = Ledger::connect(&url).await.expect("postgres ledger");
        rollup_reads_as_raw(ledger, seed).await;
    }
}

/// A window longer than the raw retention is rolled up only once its grant records have left the
/// store (a window's length after its end): before, the leader's reconciliation would copy them
/// back.
async fn long_windows_wait_for_their_records(ledger: Ledger) {
    use allot_allocator::ledger::Retention;
    const DAY_MS: u64 = 86_400_000;
    let month_start = W0;
    let month_end = W0 + 30 * DAY_MS;
    ledger
        .record_grants(
            &tenant(),
            &pool(),
            &[GrantRecord {
                window_end_ms: month_end,
                expires_at_ms: month_end,
                ..grant(1, "eu", month_start, 500, month_end)
            }],
        )
        .await
        .expect("granted");
    // Fallback admits in the same window must not roll it up early either.
    ledger
        .record_report(
            &report("month-fallback", "us", month_start, vec![], 4),
            month_start,
        )
        .await
        .expect("reported");
    let retention = Retention::default();
    // Ten days after the month ended: past the 7-day raw retention, but its records live on.
    let early = ledger
        .remove_expired(retention, month_end + 10 * DAY_MS)
        .await
        .expect("removed");
    assert_eq!(early.windows_rolled_up, 0, "{early:?}");
    assert_eq!(
        early.from("grants"),
        0,
        "the open month's grants stay: {early:?}"
    );
    // A month and a day after its end: rolled up.
    let late = ledger
        .remove_expired(retention, month_end + 31 * DAY_MS)
        .await
        .expect("removed");
    assert_eq!(late.windows_rolled_up, 1, "{late:?}");
    assert_eq!(late.from("grants"), 1);
    assert_eq!(late.from("fallback_admits"), 1);
}

#[tokio::test]
async fn sqlite_long_windows_wait_for_their_records() {
    let (ledger, _dir) = sqlite_ledger().await;
    long_windows_wait_for_their_records(ledger).await;
}

#[tokio::test]
async fn postgres_long_windows_wait_for_their_records() {
    let (_database, url) = PostgresDatabase::create().await;
    let ledger = Ledger::connect(&url).await.expect("postgres ledger");
    long_windows_wait_for_their_records(ledger).await;
}

/// Webhook registrations and their events: bounded registrations, each event recorded once and
/// only while the queue has room, due events oldest first with their endpoint and secrets, a
/// rotation keeping the old secret beside the new, deliveries and failures recorded, done events
/// pruned in batches, a deleted webhook's events gone with it.
async fn webhooks(ledger: Ledger) {
    use allot_allocator::ledger::{EventRecorded, StoredWebhook};
    use allot_allocator::webhooks::{ThresholdEvent, event_id};
    let webhook = |id: &str| StoredWebhook {
        id: id.to_owned(),
        url: format!("https://hooks.example/{id}"),
        tenant: TenantId::parse("acme").expect("tenant"),
        pool: None,
        thresholds_pct: vec![80, 100],
        secret: format!("whsec_{id}"),
        previous_secret: None,
        previous_secret_until_ms: None,
        created_at_ms: 1_000,
        created_by: "operator".to_owned(),
    };
    assert!(
        ledger
            .insert_webhook(&webhook("wh-a"), 2)
            .await
            .expect("insert")
    );
    assert!(
        ledger
            .insert_webhook(&webhook("wh-b"), 2)
            .await
            .expect("insert")
    );
    assert!(
        !ledger
            .insert_webhook(&webhook("wh-c"), 2)
            .await
            .expect("insert"),
        "full"
    );
    assert_eq!(
        ledger.webhooks().await.expect("list"),
        [webhook("wh-a"), webhook("wh-b")]
    );

    let (tenant, pool) = (
        TenantId::parse("acme").expect("tenant"),
        PoolId::parse("api").expect("pool"),
    );
    let event = |webhook_id: &str, threshold_pct: u8, window_start_ms: u64| ThresholdEvent {
        event_id: event_id(webhook_id, &tenant, &pool, window_start_ms, threshold_pct),
        kind: "quota.threshold".to_owned(),
        webhook_id: webhook_id.to_owned(),
        tenant: tenant.clone(),
        pool: pool.clone(),
        threshold_pct,
        window_start_ms,
        window_end_ms: window_start_ms + 60_000,
        limit: 10,
        granted: 8,
        fallback_admitted: 0,
        detected_at_ms: window_start_ms + 1,
    };
    let record = |e: ThresholdEvent, now_ms: u64| {
        let ledger = ledger.clone();
        async move {
            ledger
                .record_webhook_event(&e, now_ms, 2)
                .await
                .expect("record")
        }
    };
    assert_eq!(record(event("wh-a", 80, 0), 10).await, EventRecorded::New);
    assert_eq!(
        record(event("wh-a", 80, 0), 11).await,
        EventRecorded::Known,
        "once"
    );
    assert_eq!(record(event("wh-b", 80, 0), 12).await, EventRecorded::New);
    assert_eq!(
        record(event("wh-a", 100, 0), 13).await,
        EventRecorded::QueueFull
    );
    assert_eq!(ledger.pending_webhook_events().await.expect("pending"), 2);

    assert!(
        ledger
            .rotate_webhook_secret("wh-a", "whsec_new", 5_000)
            .await
            .expect("rotate")
    );
    assert!(
        !ledger
            .rotate_webhook_secret("wh-x", "s", 5_000)
            .await
            .expect("rotate")
    );
    let due = ledger.due_webhook_events(100, 10).await.expect("due");
    assert_eq!(due.len(), 2);
    assert_eq!(due[0].webhook_id, "wh-a", "oldest first");
    assert_eq!(due[0].url, "https://hooks.example/wh-a");
    assert_eq!(due[0].secret, "whsec_new");
    assert_eq!(due[0].previous_secret.as_deref(), Some("whsec_wh-a"));
    assert_eq!(due[0].previous_secret_until_ms, Some(5_000));
    assert_eq!(due[0].attempts, 0);
    assert_eq!(
        ledger.due_webhook_events(5, 10).await.expect("due").len(),
        0,
        "not due yet"
    );

    // wh-a's event fails once (tried again at 2,000), wh-b's is delivered.
    ledger
        .webhook_event_failed(&due[0].event_id, 1, Some(502), "answered 502", 2_000, None)
        .await
        .expect("failed");
    ledger
        .webhook_event_delivered(&due[1].event_id, 1, 204, 150)
        .await
        .expect("delivered");
    assert_eq!(
        ledger
            .due_webhook_events(1_999, 10)
            .await
            .expect("due")
            .len(),
        0
    );
    let retry = ledger.due_webhook_events(2_000, 10).await.expect("due");
    assert_eq!((retry.len(), retry[0].attempts), (1, 1));
    let listed = ledger
        .webhook_deliveries("wh-a", 10)
        .await
        .expect("deliveries");
    assert_eq!(listed.len(), 1);
    assert_eq!(
        (
            listed[0].state.as_str(),
            listed[0].last_status,
            listed[0].next_attempt_at_ms
        ),
        ("pending", Some(502), Some(2_000))
    );
    assert_eq!(listed[0].event.threshold_pct, 80);
    assert_eq!(
        ledger
            .webhook_deliveries("wh-b", 10)
            .await
            .expect("deliveries")[0]
            .state,
        "delivered"
    );
    // Given up: no longer due, room in the queue again.
    ledger
        .webhook_event_failed(&retry[0].event_id, 15, None, "refused", 9_000, Some(3_000))
        .await
        .expect("failed");
    assert_eq!(ledger.pending_webhook_events().await.expect("pending"), 0);
    assert_eq!(
        ledger
            .webhook_deliveries("wh-a", 10)
            .await
            .expect("deliveries")[0]
            .state,
        "failed"
    );
    assert_eq!(record(event("wh-a", 100, 0), 20).await, EventRecorded::New);

    // Done events found before 15 go, one batch at a time; the pending one stays.
    assert_eq!(ledger.prune_webhook_events(15, 1).await.expect("prune"), 1);
    assert_eq!(ledger.prune_webhook_events(15, 1).await.expect("prune"), 1);
    assert_eq!(ledger.prune_webhook_events(15, 1).await.expect("prune"), 0);
    assert_eq!(ledger.pending_webhook_events().await.expect("pending"), 1);

    assert!(ledger.delete_webhook("wh-a").await.expect("delete"));
    assert!(!ledger.delete_webhook("wh-a").await.expect("delete"));
    assert_eq!(
        ledger.pending_webhook_events().await.expect("pending"),
        0,
        "its events went too"
    );
    assert_eq!(ledger.webhooks().await.expect("list"), [webhook("wh-b")]);
}

#[tokio::test]
async fn sqlite_webhooks() {
    let (ledger, _dir) = sqlite_ledger().await;
    webhooks(ledger).await;
}

#[tokio::test]
async fn postgres_webhooks() {
    let (_database, url) = PostgresDatabase::create().await;
    let ledger = Ledger::connect(&url).await.expect("postgres ledger");
    webhooks(ledger).await;
}

/// A report of `region`'s agent `agent` (`None`: one that names no agent) of its cumulative
/// fallback admits in the window starting at `window_start_ms`.
fn fallback_report(id: &str, region_name: &str, agent_name: Option<&str>, tokens: u64) -> Report {
    Report {
        agent_id: agent_name.map(agent),
        incarnation: agent_name.map(|_| allot_shared::ids::AgentIncarnation::from_parts(W0, 3)),
        ..report(id, region_name, W0, vec![], tokens)
    }
}

/// Several agents of a region: each agent's figures kept apart (the larger reported, whatever the
/// order and however often), the region's figure their sum, everywhere the ledger is read.
async fn agents_of_a_region(ledger: Ledger) {
    // eu runs two agents, each admitting its share; us one agent that names none.
    for (id, region_name, agent_name, tokens) in [
        ("eu-1-a", "eu", Some("eu-1"), 5),
        ("eu-2-a", "eu", Some("eu-2"), 8),
        ("eu-1-b", "eu", Some("eu-1"), 8),
        // Late and out of order: a smaller cumulative figure changes nothing.
        ("eu-1-c", "eu", Some("eu-1"), 6),
        ("us-a", "us", None, 3),
        ("us-b", "us", None, 7),
    ] {
        let receipt = ledger
            .record_report(
                &fallback_report(id, region_name, agent_name, tokens),
                W0 + 9,
            )
            .await
            .expect("reported");
        assert!(!receipt.duplicate);
    }
    // A retried report is taken once.
    let retried = ledger
        .record_report(&fallback_report("eu-2-a", "eu", Some("eu-2"), 8), W0 + 10)
        .await
        .expect("retried");
    assert!(retried.duplicate);

    let windows = ledger
        .windows(&tenant(), &pool(), &config(), 10, W0 + 120_000)
        .await
        .expect("windows");
    let [window] = windows.as_slice() else {
        panic!("one window: {windows:?}");
    };
    assert_eq!(
        window.fallback_admitted_tokens_by_region,
        [(region("eu"), 16), (region("us"), 7)].into(),
        "each region's figure is the sum of its agents'"
    );
    assert_eq!(window.fallback_admitted_tokens, 23);
    assert_eq!(window.admitted_tokens, 23);
    assert_eq!(
        window.fallback_admitted_tokens_by_agent,
        [
            (
                region("eu"),
                [("eu-1".to_owned(), 8), ("eu-2".to_owned(), 8)].into()
            ),
            (
                region("us"),
                [(allot_allocator::ledger::UNNAMED_AGENT_LABEL.to_owned(), 7)].into()
            ),
        ]
        .into()
    );
    // A restarting agent starts from its own count; one that names none, from its region's.
    let admitted = async |region_name: &str, agent_name: Option<&str>| {
        let named = agent_name.map(agent);
        ledger
            .fallback_admitted(&tenant(), &pool(), &region(region_name), named.as_ref(), W0)
            .await
            .expect("fallback admitted")
    };
    assert_eq!(admitted("eu", Some("eu-1")).await, 8);
    assert_eq!(
        admitted("eu", Some("eu-3")).await,
        0,
        "an agent never heard of"
    );
    assert_eq!(admitted("eu", None).await, 16);
    assert_eq!(admitted("us", None).await, 7);
    // The regions view counts each pool once per region, with the region's sum.
    let recent = ledger.recent_fallback(W0).await.expect("recent");
    let eu: Vec<_> = recent
        .iter()
        .filter(|row| row.region == region("eu"))
        .collect();
    assert_eq!(eu.len(), 1, "{recent:?}");
    assert_eq!(eu[0].admitted_tokens, 16);
    // Within the allowance of 100 a region, no violation; two agents each taking the whole
    // allowance are one.
    assert!(window.fallback_over_allowance_tokens_by_region.is_empty());
    for (id, agent_name) in [("eu-1-d", "eu-1"), ("eu-2-d", "eu-2")] {
        ledger
            .record_report(&fallback_report(id, "eu", Some(agent_name), 100), W0 + 20)
            .await
            .expect("reported");
    }
    let windows = ledger
        .windows(&tenant(), &pool(), &config(), 10, W0 + 120_000)
        .await
        .expect("windows");
    assert_eq!(
        windows[0].fallback_over_allowance_tokens_by_region,
        [(region("eu"), 100)].into()
    );
    assert!(
        windows[0].admitted_tokens <= windows[0].bound_tokens,
        "within the window's bound, yet over the region's allowance"
    );
    let added = ledger
        .record_bound_checks(&tenant(), &pool(), &windows, W0 + 120_000)
        .await
        .expect("checked");
    assert_eq!(added.violations, 1);
    assert_eq!(added.regions_over_allowance, vec![region("eu")]);
    let summary = ledger.bound_check_summary(10).await.expect("summary");
    let [violation] = summary.recent_violations.as_slice() else {
        panic!("one violation: {summary:?}");
    };
    assert_eq!(violation.fallback_over_allowance, 100);
    assert_eq!(violation.regions_over_allowance, vec!["eu".to_owned()]);
    // A report naming a run but no agent is refused, naming the field, and writes nothing.
    let orphan = Report {
        incarnation: Some(allot_shared::ids::AgentIncarnation::from_parts(W0, 4)),
        ..report("orphan", "eu", W0, vec![], 500)
    };
    match ledger.record_report(&orphan, W0 + 30).await {
        Err(LedgerError::Invalid(error)) => assert_eq!(error.field, "incarnation"),
        other => panic!("refused: {other:?}"),
    }
    assert_eq!(admitted("eu", None).await, 200);
}

#[tokio::test]
async fn sqlite_agents_of_a_region() {
    let (ledger, _dir) = sqlite_ledger().await;
    agents_of_a_region(ledger).await;
}

#[tokio::test]
async fn postgres_agents_of_a_region() {
    let (_database, url) = PostgresDatabase::create().await;
    let ledger = Ledger::connect(&url).await.expect("postgres ledger");
    agents_of_a_region(ledger).await;
}

/// The pool's configuration as its history records a change to it.
async fn record_config(ledger: &Ledger, change_id: &str, at_ms: u64, fallback: u64) {
    let spec = serde_json::json!({ "limit": 1000, "windowMs": WINDOW_MS, "chunk": 100,
        "leaseTtlMs": 15000, "fallbackPerRegion": fallback, "regions": ["eu", "us"] });
    ledger
        .record_pool_change(&PoolChange {
            change_id,
            tenant: &tenant(),
            pool: &pool(),
            version: 1,
            actor: "operator:test",
            changed_at_ms: at_ms,
            config_json: &spec.to_string(),
        })
        .await
        .expect("pool change");
}

/// Each window is judged by the terms in force while it ran: lowering the fallback allowance after
/// a partition (as the runbook says) leaves the partition's windows within their bound, and a
/// window after the change is held to the new terms.
async fn windows_judged_by_their_terms(ledger: Ledger) {
    const DAY_MS: u64 = 86_400_000;
    record_config(&ledger, "c-1", W0 - DAY_MS, 100).await;
    // Both regions cut off in the first window: each admits its allowance of 100.
    for region_name in ["eu", "us"] {
        ledger
            .record_report(
                &fallback_report(&format!("p-{region_name}"), region_name, Some("a"), 100),
                W0 + 30_000,
            )
            .await
            .expect("reported");
    }
    // Ten minutes later the operator sets the allowance to 0.
    let lowered_at_ms = W0 + 10 * WINDOW_MS;
    record_config(&ledger, "c-2", lowered_at_ms, 0).await;
    let today = PoolConfig::new(
        1_000,
        WINDOW_MS,
        100,
        15_000,
        0,
        vec![region("eu"), region("us")],
    )
    .expect("valid");
    // A window well after the change, where us admitted 5 in fallback anyway.
    let after_ms = lowered_at_ms + 2 * WINDOW_MS;
    let late = Report {
        window_start_ms: after_ms,
        ..fallback_report("late-us", "us", Some("a"), 5)
    };
    ledger
        .record_report(&late, after_ms + 1)
        .await
        .expect("reported");
    let windows = ledger
        .windows(&tenant(), &pool(), &today, 10, after_ms + 120_000)
        .await
        .expect("windows");
    let [after, during] = windows.as_slice() else {
        panic!("two windows: {windows:?}");
    };
    assert_eq!(during.window_start_ms, W0);
    assert_eq!(
        (during.fallback_per_region_tokens, during.bound_tokens),
        (100, 1_200),
        "the partition's window is held to the allowance in force while it ran"
    );
    assert!(!during.violates_bound(), "{during:?}");
    assert_eq!(
        (after.fallback_per_region_tokens, after.bound_tokens),
        (0, 1_000)
    );
    assert_eq!(
        after.fallback_over_allowance_tokens_by_region,
        [(region("us"), 5)].into(),
        "after the change, the new allowance"
    );
    let added = ledger
        .record_bound_checks(&tenant(), &pool(), &windows, after_ms + 120_000)
        .await
        .expect("checked");
    assert_eq!((added.windows, added.violations), (2, 1));
}

#[tokio::test]
async fn sqlite_windows_judged_by_their_terms() {
    let (ledger, _dir) = sqlite_ledger().await;
    windows_judged_by_their_terms(ledger).await;
}

#[tokio::test]
async fn postgres_windows_judged_by_their_terms() {
    let (_database, url) = PostgresDatabase::create().await;
    let ledger = Ledger::connect(&url).await.expect("postgres ledger");
    windows_judged_by_their_terms(ledger).await;
}

/// The migrations before fallback was kept per agent.
fn migrator_before_agents() -> sqlx::migrate::Migrator {
    let mut migrator = sqlx::migrate!("../migrations");
    let before: Vec<_> = migrator
        .migrations
        .iter()
        .filter(|migration| migration.version < 10)
        .cloned()
        .collect();
    assert_eq!(before.len(), 9);
    migrator.migrations = std::borrow::Cow::Owned(before);
    migrator
}

/// Rows a ledger held before it kept agents apart, in every per-window table.
const LEGACY_ROWS: &str = "\
INSERT INTO fallback_admits VALUES ('atlas', 'api', 'eu', 1767225600000, 12);
INSERT INTO shadow_admits VALUES ('atlas', 'api', 'eu', 1767225600000, 40);
INSERT INTO settle_debts VALUES ('atlas', 'api', 'us', 1767225600000, 3);
INSERT INTO written_off VALUES ('atlas', 'api', 'us', 1767225600000, 2);
INSERT INTO bound_checks VALUES ('atlas', 'api', 1767225540000, 1767225600000, 1300, 1200, 1767225700000)";

/// Upgrading a ledger carries its rows over: each becomes the unnamed agent's of its region, read
/// as before, and a report naming no agent still raises it.
async fn carried_over(ledger: Ledger) {
    let windows = ledger
        .windows(&tenant(), &pool(), &config(), 10, W0 + 120_000)
        .await
        .expect("windows");
    let window = windows
        .iter()
        .find(|w| w.window_start_ms == W0)
        .expect("the window");
    assert_eq!(
        window.fallback_admitted_tokens_by_region,
        [(region("eu"), 12)].into()
    );
    assert_eq!(window.shadow_admitted_tokens, 40);
    assert_eq!(
        (window.settle_debt_tokens, window.written_off_tokens),
        (3, 2)
    );
    ledger
        .record_report(&report("after", "eu", W0, vec![], 15), W0 + 50_000)
        .await
        .expect("reported");
    assert_eq!(
        ledger
            .fallback_admitted(&tenant(), &pool(), &region("eu"), None, W0)
            .await
            .expect("admitted"),
        15,
        "the same unnamed agent: the larger kept"
    );
    let summary = ledger.bound_check_summary(10).await.expect("summary");
    assert_eq!(summary.violations, 1, "the violation carried over");
    assert_eq!(summary.recent_violations[0].fallback_over_allowance, 0);
}

#[tokio::test]
async fn sqlite_upgrade_carries_rows_over() {
    let dir = tempfile::tempdir().expect("temp dir");
    let path = dir.path().join("ledger.db");
    let url = format!("sqlite://{}", path.display());
    {
        let options = sqlx::sqlite::SqliteConnectOptions::new()
            .filename(&path)
            .create_if_missing(true);
        let pool = sqlx::SqlitePool::connect_with(options)
            .await
            .expect("sqlite");
        migrator_before_agents()
            .run(&pool)
            .await
            .expect("old migrations");
        for statement in LEGACY_ROWS.split(';') {
            sqlx::query(statement)
                .execute(&pool)
                .await
                .expect("legacy row");
        }
        pool.close().await;
    }
    carried_over(Ledger::connect(&url).await.expect("upgraded")).await;
}

#[tokio::test]
async fn postgres_upgrade_carries_rows_over() {
    let (_database, url) = PostgresDatabase::create().await;
    {
        let pool = sqlx::PgPool::connect(&url).await.expect("postgres");
        migrator_before_agents()
            .run(&pool)
            .await
            .expect("old migrations");
        for statement in LEGACY_ROWS.split(';') {
            sqlx::query(statement)
                .execute(&pool)
                .await
                .expect("legacy row");
        }
        pool.close().await;
    }
    carried_over(Ledger::connect(&url).await.expect("upgraded")).await;
}

/// Recent activity: the pools with a grant in a window ending from an instant, or a report
/// received from another, with the latest of each; older rows and other pools are not named.
async fn recent_activity(ledger: Ledger) {
    let quiet = PoolId::parse("quiet").expect("pool");
    let busy = PoolId::parse("busy").expect("pool");
    // `quiet` granted and reported only in an old window; `busy` in two later ones.
    ledger
        .record_grants(&tenant(), &quiet, &[grant(1, "eu", W0, 100, W0 + 15_000)])
        .await
        .expect("grants");
    ledger
        .record_grants(
            &tenant(),
            &busy,
            &[
                grant(2, "eu", W0 + WINDOW_MS, 100, W0 + WINDOW_MS + 15_000),
                grant(
                    3,
                    "eu",
                    W0 + 2 * WINDOW_MS,
                    100,
                    W0 + 2 * WINDOW_MS + 15_000,
                ),
            ],
        )
        .await
        .expect("grants");
    let mut old = report("old", "eu", W0, vec![(1, 10, false)], 0);
    old.pool = quiet.clone();
    ledger
        .record_report(&old, W0 + 1_000)
        .await
        .expect("report");
    let mut fallback_only = report("late", "eu", W0 + 2 * WINDOW_MS, vec![], 5);
    fallback_only.pool = busy.clone();
    ledger
        .record_report(&fallback_only, W0 + 2 * WINDOW_MS + 1_000)
        .await
        .expect("report");

    let from_ms = W0 + 2 * WINDOW_MS;
    let seen = ledger
        .recent_activity(from_ms, from_ms - WINDOW_MS)
        .await
        .expect("activity");
    let busy_key = (tenant(), busy);
    assert_eq!(
        seen.keys().collect::<Vec<_>>(),
        vec![&busy_key],
        "only the pool with recent rows: {seen:?}"
    );
    let busy_seen = seen[&busy_key];
    assert_eq!(
        busy_seen.latest_grant_window_end_ms,
        Some(W0 + 3 * WINDOW_MS)
    );
    assert_eq!(
        busy_seen.latest_report_window_start_ms,
        Some(W0 + 2 * WINDOW_MS)
    );
    assert!(busy_seen.has_window_ending_from(from_ms, WINDOW_MS));
    // From the beginning, both pools; nothing at all from after every row.
    let everything = ledger.recent_activity(0, 0).await.expect("activity");
    assert_eq!(everything.len(), 2, "{everything:?}");
    let nothing = ledger
        .recent_activity(W0 + 10 * WINDOW_MS, W0 + 10 * WINDOW_MS)
        .await
        .expect("activity");
    assert!(nothing.is_empty(), "{nothing:?}");
}

#[tokio::test]
async fn sqlite_recent_activity() {
    let (ledger, _dir) = sqlite_ledger().await;
    recent_activity(ledger).await;
}

#[tokio::test]
async fn postgres_recent_activity() {
    let (_database, url) = PostgresDatabase::create().await;
    let ledger = Ledger::connect(&url).await.expect("postgres ledger");
    recent_activity(ledger).await;
}

/// The leader's ledger round visits only the pools with windows to check or publish: of four
/// pools, the one granted in the current window, not the one idle since long ago, the one whose
/// last window settled minutes ago (it was checked then), nor the one never used; a late report
/// of that settled window has it visited again.
#[tokio::test]
async fn a_ledger_round_visits_only_pools_with_recent_windows() {
    use allot_allocator::clock::{Clock, SystemClock};
    use allot_allocator::kv::memory::MemoryKv;
    use allot_allocator::ledger_sync::{CheckRotation, publish_ledger_gauges};
    use allot_allocator::pools::{PoolSpec, list_pools, put_pools};
    use std::sync::Arc;

    let (ledger, _dir) = sqlite_ledger().await;
    let clock: Arc<dyn Clock> = Arc::new(SystemClock);
    let kv = MemoryKv::new(clock.clone());
    let now_ms = clock.now_ms();
    let spec = PoolSpec {
        limit_tokens: 1_000,
        window_ms: WINDOW_MS,
        window: None,
        chunk_tokens: 100,
        lease_ttl_ms: 15_000,
        fallback_per_region_tokens: 0,
        settle_debt_per_region_tokens: 0,
        regions: vec![region("eu")],
    };
    let [busy, idle, unused] =
        ["busy", "idle", "unused"].map(|name| PoolId::parse(name).expect("pool"));
    let settled = pool();
    let all: Vec<_> = [&busy, &idle, &unused, &settled]
        .into_iter()
        .map(|pool| (tenant(), pool.clone(), spec.clone()))
        .collect();
    put_pools(&kv, &all, now_ms).await.expect("pools");
    let window_start_ms = now_ms - now_ms % WINDOW_MS;
    ledger
        .record_grants(
            &tenant(),
            &busy,
            &[grant(1, "eu", window_start_ms, 100, now_ms)],
        )
        .await
        .expect("grants");
    let a_day_ago_ms = window_start_ms - 86_400_000;
    ledger
        .record_grants(
            &tenant(),
            &idle,
            &[grant(2, "eu", a_day_ago_ms, 100, a_day_ago_ms)],
        )
        .await
        .expect("grants");
    // The settled pool's last window ended three minutes ago, within the ten-minute re-check.
    let settled_window_ms = window_start_ms - 4 * WINDOW_MS;
    ledger
        .record_grants(
            &tenant(),
            &settled,
            &[grant(3, "eu", settled_window_ms, 100, settled_window_ms)],
        )
        .await
        .expect("grants");
    let pools = list_pools(&kv).await.expect("listing");
    assert_eq!(pools.len(), 4);
    let visited =
        publish_ledger_gauges(&ledger, &kv, &pools, &mut CheckRotation::default(), now_ms)
            .await
            .expect("round");
    assert_eq!(visited, 1, "only the pool granted lately");
    // A late report of the settled window: its pool is visited, its windows checked again.
    ledger
        .record_report(
            &report("late", "eu", settled_window_ms, vec![(3, 60, true)], 0),
            now_ms,
        )
        .await
        .expect("report");
    let visited =
        publish_ledger_gauges(&ledger, &kv, &pools, &mut CheckRotation::default(), now_ms)
            .await
            .expect("round");
    assert_eq!(
        visited, 2,
        "the pool a report arrived for, and the busy one"
    );
    // A day on, nothing is left to check: the round visits nothing.
    let visited = publish_ledger_gauges(
        &ledger,
        &kv,
        &pools,
        &mut CheckRotation::default(),
        now_ms + 86_400_000,
    )
    .await
    .expect("round");
    assert_eq!(visited, 0, "an idle system costs a round nothing");
}
