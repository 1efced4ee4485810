//! Where counter metadata lives: the [`Catalog`] trait, and [`LocalCatalog`], which
//! keeps it in the node's own store (a single node, or an embedded engine). A cluster
//! plugs in a replicated catalog instead.
//!
//! Every change goes through [`tally_core::meta::apply_command`], so every catalog
//! agrees on what each command means, and is durable before it is reported.

use crate::error::TallyError;
use crate::flusher::Flusher;
use futures::future::BoxFuture;
use std::sync::atomic::{AtomicU64, AtomicUsize, Ordering::SeqCst};
use std::sync::Arc;
use tally_core::codec;
use tally_core::meta::{apply_command_in, creation_auto, CounterMeta, MetaCommand, MetaEffect};
use tally_core::namespace::{NamespaceSpec, Namespaces};
use tally_core::spec::{AutoShards, Durability};
use tally_core::CounterName;
use tally_store::{Store, StoreError};
use tokio::sync::Mutex;

pub(crate) const COUNTER_PREFIX: &[u8] = b"counter/";
const RESHARD_PREFIX: &[u8] = b"reshard/";
const TOMBSTONE_PREFIX: &[u8] = b"tombstone/";
/// The bounds of counters whose shard count follows contention: a record of its own
/// beside the counter's, so the counter record's layout (and every store written
/// before auto counters) is unchanged. A release that predates it ignores these keys,
/// and such a counter keeps the shard count it has.
const AUTO_PREFIX: &[u8] = b"autoshard/";
/// The deadlines of counters that expire, as keys: the prefix, the deadline
/// (8 bytes, big-endian, so keys sort by it) and the name. Values are empty. The
/// reclaim of expired counters scans from the front.
const EXPIRY_PREFIX: &[u8] = b"expiry/";
/// The namespaces: `namespace/PREFIX` → the spec counters created under it take.
const NAMESPACE_PREFIX: &[u8] = b"namespace/";
/// Most keys one catalog scan returns per page.
const SCAN_PAGE_KEYS: usize = 1024;

fn key(prefix: &[u8], name: &str) -> Vec<u8> {
    [prefix, name.as_bytes()].concat()
}

/// The index key of `name`'s deadline `at_ms`.
fn expiry_key(at_ms: u64, name: &str) -> Vec<u8> {
    [EXPIRY_PREFIX, &at_ms.to_be_bytes(), name.as_bytes()].concat()
}

/// The (generation, shard count) pairs whose data a deleted counter left behind.
pub type Generations = Vec<(u32, u16)>;

/// What [`Catalog::ensure_many`] answers: per name, its metadata after the command
/// (always a counter) and whether it was created.
pub type EnsureResults = Vec<Result<(Option<CounterMeta>, MetaEffect), TallyError>>;

