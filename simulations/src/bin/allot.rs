//! `allot`: Allot's umbrella command. It parses arguments and calls into the library; nothing else.

use std::path::PathBuf;
use std::process::ExitCode;

use allot_simulations::dev::{DevOptions, run_dev};
use allot_simulations::tools::{BoundArgs, bound_report, policy_check, policy_replay};

/// Runs `allot dev` on a runtime until Ctrl-C; prints nothing more on success.
fn run_dev_blocking(options: DevOptions) -> Result<String, String> {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_env("ALLOT_LOG")
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let runtime = tokio::runtime::Runtime::new().map_err(|e| e.to_string())?;
    runtime.block_on(async {
        let stop = async {
            let terminate = async {
                match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
                    Ok(mut signal) => {
                        signal.recv().await;
                    }
                    Err(_) => std::future::pending::<()>().await,
                }
            };
            tokio::select! {
                _ = tokio::signal::ctrl_c() => {}
                () = terminate => {}
            }
        };
        run_dev(options, Box::pin(stop)).await
    })?;
    Ok(String::new())
}
use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "allot",
    version,
    about = "Allot: multi-region quota allocation"
)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Run an allocator and two region agents (eu, us) in this process on in-process stores, with an
    /// example pool and policy bundle. Not for production.
    Dev {
        /// The allocator's port; the agents take the next two.
        #[arg(long, default_value_t = 7600)]
        port: u16,
        /// Directory for the SQLite ledger.
        #[arg(long, default_value = "allot-data")]
        data_dir: PathBuf,
        /// Drive synthetic traffic (90% EU, 10% US) and print a live per-window table.
        #[arg(long)]
        demo: bool,
        /// Demo requests per second.
        #[arg(long, default_value_t = 40)]
        demo_rate: u64,
    },
    /// Run partition drills (the built-in suite, named ones, or scenario files) on the shipped
    /// allocator and agent logic in virtual time; exits non-zero when a drill misses its expected
    /// outcome or breaks an invariant.
    Drill {
        /// Built-in drill names (see docs/drills.md); none and no --file runs them all.
        names: Vec<String>,
        /// A scenario file (TOML, see simulations/scenarios/); repeatable.
        #[arg(long = "file")]
        files: Vec<PathBuf>,
        /// Print the reports as JSON instead of tables.
        #[arg(long)]
        json: bool,
        /// Write a self-contained HTML report with plots to this file.
        #[arg(long)]
        report: Option<PathBuf>,
        /// Run with this seed instead of the scenario's.
        #[arg(long, conflicts_with = "seeds")]
        seed: Option<u64>,
        /// Sweep seeds: `N` runs 0 to N-1, `A..B` runs A to B (both included); every failing seed
        /// is listed with its shortest reproduction.
        #[arg(long)]
        seeds: Option<allot_simulations::drill::SeedRange>,
        /// Run for this long instead of the scenario's duration, ms.
        #[arg(long)]
        duration_ms: Option<u64>,
        /// Run the one named drill with each value of a design parameter and print what each
        /// costs: `partition-ms=0,30000,60000`, `lease-ttl-ms=...`, `chunk=...`,
        /// `fallback-per-region=...` (each value over --seeds, 10 by default).
        #[arg(long)]
        vary: Option<allot_simulations::drill::vary::Vary>,
        /// With --vary: write the sweep as an SVG of bars to this file.
        #[arg(long, requires = "vary")]
        plot: Option<PathBuf>,
    },
    /// Policy bundle tools.
    Policy {
        #[command(subcommand)]
        command: PolicyCommand,
    },
    /// The worst case a pool can admit in one window, term by term
    /// (admitted <= G + unclamped carry-over + fallback allowances + lost grant records
    /// + settle debt).
    Bound {
        /// G: the pool's global quota per window, in tokens.
        #[arg(long, default_value_t = 1_000)]
        limit: u64,
        /// Window length in ms.
        #[arg(long, default_value_t = 60_000)]
        window_ms: u64,
        /// Largest grant in tokens.
        #[arg(long, default_value_t = 100)]
        chunk: u64,
        /// Lease TTL in ms.
        #[arg(long, default_value_t = 15_000)]
        lease_ttl_ms: u64,
        /// Tokens each region may admit per window while the allocator is unreachable.
        #[arg(long, default_value_t = 100)]
        fallback: u64,
        /// Debt each region may carry per window from metered requests settled above their
        /// estimate, tokens (the pool's settleDebtPerRegion).
        #[arg(long, default_value_t = 0)]
        settle_debt: u64,
        /// Number of regions sharing the pool.
        #[arg(long, default_value_t = 2)]
        regions: usize,
        /// Leave leases unclamped (a lease may outlive its window). Production always clamps.
        #[arg(long)]
        unclamped: bool,
        /// Leases a region's agent may hold at once (the shipped agent's limit by default; the
        /// carry-over term grows with it when leases are unclamped).
        #[arg(long, default_value_t = allot_region_agent::global::holder::MAX_LIVE_LEASES as u64)]
        max_leases_per_region: u64,
        /// Tokens re-granted after an allocator failover lost grant records (0 with etcd).
        #[arg(long, default_value_t = 0)]
        lost_grant_records: u64,
    },
}

