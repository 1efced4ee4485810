//! t80: the cluster seam, in one process. Two engines share a catalog and split the
//! shards between them through a [`Placement`] whose calls go through the wire codec;
//! every increment, read, resharding and reconciliation must behave exactly as on one
//! node, and a node that cannot be reached shows up as missing shards, not a silent
//! partial sum (invariant 5).

mod common;

use futures::future::BoxFuture;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, OnceLock};
use tally_core::codec;
use tally_core::{CounterName, NodeId, ShardId};
use tally_engine::*;

/// Even shard indexes live on "a", odd ones on "b".
struct Split {
    me: NodeId,
    peer: OnceLock<Tally>,
    peer_down: Arc<AtomicBool>,
    /// When set, every third answer is lost after the peer acted on the request.
    lossy: Arc<AtomicBool>,
    /// Every call takes this long before it reaches the peer, in milliseconds.
    slow_ms: Arc<AtomicU64>,
    calls: AtomicU64,
}

impl Placement for Split {
    fn remote_owner(&self, id: &ShardId) -> Option<NodeId> {
        let owner = NodeId::new(if id.index % 2 == 0 { "a" } else { "b" });
        (owner != self.me).then_some(owner)
    }
    fn local_node(&self) -> NodeId {
        self.me.clone()
    }
    fn call<'a>(
        &'a self,
        node: &'a NodeId,
        request: ShardRequest,
    ) -> BoxFuture<'a, Result<ShardResponse, TallyError>> {
        Box::pin(async move {
            if self.peer_down.load(SeqCst) {
                return Err(TallyError::Unavailable { shard: node.to_string(), reason: "down".into() });
            }
            let slow = self.slow_ms.load(SeqCst);
            if slow > 0 {
                tokio::time::sleep(std::time::Duration::from_millis(slow)).await;
            }
            // Through the wire format, both ways.
            let request: ShardRequest = codec::decode("request", &codec::encode(&request)).unwrap();
            let peer = self.peer.get().expect("peer started");
            let response = peer.serve_shard_request(request).await;
            if self.lossy.load(SeqCst) && self.calls.fetch_add(1, SeqCst) % 3 == 2 {
                return Err(TallyError::Unavailable {
                    shard: node.to_string(),
                    reason: "answer lost".into(),
                });
            }
            Ok(codec::decode("response", &codec::encode(&response)).unwrap())
        })
    }
}

async fn two_nodes() -> (Tally, Tally, Arc<AtomicBool>) {
    let (a, b, down, _) = two_lossy_nodes().await;
    (a, b, down)
}

async fn two_lossy_nodes() -> (Tally, Tally, Arc<AtomicBool>, Arc<AtomicBool>) {
    let (a, b, down, lossy, _) = two_nodes_with(Arc::new(AtomicU64::new(0))).await;
    (a, b, down, lossy)
}

async fn two_nodes_with(
    slow_ms: Arc<AtomicU64>,
) -> (Tally, Tally, Arc<AtomicBool>, Arc<AtomicBool>, Arc<AtomicU64>) {
    let catalog: Arc<dyn Catalog> = Arc::new(common::SharedCatalog::default());
    two_nodes_on([catalog.clone(), catalog], slow_ms).await
}

/// Nodes `a` and `b`, each with its view of the metadata.
async fn two_nodes_on(
    catalogs: [Arc<dyn Catalog>; 2],
    slow_ms: Arc<AtomicU64>,
) -> (Tally, Tally, Arc<AtomicBool>, Arc<AtomicBool>, Arc<AtomicU64>) {
    let down = Arc::new(AtomicBool::new(false));
    let lossy = Arc::new(AtomicBool::new(false));
    let mk = |me: &str| {
        Arc::new(Split {
            me: NodeId::new(me),
            peer: OnceLock::new(),
            peer_down: down.clone(),
            lossy: lossy.clone(),
            slow_ms: slow_ms.clone(),
            calls: AtomicU64::new(0),
        })
    };
    let (pa, pb) = (mk("a"), mk("b"));
    let open = |p: Arc<Split>, name: &str, catalog: Arc<dyn Catalog>| {
        let config = TallyConfig { node_id: NodeId::new(name), call_timeout_ms: 5_000, ..Default::default() };
        let parts = EngineParts {
            store: Arc::new(MemStore::new()),
            clock: Arc::new(SystemClock),
            config,
            catalog: Some(catalog),
            placement: Some(p),
        };
        Tally::open_parts(parts)
    };
    let [ca, cb] = catalogs;
    let a = open(pa.clone(), "a", ca).await.unwrap();
    let b = open(pb.clone(), "b", cb).await.unwrap();
    let _ = pa.peer.set(b.clone());
    let _ = pb.peer.set(a.clone());
    (a, b, down, lossy, slow_ms)
}

