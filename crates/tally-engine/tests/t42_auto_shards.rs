//! t42: a counter with `shards: "auto"` follows its contention. Driven from one
//! writer to 64 concurrent writers it is resharded up; once it goes quiet it is
//! resharded back down to `min_shards` — through the ordinary lossless resharding, so
//! every read after a drain equals the acknowledged sum, retried event ids included.
//! Also: the bounds are validated, persist across a restart, and a number makes the
//! counter fixed again; a catalog that cannot keep bounds refuses "auto".

mod common;

use common::*;
use std::sync::atomic::{AtomicBool, AtomicI64, AtomicUsize, Ordering::*};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tally_engine::{
    AutoPatch, AutoReason, AutoShards, AutoTuning, Consistency, Durability, Increment, MemStore, SpecPatch,
    SystemClock, Tally, TallyConfig, TallyError,
};

/// Short timers; the rate threshold out of reach, so the queue depth (a count of
/// waiting writers, whatever the machine's speed) decides.
fn tuning() -> AutoTuning {
    AutoTuning {
        sample_ms: 20,
        change_interval_ms: 150,
        quiet_ms: 400,
        hot_samples: 2,
        rate_up_per_shard: 100_000_000,
        queue_up: 8,
    }
}

async fn engine(store: &MemStore) -> Tally {
    let config = TallyConfig { autoshard: tuning(), ..quick_config() };
    Tally::open_with(Arc::new(store.clone()), Arc::new(SystemClock), config).await.unwrap()
}

fn auto(min: u16, max: u16) -> AutoPatch {
    AutoPatch { auto: true, min_shards: Some(min), max_shards: Some(max) }
}

/// Writers `0..active` increment; the others wait. `idle` counts the waiting ones.
struct Load {
    active: AtomicUsize,
    idle: AtomicUsize,
    stop: AtomicBool,
    acked: AtomicI64,
}

const WRITERS: usize = 64;

async fn shards_now(tally: &Tally, name: &str) -> (u16, Option<u16>) {
    let info = tally.counter(name).await.unwrap();
    (info.layout_shards, info.resharding)
}