#[derive(Subcommand)]
enum PolicyCommand {
    /// Validate a bundle file as an agent's --policy-file would, and summarise it.
    Check {
        /// The bundle JSON file.
        file: PathBuf,
    },
    /// Replay a decision log against a candidate bundle beside the current one, offline: the
    /// denial rate per rule, who the candidate would deny, and per pool the tokens the denied
    /// requests would not spend (stranded in their leases unless others spend them).
    Replay {
        /// The candidate bundle JSON file.
        #[arg(long)]
        bundle: PathBuf,
        /// The bundle in force, to compare with.
        #[arg(long)]
        current: PathBuf,
        /// The decision log: JSON lines of {"atMs": ..., "request": {...}}.
        #[arg(long)]
        sample: PathBuf,
        /// Replay the candidate's shadow and soft rules as if enforced.
        #[arg(long)]
        enforce: bool,
        /// Print both reports as JSON.
        #[arg(long)]
        json: bool,
    },
}

/// Runs the command named on the command line: its output printed, or its error and exit 2 (a
/// drill sets its own exit status).
///
/// Long by design: it is one match over every command, each arm moving the command's flags into the
/// options of the function that runs it; split, the table of commands would be read in several
/// places and every arm's flags would be named twice.
fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Dev {
            port,
            data_dir,
            demo,
            demo_rate,
        } => run_dev_blocking(DevOptions {
            base_port: port,
            data_dir,
            demo,
            demo_rate_per_s: demo_rate,
        }),
        Command::Drill {
            names,
            files,
            json,
            report,
            seed,
            seeds,
            duration_ms,
            vary,
            plot,
        } => {
            return drill(&allot_simulations::drill::DrillOptions {
                names,
                files,
                json,
                report,
                seed,
                seeds,
                duration_ms,
                vary,
                plot,
            });
        }
        Command::Policy {
            command: PolicyCommand::Check { file },
        } => policy_check(&file),
        Command::Policy {
            command:
                PolicyCommand::Replay {
                    bundle,
                    current,
                    sample,
                    enforce,
                    json,
                },
        } => policy_replay(&bundle, &current, &sample, enforce, json),
        Command::Bound {
            limit,
            window_ms,
            chunk,
            lease_ttl_ms,
            fallback,
            settle_debt,
            regions,
            unclamped,
            max_leases_per_region,
            lost_grant_records,
        } => bound_report(&BoundArgs {
            limit_tokens: limit,
            window_ms,
            chunk_tokens: chunk,
            lease_ttl_ms,
            fallback_per_region_tokens: fallback,
            settle_debt_per_region_tokens: settle_debt,
            regions,
            unclamped,
            max_leases_per_region,
            lost_grant_record_tokens: lost_grant_records,
        }),
    };
    match result {
        Ok(text) => {
            print!("{text}");
            ExitCode::SUCCESS
        }
        Err(message) => {
            eprintln!("allot: {message}");
            ExitCode::from(2)
        }
    }
}

/// `allot drill`: the reports on standard output whether the drills pass or fail (exit 1 names the
/// failed ones on standard error); 2 when they could not run.
fn drill(options: &allot_simulations::drill::DrillOptions) -> ExitCode {
    match allot_simulations::drill::run_blocking(options) {
        Ok(outcome) => {
            print!("{}", outcome.output);
            if outcome.failed.is_empty() {
                ExitCode::SUCCESS
            } else {
                eprintln!("allot: drills failed: {}", outcome.failed.join(", "));
                ExitCode::FAILURE
            }
        }
        Err(message) => {
            eprintln!("allot: {message}");
            ExitCode::from(2)
        }
    }
}
