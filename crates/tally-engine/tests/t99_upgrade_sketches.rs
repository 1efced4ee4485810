//! t99: a store of format 2 (one-byte registers, one precision-25 list per sketch)
//! upgrades in place to packed registers, its distinct counts preserved.
//!
//! `tests/fixtures/store-format-2.tar.gz` holds a sled database written by the last
//! release of format 2: the counters of [`story`] — distinct ones whose sketches were
//! sparse, dense, and spread over 64 shards, plus a `sync` counter with event ids —
//! shut down cleanly. This release must open it, rewrite every sketch, read every
//! total and the very estimate a sketch of the same members gives today, and keep
//! every event id known.
//!
//! The fixture was made on that release, in `crates/tally-engine`, with
//! `TALLY_WRITE_FIXTURE=tests/fixtures/store-format-2 cargo test -p tally-engine --test t99_upgrade_sketches -- --ignored`
//! and `tar czf store-format-2.tar.gz store-format-2` in `tests/fixtures`; re-running
//! it on a later release writes that release's format instead (the story is the same,
//! so the checks below hold for both).

use std::path::{Path, PathBuf};
use std::sync::Arc;
use tally_core::sketch::{member_hash, DistinctSketch};
use tally_engine::{
    Consistency, Durability, Increment, ManualClock, SledStore, SpecPatch, Tally, TallyConfig,
};

/// A distinct counter of one shard whose sketch stayed sparse.
const SMALL: &str = "small";
/// A distinct counter of 4 shards whose sketches are dense.
const VISITORS: &str = "visitors";
/// A batched distinct counter of 64 shards.
const WIDE: &str = "wide";
/// A sync counter whose event ids must stay known.
const CREDITS: &str = "credits";

const SMALL_MEMBERS: u32 = 300;
const VISITOR_MEMBERS: u32 = 20_000;
/// Members seen twice: the second visit changes the total, not the estimate.
const VISITOR_REPEATS: u32 = 2_000;
const WIDE_MEMBERS: u32 = 50_000;
const CREDIT_EVENTS: i64 = 100;

fn fixture_archive() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/store-format-2.tar.gz")
}

fn config() -> TallyConfig {
    TallyConfig { call_timeout_ms: 10_000, ..TallyConfig::default() }
}

fn distinct(shards: u16, durability: Durability) -> SpecPatch {
    SpecPatch {
        shards: Some(shards),
        durability: Some(durability),
        distinct: Some(true),
        ..SpecPatch::default()
    }
}

fn member(prefix: &str, i: u32) -> String {
    format!("{prefix}-{i}")
}

/// What the fixture's release did to its store.
async fn story(tally: &Tally) {
    tally.put_counter(SMALL, distinct(1, Durability::Sync)).await.unwrap();
    for i in 0..SMALL_MEMBERS {
        tally.incr(SMALL, Increment::new(1).member(member("s", i))).await.unwrap();
    }
    tally.put_counter(VISITORS, distinct(4, Durability::Sync)).await.unwrap();
    for i in (0..VISITOR_MEMBERS).chain(0..VISITOR_REPEATS) {
        tally.incr(VISITORS, Increment::new(1).member(member("v", i))).await.unwrap();
    }
    tally.put_counter(WIDE, distinct(64, Durability::Batched)).await.unwrap();
    for i in 0..WIDE_MEMBERS {
        tally.incr(WIDE, Increment::new(1).member(member("w", i))).await.unwrap();
    }
    tally
        .put_counter(
            CREDITS,
            SpecPatch { shards: Some(8), durability: Some(Durability::Sync), ..SpecPatch::default() },
        )
        .await
        .unwrap();
    for i in 0..CREDIT_EVENTS {
        tally.incr(CREDITS, Increment::new(i + 1).event_id(format!("credit-{i}"))).await.unwrap();
    }
    tally.settle().await;
}

/// Today's estimate of a sketch of `n` members named `prefix-i`.
fn expected_estimate(prefix: &str, n: u32) -> u64 {
    let mut sketch = DistinctSketch::new();
    for i in 0..n {
        sketch.insert_hash(member_hash(&member(prefix, i)));
    }
    sketch.estimate()
}

