//! The per-counter contract: how many shards, how durable, how reads are cached,
//! how increments are routed, whether distinct members are counted, and for how long
//! event ids are remembered.

use crate::frequency::{FrequencyError, FrequencySpec};
use crate::window::{Window, WindowError, WindowSet};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::str::FromStr;

/// Fewest shards a counter may have.
pub const SHARDS_MIN: u16 = 1;
/// Most shards a counter may have: the peak write parallelism worth absorbing.
pub const SHARDS_MAX: u16 = 1024;
/// Default shard count.
pub const SHARDS_DEFAULT: u16 = 8;
/// Shortest aggregation window of a `batched` counter, in milliseconds.
pub const FLUSH_MS_MIN: u32 = 1;
/// Longest aggregation window of a `batched` counter: the most a crash may lose.
pub const FLUSH_MS_MAX: u32 = 60_000;
/// Default aggregation window, in milliseconds.
pub const FLUSH_MS_DEFAULT: u32 = 200;
/// Longest rollup refresh interval, in milliseconds (0 turns the rollup off).
pub const ROLLUP_MS_MAX: u32 = 3_600_000;
/// Shortest non-zero rollup refresh interval, in milliseconds.
pub const ROLLUP_MS_MIN: u32 = 10;
/// Default rollup refresh interval, in milliseconds.
pub const ROLLUP_MS_DEFAULT: u32 = 1000;
/// Longest dedup window, in seconds (30 days).
pub const DEDUP_WINDOW_S_MAX: u32 = 30 * 86_400;
/// Default dedup window, in seconds (one day).
pub const DEDUP_WINDOW_S_DEFAULT: u32 = 86_400;

/// When an increment is acknowledged.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Durability {
    /// Only after the shard's write is durable on disk (group commit).
    Sync,
    /// When buffered; the buffer reaches disk within `flush_ms`.
    Batched,
}

/// How an increment without an event id picks its shard.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RouterPolicy {
    /// By hash of the event id (increments without one fall back to `writer`).
    Event,
    /// By hash of the writer id: a writer never contends with itself.
    Writer,
    /// Each increment to the next shard in turn.
    RoundRobin,
    /// A uniformly random shard.
    Random,
}

macro_rules! text_enum {
    ($ty:ty { $($variant:ident => $text:literal),+ $(,)? }) => {
        impl $ty {
            /// The wire name.
            pub fn as_str(self) -> &'static str {
                match self { $(Self::$variant => $text),+ }
            }
        }
        impl fmt::Display for $ty {
            fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
                f.write_str(self.as_str())
            }
        }
        impl FromStr for $ty {
            type Err = SpecError;
            fn from_str(s: &str) -> Result<Self, SpecError> {
                match s {
                    $($text => Ok(Self::$variant),)+
                    other => Err(SpecError::UnknownWord {
                        field: stringify!($ty),
                        found: other.chars().take(64).collect(),
                        expected: &[$($text),+],
                    }),
                }
            }
        }
    };
}

text_enum!(Durability { Sync => "sync", Batched => "batched" });
text_enum!(RouterPolicy {
    Event => "event",
    Writer => "writer",
    RoundRobin => "round_robin",
    Random => "random",
});

/// A counter's full contract. Every field has a default (see the constants above).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterSpec {
    /// N, the number of shards in the current layout.
    pub shards: u16,
    /// When increments are acknowledged.
    pub durability: Durability,
    /// Aggregation window of `batched` counters, in milliseconds.
    pub flush_ms: u32,
    /// Refresh interval of the cached total, in milliseconds; 0 = no rollup.
    pub rollup_ms: u32,
    /// Routing of increments without an event id.
    pub router: RouterPolicy,
    /// Whether to keep a HyperLogLog of `member` values.
    pub distinct: bool,
    /// How long applied event ids are remembered, in seconds.
    pub dedup_window_s: u32,
    /// Whether (and how precisely) to keep per-item frequencies of `item` (or
    /// `member`) values: a count-min sketch and heavy hitters per shard.
    pub frequency: Option<FrequencySpec>,
    /// Sliding windows whose totals (and, with `distinct`, members) each shard keeps
    /// in time buckets ([`crate::window`]); empty for none.
    pub windows: WindowSet,
    /// The lowest value the counter may take: an increment that would take it lower
    /// is refused ([`crate::escrow`]). Set when the counter is created, never changed.
    pub min: Option<i64>,
    /// The highest value the counter may take, likewise.
    pub max: Option<i64>,
    /// The most one of the counter's sliding windows may hold: a rate limit that
    /// holds across shards and nodes ([`crate::escrow`] spends it per window). Set
    /// when the counter is created, never changed.
    pub limit: Option<WindowLimit>,
    /// How many nodes hold a copy of each shard, `1..=`[`REPLICAS_MAX`](crate::ranges::REPLICAS_MAX): the shards
    /// live in the range groups of counters with the same count. `None` takes the
    /// cluster's `replicas`. On a node that does not replicate shards, only 1 (or
    /// none) is accepted. Set when the counter is created, never changed.
    pub replicas: Option<u8>,
}

