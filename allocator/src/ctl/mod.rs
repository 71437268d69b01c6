//! `allotctl`, the operator CLI: a thin client of the allocator's HTTP API, plus the offline policy
//! replay. Human tables by default, the API's JSON with `--json`; every failure is one line.

use std::fmt::Write as _;
use std::path::Path;
use std::time::Duration;

use allot_shared::policy::{PolicyBundle, parse_bundle};
use allot_shared::replay::ReplaySample;
use serde_json::Value;

mod render;
mod replay;

pub use allot_net::ClientTls;
pub use render::{Answer, render};
pub use replay::replay_comparison;

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
    /// What it answers.
    pub answer: Answer,
}

/// Performs `call`, returning the response JSON (`Null` for an empty body) or a one-line error.
pub async fn perform(target: &Target, call: Call) -> Result<Value, String> {
    let (_, text) = exchange(target, call).await?;
    Ok(json_or_text(text))
}

/// The answer's text as JSON, or as a JSON string when it is not JSON (`Null` when empty).
fn json_or_text(text: String) -> Value {
    if text.trim().is_empty() {
        Value::Null
    } else {
        serde_json::from_str(&text).unwrap_or(Value::String(text))
    }
}

/// Performs `call`, returning the successful answer's headers and text, or a one-line error.
pub async fn exchange(
    target: &Target,
    call: Call,
) -> Result<(reqwest::header::HeaderMap, String), String> {
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
    let headers = response.headers().clone();
    let text = response
        .text()
        .await
        .map_err(|e| format!("reading the answer from {url}: {e}"))?;
    if status.is_success() {
        return Ok((headers, text));
    }
    let value = json_or_text(text);
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

/// Parses a decision sample file: JSON lines of `{"atMs": ..., "request": {...}}`, sorted by time.
pub fn sample_file(path: &Path) -> Result<Vec<ReplaySample>, String> {
    let text = read_input(path)?;
    samples_from_text(&text, &path.display().to_string())
}

/// Parses decision sample lines read from `source` (named in errors with the line number),
/// sorted by time.
pub fn samples_from_text(text: &str, source: &str) -> Result<Vec<ReplaySample>, String> {
    let mut samples = Vec::new();
    for (number, line) in text.lines().enumerate() {
        if line.trim().is_empty() {
            continue;
        }
        let sample: ReplaySample =
            serde_json::from_str(line).map_err(|e| format!("{source}:{}: {e}", number + 1))?;
        samples.push(sample);
    }
    samples.sort_by_key(|s| s.at_ms);
    Ok(samples)
}
