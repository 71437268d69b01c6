//! Granting: one serialised worker per pool, committing the grants it has queued in one transaction.
//!
//! A pool's window is one hot key, and optimistic compare-and-put on one hot key collapses under
//! contention (most attempts conflict). So the leader never lets grants for one pool race: each pool has
//! one worker task that takes every pending request off its queue (up to [`MAX_BATCH`]), decides them in
//! order with the pure `allot_shared::lease::grant`, and commits the new window and all new grant
//! records in ONE transaction guarded by:
//! - the leader fence (a deposed leader's write fails),
//! - the pool configuration's and the window's revisions (nobody else changed them),
//! - every new grant key being absent (a lease id is never granted twice, even across leaders).
//!
//! Pool commits that wait at the same moment are merged by one committer into a single transaction
//! (within etcd's operation limit), so a thousand quiet pools cost one round trip, not a thousand; if
//! any merged guard fails, each pool's commit is retried alone. Cold workers' loads are merged
//! the same way by one loader: a failover's thousand first grants read their pools in a few round
//! trips.
//!
//! Because of the last guard, retrying a transaction whose outcome is unknown (a timeout) is safe: if it
//! had applied, the retry fails its guard and the grants are answered from the stored records. A new
//! leader trusts nothing cached: each worker reloads configuration and window from the store when the
//! epoch changes or a transaction fails.

use std::collections::HashMap;
use std::sync::{Arc, Mutex};
use std::time::Duration;

use allot_shared::ids::{LeaseId, PoolId, TenantId};
use allot_shared::lease::{
    GrantRequest, LeaseClamping, PoolConfig, PoolWindowState, lease_id_outlived,
};
use allot_shared::wire::GrantAnswer;
use tokio::sync::{mpsc, oneshot, watch};

mod merging;
mod plan;
mod records;
mod returns;

use merging::{CommitJob, LoadJob, run_committer, run_loader};
pub use plan::{BatchPlan, plan_batch};
pub use returns::LeaseReturn;
use returns::{PendingReturn, RecordedReturn};

use crate::clock::Clock;
use crate::kv::{Compare, Kv, KvError, Op};
use crate::leader::{LeaderRecord, Leadership, Roles, current_leader, leader_key};
use crate::ledger_sync::{CommittedGrants, LEDGER_RECONCILE_INTERVAL, LedgerFeed};
use crate::pools::{
    GrantRecord, PoolStoreError, StoredWindow, encode_record, get_grant, grant_key, return_key,
    window_key,
};
use allot_shared::shards::{ShardCount, ShardId, shard_of};

/// Most grants of one pool committed in one transaction. With the window put and three guards a
/// pool's commit stays within etcd's default `--max-txn-ops` ([`crate::kv::MAX_TXN_OPS`]).
pub const MAX_BATCH: usize = 120;
/// Pool commits waiting for the committer before pool workers wait in turn (I10).
pub const COMMIT_QUEUE: usize = 4_096;
/// Cold pools waiting for the loader before their workers wait in turn (I10).
pub const LOAD_QUEUE: usize = 4_096;
/// Pending grants queued per pool before new ones are refused as overloaded (I10).
pub const QUEUE_PER_POOL: usize = 4_096;
/// Transaction attempts per batch before giving up.
pub const MAX_TXN_ATTEMPTS: usize = 5;
/// How long a caller waits for its grant.
pub const GRANT_DEADLINE: Duration = Duration::from_secs(10);
/// A pool worker with nothing to do for this long exits (it is re-created on demand).
pub const WORKER_IDLE: Duration = Duration::from_secs(60);
/// Commits of a window longer than a record is kept
/// ([`GRANT_RECORD_MAX_LIFETIME_MS`](allot_shared::lease::GRANT_RECORD_MAX_LIFETIME_MS)) share a
/// store lease for their records this long, ms (a record outlives its commit by the lifetime and
/// at most this).
pub const RECORD_LEASE_BUCKET_MS: u64 = 600_000;
/// What an asker's clock may be ahead of the allocator's when its lease id's age is judged, ms
/// (the most `--clock-margin-ms` allows agents).
pub const LEASE_ID_CLOCK_ALLOWANCE_MS: u64 = 10_000;
/// Recently committed grants remembered per pool for answering retries without the store.
pub const RECENT_GRANTS_PER_POOL: usize = 8_192;

