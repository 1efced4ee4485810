//! t30: a raft database written by an earlier release opens and holds the same state.
//!
//! `tests/fixtures/raft-format-1.tar.gz` is the directory of a one-node metadata
//! group written in raft store format 1 by [`story`]: counters created with every spec field, a resharding completed
//! and one in progress, a counter deleted (a tombstone), members changed, with a
//! snapshot taken part-way so the database holds a snapshot *and* log entries after
//! it. This release must start on it, apply nothing twice, and hold the same state.
//!
//! Made on a release of that format, in `crates/tally-raft`, with
//! `TALLY_WRITE_FIXTURE=tests/fixtures/raft-format-1 cargo test -p tally-raft --test t30_upgrade -- --ignored --exact write_fixture`
//! and `tar czf raft-format-1.tar.gz raft-format-1` in `tests/fixtures`.
//!
//! `tests/fixtures/raft-format-3.tar.gz` is the same story written in raft store
//! format 3 (the last before bounds), with a counter that keeps frequencies and
//! windows created and its windows changed before the resharding left in progress, so
//! windowed specs sit in the snapshot, the state machine and the log. Made on that
//! release the same way, with
//! `TALLY_WRITE_FIXTURE=tests/fixtures/raft-format-3 cargo test -p tally-raft --test t30_upgrade -- --ignored --exact write_fixture_with_windows`.
//!
//! `tests/fixtures/raft-format-4.tar.gz` is the story of format 3 written in raft
//! store format 4 (the last before auto bounds), with a bounded counter created too;
//! its snapshot's state has no auto bounds. Made on that release with
//! `TALLY_WRITE_FIXTURE=tests/fixtures/raft-format-4 cargo test -p tally-raft --test t30_upgrade -- --ignored --exact write_fixture_with_bounds`.
//!
//! `tests/fixtures/raft-format-5.tar.gz` is the story of format 4 written in raft
//! store format 5 (the last before window limits), with auto counters too: one
//! created, raised and the raise completed before the last snapshot, and after it, in
//! the log only, its bounds changed, a second one created with its spec and a raise
//! of it left in progress, and a second bounded counter created. Made on that release
//! (commit bef1a93) with
//! `TALLY_WRITE_FIXTURE=tests/fixtures/raft-format-5 cargo test -p tally-raft --test t30_upgrade -- --ignored --exact write_fixture_with_auto`;
//! that release's writer had no auto requests, so the story's `auto` part and
//! [`write_fixture_with_auto`] were added to it there, as they read here.
//!
//! `tests/fixtures/raft-format-6.tar.gz` is the same story written in raft store
//! format 6 (window limits, before counters had a replica count of their own), made
//! on that release (commit 845ee8c) with
//! `TALLY_WRITE_FIXTURE=tests/fixtures/raft-format-6 cargo test -p tally-raft --test t30_upgrade -- --ignored --exact write_fixture_with_auto`.
//!
//! `tests/fixtures/raft-format-7.tar.gz` is the same story written in raft store
//! format 7 (counters' own replica counts, before the proposal book), made on that
//! release (commit 65ab1a4) the same way.
//!
//! `tests/fixtures/raft-format-8.tar.gz` is the same story written in raft store
//! format 8 (the proposal book, before counters' expiry and namespaces), made on that
//! release (commit a0f8dd4) the same way: every request went out as a proposal, so
//! its snapshot and state machine hold a proposal book whose answers carry counters
//! of format 8's layout.
//!
//! `tests/fixtures/raft-format-9.tar.gz` is the same story written in raft store
//! format 9 (counters' expiry and namespaces, each proposer's whole proposal book in
//! one record), made on that release (commit 347ec11) the same way.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::time::{Duration, Instant};
use tally_core::format::{encode_version, RAFT_STORE_FORMAT};
use tally_core::frequency::FrequencySpec;
use tally_core::meta::MetaCommand;
use tally_core::name::CounterName;
use tally_core::spec::{AutoShards, CounterSpec, Durability, RouterPolicy, SpecPatch};
use tally_core::window::WindowSet;
use tally_raft::{MetaRaft, MetaRaftConfig, RaftStorage, Request};
use tokio::net::TcpListener;

