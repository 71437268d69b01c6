//! The allocator's side as it ships: a lease id already granted answered from its record; asks
//! queued together decided by `plan_batch` on the leader's cached window and committed only while
//! the fence and the window's revision hold.

use allot_allocator::grants::{LeaseReturn, plan_batch};
use allot_allocator::pools::GrantRecord;
use allot_shared::lease::{GrantRequest, LeaseClamping, PoolConfig, returnable_tokens_at};
use allot_shared::window::Window;

use super::state::{Allocator, Leader, Reply};
use super::{LeaseModel, Variant};

impl Allocator {
    /// The grant worker's steps for one ask at `leader`, at `now_ms`.
    pub(super) fn serve(
        &mut self,
        model: &LeaseModel,
        leader: usize,
        request: &GrantRequest,
        now_ms: u64,
    ) -> Reply {
        self.serve_batch(model, leader, std::slice::from_ref(request), now_ms)
            .pop()
            .unwrap_or(Reply::NotLeader)
    }

    /// The grant worker's steps for asks queued together at `leader`, at `now_ms`: a lease id
    /// already granted is answered from its record (idempotency across batches, which lives in
    /// the store); the rest are decided in one [`plan_batch`] on the leader's cached window and
    /// committed in one transaction, which succeeds only while the leader's fence and the
    /// window's revision still hold (etcd's compare). A commit that fails the revision reloads
    /// the cache and decides again; a deposed leader answers "not leader". One reply per ask.
    ///
    /// Long by design: it follows the allocator's grant worker step for step (recorded lease ids
    /// answered first, one plan, the fence and revision compare, then commit, or reload and decide
    /// again), each step with the variant that breaks it beside it; split otherwise than the worker
    /// it models, the model could no longer be read against the worker.
    pub(super) fn serve_batch(
        &mut self,
        model: &LeaseModel,
        leader: usize,
        requests: &[GrantRequest],
        now_ms: u64,
    ) -> Vec<Reply> {
        let mut replies: Vec<Option<Reply>> = requests
            .iter()
            .map(|request| {
                self.records
                    .get(&request.lease_id)
                    .map(|record| Reply::Grant(record.answer(now_ms)))
            })
            .collect();
        let new: Vec<usize> = (0..requests.len())
            .filter(|&i| replies[i].is_none())
            .collect();
        let fill = |replies: Vec<Option<Reply>>, rest: &mut dyn FnMut(usize) -> Reply| {
            replies
                .into_iter()
                .enumerate()
                .map(|(i, reply)| reply.unwrap_or_else(|| rest(i)))
                .collect::<Vec<Reply>>()
        };
        if new.is_empty() {
            return fill(replies, &mut |_| Reply::NotLeader);
        }
        let fence = model.config.variant != Variant::FenceSkipped;
        let pool = model.granting_pool();
        // The second attempt decides on a freshly read window, so it commits or is deposed.
        for _ in 0..2 {
            let Some(node) = self.leaders.get(leader) else {
                return fill(replies, &mut |_| Reply::NotLeader);
            };
            let plan = match model.config.variant {
                Variant::BatchDecidedApart => {
                    decided_apart(&pool, node, now_ms, model.clamping(), &new, requests)
                }
                _ => plan_batch(
                    &pool,
                    node.window.as_ref(),
                    node.epoch,
                    now_ms,
                    model.clamping(),
                    new.iter().map(|&i| &requests[i]),
                ),
            };
            let deposed = node.epoch != self.epoch;
            // What the window had left is shown to callers and decides nothing; it differs
            // only with the order of grants, which would split one state into many.
            let answer_of = |answer: &Result<GrantRecord, _>| match answer {
                Ok(record) => Reply::Grant(
                    GrantRecord {
                        ungranted_tokens: None,
                        ..record.clone()
                    }
                    .answer(now_ms),
                ),
                Err(_) => Reply::Refused,
            };
            if plan.new_records.is_empty() {
                if deposed {
                    return fill(replies, &mut |_| Reply::NotLeader);
                }
                for (&i, answer) in new.iter().zip(&plan.answers) {
                    replies[i] = Some(answer_of(answer));
                }
                return fill(replies, &mut |_| Reply::Refused);
            }
            let compare_holds = !deposed && node.revision == self.window_revision;
            if compare_holds || !fence {
                self.window_revision += 1;
                self.window = plan.window.clone();
                for record in &plan.new_records {
                    let record = GrantRecord {
                        ungranted_tokens: None,
                        ..record.clone()
                    };
                    self.records.insert(record.lease_id, record);
                }
                let revision = self.window_revision;
                if let Some(node) = self.leaders.get_mut(leader) {
                    node.window = plan.window.clone();
                    node.revision = revision;
                }
                for (&i, answer) in new.iter().zip(&plan.answers) {
                    replies[i] = Some(answer_of(answer));
                }
                return fill(replies, &mut |_| Reply::Refused);
            }
            if deposed {
                return fill(replies, &mut |_| Reply::NotLeader);
            }
            let (window, revision) = (self.window.clone(), self.window_revision);
            if let Some(node) = self.leaders.get_mut(leader) {
                node.window = window;
                node.revision = revision;
            }
        }
        fill(replies, &mut |_| Reply::NotLeader)
    }
}

