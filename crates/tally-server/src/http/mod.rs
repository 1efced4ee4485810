//! The public HTTP/JSON interface (DESIGN.md, "Public interface"), over any
//! [`Service`].
//!
//! | method and path | handler |
//! | --- | --- |
//! | `PUT /v1/counters/{name}` | `put_counter`: 201 created / 200 updated, with the counter |
//! | `GET /v1/counters/{name}` | `get_counter`: the spec and a summary |
//! | `DELETE /v1/counters/{name}` | `delete_counter`: 204 |
//! | `POST /v1/counters/{name}/increments` | `incr`: `{"applied": true}` |
//! | `POST /v1/increments` | `incr_many`: `{"results": [...]}`, one per item |
//! | `GET /v1/counters/{name}/value` | `value`: `?consistency=cached\|fresh`, or `?window=1h` |
//! | `GET /v1/counters/{name}/distinct` | `distinct`, or `?window=24h` |
//! | `GET /v1/counters/{name}/frequency` | `frequency`: `?item=X`, the estimate and its bound |
//! | `GET /v1/counters/{name}/top` | `top`: `?k=10`, the heaviest items |
//! | `GET /v1/counters/{name}/shards` | `shards` |
//! | `GET`, `PUT`, `DELETE /v1/counters/{name}/expiry` | `get_expiry`, `put_expiry`, `delete_expiry`: the deadline, as `TTL`, `EXPIRE`, `PERSIST` |
//! | `POST /v1/counters/{name}/reconcile` | `reconcile` (recorded as a run of source `request`) |
//! | `PUT`, `GET`, `DELETE /v1/namespaces/{prefix}`, `GET /v1/namespaces` | `put_namespace` (201/200), `get_namespace`, `delete_namespace` (204), `list_namespaces`: the spec counters created implicitly under a prefix take |
//! | `GET /v1/counters/{name}/reconciliations` | `reconciliations`: the recent runs on this node |
//! | `GET /v1/cluster` | `cluster` |
//! | `PUT /v1/cluster/members/{id}` | `add_member`: the cluster after adding the node |
//! | `DELETE /v1/cluster/members/{id}` | `remove_member`: the cluster after removing it |
//! | `POST /v1/cluster/nodes/{id}/accept-loss` | `accept_loss`: the cluster after accepting that the node's replaced disk lost its data |
//! | `GET /v1/counters` | `ops::list`: `?prefix=&limit=&cursor=`, one page of names |
//! | `GET /v1/stats` | `ops::stats`: the busiest counters and read latency |
//! | `GET /v1/openapi.json` | `ops::openapi`: the OpenAPI 3.1 document |
//! | `GET /ui` | `ops::ui_page`: the status page (and `/ui/app.js`, `/ui/app.css`) |
//! | `GET /metrics` | `metrics`: Prometheus text |
//! | `GET /healthz` | `healthz`: 200 while the node serves |
//!
//! Every request first passes through [`browser`]: a `Host` the node answers to,
//! no write from a web page of another origin, a JSON body on every `POST`.
//! Every matched route also passes through [`access`]: the client's token, its
//! scopes and prefixes (see that module's table), and the audit of admin
//! operations. With no tokens configured every request is let through.
//!
//! Every request passes through one guard (`guard`) that bounds its time, turns a
//! panic into a 500, rewrites any error answer that is not yet JSON (axum's own
//! 404/405 and rejections) into the [`ApiError`] shape, opens its tracing span and
//! records its status and latency. Bodies are read by [`body`]'s extractors, which
//! enforce the size limit and the content type.

pub mod access;
pub mod body;
pub mod browser;
pub mod error;
pub mod ops;

use crate::auth::{authorize, Attempt, AuthError, Gate, Resource, Scope};
use crate::config::HttpConfig;
use crate::metrics::{HttpStats, PromWriter, CONTENT_TYPE as METRICS_CONTENT_TYPE};
use crate::service::{ClusterView, Service};
use crate::sources::RunRecord;
use access::Caller;
use axum::extract::rejection::QueryRejection;
use axum::extract::{Extension, FromRequestParts, Path, Query, Request, State};
use axum::http::request::Parts;
use axum::http::{header, HeaderMap, HeaderValue, Method, StatusCode};
use axum::middleware::{self, Next};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post, put};
use axum::{Json, Router};
use body::{read_batch, BodyContext, IncrementBody, JsonBody, OptionalJsonBody, ReconcileBody, SpecBody};
use error::{codes, ApiError, ErrorBody};
use futures::FutureExt;
use serde::{Deserialize, Serialize};
use std::panic::AssertUnwindSafe;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;
use std::time::Instant;
use tally_engine::{
    Consistency, CounterInfo, DistinctRead, FrequencyRead, IncrOutcome, ReconcileReport, ShardsReport,
    TallyError, TopRead, ValueRead,
};
use tracing::{field, Instrument};

/// Longest text of a non-JSON error answer kept as the message when rewriting it.
const ERROR_TEXT_BYTES_MAX: usize = 1024;

/// What the guard and the handlers share.
struct Shared {
    /// The limits requests run under.
    limits: HttpConfig,
    /// Responses and latency, exported on `/metrics`.
    stats: HttpStats,
    /// Samples of per-counter writes for `GET /v1/stats`.
    rates: ops::RateBook,
    /// Client authentication, shared with every other listener of the node.
    gate: Arc<Gate>,
}