/// Writes the fixture with this build (see the module docs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "writes the committed fixture; run by hand with TALLY_WRITE_FIXTURE"]
async fn write_fixture() {
    let dir = PathBuf::from(std::env::var("TALLY_WRITE_FIXTURE").expect("TALLY_WRITE_FIXTURE=DIR"));
    assert!(!dir.exists(), "{} exists: remove it first", dir.display());
    let tally = Tally::open(&dir, config()).await.unwrap();
    story(&tally).await;
    tally.shutdown().await.unwrap();
}

/// The estimates the format-2 release read from the fixture before it shut down
/// (`SMALL`, `VISITORS`, `WIDE`): what "preserved" means.
const FORMAT_2_ESTIMATES: [(&str, &str, u32, u64); 3] = [
    (SMALL, "s", SMALL_MEMBERS, 300),
    (VISITORS, "v", VISITOR_MEMBERS, 19_843),
    (WIDE, "w", WIDE_MEMBERS, 50_445),
];

/// The fixture unpacked in a fresh directory (opening a store writes to it): the
/// returned path is the database's directory.
fn fixture_copy() -> (tempfile::TempDir, PathBuf) {
    let to = tempfile::tempdir().unwrap();
    let status = std::process::Command::new("tar")
        .arg("xzf")
        .arg(fixture_archive())
        .arg("-C")
        .arg(to.path())
        .status()
        .expect("running tar");
    assert!(status.success(), "tar failed: {status}");
    let db = to.path().join("store-format-2");
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

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_store_of_format_2_upgrades_its_sketches_and_keeps_its_estimates() {
    let (_keep, dir) = fixture_copy();
    // A minute after the fixture was written, well within its counters' dedup window.
    let clock = ManualClock::new(written_at_ms(&dir) + 60_000);
    let store = SledStore::open_path(&dir).unwrap();
    let tally = Tally::open_with(Arc::new(store), Arc::new(clock), config()).await.unwrap();

    let totals = [
        (SMALL, i128::from(SMALL_MEMBERS)),
        (VISITORS, i128::from(VISITOR_MEMBERS + VISITOR_REPEATS)),
        (WIDE, i128::from(WIDE_MEMBERS)),
        (CREDITS, (1..=i128::from(CREDIT_EVENTS)).sum()),
    ];
    for (name, want) in totals {
        let read = tally.read(name, Consistency::Fresh).await.unwrap();
        assert!(read.complete, "{name}: {read:?}");
        assert_eq!(read.value, want, "{name}");
    }
    for (name, prefix, members, format_2) in FORMAT_2_ESTIMATES {
        let read = tally.distinct(name).await.unwrap();
        assert!(read.complete, "{name}: {read:?}");
        // Exactly the sketch of the same members built today...
        assert_eq!(read.estimate, expected_estimate(prefix, members), "{name}");
        // ...which reads what format 2 read.
        assert_eq!(read.estimate, format_2, "{name}");
        assert!(read.sketch_bytes > 0 && read.counter_bytes >= read.sketch_bytes, "{name}: {read:?}");
    }
    // A full sketch is packed: 4 dense shards cost 4 × 12 KiB, not 4 × 16 KiB.
    let visitors = tally.distinct(VISITORS).await.unwrap();
    assert!(visitors.counter_bytes <= 4 * 12_400, "{visitors:?}");
    for i in 0..CREDIT_EVENTS {
        let o = tally.incr(CREDITS, Increment::new(i + 1).event_id(format!("credit-{i}"))).await.unwrap();
        assert!(!o.applied, "credit-{i} counted twice");
    }

    // New members join the upgraded sketches; the store stays of this release.
    tally.incr(SMALL, Increment::new(1).member("s-new")).await.unwrap();
    tally.shutdown().await.unwrap();
    drop(tally);
    let tally = reopen(&dir).await;
    let mut want = DistinctSketch::new();
    for i in 0..SMALL_MEMBERS {
        want.insert_hash(member_hash(&member("s", i)));
    }
    want.insert_hash(member_hash("s-new"));
    assert_eq!(tally.distinct(SMALL).await.unwrap().estimate, want.estimate());
    assert_eq!(tally.distinct(WIDE).await.unwrap().estimate, expected_estimate("w", WIDE_MEMBERS));
    tally.shutdown().await.unwrap();
}
