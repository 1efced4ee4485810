//! Process-level tests of the transport: real nodes, real TCP, real signals.
//!
//! ractor's registries are process-global, so one process hosts one node. This binary
//! re-executes itself in "child mode" (the `child_node` test with `TALLY_TRANSPORT_CHILD`
//! set): the child runs one node with an echo handler and obeys line commands on stdin
//! (`peers`, `await`, `call`, `everup`), answering on stdout with `@@`-prefixed lines. Closing
//! its stdin ends it; the [`Cluster`] guard kills every child by pid on drop, even on failure,
//! and prints the children's logs if the test failed (or always, with
//! `TALLY_TRANSPORT_TEST_LOGS=1`).
//!
//! Scenarios:
//! - `t10_all_pairs_calls_route_to_the_right_handler`: every node calls every node (itself
//!   included) and the echo proves who answered and whom it saw as the caller.
//! - `t20_killed_node_is_detected_and_reconnects_after_restart`: SIGKILL closes the sockets;
//!   peers see `Down` within the detection bound, calls fail fast, a restarted process with
//!   the same config is `Up` again within seconds.
//! - `t30_paused_node_is_detected_by_heartbeat_and_recovers`: SIGSTOP leaves the TCP sessions
//!   open (the silent failure ractor_cluster cannot see); the heartbeat detects it within the
//!   bound, calls time out instead of hanging, SIGCONT brings it back.
//! - `t40_node_with_another_fingerprint_is_refused`: a node started with a different
//!   cluster-config fingerprint never becomes `Up` anywhere, and the refusal is logged with
//!   both values.
//! - `t50_node_with_another_secret_never_connects`: ractor_cluster's cookie handshake fails;
//!   the dialer keeps retrying with backoff and the node never becomes `Up`.

use std::collections::BTreeMap;
use std::io::{BufRead, BufReader, Write};
use std::net::{SocketAddr, TcpListener};
use std::path::{Path, PathBuf};
use std::process::{Child, ChildStdin, Command, Stdio};
use std::sync::mpsc;
use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, ensure, Context, Result};
use tally_transport::{Handler, PeerState, Transport, TransportConfig, TransportError};

/// Environment variable carrying a child's node spec; its presence selects child mode.
const CHILD_ENV: &str = "TALLY_TRANSPORT_CHILD";
/// Set this to print every child's log at the end of each test, not only on failure.
const PRINT_LOGS_ENV: &str = "TALLY_TRANSPORT_TEST_LOGS";
/// The cluster secret (ractor_cluster cookie) of every well-configured test node.
const SECRET: &str = "tally-test-secret";
/// Heartbeat interval used by every test node, in ms.
const HEARTBEAT_MS: u64 = 200;
/// Misses before `Down`, for every test node.
const MISSES_MAX: u32 = 3;
/// The detection bound those settings promise: heartbeat × (misses + 1), in ms.
const DETECTION_BOUND_MS: u64 = HEARTBEAT_MS * (MISSES_MAX as u64 + 1);
/// Scheduling slack allowed on top of a stated bound on a busy 2-core machine, in ms.
const SLACK_MS: u64 = 1_200;
/// How long a fail-fast call may take, in ms.
const FAST_FAIL_MS: u64 = 150;
/// How long a cluster may take to come up (or come back), in ms. Typically 200-450 ms; the
/// margin is for machines shared with parallel compiles.
const CONVERGE_MS: u64 = 20_000;
/// How long the parent waits for a child to start, in ms.
const CHILD_START_MS: u64 = 30_000;

// ---------------------------------------------------------------------------------------
// Child mode
// ---------------------------------------------------------------------------------------

/// Not a test on its own: in child mode it runs one node until stdin closes.
#[test]
fn child_node() {
    let Ok(spec) = std::env::var(CHILD_ENV) else { return };
    let spec = NodeSpec::decode(&spec).expect("child spec");
    let runtime = tokio::runtime::Builder::new_multi_thread()
        .worker_threads(2)
        .enable_all()
        .build()
        .expect("child runtime");
    let code = match runtime.block_on(run_child(spec)) {
        Ok(()) => 0,
        Err(e) => {
            eprintln!("child failed: {e:#}");
            1
        }
    };
    std::process::exit(code);
}

