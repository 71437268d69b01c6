//! Policy bundles in the control plane: publish (validated, versioned, checksummed), stage to canary
//! regions, promote, and track which version every agent runs.
//!
//! Store layout (values JSON):
//! - `/allot/policies/bundles/<version, zero-padded>`: each published bundle, immutable;
//! - `/allot/policies/rollout`: `{current, canary: {version, regions}}`: what regions should run;
//! - `/allot/policies/agents/<region>/<agent>`: the version an agent last said it runs; reports older
//!   than [`AGENT_STATUS_MAX_AGE_MS`] drop out of the status (and are deleted); their keys carry a
//!   rotating store lease ([`StatusLeases`]), so they leave the store even if nobody reads it.
//!
//! Versions only go up: publishing assigns the next version in a transaction guarded by the rollout
//! record's revision, so two operators publishing at once get two distinct versions. A rollback is a
//! new version with older content ([`rollback`]).
//!
//! The version a region should run ([`Rollout::version_for`]) never decreases, whatever the
//! sequence of publishes, promotions and rollbacks: an agent only installs a higher version (I13),
//! so a region told to run a lower one would split, its running agents keeping the higher version
//! while new ones fetch the lower. Every change keeps it so, decided against the rollout record the
//! guarded transaction writes over:
//! - publishing makes the next version current (every region goes up) or stages it to canary
//!   regions (they go up, the others stay);
//! - a live canary's version is always above the current one; a new canary must name every region
//!   of the live one ([`PolicyStoreError::CanaryRegionsLeftBehind`]), since a region dropped from it
//!   would fall back to the lower current version. Refusing, rather than widening the new canary
//!   silently, keeps the operator in charge of which regions run an untried version;
//! - promotion only goes up: a version below the current one is refused
//!   ([`PolicyStoreError::OlderThanCurrent`]) and promoting the current one again changes nothing.
//!   A promoted version below a live canary's leaves the canary regions on theirs; one at or above
//!   it ends the canary;
//! - a rollback publishes an older version's content as the next version, current everywhere at
//!   once (ending any canary): a new, highest version, so every region goes up.

use allot_shared::ids::RegionId;
use allot_shared::policy::{DraftBundle, PolicyBundle, PolicyError, parse_bundle};
use serde::{Deserialize, Serialize};

use crate::kv::{Compare, Kv, KvError, MAX_PREFIX_KEYS, Op};

const BUNDLE_PREFIX: &str = "/allot/policies/bundles/";
const ROLLOUT_KEY: &str = "/allot/policies/rollout";
const AGENT_PREFIX: &str = "/allot/policies/agents/";
/// How long an agent's status report counts, in ms.
pub const AGENT_STATUS_MAX_AGE_MS: u64 = 120_000;

fn bundle_key(version: u64) -> String {
    format!("{BUNDLE_PREFIX}{version:020}")
}

/// Which bundle regions should run.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Rollout {
    /// The version every region runs (0 before the first promotion).
    pub current: u64,
    /// A newer version staged to a few regions first: always above `current` (a canary at or below
    /// it ends when that version is promoted).
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary: Option<Canary>,
    /// The highest version ever published.
    pub latest: u64,
}

/// A staged version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize, utoipa::ToSchema)]
#[serde(rename_all = "camelCase")]
pub struct Canary {
    /// The staged version.
    pub version: u64,
    /// The regions that run it before everyone.
    pub regions: Vec<RegionId>,
}

impl Rollout {
    /// The version `region` should run.
    pub fn version_for(&self, region: Option<&RegionId>) -> u64 {
        match (&self.canary, region) {
            (Some(canary), Some(region)) if canary.regions.contains(region) => canary.version,
            _ => self.current,
        }
    }
}

pub use allot_shared::wire::AgentStatus;

