//! What a web page may make a browser do to a node: nothing but read what the
//! browser will not show it.
//!
//! A node on 127.0.0.1 is reachable from every page its user opens: the page cannot
//! connect to it itself, but it can make the browser send requests there. Loopback
//! is therefore no trust boundary for HTTP, and this layer, in front of every route,
//! closes the two ways in:
//!
//! * **DNS rebinding.** A page of `evil.example` whose name later resolves to
//!   127.0.0.1 is same-origin with the node as far as the browser knows: it may send
//!   any request and read every answer. The browser still names `evil.example` in
//!   `Host`, so a request whose `Host` is not a name the node answers to is refused
//!   with 421 `host_not_allowed`. The node answers to IP literals (a page cannot
//!   rebind those), `localhost` and `*.localhost` (browsers resolve them to loopback
//!   themselves), and the names of `http.allowed_hosts` (`"*"` turns the check off).
//! * **Cross-origin writes.** A page of another origin may send a `POST` with a
//!   simple content type (`text/plain`, a form's) without asking the node first, as
//!   `fetch(url, {method: "POST", mode: "no-cors"})` or a form does. So:
//!   * every `POST` must declare a JSON body (`Content-Type: application/json`, or
//!     `{}` for a request without fields): a page of another origin can send that
//!     header only after a CORS preflight, which the node never grants (it answers
//!     no `OPTIONS` and sends no `Access-Control-Allow-*` header); 415 otherwise;
//!   * a write (any method but `GET`, `HEAD` and `OPTIONS`) whose `Origin` is not the
//!     node itself, or that the browser marks `Sec-Fetch-Site: cross-site` or
//!     `same-site` (another port of 127.0.0.1 is the same site), is refused with
//!     403 `cross_origin`. Clients that are not browsers send neither header.
//!
//! Reads stay open to any origin the way every HTTP server's are: the browser sends
//! them but shows the answer to no page of another origin.
//!
//! Each refusal is counted in `tally_listener_refusals_total{listener="http"}` and
//! logged on the audit target (rate-limited, as every refusal line).

