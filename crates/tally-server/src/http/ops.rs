//! What operators read: the listing of counters (`GET /v1/counters`), a summary of
//! the busiest counters and read latency (`GET /v1/stats`), the status page (`/ui`)
//! and the OpenAPI document (`GET /v1/openapi.json`).
//!
//! The status page and `tally top` read only these public JSON endpoints; nothing
//! here parses `/metrics`. The page's HTML, CSS and JavaScript are embedded in the
//! binary (no build step, no CDN), so a node serves it with nothing else installed.

use crate::auth::Principal;
use crate::http::error::{codes, ApiError};
use crate::service::Service;
use axum::extract::rejection::QueryRejection;
use axum::extract::Query;
use axum::http::{header, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use std::collections::HashMap;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};
use tally_engine::{Consistency, CounterPage, HistogramSnapshot, Tally};

/// Counters listed per page when the request names no `limit`.
pub const LIST_LIMIT_DEFAULT: usize = 100;
/// Counters `GET /v1/stats` answers with when the request names no `limit`.
pub const STATS_COUNTERS_DEFAULT: usize = 10;
/// Most counters `GET /v1/stats` answers with: each costs one cached read.
pub const STATS_COUNTERS_MAX: usize = 100;
/// Most active counters one stats request ranks by write rate.
pub const STATS_SCAN_COUNTERS_MAX: usize = 10_000;
/// The shortest interval write rates are measured over, in milliseconds: a request
/// sooner than this after the last sample compares with the sample before it.
pub const RATE_SAMPLE_MS: u64 = 1000;
/// How long one counter's cached read may take in a stats request, in milliseconds.
pub const STATS_READ_TIMEOUT_MS: u64 = 2000;

/// The OpenAPI 3.1 document of the public interface, served at `/v1/openapi.json`.
pub const OPENAPI_JSON: &str = include_str!("../../openapi.json");
const UI_HTML: &str = include_str!("../ui/index.html");
const UI_JS: &str = include_str!("../ui/app.js");
const UI_CSS: &str = include_str!("../ui/app.css");
/// Scripts and styles come from the node itself: nothing inline, nothing remote.
const UI_CSP: &str = "default-src 'self'; img-src 'self' data:; frame-ancestors 'none'";

/// The query of `GET /v1/counters`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ListQuery {
    /// Only names starting with this (default: every counter).
    pub prefix: Option<String>,
    /// Names per page, 1 to [`tally_engine::LIST_PAGE_COUNTERS_MAX`] (default [`LIST_LIMIT_DEFAULT`]).
    pub limit: Option<usize>,
    /// The `next` of the previous page.
    pub cursor: Option<String>,
}

fn bad_query(e: QueryRejection) -> ApiError {
    ApiError::new(StatusCode::BAD_REQUEST, codes::INVALID_QUERY, e.body_text())
}

/// `GET /v1/counters?prefix=P&limit=N&cursor=C`: one page of counter names in byte
/// order with the cursor of the next (`null` on the last page). A caller limited to
/// counter prefixes sees only the names within them.
pub async fn list<S: Service>(
    svc: &S,
    caller: &Principal,
    query: Result<Query<ListQuery>, QueryRejection>,
) -> Result<Json<CounterPage>, ApiError> {
    let Query(q) = query.map_err(bad_query)?;
    let limit = q.limit.unwrap_or(LIST_LIMIT_DEFAULT);
    // Names are listed by their escaped form (`tally_core::name`), which keeps
    // prefixes; the page shows each name itself (escaped if it is not UTF-8) and
    // keeps the cursor escaped, as `cursor` takes it back.
    let requested = tally_core::name::escape(q.prefix.as_deref().unwrap_or("").as_bytes());
    let tally = svc.engine();
    let page = match caller.narrow(&requested) {
        None => tally.list_counters(&requested, q.cursor.as_deref(), limit)?,
        Some(prefixes) => {
            // Check the request as the engine would, even when nothing is left to list.
            tally.list_counters(&requested, q.cursor.as_deref(), limit)?;
            list_within(tally, &prefixes, q.cursor.as_deref(), limit)?
        }
    };
    let counters = page.counters.iter().map(|n| tally_core::name::shown(n)).collect();
    Ok(Json(CounterPage { counters, next: page.next }))
}

