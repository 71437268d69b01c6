//! The election loop when the store stops answering: a leader whose lease renewals hang steps down
//! before its lease could have expired, instead of claiming leadership while blocked in the call.
//! And shards: several processes split them evenly, one leader each, and a process that stops
//! or joins moves only the shards it must.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use allot_allocator::clock::{Clock, ManualClock};
use allot_allocator::kv::memory::MemoryKv;
use allot_allocator::kv::{Compare, Kv, KvError, Op, TxnOutcome, Versioned};
use allot_allocator::leader::{ElectionConfig, Roles, run_election};
use allot_shared::shards::ShardCount;
use tokio::sync::watch;

/// The embedded store, whose lease renewals can be made to hang.
struct HangingRenewals {
    inner: MemoryKv,
    hang: AtomicBool,
}

#[async_trait::async_trait]
impl Kv for HangingRenewals {
    async fn get(&self, key: &str) -> Result<Option<Versioned>, KvError> {
        self.inner.get(key).await
    }

    async fn get_many(&self, keys: &[String]) -> Result<Vec<Option<Versioned>>, KvError> {
        self.inner.get_many(keys).await
    }

    async fn get_prefix_newest(
        &self,
        prefix: &str,
        limit: usize,
    ) -> Result<Vec<(String, Versioned)>, KvError> {
        self.inner.get_prefix_newest(prefix, limit).await
    }

    async fn get_prefix_after(
        &self,
        prefix: &str,
        after: &str,
        limit: usize,
    ) -> Result<Vec<(String, Versioned)>, KvError> {
        self.inner.get_prefix_after(prefix, after, limit).await
    }

    async fn txn(&self, compares: Vec<Compare>, ops: Vec<Op>) -> Result<TxnOutcome, KvError> {
        self.inner.txn(compares, ops).await
    }

    async fn grant_lease(&self, ttl_s: i64) -> Result<i64, KvError> {
        self.inner.grant_lease(ttl_s).await
    }

    async fn keep_alive(&self, lease: i64) -> Result<i64, KvError> {
        if self.hang.load(Ordering::SeqCst) {
            std::future::pending::<()>().await;
        }
        self.inner.keep_alive(lease).await
    }

    async fn revoke(&self, lease: i64) -> Result<(), KvError> {
        self.inner.revoke(lease).await
    }
}

#[tokio::test(start_paused = true)]
async fn a_leader_whose_renewals_hang_steps_down_before_its_lease_could_expire() {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let kv = Arc::new(HangingRenewals {
        inner: MemoryKv::new(clock.clone() as Arc<dyn Clock>),
        hang: AtomicBool::new(false),
    });
    let (role_sender, mut role) = watch::channel(Roles::unknown(ShardCount::ONE));
    let (stop, stopped) = watch::channel(false);
    let election = tokio::spawn(run_election(
        kv.clone(),
        clock.clone() as Arc<dyn Clock>,
        ElectionConfig {
            node_id: "a".to_owned(),
            advertise_url: "http://a".to_owned(),
            lease_ttl_s: 3,
            shard_count: ShardCount::ONE,
        },
        role_sender,
        async move {
            let mut stopped = stopped;
            let _ = stopped.wait_for(|s| *s).await;
        },
    ));
    let first = role
        .wait_for(|r| r.coordinating().is_some())
        .await
        .expect("leads")
        .coordinating()
        .expect("leads");

    // The store stops answering renewals; two thirds of the TTL pass on the allocator's clock.
    kv.hang.store(true, Ordering::SeqCst);
    clock.advance(2_000);
    // (The role's read guard is dropped at once: the election loop writes the role again.)
    let stepped_down = tokio::time::timeout(
        Duration::from_secs(10),
        role.wait_for(|r| r.coordinating() != Some(first)),
    )
    .await
    .is_ok_and(|changed| changed.is_ok());
    assert!(
        stepped_down,
        "the leader kept claiming while its renewal hung"
    );
    let _ = stop.send(true);
    let _ = election.await;
}

/// One process of a sharded store: its roles, and how to stop it.
struct Process {
    roles: watch::Receiver<Roles>,
    stop: watch::Sender<bool>,
    task: tokio::task::JoinHandle<()>,
}

