//! The production store: one sled database per node.
//!
//! # Layout
//!
//! * Shard data is striped over [`SHARD_TREES`] trees named `shards-00` … `shards-15`.
//!   A shard lives in exactly one of them, chosen by hashing its key prefix, and
//!   *everything* of the shard (its image and all its dedup records) lives in that one
//!   tree.
//! * A shard write is atomic across crashes without a sled batch (see
//!   [`IMAGE_CARRIED_RECORDS_MAX`]): its removals, then its image, then its new dedup
//!   records are plain inserts, in that order, and the image's value carries the
//!   records written after it. sled recovers a prefix of its writes, so after a crash
//!   only the records of a shard's last image can be missing, and the shard's writer
//!   puts them back when it opens the shard ([`Store::open_shard`]). A write with more
//!   records than an image carries is one atomic [`sled::Tree::apply_batch`] instead.
//! * A shard's keys all start with its *prefix*:
//!   `u16 BE name length ‖ name bytes ‖ u32 BE generation ‖ u16 BE index`.
//!   The image key is `prefix ‖ 0x00`; a dedup record's key is
//!   `prefix ‖ 0x01 ‖ event id bytes`. Because the name is length-prefixed and the
//!   other fields are fixed-width, one shard's prefix is never a prefix of another
//!   shard's key: `"a"` and `"a:b"`, or generation 1 and 256, cannot collide, and a
//!   prefix scan of one shard sees that shard only.
//! * Metadata lives in its own tree, `meta`, under the caller's raw keys and values.
//!
//! Images and dedup records are encoded with [`tally_core::codec`]. An image's value is
//! the encoded image, followed — when its write put dedup records the ordered way — by
//! the encoded list of those records (`Vec<(event id, DedupRecord)>`).

use crate::{DedupRecord, ShardImage, ShardWrite, Store, StoreError, Upgrade};
use sled::Transactional as _;
use std::fmt;
use std::ops::Bound;
use std::path::{Path, PathBuf};
use tally_core::codec;
use tally_core::hash::{hash64, reduce, STORE_SEED};
use tally_core::ids::ShardId;

/// How many sled trees shard data is striped over.
///
/// sled serialises writes to neighbouring keys of one tree: they share a leaf page, and
/// concurrent updates of one page retry each other's compare-and-swap (measured on this
/// project's machines, 8 threads writing different keys of one tree got less done than
/// one thread). Writes to different trees touch different pages and scale. 16 trees
/// spread the shards of a node enough to keep every core busy while keeping the number
/// of trees (each with its own root page and iterator state) small. Changing it moves
/// every shard to another tree: it is part of the on-disk format.
pub const SHARD_TREES: usize = 16;

/// Most dedup records a shard write puts the ordered way: removals, then the image
/// carrying the records, then the records, each a plain insert. A write with more (a
/// hand-off page of records) is one atomic batch, whose image carries nothing.
///
/// Why not always a batch: a sled `Batch` or transaction rolls the log buffer before
/// and after its manifest (`pin_log`), two log-buffer writes of its own, each a
/// `pwrite` and `sync_file_range` on sled's I/O threads, and it takes sled's global
/// write lock, which stops every read meanwhile. Plain inserts share the log buffer
/// that the cycle's one flush writes. Measured with `redis-benchmark -c 64` sending
/// `TALLY.INCRBY` with a new event id each to a 64-shard `sync` counter, the batch cost
/// a third of the throughput (the measurement is in the history of bench/README.md).
pub const IMAGE_CARRIED_RECORDS_MAX: usize = 64;

/// Name of the tree that holds metadata entries.
const META_TREE: &str = "meta";

/// Tag byte after a shard prefix for the shard's image.
const TAG_IMAGE: u8 = 0x00;
/// Tag byte after a shard prefix for the shard's dedup records.
const TAG_DEDUP: u8 = 0x01;

/// How to open a [`SledStore`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct SledConfig {
    /// Directory of the sled database; created if missing.
    pub path: PathBuf,
    /// Bytes of page cache sled may keep in memory. sled's default (1 GiB) is far more
    /// than a node needs and makes memory use look like a leak, so the default here is
    /// [`SledConfig::DEFAULT_CACHE_CAPACITY_BYTES`]; this cache is what bounds the
    /// memory that retained idempotency records cost.
    pub cache_capacity_bytes: u64,
    /// Period of sled's background fsync, in milliseconds; `None` disables it so that
    /// only [`Store::flush`] makes data durable. The default, `Some(500)`, matches
    /// sled's and bounds what a crash loses on `batched` counters whose engine-side
    /// flush fell behind.
    pub flush_every_ms: Option<u64>,
}

impl SledConfig {
    /// The default page cache size: 8 MiB.
    ///
    /// Every idempotency record (event id, drain id, writer mark) lives in the
    /// store, so the page cache is the only part of them in memory, and sled holds
    /// several times its nominal capacity in cloned nodes: fed unique event ids
    /// (`examples/dedup_rss.rs`, `bench/dedup_memory.sh`), a 64 MiB cache kept
    /// stepping up to 490 MiB of RSS at 3 M records, while 8 MiB rose only from 146
    /// to 156 MiB between 0.45 M and 3 M records. Counter images are a few dozen bytes,
    /// so a small cache costs hot counters nothing; cold lookups go to the OS page
    /// cache, which is not the process's memory.
    pub const DEFAULT_CACHE_CAPACITY_BYTES: u64 = 8 << 20;
    /// The default background flush period: 500 ms, like sled's own default.
    pub const DEFAULT_FLUSH_EVERY_MS: Option<u64> = Some(500);

    /// A configuration for the database at `path` with every other setting at its
    /// default.
    pub fn new(path: impl Into<PathBuf>) -> Self {
        Self {
            path: path.into(),
            cache_capacity_bytes: Self::DEFAULT_CACHE_CAPACITY_BYTES,
            flush_every_ms: Self::DEFAULT_FLUSH_EVERY_MS,
        }
    }
}

