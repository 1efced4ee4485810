//! The operators' interfaces on a real cluster: listing counters page by page
//! (HTTP and `tally ls`), the OpenAPI document (accepted by `openapi-spec-validator`,
//! and every endpoint's success and error answers checked against its schemas), the
//! Grafana dashboard's metrics (each one exists on a live node), `promtool check
//! metrics` on `/metrics`, and `tally top` running in tmux.
//!
//! Each external program (openapi-spec-validator, promtool, tmux) skips its part
//! with a message only when it is missing and `CI` is unset.

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::collections::BTreeSet;
use std::io::Write;
use std::process::{Command, Stdio};
use std::time::{Duration, Instant};
use tally_tests::{openapi, require_tool, tally_cli, TestCluster};

/// One request: (status, JSON body or `null`), checked against the document.
async fn call(
    http: &reqwest::Client,
    base: &str,
    method: &str,
    template: &str,
    path: &str,
    body: Option<Value>,
) -> Result<(u16, Value)> {
    let mut req = http.request(reqwest::Method::from_bytes(method.as_bytes())?, format!("{base}{path}"));
    if let Some(b) = body {
        req = req.json(&b);
    }
    let r = req.send().await?;
    let status = r.status().as_u16();
    let text = r.text().await?;
    let value: Value =
        if text.is_empty() { Value::Null } else { serde_json::from_str(&text).unwrap_or(Value::Null) };
    openapi::check(method, template, status, &value).with_context(|| format!("{method} {path}"))?;
    Ok((status, value))
}

