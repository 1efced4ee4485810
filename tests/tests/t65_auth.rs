//! t65: client tokens on real nodes. A node that declares `[[tokens]]` answers 401
//! (with `WWW-Authenticate`) to a request without a token or with a wrong one, 403
//! to a token whose scope or counter prefixes do not allow the request, and serves
//! the ones they do — admin operations included, each audited with the token's name
//! and outcome, never the token. `/healthz` stays open; refusals are counted by
//! reason on `/metrics`. And `tallyd` refuses to start when a listener would be
//! reachable beyond loopback without tokens or with the shipped development secret.

use anyhow::{bail, Context, Result};
use reqwest::header::WWW_AUTHENTICATE;
use serde_json::{json, Value};
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tally_auth::Scope;
use tally_tests::{openapi, tally_cli, tallyd, TestCluster};

/// Tokens of this test (any string is a token; `tally token new` makes random ones).
const OPS: &str = "tly_t65-ops-0000000000000000000000000000000000000000000000000000000";
const READER: &str = "tly_t65-reader-000000000000000000000000000000000000000000000000000";
const INGEST: &str = "tly_t65-ingest-000000000000000000000000000000000000000000000000000";
const LIKES_ADMIN: &str = "tly_t65-likes-admin-0000000000000000000000000000000000000000000000";
/// A token no node declares.
const WRONG: &str = "tly_t65-wrong-0000000000000000000000000000000000000000000000000000";

/// How long a refused `tallyd` may take to exit.
const EXIT_WAIT_MS: u64 = 20_000;

/// The `[[tokens]]` entries of the secured nodes.
fn token_config() -> String {
    let entry = |token: &str, name: &str, scopes: &[Scope], prefixes: &[&str]| {
        let prefixes: Vec<String> = prefixes.iter().map(|p| p.to_string()).collect();
        tally_auth::config_lines(token, name, scopes, &prefixes).expect("valid entry")
    };
    [
        entry(OPS, "ops", &[Scope::Admin], &[]),
        entry(READER, "reader", &[Scope::Read], &[]),
        entry(INGEST, "ingest", &[Scope::Write], &["likes:"]),
        entry(LIKES_ADMIN, "likes-admin", &[Scope::Admin], &["likes:"]),
    ]
    .join("\n")
}

/// One request to `base` with an optional token: (status, `WWW-Authenticate`, body).
async fn call(
    http: &reqwest::Client,
    method: &str,
    url: &str,
    token: Option<&str>,
    body: Option<Value>,
) -> Result<(u16, String, Value)> {
    let mut r = http.request(reqwest::Method::from_bytes(method.as_bytes())?, url);
    if let Some(t) = token {
        r = r.bearer_auth(t);
    }
    if let Some(b) = body {
        r = r.json(&b);
    }
    let r = r.send().await?;
    let status = r.status().as_u16();
    let challenge = r.headers().get(WWW_AUTHENTICATE).and_then(|v| v.to_str().ok()).unwrap_or("").to_string();
    let text = r.text().await?;
    Ok((status, challenge, serde_json::from_str(&text).unwrap_or(Value::Null)))
}

/// Asserts a refusal: its status, error code and challenge, in the documented shape.
fn refused(
    got: &(u16, String, Value),
    status: u16,
    method: &str,
    template: &str,
    challenge: &str,
) -> Result<()> {
    let (s, c, body) = got;
    let code = if status == 401 { "unauthorized" } else { "forbidden" };
    assert_eq!((*s, body["error"]["code"].as_str()), (status, Some(code)), "{method} {template}: {body}");
    assert!(c.starts_with(challenge), "{method} {template}: WWW-Authenticate {c:?}, want {challenge:?}");
    openapi::check(method, template, status, body)
}

/// The value of the sample `name{labels}` in a Prometheus exposition.
fn sample(metrics: &str, series: &str) -> Option<u64> {
    metrics.lines().find_map(|l| l.strip_prefix(series)?.strip_prefix(' ')?.trim().parse().ok())
}

