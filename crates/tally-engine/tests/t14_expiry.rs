//! t14: counters that expire, as Redis's `EXPIRE` family states it. A deadline is
//! set under `NX`/`XX`/`GT`/`LT`, survives a restart, and from its instant on the
//! counter is missing for every read while a write creates it anew from zero; a
//! deadline already passed deletes at once; and the sweep reclaims an expired
//! counter's metadata and shard data within its interval.

mod common;

use common::{quick_config, spec};
use std::sync::Arc;
use std::time::Duration;
use tally_core::expiry::Condition;
use tally_engine::{
    Clock, Consistency, Durability, IncrTotal, Increment, ManualClock, MemStore, Store, Tally, TallyConfig,
    TallyError,
};

const START_MS: u64 = 1_700_000_000_000;
/// How often the engines of these tests sweep for expired counters.
const SWEEP_MS: u64 = 20;

fn config() -> TallyConfig {
    TallyConfig { expiry_sweep_ms: SWEEP_MS, ..quick_config() }
}

async fn engine(store: &MemStore, clock: &ManualClock) -> Tally {
    let c: Arc<dyn Clock> = Arc::new(clock.clone());
    Tally::open_with(Arc::new(store.clone()), c, config()).await.unwrap()
}

async fn total(tally: &Tally, name: &str, delta: i64) -> i128 {
    match tally.incr_value(name, Increment::new(delta)).await.unwrap().1 {
        IncrTotal::Total(t) => t.value,
        other => panic!("{other:?}"),
    }
}

fn missing<T: std::fmt::Debug>(r: Result<T, TallyError>) -> bool {
    matches!(r, Err(TallyError::NotFound(_)))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_counter_is_gone_from_its_deadline_and_a_write_starts_it_anew() {
    let (store, clock) = (MemStore::new(), ManualClock::new(START_MS));
    let tally = engine(&store, &clock).await;
    // The fixed-window limiter: INCR, then EXPIRE.
    assert_eq!(total(&tally, "rl:u1", 1).await, 1);
    assert!(tally.expire("rl:u1", START_MS + 60_000, Condition::Always).await.unwrap());
    assert_eq!(total(&tally, "rl:u1", 1).await, 2, "the deadline keeps the value");
    assert_eq!(tally.expiry("rl:u1").await.unwrap(), (Some(START_MS + 60_000), START_MS));
    assert_eq!(tally.counter("rl:u1").await.unwrap().expires_at_ms, Some(START_MS + 60_000));
    clock.advance(59_999);
    assert_eq!(tally.read("rl:u1", Consistency::Fresh).await.unwrap().value, 2);
    clock.advance(1);
    // From the deadline on: missing for every read.
    assert!(missing(tally.read("rl:u1", Consistency::Fresh).await));
    assert!(missing(tally.read("rl:u1", Consistency::Cached).await));
    assert!(missing(tally.counter("rl:u1").await));
    assert!(missing(tally.current_total("rl:u1").await));
    assert!(missing(tally.expiry("rl:u1").await));
    assert!(missing(tally.expire("rl:u1", START_MS + 120_000, Condition::Always).await));
    // A write creates it anew, from zero and without a deadline.
    assert_eq!(total(&tally, "rl:u1", 1).await, 1);
    assert_eq!(tally.expiry("rl:u1").await.unwrap().0, None);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn conditions_persist_and_a_passed_deadline_decide_as_redis_does() {
    let (store, clock) = (MemStore::new(), ManualClock::new(START_MS));
    let tally = engine(&store, &clock).await;
    tally.put_counter("c", spec(4, Durability::Sync)).await.unwrap();
    tally.incr("c", Increment::new(5)).await.unwrap();
    let at = |s: u64| START_MS + s * 1000;
    assert!(!tally.expire("c", at(10), Condition::Xx).await.unwrap(), "XX needs a deadline");
    assert!(
        !tally.expire("c", at(10), Condition::Gt).await.unwrap(),
        "GT never sets one on a counter without"
    );
    assert!(tally.expire("c", at(10), Condition::Nx).await.unwrap());
    assert!(!tally.expire("c", at(20), Condition::Nx).await.unwrap());
    assert!(!tally.expire("c", at(5), Condition::Gt).await.unwrap());
    assert!(tally.expire("c", at(5), Condition::Lt).await.unwrap());
    assert!(tally.expire("c", at(5), Condition::Always).await.unwrap(), "the same deadline is set");
    assert!(tally.persist("c").await.unwrap());
    assert!(!tally.persist("c").await.unwrap(), "nothing to remove");
    assert!(missing(tally.persist("nope").await));
    assert!(missing(tally.expire("nope", at(5), Condition::Always).await));
    // A deadline already passed deletes at once.
    assert!(tally.expire("c", START_MS - 1, Condition::Always).await.unwrap());
    assert!(missing(tally.counter("c").await));
    assert!(missing(tally.delete_counter("c").await));
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deadline_survives_a_restart_and_the_sweep_reclaims_what_expired() {
    let (store, clock) = (MemStore::new(), ManualClock::new(START_MS));
    let tally = engine(&store, &clock).await;
    tally.put_counter("keep", spec(2, Durability::Sync)).await.unwrap();
    tally.put_counter("go", spec(2, Durability::Sync)).await.unwrap();
    for name in ["keep", "go"] {
        for _ in 0..10 {
            tally.incr(name, Increment::new(1)).await.unwrap();
        }
    }
    assert!(tally.expire("go", START_MS + 1_000, Condition::Always).await.unwrap());
    assert!(tally.expire("keep", START_MS + 600_000, Condition::Always).await.unwrap());
    tally.shutdown().await.unwrap();
    drop(tally);
    let tally = engine(&store, &clock).await;
    assert_eq!(tally.expiry("go").await.unwrap().0, Some(START_MS + 1_000), "durable like the spec");
    let shards_of = |name: &str| {
        store.shard_ids(None, 1_000).unwrap().into_iter().filter(|id| id.counter.as_str() == name).count()
    };
    assert!(shards_of("go") > 0);
    clock.advance(1_000);
    // Within a few sweeps its metadata and its shards' data are gone; the other stays.
    let deadline = tokio::time::Instant::now() + Duration::from_millis(100 * SWEEP_MS);
    while tally.list_counters("", None, 10).unwrap().counters.iter().any(|n| n == "go") || shards_of("go") > 0
    {
        assert!(tokio::time::Instant::now() < deadline, "not reclaimed within 100 sweeps");
        tokio::time::sleep(Duration::from_millis(SWEEP_MS)).await;
    }
    assert_eq!(tally.stats().expired_reclaimed.get(), 1);
    assert_eq!(tally.read("keep", Consistency::Fresh).await.unwrap().value, 10);
    assert!(shards_of("keep") > 0);
    tally.shutdown().await.unwrap();
}