/// The router's state: the service and the shared limits and signals.
struct AppStateInner<S> {
    svc: S,
    shared: Arc<Shared>,
}

/// [`AppStateInner`] behind one reference count: axum clones the state into every
/// request, and a service is several `Arc`s (each clone and drop an atomic write to a
/// cache line every core shares), so a request pays one count instead of all of them.
struct AppState<S>(Arc<AppStateInner<S>>);

impl<S> std::ops::Deref for AppState<S> {
    type Target = AppStateInner<S>;
    fn deref(&self) -> &AppStateInner<S> {
        &self.0
    }
}

// Derived `Clone` would require `S: Clone`.
impl<S> Clone for AppState<S> {
    fn clone(&self) -> Self {
        Self(self.0.clone())
    }
}

/// The public interface over `svc`, with the limits of `limits`, open to every
/// client (no tokens). Serve it with [`crate::serve`] (which also enforces the
/// header-read timeout and connection limit) or drive it directly with
/// `tower::ServiceExt::oneshot` in tests.
pub fn router<S: Service>(svc: S, limits: &HttpConfig) -> Router {
    router_with_gate(svc, limits, Arc::new(Gate::open()))
}

/// [`router`] with client authentication by `gate` (see [`access`]).
pub fn router_with_gate<S: Service>(svc: S, limits: &HttpConfig, gate: Arc<Gate>) -> Router {
    let shared = Arc::new(Shared {
        limits: limits.clone(),
        stats: HttpStats::default(),
        rates: ops::RateBook::default(),
        gate: gate.clone(),
    });
    let state = AppState(Arc::new(AppStateInner { svc, shared: shared.clone() }));
    Router::new()
        .route("/v1/counters", get(list_counters::<S>))
        .route("/v1/stats", get(stats::<S>))
        .route("/v1/openapi.json", get(ops::openapi))
        .route("/ui", get(ops::ui_page))
        .route("/ui/", get(ops::ui_page))
        .route("/ui/app.js", get(ops::ui_script))
        .route("/ui/app.css", get(ops::ui_styles))
        .route("/v1/counters/{name}", put(put_counter::<S>).get(get_counter::<S>).delete(delete_counter::<S>))
        .route("/v1/counters/{name}/increments", post(incr::<S>))
        .route("/v1/increments", post(incr_many::<S>))
        .route("/v1/counters/{name}/value", get(value::<S>))
        .route("/v1/counters/{name}/distinct", get(distinct::<S>))
        .route("/v1/counters/{name}/frequency", get(frequency::<S>))
        .route("/v1/counters/{name}/top", get(top::<S>))
        .route("/v1/counters/{name}/shards", get(shards::<S>))
        .route(
            "/v1/counters/{name}/expiry",
            put(put_expiry::<S>).get(get_expiry::<S>).delete(delete_expiry::<S>),
        )
        .route("/v1/counters/{name}/reconcile", post(reconcile::<S>))
        .route("/v1/namespaces", get(list_namespaces::<S>))
        .route(
            "/v1/namespaces/{prefix}",
            put(put_namespace::<S>).get(get_namespace::<S>).delete(delete_namespace::<S>),
        )
        .route("/v1/counters/{name}/reconciliations", get(reconciliations::<S>))
        .route("/v1/cluster", get(cluster::<S>))
        .route("/v1/cluster/members/{id}", put(add_member::<S>).delete(remove_member::<S>))
        .route("/v1/cluster/nodes/{id}/accept-loss", post(accept_loss::<S>))
        .route("/metrics", get(metrics::<S>))
        .route("/healthz", get(healthz::<S>))
        .route_layer(middleware::from_fn_with_state((gate, limits.metrics_public), access::access))
        .fallback(not_found)
        .with_state(state)
        .layer(middleware::from_fn_with_state(
            Arc::new(browser::BrowserPolicy::new(&limits.allowed_hosts)),
            browser::guard,
        ))
        .layer(middleware::from_fn_with_state(shared, guard))
}

/// A counter name from the path: the bytes its percent-encoding stands for (any
/// bytes: spaces, `/` as `%2F`, `@`, `{…}`, UTF-8, `%FF`), held in its escaped form
/// (`tally_core::name`), the one RESP keys take too, so both fronts reach the same
/// counter. Names it in the request's span.
pub struct CounterPath(pub String);

impl<S: Send + Sync> FromRequestParts<S> for CounterPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        let raw = raw_segment(parts, "counters")?;
        let name = tally_core::name::CounterName::from_bytes(&raw)
            .map_err(|e| ApiError::from(tally_engine::TallyError::InvalidName(e)))?;
        tracing::Span::current().record("counter", name.as_str());
        Ok(Self(name.into()))
    }
}

