//! t90: the seed's reconciliation story against real sources of truth. A `batched`
//! counter takes increments that are also written to a source (rows in a real
//! PostgreSQL, or lines of an event log); `tallyd` is killed with SIGKILL
//! mid-stream and loses its buffered window; after the restart the scheduled
//! reconciliation finds a drift equal to what was lost and corrects it, so the
//! counter equals the source, and the next run finds nothing to do (invariant 6).
//! A source that cannot give a complete total is recorded as failed and writes
//! nothing.

use anyhow::{bail, Result};
use serde_json::{json, Value};
use std::io::Write as _;
use std::path::Path;
use std::time::{Duration, Instant};
use tally_tests::{Postgres, TestCluster};

/// Rounds of increments before the kill, and increments per round.
const ROUNDS: i64 = 30;
const PER_ROUND: i64 = 20;
/// The counters' aggregation window: long enough that the kill loses some of it.
const FLUSH_MS: u64 = 1_000;
/// How long a test waits for a scheduled run.
const RUN_WAIT_MS: u64 = 30_000;

/// Appends a `[[reconcile]]` section to node 1's config (read at its next start).
fn add_source(cluster: &TestCluster, section: &str) -> Result<()> {
    let path = cluster.dir().join("node1.toml");
    let mut f = std::fs::OpenOptions::new().append(true).open(path)?;
    writeln!(f, "\n{section}")?;
    Ok(())
}

/// The recorded runs of `name` on node 1, newest first.
async fn runs(cluster: &TestCluster, name: &str) -> Result<Vec<Value>> {
    let v = cluster.get(1, &format!("/v1/counters/{name}/reconciliations")).await?;
    tally_tests::openapi::check("GET", "/v1/counters/{name}/reconciliations", 200, &v)?;
    Ok(v["runs"].as_array().cloned().unwrap_or_default())
}