/// A cap on one sliding window: at most `max` counted in any span the window
/// covers. Written `{"window": "1m", "max": 100}`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(try_from = "WindowLimitText", into = "WindowLimitText")]
pub struct WindowLimit {
    /// The window it caps; one the counter keeps.
    pub window: Window,
    /// The most the window may hold, `1 ..= LIMIT_MAX`.
    pub max: u64,
}

/// Largest `limit.max`: a window total must fit the signed values shards keep.
pub const LIMIT_MAX: u64 = i64::MAX as u64;

/// How a [`WindowLimit`] is written: the window as its duration text.
#[derive(Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
struct WindowLimitText {
    window: String,
    max: u64,
}

impl TryFrom<WindowLimitText> for WindowLimit {
    type Error = SpecError;
    fn try_from(t: WindowLimitText) -> Result<Self, SpecError> {
        WindowLimit::parse(&t.window, t.max)
    }
}

impl WindowLimit {
    /// A limit of `max` per `window` (a duration such as `"1m"`), checked.
    pub fn parse(window: &str, max: u64) -> Result<Self, SpecError> {
        let limit = WindowLimit { window: Window::parse(window)?, max };
        range("limit.max", limit.max, 1, LIMIT_MAX)?;
        Ok(limit)
    }
}

impl From<WindowLimit> for WindowLimitText {
    fn from(l: WindowLimit) -> Self {
        WindowLimitText { window: l.window.to_string(), max: l.max }
    }
}

impl Default for CounterSpec {
    fn default() -> Self {
        Self {
            shards: SHARDS_DEFAULT,
            durability: Durability::Batched,
            flush_ms: FLUSH_MS_DEFAULT,
            rollup_ms: ROLLUP_MS_DEFAULT,
            router: RouterPolicy::Writer,
            distinct: false,
            dedup_window_s: DEDUP_WINDOW_S_DEFAULT,
            frequency: None,
            windows: WindowSet::NONE,
            min: None,
            max: None,
            limit: None,
            replicas: None,
        }
    }
}

/// A partial spec: the fields a create or update names. Absent fields keep their
/// current value (or the default, on create).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpecPatch {
    /// New shard count (a resharding on a live counter).
    pub shards: Option<u16>,
    /// New durability.
    pub durability: Option<Durability>,
    /// New aggregation window.
    pub flush_ms: Option<u32>,
    /// New rollup interval.
    pub rollup_ms: Option<u32>,
    /// New routing policy.
    pub router: Option<RouterPolicy>,
    /// Turn distinct counting on or off.
    pub distinct: Option<bool>,
    /// New dedup window.
    pub dedup_window_s: Option<u32>,
    /// Keep frequencies with this shape. Once set it cannot change: shards' sketches
    /// of different shapes do not merge.
    pub frequency: Option<FrequencySpec>,
    /// New set of windows: windows kept keep their buckets, new ones start empty,
    /// dropped ones are forgotten.
    pub windows: Option<WindowSet>,
    /// The lower bound, on create only (an update may name the current one).
    pub min: Option<i64>,
    /// The upper bound, on create only (an update may name the current one).
    pub max: Option<i64>,
    /// The window limit, on create only (an update may name the current one).
    pub limit: Option<WindowLimit>,
    /// The replica count, on create only (an update may name the current one).
    pub replicas: Option<u8>,
}

/// The bounds of a counter whose shard count follows contention (`shards: "auto"`).
///
/// Kept beside the counter's [`CounterSpec`], not inside it: the stored spec's layout
/// is unchanged, so stores and logs written before auto counters stay readable.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct AutoShards {
    /// Fewest shards; a new auto counter starts here.
    pub min_shards: u16,
    /// Most shards.
    pub max_shards: u16,
}

