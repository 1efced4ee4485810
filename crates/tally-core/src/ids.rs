//! Identities of shards and nodes.

use crate::name::CounterName;
use serde::{Deserialize, Serialize};
use std::fmt;

/// One shard of one layout generation of a counter.
///
/// Resharding creates a new generation; the shards of older generations are sealed
/// (never written again) and kept for their dedup records, so the generation is part
/// of every shard's identity and storage key.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
pub struct ShardId {
    /// The counter the shard belongs to.
    pub counter: CounterName,
    /// The layout generation (0 for a counter that was never resharded).
    pub generation: u32,
    /// The shard's index within its generation, `0..shards`.
    pub index: u16,
}

impl ShardId {
    /// Builds a shard id.
    pub fn new(counter: CounterName, generation: u32, index: u16) -> Self {
        Self { counter, generation, index }
    }
}

impl fmt::Debug for ShardId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{}#g{}/{}", self.counter, self.generation, self.index)
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
