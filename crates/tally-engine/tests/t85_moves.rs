//! t85: shards that change hands — sealed by a resharding, or moved by a membership
//! change — while a node restarts or a write is still on its way to the disk. No
//! acknowledged increment may end up in a place no read looks (invariants 1, 5).
//!
//! Two engines in one process share a catalog; a placement decides who owns which
//! shard at which epoch, and a node can be crashed and reopened on what its store
//! had made durable.

mod common;

use common::{HookStore, SharedCatalog};
use futures::future::BoxFuture;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::Duration;
use tally_core::codec;
use tally_core::router::shard_of_event;
use tally_core::{NodeId, ShardId};
use tally_engine::*;

/// The engines by node name, and the placement epoch they all see.
#[derive(Default)]
struct Net {
    engines: Mutex<BTreeMap<String, Tally>>,
    epoch: AtomicU64,
}

/// Who owns shard `id` at `epoch`: epoch 1 puts every shard on "a"; from epoch 2 on,
/// odd shards live on "b".
fn owner_at(epoch: u64, id: &ShardId) -> NodeId {
    NodeId::new(if epoch >= 2 && id.index % 2 == 1 { "b" } else { "a" })
}

struct Place {
    me: NodeId,
    net: Arc<Net>,
}

impl Placement for Place {
    fn remote_owner(&self, id: &ShardId) -> Option<NodeId> {
        let owner = owner_at(self.net.epoch.load(SeqCst), id);
        (owner != self.me).then_some(owner)
    }
    fn local_node(&self) -> NodeId {
        self.me.clone()
    }
    fn previous_owner(&self, id: &ShardId) -> Option<(NodeId, u64)> {
        let epoch = self.net.epoch.load(SeqCst);
        let (before, now) = (owner_at(epoch - 1, id), owner_at(epoch, id));
        (before != now && now == self.me).then_some((before, epoch))
    }
    fn epoch(&self) -> u64 {
        self.net.epoch.load(SeqCst)
    }
    fn call<'a>(
        &'a self,
        node: &'a NodeId,
        request: ShardRequest,
    ) -> BoxFuture<'a, Result<ShardResponse, TallyError>> {
        Box::pin(async move {
            let request: ShardRequest = codec::decode("request", &codec::encode(&request)).unwrap();
            let peer = self.net.engines.lock().unwrap().get(node.as_str()).cloned();
            let Some(peer) = peer else {
                return Err(TallyError::Unavailable { shard: node.to_string(), reason: "down".into() });
            };
            let response = peer.serve_shard_request(request).await;
            Ok(codec::decode("response", &codec::encode(&response)).unwrap())
        })
    }
}

struct Cluster {
    net: Arc<Net>,
    shared: SharedCatalog,
}

impl Cluster {
    fn new(epoch: u64) -> Self {
        let net = Arc::new(Net::default());
        net.epoch.store(epoch, SeqCst);
        Self { net, shared: SharedCatalog::default() }
    }

    /// Opens node `me` over `store`; `closed` gates its resharding completions.
    async fn open(&self, me: &str, store: HookStore, closed: Arc<AtomicBool>) -> Tally {
        let parts = EngineParts {
            store: Arc::new(store),
            clock: Arc::new(SystemClock),
            config: TallyConfig { node_id: NodeId::new(me), call_timeout_ms: 5_000, ..Default::default() },
            catalog: Some(Arc::new(self.shared.view(closed))),
            placement: Some(Arc::new(Place { me: NodeId::new(me), net: self.net.clone() })),
        };
        let tally = Tally::open_parts(parts).await.unwrap();
        self.net.engines.lock().unwrap().insert(me.to_string(), tally.clone());
        tally
    }

    fn crash(&self, me: &str) {
        if let Some(t) = self.net.engines.lock().unwrap().remove(me) {
            t.abort();
        }
    }
}

fn spec(shards: u16, d: Durability) -> SpecPatch {
    SpecPatch { shards: Some(shards), durability: Some(d), ..Default::default() }
}

/// An event id that routes to shard `index` of `shards`.
fn id_for(index: u16, shards: u16, tag: &str) -> String {
    (0..).map(|i| format!("{tag}{i}")).find(|id| shard_of_event(id, shards) == index).unwrap()
}

