//! Changes: every endpoint that changes the store (pools, policies, tokens) runs through
//! [`run_change`], which runs it to completion and audits it.
//!
//! Once the store has a change, its ledger and audit records must follow, even when the client goes
//! away or the request deadline passes: the change runs on a task of its own. A change whose record
//! could not be written answers 500 "Change applied but not recorded" ([`unrecorded`]), never 503,
//! whose retry would apply it again.

use allot_shared::ids::RecordId;
use axum::response::Response;

use super::ApiState;
use super::errors::ApiError;
use crate::auth::Credential;
use crate::ledger::AuditEntry;

/// What a change did: its answer, and what its audit entry says.
pub struct Changed {
    /// The answer to the caller.
    pub response: Response,
    /// What was changed (`tenant/pool`, a bundle version, a token id).
    pub target: String,
    /// The version it produced (0 when none).
    pub version: u64,
    /// Details for the audit log (never a secret).
    pub detail: serde_json::Value,
}

/// Runs `change` for the authorized `credential` to completion on a task of its own, and writes
/// its audit entry (`action`, the caller as actor).
pub async fn run_change<F, Fut>(
    state: ApiState,
    credential: Credential,
    action: &'static str,
    change: F,
) -> Result<Response, ApiError>
where
    F: FnOnce(ApiState, Credential) -> Fut + Send + 'static,
    Fut: Future<Output = Result<Changed, ApiError>> + Send + 'static,
{
    tokio::spawn(async move {
        let changed = change(state.clone(), credential.clone()).await?;
        audit(
            &state,
            &credential,
            action,
            changed.target,
            changed.version,
            changed.detail,
        )
        .await?;
        Ok(changed.response)
    })
    .await
    .unwrap_or_else(|error| {
        Err(ApiError::internal(
            "Internal error",
            format!("the change task failed: {error}"),
        ))
    })
}

/// The answer when a change reached the store but its ledger or audit record did not: logged at
/// error level with what is missing, counted in `allot_audit_write_failures_total`, and answered
/// 500 (not 503: a retry would apply the change again).
pub fn unrecorded(
    what: &str,
    action: &str,
    target: &str,
    error: impl std::fmt::Display,
) -> ApiError {
    tracing::error!(%error, action, target, what, "change applied but not recorded");
    metrics::counter!(crate::metrics::AUDIT_WRITE_FAILURES).increment(1);
    ApiError::internal(
        "Change applied but not recorded",
        format!("the change was applied but its {what} was not written: {error}"),
    )
}

/// A ledger record's id (a pool change): a UUID v7 of now.
pub fn record_id(now_ms: u64) -> RecordId {
    RecordId::from_parts(now_ms, rand::random::<u128>())
}

/// An audit entry's id that sorts after every earlier one of this process, even within one
/// millisecond or after the clock stepped back: RFC 9562's method 1, a 12-bit counter in `rand_a`
/// that restarts each millisecond.
pub fn audit_entry_id(now_ms: u64) -> RecordId {
    static LAST: std::sync::Mutex<(u64, u16)> = std::sync::Mutex::new((0, 0));
    let (ms, counter) = {
        let mut last = LAST
            .lock()
            .unwrap_or_else(std::sync::PoisonError::into_inner);
        if now_ms > last.0 {
            *last = (now_ms, 0);
        } else if last.1 < 0xFFF {
            last.1 += 1;
        } else {
            // 4,096 entries in one millisecond: borrow the next one.
            *last = (last.0 + 1, 0);
        }
        *last
    };
    let random = (u128::from(counter) << 64) | u128::from(rand::random::<u64>());
    RecordId::from_parts(ms, random)
}

/// Writes one audit entry. The change is already applied when this runs: a failure is
/// [`unrecorded`], so nothing is silently unaudited.
async fn audit(
    state: &ApiState,
    credential: &Credential,
    action: &str,
    target: String,
    version: u64,
    detail: serde_json::Value,
) -> Result<(), ApiError> {
    let at_ms = state.clock.now_ms();
    let entry = AuditEntry {
        entry_id: audit_entry_id(at_ms).to_string(),
        at_ms,
        actor: credential.actor(),
        action: action.to_owned(),
        target,
        version,
        detail: detail.to_string(),
    };
    state
        .ledger
        .record_audit(&entry)
        .await
        .map_err(|error| unrecorded("audit entry", action, &entry.target, error))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn audit_entry_ids_sort_in_write_order() {
        // Many in one millisecond, then the clock stepping back: still increasing.
        let mut ids: Vec<String> = (0..5_000)
            .map(|_| audit_entry_id(1_000_000).to_string())
            .collect();
        ids.push(audit_entry_id(999_000).to_string());
        ids.push(audit_entry_id(2_000_000).to_string());
        assert!(ids.windows(2).all(|pair| pair[0] < pair[1]));
    }
}