fn spec(shards: u16, d: Durability) -> SpecPatch {
    SpecPatch { shards: Some(shards), durability: Some(d), ..Default::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn increments_through_both_nodes_sum_exactly_on_both() {
    let (a, b, _) = two_nodes().await;
    for d in [Durability::Sync, Durability::Batched] {
        let name = format!("c-{d}");
        a.put_counter(&name, spec(8, d)).await.unwrap();
        let mut tasks = Vec::new();
        for w in 0..8 {
            let node = if w % 2 == 0 { a.clone() } else { b.clone() };
            let name = name.clone();
            tasks.push(tokio::spawn(async move {
                for i in 0..100 {
                    let inc = Increment::new(1).event_id(format!("w{w}-{i}"));
                    assert!(node.incr(&name, inc.clone()).await.unwrap().applied);
                    assert!(node.incr(&name, inc).await.unwrap().duplicate);
                    node.incr(&name, Increment::new(2).writer(format!("w{w}"))).await.unwrap();
                }
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        // Each node holds buffered increments for the other's shards until it drains.
        let _ = b.read(&name, Consistency::Fresh).await.unwrap();
        let ra = a.read(&name, Consistency::Fresh).await.unwrap();
        let rb = b.read(&name, Consistency::Fresh).await.unwrap();
        assert_eq!((ra.value, rb.value), (2_400, 2_400), "{name}");
        assert!(ra.complete && rb.complete);
        let report = a.shards(&name).await.unwrap();
        let nodes: Vec<&str> = report.shards.iter().map(|s| s.node.as_str()).collect();
        assert_eq!(nodes, ["a", "b", "a", "b", "a", "b", "a", "b"]);
    }
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resharding_and_reconciliation_span_both_nodes() {
    let (a, b, _) = two_nodes().await;
    let patch = SpecPatch { distinct: Some(true), ..spec(4, Durability::Sync) };
    a.put_counter("c", patch).await.unwrap();
    for i in 0..200 {
        let node = if i % 2 == 0 { &a } else { &b };
        node.incr("c", Increment::new(1).event_id(format!("e{i}")).member(format!("m{}", i % 50)))
            .await
            .unwrap();
    }
    b.put_counter("c", SpecPatch { shards: Some(7), ..Default::default() }).await.unwrap();
    b.settle().await;
    for i in 0..200 {
        assert!(a.incr("c", Increment::new(1).event_id(format!("e{i}"))).await.unwrap().duplicate);
    }
    assert_eq!(a.read("c", Consistency::Fresh).await.unwrap().value, 200);
    assert_eq!(b.distinct("c").await.unwrap().estimate, 50);
    let r = a.reconcile("c", 250).await.unwrap();
    assert_eq!(r.drift, 50);
    assert_eq!(b.read("c", Consistency::Fresh).await.unwrap().value, 250);
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_unreachable_node_makes_reads_incomplete_not_wrong() {
    let (a, b, down) = two_nodes().await;
    a.put_counter("c", spec(4, Durability::Sync)).await.unwrap();
    for i in 0..40 {
        a.incr("c", Increment::new(1).event_id(format!("e{i}"))).await.unwrap();
    }
    down.store(true, SeqCst);
    let r = a.read("c", Consistency::Fresh).await.unwrap();
    assert!(!r.complete);
    assert_eq!(r.missing_shards, vec![1, 3]);
    // An increment whose shard is down fails and may be retried with its id.
    let odd =
        (0..).map(|i| format!("x{i}")).find(|id| tally_core::router::shard_of_event(id, 4) % 2 == 1).unwrap();
    let err = a.incr("c", Increment::new(1).event_id(odd.clone())).await.unwrap_err();
    assert_eq!(err.http_status(), 503, "{err}");
    down.store(false, SeqCst);
    a.incr("c", Increment::new(1).event_id(odd)).await.unwrap();
    let r = a.read("c", Consistency::Fresh).await.unwrap();
    assert!(r.complete);
    assert_eq!(r.value, 41);
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn lost_answers_to_drained_sums_neither_lose_nor_double() {
    let (a, b, _, lossy) = two_lossy_nodes().await;
    a.put_counter("v", SpecPatch { flush_ms: Some(10), ..spec(8, Durability::Batched) }).await.unwrap();
    lossy.store(true, SeqCst);
    // An anonymous increment that waits for a remote shard (its slot is not open yet)
    // and loses its answer is unknown to its writer; buffered ones are acknowledged.
    let (mut acked, mut unknown) = (0i128, 0i128);
    for round in 0..20 {
        for w in 0..8 {
            let node = if w % 2 == 0 { &a } else { &b };
            for _ in 0..50 {
                match node.incr("v", Increment::new(1).writer(format!("w{w}-{round}"))).await {
                    Ok(_) => acked += 1,
                    Err(_) => unknown += 1,
                }
            }
        }
        tokio::time::sleep(std::time::Duration::from_millis(15)).await;
    }
    // Let every in-doubt sum be resent and answered.
    lossy.store(false, SeqCst);
    tokio::time::sleep(std::time::Duration::from_millis(300)).await;
    let _ = a.read("v", Consistency::Fresh).await.unwrap();
    let _ = b.read("v", Consistency::Fresh).await.unwrap();
    tokio::time::sleep(std::time::Duration::from_millis(100)).await;
    let value = a.read("v", Consistency::Fresh).await.unwrap().value;
    assert!(acked > 7_000, "{acked}");
    assert!(value >= acked && value <= acked + unknown, "value {value}, acked {acked}, unknown {unknown}");
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconcile_refuses_a_total_read_with_shards_missing() {
    let (a, b, down) = two_nodes().await;
    a.put_counter("c", spec(4, Durability::Sync)).await.unwrap();
    for i in 0..100 {
        a.incr("c", Increment::new(1).event_id(format!("e{i}"))).await.unwrap();
    }
    down.store(true, SeqCst);
    // Half the shards cannot be read: correcting towards 100 from what is left would
    // write the missing half a second time.
    let err = a.reconcile("c", 100).await.unwrap_err();
    assert_eq!(err.http_status(), 503, "{err}");
    down.store(false, SeqCst);
    let r = a.read("c", Consistency::Fresh).await.unwrap();
    assert_eq!((r.value, r.complete), (100, true));
    let r = a.reconcile("c", 100).await.unwrap();
    assert_eq!((r.before, r.drift, r.corrected), (100, 0, false));
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shutdown_that_cannot_deliver_its_buffers_says_so() {
    let (a, b, down) = two_nodes().await;
    a.put_counter("v", SpecPatch { flush_ms: Some(60_000), ..spec(2, Durability::Batched) }).await.unwrap();
    // Open both slots, then buffer increments for b's shard.
    for w in 0..8 {
        a.incr("v", Increment::new(1).writer(format!("w{w}"))).await.unwrap();
    }
    for w in 0..64 {
        a.incr("v", Increment::new(1).writer(format!("w{w}"))).await.unwrap();
    }
    down.store(true, SeqCst);
    let err = a.shutdown().await.expect_err("buffered increments for b could not be delivered");
    assert_eq!(err.http_status(), 503, "{err}");
    assert!(err.to_string().contains("undelivered"), "{err}");
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_slow_node_delays_only_the_sums_bound_for_it() {
    let (a, b, _, _, slow) = two_nodes_with(Arc::new(AtomicU64::new(0))).await;
    let batched = |shards| SpecPatch { flush_ms: Some(20), ..spec(shards, Durability::Batched) };
    // "far" has a shard on b; "near" has one shard, on a.
    a.put_counter("far", batched(2)).await.unwrap();
    a.put_counter("near", batched(1)).await.unwrap();
    for w in 0..16 {
        a.incr("far", Increment::new(1).writer(format!("w{w}"))).await.unwrap();
    }
    a.incr("near", Increment::new(1)).await.unwrap();
    let _ = a.read("far", Consistency::Fresh).await.unwrap();
    // b now answers after 4 s; far's sums are drained first, near's after.
    slow.store(4_000, SeqCst);
    for w in 0..16 {
        a.incr("far", Increment::new(1).writer(format!("w{w}"))).await.unwrap();
    }
    for _ in 0..10 {
        a.incr("near", Increment::new(1)).await.unwrap();
    }
    let id = ShardId::new(CounterName::new("near").unwrap(), 0, 0);
    let mut applied = 0;
    for _ in 0..75 {
        tokio::time::sleep(std::time::Duration::from_millis(20)).await;
        applied = a.store().load_shard(&id).unwrap().value;
        if applied == 11 {
            break;
        }
    }
    assert_eq!(applied, 11, "near's buffer waited behind far's slow shard");
    slow.store(0, SeqCst);
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

/// A client that retries a reconciliation after a timeout, on another node, while
/// the first attempt still runs (a server finishes what it began): every run of a
/// counter goes one at a time, on the owner of its correction shard, so a run reads
/// the total after the one before it corrected, and none of them overshoots.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn reconciliations_of_one_counter_on_both_nodes_go_one_at_a_time() {
    let (a, b, _, _, slow_ms) = two_nodes_with(Arc::new(AtomicU64::new(0))).await;
    a.put_counter("c", spec(2, Durability::Sync)).await.unwrap();
    a.incr("c", Increment::new(7).event_id("seven")).await.unwrap();
    // Remote calls take a while, so runs on the two nodes overlap.
    slow_ms.store(50, SeqCst);
    let mut runs = Vec::new();
    for i in 0..8 {
        let node = if i % 2 == 0 { a.clone() } else { b.clone() };
        runs.push(tokio::spawn(async move { node.reconcile("c", 100).await.unwrap() }));
    }
    let mut corrected = 0;
    for run in runs {
        corrected += usize::from(run.await.unwrap().corrected);
    }
    slow_ms.store(0, SeqCst);
    assert_eq!(a.read("c", Consistency::Fresh).await.unwrap().value, 100);
    assert_eq!(b.read("c", Consistency::Fresh).await.unwrap().value, 100);
    assert_eq!(corrected, 1, "one run corrects, the others find no drift");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_fresh_read_on_a_node_whose_metadata_lags_a_creation_finds_the_counter() {
    let shared = common::SharedCatalog::default();
    let lagging = shared.view(Arc::new(AtomicBool::new(false)));
    lagging.unapplied.lock().unwrap().insert("born:a".into());
    let (a, b, ..) =
        two_nodes_on([Arc::new(shared), Arc::new(lagging.clone())], Arc::new(AtomicU64::new(0))).await;
    // One shard, on `a`: `b` is never asked to serve what it does not know of.
    a.put_counter("born:a", spec(1, Durability::Sync)).await.unwrap();
    for i in 0..10 {
        assert!(a.incr("born:a", Increment::new(1).event_id(format!("e{i}"))).await.unwrap().applied);
    }
    // `b` has not applied the creation: its read asks the metadata group's latest.
    let read = b.read("born:a", Consistency::Fresh).await.unwrap();
    assert_eq!((read.value, read.complete), (10, true));
    // A counter that exists nowhere is still missing.
    assert!(matches!(b.read("born:none", Consistency::Fresh).await, Err(TallyError::NotFound(_))));
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_behind_a_deletion_never_sums_the_old_counters_shards_as_complete() {
    let (a, b, _) = two_nodes().await;
    // One shard, on `a`.
    a.put_counter("gone:a", spec(1, Durability::Sync)).await.unwrap();
    for i in 0..10 {
        assert!(a.incr("gone:a", Increment::new(1).event_id(format!("e{i}"))).await.unwrap().applied);
    }
    // `b` reads it and keeps its metadata: this catalog tells no engine of a change,
    // as a node cut off from the metadata group hears of none.
    assert_eq!(b.read("gone:a", Consistency::Fresh).await.unwrap().value, 10);
    a.delete_counter("gone:a").await.unwrap();
    let read = b.read("gone:a", Consistency::Fresh).await;
    assert!(read.as_ref().is_ok_and(|r| !r.complete), "a deleted counter read as complete: {read:?}");
    // Re-created with two shards under the same name: `b`'s layout of the old
    // counter names shard 0 only, and must not sum it as the new counter's total.
    tokio::time::sleep(std::time::Duration::from_millis(5)).await;
    a.put_counter("gone:a", spec(2, Durability::Sync)).await.unwrap();
    let read = b.read("gone:a", Consistency::Fresh).await;
    assert!(read.as_ref().is_ok_and(|r| !r.complete), "the old layout read as complete: {read:?}");
    for i in 0..10 {
        assert!(a.incr("gone:a", Increment::new(1).event_id(format!("n{i}"))).await.unwrap().applied);
    }
    // `b` hears of the change only now, when its metadata holds both the deletion
    // and the re-creation (versions start again with each incarnation): it takes
    // the new counter, not the old one it knew, and reads what `a` reads.
    b.metadata_changed("gone:a").await.unwrap();
    let on_a = a.read("gone:a", Consistency::Fresh).await.unwrap();
    let on_b = b.read("gone:a", Consistency::Fresh).await.unwrap();
    assert!(on_a.complete && on_a.value >= 10, "{on_a:?}");
    assert_eq!((on_b.value, on_b.complete), (on_a.value, true), "{on_b:?}");
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}