/// Why a grant was not answered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum GrantFailure {
    /// This node does not lead; the leader, when known.
    #[error("this allocator is not the leader")]
    NotLeader(Option<LeaderRecord>),
    /// No such pool.
    #[error("no such pool")]
    UnknownPool,
    /// The region may not take grants from the pool.
    #[error("region {0} may not take grants from this pool")]
    RegionNotInPool(String),
    /// `want` was 0.
    #[error("want must be at least 1")]
    ZeroWant,
    /// The lease id was made longer ago than a grant's record is kept, in windows that outlive
    /// that: its grant, if any, may be forgotten, so it is not granted (again).
    #[error(
        "was made more than an hour ago (by the time in it) and this pool's windows are longer: \
         a grant's record may be gone; ask with a new lease id"
    )]
    LeaseIdOutlived,
    /// Too many grants queued for this pool.
    #[error("too many grant requests queued for this pool")]
    Overloaded,
    /// The store failed; the caller may retry with the same lease id.
    #[error("store unavailable: {0}")]
    Unavailable(String),
}

impl From<PoolStoreError> for GrantFailure {
    fn from(error: PoolStoreError) -> Self {
        GrantFailure::Unavailable(error.to_string())
    }
}

impl From<KvError> for GrantFailure {
    fn from(error: KvError) -> Self {
        GrantFailure::Unavailable(error.to_string())
    }
}

type Reply = oneshot::Sender<Result<Granted, GrantFailure>>;

/// A grant's record as the pool's worker answers it, with the version of the pool's terms the
/// worker held (0: it held none, as when it answered from the store after a failed commit).
struct Granted {
    record: GrantRecord,
    terms_version: u64,
}

struct Pending {
    request: GrantRequest,
    reply: Reply,
}

/// What a pool's worker is asked to do.
enum Job {
    Grant(Pending),
    Return(PendingReturn),
}

type PoolKey = (TenantId, PoolId);

/// The leader lease the allocator runs with unless told otherwise (`--leader-lease-ttl-s`), ms.
pub const DEFAULT_LEADER_LEASE_TTL_MS: u64 = 5_000;

/// Least time a grant record stays in the store after its commit, for an election whose leader
/// lease lasts `leader_lease_ttl_ms`: two ledger rounds plus an election. The ledger copies grants
/// from the store at least once a round and at once when a node takes the lead, so a grant whose
/// leader died before feeding it to the ledger is still in the store when the next leader looks.
pub fn record_min_lifetime_ms(leader_lease_ttl_ms: u64) -> u64 {
    let round_ms = u64::try_from(LEDGER_RECONCILE_INTERVAL.as_millis()).unwrap_or(u64::MAX);
    round_ms
        .saturating_mul(2)
        .saturating_add(leader_lease_ttl_ms)
}

struct Shared {
    kv: Arc<dyn Kv>,
    clock: Arc<dyn Clock>,
    /// This node's role for every shard: it grants a pool only while it leads the pool's shard.
    roles: watch::Receiver<Roles>,
    /// How many shards the pools are split into (fixed for the process's life).
    shard_count: ShardCount,
    clamping: LeaseClamping,
    workers: Mutex<Workers>,
    /// Store leases that carry grant records, by (window end, window length, commit bucket) in
    /// ms (bucket 0 where records live by their window).
    record_leases: Mutex<HashMap<(u64, u64, u64), i64>>,
    /// Where committed grants are sent for the ledger. Bounded: when it is full the copy is skipped
    /// (and logged); the ledger's reconciliation from the store fills the gap.
    commit_feed: Option<LedgerFeed>,
    /// Most grants per transaction (1 disables group commit; benchmarks compare both).
    max_batch: usize,
    /// Least time a grant record stays in the store after its commit, ms.
    record_min_lifetime_ms: u64,
    /// The committer that merges concurrent pool commits into shared transactions.
    commits: mpsc::Sender<CommitJob>,
    /// The loader that merges cold workers' reads into shared reads.
    loads: mpsc::Sender<LoadJob>,
}

