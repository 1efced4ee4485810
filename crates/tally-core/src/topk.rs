//! Heavy hitters: the most frequent items of a weighted stream, in bounded space, with
//! a guaranteed error and an exact merge.
//!
//! This is the Misra–Gries summary (1982) in its weighted form, merged as in Agarwal,
//! Cormode, Huang, Phillips, Wei and Yi, *Mergeable Summaries* (PODS 2012, §3.1). It
//! keeps at most `capacity` items with a count each. Adding weight to a kept item adds
//! to its count; a new item takes a free place; when none is free, every count — the
//! newcomer's included — is lowered by the smallest of them, and items that reach zero
//! leave. The total of those lowerings is [`HeavyHitters::undercount`] (`D`):
//!
//! * a kept item's count is never above its true weight, and at most `D` below it;
//! * an item that is not kept has a true weight of at most `D`;
//! * every lowering removes `capacity + 1` times its amount from the summed counts, so
//!   `D ≤ (total − Σ counts) / (capacity + 1) ≤ total / (capacity + 1)`.
//!
//! Two summaries merge by adding their counts; if more than `capacity` items remain,
//! every count is lowered by the `(capacity + 1)`-th largest and the non-positive ones
//! leave. `D` of the merge is `D₁ + D₂ +` that amount, and all three statements above
//! still hold for the concatenated streams (the paper's Theorem 1). No randomness is
//! involved, so shards and nodes merge to the same summary in any grouping of equal
//! order; iteration is over `BTreeMap`s, so the result does not depend on a hasher.
//!
//! Lowering every count on each eviction would cost `capacity` steps; instead counts
//! are stored raised by a common `floor` (a lowering raises the floor), with an index
//! by stored count to find the smallest, so an add costs `O(log capacity)`.

use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};

/// Most items one summary keeps. Its memory is bounded by this times the longest item
/// (`crate::name::MEMBER_LEN_MAX`) plus a few words per item.
pub const HEAVY_HITTERS_CAPACITY_MAX: u32 = 4096;

/// Why a summary could not be built, decoded or merged.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum HeavyHittersError {
    /// Capacity outside `1..=HEAVY_HITTERS_CAPACITY_MAX`.
    #[error("heavy-hitters capacity {capacity} is outside 1..={HEAVY_HITTERS_CAPACITY_MAX}")]
    Capacity {
        /// Capacity asked for.
        capacity: u32,
    },
    /// Merging summaries of different capacities: the error bound would not hold.
    #[error("cannot merge a heavy-hitters summary of capacity {other} into one of {ours}")]
    CapacityMismatch {
        /// Our capacity.
        ours: u32,
        /// The other's.
        other: u32,
    },
    /// A decoded summary that breaks its invariants.
    #[error("heavy-hitters summary is inconsistent: {0}")]
    Inconsistent(&'static str),
}

/// One kept item, as [`HeavyHitters::top`] reports it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Hitter {
    /// The item.
    pub item: String,
    /// Its count: never above the item's true weight, at most `undercount` below it.
    pub count: u64,
}

/// A mergeable Misra–Gries summary of at most `capacity` items.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "HeavyHittersWire", into = "HeavyHittersWire")]
pub struct HeavyHitters {
    /// Most items kept.
    capacity: u32,
    /// Stored count of each kept item: its count plus `floor`.
    stored: BTreeMap<String, u64>,
    /// The kept items by stored count, to find the smallest.
    by_count: BTreeSet<(u64, String)>,
    /// The sum of every lowering so far; stored counts at or below it are zero.
    floor: u64,
    /// `D` inherited from merged summaries (their lowerings are not in `floor`).
    merged_undercount: u64,
    /// Weight added, summed over every item (saturating).
    total: u64,
}

/// The serialized form: counts with the floor taken out, sorted by item.
#[derive(Serialize, Deserialize)]
struct HeavyHittersWire {
    capacity: u32,
    counts: Vec<(String, u64)>,
    undercount: u64,
    total: u64,
}

