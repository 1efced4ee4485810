//! Request bodies: bounded reading, content-type checking, and the wire shapes of
//! the public interface with their conversion into engine types.
//!
//! Integers that matter (deltas, authoritative totals) are read from the JSON text
//! itself ([`RawValue`]) rather than through `f64`-lossy number handling, so a delta
//! of `1.5`, `"1"` or `1e3` is refused with a message that says why, a number beyond
//! 64 bits is refused as out of range instead of being rounded, and an authoritative
//! total may use the full `i128` range the engine sums in.

use super::error::{codes, ApiError};
use axum::body::Bytes;
use axum::extract::{FromRequest, Request};
use axum::http::{header, HeaderMap, StatusCode};
use futures::StreamExt;
use serde::de::{DeserializeOwned, IgnoredAny, SeqAccess, Visitor};
use serde::{Deserialize, Deserializer, Serialize};
use serde_json::value::RawValue;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use tally_core::frequency::FrequencySpec;
use tally_engine::{AutoPatch, Increment, SpecPatch, TallyError};

/// Longest excerpt of a client's value quoted back in an error message, in bytes.
const QUOTE_BYTES_MAX: usize = 64;

/// What the request guard tells body extractors: the size limit, and a flag the
/// extractor sets once the body has fully arrived (so a timeout can tell a slow
/// client, 408, from a slow node, 503).
#[derive(Debug, Clone)]
pub struct BodyContext {
    /// Largest body accepted, in bytes.
    pub limit_bytes: usize,
    /// Set when the whole body has been read.
    pub done: Arc<AtomicBool>,
}

impl Default for BodyContext {
    fn default() -> Self {
        Self { limit_bytes: 1 << 20, done: Arc::new(AtomicBool::new(false)) }
    }
}

/// Reads the whole body, refusing more than the limit (413) before buffering it.
async fn read_body(req: Request) -> Result<Bytes, ApiError> {
    let ctx = req.extensions().get::<BodyContext>().cloned().unwrap_or_default();
    let too_large = |got: String| {
        ApiError::new(
            StatusCode::PAYLOAD_TOO_LARGE,
            codes::BODY_TOO_LARGE,
            format!("the body is {got} bytes; the limit is {} (http.body_bytes_max)", ctx.limit_bytes),
        )
    };
    let declared = req
        .headers()
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.parse::<u64>().ok());
    if let Some(len) = declared {
        if len > ctx.limit_bytes as u64 {
            return Err(too_large(len.to_string()));
        }
    }
    let capacity = declared.map_or(0, |l| l as usize).min(ctx.limit_bytes);
    let mut buf = Vec::with_capacity(capacity);
    let mut stream = req.into_body().into_data_stream();
    while let Some(chunk) = stream.next().await {
        let chunk = chunk.map_err(|e| {
            ApiError::new(
                StatusCode::BAD_REQUEST,
                codes::BODY_READ_FAILED,
                format!("cannot read the body: {e}"),
            )
        })?;
        if buf.len() + chunk.len() > ctx.limit_bytes {
            return Err(too_large(format!("more than {}", ctx.limit_bytes)));
        }
        buf.extend_from_slice(&chunk);
    }
    ctx.done.store(true, Ordering::SeqCst);
    Ok(Bytes::from(buf))
}

/// Whether the request declares a JSON body (`application/json`, any parameters,
/// or any `+json` media type).
pub(crate) fn is_json(headers: &HeaderMap) -> bool {
    let Some(value) = headers.get(header::CONTENT_TYPE).and_then(|v| v.to_str().ok()) else {
        return false;
    };
    let essence = value.split(';').next().unwrap_or("").trim().to_ascii_lowercase();
    essence == "application/json" || (essence.starts_with("application/") && essence.ends_with("+json"))
}

fn not_json() -> ApiError {
    ApiError::new(
        StatusCode::UNSUPPORTED_MEDIA_TYPE,
        codes::UNSUPPORTED_MEDIA_TYPE,
        "the body must be JSON, sent with Content-Type: application/json",
    )
}

fn parse<T: DeserializeOwned>(headers: &HeaderMap, bytes: &[u8]) -> Result<T, ApiError> {
    if !is_json(headers) {
        return Err(not_json());
    }
    let mut de = serde_json::Deserializer::from_slice(bytes);
    match serde_path_to_error::deserialize::<_, T>(&mut de) {
        Ok(value) => {
            de.end().map_err(|e| ApiError::from_json(&e))?;
            Ok(value)
        }
        Err(e) => Err(describe(bytes, &e)),
    }
}