/// The bytes of the path segment after `/v1/{collection}/`, percent-decoded from
/// the request's own path: the router decodes parameters to UTF-8 text only, and a
/// name may be any bytes.
pub(crate) fn raw_segment(parts: &Parts, collection: &str) -> Result<Vec<u8>, ApiError> {
    let bad = |message: String| ApiError::new(StatusCode::BAD_REQUEST, codes::INVALID_PATH, message);
    let mut segments = parts.uri.path().split('/');
    let segment = match (segments.next(), segments.next(), segments.next(), segments.next()) {
        (Some(""), Some("v1"), Some(c), Some(segment)) if c == collection => segment,
        _ => return Err(bad(format!("the path has no /v1/{collection}/ segment"))),
    };
    tally_core::name::percent_decode(segment).map_err(|e| bad(e.to_string()))
}

/// `PUT /v1/counters/{name}`: creates (201) or updates (200) the counter and answers
/// with it. An empty body creates a counter with the defaults; `ttl_ms` sets its
/// deadline that long from now.
#[tracing::instrument(level = "debug", name = "put_counter", skip_all)]
async fn put_counter<S: Service>(
    State(st): State<AppState<S>>,
    CounterPath(name): CounterPath,
    OptionalJsonBody(spec): OptionalJsonBody<SpecBody>,
) -> Result<Response, ApiError> {
    let ttl = spec.ttl_ms.map(|t| body::ttl_ms_in_range("ttl_ms", t)).transpose()?;
    let (patch, auto) = spec.into_patch()?;
    let mut outcome = st.svc.put_counter(&name, patch, auto).await?;
    outcome.counter.name = tally_core::name::shown(&outcome.counter.name);
    if let Some(ttl) = ttl {
        let at = st.svc.engine().now_ms().saturating_add(ttl as u64);
        st.svc.expire(&name, at, tally_core::expiry::Condition::Always).await?;
        outcome.counter.expires_at_ms = Some(at);
    }
    if !outcome.created {
        return Ok(Json(outcome.counter).into_response());
    }
    let mut response = (StatusCode::CREATED, Json(outcome.counter)).into_response();
    if let Ok(location) = HeaderValue::from_str(&format!("/v1/counters/{name}")) {
        response.headers_mut().insert(header::LOCATION, location);
    }
    Ok(response)
}

/// `GET /v1/counters?prefix=P&limit=N&cursor=C`: one page of counter names.
#[tracing::instrument(level = "debug", name = "list_counters", skip_all)]
async fn list_counters<S: Service>(
    State(st): State<AppState<S>>,
    Extension(Caller(caller)): Extension<Caller>,
    query: Result<Query<ops::ListQuery>, QueryRejection>,
) -> Result<Json<tally_engine::CounterPage>, ApiError> {
    ops::list(&st.svc, &caller, query).await
}

/// `GET /v1/stats?limit=N`: this node's busiest counters and read latency.
#[tracing::instrument(level = "debug", name = "stats", skip_all)]
async fn stats<S: Service>(
    State(st): State<AppState<S>>,
    Extension(Caller(caller)): Extension<Caller>,
    query: Result<Query<ops::StatsQuery>, QueryRejection>,
) -> Result<Json<ops::StatsView>, ApiError> {
    ops::stats(&st.svc, &st.shared.rates, &caller, query).await
}

/// `GET /v1/counters/{name}`: the spec and a summary; 404 if unknown.
#[tracing::instrument(level = "debug", name = "get_counter", skip_all)]
async fn get_counter<S: Service>(
    State(st): State<AppState<S>>,
    CounterPath(name): CounterPath,
) -> Result<Json<CounterInfo>, ApiError> {
    let mut info = st.svc.counter(&name).await?;
    info.name = tally_core::name::shown(&info.name);
    Ok(Json(info))
}

