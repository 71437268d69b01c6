//! Operator tools over the pure core: check a policy bundle file, and compute a pool's overshoot bound.
//!
//! Each returns the text to print, or a one-line error, so the binary stays a thin argument parser and
//! the output is tested here.

use std::fmt::Write as _;

use allot_shared::ids::RegionId;
use allot_shared::lease::{LeaseClamping, OvershootBound, PoolConfig};
use allot_shared::limit::multi::Algorithm;
use allot_shared::policy::{Exposure, FailMode, Limit, PolicyBundle, parse_bundle};

/// Largest bundle file read, in bytes (I10).
pub const MAX_BUNDLE_FILE_BYTES: u64 = 4 << 20;

/// Loads a bundle file the way an agent's `--policy-file` does: validated, a missing version is 1, a
/// missing checksum is computed and a present one verified.
pub fn load_bundle_file(path: &std::path::Path) -> Result<PolicyBundle, String> {
    let size = std::fs::metadata(path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .len();
    if size > MAX_BUNDLE_FILE_BYTES {
        return Err(format!(
            "{}: {size} bytes is larger than the {MAX_BUNDLE_FILE_BYTES}-byte limit for a bundle",
            path.display()
        ));
    }
    let text = std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))?;
    parse_bundle(&text)
        .and_then(|draft| draft.into_file_bundle())
        .map_err(|e| format!("{}: {e}", path.display()))
}

fn describe_algorithm(limit: &Limit) -> String {
    match limit {
        Limit::Global(pool) => format!("lease from pool {pool}"),
        Limit::Regional(Algorithm::TokenBucket(b)) => format!(
            "token_bucket {} mt, +{} mt / {} ms",
            b.capacity_millitokens(),
            b.refill_millitokens(),
            b.period_ms()
        ),
        Limit::Regional(Algorithm::Gcra(g)) => {
            format!("gcra, burst tolerance {} ms", g.burst_tolerance_ms())
        }
        Limit::Regional(Algorithm::FixedWindow(w)) => {
            format!("fixed_window {} / window", w.limit_units())
        }
        Limit::Regional(Algorithm::SlidingCounter(_)) => "sliding_counter".to_owned(),
        Limit::Regional(Algorithm::SlidingLog(_)) => "sliding_log".to_owned(),
    }
}

/// `allot policy replay`: a decision log against a candidate and the current bundle, offline,
/// with the data plane's own matching, keys and algorithms (as `allotctl policies replay`, which
/// can also fetch the current bundle from the allocator).
pub fn policy_replay(
    candidate: &std::path::Path,
    current: &std::path::Path,
    sample: &std::path::Path,
    enforce: bool,
    json: bool,
) -> Result<String, String> {
    use allot_allocator::ctl::{bundle_file, replay_comparison, sample_file};
    let candidate = bundle_file(candidate)?;
    let current = bundle_file(current)?;
    let samples = sample_file(sample)?;
    Ok(replay_comparison(
        &current,
        &candidate,
        &samples,
        json,
        allot_shared::replay::ReplayOptions {
            enforce_advisory: enforce,
        },
    ))
}

/// `allot policy check FILE`: a summary of a valid bundle, one line per rule.
pub fn policy_check(path: &std::path::Path) -> Result<String, String> {
    let bundle = load_bundle_file(path)?;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "valid bundle: version {}, {} rules, {}",
        bundle.version(),
        bundle.rules().len(),
        bundle.checksum()
    );
    for rule in bundle.rules() {
        let fail = match rule.fail_mode {
            FailMode::Closed => "fails closed".to_owned(),
            FailMode::LocalBounded(local) => format!(
                "falls back to a local {} mt bucket",
                local.capacity_millitokens()
            ),
        };
        // Only what differs from an enforced rule shown by its own scope's default.
        let mut notes = String::new();
        if rule.mode.is_advisory() {
            let _ = write!(notes, ", {} (never denies)", rule.mode.as_str());
        }
        match rule.exposure {
            Exposure::OwnScope => {}
            Exposure::Shown => notes.push_str(", shown to callers"),
            Exposure::Hidden => notes.push_str(", hidden from callers"),
        }
        let _ = writeln!(
            out,
            "  {:<24} {:<7} {:<52} {fail}{notes}",
            rule.id.as_str(),
            format!("{:?}", rule.scope).to_lowercase(),
            describe_algorithm(&rule.limit),
        );
    }
    Ok(out)
}

