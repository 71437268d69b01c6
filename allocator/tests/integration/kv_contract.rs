//! One contract for the allocator's store seam, run against the in-process store and a real etcd.
//! Whatever the allocator relies on from etcd must hold for both, and so must the pool records
//! built on it.

use std::sync::Arc;
use std::time::Duration;

use allot_allocator::clock::ManualClock;
use allot_allocator::kv::etcd::EtcdKv;
use allot_allocator::kv::memory::MemoryKv;
use allot_allocator::kv::{Compare, Kv, KvError, Op};
use allot_allocator::pools::{self, BulkOutcome, PoolSpec};
use allot_shared::ids::{PoolId, TenantId};
use allot_testkit::EtcdCluster;

fn put(key: &str, value: &str) -> Op {
    Op::Put {
        key: key.to_owned(),
        value: value.as_bytes().to_vec(),
        lease: None,
    }
}

fn absent(key: &str) -> Compare {
    Compare::ModRevision {
        key: key.to_owned(),
        revision: 0,
    }
}

async fn value_of(kv: &dyn Kv, key: &str) -> Option<String> {
    kv.get(key)
        .await
        .expect("get")
        .map(|v| String::from_utf8(v.value).expect("utf-8"))
}

/// The behaviour both stores must share.
async fn contract(kv: &dyn Kv) {
    // Absent keys read as None; a put is visible with the transaction's revision.
    assert_eq!(kv.get("/c/a").await.expect("get"), None);
    let first = kv.txn(vec![], vec![put("/c/a", "1")]).await.expect("txn");
    assert!(first.succeeded);
    let a = kv.get("/c/a").await.expect("get").expect("present");
    assert_eq!(
        (a.value.as_slice(), a.mod_revision),
        (b"1".as_slice(), first.revision)
    );

    // Create-if-absent: revision 0 means absent.
    let again = kv
        .txn(vec![absent("/c/a")], vec![put("/c/a", "2")])
        .await
        .expect("txn");
    assert!(!again.succeeded, "the key exists");
    assert_eq!(
        value_of(kv, "/c/a").await.as_deref(),
        Some("1"),
        "a failed txn applies nothing"
    );

    // Compare-and-put on the modification revision; all ops of one txn share one new revision.
    let guarded = Compare::ModRevision {
        key: "/c/a".to_owned(),
        revision: a.mod_revision,
    };
    let both = kv
        .txn(
            vec![guarded.clone()],
            vec![put("/c/a", "2"), put("/c/b", "x")],
        )
        .await
        .expect("txn");
    assert!(both.succeeded);
    assert!(
        both.revision > first.revision,
        "revisions strictly increase"
    );
    let b = kv.get("/c/b").await.expect("get").expect("present");
    assert_eq!(b.mod_revision, both.revision);
    assert!(
        !kv.txn(vec![guarded], vec![put("/c/a", "3")])
            .await
            .expect("txn")
            .succeeded
    );

    // Value compares.
    let value_is_2 = Compare::Value {
        key: "/c/a".to_owned(),
        value: b"2".to_vec(),
    };
    assert!(
        kv.txn(vec![value_is_2.clone()], vec![])
            .await
            .expect("txn")
            .succeeded
    );
    let value_is_x = Compare::Value {
        key: "/c/missing".to_owned(),
        value: b"x".to_vec(),
    };
    assert!(
        !kv.txn(vec![value_is_x], vec![])
            .await
            .expect("txn")
            .succeeded
    );

    // Prefix reads: key order, the limit, and nothing outside the prefix.
    for key in ["/c/p/3", "/c/p/1", "/c/p/2", "/c/q/1"] {
        kv.txn(vec![], vec![put(key, key)]).await.expect("txn");
    }
    let keys: Vec<String> = kv
        .get_prefix("/c/p/", 10)
        .await
        .expect("prefix")
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(keys, vec!["/c/p/1", "/c/p/2", "/c/p/3"]);
    assert_eq!(kv.get_prefix("/c/p/", 2).await.expect("prefix").len(), 2);
    // Newest first: the last keys in key order, and a limit that keeps those, not the first.
    let newest: Vec<String> = kv
        .get_prefix_newest("/c/p/", 2)
        .await
        .expect("prefix")
        .into_iter()
        .map(|(k, _)| k)
        .collect();
    assert_eq!(newest, vec!["/c/p/3", "/c/p/2"]);
    // Pages: from the start, then after the last key of each page, to the end of the prefix.
    let page = |after: &'static str, limit: usize| {
        let kv = &kv;
        async move {
            kv.get_prefix_after("/c/p/", after, limit)
                .await
                .expect("page")
                .into_iter()
                .map(|(k, _)| k)
                .collect::<Vec<String>>()
        }
    };
    assert_eq!(page("", 2).await, vec!["/c/p/1", "/c/p/2"]);
    assert_eq!(page("/c/p/2", 2).await, vec!["/c/p/3"]);
    assert_eq!(page("/c/p/3", 2).await, Vec::<String>::new());
    assert_eq!(page("/c/p/1", 10).await, vec!["/c/p/2", "/c/p/3"]);
    assert_eq!(
        page("/c/a", 1).await,
        vec!["/c/p/1"],
        "an `after` before the prefix"
    );
    assert_eq!(
        page("/c/q", 10).await,
        Vec::<String>::new(),
        "an `after` past the prefix's keys: nothing, not an error"
    );
    assert_eq!(
        page("/d", 10).await,
        Vec::<String>::new(),
        "past the whole range"
    );
    // Many reads at once: each answer at its key's place, absent keys as None.
    let keys: Vec<String> = ["/c/p/2", "/c/none", "/c/p/1", "/c/p/2"]
        .map(str::to_owned)
        .to_vec();
    let many = kv.get_many(&keys).await.expect("get many");
    let values: Vec<Option<String>> = many
        .iter()
        .map(|v| {
            v.as_ref()
                .map(|v| String::from_utf8(v.value.clone()).expect("utf-8"))
        })
        .collect();
    let single = value_of(kv, "/c/p/2").await;
    assert_eq!(values.len(), 4);
    assert_eq!(
        (values[0].clone(), values[1].clone(), values[3].clone()),
        (single.clone(), None, single)
    );
    assert_eq!(values[2], value_of(kv, "/c/p/1").await);
    assert_eq!(
        many[0].as_ref().map(|v| v.mod_revision),
        kv.get("/c/p/2").await.expect("get").map(|v| v.mod_revision)
    );
    assert_eq!(kv.get_many(&[]).await.expect("no keys"), Vec::new());
    let too_many: Vec<String> = (0..=allot_allocator::kv::MAX_TXN_OPS)
        .map(|n| format!("/c/{n}"))
        .collect();
    assert!(matches!(
        kv.get_many(&too_many).await,
        Err(KvError::Refused(_))
    ));

    // Deletes.
    kv.txn(
        vec![],
        vec![Op::Delete {
            key: "/c/q/1".to_owned(),
        }],
    )
    .await
    .expect("txn");
    assert_eq!(kv.get("/c/q/1").await.expect("get"), None);

    // Leases: keys die with a revoked lease; a dead lease can neither be kept alive nor written to.
    let lease = kv.grant_lease(30).await.expect("lease");
    assert!(kv.keep_alive(lease).await.expect("keep alive") > 0);
    let leased = Op::Put {
        key: "/c/leased".to_owned(),
        value: b"v".to_vec(),
        lease: Some(lease),
    };
    assert!(
        kv.txn(vec![], vec![leased.clone()])
            .await
            .expect("txn")
            .succeeded
    );
    kv.revoke(lease).await.expect("revoke");
    assert_eq!(
        kv.get("/c/leased").await.expect("get"),
        None,
        "revoked with its lease"
    );
    assert_eq!(
        kv.keep_alive(lease).await,
        Err(KvError::LeaseNotFound(lease))
    );
    assert_eq!(
        kv.txn(vec![], vec![leased]).await,
        Err(KvError::LeaseNotFound(lease))
    );
    kv.revoke(lease).await.expect("revoking twice is fine");
}