/// The grant service: routes each request to its pool's worker.
#[derive(Clone)]
pub struct Grantor {
    shared: Arc<Shared>,
}

impl Grantor {
    /// A grantor over `kv`, granting a pool while `roles` says this node leads its shard. Production always clamps
    /// leases to their window; [`LeaseClamping::Unclamped`] exists for drills. Committed grants are
    /// sent to `commit_feed` when given.
    pub fn new(
        kv: Arc<dyn Kv>,
        clock: Arc<dyn Clock>,
        roles: watch::Receiver<Roles>,
        clamping: LeaseClamping,
        commit_feed: Option<LedgerFeed>,
    ) -> Self {
        let shard_count = roles.borrow().count();
        let (commits, jobs) = mpsc::channel(COMMIT_QUEUE);
        tokio::spawn(run_committer(kv.clone(), jobs));
        let (loads, load_jobs) = mpsc::channel(LOAD_QUEUE);
        tokio::spawn(run_loader(kv.clone(), load_jobs));
        Self {
            shared: Arc::new(Shared {
                kv,
                clock,
                roles,
                shard_count,
                clamping,
                workers: Mutex::new(Workers::default()),
                record_leases: Mutex::new(HashMap::new()),
                commit_feed,
                max_batch: MAX_BATCH,
                record_min_lifetime_ms: record_min_lifetime_ms(DEFAULT_LEADER_LEASE_TTL_MS),
                commits,
                loads,
            }),
        }
    }

    /// The same grantor committing at most `max_batch` grants per transaction (at least 1, at most
    /// [`MAX_BATCH`]). Call before the first grant.
    pub fn with_max_batch(mut self, max_batch: usize) -> Self {
        if let Some(shared) = Arc::get_mut(&mut self.shared) {
            shared.max_batch = max_batch.clamp(1, MAX_BATCH);
        }
        self
    }

    /// The same grantor for an election whose leader lease lasts `leader_lease_ttl_ms`: grant
    /// records then outlive their commit by [`record_min_lifetime_ms`] of it. Call before the
    /// first grant.
    pub fn with_leader_lease_ttl_ms(mut self, leader_lease_ttl_ms: u64) -> Self {
        if let Some(shared) = Arc::get_mut(&mut self.shared) {
            shared.record_min_lifetime_ms = record_min_lifetime_ms(leader_lease_ttl_ms);
        }
        self
    }

    /// Grants from `tenant`/`pool`. Idempotent by `request.lease_id`: asking again answers what
    /// was granted, with this answer's own instant (`answeredAtMs`).
    pub async fn grant(
        &self,
        tenant: &TenantId,
        pool: &PoolId,
        request: GrantRequest,
    ) -> Result<GrantAnswer, GrantFailure> {
        let stopwatch = crate::clock::Stopwatch::start();
        let want = request.want_tokens;
        let result = self.grant_unmeasured(tenant, pool, request).await;
        let outcome = match &result {
            Ok(granted) if granted.record.granted_tokens == 0 => "exhausted",
            Ok(granted) if granted.record.granted_tokens < want => "partial",
            Ok(_) => "granted",
            Err(GrantFailure::NotLeader(_)) => "not_leader",
            Err(GrantFailure::UnknownPool) => "unknown_pool",
            Err(
                GrantFailure::RegionNotInPool(_)
                | GrantFailure::ZeroWant
                | GrantFailure::LeaseIdOutlived,
            ) => "refused",
            Err(GrantFailure::Overloaded) => "overloaded",
            Err(GrantFailure::Unavailable(_)) => "unavailable",
        };
        metrics::counter!(crate::metrics::GRANTS, "outcome" => outcome).increment(1);
        metrics::histogram!(crate::metrics::GRANT_SECONDS).record(stopwatch.elapsed_seconds());
        result.map(|granted| {
            let mut answer = granted.record.answer(self.shared.clock.now_ms());
            answer.terms_version = granted.terms_version;
            answer
        })
    }