/// What a body field accepts, in the words of the public interface.
fn accepts(field: &str) -> &'static str {
    match field {
        "shards" => "a whole number from 1 to 1024, or \"auto\"",
        "min_shards" | "max_shards" => "a whole number from 1 to 1024",
        "durability" => "\"sync\" or \"batched\"",
        "flush_ms" => "a whole number of milliseconds from 1 to 60000",
        "rollup_ms" => "a whole number of milliseconds: 0 (no rollup) or 10 to 3600000",
        "router" => "one of \"event\", \"writer\", \"round_robin\", \"random\"",
        "distinct" => "true or false",
        "dedup_window_s" => "a whole number of seconds from 0 to 2592000",
        "frequency" => "an object {\"epsilon\": number, \"delta\": number}",
        "epsilon" | "delta_" => "a number",
        "windows" => "a list of durations such as [\"1m\", \"1h\", \"24h\"]",
        "min" | "max" => "a whole number within the 64-bit range",
        "limit" => "an object {\"window\": \"1m\", \"max\": whole number}",
        "window" => "a duration such as \"1m\"",
        "replicas" => "a whole number from 1 to 5",
        "ttl_ms" => "a whole number of milliseconds, at least 1",
        "expires_at_ms" => "a whole number of milliseconds since the Unix epoch",
        "when" => "one of \"nx\", \"xx\", \"gt\", \"lt\"",
        "event_id" | "writer" | "member" | "item" | "counter" => "a string",
        "counter_encoded" => "a string: the name's bytes percent-encoded, as in a path",
        "seq" => "a whole number from 0 to 9223372036854775807",
        "increments" => "a list of increments, each an object with counter (or counter_encoded) and delta",
        "delta" => "a non-zero whole number within the 64-bit range",
        "authoritative" => "a whole number (the counter's true total)",
        _ => "a value of the documented type (see /v1/openapi.json)",
    }
}

/// The JSON value at `path` (as `serde_path_to_error` writes it: `a.b[2].c`) of
/// `bytes`, shortened for a message.
fn value_at(bytes: &[u8], path: &str) -> Option<String> {
    let root: serde_json::Value = serde_json::from_slice(bytes).ok()?;
    let mut v = &root;
    for part in path.split('.').filter(|p| !p.is_empty()) {
        let (name, rest) = part.split_once('[').map_or((part, ""), |(n, r)| (n, r));
        if !name.is_empty() {
            v = v.get(name)?;
        }
        for index in rest.split('[').filter(|i| !i.is_empty()) {
            v = v.get(index.trim_end_matches(']').parse::<usize>().ok()?)?;
        }
    }
    Some(quote(&v.to_string()))
}

/// A body that did not decode, as an error that names the field and what it
/// accepts (never the parser's own words for its types).
fn describe(bytes: &[u8], e: &serde_path_to_error::Error<serde_json::Error>) -> ApiError {
    use serde_json::error::Category;
    let inner = e.inner();
    if !matches!(inner.classify(), Category::Data) {
        return ApiError::from_json(inner);
    }
    let bad = |m: String| ApiError::new(StatusCode::BAD_REQUEST, codes::INVALID_BODY, m);
    let path = e.path().to_string();
    let message = inner.to_string();
    if let Some(rest) = message.strip_prefix("unknown field `") {
        let name = rest.split('`').next().unwrap_or("");
        let known = rest.split_once("expected one of ").map_or("", |(_, k)| k);
        let known = known.split(" at line").next().unwrap_or("").replace('`', "");
        // The path names the unknown field itself; what it was found in comes before.
        let at = path.rsplit_once('.').map(|(parent, _)| format!(" in {parent}")).unwrap_or_default();
        return bad(format!("unknown field {name:?}{at}; the fields are {known}"));
    }
    if let Some(rest) = message.strip_prefix("missing field `") {
        let name = rest.split('`').next().unwrap_or("");
        return bad(format!("{name} is required: {}", accepts(name)));
    }
    if path == "." {
        let got = match serde_json::from_slice::<serde_json::Value>(bytes) {
            Ok(serde_json::Value::Array(_)) => "an array",
            Ok(serde_json::Value::String(_)) => "a string",
            Ok(serde_json::Value::Number(_)) => "a number",
            Ok(serde_json::Value::Bool(_)) => "a boolean",
            Ok(serde_json::Value::Null) => "null",
            _ => "something else",
        };
        return bad(format!("the body must be a JSON object of the documented fields (got {got})"));
    }
    let field = path.rsplit('.').next().unwrap_or(&path);
    let field = field.split('[').next().unwrap_or(field);
    // `delta` inside `frequency` is the count-min δ, not an increment's delta.
    let key = if field == "delta" && path.contains("frequency") { "delta_" } else { field };
    let got = value_at(bytes, &path).map(|v| format!(" (got {v})")).unwrap_or_default();
    bad(format!("{path} must be {}{got}", accepts(key)))
}

