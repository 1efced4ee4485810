//! The fixture of Tally's black-box tests: a [`TestCluster`] of real `tallyd`
//! processes on 127.0.0.1, started from generated configs, stopped by PID.
//!
//! ```text
//! let cluster = TestCluster::start(3).await?;
//! cluster.node(2).kill();          // SIGKILL
//! cluster.restart(2).await?;
//! cluster.node(3).pause();         // SIGSTOP (a silent failure), .resume() = SIGCONT
//! ```

pub mod netns;

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// How long a node may take to answer `/healthz` after it starts.
pub const NODE_START_WAIT_MS: u64 = 30_000;
/// How long a cluster may take to elect a metadata leader.
pub const LEADER_WAIT_MS: u64 = 30_000;
/// Timeout of one HTTP request from the tests.
pub const REQUEST_TIMEOUT_MS: u64 = 15_000;

/// The `tallyd` binary next to this test binary (built by `cargo test --workspace`),
/// or built on demand.
pub fn tallyd() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    // target/<profile>/deps/<test> → target/<profile>/tallyd
    let profile_dir = exe.parent().and_then(Path::parent).ok_or_else(|| anyhow!("odd test path"))?;
    let candidate = profile_dir.join("tallyd");
    if !candidate.exists() {
        let status = Command::new(env!("CARGO"))
            .args(["build", "-p", "tally-server", "--bin", "tallyd"])
            .status()
            .context("building tallyd")?;
        if !status.success() {
            bail!("cargo build of tallyd failed");
        }
    }
    Ok(candidate)
}

/// `n` distinct free ports: every listener is held until all are bound, so the
/// kernel cannot hand out one port twice (a port released at once may come back
/// from the very next bind).
fn free_ports(n: usize) -> Vec<u16> {
    let held: Vec<std::net::TcpListener> =
        (0..n).map(|_| std::net::TcpListener::bind("127.0.0.1:0").expect("a free port")).collect();
    held.iter().map(|l| l.local_addr().expect("bound").port()).collect()
}

/// How many times a cluster start is tried again, on fresh ports, when a port it
/// drew was taken before its node could bind it: ports are drawn free and released
/// for `tallyd` to bind, and in between any process may get the same one (an
/// ephemeral port of an outgoing connection, another test's `:0` listener).
const PORT_RACE_RETRIES: usize = 3;

/// Whether a start failed because a node found one of its ports taken.
fn lost_a_port_race(e: &anyhow::Error) -> bool {
    format!("{e:#}").contains("Address already in use")
}

/// A port on 127.0.0.1 that was free a moment ago.
pub fn free_port() -> u16 {
    std::net::TcpListener::bind("127.0.0.1:0")
        .and_then(|l| l.local_addr())
        .map(|a| a.port())
        .expect("a free port")
}

/// One node's addresses.
#[derive(Debug, Clone)]
pub struct Ports {
    /// HTTP.
    pub http: u16,
    /// Node-to-node.
    pub peer: u16,
    /// Raft.
    pub raft: u16,
    /// The Redis protocol (RESP).
    pub resp: u16,
}

/// One `tallyd` process.
pub struct Node {
    /// 1-based index.
    pub index: usize,
    /// Its addresses.
    pub ports: Ports,
    config: PathBuf,
    log: PathBuf,
    child: Mutex<Option<Child>>,
    scheme: &'static str,
}

impl Node {
    /// The node's base URL (`https://` in a TLS cluster).
    pub fn url(&self) -> String {
        format!("{}://127.0.0.1:{}", self.scheme, self.ports.http)
    }

    /// Its process id, if it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.lock().unwrap().as_ref().map(Child::id)
    }

    fn signal(&self, sig: i32) {
        if let Some(pid) = self.pid() {
            // Through kill(1): the workspace forbids `unsafe`, which libc::kill needs.
            let _ = Command::new("kill").arg(format!("-{sig}")).arg(pid.to_string()).status();
        }
    }

    /// SIGKILL: no flush, no goodbye. Waits for the process to be gone.
    pub fn kill(&self) {
        if let Some(mut child) = self.child.lock().unwrap().take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGTERM, then waits for a clean exit; returns its exit code.
    pub fn stop(&self) -> Option<i32> {
        self.signal(libc::SIGTERM);
        let mut child = self.child.lock().unwrap().take()?;
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            if let Ok(Some(status)) = child.try_wait() {
                return status.code();
            }
            if Instant::now() > deadline {
                let _ = child.kill();
                let _ = child.wait();
                return None;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    /// SIGSTOP: the process freezes with its sockets open (a silent failure).
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// SIGCONT.
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    /// The node's log so far (for failure messages).
    pub fn log_tail(&self) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let lines: Vec<&str> = text.lines().collect();
        lines[lines.len().saturating_sub(30)..].join("\n")
    }

    fn spawn(&self, dir: &Path) -> Result<()> {
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&self.log)?;
        let child = Command::new(tallyd()?)
            .arg("--config")
            .arg(&self.config)
            .env("RUST_LOG", "info")
            .current_dir(dir)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting tallyd")?;
        *self.child.lock().unwrap() = Some(child);
        Ok(())
    }
}

