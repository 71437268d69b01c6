//! etcd housekeeping, done by the leading allocator so etcd stays under its quota for months:
//! every [`HOUSEKEEPING_INTERVAL`] it reads each member's status (database size, the part in use,
//! its quota), compacts the key history to the revision it saw [`HousekeepingSettings::history_ms`]
//! ago, and defragments at most one member whose file is mostly free space, followers before the
//! etcd leader, so the file shrinks back to what is in use. Without compaction every rewritten
//! key (each pool's window, every grant record) stays in etcd's history and the database grows
//! until it hits its quota and refuses every write (`NOSPACE`).
//!
//! What to do each round is decided by pure functions ([`revision_to_compact`],
//! [`member_to_defragment`]); the round only talks to etcd.

use std::collections::VecDeque;
use std::time::Duration;

use etcd_client::{Client, CompactionOptions};

use super::KvError;
use super::etcd::{connect_client, within};

/// How often the leader keeps house.
pub const HOUSEKEEPING_INTERVAL: Duration = Duration::from_secs(300);
/// History kept by default, ms: an hour of revisions, as `--auto-compaction-retention 1h` keeps.
pub const DEFAULT_HISTORY_MS: u64 = 3_600_000;
/// etcd's own default quota, bytes, assumed for members that do not report theirs (before 3.6).
pub const DEFAULT_QUOTA_BYTES: u64 = 2 * 1024 * 1024 * 1024;
/// A member is defragmented only when at least this much of its file is free...
pub const DEFRAG_MIN_FREE_BYTES: u64 = 64 * 1024 * 1024;
/// ...and at least this share of it (percent): a defragmentation blocks the member while it runs.
pub const DEFRAG_MIN_FREE_PERCENT: u64 = 50;
/// Revision samples kept (I10): one a round covers the history many times over.
const MAX_REVISION_SAMPLES: usize = 64;

/// How the housekeeping runs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct HousekeepingSettings {
    /// The etcd members' client URLs.
    pub endpoints: Vec<String>,
    /// Key history kept, ms (revisions newer than this are never compacted).
    pub history_ms: u64,
    /// Defragment members whose files are mostly free space.
    pub defragment: bool,
    /// A member's free space below which a defragmentation is not worth its pause, bytes.
    pub defrag_min_free_bytes: u64,
}

impl HousekeepingSettings {
    /// The shipped defaults for `endpoints`.
    pub fn new(endpoints: Vec<String>) -> Self {
        Self {
            endpoints,
            history_ms: DEFAULT_HISTORY_MS,
            defragment: true,
            defrag_min_free_bytes: DEFRAG_MIN_FREE_BYTES,
        }
    }
}

/// One member's status.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct MemberStatus {
    /// Its client URL.
    pub endpoint: String,
    /// Its member id (hex in labels).
    pub member_id: u64,
    /// Whether it is etcd's raft leader.
    pub is_leader: bool,
    /// Its database file, bytes.
    pub db_size_bytes: u64,
    /// The part of it in use, bytes.
    pub db_in_use_bytes: u64,
    /// Its quota, bytes ([`DEFAULT_QUOTA_BYTES`] when it does not say).
    pub quota_bytes: u64,
    /// The store's revision as it answered.
    pub revision: i64,
}

impl MemberStatus {
    fn free_bytes(&self) -> u64 {
        self.db_size_bytes.saturating_sub(self.db_in_use_bytes)
    }
}

/// What a round did.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct RoundOutcome {
    /// Every member that answered.
    pub members: Vec<MemberStatus>,
    /// The revision history was compacted to, if it was this round.
    pub compacted_to: Option<i64>,
    /// The member defragmented this round, by endpoint.
    pub defragmented: Option<String>,
}

/// The revision to compact to at `now_ms`: the newest sample at least `history_ms` old, if it is
/// past what was compacted already.
pub fn revision_to_compact(
    samples: &VecDeque<(u64, i64)>,
    now_ms: u64,
    history_ms: u64,
    compacted: i64,
) -> Option<i64> {
    samples
        .iter()
        .filter(|(at_ms, _)| now_ms.saturating_sub(*at_ms) >= history_ms)
        .map(|&(_, revision)| revision)
        .max()
        .filter(|&revision| revision > compacted)
}

/// The member to defragment, if any: the one with the most free space among those whose free
/// space is at least `min_free_bytes` and [`DEFRAG_MIN_FREE_PERCENT`] of the file, followers
/// before the raft leader (the cluster keeps its leader while a follower pauses).
pub fn member_to_defragment(members: &[MemberStatus], min_free_bytes: u64) -> Option<usize> {
    members
        .iter()
        .enumerate()
        .filter(|(_, m)| {
            m.free_bytes() >= min_free_bytes
                && m.free_bytes().saturating_mul(100)
                    >= m.db_size_bytes.saturating_mul(DEFRAG_MIN_FREE_PERCENT)
        })
        .max_by_key(|(_, m)| (!m.is_leader, m.free_bytes()))
        .map(|(index, _)| index)
}

/// The housekeeper: the revisions it saw, and what it compacted.
#[derive(Debug)]
pub struct Housekeeping {
    settings: HousekeepingSettings,
    samples: VecDeque<(u64, i64)>,
    compacted: i64,
}

/// A client of `endpoint` alone: status and defragmentation speak of the member answering.
async fn member_client(endpoint: &str) -> Result<Client, KvError> {
    connect_client(&[endpoint]).await
}