/// `DELETE /v1/counters/{name}`: 204; 404 if unknown.
#[tracing::instrument(level = "debug", name = "delete_counter", skip_all)]
async fn delete_counter<S: Service>(
    State(st): State<AppState<S>>,
    CounterPath(name): CounterPath,
) -> Result<StatusCode, ApiError> {
    st.svc.delete_counter(&name).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `POST /v1/counters/{name}/increments`: `{"applied": true}` or
/// `{"applied": false, "duplicate": true}`.
#[tracing::instrument(level = "debug", name = "incr", skip_all)]
async fn incr<S: Service>(
    State(st): State<AppState<S>>,
    CounterPath(name): CounterPath,
    JsonBody(body): JsonBody<IncrementBody>,
) -> Result<Json<IncrOutcome>, ApiError> {
    let inc = body.into_increment()?;
    Ok(Json(st.svc.incr(&name, inc).await?))
}

/// One result of a batch: the outcome or the item's error.
#[derive(Debug, Serialize, Deserialize)]
#[serde(untagged)]
pub enum ItemResult {
    /// The item was counted (or recognized as a duplicate).
    Ok(IncrOutcome),
    /// The item failed; the others are unaffected.
    Err(ErrorBody),
}

/// The answer of `POST /v1/increments`.
#[derive(Debug, Serialize, Deserialize)]
pub struct BatchResults {
    /// One result per item, in the order sent.
    pub results: Vec<ItemResult>,
}

/// `POST /v1/increments`: one result per item, in order. A batch larger than
/// `http.batch_items_max` is refused whole (413), as is one with a malformed delta.
/// An item whose counter is outside the token's prefixes fails alone (`forbidden`).
#[tracing::instrument(level = "debug", name = "incr_many", skip_all, fields(items = field::Empty))]
async fn incr_many<S: Service>(
    State(st): State<AppState<S>>,
    Extension(Caller(caller)): Extension<Caller>,
    req: Request,
) -> Result<Json<BatchResults>, ApiError> {
    let body = read_batch(req, st.shared.limits.batch_limit_items()).await?;
    tracing::Span::current().record("items", body.increments.len());
    let items = body.into_items()?;
    // Items the token may not touch are answered here; the others go on together.
    // One audit event and one metric update for all of them (see `Gate::refused_items`).
    let mut results: Vec<Option<ItemResult>> = Vec::with_capacity(items.len());
    let mut allowed = Vec::with_capacity(items.len());
    let mut first_refusal: Option<(AuthError, String)> = None;
    let mut refused_items = 0u64;
    for (name, inc) in items {
        match authorize(&caller, Scope::Write, Resource::Counter(&name)) {
            Ok(()) => {
                results.push(None);
                allowed.push((name, inc));
            }
            Err(e) => {
                let refused = ApiError::new(StatusCode::FORBIDDEN, codes::FORBIDDEN, e.to_string());
                results.push(Some(ItemResult::Err(refused.body())));
                refused_items += 1;
                first_refusal.get_or_insert((e, name));
            }
        }
    }
    if let Some((e, name)) = &first_refusal {
        let attempt =
            Attempt { transport: "http", op: "POST /v1/increments", counter: Some(name), node: None };
        st.shared.gate.refused_items(e, &attempt, refused_items);
    }
    // Every item refused: nothing for the engine (an empty batch still goes to it,
    // which judges that one as before).
    let all_refused = allowed.is_empty() && refused_items > 0;
    let mut answered = if all_refused { Vec::new() } else { st.svc.incr_many(allowed).await? }.into_iter();
    let results = results
        .into_iter()
        .map(|slot| match slot {
            Some(refused) => refused,
            None => match answered.next() {
                Some(Ok(outcome)) => ItemResult::Ok(outcome),
                Some(Err(e)) => ItemResult::Err(ApiError::from(e).body()),
                None => ItemResult::Err(
                    ApiError::new(
                        StatusCode::INTERNAL_SERVER_ERROR,
                        codes::INTERNAL,
                        "no result for this item",
                    )
                    .body(),
                ),
            },
        })
        .collect();
    Ok(Json(BatchResults { results }))
}

/// The query of a value read.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ReadQuery {
    /// `cached` (default) or `fresh`.
    pub consistency: Option<String>,
    /// One of the counter's windows (`1m`, `1h`, …): the sliding window's total,
    /// always fresh.
    pub window: Option<String>,
}

/// `GET /v1/counters/{name}/value?consistency=cached|fresh`; 404 if unknown. With
/// `?window=1h`, the sliding window's total with its bucket granularity.
#[tracing::instrument(level = "debug", name = "value", skip_all)]
async fn value<S: Service>(
    State(st): State<AppState<S>>,
    CounterPath(name): CounterPath,
    query: Result<Query<ReadQuery>, QueryRejection>,
) -> Result<axum::response::Response, ApiError> {
    use axum::response::IntoResponse;
    let bad = |m: String| ApiError::new(StatusCode::BAD_REQUEST, codes::INVALID_QUERY, m);
    let Query(query) = query.map_err(|e| bad(e.body_text()))?;
    if let Some(window) = query.window {
        if query.consistency.as_deref().is_some_and(|c| c != "fresh") {
            return Err(bad("a window read is always fresh: drop consistency, or give fresh".into()));
        }
        return Ok(Json(st.svc.window(&name, &window).await?).into_response());
    }
    let consistency = match query.consistency.as_deref() {
        None | Some("cached") => Consistency::Cached,
        Some("fresh") => Consistency::Fresh,
        Some(other) => {
            let other: String = other.chars().take(64).collect();
            return Err(bad(format!("consistency must be \"cached\" or \"fresh\" (got {other:?})")));
        }
    };
    let read = st.svc.read(&name, consistency).await?;
    if consistency == Consistency::Cached {
        st.shared.stats.cached_staleness_ms.record(read.staleness_ms);
    }
    Ok(Json::<ValueRead>(read).into_response())
}

/// The query of a distinct read.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct DistinctQuery {
    /// One of the counter's windows: the members of the sliding window.
    pub window: Option<String>,
}

/// `GET /v1/counters/{name}/distinct`: the distinct-member estimate. With
/// `?window=24h`, the sliding window's estimate (and total) with its bucket
/// granularity.
#[tracing::instrument(level = "debug", name = "distinct", skip_all)]
async fn distinct<S: Service>(
    State(st): State<AppState<S>>,
    CounterPath(name): CounterPath,
    query: Result<Query<DistinctQuery>, QueryRejection>,
) -> Result<axum::response::Response, ApiError> {
    use axum::response::IntoResponse;
    let bad = |m: String| ApiError::new(StatusCode::BAD_REQUEST, codes::INVALID_QUERY, m);
    let Query(query) = query.map_err(|e| bad(e.body_text()))?;
    if let Some(window) = query.window {
        return Ok(Json(st.svc.window(&name, &window).await?).into_response());
    }
    Ok(Json::<DistinctRead>(st.svc.distinct(&name).await?).into_response())
}

