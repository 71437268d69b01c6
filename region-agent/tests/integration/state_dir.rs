//! An agent restarted while its allocator is unreachable keeps its region up (I13), and a killed
//! agent's admits still reach the ledger: the state directory keeps the last bundle, every pool's
//! terms, pending report lines and durable fallback claims. Each "process" here is a fresh agent on
//! the same directory; a killed one is dropped without its final reports.

use std::sync::Arc;

use allot_region_agent::allocator_client::AllocatorClient;
use allot_region_agent::clock::SystemClock;
use allot_region_agent::service::{Agent, FALLBACK_CLAIM_BLOCKS};
use allot_region_agent::state_dir::{StateDir, StateFile};
use allot_shared::clock::ManualClock;
use allot_shared::contract::{AdmissionRequest, DeniedScope, Principal, PrincipalType, Reason};
use allot_shared::ids::{DecisionId, RegionId, RouteGroup, TenantId};

use crate::common;

use crate::common::allocator::{Allocator, client};

/// A per-user bucket on `read`, and the tenant's global pool.
const BUNDLE: &str = r#"{ "bundleVersion": 7, "rules": [
    { "id": "user-read", "scope": "user", "routeGroup": "read", "algorithm": "fixed_window",
      "limit": 1000, "windowMs": 3600000, "failMode": "closed" },
    { "id": "global-api", "scope": "global", "pool": "api", "failMode": "closed" } ] }"#;

fn request(n: u64, user: &str) -> AdmissionRequest {
    AdmissionRequest {
        request_id: DecisionId::parse(&format!("s-{n}")).expect("id"),
        tenant_id: TenantId::parse("atlas").expect("tenant"),
        principal: Principal {
            kind: PrincipalType::User,
            id: user.to_owned(),
            api_key_id: None,
        },
        route_group: RouteGroup::parse("read").expect("route"),
        method: "GET".to_owned(),
        cost_hint: 1,
        policy_epoch: None,
        dry_run: false,
        metered: false,
    }
}

/// An allocator nobody answers at: connections are refused at once.
fn unreachable() -> Arc<AllocatorClient> {
    Arc::new(
        AllocatorClient::new(
            vec!["http://127.0.0.1:9".to_owned()],
            "agent-token-0123456789".to_owned(),
        )
        .expect("client"),
    )
}

/// Half past 10:00 on 2026-12-01 (UTC): the tests' hour-long windows never end under them.
const MID_HOUR_MS: u64 = 1_796_119_200_000 + 1_800_000;

/// An agent on the system clock, cut off from the allocator, that keeps its state in `state`
/// (nothing restored yet).
fn cut_off_agent_on(state: StateDir) -> Arc<Agent> {
    let agent = common::agent(
        common::settings(),
        Arc::new(SystemClock),
        Some(unreachable()),
        None,
    );
    agent.set_state_dir(state);
    agent
}

fn clock() -> Arc<ManualClock> {
    Arc::new(ManualClock::new(MID_HOUR_MS))
}

/// A "process": an agent on `dir` reading `clock`, with the bundle only if given (as
/// `--policy-file` would).
fn start(
    dir: &std::path::Path,
    clock: &Arc<ManualClock>,
    allocator: Arc<AllocatorClient>,
    bundle: Option<&str>,
) -> Arc<Agent> {
    let agent = common::agent(
        common::settings(),
        clock.clone(),
        Some(allocator),
        bundle.map(common::bundle),
    );
    agent.set_state_dir(
        StateDir::open(dir, RegionId::parse("eu").expect("region")).expect("state dir"),
    );
    agent.restore_state();
    agent
}

