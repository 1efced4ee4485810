//! The JSON shapes of the public interface, as the client reads and writes them.
//!
//! They mirror the server's types without depending on the engine, and they read
//! leniently: unknown fields are ignored and fields added later default, so an older
//! `tally` keeps working against a newer node. Totals are `i128` (the engine sums in
//! 128 bits) and are read exactly from the JSON text.

use serde::{Deserialize, Serialize};

/// `{"error": {"code": ..., "message": ...}}`: every error answer, and each failed
/// item of a batch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// The inside of an [`ErrorBody`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// Stable snake_case code.
    pub code: String,
    /// Human-readable explanation.
    #[serde(default)]
    pub message: String,
}

/// The body of `PUT /v1/counters/{name}`: the spec fields to set.
#[derive(Debug, Clone, Default, PartialEq, Serialize)]
pub struct SpecBody {
    /// Shard count, or `"auto"`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub shards: Option<Shards>,
    /// Fewest shards of an auto counter.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min_shards: Option<u64>,
    /// Most shards of an auto counter.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max_shards: Option<u64>,
    /// `sync` or `batched`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub durability: Option<String>,
    /// Aggregation window, in milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub flush_ms: Option<u64>,
    /// Rollup refresh interval, in milliseconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub rollup_ms: Option<u64>,
    /// `event`, `writer`, `round_robin` or `random`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub router: Option<String>,
    /// Keep a distinct-member sketch.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub distinct: Option<bool>,
    /// Dedup window, in seconds.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub dedup_window_s: Option<u64>,
    /// Keep per-item frequencies with this precision.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub frequency: Option<Frequency>,
    /// Sliding windows to keep (`["1m", "1h"]`).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub windows: Option<Vec<String>>,
    /// The lowest value the counter may take (on create).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub min: Option<i64>,
    /// The highest value the counter may take (on create).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub max: Option<i64>,
    /// At most `max` per one of the windows kept: a rate limit (on create).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub limit: Option<Limit>,
    /// Copies of each shard (on create).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub replicas: Option<u64>,
}

/// A window limit: at most `max` in any span of `window`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Limit {
    /// One of the counter's windows (`"1m"`).
    pub window: String,
    /// The most the window may hold.
    pub max: u64,
}

impl std::str::FromStr for Limit {
    type Err = String;
    /// `MAX/WINDOW`, as `100/1m`.
    fn from_str(s: &str) -> Result<Self, String> {
        let (max, window) =
            s.split_once('/').ok_or_else(|| format!("{s:?} is not MAX/WINDOW, such as 100/1m"))?;
        let max = max.trim().parse().map_err(|_| format!("{max:?} is not a whole number"))?;
        Ok(Limit { window: window.trim().to_owned(), max })
    }
}

/// `shards` of a spec: a count, or the word `auto` (the count follows contention).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
#[serde(untagged)]
pub enum Shards {
    /// A fixed count.
    Count(u64),
    /// `"auto"`.
    Auto(&'static str),
}

impl std::str::FromStr for Shards {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        if s.eq_ignore_ascii_case("auto") {
            return Ok(Self::Auto("auto"));
        }
        s.parse().map(Self::Count).map_err(|_| format!("expected a shard count or \"auto\", got {s:?}"))
    }
}

/// A counter's frequency option.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Frequency {
    /// Error bound, as a fraction of the total weight.
    pub epsilon: f64,
    /// Probability that an estimate exceeds its bound.
    pub delta: f64,
}

/// `GET /v1/counters/{name}/frequency`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct FrequencyRead {
    /// The item.
    pub item: String,
    /// Count-min estimate (never below the truth).
    pub estimate: u64,
    /// A weight the item certainly has.
    #[serde(default)]
    pub lower_bound: u64,
    /// `epsilon × total`.
    pub error_bound: u64,
    /// `1 − delta`.
    pub confidence: f64,
    /// Weight over all items.
    #[serde(default)]
    pub total: u64,
    /// Whether every shard's sketch was merged.
    #[serde(default = "yes")]
    pub complete: bool,
    /// Shards whose sketches are missing.
    #[serde(default)]
    pub missing_shards: Vec<u64>,
}

/// One item of `GET /v1/counters/{name}/top`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct TopEntry {
    /// The item.
    pub item: String,
    /// Count-min estimate.
    pub estimate: u64,
    /// A weight it certainly has.
    #[serde(default)]
    pub lower_bound: u64,
}

/// `GET /v1/counters/{name}/top`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct TopRead {
    /// The heaviest items, heaviest first.
    pub items: Vec<TopEntry>,
    /// `epsilon × total`.
    pub error_bound: u64,
    /// `1 − delta`.
    pub confidence: f64,
    /// Weight over all items.
    #[serde(default)]
    pub total: u64,
    /// Whether every shard's sketch was merged.
    #[serde(default = "yes")]
    pub complete: bool,
    /// Shards whose sketches are missing.
    #[serde(default)]
    pub missing_shards: Vec<u64>,
}