const NOW_MS: u64 = 1_700_000_000_000;

fn counter(name: &str, cmd: MetaCommand) -> Request {
    Request::Counter { name: CounterName::new(name).unwrap(), cmd, now_ms: NOW_MS }
}

fn full_patch() -> SpecPatch {
    SpecPatch {
        shards: Some(16),
        durability: Some(Durability::Sync),
        flush_ms: Some(50),
        rollup_ms: Some(250),
        router: Some(RouterPolicy::RoundRobin),
        distinct: Some(true),
        dedup_window_s: Some(3_600),
        ..SpecPatch::default()
    }
}

/// The windowed counter's creation (raft store format 3 on).
fn windowed_patch() -> SpecPatch {
    SpecPatch {
        shards: Some(4),
        durability: Some(Durability::Sync),
        distinct: Some(true),
        frequency: Some(FrequencySpec { epsilon: 0.01, delta: 0.001 }),
        windows: Some(WindowSet::parse(&["1m", "1h"]).unwrap()),
        ..SpecPatch::default()
    }
}

/// The windowed counter's change of windows.
fn rewindowed_patch() -> SpecPatch {
    SpecPatch { windows: Some(WindowSet::parse(&["1h", "1d"]).unwrap()), ..SpecPatch::default() }
}

/// Starts the one-node group of `dir`, on a fresh port, and waits for it to lead.
async fn one_node(dir: &Path) -> MetaRaft {
    let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap().to_string();
    let mut cfg = MetaRaftConfig::new(1, BTreeMap::from([(1, addr)]), RaftStorage::Path(dir.into()));
    cfg.heartbeat_ms = 100;
    cfg.election_timeout_min_ms = 300;
    cfg.election_timeout_max_ms = 600;
    cfg.snapshot_logs_since_last = 8;
    cfg.snapshot_logs_kept = 2;
    let node = MetaRaft::start_with_listener(cfg, listener).await.expect("the node starts");
    let deadline = Instant::now() + Duration::from_secs(15);
    while node.leader() != Some(1) || node.store_of(1).is_none() {
        assert!(Instant::now() < deadline, "no leader");
        tokio::time::sleep(Duration::from_millis(20)).await;
    }
    node
}

/// A bounded counter's creation (raft store format 4 on).
fn bounded_patch() -> SpecPatch {
    SpecPatch {
        shards: Some(4),
        durability: Some(Durability::Sync),
        min: Some(0),
        max: Some(1_000),
        ..SpecPatch::default()
    }
}

/// The auto counter's bounds (raft store format 5 on).
fn auto_bounds() -> AutoShards {
    AutoShards { min_shards: 2, max_shards: 16 }
}

/// The auto counter's bounds after the change the story ends with.
fn auto_bounds_changed() -> AutoShards {
    AutoShards { min_shards: 2, max_shards: 8 }
}

/// The late auto counter's creation (raft store format 5 on).
fn auto_late_patch() -> SpecPatch {
    SpecPatch { shards: Some(2), distinct: Some(true), ..SpecPatch::default() }
}

/// The late bounded counter's creation.
fn bounded_late_patch() -> SpecPatch {
    SpecPatch {
        shards: Some(2),
        durability: Some(Durability::Sync),
        min: Some(-5),
        max: Some(5),
        ..SpecPatch::default()
    }
}

