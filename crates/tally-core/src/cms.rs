//! Count-min sketch: per-item frequency in fixed space, mergeable across nodes.
//!
//! A `depth × width` table of counters. Adding an item adds its count to one counter
//! per row, chosen by that row's hash; the estimate is the smallest of those counters.
//! Collisions only ever add, so the estimate never falls below the true count, and
//! with `width = ⌈e/ε⌉` and `depth = ⌈ln(1/δ)⌉` it exceeds it by more than `ε·total`
//! with probability at most `δ` (Cormode & Muthukrishnan, 2005).
//!
//! Two sketches of the same shape merge by adding their tables, which is exactly the
//! sketch of the concatenated streams — but only if both placed every item in the same
//! columns. So the row hashes use *fixed* seeds derived from the row number (the
//! `count-min-sketch` crate draws a random key per instance and cannot merge), and the
//! column comes from [`hash64`] (XXH3-64) and [`reduce`], identical on every node,
//! process and build.

use crate::hash::{hash64, reduce};
use serde::{Deserialize, Serialize};

/// Widest table accepted, in counters per row: ε down to `e / 65536` ≈ 4·10⁻⁵ of the
/// total, at 512 KiB per row.
pub const CMS_WIDTH_MAX: u32 = 1 << 16;

/// Deepest table accepted, in rows: δ down to `e^-16` ≈ 10⁻⁷. Each row costs one hash
/// per add and per estimate.
pub const CMS_DEPTH_MAX: u32 = 16;

/// Base seed of the row hashes ("tallycms"); row `i` hashes with
/// `hash64(CMS_SEED, i as LE bytes)`. Part of the sketch's meaning: changing it makes
/// stored sketches unmergeable with new ones.
pub const CMS_SEED: u64 = 0x7461_6c6c_7963_6d73;

/// `1/e`, to size the depth by repeated multiplication instead of a logarithm, so the
/// shape derived from (ε, δ) is bit-identical on every platform.
const INV_E: f64 = 0.367_879_441_171_442_33;

/// `e`, to size the width from ε.
const E: f64 = std::f64::consts::E;

/// Why a count-min sketch could not be built, decoded or merged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum CmsError {
    /// Width outside `1..=CMS_WIDTH_MAX`.
    #[error("count-min width {width} is outside 1..={CMS_WIDTH_MAX}")]
    Width {
        /// Width asked for.
        width: u64,
    },
    /// Depth outside `1..=CMS_DEPTH_MAX`.
    #[error("count-min depth {depth} is outside 1..={CMS_DEPTH_MAX}")]
    Depth {
        /// Depth asked for.
        depth: u64,
    },
    /// ε or δ not strictly between 0 and 1.
    #[error("count-min error bounds must lie strictly between 0 and 1 (epsilon {epsilon}, delta {delta})")]
    Bounds {
        /// Relative over-count bound asked for, formatted (so the error stays `Eq`).
        epsilon: String,
        /// Failure probability asked for, formatted.
        delta: String,
    },
    /// Merging sketches of different shapes: their counters do not correspond.
    #[error("cannot merge a {other_width}x{other_depth} count-min into a {width}x{depth} one")]
    ShapeMismatch {
        /// Our width.
        width: u32,
        /// Our depth.
        depth: u32,
        /// The other's width.
        other_width: u32,
        /// The other's depth.
        other_depth: u32,
    },
    /// Decoded counters that do not fill `width × depth`.
    #[error("count-min has {len} counters; width x depth is {expected}")]
    CounterCount {
        /// Counters present.
        len: usize,
        /// Counters the shape implies.
        expected: usize,
    },
}

/// A count-min sketch with fixed row seeds: estimates how often each item was added,
/// never below the truth, and merges with any sketch of the same shape.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "CountMinWire")]
pub struct CountMin {
    /// Counters per row; each row's hash maps an item onto `0..width`.
    width: u32,
    /// Rows, each an independent hash; the estimate is the minimum over them.
    depth: u32,
    /// `depth` rows of `width` counters, row-major.
    counters: Vec<u64>,
}

/// The serialized fields, checked before they become a [`CountMin`].
#[derive(Deserialize)]
struct CountMinWire {
    /// See [`CountMin::width`].
    width: u32,
    /// See [`CountMin::depth`].
    depth: u32,
    /// See [`CountMin::counters`].
    counters: Vec<u64>,
}

