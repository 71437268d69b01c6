//! Shards: which allocator replica decides a pool.
//!
//! Pools are split into a fixed number of shards by a stable hash of `tenant/pool`, and each shard
//! is led by one replica at a time (its own election, epoch stamp and fence in the store). Every
//! replica and every agent computes the same shard for a pool from this module alone, so the hash
//! is part of the wire contract: FNV-1a over the UTF-8 bytes of `tenant/pool`, 64 bits, modulo the
//! shard count. It must never change for a stored shard count.
//!
//! Which replica *should* lead a shard is [`Placement`]: worked out alike by every replica from
//! the live replicas and the current leaders, balanced (no replica more than one shard above
//! another) and sticky (a shard moves only to even the load out). The fence, not the placement,
//! keeps two replicas from granting one window: a placement only decides who asks first.

use std::fmt;

use crate::ids::{PoolId, TenantId};

/// Most shards a store may be split into.
pub const MAX_SHARDS: u32 = 256;

/// A shard's number, `0..count`.
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    PartialOrd,
    Ord,
    Hash,
    serde::Serialize,
    serde::Deserialize,
    utoipa::ToSchema,
)]
#[serde(transparent)]
pub struct ShardId(pub u32);

impl fmt::Display for ShardId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}", self.0)
    }
}

/// How many shards the pools are split into: `1..=MAX_SHARDS`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ShardCount(u32);

impl ShardCount {
    /// One shard: every pool decided by one leader.
    pub const ONE: ShardCount = ShardCount(1);

    /// A shard count, or why it cannot be one.
    pub fn new(count: u32) -> Result<ShardCount, String> {
        if (1..=MAX_SHARDS).contains(&count) {
            Ok(ShardCount(count))
        } else {
            Err(format!(
                "a shard count must be in [1, {MAX_SHARDS}], got {count}"
            ))
        }
    }

    /// The count.
    pub fn get(self) -> u32 {
        self.0
    }

    /// Every shard, in order.
    pub fn shards(self) -> impl Iterator<Item = ShardId> {
        (0..self.0).map(ShardId)
    }
}

/// FNV-1a, 64 bits: small, stable across versions and languages (unlike `std`'s hasher).
fn fnv1a(parts: &[&[u8]]) -> u64 {
    let mut hash: u64 = 0xcbf2_9ce4_8422_2325;
    for part in parts {
        for byte in *part {
            hash ^= u64::from(*byte);
            hash = hash.wrapping_mul(0x0100_0000_01b3);
        }
    }
    hash
}

/// The shard that decides `tenant/pool`.
pub fn shard_of(tenant: &TenantId, pool: &PoolId, count: ShardCount) -> ShardId {
    let hash = fnv1a(&[tenant.as_str().as_bytes(), b"/", pool.as_str().as_bytes()]);
    let shard = hash % u64::from(count.0);
    // `shard < count <= MAX_SHARDS`, so it fits.
    ShardId(u32::try_from(shard).unwrap_or(0))
}

/// A member's rank for a shard: which of several equally placed members takes it.
fn rank(member: &str, shard: ShardId) -> u64 {
    fnv1a(&[member.as_bytes(), b"#", &shard.0.to_be_bytes()])
}

/// Where shards should go, worked out from what a replica reads in the store: the live members and
/// every shard's current leader. Every replica reading the same store works out the same placement,
/// so they agree on who campaigns for a free shard and who hands one over, without talking.
///
/// Sticky and balanced: each member's target is `count / n` shards, and `count % n` of them (those
/// leading most now, then by name) one more. A member above its target hands over one shard a
/// round (the one it ranks lowest); a free shard goes to the member furthest below its target
/// (ties by rank). So shards move only to even out the load, as few as that takes, and a replica
/// joining takes its share while one leaving gives its shards to the rest.
#[derive(Debug, Clone)]
pub struct Placement<'a> {
    /// Who should take each shard when it is free (`None`: nobody is below target).
    takers: Vec<Option<&'a str>>,
    /// Each member's leaders count above its target.
    surplus: Vec<(&'a str, usize)>,
    /// Every shard's leader, as read.
    leaders: Vec<Option<&'a str>>,
}

