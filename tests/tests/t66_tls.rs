//! t66: TLS on every listener and between nodes. A client with the CA reaches the
//! HTTP port over https (curl `--cacert`, the `tally` CLI `--cacert`); plain HTTP to
//! it fails and the node stays up. A three-node TLS cluster passes t30's crash
//! story. A node whose certificate another CA signed never joins, and one with the
//! wrong cluster secret never joins either; both refusals are logged. The RESP
//! port speaks TLS with the same `[tls]` files: `redis-cli --tls --cacert` and the
//! Python `redis` package with `ssl=True` drive it, a plaintext client is refused
//! and logged while the node stays up, and with `tls.client_ca` only a client with
//! a certificate that CA signed gets in.

use anyhow::{bail, Result};
use serde_json::json;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tally_tests::{make_certs, python_redis, require_tool, stories, tally_cli, TestCluster, TlsSetup};

/// How long the refusal tests give a refused node to (wrongly) join.
const REFUSED_WATCH_MS: u64 = 4_000;

fn certs_of(dir: &Path) -> impl Fn(usize) -> (PathBuf, PathBuf) + '_ {
    move |i| (dir.join(format!("node{i}.pem")), dir.join(format!("node{i}-key.pem")))
}

fn curl(args: &[&str]) -> Result<(bool, String)> {
    let out = Command::new("curl").args(["-sS", "--max-time", "5"]).args(args).output()?;
    Ok((out.status.success(), String::from_utf8_lossy(&out.stdout).into_owned()))
}

/// Waits until `text` appears in node `i`'s log.
async fn wait_logged(c: &TestCluster, i: usize, text: &str) -> Result<()> {
    wait_logged_after(c, i, 0, text).await
}

