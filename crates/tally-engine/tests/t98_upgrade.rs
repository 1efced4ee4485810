//! t98: a store written by an earlier release opens and reads the same.
//!
//! `tests/fixtures/store-format-1.tar.gz` holds a sled database written by the release whose
//! store had no format marker (format 1): four counters — a `sync` one with event ids,
//! a `batched` one, a `sync` one with distinct members (dense sketches) and a `sync` one resharded from
//! 4 to 8 shards — filled by [`story`] and shut down cleanly. This release must open
//! it, read every total and distinct estimate the story implies, answer `duplicate` for
//! every event id it acknowledged, and mark the store with its format.
//!
//! The fixture was made on that release, in `crates/tally-engine`, with
//! `TALLY_WRITE_FIXTURE=tests/fixtures/store-format-1 cargo test -p tally-engine --test t98_upgrade -- --ignored --exact write_fixture`
//! and `tar czf store-format-1.tar.gz store-format-1` in `tests/fixtures`; re-running
//! it on a later release writes that release's format instead (the story is the same,
//! so the checks below hold for both).
//!
//! `tests/fixtures/store-format-4.tar.gz` holds one written by the last release of
//! format 4 (windows, before bounds) by [`story_format_4`]: a `sync` counter with event
//! ids, a distinct counter with two windows, a counter with frequencies, and a
//! windowed counter resharded from 2 to 4 shards. This release must open it, read every
//! total, distinct estimate, window and frequency the story implies, answer
//! `duplicate` for every event id it acknowledged, and mark the store with its format.
//! Made on that release the same way, with
//! `TALLY_WRITE_FIXTURE=tests/fixtures/store-format-4 cargo test -p tally-engine --test t98_upgrade -- --ignored --exact write_fixture_format_4`
//! and `tar czf store-format-4.tar.gz store-format-4`.
//!
//! `tests/fixtures/store-format-5.tar.gz` holds one written by the last release of
//! format 5 (bounds and auto counters, before window limits; commit bef1a93) by
//! [`story_format_5`]: format 4's story, then a bounded counter (between 0 and 1000,
//! on 4 shards) stocked on one shard and partly taken with event ids, so its shards'
//! images hold escrow ledgers, and an auto counter. This release must read all of
//! format 4's story as above, the stock's value, bounds and event ids, the auto
//! counter's bounds, no window limit anywhere, and take from the stock exactly what
//! was left. Made on that release the same way, with
//! `TALLY_WRITE_FIXTURE=tests/fixtures/store-format-5 cargo test -p tally-engine --test t98_upgrade -- --ignored --exact write_fixture_format_5`
//! and `tar czf store-format-5.tar.gz store-format-5`; that release's writers had no
//! bounded or auto counter, so [`story_format_5`] and [`write_fixture_format_5`] were
//! added to it there, as they read here.
//!
//! `tests/fixtures/store-format-6.tar.gz` holds the same story written by the last
//! release of format 6 (window limits, before shard images carried dedup records;
//! commit 094262e), made there with
//! `TALLY_WRITE_FIXTURE=tests/fixtures/store-format-6 cargo test -p tally-engine --test t98_upgrade -- --ignored --exact write_fixture_format_5`
//! and `tar czf store-format-6.tar.gz store-format-6`. This release must read it as
//! format 5's, limits aside (the story sets none).
//!
//! `tests/fixtures/store-format-7.tar.gz` holds the same story written by the last
//! release of format 7 (shard images that carry dedup records, before counters had a
//! replica count of their own; commit 845ee8c), made there the same way with
//! `TALLY_WRITE_FIXTURE=tests/fixtures/store-format-7 cargo test -p tally-engine --test t98_upgrade -- --ignored --exact write_fixture_format_5`
//! and `tar czf store-format-7.tar.gz store-format-7`. This release must read it as
//! format 5's, and every counter takes the cluster's replicas.