/// Answers `from=<caller>;<body>`, so the caller can check who it reached and how it was seen.
struct Echo;

impl Handler for Echo {
    async fn handle(&self, from: &str, request: Vec<u8>) -> Vec<u8> {
        let mut out = format!("from={from};").into_bytes();
        out.extend(request);
        out
    }
}

async fn run_child(spec: NodeSpec) -> Result<()> {
    use tokio::io::AsyncBufReadExt;

    tracing_subscriber::fmt()
        .with_env_filter(tracing_subscriber::EnvFilter::new("info,ractor_cluster=warn"))
        .with_writer(std::io::stderr)
        .with_ansi(false)
        .init();
    let transport = Transport::start(spec.config(), Arc::new(Echo)).await?;

    // Remember every peer that was ever Up, for the fingerprint test.
    let ever_up = Arc::new(std::sync::Mutex::new(std::collections::BTreeSet::new()));
    {
        let ever_up = Arc::clone(&ever_up);
        let mut rx = transport.subscribe();
        tokio::spawn(async move {
            loop {
                for p in rx.borrow_and_update().iter().filter(|p| p.state == PeerState::Up) {
                    ever_up.lock().unwrap().insert(p.node.clone());
                }
                if rx.changed().await.is_err() {
                    break;
                }
            }
        });
    }

    say("ready");
    let mut lines = tokio::io::BufReader::new(tokio::io::stdin()).lines();
    while let Some(line) = lines.next_line().await? {
        let words: Vec<&str> = line.split_whitespace().collect();
        let [id, cmd, args @ ..] = words.as_slice() else { continue };
        let answer = match (*cmd, args) {
            ("peers", []) => transport
                .peers()
                .iter()
                .map(|p| {
                    let refused = if p.refused_fingerprint.is_some() { "!refused" } else { "" };
                    format!("{}={}{refused}", p.node, p.state.as_str())
                })
                .collect::<Vec<_>>()
                .join(" "),
            ("await", [peer, state, timeout_ms]) => {
                let start = Instant::now();
                let mut rx = transport.subscribe();
                let want = *state;
                let reached = tokio::time::timeout(Duration::from_millis(timeout_ms.parse()?), async {
                    loop {
                        if rx.borrow_and_update().iter().any(|p| p.node == *peer && p.state.as_str() == want)
                        {
                            return;
                        }
                        if rx.changed().await.is_err() {
                            std::future::pending::<()>().await;
                        }
                    }
                })
                .await;
                match reached {
                    Ok(()) => format!("ok {}", start.elapsed().as_millis()),
                    Err(_) => "timeout".to_string(),
                }
            }
            ("call", [peer, body, timeout_ms]) => {
                let start = Instant::now();
                let result = transport
                    .call(peer, body.as_bytes().to_vec(), Duration::from_millis(timeout_ms.parse()?))
                    .await;
                let ms = start.elapsed().as_millis();
                match result {
                    Ok(reply) => format!("ok {ms} {}", String::from_utf8_lossy(&reply)),
                    Err(e) => format!("err {ms} {} {e}", error_kind(&e)),
                }
            }
            ("everup", [peer]) => ever_up.lock().unwrap().contains(*peer).to_string(),
            _ => format!("unknown command {line:?}"),
        };
        say(&format!("{id} {answer}"));
    }
    transport.shutdown().await;
    Ok(())
}

fn error_kind(e: &TransportError) -> &'static str {
    match e {
        TransportError::Unreachable(_) => "Unreachable",
        TransportError::Timeout { .. } => "Timeout",
        TransportError::Disconnected(_) => "Disconnected",
        TransportError::Refused { .. } => "Refused",
        _ => "Other",
    }
}

fn say(line: &str) {
    let mut out = std::io::stdout().lock();
    let _ = writeln!(out, "@@{line}");
    let _ = out.flush();
}

// ---------------------------------------------------------------------------------------
// Parent side: node specs, processes, the cluster guard
// ---------------------------------------------------------------------------------------

