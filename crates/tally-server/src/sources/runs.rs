//! [`RunBook`]: the record of every reconciliation this node ran, per counter, for
//! `GET /v1/counters/{name}/reconciliations` and the `tally_drift` and
//! `tally_reconcile_runs_total` metrics.
//!
//! The book is bounded ([`RUNS_PER_COUNTER_MAX`] runs of each of at most
//! [`RUN_COUNTERS_MAX`] counters, the least recently reconciled dropped first) and
//! persisted as one JSON file in the node's data directory, rewritten whole (to a
//! temporary file, then renamed) after each source's run, so a restart keeps the
//! history. A file that cannot be read is set aside and the book starts empty:
//! the history is an operator's aid, never a reason not to start.

use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, VecDeque};
use std::path::{Path, PathBuf};
use tally_engine::{ReconcileReport, TallyError};

/// Runs kept per counter (the most recent).
pub const RUNS_PER_COUNTER_MAX: usize = 32;
/// Counters whose runs are kept; the least recently reconciled is dropped first.
pub const RUN_COUNTERS_MAX: usize = 10_000;
/// Counters `tally_drift` reports (the most recently reconciled), so the metrics
/// page stays small on a node with many counters.
pub const DRIFT_METRIC_COUNTERS_MAX: usize = 100;
/// Longest error text kept in a run record, in bytes.
pub const RUN_ERROR_BYTES_MAX: usize = 1_024;
/// The book's file name inside the node's data directory.
pub const RUNS_FILE: &str = "reconciliations.json";

/// How one reconciliation of one counter ended.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum RunOutcome {
    /// Drift was found and a correction written.
    Corrected,
    /// The counter already equalled the authoritative total.
    InSync,
    /// The source could not give a complete total (query error, unreadable file);
    /// nothing was written.
    SourceFailed,
    /// Some shard did not answer, so the counter's own total was incomplete (503);
    /// nothing was written.
    Unavailable,
    /// The drift exceeded what one correction may write (422); nothing was written.
    DriftOutOfRange,
    /// The counter disappeared between listing and reconciling.
    NotFound,
    /// Any other refusal by the engine; nothing was written.
    Failed,
}

impl RunOutcome {
    /// Every outcome, in the order the metrics list them.
    pub const ALL: [RunOutcome; 7] = [
        Self::Corrected,
        Self::InSync,
        Self::SourceFailed,
        Self::Unavailable,
        Self::DriftOutOfRange,
        Self::NotFound,
        Self::Failed,
    ];

    /// The outcome's name in JSON and metrics labels.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Corrected => "corrected",
            Self::InSync => "in_sync",
            Self::SourceFailed => "source_failed",
            Self::Unavailable => "unavailable",
            Self::DriftOutOfRange => "drift_out_of_range",
            Self::NotFound => "not_found",
            Self::Failed => "failed",
        }
    }
}

/// One reconciliation of one counter, as `GET /v1/counters/{name}/reconciliations`
/// shows it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct RunRecord {
    /// When the run read the counter, in Unix milliseconds.
    pub at_ms: u64,
    /// The source of truth's name, or `request` for `POST …/reconcile`.
    pub source: String,
    /// The node that ran it.
    pub node: String,
    /// The counter's sum of shards before correcting, when it was read.
    pub before: Option<i128>,
    /// The source's total, when it could be read.
    pub authoritative: Option<i128>,
    /// `authoritative - before`, when both are known.
    pub drift: Option<i128>,
    /// Whether a correction was written.
    pub corrected: bool,
    /// How the run ended.
    pub outcome: RunOutcome,
    /// Why it failed, if it did.
    pub error: Option<String>,
}