use std::path::{Path, PathBuf};
use std::sync::Arc;
use tally_core::format::{encode_version, STORE_FORMAT};
use tally_core::frequency::FrequencySpec;
use tally_core::sketch::{member_hash, DistinctSketch};
use tally_core::window::WindowSet;
use tally_engine::{
    AutoPatch, AutoShards, Consistency, Durability, Increment, ManualClock, MemStore, SledStore, SpecPatch,
    Store, SystemClock, Tally, TallyConfig, TallyError, STORE_FORMAT_KEY,
};

/// The sync counter whose event ids must stay known.
const CREDITS: &str = "credits";
/// The batched counter.
const VIEWS: &str = "views";
/// The distinct counter.
const VISITORS: &str = "visitors";
/// The counter resharded from 4 to 8 shards between its two halves of increments.
const LIKES: &str = "likes";

const CREDIT_EVENTS: i64 = 300;
const VIEW_INCREMENTS: i64 = 500;
/// Enough members that each of the two shards' sketches is dense.
const VISITOR_MEMBERS: u32 = 10_000;
/// Members seen twice: the second visit changes the total, not the estimate.
const VISITOR_REPEATS: u32 = 1_000;
const LIKES_PER_HALF: i64 = 200;

fn credit_delta(i: i64) -> i64 {
    i % 7 - 3 + 10
}

fn credit_event(i: i64) -> String {
    format!("credit-{i}")
}

/// The format-4 fixture's distinct counter with windows.
const HITS: &str = "hits";
/// The format-4 fixture's counter with frequencies.
const WORDS: &str = "words";

const HIT_MEMBERS: u32 = 300;
/// Members seen twice: the second visit changes the totals, not the estimates.
const HIT_REPEATS: u32 = 50;
/// Items `word-0..` of the frequency counter; item `i` weighs `i + 1`.
const WORD_ITEMS: u64 = 10;
const FORMAT_4_CREDIT_EVENTS: i64 = 100;
const FORMAT_4_LIKES_PER_HALF: i64 = 100;

/// The format-5 fixture's bounded counter: a stock between 0 and 1000.
const STOCK: &str = "stock";
/// The format-5 fixture's auto counter.
const BUSY: &str = "busy";

const STOCK_MIN: i64 = 0;
const STOCK_MAX: i64 = 1_000;
/// What the supplier adds to the stock, on one shard.
const STOCK_SUPPLIED: i64 = 100;
/// Single units taken from the stock, each with an event id, by three writers.
const STOCK_TAKEN: i64 = 30;
const BUSY_INCREMENTS: i64 = 50;

fn stock_event(i: i64) -> String {
    format!("take-{i}")
}

fn busy_bounds() -> AutoShards {
    AutoShards { min_shards: 2, max_shards: 8 }
}

fn hit_windows() -> WindowSet {
    WindowSet::parse(&["1m", "1h"]).unwrap()
}

fn like_windows() -> WindowSet {
    WindowSet::parse(&["1h"]).unwrap()
}

fn word_frequency() -> FrequencySpec {
    FrequencySpec { epsilon: 0.01, delta: 0.01 }
}

fn config() -> TallyConfig {
    TallyConfig { call_timeout_ms: 10_000, ..TallyConfig::default() }
}

fn spec(shards: u16, durability: Durability) -> SpecPatch {
    SpecPatch { shards: Some(shards), durability: Some(durability), ..SpecPatch::default() }
}