#[tokio::test]
async fn memory_store_meets_the_contract() {
    let kv = MemoryKv::new(Arc::new(ManualClock::new(1_000_000)));
    contract(&kv).await;
}

#[tokio::test]
async fn etcd_store_meets_the_contract() {
    let etcd = EtcdCluster::single();
    let kv = EtcdKv::connect(&etcd.endpoints()).await.expect("connect");
    contract(&kv).await;
}

#[tokio::test]
async fn memory_leases_expire_on_the_injected_clock() {
    let clock = Arc::new(ManualClock::new(1_000_000));
    let kv = MemoryKv::new(clock.clone());
    let lease = kv.grant_lease(5).await.expect("lease");
    let op = Op::Put {
        key: "/e".to_owned(),
        value: b"v".to_vec(),
        lease: Some(lease),
    };
    let written = kv.txn(vec![], vec![op]).await.expect("txn");
    clock.advance(4_999);
    assert!(kv.get("/e").await.expect("get").is_some());
    assert_eq!(
        kv.keep_alive(lease).await,
        Ok(5),
        "renewed for 5 s from now"
    );
    clock.advance(4_999);
    assert!(kv.get("/e").await.expect("get").is_some());
    clock.advance(1);
    assert_eq!(kv.get("/e").await.expect("get"), None, "expired");
    // The expiry is a write: it consumed a revision, like etcd's.
    let after = kv.txn(vec![], vec![put("/f", "v")]).await.expect("txn");
    assert_eq!(after.revision, written.revision + 2);
}

