//! The HTTP client: node URLs, requests with a timeout and a bounded answer, and
//! [`CliError`], the one error every command reports.
//!
//! The client talks only to the URL it was given (no proxies, no redirects) over
//! plain HTTP/1.1 with keep-alive.

use crate::wire::ErrorBody;
use reqwest::header::CONTENT_TYPE;
use reqwest::{Method, Url};
use serde::de::DeserializeOwned;
use serde::Serialize;
use std::time::Duration;

/// Largest answer read from a node, in bytes; a longer one is refused.
pub const ANSWER_BYTES_MAX: usize = 16 << 20;
/// Longest excerpt of a non-JSON answer quoted in an error message, in characters.
const QUOTE_CHARS_MAX: usize = 200;
/// How long connecting to a node may take, at most, in milliseconds (the request
/// timeout bounds it further).
const CONNECT_TIMEOUT_MS_MAX: u64 = 5_000;

/// Exit code: the node answered with an error.
pub const EXIT_API_ERROR: u8 = 1;
/// Exit code: a bad command line (clap's own code).
pub const EXIT_USAGE: u8 = 2;
/// Exit code: the node could not be reached, or did not answer in time.
pub const EXIT_UNREACHABLE: u8 = 3;
/// Exit code: `tally load` failed its verification or got nothing acknowledged.
pub const EXIT_LOAD_FAILED: u8 = 4;

/// Client-side error codes, in the same snake_case style as the server's.
pub mod codes {
    /// The node refused the connection or could not be resolved.
    pub const UNREACHABLE: &str = "unreachable";
    /// No answer within `--timeout-ms`; the request may or may not have taken effect.
    pub const CLIENT_TIMEOUT: &str = "client_timeout";
    /// The connection failed mid-request.
    pub const TRANSPORT: &str = "transport_error";
    /// The answer was not what the API promises (not JSON, too large, wrong shape).
    pub const BAD_ANSWER: &str = "bad_answer";
    /// A request body that cannot be encoded.
    pub const INVALID_REQUEST: &str = "invalid_request";
    /// A node URL that is not an http:// or https:// URL.
    pub const INVALID_NODE_URL: &str = "invalid_node_url";
    /// A `--cacert` file that cannot be read or holds no PEM certificate.
    pub const INVALID_CACERT: &str = "invalid_cacert";
    /// `tally load --verify` found the counter did not grow by the acknowledged count.
    pub const VERIFY_FAILED: &str = "verify_failed";
    /// A bug in the client (a task panicked).
    pub const INTERNAL: &str = "internal";
    /// `tally load` got no increment acknowledged.
    pub const NOTHING_ACKNOWLEDGED: &str = "nothing_acknowledged";
}

/// What went wrong, with a stable code: the server's own, or one of [`codes`].
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum CliError {
    /// The node answered with an error status.
    Api {
        /// The HTTP status.
        status: u16,
        /// The server's code, e.g. `counter_not_found`.
        code: String,
        /// The server's message.
        message: String,
    },
    /// The node could not be reached or did not answer usably.
    Transport {
        /// One of [`codes`].
        code: &'static str,
        /// What happened.
        message: String,
    },
    /// The command line named something unusable (a bad node URL).
    Usage {
        /// One of [`codes`].
        code: &'static str,
        /// What is wrong.
        message: String,
    },
    /// A load run failed its own checks.
    Load {
        /// One of [`codes`].
        code: &'static str,
        /// What failed.
        message: String,
    },
}

impl CliError {
    /// The stable code.
    pub fn code(&self) -> &str {
        match self {
            Self::Api { code, .. } => code,
            Self::Transport { code, .. } | Self::Usage { code, .. } | Self::Load { code, .. } => code,
        }
    }

    /// The message.
    pub fn message(&self) -> &str {
        match self {
            Self::Api { message, .. }
            | Self::Transport { message, .. }
            | Self::Usage { message, .. }
            | Self::Load { message, .. } => message,
        }
    }

    /// The process exit code for this error.
    pub fn exit_code(&self) -> u8 {
        match self {
            Self::Api { .. } => EXIT_API_ERROR,
            Self::Transport { code, .. } if *code == codes::BAD_ANSWER => EXIT_API_ERROR,
            Self::Transport { .. } => EXIT_UNREACHABLE,
            Self::Usage { .. } => EXIT_USAGE,
            Self::Load { .. } => EXIT_LOAD_FAILED,
        }
    }

    /// The error in the server's shape, `{"error": {"code": ..., "message": ...}}`.
    pub fn to_json(&self) -> serde_json::Value {
        serde_json::json!({ "error": { "code": self.code(), "message": self.message() } })
    }

    fn bad_answer(message: String) -> Self {
        Self::Transport { code: codes::BAD_ANSWER, message }
    }
}

impl std::fmt::Display for CliError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Api { status, code, message } => write!(f, "{code} (HTTP {status}): {message}"),
            other => write!(f, "{}: {}", other.code(), other.message()),
        }
    }
}