/// What the fixture's release did to its store.
async fn story(tally: &Tally) {
    tally.put_counter(CREDITS, spec(8, Durability::Sync)).await.unwrap();
    for i in 0..CREDIT_EVENTS {
        let o = tally.incr(CREDITS, Increment::new(credit_delta(i)).event_id(credit_event(i))).await.unwrap();
        assert!(o.applied);
    }
    tally.put_counter(VIEWS, spec(4, Durability::Batched)).await.unwrap();
    for i in 0..VIEW_INCREMENTS {
        tally.incr(VIEWS, Increment::new(1).writer(format!("w{}", i % 5))).await.unwrap();
    }
    let distinct = SpecPatch { distinct: Some(true), ..spec(2, Durability::Sync) };
    tally.put_counter(VISITORS, distinct).await.unwrap();
    for m in (0..VISITOR_MEMBERS).chain(0..VISITOR_REPEATS) {
        tally.incr(VISITORS, Increment::new(1).member(format!("user-{m}"))).await.unwrap();
    }
    tally.put_counter(LIKES, spec(4, Durability::Sync)).await.unwrap();
    for _ in 0..LIKES_PER_HALF {
        tally.incr(LIKES, Increment::new(1)).await.unwrap();
    }
    tally.put_counter(LIKES, SpecPatch { shards: Some(8), ..SpecPatch::default() }).await.unwrap();
    for _ in 0..LIKES_PER_HALF {
        tally.incr(LIKES, Increment::new(1)).await.unwrap();
    }
    tally.settle().await;
}

/// What the release of format 4 did to its store.
async fn story_format_4(tally: &Tally) {
    tally.put_counter(CREDITS, spec(8, Durability::Sync)).await.unwrap();
    for i in 0..FORMAT_4_CREDIT_EVENTS {
        let o = tally.incr(CREDITS, Increment::new(credit_delta(i)).event_id(credit_event(i))).await.unwrap();
        assert!(o.applied);
    }
    let hits = SpecPatch { distinct: Some(true), windows: Some(hit_windows()), ..spec(2, Durability::Sync) };
    tally.put_counter(HITS, hits).await.unwrap();
    for m in (0..HIT_MEMBERS).chain(0..HIT_REPEATS) {
        tally.incr(HITS, Increment::new(1).member(format!("user-{m}"))).await.unwrap();
    }
    let words = SpecPatch { frequency: Some(word_frequency()), ..spec(2, Durability::Sync) };
    tally.put_counter(WORDS, words).await.unwrap();
    for i in 0..WORD_ITEMS {
        let weight = i64::try_from(i + 1).unwrap();
        tally.incr(WORDS, Increment::new(weight).item(format!("word-{i}"))).await.unwrap();
    }
    let likes = SpecPatch { windows: Some(like_windows()), ..spec(2, Durability::Sync) };
    tally.put_counter(LIKES, likes).await.unwrap();
    for _ in 0..FORMAT_4_LIKES_PER_HALF {
        tally.incr(LIKES, Increment::new(1)).await.unwrap();
    }
    tally.put_counter(LIKES, SpecPatch { shards: Some(4), ..SpecPatch::default() }).await.unwrap();
    for _ in 0..FORMAT_4_LIKES_PER_HALF {
        tally.incr(LIKES, Increment::new(1)).await.unwrap();
    }
    tally.settle().await;
}

/// What the release of format 5 did to its store: format 4's story, then a bounded
/// counter whose shards' escrow ledgers hold its headroom, and an auto counter.
async fn story_format_5(tally: &Tally) {
    story_format_4(tally).await;
    let stock = SpecPatch {
        min: Some(STOCK_MIN),
        max: Some(STOCK_MAX),
        rollup_ms: Some(0),
        ..spec(4, Durability::Sync)
    };
    tally.put_counter(STOCK, stock).await.unwrap();
    tally.incr(STOCK, Increment::new(STOCK_SUPPLIED).writer("supplier")).await.unwrap();
    let mut taken = 0;
    for i in 0.. {
        if taken == STOCK_TAKEN {
            break;
        }
        assert!(i < 100 * STOCK_TAKEN, "the stock is not taken");
        // Borrowing may refuse a step while the headroom is on another shard; a
        // refused step is retried with the same event id.
        let take = Increment::new(-1).event_id(stock_event(taken)).writer(format!("w{}", i % 3));
        match tally.incr(STOCK, take).await {
            Ok(o) => {
                assert!(o.applied);
                taken += 1;
            }
            Err(e) => assert_eq!(e.code(), "bound_exceeded", "{e}"),
        }
    }
    let auto = AutoPatch {
        auto: true,
        min_shards: Some(busy_bounds().min_shards),
        max_shards: Some(busy_bounds().max_shards),
    };
    let busy = SpecPatch { durability: Some(Durability::Sync), ..SpecPatch::default() };
    tally.put_counter_auto(BUSY, busy, auto).await.unwrap();
    for i in 0..BUSY_INCREMENTS {
        tally.incr(BUSY, Increment::new(1).writer(format!("w{}", i % 4))).await.unwrap();
    }
    tally.settle().await;
}

