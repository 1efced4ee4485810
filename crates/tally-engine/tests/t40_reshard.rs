//! t40: changing `shards` on a live counter loses and doubles nothing, dedup included
//! (invariant 2, resharding clause), and distinct counts carry over.

mod common;

use common::*;
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering::*};
use std::sync::Arc;
use tally_engine::{Consistency, Durability, Increment, SpecPatch};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resharding_under_load_loses_and_doubles_nothing() {
    let (tally, _) = mem_engine().await;
    for d in [Durability::Batched, Durability::Sync] {
        let name = format!("hot-{d}");
        tally.put_counter(&name, spec(8, d)).await.unwrap();
        let stop = Arc::new(AtomicBool::new(false));
        let acked = Arc::new(AtomicI64::new(0));
        let mut writers = Vec::new();
        for w in 0..8 {
            let (t, stop, acked, name) = (tally.clone(), stop.clone(), acked.clone(), name.clone());
            writers.push(tokio::spawn(async move {
                let mut i = 0;
                while !stop.load(SeqCst) {
                    // Half anonymous, half with event ids that are each sent twice.
                    let inc = if i % 2 == 0 {
                        Increment::new(1).writer(format!("w{w}"))
                    } else {
                        Increment::new(1).event_id(format!("{w}-{i}"))
                    };
                    let o = t.incr(&name, inc.clone()).await.unwrap();
                    if o.applied {
                        acked.fetch_add(1, SeqCst);
                    }
                    if inc.event_id.is_some() {
                        assert!(t.incr(&name, inc).await.unwrap().duplicate);
                    }
                    i += 1;
                }
            }));
        }
        for shards in [64u16, 3, 17] {
            tokio::time::sleep(std::time::Duration::from_millis(50)).await;
            tally.put_counter(&name, SpecPatch { shards: Some(shards), ..Default::default() }).await.unwrap();
            tally.settle().await;
            let info = tally.counter(&name).await.unwrap();
            assert_eq!((info.layout_shards, info.resharding), (shards, None));
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        stop.store(true, SeqCst);
        for w in writers {
            w.await.unwrap();
        }
        let read = tally.read(&name, Consistency::Fresh).await.unwrap();
        assert_eq!(read.value, i128::from(acked.load(SeqCst)), "{name}");
        assert!(acked.load(SeqCst) > 100, "the writers barely ran");
        let report = tally.shards(&name).await.unwrap();
        assert_eq!((report.generation, report.shards.len()), (3, 17));
        let sum: i128 = report.base + report.shards.iter().map(|s| i128::from(s.value)).sum::<i128>();
        assert_eq!(sum, read.value);
    }
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn event_ids_from_before_a_resharding_stay_deduplicated() {
    let (tally, _) = mem_engine().await;
    tally.put_counter("c", spec(4, Durability::Sync)).await.unwrap();
    for i in 0..200 {
        tally.incr("c", Increment::new(1).event_id(format!("e{i}"))).await.unwrap();
    }
    for shards in [32u16, 5] {
        tally.put_counter("c", SpecPatch { shards: Some(shards), ..Default::default() }).await.unwrap();
        tally.settle().await;
        for i in 0..200 {
            let o = tally.incr("c", Increment::new(1).event_id(format!("e{i}"))).await.unwrap();
            assert!(o.duplicate, "e{i} counted twice after resharding to {shards}");
        }
    }
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, 200);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distinct_members_carry_over_a_resharding() {
    let (tally, _) = mem_engine().await;
    let patch = SpecPatch { distinct: Some(true), ..spec(8, Durability::Batched) };
    tally.put_counter("u", patch).await.unwrap();
    for i in 0..3_000 {
        tally.incr("u", Increment::new(1).member(format!("user-{i}"))).await.unwrap();
    }
    let before = tally.distinct("u").await.unwrap().estimate;
    tally.put_counter("u", SpecPatch { shards: Some(2), ..Default::default() }).await.unwrap();
    tally.settle().await;
    for i in 0..3_000 {
        tally.incr("u", Increment::new(1).member(format!("user-{i}"))).await.unwrap();
    }
    let after = tally.distinct("u").await.unwrap();
    assert_eq!(after.estimate, before, "the same members must not count again");
    let err = (after.estimate as f64 - 3_000.0).abs() / 3_000.0;
    assert!(err < 3.0 * after.relative_error, "estimate {} for 3000", after.estimate);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_interrupted_resharding_completes_after_a_restart() {
    let (tally, store) = mem_engine().await;
    tally.put_counter("c", spec(4, Durability::Sync)).await.unwrap();
    for i in 0..100 {
        tally.incr("c", Increment::new(1).event_id(format!("e{i}"))).await.unwrap();
    }
    // Record the resharding intent, then crash before the task can finish it.
    store.fail_next_commits(u64::MAX);
    let _ = tally.put_counter("c", SpecPatch { shards: Some(9), ..Default::default() }).await;
    tally.abort();
    let store = store.restart(usize::MAX);
    let tally = reopen(&store).await;
    tally.settle().await;
    let info = tally.counter("c").await.unwrap();
    if info.resharding.is_none() && info.layout_shards == 4 {
        // The intent itself did not become durable: resharding again is the client's retry.
        tally.put_counter("c", SpecPatch { shards: Some(9), ..Default::default() }).await.unwrap();
        tally.settle().await;
    }
    let info = tally.counter("c").await.unwrap();
    assert_eq!((info.layout_shards, info.resharding), (9, None));
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, 100);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sealed_generations_leave_once_their_window_has_passed() {
    let (tally, store, clock) = manual_engine(1_000_000).await;
    let patch = SpecPatch { dedup_window_s: Some(60), ..spec(1, Durability::Sync) };
    tally.put_counter("c", patch).await.unwrap();
    tally.incr("c", Increment::new(1).event_id("first")).await.unwrap();
    // Reshard as often as the limit of sealed generations allows.
    let mut shards = 1;
    for _ in 0..tally_core::meta::SEALED_GENERATIONS_MAX {
        shards = 3 - shards;
        tally.put_counter("c", SpecPatch { shards: Some(shards), ..Default::default() }).await.unwrap();
        tally.settle().await;
    }
    let once_more = SpecPatch { shards: Some(3 - shards), ..Default::default() };
    let err = tally.put_counter("c", once_more).await.unwrap_err();
    assert_eq!(err.http_status(), 409, "{err}");
    // Inside the window a retry across every resharding is still a duplicate.
    assert!(tally.incr("c", Increment::new(1).event_id("first")).await.unwrap().duplicate);
    // Once every record in them has expired (the drain ids' window is the longer
    // one here), the sealed generations go, and so does their data.
    clock.advance(tally_core::shard::DRAIN_DEDUP_WINDOW_MS + 1_000);
    tally.put_counter("c", once_more).await.unwrap();
    tally.settle().await;
    assert_eq!(
        tally.counter("c").await.unwrap().generation as usize,
        tally_core::meta::SEALED_GENERATIONS_MAX + 1
    );
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, 1);
    let mut generations: Vec<u32> = Vec::new();
    for id in tally_engine::Store::shard_ids(&store, None, 1_000).unwrap() {
        generations.push(id.generation);
    }
    generations.dedup();
    let current = tally.counter("c").await.unwrap().generation;
    for _ in 0..100 {
        if generations.iter().all(|g| *g + 1 >= current) {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        generations = tally_engine::Store::shard_ids(&store, None, 1_000)
            .unwrap()
            .iter()
            .map(|i| i.generation)
            .collect();
        generations.dedup();
    }
    assert!(generations.iter().all(|g| *g + 1 >= current), "pruned generations left data: {generations:?}");
    tally.shutdown().await.unwrap();
}

/// A counter that states its own replica count keeps its shards in that class
/// through a resharding and a deletion: on a node that keeps one copy of each shard,
/// only a count of 1 is accepted, and its shards are stored apart from those of a
/// counter that takes the cluster's.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counter_with_its_own_replica_count_keeps_its_class_through_a_resharding_and_a_deletion() {
    use tally_engine::{Store, TallyError};
    let (tally, store) = mem_engine().await;
    let three = SpecPatch { replicas: Some(3), ..spec(4, Durability::Sync) };
    match tally.put_counter("c", three).await {
        Err(e @ TallyError::InvalidSpec(_)) => assert!(e.to_string().contains("replicas 3"), "{e}"),
        other => panic!("a second copy on a node without replication: {other:?}"),
    }
    let six = SpecPatch { replicas: Some(6), ..spec(4, Durability::Sync) };
    let refused = tally.put_counter("c", six).await.unwrap_err();
    assert_eq!(refused.http_status(), 422, "{refused}");
    let one = SpecPatch { replicas: Some(1), ..spec(4, Durability::Sync) };
    assert_eq!(tally.put_counter("c", one).await.unwrap().counter.spec.replicas, Some(1));
    tally.put_counter("plain", spec(4, Durability::Sync)).await.unwrap();
    for i in 0..100 {
        tally.incr("c", Increment::new(1).event_id(format!("e{i}"))).await.unwrap();
        tally.incr("plain", Increment::new(1).event_id(format!("e{i}"))).await.unwrap();
    }
    let other = SpecPatch { replicas: Some(2), ..Default::default() };
    let refused = tally.put_counter("c", other).await.unwrap_err();
    assert_eq!(refused.http_status(), 422, "{refused}");
    let same = SpecPatch { replicas: Some(1), ..Default::default() };
    assert_eq!(
        tally.put_counter("c", same).await.unwrap().counter.spec.replicas,
        Some(1),
        "naming it is fine"
    );
    tally.put_counter("c", SpecPatch { shards: Some(8), ..Default::default() }).await.unwrap();
    tally.settle().await;
    for i in 0..100 {
        let o = tally.incr("c", Increment::new(1).event_id(format!("e{i}"))).await.unwrap();
        assert!(o.duplicate, "e{i} counted twice after the resharding");
    }
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, 100);
    let classes = |name: &str| -> Vec<u8> {
        let ids = store.shard_ids(None, 10_000).unwrap();
        ids.into_iter().filter(|id| id.counter.as_str() == name).map(|id| id.replicas).collect()
    };
    let (c, plain) = (classes("c"), classes("plain"));
    assert!(c.len() >= 4, "the sealed generation's shards are stored: {c:?}");
    assert!(c.iter().all(|r| *r == 1), "{c:?}");
    assert!(!plain.is_empty() && plain.iter().all(|r| *r == 0), "{plain:?}");
    // Deleted, its shards of both generations go, found by the tombstone's words.
    tally.delete_counter("c").await.unwrap();
    tally.put_counter("c", spec(2, Durability::Sync)).await.unwrap();
    assert!(classes("c").iter().all(|r| *r == 0), "{:?}", classes("c"));
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, 0);
    tally.shutdown().await.unwrap();
}