impl From<HeavyHitters> for HeavyHittersWire {
    fn from(h: HeavyHitters) -> Self {
        let undercount = h.undercount();
        let counts = h.stored.iter().map(|(item, &s)| (item.clone(), s - h.floor)).collect();
        Self { capacity: h.capacity, counts, undercount, total: h.total }
    }
}

impl TryFrom<HeavyHittersWire> for HeavyHitters {
    type Error = HeavyHittersError;
    fn try_from(w: HeavyHittersWire) -> Result<Self, HeavyHittersError> {
        let mut h = Self::new(w.capacity)?;
        if w.counts.len() > w.capacity as usize {
            return Err(HeavyHittersError::Inconsistent("more items than its capacity"));
        }
        for (item, count) in w.counts {
            if count == 0 {
                return Err(HeavyHittersError::Inconsistent("an item with a zero count"));
            }
            if h.stored.insert(item.clone(), count).is_some() {
                return Err(HeavyHittersError::Inconsistent("an item listed twice"));
            }
            h.by_count.insert((count, item));
        }
        h.merged_undercount = w.undercount;
        h.total = w.total;
        Ok(h)
    }
}

impl HeavyHitters {
    /// An empty summary keeping at most `capacity` items.
    pub fn new(capacity: u32) -> Result<Self, HeavyHittersError> {
        if capacity == 0 || capacity > HEAVY_HITTERS_CAPACITY_MAX {
            return Err(HeavyHittersError::Capacity { capacity });
        }
        Ok(Self {
            capacity,
            stored: BTreeMap::new(),
            by_count: BTreeSet::new(),
            floor: 0,
            merged_undercount: 0,
            total: 0,
        })
    }

    /// Most items kept.
    pub fn capacity(&self) -> u32 {
        self.capacity
    }

    /// Weight added, over all items.
    pub fn total(&self) -> u64 {
        self.total
    }

    /// This summary with every weight multiplied by `weight` (saturating): the
    /// summary of the same increments each counted `weight` times, bounds included.
    pub fn scaled(&self, weight: u64) -> Self {
        let mut out = Self::new(self.capacity).expect("capacity was valid");
        out.floor = self.floor.saturating_mul(weight);
        out.merged_undercount = self.merged_undercount.saturating_mul(weight);
        out.total = self.total.saturating_mul(weight);
        for (item, &s) in &self.stored {
            let stored = (s - self.floor).saturating_mul(weight).saturating_add(out.floor);
            out.by_count.insert((stored, item.clone()));
            out.stored.insert(item.clone(), stored);
        }
        out
    }

    /// `D`: the most any item's count is below its true weight, and the most weight an
    /// item that is not kept can have.
    pub fn undercount(&self) -> u64 {
        self.floor.saturating_add(self.merged_undercount)
    }

    /// Adds `weight` to `item`.
    pub fn add(&mut self, item: &str, weight: u64) {
        if weight == 0 {
            return;
        }
        self.total = self.total.saturating_add(weight);
        if let Some(&s) = self.stored.get(item) {
            self.set(item.to_owned(), s, s.saturating_add(weight));
            return;
        }
        let mut weight = weight;
        if self.stored.len() == self.capacity as usize {
            let smallest = self.by_count.first().map_or(0, |(s, _)| s - self.floor);
            // Lower every count, the newcomer's included, by the smallest of them.
            let lowering = smallest.min(weight);
            self.floor += lowering;
            weight -= lowering;
            while let Some((s, _)) = self.by_count.first() {
                if *s > self.floor {
                    break;
                }
                let (_, gone) = self.by_count.pop_first().expect("checked non-empty");
                self.stored.remove(&gone);
            }
        }
        if weight > 0 {
            let s = self.floor.saturating_add(weight);
            self.stored.insert(item.to_owned(), s);
            self.by_count.insert((s, item.to_owned()));
        }
        debug_assert!(self.stored.len() <= self.capacity as usize);
        debug_assert_eq!(self.stored.len(), self.by_count.len());
    }

