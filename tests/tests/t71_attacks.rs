//! t71: the listeners of a live default node under the attacks a client without a
//! token can mount — slowloris on HTTP and RESP, 10,000 connections, pipelines of
//! `COMMAND DOCS` (large replies), `CLIENT SETNAME` with names of a megabyte — while
//! a well-behaved client keeps working on both front ends. The node must keep
//! answering it within 100 ms at the 99th percentile, and be healthy after.
//!
//! The CI run attacks for [`SHORT_S`] seconds; `TALLY_ATTACK_LONG=1` attacks for
//! [`LONG_S`]. The test raises its own open-file limit (root may, with `prlimit`) so
//! it can hold its connections; where it cannot it uses what the limit allows and
//! says so. The figures are printed (`--nocapture`).

use anyhow::{Context, Result};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tally_tests::TestCluster;
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

/// Seconds of attack in the CI run, and with `TALLY_ATTACK_LONG=1`.
const SHORT_S: u64 = 6;
const LONG_S: u64 = 60;
/// Connections the flood opens (half to each front end), if the file limit allows.
const FLOOD_CONNECTIONS: usize = 10_000;
/// Tasks opening the flood's connections at once.
const FLOOD_OPENERS: usize = 32;
/// Open files the test asks for: its flood, the slow clients and some room.
const FILES_WANTED: u64 = 32_768;
/// Slow clients per front end (the CI run uses half), and the pause between their
/// bytes.
const SLOW_CLIENTS: usize = 200;
const SLOW_BYTE_MS: u64 = 500;
/// Connections sending pipelines of `COMMAND DOCS` (the CI run uses half), and
/// commands per pipeline.
const DOCS_CONNECTIONS: usize = 4;
const DOCS_PIPELINE: usize = 100;
/// Connections sending huge names (the CI run uses half), and the name's size in
/// bytes (under `resp.request_bytes_max`).
const NAME_CONNECTIONS: usize = 4;
const NAME_BYTES: usize = 1_000_000;
/// The well-behaved client's pace, and its bound.
const PROBE_EVERY_MS: u64 = 20;
const P99_MAX_MS: u128 = 100;
/// Seconds the client runs alone first, to learn what the machine gives it.
const BASELINE_S: u64 = 2;
/// An unattacked p99 up to this many milliseconds is a quiet machine, where the
/// bound above is judged; on a busier one (other builds and tests on its cores) the
/// attack may slow the client at most [`BUSY_SLOWDOWN_MAX`]-fold.
const BASELINE_QUIET_MS: u128 = 25;
const BUSY_SLOWDOWN_MAX: u32 = 50;
/// Fewest requests the client must have got answered during the attack.
const PROBES_MIN: usize = 20;

/// Raises this process's open-file limit (soft and hard) to `want`; the limit in
/// force afterwards.
fn raise_file_limit(want: u64) -> u64 {
    let pid = std::process::id().to_string();
    let _ = std::process::Command::new("prlimit")
        .args(["--pid", &pid, &format!("--nofile={want}:{want}")])
        .status();
    std::fs::read_to_string("/proc/self/limits")
        .ok()
        .and_then(|t| {
            t.lines()
                .find(|l| l.starts_with("Max open files"))
                .and_then(|l| l.split_whitespace().nth(3).and_then(|n| n.parse().ok()))
        })
        .unwrap_or(1024)
}

fn command(args: &[&[u8]]) -> Vec<u8> {
    let mut out = format!("*{}\r\n", args.len()).into_bytes();
    for a in args {
        out.extend_from_slice(format!("${}\r\n", a.len()).as_bytes());
        out.extend_from_slice(a);
        out.extend_from_slice(b"\r\n");
    }
    out
}

/// One RESP request and its one-line reply.
async fn exchange(s: &mut TcpStream, request: &[u8]) -> Result<Vec<u8>> {
    s.write_all(request).await?;
    let mut got = Vec::new();
    let mut buf = [0u8; 512];
    while !got.ends_with(b"\r\n") {
        let n = tokio::time::timeout(Duration::from_secs(5), s.read(&mut buf)).await??;
        anyhow::ensure!(n > 0, "the node closed the well-behaved client's connection");
        got.extend_from_slice(&buf[..n]);
    }
    Ok(got)
}

