//! The ordered key-value storage every group's log, vote and state machine live
//! in, with two implementations: [`SledKv`] (production: every group of a node in
//! one `sled::Db`, one set of trees per group) and [`MemKv`] (tests and simulation).
//!
//! Both give the same guarantees, which is all the layers above rely on:
//!
//! * [`KvTree::apply`] is atomic: after a crash either every write of a batch is
//!   there or none is; [`KvTree::write_in_order`] is not: its writes are separate
//!   units, each atomic on its own;
//! * writes become durable only at [`KvStore::flush`], which covers every tree and
//!   every write made before the call; after a crash a store holds what was
//!   flushed and possibly a prefix, in order, of the units written since
//!   ([`MemKv::crash`] keeps none of them, the harshest case allowed;
//!   [`MemKv::restart_keeping`] keeps any prefix).
//!
//! # What a write costs in sled
//!
//! A single `insert` or `remove` is atomic in sled and only reserves room in the
//! current log buffer. A `sled::Batch`, like a sled transaction, is made atomic by
//! `pin_log`, which rolls the log buffer before and after its manifest: each one
//! is a synchronous log write (`pwrite` and `sync_file_range`) of its own. So
//! `SledTree` writes one key with a plain insert or remove, and
//! [`KvTree::write_in_order`] writes each key so; only an [`KvTree::apply`] of
//! several keys pays for a batch.
//!
//! # One flush at a time
//!
//! [`SledKv::flush`] does not flush per call: concurrent callers share the
//! `FlushGate` of the store, which runs one flush at a time on the blocking pool
//! and lets every caller that arrives while one runs join the next one (a flush
//! that began before a caller's writes never answers for them).

use futures::future::BoxFuture;
use parking_lot::Mutex;
use std::collections::BTreeMap;
use std::ops::Bound;
use std::sync::{Arc, Weak};
use tokio::sync::watch;

/// Why the storage failed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    /// sled reported an error.
    #[error("sled: {0}")]
    Sled(String),
    /// The in-memory store was told to fail its flushes (a simulated fsync failure).
    #[error("flush failed (injected)")]
    FlushFailed,
    /// The in-memory store was restarted: this handle belongs to a crashed process.
    #[error("the store was restarted; this handle is closed")]
    Closed,
}

impl From<sled::Error> for KvError {
    fn from(e: sled::Error) -> Self {
        KvError::Sled(e.to_string())
    }
}

/// One write of a batch: a value to insert, or `None` to remove the key.
pub type KvWrite = (Vec<u8>, Option<Vec<u8>>);

/// A key-value pair read back.
pub type KvPair = (Vec<u8>, Vec<u8>);

/// A node's store: named trees and one flush over all of them.
pub trait KvStore: Send + Sync + 'static {
    /// The tree called `name`, created if absent.
    fn tree(&self, name: &str) -> Result<Arc<dyn KvTree>, KvError>;
    /// Makes every write made before the call durable: the returned future
    /// resolves once a flush that began after the call completed.
    fn flush(&self) -> BoxFuture<'static, Result<(), KvError>>;
    /// Removes the tree called `name` and everything in it, atomically (after a
    /// crash it is either whole or gone; durable at the next flush). Handles of the
    /// tree must not be used afterwards. Answers whether there was such a tree.
    fn drop_tree(&self, name: &str) -> Result<bool, KvError>;
}

/// One ordered tree of byte keys.
pub trait KvTree: Send + Sync + 'static {
    /// The value of `key`.
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError>;
    /// Applies every write of `batch` atomically, in order (a later write of the
    /// same key wins).
    fn apply(&self, batch: Vec<KvWrite>) -> Result<(), KvError>;
    /// Applies the writes one by one, in order, each atomic on its own but not
    /// together: after a crash the tree holds a prefix of them. Cheaper than
    /// [`KvTree::apply`] of several keys in sled (no batch).
    fn write_in_order(&self, writes: Vec<KvWrite>) -> Result<(), KvError>;
    /// Every pair with a key in `(from, to)`, in key order.
    fn scan(&self, from: Bound<Vec<u8>>, to: Bound<Vec<u8>>) -> Result<Vec<KvPair>, KvError> {
        self.scan_page(from, to, usize::MAX, usize::MAX)
    }
    /// The first pairs with a key in `(from, to)`, in key order: at most
    /// `pairs_max` of them, and no more once their keys and values add up to
    /// `bytes_max` (the first pair is always included, however large). A page of a
    /// large range, read without holding the rest in memory.
    fn scan_page(
        &self,
        from: Bound<Vec<u8>>,
        to: Bound<Vec<u8>>,
        pairs_max: usize,
        bytes_max: usize,
    ) -> Result<Vec<KvPair>, KvError>;
    /// The pair with the largest key.
    fn last(&self) -> Result<Option<KvPair>, KvError>;
}