    async fn grant_unmeasured(
        &self,
        tenant: &TenantId,
        pool: &PoolId,
        request: GrantRequest,
    ) -> Result<Granted, GrantFailure> {
        if request.want_tokens == 0 {
            return Err(GrantFailure::ZeroWant);
        }
        self.ask_worker((tenant.clone(), pool.clone()), |reply| {
            Job::Grant(Pending { request, reply })
        })
        .await
    }

    /// Hands the pool's worker the job `job` makes of a reply channel, as the leader only, and
    /// waits at most [`GRANT_DEADLINE`] for its answer.
    async fn ask_worker<T>(
        &self,
        key: PoolKey,
        job: impl FnOnce(oneshot::Sender<Result<T, GrantFailure>>) -> Job,
    ) -> Result<T, GrantFailure> {
        let shard = shard_of(&key.0, &key.1, self.shared.shard_count);
        if self.shared.roles.borrow().leadership(shard).is_none() {
            return Err(GrantFailure::NotLeader(
                current_leader(&*self.shared.kv, shard).await.ok().flatten(),
            ));
        }
        let (reply, answer) = oneshot::channel();
        self.enqueue(key, job(reply))?;
        match tokio::time::timeout(GRANT_DEADLINE, answer).await {
            Ok(Ok(result)) => result,
            _ => Err(GrantFailure::Unavailable(
                "no answer from the pool worker in time".to_owned(),
            )),
        }
    }

    /// Queues `job` on its pool's worker; a worker that exited while idle is replaced once.
    fn enqueue(&self, key: PoolKey, mut job: Job) -> Result<(), GrantFailure> {
        for _ in 0..2 {
            let sender = self.worker(&key);
            match sender.try_send(job) {
                Ok(()) => return Ok(()),
                Err(mpsc::error::TrySendError::Full(_)) => return Err(GrantFailure::Overloaded),
                Err(mpsc::error::TrySendError::Closed(returned)) => {
                    self.lock_workers().live.remove(&key);
                    job = returned;
                }
            }
        }
        Err(GrantFailure::Unavailable(
            "pool worker unavailable".to_owned(),
        ))
    }

    fn lock_workers(&self) -> std::sync::MutexGuard<'_, Workers> {
        self.shared
            .workers
            .lock()
            .unwrap_or_else(|poisoned| poisoned.into_inner())
    }

    fn worker(&self, key: &PoolKey) -> mpsc::Sender<Job> {
        let mut workers = self.lock_workers();
        if let Some(sender) = workers.live.get(key).filter(|s| !s.is_closed()) {
            return sender.clone();
        }
        workers.forget_exited();
        let (sender, receiver) = mpsc::channel(QUEUE_PER_POOL);
        workers.live.insert(key.clone(), sender.clone());
        let worker = PoolWorker {
            shard: shard_of(&key.0, &key.1, self.shared.shard_count),
            shared: self.shared.clone(),
            tenant: key.0.clone(),
            pool: key.1.clone(),
            cache: None,
            recent: HashMap::new(),
            recent_returns: HashMap::new(),
        };
        tokio::spawn(worker.run(receiver));
        sender
    }
}

/// The pool workers, by pool.
#[derive(Default)]
struct Workers {
    live: HashMap<PoolKey, mpsc::Sender<Job>>,
    /// The map's size at which exited workers are next swept out.
    sweep_at_len: usize,
}

impl Workers {
    /// Forgets workers that exited (idle, or no such pool), so the map holds live pools only
    /// whatever names callers send. A sweep reads the whole map, so it runs only once the map has
    /// doubled since the last: a new worker costs amortised constant time at 100,000 pools, not a
    /// read of all of them.
    fn forget_exited(&mut self) {
        if self.live.len() < self.sweep_at_len {
            return;
        }
        self.live.retain(|_, sender| !sender.is_closed());
        self.sweep_at_len = (self.live.len() * 2).max(1_024);
    }
}

