//! Per-item frequencies of a counter: a count-min sketch ([`crate::cms`]) for any item's
//! estimate and a heavy-hitters summary ([`crate::topk`]) for the most frequent items.
//!
//! A counter with a [`FrequencySpec`] keeps one [`FrequencySketch`] per shard, in the
//! shard's persisted image, so it is written with the shard's value, recovered after a
//! crash, carried by a hand-off and merged into the next generation by a resharding.
//! Every increment that names an item (or, without one, a member) adds its delta as the
//! item's weight. Reads merge the shards' sketches: count-min tables add cell by cell
//! (fixed seeds, so every shard and node places an item in the same cells) and the
//! summaries merge with their error bounds, so the merge of any grouping of shards is
//! the sketch of all their increments.
//!
//! Weights are positive: a negative delta carrying an item is refused by the engine
//! before it reaches a shard (count-min's guarantee that an estimate is never below the
//! truth, and the summary's bounds, hold only for additions); [`FrequencySketch::add`]
//! ignores one defensively.

use crate::cms::{CmsError, CountMin};
use crate::topk::{HeavyHitters, HeavyHittersError};
use serde::{Deserialize, Serialize};

/// Finest ε accepted: estimates within `10⁻⁴ × total`, a table 27 183 counters wide.
pub const FREQUENCY_EPSILON_MIN: f64 = 1e-4;
/// Coarsest ε accepted: anything wider is useless as an estimate.
pub const FREQUENCY_EPSILON_MAX: f64 = 0.5;
/// Smallest δ accepted: failure probability `10⁻⁶`, 14 rows.
pub const FREQUENCY_DELTA_MIN: f64 = 1e-6;
/// Largest δ accepted.
pub const FREQUENCY_DELTA_MAX: f64 = 0.5;
/// Most count-min counters one shard's sketch may hold (width × depth): 1 MiB of
/// counters in memory per shard. ε and δ that need more are refused.
pub const FREQUENCY_CELLS_MAX: u64 = 1 << 17;
/// Items each shard's heavy-hitters summary keeps: its under-count bound is
/// `total / (FREQUENCY_TOP_CAPACITY + 1)`, and `top` answers at most this many.
pub const FREQUENCY_TOP_CAPACITY: u32 = 256;
/// Largest `k` a top-k read answers.
pub const TOP_K_MAX: u32 = FREQUENCY_TOP_CAPACITY;

/// A counter's frequency option: estimates exceed the truth by more than
/// `epsilon × total weight` with probability at most `delta`.
#[derive(Debug, Clone, Copy, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FrequencySpec {
    /// Relative error bound of an estimate, as a fraction of the total weight.
    pub epsilon: f64,
    /// Probability that an estimate exceeds its bound.
    pub delta: f64,
}

/// Bit-for-bit equality: specs are compared to refuse a change of shape, and validated
/// ones hold no NaN.
impl PartialEq for FrequencySpec {
    fn eq(&self, other: &Self) -> bool {
        self.epsilon.to_bits() == other.epsilon.to_bits() && self.delta.to_bits() == other.delta.to_bits()
    }
}
impl Eq for FrequencySpec {}

