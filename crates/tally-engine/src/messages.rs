//! The messages of the engine's actors that other parts of the engine send: the
//! shard's, the supervisor's and the aggregator's. They live apart from the actors,
//! so that what sends them (the engine's environment, `ctx.rs`) and what handles them
//! depend on this module, and not on each other.

use crate::error::TallyError;
use ractor::{ActorId, ActorRef, RpcReplyPort};
use std::sync::Arc;
use tally_core::meta::CounterMeta;
use tally_core::shard::{ShardReply, Submission};
use tally_core::ShardId;
use tally_store::ShardImage;

/// Messages a shard takes.
pub(crate) enum ShardMsg {
    /// Count something; the answer follows the commit (and the flush, for `sync`).
    Submit { sub: Submission, reply: RpcReplyPort<ShardReply> },
    /// Commit what is pending (sent to itself).
    Commit,
    /// Stop taking writes; answer with the final state.
    Seal { reply: RpcReplyPort<Result<ShardImage, TallyError>> },
    /// Merge encoded sketches into this shard's (a resharding carries the sealed
    /// generation's members and frequencies into the next one); answered once durable.
    MergeSketch {
        /// The distinct sketch, if the sealed generation has one.
        sketch: Option<Vec<u8>>,
        /// The frequency sketch, if the sealed generation has one.
        frequency: Option<Vec<u8>>,
        /// The window buckets, if the sealed generation keeps windows.
        windows: Option<Vec<u8>>,
        /// Answered once the merge is durable.
        reply: RpcReplyPort<Result<(), TallyError>>,
    },
    /// The counter's metadata changed.
    MetaChanged(Arc<CounterMeta>),
    /// Periodic housekeeping.
    Tick,
    /// A message from another shard of the same bounded counter.
    Escrow(tally_core::escrow::Message),
    /// The escrow's timers (sent to itself while its escrow is not settled).
    EscrowTick,
}

impl ractor::Message for ShardMsg {}

pub(crate) type SpawnReply = RpcReplyPort<Result<ActorRef<ShardMsg>, TallyError>>;

/// Messages the supervisor takes.
pub(crate) enum SupervisorMsg {
    /// Start the shard unless it runs; answer with its actor.
    Spawn { id: ShardId, meta: Arc<CounterMeta>, reply: SpawnReply },
    /// The shard has been idle: drain and stop it, if `actor` is still its actor.
    Retire { id: ShardId, actor: ActorId },
    /// Drain and stop the shard now; answer when it has stopped (deletion).
    Stop { id: ShardId, reply: RpcReplyPort<()> },
}

impl ractor::Message for SupervisorMsg {}

/// Messages the aggregator takes.
pub(crate) enum AggregatorMsg {
    /// Drain what is due.
    Tick,
    /// A slot filled up: drain early.
    FlushNow,
    /// Drain everything now and flush (shutdown); answers how many acknowledged
    /// increments it could not deliver within [`SHUTDOWN_DELIVER_MS`].
    FlushAll { reply: RpcReplyPort<u64> },
}

impl ractor::Message for AggregatorMsg {}
