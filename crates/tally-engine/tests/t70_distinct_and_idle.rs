//! t70: distinct estimates stay within the sketch's stated error whatever the shard
//! count (invariant 7), and idle counters cost no running actors: shards stop and
//! accumulators are dropped, while their values stay in the store.

mod common;

use common::*;
use std::sync::Arc;
use std::time::Duration;
use tally_engine::{
    Consistency, Durability, Increment, MemStore, SpecPatch, SystemClock, Tally, TallyConfig,
};

/// Stored bytes of one full sketch: the 12 KiB of packed registers and its framing.
const FULL_SKETCH_BYTES: u64 = 12_320;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_distinct_counter_of_64_shards_costs_about_one_sketch() {
    let (tally, _) = mem_engine().await;
    let members = 100_000u32;
    for (shards, d) in [(1u16, Durability::Batched), (64, Durability::Batched), (64, Durability::Sync)] {
        let name = format!("bytes-{shards}-{d}");
        let patch = SpecPatch { distinct: Some(true), ..spec(shards, d) };
        tally.put_counter(&name, patch).await.unwrap();
        let items: Vec<_> = (0..members)
            .map(|i| {
                (name.clone(), Increment::new(1).member(format!("user-{i}")).writer(format!("w{}", i % 7)))
            })
            .collect();
        for chunk in items.chunks(5_000) {
            for r in tally.incr_many(chunk.to_vec()).await.unwrap() {
                r.unwrap();
            }
        }
        let read = tally.distinct(&name).await.unwrap();
        assert!(read.complete, "{name}: {read:?}");
        assert!(read.sketch_bytes <= FULL_SKETCH_BYTES, "{name}: {read:?}");
        // Each shard holds only its slice of the registers: the counter costs about
        // one sketch (each shard's framing on top), not one per shard.
        let framing = 20 * u64::from(shards);
        assert!(read.counter_bytes <= FULL_SKETCH_BYTES + framing, "{name}: {read:?}");
        let err = (read.estimate as f64 - f64::from(members)).abs() / f64::from(members);
        assert!(err <= 3.0 * read.relative_error, "{name}: {read:?}");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn distinct_estimates_stay_within_the_stated_error_for_1_8_and_64_shards() {
    let (tally, _) = mem_engine().await;
    let members = 20_000;
    for shards in [1u16, 8, 64] {
        for d in [Durability::Batched, Durability::Sync] {
            let name = format!("u-{shards}-{d}");
            let patch = SpecPatch { distinct: Some(true), ..spec(shards, d) };
            tally.put_counter(&name, patch).await.unwrap();
            let mut items = Vec::new();
            for i in 0..members {
                // Every member twice, from different writers: duplicates must not count.
                for copy in 0..2 {
                    let inc =
                        Increment::new(1).member(format!("user-{i}")).writer(format!("w{}", (i + copy) % 97));
                    items.push((name.clone(), inc));
                }
            }
            for chunk in items.chunks(5_000) {
                for r in tally.incr_many(chunk.to_vec()).await.unwrap() {
                    r.unwrap();
                }
            }
            let est = tally.distinct(&name).await.unwrap();
            let err = (est.estimate as f64 - f64::from(members)).abs() / f64::from(members);
            assert!(err <= 3.0 * est.relative_error, "{name}: estimate {} error {err:.4}", est.estimate);
            assert_eq!(tally.read(&name, Consistency::Fresh).await.unwrap().value, 2 * i128::from(members));
        }
    }
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn idle_counters_stop_their_actors_and_keep_their_values() {
    let config = TallyConfig { shard_idle_stop_ms: 300, counter_idle_evict_ms: 300, ..quick_config() };
    let store = MemStore::new();
    let tally = Tally::open_with(Arc::new(store.clone()), Arc::new(SystemClock), config).await.unwrap();
    for i in 0..200 {
        let d = if i % 2 == 0 { Durability::Sync } else { Durability::Batched };
        let patch = SpecPatch { flush_ms: Some(20), ..spec(4, d) };
        tally.put_counter(&format!("c{i}"), patch).await.unwrap();
        tally.incr(&format!("c{i}"), Increment::new(i + 1).event_id("e")).await.unwrap();
    }
    let (counters, shards) = tally.active();
    assert!(counters >= 200 && shards >= 200, "({counters}, {shards})");
    let mut active = (counters, shards);
    for _ in 0..60 {
        tokio::time::sleep(Duration::from_millis(100)).await;
        active = tally.active();
        if active == (0, 0) {
            break;
        }
    }
    assert_eq!(active, (0, 0), "idle counters still hold memory or actors");
    assert!(tally.stats().shard_retirements.get() >= 200);
    for i in 0..200 {
        let v = tally.read(&format!("c{i}"), Consistency::Fresh).await.unwrap().value;
        assert_eq!(v, i128::from(i + 1));
        // The dedup memory is in the store, not in the stopped actor.
        assert!(tally.incr(&format!("c{i}"), Increment::new(i + 1).event_id("e")).await.unwrap().duplicate);
    }
    tally.shutdown().await.unwrap();
}