impl RunRecord {
    /// The record of a reconciliation the engine answered.
    pub fn from_engine(
        at_ms: u64,
        source: &str,
        node: &str,
        authoritative: i128,
        result: &Result<ReconcileReport, TallyError>,
    ) -> Self {
        let (before, drift, corrected, outcome, error) = match result {
            Ok(r) => (
                Some(r.before),
                Some(r.drift),
                r.corrected,
                if r.corrected { RunOutcome::Corrected } else { RunOutcome::InSync },
                None,
            ),
            Err(e) => {
                let outcome = match e {
                    TallyError::Unavailable { .. } => RunOutcome::Unavailable,
                    TallyError::DriftOutOfRange { .. } => RunOutcome::DriftOutOfRange,
                    TallyError::NotFound(_) => RunOutcome::NotFound,
                    _ => RunOutcome::Failed,
                };
                (None, None, false, outcome, Some(e.to_string()))
            }
        };
        let mut record = Self {
            at_ms,
            source: source.into(),
            node: node.into(),
            before,
            authoritative: Some(authoritative),
            drift,
            corrected,
            outcome,
            error,
        };
        record.clip_error();
        record
    }

    /// The record of a run whose source could not give a complete total.
    pub fn source_failed(at_ms: u64, source: &str, node: &str, error: &str) -> Self {
        let mut record = Self {
            at_ms,
            source: source.into(),
            node: node.into(),
            before: None,
            authoritative: None,
            drift: None,
            corrected: false,
            outcome: RunOutcome::SourceFailed,
            error: Some(error.into()),
        };
        record.clip_error();
        record
    }

    fn clip_error(&mut self) {
        if let Some(e) = &mut self.error {
            if e.len() > RUN_ERROR_BYTES_MAX {
                let mut cut = RUN_ERROR_BYTES_MAX;
                while !e.is_char_boundary(cut) {
                    cut -= 1;
                }
                e.truncate(cut);
            }
        }
    }
}

/// The book's contents, as persisted.
#[derive(Debug, Default, Serialize, Deserialize)]
struct Book {
    /// Per counter: the sequence number of its latest run, and its runs (oldest first).
    counters: BTreeMap<String, (u64, VecDeque<RunRecord>)>,
    /// Sequence of the latest run recorded.
    seq: u64,
    /// Runs recorded since this process started, by outcome (not persisted).
    #[serde(skip)]
    outcomes: BTreeMap<RunOutcome, u64>,
}

/// The bounded, persisted record of reconciliations. Cheap to share behind an `Arc`.
#[derive(Debug)]
pub struct RunBook {
    book: Mutex<Book>,
    /// Where the book is persisted; `None` keeps it in memory only (tests).
    path: Option<PathBuf>,
}

impl RunBook {
    /// An empty book kept in memory only.
    pub fn in_memory() -> Self {
        Self { book: Mutex::new(Book::default()), path: None }
    }

    /// The book persisted in `data_dir`, loaded from its file if one is there.
    pub fn open(data_dir: &Path) -> Self {
        let path = data_dir.join(RUNS_FILE);
        let book = match std::fs::read(&path) {
            Ok(bytes) => match serde_json::from_slice::<Book>(&bytes) {
                Ok(book) => book,
                Err(e) => {
                    let aside = path.with_extension("json.unreadable");
                    tracing::warn!(file = %path.display(), error = %e, "reconciliation history unreadable; set aside, starting empty");
                    let _ = std::fs::rename(&path, aside);
                    Book::default()
                }
            },
            Err(_) => Book::default(),
        };
        Self { book: Mutex::new(book), path: Some(path) }
    }

    /// Records one run of `counter`.
    pub fn record(&self, counter: &str, run: RunRecord) {
        let mut b = self.book.lock();
        b.seq += 1;
        let seq = b.seq;
        *b.outcomes.entry(run.outcome).or_default() += 1;
        let entry = b.counters.entry(counter.to_string()).or_default();
        entry.0 = seq;
        entry.1.push_back(run);
        while entry.1.len() > RUNS_PER_COUNTER_MAX {
            entry.1.pop_front();
        }
        if b.counters.len() > RUN_COUNTERS_MAX {
            let oldest = b.counters.iter().min_by_key(|(_, (s, _))| *s).map(|(k, _)| k.clone());
            if let Some(k) = oldest {
                b.counters.remove(&k);
            }
        }
    }

