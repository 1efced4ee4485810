//! t90: a real crash. A child process (this test binary, re-run in child mode) writes
//! to a sled store and reports every acknowledgement on stdout; the parent kills it
//! with SIGKILL mid-stream, reopens the store, and checks invariants 1 and 3 against
//! what the child had reported.

use std::io::{BufRead, BufReader};
use std::process::{Command, Stdio};
use std::sync::atomic::{AtomicU64, Ordering::SeqCst};
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tally_engine::{Consistency, Durability, Increment, SpecPatch, Tally, TallyConfig};

const CHILD_ENV: &str = "TALLY_T90_CHILD";
const DIR_ENV: &str = "TALLY_T90_DIR";
const FLUSH_MS: u32 = 100;

fn now_ms() -> u64 {
    SystemTime::now().duration_since(UNIX_EPOCH).unwrap().as_millis() as u64
}

/// Child mode: writes until killed. `sync`: 16 writers, event ids, one line per ack.
/// `batched`: 4 writers, anonymous increments, a line with the running total of
/// acknowledgements every 500.
async fn child(mode: &str, dir: &str) {
    let tally = Tally::open(dir, TallyConfig::default()).await.unwrap();
    let patch = match mode {
        "sync" => SpecPatch { shards: Some(8), durability: Some(Durability::Sync), ..Default::default() },
        _ => SpecPatch { shards: Some(8), flush_ms: Some(FLUSH_MS), ..Default::default() },
    };
    tally.put_counter("c", patch).await.unwrap();
    println!("READY");
    let acked = Arc::new(AtomicU64::new(0));
    let writers = if mode == "sync" { 16 } else { 4 };
    let mut tasks = Vec::new();
    for w in 0..writers {
        let (t, acked, mode) = (tally.clone(), acked.clone(), mode.to_string());
        tasks.push(tokio::spawn(async move {
            for i in 0u64.. {
                if mode == "sync" {
                    let id = format!("w{w}-{i}");
                    println!("TRY {id}");
                    t.incr("c", Increment::new(1).event_id(id.clone())).await.unwrap();
                    println!("ACK {id}");
                } else {
                    t.incr("c", Increment::new(1)).await.unwrap();
                    let n = acked.fetch_add(1, SeqCst) + 1;
                    if n % 500 == 0 {
                        println!("ACKS {n} {}", now_ms());
                    }
                }
            }
        }));
    }
    for t in tasks {
        t.await.unwrap();
    }
}

/// Runs this test binary as a child in `mode`, kills it with SIGKILL after `until`
/// says so, and returns every stdout line it wrote.
fn run_and_kill(
    test: &str,
    mode: &str,
    dir: &std::path::Path,
    until: impl Fn(&[String]) -> bool,
) -> (Vec<String>, u64) {
    let mut child = Command::new(std::env::current_exe().unwrap())
        .args([test, "--exact", "--nocapture", "--test-threads=1"])
        .env(CHILD_ENV, mode)
        .env(DIR_ENV, dir)
        .stdout(Stdio::piped())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let mut lines = Vec::new();
    let mut reader = BufReader::new(child.stdout.take().unwrap());
    let deadline = Instant::now() + Duration::from_secs(60);
    let mut line = String::new();
    while !until(&lines) {
        assert!(Instant::now() < deadline, "child made too little progress");
        line.clear();
        if reader.read_line(&mut line).unwrap() == 0 {
            panic!("child exited early: {:?}", lines.last());
        }
        lines.push(line.trim_end().to_string());
    }
    child.kill().unwrap(); // SIGKILL on Unix: no destructors, no flush.
    let killed_at = now_ms();
    child.wait().unwrap();
    // What the child printed before it died is still in the pipe.
    for l in reader.lines() {
        lines.push(l.unwrap());
    }
    (lines, killed_at)
}