impl std::error::Error for CliError {}

/// Parses a node URL: `http://host:port`, or `host:port` (plain HTTP is implied).
/// Any path is kept as a prefix of the API's paths; a query or fragment is refused.
pub fn parse_node(text: &str) -> Result<Url, CliError> {
    let bad = |why: String| CliError::Usage { code: codes::INVALID_NODE_URL, message: why };
    let text = text.trim();
    let full = if text.contains("://") { text.to_string() } else { format!("http://{text}") };
    let url = Url::parse(&full).map_err(|e| bad(format!("{text:?} is not a node URL: {e}")))?;
    if url.scheme() != "http" && url.scheme() != "https" {
        return Err(bad(format!("{text:?}: a node URL is http:// or https://")));
    }
    if url.host_str().is_none_or(str::is_empty) {
        return Err(bad(format!("{text:?} names no host")));
    }
    if url.query().is_some() || url.fragment().is_some() || !url.username().is_empty() {
        return Err(bad(format!("{text:?}: a node URL has no query, fragment or user")));
    }
    Ok(url)
}

/// An answer with a success status, read whole.
#[derive(Debug, Clone)]
pub struct Answer {
    /// The HTTP status.
    pub status: u16,
    /// The body, as text.
    pub text: String,
}

impl Answer {
    /// The body decoded as `T`.
    pub fn parse<T: DeserializeOwned>(&self) -> Result<T, CliError> {
        serde_json::from_str(&self.text)
            .map_err(|e| CliError::bad_answer(format!("unexpected answer ({e}): {}", quote(&self.text))))
    }
}

fn quote(text: &str) -> String {
    let text = text.trim();
    if text.chars().count() <= QUOTE_CHARS_MAX {
        return text.to_string();
    }
    let cut: String = text.chars().take(QUOTE_CHARS_MAX).collect();
    format!("{cut}…")
}

/// The message of an error and all its causes, joined by `: `.
fn chain(e: &dyn std::error::Error) -> String {
    let mut text = e.to_string();
    let mut source = e.source();
    while let Some(s) = source {
        let more = s.to_string();
        if !text.contains(&more) {
            text.push_str(": ");
            text.push_str(&more);
        }
        source = s.source();
    }
    text
}

/// How long an idle pooled connection is kept, in milliseconds.
pub const POOL_IDLE_MS: u64 = 1_000;

/// A keep-alive HTTP client for one node.
#[derive(Debug, Clone)]
pub struct Client {
    http: reqwest::Client,
    base: Url,
    timeout: Duration,
    /// The client token, sent as `Authorization: Bearer TOKEN` with every request.
    token: Option<std::sync::Arc<str>>,
}

impl Client {
    /// A client for the node at `base`; every request (answer included) must
    /// complete within `timeout`.
    pub fn new(base: Url, timeout: Duration) -> Result<Self, CliError> {
        Self::connect(base, timeout, None)
    }

    /// [`Client::new`], trusting only `cacert` for `https://` nodes when given
    /// (as curl's `--cacert`), else the system's roots.
    pub fn connect(
        base: Url,
        timeout: Duration,
        cacert: Option<&reqwest::Certificate>,
    ) -> Result<Self, CliError> {
        let connect = timeout.min(Duration::from_millis(CONNECT_TIMEOUT_MS_MAX));
        let mut builder = reqwest::Client::builder();
        if let Some(ca) = cacert {
            builder = builder.tls_certs_only([ca.clone()]);
        }
        let http = builder
            .no_proxy()
            .redirect(reqwest::redirect::Policy::none())
            .http1_only()
            .tcp_nodelay(true)
            .connect_timeout(connect)
            .timeout(timeout)
            .pool_max_idle_per_host(1)
            // Below any node's keep-alive limit (`http.header_read_timeout_ms`, 5 s by
            // default), so a pooled connection is never reused as the node closes it.
            .pool_idle_timeout(Duration::from_millis(POOL_IDLE_MS))
            .build()
            .map_err(|e| CliError::Transport { code: codes::TRANSPORT, message: chain(&e) })?;
        Ok(Self { http, base, timeout, token: None })
    }

    /// The same client, sending `token` (if any) with every request.
    pub fn with_token(mut self, token: Option<&str>) -> Self {
        self.token = token.map(Into::into);
        self
    }

    /// The node's base URL.
    pub fn base(&self) -> &Url {
        &self.base
    }

    /// The URL of the API path made of `segments` (each percent-encoded as needed),
    /// under the base URL's own path.
    pub fn url(&self, segments: &[&str]) -> Url {
        let mut url = self.base.clone();
        if let Ok(mut path) = url.path_segments_mut() {
            path.pop_if_empty().extend(segments);
        }
        url
    }

