//! `allotctl policies replay`: recorded requests against the current and a candidate bundle, side
//! by side, offline.

use std::fmt::Write as _;

use allot_shared::keys::Pepper;
use allot_shared::policy::PolicyBundle;
use allot_shared::replay::{ReplayOptions, ReplayReport, ReplaySample, replay_with};

/// Replays the sample against both bundles and renders the per-rule comparison; with
/// `options.enforce_advisory`, the candidate's shadow and soft rules are replayed as if enforced
/// (the current bundle runs as it does).
///
/// Long by design: it renders the comparison as the operator reads it, top to bottom (the overall
/// rates, a row per rule of either bundle side by side, then what only the candidate shows), every
/// line drawn from the same two reports and the one rate format; split, the two reports and that
/// format would be passed to each section.
pub fn replay_comparison(
    current: &PolicyBundle,
    candidate: &PolicyBundle,
    samples: &[ReplaySample],
    json: bool,
    options: ReplayOptions,
) -> String {
    // The pepper only has to be stable within the replay; keys never leave this process.
    let pepper = Pepper::new(b"allotctl-replay-pepper".to_vec());
    let (current_report, candidate_report) = match pepper {
        Ok(pepper) => (
            replay_with(current, samples, &pepper, ReplayOptions::default()),
            replay_with(candidate, samples, &pepper, options),
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
    let advisory: Vec<(&String, u64)> = candidate_report
        .rules
        .iter()
        .filter(|(_, r)| r.would_deny > 0)
        .map(|(id, r)| (id, r.would_deny))
        .collect();
    for (id, would_deny) in advisory {
        let _ = writeln!(
            out,
            "shadow/soft {id}: would have denied {would_deny} (run with --enforce to replay it enforced)"
        );
    }
    let _ = writeln!(
        out,
        "principals denied with the candidate: {}",
        candidate_report.principals_denied
    );
    for who in &candidate_report.top_denied {
        let _ = writeln!(
            out,
            "  {} {} denied {}",
            who.tenant, who.principal, who.denied
        );
    }
    for (pool, tokens) in &candidate_report.unspent_global_tokens {
        let _ = writeln!(
            out,
            "pool {pool}: {tokens} tokens the denied requests would not spend (leased for them, stranded unless others spend them)"
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