/// What a child needs to run a node, passed through the environment.
#[derive(Clone, Debug)]
struct NodeSpec {
    node: String,
    listen: SocketAddr,
    fingerprint: u64,
    secret: String,
    peers: BTreeMap<String, SocketAddr>,
}

impl NodeSpec {
    fn encode(&self) -> String {
        let peers: Vec<String> = self.peers.iter().map(|(n, a)| format!("{n}={a}")).collect();
        format!("{};{};{};{};{}", self.node, self.listen, self.fingerprint, self.secret, peers.join(","))
    }

    fn decode(s: &str) -> Result<Self> {
        let parts: Vec<&str> = s.split(';').collect();
        let [node, listen, fingerprint, secret, peers] = parts.as_slice() else { bail!("bad spec {s:?}") };
        let peers = peers
            .split(',')
            .filter(|p| !p.is_empty())
            .map(|p| {
                let (n, a) = p.split_once('=').ok_or_else(|| anyhow!("bad peer {p:?}"))?;
                Ok((n.to_string(), a.parse()?))
            })
            .collect::<Result<_>>()?;
        Ok(NodeSpec {
            node: node.to_string(),
            listen: listen.parse()?,
            fingerprint: fingerprint.parse()?,
            secret: secret.to_string(),
            peers,
        })
    }

    fn config(&self) -> TransportConfig {
        TransportConfig {
            node_id: self.node.clone(),
            listen: self.listen,
            peers: self.peers.clone(),
            secret: self.secret.clone(),
            fingerprint: self.fingerprint,
            heartbeat_ms: HEARTBEAT_MS,
            heartbeat_misses_max: MISSES_MAX,
            reconnect_backoff_min_ms: 100,
            reconnect_backoff_max_ms: 1_000,
            call_timeout_ms: 1_000,
            tls: None,
        }
    }
}

/// One child process running one node.
struct NodeProc {
    child: Child,
    stdin: ChildStdin,
    lines: mpsc::Receiver<String>,
    next_id: u64,
    /// Where the child's stderr (its tracing output) goes.
    log: PathBuf,
}

/// The outcome of one `call` command.
#[derive(Debug)]
struct CallOutcome {
    ok: bool,
    elapsed_ms: u64,
    /// The reply on success; `<kind> <message>` on error.
    text: String,
}

impl NodeProc {
    fn spawn(spec: &NodeSpec, log: PathBuf) -> Result<Self> {
        let exe = std::env::current_exe()?;
        let mut child = Command::new(exe)
            .args(["child_node", "--exact", "--nocapture", "--test-threads=1"])
            .env(CHILD_ENV, spec.encode())
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(std::fs::File::create(&log)?)
            .spawn()
            .context("spawning child node")?;
        let stdin = child.stdin.take().context("child stdin")?;
        let stdout = child.stdout.take().context("child stdout")?;
        let (tx, rx) = mpsc::channel();
        std::thread::spawn(move || {
            for line in BufReader::new(stdout).lines().map_while(Result::ok) {
                // libtest may have printed "test child_node ... " on the same line.
                if let Some((_, rest)) = line.split_once("@@") {
                    if tx.send(rest.to_string()).is_err() {
                        break;
                    }
                }
            }
        });
        let node = NodeProc { child, stdin, lines: rx, next_id: 0, log };
        let first = node.lines.recv_timeout(Duration::from_millis(CHILD_START_MS));
        ensure!(first.as_deref() == Ok("ready"), "child {} did not start: {first:?}", spec.node);
        Ok(node)
    }

    fn pid(&self) -> i32 {
        self.child.id() as i32
    }

