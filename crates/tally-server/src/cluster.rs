//! [`ClusterService`]: the [`Service`] of a node in a multi-node cluster. Counters are
//! served by the node's engine exactly as on a single node; what differs lives in
//! `tally-cluster`: replicated metadata, ring placement and node-to-node calls.

use crate::config::Config;
use crate::http::error::ApiError;
use crate::metrics::{engine_metrics, reconcile_metrics, replication_metrics, PromWriter};
use crate::service::{ClusterView, NodeState, NodeView, Service};
use crate::sources::{RunBook, RunContext, Scheduler};
use axum::http::StatusCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tally_cluster::{AcceptLossError, ClusterError, ClusterNode, ClusterNodeConfig, Member, MembershipError};
use tally_engine::{ShardsReport, Tally, TallyError};
use tally_raft::MemberRejection;

/// A cluster node behind the HTTP API. Cheap to clone.
#[derive(Clone)]
pub struct ClusterService {
    node: ClusterNode,
    node_id: Arc<str>,
    /// Cleared when shutdown begins, so `/healthz` turns 503 while requests drain.
    serving: Arc<AtomicBool>,
    /// The record of reconciliations this node ran, persisted in its data directory.
    book: Arc<RunBook>,
    /// The schedules of the configured sources of truth (run while this node leads).
    scheduler: Arc<Scheduler>,
}

/// The cluster node's settings, taken from a validated [`Config`]; reads the TLS
/// files of `[tls]`, if any.
pub fn cluster_node_config(config: &Config) -> Result<ClusterNodeConfig, tally_tls::TlsError> {
    let c = &config.cluster;
    // Every node's certificate names its id; its addresses, raft first, tell a
    // dialer whom it reaches.
    let names: tally_tls::NodeNames = c
        .nodes
        .iter()
        .map(|n| (n.id.clone(), [n.raft, n.peer, n.http].into_iter().chain(n.resp).collect()))
        .collect();
    let tls =
        config.tls.as_ref().map(|t| tally_tls::ClusterTls::load(t, &config.node.id, names)).transpose()?;
    Ok(ClusterNodeConfig {
        node_id: config.node.id.clone(),
        data_dir: config.node.data_dir.clone(),
        members: c
            .nodes
            .iter()
            .map(|n| Member {
                id: n.id.clone(),
                raft_id: n.raft_id,
                http: n.http,
                peer: n.peer,
                raft: n.raft,
                initial: n.member,
            })
            .collect(),
        secret: c.secret.clone(),
        fingerprint: c.fingerprint(),
        vnodes_per_node: c.vnodes_per_node,
        heartbeat_ms: c.heartbeat_ms,
        heartbeat_misses_max: c.heartbeat_misses_max,
        raft_heartbeat_ms: c.raft_heartbeat_ms,
        raft_election_timeout_ms: (c.raft_election_timeout_min_ms, c.raft_election_timeout_max_ms),
        engine: config.tally_config(),
        tls,
        replicas: c.replicas(),
        ranges_per_node: c.ranges_per_node,
        groups: tally_cluster::GroupsConfig::default(),
    })
}

impl ClusterService {
    /// Starts this node of the cluster `config` describes.
    pub async fn start(config: &Config) -> Result<Self, ClusterError> {
        let settings = cluster_node_config(config).map_err(|e| ClusterError::Config(e.to_string()))?;
        let node = ClusterNode::start(settings).await?;
        let node_id: Arc<str> = config.node.id.as_str().into();
        let book = Arc::new(RunBook::open(&config.node.data_dir));
        let ctx = RunContext { tally: node.tally().clone(), node: node_id.to_string(), book: book.clone() };
        // Only the metadata leader runs the schedules: every node computes the same
        // instants, and at most one of them leads at a time (a leader change between
        // two nodes' checks may run one instant twice, which the idempotent
        // corrections make harmless).
        let owner = {
            let (node, me) = (node.clone(), node_id.clone());
            Arc::new(move || node.leader().as_deref() == Some(&*me))
        };
        let scheduler = Scheduler::start(&config.reconcile, ctx, owner);
        Ok(Self {
            node,
            node_id,
            serving: Arc::new(AtomicBool::new(true)),
            book,
            scheduler: Arc::new(scheduler),
        })
    }

    /// Marks the node as draining: `/healthz` answers 503 from now on.
    pub fn begin_shutdown(&self) {
        self.serving.store(false, Ordering::SeqCst);
    }

    /// Delivers and flushes every buffered increment, then leaves the cluster.
    pub async fn shutdown(&self) -> Result<(), TallyError> {
        self.begin_shutdown();
        self.scheduler.stop();
        self.node.shutdown().await
    }
}

impl Service for ClusterService {
    async fn shards(&self, name: &str) -> Result<ShardsReport, TallyError> {
        self.node.shards(name).await
    }