/// A JSON request body, bounded by `http.body_bytes_max`. Every failure is an
/// [`ApiError`]: 413 too large, 415 not JSON, 400 malformed or of the wrong shape.
#[derive(Debug)]
pub struct JsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned> FromRequest<S> for JsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, ApiError> {
        let headers = req.headers().clone();
        let bytes = read_body(req).await?;
        parse(&headers, &bytes).map(JsonBody)
    }
}

/// Like [`JsonBody`], but an empty body (with any content type, or none) means
/// `T::default()`: `PUT /v1/counters/x` with no body creates a default counter.
#[derive(Debug)]
pub struct OptionalJsonBody<T>(pub T);

impl<S: Send + Sync, T: DeserializeOwned + Default> FromRequest<S> for OptionalJsonBody<T> {
    type Rejection = ApiError;

    async fn from_request(req: Request, _state: &S) -> Result<Self, ApiError> {
        let headers = req.headers().clone();
        let bytes = read_body(req).await?;
        if bytes.iter().all(u8::is_ascii_whitespace) {
            return Ok(Self(T::default()));
        }
        parse(&headers, &bytes).map(OptionalJsonBody)
    }
}

fn quote(raw: &str) -> String {
    if raw.len() <= QUOTE_BYTES_MAX {
        return raw.to_string();
    }
    let mut end = QUOTE_BYTES_MAX;
    while !raw.is_char_boundary(end) {
        end -= 1;
    }
    format!("{}…", &raw[..end])
}

/// Why a JSON value is not the integer a field needs.
#[derive(Debug, Clone, PartialEq, Eq)]
enum IntError {
    /// A string, array, object or boolean.
    NotANumber(&'static str),
    /// A number with a fraction or an exponent.
    NotAnInteger,
    /// An integer beyond `i128`.
    TooLarge,
}

/// Reads a JSON integer from its text, exactly. `null` is `None` (absent).
fn json_int(raw: &RawValue) -> Result<Option<i128>, IntError> {
    let text = raw.get().trim();
    match text.as_bytes().first() {
        Some(b'n') => Ok(None),
        Some(b'"') => Err(IntError::NotANumber("a string")),
        Some(b'[') => Err(IntError::NotANumber("an array")),
        Some(b'{') => Err(IntError::NotANumber("an object")),
        Some(b't' | b'f') => Err(IntError::NotANumber("a boolean")),
        _ if text.contains(['.', 'e', 'E']) => Err(IntError::NotAnInteger),
        // Valid JSON integer digits fail to parse only by overflowing.
        _ => text.parse::<i128>().map(Some).map_err(|_| IntError::TooLarge),
    }
}

/// Reads a raw `delta` as an `i64`. Zero passes: the engine refuses it, so the
/// message is the same on every front end.
fn delta_of(raw: Option<&RawValue>) -> Result<i64, ApiError> {
    let bad = |m: String| ApiError::new(StatusCode::BAD_REQUEST, codes::INVALID_DELTA, m);
    let Some(raw) = raw else {
        return Err(bad("delta is required: a non-zero JSON integer".into()));
    };
    let value = match json_int(raw) {
        Ok(Some(v)) => v,
        Ok(None) => return Err(bad("delta is required: a non-zero JSON integer".into())),
        Err(IntError::NotANumber(kind)) => {
            return Err(bad(format!("delta must be a JSON integer, not {kind} (got {})", quote(raw.get()))))
        }
        Err(IntError::NotAnInteger) => {
            return Err(bad(format!(
                "delta must be a JSON integer, without fraction or exponent (got {})",
                quote(raw.get())
            )))
        }
        Err(IntError::TooLarge) => i128::MAX,
    };
    i64::try_from(value).map_err(|_| {
        ApiError::new(
            StatusCode::UNPROCESSABLE_ENTITY,
            codes::OUT_OF_RANGE,
            format!("delta {} is outside the 64-bit range ±{}", quote(raw.get()), i64::MAX),
        )
    })
}

/// `POST /v1/counters/{name}/increments`: one increment. Only `delta` is required.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct IncrementBody {
    /// The non-zero amount (read exactly from the JSON text).
    #[serde(default)]
    pub delta: Option<Box<RawValue>>,
    /// The idempotency key.
    #[serde(default)]
    pub event_id: Option<String>,
    /// The writer, for writer-affinity routing.
    #[serde(default)]
    pub writer: Option<String>,
    /// A member for distinct counting.
    #[serde(default)]
    pub member: Option<String>,
    /// An item whose frequency the delta adds to (counters with `frequency`).
    #[serde(default)]
    pub item: Option<String>,
    /// The writer's sequence number (needs `writer`, excludes `event_id`).
    #[serde(default)]
    pub seq: Option<u64>,
}

