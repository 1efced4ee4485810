//! The status page in a real browser: a 3-node cluster under load, the page at
//! `/ui` opened in headless Chromium, its member table and shard heatmap checked
//! against the cluster's JSON, then a node killed and the page checked to show it
//! down. Also checks the page fits a phone-width window.
//!
//! Skips (with a message) only when `chromium` is missing and `CI` is unset.

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::{Duration, Instant};
use tally_tests::{openapi, require_tool, TestCluster};

/// Virtual time the page gets to poll and render before its DOM is read, in ms.
const PAGE_BUDGET_MS: u64 = 4000;
/// Longest one Chromium run may take, in seconds.
const CHROMIUM_TIMEOUT_S: u64 = 60;
const COUNTER: &str = "likes:hot";
const SHARDS: usize = 16;

struct Browser {
    exe: PathBuf,
    profile: tempfile::TempDir,
}

impl Browser {
    fn args(&self, width: u32, height: u32) -> Vec<String> {
        vec![
            "--headless".into(),
            "--no-sandbox".into(),
            "--disable-gpu".into(),
            "--disable-dev-shm-usage".into(),
            "--hide-scrollbars".into(),
            format!("--user-data-dir={}", self.profile.path().display()),
            format!("--window-size={width},{height}"),
            format!("--virtual-time-budget={PAGE_BUDGET_MS}"),
        ]
    }

    fn run(&self, mut args: Vec<String>, url: &str) -> Result<String> {
        args.push(url.to_string());
        let out = Command::new("timeout")
            .arg(CHROMIUM_TIMEOUT_S.to_string())
            .arg(&self.exe)
            .args(&args)
            .output()
            .context("running chromium")?;
        if !out.status.success() {
            bail!("chromium failed ({}): {}", out.status, String::from_utf8_lossy(&out.stderr));
        }
        Ok(String::from_utf8_lossy(&out.stdout).into_owned())
    }

    /// The page's DOM after it ran for [`PAGE_BUDGET_MS`] of virtual time.
    fn dom(&self, url: &str, width: u32) -> Result<String> {
        let mut args = self.args(width, 900);
        args.push("--dump-dom".into());
        self.run(args, url)
    }

    fn screenshot(&self, url: &str, width: u32, height: u32, to: &Path) -> Result<()> {
        let mut args = self.args(width, height);
        args.push(format!("--screenshot={}", to.display()));
        self.run(args, url)?;
        if !to.exists() {
            bail!("chromium wrote no screenshot to {}", to.display());
        }
        Ok(())
    }
}

/// The value of attribute `attr` in the first element that contains `marker`.
fn attr(dom: &str, marker: &str, attr: &str) -> Option<String> {
    let at = dom.find(marker)?;
    let tag_end = at + dom[at..].find('>')?;
    let tag_start = dom[..at].rfind('<')?;
    let tag = &dom[tag_start..tag_end];
    let key = format!("{attr}=\"");
    let from = tag.find(&key)? + key.len();
    let len = tag[from..].find('"')?;
    Some(tag[from..from + len].to_string())
}

async fn get(url: &str) -> Result<Value> {
    let r = reqwest::get(url).await?;
    let status = r.status().as_u16();
    let body: Value = r.json().await?;
    if status != 200 {
        bail!("GET {url}: {status} {body}");
    }
    Ok(body)
}

fn check_members(dom: &str, cluster: &Value) -> Result<()> {
    if attr(dom, "id=\"members\"", "data-ready").as_deref() != Some("true") {
        bail!("the member table did not render:\n{dom}");
    }
    for node in cluster["nodes"].as_array().context("nodes")? {
        let id = node["id"].as_str().context("id")?;
        let state = attr(dom, &format!("data-node=\"{id}\""), "data-state");
        if state.as_deref() != node["state"].as_str() {
            bail!("the page shows {id} as {state:?}, the cluster says {}:\n{dom}", node["state"]);
        }
    }
    let leader = cluster["leader"].as_str().context("a leader")?;
    if !dom.contains(&format!("<dd id=\"leader\">{leader}</dd>")) {
        bail!("the page does not name the leader {leader}:\n{dom}");
    }
    if !dom.contains(&format!("<dd id=\"term\">{}</dd>", cluster["term"])) {
        bail!("the page does not show term {}:\n{dom}", cluster["term"]);
    }
    if !dom.contains(&format!("<dd id=\"epoch\">{}</dd>", cluster["placement_epoch"])) {
        bail!("the page does not show placement epoch {}:\n{dom}", cluster["placement_epoch"]);
    }
    Ok(())
}

fn check_heatmap(dom: &str, shards: &Value) -> Result<()> {
    if attr(dom, "id=\"heatmap\"", "data-ready").as_deref() != Some("true") {
        bail!("the heatmap did not render:\n{dom}");
    }
    if attr(dom, "id=\"heatmap\"", "data-counter").as_deref() != Some(COUNTER) {
        bail!("the heatmap shows another counter:\n{dom}");
    }
    let list = shards["shards"].as_array().context("shards")?;
    if list.len() != SHARDS || dom.matches("class=\"cell\" data-shard=").count() != SHARDS {
        bail!("the heatmap does not show {SHARDS} shards:\n{dom}");
    }
    for s in list {
        let marker =
            format!("data-shard=\"{}\" data-node=\"{}\"", s["index"], s["node"].as_str().unwrap_or(""));
        if !dom.contains(&marker) {
            bail!("the heatmap does not place shard {} on {}:\n{dom}", s["index"], s["node"]);
        }
    }
    if !dom.contains("<strong id=\"skew\">") || dom.contains("<strong id=\"skew\">–</strong>") {
        bail!("the heatmap shows no skew figure:\n{dom}");
    }
    Ok(())
}