impl Allocator {
    /// The grant worker's steps for a lease's give-back at `leader`: a lease whose tokens the
    /// store's mark says were taken back, with no record of the giving region's, or of a window
    /// that has ended, changes nothing; otherwise what it may give back is taken back on the leader's cached window and
    /// committed with the mark only while the fence and the window's revision hold (a commit that
    /// fails the revision reloads the cache and tries again; a deposed leader gives up).
    pub(super) fn take_back(
        &mut self,
        model: &LeaseModel,
        leader: usize,
        lease: &LeaseReturn,
        now_ms: u64,
    ) {
        let marked = model.config.variant != Variant::GiveBackUnmarked;
        if marked && self.returned.contains(&lease.lease_id) {
            return;
        }
        let Some(record) = self
            .records
            .get(&lease.lease_id)
            .filter(|record| record.region == lease.region)
        else {
            return;
        };
        let lease_window = Window {
            start_ms: record.window_start_ms,
            end_ms: record.window_end_ms,
        };
        let returnable = returnable_tokens_at(
            record.granted_tokens,
            record.issued_at_ms,
            lease_window,
            lease.spent_tokens,
            lease.unspent_tokens,
            now_ms,
        );
        if returnable == 0 {
            return;
        }
        let fence = model.config.variant != Variant::FenceSkipped;
        for _ in 0..2 {
            let Some(node) = self.leaders.get(leader) else {
                return;
            };
            let mut window = node.window.clone();
            let taken = window
                .as_mut()
                .map_or(0, |window| window.take_back(lease_window, returnable));
            if taken == 0 {
                return;
            }
            let deposed = node.epoch != self.epoch;
            if (!deposed && node.revision == self.window_revision) || !fence {
                self.window_revision += 1;
                self.window = window.clone();
                self.returned.insert(lease.lease_id);
                let revision = self.window_revision;
                if let Some(node) = self.leaders.get_mut(leader) {
                    node.window = window;
                    node.revision = revision;
                }
                return;
            }
            if deposed {
                return;
            }
            let (window, revision) = (self.window.clone(), self.window_revision);
            if let Some(node) = self.leaders.get_mut(leader) {
                node.window = window;
                node.revision = revision;
            }
        }
    }
}

/// [`Variant::BatchDecidedApart`]: each ask decided alone on the leader's window as it was before
/// the batch; the batch's window is the one the last ask left.
fn decided_apart(
    pool: &PoolConfig,
    node: &Leader,
    now_ms: u64,
    clamping: LeaseClamping,
    new: &[usize],
    requests: &[GrantRequest],
) -> allot_allocator::grants::BatchPlan {
    let mut merged = allot_allocator::grants::BatchPlan {
        answers: Vec::new(),
        new_records: Vec::new(),
        window: node.window.clone(),
    };
    for &i in new {
        let alone = plan_batch(
            pool,
            node.window.as_ref(),
            node.epoch,
            now_ms,
            clamping,
            std::iter::once(&requests[i]),
        );
        merged.answers.extend(alone.answers);
        merged.new_records.extend(alone.new_records);
        if alone.window.is_some() {
            merged.window = alone.window;
        }
    }
    merged
}
