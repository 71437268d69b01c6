//! The sampled decision log: JSON lines for audits, offline overshoot estimates and
//! `allotctl policies replay`.
//!
//! Allowed decisions are sampled at a low rate and denials and fallback decisions at a high one (both
//! configurable). A line carries the decision and the request with its principal replaced by the
//! keyed hash: never a raw user id, API key or address. Lines go through a bounded queue to a writer
//! task; when the queue is full or the file reached its size cap, lines are dropped and counted
//! (telemetry, not the ledger: I12).

use std::io::Write as _;
use std::path::PathBuf;

use allot_shared::contract::{AdmissionRequest, Decision};
use allot_shared::keys::{IpPrefixes, Pepper, principal_hash};
use serde::Serialize;
use tokio::sync::mpsc;

/// Lines waiting for the writer.
pub const QUEUE_LINES: usize = 10_000;
/// Metric: lines dropped (queue full or file at its cap).
pub const DROPPED: &str = "allot_agent_decision_log_dropped_total";

/// Where and how much to log.
#[derive(Debug, Clone)]
pub struct DecisionLogConfig {
    /// The JSON-lines file (appended to).
    pub path: PathBuf,
    /// Share of allowed decisions logged, in [0, 1].
    pub allowed_rate: f64,
    /// Share of denied and fallback decisions logged, in [0, 1].
    pub denied_rate: f64,
    /// The file stops growing at this size; later lines are dropped and counted.
    pub max_bytes: u64,
}

#[derive(Serialize)]
#[serde(rename_all = "camelCase")]
struct Line<'a> {
    at_ms: u64,
    request: serde_json::Value,
    decision: &'a Decision,
}

/// A handle to the log's writer.
#[derive(Debug, Clone)]
pub struct DecisionLog {
    lines: mpsc::Sender<String>,
    allowed_rate: f64,
    denied_rate: f64,
    pepper: Pepper,
    prefixes: IpPrefixes,
}

impl DecisionLog {
    /// Opens the file and starts the writer task.
    pub fn open(
        config: DecisionLogConfig,
        pepper: Pepper,
        prefixes: IpPrefixes,
    ) -> std::io::Result<Self> {
        let mut file = std::fs::OpenOptions::new()
            .create(true)
            .append(true)
            .open(&config.path)?;
        let mut written = file.metadata().map(|m| m.len()).unwrap_or(0);
        let (lines, mut queue) = mpsc::channel::<String>(QUEUE_LINES);
        let max_bytes = config.max_bytes;
        tokio::task::spawn_blocking(move || {
            while let Some(line) = queue.blocking_recv() {
                let size = line.len() as u64 + 1;
                if written + size > max_bytes {
                    metrics::counter!(DROPPED).increment(1);
                    continue;
                }
                if writeln!(file, "{line}").is_ok() {
                    written += size;
                } else {
                    metrics::counter!(DROPPED).increment(1);
                }
            }
            let _ = file.flush();
        });
        Ok(Self {
            lines,
            allowed_rate: config.allowed_rate.clamp(0.0, 1.0),
            denied_rate: config.denied_rate.clamp(0.0, 1.0),
            pepper,
            prefixes,
        })
    }

    /// Samples and queues one decision.
    pub fn record(&self, at_ms: u64, request: &AdmissionRequest, decision: &Decision) {
        // A shadow or soft rule's would-be denial is sampled like a denial: it is what an operator
        // dark-launching a limit reads the log for.
        let rate = if decision.allowed && !decision.fallback && decision.violations.is_empty() {
            self.allowed_rate
        } else {
            self.denied_rate
        };
        if rate <= 0.0 || (rate < 1.0 && rand::random::<f64>() >= rate) {
            return;
        }
        let hash = principal_hash(
            &self.pepper,
            request.principal.kind,
            &request.principal.id,
            self.prefixes,
        );
        let mut keyed = request.clone();
        // The principal is logged by its keyed hash only; the API key id likewise.
        keyed.principal.id = hash.to_string();
        keyed.principal.api_key_id = request.principal.api_key_id.as_ref().map(|key| {
            principal_hash(
                &self.pepper,
                allot_shared::contract::PrincipalType::ApiKey,
                key,
                self.prefixes,
            )
            .to_string()
        });
        let line = Line {
            at_ms,
            request: serde_json::to_value(&keyed).unwrap_or_default(),
            decision,
        };
        let Ok(text) = serde_json::to_string(&line) else {
            return;
        };
        if self.lines.try_send(text).is_err() {
            metrics::counter!(DROPPED).increment(1);
        }
    }
}
