//! `allotctl`, the operator CLI: a thin client of the allocator's HTTP API, plus the offline policy
//! replay. Human tables by default, the API's JSON with `--json`; every failure is one line.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use allot_shared::keys::Pepper;
use allot_shared::policy::{PolicyBundle, parse_bundle};
use allot_shared::replay::{ReplayReport, ReplaySample, replay};
use serde_json::Value;

pub use allot_net::ClientTls;

/// Largest file `allotctl` reads (bundles, samples), in bytes.
pub const MAX_INPUT_BYTES: u64 = 64 << 20;
/// Deadline of one API call.
pub const CALL_TIMEOUT: Duration = Duration::from_secs(10);

/// Where and as whom to call.
#[derive(Debug, Clone)]
pub struct Target {
    /// The allocator's base URL.
    pub server: String,
    /// The bearer token.
    pub token: Option<String>,
    /// How to reach an https:// allocator (trusted CAs, client certificate).
    pub tls: ClientTls,
}

/// An HTTP call to make.
#[derive(Debug, Clone)]
pub struct Call {
    /// The method.
    pub method: reqwest::Method,
    /// The path and query, starting with `/`.
    pub path: String,
    /// A JSON body (or bundle text), if any.
    pub body: Option<String>,
}

/// Performs `call`, returning the response JSON (`Null` for an empty body) or a one-line error.
pub async fn perform(target: &Target, call: Call) -> Result<Value, String> {
    let client = target
        .tls
        .configure(reqwest::Client::builder().timeout(CALL_TIMEOUT))
        .map_err(|e| e.to_string())?
        .build()
        .map_err(|e| format!("cannot build an HTTP client: {e}"))?;
    let url = format!("{}{}", target.server.trim_end_matches('/'), call.path);
    let mut request = client.request(call.method, &url);
    if let Some(token) = &target.token {
        request = request.bearer_auth(token);
    }
    if let Some(body) = call.body {
        request = request
            .header(reqwest::header::CONTENT_TYPE, "application/json")
            .body(body);
    }
    let response = request
        .send()
        .await
        .map_err(|e| format!("cannot reach {url}: {}", one_line(&e.to_string())))?;
    let status = response.status();
    let text = response
        .text()
        .await
        .map_err(|e| format!("reading the answer from {url}: {e}"))?;
    let value: Value = if text.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or(Value::String(text))
    };
    if status.is_success() {
        return Ok(value);
    }
    let mut message = format!(
        "{} {}",
        status.as_u16(),
        status.canonical_reason().unwrap_or("")
    );
    if let Some(detail) = value.get("detail").and_then(Value::as_str) {
        let _ = write!(message, ": {}", one_line(detail));
    }
    if let Some(field) = value.get("field").and_then(Value::as_str) {
        let _ = write!(message, " (field {field})");
    }
    if let Some(leader) = value.get("leader").and_then(Value::as_str) {
        let _ = write!(message, " (leader: {leader})");
    }
    Err(message)
}

fn one_line(text: &str) -> String {
    text.split_whitespace().collect::<Vec<_>>().join(" ")
}

/// Reads a file of at most [`MAX_INPUT_BYTES`].
pub fn read_input(path: &Path) -> Result<String, String> {
    let size = std::fs::metadata(path)
        .map_err(|e| format!("{}: {e}", path.display()))?
        .len();
    if size > MAX_INPUT_BYTES {
        return Err(format!(
            "{}: larger than {MAX_INPUT_BYTES} bytes",
            path.display()
        ));
    }
    std::fs::read_to_string(path).map_err(|e| format!("{}: {e}", path.display()))
}

/// Parses a bundle file (version and checksum may be absent).
pub fn bundle_file(path: &Path) -> Result<PolicyBundle, String> {
    let text = read_input(path)?;
    parse_bundle(&text)
        .and_then(|draft| draft.into_file_bundle())
        .map_err(|e| format!("{}: {e}", path.display()))
}

/// Parses a decision sample: JSON lines of `{"atMs": ..., "request": {...}}`, sorted by time.
pub fn sample_file(path: &Path) -> Result<Vec<ReplaySample>, String> {
    let text = read_input(path)?;
    let mut samples = Vec::new();
    for (number, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let sample: ReplaySample = serde_json::from_str(line)
            .map_err(|e| format!("{}:{}: {e}", path.display(), number + 1))?;
        samples.push(sample);
    }
    samples.sort_by_key(|s| s.at_ms);
    Ok(samples)
}

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