/// What a worker believes about its pool, valid only for the epoch it was loaded in.
struct Cached {
    epoch_leadership: Leadership,
    config: PoolConfig,
    /// The pool's limit overrides; guarded with the pool's revision like the configuration.
    overrides: Vec<allot_shared::overrides::PoolOverride>,
    /// The version of the pool's terms (its configuration and overrides), as agents are told.
    terms_version: u64,
    pool_revision: i64,
    window: Option<PoolWindowState>,
    window_revision: i64,
}

struct PoolWorker {
    shared: Arc<Shared>,
    /// The shard the pool belongs to: the worker grants while this node leads it.
    shard: ShardId,
    tenant: TenantId,
    pool: PoolId,
    cache: Option<Cached>,
    recent: HashMap<LeaseId, GrantRecord>,
    /// Tokens taken back per lease recently, for answering a repeated return without the store.
    recent_returns: HashMap<LeaseId, u64>,
}

enum Attempt {
    Done,
    Retry,
}

impl PoolWorker {
    async fn run(mut self, mut receiver: mpsc::Receiver<Job>) {
        loop {
            let first = match tokio::time::timeout(WORKER_IDLE, receiver.recv()).await {
                Ok(Some(first)) => first,
                Ok(None) => return,
                // Idle: stop taking requests (senders now see the queue closed and start a new
                // worker), answer whatever slipped in meanwhile, and exit.
                Err(_) => {
                    receiver.close();
                    loop {
                        let mut late = Vec::new();
                        while late.len() < self.shared.max_batch {
                            match receiver.try_recv() {
                                Ok(job) => late.push(job),
                                Err(_) => break,
                            }
                        }
                        if late.is_empty() {
                            return;
                        }
                        self.process(late).await;
                    }
                }
            };
            let mut jobs = vec![first];
            while jobs.len() < self.shared.max_batch {
                match receiver.try_recv() {
                    Ok(next) => jobs.push(next),
                    Err(_) => break,
                }
            }
            self.process(jobs).await;
        }
    }

    fn leadership(&self) -> Option<Leadership> {
        self.shared.roles.borrow().leadership(self.shard)
    }

    /// Decides and commits one batch of jobs: the returns first (their tokens can be granted at
    /// once), then the grants, in one transaction.
    async fn process(&mut self, jobs: Vec<Job>) {
        let mut batch = Vec::new();
        let mut returns = Vec::new();
        for job in jobs {
            match job {
                Job::Grant(pending) => batch.push(pending),
                Job::Return(pending) => returns.push(pending),
            }
        }
        let mut returns = self.with_records(returns).await;
        for _ in 0..MAX_TXN_ATTEMPTS {
            let Some(leadership) = self.leadership() else {
                let leader = current_leader(&*self.shared.kv, self.shard)
                    .await
                    .ok()
                    .flatten();
                return fail_all(batch, returns, GrantFailure::NotLeader(leader));
            };
            if self
                .cache
                .as_ref()
                .is_none_or(|c| c.epoch_leadership != leadership)
            {
                match self.load(leadership).await {
                    Ok(true) => {}
                    Ok(false) => return fail_all(batch, returns, GrantFailure::UnknownPool),
                    Err(failure) => return fail_all(batch, returns, failure),
                }
            }
            batch = self.answer_known(batch);
            batch = self.refuse_outlived_ids(batch).await;
            returns = self.answer_known_returns(returns);
            if batch.is_empty() && returns.is_empty() {
                return;
            }
            match self.attempt(leadership, &mut batch, &mut returns).await {
                Attempt::Done => return,
                Attempt::Retry => {
                    self.cache = None;
                    // A broken fence means another node leads now: stop, and say who.
                    if let Some(leader) = self.deposed(leadership).await {
                        return fail_all(batch, returns, GrantFailure::NotLeader(leader));
                    }
                    batch = self.answer_from_store(batch).await;
                    returns = self.returns_from_store(returns).await;
                    if batch.is_empty() && returns.is_empty() {
                        return;
                    }
                }
            }
        }
        fail_all(
            batch,
            returns,
            GrantFailure::Unavailable("could not commit; retry with the same lease id".to_owned()),
        );
    }