/// The production [`Store`]: a sled database with shard data striped over
/// [`SHARD_TREES`] trees and metadata in a tree of its own (see the module docs for the
/// key layout).
///
/// Cloning is cheap and yields another handle to the same open database; the database
/// closes when the last handle is dropped (sled flushes it then).
#[derive(Clone)]
pub struct SledStore {
    db: sled::Db,
    shards: Vec<sled::Tree>,
    meta: sled::Tree,
    path: PathBuf,
}

impl fmt::Debug for SledStore {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("SledStore").field("path", &self.path).finish_non_exhaustive()
    }
}

impl SledStore {
    /// Opens (or creates) the database described by `config`.
    ///
    /// sled runs in [`sled::Mode::HighThroughput`]: a Tally node's disk traffic is almost
    /// all small overwrites (shard images) and short-lived inserts (dedup records that
    /// expire after the dedup window), so write throughput matters far more than the
    /// space that fragmentation costs, and expiry returns that space anyway. (sled 0.34.7
    /// records the mode but does not act on it yet; the choice states the intent for
    /// the version that does.)
    pub fn open(config: &SledConfig) -> Result<Self, StoreError> {
        let db = sled::Config::new()
            .path(&config.path)
            .cache_capacity(config.cache_capacity_bytes)
            .flush_every_ms(config.flush_every_ms)
            .mode(sled::Mode::HighThroughput)
            .open()
            .map_err(|e| StoreError::sled("open", e))?;
        let shards = (0..SHARD_TREES)
            .map(|i| db.open_tree(format!("shards-{i:02}")))
            .collect::<Result<Vec<_>, _>>()
            .map_err(|e| StoreError::sled("open", e))?;
        let meta = db.open_tree(META_TREE).map_err(|e| StoreError::sled("open", e))?;
        tracing::debug!(path = %config.path.display(), recovered = db.was_recovered(), "opened sled store");
        Ok(Self { db, shards, meta, path: config.path.clone() })
    }

    /// Opens (or creates) the database at `path` with the default configuration.
    pub fn open_path(path: impl AsRef<Path>) -> Result<Self, StoreError> {
        Self::open(&SledConfig::new(path.as_ref()))
    }

    /// Opens the database at `path` as [`SledStore::open_path`] does, retrying for up
    /// to `wait` while another handle's lock on it is still held: sled's background
    /// threads can keep a dropped handle's lock for a moment on a busy machine, so a
    /// store closed and opened again in one process may find it taken.
    pub fn open_path_waiting(path: impl AsRef<Path>, wait: std::time::Duration) -> Result<Self, StoreError> {
        let deadline = std::time::Instant::now() + wait;
        loop {
            match Self::open_path(path.as_ref()) {
                Err(e) if e.to_string().contains("lock") && std::time::Instant::now() < deadline => {
                    std::thread::sleep(std::time::Duration::from_millis(10));
                }
                opened => return opened,
            }
        }
    }

    /// The directory the database lives in.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// True if the database existed before it was opened (a restart rather than a
    /// first start).
    pub fn was_recovered(&self) -> bool {
        self.db.was_recovered()
    }

    /// The tree that holds shard `id`, given its key prefix.
    fn tree_for(&self, prefix: &[u8]) -> &sled::Tree {
        &self.shards[tree_index(prefix)]
    }

    /// Applies every tree's staged operations (indexed like `self.shards`) in one
    /// atomic transaction over the trees that have any.
    fn apply_group(&self, grouped: Vec<Staged>) -> Result<(), StoreError> {
        let (trees, ops): (Vec<&sled::Tree>, Vec<Staged>) = grouped
            .into_iter()
            .enumerate()
            .filter(|(_, ops)| !ops.is_empty())
            .map(|(tree, ops)| (&self.shards[tree], ops))
            .unzip();
        if trees.len() == 1 {
            let (tree, ops) = (trees[0], ops.into_iter().next().unwrap_or_default());
            return apply_staged(tree, ops);
        }
        let result: sled::transaction::TransactionResult<(), ()> = trees.as_slice().transaction(|views| {
            for (view, ops) in views.iter().zip(&ops) {
                for (key, value) in ops {
                    match value {
                        Some(v) => view.insert(key.as_slice(), v.as_slice())?,
                        None => view.remove(key.as_slice())?,
                    };
                }
            }
            Ok(())
        });
        result.map_err(|e| match e {
            sled::transaction::TransactionError::Storage(e) => StoreError::sled("commit", e),
            sled::transaction::TransactionError::Abort(()) => {
                StoreError::Io { op: "commit", message: "the transaction aborted".into() }
            }
        })
    }
}

/// The key prefix shared by every key of shard `id`:
/// `u16 BE name length ‖ name ‖ u32 BE generation ‖ u16 BE index`.
fn shard_prefix(id: &ShardId) -> Vec<u8> {
    let name = id.counter.as_str().as_bytes();
    // A counter name's escaped form is at most `NAME_LEN_MAX` (1,536) bytes, so the
    // length always fits.
    let len = u16::try_from(name.len()).expect("counter names are at most NAME_LEN_MAX bytes");
    let mut key = Vec::with_capacity(2 + name.len() + 4 + 2 + 1 + 32);
    key.extend_from_slice(&len.to_be_bytes());
    key.extend_from_slice(name);
    // The generation's word: the replica class rides in its top bits.
    key.extend_from_slice(&id.generation_word().to_be_bytes());
    key.extend_from_slice(&id.index.to_be_bytes());
    key
}

