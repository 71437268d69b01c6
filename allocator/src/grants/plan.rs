//! A batch's decisions, pure: the asks of one pool decided in order on its window, as one leader
//! would decide them one at a time. The commit is the worker's.

use std::collections::HashMap;

use allot_shared::ids::LeaseId;
use allot_shared::lease::{GrantRequest, LeaseClamping, PoolConfig, PoolWindowState, grant};

use super::GrantFailure;
use crate::pools::GrantRecord;

/// The decisions for one batch, before commit.
#[derive(Debug)]
pub struct BatchPlan {
    /// One answer per request, in order.
    pub answers: Vec<Result<GrantRecord, GrantFailure>>,
    /// The grant records to create (granted > 0, one per distinct lease id).
    pub new_records: Vec<GrantRecord>,
    /// The window after the batch.
    pub window: Option<PoolWindowState>,
}

/// Decides a batch in order, as one leader would one request at a time. A lease id repeated inside the
/// batch gets the first occurrence's answer and is granted once. Pure: the commit is the caller's.
pub fn plan_batch<'a>(
    config: &PoolConfig,
    window: Option<&PoolWindowState>,
    epoch: allot_shared::ids::Epoch,
    now_ms: u64,
    clamping: LeaseClamping,
    requests: impl Iterator<Item = &'a GrantRequest>,
) -> BatchPlan {
    let mut window = window.cloned();
    let mut answers = Vec::new();
    let mut new_records = Vec::new();
    let mut first_answer: HashMap<LeaseId, usize> = HashMap::new();
    for request in requests {
        if let Some(&first) = first_answer.get(&request.lease_id) {
            let repeated = answers
                .get(first)
                .cloned()
                .unwrap_or(Err(GrantFailure::Unavailable(
                    "inconsistent batch".to_owned(),
                )));
            answers.push(repeated);
            continue;
        }
        first_answer.insert(request.lease_id, answers.len());
        let answer = match grant(config, window.as_ref(), epoch, now_ms, request, clamping) {
            Ok((granted, next)) => {
                let record = GrantRecord::from(&granted);
                if record.granted_tokens > 0 {
                    new_records.push(record.clone());
                    window = Some(next);
                }
                Ok(record)
            }
            Err(allot_shared::lease::GrantError::RegionNotInPool(region)) => {
                Err(GrantFailure::RegionNotInPool(region.to_string()))
            }
            Err(allot_shared::lease::GrantError::ZeroWant) => Err(GrantFailure::ZeroWant),
        };
        answers.push(answer);
    }
    BatchPlan {
        answers,
        new_records,
        window,
    }
}