/// Why a frequency spec or sketch was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrequencyError {
    /// ε or δ outside its range (or not a number).
    #[error(
        "frequency needs epsilon in [{FREQUENCY_EPSILON_MIN}, {FREQUENCY_EPSILON_MAX}] and delta in \
         [{FREQUENCY_DELTA_MIN}, {FREQUENCY_DELTA_MAX}] (got epsilon {epsilon}, delta {delta})"
    )]
    Bounds {
        /// ε given, formatted (so the error stays `Eq`).
        epsilon: String,
        /// δ given, formatted.
        delta: String,
    },
    /// The table ε and δ need is larger than [`FREQUENCY_CELLS_MAX`].
    #[error(
        "frequency epsilon {epsilon} and delta {delta} need {cells} count-min counters per shard; at most \
         {FREQUENCY_CELLS_MAX} are kept (raise epsilon or delta)"
    )]
    TooLarge {
        /// ε given, formatted.
        epsilon: String,
        /// δ given, formatted.
        delta: String,
        /// Counters needed.
        cells: u64,
    },
    /// The count-min part.
    #[error(transparent)]
    Cms(#[from] CmsError),
    /// The heavy-hitters part.
    #[error(transparent)]
    Top(#[from] HeavyHittersError),
    /// Bytes that are not a sketch.
    #[error(transparent)]
    Decode(#[from] crate::codec::DecodeError),
}

impl FrequencySpec {
    /// Checks ε and δ against their ranges and the table they imply against
    /// [`FREQUENCY_CELLS_MAX`].
    pub fn validate(&self) -> Result<(), FrequencyError> {
        let (e, d) = (self.epsilon, self.delta);
        let in_range = |x: f64, lo: f64, hi: f64| x >= lo && x <= hi; // false for NaN
        if !in_range(e, FREQUENCY_EPSILON_MIN, FREQUENCY_EPSILON_MAX)
            || !in_range(d, FREQUENCY_DELTA_MIN, FREQUENCY_DELTA_MAX)
        {
            return Err(FrequencyError::Bounds { epsilon: e.to_string(), delta: d.to_string() });
        }
        let table = CountMin::with_error(e, d)?;
        let cells = u64::from(table.width()) * u64::from(table.depth());
        if cells > FREQUENCY_CELLS_MAX {
            return Err(FrequencyError::TooLarge { epsilon: e.to_string(), delta: d.to_string(), cells });
        }
        Ok(())
    }
}

/// One shard's (or a merge of shards') frequency state.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct FrequencySketch {
    /// Every item's weight, over-estimated by at most ε·total with probability 1−δ.
    cms: CountMin,
    /// The heaviest items, each under-counted by at most its `undercount`.
    top: HeavyHitters,
    /// Whether the previous generation's sketches were merged into this one (a
    /// resharding does it once, into the next generation's first shard). Count-min
    /// merges add, so a repeated merge would count twice: this makes it idempotent.
    carried: bool,
}

/// An item's estimate, as a read answers it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Estimate {
    /// Count-min estimate: never below the item's true weight.
    pub estimate: u64,
    /// A weight the item certainly has (the summary's count, or 0).
    pub lower_bound: u64,
    /// `ε × total`: the estimate exceeds the truth by at most this, with probability
    /// `1 − δ`.
    pub error_bound: u64,
}

/// One heavy hitter, as a read answers it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TopItem {
    /// The item.
    pub item: String,
    /// Its estimate and bounds.
    pub estimate: Estimate,
}

impl FrequencySketch {
    /// An empty sketch shaped by `spec` (which must be valid).
    pub fn new(spec: &FrequencySpec) -> Result<Self, FrequencyError> {
        spec.validate()?;
        Ok(Self {
            cms: CountMin::with_error(spec.epsilon, spec.delta)?,
            top: HeavyHitters::new(FREQUENCY_TOP_CAPACITY)?,
            carried: false,
        })
    }

    /// Whether this sketch has the shape `spec` implies.
    pub fn fits(&self, spec: &FrequencySpec) -> bool {
        CountMin::with_error(spec.epsilon, spec.delta)
            .map(|c| (c.width(), c.depth()) == (self.cms.width(), self.cms.depth()))
            .unwrap_or(false)
    }

    /// Adds `delta` to `item`'s weight. A non-positive delta is ignored (the engine
    /// refuses negative ones on frequency counters; see the module's doc).
    pub fn add(&mut self, item: &str, delta: i64) {
        let Ok(weight) = u64::try_from(delta) else { return };
        if weight == 0 {
            return;
        }
        self.cms.add(item.as_bytes(), weight);
        self.top.add(item, weight);
    }

    /// Merges `other` into `self`: afterwards `self` is the sketch of both streams.
    /// Different shapes are an error and leave `self` unchanged.
    pub fn merge(&mut self, other: &FrequencySketch) -> Result<(), FrequencyError> {
        let mut cms = self.cms.clone();
        cms.merge(&other.cms)?;
        let mut top = self.top.clone();
        top.merge(&other.top)?;
        self.cms = cms;
        self.top = top;
        Ok(())
    }

    /// Merges the previous generation's union into this sketch, once: a second carry is
    /// ignored. Returns whether anything changed.
    pub fn carry(&mut self, previous: &FrequencySketch) -> Result<bool, FrequencyError> {
        if self.carried {
            return Ok(false);
        }
        self.merge(previous)?;
        self.carried = true;
        Ok(true)
    }

    /// This sketch with every weight multiplied by `weight`: what RedisBloom's
    /// `CMS.MERGE ... WEIGHTS` adds of each source.
    pub fn scaled(&self, weight: u64) -> Self {
        Self { cms: self.cms.scaled(weight), top: self.top.scaled(weight), carried: self.carried }
    }

    /// The count-min table's width and depth.
    pub fn shape(&self) -> (u32, u32) {
        (self.cms.width(), self.cms.depth())
    }

    /// Total weight added.
    pub fn total(&self) -> u64 {
        self.cms.total()
    }

    /// The error bound `ε × total` for this sketch's estimates (`ε` as the table's
    /// width implies it, `e / width`, never above the ε asked for).
    pub fn error_bound(&self, spec: &FrequencySpec) -> u64 {
        (spec.epsilon * self.total() as f64).ceil() as u64
    }

