//! t72: per-item frequencies are counted on every shard, merged at read time, and
//! survive what shard values survive: a crash of the store (sync increments are
//! durable once acknowledged), a clean restart, and reshardings — one after another,
//! each carrying the sealed generation's sketches into the next exactly once.
//! Negative weights are refused on a frequency counter; reads of a counter without
//! frequencies say so.

mod common;

use common::*;
use std::collections::BTreeMap;
use tally_core::frequency::FrequencySpec;
use tally_engine::{Durability, Increment, SpecPatch, Tally};

const FREQ: FrequencySpec = FrequencySpec { epsilon: 0.001, delta: 0.01 };

/// Writes `rounds` increments over 40 items with skewed weights (item `k` gets
/// `1 + k % 3` per increment, and item `k` appears `40 / (k + 1)` times a round),
/// some with `member` instead of `item`; returns the true weights.
async fn write(tally: &Tally, name: &str, rounds: u32, truth: &mut BTreeMap<String, u64>) {
    for round in 0..rounds {
        for k in 0..40u32 {
            for j in 0..(40 / (k + 1)) {
                let item = format!("item-{k}");
                let weight = 1 + i64::from(k % 3);
                let inc = if (round + j) % 4 == 0 {
                    Increment::new(weight).member(item.clone())
                } else {
                    Increment::new(weight).item(item.clone())
                };
                let o = tally.incr(name, inc.writer(format!("w{j}"))).await.unwrap();
                assert!(o.applied);
                *truth.entry(item).or_default() += weight as u64;
            }
        }
    }
}

/// Every item's estimate is exact here (few items, a wide table: no collisions are
/// expected, and the check allows the stated bound anyway), and the top 5 is exact.
async fn check(tally: &Tally, name: &str, truth: &BTreeMap<String, u64>, phase: &str) {
    let total: u64 = truth.values().sum();
    for (item, &weight) in truth {
        let f = tally.frequency(name, item).await.unwrap();
        assert!(f.complete, "{phase}: {f:?}");
        assert_eq!(f.total, total, "{phase}: total weight");
        assert!(
            f.estimate >= weight && f.estimate - weight <= f.error_bound,
            "{phase}: {item} {f:?} vs {weight}"
        );
        assert!(f.lower_bound <= weight, "{phase}: {item} lower bound {f:?} vs {weight}");
        assert_eq!(f.confidence, 1.0 - FREQ.delta);
    }
    let mut exact: Vec<(&String, &u64)> = truth.iter().collect();
    exact.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
    let top = tally.top(name, 5).await.unwrap();
    assert!(top.complete, "{phase}");
    let got: Vec<&str> = top.items.iter().map(|e| e.item.as_str()).collect();
    let want: Vec<&str> = exact.iter().take(5).map(|(i, _)| i.as_str()).collect();
    assert_eq!(got, want, "{phase}: top 5");
    for e in &top.items {
        assert_eq!(e.lower_bound, truth[&e.item], "{phase}: fewer items than the summary keeps are exact");
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frequencies_survive_a_crash_a_restart_and_reshardings() {
    let (tally, store) = mem_engine().await;
    let patch = SpecPatch { frequency: Some(FREQ), ..spec(4, Durability::Sync) };
    tally.put_counter("f", patch).await.unwrap();
    let mut truth = BTreeMap::new();
    write(&tally, "f", 2, &mut truth).await;
    check(&tally, "f", &truth, "written").await;

    // A crash that loses every unflushed write: sync increments were flushed.
    tally.abort();
    let store = store.restart(0);
    let tally = reopen(&store).await;
    check(&tally, "f", &truth, "after a crash").await;

    for shards in [7u16, 2, 5] {
        tally.put_counter("f", SpecPatch { shards: Some(shards), ..Default::default() }).await.unwrap();
        tally.settle().await;
        let info = tally.counter("f").await.unwrap();
        assert_eq!((info.layout_shards, info.resharding), (shards, None));
        check(&tally, "f", &truth, &format!("resharded to {shards}")).await;
        write(&tally, "f", 1, &mut truth).await;
        check(&tally, "f", &truth, &format!("written after resharding to {shards}")).await;
    }

    tally.shutdown().await.unwrap();
    let tally = reopen(&store).await;
    check(&tally, "f", &truth, "after a clean restart").await;
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_items_take_the_direct_path_and_are_all_counted() {
    let (tally, _) = mem_engine().await;
    let patch = SpecPatch { frequency: Some(FREQ), ..spec(8, Durability::Batched) };
    tally.put_counter("b", patch).await.unwrap();
    let mut truth = BTreeMap::new();
    write(&tally, "b", 3, &mut truth).await;
    // Increments without an item still take the accumulator.
    for _ in 0..50 {
        tally.incr("b", Increment::new(1)).await.unwrap();
    }
    check(&tally, "b", &truth, "batched").await;
    let read = tally.read("b", tally_engine::Consistency::Fresh).await.unwrap();
    assert_eq!(read.value, i128::from(truth.values().sum::<u64>() as u32) + 50);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn negative_weights_and_reads_without_frequencies_are_refused() {
    let (tally, _) = mem_engine().await;
    let patch = SpecPatch { frequency: Some(FREQ), ..spec(2, Durability::Sync) };
    tally.put_counter("f", patch).await.unwrap();
    tally.incr("f", Increment::new(5).item("a")).await.unwrap();
    let err = tally.incr("f", Increment::new(-2).item("a")).await.unwrap_err();
    assert_eq!((err.code(), err.http_status()), ("negative_frequency_weight", 422), "{err}");
    let err = tally.incr("f", Increment::new(-2).member("a")).await.unwrap_err();
    assert_eq!(err.code(), "negative_frequency_weight");
    // Without an item a negative delta only changes the total.
    tally.incr("f", Increment::new(-1)).await.unwrap();
    assert_eq!(tally.read("f", tally_engine::Consistency::Fresh).await.unwrap().value, 4);
    assert_eq!(tally.frequency("f", "a").await.unwrap().estimate, 5);

    // The shape is fixed once set.
    let other =
        SpecPatch { frequency: Some(FrequencySpec { epsilon: 0.01, delta: 0.01 }), ..Default::default() };
    let err = tally.put_counter("f", other).await.unwrap_err();
    assert_eq!((err.code(), err.http_status()), ("invalid_spec", 422), "{err}");
    let too_big =
        SpecPatch { frequency: Some(FrequencySpec { epsilon: 1e-4, delta: 1e-6 }), ..Default::default() };
    let err = tally.put_counter("g", too_big).await.unwrap_err();
    assert!(err.to_string().contains("raise epsilon or delta"), "{err}");

    // Negative deltas with a member stay fine on a counter without frequencies.
    tally.put_counter("plain", spec(2, Durability::Sync)).await.unwrap();
    tally.incr("plain", Increment::new(-1).member("a")).await.unwrap();
    let err = tally.frequency("plain", "a").await.unwrap_err();
    assert_eq!((err.code(), err.http_status()), ("frequency_off", 409), "{err}");
    let err = tally.top("f", 0).await.unwrap_err();
    assert_eq!((err.code(), err.http_status()), ("invalid_k", 400));
    assert!(tally.top("f", tally_core::frequency::TOP_K_MAX + 1).await.is_err());
    let err = tally.frequency("f", &"x".repeat(2000)).await.unwrap_err();
    assert_eq!(err.http_status(), 400);
    tally.shutdown().await.unwrap();
}
