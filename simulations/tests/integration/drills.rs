//! The built-in drills on the shipped allocator and agent logic: each meets its expected outcome, the
//! numbers are the ones the design predicts, and a run is reproducible.

use allot_simulations::drill::{DrillReport, RegionWindow, Scenario, builtin, run};

fn scenario(name: &str) -> Scenario {
    builtin()
        .into_iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no drill {name}"))
}

fn drill(name: &str) -> DrillReport {
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let report = runtime.block_on(run(&scenario(name))).expect("drill runs");
    assert!(report.passed(), "{}", report.table());
    report
}

#[test]
fn clamped_leases_never_admit_beyond_g_and_a_saturated_pool_is_nearly_used_up() {
    let report = drill("clamped");
    let s = &report.scenario;
    assert_eq!(report.windows.len(), 3);
    for w in &report.windows {
        let admitted: u64 = w.regions.iter().map(|r| r.admitted()).sum();
        let granted: u64 = w.regions.iter().map(|r| r.granted_tokens).sum();
        let stranded: u64 = w.regions.iter().map(|r| r.stranded_tokens).sum();
        let returned: u64 = w.regions.iter().map(|r| r.returned_tokens).sum();
        // Demand is 1.5 x G: the pool runs out, so at most the stranded remainder is unused
        // (what leases left unspent counts as stranded, and, once taken back, again as granted).
        assert!(admitted <= s.limit_tokens, "{}", report.table());
        assert!(granted - returned <= s.limit_tokens, "{}", report.table());
        assert_eq!(admitted + stranded, granted, "{}", report.table());
        assert!(
            admitted + s.chunk_tokens * 2 >= s.limit_tokens,
            "{}",
            report.table()
        );
        assert!(
            w.regions
                .iter()
                .all(|r| r.fallback == 0 && r.carried_over == 0)
        );
        // The skew shows: EU (1200/min) gets most of the pool, US (300/min) most of its demand.
        assert!(w.regions[0].admitted() > 3 * w.regions[1].admitted());
    }
}

#[test]
fn a_partitioned_region_admits_exactly_its_fallback_allowance_and_the_window_stays_within_the_bound()
 {
    let report = drill("fallback");
    let s = &report.scenario;
    // EU is cut off for the whole of the 60 s window: demand 1200, admitted exactly the allowance.
    let cut = &report.windows[1];
    assert_eq!(cut.regions[0].fallback, s.fallback_per_region_tokens);
    assert_eq!(cut.regions[0].leased, 0);
    assert_eq!(cut.regions[0].granted_tokens, 0);
    assert_eq!(
        cut.regions[0].denied_fallback_spent,
        cut.regions[0].demand - s.fallback_per_region_tokens
    );
    // The window where EU comes back: fallback and leases together exceed G, by no more than the
    // fallback term.
    let healed = &report.windows[2];
    let admitted: u64 = healed.regions.iter().map(|r| r.admitted()).sum();
    assert!(admitted > s.limit_tokens, "{}", report.table());
    assert!(
        admitted <= s.limit_tokens + s.fallback_per_region_tokens * 2,
        "{}",
        report.table()
    );
    assert!(report.bound.holds(admitted));
}

#[test]
fn unclamped_leases_carry_tokens_into_the_next_window_within_the_carry_over_term() {
    let report = drill("unclamped");
    assert_eq!(
        report.windows[0]
            .regions
            .iter()
            .map(|r| r.carried_over)
            .sum::<u64>(),
        0
    );
    let carried: u64 = report.windows[1..]
        .iter()
        .flat_map(|w| &w.regions)
        .map(|r| r.carried_over)
        .sum();
    assert!(carried > 0, "{}", report.table());
    assert!(report.bound.unclamped_carry_over_tokens > 0);
    for w in &report.windows {
        let carried: u64 = w.regions.iter().map(|r| r.carried_over).sum();
        assert!(carried <= report.bound.unclamped_carry_over_tokens);
    }
}

