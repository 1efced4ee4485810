//! [`ApiError`]: the one error shape of the public interface,
//! `{"error": {"code": "snake_case_code", "message": "..."}}`, with a fitting status.
//!
//! Domain errors keep the engine's code and status ([`TallyError::code`],
//! [`TallyError::http_status`]); the codes in [`codes`] cover what only the HTTP
//! layer can get wrong (malformed JSON, a wrong content type, an unknown route).

use axum::http::{header, HeaderValue, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::Json;
use serde::{Deserialize, Serialize};
use std::borrow::Cow;
use tally_engine::TallyError;

/// Error codes of the HTTP layer. Stable: clients match on them.
pub mod codes {
    /// 400: the body is not JSON (syntax error, truncated, nested too deeply).
    pub const MALFORMED_JSON: &str = "malformed_json";
    /// 400: the body is JSON of the wrong shape (unknown field, wrong type, missing field).
    pub const INVALID_BODY: &str = "invalid_body";
    /// 400: a delta that is missing or not a JSON integer (zero is refused by the
    /// engine with the same code).
    pub const INVALID_DELTA: &str = "invalid_delta";
    /// 422: an integer beyond the range its field allows (deltas are 64-bit).
    pub const OUT_OF_RANGE: &str = "out_of_range";
    /// 400: a query string the endpoint does not understand.
    pub const INVALID_QUERY: &str = "invalid_query";
    /// 400: a path segment that cannot be decoded.
    pub const INVALID_PATH: &str = "invalid_path";
    /// 400: the request body could not be read (the client went away mid-body).
    pub const BODY_READ_FAILED: &str = "body_read_failed";
    /// 413: the body is larger than `http.body_bytes_max`.
    pub const BODY_TOO_LARGE: &str = "body_too_large";
    /// 413: a batch with more than `http.batch_items_max` items (the engine's code).
    pub const BATCH_TOO_LARGE: &str = "batch_too_large";
    /// 415: a body that is not declared as `application/json`.
    pub const UNSUPPORTED_MEDIA_TYPE: &str = "unsupported_media_type";
    /// 401: no token, a malformed `Authorization` header, or a token this node does
    /// not accept (the answer carries `WWW-Authenticate: Bearer realm="tally"`).
    pub const UNAUTHORIZED: &str = "unauthorized";
    /// 403: the token is valid but its scopes or counter prefixes do not allow this.
    pub const FORBIDDEN: &str = "forbidden";
    /// 404: no such route.
    pub const NOT_FOUND: &str = "not_found";
    /// 405: the route exists but not with this method.
    pub const METHOD_NOT_ALLOWED: &str = "method_not_allowed";
    /// 408: the client did not send its body within `http.request_timeout_ms`.
    pub const REQUEST_TIMEOUT: &str = "request_timeout";
    /// 503: the node did not answer within `http.request_timeout_ms`; an increment
    /// with an event id may be retried with the same id.
    pub const TIMEOUT: &str = "timeout";
    /// 503: the node is draining for shutdown.
    pub const SHUTTING_DOWN: &str = "shutting_down";
    /// 500: a bug; the request may or may not have taken effect.
    pub const INTERNAL: &str = "internal";
    /// Any other client error produced below the router.
    pub const BAD_REQUEST: &str = "bad_request";
}

/// Seconds a client should wait before retrying a retryable error.
pub const RETRY_AFTER_S: u32 = 1;

/// The code of an error answer, left in the response's extensions so that layers
/// (the audit of admin operations) can name the outcome without reading the body.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ErrorCode(pub Cow<'static, str>);

/// An error answer: status, stable code and a human-readable message.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ApiError {
    /// The HTTP status.
    pub status: StatusCode,
    /// The stable snake_case code.
    pub code: Cow<'static, str>,
    /// What went wrong, for people.
    pub message: String,
    /// Whether the same request may succeed later (adds `Retry-After`).
    pub retryable: bool,
}

/// The JSON body of every error answer, and of each failed item of a batch.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorBody {
    /// The error.
    pub error: ErrorDetail,
}

/// The inside of an [`ErrorBody`].
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ErrorDetail {
    /// Stable snake_case code.
    pub code: String,
    /// Human-readable explanation.
    pub message: String,
}

impl ApiError {
    /// An error with a code of the HTTP layer.
    pub fn new(status: StatusCode, code: &'static str, message: impl Into<String>) -> Self {
        Self {
            status,
            code: Cow::Borrowed(code),
            message: message.into(),
            retryable: status.is_server_error(),
        }
    }

    /// 400 `malformed_json` or `invalid_body`, from a serde_json error.
    pub fn from_json(e: &serde_json::Error) -> Self {
        use serde_json::error::Category;
        match e.classify() {
            Category::Data => Self::new(StatusCode::BAD_REQUEST, codes::INVALID_BODY, e.to_string()),
            Category::Syntax | Category::Eof | Category::Io => {
                Self::new(StatusCode::BAD_REQUEST, codes::MALFORMED_JSON, e.to_string())
            }
        }
    }

    /// The body of this error.
    pub fn body(&self) -> ErrorBody {
        ErrorBody { error: ErrorDetail { code: self.code.to_string(), message: self.message.clone() } }
    }

    /// The same error with `prefix: ` before its message (e.g. a batch item's index).
    pub fn context(mut self, prefix: impl std::fmt::Display) -> Self {
        self.message = format!("{prefix}: {}", self.message);
        self
    }
}

impl From<TallyError> for ApiError {
    fn from(e: TallyError) -> Self {
        Self {
            status: StatusCode::from_u16(e.http_status()).unwrap_or(StatusCode::INTERNAL_SERVER_ERROR),
            code: Cow::Borrowed(e.code()),
            message: e.to_string(),
            retryable: e.retryable(),
        }
    }
}

impl IntoResponse for ApiError {
    fn into_response(self) -> Response {
        let mut response = (self.status, Json(self.body())).into_response();
        response.extensions_mut().insert(ErrorCode(self.code.clone()));
        if self.retryable {
            response.headers_mut().insert(header::RETRY_AFTER, HeaderValue::from(RETRY_AFTER_S));
        }
        response
    }
}

impl std::fmt::Display for ApiError {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} {}: {}", self.status.as_u16(), self.code, self.message)
    }
}

impl std::error::Error for ApiError {}