/// A counter's contract.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct Spec {
    /// Number of shards.
    pub shards: u64,
    /// `sync` or `batched`.
    pub durability: String,
    /// Aggregation window, in milliseconds.
    pub flush_ms: u64,
    /// Rollup refresh interval, in milliseconds; 0 = none.
    pub rollup_ms: u64,
    /// Routing policy.
    pub router: String,
    /// Whether distinct members are counted.
    pub distinct: bool,
    /// Dedup window, in seconds.
    pub dedup_window_s: u64,
    /// The frequency option, if any.
    #[serde(default)]
    pub frequency: Option<Frequency>,
    /// The sliding windows kept.
    #[serde(default)]
    pub windows: Vec<String>,
    /// The lower bound, if any.
    #[serde(default)]
    pub min: Option<i64>,
    /// The upper bound, if any.
    #[serde(default)]
    pub max: Option<i64>,
    /// The window limit, if any.
    #[serde(default)]
    pub limit: Option<Limit>,
    /// The counter's own replica count, if it states one.
    #[serde(default)]
    pub replicas: Option<u8>,
}

/// `GET /v1/counters/{name}` (and the answer of a create or update).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct CounterInfo {
    /// The counter's name.
    pub name: String,
    /// Its contract.
    pub spec: Spec,
    /// The current layout generation.
    #[serde(default)]
    pub generation: u64,
    /// Shards in the current layout (differs from `spec.shards` while resharding).
    #[serde(default)]
    pub layout_shards: u64,
    /// The target shard count of a resharding in progress.
    #[serde(default)]
    pub resharding: Option<u64>,
    /// Creation time, in milliseconds since the Unix epoch.
    #[serde(default)]
    pub created_at_ms: u64,
}

/// The body of `POST /v1/counters/{name}/increments`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct IncrementBody<'a> {
    /// The non-zero amount.
    pub delta: i64,
    /// Idempotency key.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub event_id: Option<&'a str>,
    /// Writer id.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub writer: Option<&'a str>,
    /// The writer's sequence number.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub seq: Option<u64>,
    /// Distinct member.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub member: Option<&'a str>,
    /// Frequency item.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub item: Option<&'a str>,
}

/// One item of `POST /v1/increments`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BatchItem<'a> {
    /// The counter.
    pub counter: &'a str,
    /// The increment.
    #[serde(flatten)]
    pub increment: IncrementBody<'a>,
}

/// The body of `POST /v1/increments`.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct BatchBody<'a> {
    /// The items, answered in order.
    pub increments: Vec<BatchItem<'a>>,
}

/// What became of one increment.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct IncrOutcome {
    /// Counted now.
    pub applied: bool,
    /// Its event id was counted before; not counted again.
    #[serde(default)]
    pub duplicate: bool,
}

/// One result of a batch.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
#[serde(untagged)]
pub enum ItemResult {
    /// Counted, or recognized as a duplicate.
    Ok(IncrOutcome),
    /// Refused; the other items are unaffected.
    Err(ErrorBody),
}

/// The answer of `POST /v1/increments`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct BatchResults {
    /// One result per item, in order.
    pub results: Vec<ItemResult>,
}

/// `GET /v1/counters/{name}/value`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ValueRead {
    /// The total.
    pub value: i128,
    /// `cached` or `fresh`.
    pub consistency: String,
    /// When the total was computed, in milliseconds since the Unix epoch.
    pub as_of_ms: u64,
    /// How old the total was when answered.
    pub staleness_ms: u64,
    /// Whether every shard answered.
    pub complete: bool,
    /// Shards whose values are missing from `value`.
    #[serde(default)]
    pub missing_shards: Vec<u64>,
}

/// `GET /v1/counters/{name}/value?window=W` (and `/distinct?window=W`).
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct WindowRead {
    /// The window, in its shortest form.
    pub window: String,
    /// Its length in milliseconds.
    pub window_ms: u64,
    /// The width of its buckets: the granularity of the answer.
    pub bucket_ms: u64,
    /// The start of the oldest bucket summed, in milliseconds since the Unix epoch.
    pub start_ms: u64,
    /// The end of the span: the reading node's clock.
    pub end_ms: u64,
    /// The sum of the deltas in the span (at most the limit, for the window it caps).
    pub value: i128,
    /// The most this window may hold, when the counter's limit caps it.
    #[serde(default)]
    pub limit: Option<u64>,
    /// What the limit leaves to spend in this span.
    #[serde(default)]
    pub remaining: Option<u64>,
    /// The estimated distinct members in the span, for a counter with `distinct`.
    #[serde(default)]
    pub estimate: Option<u64>,
    /// The sketch's standard relative error, for a counter with `distinct`.
    #[serde(default)]
    pub relative_error: Option<f64>,
    /// Bytes the window buckets of the shards that answered hold.
    pub window_bytes: u64,
    /// The most those buckets can hold.
    pub window_bytes_bound: u64,
    /// Whether every shard answered.
    pub complete: bool,
    /// Shards whose buckets are missing.
    #[serde(default)]
    pub missing_shards: Vec<u64>,
}