/// The query of a frequency read.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct FrequencyQuery {
    /// The item whose frequency is asked for.
    pub item: Option<String>,
}

/// `GET /v1/counters/{name}/frequency?item=X`: the item's estimate, error bound and
/// confidence, merged over every shard.
#[tracing::instrument(level = "debug", name = "frequency", skip_all)]
async fn frequency<S: Service>(
    State(st): State<AppState<S>>,
    CounterPath(name): CounterPath,
    query: Result<Query<FrequencyQuery>, QueryRejection>,
) -> Result<Json<FrequencyRead>, ApiError> {
    let bad = |m: String| ApiError::new(StatusCode::BAD_REQUEST, codes::INVALID_QUERY, m);
    let Query(query) = query.map_err(|e| bad(e.body_text()))?;
    let Some(item) = query.item else { return Err(bad("the query needs item=ITEM".into())) };
    Ok(Json(st.svc.frequency(&name, &item).await?))
}

/// Items a top read answers when `k` is not given.
pub const TOP_K_DEFAULT: u32 = 10;

/// The query of a top-k read.
#[derive(Debug, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct TopQuery {
    /// How many items (default [`TOP_K_DEFAULT`], at most
    /// `tally_core::frequency::TOP_K_MAX`).
    pub k: Option<String>,
}

/// `GET /v1/counters/{name}/top?k=10`: the heaviest items with their estimates.
#[tracing::instrument(level = "debug", name = "top", skip_all)]
async fn top<S: Service>(
    State(st): State<AppState<S>>,
    CounterPath(name): CounterPath,
    query: Result<Query<TopQuery>, QueryRejection>,
) -> Result<Json<TopRead>, ApiError> {
    let bad = |m: String| ApiError::new(StatusCode::BAD_REQUEST, codes::INVALID_QUERY, m);
    let Query(query) = query.map_err(|e| bad(e.body_text()))?;
    let k = match query.k.as_deref() {
        None => TOP_K_DEFAULT,
        Some(text) => text.parse::<u32>().map_err(|_| {
            let text: String = text.chars().take(64).collect();
            bad(format!(
                "k must be a whole number from 1 to {} (got {text:?})",
                tally_core::frequency::TOP_K_MAX
            ))
        })?,
    };
    Ok(Json(st.svc.top(&name, k).await?))
}

/// `GET /v1/counters/{name}/shards`: per-shard values and skew.
#[tracing::instrument(level = "debug", name = "shards", skip_all)]
async fn shards<S: Service>(
    State(st): State<AppState<S>>,
    CounterPath(name): CounterPath,
) -> Result<Json<ShardsReport>, ApiError> {
    Ok(Json(st.svc.shards(&name).await?))
}

/// When a counter expires: its deadline and what is left of it.
#[derive(Debug, Serialize, Deserialize)]
pub struct ExpiryView {
    /// The deadline in milliseconds since the Unix epoch; `null` for never.
    pub expires_at_ms: Option<u64>,
    /// Milliseconds left, or -1 for never (as `PTTL`).
    pub ttl_ms: i64,
    /// `PUT`: whether the deadline was set (false when `when` kept the current one);
    /// `DELETE`: whether there was one to remove. Absent on `GET`.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub changed: Option<bool>,
}

async fn expiry_view<S: Service>(svc: &S, name: &str, changed: Option<bool>) -> Result<ExpiryView, ApiError> {
    let (at, now) = svc.expiry(name).await?;
    Ok(ExpiryView { expires_at_ms: at, ttl_ms: tally_core::expiry::remaining(at, now).millis(), changed })
}

/// `GET /v1/counters/{name}/expiry`: the counter's deadline (404 if it does not
/// exist, or expired).
#[tracing::instrument(level = "debug", name = "get_expiry", skip_all)]
async fn get_expiry<S: Service>(
    State(st): State<AppState<S>>,
    CounterPath(name): CounterPath,
) -> Result<Json<ExpiryView>, ApiError> {
    Ok(Json(expiry_view(&st.svc, &name, None).await?))
}

/// `PUT /v1/counters/{name}/expiry` with `{"ttl_ms": N}` or `{"expires_at_ms": T}`
/// (and `"when": "nx"|"xx"|"gt"|"lt"`): sets the deadline, as `EXPIRE` does. A
/// deadline already passed deletes the counter at once and answers
/// `{"expires_at_ms": T, "ttl_ms": 0, "changed": true}`.
#[tracing::instrument(level = "debug", name = "put_expiry", skip_all)]
async fn put_expiry<S: Service>(
    State(st): State<AppState<S>>,
    CounterPath(name): CounterPath,
    JsonBody(body): JsonBody<body::ExpiryBody>,
) -> Result<Json<ExpiryView>, ApiError> {
    let now = st.svc.engine().now_ms();
    let (at, when) = body.deadline(now)?;
    let changed = st.svc.expire(&name, at, when).await?;
    if changed && at <= now {
        return Ok(Json(ExpiryView { expires_at_ms: Some(at), ttl_ms: 0, changed: Some(true) }));
    }
    Ok(Json(expiry_view(&st.svc, &name, Some(changed)).await?))
}

