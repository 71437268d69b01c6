//! Leadership and epochs.
//!
//! Several allocator processes may run against one store; exactly one leads and grants. Leadership is
//! a key (`/allot/leader`) created only if absent and attached to a lease the leader keeps alive; the
//! epoch (`/allot/epoch`) is bumped in the same transaction, so it strictly increases with every change
//! of leadership and is stamped on every grant. The leader key's modification revision is the fencing
//! token: every grant transaction compares it, so a deposed leader (its lease expired, someone else
//! created the key) cannot write, however late its request arrives.

use std::sync::Arc;
use std::time::Duration;

use allot_shared::ids::Epoch;
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::clock::Clock;
use crate::kv::{Compare, Kv, KvError, Op};

/// The leadership key.
pub const LEADER_KEY: &str = "/allot/leader";
/// The epoch counter.
pub const EPOCH_KEY: &str = "/allot/epoch";

/// Who leads, as stored in the leader key.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "camelCase")]
pub struct LeaderRecord {
    /// The leader's node id.
    pub node_id: String,
    /// Its epoch.
    pub epoch: Epoch,
    /// Where agents and operators reach it.
    pub advertise_url: String,
}

/// Proof of leadership held by the leader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Leadership {
    /// The epoch of this term.
    pub epoch: Epoch,
    /// The leader key's modification revision: the fencing token.
    pub leader_revision: i64,
    /// The store lease that keeps the leader key alive.
    pub lease: i64,
}

impl Leadership {
    /// The guard every leader-only write carries.
    pub fn fence(&self) -> Compare {
        Compare::ModRevision {
            key: LEADER_KEY.to_owned(),
            revision: self.leader_revision,
        }
    }
}

/// This node's view of leadership.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// Not yet known (starting, or the store is unreachable).
    Unknown,
    /// This node leads.
    Leader(Leadership),
    /// Another node leads (or nobody does, right now).
    Follower(Option<LeaderRecord>),
}

/// Reads the current leader record.
pub async fn current_leader(kv: &dyn Kv) -> Result<Option<LeaderRecord>, KvError> {
    Ok(kv
        .get(LEADER_KEY)
        .await?
        .and_then(|v| serde_json::from_slice(&v.value).ok()))
}

/// Tries once to become leader. `Ok(None)` when someone else leads or won the race.
pub async fn try_acquire(
    kv: &dyn Kv,
    node_id: &str,
    advertise_url: &str,
    ttl_s: i64,
) -> Result<Option<Leadership>, KvError> {
    if kv.get(LEADER_KEY).await?.is_some() {
        return Ok(None);
    }
    let (previous_epoch, epoch_revision) = match kv.get(EPOCH_KEY).await? {
        Some(v) => (
            std::str::from_utf8(&v.value)
                .ok()
                .and_then(|text| text.parse::<u64>().ok())
                .ok_or_else(|| KvError::Refused(format!("{EPOCH_KEY} does not hold a number")))?,
            v.mod_revision,
        ),
        None => (0, 0),
    };
    let epoch = Epoch(previous_epoch + 1);
    let record = LeaderRecord {
        node_id: node_id.to_owned(),
        epoch,
        advertise_url: advertise_url.to_owned(),
    };
    let lease = kv.grant_lease(ttl_s).await?;
    let value = serde_json::to_vec(&record).map_err(|e| KvError::Refused(e.to_string()))?;
    let outcome = kv
        .txn(
            vec![
                Compare::ModRevision {
                    key: LEADER_KEY.to_owned(),
                    revision: 0,
                },
                Compare::ModRevision {
                    key: EPOCH_KEY.to_owned(),
                    revision: epoch_revision,
                },
            ],
            vec![
                Op::Put {
                    key: LEADER_KEY.to_owned(),
                    value,
                    lease: Some(lease),
                },
                Op::Put {
                    key: EPOCH_KEY.to_owned(),
                    value: epoch.0.to_string().into_bytes(),
                    lease: None,
                },
            ],
        )
        .await?;
    if !outcome.succeeded {
        kv.revoke(lease).await?;
        return Ok(None);
    }
    Ok(Some(Leadership {
        epoch,
        leader_revision: outcome.revision,
        lease,
    }))
}