/// One page of the names under `prefixes` (in byte order, none a prefix of
/// another, so their names are disjoint ranges in that order) after `cursor`.
pub(crate) fn list_within(
    tally: &Tally,
    prefixes: &[String],
    cursor: Option<&str>,
    limit: usize,
) -> Result<CounterPage, tally_engine::TallyError> {
    let mut counters: Vec<String> = Vec::new();
    let mut more = false;
    for prefix in prefixes {
        // Every name under a prefix that sorts before the cursor without being under
        // it sorts before the cursor too: skip it.
        if cursor.is_some_and(|c| c > prefix.as_str() && !c.starts_with(prefix.as_str())) {
            continue;
        }
        let after = cursor.filter(|c| c.starts_with(prefix.as_str()));
        if counters.len() == limit {
            // The page is full: one name under a later prefix means another page.
            more = !tally.list_counters(prefix, after, 1)?.counters.is_empty();
            if more {
                break;
            }
            continue;
        }
        let page = tally.list_counters(prefix, after, limit - counters.len())?;
        counters.extend(page.counters);
        if page.next.is_some() {
            more = true;
            break;
        }
    }
    let next = if more { counters.last().cloned() } else { None };
    Ok(CounterPage { counters, next })
}

/// The query of `GET /v1/stats`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct StatsQuery {
    /// Counters to answer with, 1 to [`STATS_COUNTERS_MAX`].
    pub limit: Option<usize>,
}

/// One busy counter in a [`StatsView`].
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct CounterStats {
    /// Its name.
    pub name: String,
    /// Increments routed on this node since the counter became active here.
    pub writes: u64,
    /// Increments per second routed on this node over the last sample interval.
    pub write_rate: f64,
    /// Hottest shard's writes ÷ mean (1.0 = even), from this node's writes.
    pub skew: f64,
    /// The cached total, if the read answered.
    pub value: Option<i128>,
    /// How old that total was.
    pub staleness_ms: Option<u64>,
    /// Whether every shard answered that read.
    pub complete: Option<bool>,
    /// The last drift measured by a reconciliation on this node, if any.
    pub drift: Option<i128>,
    /// Why the read failed, if it did.
    pub error: Option<String>,
}

/// A latency distribution in microseconds (upper bounds of power-of-two buckets).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct LatencySummary {
    /// Reads measured since the node started.
    pub count: u64,
    /// Their mean.
    pub mean_us: f64,
    /// Half of them took at most this long.
    pub p50_us: u64,
    /// 99 % of them took at most this long.
    pub p99_us: u64,
}

/// Read latency inside the engine, by consistency.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ReadLatency {
    /// Cached reads.
    pub cached: LatencySummary,
    /// Fresh reads.
    pub fresh: LatencySummary,
}

/// The answer of `GET /v1/stats`: this node's busiest counters and read latency.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct StatsView {
    /// The node answering: every figure is as this node sees it.
    pub node: String,
    /// When the figures were taken, in milliseconds since the Unix epoch.
    pub as_of_ms: u64,
    /// The interval the rates were measured over (0 on the first sample).
    pub rate_window_ms: u64,
    /// Increments acknowledged by this node since it started.
    pub increments: u64,
    /// Increments per second acknowledged by this node over that interval.
    pub increment_rate: f64,
    /// The busiest counters, by write rate then writes.
    pub counters: Vec<CounterStats>,
    /// Read latency inside the engine.
    pub reads: ReadLatency,
}

/// One sample of per-counter writes, for rates.
struct Sample {
    at: Instant,
    increments: u64,
    writes: HashMap<String, u64>,
}

