//! A range group's raft log and vote, in two trees of the node's [`KvStore`].
//!
//! Keys of the log tree are log indexes as 8 big-endian bytes (key order is log
//! order); the meta tree holds the vote, the committed and the purged log id.
//! `save_vote` returns, and `append` reports its entries written, only after a
//! [`KvStore::flush`] (an fsync of the whole store) that began after the write
//! completed: a replica never acknowledges an entry or a vote a crash could take
//! back. An append writes its entries one by one in index order
//! ([`KvTree::write_in_order`], no batch): until the flush a crash keeps a prefix of
//! them, a log without holes, and none of them was acknowledged yet. Truncation and
//! purge are not flushed: the store keeps a prefix of its writes, so a crash can
//! only bring back the state before the truncate or purge, which is as valid as it
//! was then. The vote, the committed and the purged log id are one key each, a
//! plain write. A replication stream's read (`limited_get_log_entries`) answers the
//! entries from its start on, up to the first one missing
//! ([`tally_raft_kit::keep_leading_run`]): never entries past a gap.

// openraft's `StorageError` is large and its storage traits return it.
#![allow(clippy::result_large_err)]

use crate::storage::{KvError, KvStore, KvTree};
use crate::types::{Entry, LogId, RangeConfig, ReplicaId, StorageError};
use openraft::storage::{LogFlushed, LogState, RaftLogStorage};
use openraft::{ErrorSubject, ErrorVerb, OptionalSend, RaftLogReader, StorageIOError, Vote};
use std::fmt::Debug;
use std::ops::{Bound, RangeBounds};
use std::sync::Arc;

const KEY_VOTE: &[u8] = b"vote";
const KEY_COMMITTED: &[u8] = b"committed";
const KEY_PURGED: &[u8] = b"purged";

pub(crate) fn read_err(
    subject: ErrorSubject<ReplicaId>,
    e: impl std::error::Error + 'static,
) -> StorageError {
    StorageIOError::new(subject, ErrorVerb::Read, openraft::AnyError::new(&e)).into()
}

pub(crate) fn write_err(
    subject: ErrorSubject<ReplicaId>,
    e: impl std::error::Error + 'static,
) -> StorageError {
    StorageIOError::new(subject, ErrorVerb::Write, openraft::AnyError::new(&e)).into()
}

/// The log of one group. Cheap to clone; clones share the trees.
#[derive(Clone)]
pub struct LogStore {
    kv: Arc<dyn KvStore>,
    log: Arc<dyn KvTree>,
    meta: Arc<dyn KvTree>,
}

fn index_key(index: u64) -> Vec<u8> {
    index.to_be_bytes().to_vec()
}

fn bound(b: Bound<&u64>) -> Bound<Vec<u8>> {
    match b {
        Bound::Included(i) => Bound::Included(index_key(*i)),
        Bound::Excluded(i) => Bound::Excluded(index_key(*i)),
        Bound::Unbounded => Bound::Unbounded,
    }
}

impl LogStore {
    /// Opens the log trees `<prefix>log` and `<prefix>vote`.
    pub fn open(kv: Arc<dyn KvStore>, prefix: &str) -> Result<Self, KvError> {
        let log = kv.tree(&format!("{prefix}log"))?;
        let meta = kv.tree(&format!("{prefix}vote"))?;
        Ok(Self { kv, log, meta })
    }

    /// Whether the group whose trees are under `prefix` ever voted or was told of
    /// a leader (a stored vote): it took part in a group, so none may be formed anew.
    pub fn took_part(kv: &dyn KvStore, prefix: &str) -> Result<bool, KvError> {
        Ok(kv.tree(&format!("{prefix}vote"))?.get(KEY_VOTE)?.is_some())
    }