fn sketch_estimate(members: u32) -> u64 {
    let mut sketch = DistinctSketch::new();
    for m in 0..members {
        sketch.insert_hash(member_hash(&format!("user-{m}")));
    }
    sketch.estimate()
}

fn expected_visitors_estimate() -> u64 {
    sketch_estimate(VISITOR_MEMBERS)
}

/// Opens a new store, in this build's format, in the directory named by
/// `TALLY_WRITE_FIXTURE`.
async fn new_fixture() -> Tally {
    let dir = PathBuf::from(std::env::var("TALLY_WRITE_FIXTURE").expect("TALLY_WRITE_FIXTURE=DIR"));
    assert!(!dir.exists(), "{} exists: remove it first", dir.display());
    Tally::open(&dir, config()).await.unwrap()
}

/// Writes the first format's fixture with this build (see the module docs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "writes the committed fixture; run by hand with TALLY_WRITE_FIXTURE"]
async fn write_fixture() {
    let tally = new_fixture().await;
    story(&tally).await;
    tally.shutdown().await.unwrap();
}

/// Writes the format-4 fixture with this build (see the module docs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "writes the committed fixture; run by hand with TALLY_WRITE_FIXTURE"]
async fn write_fixture_format_4() {
    let tally = new_fixture().await;
    story_format_4(&tally).await;
    tally.shutdown().await.unwrap();
}

/// Writes the format-5 fixture with this build (see the module docs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "writes the committed fixture; run by hand with TALLY_WRITE_FIXTURE"]
async fn write_fixture_format_5() {
    let tally = new_fixture().await;
    story_format_5(&tally).await;
    tally.shutdown().await.unwrap();
}

/// Opens the store at `dir` once the engine that had it open has let go of it (its
/// actors drop their handles shortly after a shutdown; sled locks the directory).
async fn reopen(dir: &Path) -> Tally {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match Tally::open(dir, config()).await {
            Ok(t) => return t,
            Err(e) if e.to_string().contains("lock") && std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            Err(e) => panic!("reopening {}: {e}", dir.display()),
        }
    }
}

/// The fixture `name` unpacked in a fresh directory (opening a store writes to it):
/// the returned path is the database's directory.
fn fixture_copy(name: &str) -> (tempfile::TempDir, PathBuf) {
    let to = tempfile::tempdir().unwrap();
    let archive = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/{name}.tar.gz"));
    let status = std::process::Command::new("tar")
        .arg("xzf")
        .arg(archive)
        .arg("-C")
        .arg(to.path())
        .status()
        .expect("running tar");
    assert!(status.success(), "tar failed: {status}");
    let db = to.path().join(name);
    (to, db)
}