/// Adds one shard write to `batch`. A sled batch maps each key to its last write, so
/// staging several writes in order has the effect of applying them in order.
fn stage_write(staged: &mut Staged, prefix: &[u8], write: &ShardWrite) {
    for event_id in &write.dedup_remove {
        staged.push((dedup_key(prefix, event_id), None));
    }
    for (event_id, record) in &write.dedup_put {
        staged.push((dedup_key(prefix, event_id), Some(codec::encode(record))));
    }
    staged.push((image_key(prefix), Some(codec::encode(&write.image))));
}

/// The key operations of one or more shard writes to one tree, in order (`None`
/// removes the key).
type Staged = Vec<(Vec<u8>, Option<Vec<u8>>)>;

/// Applies `staged` to `tree` atomically. A single key is written with a plain
/// insert or remove, which sled applies atomically on its own: a `Batch` costs sled
/// two extra log-buffer writes (`pin_log` rolls the buffer before and after its
/// manifest), each a `pwrite` and `sync_file_range` of its own, so a one-shard
/// commit cycle would write the log three times instead of once.
fn apply_staged(tree: &sled::Tree, staged: Staged) -> Result<(), StoreError> {
    let err = |e| StoreError::sled("commit", e);
    if staged.len() == 1 {
        let (key, value) = staged.into_iter().next().expect("one operation");
        return match value {
            Some(v) => tree.insert(key, v).map(drop).map_err(err),
            None => tree.remove(key).map(drop).map_err(err),
        };
    }
    let mut batch = sled::Batch::default();
    for (key, value) in staged {
        match value {
            Some(v) => batch.insert(key, v),
            None => batch.remove(key),
        }
    }
    tree.apply_batch(batch).map_err(err)
}

/// The shard whose prefix starts `key` (the inverse of [`shard_prefix`]).
fn parse_prefix(key: &[u8]) -> Result<ShardId, StoreError> {
    let corrupt = |reason: &str| {
        StoreError::corrupt(
            "shard key".to_string(),
            codec::DecodeError { what: "shard key", reason: reason.to_string() },
        )
    };
    let len = usize::from(u16::from_be_bytes(
        key.get(..2).and_then(|b| b.try_into().ok()).ok_or_else(|| corrupt("short key"))?,
    ));
    let name = key.get(2..2 + len).ok_or_else(|| corrupt("short name"))?;
    let name = std::str::from_utf8(name).map_err(|e| corrupt(&e.to_string()))?;
    let rest = key.get(2 + len..2 + len + 6).ok_or_else(|| corrupt("short key"))?;
    let word = u32::from_be_bytes([rest[0], rest[1], rest[2], rest[3]]);
    let index = u16::from_be_bytes([rest[4], rest[5]]);
    let counter = tally_core::CounterName::new(name).map_err(|e| corrupt(&e.to_string()))?;
    Ok(ShardId::from_word(counter, word, index))
}

/// Which of the [`SHARD_TREES`] trees holds the shard with key prefix `prefix`.
fn tree_index(prefix: &[u8]) -> usize {
    // The result is below SHARD_TREES, so the cast cannot truncate.
    reduce(hash64(STORE_SEED, prefix), SHARD_TREES as u64) as usize
}

/// The key of the shard's image.
fn image_key(prefix: &[u8]) -> Vec<u8> {
    let mut key = prefix.to_vec();
    key.push(TAG_IMAGE);
    key
}

/// The first key of the shard's dedup records (the records' key prefix).
fn dedup_start(prefix: &[u8]) -> Vec<u8> {
    let mut key = prefix.to_vec();
    key.push(TAG_DEDUP);
    key
}

/// The key of the shard's dedup record for `event_id`.
fn dedup_key(prefix: &[u8], event_id: &str) -> Vec<u8> {
    let mut key = dedup_start(prefix);
    key.extend_from_slice(event_id.as_bytes());
    key
}

/// The first key after all of the shard's dedup records.
fn dedup_end(prefix: &[u8]) -> Vec<u8> {
    let mut key = prefix.to_vec();
    key.push(TAG_DEDUP + 1);
    key
}

fn decode_image(id: &ShardId, bytes: &[u8]) -> Result<ShardImage, StoreError> {
    decode_stored_image(id, bytes).map(|(image, _)| image)
}

/// The records an image's write put after it (see [`IMAGE_CARRIED_RECORDS_MAX`]).
type Carried = Vec<(String, DedupRecord)>;

/// An image's value: the image, then the records its write puts after it, if any (an
/// image that carries none is stored as the image alone).
fn encode_stored_image(image: &ShardImage, carried: &[(String, DedupRecord)]) -> Vec<u8> {
    let mut bytes = codec::encode(image);
    if !carried.is_empty() {
        bytes.extend_from_slice(&codec::encode(&carried));
    }
    bytes
}

/// The image in an image's value and the records it carries (both checked: bytes
/// that are neither are corruption, whoever reads them).
fn decode_stored_image(id: &ShardId, bytes: &[u8]) -> Result<(ShardImage, Carried), StoreError> {
    let corrupt = |e| StoreError::corrupt(format!("shard {id} image"), e);
    let (image, used) = codec::decode_prefix("shard image", bytes).map_err(corrupt)?;
    let carried = match &bytes[used..] {
        [] => Vec::new(),
        rest => codec::decode("records carried by a shard image", rest).map_err(corrupt)?,
    };
    Ok((image, carried))
}

/// Whether `write` goes the ordered way (plain inserts, its image carrying its
/// records) rather than as one atomic batch.
fn goes_ordered(write: &ShardWrite) -> bool {
    write.dedup_put.len() <= IMAGE_CARRIED_RECORDS_MAX
}

