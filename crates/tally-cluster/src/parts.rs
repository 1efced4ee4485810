//! A node's data directory is one unit.
//!
//! It holds three stores: `raft` (the metadata group's log, and the directory's
//! identity, a [`StoreId`]), `store` (the engine's store: one-copy shards and the
//! node's own records) and, with range groups, `replica` (the node's range
//! replicas, whose raft id is [`crate::replication::replica_id_of`] the identity).
//! The identity is what the cluster knows the node's data by: a directory with a
//! new identity rejoins as a new incarnation, its losses reported until accepted.
//!
//! So a node never runs on part of its directory. Emptied on its own, `replica`
//! would come back under its old replica id with no vote and no log (it could vote
//! for a stale candidate, and entries only it and the old leader held would be
//! lost); `store` would read its one-copy shards as complete zeros. Every store
//! therefore carries the identity's mark (the engine store a key, the replica store
//! its replica id), and once they all do, the identity records that they are
//! *bound*: from then on a store found without the mark was emptied on its own, and
//! one with another identity's mark belongs to another directory. Either way the node
//! refuses to start and says how to come back: with a whole empty directory, as a
//! new incarnation.
//!
//! Directories written before the mark existed are not bound yet: their stores are
//! marked at the next start.

use crate::ClusterError;
use std::path::Path;
use tally_raft::identity::Identity;
use tally_raft::StoreId;
use tally_replica::storage::KvStore;
use tally_replica::{RangeGroups, ReplicaId};
use tally_store::Store;

/// The engine store's key that names the identity of the directory it belongs to.
const STORE_MARK_KEY: &[u8] = b"cluster:data_dir_identity";

/// What a data directory's stores say of the identity they belong to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Mark {
    /// The store carries no mark: new, emptied, or written before marks existed.
    None,
    /// The store belongs to this identity.
    Ours,
    /// The store belongs to another identity.
    Other,
}

/// The mark of the engine store.
fn store_mark(store: &dyn Store, me: StoreId) -> Result<Mark, ClusterError> {
    let storage = |e: tally_store::StoreError| ClusterError::Engine(e.into());
    Ok(match store.meta_get(STORE_MARK_KEY).map_err(storage)? {
        None => Mark::None,
        Some(bytes) if bytes.as_slice() == me.0.to_be_bytes() => Mark::Ours,
        Some(_) => Mark::Other,
    })
}

/// The mark of the replica store: its replica id, `mine` if it is this directory's.
fn replica_mark(replica: &dyn KvStore, mine: ReplicaId) -> Result<Mark, ClusterError> {
    let stored = RangeGroups::stored_replica_id(replica)
        .map_err(|e| ClusterError::DataDir(format!("reading the range replicas' identity: {e}")))?;
    Ok(match stored {
        None => Mark::None,
        Some(id) if id == mine => Mark::Ours,
        Some(_) => Mark::Other,
    })
}

/// The operator's way out, said the same way in every refusal.
fn remedy(data_dir: &Path) -> String {
    format!(
        "A node never runs on part of its data directory. Start it with an empty data directory \
         (move {} aside): it rejoins as a new incarnation and catches up from the other nodes, and \
         whatever only this node held is reported lost until `tally cluster accept-loss`",
        data_dir.display()
    )
}

/// Refuses a data directory whose stores do not all belong to `identity`: before the
/// node starts raft, so it never takes part in anything under an identity whose data
/// it does not hold.
pub(crate) fn check(
    data_dir: &Path,
    identity: &Identity,
    store: &dyn Store,
    replica: Option<(&dyn KvStore, ReplicaId)>,
) -> Result<(), ClusterError> {
    let me = identity.store;
    let bound = identity.bound().map_err(|e| ClusterError::DataDir(e.to_string()))?;
    let mut parts = vec![("store", store_mark(store, me)?)];
    if let Some((replica, mine)) = replica {
        parts.push(("replica", replica_mark(replica, mine)?));
    }
    for (part, mark) in parts {
        let why = match mark {
            Mark::Ours => continue,
            Mark::None if !bound => continue,
            Mark::None => format!(
                "the `{part}` store of {} is empty, but the directory's identity {me} recorded that \
                 it held this node's data: it was emptied on its own",
                data_dir.display()
            ),
            Mark::Other if identity.created => format!(
                "the `raft` store of {} is new (identity {me} was created just now), but `{part}` \
                 holds the data of an earlier identity: `raft` was emptied on its own",
                data_dir.display()
            ),
            Mark::Other => format!(
                "the `{part}` store of {} belongs to another data directory than its `raft` \
                 store (identity {me})",
                data_dir.display()
            ),
        };
        return Err(ClusterError::DataDir(format!("{why}. {}", remedy(data_dir))));
    }
    Ok(())
}