/// Counter metadata as the engine needs it. Reads are local and quick (they may lag a
/// replicated catalog slightly; shards answer writes under stale metadata with
/// `Sealed`, and the engine re-reads). Changes are durable when they return.
pub trait Catalog: Send + Sync + 'static {
    /// The counter's metadata, if it exists.
    fn get(&self, name: &str) -> Result<Option<CounterMeta>, TallyError>;
    /// The counter's metadata as of a moment after this call started: never older
    /// than a change committed before it (a replicated catalog asks its leader). A
    /// read that finds the generation it summed sealed asks this to learn whether a
    /// resharding completed meanwhile. Local catalogs are always current.
    fn current<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<Option<CounterMeta>, TallyError>> {
        Box::pin(async move { self.get(name) })
    }
    /// Applies `cmd` (with the proposer's `now_ms`) and returns the counter's metadata
    /// after it and what it did.
    fn apply<'a>(
        &'a self,
        name: &'a CounterName,
        cmd: &'a MetaCommand,
        now_ms: u64,
    ) -> BoxFuture<'a, Result<(Option<CounterMeta>, MetaEffect), TallyError>>;
    /// Creates every counter of `names` that does not exist, with the default spec
    /// (`MetaCommand::Ensure` on each, in order): one result per name. Durable when
    /// it returns, except that a catalog whose store recovers a prefix of its writes
    /// may answer a `batched` creation once it is written and make it durable with the
    /// next flush ([`LocalCatalog`] does: see `ensure_local`). The default applies them
    /// one by one, concurrently, so a catalog
    /// that shares its commits among concurrent changes (a replicated log that
    /// appends what is queued together) shares them here too; [`LocalCatalog`] writes
    /// them all in one store batch and one flush.
    fn ensure_many<'a>(
        &'a self,
        names: &'a [CounterName],
        now_ms: u64,
        default: &'a NamespaceSpec,
    ) -> BoxFuture<'a, EnsureResults> {
        Box::pin(async move {
            let ensure = MetaCommand::EnsureWith(*default);
            let each = names.iter().map(|n| self.apply(n, &ensure, now_ms));
            futures::future::join_all(each).await
        })
    }
    /// Creates `name` with the default spec if it exists nowhere, without waiting
    /// for the creation to be written: its metadata and whether this call created
    /// it. `None` if this catalog cannot (the default, and a replicated catalog: a
    /// creation there is agreed on by the group before anyone may use it), or cannot
    /// now (the name is under a change, or too many creations are unwritten); the
    /// caller then creates it through [`Catalog::ensure_many`].
    ///
    /// A catalog that answers `Some` sees the creation in every read and listing at
    /// once, orders every later change of the counter after it, writes it soon on its
    /// own ([`Catalog::write_deferred`]), and writes it before
    /// [`Catalog::creation_written`] returns, which the engine awaits before any
    /// shard of the counter is written. It answers `Some` only for a `batched`
    /// default spec: the creation is then durable with the flush that makes the
    /// counter's first drained sum durable, and never after it.
    fn ensure_deferred(
        &self,
        _name: &CounterName,
        _now_ms: u64,
        _default: &NamespaceSpec,
    ) -> Option<Result<(CounterMeta, MetaEffect), TallyError>> {
        None
    }
    /// Writes the creations [`Catalog::ensure_deferred`] answered and has not written
    /// yet (nothing, for a catalog that defers none).
    fn write_deferred(&self) -> BoxFuture<'_, Result<(), TallyError>> {
        Box::pin(async { Ok(()) })
    }
    /// Returns once the creation of `name`, if [`Catalog::ensure_deferred`] answered
    /// it, is written (in the store's order, before anything written after this
    /// returns).
    fn creation_written<'a>(&'a self, _name: &'a str) -> BoxFuture<'a, Result<(), TallyError>> {
        Box::pin(async { Ok(()) })
    }
    /// The auto bounds of a counter whose shard count follows contention (`None`:
    /// fixed, or no such counter).
    fn auto_shards(&self, _name: &str) -> Result<Option<AutoShards>, TallyError> {
        Ok(None)
    }
    /// Every counter whose shard count follows contention, with its bounds. The
    /// engine lists them at every auto sample and follows exactly these (so a
    /// catalog that keeps auto bounds must list every one of them here).
    fn auto_counters(&self) -> Result<Vec<(CounterName, AutoShards)>, TallyError> {
        Ok(Vec::new())
    }
    /// Applies `cmd` and sets the counter's auto bounds (`None`: fixed) in one
    /// durable change. A catalog that does not keep auto bounds refuses any but `None`.
    fn apply_auto<'a>(
        &'a self,
        name: &'a CounterName,
        cmd: &'a MetaCommand,
        auto: Option<AutoShards>,
        now_ms: u64,
    ) -> BoxFuture<'a, Result<(Option<CounterMeta>, MetaEffect), TallyError>> {
        match auto {
            None => self.apply(name, cmd, now_ms),
            Some(_) => Box::pin(async { Err(TallyError::AutoShardsUnsupported) }),
        }
    }
    /// Reshards an auto counter to `shards`, only if it is still auto and its
    /// metadata is still at `version` (so a proposal made from a stale look, or
    /// crossing a change by hand, is refused rather than undoing that change). The
    /// one path by which the engine's own decisions change a counter.
    fn auto_reshard<'a>(
        &'a self,
        _name: &'a CounterName,
        _version: u64,
        _shards: u16,
        _now_ms: u64,
    ) -> BoxFuture<'a, Result<(Option<CounterMeta>, MetaEffect), TallyError>> {
        Box::pin(async { Err(TallyError::AutoShardsUnsupported) })
    }
    /// Up to `limit` counters whose deadline is at or before `now_ms`, earliest
    /// first: what the reclaim of expired counters deletes next. A catalog that keeps
    /// no deadlines answers none.
    fn expired(&self, _now_ms: u64, _limit: usize) -> Result<Vec<CounterName>, TallyError> {
        Ok(Vec::new())
    }
    /// Whether this node reclaims expired counters now: every node of its own
    /// catalog; in a cluster, the one node that leads the metadata group (the others
    /// would only propose the same deletions again).
    fn reclaims_expired(&self) -> bool {
        true
    }
    /// How many counters exist, and how many have a deadline. The default pages
    /// through [`Catalog::list`] (a catalog that keeps its counters in memory answers
    /// at once).
    fn count(&self) -> Result<(u64, u64), TallyError> {
        let (mut n, mut expiring) = (0u64, 0u64);
        let mut after: Option<CounterName> = None;
        loop {
            let page = self.list("", after.as_ref(), SCAN_PAGE_KEYS)?;
            for name in &page {
                n += 1;
                if self.get(name.as_str())?.is_some_and(|m| m.expires_at_ms.is_some()) {
                    expiring += 1;
                }
            }
            if page.len() < SCAN_PAGE_KEYS {
                return Ok((n, expiring));
            }
            after = page.last().cloned();
        }
    }
    /// The namespaces, by prefix ([`tally_core::namespace`]): what implicit
    /// creations resolve against (the catalog applies them itself; this answers
    /// `GET /v1/namespaces`).
    fn namespaces(&self) -> Result<Namespaces, TallyError> {
        Ok(Namespaces::new())
    }
    /// Declares (or replaces) the namespace `prefix`, checked by the caller:
    /// true if it existed. Durable when it returns.
    fn put_namespace<'a>(
        &'a self,
        _prefix: &'a str,
        _spec: NamespaceSpec,
    ) -> BoxFuture<'a, Result<bool, TallyError>> {
        Box::pin(async { Err(TallyError::Namespace("this catalog keeps no namespaces".into())) })
    }
    /// Drops the namespace `prefix`: true if it existed.
    fn delete_namespace<'a>(&'a self, _prefix: &'a str) -> BoxFuture<'a, Result<bool, TallyError>> {
        Box::pin(async { Ok(false) })
    }
    /// Counters with a resharding that has not completed.
    fn pending_reshards(&self) -> Result<Vec<CounterName>, TallyError>;
    /// Deleted counters whose data may still be in stores, with their generations.
    fn tombstones(&self) -> Result<Vec<(CounterName, Generations)>, TallyError>;
    /// The generations a deleted counter left behind, if its cleanup is pending.
    fn tombstone(&self, name: &str) -> Result<Option<Generations>, TallyError>;
    /// Forgets a tombstone once its data is gone everywhere.
    fn clear_tombstone<'a>(&'a self, name: &'a CounterName) -> BoxFuture<'a, Result<(), TallyError>>;
    /// Up to `limit` existing counters whose names start with `prefix` and sort after
    /// `after` (byte order), in that order: one page of a listing, so its work is
    /// bounded by `limit`, not by how many counters exist.
    fn list(
        &self,
        prefix: &str,
        after: Option<&CounterName>,
        limit: usize,
    ) -> Result<Vec<CounterName>, TallyError>;
}