/// A policy operation failure.
#[derive(Debug, thiserror::Error)]
pub enum PolicyStoreError {
    /// The bundle is invalid.
    #[error(transparent)]
    Invalid(#[from] PolicyError),
    /// No such version.
    #[error("no bundle with version {0}")]
    UnknownVersion(u64),
    /// Nothing has been published or promoted yet.
    #[error("no policy bundle is current yet")]
    NothingCurrent,
    /// The store failed.
    #[error(transparent)]
    Store(#[from] KvError),
    /// A stored value is unreadable.
    #[error("stored policy data at {0} is not readable")]
    Corrupt(String),
    /// Concurrent publishers kept winning.
    #[error("policies changed concurrently too often; retry")]
    Contended,
    /// A promotion would move every region to a lower version than it runs.
    #[error(
        "version {version} is older than the current version {current}, and agents never go back \
         to a lower version; roll back instead (POST /v1/policies/{version}/rollback) to publish \
         its content as a new version"
    )]
    OlderThanCurrent {
        /// The version asked for.
        version: u64,
        /// The current version.
        current: u64,
    },
    /// A new canary leaves out regions of the live one, which would fall back to a lower version.
    #[error(
        "canary version {live} runs in {}, and agents never go back to a lower version; the new \
         canary must include {} too (or promote {live}, or roll back, first)",
        region_list(.missing),
        region_list(.missing)
    )]
    CanaryRegionsLeftBehind {
        /// The live canary's version.
        live: u64,
        /// Its regions the new canary leaves out.
        missing: Vec<RegionId>,
    },
}

fn region_list(regions: &[RegionId]) -> String {
    regions
        .iter()
        .map(RegionId::as_str)
        .collect::<Vec<_>>()
        .join(",")
}

async fn read_rollout(kv: &dyn Kv) -> Result<(Rollout, i64), PolicyStoreError> {
    match kv.get(ROLLOUT_KEY).await? {
        None => Ok((Rollout::default(), 0)),
        Some(v) => Ok((
            serde_json::from_slice(&v.value)
                .map_err(|_| PolicyStoreError::Corrupt(ROLLOUT_KEY.to_owned()))?,
            v.mod_revision,
        )),
    }
}

/// The rollout record.
pub async fn rollout(kv: &dyn Kv) -> Result<Rollout, PolicyStoreError> {
    Ok(read_rollout(kv).await?.0)
}

/// Changes the rollout record under optimistic concurrency (the transaction compares its revision),
/// writing the extra ops `change` returns in the same transaction. `change` decides against the very
/// record it replaces, so a refusal it makes cannot be raced past. Retries a bounded number of times.
async fn update_rollout<T>(
    kv: &dyn Kv,
    mut change: impl FnMut(&mut Rollout) -> Result<(T, Vec<Op>), PolicyStoreError>,
) -> Result<(Rollout, T), PolicyStoreError> {
    for _ in 0..8 {
        let (mut rollout, revision) = read_rollout(kv).await?;
        let (answer, mut ops) = change(&mut rollout)?;
        ops.push(Op::Put {
            key: ROLLOUT_KEY.to_owned(),
            value: serde_json::to_vec(&rollout).unwrap_or_default(),
            lease: None,
        });
        let guard = Compare::ModRevision {
            key: ROLLOUT_KEY.to_owned(),
            revision,
        };
        if kv.txn(vec![guard], ops).await?.succeeded {
            return Ok((rollout, answer));
        }
    }
    Err(PolicyStoreError::Contended)
}

/// Seals `draft` as the next version and records it as published in `rollout`, returning the
/// bundle and the op that stores it. The rollout's current version and canary are left to the
/// caller.
fn seal_next(rollout: &mut Rollout, draft: DraftBundle, published_at: &str) -> (PolicyBundle, Op) {
    let version = rollout.latest + 1;
    let bundle = draft.seal(version, Some(published_at.to_owned()));
    rollout.latest = version;
    let put = Op::Put {
        key: bundle_key(version),
        value: bundle.to_json().to_string().into_bytes(),
        lease: None,
    };
    (bundle, put)
}

/// Refuses a new canary to `regions` that leaves out a region of the live canary: that region
/// runs a version above the current one and would be told to go back down to it.
fn check_canary_keeps_regions(
    rollout: &Rollout,
    regions: &[RegionId],
) -> Result<(), PolicyStoreError> {
    let Some(live) = &rollout.canary else {
        return Ok(());
    };
    let missing: Vec<RegionId> = live
        .regions
        .iter()
        .filter(|region| !regions.contains(region))
        .cloned()
        .collect();
    if missing.is_empty() {
        return Ok(());
    }
    Err(PolicyStoreError::CanaryRegionsLeftBehind {
        live: live.version,
        missing,
    })
}