/// Every pair whose key starts with `prefix`.
pub fn scan_prefix(tree: &dyn KvTree, prefix: &[u8]) -> Result<Vec<KvPair>, KvError> {
    tree.scan(Bound::Included(prefix.to_vec()), prefix_bound(prefix))
}

/// The bound past every key starting with `prefix`.
pub fn prefix_bound(prefix: &[u8]) -> Bound<Vec<u8>> {
    prefix_end(prefix).map_or(Bound::Unbounded, Bound::Excluded)
}

/// Whether a page holding `pairs` pairs of `bytes` bytes is full.
fn page_full(pairs: usize, bytes: usize, pairs_max: usize, bytes_max: usize) -> bool {
    pairs >= pairs_max || (pairs > 0 && bytes >= bytes_max)
}

/// The smallest key greater than every key starting with `prefix`, if any.
pub fn prefix_end(prefix: &[u8]) -> Option<Vec<u8>> {
    let mut end = prefix.to_vec();
    while let Some(last) = end.pop() {
        if last < u8::MAX {
            end.push(last + 1);
            return Some(end);
        }
    }
    None
}

// ------------------------------------------------------------------------- sled

/// Bytes of page cache the range groups' sled database keeps: the bounded cache
/// in front of every range's shard images and dedup records, which live on disk.
/// sled's default (1 GiB) would let the cache, not the data, set a node's memory;
/// as for the node's own store (`tally_store::SledConfig`), a small cache costs hot
/// shards nothing and cold lookups go to the OS page cache, outside the process.
pub const SLED_CACHE_BYTES: u64 = 8 << 20;

/// The production store: trees of one `sled::Db`, shared by every group of a node
/// (and by the rest of the node's data, under other tree names).
#[derive(Clone)]
pub struct SledKv {
    db: sled::Db,
    flusher: Arc<FlushGate>,
}

impl SledKv {
    /// Wraps an open database.
    pub fn new(db: sled::Db) -> Self {
        let flushed = db.clone();
        let flusher = FlushGate::new(Box::new(move || flushed.flush().map(drop).map_err(KvError::from)));
        Self { db, flusher }
    }

    /// Opens (or creates) the database in directory `path`, with a page cache of
    /// [`SLED_CACHE_BYTES`].
    pub fn open(path: &std::path::Path) -> Result<Self, KvError> {
        Ok(Self::new(sled::Config::new().path(path).cache_capacity(SLED_CACHE_BYTES).open()?))
    }

    /// How many whole-store flushes this store ran.
    pub fn flushes(&self) -> u64 {
        self.flusher.flushes()
    }
}

struct SledTree(sled::Tree);

impl SledTree {
    fn write_one(&self, key: Vec<u8>, value: Option<Vec<u8>>) -> Result<(), KvError> {
        match value {
            Some(v) => self.0.insert(key, v).map(drop)?,
            None => self.0.remove(key).map(drop)?,
        }
        Ok(())
    }
}

impl KvStore for SledKv {
    fn tree(&self, name: &str) -> Result<Arc<dyn KvTree>, KvError> {
        Ok(Arc::new(SledTree(self.db.open_tree(name)?)))
    }

    fn flush(&self) -> BoxFuture<'static, Result<(), KvError>> {
        // A blocking `Db::flush` on the blocking pool, not `Db::flush_async`: in
        // sled 0.34 concurrent `flush_async` calls can all wait forever (sled issues
        // #1241, #1308). The gate runs one at a time for every group of the node.
        self.flusher.flush()
    }

    fn drop_tree(&self, name: &str) -> Result<bool, KvError> {
        Ok(self.db.drop_tree(name)?)
    }
}

impl KvTree for SledTree {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        Ok(self.0.get(key)?.map(|v| v.to_vec()))
    }

    fn apply(&self, batch: Vec<KvWrite>) -> Result<(), KvError> {
        if batch.len() <= 1 {
            // One key is atomic on its own; a batch would roll the log twice.
            return self.write_in_order(batch);
        }
        let mut b = sled::Batch::default();
        for (key, value) in batch {
            match value {
                Some(v) => b.insert(key, v),
                None => b.remove(key),
            }
        }
        Ok(self.0.apply_batch(b)?)
    }

    fn write_in_order(&self, writes: Vec<KvWrite>) -> Result<(), KvError> {
        writes.into_iter().try_for_each(|(key, value)| self.write_one(key, value))
    }

    fn scan_page(
        &self,
        from: Bound<Vec<u8>>,
        to: Bound<Vec<u8>>,
        pairs_max: usize,
        bytes_max: usize,
    ) -> Result<Vec<KvPair>, KvError> {
        let (mut out, mut bytes) = (Vec::new(), 0usize);
        if inverted(&from, &to) {
            return Ok(out);
        }
        for item in self.0.range::<Vec<u8>, _>((from, to)) {
            if page_full(out.len(), bytes, pairs_max, bytes_max) {
                break;
            }
            let (k, v) = item?;
            bytes += k.len() + v.len();
            out.push((k.to_vec(), v.to_vec()));
        }
        Ok(out)
    }

    fn last(&self) -> Result<Option<KvPair>, KvError> {
        Ok(self.0.last()?.map(|(k, v)| (k.to_vec(), v.to_vec())))
    }
}