/// Waits until `pred` holds of the layout's shard count (no resharding in progress).
async fn wait_for(tally: &Tally, name: &str, within: Duration, pred: impl Fn(u16) -> bool) -> Duration {
    let start = Instant::now();
    loop {
        let (shards, resharding) = shards_now(tally, name).await;
        if resharding.is_none() && pred(shards) {
            return start.elapsed();
        }
        assert!(
            start.elapsed() < within,
            "still {shards} shards (resharding {resharding:?}) after {within:?}"
        );
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Waits until the machine has seen its last change complete at the current count.
async fn seen_change(tally: &Tally, name: &str) -> tally_engine::AutoChange {
    let start = Instant::now();
    loop {
        let report = tally.shards(name).await.unwrap();
        let status = report.auto.expect("an auto counter reports its machine");
        if let Some(c) = status
            .last_change
            .filter(|c| status.pending.is_none() && usize::from(c.to) == report.shards.len())
        {
            return c;
        }
        assert!(start.elapsed() < Duration::from_secs(5), "the change was never seen complete: {status:?}");
        tokio::time::sleep(Duration::from_millis(10)).await;
    }
}

/// Pauses every writer, then checks a fresh read against the acknowledged sum.
async fn check_exact(tally: &Tally, name: &str, load: &Load, resume: usize) {
    load.active.store(0, SeqCst);
    while load.idle.load(SeqCst) < WRITERS {
        tokio::time::sleep(Duration::from_millis(1)).await;
    }
    let read = tally.read(name, Consistency::Fresh).await.unwrap();
    assert!(read.complete);
    assert_eq!(
        read.value,
        i128::from(load.acked.load(SeqCst)),
        "a read after a drain is the acknowledged sum"
    );
    load.active.store(resume, SeqCst);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_to_sixty_four_writers_and_quiet_again() {
    let store = MemStore::new();
    let tally = engine(&store).await;
    let name = "auto-hot";
    let patch = SpecPatch { durability: Some(Durability::Sync), ..SpecPatch::default() };
    let created = tally.put_counter_auto(name, patch, auto(1, 64)).await.unwrap();
    assert!(created.created);
    assert_eq!(created.counter.layout_shards, 1, "an auto counter starts at min_shards");
    assert_eq!(created.counter.auto, Some(AutoShards { min_shards: 1, max_shards: 64 }));

    let load = Arc::new(Load {
        active: AtomicUsize::new(1),
        idle: AtomicUsize::new(0),
        stop: AtomicBool::new(false),
        acked: AtomicI64::new(0),
    });
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (t, load) = (tally.clone(), load.clone());
        writers.push(tokio::spawn(async move {
            let mut i = 0u64;
            let mut idle = false;
            while !load.stop.load(SeqCst) {
                if w >= load.active.load(SeqCst) {
                    if !idle {
                        load.idle.fetch_add(1, SeqCst);
                        idle = true;
                    }
                    tokio::time::sleep(Duration::from_millis(2)).await;
                    continue;
                }
                if idle {
                    load.idle.fetch_sub(1, SeqCst);
                    idle = false;
                }
                // Every increment carries an event id, so an unknown outcome (a
                // shard unavailable mid-resharding) is retried until known; every
                // fourth is sent twice: the retry must be a duplicate across every
                // resharding.
                let inc = Increment::new(if i % 4 == 0 { 2 } else { 1 }).event_id(format!("{w}-{i}"));
                let delta = inc.delta;
                match t.incr(name, inc.clone()).await {
                    Ok(o) if o.applied => {
                        load.acked.fetch_add(delta, SeqCst);
                    }
                    Ok(o) => panic!("a first send is applied: {o:?}"),
                    // Unknown outcome: retry with the same event id until known.
                    Err(e) if e.retryable() => continue,
                    Err(e) => panic!("{e}"),
                }
                if i % 4 == 0 {
                    loop {
                        match t.incr(name, inc.clone()).await {
                            Ok(again) => break assert!(again.duplicate, "a retried event id counts once"),
                            Err(e) if e.retryable() => continue,
                            Err(e) => panic!("{e}"),
                        }
                    }
                }
                i += 1;
            }
        }));
    }

    // One writer: no contention, no change.
    tokio::time::sleep(Duration::from_millis(500)).await;
    assert_eq!(shards_now(&tally, name).await, (1, None), "one writer never queues");
    check_exact(&tally, name, &load, WRITERS).await;

    // 64 writers: resharded up.
    let up = wait_for(&tally, name, Duration::from_secs(10), |s| s >= 8).await;
    eprintln!("t42: 64 writers: 1 -> {} shards in {up:?}", shards_now(&tally, name).await.0);
    check_exact(&tally, name, &load, WRITERS).await;
    tokio::time::sleep(Duration::from_millis(300)).await;
    check_exact(&tally, name, &load, 0).await;
    let peak = shards_now(&tally, name).await.0;
    assert!(peak <= 64);

    // Quiet: back down to min_shards.
    let down = wait_for(&tally, name, Duration::from_secs(10), |s| s == 1).await;
    eprintln!("t42: quiet: {peak} -> 1 shards in {down:?}");
    load.stop.store(true, SeqCst);
    for w in writers {
        w.await.unwrap();
    }
    let read = tally.read(name, Consistency::Fresh).await.unwrap();
    assert_eq!(read.value, i128::from(load.acked.load(SeqCst)));
    assert!(load.acked.load(SeqCst) > 1_000, "the writers barely ran");

    // Each change and its reason are reported.
    let report = tally.shards(name).await.unwrap();
    let status = report.auto.expect("an auto counter reports its machine");
    assert_eq!(status.bounds, AutoShards { min_shards: 1, max_shards: 64 });
    let last = seen_change(&tally, name).await;
    // The count may have risen once more after `peak` was read, while the writers ran.
    assert!((peak..=64).contains(&last.from), "lowered from {} after a peak of {peak}", last.from);
    assert_eq!((last.to, last.reason), (1, AutoReason::Quiet));
    assert!(last.completed_at_ms.is_some());
    assert!(status.figures.is_some());
    let sum: i128 = report.base + report.shards.iter().map(|s| i128::from(s.value)).sum::<i128>();
    assert_eq!(sum, read.value);
    let counts = tally.stats().auto_changes.snapshot();
    let count = |d: &str, r: &str| counts.iter().find(|(dd, rr, _)| *dd == d && *rr == r).unwrap().2;
    assert!(count("up", "queue_depth") >= 3, "1 -> 2 -> 4 -> 8 at least: {counts:?}");
    assert_eq!(count("down", "quiet"), 1, "{counts:?}");
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounds_are_validated_kept_across_a_restart_and_given_up_for_a_number() {
    let store = MemStore::new();
    let tally = engine(&store).await;
    for (min, max) in [(0u16, 4u16), (5, 4), (1, 1025)] {
        let err = tally.put_counter_auto("a", SpecPatch::default(), auto(min, max)).await.unwrap_err();
        assert_eq!(err.http_status(), 422, "{min}..{max}: {err}");
    }
    let both = SpecPatch { shards: Some(4), ..SpecPatch::default() };
    assert_eq!(tally.put_counter_auto("a", both, auto(1, 4)).await.unwrap_err().code(), "invalid_spec");
    let bounds_only = AutoPatch { max_shards: Some(8), ..AutoPatch::default() };
    assert_eq!(
        tally.put_counter_auto("a", SpecPatch::default(), bounds_only).await.unwrap_err().code(),
        "invalid_spec",
        "bounds alone on a fixed counter"
    );
    // A fixed counter switched to auto below its min is brought into its bounds.
    tally.put_counter("a", SpecPatch { shards: Some(2), ..SpecPatch::default() }).await.unwrap();
    tally.incr("a", Increment::new(5)).await.unwrap();
    tally.put_counter_auto("a", SpecPatch::default(), auto(4, 16)).await.unwrap();
    wait_for(&tally, "a", Duration::from_secs(5), |s| s == 4).await;
    // The machine sees the change complete in its next sample.
    let last = seen_change(&tally, "a").await;
    assert_eq!((last.from, last.to, last.reason), (2, 4, AutoReason::Bounds));
    // Bounds alone now change; they survive a restart.
    tally.put_counter_auto("a", SpecPatch::default(), bounds_only).await.unwrap();
    tally.shutdown().await.unwrap();
    drop(tally);
    let tally = engine(&store).await;
    let info = tally.counter("a").await.unwrap();
    assert_eq!(info.auto, Some(AutoShards { min_shards: 4, max_shards: 8 }));
    assert!(tally.shards("a").await.unwrap().auto.is_some(), "followed again after a restart");
    // A number makes it fixed.
    tally.put_counter("a", SpecPatch { shards: Some(3), ..SpecPatch::default() }).await.unwrap();
    tally.settle().await;
    let info = tally.counter("a").await.unwrap();
    assert_eq!((info.auto, info.layout_shards), (None, 3));
    assert!(tally.shards("a").await.unwrap().auto.is_none());
    assert_eq!(tally.read("a", Consistency::Fresh).await.unwrap().value, 5);
    // A deleted auto counter leaves no bounds behind.
    tally.put_counter_auto("b", SpecPatch::default(), auto(2, 8)).await.unwrap();
    tally.delete_counter("b").await.unwrap();
    tally.put_counter("b", SpecPatch::default()).await.unwrap();
    assert_eq!(tally.counter("b").await.unwrap().auto, None);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_catalog_without_auto_bounds_refuses_auto() {
    let catalog = SharedCatalog::default();
    let tally = Tally::open_parts(tally_engine::EngineParts {
        store: Arc::new(MemStore::new()),
        clock: Arc::new(SystemClock),
        config: quick_config(),
        catalog: Some(Arc::new(catalog)),
        placement: None,
    })
    .await
    .unwrap();
    let err = tally.put_counter_auto("c", SpecPatch::default(), auto(1, 8)).await.unwrap_err();
    assert_eq!(err, TallyError::AutoShardsUnsupported);
    assert!(tally.counter("c").await.is_err(), "nothing was created");
    tally.put_counter("c", SpecPatch::default()).await.unwrap();
    tally.shutdown().await.unwrap();
}