/// Most creations [`LocalCatalog`] holds answered and not yet written; a creation
/// beyond them waits for a commit ([`Catalog::ensure_many`]). One write takes them all.
pub const CREATIONS_UNWRITTEN_MAX: usize = 8192;

/// Creations answered by [`Catalog::ensure_deferred`] and not written yet.
#[derive(Default)]
struct Deferred {
    /// Each with its ticket: tickets rise in the order creations were answered.
    unwritten: std::collections::HashMap<CounterName, (CounterMeta, u64)>,
    /// Counters a change holds under the write lock: no creation of theirs is deferred
    /// while it runs (it would be written over the change).
    busy: std::collections::HashSet<CounterName>,
    /// The last ticket handed out.
    last_ticket: u64,
}

/// Counter metadata backed by the store's metadata space.
pub struct LocalCatalog {
    store: Arc<dyn Store>,
    flusher: Flusher,
    write: Mutex<()>,
    deferred: parking_lot::Mutex<Deferred>,
    /// How many creations are unwritten (read without the lock on every look-up).
    unwritten: AtomicUsize,
    /// Every ticket up to this one is written.
    written: AtomicU64,
    /// The namespaces, as stored (read at open, changed under the write lock).
    namespaces: parking_lot::RwLock<Namespaces>,
}

impl LocalCatalog {
    pub(crate) fn new(store: Arc<dyn Store>, flusher: Flusher) -> Result<Self, TallyError> {
        let mut namespaces = Namespaces::new();
        let mut after: Option<Vec<u8>> = None;
        loop {
            let page = store.meta_scan(NAMESPACE_PREFIX, after.as_deref(), SCAN_PAGE_KEYS)?;
            for (k, v) in &page {
                let prefix = String::from_utf8_lossy(&k[NAMESPACE_PREFIX.len()..]).into_owned();
                let spec = codec::decode("namespace", v).map_err(|source| StoreError::Corrupt {
                    location: format!("namespace {prefix:?}"),
                    source,
                })?;
                namespaces.insert(prefix, spec);
            }
            after = page.last().map(|(k, _)| k.clone());
            if page.len() < SCAN_PAGE_KEYS {
                break;
            }
        }
        Ok(Self {
            store,
            flusher,
            write: Mutex::new(()),
            deferred: Default::default(),
            unwritten: AtomicUsize::new(0),
            written: AtomicU64::new(0),
            namespaces: parking_lot::RwLock::new(namespaces),
        })
    }