impl IncrementBody {
    /// The engine's increment, or why the delta is unusable.
    pub fn into_increment(self) -> Result<Increment, ApiError> {
        Ok(Increment {
            delta: delta_of(self.delta.as_deref())?,
            event_id: self.event_id,
            writer: self.writer,
            seq: self.seq,
            member: self.member,
            item: self.item,
        })
    }
}

/// One item of `POST /v1/increments`: an increment plus the counter it goes to,
/// named by exactly one of `counter` and `counter_encoded`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchItem {
    /// The counter's name as text (its UTF-8 bytes).
    #[serde(default)]
    pub counter: Option<String>,
    /// The counter's name percent-encoded as in a path (`%FF`, `a%20b`): any bytes,
    /// such as a name that is not UTF-8, which a listing shows in this form.
    #[serde(default)]
    pub counter_encoded: Option<String>,
    /// The non-zero amount.
    #[serde(default)]
    pub delta: Option<Box<RawValue>>,
    /// The idempotency key.
    #[serde(default)]
    pub event_id: Option<String>,
    /// The writer.
    #[serde(default)]
    pub writer: Option<String>,
    /// A member for distinct counting.
    #[serde(default)]
    pub member: Option<String>,
    /// An item for frequencies.
    #[serde(default)]
    pub item: Option<String>,
    /// The writer's sequence number.
    #[serde(default)]
    pub seq: Option<u64>,
}

/// `POST /v1/increments`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct BatchBody {
    /// The increments, answered one result each, in order.
    pub increments: Vec<BatchItem>,
}

impl BatchBody {
    /// The engine's batch. A malformed delta refuses the whole batch (nothing is
    /// applied), naming the item; domain errors (bad names, zero deltas, conflicts)
    /// are answered per item by the engine.
    pub fn into_items(self) -> Result<Vec<(String, Increment)>, ApiError> {
        self.increments
            .into_iter()
            .enumerate()
            .map(|(i, item)| {
                let delta =
                    delta_of(item.delta.as_deref()).map_err(|e| e.context(format!("increments[{i}]")))?;
                let name = item_name(item.counter, item.counter_encoded)
                    .map_err(|e| e.context(format!("increments[{i}]")))?;
                let inc = Increment {
                    delta,
                    event_id: item.event_id,
                    writer: item.writer,
                    seq: item.seq,
                    member: item.member,
                    item: item.item,
                };
                Ok((name, inc))
            })
            .collect()
    }
}

/// A batch item's counter, in its escaped form (`tally_core::name`), from exactly
/// one of its two fields: `counter`'s UTF-8 bytes, or the bytes `counter_encoded`
/// percent-encodes (as a path segment is decoded).
fn item_name(counter: Option<String>, encoded: Option<String>) -> Result<String, ApiError> {
    let bad = |m: String| ApiError::new(StatusCode::BAD_REQUEST, codes::INVALID_BODY, m);
    match (counter, encoded) {
        (Some(text), None) => Ok(tally_core::name::escape(text.as_bytes())),
        (None, Some(encoded)) => tally_core::name::percent_decode(&encoded)
            .map(|raw| tally_core::name::escape(&raw))
            .map_err(|e| bad(format!("counter_encoded: {e}"))),
        (Some(_), Some(_)) => {
            Err(bad("counter and counter_encoded name the same thing: give one of them, not both".into()))
        }
        (None, None) => Err(bad(
            "counter or counter_encoded is required: the name as text, or its bytes percent-encoded as in a path"
                .into(),
        )),
    }
}