/// Retries an increment on 503 (as a client does, with the same event id).
async fn incr_retrying(t: &Tally, name: &str, inc: Increment) -> IncrOutcome {
    for _ in 0..200 {
        match t.incr(name, inc.clone()).await {
            Ok(o) => return o,
            Err(e) if e.retryable() => tokio::time::sleep(Duration::from_millis(20)).await,
            Err(e) => panic!("{e}"),
        }
    }
    panic!("never acknowledged");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_sealed_before_its_node_restarts_stays_sealed() {
    // Epoch 3 moves nothing (2 and 3 place alike): no hand-off in this test.
    let c = Cluster::new(3);
    let (gate_a, gate_b) = (Arc::new(AtomicBool::new(false)), Arc::new(AtomicBool::new(true)));
    let store_b = MemStore::new();
    let a = c.open("a", HookStore::new(MemStore::new()), gate_a.clone()).await;
    let _b = c.open("b", HookStore::new(store_b.clone()), gate_b.clone()).await;
    a.put_counter("c", spec(4, Durability::Sync)).await.unwrap();
    for i in 0..40 {
        a.incr("c", Increment::new(1).event_id(format!("e{i}"))).await.unwrap();
    }
    // A resharding seals every shard of generation 0 (b's odd ones too) and then
    // waits before it opens generation 1.
    gate_a.store(true, SeqCst);
    a.put_counter("c", SpecPatch { shards: Some(2), ..Default::default() }).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // b crashes and comes back on what it had made durable.
    c.crash("b");
    let b = c.open("b", HookStore::new(store_b.restart(0)), gate_b.clone()).await;
    // A write to one of b's sealed shards must not be taken into a generation whose
    // sum is already counted.
    let late = tokio::spawn({
        let a = a.clone();
        async move { incr_retrying(&a, "c", Increment::new(1).event_id(id_for(1, 4, "late"))).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    gate_a.store(false, SeqCst);
    assert!(late.await.unwrap().applied);
    a.settle().await;
    gate_b.store(false, SeqCst);
    // (A replicated catalog tells every node of the change; this one does not.)
    b.metadata_changed("c").await.unwrap();
    for t in [&a, &b] {
        let r = t.read("c", Consistency::Fresh).await.unwrap();
        assert_eq!((r.value, r.complete), (41, true), "{r:?}");
    }
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_shard_whose_first_write_is_on_its_way_to_disk_is_handed_off() {
    let c = Cluster::new(1);
    let never = Arc::new(AtomicBool::new(false));
    let store_a = HookStore::new(MemStore::new());
    let a = c.open("a", store_a.clone(), never.clone()).await;
    let b = c.open("b", HookStore::new(MemStore::new()), never.clone()).await;
    a.put_counter("c", spec(2, Durability::Sync)).await.unwrap();
    // The shard's first write is taken by its actor on a, and the disk stalls.
    store_a.stall_commit_path(500);
    let first = tokio::spawn({
        let a = a.clone();
        async move { a.incr("c", Increment::new(1).event_id(id_for(1, 2, "x"))).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    // The membership changes: shard 1 moves to b, and a hands off what it holds.
    c.net.epoch.store(2, SeqCst);
    let report = a.hand_off_foreign(2).await.unwrap();
    store_a.stall_commit_path(0);
    assert!(first.await.unwrap().unwrap().applied);
    assert_eq!((report.moved, report.failed), (1, 0), "{report:?}");
    // The next membership change: b no longer pulls from a.
    c.net.epoch.store(3, SeqCst);
    for t in [&a, &b] {
        let r = t.read("c", Consistency::Fresh).await.unwrap();
        assert_eq!((r.value, r.complete), (1, true), "{r:?}");
    }
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frequency_sketches_move_with_their_shards() {
    let c = Cluster::new(1);
    let never = Arc::new(AtomicBool::new(false));
    let a = c.open("a", HookStore::new(MemStore::new()), never.clone()).await;
    let b = c.open("b", HookStore::new(MemStore::new()), never.clone()).await;
    let freq = tally_core::frequency::FrequencySpec { epsilon: 0.001, delta: 0.01 };
    a.put_counter("f", SpecPatch { frequency: Some(freq), ..spec(4, Durability::Sync) }).await.unwrap();
    // Every shard is on a; the writers spread the items over all four.
    let total: u64 = (0..40u64).map(|i| 1 + i % 3).sum();
    for i in 0..40u64 {
        let inc = Increment::new(1 + (i % 3) as i64).item(format!("item-{}", i % 5)).writer(format!("w{i}"));
        a.incr("f", inc).await.unwrap();
    }
    let mut before = Vec::new();
    for k in 0..5 {
        before.push(a.frequency("f", &format!("item-{k}")).await.unwrap().estimate);
    }
    assert_eq!(before.iter().sum::<u64>(), total, "{before:?}");
    // Odd shards move to b with their sketches.
    c.net.epoch.store(2, SeqCst);
    let report = a.hand_off_foreign(2).await.unwrap();
    assert_eq!((report.moved, report.failed), (2, 0), "{report:?}");
    c.net.epoch.store(3, SeqCst);
    for t in [&a, &b] {
        for (k, &want) in before.iter().enumerate() {
            let f = t.frequency("f", &format!("item-{k}")).await.unwrap();
            assert_eq!((f.estimate, f.complete, f.total), (want, true, total), "{f:?}");
        }
        let top = t.top("f", 5).await.unwrap();
        assert_eq!(top.items.iter().map(|e| e.lower_bound).sum::<u64>(), total, "{top:?}");
    }
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writer_marks_move_with_their_shards() {
    let c = Cluster::new(1);
    let never = Arc::new(AtomicBool::new(false));
    let a = c.open("a", HookStore::new(MemStore::new()), never.clone()).await;
    let b = c.open("b", HookStore::new(MemStore::new()), never.clone()).await;
    a.put_counter("c", spec(2, Durability::Sync)).await.unwrap();
    // A writer whose mark lives in shard 1, which moves to b.
    let writer = (0..)
        .map(|i| format!("w{i}"))
        .find(|w| shard_of_event(&tally_core::dedup::mark_id(w), 2) == 1)
        .unwrap();
    for n in 1..=5 {
        assert!(a.incr("c", Increment::new(1).sequenced(&writer, n)).await.unwrap().applied);
    }
    c.net.epoch.store(2, SeqCst);
    let report = a.hand_off_foreign(2).await.unwrap();
    assert_eq!((report.moved, report.failed), (1, 0), "{report:?}");
    c.net.epoch.store(3, SeqCst);
    for t in [&a, &b] {
        let o = incr_retrying(t, "c", Increment::new(1).sequenced(&writer, 5)).await;
        assert!(o.duplicate, "the mark moved with its shard: {o:?}");
        let err = t.incr("c", Increment::new(1).sequenced(&writer, 9)).await.unwrap_err();
        assert_eq!(err.code(), "out_of_order_sequence");
    }
    assert!(incr_retrying(&b, "c", Increment::new(1).sequenced(&writer, 6)).await.applied);
    for t in [&a, &b] {
        let r = t.read("c", Consistency::Fresh).await.unwrap();
        assert_eq!((r.value, r.complete), (6, true), "{r:?}");
    }
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_sealed_shard_that_never_took_a_write_moves_with_its_seal() {
    let c = Cluster::new(1);
    let closed = Arc::new(AtomicBool::new(false));
    let a = c.open("a", HookStore::new(MemStore::new()), closed.clone()).await;
    let b = c.open("b", HookStore::new(MemStore::new()), closed.clone()).await;
    a.put_counter("c", spec(2, Durability::Sync)).await.unwrap();
    // Every write goes to shard 0: shard 1 has nothing stored but what a seal puts.
    let ids: Vec<String> =
        (0..).map(|i| format!("e{i}")).filter(|id| shard_of_event(id, 2) == 0).take(10).collect();
    for id in &ids {
        assert!(a.incr("c", Increment::new(1).event_id(id.clone())).await.unwrap().applied);
    }
    // A resharding seals both shards of generation 0, then waits before it opens
    // generation 1.
    closed.store(true, SeqCst);
    a.put_counter("c", SpecPatch { shards: Some(1), ..Default::default() }).await.unwrap();
    tokio::time::sleep(Duration::from_millis(300)).await;
    // Shard 1 moves to b: its seal goes with it, though it holds no value.
    c.net.epoch.store(2, SeqCst);
    let report = a.hand_off_foreign(2).await.unwrap();
    assert_eq!((report.moved, report.failed), (1, 0), "{report:?}");
    // The next change: b serves shard 1 without asking a.
    c.net.epoch.store(3, SeqCst);
    // A write routed to the sealed shard must not be counted in a generation whose
    // sum is already taken.
    let late = tokio::spawn({
        let b = b.clone();
        async move { incr_retrying(&b, "c", Increment::new(1).event_id(id_for(1, 2, "late"))).await }
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    closed.store(false, SeqCst);
    assert!(late.await.unwrap().applied);
    a.settle().await;
    b.metadata_changed("c").await.unwrap();
    for t in [&a, &b] {
        let r = t.read("c", Consistency::Fresh).await.unwrap();
        assert_eq!((r.value, r.complete), (11, true), "{r:?}");
    }
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

/// The node of a one-copy cluster that came back with an empty disk, its loss not
/// accepted: it holds `b`'s shards of a counter with acknowledged increments.
async fn lost_disk_on_b(c: &Cluster, shards: u16) -> (Tally, Tally, i128) {
    let never = Arc::new(AtomicBool::new(false));
    let a = c.open("a", HookStore::new(MemStore::new()), never.clone()).await;
    let _b = c.open("b", HookStore::new(MemStore::new()), never.clone()).await;
    a.put_counter("c", spec(shards, Durability::Sync)).await.unwrap();
    for i in 0..40 {
        a.incr("c", Increment::new(1).event_id(format!("e{i}"))).await.unwrap();
    }
    c.crash("b");
    let b = c.open("b", HookStore::new(MemStore::new()), never).await;
    b.set_data_lost(true);
    (a, b, 40)
}

/// A read is either complete and exact, or lists what is missing: never a short
/// total called complete.
async fn assert_honest(t: &Tally, acknowledged: i128, when: &str) {
    let r = t.read("c", Consistency::Fresh).await.unwrap();
    assert!(!r.complete || r.value == acknowledged, "{when}: a complete read of a short total: {r:?}");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_resharding_never_seals_a_lost_disk_into_a_complete_total() {
    // Epoch 2: odd shards on b, whose disk is lost. Resharding to one shard (on a)
    // would seal b's empty shards into the new generation's base, after which no
    // read asks b anything.
    let c = Cluster::new(2);
    let (a, b, acknowledged) = lost_disk_on_b(&c, 4).await;
    assert_honest(&a, acknowledged, "before the resharding").await;
    a.put_counter("c", SpecPatch { shards: Some(1), ..Default::default() }).await.unwrap();
    for _ in 0..20 {
        tokio::time::sleep(Duration::from_millis(50)).await;
        assert_honest(&a, acknowledged, "during the resharding").await;
    }
    // The loss accepted, the resharding completes from what the shards hold now.
    b.set_data_lost(false);
    a.settle().await;
    let r = a.read("c", Consistency::Fresh).await.unwrap();
    assert!(r.complete && r.value < acknowledged, "{r:?}");
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_hand_off_never_carries_a_lost_disk_into_a_complete_shard() {
    // Epoch 1: every shard on a; a's disk is lost; epoch 2 moves the odd shards to
    // b, which adopts them from a. They must not arrive as complete zeros.
    let c = Cluster::new(1);
    let never = Arc::new(AtomicBool::new(false));
    let a = c.open("a", HookStore::new(MemStore::new()), never.clone()).await;
    let b = c.open("b", HookStore::new(MemStore::new()), never.clone()).await;
    a.put_counter("c", spec(4, Durability::Sync)).await.unwrap();
    for i in 0..40 {
        a.incr("c", Increment::new(1).event_id(format!("e{i}"))).await.unwrap();
    }
    c.crash("a");
    let a = c.open("a", HookStore::new(MemStore::new()), never).await;
    a.set_data_lost(true);
    c.net.epoch.store(2, SeqCst);
    let _ = a.hand_off_foreign(2).await;
    for t in [&a, &b] {
        let r = t.read("c", Consistency::Fresh).await.unwrap();
        assert!(!r.complete, "{r:?}");
        assert_eq!(r.missing_shards, vec![0, 1, 2, 3], "every shard's value is lost: {r:?}");
    }
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}

/// A node whose metadata lags may still hold a deleted counter's tombstone after
/// the deletion was finished and a namesake created under the same shard ids: its
/// cleanup then asks the owners to delete shards that belong to the namesake. An
/// owner deletes nothing its own metadata gives to a live counter (it deletes what
/// a tombstone there lists, or what nothing claims: t12 and the process tests
/// delete counters for real).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_owner_never_deletes_a_live_counters_shard_for_a_stale_cleanup() {
    let c = Cluster::new(2);
    let never = Arc::new(AtomicBool::new(false));
    let a = c.open("a", HookStore::new(MemStore::new()), never.clone()).await;
    let b = c.open("b", HookStore::new(MemStore::new()), never).await;
    a.put_counter("c", spec(2, Durability::Sync)).await.unwrap();
    for i in 0..20 {
        a.incr("c", Increment::new(1).event_id(format!("e{i}"))).await.unwrap();
    }
    let odd = ShardId::new(tally_core::CounterName::new("c").unwrap(), 0, 1);
    let stale = ShardRequest::Delete { id: odd.clone(), prune_of: None };
    let answer = b.serve_shard_request(stale).await;
    assert!(matches!(answer, ShardResponse::Failed { .. }), "{answer:?}");
    let r = a.read("c", Consistency::Fresh).await.unwrap();
    assert_eq!((r.value, r.complete), (20, true), "{r:?}");
    // A prune of a generation the live counter does not hold sealed is refused too.
    let created = a.counter("c").await.unwrap().created_at_ms;
    let prune = ShardRequest::Delete { id: odd, prune_of: Some(created) };
    assert!(matches!(b.serve_shard_request(prune).await, ShardResponse::Failed { .. }));
    let r = b.read("c", Consistency::Fresh).await.unwrap();
    assert_eq!((r.value, r.complete), (20, true), "{r:?}");
    a.shutdown().await.unwrap();
    b.shutdown().await.unwrap();
}
