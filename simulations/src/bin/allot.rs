//! `allot`: Allot's umbrella command. It parses arguments and calls into the library; nothing else.

use std::path::PathBuf;
use std::process::ExitCode;

use allot_simulations::tools::{BoundArgs, bound_report, policy_check};
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
    /// Policy bundle tools.
    Policy {
        #[command(subcommand)]
        command: PolicyCommand,
    },
    /// The worst case a pool can admit in one window, term by term
    /// (admitted <= G + unclamped carry-over + fallback allowances + lost grant records).
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
        /// Number of regions sharing the pool.
        #[arg(long, default_value_t = 2)]
        regions: usize,
        /// Leave leases unclamped (a lease may outlive its window). Production always clamps.
        #[arg(long)]
        unclamped: bool,
        /// Leases a region may hold at once (2 with a prefetched renewal).
        #[arg(long, default_value_t = 1)]
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
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match cli.command {
        Command::Policy {
            command: PolicyCommand::Check { file },
        } => policy_check(&file),
        Command::Bound {
            limit,
            window_ms,
            chunk,
            lease_ttl_ms,
            fallback,
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
