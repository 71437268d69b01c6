//! The grant service against both stores: no window ever grants more than G, a retried lease id never
//! grants twice (even when the retries race), leases never outlive their window, and a deposed leader
//! cannot grant. Every scenario runs on the embedded store and on a real etcd.

use std::collections::{BTreeMap, HashMap};
use std::sync::Arc;

use allot_allocator::clock::{Clock, ManualClock};
use allot_allocator::grants::{GrantFailure, Grantor, LeaseReturn};
use allot_allocator::kv::Kv;
use allot_allocator::kv::etcd::EtcdKv;
use allot_allocator::kv::memory::MemoryKv;
use allot_allocator::leader::{Leadership, Role, Roles, try_acquire};
use allot_allocator::pools::{PoolSpec, get_grant, list_grants, put_pool};
use allot_shared::ids::{LeaseId, PoolId, RegionId, TenantId};
use allot_shared::lease::{GrantRequest, LeaseClamping};
use allot_shared::wire::GrantAnswer;
use allot_testkit::EtcdCluster;
use rand::{Rng, SeedableRng};
use tokio::sync::watch;

/// 2026-01-01T00:00:10Z: 10 s into a minute window.
const T0_MS: u64 = 1_767_225_610_000;

fn tenant() -> TenantId {
    TenantId::parse("atlas").expect("tenant")
}

fn pool() -> PoolId {
    PoolId::parse("api").expect("pool")
}

fn region(name: &str) -> RegionId {
    RegionId::parse(name).expect("region")
}

fn spec(limit_tokens: u64, chunk_tokens: u64) -> PoolSpec {
    PoolSpec {
        limit_tokens,
        window_ms: 60_000,
        window: None,
        chunk_tokens,
        lease_ttl_ms: 15_000,
        fallback_per_region_tokens: 100,
        settle_debt_per_region_tokens: 0,
        regions: vec![region("eu"), region("us")],
    }
}

fn lease(n: u64) -> LeaseId {
    LeaseId::from_parts(T0_MS, u128::from(n) + 1)
}

/// A grant service leading with `leadership` over `kv` on `clock` (a new leader's workers: they
/// remember nothing).
fn grantor_on(kv: Arc<dyn Kv>, clock: Arc<ManualClock>, leadership: Leadership) -> Grantor {
    let (sender, role) = watch::channel(Roles::single(Role::Leader(leadership)));
    // The role never changes in these tests; a dropped sender leaves the last value readable.
    drop(sender);
    Grantor::new(kv, clock, role, LeaseClamping::Clamped, None)
}

/// A leader over `kv` with a manual clock, and its grant service.
async fn leader(kv: Arc<dyn Kv>) -> (Grantor, Arc<ManualClock>, Leadership) {
    let clock = Arc::new(ManualClock::new(T0_MS));
    let leadership = try_acquire(&*kv, "node-a", "http://a", 30)
        .await
        .expect("store")
        .expect("the first node leads");
    let grantor = grantor_on(kv, clock.clone(), leadership);
    (grantor, clock, leadership)
}

async fn configure(kv: &dyn Kv, limit: u64, chunk: u64) {
    put_pool(kv, &tenant(), &pool(), spec(limit, chunk), T0_MS)
        .await
        .expect("pool configured");
}

fn request(n: u64, region_name: &str, want: u64) -> GrantRequest {
    GrantRequest {
        lease_id: lease(n),
        region: region(region_name),
        want_tokens: want,
    }
}

