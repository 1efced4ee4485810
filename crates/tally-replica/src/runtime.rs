//! The async runtime of the range groups: openraft's tokio runtime, with the
//! election timeouts drawn from a per-thread generator that a simulation seeds
//! ([`tally_raft_kit`], shared with the metadata group).

pub use tally_raft_kit::{random_u128, random_u64, seed_thread_rng, SeededRuntime, ThreadRng};