// ------------------------------------------------------------------ the flusher

/// The flush a [`FlushGate`] runs: blocking, over the whole store.
pub(crate) type FlushFn = Box<dyn Fn() -> Result<(), KvError> + Send + Sync>;

/// Group commit for one store: one flush runs at a time, on the blocking pool; a
/// caller gets the next flush to start (the one under way may have begun before
/// its writes), and every caller that arrives while a flush runs shares that next
/// one. A caller is answered `Ok` only once a flush numbered at least its ticket
/// succeeded, so only by a flush that began after it called.
///
/// The state is three counters and the last outcome, whatever the number of
/// waiters: callers wait on a `watch` of the outcome, which keeps its latest value,
/// so a waiter that subscribes late still sees it (no lost wake-up).
pub(crate) struct FlushGate {
    run: FlushFn,
    state: Arc<Mutex<GateState>>,
    outcome: watch::Sender<Outcome>,
}

#[derive(Default)]
struct GateState {
    /// Flushes started so far; the one under way, if any, is number `started`.
    started: u64,
    /// The highest ticket handed out (at most `started + 1`).
    wanted: u64,
    /// Whether a driver is running flushes.
    running: bool,
}

#[derive(Debug, Clone, Default)]
struct Outcome {
    /// The last flush that completed.
    done: u64,
    /// The last flush that succeeded.
    ok: u64,
    /// The error of the last flush that failed.
    error: Option<KvError>,
}

/// The most flushes one driver runs back to back before it hands its blocking
/// thread back and a fresh driver carries on (so the pool's threads rotate).
const FLUSHES_PER_DRIVER: u32 = 1024;

impl FlushGate {
    pub(crate) fn new(run: FlushFn) -> Arc<Self> {
        Arc::new(Self {
            run,
            state: Arc::new(Mutex::new(GateState::default())),
            outcome: watch::channel(Outcome::default()).0,
        })
    }

    /// How many flushes completed (successfully or not).
    pub(crate) fn flushes(&self) -> u64 {
        self.outcome.borrow().done
    }

    /// Resolves once a flush that began after this call completed.
    pub(crate) fn flush(self: &Arc<Self>) -> BoxFuture<'static, Result<(), KvError>> {
        let mut outcome = self.outcome.subscribe();
        let (ticket, start) = {
            let mut st = self.state.lock();
            let ticket = st.started + 1;
            st.wanted = ticket;
            let start = !st.running;
            st.running = true;
            (ticket, start)
        };
        if start {
            self.spawn_driver();
        }
        Box::pin(async move {
            let seen = outcome
                .wait_for(|o| o.done >= ticket)
                .await
                .map_err(|_| KvError::Sled("the store's flusher is gone".into()))?;
            if seen.ok >= ticket {
                Ok(())
            } else {
                Err(seen.error.clone().unwrap_or_else(|| KvError::Sled("flush failed".into())))
            }
        })
    }

    fn spawn_driver(self: &Arc<Self>) {
        let driver = Driver {
            gate: Arc::downgrade(self),
            state: self.state.clone(),
            outcome: self.outcome.clone(),
            finished: false,
        };
        match tokio::runtime::Handle::try_current() {
            Ok(rt) => drop(rt.spawn_blocking(move || driver.run())),
            // No runtime (a synchronous caller): flush on this thread.
            Err(_) => driver.run(),
        }
    }
}

/// The next flush to run, if anyone waits for one.
fn next(state: &Mutex<GateState>) -> Option<u64> {
    let mut st = state.lock();
    if st.wanted <= st.started {
        st.running = false;
        return None;
    }
    st.started += 1;
    Some(st.started)
}

fn publish(outcome: &watch::Sender<Outcome>, flush: u64, result: Result<(), KvError>) {
    outcome.send_modify(|o| {
        o.done = o.done.max(flush);
        match result {
            Ok(()) => o.ok = o.ok.max(flush),
            Err(e) => o.error = Some(e),
        }
    });
}

