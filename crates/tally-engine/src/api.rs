//! The types callers exchange with the engine. They serialize to the JSON shapes of
//! the public HTTP interface, so every front end speaks the same language.

use serde::{Deserialize, Serialize};
use tally_core::spec::CounterSpec;

/// One increment.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Increment {
    /// The non-zero amount to add (negative to subtract).
    pub delta: i64,
    /// An idempotency key: a retry with the same id is never counted twice.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub event_id: Option<String>,
    /// The writer, for the `writer` routing policy, and the owner of `seq`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub writer: Option<String>,
    /// The writer's sequence number (needs `writer`, excludes `event_id`): the
    /// writer's increments to this counter are idempotent by sequence — the shard
    /// keeps one high-water mark per writer, answers a sequence at or below it as a
    /// duplicate and refuses one beyond the next as out of order.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    /// A member to count distinctly, for counters with `distinct`.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub member: Option<String>,
    /// The item whose frequency it adds to, for counters with `frequency` (without
    /// one, `member` is counted). Its delta is the weight, so it must be positive.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub item: Option<String>,
}

impl Increment {
    /// An increment of `delta` with nothing else.
    pub fn new(delta: i64) -> Self {
        Self { delta, ..Self::default() }
    }
    /// With an event id.
    pub fn event_id(mut self, id: impl Into<String>) -> Self {
        self.event_id = Some(id.into());
        self
    }
    /// With a writer id.
    pub fn writer(mut self, w: impl Into<String>) -> Self {
        self.writer = Some(w.into());
        self
    }
    /// With a writer and its sequence number.
    pub fn sequenced(mut self, writer: impl Into<String>, seq: u64) -> Self {
        self.writer = Some(writer.into());
        self.seq = Some(seq);
        self
    }
    /// The id its dedup record is kept under: its event id, or its writer's mark id
    /// when sequenced.
    pub fn record_id(&self) -> Option<String> {
        match (&self.seq, &self.writer) {
            (Some(_), Some(w)) => Some(tally_core::dedup::mark_id(w)),
            _ => self.event_id.clone(),
        }
    }
    /// With a distinct-count member.
    pub fn member(mut self, m: impl Into<String>) -> Self {
        self.member = Some(m.into());
        self
    }
    /// With a frequency item.
    pub fn item(mut self, i: impl Into<String>) -> Self {
        self.item = Some(i.into());
        self
    }
    /// What a frequency counter counts: the item, or the member without one.
    pub fn frequency_key(&self) -> Option<&str> {
        self.item.as_deref().or(self.member.as_deref())
    }
}

/// What became of an increment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IncrOutcome {
    /// Counted now.
    pub applied: bool,
    /// Its event id was counted before; not counted again.
    #[serde(default, skip_serializing_if = "std::ops::Not::not")]
    pub duplicate: bool,
}

impl IncrOutcome {
    /// Counted now.
    pub const APPLIED: Self = Self { applied: true, duplicate: false };
    /// Counted before.
    pub const DUPLICATE: Self = Self { applied: false, duplicate: true };
}

/// How fresh a read must be.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Consistency {
    /// The rollup's cached total: constant cost, at most `rollup_ms` plus one refresh old.
    Cached,
    /// The sum of every shard now, after this node's buffered increments reach them.
    Fresh,
}

/// A counter's total and how much to trust it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ValueRead {
    /// The total.
    pub value: i128,
    /// How it was produced (a cached read of a counter without rollup is fresh).
    pub consistency: Consistency,
    /// When the total was computed, in milliseconds since the Unix epoch.
    pub as_of_ms: u64,
    /// How old it was when answered.
    pub staleness_ms: u64,
    /// Whether every shard answered.
    pub complete: bool,
    /// Shards that did not answer (their values are missing from `value`).
    pub missing_shards: Vec<u16>,
}

/// What an increment that answers with its counter's new total (Redis's `INCR`)
/// reports, besides its outcome ([`crate::Tally::incr_value`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Total {
    /// The total right after the increment: it includes the increment and every
    /// increment this node acknowledged before it (`docs/SEMANTICS.md`, "What INCR
    /// returns").
    pub value: i128,
    /// Whether it is the counter's exact total at that point, increments every
    /// other node acknowledged included: always on a `sync` counter of one shard
    /// (the value the shard's commit gave this increment) and on a single node; in
    /// a cluster, other nodes' increments are included as of this node's last look
    /// at the shards (at most [`crate::LEDGER_REFRESH_MS`] old while the counter is
    /// incremented here).
    pub exact: bool,
}

/// What an increment that answers with its counter's new total reports, besides its
/// outcome.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum IncrTotal {
    /// The total.
    Total(Total),
    /// The increment was counted but the total cannot be given: these shards did
    /// not answer the read it needed (a partial sum is never reported).
    Incomplete(Vec<u16>),
}

