//! A resharding's coordination as a state machine: which shards must still be
//! sealed, what the sealed generation sums to, whose sketches carry into the next
//! generation and where, and when the next generation may open.
//!
//! The steps are those of [`crate::meta`]'s resharding by generations: seal every
//! shard of the current generation (each answers its final image), merge their
//! sketches into the first shard of the next generation (only if any has one), then
//! `CompleteReshard` with the sealed sum. Every step may be repeated: sealing a sealed
//! shard answers the same image, merging a sketch twice changes nothing, and a second
//! completion is refused by the metadata.
//!
//! The engine's resharding task carries the effects out one after another; the
//! simulator's control plane sends them as messages and resends what is outstanding
//! ([`ReshardInput::Outstanding`]) until answered. Both run this machine.

use crate::frequency::{FrequencyError, FrequencySketch};
use crate::meta::Layout;
use crate::shard::ShardImage;
use crate::sketch::{DistinctSketch, SketchError};
use crate::window::WindowState;
use crate::{CounterName, ShardId};
use std::collections::BTreeMap;

/// Why a sealed image cannot be carried into the next generation.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ReshardError {
    /// Its distinct sketch does not decode.
    #[error("a sealed shard's sketch does not decode: {0}")]
    Sketch(#[from] SketchError),
    /// Its frequency sketch does not decode, or does not merge with the others.
    #[error("a sealed shard's frequency sketch cannot be carried: {0}")]
    Frequency(#[from] FrequencyError),
    /// Its window buckets do not decode.
    #[error("a sealed shard's window buckets cannot be carried: {0}")]
    Windows(#[from] crate::codec::DecodeError),
}

/// What happened to a resharding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReshardInput {
    /// Shard `index` of the sealed generation is sealed with this final image.
    Sealed {
        /// The shard's index.
        index: u16,
        /// Its final image.
        image: ShardImage,
    },
    /// The sealed generation's sketches are merged into the next generation.
    Merged,
    /// What is still outstanding? (The first question, and every resend.)
    Outstanding,
}

/// One thing to do for a resharding.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ReshardEffect {
    /// Seal this shard and answer [`ReshardInput::Sealed`] with its final image.
    Seal(ShardId),
    /// Merge these encoded sketches into `shard` (the next generation's first shard)
    /// and answer [`ReshardInput::Merged`]. At least one is present.
    MergeSketch {
        /// Where.
        shard: ShardId,
        /// The union of the sealed shards' distinct sketches.
        sketch: Option<Vec<u8>>,
        /// The merge of the sealed shards' frequency sketches, carried once.
        frequency: Option<Vec<u8>>,
        /// The bucket-wise merge of the sealed shards' window buckets, carried once
        /// ([`crate::window::WindowState::to_bytes`]).
        windows: Option<Vec<u8>>,
    },
    /// Every shard is sealed (and its sketches carried over): open the next
    /// generation with `MetaCommand::CompleteReshard`.
    Complete {
        /// The sealed generation.
        generation: u32,
        /// The sum of its final values.
        sealed_sum: i128,
    },
}

/// One resharding in progress.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ReshardMachine {
    counter: CounterName,
    /// The replica class of the counter's shards ([`ShardId::replicas`]).
    class: u8,
    generation: u32,
    shards: u16,
    images: BTreeMap<u16, ShardImage>,
    merged: bool,
}

impl ReshardMachine {
    /// The resharding of `counter` with `layout`, if one is in progress.
    pub fn new(counter: CounterName, layout: &Layout) -> Option<Self> {
        layout.resharding?;
        Some(Self {
            counter,
            class: crate::ids::CLUSTER_REPLICAS,
            generation: layout.generation,
            shards: layout.shards,
            images: BTreeMap::new(),
            merged: false,
        })
    }

    /// The same resharding of a counter whose shards are of replica class `class`.
    pub fn in_class(self, class: u8) -> Self {
        Self { class, ..self }
    }

    /// Shard `index` of generation `generation` of the counter.
    pub fn shard(&self, generation: u32, index: u16) -> ShardId {
        ShardId::new(self.counter.clone(), generation, index).in_class(self.class)
    }

    /// The generation being sealed.
    pub fn generation(&self) -> u32 {
        self.generation
    }

    /// Takes one input; returns what is now to do. After `Sealed` and `Merged` that is
    /// only what they made due (the merge once the last shard is sealed, the
    /// completion once nothing else is outstanding); after `Outstanding`, everything
    /// not yet answered. A sealed image whose sketch does not decode is an error: the
    /// resharding cannot carry its members over.
    pub fn step(&mut self, input: ReshardInput) -> Result<Vec<ReshardEffect>, ReshardError> {
        let effects = self.take(input);
        self.check(effects.as_deref().unwrap_or_default());
        effects
    }

