//! An event-log source of truth: a directory of JSON-lines files, one event
//! `{"event_id": "e-1", "counter": "views:9", "delta": 1}` per line (`event_id` is
//! optional; other fields are ignored), recounted from the start on every run.
//!
//! The recount streams: it holds one line at a time, one total per counter that
//! matches the source's pattern, and the event ids of the current and the previous
//! file only. An event id seen again in either (for the same counter) is a retry
//! and counts once; the same id with another delta is a producer bug, and the run
//! fails rather than guess. The window is exact for producers whose retries land in
//! the file they first wrote to or the next one (a writer that rotates files by
//! size or time and retries within seconds); a retry written two or more files
//! later would count twice. Any unreadable file, malformed line, or bound exceeded
//! fails the whole run, so a run either has a complete total or corrects nothing.

use super::config::Pattern;
use serde::Deserialize;
use std::collections::{BTreeMap, HashMap};
use std::io::{BufRead, BufReader, Read};
use std::path::{Path, PathBuf};
use tally_core::name::EVENT_ID_LEN_MAX;

/// Longest event line, in bytes: a longer one fails the run (it is not an event).
pub const EVENT_LINE_BYTES_MAX: usize = 64 * 1024;
/// Most event ids one file may hold: the dedup window keeps two files' ids in
/// memory (about 300 bytes each at most), so this bounds the window to a few
/// hundred MiB in the worst case. A file with more fails the run: rotate sooner.
pub const EVENT_LOG_FILE_IDS_MAX: usize = 1_000_000;
/// Most distinct counters one recount may total (one `i128` and a name each).
pub const EVENT_LOG_COUNTERS_MAX: usize = 1_000_000;
/// Most files one directory may hold.
pub const EVENT_LOG_FILES_MAX: usize = 100_000;

/// Why an event log could not give complete totals.
#[derive(Debug, thiserror::Error)]
pub enum EventLogError {
    /// The directory or a file could not be read.
    #[error("cannot read {path}: {reason}")]
    Io {
        /// The directory or file.
        path: PathBuf,
        /// The operating system's explanation.
        reason: String,
    },
    /// A line is not an event.
    #[error("{path}:{line}: {reason}")]
    Malformed {
        /// The file.
        path: PathBuf,
        /// 1-based line number.
        line: u64,
        /// What is wrong.
        reason: String,
    },
    /// A bound of the recount was exceeded.
    #[error("{0}")]
    Limit(String),
}

/// One event line.
#[derive(Debug, Deserialize)]
struct Event {
    #[serde(default)]
    event_id: Option<String>,
    counter: String,
    delta: i64,
}

/// The result of one recount.
#[derive(Debug, Default, PartialEq, Eq)]
pub struct Recount {
    /// The total of every counter that matches the pattern and has events.
    pub totals: BTreeMap<String, i128>,
    /// Files read.
    pub files: usize,
    /// Events counted.
    pub events: u64,
    /// Retries dropped by event id.
    pub duplicates: u64,
}