fn child_mode() -> Option<(String, String)> {
    Some((std::env::var(CHILD_ENV).ok()?, std::env::var(DIR_ENV).ok()?))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_mid_stream_loses_no_acknowledged_sync_increment() {
    if let Some((mode, dir)) = child_mode() {
        return child(&mode, &dir).await;
    }
    for round in 0..3 {
        let dir = tempfile::tempdir().unwrap();
        let acks_wanted = 1_000 + round * 700;
        let (lines, _) = run_and_kill(
            "sigkill_mid_stream_loses_no_acknowledged_sync_increment",
            "sync",
            dir.path(),
            |l| l.iter().filter(|x| x.starts_with("ACK ")).count() >= acks_wanted,
        );
        let acked: Vec<&str> = lines.iter().filter_map(|l| l.strip_prefix("ACK ")).collect();
        let tried = lines.iter().filter(|l| l.starts_with("TRY ")).count();
        let tally = Tally::open(dir.path(), TallyConfig::default()).await.unwrap();
        let value = tally.read("c", Consistency::Fresh).await.unwrap().value;
        assert!(value >= acked.len() as i128, "round {round}: value {value} < {} acknowledged", acked.len());
        assert!(value <= tried as i128, "round {round}: value {value} > {tried} attempted");
        for id in &acked {
            let o = tally.incr("c", Increment::new(1).event_id(*id)).await.unwrap();
            assert!(o.duplicate, "round {round}: acknowledged {id} was not remembered");
        }
        assert_eq!(tally.read("c", Consistency::Fresh).await.unwrap().value, value);
        // Retried, every increment the child tried counts once: an unacknowledged one
        // that reached the disk answers duplicate, one that did not is applied now.
        let tried: Vec<&str> = lines.iter().filter_map(|l| l.strip_prefix("TRY ")).collect();
        let mut applied_now = 0;
        for id in &tried {
            if !tally.incr("c", Increment::new(1).event_id(*id)).await.unwrap().duplicate {
                applied_now += 1;
            }
        }
        let after = tally.read("c", Consistency::Fresh).await.unwrap().value;
        assert_eq!(after, value + applied_now, "round {round}");
        assert_eq!(after, tried.len() as i128, "round {round}: every tried increment counts once");
        tally.shutdown().await.unwrap();
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sigkill_loses_at_most_the_open_batched_window() {
    if let Some((mode, dir)) = child_mode() {
        return child(&mode, &dir).await;
    }
    let dir = tempfile::tempdir().unwrap();
    let started = now_ms();
    let (lines, killed_at) =
        run_and_kill("sigkill_loses_at_most_the_open_batched_window", "batched", dir.path(), |l| {
            l.last().is_some_and(|x| x.starts_with("ACKS ")) && now_ms() > started + 1_500
        });
    let reports: Vec<(u64, u64)> = lines
        .iter()
        .filter_map(|l| l.strip_prefix("ACKS "))
        .map(|r| {
            let mut it = r.split(' ').map(|x| x.parse::<u64>().unwrap());
            (it.next().unwrap(), it.next().unwrap())
        })
        .collect();
    let last_reported = reports.last().unwrap().0;
    // Everything acknowledged more than one window (plus the flush in flight and slack
    // for a loaded 2-core machine) before the kill must have survived.
    let window_ms = u64::from(FLUSH_MS) + 5 + 300;
    let must_survive =
        reports.iter().filter(|(_, at)| *at + window_ms < killed_at).map(|(n, _)| *n).max().unwrap_or(0);
    let tally = Tally::open(dir.path(), TallyConfig::default()).await.unwrap();
    let value = tally.read("c", Consistency::Fresh).await.unwrap().value as u64;
    assert!(value >= must_survive, "lost more than the window: {value} < {must_survive}");
    // Never more than was acknowledged (at most one report interval per writer past the last line).
    assert!(value <= last_reported + 500 + 4, "double counted: {value} > {last_reported} + 504");
    assert!(must_survive > 1_000, "the child barely ran: {must_survive}");
    tally.shutdown().await.unwrap();
}
