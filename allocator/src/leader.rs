//! Leadership, shards and epochs.
//!
//! Several allocator processes may run against one store. The pools are split into a fixed number
//! of shards ([`allot_shared::shards`]; the count is kept in the store at [`SHARD_COUNT_KEY`]), and
//! each shard is led by one process at a time, which alone grants its pools. A shard's leadership is
//! a key created only if absent (shard 0's is `/allot/leader`, shard `s`'s `/allot/shards/{s}/leader`)
//! and attached to its process's store lease: one lease a process, which also keeps the process's
//! membership key (`/allot/members/{node}`), so a process's keys live and lapse together. The epoch
//! (`/allot/epoch`) is one counter bumped in the same transaction as any shard's leader key, so each
//! shard's epochs strictly increase; they are stamped on its grants. A leader key's modification
//! revision is its shard's fencing token: every grant transaction compares it, so a deposed leader
//! (its lease lapsed, its shard handed over, someone else created the key) cannot write, however
//! late its request arrives. Shard 0's leader also coordinates what is done once for the store:
//! ledger rounds, store upkeep, webhook deliveries.
//!
//! Who campaigns for what is a [`Placement`] every process works out alike from the members and
//! leaders it reads: a free shard is asked for at once by the process it is placed with, and by any
//! after [`ORPHAN_GRACE_ROUNDS`] rounds; a process above its share hands one shard over a round.

use std::sync::Arc;
use std::time::Duration;

use allot_shared::ids::Epoch;
use allot_shared::shards::{Placement, ShardCount, ShardId};
use serde::{Deserialize, Serialize};
use tokio::sync::watch;

use crate::clock::Clock;
use crate::kv::{Compare, Kv, KvError, Op};

/// Shard 0's leadership key (the only one with one shard, as before shards existed).
pub const LEADER_KEY: &str = "/allot/leader";
/// The epoch counter, shared by all shards.
pub const EPOCH_KEY: &str = "/allot/epoch";
/// How many shards the store's pools are split into.
pub const SHARD_COUNT_KEY: &str = "/allot/shard-count";
/// Where each process keeps its membership key, under its node id.
pub const MEMBERS_PREFIX: &str = "/allot/members/";
/// Where the leader keys of shards other than 0 are.
pub const SHARD_LEADERS_PREFIX: &str = "/allot/shards/";
/// Rounds (about a second each) a free shard waits for the process it is placed with before any
/// process asks for it: long enough for the placed one to see it, short enough that a shard is
/// never long without a leader.
pub const ORPHAN_GRACE_ROUNDS: u32 = 3;

/// A shard's leadership key.
pub fn leader_key(shard: ShardId) -> String {
    if shard.0 == 0 {
        LEADER_KEY.to_owned()
    } else {
        format!("{SHARD_LEADERS_PREFIX}{:03}/leader", shard.0)
    }
}

/// The shard whose leadership key `key` is.
fn shard_of_leader_key(key: &str) -> Option<ShardId> {
    if key == LEADER_KEY {
        return Some(ShardId(0));
    }
    let number = key
        .strip_prefix(SHARD_LEADERS_PREFIX)?
        .strip_suffix("/leader")?;
    number.parse().ok().filter(|&n| n > 0).map(ShardId)
}

/// Who leads a shard, as stored in its leader key.
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

/// Proof of a shard's leadership, held by its leader.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Leadership {
    /// The shard led.
    pub shard: ShardId,
    /// The epoch of this term.
    pub epoch: Epoch,
    /// The leader key's modification revision: the fencing token.
    pub leader_revision: i64,
    /// The store lease that keeps the leader key alive.
    pub lease: i64,
}

impl Leadership {
    /// The guard every write for this shard's pools carries.
    pub fn fence(&self) -> Compare {
        Compare::ModRevision {
            key: leader_key(self.shard),
            revision: self.leader_revision,
        }
    }
}

/// This node's view of one shard's leadership.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Role {
    /// Not yet known (starting, or the store is unreachable).
    Unknown,
    /// This node leads.
    Leader(Leadership),
    /// Another node leads (or nobody does, right now).
    Follower(Option<LeaderRecord>),
}

/// This node's view of every shard's leadership, indexed by shard.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Roles {
    shards: Vec<Role>,
}

impl Roles {
    /// Nothing known yet, for `count` shards.
    pub fn unknown(count: ShardCount) -> Roles {
        Roles {
            shards: vec![Role::Unknown; count.get() as usize],
        }
    }

