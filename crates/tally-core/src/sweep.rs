//! When a shard sweeps its expired dedup records, and which records a sweep reads.
//!
//! A sweep *pass* reads a shard's records in key order, a page at a time, and
//! removes every record past its window. Reading is what costs: a shard may hold
//! millions of live records (a day of event ids), and a pass every
//! `dedup_sweep_ms` would read all of them each time to find the few that expired
//! since the last one. So a pass starts only once a record is *due*: past its
//! window by an eighth of it ([`SWEEP_SLACK_DIVISOR`]). The next pass starts at the
//! earliest due among the records the last one kept and the records written since
//! it began, and never sooner than `dedup_sweep_ms` after it. A pass then removes
//! about an eighth of what a busy shard holds, so each record is read about nine
//! times in its life, whatever the number of records.
//!
//! A record is never removed before its window ends (what decides a duplicate is
//! [`crate::dedup::judge`] against the window, whether or not the record is still
//! stored), and it stays stored at most 9/8 of its window, plus a pass.
//!
//! A shard's records fall in two lanes, each with its own passes, because their
//! windows differ: the ids of drained sums sent from other nodes
//! ([`DRAIN_ID_PREFIX`], [`DRAIN_DEDUP_WINDOW_MS`]) and everything else (event ids
//! and writers' marks, the counter's window). Drain ids sort after event ids and
//! before marks, so each lane is a range of keys: the records lane steps over the
//! block of drain ids, and the drains lane ends at the first key after it.
//!
//! A drain record is aged in its *sender's* clock: its id carries the sender's clock
//! at its first send ([`crate::drain_book::drain_sender_and_time`]), and it expires
//! once the sender has first-sent another drain to the shard a whole
//! [`DRAIN_DEDUP_WINDOW_MS`] later — so the sender, which stops resending a sum
//! [`crate::drain_book::IN_DOUBT_RETRY_MS_MAX`] after its first send by the same
//! clock, can no longer resend it. Which node's clock stamped the record (the range
//! leader before a failover, or after) does not matter. A sender that stops sending
//! to the shard leaves its last records to the shard's own clock, for
//! [`DRAIN_QUIET_SENDER_WINDOW_MS`]: only a shard clock ahead of the sender's by
//! more than that window less the resend limit could forget one of them early.
//!
//! The sweeper is pure: the shard's actor reads the page [`Sweeper::due`] names and
//! hands it to [`Sweeper::take`], which answers the ids to remove.

use crate::dedup::{expired, DedupRecord};
use crate::drain_book::drain_sender_and_time;
use crate::shard::{DRAIN_DEDUP_WINDOW_MS, DRAIN_ID_PREFIX};
use std::collections::BTreeMap;

/// A record is due for a sweep once it is past its window by `window / 8`.
pub const SWEEP_SLACK_DIVISOR: u64 = 8;

/// How long, by the shard's clock, a drain record stays when its sender sent the
/// shard nothing newer to age it by (see the module docs), in milliseconds: an
/// hour, six drain windows, so only a shard clock more than 55 minutes ahead of a
/// quiet sender's could count one of its last sums twice, while the records a
/// quiet sender leaves behind (at most a drain window's) still go within the hour.
pub const DRAIN_QUIET_SENDER_WINDOW_MS: u64 = 60 * 60 * 1000;

/// The first key after every drain id: `;` follows `:`, so every id that starts
/// with `~drain:` sorts before it.
const DRAINS_END: &str = "~drain;";

/// When a record applied at `applied_at_ms`, with a window of `window_ms`, is due
/// for a sweep: an eighth of its window after it expired.
pub fn sweep_due_ms(applied_at_ms: u64, window_ms: u64) -> u64 {
    applied_at_ms.saturating_add(window_ms).saturating_add(window_ms / SWEEP_SLACK_DIVISOR)
}