    /// Whether the group whose trees are under `prefix` holds nothing: no vote, no
    /// log entry, nothing purged. Such a replica never took part in its group.
    pub fn holds_nothing(kv: &dyn KvStore, prefix: &str) -> Result<bool, KvError> {
        let meta = kv.tree(&format!("{prefix}vote"))?;
        let stateless = meta.get(KEY_VOTE)?.is_none() && meta.get(KEY_PURGED)?.is_none();
        Ok(stateless && kv.tree(&format!("{prefix}log"))?.last()?.is_none())
    }

    /// Writes `first` as the log's first entry (log id 0: the entry openraft's
    /// `initialize` writes on each first voter, the same on all of them) if the
    /// log never held an entry; `false` if it did. The vote stays as it is.
    pub async fn seed_first(&mut self, first: Entry) -> Result<bool, StorageError> {
        assert_eq!(first.log_id, LogId::default(), "only a group's first entry is seeded");
        if self.get_log_state().await?.last_log_id.is_some() {
            return Ok(false);
        }
        let write = vec![(index_key(first.log_id.index), Some(tally_core::codec::encode(&first)))];
        self.log.write_in_order(write).map_err(|e| write_err(ErrorSubject::Logs, e))?;
        self.kv.flush().await.map_err(|e| write_err(ErrorSubject::Logs, e))?;
        Ok(true)
    }

    fn get_value<T: serde::de::DeserializeOwned>(
        &self,
        key: &[u8],
        what: &'static str,
        subject: ErrorSubject<ReplicaId>,
    ) -> Result<Option<T>, StorageError> {
        match self.meta.get(key).map_err(|e| read_err(subject.clone(), e))? {
            None => Ok(None),
            Some(bytes) => {
                tally_core::codec::decode(what, &bytes).map(Some).map_err(|e| read_err(subject, e))
            }
        }
    }

    fn decode_entry(bytes: &[u8]) -> Result<Entry, StorageError> {
        tally_core::codec::decode("range log entry", bytes).map_err(|e| read_err(ErrorSubject::Logs, e))
    }

    fn remove_range(&self, from: Bound<Vec<u8>>, to: Bound<Vec<u8>>) -> Result<(), StorageError> {
        let keys = self.log.scan(from, to).map_err(|e| read_err(ErrorSubject::Logs, e))?;
        let batch = keys.into_iter().map(|(k, _)| (k, None)).collect();
        self.log.apply(batch).map_err(|e| write_err(ErrorSubject::Logs, e))
    }
}

impl RaftLogReader<RangeConfig> for LogStore {
    async fn try_get_log_entries<RB: RangeBounds<u64> + Clone + Debug + OptionalSend>(
        &mut self,
        range: RB,
    ) -> Result<Vec<Entry>, StorageError> {
        let pairs = self
            .log
            .scan(bound(range.start_bound()), bound(range.end_bound()))
            .map_err(|e| read_err(ErrorSubject::Logs, e))?;
        pairs.iter().map(|(_, v)| Self::decode_entry(v)).collect()
    }

    async fn limited_get_log_entries(&mut self, start: u64, end: u64) -> Result<Vec<Entry>, StorageError> {
        let mut entries = self.try_get_log_entries(start..end).await?;
        tally_raft_kit::keep_leading_run(start, &mut entries, |e| e.log_id.index);
        Ok(entries)
    }
}

impl RaftLogStorage<RangeConfig> for LogStore {
    type LogReader = Self;