/// Campaign settings.
#[derive(Debug, Clone)]
pub struct ElectionConfig {
    /// This node's id.
    pub node_id: String,
    /// Its advertised URL.
    pub advertise_url: String,
    /// Leader lease TTL in seconds: a crashed leader is replaced after at most this long.
    pub lease_ttl_s: i64,
}

/// Runs the election loop until `shutdown` resolves, publishing this node's role. On shutdown a
/// leader revokes its lease, so a successor takes over at once instead of after the TTL.
///
/// Long by design: the election is one state machine over the node's role, and its step-down rule
/// (once two thirds of the TTL pass without a renewal) reads the last renewal time that both the
/// leader's and the candidate's arms write; split, that time would be state shared between
/// functions, and when a leader stops claiming would be read apart from when it last renewed.
pub async fn run_election(
    kv: Arc<dyn Kv>,
    clock: Arc<dyn Clock>,
    config: ElectionConfig,
    role: watch::Sender<Role>,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let ttl_ms = u64::try_from(config.lease_ttl_s).unwrap_or(1).max(1) * 1_000;
    // A leader renews three times per TTL. Others look for a free leader key at least every second,
    // so a leader that resigned (revoking its lease) is replaced at once.
    let renew_every = Duration::from_millis(ttl_ms / 3);
    let campaign_every = renew_every.min(Duration::from_secs(1));
    let mut last_renewal_ms = 0;
    loop {
        let current = role.borrow().clone();
        let next = match current {
            // A renewal that hangs counts as failed once a renewal period has passed: the loop must
            // get back to the step-down check below, whatever the store does.
            Role::Leader(leadership) => {
                match tokio::time::timeout(renew_every, kv.keep_alive(leadership.lease)).await {
                    Ok(Ok(_)) => {
                        last_renewal_ms = clock.now_ms();
                        Role::Leader(leadership)
                    }
                    Ok(Err(KvError::LeaseNotFound(_))) => {
                        tracing::warn!(epoch = %leadership.epoch, "leader lease lost; stepping down");
                        Role::Unknown
                    }
                    failed => {
                        let error = match failed {
                            Ok(Err(error)) => error.to_string(),
                            _ => format!("no answer within {renew_every:?}"),
                        };
                        // Step down before the store could have expired the lease: past that point
                        // another node may lead, and although the fence stops our writes, we must stop
                        // claiming (/readyz, metrics, answers to agents).
                        if clock.now_ms().saturating_sub(last_renewal_ms) >= ttl_ms * 2 / 3 {
                            tracing::warn!(%error, "cannot renew the leader lease; stepping down");
                            Role::Unknown
                        } else {
                            tracing::warn!(%error, "leader lease renewal failed; retrying");
                            Role::Leader(leadership)
                        }
                    }
                }
            }
            Role::Unknown | Role::Follower(_) => {
                match try_acquire(
                    &*kv,
                    &config.node_id,
                    &config.advertise_url,
                    config.lease_ttl_s,
                )
                .await
                {
                    Ok(Some(leadership)) => {
                        last_renewal_ms = clock.now_ms();
                        tracing::info!(epoch = %leadership.epoch, node = %config.node_id, "became leader");
                        Role::Leader(leadership)
                    }
                    Ok(None) => Role::Follower(current_leader(&*kv).await.ok().flatten()),
                    Err(error) => {
                        tracing::warn!(%error, "election round failed");
                        Role::Unknown
                    }
                }
            }
        };
        let (epoch, leading) = match &next {
            Role::Leader(leadership) => (leadership.epoch.0 as f64, 1.0),
            _ => (0.0, 0.0),
        };
        metrics::gauge!(crate::metrics::LEADER_EPOCH).set(epoch);
        metrics::gauge!(crate::metrics::IS_LEADER).set(leading);
        role.send_if_modified(|r| {
            let changed = *r != next;
            *r = next;
            changed
        });
        let tick = if matches!(*role.borrow(), Role::Leader(_)) {
            renew_every
        } else {
            campaign_every
        };
        tokio::select! {
            () = &mut shutdown => break,
            () = tokio::time::sleep(tick) => {}
        }
    }
    let last = role.borrow().clone();
    if let Role::Leader(leadership) = last
        && let Err(error) = kv.revoke(leadership.lease).await
    {
        tracing::warn!(%error, "could not revoke the leader lease on shutdown");
    }
    role.send_replace(Role::Unknown);
}