impl Drop for Node {
    fn drop(&mut self) {
        self.resume();
        self.kill();
    }
}

/// A cluster of real `tallyd` processes on 127.0.0.1.
pub struct TestCluster {
    dir: tempfile::TempDir,
    nodes: Vec<Node>,
    http: reqwest::Client,
    /// The token the fixture's own requests carry (`Authorization: Bearer`), for
    /// nodes that declare `[[tokens]]`.
    token: Option<String>,
}

/// A node's config. Lines of `extra` of the form `cluster.KEY = VALUE` go into the
/// `[cluster]` section (as `KEY = VALUE`); the rest is appended at the end.
fn config_text(ports: &[Ports], me: usize, data_dir: &Path, spares: &[usize], extra: &str) -> String {
    let mut s = String::from(
        "[cluster]\nname = \"test\"\nsecret = \"tally-test-secret\"\nvnodes_per_node = 64\n\
         heartbeat_ms = 200\nheartbeat_misses_max = 4\nraft_heartbeat_ms = 200\n\
         raft_election_timeout_min_ms = 800\nraft_election_timeout_max_ms = 1600\n",
    );
    let (cluster_lines, rest): (Vec<&str>, Vec<&str>) =
        extra.lines().partition(|l| l.trim_start().starts_with("cluster."));
    // One copy of each shard unless the test asks for more: the default for three
    // members is three copies, which the tests of one copy per shard must not get.
    if !cluster_lines.iter().any(|l| l.trim_start().starts_with("cluster.replicas")) {
        s += "replicas = 1\n";
    }
    for line in cluster_lines {
        s += line.trim_start().trim_start_matches("cluster.");
        s += "\n";
    }
    let extra = rest.join("\n");
    for (i, p) in ports.iter().enumerate() {
        s += &format!(
            "\n[[cluster.nodes]]\nid = \"node{n}\"\nraft_id = {n}\nhttp = \"127.0.0.1:{}\"\npeer = \"127.0.0.1:{}\"\nraft = \"127.0.0.1:{}\"\nresp = \"127.0.0.1:{}\"\nmember = {}\n",
            p.http,
            p.peer,
            p.raft,
            p.resp,
            !spares.contains(&(i + 1)),
            n = i + 1
        );
    }
    s += &format!("\n[node]\nid = \"node{me}\"\ndata_dir = {:?}\n", data_dir.display().to_string());
    s += "\n[engine]\ncall_timeout_ms = 3000\n";
    s += &extra;
    s += "\n";
    s
}

impl TestCluster {
    /// Starts `n` nodes and waits until every one is healthy and a leader is known.
    pub async fn start(n: usize) -> Result<Self> {
        Self::start_with_spares(n, &[]).await
    }

    /// Like [`TestCluster::start`], with the nodes of `spares` (1-based) listed as
    /// `member = false`: running, but holding shards only once added.
    pub async fn start_with_spares(n: usize, spares: &[usize]) -> Result<Self> {
        Self::start_configured(n, spares, "").await
    }

    /// Like [`TestCluster::start_with_spares`], with `extra` appended to every node's
    /// config (per-node sections such as `[http]`).
    pub async fn start_configured(n: usize, spares: &[usize], extra: &str) -> Result<Self> {
        let cluster = Self::start_until_healthy(n, spares, extra).await?;
        cluster.wait_leader().await?;
        cluster.wait_connected().await?;
        Ok(cluster)
    }

    /// Starts `n` nodes and waits only until every one answers `/healthz` with 200,
    /// as a load balancer would: `/healthz` alone must mean ready to serve.
    pub async fn start_until_healthy(n: usize, spares: &[usize], extra: &str) -> Result<Self> {
        Self::start_inner(n, spares, extra, None).await
    }

    /// Like [`TestCluster::start_configured`] for nodes that declare tokens in
    /// `extra`: the fixture's own requests (`get`, `send`, the waits) carry
    /// `token`, which should have the `admin` scope and no prefixes.
    pub async fn start_secured(n: usize, spares: &[usize], extra: &str, token: &str) -> Result<Self> {
        let cluster = Self::start_inner(n, spares, extra, Some(token.to_string())).await?;
        cluster.wait_leader().await?;
        cluster.wait_connected().await?;
        Ok(cluster)
    }