/// When the fixture's release wrote it: its database file's modification time, which
/// tar keeps. Its event ids are judged then, not today: they expire with the
/// counter's dedup window (a day), so a clock of today would rightly forget them.
fn written_at_ms(dir: &Path) -> u64 {
    let modified =
        std::fs::metadata(dir.join("db")).and_then(|m| m.modified()).expect("the fixture's db file");
    let since = modified.duration_since(std::time::UNIX_EPOCH).expect("a time after 1970");
    u64::try_from(since.as_millis()).expect("a time within 64 bits of milliseconds")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_of_the_first_format_reads_the_same() {
    let (_keep, dir) = fixture_copy("store-format-1");
    // A minute after the fixture was written, well within its counters' dedup window.
    let clock = ManualClock::new(written_at_ms(&dir) + 60_000);
    let store = SledStore::open_path(&dir).unwrap();
    let tally = Tally::open_with(Arc::new(store), Arc::new(clock), config()).await.unwrap();

    let credits: i128 = (0..CREDIT_EVENTS).map(|i| i128::from(credit_delta(i))).sum();
    let cases = [
        (CREDITS, credits),
        (VIEWS, i128::from(VIEW_INCREMENTS)),
        (VISITORS, i128::from(VISITOR_MEMBERS + VISITOR_REPEATS)),
        (LIKES, 2 * i128::from(LIKES_PER_HALF)),
    ];
    for (name, want) in cases {
        let read = tally.read(name, Consistency::Fresh).await.unwrap();
        assert!(read.complete, "{name}: {read:?}");
        assert_eq!(read.value, want, "{name}");
    }
    assert_eq!(tally.counter(LIKES).await.unwrap().layout_shards, 8);
    assert_eq!(tally.distinct(VISITORS).await.unwrap().estimate, expected_visitors_estimate());

    // Every acknowledged event id is still known: a retry is a duplicate, counted once.
    for i in 0..CREDIT_EVENTS {
        let o = tally.incr(CREDITS, Increment::new(credit_delta(i)).event_id(credit_event(i))).await.unwrap();
        assert!(!o.applied, "event {} counted twice", credit_event(i));
    }
    assert_eq!(tally.read(CREDITS, Consistency::Fresh).await.unwrap().value, credits);

    // It keeps working as a store of this release, and says so.
    tally.incr(CREDITS, Increment::new(5).event_id("after-upgrade")).await.unwrap();
    tally.shutdown().await.unwrap();
    drop(tally);
    let tally = reopen(&dir).await;
    assert_eq!(tally.read(CREDITS, Consistency::Fresh).await.unwrap().value, credits + 5);
    tally.shutdown().await.unwrap();
    drop(tally);
    let store = open_store_when_free(&dir).await;
    let marker = Store::meta_get(&store, STORE_FORMAT_KEY).unwrap();
    assert_eq!(marker.as_deref(), Some(&encode_version(STORE_FORMAT)[..]));
}

/// Opens the fixture `name` of format `format` with this release, a minute after it
/// was written (well within its counters' dedup window and its hour windows, just
/// past its minute window); returns the engine, the fixture's directory (kept while
/// the first value lives) and when it was written.
async fn open_fixture(name: &str, format: u32) -> (Tally, (tempfile::TempDir, PathBuf), u64) {
    let (keep, dir) = fixture_copy(name);
    let written_at = written_at_ms(&dir);
    {
        let store = SledStore::open_path(&dir).unwrap();
        let marker = Store::meta_get(&store, STORE_FORMAT_KEY).unwrap();
        assert_eq!(marker.as_deref(), Some(&encode_version(format)[..]), "the fixture is of format {format}");
    }
    let clock = ManualClock::new(written_at + 60_000);
    let store = open_store_when_free(&dir).await;
    let tally = Tally::open_with(Arc::new(store), Arc::new(clock), config()).await.unwrap();
    (tally, (keep, dir), written_at)
}

/// Checks that `tally` reads what [`story_format_4`] wrote at `written_at` (a minute
/// ago by its clock): every total, spec, distinct estimate, window and frequency,
/// and every acknowledged event id, which a retry finds a duplicate. Returns the
/// credits' total.
async fn check_story_format_4(tally: &Tally, written_at: u64) -> i128 {
    let credits: i128 = (0..FORMAT_4_CREDIT_EVENTS).map(|i| i128::from(credit_delta(i))).sum();
    let words: i128 = (1..=i128::from(WORD_ITEMS)).sum();
    let cases = [
        (CREDITS, credits),
        (HITS, i128::from(HIT_MEMBERS + HIT_REPEATS)),
        (WORDS, words),
        (LIKES, 2 * i128::from(FORMAT_4_LIKES_PER_HALF)),
    ];
    for (name, want) in cases {
        let read = tally.read(name, Consistency::Fresh).await.unwrap();
        assert!(read.complete, "{name}: {read:?}");
        assert_eq!(read.value, want, "{name}");
        let spec = tally.counter(name).await.unwrap().spec;
        assert_eq!((spec.min, spec.max), (None, None), "{name}: an upgraded counter has no bounds");
        assert_eq!(spec.limit, None, "{name}: an upgraded counter has no window limit");
        assert_eq!(spec.replicas, None, "{name}: an upgraded counter takes the cluster's replicas");
    }

    // Specs keep their windows and frequencies; the resharding is done.
    assert_eq!(tally.counter(HITS).await.unwrap().spec.windows, hit_windows());
    assert_eq!(tally.counter(WORDS).await.unwrap().spec.frequency, Some(word_frequency()));
    let likes = tally.counter(LIKES).await.unwrap();
    assert_eq!((likes.layout_shards, likes.spec.windows), (4, like_windows()));

    // Shard images keep their sketches and window buckets.
    let estimate = sketch_estimate(HIT_MEMBERS);
    assert_eq!(tally.distinct(HITS).await.unwrap().estimate, estimate);
    let hour = tally.window(HITS, "1h").await.unwrap();
    assert!(hour.complete, "{hour:?}");
    assert_eq!((hour.value, hour.estimate), (i128::from(HIT_MEMBERS + HIT_REPEATS), Some(estimate)));
    assert!(hour.start_ms < written_at.saturating_sub(30_000), "{hour:?}");
    let minute = tally.window(HITS, "1m").await.unwrap();
    assert_eq!(minute.value, 0, "a minute on, the story has left the minute window: {minute:?}");
    let likes_hour = tally.window(LIKES, "1h").await.unwrap();
    assert_eq!(likes_hour.value, 2 * i128::from(FORMAT_4_LIKES_PER_HALF), "carried once: {likes_hour:?}");
    for i in 0..WORD_ITEMS {
        let read = tally.frequency(WORDS, &format!("word-{i}")).await.unwrap();
        assert!(read.complete, "{read:?}");
        let weight = i + 1;
        assert_eq!(read.lower_bound, weight, "word-{i}");
        assert!(read.estimate >= weight && read.estimate <= weight + read.error_bound, "word-{i}: {read:?}");
    }
    let top = tally.top(WORDS, 3).await.unwrap();
    let items: Vec<&str> = top.items.iter().map(|e| e.item.as_str()).collect();
    assert_eq!(items, ["word-9", "word-8", "word-7"]);

    // Every acknowledged event id is still known: a retry is a duplicate, counted once.
    for i in 0..FORMAT_4_CREDIT_EVENTS {
        let o = tally.incr(CREDITS, Increment::new(credit_delta(i)).event_id(credit_event(i))).await.unwrap();
        assert!(!o.applied, "event {} counted twice", credit_event(i));
    }
    assert_eq!(tally.read(CREDITS, Consistency::Fresh).await.unwrap().value, credits);
    credits
}

/// Goes on with the upgraded store of [`story_format_4`] (whose credits' total is
/// `credits`) as a store of this release: new members join the upgraded sketch and
/// window, and an increment survives a restart. Returns the engine reopened on `dir`.
async fn go_on_after_story_format_4(tally: Tally, dir: &Path, credits: i128) -> Tally {
    tally.incr(HITS, Increment::new(1).member("user-new")).await.unwrap();
    assert_eq!(tally.window(HITS, "1m").await.unwrap().value, 1);
    let hour = tally.window(HITS, "1h").await.unwrap();
    assert_eq!(hour.value, i128::from(HIT_MEMBERS + HIT_REPEATS) + 1);
    tally.incr(CREDITS, Increment::new(5).event_id("after-upgrade")).await.unwrap();
    tally.shutdown().await.unwrap();
    drop(tally);
    let tally = reopen(dir).await;
    assert_eq!(tally.read(CREDITS, Consistency::Fresh).await.unwrap().value, credits + 5);
    assert_eq!(
        tally.read(HITS, Consistency::Fresh).await.unwrap().value,
        i128::from(HIT_MEMBERS + HIT_REPEATS) + 1
    );
    tally
}

/// Shuts `tally` down and checks that its store, at `dir`, says it is of this
/// release's format.
async fn shut_down_in_this_format(tally: Tally, dir: &Path) {
    tally.shutdown().await.unwrap();
    drop(tally);
    let store = open_store_when_free(dir).await;
    let marker = Store::meta_get(&store, STORE_FORMAT_KEY).unwrap();
    assert_eq!(marker.as_deref(), Some(&encode_version(STORE_FORMAT)[..]));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_of_format_4_reads_the_same_with_its_windows_and_no_bounds() {
    let (tally, (_keep, dir), written_at) = open_fixture("store-format-4", 4).await;
    let credits = check_story_format_4(&tally, written_at).await;
    let tally = go_on_after_story_format_4(tally, &dir, credits).await;
    shut_down_in_this_format(tally, &dir).await;
}

/// The bound an increment was refused at; panics unless it was refused at one.
fn refused_at<T: std::fmt::Debug>(result: Result<T, TallyError>) -> String {
    match result {
        Err(TallyError::BoundExceeded { bound, .. }) => bound.to_string(),
        other => panic!("not refused at a bound: {other:?}"),
    }
}

/// `tally`'s stock keeps its bounds, and its shards' escrow ledgers the headroom
/// [`story_format_5`] left: exactly what remains can be taken, nothing past either
/// bound.
async fn check_stock_takes_exactly_what_remains(tally: &Tally) {
    let remaining = STOCK_SUPPLIED - STOCK_TAKEN;
    let mut taken = 0;
    for i in 0..100 * remaining {
        match tally.incr(STOCK, Increment::new(-1).writer(format!("w{}", i % 3))).await {
            Ok(o) => {
                assert!(o.applied);
                taken += 1;
            }
            Err(TallyError::BoundExceeded { bound, .. }) => {
                assert_eq!(bound, "min");
                let value = tally.read(STOCK, Consistency::Fresh).await.unwrap().value;
                assert!(value >= 0, "a read below the floor: {value}");
                if value == 0 {
                    break;
                }
            }
            Err(e) => panic!("{e}"),
        }
    }
    assert_eq!(taken, remaining, "the ledgers hold exactly the stock that was left");
    assert_eq!(tally.read(STOCK, Consistency::Fresh).await.unwrap().value, 0);
    assert_eq!(refused_at(tally.incr(STOCK, Increment::new(-1)).await), "min");
    assert_eq!(refused_at(tally.incr(STOCK, Increment::new(STOCK_MAX + 1)).await), "max");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_of_format_5_reads_the_same_with_its_bounds_and_auto_bounds_and_no_limits() {
    reads_the_same_after_story_format_5("store-format-5", 5).await;
}

/// Format 6's images carry no records: they open as format 7's, and only the marker
/// changes.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_of_format_6_reads_the_same() {
    reads_the_same_after_story_format_5("store-format-6", 6).await;
}

/// Format 7's catalog entries lack format 8's replica count: every counter opens
/// without one of its own, so its shards keep the ids (and keys) they had.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_of_format_7_reads_the_same_with_the_clusters_replicas() {
    reads_the_same_after_story_format_5("store-format-7", 7).await;
}

/// Opens the fixture `name`, of `format`, written by [`story_format_5`]; checks
/// everything the story implies, goes on writing across a restart, and leaves the
/// store in this release's format.
async fn reads_the_same_after_story_format_5(name: &str, format: u32) {
    let (tally, (_keep, dir), written_at) = open_fixture(name, format).await;
    let credits = check_story_format_4(&tally, written_at).await;

    // The bounded counter: its value, its bounds, and its event ids.
    let remaining = i128::from(STOCK_SUPPLIED - STOCK_TAKEN);
    let read = tally.read(STOCK, Consistency::Fresh).await.unwrap();
    assert!(read.complete, "{read:?}");
    assert_eq!(read.value, remaining);
    let stock = tally.counter(STOCK).await.unwrap();
    assert_eq!((stock.spec.min, stock.spec.max, stock.spec.limit), (Some(STOCK_MIN), Some(STOCK_MAX), None));
    assert_eq!((stock.layout_shards, stock.spec.durability, stock.auto), (4, Durability::Sync, None));
    for i in 0..STOCK_TAKEN {
        let o = tally.incr(STOCK, Increment::new(-1).event_id(stock_event(i))).await.unwrap();
        assert!(!o.applied, "event {} counted twice", stock_event(i));
    }
    assert_eq!(tally.read(STOCK, Consistency::Fresh).await.unwrap().value, remaining);

    // The auto counter: its value, its bounds, its shard count.
    let busy = tally.counter(BUSY).await.unwrap();
    assert_eq!((busy.auto, busy.layout_shards, busy.spec.limit), (Some(busy_bounds()), 2, None));
    assert_eq!(tally.read(BUSY, Consistency::Fresh).await.unwrap().value, i128::from(BUSY_INCREMENTS));

    // It keeps working as a store of this release, across a restart: nothing is
    // counted twice, and the stock's ledgers hold exactly the headroom that was left
    // (taken after the restart, on the system's clock: a shard that borrows headroom
    // waits for time to pass, which the fixture's clock never does).
    tally.incr(BUSY, Increment::new(1)).await.unwrap();
    let tally = go_on_after_story_format_4(tally, &dir, credits).await;
    assert_eq!(tally.read(STOCK, Consistency::Fresh).await.unwrap().value, remaining);
    assert_eq!(tally.read(BUSY, Consistency::Fresh).await.unwrap().value, i128::from(BUSY_INCREMENTS) + 1);
    assert_eq!(tally.counter(BUSY).await.unwrap().auto, Some(busy_bounds()));
    check_stock_takes_exactly_what_remains(&tally).await;
    shut_down_in_this_format(tally, &dir).await;
}

async fn open_store_when_free(dir: &Path) -> SledStore {
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
    loop {
        match SledStore::open_path(dir) {
            Ok(s) => return s,
            Err(e) if e.to_string().contains("lock") && std::time::Instant::now() < deadline => {
                tokio::time::sleep(std::time::Duration::from_millis(20)).await;
            }
            Err(e) => panic!("reopening {}: {e}", dir.display()),
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_new_store_is_marked_and_a_store_of_an_unknown_format_is_refused_untouched() {
    let store = MemStore::new();
    let tally = Tally::open_with(Arc::new(store.clone()), Arc::new(SystemClock), config()).await.unwrap();
    tally.put_counter(CREDITS, spec(2, Durability::Sync)).await.unwrap();
    tally.incr(CREDITS, Increment::new(3)).await.unwrap();
    tally.shutdown().await.unwrap();
    let marker = Store::meta_get(&store, STORE_FORMAT_KEY).unwrap();
    assert_eq!(marker.as_deref(), Some(&encode_version(STORE_FORMAT)[..]));

    // A later release's store: refused by name and version, nothing written.
    let future = STORE_FORMAT + 1;
    Store::meta_put(&store, STORE_FORMAT_KEY, &encode_version(future)).unwrap();
    let opens_before = Store::meta_get(&store, b"engine:opens").unwrap();
    let err = Tally::open_with(Arc::new(store.clone()), Arc::new(SystemClock), config())
        .await
        .err()
        .expect("a store of an unknown format must be refused");
    let text = err.to_string();
    assert!(text.contains(&format!("format {future}")) && text.contains("engine store"), "{text}");
    assert_eq!(Store::meta_get(&store, b"engine:opens").unwrap(), opens_before);
    assert_eq!(
        Store::meta_get(&store, STORE_FORMAT_KEY).unwrap().as_deref(),
        Some(&encode_version(future)[..])
    );

    // A marker that is not a version is corruption, said as such.
    Store::meta_put(&store, STORE_FORMAT_KEY, b"x").unwrap();
    let err = Tally::open_with(Arc::new(store), Arc::new(SystemClock), config()).await.err().unwrap();
    assert!(err.to_string().contains("corrupt"), "{err}");
}
