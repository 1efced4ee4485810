//! Overflow arithmetic for acknowledged-but-buffered increments.
//!
//! A `batched` increment is acknowledged the moment it lands in an in-memory
//! accumulator slot, before its shard has seen it. Totals must never wrap, and an
//! acknowledged increment must never be refused later, so the slot may only take an
//! increment when the sum that will eventually reach the shard provably fits. The
//! argument, with the constants below:
//!
//! 1. A slot takes an increment only if `|delta| < FAST_DELTA_ABS_LIMIT` (2^32) and the
//!    slot holds fewer than `SLOT_INCREMENTS_MAX` (2^19) increments since its last drain,
//!    so one drain carries less than 2^51 in magnitude.
//! 2. A slot takes increments only while its shard's last known value satisfies
//!    `|value| <= FAST_SHARD_ABS_MAX` (2^60). Once a commit takes the shard past that,
//!    the slot closes; what it already holds (and what writers racing with the close
//!    add) still drains: at most two drains per node.
//! 3. Every other write (large deltas, closed or full slots, event ids, `sync`
//!    counters) is checked against the shard's real value by [`check_direct`], which
//!    refuses to move a shard beyond `SHARD_VALUE_ABS_MAX` = i64::MAX − 2^58.
//! 4. The reserve 2^58 covers two drains from each of `NODES_MAX` (32) nodes
//!    (32 × 2 × 2^51 = 2^57) with 2^57 to spare for racing writers, so
//!    [`apply_buffered`] can never overflow; it asserts so anyway.

/// Largest `|delta|` (exclusive) an accumulator slot accepts; larger deltas take the
/// checked direct path.
pub const FAST_DELTA_ABS_LIMIT: i64 = 1 << 32;
/// Most increments one accumulator slot takes between drains before writers take the
/// direct path.
pub const SLOT_INCREMENTS_MAX: u64 = 1 << 19;
/// A slot is open while its shard's value is within this magnitude.
pub const FAST_SHARD_ABS_MAX: i64 = 1 << 60;
/// Largest magnitude a checked write may move a shard to.
pub const SHARD_VALUE_ABS_MAX: i64 = i64::MAX - (1 << 58);
/// Most nodes whose accumulators the reserve above is sized for.
pub const NODES_MAX: usize = 32;

/// Why a write was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error, serde::Serialize, serde::Deserialize)]
#[error("adding {delta} to a shard holding {value} would leave the range ±{max}", max = SHARD_VALUE_ABS_MAX)]
pub struct Overflow {
    /// The shard's value.
    pub value: i64,
    /// The refused delta.
    pub delta: i64,
}

/// Whether an increment of `delta` may be buffered in an accumulator slot.
pub fn bufferable(delta: i64) -> bool {
    delta != 0 && delta.unsigned_abs() < FAST_DELTA_ABS_LIMIT as u64
}

/// Whether accumulator slots for a shard holding `value` may take increments.
pub fn slot_open(value: i64) -> bool {
    value.unsigned_abs() <= FAST_SHARD_ABS_MAX as u64
}

/// The shard's value after a checked write of `delta`, or the refusal.
///
/// A write that moves the value towards zero is always allowed (it cannot overflow,
/// and it must stay possible to bring an extreme shard back).
pub fn check_direct(value: i64, delta: i64) -> Result<i64, Overflow> {
    #[cfg(feature = "planted-bugs")]
    if crate::planted::active(crate::planted::Bug::WrappingAdd) {
        return Ok(value.wrapping_add(delta));
    }
    let next = value.checked_add(delta).ok_or(Overflow { value, delta })?;
    if next.unsigned_abs() > SHARD_VALUE_ABS_MAX as u64 && next.unsigned_abs() > value.unsigned_abs() {
        return Err(Overflow { value, delta });
    }
    Ok(next)
}

/// The shard's value after adding a drained accumulator sum, which was acknowledged
/// already and so cannot be refused. The module's argument shows it cannot overflow;
/// the assertion stays on in production so a broken argument is a crash, not a wrap.
pub fn apply_buffered(value: i64, sum: i64) -> i64 {
    value.checked_add(sum).unwrap_or_else(|| {
        panic!("buffered sum {sum} overflowed shard value {value}: limits argument broken")
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn reserve_covers_every_node_draining_twice() {
        let per_drain = (FAST_DELTA_ABS_LIMIT as i128) * (SLOT_INCREMENTS_MAX as i128);
        let worst = 2 * (NODES_MAX as i128) * per_drain;
        let reserve = i64::MAX as i128 - SHARD_VALUE_ABS_MAX as i128;
        assert!(worst * 2 <= reserve, "worst {worst} reserve {reserve}");
        assert!((FAST_SHARD_ABS_MAX as i128) + worst < SHARD_VALUE_ABS_MAX as i128);
    }

    #[test]
    fn direct_writes_stop_at_the_limit_but_may_come_back() {
        assert_eq!(check_direct(0, 5), Ok(5));
        assert_eq!(check_direct(SHARD_VALUE_ABS_MAX - 1, 1), Ok(SHARD_VALUE_ABS_MAX));
        assert!(check_direct(SHARD_VALUE_ABS_MAX, 1).is_err());
        assert!(check_direct(-SHARD_VALUE_ABS_MAX, -1).is_err());
        assert!(check_direct(0, i64::MAX).is_err());
        assert!(check_direct(i64::MAX, 1).is_err());
        // Beyond the limit (reached through buffered sums), moving back is fine.
        assert_eq!(check_direct(SHARD_VALUE_ABS_MAX + 10, -1), Ok(SHARD_VALUE_ABS_MAX + 9));
        assert_eq!(check_direct(i64::MIN + 1, -1).unwrap_err().delta, -1);
    }

    #[test]
    fn bufferable_and_slot_open_bounds() {
        assert!(bufferable(1) && bufferable(-1));
        assert!(!bufferable(0));
        assert!(bufferable(FAST_DELTA_ABS_LIMIT - 1));
        assert!(!bufferable(FAST_DELTA_ABS_LIMIT));
        assert!(!bufferable(i64::MIN));
        assert!(slot_open(FAST_SHARD_ABS_MAX) && slot_open(-FAST_SHARD_ABS_MAX));
        assert!(!slot_open(FAST_SHARD_ABS_MAX + 1));
    }

    #[test]
    #[should_panic(expected = "limits argument broken")]
    fn buffered_overflow_is_a_crash_not_a_wrap() {
        apply_buffered(i64::MAX, 1);
    }

    #[test]
    fn the_argument_is_made_for_these_bounds() {
        // The module's argument is written out for these values; changing one means
        // redoing it (and `reserve_covers_every_node_draining_twice` checks the sum).
        assert_eq!(FAST_DELTA_ABS_LIMIT, 1i64 << 32);
        assert_eq!(SLOT_INCREMENTS_MAX, 524_288);
        assert_eq!(FAST_SHARD_ABS_MAX, 1_152_921_504_606_846_976);
        assert!(slot_open(1 << 60) && !slot_open((1 << 60) + 1));
    }

    #[test]
    fn a_shard_beyond_the_limit_may_stay_where_it_is() {
        // Only moving further from zero is refused.
        assert_eq!(check_direct(SHARD_VALUE_ABS_MAX + 10, 0), Ok(SHARD_VALUE_ABS_MAX + 10));
        assert_eq!(check_direct(-SHARD_VALUE_ABS_MAX - 10, 0), Ok(-SHARD_VALUE_ABS_MAX - 10));
    }
}