/// Applies `write` as plain inserts, each atomic on its own: the removals (records
/// past their window: a crash that keeps some of them and loses the rest changes no
/// verdict), the image carrying the new records, then the records. sled recovers a
/// prefix of its writes, so a crash leaves either the old image, or the new one with
/// some of its records, which [`SledStore::open_shard`] puts back.
fn write_ordered(tree: &sled::Tree, prefix: &[u8], write: &ShardWrite) -> Result<(), StoreError> {
    let err = |e| StoreError::sled("commit", e);
    for event_id in &write.dedup_remove {
        tree.remove(dedup_key(prefix, event_id)).map_err(err)?;
    }
    tree.insert(image_key(prefix), encode_stored_image(&write.image, &write.dedup_put)).map_err(err)?;
    for (event_id, record) in &write.dedup_put {
        tree.insert(dedup_key(prefix, event_id), codec::encode(record)).map_err(err)?;
    }
    Ok(())
}

fn decode_record(id: &ShardId, event_id: &str, bytes: &[u8]) -> Result<DedupRecord, StoreError> {
    codec::decode("dedup record", bytes)
        .map_err(|e| StoreError::corrupt(format!("shard {id} dedup record {event_id:?}"), e))
}

/// A record an upgrade writes back: its tree (`SHARD_TREES` for the metadata tree),
/// key and new value.
type Rewritten = (usize, Vec<u8>, Vec<u8>);

impl SledStore {
    /// The rewritten `(tree, key, value)` of every record `plan` names, read before
    /// anything is written.
    fn upgraded_records(&self, plan: &Upgrade<'_>) -> Result<Vec<Rewritten>, StoreError> {
        let mut out = Vec::new();
        if let Some(rewrite) = plan.shard_image {
            for (index, tree) in self.shards.iter().enumerate() {
                for entry in tree.iter() {
                    let (key, value) = entry.map_err(|e| StoreError::sled("upgrade", e))?;
                    let id = parse_prefix(&key)?;
                    if key[..] != image_key(&shard_prefix(&id))[..] {
                        continue;
                    }
                    let upgraded =
                        rewrite(&value).map_err(|e| StoreError::corrupt(format!("shard {id} image"), e))?;
                    out.push((index, key.to_vec(), upgraded));
                }
            }
        }
        for (prefix, rewrite) in &plan.meta {
            for entry in self.meta.scan_prefix(prefix) {
                let (key, value) = entry.map_err(|e| StoreError::sled("upgrade", e))?;
                let upgraded = rewrite(&value).map_err(|e| {
                    StoreError::corrupt(format!("metadata entry {:?}", String::from_utf8_lossy(&key)), e)
                })?;
                out.push((SHARD_TREES, key.to_vec(), upgraded));
            }
        }
        Ok(out)
    }
}

impl Store for SledStore {
    fn load_shard(&self, id: &ShardId) -> Result<ShardImage, StoreError> {
        fail::fail_point!("store::load", |_| Err(StoreError::Injected("store::load")));
        let prefix = shard_prefix(id);
        match self.tree_for(&prefix).get(image_key(&prefix)) {
            Ok(Some(bytes)) => decode_image(id, &bytes),
            Ok(None) => Ok(ShardImage::default()),
            Err(e) => Err(StoreError::sled("load_shard", e)),
        }
    }

    /// The image, after putting back any record it carries that a crash lost: only
    /// the shard's writer opens it, so nothing else writes the shard meanwhile, and its
    /// dedup lookups all come after.
    fn open_shard(&self, id: &ShardId) -> Result<ShardImage, StoreError> {
        fail::fail_point!("store::load", |_| Err(StoreError::Injected("store::load")));
        let prefix = shard_prefix(id);
        let tree = self.tree_for(&prefix);
        let bytes = match tree.get(image_key(&prefix)) {
            Ok(Some(bytes)) => bytes,
            Ok(None) => return Ok(ShardImage::default()),
            Err(e) => return Err(StoreError::sled("open_shard", e)),
        };
        let (image, carried) = decode_stored_image(id, &bytes)?;
        let mut restored = 0usize;
        let err = |e| StoreError::sled("open_shard", e);
        for (event_id, record) in &carried {
            let key = dedup_key(&prefix, event_id);
            let held = tree.get(&key).map_err(err)?.map(|b| decode_record(id, event_id, &b)).transpose()?;
            if held.as_ref() != Some(record) {
                tree.insert(key, codec::encode(record)).map_err(err)?;
                restored += 1;
            }
        }
        if restored > 0 {
            tracing::info!(shard = %id, restored, "put back dedup records its image carries");
        }
        Ok(image)
    }

    fn dedup_get(&self, id: &ShardId, event_id: &str) -> Result<Option<DedupRecord>, StoreError> {
        fail::fail_point!("store::dedup_get", |_| Err(StoreError::Injected("store::dedup_get")));
        let prefix = shard_prefix(id);
        match self.tree_for(&prefix).get(dedup_key(&prefix, event_id)) {
            Ok(Some(bytes)) => decode_record(id, event_id, &bytes).map(Some),
            Ok(None) => Ok(None),
            Err(e) => Err(StoreError::sled("dedup_get", e)),
        }
    }

    fn shard_ids(&self, after: Option<&ShardId>, limit: usize) -> Result<Vec<ShardId>, StoreError> {
        fail::fail_point!("store::shard_ids", |_| Err(StoreError::Injected("store::shard_ids")));
        // Order: tree by tree, and by key within a tree. Each shard's keys are
        // contiguous, so after one shard's image the scan jumps past its records.
        let (mut tree, mut from) = match after {
            Some(id) => {
                let prefix = shard_prefix(id);
                (tree_index(&prefix), Bound::Included(dedup_end(&prefix)))
            }
            None => (0, Bound::Unbounded),
        };
        let mut out = Vec::new();
        while out.len() < limit && tree < SHARD_TREES {
            let next = self.shards[tree].range::<Vec<u8>, _>((from.clone(), Bound::Unbounded)).next();
            match next {
                Some(entry) => {
                    let (key, _) = entry.map_err(|e| StoreError::sled("shard_ids", e))?;
                    let id = parse_prefix(&key)?;
                    from = Bound::Included(dedup_end(&shard_prefix(&id)));
                    out.push(id);
                }
                None => {
                    tree += 1;
                    from = Bound::Unbounded;
                }
            }
        }
        Ok(out)
    }

