//! Expiry: when a counter stops existing, as Redis's `EXPIRE` family states it.
//!
//! A counter may carry an absolute deadline, `expires_at_ms` (milliseconds since
//! the Unix epoch), in its metadata ([`crate::meta::CounterMeta`]). From that
//! instant on it does not exist for any read or write; an increment then creates it
//! anew, as Redis's `INCR` creates a key that expired. Its data is reclaimed later
//! by deleting it like any counter (the engine's sweeper, or the first write that
//! finds it expired).
//!
//! Everything here is arithmetic on times the caller passes in: which deadline a
//! command asks for ([`deadline`]), whether a deadline is replaced under `NX`, `XX`,
//! `GT`, `LT` ([`Condition::allows`]), and what `TTL`/`PTTL` answer ([`remaining`]).

use serde::{Deserialize, Serialize};

/// Latest deadline accepted, in milliseconds since the Unix epoch: far beyond any
/// real use (year 10,000), and small enough that every sum of it with a 64-bit
/// span is checked, not wrapped.
pub const EXPIRES_AT_MS_MAX: u64 = 253_402_300_800_000;

/// How a relative or absolute time is written in a command.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum When {
    /// Seconds from now (`EXPIRE`, `SET ... EX`).
    InSeconds(i64),
    /// Milliseconds from now (`PEXPIRE`, `SET ... PX`).
    InMillis(i64),
    /// A Unix time in seconds (`EXPIREAT`, `SET ... EXAT`).
    AtSeconds(i64),
    /// A Unix time in milliseconds (`PEXPIREAT`, `SET ... PXAT`).
    AtMillis(i64),
}

/// Why a time was refused: it overflows when turned into a deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
#[error("invalid expire time: it must turn into a deadline before the year 10000 (at most {EXPIRES_AT_MS_MAX} ms since the Unix epoch)")]
pub struct InvalidTime;

/// The deadline `when` names at `now_ms`. A deadline at or before `now_ms` means the
/// counter expires at once (Redis deletes a key given a non-positive timeout); it is
/// answered as it is, and never below 0.
pub fn deadline(when: When, now_ms: u64) -> Result<u64, InvalidTime> {
    let now = i128::from(now_ms);
    let at = match when {
        When::InSeconds(s) => now + i128::from(s) * 1000,
        When::InMillis(ms) => now + i128::from(ms),
        When::AtSeconds(s) => i128::from(s) * 1000,
        When::AtMillis(ms) => i128::from(ms),
    };
    // Redis refuses a span whose milliseconds overflow 64 bits; a deadline beyond
    // the bound here.
    if at > i128::from(EXPIRES_AT_MS_MAX) {
        return Err(InvalidTime);
    }
    Ok(u64::try_from(at.max(0)).unwrap_or(0))
}

/// `EXPIRE`'s conditions on the deadline a counter has now.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
pub enum Condition {
    /// Always set.
    #[default]
    Always,
    /// Only if the counter has no deadline (`NX`).
    Nx,
    /// Only if it has one (`XX`).
    Xx,
    /// Only if the new deadline is later (`GT`; no deadline counts as forever, so
    /// `GT` never sets one on a counter without).
    Gt,
    /// Only if the new deadline is earlier (`LT`; no deadline counts as forever).
    Lt,
}

impl Condition {
    /// Whether a deadline `next` replaces `current` under this condition.
    pub fn allows(self, current: Option<u64>, next: u64) -> bool {
        match (self, current) {
            (Condition::Always, _) => true,
            (Condition::Nx, current) => current.is_none(),
            (Condition::Xx, current) => current.is_some(),
            (Condition::Gt, None) => false,
            (Condition::Gt, Some(c)) => next > c,
            (Condition::Lt, None) => true,
            (Condition::Lt, Some(c)) => next < c,
        }
    }
}

/// Whether a counter with deadline `expires_at_ms` has expired at `now_ms`: from
/// its deadline on, it does not exist.
pub fn expired(expires_at_ms: Option<u64>, now_ms: u64) -> bool {
    expires_at_ms.is_some_and(|at| at <= now_ms)
}

