//! A node's store incarnation: the identity of its data directory.
//!
//! A raft node id names a machine's role in the cluster; it survives a replaced
//! disk. What raft must never see is the same id with lost state (a voter whose log
//! is shorter than what the leader knows it acknowledged). So every data directory
//! gets a [`StoreId`] of its own when it is first created, persisted in the raft
//! database, and every raft RPC names the sender's and the expected receiver's
//! store ids (see `server.rs`). A node whose disk was replaced comes back with a new
//! store id, is refused under its old identity, and rejoins as a new incarnation.
//!
//! # Layout
//!
//! Tree [`IDENTITY_TREE`]: `store` → the [`StoreId`], `replaced` → present while
//! this node knows that its earlier data is lost and the metadata group has not
//! recorded the loss as accepted, `format` → the raft database's format marker
//! ([`tally_core::format::RAFT_STORE_FORMAT`]; absent in databases of the first
//! format), `bound` → present once the node's other stores (its shard store, its
//! range replicas) were marked as this identity's, so a store that is later found
//! without the mark was emptied on its own (tally-cluster's `parts`).

use crate::log_store::LOG_TREE;
use crate::store_id::StoreId;

/// Name of the sled tree holding the store identity.
pub const IDENTITY_TREE: &str = "raft_identity";

const KEY_STORE: &[u8] = b"store";
const KEY_REPLACED: &[u8] = b"replaced";
const KEY_FORMAT: &[u8] = b"format";
const KEY_BOUND: &[u8] = b"bound";

/// This node's identity as stored in its raft database.
#[derive(Debug, Clone)]
pub struct Identity {
    tree: sled::Tree,
    /// The data directory's identity.
    pub store: StoreId,
    /// Whether the identity was created by this start (the directory is new).
    pub created: bool,
}

