//! t32: per-writer sequence numbers: a writer's increments are idempotent by sequence.
//! The shard keeps one high-water mark per writer (a dedup record under the writer's
//! mark id); a retried sequence is a duplicate, one beyond the next is refused as out
//! of order, and the mark survives a crash and a resharding like an event id's record.

mod common;

use common::*;
use tally_core::dedup::mark_id;
use tally_core::ShardId;
use tally_engine::{Consistency, Durability, Increment, MemStore, SpecPatch, Store, Tally};

fn seq(writer: &str, n: u64) -> Increment {
    Increment::new(1).sequenced(writer, n)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn retried_sequences_are_duplicates_and_gaps_are_refused() {
    let (tally, _) = mem_engine().await;
    for d in [Durability::Sync, Durability::Batched] {
        let name = format!("c-{d}");
        tally.put_counter(&name, spec(16, d)).await.unwrap();
        for n in 1..=20 {
            let o = tally.incr(&name, seq("w", n)).await.unwrap();
            assert!(o.applied && !o.duplicate, "seq {n}");
        }
        for n in [20, 5, 1] {
            let o = tally.incr(&name, seq("w", n)).await.unwrap();
            assert!(!o.applied && o.duplicate, "retry of {n}");
        }
        let err = tally.incr(&name, seq("w", 22)).await.unwrap_err();
        assert_eq!((err.code(), err.http_status(), err.retryable()), ("out_of_order_sequence", 409, true));
        assert!(err.to_string().contains("next sequence this counter takes from it is 21"), "{err}");
        assert!(tally.incr(&name, seq("w", 21)).await.unwrap().applied);
        // Another writer has a mark of its own, starting wherever it starts.
        assert!(tally.incr(&name, seq("v", 1_000)).await.unwrap().applied);
        assert!(tally.incr(&name, seq("v", 1_000)).await.unwrap().duplicate);
        assert_eq!(tally.read(&name, Consistency::Fresh).await.unwrap().value, 22);
    }
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn malformed_sequences_are_refused() {
    let (tally, _) = mem_engine().await;
    tally.put_counter("c", spec(4, Durability::Sync)).await.unwrap();
    let no_writer = Increment { seq: Some(1), ..Increment::new(1) };
    let both = seq("w", 1).event_id("e");
    let too_big = seq("w", u64::MAX);
    for inc in [no_writer, both, too_big] {
        let err = tally.incr("c", inc.clone()).await.unwrap_err();
        assert_eq!(
            (err.code(), err.http_status(), err.retryable()),
            ("invalid_sequence", 400, false),
            "{inc:?}"
        );
    }
    assert!(tally.incr("c", seq("w", i64::MAX as u64)).await.unwrap().applied);
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, 1);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_batch_applies_a_writers_sequences_in_order() {
    let (tally, _) = mem_engine().await;
    tally.put_counter("c", spec(8, Durability::Sync)).await.unwrap();
    // Three writers interleaved, each in order, plus a retry and a gap.
    let mut items: Vec<(String, Increment)> = Vec::new();
    for n in 1..=30u64 {
        for w in ["a", "b", "c"] {
            items.push(("c".into(), seq(w, n)));
        }
    }
    items.push(("c".into(), seq("a", 30)));
    items.push(("c".into(), seq("b", 99)));
    let results = tally.incr_many(items).await.unwrap();
    assert!(results[..90].iter().all(|r| r.as_ref().is_ok_and(|o| o.applied)), "{results:?}");
    assert!(results[90].as_ref().unwrap().duplicate);
    assert_eq!(results[91].as_ref().unwrap_err().code(), "out_of_order_sequence");
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, 90);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn marks_survive_a_crash_and_keep_one_record_per_writer() {
    let (tally, mut store) = mem_engine().await;
    tally.put_counter("c", spec(4, Durability::Sync)).await.unwrap();
    for n in 1..=50 {
        assert!(tally.incr("c", seq("w", n)).await.unwrap().applied);
    }
    // A crash loses nothing acknowledged: the marks were flushed with their values.
    tally.abort();
    store = store.restart(0);
    let tally = reopen(&store).await;
    for n in [50, 49, 1] {
        assert!(tally.incr("c", seq("w", n)).await.unwrap().duplicate, "retry of {n} after a crash");
    }
    assert_eq!(tally.incr("c", seq("w", 52)).await.unwrap_err().code(), "out_of_order_sequence");
    assert!(tally.incr("c", seq("w", 51)).await.unwrap().applied);
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, 51);
    tally.shutdown().await.unwrap();
    // Fifty-one increments, one record: the writer's mark.
    assert_eq!(records(&store, "c", 4), vec![(mark_id("w"), 51)]);
}

/// Every dedup record of counter `name` in generation 0, as (id, delta).
fn records(store: &MemStore, name: &str, shards: u16) -> Vec<(String, i64)> {
    let mut out = Vec::new();
    for index in 0..shards {
        let id = ShardId::new(tally_core::CounterName::new(name).unwrap(), 0, index);
        for (k, r) in store.dedup_scan(&id, None, 1_000).unwrap() {
            out.push((k, r.delta));
        }
    }
    out
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn marks_from_before_a_resharding_still_answer_duplicates() {
    let (tally, _) = mem_engine().await;
    tally.put_counter("c", spec(4, Durability::Sync)).await.unwrap();
    for w in 0..10 {
        for n in 1..=10 {
            tally.incr("c", seq(&format!("w{w}"), n)).await.unwrap();
        }
    }
    for (next, shards) in [(11u64, 32u16), (12, 5)] {
        tally.put_counter("c", SpecPatch { shards: Some(shards), ..Default::default() }).await.unwrap();
        tally.settle().await;
        for w in 0..10 {
            let writer = format!("w{w}");
            let o = tally.incr("c", seq(&writer, next - 1)).await.unwrap();
            assert!(o.duplicate, "{writer} counted twice after resharding to {shards}");
            let err = tally.incr("c", seq(&writer, next + 1)).await.unwrap_err();
            assert_eq!(err.code(), "out_of_order_sequence", "the mark moved with the layout");
            assert!(tally.incr("c", seq(&writer, next)).await.unwrap().applied);
        }
    }
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, 120);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn marks_and_event_ids_live_side_by_side() {
    let dir = tempfile::tempdir().unwrap();
    let tally = Tally::open(dir.path(), tally_engine::TallyConfig::default()).await.unwrap();
    tally.put_counter("c", spec(2, Durability::Sync)).await.unwrap();
    // An event id spelled like a writer is not the writer's mark.
    assert!(tally.incr("c", Increment::new(1).event_id("w")).await.unwrap().applied);
    assert!(tally.incr("c", seq("w", 1)).await.unwrap().applied);
    assert!(tally.incr("c", Increment::new(1).event_id("w")).await.unwrap().duplicate);
    assert!(tally.incr("c", seq("w", 1)).await.unwrap().duplicate);
    assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, 2);
    tally.shutdown().await.unwrap();
}