#[test]
fn the_same_drill_gives_the_same_report() {
    for s in builtin() {
        let first = drill(&s.name);
        let second = drill(&s.name);
        assert_eq!(first, second);
        assert_eq!(first.table(), second.table());
    }
}

#[test]
fn allot_drill_runs_the_suite_and_names_unknown_drills_in_one_line() {
    let allot = env!("CARGO_BIN_EXE_allot");
    let suite = std::process::Command::new(allot)
        .arg("drill")
        .output()
        .expect("allot runs");
    let stdout = String::from_utf8_lossy(&suite.stdout);
    assert!(suite.status.success(), "{stdout}");
    assert_eq!(
        stdout.matches("  PASS").count(),
        builtin().len(),
        "{stdout}"
    );
    let unknown = std::process::Command::new(allot)
        .args(["drill", "nope"])
        .output()
        .expect("allot runs");
    assert_eq!(unknown.status.code(), Some(2));
    let stderr = String::from_utf8_lossy(&unknown.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.contains("no drill named \"nope\""), "{stderr}");
}

#[test]
fn a_failover_on_etcd_semantics_changes_nothing_and_fences_the_deposed_leader() {
    // The run fails (an Err, not a report) if the deposed allocator's grant is accepted.
    let failover = drill("failover-etcd");
    let steady = drill("clamped");
    assert_eq!(failover.windows, steady.windows, "{}", failover.table());
    assert!(
        failover
            .windows
            .iter()
            .all(|w| w.lost_grant_record_tokens == 0)
    );
}

#[test]
fn shards_moving_between_allocators_change_nothing_and_fence_the_old_leader() {
    // The run fails (an Err, not a report) if an allocator that lost a shard still grants for
    // it, or if a pool's call reaches an allocator that does not lead its shard.
    let moved = drill("shard-move");
    let mut unsplit = scenario("shard-move");
    unsplit.shards = 1;
    unsplit
        .faults
        .retain(|fault| !matches!(fault, allot_simulations::drill::Fault::ShardMove { .. }));
    assert!(moved.scenario.faults.len() > unsplit.faults.len());
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime");
    let steady = runtime.block_on(run(&unsplit)).expect("drill runs");
    assert_eq!(moved.windows, steady.windows, "{}", moved.table());
}

#[test]
fn a_failover_that_loses_grant_records_overshoots_by_at_most_what_was_lost() {
    let report = drill("failover-lost");
    let s = &report.scenario;
    let first = &report.windows[0];
    let admitted: u64 = first.regions.iter().map(|r| r.admitted()).sum();
    let lost = first.lost_grant_record_tokens;
    // At 30 s the old leader had granted about half the pool; the new one grants G again.
    assert!((300..=s.limit_tokens).contains(&lost), "lost {lost}");
    assert!(admitted > s.limit_tokens, "{}", report.table());
    assert!(admitted <= s.limit_tokens + lost, "{}", report.table());
    // The next windows are back to normal.
    for w in &report.windows[1..] {
        assert_eq!(w.lost_grant_record_tokens, 0);
        assert!(w.regions.iter().map(|r| r.admitted()).sum::<u64>() <= s.limit_tokens);
    }
}

fn admitted(report: &DrillReport, window: usize, region: usize) -> u64 {
    report.windows[window].regions[region].admitted()
}

#[test]
fn independent_regional_limits_admit_up_to_regions_times_g() {
    let report = drill("independent");
    let s = &report.scenario;
    for (w, window) in report.windows.iter().enumerate() {
        // EU's demand (1200) exceeds its own G, so it admits exactly G; US's (300) fits in its own.
        assert_eq!(admitted(&report, w, 0), s.limit_tokens);
        let total: u64 = window.regions.iter().map(|r| r.admitted()).sum();
        assert!(
            total > s.limit_tokens && total <= 2 * s.limit_tokens,
            "{}",
            report.table()
        );
    }
}