/// Publishes a draft as the next version. With `canary` regions it is staged to them (which must
/// include every region of a live canary); otherwise it becomes current at once.
pub async fn publish(
    kv: &dyn Kv,
    draft: DraftBundle,
    published_at: String,
    canary: Option<Vec<RegionId>>,
) -> Result<PolicyBundle, PolicyStoreError> {
    let canary = canary.filter(|regions| !regions.is_empty());
    let (_, bundle) = update_rollout(kv, |rollout| {
        if let Some(regions) = &canary {
            check_canary_keeps_regions(rollout, regions)?;
        }
        let (bundle, put) = seal_next(rollout, draft.clone(), &published_at);
        match &canary {
            Some(regions) => {
                rollout.canary = Some(Canary {
                    version: bundle.version(),
                    regions: regions.clone(),
                });
            }
            None => make_current(rollout, bundle.version()),
        }
        Ok((bundle, vec![put]))
    })
    .await?;
    Ok(bundle)
}

/// Makes `version` current for every region, ending a canary of it or of a lower version (its
/// regions go up to `version`); a canary of a higher version stays. `version` must be at least the
/// current one.
fn make_current(rollout: &mut Rollout, version: u64) {
    rollout.current = version;
    if rollout
        .canary
        .as_ref()
        .is_some_and(|canary| canary.version <= version)
    {
        rollout.canary = None;
    }
}

/// Makes `version` current for every region (ending its canary, if any). A version below the
/// current one is refused: agents that run the current one would keep it, and only new ones would
/// take `version` ([`rollback`] publishes its content as a new version instead). Promoting the
/// current version again changes nothing.
pub async fn promote(kv: &dyn Kv, version: u64) -> Result<Rollout, PolicyStoreError> {
    get_bundle(kv, version).await?;
    let (rollout, ()) = update_rollout(kv, |rollout| {
        if version < rollout.current {
            return Err(PolicyStoreError::OlderThanCurrent {
                version,
                current: rollout.current,
            });
        }
        make_current(rollout, version);
        Ok(((), Vec::new()))
    })
    .await?;
    Ok(rollout)
}

/// Rolls back to `version`'s content: publishes its rules as the next version, current for every
/// region at once (any canary ends, its regions going up to the new version too).
pub async fn rollback(
    kv: &dyn Kv,
    version: u64,
    published_at: String,
) -> Result<PolicyBundle, PolicyStoreError> {
    // Bundles are immutable once stored, so reading the source outside the transaction is safe.
    let source = get_bundle(kv, version).await?;
    let draft = DraftBundle {
        version: None,
        published_at: None,
        checksum: None,
        rules: source.rules().to_vec(),
    };
    let (_, bundle) = update_rollout(kv, |rollout| {
        let (bundle, put) = seal_next(rollout, draft.clone(), &published_at);
        make_current(rollout, bundle.version());
        Ok((bundle, vec![put]))
    })
    .await?;
    Ok(bundle)
}

/// Reads a published bundle, verifying its checksum.
pub async fn get_bundle(kv: &dyn Kv, version: u64) -> Result<PolicyBundle, PolicyStoreError> {
    let key = bundle_key(version);
    let stored = kv
        .get(&key)
        .await?
        .ok_or(PolicyStoreError::UnknownVersion(version))?;
    let text =
        String::from_utf8(stored.value).map_err(|_| PolicyStoreError::Corrupt(key.clone()))?;
    Ok(parse_bundle(&text)?.into_verified()?)
}

/// The bundle `region` should run.
pub async fn current_for(
    kv: &dyn Kv,
    region: Option<&RegionId>,
) -> Result<PolicyBundle, PolicyStoreError> {
    let version = rollout(kv).await?.version_for(region);
    if version == 0 {
        return Err(PolicyStoreError::NothingCurrent);
    }
    get_bundle(kv, version).await
}

/// Records what an agent runs.
pub async fn report_agent(
    kv: &dyn Kv,
    status: &AgentStatus,
    leases: &StatusLeases,
    now_ms: u64,
) -> Result<(), PolicyStoreError> {
    let put = |lease| {
        vec![Op::Put {
            key: format!("{AGENT_PREFIX}{}/{}", status.region, status.agent_id),
            value: serde_json::to_vec(status).unwrap_or_default(),
            lease: Some(lease),
        }]
    };
    let lease = leases.lease(kv, now_ms).await?;
    match kv.txn(vec![], put(lease)).await {
        Err(KvError::LeaseNotFound(_)) => {
            // The store dropped the lease early (a restored snapshot, a clock jump): take another.
            leases.forget(lease).await;
            let lease = leases.lease(kv, now_ms).await?;
            kv.txn(vec![], put(lease)).await?;
        }
        outcome => {
            outcome?;
        }
    }
    Ok(())
}