/// 64 clients with random wants, each retrying its own lease ids at random, all at once.
async fn concurrent_clients_never_exceed_the_pool(kv: Arc<dyn Kv>) {
    configure(&*kv, 1_000, 100).await;
    let (grantor, _clock, _) = leader(kv.clone()).await;
    let mut tasks = Vec::new();
    for client in 0..64u64 {
        let grantor = grantor.clone();
        tasks.push(tokio::spawn(async move {
            let mut rng = rand::rngs::StdRng::seed_from_u64(client);
            let mut answers: Vec<(u64, GrantAnswer)> = Vec::new();
            for attempt in 0..6u64 {
                let n = client * 100 + attempt;
                let want = rng.random_range(1..=150);
                let region_name = if client % 10 == 0 { "us" } else { "eu" };
                let record = grantor
                    .grant(&tenant(), &pool(), request(n, region_name, want))
                    .await
                    .expect("granted");
                answers.push((n, record));
                // Retry an earlier lease id now and then, as after a lost reply; the retry's own
                // want is ignored.
                if rng.random_bool(0.5) {
                    let (old, first) = answers[rng.random_range(0..answers.len())].clone();
                    let again = grantor
                        .grant(&tenant(), &pool(), request(old, region_name, 1))
                        .await
                        .expect("granted");
                    assert_eq!(again, first, "a retry returns the original answer");
                }
            }
            answers
        }));
    }
    let mut granted_by_window: BTreeMap<u64, u64> = BTreeMap::new();
    let mut seen: HashMap<LeaseId, GrantAnswer> = HashMap::new();
    for task in tasks {
        for (n, record) in task.await.expect("client task") {
            let id = lease(n);
            assert!(
                record.expires_at_ms <= record.window_end_ms,
                "clamped to the window"
            );
            assert!(record.granted_tokens <= 100, "never more than a chunk");
            if let Some(previous) = seen.insert(id, record.clone()) {
                assert_eq!(previous, record);
                continue;
            }
            *granted_by_window.entry(record.window_start_ms).or_default() += record.granted_tokens;
        }
    }
    assert_eq!(granted_by_window.len(), 1);
    let total: u64 = granted_by_window.values().sum();
    assert_eq!(total, 1_000, "the pool is used up exactly, never exceeded");
    // What the store recorded agrees with what the clients were told.
    let stored: u64 = list_grants(&*kv, &tenant(), &pool())
        .await
        .expect("grants")
        .iter()
        .map(|g| g.granted_tokens)
        .sum();
    assert_eq!(stored, 1_000);
}

/// Ten simultaneous retries of one lease id: one grant.
async fn racing_retries_grant_once(kv: Arc<dyn Kv>) {
    configure(&*kv, 1_000, 100).await;
    let (grantor, _clock, _) = leader(kv.clone()).await;
    let answers = futures_join(
        (0..10)
            .map(|_| {
                let grantor = grantor.clone();
                tokio::spawn(async move {
                    grantor
                        .grant(&tenant(), &pool(), request(7, "eu", 60))
                        .await
                        .expect("granted")
                })
            })
            .collect(),
    )
    .await;
    assert!(answers.iter().all(|a| *a == answers[0]));
    assert_eq!(answers[0].granted_tokens, 60);
    let records = list_grants(&*kv, &tenant(), &pool()).await.expect("grants");
    assert_eq!(records.len(), 1);
}

/// A lease id asked again later (its first answer was lost) gets the stored grant back, with the
/// instant of this answer: what is left of the lease is `expiresAtMs - answeredAtMs`, never the
/// whole length again.
async fn a_replay_says_when_it_was_answered(kv: Arc<dyn Kv>) {
    configure(&*kv, 1_000, 100).await;
    let (grantor, clock, _) = leader(kv.clone()).await;
    let first = grantor
        .grant(&tenant(), &pool(), request(8, "eu", 60))
        .await
        .expect("granted");
    assert_eq!(first.answered_at_ms, first.issued_at_ms);
    clock.advance(4_000);
    let replay = grantor
        .grant(&tenant(), &pool(), request(8, "eu", 60))
        .await
        .expect("granted again");
    assert_eq!(replay.issued_at_ms, first.issued_at_ms);
    assert_eq!(replay.expires_at_ms, first.expires_at_ms);
    assert_eq!(replay.granted_tokens, first.granted_tokens);
    assert_eq!(replay.answered_at_ms, first.issued_at_ms + 4_000);
}

async fn futures_join<T: Send + 'static>(tasks: Vec<tokio::task::JoinHandle<T>>) -> Vec<T> {
    let mut out = Vec::new();
    for task in tasks {
        out.push(task.await.expect("task"));
    }
    out
}