/// Why the identity could not be read or written.
#[derive(Debug, thiserror::Error)]
pub enum IdentityError {
    /// sled failed.
    #[error("store identity: {0}")]
    Sled(#[from] sled::Error),
    /// The stored identity does not decode.
    #[error("store identity: {0}")]
    Corrupt(String),
    /// The database was written in a format this release does not read.
    #[error(transparent)]
    Format(#[from] tally_core::format::FormatError),
    /// Upgrading a database of an older format failed; nothing was changed.
    #[error(transparent)]
    Upgrade(#[from] crate::upgrade::UpgradeError),
}

impl Identity {
    /// Opens the identity of `db`, creating (and flushing) a new random one if the
    /// database has none. Refuses, before anything is written, a database of a format
    /// this release does not read, and marks the others with this release's format.
    pub fn open(db: &sled::Db) -> Result<Self, IdentityError> {
        use tally_core::format::{
            encode_version, judge_store, RAFT_STORE_FORMAT, RAFT_STORE_FORMATS_READABLE,
        };
        let tree = db.open_tree(IDENTITY_TREE)?;
        let holds_data = tree.contains_key(KEY_STORE)? || db.open_tree(LOG_TREE)?.first()?.is_some();
        let marker = tree.get(KEY_FORMAT)?;
        let verdict = judge_store("raft store", marker.as_deref(), holds_data, RAFT_STORE_FORMATS_READABLE)?;
        let current = encode_version(RAFT_STORE_FORMAT);
        if verdict.write_marker && holds_data && verdict.found != RAFT_STORE_FORMAT {
            assert!(verdict.found < RAFT_STORE_FORMAT, "readable formats are 1..={RAFT_STORE_FORMAT}");
            let rewritten = crate::upgrade::from(verdict.found, db, &tree, KEY_FORMAT, &current)?;
            tracing::info!(
                from = verdict.found,
                to = RAFT_STORE_FORMAT,
                rewritten,
                "upgraded the raft store's format"
            );
        } else if verdict.write_marker {
            tree.insert(KEY_FORMAT, &current)?;
            db.flush()?;
        }
        if let Some(bytes) = tree.get(KEY_STORE)? {
            let raw = <[u8; 16]>::try_from(&*bytes)
                .map_err(|_| IdentityError::Corrupt(format!("{} bytes instead of 16", bytes.len())))?;
            return Ok(Self { tree, store: StoreId(u128::from_be_bytes(raw)), created: false });
        }
        let store = StoreId::random();
        tree.insert(KEY_STORE, &store.0.to_be_bytes())?;
        db.flush()?;
        Ok(Self { tree, store, created: true })
    }

    /// Whether this node has recorded that its earlier data is lost.
    pub fn replaced(&self) -> Result<bool, IdentityError> {
        Ok(self.tree.contains_key(KEY_REPLACED)?)
    }

    /// Whether the node's other stores were marked as this identity's
    /// ([`Identity::set_bound`]).
    pub fn bound(&self) -> Result<bool, IdentityError> {
        Ok(self.tree.contains_key(KEY_BOUND)?)
    }

    /// Records (durably) that every other store of the data directory carries this
    /// identity's mark: from now on a store found without it was emptied on its own.
    pub fn set_bound(&self) -> Result<(), IdentityError> {
        self.tree.insert(KEY_BOUND, &[])?;
        self.tree.flush()?;
        Ok(())
    }

    /// Records (durably) whether this node's earlier data is lost.
    pub fn set_replaced(&self, replaced: bool) -> Result<(), IdentityError> {
        if replaced {
            self.tree.insert(KEY_REPLACED, &[])?;
        } else {
            self.tree.remove(KEY_REPLACED)?;
        }
        self.tree.flush()?;
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Opens the database at `path` again once the one just dropped has let go of its
    /// file lock: sled's flusher thread may still hold it for a moment after the drop.
    fn reopen(path: &std::path::Path) -> sled::Db {
        let deadline = std::time::Instant::now() + std::time::Duration::from_secs(10);
        loop {
            match sled::open(path) {
                Ok(db) => return db,
                Err(sled::Error::Io(e))
                    if e.kind() == std::io::ErrorKind::WouldBlock && std::time::Instant::now() < deadline =>
                {
                    std::thread::sleep(std::time::Duration::from_millis(20));
                }
                Err(e) => panic!("cannot reopen {}: {e}", path.display()),
            }
        }
    }

    #[test]
    fn an_identity_is_created_once_and_kept() {
        let dir = tempfile::tempdir().unwrap();
        let first = {
            let db = sled::open(dir.path()).unwrap();
            let id = Identity::open(&db).unwrap();
            assert!(id.created && !id.replaced().unwrap());
            id.set_replaced(true).unwrap();
            id.store
        };
        let db = reopen(dir.path());
        let again = Identity::open(&db).unwrap();
        assert_eq!((again.store, again.created), (first, false));
        assert!(again.replaced().unwrap());
        again.set_replaced(false).unwrap();
        assert!(!again.replaced().unwrap());
        assert!(!again.bound().unwrap());
        again.set_bound().unwrap();
        assert!(again.bound().unwrap());
        let other = sled::open(tempfile::tempdir().unwrap().path()).unwrap();
        assert_ne!(Identity::open(&other).unwrap().store, first);
    }

    #[test]
    fn a_database_is_marked_and_one_of_an_unknown_format_is_refused() {
        use tally_core::format::{encode_version, RAFT_STORE_FORMAT};
        let dir = tempfile::tempdir().unwrap();
        let db = sled::open(dir.path()).unwrap();
        let id = Identity::open(&db).unwrap();
        let marker = db.open_tree(IDENTITY_TREE).unwrap().get(KEY_FORMAT).unwrap();
        assert_eq!(marker.as_deref(), Some(&encode_version(RAFT_STORE_FORMAT)[..]));

        // A database of the first format (no marker, an identity): opened and marked.
        let tree = db.open_tree(IDENTITY_TREE).unwrap();
        tree.remove(KEY_FORMAT).unwrap();
        assert_eq!(Identity::open(&db).unwrap().store, id.store);
        assert!(tree.contains_key(KEY_FORMAT).unwrap());

        // A later release's database: refused, identity untouched.
        tree.insert(KEY_FORMAT, &encode_version(RAFT_STORE_FORMAT + 1)).unwrap();
        let err = Identity::open(&db).unwrap_err();
        assert!(matches!(err, IdentityError::Format(_)), "{err}");
        assert!(err.to_string().contains("raft store"), "{err}");
    }

    #[test]
    fn store_ids_round_trip_through_json_and_the_codec() {
        let id = StoreId(u128::MAX - 7);
        let json = serde_json::to_string(&id).unwrap();
        assert_eq!(serde_json::from_str::<StoreId>(&json).unwrap(), id);
        let bytes = tally_core::codec::encode(&id);
        assert_eq!(tally_core::codec::decode::<StoreId>("id", &bytes).unwrap(), id);
        assert_eq!(id.to_string().len(), 32);
    }
}