    /// Sends one command and waits up to `wait` for its answer.
    fn request(&mut self, cmd: &str, wait: Duration) -> Result<String> {
        self.next_id += 1;
        let id = self.next_id;
        writeln!(self.stdin, "{id} {cmd}")?;
        self.stdin.flush()?;
        let deadline = Instant::now() + wait;
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            let line = self.lines.recv_timeout(left).with_context(|| format!("no answer to {cmd:?}"))?;
            if let Some(rest) = line.strip_prefix(&format!("{id} ")) {
                return Ok(rest.to_string());
            }
        }
    }

    /// Waits until this node sees `peer` in `state`; returns how long the node waited, in ms.
    fn await_state(&mut self, peer: &str, state: &str, timeout_ms: u64) -> Result<u64> {
        let answer = self.request(
            &format!("await {peer} {state} {timeout_ms}"),
            Duration::from_millis(timeout_ms + 5_000),
        )?;
        match answer.strip_prefix("ok ") {
            Some(ms) => Ok(ms.parse()?),
            None => {
                let peers = self.request("peers", Duration::from_secs(5))?;
                bail!("{peer} not {state} within {timeout_ms} ms (peers: {peers})")
            }
        }
    }

    fn call(&mut self, peer: &str, body: &str, timeout_ms: u64) -> Result<CallOutcome> {
        let answer = self.request(
            &format!("call {peer} {body} {timeout_ms}"),
            Duration::from_millis(timeout_ms + 5_000),
        )?;
        let mut parts = answer.splitn(3, ' ');
        let status = parts.next().unwrap_or_default();
        let elapsed_ms = parts.next().unwrap_or_default().parse()?;
        let text = parts.next().unwrap_or_default().to_string();
        Ok(CallOutcome { ok: status == "ok", elapsed_ms, text })
    }

    fn ever_up(&mut self, peer: &str) -> Result<bool> {
        Ok(self.request(&format!("everup {peer}"), Duration::from_secs(5))? == "true")
    }
}

/// A set of child nodes that are all killed, by pid, when the guard drops.
struct Cluster {
    dir: tempfile::TempDir,
    specs: BTreeMap<String, NodeSpec>,
    nodes: BTreeMap<String, NodeProc>,
    generation: u32,
    logs: Vec<PathBuf>,
    /// Set by [`Cluster::passed`]; a guard dropped without it (panic or `Err`) prints logs.
    passed: bool,
}

/// Finds `n` free loopback ports by binding port 0 and releasing the listeners.
fn free_ports(n: usize) -> Result<Vec<u16>> {
    let listeners: Vec<TcpListener> =
        (0..n).map(|_| TcpListener::bind("127.0.0.1:0")).collect::<std::io::Result<_>>()?;
    listeners.iter().map(|l| Ok(l.local_addr()?.port())).collect()
}

/// Sends `signal` to `pid`.
#[allow(unsafe_code)]
fn send_signal(pid: i32, signal: i32) -> Result<()> {
    // SAFETY: kill(2) takes plain integers and touches no memory of ours.
    let rc = unsafe { libc::kill(pid, signal) };
    ensure!(rc == 0, "kill({pid}, {signal}) failed: {}", std::io::Error::last_os_error());
    Ok(())
}

impl Cluster {
    /// Starts one node per `(name, fingerprint)` with the shared secret, each listing all
    /// others as peers.
    fn start(nodes: &[(&str, u64)]) -> Result<Self> {
        let with_secret: Vec<(&str, u64, &str)> = nodes.iter().map(|(n, f)| (*n, *f, SECRET)).collect();
        Self::start_with_secrets(&with_secret)
    }

    /// Starts one node per `(name, fingerprint, secret)`, each listing all others as peers.
    fn start_with_secrets(nodes: &[(&str, u64, &str)]) -> Result<Self> {
        let ports = free_ports(nodes.len())?;
        let addrs: BTreeMap<String, SocketAddr> = nodes
            .iter()
            .zip(&ports)
            .map(|((name, _, _), port)| (name.to_string(), SocketAddr::from(([127, 0, 0, 1], *port))))
            .collect();
        let specs = nodes
            .iter()
            .map(|(name, fingerprint, secret)| {
                let peers = addrs.iter().filter(|(n, _)| n != name).map(|(n, a)| (n.clone(), *a)).collect();
                let spec = NodeSpec {
                    node: name.to_string(),
                    listen: addrs[*name],
                    fingerprint: *fingerprint,
                    secret: secret.to_string(),
                    peers,
                };
                (name.to_string(), spec)
            })
            .collect();
        let mut cluster = Cluster {
            dir: tempfile::tempdir()?,
            specs,
            nodes: BTreeMap::new(),
            generation: 0,
            logs: Vec::new(),
            passed: false,
        };
        for (name, _, _) in nodes {
            cluster.launch(name)?;
        }
        Ok(cluster)
    }

