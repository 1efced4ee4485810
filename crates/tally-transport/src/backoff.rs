//! Reconnect pacing and log rate limiting, both pure.
//!
//! A dead peer must not be hammered with connection attempts, and a refused peer must not
//! fill the log: the connector waits [`Backoff::delay_ms`] between attempts and logs through a
//! [`LogLimiter`]. Jitter comes from a seeded hash, not a global RNG, so a schedule can be
//! replayed from its seed and tested exactly.

use std::time::{SystemTime, UNIX_EPOCH};
use tally_core::hash::hash64;

/// Seed for reconnect jitter (mixed with the node pair so peers do not dial in lockstep).
pub const BACKOFF_SEED: u64 = 0x7461_6c6c_7962_6f66; // "tallybof"

/// Exponential backoff with "equal jitter": attempt `n` waits a deterministic value in
/// `[base/2, base]` where `base = min(min_ms * 2^n, max_ms)`, never less than `min_ms`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Backoff {
    /// Shortest wait, in ms (also the base of the exponential).
    pub min_ms: u64,
    /// Longest wait, in ms.
    pub max_ms: u64,
    /// Jitter seed; derive it from something stable such as the (node, peer) pair.
    pub seed: u64,
}

impl Backoff {
    /// A schedule between `min_ms` and `max_ms` (swapped if given in the wrong order).
    pub fn new(min_ms: u64, max_ms: u64, seed: u64) -> Self {
        Backoff { min_ms: min_ms.min(max_ms), max_ms: max_ms.max(min_ms), seed }
    }

    /// A schedule whose jitter is seeded by this node and the peer it dials.
    pub fn for_pair(min_ms: u64, max_ms: u64, node: &str, peer: &str) -> Self {
        let mut key = Vec::with_capacity(node.len() + peer.len() + 1);
        key.extend_from_slice(node.as_bytes());
        key.push(0);
        key.extend_from_slice(peer.as_bytes());
        Backoff::new(min_ms, max_ms, hash64(BACKOFF_SEED, &key))
    }

    /// How long to wait before retry number `attempt` (0 = the first retry).
    pub fn delay_ms(&self, attempt: u32) -> u64 {
        let base = self.min_ms.saturating_mul(1u64.checked_shl(attempt.min(63)).unwrap_or(u64::MAX));
        let base = base.min(self.max_ms);
        let half = base / 2;
        let jitter = hash64(self.seed, &attempt.to_le_bytes()) % (half + 1);
        (base - half + jitter).max(self.min_ms).min(self.max_ms)
    }
}

/// Lets one message through per `interval_ms` and counts what it held back, so a flapping
/// peer produces one line per interval saying how many were suppressed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LogLimiter {
    /// Minimum spacing between two emitted lines, in ms.
    pub interval_ms: u64,
    last_ms: Option<u64>,
    suppressed: u64,
}

impl LogLimiter {
    /// A limiter that emits at most one line per `interval_ms`.
    pub fn new(interval_ms: u64) -> Self {
        LogLimiter { interval_ms, last_ms: None, suppressed: 0 }
    }

    /// Returns `Some(suppressed_since_last)` if a line may be emitted at `now_ms`, else
    /// `None` (and counts the event as suppressed).
    pub fn allow(&mut self, now_ms: u64) -> Option<u64> {
        match self.last_ms {
            Some(last) if now_ms.saturating_sub(last) < self.interval_ms => {
                self.suppressed = self.suppressed.saturating_add(1);
                None
            }
            _ => {
                self.last_ms = Some(now_ms);
                Some(std::mem::take(&mut self.suppressed))
            }
        }
    }

    /// Forgets the history, so the next event is logged (e.g. after a successful reconnect).
    pub fn reset(&mut self) {
        self.last_ms = None;
        self.suppressed = 0;
    }
}

/// Spacing of repeated reconnect-failure and refusal log lines per peer, in ms.
pub const RECONNECT_LOG_INTERVAL_MS: u64 = 10_000;

/// Wall-clock milliseconds since the Unix epoch, for `last_seen_ms` and log limiting only
/// (detection counts pings, it never compares clocks).
pub(crate) fn unix_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn delays_grow_then_cap_and_stay_in_range() {
        let b = Backoff::new(100, 2_000, 1);
        let delays: Vec<u64> = (0..12).map(|a| b.delay_ms(a)).collect();
        for (attempt, d) in delays.iter().enumerate() {
            let base = (100u64 << attempt).min(2_000);
            assert!(*d >= (base / 2).max(100) && *d <= base, "attempt {attempt}: {d} vs base {base}");
        }
        // Late attempts sit in the top half of the cap.
        assert!(delays[11] >= 1_000 && delays[11] <= 2_000);
    }

    #[test]
    fn schedule_is_deterministic_per_seed_and_differs_across_seeds() {
        let a = Backoff::for_pair(100, 10_000, "node1", "node2");
        let b = Backoff::for_pair(100, 10_000, "node1", "node2");
        let c = Backoff::for_pair(100, 10_000, "node1", "node3");
        let sa: Vec<u64> = (0..10).map(|n| a.delay_ms(n)).collect();
        let sb: Vec<u64> = (0..10).map(|n| b.delay_ms(n)).collect();
        let sc: Vec<u64> = (0..10).map(|n| c.delay_ms(n)).collect();
        assert_eq!(sa, sb);
        assert_ne!(sa, sc);
    }

    #[test]
    fn huge_attempt_numbers_do_not_overflow() {
        let b = Backoff::new(1, u64::MAX, 9);
        for attempt in [63, 64, 100, u32::MAX] {
            assert!(b.delay_ms(attempt) >= 1);
        }
        let swapped = Backoff::new(500, 100, 0);
        assert_eq!((swapped.min_ms, swapped.max_ms), (100, 500));
        assert!((100..=500).contains(&swapped.delay_ms(0)));
    }

    #[test]
    fn min_equal_max_is_a_constant_schedule() {
        let b = Backoff::new(250, 250, 3);
        assert!((0..20).all(|a| b.delay_ms(a) == 250));
    }

    #[test]
    fn limiter_emits_once_per_interval_and_reports_suppressed() {
        let mut l = LogLimiter::new(1_000);
        assert_eq!(l.allow(0), Some(0));
        assert_eq!(l.allow(10), None);
        assert_eq!(l.allow(999), None);
        assert_eq!(l.allow(1_000), Some(2));
        assert_eq!(l.allow(1_500), None);
        l.reset();
        assert_eq!(l.allow(1_501), Some(0));
    }
}