/// Partial grant at the tail, 0 with the time to the next window once exhausted, a full pool again
/// in the next window, and leases clamped to the window's end.
async fn tail_exhaustion_and_clamping(kv: Arc<dyn Kv>) {
    configure(&*kv, 250, 100).await;
    let (grantor, clock, leadership) = leader(kv.clone()).await;
    let (atlas, api) = (tenant(), pool());
    let g = |n, want| grantor.grant(&atlas, &api, request(n, "eu", want));
    assert_eq!(g(1, 100).await.expect("grant").granted_tokens, 100);
    assert_eq!(g(2, 100).await.expect("grant").granted_tokens, 100);
    let tail = g(3, 100).await.expect("grant");
    assert_eq!(tail.granted_tokens, 50, "partial grant at the tail");
    assert_eq!(tail.epoch, leadership.epoch);
    let none = g(4, 100).await.expect("grant");
    assert_eq!(none.granted_tokens, 0);
    assert_eq!(none.retry_after_ms, 50_000, "until the next window");
    // 55 s into the window a 15 s lease is clamped to the window's end.
    clock.advance(45_000);
    assert_eq!(g(5, 1).await.expect("grant").granted_tokens, 0);
    clock.advance(5_000);
    let next = g(6, 100).await.expect("grant");
    assert_eq!(next.granted_tokens, 100, "a new window starts full");
    assert_eq!(next.window_start_ms, T0_MS - 10_000 + 60_000);
    clock.set(next.window_end_ms - 5_000);
    let clamped = g(7, 10).await.expect("grant");
    assert_eq!(clamped.expires_at_ms, clamped.window_end_ms);
    // Unknown pools and foreign regions are refused.
    let other = PoolId::parse("other").expect("pool");
    assert_eq!(
        grantor.grant(&tenant(), &other, request(8, "eu", 1)).await,
        Err(GrantFailure::UnknownPool)
    );
    assert!(matches!(
        grantor.grant(&tenant(), &pool(), request(9, "ap", 1)).await,
        Err(GrantFailure::RegionNotInPool(_))
    ));
}

/// What a lease leaves unspent comes back to its window once, whoever asks and however often: at
/// most the grant less the spend, only to the lease's own region and window, and a fresh worker
/// (another grantor on the same leadership) answers from the store's mark, never taking it twice.
async fn unspent_tokens_come_back_once_and_only_in_their_window(kv: Arc<dyn Kv>) {
    configure(&*kv, 100, 100).await;
    let (grantor, clock, leadership) = leader(kv.clone()).await;
    let (atlas, api) = (tenant(), pool());
    let g = |grantor: &Grantor, n, region_name: &str, want| {
        let request = request(n, region_name, want);
        let (atlas, api) = (atlas.clone(), api.clone());
        let grantor = grantor.clone();
        async move { grantor.grant(&atlas, &api, request).await.expect("grant") }
    };
    let give_back = |grantor: &Grantor, n, region_name: &str, spent, unspent| {
        let lease = LeaseReturn {
            lease_id: lease(n),
            region: region(region_name),
            spent_tokens: spent,
            unspent_tokens: unspent,
        };
        let (atlas, api) = (atlas.clone(), api.clone());
        let grantor = grantor.clone();
        async move {
            grantor
                .take_back(&atlas, &api, lease)
                .await
                .expect("take back")
        }
    };
    let first = g(&grantor, 1, "eu", 60).await;
    assert!(first.returnable, "this allocator takes unspent tokens back");
    assert_eq!(g(&grantor, 2, "us", 100).await.granted_tokens, 40);
    assert_eq!(g(&grantor, 3, "us", 10).await.granted_tokens, 0, "used up");
    assert_eq!(give_back(&grantor, 1, "eu", 30, 30).await, 30);
    assert_eq!(
        give_back(&grantor, 1, "eu", 30, 30).await,
        30,
        "asked again"
    );
    let fresh = grantor_on(kv.clone(), clock.clone(), leadership);
    assert_eq!(
        give_back(&fresh, 1, "eu", 30, 30).await,
        30,
        "a worker that never saw it answers from the store's mark"
    );
    assert_eq!(
        g(&fresh, 4, "us", 100).await.granted_tokens,
        30,
        "what came back is granted again, once"
    );
    assert_eq!(
        give_back(&fresh, 4, "us", 25, 30).await,
        5,
        "never more than the grant less the spend"
    );
    assert_eq!(
        give_back(&fresh, 2, "eu", 0, 40).await,
        0,
        "another region's lease gives nothing back"
    );
    assert_eq!(
        give_back(&fresh, 99, "eu", 0, 40).await,
        0,
        "nor one never granted"
    );
    clock.advance(60_000);
    assert_eq!(
        g(&fresh, 5, "eu", 10).await.granted_tokens,
        10,
        "the next window"
    );
    assert_eq!(
        give_back(&fresh, 2, "us", 0, 40).await,
        0,
        "a lease of a window that is over gives nothing back"
    );
    assert_eq!(
        g(&fresh, 6, "eu", 100).await.granted_tokens,
        90,
        "the new window holds only its own"
    );
}

