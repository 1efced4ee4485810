//! t69: a web page against a default node (loopback, no tokens). Any page its user
//! opens can make the browser send requests to 127.0.0.1: a `no-cors` fetch posting
//! `DEL likes:1` after the HTTP headers to the RESP port, a form-like post to the
//! HTTP API, a name of the page's own resolved to 127.0.0.1 (DNS rebinding). The
//! node must close the RESP connection at the `POST` line before anything after it
//! runs (as Redis does), refuse the cross-origin writes and the unknown host on
//! HTTP, count and log each refusal, and lose nothing.
//!
//! The raw-socket half always runs; the browser half runs headless Chromium (as t80
//! does) and skips, with a message, only when `chromium` is missing and `CI` is unset.

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::path::Path;
use std::process::Command;
use std::time::Duration;
use tally_tests::{require_tool, TestCluster};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};

/// Longest one Chromium run may take, in seconds.
const CHROMIUM_TIMEOUT_S: u64 = 60;
/// Virtual time the attacking page gets to send its requests, in ms.
const PAGE_BUDGET_MS: u64 = 3000;

/// What Chromium sends for `fetch("http://127.0.0.1:PORT/", {method: "POST", mode:
/// "no-cors", body: "\r\nDEL NAME\r\n"})`, headers abridged.
fn browser_post(port: u16, name: &str) -> String {
    let body = format!("\r\nDEL {name}\r\n");
    format!(
        "POST / HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nConnection: keep-alive\r\nContent-Length: {}\r\n\
         sec-ch-ua-platform: \"Linux\"\r\nUser-Agent: Mozilla/5.0 (X11; Linux x86_64)\r\n\
         Content-Type: text/plain;charset=UTF-8\r\nAccept: */*\r\nOrigin: http://127.0.0.1:8000\r\n\
         Sec-Fetch-Site: same-site\r\nSec-Fetch-Mode: no-cors\r\n\r\n{body}",
        body.len()
    )
}

/// A counter's fresh value, or `None` when the node no longer knows it.
async fn value(c: &TestCluster, name: &str) -> Result<Option<i64>> {
    let r = reqwest::get(format!("{}/v1/counters/{name}/value?consistency=fresh", c.node(1).url())).await?;
    if r.status() == 404 {
        return Ok(None);
    }
    let v: Value = r.json().await?;
    Ok(v["value"].as_i64())
}

/// The value of a sample of `/metrics`, 0 when absent.
async fn metric(c: &TestCluster, series: &str) -> Result<u64> {
    let text = reqwest::get(format!("{}/metrics", c.node(1).url())).await?.text().await?;
    Ok(text.lines().find_map(|l| l.strip_prefix(series)?.trim().parse().ok()).unwrap_or(0))
}

/// Serves `html` to every request on a port of 127.0.0.1: the attacker's site.
async fn attacker_site(html: String) -> Result<u16> {
    let listener = TcpListener::bind("127.0.0.1:0").await?;
    let port = listener.local_addr()?.port();
    tokio::spawn(async move {
        while let Ok((mut s, _)) = listener.accept().await {
            let html = html.clone();
            tokio::spawn(async move {
                let mut head = [0u8; 4096];
                let _ = s.read(&mut head).await;
                let answer = format!(
                    "HTTP/1.1 200 OK\r\nContent-Type: text/html\r\nContent-Length: {}\r\nConnection: close\r\n\r\n{html}",
                    html.len()
                );
                let _ = s.write_all(answer.as_bytes()).await;
            });
        }
    });
    Ok(port)
}

