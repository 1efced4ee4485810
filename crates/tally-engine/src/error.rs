//! Errors the engine answers with. Each maps to one HTTP status and one stable
//! snake_case code, so every front end reports them the same way.

use tally_core::limits::Overflow;
use tally_core::meta::MetaError;
use tally_core::name::{quoted, NameError};
use tally_core::spec::SpecError;
use tally_store::StoreError;

/// Why a listing request was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ListError {
    /// The page size was 0 or above `LIST_PAGE_COUNTERS_MAX`.
    #[error("limit must be between 1 and {max} (got {got})")]
    Limit {
        /// What was asked for.
        got: usize,
        /// `LIST_PAGE_COUNTERS_MAX`.
        max: usize,
    },
    /// The prefix was longer than a name may be (in bytes of the name itself).
    #[error("prefix must be at most {max} bytes, a counter name's limit")]
    Prefix {
        /// `tally_core::name::NAME_BYTES_MAX`.
        max: usize,
    },
    /// The cursor was not a counter name (cursors are the last name of a page).
    #[error("cursor must be a counter name, as returned in `next` by the previous page")]
    Cursor,
}

/// Why a request was refused or failed. The counter names and prefixes it holds are
/// escaped forms (`tally_core::name`); its messages quote them as the client gave
/// them ([`quoted`]).
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum TallyError {
    /// A name, event id, writer or member was malformed.
    #[error(transparent)]
    InvalidName(#[from] NameError),
    /// A spec field was out of range.
    #[error(transparent)]
    InvalidSpec(#[from] SpecError),
    /// The delta was zero.
    #[error("delta must be a non-zero integer")]
    ZeroDelta,
    /// The counter does not exist.
    #[error("counter {} does not exist", quoted(.0))]
    NotFound(String),
    /// The event id was applied before with another delta.
    #[error("event id {event_id:?} was applied with delta {recorded_delta}; it cannot be reused with delta {delta}")]
    EventIdConflict {
        /// The event id.
        event_id: String,
        /// The delta it was first applied with.
        recorded_delta: i64,
        /// The delta of this attempt.
        delta: i64,
    },
    /// Counting the increment would overflow its shard.
    #[error(transparent)]
    Overflow(#[from] Overflow),
    /// A metadata transition was refused (for example a resharding in progress).
    #[error(transparent)]
    Meta(#[from] MetaError),
    /// A shard could not be reached or did not answer in time. An increment with an
    /// event id may be retried with the same id.
    #[error("shard {shard} is unavailable: {reason}")]
    Unavailable {
        /// The shard.
        shard: String,
        /// Why.
        reason: String,
    },
    /// The store failed. After a failed flush the node refuses writes until restarted,
    /// because the operating system may have dropped unflushed pages.
    #[error("storage failure: {0}")]
    Store(#[from] StoreError),
    /// The engine is shutting down.
    #[error("the engine is shutting down")]
    ShuttingDown,
    /// A reconciliation would correct more than one request may: the drift between
    /// the authoritative total and the counter is beyond the bound, or beyond 128 bits.
    #[error("reconciling to {authoritative} would correct a drift of {drift} (the counter holds {before}); one reconciliation corrects at most ±{max}: reconcile in steps, or check the authoritative total")]
    DriftOutOfRange {
        /// The total asked for.
        authoritative: i128,
        /// The counter's total found by the read.
        before: i128,
        /// `authoritative - before`, saturated to the 128-bit range.
        drift: i128,
        /// The bound, [`crate::RECONCILE_DRIFT_ABS_MAX`].
        max: i128,
    },
    /// A batch held more items than allowed.
    #[error("batch holds {got} items; the limit is {max}")]
    BatchTooLarge {
        /// Items sent.
        got: usize,
        /// The limit.
        max: usize,
    },
    /// A listing of counters was asked with a bad limit, prefix or cursor.
    #[error(transparent)]
    InvalidListing(#[from] ListError),
    /// An increment with a frequency item had a negative delta: an item's weight only
    /// grows (count-min's bounds hold for additions only).
    #[error("counter {} keeps frequencies: an increment with an item (or member) must have a positive delta (got {delta})", quoted(.counter))]
    NegativeWeight {
        /// The counter.
        counter: String,
        /// The delta refused.
        delta: i64,
    },
    /// An increment of zero or less to a counter with a window limit: its buckets
    /// give back what they hold when they expire, which only additions keep exact.
    #[error("counter {} has a window limit: an increment must have a positive delta (got {delta})", quoted(.counter))]
    LimitNegative {
        /// The counter.
        counter: String,
        /// The delta refused.
        delta: i64,
    },
    /// A frequency read of a counter without the `frequency` option.
    #[error("counter {} keeps no frequencies; create it with \"frequency\": {{\"epsilon\": ..., \"delta\": ...}}", quoted(.0))]
    FrequencyOff(String),
    /// A sequenced increment was malformed: a sequence without a writer, with an
    /// event id as well, or above `tally_core::dedup::SEQ_MAX`.
    #[error("{0}")]
    InvalidSequence(&'static str),
    /// A sequenced increment skipped ahead of its writer's next sequence: nothing was
    /// counted. Retry it once the earlier sequences are answered.
    #[error(
        "writer {writer:?} sent sequence {seq}; the next sequence this counter takes from it is {expected}"
    )]
    OutOfOrderSequence {
        /// The writer.
        writer: String,
        /// The sequence sent.
        seq: u64,
        /// The sequence the shard takes next.
        expected: u64,
    },
    /// The shard a new writer's sequenced increments route to keeps marks for
    /// `tally_core::dedup::WRITERS_PER_SHARD_MAX` writers already: nothing was counted.
    #[error("writer {writer:?} is new and its shard of counter {} keeps marks for {max} writers already; retry later (marks expire after the dedup window) or use event ids", quoted(.counter))]
    TooManyWriters {
        /// The counter.
        counter: String,
        /// The writer.
        writer: String,
        /// The bound.
        max: u64,
    },
    /// A quota of the node's config would be exceeded (`crate::quota`): nothing was
    /// created or counted. Retrying does not help until counters are deleted, ids
    /// expire, or the quota is raised.
    #[error("{what} ({quota})")]
    QuotaExceeded {
        /// The config field of the quota.
        quota: &'static str,
        /// What would exceed it.
        what: String,
    },
    /// The increment would take a bounded counter past its bound, as far as the shard
    /// it reached could tell within its wait for headroom: nothing was counted.
    #[error(
        "counter {} refused {delta}: it would cross the counter's {bound} ({limit}); \
         the shard it reached held {headroom} of headroom on that side",
        quoted(.counter)
    )]
    BoundExceeded {
        /// The counter.
        counter: String,
        /// The increment's delta.
        delta: i64,
        /// `"min"`, `"max"`, or `"limit per <window>"`.
        bound: String,
        /// The bound's value.
        limit: i64,
        /// The headroom the shard held when it gave up.
        headroom: u64,
    },
    /// A top-k read asked for no items or more than the summary keeps.
    #[error("k must be between 1 and {max} (got {got})")]
    TopK {
        /// What was asked for.
        got: u64,
        /// `tally_core::frequency::TOP_K_MAX`.
        max: u32,
    },
    /// `shards: "auto"` on a node whose catalog does not keep auto bounds (a
    /// cluster's replicated catalog does not yet).
    #[error("shards: \"auto\" is not available on this node's catalog (a cluster does not replicate auto bounds yet); give a number")]
    AutoShardsUnsupported,
    /// A node follows at most `AUTO_COUNTERS_MAX` auto counters.
    #[error("this node already follows {max} counters with shards: \"auto\"; give a number")]
    AutoCountersFull {
        /// `AUTO_COUNTERS_MAX`.
        max: usize,
    },
    /// An auto resharding was proposed from a look at the counter that is no longer
    /// current (it changed, or stopped being auto, meanwhile); the next sample decides
    /// again.
    #[error("counter {} changed since version {version} (now {found:?}) or is no longer auto", quoted(.counter))]
    AutoProposalStale {
        /// The counter.
        counter: String,
        /// The version the proposal was made from.
        version: u64,
        /// The version found (`None`: the counter is gone).
        found: Option<u64>,
    },
    /// A window read named a window the counter does not keep (or no duration).
    #[error(transparent)]
    Window(#[from] tally_core::window::WindowError),
    /// A namespace was refused: its prefix, its spec, or one too many.
    #[error("{0}")]
    Namespace(String),
    /// A distinct-count read or merge named a counter without `distinct`.
    #[error("counter {} does not keep distinct members (create it with \"distinct\": true)", quoted(.0))]
    NotDistinct(String),
    /// No namespace has this prefix.
    #[error("no namespace has the prefix {}", quoted(.0))]
    NamespaceNotFound(String),
    /// Bounds named with an increment were refused ([`crate::Tally::incr_within`]).
    #[error(transparent)]
    Within(#[from] tally_core::within::WithinError),
}

impl From<tally_core::namespace::NamespaceError> for TallyError {
    fn from(e: tally_core::namespace::NamespaceError) -> Self {
        match e {
            tally_core::namespace::NamespaceError::Spec(s) => TallyError::InvalidSpec(s),
            other => TallyError::Namespace(other.to_string()),
        }
    }
}

impl TallyError {
    /// A shard of `counter` (with `spec`) refused `delta` holding `headroom`.
    pub(crate) fn bound_exceeded(
        counter: &impl ToString,
        spec: &tally_core::spec::CounterSpec,
        delta: i64,
        headroom: u64,
    ) -> Self {
        let (bound, limit) = match (spec.limit, delta < 0) {
            (Some(l), _) => (format!("limit per {}", l.window), l.max as i64),
            (None, true) => ("min".to_owned(), spec.min.unwrap_or(i64::MIN)),
            (None, false) => ("max".to_owned(), spec.max.unwrap_or(i64::MAX)),
        };
        Self::BoundExceeded { counter: counter.to_string(), delta, bound, limit, headroom }
    }

    /// The stable machine-readable code of this error.
    pub fn code(&self) -> &'static str {
        match self {
            Self::InvalidName(_) => "invalid_name",
            Self::InvalidSpec(_) => "invalid_spec",
            Self::ZeroDelta => "invalid_delta",
            Self::NotFound(_) => "counter_not_found",
            Self::EventIdConflict { .. } => "event_id_conflict",
            Self::Overflow(_) => "overflow",
            Self::Meta(MetaError::Spec(_)) => "invalid_spec",
            // An expired counter does not exist (the engine reaps it before it
            // creates it anew; this answers only a race it lost).
            Self::Meta(MetaError::Expired { .. }) => "counter_not_found",
            Self::Meta(_) => "resharding_in_progress",
            Self::Unavailable { .. } => "shard_unavailable",
            Self::Store(StoreError::Unavailable { .. }) => "shard_unavailable",
            Self::Store(_) => "storage_failure",
            Self::ShuttingDown => "shutting_down",
            Self::BatchTooLarge { .. } => "batch_too_large",
            Self::DriftOutOfRange { .. } => "drift_out_of_range",
            Self::InvalidListing(_) => "invalid_listing",
            Self::NegativeWeight { .. } => "negative_frequency_weight",
            Self::LimitNegative { .. } => "invalid_delta",
            Self::FrequencyOff(_) => "frequency_off",
            Self::TopK { .. } => "invalid_k",
            Self::AutoShardsUnsupported => "auto_shards_unsupported",
            Self::AutoCountersFull { .. } => "auto_counters_full",
            Self::AutoProposalStale { .. } => "auto_proposal_stale",
            Self::InvalidSequence(_) => "invalid_sequence",
            Self::OutOfOrderSequence { .. } => "out_of_order_sequence",
            Self::TooManyWriters { .. } => "too_many_writers",
            Self::QuotaExceeded { .. } => "quota_exceeded",
            Self::BoundExceeded { .. } => "bound_exceeded",
            Self::Window(e) => e.code(),
            Self::Namespace(_) => "invalid_namespace",
            Self::NamespaceNotFound(_) => "namespace_not_found",
            Self::NotDistinct(_) => "not_distinct",
            Self::Within(_) => "invalid_bounds",
        }
    }

    /// The HTTP status that fits this error.
    pub fn http_status(&self) -> u16 {
        match self {
            Self::InvalidName(_) | Self::ZeroDelta | Self::InvalidListing(_) | Self::TopK { .. } => 400,
            Self::FrequencyOff(_) | Self::AutoProposalStale { .. } | Self::NotDistinct(_) => 409,
            Self::AutoShardsUnsupported | Self::AutoCountersFull { .. } => 422,
            Self::InvalidSequence(_) | Self::Window(_) => 400,
            Self::OutOfOrderSequence { .. } | Self::BoundExceeded { .. } => 409,
            Self::TooManyWriters { .. } => 429,
            Self::QuotaExceeded { .. } => 507,
            Self::NegativeWeight { .. } | Self::LimitNegative { .. } => 422,
            Self::NotFound(_) | Self::Meta(MetaError::Expired { .. }) | Self::NamespaceNotFound(_) => 404,
            Self::Namespace(_) => 422,
            Self::EventIdConflict { .. } | Self::Meta(MetaError::Resharding { .. }) => 409,
            Self::Meta(MetaError::TooManyGenerations { .. } | MetaError::StaleGeneration { .. }) => 409,
            Self::BatchTooLarge { .. } => 413,
            Self::InvalidSpec(_) | Self::Meta(MetaError::Spec(_)) | Self::Overflow(_) => 422,
            Self::DriftOutOfRange { .. } | Self::Within(_) => 422,
            Self::Unavailable { .. } | Self::Store(_) | Self::ShuttingDown => 503,
        }
    }

    /// Whether retrying the same request (with the same event id) may succeed.
    pub fn retryable(&self) -> bool {
        self.http_status() == 503
            || matches!(
                self,
                Self::Meta(MetaError::Resharding { .. })
                    | Self::OutOfOrderSequence { .. }
                    | Self::TooManyWriters { .. }
            )
    }
}

/// A shard that could not be reached or did not answer, and why.
pub(crate) fn unavailable(id: &tally_core::ShardId, reason: &str) -> TallyError {
    TallyError::Unavailable { shard: id.shown(), reason: reason.to_string() }
}
