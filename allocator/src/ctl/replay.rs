//! `allotctl policies replay`: recorded requests against the current and a candidate bundle, side
//! by side, offline.

use std::fmt::Write as _;

use allot_shared::keys::Pepper;
use allot_shared::policy::PolicyBundle;
use allot_shared::replay::{ReplayReport, ReplaySample, replay};

/// Replays the sample against both bundles and renders the per-rule comparison.
pub fn replay_comparison(
    current: &PolicyBundle,
    candidate: &PolicyBundle,
    samples: &[ReplaySample],
    json: bool,
) -> String {
    // The pepper only has to be stable within the replay; keys never leave this process.
    let pepper = Pepper::new(b"allotctl-replay-pepper".to_vec());
    let (current_report, candidate_report) = match pepper {
        Ok(pepper) => (
            replay(current, samples, &pepper),
            replay(candidate, samples, &pepper),
        ),
        Err(_) => (ReplayReport::default(), ReplayReport::default()),
    };
    if json {
        return format!(
            "{}\n",
            serde_json::json!({ "current": current_report, "candidate": candidate_report })
        );
    }
    let rate = |denied: u64, total: u64| {
        if total == 0 {
            "-".to_owned()
        } else {
            format!("{:.2}%", denied as f64 * 100.0 / total as f64)
        }
    };
    let mut out = String::new();
    let _ = writeln!(
        out,
        "{} requests: denied {} now (v{}), {} with the candidate (v{})",
        current_report.requests,
        rate(current_report.denied, current_report.requests),
        current.version(),
        rate(candidate_report.denied, candidate_report.requests),
        candidate.version()
    );
    let _ = writeln!(out, "{:<32} {:>12} {:>12}", "rule", "current", "candidate");
    let mut ids: Vec<&String> = current_report
        .rules
        .keys()
        .chain(candidate_report.rules.keys())
        .collect();
    ids.sort();
    ids.dedup();
    for id in ids {
        let cell = |report: &ReplayReport| {
            report
                .rules
                .get(id)
                .map_or("-".to_owned(), |r| rate(r.denied, r.evaluated))
        };
        let _ = writeln!(
            out,
            "{id:<32} {:>12} {:>12}",
            cell(&current_report),
            cell(&candidate_report)
        );
    }
    let skipped: Vec<&String> = candidate_report.not_replayed.keys().collect();
    if !skipped.is_empty() {
        let _ = writeln!(
            out,
            "not replayed (global leases and concurrency caps): {}",
            skipped
                .iter()
                .map(|s| s.as_str())
                .collect::<Vec<_>>()
                .join(", ")
        );
    }
    out
}