impl IncrTotal {
    /// The total's value, if it could be given.
    pub fn value(&self) -> Option<i128> {
        match self {
            IncrTotal::Total(t) => Some(t.value),
            IncrTotal::Incomplete(_) => None,
        }
    }
}

impl From<&ValueRead> for IncrTotal {
    fn from(read: &ValueRead) -> Self {
        if read.complete {
            let exact = read.consistency == Consistency::Fresh;
            IncrTotal::Total(Total { value: read.value, exact })
        } else {
            IncrTotal::Incomplete(read.missing_shards.clone())
        }
    }
}

/// A sliding window's total (and, for a counter with `distinct`, its distinct
/// members), merged over every shard: the exact sum of the increments the shards
/// stamped in `[start_ms, end_ms]`, which is the nominal window `[end_ms - window,
/// end_ms]` less at most its oldest bucket (`docs/SEMANTICS.md`, "Windowed counters").
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct WindowRead {
    /// The window, in its shortest form (`"1h"`, `"1d"`).
    pub window: String,
    /// Its length in milliseconds.
    pub window_ms: u64,
    /// The width of its buckets: the granularity of the answer.
    pub bucket_ms: u64,
    /// The start of the oldest bucket summed, in milliseconds since the Unix epoch.
    pub start_ms: u64,
    /// The reading node's clock when the read was taken: the end of the window.
    pub end_ms: u64,
    /// The sum of the deltas in the span; for the window a `limit` caps, at most
    /// its `max` (shards read one after another may together show more, by headroom
    /// that expired at one and was spent at another while the read went round).
    pub value: i128,
    /// The most this window may hold, when the counter's `limit` caps it.
    pub limit: Option<u64>,
    /// What the limit leaves to spend in this span (`limit − value`), when it caps
    /// this window.
    pub remaining: Option<u64>,
    /// The estimated distinct members in the span, for a counter with `distinct`.
    pub estimate: Option<u64>,
    /// The sketch's standard relative error, for a counter with `distinct`.
    pub relative_error: Option<f64>,
    /// Bytes the window buckets of every shard that answered hold in memory (all of
    /// the counter's windows).
    pub window_bytes: u64,
    /// The most those buckets can hold: shards × windows × buckets per window.
    pub window_bytes_bound: u64,
    /// Whether every shard answered.
    pub complete: bool,
    /// Shards that did not answer (their buckets are missing).
    pub missing_shards: Vec<u16>,
}

/// A distinct-count estimate.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct DistinctRead {
    /// Estimated number of distinct members.
    pub estimate: u64,
    /// The sketch's standard relative error.
    pub relative_error: f64,
    /// Stored bytes of the merged sketch: what one sketch of these members costs
    /// (at most about 12 KiB, the packed registers).
    pub sketch_bytes: u64,
    /// Stored bytes of the sketches of every shard that answered, summed: what the
    /// counter's distinct count costs.
    pub counter_bytes: u64,
    /// Whether every shard's sketch was merged.
    pub complete: bool,
    /// Shards whose sketches are missing.
    pub missing_shards: Vec<u16>,
}

/// One item's estimated frequency (its summed weight), merged over every shard.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct FrequencyRead {
    /// The item asked about.
    pub item: String,
    /// Count-min estimate of the item's weight: never below the truth.
    pub estimate: u64,
    /// A weight the item certainly has (from the heavy-hitters summary; 0 for an item
    /// it does not keep).
    pub lower_bound: u64,
    /// `epsilon × total`: the estimate exceeds the truth by at most this, with
    /// probability `confidence`.
    pub error_bound: u64,
    /// `1 − delta`.
    pub confidence: f64,
    /// The counter's `epsilon`.
    pub epsilon: f64,
    /// Weight counted over all items in the merged shards.
    pub total: u64,
    /// Whether every shard's sketch was merged.
    pub complete: bool,
    /// Shards whose sketches are missing (their weights are missing from the estimate).
    pub missing_shards: Vec<u16>,
}

/// One heavy hitter in a top-k read.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TopEntry {
    /// The item.
    pub item: String,
    /// Count-min estimate of its weight: never below the truth, above it by at most
    /// the read's `error_bound` with probability `confidence`.
    pub estimate: u64,
    /// A weight it certainly has; the truth is at most `lower_bound + undercount`.
    pub lower_bound: u64,
}

/// The heaviest items, merged over every shard.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TopRead {
    /// How many were asked for.
    pub k: u32,
    /// At most `k` items, heaviest first (by `lower_bound`, ties by item).
    pub items: Vec<TopEntry>,
    /// `epsilon × total`, the estimates' bound.
    pub error_bound: u64,
    /// `1 − delta`.
    pub confidence: f64,
    /// The most a listed item's weight exceeds its `lower_bound`, and the most weight
    /// an unlisted item can have (so an item heavier than this is always listed when
    /// `k` is large enough).
    pub undercount: u64,
    /// Weight counted over all items in the merged shards.
    pub total: u64,
    /// Whether every shard's sketch was merged.
    pub complete: bool,
    /// Shards whose sketches are missing.
    pub missing_shards: Vec<u16>,
}

