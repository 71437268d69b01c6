//! Give-backs: a lease's holder ends it and says what it left unspent; the pool's worker takes
//! that back into the lease's window (so it can be granted again) once per lease, under the
//! guards of a grant and the absence of the lease's mark in the store.

use allot_shared::ids::{LeaseId, PoolId, RegionId, TenantId};
use allot_shared::lease::returnable_tokens_at;
use allot_shared::window::Window;
use tokio::sync::oneshot;

use std::collections::HashMap;

use super::{GrantFailure, Grantor, Job, PoolWorker, RECENT_GRANTS_PER_POOL};
use crate::pools::{GrantRecord, get_grants, get_return};

/// What a lease's holder gives back when it ends the lease (a final report line): the tokens it
/// left unspent and will never spend.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LeaseReturn {
    /// The lease.
    pub lease_id: LeaseId,
    /// The region that holds it (a lease of another region gives nothing back).
    pub region: RegionId,
    /// Tokens spent from it, as its final line says.
    pub spent_tokens: u64,
    /// Tokens it left unspent, as its final line says.
    pub unspent_tokens: u64,
}

/// A return waiting for its pool's worker, and where to say how many tokens were taken back.
pub(super) struct PendingReturn {
    pub(super) lease: LeaseReturn,
    pub(super) reply: Reply,
}

/// Where a give-back's answer goes: how many tokens were taken back.
pub(super) type Reply = oneshot::Sender<Result<u64, GrantFailure>>;

/// Answers a give-back and the repeats of its lease alike.
fn answer_all(reply: Reply, repeats: Vec<Reply>, result: Result<u64, GrantFailure>) {
    for repeat in repeats {
        let _ = repeat.send(result.clone());
    }
    let _ = reply.send(result);
}

/// A return whose grant record was found: what the lease was granted, when, and in which
/// window; with the same lease's other give-backs queued in the batch, answered alike (a lease
/// is taken back from once, never once per line that names it).
pub(super) struct RecordedReturn {
    pub(super) pending: PendingReturn,
    pub(super) repeats: Vec<Reply>,
    pub(super) granted_tokens: u64,
    pub(super) issued_at_ms: u64,
    pub(super) window: Window,
}

impl RecordedReturn {
    /// The lease.
    pub(super) fn lease_id(&self) -> LeaseId {
        self.pending.lease.lease_id
    }

    /// Answers this give-back and its repeats.
    pub(super) fn answer(self, result: Result<u64, GrantFailure>) {
        answer_all(self.pending.reply, self.repeats, result);
    }

    /// What may be taken back at `now_ms` ([`returnable_tokens_at`]).
    pub(super) fn returnable_at(&self, now_ms: u64) -> u64 {
        let lease = &self.pending.lease;
        returnable_tokens_at(
            self.granted_tokens,
            self.issued_at_ms,
            self.window,
            lease.spent_tokens,
            lease.unspent_tokens,
            now_ms,
        )
    }
}

impl Grantor {
    /// Takes back what a lease's holder left unspent at its end and will never spend, so it can be
    /// granted again in the lease's window: how many tokens were (0 when the lease's window is
    /// over, its record is gone, or it gave back nothing). Once per lease id: asking again
    /// answers what was taken back then, as long as the window's records are kept.
    pub async fn take_back(
        &self,
        tenant: &TenantId,
        pool: &PoolId,
        lease: LeaseReturn,
    ) -> Result<u64, GrantFailure> {
        self.ask_worker((tenant.clone(), pool.clone()), |reply| {
            Job::Return(PendingReturn { lease, reply })
        })
        .await
    }
}

impl PoolWorker {
    /// Answers returns of leases this worker took back recently.
    pub(super) fn answer_known_returns(&self, returns: Vec<RecordedReturn>) -> Vec<RecordedReturn> {
        let mut rest = Vec::with_capacity(returns.len());
        for recorded in returns {
            match self.recent_returns.get(&recorded.lease_id()) {
                Some(&taken) => recorded.answer(Ok(taken)),
                None => rest.push(recorded),
            }
        }
        rest
    }

