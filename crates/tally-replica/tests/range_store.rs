//! `RangeStore`: the engine's store over a range group. Two stores over one group
//! stand for two writers of one shard (on two nodes, one a deposed leader): the
//! commit sequence lets only a writer that built on the stored state commit.

use std::sync::{Arc, Weak};
use std::time::Duration;
use tally_core::dedup::DedupRecord;
use tally_core::handoff_machine::seal_marker;
use tally_core::name::CounterName;
use tally_core::ranges::{RangeId, RangeLayout};
use tally_core::shard::{ShardImage, ShardWrite};
use tally_core::ShardId;
use tally_replica::{GroupsConfig, MemKv, MemRouter, RangeGroups, RangeInbound, RangeStore, ReplicaNode};
use tally_store::{MemStore, Store, StoreError};

async fn one_replica_group() -> (Arc<RangeGroups>, RangeId) {
    let layout = RangeLayout::try_new(1).unwrap();
    let router = MemRouter::new();
    let groups = RangeGroups::open(
        "node1",
        7,
        Arc::new(MemKv::new()),
        Arc::new(router.clone()),
        layout,
        GroupsConfig::default(),
    )
    .await
    .unwrap();
    let inbound: Arc<dyn RangeInbound> = groups.clone();
    router.register(groups.replica_id(), Arc::downgrade(&inbound) as Weak<dyn RangeInbound>);
    let range = RangeId(0);
    groups.open_range(range).await.unwrap();
    groups.initialize(range, &[(7, ReplicaNode { node: "node1".into() })]).await.unwrap();
    for _ in 0..500 {
        if groups.leads(range) {
            return (groups, range);
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    panic!("the group elected no leader");
}

fn write(value: i64, put: &[&str]) -> ShardWrite {
    ShardWrite {
        image: ShardImage { value, ..Default::default() },
        dedup_put: put
            .iter()
            .map(|id| (id.to_string(), DedupRecord { delta: 1, applied_at_ms: 1 }))
            .collect(),
        dedup_remove: Vec::new(),
    }
}

fn refused(r: &Result<(), StoreError>) -> bool {
    matches!(r, Err(StoreError::Unavailable { .. }))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_writer_that_missed_a_commit_is_refused_and_reloads() {
    let (groups, _) = one_replica_group().await;
    let handle = tokio::runtime::Handle::current();
    let shard = ShardId::new(CounterName::new("likes").unwrap(), 0, 3);
    let a = RangeStore::new(groups.clone(), Arc::new(MemStore::new()), handle.clone());
    let b = RangeStore::new(groups.clone(), Arc::new(MemStore::new()), handle.clone());
    let s = shard.clone();
    tokio::task::spawn_blocking(move || {
        // A commit from a writer that never opened the shard is refused.
        assert!(refused(&a.commit(&s, &write(1, &[]))));
        assert_eq!(a.open_shard(&s).unwrap().value, 0);
        assert_eq!(b.open_shard(&s).unwrap().value, 0);
        a.commit(&s, &write(5, &["e1"])).unwrap();
        // b built on the empty shard: its image would overwrite a's acknowledged 5.
        assert!(refused(&b.commit(&s, &write(3, &["e2"]))));
        assert_eq!(b.load_shard(&s).unwrap().value, 5);
        assert!(b.dedup_get(&s, "e2").unwrap().is_none());
        // Until it reloads, b stays refused; then it builds on 5.
        assert!(refused(&b.commit(&s, &write(8, &["e2"]))));
        assert_eq!(b.open_shard(&s).unwrap().value, 5);
        b.commit(&s, &write(8, &["e2"])).unwrap();
        // Now a is the stale one.
        assert!(refused(&a.commit(&s, &write(6, &[]))));
        assert_eq!(a.load_shard(&s).unwrap().value, 8);
        let ids: Vec<String> = a.dedup_scan(&s, None, 10).unwrap().into_iter().map(|(id, _)| id).collect();
        assert_eq!(ids, ["e1", "e2"]);
        assert_eq!(a.dedup_scan(&s, Some("e1"), 10).unwrap().len(), 1);
    })
    .await
    .unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn seals_and_deletions_are_replicated_and_other_metadata_stays_local() {
    let (groups, _) = one_replica_group().await;
    let handle = tokio::runtime::Handle::current();
    let shard = ShardId::new(CounterName::new("views").unwrap(), 1, 0);
    let local = Arc::new(MemStore::new());
    let store = RangeStore::new(groups.clone(), local.clone(), handle);
    let s = shard.clone();
    tokio::task::spawn_blocking(move || {
        store.open_shard(&s).unwrap();
        store.commit(&s, &write(4, &["e1", "e2"])).unwrap();
        assert_eq!(store.meta_get(&seal_marker(&s)).unwrap(), None);
        store.meta_put(&seal_marker(&s), b"").unwrap();
        assert_eq!(store.meta_get(&seal_marker(&s)).unwrap(), Some(Vec::new()));
        assert_eq!(store.load_shard(&s).unwrap().value, 4, "a seal keeps the image");
        // The writer built on the state the seal was built on, so it goes on.
        store.commit(&s, &write(4, &["e3"])).unwrap();
        // Other metadata goes to the local store.
        store.meta_put(b"counter:views", b"spec").unwrap();
        assert_eq!(local.meta_get(b"counter:views").unwrap(), Some(b"spec".to_vec()));
        assert_eq!(local.meta_get(&seal_marker(&s)).unwrap(), None);
        assert_eq!(store.shard_ids(None, 10).unwrap(), std::slice::from_ref(&s));
        store.delete_shard(&s).unwrap();
        store.meta_delete(&seal_marker(&s)).unwrap();
        assert_eq!(store.load_shard(&s).unwrap(), ShardImage::default());
        assert!(store.dedup_scan(&s, None, 10).unwrap().is_empty(), "a deletion clears every record");
        assert_eq!(store.meta_get(&seal_marker(&s)).unwrap(), None);
        // A writer of the deleted shard must reload before it commits again.
        assert!(refused(&store.commit(&s, &write(1, &[]))));
    })
    .await
    .unwrap();
}

/// A writer seals with the image it holds, which goes into the next generation's
/// base: a seal by a writer that missed another's commit must be refused (it
/// would seal the newer image in the group and count the older one).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_seal_by_a_writer_that_missed_a_commit_is_refused() {
    let (groups, _) = one_replica_group().await;
    let handle = tokio::runtime::Handle::current();
    let shard = ShardId::new(CounterName::new("likes").unwrap(), 0, 2);
    let stale = RangeStore::new(groups.clone(), Arc::new(MemStore::new()), handle.clone());
    let current = RangeStore::new(groups.clone(), Arc::new(MemStore::new()), handle.clone());
    let s = shard.clone();
    tokio::task::spawn_blocking(move || {
        assert_eq!(stale.open_shard(&s).unwrap().value, 0);
        assert_eq!(current.open_shard(&s).unwrap().value, 0);
        current.commit(&s, &write(2, &["e1"])).unwrap();
        assert!(refused(&stale.meta_put(&seal_marker(&s), b"")), "the stale writer's seal is refused");
        assert_eq!(stale.meta_get(&seal_marker(&s)).unwrap(), None);
        // Reloaded, it seals what is stored.
        assert_eq!(stale.open_shard(&s).unwrap().value, 2);
        stale.meta_put(&seal_marker(&s), b"").unwrap();
        assert_eq!(stale.meta_get(&seal_marker(&s)).unwrap(), Some(Vec::new()));
    })
    .await
    .unwrap();
}

/// A write of `records` new records with 200-byte ids: about 215 bytes each.
fn big_write(value: i64, records: usize) -> ShardWrite {
    let ids: Vec<String> = (0..records).map(|r| format!("{value:04}-{r:06}-{}", "x".repeat(189))).collect();
    let refs: Vec<&str> = ids.iter().map(String::as_str).collect();
    write(value, &refs)
}

/// A commit cycle whose writes to one range add up to more than one entry may
/// carry (twelve shards of 4,000 new records, about 10 MB) is cut into entries
/// that each fit in a message between nodes, and every write is answered Ok; a
/// group refuses, as too large, one entry of them all.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_commit_cycle_larger_than_an_entry_is_cut_into_entries_that_fit() {
    let (groups, range) = one_replica_group().await;
    let store = RangeStore::new(groups.clone(), Arc::new(MemStore::new()), tokio::runtime::Handle::current());
    let shards: Vec<ShardId> =
        (0..12).map(|i| ShardId::new(CounterName::new("big").unwrap(), 0, i)).collect();
    let writes: Vec<(ShardId, ShardWrite)> =
        shards.iter().map(|s| (s.clone(), big_write(1, 4_000))).collect();
    let before = groups.status(range).unwrap().last_log_index.unwrap_or(0);
    let store = Arc::new(store);
    let (s, w) = (store.clone(), writes.clone());
    let results = tokio::task::spawn_blocking(move || {
        for (id, _) in &w {
            s.open_shard(id).unwrap();
        }
        s.commit_many(&w)
    })
    .await
    .unwrap();
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let entries = groups.status(range).unwrap().last_log_index.unwrap_or(0) - before;
    assert!(entries >= 2, "one cycle, {entries} entries");
    assert!(store.dedup_get(&shards[11], &writes[11].1.dedup_put[3999].0).unwrap().is_some());

    let images: Vec<tally_replica::ShardEntry> = writes
        .iter()
        .map(|(id, w)| tally_replica::ShardEntry {
            shard: id.clone(),
            seq: 9,
            write: w.clone(),
            sealed: false,
            clear: false,
        })
        .collect();
    match groups.write(range, images).await {
        Err(tally_replica::ReplicaError::TooLarge { bytes, bytes_max, .. }) => assert!(bytes > bytes_max),
        other => panic!("an entry too large answered {other:?}"),
    }
}

/// A dedup sweep page can hold up to `dedup_sweep_records_max` (10,000 by default)
/// expired ids, written as one image. A shard with 5,000 expired ids in one page
/// sweeps them in one commit, and the other writes of its cycle, in the same
/// range, are applied beside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_page_of_more_than_4096_expired_ids_commits_beside_other_writes() {
    let (groups, _) = one_replica_group().await;
    let store =
        Arc::new(RangeStore::new(groups, Arc::new(MemStore::new()), tokio::runtime::Handle::current()));
    let (a, b) = (
        ShardId::new(CounterName::new("swept").unwrap(), 0, 0),
        ShardId::new(CounterName::new("other").unwrap(), 0, 0),
    );
    let s = store.clone();
    tokio::task::spawn_blocking(move || {
        s.open_shard(&a).unwrap();
        s.open_shard(&b).unwrap();
        let ids: Vec<String> = (0..5_000).map(|i| format!("old-{i:05}")).collect();
        for (n, half) in ids.chunks(2_500).enumerate() {
            let refs: Vec<&str> = half.iter().map(String::as_str).collect();
            s.commit(&a, &write(n as i64 + 1, &refs)).unwrap();
        }
        assert_eq!(s.dedup_scan(&a, None, usize::MAX).unwrap().len(), 5_000);
        let sweep = ShardWrite {
            image: ShardImage { value: 2, ..Default::default() },
            dedup_put: vec![],
            dedup_remove: ids,
        };
        let results = s.commit_many(&[(a.clone(), sweep), (b.clone(), write(7, &["b-1"]))]);
        assert!(results.iter().all(Result::is_ok), "{results:?}");
        assert!(s.dedup_scan(&a, None, usize::MAX).unwrap().is_empty(), "every expired id swept");
        assert_eq!(s.load_shard(&b).unwrap().value, 7);
        assert!(s.dedup_get(&b, "b-1").unwrap().is_some());
    })
    .await
    .unwrap();
}