    fn dedup_scan(
        &self,
        id: &ShardId,
        after: Option<&str>,
        limit: usize,
    ) -> Result<Vec<(String, DedupRecord)>, StoreError> {
        fail::fail_point!("store::dedup_scan", |_| Err(StoreError::Injected("store::dedup_scan")));
        if limit == 0 {
            return Ok(Vec::new());
        }
        let prefix = shard_prefix(id);
        let start = match after {
            Some(after) => Bound::Excluded(dedup_key(&prefix, after)),
            None => Bound::Included(dedup_start(&prefix)),
        };
        let end = Bound::Excluded(dedup_end(&prefix));
        let skip = prefix.len() + 1;
        let mut out = Vec::with_capacity(limit.min(1024));
        for entry in self.tree_for(&prefix).range::<Vec<u8>, _>((start, end)).take(limit) {
            let (key, value) = entry.map_err(|e| StoreError::sled("dedup_scan", e))?;
            let event_id = std::str::from_utf8(&key[skip..]).map_err(|e| {
                StoreError::corrupt(
                    format!("shard {id} dedup key"),
                    codec::DecodeError { what: "event id", reason: e.to_string() },
                )
            })?;
            let record = decode_record(id, event_id, &value)?;
            out.push((event_id.to_owned(), record));
        }
        Ok(out)
    }

    /// Removes come before puts in the batch, so an event id that is both removed and
    /// put ends up with the put record (an expired id applied again); when an id is
    /// put twice the later record wins.
    fn commit(&self, id: &ShardId, write: &ShardWrite) -> Result<(), StoreError> {
        fail::fail_point!("store::commit", |_| Err(StoreError::Injected("store::commit")));
        let prefix = shard_prefix(id);
        if goes_ordered(write) {
            return write_ordered(self.tree_for(&prefix), &prefix, write);
        }
        let mut staged = Staged::new();
        stage_write(&mut staged, &prefix, write);
        apply_staged(self.tree_for(&prefix), staged)
    }

    /// A shard's write is atomic on its own; writes of several shards need not be
    /// atomic together, but may be. So a write goes the ordered way (plain inserts,
    /// which sled appends to its current log buffer; see [`IMAGE_CARRIED_RECORDS_MAX`]),
    /// and only writes with more records than an image carries share one atomic
    /// transaction over the trees they touch. Every atomic group costs sled two
    /// log-buffer writes of its own, each a synchronous `sync_file_range` (see
    /// `apply_staged`): one `Batch` per tree cost up to 2 × [`SHARD_TREES`] disk
    /// writes per cycle, on top of its flush.
    fn commit_many(&self, writes: &[(ShardId, ShardWrite)]) -> Vec<Result<(), StoreError>> {
        fail::fail_point!("store::commit_many", |_| {
            writes.iter().map(|_| Err(StoreError::Injected("store::commit_many"))).collect()
        });
        let mut grouped: Vec<Staged> = (0..SHARD_TREES).map(|_| Staged::new()).collect();
        // Shards with a write in the group: a later write of theirs joins it, so the
        // writes of one shard are applied in the order given.
        let mut in_group: std::collections::HashSet<Vec<u8>> = std::collections::HashSet::new();
        // Per write: `None` when it rides in the group, else its own result.
        let mut outcome: Vec<Option<Result<(), StoreError>>> = Vec::with_capacity(writes.len());
        for (id, write) in writes {
            let prefix = shard_prefix(id);
            let tree = tree_index(&prefix);
            if goes_ordered(write) && !in_group.contains(&prefix) {
                outcome.push(Some(write_ordered(&self.shards[tree], &prefix, write)));
            } else {
                let mut staged = Staged::new();
                stage_write(&mut staged, &prefix, write);
                grouped[tree].extend(staged);
                in_group.insert(prefix);
                outcome.push(None);
            }
        }
        let group = if outcome.iter().any(Option::is_none) { self.apply_group(grouped) } else { Ok(()) };
        outcome.into_iter().map(|o| o.unwrap_or_else(|| group.clone())).collect()
    }

    /// Scans the shard's keys and removes them in one batch. The shard actor is the
    /// only writer of its shard, so nothing is committed to it between the scan and
    /// the batch.
    fn delete_shard(&self, id: &ShardId) -> Result<(), StoreError> {
        fail::fail_point!("store::delete_shard", |_| Err(StoreError::Injected("store::delete_shard")));
        let prefix = shard_prefix(id);
        let tree = self.tree_for(&prefix);
        let mut batch = sled::Batch::default();
        for key in tree.scan_prefix(&prefix).keys() {
            batch.remove(key.map_err(|e| StoreError::sled("delete_shard", e))?);
        }
        tree.apply_batch(batch).map_err(|e| StoreError::sled("delete_shard", e))
    }

    fn flush(&self) -> Result<(), StoreError> {
        fail::fail_point!("store::flush", |_| Err(StoreError::Injected("store::flush")));
        self.db.flush().map(drop).map_err(|e| StoreError::sled("flush", e))
    }

    fn meta_get(&self, key: &[u8]) -> Result<Option<Vec<u8>>, StoreError> {
        fail::fail_point!("store::meta_get", |_| Err(StoreError::Injected("store::meta_get")));
        self.meta.get(key).map(|v| v.map(|v| v.to_vec())).map_err(|e| StoreError::sled("meta_get", e))
    }