    /// Replaces `item`'s stored count `old` by `new`.
    fn set(&mut self, item: String, old: u64, new: u64) {
        self.by_count.remove(&(old, item.clone()));
        self.by_count.insert((new, item.clone()));
        self.stored.insert(item, new);
    }

    /// `item`'s count: never above its true weight, at most [`Self::undercount`] below.
    /// Zero for an item not kept.
    pub fn count(&self, item: &str) -> u64 {
        self.stored.get(item).map_or(0, |s| s - self.floor)
    }

    /// The `k` items with the largest counts, largest first (ties by item).
    pub fn top(&self, k: usize) -> Vec<Hitter> {
        let mut all: Vec<Hitter> = self
            .stored
            .iter()
            .map(|(item, &s)| Hitter { item: item.clone(), count: s - self.floor })
            .collect();
        all.sort_by(|a, b| b.count.cmp(&a.count).then_with(|| a.item.cmp(&b.item)));
        all.truncate(k);
        all
    }

    /// Merges `other` into `self` (Agarwal et al.): afterwards `self` summarizes both
    /// streams with every guarantee above. Different capacities are an error and leave
    /// `self` unchanged.
    pub fn merge(&mut self, other: &HeavyHitters) -> Result<(), HeavyHittersError> {
        if self.capacity != other.capacity {
            return Err(HeavyHittersError::CapacityMismatch { ours: self.capacity, other: other.capacity });
        }
        let mut counts: BTreeMap<String, u64> =
            self.stored.iter().map(|(item, &s)| (item.clone(), s - self.floor)).collect();
        for (item, &s) in &other.stored {
            let c = counts.entry(item.clone()).or_insert(0);
            *c = c.saturating_add(s - other.floor);
        }
        let mut lowering = 0;
        if counts.len() > self.capacity as usize {
            let mut sorted: Vec<u64> = counts.values().copied().collect();
            sorted.sort_unstable_by(|a, b| b.cmp(a));
            lowering = sorted[self.capacity as usize];
        }
        let undercount = self.undercount().saturating_add(other.undercount()).saturating_add(lowering);
        let total = self.total.saturating_add(other.total);
        let capacity = self.capacity;
        *self = Self::new(capacity).expect("capacity was valid");
        for (item, c) in counts {
            if c > lowering {
                let s = c - lowering;
                self.by_count.insert((s, item.clone()));
                self.stored.insert(item, s);
            }
        }
        self.merged_undercount = undercount;
        self.total = total;
        debug_assert!(self.stored.len() <= self.capacity as usize);
        Ok(())
    }