    /// `item`'s estimate and bounds.
    pub fn estimate(&self, item: &str, spec: &FrequencySpec) -> Estimate {
        let estimate = self.cms.estimate(item.as_bytes());
        // The summary's count is a certain lower bound; count-min's never lower.
        let lower_bound = self.top.count(item).min(estimate);
        Estimate { estimate, lower_bound, error_bound: self.error_bound(spec) }
    }

    /// The `k` heaviest items by the summary's counts (ties by item), each with its
    /// count-min estimate. `k` is capped at [`TOP_K_MAX`].
    pub fn top(&self, k: u32, spec: &FrequencySpec) -> Vec<TopItem> {
        let error_bound = self.error_bound(spec);
        self.top
            .top(k.min(TOP_K_MAX) as usize)
            .into_iter()
            .map(|h| {
                let estimate = self.cms.estimate(h.item.as_bytes());
                TopItem {
                    estimate: Estimate { estimate, lower_bound: h.count.min(estimate), error_bound },
                    item: h.item,
                }
            })
            .collect()
    }

    /// The most weight an item missing from [`Self::top`]'s full list may have, and the
    /// most a listed item's count is below its weight.
    pub fn top_undercount(&self) -> u64 {
        self.top.undercount()
    }

    /// Bytes held in memory.
    pub fn size_bytes(&self) -> usize {
        self.cms.size_bytes() + self.top.size_bytes() + std::mem::size_of::<bool>()
    }

    /// The encoded sketch, as stored in a shard image.
    pub fn to_bytes(&self) -> Vec<u8> {
        crate::codec::encode(self)
    }

    /// Decodes [`Self::to_bytes`].
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, FrequencyError> {
        Ok(crate::codec::decode("frequency sketch", bytes)?)
    }
}

#[cfg(test)]
mod scale_tests {
    use super::*;

    #[test]
    fn a_scaled_sketch_is_the_sketch_of_each_increment_counted_that_many_times() {
        let spec = FrequencySpec { epsilon: 0.01, delta: 0.01 };
        let (mut once, mut thrice) =
            (FrequencySketch::new(&spec).unwrap(), FrequencySketch::new(&spec).unwrap());
        for (item, w) in [("a", 5), ("b", 2), ("c", 1)] {
            once.add(item, w);
            thrice.add(item, 3 * w);
        }
        let scaled = once.scaled(3);
        assert_eq!(scaled.total(), thrice.total());
        for item in ["a", "b", "c", "d"] {
            assert_eq!(scaled.estimate(item, &spec), thrice.estimate(item, &spec), "{item}");
        }
        assert_eq!(scaled.top(3, &spec), thrice.top(3, &spec));
        assert_eq!(once.shape(), (272, 5));
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};
    use rand_chacha::ChaCha8Rng;
    use std::collections::BTreeMap;

    const SPEC: FrequencySpec = FrequencySpec { epsilon: 0.001, delta: 0.01 };

    /// A Zipf(1) sampler over `1..=n` by inverse CDF: exact, seeded, no extra crate.
    struct Zipf {
        cdf: Vec<f64>,
    }

    impl Zipf {
        fn new(n: usize) -> Self {
            let mut cdf = Vec::with_capacity(n);
            let mut sum = 0.0;
            for k in 1..=n {
                sum += 1.0 / k as f64;
                cdf.push(sum);
            }
            for c in &mut cdf {
                *c /= sum;
            }
            Self { cdf }
        }
        fn sample(&self, rng: &mut ChaCha8Rng) -> usize {
            let u: f64 = rng.random();
            self.cdf.partition_point(|&c| c < u).min(self.cdf.len() - 1) + 1
        }
    }

