//! Every built-in drill holds for every seed, not just the one in its file: each is swept over
//! [`SEEDS`] seeds (checks outside this repository use other seeds). A failure lists each failing
//! seed with its shortest reproduction.

use allot_simulations::drill::{SeedRange, builtin, sweep};

/// Seeds swept per drill (`allot drill NAME --seeds 1..400` reproduces a sweep).
const SEEDS: (u64, u64) = (1, 400);
/// Drills whose one run simulates days of calendar windows, swept over fewer seeds (each seed
/// varies only the arrivals; the calendar, its daylight-saving switch, is the same in every one).
const LONG_DRILL_SEEDS: [(&str, u64); 1] = [("calendar-dst", 100)];

fn sweep_drill(name: &str) {
    let scenario = builtin()
        .into_iter()
        .find(|s| s.name == name)
        .unwrap_or_else(|| panic!("no drill {name}"));
    let last_seed = LONG_DRILL_SEEDS
        .iter()
        .find(|(long, _)| *long == name)
        .map_or(SEEDS.1, |&(_, seeds)| SEEDS.0 + seeds - 1);
    let seeds = SeedRange::new(SEEDS.0, last_seed).expect("a valid range");
    let found = tokio::runtime::Builder::new_current_thread()
        .enable_all()
        .build()
        .expect("runtime")
        .block_on(sweep(&scenario, seeds))
        .expect("the drill runs");
    assert_eq!(found.seeds_run, last_seed - SEEDS.0 + 1);
    let reproductions: Vec<String> = found
        .failures
        .iter()
        .map(|f| {
            format!(
                "allot drill {name} --seed {} --duration-ms {}: {:?}",
                f.seed, f.scenario.duration_ms, f.violations
            )
        })
        .collect();
    assert!(
        reproductions.is_empty(),
        "{} of {} seeds fail:\n{}",
        reproductions.len() as u64 + found.failures_not_listed,
        found.seeds_run,
        reproductions.join("\n")
    );
}

macro_rules! sweeps {
    ($($test:ident => $name:literal),* $(,)?) => {
        $(
            #[test]
            fn $test() {
                sweep_drill($name);
            }
        )*

        #[test]
        fn every_built_in_drill_is_swept() {
            let swept = [$($name),*];
            for scenario in builtin() {
                assert!(swept.contains(&scenario.name.as_str()), "{} is not swept", scenario.name);
            }
        }
    };
}

sweeps! {
    clamped => "clamped",
    unclamped => "unclamped",
    fallback => "fallback",
    blackhole => "blackhole",
    failover_etcd => "failover-etcd",
    failover_lost => "failover-lost",
    failover_exhausted => "failover-exhausted",
    shard_move => "shard-move",
    independent => "independent",
    static_split => "static-split",
    demand_weighted => "demand-weighted",
    full_split => "full-split",
    answer_loss => "answer-loss",
    latency => "latency",
    agent_restart => "agent-restart",
    agent_restart_fallback => "agent-restart-fallback",
    agent_crash_in_partition => "agent-crash-in-partition",
    agents_per_region => "agents-per-region",
    regional_denials_metered => "regional-denials-metered",
    clock_skew => "clock-skew",
    clock_skew_partition => "clock-skew-partition",
    clock_rate_beyond_margin => "clock-rate-beyond-margin",
    rlqs => "rlqs",
    rlqs_partition => "rlqs-partition",
    rlqs_agent_restart => "rlqs-agent-restart",
    calendar_dst => "calendar-dst",
    pool_override => "override",
}