/// Waits until `text` appears in node `i`'s log after its first `from` bytes.
async fn wait_logged_after(c: &TestCluster, i: usize, from: usize, text: &str) -> Result<()> {
    let deadline = Instant::now() + Duration::from_secs(20);
    while !c.log(i).get(from..).is_some_and(|tail| tail.contains(text)) {
        if Instant::now() > deadline {
            bail!("node{i} never logged {text:?}; log:\n{}", c.node(i).log_tail());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

/// What node `i` (TLS, trusted through `ca`) counts in
/// `tally_listener_refusals_total{listener, reason}`.
fn refusals(c: &TestCluster, i: usize, ca: &Path, listener: &str, reason: &str) -> Result<u64> {
    let ca = ca.display().to_string();
    let (ok, metrics) = curl(&["--cacert", &ca, &format!("{}/metrics", c.node(i).url())])?;
    anyhow::ensure!(ok, "node{i}'s /metrics did not answer");
    let series = format!("tally_listener_refusals_total{{listener=\"{listener}\",reason=\"{reason}\"}} ");
    let line = metrics.lines().find_map(|l| l.strip_prefix(series.as_str()));
    Ok(line.ok_or_else(|| anyhow::anyhow!("no {series:?} in:\n{metrics}"))?.trim().parse()?)
}

/// [`refusals`] once it reaches `at_least` (a refusal is counted just after the
/// client sees its connection close), or what it is after five seconds.
async fn refusals_reaching(
    c: &TestCluster,
    i: usize,
    ca: &Path,
    series: (&str, &str),
    at_least: u64,
) -> Result<u64> {
    let deadline = Instant::now() + Duration::from_secs(5);
    loop {
        let n = refusals(c, i, ca, series.0, series.1)?;
        if n >= at_least || Instant::now() > deadline {
            return Ok(n);
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
}

/// The state node `from` reports for node `of` in `/v1/cluster`.
async fn state_seen(c: &TestCluster, from: usize, of: usize) -> Result<String> {
    let view = c.get(from, "/v1/cluster").await?;
    let nodes = view["nodes"].as_array().cloned().unwrap_or_default();
    let node = nodes.iter().find(|n| n["id"] == format!("node{of}").as_str());
    Ok(node.and_then(|n| n["state"].as_str()).unwrap_or("absent").to_string())
}

/// Node 3 stays apart for [`REFUSED_WATCH_MS`] while nodes 1 and 2 serve.
async fn node3_stays_out(c: &TestCluster) -> Result<()> {
    c.put_counter(1, "likes", json!({"shards": 4})).await?;
    let deadline = Instant::now() + Duration::from_millis(REFUSED_WATCH_MS);
    while Instant::now() < deadline {
        for from in [1, 2] {
            let state = state_seen(c, from, 3).await?;
            assert_ne!(state, "up", "node{from} sees the refused node3 up");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    assert!(c.node(1).pid().is_some() && c.node(2).pid().is_some());
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn https_with_the_ca_works_and_plain_http_to_the_tls_port_fails() -> Result<()> {
    let Some(_) = require_tool("curl", "apt-get install curl")? else { return Ok(()) };
    let dir1 = tempfile::tempdir()?;
    let certs = make_certs(dir1.path(), "t66 CA", &["node1"])?;
    let ca = certs.join("ca.pem");
    let c = TestCluster::start_tls(1, &TlsSetup { ca: &ca, certs: &certs_of(&certs) }).await?;
    let https = format!("{}/healthz", c.node(1).url());
    let plain = https.replacen("https://", "http://", 1);
    let ca_arg = ca.display().to_string();

    let (ok, body) = curl(&["--cacert", &ca_arg, &https])?;
    assert!(ok, "curl --cacert failed");
    assert_eq!(serde_json::from_str::<serde_json::Value>(&body)?, json!({"status": "ok"}));
    // Without the CA the certificate is not trusted; plain HTTP gets no answer.
    assert!(!curl(&[&https])?.0, "curl trusted the node without --cacert");
    let (ok, body) = curl(&[&plain])?;
    assert!(!ok && !body.contains("status"), "plain HTTP got an answer: {body}");
    wait_logged(&c, 1, "HTTP: refused a connection: TLS handshake failed").await?;
    // Counted by reason: the client that did not trust the certificate, and the plaintext one.
    assert_eq!(refusals_reaching(&c, 1, &ca, ("http", "tls_handshake"), 2).await?, 2);
    // The node stays up and serves the next client.
    assert!(curl(&["--cacert", &ca_arg, &https])?.0, "the node stopped serving after a plaintext client");
    assert!(c.node(1).pid().is_some());

    // The CLI takes https URLs and --cacert.
    let cli = |extra: &[&str]| {
        Command::new(tally_cli()?)
            .args(["--node", &c.node(1).url(), "--json"])
            .args(extra)
            .args(["create", "visits"])
            .output()
            .map_err(anyhow::Error::from)
    };
    let out = cli(&["--cacert", &ca_arg])?;
    assert!(out.status.success(), "tally --cacert: {}", String::from_utf8_lossy(&out.stderr));
    let out = cli(&[])?;
    assert!(!out.status.success(), "tally trusted the node without --cacert");
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    assert!(said.contains("certificate"), "{said}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_tls_cluster_loses_no_acknowledged_sync_increment_when_a_node_is_killed() -> Result<()> {
    let dir2 = tempfile::tempdir()?;
    let certs = make_certs(dir2.path(), "t66 CA", &["node1", "node2", "node3"])?;
    let ca = certs.join("ca.pem");
    let c = TestCluster::start_tls(3, &TlsSetup { ca: &ca, certs: &certs_of(&certs) }).await?;
    stories::kill_one_node_under_sync_writes(Arc::new(c)).await
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_a_certificate_from_another_ca_cannot_join() -> Result<()> {
    let dir3 = tempfile::tempdir()?;
    let ours = make_certs(dir3.path(), "t66 CA", &["node1", "node2"])?;
    let dir4 = tempfile::tempdir()?;
    let theirs = make_certs(dir4.path(), "another CA", &["node3"])?;
    let ca = ours.join("ca.pem");
    // Node 3 trusts the cluster CA but presents a certificate another CA signed.
    let certs = |i: usize| if i == 3 { certs_of(&theirs)(i) } else { certs_of(&ours)(i) };
    let c = TestCluster::spawn_tls_healthy(3, &[1, 2], &TlsSetup { ca: &ca, certs: &certs }).await?;
    c.wait_leader().await?;
    node3_stays_out(&c).await?;
    // Nodes 1 and 2 dial node 3's sessions and refuse its certificate; node 3's raft
    // calls are refused at their TLS handshake.
    wait_logged(&c, 1, "cannot reach node3").await?;
    assert!(c.log(1).contains("invalid peer certificate"), "{}", c.node(1).log_tail());
    let refused = "raft: refused a connection: TLS handshake failed";
    assert!(c.log(1).contains(refused) || c.log(2).contains(refused), "no raft refusal logged");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn certificates_of_the_cluster_ca_open_node_links_only_for_the_node_they_name() -> Result<()> {
    let dir7 = tempfile::tempdir()?;
    // The cluster CA also signed a certificate for something that is no node.
    let certs = make_certs(dir7.path(), "t66 CA", &["node1", "node2", "intruder"])?;
    let ca = certs.join("ca.pem");
    let c = TestCluster::start_tls(2, &TlsSetup { ca: &ca, certs: &certs_of(&certs) }).await?;
    let pem = |name: &str| std::fs::read(certs.join(name));
    let intruder = [pem("intruder.pem")?, pem("intruder-key.pem")?].concat();
    let client = reqwest::Client::builder()
        .tls_certs_only([reqwest::Certificate::from_pem(&pem("ca.pem")?)?])
        .identity(reqwest::Identity::from_pem(&intruder)?)
        .timeout(Duration::from_secs(10))
        .build()?;
    // It cannot reach a raft endpoint: the handshake wants a certificate naming a node.
    let url = format!("https://127.0.0.1:{}/raft/identity", c.node(1).ports.raft);
    let sent = client.post(&url).header("tally-raft-protocol", "1").json(&serde_json::json!({})).send().await;
    assert!(
        sent.is_err(),
        "a certificate naming no node reached the raft endpoint: {:?}",
        sent.map(|r| r.status())
    );
    wait_logged(&c, 1, "raft: refused a connection: TLS handshake failed").await?;
    // A node started with a certificate that names another node refuses to start.
    let config = c.config_path(2).to_path_buf();
    let text = std::fs::read_to_string(&config)?;
    c.node(2).kill();
    std::fs::write(
        &config,
        text.replace("node2.pem", "node1.pem").replace("node2-key.pem", "node1-key.pem"),
    )?;
    let out = Command::new("timeout")
        .arg("20")
        .arg(tally_tests::tallyd()?)
        .arg("--config")
        .arg(&config)
        .current_dir(c.dir())
        .output()?;
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success() && err.contains("does not name node \"node2\""), "{err}");
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_node_with_the_wrong_secret_cannot_join_a_tls_cluster() -> Result<()> {
    let dir5 = tempfile::tempdir()?;
    let certs = make_certs(dir5.path(), "t66 CA", &["node1", "node2", "node3"])?;
    let ca = certs.join("ca.pem");
    let c = TestCluster::start_tls(3, &TlsSetup { ca: &ca, certs: &certs_of(&certs) }).await?;
    c.node(3).kill();
    // Both survivors first see the killed node3 leave `up`, so what they report after
    // the restart below is about the new node3, not what they saw before the kill.
    let deadline = Instant::now() + Duration::from_secs(15);
    for from in [1, 2] {
        while state_seen(&c, from, 3).await? == "up" {
            anyhow::ensure!(Instant::now() < deadline, "node{from} still sees the killed node3 up");
            tokio::time::sleep(Duration::from_millis(100)).await;
        }
    }
    let config = c.dir().join("node3.toml");
    let text = std::fs::read_to_string(&config)?;
    std::fs::write(&config, text.replace("secret = \"tally-test-secret\"", "secret = \"another-secret-1\""))?;
    let before = c.log(1).len();
    c.spawn(3)?;
    // Its certificate is good, so TLS passes; the secret handshake fails.
    wait_logged_after(&c, 1, before, "handshake with node3").await?;
    node3_stays_out(&c).await?;
    let after = &c.log(1)[before..];
    assert!(after.contains("failed (wrong secret"), "{}", c.node(1).log_tail());
    // Node 3 is dialed by the others (the smaller name dials) and refuses their
    // sessions, which cannot prove its secret: it counts them and says so.
    wait_logged(&c, 3, "refused an inbound node-to-node session").await?;
    assert!(refusals_reaching(&c, 3, &ca, ("node", "unauthenticated"), 1).await? >= 1);
    assert!(!after.contains("peer node3 is up"), "node1 saw node3 up: {}", c.node(1).log_tail());
    Ok(())
}

/// `redis-cli -p PORT FLAGS... ARGS...`: (whether it succeeded, what it printed on
/// both streams, trimmed).
fn redis_cli(port: u16, flags: &[&str], args: &[&str]) -> Result<(bool, String)> {
    let out = Command::new("redis-cli")
        .arg("-p")
        .arg(port.to_string())
        .args(flags)
        .args(args)
        .stdin(Stdio::null())
        .output()?;
    let said = format!("{}{}", String::from_utf8_lossy(&out.stdout), String::from_utf8_lossy(&out.stderr));
    Ok((out.status.success(), said.trim().to_string()))
}

/// The Python client over TLS: argv is the port and the CA file.
const PYTHON_TLS: &str = r#"
import sys, redis
r = redis.Redis(host="127.0.0.1", port=int(sys.argv[1]), ssl=True, ssl_ca_certs=sys.argv[2],
                socket_timeout=10)
assert r.ping()
got = r.incrby("likes", 2)
assert got == 7, f"incrby: {got!r}"
p = r.pipeline(transaction=False)
for _ in range(10):
    p.incr("likes")
got = p.execute()
assert got[-1] == 17, f"pipeline: {got!r}"
print("python tls ok")
"#;

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn resp_over_tls_serves_redis_clients_and_refuses_plaintext() -> Result<()> {
    let Some(_) = require_tool("redis-cli", "apt-get install redis-tools")? else { return Ok(()) };
    let dir6 = tempfile::tempdir()?;
    let certs = make_certs(dir6.path(), "t66 CA", &["node1"])?;
    let ca = certs.join("ca.pem");
    let ca_arg = ca.display().to_string();
    let c = TestCluster::start_tls(1, &TlsSetup { ca: &ca, certs: &certs_of(&certs) }).await?;
    let port = c.node(1).ports.resp;
    let tls = ["--tls", "--cacert", &ca_arg];

    assert_eq!(redis_cli(port, &tls, &["PING"])?, (true, "PONG".to_string()));
    let create = ["TALLY.CREATE", "likes", "DURABILITY", "sync", "SHARDS", "4"];
    assert_eq!(redis_cli(port, &tls, &create)?, (true, "created".to_string()));
    assert_eq!(redis_cli(port, &tls, &["INCRBY", "likes", "5"])?, (true, "5".to_string()));
    assert_eq!(redis_cli(port, &tls, &["GET", "likes"])?, (true, "5".to_string()));
    // Plaintext to the TLS port gets no reply; the refusal is logged and counted.
    let (_, said) = redis_cli(port, &[], &["PING"])?;
    assert!(!said.contains("PONG"), "plaintext RESP got an answer: {said}");
    wait_logged(&c, 1, "RESP: refused a connection: TLS handshake failed").await?;
    assert_eq!(refusals_reaching(&c, 1, &ca, ("resp", "tls_handshake"), 1).await?, 1, "the plaintext client");
    // Without the CA the node's certificate is not trusted (the client aborts the
    // handshake, which counts too).
    let (_, said) = redis_cli(port, &["--tls"], &["PING"])?;
    assert!(!said.contains("PONG"), "redis-cli trusted the node without --cacert: {said}");
    let n = refusals_reaching(&c, 1, &ca, ("resp", "tls_handshake"), 2).await?;
    assert!(n >= 2, "the client that did not trust the node was not counted");
    if let Some(python) = python_redis()? {
        let out = Command::new(python).arg("-c").arg(PYTHON_TLS).arg(port.to_string()).arg(&ca).output()?;
        assert!(
            out.status.success(),
            "python redis over TLS: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The node is still up and serving, over RESP and HTTP.
    assert!(c.node(1).pid().is_some());
    let (ok, total) = redis_cli(port, &tls, &["GET", "likes"])?;
    assert!(ok && (total == "5" || total == "17"), "after the plaintext client: {total}");

    // With tls.client_ca, a client must present a certificate the CA signed.
    c.node(1).kill();
    let config = c.config_path(1).to_path_buf();
    let text = std::fs::read_to_string(&config)?;
    let client_ca = certs.join("client-ca.pem");
    std::fs::write(&config, text.replace("[tls]\n", &format!("[tls]\nclient_ca = {client_ca:?}\n")))?;
    let before = c.log(1).len();
    c.spawn(1)?;
    // HTTP now wants a client certificate too, so the fixture's health check cannot
    // pass: the listener's start is in the log.
    wait_logged_after(&c, 1, before, "serving RESP").await?;
    let (_, said) = redis_cli(port, &tls, &["PING"])?;
    assert!(!said.contains("PONG"), "a client without a certificate got in: {said}");
    wait_logged_after(&c, 1, before, "RESP: refused a connection: TLS handshake failed").await?;
    let (cert, key) = (certs.join("client.pem"), certs.join("client-key.pem"));
    let (cert, key) = (cert.display().to_string(), key.display().to_string());
    let with_cert = ["--tls", "--cacert", &ca_arg, "--cert", &cert, "--key", &key];
    assert_eq!(redis_cli(port, &with_cert, &["PING"])?, (true, "PONG".to_string()));
    Ok(())
}