    /// `/v1/counters/{name}` followed by `rest`.
    pub fn counter_url(&self, name: &str, rest: &[&str]) -> Url {
        let mut segments = vec!["v1", "counters", name];
        segments.extend_from_slice(rest);
        self.url(&segments)
    }

    /// Sends a request with an optional JSON body; a success status gives the answer,
    /// an error status the server's error.
    pub async fn call<B: Serialize + ?Sized>(
        &self,
        method: Method,
        url: Url,
        body: Option<&B>,
    ) -> Result<Answer, CliError> {
        let body = match body {
            Some(b) => Some(serde_json::to_vec(b).map_err(|e| CliError::Usage {
                code: codes::INVALID_REQUEST,
                message: format!("cannot encode the request: {e}"),
            })?),
            None => None,
        };
        self.send_raw(method, url, body).await
    }

    /// Sends a request whose JSON body is already encoded.
    pub async fn send_raw(
        &self,
        method: Method,
        url: Url,
        body: Option<Vec<u8>>,
    ) -> Result<Answer, CliError> {
        let mut request = self.http.request(method, url.clone());
        if let Some(token) = &self.token {
            request = request.bearer_auth(token);
        }
        if let Some(bytes) = body {
            request = request.header(CONTENT_TYPE, "application/json").body(bytes);
        }
        let mut response = request.send().await.map_err(|e| self.transport(&url, &e))?;
        let status = response.status().as_u16();
        let mut bytes = Vec::new();
        while let Some(chunk) = response.chunk().await.map_err(|e| self.transport(&url, &e))? {
            if bytes.len() + chunk.len() > ANSWER_BYTES_MAX {
                return Err(CliError::bad_answer(format!(
                    "the answer from {url} is larger than {ANSWER_BYTES_MAX} bytes"
                )));
            }
            bytes.extend_from_slice(&chunk);
        }
        let text = String::from_utf8_lossy(&bytes).into_owned();
        if (200..300).contains(&status) {
            return Ok(Answer { status, text });
        }
        Err(match serde_json::from_str::<ErrorBody>(&text) {
            Ok(body) => CliError::Api { status, code: body.error.code, message: body.error.message },
            Err(_) => CliError::Api {
                status,
                code: format!("http_{status}"),
                message: if text.trim().is_empty() {
                    format!("HTTP {status} from {url}")
                } else {
                    quote(&text)
                },
            },
        })
    }

    fn transport(&self, url: &Url, e: &reqwest::Error) -> CliError {
        if e.is_timeout() {
            CliError::Transport {
                code: codes::CLIENT_TIMEOUT,
                message: format!(
                    "no answer from {url} within {} ms (--timeout-ms); the request may or may not \
                     have taken effect",
                    self.timeout.as_millis()
                ),
            }
        } else if e.is_connect() {
            CliError::Transport {
                code: codes::UNREACHABLE,
                message: format!("cannot connect to {}: {}", self.base, chain(e)),
            }
        } else {
            CliError::Transport { code: codes::TRANSPORT, message: format!("{url}: {}", chain(e)) }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn node_urls() {
        assert_eq!(parse_node("127.0.0.1:7070").expect("ok").as_str(), "http://127.0.0.1:7070/");
        assert_eq!(parse_node("http://localhost:1/").expect("ok").as_str(), "http://localhost:1/");
        assert_eq!(parse_node("https://127.0.0.1:7443").expect("ok").as_str(), "https://127.0.0.1:7443/");
        for bad in ["http://", "ftp://x", "http://x/?a=1", "http://u@x/"] {
            let e = parse_node(bad).expect_err(bad);
            assert_eq!((e.code(), e.exit_code()), (codes::INVALID_NODE_URL, EXIT_USAGE), "{bad}");
        }
    }

    #[test]
    fn api_paths_are_encoded_under_the_base() {
        let t = Duration::from_secs(1);
        let c = Client::new(parse_node("http://127.0.0.1:7070").expect("ok"), t).expect("client");
        assert_eq!(
            c.counter_url("likes:42", &["value"]).as_str(),
            "http://127.0.0.1:7070/v1/counters/likes:42/value"
        );
        assert_eq!(c.counter_url("a/b c", &[]).as_str(), "http://127.0.0.1:7070/v1/counters/a%2Fb%20c");
        let c = Client::new(parse_node("http://h:1/tally/").expect("ok"), t).expect("client");
        assert_eq!(c.url(&["v1", "cluster"]).as_str(), "http://h:1/tally/v1/cluster");
    }

    #[test]
    fn errors_keep_the_server_shape() {
        let e = CliError::Api { status: 404, code: "counter_not_found".into(), message: "no x".into() };
        assert_eq!(
            e.to_json(),
            serde_json::json!({"error": {"code": "counter_not_found", "message": "no x"}})
        );
        assert_eq!(e.exit_code(), EXIT_API_ERROR);
        assert_eq!(e.to_string(), "counter_not_found (HTTP 404): no x");
    }
}