impl AutoShards {
    /// Checks `1 ≤ min_shards ≤ max_shards ≤ SHARDS_MAX`.
    pub fn validate(&self) -> Result<(), SpecError> {
        range("min_shards", self.min_shards.into(), SHARDS_MIN.into(), SHARDS_MAX.into())?;
        range("max_shards", self.max_shards.into(), self.min_shards.into(), SHARDS_MAX.into())?;
        Ok(())
    }

    /// These bounds with the named ones replaced, validated.
    pub fn patched(&self, min_shards: Option<u16>, max_shards: Option<u16>) -> Result<Self, SpecError> {
        let next = Self {
            min_shards: min_shards.unwrap_or(self.min_shards),
            max_shards: max_shards.unwrap_or(self.max_shards),
        };
        next.validate()?;
        Ok(next)
    }
}

/// How a create or update sets a counter's shard count: the numeric `shards` of a
/// [`SpecPatch`] makes it fixed; this makes it follow contention, or changes its
/// bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct AutoPatch {
    /// `shards: "auto"` was named.
    pub auto: bool,
    /// New lower bound.
    pub min_shards: Option<u16>,
    /// New upper bound.
    pub max_shards: Option<u16>,
}

impl AutoPatch {
    /// Whether the patch names anything.
    pub fn is_empty(&self) -> bool {
        !self.auto && self.min_shards.is_none() && self.max_shards.is_none()
    }

    /// The bounds after this patch, given the current ones (`None`: the counter is
    /// fixed) and a numeric `shards` in the same request (`fixed`): `Ok(None)` keeps
    /// or makes the counter fixed. Switching to auto without naming a bound takes
    /// `SHARDS_MIN` and `max(AUTO_MAX_SHARDS_DEFAULT, min_shards)`.
    pub fn resolve(
        &self,
        current: Option<AutoShards>,
        fixed: Option<u16>,
    ) -> Result<Option<AutoShards>, SpecError> {
        if self.auto && fixed.is_some() {
            return Err(SpecError::AutoAndFixed);
        }
        if fixed.is_some() {
            if self.min_shards.is_some() || self.max_shards.is_some() {
                return Err(SpecError::AutoAndFixed);
            }
            return Ok(None);
        }
        let base = match (current, self.auto) {
            (Some(b), _) => b,
            (None, true) => {
                let min_shards = self.min_shards.unwrap_or(SHARDS_MIN);
                AutoShards { min_shards, max_shards: AUTO_MAX_SHARDS_DEFAULT.max(min_shards) }
            }
            (None, false) if self.is_empty() => return Ok(None),
            (None, false) => return Err(SpecError::BoundsWithoutAuto),
        };
        base.patched(self.min_shards, self.max_shards).map(Some)
    }
}

/// `max_shards` of an auto counter that names none.
pub const AUTO_MAX_SHARDS_DEFAULT: u16 = 64;