#[tokio::test]
async fn etcd_leases_expire() {
    let etcd = EtcdCluster::single();
    let kv = EtcdKv::connect(&etcd.endpoints()).await.expect("connect");
    let lease = kv.grant_lease(1).await.expect("lease");
    let op = Op::Put {
        key: "/e".to_owned(),
        value: b"v".to_vec(),
        lease: Some(lease),
    };
    kv.txn(vec![], vec![op]).await.expect("txn");
    assert!(kv.get("/e").await.expect("get").is_some());
    let mut waited = Duration::ZERO;
    while kv.get("/e").await.expect("get").is_some() {
        assert!(waited < Duration::from_secs(15), "the lease never expired");
        tokio::time::sleep(Duration::from_millis(100)).await;
        waited += Duration::from_millis(100);
    }
    assert!(matches!(
        kv.keep_alive(lease).await,
        Err(KvError::LeaseNotFound(_))
    ));
}

async fn oversized_transactions_are_refused(kv: &dyn Kv) {
    let ops: Vec<Op> = (0..=allot_allocator::kv::MAX_TXN_OPS)
        .map(|n| put(&format!("/big/{n}"), "v"))
        .collect();
    assert!(matches!(
        kv.txn(vec![], ops).await,
        Err(KvError::Refused(_))
    ));
    let fits: Vec<Op> = (0..allot_allocator::kv::MAX_TXN_OPS)
        .map(|n| put(&format!("/big/{n}"), "v"))
        .collect();
    assert!(kv.txn(vec![], fits).await.expect("txn").succeeded);
    // One key written twice in one transaction is refused by both, and nothing is written.
    let twice = vec![
        put("/twice/a", "1"),
        put("/twice/b", "1"),
        put("/twice/a", "2"),
    ];
    assert!(matches!(
        kv.txn(vec![], twice).await,
        Err(KvError::Refused(_))
    ));
    assert_eq!(value_of(kv, "/twice/b").await, None);
}

#[tokio::test]
async fn both_stores_refuse_oversized_transactions() {
    oversized_transactions_are_refused(&MemoryKv::new(Arc::new(ManualClock::new(1)))).await;
    let etcd = EtcdCluster::single();
    let kv = EtcdKv::connect(&etcd.endpoints()).await.expect("connect");
    oversized_transactions_are_refused(&kv).await;
}

fn spec(limit_tokens: u64) -> PoolSpec {
    serde_json::from_value(
        serde_json::json!({ "limit": limit_tokens, "windowMs": 60000,
        "chunk": 10, "leaseTtlMs": 10000, "fallbackPerRegion": 0, "regions": ["eu"] }),
    )
    .expect("a pool spec")
}