#[test]
fn an_override_raises_then_lowers_the_windows_it_is_in_force_in() {
    let report = drill("override");
    let limits: Vec<u64> = report.windows.iter().map(|w| w.limit_tokens).collect();
    let admitted: Vec<u64> = report
        .windows
        .iter()
        .map(|w| w.sum(RegionWindow::admitted))
        .collect();
    // Raised for 70-220 s, lowered for 240-365 s (ended by hand), windows of 60 s from 0.
    assert_eq!(
        limits,
        [1_000, 1_500, 1_500, 1_500, 500, 500, 1_000],
        "{}",
        report.table()
    );
    assert_eq!(
        admitted[1],
        1_500,
        "the raise is granted: {}",
        report.table()
    );
    assert!(
        admitted[4] <= 500 && admitted[5] <= 500,
        "the lowering holds: {}",
        report.table()
    );
    for (w, window) in report.windows.iter().enumerate() {
        assert!(admitted[w] <= report.window_bound(window));
    }
}

#[test]
fn a_static_split_denies_the_busy_region_while_the_quiet_region_holds_the_rest() {
    let split = drill("static-split");
    let weighted = drill("demand-weighted");
    for w in 0..split.windows.len() {
        let eu = &split.windows[w].regions[0];
        // EU gets exactly its half; every one of its other requests is denied with quota to spare.
        assert_eq!(eu.admitted(), 500);
        assert_eq!(eu.denied_while_tokens_left, eu.demand - 500);
        // One shared pool leased on demand serves EU far better, with no such denial anywhere.
        assert!(
            admitted(&weighted, w, 0) >= 500 + 300,
            "{}",
            weighted.table()
        );
        assert!(
            weighted.windows[w]
                .regions
                .iter()
                .all(|r| r.denied_while_tokens_left == 0)
        );
        let total: u64 = weighted.windows[w]
            .regions
            .iter()
            .map(|r| r.admitted())
            .sum();
        assert!(total <= weighted.scenario.limit_tokens);
    }
}

#[test]
fn allot_drill_json_carries_every_window_and_the_bound_terms() {
    let output = std::process::Command::new(env!("CARGO_BIN_EXE_allot"))
        .args(["drill", "--json", "fallback"])
        .output()
        .expect("allot runs");
    assert!(output.status.success());
    let reports: serde_json::Value = serde_json::from_slice(&output.stdout).expect("JSON");
    let report = &reports[0];
    assert_eq!(report["name"], "fallback");
    assert_eq!(report["passed"], true);
    assert_eq!(report["bound"]["totalTokens"], 1_200);
    let expected = drill("fallback");
    let windows = report["windows"].as_array().expect("windows");
    assert_eq!(windows.len(), expected.windows.len());
    assert_eq!(windows[1]["regions"][0]["region"], "eu");
    assert_eq!(windows[1]["regions"][0]["fallback"], 100);
    assert_eq!(
        windows[2]["admitted"],
        expected.windows[2]
            .regions
            .iter()
            .map(|r| r.admitted())
            .sum::<u64>()
    );
}

fn admitted_per_window(report: &DrillReport, region: Option<usize>) -> Vec<u64> {
    report
        .windows
        .iter()
        .map(|w| match region {
            Some(index) => w.regions[index].admitted(),
            None => w.regions.iter().map(|r| r.admitted()).sum(),
        })
        .collect()
}