/// Two give-backs of one lease queued together (a report sent again while the first is still
/// waiting for the pool's worker) are decided in one batch: the lease is taken back from once,
/// and both are answered alike. On one thread both are queued before the worker runs.
#[tokio::test]
async fn one_lease_given_back_twice_in_one_batch_comes_back_once() {
    let kv = memory();
    configure(&*kv, 100, 100).await;
    let (grantor, _clock, _) = leader(kv.clone()).await;
    let (atlas, api) = (tenant(), pool());
    let granted = grantor
        .grant(&atlas, &api, request(1, "eu", 60))
        .await
        .expect("grant");
    assert_eq!(granted.granted_tokens, 60);
    let line = || LeaseReturn {
        lease_id: lease(1),
        region: region("eu"),
        spent_tokens: 30,
        unspent_tokens: 30,
    };
    let (first, second) = tokio::join!(
        grantor.take_back(&atlas, &api, line()),
        grantor.take_back(&atlas, &api, line())
    );
    assert_eq!((first, second), (Ok(30), Ok(30)));
    assert_eq!(
        grantor
            .grant(&atlas, &api, request(2, "us", 100))
            .await
            .expect("grant")
            .granted_tokens,
        70,
        "the 40 never granted and the 30 given back, once"
    );
}

/// In windows longer than a record is kept, a record lives about an hour after its commit, not a
/// window past its window; an ask whose lease id is older than that is refused rather than risk
/// granting it twice, and a record still kept answers its own id as before.
#[tokio::test]
async fn a_long_window_keeps_records_an_hour_and_refuses_older_lease_ids() {
    let clock = Arc::new(ManualClock::new(T0_MS));
    let kv: Arc<dyn Kv> = Arc::new(MemoryKv::new(clock.clone()));
    let daily = PoolSpec {
        window_ms: 86_400_000,
        lease_ttl_ms: 600_000,
        ..spec(1_000, 100)
    };
    put_pool(&*kv, &tenant(), &pool(), daily, T0_MS)
        .await
        .expect("pool configured");
    let leadership = try_acquire(&*kv, "node-a", "http://a", 1 << 30)
        .await
        .expect("store")
        .expect("leads");
    let grantor = grantor_on(kv.clone(), clock.clone(), leadership);
    let (atlas, api) = (tenant(), pool());
    let ask = |n: u64| grantor.grant(&atlas, &api, request(n, "eu", 10));
    assert_eq!(ask(1).await.expect("grant").granted_tokens, 10);
    clock.advance(50 * 60_000);
    let again = ask(1).await.expect("asked again within the hour");
    assert_eq!(again.granted_tokens, 10, "answered from its record");
    assert_eq!(ask(2).await.expect("a 50-minute-old id").granted_tokens, 10);
    let ahead = GrantRequest {
        lease_id: LeaseId::from_parts(clock.now_ms() + 60_000, 98),
        region: region("eu"),
        want_tokens: 10,
    };
    assert_eq!(
        grantor.grant(&atlas, &api, ahead).await,
        Err(GrantFailure::LeaseIdOutlived),
        "an id stamped a minute ahead: its age cannot be trusted"
    );
    clock.advance(25 * 60_000);
    assert_eq!(ask(3).await, Err(GrantFailure::LeaseIdOutlived));
    assert_eq!(
        get_grant(&*kv, &tenant(), &pool(), &lease(1))
            .await
            .expect("read"),
        None,
        "gone 75 minutes after its commit, the day far from over"
    );
    // A worker that does not remember it (a new leader's) refuses it: never granted twice.
    let fresh_worker = grantor_on(kv.clone(), clock.clone(), leadership);
    assert_eq!(
        fresh_worker.grant(&atlas, &api, request(1, "eu", 10)).await,
        Err(GrantFailure::LeaseIdOutlived),
        "never granted twice"
    );
    let fresh = GrantRequest {
        lease_id: LeaseId::from_parts(clock.now_ms(), 99),
        region: region("eu"),
        want_tokens: 10,
    };
    assert_eq!(
        grantor
            .grant(&tenant(), &pool(), fresh)
            .await
            .expect("a fresh id")
            .granted_tokens,
        10
    );
}