/// Why a spec was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SpecError {
    /// A numeric field outside its range.
    #[error("{field} must be between {min} and {max} (got {got})")]
    OutOfRange {
        /// The field.
        field: &'static str,
        /// Smallest allowed.
        min: u64,
        /// Largest allowed.
        max: u64,
        /// What was given.
        got: u64,
    },
    /// A textual field with an unknown word.
    #[error("{field} must be one of {expected:?} (got {found:?})")]
    UnknownWord {
        /// The field.
        field: &'static str,
        /// What was given (truncated).
        found: String,
        /// The accepted words.
        expected: &'static [&'static str],
    },
    /// A frequency option out of its bounds.
    #[error(transparent)]
    Frequency(#[from] FrequencyError),
    /// A `windows` option out of its bounds (see [`crate::window`]'s limits).
    #[error(transparent)]
    Window(#[from] WindowError),
    /// Both a numeric `shards` and auto bounds were named.
    #[error("shards is either a number or \"auto\" with min_shards and max_shards, not both")]
    AutoAndFixed,
    /// `min_shards` or `max_shards` named for a counter whose shard count is fixed.
    #[error("min_shards and max_shards apply only with shards: \"auto\"")]
    BoundsWithoutAuto,
    /// A counter's frequency shape cannot change once set.
    #[error(
        "frequency is fixed once set (epsilon {epsilon}, delta {delta}): sketches of another shape would not merge; \
         create a new counter"
    )]
    FrequencyFixed {
        /// The current ε, formatted.
        epsilon: String,
        /// The current δ, formatted.
        delta: String,
    },
    /// `min` above `max`.
    #[error("min {min} is above max {max}")]
    BoundsInverted {
        /// The lower bound.
        min: i64,
        /// The upper bound.
        max: i64,
    },
    /// A bounded counter must answer an increment only once a shard admitted it.
    #[error(
        "a counter with min, max or limit must have durability \"sync\": a batched increment is acknowledged \
         before any shard could refuse it"
    )]
    BoundedNeedsSync,
    /// A new counter starts at 0, which must lie within its bounds.
    #[error(
        "a new counter starts at 0, outside min {min:?} and max {max:?}; add an offset to the bounds instead"
    )]
    BoundsExcludeZero {
        /// The lower bound.
        min: Option<i64>,
        /// The upper bound.
        max: Option<i64>,
    },
    /// `shards: "auto"` on a counter with bounds.
    #[error(
        "a counter with min, max or limit keeps the shard count it was created with; give a number, not \"auto\""
    )]
    BoundedAuto,
    /// Bounds are set when a counter is created and never change; neither does a
    /// bounded counter's shard count (its shards' headroom shares are per shard).
    #[error(
        "min and max are set when a counter is created and never change, nor does the shard count of a \
         counter that has them (now min {min:?}, max {max:?}, {shards} shards); create a new counter"
    )]
    BoundsFixed {
        /// The current lower bound.
        min: Option<i64>,
        /// The current upper bound.
        max: Option<i64>,
        /// The current shard count.
        shards: u16,
    },
    /// `limit` names a window the counter does not keep.
    #[error("limit.window {window} is not one of the counter's windows {kept:?}")]
    LimitWindowNotKept {
        /// The limit's window.
        window: String,
        /// The windows the counter keeps.
        kept: Vec<String>,
    },
    /// `limit` together with `min` or `max`.
    #[error(
        "a counter has either min and max (bounds on its value) or a limit (a cap on one window), not both"
    )]
    LimitWithBounds,
    /// A window limit is set when a counter is created and never changes.
    #[error(
        "limit is set when a counter is created and never changes (now {now}), nor does the shard count of \
         a counter that has one; create a new counter"
    )]
    LimitFixed {
        /// The current limit, as `max per window`, or `none`.
        now: String,
    },
    /// A counter's replica count is set when it is created and never changes.
    #[error("replicas is set when a counter is created and never changes (now {now}); create a new counter")]
    ReplicasFixed {
        /// The current count, or `the cluster's`.
        now: String,
    },
    /// A replica count above 1 on a node whose shards have one copy each.
    #[error(
        "replicas {asked}: this node keeps one copy of each shard; a cluster with \
         `cluster.replicas` above 1 on every node replicates them"
    )]
    Unreplicated {
        /// The count asked for.
        asked: u8,
    },
    /// Two copies: a group of two voters cannot replace a lost disk.
    #[error(
        "replicas 2: two copies cannot survive a lost disk (every majority of two needs both, so a \
         replaced disk can never rejoin its ranges); ask for 3, or 1"
    )]
    TwoCopies,
    /// The counter was resharded as many times as its shards' ids can number.
    #[error("the counter was resharded {max} times, the most a counter may be; create a new counter")]
    GenerationsExhausted {
        /// The last generation, [`crate::ids::GENERATION_MAX`].
        max: u32,
    },
}

fn range(field: &'static str, got: u64, min: u64, max: u64) -> Result<(), SpecError> {
    if got < min || got > max {
        return Err(SpecError::OutOfRange { field, min, max, got });
    }
    Ok(())
}

impl CounterSpec {
    /// Checks every field against its bounds.
    pub fn validate(&self) -> Result<(), SpecError> {
        range("shards", self.shards.into(), SHARDS_MIN.into(), SHARDS_MAX.into())?;
        range("flush_ms", self.flush_ms.into(), FLUSH_MS_MIN.into(), FLUSH_MS_MAX.into())?;
        if self.rollup_ms != 0 {
            range("rollup_ms", self.rollup_ms.into(), ROLLUP_MS_MIN.into(), ROLLUP_MS_MAX.into())?;
        }
        range("dedup_window_s", self.dedup_window_s.into(), 0, DEDUP_WINDOW_S_MAX.into())?;
        if let Some(f) = &self.frequency {
            f.validate()?;
        }
        if let (Some(min), Some(max)) = (self.min, self.max) {
            if min > max {
                return Err(SpecError::BoundsInverted { min, max });
            }
        }
        if let Some(limit) = &self.limit {
            if self.min.is_some() || self.max.is_some() {
                return Err(SpecError::LimitWithBounds);
            }
            if !self.windows.windows().contains(&limit.window) {
                let window = limit.window.to_string();
                return Err(SpecError::LimitWindowNotKept { window, kept: self.windows.texts() });
            }
        }
        if self.bounded() && self.durability != Durability::Sync {
            return Err(SpecError::BoundedNeedsSync);
        }
        if let Some(r) = self.replicas {
            range("replicas", r.into(), 1, crate::ranges::REPLICAS_MAX.into())?;
        }
        Ok(())
    }