fn expect(got: (u16, Value), status: u16) -> Result<Value> {
    if got.0 != status {
        bail!("expected {status}, got {} {}", got.0, got.1);
    }
    Ok(got.1)
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn listing_openapi_dashboard_metrics_and_top() -> Result<()> {
    let cluster = TestCluster::start(3).await?;
    let http = reqwest::Client::builder().timeout(Duration::from_secs(15)).build()?;
    let (b1, b2) = (cluster.node(1).url(), cluster.node(2).url());

    // --- Every endpoint, success and error answers, against the document.
    let c = "/v1/counters/{name}";
    expect(call(&http, &b1, "PUT", c, "/v1/counters/ls:a", Some(json!({"shards": 4}))).await?, 201)?;
    expect(call(&http, &b1, "PUT", c, "/v1/counters/ls:a", Some(json!({"rollup_ms": 500}))).await?, 200)?;
    expect(call(&http, &b1, "PUT", c, "/v1/counters/ls:a", Some(json!({"shards": 0}))).await?, 422)?;
    expect(call(&http, &b1, "PUT", c, "/v1/counters/bad%zz", Some(json!({}))).await?, 400)?;
    expect(call(&http, &b1, "GET", c, "/v1/counters/ls:a", None).await?, 200)?;
    expect(call(&http, &b1, "GET", c, "/v1/counters/nope", None).await?, 404)?;
    let inc = "/v1/counters/{name}/increments";
    let incr = |body: Value| call(&http, &b1, "POST", inc, "/v1/counters/ls:a/increments", Some(body));
    expect(incr(json!({"delta": 5, "event_id": "e1"})).await?, 200)?;
    let dup = expect(incr(json!({"delta": 5, "event_id": "e1"})).await?, 200)?;
    assert_eq!(dup["duplicate"], true);
    expect(incr(json!({"delta": 6, "event_id": "e1"})).await?, 409)?;
    expect(incr(json!({"delta": 0})).await?, 400)?;
    let batch = json!({"increments": [{"counter": "ls:b", "delta": 1}, {"counter": "", "delta": 1}]});
    let results =
        expect(call(&http, &b1, "POST", "/v1/increments", "/v1/increments", Some(batch)).await?, 200)?;
    assert_eq!(results["results"][0]["applied"], true, "{results}");
    expect(
        call(&http, &b1, "POST", "/v1/increments", "/v1/increments", Some(json!({"nope": 1}))).await?,
        400,
    )?;
    let v = "/v1/counters/{name}/value";
    let read =
        expect(call(&http, &b2, "GET", v, "/v1/counters/ls:a/value?consistency=fresh", None).await?, 200)?;
    assert_eq!(read["value"], 5, "{read}");
    expect(call(&http, &b2, "GET", v, "/v1/counters/ls:a/value", None).await?, 200)?;
    expect(call(&http, &b2, "GET", v, "/v1/counters/ls:a/value?consistency=maybe", None).await?, 400)?;
    expect(call(&http, &b2, "GET", v, "/v1/counters/nope/value", None).await?, 404)?;
    let d = "/v1/counters/{name}/distinct";
    expect(call(&http, &b1, "PUT", c, "/v1/counters/ls:d", Some(json!({"distinct": true}))).await?, 201)?;
    expect(
        call(
            &http,
            &b1,
            "POST",
            inc,
            "/v1/counters/ls:d/increments",
            Some(json!({"delta": 1, "member": "u1"})),
        )
        .await?,
        200,
    )?;
    expect(call(&http, &b1, "GET", d, "/v1/counters/ls:d/distinct", None).await?, 200)?;
    expect(call(&http, &b1, "GET", d, "/v1/counters/nope/distinct", None).await?, 404)?;
    let s = "/v1/counters/{name}/shards";
    expect(call(&http, &b1, "GET", s, "/v1/counters/ls:a/shards", None).await?, 200)?;
    expect(call(&http, &b1, "GET", s, "/v1/counters/nope/shards", None).await?, 404)?;
    let r = "/v1/counters/{name}/reconcile";
    let fixed = expect(
        call(&http, &b1, "POST", r, "/v1/counters/ls:a/reconcile", Some(json!({"authoritative": 7}))).await?,
        200,
    )?;
    assert_eq!(fixed["drift"], 2, "{fixed}");
    expect(
        call(&http, &b1, "POST", r, "/v1/counters/nope/reconcile", Some(json!({"authoritative": 7}))).await?,
        404,
    )?;
    expect(call(&http, &b1, "POST", r, "/v1/counters/ls:a/reconcile", Some(json!({}))).await?, 400)?;
    expect(call(&http, &b1, "GET", "/v1/cluster", "/v1/cluster", None).await?, 200)?;
    let m = "/v1/cluster/members/{id}";
    // A node the config does not list: whatever the answer, it is a documented one.
    call(&http, &b1, "PUT", m, "/v1/cluster/members/node9", None).await?;
    call(&http, &b1, "DELETE", m, "/v1/cluster/members/node9", None).await?;
    expect(call(&http, &b1, "PUT", m, "/v1/cluster/members/node1", None).await?, 200)?;
    let a = "/v1/cluster/nodes/{id}/accept-loss";
    let (status, body) = call(&http, &b1, "POST", a, "/v1/cluster/nodes/node9/accept-loss", None).await?;
    assert!(status >= 400, "{status} {body}");
    expect(call(&http, &b1, "GET", "/healthz", "/healthz", None).await?, 200)?;
    let stats = expect(call(&http, &b1, "GET", "/v1/stats", "/v1/stats?limit=5", None).await?, 200)?;
    assert_eq!(stats["node"], "node1");
    let busy = stats["counters"].as_array().context("counters")?;
    let ls_a = busy.iter().find(|c| c["name"] == "ls:a").context("ls:a among the busiest")?;
    assert_eq!(ls_a["drift"], 2, "{stats}");
    expect(call(&http, &b1, "GET", "/v1/stats", "/v1/stats?limit=0", None).await?, 400)?;
    expect(call(&http, &b1, "GET", "/v1/stats", "/v1/stats?top=3", None).await?, 400)?;
    expect(call(&http, &b1, "DELETE", c, "/v1/counters/ls:d", None).await?, 204)?;
    expect(call(&http, &b1, "DELETE", c, "/v1/counters/ls:d", None).await?, 404)?;

    // --- Listing: pages in name order, on any node, bounded, with typed errors.
    let mut want = BTreeSet::from(["ls:a".to_string(), "ls:b".to_string()]);
    let batch: Vec<Value> = (0..35).map(|i| json!({"counter": format!("ls:n{i:02}"), "delta": 1})).collect();
    want.extend((0..35).map(|i| format!("ls:n{i:02}")));
    expect(
        call(&http, &b1, "POST", "/v1/increments", "/v1/increments", Some(json!({"increments": batch})))
            .await?,
        200,
    )?;
    expect(
        call(&http, &b1, "POST", inc, "/v1/counters/other:1/increments", Some(json!({"delta": 1}))).await?,
        200,
    )?;
    let l = "/v1/counters";
    for base in [&b1, &b2] {
        // Followers list what they have applied: wait until it has all arrived.
        let deadline = Instant::now() + Duration::from_secs(10);
        loop {
            let mut got = Vec::new();
            let mut cursor: Option<String> = None;
            let mut pages = 0;
            loop {
                let path = match &cursor {
                    Some(c) => format!("/v1/counters?prefix=ls:&limit=10&cursor={c}"),
                    None => "/v1/counters?prefix=ls:&limit=10".to_string(),
                };
                let page = expect(call(&http, base, "GET", l, &path, None).await?, 200)?;
                let names: Vec<String> = page["counters"]
                    .as_array()
                    .context("counters")?
                    .iter()
                    .filter_map(|n| n.as_str().map(String::from))
                    .collect();
                assert!(names.len() <= 10, "{page}");
                got.extend(names);
                pages += 1;
                match page["next"].as_str() {
                    Some(n) => cursor = Some(n.to_string()),
                    None => break,
                }
            }
            let sorted: Vec<String> = want.iter().cloned().collect();
            if got == sorted {
                assert_eq!(pages, 4, "37 names in pages of 10");
                break;
            }
            if Instant::now() > deadline {
                bail!("listing on {base} gave {got:?}, want {sorted:?}");
            }
            tokio::time::sleep(Duration::from_millis(200)).await;
        }
    }
    let all = expect(call(&http, &b1, "GET", l, "/v1/counters", None).await?, 200)?;
    assert!(all["counters"].as_array().is_some_and(|c| c.iter().any(|n| n == "other:1")), "{all}");
    let long_prefix = format!("/v1/counters?prefix={}", "p".repeat(513));
    for bad in [
        "/v1/counters?limit=0",
        "/v1/counters?limit=1001",
        long_prefix.as_str(),
        "/v1/counters?cursor=a%20b",
        "/v1/counters?limit=x",
        "/v1/counters?sort=1",
    ] {
        let e = expect(call(&http, &b1, "GET", l, bad, None).await?, 400)?;
        assert!(
            e["error"]["code"] == "invalid_listing" || e["error"]["code"] == "invalid_query",
            "{bad}: {e}"
        );
    }

    // `tally ls` pages through the same listing.
    let out = Command::new(tally_cli()?)
        .args(["--node", &b2, "ls", "--prefix", "ls:n", "--limit", "30"])
        .output()?;
    assert!(out.status.success(), "{}", String::from_utf8_lossy(&out.stderr));
    let text = String::from_utf8(out.stdout)?;
    let lines: Vec<&str> = text.lines().collect();
    let expected: Vec<String> = (0..30).map(|i| format!("ls:n{i:02}")).collect();
    assert_eq!(lines, expected);

    // --- The OpenAPI document: served as written, accepted by a real validator.
    let served: Value = http.get(format!("{b1}/v1/openapi.json")).send().await?.json().await?;
    assert_eq!(&served, openapi::document(), "tallyd serves the document in the repository");
    if let Some(validator) = require_tool("openapi-spec-validator", "pip install openapi-spec-validator")? {
        let out = Command::new(validator).arg(openapi::path()).output()?;
        assert!(
            out.status.success(),
            "openapi-spec-validator: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // Every path the router serves is documented.
    for path in [
        "/v1/counters",
        "/v1/counters/{name}",
        "/v1/stats",
        "/v1/cluster",
        "/metrics",
        "/healthz",
        "/ui",
        "/v1/openapi.json",
    ] {
        assert!(!openapi::document()["paths"][path].is_null(), "{path} is not documented");
    }

    // --- Metrics: promtool accepts them; the dashboard names only metrics that exist.
    let metrics = http.get(format!("{b1}/metrics")).send().await?.text().await?;
    if let Some(promtool) = require_tool("promtool", "apt-get install -y prometheus")? {
        let mut child = Command::new(promtool)
            .args(["check", "metrics"])
            .stdin(Stdio::piped())
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()?;
        child.stdin.take().context("stdin")?.write_all(metrics.as_bytes())?;
        let out = child.wait_with_output()?;
        assert!(
            out.status.success(),
            "promtool check metrics: {}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        );
    }
    let exported: BTreeSet<&str> = metrics
        .lines()
        .filter(|l| !l.starts_with('#') && !l.is_empty())
        .filter_map(|l| l.split(['{', ' ']).next())
        .collect();
    let dashboard_path = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("../docs/grafana/tally.json");
    let dashboard: Value = serde_json::from_str(&std::fs::read_to_string(dashboard_path)?)?;
    let mut named = BTreeSet::new();
    for panel in dashboard["panels"].as_array().context("panels")? {
        for target in panel["targets"].as_array().context("targets")? {
            let expr = target["expr"].as_str().context("expr")?;
            let bytes = expr.as_bytes();
            let mut i = 0;
            while let Some(at) = expr[i..].find("tally_") {
                let start = i + at;
                let end = start
                    + expr[start..]
                        .find(|c: char| !(c.is_ascii_alphanumeric() || c == '_'))
                        .unwrap_or(expr.len() - start);
                let preceded =
                    start > 0 && (bytes[start - 1].is_ascii_alphanumeric() || bytes[start - 1] == b'_');
                if !preceded {
                    named.insert(expr[start..end].to_string());
                }
                i = end;
            }
        }
    }
    assert!(named.len() >= 10, "the dashboard names {named:?}");
    for name in &named {
        assert!(
            exported.contains(name.as_str()),
            "the dashboard names {name}, which /metrics does not export"
        );
    }

    // --- `tally top` in a terminal: the table of the busiest counters.
    if let Some(tmux) = require_tool("tmux", "apt-get install -y tmux")? {
        // A tmux server of this test's own, on its own socket.
        let socket = format!("tally-test-{}", std::process::id());
        let tmux_cmd = |args: &[&str]| Command::new(&tmux).arg("-L").arg(&socket).args(args).output();
        let top = format!("{} --node {b1} top --count 5", tally_cli()?.display());
        let started = tmux_cmd(&["new-session", "-d", "-s", "top", "-x", "120", "-y", "30", &top])?;
        assert!(started.status.success(), "tmux: {}", String::from_utf8_lossy(&started.stderr));
        let deadline = Instant::now() + Duration::from_secs(15);
        let mut screen = String::new();
        let mut redraws = BTreeSet::new();
        while Instant::now() < deadline {
            // Keep writing, so the rates move between screens.
            let _ = http
                .post(format!("{b1}/v1/counters/ls:a/increments"))
                .json(&json!({"delta": 1}))
                .send()
                .await;
            let out = tmux_cmd(&["capture-pane", "-p", "-t", "top"])?;
            screen = String::from_utf8_lossy(&out.stdout).into_owned();
            if screen.contains("COUNTER") && screen.contains("WRITES/S") && screen.contains("ls:a") {
                redraws.insert(screen.lines().find(|l| l.contains("ls:a")).unwrap_or("").to_string());
                if redraws.len() >= 2 {
                    break;
                }
            }
            tokio::time::sleep(Duration::from_millis(300)).await;
        }
        let _ = tmux_cmd(&["kill-server"]);
        assert!(screen.contains("tally top — node node1"), "tally top's screen:\n{screen}");
        assert!(screen.contains("COUNTER") && screen.contains("ls:a"), "tally top's screen:\n{screen}");
        assert!(redraws.len() >= 2, "tally top did not redraw with new figures:\n{screen}");
    }
    Ok(())
}
