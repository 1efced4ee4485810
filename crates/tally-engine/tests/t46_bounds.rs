//! t46: bounded counters — `min` and `max` hold exactly across a counter's shards
//! (each spends its escrow share and borrows from the others), an increment that
//! would cross a bound is refused whole with `bound_exceeded`, the shares survive a
//! restart, and bounds are set once.

mod common;

use common::*;
use std::sync::atomic::{AtomicI64, AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use tally_engine::{
    Consistency, Durability, Increment, MemStore, SpecPatch, SystemClock, Tally, TallyConfig, TallyError,
};

fn bounded(shards: u16, min: Option<i64>, max: Option<i64>) -> SpecPatch {
    SpecPatch { min, max, rollup_ms: Some(0), ..spec(shards, Durability::Sync) }
}

/// `writers` tasks each take `-1` until a fresh read shows the counter at its floor
/// of 0; returns how many decrements were acknowledged and refused.
async fn drain_to_zero(tally: &Tally, name: &'static str, writers: u32) -> (i64, u64) {
    let (taken, refused) = (Arc::new(AtomicI64::new(0)), Arc::new(AtomicU64::new(0)));
    let mut tasks = Vec::new();
    for w in 0..writers {
        let (t, taken, refused) = (tally.clone(), taken.clone(), refused.clone());
        tasks.push(tokio::spawn(async move {
            for i in 0.. {
                let inc = Increment::new(-1).event_id(format!("take-{w}-{i}"));
                match t.incr(name, inc).await {
                    Ok(o) => {
                        assert!(o.applied);
                        taken.fetch_add(1, SeqCst);
                    }
                    Err(TallyError::BoundExceeded { bound, headroom, .. }) => {
                        assert_eq!(bound, "min");
                        refused.fetch_add(1, SeqCst);
                        let v = t.read(name, Consistency::Fresh).await.unwrap().value;
                        assert!(v >= 0, "a read below the floor: {v} (headroom seen {headroom})");
                        if v == 0 {
                            return;
                        }
                    }
                    Err(e) => panic!("{e}"),
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    (taken.load(SeqCst), refused.load(SeqCst))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_floor_of_zero_admits_exactly_the_stock_across_shards() {
    let (tally, _) = mem_engine().await;
    tally.put_counter("stock", bounded(4, Some(0), None)).await.unwrap();
    // The stock arrives on one shard (one writer): the other shards must borrow it.
    tally.incr("stock", Increment::new(300).writer("supplier")).await.unwrap();
    let (taken, refused) = drain_to_zero(&tally, "stock", 16).await;
    assert_eq!(taken, 300, "refused {refused}");
    assert_eq!(tally.read("stock", Consistency::Fresh).await.unwrap().value, 0);
    let err = tally.incr("stock", Increment::new(-1)).await.unwrap_err();
    assert_eq!((err.code(), err.http_status(), err.retryable()), ("bound_exceeded", 409, false));
    assert!(err.to_string().contains("min (0)"), "{err}");
    tally.shutdown().await.unwrap();
}

/// On sled, flushes run on a thread of their own, outside the runtime: escrow
/// messages that wait for a flush are sent from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_floor_holds_on_a_sled_store_whose_flushes_run_off_the_runtime() {
    let dir = tempfile::tempdir().unwrap();
    let tally = Tally::open(dir.path(), quick_config()).await.unwrap();
    tally.put_counter("stock", bounded(4, Some(0), None)).await.unwrap();
    tally.incr("stock", Increment::new(120).writer("supplier")).await.unwrap();
    let drain = tokio::time::timeout(std::time::Duration::from_secs(30), drain_to_zero(&tally, "stock", 8));
    let (taken, refused) = drain.await.expect("the stock is taken within 30 s");
    assert_eq!(taken, 120, "refused {refused}");
    assert_eq!(tally.read("stock", Consistency::Fresh).await.unwrap().value, 0);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_ceiling_admits_exactly_up_to_it_and_a_large_step_is_refused_whole() {
    let (tally, _) = mem_engine().await;
    tally.put_counter("quota", bounded(3, None, Some(10))).await.unwrap();
    let mut applied = 0;
    for i in 0..20 {
        match tally.incr("quota", Increment::new(1).writer(format!("w{}", i % 5))).await {
            Ok(_) => applied += 1,
            Err(e) => assert_eq!(e.code(), "bound_exceeded", "{e}"),
        }
    }
    // Borrowing may refuse a step while headroom is elsewhere; retrying takes the rest.
    for i in 0..100 {
        if applied == 10 {
            break;
        }
        if tally.incr("quota", Increment::new(1).writer(format!("w{}", i % 5))).await.is_ok() {
            applied += 1;
        }
    }
    assert_eq!(applied, 10);
    assert_eq!(tally.read("quota", Consistency::Fresh).await.unwrap().value, 10);
    // Coming down frees headroom above; a step larger than all of it is never taken
    // in part.
    tally.incr("quota", Increment::new(-4)).await.unwrap();
    let err = tally.incr("quota", Increment::new(5)).await.unwrap_err();
    assert!(matches!(err, TallyError::BoundExceeded { ref bound, limit: 10, .. } if bound == "max"), "{err}");
    assert_eq!(tally.read("quota", Consistency::Fresh).await.unwrap().value, 6);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn shares_survive_a_restart() {
    let (tally, store) = mem_engine().await;
    tally.put_counter("credits", bounded(2, Some(0), None)).await.unwrap();
    tally.incr("credits", Increment::new(5).writer("a")).await.unwrap();
    tally.incr("credits", Increment::new(-3).writer("a")).await.unwrap();
    tally.shutdown().await.unwrap();
    let tally = reopen(&store).await;
    let (taken, _) = drain_to_zero(&tally, "credits", 4).await;
    assert_eq!(taken, 2);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounds_are_checked_on_create_and_never_change() {
    let (tally, _) = mem_engine().await;
    let cases = [
        (SpecPatch { min: Some(0), ..SpecPatch::default() }, "durability"),
        (bounded(2, Some(1), None), "starts at 0"),
        (bounded(2, None, Some(-1)), "starts at 0"),
        (bounded(2, Some(5), Some(4)), "above max"),
    ];
    for (patch, words) in cases {
        let err = tally.put_counter("c", patch).await.unwrap_err();
        assert_eq!((err.code(), err.http_status()), ("invalid_spec", 422), "{err}");
        assert!(err.to_string().contains(words), "{err}");
    }
    tally.put_counter("c", bounded(2, Some(-10), Some(10))).await.unwrap();
    for patch in [
        SpecPatch { min: Some(-11), ..SpecPatch::default() },
        SpecPatch { max: Some(11), ..SpecPatch::default() },
        SpecPatch { shards: Some(4), ..SpecPatch::default() },
    ] {
        let err = tally.put_counter("c", patch).await.unwrap_err();
        assert_eq!(err.code(), "invalid_spec", "{err}");
        assert!(err.to_string().contains("never change"), "{err}");
    }
    let auto = tally_engine::AutoPatch { auto: true, ..Default::default() };
    let err = tally.put_counter_auto("c", SpecPatch::default(), auto).await.unwrap_err();
    assert_eq!(err.code(), "invalid_spec", "{err}");
    // Naming the bounds it has is fine, and so is changing anything else.
    let same = SpecPatch { min: Some(-10), rollup_ms: Some(100), ..SpecPatch::default() };
    assert_eq!(tally.put_counter("c", same).await.unwrap().counter.spec.rollup_ms, 100);
    tally.shutdown().await.unwrap();
}

/// A change at its bound waits for headroom from the other shards, and is refused
/// when none comes: the caller must hear that refusal, not give up first. With a
/// call timeout shorter than the default wait, the wait shrinks to fit inside it.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_change_at_the_bound_is_refused_within_a_short_call_timeout() {
    let store = MemStore::new();
    let config = TallyConfig { call_timeout_ms: 120, ..TallyConfig::default() };
    let tally = Tally::open_with(Arc::new(store), Arc::new(SystemClock), config).await.unwrap();
    tally.put_counter("empty", bounded(2, Some(0), None)).await.unwrap();
    for i in 0..4 {
        let err = tally.incr("empty", Increment::new(-1).writer(format!("w{i}"))).await.unwrap_err();
        assert_eq!(err.code(), "bound_exceeded", "{err}");
    }
    tally.shutdown().await.unwrap();
}
