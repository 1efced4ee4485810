//! Where shards live, and how an engine reaches shards on other nodes.
//!
//! An embedded engine owns every shard. In a cluster each shard has one owner, the
//! node the consistent-hash ring assigns it to; the cluster layer implements
//! [`Placement`] and carries [`ShardRequest`]s to the owner, whose engine answers them
//! with [`crate::Tally::serve_shard_request`]. Everything above this seam — routing,
//! aggregation, dedup, resharding, reads — is the same code on one node or many.

use crate::error::TallyError;
use futures::future::BoxFuture;
use serde::{Deserialize, Serialize};
use tally_core::dedup::DedupRecord;
use tally_core::shard::ShardReply;
use tally_core::shard::Submission;
use tally_core::{CounterName, NodeId, ShardId};
use tally_store::ShardImage;

/// A request to the engine that owns a shard.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum ShardRequest {
    /// Count a submission. `meta_version` is the sender's metadata version: the owner
    /// waits until its own copy is at least as new before deciding. The owner counts
    /// it only if the latest metadata gives the shard to the incarnation `born_ms`
    /// (see [`ShardRequest::Read`]).
    Submit {
        /// The shard.
        id: ShardId,
        /// The sender's metadata version.
        meta_version: u64,
        /// The incarnation (`created_at_ms`) of the counter the sender counts in.
        born_ms: u64,
        /// What to count.
        sub: Submission,
    },
    /// The shard's committed state, and whether it is sealed. The owner answers only
    /// if the latest metadata gives the shard to the incarnation `born_ms` of its
    /// counter: a sender whose metadata lags a deletion, a re-creation or the
    /// pruning of a sealed generation would otherwise sum an emptied shard, or one
    /// of another layout, as a complete total.
    Read {
        /// The shard.
        id: ShardId,
        /// The incarnation (`created_at_ms`) of the counter the sender reads.
        born_ms: u64,
    },
    /// Seal the shard for a resharding; answers with its final state.
    Seal {
        /// The shard.
        id: ShardId,
        /// The sender's metadata version.
        meta_version: u64,
    },
    /// The dedup record of an event id in a (sealed) shard.
    DedupGet {
        /// The shard.
        id: ShardId,
        /// The event id.
        event_id: String,
    },
    /// Stop the shard and delete its data: its counter was deleted (a tombstone's
    /// cleanup), or its sealed generation expired (`prune_of`). The owner deletes
    /// nothing that its own view of the metadata gives to a live counter: the
    /// sender's view may lag (a tombstone cleared meanwhile, and a namesake created
    /// since), and only the owner's is sure to know every counter whose data it
    /// holds.
    Delete {
        /// The shard.
        id: ShardId,
        /// For a prune, the incarnation (`created_at_ms`) of the counter whose
        /// sealed generation it is; `None` for a deleted counter's cleanup.
        prune_of: Option<u64>,
    },
    /// Merge a sketch into a shard of a generation that is not open yet.
    MergeSketch {
        /// The shard.
        id: ShardId,
        /// The encoded distinct sketch.
        sketch: Option<Vec<u8>>,
        /// The encoded frequency sketch.
        frequency: Option<Vec<u8>>,
        /// The encoded window buckets.
        windows: Option<Vec<u8>>,
    },
    /// From the shard's new owner after a membership change: stop serving the shard
    /// and answer its state with a page of dedup records (those after `after`).
    HandOff {
        /// The shard.
        id: ShardId,
        /// The placement epoch of the change.
        epoch: u64,
        /// The last event id of the previous page.
        after: Option<String>,
    },
    /// From the shard's previous owner: take the shard over now.
    Adopt {
        /// The shard.
        id: ShardId,
        /// The placement epoch of the change.
        epoch: u64,
    },
    /// An escrow message from another shard of the same bounded counter and
    /// generation (`tally_core::escrow`); answered once handed to the shard, not
    /// once it acted on it.
    Escrow {
        /// The recipient shard.
        id: ShardId,
        /// The sender's metadata version.
        meta_version: u64,
        /// The message.
        message: tally_core::escrow::Message,
    },
    /// Run a reconciliation of the shard's counter against `authoritative`, on the
    /// node that owns the counter's first shard: every node sends its runs there,
    /// where they go one at a time, so a run reads the total after the one before
    /// it corrected (two runs of one counter on two nodes would each correct from
    /// the same total).
    Reconcile {
        /// The first shard of the counter's current generation.
        id: ShardId,
        /// The sender's metadata version.
        meta_version: u64,
        /// The total asked for.
        authoritative: i128,
    },
    /// To a node, not a shard: what it has seen of an auto counter
    /// ([`tally_core::autoshard::PeerView`]), asked by a node about to lower the
    /// counter's shard count.
    AutoView {
        /// The counter.
        counter: CounterName,
    },
}