    fn launch(&mut self, name: &str) -> Result<()> {
        self.generation += 1;
        let log = self.dir.path().join(format!("{name}-{}.log", self.generation));
        self.logs.push(log.clone());
        let node = NodeProc::spawn(&self.specs[name], log)?;
        self.nodes.insert(name.to_string(), node);
        Ok(())
    }

    fn node(&mut self, name: &str) -> &mut NodeProc {
        self.nodes.get_mut(name).expect("node is running")
    }

    /// Waits until every running node sees every other running node (not in `except`) Up.
    fn await_all_up(&mut self, except: &[&str]) -> Result<()> {
        let names: Vec<String> = self.nodes.keys().cloned().collect();
        let start = Instant::now();
        for a in &names {
            for b in names.iter().filter(|b| *b != a && !except.contains(&b.as_str())) {
                let left = CONVERGE_MS.saturating_sub(start.elapsed().as_millis() as u64).max(1);
                self.node(a).await_state(b, "up", left).with_context(|| format!("{a} waiting for {b}"))?;
            }
        }
        eprintln!("[cluster] all up after {} ms", start.elapsed().as_millis());
        Ok(())
    }

    fn kill(&mut self, name: &str) -> Result<()> {
        let mut node = self.nodes.remove(name).context("no such node")?;
        node.child.kill()?;
        node.child.wait()?;
        Ok(())
    }

    fn signal(&mut self, name: &str, signal: i32) -> Result<()> {
        send_signal(self.node(name).pid(), signal)
    }