/// Runs flushes while anyone waits. It holds the gate (and so the store) only
/// while a flush runs and lets go of it before it answers: a caller woken by the
/// last flush may close the store and open it again at once, and must not find it
/// still locked by the flusher. Its bookkeeping lives beside the gate, not in it.
/// Dropped without finishing (its blocking task never ran, the runtime shutting
/// down, or a panicking flush), it fails every ticket handed out and frees the gate
/// for the next caller, so no waiter hangs.
struct Driver {
    gate: Weak<FlushGate>,
    state: Arc<Mutex<GateState>>,
    outcome: watch::Sender<Outcome>,
    finished: bool,
}

impl Driver {
    fn run(mut self) {
        let rt = tokio::runtime::Handle::try_current().ok();
        let mut ran = 0u32;
        // `next` found nobody waiting and freed the gate.
        while let Some(flush) = next(&self.state) {
            let result = match self.gate.upgrade() {
                Some(gate) => (gate.run)(),
                // The store is gone: its flush cannot run.
                None => Err(KvError::Sled("the store was closed".into())),
            };
            publish(&self.outcome, flush, result);
            ran += 1;
            if ran >= FLUSHES_PER_DRIVER {
                if let Some(rt) = &rt {
                    // Still busy: a fresh driver carries on (the gate stays running).
                    drop(rt.spawn_blocking(move || self.run()));
                    return;
                }
            }
        }
        self.finished = true;
    }
}

impl Drop for Driver {
    fn drop(&mut self) {
        if self.finished {
            return;
        }
        let wanted = {
            let mut st = self.state.lock();
            st.started = st.started.max(st.wanted);
            st.running = false;
            st.wanted
        };
        publish(&self.outcome, wanted, Err(KvError::Sled("the flush did not run".into())));
    }
}

// ----------------------------------------------------------------------- memory

type Trees = BTreeMap<String, BTreeMap<Vec<u8>, Vec<u8>>>;

/// One unit of writes since the last flush: a tree and writes a crash keeps or
/// loses together.
type Unit = (String, Vec<KvWrite>);

/// The most units [`MemKv`] remembers between two flushes, for
/// [`MemKv::restart_keeping`]; past it, a restart keeps none of them (always a
/// state a crash may leave).
pub const MEM_PENDING_UNITS_MAX: usize = 1 << 16;

#[derive(Default)]
struct MemInner {
    /// What a crash keeps.
    durable: Trees,
    /// What readers see: `durable` plus every write since the last flush.
    live: Trees,
    /// The units written since the last flush, in order (`live` = `durable` with
    /// them applied), unless `pending_lost`.
    pending: Vec<Unit>,
    /// More than [`MEM_PENDING_UNITS_MAX`] units were written since the last flush.
    pending_lost: bool,
    /// Flushes that succeeded.
    flushes: u64,
    /// Whether flushes fail.
    fail_flushes: bool,
    /// Set by [`MemKv::restart`]: every later call through this store fails.
    closed: bool,
}

impl MemInner {
    fn record(&mut self, unit: Unit) {
        if self.pending_lost {
            return;
        }
        if self.pending.len() >= MEM_PENDING_UNITS_MAX {
            self.pending = Vec::new();
            self.pending_lost = true;
            return;
        }
        self.pending.push(unit);
    }

    fn flush(&mut self) -> Result<(), KvError> {
        if self.closed {
            return Err(KvError::Closed);
        }
        if self.fail_flushes {
            return Err(KvError::FlushFailed);
        }
        if self.pending_lost {
            self.durable = self.live.clone();
        } else {
            // What the units since the last flush wrote, without copying every tree.
            for (tree, writes) in std::mem::take(&mut self.pending) {
                write_to(self.durable.entry(tree).or_default(), &writes);
            }
        }
        self.pending = Vec::new();
        self.pending_lost = false;
        self.flushes += 1;
        Ok(())
    }
}

/// Whether `(from, to)` is a range that holds no key because it is inverted (or
/// empty with an excluded end).
fn inverted(from: &Bound<Vec<u8>>, to: &Bound<Vec<u8>>) -> bool {
    match (from, to) {
        (Bound::Included(a), Bound::Included(b)) => a > b,
        (Bound::Included(a) | Bound::Excluded(a), Bound::Included(b) | Bound::Excluded(b)) => a >= b,
        _ => false,
    }
}

fn write_to(tree: &mut BTreeMap<Vec<u8>, Vec<u8>>, writes: &[KvWrite]) {
    for (key, value) in writes {
        match value {
            Some(v) => tree.insert(key.clone(), v.clone()),
            None => tree.remove(key),
        };
    }
}

