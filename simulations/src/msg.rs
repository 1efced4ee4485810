//! Everything that travels between endpoints (clients, nodes, the control plane), and
//! how each message feeds the trace hash.

use std::hash::{Hash, Hasher};
use tally_core::handoff_machine::HandOffPage;
use tally_core::shard::{Outcome, Submission};
use tally_core::{CounterName, ShardId};
use tally_store::ShardImage;

/// Who sends and receives messages.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum Addr {
    /// A cluster node, by index.
    Node(u8),
    /// A workload client, by index.
    Client(u16),
    /// The control plane that drives reshardings and membership changes.
    Control,
}

/// A client-visible answer to one increment attempt.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Answer {
    /// Counted now.
    Applied,
    /// Counted before under this event id.
    Duplicate,
    /// The event id was counted with another delta; not counted.
    Conflict,
    /// Counting it would overflow a shard; not counted.
    Overflow,
    /// A sequenced increment refused before counting (out of order, or too many
    /// writers on its shard); not counted.
    Refused,
    /// The node could not get an answer (may or may not have been counted).
    Unavailable,
}

impl Answer {
    /// The client-visible answer to a shard's outcome.
    pub fn of(outcome: Outcome) -> Self {
        match outcome {
            Outcome::Applied => Answer::Applied,
            Outcome::Duplicate => Answer::Duplicate,
            Outcome::Conflict { .. } => Answer::Conflict,
            Outcome::Overflow(_) => Answer::Overflow,
            Outcome::OutOfOrder { .. }
            | Outcome::TooManyWriters
            | Outcome::TooManyEventIds
            | Outcome::BoundExceeded { .. } => Answer::Refused,
        }
    }
}

/// A shard owner's answer to a submission.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum ShardAnswer {
    /// Decided and committed (for `sync`, flushed).
    Done(Outcome),
    /// The shard's generation is sealed or being sealed: resend on the current layout.
    Sealed,
    /// The shard is moving to another node or is not owned here: resend later.
    Moved,
}

/// What a gateway does with a shard's answer: the state of the request travels with
/// the submission, so gateways keep no table of requests in flight.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum SubmitCtx {
    /// A client's increment.
    Client {
        /// The client.
        client: u16,
        /// Its operation number.
        op: u32,
        /// Which attempt of the operation.
        attempt: u32,
        /// Resends after sealed or moving shards so far.
        hops: u8,
    },
    /// A drained sum sent to a shard on another node, remembered under its drain id.
    RemoteDrain,
    /// A drained sum of this node's accumulator for a shard it owns: given back to the
    /// accumulator (key `index`) if refused.
    LocalDrain {
        /// The accumulator slot it came from.
        index: u16,
    },
    /// A reconciliation's correction.
    Reconcile {
        /// The client that asked.
        client: u16,
        /// Its operation number.
        op: u32,
        /// The total found before the correction.
        before: i128,
        /// The correction.
        drift: i128,
        /// The authoritative total.
        authoritative: i128,
        /// Resends so far.
        hops: u8,
    },
}

/// A read's answer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct ReadValue {
    /// The total.
    pub value: i128,
    /// When it was computed.
    pub as_of_ms: u64,
    /// Its age when answered.
    pub staleness_ms: u64,
    /// Whether every shard answered.
    pub complete: bool,
}

/// Which read.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Consistency {
    /// Sum of shards now.
    Fresh,
    /// The rollup's cached total.
    Cached,
}