/// Recounts the `*.jsonl` files of `dir` (in name order) for the counters that
/// match `pattern`. Blocking: run it on a blocking thread.
pub fn recount(dir: &Path, pattern: &Pattern) -> Result<Recount, EventLogError> {
    let io = |path: &Path, e: std::io::Error| EventLogError::Io {
        path: path.to_path_buf(),
        reason: e.to_string(),
    };
    let mut files = Vec::new();
    for entry in std::fs::read_dir(dir).map_err(|e| io(dir, e))? {
        let entry = entry.map_err(|e| io(dir, e))?;
        let path = entry.path();
        if path.extension().is_some_and(|x| x == "jsonl") {
            files.push(path);
            if files.len() > EVENT_LOG_FILES_MAX {
                return Err(EventLogError::Limit(format!(
                    "{} holds more than {EVENT_LOG_FILES_MAX} files",
                    dir.display()
                )));
            }
        }
    }
    files.sort();
    let mut out = Recount { files: files.len(), ..Recount::default() };
    let mut previous: HashMap<(String, String), i64> = HashMap::new();
    for path in &files {
        let file = std::fs::File::open(path).map_err(|e| io(path, e))?;
        let mut current: HashMap<(String, String), i64> = HashMap::new();
        let mut reader = BufReader::new(file);
        let mut line = Vec::new();
        let mut number = 0u64;
        loop {
            line.clear();
            let n = (&mut reader)
                .take(EVENT_LINE_BYTES_MAX as u64 + 1)
                .read_until(b'\n', &mut line)
                .map_err(|e| io(path, e))?;
            if n == 0 {
                break;
            }
            number += 1;
            let bad = |reason: String| EventLogError::Malformed { path: path.clone(), line: number, reason };
            if line.len() > EVENT_LINE_BYTES_MAX {
                return Err(bad(format!("longer than {EVENT_LINE_BYTES_MAX} bytes")));
            }
            if line.iter().all(u8::is_ascii_whitespace) {
                continue;
            }
            let ev: Event = serde_json::from_slice(&line).map_err(|e| bad(e.to_string()))?;
            if ev.delta == 0 {
                return Err(bad("delta must not be 0".into()));
            }
            if pattern.matches(&ev.counter).is_none() {
                continue;
            }
            if let Some(id) = ev.event_id {
                if id.is_empty() || id.len() > EVENT_ID_LEN_MAX {
                    return Err(bad(format!("event_id must be 1 to {EVENT_ID_LEN_MAX} bytes")));
                }
                let key = (ev.counter.clone(), id);
                if let Some(&seen) = current.get(&key).or_else(|| previous.get(&key)) {
                    if seen != ev.delta {
                        return Err(bad(format!(
                            "event_id {:?} of {} appears with delta {seen} and {}",
                            key.1, key.0, ev.delta
                        )));
                    }
                    out.duplicates += 1;
                    continue;
                }
                if current.len() >= EVENT_LOG_FILE_IDS_MAX {
                    return Err(EventLogError::Limit(format!(
                        "{} holds more than {EVENT_LOG_FILE_IDS_MAX} event ids; rotate the log sooner",
                        path.display()
                    )));
                }
                current.insert(key, ev.delta);
            }
            if !out.totals.contains_key(&ev.counter) && out.totals.len() >= EVENT_LOG_COUNTERS_MAX {
                return Err(EventLogError::Limit(format!(
                    "more than {EVENT_LOG_COUNTERS_MAX} counters in the log"
                )));
            }
            let total = out.totals.entry(ev.counter).or_default();
            *total = total
                .checked_add(i128::from(ev.delta))
                .ok_or_else(|| bad("the total passes 128 bits".into()))?;
            out.events += 1;
        }
        previous = current;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn recounts_deduplicate_within_the_window_and_refuse_bad_lines() {
        let dir = tempfile::tempdir().unwrap();
        let p = Pattern::parse("views:{id}").unwrap();
        let w = |name: &str, text: &str| std::fs::write(dir.path().join(name), text).unwrap();
        w("a.jsonl", "{\"event_id\":\"e1\",\"counter\":\"views:1\",\"delta\":2}\n{\"counter\":\"views:1\",\"delta\":1}\n\n");
        w("b.jsonl", "{\"event_id\":\"e1\",\"counter\":\"views:1\",\"delta\":2}\n{\"event_id\":\"e1\",\"counter\":\"views:2\",\"delta\":5}\n{\"counter\":\"likes:1\",\"delta\":9}\n");
        w("ignored.txt", "not an event");
        let r = recount(dir.path(), &p).unwrap();
        assert_eq!(r.totals, BTreeMap::from([("views:1".into(), 3), ("views:2".into(), 5)]));
        assert_eq!((r.files, r.events, r.duplicates), (2, 3, 1));
        // Outside the window (two files later) a retry counts again.
        w("c.jsonl", "{\"counter\":\"views:3\",\"delta\":1}\n");
        w("d.jsonl", "{\"event_id\":\"e1\",\"counter\":\"views:1\",\"delta\":2}\n");
        assert_eq!(recount(dir.path(), &p).unwrap().totals["views:1"], 5);
        w("e.jsonl", "{\"event_id\":\"e1\",\"counter\":\"views:1\",\"delta\":3}\n");
        assert!(matches!(recount(dir.path(), &p), Err(EventLogError::Malformed { line: 1, .. })));
        w("e.jsonl", "{\"counter\":\"views:1\"}\n");
        assert!(matches!(recount(dir.path(), &p), Err(EventLogError::Malformed { .. })));
        w("e.jsonl", &"x".repeat(EVENT_LINE_BYTES_MAX + 10));
        assert!(matches!(recount(dir.path(), &p), Err(EventLogError::Malformed { .. })));
        assert!(matches!(recount(&dir.path().join("missing"), &p), Err(EventLogError::Io { .. })));
    }
}
