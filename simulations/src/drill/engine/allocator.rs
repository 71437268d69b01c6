//! The shipped grant service for the drill's pools, as the agents reach it: the pools put in the
//! embedded store, one leader granting, and a failover to the next epoch's leader. With the pools
//! split into shards, a second allocator beside the first, shards moving between them one at a
//! time, and each pool's calls sent to its shard's leader, as agents send them.

use std::sync::Arc;

use allot_allocator::clock::{Clock, ManualClock};
use allot_allocator::grants::{Grantor, LeaseReturn};
use allot_allocator::kv::memory::MemoryKv;
use allot_allocator::kv::{Kv, Op};
use allot_allocator::leader::{
    EPOCH_KEY, Leadership, Role, Roles, resign, try_acquire, try_acquire_shard,
};
use allot_allocator::pools::get_window;
use allot_shared::ids::{LeaseId, PoolId, RegionId, TenantId};
use allot_shared::lease::{GrantRequest, LeaseClamping, PoolConfig};
use allot_shared::shards::{ShardCount, ShardId, shard_of};
use allot_shared::wire::{GrantAnswer, ReportLease};
use tokio::sync::watch;

use super::{DrillError, store};

/// The shipped grant service for the drill's pools, as the agents reach it.
pub(super) struct DrillAllocator {
    pub(super) kv: Arc<dyn Kv>,
    leadership: Leadership,
    /// Keeps the current leader's role readable.
    role_sender: watch::Sender<Roles>,
    clamping: LeaseClamping,
    grantor: Grantor,
    pub(super) tenants: Vec<TenantId>,
    /// The pool each region draws from, by tenant and region index.
    pools: Vec<Vec<PoolId>>,
    /// Lease ids are made from the virtual time and this counter (unique, reproducible).
    pub(super) leases_asked: u128,
    /// With the pools split into shards: the second allocator (the first is the one above).
    second: Option<SecondAllocator>,
}

/// The second allocator of a store split into shards: it leads the shards moved to it.
struct SecondAllocator {
    grantor: Grantor,
    role_sender: watch::Sender<Roles>,
    lease: i64,
    /// The first allocator's store lease, which keeps its leader keys.
    first_lease: i64,
}

/// Node ids and URLs of the drill's two allocators of a split store.
const NODES: [(&str, &str); 2] = [
    ("drill-allocator", "http://drill"),
    ("drill-allocator-b", "http://drill-b"),
];

impl DrillAllocator {
    /// The first allocator, leading over `pools` of `tenants` (its leader key outlives any drill:
    /// failover drills replace it explicitly).
    pub(super) async fn lead(
        kv: Arc<dyn Kv>,
        clock: &Arc<ManualClock>,
        clamping: LeaseClamping,
        tenants: Vec<TenantId>,
        pools: Vec<Vec<PoolId>>,
    ) -> Result<Self, DrillError> {
        let leadership = try_acquire(&*kv, "drill-allocator", "http://drill", 1 << 40)
            .await
            .map_err(store)?
            .ok_or_else(|| {
                DrillError::Broken("the drill allocator did not become leader".into())
            })?;
        let (role_sender, role) = watch::channel(Roles::single(Role::Leader(leadership)));
        Ok(Self {
            grantor: Grantor::new(
                kv.clone(),
                clock.clone() as Arc<dyn Clock>,
                role,
                clamping,
                None,
            ),
            kv,
            leadership,
            role_sender,
            clamping,
            tenants,
            pools,
            leases_asked: 0,
            second: None,
        })
    }

    /// Two allocators over a store split into `shards`: the first leads every shard at the start.
    pub(super) async fn lead_shards(
        kv: Arc<dyn Kv>,
        clock: &Arc<ManualClock>,
        clamping: LeaseClamping,
        tenants: Vec<TenantId>,
        pools: Vec<Vec<PoolId>>,
        shards: ShardCount,
    ) -> Result<Self, DrillError> {
        if shards.get() == 1 {
            return Self::lead(kv, clock, clamping, tenants, pools).await;
        }
        let first_lease = kv.grant_lease(1 << 40).await.map_err(store)?;
        let mut roles = Vec::new();
        for shard in shards.shards() {
            let (node, url) = NODES[0];
            let leadership = try_acquire_shard(&*kv, shard, node, url, first_lease)
                .await
                .map_err(store)?
                .ok_or_else(|| DrillError::Broken(format!("shard {shard} not led at the start")))?;
            roles.push(Role::Leader(leadership));
        }
        let Role::Leader(leadership) = roles[0] else {
            return Err(DrillError::Broken("shard 0 not led".into()));
        };
        let (role_sender, role) = watch::channel(Roles::from_shards(roles));
        let followed = Roles::from_shards(vec![Role::Follower(None); shards.get() as usize]);
        let (second_sender, second_role) = watch::channel(followed);
        let lease = kv.grant_lease(1 << 40).await.map_err(store)?;
        let grantor = |role| {
            Grantor::new(
                kv.clone(),
                clock.clone() as Arc<dyn Clock>,
                role,
                clamping,
                None,
            )
        };
        Ok(Self {
            grantor: grantor(role),
            second: Some(SecondAllocator {
                grantor: grantor(second_role),
                role_sender: second_sender,
                lease,
                first_lease,
            }),
            kv: kv.clone(),
            leadership,
            role_sender,
            clamping,
            tenants,
            pools,
            leases_asked: 0,
        })
    }