    /// The unwritten creation of `name`, with its ticket.
    fn unwritten(&self, name: &str) -> Option<(CounterMeta, u64)> {
        if self.unwritten.load(SeqCst) == 0 {
            return None;
        }
        self.deferred.lock().unwritten.get(name).cloned()
    }

    /// Writes every unwritten creation (no flush: they are `batched`). The caller
    /// holds the write lock.
    async fn write_unwritten(&self, _guard: &tokio::sync::MutexGuard<'_, ()>) -> Result<(), TallyError> {
        let (puts, names, last) = {
            let d = self.deferred.lock();
            if d.unwritten.is_empty() {
                return Ok(());
            }
            let puts: Vec<_> = d
                .unwritten
                .iter()
                .map(|(n, (m, _))| (key(COUNTER_PREFIX, n.as_str()), codec::encode(m)))
                .collect();
            let names: Vec<_> = d.unwritten.keys().cloned().collect();
            (puts, names, d.last_ticket)
        };
        self.put_entries_off_worker(puts).await?;
        let mut d = self.deferred.lock();
        for n in &names {
            d.unwritten.remove(n);
        }
        self.unwritten.store(d.unwritten.len(), SeqCst);
        // Only this writer removes, and it took every entry there was: every ticket up
        // to `last` is written.
        self.written.fetch_max(last, SeqCst);
        Ok(())
    }

    /// New counters' entries, each written on its own (`Store::meta_put_each`: they
    /// stand alone, and sled recovers a prefix of its writes, so an entry is on disk
    /// whenever shard data written after it is), from a blocking thread when the
    /// store blocks (sled holds a write back while a flush's fsync runs). A failure
    /// may leave some of them written: each is a counter with its default spec,
    /// which any later increment would have created the same way.
    async fn put_entries_off_worker(&self, puts: Vec<(Vec<u8>, Vec<u8>)>) -> Result<(), TallyError> {
        if self.store.blocks() {
            let store = self.store.clone();
            tokio::task::spawn_blocking(move || store.meta_put_each(&puts))
                .await
                .unwrap_or(Err(tally_store::StoreError::Closed))
        } else {
            self.store.meta_put_each(&puts)
        }
        .map_err(TallyError::from)
    }

    /// Marks `name` as under a change: no creation of it is deferred until
    /// [`LocalCatalog::release`]. The caller holds the write lock and writes the
    /// unwritten creations next, so the change sees any creation deferred before.
    fn hold(&self, name: &CounterName) {
        self.deferred.lock().busy.insert(name.clone());
    }

    fn release(&self, name: &CounterName) {
        self.deferred.lock().busy.remove(name);
    }
}

impl Catalog for LocalCatalog {
    fn get(&self, name: &str) -> Result<Option<CounterMeta>, TallyError> {
        match self.unwritten(name) {
            Some((meta, _)) => Ok(Some(meta)),
            None => self.stored(name),
        }
    }

    fn ensure_deferred(
        &self,
        name: &CounterName,
        now_ms: u64,
        default: &NamespaceSpec,
    ) -> Option<Result<(CounterMeta, MetaEffect), TallyError>> {
        let mut d = self.deferred.lock();
        if let Some((meta, _)) = d.unwritten.get(name.as_str()) {
            return Some(Ok((meta.clone(), MetaEffect::Unchanged)));
        }
        if d.busy.contains(name.as_str()) || d.unwritten.len() >= CREATIONS_UNWRITTEN_MAX {
            return None;
        }
        // Under the lock, so two creations of one name cannot both find it missing,
        // and the writer cannot move it from the map to the store unseen.
        match self.stored(name.as_str()) {
            Ok(Some(meta)) => return Some(Ok((meta, MetaEffect::Unchanged))),
            Ok(None) => {}
            Err(e) => return Some(Err(e)),
        }
        let ensure = MetaCommand::EnsureWith(*default);
        let namespaces = self.namespaces.read();
        // A counter created under an auto namespace has a record of its own to write.
        if creation_auto(name.as_str(), &ensure, &namespaces).is_some() {
            return None;
        }
        let meta = match apply_command_in(name.as_str(), None, &ensure, now_ms, &namespaces) {
            Ok((Some(meta), MetaEffect::Created)) => meta,
            Ok(_) => return None,
            Err(e) => return Some(Err(e.into())),
        };
        drop(namespaces);
        // Only a `batched` creation may be answered before it is durable (and one
        // without a deadline: a deadline is written with its index record).
        if meta.spec.durability != Durability::Batched || meta.expires_at_ms.is_some() {
            return None;
        }
        d.last_ticket += 1;
        let ticket = d.last_ticket;
        d.unwritten.insert(name.clone(), (meta.clone(), ticket));
        self.unwritten.store(d.unwritten.len(), SeqCst);
        Some(Ok((meta, MetaEffect::Created)))
    }

