//! t25: what a web page can make a browser do to a node, through the router. A page
//! may make the browser send requests to 127.0.0.1; the node must refuse those that
//! could change something (a write from another origin, a `POST` without a JSON
//! body, as a form or a `no-cors` fetch sends it) and every request for a host name
//! it does not answer to (DNS rebinding), while clients that are not browsers —
//! which send no `Origin` — and the node's own pages go on as before.

mod common;

use axum::body::Body;
use axum::http::Request;
use common::*;
use tally_server::{router, HttpConfig};

fn with(method: &str, uri: &str, headers: &[(&str, &str)], body: &str) -> Request<Body> {
    let mut b = Request::builder().method(method).uri(uri);
    for (k, v) in headers {
        b = b.header(*k, *v);
    }
    b.body(Body::from(body.to_string())).expect("request")
}

#[tokio::test(flavor = "multi_thread", worker_threads = 2)]
async fn writes_from_other_origins_and_unknown_hosts_are_refused() {
    let limits = HttpConfig { allowed_hosts: vec!["tally-1.internal".into()], ..HttpConfig::default() };
    let node = mem_node(&limits).await;
    let app = router(node.clone(), &limits);
    call(&app, "PUT", "/v1/counters/likes:1", Some("{}")).await;
    let incr = "/v1/counters/likes:1/increments";
    let json = ("content-type", "application/json");
    let host = ("host", "127.0.0.1:7070");

    // A `no-cors` fetch from a page on another port: text/plain, an Origin, Sec-Fetch-Site.
    let a = send(
        &app,
        with(
            "POST",
            incr,
            &[host, ("content-type", "text/plain;charset=UTF-8"), ("origin", "http://127.0.0.1:8000")],
            r#"{"delta": 1}"#,
        ),
    )
    .await;
    a.assert_error(403, "cross_origin");
    // The same write with a JSON content type (only possible after a preflight the node
    // never grants), from a site the browser calls cross-site.
    let a =
        send(&app, with("POST", incr, &[host, json, ("sec-fetch-site", "cross-site")], r#"{"delta": 1}"#))
            .await;
    a.assert_error(403, "cross_origin");
    let a = send(&app, with("DELETE", "/v1/counters/likes:1", &[host, ("origin", "null")], "")).await;
    a.assert_error(403, "cross_origin");
    // A POST without a body, as a form sends it: accept-loss took none.
    let a = send(&app, with("POST", "/v1/cluster/nodes/node1/accept-loss", &[host], "")).await;
    a.assert_error(415, "unsupported_media_type");

    // DNS rebinding: a same-origin page whose name now points at 127.0.0.1.
    let rebound = ("host", "evil.example:7070");
    let a = send(&app, with("GET", "/v1/counters/likes:1/value", &[rebound], "")).await;
    a.assert_error(421, "host_not_allowed");
    let a = send(
        &app,
        with("POST", incr, &[rebound, json, ("origin", "http://evil.example:7070")], "{\"delta\":1}"),
    )
    .await;
    a.assert_error(421, "host_not_allowed");
    assert_eq!(
        call(&app, "GET", "/v1/counters/likes:1/value?consistency=fresh", None).await.json()["value"],
        0
    );

    // What goes on: clients that are not browsers, the node's own origin, listed names.
    for (headers, what) in [
        (vec![host, json], "curl"),
        (
            vec![host, json, ("origin", "http://127.0.0.1:7070"), ("sec-fetch-site", "same-origin")],
            "own page",
        ),
        (vec![("host", "localhost:7070"), json], "localhost"),
        (vec![("host", "[::1]:7070"), json], "IPv6 loopback"),
        (vec![("host", "TALLY-1.internal:7070"), json], "a listed name"),
    ] {
        let a = send(&app, with("POST", incr, &headers, r#"{"delta": 1}"#)).await;
        assert_eq!(a.status, 200, "{what}: {}", a.text);
    }
    let a = send(
        &app,
        with(
            "GET",
            "/v1/counters/likes:1/value?consistency=fresh",
            &[host, ("origin", "https://elsewhere.example")],
            "",
        ),
    )
    .await;
    assert_eq!(
        (a.status.as_u16(), a.json()["value"].as_i64()),
        (200, Some(5)),
        "reads from any origin are answered: {}",
        a.text
    );
    node.shutdown().await.expect("shutdown");
}