    /// The grantor that leads the shard of `tenant`'s pool for region `region_index`: where an
    /// agent's client sends its calls.
    fn grantor_for(&self, tenant: usize, region_index: usize) -> &Grantor {
        let Some(second) = &self.second else {
            return &self.grantor;
        };
        let roles = second.role_sender.borrow();
        let shard = shard_of(
            &self.tenants[tenant],
            &self.pools[tenant][region_index],
            roles.count(),
        );
        if roles.leadership(shard).is_some() {
            &second.grantor
        } else {
            &self.grantor
        }
    }

    /// Moves `shard` to the other allocator: its leader key goes (as a hand-over deletes it, or a
    /// lapsed lease drops it), the other takes it with the next epoch, and the old leader, still
    /// believing it leads, is asked for a grant of a pool in the shard: the fence must refuse it.
    ///
    /// Long by design: the old leader's belief is kept from the key's removal to the probe, and
    /// only then corrected; split, that window would be spread between functions.
    pub(super) async fn move_shard(
        &mut self,
        shard: ShardId,
        config: &PoolConfig,
        now_ms: u64,
    ) -> Result<(), DrillError> {
        let Some(second) = &self.second else {
            return Err(DrillError::Broken("a shard move needs shards".into()));
        };
        let first_leads = self.role_sender.borrow().leadership(shard);
        let second_leads = second.role_sender.borrow().leadership(shard);
        let (from, from_grantor, to_sender, to_lease, to_node) = match (first_leads, second_leads) {
            (Some(held), None) => (
                held,
                &self.grantor,
                &second.role_sender,
                second.lease,
                NODES[1],
            ),
            (None, Some(held)) => (
                held,
                &second.grantor,
                &self.role_sender,
                second.first_lease,
                NODES[0],
            ),
            _ => {
                return Err(DrillError::Broken(format!(
                    "shard {shard} has no one leader"
                )));
            }
        };
        if !resign(&*self.kv, from).await.map_err(store)? {
            return Err(DrillError::Broken(format!(
                "shard {shard}'s key was not its leader's"
            )));
        }
        let taken = try_acquire_shard(&*self.kv, shard, to_node.0, to_node.1, to_lease)
            .await
            .map_err(store)?
            .ok_or_else(|| DrillError::Broken(format!("shard {shard} was not taken over")))?;
        debug_assert!(taken.epoch > from.epoch);
        to_sender.send_modify(|roles| *roles = with_role(roles, shard, Role::Leader(taken)));
        // The old leader still believes it leads: a grant of one of the shard's pools must fail on
        // the fence, not be granted from what it knew.
        let probe = (0..self.tenants.len()).find_map(|t| {
            (0..self.pools[t].len())
                .find(|&r| {
                    shard_of(
                        &self.tenants[t],
                        &self.pools[t][r],
                        self.role_sender.borrow().count(),
                    ) == shard
                })
                .map(|r| (t, r))
        });
        if let Some((tenant, region_index)) = probe {
            self.leases_asked += 1;
            let attempt = from_grantor
                .grant(
                    &self.tenants[tenant],
                    &self.pools[tenant][region_index],
                    GrantRequest {
                        lease_id: LeaseId::from_parts(now_ms, self.leases_asked),
                        region: config.regions().first().cloned().ok_or_else(|| {
                            DrillError::Broken("a pool has at least one region".into())
                        })?,
                        want_tokens: 1,
                    },
                )
                .await;
            if let Ok(answer) = attempt {
                return Err(DrillError::Broken(format!(
                    "the allocator that lost shard {shard} still answered a grant ({} tokens)",
                    answer.granted_tokens
                )));
            }
        }
        let from_sender = if first_leads.is_some() {
            &self.role_sender
        } else {
            &second.role_sender
        };
        from_sender.send_modify(|roles| *roles = with_role(roles, shard, Role::Follower(None)));
        Ok(())
    }

    pub(super) async fn grant(
        &mut self,
        tenant: usize,
        region_index: usize,
        region: &RegionId,
        lease_id: LeaseId,
        want_tokens: u64,
    ) -> Result<GrantAnswer, DrillError> {
        self.grantor_for(tenant, region_index)
            .grant(
                &self.tenants[tenant],
                &self.pools[tenant][region_index],
                GrantRequest {
                    lease_id,
                    region: region.clone(),
                    want_tokens,
                },
            )
            .await
            .map_err(|e| DrillError::Broken(format!("grant failed: {e}")))
    }

