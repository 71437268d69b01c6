//! Outside tools that judge a service's OpenAPI document, run as the CI runs them: the document
//! through `openapi-spec-validator`, and the running service through Schemathesis (both from PyPI;
//! `scripts/ensure-deps` installs them). Either one failing fails the test with its whole report.

use std::time::Duration;

use crate::binary::Binary;
use crate::process::{Launch, run_to_completion};

/// How long the validator may take.
const VALIDATE_TIMEOUT: Duration = Duration::from_secs(60);
/// How long one Schemathesis run may take.
const SCHEMATHESIS_TIMEOUT: Duration = Duration::from_secs(600);
/// How much of a failing tool's output the panic quotes.
const REPORT_LINES: usize = 400;

/// Checks `document` (OpenAPI JSON) with `openapi-spec-validator`; panics with its report when it
/// is not a valid OpenAPI document.
pub fn validate_openapi(document: &str) {
    let program = Binary::OpenapiSpecValidator.require();
    let dir = tempfile::tempdir().expect("allot-testkit: temp dir for the validator");
    let path = dir.path().join("openapi.json");
    std::fs::write(&path, document).expect("allot-testkit: cannot write the document");
    let launch = Launch {
        label: "openapi-spec-validator".to_owned(),
        program,
        args: vec![path.display().to_string()],
        log: dir.path().join("validator.log"),
    };
    if let Err(why) = run_to_completion(&launch, VALIDATE_TIMEOUT) {
        panic!("{why}\n{}", whole_log(&launch));
    }
}

/// What Schemathesis runs against.
#[derive(Debug, Clone)]
pub struct SchemathesisRun<'a> {
    /// Where the service serves its document, `http://127.0.0.1:port/openapi.json`.
    pub schema_url: &'a str,
    /// `Authorization` header value the calls carry (`Bearer <token>`).
    pub authorization: &'a str,
    /// Test cases per operation and phase.
    pub max_examples: u32,
    /// The seed, so a failure can be run again.
    pub seed: u64,
    /// Checks to leave out, each with the reason in the caller's comment.
    pub exclude_checks: &'a [&'a str],
    /// A `schemathesis.toml` (per-operation settings, each with its reason in a comment), or "".
    pub config: &'a str,
}

/// Runs Schemathesis (`--checks all`) against the running service; panics with its report when
/// any check fails. Returns the report of a passing run. `ALLOT_SCHEMATHESIS_SEED` and
/// `ALLOT_SCHEMATHESIS_EXAMPLES`, when set, replace the run's seed and examples (for sweeps).
pub fn schemathesis(run: &SchemathesisRun<'_>) -> String {
    let from_env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    let seed = from_env("ALLOT_SCHEMATHESIS_SEED").unwrap_or(run.seed);
    let max_examples =
        from_env("ALLOT_SCHEMATHESIS_EXAMPLES").unwrap_or(u64::from(run.max_examples));
    let program = Binary::Schemathesis.require();
    let dir = tempfile::tempdir().expect("allot-testkit: temp dir for Schemathesis");
    let config = dir.path().join("schemathesis.toml");
    std::fs::write(&config, run.config).expect("allot-testkit: cannot write schemathesis.toml");
    let mut args = vec![
        "--config-file".to_owned(),
        config.display().to_string(),
        "run".to_owned(),
        run.schema_url.to_owned(),
        "--header".to_owned(),
        format!("Authorization: {}", run.authorization),
        "--checks".to_owned(),
        "all".to_owned(),
        "--max-examples".to_owned(),
        max_examples.to_string(),
        "--seed".to_owned(),
        seed.to_string(),
        "--workers".to_owned(),
        "1".to_owned(),
        "--request-timeout".to_owned(),
        "10".to_owned(),
        "--wait-for-schema".to_owned(),
        "10".to_owned(),
    ];
    if !run.exclude_checks.is_empty() {
        args.push("--exclude-checks".to_owned());
        args.push(run.exclude_checks.join(","));
    }
    let launch = Launch {
        label: format!("schemathesis against {}", run.schema_url),
        program,
        args,
        log: dir.path().join("schemathesis.log"),
    };
    if let Err(why) = run_to_completion(&launch, SCHEMATHESIS_TIMEOUT) {
        panic!("{why}\n{}", whole_log(&launch));
    }
    whole_log(&launch)
}

fn whole_log(launch: &Launch) -> String {
    let text = std::fs::read_to_string(&launch.log).unwrap_or_default();
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(REPORT_LINES)..].join("\n")
}