impl<'a> Placement<'a> {
    /// The placement for `members` (the live replicas) when `leaders[s]` leads shard `s` (`None`:
    /// free). A leader that is not a live member (its key not yet lapsed) keeps its shard and counts
    /// for no one.
    pub fn new(members: &[&'a str], leaders: &[Option<&'a str>]) -> Placement<'a> {
        let mut members: Vec<&str> = members.to_vec();
        members.sort_unstable();
        members.dedup();
        let shard_count = leaders.len();
        if members.is_empty() {
            return Placement {
                takers: vec![None; shard_count],
                surplus: Vec::new(),
                leaders: leaders.to_vec(),
            };
        }
        let load = |member: &str| leaders.iter().filter(|l| **l == Some(member)).count();
        let mut by_load: Vec<(usize, &str)> = members.iter().map(|m| (load(m), *m)).collect();
        // Most loaded first, then by name: those keep the larger targets, so fewer shards move.
        by_load.sort_unstable_by(|a, b| b.0.cmp(&a.0).then(a.1.cmp(b.1)));
        let (base, fuller) = (shard_count / members.len(), shard_count % members.len());
        let targets: Vec<(&str, usize, usize)> = by_load
            .iter()
            .enumerate()
            .map(|(place, (load, member))| (*member, *load, base + usize::from(place < fuller)))
            .collect();
        let surplus = targets
            .iter()
            .map(|(member, load, target)| (*member, load.saturating_sub(*target)))
            .collect();
        let mut deficit: Vec<(&str, usize)> = targets
            .iter()
            .map(|(member, load, target)| (*member, target.saturating_sub(*load)))
            .collect();
        let mut takers = vec![None; shard_count];
        for (shard, taker) in takers.iter_mut().enumerate() {
            if leaders[shard].is_some() {
                continue;
            }
            let shard_id = ShardId(u32::try_from(shard).unwrap_or(u32::MAX));
            if let Some((member, owed)) = deficit
                .iter_mut()
                .filter(|(_, owed)| *owed > 0)
                .max_by_key(|(member, owed)| (*owed, rank(member, shard_id)))
            {
                *owed -= 1;
                *taker = Some(*member);
            }
        }
        Placement {
            takers,
            surplus,
            leaders: leaders.to_vec(),
        }
    }

    /// Who should take `shard` while it is free.
    pub fn taker(&self, shard: ShardId) -> Option<&'a str> {
        self.takers.get(shard.0 as usize).copied().flatten()
    }

    /// The shard `member` should hand over this round, if it leads more than its target: the one
    /// it ranks lowest.
    pub fn to_hand_over(&self, member: &str) -> Option<ShardId> {
        let (_, surplus) = self.surplus.iter().find(|(m, _)| *m == member)?;
        if *surplus == 0 {
            return None;
        }
        self.leaders
            .iter()
            .enumerate()
            .filter(|(_, leader)| **leader == Some(member))
            .map(|(shard, _)| ShardId(u32::try_from(shard).unwrap_or(u32::MAX)))
            .min_by_key(|shard| rank(member, *shard))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    fn pool(tenant: &str, pool: &str) -> (TenantId, PoolId) {
        (
            TenantId::parse(tenant).expect("tenant"),
            PoolId::parse(pool).expect("pool"),
        )
    }

    #[test]
    fn the_hash_is_pinned() {
        // The shard of a pool is a contract between replicas and agents of every version: these
        // values must never change.
        let (tenant, api) = pool("acme", "api");
        assert_eq!(fnv1a(&[b""]), 0xcbf2_9ce4_8422_2325);
        assert_eq!(fnv1a(&[b"a"]), 0xaf63_dc4c_8601_ec8c);
        assert_eq!(fnv1a(&[b"acme/api"]), fnv1a(&[b"acme", b"/", b"api"]));
        let sixteen = ShardCount::new(16).expect("count");
        assert_eq!(
            shard_of(&tenant, &api, sixteen).0 as u64,
            fnv1a(&[b"acme/api"]) % 16
        );
        assert_eq!(shard_of(&tenant, &api, ShardCount::ONE), ShardId(0));
    }

    #[test]
    fn counts_outside_the_range_are_refused() {
        assert!(ShardCount::new(0).is_err());
        assert!(ShardCount::new(MAX_SHARDS + 1).is_err());
        assert_eq!(ShardCount::new(MAX_SHARDS).map(ShardCount::get), Ok(256));
    }

    #[test]
    fn pools_spread_over_shards() {
        let count = ShardCount::new(8).expect("count");
        let mut per_shard = [0u32; 8];
        for n in 0..8_000 {
            let (tenant, api) = pool(&format!("t{n:05}"), "api");
            per_shard[shard_of(&tenant, &api, count).0 as usize] += 1;
        }
        // 1,000 expected each; a stable hash of similar names must not cluster.
        assert!(
            per_shard.iter().all(|&n| (850..=1_150).contains(&n)),
            "{per_shard:?}"
        );
    }

    #[test]
    fn no_members_take_nothing() {
        let placement = Placement::new(&[], &[None, None]);
        assert_eq!(placement.taker(ShardId(0)), None);
        assert_eq!(placement.to_hand_over("a"), None);
    }

    /// Runs placement rounds as the replicas do: each member above target hands one shard over,
    /// then every free shard goes to its taker. Returns the leaders once nothing changes, and how
    /// many times a shard changed hands.
    fn settle<'a>(
        members: &[&'a str],
        mut leaders: Vec<Option<&'a str>>,
    ) -> (Vec<Option<&'a str>>, usize) {
        let mut moves = 0;
        for _ in 0..=2 * leaders.len() + 2 {
            let placement = Placement::new(members, &leaders);
            let handed: Vec<ShardId> = members
                .iter()
                .filter_map(|m| placement.to_hand_over(m))
                .collect();
            for shard in &handed {
                leaders[shard.0 as usize] = None;
            }
            let placement = Placement::new(members, &leaders);
            let mut taken = 0;
            for (shard, leader) in leaders.iter_mut().enumerate() {
                if leader.is_none() {
                    *leader = placement.taker(ShardId(shard as u32));
                    taken += usize::from(leader.is_some());
                }
            }
            moves += handed.len();
            if handed.is_empty() && taken == 0 {
                return (leaders, moves);
            }
        }
        panic!("placement did not settle: {leaders:?}");
    }

    proptest! {
        #[test]
        fn placement_settles_balanced_moving_only_what_it_must(
            count in 1usize..=64,
            names in proptest::collection::btree_set("[a-z]{1,6}", 1..8),
            start in proptest::collection::vec(0usize..10, 64),
        ) {
            let members: Vec<&str> = names.iter().map(String::as_str).collect();
            // Any starting point: shards led by members, by gone replicas, or free.
            let gone = "zz-gone";
            let leaders: Vec<Option<&str>> = start[..count]
                .iter()
                .map(|&pick| match pick {
                    p if p < members.len() => Some(members[p]),
                    8 => Some(gone),
                    _ => None,
                })
                .collect();
            // A gone replica's keys lapse: its shards are free.
            let leaders: Vec<Option<&str>> =
                leaders.into_iter().map(|l| l.filter(|m| *m != gone)).collect();
            let before = leaders.clone();
            let (after, handed_over) = settle(&members, leaders);
            prop_assert!(after.iter().all(Option::is_some), "a shard left free: {:?}", after);
            let mut loads: Vec<usize> = members
                .iter()
                .map(|m| after.iter().filter(|l| **l == Some(*m)).count())
                .collect();
            loads.sort_unstable();
            prop_assert!(loads[loads.len() - 1] - loads[0] <= 1, "loads {:?}", loads);
            // Only what must move moves: each member's shards above its final load, once.
            let must_move: usize = members
                .iter()
                .map(|m| {
                    let had = before.iter().filter(|l| **l == Some(*m)).count();
                    let has = after.iter().filter(|l| **l == Some(*m)).count();
                    had.saturating_sub(has)
                })
                .sum();
            prop_assert_eq!(handed_over, must_move);
            let kept = before.iter().zip(&after).filter(|(b, a)| b.is_some() && b == a).count();
            let held_before = before.iter().filter(|b| b.is_some()).count();
            prop_assert_eq!(kept, held_before - must_move);
        }

        #[test]
        fn a_new_member_takes_its_share_and_no_more(
            count in 1usize..=64,
            names in proptest::collection::btree_set("[a-z]{1,6}", 2..8),
        ) {
            let members: Vec<&str> = names.iter().map(String::as_str).collect();
            let (settled, _) = settle(&members[1..], vec![None; count]);
            let (after, handed_over) = settle(&members, settled.clone());
            let newcomer_has = after.iter().filter(|l| **l == Some(members[0])).count();
            prop_assert_eq!(handed_over, newcomer_has);
            prop_assert!(newcomer_has >= count / members.len());
            prop_assert!(newcomer_has <= count.div_ceil(members.len()));
        }
    }
}