/// `GET /v1/counters/{name}/distinct`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct DistinctRead {
    /// Estimated number of distinct members.
    pub estimate: u64,
    /// The sketch's standard relative error.
    pub relative_error: f64,
    /// Stored bytes of the merged sketch (0 from a server that does not say).
    #[serde(default)]
    pub sketch_bytes: u64,
    /// Stored bytes of every shard's sketch, summed (0 from a server that does not say).
    #[serde(default)]
    pub counter_bytes: u64,
    /// Whether every shard's sketch was merged.
    #[serde(default = "yes")]
    pub complete: bool,
    /// Shards whose sketches are missing.
    #[serde(default)]
    pub missing_shards: Vec<u64>,
}

fn yes() -> bool {
    true
}

/// One shard of a [`ShardsReport`].
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ShardReport {
    /// Its index.
    pub index: u64,
    /// The node that owns it.
    pub node: String,
    /// Its partial sum.
    pub value: i128,
    /// Increments routed to it (as seen by the answering node).
    #[serde(default)]
    pub writes: u64,
    /// Its range's group, when shards are replicated.
    #[serde(default)]
    pub replication: Option<RangeReport>,
}

/// A range's replica group as the answering node knows it.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct RangeReport {
    /// The range's number.
    pub range: u64,
    /// Its leader's node, if known.
    pub leader: Option<String>,
    /// The raft term of that knowledge.
    pub term: Option<u64>,
    /// Its replicas.
    pub replicas: Vec<ReplicaReport>,
}

/// One replica of a range.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ReplicaReport {
    /// Its node.
    pub node: String,
    /// `voter`, `learner` or `directory`.
    pub role: String,
}

/// `GET /v1/counters/{name}/shards`.
#[derive(Debug, Clone, PartialEq, Deserialize)]
pub struct ShardsReport {
    /// The current layout generation.
    #[serde(default)]
    pub generation: u64,
    /// Sum of sealed generations, included in the total.
    #[serde(default)]
    pub base: i128,
    /// Every shard.
    pub shards: Vec<ShardReport>,
    /// Hottest shard's writes ÷ mean writes.
    pub skew: f64,
}

/// `POST /v1/counters/{name}/reconcile`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Deserialize)]
pub struct ReconcileReport {
    /// The sum of shards before correcting.
    pub before: i128,
    /// Authoritative minus before.
    pub drift: i128,
    /// Whether a correction was written.
    pub corrected: bool,
}

/// One node of a [`ClusterView`].
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct NodeView {
    /// The node's id.
    pub id: String,
    /// `up`, `suspect` or `down`.
    pub state: String,
    /// Its public HTTP address.
    pub http: String,
    /// Whether it holds shards.
    #[serde(default = "yes")]
    pub member: bool,
}

/// `GET /v1/cluster`.
#[derive(Debug, Clone, PartialEq, Eq, Deserialize)]
pub struct ClusterView {
    /// Every member.
    pub nodes: Vec<NodeView>,
    /// The metadata leader, if known.
    pub leader: Option<String>,
    /// The raft term.
    pub term: u64,
    /// Membership changes applied.
    #[serde(default)]
    pub placement_epoch: u64,
    /// Nodes still handing off shards after the last change.
    #[serde(default)]
    pub handoff: Vec<String>,
    /// Nodes whose replaced disk lost data that no operator has accepted yet.
    #[serde(default)]
    pub data_lost: Vec<String>,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn totals_beyond_64_bits_are_exact() {
        let text = r#"{"value": 170141183460469231731687303715884105727, "consistency": "fresh",
            "as_of_ms": 1, "staleness_ms": 0, "complete": true, "missing_shards": [], "later": 1}"#;
        let v: ValueRead = serde_json::from_str(text).expect("reads");
        assert_eq!(v.value, i128::MAX);
    }

    #[test]
    fn batch_items_and_results() {
        let body = BatchBody {
            increments: vec![BatchItem {
                counter: "c",
                increment: IncrementBody {
                    delta: 1,
                    event_id: Some("e"),
                    writer: None,
                    seq: None,
                    member: None,
                    item: None,
                },
            }],
        };
        assert_eq!(
            serde_json::to_string(&body).expect("encodes"),
            r#"{"increments":[{"counter":"c","delta":1,"event_id":"e"}]}"#
        );
        let r: BatchResults = serde_json::from_str(
            r#"{"results": [{"applied": true}, {"applied": false, "duplicate": true},
                {"error": {"code": "overflow", "message": "m"}}]}"#,
        )
        .expect("reads");
        assert_eq!(r.results[0], ItemResult::Ok(IncrOutcome { applied: true, duplicate: false }));
        assert_eq!(r.results[1], ItemResult::Ok(IncrOutcome { applied: false, duplicate: true }));
        assert!(matches!(&r.results[2], ItemResult::Err(e) if e.error.code == "overflow"));
    }
}