#[tokio::test(flavor = "multi_thread", worker_threads = 4)]
async fn the_status_page_shows_the_cluster_and_a_dead_node() -> Result<()> {
    let Some(exe) = require_tool("chromium", "apt-get install -y chromium")? else { return Ok(()) };
    let browser = Browser { exe, profile: tempfile::tempdir()? };
    let cluster = TestCluster::start(3).await?;
    cluster.put_counter(1, COUNTER, json!({"shards": SHARDS})).await?;
    cluster.put_counter(1, "views:cold", json!({"shards": 4})).await?;

    // Load through node1, whose page is opened: a hot counter and a cold one.
    let stop = Arc::new(AtomicBool::new(false));
    let base = cluster.node(1).url();
    let load = tokio::spawn({
        let (stop, base) = (stop.clone(), base.clone());
        async move {
            let http = reqwest::Client::new();
            let mut i = 0u64;
            while !stop.load(Ordering::SeqCst) {
                let items: Vec<Value> = (0..50)
                    .map(|k| json!({"counter": COUNTER, "delta": 1, "writer": format!("w{}", (i + k) % 13)}))
                    .chain(std::iter::once(json!({"counter": "views:cold", "delta": 1})))
                    .collect();
                let _ = http
                    .post(format!("{base}/v1/increments"))
                    .json(&json!({"increments": items}))
                    .send()
                    .await;
                i += 1;
                tokio::time::sleep(Duration::from_millis(20)).await;
            }
        }
    });
    tokio::time::sleep(Duration::from_millis(1500)).await;

    // The endpoints the page reads answer as documented.
    let stats = get(&format!("{base}/v1/stats?limit=10")).await?;
    openapi::check("GET", "/v1/stats", 200, &stats)?;
    if stats["counters"][0]["name"] != COUNTER {
        bail!("the busiest counter through node1 should be {COUNTER}: {stats}");
    }
    let view = get(&format!("{base}/v1/cluster")).await?;
    openapi::check("GET", "/v1/cluster", 200, &view)?;

    let page = format!("{base}/ui");
    let dom = browser.dom(&page, 1200)?;
    let view = get(&format!("{base}/v1/cluster")).await?;
    let shards = get(&format!("{base}/v1/counters/{COUNTER}/shards")).await?;
    openapi::check("GET", "/v1/counters/{name}/shards", 200, &shards)?;
    check_members(&dom, &view)?;
    check_heatmap(&dom, &shards)?;
    if !dom.contains(&format!("data-counter=\"{COUNTER}\"")) || !dom.contains("data-counter=\"views:cold\"") {
        bail!("the busiest counters are not listed:\n{dom}");
    }
    if attr(&dom, "id=\"busiest\"", "data-ready").as_deref() != Some("true") {
        bail!("the busiest table did not render:\n{dom}");
    }

    // A phone-width window: everything fits (wide tables scroll inside their box).
    let narrow = browser.dom(&page, 390)?;
    check_members(&narrow, &get(&format!("{base}/v1/cluster")).await?)?;
    if attr(&narrow, "<html", "data-overflow-x").as_deref() != Some("false") {
        bail!("the page is wider than a 390-pixel window:\n{narrow}");
    }

    // Screenshots for the docs, when asked for (`TALLY_SCREENSHOTS=docs`).
    let shots = std::env::var("TALLY_SCREENSHOTS").ok().map(PathBuf::from);
    let dir = shots.clone().unwrap_or_else(|| cluster.dir().to_path_buf());
    browser.screenshot(&page, 1100, 900, &dir.join("status-page.png"))?;
    browser.screenshot(&page, 390, 1400, &dir.join("status-page-phone.png"))?;

    // Kill node3 through the fixture; node1's page must show it down.
    cluster.node(3).kill();
    let deadline = Instant::now() + Duration::from_secs(20);
    loop {
        let view = get(&format!("{base}/v1/cluster")).await?;
        let down = view["nodes"]
            .as_array()
            .into_iter()
            .flatten()
            .any(|n| n["id"] == "node3" && n["state"] == "down");
        if down {
            break;
        }
        if Instant::now() > deadline {
            bail!("node1 never saw node3 down: {view}");
        }
        tokio::time::sleep(Duration::from_millis(200)).await;
    }
    let dom = browser.dom(&page, 1200)?;
    if attr(&dom, "data-node=\"node3\"", "data-state").as_deref() != Some("down") {
        bail!("the page does not show node3 down:\n{dom}");
    }
    check_members(&dom, &get(&format!("{base}/v1/cluster")).await?)?;
    if shots.is_some() {
        browser.screenshot(&page, 1100, 900, &dir.join("status-page-node-down.png"))?;
    }
    stop.store(true, Ordering::SeqCst);
    let _ = load.await;
    Ok(())
}
