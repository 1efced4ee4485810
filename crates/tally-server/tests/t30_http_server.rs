//! t30: the serving loop over real sockets. Clients that misbehave — trickling
//! headers, stalling mid-body, holding idle connections — are cut off by the
//! configured timeouts while everyone else keeps being served; the connection
//! limit holds; and a graceful shutdown finishes the requests in flight, closes
//! idle connections, and returns.

mod common;

use common::*;
use std::net::SocketAddr;
use std::time::{Duration, Instant};
use tally_server::{router, serve, HttpConfig, Service};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::sync::oneshot;
use tokio::task::JoinHandle;

/// A server on 127.0.0.1:0 and the handle that stops it.
struct Running {
    addr: SocketAddr,
    stop: Option<oneshot::Sender<()>>,
    task: JoinHandle<std::io::Result<()>>,
}

async fn start<S: Service>(svc: S, limits: HttpConfig) -> Running {
    let listener = TcpListener::bind("127.0.0.1:0").await.expect("bind");
    let addr = listener.local_addr().expect("addr");
    let (tx, rx) = oneshot::channel::<()>();
    let app = router(svc, &limits);
    let task = tokio::spawn(async move {
        serve(listener, app, &limits, async {
            let _ = rx.await;
        })
        .await
    });
    Running { addr, stop: Some(tx), task }
}

impl Running {
    async fn stop(mut self) -> Duration {
        let started = Instant::now();
        if let Some(tx) = self.stop.take() {
            let _ = tx.send(());
        }
        self.task.await.expect("serve task").expect("serve result");
        started.elapsed()
    }
}

/// Reads until the server closes the connection; returns how long that took and
/// what it sent.
async fn until_closed(stream: &mut TcpStream, limit: Duration) -> (Duration, Vec<u8>) {
    let started = Instant::now();
    let mut got = Vec::new();
    let mut buf = [0u8; 1024];
    loop {
        match tokio::time::timeout(limit.saturating_sub(started.elapsed()), stream.read(&mut buf)).await {
            Ok(Ok(0)) | Ok(Err(_)) => return (started.elapsed(), got),
            Ok(Ok(n)) => got.extend_from_slice(&buf[..n]),
            Err(_) => panic!("the server kept the connection open for {limit:?}"),
        }
    }
}