    async fn start_inner(n: usize, spares: &[usize], extra: &str, token: Option<String>) -> Result<Self> {
        let mut attempt = 0;
        loop {
            let cluster = Self::prepare(n, spares, &|_| extra.to_string(), None, token.clone())?;
            for node in &cluster.nodes {
                node.spawn(cluster.dir.path())?;
            }
            match cluster.wait_all_healthy(n).await {
                Err(e) if lost_a_port_race(&e) && attempt < PORT_RACE_RETRIES => attempt += 1,
                other => return other.map(|()| cluster),
            }
        }
    }

    async fn wait_all_healthy(&self, n: usize) -> Result<()> {
        self.wait_these_healthy(n, &(1..=n).collect::<Vec<_>>()).await
    }

    /// Waits until nodes `which` (of `n`) are healthy; the error of one that is not
    /// names the other nodes' errors.
    async fn wait_these_healthy(&self, n: usize, which: &[usize]) -> Result<()> {
        for &i in which {
            if let Err(e) = self.wait_healthy(i).await {
                // Why a node is not healthy is often another node's failure.
                let mut why = String::new();
                for j in (1..=n).filter(|j| *j != i) {
                    let log = self.log(j);
                    for line in
                        log.lines().filter(|l| l.contains("panicked") || l.contains(" ERROR tally")).take(5)
                    {
                        why += &format!("\nnode{j}: {line}");
                    }
                    for line in log.lines().rev().take(3) {
                        why += &format!("\nnode{j} (end): {line}");
                    }
                }
                return Err(e.context(format!("other nodes:{why}")));
            }
        }
        Ok(())
    }

    /// Starts `n` nodes with TLS on every listener and between them (see
    /// [`TlsSetup`]) and waits, as [`TestCluster::start`] does, until all are
    /// healthy, a leader is known and every node sees every other one up.
    pub async fn start_tls(n: usize, tls: &TlsSetup<'_>) -> Result<Self> {
        let cluster = Self::spawn_tls_healthy(n, &(1..=n).collect::<Vec<_>>(), tls).await?;
        cluster.wait_leader().await?;
        cluster.wait_connected().await?;
        Ok(cluster)
    }

    /// Starts `n` TLS nodes (see [`TlsSetup`]) and waits until nodes `healthy` are
    /// healthy (the others may be meant to stay out), on fresh ports again when a
    /// node lost a port race.
    pub async fn spawn_tls_healthy(n: usize, healthy: &[usize], tls: &TlsSetup<'_>) -> Result<Self> {
        let mut attempt = 0;
        loop {
            let cluster = Self::spawn_tls(n, tls)?;
            match cluster.wait_these_healthy(n, healthy).await {
                Err(e) if lost_a_port_race(&e) && attempt < PORT_RACE_RETRIES => attempt += 1,
                Err(e) => return Err(e),
                Ok(()) => return Ok(cluster),
            }
        }
    }

    /// Starts `n` TLS nodes (see [`TlsSetup`]) and waits for nothing.
    pub fn spawn_tls(n: usize, tls: &TlsSetup<'_>) -> Result<Self> {
        let extra = |i: usize| {
            let (cert, key) = (tls.certs)(i);
            format!("\n[tls]\ncert = {:?}\nkey = {:?}\ncluster_ca = {:?}\n", cert, key, tls.ca)
        };
        let cluster = Self::prepare(n, &[], &extra, Some(tls.ca), None)?;
        for node in &cluster.nodes {
            node.spawn(cluster.dir.path())?;
        }
        Ok(cluster)
    }

    /// Writes the configs (node `i`'s ends with `extra(i)`) without starting any
    /// node; with `ca`, nodes are reached over `https://` verified by it.
    fn prepare(
        n: usize,
        spares: &[usize],
        extra: &dyn Fn(usize) -> String,
        ca: Option<&Path>,
        token: Option<String>,
    ) -> Result<Self> {
        let dir = tempfile::tempdir()?;
        let free = free_ports(4 * n);
        let ports: Vec<Ports> =
            free.chunks(4).map(|p| Ports { http: p[0], peer: p[1], raft: p[2], resp: p[3] }).collect();
        let mut nodes = Vec::new();
        for i in 1..=n {
            let config = dir.path().join(format!("node{i}.toml"));
            std::fs::write(
                &config,
                config_text(&ports, i, &dir.path().join(format!("data{i}")), spares, &extra(i)),
            )?;
            nodes.push(Node {
                index: i,
                ports: ports[i - 1].clone(),
                config,
                log: dir.path().join(format!("node{i}.log")),
                child: Mutex::new(None),
                scheme: if ca.is_some() { "https" } else { "http" },
            });
        }
        let mut http = reqwest::Client::builder().timeout(Duration::from_millis(REQUEST_TIMEOUT_MS));
        if let Some(ca) = ca {
            let pem = std::fs::read(ca).with_context(|| format!("reading {}", ca.display()))?;
            http = http.tls_certs_only([reqwest::Certificate::from_pem(&pem)?]);
        }
        Ok(Self { dir, nodes, http: http.build()?, token })
    }