/// The figures docs/drills.md quotes are the ones the drills produce.
#[test]
fn the_figures_in_the_drill_docs_are_what_the_drills_produce() {
    assert_eq!(
        admitted_per_window(&drill("clamped"), None),
        [1_000, 1_000, 999]
    );
    let fallback = drill("fallback");
    assert_eq!(admitted_per_window(&fallback, None)[2], 1_097);
    assert_eq!(fallback.windows[1].regions[1].stranded_tokens, 14);
    let lost = drill("failover-lost");
    assert_eq!(lost.windows[0].lost_grant_record_tokens, 868);
    assert_eq!(admitted_per_window(&lost, None)[0], 1_500);
    assert_eq!(
        admitted_per_window(&drill("independent"), None),
        [1_300, 1_300, 1_300]
    );
    assert_eq!(
        admitted_per_window(&drill("demand-weighted"), Some(0)),
        [895, 898, 898]
    );
    let restart = drill("agent-restart");
    // 900/min for the 5 s the agent is down: 75 requests not served.
    assert_eq!(restart.windows[1].regions[0].denied_unavailable, 75);
    assert_eq!(restart.windows[1].regions[0].unreported_tokens, 14);
    // Fallback, heal, restart, fallback again in the same window: one allowance, not two.
    let again = drill("agent-restart-fallback");
    assert_eq!(again.windows[1].regions[0].fallback, 100);
    // A crash inside the partition: its fallback admits never reached the ledger, and the new run
    // counts the window's allowance as used; still one allowance.
    let crashed = drill("agent-crash-in-partition");
    assert_eq!(crashed.windows[1].regions[0].fallback, 100);
    assert_eq!(crashed.windows[1].regions[0].unreported_tokens, 178);
    assert_eq!(admitted_per_window(&drill("rlqs"), None), [990, 981, 981]);
    assert_eq!(
        admitted_per_window(&drill("rlqs-partition"), None)[2],
        1_084
    );
}

/// A blackholed allocator (calls that hang, neither answered nor refused): a renewal unanswered
/// for the agent's patience (200 ms) counts as unreachable, so the region falls back instead of
/// waiting, no decision waits longer, and fallback stays within the allowance per window.
#[test]
fn a_hung_allocator_starts_fallback_within_the_patience_and_no_admit_waits_longer() {
    let report = drill("blackhole");
    let s = &report.scenario;
    let patience_ms =
        u64::try_from(allot_region_agent::service::FIRST_GRANT_WAIT.as_millis()).expect("ms");
    for window in &report.windows {
        for region in &window.regions {
            assert!(region.max_wait_ms <= patience_ms, "{}", report.table());
            assert!(region.fallback <= s.fallback_per_region_tokens);
        }
        assert!(report.bound.holds(window.sum(|r| r.admitted())));
    }
    // The hang spans the end of window 0 and the start of window 1: EU used its allowance in both,
    // instead of denying everything it could not lease.
    assert_eq!(
        report.windows[0].regions[0].fallback,
        s.fallback_per_region_tokens
    );
    assert_eq!(
        report.windows[1].regions[0].fallback,
        s.fallback_per_region_tokens
    );
    // After the hang, leasing again: no fallback in the last window.
    assert_eq!(
        report.windows[2].regions[0].fallback,
        0,
        "{}",
        report.table()
    );
    assert!(report.windows[2].regions[0].leased > 0);
    // Slow answers (400 ms) are a milder case of the same: fallback after 200 ms, no longer wait.
    let latency = drill("latency");
    assert!(latency.windows[1].regions[0].fallback > 0);
    assert!(
        latency
            .windows
            .iter()
            .all(|w| w.regions.iter().all(|r| r.max_wait_ms <= patience_ms))
    );
}

/// Gateways deciding locally behind the rate limit quota service: no window admits beyond G, the
/// saturated pool is nearly used up (what the gateways are not handed is stranded, a few percent),
/// the busy region gets most of it, and the gateways deny the rest themselves.
#[test]
fn gateways_deciding_locally_stay_within_g_and_use_most_of_the_pool() {
    let report = drill("rlqs");
    let s = &report.scenario;
    assert_eq!(report.windows.len(), 3);
    for w in &report.windows {
        let admitted: u64 = w.regions.iter().map(|r| r.admitted()).sum();
        let stranded: u64 = w.regions.iter().map(|r| r.stranded_tokens).sum();
        assert!(admitted <= s.limit_tokens, "{}", report.table());
        assert!(admitted * 10 >= s.limit_tokens * 9, "{}", report.table());
        assert!(stranded * 10 <= s.limit_tokens, "{}", report.table());
        assert!(w.regions.iter().all(|r| r.fallback == 0));
        assert!(w.regions[0].admitted() > 3 * w.regions[1].admitted());
        assert!(
            w.regions.iter().all(|r| r.denied_by_gateway > 0),
            "demand beyond G is denied by the gateways: {}",
            report.table()
        );
    }
}