    /// Loads configuration and window from the store in one read shared with other cold pools (a
    /// cold worker's first grant waits one round trip for them). `Ok(false)` when the pool does not
    /// exist.
    async fn load(&mut self, leadership: Leadership) -> Result<bool, GrantFailure> {
        let (pool, window) = self
            .shared
            .load((self.tenant.clone(), self.pool.clone()))
            .await?;
        let Some((stored_pool, pool_revision)) = pool else {
            self.cache = None;
            return Ok(false);
        };
        let config = stored_pool
            .spec
            .validate()
            .map_err(|e| GrantFailure::Unavailable(format!("stored pool is invalid: {e}")))?;
        let (window, window_revision) = match window {
            Some((window, revision)) => (Some(window), revision),
            None => (None, 0),
        };
        self.cache = Some(Cached {
            epoch_leadership: leadership,
            config,
            overrides: stored_pool.overrides,
            terms_version: stored_pool.version,
            pool_revision,
            window,
            window_revision,
        });
        Ok(true)
    }

    /// Answers requests whose lease id this worker committed recently.
    fn answer_known(&self, batch: Vec<Pending>) -> Vec<Pending> {
        let mut rest = Vec::with_capacity(batch.len());
        for pending in batch {
            match self.recent.get(&pending.request.lease_id) {
                Some(record) => {
                    let _ = pending.reply.send(Ok(self.granted(record.clone())));
                }
                None => rest.push(pending),
            }
        }
        rest
    }

    /// Refuses asks whose lease ids are older than a grant's record is kept in this pool's windows
    /// ([`lease_id_outlived`]), unless their record is still there (then it answers them).
    async fn refuse_outlived_ids(&mut self, batch: Vec<Pending>) -> Vec<Pending> {
        let Some(cache) = self.cache.as_ref() else {
            return batch;
        };
        let longest_ms = cache.config.window().longest_ms();
        let now_ms = self.shared.clock.now_ms();
        let (outlived, rest): (Vec<Pending>, Vec<Pending>) =
            batch.into_iter().partition(|pending| {
                lease_id_outlived(
                    pending.request.lease_id,
                    longest_ms,
                    now_ms,
                    LEASE_ID_CLOCK_ALLOWANCE_MS,
                )
            });
        for pending in self.answer_from_store(outlived).await {
            let _ = pending.reply.send(Err(GrantFailure::LeaseIdOutlived));
        }
        rest
    }

    /// Answers requests whose grant records exist in the store (committed by an earlier attempt whose
    /// answer was lost, or by another leader).
    async fn answer_from_store(&mut self, batch: Vec<Pending>) -> Vec<Pending> {
        let mut rest = Vec::with_capacity(batch.len());
        for pending in batch {
            match get_grant(
                &*self.shared.kv,
                &self.tenant,
                &self.pool,
                &pending.request.lease_id,
            )
            .await
            {
                Ok(Some(record)) => {
                    self.remember(&record);
                    let _ = pending.reply.send(Ok(self.granted(record)));
                }
                Ok(None) => rest.push(pending),
                Err(failure) => {
                    let _ = pending.reply.send(Err(failure.into()));
                }
            }
        }
        rest
    }

    /// `record` as this worker answers it: with the version of the terms it holds.
    fn granted(&self, record: GrantRecord) -> Granted {
        Granted {
            record,
            terms_version: self.cache.as_ref().map_or(0, |cache| cache.terms_version),
        }
    }

    fn remember(&mut self, record: &GrantRecord) {
        if self.recent.len() >= RECENT_GRANTS_PER_POOL {
            // Forgetting only costs a store read on a later retry; correctness rests on the store.
            self.recent.clear();
        }
        self.recent.insert(record.lease_id, record.clone());
    }