/// What the well-behaved client measured, per kind of request.
#[derive(Default)]
struct Probes {
    resp: Vec<Duration>,
    http: Vec<Duration>,
    fresh: Vec<Duration>,
    failures: Vec<String>,
}

fn p99(v: &mut [Duration]) -> Duration {
    v.sort();
    v.get((v.len() * 99 / 100).min(v.len().saturating_sub(1))).copied().unwrap_or_default()
}

/// The well-behaved client: an `INCR` on its RESP connection, a read over HTTP
/// keep-alive, and every tenth round a new RESP connection with a `PING`.
async fn well_behaved(resp: u16, http: String, stop: Arc<AtomicBool>) -> Result<Probes> {
    let mut p = Probes::default();
    let mut conn = TcpStream::connect(("127.0.0.1", resp)).await?;
    let client = reqwest::Client::builder().timeout(Duration::from_secs(5)).build()?;
    let incr = command(&[b"INCR", b"probe"]);
    let mut round = 0u64;
    while !stop.load(Ordering::SeqCst) {
        let t = Instant::now();
        match exchange(&mut conn, &incr).await {
            Ok(r) if r.starts_with(b":") => p.resp.push(t.elapsed()),
            Ok(r) => p.failures.push(format!("INCR answered {:?}", String::from_utf8_lossy(&r))),
            Err(e) => p.failures.push(format!("INCR: {e}")),
        }
        let t = Instant::now();
        match client.get(format!("{http}/v1/counters/probe/value")).send().await {
            Ok(r) if r.status().is_success() => p.http.push(t.elapsed()),
            Ok(r) => p.failures.push(format!("GET answered {}", r.status())),
            Err(e) => p.failures.push(format!("GET: {e}")),
        }
        if round % 10 == 0 {
            let t = Instant::now();
            let fresh = async {
                let mut s = TcpStream::connect(("127.0.0.1", resp)).await?;
                exchange(&mut s, b"PING\r\n").await
            };
            match fresh.await {
                Ok(r) if r == b"+PONG\r\n" => p.fresh.push(t.elapsed()),
                Ok(r) => p.failures.push(format!("fresh PING answered {:?}", String::from_utf8_lossy(&r))),
                Err(e) => p.failures.push(format!("fresh PING: {e}")),
            }
        }
        round += 1;
        tokio::time::sleep(Duration::from_millis(PROBE_EVERY_MS)).await;
    }
    Ok(p)
}

/// A client that sends `prefix`, then one byte of `trickle` every [`SLOW_BYTE_MS`],
/// reconnecting when closed.
async fn slowloris(
    port: u16,
    prefix: &'static [u8],
    trickle: u8,
    stop: Arc<AtomicBool>,
    closed: Arc<AtomicU64>,
) {
    while !stop.load(Ordering::SeqCst) {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)).await else {
            tokio::time::sleep(Duration::from_millis(SLOW_BYTE_MS)).await;
            continue;
        };
        if s.write_all(prefix).await.is_err() {
            continue;
        }
        while !stop.load(Ordering::SeqCst) {
            tokio::time::sleep(Duration::from_millis(SLOW_BYTE_MS)).await;
            if s.write_all(&[trickle]).await.is_err() {
                closed.fetch_add(1, Ordering::Relaxed);
                break;
            }
        }
    }
}