    /// The invariants after every step, checked in production too: only the sealed
    /// generation's shards are sealed, each once; sketches merge only once every
    /// shard is sealed, into the next generation; and the completion names the
    /// sealed generation and comes only once every shard is sealed and merged.
    fn check(&self, effects: &[ReshardEffect]) {
        assert!(self.images.len() <= usize::from(self.shards), "more sealed images than shards");
        assert!(self.images.keys().all(|i| *i < self.shards), "an image of a shard the generation lacks");
        let all_sealed = self.images.len() == usize::from(self.shards);
        assert!(!self.merged || all_sealed, "merged before every shard was sealed");
        for effect in effects {
            match effect {
                ReshardEffect::Seal(id) => {
                    assert!(id.generation == self.generation && id.index < self.shards, "sealing {id}");
                }
                ReshardEffect::MergeSketch { shard, .. } => {
                    assert!(all_sealed && !self.merged, "a merge before sealing ended, or twice");
                    assert_eq!(shard.generation, self.generation + 1, "a merge outside the next generation");
                }
                ReshardEffect::Complete { generation, .. } => {
                    assert!(all_sealed, "completed before every shard was sealed");
                    assert_eq!(*generation, self.generation, "completed another generation");
                }
            }
        }
    }

    fn take(&mut self, input: ReshardInput) -> Result<Vec<ReshardEffect>, ReshardError> {
        match input {
            ReshardInput::Sealed { index, image } => {
                if index >= self.shards || self.images.contains_key(&index) {
                    return Ok(Vec::new());
                }
                if let Some(bytes) = &image.sketch {
                    DistinctSketch::from_bytes(bytes)?;
                }
                image.decode_frequency()?;
                image.decode_windows()?;
                self.images.insert(index, image);
                if self.images.len() < usize::from(self.shards) {
                    return Ok(Vec::new());
                }
                self.after_sealing()
            }
            ReshardInput::Merged => {
                if self.images.len() < usize::from(self.shards) || self.merged {
                    return Ok(Vec::new());
                }
                self.merged = true;
                self.after_sealing()
            }
            ReshardInput::Outstanding => {
                let unsealed: Vec<ReshardEffect> = (0..self.shards)
                    .filter(|i| !self.images.contains_key(i))
                    .map(|i| ReshardEffect::Seal(self.shard(self.generation, i)))
                    .collect();
                if !unsealed.is_empty() {
                    return Ok(unsealed);
                }
                self.after_sealing()
            }
        }
    }

