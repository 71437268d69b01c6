//! Give-backs: a lease's holder ends it and says what it left unspent; the pool's worker takes
//! that back into the lease's window (so it can be granted again) once per lease, under the
//! guards of a grant and the absence of the lease's mark in the store.

use allot_shared::ids::{LeaseId, PoolId, RegionId, TenantId};
use allot_shared::lease::{GRANT_RECORD_MAX_LIFETIME_MS, returnable_tokens};
use allot_shared::window::Window;
use tokio::sync::oneshot;

use super::{GRANT_DEADLINE, GrantFailure, Grantor, Job, PoolWorker, RECENT_GRANTS_PER_POOL};
use crate::leader::{Role, current_leader};
use crate::pools::{get_grant, return_key};

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
    pub(super) reply: oneshot::Sender<Result<u64, GrantFailure>>,
}

/// A return whose grant record was found: what the lease was granted, when, and in which
/// window; with the same lease's other give-backs queued in the batch, answered alike (a lease
/// is taken back from once, never once per line that names it).
pub(super) struct RecordedReturn {
    pub(super) pending: PendingReturn,
    pub(super) repeats: Vec<oneshot::Sender<Result<u64, GrantFailure>>>,
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
        for repeat in self.repeats {
            let _ = repeat.send(result.clone());
        }
        let _ = self.pending.reply.send(result);
    }

    /// What may be taken back at `now_ms`: what the line gives, within the grant less the spend,
    /// while the lease's window runs and, in windows longer than a record is kept, while the
    /// record is surely kept (so its mark, which outlives its commit as long, is too: a line
    /// replayed later can never find the record without the mark).
    pub(super) fn returnable_at(&self, now_ms: u64) -> u64 {
        let capped = self.window.length_ms() > GRANT_RECORD_MAX_LIFETIME_MS;
        let record_young = now_ms
            < self
                .issued_at_ms
                .saturating_add(GRANT_RECORD_MAX_LIFETIME_MS);
        if now_ms >= self.window.end_ms || (capped && !record_young) {
            return 0;
        }
        let lease = &self.pending.lease;
        returnable_tokens(
            self.granted_tokens,
            lease.spent_tokens,
            lease.unspent_tokens,
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
        if !matches!(*self.shared.role.borrow(), Role::Leader(_)) {
            return Err(GrantFailure::NotLeader(
                current_leader(&*self.shared.kv).await.ok().flatten(),
            ));
        }
        let (reply, answer) = oneshot::channel();
        self.enqueue(
            (tenant.clone(), pool.clone()),
            Job::Return(PendingReturn { lease, reply }),
        )?;
        match tokio::time::timeout(GRANT_DEADLINE, answer).await {
            Ok(Ok(result)) => result,
            _ => Err(GrantFailure::Unavailable(
                "no answer from the pool worker in time".to_owned(),
            )),
        }
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

    /// The grant record of each return's lease (remembered, or read from the store). A lease with
    /// no record of its region's (its window's records are gone, or it names another region's
    /// lease) gives nothing back and is answered at once.
    pub(super) async fn with_records(
        &mut self,
        returns: Vec<PendingReturn>,
    ) -> Vec<RecordedReturn> {
        let mut recorded: Vec<RecordedReturn> = Vec::with_capacity(returns.len());
        for pending in returns {
            let lease_id = pending.lease.lease_id;
            if let Some(first) = recorded.iter_mut().find(|r| r.lease_id() == lease_id) {
                first.repeats.push(pending.reply);
                continue;
            }
            let record = match self.recent.get(&lease_id) {
                Some(record) => Ok(Some(record.clone())),
                None => get_grant(&*self.shared.kv, &self.tenant, &self.pool, &lease_id).await,
            };
            match record {
                Ok(Some(record)) if record.region == pending.lease.region => {
                    recorded.push(RecordedReturn {
                        repeats: Vec::new(),
                        granted_tokens: record.granted_tokens,
                        issued_at_ms: record.issued_at_ms,
                        window: Window {
                            start_ms: record.window_start_ms,
                            end_ms: record.window_end_ms,
                        },
                        pending,
                    });
                }
                Ok(_) => {
                    let _ = pending.reply.send(Ok(0));
                }
                Err(failure) => {
                    let _ = pending.reply.send(Err(failure.into()));
                }
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
        let key = return_key(&self.tenant, &self.pool, &lease_id);
        let Some(stored) = self.shared.kv.get(&key).await? else {
            return Ok(None);
        };
        serde_json::from_slice(&stored.value)
            .map(Some)
            .map_err(|_| {
                GrantFailure::Unavailable(format!("stored value at {key} is not readable"))
            })
    }

    pub(super) fn remember_return(&mut self, lease_id: LeaseId, taken: u64) {
        if self.recent_returns.len() >= RECENT_GRANTS_PER_POOL {
            // As for grants: the store's mark is the authority.
            self.recent_returns.clear();
        }
        self.recent_returns.insert(lease_id, taken);
    }
}