/// `DELETE /v1/counters/{name}/expiry`: removes the deadline, as `PERSIST` does.
#[tracing::instrument(level = "debug", name = "delete_expiry", skip_all)]
async fn delete_expiry<S: Service>(
    State(st): State<AppState<S>>,
    CounterPath(name): CounterPath,
) -> Result<Json<ExpiryView>, ApiError> {
    let removed = st.svc.persist(&name).await?;
    Ok(Json(expiry_view(&st.svc, &name, Some(removed)).await?))
}

/// A namespace as the API shows it.
#[derive(Debug, Serialize, Deserialize)]
pub struct NamespaceView {
    /// The name prefix.
    pub prefix: String,
    /// The spec fields it sets (those it does not name take the defaults).
    pub spec: tally_core::spec::SpecPatch,
    /// `shards: "auto"`'s bounds, if its counters follow contention.
    pub auto: Option<tally_core::spec::AutoShards>,
    /// How long after creation its counters expire, if they do.
    pub ttl_ms: Option<u64>,
}

impl NamespaceView {
    fn of(prefix: &str, n: &tally_core::namespace::NamespaceSpec) -> Self {
        Self { prefix: tally_core::name::shown(prefix), spec: n.patch, auto: n.auto, ttl_ms: n.ttl_ms }
    }
}

/// `GET /v1/namespaces`: every namespace.
#[derive(Debug, Serialize, Deserialize)]
pub struct NamespacesView {
    /// The namespaces, by prefix in byte order.
    pub namespaces: Vec<NamespaceView>,
}

/// A namespace prefix from the path (percent-decoded, in its escaped form).
struct PrefixPath(String);

impl<S: Send + Sync> FromRequestParts<S> for PrefixPath {
    type Rejection = ApiError;

    async fn from_request_parts(parts: &mut Parts, _state: &S) -> Result<Self, ApiError> {
        Ok(Self(tally_core::name::escape(&raw_segment(parts, "namespaces")?)))
    }
}

/// `PUT /v1/namespaces/{prefix}` with the fields of `PUT /v1/counters/{name}`
/// (`ttl_ms` included): counters created implicitly under the prefix from now on
/// take them. 201 created, 200 replaced.
#[tracing::instrument(level = "debug", name = "put_namespace", skip_all)]
async fn put_namespace<S: Service>(
    State(st): State<AppState<S>>,
    PrefixPath(prefix): PrefixPath,
    OptionalJsonBody(spec): OptionalJsonBody<SpecBody>,
) -> Result<Response, ApiError> {
    let spec = spec.into_namespace()?;
    let created = st.svc.put_namespace(&prefix, spec).await?;
    let status = if created { StatusCode::CREATED } else { StatusCode::OK };
    Ok((status, Json(NamespaceView::of(&prefix, &spec))).into_response())
}

/// `GET /v1/namespaces/{prefix}`: the namespace; 404 `namespace_not_found`.
#[tracing::instrument(level = "debug", name = "get_namespace", skip_all)]
async fn get_namespace<S: Service>(
    State(st): State<AppState<S>>,
    PrefixPath(prefix): PrefixPath,
) -> Result<Json<NamespaceView>, ApiError> {
    let spec = st.svc.engine().namespace(&prefix)?;
    Ok(Json(NamespaceView::of(&prefix, &spec)))
}

/// `DELETE /v1/namespaces/{prefix}`: 204; counters created under it keep their specs.
#[tracing::instrument(level = "debug", name = "delete_namespace", skip_all)]
async fn delete_namespace<S: Service>(
    State(st): State<AppState<S>>,
    PrefixPath(prefix): PrefixPath,
) -> Result<StatusCode, ApiError> {
    st.svc.delete_namespace(&prefix).await?;
    Ok(StatusCode::NO_CONTENT)
}

/// `GET /v1/namespaces`: every namespace (at most `NAMESPACES_MAX`).
#[tracing::instrument(level = "debug", name = "list_namespaces", skip_all)]
async fn list_namespaces<S: Service>(
    State(st): State<AppState<S>>,
) -> Result<Json<NamespacesView>, ApiError> {
    let all = st.svc.engine().namespaces()?;
    Ok(Json(NamespacesView { namespaces: all.iter().map(|(p, n)| NamespaceView::of(p, n)).collect() }))
}

/// `POST /v1/counters/{name}/reconcile` with `{"authoritative": N}`.
#[tracing::instrument(level = "debug", name = "reconcile", skip_all)]
async fn reconcile<S: Service>(
    State(st): State<AppState<S>>,
    CounterPath(name): CounterPath,
    JsonBody(body): JsonBody<ReconcileBody>,
) -> Result<Json<ReconcileReport>, ApiError> {
    let authoritative = body.authoritative()?;
    Ok(Json(crate::service::reconcile_recorded(&st.svc, &name, authoritative).await?))
}

/// What a token without `admin` on the counter reads instead of a source's error.
pub const REDACTED_SOURCE_ERROR: &str =
    "the source failed; why is shown to admin tokens and in the node's log (it may name hosts, users or files)";

