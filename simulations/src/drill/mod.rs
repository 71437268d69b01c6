//! Deterministic partition drills: the shipped allocator grant service and the shipped agent lease
//! logic driven in virtual time under the faults a scenario declares, checked against the stated
//! bound (`admitted <= G + carry-over + fallback allowances + lost records`) and the invariants.
//!
//! Why: "what does a partition cost us?" needs a number and its proof. Scenarios are TOML
//! ([`scenario`]); the engine ([`engine`]) runs the real crates through their seams; [`check`]
//! holds the history to the bound; [`report`] prints a table, JSON or an HTML page with plots.

pub mod check;
pub mod engine;
pub mod report;
pub mod scenario;

use std::path::PathBuf;

pub use engine::{Convergence, DrillReport, RegionWindow, WindowRecord, run, run_with};
pub use scenario::{Burst, Expectation, Fault, PoolLayout, RegionPlan, Scenario, builtin};

/// What `allot drill` was asked to do.
#[derive(Debug, Clone, Default)]
pub struct DrillOptions {
    /// Built-in drills by name (none and no files: the whole built-in suite).
    pub names: Vec<String>,
    /// Scenario files to run.
    pub files: Vec<PathBuf>,
    /// Print JSON instead of tables.
    pub json: bool,
    /// Write an HTML report with plots here.
    pub report: Option<PathBuf>,
    /// Run with this seed instead of the scenario's.
    pub seed: Option<u64>,
    /// Run every drill with seeds 0 to N-1, and shrink the first failure to its shortest run.
    pub seeds: Option<u64>,
    /// Run for this long instead of the scenario's duration, ms.
    pub duration_ms: Option<u64>,
}

/// Most seeds one `--seeds` search runs per drill (I10).
pub const MAX_SEEDS: u64 = 10_000;

/// The scenarios `options` names: built-in ones, then files; each with how to name it on the
/// command line (its name, or `--file <path>`).
pub fn chosen(options: &DrillOptions) -> Result<Vec<(Scenario, String)>, String> {
    let all = builtin();
    let mut chosen = Vec::new();
    if options.names.is_empty() && options.files.is_empty() {
        chosen = all.iter().map(|s| (s.clone(), s.name.clone())).collect();
    }
    for name in &options.names {
        let scenario = all.iter().find(|s| &s.name == name).ok_or_else(|| {
            let known: Vec<&str> = all.iter().map(|s| s.name.as_str()).collect();
            format!("no drill named {name:?} (known: {})", known.join(", "))
        })?;
        chosen.push((scenario.clone(), name.clone()));
    }
    for file in &options.files {
        let text =
            std::fs::read_to_string(file).map_err(|e| format!("--file {}: {e}", file.display()))?;
        let scenario =
            Scenario::from_toml(&text).map_err(|e| format!("--file {}: {e}", file.display()))?;
        chosen.push((scenario, format!("--file {}", file.display())));
    }
    Ok(chosen)
}

/// The shortest failing run of `scenario` among `seeds`: the smallest failing seed, then the fewest
/// whole windows that still fail with it. `None` when every seed passes.
pub async fn shortest_failure(
    scenario: &Scenario,
    seeds: u64,
) -> Result<Option<DrillReport>, String> {
    for seed in 0..seeds.min(MAX_SEEDS) {
        let report = run_with(scenario, seed, scenario.duration_ms).await?;
        if report.passed() {
            continue;
        }
        let shortest = shortest_for_seed(scenario, seed, scenario.duration_ms).await?;
        return Ok(Some(run_with(scenario, seed, shortest).await?));
    }
    Ok(None)
}

/// The fewest whole windows (as a duration, ms) of `scenario` with `seed` that still fail, up to
/// `duration_ms`.
pub async fn shortest_for_seed(
    scenario: &Scenario,
    seed: u64,
    duration_ms: u64,
) -> Result<u64, String> {
    let windows = duration_ms.div_ceil(scenario.window_ms);
    for count in 1..windows {
        let shorter = count * scenario.window_ms;
        if !run_with(scenario, seed, shorter).await?.passed() {
            return Ok(shorter);
        }
    }
    Ok(duration_ms)
}

/// Runs the chosen drills on a single-threaded runtime: the table (or, with `json`, a JSON array)
/// for each, the simulated-to-wall-clock speed, and an error naming the failed ones.
pub fn run_blocking(options: &DrillOptions) -> Result<String, String> {
    let chosen = chosen(options)?;
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a runtime: {e}"))?;
    let mut out = String::new();
    let mut failed = Vec::new();
    let mut reports = Vec::new();
    for (scenario, invocation) in &chosen {
        let stopwatch = allot_allocator::clock::Stopwatch::start();
        let report = if let Some(seeds) = options.seeds {
            match runtime.block_on(shortest_failure(scenario, seeds))? {
                Some(failure) => {
                    out.push_str(&format!(
                        "drill {} fails; shortest reproduction: allot drill {invocation} --seed {} --duration-ms {}\n",
                        scenario.name, failure.seed, failure.scenario.duration_ms
                    ));
                    failure
                }
                None => {
                    out.push_str(&format!(
                        "drill {}: seeds 0 to {} all pass\n",
                        scenario.name,
                        seeds.min(MAX_SEEDS).saturating_sub(1)
                    ));
                    runtime.block_on(run(scenario))?
                }
            }
        } else {
            let seed = options.seed.unwrap_or(scenario.seed);
            let duration_ms = options.duration_ms.unwrap_or(scenario.duration_ms);
            let report = runtime.block_on(run_with(scenario, seed, duration_ms))?;
            if !report.passed() {
                let shortest = runtime.block_on(shortest_for_seed(scenario, seed, duration_ms))?;
                out.push_str(&format!(
                    "drill {} fails; shortest reproduction: allot drill {invocation} --seed {seed} --duration-ms {shortest}\n",
                    scenario.name
                ));
            }
            report
        };
        let wall_s = stopwatch.elapsed_seconds();
        if !options.json {
            out.push_str(&report.table());
            let simulated_s = report.scenario.duration_ms as f64 / 1_000.0;
            out.push_str(&format!(
                "  simulated {simulated_s:.0} s in {wall_s:.2} s of wall clock ({:.0}x)\n\n",
                simulated_s / wall_s.max(1e-9)
            ));
        }
        if !report.passed() {
            failed.push(scenario.name.clone());
        }
        reports.push(report);
    }
    if options.json {
        let values: Vec<serde_json::Value> = reports.iter().map(DrillReport::json).collect();
        out = serde_json::to_string_pretty(&values).map_err(|e| e.to_string())?;
        out.push('\n');
    }
    if let Some(path) = &options.report {
        let page = report::html(&reports)?;
        std::fs::write(path, page).map_err(|e| format!("--report {}: {e}", path.display()))?;
        if !options.json {
            out.push_str(&format!("report written to {}\n", path.display()));
        }
    }
    if failed.is_empty() {
        Ok(out)
    } else {
        Err(format!("{out}drills failed: {}", failed.join(", ")))
    }
}