    async fn cluster(&self) -> ClusterView {
        let (members, placement_epoch, handoff) = self.node.placement();
        let nodes = self
            .node
            .members()
            .into_iter()
            .map(|m| NodeView {
                member: members.contains(&m.id),
                id: m.id,
                state: match m.state {
                    "up" => NodeState::Up,
                    "suspect" => NodeState::Suspect,
                    _ => NodeState::Down,
                },
                http: m.http.to_string(),
            })
            .collect();
        ClusterView {
            nodes,
            leader: self.node.leader(),
            term: self.node.term(),
            placement_epoch,
            handoff,
            data_lost: self.node.data_lost_nodes(),
            ranges: self.node.replication().map(|r| r.range_reports()),
        }
    }

    async fn accept_loss(&self, id: &str) -> Result<ClusterView, ApiError> {
        match self.node.accept_loss(id).await {
            Ok(_) => Ok(self.cluster().await),
            Err(AcceptLossError::UnknownNode(n)) => Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "node_not_found",
                format!("node {n:?} is not one of cluster.nodes"),
            )),
            Err(e @ AcceptLossError::NotRegistered(_)) => {
                Err(ApiError::new(StatusCode::CONFLICT, "node_not_registered", e.to_string()))
            }
            Err(e @ AcceptLossError::Refused(_)) => {
                Err(ApiError::new(StatusCode::CONFLICT, "store_changed", e.to_string()))
            }
            Err(e @ AcceptLossError::Unavailable(_)) => {
                Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "metadata_unavailable", e.to_string()))
            }
        }
    }

    async fn change_membership(&self, id: &str, add: bool) -> Result<ClusterView, ApiError> {
        let changed = if add { self.node.add_member(id).await } else { self.node.remove_member(id).await };
        match changed {
            Ok(_) => Ok(self.cluster().await),
            Err(MembershipError::UnknownNode(n)) => Err(ApiError::new(
                StatusCode::NOT_FOUND,
                "node_not_found",
                format!("node {n:?} is not one of cluster.nodes"),
            )),
            Err(MembershipError::Refused(e @ MemberRejection::HandoffUnderWay { .. })) => {
                Err(ApiError::new(StatusCode::CONFLICT, "membership_change_in_progress", e.to_string()))
            }
            Err(MembershipError::Refused(e @ MemberRejection::ReshardingUnderWay { .. })) => {
                Err(ApiError::new(StatusCode::CONFLICT, "resharding_in_progress", e.to_string()))
            }
            Err(MembershipError::Refused(e @ MemberRejection::StaleEpoch { .. })) => {
                Err(ApiError::new(StatusCode::CONFLICT, "membership_changed", e.to_string()))
            }
            Err(MembershipError::Refused(e)) => {
                Err(ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_membership", e.to_string()))
            }
            Err(e @ MembershipError::TwoVoters) => {
                Err(ApiError::new(StatusCode::UNPROCESSABLE_ENTITY, "invalid_membership", e.to_string()))
            }
            Err(e @ MembershipError::Unavailable(_)) => {
                Err(ApiError::new(StatusCode::SERVICE_UNAVAILABLE, "metadata_unavailable", e.to_string()))
            }
        }
    }

    fn engine(&self) -> &Tally {
        self.node.tally()
    }

    fn node_id(&self) -> &str {
        &self.node_id
    }

    fn runs(&self) -> &RunBook {
        &self.book
    }

    fn metrics_text(&self) -> String {
        let mut w = PromWriter::new();
        engine_metrics(&mut w, self.node.tally(), &self.node_id);
        reconcile_metrics(&mut w, &self.book);
        let leader = self.node.leader();
        let is_leader = if leader.as_deref() == Some(&*self.node_id) { 1.0 } else { 0.0 };
        w.gauge("tally_raft_leader", "1 when this node leads the metadata group.", &[(&[], is_leader)]);
        w.gauge("tally_raft_term", "The metadata group's raft term.", &[(&[], self.node.term() as f64)]);
        let (members, epoch, handoff) = self.node.placement();
        w.gauge("tally_placement_epoch", "Membership changes applied.", &[(&[], epoch as f64)]);
        w.gauge("tally_placement_members", "Nodes holding shards.", &[(&[], members.len() as f64)]);
        w.gauge(
            "tally_handoff_pending_nodes",
            "Nodes still handing off shards after the last membership change.",
            &[(&[], handoff.len() as f64)],
        );
        w.gauge(
            "tally_ready",
            "1 when the node is ready to serve (metadata caught up, peer sessions up).",
            &[(&[], if self.node.ready() { 1.0 } else { 0.0 })],
        );
        w.gauge(
            "tally_data_lost",
            "1 while this node's shards lack data its replaced disk lost and the loss is not accepted.",
            &[(&[], if self.node.tally().data_lost() { 1.0 } else { 0.0 })],
        );
        w.gauge(
            "tally_connected_peers",
            "Peers with a healthy node-to-node session.",
            &[(&[], self.node.connected_peers() as f64)],
        );
        if let Some(r) = self.node.replication() {
            replication_metrics(&mut w, &r.figures());
        }
        w.finish()
    }

    fn healthy(&self) -> bool {
        self.serving.load(Ordering::SeqCst)
    }

    fn ready(&self) -> bool {
        self.node.ready()
    }
}