    /// The replica class of the counter's shards ([`crate::ShardId::replicas`]): its
    /// own replica count, or [`crate::ids::CLUSTER_REPLICAS`].
    pub fn replica_class(&self) -> u8 {
        self.replicas.unwrap_or(crate::ids::CLUSTER_REPLICAS)
    }

    /// Whether the counter keeps an escrow: it has a `min`, a `max` or a `limit`.
    /// Such a counter is `sync` and keeps the shard count it was created with.
    pub fn bounded(&self) -> bool {
        self.min.is_some() || self.max.is_some() || self.limit.is_some()
    }

    /// `total` brought within the counter's bounds. The value of a bounded counter is
    /// within them at every instant; a total summed from shards read one after another
    /// can fall outside by headroom that moved between shards while the read went
    /// round (a shard read late spent what a shard read early had not yet granted),
    /// and is answered at the bound it crossed.
    pub fn clamp(&self, total: i128) -> i128 {
        let total = self.min.map_or(total, |m| total.max(i128::from(m)));
        self.max.map_or(total, |m| total.min(i128::from(m)))
    }

    /// The counter's bounds, as the escrow keeps them: a window limit is an upper
    /// bound on its window's total, which the shards' expiring buckets give back.
    pub fn bounds(&self) -> crate::escrow::Bounds {
        match self.limit {
            Some(l) => crate::escrow::Bounds { min: None, max: Some(l.max as i64) },
            None => crate::escrow::Bounds { min: self.min, max: self.max },
        }
    }

    /// This spec with `patch` applied, validated.
    pub fn patched(&self, patch: &SpecPatch) -> Result<Self, SpecError> {
        if let (Some(now), Some(asked)) = (&self.frequency, &patch.frequency) {
            if now != asked {
                return Err(SpecError::FrequencyFixed {
                    epsilon: now.epsilon.to_string(),
                    delta: now.delta.to_string(),
                });
            }
        }
        let next = Self {
            shards: patch.shards.unwrap_or(self.shards),
            durability: patch.durability.unwrap_or(self.durability),
            flush_ms: patch.flush_ms.unwrap_or(self.flush_ms),
            rollup_ms: patch.rollup_ms.unwrap_or(self.rollup_ms),
            router: patch.router.unwrap_or(self.router),
            distinct: patch.distinct.unwrap_or(self.distinct),
            dedup_window_s: patch.dedup_window_s.unwrap_or(self.dedup_window_s),
            frequency: patch.frequency.or(self.frequency),
            windows: patch.windows.unwrap_or(self.windows),
            min: patch.min.or(self.min),
            max: patch.max.or(self.max),
            limit: patch.limit.or(self.limit),
            replicas: patch.replicas.or(self.replicas),
        };
        next.validate()?;
        // A counter that stated two copies before they were refused keeps them (its
        // groups have three voters: `ranges::group_voters`); no counter asks anew.
        if patch.replicas == Some(2) && self.replicas != Some(2) {
            return Err(SpecError::TwoCopies);
        }
        Ok(next)
    }

    /// This spec with `patch` applied to a live counter: as [`CounterSpec::patched`],
    /// and bounds (and a bounded counter's shard count) stay as they are.
    pub fn updated(&self, patch: &SpecPatch) -> Result<Self, SpecError> {
        let next = self.patched(patch)?;
        if next.limit != self.limit || (self.limit.is_some() && next.shards != self.shards) {
            let now = self.limit.map_or_else(|| "none".to_owned(), |l| format!("{} per {}", l.max, l.window));
            return Err(SpecError::LimitFixed { now });
        }
        if next.replicas != self.replicas {
            let now = self.replicas.map_or_else(|| "the cluster's".to_owned(), |r| r.to_string());
            return Err(SpecError::ReplicasFixed { now });
        }
        let moved =
            (next.min, next.max) != (self.min, self.max) || (self.bounded() && next.shards != self.shards);
        if moved {
            return Err(SpecError::BoundsFixed { min: self.min, max: self.max, shards: self.shards });
        }
        Ok(next)
    }