    async fn get_log_state(&mut self) -> Result<LogState<RangeConfig>, StorageError> {
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

    async fn save_vote(&mut self, vote: &Vote<ReplicaId>) -> Result<(), StorageError> {
        self.meta
            .apply(vec![(KEY_VOTE.to_vec(), Some(tally_core::codec::encode(vote)))])
            .map_err(|e| write_err(ErrorSubject::Vote, e))?;
        self.kv.flush().await.map_err(|e| write_err(ErrorSubject::Vote, e))
    }

    async fn read_vote(&mut self) -> Result<Option<Vote<ReplicaId>>, StorageError> {
        self.get_value(KEY_VOTE, "vote", ErrorSubject::Vote)
    }

    async fn save_committed(&mut self, committed: Option<LogId>) -> Result<(), StorageError> {
        self.meta
            .apply(vec![(KEY_COMMITTED.to_vec(), Some(tally_core::codec::encode(&committed)))])
            .map_err(|e| write_err(ErrorSubject::Store, e))
    }

    async fn read_committed(&mut self) -> Result<Option<LogId>, StorageError> {
        Ok(self.get_value::<Option<LogId>>(KEY_COMMITTED, "committed log id", ErrorSubject::Store)?.flatten())
    }

    async fn append<I>(&mut self, entries: I, callback: LogFlushed<RangeConfig>) -> Result<(), StorageError>
    where
        I: IntoIterator<Item = Entry> + OptionalSend,
        I::IntoIter: OptionalSend,
    {
        let writes = entries
            .into_iter()
            .map(|e| (index_key(e.log_id.index), Some(tally_core::codec::encode(&e))))
            .collect();
        self.log.write_in_order(writes).map_err(|e| write_err(ErrorSubject::Logs, e))?;
        match self.kv.flush().await {
            Ok(()) => {
                callback.log_io_completed(Ok(()));
                Ok(())
            }
            Err(e) => {
                callback.log_io_completed(Err(std::io::Error::other(e.clone())));
                Err(write_err(ErrorSubject::Logs, e))
            }
        }
    }

    async fn truncate(&mut self, log_id: LogId) -> Result<(), StorageError> {
        self.remove_range(Bound::Included(index_key(log_id.index)), Bound::Unbounded)
    }

    async fn purge(&mut self, log_id: LogId) -> Result<(), StorageError> {
        // The purge point first: a crash between the two leaves entries at or below
        // it, which nobody asks for, never a hole.
        self.meta
            .apply(vec![(KEY_PURGED.to_vec(), Some(tally_core::codec::encode(&log_id)))])
            .map_err(|e| write_err(ErrorSubject::Logs, e))?;
        self.remove_range(Bound::Unbounded, Bound::Included(index_key(log_id.index)))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::storage::MemKv;
    use openraft::entry::RaftEntry;
    use openraft::CommittedLeaderId;

    fn log_id(index: u64) -> LogId {
        LogId::new(CommittedLeaderId::new(1, 1), index)
    }

    fn indexes(entries: &[Entry]) -> Vec<u64> {
        entries.iter().map(|e| e.log_id.index).collect()
    }

    /// A replication stream's read returns the entries from its start on, up to the
    /// first one missing: never entries past a gap, which openraft would send as if
    /// they followed the entry before the range (a deposed leader's stream, reading
    /// a log purged and refilled since it planned the read, sent a follower entries
    /// 8 and 9 as the first of the log, and the follower's group stopped on "try to
    /// get log at index 0").
    #[tokio::test]
    async fn a_read_never_returns_entries_past_a_missing_one() {
        let mut log = LogStore::open(Arc::new(MemKv::new()), "t/").unwrap();
        let writes = (0..12)
            .map(|i| (index_key(i), Some(tally_core::codec::encode(&Entry::new_blank(log_id(i))))))
            .collect();
        log.log.write_in_order(writes).unwrap();
        log.purge(log_id(7)).await.unwrap();
        assert_eq!(indexes(&log.limited_get_log_entries(0, 10).await.unwrap()), Vec::<u64>::new());
        assert_eq!(indexes(&log.limited_get_log_entries(8, 10).await.unwrap()), vec![8, 9]);
        assert_eq!(indexes(&log.limited_get_log_entries(8, 12).await.unwrap()), vec![8, 9, 10, 11]);
        log.log.write_in_order(vec![(index_key(10), None)]).unwrap();
        assert_eq!(indexes(&log.limited_get_log_entries(8, 12).await.unwrap()), vec![8, 9]);
        // openraft's own reads (memberships at startup) may start below the log and
        // take what is there.
        assert_eq!(indexes(&log.try_get_log_entries(0..12).await.unwrap()), vec![8, 9, 11]);
    }
}
