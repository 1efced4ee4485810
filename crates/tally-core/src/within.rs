//! Increments kept within bounds the caller names with each increment (Redis's
//! `INCREX ... LBOUND l UBOUND u [SATURATE]`), as opposed to the bounds a counter
//! keeps for its whole life in its spec (`min`/`max`, kept by [`crate::escrow`]).
//!
//! The arithmetic only: given the counter's total and the increment asked for,
//! what to add. An increment whose result would leave the bounds is skipped
//! (nothing added), or with `SATURATE` replaced by the one that takes the total to
//! the bound it would cross. Without a bound on a side, that side's bound is the
//! 64-bit integer limit, as in Redis.

use crate::escrow::Bounds;

/// Bounds on one increment's result.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Within {
    /// The lowest total the increment may leave (`LBOUND`).
    pub min: Option<i64>,
    /// The highest (`UBOUND`).
    pub max: Option<i64>,
    /// Whether a result out of bounds is brought to the bound (`SATURATE`) rather
    /// than skipped.
    pub saturate: bool,
}

/// Why bounds or a step were refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, thiserror::Error)]
pub enum WithinError {
    /// The lower bound is above the upper one.
    #[error("LBOUND {min} is above UBOUND {max}")]
    Inverted {
        /// The lower bound.
        min: i64,
        /// The upper bound.
        max: i64,
    },
    /// Saturating would need an increment beyond a 64-bit integer (a total far
    /// outside the bounds, which only a counter's i128 total can reach).
    #[error("the increment that saturates the total does not fit a 64-bit integer")]
    Overflow,
}

/// What to add for an increment kept within bounds.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Step {
    /// Add this (the increment asked for, or the saturating one; 0 when the total is
    /// at the bound already).
    Apply(i64),
    /// Add nothing: the result would leave the bounds.
    Skip,
}

impl Within {
    /// Bounds `min..=max` (either open), checked.
    pub fn new(min: Option<i64>, max: Option<i64>, saturate: bool) -> Result<Self, WithinError> {
        if let (Some(min), Some(max)) = (min, max) {
            if min > max {
                return Err(WithinError::Inverted { min, max });
            }
        }
        Ok(Self { min, max, saturate })
    }

    /// Whether a bound is named.
    pub fn any(&self) -> bool {
        self.min.is_some() || self.max.is_some()
    }

    fn lo(&self) -> i128 {
        i128::from(self.min.unwrap_or(i64::MIN))
    }

    fn hi(&self) -> i128 {
        i128::from(self.max.unwrap_or(i64::MAX))
    }

    /// What to add to a counter at `total` for an increment of `delta`: `delta`
    /// itself if `total + delta` is within the bounds; otherwise nothing, or with
    /// `saturate` what takes the total to the nearest bound (which may be 0, or of
    /// the other sign than `delta` when the total is already beyond that bound).
    /// A result out of bounds is out even if it is nearer the bounds than `total`,
    /// as Redis has it.
    pub fn step(&self, total: i128, delta: i64) -> Result<Step, WithinError> {
        let (lo, hi) = (self.lo(), self.hi());
        let target = total.saturating_add(i128::from(delta));
        if (lo..=hi).contains(&target) {
            return Ok(Step::Apply(delta));
        }
        if !self.saturate {
            return Ok(Step::Skip);
        }
        let to = target.clamp(lo, hi);
        i64::try_from(to - total).map(Step::Apply).map_err(|_| WithinError::Overflow)
    }

    /// Whether a counter whose own bounds are `own` refuses exactly what these
    /// bounds refuse: its escrow then keeps them across every node and writer.
    pub fn kept_by(&self, own: Bounds) -> bool {
        self.any() && own.min == self.min && own.max == self.max
    }

    /// Whether a new counter may take these bounds as its own: a bound is named and
    /// they include 0, where a new counter starts.
    pub fn fit_a_new_counter(&self) -> bool {
        self.any() && self.lo() <= 0 && self.hi() >= 0
    }

    /// These bounds narrowed by a counter's own (`own`): the tighter on each side.
    /// Saturating then stops at the bound the counter would refuse to cross.
    pub fn narrowed(&self, own: Bounds) -> Self {
        let tighter = |a: Option<i64>, b: Option<i64>, pick: fn(i64, i64) -> i64| match (a, b) {
            (Some(a), Some(b)) => Some(pick(a, b)),
            (a, b) => a.or(b),
        };
        Self { min: tighter(self.min, own.min, i64::max), max: tighter(self.max, own.max, i64::min), ..*self }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn within(min: Option<i64>, max: Option<i64>, saturate: bool) -> Within {
        Within::new(min, max, saturate).unwrap()
    }

    #[test]
    fn an_increment_within_bounds_is_applied_and_one_beyond_is_skipped() {
        let w = within(None, Some(100), false);
        assert_eq!(w.step(99, 1), Ok(Step::Apply(1)));
        assert_eq!(w.step(99, 5), Ok(Step::Skip));
        assert_eq!(w.step(100, 0), Ok(Step::Apply(0)));
        // Nearer the bound than the total is still out (Redis's rule).
        assert_eq!(w.step(10_000, -500), Ok(Step::Skip));
        let w = within(Some(0), None, false);
        assert_eq!(w.step(3, -3), Ok(Step::Apply(-3)));
        assert_eq!(w.step(3, -4), Ok(Step::Skip));
    }

    #[test]
    fn saturate_takes_the_total_to_the_bound_it_would_cross() {
        let w = within(Some(-10), Some(100), true);
        assert_eq!(w.step(99, 5), Ok(Step::Apply(1)));
        assert_eq!(w.step(100, 5), Ok(Step::Apply(0)));
        assert_eq!(w.step(-8, -5), Ok(Step::Apply(-2)));
        // Already beyond: brought back to the bound, against the increment's sign.
        assert_eq!(w.step(150, 1), Ok(Step::Apply(-50)));
    }

    #[test]
    fn without_a_bound_the_64_bit_limits_apply() {
        let skip = within(None, None, false);
        assert_eq!(skip.step(i128::from(i64::MAX), 1), Ok(Step::Skip));
        assert_eq!(skip.step(i128::from(i64::MIN), -1), Ok(Step::Skip));
        let sat = within(None, None, true);
        assert_eq!(sat.step(i128::from(i64::MAX) - 1, 5), Ok(Step::Apply(1)));
        // A total no 64-bit increment can bring back within.
        assert_eq!(sat.step(i128::MAX / 2, 1), Err(WithinError::Overflow));
    }

    #[test]
    fn bounds_are_checked_compared_and_narrowed() {
        assert_eq!(Within::new(Some(5), Some(4), false), Err(WithinError::Inverted { min: 5, max: 4 }));
        assert!(Within::new(Some(4), Some(4), false).is_ok());
        let w = within(None, Some(100), false);
        assert!(w.kept_by(Bounds { min: None, max: Some(100) }));
        assert!(!w.kept_by(Bounds { min: Some(0), max: Some(100) }));
        assert!(!within(None, None, false).kept_by(Bounds { min: None, max: None }));
        assert!(w.fit_a_new_counter());
        assert!(!within(Some(1), None, false).fit_a_new_counter());
        assert!(!within(None, None, false).fit_a_new_counter());
        let n = within(Some(-5), Some(100), true).narrowed(Bounds { min: Some(0), max: Some(200) });
        assert_eq!((n.min, n.max, n.saturate), (Some(0), Some(100), true));
        let n = within(None, Some(100), false).narrowed(Bounds { min: Some(-3), max: None });
        assert_eq!((n.min, n.max), (Some(-3), Some(100)));
    }
}