/// Admits `count` requests; returns (allowed, of them in fallback).
async fn admit(agent: &Arc<Agent>, first: u64, count: u64) -> (u64, u64) {
    let (mut allowed, mut fallback) = (0, 0);
    for n in first..first + count {
        let decision = agent
            .admit(&request(n, &format!("U-{}", n % 7)))
            .await
            .expect("decision");
        if decision.allowed {
            allowed += 1;
            fallback += u64::from(decision.fallback);
        } else {
            assert_eq!(
                decision.denied_scope,
                Some(DeniedScope::Global),
                "{decision:?}"
            );
            assert_eq!(decision.reason, Some(Reason::RateExceeded), "{decision:?}");
        }
    }
    (allowed, fallback)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_during_a_partition_serves_from_the_saved_state_and_loses_no_admit() {
    let dir = tempfile::tempdir().expect("temp dir");
    let allowance = 40;
    let clock = clock();
    let fake = Allocator::with_clock(1_000, 10, allowance, clock.clone());

    // 1. Connected: the allocator's bundle is installed and kept; 25 admits from leases.
    let first = start(dir.path(), &clock, client(fake.clone()).await, None);
    assert!(first.offer_bundle(common::bundle(BUNDLE)));
    first.save_bundle().await;
    let (allowed, fallback) = admit(&first, 0, 25).await;
    assert_eq!((allowed, fallback), (25, 0));
    first.write_journal_if_changed().await;
    // Killed: no final reports. The ledger has heard nothing yet.
    drop(first);
    assert_eq!(fake.reported_spent(), 0);

    // 2. Restarted while the allocator is unreachable: the saved bundle and pool terms decide at
    // once; global rules from the fallback allowance, never past it.
    let second = start(dir.path(), &clock, unreachable(), None);
    assert_eq!(second.bundle().map(|b| b.version()), Some(7));
    assert_eq!(
        second.pool_counts().0,
        1,
        "the pool's terms came from the directory"
    );
    let (allowed, fallback) = admit(&second, 100, 30).await;
    assert_eq!(
        (allowed, fallback),
        (30, 30),
        "regional rules as usual, global from fallback"
    );
    second.write_journal_if_changed().await;
    drop(second);

    // 3. Restarted again, still cut off, in the same window: what is left of the allowance, less
    // at most one claim block the killed process claimed and may have used.
    let third = start(dir.path(), &clock, unreachable(), None);
    let (allowed, fallback) = admit(&third, 200, 30).await;
    assert_eq!(allowed, fallback);
    let block = allowance / FALLBACK_CLAIM_BLOCKS;
    assert!(
        (allowance - 30 - block..=allowance - 30).contains(&allowed),
        "{allowed} admitted after 30 of {allowance} (a claim block is {block})"
    );
    third.write_journal_if_changed().await;
    drop(third);

    // 4. The allocator is back: the admits of every incarnation reach the ledger, the first one's
    // leases reported final with what the journal said they spent.
    let fourth = start(dir.path(), &clock, client(fake.clone()).await, None);
    fourth.send_reports().await;
    assert_eq!(
        fake.reported_spent(),
        25,
        "the killed process's lease spends"
    );
    let fallback_reported = fake.reported_fallback();
    assert_eq!(
        fallback_reported,
        30 + allowed,
        "both partitioned incarnations' fallback"
    );
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_damaged_or_foreign_state_directory_is_ignored_not_fatal() {
    let dir = tempfile::tempdir().expect("temp dir");
    let clock = clock();
    let fake = Allocator::with_clock(1_000, 10, 5, clock.clone());
    let first = start(dir.path(), &clock, client(fake.clone()).await, Some(BUNDLE));
    admit(&first, 0, 3).await;
    first.write_journal_if_changed().await;
    drop(first);
    // Another region's agent finds nothing it may use.
    let us = cut_off_agent_on(
        StateDir::open(dir.path(), RegionId::parse("us").expect("region")).expect("dir"),
    );
    let restored = us.restore_state();
    assert_eq!(restored.pools, 0);
    // A corrupt journal is ignored; the agent starts empty and serves what it can.
    let journal = dir.path().join(StateFile::Journal.name());
    let mut bytes = std::fs::read(&journal).expect("journal");
    let middle = bytes.len() / 2;
    bytes[middle] ^= 0x55;
    std::fs::write(&journal, bytes).expect("write");
    let agent = start(dir.path(), &clock, unreachable(), Some(BUNDLE));
    assert_eq!(agent.pool_counts().0, 0);
    let decision = agent.admit(&request(9, "U-1")).await.expect("decision");
    assert_eq!(
        decision.reason,
        Some(Reason::LimiterUnavailable),
        "no terms: fails closed"
    );
}

/// A bundle restored from the directory ages from when the allocator last confirmed it (as the
/// journal says), so `strict` rules keep their maximum age across a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restored_bundle_keeps_aging_from_its_last_confirmation() {
    use allot_region_agent::clock::Clock;
    use allot_region_agent::service::AgentSettings;
    use allot_region_agent::state_dir::{Journal, SavedBundle};

    const STRICT: &str = r#"{ "bundleVersion": 3, "rules": [
        { "id": "user-read", "scope": "user", "routeGroup": "read", "algorithm": "fixed_window",
          "limit": 1000, "windowMs": 3600000, "failMode": "closed", "strict": true } ] }"#;
    let dir = tempfile::tempdir().expect("temp dir");
    let eu = RegionId::parse("eu").expect("region");
    let state = StateDir::open(dir.path(), eu).expect("dir");
    state
        .write(
            StateFile::Bundle,
            &SavedBundle {
                bundle: common::bundle(STRICT).to_json(),
            },
        )
        .expect("bundle saved");
    let hour_ms = 3_600_000;
    for (confirmed_hours_ago, stale) in [(2, true), (0, false)] {
        state
            .write(
                StateFile::Journal,
                &Journal {
                    written_at_ms: SystemClock.now_ms(),
                    bundle_confirmed_at_ms: SystemClock.now_ms() - confirmed_hours_ago * hour_ms,
                    pools: Vec::new(),
                },
            )
            .expect("journal written");
        let settings = AgentSettings {
            policy_max_age_ms: hour_ms,
            ..common::settings()
        };
        let agent = common::agent(settings, Arc::new(SystemClock), Some(unreachable()), None);
        agent.set_state_dir(state.clone());
        assert_eq!(agent.restore_state().bundle_version, Some(3));
        assert_eq!(agent.bundle_is_stale(), stale);
        let decision = agent.admit(&request(1, "U-1")).await.expect("decision");
        if stale {
            assert_eq!(
                decision.reason,
                Some(Reason::LimiterUnavailable),
                "{decision:?}"
            );
            assert_eq!(decision.policy_id.as_deref(), Some("user-read"));
        } else {
            assert!(decision.allowed, "{decision:?}");
        }
    }
}

