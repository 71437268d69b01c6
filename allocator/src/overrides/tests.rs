use allot_shared::clock::ManualClock;
use allot_shared::contract::PrincipalType;
use allot_shared::keys::PrincipalHash;

use super::*;
use crate::kv::memory::MemoryKv;
use crate::pools::{PoolSpec, get_pool, put_pool};

fn tenant() -> TenantId {
    TenantId::parse("acme").expect("tenant")
}

fn pool() -> PoolId {
    PoolId::parse("api").expect("pool")
}

fn id(n: u64) -> RecordId {
    RecordId::from_parts(1_000 + n, u128::from(n))
}

fn raise(limit_tokens: u64, expires_at_ms: Option<u64>) -> NewOverride {
    NewOverride {
        tenant: tenant(),
        target: Target::Pool {
            pool: pool(),
            limit_tokens,
        },
        expires_at_ms,
        reason: "launch week".to_owned(),
        created_by: "operator:test".to_owned(),
    }
}

async fn store_with_pool() -> MemoryKv {
    let kv = MemoryKv::new(Arc::new(ManualClock::new(0)));
    let spec: PoolSpec = serde_json::from_value(serde_json::json!({
        "limit": 1000, "windowMs": 60000, "chunk": 100, "leaseTtlMs": 5000,
        "fallbackPerRegion": 0, "regions": ["eu"] }))
    .expect("spec");
    put_pool(&kv, &tenant(), &pool(), spec, 0)
        .await
        .expect("pool");
    kv
}

#[tokio::test]
async fn a_pool_override_reaches_the_pool_record_and_ends_there_too() {
    let kv = store_with_pool().await;
    let created = create(&kv, raise(5_000, Some(90_000)), id(1), 10_000)
        .await
        .expect("created");
    let (stored, _) = get_pool(&kv, &tenant(), &pool())
        .await
        .expect("read")
        .expect("pool");
    assert_eq!(stored.version, 2, "the pool's version went up");
    assert_eq!(stored.limit_at(9_999), 1_000);
    assert_eq!(stored.limit_at(10_000), 5_000);
    assert_eq!(stored.limit_at(90_000), 1_000);

    // A second one of the same pool is refused while the first is in force.
    let again = create(&kv, raise(7_000, None), id(2), 20_000).await;
    assert!(
        matches!(again, Err(OverrideStoreError::Conflict(_))),
        "{again:?}"
    );

    let ended = end(&kv, &tenant(), &created.id, 30_000)
        .await
        .expect("ended");
    assert_eq!(ended.expires_at_ms, Some(30_000));
    let (stored, _) = get_pool(&kv, &tenant(), &pool())
        .await
        .expect("read")
        .expect("pool");
    assert_eq!(stored.limit_at(29_999), 5_000);
    assert_eq!(stored.limit_at(30_000), 1_000);
    // Ending twice changes nothing; now a new one may start.
    assert_eq!(end(&kv, &tenant(), &created.id, 40_000).await, Ok(ended));
    create(&kv, raise(7_000, None), id(2), 40_000)
        .await
        .expect("a new one once the first ended");
    let unknown = NewOverride {
        target: Target::Pool {
            pool: PoolId::parse("nope").expect("pool"),
            limit_tokens: 5,
        },
        ..raise(5, None)
    };
    assert_eq!(
        create(&kv, unknown, id(3), 40_000).await,
        Err(OverrideStoreError::UnknownPool)
    );
}

#[tokio::test]
async fn a_change_made_behind_a_leader_ahead_takes_effect_inside_its_window() {
    let kv = store_with_pool().await;
    // The leader, its clock ahead, has granted in the window from 60 s.
    let window = StoredWindow {
        window_start_ms: 60_000,
        window_end_ms: 120_000,
        granted_by_region: [(
            allot_shared::ids::RegionId::parse("eu").expect("region"),
            900,
        )]
        .into_iter()
        .collect(),
        returned_tokens: 0,
    };
    let put_window = Op::Put {
        key: window_key(&tenant(), &pool()),
        value: encode(&window),
        lease: None,
    };
    assert!(
        kv.txn(vec![], vec![put_window])
            .await
            .expect("txn")
            .succeeded
    );
    let lowered = create(&kv, raise(100, None), id(1), 59_998)
        .await
        .expect("created");
    assert_eq!(
        lowered.starts_at_ms, 60_001,
        "not before the window's grants"
    );
    let ended = end(&kv, &tenant(), &lowered.id, 60_000)
        .await
        .expect("ended");
    assert_eq!(ended.expires_at_ms, Some(60_001));
}

