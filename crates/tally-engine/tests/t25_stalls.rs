//! t25: a disk that stalls and a clock that moves while the engine works. Answers
//! that time out must neither lose nor double what they carried (invariants 2, 3),
//! a write beside the commit path must never roll a shard back, and a read states
//! the time its values are from, not the time it finished (invariants 4, 5).

mod common;

use common::*;
use std::sync::Arc;
use std::time::Duration;
use tally_core::sketch::{member_hash, DistinctSketch};
use tally_core::{CounterName, ShardId};
use tally_engine::{
    Clock, Consistency, Durability, Increment, ManualClock, MemStore, ShardRequest, ShardResponse, SpecPatch,
    SystemClock, Tally, TallyConfig,
};

async fn hooked(config: TallyConfig, clock: Arc<dyn Clock>) -> (Tally, HookStore) {
    let store = HookStore::new(MemStore::new());
    let tally = Tally::open_with(Arc::new(store.clone()), clock, config).await.unwrap();
    (tally, store)
}

/// Polls a fresh read until `done` holds or about `ms` pass; returns the last read.
async fn read_until(tally: &Tally, name: &str, ms: u64, done: impl Fn(i128) -> bool) -> i128 {
    let mut value = 0;
    for _ in 0..ms / 20 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        if let Ok(r) = tally.read(name, Consistency::Fresh).await {
            value = r.value;
            if r.complete && done(value) {
                break;
            }
        }
    }
    value
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_local_drain_whose_answer_times_out_counts_once() {
    // The disk stalls longer than the call timeout: the drain's sender stops waiting
    // while its submission is still queued at the shard, which applies it later.
    let config = TallyConfig { call_timeout_ms: 200, ..quick_config() };
    let (tally, store) = hooked(config, Arc::new(SystemClock)).await;
    let patch = SpecPatch { flush_ms: Some(10), ..spec(1, Durability::Batched) };
    tally.put_counter("v", patch).await.unwrap();
    // The first increment goes to the shard and opens its accumulator slot.
    tally.incr("v", Increment::new(1)).await.unwrap();
    store.stall_commit_path(700);
    for _ in 0..10 {
        assert!(tally.incr("v", Increment::new(1)).await.unwrap().applied);
    }
    tokio::time::sleep(Duration::from_millis(1_200)).await;
    store.stall_commit_path(0);
    let value = read_until(&tally, "v", 3_000, |v| v > 11).await;
    assert_eq!(value, 11, "10 buffered increments and one direct one");
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_read_with_a_drain_still_in_doubt_says_it_is_incomplete() {
    let config = TallyConfig { call_timeout_ms: 200, ..quick_config() };
    let (tally, store) = hooked(config, Arc::new(SystemClock)).await;
    let patch = SpecPatch { flush_ms: Some(60_000), ..spec(1, Durability::Batched) };
    tally.put_counter("v", patch).await.unwrap();
    tally.incr("v", Increment::new(1)).await.unwrap();
    for _ in 0..10 {
        tally.incr("v", Increment::new(1)).await.unwrap();
    }
    store.stall_commit_path(1_000);
    // The read's own drain times out: the read cannot know whether the shard applied
    // those 10, so it must not claim a complete total.
    let r = tally.read("v", Consistency::Fresh).await.unwrap();
    assert!(!r.complete || r.value == 11, "{r:?}");
    store.stall_commit_path(0);
    assert_eq!(read_until(&tally, "v", 3_000, |v| v == 11).await, 11);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_read_includes_what_a_replaced_runtime_still_buffers() {
    // The aggregator never ticks here: only the read itself can deliver buffers.
    let config = TallyConfig { aggregator_tick_ms: 3_600_000, ..quick_config() };
    let (tally, _) = hooked(config, Arc::new(SystemClock)).await;
    tally.put_counter("v", spec(1, Durability::Batched)).await.unwrap();
    tally.incr("v", Increment::new(1)).await.unwrap();
    for _ in 0..5 {
        tally.incr("v", Increment::new(1)).await.unwrap();
    }
    // A spec change replaces the counter's runtime; the old one still holds the 5.
    tally.put_counter("v", SpecPatch { rollup_ms: Some(500), ..Default::default() }).await.unwrap();
    let r = tally.read("v", Consistency::Fresh).await.unwrap();
    assert_eq!((r.value, r.complete), (6, true), "{r:?}");
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sketch_merged_beside_a_live_shard_never_rolls_it_back() {
    let (tally, store) = hooked(quick_config(), Arc::new(SystemClock)).await;
    let patch = SpecPatch { distinct: Some(true), ..spec(1, Durability::Sync) };
    tally.put_counter("c", patch).await.unwrap();
    tally.incr("c", Increment::new(5).event_id("e1").member("m1")).await.unwrap();
    // A merge from a late resharding task arrives while the shard takes writes.
    let mut sketch = DistinctSketch::new();
    sketch.insert_hash(member_hash("x"));
    store.stall_direct_commits(400);
    let id = ShardId::new(CounterName::new("c").unwrap(), 0, 0);
    let merge = tokio::spawn({
        let tally = tally.clone();
        async move {
            tally
                .serve_shard_request(ShardRequest::MergeSketch {
                    id,
                    sketch: Some(sketch.to_bytes()),
                    frequency: None,
                    windows: None,
                })
                .await
        }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    assert!(tally.incr("c", Increment::new(7).event_id("e2").member("m2")).await.unwrap().applied);
    let answer = merge.await.unwrap();
    assert!(matches!(answer, ShardResponse::Done), "{answer:?}");
    store.stall_direct_commits(0);
    assert_eq!(
        tally.read("c", Consistency::Fresh).await.unwrap().value,
        12,
        "an acknowledged write was lost"
    );
    assert!(tally.incr("c", Increment::new(1).event_id("e3").member("m3")).await.unwrap().applied);
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, 13);
    assert_eq!(tally.distinct("c").await.unwrap().estimate, 4, "m1, m2, m3 and the merged x");
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_is_as_of_the_time_before_it_fanned_out() {
    let clock = ManualClock::new(1_000_000);
    let (tally, store) = hooked(quick_config(), Arc::new(clock.clone())).await;
    tally.put_counter("c", spec(4, Durability::Sync)).await.unwrap();
    tally.incr("c", Increment::new(3).event_id("a")).await.unwrap();
    // Every shard load takes 100 ms of the node's clock.
    let c = clock.clone();
    *store.on_load.lock().unwrap() = Some(Box::new(move || c.advance(100)));
    let started = clock.now_ms();
    let r = tally.read("c", Consistency::Fresh).await.unwrap();
    assert_eq!(r.value, 3);
    assert!(r.as_of_ms <= started, "as_of {} after the read began at {started}", r.as_of_ms);
    // A cached read's staleness counts the time its refresh took.
    let started = clock.now_ms();
    let r = tally.read("c", Consistency::Cached).await.unwrap();
    assert!(r.as_of_ms <= started, "as_of {} after the read began at {started}", r.as_of_ms);
    assert!(r.staleness_ms >= 400, "{r:?}");
    *store.on_load.lock().unwrap() = None;
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_cached_read_never_waits_behind_another_counters_slow_read() {
    let (tally, store) = hooked(quick_config(), Arc::new(SystemClock)).await;
    for name in ["hot", "cold"] {
        tally.put_counter(name, spec(1, Durability::Sync)).await.unwrap();
        tally.incr(name, Increment::new(2).event_id("a")).await.unwrap();
    }
    assert_eq!(tally.read("hot", Consistency::Cached).await.unwrap().value, 2);
    // From now on every shard read hangs until released: the first cached read of
    // "cold" must fan out without holding up the cached answer for "hot".
    let held = Arc::new(std::sync::atomic::AtomicBool::new(true));
    let h = held.clone();
    *store.on_load.lock().unwrap() = Some(Box::new(move || {
        while h.load(std::sync::atomic::Ordering::SeqCst) {
            std::thread::sleep(Duration::from_millis(5));
        }
    }));
    let cold = tokio::spawn({
        let tally = tally.clone();
        async move { tally.read("cold", Consistency::Cached).await }
    });
    tokio::time::sleep(Duration::from_millis(50)).await;
    let hot = tokio::time::timeout(Duration::from_secs(5), tally.read("hot", Consistency::Cached)).await;
    held.store(false, std::sync::atomic::Ordering::SeqCst);
    assert_eq!(hot.expect("the cached read of hot waited for cold's fan-out").unwrap().value, 2);
    assert_eq!(cold.await.unwrap().unwrap().value, 2);
    *store.on_load.lock().unwrap() = None;
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_that_cannot_forget_a_failed_commit_starts_again_from_the_store() {
    let (tally, store) = hooked(quick_config(), Arc::new(SystemClock)).await;
    tally.put_counter("c", spec(1, Durability::Sync)).await.unwrap();
    tally.incr("c", Increment::new(1).event_id("e0")).await.unwrap();
    // The commit fails, and so does the reload that would forget what it decided.
    store.inner.fail_next_commits(1);
    store.fail_loads.store(true, std::sync::atomic::Ordering::SeqCst);
    let err = tally.incr("c", Increment::new(1).event_id("e1")).await.unwrap_err();
    assert_eq!(err.http_status(), 503, "{err}");
    // (The caller hears of the failure before the shard does.)
    tokio::time::sleep(Duration::from_millis(200)).await;
    store.fail_loads.store(false, std::sync::atomic::Ordering::SeqCst);
    // The client retries with the same id: counted once.
    for _ in 0..50 {
        match tally.incr("c", Increment::new(1).event_id("e1")).await {
            Ok(o) => {
                assert!(o.applied, "{o:?}");
                break;
            }
            Err(e) => assert!(e.retryable(), "{e}"),
        }
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, 2);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sum_in_doubt_past_the_resend_limit_is_reported_not_resent() {
    let clock = ManualClock::new(1_000_000);
    let config = TallyConfig { call_timeout_ms: 200, ..quick_config() };
    let (tally, store) = hooked(config, Arc::new(clock.clone())).await;
    let patch = SpecPatch { flush_ms: Some(10), ..spec(1, Durability::Batched) };
    tally.put_counter("v", patch).await.unwrap();
    tally.incr("v", Increment::new(1)).await.unwrap();
    // The disk stalls for good: the drain's answer never comes in time.
    store.stall_commit_path(3_000);
    for _ in 0..10 {
        tally.incr("v", Increment::new(1)).await.unwrap();
    }
    for _ in 0..100 {
        clock.advance(20);
        tokio::time::sleep(Duration::from_millis(20)).await;
        if tally.in_doubt_increments() == 10 {
            break;
        }
    }
    assert_eq!(tally.in_doubt_increments(), 10, "the drain is in doubt");
    assert_eq!(tally.stats().buffered_lost.get(), 0);
    // Past the limit its record could have expired: it is given up and reported.
    clock.advance(tally_engine::IN_DOUBT_RETRY_MS_MAX + 1);
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        if tally.stats().buffered_lost.get() == 10 {
            break;
        }
    }
    assert_eq!(tally.stats().buffered_lost.get(), 10);
    assert_eq!(tally.in_doubt_increments(), 0);
    store.stall_commit_path(0);
    tally.shutdown().await.unwrap();
}

/// A sum in doubt belongs to the counter it was drained from. Its counter deleted
/// and a namesake created before the resend, the resend must not count the first
/// counter's increments in the second (its drain id is new to the namesake's
/// shard, so the shard cannot tell).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sum_in_doubt_is_never_resent_to_a_namesake_of_its_deleted_counter() {
    let clock = ManualClock::new(1_000_000);
    let config = TallyConfig { call_timeout_ms: 200, ..quick_config() };
    let (tally, store) = hooked(config, Arc::new(clock.clone())).await;
    let patch = SpecPatch { flush_ms: Some(10), ..spec(1, Durability::Batched) };
    tally.put_counter("v", patch).await.unwrap();
    tally.incr("v", Increment::new(1)).await.unwrap();
    store.stall_commit_path(1_500);
    for _ in 0..10 {
        tally.incr("v", Increment::new(1)).await.unwrap();
    }
    for _ in 0..100 {
        clock.advance(5);
        tokio::time::sleep(Duration::from_millis(20)).await;
        if tally.in_doubt_increments() == 10 {
            break;
        }
    }
    assert_eq!(tally.in_doubt_increments(), 10, "the drain is in doubt");
    // The counter is deleted (its shard applies the stalled sum, then goes) and
    // created again before the sum's resend is due.
    store.stall_commit_path(0);
    tally.delete_counter("v").await.unwrap();
    tally.put_counter("v", patch).await.unwrap();
    for _ in 0..50 {
        clock.advance(50);
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    assert_eq!(tally.in_doubt_increments(), 0);
    let r = tally.read("v", Consistency::Fresh).await.unwrap();
    assert_eq!((r.value, r.complete), (0, true), "the new counter holds none of the old one's increments");
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_read_whose_caller_stops_waiting_leaves_no_drain_behind() {
    // A client that gives up (its connection closes, its own timeout passes) drops
    // its read while the read's drain of buffered increments waits on the disk. The
    // drain must still end: later fresh reads complete, and nothing it carried is
    // lost or counted twice.
    let (tally, store) = hooked(quick_config(), Arc::new(SystemClock)).await;
    let patch = SpecPatch { flush_ms: Some(60_000), ..spec(1, Durability::Batched) };
    tally.put_counter("v", patch).await.unwrap();
    tally.incr("v", Increment::new(1)).await.unwrap();
    for _ in 0..10 {
        tally.incr("v", Increment::new(1)).await.unwrap();
    }
    store.stall_commit_path(500);
    let gave_up = tokio::time::timeout(Duration::from_millis(50), tally.read("v", Consistency::Fresh)).await;
    assert!(gave_up.is_err(), "the read waited on the stalled disk");
    store.stall_commit_path(0);
    let r = tally.read("v", Consistency::Fresh).await.unwrap();
    let r = if r.complete {
        r
    } else {
        tokio::time::sleep(Duration::from_millis(1_000)).await;
        tally.read("v", Consistency::Fresh).await.unwrap()
    };
    assert!(r.complete, "a fresh read after the abandoned one is complete: {r:?}");
    assert_eq!(r.value, 11);
    tally.shutdown().await.unwrap();
}