/// The newest first send of each sender among the drain records of `page`: its
/// drains age by it.
fn newest_sends(page: &[(String, DedupRecord)]) -> BTreeMap<&str, u64> {
    let mut newest: BTreeMap<&str, u64> = BTreeMap::new();
    for (sender, sent) in page.iter().filter_map(|(id, _)| drain_sender_and_time(id)) {
        let at = newest.entry(sender).or_insert(sent);
        *at = (*at).max(sent);
    }
    newest
}

/// Whether record `id` is past its window at `now_ms` (`window_ms` is its lane's),
/// and the window by which it is next due if it stays. A drain that names its first
/// send ages by its sender's newest first send on the page, or else by the shard's
/// clock over [`DRAIN_QUIET_SENDER_WINDOW_MS`]; newer drains of its sender, written
/// after a pass began, bring the next pass soon enough to age it by them.
fn judge_record(
    newest: &BTreeMap<&str, u64>,
    id: &str,
    record: &DedupRecord,
    now_ms: u64,
    window_ms: u64,
) -> (bool, u64) {
    match drain_sender_and_time(id) {
        Some((sender, sent)) => {
            let aged = newest.get(sender).is_some_and(|n| expired(sent, *n, DRAIN_DEDUP_WINDOW_MS));
            let quiet = DRAIN_QUIET_SENDER_WINDOW_MS;
            (aged || expired(record.applied_at_ms, now_ms, quiet), quiet)
        }
        None => (expired(record.applied_at_ms, now_ms, window_ms), window_ms),
    }
}

/// Whether a sweep of `page` (a shard's first page of records, of a counter whose
/// window is `window_ms`) would find a record due at `now_ms`: what wakes a shard
/// that no actor runs, so that it sweeps.
pub fn any_due(page: &[(String, DedupRecord)], now_ms: u64, window_ms: u64) -> bool {
    let newest = newest_sends(page);
    page.iter().any(|(id, record)| {
        let window = crate::shard::window_for(id, window_ms);
        let (aged, due_window) = judge_record(&newest, id, record, now_ms, window);
        let by_sender = aged && drain_sender_and_time(id).is_some();
        by_sender || sweep_due_ms(record.applied_at_ms, due_window) <= now_ms
    })
}

/// The two ranges of a shard's records, each swept on its own schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lane {
    /// Event ids and writers' marks, kept for the counter's window.
    Records,
    /// Ids of drained sums from other nodes, kept for [`DRAIN_DEDUP_WINDOW_MS`].
    Drains,
}

/// One page for the shard's actor to read: its records after `after` (all of them
/// from the first when `None`), in key order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Scan {
    /// The lane the page belongs to; pass it back to [`Sweeper::take`].
    pub lane: Lane,
    /// The key the page starts after.
    pub after: Option<String>,
}

/// A pass under way.
#[derive(Debug, Clone)]
struct Pass {
    started_ms: u64,
    after: Option<String>,
    /// The earliest due among the records this pass kept so far.
    earliest_due_ms: u64,
}

#[derive(Debug, Clone)]
struct LaneState {
    /// When the next pass may start.
    next_ms: u64,
    pass: Option<Pass>,
}

/// The sweep schedule of one shard.
#[derive(Debug, Clone)]
pub struct Sweeper {
    period_ms: u64,
    records: LaneState,
    drains: LaneState,
}

impl Sweeper {
    /// A shard's schedule from `now_ms`: a pass of each lane is due at once (a shard
    /// that is started sweeps, so that one written to less often than it retires
    /// still does), and passes start at most every `period_ms`.
    pub fn new(now_ms: u64, period_ms: u64) -> Self {
        let lane = LaneState { next_ms: now_ms, pass: None };
        Self { period_ms, records: lane.clone(), drains: lane }
    }

    /// Whether a pass is under way: it goes on a page at a time until it ends.
    pub fn passing(&self) -> bool {
        self.records.pass.is_some() || self.drains.pass.is_some()
    }