/// The DOM of `url` after [`PAGE_BUDGET_MS`] of virtual time in headless Chromium.
fn dom(exe: &Path, profile: &Path, url: &str, extra: &[String]) -> Result<String> {
    let out = Command::new("timeout")
        .arg(CHROMIUM_TIMEOUT_S.to_string())
        .arg(exe)
        .args(["--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"])
        .arg(format!("--user-data-dir={}", profile.display()))
        .arg(format!("--virtual-time-budget={PAGE_BUDGET_MS}"))
        .args(extra)
        .arg("--dump-dom")
        .arg(url)
        .output()
        .context("running chromium")?;
    if !out.status.success() {
        bail!("chromium failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr));
    }
    Ok(String::from_utf8_lossy(&out.stdout).into_owned())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_web_page_cannot_drive_a_default_node() -> Result<()> {
    let c = TestCluster::start(1).await?;
    for name in ["likes:1", "likes:2"] {
        c.put_counter(1, name, json!({"durability": "sync"})).await?;
        c.incr(1, name, json!({"delta": 5})).await?;
    }
    let resp = c.node(1).ports.resp;
    let http = c.node(1).ports.http;
    let cross_protocol = "tally_listener_refusals_total{listener=\"resp\",reason=\"cross_protocol\"}";
    let cross_origin = "tally_listener_refusals_total{listener=\"http\",reason=\"cross_origin\"}";
    let bad_host = "tally_listener_refusals_total{listener=\"http\",reason=\"host_not_allowed\"}";

    // The bytes of the browser's request, on a raw socket: the connection is closed
    // at the POST line, unanswered, and the DEL after the headers never runs.
    let mut s = TcpStream::connect(("127.0.0.1", resp)).await?;
    s.write_all(browser_post(resp, "likes:1").as_bytes()).await?;
    let mut answer = Vec::new();
    tokio::time::timeout(Duration::from_secs(10), s.read_to_end(&mut answer))
        .await
        .context("the RESP port kept the connection of an HTTP request open")??;
    assert_eq!(
        value(&c, "likes:1").await?,
        Some(5),
        "the DEL after the headers ran; answer {:?}",
        String::from_utf8_lossy(&answer)
    );
    assert!(answer.is_empty(), "an HTTP request was answered: {:?}", String::from_utf8_lossy(&answer));
    assert_eq!(metric(&c, cross_protocol).await?, 1);
    assert!(c.log(1).contains("Possible SECURITY ATTACK detected"), "{}", c.node(1).log_tail());
    // A well-behaved client on the same port is served as before.
    let mut ok = TcpStream::connect(("127.0.0.1", resp)).await?;
    ok.write_all(b"*2\r\n$3\r\nGET\r\n$7\r\nlikes:1\r\n").await?;
    let mut reply = [0u8; 64];
    let n = tokio::time::timeout(Duration::from_secs(10), ok.read(&mut reply)).await??;
    assert_eq!(&reply[..n], b"$1\r\n5\r\n");

    // The same from a real page in a real browser.
    let Some(exe) = require_tool("chromium", "apt-get install -y chromium")? else { return Ok(()) };
    let profile = tempfile::tempdir()?;
    let page = format!(
        r#"<!doctype html><html><body><script>
        const quiet = p => p.catch(() => null);
        (async () => {{
          await quiet(fetch("http://127.0.0.1:{resp}/", {{method: "POST", mode: "no-cors", body: "\r\nDEL likes:2\r\n"}}));
          await quiet(fetch("http://127.0.0.1:{http}/v1/counters/likes:2/increments",
                            {{method: "POST", mode: "no-cors", body: '{{"delta": 1000}}'}}));
          await quiet(fetch("http://127.0.0.1:{http}/v1/cluster/nodes/node1/accept-loss", {{method: "POST", mode: "no-cors"}}));
          document.body.setAttribute("data-done", "true");
        }})();
        </script></body></html>"#
    );
    let site = attacker_site(page).await?;
    let attacked = dom(&exe, profile.path(), &format!("http://127.0.0.1:{site}/"), &[])?;
    if !attacked.contains("data-done=\"true\"") {
        bail!("the attacking page did not finish its requests:\n{attacked}");
    }
    assert_eq!(value(&c, "likes:2").await?, Some(5), "a web page changed likes:2");
    assert_eq!(metric(&c, cross_protocol).await?, 2, "the browser's POST to the RESP port was not refused");
    assert!(metric(&c, cross_origin).await? >= 2, "the page's HTTP writes were not refused as cross-origin");

    // DNS rebinding: a name of the attacker's that now resolves to 127.0.0.1.
    let rules = "--host-resolver-rules=MAP rebound.example 127.0.0.1".to_string();
    let url = format!("http://rebound.example:{http}/v1/counters/likes:2/value");
    let rebound = dom(&exe, profile.path(), &url, &[rules])?;
    if !rebound.contains("host_not_allowed") || rebound.contains("\"value\"") {
        bail!("the node answered a rebound name:\n{rebound}");
    }
    assert!(metric(&c, bad_host).await? >= 1);
    Ok(())
}
