//! The operators' commands: `tally ls` (pages through `GET /v1/counters`) and
//! `tally top` (redraws `GET /v1/stats` every second, like `redis-cli --stat`).

use crate::client::{CliError, Client};
use crate::render;
use reqwest::Method;
use serde::Deserialize;
use std::io::Write;
use std::time::Duration;

/// Most names one page of `tally ls` asks for (the node's own page limit).
pub const LS_PAGE_MAX: usize = 1000;
/// Names `tally ls` prints when `--limit` is not given.
pub const LS_LIMIT_DEFAULT: usize = 1000;
/// Counters `tally top` shows when `--count` is not given.
pub const TOP_COUNTERS_DEFAULT: usize = 20;
/// Most counters `tally top` can show (the node's own `GET /v1/stats` limit).
pub const TOP_COUNTERS_MAX: usize = 100;
/// Time between two screens of `tally top`, in milliseconds.
pub const TOP_REFRESH_MS: u64 = 1000;

/// One page of `GET /v1/counters`.
#[derive(Debug, Deserialize)]
pub struct CounterPage {
    /// Names in byte order.
    pub counters: Vec<String>,
    /// The cursor of the next page.
    pub next: Option<String>,
}

/// One counter of `GET /v1/stats`.
#[derive(Debug, Deserialize)]
pub struct CounterStats {
    /// Its name.
    pub name: String,
    /// Increments per second through the node.
    pub write_rate: f64,
    /// Hottest shard ÷ mean.
    pub skew: f64,
    /// The cached total.
    pub value: Option<serde_json::Number>,
    /// How old that total was.
    pub staleness_ms: Option<u64>,
    /// Last measured drift.
    pub drift: Option<serde_json::Number>,
}

/// A latency summary of `GET /v1/stats`.
#[derive(Debug, Deserialize)]
pub struct Latency {
    /// Median, µs.
    pub p50_us: u64,
    /// 99th percentile, µs.
    pub p99_us: u64,
}

/// Read latency by consistency.
#[derive(Debug, Deserialize)]
pub struct Reads {
    /// Cached reads.
    pub cached: Latency,
    /// Fresh reads.
    pub fresh: Latency,
}

/// The answer of `GET /v1/stats`.
#[derive(Debug, Deserialize)]
pub struct StatsView {
    /// The node answering.
    pub node: String,
    /// Increments per second through the node.
    pub increment_rate: f64,
    /// The busiest counters.
    pub counters: Vec<CounterStats>,
    /// Read latency.
    pub reads: Reads,
}

/// `tally ls`: the names, one per line (with `--json`, one page object per page).
pub async fn ls(
    client: &Client,
    prefix: Option<&str>,
    limit: usize,
    json: bool,
    out: &mut impl Write,
) -> Result<(), CliError> {
    let mut cursor: Option<String> = None;
    let mut left = limit;
    while left > 0 {
        let mut url = client.url(&["v1", "counters"]);
        {
            let mut q = url.query_pairs_mut();
            if let Some(p) = prefix {
                q.append_pair("prefix", p);
            }
            q.append_pair("limit", &left.min(LS_PAGE_MAX).to_string());
            if let Some(c) = &cursor {
                q.append_pair("cursor", c);
            }
        }
        let answer = client.call::<()>(Method::GET, url, None).await?;
        let page: CounterPage = answer.parse()?;
        let text = if json {
            format!("{}\n", answer.text.trim())
        } else {
            page.counters.iter().map(|n| format!("{n}\n")).collect()
        };
        // A closed pipe (`tally ls | head`) ends the listing quietly.
        if out.write_all(text.as_bytes()).and_then(|()| out.flush()).is_err() {
            return Ok(());
        }
        left = left.saturating_sub(page.counters.len());
        match page.next {
            Some(next) if !page.counters.is_empty() => cursor = Some(next),
            _ => break,
        }
    }
    Ok(())
}

fn fmt_us(us: u64) -> String {
    if us >= 1000 {
        format!("{:.1}ms", us as f64 / 1000.0)
    } else {
        format!("{us}µs")
    }
}

fn number(n: &Option<serde_json::Number>) -> String {
    n.as_ref().map_or_else(|| "-".to_string(), |n| n.to_string())
}

/// One screen of `tally top`.
pub fn screen(s: &StatsView) -> String {
    let mut text = format!(
        "tally top — node {}   increments/s {:.1}   read p50/p99 cached {}/{} fresh {}/{}\n\n",
        s.node,
        s.increment_rate,
        fmt_us(s.reads.cached.p50_us),
        fmt_us(s.reads.cached.p99_us),
        fmt_us(s.reads.fresh.p50_us),
        fmt_us(s.reads.fresh.p99_us),
    );
    let rows: Vec<Vec<String>> = s
        .counters
        .iter()
        .map(|c| {
            vec![
                c.name.clone(),
                format!("{:.1}", c.write_rate),
                number(&c.value),
                format!("{:.2}", c.skew),
                c.staleness_ms.map_or_else(|| "-".to_string(), |ms| format!("{ms}ms")),
                number(&c.drift),
            ]
        })
        .collect();
    if rows.is_empty() {
        text.push_str("no writes through this node yet\n");
    } else {
        text.push_str(&render::table(&["COUNTER", "WRITES/S", "VALUE", "SKEW", "STALENESS", "DRIFT"], &rows));
    }
    text
}

/// `tally top`: redraws the busiest counters every second until interrupted, or
/// `iterations` times. A failed poll is shown on the screen and retried.
pub async fn top(
    client: &Client,
    count: usize,
    iterations: Option<u64>,
    out: &mut impl Write,
) -> Result<(), CliError> {
    let mut url = client.url(&["v1", "stats"]);
    url.query_pairs_mut().append_pair("limit", &count.to_string());
    let mut n = 0u64;
    loop {
        let body = match client.call::<()>(Method::GET, url.clone(), None).await {
            Ok(answer) => match answer.parse::<StatsView>() {
                Ok(s) => screen(&s),
                Err(e) => format!("error: {e}\n"),
            },
            // Wrong arguments do not get better by asking again.
            Err(e @ CliError::Api { status: 400, .. }) => return Err(e),
            Err(e) => format!("error: {e} (retrying)\n"),
        };
        // Clear the screen and home the cursor, then draw.
        if out.write_all(format!("\x1b[2J\x1b[H{body}").as_bytes()).and_then(|()| out.flush()).is_err() {
            return Ok(());
        }
        n += 1;
        if iterations.is_some_and(|max| n >= max) {
            return Ok(());
        }
        tokio::time::sleep(Duration::from_millis(TOP_REFRESH_MS)).await;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_screen_lists_counters_in_a_table() {
        let s: StatsView = serde_json::from_value(serde_json::json!({
            "node": "node1", "increment_rate": 12.0,
            "counters": [{"name": "likes:1", "write_rate": 10.5, "skew": 1.25, "value": 42,
                          "staleness_ms": 7, "drift": null}],
            "reads": {"cached": {"p50_us": 12, "p99_us": 2047}, "fresh": {"p50_us": 0, "p99_us": 0}}
        }))
        .unwrap();
        let text = screen(&s);
        assert!(text.contains("node node1"), "{text}");
        assert!(text.contains("COUNTER"), "{text}");
        assert!(text.contains("likes:1") && text.contains("10.5") && text.contains("42"), "{text}");
        assert!(text.contains("2.0ms"), "{text}");
    }
}