/// The operators' rule overrides the agent last took survive a restart while the allocator is
/// away: the new run lays them over the restored bundle; a tampered file is ignored.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_restart_keeps_the_overrides_it_last_verified() {
    use allot_region_agent::clock::Clock;
    use allot_region_agent::state_dir::SavedBundle;
    use allot_shared::overrides::{OverrideSet, RuleAmounts, RuleOverride};
    const READ_RULE: &str = r#"{ "bundleVersion": 3, "rules": [
        { "id": "user-read", "scope": "user", "routeGroup": "read", "algorithm": "fixed_window",
          "limit": 1000, "windowMs": 3600000, "failMode": "closed" } ] }"#;
    let dir = tempfile::tempdir().expect("temp dir");
    let state = StateDir::open(dir.path(), RegionId::parse("eu").expect("region")).expect("opens");
    state
        .write(
            StateFile::Bundle,
            &SavedBundle {
                bundle: common::bundle(READ_RULE).to_json(),
            },
        )
        .expect("bundle saved");
    let set = OverrideSet::seal(
        4,
        vec![RuleOverride {
            id: allot_shared::ids::RecordId::from_parts(SystemClock.now_ms(), 1),
            tenant: allot_shared::ids::TenantId::parse("atlas").expect("tenant"),
            rule: allot_shared::ids::RuleId::parse("user-read").expect("rule"),
            principal: None,
            amounts: RuleAmounts {
                limit: Some(7),
                ..RuleAmounts::default()
            },
            expires_at_ms: None,
        }],
    );
    let first = cut_off_agent_on(state.clone());
    assert_eq!(
        first.restore_state().override_version,
        None,
        "none saved yet"
    );
    assert!(first.offer_overrides(set.clone()));
    first.save_overrides().await;
    drop(first);

    let second = cut_off_agent_on(state.clone());
    assert_eq!(second.restore_state().override_version, Some(4));
    let bundle = second.bundle().expect("restored bundle");
    assert_eq!((bundle.overlay().version(), bundle.overlay().len()), (4, 1));

    // A set whose checksum does not match its content is not taken.
    let mut tampered = set;
    tampered.overrides[0].amounts.limit = Some(7_000);
    state
        .write(StateFile::Overrides, &tampered)
        .expect("written");
    let third = cut_off_agent_on(state);
    assert_eq!(third.restore_state().override_version, None);
}