    fn write_deferred(&self) -> BoxFuture<'_, Result<(), TallyError>> {
        Box::pin(async move {
            let guard = self.write.lock().await;
            self.write_unwritten(&guard).await
        })
    }

    fn creation_written<'a>(&'a self, name: &'a str) -> BoxFuture<'a, Result<(), TallyError>> {
        Box::pin(async move {
            let Some((_, ticket)) = self.unwritten(name) else { return Ok(()) };
            if self.written.load(SeqCst) >= ticket {
                return Ok(());
            }
            let guard = self.write.lock().await;
            // Another writer may have written it while this waited for the lock.
            if self.written.load(SeqCst) >= ticket {
                return Ok(());
            }
            self.write_unwritten(&guard).await
        })
    }

    fn apply<'a>(
        &'a self,
        name: &'a CounterName,
        cmd: &'a MetaCommand,
        now_ms: u64,
    ) -> BoxFuture<'a, Result<(Option<CounterMeta>, MetaEffect), TallyError>> {
        Box::pin(self.apply_local(name, cmd, now_ms))
    }

    fn ensure_many<'a>(
        &'a self,
        names: &'a [CounterName],
        now_ms: u64,
        default: &'a NamespaceSpec,
    ) -> BoxFuture<'a, EnsureResults> {
        Box::pin(self.ensure_local(names, now_ms, default))
    }

    fn namespaces(&self) -> Result<Namespaces, TallyError> {
        Ok(self.namespaces.read().clone())
    }

    fn put_namespace<'a>(
        &'a self,
        prefix: &'a str,
        spec: NamespaceSpec,
    ) -> BoxFuture<'a, Result<bool, TallyError>> {
        Box::pin(async move {
            let guard = self.write.lock().await;
            let existed = self.namespaces.read().contains_key(prefix);
            if !existed && self.namespaces.read().len() >= tally_core::namespace::NAMESPACES_MAX {
                return Err(tally_core::namespace::NamespaceError::TooMany.into());
            }
            self.store.meta_batch(&[(key(NAMESPACE_PREFIX, prefix), codec::encode(&spec))], &[])?;
            self.namespaces.write().insert(prefix.to_owned(), spec);
            drop(guard);
            self.flusher.flush().await?;
            Ok(existed)
        })
    }

    fn delete_namespace<'a>(&'a self, prefix: &'a str) -> BoxFuture<'a, Result<bool, TallyError>> {
        Box::pin(async move {
            let guard = self.write.lock().await;
            if !self.namespaces.read().contains_key(prefix) {
                return Ok(false);
            }
            self.store.meta_batch(&[], &[key(NAMESPACE_PREFIX, prefix)])?;
            self.namespaces.write().remove(prefix);
            drop(guard);
            self.flusher.flush().await?;
            Ok(true)
        })
    }

    fn pending_reshards(&self) -> Result<Vec<CounterName>, TallyError> {
        self.names(RESHARD_PREFIX)
    }

    fn expired(&self, now_ms: u64, limit: usize) -> Result<Vec<CounterName>, TallyError> {
        let page = self.store.meta_scan(EXPIRY_PREFIX, None, limit)?;
        let mut out = Vec::new();
        let mut stale = Vec::new();
        for (k, _) in &page {
            let Some(at) = k.get(EXPIRY_PREFIX.len()..EXPIRY_PREFIX.len() + 8) else { continue };
            let at = u64::from_be_bytes(at.try_into().expect("8 bytes"));
            if at > now_ms {
                break;
            }
            let name = std::str::from_utf8(&k[EXPIRY_PREFIX.len() + 8..])
                .ok()
                .and_then(|n| CounterName::new(n).ok());
            // A record whose counter is gone, or has another deadline now (a crash
            // between the writes of a creation), is dropped here.
            match name {
                Some(n) if self.get(n.as_str())?.and_then(|m| m.expires_at_ms) == Some(at) => out.push(n),
                _ => stale.push(k.clone()),
            }
        }
        if !stale.is_empty() {
            self.store.meta_batch(&[], &stale)?;
        }
        Ok(out)
    }

    fn auto_shards(&self, name: &str) -> Result<Option<AutoShards>, TallyError> {
        match self.store.meta_get(&key(AUTO_PREFIX, name))? {
            None => Ok(None),
            Some(b) => Ok(Some(codec::decode("auto shard bounds", &b).map_err(|source| {
                StoreError::Corrupt { location: format!("auto shard bounds {name:?}"), source }
            })?)),
        }
    }

    fn auto_counters(&self) -> Result<Vec<(CounterName, AutoShards)>, TallyError> {
        self.records(AUTO_PREFIX, |name| self.auto_shards(name))
    }

    fn apply_auto<'a>(
        &'a self,
        name: &'a CounterName,
        cmd: &'a MetaCommand,
        auto: Option<AutoShards>,
        now_ms: u64,
    ) -> BoxFuture<'a, Result<(Option<CounterMeta>, MetaEffect), TallyError>> {
        Box::pin(async move {
            let guard = self.write.lock().await;
            self.apply_locked(guard, name, cmd, Some(auto), now_ms).await
        })
    }

    fn auto_reshard<'a>(
        &'a self,
        name: &'a CounterName,
        version: u64,
        shards: u16,
        now_ms: u64,
    ) -> BoxFuture<'a, Result<(Option<CounterMeta>, MetaEffect), TallyError>> {
        Box::pin(async move {
            let guard = self.write.lock().await;
            let found = self.get(name.as_str())?.map(|m| m.version);
            if found != Some(version) || self.auto_shards(name.as_str())?.is_none() {
                return Err(TallyError::AutoProposalStale { counter: name.to_string(), version, found });
            }
            let cmd =
                MetaCommand::Put(tally_core::spec::SpecPatch { shards: Some(shards), ..Default::default() });
            self.apply_locked(guard, name, &cmd, None, now_ms).await
        })
    }

    fn tombstones(&self) -> Result<Vec<(CounterName, Generations)>, TallyError> {
        self.records(TOMBSTONE_PREFIX, |name| self.tombstone(name))
    }

    fn tombstone(&self, name: &str) -> Result<Option<Generations>, TallyError> {
        match self.store.meta_get(&key(TOMBSTONE_PREFIX, name))? {
            None => Ok(None),
            Some(b) => Ok(Some(codec::decode("tombstone", &b).map_err(|source| StoreError::Corrupt {
                location: format!("tombstone {name:?}"),
                source,
            })?)),
        }
    }

    fn clear_tombstone<'a>(&'a self, name: &'a CounterName) -> BoxFuture<'a, Result<(), TallyError>> {
        Box::pin(async move {
            self.store.meta_delete(&key(TOMBSTONE_PREFIX, name.as_str()))?;
            self.flusher.flush().await?;
            Ok(())
        })
    }

    fn list(
        &self,
        prefix: &str,
        after: Option<&CounterName>,
        limit: usize,
    ) -> Result<Vec<CounterName>, TallyError> {
        let scan = key(COUNTER_PREFIX, prefix);
        let after_key = after.map(|a| key(COUNTER_PREFIX, a.as_str()));
        let page = self.store.meta_scan(&scan, after_key.as_deref(), limit)?;
        let mut names: Vec<CounterName> = page
            .iter()
            .filter_map(|(k, _)| std::str::from_utf8(&k[COUNTER_PREFIX.len()..]).ok())
            .filter_map(|n| CounterName::new(n).ok())
            .collect();
        // Unwritten creations are listed as if written: the first `limit` names of
        // both, in byte order (the store's page holds the first `limit` it has).
        if self.unwritten.load(SeqCst) > 0 {
            let d = self.deferred.lock();
            let after = after.map(CounterName::as_str);
            names.extend(
                d.unwritten
                    .keys()
                    .filter(|n| n.as_str().starts_with(prefix) && after.is_none_or(|a| n.as_str() > a))
                    .cloned(),
            );
            drop(d);
            names.sort_by(|a, b| a.as_str().as_bytes().cmp(b.as_str().as_bytes()));
            names.dedup();
            names.truncate(limit);
        }
        Ok(names)
    }
}

