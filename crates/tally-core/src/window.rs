//! Sliding windows: a counter's totals and distinct members over the last minute,
//! hour or day, kept in time buckets per shard.
//!
//! A window of length `W` is cut into buckets of `W / BUCKETS_PER_WINDOW` (a bucket
//! of a one-hour window is one minute). A shard adds each applied increment to the
//! bucket its node clock's `now_ms` falls in ([`bucket_of`]), and, for a counter with
//! `distinct`, the increment's member to that bucket's HyperLogLog registers
//! ([`crate::sketch`], which merges exactly, so the window's distinct over many
//! shards and buckets is the sketch one shard would have built from the same members).
//!
//! A read at `now_ms` sums the bucket `now_ms` falls in and the
//! `BUCKETS_PER_WINDOW - 1` before it ([`span`]): it is the exact sum of the
//! increments stamped in `[start_ms, end_ms]`, and that span is shorter than `W` by
//! less than one bucket. So against the nominal `[now_ms - W, now_ms]` a window total
//! misses at most the increments of one bucket at its old edge, and it never counts
//! an increment from before `now_ms - W`.
//!
//! Buckets older than the window are dropped on every add and on [`WindowState::expire`],
//! so a shard keeps at most `BUCKETS_PER_WINDOW` buckets per window: memory per window
//! is bounded ([`WindowState::size_bytes`] reports it). An increment stamped before
//! the oldest bucket kept (a clock that went back by more than a window) is counted
//! in the shard's total only; an increment stamped after a reader's `now_ms` (a clock
//! ahead of the reader's) is not in that read's window until the reader's clock
//! reaches it.
//!
//! Everything here is pure: time arrives as `now_ms`.

use crate::codec::{decode, encode, DecodeError};
use crate::sketch::DistinctSketch;
use serde::{Deserialize, Serialize};
use std::collections::BTreeMap;
use std::fmt;

/// Buckets a window is cut into: its granularity is `1 / BUCKETS_PER_WINDOW` of its
/// length (a one-minute bucket for a one-hour window).
pub const BUCKETS_PER_WINDOW: u64 = 60;
/// Most windows one counter may keep.
pub const WINDOWS_PER_COUNTER_MAX: usize = 4;
/// Shortest window, in milliseconds (one minute: one-second buckets).
pub const WINDOW_MS_MIN: u64 = 60_000;
/// Longest window, in milliseconds (30 days: twelve-hour buckets).
pub const WINDOW_MS_MAX: u64 = 30 * 86_400_000;
/// Longest duration text accepted (`"43200m"` fits; longer is refused unparsed).
pub const WINDOW_TEXT_BYTES_MAX: usize = 16;
/// Bytes of one bucket's index and total, as [`WindowState::size_bytes`] counts them.
const BUCKET_ENTRY_BYTES: usize = 2 * std::mem::size_of::<u64>();
/// Version byte of the encoded window state.
const STATE_VERSION: u8 = 1;

/// Why a window was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum WindowError {
    /// Not a duration such as `"90s"`, `"1m"`, `"1h"` or `"7d"`.
    #[error("window {found:?} is not a duration such as \"1m\", \"1h\" or \"24h\"")]
    Unparsable {
        /// What was given (truncated).
        found: String,
    },
    /// A duration outside `WINDOW_MS_MIN ..= WINDOW_MS_MAX`.
    #[error("window {text} must be between 1m and 30d")]
    OutOfRange {
        /// The duration as given.
        text: String,
    },
    /// A duration that does not cut into `BUCKETS_PER_WINDOW` whole milliseconds.
    #[error("window {text} does not divide into {BUCKETS_PER_WINDOW} buckets of whole milliseconds")]
    NotDivisible {
        /// The duration as given.
        text: String,
    },
    /// More windows than `WINDOWS_PER_COUNTER_MAX`.
    #[error("at most {WINDOWS_PER_COUNTER_MAX} windows per counter (got {count})")]
    TooMany {
        /// How many were named.
        count: usize,
    },
    /// The same duration named twice.
    #[error("window {text} is named twice")]
    Duplicate {
        /// The duration.
        text: String,
    },
    /// A read of a window the counter does not keep.
    #[error("the counter keeps no window {asked} (it keeps {kept:?})")]
    Unknown {
        /// The window asked for.
        asked: String,
        /// The windows it keeps.
        kept: Vec<String>,
    },
}

impl WindowError {
    /// The stable snake_case code of the refusal.
    pub fn code(&self) -> &'static str {
        match self {
            Self::Unparsable { .. } => "invalid_window",
            Self::OutOfRange { .. } => "window_out_of_range",
            Self::NotDivisible { .. } => "window_not_divisible",
            Self::TooMany { .. } => "too_many_windows",
            Self::Duplicate { .. } => "duplicate_window",
            Self::Unknown { .. } => "unknown_window",
        }
    }
}

/// One window's length.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct Window {
    /// Its length in milliseconds, validated.
    ms: u64,
}

