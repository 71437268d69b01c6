//! The grant workers' store I/O, merged across pools: one loader merges cold pools' reads, one
//! committer merges pool commits that wait at the same moment into shared transactions (module
//! docs of `grants`).

use std::sync::Arc;

use tokio::sync::{mpsc, oneshot};

use super::{PoolKey, Shared};
use crate::kv::{Compare, Kv, KvError, Op};
use crate::pools::{PoolAndWindow, PoolStoreError, get_pools_and_windows};

/// One cold pool's read of its configuration and window, and where to say what it found.
pub(super) struct LoadJob {
    pool: PoolKey,
    reply: oneshot::Sender<Result<PoolAndWindow, PoolStoreError>>,
}

/// One pool's commit: its guards and writes, and where to say how it went.
pub(super) struct CommitJob {
    compares: Vec<Compare>,
    ops: Vec<Op>,
    reply: oneshot::Sender<Result<crate::kv::TxnOutcome, KvError>>,
}

impl Shared {
    /// Commits one pool's guarded writes through the committer.
    pub(super) async fn commit(
        &self,
        compares: Vec<Compare>,
        ops: Vec<Op>,
    ) -> Result<crate::kv::TxnOutcome, KvError> {
        let (reply, outcome) = oneshot::channel();
        let job = CommitJob {
            compares,
            ops,
            reply,
        };
        if self.commits.send(job).await.is_err() {
            return Err(KvError::Unavailable("the committer has stopped".to_owned()));
        }
        outcome.await.unwrap_or_else(|_| {
            Err(KvError::Unavailable(
                "the committer dropped a commit".to_owned(),
            ))
        })
    }
}

impl Shared {
    /// Reads one pool's configuration and window through the loader.
    pub(super) async fn load(&self, pool: PoolKey) -> Result<PoolAndWindow, PoolStoreError> {
        let (reply, loaded) = oneshot::channel();
        if self.loads.send(LoadJob { pool, reply }).await.is_err() {
            return Err(KvError::Unavailable("the loader has stopped".to_owned()).into());
        }
        loaded.await.unwrap_or_else(|_| {
            Err(KvError::Unavailable("the loader dropped a read".to_owned()).into())
        })
    }
}

/// Merges the reads of cold pools that wait at the same moment into one store read (two keys a
/// pool, within etcd's operation limit), so many pools' first grants cost one round trip to load,
/// not one each. Each pool's answer is its own: one unreadable pool fails no other.
pub(super) async fn run_loader(kv: Arc<dyn Kv>, mut jobs: mpsc::Receiver<LoadJob>) {
    const POOLS_PER_READ: usize = crate::kv::MAX_TXN_OPS / 2;
    while let Some(first) = jobs.recv().await {
        let mut group = vec![first];
        while group.len() < POOLS_PER_READ {
            match jobs.try_recv() {
                Ok(next) => group.push(next),
                Err(_) => break,
            }
        }
        metrics::histogram!(crate::metrics::POOLS_PER_LOAD).record(group.len() as f64);
        let pools: Vec<PoolKey> = group.iter().map(|job| job.pool.clone()).collect();
        match get_pools_and_windows(&*kv, &pools).await {
            Ok(found) => {
                for (job, found) in group.into_iter().zip(found) {
                    let _ = job.reply.send(found);
                }
            }
            Err(error) => {
                for job in group {
                    let _ = job.reply.send(Err(error.clone()));
                }
            }
        }
    }
}

/// Merges pool commits that are waiting at the same moment into one transaction (up to etcd's
/// operation limit), so many pools with one grant each cost one etcd round trip, not one each. The
/// guards of all of them must hold; when one fails, each commit is retried alone so that one pool's
/// conflict never fails another's.
pub(super) async fn run_committer(kv: Arc<dyn Kv>, mut jobs: mpsc::Receiver<CommitJob>) {
    use crate::kv::MAX_TXN_OPS;
    let mut carried: Option<CommitJob> = None;
    loop {
        let first = match carried.take() {
            Some(job) => job,
            None => match jobs.recv().await {
                Some(job) => job,
                None => return,
            },
        };
        let (mut compares, mut ops) = (first.compares.len(), first.ops.len());
        let mut group = vec![first];
        while let Ok(next) = jobs.try_recv() {
            if compares + next.compares.len() > MAX_TXN_OPS || ops + next.ops.len() > MAX_TXN_OPS {
                carried = Some(next);
                break;
            }
            compares += next.compares.len();
            ops += next.ops.len();
            group.push(next);
        }
        commit_group(&*kv, group).await;
    }
}

async fn commit_group(kv: &dyn Kv, mut group: Vec<CommitJob>) {
    if group.len() == 1 {
        if let Some(job) = group.pop() {
            let _ = job.reply.send(kv.txn(job.compares, job.ops).await);
        }
        return;
    }
    let mut compares: Vec<Compare> = Vec::new();
    let mut ops = Vec::new();
    for job in &group {
        for compare in &job.compares {
            // Every pool guards on the same leader fence: state it once.
            if !compares.contains(compare) {
                compares.push(compare.clone());
            }
        }
        ops.extend(job.ops.iter().cloned());
    }
    metrics::histogram!(crate::metrics::POOLS_PER_TXN).record(group.len() as f64);
    match kv.txn(compares, ops).await {
        Ok(outcome) if outcome.succeeded => {
            for job in group {
                let _ = job.reply.send(Ok(outcome));
            }
        }
        Ok(_) => {
            for job in group {
                let _ = job.reply.send(kv.txn(job.compares, job.ops).await);
            }
        }
        Err(error) => {
            for job in group {
                let _ = job.reply.send(Err(error.clone()));
            }
        }
    }
}