impl TryFrom<CountMinWire> for CountMin {
    type Error = CmsError;
    fn try_from(wire: CountMinWire) -> Result<Self, CmsError> {
        check_shape(u64::from(wire.width), u64::from(wire.depth))?;
        let expected = wire.width as usize * wire.depth as usize;
        if wire.counters.len() != expected {
            return Err(CmsError::CounterCount { len: wire.counters.len(), expected });
        }
        Ok(Self { width: wire.width, depth: wire.depth, counters: wire.counters })
    }
}

/// Refuses widths and depths outside their named bounds.
fn check_shape(width: u64, depth: u64) -> Result<(), CmsError> {
    if width == 0 || width > u64::from(CMS_WIDTH_MAX) {
        return Err(CmsError::Width { width });
    }
    if depth == 0 || depth > u64::from(CMS_DEPTH_MAX) {
        return Err(CmsError::Depth { depth });
    }
    Ok(())
}

impl CountMin {
    /// An all-zero sketch of `depth` rows of `width` counters.
    pub fn new(width: u32, depth: u32) -> Result<Self, CmsError> {
        check_shape(u64::from(width), u64::from(depth))?;
        Ok(Self { width, depth, counters: vec![0; width as usize * depth as usize] })
    }

    /// The smallest sketch whose estimates exceed the truth by more than
    /// `epsilon × total` with probability at most `delta`: width `⌈e/ε⌉`, depth
    /// `⌈ln(1/δ)⌉`. Every node derives the same shape from the same (ε, δ).
    pub fn with_error(epsilon: f64, delta: f64) -> Result<Self, CmsError> {
        let valid = |x: f64| x > 0.0 && x < 1.0;
        if !valid(epsilon) || !valid(delta) {
            return Err(CmsError::Bounds { epsilon: epsilon.to_string(), delta: delta.to_string() });
        }
        // Saturating conversion: anything beyond u64 is refused by check_shape anyway.
        let width = (E / epsilon).ceil() as u64;
        // Smallest depth with e^-depth <= delta; stops one past the bound at worst.
        let mut depth = 0u64;
        let mut failure = 1.0;
        while failure > delta && depth <= u64::from(CMS_DEPTH_MAX) {
            failure *= INV_E;
            depth += 1;
        }
        check_shape(width, depth)?;
        Self::new(width as u32, depth as u32)
    }

    /// This sketch with every count multiplied by `weight` (saturating).
    pub fn scaled(&self, weight: u64) -> Self {
        let mut out = self.clone();
        out.counters.iter_mut().for_each(|c| *c = c.saturating_mul(weight));
        out
    }

    /// Counters per row.
    pub fn width(&self) -> u32 {
        self.width
    }

    /// Number of rows.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// Adds `count` occurrences of `item`. Counters saturate at `u64::MAX` rather than
    /// wrap, so an estimate can stick at the top but never drops below the truth.
    pub fn add(&mut self, item: &[u8], count: u64) {
        for row in 0..self.depth {
            let at = self.cell(row, item);
            self.counters[at] = self.counters[at].saturating_add(count);
        }
    }

    /// Estimated occurrences of `item`: at least the true count; above it by at most
    /// `epsilon × total` with probability `1 − delta`.
    pub fn estimate(&self, item: &[u8]) -> u64 {
        (0..self.depth).map(|row| self.counters[self.cell(row, item)]).min().unwrap_or(0)
    }

    /// Adds `other`'s counters into ours. Afterwards `self` equals the sketch of both
    /// streams concatenated (up to saturation). Different shapes are an error and leave
    /// `self` unchanged.
    pub fn merge(&mut self, other: &CountMin) -> Result<(), CmsError> {
        if (self.width, self.depth) != (other.width, other.depth) {
            return Err(CmsError::ShapeMismatch {
                width: self.width,
                depth: self.depth,
                other_width: other.width,
                other_depth: other.depth,
            });
        }
        for (ours, &theirs) in self.counters.iter_mut().zip(&other.counters) {
            *ours = ours.saturating_add(theirs);
        }
        Ok(())
    }

    /// Sum of all counts added (saturating): every add touches exactly one counter per
    /// row, so any row sums to it. The `total` that bounds the over-count.
    pub fn total(&self) -> u64 {
        self.counters[..self.width as usize].iter().fold(0u64, |sum, &c| sum.saturating_add(c))
    }

