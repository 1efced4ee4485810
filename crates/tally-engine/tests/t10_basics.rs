//! t10: the embedded API's everyday contract — create, update, increment, read,
//! delete — and the clear errors for bad input (invariant 8).

mod common;

use common::*;
use tally_engine::{Consistency, Durability, Increment, SpecPatch, TallyError};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_increment_to_an_unknown_counter_creates_it_with_the_defaults() {
    let (tally, _) = mem_engine().await;
    assert!(matches!(tally.read("likes:1", Consistency::Fresh).await, Err(TallyError::NotFound(_))));
    assert!(tally.incr("likes:1", Increment::new(1)).await.unwrap().applied);
    let info = tally.counter("likes:1").await.unwrap();
    assert_eq!(info.spec, tally_engine::CounterSpec::default());
    assert_eq!(tally.read("likes:1", Consistency::Fresh).await.unwrap().value, 1);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn put_creates_then_updates() {
    let (tally, _) = mem_engine().await;
    let created = tally.put_counter("c", spec(4, Durability::Sync)).await.unwrap();
    assert!(created.created);
    assert_eq!(created.counter.spec.shards, 4);
    let updated =
        tally.put_counter("c", SpecPatch { rollup_ms: Some(0), ..Default::default() }).await.unwrap();
    assert!(!updated.created);
    assert_eq!((updated.counter.spec.rollup_ms, updated.counter.spec.durability), (0, Durability::Sync));
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn batched_and_sync_counters_sum_positive_and_negative_deltas_exactly() {
    let (tally, _) = mem_engine().await;
    for (name, d) in [("b", Durability::Batched), ("s", Durability::Sync)] {
        tally.put_counter(name, spec(8, d)).await.unwrap();
        let mut tasks = Vec::new();
        for w in 0..16 {
            let t = tally.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0..200i64 {
                    let delta = if i % 3 == 0 { -2 } else { 5 };
                    t.incr(name, Increment::new(delta).writer(format!("w{w}"))).await.unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        // Per writer: 67 times -2 and 133 times +5.
        let want = 16 * (67 * -2 + 133 * 5);
        assert_eq!(tally.read(name, Consistency::Fresh).await.unwrap().value, want, "{name}");
    }
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bad_input_gets_a_clear_error_and_changes_nothing() {
    let (tally, _) = mem_engine().await;
    tally.incr("ok", Increment::new(1)).await.unwrap();
    // The engine takes names in their escaped form (`tally_core::name`).
    let long = "x".repeat(tally_core::name::NAME_BYTES_MAX + 1);
    let cases: Vec<(&str, Increment, &str)> = vec![
        ("ok", Increment::new(0), "invalid_delta"),
        ("", Increment::new(1), "invalid_name"),
        ("has space", Increment::new(1), "invalid_name"),
        ("a%2f", Increment::new(1), "invalid_name"),
        (&long, Increment::new(1), "invalid_name"),
        ("ok", Increment::new(1).event_id("bad id"), "invalid_name"),
        ("ok", Increment::new(1).event_id("e".repeat(256)), "invalid_name"),
        ("ok", Increment::new(1).member("m".repeat(1025)), "invalid_name"),
    ];
    for (name, inc, code) in cases {
        let err = tally.incr(name, inc.clone()).await.unwrap_err();
        assert_eq!(err.code(), code, "{name:?} {inc:?}: {err}");
        assert_eq!(err.http_status(), 400);
    }
    let err = tally.put_counter("ok", SpecPatch { shards: Some(0), ..Default::default() }).await.unwrap_err();
    assert_eq!((err.code(), err.http_status()), ("invalid_spec", 422));
    let err =
        tally.put_counter("ok", SpecPatch { shards: Some(1025), ..Default::default() }).await.unwrap_err();
    assert_eq!(err.http_status(), 422);
    assert_eq!(tally.read("ok", Consistency::Fresh).await.unwrap().value, 1);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn totals_never_wrap() {
    let (tally, _) = mem_engine().await;
    tally.put_counter("big", spec(1, Durability::Batched)).await.unwrap();
    let huge = tally_core::limits::SHARD_VALUE_ABS_MAX;
    tally.incr("big", Increment::new(huge)).await.unwrap();
    let err = tally.incr("big", Increment::new(1)).await.unwrap_err();
    assert_eq!((err.code(), err.http_status()), ("overflow", 422));
    let err = tally.incr("big", Increment::new(i64::MAX)).await.unwrap_err();
    assert_eq!(err.code(), "overflow");
    // Moving back towards zero is always allowed.
    tally.incr("big", Increment::new(-1)).await.unwrap();
    assert_eq!(tally.read("big", Consistency::Fresh).await.unwrap().value, i128::from(huge) - 1);
    // Many shards near the limit add up beyond i64 without wrapping.
    tally.put_counter("wide", spec(4, Durability::Sync)).await.unwrap();
    // One event id per shard, so each shard takes one huge delta.
    let mut ids: Vec<String> = Vec::new();
    for i in 0.. {
        let id = format!("e{i}");
        let shard = tally_core::router::shard_of_event(&id, 4);
        if !ids.iter().any(|x| tally_core::router::shard_of_event(x, 4) == shard) {
            ids.push(id);
        }
        if ids.len() == 4 {
            break;
        }
    }
    for id in ids {
        tally.incr("wide", Increment::new(huge).event_id(id)).await.unwrap();
    }
    let total = tally.read("wide", Consistency::Fresh).await.unwrap().value;
    assert!(total > i128::from(i64::MAX), "{total}");
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn delete_removes_the_counter_and_its_data() {
    let (tally, _) = mem_engine().await;
    tally.put_counter("gone", spec(4, Durability::Sync)).await.unwrap();
    tally.incr("gone", Increment::new(7).event_id("e1")).await.unwrap();
    tally.delete_counter("gone").await.unwrap();
    assert!(matches!(tally.read("gone", Consistency::Fresh).await, Err(TallyError::NotFound(_))));
    assert!(matches!(tally.delete_counter("gone").await, Err(TallyError::NotFound(_))));
    // Recreated, it starts from zero and has forgotten its event ids.
    assert!(tally.incr("gone", Increment::new(7).event_id("e1")).await.unwrap().applied);
    assert_eq!(tally.read("gone", Consistency::Fresh).await.unwrap().value, 7);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_answers_each_item_in_order() {
    let (tally, _) = mem_engine().await;
    let items = vec![
        ("a".to_string(), Increment::new(1).event_id("x")),
        ("a".to_string(), Increment::new(1).event_id("x")),
        ("b".to_string(), Increment::new(0)),
        ("b".to_string(), Increment::new(3)),
    ];
    let out = tally.incr_many(items).await.unwrap();
    assert_eq!(out.len(), 4);
    let applied: Vec<_> = out.iter().map(|r| r.as_ref().map(|o| o.applied).map_err(|e| e.code())).collect();
    // The two "x" items race; exactly one applies.
    assert_eq!(applied.iter().filter(|r| **r == Ok(true)).count(), 2);
    assert_eq!(applied[2], Err("invalid_delta"));
    assert_eq!(tally.read("a", Consistency::Fresh).await.unwrap().value, 1);
    let too_many = (0..10_001).map(|_| ("a".to_string(), Increment::new(1))).collect();
    assert_eq!(tally.incr_many(too_many).await.unwrap_err().http_status(), 413);
    tally.shutdown().await.unwrap();
}