    /// Takes back what a lease's final `line` (of `region`'s pool of `tenant`) leaves unspent, as
    /// the allocator's report route does: how many tokens came back to the window.
    pub(super) async fn take_back(
        &mut self,
        tenant: usize,
        region_index: usize,
        region: &RegionId,
        line: &ReportLease,
    ) -> Result<u64, DrillError> {
        let lease = LeaseReturn {
            lease_id: line.lease_id,
            region: region.clone(),
            spent_tokens: line.spent_tokens,
            unspent_tokens: line.unspent_tokens,
        };
        self.grantor_for(tenant, region_index)
            .take_back(
                &self.tenants[tenant],
                &self.pools[tenant][region_index],
                lease,
            )
            .await
            .map_err(|e| DrillError::Broken(format!("taking back unspent tokens failed: {e}")))
    }

    /// Replaces the leader: the old one loses its store lease (it crashed or was partitioned away),
    /// a new one takes over with the next epoch. Returns, per tenant, the tokens granted in the
    /// current window that the new leader cannot see (0 when records are kept).
    ///
    /// Long by design: the deposed grantor is kept from its first line to its last: swapped out
    /// before its store lease is revoked, and asked for a grant only after the new leader holds the
    /// next epoch, to show it is fenced off; split, that grantor and the order of revoke, takeover
    /// and probe would be handed between pieces.
    pub(super) async fn fail_over(
        &mut self,
        config: &PoolConfig,
        clock: &Arc<ManualClock>,
        records_kept: bool,
        now_ms: u64,
    ) -> Result<Vec<u64>, DrillError> {
        let deposed = std::mem::replace(
            &mut self.grantor,
            Grantor::new(
                self.kv.clone(),
                clock.clone() as Arc<dyn Clock>,
                self.role_sender.subscribe(),
                self.clamping,
                None,
            ),
        );
        self.kv.revoke(self.leadership.lease).await.map_err(store)?;
        let mut lost = vec![0; self.tenants.len()];
        if !records_kept {
            let current = config.window_at(now_ms);
            for (t, tenant) in self.tenants.iter().enumerate() {
                let mut pools = self.pools[t].clone();
                pools.dedup();
                for pool in &pools {
                    lost[t] += get_window(&*self.kv, tenant, pool)
                        .await
                        .map_err(store)?
                        .filter(|(state, _)| state.window == current)
                        .map_or(0, |(state, _)| state.granted_tokens());
                }
            }
            // The replica the new leader reads kept configurations and the epoch, not the grants.
            let replica: Arc<dyn Kv> = Arc::new(MemoryKv::new(clock.clone()));
            let mut puts = Vec::new();
            for (key, value) in self
                .kv
                .get_prefix("/allot/", 1 << 20)
                .await
                .map_err(store)?
            {
                if key.starts_with("/allot/pools/") || key == EPOCH_KEY {
                    puts.push(Op::Put {
                        key,
                        value: value.value,
                        lease: None,
                    });
                }
            }
            for batch in puts.chunks(allot_allocator::kv::MAX_TXN_OPS) {
                replica
                    .txn(Vec::new(), batch.to_vec())
                    .await
                    .map_err(store)?;
            }
            self.kv = replica;
        }
        let leadership = try_acquire(&*self.kv, "drill-allocator-2", "http://drill-2", 1 << 40)
            .await
            .map_err(store)?
            .ok_or_else(|| DrillError::Broken("the new allocator did not become leader".into()))?;
        debug_assert!(leadership.epoch > self.leadership.epoch);
        self.leadership = leadership;
        let (role_sender, role) = watch::channel(Roles::single(Role::Leader(leadership)));
        self.role_sender = role_sender;
        self.grantor = Grantor::new(
            self.kv.clone(),
            clock.clone() as Arc<dyn Clock>,
            role,
            self.clamping,
            None,
        );
        if records_kept {
            // The deposed leader still believes it leads; its writes must be fenced off.
            self.leases_asked += 1;
            let region = config
                .regions()
                .first()
                .cloned()
                .ok_or_else(|| DrillError::Broken("a pool has at least one region".into()))?;
            let attempt = deposed
                .grant(
                    &self.tenants[0],
                    &self.pools[0][0],
                    GrantRequest {
                        lease_id: LeaseId::from_parts(now_ms, self.leases_asked),
                        region,
                        want_tokens: 1,
                    },
                )
                .await;
            // Fenced off, a deposed allocator says it does not lead. Tokens from it would be a
            // grant the new leader cannot know of; a refusal from it, an answer from a stale cache.
            match attempt {
                Ok(record) if record.granted_tokens > 0 => {
                    return Err(DrillError::Broken(format!(
                        "a deposed allocator granted {} tokens after the failover",
                        record.granted_tokens
                    )));
                }
                Ok(_) => {
                    return Err(DrillError::Broken(
                        "a deposed allocator answered from its cache after the failover instead \
                         of saying it does not lead"
                            .to_owned(),
                    ));
                }
                Err(_) => {}
            }
        }
        Ok(lost)
    }
}

/// `roles` with `shard`'s role replaced by `role`.
fn with_role(roles: &Roles, shard: ShardId, role: Role) -> Roles {
    let mut shards = roles.all().to_vec();
    if let Some(slot) = shards.get_mut(shard.0 as usize) {
        *slot = role;
    }
    Roles::from_shards(shards)
}
