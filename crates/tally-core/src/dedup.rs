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

/// Prefix of a writer's sequence mark among a shard's dedup records: `~` is outside
/// the event-id alphabet (see [`crate::name`]), so no event id takes this key, and
/// it sorts after `~drain:` ids.
pub const MARK_ID_PREFIX: &str = "~seq:";
/// Largest sequence number a sequenced increment may carry: a mark is kept in a
/// [`DedupRecord`]'s `delta` field, which is an `i64`.
pub const SEQ_MAX: u64 = i64::MAX as u64;
/// Most writers whose marks one shard keeps. A sequenced increment from a writer with
/// no mark in a shard that holds this many is refused (retryable once marks expire,
/// or on another writer id routed elsewhere); writers that already hold a mark are
/// never refused. 65,536 marks are a few MiB of disk per shard at most.
pub const WRITERS_PER_SHARD_MAX: u64 = 1 << 16;

/// The record id of `writer`'s sequence mark.
pub fn mark_id(writer: &str) -> String {
    let mut id = String::with_capacity(MARK_ID_PREFIX.len() + writer.len());
    id.push_str(MARK_ID_PREFIX);
    id.push_str(writer);
    id
}

/// Whether a record id is a writer's sequence mark.
pub fn is_mark_id(id: &str) -> bool {
    id.starts_with(MARK_ID_PREFIX)
}

/// Whether a dedup record's id is a client's event id, which counts against the
/// counter's event-id quota: the ids the node makes itself (writer marks, drains,
/// corrections) start with `~`, which a client's id cannot.
pub fn is_client_event_id(id: &str) -> bool {
    !id.starts_with('~')
}

/// A writer's high-water mark: the highest sequence applied for it in a shard, and
/// when. Stored as a [`DedupRecord`] under [`mark_id`] (`delta` holds the sequence),
/// so every path that carries dedup records — the commit, a hand-off, the lookups in
/// sealed generations — carries marks with no code of its own.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct WriterMark {
    /// The highest sequence applied.
    pub seq: u64,
    /// When it was applied, in milliseconds since the Unix epoch; the mark expires
    /// `dedup_window_s` later.
    pub applied_at_ms: u64,
}

impl WriterMark {
    /// The mark a stored record holds (`None` for a negative `delta`, which no mark
    /// writes).
    pub fn from_record(r: &DedupRecord) -> Option<Self> {
        u64::try_from(r.delta).ok().map(|seq| Self { seq, applied_at_ms: r.applied_at_ms })
    }

    /// The record that stores the mark. `seq` is at most [`SEQ_MAX`], so it fits.
    pub fn to_record(self) -> DedupRecord {
        DedupRecord { delta: i64::try_from(self.seq).unwrap_or(i64::MAX), applied_at_ms: self.applied_at_ms }
    }
}

/// What to do with a sequenced increment, given its writer's mark.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SeqVerdict {
    /// The next sequence (or the writer has no live mark): apply it and move the mark.
    Fresh,
    /// At or below the mark: applied before, answer "duplicate".
    Duplicate,
    /// Beyond the next sequence: an earlier one is missing. Refused, counting nothing;
    /// the writer retries once the earlier ones are answered.
    OutOfOrder {
        /// The sequence the shard takes next.
        expected: u64,
    },
}

/// Judges sequence `seq` against the writer's mark record, if any. A writer with no
/// live mark (never seen, or idle past the window) starts at whatever it sends; with
/// a mark `m`, `m + 1` is applied, anything `<= m` is a duplicate and anything
/// beyond `m + 1` is out of order.
pub fn judge_seq(record: Option<&DedupRecord>, seq: u64, now_ms: u64, window_ms: u64) -> SeqVerdict {
    #[cfg(feature = "planted-bugs")]
    if crate::planted::active(crate::planted::Bug::DedupOff) {
        return SeqVerdict::Fresh;
    }
    let mark = match record {
        Some(r) if !expired(r.applied_at_ms, now_ms, window_ms) => WriterMark::from_record(r),
        _ => None,
    };
    match mark {
        None => SeqVerdict::Fresh,
        Some(m) if seq <= m.seq => SeqVerdict::Duplicate,
        Some(m) if seq == m.seq + 1 => SeqVerdict::Fresh,
        Some(m) => SeqVerdict::OutOfOrder { expected: m.seq + 1 },
    }
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
    fn marks_take_the_next_sequence_and_answer_retries_as_duplicates() {
        let m = WriterMark { seq: 7, applied_at_ms: 1_000 }.to_record();
        assert_eq!(m, DedupRecord { delta: 7, applied_at_ms: 1_000 });
        assert_eq!(WriterMark::from_record(&m), Some(WriterMark { seq: 7, applied_at_ms: 1_000 }));
        assert_eq!(judge_seq(None, 42, 2_000, W), SeqVerdict::Fresh, "a new writer starts anywhere");
        assert_eq!(judge_seq(Some(&m), 8, 2_000, W), SeqVerdict::Fresh);
        assert_eq!(judge_seq(Some(&m), 7, 2_000, W), SeqVerdict::Duplicate);
        assert_eq!(judge_seq(Some(&m), 0, 2_000, W), SeqVerdict::Duplicate);
        assert_eq!(judge_seq(Some(&m), 9, 2_000, W), SeqVerdict::OutOfOrder { expected: 8 });
        assert_eq!(judge_seq(Some(&m), SEQ_MAX, 2_000, W), SeqVerdict::OutOfOrder { expected: 8 });
        // Past the window the mark is forgotten: the writer starts again.
        assert_eq!(judge_seq(Some(&m), 9, 1_000 + W, W), SeqVerdict::Fresh);
        assert_eq!(judge_seq(Some(&m), 7, 1_000 + W - 1, W), SeqVerdict::Duplicate);
        // A record no mark writes is no mark.
        let bad = DedupRecord { delta: -1, applied_at_ms: 1_000 };
        assert_eq!(WriterMark::from_record(&bad), None);
        assert_eq!(judge_seq(Some(&bad), 3, 2_000, W), SeqVerdict::Fresh);
        let top = WriterMark { seq: SEQ_MAX, applied_at_ms: 0 }.to_record();
        assert_eq!(top.delta, i64::MAX);
    }

    #[test]
    fn mark_ids_are_outside_the_event_id_alphabet() {
        assert_eq!(mark_id("w-1"), "~seq:w-1");
        assert!(is_mark_id(&mark_id("w")) && !is_mark_id("seq:w"));
        assert!(crate::name::check_token("event id", &mark_id("w"), 255).is_err());
        assert!(!is_mark_id(&format!("{}x", crate::shard::DRAIN_ID_PREFIX)));
    }
}
