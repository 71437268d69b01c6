//! The leader's etcd upkeep: every [`HOUSEKEEPING_INTERVAL`] the leading allocator keeps house in
//! etcd ([`Housekeeping`]: compaction, defragmentation) and publishes each member's database
//! size, the part in use and its quota, so an alert fires well before etcd fills.

use std::sync::Arc;

use tokio::sync::watch;

use crate::clock::Clock;
use crate::kv::housekeeping::{HOUSEKEEPING_INTERVAL, Housekeeping, HousekeepingSettings};
use crate::leader::Roles;

/// Keeps house while this node leads, until `shutdown`.
pub async fn keep_etcd(
    settings: HousekeepingSettings,
    clock: Arc<dyn Clock>,
    role: watch::Receiver<Roles>,
    shutdown: impl Future<Output = ()>,
) {
    tokio::pin!(shutdown);
    let mut housekeeping = Housekeeping::new(settings);
    let mut every = tokio::time::interval(HOUSEKEEPING_INTERVAL);
    loop {
        tokio::select! {
            () = &mut shutdown => return,
            _ = every.tick() => {
                if role.borrow().coordinating().is_none() {
                    continue;
                }
                match housekeeping.round(clock.now_ms()).await {
                    Ok(outcome) => {
                        for member in &outcome.members {
                            let id = format!("{:x}", member.member_id);
                            metrics::gauge!(crate::metrics::ETCD_DB_SIZE, "member" => id.clone())
                                .set(member.db_size_bytes as f64);
                            metrics::gauge!(crate::metrics::ETCD_DB_IN_USE, "member" => id.clone())
                                .set(member.db_in_use_bytes as f64);
                            metrics::gauge!(crate::metrics::ETCD_DB_QUOTA, "member" => id)
                                .set(member.quota_bytes as f64);
                        }
                        if let Some(revision) = outcome.compacted_to {
                            tracing::info!(revision, "etcd history compacted");
                            metrics::counter!(crate::metrics::ETCD_COMPACTIONS).increment(1);
                        }
                        if let Some(endpoint) = outcome.defragmented {
                            tracing::info!(%endpoint, "etcd member defragmented");
                            metrics::counter!(crate::metrics::ETCD_DEFRAGMENTATIONS).increment(1);
                        }
                    }
                    Err(error) => {
                        tracing::warn!(%error, "etcd housekeeping round failed; the next one retries");
                        metrics::counter!(crate::metrics::ETCD_HOUSEKEEPING_FAILURES).increment(1);
                    }
                }
            }
        }
    }
}