/// What `TTL`/`PTTL` answer about a counter that exists.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Remaining {
    /// It has no deadline (`-1`).
    Forever,
    /// Milliseconds left (at least 1: a counter whose deadline passed does not exist).
    Millis(u64),
}

impl Remaining {
    /// `PTTL`'s integer.
    pub fn millis(self) -> i64 {
        match self {
            Remaining::Forever => -1,
            Remaining::Millis(ms) => i64::try_from(ms).unwrap_or(i64::MAX),
        }
    }

    /// `TTL`'s integer: seconds, rounded to the nearest as Redis does.
    pub fn seconds(self) -> i64 {
        match self {
            Remaining::Forever => -1,
            Remaining::Millis(ms) => i64::try_from(ms.saturating_add(500) / 1000).unwrap_or(i64::MAX),
        }
    }
}

/// What is left of `expires_at_ms` at `now_ms` for a counter that has not expired.
pub fn remaining(expires_at_ms: Option<u64>, now_ms: u64) -> Remaining {
    match expires_at_ms {
        None => Remaining::Forever,
        Some(at) => Remaining::Millis(at.saturating_sub(now_ms).max(1)),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const NOW: u64 = 1_700_000_000_000;

    #[test]
    fn times_become_deadlines_and_overflow_is_refused() {
        assert_eq!(deadline(When::InSeconds(60), NOW), Ok(NOW + 60_000));
        assert_eq!(deadline(When::InMillis(1_500), NOW), Ok(NOW + 1_500));
        assert_eq!(deadline(When::AtSeconds(1_800_000_000), NOW), Ok(1_800_000_000_000));
        assert_eq!(deadline(When::AtMillis(5), NOW), Ok(5));
        // A timeout of zero or less is a deadline already passed.
        assert_eq!(deadline(When::InSeconds(0), NOW), Ok(NOW));
        assert_eq!(deadline(When::InSeconds(-10), NOW), Ok(NOW - 10_000));
        assert_eq!(deadline(When::AtSeconds(-1), NOW), Ok(0));
        assert_eq!(deadline(When::InSeconds(i64::MAX), NOW), Err(InvalidTime));
        assert_eq!(deadline(When::AtMillis(i64::MAX), NOW), Err(InvalidTime));
        assert_eq!(deadline(When::AtMillis(EXPIRES_AT_MS_MAX as i64), NOW), Ok(EXPIRES_AT_MS_MAX));
        assert!(deadline(When::InSeconds(i64::MIN), NOW).is_ok(), "far in the past is just past");
    }

    #[test]
    fn conditions_decide_as_redis_does() {
        use Condition::*;
        assert!(Always.allows(Some(10), 5));
        assert!(Nx.allows(None, 5) && !Nx.allows(Some(10), 5));
        assert!(Xx.allows(Some(10), 5) && !Xx.allows(None, 5));
        assert!(Gt.allows(Some(10), 11) && !Gt.allows(Some(10), 10) && !Gt.allows(None, 5));
        assert!(Lt.allows(Some(10), 9) && !Lt.allows(Some(10), 10) && Lt.allows(None, 5));
    }

    #[test]
    fn ttls_round_and_expired_counters_are_gone() {
        assert!(!expired(None, NOW));
        assert!(!expired(Some(NOW + 1), NOW));
        assert!(expired(Some(NOW), NOW), "the deadline itself is past");
        assert_eq!(remaining(None, NOW), Remaining::Forever);
        assert_eq!((Remaining::Forever.seconds(), Remaining::Forever.millis()), (-1, -1));
        let r = remaining(Some(NOW + 59_501), NOW);
        assert_eq!((r.seconds(), r.millis()), (60, 59_501));
        assert_eq!(remaining(Some(NOW + 499), NOW).seconds(), 0);
        assert_eq!(remaining(Some(NOW + 500), NOW).seconds(), 1);
    }
}