    /// SIGSTOP, then wait until the kernel reports the process stopped: kill(2) returns once
    /// the signal is queued, and on a busy machine the threads may run a little longer.
    fn pause(&mut self, name: &str) -> Result<()> {
        let pid = self.node(name).pid();
        send_signal(pid, libc::SIGSTOP)?;
        let deadline = Instant::now() + Duration::from_secs(5);
        loop {
            // /proc/<pid>/stat: "pid (comm) S ..."; the state follows the last ')'.
            let stat = std::fs::read_to_string(format!("/proc/{pid}/stat"))?;
            let state = stat.rsplit_once(')').and_then(|(_, rest)| rest.trim_start().chars().next());
            if state == Some('T') {
                return Ok(());
            }
            ensure!(Instant::now() < deadline, "{name} did not stop (state {state:?})");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    /// Marks the scenario as passed, so the logs are not printed.
    fn passed(&mut self) {
        self.passed = true;
    }

    fn print_logs(&self) {
        for log in &self.logs {
            let text = std::fs::read_to_string(log).unwrap_or_default();
            let lines: Vec<&str> = text.lines().collect();
            let tail = &lines[lines.len().saturating_sub(60)..];
            eprintln!("----- {} (last {} lines) -----\n{}", log.display(), tail.len(), tail.join("\n"));
        }
    }
}

impl Drop for Cluster {
    fn drop(&mut self) {
        for node in self.nodes.values_mut() {
            // SIGCONT first so a stopped child can die and be reaped; SIGKILL by pid.
            let _ = send_signal(node.pid(), libc::SIGCONT);
            let _ = node.child.kill();
            let _ = node.child.wait();
        }
        if !self.passed || std::env::var_os(PRINT_LOGS_ENV).is_some() {
            self.print_logs();
        }
    }
}

fn log_contains(path: &Path, needles: &[&str]) -> bool {
    let text = std::fs::read_to_string(path).unwrap_or_default();
    text.lines().any(|line| needles.iter().all(|n| line.contains(n)))
}

fn phase(what: &str) {
    eprintln!("[phase] {what}");
}

// ---------------------------------------------------------------------------------------
// Scenarios
// ---------------------------------------------------------------------------------------

/// Every node reaches every node, itself included, and the handler sees the true caller.
#[test]
fn t10_all_pairs_calls_route_to_the_right_handler() -> Result<()> {
    let started = Instant::now();
    let mut c = Cluster::start(&[("n1", 7), ("n2", 7), ("n3", 7)])?;
    phase("waiting for all sessions");
    c.await_all_up(&[])?;
    phase("all-pairs calls");
    for from in ["n1", "n2", "n3"] {
        for to in ["n1", "n2", "n3"] {
            let body = format!("hello-{from}-to-{to}");
            let out = c.node(from).call(to, &body, 2_000)?;
            assert!(out.ok, "{from} -> {to}: {out:?}");
            assert_eq!(out.text, format!("from={from};{body}"), "{from} -> {to}");
        }
    }
    phase("unknown node");
    let out = c.node("n1").call("nobody", "x", 500)?;
    assert!(!out.ok && out.elapsed_ms < FAST_FAIL_MS, "{out:?}");
    eprintln!("[t10] took {} ms", started.elapsed().as_millis());
    c.passed();
    Ok(())
}

/// SIGKILL: sockets close, peers see Down fast, calls fail fast; a restart reconnects.
#[test]
fn t20_killed_node_is_detected_and_reconnects_after_restart() -> Result<()> {
    let started = Instant::now();
    let mut c = Cluster::start(&[("n1", 7), ("n2", 7), ("n3", 7)])?;
    c.await_all_up(&[])?;

    phase("SIGKILL n2");
    let t0 = Instant::now();
    c.kill("n2")?;
    for observer in ["n1", "n3"] {
        c.node(observer).await_state("n2", "down", DETECTION_BOUND_MS + SLACK_MS)?;
        let seen_ms = t0.elapsed().as_millis() as u64;
        eprintln!("[t20] {observer} saw n2 down {seen_ms} ms after the kill");
        assert!(seen_ms <= DETECTION_BOUND_MS + SLACK_MS, "{observer} took {seen_ms} ms");
    }
    for observer in ["n1", "n3"] {
        let out = c.node(observer).call("n2", "x", 2_000)?;
        assert!(!out.ok && out.text.starts_with("Unreachable"), "{observer}: {out:?}");
        assert!(out.elapsed_ms < FAST_FAIL_MS, "{observer} did not fail fast: {out:?}");
    }
    // The survivors still talk to each other.
    assert!(c.node("n1").call("n3", "still", 2_000)?.ok);

    phase("restart n2 with the same config");
    let t1 = Instant::now();
    c.launch("n2")?;
    c.await_all_up(&[])?;
    eprintln!("[t20] reconnected {} ms after the restart", t1.elapsed().as_millis());
    for (a, b) in [("n1", "n2"), ("n2", "n1"), ("n3", "n2"), ("n2", "n3")] {
        let out = c.node(a).call(b, "again", 2_000)?;
        assert_eq!(out.text, format!("from={a};again"), "{a} -> {b}: {out:?}");
    }
    eprintln!("[t20] took {} ms", started.elapsed().as_millis());
    c.passed();
    Ok(())
}

/// SIGSTOP: nothing closes, only the heartbeat can tell. Calls time out, never hang.
#[test]
fn t30_paused_node_is_detected_by_heartbeat_and_recovers() -> Result<()> {
    let started = Instant::now();
    let mut c = Cluster::start(&[("n1", 7), ("n2", 7), ("n3", 7)])?;
    c.await_all_up(&[])?;

    phase("SIGSTOP n2");
    let t0 = Instant::now();
    c.pause("n2")?;
    let call_timeout_ms = 300;
    let out = c.node("n1").call("n2", "are-you-there", call_timeout_ms)?;
    eprintln!("[t30] call during the pause: {out:?}");
    assert!(!out.ok, "a paused node answered: {out:?}");
    assert!(out.elapsed_ms <= call_timeout_ms + SLACK_MS, "call overran its timeout: {out:?}");

    for observer in ["n1", "n3"] {
        c.node(observer).await_state("n2", "down", DETECTION_BOUND_MS + SLACK_MS)?;
        let seen_ms = t0.elapsed().as_millis() as u64;
        eprintln!("[t30] {observer} saw n2 down {seen_ms} ms after SIGSTOP (bound {DETECTION_BOUND_MS} ms)");
        assert!(seen_ms <= DETECTION_BOUND_MS + SLACK_MS, "{observer} took {seen_ms} ms");
    }
    let out = c.node("n3").call("n2", "x", 2_000)?;
    assert!(!out.ok && out.elapsed_ms < FAST_FAIL_MS, "calls to a down node must fail fast: {out:?}");

    phase("SIGCONT n2");
    let t1 = Instant::now();
    c.signal("n2", libc::SIGCONT)?;
    c.await_all_up(&[])?;
    eprintln!("[t30] back up {} ms after SIGCONT", t1.elapsed().as_millis());
    for (a, b) in [("n1", "n2"), ("n2", "n1"), ("n3", "n2"), ("n2", "n3")] {
        let out = c.node(a).call(b, "resumed", 2_000)?;
        assert_eq!(out.text, format!("from={a};resumed"), "{a} -> {b}: {out:?}");
    }
    eprintln!("[t30] took {} ms", started.elapsed().as_millis());
    c.passed();
    Ok(())
}

/// A node started from another cluster config is refused by everyone, loudly.
#[test]
fn t40_node_with_another_fingerprint_is_refused() -> Result<()> {
    let started = Instant::now();
    let (good, bad) = (0x1111_u64, 0x2222_u64);
    let mut c = Cluster::start(&[("n1", good), ("n2", good), ("n3", bad)])?;
    c.node("n1").await_state("n2", "up", CONVERGE_MS)?;
    c.node("n2").await_state("n1", "up", CONVERGE_MS)?;

    phase("letting the refused node retry for a few detection bounds");
    std::thread::sleep(Duration::from_millis(3 * DETECTION_BOUND_MS));
    for (a, b) in [("n1", "n3"), ("n2", "n3"), ("n3", "n1"), ("n3", "n2")] {
        assert!(!c.node(a).ever_up(b)?, "{a} saw {b} up despite the fingerprint mismatch");
    }
    let peers = c.node("n1").request("peers", Duration::from_secs(5))?;
    assert!(peers.contains("n3=down!refused"), "n1 peers: {peers}");
    let out = c.node("n1").call("n3", "x", 2_000)?;
    assert!(!out.ok && out.text.starts_with("Refused"), "{out:?}");
    assert!(out.elapsed_ms < FAST_FAIL_MS, "{out:?}");
    assert!(c.node("n1").call("n2", "fine", 2_000)?.ok);

    let n1_log = c.node("n1").log.clone();
    assert!(
        log_contains(&n1_log, &["fingerprint mismatch", "0x0000000000001111", "0x0000000000002222"]),
        "n1's log does not name both fingerprints"
    );
    eprintln!("[t40] took {} ms", started.elapsed().as_millis());
    c.passed();
    Ok(())
}

/// A node with the wrong secret fails ractor_cluster's handshake and never becomes Up.
#[test]
fn t50_node_with_another_secret_never_connects() -> Result<()> {
    let started = Instant::now();
    let mut c =
        Cluster::start_with_secrets(&[("n1", 7, SECRET), ("n2", 7, SECRET), ("n3", 7, "not-the-secret")])?;
    c.node("n1").await_state("n2", "up", CONVERGE_MS)?;
    phase("letting n3 retry for a few detection bounds");
    std::thread::sleep(Duration::from_millis(3 * DETECTION_BOUND_MS));
    for (a, b) in [("n1", "n3"), ("n2", "n3"), ("n3", "n1"), ("n3", "n2")] {
        assert!(!c.node(a).ever_up(b)?, "{a} saw {b} up despite the wrong secret");
    }
    let out = c.node("n1").call("n3", "x", 2_000)?;
    assert!(!out.ok && out.text.starts_with("Unreachable") && out.elapsed_ms < FAST_FAIL_MS, "{out:?}");
    assert!(c.node("n1").call("n2", "fine", 2_000)?.ok);
    let n1_log = c.node("n1").log.clone();
    assert!(log_contains(&n1_log, &["handshake with n3"]), "n1 did not log the failed handshakes");
    eprintln!("[t50] took {} ms", started.elapsed().as_millis());
    c.passed();
    Ok(())
}
