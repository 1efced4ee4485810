//! Shared fixtures for the server's tests: a node over the in-memory store, a
//! router driver that needs no sockets, a tiny raw HTTP/1.1 client (so the tests can
//! also misbehave on purpose: slow headers, partial bodies), and a checker for the
//! Prometheus text format.
#![allow(dead_code)]

use axum::body::Body;
use axum::http::{HeaderMap, Request, StatusCode};
use axum::Router;
use serde_json::Value;
use std::collections::{BTreeMap, BTreeSet};
use std::net::SocketAddr;
use std::sync::Arc;
use std::time::Duration;
use tally_engine::{
    Consistency, IncrOutcome, Increment, MemStore, SystemClock, Tally, TallyConfig, TallyError, ValueRead,
};
use tally_server::http::error::ApiError;
use tally_server::{ClusterView, HttpConfig, NodeEntry, Service, SingleNode};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;
use tower::ServiceExt;

/// The cluster entry of the test node.
pub fn node_entry(http: SocketAddr) -> NodeEntry {
    NodeEntry {
        id: "node1".into(),
        raft_id: 1,
        http,
        peer: "127.0.0.1:7170".parse().expect("addr"),
        raft: "127.0.0.1:7270".parse().expect("addr"),
        resp: None,
        member: true,
    }
}

/// A single node over the in-memory store, with the batch limit of `limits`.
pub async fn mem_node(limits: &HttpConfig) -> SingleNode {
    let config = TallyConfig {
        node_id: tally_core::NodeId::new("node1"),
        batch_items_max: limits.batch_limit_items(),
        ..TallyConfig::default()
    };
    let tally = Tally::open_with(Arc::new(MemStore::new()), Arc::new(SystemClock), config)
        .await
        .expect("engine opens");
    SingleNode::new(tally, node_entry("127.0.0.1:7070".parse().expect("addr")))
}

/// An answer, read whole.
#[derive(Debug)]
pub struct Answer {
    /// The status.
    pub status: StatusCode,
    /// The headers.
    pub headers: HeaderMap,
    /// The body as text.
    pub text: String,
}

impl Answer {
    /// The body as JSON (`Value::Null` if it is not JSON).
    pub fn json(&self) -> Value {
        serde_json::from_str(&self.text).unwrap_or(Value::Null)
    }

    /// Asserts the error shape `{"error": {"code", "message"}}` with this status and code.
    #[track_caller]
    pub fn assert_error(&self, status: u16, code: &str) {
        let json = self.json();
        assert_eq!(self.status.as_u16(), status, "status of {json}");
        assert_eq!(json["error"]["code"], code, "code of {json}");
        let message = json["error"]["message"].as_str().unwrap_or("");
        assert!(!message.is_empty(), "an error without a message: {json}");
        assert_eq!(json.as_object().map(|o| o.len()), Some(1), "extra top-level fields: {json}");
        let ct = self.headers.get("content-type").and_then(|v| v.to_str().ok()).unwrap_or("");
        assert!(ct.starts_with("application/json"), "content-type {ct:?}");
    }
}

/// Drives `app` with one request, without sockets.
pub async fn send(app: &Router, req: Request<Body>) -> Answer {
    let response = app.clone().oneshot(req).await.expect("the router is infallible");
    let status = response.status();
    let headers = response.headers().clone();
    let bytes = axum::body::to_bytes(response.into_body(), usize::MAX).await.expect("body");
    Answer { status, headers, text: String::from_utf8_lossy(&bytes).into_owned() }
}

/// A request with a JSON body (`None`: no body, no content type).
pub fn request(method: &str, uri: &str, json: Option<&str>) -> Request<Body> {
    let b = Request::builder().method(method).uri(uri);
    match json {
        Some(text) => b.header("content-type", "application/json").body(Body::from(text.to_string())),
        None => b.body(Body::empty()),
    }
    .expect("request")
}

