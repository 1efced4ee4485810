//! t44: windowed counters through the engine, with time driven by a manual clock.
//!
//! Every increment is stamped by the shard with the engine's clock when it is applied;
//! the test knows each increment's time, so it can compute what a window read must
//! answer: the exact sum over the span the read names, which is the nominal window
//! less at most its oldest bucket.

mod common;

use common::{quick_config, spec};
use std::sync::Arc;
use tally_core::sketch::DistinctSketch;
use tally_core::window::WindowSet;
use tally_engine::{Clock, Durability, Increment, ManualClock, MemStore, SpecPatch, Tally, TallyError};

const MIN: u64 = 60_000;
/// An instant not on any bucket edge.
const T0: u64 = 1_764_000_000_000 + 12_345;

fn windowed(shards: u16, durability: Durability, distinct: bool) -> SpecPatch {
    SpecPatch {
        windows: Some(WindowSet::parse(&["1m", "1h"]).unwrap()),
        distinct: Some(distinct),
        ..spec(shards, durability)
    }
}

async fn engine(store: &MemStore, clock: &ManualClock) -> Tally {
    let c: Arc<dyn Clock> = Arc::new(clock.clone());
    Tally::open_with(Arc::new(store.clone()), c, quick_config()).await.unwrap()
}

/// The sum of the deltas stamped in `[from, to]`.
fn sum_in(history: &[(u64, i64)], from: u64, to: u64) -> i128 {
    history.iter().filter(|(t, _)| *t >= from && *t <= to).map(|(_, d)| i128::from(*d)).sum()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_total_is_the_exact_sum_of_its_span_within_one_bucket_of_the_nominal_window() {
    for durability in [Durability::Sync, Durability::Batched] {
        let (store, clock) = (MemStore::new(), ManualClock::new(T0));
        let tally = engine(&store, &clock).await;
        tally.put_counter("w", windowed(4, durability, false)).await.unwrap();
        let mut history: Vec<(u64, i64)> = Vec::new();
        // Three minutes of increments 337 ms apart, each with its own delta; a read
        // after every seventh, across every bucket edge of the one-minute window.
        for i in 0..540u64 {
            let delta = (i % 11) as i64 - 3;
            let delta = if delta == 0 { 5 } else { delta };
            tally.incr("w", Increment::new(delta).writer(format!("w{}", i % 6))).await.unwrap();
            if durability == Durability::Batched {
                // A fresh read delivers the buffered increments now, so they are
                // stamped at this instant.
                tally.window("w", "1h").await.unwrap();
            }
            history.push((clock.now_ms(), delta));
            if i % 7 == 0 {
                let now = clock.now_ms();
                let r = tally.window("w", "1m").await.unwrap();
                assert_eq!((r.window.as_str(), r.window_ms, r.bucket_ms), ("1m", MIN, 1_000));
                assert_eq!(r.end_ms, now);
                assert_eq!(
                    r.start_ms,
                    (now / 1_000).saturating_sub(59) * 1_000,
                    "59 whole buckets and this one"
                );
                assert!(r.complete, "{r:?}");
                assert_eq!(r.value, sum_in(&history, r.start_ms, r.end_ms), "{durability:?} at {now}: {r:?}");
                // Against the nominal window [now - 1m, now]: short only by what the
                // oldest bucket held before the span starts.
                let nominal = sum_in(&history, now - MIN, now);
                let edge = sum_in(&history, now - MIN, r.start_ms.saturating_sub(1));
                assert_eq!(nominal - r.value, edge);
                assert!(r.start_ms - (now - MIN) < r.bucket_ms, "the edge is less than one bucket");
                // The hour window still holds everything.
                let h = tally.window("w", "60m").await.unwrap();
                assert_eq!((h.window.as_str(), h.value), ("1h", sum_in(&history, 0, now)));
                assert!(h.window_bytes > 0 && h.window_bytes <= h.window_bytes_bound, "{h:?}");
            }
            clock.advance(337);
        }
        // Unknown windows are refused with their code.
        for asked in ["24h", "", "soon"] {
            let e = tally.window("w", asked).await.unwrap_err();
            assert!(matches!(e, TallyError::Window(_)), "{e:?}");
            assert_eq!((e.code(), e.http_status()), ("unknown_window", 400));
        }
        // The buckets outlive a restart.
        let before = tally.window("w", "1m").await.unwrap();
        tally.shutdown().await.unwrap();
        let again = engine(&store, &clock).await;
        assert_eq!(again.window("w", "1m").await.unwrap(), before, "{durability:?}");
        // Long after the last increment the window is empty; the total is not.
        clock.advance(2 * MIN);
        assert_eq!(again.window("w", "1m").await.unwrap().value, 0);
        assert_eq!(again.window("w", "1h").await.unwrap().value, sum_in(&history, 0, u64::MAX));
        again.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_window_distinct_stays_within_the_sketch_bound_and_survives_a_resharding() {
    let (store, clock) = (MemStore::new(), ManualClock::new(T0));
    let tally = engine(&store, &clock).await;
    tally.put_counter("u", windowed(4, Durability::Sync, true)).await.unwrap();
    // Two thousand members a minute for three minutes, each minute's members new.
    let mut seen: Vec<(u64, u32)> = Vec::new();
    for i in 0..6_000u32 {
        tally.incr("u", Increment::new(1).member(format!("user-{i}"))).await.unwrap();
        seen.push((clock.now_ms(), i));
        clock.advance(30);
    }
    let check = |r: &tally_engine::WindowRead, seen: &[(u64, u32)]| {
        let exact = seen.iter().filter(|(t, _)| *t >= r.start_ms && *t <= r.end_ms).count() as f64;
        let estimate = r.estimate.expect("a distinct counter's window has an estimate") as f64;
        let bound = 4.0 * DistinctSketch::relative_error() * exact;
        assert!((estimate - exact).abs() <= bound.max(2.0), "estimate {estimate}, exact {exact}");
        assert_eq!(r.relative_error, Some(DistinctSketch::relative_error()));
        assert_eq!(r.value as f64, exact, "each member came once, with delta 1");
    };
    let minute = tally.window("u", "1m").await.unwrap();
    check(&minute, &seen);
    let hour = tally.window("u", "1h").await.unwrap();
    check(&hour, &seen);
    assert!(hour.window_bytes <= hour.window_bytes_bound);
    // A resharding carries the buckets into the next generation.
    tally.put_counter("u", SpecPatch { shards: Some(2), ..Default::default() }).await.unwrap();
    tally.settle().await;
    assert_eq!(tally.shards("u").await.unwrap().shards.len(), 2);
    let after = tally.window("u", "1h").await.unwrap();
    assert_eq!((after.value, after.estimate), (hour.value, hour.estimate), "carried once, exactly");
    tally.incr("u", Increment::new(1).member("user-0")).await.unwrap();
    assert_eq!(tally.window("u", "1h").await.unwrap().value, hour.value + 1);
    // Changing the windows keeps the buckets of those that stay.
    let patch = SpecPatch { windows: Some(WindowSet::parse(&["1h", "24h"]).unwrap()), ..Default::default() };
    tally.put_counter("u", patch).await.unwrap();
    assert_eq!(tally.window("u", "1h").await.unwrap().value, hour.value + 1);
    assert_eq!(tally.window("u", "1m").await.unwrap_err().code(), "unknown_window");
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counter_without_windows_answers_none() {
    let (store, clock) = (MemStore::new(), ManualClock::new(T0));
    let tally = engine(&store, &clock).await;
    tally.incr("plain", Increment::new(1)).await.unwrap();
    let e = tally.window("plain", "1m").await.unwrap_err();
    assert_eq!(e.code(), "unknown_window");
    assert!(e.to_string().contains("keeps no window"), "{e}");
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_of_format_3_opens_with_counters_without_windows() {
    use tally_core::codec::encode;
    use tally_core::format::v3::{CounterMetaV3, CounterSpecV3};
    use tally_core::format::{encode_version, STORE_FORMAT};
    use tally_core::meta::Layout;
    use tally_engine::{Consistency, RouterPolicy, Store, STORE_FORMAT_KEY};
    // The records a format-3 release left: an opened store with one counter whose
    // sealed generations summed to 5.
    let (store, clock) = (MemStore::new(), ManualClock::new(T0));
    Store::meta_put(&store, b"engine:opens", &1u64.to_be_bytes()).unwrap();
    Store::meta_put(&store, STORE_FORMAT_KEY, &encode_version(3)).unwrap();
    let spec = CounterSpecV3 {
        shards: 4,
        durability: Durability::Sync,
        flush_ms: 200,
        rollup_ms: 0,
        router: RouterPolicy::Writer,
        distinct: false,
        dedup_window_s: 60,
        frequency: None,
    };
    let layout = Layout { generation: 1, shards: 4, base: 5, sealed: vec![], resharding: None };
    let meta = CounterMetaV3 { spec, layout, created_at_ms: T0, version: 3 };
    Store::meta_put(&store, b"counter/old", &encode(&meta)).unwrap();
    let tally = engine(&store, &clock).await;
    let info = tally.counter("old").await.unwrap();
    assert_eq!((info.spec.shards, info.spec.windows, info.generation), (4, WindowSet::NONE, 1));
    assert_eq!(tally.read("old", Consistency::Fresh).await.unwrap().value, 5);
    let marker = Store::meta_get(&store, STORE_FORMAT_KEY).unwrap();
    assert_eq!(marker.as_deref(), Some(&encode_version(STORE_FORMAT)[..]), "marked with today's format");
    // The upgraded counter takes windows like any other.
    let patch = SpecPatch { windows: Some(WindowSet::parse(&["1m"]).unwrap()), ..Default::default() };
    tally.put_counter("old", patch).await.unwrap();
    tally.incr("old", Increment::new(2)).await.unwrap();
    assert_eq!(tally.window("old", "1m").await.unwrap().value, 2);
    assert_eq!(tally.read("old", Consistency::Fresh).await.unwrap().value, 7);
    tally.shutdown().await.unwrap();
}