fn quick_limits() -> HttpConfig {
    HttpConfig { header_read_timeout_ms: 300, request_timeout_ms: 600, ..HttpConfig::default() }
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn slow_headers_and_idle_connections_are_cut_off_while_others_are_served() {
    let limits = quick_limits();
    let node = mem_node(&limits).await;
    let server = start(node.clone(), limits).await;

    // A slowloris: a request line, then one header byte every 50 ms, forever.
    let mut slow = TcpStream::connect(server.addr).await.expect("connect");
    slow.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n").await.expect("write");
    let (mut slow_read, mut slow_write) = slow.into_split();
    let dripper = tokio::spawn(async move {
        for _ in 0..200 {
            if slow_write.write_all(b"X").await.is_err() {
                return;
            }
            tokio::time::sleep(Duration::from_millis(50)).await;
        }
    });
    // A client that connects and never says anything.
    let mut idle = TcpStream::connect(server.addr).await.expect("connect");

    // Meanwhile, ordinary clients are served.
    for i in 0..5 {
        let body = format!(r#"{{"delta": 1, "event_id": "e{i}"}}"#);
        let a =
            raw_http(server.addr, "POST", "/v1/counters/c/increments", Some(&body)).await.expect("answer");
        assert_eq!(a.status, 200, "{}", a.text);
    }

    let started = Instant::now();
    let mut got = Vec::new();
    let closed = tokio::time::timeout(Duration::from_secs(5), slow_read.read_to_end(&mut got)).await;
    assert!(closed.is_ok(), "the slowloris connection is still open after 5 s");
    assert!(!String::from_utf8_lossy(&got).contains("200 OK"), "the slow request was served");
    let (idle_after, _) = until_closed(&mut idle, Duration::from_secs(5)).await;
    eprintln!(
        "t30: slowloris cut {:?} after the last answer; idle cut after {idle_after:?}",
        started.elapsed()
    );
    dripper.abort();

    let a =
        raw_http(server.addr, "GET", "/v1/counters/c/value?consistency=fresh", None).await.expect("answer");
    assert_eq!(a.json()["value"], 5);
    server.stop().await;
    node.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_stalled_body_gets_408_and_the_connection_is_closed() {
    let limits = quick_limits();
    let node = mem_node(&limits).await;
    let server = start(node.clone(), limits).await;

    let mut stream = TcpStream::connect(server.addr).await.expect("connect");
    let head =
        "POST /v1/counters/c/increments HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n\
                Content-Length: 100\r\n\r\n{\"delta\": ";
    stream.write_all(head.as_bytes()).await.expect("write");
    let (took, got) = until_closed(&mut stream, Duration::from_secs(5)).await;
    let answer = parse_answer(&got).expect("an HTTP answer before the close");
    answer.assert_error(408, "request_timeout");
    assert!(took >= Duration::from_millis(500), "cut after {took:?}, before the request timeout");

    // Nothing was counted, and the server still serves.
    let a = raw_http(server.addr, "GET", "/v1/counters/c", None).await.expect("answer");
    a.assert_error(404, "counter_not_found");
    server.stop().await;
    node.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn a_full_listener_closes_a_silent_connection_for_a_new_one_and_waits_only_behind_busy_ones() {
    let limits = HttpConfig { connections_max: 1, request_timeout_ms: 5_000, ..quick_limits() };
    let inner = mem_node(&limits).await;
    let svc = Faulty { inner: inner.clone(), incr_delay: Duration::from_millis(600) };
    let server = start(svc, limits).await;

    // A socket that says nothing holds the one slot: a newcomer takes it at once.
    let mut hog = TcpStream::connect(server.addr).await.expect("connect");
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    let a = raw_http(server.addr, "GET", "/healthz", None).await.expect("answer");
    assert_eq!(a.status, 200);
    assert!(started.elapsed() < Duration::from_millis(150), "served after {:?}", started.elapsed());
    let (closed_after, _) = until_closed(&mut hog, Duration::from_secs(1)).await;
    assert!(closed_after < Duration::from_millis(100), "the silent socket was kept {closed_after:?}");

    // A connection with a request in flight is never closed for a newcomer, which
    // waits for it instead.
    let addr = server.addr;
    let busy = tokio::spawn(async move {
        raw_http(addr, "POST", "/v1/counters/c/increments", Some(r#"{"delta": 1, "event_id": "e"}"#)).await
    });
    tokio::time::sleep(Duration::from_millis(100)).await;
    let started = Instant::now();
    let a = raw_http(server.addr, "GET", "/healthz", None).await.expect("answer");
    assert_eq!(a.status, 200);
    assert!(started.elapsed() >= Duration::from_millis(300), "served after {:?}", started.elapsed());
    let b = busy.await.expect("task").expect("the busy request was answered");
    assert_eq!((b.status.as_u16(), b.json()), (200, serde_json::json!({"applied": true})));
    server.stop().await;
    inner.shutdown().await.expect("shutdown");
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn graceful_shutdown_finishes_in_flight_requests_and_closes_idle_connections() {
    // Long header timeout: idle connections may only close because of the shutdown.
    let limits =
        HttpConfig { header_read_timeout_ms: 30_000, request_timeout_ms: 5_000, ..HttpConfig::default() };
    let inner = mem_node(&limits).await;
    let svc = Faulty { inner: inner.clone(), incr_delay: Duration::from_millis(800) };
    let server = start(svc, limits).await;
    let addr = server.addr;

    // An idle keep-alive connection that has been served once.
    let mut idle = TcpStream::connect(addr).await.expect("connect");
    idle.write_all(b"GET /healthz HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n").await.expect("write");
    let mut buf = [0u8; 512];
    let n = idle.read(&mut buf).await.expect("read");
    assert!(String::from_utf8_lossy(&buf[..n]).starts_with("HTTP/1.1 200"));

    // A slow increment in flight when the shutdown starts.
    let in_flight = tokio::spawn(async move {
        raw_http(addr, "POST", "/v1/counters/c/increments", Some(r#"{"delta": 7, "event_id": "e"}"#)).await
    });
    tokio::time::sleep(Duration::from_millis(200)).await;
    let took = server.stop().await;

    let a = in_flight.await.expect("task").expect("the in-flight request was answered");
    assert_eq!((a.status.as_u16(), a.json()), (200, serde_json::json!({"applied": true})));
    assert!(took >= Duration::from_millis(400), "serve returned after {took:?}, before the request finished");
    assert!(took < Duration::from_secs(5), "serve took {took:?}: the idle connection held it up");
    let (_, _) = until_closed(&mut idle, Duration::from_secs(1)).await;
    assert!(TcpStream::connect(addr).await.is_err(), "still accepting after shutdown");

    let v = inner.read("c", tally_engine::Consistency::Fresh).await.expect("read");
    assert_eq!(v.value, 7);
    inner.shutdown().await.expect("shutdown");
}
