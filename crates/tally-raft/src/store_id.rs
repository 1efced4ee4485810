//! [`StoreId`], the identity of a data directory (see `identity.rs` for how it is kept
//! and why every raft RPC names it). Apart from the code that stores it, so the log's
//! types can name it without depending on that code.

use serde::{Deserialize, Serialize};
use std::fmt;
use std::hash::{BuildHasher, Hasher};

/// The random 128-bit identity of one data directory, created with it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(transparent)]
pub struct StoreId(pub u128);

impl StoreId {
    /// A new random identity. The bits come from the standard library's
    /// per-process random hash keys (seeded by the operating system), mixed with the
    /// clock and the process id, so two directories never share one in practice.
    pub fn random() -> Self {
        let nanos = std::time::SystemTime::now()
            .duration_since(std::time::UNIX_EPOCH)
            .map(|d| d.as_nanos())
            .unwrap_or(0);
        let half = |salt: u64| {
            let mut h = std::collections::hash_map::RandomState::new().build_hasher();
            h.write_u64(salt);
            h.write_u128(nanos);
            h.write_u32(std::process::id());
            h.finish()
        };
        Self((u128::from(half(1)) << 64) | u128::from(half(2)))
    }
}

impl fmt::Display for StoreId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:032x}", self.0)
    }
}