/// One message.
#[derive(Debug, Clone)]
pub enum Msg {
    /// Client → gateway: count this.
    Incr {
        /// The client.
        client: u16,
        /// Its operation number.
        op: u32,
        /// Attempt number.
        attempt: u32,
        /// The counter.
        counter: CounterName,
        /// The delta.
        delta: i64,
        /// The event id, if any.
        event_id: Option<String>,
        /// The distinct-count member, if any.
        member: Option<String>,
    },
    /// Gateway → client.
    IncrReply {
        /// Operation number.
        op: u32,
        /// Attempt number.
        attempt: u32,
        /// The answer.
        answer: Answer,
    },
    /// Client → gateway: read a total.
    Read {
        /// The client.
        client: u16,
        /// Operation number.
        op: u32,
        /// The counter.
        counter: CounterName,
        /// Which read.
        consistency: Consistency,
    },
    /// Gateway → client.
    ReadReply {
        /// Operation number.
        op: u32,
        /// The total, unless the counter is unknown.
        read: Option<ReadValue>,
    },
    /// Client → gateway: estimate distinct members.
    Distinct {
        /// The client.
        client: u16,
        /// Operation number.
        op: u32,
        /// The counter.
        counter: CounterName,
    },
    /// Gateway → client: (estimate, complete).
    DistinctReply {
        /// Operation number.
        op: u32,
        /// The estimate and whether every shard answered.
        estimate: Option<(u64, bool)>,
    },
    /// Client → gateway: reconcile against an authoritative total.
    Reconcile {
        /// The client.
        client: u16,
        /// Operation number.
        op: u32,
        /// The counter.
        counter: CounterName,
        /// The authoritative total.
        authoritative: i128,
    },
    /// Gateway → client: (before, drift), or `None` if it could not reconcile.
    ReconcileReply {
        /// Operation number.
        op: u32,
        /// The total found and the drift corrected.
        result: Option<(i128, i128)>,
    },
    /// Gateway → shard owner.
    Submit {
        /// The shard.
        shard: ShardId,
        /// What to count.
        sub: Submission,
        /// What the gateway does with the answer.
        ctx: SubmitCtx,
    },
    /// Shard owner → gateway.
    SubmitReply {
        /// The shard.
        shard: ShardId,
        /// The submission answered.
        sub: Submission,
        /// Its context.
        ctx: SubmitCtx,
        /// The answer.
        answer: ShardAnswer,
    },
    /// Control → owner: seal this shard and report its final image (after a flush).
    Seal {
        /// The shard.
        shard: ShardId,
    },
    /// Owner → control.
    Sealed {
        /// The shard.
        shard: ShardId,
        /// Its final, durable image.
        image: ShardImage,
    },
    /// Control → owner of the next generation's first shard: merge the sealed sketches.
    MergeSketch {
        /// The shard.
        shard: ShardId,
        /// The merged distinct sketch of the sealed generation.
        sketch: Option<Vec<u8>>,
        /// The merged frequency sketch of the sealed generation.
        frequency: Option<Vec<u8>>,
        /// The merged window buckets of the sealed generation.
        windows: Option<Vec<u8>>,
    },
    /// Owner → control: merged and durable.
    Merged {
        /// The shard.
        shard: ShardId,
    },
    /// New owner → previous owner: a page of a shard it adopts (the engine's
    /// `ShardRequest::HandOff`).
    HandOff {
        /// The shard.
        shard: ShardId,
        /// The membership epoch of the change.
        epoch: u64,
        /// The last record key of the previous page.
        after: Option<String>,
    },
    /// Previous owner → new owner: the page.
    HandedOff {
        /// The shard.
        shard: ShardId,
        /// The membership epoch of the change.
        epoch: u64,
        /// The `after` of the pull it answers.
        after: Option<String>,
        /// The page.
        page: HandOffPage,
    },
    /// Previous owner → new owner: take this shard over now (`ShardRequest::Adopt`).
    Adopt {
        /// The shard.
        shard: ShardId,
        /// The membership epoch of the change.
        epoch: u64,
    },
    /// New owner → previous owner: adopted, durably.
    Adopted {
        /// The shard.
        shard: ShardId,
        /// The membership epoch of the change.
        epoch: u64,
    },
}

fn hash_sub<H: Hasher>(sub: &Submission, h: &mut H) {
    match sub {
        Submission::Buffered { sum, increments, members, drain_id } => {
            0u8.hash(h);
            (sum, increments, members, drain_id).hash(h);
        }
        Submission::Single { delta, event_id, member, item, seq } => {
            1u8.hash(h);
            (delta, event_id, member, item, seq).hash(h);
        }
    }
}

fn hash_image<H: Hasher>(image: &ShardImage, h: &mut H) {
    (image.value, &image.sketch).hash(h);
}

impl Hash for ShardAnswer {
    fn hash<H: Hasher>(&self, h: &mut H) {
        match self {
            ShardAnswer::Done(o) => {
                0u8.hash(h);
                Answer::of(*o).hash(h);
            }
            ShardAnswer::Sealed => 1u8.hash(h),
            ShardAnswer::Moved => 2u8.hash(h),
        }
    }
}

impl Hash for Msg {
    fn hash<H: Hasher>(&self, h: &mut H) {
        std::mem::discriminant(self).hash(h);
        match self {
            Msg::Incr { client, op, attempt, counter, delta, event_id, member } => {
                (client, op, attempt, counter, delta, event_id, member).hash(h)
            }
            Msg::IncrReply { op, attempt, answer } => (op, attempt, answer).hash(h),
            Msg::Read { client, op, counter, consistency } => (client, op, counter, consistency).hash(h),
            Msg::ReadReply { op, read } => (op, read).hash(h),
            Msg::Distinct { client, op, counter } => (client, op, counter).hash(h),
            Msg::DistinctReply { op, estimate } => (op, estimate).hash(h),
            Msg::Reconcile { client, op, counter, authoritative } => {
                (client, op, counter, authoritative).hash(h)
            }
            Msg::ReconcileReply { op, result } => (op, result).hash(h),
            Msg::Submit { shard, sub, ctx } => {
                (shard, ctx).hash(h);
                hash_sub(sub, h);
            }
            Msg::SubmitReply { shard, sub, ctx, answer } => {
                (shard, ctx, answer).hash(h);
                hash_sub(sub, h);
            }
            Msg::Seal { shard } | Msg::Merged { shard } => shard.hash(h),
            Msg::Adopt { shard, epoch } | Msg::Adopted { shard, epoch } => (shard, epoch).hash(h),
            Msg::HandOff { shard, epoch, after } => (shard, epoch, after).hash(h),
            Msg::Sealed { shard, image } => {
                shard.hash(h);
                hash_image(image, h);
            }
            Msg::MergeSketch { shard, sketch, frequency, windows } => {
                (shard, sketch, frequency, windows).hash(h)
            }
            Msg::HandedOff { shard, epoch, after, page } => {
                (shard, epoch, after, page.more, page.sealed).hash(h);
                hash_image(&page.image, h);
                for (id, r) in &page.records {
                    (id, r.delta, r.applied_at_ms).hash(h);
                }
            }
        }
    }
}
