//! t60: reconciliation brings drift to zero, and the same correction applied twice
//! changes nothing (invariant 6).

mod common;

use common::*;
use std::sync::Arc;
use std::time::Duration;
use tally_engine::{
    AuthoritativeSource, Consistency, Durability, Increment, MemStore, SystemClock, Tally, TallyConfig,
    RECONCILE_DRIFT_ABS_MAX,
};

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn drift_goes_to_zero_and_a_second_reconcile_changes_nothing() {
    let (tally, _) = mem_engine().await;
    tally.put_counter("c", spec(8, Durability::Batched)).await.unwrap();
    for _ in 0..95 {
        tally.incr("c", Increment::new(1)).await.unwrap();
    }
    let r = tally.reconcile("c", 100).await.unwrap();
    assert_eq!((r.before, r.drift, r.corrected), (95, 5, true));
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, 100);
    let again = tally.reconcile("c", 100).await.unwrap();
    assert_eq!((again.before, again.drift, again.corrected), (100, 0, false));
    // Downwards, and up to the largest drift one reconciliation corrects.
    let r = tally.reconcile("c", -7).await.unwrap();
    assert_eq!(r.drift, -107);
    let far = -7 + RECONCILE_DRIFT_ABS_MAX;
    tally.reconcile("c", far).await.unwrap();
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, far);
    assert!(tally.reconcile("nope", 1).await.is_err());
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_correction_delivered_twice_counts_once() {
    // Two reconciliations that find the same total against the same authority write
    // the same correction id: the shard deduplicates the second.
    let (tally, _) = mem_engine().await;
    tally.put_counter("c", spec(4, Durability::Sync)).await.unwrap();
    tally.incr("c", Increment::new(10).event_id("x")).await.unwrap();
    let (a, b) = tokio::join!(tally.reconcile("c", 50), tally.reconcile("c", 50));
    let (a, b) = (a.unwrap(), b.unwrap());
    assert_eq!(a.drift + b.drift, 40, "{a:?} {b:?}");
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, 50);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_second_reconcile_to_the_same_total_from_the_same_sum_corrects_again() {
    // +10, brought to 5; +5 makes it 10 again: the second reconciliation finds the
    // same (authoritative, before) pair as the first, yet it is a new correction and
    // must change the value, not be dropped as a repeat of the first.
    let (tally, _) = mem_engine().await;
    tally.put_counter("c", spec(1, Durability::Sync)).await.unwrap();
    tally.incr("c", Increment::new(10).event_id("a")).await.unwrap();
    let first = tally.reconcile("c", 5).await.unwrap();
    assert_eq!((first.before, first.drift, first.corrected), (10, -5, true));
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, 5);
    tally.incr("c", Increment::new(5).event_id("b")).await.unwrap();
    let second = tally.reconcile("c", 5).await.unwrap();
    assert_eq!((second.before, second.drift, second.corrected), (10, -5, true));
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, 5, "corrected means changed");
    let third = tally.reconcile("c", 5).await.unwrap();
    assert_eq!((third.before, third.drift, third.corrected), (5, 0, false));
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_scheduled_instant_corrects_once_and_the_next_instant_again() {
    // Two nodes running the same scheduled instant (a leader change between them)
    // name one correction: the second run's is a duplicate and says it changed
    // nothing. The next instant is a correction of its own.
    let (tally, _) = mem_engine().await;
    tally.put_counter("c", spec(2, Durability::Sync)).await.unwrap();
    tally.incr("c", Increment::new(10).event_id("a")).await.unwrap();
    let first = tally.reconcile_scheduled("c", 5, "ledger", 60_000).await.unwrap();
    assert_eq!((first.before, first.drift, first.corrected), (10, -5, true));
    tally.incr("c", Increment::new(5).event_id("b")).await.unwrap();
    let again = tally.reconcile_scheduled("c", 5, "ledger", 60_000).await.unwrap();
    assert_eq!((again.before, again.drift, again.corrected), (10, -5, false), "written by the first run");
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, 10);
    let next = tally.reconcile_scheduled("c", 5, "ledger", 120_000).await.unwrap();
    assert_eq!((next.before, next.drift, next.corrected), (10, -5, true));
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, 5);
    assert_eq!(
        tally.stats().reconcile_corrections.get(),
        2,
        "a correction is counted when it changed the value"
    );
    tally.shutdown().await.unwrap();
}

struct Ledger;

impl AuthoritativeSource for Ledger {
    fn counters(&self) -> Vec<String> {
        vec!["ledger".into()]
    }
    fn total(&self, _counter: &str) -> Option<i128> {
        Some(1_000)
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn periodic_reconciliation_follows_the_authority() {
    let config =
        TallyConfig { reconcile_interval_ms: 50, authority: Some(Arc::new(Ledger)), ..quick_config() };
    let tally = Tally::open_with(Arc::new(MemStore::new()), Arc::new(SystemClock), config).await.unwrap();
    tally.put_counter("ledger", spec(4, Durability::Sync)).await.unwrap();
    tally.incr("ledger", Increment::new(1).event_id("a")).await.unwrap();
    let mut value = 0;
    for _ in 0..100 {
        tokio::time::sleep(Duration::from_millis(20)).await;
        value = tally.read("ledger", Consistency::Fresh).await.unwrap().value;
        // The correction is readable once applied; it is counted once durable.
        if value == 1_000 && tally.stats().reconcile_corrections.get() >= 1 {
            break;
        }
    }
    assert_eq!(value, 1_000);
    assert!(tally.stats().reconcile_corrections.get() >= 1);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_drift_beyond_the_bound_is_refused_whole_and_the_reconciler_lives_on() {
    let (tally, _) = mem_engine().await;
    tally.put_counter("c1", spec(4, Durability::Sync)).await.unwrap();
    tally.incr("c1", Increment::new(-5).event_id("e")).await.unwrap();
    // i128::MAX - (-5) does not fit 128 bits; 10^30 fits, but is no correction a
    // counter of i64 shards can take. Both are refused before anything is written.
    for authoritative in [i128::MAX, 10i128.pow(30), i128::MIN, -5 + RECONCILE_DRIFT_ABS_MAX + 1] {
        let err = tally.reconcile("c1", authoritative).await.unwrap_err();
        assert_eq!((err.http_status(), err.code()), (422, "drift_out_of_range"), "{authoritative}: {err}");
        assert_eq!(tally.read("c1", Consistency::Fresh).await.unwrap().value, -5);
    }
    // The reconciler still serves.
    let r = tally.reconcile("c1", 10).await.unwrap();
    assert_eq!((r.before, r.drift, r.corrected), (-5, 15, true));
    assert_eq!(tally.read("c1", Consistency::Fresh).await.unwrap().value, 10);
    tally.shutdown().await.unwrap();
}