/// The answer of `GET /v1/counters/{name}/reconciliations`.
#[derive(Debug, Serialize)]
struct ReconciliationsView {
    /// The counter, as the client gave it (`tally_core::name::shown`).
    counter: String,
    /// The node whose record this is (scheduled runs are on the one that ran them).
    node: String,
    /// The recent runs, newest first, at most `RUNS_PER_COUNTER_MAX`.
    runs: Vec<RunRecord>,
}

/// `GET /v1/counters/{name}/reconciliations`: the recent reconciliations of the
/// counter this node ran, newest first.
#[tracing::instrument(level = "debug", name = "reconciliations", skip_all)]
async fn reconciliations<S: Service>(
    State(st): State<AppState<S>>,
    Extension(Caller(caller)): Extension<Caller>,
    CounterPath(name): CounterPath,
) -> Result<Json<ReconciliationsView>, ApiError> {
    tally_core::CounterName::new(name.as_str()).map_err(TallyError::from)?;
    let mut runs = st.svc.runs().runs(&name);
    // A source's error may name its hosts, users, files or database: an admin's to
    // read, not every reader's.
    if authorize(&caller, Scope::Admin, Resource::Counter(&name)).is_err() {
        for run in &mut runs {
            if run.error.is_some() {
                run.error = Some(REDACTED_SOURCE_ERROR.into());
            }
        }
    }
    let counter = tally_core::name::shown(&name);
    Ok(Json(ReconciliationsView { counter, node: st.svc.node_id().to_string(), runs }))
}

/// `GET /v1/cluster`: membership, health and leader.
#[tracing::instrument(level = "debug", name = "cluster", skip_all)]
async fn cluster<S: Service>(State(st): State<AppState<S>>) -> Json<ClusterView> {
    Json(st.svc.cluster().await)
}

/// `PUT /v1/cluster/members/{id}`: the node joins the placement ring; shards move
/// to it in the background (`handoff` lists the nodes still moving them).
#[tracing::instrument(level = "debug", name = "add_member", skip_all)]
async fn add_member<S: Service>(
    State(st): State<AppState<S>>,
    Path(id): Path<String>,
) -> Result<Json<ClusterView>, ApiError> {
    Ok(Json(st.svc.change_membership(&id, true).await?))
}

/// `DELETE /v1/cluster/members/{id}`: the node leaves the placement ring; its
/// shards move to the others. Stop it once `handoff` is empty.
#[tracing::instrument(level = "debug", name = "remove_member", skip_all)]
async fn remove_member<S: Service>(
    State(st): State<AppState<S>>,
    Path(id): Path<String>,
) -> Result<Json<ClusterView>, ApiError> {
    Ok(Json(st.svc.change_membership(&id, false).await?))
}

/// `POST /v1/cluster/nodes/{id}/accept-loss`: the operator accepts that the node's
/// replaced disk lost its shards' earlier values; reads count its shards again.
#[tracing::instrument(level = "debug", name = "accept_loss", skip_all)]
async fn accept_loss<S: Service>(
    State(st): State<AppState<S>>,
    Path(id): Path<String>,
) -> Result<Json<ClusterView>, ApiError> {
    Ok(Json(st.svc.accept_loss(&id).await?))
}

/// `GET /metrics`: the service's signals followed by the HTTP front end's.
async fn metrics<S: Service>(State(st): State<AppState<S>>) -> Response {
    let mut text = st.svc.metrics_text();
    let mut w = PromWriter::new();
    st.shared.stats.write(&mut w);
    st.shared.gate.stats().write(&mut w);
    crate::metrics::listener_refusals(&mut w);
    text.push_str(&w.finish());
    ([(header::CONTENT_TYPE, METRICS_CONTENT_TYPE)], text).into_response()
}

/// The answer of a healthy `GET /healthz`.
#[derive(Debug, Serialize, Deserialize)]
pub struct Health {
    /// Always `"ok"`.
    pub status: String,
}

/// `GET /healthz`: 200 while the node serves, 503 `not_ready` until it is ready
/// (see [`Service::ready`]), 503 `shutting_down` while it drains.
async fn healthz<S: Service>(State(st): State<AppState<S>>) -> Result<Json<Health>, ApiError> {
    if !st.svc.healthy() {
        return Err(TallyError::ShuttingDown.into());
    }
    if !st.svc.ready() {
        return Err(ApiError::new(
            StatusCode::SERVICE_UNAVAILABLE,
            "not_ready",
            "the node is starting: its metadata is not caught up or its peer sessions are not up yet",
        ));
    }
    Ok(Json(Health { status: "ok".into() }))
}

/// Any path no route matches: 404 `not_found`.
async fn not_found(method: Method, uri: axum::http::Uri) -> ApiError {
    let path: String = uri.path().chars().take(256).collect();
    ApiError::new(StatusCode::NOT_FOUND, codes::NOT_FOUND, format!("no route for {method} {path}"))
}

/// Whether the request carries a body (so a timeout before it arrived is the client's).
fn sends_body(headers: &HeaderMap) -> bool {
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok())
        .is_some_and(|n| n > 0);
    declared || headers.contains_key(header::TRANSFER_ENCODING)
}

fn panic_message(panic: &(dyn std::any::Any + Send)) -> String {
    panic
        .downcast_ref::<&str>()
        .map(|s| s.to_string())
        .or_else(|| panic.downcast_ref::<String>().cloned())
        .unwrap_or_else(|| "unknown panic".into())
}

