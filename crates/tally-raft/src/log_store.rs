//! The raft log and vote, persisted in sled.
//!
//! # Layout
//!
//! * tree [`LOG_TREE`]: key = log index as 8 big-endian bytes (so sled's key order is
//!   log order), value = the [`Entry`] encoded by `tally_core::codec`.
//! * tree [`VOTE_TREE`]: `vote` → the last saved vote, `committed` → the last
//!   committed log id (an optimisation: a restarted node re-applies up to it at once),
//!   `purged` → the last purged log id.
//!
//! # Durability
//!
//! `save_vote` returns, and `append` calls its callback, only after [`flush`] — an
//! fsync of the whole database — completed. Truncation and
//! purging are not flushed themselves: sled recovers a prefix of its writes, so a
//! crash can only bring back entries that a later flush would have removed, which
//! is the state before the truncate or purge and is as valid as it was then.

// openraft's `StorageError` is large (224 bytes) and its storage traits return it;
// the helpers here return the same type rather than boxing and unboxing it.
#![allow(clippy::result_large_err)]

use crate::types::{Entry, LogId, NodeId, StorageError, TypeConfig};
use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{ErrorSubject, ErrorVerb, OptionalSend, RaftLogReader, StorageIOError, Vote};
use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};

/// Flushes `db` — an fsync of the whole database — and answers what sled's flush
/// does. On a multi-threaded runtime it runs on sled's own threads
/// (`Db::flush_async`). On a current-thread runtime it runs on the spot: there a
/// simulation runs every node on paused time, whose clock jumps to the next timer
/// whenever the runtime has nothing to run, as it would while it waited for another
/// thread, and whose runs must not depend on when another thread finishes.
pub async fn flush(db: &sled::Db) -> sled::Result<usize> {
    let current_thread = tokio::runtime::Handle::try_current()
        .is_ok_and(|h| h.runtime_flavor() == tokio::runtime::RuntimeFlavor::CurrentThread);
    if current_thread {
        db.flush()
    } else {
        db.flush_async().await
    }
}

/// Name of the sled tree holding the log entries.
pub const LOG_TREE: &str = "raft_log";
/// Name of the sled tree holding the vote, the committed and the purged log id.
pub const VOTE_TREE: &str = "raft_vote";

const KEY_VOTE: &[u8] = b"vote";
const KEY_COMMITTED: &[u8] = b"committed";
const KEY_PURGED: &[u8] = b"purged";

/// The raft log of one node, stored in two trees of its sled database. Cheap to
/// clone; clones share the trees (openraft's replication tasks read through clones).
#[derive(Clone)]
pub struct SledLogStore {
    db: sled::Db,
    log: sled::Tree,
    vote: sled::Tree,
}

fn index_key(index: u64) -> [u8; 8] {
    index.to_be_bytes()
}

fn read_err(subject: ErrorSubject<NodeId>, e: impl std::error::Error + 'static) -> StorageError {
    StorageIOError::new(subject, ErrorVerb::Read, openraft::AnyError::new(&e)).into()
}

fn write_err(subject: ErrorSubject<NodeId>, e: impl std::error::Error + 'static) -> StorageError {
    StorageIOError::new(subject, ErrorVerb::Write, openraft::AnyError::new(&e)).into()
}

impl SledLogStore {
    /// Opens (creating if absent) the log trees of `db`.
    pub fn open(db: &sled::Db) -> Result<Self, sled::Error> {
        Ok(Self { db: db.clone(), log: db.open_tree(LOG_TREE)?, vote: db.open_tree(VOTE_TREE)? })
    }

    fn get_value<T: serde::de::DeserializeOwned>(
        &self,
        key: &[u8],
        what: &'static str,
        subject: ErrorSubject<NodeId>,
    ) -> Result<Option<T>, StorageError> {
        match self.vote.get(key).map_err(|e| read_err(subject.clone(), e))? {
            None => Ok(None),
            Some(bytes) => {
                tally_core::codec::decode(what, &bytes).map(Some).map_err(|e| read_err(subject, e))
            }
        }
    }

    fn decode_entry(bytes: &[u8]) -> Result<Entry, StorageError> {
        tally_core::codec::decode("raft log entry", bytes).map_err(|e| read_err(ErrorSubject::Logs, e))
    }