/// The in-memory store, with sled's durability contract: writes since the last
/// [`KvStore::flush`] vanish on [`MemKv::crash`]. Clones share the same store (a
/// node restarted on it sees what survived).
#[derive(Clone, Default)]
pub struct MemKv {
    inner: Arc<Mutex<MemInner>>,
}

impl MemKv {
    /// An empty store.
    pub fn new() -> Self {
        Self::default()
    }

    /// Simulates a crash: every write since the last successful flush is lost.
    pub fn crash(&self) {
        let mut inner = self.inner.lock();
        inner.live = inner.durable.clone();
        inner.pending = Vec::new();
        inner.pending_lost = false;
    }

    /// Simulates a crash of the process that used this store and returns the store
    /// its next process opens: what was flushed. This handle (and every tree opened
    /// through it) is closed for good, so the crashed process's leftover tasks can
    /// change nothing.
    pub fn restart(&self) -> MemKv {
        self.restart_keeping(0)
    }

    /// Like [`MemKv::restart`], but the next process also finds the first `units`
    /// units written since the last flush (one per [`KvTree::apply`], one per write
    /// of [`KvTree::write_in_order`]): any prefix is a state sled may recover.
    pub fn restart_keeping(&self, units: usize) -> MemKv {
        let mut inner = self.inner.lock();
        inner.closed = true;
        let mut durable = inner.durable.clone();
        if !inner.pending_lost {
            for (tree, writes) in inner.pending.iter().take(units) {
                write_to(durable.entry(tree.clone()).or_default(), writes);
            }
        }
        MemKv {
            inner: Arc::new(Mutex::new(MemInner { live: durable.clone(), durable, ..MemInner::default() })),
        }
    }

    /// How many units were written since the last flush (what
    /// [`MemKv::restart_keeping`] can keep).
    pub fn pending_units(&self) -> usize {
        let inner = self.inner.lock();
        if inner.pending_lost {
            0
        } else {
            inner.pending.len()
        }
    }

    /// How many flushes succeeded.
    pub fn flushes(&self) -> u64 {
        self.inner.lock().flushes
    }

    /// Makes later flushes fail (`true`) or succeed again (`false`).
    pub fn fail_flushes(&self, fail: bool) {
        self.inner.lock().fail_flushes = fail;
    }
}

struct MemTree {
    inner: Arc<Mutex<MemInner>>,
    name: String,
}

impl KvStore for MemKv {
    fn tree(&self, name: &str) -> Result<Arc<dyn KvTree>, KvError> {
        self.inner.lock().live.entry(name.to_owned()).or_default();
        Ok(Arc::new(MemTree { inner: self.inner.clone(), name: name.to_owned() }))
    }

    fn flush(&self) -> BoxFuture<'static, Result<(), KvError>> {
        let result = self.inner.lock().flush();
        Box::pin(async move { result })
    }

    /// One unit that removes every key of the tree: a crash keeps all of it or
    /// none, as sled's drop does.
    fn drop_tree(&self, name: &str) -> Result<bool, KvError> {
        let mut inner = self.inner.lock();
        if inner.closed {
            return Err(KvError::Closed);
        }
        let Some(tree) = inner.live.remove(name) else { return Ok(false) };
        let removals: Vec<KvWrite> = tree.into_keys().map(|k| (k, None)).collect();
        inner.record((name.to_owned(), removals));
        Ok(true)
    }
}

impl MemTree {
    fn with<T>(&self, f: impl FnOnce(&mut BTreeMap<Vec<u8>, Vec<u8>>) -> T) -> Result<T, KvError> {
        let mut inner = self.inner.lock();
        if inner.closed {
            return Err(KvError::Closed);
        }
        Ok(f(inner.live.entry(self.name.clone()).or_default()))
    }

    /// Writes `units` in order, each one a unit a crash keeps or loses whole.
    fn write_units(&self, units: Vec<Vec<KvWrite>>) -> Result<(), KvError> {
        let mut inner = self.inner.lock();
        if inner.closed {
            return Err(KvError::Closed);
        }
        for writes in units {
            write_to(inner.live.entry(self.name.clone()).or_default(), &writes);
            inner.record((self.name.clone(), writes));
        }
        Ok(())
    }
}

impl KvTree for MemTree {
    fn get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, KvError> {
        self.with(|t| t.get(key).cloned())
    }

    fn apply(&self, batch: Vec<KvWrite>) -> Result<(), KvError> {
        self.write_units(vec![batch])
    }

    fn write_in_order(&self, writes: Vec<KvWrite>) -> Result<(), KvError> {
        self.write_units(writes.into_iter().map(|w| vec![w]).collect())
    }

