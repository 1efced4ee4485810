//! t16: namespaces — the spec counters created implicitly under a name prefix take.
//! A bounded sync counter deleted and incremented again is the same bounded sync
//! counter (its contract is never lost by deleting it); the longest prefix wins; a
//! name under no namespace takes the node's default; a namespace's `ttl_ms` and
//! `shards: "auto"` reach its counters; namespaces survive a restart; and creating
//! counters through a namespace shares metadata commits as any creation does.

mod common;

use common::{quick_config, HookStore};
use std::sync::atomic::Ordering::SeqCst;
use std::sync::Arc;
use tally_core::namespace::NamespaceSpec;
use tally_engine::{
    AutoShards, Consistency, Durability, Increment, MemStore, SpecPatch, SystemClock, Tally, TallyConfig,
    TallyError,
};

fn sync_floor_zero() -> NamespaceSpec {
    NamespaceSpec {
        patch: SpecPatch {
            durability: Some(Durability::Sync),
            min: Some(0),
            shards: Some(4),
            ..Default::default()
        },
        ..Default::default()
    }
}

async fn open(store: &MemStore, config: TallyConfig) -> Tally {
    Tally::open_with(Arc::new(store.clone()), Arc::new(SystemClock), config).await.unwrap()
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_deleted_counter_comes_back_with_its_namespaces_contract() {
    let store = MemStore::new();
    let tally = open(&store, quick_config()).await;
    assert!(tally.put_namespace("stock:", sync_floor_zero()).await.unwrap(), "created");
    assert!(!tally.put_namespace("stock:", sync_floor_zero()).await.unwrap(), "replaced");
    for round in 0..2 {
        tally.incr("stock:sku-1", Increment::new(5)).await.unwrap();
        let spec = tally.counter("stock:sku-1").await.unwrap().spec;
        assert_eq!((spec.durability, spec.min, spec.shards), (Durability::Sync, Some(0), 4), "round {round}");
        for _ in 0..5 {
            tally.incr("stock:sku-1", Increment::new(-1)).await.unwrap();
        }
        let refused = tally.incr("stock:sku-1", Increment::new(-1)).await;
        assert!(matches!(refused, Err(TallyError::BoundExceeded { .. })), "round {round}: {refused:?}");
        assert_eq!(tally.read("stock:sku-1", Consistency::Fresh).await.unwrap().value, 0);
        tally.delete_counter("stock:sku-1").await.unwrap();
    }
    // The longest prefix wins; a name under none takes the built-in default.
    let two =
        NamespaceSpec { patch: SpecPatch { shards: Some(2), ..Default::default() }, ..Default::default() };
    tally.put_namespace("stock:eu:", two).await.unwrap();
    tally.incr("stock:eu:1", Increment::new(1)).await.unwrap();
    let spec = tally.counter("stock:eu:1").await.unwrap().spec;
    assert_eq!((spec.shards, spec.min, spec.durability), (2, None, Durability::Batched));
    tally.incr("likes:1", Increment::new(1)).await.unwrap();
    assert_eq!(tally.counter("likes:1").await.unwrap().spec.shards, 8);
    // An explicit spec is the caller's: a namespace fills only implicit creations.
    tally.put_counter("stock:explicit", SpecPatch { shards: Some(3), ..Default::default() }).await.unwrap();
    assert_eq!(tally.counter("stock:explicit").await.unwrap().spec.min, None);
    // What a creation would refuse is refused when declared.
    let batched_floor =
        NamespaceSpec { patch: SpecPatch { min: Some(0), ..Default::default() }, ..Default::default() };
    assert!(matches!(tally.put_namespace("bad:", batched_floor).await, Err(TallyError::InvalidSpec(_))));
    assert!(matches!(tally.put_namespace("", two).await, Err(TallyError::Namespace(_))));
    tally.shutdown().await.unwrap();
    drop(tally);
    // Namespaces are metadata: they survive a restart; deleting one leaves its
    // counters as they are.
    let tally = open(&store, quick_config()).await;
    assert_eq!(tally.namespace("stock:").unwrap(), sync_floor_zero());
    assert_eq!(tally.namespaces().unwrap().len(), 2);
    tally.delete_namespace("stock:").await.unwrap();
    assert!(matches!(tally.delete_namespace("stock:").await, Err(TallyError::NamespaceNotFound(_))));
    assert_eq!(tally.counter("stock:explicit").await.unwrap().spec.shards, 3);
    tally.incr("stock:sku-2", Increment::new(1)).await.unwrap();
    assert_eq!(tally.counter("stock:sku-2").await.unwrap().spec.min, None);
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn the_node_default_ttl_and_auto_reach_implicit_creations() {
    let store = MemStore::new();
    let default = NamespaceSpec {
        patch: SpecPatch { durability: Some(Durability::Sync), shards: Some(1), ..Default::default() },
        ..Default::default()
    };
    let tally = open(&store, TallyConfig { default_spec: default, ..quick_config() }).await;
    tally.incr("plain", Increment::new(1)).await.unwrap();
    let spec = tally.counter("plain").await.unwrap().spec;
    assert_eq!((spec.durability, spec.shards), (Durability::Sync, 1));
    let window = NamespaceSpec { ttl_ms: Some(60_000), ..Default::default() };
    tally.put_namespace("rl:", window).await.unwrap();
    let before = tally.now_ms();
    tally.incr("rl:u1", Increment::new(1)).await.unwrap();
    let at = tally.expiry("rl:u1").await.unwrap().0.expect("a deadline");
    assert!((before + 60_000..=tally.now_ms() + 60_000).contains(&at), "{at}");
    let auto =
        NamespaceSpec { auto: Some(AutoShards { min_shards: 2, max_shards: 16 }), ..Default::default() };
    tally.put_namespace("hot:", auto).await.unwrap();
    tally.incr("hot:1", Increment::new(1)).await.unwrap();
    let info = tally.counter("hot:1").await.unwrap();
    assert_eq!((info.auto, info.spec.shards), (auto.auto, 2));
    tally.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn creations_through_a_namespace_share_metadata_commits() {
    let store = HookStore::new(MemStore::new());
    let tally =
        Tally::open_with(Arc::new(store.clone()), Arc::new(SystemClock), quick_config()).await.unwrap();
    tally.put_namespace("acct:", sync_floor_zero()).await.unwrap();
    store.meta_batch_stall_ms.store(20, SeqCst);
    let before = store.meta_batches.load(SeqCst);
    const NEW: usize = 64;
    let tasks: Vec<_> = (0..NEW)
        .map(|i| {
            let t = tally.clone();
            tokio::spawn(async move { t.incr(&format!("acct:{i:02}"), Increment::new(1)).await })
        })
        .collect();
    for t in tasks {
        assert!(t.await.unwrap().unwrap().applied);
    }
    let commits = store.meta_batches.load(SeqCst) - before;
    assert!(commits * 4 <= NEW as u64, "{commits} metadata commits for {NEW} new counters");
    store.meta_batch_stall_ms.store(0, SeqCst);
    assert_eq!(tally.counter("acct:07").await.unwrap().spec.min, Some(0));
    tally.shutdown().await.unwrap();
}