/// One shard in a shard report.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardReport {
    /// Its index in the current generation.
    pub index: u16,
    /// The node that owns it.
    pub node: String,
    /// Its partial sum.
    pub value: i64,
    /// Increments routed to it on this node since the counter became active here.
    pub writes: u64,
    /// Its range's replicas, leader and term, when shards are replicated
    /// (`cluster.replicas` > 1); absent otherwise.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub replication: Option<RangeReport>,
}

/// The part a replica plays in its range's group.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ReplicaRole {
    /// Counts towards quorums.
    Voter,
    /// Receives the log but counts towards no quorum (a replica catching up).
    Learner,
    /// Named by the range directory; this node runs no replica of the range, so
    /// it does not know the group's membership.
    Directory,
}

/// One replica of a range, as the node asked knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReplicaReport {
    /// The node running it.
    pub node: String,
    /// Its raft id (its node's store incarnation), in decimal: a 64-bit id is
    /// beyond the integers a JSON double holds exactly. `None` where unknown.
    pub replica: Option<String>,
    /// Voter, learner, or only named by the directory.
    pub role: ReplicaRole,
    /// Whether it is its node's current store incarnation; `false` for the replica
    /// of a replaced disk still in the membership until it is removed; `None`
    /// where unknown.
    pub current: Option<bool>,
    /// On the range's leader only: the last log index the replica is known to hold.
    pub matched: Option<u64>,
}

/// A range's replica group as the node asked knows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RangeReport {
    /// The range's number in its layout.
    pub range: u32,
    /// The replica count of the counters whose shards the range holds, when they
    /// state their own; `None` for the range of counters that take the cluster's.
    pub counter_replicas: Option<u8>,
    /// Whether the node asked runs a replica of the range. If not, `replicas` are
    /// the directory's, `leader` is the replica that served the range last for
    /// this node (or `None`), and `term` is `None`.
    pub replicated_here: bool,
    /// The replicas: voters, then learners (or the directory's nodes).
    pub replicas: Vec<ReplicaReport>,
    /// The leader's node, if known.
    pub leader: Option<String>,
    /// The raft term of that knowledge.
    pub term: Option<u64>,
    /// Whether a joint membership change (a replica being replaced) is under way.
    pub joint: bool,
    /// The last index the node asked applied.
    pub applied: Option<u64>,
    /// On the leader only: its last log index (a replica whose `matched` equals it
    /// holds everything).
    pub leader_last_log: Option<u64>,
    /// Nodes the directory names for the range that hold no replica in the
    /// group's membership (excluded, or not added yet).
    pub excluded: Vec<String>,
    /// Why the node asked's replica stopped (a fatal storage error): it takes no
    /// part in the group until the node restarts. `None` while it runs.
    pub stopped: Option<String>,
}

/// Per-shard values and the write skew.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ShardsReport {
    /// The current generation.
    pub generation: u32,
    /// Sum of sealed generations (from reshardings), included in the total.
    pub base: i128,
    /// Every shard of the current generation.
    pub shards: Vec<ShardReport>,
    /// Hottest shard's writes ÷ mean writes (1.0 = perfectly even; 0 when idle).
    pub skew: f64,
    /// For a counter whose shard count follows contention: its bounds, its last
    /// change and why, and the latest contention figures.
    pub auto: Option<tally_core::autoshard::AutoStatus>,
}

/// The result of a reconciliation.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct ReconcileReport {
    /// The sum of shards before correcting.
    pub before: i128,
    /// Authoritative minus before.
    pub drift: i128,
    /// Whether a correction was written.
    pub corrected: bool,
}

/// A counter's spec and a summary of its state.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterInfo {
    /// Its name.
    pub name: String,
    /// Its contract.
    pub spec: CounterSpec,
    /// The current layout generation.
    pub generation: u32,
    /// Shards in the current generation (differs from `spec.shards` while resharding).
    pub layout_shards: u16,
    /// The target of a resharding in progress.
    pub resharding: Option<u16>,
    /// When it was created, in milliseconds since the Unix epoch.
    pub created_at_ms: u64,
    /// The bounds of a counter whose shard count follows contention (`shards:
    /// "auto"`); `None` for a fixed count.
    pub auto: Option<tally_core::spec::AutoShards>,
    /// When it expires, in milliseconds since the Unix epoch; `None` for never.
    #[serde(default)]
    pub expires_at_ms: Option<u64>,
}

/// Whether a create-or-update created the counter.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct PutOutcome {
    /// True if the counter did not exist before.
    pub created: bool,
    /// The counter after the change.
    pub counter: CounterInfo,
}