/// Marks the engine store as `identity`'s and records the directory as bound. The
/// replica store, if any, carries its mark already: [`RangeGroups::open`] wrote the
/// identity's replica id into it. Call once every store is open.
pub(crate) fn bind(identity: &Identity, store: &dyn Store) -> Result<(), ClusterError> {
    let storage = |e: tally_store::StoreError| ClusterError::Engine(e.into());
    if identity.bound().map_err(|e| ClusterError::DataDir(e.to_string()))? {
        return Ok(());
    }
    if store_mark(store, identity.store)? == Mark::None {
        store.meta_put(STORE_MARK_KEY, &identity.store.0.to_be_bytes()).map_err(storage)?;
        store.flush().map_err(storage)?;
    }
    identity.set_bound().map_err(|e| ClusterError::DataDir(e.to_string()))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::replication::replica_id_of;
    use tally_replica::storage::MemKv;
    use tally_store::MemStore;

    fn identity() -> (tempfile::TempDir, Identity) {
        let dir = tempfile::tempdir().unwrap();
        let db = sled::open(dir.path()).unwrap();
        let identity = Identity::open(&db).unwrap();
        (dir, identity)
    }

    async fn replica_of(kv: &MemKv, identity: &Identity) {
        RangeGroups::open(
            "n",
            replica_id_of(identity.store),
            std::sync::Arc::new(kv.clone()),
            std::sync::Arc::new(tally_replica::MemRouter::new()),
            tally_core::ranges::RangeLayout::for_members_at(1, 1),
            tally_replica::GroupsConfig::default(),
        )
        .await
        .unwrap();
    }

    #[tokio::test]
    async fn a_bound_directory_refuses_a_store_emptied_on_its_own() {
        let (_dir, identity) = identity();
        let (store, replica) = (MemStore::new(), MemKv::new());
        check(Path::new("d"), &identity, &store, Some((&replica, replica_id_of(identity.store)))).unwrap();
        replica_of(&replica, &identity).await;
        bind(&identity, &store).unwrap();
        check(Path::new("d"), &identity, &store, Some((&replica, replica_id_of(identity.store)))).unwrap();

        let err =
            check(Path::new("d"), &identity, &store, Some((&MemKv::new(), replica_id_of(identity.store))))
                .unwrap_err()
                .to_string();
        assert!(
            err.contains("`replica` store of d is empty") && err.contains("empty data directory"),
            "{err}"
        );
        let err = check(
            Path::new("d"),
            &identity,
            &MemStore::new(),
            Some((&replica, replica_id_of(identity.store))),
        )
        .unwrap_err()
        .to_string();
        assert!(err.contains("`store` store of d is empty"), "{err}");
    }

    #[tokio::test]
    async fn a_store_of_another_directory_is_refused_bound_or_not() {
        let (_a, first) = identity();
        let (_b, second) = identity();
        let (store, replica) = (MemStore::new(), MemKv::new());
        replica_of(&replica, &first).await;
        bind(&first, &store).unwrap();
        assert!(!second.bound().unwrap());
        for (s, r) in [(&store, &MemKv::new()), (&MemStore::new(), &replica)] {
            let err = check(Path::new("d"), &second, s, Some((r, replica_id_of(second.store))))
                .unwrap_err()
                .to_string();
            assert!(err.contains("`raft` store of d is new"), "{err}");
        }
    }

    #[test]
    fn a_directory_written_before_marks_is_bound_at_its_next_start() {
        let (_dir, identity) = identity();
        let store = MemStore::new();
        store.meta_put(b"some:record", b"kept").unwrap();
        check(Path::new("d"), &identity, &store, None).unwrap();
        bind(&identity, &store).unwrap();
        assert!(identity.bound().unwrap());
        assert_eq!(store_mark(&store, identity.store).unwrap(), Mark::Ours);
    }
}