/// A leader whose term has ended cannot grant, even with its old proof of leadership in hand.
async fn a_deposed_leader_cannot_grant(kv: Arc<dyn Kv>) {
    configure(&*kv, 1_000, 100).await;
    let (old, _clock, old_leadership) = leader(kv.clone()).await;
    assert_eq!(
        old.grant(&tenant(), &pool(), request(1, "eu", 10))
            .await
            .expect("grant")
            .granted_tokens,
        10
    );
    // Its lease ends (a long pause, a partition); another node takes over with a higher epoch.
    kv.revoke(old_leadership.lease).await.expect("revoke");
    let new = try_acquire(&*kv, "node-b", "http://b", 30)
        .await
        .expect("store")
        .expect("node b leads");
    assert!(new.epoch > old_leadership.epoch);
    // The old grantor still believes it leads: its write must be fenced off.
    let refused = old.grant(&tenant(), &pool(), request(2, "eu", 10)).await;
    match refused {
        Err(GrantFailure::NotLeader(Some(leader))) => {
            assert_eq!(
                (leader.node_id.as_str(), leader.epoch),
                ("node-b", new.epoch)
            );
        }
        other => {
            panic!("a deposed leader's grant must be refused naming the new leader: {other:?}")
        }
    }
    assert_eq!(
        get_grant(&*kv, &tenant(), &pool(), &lease(2))
            .await
            .expect("read"),
        None,
        "and nothing was written"
    );
    // The new leader grants, stamping its own epoch, and the old grant is still answered as it was.
    let (_sender, role) = watch::channel(Roles::single(Role::Leader(new)));
    let clock: Arc<dyn Clock> = Arc::new(ManualClock::new(T0_MS));
    let grantor = Grantor::new(kv.clone(), clock, role, LeaseClamping::Clamped, None);
    let fresh = grantor
        .grant(&tenant(), &pool(), request(3, "eu", 10))
        .await
        .expect("grant");
    assert_eq!(fresh.epoch, new.epoch);
    let replay = grantor
        .grant(&tenant(), &pool(), request(1, "eu", 99))
        .await
        .expect("grant");
    assert_eq!(
        (replay.granted_tokens, replay.epoch),
        (10, old_leadership.epoch)
    );
}