/// The number of elements of a JSON array, counted without keeping them.
struct SeqLen(usize);

impl<'de> Deserialize<'de> for SeqLen {
    fn deserialize<D: Deserializer<'de>>(d: D) -> Result<Self, D::Error> {
        struct Count;
        impl<'de> Visitor<'de> for Count {
            type Value = SeqLen;
            fn expecting(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
                f.write_str("an array")
            }
            fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<SeqLen, A::Error> {
                let mut n = 0;
                while seq.next_element::<IgnoredAny>()?.is_some() {
                    n += 1;
                }
                Ok(SeqLen(n))
            }
        }
        d.deserialize_seq(Count)
    }
}

/// How many items a batch body holds, counted before any item is built, so an
/// oversized batch is refused without allocating its items. `None` if the body is
/// not a well-formed batch (the full parse then reports why).
pub fn batch_len(bytes: &[u8]) -> Option<usize> {
    #[derive(Deserialize)]
    struct Shape {
        increments: SeqLen,
    }
    serde_json::from_slice::<Shape>(bytes).ok().map(|s| s.increments.0)
}

/// Extracts a batch body, refusing one with more than `limit` items (413
/// `batch_too_large`) before any item is built.
pub async fn read_batch(req: Request, limit: usize) -> Result<BatchBody, ApiError> {
    let headers = req.headers().clone();
    let bytes = read_body(req).await?;
    if !is_json(&headers) {
        return Err(not_json());
    }
    if let Some(got) = batch_len(&bytes) {
        if got > limit {
            return Err(TallyError::BatchTooLarge { got, max: limit }.into());
        }
    }
    parse(&headers, &bytes)
}

/// `POST /v1/counters/{name}/reconcile`.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReconcileBody {
    /// The true total, any `i128`.
    #[serde(default)]
    pub authoritative: Option<Box<RawValue>>,
}

impl ReconcileBody {
    /// The authoritative total, read exactly.
    pub fn authoritative(&self) -> Result<i128, ApiError> {
        let bad = |m: String| ApiError::new(StatusCode::BAD_REQUEST, codes::INVALID_BODY, m);
        let Some(raw) = self.authoritative.as_deref() else {
            return Err(bad("authoritative is required: the counter's true total as a JSON integer".into()));
        };
        match json_int(raw) {
            Ok(Some(v)) => Ok(v),
            Ok(None) => {
                Err(bad("authoritative is required: the counter's true total as a JSON integer".into()))
            }
            Err(IntError::NotANumber(kind)) => Err(bad(format!(
                "authoritative must be a JSON integer, not {kind} (got {})",
                quote(raw.get())
            ))),
            Err(IntError::NotAnInteger) => Err(bad(format!(
                "authoritative must be a JSON integer, without fraction or exponent (got {})",
                quote(raw.get())
            ))),
            Err(IntError::TooLarge) => Err(ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                codes::OUT_OF_RANGE,
                format!("authoritative {} is outside the 128-bit range ±{}", quote(raw.get()), i128::MAX),
            )),
        }
    }
}

/// `PUT /v1/counters/{name}`: the spec fields to set, all optional. Numbers are read
/// wide and words as text so that every out-of-range value or unknown word gets the
/// engine's own `invalid_spec` error (422) rather than a JSON type error.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct SpecBody {
    /// Shard count, or `"auto"`: the count follows contention within
    /// `min_shards..=max_shards`.
    pub shards: Option<ShardsField>,
    /// Fewest shards of an auto counter (where a new one starts).
    pub min_shards: Option<u64>,
    /// Most shards of an auto counter.
    pub max_shards: Option<u64>,
    /// `sync` or `batched`.
    pub durability: Option<String>,
    /// Aggregation window, in milliseconds.
    pub flush_ms: Option<u64>,
    /// Rollup refresh interval, in milliseconds; 0 = none.
    pub rollup_ms: Option<u64>,
    /// `event`, `writer`, `round_robin` or `random`.
    pub router: Option<String>,
    /// Keep a distinct-count sketch.
    pub distinct: Option<bool>,
    /// Dedup window, in seconds.
    pub dedup_window_s: Option<u64>,
    /// Keep per-item frequencies: `{"epsilon": ..., "delta": ...}`.
    pub frequency: Option<FrequencySpec>,
    /// Sliding windows: durations such as `["1m", "1h", "24h"]`; `[]` for none.
    pub windows: Option<Vec<String>>,
    /// The lowest value the counter may take (set on create only).
    pub min: Option<i64>,
    /// The highest value the counter may take (set on create only).
    pub max: Option<i64>,
    /// The most one window may hold, `{"window": "1m", "max": 100}` (set on create
    /// only).
    pub limit: Option<LimitBody>,
    /// How many nodes hold a copy of each shard, 1–5 (set on create only; without
    /// it, the cluster's `replicas`).
    pub replicas: Option<u64>,
    /// The counter expires this many milliseconds from now (as `EXPIRE`); the
    /// deadline is counter metadata (`GET …` answers it as `expires_at_ms`).
    pub ttl_ms: Option<u64>,
}