/// What the fixture's release wrote; `windowed`: the requests only a release with
/// windows could write, too; `bounded`: those only a release with bounds could;
/// `auto`: those only a release with auto bounds could.
async fn story(node: &MetaRaft, windowed: bool, bounded: bool, auto: bool) {
    node.write(counter("full", MetaCommand::Put(full_patch()))).await.unwrap();
    node.write(counter("plain", MetaCommand::Ensure)).await.unwrap();
    for i in 0..12 {
        node.write(counter(&format!("many:{i}"), MetaCommand::Ensure)).await.unwrap();
    }
    node.write(counter("r", MetaCommand::Ensure)).await.unwrap();
    node.write(counter("r", MetaCommand::Put(SpecPatch { shards: Some(4), ..Default::default() })))
        .await
        .unwrap();
    node.write(counter("r", MetaCommand::CompleteReshard { generation: 0, sealed_sum: 7 })).await.unwrap();
    node.write(counter("gone", MetaCommand::Ensure)).await.unwrap();
    node.write(counter("gone", MetaCommand::Delete)).await.unwrap();
    let set = Request::SetMembers { from_epoch: 0, previous: vec![], members: vec!["node1".into()] };
    node.write(set).await.unwrap();
    if windowed {
        node.write(counter("windowed", MetaCommand::Put(windowed_patch()))).await.unwrap();
        node.write(counter("windowed", MetaCommand::Put(rewindowed_patch()))).await.unwrap();
    }
    if bounded {
        node.write(counter("bounded", MetaCommand::Put(bounded_patch()))).await.unwrap();
    }
    if auto {
        // An auto counter created at 2 shards, raised to 4 and the raise completed.
        let name = CounterName::new("auto").unwrap();
        let put = MetaCommand::Put(SpecPatch { shards: Some(2), ..SpecPatch::default() });
        let create =
            Request::CounterAuto { name: name.clone(), cmd: put, auto: Some(auto_bounds()), now_ms: NOW_MS };
        node.write(create).await.unwrap();
        let version = node.counter("auto").expect("the auto counter exists").version;
        node.write(Request::AutoReshard { name, version, shards: 4, now_ms: NOW_MS }).await.unwrap();
        node.write(counter("auto", MetaCommand::CompleteReshard { generation: 0, sealed_sum: 5 }))
            .await
            .unwrap();
    }
    // Last, so it sits in the log after the snapshot: a resharding left in progress.
    node.write(counter("moving", MetaCommand::Put(SpecPatch { shards: Some(2), ..Default::default() })))
        .await
        .unwrap();
    node.write(counter("moving", MetaCommand::Put(SpecPatch { shards: Some(3), ..Default::default() })))
        .await
        .unwrap();
    if auto {
        // After the last snapshot, in the log only: new bounds for the auto counter, an
        // auto counter created with a spec and a raise of it left in progress, and a
        // bounded counter created.
        let name = CounterName::new("auto").unwrap();
        let bounds = Some(auto_bounds_changed());
        node.write(Request::CounterAuto { name, cmd: MetaCommand::Ensure, auto: bounds, now_ms: NOW_MS })
            .await
            .unwrap();
        let name = CounterName::new("auto-late").unwrap();
        let put = MetaCommand::Put(auto_late_patch());
        let create =
            Request::CounterAuto { name: name.clone(), cmd: put, auto: Some(auto_bounds()), now_ms: NOW_MS };
        node.write(create).await.unwrap();
        let version = node.counter("auto-late").expect("the auto counter exists").version;
        node.write(Request::AutoReshard { name, version, shards: 3, now_ms: NOW_MS }).await.unwrap();
        node.write(counter("bounded-late", MetaCommand::Put(bounded_late_patch()))).await.unwrap();
    }
}

/// Writes a fixture with this build, in its raft store format.
async fn write(windowed: bool, bounded: bool, auto: bool) {
    let dir = PathBuf::from(std::env::var("TALLY_WRITE_FIXTURE").expect("TALLY_WRITE_FIXTURE=DIR"));
    assert!(!dir.exists(), "{} exists: remove it first", dir.display());
    let node = one_node(&dir).await;
    story(&node, windowed, bounded, auto).await;
    node.shutdown().await;
}