/// Cut off, a region's gateways get assignments from its fallback allowance only: exactly the
/// allowance in the window it is cut off for, and the healing window stays within the bound.
#[test]
fn gateways_of_a_partitioned_region_admit_their_allowance_and_no_more() {
    let report = drill("rlqs-partition");
    let s = &report.scenario;
    let cut = &report.windows[1];
    // All of the allowance but, at most, a last token: one request cannot be written as an
    // assignment Envoy enforces (whole seconds), so it is denied rather than handed out.
    let fallback = cut.regions[0].fallback;
    assert!(
        (s.fallback_per_region_tokens - 1..=s.fallback_per_region_tokens).contains(&fallback),
        "{fallback} of {}: {}",
        s.fallback_per_region_tokens,
        report.table()
    );
    assert_eq!(cut.regions[0].leased, 0);
    let healed = &report.windows[2];
    let admitted: u64 = healed.regions.iter().map(|r| r.admitted()).sum();
    assert!(report.bound.holds(admitted), "{}", report.table());
    assert!(healed.regions[0].leased > 0, "leases again after the heal");
}

/// While their agent is down, gateways keep enforcing what they hold (nothing is refused for the
/// agent's absence), and the restarted agent hands out fresh assignments.
#[test]
fn gateways_keep_deciding_while_their_agent_restarts() {
    let report = drill("rlqs-agent-restart");
    let restart = &report.windows[1].regions[0];
    assert_eq!(restart.denied_unavailable, 0, "{}", report.table());
    assert!(
        restart.leased * 10 >= restart.demand * 8,
        "{}",
        report.table()
    );
    assert!(report.windows[2].regions[0].leased > 0);
}

/// Daily quotas in Berlin time across the 23-hour day of the spring switch: the day that began at
/// 23:00 UTC ends 23 hours later, at 22:00 UTC, and the next day is a window of its own with its
/// own allowance; EU's fallback across that midnight stays within each day's allowance.
#[test]
fn calendar_days_end_at_local_midnight_across_a_daylight_saving_switch() {
    let report = drill("calendar-dst");
    let offsets: Vec<u64> = report.windows.iter().map(|w| w.offset_ms).collect();
    assert_eq!(offsets, [0, 23 * 3_600_000], "{}", report.table());
    let s = &report.scenario;
    for w in &report.windows {
        let admitted: u64 = w.regions.iter().map(|r| r.admitted()).sum();
        assert!(
            admitted <= s.limit_tokens + 2 * s.fallback_per_region_tokens,
            "{}",
            report.table()
        );
        assert!(
            w.regions[0].fallback > 0,
            "EU fell back on both sides of midnight: {}",
            report.table()
        );
        assert!(w.regions[0].fallback <= s.fallback_per_region_tokens);
    }
}

/// Every file of `simulations/scenarios/` is a built-in drill of its file's name, and every
/// built-in drill is such a file: a new file is a new drill, never silently left out.
#[test]
fn every_scenario_file_is_a_built_in_drill_of_its_name() {
    let dir = concat!(env!("CARGO_MANIFEST_DIR"), "/scenarios");
    let mut files: Vec<String> = std::fs::read_dir(dir)
        .expect("the scenarios")
        .map(|entry| entry.expect("an entry").path())
        .filter(|path| path.is_file() && path.extension().is_some_and(|ext| ext == "toml"))
        .map(|path| {
            path.file_stem()
                .and_then(|stem| stem.to_str())
                .expect("a name")
                .to_owned()
        })
        .collect();
    files.sort();
    assert!(files.len() >= 21, "{files:?}");
    let listed: Vec<&str> = allot_simulations::drill::scenario::BUILTIN
        .iter()
        .map(|(name, _)| *name)
        .collect();
    assert_eq!(listed, files);
    let parsed: Vec<String> = builtin().into_iter().map(|s| s.name).collect();
    assert_eq!(
        parsed, files,
        "each parses, and names itself as its file does"
    );
}