/// An agent status key's store lease lasts this long, s: the key of an agent that stops reporting
/// leaves the store within it, even if nobody reads the status (I10).
pub const AGENT_STATUS_LEASE_TTL_S: i64 = 120;
/// Status keys are written with a new lease this often, ms (half the TTL): a reporting agent's key
/// moves to the newest lease with its next report, so no lease is ever renewed.
pub const AGENT_STATUS_LEASE_ROTATE_MS: u64 = 60_000;

/// The store lease agent status keys are written with, taken anew every
/// [`AGENT_STATUS_LEASE_ROTATE_MS`]: a key lives at most [`AGENT_STATUS_LEASE_TTL_S`] after its
/// last report, and at most about three leases are alive at once.
#[derive(Debug, Default)]
pub struct StatusLeases {
    /// The lease in use and when it was taken (allocator clock, ms).
    current: tokio::sync::Mutex<Option<(i64, u64)>>,
}

impl StatusLeases {
    /// The lease to write a status with at `now_ms`, taking a new one when due.
    pub async fn lease(&self, kv: &dyn Kv, now_ms: u64) -> Result<i64, PolicyStoreError> {
        let mut current = self.current.lock().await;
        if let Some((lease, taken_at_ms)) = *current
            && now_ms.saturating_sub(taken_at_ms) < AGENT_STATUS_LEASE_ROTATE_MS
        {
            return Ok(lease);
        }
        let lease = kv.grant_lease(AGENT_STATUS_LEASE_TTL_S).await?;
        *current = Some((lease, now_ms));
        Ok(lease)
    }

    /// Stops using `lease` (the store no longer has it).
    pub async fn forget(&self, lease: i64) {
        let mut current = self.current.lock().await;
        if current.is_some_and(|(held, _)| held == lease) {
            *current = None;
        }
    }
}

/// The distinct pepper fingerprints `agents` report, by region.
pub fn pepper_fingerprints(
    agents: &[AgentStatus],
) -> std::collections::BTreeMap<RegionId, std::collections::BTreeSet<String>> {
    let mut by_region: std::collections::BTreeMap<RegionId, std::collections::BTreeSet<String>> =
        std::collections::BTreeMap::new();
    for agent in agents {
        if let Some(fingerprint) = &agent.pepper_fingerprint {
            by_region
                .entry(agent.region.clone())
                .or_default()
                .insert(fingerprint.clone());
        }
    }
    by_region
}

/// Agents that reported within [`AGENT_STATUS_MAX_AGE_MS`] of `now_ms`. Older reports are deleted
/// (an agent that stopped reporting is gone), which keeps the set bounded.
pub async fn agent_statuses(
    kv: &dyn Kv,
    now_ms: u64,
) -> Result<Vec<AgentStatus>, PolicyStoreError> {
    let mut fresh = Vec::new();
    let mut stale = Vec::new();
    for (key, value) in kv.get_prefix(AGENT_PREFIX, MAX_PREFIX_KEYS).await? {
        let status: AgentStatus = serde_json::from_slice(&value.value)
            .map_err(|_| PolicyStoreError::Corrupt(key.clone()))?;
        if now_ms.saturating_sub(status.reported_at_ms) <= AGENT_STATUS_MAX_AGE_MS {
            fresh.push(status);
        } else {
            stale.push(Op::Delete { key });
        }
    }
    // One transaction may hold at most MAX_TXN_OPS operations; a larger sweep in one would be
    // refused every time and the stale set would only grow.
    for chunk in stale.chunks(crate::kv::MAX_TXN_OPS) {
        kv.txn(vec![], chunk.to_vec()).await?;
    }
    Ok(fresh)
}

#[cfg(test)]
mod tests {
    use std::sync::Arc;

    use super::*;
    use crate::clock::{Clock, ManualClock};
    use crate::kv::memory::MemoryKv;

    fn status(agent: &str, now_ms: u64) -> AgentStatus {
        AgentStatus {
            region: RegionId::parse("eu").expect("region"),
            agent_id: allot_shared::ids::AgentId::parse(agent).expect("agent id"),
            version: 1,
            reported_at_ms: now_ms,
            pepper_fingerprint: None,
        }
    }

    async fn keys(kv: &MemoryKv) -> Vec<String> {
        kv.get_prefix(AGENT_PREFIX, 100)
            .await
            .expect("listing")
            .into_iter()
            .map(|(key, _)| key)
            .collect()
    }

