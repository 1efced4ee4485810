//! [`StoreId`], the identity of a data directory (see `identity.rs` for how it is kept
//! and why every raft RPC names it). Apart from the code that stores it, so the log's
//! types can name it without depending on that code.

use serde::{Deserialize, Serialize};
use std::fmt;

/// The random 128-bit identity of one data directory, created with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct StoreId(pub u128);

impl StoreId {
    /// A new random identity, drawn from this thread's generator
    /// ([`tally_raft_kit::random_u128`]): seeded by the operating system (a
    /// cryptographically strong generator, so two directories never share one in
    /// practice), or by a simulation that draws the same identities again.
    pub fn random() -> Self {
        Self(tally_raft_kit::random_u128())
    }
}

impl fmt::Display for StoreId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}