    /// The dedup window in milliseconds.
    pub fn dedup_window_ms(&self) -> u64 {
        u64::from(self.dedup_window_s) * 1000
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn defaults_match_the_documented_contract() {
        let s = CounterSpec::default();
        assert_eq!(s.shards, 8);
        assert_eq!(s.durability, Durability::Batched);
        assert_eq!(s.flush_ms, 200);
        assert_eq!(s.rollup_ms, 1000);
        assert_eq!(s.router, RouterPolicy::Writer);
        assert!(!s.distinct);
        assert_eq!(s.dedup_window_s, 86_400);
        assert_eq!(s.validate(), Ok(()));
    }

    #[test]
    fn patch_changes_only_named_fields_and_validates() {
        let s = CounterSpec::default();
        let p = SpecPatch { shards: Some(64), durability: Some(Durability::Sync), ..Default::default() };
        let t = s.patched(&p).unwrap();
        assert_eq!((t.shards, t.durability, t.flush_ms), (64, Durability::Sync, 200));
        for bad in [0u16, 1025] {
            let p = SpecPatch { shards: Some(bad), ..Default::default() };
            assert!(matches!(s.patched(&p), Err(SpecError::OutOfRange { field: "shards", .. })));
        }
        let p = SpecPatch { rollup_ms: Some(0), ..Default::default() };
        assert_eq!(s.patched(&p).unwrap().rollup_ms, 0);
        let p = SpecPatch { rollup_ms: Some(5), ..Default::default() };
        assert!(s.patched(&p).is_err());
        let p = SpecPatch { flush_ms: Some(0), ..Default::default() };
        assert!(s.patched(&p).is_err());
    }

    #[test]
    fn words_parse_and_print() {
        for d in [Durability::Sync, Durability::Batched] {
            assert_eq!(d.as_str().parse::<Durability>(), Ok(d));
        }
        assert_eq!("round_robin".parse::<RouterPolicy>(), Ok(RouterPolicy::RoundRobin));
        assert!("fast".parse::<Durability>().is_err());
        let json = serde_json::to_string(&CounterSpec::default()).unwrap();
        assert!(json.contains("\"batched\"") && json.contains("\"writer\""), "{json}");
    }

    #[test]
    fn frequency_is_validated_and_fixed_once_set() {
        let f = FrequencySpec { epsilon: 0.001, delta: 0.01 };
        let p = SpecPatch { frequency: Some(f), ..Default::default() };
        let s = CounterSpec::default().patched(&p).unwrap();
        assert_eq!(s.frequency, Some(f));
        // Naming the same shape again, or not naming it, keeps it.
        assert_eq!(s.patched(&p).unwrap().frequency, Some(f));
        assert_eq!(s.patched(&SpecPatch::default()).unwrap().frequency, Some(f));
        let other =
            SpecPatch { frequency: Some(FrequencySpec { epsilon: 0.01, delta: 0.01 }), ..Default::default() };
        assert!(matches!(s.patched(&other), Err(SpecError::FrequencyFixed { .. })));
        let bad =
            SpecPatch { frequency: Some(FrequencySpec { epsilon: 0.0, delta: 0.01 }), ..Default::default() };
        assert!(matches!(CounterSpec::default().patched(&bad), Err(SpecError::Frequency(_))));
        let json: SpecPatch =
            serde_json::from_str(r#"{"frequency": {"epsilon": 0.001, "delta": 0.01}}"#).unwrap();
        assert_eq!(json.frequency, Some(f));
    }

    #[test]
    fn auto_bounds_are_validated_and_exclusive_with_a_number() {
        let auto = |min, max| AutoPatch { auto: true, min_shards: min, max_shards: max };
        assert_eq!(
            auto(None, None).resolve(None, None),
            Ok(Some(AutoShards { min_shards: 1, max_shards: 64 }))
        );
        assert_eq!(
            auto(Some(2), Some(8)).resolve(None, None),
            Ok(Some(AutoShards { min_shards: 2, max_shards: 8 }))
        );
        assert_eq!(
            auto(Some(100), None).resolve(None, None),
            Ok(Some(AutoShards { min_shards: 100, max_shards: 100 }))
        );
        for (min, max, field) in [(0, 4, "min_shards"), (4, 2, "max_shards"), (1, 1025, "max_shards")] {
            let err = auto(Some(min), Some(max)).resolve(None, None).unwrap_err();
            assert!(matches!(err, SpecError::OutOfRange { field: f, .. } if f == field), "{err:?}");
        }
        assert_eq!(auto(None, None).resolve(None, Some(4)), Err(SpecError::AutoAndFixed));
        let bounds_only = AutoPatch { max_shards: Some(8), ..Default::default() };
        assert_eq!(bounds_only.resolve(None, Some(4)), Err(SpecError::AutoAndFixed));
        assert_eq!(bounds_only.resolve(None, None), Err(SpecError::BoundsWithoutAuto));
        // On an auto counter: bounds change alone; a number makes it fixed; nothing
        // named keeps it.
        let now = Some(AutoShards { min_shards: 2, max_shards: 16 });
        assert_eq!(bounds_only.resolve(now, None), Ok(Some(AutoShards { min_shards: 2, max_shards: 8 })));
        assert_eq!(AutoPatch::default().resolve(now, Some(4)), Ok(None));
        assert_eq!(AutoPatch::default().resolve(now, None), Ok(now));
        assert_eq!(AutoPatch::default().resolve(None, None), Ok(None));
    }

    #[test]
    fn windows_are_an_option_of_the_spec() {
        let set = WindowSet::parse(&["1m", "1h"]).unwrap();
        let p = SpecPatch { windows: Some(set), ..Default::default() };
        let s = CounterSpec::default().patched(&p).unwrap();
        assert_eq!(s.windows, set);
        assert_eq!(s.patched(&SpecPatch::default()).unwrap().windows, set, "unnamed, they stay");
        let none = SpecPatch { windows: Some(WindowSet::NONE), ..Default::default() };
        assert!(s.patched(&none).unwrap().windows.is_empty());
        let json: SpecPatch = serde_json::from_str(r#"{"windows": ["1h", "1m"]}"#).unwrap();
        assert_eq!(json.windows, Some(set));
        assert!(serde_json::from_str::<SpecPatch>(r#"{"windows": ["1y"]}"#).is_err());
        let e: SpecError = WindowSet::parse(&["1m", "1m"]).unwrap_err().into();
        assert!(e.to_string().contains("named twice"), "{e}");
    }

    #[test]
    fn bounds_are_checked_and_fixed_once_the_counter_exists() {
        let sync = Some(Durability::Sync);
        let p = SpecPatch { min: Some(0), durability: sync, ..Default::default() };
        let s = CounterSpec::default().patched(&p).unwrap();
        assert_eq!((s.min, s.max, s.bounded()), (Some(0), None, true));
        let batched = SpecPatch { min: Some(0), ..Default::default() };
        assert_eq!(CounterSpec::default().patched(&batched), Err(SpecError::BoundedNeedsSync));
        let inverted = SpecPatch { min: Some(5), max: Some(4), durability: sync, ..Default::default() };
        assert_eq!(
            CounterSpec::default().patched(&inverted),
            Err(SpecError::BoundsInverted { min: 5, max: 4 })
        );
        // An update keeps them: naming the same is fine, another or a new one is not.
        assert_eq!(s.updated(&p).unwrap(), s);
        let fixed = SpecError::BoundsFixed { min: Some(0), max: None, shards: 8 };
        for bad in [
            SpecPatch { min: Some(-1), ..Default::default() },
            SpecPatch { max: Some(10), ..Default::default() },
            SpecPatch { shards: Some(16), ..Default::default() },
            SpecPatch { durability: Some(Durability::Batched), ..Default::default() },
        ] {
            let got = s.updated(&bad);
            assert!(got == Err(fixed.clone()) || got == Err(SpecError::BoundedNeedsSync), "{bad:?}: {got:?}");
        }
        let unbounded = CounterSpec::default();
        assert!(unbounded.updated(&SpecPatch { max: Some(3), ..Default::default() }).is_err());
        assert_eq!(
            unbounded.updated(&SpecPatch { shards: Some(3), ..Default::default() }).unwrap().shards,
            3
        );
        let both = CounterSpec { min: Some(0), max: Some(9), ..s };
        assert_eq!((both.clamp(-3), both.clamp(4), both.clamp(12)), (0, 4, 9));
        assert_eq!(CounterSpec::default().clamp(-3), -3);
        let json: SpecPatch = serde_json::from_str(r#"{"min": 0, "max": 1000}"#).unwrap();
        assert_eq!((json.min, json.max), (Some(0), Some(1000)));
    }

    #[test]
    fn patch_refuses_unknown_fields() {
        let r: Result<SpecPatch, _> = serde_json::from_str(r#"{"shardz": 3}"#);
        assert!(r.is_err());
    }

    #[test]
    fn a_window_limit_caps_a_kept_window_of_a_sync_counter_and_never_changes() {
        let minute = WindowSet::parse(&["1m", "1h"]).unwrap();
        let limit = WindowLimit::parse("1m", 100).unwrap();
        let p = SpecPatch {
            windows: Some(minute),
            limit: Some(limit),
            durability: Some(Durability::Sync),
            ..Default::default()
        };
        let s = CounterSpec::default().patched(&p).unwrap();
        assert!(s.bounded());
        assert_eq!(s.bounds(), crate::escrow::Bounds { min: None, max: Some(100) });
        // Written and read as text.
        let json = serde_json::to_string(&s.limit).unwrap();
        assert_eq!(json, r#"{"window":"1m","max":100}"#);
        let back: SpecPatch = serde_json::from_str(&format!(r#"{{"limit": {json}}}"#)).unwrap();
        assert_eq!(back.limit, Some(limit));
        assert!(serde_json::from_str::<SpecPatch>(r#"{"limit": {"window": "1m", "max": 0}}"#).is_err());
        assert!(matches!(WindowLimit::parse("1y", 5), Err(SpecError::Window(_))));
        // The window must be kept, and kept on.
        let unkept = SpecPatch { windows: Some(WindowSet::parse(&["1h"]).unwrap()), ..p };
        let e = CounterSpec::default().patched(&unkept).unwrap_err();
        assert!(matches!(e, SpecError::LimitWindowNotKept { .. }), "{e:?}");
        assert!(matches!(s.updated(&unkept), Err(SpecError::LimitWindowNotKept { .. })));
        // Sync, without min and max, set once.
        let batched = SpecPatch { durability: Some(Durability::Batched), ..p };
        assert_eq!(CounterSpec::default().patched(&batched), Err(SpecError::BoundedNeedsSync));
        let both = SpecPatch { max: Some(10), ..p };
        assert_eq!(CounterSpec::default().patched(&both), Err(SpecError::LimitWithBounds));
        let other = SpecPatch { limit: Some(WindowLimit::parse("1h", 100).unwrap()), ..Default::default() };
        assert!(matches!(s.updated(&other), Err(SpecError::LimitFixed { .. })));
        let reshard = SpecPatch { shards: Some(4), ..Default::default() };
        assert!(matches!(s.updated(&reshard), Err(SpecError::LimitFixed { .. })));
        let plain = CounterSpec::default();
        assert!(matches!(
            plain.updated(&SpecPatch { limit: Some(limit), ..p }),
            Err(SpecError::LimitFixed { .. })
        ));
        assert_eq!(
            s.updated(&SpecPatch { limit: Some(limit), ..Default::default() }),
            Ok(s),
            "naming it is fine"
        );
    }

    #[test]
    fn replicas_are_checked_and_set_once() {
        let p = SpecPatch { replicas: Some(3), ..Default::default() };
        let s = CounterSpec::default().patched(&p).unwrap();
        assert_eq!((s.replicas, s.replica_class()), (Some(3), 3));
        assert_eq!(CounterSpec::default().replica_class(), crate::ids::CLUSTER_REPLICAS);
        for bad in [0u8, 6] {
            let e = CounterSpec::default().patched(&SpecPatch { replicas: Some(bad), ..Default::default() });
            assert!(matches!(e, Err(SpecError::OutOfRange { field: "replicas", .. })), "{e:?}");
        }
        assert_eq!(s.updated(&p), Ok(s), "naming it is fine");
        let other = SpecPatch { replicas: Some(5), ..Default::default() };
        assert!(matches!(s.updated(&other), Err(SpecError::ReplicasFixed { .. })));
        let plain = CounterSpec::default();
        assert!(matches!(plain.updated(&p), Err(SpecError::ReplicasFixed { .. })));
        let back: SpecPatch = serde_json::from_str(r#"{"replicas": 5}"#).unwrap();
        assert_eq!(back.replicas, Some(5));
        // Two copies are refused anew; a counter that stated them before keeps them.
        let two = SpecPatch { replicas: Some(2), ..Default::default() };
        assert_eq!(CounterSpec::default().patched(&two), Err(SpecError::TwoCopies));
        let kept = CounterSpec { replicas: Some(2), ..CounterSpec::default() };
        assert_eq!(kept.updated(&two).map(|s| s.replicas), Ok(Some(2)));
        let other = SpecPatch { rollup_ms: Some(500), ..Default::default() };
        assert_eq!(kept.updated(&other).map(|s| s.replicas), Ok(Some(2)));
    }
}