    /// Bytes held: the structure, each kept item twice (map and index) and its words.
    pub fn size_bytes(&self) -> usize {
        let per_item = 2 * (std::mem::size_of::<String>() + std::mem::size_of::<u64>());
        std::mem::size_of::<Self>() + self.stored.keys().map(|k| 2 * k.len() + per_item).sum::<usize>()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    /// Checks every guarantee of `h` against the true weights.
    fn check(h: &HeavyHitters, truth: &BTreeMap<String, u64>) {
        let d = h.undercount();
        let total: u64 = truth.values().sum();
        assert_eq!(h.total(), total);
        let counted: u64 = h.stored.values().map(|s| s - h.floor).sum();
        assert!(d <= (total - counted) / (u64::from(h.capacity) + 1), "D {d} beyond its bound");
        for (item, &w) in truth {
            let c = h.count(item);
            assert!(c <= w, "{item}: count {c} above weight {w}");
            assert!(w - c <= d, "{item}: count {c} more than D {d} below weight {w}");
        }
        assert!(h.stored.len() <= h.capacity as usize);
    }

    #[test]
    fn keeps_exact_counts_while_there_is_room() {
        let mut h = HeavyHitters::new(3).unwrap();
        h.add("a", 5);
        h.add("b", 2);
        h.add("a", 1);
        assert_eq!((h.count("a"), h.count("b"), h.undercount()), (6, 2, 0));
        assert_eq!(h.top(1), vec![Hitter { item: "a".into(), count: 6 }]);
    }

    #[test]
    fn a_newcomer_lowers_every_count_by_the_smallest() {
        let mut h = HeavyHitters::new(2).unwrap();
        h.add("a", 5);
        h.add("b", 2);
        h.add("c", 3); // lowers by 2: a 3, b gone, c 1
        assert_eq!((h.count("a"), h.count("b"), h.count("c"), h.undercount()), (3, 0, 1, 2));
        h.add("d", 1); // lowers by 1: a 2, c gone, d absorbed
        assert_eq!((h.count("a"), h.count("c"), h.count("d"), h.undercount()), (2, 0, 0, 3));
        assert_eq!(h.stored.len(), 1);
    }

    #[test]
    fn merge_lowers_by_the_capacity_plus_first_count() {
        let mut a = HeavyHitters::new(2).unwrap();
        a.add("x", 10);
        a.add("y", 4);
        let mut b = HeavyHitters::new(2).unwrap();
        b.add("z", 6);
        b.add("y", 1);
        a.merge(&b).unwrap();
        // x 10, z 6, y 5: lowered by the third largest, 5.
        assert_eq!((a.count("x"), a.count("z"), a.count("y"), a.undercount()), (5, 1, 0, 5));
        assert_eq!(a.total(), 21);
    }

    #[test]
    fn capacities_are_bounded_and_must_match_to_merge() {
        assert_eq!(HeavyHitters::new(0), Err(HeavyHittersError::Capacity { capacity: 0 }));
        assert!(HeavyHitters::new(HEAVY_HITTERS_CAPACITY_MAX + 1).is_err());
        let mut a = HeavyHitters::new(4).unwrap();
        a.add("x", 1);
        let before = a.clone();
        assert_eq!(
            a.merge(&HeavyHitters::new(5).unwrap()),
            Err(HeavyHittersError::CapacityMismatch { ours: 4, other: 5 })
        );
        assert_eq!(a, before);
    }

    #[test]
    fn serde_round_trips_and_refuses_inconsistent_summaries() {
        let mut h = HeavyHitters::new(2).unwrap();
        for (item, w) in [("a", 5), ("b", 2), ("c", 3), ("a", 1)] {
            h.add(item, w);
        }
        let bytes = crate::codec::encode(&h);
        let back: HeavyHitters = crate::codec::decode("top", &bytes).unwrap();
        assert_eq!(back.top(10), h.top(10));
        assert_eq!((back.undercount(), back.total()), (h.undercount(), h.total()));
        for counts in
            [vec![("a".to_owned(), 1), ("b".to_owned(), 1), ("c".to_owned(), 1)], vec![("a".into(), 0)]]
        {
            let wire = HeavyHittersWire { capacity: 2, counts, undercount: 0, total: 3 };
            assert!(crate::codec::decode::<HeavyHitters>("top", &crate::codec::encode(&wire)).is_err());
        }
    }

    proptest! {
        /// Any stream, split anywhere into two summaries and merged, keeps every
        /// guarantee for the whole stream, as does the summary of the whole stream.
        #[test]
        fn guarantees_hold_for_streams_and_merges(
            capacity in 1u32..6,
            stream in proptest::collection::vec((0u8..12, 1u64..20), 0..200),
            split in 0usize..200,
        ) {
            let split = split.min(stream.len());
            let mut whole = HeavyHitters::new(capacity).unwrap();
            let mut left = HeavyHitters::new(capacity).unwrap();
            let mut right = HeavyHitters::new(capacity).unwrap();
            let mut truth = BTreeMap::new();
            for (i, (item, w)) in stream.iter().enumerate() {
                let item = format!("i{item}");
                whole.add(&item, *w);
                if i < split { left.add(&item, *w) } else { right.add(&item, *w) }
                *truth.entry(item).or_insert(0) += w;
            }
            check(&whole, &truth);
            left.merge(&right).unwrap();
            check(&left, &truth);
        }
    }
}
