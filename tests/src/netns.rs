//! Real network partitions for the process tests: every `tallyd` of an
//! [`NsCluster`] runs in a network namespace of its own, and the fault injector
//! drops packets between them with nftables rules inside those namespaces.
//!
//! ```text
//!   host (the test)                hub namespace               node namespaces
//!   nm<tag>h 10.77.S.254 ──veth── br0 ──veth── eth0 10.77.S.11  (node1, nft table "nemesis")
//!                                     ──veth── eth0 10.77.S.12  (node2)
//!                                     ──veth── eth0 10.77.S.13  (node3) …
//! ```
//!
//! The nodes reach each other on their namespace addresses (`http`, `peer`, `raft`
//! and `resp` in `cluster.nodes` are all `10.77.S.1x`); the test process reaches
//! every node's HTTP through its own veth into the hub's bridge, so a partition
//! between nodes never cuts a client off. Nothing leaves the machine: the subnet
//! exists only on these links, and the namespaces, links and rules are removed when
//! the [`Network`] is dropped — also when a test fails — and, at the next start, any
//! left behind by a test process that no longer runs (killed before its guards ran).
//!
//! Names carry the test process's id and a sequence number (`nm<pid><seq>`), so
//! runs side by side never touch each other's namespaces.

use anyhow::{anyhow, bail, Context, Result};
use serde_json::{json, Value};
use std::net::Ipv4Addr;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};
use std::sync::atomic::{AtomicU32, Ordering};
use std::sync::Mutex;
use std::time::{Duration, Instant};

/// The first two octets of every address a [`Network`] hands out (private range).
const SUBNET_PREFIX: [u8; 2] = [10, 77];
/// Host part of node `i`'s address: `10.77.S.(NODE_HOST_BASE + i)`.
const NODE_HOST_BASE: u8 = 10;
/// Host part of the test process's own address on the bridge.
const CLIENT_HOST: u8 = 254;
/// The ports every node listens on inside its namespace (each has its own port
/// space, so there is no race for free ports).
pub const HTTP_PORT: u16 = 7070;
/// Node-to-node (actor transport) port.
pub const PEER_PORT: u16 = 7170;
/// Raft RPC port.
pub const RAFT_PORT: u16 = 7270;
/// Redis-protocol port.
pub const RESP_PORT: u16 = 6380;
/// The nftables table each node namespace gets; partitions are rules in it.
const NFT_TABLE: &str = "nemesis";
/// The most nodes one [`Network`] holds (interface names must stay within 15 bytes).
pub const NODES_MAX: usize = 9;
/// How long a node may take to answer `/healthz` after it starts.
pub const NODE_START_WAIT_MS: u64 = 60_000;

/// Serializes the choice of subnets between networks made at once in one process.
static CREATING: Mutex<()> = Mutex::new(());
/// Distinguishes the networks one test process makes.
static SEQUENCE: AtomicU32 = AtomicU32::new(0);

/// Why namespaces cannot be made here, if they cannot: not root, or no `ip` or
/// `nft`. `Ok(None)` means they can.
pub fn unavailable_because() -> Option<String> {
    use std::os::unix::fs::MetadataExt;
    let root = std::fs::metadata("/proc/self").map(|m| m.uid() == 0).unwrap_or(false);
    if !root {
        return Some("network namespaces need root".into());
    }
    for (tool, package) in [("ip", "iproute2"), ("nft", "nftables")] {
        let found = Command::new(tool).arg("-V").stdout(Stdio::null()).stderr(Stdio::null()).status();
        if !found.is_ok_and(|s| s.success()) {
            return Some(format!("`{tool}` is not installed (apt-get install {package})"));
        }
    }
    None
}