    fn lane(&mut self, lane: Lane) -> &mut LaneState {
        match lane {
            Lane::Records => &mut self.records,
            Lane::Drains => &mut self.drains,
        }
    }

    /// The page to read at `now_ms`, if any: the next page of a pass under way, or the
    /// first of a pass that is due (drains first).
    pub fn due(&mut self, now_ms: u64) -> Option<Scan> {
        for lane in [Lane::Drains, Lane::Records] {
            let state = self.lane(lane);
            if state.pass.is_none() && now_ms >= state.next_ms {
                let after = match lane {
                    Lane::Records => None,
                    Lane::Drains => Some(DRAIN_ID_PREFIX.to_owned()),
                };
                state.pass = Some(Pass { started_ms: now_ms, after, earliest_due_ms: u64::MAX });
            }
            if let Some(pass) = &state.pass {
                return Some(Scan { lane, after: pass.after.clone() });
            }
        }
        None
    }

    /// Takes the page read for `lane`'s pass (`limit` was the most asked for, so a
    /// shorter page is the last) and answers the ids in it that left their window
    /// (`window_ms` is the counter's), for the shard to remove. The pass moves on,
    /// or ends and schedules the lane's next.
    pub fn take(
        &mut self,
        now_ms: u64,
        lane: Lane,
        page: &[(String, DedupRecord)],
        limit: usize,
        window_ms: u64,
    ) -> Vec<String> {
        let period_ms = self.period_ms;
        let state = self.lane(lane);
        let Some(pass) = state.pass.as_mut() else { return Vec::new() };
        let lane_window = match lane {
            Lane::Records => window_ms,
            Lane::Drains => DRAIN_DEDUP_WINDOW_MS,
        };
        let mut expired_ids = Vec::new();
        let mut ended = page.len() < limit;
        let newest = newest_sends(page);
        for (id, record) in page {
            let drain = id.starts_with(DRAIN_ID_PREFIX);
            if lane == Lane::Drains && !drain {
                // Past the block of drain ids: the lane is read.
                ended = true;
                break;
            }
            if lane == Lane::Records && drain {
                continue;
            }
            let (gone, due_window) = judge_record(&newest, id, record, now_ms, lane_window);
            if gone {
                expired_ids.push(id.clone());
            } else {
                pass.earliest_due_ms =
                    pass.earliest_due_ms.min(sweep_due_ms(record.applied_at_ms, due_window));
            }
        }
        match page.last() {
            Some((last, _)) if !ended => {
                let skip = lane == Lane::Records && last.starts_with(DRAIN_ID_PREFIX);
                pass.after = Some(if skip { DRAINS_END.to_owned() } else { last.clone() });
            }
            _ => {
                // What is written from now on is due no sooner than this.
                let written_since = sweep_due_ms(pass.started_ms, lane_window);
                let due = pass.earliest_due_ms.min(written_since);
                state.next_ms = due.max(pass.started_ms.saturating_add(period_ms));
                state.pass = None;
            }
        }
        expired_ids
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    const HOUR: u64 = 3_600_000;
    const DAY: u64 = 24 * HOUR;

    fn rec(id: &str, applied_at_ms: u64) -> (String, DedupRecord) {
        (id.to_owned(), DedupRecord { delta: 1, applied_at_ms })
    }

    /// Runs every page of the passes due at `now` over `records` (sorted by key),
    /// `limit` at a time; answers the ids removed and the number of records read.
    fn sweep(
        s: &mut Sweeper,
        now: u64,
        records: &mut Vec<(String, DedupRecord)>,
        limit: usize,
    ) -> (Vec<String>, usize) {
        let (mut removed, mut read) = (Vec::new(), 0);
        while let Some(scan) = s.due(now) {
            let page: Vec<_> = records
                .iter()
                .filter(|(id, _)| scan.after.as_ref().is_none_or(|a| id > a))
                .take(limit)
                .cloned()
                .collect();
            read += page.len();
            let gone = s.take(now, scan.lane, &page, limit, DAY);
            records.retain(|(id, _)| !gone.contains(id));
            removed.extend(gone);
        }
        (removed, read)
    }

    #[test]
    fn live_records_are_not_read_again_until_one_is_due() {
        let mut records: Vec<_> = (0..1000).map(|i| rec(&format!("e{i:04}"), i)).collect();
        let mut s = Sweeper::new(1_000, 60_000);
        let (removed, read) = sweep(&mut s, 1_000, &mut records, 100);
        assert!(removed.is_empty());
        assert_eq!(read, 1000, "a started shard reads its records once");
        // A pass a minute for the next day would read them all every minute; none
        // is due before a day and an eighth.
        for minute in 1..(DAY + DAY / 8) / 60_000 {
            let (removed, read) = sweep(&mut s, 1_000 + minute * 60_000, &mut records, 100);
            assert_eq!((removed.len(), read), (0, 0), "minute {minute}");
        }
        let due = sweep_due_ms(0, DAY);
        let (removed, read) = sweep(&mut s, due, &mut records, 100);
        assert_eq!(read, 1000);
        // Every expired record goes, due or not.
        assert_eq!(removed.len(), 1000);
    }

    /// Fixed defect: drain records aged by the shard's clock, which after a
    /// failover is another node's: a leader whose clock ran ahead of the one that
    /// stamped a record (or of the sender's) forgot it early, and a resend near the
    /// sender's limit counted twice. A record now lives until its own sender has
    /// first-sent another drain a whole window later, however far ahead the shard's
    /// clock is.
    #[test]
    fn a_drain_record_lives_its_window_in_its_senders_clock_whatever_the_shards() {
        const W: u64 = DRAIN_DEDUP_WINDOW_MS;
        let id = |seq: u64, sent: u64| format!("~drain:n1:5.1:{seq}:0@{sent}");
        // Stamped at 0 by a leader; the shard's clock now reads 40 minutes later,
        // while its sender has sent nothing newer than half a window on.
        let mut records = vec![rec(&id(1, 0), 0), rec(&id(2, W / 2), W / 2)];
        let mut s = Sweeper::new(0, 1);
        let (removed, _) = sweep(&mut s, 4 * W, &mut records, 100);
        assert!(
            removed.is_empty(),
            "aged by the sender's clock, neither record's window passed: {removed:?}"
        );
        // The sender's next drain, a window after the first: at the pass its write
        // brings, the first goes.
        records.push(rec(&id(3, W), 4 * W));
        let (removed, _) = sweep(&mut s, sweep_due_ms(4 * W, W), &mut records, 100);
        assert_eq!(removed, vec![id(1, 0)]);
        // Another sender's drains do not age this one's.
        records.push(rec("~drain:n2:9.1:1:0@99999999", 5 * W));
        let (removed, _) = sweep(&mut s, sweep_due_ms(sweep_due_ms(4 * W, W), W), &mut records, 100);
        assert!(removed.is_empty(), "{removed:?}");
        // A quiet sender's last records go by the shard's clock after an hour.
        let quiet = sweep_due_ms(W / 2, DRAIN_QUIET_SENDER_WINDOW_MS);
        let (removed, _) = sweep(&mut s, quiet, &mut records, 100);
        assert_eq!(removed, vec![id(2, W / 2)]);
        // Ids written before they carried the time age as before.
        let mut old = vec![rec("~drain:n3:1.1:4:0", 0)];
        let (removed, _) = sweep(&mut Sweeper::new(0, 1), W, &mut old, 100);
        assert_eq!(removed.len(), 1);
    }

    #[test]
    fn no_record_is_removed_before_its_window_ends() {
        let mut records = vec![rec("a", 0), rec("b", 500), rec("c", DAY / 2)];
        let mut s = Sweeper::new(0, 1);
        for now in [0, DAY - 1, DAY, DAY + 499, DAY + 500, DAY + DAY / 2 - 1] {
            sweep(&mut s, now, &mut records, 2);
            for (id, applied) in [("a", 0), ("b", 500), ("c", DAY / 2)] {
                if now < applied + DAY {
                    assert!(
                        records.iter().any(|(i, _)| i == id),
                        "{id} removed at {now}, before its window ended"
                    );
                }
            }
        }
        // By an eighth of a window after expiry, and a pass, each is gone.
        sweep(&mut s, sweep_due_ms(DAY / 2, DAY), &mut records, 2);
        assert!(records.is_empty(), "{records:?}");
    }

    #[test]
    fn records_written_after_a_pass_bound_the_next() {
        let mut records = Vec::new();
        let mut s = Sweeper::new(0, 1_000);
        sweep(&mut s, 0, &mut records, 10);
        // Written after the pass (which kept nothing): due a window and an eighth later.
        records.push(rec("late", 5));
        assert_eq!(sweep(&mut s, sweep_due_ms(0, DAY) - 1, &mut records, 10), (vec![], 0));
        let (removed, _) = sweep(&mut s, sweep_due_ms(5, DAY), &mut records, 10);
        assert_eq!(removed, ["late"]);
    }

    #[test]
    fn drain_ids_have_their_own_lane_and_window() {
        let drain = |n: u64, at| rec(&format!("{DRAIN_ID_PREFIX}node2:1:{n:03}"), at);
        let mut records = vec![rec("e1", 0), drain(1, 0), drain(2, 0), drain(3, 0), rec("~seq:w", 0)];
        records.sort_by(|a, b| a.0.cmp(&b.0));
        let mut s = Sweeper::new(0, 1_000);
        assert_eq!(sweep(&mut s, 0, &mut records, 2).0.len(), 0);
        // Ten minutes and an eighth later the drain ids go; the records lane,
        // a day long, is not read.
        let now = sweep_due_ms(0, DRAIN_DEDUP_WINDOW_MS);
        let (removed, read) = sweep(&mut s, now, &mut records, 2);
        assert_eq!(removed.len(), 3);
        assert!(removed.iter().all(|id| id.starts_with(DRAIN_ID_PREFIX)));
        assert!(read <= 4, "read {read}: the drains lane ends at the first key after it");
        assert_eq!(records.len(), 2);
        // The records lane steps over drain ids, whatever the page size.
        let mut records = vec![rec("e1", 0), drain(1, 0), drain(2, 0), drain(3, 0), rec("~seq:w", 0)];
        records.sort_by(|a, b| a.0.cmp(&b.0));
        let mut s = Sweeper::new(DAY, 1_000);
        let (removed, _) = sweep(&mut s, DAY, &mut records, 1);
        assert_eq!(removed.len(), 5, "the drains lane takes its own, the records lane the rest");
    }

    #[test]
    fn a_pass_goes_on_page_by_page_until_it_ends() {
        let mut records: Vec<_> = (0..20).map(|i| rec(&format!("e{i:02}"), 0)).collect();
        let mut s = Sweeper::new(DAY, HOUR);
        // No drain ids: that lane's pass reads an empty page.
        let drains = s.due(DAY).unwrap();
        assert_eq!(drains.lane, Lane::Drains);
        assert!(s.take(DAY, drains.lane, &[], 5, DAY).is_empty());
        let scan = s.due(DAY).unwrap();
        assert_eq!(scan, Scan { lane: Lane::Records, after: None });
        let page: Vec<_> = records[..5].to_vec();
        assert_eq!(s.take(DAY, scan.lane, &page, 5, DAY).len(), 5);
        assert!(s.passing());
        // The next page comes at the next tick, not an hour later.
        assert_eq!(s.due(DAY + 1).unwrap().after.as_deref(), Some("e04"));
        records.drain(..5);
        sweep(&mut s, DAY + 1, &mut records, 5);
        assert!(records.is_empty());
        assert!(!s.passing());
    }
}