impl Window {
    /// Parses `"<n><unit>"` with unit `s`, `m`, `h` or `d` and checks its bounds.
    pub fn parse(text: &str) -> Result<Self, WindowError> {
        let unparsable = || WindowError::Unparsable { found: text.chars().take(32).collect() };
        // ASCII only: the unit is the last byte, and a multi-byte character there
        // must be refused, not split.
        if text.is_empty() || text.len() > WINDOW_TEXT_BYTES_MAX || !text.is_ascii() {
            return Err(unparsable());
        }
        let (digits, unit) = text.split_at(text.len() - 1);
        let unit_ms: u64 = match unit {
            "s" => 1_000,
            "m" => 60_000,
            "h" => 3_600_000,
            "d" => 86_400_000,
            _ => return Err(unparsable()),
        };
        if digits.is_empty() || !digits.bytes().all(|b| b.is_ascii_digit()) {
            return Err(unparsable());
        }
        let n: u64 = digits.parse().map_err(|_| unparsable())?;
        let ms = n.checked_mul(unit_ms).ok_or_else(|| WindowError::OutOfRange { text: text.to_owned() })?;
        Self::from_ms(ms).map_err(|e| match e {
            WindowError::OutOfRange { .. } => WindowError::OutOfRange { text: text.to_owned() },
            WindowError::NotDivisible { .. } => WindowError::NotDivisible { text: text.to_owned() },
            other => other,
        })
    }

    /// A window of `ms` milliseconds, checked.
    pub fn from_ms(ms: u64) -> Result<Self, WindowError> {
        let text = || Self { ms }.to_string();
        if !(WINDOW_MS_MIN..=WINDOW_MS_MAX).contains(&ms) {
            return Err(WindowError::OutOfRange { text: text() });
        }
        if ms % BUCKETS_PER_WINDOW != 0 {
            return Err(WindowError::NotDivisible { text: text() });
        }
        Ok(Self { ms })
    }

    /// Its length in milliseconds.
    pub fn ms(self) -> u64 {
        self.ms
    }

    /// The width of its buckets, in milliseconds: its granularity.
    pub fn bucket_ms(self) -> u64 {
        self.ms / BUCKETS_PER_WINDOW
    }
}

impl fmt::Display for Window {
    /// The shortest exact form: `"1h"` rather than `"60m"`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (unit, unit_ms) in [("d", 86_400_000), ("h", 3_600_000), ("m", 60_000), ("s", 1_000)] {
            if self.ms % unit_ms == 0 {
                return write!(f, "{}{unit}", self.ms / unit_ms);
            }
        }
        write!(f, "{}ms", self.ms)
    }
}

/// Parses a counter's `windows` option: at most `WINDOWS_PER_COUNTER_MAX`, each once,
/// returned shortest first.
pub fn parse_windows<S: AsRef<str>>(texts: &[S]) -> Result<Vec<Window>, WindowError> {
    if texts.len() > WINDOWS_PER_COUNTER_MAX {
        return Err(WindowError::TooMany { count: texts.len() });
    }
    let mut out = Vec::with_capacity(texts.len());
    for t in texts {
        let w = Window::parse(t.as_ref())?;
        if out.contains(&w) {
            return Err(WindowError::Duplicate { text: w.to_string() });
        }
        out.push(w);
    }
    out.sort();
    Ok(out)
}

/// The windows a counter keeps, as its spec holds them: at most
/// `WINDOWS_PER_COUNTER_MAX`, each once, shortest first. A plain value (`Copy`), so a
/// spec stays one; it is written as the list of its durations (`["1m", "1h"]`), and
/// decoding one parses and checks them again.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub struct WindowSet {
    /// The windows' lengths in milliseconds, the first `len` used, shortest first.
    ms: [u64; WINDOWS_PER_COUNTER_MAX],
    len: u8,
}

impl WindowSet {
    /// No windows.
    pub const NONE: WindowSet = WindowSet { ms: [0; WINDOWS_PER_COUNTER_MAX], len: 0 };

    /// Parses a counter's `windows` option (see [`parse_windows`]).
    pub fn parse<S: AsRef<str>>(texts: &[S]) -> Result<Self, WindowError> {
        let windows = parse_windows(texts)?;
        let mut set = Self::NONE;
        for (slot, w) in set.ms.iter_mut().zip(&windows) {
            *slot = w.ms;
        }
        set.len = windows.len() as u8;
        Ok(set)
    }

    /// The windows, shortest first.
    pub fn windows(&self) -> Vec<Window> {
        self.ms[..usize::from(self.len)].iter().map(|&ms| Window { ms }).collect()
    }

    /// Whether the counter keeps no window.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// How many windows.
    pub fn len(&self) -> usize {
        usize::from(self.len)
    }

    /// The windows as text, shortest first (`["1m", "1h"]`).
    pub fn texts(&self) -> Vec<String> {
        self.windows().iter().map(Window::to_string).collect()
    }