/// The samples write rates are measured between. Several pollers share it: a rate
/// always spans at least [`RATE_SAMPLE_MS`] once two samples exist.
#[derive(Default)]
pub struct RateBook {
    samples: std::sync::Mutex<(Option<Sample>, Option<Sample>)>,
}

impl RateBook {
    /// Records `now` and answers (window, the sample rates are measured against).
    fn observe(&self, now: Sample) -> (Duration, u64, HashMap<String, u64>) {
        let mut guard = self.samples.lock().unwrap_or_else(|p| p.into_inner());
        let (prev, curr) = &mut *guard;
        let rotate = curr.as_ref().is_none_or(|c| c.at.elapsed() >= Duration::from_millis(RATE_SAMPLE_MS));
        let (at, increments, writes) = (now.at, now.increments, now.writes.clone());
        if rotate {
            *prev = curr.take();
            *curr = Some(now);
        }
        match prev.as_ref() {
            Some(base) => (at.saturating_duration_since(base.at), base.increments, base.writes.clone()),
            None => (Duration::ZERO, increments, writes),
        }
    }
}

fn per_second(now: u64, then: u64, window: Duration) -> f64 {
    if window.is_zero() {
        return 0.0;
    }
    now.saturating_sub(then) as f64 / window.as_secs_f64()
}

fn quantile(snap: &HistogramSnapshot, q: f64) -> u64 {
    if snap.count == 0 {
        return 0;
    }
    let want = (snap.count as f64 * q).ceil() as u64;
    snap.buckets.iter().find(|(_, acc)| *acc >= want).map_or(u64::MAX, |(bound, _)| bound.saturating_sub(1))
}

fn latency(snap: HistogramSnapshot) -> LatencySummary {
    LatencySummary {
        count: snap.count,
        mean_us: if snap.count == 0 { 0.0 } else { snap.sum as f64 / snap.count as f64 },
        p50_us: quantile(&snap, 0.5),
        p99_us: quantile(&snap, 0.99),
    }
}

/// `GET /v1/stats?limit=N`: the busiest counters on this node with their write rate,
/// cached value, staleness, skew and last drift, and the engine's read latency.
/// A caller limited to counter prefixes sees only the counters within them.
pub async fn stats<S: Service>(
    svc: &S,
    rates: &RateBook,
    caller: &Principal,
    query: Result<Query<StatsQuery>, QueryRejection>,
) -> Result<Json<StatsView>, ApiError> {
    let Query(q) = query.map_err(bad_query)?;
    let limit = q.limit.unwrap_or(STATS_COUNTERS_DEFAULT);
    if limit == 0 || limit > STATS_COUNTERS_MAX {
        return Err(ApiError::new(
            StatusCode::BAD_REQUEST,
            codes::INVALID_QUERY,
            format!("limit must be between 1 and {STATS_COUNTERS_MAX} (got {limit})"),
        ));
    }
    let tally: &Tally = svc.engine();
    let s = tally.stats();
    let increments = s.increments_batched.get() + s.increments_sync.get();
    let mut active = tally.write_skews(STATS_SCAN_COUNTERS_MAX);
    active.retain(|(name, _, _)| caller.sees(name.as_str()));
    let writes: HashMap<String, u64> = active.iter().map(|(n, _, w)| (n.as_str().to_string(), *w)).collect();
    let (window, base_increments, base) = rates.observe(Sample { at: Instant::now(), increments, writes });
    let mut ranked: Vec<(String, f64, f64, u64)> = active
        .into_iter()
        .map(|(name, skew, w)| {
            let rate = per_second(w, base.get(name.as_str()).copied().unwrap_or(0), window);
            (name.as_str().to_string(), rate, skew, w)
        })
        .collect();
    ranked.sort_by(|a, b| b.1.total_cmp(&a.1).then(b.3.cmp(&a.3)).then_with(|| a.0.cmp(&b.0)));
    ranked.truncate(limit);
    let reads = ranked.iter().map(|(name, ..)| async move {
        let read = tokio::time::timeout(
            Duration::from_millis(STATS_READ_TIMEOUT_MS),
            tally.read(name, Consistency::Cached),
        )
        .await;
        match read {
            Ok(Ok(r)) => Ok(r),
            Ok(Err(e)) => Err(e.to_string()),
            Err(_) => Err(format!("the cached read took longer than {STATS_READ_TIMEOUT_MS} ms")),
        }
    });
    let reads = futures::future::join_all(reads).await;
    let counters = ranked
        .into_iter()
        .zip(reads)
        .map(|((name, write_rate, skew, writes), read)| {
            let drift = s.drifts.get(&name).map(|(d, _)| d);
            let (value, staleness_ms, complete, error) = match read {
                Ok(r) => (Some(r.value), Some(r.staleness_ms), Some(r.complete), None),
                Err(e) => (None, None, None, Some(e)),
            };
            let name = tally_core::name::shown(&name);
            CounterStats { name, writes, write_rate, skew, value, staleness_ms, complete, drift, error }
        })
        .collect();
    let as_of_ms = SystemTime::now().duration_since(UNIX_EPOCH).map_or(0, |d| d.as_millis() as u64);
    Ok(Json(StatsView {
        node: svc.node_id().to_string(),
        as_of_ms,
        rate_window_ms: window.as_millis() as u64,
        increments,
        increment_rate: per_second(increments, base_increments, window),
        counters,
        reads: ReadLatency {
            cached: latency(s.read_cached_us.snapshot()),
            fresh: latency(s.read_fresh_us.snapshot()),
        },
    }))
}