    /// One shard in `role` (a store that is not split).
    pub fn single(role: Role) -> Roles {
        Roles { shards: vec![role] }
    }

    /// A role for each shard, in order (none: one unknown shard).
    pub fn from_shards(shards: Vec<Role>) -> Roles {
        if shards.is_empty() {
            return Roles::single(Role::Unknown);
        }
        Roles { shards }
    }

    /// How many shards there are.
    pub fn count(&self) -> ShardCount {
        ShardCount::new(u32::try_from(self.shards.len()).unwrap_or(u32::MAX))
            .unwrap_or(ShardCount::ONE)
    }

    /// The role for `shard` (unknown for one out of range).
    pub fn of(&self, shard: ShardId) -> &Role {
        const UNKNOWN: &Role = &Role::Unknown;
        self.shards.get(shard.0 as usize).unwrap_or(UNKNOWN)
    }

    /// This node's leadership of `shard`, if it leads it.
    pub fn leadership(&self, shard: ShardId) -> Option<Leadership> {
        match self.of(shard) {
            Role::Leader(leadership) => Some(*leadership),
            _ => None,
        }
    }

    /// This node's leadership of shard 0, if it leads it: the coordinator's duties are its.
    pub fn coordinating(&self) -> Option<Leadership> {
        self.leadership(ShardId(0))
    }

    /// Every shard's role, in order.
    pub fn all(&self) -> &[Role] {
        &self.shards
    }

    /// The shards this node leads.
    pub fn leading(&self) -> impl Iterator<Item = Leadership> + '_ {
        self.shards.iter().filter_map(|role| match role {
            Role::Leader(leadership) => Some(*leadership),
            _ => None,
        })
    }
}

/// Reads the current leader record of `shard`.
pub async fn current_leader(kv: &dyn Kv, shard: ShardId) -> Result<Option<LeaderRecord>, KvError> {
    Ok(kv
        .get(&leader_key(shard))
        .await?
        .and_then(|v| serde_json::from_slice(&v.value).ok()))
}

/// The store's shard count, agreed on: the count stored, written first as `wanted` (or one shard)
/// when none is. Refused when `wanted` differs from the stored count: pools would map to other
/// shards, and two leaders could grant one pool.
pub async fn agree_shard_count(
    kv: &dyn Kv,
    wanted: Option<ShardCount>,
) -> Result<ShardCount, String> {
    let read = |bytes: &[u8]| {
        std::str::from_utf8(bytes)
            .ok()
            .and_then(|text| text.parse::<u32>().ok())
            .and_then(|n| ShardCount::new(n).ok())
            .ok_or_else(|| format!("{SHARD_COUNT_KEY} does not hold a shard count"))
    };
    let stored = match kv.get(SHARD_COUNT_KEY).await.map_err(|e| e.to_string())? {
        Some(value) => read(&value.value)?,
        None => {
            let count = wanted.unwrap_or(ShardCount::ONE);
            let outcome = kv
                .txn(
                    vec![Compare::ModRevision {
                        key: SHARD_COUNT_KEY.to_owned(),
                        revision: 0,
                    }],
                    vec![Op::Put {
                        key: SHARD_COUNT_KEY.to_owned(),
                        value: count.get().to_string().into_bytes(),
                        lease: None,
                    }],
                )
                .await
                .map_err(|e| e.to_string())?;
            if outcome.succeeded {
                count
            } else {
                // Another process wrote it first: that count holds.
                let value = kv
                    .get(SHARD_COUNT_KEY)
                    .await
                    .map_err(|e| e.to_string())?
                    .ok_or_else(|| format!("{SHARD_COUNT_KEY} vanished"))?;
                read(&value.value)?
            }
        }
    };
    match wanted {
        Some(wanted) if wanted != stored => Err(format!(
            "--shards {} disagrees with the store, whose pools are split into {} shards (a store's \
             shard count cannot change)",
            wanted.get(),
            stored.get()
        )),
        _ => Ok(stored),
    }
}

/// Tries once to lead shard 0 with a lease of its own (a store that is not split, as drills and
/// tests run it). `Ok(None)` when someone else leads or won the race.
pub async fn try_acquire(
    kv: &dyn Kv,
    node_id: &str,
    advertise_url: &str,
    ttl_s: i64,
) -> Result<Option<Leadership>, KvError> {
    if kv.get(LEADER_KEY).await?.is_some() {
        return Ok(None);
    }
    let lease = kv.grant_lease(ttl_s).await?;
    let acquired = try_acquire_shard(kv, ShardId(0), node_id, advertise_url, lease).await?;
    if acquired.is_none() {
        kv.revoke(lease).await?;
    }
    Ok(acquired)
}

