//! Failpoint tests. `fail` failpoints are process-global, so these live in their own test
//! binary (no other test's store can trip them) and run one at a time under
//! `fail::FailScenario`.
#![cfg(feature = "failpoints")]

use tally_core::ids::ShardId;
use tally_core::name::CounterName;
use tally_store::{DedupRecord, ShardImage, ShardWrite, SledStore, Store, StoreError};

fn shard() -> ShardId {
    ShardId::new(CounterName::new("likes").unwrap(), 0, 1)
}

fn write(value: i64, event: &str) -> ShardWrite {
    ShardWrite {
        image: ShardImage { value, sketch: Some(vec![value as u8]), frequency: None, escrow: None },
        dedup_put: vec![(event.to_owned(), DedupRecord { delta: value, applied_at_ms: 9 })],
        dedup_remove: vec!["old".to_owned()],
    }
}

#[test]
fn a_failed_commit_changes_nothing() {
    let scenario = fail::FailScenario::setup();
    let dir = tempfile::tempdir().unwrap();
    let store = SledStore::open_path(dir.path()).unwrap();
    store.commit(&shard(), &write(1, "old")).unwrap();
    let before = (store.load_shard(&shard()).unwrap(), store.dedup_scan(&shard(), None, 100).unwrap());

    fail::cfg("store::commit", "return").unwrap();
    assert_eq!(store.commit(&shard(), &write(2, "new")), Err(StoreError::Injected("store::commit")));
    fail::remove("store::commit");

    assert_eq!((store.load_shard(&shard()).unwrap(), store.dedup_scan(&shard(), None, 100).unwrap()), before);
    store.flush().unwrap();
    drop(store);
    let store = SledStore::open_path(dir.path()).unwrap();
    assert_eq!((store.load_shard(&shard()).unwrap(), store.dedup_scan(&shard(), None, 100).unwrap()), before);

    // The next commit goes through.
    store.commit(&shard(), &write(3, "new")).unwrap();
    assert_eq!(store.load_shard(&shard()).unwrap().value, 3);
    assert_eq!(store.dedup_scan(&shard(), None, 100).unwrap().len(), 1);
    scenario.teardown();
}

#[test]
fn every_io_call_has_a_failpoint() {
    let scenario = fail::FailScenario::setup();
    let dir = tempfile::tempdir().unwrap();
    let store = SledStore::open_path(dir.path()).unwrap();
    let id = shard();
    type Call = Box<dyn Fn(&SledStore) -> Result<(), StoreError>>;
    let calls: Vec<(&'static str, Call)> = vec![
        ("store::load", Box::new(|s| s.load_shard(&shard()).map(drop))),
        ("store::dedup_get", Box::new(|s| s.dedup_get(&shard(), "e").map(drop))),
        ("store::dedup_scan", Box::new(|s| s.dedup_scan(&shard(), None, 1).map(drop))),
        ("store::commit", Box::new(|s| s.commit(&shard(), &write(1, "e")))),
        (
            "store::commit_many",
            Box::new(|s| s.commit_many(&[(shard(), write(1, "e"))]).into_iter().collect()),
        ),
        ("store::shard_ids", Box::new(|s| s.shard_ids(None, 1).map(drop))),
        ("store::delete_shard", Box::new(|s| s.delete_shard(&shard()))),
        ("store::flush", Box::new(|s| s.flush())),
        ("store::meta_get", Box::new(|s| s.meta_get(b"k").map(drop))),
        ("store::meta_put", Box::new(|s| s.meta_put(b"k", b"v"))),
        ("store::meta_delete", Box::new(|s| s.meta_delete(b"k"))),
        ("store::meta_put_each", Box::new(|s| s.meta_put_each(&[(b"k".to_vec(), b"v".to_vec())]))),
        ("store::meta_scan", Box::new(|s| s.meta_scan(b"", None, 1).map(drop))),
    ];
    for (name, call) in calls {
        fail::cfg(name, "1*return").unwrap();
        assert_eq!(call(&store), Err(StoreError::Injected(name)), "{name}");
        // `1*` fires once; the next call goes through.
        assert_eq!(call(&store), Ok(()), "{name}");
        fail::remove(name);
    }
    assert_eq!(store.load_shard(&id).unwrap(), ShardImage::default());
    scenario.teardown();
}