fn start(kv: &Arc<MemoryKv>, clock: &Arc<ManualClock>, node: &str, shards: ShardCount) -> Process {
    let (role_sender, roles) = watch::channel(Roles::unknown(shards));
    let (stop, stopped) = watch::channel(false);
    let task = tokio::spawn(run_election(
        kv.clone(),
        clock.clone() as Arc<dyn Clock>,
        ElectionConfig {
            node_id: node.to_owned(),
            advertise_url: format!("http://{node}"),
            lease_ttl_s: 3,
            shard_count: shards,
        },
        role_sender,
        async move {
            let mut stopped = stopped;
            let _ = stopped.wait_for(|s| *s).await;
        },
    ));
    Process { roles, stop, task }
}

/// Who leads each shard, by the processes' own roles: `None` where no process claims it; panics
/// when two do.
fn claimed(processes: &[(&str, &Process)], shards: ShardCount) -> Vec<Option<String>> {
    shards
        .shards()
        .map(|shard| {
            let claiming: Vec<&str> = processes
                .iter()
                .filter(|(_, p)| p.roles.borrow().leadership(shard).is_some())
                .map(|(name, _)| *name)
                .collect();
            assert!(claiming.len() <= 1, "shard {shard} claimed by {claiming:?}");
            claiming.first().map(|name| (*name).to_owned())
        })
        .collect()
}

/// Lets rounds run (a second of paused time each) until `done` holds of who leads what, checking
/// after every round that no shard has two leaders; panics after `rounds`.
async fn rounds_until(
    processes: &[(&str, &Process)],
    shards: ShardCount,
    rounds: u32,
    done: impl Fn(&[Option<String>]) -> bool,
) -> Vec<Option<String>> {
    for _ in 0..rounds {
        tokio::time::sleep(Duration::from_secs(1)).await;
        let leaders = claimed(processes, shards);
        if done(&leaders) {
            return leaders;
        }
    }
    panic!("not settled: {:?}", claimed(processes, shards));
}

fn loads(leaders: &[Option<String>], names: &[&str]) -> Vec<usize> {
    names
        .iter()
        .map(|name| {
            leaders
                .iter()
                .filter(|l| l.as_deref() == Some(*name))
                .count()
        })
        .collect()
}

#[tokio::test(start_paused = true)]
async fn processes_split_the_shards_and_move_only_what_they_must() {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let kv = Arc::new(MemoryKv::new(clock.clone() as Arc<dyn Clock>));
    let shards = ShardCount::new(8).expect("count");

    // One process leads every shard.
    let a = start(&kv, &clock, "a", shards);
    let alone = rounds_until(&[("a", &a)], shards, 10, |l| l.iter().all(Option::is_some)).await;
    assert_eq!(loads(&alone, &["a"]), vec![8]);
    let epochs_before: Vec<_> = shards
        .shards()
        .map(|s| a.roles.borrow().leadership(s).expect("a leads").epoch)
        .collect();

    // Two more join: each takes its share (3, 3, 2), a shard a round from each above its share.
    let b = start(&kv, &clock, "b", shards);
    let c = start(&kv, &clock, "c", shards);
    let three = [("a", &a), ("b", &b), ("c", &c)];
    let balanced = |l: &[Option<String>]| {
        let mut loads = loads(l, &["a", "b", "c"]);
        loads.sort_unstable();
        l.iter().all(Option::is_some) && loads == vec![2, 3, 3]
    };
    let split = rounds_until(&three, shards, 30, balanced).await;
    // What stayed with `a` kept its epoch: only the shards handed over changed leader.
    let kept = shards
        .shards()
        .filter(|s| split[s.0 as usize].as_deref() == Some("a"))
        .filter(|s| {
            a.roles.borrow().leadership(*s).map(|l| l.epoch) == Some(epochs_before[s.0 as usize])
        })
        .count();
    assert_eq!(kept, loads(&split, &["a"])[0]);
    // Settled: more rounds move nothing.
    for _ in 0..5 {
        tokio::time::sleep(Duration::from_secs(1)).await;
        assert_eq!(claimed(&three, shards), split);
    }

    // `c` stops (revoking its lease): its shards go to the other two at once, 4 and 4; the shards
    // `a` and `b` led stay where they were.
    let _ = c.stop.send(true);
    let _ = c.task.await;
    let two = [("a", &a), ("b", &b)];
    let after = rounds_until(&two, shards, 10, |l| {
        l.iter().all(Option::is_some) && loads(l, &["a", "b"]) == vec![4, 4]
    })
    .await;
    for shard in 0..8 {
        if split[shard].as_deref() != Some("c") {
            assert_eq!(after[shard], split[shard], "shard {shard} moved needlessly");
        }
    }
    let _ = a.stop.send(true);
    let _ = b.stop.send(true);
    let _ = a.task.await;
    let _ = b.task.await;
}