/// Renders an API answer for humans, by shape.
pub fn render(value: &Value) -> String {
    let mut out = String::new();
    if let Some(pools) = value.get("pools").and_then(Value::as_array) {
        let _ = writeln!(
            out,
            "{:<24} {:<24} {:>10} {:>10} {:>8} {:>8}  regions",
            "tenant", "pool", "limit", "window ms", "chunk", "version"
        );
        for pool in pools {
            let _ = writeln!(
                out,
                "{:<24} {:<24} {:>10} {:>10} {:>8} {:>8}  {}",
                text(&pool["tenant"]),
                text(&pool["pool"]),
                text(&pool["limit"]),
                text(&pool["windowMs"]),
                text(&pool["chunk"]),
                text(&pool["version"]),
                list(&pool["regions"])
            );
        }
        return out;
    }
    if let Some(tokens) = value.get("tokens").and_then(Value::as_array) {
        let _ = writeln!(
            out,
            "{:<22} {:<8} {:<10} {:<6} name",
            "id", "role", "region", "source"
        );
        for token in tokens {
            let _ = writeln!(
                out,
                "{:<22} {:<8} {:<10} {:<6} {}",
                text(&token["id"]),
                text(&token["role"]),
                token["region"].as_str().unwrap_or("*"),
                text(&token["source"]),
                token["name"].as_str().unwrap_or("")
            );
        }
        return out;
    }
    if let Some(token) = value.get("token").and_then(Value::as_str) {
        let _ = writeln!(
            out,
            "minted {} ({}{}); the token is shown only now:\n{token}",
            text(&value["id"]),
            text(&value["role"]),
            value["region"]
                .as_str()
                .map(|r| format!(", region {r}"))
                .unwrap_or_default()
        );
        return out;
    }
    if let Some(entries) = value.get("entries").and_then(Value::as_array) {
        let _ = writeln!(
            out,
            "{:<24} {:<28} {:<15} {:<24} {:>7}  detail",
            "at", "actor", "action", "target", "version"
        );
        for entry in entries {
            let at = entry["atMs"]
                .as_u64()
                .map_or_else(|| "?".to_owned(), allot_shared::window::rfc3339_utc);
            let _ = writeln!(
                out,
                "{:<24} {:<28} {:<15} {:<24} {:>7}  {}",
                at,
                text(&entry["actor"]),
                text(&entry["action"]),
                text(&entry["target"]),
                text(&entry["version"]),
                entry["detail"].as_str().unwrap_or("")
            );
        }
        return out;
    }
    if let Some(windows) = value.get("windows").and_then(Value::as_array) {
        let _ = writeln!(
            out,
            "{:<24} {:>8} {:>8} {:>8} {:>9} {:>10} {:>9} {:>9} {:>7}",
            "window start",
            "limit",
            "granted",
            "spent",
            "stranded",
            "unreported",
            "fallback",
            "overshoot",
            "bound"
        );
        for w in windows {
            let start = w["windowStartMs"]
                .as_u64()
                .map_or_else(|| "?".to_owned(), allot_shared::window::rfc3339_utc);
            let _ = writeln!(
                out,
                "{:<24} {:>8} {:>8} {:>8} {:>9} {:>10} {:>9} {:>9} {:>7}",
                start,
                text(&w["limit"]),
                text(&w["granted"]),
                text(&w["spent"]),
                text(&w["stranded"]),
                text(&w["unreported"]),
                text(&w["fallbackAdmitted"]),
                text(&w["overshoot"]),
                text(&w["bound"])
            );
        }
        return out;
    }
    if let Some(version) = value.get("bundleVersion") {
        let rules = value["rules"].as_array().map_or(0, Vec::len);
        let _ = writeln!(
            out,
            "bundle version {} ({rules} rules), {}, published {}",
            text(version),
            text(&value["checksum"]),
            text(&value["publishedAt"])
        );
        return out;
    }
    if value.get("rollout").is_some() {
        let rollout = &value["rollout"];
        let _ = writeln!(
            out,
            "current v{}, latest v{}{}",
            text(&rollout["current"]),
            text(&rollout["latest"]),
            rollout
                .get("canary")
                .map(|c| format!(
                    ", canary v{} in {}",
                    text(&c["version"]),
                    list(&c["regions"])
                ))
                .unwrap_or_default()
        );
        let _ = writeln!(out, "agents behind: {}", text(&value["agentsBehind"]));
        for agent in value["agents"].as_array().into_iter().flatten() {
            let _ = writeln!(
                out,
                "  {:<8} {:<24} v{}",
                text(&agent["region"]),
                text(&agent["agentId"]),
                text(&agent["version"])
            );
        }
        return out;
    }
    if value.is_null() {
        return "ok\n".to_owned();
    }
    // Single objects (a pool, a grant, a rollout): one "key: value" line per field.
    if let Some(object) = value.as_object() {
        for (key, field) in object {
            let _ = writeln!(out, "{key}: {}", compact(field));
        }
        return out;
    }
    format!("{value}\n")
}

fn text(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        Value::Null => "-".to_owned(),
        other => other.to_string(),
    }
}

fn list(value: &Value) -> String {
    value
        .as_array()
        .map(|items| items.iter().map(text).collect::<Vec<_>>().join(","))
        .unwrap_or_default()
}

fn compact(value: &Value) -> String {
    match value {
        Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn tables_show_pools_and_windows() {
        let pools = json!({ "pools": [{ "tenant": "atlas", "pool": "api", "limit": 1000, "windowMs": 60000,
            "chunk": 100, "version": 3, "regions": ["eu", "us"] }] });
        let text = render(&pools);
        assert!(
            text.lines()
                .nth(1)
                .is_some_and(|l| l.starts_with("atlas") && l.ends_with("eu,us")),
            "{text}"
        );
        let windows = json!({ "windows": [{ "windowStartMs": 0, "limit": 1000, "granted": 900, "spent": 850,
            "stranded": 50, "unreported": 0, "fallbackAdmitted": 0, "overshoot": 0, "bound": 1200 }] });
        let text = render(&windows);
        assert!(text.contains("1970-01-01T00:00:00.000Z"), "{text}");
        assert!(text.contains("1200"), "{text}");
        assert_eq!(render(&Value::Null), "ok\n");
    }
}
