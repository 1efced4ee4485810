//! The one hash function the core uses for placement and routing.
//!
//! Placement must agree across nodes, processes and Rust releases, so it never uses
//! `std`'s `DefaultHasher` (whose algorithm is unspecified). Everything goes through
//! XXH3-64 with explicit, documented seeds.

use xxhash_rust::xxh3::xxh3_64_with_seed;

/// Seed for routing an increment to a shard by event id or writer id.
pub const ROUTE_SEED: u64 = 0x7461_6c6c_7972_6f75; // "tallyrou"
/// Seed for placing shards and virtual nodes on the consistent-hash ring.
pub const RING_SEED: u64 = 0x7461_6c6c_7972_696e; // "tallyrin"
/// Seed for hashing distinct-count members before they reach a sketch.
pub const MEMBER_SEED: u64 = 0x7461_6c6c_796d_656d; // "tallymem"
/// Seed for spreading shards over storage partitions.
pub const STORE_SEED: u64 = 0x7461_6c6c_7973_746f; // "tallysto"

/// Seed for breaking ties when replicas of ring ranges are assigned to nodes.
pub const RANGE_SEED: u64 = 0x7461_6c6c_7972_616e; // "tallyran"

/// XXH3-64 of `bytes` under `seed`.
pub fn hash64(seed: u64, bytes: &[u8]) -> u64 {
    xxh3_64_with_seed(bytes, seed)
}

/// Maps a 64-bit hash uniformly onto `0..n` without the modulo bias of `%`
/// (Lemire's multiply-shift reduction). `n` must be non-zero.
pub fn reduce(hash: u64, n: u64) -> u64 {
    assert!(n > 0, "reduce onto an empty range");
    ((u128::from(hash) * u128::from(n)) >> 64) as u64
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn hash_is_pinned() {
        // If this changes, every placement and route changes: treat it as a format break.
        assert_eq!(hash64(0, b""), 0x2d06800538d394c2);
        assert_ne!(hash64(ROUTE_SEED, b"e-1"), hash64(RING_SEED, b"e-1"));
    }

    #[test]
    fn reduce_stays_in_range() {
        for n in [1u64, 2, 7, 1024] {
            for h in [0u64, 1, u64::MAX / 3, u64::MAX] {
                assert!(reduce(h, n) < n);
            }
        }
        assert_eq!(reduce(u64::MAX, 8), 7);
        assert_eq!(reduce(0, 8), 0);
    }
}