/// Pipelines of `command` on one connection, replies read and dropped, until stop.
async fn pipeline(port: u16, request: Arc<Vec<u8>>, stop: Arc<AtomicBool>, sent: Arc<AtomicU64>) {
    while !stop.load(Ordering::SeqCst) {
        let Ok(mut s) = TcpStream::connect(("127.0.0.1", port)).await else { continue };
        let mut sink = vec![0u8; 1 << 16];
        while !stop.load(Ordering::SeqCst) {
            if s.write_all(&request).await.is_err() {
                break;
            }
            sent.fetch_add(1, Ordering::Relaxed);
            // Read whatever came back, briefly: the node must not wait on a reader.
            let _ = tokio::time::timeout(Duration::from_millis(50), s.read(&mut sink)).await;
        }
    }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn a_node_under_attack_keeps_answering_a_well_behaved_client() -> Result<()> {
    let files = raise_file_limit(FILES_WANTED);
    let flood =
        FLOOD_CONNECTIONS.min(usize::try_from(files).unwrap_or(0).saturating_sub(2 * SLOW_CLIENTS + 500));
    if flood < FLOOD_CONNECTIONS {
        eprintln!(
            "the open-file limit is {files}: the flood opens {flood} connections, not {FLOOD_CONNECTIONS}"
        );
    }
    let long = std::env::var("TALLY_ATTACK_LONG").is_ok_and(|v| v == "1");
    let (attack_s, share) = if long { (LONG_S, 1) } else { (SHORT_S, 2) };
    let c = TestCluster::start(1).await?;
    let (resp, http) = (c.node(1).ports.resp, c.node(1).ports.http);
    let base = c.node(1).url();
    let stop = Arc::new(AtomicBool::new(false));

    // The well-behaved client alone first: what this machine gives it unattacked.
    let calm = Arc::new(AtomicBool::new(false));
    let baseline = tokio::spawn(well_behaved(resp, base.clone(), calm.clone()));
    tokio::time::sleep(Duration::from_secs(BASELINE_S)).await;
    calm.store(true, Ordering::SeqCst);
    let mut quiet = baseline.await.context("the baseline")??;
    let mut unattacked: Vec<Duration> =
        quiet.resp.drain(..).chain(quiet.http.drain(..)).chain(quiet.fresh.drain(..)).collect();
    let baseline_p99 = p99(&mut unattacked);

    // Then from before the attack to its end.
    let probe = tokio::spawn(well_behaved(resp, base.clone(), stop.clone()));
    tokio::time::sleep(Duration::from_millis(500)).await;

    // Each attack runs unless `TALLY_ATTACKS` lists others (`slow,docs,names,flood`).
    let only = std::env::var("TALLY_ATTACKS").unwrap_or_default();
    let on = |a: &str| only.is_empty() || only.split(',').any(|x| x == a);
    let mut attackers = Vec::new();
    let closed = Arc::new(AtomicU64::new(0));
    for _ in 0..if on("slow") { SLOW_CLIENTS / share } else { 0 } {
        let http_head: &'static [u8] = b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\nX-Slow: ";
        attackers.push(tokio::spawn(slowloris(http, http_head, b'a', stop.clone(), closed.clone())));
        attackers.push(tokio::spawn(slowloris(
            resp,
            b"*2\r\n$4\r\nINCR\r\n$100\r\n",
            b'a',
            stop.clone(),
            closed.clone(),
        )));
    }
    let sent = Arc::new(AtomicU64::new(0));
    let docs: Vec<u8> = (0..DOCS_PIPELINE).flat_map(|_| command(&[b"COMMAND", b"DOCS"])).collect();
    let docs = Arc::new(docs);
    for _ in 0..if on("docs") { DOCS_CONNECTIONS / share } else { 0 } {
        attackers.push(tokio::spawn(pipeline(resp, docs.clone(), stop.clone(), sent.clone())));
    }
    let name = Arc::new(command(&[b"CLIENT", b"SETNAME", &vec![b'n'; NAME_BYTES]]));
    for _ in 0..if on("names") { NAME_CONNECTIONS / share } else { 0 } {
        attackers.push(tokio::spawn(pipeline(resp, name.clone(), stop.clone(), sent.clone())));
    }
    // The flood: connections that say nothing, opened by many tasks at once for as
    // long as the attack lasts (up to `flood`), half to each front end, held to the end.
    let started = Instant::now();
    let deadline = tokio::time::Instant::now() + Duration::from_secs(attack_s);
    let opened = Arc::new(AtomicU64::new(0));
    let refused = Arc::new(AtomicU64::new(0));
    let openers = if on("flood") { FLOOD_OPENERS } else { 0 };
    let mut flooding = Vec::new();
    let claimed = Arc::new(AtomicU64::new(0));
    for _ in 0..openers {
        let (opened, refused, claimed) = (opened.clone(), refused.clone(), claimed.clone());
        flooding.push(tokio::spawn(async move {
            let mut held = Vec::new();
            loop {
                let i = claimed.fetch_add(1, Ordering::Relaxed);
                if i >= flood as u64 || tokio::time::Instant::now() >= deadline {
                    break;
                }
                let port = if i % 2 == 0 { resp } else { http };
                match tokio::time::timeout_at(deadline, TcpStream::connect(("127.0.0.1", port))).await {
                    Ok(Ok(s)) => {
                        held.push(s);
                        opened.fetch_add(1, Ordering::Relaxed);
                    }
                    Ok(Err(_)) => {
                        refused.fetch_add(1, Ordering::Relaxed);
                    }
                    Err(_) => break,
                }
            }
            tokio::time::sleep_until(deadline).await;
            held
        }));
    }
    tokio::time::sleep_until(deadline).await;
    let opened_in = started.elapsed();
    stop.store(true, Ordering::SeqCst);
    let mut probes = probe.await.context("the well-behaved client")??;
    for a in attackers {
        a.abort();
    }
    for f in flooding {
        drop(f.await);
    }
    let (opened, refused) = (opened.load(Ordering::Relaxed), refused.load(Ordering::Relaxed));
    if on("flood") && opened < flood as u64 {
        eprintln!("in {attack_s} s this machine let the flood open {opened} connections of {flood}");
    }

    let (resp_p99, http_p99, fresh_p99) =
        (p99(&mut probes.resp), p99(&mut probes.http), p99(&mut probes.fresh));
    let mut all: Vec<Duration> =
        probes.resp.iter().chain(&probes.http).chain(&probes.fresh).copied().collect();
    let all_p99 = p99(&mut all);
    eprintln!("unattacked: p99 {baseline_p99:?} over {} requests", unattacked.len());
    eprintln!(
        "attack of {attack_s} s ({opened_in:?}): {opened} flood connections opened ({refused} refused), {} slow \
         clients closed, {} pipelines sent; well-behaved client: {} requests, p99 {all_p99:?} (RESP INCR \
         {resp_p99:?}, HTTP GET {http_p99:?}, new connection + PING {fresh_p99:?}), {} failures",
        closed.load(Ordering::Relaxed),
        sent.load(Ordering::Relaxed),
        all.len(),
        probes.failures.len()
    );
    assert!(
        probes.failures.is_empty(),
        "the well-behaved client failed: {:?}",
        &probes.failures[..probes.failures.len().min(5)]
    );
    assert!(all.len() > PROBES_MIN, "too few probes: {}", all.len());
    // The bound is judged on a machine that gives the client its own pace unattacked;
    // a machine busy with other work gets a bound relative to its baseline, said so.
    if baseline_p99.as_millis() <= BASELINE_QUIET_MS {
        assert!(
            all_p99.as_millis() < P99_MAX_MS,
            "p99 {all_p99:?} under attack (unattacked {baseline_p99:?})"
        );
    } else {
        eprintln!(
            "this machine is busy (unattacked p99 {baseline_p99:?} > {BASELINE_QUIET_MS} ms): the {P99_MAX_MS} ms \
             bound is not judged; the attack may slow the client {BUSY_SLOWDOWN_MAX}-fold at most"
        );
        let bound = baseline_p99 * BUSY_SLOWDOWN_MAX;
        assert!(all_p99 < bound, "p99 {all_p99:?} under attack, unattacked {baseline_p99:?}");
    }
    // The node is whole afterwards.
    let health = reqwest::get(format!("{base}/healthz")).await?;
    assert!(health.status().is_success(), "unhealthy after the attack");
    assert!(c.node(1).pid().is_some(), "the node died");
    Ok(())
}