    /// The kept window a read names (see [`find_window`]).
    pub fn find(&self, asked: &str) -> Result<Window, WindowError> {
        find_window(&self.windows(), asked)
    }
}

impl Serialize for WindowSet {
    fn serialize<S: serde::Serializer>(&self, serializer: S) -> Result<S::Ok, S::Error> {
        serializer.collect_seq(self.texts())
    }
}

impl<'de> Deserialize<'de> for WindowSet {
    fn deserialize<D: serde::Deserializer<'de>>(deserializer: D) -> Result<Self, D::Error> {
        let texts: Vec<String> = Vec::deserialize(deserializer)?;
        if texts.len() > WINDOWS_PER_COUNTER_MAX {
            return Err(serde::de::Error::custom(WindowError::TooMany { count: texts.len() }));
        }
        Self::parse(&texts).map_err(serde::de::Error::custom)
    }
}

/// Finds the window a read names among those a counter keeps.
pub fn find_window(kept: &[Window], asked: &str) -> Result<Window, WindowError> {
    let unknown = || WindowError::Unknown {
        asked: asked.chars().take(32).collect(),
        kept: kept.iter().map(|w| w.to_string()).collect(),
    };
    let w = Window::parse(asked).map_err(|_| unknown())?;
    kept.iter().copied().find(|k| *k == w).ok_or_else(unknown)
}

/// The bucket a timestamp falls in, for buckets `bucket_ms` wide.
pub fn bucket_of(t_ms: u64, bucket_ms: u64) -> u64 {
    t_ms / bucket_ms.max(1)
}

/// What a read at some instant covers.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    /// The window.
    pub window: Window,
    /// Its bucket width: the granularity of the answer.
    pub bucket_ms: u64,
    /// The first bucket summed.
    pub first_bucket: u64,
    /// The last bucket summed (the one the read's instant falls in).
    pub last_bucket: u64,
    /// The start of the first bucket: increments stamped from here on are counted.
    pub start_ms: u64,
    /// The read's instant: increments stamped up to here are counted.
    pub end_ms: u64,
}

/// The buckets a read of `window` at `now_ms` sums: the one `now_ms` falls in and the
/// `BUCKETS_PER_WINDOW - 1` before it (fewer near the epoch).
pub fn span(window: Window, now_ms: u64) -> Span {
    let bucket_ms = window.bucket_ms();
    let last_bucket = bucket_of(now_ms, bucket_ms);
    let first_bucket = last_bucket.saturating_sub(BUCKETS_PER_WINDOW - 1);
    Span { window, bucket_ms, first_bucket, last_bucket, start_ms: first_bucket * bucket_ms, end_ms: now_ms }
}

/// One bucket of one window.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct Bucket {
    /// The sum of the deltas applied in it.
    pub total: i64,
    /// The members applied in it, for counters with `distinct`.
    pub sketch: Option<DistinctSketch>,
}

/// One window's buckets in one shard, oldest first.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Buckets {
    /// The window.
    pub window: Window,
    /// Bucket index → bucket; at most `BUCKETS_PER_WINDOW` of them, all within one
    /// window of the newest.
    pub buckets: BTreeMap<u64, Bucket>,
}

impl Buckets {
    fn new(window: Window) -> Self {
        Self { window, buckets: BTreeMap::new() }
    }

    /// Drops buckets more than a window older than `newest`. Returns how many.
    fn drop_before(&mut self, newest: u64) -> usize {
        let keep_from = newest.saturating_sub(BUCKETS_PER_WINDOW - 1);
        let mut dropped = 0;
        while self.buckets.first_key_value().is_some_and(|(k, _)| *k < keep_from) {
            self.buckets.pop_first();
            dropped += 1;
        }
        dropped
    }

    fn newest(&self) -> Option<u64> {
        self.buckets.keys().next_back().copied()
    }
}

/// A read of one window, from one shard or merged over many.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct WindowRead {
    /// What the read covers.
    pub span: Span,
    /// The sum of the deltas applied in the span.
    pub total: i128,
    /// The union of the span's members, for counters with `distinct`.
    pub sketch: Option<DistinctSketch>,
}

impl WindowRead {
    /// An empty read of `span`.
    pub fn empty(span: Span, distinct: bool) -> Self {
        Self { span, total: 0, sketch: distinct.then(DistinctSketch::new) }
    }

    /// Adds another shard's read of the same span (sums add, sketches unite).
    pub fn merge(&mut self, other: &WindowRead) {
        self.total += other.total;
        if let Some(theirs) = &other.sketch {
            self.sketch.get_or_insert_with(DistinctSketch::new).merge(theirs);
        }
    }
}

/// A shard's window state: one [`Buckets`] per window the counter keeps.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct WindowState {
    /// One per window, shortest first.
    pub windows: Vec<Buckets>,
    /// Whether buckets keep members.
    pub distinct: bool,
    /// Increments stamped before every kept bucket (counted in the total only).
    pub late: u64,
    /// Whether a resharding's carry was merged in ([`WindowState::carry`]).
    pub carried: bool,
}

