//! [`Service`]: what the HTTP front end needs from a node.
//!
//! The router is generic over this trait so the same handlers serve a single node
//! over the embedded engine ([`crate::SingleNode`]) today and a cluster member that
//! forwards to remote shards tomorrow. An implementation answers in the engine's
//! types and errors; the router owns everything about HTTP and JSON.

use crate::http::error::ApiError;
use crate::sources::{RunBook, RunRecord};
use serde::{Deserialize, Serialize};
use std::future::Future;
use tally_engine::{
    AutoPatch, Consistency, CounterInfo, DistinctRead, FrequencyRead, IncrOutcome, Increment, PutOutcome,
    ReconcileReport, ShardsReport, SpecPatch, Tally, TallyError, TopRead, ValueRead,
};

pub use tally_engine::IncrTotal;

/// The operations behind the public HTTP and RESP interfaces. Cheap to clone: the
/// router clones it into every request.
///
/// The data operations are the engine's ([`Service::engine`]) on one node and in a
/// cluster alike, so they are written once here; an implementation states what
/// differs between the two (the cluster's view, membership, accepted losses, the
/// shards report's replicas, health and metrics), and a test's may wrap any of them.
pub trait Service: Clone + Send + Sync + 'static {
    /// Creates the counter (defaults plus `patch`) or updates the fields `patch` names;
    /// `auto` makes its shard count follow contention, or changes its bounds.
    fn put_counter(
        &self,
        name: &str,
        patch: SpecPatch,
        auto: AutoPatch,
    ) -> impl Future<Output = Result<PutOutcome, TallyError>> + Send {
        async move { self.engine().put_counter_auto(name, patch, auto).await }
    }

    /// The counter's spec and a summary of its layout.
    fn counter(&self, name: &str) -> impl Future<Output = Result<CounterInfo, TallyError>> + Send {
        async move { self.engine().counter(name).await }
    }

    /// Deletes the counter and all its data.
    fn delete_counter(&self, name: &str) -> impl Future<Output = Result<(), TallyError>> + Send {
        async move { self.engine().delete_counter(name).await }
    }

    /// Counts one increment; an unknown counter is created with the defaults.
    fn incr(
        &self,
        name: &str,
        inc: Increment,
    ) -> impl Future<Output = Result<IncrOutcome, TallyError>> + Send {
        async move { self.engine().incr(name, inc).await }
    }

    /// Counts one increment and reports the counter's total right after it (Redis's
    /// `INCR`): it includes this increment and every increment this node
    /// acknowledged before it, each once; on a `sync` counter of one shard it is the
    /// value the shard's commit gave this increment (`docs/SEMANTICS.md`, "What INCR
    /// returns", and [`Tally::incr_value`]).
    fn incr_total(
        &self,
        name: &str,
        inc: Increment,
    ) -> impl Future<Output = Result<(IncrOutcome, IncrTotal), TallyError>> + Send {
        async move { self.engine().incr_value(name, inc).await }
    }

    /// The counter's total as Redis's `GET` answers it: every increment this node
    /// acknowledged before the call included ([`Tally::current_total`]).
    fn current_total(&self, name: &str) -> impl Future<Output = Result<IncrTotal, TallyError>> + Send {
        async move { self.engine().current_total(name).await }
    }

    /// Sets the counter's deadline (Redis's `EXPIRE` family, [`Tally::expire`]):
    /// true if set. A missing counter is [`TallyError::NotFound`].
    fn expire(
        &self,
        name: &str,
        at_ms: u64,
        when: tally_core::expiry::Condition,
    ) -> impl Future<Output = Result<bool, TallyError>> + Send {
        async move { self.engine().expire(name, at_ms, when).await }
    }

    /// Adds `delta` if the counter's total stays within `within` (Redis's `INCREX`,
    /// [`Tally::incr_within`]).
    fn incr_within(
        &self,
        name: &str,
        delta: i64,
        within: tally_core::within::Within,
    ) -> impl Future<Output = Result<tally_engine::WithinOutcome, TallyError>> + Send {
        async move { self.engine().incr_within(name, delta, within).await }
    }

    /// Removes the counter's deadline (`PERSIST`): true if it had one.
    fn persist(&self, name: &str) -> impl Future<Output = Result<bool, TallyError>> + Send {
        async move { self.engine().persist(name).await }
    }

    /// The counter's deadline, if any, and the time it was read at (`TTL`).
    fn expiry(&self, name: &str) -> impl Future<Output = Result<(Option<u64>, u64), TallyError>> + Send {
        async move { self.engine().expiry(name).await }
    }

    /// Sets the counter's total (`SET`, [`Tally::set_total`]), creating it first as
    /// an increment would.
    fn set_total(
        &self,
        name: &str,
        value: i128,
    ) -> impl Future<Output = Result<ReconcileReport, TallyError>> + Send {
        async move { self.engine().set_total(name, value).await }
    }

    /// Declares (or replaces) a namespace ([`Tally::put_namespace`]): true if created.
    fn put_namespace(
        &self,
        prefix: &str,
        spec: tally_core::namespace::NamespaceSpec,
    ) -> impl Future<Output = Result<bool, TallyError>> + Send {
        async move { self.engine().put_namespace(prefix, spec).await }
    }

    /// Drops a namespace.
    fn delete_namespace(&self, prefix: &str) -> impl Future<Output = Result<(), TallyError>> + Send {
        async move { self.engine().delete_namespace(prefix).await }
    }

    /// Counts many independent increments: one result per item, in order. The outer
    /// error refuses the whole batch (for example one that is too large).
    fn incr_many(
        &self,
        items: Vec<(String, Increment)>,
    ) -> impl Future<Output = Result<Vec<Result<IncrOutcome, TallyError>>, TallyError>> + Send {
        async move { self.engine().incr_many(items).await }
    }

    /// The counter's total at the requested consistency.
    fn read(
        &self,
        name: &str,
        consistency: Consistency,
    ) -> impl Future<Output = Result<ValueRead, TallyError>> + Send {
        async move { self.engine().read(name, consistency).await }
    }

    /// The distinct-member estimate of a counter with `distinct`.
    fn distinct(&self, name: &str) -> impl Future<Output = Result<DistinctRead, TallyError>> + Send {
        async move { self.engine().distinct(name).await }
    }

    /// One of a counter's sliding windows (its total, and its distinct estimate with
    /// `distinct`), merged over every shard.
    fn window(
        &self,
        name: &str,
        window: &str,
    ) -> impl Future<Output = Result<tally_engine::WindowRead, TallyError>> + Send {
        async move { self.engine().window(name, window).await }
    }

    /// An item's estimated frequency, for a counter with `frequency`.
    fn frequency(
        &self,
        name: &str,
        item: &str,
    ) -> impl Future<Output = Result<FrequencyRead, TallyError>> + Send {
        async move { self.engine().frequency(name, item).await }
    }

    /// The `k` heaviest items of a counter with `frequency`.
    fn top(&self, name: &str, k: u32) -> impl Future<Output = Result<TopRead, TallyError>> + Send {
        async move { self.engine().top(name, k).await }
    }

    /// Per-shard values, owners and write skew. A cluster adds what its directory
    /// knows of each shard's replicas.
    fn shards(&self, name: &str) -> impl Future<Output = Result<ShardsReport, TallyError>> + Send {
        async move { self.engine().shards(name).await }
    }

    /// Brings the counter to `authoritative` with an idempotent correction.
    fn reconcile(
        &self,
        name: &str,
        authoritative: i128,
    ) -> impl Future<Output = Result<ReconcileReport, TallyError>> + Send {
        async move { self.engine().reconcile(name, authoritative).await }
    }

    /// The cluster as this node sees it.
    fn cluster(&self) -> impl Future<Output = ClusterView> + Send;

    /// Adds node `id` to the placement ring (`add`) or removes it; shards move to
    /// their new owners in the background. Answers the cluster view after the change.
    fn change_membership(
        &self,
        id: &str,
        add: bool,
    ) -> impl Future<Output = Result<ClusterView, ApiError>> + Send;

    /// Accepts that node `id` lost the data of its previous disk, so reads count its
    /// shards again. Answers the cluster view after the change.
    fn accept_loss(&self, id: &str) -> impl Future<Output = Result<ClusterView, ApiError>> + Send;

    /// The node's engine, for the operators' views (`GET /v1/counters`,
    /// `GET /v1/stats`) that read its catalog and signals directly.
    fn engine(&self) -> &Tally;

    /// This node's id, so an operators' view can say whose figures it shows.
    fn node_id(&self) -> &str;

    /// The record of the reconciliations this node ran (scheduled and requested),
    /// for `GET /v1/counters/{name}/reconciliations` and the drift metrics.
    fn runs(&self) -> &RunBook;

    /// This node's operational signals in the Prometheus text exposition format
    /// (HELP and TYPE lines included; the router appends its own HTTP signals).
    fn metrics_text(&self) -> String;

    /// Whether the node serves requests; `GET /healthz` answers 503 when it does not
    /// (for example while it drains for shutdown), so load balancers move away.
    fn healthy(&self) -> bool {
        true
    }

    /// Whether the node is ready to serve (a cluster node: its metadata is caught up
    /// and its sessions to reachable peers are up); `GET /healthz` answers 503
    /// `not_ready` until it is.
    fn ready(&self) -> bool {
        true
    }
}