    fn meta_put(&self, key: &[u8], value: &[u8]) -> Result<(), StoreError> {
        fail::fail_point!("store::meta_put", |_| Err(StoreError::Injected("store::meta_put")));
        self.meta.insert(key, value).map(drop).map_err(|e| StoreError::sled("meta_put", e))
    }

    fn meta_delete(&self, key: &[u8]) -> Result<(), StoreError> {
        fail::fail_point!("store::meta_delete", |_| Err(StoreError::Injected("store::meta_delete")));
        self.meta.remove(key).map(drop).map_err(|e| StoreError::sled("meta_delete", e))
    }

    fn meta_batch(&self, puts: &[(Vec<u8>, Vec<u8>)], deletes: &[Vec<u8>]) -> Result<(), StoreError> {
        fail::fail_point!("store::meta_batch", |_| Err(StoreError::Injected("store::meta_batch")));
        let mut batch = sled::Batch::default();
        for key in deletes {
            batch.remove(key.as_slice());
        }
        for (key, value) in puts {
            batch.insert(key.as_slice(), value.as_slice());
        }
        self.meta.apply_batch(batch).map_err(|e| StoreError::sled("meta_batch", e))
    }

    /// Plain inserts: a `sled::Batch` would roll the log buffer twice and take sled's
    /// global write lock (see [`IMAGE_CARRIED_RECORDS_MAX`]).
    fn meta_put_each(&self, puts: &[(Vec<u8>, Vec<u8>)]) -> Result<(), StoreError> {
        fail::fail_point!("store::meta_put_each", |_| Err(StoreError::Injected("store::meta_put_each")));
        for (key, value) in puts {
            self.meta
                .insert(key.as_slice(), value.as_slice())
                .map_err(|e| StoreError::sled("meta_put_each", e))?;
        }
        Ok(())
    }

    fn meta_scan(
        &self,
        prefix: &[u8],
        after: Option<&[u8]>,
        limit: usize,
    ) -> Result<Vec<(Vec<u8>, Vec<u8>)>, StoreError> {
        fail::fail_point!("store::meta_scan", |_| Err(StoreError::Injected("store::meta_scan")));
        if limit == 0 {
            return Ok(Vec::new());
        }
        // Keys with `prefix` form one contiguous run. Start at the later of the run's
        // start and `after`, and stop at the first key outside the run.
        let iter = match after {
            Some(after) if after >= prefix => {
                self.meta.range::<&[u8], _>((Bound::Excluded(after), Bound::Unbounded))
            }
            _ => self.meta.range::<&[u8], _>((Bound::Included(prefix), Bound::Unbounded)),
        };
        let mut out = Vec::with_capacity(limit.min(1024));
        for entry in iter {
            let (key, value) = entry.map_err(|e| StoreError::sled("meta_scan", e))?;
            if !key.starts_with(prefix) || out.len() == limit {
                break;
            }
            out.push((key.to_vec(), value.to_vec()));
        }
        Ok(out)
    }

    fn upgrade(&self, plan: &Upgrade<'_>) -> Result<u64, StoreError> {
        use sled::transaction::{ConflictableTransactionError, TransactionError, Transactional};
        let records = self.upgraded_records(plan)?;
        // Shard trees first, metadata last: index SHARD_TREES is the meta tree.
        let trees: Vec<&sled::Tree> = self.shards.iter().chain(std::iter::once(&self.meta)).collect();
        let (marker_key, marker_value) = plan.marker;
        trees
            .as_slice()
            .transaction(|txs| {
                for (tree, key, value) in &records {
                    txs[*tree].insert(key.as_slice(), value.as_slice())?;
                }
                txs[SHARD_TREES].insert(marker_key, marker_value)?;
                Ok::<_, ConflictableTransactionError<()>>(())
            })
            .map_err(|e| match e {
                TransactionError::Storage(e) => StoreError::sled("upgrade", e),
                TransactionError::Abort(()) => StoreError::Io { op: "upgrade", message: "aborted".into() },
            })?;
        self.db.flush().map_err(|e| StoreError::sled("upgrade", e))?;
        Ok(records.len() as u64)
    }