/// The window state a shard starts from: stored bytes decoded and made to follow the
/// counter's current windows, or empty buckets when the counter keeps windows and
/// nothing is stored; `None` when it keeps none.
pub fn state_for(
    windows: &WindowSet,
    distinct: bool,
    stored: Option<&[u8]>,
) -> Result<Option<WindowState>, DecodeError> {
    if windows.is_empty() {
        return Ok(None);
    }
    let mut state = match stored {
        Some(bytes) => WindowState::from_bytes(bytes)?,
        None => WindowState::new(&windows.windows(), distinct),
    };
    state.respec(&windows.windows(), distinct);
    Ok(Some(state))
}

impl WindowState {
    /// Empty buckets for `windows`.
    pub fn new(windows: &[Window], distinct: bool) -> Self {
        Self {
            windows: windows.iter().map(|w| Buckets::new(*w)).collect(),
            distinct,
            late: 0,
            carried: false,
        }
    }

    /// Whether the counter keeps any window.
    pub fn is_empty(&self) -> bool {
        self.windows.is_empty()
    }

    /// Follows a spec change: windows kept keep their buckets, new ones start empty,
    /// dropped ones are forgotten. Turning `distinct` on starts sketches from now on.
    pub fn respec(&mut self, windows: &[Window], distinct: bool) {
        let mut old: BTreeMap<Window, Buckets> =
            std::mem::take(&mut self.windows).into_iter().map(|b| (b.window, b)).collect();
        self.windows = windows.iter().map(|w| old.remove(w).unwrap_or_else(|| Buckets::new(*w))).collect();
        if !distinct {
            for b in self.windows.iter_mut().flat_map(|w| w.buckets.values_mut()) {
                b.sketch = None;
            }
        }
        self.distinct = distinct;
    }

    /// Adds one applied increment stamped `now_ms` (with its member's hash, if any) to
    /// every window, dropping expired buckets. A total that would leave `i64` saturates
    /// (a bucket's total is a difference of two shard values, so it never does).
    pub fn add(&mut self, now_ms: u64, delta: i64, members: &[u64]) {
        for w in &mut self.windows {
            let b = bucket_of(now_ms, w.window.bucket_ms());
            let bucket = match w.buckets.last_entry() {
                // The common case: the newest bucket, so nothing expires.
                Some(e) if *e.key() == b => e.into_mut(),
                _ => {
                    let newest = w.newest().map_or(b, |n| n.max(b));
                    w.drop_before(newest);
                    if b + BUCKETS_PER_WINDOW <= newest {
                        self.late += 1;
                        continue;
                    }
                    w.buckets.entry(b).or_default()
                }
            };
            bucket.total = bucket.total.saturating_add(delta);
            if self.distinct {
                let sketch = bucket.sketch.get_or_insert_with(DistinctSketch::new);
                for &h in members {
                    sketch.insert_hash(h);
                }
            }
        }
    }

    /// Drops every bucket wholly outside its window at `now_ms`. Returns whether any
    /// was dropped (the state must then be rewritten to reclaim the space).
    pub fn expire(&mut self, now_ms: u64) -> bool {
        let mut dropped = 0;
        for w in &mut self.windows {
            let b = bucket_of(now_ms, w.window.bucket_ms());
            let newest = w.newest().map_or(b, |n| n.max(b));
            dropped += w.drop_before(newest);
        }
        dropped > 0
    }

    /// What every bucket kept for `window` holds, in the window or not yet dropped
    /// (0 for a window not kept): what a window limit counts as spent at this shard.
    pub fn held(&self, window: Window) -> i128 {
        let kept = self.windows.iter().find(|b| b.window == window);
        kept.map_or(0, |w| w.buckets.values().map(|b| i128::from(b.total)).sum())
    }

    /// This shard's read of `window` at `now_ms`; `None` if it keeps no such window.
    pub fn read(&self, window: Window, now_ms: u64) -> Option<WindowRead> {
        let w = self.windows.iter().find(|b| b.window == window)?;
        let s = span(window, now_ms);
        let mut r = WindowRead::empty(s, self.distinct);
        for (_, b) in w.buckets.range(s.first_bucket..=s.last_bucket) {
            r.total += i128::from(b.total);
            if let (Some(mine), Some(theirs)) = (r.sketch.as_mut(), &b.sketch) {
                mine.merge(theirs);
            }
        }
        Some(r)
    }

    /// Merges another shard's state into this one bucket by bucket (a resharding
    /// carries a sealed generation's windows into the next). Sums add, so a carry
    /// must be applied once; sketches unite. Windows this state does not keep are
    /// ignored. Expired buckets are dropped afterwards.
    pub fn merge(&mut self, other: &WindowState) {
        for theirs in &other.windows {
            let Some(mine) = self.windows.iter_mut().find(|b| b.window == theirs.window) else { continue };
            for (idx, b) in &theirs.buckets {
                let bucket = mine.buckets.entry(*idx).or_default();
                bucket.total = bucket.total.saturating_add(b.total);
                if let (true, Some(s)) = (self.distinct, &b.sketch) {
                    bucket.sketch.get_or_insert_with(DistinctSketch::new).merge(s);
                }
            }
            if let Some(newest) = mine.newest() {
                mine.drop_before(newest);
            }
        }
        self.late += other.late;
    }

