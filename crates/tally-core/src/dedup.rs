//! The dedup window: what an event id that was seen before means now.

use serde::{Deserialize, Serialize};

/// The memory of one applied increment that carried an event id.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct DedupRecord {
    /// The delta applied under this event id; a retry with another delta is a
    /// conflict, not a duplicate.
    pub delta: i64,
    /// When the increment was applied, in milliseconds since the Unix epoch; the
    /// record expires `dedup_window_s` later.
    pub applied_at_ms: u64,
}

/// What to do with an increment whose event id may have been seen before.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Verdict {
    /// Not seen within the window: apply it and remember it.
    Fresh,
    /// Seen with the same delta: already counted, answer "duplicate".
    Duplicate,
    /// Seen with another delta: a client bug, answered as a conflict and never counted.
    Conflict {
        /// The delta the event id was first applied with.
        recorded_delta: i64,
    },
}

/// True once a record applied at `applied_at_ms` has left a window of `window_ms`.
pub fn expired(applied_at_ms: u64, now_ms: u64, window_ms: u64) -> bool {
    now_ms.saturating_sub(applied_at_ms) >= window_ms
}

/// Judges an increment of `delta` against the record found for its event id, if any.
pub fn judge(record: Option<&DedupRecord>, delta: i64, now_ms: u64, window_ms: u64) -> Verdict {
    #[cfg(feature = "planted-bugs")]
    if crate::planted::active(crate::planted::Bug::DedupOff) {
        return Verdict::Fresh;
    }
    match record {
        None => Verdict::Fresh,
        Some(r) if expired(r.applied_at_ms, now_ms, window_ms) => Verdict::Fresh,
        Some(r) if r.delta == delta => Verdict::Duplicate,
        Some(r) => Verdict::Conflict { recorded_delta: r.delta },
    }
}

/// The record ids among `records` that have left their window and can be removed;
/// `window_ms` gives each id's window (drain ids keep theirs shorter than event ids).
pub fn expired_ids<'a>(
    records: impl IntoIterator<Item = &'a (String, DedupRecord)>,
    now_ms: u64,
    window_ms: impl Fn(&str) -> u64,
) -> Vec<String> {
    records
        .into_iter()
        .filter(|(id, r)| expired(r.applied_at_ms, now_ms, window_ms(id)))
        .map(|(id, _)| id.clone())
        .collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    const W: u64 = 86_400_000;

    #[test]
    fn fresh_duplicate_conflict() {
        let r = DedupRecord { delta: 3, applied_at_ms: 1_000 };
        assert_eq!(judge(None, 3, 1_000, W), Verdict::Fresh);
        assert_eq!(judge(Some(&r), 3, 2_000, W), Verdict::Duplicate);
        assert_eq!(judge(Some(&r), 4, 2_000, W), Verdict::Conflict { recorded_delta: 3 });
    }

    #[test]
    fn the_window_ends_exactly_at_its_length() {
        let r = DedupRecord { delta: 1, applied_at_ms: 1_000 };
        assert_eq!(judge(Some(&r), 1, 1_000 + W - 1, W), Verdict::Duplicate);
        assert_eq!(judge(Some(&r), 1, 1_000 + W, W), Verdict::Fresh);
        // A conflicting delta after expiry is just a new increment.
        assert_eq!(judge(Some(&r), 9, 1_000 + W, W), Verdict::Fresh);
        // A zero window remembers nothing.
        assert_eq!(judge(Some(&r), 1, 1_000, 0), Verdict::Fresh);
        // A clock that steps backwards never expires a record early.
        assert_eq!(judge(Some(&r), 1, 0, W), Verdict::Duplicate);
    }

    #[test]
    fn sweep_selects_only_expired_records() {
        let recs = vec![
            ("a".to_string(), DedupRecord { delta: 1, applied_at_ms: 0 }),
            ("b".to_string(), DedupRecord { delta: 1, applied_at_ms: 500 }),
        ];
        assert_eq!(expired_ids(&recs, 1_000, |_| 600), vec!["a".to_string()]);
        assert!(expired_ids(&recs, 1_000, |_| 2_000).is_empty());
    }
}
