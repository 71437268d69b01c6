//! # allot-shared: the pure quota core
//!
//! Everything a quota decision needs, as plain data and pure functions of `(state, now_ms, arguments)`.
//! The Redis scripts, the in-process stores, the allocator, the agents and the simulator all call into
//! this crate or are checked against it, so there is exactly one definition of "correct".
//!
//! ## Units
//! - Token amounts inside rules are **millitokens** (`1 token = 1_000 millitokens`), integers.
//! - Pool quotas handed out by the allocator are whole **tokens** (one token admits one unit of cost).
//! - Time is integer **epoch milliseconds** (`_ms`), passed in by the caller. This crate never reads a clock.
//!
//! ## Architecture invariants
//! - No I/O, no async runtime, no clock: every function here is deterministic in its arguments.
//! - Nothing here panics on input: parsing and validation return errors that name the offending field.
//!
//! ## Map
//! - [`clock`]: the clock seam (a trait and a manual clock; no clock is read here).
//! - [`ids`]: validated identifiers (tenant, pool, region, agent, lease, record, epoch, decision, rule,
//!   route group).
//! - [`limit`]: the per-key algorithms (token bucket, GCRA, fixed window, sliding log, sliding counter,
//!   concurrency semaphore) and all-or-nothing evaluation of several rules.
//! - [`window`] and [`lease`]: quota windows, lease grants clamped to their window, and the overshoot bound.
//! - [`contract`]: the admission request and decision, and their HTTP mapping.
//! - [`policy`]: policy bundles, their validation, canonical checksum and rule matching.
//! - [`keys`]: the store key model and keyed principal hashes.
//! - [`shards`]: which shard decides a pool, and which allocator replica should lead each shard.
//! - [`replay`]: offline replay of recorded requests against a bundle (denial rate per rule).
//! - [`wire`]: every message that crosses the allocator-agent link (terms, grants, reports, agent
//!   status), defined once for both sides.

pub mod clock;
pub mod contract;
pub mod ids;
pub mod json_number;
pub mod keys;
pub mod lease;
pub mod limit;
pub mod overrides;
pub mod policy;
pub mod replay;
pub mod shards;
pub mod window;
pub mod wire;

/// A value refused by validation beyond its type, naming the field at fault as the wire names it
/// (a JSON path such as `principal.id`, `windowMs` or `leases[2].spent`). Every layer's validation
/// answers with it, and the APIs turn it into problem+json naming the field.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{field}: {message}")]
pub struct FieldError {
    /// The field at fault.
    pub field: String,
    /// What is wrong with it.
    pub message: String,
}

impl FieldError {
    /// `field` is at fault: `message`.
    pub fn new(field: impl Into<String>, message: impl Into<String>) -> Self {
        Self {
            field: field.into(),
            message: message.into(),
        }
    }

    /// The error of a document that did not deserialize, at `path` (as `serde_path_to_error`
    /// writes it; `.` for the top) with serde's `message`: a missing or unknown field is named
    /// itself (`window.timeZone`), anything else by its path; `whole` names the document when
    /// nothing narrower is known (`body`, `query`).
    pub fn from_serde(path: &str, message: String, whole: &str) -> Self {
        let top = matches!(path, "." | "?" | "");
        let name_in = |prefix: &str| message.strip_prefix(prefix)?.split('`').next();
        // The path of a missing field stops at its parent; that of an unknown one includes it.
        let field = match (name_in("missing field `"), name_in("unknown field `"), top) {
            (Some(name), _, false) => format!("{path}.{name}"),
            (Some(name), _, true) | (None, Some(name), true) => name.to_owned(),
            (None, None, true) => whole.to_owned(),
            (None, _, false) => path.to_owned(),
        };
        Self { field, message }
    }

    /// A JSON document of type `T` from `bytes`, or the error naming the field at fault (`whole`
    /// when nothing narrower is known, and for anything after the document). Tracking the path
    /// allocates a string per field, and only a document that fails needs it: a document is
    /// parsed plainly, and one that fails is parsed again with its path to name the field.
    pub fn parse_json<T: serde::de::DeserializeOwned>(
        bytes: &[u8],
        whole: &str,
    ) -> Result<T, Self> {
        if let Ok(parsed) = serde_json::from_slice(bytes) {
            return Ok(parsed);
        }
        let mut deserializer = serde_json::Deserializer::from_slice(bytes);
        let parsed = serde_path_to_error::deserialize(&mut deserializer).map_err(|error| {
            let path = error.path().to_string();
            Self::from_serde(&path, error.into_inner().to_string(), whole)
        })?;
        deserializer
            .end()
            .map_err(|error| Self::new(whole, error.to_string()))?;
        Ok(parsed)
    }

