//! Outside tools that judge a service's OpenAPI document, run as the CI runs them: the document
//! through `openapi-spec-validator`, and the running service through Schemathesis (both from PyPI;
//! `scripts/ensure-deps` installs them). Either one failing fails the test with its whole report.

use std::collections::BTreeSet;
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

/// Checks a service's OpenAPI `document` (JSON) as CI does: OpenAPI 3.1, accepted by
/// `openapi-spec-validator`, and naming exactly the operations `router_source` (the code that
/// builds the service's router) routes, at least `min_operations` of them (fewer means the reading
/// broke). Panics saying what differs.
pub fn check_openapi_document(document: &str, router_source: &str, min_operations: usize) {
    let parsed: serde_json::Value =
        serde_json::from_str(document).expect("allot-testkit: the document is not JSON");
    assert!(
        parsed["openapi"]
            .as_str()
            .is_some_and(|v| v.starts_with("3.1")),
        "not OpenAPI 3.1: {}",
        parsed["openapi"]
    );
    let routed = routed_operations(router_source);
    assert!(
        routed.len() >= min_operations,
        "only {} routes read: the reading is broken: {routed:?}",
        routed.len()
    );
    let documented = documented_operations(document);
    let undocumented: Vec<_> = routed.difference(&documented).collect();
    let unrouted: Vec<_> = documented.difference(&routed).collect();
    assert!(
        undocumented.is_empty() && unrouted.is_empty(),
        "routed but not in the document: {undocumented:?}; in the document but not routed: {unrouted:?}"
    );
    validate_openapi(document);
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
    /// A `schemathesis.toml` (per-operation settings, each with its reason in a comment), or "".
    pub config: &'a str,
}

/// Runs Schemathesis against the running service with every check (its default; a per-operation
/// exception belongs in the config, with its reason, since a `--checks` flag would override it);
/// panics with its report when any check fails. Returns the report of a passing run. `ALLOT_SCHEMATHESIS_SEED` and
/// `ALLOT_SCHEMATHESIS_EXAMPLES`, when set, replace the run's seed and examples (for sweeps).
pub fn schemathesis(run: &SchemathesisRun<'_>) -> String {
    let from_env = |name: &str| std::env::var(name).ok().and_then(|v| v.parse::<u64>().ok());
    let seed = from_env("ALLOT_SCHEMATHESIS_SEED").unwrap_or(run.seed);
    let max_examples =
        from_env("ALLOT_SCHEMATHESIS_EXAMPLES").unwrap_or(u64::from(run.max_examples));
    let program = Binary::Schemathesis.require();
    let dir = tempfile::tempdir().expect("allot-testkit: temp dir for Schemathesis");
    let config = dir.path().join("schemathesis.toml");
    // Nothing kept between runs (no cache, no example database in the caller's directory): a run
    // depends on its seed alone.
    let config_text = format!(
        "[cache]\nenabled = false\n\n[generation]\ndatabase = \"none\"\n\n{}",
        run.config
    );
    std::fs::write(&config, config_text).expect("allot-testkit: cannot write schemathesis.toml");
    let args = vec![
        "--config-file".to_owned(),
        config.display().to_string(),
        "run".to_owned(),
        run.schema_url.to_owned(),
        "--header".to_owned(),
        format!("Authorization: {}", run.authorization),
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

/// `(path, method)` of every operation an OpenAPI document (JSON) describes.
#[must_use]
pub fn documented_operations(document: &str) -> BTreeSet<(String, String)> {
    let document: serde_json::Value =
        serde_json::from_str(document).expect("allot-testkit: the document is not JSON");
    let mut operations = BTreeSet::new();
    for (path, item) in document["paths"].as_object().into_iter().flatten() {
        for method in item.as_object().into_iter().flatten().map(|(m, _)| m) {
            operations.insert((path.clone(), method.clone()));
        }
    }
    operations
}

/// `(path, method)` of every route a router's source declares:
/// `.route("/p", get(a).post(b))`, methods as lower-case names. A method router's handler named
/// like a method (`get_all`) is not a method.
#[must_use]
pub fn routed_operations(source: &str) -> BTreeSet<(String, String)> {
    let mut operations = BTreeSet::new();
    for declaration in source.split(".route(").skip(1) {
        let Some(path) = declaration.split('"').nth(1) else {
            continue;
        };
        // The method routers, up to the route's closing parenthesis.
        let mut depth = 1;
        let end = declaration
            .char_indices()
            .find_map(|(i, c)| {
                match c {
                    '(' => depth += 1,
                    ')' => depth -= 1,
                    _ => {}
                }
                (depth == 0).then_some(i)
            })
            .unwrap_or(declaration.len());
        let methods = &declaration[..end];
        for method in ["get", "post", "put", "delete", "patch"] {
            let called = methods.match_indices(&format!("{method}(")).any(|(i, _)| {
                i == 0
                    || !methods.as_bytes()[i - 1].is_ascii_alphanumeric()
                        && methods.as_bytes()[i - 1] != b'_'
            });
            if called {
                operations.insert((path.to_owned(), method.to_owned()));
            }
        }
    }
    operations
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn routes_are_read_with_their_methods() {
        let routed = routed_operations(
            r#".route("/a", get(x).post(y)).route("/b/{id}", post(get_all))
               .route("/c", axum::routing::put(z).layer(limit(1)))"#,
        );
        let expected: BTreeSet<(String, String)> = [
            ("/a", "get"),
            ("/a", "post"),
            ("/b/{id}", "post"),
            ("/c", "put"),
        ]
        .into_iter()
        .map(|(p, m)| (p.to_owned(), m.to_owned()))
        .collect();
        assert_eq!(routed, expected);
        let documented = documented_operations(
            r#"{"paths": {"/a": {"get": {}, "post": {}}, "/b/{id}": {"post": {}}}}"#,
        );
        assert_eq!(documented.len(), 3);
        assert!(documented.contains(&("/b/{id}".to_owned(), "post".to_owned())));
    }
}
