//! Deterministic partition drills: the shipped allocator grant service and the shipped agent lease
//! logic driven in virtual time under the faults a scenario declares, checked against the stated
//! bound (`admitted <= G + carry-over + fallback allowances + lost records`) and the invariants.
//!
//! Why: "what does a partition cost us?" needs a number and its proof. Scenarios are TOML
//! ([`scenario`]); the engine ([`engine`]) runs the real crates through their seams; [`check`]
//! holds the history to the bound; [`report`] prints a table, JSON or an HTML page with plots.

pub mod check;
pub mod engine;
mod gateways;
pub mod report;
pub mod results;
pub mod scenario;
pub mod vary;

use std::path::PathBuf;

pub use engine::{DrillError, run, run_with};
pub use results::{Convergence, DrillReport, RegionWindow, WindowRecord};
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
    /// Run every drill with each of these seeds, and shrink each failing seed to its shortest run.
    pub seeds: Option<SeedRange>,
    /// Run for this long instead of the scenario's duration, ms.
    pub duration_ms: Option<u64>,
    /// Run the one chosen drill with each value of a design parameter ([`vary`]).
    pub vary: Option<vary::Vary>,
    /// With `vary`: write the sweep's SVG here.
    pub plot: Option<PathBuf>,
}

/// Seeds a `--vary` sweep runs per value unless `--seeds` says otherwise.
pub const VARY_SEEDS: u64 = 10;

/// Most seeds one `--seeds` sweep runs per drill (I10).
pub const MAX_SEEDS: u64 = 10_000;
/// Most failing seeds a sweep shrinks and lists per drill (the rest are counted) (I10).
pub const MAX_LISTED_FAILURES: usize = 20;

/// The seeds of a `--seeds` sweep: `N` (0 to N-1) or `A..B` (A to B, both included).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SeedRange {
    /// The first seed.
    pub first: u64,
    /// The last seed (included).
    pub last: u64,
}

impl SeedRange {
    /// Seeds 0 to `count - 1`.
    pub fn first_n(count: u64) -> Result<Self, String> {
        Self::new(
            0,
            count.checked_sub(1).ok_or("--seeds: 0 seeds is no sweep")?,
        )
    }

    /// Seeds `first` to `last`, both included, at most [`MAX_SEEDS`].
    pub fn new(first: u64, last: u64) -> Result<Self, String> {
        if last < first {
            return Err(format!(
                "--seeds: {first}..{last} is empty (the last seed comes first)"
            ));
        }
        if last - first >= MAX_SEEDS {
            return Err(format!("--seeds: at most {MAX_SEEDS} seeds per sweep"));
        }
        Ok(Self { first, last })
    }

    /// The seeds, in order.
    pub fn seeds(self) -> std::ops::RangeInclusive<u64> {
        self.first..=self.last
    }
}

impl std::str::FromStr for SeedRange {
    type Err = String;

    fn from_str(text: &str) -> Result<Self, String> {
        let number = |s: &str| {
            s.trim()
                .parse::<u64>()
                .map_err(|_| format!("--seeds: {s:?} is not a seed (a whole number)"))
        };
        match text.split_once("..") {
            None => Self::first_n(number(text)?),
            Some((first, last)) => Self::new(
                number(first)?,
                number(last.strip_prefix('=').unwrap_or(last))?,
            ),
        }
    }
}

impl std::fmt::Display for SeedRange {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}..{}", self.first, self.last)
    }
}

/// What a sweep of one drill over a [`SeedRange`] found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Sweep {
    /// The shortest failing run of each failing seed, smallest seed first (at most
    /// [`MAX_LISTED_FAILURES`]).
    pub failures: Vec<DrillReport>,
    /// Failing seeds beyond those listed.
    pub failures_not_listed: u64,
    /// Seeds run.
    pub seeds_run: u64,
}

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

/// Runs `scenario` with every seed of `seeds`, and shrinks each failing seed to its shortest
/// failing run.
pub async fn sweep(scenario: &Scenario, seeds: SeedRange) -> Result<Sweep, String> {
    let mut found = Sweep {
        failures: Vec::new(),
        failures_not_listed: 0,
        seeds_run: 0,
    };
    for seed in seeds.seeds() {
        found.seeds_run += 1;
        if run_with(scenario, seed, scenario.duration_ms)
            .await?
            .passed()
        {
            continue;
        }
        if found.failures.len() >= MAX_LISTED_FAILURES {
            found.failures_not_listed += 1;
            continue;
        }
        let shortest = shortest_for_seed(scenario, seed, scenario.duration_ms).await?;
        found
            .failures
            .push(run_with(scenario, seed, shortest).await?);
    }
    Ok(found)
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

/// What `allot drill` prints, and which drills failed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct DrillOutcome {
    /// The tables (or, with `json`, the JSON array of reports) for standard output.
    pub output: String,
    /// The drills that missed their expectation or broke an invariant (empty: all passed).
    pub failed: Vec<String>,
}