    /// Waits until every running node sees every other running node `up`.
    pub async fn wait_connected(&self) -> Result<()> {
        let deadline = Instant::now() + Duration::from_millis(NODE_START_WAIT_MS);
        let running: Vec<String> =
            self.nodes.iter().filter(|n| n.pid().is_some()).map(|n| format!("node{}", n.index)).collect();
        'retry: loop {
            if Instant::now() > deadline {
                bail!("nodes did not all connect to each other");
            }
            for node in self.nodes.iter().filter(|n| n.pid().is_some()) {
                let Ok(view) = self.get(node.index, "/v1/cluster").await else {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue 'retry;
                };
                let up = view["nodes"]
                    .as_array()
                    .map(|ns| {
                        ns.iter().filter(|n| n["state"] == "up").filter_map(|n| n["id"].as_str()).count()
                    })
                    .unwrap_or(0);
                let want = view["nodes"]
                    .as_array()
                    .map(|ns| ns.iter().filter(|n| running.iter().any(|r| n["id"] == r.as_str())).count())
                    .unwrap_or(0);
                if up < want {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue 'retry;
                }
            }
            return Ok(());
        }
    }

    /// Node `i` (1-based).
    pub fn node(&self, i: usize) -> &Node {
        &self.nodes[i - 1]
    }

    /// How many nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Never true: a cluster has at least one node.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// Starts node `i` again (after `kill` or `stop`) and waits until it is healthy.
    pub async fn restart(&self, i: usize) -> Result<()> {
        self.node(i).spawn(self.dir.path())?;
        self.wait_healthy(i).await?;
        if self.nodes.len() > 1 {
            self.wait_connected().await?;
        }
        Ok(())
    }

    /// Waits until node `i` answers `/healthz`.
    pub async fn wait_healthy(&self, i: usize) -> Result<()> {
        let deadline = Instant::now() + Duration::from_millis(NODE_START_WAIT_MS);
        let url = format!("{}/healthz", self.node(i).url());
        loop {
            if let Ok(r) = self.http.get(&url).timeout(Duration::from_secs(1)).send().await {
                if r.status().is_success() {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                bail!("node{i} not healthy; log:\n{}", self.node(i).log_tail());
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until some live node reports a metadata leader; returns its name.
    pub async fn wait_leader(&self) -> Result<String> {
        let deadline = Instant::now() + Duration::from_millis(LEADER_WAIT_MS);
        loop {
            for node in self.nodes.iter().filter(|n| n.pid().is_some()) {
                if let Ok(v) = self.get(node.index, "/v1/cluster").await {
                    if let Some(leader) = v["leader"].as_str() {
                        let live = self
                            .nodes
                            .iter()
                            .any(|n| format!("node{}", n.index) == leader && n.pid().is_some());
                        if live {
                            return Ok(leader.to_string());
                        }
                    }
                }
            }
            if Instant::now() > deadline {
                bail!("no leader elected");
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// GET on node `i`; the JSON body of a 2xx answer.
    pub async fn get(&self, i: usize, path: &str) -> Result<Value> {
        let r = self.authorized(self.http.get(format!("{}{path}", self.node(i).url()))).send().await?;
        let status = r.status();
        let body: Value = r.json().await.unwrap_or(Value::Null);
        if !status.is_success() {
            bail!("GET {path} on node{i}: {status} {body}");
        }
        Ok(body)
    }

    /// A request with a JSON body on node `i`; (status, body).
    pub async fn send(&self, i: usize, method: &str, path: &str, body: Value) -> Result<(u16, Value)> {
        let method = reqwest::Method::from_bytes(method.as_bytes())?;
        let r = self.http.request(method, format!("{}{path}", self.node(i).url())).json(&body);
        let r = self.authorized(r).send().await?;
        let status = r.status().as_u16();
        Ok((status, r.json().await.unwrap_or(Value::Null)))
    }

    /// Creates or updates a counter through node `i`.
    pub async fn put_counter(&self, i: usize, name: &str, spec: Value) -> Result<()> {
        let (status, body) = self.send(i, "PUT", &format!("/v1/counters/{name}"), spec).await?;
        if status != 200 && status != 201 {
            bail!("PUT {name}: {status} {body}");
        }
        Ok(())
    }

    /// One increment through node `i`; the HTTP status and body.
    pub async fn incr(&self, i: usize, name: &str, inc: Value) -> Result<(u16, Value)> {
        self.send(i, "POST", &format!("/v1/counters/{name}/increments"), inc).await
    }

    /// A fresh read through node `i`.
    pub async fn fresh(&self, i: usize, name: &str) -> Result<Value> {
        self.get(i, &format!("/v1/counters/{name}/value?consistency=fresh")).await
    }

    /// The fresh value through node `i`, insisting every shard answered.
    pub async fn value(&self, i: usize, name: &str) -> Result<i64> {
        let v = self.fresh(i, name).await?;
        if v["complete"] != json!(true) {
            bail!("incomplete read on node{i}: {v}");
        }
        v["value"].as_i64().ok_or_else(|| anyhow!("no value in {v}"))
    }

    /// `request` with the fixture's token, if it has one.
    fn authorized(&self, request: reqwest::RequestBuilder) -> reqwest::RequestBuilder {
        match &self.token {
            Some(t) => request.bearer_auth(t),
            None => request,
        }
    }

    /// Node `i`'s configuration file.
    pub fn config_path(&self, i: usize) -> &Path {
        &self.node(i).config
    }

    /// The test's data directory (logs, configs).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Node `i`'s data directory (its shard store and raft log).
    pub fn data_dir(&self, i: usize) -> PathBuf {
        self.dir.path().join(format!("data{i}"))
    }

    /// Deletes node `i`'s data directory, as a replaced disk would. The node must
    /// not be running.
    pub fn wipe(&self, i: usize) -> Result<()> {
        if self.node(i).pid().is_some() {
            bail!("node{i} is running; kill it before wiping its disk");
        }
        std::fs::remove_dir_all(self.data_dir(i)).context("deleting the data directory")
    }

    /// Starts node `i`'s process again without waiting for it to become healthy.
    pub fn spawn(&self, i: usize) -> Result<()> {
        self.node(i).spawn(self.dir.path())
    }

    /// Node `i`'s whole log so far.
    pub fn log(&self, i: usize) -> String {
        std::fs::read_to_string(&self.node(i).log).unwrap_or_default()
    }
}

/// TLS for a [`TestCluster`]: the cluster CA every node trusts (and the tests
/// verify nodes with), and node `i`'s certificate chain and key.
pub struct TlsSetup<'a> {
    /// The cluster CA (`tls.cluster_ca`).
    pub ca: &'a Path,
    /// Node `i`'s (1-based) certificate chain and key.
    pub certs: &'a dyn Fn(usize) -> (PathBuf, PathBuf),
}

/// Runs `scripts/tls-local-ca.sh` into `dir` for `nodes` with a CA called
/// `ca_name`; returns `dir`. Node `n`'s files are `dir/n.pem`, `dir/n-key.pem`.
pub fn make_certs(dir: &Path, ca_name: &str, nodes: &[&str]) -> Result<PathBuf> {
    let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/tls-local-ca.sh");
    let out = Command::new("bash")
        .arg(script)
        .arg(dir)
        .args(nodes)
        .env("TALLY_CA_NAME", ca_name)
        .output()
        .context("running scripts/tls-local-ca.sh (needs openssl)")?;
    if !out.status.success() {
        bail!("tls-local-ca.sh failed: {}", String::from_utf8_lossy(&out.stderr));
    }
    Ok(dir.to_path_buf())
}

/// The `tally` CLI next to this test binary, or built on demand.
pub fn tally_cli() -> Result<PathBuf> {
    let exe = std::env::current_exe()?;
    let profile_dir = exe.parent().and_then(Path::parent).ok_or_else(|| anyhow!("odd test path"))?;
    let candidate = profile_dir.join("tally");
    if !candidate.exists() {
        let status = Command::new(env!("CARGO"))
            .args(["build", "-p", "tally-cli", "--bin", "tally"])
            .status()
            .context("building tally")?;
        if !status.success() {
            bail!("cargo build of tally failed");
        }
    }
    Ok(candidate)
}

/// Whether the tests run in CI (`CI=true`), where every external tool must be present.
pub fn in_ci() -> bool {
    std::env::var("CI").is_ok_and(|v| !v.is_empty() && v != "false" && v != "0")
}

/// A Python that imports the `redis` package: Debian's (where `python3-redis`
/// installs it) before whatever `python3` is first on `PATH`. Outside CI a missing
/// package is `Ok(None)` after a message saying the test is skipped; in CI an error.
pub fn python_redis() -> Result<Option<&'static str>> {
    for python in ["/usr/bin/python3", "python3"] {
        let ok = Command::new(python)
            .args(["-c", "import redis"])
            .stderr(Stdio::null())
            .status()
            .is_ok_and(|s| s.success());
        if ok {
            return Ok(Some(python));
        }
    }
    if in_ci() {
        bail!(
            "the Python redis package is missing and CI is set: apt-get install python3-redis (.ci/run does)"
        );
    }
    eprintln!("SKIPPED: the Python redis package is missing (apt-get install python3-redis)");
    Ok(None)
}

/// The path of the external program `name` (looked up on `PATH`). Outside CI a
/// missing program is `Ok(None)` after a message saying the test is skipped and how
/// to install it; in CI it is an error, so a missing install step fails the run.
pub fn require_tool(name: &str, install: &str) -> Result<Option<PathBuf>> {
    let path = std::env::var_os("PATH").unwrap_or_default();
    if let Some(found) = std::env::split_paths(&path).map(|d| d.join(name)).find(|p| p.is_file()) {
        return Ok(Some(found));
    }
    if in_ci() {
        bail!("{name} is not installed and CI is set: install it with `{install}` (.ci/run does)");
    }
    eprintln!("SKIPPED: {name} is not installed (install it with `{install}`); CI=true makes this a failure");
    Ok(None)
}

/// The OpenAPI document of the public interface, and answers checked against it.
pub mod openapi {
    use anyhow::{anyhow, bail, Result};
    use serde_json::{json, Value};
    use std::path::PathBuf;
    use std::sync::OnceLock;

    /// Where the document lives in the repository (`tallyd` embeds this file).
    pub fn path() -> PathBuf {
        PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../crates/tally-server/openapi.json")
    }

    /// The document, parsed once.
    pub fn document() -> &'static Value {
        static DOC: OnceLock<Value> = OnceLock::new();
        DOC.get_or_init(|| {
            let text = std::fs::read_to_string(path()).expect("the OpenAPI document is readable");
            serde_json::from_str(&text).expect("the OpenAPI document is JSON")
        })
    }

    /// Checks an answer: `status` must be documented for `method` on the path
    /// template `template` (such as `/v1/counters/{name}`), and a JSON `body` must
    /// match that answer's schema. Every error answer must match the `Error` schema.
    pub fn check(method: &str, template: &str, status: u16, body: &Value) -> Result<()> {
        let doc = document();
        let op = &doc["paths"][template][method.to_ascii_lowercase()];
        if op.is_null() {
            bail!("the OpenAPI document has no {method} {template}");
        }
        let response = &op["responses"][status.to_string()];
        if response.is_null() {
            bail!("the OpenAPI document does not list status {status} for {method} {template}; the body was {body}");
        }
        let Some(schema) = response.pointer("/content/application~1json/schema") else {
            return Ok(());
        };
        let root = json!({
            "$schema": "https://json-schema.org/draft/2020-12/schema",
            "components": doc["components"],
            "allOf": [schema],
        });
        let validator = jsonschema::validator_for(&root)
            .map_err(|e| anyhow!("schema of {method} {template} {status}: {e}"))?;
        let errors: Vec<String> =
            validator.iter_errors(body).map(|e| format!("{} at {}", e, e.instance_path())).collect();
        if !errors.is_empty() {
            bail!("{method} {template} answered {status} with a body its schema refuses: {errors:?}\nbody: {body}");
        }
        if status >= 400 {
            let error_schema = json!({"components": doc["components"], "$ref": "#/components/schemas/Error"});
            let v = jsonschema::validator_for(&error_schema).map_err(|e| anyhow!("the Error schema: {e}"))?;
            if !v.is_valid(body) {
                bail!("{method} {template} answered {status} outside the error shape: {body}");
            }
        }
        Ok(())
    }
}

/// A throwaway PostgreSQL server for the tests: Debian's `postgresql` binaries,
/// `initdb` into a temporary directory, listening on 127.0.0.1 and a free port,
/// stopped by the postmaster's PID (then its launcher's) when dropped.
pub struct Postgres {
    /// The TCP port it listens on (127.0.0.1 only).
    pub port: u16,
    dir: tempfile::TempDir,
    launcher: Option<Child>,
}

impl Postgres {
    /// Starts a server. Without PostgreSQL's binaries, or if it cannot start: an
    /// error in CI (`CI=true`), else `Ok(None)` after a message that the test is
    /// skipped.
    pub fn start() -> Result<Option<Self>> {
        Self::start_with(None)
    }

    /// Like [`Postgres::start`], serving TLS with the certificate chain `cert` and
    /// key `key`, and taking TCP connections over TLS only (`hostssl` in
    /// `pg_hba.conf`): a plaintext client is refused.
    pub fn start_tls(cert: &Path, key: &Path) -> Result<Option<Self>> {
        Self::start_with(Some((cert, key)))
    }

    fn start_with(tls: Option<(&Path, &Path)>) -> Result<Option<Self>> {
        match Self::try_start(tls) {
            Ok(pg) => Ok(Some(pg)),
            Err(e) if !in_ci() => {
                eprintln!("SKIPPED: cannot start PostgreSQL ({e:#}); install it with `apt-get install postgresql`; CI=true makes this a failure");
                Ok(None)
            }
            Err(e) => {
                Err(e.context("starting PostgreSQL (CI is set: .ci/run installs the postgresql package)"))
            }
        }
    }

    fn try_start(tls: Option<(&Path, &Path)>) -> Result<Self> {
        use std::os::unix::fs::{MetadataExt, PermissionsExt};
        let bin = std::fs::read_dir("/usr/lib/postgresql")
            .context("no /usr/lib/postgresql")?
            .filter_map(|e| e.ok().map(|e| e.path().join("bin")))
            .filter(|b| b.join("postgres").is_file() && b.join("initdb").is_file())
            .max()
            .ok_or_else(|| anyhow!("no PostgreSQL server binaries under /usr/lib/postgresql"))?;
        let root = std::fs::metadata("/proc/self").map(|m| m.uid() == 0).unwrap_or(false);
        let dir = tempfile::tempdir()?;
        // The postgres user must reach its directories inside.
        std::fs::set_permissions(dir.path(), std::fs::Permissions::from_mode(0o755))?;
        let data = dir.path().join("data");
        let as_pg = |program: &Path| {
            if root {
                let mut c = Command::new("runuser");
                c.args(["-u", "postgres", "--"]).arg(program);
                c
            } else {
                Command::new(program)
            }
        };
        if root {
            let status = Command::new("chown").arg("postgres:").arg(dir.path()).status()?;
            if !status.success() {
                bail!("chown of the data directory to postgres failed");
            }
        }
        let out = as_pg(&bin.join("initdb"))
            .arg("-D")
            .arg(&data)
            .args(["-U", "postgres", "-A", "trust", "-E", "UTF8", "--no-sync"])
            .output()
            .context("running initdb")?;
        if !out.status.success() {
            bail!("initdb failed: {}", String::from_utf8_lossy(&out.stderr));
        }
        let mut settings = Vec::new();
        if let Some((cert, key)) = tls {
            // The server's key must be its own and private to it.
            for (from, to) in [(cert, "server.pem"), (key, "server-key.pem")] {
                let to = data.join(to);
                std::fs::copy(from, &to)?;
                std::fs::set_permissions(&to, std::fs::Permissions::from_mode(0o600))?;
                if root && !Command::new("chown").arg("postgres:").arg(&to).status()?.success() {
                    bail!("chown of {} to postgres failed", to.display());
                }
            }
            std::fs::write(
                data.join("pg_hba.conf"),
                "local all all trust\nhostssl all all 127.0.0.1/32 trust\n",
            )?;
            for s in ["ssl=on", "ssl_cert_file=server.pem", "ssl_key_file=server-key.pem"] {
                settings.extend(["-c".to_string(), s.to_string()]);
            }
        }
        let port = free_port();
        let log = std::fs::File::create(dir.path().join("postgres.log"))?;
        let launcher = as_pg(&bin.join("postgres"))
            .arg("-D")
            .arg(&data)
            .arg("-k")
            .arg(dir.path())
            .args(["-p", &port.to_string(), "-c", "listen_addresses=127.0.0.1", "-c", "fsync=off"])
            .args(&settings)
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting postgres")?;
        let mut pg = Self { port, dir, launcher: Some(launcher) };
        let deadline = Instant::now() + Duration::from_secs(30);
        loop {
            let ready = Command::new(bin.join("pg_isready"))
                .args(["-q", "-h", "127.0.0.1", "-p", &port.to_string()])
                .status()
                .is_ok_and(|s| s.success());
            if ready {
                return Ok(pg);
            }
            if Instant::now() > deadline {
                let log = std::fs::read_to_string(pg.dir.path().join("postgres.log")).unwrap_or_default();
                pg.stop();
                bail!("PostgreSQL did not become ready within 30 s; its log:\n{log}");
            }
            std::thread::sleep(Duration::from_millis(100));
        }
    }

    /// The connection URL (user `postgres`, database `postgres`, no password).
    pub fn url(&self) -> String {
        format!("postgres://postgres@127.0.0.1:{}/postgres", self.port)
    }

    /// A connection string through the server's Unix socket (open to the test's
    /// own client when TCP takes TLS only).
    pub fn socket_url(&self) -> String {
        format!("host={} port={} user=postgres dbname=postgres", self.dir.path().display(), self.port)
    }

    /// Stops the server: SIGINT (fast shutdown) to the postmaster by its PID, then
    /// waits for the launcher, killing it after 30 s.
    pub fn stop(&mut self) {
        let Some(mut launcher) = self.launcher.take() else { return };
        let pid_file = self.dir.path().join("data/postmaster.pid");
        if let Some(pid) = std::fs::read_to_string(pid_file)
            .ok()
            .and_then(|t| t.lines().next().and_then(|l| l.trim().parse::<u32>().ok()))
        {
            let _ = Command::new("kill").arg("-INT").arg(pid.to_string()).status();
        }
        let deadline = Instant::now() + Duration::from_secs(30);
        while Instant::now() < deadline {
            if let Ok(Some(_)) = launcher.try_wait() {
                return;
            }
            std::thread::sleep(Duration::from_millis(50));
        }
        let _ = launcher.kill();
        let _ = launcher.wait();
    }
}

impl Drop for Postgres {
    fn drop(&mut self) {
        self.stop();
    }
}

/// Stories several tests run on differently configured clusters.
pub mod stories {
    use crate::TestCluster;
    use serde_json::json;
    use std::sync::atomic::{AtomicBool, Ordering::SeqCst};
    use std::sync::{Arc, Mutex};
    use std::time::Duration;

    /// Checks that every acknowledged increment of `counter` is counted exactly once:
    /// every node's total is the number of `acked` ids, plus at most `in_flight`
    /// (ids still unanswered when the writers stopped may have been applied), and
    /// every `step`th acknowledged id answers `duplicate` through node 3.
    pub async fn assert_counted_once(
        c: &TestCluster,
        counter: &str,
        acked: &[String],
        in_flight: usize,
        step: usize,
    ) -> anyhow::Result<()> {
        let n = acked.len() as i64;
        for node in 1..=c.len() {
            let value = c.value(node, counter).await?;
            assert!(
                (n..=n + in_flight as i64).contains(&value),
                "node{node}: value {value}, acknowledged {n}"
            );
        }
        for id in acked.iter().step_by(step) {
            let (_, body) = c.incr(3, counter, json!({"delta": 1, "event_id": id})).await?;
            assert_eq!(body, json!({"applied": false, "duplicate": true}), "{id}");
        }
        Ok(())
    }

    /// The story of t30 on a running three-node cluster `c`: sync increments stream
    /// in through nodes 1 and 2 (retried with the same event id), node 3 is killed with
    /// `kill -9` and restarted, and afterwards every acknowledged increment is counted
    /// exactly once on every node. t66 runs it over TLS.
    pub async fn kill_one_node_under_sync_writes(c: Arc<TestCluster>) -> anyhow::Result<()> {
        c.put_counter(1, "credits", json!({"shards": 12, "durability": "sync"})).await?;
        let stop = Arc::new(AtomicBool::new(false));
        let acked = Arc::new(Mutex::new(Vec::new()));
        let mut writers = Vec::new();
        for w in 0..8usize {
            let (c, stop, acked) = (c.clone(), stop.clone(), acked.clone());
            writers.push(tokio::spawn(async move {
                let node = if w % 2 == 0 { 1 } else { 2 };
                let mut i = 0;
                while !stop.load(SeqCst) {
                    let id = format!("w{w}-{i}");
                    // Retry with the same id until acknowledged (or the test ends).
                    while !stop.load(SeqCst) {
                        match c.incr(node, "credits", json!({"delta": 1, "event_id": id})).await {
                            Ok((200, _)) => {
                                acked.lock().unwrap().push(id.clone());
                                break;
                            }
                            Ok((503, _)) | Err(_) => tokio::time::sleep(Duration::from_millis(50)).await,
                            Ok((status, body)) => panic!("unexpected {status} {body}"),
                        }
                    }
                    i += 1;
                }
            }));
        }
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        c.node(3).kill();
        tokio::time::sleep(Duration::from_millis(2_000)).await;
        c.restart(3).await?;
        tokio::time::sleep(Duration::from_millis(1_500)).await;
        stop.store(true, SeqCst);
        for w in writers {
            w.await?;
        }
        let acked = acked.lock().unwrap().clone();
        assert!(acked.len() > 100, "writers made little progress: {}", acked.len());
        // An id that was refused and then retried may have been applied by the refused
        // attempt; its id makes that count once. An id still in flight when the writers
        // stopped is the only unknown: at most one per writer.
        assert_counted_once(&c, "credits", &acked, 8, 17).await
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn free_ports_are_distinct() {
        let ports = super::free_ports(256);
        let distinct: std::collections::BTreeSet<u16> = ports.iter().copied().collect();
        assert_eq!(distinct.len(), ports.len(), "{ports:?}");
    }
}