    /// 10⁶ unit increments over 10⁵ Zipf-distributed items, spread over 8 shards by
    /// a seeded draw, each shard its own sketch, merged as a read merges them: every
    /// item's estimate is at or above the truth and within ε·total for at least a
    /// 1−δ fraction of items, and the top 10 is the exact top 10, in order.
    #[test]
    fn zipf_stream_estimates_within_bound_and_top_ten_exact() {
        const INCREMENTS: usize = 1_000_000;
        const ITEMS: usize = 100_000;
        const SHARDS: usize = 8;
        let zipf = Zipf::new(ITEMS);
        let mut rng = ChaCha8Rng::seed_from_u64(0x5eed_2026);
        let mut shards: Vec<FrequencySketch> =
            (0..SHARDS).map(|_| FrequencySketch::new(&SPEC).unwrap()).collect();
        let mut truth: BTreeMap<String, u64> = BTreeMap::new();
        let names: Vec<String> = (0..=ITEMS).map(|k| format!("item-{k}")).collect();
        for _ in 0..INCREMENTS {
            let k = zipf.sample(&mut rng);
            let shard = rng.random_range(0..SHARDS);
            shards[shard].add(&names[k], 1);
            *truth.entry(names[k].clone()).or_insert(0) += 1;
        }
        let mut merged = FrequencySketch::new(&SPEC).unwrap();
        for s in &shards {
            merged.merge(s).unwrap();
        }
        assert_eq!(merged.total(), INCREMENTS as u64);
        let bound = merged.error_bound(&SPEC);
        assert_eq!(bound, 1000, "ε × total");
        let mut within = 0usize;
        let mut worst = 0;
        // Every item of the domain, seen or not.
        for name in &names[1..] {
            let t = truth.get(name).copied().unwrap_or(0);
            let e = merged.estimate(name, &SPEC);
            assert!(e.estimate >= t, "{name}: estimate {} below truth {t}", e.estimate);
            assert!(e.lower_bound <= t, "{name}: lower bound {} above truth {t}", e.lower_bound);
            worst = worst.max(e.estimate - t);
            if e.estimate - t <= e.error_bound {
                within += 1;
            }
        }
        let fraction = within as f64 / ITEMS as f64;
        let mut exact: Vec<(&String, &u64)> = truth.iter().collect();
        exact.sort_by(|a, b| b.1.cmp(a.1).then_with(|| a.0.cmp(b.0)));
        let exact_top: Vec<&str> = exact.iter().take(10).map(|(n, _)| n.as_str()).collect();
        let top = merged.top(10, &SPEC);
        let got_top: Vec<&str> = top.iter().map(|t| t.item.as_str()).collect();
        let one = merged.to_bytes().len();
        println!(
            "zipf: {} distinct items seen, bound {bound}, worst over-count {worst}, {:.5} within bound, summary \
             under-count {}, bytes per shard sketch: {} in memory, {} encoded (merged: {one})",
            truth.len(),
            fraction,
            merged.top_undercount(),
            shards[0].size_bytes(),
            shards[0].to_bytes().len(),
        );
        assert!(fraction >= 1.0 - SPEC.delta, "only {fraction} of estimates within their bound");
        assert_eq!(got_top, exact_top);
        for t in &top {
            let truth = truth[&t.item];
            assert!(t.estimate.lower_bound <= truth && truth <= t.estimate.estimate, "{t:?} vs {truth}");
        }
    }

    #[test]
    fn specs_beyond_the_limits_are_refused_with_a_reason() {
        assert_eq!(SPEC.validate(), Ok(()));
        for (epsilon, delta) in
            [(0.0, 0.01), (1e-5, 0.01), (0.6, 0.01), (0.01, 0.0), (0.01, 0.9), (f64::NAN, 0.1)]
        {
            let e = FrequencySpec { epsilon, delta }.validate().unwrap_err();
            assert!(matches!(e, FrequencyError::Bounds { .. }), "({epsilon}, {delta}): {e}");
        }
        // Each bound alone is fine, both together need too large a table.
        let e = FrequencySpec { epsilon: 1e-4, delta: 1e-6 }.validate().unwrap_err();
        assert!(matches!(e, FrequencyError::TooLarge { cells, .. } if cells == 27_183 * 14), "{e}");
        assert!(e.to_string().contains("raise epsilon or delta"), "{e}");
        assert!(FrequencySpec { epsilon: 1e-4, delta: 0.02 }.validate().is_ok());
        assert!(FrequencySpec { epsilon: 0.5, delta: 1e-6 }.validate().is_ok());
    }

    #[test]
    fn carry_merges_once_and_non_positive_weights_are_ignored() {
        let mut prev = FrequencySketch::new(&SPEC).unwrap();
        prev.add("a", 3);
        prev.add("a", -2);
        prev.add("b", 0);
        assert_eq!(prev.total(), 3);
        let mut next = FrequencySketch::new(&SPEC).unwrap();
        next.add("a", 1);
        assert!(next.carry(&prev).unwrap());
        assert!(!next.carry(&prev).unwrap(), "a second carry changes nothing");
        assert_eq!(next.estimate("a", &SPEC).estimate, 4);
        assert_eq!(next.estimate("a", &SPEC).lower_bound, 4);
        let back = FrequencySketch::from_bytes(&next.to_bytes()).unwrap();
        assert_eq!(back, next);
        assert!(FrequencySketch::from_bytes(&[1, 2, 3]).is_err());
    }

    #[test]
    fn sketches_of_other_shapes_do_not_merge() {
        let mut a = FrequencySketch::new(&SPEC).unwrap();
        a.add("x", 1);
        let before = a.clone();
        let other = FrequencySpec { epsilon: 0.01, delta: 0.01 };
        assert!(a.merge(&FrequencySketch::new(&other).unwrap()).is_err());
        assert_eq!(a, before);
        assert!(a.fits(&SPEC) && !a.fits(&other));
    }
}