/// Waits for the newest run of `name` from `source` made after `after_ms`.
async fn next_run(cluster: &TestCluster, name: &str, source: &str, after_ms: u64) -> Result<Value> {
    let deadline = Instant::now() + Duration::from_millis(RUN_WAIT_MS);
    loop {
        let found = runs(cluster, name)
            .await?
            .into_iter()
            .find(|r| r["source"] == source && r["at_ms"].as_u64().is_some_and(|t| t > after_ms));
        if let Some(run) = found {
            return Ok(run);
        }
        if Instant::now() > deadline {
            bail!("no run of {source} on {name} after {after_ms}; log:\n{}", cluster.node(1).log_tail());
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
}

/// A batch of `n` anonymous increments of 1 to `name` (buffered, so a kill loses them).
async fn incr_batch(cluster: &TestCluster, name: &str, n: i64) -> Result<()> {
    let items: Vec<Value> = (0..n).map(|_| json!({"counter": name, "delta": 1})).collect();
    let (status, body) = cluster.send(1, "POST", "/v1/increments", json!({"increments": items})).await?;
    if status != 200 || body["results"].as_array().is_none_or(|r| r.iter().any(|x| x["applied"] != true)) {
        bail!("batch refused: {status} {body}");
    }
    Ok(())
}

async fn metrics(cluster: &TestCluster) -> Result<String> {
    Ok(reqwest::get(format!("{}/metrics", cluster.node(1).url())).await?.text().await?)
}

/// After the kill and restart: the first scheduled run corrects exactly what the
/// kill lost, the counter equals `truth`, and the next run finds no drift.
async fn check_recovery(
    cluster: &TestCluster,
    name: &str,
    source: &str,
    truth: i64,
    since_ms: u64,
) -> Result<u64> {
    let run = next_run(cluster, name, source, since_ms).await?;
    assert_eq!(run["outcome"], "corrected", "{run}");
    assert_eq!(run["corrected"], true, "{run}");
    assert_eq!(run["authoritative"], json!(truth), "{run}");
    let before = run["before"].as_i64().expect("before");
    assert!(before < truth, "the kill lost nothing ({before} of {truth}): {run}");
    assert_eq!(run["drift"], json!(truth - before), "the drift is what the kill lost: {run}");
    assert_eq!(cluster.value(1, name).await?, truth);
    let again = next_run(cluster, name, source, run["at_ms"].as_u64().unwrap_or(0)).await?;
    assert_eq!(
        (&again["outcome"], &again["corrected"], &again["drift"]),
        (&json!("in_sync"), &json!(false), &json!(0))
    );
    assert_eq!(cluster.value(1, name).await?, truth);
    let text = metrics(cluster).await?;
    assert!(text.contains(&format!("tally_drift{{counter=\"{name}\"}} 0\n")), "{text}");
    assert!(text.contains("tally_reconcile_runs_total{outcome=\"corrected\"} 1\n"), "{text}");
    Ok(again["at_ms"].as_u64().unwrap_or(0))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_postgres_source_restores_what_a_sigkill_lost() -> Result<()> {
    let Some(mut pg) = Postgres::start()? else { return Ok(()) };
    let (db, conn) = tokio_postgres::connect(&pg.url(), tokio_postgres::NoTls).await?;
    tokio::spawn(conn);
    db.batch_execute("CREATE TABLE likes (post_id bigint NOT NULL, user_id bigint NOT NULL)").await?;

    let cluster = TestCluster::start(1).await?;
    cluster.put_counter(1, "likes:42", json!({"shards": 4, "flush_ms": FLUSH_MS})).await?;
    cluster.put_counter(1, "views:42", json!({})).await?;
    let mut rows = 0i64;
    for round in 0..ROUNDS {
        db.execute(
            "INSERT INTO likes SELECT 42, g FROM generate_series($1::bigint, $2::bigint) g",
            &[&rows, &(rows + PER_ROUND - 1)],
        )
        .await?;
        rows += PER_ROUND;
        incr_batch(&cluster, "likes:42", PER_ROUND).await?;
        if round + 1 < ROUNDS {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    cluster.node(1).kill();
    add_source(
        &cluster,
        &format!(
            "[[reconcile]]\nname = \"likes-db\"\ncounters = \"likes:{{id}}\"\nevery = \"2s\"\n\
             [reconcile.postgres]\nurl = \"{}\"\nquery = \"SELECT count(*) FROM likes WHERE post_id = $1\"\n\
             connect_timeout_ms = 2000\nquery_timeout_ms = 5000\n",
            pg.url()
        ),
    )?;
    let restarted_ms = tally_server_now();
    cluster.restart(1).await?;
    let last = check_recovery(&cluster, "likes:42", "likes-db", rows, restarted_ms).await?;
    assert!(runs(&cluster, "views:42").await?.is_empty(), "a counter outside the pattern is not reconciled");

    // The database goes away: the run is recorded as failed and writes nothing.
    pg.stop();
    let failed = next_run(&cluster, "likes:42", "likes-db", last).await?;
    assert_eq!(
        (&failed["outcome"], &failed["corrected"]),
        (&json!("source_failed"), &json!(false)),
        "{failed}"
    );
    assert!(failed["error"].as_str().is_some_and(|e| !e.is_empty()), "{failed}");
    assert_eq!(cluster.value(1, "likes:42").await?, rows);

    // The history survives a restart.
    cluster.node(1).stop();
    cluster.restart(1).await?;
    assert!(runs(&cluster, "likes:42").await?.iter().any(|r| r["outcome"] == "corrected"));
    Ok(())
}

/// Writes events to `dir/events-NNNN.jsonl`, rotating every few rounds; each new
/// file starts with a retry of the previous file's last event, which must count once.
struct EventWriter<'a> {
    dir: &'a Path,
    file: Option<std::fs::File>,
    files: u32,
    next_id: i64,
    last: Option<String>,
}

impl EventWriter<'_> {
    fn rotate(&mut self) -> Result<()> {
        let path = self.dir.join(format!("events-{:04}.jsonl", self.files));
        self.files += 1;
        let mut f = std::fs::File::create(path)?;
        if let Some(retry) = &self.last {
            writeln!(f, "{retry}")?;
        }
        self.file = Some(f);
        Ok(())
    }

    fn write(&mut self, counter: &str, n: i64) -> Result<()> {
        let f = self.file.as_mut().expect("rotated first");
        for _ in 0..n {
            let line = json!({"event_id": format!("ev-{}", self.next_id), "counter": counter, "delta": 1})
                .to_string();
            writeln!(f, "{line}")?;
            self.next_id += 1;
            self.last = Some(line);
        }
        f.flush()?;
        Ok(())
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn an_event_log_source_restores_what_a_sigkill_lost() -> Result<()> {
    let cluster = TestCluster::start(1).await?;
    let dir = cluster.dir().join("events");
    std::fs::create_dir_all(&dir)?;
    cluster.put_counter(1, "views:9", json!({"shards": 4, "flush_ms": FLUSH_MS})).await?;
    let mut log = EventWriter { dir: &dir, file: None, files: 0, next_id: 0, last: None };
    for round in 0..ROUNDS {
        if round % 5 == 0 {
            log.rotate()?;
        }
        log.write("views:9", PER_ROUND)?;
        incr_batch(&cluster, "views:9", PER_ROUND).await?;
        if round + 1 < ROUNDS {
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let truth = ROUNDS * PER_ROUND;
    cluster.node(1).kill();
    add_source(
        &cluster,
        &format!(
            "[[reconcile]]\nname = \"views-log\"\ncounters = \"views:{{id}}\"\nevery = \"2s\"\n\
             [reconcile.event_log]\ndir = {:?}\n",
            dir.display().to_string()
        ),
    )?;
    let restarted_ms = tally_server_now();
    cluster.restart(1).await?;
    let last = check_recovery(&cluster, "views:9", "views-log", truth, restarted_ms).await?;

    // A malformed line makes the log incomplete: recorded as failed, nothing written.
    std::fs::write(dir.join("events-9999.jsonl"), "{\"counter\": \"views:9\"}\n")?;
    let failed = next_run(&cluster, "views:9", "views-log", last).await?;
    assert_eq!(
        (&failed["outcome"], &failed["corrected"]),
        (&json!("source_failed"), &json!(false)),
        "{failed}"
    );
    assert!(failed["error"].as_str().is_some_and(|e| e.contains("events-9999.jsonl")), "{failed}");
    assert_eq!(cluster.value(1, "views:9").await?, truth);
    Ok(())
}

/// Unix milliseconds now, as the node's run records count them.
fn tally_server_now() -> u64 {
    std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64)
}