/// The guard around every request: span, timeout, panic catching, JSON errors, stats.
async fn guard(State(shared): State<Arc<Shared>>, mut req: Request, next: Next) -> Response {
    let started = Instant::now();
    let limits = &shared.limits;
    let done = Arc::new(AtomicBool::new(false));
    let body_expected = sends_body(req.headers());
    req.extensions_mut().insert(BodyContext { limit_bytes: limits.body_limit_bytes(), done: done.clone() });
    let method = req.method().clone();
    // At debug level: under the default `info` filter a request opens no span at all
    // (a span is a registry slot, allocated and released per request). The warnings
    // and errors below name the method and path themselves.
    let uri = req.uri().clone();
    let path = uri.path();
    let span = tracing::debug_span!(
        "request",
        method = %method,
        path = %path,
        counter = field::Empty,
        status = field::Empty,
    );
    let run = AssertUnwindSafe(next.run(req)).catch_unwind();
    let outcome = tokio::time::timeout(limits.request_timeout(), run).instrument(span.clone()).await;
    let response = match outcome {
        Ok(Ok(response)) => json_errors(response, &method).await,
        Ok(Err(panic)) => {
            shared.stats.panics.inc();
            let number = shared.stats.panics.get();
            let message = panic_message(panic.as_ref());
            tracing::error!(parent: &span, %method, %path, %message, panic = number, "handler panicked");
            // The panic's text may name source files, values or internals: it stays in
            // the log, and the answer says which line to look for.
            ApiError::new(
                StatusCode::INTERNAL_SERVER_ERROR,
                codes::INTERNAL,
                format!(
                    "internal error (panic {number} on this node, logged with its details); the request may \
                     or may not have taken effect"
                ),
            )
            .into_response()
        }
        Err(_) => {
            shared.stats.timeouts.inc();
            let ms = limits.request_timeout_ms;
            if body_expected && !done.load(Ordering::SeqCst) {
                let message =
                    format!("the request body did not arrive within {ms} ms (http.request_timeout_ms)");
                let mut r = ApiError::new(StatusCode::REQUEST_TIMEOUT, codes::REQUEST_TIMEOUT, message)
                    .into_response();
                // The rest of the body may still be in flight: do not reuse the connection.
                r.headers_mut().insert(header::CONNECTION, HeaderValue::from_static("close"));
                r
            } else {
                let message = format!(
                    "the node did not answer within {ms} ms; the request may or may not have taken effect \
                     (retry an increment with the same event id)"
                );
                ApiError::new(StatusCode::SERVICE_UNAVAILABLE, codes::TIMEOUT, message).into_response()
            }
        }
    };
    let status = response.status().as_u16();
    span.record("status", status);
    let elapsed_us = u64::try_from(started.elapsed().as_micros()).unwrap_or(u64::MAX);
    shared.stats.record(status, elapsed_us);
    if status >= 500 {
        tracing::warn!(parent: &span, %method, %path, status, elapsed_us, "answered with a server error");
    } else {
        tracing::debug!(parent: &span, elapsed_us, "answered");
    }
    response
}

fn is_json_response(headers: &HeaderMap) -> bool {
    headers
        .get(header::CONTENT_TYPE)
        .and_then(|v| v.to_str().ok())
        .is_some_and(|v| v.starts_with("application/json"))
}

/// Rewrites an error answer that is not JSON yet (axum's 405, an extractor's plain
/// text rejection) into the [`ApiError`] shape, keeping its status and headers.
async fn json_errors(response: Response, method: &Method) -> Response {
    let status = response.status();
    if !(status.is_client_error() || status.is_server_error()) || is_json_response(response.headers()) {
        return response;
    }
    let (mut parts, body) = response.into_parts();
    let text = axum::body::to_bytes(body, ERROR_TEXT_BYTES_MAX)
        .await
        .map(|b| String::from_utf8_lossy(&b).trim().to_string())
        .unwrap_or_default();
    let code = match status {
        StatusCode::NOT_FOUND => codes::NOT_FOUND,
        StatusCode::METHOD_NOT_ALLOWED => codes::METHOD_NOT_ALLOWED,
        StatusCode::PAYLOAD_TOO_LARGE => codes::BODY_TOO_LARGE,
        StatusCode::UNSUPPORTED_MEDIA_TYPE => codes::UNSUPPORTED_MEDIA_TYPE,
        StatusCode::REQUEST_TIMEOUT => codes::REQUEST_TIMEOUT,
        s if s.is_server_error() => codes::INTERNAL,
        _ => codes::BAD_REQUEST,
    };
    let message = if status == StatusCode::METHOD_NOT_ALLOWED {
        // axum adds the `Allow` header outside this guard, so it is not known here.
        format!("method {method} is not allowed on this path (see the Allow header)")
    } else if text.is_empty() {
        status.canonical_reason().unwrap_or("error").to_string()
    } else {
        text
    };
    let (api_parts, api_body) = ApiError::new(status, code, message).into_response().into_parts();
    parts.headers.remove(header::CONTENT_LENGTH);
    for (name, value) in &api_parts.headers {
        parts.headers.insert(name.clone(), value.clone());
    }
    Response::from_parts(parts, api_body)
}
