//! t35: availability with one node of three killed and kept down.
//!
//! 16 writers send sync increments with event ids through nodes 1 and 2, retrying
//! every failure with the same id; a reader takes fresh reads through both. Node 3 is
//! killed with `kill -9` and kept down for [`OUTAGE`], then restarted. The test prints
//! what a user sees (the share of attempts acknowledged, of increments acknowledged at
//! their first attempt, of fresh reads that were complete, and how long after the kill
//! first attempts succeeded again), and checks what must hold whatever the replication:
//! after the restart every node's total is the acknowledged sum and every acknowledged
//! id answers `duplicate`.
//!
//! With one copy per shard, increments whose event id routes to a shard of the dead
//! node cannot complete until it returns, and no fresh read during the outage is
//! complete; the figures say so rather than hide it. With three copies
//! (`cluster.replicas = 3`), the dead node's range groups elect new leaders: after
//! a failover of at most 3 s, at least 99.9 % of attempts are acknowledged and
//! every fresh read is complete, also when the node comes back with an empty disk.

use serde_json::json;
use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use tally_tests::TestCluster;

/// Writers, as many as the availability target names.
const WRITERS: usize = 16;
/// How long node 3 stays down.
const OUTAGE: Duration = Duration::from_secs(6);
/// Writing before the kill.
const WARM_UP: Duration = Duration::from_millis(1_500);
/// Pause before a failed attempt is retried.
const RETRY_PAUSE: Duration = Duration::from_millis(50);
/// Width of the windows in which the share of first attempts acknowledged is
/// measured, to find when writes recovered.
const WINDOW: Duration = Duration::from_millis(250);
/// A window in which at least this share of first attempts was acknowledged counts
/// as recovered.
const RECOVERED_SHARE: f64 = 0.99;
/// The longest failover the targets allow: from the kill until writes are
/// acknowledged again.
const FAILOVER_MAX: Duration = Duration::from_secs(3);

/// One attempt of one increment: when it was sent (since the start), whether it was
/// the increment's first attempt, whether it was acknowledged.
#[derive(Clone, Copy)]
struct Attempt {
    at: Duration,
    first: bool,
    acked: bool,
}

/// Held by each test while its cluster runs: the figures are only comparable when
/// one cluster at a time shares the machine.
static ONE_AT_A_TIME: tokio::sync::Mutex<()> = tokio::sync::Mutex::const_new(());

/// What the writers and the reader saw, and when.
struct Figures {
    /// Share of attempts acknowledged from the end of the failover until the restart.
    acked_after_failover: f64,
    /// Attempts counted in it.
    attempts_after_failover: usize,
    /// Fresh reads complete from the end of the failover until the restart, and all.
    complete_after_failover: (usize, usize),
    /// When first attempts were acknowledged again, after the kill.
    recovered: Option<Duration>,
}