#[tokio::test]
async fn the_set_agents_get_is_every_rule_override_at_the_stores_version() {
    let kv = store_with_pool().await;
    let cache = SetCache::default();
    assert_eq!(cache.current(&kv).await.expect("set").version, 0);
    create(&kv, raise(5_000, None), id(1), 1_000)
        .await
        .expect("pool override");
    let rule = NewOverride {
        target: Target::Rule {
            rule: RuleId::parse("read-user").expect("rule"),
            principal: Some(OverridePrincipal {
                kind: PrincipalType::User,
                hash: PrincipalHash::parse("00000000000000aa").expect("hash"),
            }),
            amounts: RuleAmounts {
                capacity_millis: Some(50_000),
                ..RuleAmounts::default()
            },
        },
        ..raise(0, Some(5_000))
    };
    create(&kv, rule, id(2), 1_000)
        .await
        .expect("rule override");
    let set = cache.current(&kv).await.expect("set");
    assert_eq!(set.version, 2);
    assert_eq!(
        set.overrides.len(),
        1,
        "pool overrides are the allocator's own"
    );
    assert_eq!(set.overrides[0].id, id(2));
    assert!(set.as_ref().clone().verify().is_ok());
    // The same version is the same set, even after the override ended on the clock.
    assert_eq!(cache.current(&kv).await.expect("set"), set);

    // Ended ones leave the store after they were kept long enough, with a new version.
    assert_eq!(
        remove_ended(&kv, 5_000 + ENDED_OVERRIDE_KEPT_MS - 1).await,
        Ok(0)
    );
    assert_eq!(
        remove_ended(&kv, 5_000 + ENDED_OVERRIDE_KEPT_MS).await,
        Ok(1)
    );
    let after = cache.current(&kv).await.expect("set");
    assert_eq!((after.version, after.overrides.len()), (3, 0));
    let (listed, next) = list(&kv, None, None, 10).await.expect("list");
    assert_eq!((listed.len(), next), (1, None));
}

#[tokio::test]
async fn listing_pages_with_a_cursor_and_bounds_hold() {
    let kv = store_with_pool().await;
    for n in 0..5 {
        let rule = NewOverride {
            tenant: TenantId::parse(&format!("t{n}")).expect("tenant"),
            target: Target::Rule {
                rule: RuleId::parse("r").expect("rule"),
                principal: None,
                amounts: RuleAmounts {
                    limit: Some(n + 1),
                    ..RuleAmounts::default()
                },
            },
            ..raise(0, None)
        };
        create(&kv, rule, id(n), 1_000).await.expect("created");
    }
    let (first, next) = list(&kv, None, None, 2).await.expect("page");
    let (second, next) = list(&kv, None, next.as_deref(), 2).await.expect("page");
    let (third, next) = list(&kv, None, next.as_deref(), 2).await.expect("page");
    let tenants: Vec<String> = first
        .iter()
        .chain(&second)
        .chain(&third)
        .map(|o| o.tenant.to_string())
        .collect();
    assert_eq!(tenants, ["t0", "t1", "t2", "t3", "t4"]);
    assert_eq!(next, None);
    let (one, _) = list(&kv, Some(&TenantId::parse("t3").expect("t")), None, 10)
        .await
        .expect("tenant");
    assert_eq!(one.len(), 1);
}

#[test]
fn a_pool_keeps_every_override_a_kept_window_was_held_to() {
    let spec: PoolSpec = serde_json::from_value(serde_json::json!({
        "limit": 1000, "windowMs": 60000, "chunk": 100, "leaseTtlMs": 5000,
        "fallbackPerRegion": 0, "regions": ["eu"] }))
    .expect("spec");
    let mut pool = StoredPool {
        spec,
        version: 1,
        updated_at_ms: 0,
        overrides: Vec::new(),
    };
    let now_ms = 1_000_000;
    let ended = |n: u64| PoolOverride {
        id: id(n),
        limit_tokens: n + 1,
        starts_at_ms: n * 10,
        expires_at_ms: Some(n * 10 + 5),
    };
    for n in 0..MAX_POOL_OVERRIDES_KEPT as u64 {
        pool.overrides = kept_on_pool(&pool, ended(n), now_ms).expect("kept");
    }
    // One more is refused, not kept by forgetting one a window was held to.
    let open = PoolOverride {
        id: id(99),
        limit_tokens: 5,
        starts_at_ms: 500,
        expires_at_ms: None,
    };
    assert!(matches!(
        kept_on_pool(&pool, open.clone(), now_ms),
        Err(OverrideStoreError::Conflict(_))
    ));
    // Ending one changes it in place.
    let touched = PoolOverride {
        expires_at_ms: Some(3),
        ..ended(0)
    };
    let kept = kept_on_pool(&pool, touched, now_ms).expect("kept");
    assert_eq!(kept.len(), MAX_POOL_OVERRIDES_KEPT);
    // Once the oldest ended ones have been kept as long as the ledger keeps windows, they go.
    let later = 5 + ENDED_POOL_OVERRIDE_KEPT_MS;
    let kept = kept_on_pool(&pool, open, later).expect("kept");
    assert_eq!(kept.len(), MAX_POOL_OVERRIDES_KEPT);
    assert!(kept.iter().all(|o| o.id != id(0)) && kept.iter().any(|o| o.id == id(99)));
}

#[test]
fn an_override_takes_effect_after_the_pools_latest_grants() {
    let read = |window_start_ms: Option<u64>| PoolRead {
        stored: StoredPool {
            spec: serde_json::from_value(serde_json::json!({
                "limit": 1000, "windowMs": 60000, "chunk": 100, "leaseTtlMs": 5000,
                "fallbackPerRegion": 0, "regions": ["eu"] }))
            .expect("spec"),
            version: 1,
            updated_at_ms: 0,
            overrides: Vec::new(),
        },
        pool_revision: 1,
        window_revision: 0,
        window_start_ms,
    };
    assert_eq!(read(None).effective_ms(5_000), 5_000);
    assert_eq!(read(Some(0)).effective_ms(5_000), 5_000);
    // The leader, its clock ahead, granted in a window that starts after this clock's now:
    // the change takes effect inside that window, not before it.
    assert_eq!(read(Some(60_000)).effective_ms(59_998), 60_001);
}
