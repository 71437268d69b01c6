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
//! new version with older content.

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
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct Rollout {
    /// The version every region runs (0 before the first promotion).
    pub current: u64,
    /// A newer version staged to a few regions first.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub canary: Option<Canary>,
    /// The highest version ever published.
    pub latest: u64,
}

/// A staged version.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
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
/// writing the extra ops `change` returns in the same transaction. Retries a bounded number of times.
async fn update_rollout<T>(
    kv: &dyn Kv,
    mut change: impl FnMut(&mut Rollout) -> (T, Vec<Op>),
) -> Result<(Rollout, T), PolicyStoreError> {
    for _ in 0..8 {
        let (mut rollout, revision) = read_rollout(kv).await?;
        let (answer, mut ops) = change(&mut rollout);
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

/// Publishes a draft as the next version. With `canary` regions it is staged to them; otherwise it
/// becomes current at once.
pub async fn publish(
    kv: &dyn Kv,
    draft: DraftBundle,
    published_at: String,
    canary: Option<Vec<RegionId>>,
) -> Result<PolicyBundle, PolicyStoreError> {
    let (_, bundle) = update_rollout(kv, |rollout| {
        let version = rollout.latest + 1;
        let bundle = draft.clone().seal(version, Some(published_at.clone()));
        rollout.latest = version;
        match &canary {
            Some(regions) if !regions.is_empty() => {
                rollout.canary = Some(Canary {
                    version,
                    regions: regions.clone(),
                });
            }
            _ => {
                rollout.current = version;
                rollout.canary = None;
            }
        }
        let put = Op::Put {
            key: bundle_key(version),
            value: bundle.to_json().to_string().into_bytes(),
            lease: None,
        };
        (bundle, vec![put])
    })
    .await?;
    Ok(bundle)
}

/// Makes `version` current for every region (ending its canary, if any).
pub async fn promote(kv: &dyn Kv, version: u64) -> Result<Rollout, PolicyStoreError> {
    get_bundle(kv, version).await?;
    let (rollout, ()) = update_rollout(kv, |rollout| {
        rollout.current = version;
        if rollout
            .canary
            .as_ref()
            .is_some_and(|c| c.version <= version)
        {
            rollout.canary = None;
        }
        ((), Vec::new())
    })
    .await?;
    Ok(rollout)
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