/// The outage on a running three-node cluster `c`: writers and a reader run, node 3
/// is killed and kept down for [`OUTAGE`], then restarted (with an empty data
/// directory if `wipe`). Prints what a user saw, checks that nothing acknowledged
/// is lost on any node, and returns the figures.
async fn outage(c: Arc<TestCluster>, label: &str, wipe: bool) -> anyhow::Result<Figures> {
    c.put_counter(1, "balance", json!({"shards": 12, "durability": "sync"})).await?;
    let start = Instant::now();
    let stop = Arc::new(AtomicBool::new(false));
    let attempts = Arc::new(Mutex::new(Vec::<Attempt>::new()));
    let acked = Arc::new(Mutex::new(Vec::<String>::new()));
    let mut writers = Vec::new();
    for w in 0..WRITERS {
        let (c, stop, attempts, acked) = (c.clone(), stop.clone(), attempts.clone(), acked.clone());
        writers.push(tokio::spawn(async move {
            let node = 1 + w % 2;
            let mut i = 0;
            while !stop.load(SeqCst) {
                let id = format!("w{w}-{i}");
                let mut first = true;
                while !stop.load(SeqCst) {
                    let at = start.elapsed();
                    let answer = c.incr(node, "balance", json!({"delta": 1, "event_id": id})).await;
                    let ok = matches!(answer, Ok((200, _)));
                    attempts.lock().unwrap().push(Attempt { at, first, acked: ok });
                    match answer {
                        Ok((200, _)) => {
                            acked.lock().unwrap().push(id.clone());
                            break;
                        }
                        Ok((503 | 504, _)) | Err(_) => tokio::time::sleep(RETRY_PAUSE).await,
                        Ok((status, body)) => panic!("unexpected {status} {body}"),
                    }
                    first = false;
                }
                i += 1;
            }
        }));
    }
    let reads = Arc::new(Mutex::new(Vec::<(Duration, bool)>::new()));
    let incomplete = Arc::new(Mutex::new(Vec::<(Duration, String)>::new()));
    let reader = {
        let (c, stop, reads, incomplete) = (c.clone(), stop.clone(), reads.clone(), incomplete.clone());
        tokio::spawn(async move {
            let mut n = 0;
            while !stop.load(SeqCst) {
                let at = start.elapsed();
                let answer = c.fresh(1 + n % 2, "balance").await;
                let complete = matches!(&answer, Ok(v) if v["complete"] == json!(true));
                if !complete {
                    let why = match answer {
                        Ok(v) => v.to_string(),
                        Err(e) => e.to_string(),
                    };
                    let why = format!("(answered after {} ms) {why}", (start.elapsed() - at).as_millis());
                    incomplete.lock().unwrap().push((at, why));
                }
                reads.lock().unwrap().push((at, complete));
                n += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        })
    };

    tokio::time::sleep(WARM_UP).await;
    let killed_at = start.elapsed();
    c.node(3).kill();
    tokio::time::sleep(OUTAGE).await;
    let restarted_at = start.elapsed();
    if wipe {
        c.wipe(3)?;
    }
    c.restart(3).await?;
    tokio::time::sleep(Duration::from_millis(1_500)).await;
    stop.store(true, SeqCst);
    for w in writers {
        w.await?;
    }
    reader.await?;

    // What a user saw while node 3 was down.
    let attempts = attempts.lock().unwrap().clone();
    let down = |at: Duration| at >= killed_at && at < restarted_at;
    let during: Vec<Attempt> = attempts.iter().copied().filter(|a| down(a.at)).collect();
    let share = |xs: &[Attempt], f: &dyn Fn(&Attempt) -> bool| {
        let n = xs.iter().filter(|a| f(a)).count();
        (n, if n == 0 { f64::NAN } else { xs.iter().filter(|a| f(a) && a.acked).count() as f64 / n as f64 })
    };
    let (n_all, acked_all) = share(&during, &|_| true);
    let (n_first, acked_first) = share(&during, &|a| a.first);
    let recovered = recovery_after(&during, killed_at, restarted_at);
    let failover_end = killed_at + recovered.unwrap_or(restarted_at - killed_at).max(FAILOVER_MAX);
    let (n_after, acked_after) = share(&during, &|a| a.at >= failover_end);
    let reads = reads.lock().unwrap().clone();
    let reads_down: Vec<bool> = reads.iter().filter(|(at, _)| down(*at)).map(|(_, ok)| *ok).collect();
    let complete = reads_down.iter().filter(|ok| **ok).count();
    let after: Vec<bool> =
        reads.iter().filter(|(at, _)| down(*at) && *at >= failover_end).map(|(_, ok)| *ok).collect();
    let complete_after = after.iter().filter(|ok| **ok).count();
    for (at, why) in
        incomplete.lock().unwrap().iter().filter(|(at, _)| down(*at) && *at >= failover_end).take(3)
    {
        println!(
            "  {label}: incomplete fresh read {} ms after the kill: {why}",
            (*at - killed_at).as_millis()
        );
        for n in 1..=2 {
            for line in c.log(n).lines().filter(|l| l.contains("missing from a read")).take(3) {
                println!("    node{n}: {line}");
            }
        }
    }
    println!(
        "{label}: one node of three down for {} ms, {WRITERS} sync writers with event ids:",
        OUTAGE.as_millis()
    );
    println!("  attempts acknowledged:             {:6.2} % of {n_all}", acked_all * 100.0);
    println!("  first attempts acknowledged:       {:6.2} % of {n_first}", acked_first * 100.0);
    println!("  fresh reads complete:              {complete} of {}", reads_down.len());
    match recovered {
        Some(d) => println!("  first attempts ≥ 99 % again after: {} ms (the failover)", d.as_millis()),
        None => println!("  first attempts ≥ 99 % again after: not before the node returned"),
    }
    println!(
        "  after {} ms: attempts acknowledged {:6.2} % of {n_after}, fresh reads complete {complete_after} of {}",
        (failover_end - killed_at).as_millis(),
        acked_after * 100.0,
        after.len()
    );
    assert!(n_all > 100, "writers made little progress while node 3 was down: {n_all}");

    // Nothing acknowledged is lost, and every acknowledged id is remembered.
    let acked = acked.lock().unwrap().clone();
    // An id still unanswered when the writers stopped may have been applied: at most
    // one per writer.
    tally_tests::stories::assert_counted_once(&c, "balance", &acked, WRITERS, 23).await?;
    Ok(Figures {
        acked_after_failover: acked_after,
        attempts_after_failover: n_after,
        complete_after_failover: (complete_after, after.len()),
        recovered,
    })
}

/// One copy per shard: the figures say what the outage costs, and nothing is lost.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn one_node_of_three_down_what_writers_and_readers_see() -> anyhow::Result<()> {
    let _alone = ONE_AT_A_TIME.lock().await;
    let c = Arc::new(TestCluster::start(3).await?);
    outage(c, "one copy", false).await?;
    Ok(())
}

