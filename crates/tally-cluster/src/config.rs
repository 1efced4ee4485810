//! What a cluster node is started from ([`ClusterNodeConfig`]), why it may refuse to
//! start ([`ClusterError`]), and the check that its data was kept the way the config
//! asks (`check_copies`).

use std::net::SocketAddr;
use std::path::PathBuf;
use tally_engine::{TallyConfig, TallyError};

/// One node of the cluster as every node's config lists it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Member {
    /// Stable node name.
    pub id: String,
    /// Stable raft id.
    pub raft_id: u64,
    /// Public HTTP address.
    pub http: SocketAddr,
    /// Node-to-node (ractor_cluster) address.
    pub peer: SocketAddr,
    /// Raft RPC address.
    pub raft: SocketAddr,
    /// Whether the node holds shards from the start (placement epoch 0). A node
    /// listed with `false` runs, votes in the metadata group and serves requests,
    /// but holds shards only once a membership change adds it.
    pub initial: bool,
}

/// Everything a cluster node is started from.
#[derive(Debug, Clone)]
pub struct ClusterNodeConfig {
    /// This node's name (one of `members`).
    pub node_id: String,
    /// Where this node keeps its shard store and its raft log.
    pub data_dir: PathBuf,
    /// Every node of the cluster.
    pub members: Vec<Member>,
    /// Shared secret of node-to-node sessions.
    pub secret: String,
    /// Fingerprint of the cluster-wide config; peers with another one are refused.
    pub fingerprint: u64,
    /// Virtual nodes per node on the ring.
    pub vnodes_per_node: u32,
    /// Node heartbeat interval, in milliseconds.
    pub heartbeat_ms: u64,
    /// Missed heartbeats before a peer is declared down.
    pub heartbeat_misses_max: u32,
    /// Raft heartbeat, in milliseconds.
    pub raft_heartbeat_ms: u64,
    /// Raft election timeout range, in milliseconds.
    pub raft_election_timeout_ms: (u64, u64),
    /// The engine's settings.
    pub engine: TallyConfig,
    /// Mutual TLS between nodes (sessions and raft), with the cluster CA as the
    /// only root; plaintext when `None`.
    pub tls: Option<tally_tls::ClusterTls>,
    /// Copies of every shard, `1..=`[`tally_core::ranges::REPLICAS_MAX`]: 1 keeps
    /// one copy on the ring owner (membership changes hand shards off); more puts
    /// each shard in a range group of `min(replicas, members)` nodes (see
    /// [`replication`](crate::replication); the membership is then fixed).
    pub replicas: u8,
    /// With `replicas` > 1, ranges per member
    /// ([`tally_core::ranges::RangeLayout::for_members_at`]); the same on every node.
    pub ranges_per_node: u32,
    /// With `replicas` > 1, the range groups' raft settings (heartbeat, elections,
    /// when to snapshot and in what frames); `tallyd` takes
    /// [`tally_replica::GroupsConfig::default`].
    pub groups: tally_replica::GroupsConfig,
}