/// A token made by `tally token new --json`: (token, its `[[tokens]]` entry).
fn cli_token(name: &str, scopes: &str) -> Result<(String, String)> {
    let out = Command::new(tally_cli()?)
        .args(["--json", "token", "new", "--name", name, "--scopes", scopes])
        .output()?;
    if !out.status.success() {
        bail!("tally token new: {}", String::from_utf8_lossy(&out.stderr));
    }
    let v: Value = serde_json::from_slice(&out.stdout)?;
    let (token, lines) = (v["token"].as_str().unwrap_or(""), v["config"].as_str().unwrap_or(""));
    assert!(token.starts_with("tly_") && lines.contains("sha256:") && !lines.contains(token), "{v}");
    Ok((token.to_string(), lines.to_string()))
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn tokens_guard_the_api_and_admin_operations_are_audited() -> Result<()> {
    let (made, made_lines) = cli_token("made-by-cli", "read")?;
    let c = TestCluster::start_secured(2, &[2], &format!("{}\n{made_lines}", token_config()), OPS).await?;
    let http = reqwest::Client::builder().timeout(Duration::from_secs(15)).build()?;
    let base = c.node(1).url();
    let url = |path: &str| format!("{base}{path}");
    let (mut missing, mut unknown, mut malformed, mut scope, mut prefix) = (0u64, 0u64, 0u64, 0u64, 0u64);

    // Open without a token: health, the OpenAPI document, the status page.
    for path in ["/healthz", "/v1/openapi.json", "/ui", "/ui/app.js"] {
        let (s, _, _) = call(&http, "GET", &url(path), None, None).await?;
        assert_eq!(s, 200, "GET {path} without a token");
    }

    // 401: no token, a wrong token, credentials that are not a bearer token.
    let value = "/v1/counters/{name}/value";
    let got = call(&http, "GET", &url("/v1/counters/likes:1/value"), None, None).await?;
    refused(&got, 401, "GET", value, "Bearer realm=\"tally\"")?;
    assert_eq!(got.1, "Bearer realm=\"tally\"");
    missing += 1;
    let got = call(&http, "GET", &url("/v1/counters/likes:1/value"), Some(WRONG), None).await?;
    refused(&got, 401, "GET", value, "Bearer realm=\"tally\", error=\"invalid_token\"")?;
    unknown += 1;
    let r = http.get(url("/v1/cluster")).header("authorization", "Basic b3BzOm9wcw==").send().await?;
    assert_eq!(r.status().as_u16(), 401, "basic credentials");
    malformed += 1;
    let got =
        call(&http, "POST", &url("/v1/counters/likes:1/increments"), None, Some(json!({"delta": 1}))).await?;
    refused(&got, 401, "POST", "/v1/counters/{name}/increments", "Bearer")?;
    missing += 1;

    // 403: a read token writing; a prefix token on another prefix.
    let incr = "/v1/counters/{name}/increments";
    let got =
        call(&http, "POST", &url("/v1/counters/likes:1/increments"), Some(READER), Some(json!({"delta": 1})))
            .await?;
    refused(
        &got,
        403,
        "POST",
        incr,
        "Bearer realm=\"tally\", error=\"insufficient_scope\", scope=\"write\"",
    )?;
    scope += 1;
    let got = call(
        &http,
        "POST",
        &url("/v1/counters/credits:1/increments"),
        Some(INGEST),
        Some(json!({"delta": 1})),
    )
    .await?;
    refused(&got, 403, "POST", incr, "Bearer realm=\"tally\", error=\"insufficient_scope\"")?;
    prefix += 1;
    // The write token may not read either (write does not imply read).
    let got = call(&http, "GET", &url("/v1/counters/likes:1/value"), Some(INGEST), None).await?;
    refused(&got, 403, "GET", value, "Bearer")?;
    scope += 1;

    // Allowed: the prefix token writes its own prefix, the reader reads it.
    let got =
        call(&http, "POST", &url("/v1/counters/likes:1/increments"), Some(INGEST), Some(json!({"delta": 3})))
            .await?;
    assert_eq!(got.0, 200, "{}", got.2);
    let batch =
        json!({"increments": [{"counter": "likes:2", "delta": 1}, {"counter": "credits:2", "delta": 1}]});
    let got = call(&http, "POST", &url("/v1/increments"), Some(INGEST), Some(batch)).await?;
    assert_eq!(got.0, 200, "{}", got.2);
    assert_eq!(got.2["results"][0]["applied"], json!(true), "{}", got.2);
    assert_eq!(got.2["results"][1]["error"]["code"], json!("forbidden"), "{}", got.2);
    openapi::check("POST", "/v1/increments", 200, &got.2)?;
    prefix += 1;
    let got =
        call(&http, "GET", &url("/v1/counters/likes:1/value?consistency=fresh"), Some(READER), None).await?;
    assert_eq!((got.0, got.2["value"].as_i64()), (200, Some(3)), "{}", got.2);

    // Admin operations need admin; a prefix admin only on its prefix, and never on the cluster.
    let got =
        call(&http, "PUT", &url("/v1/counters/credits:7"), Some(READER), Some(json!({"shards": 4}))).await?;
    refused(&got, 403, "PUT", "/v1/counters/{name}", "Bearer")?;
    scope += 1;
    let got = call(&http, "DELETE", &url("/v1/counters/credits:7"), Some(LIKES_ADMIN), None).await?;
    refused(&got, 403, "DELETE", "/v1/counters/{name}", "Bearer")?;
    prefix += 1;
    let got = call(&http, "PUT", &url("/v1/cluster/members/node2"), Some(LIKES_ADMIN), None).await?;
    refused(&got, 403, "PUT", "/v1/cluster/members/{id}", "Bearer")?;
    prefix += 1;
    let got = call(&http, "PUT", &url("/v1/counters/likes:9"), Some(LIKES_ADMIN), Some(json!({"shards": 2})))
        .await?;
    assert_eq!(got.0, 201, "a prefix admin creates within its prefix: {}", got.2);

    // With the admin token: create, reshard, reconcile, delete, add a member.
    let sync = json!({"shards": 4, "durability": "sync"});
    let got = call(&http, "PUT", &url("/v1/counters/credits:7"), Some(OPS), Some(sync)).await?;
    assert_eq!(got.0, 201, "{}", got.2);
    let got =
        call(&http, "PUT", &url("/v1/counters/credits:7"), Some(OPS), Some(json!({"shards": 8}))).await?;
    assert_eq!((got.0, got.2["spec"]["shards"].as_u64()), (200, Some(8)), "resharded: {}", got.2);
    let got = call(
        &http,
        "POST",
        &url("/v1/counters/credits:7/reconcile"),
        Some(OPS),
        Some(json!({"authoritative": 100})),
    )
    .await?;
    assert_eq!(got.0, 200, "{}", got.2);
    let got = call(&http, "GET", &url("/v1/counters/credits:7/value?consistency=fresh"), Some(READER), None)
        .await?;
    assert_eq!(got.2["value"].as_i64(), Some(100), "{}", got.2);
    let got = call(&http, "DELETE", &url("/v1/counters/credits:7"), Some(OPS), None).await?;
    assert_eq!(got.0, 204, "{}", got.2);
    let got = call(&http, "DELETE", &url("/v1/counters/credits:7"), Some(OPS), None).await?;
    assert_eq!(got.0, 404, "deleting it again: {}", got.2);
    let got = call(&http, "PUT", &url("/v1/cluster/members/node2"), Some(OPS), None).await?;
    assert_eq!(got.0, 200, "adding the spare: {}", got.2);
    let members: Vec<&str> = got.2["nodes"]
        .as_array()
        .map(|ns| ns.iter().filter(|n| n["member"] == json!(true)).filter_map(|n| n["id"].as_str()).collect())
        .unwrap_or_default();
    assert_eq!(members, ["node1", "node2"], "{}", got.2);

    // Listings show a prefix token only its prefixes.
    call(&http, "PUT", &url("/v1/counters/views:1"), Some(OPS), None).await?;
    let got = call(&http, "GET", &url("/v1/counters"), Some(LIKES_ADMIN), None).await?;
    assert_eq!(got.2["counters"], json!(["likes:1", "likes:2", "likes:9"]), "{}", got.2);
    let got = call(&http, "GET", &url("/v1/counters?prefix=views"), Some(LIKES_ADMIN), None).await?;
    assert_eq!(got.2["counters"], json!([]), "{}", got.2);
    let got = call(&http, "GET", &url("/v1/counters?limit=2"), Some(LIKES_ADMIN), None).await?;
    assert_eq!(
        (got.2["counters"].clone(), got.2["next"].clone()),
        (json!(["likes:1", "likes:2"]), json!("likes:2"))
    );
    let got =
        call(&http, "GET", &url("/v1/counters?limit=2&cursor=likes:2"), Some(LIKES_ADMIN), None).await?;
    assert_eq!((got.2["counters"].clone(), got.2["next"].clone()), (json!(["likes:9"]), Value::Null));
    let got = call(&http, "GET", &url("/v1/counters"), Some(READER), None).await?;
    let all = got.2["counters"].as_array().map(Vec::len).unwrap_or(0);
    assert!(all >= 4 && got.2["counters"].to_string().contains("views:1"), "{}", got.2);

    // The tally CLI sends --token / TALLY_TOKEN.
    let cli = tally_cli()?;
    let out = Command::new(&cli).args(["--node", &base, "--token", INGEST, "incr", "likes:1"]).output()?;
    assert!(out.status.success(), "tally --token: {}", String::from_utf8_lossy(&out.stderr));
    let out = Command::new(&cli)
        .args(["--node", &base, "get", "likes:1", "--fresh"])
        .env("TALLY_TOKEN", READER)
        .output()?;
    assert!(out.status.success(), "TALLY_TOKEN: {}", String::from_utf8_lossy(&out.stderr));
    let out =
        Command::new(&cli).args(["--node", &base, "get", "likes:1"]).env_remove("TALLY_TOKEN").output()?;
    assert_eq!(out.status.code(), Some(1));
    assert!(String::from_utf8_lossy(&out.stderr).contains("unauthorized (HTTP 401)"));
    missing += 1;

    // /metrics needs a read token without prefixes, and counts the refusals by reason.
    let got = call(&http, "GET", &url("/metrics"), None, None).await?;
    assert_eq!(got.0, 401);
    missing += 1;
    let got = call(&http, "GET", &url("/metrics"), Some(LIKES_ADMIN), None).await?;
    assert_eq!(got.0, 403, "a prefix token sees no whole-node figures");
    prefix += 1;
    let metrics = http.get(url("/metrics")).bearer_auth(READER).send().await?.text().await?;
    for (reason, want) in [
        ("missing", missing),
        ("unknown_token", unknown),
        ("malformed", malformed),
        ("scope", scope),
        ("prefix", prefix),
    ] {
        let series = format!("tally_auth_refusals_total{{reason=\"{reason}\"}}");
        assert_eq!(sample(&metrics, &series), Some(want), "{series}");
    }
    for (op, outcome, want) in [
        ("put_counter", "ok", 4),
        ("reconcile", "ok", 1),
        ("delete_counter", "ok", 1),
        ("delete_counter", "rejected", 1),
        ("add_member", "ok", 1),
    ] {
        let series = format!("tally_admin_operations_total{{op=\"{op}\",outcome=\"{outcome}\"}}");
        assert_eq!(sample(&metrics, &series), Some(want), "{series}");
    }

    // The audit trail: names and outcomes, never a token.
    let log = c.log(1);
    let audit: Vec<&str> = log.lines().filter(|l| l.contains("tally::audit")).collect();
    let has = |needles: &[&str]| audit.iter().any(|l| needles.iter().all(|n| l.contains(n)));
    for needles in [
        &["event=\"refused\"", "reason=\"missing\"", "counter=\"likes:1\""][..],
        &["event=\"refused\"", "reason=\"unknown_token\"", "token=\"-\""],
        &["event=\"refused\"", "reason=\"scope\"", "token=\"reader\""],
        &["event=\"refused\"", "reason=\"prefix\"", "token=\"ingest\"", "counter=\"credits:1\""],
        &[
            "event=\"admin\"",
            "token=\"ops\"",
            "op=\"put_counter\"",
            "counter=\"credits:7\"",
            "outcome=\"ok\"",
        ],
        &["event=\"admin\"", "token=\"ops\"", "op=\"reconcile\"", "outcome=\"ok\""],
        &["event=\"admin\"", "token=\"ops\"", "op=\"delete_counter\"", "outcome=\"rejected\"", "status=404"],
        &["event=\"admin\"", "token=\"ops\"", "op=\"add_member\"", "node=\"node2\"", "outcome=\"ok\""],
        &["event=\"admin\"", "token=\"likes-admin\"", "op=\"put_counter\"", "counter=\"likes:9\""],
    ] {
        assert!(has(needles), "no audit line with {needles:?} in:\n{}", audit.join("\n"));
    }
    for token in [OPS, READER, INGEST, LIKES_ADMIN, WRONG, made.as_str()] {
        assert!(!log.contains(token), "the log holds a token");
    }
    Ok(())
}

/// Runs `tallyd` with `args` and the config `text`; (exit code, standard error).
fn run_tallyd(dir: &std::path::Path, text: &str, args: &[&str]) -> Result<(Option<i32>, String)> {
    let config = dir.join("node.toml");
    std::fs::write(&config, text)?;
    let mut child = Command::new(tallyd()?)
        .arg("--config")
        .arg(&config)
        .args(args)
        .current_dir(dir)
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .context("starting tallyd")?;
    let deadline = Instant::now() + Duration::from_millis(EXIT_WAIT_MS);
    loop {
        if let Some(status) = child.try_wait()? {
            let mut err = String::new();
            if let Some(mut e) = child.stderr.take() {
                std::io::Read::read_to_string(&mut e, &mut err)?;
            }
            return Ok((status.code(), err));
        }
        if Instant::now() > deadline {
            let _ = child.kill();
            let _ = child.wait();
            bail!("tallyd did not refuse to start within {EXIT_WAIT_MS} ms");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// A one- or three-node config; node1's `field` gets `addr`.
fn config(nodes: usize, field: &str, addr: &str, secret: &str, tokens: &str) -> String {
    let mut s = format!("[cluster]\nname = \"t65\"\nsecret = \"{secret}\"\n");
    for i in 1..=nodes {
        let port = |kind: u16| 17000 + kind * 100 + i as u16;
        let mut addrs =
            [("http", port(1).to_string()), ("peer", port(2).to_string()), ("raft", port(3).to_string())]
                .map(|(f, p)| (f, format!("127.0.0.1:{p}")));
        for a in addrs.iter_mut() {
            if i == 1 && a.0 == field {
                a.1 = addr.to_string();
            }
        }
        s += &format!("\n[[cluster.nodes]]\nid = \"node{i}\"\nraft_id = {i}\n");
        for (f, a) in addrs {
            s += &format!("{f} = \"{a}\"\n");
        }
    }
    s + "\n[node]\nid = \"node1\"\ndata_dir = \"./data\"\n\n" + tokens
}

#[test]
fn tallyd_refuses_exposed_listeners_without_tokens_or_with_the_dev_secret() -> Result<()> {
    let dir = tempfile::tempdir()?;
    // An address of the documentation range (TEST-NET-1): beyond loopback, and not
    // one this machine has, so a node that failed to refuse could not bind it either.
    let outside = "192.0.2.1:17999";
    let secret = "t65-a-long-random-secret";
    let tokens = tally_auth::config_lines(OPS, "ops", &[Scope::Admin], &[]).expect("valid");

    for args in [&[][..], &["--check"]] {
        let (code, err) = run_tallyd(dir.path(), &config(1, "http", outside, secret, ""), args)?;
        assert_eq!(code, Some(1), "{args:?}: {err}");
        for needle in ["refusing to start", "cluster.nodes[0].http", outside, "[[tokens]]", "tally token new"]
        {
            assert!(err.contains(needle), "{args:?}: {needle:?} not in {err}");
        }
        assert!(!err.contains("binding HTTP"), "refused before binding: {err}");

        let (code, err) =
            run_tallyd(dir.path(), &config(1, "http", outside, "tally-dev-secret", &tokens), args)?;
        assert_eq!(code, Some(1), "{args:?}: {err}");
        for needle in ["refusing to start", "development", "cluster.secret", "cluster-config/"] {
            assert!(err.contains(needle), "{args:?}: {needle:?} not in {err}");
        }
    }
    // Every listener of a cluster node counts: here only the peer address is exposed.
    let (code, err) = run_tallyd(dir.path(), &config(3, "peer", outside, secret, ""), &[])?;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("cluster.nodes[0].peer") && err.contains("[[tokens]]"), "{err}");
    let (code, err) =
        run_tallyd(dir.path(), &config(3, "raft", outside, "tally-dev-secret", &tokens), &["--check"])?;
    assert_eq!(code, Some(1), "{err}");
    assert!(err.contains("cluster.nodes[0].raft") && err.contains("development"), "{err}");

    // On loopback the shipped secret and no tokens are fine (the built-in config).
    let (code, err) =
        run_tallyd(dir.path(), &config(1, "http", "127.0.0.1:17998", "tally-dev-secret", ""), &["--check"])?;
    assert_eq!(code, Some(0), "{err}");
    let out = Command::new(tallyd()?).arg("--check").current_dir(dir.path()).output()?;
    assert!(out.status.success(), "the built-in config: {}", String::from_utf8_lossy(&out.stderr));
    assert!(String::from_utf8_lossy(&out.stdout).contains("client tokens: none"));
    Ok(())
}

#[test]
fn tallyd_wants_tls_and_a_long_random_secret_beyond_loopback() -> Result<()> {
    let dir = tempfile::tempdir()?;
    let outside = "192.0.2.1:17999";
    let tokens = tally_auth::config_lines(OPS, "ops", &[Scope::Admin], &[]).expect("valid");
    // Tokens, but a secret of 24 bytes: brute-forced from one captured handshake.
    let (code, err) = run_tallyd(
        dir.path(),
        &config(3, "peer", outside, "t65-a-long-random-secret", &tokens),
        &["--check"],
    )?;
    assert_eq!(code, Some(1), "{err}");
    for needle in
        ["refusing to start", "cluster.nodes[0].peer", "at least 32 random bytes", "openssl rand -hex 32"]
    {
        assert!(err.contains(needle), "{needle:?} not in {err}");
    }
    // A long random secret, but no TLS.
    let strong = "6f1c0e9a4b7d2385f0a1c3e5b7d9f1a2c4e6f8091b3d5f7a9c1e3f5a7b9d1f3a";
    let (code, err) = run_tallyd(dir.path(), &config(1, "http", outside, strong, &tokens), &["--check"])?;
    assert_eq!(code, Some(1), "{err}");
    for needle in ["refusing to start", "cluster.nodes[0].http", "without TLS", "[tls]", "insecure_plaintext"]
    {
        assert!(err.contains(needle), "{needle:?} not in {err}");
    }
    // Said out loud, plaintext is let through, with a warning.
    let insecure = config(1, "http", outside, strong, &tokens)
        .replace("[node]\n", "[node]\ninsecure_plaintext = true\n");
    let (code, err) = run_tallyd(dir.path(), &insecure, &["--check"])?;
    assert_eq!(code, Some(0), "{err}");
    assert!(err.contains("WITHOUT TLS") && err.contains("insecure_plaintext"), "no warning: {err}");
    Ok(())
}

/// One `[[tokens]]` entry for `token`.
fn token_entry(token: &str, name: &str, scopes: &[Scope], prefixes: &[&str]) -> String {
    let prefixes: Vec<String> = prefixes.iter().map(|p| p.to_string()).collect();
    tally_auth::config_lines(token, name, scopes, &prefixes).expect("valid entry")
}

/// Sends one RESP command on `s` and reads one reply line.
async fn resp_line(s: &mut tokio::net::TcpStream, args: &[&str]) -> Result<String> {
    use tokio::io::{AsyncReadExt, AsyncWriteExt};
    let mut req = format!("*{}\r\n", args.len());
    for a in args {
        req += &format!("${}\r\n{a}\r\n", a.len());
    }
    s.write_all(req.as_bytes()).await?;
    let mut got = Vec::new();
    while !got.ends_with(b"\r\n") {
        let mut chunk = [0u8; 1024];
        let n = tokio::time::timeout(Duration::from_secs(10), s.read(&mut chunk)).await??;
        if n == 0 {
            bail!("the node closed the RESP connection");
        }
        got.extend_from_slice(&chunk[..n]);
    }
    Ok(String::from_utf8_lossy(&got).trim().to_string())
}

/// Sends SIGHUP to node 1 and waits until its log has `text` after `from` bytes.
async fn hangup_and_wait(c: &TestCluster, from: usize, text: &str) -> Result<()> {
    let pid = c.node(1).pid().context("node1 runs")?;
    let status = Command::new("kill").args(["-HUP", &pid.to_string()]).status()?;
    assert!(status.success(), "kill -HUP");
    let deadline = Instant::now() + Duration::from_secs(20);
    while !c.log(1).get(from..).is_some_and(|t| t.contains(text)) {
        if Instant::now() > deadline {
            bail!("node1 never logged {text:?}:\n{}", c.node(1).log_tail());
        }
        tokio::time::sleep(Duration::from_millis(100)).await;
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn sighup_reloads_the_tokens_without_a_restart() -> Result<()> {
    let ops = token_entry(OPS, "ops", &[Scope::Admin], &[]);
    let reader = token_entry(READER, "reader", &[Scope::Read], &[]);
    let ingest = token_entry(INGEST, "ingest", &[Scope::Write], &["likes:"]);
    let c = TestCluster::start_secured(1, &[], &format!("{ops}\n{reader}"), OPS).await?;
    let http = reqwest::Client::new();
    let base = c.node(1).url();
    let pid = c.node(1).pid();
    c.put_counter(1, "likes:1", json!({"shards": 2, "durability": "sync"})).await?;
    let read = format!("{base}/v1/counters/likes:1");
    let incr = format!("{base}/v1/counters/likes:1/increments");
    assert_eq!(call(&http, "GET", &read, Some(READER), None).await?.0, 200);
    assert_eq!(call(&http, "POST", &incr, Some(INGEST), Some(json!({"delta": 1}))).await?.0, 401);
    // A RESP connection authenticated as the reader.
    let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", c.node(1).ports.resp)).await?;
    assert_eq!(resp_line(&mut conn, &["AUTH", READER]).await?, "+OK");
    let got = resp_line(&mut conn, &["GET", "likes:1"]).await?;
    assert!(!got.starts_with('-'), "the reader cannot GET over RESP: {got}");

    // The reader is revoked and the ingest token added, in the file; then SIGHUP.
    let config = c.config_path(1).to_path_buf();
    let text = std::fs::read_to_string(&config)?;
    assert!(text.contains(&reader));
    std::fs::write(&config, text.replace(&reader, &ingest))?;
    let before = c.log(1).len();
    hangup_and_wait(&c, before, "reloaded [[tokens]]: 2 in force").await?;
    assert_eq!(c.node(1).pid(), pid, "the node restarted");
    let (status, challenge, _) = call(&http, "GET", &read, Some(READER), None).await?;
    assert_eq!((status, challenge.is_empty()), (401, false), "the revoked reader still reads");
    let (status, _, body) = call(&http, "POST", &incr, Some(INGEST), Some(json!({"delta": 1}))).await?;
    assert_eq!(status, 200, "the added token is not in force: {body}");
    assert_eq!(call(&http, "GET", &read, Some(OPS), None).await?.0, 200);
    // The RESP connection authenticated under the old tokens must AUTH again, and
    // the revoked token no longer does.
    assert!(resp_line(&mut conn, &["GET", "likes:1"]).await?.starts_with("-NOAUTH"));
    assert!(resp_line(&mut conn, &["AUTH", READER]).await?.starts_with("-WRONGPASS"));
    assert_eq!(resp_line(&mut conn, &["AUTH", INGEST]).await?, "+OK");
    assert_eq!(resp_line(&mut conn, &["INCR", "likes:1"]).await?, ":2");

    // A config that does not load is refused whole: the tokens in force stay.
    std::fs::write(&config, "this is not toml [[[")?;
    let before = c.log(1).len();
    hangup_and_wait(&c, before, "token reload refused, the tokens in force stay").await?;
    assert_eq!(call(&http, "POST", &incr, Some(INGEST), Some(json!({"delta": 1}))).await?.0, 200);
    assert_eq!(call(&http, "GET", &read, Some(READER), None).await?.0, 401);
    assert_eq!(c.node(1).pid(), pid);
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn frequency_reads_need_read_on_both_front_ends_and_pfadd_creates_only_with_admin() -> Result<()> {
    let ops = token_entry(OPS, "ops", &[Scope::Admin], &[]);
    let reader = token_entry(READER, "reader", &[Scope::Read], &[]);
    let ingest = token_entry(INGEST, "ingest", &[Scope::Write], &["likes:"]);
    let c = TestCluster::start_secured(1, &[], &format!("{ops}\n{reader}\n{ingest}"), OPS).await?;
    let http = reqwest::Client::new();
    let base = c.node(1).url();
    c.put_counter(
        1,
        "likes:pages",
        json!({"frequency": {"epsilon": 0.01, "delta": 0.01}, "durability": "sync"}),
    )
    .await?;
    c.send(1, "POST", "/v1/counters/likes:pages/increments", json!({"delta": 3, "item": "/home"})).await?;
    // A read token reads frequencies over HTTP, as over RESP (CMS.QUERY, TOPK.LIST).
    for path in ["/v1/counters/likes:pages/frequency?item=/home", "/v1/counters/likes:pages/top?k=5"] {
        let (status, _, body) = call(&http, "GET", &format!("{base}{path}"), Some(READER), None).await?;
        assert_eq!(status, 200, "GET {path} with a read token: {body}");
    }
    let (status, _, body) =
        call(&http, "GET", &format!("{base}/v1/counters/likes:pages/top"), Some(INGEST), None).await?;
    assert_eq!(
        (status, body["error"]["code"].as_str()),
        (403, Some("forbidden")),
        "a write token reads no top"
    );
    let mut conn = tokio::net::TcpStream::connect(("127.0.0.1", c.node(1).ports.resp)).await?;
    assert_eq!(resp_line(&mut conn, &["AUTH", READER]).await?, "+OK");
    assert_eq!(
        resp_line(&mut conn, &["CMS.QUERY", "likes:pages", "/home"]).await?.lines().next(),
        Some("*1")
    );

    // PFADD: a write token adds members to a distinct counter that exists, but does
    // not create one (a counter with a spec of its own); an admin token does.
    c.put_counter(1, "likes:visitors", json!({"distinct": true})).await?;
    let mut writer = tokio::net::TcpStream::connect(("127.0.0.1", c.node(1).ports.resp)).await?;
    assert_eq!(resp_line(&mut writer, &["AUTH", INGEST]).await?, "+OK");
    assert_eq!(resp_line(&mut writer, &["PFADD", "likes:visitors", "u1"]).await?, ":1");
    let refused = resp_line(&mut writer, &["PFADD", "likes:new", "u1"]).await?;
    assert!(refused.starts_with("-NOPERM") && refused.contains("TALLY.CREATE"), "{refused}");
    let (status, _, _) =
        call(&http, "GET", &format!("{base}/v1/counters/likes:new"), Some(OPS), None).await?;
    assert_eq!(status, 404, "the refused PFADD created the counter");
    // Incrementing an unknown counter creates it with the node's spec: write suffices.
    assert_eq!(resp_line(&mut writer, &["INCR", "likes:plain"]).await?, ":1");
    let mut admin = tokio::net::TcpStream::connect(("127.0.0.1", c.node(1).ports.resp)).await?;
    assert_eq!(resp_line(&mut admin, &["AUTH", OPS]).await?, "+OK");
    assert_eq!(resp_line(&mut admin, &["PFADD", "likes:new", "u1"]).await?, ":1");
    Ok(())
}