/// Bulk pool writes span several store transactions and are idempotent; prefix pages read only
/// their own pools.
async fn bulk_pools_and_prefix_pages(kv: &dyn Kv) {
    let names: Vec<(TenantId, PoolId)> = (0..300)
        .map(|n| {
            (
                TenantId::parse(&format!("t{}", n / 100)).expect("tenant"),
                PoolId::parse(&format!("p{:03}", n % 100)).expect("pool"),
            )
        })
        .collect();
    let with = |limit: u64| -> Vec<(TenantId, PoolId, PoolSpec)> {
        names
            .iter()
            .map(|(tenant, pool)| (tenant.clone(), pool.clone(), spec(limit)))
            .collect()
    };
    let outcomes = |written: &[(pools::StoredPool, BulkOutcome)], wanted| {
        written.iter().filter(|(_, o)| *o == wanted).count()
    };
    let created = pools::put_pools(kv, &with(100), 1).await.expect("bulk");
    assert_eq!(outcomes(&created, BulkOutcome::Created), 300);
    assert!(created.iter().all(|(stored, _)| stored.version == 1));
    let again = pools::put_pools(kv, &with(100), 2).await.expect("bulk");
    assert_eq!(
        outcomes(&again, BulkOutcome::Unchanged),
        300,
        "a repeat writes nothing"
    );
    assert!(
        again
            .iter()
            .all(|(stored, _)| stored.version == 1 && stored.updated_at_ms == 1)
    );
    // 130 changed across the 128-pool transactions, one new, the rest as they were.
    let mut mixed = with(100);
    for entry in &mut mixed[100..230] {
        entry.2 = spec(200);
    }
    mixed.push((
        TenantId::parse("t9").expect("tenant"),
        PoolId::parse("new").expect("pool"),
        spec(50),
    ));
    let written = pools::put_pools(kv, &mixed, 3).await.expect("bulk");
    assert_eq!(outcomes(&written, BulkOutcome::Updated), 130);
    assert_eq!(outcomes(&written, BulkOutcome::Created), 1);
    assert_eq!(outcomes(&written, BulkOutcome::Unchanged), 170);
    let (stored, _) = pools::get_pool(kv, &names[150].0, &names[150].1)
        .await
        .expect("get")
        .expect("present");
    assert_eq!((stored.version, stored.spec.limit_tokens), (2, 200));

    let prefix = |text: &str| pools::PoolPrefix::parse(text).expect("a prefix");
    let tenant_1 = pools::list_pools_matching(kv, &prefix("t1/"))
        .await
        .expect("list");
    assert_eq!(tenant_1.len(), 100);
    assert!(
        tenant_1
            .iter()
            .all(|(tenant, _, _)| tenant.as_str() == "t1")
    );
    assert_eq!(
        pools::list_pools_matching(kv, &prefix("t"))
            .await
            .expect("list")
            .len(),
        301
    );
    let page = pools::list_pools_page(kv, &prefix("t1/p05"), None, 5)
        .await
        .expect("page");
    let pool_names = |page: &[(TenantId, PoolId, pools::StoredPool)]| -> Vec<String> {
        page.iter().map(|(_, pool, _)| pool.to_string()).collect()
    };
    assert_eq!(pool_names(&page), ["p050", "p051", "p052", "p053", "p054"]);
    let after = page.last().map(|(t, p, _)| (t.clone(), p.clone()));
    let next = pools::list_pools_page(kv, &prefix("t1/p05"), after.as_ref(), 10)
        .await
        .expect("page");
    assert_eq!(pool_names(&next), ["p055", "p056", "p057", "p058", "p059"]);
    let bad = pools::put_pools(kv, &[(names[0].0.clone(), names[0].1.clone(), spec(0))], 4).await;
    assert!(matches!(bad, Err(pools::PoolStoreError::Invalid(_))));
}

#[tokio::test]
async fn both_stores_write_pools_in_bulk_and_page_by_prefix() {
    bulk_pools_and_prefix_pages(&MemoryKv::new(Arc::new(ManualClock::new(1)))).await;
    let etcd = EtcdCluster::single();
    let kv = EtcdKv::connect(&etcd.endpoints()).await.expect("connect");
    bulk_pools_and_prefix_pages(&kv).await;
}