fn run_scenario(scenario: &Scenario) -> DrillReport {
    tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(run(scenario))
        .expect("drill runs")
}

/// Several agents in a region, each with its share of the region's fallback allowance as the
/// shipped agent takes it: cut off, the region's agents together admit exactly the allowance, not
/// an agent's share and not more.
#[test]
fn a_regions_agents_together_admit_its_fallback_allowance_and_no_more() {
    let report = drill("agents-per-region");
    let s = &report.scenario;
    // The whole middle window is cut off: EU's two agents and US's three each spend their share.
    let cut = &report.windows[1];
    for region in &cut.regions {
        assert_eq!(
            region.fallback,
            s.fallback_per_region_tokens,
            "{}",
            report.table()
        );
        assert_eq!(region.leased, 0);
    }
    // Told each region runs one agent, every agent takes the whole allowance: the region admits
    // its agent count times it, and the check says so.
    let mut misconfigured = scenario("agents-per-region");
    for plan in &mut misconfigured.regions {
        plan.region_agents_setting = Some(1);
    }
    let broken = run_scenario(&misconfigured);
    assert!(!broken.passed());
    let cut = &broken.windows[1];
    assert_eq!(cut.regions[0].fallback, 2 * s.fallback_per_region_tokens);
    assert_eq!(cut.regions[1].fallback, 3 * s.fallback_per_region_tokens);
    assert!(
        broken
            .violations
            .iter()
            .any(|v| v.contains("region eu admitted 180 in fallback > allowance 90")),
        "{:?}",
        broken.violations
    );
    // One agent of three restarted inside the partition: it counts its share as used (no state
    // directory, an unclean end), and the region stays within its allowance.
    let mut restarted = scenario("agents-per-region");
    restarted.faults.push(toml_fault(
        "kind = \"agent_restart\"\nregion = \"us\"\nat_ms = 100000\ndown_ms = 2000\nagent = 1",
    ));
    let report = run_scenario(&restarted);
    assert!(report.passed(), "{}", report.table());
    assert!(report.windows[1].regions[1].fallback <= s.fallback_per_region_tokens);
    assert!(
        report.windows[1].regions[1].denied_unavailable > 0,
        "{}",
        report.table()
    );
}

fn toml_fault(text: &str) -> allot_simulations::drill::Fault {
    toml::from_str(text).expect("fault")
}

/// Requests as gateways send them: a regional rule denies some after their global reservation,
/// and the agent cancels it; some are metered and settled above their estimate. No denial debits
/// the pool, what metered requests cost beyond their estimates counts against the bound (its
/// settle-debt term), and what a cut-off region could not pay or owe is written off, counted.
#[test]
fn regional_denials_debit_nothing_and_metered_costs_count_against_the_bound() {
    let report = drill("regional-denials-metered");
    let s = &report.scenario;
    let mut denied = 0;
    for window in &report.windows {
        let eu = &window.regions[0];
        denied += eu.denied_regional;
        assert_eq!(eu.denials_that_debited, 0, "{}", report.table());
        let consumed: u64 = window.regions.iter().map(|r| r.consumed()).sum();
        assert!(report.bound.holds(consumed), "{}", report.table());
        assert!(window.regions[1].charged_extra_tokens > 0);
    }
    assert!(denied > 100, "{}", report.table());
    assert_eq!(
        report.bound.settle_debt_tokens,
        2 * s.settle_debt_per_region_tokens
    );
    // Cut off, EU's leases cannot pay what its metered requests cost beyond their estimates:
    // owed up to its share of the debt, the rest written off.
    assert!(
        report.windows[1].regions[0].written_off_tokens > 0,
        "{}",
        report.table()
    );
    // Every window that charged extra: admitted requests alone stay within G, their extra cost
    // within the settle-debt term above it.
    for window in &report.windows {
        let admitted: u64 = window.regions.iter().map(|r| r.admitted()).sum();
        assert!(admitted <= s.limit_tokens + report.bound.fallback_allowance_tokens);
    }
}