/// Longest span a deadline may be set to from now, in milliseconds: 100 years,
/// far beyond any window and well inside the deadlines' bound
/// ([`tally_core::expiry::EXPIRES_AT_MS_MAX`]).
pub const TTL_MS_MAX: u64 = 100 * 365 * 86_400_000;

/// Checks a span given as `ttl_ms`: 1 to [`TTL_MS_MAX`].
pub fn ttl_ms_in_range(field: &'static str, ttl_ms: u64) -> Result<i64, TallyError> {
    if ttl_ms == 0 || ttl_ms > TTL_MS_MAX {
        return Err(TallyError::InvalidSpec(tally_core::spec::SpecError::OutOfRange {
            field,
            min: 1,
            max: TTL_MS_MAX,
            got: ttl_ms,
        }));
    }
    Ok(ttl_ms as i64)
}

/// `PUT /v1/counters/{name}/expiry`: when the counter expires — `ttl_ms` from now,
/// or `expires_at_ms` (milliseconds since the Unix epoch; one already passed deletes
/// the counter at once, as `EXPIRE` with a past time does) — and under which
/// condition on its current deadline (`when`: `nx`, `xx`, `gt` or `lt`, as Redis's
/// `EXPIRE` options).
#[derive(Debug, Clone, Default, PartialEq, Eq, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ExpiryBody {
    /// Milliseconds from now.
    pub ttl_ms: Option<u64>,
    /// A deadline in milliseconds since the Unix epoch.
    pub expires_at_ms: Option<u64>,
    /// `nx`, `xx`, `gt`, `lt`; absent: always.
    pub when: Option<String>,
}

impl ExpiryBody {
    /// The deadline asked for at `now_ms`, and the condition.
    pub fn deadline(&self, now_ms: u64) -> Result<(u64, tally_core::expiry::Condition), ApiError> {
        use tally_core::expiry::{deadline, Condition, When};
        let bad = |m: &str| ApiError::new(StatusCode::BAD_REQUEST, codes::INVALID_BODY, m.to_owned());
        let when = match (self.ttl_ms, self.expires_at_ms) {
            (Some(ttl), None) => When::InMillis(ttl_ms_in_range("ttl_ms", ttl)?),
            (None, Some(at)) => When::AtMillis(i64::try_from(at).unwrap_or(i64::MAX)),
            _ => return Err(bad("give exactly one of ttl_ms (milliseconds from now) or expires_at_ms (milliseconds since the Unix epoch)")),
        };
        let at = deadline(when, now_ms).map_err(|e| {
            ApiError::new(
                StatusCode::UNPROCESSABLE_ENTITY,
                codes::OUT_OF_RANGE,
                format!("expires_at_ms: {e}"),
            )
        })?;
        let cond = match self.when.as_deref() {
            None => Condition::Always,
            Some("nx") => Condition::Nx,
            Some("xx") => Condition::Xx,
            Some("gt") => Condition::Gt,
            Some("lt") => Condition::Lt,
            Some(other) => {
                let other: String = other.chars().take(QUOTE_BYTES_MAX).collect();
                return Err(ApiError::new(
                    StatusCode::BAD_REQUEST,
                    codes::INVALID_BODY,
                    format!("when must be one of \"nx\", \"xx\", \"gt\", \"lt\" (got {other:?})"),
                ));
            }
        };
        Ok((at, cond))
    }
}