    /// A URL query string (`a=1&b=x`, without the `?`) as `T`, or the error naming the parameter
    /// at fault: a value that does not parse by its own name, a missing or unknown one by its
    /// name, `whole` otherwise.
    pub fn parse_query<T: serde::de::DeserializeOwned>(text: &str, whole: &str) -> Result<T, Self> {
        let deserializer =
            serde_urlencoded::Deserializer::new(form_urlencoded::parse(text.as_bytes()));
        serde_path_to_error::deserialize(deserializer).map_err(|error| {
            let path = error.path().to_string();
            Self::from_serde(&path, error.into_inner().to_string(), whole)
        })
    }
}

/// Millitokens in one token.
pub const MILLITOKENS_PER_TOKEN: u64 = 1_000;

/// Largest value allowed for any rule parameter (capacity, refill, period, cost, slack): 2^40.
///
/// Together with [`MAX_CAPACITY_TIMES_PERIOD`] it keeps every product the algorithms form below 2^53,
/// so the Lua scripts (whose numbers are IEEE doubles) compute exactly what this crate computes.
pub const MAX_RULE_PARAMETER: u64 = 1 << 40;

/// Largest allowed `capacity_millitokens * period_ms` of a rate rule: 2^52.
pub const MAX_CAPACITY_TIMES_PERIOD: u64 = 1 << 52;

#[cfg(test)]
mod tests {
    use super::FieldError;

    #[derive(Debug, PartialEq, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Document {
        limit: u64,
        window: Window,
    }

    #[derive(Debug, PartialEq, serde::Deserialize)]
    #[serde(rename_all = "camelCase")]
    struct Window {
        time_zone: String,
    }

    #[derive(Debug, PartialEq, serde::Deserialize)]
    #[serde(deny_unknown_fields)]
    struct Query {
        from: u64,
        limit: Option<u64>,
        prefix: Option<String>,
    }

    #[test]
    fn queries_parse_or_name_the_parameter_at_fault() {
        let parse = |text: &str| FieldError::parse_query::<Query>(text, "query");
        assert_eq!(
            parse("from=5&prefix=acme%2Fapi"),
            Ok(Query {
                from: 5,
                limit: None,
                prefix: Some("acme/api".to_owned())
            })
        );
        let field = |text: &str| parse(text).expect_err(text).field;
        assert_eq!(field("from=5&limit=x"), "limit", "a value by its own name");
        assert_eq!(field("from=-1"), "from");
        assert_eq!(field("limit=1"), "from", "a missing one");
        assert_eq!(field("from=1&colour=red"), "colour", "an unknown one");
    }

    #[test]
    fn json_documents_parse_or_name_the_field_at_fault() {
        let parse = |text: &str| FieldError::parse_json::<Document>(text.as_bytes(), "body");
        assert_eq!(
            parse(r#" {"limit": 5, "window": {"timeZone": "UTC"}} "#),
            Ok(Document {
                limit: 5,
                window: Window {
                    time_zone: "UTC".to_owned()
                }
            })
        );
        let field = |text: &str| parse(text).expect_err(text).field;
        assert_eq!(field(r#"{"limit": "5", "window": {}}"#), "limit");
        assert_eq!(field(r#"{"limit": 5, "window": {}}"#), "window.timeZone");
        assert_eq!(field(r#"{"limit": 5}"#), "window");
        assert_eq!(
            field(r#"{"limit": 5, "window": {"timeZone": "UTC"}, "colour": 1}"#),
            "colour"
        );
        assert_eq!(
            field(r#"{"limit": 5, "window": {"timeZone": "UTC"}} {}"#),
            "body",
            "anything after the document"
        );
        assert_eq!(field("{"), "body");
    }

    #[test]
    fn serde_errors_name_the_missing_or_unknown_field() {
        let field =
            |path: &str, message: &str| FieldError::from_serde(path, message.into(), "body").field;
        assert_eq!(field(".", "missing field `limit`"), "limit");
        assert_eq!(
            field("window", "missing field `timeZone`"),
            "window.timeZone"
        );
        assert_eq!(
            field(".", "unknown field `colour`, expected one of `a`"),
            "colour"
        );
        assert_eq!(
            field("surprise", "unknown field `surprise`, expected `a`"),
            "surprise"
        );
        assert_eq!(field("limit", "invalid type: string"), "limit");
        assert_eq!(field(".", "expected value at line 1"), "body");
    }
}