fn asset(content_type: &'static str, body: &'static str) -> Response {
    (
        [
            (header::CONTENT_TYPE, content_type),
            (header::CACHE_CONTROL, "no-cache"),
            (header::CONTENT_SECURITY_POLICY, UI_CSP),
            (header::X_CONTENT_TYPE_OPTIONS, "nosniff"),
        ],
        body,
    )
        .into_response()
}

/// `GET /ui`: the status page.
pub async fn ui_page() -> Response {
    asset("text/html; charset=utf-8", UI_HTML)
}

/// `GET /ui/app.js`: the status page's script.
pub async fn ui_script() -> Response {
    asset("text/javascript; charset=utf-8", UI_JS)
}

/// `GET /ui/app.css`: the status page's styles.
pub async fn ui_styles() -> Response {
    asset("text/css; charset=utf-8", UI_CSS)
}

/// `GET /v1/openapi.json`: the OpenAPI 3.1 document of this interface.
pub async fn openapi() -> Response {
    ([(header::CONTENT_TYPE, "application/json")], OPENAPI_JSON).into_response()
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_openapi_document_is_json() {
        let v: serde_json::Value = serde_json::from_str(OPENAPI_JSON).expect("valid JSON");
        assert_eq!(v["openapi"], "3.1.0");
    }

    #[test]
    fn quantiles_are_bucket_bounds() {
        let h = tally_engine::Histogram::default();
        for v in [1, 2, 3, 100] {
            h.record(v);
        }
        let s = latency(h.snapshot());
        assert_eq!(s.count, 4);
        assert_eq!(s.p50_us, 3);
        assert_eq!(s.p99_us, 127);
    }

    #[test]
    fn rates_span_the_previous_sample() {
        let book = RateBook::default();
        let t0 = Instant::now();
        let sample = |at, n| Sample { at, increments: n, writes: HashMap::from([("a".to_string(), n)]) };
        let (w, _, _) = book.observe(sample(t0, 0));
        assert!(w.is_zero());
        // A second sample within the interval compares with nothing older yet.
        let (w, _, _) = book.observe(sample(t0, 5));
        assert!(w.is_zero());
    }
}