/// Why a node could not start.
#[derive(Debug, thiserror::Error)]
pub enum ClusterError {
    /// The config does not name this node, or is otherwise unusable.
    #[error("cluster config: {0}")]
    Config(String),
    /// The metadata group failed to start.
    #[error("metadata group: {0}")]
    Raft(#[from] tally_raft::RaftError),
    /// The transport failed to start.
    #[error("transport: {0}")]
    Transport(#[from] tally_transport::TransportError),
    /// The engine failed to start.
    #[error("engine: {0}")]
    Engine(#[from] TallyError),
    /// The data directory's stores do not all belong to one identity (one of them
    /// was emptied on its own, or comes from another directory).
    #[error("data directory: {0}")]
    DataDir(String),
}

/// The local store's record of how this node keeps shards: [`ONE_COPY`] or
/// [`RANGE_GROUPS`], written when the node first starts.
const SHARD_COPIES_KEY: &[u8] = b"cluster:shard_copies";
/// Each shard's one copy is in the local store, on its ring owner.
const ONE_COPY: &[u8] = b"one-copy";
/// Shards live in range groups under `data_dir/replica`.
const RANGE_GROUPS: &[u8] = b"range-groups";

/// Refuses to start over data kept the other way than `config.replicas` asks:
/// range groups would never see the local store's one-copy shards (every counter
/// would read as empty), and one copy would never see the groups'. Data written
/// before the record existed is recognized by what it holds (`had_replicas`: the
/// node already had a range replicas' store).
pub(crate) fn check_copies(
    replicas: u8,
    data_dir: &std::path::Path,
    had_replicas: bool,
    local: &dyn tally_store::Store,
) -> Result<(), ClusterError> {
    let want = if replicas > 1 { RANGE_GROUPS } else { ONE_COPY };
    let storage = |e: tally_store::StoreError| ClusterError::Engine(e.into());
    let recorded = local.meta_get(SHARD_COPIES_KEY).map_err(storage)?;
    let stored = match &recorded {
        Some(v) => Some(v.as_slice()),
        None if had_replicas => Some(RANGE_GROUPS),
        None if !local.shard_ids(None, 1).map_err(storage)?.is_empty() => Some(ONE_COPY),
        None => None,
    };
    if let Some(stored) = stored.filter(|s| *s != want) {
        let (held, asked, fix) = if stored == RANGE_GROUPS {
            (
                "shards in range groups (cluster.replicas above 1)",
                "one copy of each shard",
                "the replicas it first started with",
            )
        } else {
            (
                "one copy of each shard (cluster.replicas = 1, the default of earlier releases)",
                "range groups",
                "replicas = 1",
            )
        };
        return Err(ClusterError::Config(format!(
            "the data in {} keeps {held}, and this config asks for {asked} (cluster.replicas = {}): \
             its counters would read as empty. Put {fix} in [cluster], the same on every node",
            data_dir.display(),
            replicas,
        )));
    }
    if recorded.is_none() {
        local.meta_put(SHARD_COPIES_KEY, want).map_err(storage)?;
    }
    Ok(())
}

impl From<tally_store::StoreError> for ClusterError {
    fn from(e: tally_store::StoreError) -> Self {
        ClusterError::Engine(e.into())
    }
}

/// The config's initial members (`member = true`), sorted.
pub(crate) fn initial_members(config: &ClusterNodeConfig) -> Vec<String> {
    let mut ids: Vec<String> = config.members.iter().filter(|m| m.initial).map(|m| m.id.clone()).collect();
    ids.sort();
    ids
}

#[cfg(test)]
mod tests {
    use super::*;
    use tally_core::ids::ShardId;
    use tally_core::name::CounterName;
    use tally_store::{MemStore, ShardWrite, Store};

    fn refused(replicas: u8, dir: &std::path::Path, store: &MemStore) -> String {
        match check_copies(replicas, dir, dir.join("replica").exists(), store) {
            Err(ClusterError::Config(why)) => why,
            other => panic!("replicas = {replicas} over {}: {other:?}", dir.display()),
        }
    }

    #[test]
    fn a_node_keeps_shards_the_way_it_first_started() {
        let dir = tempfile::tempdir().expect("temp dir");
        // A new node records what it was started with, and keeps to it.
        for (first, other) in [(1u8, 3u8), (3, 1)] {
            let store = MemStore::new();
            check_copies(first, dir.path(), dir.path().join("replica").exists(), &store)
                .expect("a new node takes its config");
            check_copies(first, dir.path(), dir.path().join("replica").exists(), &store)
                .expect("and starts again the same way");
            let why = refused(other, dir.path(), &store);
            assert!(why.contains("would read as empty"), "{why}");
            let fix = if first == 1 { "replicas = 1" } else { "the replicas it first started with" };
            assert!(why.contains(fix), "{why}");
            if first > 1 {
                check_copies(5, dir.path(), dir.path().join("replica").exists(), &store)
                    .expect("another count of range groups is still range groups");
            }
        }

        // Data of a release before the record: one-copy shards in the local store...
        let store = MemStore::new();
        let shard = ShardId::new(CounterName::new("likes").expect("name"), 0, 0);
        store.commit(&shard, &ShardWrite::default()).expect("commit");
        refused(3, dir.path(), &store);
        check_copies(1, dir.path(), dir.path().join("replica").exists(), &store)
            .expect("one copy reads them");
        assert_eq!(store.meta_get(SHARD_COPIES_KEY).expect("meta").as_deref(), Some(ONE_COPY));

        // ... or range groups under data_dir/replica.
        std::fs::create_dir(dir.path().join("replica")).expect("mkdir");
        let store = MemStore::new();
        refused(1, dir.path(), &store);
        check_copies(3, dir.path(), dir.path().join("replica").exists(), &store)
            .expect("range groups read them");
        assert_eq!(store.meta_get(SHARD_COPIES_KEY).expect("meta").as_deref(), Some(RANGE_GROUPS));
    }
}
