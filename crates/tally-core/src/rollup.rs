//! When a cached total must be refreshed.

/// A refresh is also due once this much absolute change has accumulated …
pub const ROLLUP_CHANGE_ABS_MIN: u64 = 1_000;
/// … or once the change reaches this fraction (in parts per million) of the cached
/// value, whichever is larger: a big counter tolerates proportionally more change.
pub const ROLLUP_CHANGE_PPM: u64 = 10_000;

/// The change that makes a refresh due early for a cached `value`.
pub fn change_threshold(value: i128) -> u64 {
    let relative = value.unsigned_abs().saturating_mul(u128::from(ROLLUP_CHANGE_PPM)) / 1_000_000;
    ROLLUP_CHANGE_ABS_MIN.max(u64::try_from(relative).unwrap_or(u64::MAX))
}

/// Whether a total cached at `as_of_ms` with `changed` absolute change since then
/// must be refreshed at `now_ms`, for a counter with `rollup_ms`.
pub fn refresh_due(now_ms: u64, as_of_ms: u64, rollup_ms: u32, value: i128, changed: u64) -> bool {
    #[cfg(feature = "planted-bugs")]
    if crate::planted::active(crate::planted::Bug::RollupNeverRefreshed) {
        return false;
    }
    now_ms.saturating_sub(as_of_ms) >= u64::from(rollup_ms) || changed >= change_threshold(value)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn due_on_age_or_on_change() {
        assert!(!refresh_due(1_500, 1_000, 1_000, 0, 0));
        assert!(refresh_due(2_000, 1_000, 1_000, 0, 0));
        assert!(refresh_due(1_001, 1_000, 1_000, 0, 1_000));
        // A big total needs 1 % change before an early refresh.
        assert!(!refresh_due(1_001, 1_000, 1_000, 10_000_000, 99_999));
        assert!(refresh_due(1_001, 1_000, 1_000, 10_000_000, 100_000));
        assert_eq!(change_threshold(i128::MIN), u64::MAX);
    }
}