/// `limit`: a window the counter keeps and the most it may hold.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct LimitBody {
    /// A duration such as `"1m"`, one of the counter's `windows`.
    pub window: String,
    /// The most the window may hold, at least 1.
    pub max: u64,
}

/// `shards`: a number, or a word (only `"auto"` is accepted, by the engine's own
/// error for any other).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ShardsField {
    /// A fixed count.
    Count(u64),
    /// `"auto"`.
    Word(String),
}

fn narrow<T: TryFrom<u64>>(
    field: &'static str,
    v: Option<u64>,
    min: u64,
    max: u64,
) -> Result<Option<T>, TallyError> {
    v.map(|got| {
        T::try_from(got).map_err(|_| {
            TallyError::InvalidSpec(tally_core::spec::SpecError::OutOfRange { field, min, max, got })
        })
    })
    .transpose()
}

impl SpecBody {
    /// The namespace these fields declare (`PUT /v1/namespaces/{prefix}`, the node
    /// config's `default_spec`): the spec fields, `shards: "auto"` with its bounds,
    /// and `ttl_ms`. The engine checks it as a creation would.
    pub fn into_namespace(self) -> Result<tally_core::namespace::NamespaceSpec, TallyError> {
        let ttl_ms = self.ttl_ms.map(|t| ttl_ms_in_range("ttl_ms", t).map(|t| t as u64)).transpose()?;
        let (patch, auto) = self.into_patch()?;
        let auto = auto.resolve(None, patch.shards)?;
        Ok(tally_core::namespace::NamespaceSpec { patch, auto, ttl_ms })
    }