/// Sends `method uri` with an optional JSON body.
pub async fn call(app: &Router, method: &str, uri: &str, json: Option<&str>) -> Answer {
    send(app, request(method, uri, json)).await
}

/// A raw HTTP/1.1 exchange over TCP with `Connection: close`; `None` if the server
/// closed the connection without answering.
pub async fn raw_http(addr: SocketAddr, method: &str, path: &str, json: Option<&str>) -> Option<Answer> {
    let mut stream = TcpStream::connect(addr).await.ok()?;
    let body = json.unwrap_or("");
    let mut head = format!("{method} {path} HTTP/1.1\r\nHost: {addr}\r\nConnection: close\r\n");
    if json.is_some() {
        head.push_str(&format!("Content-Type: application/json\r\nContent-Length: {}\r\n", body.len()));
    }
    head.push_str("\r\n");
    stream.write_all(head.as_bytes()).await.ok()?;
    stream.write_all(body.as_bytes()).await.ok()?;
    read_answer(&mut stream).await
}

/// Reads one whole answer from a connection the server will close after it.
pub async fn read_answer(stream: &mut TcpStream) -> Option<Answer> {
    let mut buf = Vec::new();
    stream.read_to_end(&mut buf).await.ok()?;
    parse_answer(&buf)
}

/// Parses a raw HTTP/1.1 response with a `Content-Length` body.
pub fn parse_answer(buf: &[u8]) -> Option<Answer> {
    let text = String::from_utf8_lossy(buf).into_owned();
    let (head, body) = text.split_once("\r\n\r\n")?;
    let mut lines = head.lines();
    let status_line = lines.next()?;
    let code: u16 = status_line.split(' ').nth(1)?.parse().ok()?;
    let mut headers = HeaderMap::new();
    for line in lines {
        let (k, v) = line.split_once(':')?;
        headers.append(axum::http::HeaderName::from_bytes(k.trim().as_bytes()).ok()?, v.trim().parse().ok()?);
    }
    Some(Answer { status: StatusCode::from_u16(code).ok()?, headers, text: body.to_string() })
}

/// Polls `GET /healthz` until it answers 200, for at most `wait`.
pub async fn wait_healthy(addr: SocketAddr, wait: Duration) -> bool {
    let deadline = tokio::time::Instant::now() + wait;
    while tokio::time::Instant::now() < deadline {
        if let Some(a) = raw_http(addr, "GET", "/healthz", None).await {
            if a.status == StatusCode::OK {
                return true;
            }
        }
        tokio::time::sleep(Duration::from_millis(50)).await;
    }
    false
}

/// A free port on 127.0.0.1 (bound, read, released).
pub fn free_port() -> u16 {
    let l = std::net::TcpListener::bind("127.0.0.1:0").expect("bind port 0");
    l.local_addr().expect("local addr").port()
}

