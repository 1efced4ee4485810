//! t20: what survives a crash (invariants 1 and 3), on the in-memory store whose
//! crash drops exactly what was not flushed.
//!
//! A crash here is: close the store (the dead node writes nothing more), abort the
//! engine (no shutdown flush), drop unflushed writes, and open a new engine.

mod common;

use common::*;
use std::collections::BTreeSet;
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tally_engine::{Consistency, Durability, Increment, MemStore, SpecPatch, Tally};

async fn crash(tally: &Tally, store: &mut MemStore) -> Tally {
    tally.abort();
    *store = store.restart(0);
    reopen(store).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_acknowledged_sync_increment_survives_a_crash_mid_stream() {
    let (tally, mut store) = mem_engine().await;
    tally.put_counter("credits", spec(8, Durability::Sync)).await.unwrap();
    let acked = Arc::new(Mutex::new(BTreeSet::new()));
    let mut tasks = Vec::new();
    for w in 0..32 {
        let (t, acked) = (tally.clone(), acked.clone());
        tasks.push(tokio::spawn(async move {
            let mut attempted = 0u64;
            for i in 0..10_000 {
                let id = format!("w{w}-{i}");
                attempted += 1;
                match t.incr("credits", Increment::new(1).event_id(id.clone())).await {
                    Ok(o) => {
                        assert!(o.applied);
                        acked.lock().unwrap().insert(id);
                    }
                    Err(_) => break,
                }
            }
            attempted
        }));
    }
    // Let the writers run, then pull the plug while increments are in flight.
    while acked.lock().unwrap().len() < 2_000 {
        tokio::time::sleep(Duration::from_millis(5)).await;
    }
    let tally = crash(&tally, &mut store).await;
    let mut attempted = 0;
    for t in tasks {
        attempted += t.await.unwrap();
    }
    let acked = acked.lock().unwrap().clone();
    let value = tally.read("credits", Consistency::Fresh).await.unwrap().value;
    let unknown = attempted - acked.len() as u64;
    assert!(
        value >= acked.len() as i128,
        "lost acknowledged increments: value {value} < acked {}",
        acked.len()
    );
    assert!(value <= (acked.len() as u64 + unknown) as i128, "counted more than was sent");
    // Every acknowledged id is remembered: its retry is a duplicate, not a second count.
    for id in acked.iter().take(500) {
        let o = tally.incr("credits", Increment::new(1).event_id(id.clone())).await.unwrap();
        assert!(o.duplicate, "{id} was acknowledged but forgotten");
    }
    assert_eq!(tally.read("credits", Consistency::Fresh).await.unwrap().value, value);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_flush_serves_many_sync_increments() {
    // On sled, where a flush is a real fsync, 64 concurrent writers share flushes.
    let dir = tempfile::tempdir().unwrap();
    let tally = Tally::open(dir.path(), quick_config()).await.unwrap();
    tally.put_counter("s", spec(64, Durability::Sync)).await.unwrap();
    let flushes_before = tally.stats().flushes.get();
    let mut tasks = Vec::new();
    for w in 0..64 {
        let t = tally.clone();
        tasks.push(tokio::spawn(async move {
            for i in 0..50 {
                t.incr("s", Increment::new(1).event_id(format!("{w}:{i}"))).await.unwrap();
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    let flushes = tally.stats().flushes.get() - flushes_before;
    assert_eq!(tally.read("s", Consistency::Fresh).await.unwrap().value, 3_200);
    // Without group commit every increment would cost its own flush. (The factor
    // reached in an optimized build is in BENCHMARKS.md; debug builds share less.)
    assert!(flushes < 3_200 / 2, "group commit should share flushes: {flushes} flushes for 3200 increments");
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batched_crash_loses_at_most_the_open_window_and_never_double_counts() {
    let (tally, mut store) = mem_engine().await;
    let patch = SpecPatch { flush_ms: Some(100), ..spec(8, Durability::Batched) };
    tally.put_counter("views", patch).await.unwrap();
    for _ in 0..1_000 {
        tally.incr("views", Increment::new(1)).await.unwrap();
    }
    // One window plus the flush: everything so far is durable.
    tokio::time::sleep(Duration::from_millis(400)).await;
    for _ in 0..500 {
        tally.incr("views", Increment::new(1)).await.unwrap();
    }
    let tally = crash(&tally, &mut store).await;
    let value = tally.read("views", Consistency::Fresh).await.unwrap().value;
    assert!(
        (1_000..=1_500).contains(&value),
        "value {value}: lost more than the open window or double counted"
    );
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batched_counter_is_durable_once_its_window_has_passed() {
    let (tally, mut store) = mem_engine().await;
    let patch = SpecPatch { flush_ms: Some(50), ..spec(8, Durability::Batched) };
    tally.put_counter("views", patch).await.unwrap();
    for _ in 0..2_000 {
        tally.incr("views", Increment::new(1)).await.unwrap();
    }
    tokio::time::sleep(Duration::from_millis(300)).await;
    let tally = crash(&tally, &mut store).await;
    assert_eq!(tally.read("views", Consistency::Fresh).await.unwrap().value, 2_000);
    tally.shutdown().await.unwrap();
}

/// A wall clock stepped back (NTP correcting a clock that ran ahead) does not hold
/// back the window: buffers drain `flush_ms` after they filled, by the time that
/// passed, not by what the wall clock reads.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batched_counter_is_durable_once_its_window_has_passed_though_the_clock_stepped_back() {
    let store = MemStore::new();
    let clock = SteppedClock::default();
    let mut store_ref = store.clone();
    let tally = Tally::open_with(Arc::new(store), Arc::new(clock.clone()), quick_config()).await.unwrap();
    let patch = SpecPatch { flush_ms: Some(50), ..spec(8, Durability::Batched) };
    tally.put_counter("views", patch).await.unwrap();
    for _ in 0..2_000 {
        tally.incr("views", Increment::new(1)).await.unwrap();
    }
    // The aggregator has seen the buffers (it ticks every 5 ms) and set their drain
    // `flush_ms` ahead; then the clock steps back a minute.
    tokio::time::sleep(Duration::from_millis(20)).await;
    clock.step_back(60_000);
    tokio::time::sleep(Duration::from_millis(300)).await;
    let tally = crash(&tally, &mut store_ref).await;
    assert_eq!(tally.read("views", Consistency::Fresh).await.unwrap().value, 2_000);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shutdown_delivers_every_buffered_increment() {
    let (tally, store) = mem_engine().await;
    let patch = SpecPatch { flush_ms: Some(60_000), ..spec(8, Durability::Batched) };
    tally.put_counter("views", patch).await.unwrap();
    for _ in 0..777 {
        tally.incr("views", Increment::new(1)).await.unwrap();
    }
    tally.shutdown().await.unwrap();
    let store = store.restart(0);
    let tally = reopen(&store).await;
    assert_eq!(tally.read("views", Consistency::Fresh).await.unwrap().value, 777);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_failed_flush_is_never_acknowledged_and_stops_writes() {
    let (tally, mut store) = mem_engine().await;
    tally.put_counter("s", spec(2, Durability::Sync)).await.unwrap();
    tally.incr("s", Increment::new(1).event_id("before")).await.unwrap();
    store.fail_next_flushes(1);
    let err = tally.incr("s", Increment::new(1).event_id("during")).await.unwrap_err();
    assert_eq!(err.http_status(), 503, "{err}");
    // The node refuses writes until it is restarted.
    let err = tally.incr("s", Increment::new(1).event_id("after")).await.unwrap_err();
    assert_eq!(err.http_status(), 503, "{err}");
    let tally = crash(&tally, &mut store).await;
    let value = tally.read("s", Consistency::Fresh).await.unwrap().value;
    assert!((1..=2).contains(&value), "{value}");
    // The unacknowledged increment is retried with its id and counted once.
    tally.incr("s", Increment::new(1).event_id("during")).await.unwrap();
    assert_eq!(tally.read("s", Consistency::Fresh).await.unwrap().value, 2);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_read_never_shows_what_a_crash_can_take_back() {
    let (tally, mut store) = mem_engine().await;
    // A long window: only the read itself delivers the buffered increments.
    let patch = SpecPatch { flush_ms: Some(60_000), ..spec(4, Durability::Batched) };
    tally.put_counter("views", patch).await.unwrap();
    for _ in 0..25 {
        tally.incr("views", Increment::new(2)).await.unwrap();
    }
    let seen = tally.read("views", Consistency::Fresh).await.unwrap().value;
    assert_eq!(seen, 50);
    let tally = crash(&tally, &mut store).await;
    let after = tally.read("views", Consistency::Fresh).await.unwrap().value;
    assert_eq!(after, seen, "a read showed a total that the crash took back");
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn every_opening_of_a_store_is_a_new_incarnation() {
    // Drain ids carry the store's open count: it must never repeat, even across a
    // crash right after opening (a clock reading could).
    let opens = |store: &MemStore| {
        let b = tally_engine::Store::meta_get(store, b"engine:opens").unwrap().expect("counted");
        u64::from_be_bytes(b.try_into().unwrap())
    };
    let store = MemStore::new();
    let tally =
        Tally::open_with(Arc::new(store.clone()), Arc::new(tally_engine::SystemClock), quick_config())
            .await
            .unwrap();
    assert_eq!(opens(&store), 1);
    tally.shutdown().await.unwrap();
    drop(tally);
    let tally = reopen(&store).await;
    assert_eq!(opens(&store), 2);
    tally.abort();
    let store = store.restart(0);
    let tally = reopen(&store).await;
    assert_eq!(opens(&store), 3, "the count was durable before the engine served");
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counters_spec_and_a_deletion_outlive_a_restart() {
    // After a restart a counter created with its own spec keeps it (an increment
    // does not create a default counter over it), and a deleted counter's name
    // starts again from nothing.
    let (tally, store) = mem_engine().await;
    for i in 0..50 {
        tally.put_counter(&format!("kept:{i}"), spec(4, Durability::Sync)).await.unwrap();
        tally.incr(&format!("kept:{i}"), Increment::new(i + 1)).await.unwrap();
    }
    tally.incr("gone", Increment::new(7)).await.unwrap();
    tally.settle().await;
    tally.delete_counter("gone").await.unwrap();
    tally.shutdown().await.unwrap();

    let tally = reopen(&store).await;
    for i in 0..50 {
        let name = format!("kept:{i}");
        let info = tally.counter(&name).await.unwrap();
        assert_eq!((info.spec.shards, info.spec.durability), (4, Durability::Sync), "{name}");
        tally.incr(&name, Increment::new(1)).await.unwrap();
        assert_eq!(tally.read(&name, Consistency::Fresh).await.unwrap().value, i128::from(i) + 2);
    }
    tally.incr("gone", Increment::new(2)).await.unwrap();
    assert_eq!(tally.read("gone", Consistency::Fresh).await.unwrap().value, 2);
    tally.shutdown().await.unwrap();
}