    fn scan_page(
        &self,
        from: Bound<Vec<u8>>,
        to: Bound<Vec<u8>>,
        pairs_max: usize,
        bytes_max: usize,
    ) -> Result<Vec<KvPair>, KvError> {
        if inverted(&from, &to) {
            // BTreeMap::range panics on an inverted range; an empty answer is right.
            return Ok(Vec::new());
        }
        self.with(|t| {
            let (mut out, mut bytes) = (Vec::new(), 0usize);
            for (k, v) in t.range((from, to)) {
                if page_full(out.len(), bytes, pairs_max, bytes_max) {
                    break;
                }
                bytes += k.len() + v.len();
                out.push((k.clone(), v.clone()));
            }
            out
        })
    }

    fn last(&self) -> Result<Option<KvPair>, KvError> {
        self.with(|t| t.iter().next_back().map(|(k, v)| (k.clone(), v.clone())))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    #[derive(Debug, Clone)]
    enum Op {
        Apply(Vec<(u8, Option<u8>)>),
        InOrder(Vec<(u8, Option<u8>)>),
        Scan(u8, u8),
        Page(u8, u8, usize, usize),
        Drop,
    }

    fn op() -> impl Strategy<Value = Op> {
        prop_oneof![
            proptest::collection::vec((0u8..16, proptest::option::of(any::<u8>())), 0..6).prop_map(Op::Apply),
            proptest::collection::vec((0u8..16, proptest::option::of(any::<u8>())), 0..6)
                .prop_map(Op::InOrder),
            (0u8..18, 0u8..18).prop_map(|(a, b)| Op::Scan(a, b)),
            (0u8..18, 0u8..18, 0usize..5, 0usize..12).prop_map(|(a, b, n, bytes)| Op::Page(a, b, n, bytes)),
            Just(Op::Drop),
        ]
    }

    fn key(k: u8) -> Vec<u8> {
        vec![b'k', k]
    }

    proptest! {
        #![proptest_config(ProptestConfig::with_cases(32))]

        /// sled and the in-memory store answer every read the same after the same
        /// writes, over two trees.
        #[test]
        fn sled_and_memory_agree(ops in proptest::collection::vec((any::<bool>(), op()), 1..40)) {
            let dir = tempfile::tempdir().unwrap();
            let sled = SledKv::new(sled::open(dir.path()).unwrap());
            let mem = MemKv::new();
            let trees = |s: &dyn KvStore| [s.tree("a").unwrap(), s.tree("b").unwrap()];
            let (mut st, mut mt) = (trees(&sled), trees(&mem));
            for (which, op) in ops {
                if let Op::Drop = op {
                    // The tree is gone with its keys, and opens again empty.
                    let name = ["a", "b"][usize::from(which)];
                    prop_assert_eq!(sled.drop_tree(name).unwrap(), mem.drop_tree(name).unwrap());
                    st[usize::from(which)] = sled.tree(name).unwrap();
                    mt[usize::from(which)] = mem.tree(name).unwrap();
                    continue;
                }
                let (s, m) = (&st[usize::from(which)], &mt[usize::from(which)]);
                match op {
                    Op::Apply(writes) => {
                        let batch: Vec<KvWrite> = writes.iter().map(|(k, v)| (key(*k), v.map(|v| vec![v]))).collect();
                        s.apply(batch.clone()).unwrap();
                        m.apply(batch).unwrap();
                    }
                    Op::InOrder(writes) => {
                        let batch: Vec<KvWrite> = writes.iter().map(|(k, v)| (key(*k), v.map(|v| vec![v]))).collect();
                        s.write_in_order(batch.clone()).unwrap();
                        m.write_in_order(batch).unwrap();
                    }
                    Op::Scan(a, b) => {
                        let range = || (Bound::Included(key(a)), Bound::Excluded(key(b)));
                        let (r1, r2) = range();
                        let (m1, m2) = range();
                        prop_assert_eq!(s.scan(r1, r2).unwrap(), m.scan(m1, m2).unwrap());
                    }
                    Op::Page(a, b, n, bytes) => {
                        let range = || (Bound::Excluded(key(a)), Bound::Included(key(b)));
                        let (r1, r2) = range();
                        let page = s.scan_page(r1, r2, n, bytes).unwrap();
                        let (m1, m2) = range();
                        prop_assert_eq!(&page, &m.scan_page(m1, m2, n, bytes).unwrap());
                        prop_assert!(page.len() <= n);
                        let size: usize = page.iter().map(|(k, v)| k.len() + v.len()).sum();
                        let last = page.last().map_or(0, |(k, v)| k.len() + v.len());
                        prop_assert!(page.len() <= 1 || size - last < bytes, "a page stops once full");
                    }
                    Op::Drop => unreachable!("handled above"),
                }
                prop_assert_eq!(s.last().unwrap(), m.last().unwrap());
                prop_assert_eq!(scan_prefix(&**s, b"k").unwrap(), scan_prefix(&**m, b"k").unwrap());
                for k in 0..16 {
                    prop_assert_eq!(s.get(&key(k)).unwrap(), m.get(&key(k)).unwrap());
                }
            }
        }
    }

    #[test]
    fn a_crash_loses_exactly_what_was_not_flushed() {
        let kv = MemKv::new();
        let t = kv.tree("t").unwrap();
        t.apply(vec![(b"a".to_vec(), Some(b"1".to_vec()))]).unwrap();
        futures::executor::block_on(kv.flush()).unwrap();
        t.apply(vec![(b"b".to_vec(), Some(b"2".to_vec())), (b"a".to_vec(), None)]).unwrap();
        kv.crash();
        assert_eq!(t.get(b"a").unwrap(), Some(b"1".to_vec()));
        assert_eq!(t.get(b"b").unwrap(), None);
        kv.fail_flushes(true);
        t.apply(vec![(b"c".to_vec(), Some(b"3".to_vec()))]).unwrap();
        assert_eq!(futures::executor::block_on(kv.flush()), Err(KvError::FlushFailed));
        kv.crash();
        assert_eq!(t.get(b"c").unwrap(), None);
    }

    #[test]
    fn a_restart_keeps_the_chosen_prefix_of_the_units_since_the_flush() {
        let kv = MemKv::new();
        let t = kv.tree("t").unwrap();
        let put = |k: &[u8], v: u8| (k.to_vec(), Some(vec![v]));
        t.apply(vec![put(b"a", 1)]).unwrap();
        futures::executor::block_on(kv.flush()).unwrap();
        t.apply(vec![put(b"a", 2), put(b"b", 2)]).unwrap();
        t.write_in_order(vec![put(b"c", 3), (b"a".to_vec(), None)]).unwrap();
        assert_eq!(kv.pending_units(), 3);
        let read = |kv: &MemKv| {
            let t = kv.tree("t").unwrap();
            [b"a", b"b", b"c"].map(|k| t.get(k).unwrap().map(|v| v[0]))
        };
        let kept: Vec<_> = (0..=3).map(|n| read(&kv.clone().restart_keeping(n))).collect();
        assert_eq!(
            kept,
            [
                [Some(1), None, None],
                [Some(2), Some(2), None],
                [Some(2), Some(2), Some(3)],
                [None, Some(2), Some(3)],
            ]
        );
        assert_eq!(t.get(b"a"), Err(KvError::Closed), "the old handle is closed");
    }

    /// A gate over a `MemKv` whose flush copies what is written when it starts,
    /// then takes `delay` before it makes that durable: a write made while a flush
    /// runs is not covered by it.
    fn slow_gate(kv: &MemKv, delay: std::time::Duration) -> Arc<FlushGate> {
        let inner = kv.inner.clone();
        FlushGate::new(Box::new(move || {
            let snapshot = inner.lock().live.clone();
            std::thread::sleep(delay);
            let mut inner = inner.lock();
            if inner.fail_flushes {
                return Err(KvError::FlushFailed);
            }
            inner.durable = snapshot;
            inner.flushes += 1;
            Ok(())
        }))
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 4)]
    async fn concurrent_flushes_share_flushes_and_each_covers_its_caller() {
        const CALLERS: u32 = 64;
        const ROUNDS: u32 = 5;
        let kv = MemKv::new();
        let gate = slow_gate(&kv, std::time::Duration::from_millis(5));
        let tasks: Vec<_> = (0..CALLERS)
            .map(|caller| {
                let (kv, gate) = (kv.clone(), gate.clone());
                tokio::spawn(async move {
                    let t = kv.tree("t").unwrap();
                    for round in 0..ROUNDS {
                        let key = format!("{caller}-{round}").into_bytes();
                        t.apply(vec![(key.clone(), Some(vec![1]))]).unwrap();
                        gate.flush().await.unwrap();
                        let durable = kv.inner.lock().durable.get("t").and_then(|t| t.get(&key).cloned());
                        assert_eq!(durable, Some(vec![1]), "{caller}/{round} not durable when told so");
                    }
                })
            })
            .collect();
        for t in tasks {
            t.await.unwrap();
        }
        let flushes = kv.flushes();
        assert_eq!(gate.flushes(), flushes);
        assert!(flushes >= u64::from(ROUNDS), "each caller waits for its own flush");
        assert!(
            flushes * 4 <= u64::from(CALLERS * ROUNDS),
            "{flushes} flushes for {} calls: callers did not share them",
            CALLERS * ROUNDS
        );
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_flush_under_way_does_not_answer_a_later_write() {
        let kv = MemKv::new();
        let gate = slow_gate(&kv, std::time::Duration::from_millis(200));
        let t = kv.tree("t").unwrap();
        t.apply(vec![(b"a".to_vec(), Some(vec![1]))]).unwrap();
        let first = tokio::spawn(gate.flush());
        // Let the first flush start (and copy what it covers) before writing "b".
        tokio::time::sleep(std::time::Duration::from_millis(50)).await;
        t.apply(vec![(b"b".to_vec(), Some(vec![2]))]).unwrap();
        gate.flush().await.unwrap();
        let durable = kv.inner.lock().durable.get("t").cloned().unwrap_or_default();
        assert_eq!(durable.get(b"b".as_slice()), Some(&vec![2]), "answered by the flush under way");
        first.await.unwrap().unwrap();
        assert_eq!(kv.flushes(), 2);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_failed_flush_fails_its_callers_and_the_next_one_can_succeed() {
        let kv = MemKv::new();
        let gate = slow_gate(&kv, std::time::Duration::from_millis(1));
        kv.fail_flushes(true);
        assert_eq!(gate.flush().await, Err(KvError::FlushFailed));
        kv.fail_flushes(false);
        assert_eq!(gate.flush().await, Ok(()));
        // Without a runtime the caller's thread runs the flush.
        let sync = std::thread::spawn(move || futures::executor::block_on(gate.flush()));
        assert_eq!(sync.join().unwrap(), Ok(()));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_panicking_flush_fails_its_callers_instead_of_hanging_them() {
        let calls = Arc::new(std::sync::atomic::AtomicU32::new(0));
        let counted = calls.clone();
        let gate = FlushGate::new(Box::new(move || {
            if counted.fetch_add(1, std::sync::atomic::Ordering::SeqCst) == 0 {
                panic!("injected flush panic");
            }
            Ok(())
        }));
        assert!(gate.flush().await.is_err());
        assert_eq!(gate.flush().await, Ok(()));
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn sled_flushes_are_shared_and_make_writes_durable() {
        let dir = tempfile::tempdir().unwrap();
        let kv = SledKv::open(dir.path()).unwrap();
        let t = kv.tree("t").unwrap();
        let tasks: Vec<_> = (0..32u8)
            .map(|i| {
                let (kv, t) = (kv.clone(), t.clone());
                tokio::spawn(async move {
                    t.apply(vec![(vec![i], Some(vec![i]))]).unwrap();
                    kv.flush().await
                })
            })
            .collect();
        for task in tasks {
            task.await.unwrap().unwrap();
        }
        assert!(kv.flushes() >= 1 && kv.flushes() <= 32);
        drop((t, kv));
        let reopened = open_once_free(dir.path()).tree("t").unwrap();
        assert_eq!(reopened.scan(Bound::Unbounded, Bound::Unbounded).unwrap().len(), 32);
    }

    /// Opens the store at `path` once every handle of its last opening is gone: sled
    /// releases its directory lock when its own background threads let go of the
    /// database, which may be a moment after the last handle was dropped.
    fn open_once_free(path: &std::path::Path) -> SledKv {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            match SledKv::open(path) {
                Ok(kv) => return kv,
                Err(e) if e.to_string().contains("lock") && std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(5));
                }
                Err(e) => panic!("opening {}: {e}", path.display()),
            }
        }
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn a_store_closed_after_its_flush_answered_opens_again() {
        let dir = tempfile::tempdir().unwrap();
        for round in 0..200u8 {
            let kv = open_once_free(dir.path());
            let t = kv.tree("t").unwrap();
            assert_eq!(t.scan(Bound::Unbounded, Bound::Unbounded).unwrap().len(), usize::from(round));
            t.apply(vec![(vec![round], Some(vec![round]))]).unwrap();
            kv.flush().await.unwrap();
        }
    }

    #[test]
    fn prefix_scans_stop_at_the_prefix() {
        assert_eq!(prefix_end(b"ab"), Some(b"ac".to_vec()));
        assert_eq!(prefix_end(&[b'a', 0xff]), Some(b"b".to_vec()));
        assert_eq!(prefix_end(&[0xff, 0xff]), None);
        let kv = MemKv::new();
        let t = kv.tree("t").unwrap();
        let put = |k: &[u8]| (k.to_vec(), Some(vec![1]));
        t.apply(vec![put(b"a"), put(b"ab"), put(&[b'a', 0xff]), put(b"b")]).unwrap();
        let keys: Vec<Vec<u8>> = scan_prefix(&*t, b"a").unwrap().into_iter().map(|(k, _)| k).collect();
        assert_eq!(keys, vec![b"a".to_vec(), b"ab".to_vec(), vec![b'a', 0xff]]);
    }
}