    /// Decides the batch and commits it in one transaction.
    ///
    /// Long by design: its order is the grant's safety: the returns taken back and the grants
    /// planned on the cached revisions, committed only if the fence, those revisions and the
    /// absence of each return's mark still hold, the cache moved only on success, and the answers
    /// sent only after the commit (or after the fence is checked again when nothing was
    /// committed); split, a piece could be called out of that order, and a retry's early returns
    /// would be spread over several functions.
    async fn attempt(
        &mut self,
        leadership: Leadership,
        batch: &mut Vec<Pending>,
        returns: &mut Vec<RecordedReturn>,
    ) -> Attempt {
        let Some(cache) = self.cache.as_ref() else {
            return Attempt::Retry;
        };
        let now_ms = self.shared.clock.now_ms();
        // The limit in force now: an override's while one is (its start and end are on this
        // clock, as the windows are).
        let config = cache.config.limited_to(allot_shared::overrides::limit_at(
            cache.config.limit_tokens(),
            &cache.overrides,
            now_ms,
        ));
        // Returns first: what they give back can be granted in this very batch.
        let mut window_after_returns = cache.window.clone();
        let taken_back: Vec<u64> = returns
            .iter()
            .map(|recorded| {
                let returnable = recorded.returnable_at(now_ms);
                window_after_returns
                    .as_mut()
                    .map_or(0, |window| window.take_back(recorded.window, returnable))
            })
            .collect();
        let plan = plan_batch(
            &config,
            window_after_returns.as_ref(),
            leadership.epoch,
            now_ms,
            self.shared.clamping,
            batch.iter().map(|p| &p.request),
        );
        let (pool_revision, window_revision) = (cache.pool_revision, cache.window_revision);
        let any_taken_back = taken_back.iter().any(|&taken| taken > 0);
        let commits = !plan.new_records.is_empty() || any_taken_back;
        if let (true, Some(window_state)) = (commits, plan.window.as_ref()) {
            let record_lease = match self.record_lease(window_state, now_ms).await {
                Ok(lease) => lease,
                Err(_) => return Attempt::Retry,
            };
            let window_key = window_key(&self.tenant, &self.pool);
            let mut compares = vec![
                leadership.fence(),
                Compare::ModRevision {
                    key: crate::pools::pool_key(&self.tenant, &self.pool),
                    revision: pool_revision,
                },
                Compare::ModRevision {
                    key: window_key.clone(),
                    revision: window_revision,
                },
            ];
            let mut ops = vec![Op::Put {
                key: window_key,
                value: encode_record(&StoredWindow::from(window_state)),
                lease: None,
            }];
            for record in &plan.new_records {
                let key = grant_key(&self.tenant, &self.pool, &record.lease_id);
                compares.push(Compare::ModRevision {
                    key: key.clone(),
                    revision: 0,
                });
                ops.push(Op::Put {
                    key,
                    value: encode_record(record),
                    lease: Some(record_lease),
                });
            }
            // A lease's tokens are taken back once: its mark must be absent, whoever leads.
            for (recorded, &taken) in returns.iter().zip(&taken_back) {
                if taken == 0 {
                    continue;
                }
                let key = return_key(&self.tenant, &self.pool, &recorded.lease_id());
                compares.push(Compare::ModRevision {
                    key: key.clone(),
                    revision: 0,
                });
                ops.push(Op::Put {
                    key,
                    value: encode_record(&taken),
                    lease: Some(record_lease),
                });
            }
            match self.shared.commit(compares, ops).await {
                Ok(outcome) if outcome.succeeded => {
                    metrics::histogram!(crate::metrics::GRANT_BATCH)
                        .record(plan.new_records.len() as f64);
                    let granted: u64 = plan.new_records.iter().map(|r| r.granted_tokens).sum();
                    metrics::counter!(crate::metrics::TOKENS_GRANTED).increment(granted);
                    metrics::counter!(crate::metrics::TOKENS_RETURNED)
                        .increment(taken_back.iter().sum());
                    metrics::gauge!(crate::metrics::POOL_REMAINING,
                        "tenant" => self.tenant.to_string(), "pool" => self.pool.to_string())
                    .set(window_state.remaining_tokens(&config) as f64);
                    let limit_in_force_tokens = config.limit_tokens();
                    if let Some(cache) = self.cache.as_mut() {
                        debug_assert!(
                            granted == 0
                                || window_state.outstanding_tokens() <= limit_in_force_tokens,
                            "committed grants never exceed the limit in force"
                        );
                        cache.window = plan.window.clone();
                        cache.window_revision = outcome.revision;
                    }
                }
                Ok(_) => return Attempt::Retry,
                Err(KvError::LeaseNotFound(_)) => {
                    self.forget_record_lease(window_state);
                    return Attempt::Retry;
                }
                Err(error) => {
                    metrics::counter!(crate::metrics::STORE_ERRORS, "op" => "grant_txn")
                        .increment(1);
                    tracing::warn!(%error, tenant = %self.tenant, pool = %self.pool, "grant commit failed");
                    return Attempt::Retry;
                }
            }
        }
        if !commits && let Some(leader) = self.deposed(leadership).await {
            // Nothing to commit, so no transaction met the fence: the answers (refusals, or
            // repeats of records this worker remembers) came from a cache a deposed leader may no
            // longer own. A deposed leader says who leads instead.
            self.cache = None;
            fail_all(
                std::mem::take(batch),
                std::mem::take(returns),
                GrantFailure::NotLeader(leader),
            );
            return Attempt::Done;
        }
        for record in &plan.new_records {
            self.remember(record);
        }
        if let (Some(feed), false) = (&self.shared.commit_feed, plan.new_records.is_empty()) {
            feed.send(CommittedGrants {
                tenant: self.tenant.clone(),
                pool: self.pool.clone(),
                records: plan.new_records.clone(),
            });
        }
        for (pending, answer) in batch.drain(..).zip(plan.answers) {
            let _ = pending
                .reply
                .send(answer.map(|record| self.granted(record)));
        }
        for (recorded, taken) in returns.drain(..).zip(taken_back) {
            if taken > 0 {
                self.remember_return(recorded.lease_id(), taken);
                recorded.answer(Ok(taken));
            } else {
                // Nothing to take back now (the lease's window is over): unless an earlier
                // attempt or leader took it back, which its mark says.
                let stored = self.stored_return(recorded.lease_id()).await;
                recorded.answer(stored.map(|taken| taken.unwrap_or(0)));
            }
        }
        Attempt::Done
    }