    /// Removes every entry whose key lies in `range`, in one batch.
    fn remove_range(&self, range: impl RangeBounds<[u8; 8]>) -> Result<(), StorageError> {
        let mut batch = sled::Batch::default();
        for item in self.log.range(range) {
            let (key, _) = item.map_err(|e| read_err(ErrorSubject::Logs, e))?;
            batch.remove(key);
        }
        self.log.apply_batch(batch).map_err(|e| write_err(ErrorSubject::Logs, e))
    }
}

impl RaftLogReader<TypeConfig> for SledLogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        let start = match range.start_bound() {
            Bound::Included(i) => Bound::Included(index_key(*i)),
            Bound::Excluded(i) => Bound::Excluded(index_key(*i)),
            Bound::Unbounded => Bound::Unbounded,
        };
        let end = match range.end_bound() {
            Bound::Included(i) => Bound::Included(index_key(*i)),
            Bound::Excluded(i) => Bound::Excluded(index_key(*i)),
            Bound::Unbounded => Bound::Unbounded,
        };
        let mut entries = Vec::new();
        for item in self.log.range((start, end)) {
            let (_, bytes) = item.map_err(|e| read_err(ErrorSubject::Logs, e))?;
            entries.push(Self::decode_entry(&bytes)?);
        }
        Ok(entries)
    }

    async fn limited_get_log_entries(&mut self, start: u64, end: u64) -> Result<Vec<Entry>, StorageError> {
        let mut entries = self.try_get_log_entries(start..end).await?;
        tally_raft_kit::keep_leading_run(start, &mut entries, |e| e.log_id.index);
        Ok(entries)
    }
}

impl RaftLogStorage<TypeConfig> for SledLogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<TypeConfig>, StorageError> {
        let last_purged_log_id: Option<LogId> =
            self.get_value(KEY_PURGED, "purged log id", ErrorSubject::Logs)?;
        let last = match self.log.last().map_err(|e| read_err(ErrorSubject::Logs, e))? {
            Some((_, bytes)) => Some(Self::decode_entry(&bytes)?.log_id),
            None => None,
        };
        Ok(LogState { last_log_id: last.or(last_purged_log_id), last_purged_log_id })
    }

    async fn get_log_reader(&mut self) -> Self::LogReader {
        self.clone()
    }

    async fn save_vote(&mut self, vote: &Vote<NodeId>) -> Result<(), StorageError> {
        self.vote
            .insert(KEY_VOTE, tally_core::codec::encode(vote))
            .map_err(|e| write_err(ErrorSubject::Vote, e))?;
        flush(&self.db).await.map_err(|e| write_err(ErrorSubject::Vote, e))?;
        Ok(())
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<NodeId>>, StorageError> {
        self.get_value(KEY_VOTE, "vote", ErrorSubject::Vote)
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        self.vote
            .insert(KEY_COMMITTED, tally_core::codec::encode(&committed))
            .map_err(|e| write_err(ErrorSubject::Store, e))?;
        Ok(())
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        Ok(self.get_value::<Option<LogId>>(KEY_COMMITTED, "committed log id", ErrorSubject::Store)?.flatten())
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<TypeConfig>) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let mut batch = sled::Batch::default();
        for entry in entries {
            batch.insert(&index_key(entry.log_id.index), tally_core::codec::encode(&entry));
        }
        self.log.apply_batch(batch).map_err(|e| write_err(ErrorSubject::Logs, e))?;
        match flush(&self.db).await {
            Ok(_) => {
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                let err = write_err(ErrorSubject::Logs, e.clone());
                callback.log_io_completed(Err(std::io::Error::other(e)));
                Err(err)
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        tracing::debug!(%log_id, "truncating raft log");
        self.remove_range(index_key(log_id.index)..)
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        tracing::debug!(%log_id, "purging raft log");
        // Record the purge point first: a crash between the two writes leaves entries
        // at or below it, which readers never ask for, but never a hole.
        self.vote
            .insert(KEY_PURGED, tally_core::codec::encode(&log_id))
            .map_err(|e| write_err(ErrorSubject::Logs, e))?;
        self.remove_range(..=index_key(log_id.index))
    }
}