impl LocalCatalog {
    /// The counter's metadata as the store holds it (without unwritten creations).
    fn stored(&self, name: &str) -> Result<Option<CounterMeta>, TallyError> {
        match self.store.meta_get(&key(COUNTER_PREFIX, name))? {
            None => Ok(None),
            Some(bytes) => {
                let meta = codec::decode("counter metadata", &bytes).map_err(|source| {
                    StoreError::Corrupt { location: format!("catalog entry {name:?}"), source }
                })?;
                Ok(Some(meta))
            }
        }
    }

    async fn apply_local(
        &self,
        name: &CounterName,
        cmd: &MetaCommand,
        now_ms: u64,
    ) -> Result<(Option<CounterMeta>, MetaEffect), TallyError> {
        let guard = self.write.lock().await;
        self.apply_locked(guard, name, cmd, None, now_ms).await
    }

    /// [`LocalCatalog::apply_local`] under the write lock, setting the auto bounds too
    /// when `auto` is `Some` (`Some(None)`: the counter becomes fixed). The counter is
    /// held meanwhile, and the unwritten creations are written first, so the change
    /// applies to a deferred creation of the counter and is never written over by it.
    async fn apply_locked(
        &self,
        guard: tokio::sync::MutexGuard<'_, ()>,
        name: &CounterName,
        cmd: &MetaCommand,
        auto: Option<Option<AutoShards>>,
        now_ms: u64,
    ) -> Result<(Option<CounterMeta>, MetaEffect), TallyError> {
        self.hold(name);
        let result = match self.write_unwritten(&guard).await {
            Ok(()) => self.apply_held(guard, name, cmd, auto, now_ms).await,
            Err(e) => Err(e),
        };
        self.release(name);
        result
    }