use super::error::{codes, ApiError};
use axum::extract::{Request, State};
use axum::http::{header, HeaderMap, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::net::IpAddr;
use std::sync::Arc;
use tally_tls::refusals::{self, Listener, Reason};

/// The error code of a request for a host the node does not answer to (421).
pub const HOST_NOT_ALLOWED: &str = "host_not_allowed";
/// The error code of a browser's write from a page of another origin (403).
pub const CROSS_ORIGIN: &str = "cross_origin";
/// Longest piece of a client's header quoted back in an error, in bytes.
const QUOTE_BYTES_MAX: usize = 128;
/// The entry of `http.allowed_hosts` that lets every host through.
pub const ANY_HOST: &str = "*";

/// The names the node answers to beyond IP literals and `localhost`.
#[derive(Debug, Clone, Default)]
pub struct BrowserPolicy {
    /// `http.allowed_hosts`, lowercased.
    allowed_hosts: Vec<String>,
}

impl BrowserPolicy {
    /// The policy of `http.allowed_hosts`.
    pub fn new(allowed_hosts: &[String]) -> Self {
        Self { allowed_hosts: allowed_hosts.iter().map(|h| h.to_ascii_lowercase()).collect() }
    }

    /// Whether the node answers to `host` (a `Host` header's value, port included).
    pub fn allows_host(&self, host: &str) -> bool {
        let name = host_name(host).to_ascii_lowercase();
        if name.parse::<IpAddr>().is_ok() || name == "localhost" || name.ends_with(".localhost") {
            return true;
        }
        self.allowed_hosts.iter().any(|h| h == ANY_HOST || *h == name)
    }
}

/// The name part of a `Host` value: without its port, and an IPv6 literal without
/// its brackets.
fn host_name(host: &str) -> &str {
    let host = host.trim();
    if let Some(rest) = host.strip_prefix('[') {
        return rest.split(']').next().unwrap_or("");
    }
    match host.rsplit_once(':') {
        Some((name, port)) if port.bytes().all(|b| b.is_ascii_digit()) => name,
        _ => host,
    }
}

fn quote(text: &str) -> String {
    text.chars().take(QUOTE_BYTES_MAX).map(|c| if c.is_control() { '?' } else { c }).collect()
}

/// Whether a request may change something: every method but the safe ones.
fn is_write(method: &Method) -> bool {
    !matches!(*method, Method::GET | Method::HEAD | Method::OPTIONS)
}

/// Whether a write comes from a page of another origin, by what the browser says
/// (`Origin`, `Sec-Fetch-Site`); `None` for a same-origin one or a client that is
/// not a browser, else what gave it away.
fn cross_origin(headers: &HeaderMap) -> Option<String> {
    let text = |name: header::HeaderName| {
        headers.get(name).map(|v| String::from_utf8_lossy(v.as_bytes()).into_owned())
    };
    if let Some(site) = text(header::HeaderName::from_static("sec-fetch-site")) {
        if !matches!(site.as_str(), "same-origin" | "none") {
            return Some(format!("Sec-Fetch-Site: {}", quote(&site)));
        }
    }
    let origin = text(header::ORIGIN)?;
    let host = text(header::HOST).unwrap_or_default();
    // `scheme://host[:port]`, compared with the Host the request was sent to.
    let same = origin
        .split_once("://")
        .is_some_and(|(_, authority)| !host.is_empty() && authority.eq_ignore_ascii_case(host.trim()));
    (!same).then(|| format!("Origin: {}", quote(&origin)))
}

/// Whether the request declares a JSON body (as `body::JsonBody` requires).
fn declares_json(headers: &HeaderMap) -> bool {
    super::body::is_json(headers)
}

fn refused(reason: Reason, method: &Method, path: &str, why: &str) {
    refusals::count(Listener::Http, reason);
    refusals::log_limited(|| {
        tracing::warn!(
            target: crate::auth::AUDIT_TARGET,
            event = "refused",
            transport = "http",
            reason = reason.as_str(),
            %method,
            path = %quote(path),
            outcome = "refused",
            "HTTP: refused a browser request: {why}"
        );
    });
}

/// The layer in front of every route (see the module docs).
pub async fn guard(State(policy): State<Arc<BrowserPolicy>>, req: Request, next: Next) -> Response {
    let (method, headers, path) = (req.method(), req.headers(), req.uri().path());
    if let Some(host) = headers.get(header::HOST) {
        let host = String::from_utf8_lossy(host.as_bytes());
        if !policy.allows_host(&host) {
            let why = format!("Host {:?} is not a name this node answers to", quote(&host));
            refused(Reason::HostNotAllowed, method, path, &why);
            let message = format!(
                "this node does not answer to host {:?}: add the name to http.allowed_hosts if clients \
                 reach the node by it (a web page can point a name it owns at 127.0.0.1: DNS rebinding)",
                quote(&host)
            );
            return ApiError::new(StatusCode::MISDIRECTED_REQUEST, HOST_NOT_ALLOWED, message).into_response();
        }
    }
    if is_write(method) {
        if let Some(why) = cross_origin(headers) {
            refused(Reason::CrossOrigin, method, path, &why);
            let message = format!(
                "a browser sent this {method} from a page of another origin ({why}); writes are taken \
                 only from clients that are not browsers or from the node's own pages"
            );
            return ApiError::new(StatusCode::FORBIDDEN, CROSS_ORIGIN, message).into_response();
        }
    }
    next.run(req).await
}

/// The 415 answer to a `POST` that declares no JSON body, or `None` to serve it.
/// Run on the routes of the access table only (from [`super::access`]), so a `POST`
/// to a path that does not take one still gets 405.
pub fn unless_json_post(method: &Method, headers: &HeaderMap) -> Option<Response> {
    (method == Method::POST && !declares_json(headers)).then(|| {
        ApiError::new(
            StatusCode::UNSUPPORTED_MEDIA_TYPE,
            codes::UNSUPPORTED_MEDIA_TYPE,
            "a POST must be sent with Content-Type: application/json (a body of {} when the request \
             has no fields): a web page of another origin cannot send that header",
        )
        .into_response()
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use axum::http::HeaderValue;

    #[test]
    fn the_node_answers_to_ip_literals_localhost_and_its_listed_names() {
        let policy = BrowserPolicy::new(&["Tally-1.internal".into()]);
        for host in [
            "127.0.0.1:7070",
            "127.0.0.1",
            "[::1]:7070",
            "10.0.0.7:7070",
            "localhost:7070",
            "LOCALHOST",
            "app.localhost:1",
            "tally-1.internal:7070",
        ] {
            assert!(policy.allows_host(host), "{host}");
        }
        for host in
            ["evil.example:7070", "evil.example", "127.0.0.1.nip.io:7070", "localhost.evil.example", ""]
        {
            assert!(!policy.allows_host(host), "{host}");
        }
        assert!(BrowserPolicy::new(&[ANY_HOST.into()]).allows_host("evil.example:1"));
    }

    fn headers(pairs: &[(&'static str, &'static str)]) -> HeaderMap {
        let mut h = HeaderMap::new();
        for (k, v) in pairs {
            h.insert(*k, HeaderValue::from_static(v));
        }
        h
    }

    #[test]
    fn a_write_from_another_origin_is_told_apart_from_the_nodes_own_and_from_non_browsers() {
        assert_eq!(cross_origin(&headers(&[("host", "127.0.0.1:7070")])), None, "curl sends no Origin");
        let same = headers(&[("host", "127.0.0.1:7070"), ("origin", "http://127.0.0.1:7070")]);
        assert_eq!(cross_origin(&same), None);
        let same = headers(&[("host", "127.0.0.1:7070"), ("sec-fetch-site", "same-origin")]);
        assert_eq!(cross_origin(&same), None);
        for bad in [
            headers(&[("host", "127.0.0.1:7070"), ("origin", "http://127.0.0.1:8000")]),
            headers(&[("host", "127.0.0.1:7070"), ("origin", "null")]),
            headers(&[("host", "127.0.0.1:7070"), ("origin", "https://evil.example")]),
            headers(&[("host", "127.0.0.1:7070"), ("sec-fetch-site", "same-site")]),
            headers(&[("host", "127.0.0.1:7070"), ("sec-fetch-site", "cross-site")]),
        ] {
            assert!(cross_origin(&bad).is_some(), "{bad:?}");
        }
        assert!(is_write(&Method::POST) && is_write(&Method::DELETE) && !is_write(&Method::GET));
    }
}