/// Writes the first format's fixture (see the module docs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "writes the committed fixture; run by hand with TALLY_WRITE_FIXTURE"]
async fn write_fixture() {
    write(false, false, false).await;
}

/// Writes the format-3 fixture (see the module docs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "writes the committed fixture; run by hand with TALLY_WRITE_FIXTURE"]
async fn write_fixture_with_windows() {
    write(true, false, false).await;
}

/// Writes the format-4 fixture (see the module docs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "writes the committed fixture; run by hand with TALLY_WRITE_FIXTURE"]
async fn write_fixture_with_bounds() {
    write(true, true, false).await;
}

/// Writes the format-5 fixture (see the module docs).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
#[ignore = "writes the committed fixture; run by hand with TALLY_WRITE_FIXTURE"]
async fn write_fixture_with_auto() {
    write(true, true, true).await;
}

/// The fixture `name` unpacked in a fresh directory (starting a node writes to it):
/// the returned path is the database's directory.
fn fixture_copy(name: &str) -> (tempfile::TempDir, PathBuf) {
    let unpacked = tempfile::tempdir().unwrap();
    let archive = Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("tests/fixtures/{name}.tar.gz"));
    let status =
        std::process::Command::new("tar").arg("xzf").arg(&archive).arg("-C").arg(unpacked.path()).status();
    assert!(status.expect("running tar").success());
    let dir = unpacked.path().join(name);
    (unpacked, dir)
}