    /// Merges the sealed generation's windows into this state, once: a second carry
    /// is ignored (sums add, so a repeated carry would count twice). Returns whether
    /// anything changed.
    pub fn carry(&mut self, previous: &WindowState) -> bool {
        if self.carried {
            return false;
        }
        self.merge(previous);
        self.carried = true;
        true
    }

    /// Bytes the buckets hold in memory: each bucket's index and total, and its
    /// sketch (inline part and heap); the map's own nodes are not counted. At most
    /// [`WindowState::bound_bytes`].
    pub fn size_bytes(&self) -> usize {
        self.windows
            .iter()
            .flat_map(|w| w.buckets.values())
            .map(|b| BUCKET_ENTRY_BYTES + b.sketch.as_ref().map_or(0, DistinctSketch::size_bytes))
            .sum()
    }

    /// The most [`WindowState::size_bytes`] can reach for `windows` windows: every
    /// bucket kept, each sketch with its sparse list at its largest capacity and
    /// every segment dense (a sketch's sparse list is not shrunk as segments turn
    /// dense).
    pub fn bound_bytes(windows: usize, distinct: bool) -> usize {
        let sketch = if distinct {
            std::mem::size_of::<DistinctSketch>()
                + crate::sketch::SPARSE_ENTRIES_MAX.next_power_of_two() * std::mem::size_of::<u32>()
                + crate::sketch::DENSE_BYTES
        } else {
            0
        };
        windows * BUCKETS_PER_WINDOW as usize * (BUCKET_ENTRY_BYTES + sketch)
    }