    /// The engine's patches (the spec's, and whether the shard count follows
    /// contention); the engine validates the resulting spec as a whole.
    pub fn into_patch(self) -> Result<(SpecPatch, AutoPatch), TallyError> {
        use tally_core::spec::*;
        let (count, auto) = match self.shards {
            None => (None, false),
            Some(ShardsField::Count(n)) => (Some(n), false),
            Some(ShardsField::Word(w)) if w == "auto" => (None, true),
            Some(ShardsField::Word(w)) => {
                return Err(TallyError::InvalidSpec(SpecError::UnknownWord {
                    field: "shards",
                    found: w.chars().take(64).collect(),
                    expected: &["auto"],
                }))
            }
        };
        let auto = AutoPatch {
            auto,
            min_shards: narrow("min_shards", self.min_shards, SHARDS_MIN.into(), SHARDS_MAX.into())?,
            max_shards: narrow("max_shards", self.max_shards, SHARDS_MIN.into(), SHARDS_MAX.into())?,
        };
        let spec = SpecPatch {
            shards: narrow("shards", count, SHARDS_MIN.into(), SHARDS_MAX.into())?,
            durability: self.durability.map(|s| s.parse::<Durability>()).transpose()?,
            flush_ms: narrow("flush_ms", self.flush_ms, FLUSH_MS_MIN.into(), FLUSH_MS_MAX.into())?,
            rollup_ms: narrow("rollup_ms", self.rollup_ms, 0, ROLLUP_MS_MAX.into())?,
            router: self.router.map(|s| s.parse::<RouterPolicy>()).transpose()?,
            distinct: self.distinct,
            dedup_window_s: narrow("dedup_window_s", self.dedup_window_s, 0, DEDUP_WINDOW_S_MAX.into())?,
            frequency: self.frequency,
            windows: self
                .windows
                .as_deref()
                .map(tally_core::window::WindowSet::parse)
                .transpose()
                .map_err(SpecError::from)?,
            min: self.min,
            max: self.max,
            limit: self.limit.map(|l| WindowLimit::parse(&l.window, l.max)).transpose()?,
            replicas: narrow("replicas", self.replicas, 1, tally_core::ranges::REPLICAS_MAX.into())?,
        };
        Ok((spec, auto))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn raw(text: &str) -> Box<RawValue> {
        serde_json::from_str(text).expect("valid JSON")
    }

    #[test]
    fn json_int_reads_exact_integers_and_refuses_the_rest() {
        assert_eq!(json_int(&raw("12")), Ok(Some(12)));
        assert_eq!(json_int(&raw("-7")), Ok(Some(-7)));
        assert_eq!(json_int(&raw("170141183460469231731687303715884105727")), Ok(Some(i128::MAX)));
        assert_eq!(json_int(&raw("170141183460469231731687303715884105728")), Err(IntError::TooLarge));
        assert_eq!(json_int(&raw("null")), Ok(None));
        assert_eq!(json_int(&raw("1.5")), Err(IntError::NotAnInteger));
        assert_eq!(json_int(&raw("1e3")), Err(IntError::NotAnInteger));
        assert_eq!(json_int(&raw("1.0")), Err(IntError::NotAnInteger));
        assert_eq!(json_int(&raw("\"1\"")), Err(IntError::NotANumber("a string")));
        assert_eq!(json_int(&raw("[1]")), Err(IntError::NotANumber("an array")));
        assert_eq!(json_int(&raw("{}")), Err(IntError::NotANumber("an object")));
        assert_eq!(json_int(&raw("true")), Err(IntError::NotANumber("a boolean")));
    }

    #[test]
    fn deltas_are_64_bit_and_out_of_range_is_422() {
        assert_eq!(delta_of(Some(&raw("9223372036854775807"))), Ok(i64::MAX));
        assert_eq!(delta_of(Some(&raw("-9223372036854775808"))), Ok(i64::MIN));
        for big in ["9223372036854775808", "-9223372036854775809", &"9".repeat(200)] {
            let e = delta_of(Some(&raw(big))).expect_err("out of range");
            assert_eq!((e.status, e.code.as_ref()), (StatusCode::UNPROCESSABLE_ENTITY, codes::OUT_OF_RANGE));
            assert!(e.message.len() < 200, "{}", e.message);
        }
        assert_eq!(delta_of(None).expect_err("missing").code, codes::INVALID_DELTA);
        assert_eq!(delta_of(Some(&raw("0"))), Ok(0), "zero is the engine's to refuse");
    }

    #[test]
    fn batch_len_counts_without_building_items() {
        assert_eq!(batch_len(br#"{"increments": [1, {"a": [2]}, "x"]}"#), Some(3));
        assert_eq!(batch_len(br#"{"increments": []}"#), Some(0));
        assert_eq!(batch_len(br#"{"increments": 3}"#), None);
        assert_eq!(batch_len(b"{"), None);
    }

    #[test]
    fn spec_numbers_beyond_their_type_are_invalid_spec() {
        let e = SpecBody { shards: Some(ShardsField::Count(70_000)), ..Default::default() }
            .into_patch()
            .expect_err("too many");
        assert_eq!((e.code(), e.http_status()), ("invalid_spec", 422));
        let e = SpecBody { durability: Some("fast".into()), ..Default::default() }
            .into_patch()
            .expect_err("word");
        assert_eq!(e.code(), "invalid_spec");
        let (p, auto) = SpecBody {
            shards: Some(ShardsField::Count(4)),
            router: Some("round_robin".into()),
            ..Default::default()
        }
        .into_patch()
        .expect("valid");
        assert_eq!((p.shards, p.router), (Some(4), Some(tally_engine::RouterPolicy::RoundRobin)));
        assert!(auto.is_empty());
    }

    #[test]
    fn shards_is_a_number_or_auto_with_bounds() {
        let body: SpecBody =
            serde_json::from_str(r#"{"shards": "auto", "min_shards": 2, "max_shards": 32}"#).unwrap();
        let (p, auto) = body.into_patch().unwrap();
        assert_eq!(p.shards, None);
        assert_eq!(auto, AutoPatch { auto: true, min_shards: Some(2), max_shards: Some(32) });
        let body: SpecBody = serde_json::from_str(r#"{"shards": "many"}"#).unwrap();
        assert_eq!(body.into_patch().unwrap_err().code(), "invalid_spec");
        let body: SpecBody = serde_json::from_str(r#"{"shards": "auto", "max_shards": 70000}"#).unwrap();
        assert_eq!(body.into_patch().unwrap_err().http_status(), 422);
        assert!(serde_json::from_str::<SpecBody>(r#"{"shards": true}"#).is_err());
    }

    #[test]
    fn content_types() {
        let mut h = HeaderMap::new();
        assert!(!is_json(&h));
        for (v, ok) in [
            ("application/json", true),
            ("Application/JSON; charset=utf-8", true),
            ("application/merge-patch+json", true),
            ("text/plain", false),
            ("application/x-www-form-urlencoded", false),
        ] {
            h.insert(header::CONTENT_TYPE, v.parse().expect("header"));
            assert_eq!(is_json(&h), ok, "{v}");
        }
    }
}