    /// The recent runs of `counter`, newest first.
    pub fn runs(&self, counter: &str) -> Vec<RunRecord> {
        let b = self.book.lock();
        b.counters.get(counter).map(|(_, runs)| runs.iter().rev().cloned().collect()).unwrap_or_default()
    }

    /// The latest measured drift of the most recently reconciled counters (at most
    /// [`DRIFT_METRIC_COUNTERS_MAX`]), in name order.
    pub fn latest_drifts(&self) -> Vec<(String, i128)> {
        let b = self.book.lock();
        let mut recent: Vec<(u64, &String, i128)> = b
            .counters
            .iter()
            .filter_map(|(name, (seq, runs))| {
                runs.iter().rev().find_map(|r| r.drift).map(|d| (*seq, name, d))
            })
            .collect();
        recent.sort_by_key(|r| std::cmp::Reverse(r.0));
        recent.truncate(DRIFT_METRIC_COUNTERS_MAX);
        let mut out: Vec<(String, i128)> = recent.into_iter().map(|(_, n, d)| (n.clone(), d)).collect();
        out.sort();
        out
    }

    /// Runs recorded since this process started, per outcome (every outcome listed).
    pub fn outcome_totals(&self) -> Vec<(RunOutcome, u64)> {
        let b = self.book.lock();
        RunOutcome::ALL.iter().map(|o| (*o, b.outcomes.get(o).copied().unwrap_or(0))).collect()
    }

    /// Writes the book to its file (a temporary file, then a rename). A failure is
    /// logged: the runs stay in memory.
    pub fn persist(&self) {
        let Some(path) = &self.path else { return };
        let bytes = match serde_json::to_vec(&*self.book.lock()) {
            Ok(b) => b,
            Err(e) => {
                tracing::warn!(error = %e, "cannot encode the reconciliation history");
                return;
            }
        };
        let tmp = path.with_extension("json.tmp");
        let written = std::fs::write(&tmp, bytes).and_then(|()| std::fs::rename(&tmp, path));
        if let Err(e) = written {
            tracing::warn!(file = %path.display(), error = %e, "cannot persist the reconciliation history");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(at_ms: u64, drift: i128) -> RunRecord {
        let report = ReconcileReport { before: 10, drift, corrected: drift != 0 };
        RunRecord::from_engine(at_ms, "s", "n1", 10 + drift, &Ok(report))
    }

    #[test]
    fn runs_are_bounded_newest_first_and_persisted() {
        let dir = tempfile::tempdir().unwrap();
        let book = RunBook::open(dir.path());
        for i in 0..(RUNS_PER_COUNTER_MAX as u64 + 5) {
            book.record("likes:1", run(i, 1));
        }
        book.record("likes:1", run(1_000, 0));
        let runs = book.runs("likes:1");
        assert_eq!(runs.len(), RUNS_PER_COUNTER_MAX);
        assert_eq!((runs[0].at_ms, runs[0].outcome), (1_000, RunOutcome::InSync));
        assert_eq!(book.latest_drifts(), vec![("likes:1".to_string(), 0)]);
        book.persist();
        let again = RunBook::open(dir.path());
        assert_eq!(again.runs("likes:1"), runs);
        std::fs::write(dir.path().join(RUNS_FILE), b"{not json").unwrap();
        assert!(RunBook::open(dir.path()).runs("likes:1").is_empty());
    }

    #[test]
    fn engine_refusals_become_outcomes() {
        let e = TallyError::Unavailable { shard: "x/0".into(), reason: "down".into() };
        let r = RunRecord::from_engine(1, "s", "n1", 5, &Err(e));
        assert_eq!((r.outcome, r.corrected, r.before), (RunOutcome::Unavailable, false, None));
        let f = RunRecord::source_failed(1, "s", "n1", &"x".repeat(5_000));
        assert_eq!(f.error.map(|e| e.len()), Some(RUN_ERROR_BYTES_MAX));
    }
}