/// Three copies per shard: after a failover of at most [`FAILOVER_MAX`], writes
/// and fresh reads go on as if nothing happened.
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_copies_one_node_down_writes_and_fresh_reads_go_on() -> anyhow::Result<()> {
    let _alone = ONE_AT_A_TIME.lock().await;
    let c = Arc::new(TestCluster::start_configured(3, &[], "cluster.replicas = 3\n").await?);
    let f = outage(c, "three copies", false).await?;
    check_targets(&f);
    Ok(())
}

/// Three copies, and node 3 comes back with an empty data directory: it catches up
/// from the others, every node's fresh value is the acknowledged sum and every
/// acknowledged id is still a duplicate (checked by [`outage`]).
#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn three_copies_a_node_back_with_an_empty_disk_loses_nothing() -> anyhow::Result<()> {
    let _alone = ONE_AT_A_TIME.lock().await;
    let c = Arc::new(TestCluster::start_configured(3, &[], "cluster.replicas = 3\n").await?);
    let f = outage(c.clone(), "three copies, disk lost", true).await?;
    check_targets(&f);
    for node in 1..=3 {
        let read = c.fresh(node, "balance").await?;
        assert_eq!(read["complete"], json!(true), "node{node}: {read}");
    }
    // The emptied node runs new replicas, which the leaders promoted in place of its
    // old ones once they had caught up.
    let promoted: usize =
        (1..=3).map(|n| c.log(n).matches("making the caught-up replicas the voters").count()).sum();
    println!("  replicas of the emptied node promoted after catching up: {promoted}");
    assert!(promoted > 0, "no replica of the emptied node was promoted");
    Ok(())
}

fn check_targets(f: &Figures) {
    let recovered = f.recovered.expect("writes recovered while the node was down");
    assert!(recovered <= FAILOVER_MAX, "failover took {} ms", recovered.as_millis());
    assert!(
        f.attempts_after_failover > 100,
        "few attempts after the failover: {}",
        f.attempts_after_failover
    );
    assert!(
        f.acked_after_failover >= 0.999,
        "{:.4} of attempts acknowledged after the failover",
        f.acked_after_failover
    );
    let (complete, all) = f.complete_after_failover;
    assert!(all > 0 && complete == all, "{complete} of {all} fresh reads complete after the failover");
}

/// How long after `from` the first window of [`WINDOW`] began in which at least
/// [`RECOVERED_SHARE`] of first attempts were acknowledged, and every later window
/// until `until` too; `None` if that never happened.
fn recovery_after(attempts: &[Attempt], from: Duration, until: Duration) -> Option<Duration> {
    let windows = ((until - from).as_millis() / WINDOW.as_millis()) as u32;
    let good = |k: u32| {
        let (lo, hi) = (from + WINDOW * k, from + WINDOW * (k + 1));
        let firsts: Vec<&Attempt> = attempts.iter().filter(|a| a.first && a.at >= lo && a.at < hi).collect();
        !firsts.is_empty()
            && firsts.iter().filter(|a| a.acked).count() as f64 >= RECOVERED_SHARE * firsts.len() as f64
    };
    (0..windows).find(|&k| (k..windows).all(good)).map(|k| WINDOW * k)
}