/// A deposed leader whose cache says the pool is used up still says it does not lead, rather than
/// answer a refusal no store read backs (a partition drill once took that for a grant after the
/// failover).
async fn a_deposed_leader_answers_no_refusal_from_its_cache(kv: Arc<dyn Kv>) {
    configure(&*kv, 100, 100).await;
    let (old, _clock, old_leadership) = leader(kv.clone()).await;
    let granted = old
        .grant(&tenant(), &pool(), request(1, "eu", 100))
        .await
        .expect("grant");
    assert_eq!(granted.granted_tokens, 100);
    let exhausted = old
        .grant(&tenant(), &pool(), request(2, "eu", 10))
        .await
        .expect("a refusal while it leads");
    assert_eq!(exhausted.granted_tokens, 0, "the pool is used up");
    kv.revoke(old_leadership.lease).await.expect("revoke");
    let new = try_acquire(&*kv, "node-b", "http://b", 30)
        .await
        .expect("store")
        .expect("node b leads");
    let answer = old.grant(&tenant(), &pool(), request(3, "us", 10)).await;
    assert!(
        matches!(&answer, Err(GrantFailure::NotLeader(Some(leader))) if leader.epoch == new.epoch),
        "a deposed leader names the new one: {answer:?}"
    );
    // What it did commit is still answered as it was, by a lease id it remembers.
    let repeat = old
        .grant(&tenant(), &pool(), request(1, "eu", 100))
        .await
        .expect("a committed grant's answer");
    assert_eq!(repeat.granted_tokens, 100);
}

fn memory() -> Arc<dyn Kv> {
    Arc::new(MemoryKv::new(Arc::new(ManualClock::new(T0_MS))))
}

async fn etcd(cluster: &EtcdCluster) -> Arc<dyn Kv> {
    Arc::new(
        EtcdKv::connect(&cluster.endpoints())
            .await
            .expect("connect"),
    )
}

macro_rules! on_both_stores {
    ($scenario:ident, $memory_test:ident, $etcd_test:ident) => {
        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $memory_test() {
            $scenario(memory()).await;
        }

        #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
        async fn $etcd_test() {
            let cluster = EtcdCluster::single();
            $scenario(etcd(&cluster).await).await;
        }
    };
}

on_both_stores!(
    concurrent_clients_never_exceed_the_pool,
    memory_concurrent_clients_never_exceed_the_pool,
    etcd_concurrent_clients_never_exceed_the_pool
);
on_both_stores!(
    racing_retries_grant_once,
    memory_racing_retries_grant_once,
    etcd_racing_retries_grant_once
);
on_both_stores!(
    a_replay_says_when_it_was_answered,
    memory_a_replay_says_when_it_was_answered,
    etcd_a_replay_says_when_it_was_answered
);
on_both_stores!(
    tail_exhaustion_and_clamping,
    memory_tail_exhaustion_and_clamping,
    etcd_tail_exhaustion_and_clamping
);
on_both_stores!(
    a_deposed_leader_answers_no_refusal_from_its_cache,
    memory_a_deposed_leader_answers_no_refusal_from_its_cache,
    etcd_a_deposed_leader_answers_no_refusal_from_its_cache
);
on_both_stores!(
    unspent_tokens_come_back_once_and_only_in_their_window,
    memory_unspent_tokens_come_back_once_and_only_in_their_window,
    etcd_unspent_tokens_come_back_once_and_only_in_their_window
);
on_both_stores!(
    a_deposed_leader_cannot_grant,
    memory_a_deposed_leader_cannot_grant,
    etcd_a_deposed_leader_cannot_grant
);

