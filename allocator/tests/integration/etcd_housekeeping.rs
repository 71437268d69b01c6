//! The leader's etcd housekeeping against a real etcd: history compacted to the revision seen a
//! history ago, and a member whose file is mostly free space defragmented, so the file shrinks
//! back to what is in use.

use allot_allocator::kv::housekeeping::{Housekeeping, HousekeepingSettings};
use allot_testkit::EtcdCluster;

#[tokio::test]
async fn compaction_and_defragmentation_shrink_a_rewritten_store() {
    let etcd = EtcdCluster::single();
    let endpoints = etcd.endpoints();
    let mut client = etcd_client::Client::connect(&endpoints, None)
        .await
        .expect("connect");
    // One key rewritten 3,000 times with 8 KiB: each version stays in etcd's history.
    let value = vec![b'x'; 8 * 1024];
    let first = client
        .put("window", value.clone(), None)
        .await
        .expect("put");
    let first_revision = first.header().expect("header").revision();
    for _ in 0..3_000 {
        client
            .put("window", value.clone(), None)
            .await
            .expect("put");
    }
    let mut housekeeping = Housekeeping::new(HousekeepingSettings {
        history_ms: 60_000,
        defrag_min_free_bytes: 1024 * 1024,
        ..HousekeepingSettings::new(endpoints.clone())
    });
    // The first round only sees the revision: nothing is a minute old yet.
    let seen = housekeeping.round(1_000_000).await.expect("a round");
    let [member] = seen.members.as_slice() else {
        panic!("one member: {seen:?}");
    };
    let (size_before, revision) = (member.db_size_bytes, member.revision);
    assert!(
        size_before > 16 * 1024 * 1024,
        "3,000 versions of 8 KiB: {size_before}"
    );
    assert_eq!(seen.compacted_to, None, "nothing is older than the history");
    assert_eq!(
        seen.defragmented, None,
        "nothing is free before a compaction"
    );
    // A minute later: compacted to what the first round saw.
    let compacted = housekeeping.round(1_060_000).await.expect("a round");
    assert_eq!(compacted.compacted_to, Some(revision));
    let old = client
        .get(
            "window",
            Some(etcd_client::GetOptions::new().with_revision(first_revision)),
        )
        .await;
    assert!(
        old.is_err_and(|e| e.to_string().contains("compacted")),
        "an old revision is gone"
    );
    // The next round sees the file mostly free and defragments it.
    let defragmented = housekeeping.round(1_120_000).await.expect("a round");
    assert_eq!(
        defragmented.defragmented.as_deref(),
        Some(endpoints[0].as_str())
    );
    let after = housekeeping.round(1_180_000).await.expect("a round");
    let size_after = after.members[0].db_size_bytes;
    eprintln!("etcd file: {size_before} bytes before compaction, {size_after} after defragmenting");
    assert!(
        size_after * 4 < size_before,
        "the file shrank to what is in use: {size_before} -> {size_after}"
    );
    assert_eq!(after.defragmented, None, "once is enough");
    // The current value is intact.
    let now = client.get("window", None).await.expect("get");
    assert_eq!(now.kvs()[0].value(), value.as_slice());
}
