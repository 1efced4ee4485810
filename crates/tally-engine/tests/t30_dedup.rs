//! t30: event ids are idempotency keys (invariant 2): a retry is a duplicate, a reuse
//! with another delta is a conflict, the memory survives restarts and ends with the
//! dedup window.

mod common;

use common::*;
use std::sync::Arc;
use tally_engine::{Consistency, Durability, Increment, SpecPatch, Tally, TallyConfig};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retries_are_duplicates_and_reuse_with_another_delta_is_a_conflict() {
    let (tally, _) = mem_engine().await;
    for d in [Durability::Sync, Durability::Batched] {
        let name = format!("c-{d}");
        tally.put_counter(&name, spec(16, d)).await.unwrap();
        let first = tally.incr(&name, Increment::new(5).event_id("e-1")).await.unwrap();
        assert!(first.applied && !first.duplicate);
        for _ in 0..3 {
            let again = tally.incr(&name, Increment::new(5).event_id("e-1").writer("other")).await.unwrap();
            assert!(!again.applied && again.duplicate);
        }
        let err = tally.incr(&name, Increment::new(6).event_id("e-1")).await.unwrap_err();
        assert_eq!((err.code(), err.http_status()), ("event_id_conflict", 409));
        assert_eq!(tally.read(&name, Consistency::Fresh).await.unwrap().value, 5);
    }
    assert_eq!(tally.stats().dedup_hits.get(), 6);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_copies_of_one_event_count_once() {
    let (tally, _) = mem_engine().await;
    tally.put_counter("c", spec(8, Durability::Sync)).await.unwrap();
    let mut tasks = Vec::new();
    for i in 0..100 {
        let t = tally.clone();
        tasks.push(tokio::spawn(async move {
            t.incr("c", Increment::new(1).event_id(format!("e-{}", i % 10))).await.unwrap().applied
        }));
    }
    let mut applied = 0;
    for t in tasks {
        applied += usize::from(t.await.unwrap());
    }
    assert_eq!(applied, 10);
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, 10);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn dedup_memory_survives_a_restart_of_the_sled_store() {
    let dir = tempfile::tempdir().unwrap();
    let tally = Tally::open(dir.path(), TallyConfig::default()).await.unwrap();
    tally.put_counter("c", spec(4, Durability::Sync)).await.unwrap();
    for i in 0..50 {
        tally.incr("c", Increment::new(2).event_id(format!("e{i}"))).await.unwrap();
    }
    tally.shutdown().await.unwrap();
    drop(tally);
    // sled releases its file lock once its last handle is gone; the engine's last
    // tasks let go of theirs shortly after shutdown.
    let mut reopened = None;
    for _ in 0..100 {
        match Tally::open(dir.path(), TallyConfig::default()).await {
            Ok(t) => {
                reopened = Some(t);
                break;
            }
            Err(_) => tokio::time::sleep(std::time::Duration::from_millis(50)).await,
        }
    }
    let tally = reopened.expect("the store reopens after shutdown");
    for i in 0..50 {
        assert!(tally.incr("c", Increment::new(2).event_id(format!("e{i}"))).await.unwrap().duplicate);
    }
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, 100);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_id_counts_again_once_its_window_has_passed() {
    let (tally, _store, clock) = manual_engine(1_000_000).await;
    let patch = SpecPatch { dedup_window_s: Some(60), ..spec(4, Durability::Sync) };
    tally.put_counter("c", patch).await.unwrap();
    tally.incr("c", Increment::new(1).event_id("e")).await.unwrap();
    clock.advance(59_999);
    assert!(tally.incr("c", Increment::new(1).event_id("e")).await.unwrap().duplicate);
    clock.advance(1);
    assert!(tally.incr("c", Increment::new(1).event_id("e")).await.unwrap().applied);
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, 2);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn expired_records_are_swept_from_the_store() {
    let store = tally_engine::MemStore::new();
    let clock = tally_engine::ManualClock::new(1_000_000);
    let config = TallyConfig { dedup_sweep_ms: 1, ..quick_config() };
    let tally = Tally::open_with(Arc::new(store.clone()), Arc::new(clock.clone()), config).await.unwrap();
    let patch = SpecPatch { dedup_window_s: Some(1), ..spec(1, Durability::Sync) };
    tally.put_counter("c", patch).await.unwrap();
    for i in 0..20 {
        tally.incr("c", Increment::new(1).event_id(format!("e{i}"))).await.unwrap();
    }
    let id = tally_core::ShardId::new(tally_core::CounterName::new("c").unwrap(), 0, 0);
    assert_eq!(tally.store().dedup_scan(&id, None, 100).unwrap().len(), 20);
    // Expired after 1 s; due for a sweep an eighth of the window later. The shard
    // sweeps on its next tick (once a second).
    clock.advance(1_125);
    let left = polled_until_zero(40, || tally.store().dedup_scan(&id, None, 100).unwrap().len()).await;
    assert_eq!(left, 0, "expired records were not swept");
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, 20);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn live_records_are_not_read_again_every_sweep_period() {
    // A day's window and a pass due every minute: a shard whose records are all
    // live reads them once when it starts, not again every minute (with millions of
    // records that was a node's whole CPU).
    let store = tally_engine::MemStore::new();
    let clock = tally_engine::ManualClock::new(1_000_000);
    let config =
        TallyConfig { dedup_sweep_ms: 60_000, shard_idle_stop_ms: 1_000 * 3_600_000, ..quick_config() };
    let tally = Tally::open_with(Arc::new(store.clone()), Arc::new(clock.clone()), config).await.unwrap();
    tally.put_counter("c", spec(1, Durability::Sync)).await.unwrap();
    for i in 0..50 {
        tally.incr("c", Increment::new(1).event_id(format!("e{i:02}"))).await.unwrap();
    }
    // The passes a started shard makes at its first ticks (its drain ids' lane,
    // then the records'), a page a tick.
    let reads = || tally.stats().dedup_sweep_reads.get();
    polled_until_zero(50, || 50u64.saturating_sub(reads())).await;
    let before = reads();
    assert_eq!(before, 50, "a started shard reads its records once");
    for _ in 0..4 {
        clock.advance(60_000);
        tokio::time::sleep(std::time::Duration::from_millis(1_100)).await;
    }
    assert_eq!(reads(), before, "live records were read again before any was due");
    let id = tally_core::ShardId::new(tally_core::CounterName::new("c").unwrap(), 0, 0);
    assert_eq!(tally.store().dedup_scan(&id, None, 100).unwrap().len(), 50);
    // A day and an eighth later they are due, read once more, and removed.
    clock.advance(86_400_000 + 86_400_000 / 8);
    let left = polled_until_zero(40, || tally.store().dedup_scan(&id, None, 100).unwrap().len()).await;
    assert_eq!(left, 0, "due records were not swept");
    assert_eq!(reads(), before + 50);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sweep_pass_goes_on_page_by_page_until_every_expired_record_is_gone() {
    // Pages of 5 records and a pass an hour: 20 expired records must not wait four
    // hours (expiry would never keep up with a shard taking more than a page per
    // period); once a pass starts it takes a page per tick.
    let store = tally_engine::MemStore::new();
    let clock = tally_engine::ManualClock::new(1_000_000);
    let config = TallyConfig {
        dedup_sweep_ms: 3_600_000,
        dedup_sweep_records_max: 5,
        shard_idle_stop_ms: 1_000 * 3_600_000,
        ..quick_config()
    };
    let tally = Tally::open_with(Arc::new(store.clone()), Arc::new(clock.clone()), config).await.unwrap();
    let patch = SpecPatch { dedup_window_s: Some(1), ..spec(1, Durability::Sync) };
    tally.put_counter("c", patch).await.unwrap();
    for i in 0..20 {
        tally.incr("c", Increment::new(1).event_id(format!("e{i:02}"))).await.unwrap();
    }
    let id = tally_core::ShardId::new(tally_core::CounterName::new("c").unwrap(), 0, 0);
    clock.advance(3_600_000);
    let left = polled_until_zero(100, || tally.store().dedup_scan(&id, None, 100).unwrap().len()).await;
    assert_eq!(left, 0, "a pass stopped after its first page");
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, 20);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_that_went_idle_still_has_its_expired_records_swept() {
    // The shard retires long before its records expire, and nothing writes to it
    // again: its records must not stay on disk forever.
    let store = tally_engine::MemStore::new();
    let clock = tally_engine::ManualClock::new(1_000_000);
    let config = TallyConfig { dedup_sweep_ms: 60_000, shard_idle_stop_ms: 5_000, ..quick_config() };
    let tally = Tally::open_with(Arc::new(store.clone()), Arc::new(clock.clone()), config).await.unwrap();
    let patch = SpecPatch { dedup_window_s: Some(3_600), ..spec(2, Durability::Sync) };
    tally.put_counter("c", patch).await.unwrap();
    for i in 0..20 {
        tally.incr("c", Increment::new(1).event_id(format!("e{i:02}"))).await.unwrap();
    }
    let name = tally_core::CounterName::new("c").unwrap();
    let ids = [tally_core::ShardId::new(name.clone(), 0, 0), tally_core::ShardId::new(name, 0, 1)];
    let records =
        || ids.iter().map(|id| tally.store().dedup_scan(id, None, 100).unwrap().len()).sum::<usize>();
    assert_eq!(records(), 20);
    // Idle: the shards retire (a tick a second sees the idle time).
    clock.advance(10_000);
    tokio::time::sleep(std::time::Duration::from_millis(2_500)).await;
    assert_eq!(records(), 20, "records swept before they expired");
    // An hour later every record has expired, and an eighth of an hour after that
    // each is due for a sweep.
    clock.advance(3_600_000 + 450_000);
    let left = polled_until_zero(50, records).await;
    assert_eq!(left, 0, "an idle shard's expired records stayed on disk");
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, 20);
    tally.shutdown().await.unwrap();
}

/// Polls `left` every 100 ms until it answers 0, at most `polls` times; answers
/// the last value.
async fn polled_until_zero<N: PartialEq + Default>(polls: usize, left: impl Fn() -> N) -> N {
    let mut last = left();
    for _ in 0..polls {
        if last == N::default() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(100)).await;
        last = left();
    }
    last
}