impl ShardRequest {
    /// The shard the request is about (`None`: it is for the node itself).
    pub fn shard(&self) -> Option<&ShardId> {
        let id = match self {
            ShardRequest::Submit { id, .. }
            | ShardRequest::Read { id, .. }
            | ShardRequest::Seal { id, .. }
            | ShardRequest::DedupGet { id, .. }
            | ShardRequest::Delete { id, .. }
            | ShardRequest::MergeSketch { id, .. }
            | ShardRequest::HandOff { id, .. }
            | ShardRequest::Adopt { id, .. }
            | ShardRequest::Escrow { id, .. }
            | ShardRequest::Reconcile { id, .. } => id,
            ShardRequest::AutoView { .. } => return None,
        };
        Some(id)
    }
}

/// The owner's answer.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub enum ShardResponse {
    /// The answer to a submission.
    Reply(ShardReply),
    /// A shard's state (the answer to a seal).
    Image(ShardImage),
    /// The answer to a read: the shard's committed state, and whether it is sealed.
    Read {
        /// The shard's state.
        image: ShardImage,
        /// Whether the shard is sealed.
        sealed: bool,
    },
    /// A dedup record, if any.
    Record(Option<DedupRecord>),
    /// Done.
    Done,
    /// A shard handed off: its state and a page of its dedup records.
    HandedOff {
        /// The shard's state.
        image: ShardImage,
        /// Dedup records, in event-id order.
        records: Vec<(String, DedupRecord)>,
        /// Whether more records follow (ask again after the last one).
        more: bool,
        /// Whether the shard is sealed: its new owner must keep it sealed.
        sealed: bool,
    },
    /// What the node has seen of an auto counter (`None`: it does not follow it).
    AutoView(Option<tally_core::autoshard::PeerView>),
    /// The report of a reconciliation run on the owner.
    Reconciled(crate::api::ReconcileReport),
    /// A reconciliation the owner refused: the drift from the total it read,
    /// `before`, is beyond what one correction may write.
    DriftOutOfRange {
        /// The total the owner read.
        before: i128,
    },
    /// The owner could not serve the request; retrying may succeed.
    Failed {
        /// The engine's error code.
        code: String,
        /// Its message.
        message: String,
        /// The node that owns the shard as the answering node knows it, when that
        /// is another node: where the request may go next.
        owner: Option<NodeId>,
    },
}

/// Where shards live and how to reach the remote ones.
pub trait Placement: Send + Sync + 'static {
    /// The node that owns `id`, or `None` when this node does.
    fn remote_owner(&self, id: &ShardId) -> Option<NodeId>;
    /// This node's name.
    fn local_node(&self) -> NodeId;
    /// While a membership change is being handed off: the node that owned `id`
    /// before it, if this node owns `id` now and did not then, with the placement
    /// epoch of the change. `None` when there is nothing to take over.
    fn previous_owner(&self, _id: &ShardId) -> Option<(NodeId, u64)> {
        None
    }
    /// The placement epoch this node has applied (0 for a fixed placement).
    fn epoch(&self) -> u64 {
        0
    }
    /// Confirms that this node may serve shard `id` from its own store now: called
    /// before a local shard's actor starts and before a local shard's state is read.
    /// A placement that replicates shards checks that this node leads the shard's
    /// group and has applied everything committed before the call; one where the
    /// owner is the only copy always may.
    fn confirm_local<'a>(&'a self, _id: &'a ShardId) -> BoxFuture<'a, Result<(), TallyError>> {
        Box::pin(async { Ok(()) })
    }
    /// Every other node that may route increments (for questions put to all of them).
    fn peers(&self) -> Vec<NodeId> {
        Vec::new()
    }
    /// Carries `request` to `node` and returns its answer (with a timeout).
    fn call<'a>(
        &'a self,
        node: &'a NodeId,
        request: ShardRequest,
    ) -> BoxFuture<'a, Result<ShardResponse, TallyError>>;
}

/// An answer to a request that failed on the node asked; `owner` names the node that
/// owns the shard when it is another.
pub(crate) fn failed(e: &TallyError, owner: Option<NodeId>) -> ShardResponse {
    ShardResponse::Failed { code: e.code().to_string(), message: e.to_string(), owner }
}

/// Turns an unexpected or failed answer into an error.
pub(crate) fn unexpected(node: &NodeId, id: &ShardId, r: ShardResponse) -> TallyError {
    let reason = match r {
        ShardResponse::Failed { code, message, .. } => format!("node {node} failed ({code}): {message}"),
        other => format!("node {node} answered {other:?}"),
    };
    TallyError::Unavailable { shard: id.shown(), reason }
}