/// How one node looks from the node answering.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NodeState {
    /// Answering heartbeats.
    Up,
    /// Missed some heartbeats; calls to it may time out.
    Suspect,
    /// Missed `heartbeat_misses_max` heartbeats, or never connected.
    Down,
}

/// One node in a [`ClusterView`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NodeView {
    /// The node's stable id.
    pub id: String,
    /// Its health as seen from here.
    pub state: NodeState,
    /// Its public HTTP address, so clients can find the other nodes.
    pub http: String,
    /// Whether the node is a placement member (holds shards).
    pub member: bool,
}

/// The answer of `GET /v1/cluster`: membership, health and the metadata leader.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ClusterView {
    /// Every member, in configuration order.
    pub nodes: Vec<NodeView>,
    /// The metadata (raft) leader, if one is known.
    pub leader: Option<String>,
    /// The raft term of that knowledge.
    pub term: u64,
    /// Bumped by every membership change.
    pub placement_epoch: u64,
    /// Nodes still handing off shards after the last membership change; empty once
    /// it has settled.
    pub handoff: Vec<String>,
    /// Nodes whose disk was replaced and whose earlier data is lost, until an
    /// operator accepts the loss (`POST /v1/cluster/nodes/{id}/accept-loss`); reads
    /// of their shards report them missing meanwhile.
    #[serde(default)]
    pub data_lost: Vec<String>,
    /// Every range's replica group as this node knows it, when shards are
    /// replicated (`cluster.replicas` > 1); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub ranges: Option<Vec<tally_engine::RangeReport>>,
}

/// Reconciles `name` to `authoritative` and records the run (source `request`)
/// beside the scheduled ones, as every front end's reconcile request does. A
/// refused name or an unknown counter is not a run and is not recorded.
pub async fn reconcile_recorded<S: Service>(
    svc: &S,
    name: &str,
    authoritative: i128,
) -> Result<ReconcileReport, TallyError> {
    let at_ms = crate::sources::now_ms();
    let result = svc.reconcile(name, authoritative).await;
    if matches!(&result, Ok(_) | Err(TallyError::Unavailable { .. } | TallyError::DriftOutOfRange { .. })) {
        let runs = svc.runs();
        runs.record(name, RunRecord::from_engine(at_ms, "request", svc.node_id(), authoritative, &result));
        runs.persist();
    }
    result
}