    /// [`LocalCatalog::apply_locked`] once the unwritten creations are written.
    async fn apply_held(
        &self,
        guard: tokio::sync::MutexGuard<'_, ()>,
        name: &CounterName,
        cmd: &MetaCommand,
        auto: Option<Option<AutoShards>>,
        now_ms: u64,
    ) -> Result<(Option<CounterMeta>, MetaEffect), TallyError> {
        let current = self.stored(name.as_str())?;
        let deadline_before = current.as_ref().and_then(|m| m.expires_at_ms);
        let (next, effect) = {
            let namespaces = self.namespaces.read();
            apply_command_in(name.as_str(), current, cmd, now_ms, &namespaces)?
        };
        let ck = key(COUNTER_PREFIX, name.as_str());
        let rk = key(RESHARD_PREFIX, name.as_str());
        let ak = key(AUTO_PREFIX, name.as_str());
        // The deadline's index record follows the counter's in the same batch.
        let deadline_after = next.as_ref().and_then(|m| m.expires_at_ms);
        let old_deadline = deadline_before.filter(|at| Some(*at) != deadline_after);
        let xk_gone = old_deadline.map(|at| expiry_key(at, name.as_str()));
        let xk_new =
            deadline_after.filter(|at| Some(*at) != deadline_before).map(|at| expiry_key(at, name.as_str()));
        let auto_changed = match auto {
            Some(a) if next.is_some() => a != self.auto_shards(name.as_str())?,
            _ => false,
        };
        match (&next, &effect) {
            (Some(_), MetaEffect::Unchanged) if auto_changed => match auto.flatten() {
                Some(bounds) => self.store.meta_batch(&[(ak, codec::encode(&bounds))], &[])?,
                None => self.store.meta_batch(&[], &[ak])?,
            },
            (_, MetaEffect::Unchanged | MetaEffect::Missing) => return Ok((next, effect)),
            // One atomic change each: a crash never leaves a counter without its
            // tombstone, or a resharding without its marker (or the reverse).
            (None, MetaEffect::Deleted(generations)) => {
                // The tombstone lists the data to delete; it outlives a crash mid-cleanup.
                let tombstone = (key(TOMBSTONE_PREFIX, name.as_str()), codec::encode(generations));
                let deletes: Vec<Vec<u8>> = [ck, rk, ak].into_iter().chain(xk_gone).collect();
                self.store.meta_batch(&[tombstone], &deletes)?;
            }
            (Some(meta), _) => {
                let mut puts = vec![(ck, codec::encode(meta))];
                let mut deletes: Vec<Vec<u8>> = xk_gone.into_iter().collect();
                puts.extend(xk_new.map(|k| (k, Vec::new())));
                if meta.layout.resharding.is_some() {
                    puts.push((rk, Vec::new()));
                } else {
                    deletes.push(rk);
                }
                match auto {
                    Some(Some(bounds)) => puts.push((ak, codec::encode(&bounds))),
                    Some(None) => deletes.push(ak),
                    None => {}
                }
                self.store.meta_batch(&puts, &deletes)?;
            }
            (None, _) => unreachable!("only a delete removes a counter"),
        }
        // Durable before reported, but the next change need not wait for this
        // fsync: one flush then serves several changes.
        drop(guard);
        self.flusher.flush().await?;
        Ok((next, effect))
    }