/// Runs the chosen drills on a single-threaded runtime: the table (or, with `json`, a JSON array)
/// for each, the simulated-to-wall-clock speed, and the failed ones. With `seeds`, every seed of
/// the range runs and each failing one is listed with its shortest reproduction; the report shown
/// is the first failure's (or the scenario's own seed when all pass). An error is returned only
/// when the drills could not run at all.
///
/// Long by design: each way a drill runs (a seed sweep, or one seed with its shortest reproduction)
/// picks the report to show and writes its lines into the one output, whose form (tables, JSON
/// only, an HTML file) is then settled once for every drill; split, the output, the failed names
/// and the reports would be threaded through each piece.
pub fn run_blocking(options: &DrillOptions) -> Result<DrillOutcome, String> {
    let chosen = chosen(options)?;
    if let Some(varied) = &options.vary {
        return run_vary(options, &chosen, varied);
    }
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a runtime: {e}"))?;
    let mut out = String::new();
    let mut failed = Vec::new();
    let mut reports = Vec::new();
    for (scenario, invocation) in &chosen {
        let stopwatch = allot_allocator::clock::Stopwatch::start();
        let reproduce = |report: &DrillReport| {
            format!(
                "  allot drill {invocation} --seed {} --duration-ms {}\n",
                report.seed, report.scenario.duration_ms
            )
        };
        let report = if let Some(seeds) = options.seeds {
            let found = runtime.block_on(sweep(scenario, seeds))?;
            let failing = found.failures.len() as u64 + found.failures_not_listed;
            if failing == 0 {
                out.push_str(&format!(
                    "drill {}: seeds {seeds} all pass ({} runs)\n",
                    scenario.name, found.seeds_run
                ));
                runtime.block_on(run(scenario))?
            } else {
                out.push_str(&format!(
                    "drill {} fails on {failing} of {} seeds ({seeds}); shortest reproductions:\n",
                    scenario.name, found.seeds_run
                ));
                for failure in &found.failures {
                    out.push_str(&reproduce(failure));
                }
                if found.failures_not_listed > 0 {
                    out.push_str(&format!(
                        "  ... and {} more failing seeds\n",
                        found.failures_not_listed
                    ));
                }
                found
                    .failures
                    .into_iter()
                    .next()
                    .ok_or("a failing sweep lists its first failure")?
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
        // Only the JSON on standard output, pass or fail: the exit status says which.
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
    Ok(DrillOutcome {
        output: out,
        failed,
    })
}

/// `--vary`: the one chosen drill with each value (module [`vary`]); a table (or JSON), and the SVG
/// with `plot`. Drills that fail their checks at some value are counted in the table, not errors:
/// where a parameter stops being safe is what the sweep is for.
fn run_vary(
    options: &DrillOptions,
    chosen: &[(Scenario, String)],
    varied: &vary::Vary,
) -> Result<DrillOutcome, String> {
    let [(scenario, _)] = chosen else {
        return Err("--vary takes one drill (a name or one --file)".to_owned());
    };
    let seeds = match options.seeds {
        Some(seeds) => seeds,
        None => SeedRange::first_n(VARY_SEEDS)?,
    };
    let runtime = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .map_err(|e| format!("cannot start a runtime: {e}"))?;
    let points = runtime.block_on(vary::sweep(scenario, varied, seeds))?;
    let mut output = if options.json {
        let mut json = serde_json::to_string_pretty(&serde_json::json!({
            "drill": scenario.name, "parameter": format!("{:?}", varied.parameter), "points": points,
        }))
        .map_err(|e| e.to_string())?;
        json.push('\n');
        json
    } else {
        vary::table(scenario, varied, &points)
    };
    if let Some(path) = &options.plot {
        let svg = vary::svg(scenario, varied, &points)?;
        std::fs::write(path, svg).map_err(|e| format!("--plot {}: {e}", path.display()))?;
        if !options.json {
            output.push_str(&format!("plot written to {}\n", path.display()));
        }
    }
    Ok(DrillOutcome {
        output,
        failed: Vec::new(),
    })
}