/// The raft database's format marker, read once the node that had it open has let
/// go of it (sled locks the directory).
async fn format_marker(dir: &Path) -> Option<Vec<u8>> {
    let deadline = Instant::now() + Duration::from_secs(10);
    let db = loop {
        match sled::open(dir) {
            Ok(db) => break db,
            Err(e) if e.to_string().contains("lock") && Instant::now() < deadline => {
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
            Err(e) => panic!("opening {}: {e}", dir.display()),
        }
    };
    let marker = db.open_tree("raft_identity").unwrap().get(b"format").unwrap();
    marker.map(|m| m.to_vec())
}

/// Checks the state the story leaves (every format's fixture holds it); returns how
/// many requests were applied.
fn check_story(node: &MetaRaft) -> u64 {
    let state = node.state();
    let full = &state.counters["full"];
    let want = CounterSpec::default().patched(&full_patch()).unwrap();
    assert_eq!(full.spec, want);
    assert_eq!(full.created_at_ms, NOW_MS);
    assert_eq!(state.counters["plain"].spec, CounterSpec::default());
    assert_eq!((0..12).filter(|i| state.counters.contains_key(format!("many:{i}").as_str())).count(), 12);
    let r = &state.counters["r"];
    assert_eq!((r.layout.generation, r.layout.shards, r.layout.base, r.layout.resharding), (1, 4, 7, None));
    let moving = &state.counters["moving"];
    assert_eq!((moving.spec.shards, moving.layout.resharding), (3, Some(3)));
    assert!(!state.counters.contains_key("gone"));
    assert_eq!(state.tombstones.get("gone"), Some(&vec![(0, 8)]));
    assert_eq!(state.members, vec!["node1".to_string()]);
    state.applied_requests
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raft_database_of_the_first_format_holds_the_same_state() {
    let (_keep, dir) = fixture_copy("raft-format-1");
    assert_eq!(format_marker(&dir).await, Some(encode_version(1).to_vec()), "the fixture is of format 1");

    let node = one_node(&dir).await;
    // The story's 22 requests plus the store registration, each applied once.
    assert_eq!(check_story(&node), 23);
    assert!(!node.state().counters.contains_key("windowed"));

    // It goes on as a database of this release.
    node.write(counter("after", MetaCommand::Ensure)).await.unwrap();
    assert!(node.counter("after").is_some());
    node.shutdown().await;
    drop(node);
    assert_eq!(format_marker(&dir).await, Some(encode_version(RAFT_STORE_FORMAT).to_vec()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raft_database_of_format_3_holds_the_same_state_with_its_windows_and_no_bounds() {
    let (_keep, dir) = fixture_copy("raft-format-3");
    assert_eq!(format_marker(&dir).await, Some(encode_version(3).to_vec()));

    let node = one_node(&dir).await;
    // The story's 24 requests plus the store registration, each applied once.
    assert_eq!(check_story(&node), 25);
    let windowed = node.state().counters["windowed"].clone();
    let want =
        CounterSpec::default().patched(&windowed_patch()).unwrap().patched(&rewindowed_patch()).unwrap();
    assert_eq!(windowed.spec, want);
    assert_eq!((windowed.spec.windows.len(), windowed.spec.min, windowed.spec.max), (2, None, None));
    assert_eq!(windowed.spec.frequency, Some(FrequencySpec { epsilon: 0.01, delta: 0.001 }));
    assert_eq!((windowed.created_at_ms, windowed.layout.shards), (NOW_MS, 4));

    // It goes on as a database of this release: the upgraded counter changes as any.
    let patch = SpecPatch { windows: Some(WindowSet::parse(&["1m"]).unwrap()), ..SpecPatch::default() };
    node.write(counter("windowed", MetaCommand::Put(patch))).await.unwrap();
    assert_eq!(node.counter("windowed").unwrap().spec.windows, WindowSet::parse(&["1m"]).unwrap());
    node.shutdown().await;
    drop(node);
    assert_eq!(format_marker(&dir).await, Some(encode_version(RAFT_STORE_FORMAT).to_vec()));
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raft_database_of_format_4_holds_the_same_state_with_its_bounds_and_takes_auto_bounds() {
    let (_keep, dir) = fixture_copy("raft-format-4");
    assert_eq!(format_marker(&dir).await, Some(encode_version(4).to_vec()));

    let node = one_node(&dir).await;
    // The story's 25 requests plus the store registration, each applied once.
    assert_eq!(check_story(&node), 26);
    let bounded = node.state().counters["bounded"].clone();
    assert_eq!(bounded.spec, CounterSpec::default().patched(&bounded_patch()).unwrap());
    assert_eq!((bounded.spec.min, bounded.spec.max, bounded.layout.shards), (Some(0), Some(1_000), 4));
    assert!(node.auto_counters().is_empty());

    // It goes on as a database of this release: a counter becomes auto, and the
    // bounds survive a restart (and the snapshots taken meanwhile).
    let bounds = AutoShards { min_shards: 2, max_shards: 16 };
    let name = CounterName::new("auto").unwrap();
    let put = MetaCommand::Put(SpecPatch { shards: Some(2), ..SpecPatch::default() });
    node.write(Request::CounterAuto { name: name.clone(), cmd: put, auto: Some(bounds), now_ms: NOW_MS })
        .await
        .unwrap();
    for i in 0..10 {
        node.write(counter(&format!("after:{i}"), MetaCommand::Ensure)).await.unwrap();
    }
    node.shutdown().await;
    drop(node);
    assert_eq!(format_marker(&dir).await, Some(encode_version(RAFT_STORE_FORMAT).to_vec()));
    let node = one_node(&dir).await;
    assert_eq!(node.auto_counters(), vec![(name, bounds)]);
    // Nothing applied twice across the restart.
    assert_eq!(check_story(&node), 26 + 11);
    node.shutdown().await;
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raft_database_of_format_5_holds_the_same_state_with_its_bounds_and_auto_bounds_and_no_limits() {
    holds_the_same_state_as_format_5("raft-format-5", 5).await;
}

/// Format 6's story is format 5's: counters of both take the cluster's replicas.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raft_database_of_format_6_holds_the_same_state_with_the_clusters_replicas() {
    holds_the_same_state_as_format_5("raft-format-6", 6).await;
}

/// Format 7's story is format 5's too, written before the proposal book: the
/// upgrade rewrites its snapshot with an empty book, and proposals go on from there.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raft_database_of_format_7_holds_the_same_state_and_starts_a_proposal_book() {
    holds_the_same_state_as_format_5("raft-format-7", 7).await;
}

/// Format 8's story is format 5's too, written with the proposal book: the upgrade
/// rewrites its counters (in records, the snapshot and the book's answers) without
/// deadlines, the book keeps every answer, and deadlines and namespaces go on from
/// there across a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raft_database_of_format_8_keeps_its_proposal_book_and_takes_deadlines_and_namespaces() {
    holds_the_same_state_as_format_5("raft-format-8", 8).await;

    let (_keep, dir) = fixture_copy("raft-format-8");
    let node = one_node(&dir).await;
    let state = node.state();
    let answered: Vec<&tally_raft::Response> =
        state.proposals.values().flat_map(|p| p.answered.values()).collect();
    assert!(answered.len() >= 30, "the story's proposals are remembered: {}", answered.len());
    let counters_answered = answered
        .iter()
        .filter_map(|r| match r {
            tally_raft::Response::Counter(Ok((Some(meta), _))) => Some(meta),
            _ => None,
        })
        .inspect(|meta| assert_eq!(meta.expires_at_ms, None, "an upgraded answer has no deadline"))
        .count();
    assert!(counters_answered > 10, "{counters_answered}");
    assert!(state.counters.values().all(|m| m.expires_at_ms.is_none()));
    assert!(state.namespaces.is_empty());

    let deadline = NOW_MS + 3_600_000;
    let when = tally_core::expiry::Condition::Always;
    node.write(counter("plain", MetaCommand::Expire { at_ms: deadline, when })).await.unwrap();
    let spec = tally_core::namespace::NamespaceSpec {
        patch: SpecPatch { durability: Some(Durability::Sync), min: Some(0), ..SpecPatch::default() },
        ..Default::default()
    };
    node.write(Request::PutNamespace { prefix: "stock:".into(), spec }).await.unwrap();
    node.shutdown().await;
    drop(node);
    let node = one_node(&dir).await;
    assert_eq!(node.counter("plain").unwrap().expires_at_ms, Some(deadline));
    assert_eq!(node.state().namespaces.get("stock:"), Some(&spec));
    node.shutdown().await;
}

/// Format 10 keeps each answer of the proposal book in a record of its own: the
/// upgrade splits format 9's books, and the book reads back whole across a restart.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_raft_database_of_format_9_keeps_its_proposal_book_in_one_record_per_answer() {
    holds_the_same_state_as_format_5("raft-format-9", 9).await;

    let (_keep, dir) = fixture_copy("raft-format-9");
    let node = one_node(&dir).await;
    let book = node.state().proposals;
    let answered: usize = book.values().map(|p| p.answered.len()).sum();
    assert!(answered >= 30, "the story's proposals are remembered: {answered}");
    node.write(counter("after", MetaCommand::Ensure)).await.unwrap();
    let grown = node.state().proposals;
    node.shutdown().await;
    drop(node);
    let node = one_node(&dir).await;
    assert_eq!(node.state().proposals, grown, "the book reads back as it was");
    assert_eq!(grown.values().map(|p| p.answered.len()).sum::<usize>(), answered + 1);
    for (proposer, p) in &book {
        assert_eq!(grown[proposer].answered, p.answered, "the fixture's answers are kept as they were");
    }
    node.shutdown().await;
}

/// Opens the fixture `name`, of `format`, holding the story with auto counters
/// ([`write_fixture_with_auto`]), checks it, and goes on writing in this release's
/// format across a restart.
async fn holds_the_same_state_as_format_5(name: &str, format: u32) {
    let (_keep, dir) = fixture_copy(name);
    assert_eq!(format_marker(&dir).await, Some(encode_version(format).to_vec()), "the fixture's format");

    let node = one_node(&dir).await;
    // The story's 32 requests plus the store registration, each applied once.
    assert_eq!(check_story(&node), 33);
    let state = node.state();
    for (name, meta) in &state.counters {
        assert_eq!(meta.spec.limit, None, "{name}: an upgraded counter has no window limit");
        assert_eq!(meta.spec.replicas, None, "{name}: an upgraded counter takes the cluster's replicas");
    }
    let windowed = &state.counters["windowed"];
    let want =
        CounterSpec::default().patched(&windowed_patch()).unwrap().patched(&rewindowed_patch()).unwrap();
    assert_eq!(windowed.spec, want);
    let bounded = &state.counters["bounded"];
    assert_eq!(bounded.spec, CounterSpec::default().patched(&bounded_patch()).unwrap());
    assert_eq!((bounded.spec.min, bounded.spec.max, bounded.layout.shards), (Some(0), Some(1_000), 4));
    let late = &state.counters["bounded-late"];
    assert_eq!(late.spec, CounterSpec::default().patched(&bounded_late_patch()).unwrap());
    assert_eq!((late.spec.min, late.spec.max), (Some(-5), Some(5)));
    // The auto counters: bounds, raises done and in progress, as written.
    let auto = &state.counters["auto"];
    assert_eq!((auto.spec.shards, auto.layout.generation, auto.layout.shards), (4, 1, 4));
    assert_eq!((auto.layout.base, auto.layout.resharding), (5, None));
    let auto_late = &state.counters["auto-late"];
    assert_eq!(
        auto_late.spec,
        CounterSpec::default()
            .patched(&auto_late_patch())
            .unwrap()
            .patched(&SpecPatch { shards: Some(3), ..SpecPatch::default() })
            .unwrap()
    );
    assert_eq!((auto_late.layout.shards, auto_late.layout.resharding), (2, Some(3)));
    let auto_name = CounterName::new("auto").unwrap();
    let auto_late_name = CounterName::new("auto-late").unwrap();
    let autos = vec![(auto_name.clone(), auto_bounds_changed()), (auto_late_name.clone(), auto_bounds())];
    assert_eq!(node.auto_counters(), autos);

    // It goes on as a database of this release: a counter with a window limit is
    // created, an upgraded auto counter is raised, and all of it survives a restart
    // (and the snapshots taken meanwhile).
    let limit = tally_core::spec::WindowLimit::parse("1m", 100).unwrap();
    let limited = SpecPatch {
        shards: Some(2),
        durability: Some(Durability::Sync),
        windows: Some(WindowSet::parse(&["1m", "1h"]).unwrap()),
        limit: Some(limit),
        replicas: Some(3),
        ..SpecPatch::default()
    };
    node.write(counter("limited", MetaCommand::Put(limited))).await.unwrap();
    let version = auto.version;
    let raise = Request::AutoReshard { name: auto_name, version, shards: 8, now_ms: NOW_MS };
    node.write(raise).await.unwrap();
    for i in 0..10 {
        node.write(counter(&format!("after:{i}"), MetaCommand::Ensure)).await.unwrap();
    }
    node.shutdown().await;
    drop(node);
    assert_eq!(format_marker(&dir).await, Some(encode_version(RAFT_STORE_FORMAT).to_vec()));
    let node = one_node(&dir).await;
    // Nothing applied twice across the restart.
    assert_eq!(check_story(&node), 33 + 12);
    assert_eq!(node.counter("limited").unwrap().spec.limit, Some(limit));
    assert_eq!(node.counter("limited").unwrap().spec.replicas, Some(3));
    assert_eq!(node.counter("auto").unwrap().layout.resharding, Some(8));
    assert_eq!(node.counter("bounded").unwrap().spec.max, Some(1_000));
    assert_eq!(node.auto_counters(), autos);
    node.shutdown().await;
}
