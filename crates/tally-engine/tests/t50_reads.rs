//! t50: reads state how fresh they are (invariants 4 and 5): a cached total is never
//! older than `rollup_ms` plus one refresh, and a fresh total includes every
//! acknowledged increment.

mod common;

use common::*;
use std::time::Duration;
use tally_engine::{Consistency, Durability, Increment, SpecPatch};

/// On paused time, so the bound is the engine's and not the machine's load: the
/// rollup's timers fire when due, and a refresh takes no time.
#[tokio::test(start_paused = true)]
async fn a_cached_read_is_never_staler_than_its_rollup_interval() {
    let (tally, _) = paused_engine(1_700_000_000_000).await;
    let patch = SpecPatch { rollup_ms: Some(100), flush_ms: Some(20), ..spec(16, Durability::Batched) };
    tally.put_counter("c", patch).await.unwrap();
    let slack_ms = 20; // the rollup's own tick, which may fall just after an interval ends
    let mut last = 0;
    for round in 0..40 {
        for _ in 0..10 {
            tally.incr("c", Increment::new(1)).await.unwrap();
        }
        let r = tally.read("c", Consistency::Cached).await.unwrap();
        assert_eq!(r.consistency, Consistency::Cached);
        assert!(r.complete && r.missing_shards.is_empty());
        assert!(r.staleness_ms <= 100 + slack_ms, "round {round}: staleness {}", r.staleness_ms);
        assert!(r.value >= last, "a cached total went backwards");
        last = r.value;
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
    // Once writes stop, the cache catches up within one interval (plus the flush window).
    tokio::time::sleep(Duration::from_millis(250)).await;
    assert_eq!(tally.read("c", Consistency::Cached).await.unwrap().value, 400);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_large_change_refreshes_the_cache_early() {
    let (tally, _) = mem_engine().await;
    let patch = SpecPatch { rollup_ms: Some(60_000), ..spec(4, Durability::Sync) };
    tally.put_counter("c", patch).await.unwrap();
    assert_eq!(tally.read("c", Consistency::Cached).await.unwrap().value, 0);
    tally.incr("c", Increment::new(5_000).event_id("big")).await.unwrap();
    let mut value = 0;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(10)).await;
        value = tally.read("c", Consistency::Cached).await.unwrap().value;
        if value == 5_000 {
            break;
        }
    }
    assert_eq!(value, 5_000, "a change past the threshold must refresh before rollup_ms");
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn without_a_rollup_a_cached_read_is_fresh() {
    let (tally, _) = mem_engine().await;
    let patch = SpecPatch { rollup_ms: Some(0), ..spec(4, Durability::Batched) };
    tally.put_counter("c", patch).await.unwrap();
    tally.incr("c", Increment::new(3)).await.unwrap();
    let r = tally.read("c", Consistency::Cached).await.unwrap();
    assert_eq!((r.value, r.consistency, r.staleness_ms), (3, Consistency::Fresh, 0));
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_read_includes_this_nodes_buffered_increments() {
    let (tally, _) = mem_engine().await;
    let patch = SpecPatch { flush_ms: Some(60_000), ..spec(8, Durability::Batched) };
    tally.put_counter("c", patch).await.unwrap();
    for _ in 0..123 {
        tally.incr("c", Increment::new(1)).await.unwrap();
    }
    let r = tally.read("c", Consistency::Fresh).await.unwrap();
    assert_eq!((r.value, r.consistency, r.staleness_ms, r.complete), (123, Consistency::Fresh, 0, true));
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_shard_report_sums_to_the_total_and_measures_skew() {
    let (tally, _) = mem_engine().await;
    let patch =
        SpecPatch { router: Some(tally_engine::RouterPolicy::RoundRobin), ..spec(4, Durability::Batched) };
    tally.put_counter("even", patch).await.unwrap();
    for _ in 0..400 {
        tally.incr("even", Increment::new(1)).await.unwrap();
    }
    let r = tally.shards("even").await.unwrap();
    assert_eq!(r.shards.iter().map(|s| i128::from(s.value)).sum::<i128>(), 400);
    assert!((r.skew - 1.0).abs() < 0.05, "round robin should be even: {}", r.skew);
    tally.put_counter("hot", spec(4, Durability::Batched)).await.unwrap();
    for _ in 0..400 {
        tally.incr("hot", Increment::new(1).writer("the-one-writer")).await.unwrap();
    }
    let r = tally.shards("hot").await.unwrap();
    assert!((r.skew - 4.0).abs() < 1e-9, "one writer on one of 4 shards: skew {}", r.skew);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_read_waits_for_drains_already_under_way() {
    // With a 1 ms window the aggregator drains all the time; a fresh read right
    // after the writers stop must still include everything they were told counted.
    let (tally, _) = mem_engine().await;
    let patch = SpecPatch { flush_ms: Some(1), ..spec(8, Durability::Batched) };
    tally.put_counter("c", patch).await.unwrap();
    let mut expected = 0u64;
    for _ in 0..5 {
        let mut writers = Vec::new();
        for _ in 0..4 {
            let t = tally.clone();
            writers.push(tokio::spawn(async move {
                let started = std::time::Instant::now();
                let mut n = 0u64;
                while started.elapsed() < Duration::from_millis(100) {
                    t.incr("c", Increment::new(1)).await.unwrap();
                    n += 1;
                }
                n
            }));
        }
        for w in writers {
            expected += w.await.unwrap();
        }
        let value = tally.read("c", Consistency::Fresh).await.unwrap().value;
        assert_eq!(value, i128::from(expected));
    }
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_counters_cached_total_is_never_answered_again() {
    let (tally, _) = mem_engine().await;
    for round in 0..20 {
        let name = format!("c{round}");
        let patch = SpecPatch { rollup_ms: Some(60_000), ..spec(4, Durability::Batched) };
        tally.put_counter(&name, patch).await.unwrap();
        tally.incr(&name, Increment::new(5)).await.unwrap();
        assert_eq!(tally.read(&name, Consistency::Cached).await.unwrap().value, 5, "round {round}");
        tally.delete_counter(&name).await.unwrap();
        // Created anew by its first increment: its total starts from zero.
        tally.incr(&name, Increment::new(1)).await.unwrap();
        let r = tally.read(&name, Consistency::Cached).await.unwrap();
        assert_eq!(r.value, 1, "round {round}: the deleted counter's total was answered: {r:?}");
    }
    tally.shutdown().await.unwrap();
}

/// A wall clock on paused time that can be stepped, as NTP or an operator steps a
/// machine's clock.
#[derive(Clone)]
struct SteppedClock {
    start: tokio::time::Instant,
    start_ms: u64,
    offset_ms: std::sync::Arc<std::sync::atomic::AtomicI64>,
}

impl tally_engine::Clock for SteppedClock {
    fn now_ms(&self) -> u64 {
        let now = self.start_ms + self.start.elapsed().as_millis() as u64;
        now.saturating_add_signed(self.offset_ms.load(std::sync::atomic::Ordering::SeqCst))
    }
}

#[tokio::test(start_paused = true)]
async fn a_clock_stepped_back_does_not_freeze_cached_totals() {
    let clock = SteppedClock {
        start: tokio::time::Instant::now(),
        start_ms: 1_700_000_000_000,
        offset_ms: Default::default(),
    };
    let store = std::sync::Arc::new(tally_engine::MemStore::new());
    let tally = tally_engine::Tally::open_with(store, std::sync::Arc::new(clock.clone()), quick_config())
        .await
        .unwrap();
    let patch = SpecPatch { rollup_ms: Some(100), ..spec(4, Durability::Sync) };
    tally.put_counter("c", patch).await.unwrap();
    tally.incr("c", Increment::new(5)).await.unwrap();
    assert_eq!(tally.read("c", Consistency::Cached).await.unwrap().value, 5);
    tokio::time::sleep(Duration::from_millis(300)).await;
    // The clock steps back two minutes; the next increment must reach the cached
    // total within a few rollup intervals, not once the clock is back where it was.
    clock.offset_ms.store(-120_000, std::sync::atomic::Ordering::SeqCst);
    tally.incr("c", Increment::new(3)).await.unwrap();
    tokio::time::sleep(Duration::from_millis(500)).await;
    let r = tally.read("c", Consistency::Cached).await.unwrap();
    assert_eq!((r.value, r.complete), (8, true), "{r:?}");
    tally.shutdown().await.unwrap();
}