    /// The grant record of each return's lease (remembered, or read from the store, all in one
    /// read), the lease's repeats in the batch with it. A lease with no record of its region's
    /// (its window's records are gone, or it names another region's lease) gives nothing back
    /// and is answered at once.
    pub(super) async fn with_records(
        &mut self,
        returns: Vec<PendingReturn>,
    ) -> Vec<RecordedReturn> {
        let mut leases: Vec<(PendingReturn, Vec<Reply>)> = Vec::with_capacity(returns.len());
        for pending in returns {
            match leases
                .iter_mut()
                .find(|(first, _)| first.lease.lease_id == pending.lease.lease_id)
            {
                Some((_, repeats)) => repeats.push(pending.reply),
                None => leases.push((pending, Vec::new())),
            }
        }
        let unknown: Vec<(TenantId, PoolId, LeaseId)> = leases
            .iter()
            .map(|(pending, _)| pending.lease.lease_id)
            .filter(|lease_id| !self.recent.contains_key(lease_id))
            .map(|lease_id| (self.tenant.clone(), self.pool.clone(), lease_id))
            .collect();
        let read = if unknown.is_empty() {
            Ok(Vec::new())
        } else {
            get_grants(&*self.shared.kv, &unknown).await
        };
        let mut records: HashMap<LeaseId, GrantRecord> = match read {
            Ok(found) => found
                .into_iter()
                .map(|(_, _, record)| (record.lease_id, record))
                .collect(),
            Err(failure) => {
                let failure = GrantFailure::from(failure);
                // The remembered ones can still be decided; the others cannot be known.
                let (known, unread): (Vec<_>, Vec<_>) = leases
                    .into_iter()
                    .partition(|(pending, _)| self.recent.contains_key(&pending.lease.lease_id));
                for (pending, repeats) in unread {
                    answer_all(pending.reply, repeats, Err(failure.clone()));
                }
                leases = known;
                HashMap::new()
            }
        };
        let mut recorded = Vec::with_capacity(leases.len());
        for (pending, repeats) in leases {
            let lease_id = pending.lease.lease_id;
            let record = records
                .remove(&lease_id)
                .or_else(|| self.recent.get(&lease_id).cloned())
                .filter(|record| record.region == pending.lease.region);
            match record {
                Some(record) => recorded.push(RecordedReturn {
                    repeats,
                    granted_tokens: record.granted_tokens,
                    issued_at_ms: record.issued_at_ms,
                    window: Window {
                        start_ms: record.window_start_ms,
                        end_ms: record.window_end_ms,
                    },
                    pending,
                }),
                None => answer_all(pending.reply, repeats, Ok(0)),
            }
        }
        recorded
    }

    /// Answers returns whose mark exists in the store (taken back by an earlier attempt whose
    /// answer was lost, or by another leader): what the mark says was taken back.
    pub(super) async fn returns_from_store(
        &mut self,
        returns: Vec<RecordedReturn>,
    ) -> Vec<RecordedReturn> {
        let mut rest = Vec::with_capacity(returns.len());
        for recorded in returns {
            match self.stored_return(recorded.lease_id()).await {
                Ok(Some(taken)) => {
                    self.recent_returns.insert(recorded.lease_id(), taken);
                    recorded.answer(Ok(taken));
                }
                Ok(None) => rest.push(recorded),
                Err(failure) => recorded.answer(Err(failure)),
            }
        }
        rest
    }

    /// What the store's mark says was taken back of `lease_id` (`None`: nothing yet).
    pub(super) async fn stored_return(
        &self,
        lease_id: LeaseId,
    ) -> Result<Option<u64>, GrantFailure> {
        Ok(get_return(&*self.shared.kv, &self.tenant, &self.pool, &lease_id).await?)
    }

    pub(super) fn remember_return(&mut self, lease_id: LeaseId, taken: u64) {
        if self.recent_returns.len() >= RECENT_GRANTS_PER_POOL {
            // As for grants: the store's mark is the authority.
            self.recent_returns.clear();
        }
        self.recent_returns.insert(lease_id, taken);
    }
}