    /// Every creation in one store batch and one flush: the counters that do not
    /// exist yet are written together, so a burst of first increments to new
    /// counters costs one metadata commit, not one each.
    async fn ensure_local(
        &self,
        names: &[CounterName],
        now_ms: u64,
        default: &NamespaceSpec,
    ) -> EnsureResults {
        let guard = self.write.lock().await;
        // A name deferred meanwhile is found written, not created twice.
        if let Err(e) = self.write_unwritten(&guard).await {
            return names.iter().map(|_| Err(e.clone())).collect();
        }
        let mut out = Vec::with_capacity(names.len());
        let mut puts: Vec<(Vec<u8>, Vec<u8>)> = Vec::new();
        // A name twice in one batch is created once: the second sees the first.
        let mut created: std::collections::HashMap<&str, CounterMeta> = std::collections::HashMap::new();
        for name in names {
            let current = match created.get(name.as_str()) {
                Some(m) => Ok(Some(m.clone())),
                None => self.stored(name.as_str()),
            };
            let ensure = MetaCommand::EnsureWith(*default);
            let result = current.and_then(|c| {
                let namespaces = self.namespaces.read();
                Ok(apply_command_in(name.as_str(), c, &ensure, now_ms, &namespaces)?)
            });
            if let Ok((Some(_), MetaEffect::Created)) = &result {
                // A counter created under an auto namespace follows contention.
                if let Some(bounds) = creation_auto(name.as_str(), &ensure, &self.namespaces.read()) {
                    puts.push((key(AUTO_PREFIX, name.as_str()), codec::encode(&bounds)));
                }
            }
            if let Ok((Some(meta), MetaEffect::Created)) = &result {
                // The deadline's index record first: one that outlives a crash
                // without its counter is dropped by the next reclaim pass, while a
                // counter without its record would never be reclaimed.
                if let Some(at) = meta.expires_at_ms {
                    puts.push((expiry_key(at, name.as_str()), Vec::new()));
                }
                puts.push((key(COUNTER_PREFIX, name.as_str()), codec::encode(meta)));
                created.insert(name.as_str(), meta.clone());
            }
            out.push(result);
        }
        if puts.is_empty() {
            return out;
        }
        let any_sync = created.values().any(|m| m.spec.durability == Durability::Sync);
        drop(created);
        // A new counter never has a resharding marker, so nothing is deleted. sled
        // holds a write back while a flush's fsync runs, so a store that blocks is
        // written from a blocking thread, never from an async worker.
        let written = self.put_entries_off_worker(puts).await;
        drop(guard);
        let settled = match written {
            // A counter created with a `batched` spec by its first increment needs no
            // fsync of its own before that increment is acknowledged: the increment
            // itself is acknowledged from memory and durable only with the flush that
            // follows its drain (within `flush_ms`), and sled recovers a prefix of its
            // writes, so no shard data can survive a crash without the entry written
            // before it.
            Ok(()) if !any_sync => Ok(()),
            Ok(()) => self.flusher.flush().await.map_err(TallyError::from),
            Err(e) => Err(e),
        };
        if let Err(e) = settled {
            // Nothing is reported created that was not written (or, for a `sync`
            // spec, made durable).
            for r in out.iter_mut().filter(|r| matches!(r, Ok((_, MetaEffect::Created)))) {
                *r = Err(e.clone());
            }
        }
        out
    }

    /// Every counter with a record under `prefix`, with that record as `get` reads it.
    fn records<T>(
        &self,
        prefix: &[u8],
        get: impl Fn(&str) -> Result<Option<T>, TallyError>,
    ) -> Result<Vec<(CounterName, T)>, TallyError> {
        let mut out = Vec::new();
        for name in self.names(prefix)? {
            if let Some(record) = get(name.as_str())? {
                out.push((name, record));
            }
        }
        Ok(out)
    }

    fn names(&self, prefix: &[u8]) -> Result<Vec<CounterName>, TallyError> {
        let mut out = Vec::new();
        let mut after: Option<Vec<u8>> = None;
        loop {
            let page = self.store.meta_scan(prefix, after.as_deref(), SCAN_PAGE_KEYS)?;
            let done = page.len() < SCAN_PAGE_KEYS;
            for (k, _) in &page {
                let name = String::from_utf8_lossy(&k[prefix.len()..]).into_owned();
                if let Ok(n) = CounterName::new(name) {
                    out.push(n);
                }
            }
            after = page.last().map(|(k, _)| k.clone());
            if done || after.is_none() {
                return Ok(out);
            }
        }
    }
}