/// Killed between journal writes, after fallback admits the journal never saw: the next
/// incarnation counts the window's allowance as used up to the last durable claim, so it never
/// re-opens the allowance, and leaves at most one claim block of it unused.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_kill_between_journal_writes_never_reopens_the_fallback_allowance() {
    let dir = tempfile::tempdir().expect("temp dir");
    let allowance = 40;
    let block = allowance / FALLBACK_CLAIM_BLOCKS;
    let clock = clock();
    let fake = Allocator::with_clock(1_000, 10, allowance, clock.clone());
    // Terms learned while connected; then cut off.
    let first = start(dir.path(), &clock, client(fake.clone()).await, Some(BUNDLE));
    admit(&first, 0, 1).await;
    first.write_journal_if_changed().await;
    drop(first);
    let second = start(dir.path(), &clock, unreachable(), Some(BUNDLE));
    let (allowed, fallback) = admit(&second, 10, 13).await;
    assert_eq!((allowed, fallback), (13, 13));
    // Killed: no journal write since its last claim.
    drop(second);
    let third = start(dir.path(), &clock, unreachable(), Some(BUNDLE));
    let (allowed, fallback) = admit(&third, 100, allowance).await;
    assert_eq!(allowed, fallback);
    assert!(
        allowed <= allowance - 13,
        "{allowed} admitted after 13 of {allowance}: the allowance was re-opened"
    );
    assert!(
        allowed + block >= allowance - 13,
        "{allowed} admitted after 13 of {allowance}: more than a block ({block}) lost"
    );
}

/// A shadow pool's count of the window survives a kill: the restarted agent goes on from the
/// journaled count, so the ledger (which keeps the larger report) sees every admitted request.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shadow_pools_count_survives_a_restart_in_mid_window() {
    const SHADOW: &str = r#"{ "bundleVersion": 8, "rules": [
        { "id": "user-read", "scope": "user", "routeGroup": "read", "algorithm": "fixed_window",
          "limit": 1000, "windowMs": 3600000, "failMode": "closed" },
        { "id": "global-api", "scope": "global", "pool": "api", "failMode": "closed",
          "mode": "shadow" } ] }"#;
    let dir = tempfile::tempdir().expect("temp dir");
    let clock = clock();
    let fake = Allocator::with_clock(1_000, 10, 0, clock.clone());
    let first = start(dir.path(), &clock, client(fake.clone()).await, Some(SHADOW));
    assert_eq!(admit(&first, 0, 12).await, (12, 0));
    first.write_journal_if_changed().await;
    // Killed before it reported.
    drop(first);
    assert_eq!(fake.reported_shadow(), 0);
    let second = start(dir.path(), &clock, client(fake.clone()).await, Some(SHADOW));
    assert_eq!(admit(&second, 100, 5).await, (5, 0));
    second.send_reports().await;
    assert_eq!(
        fake.reported_shadow(),
        17,
        "the window's count went on from the journal"
    );
    assert_eq!(fake.reported_spent(), 0, "a shadow pool spends nothing");
}