/// The inputs of `allot bound`.
#[derive(Debug, Clone)]
pub struct BoundArgs {
    /// `G`, tokens per window.
    pub limit_tokens: u64,
    /// Window length, ms.
    pub window_ms: u64,
    /// Largest grant, tokens.
    pub chunk_tokens: u64,
    /// Lease TTL, ms.
    pub lease_ttl_ms: u64,
    /// Fallback allowance per region per window, tokens.
    pub fallback_per_region_tokens: u64,
    /// Debt each region may carry from metered requests settled above their estimate, tokens.
    pub settle_debt_per_region_tokens: u64,
    /// Number of regions.
    pub regions: usize,
    /// Whether leases are left unclamped (never in production).
    pub unclamped: bool,
    /// Leases a region may hold at once (a prefetched renewal makes it 2).
    pub max_leases_per_region: u64,
    /// Tokens re-granted because an asynchronous allocator store lost grant records (0 with etcd).
    pub lost_grant_record_tokens: u64,
}

/// `allot bound`: the worst case one window can admit, term by term.
pub fn bound_report(args: &BoundArgs) -> Result<String, String> {
    let regions = (0..args.regions)
        .map(|n| RegionId::parse(&format!("r{n}")))
        .collect::<Result<Vec<_>, _>>()
        .map_err(|e| e.to_string())?;
    let config = PoolConfig::new(
        args.limit_tokens,
        args.window_ms,
        args.chunk_tokens,
        args.lease_ttl_ms,
        args.fallback_per_region_tokens,
        regions,
    )
    .and_then(|config| config.with_settle_debt_per_region(args.settle_debt_per_region_tokens))
    .map_err(|e| format!("invalid pool: {e}"))?;
    let clamping = if args.unclamped {
        LeaseClamping::Unclamped
    } else {
        LeaseClamping::Clamped
    };
    let bound = OvershootBound::for_design(
        &config,
        clamping,
        args.max_leases_per_region,
        args.lost_grant_record_tokens,
    );
    let limit = bound.limit_tokens;
    let percent = |tokens: u64| tokens as f64 * 100.0 / limit as f64;
    let mut out = String::new();
    let _ = writeln!(
        out,
        "admitted per window <= {} tokens",
        bound.total_tokens()
    );
    let _ = writeln!(out, "  G (limit)                    {limit:>10}");
    for (name, tokens) in [
        ("unclamped carry-over", bound.unclamped_carry_over_tokens),
        ("fallback allowances", bound.fallback_allowance_tokens),
        ("lost grant records", bound.lost_grant_record_tokens),
        ("settle debt", bound.settle_debt_tokens),
    ] {
        let _ = writeln!(
            out,
            "  + {name:<26} {tokens:>10}  (+{:.1}% of G)",
            percent(tokens)
        );
    }
    let stranded = config.chunk_tokens().saturating_mul(args.regions as u64);
    let _ = writeln!(
        out,
        "stranded per window at most {stranded} tokens (one chunk per region left in leases that expire)"
    );
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn args() -> BoundArgs {
        BoundArgs {
            limit_tokens: 1_000,
            window_ms: 60_000,
            chunk_tokens: 100,
            lease_ttl_ms: 15_000,
            fallback_per_region_tokens: 100,
            settle_debt_per_region_tokens: 0,
            regions: 2,
            unclamped: false,
            max_leases_per_region: 1,
            lost_grant_record_tokens: 0,
        }
    }

    #[test]
    fn bound_report_shows_each_term() {
        let text = bound_report(&args()).expect("valid");
        assert!(
            text.starts_with("admitted per window <= 1200 tokens"),
            "{text}"
        );
        assert!(
            text.contains("fallback allowances               200  (+20.0% of G)"),
            "{text}"
        );
        let unclamped = bound_report(&BoundArgs {
            unclamped: true,
            ..args()
        })
        .expect("valid");
        assert!(
            unclamped.starts_with("admitted per window <= 1400 tokens"),
            "{unclamped}"
        );
        let metered = bound_report(&BoundArgs {
            settle_debt_per_region_tokens: 25,
            ..args()
        })
        .expect("valid");
        assert!(
            metered.starts_with("admitted per window <= 1250 tokens"),
            "{metered}"
        );
        assert!(
            metered.contains("settle debt                        50  (+5.0% of G)"),
            "{metered}"
        );
    }

    #[test]
    fn bound_report_rejects_invalid_pools_in_one_line() {
        let err = bound_report(&BoundArgs {
            chunk_tokens: 2_000,
            ..args()
        })
        .expect_err("chunk above limit");
        assert_eq!(
            err,
            "invalid pool: chunk: must be at least 1 and at most limit"
        );
    }

    #[test]
    fn policy_check_summarises_the_example_bundle() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy/examples/northstar-bundle.json");
        let text = policy_check(&path).expect("the example is valid");
        assert!(
            text.starts_with("valid bundle: version 42, 5 rules, sha256:"),
            "{text}"
        );
        assert!(text.contains("export-tenant"), "{text}");
        assert!(text.contains("lease from pool api"), "{text}");
    }

    #[test]
    fn policy_check_says_which_rules_never_deny_and_which_callers_see() {
        let path = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy/examples/dev-bundle.json");
        let text = policy_check(&path).expect("the dev bundle is valid");
        let line = |id: &str| {
            text.lines()
                .find(|l| l.trim_start().starts_with(id))
                .unwrap_or_else(|| panic!("no {id} in {text}"))
                .to_owned()
        };
        assert!(
            line("burst-guard").ends_with("fails closed, shadow (never denies)"),
            "{text}"
        );
        assert!(
            line("atlas-plan").ends_with("soft (never denies), shown to callers"),
            "{text}"
        );
        assert!(line("read-user-v3").ends_with("bucket"), "{text}");
    }

    /// The dev bundle's burst guard is in shadow mode: replayed as it is it denies nothing, with
    /// `enforce` it denies every user's second request within ten seconds, and names them.
    #[test]
    fn policy_replay_answers_who_an_enforced_shadow_rule_would_deny() {
        let dir = tempfile::tempdir().expect("temp dir");
        let bundle = std::path::Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../deploy/examples/dev-bundle.json");
        let sample = dir.path().join("decisions.jsonl");
        let lines: Vec<String> = (0..6)
            .map(|n| {
                serde_json::json!({ "atMs": 1_000 + n * 100, "request": {
                    "requestId": format!("r-{n}"), "tenantId": "atlas",
                    "principal": { "type": "user", "id": format!("U-{}", n % 2) },
                    "routeGroup": "read", "method": "GET" } })
                .to_string()
            })
            .collect();
        std::fs::write(&sample, lines.join("\n")).expect("sample");
        let as_is = policy_replay(&bundle, &bundle, &sample, false, false).expect("replayed");
        assert!(
            as_is.contains("principals denied with the candidate: 0"),
            "{as_is}"
        );
        assert!(
            as_is.contains("shadow/soft burst-guard: would have denied 4"),
            "{as_is}"
        );
        let enforced = policy_replay(&bundle, &bundle, &sample, true, false).expect("replayed");
        assert!(
            enforced.contains("principals denied with the candidate: 2"),
            "{enforced}"
        );
        let missing = policy_replay(
            &bundle,
            &bundle,
            &dir.path().join("none.jsonl"),
            false,
            false,
        )
        .expect_err("no sample");
        assert!(missing.contains("none.jsonl"), "{missing}");
        assert!(!missing.contains('\n'), "one line: {missing}");
    }

    #[test]
    fn policy_check_errors_name_the_file_and_field() {
        let dir = std::env::temp_dir().join(format!("allot-policy-check-{}", std::process::id()));
        std::fs::create_dir_all(&dir).expect("temp dir");
        let path = dir.join("bad.json");
        std::fs::write(
            &path,
            r#"{"rules":[{"id":"x","scope":"user","algorithm":"gcra"}]}"#,
        )
        .expect("write");
        let err = policy_check(&path).expect_err("invalid");
        assert!(
            err.contains("bad.json: rule x: rules[0].capacityMillis: is required"),
            "{err}"
        );
        assert!(!err.contains('\n'), "one line");
        std::fs::remove_dir_all(&dir).expect("cleanup");
    }
}
