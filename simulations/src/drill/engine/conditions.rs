//! What acts on a region during one tick: the scenario's faults in force, the arrivals (Poisson,
//! each stream seeded apart) and their phases.

use rand::Rng;
use rand::rngs::StdRng;

use crate::drill::scenario::{Fault, Scenario};

/// The faults acting on one region during one tick.
#[derive(Debug, Clone, Copy, Default)]
pub(super) struct RegionConditions {
    pub(super) partitioned: bool,
    pub(super) loss_percent: u64,
    pub(super) added_ms: u64,
    pub(super) clock_offset_ms: i64,
}

pub(super) fn conditions(scenario: &Scenario, region: &str, elapsed_ms: u64) -> RegionConditions {
    let mut c = RegionConditions::default();
    for fault in scenario.faults.iter().filter(|f| f.touches(region)) {
        match *fault {
            Fault::Partition {
                from_ms, until_ms, ..
            } if (from_ms..until_ms).contains(&elapsed_ms) => c.partitioned = true,
            Fault::AnswerLoss {
                from_ms,
                until_ms,
                percent,
                ..
            } if (from_ms..until_ms).contains(&elapsed_ms) => {
                c.loss_percent = c.loss_percent.max(percent);
            }
            Fault::Latency {
                from_ms,
                until_ms,
                added_ms,
                ..
            } if (from_ms..until_ms).contains(&elapsed_ms) => c.added_ms += added_ms,
            Fault::ClockSkew {
                offset_ms,
                rate_ppm,
                ..
            } => {
                let drift = i64::try_from(elapsed_ms)
                    .unwrap_or(i64::MAX)
                    .saturating_mul(rate_ppm)
                    / 1_000_000;
                c.clock_offset_ms += offset_ms + drift;
            }
            _ => {}
        }
    }
    c
}

/// Poisson-distributed arrivals with mean `mean` (Knuth's method for small means, a rounded normal
/// approximation above 30).
pub(super) fn poisson(rng: &mut StdRng, mean: f64) -> u64 {
    if mean <= 0.0 {
        return 0;
    }
    if mean > 30.0 {
        // Box-Muller.
        let u1: f64 = rng.random::<f64>().max(f64::MIN_POSITIVE);
        let u2: f64 = rng.random::<f64>();
        let z = (-2.0 * u1.ln()).sqrt() * (std::f64::consts::TAU * u2).cos();
        return (mean + z * mean.sqrt()).round().max(0.0) as u64;
    }
    let limit = (-mean).exp();
    let mut product = rng.random::<f64>();
    let mut count = 0;
    while product > limit {
        product *= rng.random::<f64>();
        count += 1;
    }
    count
}

/// Mixed into the seed for the stream of timings (the run's start, arrival phases).
pub(super) const TIMING_STREAM: u64 = 0x5eed_0fa1_11e5;
/// The stream that decides which requests a regional rule denies and which are metered: a
/// stream of its own, so drills without either draw exactly what they always did.
pub(super) const REQUEST_KIND_STREAM: u64 = 0x5eed_0de1_7e0d;

/// The starting remainder of a steady arrival count (in requests x 60,000): 0 without a phase
/// stream, else uniform over one request.
pub(super) fn arrival_phase(phases: &mut Option<StdRng>) -> u64 {
    phases.as_mut().map_or(0, |rng| rng.random_range(0..60_000))
}

pub(super) fn ms(duration: std::time::Duration) -> u64 {
    u64::try_from(duration.as_millis()).unwrap_or(u64::MAX)
}