    /// Bytes of counters held, for the memory report.
    pub fn size_bytes(&self) -> usize {
        std::mem::size_of::<Self>() + self.counters.len() * std::mem::size_of::<u64>()
    }

    /// Index of `item`'s counter in `row`.
    fn cell(&self, row: u32, item: &[u8]) -> usize {
        let column = reduce(hash64(row_seed(row), item), u64::from(self.width));
        row as usize * self.width as usize + column as usize
    }
}

/// The fixed seed of row `row`'s hash.
fn row_seed(row: u32) -> u64 {
    hash64(CMS_SEED, &row.to_le_bytes())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::collections::BTreeMap;

    /// `(item, count)` adds in stream order.
    type Stream = Vec<(Vec<u8>, u64)>;

    /// A skewed stream: item `k` (for `k` in `1..=items`) occurs `heaviest / k` times,
    /// interleaved deterministically. Returns the stream and the true counts.
    fn zipf_stream(items: u64, heaviest: u64) -> (Stream, BTreeMap<Vec<u8>, u64>) {
        let mut stream = Vec::new();
        let mut truth = BTreeMap::new();
        for k in 1..=items {
            let item = format!("item-{k}").into_bytes();
            let n = (heaviest / k).max(1);
            // Split each item's count into a few adds of varying size.
            let mut left = n;
            let mut part = 1;
            while left > 0 {
                let c = left.min(part);
                stream.push((item.clone(), c));
                left -= c;
                part *= 3;
            }
            truth.insert(item, n);
        }
        // Interleave: order by a hash of position so adds of one item are spread out.
        let mut keyed: Vec<(u64, (Vec<u8>, u64))> =
            stream.into_iter().enumerate().map(|(i, x)| (hash64(1, &(i as u64).to_le_bytes()), x)).collect();
        keyed.sort_by_key(|(k, _)| *k);
        (keyed.into_iter().map(|(_, x)| x).collect(), truth)
    }

    fn sketch(stream: &[(Vec<u8>, u64)], epsilon: f64, delta: f64) -> CountMin {
        let mut cms = CountMin::with_error(epsilon, delta).unwrap();
        for (item, count) in stream {
            cms.add(item, *count);
        }
        cms
    }

    #[test]
    fn never_underestimates_and_overcounts_within_epsilon_total() {
        let (stream, truth) = zipf_stream(20_000, 100_000);
        let (epsilon, delta) = (0.001, 0.01);
        let cms = sketch(&stream, epsilon, delta);
        let total: u64 = truth.values().sum();
        assert_eq!(cms.total(), total);
        let bound = (epsilon * total as f64) as u64;
        let mut over_bound = 0;
        let mut worst = 0;
        for (item, &n) in &truth {
            let e = cms.estimate(item);
            assert!(e >= n, "underestimate {e} < {n}");
            worst = worst.max(e - n);
            if e - n > bound {
                over_bound += 1;
            }
        }
        // Items never added are bounded the same way.
        for k in 0..1_000 {
            let e = cms.estimate(format!("absent-{k}").as_bytes());
            if e > bound {
                over_bound += 1;
            }
        }
        let checked = truth.len() + 1_000;
        println!(
            "count-min {}x{}: total {total}, bound {bound}, worst over-count {worst}, {over_bound}/{checked} over bound",
            cms.width(),
            cms.depth()
        );
        assert!((over_bound as f64) <= delta * checked as f64, "{over_bound} items over bound");
    }

    #[test]
    fn merge_equals_the_sketch_of_the_concatenated_streams() {
        let (stream, _) = zipf_stream(5_000, 20_000);
        let (a, b) = stream.split_at(stream.len() / 3);
        let whole = sketch(&stream, 0.01, 0.01);
        let mut left = sketch(a, 0.01, 0.01);
        let right = sketch(b, 0.01, 0.01);
        left.merge(&right).unwrap();
        assert_eq!(left, whole);
        let mut other_way = sketch(b, 0.01, 0.01);
        other_way.merge(&sketch(a, 0.01, 0.01)).unwrap();
        assert_eq!(other_way, whole);
    }

    #[test]
    fn shape_mismatch_is_an_error_and_changes_nothing() {
        let mut a = CountMin::new(100, 4).unwrap();
        a.add(b"x", 3);
        let before = a.clone();
        let b = CountMin::new(100, 5).unwrap();
        assert_eq!(
            a.merge(&b),
            Err(CmsError::ShapeMismatch { width: 100, depth: 4, other_width: 100, other_depth: 5 })
        );
        assert!(a.merge(&CountMin::new(101, 4).unwrap()).is_err());
        assert_eq!(a, before);
    }

    #[test]
    fn shape_limits_are_enforced() {
        assert_eq!(CountMin::new(0, 4), Err(CmsError::Width { width: 0 }));
        assert_eq!(
            CountMin::new(CMS_WIDTH_MAX + 1, 4),
            Err(CmsError::Width { width: u64::from(CMS_WIDTH_MAX) + 1 })
        );
        assert_eq!(CountMin::new(10, 0), Err(CmsError::Depth { depth: 0 }));
        assert_eq!(
            CountMin::new(10, CMS_DEPTH_MAX + 1),
            Err(CmsError::Depth { depth: u64::from(CMS_DEPTH_MAX) + 1 })
        );
        assert!(CountMin::new(CMS_WIDTH_MAX, CMS_DEPTH_MAX).is_ok());
        for (e, d) in
            [(0.0, 0.1), (1.0, 0.1), (0.1, 0.0), (0.1, 1.0), (f64::NAN, 0.1), (0.1, f64::NAN), (-1.0, 0.5)]
        {
            assert!(matches!(CountMin::with_error(e, d), Err(CmsError::Bounds { .. })), "({e}, {d})");
        }
        // Too fine an epsilon or too small a delta needs a table beyond the bounds.
        assert!(matches!(CountMin::with_error(1e-9, 0.1), Err(CmsError::Width { .. })));
        assert!(matches!(CountMin::with_error(0.1, 1e-12), Err(CmsError::Depth { .. })));
    }

    #[test]
    fn with_error_sizes_as_documented() {
        let cms = CountMin::with_error(0.001, 0.01).unwrap();
        assert_eq!(cms.width(), 2719); // ⌈e / 0.001⌉
        assert_eq!(cms.depth(), 5); // ⌈ln 100⌉ = ⌈4.605⌉
        let cms = CountMin::with_error(0.5, 0.5).unwrap();
        assert_eq!((cms.width(), cms.depth()), (6, 1));
        assert_eq!(CountMin::with_error(0.01, 0.4).unwrap().depth(), 1);
    }

    #[test]
    fn counters_saturate_instead_of_wrapping() {
        let mut cms = CountMin::new(8, 3).unwrap();
        cms.add(b"hot", u64::MAX - 1);
        cms.add(b"hot", 5);
        assert_eq!(cms.estimate(b"hot"), u64::MAX);
        assert_eq!(cms.total(), u64::MAX);
        let mut other = cms.clone();
        other.merge(&cms).unwrap();
        assert_eq!(other.estimate(b"hot"), u64::MAX);
    }

    #[test]
    fn empty_sketch_estimates_zero() {
        let cms = CountMin::with_error(0.01, 0.01).unwrap();
        assert_eq!(cms.estimate(b"anything"), 0);
        assert_eq!(cms.total(), 0);
    }

    #[test]
    fn serde_round_trips_and_validates_shape() {
        let mut cms = CountMin::new(64, 3).unwrap();
        cms.add(b"a", 7);
        let bytes = crate::codec::encode(&cms);
        assert_eq!(crate::codec::decode::<CountMin>("cms", &bytes), Ok(cms.clone()));
        let bad = CountMin { width: 64, depth: 4, counters: cms.counters.clone() };
        assert!(crate::codec::decode::<CountMin>("cms", &crate::codec::encode(&bad)).is_err());
        let bad = CountMin { width: 0, depth: 0, counters: Vec::new() };
        assert!(crate::codec::decode::<CountMin>("cms", &crate::codec::encode(&bad)).is_err());
    }

    #[test]
    fn placement_is_pinned() {
        // Sketches from different builds only merge if items land in the same columns.
        let cms = CountMin::new(1000, 4).unwrap();
        let columns: Vec<usize> = (0..4).map(|r| cms.cell(r, b"item-1") % 1000).collect();
        assert_eq!(columns, PINNED_COLUMNS);
    }

    const PINNED_COLUMNS: [usize; 4] = [277, 191, 44, 394];
}
