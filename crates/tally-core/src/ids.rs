//! Identities of shards and nodes.

use crate::name::CounterName;
use serde::{Deserialize, Serialize};
use std::fmt;

/// The highest layout generation a shard id can carry: its encoding shares one
/// 32-bit word between the generation (the low 28 bits) and the replica class (the
/// high 4 bits, see [`ShardId::replicas`]).
pub const GENERATION_MAX: u32 = (1 << GENERATION_BITS) - 1;

/// Bits of the encoded generation word that hold the generation.
const GENERATION_BITS: u32 = 28;

/// The replica class of a counter that states no replica count of its own: its
/// shards live in the range groups of the cluster's `replicas`.
pub const CLUSTER_REPLICAS: u8 = 0;

/// One shard of one layout generation of a counter.
///
/// Resharding creates a new generation; the shards of older generations are sealed
/// (never written again) and kept for their dedup records, so the generation is part
/// of every shard's identity and storage key.
///
/// The replica class says which range groups hold the shard: [`CLUSTER_REPLICAS`]
/// for a counter that takes the cluster's replica count, or the counter's own count
/// (`1..=5`). It is fixed when the counter is created, so every shard of a counter
/// has the same one. Encoded, it sits in the top four bits of the generation's word,
/// so the ids of counters without a replica count of their own — every id stored
/// before replica classes existed — encode exactly as they did.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(into = "ShardIdWire", from = "ShardIdWire")]
pub struct ShardId {
    /// The counter the shard belongs to.
    pub counter: CounterName,
    /// The layout generation (0 for a counter that was never resharded), at most
    /// [`GENERATION_MAX`].
    pub generation: u32,
    /// The shard's index within its generation, `0..shards`.
    pub index: u16,
    /// The replica class: [`CLUSTER_REPLICAS`], or the counter's own replica count.
    pub replicas: u8,
}

/// A shard id as it is encoded: the generation and the replica class share a word.
#[derive(Serialize, Deserialize)]
struct ShardIdWire {
    counter: CounterName,
    generation: u32,
    index: u16,
}

impl From<ShardId> for ShardIdWire {
    fn from(id: ShardId) -> Self {
        let generation = id.generation_word();
        Self { counter: id.counter, generation, index: id.index }
    }
}

impl From<ShardIdWire> for ShardId {
    fn from(w: ShardIdWire) -> Self {
        ShardId::from_word(w.counter, w.generation, w.index)
    }
}

impl ShardId {
    /// Builds the id of a shard of a counter without a replica count of its own.
    pub fn new(counter: CounterName, generation: u32, index: u16) -> Self {
        Self { counter, generation, index, replicas: CLUSTER_REPLICAS }
    }

    /// The same shard in replica class `replicas` ([`CLUSTER_REPLICAS`] or `1..=15`;
    /// the spec allows `1..=5`).
    pub fn in_class(self, replicas: u8) -> Self {
        Self { replicas, ..self }
    }

    /// Shard `index` of generation `generation` of the same counter (same class).
    pub fn sibling(&self, generation: u32, index: u16) -> Self {
        Self { counter: self.counter.clone(), generation, index, replicas: self.replicas }
    }

    /// The word that encodes the generation and the replica class: the class in the
    /// top four bits. A generation above [`GENERATION_MAX`] never reaches here
    /// (resharding refuses to make one); if it did, its high bits would be lost,
    /// so that is checked in every build.
    pub fn generation_word(&self) -> u32 {
        generation_word(self.generation, self.replicas)
    }

    /// The id whose [`ShardId::generation_word`] is `word`.
    pub fn from_word(counter: CounterName, word: u32, index: u16) -> Self {
        let (generation, replicas) = split_generation_word(word);
        Self { counter, generation, index, replicas }
    }
}

/// The word that encodes `generation` and the replica class `replicas` of a shard
/// id ([`ShardId::generation_word`]).
pub fn generation_word(generation: u32, replicas: u8) -> u32 {
    assert!(generation <= GENERATION_MAX, "shard generation {generation} past its limit");
    assert!(replicas < 16, "replica class {replicas} past its four bits");
    (u32::from(replicas) << GENERATION_BITS) | generation
}

/// The generation and the replica class a generation word encodes.
pub fn split_generation_word(word: u32) -> (u32, u8) {
    (word & GENERATION_MAX, (word >> GENERATION_BITS) as u8)
}

impl fmt::Debug for ShardId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#g{}/{}", self.counter, self.generation, self.index)?;
        if self.replicas != CLUSTER_REPLICAS {
            write!(f, "@r{}", self.replicas)?;
        }
        Ok(())
    }
}

impl ShardId {
    /// The id as a client's message shows it: the counter's name quoted as it was
    /// given ([`crate::name::quoted`]), then the generation and index as in the
    /// `Debug` form (`"a b"#g0/1`), which logs and metric labels keep.
    pub fn shown(&self) -> String {
        let mut id =
            format!("{}#g{}/{}", crate::name::quoted(self.counter.as_str()), self.generation, self.index);
        if self.replicas != CLUSTER_REPLICAS {
            id.push_str(&format!("@r{}", self.replicas));
        }
        id
    }
}

impl fmt::Display for ShardId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        fmt::Debug::fmt(self, f)
    }
}

/// A cluster node's stable name (from its config). Shard ownership is keyed by this,
/// never by a transport-level id, because those change on reconnect.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct NodeId(pub String);

impl NodeId {
    /// Wraps a node name.
    pub fn new(s: impl Into<String>) -> Self {
        Self(s.into())
    }

    /// The name as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl fmt::Debug for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Display for NodeId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A shard id as every release before replica classes encoded it.
    #[derive(Serialize)]
    struct Legacy {
        counter: CounterName,
        generation: u32,
        index: u16,
    }

    fn name() -> CounterName {
        CounterName::new("likes:42").unwrap()
    }

    #[test]
    fn an_id_of_the_clusters_class_encodes_as_before_replica_classes() {
        let id = ShardId::new(name(), 7, 300);
        let legacy = Legacy { counter: name(), generation: 7, index: 300 };
        assert_eq!(crate::codec::encode(&id), crate::codec::encode(&legacy));
        assert_eq!(id.to_string(), "likes:42#g7/300");
    }

    #[test]
    fn a_class_survives_encoding_and_keeps_the_generation_apart() {
        for replicas in [CLUSTER_REPLICAS, 1, 3, 5] {
            for generation in [0, 1, 12_345, GENERATION_MAX] {
                let id = ShardId::new(name(), generation, 9).in_class(replicas);
                let back: ShardId = crate::codec::decode("shard id", &crate::codec::encode(&id)).unwrap();
                assert_eq!(back, id);
                assert_eq!(back.replicas, replicas);
                assert_eq!(back.generation, generation);
            }
        }
        let id = ShardId::new(name(), 2, 1).in_class(3);
        assert_eq!(id.to_string(), "likes:42#g2/1@r3");
        assert_eq!(id.sibling(3, 0), ShardId::new(name(), 3, 0).in_class(3));
        assert_ne!(id, ShardId::new(name(), 2, 1), "the class is part of the identity");
    }

    #[test]
    #[should_panic(expected = "past its limit")]
    fn a_generation_past_its_bits_is_never_encoded() {
        let _ = ShardId::new(name(), GENERATION_MAX + 1, 0).generation_word();
    }
}