    fn region(name: &str) -> RegionId {
        RegionId::parse(name).expect("region")
    }

    fn draft() -> DraftBundle {
        DraftBundle {
            version: None,
            published_at: None,
            checksum: None,
            rules: Vec::new(),
        }
    }

    fn memory_kv() -> MemoryKv {
        MemoryKv::new(Arc::new(ManualClock::new(1_000_000)) as Arc<dyn Clock>)
    }

    async fn publish_to(kv: &MemoryKv, canary: &[&str]) -> Result<u64, PolicyStoreError> {
        let regions = (!canary.is_empty()).then(|| canary.iter().map(|r| region(r)).collect());
        let at = "2025-01-01T00:00:00Z".to_owned();
        Ok(publish(kv, draft(), at, regions).await?.version())
    }

    /// Promoting a version below the current one would leave the agents that run the current one
    /// on it and send new ones to the older: refused, nothing changes; the current one again is a
    /// no-op.
    #[tokio::test]
    async fn promotion_never_goes_below_the_current_version() {
        let kv = memory_kv();
        publish_to(&kv, &[]).await.expect("v1");
        publish_to(&kv, &[]).await.expect("v2");
        let before = rollout(&kv).await.expect("rollout");
        let refused = promote(&kv, 1).await;
        assert!(
            matches!(
                refused,
                Err(PolicyStoreError::OlderThanCurrent {
                    version: 1,
                    current: 2
                })
            ),
            "{refused:?}"
        );
        assert_eq!(rollout(&kv).await.expect("rollout"), before);
        assert_eq!(promote(&kv, 2).await.expect("again"), before);
    }

    /// A newer canary elsewhere would send the older canary's regions back to the current version:
    /// refused unless it names them too; a canary that does moves them up.
    #[tokio::test]
    async fn a_new_canary_keeps_the_live_canarys_regions() {
        let kv = memory_kv();
        publish_to(&kv, &[]).await.expect("v1");
        publish_to(&kv, &["eu"]).await.expect("v2 to eu");
        let refused = publish_to(&kv, &["us"]).await;
        match refused {
            Err(PolicyStoreError::CanaryRegionsLeftBehind { live, missing }) => {
                assert_eq!((live, missing), (2, vec![region("eu")]));
            }
            other => panic!("{other:?}"),
        }
        let after = rollout(&kv).await.expect("rollout");
        assert_eq!(after.latest, 2, "nothing was published");
        assert_eq!(after.version_for(Some(&region("eu"))), 2);
        assert_eq!(publish_to(&kv, &["us", "eu"]).await.expect("v3"), 3);
        let after = rollout(&kv).await.expect("rollout");
        let versions: Vec<u64> = ["eu", "us", "ap"]
            .iter()
            .map(|r| after.version_for(Some(&region(r))))
            .collect();
        assert_eq!(versions, [3, 3, 1]);
    }

    /// A rollback publishes the older content as the next version, current everywhere.
    #[tokio::test]
    async fn a_rollback_is_the_next_version_with_older_content() {
        let kv = memory_kv();
        publish_to(&kv, &[]).await.expect("v1");
        publish_to(&kv, &["eu"]).await.expect("v2 to eu");
        let at = "2025-01-02T00:00:00Z".to_owned();
        let rolled = rollback(&kv, 1, at.clone()).await.expect("rollback");
        let source = get_bundle(&kv, 1).await.expect("v1");
        assert_eq!(rolled.version(), 3);
        assert_eq!(rolled.rules(), source.rules());
        assert_eq!(rolled.published_at(), Some(at.as_str()));
        assert_eq!(get_bundle(&kv, 3).await.expect("stored"), rolled);
        let after = rollout(&kv).await.expect("rollout");
        assert_eq!((after.current, after.latest, after.canary), (3, 3, None));
        assert!(matches!(
            rollback(&kv, 9, at).await,
            Err(PolicyStoreError::UnknownVersion(9))
        ));
    }

    /// One step of a random rollout history.
    #[derive(Debug, Clone)]
    enum Step {
        /// Publish, to the regions of the mask (none: current at once).
        Publish(u8),
        Promote(u64),
        Rollback(u64),
    }

    const REGIONS: [&str; 3] = ["eu", "us", "ap"];