impl Housekeeping {
    /// A housekeeper with `settings`, nothing seen yet.
    pub fn new(settings: HousekeepingSettings) -> Self {
        Self {
            settings,
            samples: VecDeque::new(),
            compacted: 0,
        }
    }

    /// One round at `now_ms`: statuses, compaction, at most one defragmentation. A member that
    /// does not answer is left out (and warned about); the round fails only when none answers.
    pub async fn round(&mut self, now_ms: u64) -> Result<RoundOutcome, KvError> {
        let mut outcome = RoundOutcome::default();
        let mut last_error = None;
        for endpoint in &self.settings.endpoints {
            match Self::status(endpoint).await {
                Ok(status) => outcome.members.push(status),
                Err(error) => {
                    tracing::warn!(%error, %endpoint, "etcd member status not read");
                    last_error = Some(error);
                }
            }
        }
        let Some(revision) = outcome.members.iter().map(|m| m.revision).max() else {
            return Err(
                last_error.unwrap_or_else(|| KvError::Unavailable("no etcd endpoints".into()))
            );
        };
        self.samples.push_back((now_ms, revision));
        while self.samples.len() > MAX_REVISION_SAMPLES {
            self.samples.pop_front();
        }
        if let Some(target) = revision_to_compact(
            &self.samples,
            now_ms,
            self.settings.history_ms,
            self.compacted,
        ) {
            let endpoint = &outcome.members[0].endpoint;
            let mut client = member_client(endpoint).await?;
            let compacted = within(
                None,
                client.compact(target, Some(CompactionOptions::new().with_physical())),
            )
            .await;
            match compacted {
                Ok(_) => outcome.compacted_to = Some(target),
                // etcd's own auto-compaction got there first: as good.
                Err(KvError::Unavailable(text)) if text.contains("compacted") => {}
                Err(error) => return Err(error),
            }
            self.compacted = target;
            // Only revisions newer than what was compacted can be compacted to later.
            self.samples.retain(|&(_, revision)| revision > target);
        }
        if self.settings.defragment
            && let Some(index) =
                member_to_defragment(&outcome.members, self.settings.defrag_min_free_bytes)
        {
            let endpoint = outcome.members[index].endpoint.clone();
            let mut client = member_client(&endpoint).await?;
            // A defragmentation of a large file takes longer than a call's usual deadline.
            match tokio::time::timeout(Duration::from_secs(60), client.defragment()).await {
                Ok(Ok(_)) => outcome.defragmented = Some(endpoint),
                Ok(Err(error)) => tracing::warn!(%error, %endpoint, "etcd defragmentation failed"),
                Err(_) => {
                    tracing::warn!(%endpoint, "etcd defragmentation still running after 60 s")
                }
            }
        }
        Ok(outcome)
    }

    async fn status(endpoint: &str) -> Result<MemberStatus, KvError> {
        let mut client = member_client(endpoint).await?;
        let status = within(None, client.status()).await?;
        let header = status.header();
        let member_id = header.map_or(0, |h| h.member_id());
        let to_u64 = |bytes: i64| u64::try_from(bytes).unwrap_or(0);
        Ok(MemberStatus {
            endpoint: endpoint.to_owned(),
            member_id,
            is_leader: member_id != 0 && status.leader() == member_id,
            db_size_bytes: to_u64(status.db_size()),
            db_in_use_bytes: to_u64(status.raft_used_db_size()),
            quota_bytes: match to_u64(status.db_size_quota()) {
                0 => DEFAULT_QUOTA_BYTES,
                quota => quota,
            },
            revision: header.map_or(0, |h| h.revision()),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn member(endpoint: &str, leader: bool, size_mib: u64, in_use_mib: u64) -> MemberStatus {
        MemberStatus {
            endpoint: endpoint.to_owned(),
            member_id: 1,
            is_leader: leader,
            db_size_bytes: size_mib << 20,
            db_in_use_bytes: in_use_mib << 20,
            quota_bytes: DEFAULT_QUOTA_BYTES,
            revision: 10,
        }
    }

    #[test]
    fn history_is_compacted_to_the_newest_revision_old_enough_and_never_backwards() {
        let samples: VecDeque<(u64, i64)> =
            [(0, 100), (300_000, 180), (600_000, 260), (900_000, 300)].into();
        assert_eq!(
            revision_to_compact(&samples, 900_000, 600_000, 0),
            Some(180)
        );
        assert_eq!(revision_to_compact(&samples, 900_000, 0, 0), Some(300));
        assert_eq!(
            revision_to_compact(&samples, 900_000, 600_000, 180),
            None,
            "done already"
        );
        assert_eq!(
            revision_to_compact(&samples, 100_000, 600_000, 0),
            None,
            "nothing old enough"
        );
    }

    #[test]
    fn the_most_fragmented_follower_is_defragmented_before_the_leader() {
        let members = [
            member("a", true, 900, 100),
            member("b", false, 700, 100),
            member("c", false, 800, 500),
        ];
        assert_eq!(
            member_to_defragment(&members, 64 << 20),
            Some(1),
            "b: 600 MiB free, 86 %"
        );
        // c is mostly in use, a leads: with b done, the leader's turn.
        let members = [
            member("a", true, 900, 100),
            member("b", false, 110, 100),
            members[2].clone(),
        ];
        assert_eq!(member_to_defragment(&members, 64 << 20), Some(0));
        // Too little free space to be worth a pause.
        assert_eq!(
            member_to_defragment(&[member("a", false, 100, 40)], 64 << 20),
            None
        );
    }
}