/// Checks Prometheus text exposition: HELP and TYPE before every family's samples,
/// one TYPE per family, well-formed sample lines and values, and histograms whose
/// buckets are cumulative and end with `+Inf` equal to `_count`. Returns the samples
/// as `name{labels}` → value.
pub fn check_prometheus(text: &str) -> BTreeMap<String, f64> {
    let mut typed: BTreeMap<String, String> = BTreeMap::new();
    let mut helped: BTreeSet<String> = BTreeSet::new();
    let mut samples = BTreeMap::new();
    let mut last_bucket: BTreeMap<String, f64> = BTreeMap::new();
    for line in text.lines() {
        assert!(!line.trim().is_empty(), "blank line in exposition");
        if let Some(rest) = line.strip_prefix("# HELP ") {
            let name = rest.split(' ').next().expect("name");
            assert!(helped.insert(name.to_string()), "second HELP for {name}");
            continue;
        }
        if let Some(rest) = line.strip_prefix("# TYPE ") {
            let mut parts = rest.split(' ');
            let (name, kind) = (parts.next().expect("name"), parts.next().expect("kind"));
            assert!(["counter", "gauge", "histogram", "summary", "untyped"].contains(&kind), "{line}");
            assert!(helped.contains(name), "TYPE before HELP for {name}");
            assert!(typed.insert(name.to_string(), kind.to_string()).is_none(), "second TYPE for {name}");
            continue;
        }
        assert!(!line.starts_with('#'), "unknown comment {line}");
        let (series, value) = line.rsplit_once(' ').expect("sample has a value");
        let value: f64 = match value {
            "+Inf" => f64::INFINITY,
            "-Inf" => f64::NEG_INFINITY,
            v => v.parse().unwrap_or_else(|_| panic!("bad value in {line}")),
        };
        let name = series.split('{').next().expect("name");
        assert!(
            name.chars().all(|c| c.is_ascii_alphanumeric() || c == '_' || c == ':') && !name.is_empty(),
            "bad metric name {name}"
        );
        if let Some(labels) = series.strip_prefix(name) {
            if !labels.is_empty() {
                assert!(labels.starts_with('{') && labels.ends_with('}'), "bad labels {labels}");
            }
        }
        let family = ["_bucket", "_sum", "_count"]
            .iter()
            .find_map(|s| name.strip_suffix(s).filter(|f| typed.get(*f).is_some_and(|k| k == "histogram")))
            .unwrap_or(name);
        assert!(typed.contains_key(family), "sample {name} before its TYPE");
        if name.ends_with("_bucket") {
            let at = series.find("le=\"").unwrap_or_else(|| panic!("bucket without le: {line}"));
            let key = series[..at].to_string();
            let prev = last_bucket.insert(key, value).unwrap_or(0.0);
            assert!(value >= prev, "buckets not cumulative at {line}");
        }
        samples.insert(series.to_string(), value);
    }
    for (name, kind) in &typed {
        if kind != "histogram" {
            continue;
        }
        for (series, count) in samples.iter().filter(|(s, _)| s.starts_with(&format!("{name}_count"))) {
            let labels = series.strip_prefix(&format!("{name}_count")).unwrap_or("");
            let inf = if labels.is_empty() {
                format!("{name}_bucket{{le=\"+Inf\"}}")
            } else {
                format!("{name}_bucket{},le=\"+Inf\"}}", labels.trim_end_matches('}'))
            };
            assert_eq!(samples.get(&inf), Some(count), "{inf} must equal {series}");
        }
    }
    samples
}

/// A service that delegates to a single node but is slow to count and panics on
/// reads of one counter: the guard must turn both into JSON answers.
#[derive(Clone)]
pub struct Faulty {
    /// The node it delegates to.
    pub inner: SingleNode,
    /// How long each single increment waits before counting.
    pub incr_delay: Duration,
}

impl Service for Faulty {
    async fn incr(&self, name: &str, inc: Increment) -> Result<IncrOutcome, TallyError> {
        tokio::time::sleep(self.incr_delay).await;
        self.inner.incr(name, inc).await
    }
    async fn read(&self, name: &str, consistency: Consistency) -> Result<ValueRead, TallyError> {
        if name == "boom" {
            panic!("read of boom");
        }
        self.inner.read(name, consistency).await
    }
    async fn cluster(&self) -> ClusterView {
        self.inner.cluster().await
    }
    async fn change_membership(&self, id: &str, add: bool) -> Result<ClusterView, ApiError> {
        self.inner.change_membership(id, add).await
    }
    async fn accept_loss(&self, id: &str) -> Result<ClusterView, ApiError> {
        self.inner.accept_loss(id).await
    }
    fn engine(&self) -> &tally_engine::Tally {
        self.inner.tally()
    }
    fn node_id(&self) -> &str {
        self.inner.node_id()
    }
    fn runs(&self) -> &tally_server::sources::RunBook {
        self.inner.runs()
    }
    fn metrics_text(&self) -> String {
        self.inner.metrics_text()
    }
}
