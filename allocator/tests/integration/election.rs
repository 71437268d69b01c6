//! The election loop when the store stops answering: a leader whose lease renewals hang steps down
//! before its lease could have expired, instead of claiming leadership while blocked in the call.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use allot_allocator::clock::{Clock, ManualClock};
use allot_allocator::kv::memory::MemoryKv;
use allot_allocator::kv::{Compare, Kv, KvError, Op, TxnOutcome, Versioned};
use allot_allocator::leader::{ElectionConfig, Role, run_election};
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
    let (role_sender, mut role) = watch::channel(Role::Unknown);
    let (stop, stopped) = watch::channel(false);
    let election = tokio::spawn(run_election(
        kv.clone(),
        clock.clone() as Arc<dyn Clock>,
        ElectionConfig {
            node_id: "a".to_owned(),
            advertise_url: "http://a".to_owned(),
            lease_ttl_s: 3,
        },
        role_sender,
        async move {
            let mut stopped = stopped;
            let _ = stopped.wait_for(|s| *s).await;
        },
    ));
    let first = match role
        .wait_for(|r| matches!(r, Role::Leader(_)))
        .await
        .expect("leads")
        .clone()
    {
        Role::Leader(leadership) => leadership,
        other => panic!("waited for leadership, got {other:?}"),
    };

    // The store stops answering renewals; two thirds of the TTL pass on the allocator's clock.
    kv.hang.store(true, Ordering::SeqCst);
    clock.advance(2_000);
    // (The role's read guard is dropped at once: the election loop writes the role again.)
    let stepped_down = tokio::time::timeout(
        Duration::from_secs(10),
        role.wait_for(|r| !matches!(r, Role::Leader(l) if *l == first)),
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
