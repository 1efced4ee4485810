//! t17: increments kept within bounds named with each increment (Redis's `INCREX`).
//! A new counter takes the bounds as its own and its escrow keeps them against any
//! number of concurrent writers; bounds a new counter cannot take (0 outside them)
//! are kept by the node's turns; `SATURATE` stops at the bound; a namespace's own
//! bounds serve the same way; and bounds that cannot hold are refused.

mod common;

use common::mem_engine;
use tally_core::namespace::NamespaceSpec;
use tally_core::within::{Within, WithinError};
use tally_engine::{Consistency, Durability, IncrTotal, SpecPatch, Tally, TallyError};

fn value(total: &IncrTotal) -> i128 {
    total.value().expect("a total")
}

async fn concurrently(tally: &Tally, name: &str, n: usize, delta: i64, within: Within) -> Vec<i64> {
    let tasks: Vec<_> = (0..n)
        .map(|_| {
            let (tally, name) = (tally.clone(), name.to_owned());
            tokio::spawn(async move { tally.incr_within(&name, delta, within).await.unwrap() })
        })
        .collect();
    let mut applied = Vec::new();
    for t in tasks {
        applied.push(t.await.unwrap().applied);
    }
    applied
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_rate_limit_counts_exactly_up_to_its_bound_under_concurrency() {
    let (tally, _) = mem_engine().await;
    let cap = Within::new(None, Some(10), false).unwrap();
    let applied = concurrently(&tally, "rl:user-1", 50, 1, cap).await;
    assert_eq!(applied.iter().sum::<i64>(), 10, "{applied:?}");
    assert_eq!(applied.iter().filter(|&&a| a == 1).count(), 10);
    let info = tally.counter("rl:user-1").await.unwrap();
    assert_eq!((info.spec.max, info.spec.min, info.spec.durability), (Some(10), None, Durability::Sync));
    // Once full: skipped, answered at the total, kept by the counter itself.
    let out = tally.incr_within("rl:user-1", 1, cap).await.unwrap();
    assert_eq!((value(&out.total), out.applied, out.kept_by_counter, out.exists), (10, 0, true, true));
    assert_eq!(tally.read("rl:user-1", Consistency::Fresh).await.unwrap().value, 10);
    // Another call's bounds are checked against both: the counter never passes 10.
    let looser = Within::new(None, Some(20), false).unwrap();
    let out = tally.incr_within("rl:user-1", 1, looser).await.unwrap();
    assert_eq!((value(&out.total), out.applied, out.kept_by_counter), (10, 0, false));
    let lower = Within::new(None, Some(20), false).unwrap();
    let out = tally.incr_within("rl:user-1", -4, lower).await.unwrap();
    assert_eq!((value(&out.total), out.applied), (6, -4));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn saturate_stops_at_the_bound_and_a_skip_creates_nothing() {
    let (tally, _) = mem_engine().await;
    let sat = Within::new(Some(0), Some(10), true).unwrap();
    let out = tally.incr_within("s:1", 8, sat).await.unwrap();
    assert_eq!((value(&out.total), out.applied, out.kept_by_counter), (8, 8, true));
    let out = tally.incr_within("s:1", 5, sat).await.unwrap();
    assert_eq!((value(&out.total), out.applied), (10, 2));
    let out = tally.incr_within("s:1", 5, sat).await.unwrap();
    assert_eq!((value(&out.total), out.applied), (10, 0));
    let out = tally.incr_within("s:1", -50, sat).await.unwrap();
    assert_eq!((value(&out.total), out.applied), (0, -10));
    // Concurrent saturating increments share the headroom exactly.
    let applied = concurrently(&tally, "s:2", 20, 3, sat).await;
    assert_eq!(applied.iter().sum::<i64>(), 10, "{applied:?}");
    // Out of bounds from the start: nothing is added and no counter appears.
    let skip = Within::new(None, Some(10), false).unwrap();
    let out = tally.incr_within("s:3", 11, skip).await.unwrap();
    assert_eq!((value(&out.total), out.applied, out.exists), (0, 0, false));
    assert!(matches!(tally.counter("s:3").await, Err(TallyError::NotFound(_))));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn bounds_a_new_counter_cannot_take_hold_among_this_nodes_calls() {
    let (tally, _) = mem_engine().await;
    let floor = Within::new(Some(5), None, false).unwrap();
    let out = tally.incr_within("f:1", 1, floor).await.unwrap();
    assert_eq!((value(&out.total), out.applied, out.exists), (0, 0, false));
    let out = tally.incr_within("f:1", 10, floor).await.unwrap();
    assert_eq!((value(&out.total), out.applied, out.kept_by_counter), (10, 10, false));
    let spec = tally.counter("f:1").await.unwrap().spec;
    assert_eq!((spec.min, spec.durability), (None, Durability::Batched), "created as an increment creates");
    let applied = concurrently(&tally, "f:1", 20, -1, floor).await;
    assert_eq!(applied.iter().sum::<i64>(), -5, "{applied:?}");
    assert_eq!(value(&tally.current_total("f:1").await.unwrap()), 5);
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_namespaces_own_bounds_keep_the_calls_and_bad_bounds_are_refused() {
    let (tally, _) = mem_engine().await;
    let ns = NamespaceSpec {
        patch: SpecPatch {
            durability: Some(Durability::Sync),
            max: Some(3),
            shards: Some(2),
            ..Default::default()
        },
        ..Default::default()
    };
    tally.put_namespace("quota:", ns).await.unwrap();
    let cap = Within::new(None, Some(3), false).unwrap();
    let applied = concurrently(&tally, "quota:a", 10, 1, cap).await;
    assert_eq!(applied.iter().sum::<i64>(), 3, "{applied:?}");
    let spec = tally.counter("quota:a").await.unwrap().spec;
    assert_eq!((spec.max, spec.shards), (Some(3), 2), "the namespace's spec, not the call's");
    assert!(tally.incr_within("quota:a", 1, cap).await.unwrap().kept_by_counter);
    assert_eq!(Within::new(Some(2), Some(1), false), Err(WithinError::Inverted { min: 2, max: 1 }));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_skip_is_told_apart_from_a_saturated_zero() {
    let (tally, _) = mem_engine().await;
    let sat = Within::new(None, Some(2), true).unwrap();
    tally.incr_within("z:1", 2, sat).await.unwrap();
    let at_bound = tally.incr_within("z:1", 1, sat).await.unwrap();
    assert_eq!((at_bound.applied, at_bound.skipped), (0, false));
    let skip = Within::new(None, Some(2), false).unwrap();
    let out = tally.incr_within("z:1", 1, skip).await.unwrap();
    assert_eq!((out.applied, out.skipped), (0, true));
    let zero = tally.incr_within("z:2", 0, Within::new(None, None, false).unwrap()).await.unwrap();
    assert_eq!((zero.applied, zero.skipped, zero.exists), (0, false, true));
    assert_eq!(value(&tally.current_total("z:2").await.unwrap()), 0);
}
