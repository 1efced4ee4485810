//! t13: what an increment that answers its total (`Tally::incr_value`, Redis's
//! `INCR`) answers — the counter's total right after it, including it and every
//! increment this node acknowledged before it, each once. One client's increments
//! answer 1, 2, 3, … on every durability; a `sync` counter of one shard answers the
//! value its commit gave each increment, unique and gap-free however many
//! increments run at once; and answers start from what the counter already holds
//! (after a restart, a correction, increments that answered nothing).

mod common;

use common::{mem_engine, reopen, spec};
use tally_engine::{Durability, IncrTotal, Increment, SpecPatch, Tally, Total};

/// The total `incr_value` answers for one increment of `delta`, which must be exact
/// (a single engine knows every increment).
async fn incr(tally: &Tally, name: &str, delta: i64) -> i128 {
    let (outcome, total) = tally.incr_value(name, Increment::new(delta)).await.unwrap();
    assert!(outcome.applied);
    match total {
        IncrTotal::Total(Total { value, exact: true }) => value,
        other => panic!("{name} += {delta}: {other:?}"),
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_client_counts_one_two_three_on_every_durability() {
    let (tally, _) = mem_engine().await;
    // A new counter, created by its first increment (batched, 8 shards).
    let mut got = Vec::new();
    for _ in 0..5 {
        got.push(incr(&tally, "fresh:a", 1).await);
    }
    assert_eq!(got, [1, 2, 3, 4, 5]);
    // INCR, INCRBY 10, DECR, DECRBY 3.
    let mut got = Vec::new();
    for delta in [1, 10, -1, -3] {
        got.push(incr(&tally, "mixed", delta).await);
    }
    assert_eq!(got, [1, 11, 10, 7]);
    // A sync counter of eight shards, and one of a single shard.
    tally.put_counter("sync:8", spec(8, Durability::Sync)).await.unwrap();
    tally.put_counter("sync:1", spec(1, Durability::Sync)).await.unwrap();
    for name in ["sync:8", "sync:1"] {
        let mut got = Vec::new();
        for _ in 0..20 {
            got.push(incr(&tally, name, 1).await);
        }
        assert_eq!(got, (1..=20).collect::<Vec<i128>>(), "{name}");
    }
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_thousand_increments_in_a_row_answer_a_thousand_totals_while_drains_run() {
    let (tally, _) = mem_engine().await;
    // Drained every millisecond: sums leave the slots while the answers go on.
    let patch = SpecPatch { flush_ms: Some(1), rollup_ms: Some(10), ..SpecPatch::default() };
    tally.put_counter("views", patch).await.unwrap();
    let mut got = Vec::with_capacity(1000);
    for i in 0..1000 {
        got.push(incr(&tally, "views", 1).await);
        if i % 100 == 0 {
            // Let the aggregator drain meanwhile.
            tokio::time::sleep(std::time::Duration::from_millis(3)).await;
        }
    }
    assert_eq!(got, (1..=1000).collect::<Vec<i128>>());
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_one_shard_sync_counter_answers_unique_gap_free_values_under_concurrency() {
    let (tally, _) = mem_engine().await;
    tally.put_counter("ids", spec(1, Durability::Sync)).await.unwrap();
    const TASKS: usize = 16;
    const EACH: usize = 50;
    let tasks: Vec<_> = (0..TASKS)
        .map(|_| {
            let t = tally.clone();
            tokio::spawn(async move {
                let mut got = Vec::with_capacity(EACH);
                for _ in 0..EACH {
                    got.push(incr(&t, "ids", 1).await);
                }
                got
            })
        })
        .collect();
    let mut all = Vec::new();
    for t in tasks {
        let got = t.await.unwrap();
        assert!(got.windows(2).all(|w| w[0] < w[1]), "one client's answers rise: {got:?}");
        all.extend(got);
    }
    all.sort_unstable();
    assert_eq!(all, (1..=(TASKS * EACH) as i128).collect::<Vec<_>>(), "every id issued once");
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_answers_of_a_sharded_counter_include_everything_before_them() {
    let (tally, _) = mem_engine().await;
    tally.put_counter("sharded", spec(8, Durability::Sync)).await.unwrap();
    tally.put_counter("buffered", SpecPatch { flush_ms: Some(2), ..SpecPatch::default() }).await.unwrap();
    for name in ["sharded", "buffered"] {
        const TASKS: usize = 8;
        const EACH: usize = 40;
        let tasks: Vec<_> = (0..TASKS)
            .map(|_| {
                let t = tally.clone();
                tokio::spawn(async move {
                    let mut got = Vec::with_capacity(EACH);
                    for _ in 0..EACH {
                        got.push(incr(&t, name, 1).await);
                    }
                    got
                })
            })
            .collect();
        for t in tasks {
            let got = t.await.unwrap();
            // Each answer holds this task's earlier increments and itself; never more
            // than was counted in all.
            for (i, v) in got.iter().enumerate() {
                assert!(*v > i as i128 && *v <= (TASKS * EACH) as i128, "{name}: {got:?}");
            }
            assert!(got.windows(2).all(|w| w[0] < w[1]), "{name}: one client's answers rise: {got:?}");
        }
        assert_eq!(incr(&tally, name, 1).await, (TASKS * EACH) as i128 + 1, "{name}");
    }
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn answers_start_from_what_the_counter_holds() {
    let (tally, store) = mem_engine().await;
    // Increments that answered nothing (HTTP, a batch) count in the next answer.
    for _ in 0..3 {
        tally.incr("quiet", Increment::new(1)).await.unwrap();
    }
    tally.incr_many(vec![("quiet".into(), Increment::new(5))]).await.unwrap();
    assert_eq!(incr(&tally, "quiet", 1).await, 9);
    tally.put_counter("money", spec(4, Durability::Sync)).await.unwrap();
    tally.incr("money", Increment::new(100).event_id("e-1")).await.unwrap();
    assert_eq!(incr(&tally, "money", 1).await, 101);
    // A correction moves the answers with it.
    tally.reconcile("money", 500).await.unwrap();
    assert_eq!(incr(&tally, "money", 1).await, 501);
    tally.shutdown().await.unwrap();
    drop(tally);
    // A restarted engine reads what the counters hold before it answers.
    let tally = reopen(&store).await;
    assert_eq!(incr(&tally, "quiet", 1).await, 10);
    assert_eq!(incr(&tally, "money", -1).await, 500);
    tally.shutdown().await.unwrap();
}
