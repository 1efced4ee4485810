//! t12: the lean paths — an increment that answers its total reads through the
//! counter's runtime, first increments to new counters share one metadata commit,
//! and a resolved handle counts exactly as `incr` does.

mod common;

use common::{quick_config, spec, HookStore, SharedCatalog};
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use tally_engine::{
    Catalog, Clock, Consistency, Durability, EngineParts, Increment, MemStore, SpecPatch, SystemClock, Tally,
};

/// The system clock, counting its readings.
#[derive(Default)]
struct CountingClock(std::sync::atomic::AtomicU64);

impl Clock for CountingClock {
    fn now_ms(&self) -> u64 {
        self.0.fetch_add(1, SeqCst);
        SystemClock.now_ms()
    }
}

async fn engine_with_catalog() -> (Tally, SharedCatalog) {
    let catalog = SharedCatalog::default();
    let shared: Arc<dyn Catalog> = Arc::new(catalog.clone());
    let tally = Tally::open_parts(EngineParts {
        store: Arc::new(MemStore::new()),
        clock: Arc::new(SystemClock),
        config: quick_config(),
        catalog: Some(shared),
        placement: None,
    })
    .await
    .unwrap();
    (tally, catalog)
}

async fn engine_on_hooks() -> (Tally, HookStore) {
    let store = HookStore::new(MemStore::new());
    let tally =
        Tally::open_with(Arc::new(store.clone()), Arc::new(SystemClock), quick_config()).await.unwrap();
    (tally, store)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incr_total_answers_from_the_runtime_without_reading_the_catalog() {
    let (tally, catalog) = engine_with_catalog().await;
    tally.put_counter("money", spec(4, Durability::Sync)).await.unwrap();
    let no_rollup = SpecPatch { shards: Some(4), rollup_ms: Some(0), ..SpecPatch::default() };
    tally.put_counter("views", no_rollup).await.unwrap();
    // Activate both, then count the catalog reads of the increments alone.
    tally.incr_total("money", Increment::new(1)).await.unwrap();
    tally.incr_total("views", Increment::new(1)).await.unwrap();
    let before = catalog.gets.load(SeqCst);
    for i in 2..=20i128 {
        let (outcome, read) = tally.incr_total("money", Increment::new(1)).await.unwrap();
        assert!(outcome.applied);
        // sync: the fresh total after this increment is durable, so it includes it.
        assert_eq!(read.consistency, Consistency::Fresh);
        assert_eq!(read.value, i);
        // batched without a rollup: a fresh read that delivers this node's buffers.
        let (_, read) = tally.incr_total("views", Increment::new(1)).await.unwrap();
        assert_eq!(read.value, i);
        assert!(read.complete);
    }
    assert_eq!(catalog.gets.load(SeqCst), before, "no increment looked its spec up again");
    // The counter used to be looked up through the catalog for its durability.
    tally.counter("money").await.unwrap();
    assert!(catalog.gets.load(SeqCst) > before);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incr_total_of_a_batched_counter_answers_the_cached_total() {
    let (tally, _) = engine_with_catalog().await;
    let (_, first) = tally.incr_total("likes", Increment::new(5)).await.unwrap();
    assert_eq!(first.consistency, Consistency::Cached);
    // The cached total may or may not include the increment, never more than counted.
    assert!(first.value == 0 || first.value == 5, "{first:?}");
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn incr_value_answers_from_memory_and_reads_no_clock() {
    let clock = Arc::new(CountingClock::default());
    let tally = Tally::open_with(Arc::new(MemStore::new()), clock.clone(), quick_config()).await.unwrap();
    tally.put_counter("money", spec(4, Durability::Sync)).await.unwrap();
    for i in 1..=5i128 {
        // sync: the total right after this increment, as a fresh read would find it.
        let (outcome, total) = tally.incr_value("money", Increment::new(1)).await.unwrap();
        assert!(outcome.applied);
        assert_eq!(total.value(), Some(i));
    }
    // batched: this node's ledger, from memory.
    tally.incr_value("likes", Increment::new(1)).await.unwrap();
    let runs = 2_000u64;
    let clock_reads = |before: u64| clock.0.load(SeqCst) - before;
    let before = clock.0.load(SeqCst);
    for i in 0..runs {
        let (_, total) = tally.incr_value("likes", Increment::new(1)).await.unwrap();
        assert_eq!(total.value(), Some(i128::from(i) + 2), "every increment counted once");
    }
    let by_value = clock_reads(before);
    let before = clock.0.load(SeqCst);
    for _ in 0..runs {
        let (_, read) = tally.incr_total("likes", Increment::new(1)).await.unwrap();
        assert_eq!(read.consistency, Consistency::Cached);
    }
    let by_total = clock_reads(before);
    // The engine's own timers read the clock meanwhile; the increments add one read
    // each through `incr_total` (to age the total), none through `incr_value`.
    assert!(by_total >= runs, "{by_total} clock reads for {runs} aged totals");
    assert!(by_value < runs / 4, "{by_value} clock reads for {runs} totals answered from memory");
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn first_increments_to_new_counters_share_metadata_commits() {
    let (tally, store) = engine_on_hooks().await;
    // A commit that takes a while (a loaded disk): creations arriving meanwhile wait
    // for the next one and share it.
    store.meta_batch_stall_ms.store(20, SeqCst);
    let before = store.meta_batches.load(SeqCst);
    const NEW: usize = 64;
    let tasks: Vec<_> = (0..NEW)
        .map(|i| {
            let t = tally.clone();
            tokio::spawn(async move { t.incr(&format!("new:{i:02}"), Increment::new(1)).await })
        })
        .collect();
    for t in tasks {
        assert!(t.await.unwrap().unwrap().applied);
    }
    let commits = store.meta_batches.load(SeqCst) - before;
    assert!(commits * 4 <= NEW as u64, "{commits} metadata commits for {NEW} new counters");
    store.meta_batch_stall_ms.store(0, SeqCst);
    // Every one is a counter like any other: listed, counted, deletable, reshardable.
    let page = tally.list_counters("new:", None, 1000).unwrap();
    assert_eq!(page.counters.len(), NEW);
    for i in 0..NEW {
        let read = tally.read(&format!("new:{i:02}"), Consistency::Fresh).await.unwrap();
        assert_eq!(read.value, 1, "new:{i:02}");
    }
    tally.delete_counter("new:00").await.unwrap();
    assert_eq!(tally.list_counters("new:", None, 1000).unwrap().counters.len(), NEW - 1);
    tally.put_counter("new:01", SpecPatch { shards: Some(2), ..SpecPatch::default() }).await.unwrap();
    tally.incr("new:01", Increment::new(1)).await.unwrap();
    assert_eq!(tally.read("new:01", Consistency::Fresh).await.unwrap().value, 2);
    // A deleted counter's first increment creates it anew, from zero.
    tally.incr("new:00", Increment::new(3)).await.unwrap();
    assert_eq!(tally.read("new:00", Consistency::Fresh).await.unwrap().value, 3);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_created_counter_takes_its_first_increment_into_memory() {
    let (tally, store) = engine_on_hooks().await;
    let loads = store.loads.load(SeqCst);
    tally.incr("fresh:1", Increment::new(1)).await.unwrap();
    // Acknowledged from the accumulator: no shard was started to learn its value.
    assert_eq!(store.loads.load(SeqCst), loads);
    assert_eq!(tally.read("fresh:1", Consistency::Fresh).await.unwrap().value, 1);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_counters_first_drained_sum_is_written_without_a_shard_actor() {
    let (tally, store) = common::mem_engine().await;
    tally.incr("cold:1", Increment::new(4)).await.unwrap();
    // The fresh read delivers the buffered sum: to a shard that holds nothing and
    // never ran, so no actor is started for it.
    assert_eq!(tally.read("cold:1", Consistency::Fresh).await.unwrap().value, 4);
    assert_eq!(tally.stats().shard_activations.get(), 0, "a shard actor was started");
    assert_eq!(tally.stats().cold_writes.get(), 1);
    // Later writes go through actors, which start from what that write left.
    for shard_key in 0..16 {
        let inc = Increment::new(1).event_id(format!("e{shard_key}"));
        assert!(tally.incr("cold:1", inc.clone()).await.unwrap().applied);
        assert!(!tally.incr("cold:1", inc).await.unwrap().applied, "a retry counts once");
    }
    assert_eq!(tally.read("cold:1", Consistency::Fresh).await.unwrap().value, 20);
    assert!(tally.stats().shard_activations.get() > 0);
    assert_eq!(tally.stats().cold_writes.get(), 1, "only the first write of a shard goes without an actor");
    tally.shutdown().await.unwrap();
    let tally = common::reopen(&store).await;
    assert_eq!(tally.read("cold:1", Consistency::Fresh).await.unwrap().value, 20);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_drain_without_an_actor_and_direct_writes_to_the_same_shard_both_count() {
    // A new counter's buffered first increment is drained while increments with event
    // ids start the shard's actor: whichever comes first, neither overwrites the other.
    let (tally, store) = common::mem_engine().await;
    const COUNTERS: usize = 200;
    let mut tasks = Vec::new();
    for c in 0..COUNTERS {
        let t = tally.clone();
        tasks.push(tokio::spawn(async move {
            let name = format!("race:{c}");
            t.incr(&name, Increment::new(1)).await.unwrap();
            let (t2, n2) = (t.clone(), name.clone());
            let reader = tokio::spawn(async move { t2.read(&n2, Consistency::Fresh).await.unwrap() });
            for e in 0..4 {
                t.incr(&name, Increment::new(10).event_id(format!("{name}-{e}"))).await.unwrap();
            }
            reader.await.unwrap();
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
    for c in 0..COUNTERS {
        let read = tally.read(&format!("race:{c}"), Consistency::Fresh).await.unwrap();
        assert!(read.complete);
        assert_eq!(read.value, 41, "race:{c}");
    }
    assert!(tally.stats().cold_writes.get() > 0);
    tally.shutdown().await.unwrap();
    let tally = common::reopen(&store).await;
    for c in 0..COUNTERS {
        assert_eq!(tally.read(&format!("race:{c}"), Consistency::Fresh).await.unwrap().value, 41, "race:{c}");
    }
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_read_during_a_flush_joins_it_instead_of_waiting_for_the_next() {
    let (tally, store) = engine_on_hooks().await;
    tally.put_counter("money", spec(1, Durability::Sync)).await.unwrap();
    tally.incr("views", Increment::new(3)).await.unwrap();
    assert_eq!(tally.read("views", Consistency::Fresh).await.unwrap().value, 3);
    // A slow fsync under way: a `sync` increment's write is applied, its flush runs.
    const STALL_MS: u64 = 400;
    store.flush_stall_ms.store(STALL_MS, SeqCst);
    let t = tally.clone();
    let writer = tokio::spawn(async move { t.incr("money", Increment::new(1)).await });
    let started = store.flush_starts.load(SeqCst);
    while store.flush_starts.load(SeqCst) == started {
        tokio::time::sleep(std::time::Duration::from_millis(1)).await;
    }
    // Nothing is applied while a flush runs, so that flush covers everything this read
    // sees: the read returns with it (at most one stall), not after a flush of its own
    // that starts once it ends (two stalls).
    let begun = std::time::Instant::now();
    let read = tally.read("views", Consistency::Fresh).await.unwrap();
    let waited = begun.elapsed();
    assert_eq!(read.value, 3);
    assert!(
        waited < std::time::Duration::from_millis(STALL_MS * 3 / 2),
        "the read waited {waited:?}: for a flush started after it"
    );
    store.flush_stall_ms.store(0, SeqCst);
    assert!(writer.await.unwrap().unwrap().applied);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_handle_counts_as_incr_does() {
    let (tally, _) = engine_on_hooks().await;
    let likes = tally.handle("likes:42").await.unwrap();
    assert_eq!(likes.name(), "likes:42");
    for _ in 0..1000 {
        assert!(likes.incr_by(1).await.unwrap().applied);
    }
    assert!(likes.incr_by(0).await.is_err(), "a zero delta is refused as by incr");
    assert_eq!(tally.read("likes:42", Consistency::Fresh).await.unwrap().value, 1000);
    // A resharding replaces the runtime: the handle goes on counting by name.
    tally.put_counter("likes:42", SpecPatch { shards: Some(16), ..SpecPatch::default() }).await.unwrap();
    assert!(!likes.is_current());
    for _ in 0..10 {
        likes.incr_by(1).await.unwrap();
    }
    // Every increment counts (a fresh read during the resharding may say it is
    // incomplete: see the next test).
    let mut value = 0;
    for _ in 0..100 {
        value = tally.read("likes:42", Consistency::Fresh).await.unwrap().value;
        if value == 1010 {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    }
    assert_eq!(value, 1010);
    assert!(tally.handle("likes:42").await.unwrap().is_current());

    // Event ids and sync counters take the shard path through a handle too.
    tally.put_counter("credits", spec(2, Durability::Sync)).await.unwrap();
    let credits = tally.handle("credits").await.unwrap();
    assert!(credits.incr(Increment::new(5).event_id("e-1")).await.unwrap().applied);
    assert!(credits.incr(Increment::new(5).event_id("e-1")).await.unwrap().duplicate);
    assert_eq!(tally.read("credits", Consistency::Fresh).await.unwrap().value, 5);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_crash_never_leaves_shard_data_of_a_counter_whose_creation_was_lost() {
    // Counters created by their first (batched) increment are written without an
    // fsync of their own; whatever prefix of the store survives, every shard on disk
    // belongs to a listed counter and every listed counter reads.
    for keep in [0usize, 1, 2, 3, 5, 8, 13, 21, 34, usize::MAX] {
        let (tally, store) = common::mem_engine().await;
        for i in 0..8 {
            tally.incr(&format!("c:{i}"), Increment::new(i + 1)).await.unwrap();
        }
        // Let some drains and flushes happen for the larger prefixes.
        tokio::time::sleep(std::time::Duration::from_millis(if keep > 8 { 300 } else { 0 })).await;
        tally.abort();
        let store = store.restart(keep);
        let tally = common::reopen(&store).await;
        let listed = tally.list_counters("c:", None, 100).unwrap().counters;
        let shards = tally_engine::Store::shard_ids(&store, None, 10_000).unwrap();
        for id in &shards {
            assert!(
                listed.iter().any(|n| n == id.counter.as_str()),
                "keep {keep}: shard {id} of an unlisted counter"
            );
        }
        for name in &listed {
            let i: i128 = name[2..].parse().unwrap();
            let v = tally.read(name, Consistency::Fresh).await.unwrap().value;
            assert!(v == 0 || v == i + 1, "keep {keep}: {name} = {v}");
        }
        tally.shutdown().await.unwrap();
    }
}

/// Increments counted through a handle just after `put_counter` started a resharding
/// are acknowledged while their shards are being sealed: a drained sum a sealed shard
/// refuses goes back to its slots. A fresh read then must either deliver it to the
/// new generation or say it is incomplete; it said `complete: true` with 1,001 of
/// 1,010 about one run in sixteen beside two busy cores.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_complete_fresh_read_right_after_a_resharding_shows_every_acknowledged_increment() {
    for _ in 0..8 {
        let (tally, _) = engine_on_hooks().await;
        let likes = tally.handle("likes:42").await.unwrap();
        for _ in 0..1000 {
            likes.incr_by(1).await.unwrap();
        }
        assert_eq!(tally.read("likes:42", Consistency::Fresh).await.unwrap().value, 1000);
        tally.put_counter("likes:42", SpecPatch { shards: Some(16), ..SpecPatch::default() }).await.unwrap();
        for _ in 0..10 {
            likes.incr_by(1).await.unwrap();
        }
        let r = tally.read("likes:42", Consistency::Fresh).await.unwrap();
        assert!(!r.complete || r.value == 1010, "a complete read missed increments: {r:?}");
        tally.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_first_increment_does_not_wait_for_its_counters_creation_to_be_written() {
    let (tally, store) = engine_on_hooks().await;
    // A metadata write that takes a while (a loaded disk).
    const STALL_MS: u64 = 400;
    store.meta_batch_stall_ms.store(STALL_MS, SeqCst);
    let begun = std::time::Instant::now();
    assert!(tally.incr("later:1", Increment::new(2)).await.unwrap().applied);
    let waited = begun.elapsed();
    assert!(
        waited < std::time::Duration::from_millis(STALL_MS / 2),
        "the first increment waited {waited:?} for its counter's creation"
    );
    // The counter exists at once, as if written: listed, described, counted.
    let page = tally.list_counters("later:", None, 10).unwrap();
    assert_eq!(page.counters.len(), 1);
    assert_eq!(tally.counter("later:1").await.unwrap().spec, tally_engine::CounterSpec::default());
    // A fresh read delivers the increment, which writes the creation first.
    assert_eq!(tally.read("later:1", Consistency::Fresh).await.unwrap().value, 2);
    store.meta_batch_stall_ms.store(0, SeqCst);
    tally.shutdown().await.unwrap();
    let tally =
        Tally::open_with(Arc::new(store.clone()), Arc::new(SystemClock), quick_config()).await.unwrap();
    assert_eq!(tally.read("later:1", Consistency::Fresh).await.unwrap().value, 2);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn changes_of_a_counter_whose_creation_is_unwritten_apply_after_it() {
    let (tally, store) = engine_on_hooks().await;
    store.meta_batch_stall_ms.store(100, SeqCst);
    // Created by an increment, then changed at once: the change applies to it and is
    // never written over by the creation.
    tally.incr("ch:put", Increment::new(1)).await.unwrap();
    tally.put_counter("ch:put", SpecPatch { shards: Some(2), ..SpecPatch::default() }).await.unwrap();
    tally.incr("ch:put", Increment::new(1)).await.unwrap();
    // Created, then deleted at once: gone, and its next increment starts from zero.
    tally.incr("ch:del", Increment::new(5)).await.unwrap();
    tally.delete_counter("ch:del").await.unwrap();
    assert!(tally.counter("ch:del").await.is_err());
    tally.incr("ch:del", Increment::new(3)).await.unwrap();
    store.meta_batch_stall_ms.store(0, SeqCst);
    // A fresh read while the resharding runs may say it is incomplete.
    let mut read = tally.read("ch:put", Consistency::Fresh).await.unwrap();
    for _ in 0..100 {
        if read.complete && tally.counter("ch:put").await.unwrap().resharding.is_none() {
            break;
        }
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        read = tally.read("ch:put", Consistency::Fresh).await.unwrap();
    }
    assert!(read.complete);
    assert_eq!(read.value, 2);
    assert_eq!(tally.read("ch:del", Consistency::Fresh).await.unwrap().value, 3);
    tally.shutdown().await.unwrap();
    let tally =
        Tally::open_with(Arc::new(store.clone()), Arc::new(SystemClock), quick_config()).await.unwrap();
    assert_eq!(tally.counter("ch:put").await.unwrap().spec.shards, 2);
    assert_eq!(tally.read("ch:put", Consistency::Fresh).await.unwrap().value, 2);
    assert_eq!(tally.read("ch:del", Consistency::Fresh).await.unwrap().value, 3);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_counters_buffered_increments_never_count_in_the_counter_created_anew() {
    let (tally, _) = common::mem_engine().await;
    // Deleted while its first increment is still buffered, then created anew by the
    // next increment before the window drains the old buffer.
    tally.incr("reborn", Increment::new(5)).await.unwrap();
    tally.delete_counter("reborn").await.unwrap();
    tally.incr("reborn", Increment::new(3)).await.unwrap();
    // Past two windows: whatever the deleted counter buffered has been drained or
    // dropped by now.
    let window = u64::from(tally_engine::CounterSpec::default().flush_ms);
    tokio::time::sleep(std::time::Duration::from_millis(2 * window + 100)).await;
    assert_eq!(tally.read("reborn", Consistency::Fresh).await.unwrap().value, 3);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn more_new_counters_than_wait_for_a_drain_or_a_write_all_count_and_survive_a_restart() {
    // Past both bounds: creations answered before they are written, and created
    // counters waiting for their first drain. Every one is listed, counted once, and
    // written by a clean shutdown.
    let (tally, store) = common::mem_engine().await;
    let total = tally_engine::CREATED_UNDRAINED_MAX + tally_engine::CREATIONS_UNWRITTEN_MAX;
    const WRITERS: usize = 64;
    let tasks: Vec<_> = (0..WRITERS)
        .map(|w| {
            let t = tally.clone();
            tokio::spawn(async move {
                for i in (w..total).step_by(WRITERS) {
                    assert!(t.incr(&format!("many:{i:06}"), Increment::new(1)).await.unwrap().applied);
                }
            })
        })
        .collect();
    for t in tasks {
        t.await.unwrap();
    }
    let listed = |tally: Tally| async move {
        let mut n = 0;
        let mut after: Option<String> = None;
        loop {
            let page = tally.list_counters("many:", after.as_deref(), 1000).unwrap();
            n += page.counters.len();
            match page.next {
                Some(next) => after = Some(next),
                None => return n,
            }
        }
    };
    assert_eq!(listed(tally.clone()).await, total);
    tally.shutdown().await.unwrap();
    let tally = common::reopen(&store).await;
    assert_eq!(listed(tally.clone()).await, total);
    for i in (0..total).step_by(997) {
        assert_eq!(tally.read(&format!("many:{i:06}"), Consistency::Fresh).await.unwrap().value, 1);
    }
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_counters_first_cached_total_is_summed_from_memory() {
    let (tally, store) = engine_on_hooks().await;
    let loads = store.loads.load(SeqCst);
    // The increment that creates the counter answers its total from the slots: no
    // drain, no shard write and no shard read on the way.
    let (_, first) = tally.incr_total("mem:1", Increment::new(5)).await.unwrap();
    assert_eq!(first.consistency, Consistency::Cached);
    assert_eq!(first.value, 5);
    assert!(first.complete);
    assert_eq!(tally.stats().cold_writes.get(), 0, "the first read drained the counter");
    assert_eq!(store.loads.load(SeqCst), loads, "the first read read a shard");
    // Concurrent first increments of one new counter: each answer counts at least
    // its own increment and never more than were acknowledged.
    let tasks: Vec<_> = (0..32)
        .map(|_| {
            let t = tally.clone();
            tokio::spawn(async move { t.incr_total("mem:2", Increment::new(1)).await.unwrap().1.value })
        })
        .collect();
    for t in tasks {
        let value = t.await.unwrap();
        assert!((0..=32).contains(&value), "{value}");
    }
    assert_eq!(tally.read("mem:2", Consistency::Fresh).await.unwrap().value, 32);
    assert_eq!(tally.read("mem:1", Consistency::Fresh).await.unwrap().value, 5);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_counters_first_cached_total_counts_what_already_left_its_slots() {
    let (tally, _) = common::mem_engine().await;
    // Created by a direct write (an event id): its slots never held it.
    tally.incr("direct:1", Increment::new(7).event_id("e1")).await.unwrap();
    assert_eq!(tally.read("direct:1", Consistency::Cached).await.unwrap().value, 7);
    // Created from the slots, then written directly.
    tally.incr("mixed:1", Increment::new(1)).await.unwrap();
    tally.incr("mixed:1", Increment::new(10).event_id("e2")).await.unwrap();
    assert_eq!(tally.read("mixed:1", Consistency::Cached).await.unwrap().value, 11);
    // Created from the slots, then drained (a fresh read delivers them; it does not
    // cache), then read cached for the first time.
    tally.incr("drained:1", Increment::new(3)).await.unwrap();
    assert_eq!(tally.read("drained:1", Consistency::Fresh).await.unwrap().value, 3);
    assert_eq!(tally.read("drained:1", Consistency::Cached).await.unwrap().value, 3);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_read_of_a_new_counter_skips_the_shards_nothing_was_written_to() {
    let (tally, store) = engine_on_hooks().await;
    tally.put_counter("sparse:1", spec(8, Durability::Batched)).await.unwrap();
    tally.incr("sparse:2", Increment::new(1)).await.unwrap();
    let loads = store.loads.load(SeqCst);
    // One drained sum: one shard written, the seven others known empty.
    assert_eq!(tally.read("sparse:2", Consistency::Fresh).await.unwrap().value, 1);
    assert_eq!(store.loads.load(SeqCst) - loads, 1, "shards read beyond the one written");
    // Direct writes start actors on other shards; every one written is read again.
    for e in 0..16 {
        tally.incr("sparse:2", Increment::new(1).event_id(format!("e{e}"))).await.unwrap();
    }
    let read = tally.read("sparse:2", Consistency::Fresh).await.unwrap();
    assert_eq!(read.value, 17);
    assert!(read.complete);
    // A counter created by `put_counter` is not known empty: it is read whole.
    tally.incr("sparse:1", Increment::new(2)).await.unwrap();
    let loads = store.loads.load(SeqCst);
    assert_eq!(tally.read("sparse:1", Consistency::Fresh).await.unwrap().value, 2);
    assert!(store.loads.load(SeqCst) - loads >= 8);
    tally.shutdown().await.unwrap();
    let tally = common::reopen(&store.inner).await;
    assert_eq!(tally.read("sparse:2", Consistency::Fresh).await.unwrap().value, 17);
    assert_eq!(tally.read("sparse:1", Consistency::Fresh).await.unwrap().value, 2);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_counters_first_cached_total_counts_a_sum_on_its_way_to_a_shard() {
    let (tally, store) = engine_on_hooks().await;
    // The creation's write is slow, and a counter's first drained sum is written only
    // after it: the sum waits between the slots and its shard meanwhile.
    store.meta_batch_stall_ms.store(300, SeqCst);
    tally.incr("between:1", Increment::new(3)).await.unwrap();
    let t = tally.clone();
    let drain = tokio::spawn(async move { t.read("between:1", Consistency::Fresh).await.unwrap().value });
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    assert_eq!(tally.read("between:1", Consistency::Cached).await.unwrap().value, 3);
    assert_eq!(drain.await.unwrap(), 3);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn concurrent_fresh_reads_share_rounds_and_each_counts_what_came_before_it() {
    let (tally, store) = engine_on_hooks().await;
    const SHARDS: u16 = 8;
    const WRITERS: usize = 64;
    const EACH: i128 = 10;
    tally.put_counter("shared:1", spec(SHARDS, Durability::Sync)).await.unwrap();
    // A shard load takes a millisecond, as a read from a busy disk may: a round then
    // lasts long enough for the writers acknowledged during it to share the next one,
    // however the two cores are shared with other work.
    *store.on_load.lock().unwrap() =
        Some(Box::new(|| std::thread::sleep(std::time::Duration::from_millis(1))));
    let loads = store.loads.load(SeqCst);
    let tasks: Vec<_> = (0..WRITERS)
        .map(|_| {
            let t = tally.clone();
            tokio::spawn(async move {
                // Each answer includes this writer's increments so far (each was
                // durable before its read was asked for), and every answer is newer.
                let mut last = 0;
                for _ in 0..EACH {
                    let (_, read) = t.incr_total("shared:1", Increment::new(1)).await.unwrap();
                    assert!(read.complete);
                    assert!(read.value > last, "{} after {last}", read.value);
                    last = read.value;
                }
                last
            })
        })
        .collect();
    for t in tasks {
        let last = t.await.unwrap();
        assert!((EACH..=WRITERS as i128 * EACH).contains(&last), "{last}");
    }
    assert_eq!(tally.read("shared:1", Consistency::Fresh).await.unwrap().value, WRITERS as i128 * EACH);
    // A read of its own per increment would have loaded every shard each time.
    let read_loads = store.loads.load(SeqCst) - loads;
    let alone = WRITERS as u64 * EACH as u64 * u64::from(SHARDS);
    assert!(read_loads * 2 < alone, "{read_loads} shard loads, {alone} without sharing");
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_reader_that_stops_waiting_leaves_the_next_round_to_run() {
    let (tally, store) = engine_on_hooks().await;
    tally.put_counter("shared:2", spec(4, Durability::Batched)).await.unwrap();
    tally.incr("shared:2", Increment::new(1)).await.unwrap();
    // The read delivers the buffered increment and waits for its flush, which stalls.
    store.flush_stall_ms.store(300, SeqCst);
    let mut first = Box::pin(tally.read("shared:2", Consistency::Fresh));
    assert!(futures::poll!(&mut first).is_pending());
    let t = tally.clone();
    let second = tokio::spawn(async move { t.read("shared:2", Consistency::Fresh).await });
    tokio::time::sleep(std::time::Duration::from_millis(50)).await;
    // The first reader gives up; the one that asked during its round still gets one.
    drop(first);
    let read = tokio::time::timeout(std::time::Duration::from_secs(10), second)
        .await
        .expect("the waiting reader was left without a round")
        .unwrap()
        .unwrap();
    assert_eq!(read.value, 1);
    assert!(read.complete);
    store.flush_stall_ms.store(0, SeqCst);
    tally.shutdown().await.unwrap();
}