    /// The state's stored bytes.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = vec![STATE_VERSION];
        out.extend(encode(self));
        out
    }

    /// Decodes stored bytes, checking every bound: at most
    /// `WINDOWS_PER_COUNTER_MAX` valid windows, at most `BUCKETS_PER_WINDOW` buckets
    /// each within one window of the newest, sketches only with `distinct`.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, DecodeError> {
        let refuse = |reason: &str| DecodeError { what: "window state", reason: reason.to_owned() };
        let (&version, body) = bytes.split_first().ok_or_else(|| refuse("empty"))?;
        if version != STATE_VERSION {
            return Err(refuse(&format!("unknown version {version}")));
        }
        let state: WindowState = decode("window state", body)?;
        match state.violation() {
            Some(reason) => Err(refuse(&reason)),
            None => Ok(state),
        }
    }

    /// Asserts the bounds [`WindowState::from_bytes`] checks: a shard's buckets
    /// keep them after every change, in production too.
    pub fn check(&self) {
        if let Some(reason) = self.violation() {
            panic!("window state: {reason}");
        }
    }

    /// The first bound the state breaks, if any: at most `WINDOWS_PER_COUNTER_MAX`
    /// valid windows, each once, at most `BUCKETS_PER_WINDOW` buckets each within
    /// one window of the newest, sketches only with `distinct`.
    fn violation(&self) -> Option<String> {
        if self.windows.len() > WINDOWS_PER_COUNTER_MAX {
            return Some("too many windows".into());
        }
        for (i, w) in self.windows.iter().enumerate() {
            if let Err(e) = Window::from_ms(w.window.ms) {
                return Some(e.to_string());
            }
            if self.windows[..i].iter().any(|o| o.window == w.window) {
                return Some("a window twice".into());
            }
            if let (Some(first), Some(last)) = (w.buckets.keys().next(), w.newest()) {
                if last - first >= BUCKETS_PER_WINDOW {
                    return Some("buckets span more than a window".into());
                }
            }
            if !self.distinct && w.buckets.values().any(|b| b.sketch.is_some()) {
                return Some("members without distinct".into());
            }
        }
        None
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sketch::member_hash;

    const HOUR: u64 = 3_600_000;
    const MIN: u64 = 60_000;

    fn w(text: &str) -> Window {
        Window::parse(text).unwrap()
    }

    #[test]
    #[should_panic(expected = "buckets span more than a window")]
    fn buckets_beyond_one_window_break_the_states_invariant() {
        let mut state = WindowState::new(&[w("1h")], false);
        state.add(0, 1, &[]);
        // Past the window, without the drop that `add` does.
        state.windows[0].buckets.insert(BUCKETS_PER_WINDOW, Bucket::default());
        assert!(WindowState::from_bytes(&state.to_bytes()).is_err(), "stored, it would not decode");
        state.check();
    }

    #[test]
    fn durations_parse_print_and_are_bounded() {
        assert_eq!(w("1h").ms(), HOUR);
        assert_eq!(w("60m"), w("1h"));
        assert_eq!(w("60m").to_string(), "1h");
        assert_eq!(w("90s").to_string(), "90s");
        assert_eq!(w("24h").to_string(), "1d");
        assert_eq!(w("1h").bucket_ms(), MIN, "a one-hour window has one-minute buckets");
        assert_eq!(w("1m").bucket_ms(), 1_000);
        assert_eq!(w("30d").ms(), WINDOW_MS_MAX);
        for bad in ["", "h", "1", "1w", "-1h", "1.5h", " 1h", "1H", "99999999999999999d"] {
            let e = Window::parse(bad).unwrap_err();
            assert!(
                matches!(e, WindowError::Unparsable { .. } | WindowError::OutOfRange { .. }),
                "{bad}: {e:?}"
            );
        }
        assert_eq!(Window::parse("59s").unwrap_err().code(), "window_out_of_range");
        assert_eq!(Window::parse("31d").unwrap_err().code(), "window_out_of_range");
        assert_eq!(Window::parse("1000000d").unwrap_err().code(), "window_out_of_range");
        assert_eq!(Window::parse("61s").unwrap_err().code(), "window_not_divisible");
        assert_eq!(Window::parse("1w").unwrap_err().code(), "invalid_window");
    }

    #[test]
    fn a_counter_keeps_a_bounded_set_of_distinct_windows() {
        assert_eq!(parse_windows(&["24h", "1m", "1h"]).unwrap(), vec![w("1m"), w("1h"), w("1d")]);
        assert_eq!(parse_windows::<&str>(&[]).unwrap(), vec![]);
        let e = parse_windows(&["1m", "2m", "3m", "4m", "5m"]).unwrap_err();
        assert_eq!((e.code(), e.clone()), ("too_many_windows", WindowError::TooMany { count: 5 }));
        assert_eq!(parse_windows(&["1h", "60m"]).unwrap_err().code(), "duplicate_window");
        let kept = parse_windows(&["1m", "1h"]).unwrap();
        assert_eq!(find_window(&kept, "60m"), Ok(w("1h")));
        let e = find_window(&kept, "24h").unwrap_err();
        assert_eq!(e.code(), "unknown_window");
        assert!(e.to_string().contains("\"1m\", \"1h\""), "{e}");
        assert_eq!(find_window(&kept, "garbage").unwrap_err().code(), "unknown_window");
    }

    #[test]
    fn a_window_set_is_a_checked_list_of_durations() {
        let set = WindowSet::parse(&["24h", "1m"]).unwrap();
        assert_eq!(set.windows(), vec![w("1m"), w("1d")]);
        assert_eq!((set.len(), set.is_empty()), (2, false));
        assert_eq!(set.texts(), vec!["1m".to_owned(), "1d".to_owned()]);
        assert_eq!(set.find("24h"), Ok(w("1d")));
        assert_eq!(set.find("1h").unwrap_err().code(), "unknown_window");
        assert!(WindowSet::NONE.is_empty() && WindowSet::default() == WindowSet::NONE);
        let json = serde_json::to_string(&set).unwrap();
        assert_eq!(json, r#"["1m","1d"]"#);
        assert_eq!(serde_json::from_str::<WindowSet>(&json).unwrap(), set);
        assert_eq!(decode::<WindowSet>("set", &encode(&set)), Ok(set));
        for bad in [r#"["1m","60s"]"#, r#"["1w"]"#, r#"["1m","2m","3m","4m","5m"]"#, r#"["59s"]"#] {
            assert!(serde_json::from_str::<WindowSet>(bad).is_err(), "{bad}");
        }
        assert_eq!(WindowSet::parse(&["1m", "2m", "3m", "4m", "5m"]).unwrap_err().code(), "too_many_windows");
    }

    #[test]
    fn a_read_covers_its_bucket_and_the_ones_before_it() {
        let s = span(w("1h"), 10 * HOUR + 30 * MIN + 5);
        assert_eq!(s.bucket_ms, MIN);
        assert_eq!(s.last_bucket, 630);
        assert_eq!(s.first_bucket, 571);
        assert_eq!(s.start_ms, 571 * MIN);
        assert_eq!(s.end_ms, 10 * HOUR + 30 * MIN + 5);
        // Shorter than the window by less than one bucket.
        let covered = s.end_ms - s.start_ms;
        assert!(covered <= HOUR && covered > HOUR - MIN, "{covered}");
        // Near the epoch there are fewer buckets.
        assert_eq!(span(w("1h"), 5).first_bucket, 0);
        assert_eq!(bucket_of(MIN - 1, MIN), 0);
        assert_eq!(bucket_of(MIN, MIN), 1);
    }

    #[test]
    fn bucket_edges_count_exactly_what_the_span_names() {
        let win = w("1m"); // one-second buckets
        let mut st = WindowState::new(&[win], false);
        let t0 = 1_000_000_000;
        // One increment at every 250 ms over two minutes, delta = its index; after
        // each, reads at that instant and up to one bucket later, across every edge.
        let mut all: Vec<(u64, i64)> = Vec::new();
        for i in 0..480u64 {
            let t = t0 + i * 250;
            st.add(t, i as i64 + 1, &[]);
            all.push((t, i as i64 + 1));
            for now in [t, t + 1, t + 249] {
                let r = st.read(win, now).unwrap();
                let exact: i128 = all
                    .iter()
                    .filter(|(t, _)| *t >= r.span.start_ms && *t <= r.span.end_ms)
                    .map(|(_, d)| i128::from(*d))
                    .sum();
                assert_eq!(r.total, exact, "at {now}");
                // Against the nominal window: short by the old edge's bucket only.
                let nominal: i128 = all
                    .iter()
                    .filter(|(t, _)| *t + win.ms() >= now && *t <= now)
                    .map(|(_, d)| i128::from(*d))
                    .sum();
                let edge: i128 = all
                    .iter()
                    .filter(|(t, _)| *t + win.ms() >= now && *t < r.span.start_ms)
                    .map(|(_, d)| i128::from(*d))
                    .sum();
                assert_eq!(nominal - r.total, edge, "at {now}");
                assert!(r.span.start_ms + win.bucket_ms() > now.saturating_sub(win.ms()));
                assert!(r.span.start_ms <= now + win.bucket_ms() - win.ms() || r.span.first_bucket == 0);
            }
        }
    }

    #[test]
    fn old_buckets_expire_and_their_space_is_reclaimed() {
        let win = w("1h");
        let mut st = WindowState::new(&[win], true);
        for m in 0..200u64 {
            st.add(m * MIN, 1, &[member_hash(&format!("u{m}"))]);
            let kept = st.windows[0].buckets.len() as u64;
            assert!(kept <= BUCKETS_PER_WINDOW, "{kept} buckets at minute {m}");
        }
        assert!(st.size_bytes() <= WindowState::bound_bytes(1, true));
        assert_eq!(st.read(win, 199 * MIN).unwrap().total, 60);
        assert_eq!(st.read(win, 199 * MIN).unwrap().sketch.unwrap().estimate(), 60);
        let before = st.size_bytes();
        assert!(st.expire(230 * MIN));
        assert!(st.size_bytes() < before);
        assert_eq!(st.windows[0].buckets.len(), 29);
        assert_eq!(st.read(win, 230 * MIN).unwrap().total, 29);
        assert!(!st.expire(230 * MIN), "nothing more to drop");
        assert!(st.expire(300 * MIN));
        assert_eq!((st.size_bytes(), st.read(win, 300 * MIN).unwrap().total), (0, 0));
    }

    #[test]
    fn full_sketches_stay_within_the_stated_bound() {
        let win = w("1m");
        let mut st = WindowState::new(&[win], true);
        for second in 0..3u64 {
            for i in 0..30_000u64 {
                st.add(HOUR + second * 1_000, 1, &[member_hash(&format!("{second}:{i}"))]);
            }
        }
        let per_bucket = WindowState::bound_bytes(1, true) / BUCKETS_PER_WINDOW as usize;
        assert!(st.size_bytes() <= 3 * per_bucket, "{} > {}", st.size_bytes(), 3 * per_bucket);
        assert!(st.size_bytes() >= 3 * crate::sketch::DENSE_BYTES, "the sketches are dense");
        let e = st.read(win, HOUR + 2_000).unwrap().sketch.unwrap().estimate() as f64;
        assert!((e - 90_000.0).abs() < 90_000.0 * 4.0 * DistinctSketch::relative_error(), "{e}");
    }

    #[test]
    fn a_clock_gone_back_by_more_than_a_window_counts_nothing_there() {
        let win = w("1m");
        let mut st = WindowState::new(&[win], false);
        st.add(10 * MIN, 5, &[]);
        st.add(10 * MIN - 30_000, 3, &[]);
        st.add(8 * MIN, 7, &[]);
        assert_eq!(st.late, 1);
        assert_eq!(st.read(win, 10 * MIN).unwrap().total, 8);
        // A reader whose clock is behind the writer's does not see the future bucket.
        assert_eq!(st.read(win, 10 * MIN - 1).unwrap().total, 3);
    }

    #[test]
    fn shards_merge_to_one_shards_answer() {
        let windows = [w("1m"), w("1h")];
        let mut one = WindowState::new(&windows, true);
        let mut parts: Vec<WindowState> = (0..4).map(|_| WindowState::new(&windows, true)).collect();
        for i in 0..5_000u64 {
            let t = 7 * HOUR + i * 700;
            let h = member_hash(&format!("m{}", i % 1_500));
            one.add(t, 2, &[h]);
            parts[(i % 4) as usize].add(t, 2, &[h]);
        }
        let now = 7 * HOUR + 5_000 * 700;
        for win in windows {
            let want = one.read(win, now).unwrap();
            let mut got = WindowRead::empty(span(win, now), true);
            for p in &parts {
                got.merge(&p.read(win, now).unwrap());
            }
            assert_eq!(got, want, "reads merge exactly");
        }
        // A carry into an empty state is that state, and adds on a second time.
        let mut carried = WindowState::new(&windows, true);
        for p in &parts {
            carried.merge(p);
        }
        assert_eq!(carried.read(w("1h"), now), one.read(w("1h"), now));
    }

    #[test]
    fn a_carry_is_merged_once() {
        let win = w("1m");
        let mut sealed = WindowState::new(&[win], false);
        sealed.add(HOUR, 5, &[]);
        let mut next = WindowState::new(&[win], false);
        assert!(next.carry(&sealed));
        assert!(!next.carry(&sealed), "a repeated carry changes nothing");
        assert_eq!(next.read(win, HOUR).unwrap().total, 5);
        let back = WindowState::from_bytes(&next.to_bytes()).unwrap();
        assert!(back.carried, "the flag is stored");
    }

    #[test]
    fn respec_keeps_what_stays_and_starts_what_is_new() {
        let mut st = WindowState::new(&[w("1m"), w("1h")], true);
        st.add(HOUR, 4, &[member_hash("a")]);
        st.respec(&[w("1h"), w("1d")], false);
        assert_eq!(st.read(w("1h"), HOUR).unwrap().total, 4);
        assert_eq!(st.read(w("1h"), HOUR).unwrap().sketch, None);
        assert_eq!(st.read(w("1d"), HOUR).unwrap().total, 0);
        assert!(st.read(w("1m"), HOUR).is_none());
    }

    #[test]
    fn stored_bytes_round_trip_and_bad_ones_are_refused() {
        let mut st = WindowState::new(&[w("1m"), w("1d")], true);
        for i in 0..100u64 {
            st.add(HOUR + i * 1_000, -3, &[member_hash(&i.to_string())]);
        }
        let bytes = st.to_bytes();
        assert_eq!(WindowState::from_bytes(&bytes), Ok(st.clone()));
        assert!(WindowState::from_bytes(&[]).is_err());
        assert!(WindowState::from_bytes(&[9]).is_err());
        assert!(WindowState::from_bytes(&bytes[..bytes.len() - 1]).is_err());
        let mut wide = st.clone();
        wide.windows[0].buckets.insert(0, Bucket::default());
        assert!(WindowState::from_bytes(&wide.to_bytes()).is_err(), "buckets beyond a window");
        let mut no_distinct = st.clone();
        no_distinct.distinct = false;
        assert!(WindowState::from_bytes(&no_distinct.to_bytes()).is_err());
        let mut bad = st;
        bad.windows[0].window = Window { ms: 61_000 };
        assert!(WindowState::from_bytes(&bad.to_bytes()).is_err());
        // Arbitrary bytes never panic.
        for n in 0..64u8 {
            let junk: Vec<u8> = (0..n).map(|i| i.wrapping_mul(37).wrapping_add(n)).collect();
            let _ = WindowState::from_bytes(&junk);
        }
    }

    mod property {
        use super::*;
        use proptest::prelude::*;

        proptest! {
            /// Increments spread over shards whose clocks only move forward: a read
            /// at or shortly after the last increment is the exact sum of the
            /// increments stamped in its span, whatever shard took them, and the
            /// merged distinct equals one sketch of the span's members.
            #[test]
            fn merged_reads_are_exact_over_their_span(
                steps in proptest::collection::vec((0u64..3_000, -50i64..50, 0u8..4, 0u32..300), 1..300),
                read_after in 0u64..3_000,
            ) {
                let win = Window::parse("1m").unwrap();
                let mut shards: Vec<WindowState> = (0..4).map(|_| WindowState::new(&[win], true)).collect();
                let mut t = 10 * HOUR;
                let mut history = Vec::new();
                for (gap, delta, shard, member) in steps {
                    t += gap;
                    let h = member_hash(&member.to_string());
                    shards[usize::from(shard)].add(t, delta, &[h]);
                    history.push((t, delta, h));
                }
                let now = t + read_after;
                let mut got = WindowRead::empty(span(win, now), true);
                for s in &shards {
                    got.merge(&s.read(win, now).unwrap());
                    prop_assert!(s.windows[0].buckets.len() as u64 <= BUCKETS_PER_WINDOW);
                }
                let mut want_total = 0i128;
                let mut want_sketch = DistinctSketch::new();
                for (at, delta, h) in history {
                    if at >= got.span.start_ms && at <= got.span.end_ms {
                        want_total += i128::from(delta);
                        want_sketch.insert_hash(h);
                    }
                }
                prop_assert_eq!(got.total, want_total);
                prop_assert_eq!(got.sketch, Some(want_sketch));
            }
        }
    }

    #[test]
    fn a_duration_ending_in_a_multi_byte_character_is_refused() {
        for text in ["\u{5ff}", "1\u{5ff}", "é", "5mé"] {
            assert!(Window::parse(text).is_err(), "{text:?}");
        }
    }
}