/// A grant record outlives its window by two ledger rounds and an election, however short the
/// window: a leader killed before it fed a grant to the ledger leaves it in the store for the next
/// leader's round, which copies it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_grant_record_outlives_a_short_window_until_a_ledger_round_has_seen_it() {
    let clock = Arc::new(ManualClock::new(T0_MS));
    let kv: Arc<dyn Kv> = Arc::new(MemoryKv::new(clock.clone()));
    let mut one_second = spec(1_000, 100);
    one_second.window_ms = 1_000;
    one_second.lease_ttl_ms = 1_000;
    put_pool(&*kv, &tenant(), &pool(), one_second, T0_MS)
        .await
        .expect("pool configured");
    let leadership = try_acquire(&*kv, "node-a", "http://a", 30)
        .await
        .expect("store")
        .expect("the first node leads");
    let (_role_sender, role) = watch::channel(Roles::single(Role::Leader(leadership)));
    let leader_lease_ttl_ms = 5_000;
    let grantor = Grantor::new(
        kv.clone(),
        clock.clone(),
        role,
        LeaseClamping::Clamped,
        None,
    )
    .with_leader_lease_ttl_ms(leader_lease_ttl_ms);
    grantor
        .grant(&tenant(), &pool(), request(1, "eu", 100))
        .await
        .expect("granted");
    let lifetime_ms = allot_allocator::grants::record_min_lifetime_ms(leader_lease_ttl_ms);
    assert!(
        lifetime_ms
            > 2 * u64::try_from(
                allot_allocator::ledger_sync::LEDGER_RECONCILE_INTERVAL.as_millis()
            )
            .expect("ms"),
        "longer than two rounds"
    );
    // Two windows on (where a window's records used to end), and just short of the lifetime.
    for at_ms in [T0_MS + 2_001, T0_MS + lifetime_ms - 1] {
        clock.set(at_ms);
        assert!(
            get_grant(&*kv, &tenant(), &pool(), &lease(1))
                .await
                .expect("store")
                .is_some(),
            "the record is still in the store {} ms after its commit",
            at_ms - T0_MS
        );
    }
    // Records do go: one window past the lifetime after the window's end.
    clock.set(T0_MS + 1_000 + lifetime_ms + 1_000);
    assert!(
        list_grants(&*kv, &tenant(), &pool())
            .await
            .expect("store")
            .is_empty(),
        "the record expired after its lifetime"
    );
}

/// A node that takes the lead copies into the ledger at once what the last leader committed but
/// never fed it, not a reconciliation period later (by then a short window's records could be gone).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_copies_unfed_grants_into_the_ledger_at_once() {
    let (ledger, _dir) = sqlite_ledger().await;
    let kv = memory();
    configure(&*kv, 1_000, 100).await;
    // The old leader commits a grant and dies before its feed reached the ledger (no feed here).
    let (grantor, clock, leadership) = leader(kv.clone()).await;
    grantor
        .grant(&tenant(), &pool(), request(1, "eu", 100))
        .await
        .expect("granted");
    // This node's sync starts as a follower, then takes the lead.
    let (role_sender, role) = watch::channel(Roles::single(Role::Follower(None)));
    let (_feed_sender, feed) = allot_allocator::ledger_sync::ledger_feed();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let sync = tokio::spawn(allot_allocator::ledger_sync::feed_ledger(
        ledger.clone(),
        allot_allocator::ledger_sync::LedgerRounds::default(),
        kv.clone(),
        clock.clone(),
        role,
        feed,
        async move {
            let _ = stopped.await;
        },
    ));
    let config = spec(1_000, 100).validate().expect("valid");
    let granted = async || {
        ledger
            .windows(&tenant(), &pool(), &config, 1, T0_MS)
            .await
            .expect("ledger")
            .first()
            .map_or(0, |w| w.granted_tokens)
    };
    // A follower's first round copies nothing.
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(granted().await, 0, "a follower does not copy grants");
    role_sender
        .send(Roles::single(Role::Leader(leadership)))
        .expect("the sync listens");
    let mut copied = 0;
    for _ in 0..50 {
        copied = granted().await;
        if copied > 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(
        copied, 100,
        "the new leader's first round copied the grant within 5 s (a round is every 30 s)"
    );
    let _ = stop.send(());
    sync.await.expect("the sync stops");
}