    fn size_on_disk(&self) -> Result<u64, StoreError> {
        self.db.size_on_disk().map_err(|e| StoreError::sled("size_on_disk", e))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_core::name::CounterName;

    fn shard(name: &str, generation: u32, index: u16) -> ShardId {
        ShardId::new(CounterName::new(name).unwrap(), generation, index)
    }

    /// Opens the store at `path` again once the dropped handle has let go of it.
    fn reopen(path: &Path) -> SledStore {
        SledStore::open_path_waiting(path, std::time::Duration::from_secs(10)).unwrap()
    }

    #[test]
    fn a_shards_prefix_names_it_back_with_its_class() {
        for id in [shard("likes:1", 0, 3), shard("likes:1", 12, 0).in_class(5)] {
            assert_eq!(parse_prefix(&shard_prefix(&id)).unwrap(), id);
        }
        // The cluster's class keys as before classes existed.
        let mut legacy = 7u16.to_be_bytes().to_vec();
        legacy.extend_from_slice(b"likes:1");
        legacy.extend_from_slice(&12u32.to_be_bytes());
        legacy.extend_from_slice(&3u16.to_be_bytes());
        assert_eq!(shard_prefix(&shard("likes:1", 12, 3)), legacy);
    }

    #[test]
    fn an_upgrade_rewrites_every_named_record_at_once_or_nothing() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open_path(dir.path()).unwrap();
        let (a, b) = (shard("a", 0, 0), shard("b", 1, 3));
        for id in [&a, &b] {
            let write = ShardWrite {
                image: ShardImage { value: 7, ..ShardImage::default() },
                dedup_put: vec![("e".into(), DedupRecord { delta: 1, applied_at_ms: 2 })],
                ..Default::default()
            };
            store.commit(id, &write).unwrap();
        }
        store.meta_put(b"c/x", b"old").unwrap();
        store.meta_put(b"other", b"kept").unwrap();
        // A rewrite that doubles the value of every image and marks metadata.
        // An image's value may carry records after the image (`a`'s and `b`'s do).
        let images = |bytes: &[u8]| {
            let (mut image, used): (ShardImage, usize) = codec::decode_prefix("image", bytes)?;
            image.value *= 2;
            Ok([codec::encode(&image), bytes[used..].to_vec()].concat())
        };
        let meta = |bytes: &[u8]| Ok([bytes, b"+new"].concat());
        let plan =
            Upgrade { shard_image: Some(&images), meta: vec![(b"c/", &meta)], marker: (b"format", b"2") };
        assert_eq!(store.upgrade(&plan).unwrap(), 3);
        assert_eq!(store.load_shard(&a).unwrap().value, 14);
        assert_eq!(store.load_shard(&b).unwrap().value, 14);
        assert!(store.dedup_get(&a, "e").unwrap().is_some(), "dedup records are not images");
        assert_eq!(store.meta_get(b"c/x").unwrap().as_deref(), Some(&b"old+new"[..]));
        assert_eq!(store.meta_get(b"other").unwrap().as_deref(), Some(&b"kept"[..]));
        assert_eq!(store.meta_get(b"format").unwrap().as_deref(), Some(&b"2"[..]));

        // One record the rewrite cannot read: nothing changes, marker included.
        store.meta_put(b"c/y", b"").unwrap();
        let picky = |bytes: &[u8]| {
            if bytes.is_empty() {
                Err(codec::DecodeError { what: "entry", reason: "empty".into() })
            } else {
                Ok(bytes.to_vec())
            }
        };
        let plan =
            Upgrade { shard_image: Some(&images), meta: vec![(b"c/", &picky)], marker: (b"format", b"3") };
        let err = store.upgrade(&plan).unwrap_err();
        assert!(matches!(err, StoreError::Corrupt { .. }), "{err}");
        assert_eq!(store.load_shard(&a).unwrap().value, 14);
        assert_eq!(store.meta_get(b"format").unwrap().as_deref(), Some(&b"2"[..]));
    }

    /// What a crash can leave of an ordered write: its image, and not all the records
    /// written after it.
    #[test]
    fn the_shards_writer_puts_back_the_records_its_image_carries() {
        let dir = tempfile::tempdir().unwrap();
        let id = shard("likes", 0, 3);
        let (r1, r2) =
            (DedupRecord { delta: 1, applied_at_ms: 5 }, DedupRecord { delta: 2, applied_at_ms: 6 });
        {
            let store = SledStore::open_path(dir.path()).unwrap();
            let first = ShardWrite {
                image: ShardImage { value: 1, ..ShardImage::default() },
                dedup_put: vec![("e1".into(), r1)],
                ..Default::default()
            };
            let second = ShardWrite {
                image: ShardImage { value: 3, ..ShardImage::default() },
                dedup_put: vec![("e2".into(), r2)],
                ..Default::default()
            };
            assert!(store
                .commit_many(&[(id.clone(), first), (id.clone(), second)])
                .iter()
                .all(Result::is_ok));
            // The crash: the last image reached the disk, its record did not.
            let prefix = shard_prefix(&id);
            store.tree_for(&prefix).remove(dedup_key(&prefix, "e2")).unwrap();
            store.flush().unwrap();
        }
        let store = reopen(dir.path());
        // A reader sees the image and writes nothing.
        assert_eq!(store.load_shard(&id).unwrap().value, 3);
        assert_eq!(store.dedup_get(&id, "e2").unwrap(), None);
        // The writer's open puts the record back before its first lookup.
        assert_eq!(store.open_shard(&id).unwrap().value, 3);
        assert_eq!(store.dedup_get(&id, "e2").unwrap(), Some(r2));
        assert_eq!(store.dedup_get(&id, "e1").unwrap(), Some(r1));
        // Records are records, not images; and an image written alone carries nothing.
        assert_eq!(store.shard_ids(None, 10).unwrap(), vec![id.clone()]);
        store
            .commit(
                &id,
                &ShardWrite { image: ShardImage { value: 4, ..ShardImage::default() }, ..Default::default() },
            )
            .unwrap();
        let prefix = shard_prefix(&id);
        let stored = store.tree_for(&prefix).get(image_key(&prefix)).unwrap().unwrap();
        assert_eq!(&stored[..], &codec::encode(&ShardImage { value: 4, ..ShardImage::default() })[..]);
    }