/// Runs a command to completion; an error carries its stderr.
fn run(program: &str, args: &[&str]) -> Result<String> {
    let out = Command::new(program).args(args).output().with_context(|| format!("running {program}"))?;
    if !out.status.success() {
        bail!("`{program} {}` failed: {}", args.join(" "), String::from_utf8_lossy(&out.stderr).trim());
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

/// `ip` with these arguments.
fn ip(args: &[&str]) -> Result<String> {
    run("ip", args)
}

/// Whether process `pid` still runs.
fn alive(pid: u32) -> bool {
    Path::new(&format!("/proc/{pid}")).exists()
}

/// The pid in a name made by [`Network::create`] (`nm<pid><seq>…`): the digits after
/// `nm` less the last (the sequence number, 0–9).
fn owner_pid(name: &str) -> Option<u32> {
    let digits: String = name.strip_prefix("nm")?.chars().take_while(char::is_ascii_digit).collect();
    if digits.len() < 2 {
        return None;
    }
    digits[..digits.len() - 1].parse().ok()
}

/// Removes namespaces and host links that a test process left behind when it was
/// killed before its guards ran (their owner no longer runs). Returns what it removed.
pub fn sweep_stale() -> Vec<String> {
    let mut removed = Vec::new();
    let namespaces = ip(&["netns", "list"]).unwrap_or_default();
    for name in namespaces.lines().filter_map(|l| l.split_whitespace().next()) {
        if owner_pid(name).is_some_and(|pid| !alive(pid)) && ip(&["netns", "del", name]).is_ok() {
            removed.push(format!("namespace {name}"));
        }
    }
    let links = ip(&["-o", "link", "show"]).unwrap_or_default();
    for line in links.lines() {
        let Some(name) = line.split(':').nth(1).map(|n| n.trim().split('@').next().unwrap_or("")) else {
            continue;
        };
        if owner_pid(name).is_some_and(|pid| !alive(pid)) && ip(&["link", "del", name]).is_ok() {
            removed.push(format!("link {name}"));
        }
    }
    removed
}

/// One partition rule: packets from node `from` to node `to` are dropped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord)]
pub struct Cut {
    /// The sending node (1-based).
    pub from: usize,
    /// The receiving node (1-based).
    pub to: usize,
}

/// Namespaces, links and addresses for `n` nodes, removed on drop.
pub struct Network {
    /// `nm<pid><seq>`: the prefix of every name this network made.
    tag: String,
    /// The third octet of the subnet.
    subnet: u8,
    /// How many node namespaces.
    nodes: usize,
    /// The cuts in force, so a partition can be described and healed.
    cuts: Mutex<Vec<Cut>>,
}

impl Network {
    /// Makes the hub namespace with its bridge, one namespace per node joined to it
    /// by a veth pair, and the test process's own veth into the bridge; loads an
    /// empty `nemesis` table into every node namespace.
    pub fn create(nodes: usize) -> Result<Self> {
        if nodes == 0 || nodes > NODES_MAX {
            bail!("a network holds 1 to {NODES_MAX} nodes, not {nodes}");
        }
        let _one = CREATING.lock().unwrap_or_else(|e| e.into_inner());
        for what in sweep_stale() {
            eprintln!("netns: removed {what}, left behind by a test process that no longer runs");
        }
        let seq = SEQUENCE.fetch_add(1, Ordering::SeqCst) % 10;
        let tag = format!("nm{}{seq}", std::process::id());
        let subnet = free_subnet()?;
        let net = Self { tag, subnet, nodes, cuts: Mutex::new(Vec::new()) };
        // From here on, Drop removes whatever was made, also if a step fails.
        net.build().with_context(|| format!("building the test network {}", net.tag))?;
        Ok(net)
    }

    fn build(&self) -> Result<()> {
        let hub = self.hub();
        ip(&["netns", "add", &hub])?;
        ip(&["-n", &hub, "link", "set", "lo", "up"])?;
        ip(&["-n", &hub, "link", "add", "br0", "type", "bridge"])?;
        ip(&["-n", &hub, "link", "set", "br0", "up"])?;
        for i in 1..=self.nodes {
            let ns = self.ns(i);
            let (inside, outside) = (format!("{}n{i}a", self.tag), format!("{}n{i}b", self.tag));
            ip(&["netns", "add", &ns])?;
            ip(&["link", "add", &inside, "type", "veth", "peer", "name", &outside])?;
            ip(&["link", "set", &inside, "netns", &ns])?;
            ip(&["link", "set", &outside, "netns", &hub])?;
            ip(&["-n", &ns, "link", "set", &inside, "name", "eth0"])?;
            ip(&["-n", &ns, "addr", "add", &format!("{}/24", self.addr(i)), "dev", "eth0"])?;
            ip(&["-n", &ns, "link", "set", "eth0", "up"])?;
            ip(&["-n", &ns, "link", "set", "lo", "up"])?;
            ip(&["-n", &hub, "link", "set", &outside, "master", "br0"])?;
            ip(&["-n", &hub, "link", "set", &outside, "up"])?;
            let table = format!(
                "table inet {NFT_TABLE} {{\n\
                 chain input {{ type filter hook input priority 0; policy accept; }}\n\
                 chain output {{ type filter hook output priority 0; policy accept; }}\n}}\n"
            );
            self.nft(i, &table)?;
        }
        let (host, peer) = (self.host_link(), format!("{}c", self.tag));
        ip(&["link", "add", &host, "type", "veth", "peer", "name", &peer])?;
        ip(&["link", "set", &peer, "netns", &hub])?;
        ip(&["-n", &hub, "link", "set", &peer, "master", "br0"])?;
        ip(&["-n", &hub, "link", "set", &peer, "up"])?;
        ip(&["addr", "add", &format!("{}/24", self.client_addr()), "dev", &host])?;
        ip(&["link", "set", &host, "up"])?;
        Ok(())
    }

    /// The hub namespace (the bridge).
    fn hub(&self) -> String {
        format!("{}-hub", self.tag)
    }

    /// Node `i`'s namespace (1-based).
    pub fn ns(&self, i: usize) -> String {
        format!("{}-node{i}", self.tag)
    }

    /// The test process's end of its veth into the bridge.
    fn host_link(&self) -> String {
        format!("{}h", self.tag)
    }

    /// Node `i`'s address.
    pub fn addr(&self, i: usize) -> Ipv4Addr {
        let [a, b] = SUBNET_PREFIX;
        Ipv4Addr::new(a, b, self.subnet, NODE_HOST_BASE + i as u8)
    }

    /// The test process's address on the bridge (where client requests come from).
    pub fn client_addr(&self) -> Ipv4Addr {
        let [a, b] = SUBNET_PREFIX;
        Ipv4Addr::new(a, b, self.subnet, CLIENT_HOST)
    }

    /// How many nodes.
    pub fn len(&self) -> usize {
        self.nodes
    }

    /// Never true: a network has at least one node.
    pub fn is_empty(&self) -> bool {
        self.nodes == 0
    }

    /// `nft -f -` inside node `i`'s namespace, with `script` on stdin.
    fn nft(&self, i: usize, script: &str) -> Result<()> {
        use std::io::Write;
        let mut child = Command::new("ip")
            .args(["netns", "exec", &self.ns(i), "nft", "-f", "-"])
            .stdin(Stdio::piped())
            .stdout(Stdio::null())
            .stderr(Stdio::piped())
            .spawn()
            .context("running nft")?;
        child.stdin.take().ok_or_else(|| anyhow!("nft's stdin"))?.write_all(script.as_bytes())?;
        let out = child.wait_with_output()?;
        if !out.status.success() {
            bail!("nft in {} failed: {}\n{script}", self.ns(i), String::from_utf8_lossy(&out.stderr).trim());
        }
        Ok(())
    }

    /// Drops every packet from node `from` to node `to` (a one-way cut): the rule
    /// sits on `from`'s output and on `to`'s input, so neither side's own traffic
    /// to third nodes is touched. TCP needs both directions, so a one-way cut
    /// stalls connections either way, as a real one does, while datagrams and
    /// segments still flow from `to` to `from`.
    pub fn cut(&self, from: usize, to: usize) -> Result<()> {
        let (a, b) = (self.addr(from), self.addr(to));
        self.nft(from, &format!("add rule inet {NFT_TABLE} output ip daddr {b} drop\n"))?;
        self.nft(to, &format!("add rule inet {NFT_TABLE} input ip saddr {a} drop\n"))?;
        self.cuts.lock().unwrap().push(Cut { from, to });
        Ok(())
    }

    /// Cuts both ways between every node of `side` and every node outside it.
    pub fn isolate(&self, side: &[usize]) -> Result<()> {
        for &a in side {
            for b in (1..=self.nodes).filter(|b| !side.contains(b)) {
                self.cut(a, b)?;
                self.cut(b, a)?;
            }
        }
        Ok(())
    }

    /// The cuts in force.
    pub fn cuts(&self) -> Vec<Cut> {
        self.cuts.lock().unwrap().clone()
    }

    /// Removes every cut: each node namespace's rules are flushed.
    pub fn heal(&self) -> Result<()> {
        for i in 1..=self.nodes {
            self.nft(
                i,
                &format!("flush chain inet {NFT_TABLE} input\nflush chain inet {NFT_TABLE} output\n"),
            )?;
        }
        self.cuts.lock().unwrap().clear();
        Ok(())
    }

    /// The rules in force in node `i`'s namespace (for failure messages).
    pub fn ruleset(&self, i: usize) -> String {
        run("ip", &["netns", "exec", &self.ns(i), "nft", "list", "table", "inet", NFT_TABLE])
            .unwrap_or_else(|e| e.to_string())
    }

    /// A command run inside node `i`'s namespace.
    pub fn command(&self, i: usize, program: &Path) -> Command {
        let mut c = Command::new("ip");
        c.args(["netns", "exec", &self.ns(i)]).arg(program);
        c
    }
}

impl Drop for Network {
    fn drop(&mut self) {
        // Deleting a namespace destroys the veths in it, and with them their peers;
        // its nftables rules go with it.
        let _ = ip(&["link", "del", &self.host_link()]);
        // Links still in the host if the build stopped half way.
        let _ = ip(&["link", "del", &format!("{}c", self.tag)]);
        for i in 1..=self.nodes {
            let _ = ip(&["link", "del", &format!("{}n{i}a", self.tag)]);
            let _ = ip(&["netns", "del", &self.ns(i)]);
        }
        let _ = ip(&["netns", "del", &self.hub()]);
        let left: Vec<String> = ip(&["netns", "list"])
            .unwrap_or_default()
            .lines()
            .filter(|l| l.starts_with(&format!("{}-", self.tag)))
            .map(str::to_string)
            .collect();
        if !left.is_empty() {
            eprintln!("netns: could not remove {left:?}");
        }
    }
}

/// A third octet no address or route of this machine uses yet.
fn free_subnet() -> Result<u8> {
    let used = ip(&["-4", "-o", "addr", "show"])? + &ip(&["-4", "route", "show"])?;
    let start = (std::process::id() % 200) as u8;
    (0..200u8)
        .map(|k| 20 + (start + k) % 200)
        .find(|s| !used.contains(&format!("{}.{}.{s}.", SUBNET_PREFIX[0], SUBNET_PREFIX[1])))
        .ok_or_else(|| anyhow!("no free 10.77.x.0/24 subnet"))
}

/// One `tallyd` in its namespace.
pub struct NsNode {
    /// 1-based index.
    pub index: usize,
    config: PathBuf,
    data: PathBuf,
    log: PathBuf,
    child: Mutex<Option<Child>>,
}

impl NsNode {
    /// Its process id, if it runs.
    pub fn pid(&self) -> Option<u32> {
        self.child.lock().unwrap().as_ref().map(Child::id)
    }

    /// Whether it runs (started and not killed, or exited on its own).
    pub fn running(&self) -> bool {
        let mut child = self.child.lock().unwrap();
        match child.as_mut().map(Child::try_wait) {
            Some(Ok(None)) => true,
            Some(_) => {
                *child = None;
                false
            }
            None => false,
        }
    }

    fn signal(&self, sig: i32) {
        if let Some(pid) = self.pid() {
            // Through kill(1): the workspace forbids `unsafe`, which libc::kill needs.
            let _ = Command::new("kill").arg(format!("-{sig}")).arg(pid.to_string()).status();
        }
    }

    /// SIGKILL, and waits until the process is gone.
    pub fn kill(&self) {
        if let Some(mut child) = self.child.lock().unwrap().take() {
            let _ = child.kill();
            let _ = child.wait();
        }
    }

    /// SIGSTOP: frozen with its sockets open.
    pub fn pause(&self) {
        self.signal(libc::SIGSTOP);
    }

    /// SIGCONT.
    pub fn resume(&self) {
        self.signal(libc::SIGCONT);
    }

    /// The last `lines` lines of its log.
    pub fn log_tail(&self, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.log).unwrap_or_default();
        let all: Vec<&str> = text.lines().collect();
        all[all.len().saturating_sub(lines)..].join("\n")
    }

    /// Its whole log so far.
    pub fn log(&self) -> String {
        std::fs::read_to_string(&self.log).unwrap_or_default()
    }
}

impl Drop for NsNode {
    fn drop(&mut self) {
        self.resume();
        self.kill();
    }
}

/// A cluster of real `tallyd` processes, each in its own namespace of a
/// [`Network`], reached over HTTP from the test process with a bearer token
/// (a node listening beyond loopback must declare `[[tokens]]`).
pub struct NsCluster {
    // Field order is drop order: the processes die before their namespaces go.
    nodes: Vec<NsNode>,
    /// The namespaces, and the partitions between them.
    pub net: Network,
    dir: tempfile::TempDir,
    http: reqwest::Client,
    token: String,
}

/// The token the test's requests carry (declared with the `admin` scope).
const TOKEN: &str = "tly_nemesis-0000000000000000000000000000000000000000000000000000000";

impl NsCluster {
    /// Writes the configs of `n` nodes (each `[cluster]` with `cluster_extra` lines
    /// added, each file with `extra` appended), starts them in their namespaces and
    /// waits until all are healthy, a leader is known and every node sees every
    /// other one up. `request_timeout_ms` is the test client's timeout.
    pub async fn start(n: usize, cluster_extra: &str, extra: &str, request_timeout_ms: u64) -> Result<Self> {
        let net = Network::create(n)?;
        let dir = tempfile::Builder::new().prefix("tally-netns-").tempdir()?;
        let tokens = tally_auth::config_lines(TOKEN, "nemesis", &[tally_auth::Scope::Admin], &[])
            .map_err(|e| anyhow!("token entry: {e}"))?;
        let mut nodes = Vec::new();
        for i in 1..=n {
            let config = dir.path().join(format!("node{i}.toml"));
            let data = dir.path().join(format!("data{i}"));
            let text = config_text(&net, i, &data, cluster_extra, &format!("{extra}\n{tokens}"));
            std::fs::write(&config, text)?;
            nodes.push(NsNode {
                index: i,
                config,
                data,
                log: dir.path().join(format!("node{i}.log")),
                child: Mutex::new(None),
            });
        }
        let http = reqwest::Client::builder()
            .timeout(Duration::from_millis(request_timeout_ms))
            .connect_timeout(Duration::from_millis(request_timeout_ms.min(2_000)))
            // Never a proxy from the environment: every request stays on the bridge.
            .no_proxy()
            .build()?;
        let cluster = Self { nodes, net, dir, http, token: TOKEN.to_string() };
        for i in 1..=n {
            cluster.spawn(i)?;
        }
        for i in 1..=n {
            cluster.wait_healthy(i, NODE_START_WAIT_MS).await?;
        }
        cluster.wait_connected(NODE_START_WAIT_MS).await?;
        Ok(cluster)
    }

    /// Node `i` (1-based).
    pub fn node(&self, i: usize) -> &NsNode {
        &self.nodes[i - 1]
    }

    /// How many nodes.
    pub fn len(&self) -> usize {
        self.nodes.len()
    }

    /// Never true.
    pub fn is_empty(&self) -> bool {
        self.nodes.is_empty()
    }

    /// The test's directory (configs, logs, data).
    pub fn dir(&self) -> &Path {
        self.dir.path()
    }

    /// Node `i`'s base URL, on its namespace address.
    pub fn url(&self, i: usize) -> String {
        format!("http://{}:{HTTP_PORT}", self.net.addr(i))
    }

    /// Starts node `i`'s process inside its namespace (after a kill, too) without
    /// waiting for it.
    pub fn spawn(&self, i: usize) -> Result<()> {
        let node = self.node(i);
        let log = std::fs::OpenOptions::new().create(true).append(true).open(&node.log)?;
        // `ip netns exec` enters the namespace and execs tallyd: the child's pid is
        // tallyd's own.
        let child = self
            .net
            .command(i, &crate::tallyd()?)
            .arg("--config")
            .arg(&node.config)
            .env("RUST_LOG", "info")
            .current_dir(self.dir.path())
            .stdout(Stdio::null())
            .stderr(log)
            .spawn()
            .context("starting tallyd in its namespace")?;
        *node.child.lock().unwrap() = Some(child);
        Ok(())
    }

    /// Deletes node `i`'s data directory, as a replaced disk would. It must not run.
    pub fn wipe(&self, i: usize) -> Result<()> {
        if self.node(i).running() {
            bail!("node{i} is running; kill it before wiping its disk");
        }
        match std::fs::remove_dir_all(&self.node(i).data) {
            Err(e) if e.kind() != std::io::ErrorKind::NotFound => {
                Err(e).context("deleting the data directory")
            }
            _ => Ok(()),
        }
    }

    /// Waits until node `i` answers `/healthz` with 200, for at most `wait_ms`.
    pub async fn wait_healthy(&self, i: usize, wait_ms: u64) -> Result<()> {
        let deadline = Instant::now() + Duration::from_millis(wait_ms);
        let url = format!("{}/healthz", self.url(i));
        loop {
            if let Ok(r) = self.http.get(&url).timeout(Duration::from_secs(1)).send().await {
                if r.status().is_success() {
                    return Ok(());
                }
            }
            if Instant::now() > deadline {
                bail!(
                    "node{i} not healthy within {wait_ms} ms; its log ends:\n{}",
                    self.node(i).log_tail(30)
                );
            }
            if !self.node(i).running() {
                bail!("node{i} exited; its log ends:\n{}", self.node(i).log_tail(30));
            }
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }

    /// Waits until every node sees every other node `up` and names a leader, for
    /// at most `wait_ms`.
    pub async fn wait_connected(&self, wait_ms: u64) -> Result<()> {
        let deadline = Instant::now() + Duration::from_millis(wait_ms);
        'retry: loop {
            if Instant::now() > deadline {
                bail!("nodes did not all connect to each other within {wait_ms} ms");
            }
            for i in 1..=self.len() {
                let view = match self.get(i, "/v1/cluster").await {
                    Ok(v) => v,
                    Err(_) => {
                        tokio::time::sleep(Duration::from_millis(100)).await;
                        continue 'retry;
                    }
                };
                let nodes = view["nodes"].as_array().cloned().unwrap_or_default();
                let up = nodes.iter().filter(|n| n["state"] == "up").count();
                if up < self.len() || view["leader"].as_str().is_none() {
                    tokio::time::sleep(Duration::from_millis(100)).await;
                    continue 'retry;
                }
            }
            return Ok(());
        }
    }

    /// The metadata leader as node `i` names it (1-based), if it names one.
    pub async fn leader(&self, i: usize) -> Option<usize> {
        let view = self.get(i, "/v1/cluster").await.ok()?;
        let name = view["leader"].as_str()?;
        name.strip_prefix("node")?.parse().ok()
    }

    /// GET on node `i`; the JSON body of a 2xx answer.
    pub async fn get(&self, i: usize, path: &str) -> Result<Value> {
        let r = self.http.get(format!("{}{path}", self.url(i))).bearer_auth(&self.token).send().await?;
        let status = r.status();
        let body: Value = r.json().await.unwrap_or(Value::Null);
        if !status.is_success() {
            bail!("GET {path} on node{i}: {status} {body}");
        }
        Ok(body)
    }

    /// A request with a JSON body on node `i`: (status, body), or the transport's
    /// error (refused, reset, timed out).
    pub async fn send(&self, i: usize, method: &str, path: &str, body: Value) -> Result<(u16, Value)> {
        let method = reqwest::Method::from_bytes(method.as_bytes())?;
        let r = self
            .http
            .request(method, format!("{}{path}", self.url(i)))
            .bearer_auth(&self.token)
            .json(&body)
            .send()
            .await?;
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

    /// A JSON summary of who runs (for failure messages).
    pub fn processes(&self) -> Value {
        json!(self.nodes.iter().map(|n| json!({"node": n.index, "pid": n.pid()})).collect::<Vec<_>>())
    }
}

/// The cluster's secret: 32 bytes, as a node listening beyond loopback wants.
const SECRET: &str = "7f3a9c1e5b2d8046af19c3e7d5b2086f4e1a7c9d3b5f2e80a6c4d1b9e3f70582";

/// Node `me`'s config: every address on its namespace's interface.
fn config_text(net: &Network, me: usize, data_dir: &Path, cluster_extra: &str, extra: &str) -> String {
    let mut s = format!(
        "[cluster]\nname = \"nemesis\"\nsecret = \"{SECRET}\"\nvnodes_per_node = 64\n\
         heartbeat_ms = 200\nheartbeat_misses_max = 4\nraft_heartbeat_ms = 200\n\
         raft_election_timeout_min_ms = 800\nraft_election_timeout_max_ms = 1600\n",
    );
    s += cluster_extra;
    s += "\n";
    for i in 1..=net.len() {
        let a = net.addr(i);
        s += &format!(
            "\n[[cluster.nodes]]\nid = \"node{i}\"\nraft_id = {i}\nhttp = \"{a}:{HTTP_PORT}\"\n\
             peer = \"{a}:{PEER_PORT}\"\nraft = \"{a}:{RAFT_PORT}\"\nresp = \"{a}:{RESP_PORT}\"\n"
        );
    }
    // The namespaces' links are the test's own: plaintext on them is stated.
    s += &format!(
        "\n[node]\nid = \"node{me}\"\ndata_dir = {:?}\ninsecure_plaintext = true\n",
        data_dir.display().to_string()
    );
    s += extra;
    s += "\n";
    s
}

#[cfg(test)]
mod tests {
    #[test]
    fn owner_pids_are_read_back_from_names() {
        assert_eq!(super::owner_pid("nm123450-node1"), Some(12345));
        assert_eq!(super::owner_pid("nm98761h"), Some(9876));
        assert_eq!(super::owner_pid("nm5"), None);
        assert_eq!(super::owner_pid("eth0"), None);
        assert_eq!(super::owner_pid("nmx1"), None);
    }
}