    /// `Some(the leader now)` when `leadership`'s fence no longer holds (another node leads, or
    /// none); `None` while it holds, or when the store cannot say (the answer stands, as a
    /// refusal grants nothing).
    async fn deposed(&self, leadership: Leadership) -> Option<Option<LeaderRecord>> {
        let current = self
            .shared
            .kv
            .get(&leader_key(leadership.shard))
            .await
            .ok()?;
        if current.as_ref().map(|c| c.mod_revision) == Some(leadership.leader_revision) {
            return None;
        }
        Some(current.and_then(|c| serde_json::from_slice(&c.value).ok()))
    }
}

/// Answers every grant and return of a batch with `failure`.
fn fail_all(batch: Vec<Pending>, returns: Vec<RecordedReturn>, failure: GrantFailure) {
    for recorded in returns {
        recorded.answer(Err(failure.clone()));
    }
    for pending in batch {
        let _ = pending.reply.send(Err(failure.clone()));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(n: usize) -> PoolKey {
        (
            TenantId::parse(&format!("t{n}")).expect("tenant"),
            PoolId::parse("api").expect("pool"),
        )
    }

    #[test]
    fn exited_workers_are_swept_once_the_map_doubles_and_live_ones_stay() {
        let mut workers = Workers::default();
        let mut receivers = Vec::new();
        for n in 0..3_000 {
            let (sender, receiver) = mpsc::channel(1);
            // Every third worker is still running; the rest have exited.
            if n % 3 == 0 {
                receivers.push(receiver);
            }
            workers.forget_exited();
            workers.live.insert(key(n), sender);
            assert!(
                workers.live.len() <= (receivers.len() * 2).max(1_024) + 1,
                "at most twice the live workers (or the floor) are kept: {} with {} live",
                workers.live.len(),
                receivers.len()
            );
        }
        workers.sweep_at_len = 0;
        workers.forget_exited();
        assert_eq!(
            workers.live.len(),
            receivers.len(),
            "a sweep keeps the live ones"
        );
        assert!(workers.live.contains_key(&key(2_997)));
        assert!(!workers.live.contains_key(&key(2_998)));
    }
}