/// With the pools split into shards, a node that takes a shard without coordinating (it does not
/// lead shard 0) copies what that shard's last leader committed but never fed the ledger, itself
/// and at once.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_leader_of_a_shard_copies_its_unfed_grants_without_coordinating() {
    let (ledger, _dir) = sqlite_ledger().await;
    let kv = memory();
    configure(&*kv, 1_000, 100).await;
    let (grantor, clock, leadership) = leader(kv.clone()).await;
    grantor
        .grant(&tenant(), &pool(), request(1, "eu", 100))
        .await
        .expect("granted");
    let (role_sender, role) = watch::channel(Roles::from_shards(vec![
        Role::Follower(None),
        Role::Follower(None),
    ]));
    let (_feed_sender, feed) = allot_allocator::ledger_sync::ledger_feed();
    let (stop, stopped) = tokio::sync::oneshot::channel::<()>();
    let sync = tokio::spawn(allot_allocator::ledger_sync::feed_ledger(
        ledger.clone(),
        allot_allocator::ledger_sync::LedgerRounds::default(),
        kv.clone(),
        clock.clone(),
        role,
        feed,
        async move {
            let _ = stopped.await;
        },
    ));
    let config = spec(1_000, 100).validate().expect("valid");
    let granted = async || {
        ledger
            .windows(&tenant(), &pool(), &config, 1, T0_MS)
            .await
            .expect("ledger")
            .first()
            .map_or(0, |w| w.granted_tokens)
    };
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    assert_eq!(granted().await, 0, "a node leading nothing copies nothing");
    // It takes shard 1; shard 0 (the coordinator's) stays with another node.
    role_sender
        .send(Roles::from_shards(vec![
            Role::Follower(None),
            Role::Leader(leadership),
        ]))
        .expect("the sync listens");
    let mut copied = 0;
    for _ in 0..50 {
        copied = granted().await;
        if copied > 0 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    }
    assert_eq!(copied, 100, "copied within 5 s of taking the shard");
    let _ = stop.send(());
    sync.await.expect("the sync stops");
}

/// Reconciliation reads every pool's records a page at a time: more records than one read holds,
/// over several pools, all reach the ledger.
#[tokio::test]
async fn reconciliation_copies_every_record_across_pages() {
    let (ledger, _dir) = sqlite_ledger().await;
    let kv = memory();
    let records = allot_allocator::kv::MAX_PREFIX_KEYS + 250;
    let eu = RegionId::parse("eu").expect("region");
    let mut leases = Vec::with_capacity(records);
    let mut ops = Vec::new();
    for n in 0..records {
        let tenant = TenantId::parse(&format!("t{}", n % 3)).expect("tenant");
        let pool = PoolId::parse(&format!("p{}", n % 2)).expect("pool");
        let lease_id = LeaseId::from_parts(T0_MS + n as u64, rand::random());
        let record: allot_allocator::pools::GrantRecord =
            serde_json::from_value(serde_json::json!({
            "leaseId": lease_id.to_string(), "region": eu.to_string(), "granted": 1,
            "epoch": 1, "windowStartMs": T0_MS, "windowEndMs": T0_MS + 60_000,
            "expiresAtMs": T0_MS + 30_000, "retryAfterMs": 0 }))
            .expect("a grant record");
        ops.push(allot_allocator::kv::Op::Put {
            key: allot_allocator::pools::grant_key(&tenant, &pool, &lease_id),
            value: serde_json::to_vec(&record).expect("json"),
            lease: None,
        });
        leases.push(lease_id);
        if ops.len() == allot_allocator::kv::MAX_TXN_OPS {
            kv.txn(vec![], std::mem::take(&mut ops)).await.expect("put");
        }
    }
    kv.txn(vec![], ops).await.expect("put");
    assert_eq!(
        ledger.missing_grants(&leases).await.expect("ledger").len(),
        records
    );
    allot_allocator::ledger_sync::reconcile_grants(&ledger, &*kv)
        .await
        .expect("reconciled");
    assert_eq!(
        ledger.missing_grants(&leases).await.expect("ledger"),
        Vec::<LeaseId>::new(),
        "every record of every pool, past one read's cap"
    );
}

/// A ledger on SQLite in a temp dir (kept while the guard lives).
async fn sqlite_ledger() -> (allot_allocator::ledger::Ledger, tempfile::TempDir) {
    let dir = tempfile::tempdir().expect("dir");
    let ledger = allot_allocator::ledger::Ledger::connect(&format!(
        "sqlite://{}",
        dir.path().join("ledger.db").display()
    ))
    .await
    .expect("ledger");
    (ledger, dir)
}