    fn step() -> impl proptest::strategy::Strategy<Value = Step> {
        use proptest::prelude::*;
        // Versions up to 12 include unknown ones (refused as such).
        prop_oneof![
            (0u8..8).prop_map(Step::Publish),
            (1u64..=12).prop_map(Step::Promote),
            (1u64..=12).prop_map(Step::Rollback),
        ]
    }

    /// What every region (and an agent that names none) should run.
    fn targets(rollout: &Rollout) -> Vec<u64> {
        REGIONS
            .iter()
            .map(|r| rollout.version_for(Some(&region(r))))
            .chain([rollout.version_for(None)])
            .collect()
    }

    async fn apply(kv: &MemoryKv, step: &Step) -> Result<(), PolicyStoreError> {
        let at = "2025-01-01T00:00:00Z".to_owned();
        match step {
            Step::Publish(mask) => {
                let canary: Vec<&str> = REGIONS
                    .iter()
                    .enumerate()
                    .filter(|(bit, _)| mask & (1 << bit) != 0)
                    .map(|(_, r)| *r)
                    .collect();
                publish_to(kv, &canary).await.map(|_| ())
            }
            Step::Promote(version) => promote(kv, *version).await.map(|_| ()),
            Step::Rollback(version) => rollback(kv, *version, at).await.map(|_| ()),
        }
    }

    proptest::proptest! {
        /// Whatever the sequence of publishes, promotions and rollbacks, no region is ever told
        /// to run a lower version than before (agents only go up: it would split the region), a
        /// live canary stays above the current version, and a refused step changes nothing.
        #[test]
        fn no_region_is_ever_told_to_run_a_lower_version(
            steps in proptest::collection::vec(step(), 1..40),
        ) {
            let runtime = tokio::runtime::Builder::new_current_thread()
                .enable_all()
                .build()
                .expect("runtime");
            runtime.block_on(async {
                let kv = memory_kv();
                let mut before = rollout(&kv).await.expect("rollout");
                for step in &steps {
                    let outcome = apply(&kv, step).await;
                    let after = rollout(&kv).await.expect("rollout");
                    let (was, now) = (targets(&before), targets(&after));
                    assert!(
                        was.iter().zip(&now).all(|(was, now)| now >= was),
                        "{step:?} moved a region down: {was:?} -> {now:?} ({before:?} -> {after:?})"
                    );
                    if let Some(canary) = &after.canary {
                        assert!(canary.version > after.current, "{after:?}");
                    }
                    match &outcome {
                        Err(PolicyStoreError::UnknownVersion(_))
                        | Err(PolicyStoreError::OlderThanCurrent { .. })
                        | Err(PolicyStoreError::CanaryRegionsLeftBehind { .. }) => {
                            assert_eq!(after, before, "{step:?} was refused: {outcome:?}");
                        }
                        Err(other) => panic!("{step:?}: {other}"),
                        Ok(()) => {}
                    }
                    // A rollback of a known version always succeeds, and is current everywhere.
                    if let Step::Rollback(version) = step
                        && *version <= before.latest
                    {
                        assert!(outcome.is_ok(), "{step:?}: {outcome:?}");
                        assert!(now.iter().all(|v| *v == after.latest), "{after:?}");
                    }
                    before = after;
                }
            });
        }
    }

    /// A status key leaves the store once its agent stops reporting, though nobody reads the
    /// status; a reporting agent's key survives every lease rotation.
    #[tokio::test]
    async fn status_keys_expire_with_their_rotating_lease_unless_reported_again() {
        let clock = Arc::new(ManualClock::new(1_000_000));
        let kv = MemoryKv::new(clock.clone() as Arc<dyn Clock>);
        let leases = StatusLeases::default();
        let start = clock.now_ms();
        report_agent(&kv, &status("quiet", start), &leases, start)
            .await
            .expect("report");
        for step in 1..=60u64 {
            clock.advance(5_000);
            let now = clock.now_ms();
            report_agent(&kv, &status("busy", now), &leases, now)
                .await
                .expect("report");
            let present = keys(&kv).await;
            assert!(present.iter().any(|k| k.ends_with("/busy")), "step {step}");
            let quiet_alive = present.iter().any(|k| k.ends_with("/quiet"));
            let elapsed_s = step * 5;
            if elapsed_s < 120 {
                assert!(quiet_alive, "still within its lease at {elapsed_s} s");
            } else {
                assert!(!quiet_alive, "gone after its lease at {elapsed_s} s");
            }
        }
    }
}
