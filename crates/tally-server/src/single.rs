//! [`SingleNode`]: the [`Service`] of a one-node deployment, straight over the
//! embedded engine. Every shard is local, the node is its own metadata leader, and
//! nothing crosses a network except the HTTP request itself.

use crate::config::{Config, ConfigError, NodeEntry};
use crate::http::error::ApiError;
use crate::metrics::{engine_metrics, reconcile_metrics, PromWriter};
use crate::service::{ClusterView, NodeState, NodeView, Service};
use crate::sources::{RunBook, RunContext, Scheduler};
use axum::http::StatusCode;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tally_engine::{SledStore, SystemClock, Tally, TallyError};

/// Why a node could not start.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum StartError {
    /// The configuration was refused.
    #[error(transparent)]
    Config(#[from] ConfigError),
    /// The engine (or its store) could not open.
    #[error("cannot open the engine: {0}")]
    Engine(#[from] TallyError),
}

/// A one-node Tally: the embedded engine plus this node's identity. Cheap to clone.
#[derive(Clone)]
pub struct SingleNode {
    tally: Tally,
    /// This node's entry in `cluster.nodes`, for the cluster view and metrics labels.
    node: Arc<NodeEntry>,
    /// Cleared when shutdown begins, so `/healthz` turns 503 while requests drain.
    serving: Arc<AtomicBool>,
    /// The record of reconciliations, persisted in the data directory.
    book: Arc<RunBook>,
    /// The schedules of the configured sources of truth.
    scheduler: Arc<Scheduler>,
}

impl SingleNode {
    /// Opens the engine over the sled store in the configured data directory.
    pub async fn open(config: &Config) -> Result<Self, StartError> {
        let node = config.this_node()?.clone();
        let store = SledStore::open(&config.sled_config()).map_err(TallyError::from)?;
        let tally = Tally::open_with(Arc::new(store), Arc::new(SystemClock), config.tally_config()).await?;
        let book = Arc::new(RunBook::open(&config.node.data_dir));
        let ctx = RunContext { tally: tally.clone(), node: node.id.clone(), book: book.clone() };
        // One node is the only owner of its schedules.
        let scheduler = Scheduler::start(&config.reconcile, ctx, Arc::new(|| true));
        Ok(Self {
            tally,
            node: Arc::new(node),
            serving: Arc::new(AtomicBool::new(true)),
            book,
            scheduler: Arc::new(scheduler),
        })
    }

    /// Wraps an engine that is already open (tests use one over the in-memory
    /// store), with no sources of truth and an in-memory record of runs.
    pub fn new(tally: Tally, node: NodeEntry) -> Self {
        Self {
            tally,
            node: Arc::new(node),
            serving: Arc::new(AtomicBool::new(true)),
            book: Arc::new(RunBook::in_memory()),
            scheduler: Arc::new(Scheduler::none()),
        }
    }

    /// The engine.
    pub fn tally(&self) -> &Tally {
        &self.tally
    }

    /// Marks the node as draining: `/healthz` answers 503 from now on, while
    /// requests already accepted still complete.
    pub fn begin_shutdown(&self) {
        self.serving.store(false, Ordering::SeqCst);
    }

    /// Stops the engine: delivers and flushes every buffered increment, then stops
    /// the actors. Call it after the HTTP server has drained.
    pub async fn shutdown(&self) -> Result<(), TallyError> {
        self.begin_shutdown();
        self.scheduler.stop();
        self.tally.shutdown().await
    }
}

impl Service for SingleNode {
    async fn cluster(&self) -> ClusterView {
        ClusterView {
            nodes: vec![NodeView {
                id: self.node.id.clone(),
                state: NodeState::Up,
                http: self.node.http.to_string(),
                member: true,
            }],
            leader: Some(self.node.id.clone()),
            term: 0,
            placement_epoch: 0,
            handoff: Vec::new(),
            data_lost: Vec::new(),
            ranges: None,
        }
    }

    async fn accept_loss(&self, _id: &str) -> Result<ClusterView, ApiError> {
        Err(ApiError::new(
            StatusCode::CONFLICT,
            "not_a_cluster",
            "this node runs alone (a one-node config); there is no other node to accept a loss of",
        ))
    }

    async fn change_membership(&self, _id: &str, _add: bool) -> Result<ClusterView, ApiError> {
        Err(ApiError::new(
            StatusCode::CONFLICT,
            "not_a_cluster",
            "this node runs alone (a one-node config); membership changes need a cluster config",
        ))
    }

    fn engine(&self) -> &Tally {
        &self.tally
    }

    fn node_id(&self) -> &str {
        &self.node.id
    }

    fn runs(&self) -> &RunBook {
        &self.book
    }

    fn metrics_text(&self) -> String {
        let mut w = PromWriter::new();
        engine_metrics(&mut w, &self.tally, &self.node.id);
        reconcile_metrics(&mut w, &self.book);
        w.finish()
    }

    fn healthy(&self) -> bool {
        self.serving.load(Ordering::SeqCst)
    }
}