    #[test]
    fn a_write_with_more_records_than_an_image_carries_is_one_batch() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open_path(dir.path()).unwrap();
        let id = shard("likes", 0, 1);
        let record = DedupRecord { delta: 1, applied_at_ms: 5 };
        let dedup_put: Vec<(String, DedupRecord)> =
            (0..=IMAGE_CARRIED_RECORDS_MAX).map(|i| (format!("e{i}"), record)).collect();
        let image = ShardImage { value: 7, ..ShardImage::default() };
        store.commit_many(&[(
            id.clone(),
            ShardWrite { image: image.clone(), dedup_put, ..Default::default() },
        )]);
        let prefix = shard_prefix(&id);
        let stored = store.tree_for(&prefix).get(image_key(&prefix)).unwrap().unwrap();
        assert_eq!(&stored[..], &codec::encode(&image)[..], "the image carries nothing");
        assert_eq!(store.dedup_scan(&id, None, 1000).unwrap().len(), IMAGE_CARRIED_RECORDS_MAX + 1);
    }

    #[test]
    fn no_shard_prefix_is_a_prefix_of_another_shards_key() {
        let ids = [
            shard("a", 0, 0),
            shard("a", 0, 1),
            shard("a", 1, 0),
            shard("a", 256, 0),
            shard("a", 0, 256),
            shard("a:b", 0, 0),
            shard("ab", 0, 0),
            shard("a.", 1, 1),
        ];
        for x in &ids {
            for y in &ids {
                if x == y {
                    continue;
                }
                let px = shard_prefix(x);
                let py = shard_prefix(y);
                assert!(!image_key(&py).starts_with(&px), "{x} vs {y}");
                assert!(!dedup_key(&py, "").starts_with(&px), "{x} vs {y}");
                assert!(!dedup_key(&py, "zzzz").starts_with(&px), "{x} vs {y}");
            }
        }
    }

    #[test]
    fn key_layout_is_pinned() {
        let p = shard_prefix(&shard("ab", 0x0102_0304, 0x0506));
        assert_eq!(p, [0, 2, b'a', b'b', 1, 2, 3, 4, 5, 6]);
        assert_eq!(image_key(&p).last(), Some(&0));
        assert_eq!(dedup_key(&p, "e").as_slice(), [&p[..], &[1, b'e']].concat().as_slice());
        assert!(tree_index(&p) < SHARD_TREES);
    }

    #[test]
    fn a_cycle_of_one_key_and_many_key_writes_over_every_tree_reads_back_after_reopening() {
        let dir = tempfile::tempdir().unwrap();
        let ids: Vec<ShardId> = (0..64u16).map(|i| shard("likes", 0, i)).collect();
        {
            let store = SledStore::open_path(dir.path()).unwrap();
            // Odd shards write an image alone (a plain insert); even ones an image with
            // a record and remove another (their cycle's transaction).
            let first: Vec<(ShardId, ShardWrite)> = ids
                .iter()
                .map(|id| {
                    let record = DedupRecord { delta: 1, applied_at_ms: 2 };
                    let dedup_put = vec![("old".into(), record), ("e".into(), record)];
                    (id.clone(), ShardWrite { image: ShardImage::default(), dedup_put, ..Default::default() })
                })
                .collect();
            assert!(store.commit_many(&first).iter().all(Result::is_ok));
            let writes: Vec<(ShardId, ShardWrite)> = ids
                .iter()
                .map(|id| {
                    let image = ShardImage { value: i64::from(id.index) + 1, ..ShardImage::default() };
                    let write = if id.index % 2 == 1 {
                        ShardWrite { image, ..Default::default() }
                    } else {
                        ShardWrite {
                            image,
                            dedup_put: vec![("e2".into(), DedupRecord { delta: 3, applied_at_ms: 4 })],
                            dedup_remove: vec!["old".into()],
                        }
                    };
                    (id.clone(), write)
                })
                .collect();
            assert!(store.commit_many(&writes).iter().all(Result::is_ok));
            store.flush().unwrap();
        }
        let store = reopen(dir.path());
        for id in &ids {
            assert_eq!(store.load_shard(id).unwrap().value, i64::from(id.index) + 1, "{id}");
            assert!(store.dedup_get(id, "e").unwrap().is_some(), "{id}");
            let even = id.index % 2 == 0;
            assert_eq!(store.dedup_get(id, "e2").unwrap().is_some(), even, "{id}");
            assert_eq!(store.dedup_get(id, "old").unwrap().is_none(), even, "{id}");
        }
    }

    #[test]
    fn shards_spread_over_trees() {
        let mut used = [false; SHARD_TREES];
        for i in 0..256u16 {
            used[tree_index(&shard_prefix(&shard("likes", 0, i)))] = true;
        }
        assert!(used.iter().all(|u| *u), "256 shards should touch every tree");
    }

    #[test]
    fn garbage_bytes_are_reported_as_corruption_not_panics() {
        let dir = tempfile::tempdir().unwrap();
        let store = SledStore::open_path(dir.path()).unwrap();
        let id = shard("likes", 0, 3);
        let prefix = shard_prefix(&id);
        let tree = store.tree_for(&prefix).clone();

        tree.insert(image_key(&prefix), &[0xff, 0xff, 0xff][..]).unwrap();
        match store.load_shard(&id) {
            Err(StoreError::Corrupt { location, source }) => {
                assert!(location.contains("likes"), "{location}");
                assert_eq!(source.what, "shard image");
            }
            other => panic!("expected corruption, got {other:?}"),
        }

        // A valid image followed by trailing bytes is corrupt too.
        let mut long = codec::encode(&ShardImage {
            value: 1,
            sketch: None,
            frequency: None,
            windows: None,
            escrow: None,
        });
        long.push(7);
        tree.insert(image_key(&prefix), long).unwrap();
        assert!(matches!(store.load_shard(&id), Err(StoreError::Corrupt { .. })));

        tree.insert(dedup_key(&prefix, "e1"), &[0x01][..]).unwrap();
        assert!(matches!(store.dedup_get(&id, "e1"), Err(StoreError::Corrupt { .. })));
        assert!(matches!(store.dedup_scan(&id, None, 10), Err(StoreError::Corrupt { .. })));

        // An event id that is not UTF-8.
        let mut bad_key = dedup_start(&prefix);
        bad_key.push(0xff);
        tree.remove(dedup_key(&prefix, "e1")).unwrap();
        tree.insert(bad_key, codec::encode(&DedupRecord { delta: 1, applied_at_ms: 2 })).unwrap();
        match store.dedup_scan(&id, None, 10) {
            Err(StoreError::Corrupt { source, .. }) => assert_eq!(source.what, "event id"),
            other => panic!("expected corruption, got {other:?}"),
        }

        // Other shards are unaffected, and deleting the shard clears the damage.
        assert_eq!(store.load_shard(&shard("likes", 0, 4)), Ok(ShardImage::default()));
        store.delete_shard(&id).unwrap();
        assert_eq!(store.load_shard(&id), Ok(ShardImage::default()));
        assert_eq!(store.dedup_scan(&id, None, 10), Ok(vec![]));
    }
}