    /// With every shard sealed: the merge, unless done or not needed; then the
    /// completion.
    fn after_sealing(&self) -> Result<Vec<ReshardEffect>, ReshardError> {
        let mut union: Option<DistinctSketch> = None;
        for bytes in self.images.values().filter_map(|i| i.sketch.as_ref()) {
            union.get_or_insert_with(DistinctSketch::new).merge(&DistinctSketch::from_bytes(bytes)?);
        }
        let mut frequency: Option<FrequencySketch> = None;
        for image in self.images.values() {
            if let Some(f) = image.decode_frequency()? {
                match frequency.as_mut() {
                    None => frequency = Some(f),
                    Some(all) => all.merge(&f)?,
                }
            }
        }
        let mut windows: Option<WindowState> = None;
        for image in self.images.values() {
            if let Some(w) = image.decode_windows()? {
                match windows.as_mut() {
                    None => windows = Some(w),
                    Some(all) => all.merge(&w),
                }
            }
        }
        if (union.is_some() || frequency.is_some() || windows.is_some()) && !self.merged {
            let shard = self.shard(self.generation + 1, 0);
            return Ok(vec![ReshardEffect::MergeSketch {
                shard,
                sketch: union.map(|u| u.to_bytes()),
                frequency: frequency.map(|f| f.to_bytes()),
                windows: windows.map(|w| w.to_bytes()),
            }]);
        }
        let sealed_sum = self.images.values().map(|i| i128::from(i.value)).sum();
        Ok(vec![ReshardEffect::Complete { generation: self.generation, sealed_sum }])
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::sketch::member_hash;

    fn layout(generation: u32, shards: u16, resharding: Option<u16>) -> Layout {
        Layout { generation, shards, base: 0, sealed: Vec::new(), resharding }
    }

    fn name() -> CounterName {
        CounterName::new("c").unwrap()
    }

    #[test]
    #[should_panic(expected = "merged before every shard was sealed")]
    fn a_merge_recorded_before_sealing_ended_breaks_the_invariant() {
        let mut m = ReshardMachine::new(name(), &layout(3, 2, Some(4))).unwrap();
        m.merged = true;
        let _ = m.step(ReshardInput::Outstanding);
    }

    fn image(value: i64, member: Option<&str>) -> ShardImage {
        let sketch = member.map(|m| {
            let mut s = DistinctSketch::new();
            s.insert_hash(member_hash(m));
            s.to_bytes()
        });
        ShardImage { value, sketch, frequency: None, windows: None, escrow: None }
    }

    #[test]
    fn no_resharding_no_machine() {
        assert!(ReshardMachine::new(name(), &layout(0, 4, None)).is_none());
    }

    #[test]
    fn seal_every_shard_then_complete_with_their_sum() {
        let mut m = ReshardMachine::new(name(), &layout(3, 2, Some(5))).unwrap();
        assert_eq!(m.generation(), 3);
        assert_eq!(
            m.step(ReshardInput::Outstanding).unwrap(),
            vec![
                ReshardEffect::Seal(ShardId::new(name(), 3, 0)),
                ReshardEffect::Seal(ShardId::new(name(), 3, 1))
            ]
        );
        assert_eq!(m.step(ReshardInput::Sealed { index: 1, image: image(-4, None) }).unwrap(), vec![]);
        assert_eq!(
            m.step(ReshardInput::Outstanding).unwrap(),
            vec![ReshardEffect::Seal(ShardId::new(name(), 3, 0))],
            "only what is not answered is resent"
        );
        // An answer twice, or for a shard the generation does not have, changes nothing.
        assert_eq!(m.step(ReshardInput::Sealed { index: 1, image: image(99, None) }).unwrap(), vec![]);
        assert_eq!(m.step(ReshardInput::Sealed { index: 7, image: image(99, None) }).unwrap(), vec![]);
        assert_eq!(
            m.step(ReshardInput::Sealed { index: 0, image: image(10, None) }).unwrap(),
            vec![ReshardEffect::Complete { generation: 3, sealed_sum: 6 }]
        );
        assert_eq!(
            m.step(ReshardInput::Outstanding).unwrap(),
            vec![ReshardEffect::Complete { generation: 3, sealed_sum: 6 }]
        );
    }

    #[test]
    fn sketches_carry_into_the_next_generation_before_it_opens() {
        let mut m = ReshardMachine::new(name(), &layout(0, 2, Some(1))).unwrap();
        m.step(ReshardInput::Sealed { index: 0, image: image(1, Some("a")) }).unwrap();
        let effects = m.step(ReshardInput::Sealed { index: 1, image: image(2, Some("b")) }).unwrap();
        let [ReshardEffect::MergeSketch { shard, sketch: Some(sketch), frequency: None, windows: None }] =
            effects.as_slice()
        else {
            panic!("{effects:?}")
        };
        assert_eq!(shard, &ShardId::new(name(), 1, 0));
        assert_eq!(DistinctSketch::from_bytes(sketch).unwrap().estimate(), 2);
        assert_eq!(m.step(ReshardInput::Outstanding).unwrap(), effects, "resent until merged");
        assert_eq!(
            m.step(ReshardInput::Merged).unwrap(),
            vec![ReshardEffect::Complete { generation: 0, sealed_sum: 3 }]
        );
        assert_eq!(m.step(ReshardInput::Merged).unwrap(), vec![]);
    }

    #[test]
    fn frequency_sketches_carry_merged_and_a_bad_one_is_an_error() {
        use crate::frequency::FrequencySpec;
        let spec = FrequencySpec { epsilon: 0.01, delta: 0.01 };
        let with = |value, item: &str, weight| {
            let mut f = FrequencySketch::new(&spec).unwrap();
            f.add(item, weight);
            ShardImage { value, sketch: None, frequency: Some(f.to_bytes()), windows: None, escrow: None }
        };
        let mut m = ReshardMachine::new(name(), &layout(0, 2, Some(1))).unwrap();
        m.step(ReshardInput::Sealed { index: 0, image: with(3, "x", 3) }).unwrap();
        let effects = m.step(ReshardInput::Sealed { index: 1, image: with(4, "x", 4) }).unwrap();
        let [ReshardEffect::MergeSketch { sketch: None, frequency: Some(bytes), .. }] = effects.as_slice()
        else {
            panic!("{effects:?}")
        };
        let carried = FrequencySketch::from_bytes(bytes).unwrap();
        assert_eq!((carried.total(), carried.estimate("x", &spec).estimate), (7, 7));
        assert_eq!(
            m.step(ReshardInput::Merged).unwrap(),
            vec![ReshardEffect::Complete { generation: 0, sealed_sum: 7 }]
        );
        let mut m = ReshardMachine::new(name(), &layout(0, 1, Some(2))).unwrap();
        let bad =
            ShardImage { value: 1, sketch: None, frequency: Some(vec![9, 9]), windows: None, escrow: None };
        assert!(matches!(
            m.step(ReshardInput::Sealed { index: 0, image: bad }),
            Err(ReshardError::Frequency(_))
        ));
    }

    #[test]
    fn a_merge_before_every_seal_is_ignored_and_a_bad_sketch_is_an_error() {
        let mut m = ReshardMachine::new(name(), &layout(0, 2, Some(1))).unwrap();
        assert_eq!(m.step(ReshardInput::Merged).unwrap(), vec![]);
        let bad = ShardImage {
            value: 1,
            sketch: Some(vec![1, 2, 3]),
            frequency: None,
            windows: None,
            escrow: None,
        };
        assert!(m.step(ReshardInput::Sealed { index: 0, image: bad }).is_err());
        assert_eq!(m.step(ReshardInput::Outstanding).unwrap().len(), 2, "the bad answer was not taken");
    }
}