/// Tries once to lead `shard`, its key kept by `lease`. `Ok(None)` when someone else leads or won
/// the race.
pub async fn try_acquire_shard(
    kv: &dyn Kv,
    shard: ShardId,
    node_id: &str,
    advertise_url: &str,
    lease: i64,
) -> Result<Option<Leadership>, KvError> {
    let key = leader_key(shard);
    if kv.get(&key).await?.is_some() {
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
    let value = serde_json::to_vec(&record).map_err(|e| KvError::Refused(e.to_string()))?;
    let outcome = kv
        .txn(
            vec![
                Compare::ModRevision {
                    key: key.clone(),
                    revision: 0,
                },
                Compare::ModRevision {
                    key: EPOCH_KEY.to_owned(),
                    revision: epoch_revision,
                },
            ],
            vec![
                Op::Put {
                    key,
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
        return Ok(None);
    }
    Ok(Some(Leadership {
        shard,
        epoch,
        leader_revision: outcome.revision,
        lease,
    }))
}

/// Every shard's leader as stored, with its key's revision: one read for shard 0 and one listing
/// for the rest.
pub async fn read_leaders(
    kv: &dyn Kv,
    count: ShardCount,
) -> Result<Vec<Option<(LeaderRecord, i64)>>, KvError> {
    let mut leaders = vec![None; count.get() as usize];
    let decode = |value: &crate::kv::Versioned| {
        serde_json::from_slice::<LeaderRecord>(&value.value)
            .ok()
            .map(|record| (record, value.mod_revision))
    };
    if let Some(value) = kv.get(LEADER_KEY).await? {
        leaders[0] = decode(&value);
    }
    if count.get() > 1 {
        for (key, value) in kv
            .get_prefix(
                SHARD_LEADERS_PREFIX,
                allot_shared::shards::MAX_SHARDS as usize,
            )
            .await?
        {
            if let Some(slot) =
                shard_of_leader_key(&key).and_then(|s| leaders.get_mut(s.0 as usize))
            {
                *slot = decode(&value);
            }
        }
    }
    Ok(leaders)
}

/// The node ids of the processes whose membership keys are live.
pub async fn read_members(kv: &dyn Kv) -> Result<Vec<String>, KvError> {
    Ok(kv
        .get_prefix(MEMBERS_PREFIX, crate::kv::MAX_PREFIX_KEYS)
        .await?
        .into_iter()
        .filter_map(|(key, _)| key.strip_prefix(MEMBERS_PREFIX).map(str::to_owned))
        .collect())
}

/// Campaign settings.
#[derive(Debug, Clone)]
pub struct ElectionConfig {
    /// This node's id.
    pub node_id: String,
    /// Its advertised URL.
    pub advertise_url: String,
    /// Store lease TTL in seconds: a crashed leader's shards are taken over after at most this long.
    pub lease_ttl_s: i64,
    /// How many shards the store's pools are split into (agreed with [`agree_shard_count`]).
    pub shard_count: ShardCount,
}

/// One process's campaign over every shard, round after round.
struct Campaign {
    config: ElectionConfig,
    ttl_ms: u64,
    renew_within: Duration,
    /// The process's store lease, which keeps its membership and leader keys.
    lease: Option<i64>,
    last_renewal_ms: u64,
    /// The shards led, each with its proof.
    held: Vec<Option<Leadership>>,
    /// Rounds each shard has been seen free in a row.
    free_rounds: Vec<u32>,
}

impl Campaign {
    fn new(config: ElectionConfig) -> Campaign {
        let ttl_ms = u64::try_from(config.lease_ttl_s).unwrap_or(1).max(1) * 1_000;
        let shards = config.shard_count.get() as usize;
        Campaign {
            ttl_ms,
            // A renewal that hangs counts as failed once a third of the TTL has passed: the round
            // must get back to the step-down check, whatever the store does.
            renew_within: Duration::from_millis(ttl_ms / 3),
            config,
            lease: None,
            last_renewal_ms: 0,
            held: vec![None; shards],
            free_rounds: vec![0; shards],
        }
    }

    /// How often a round runs: three renewals per TTL, and a look for free shards every second
    /// at least, so a shard handed over or resigned is taken at once.
    fn round_every(&self) -> Duration {
        self.renew_within.min(Duration::from_secs(1))
    }

    /// The roles as held now: led shards led, the others not known.
    fn roles_held(&self) -> Roles {
        Roles {
            shards: self
                .held
                .iter()
                .map(|held| held.map_or(Role::Unknown, Role::Leader))
                .collect(),
        }
    }

    /// Gives up every shard (the lease lapsed or is being abandoned).
    fn drop_all(&mut self) {
        for (shard, held) in self.held.iter_mut().enumerate() {
            if let Some(leadership) = held.take() {
                tracing::warn!(shard, epoch = %leadership.epoch, "shard leadership lost");
            }
        }
    }

    /// One round: keep the lease, read who leads what, hand over or take shards as the placement
    /// says, and return the roles that result.
    async fn round(&mut self, kv: &dyn Kv, clock: &dyn Clock) -> Roles {
        match self.keep_lease(kv, clock).await {
            Ok(lease) => match self.campaign(kv, lease).await {
                Ok(roles) => roles,
                Err(error) => {
                    tracing::warn!(%error, "election round failed");
                    self.roles_held()
                }
            },
            Err(error) => {
                tracing::warn!(%error, "election round failed");
                self.roles_held()
            }
        }
    }

    /// Keeps the process's lease alive (making one, with its membership key, when there is none).
    /// Once two thirds of the TTL pass without a renewal the lease is abandoned and every shard
    /// given up, before the store could expire it: past that point another process may lead, and
    /// although the fence stops our writes, we must stop claiming (readiness, metrics, answers).
    async fn keep_lease(&mut self, kv: &dyn Kv, clock: &dyn Clock) -> Result<i64, String> {
        let Some(lease) = self.lease else {
            let lease = kv
                .grant_lease(self.config.lease_ttl_s)
                .await
                .map_err(|e| e.to_string())?;
            let member = Op::Put {
                key: format!("{MEMBERS_PREFIX}{}", self.config.node_id),
                value: self.config.advertise_url.clone().into_bytes(),
                lease: Some(lease),
            };
            if let Err(error) = kv.txn(Vec::new(), vec![member]).await {
                let _ = kv.revoke(lease).await;
                return Err(error.to_string());
            }
            self.lease = Some(lease);
            self.last_renewal_ms = clock.now_ms();
            return Ok(lease);
        };
        match tokio::time::timeout(self.renew_within, kv.keep_alive(lease)).await {
            Ok(Ok(_)) => {
                self.last_renewal_ms = clock.now_ms();
                Ok(lease)
            }
            Ok(Err(KvError::LeaseNotFound(_))) => {
                self.lease = None;
                self.drop_all();
                Err("the store lease lapsed".to_owned())
            }
            failed => {
                let error = match failed {
                    Ok(Err(error)) => error.to_string(),
                    _ => format!("no answer within {:?}", self.renew_within),
                };
                if clock.now_ms().saturating_sub(self.last_renewal_ms) >= self.ttl_ms * 2 / 3 {
                    self.lease = None;
                    self.drop_all();
                    return Err(format!(
                        "cannot renew the store lease ({error}); stepping down"
                    ));
                }
                Err(format!("store lease renewal failed ({error}); retrying"))
            }
        }
    }

    /// Reads members and leaders, checks every held shard is still ours, and hands over or takes
    /// shards as the placement says.
    async fn campaign(&mut self, kv: &dyn Kv, lease: i64) -> Result<Roles, KvError> {
        let count = self.config.shard_count;
        let mut members = read_members(kv).await?;
        if !members.contains(&self.config.node_id) {
            members.push(self.config.node_id.clone());
        }
        let mut leaders = read_leaders(kv, count).await?;
        self.drop_deposed(&leaders);
        let me = self.config.node_id.as_str();
        let member_names: Vec<&str> = members.iter().map(String::as_str).collect();
        let leader_names: Vec<Option<String>> = leaders
            .iter()
            .map(|l| l.as_ref().map(|(record, _)| record.node_id.clone()))
            .collect();
        let leader_refs: Vec<Option<&str>> = leader_names.iter().map(Option::as_deref).collect();
        let placement = Placement::new(&member_names, &leader_refs);
        if let Some(shard) = placement.to_hand_over(me)
            && let Some(leadership) = self.held[shard.0 as usize]
        {
            self.hand_over(kv, leadership).await?;
            self.held[shard.0 as usize] = None;
            leaders[shard.0 as usize] = None;
        }
        let placement_taker: Vec<Option<String>> = count
            .shards()
            .map(|shard| placement.taker(shard).map(str::to_owned))
            .collect();
        let mut roles = Vec::with_capacity(count.get() as usize);
        for shard in count.shards() {
            let index = shard.0 as usize;
            if let Some(leadership) = self.held[index] {
                self.free_rounds[index] = 0;
                roles.push(Role::Leader(leadership));
                continue;
            }
            if let Some((record, _)) = &leaders[index] {
                self.free_rounds[index] = 0;
                roles.push(Role::Follower(Some(record.clone())));
                continue;
            }
            self.free_rounds[index] += 1;
            let placed_here = placement_taker[index].as_deref() == Some(me);
            if !placed_here && self.free_rounds[index] <= ORPHAN_GRACE_ROUNDS {
                roles.push(Role::Follower(None));
                continue;
            }
            let config = &self.config;
            match try_acquire_shard(kv, shard, &config.node_id, &config.advertise_url, lease)
                .await?
            {
                Some(leadership) => {
                    tracing::info!(shard = index, epoch = %leadership.epoch,
                        node = %config.node_id, "leading a shard");
                    self.held[index] = Some(leadership);
                    self.free_rounds[index] = 0;
                    roles.push(Role::Leader(leadership));
                }
                None => roles.push(Role::Follower(current_leader(kv, shard).await?)),
            }
        }
        Ok(Roles { shards: roles })
    }

    /// Forgets every held shard whose leader key is no longer the one this process wrote.
    fn drop_deposed(&mut self, leaders: &[Option<(LeaderRecord, i64)>]) {
        for (shard, held) in self.held.iter_mut().enumerate() {
            let still = match (&*held, &leaders[shard]) {
                (Some(leadership), Some((_, revision))) => *revision == leadership.leader_revision,
                _ => false,
            };
            if let (Some(leadership), false) = (*held, still) {
                tracing::warn!(shard, epoch = %leadership.epoch, "deposed from a shard");
                *held = None;
            }
        }
    }

    /// Gives `leadership`'s shard up for another process to take: its key deleted under its own
    /// fence, so nothing is deleted that another process wrote.
    async fn hand_over(&self, kv: &dyn Kv, leadership: Leadership) -> Result<(), KvError> {
        if resign(kv, leadership).await? {
            tracing::info!(shard = %leadership.shard, epoch = %leadership.epoch,
                "handing a shard over to even out the load");
        }
        Ok(())
    }
}

/// Gives up `leadership`'s shard: its key deleted under its own fence, so nothing is deleted that
/// another process wrote. Whether it was still held.
pub async fn resign(kv: &dyn Kv, leadership: Leadership) -> Result<bool, KvError> {
    let outcome = kv
        .txn(
            vec![leadership.fence()],
            vec![Op::Delete {
                key: leader_key(leadership.shard),
            }],
        )
        .await?;
    Ok(outcome.succeeded)
}

/// Runs the election until `shutdown` resolves, publishing this node's role for every shard. On
/// shutdown the node revokes its lease, so its shards are taken over at once instead of after the
/// TTL.
pub async fn run_election(
    kv: Arc<dyn Kv>,
    clock: Arc<dyn Clock>,
    config: ElectionConfig,
    roles: watch::Sender<Roles>,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let mut campaign = Campaign::new(config);
    loop {
        let next = campaign.round(&*kv, &*clock).await;
        publish_metrics(&next);
        roles.send_if_modified(|r| {
            let changed = *r != next;
            *r = next;
            changed
        });
        tokio::select! {
            () = &mut shutdown => break,
            () = tokio::time::sleep(campaign.round_every()) => {}
        }
    }
    if let Some(lease) = campaign.lease
        && let Err(error) = kv.revoke(lease).await
    {
        tracing::warn!(%error, "could not revoke the store lease on shutdown");
    }
    roles.send_replace(Roles::unknown(campaign.config.shard_count));
}

/// The election's gauges: shard 0's leadership (the coordinator) and how many shards are led.
fn publish_metrics(roles: &Roles) {
    let (epoch, coordinating) = match roles.coordinating() {
        Some(leadership) => (leadership.epoch.0 as f64, 1.0),
        None => (0.0, 0.0),
    };
    metrics::gauge!(crate::metrics::LEADER_EPOCH).set(epoch);
    metrics::gauge!(crate::metrics::IS_LEADER).set(coordinating);
    metrics::gauge!(crate::metrics::SHARDS_LED).set(roles.leading().count() as f64);
}
