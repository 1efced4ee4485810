//! Who may call which route: the router's layer over [`Gate`].
//!
//! Every matched route passes through [`access`], which looks its method and path
//! template up in one table ([`need`]), authenticates the request's
//! `Authorization: Bearer TOKEN` (401 with `WWW-Authenticate` when missing or
//! wrong), authorizes the scope on the counter or the cluster (403), hands the
//! handler its [`Caller`], and audits admin operations with their outcome. A route
//! missing from the table needs an `admin` token without prefixes: forgetting an
//! entry fails closed.
//!
//! | routes | needs |
//! | --- | --- |
//! | `GET /healthz`, `/v1/openapi.json`, `/ui` and its assets | nothing (no data: the page reads the API with the token typed into it) |
//! | `GET /metrics` | `read` without prefixes (it names counters), or nothing with `http.metrics_public` |
//! | `GET /v1/counters/{name}` and its `value`, `distinct`, `frequency`, `top`, `shards`, `reconciliations`, `expiry` | `read` on the counter |
//! | `POST /v1/counters/{name}/increments`, `PUT`/`DELETE …/expiry` | `write` on the counter |
//! | `POST /v1/increments` | `write`; each item is checked against the prefixes on its own |
//! | `PUT`, `DELETE /v1/counters/{name}`, `POST …/reconcile` | `admin` on the counter |
//! | `GET /v1/counters`, `GET /v1/stats` | `read`; narrowed to the token's prefixes |
//! | `GET /v1/cluster` | `read` |
//! | `GET /v1/namespaces` and `/v1/namespaces/{prefix}` | `read` without prefixes |
//! | `PUT`, `DELETE /v1/namespaces/{prefix}` | `admin` without prefixes (not in the table) |
//! | `PUT`, `DELETE /v1/cluster/members/{id}`, `POST /v1/cluster/nodes/{id}/accept-loss` | `admin` without prefixes |

use crate::auth::{AuthError, Gate, Principal, Resource, Scope};
use crate::http::error::{codes, ApiError, ErrorCode};
use crate::metrics::AdminOp;
use axum::extract::{FromRequestParts, MatchedPath, Path, Request, State};
use axum::http::{header, HeaderValue, Method, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use std::collections::HashMap;
use std::sync::Arc;

/// The principal a request acts as, for handlers that narrow what they answer
/// (listings, statistics, batches).
#[derive(Debug, Clone)]
pub struct Caller(pub Arc<Principal>);

/// What a route touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum On {
    /// Nothing: served to anyone.
    Public,
    /// `/metrics`: public with `http.metrics_public`, else [`Resource::AllCounters`].
    Metrics,
    /// The counter named by the path's `{name}`.
    Counter,
    /// The cluster; the node named by the path's `{id}`, if any.
    Cluster,
    /// A listing the handler narrows itself.
    Narrowed,
    /// Every counter (a route the table does not classify).
    AllCounters,
}

/// What a route needs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Need {
    /// The scope.
    pub scope: Scope,
    /// On what.
    pub on: On,
    /// The admin operation it is, audited with its outcome.
    pub admin: Option<AdminOp>,
}

const fn needs(scope: Scope, on: On, admin: Option<AdminOp>) -> Need {
    Need { scope, on, admin }
}

/// The table: what the route `method path` (its template, e.g.
/// `/v1/counters/{name}`) needs.
pub fn need(method: &Method, path: &str) -> Need {
    use Scope::{Admin, Read, Write};
    let m = method.as_str();
    match (m, path) {
        ("GET" | "HEAD", "/healthz" | "/v1/openapi.json" | "/ui" | "/ui/" | "/ui/app.js" | "/ui/app.css") => {
            needs(Read, On::Public, None)
        }
        ("GET" | "HEAD", "/metrics") => needs(Read, On::Metrics, None),
        ("GET" | "HEAD", "/v1/counters" | "/v1/stats") => needs(Read, On::Narrowed, None),
        // A namespace decides the contract of every counter under its prefix.
        ("GET" | "HEAD", "/v1/namespaces" | "/v1/namespaces/{prefix}") => needs(Read, On::AllCounters, None),
        ("GET" | "HEAD", "/v1/cluster") => needs(Read, On::Cluster, None),
        (
            "GET" | "HEAD",
            "/v1/counters/{name}"
            | "/v1/counters/{name}/value"
            | "/v1/counters/{name}/distinct"
            | "/v1/counters/{name}/frequency"
            | "/v1/counters/{name}/top"
            | "/v1/counters/{name}/shards"
            | "/v1/counters/{name}/reconciliations"
            | "/v1/counters/{name}/expiry",
        ) => needs(Read, On::Counter, None),
        // A deadline is part of a counter's life as its increments are (`EXPIRE`
        // needs `write` over RESP too).
        ("PUT" | "DELETE", "/v1/counters/{name}/expiry") => needs(Write, On::Counter, None),
        ("POST", "/v1/counters/{name}/increments") => needs(Write, On::Counter, None),
        ("POST", "/v1/increments") => needs(Write, On::Narrowed, None),
        ("PUT", "/v1/counters/{name}") => needs(Admin, On::Counter, Some(AdminOp::PutCounter)),
        ("DELETE", "/v1/counters/{name}") => needs(Admin, On::Counter, Some(AdminOp::DeleteCounter)),
        ("POST", "/v1/counters/{name}/reconcile") => needs(Admin, On::Counter, Some(AdminOp::Reconcile)),
        ("PUT", "/v1/cluster/members/{id}") => needs(Admin, On::Cluster, Some(AdminOp::AddMember)),
        ("DELETE", "/v1/cluster/members/{id}") => needs(Admin, On::Cluster, Some(AdminOp::RemoveMember)),
        ("POST", "/v1/cluster/nodes/{id}/accept-loss") => {
            needs(Admin, On::Cluster, Some(AdminOp::AcceptLoss))
        }
        _ => needs(Admin, On::AllCounters, Some(AdminOp::Other)),
    }
}

/// The answer to a refused request: 401 `unauthorized` or 403 `forbidden`, with
/// `WWW-Authenticate` (RFC 6750 §3), in the usual error shape.
pub fn refusal(e: &AuthError) -> Response {
    let (status, code) = if e.is_unauthenticated() {
        (StatusCode::UNAUTHORIZED, codes::UNAUTHORIZED)
    } else {
        (StatusCode::FORBIDDEN, codes::FORBIDDEN)
    };
    let mut response = ApiError::new(status, code, e.to_string()).into_response();
    if let Ok(v) = HeaderValue::from_str(&e.www_authenticate()) {
        response.headers_mut().insert(header::WWW_AUTHENTICATE, v);
    }
    response
}

/// The layer every matched route passes through (see the module docs).
pub async fn access(
    State((gate, metrics_public)): State<(Arc<Gate>, bool)>,
    req: Request,
    next: Next,
) -> Response {
    let template = req.extensions().get::<MatchedPath>().map(|p| p.as_str().to_string()).unwrap_or_default();
    let need = need(req.method(), &template);
    // A route the table knows (a method the path does not take still gets 405).
    if need.on != On::AllCounters {
        if let Some(refused) = super::browser::unless_json_post(req.method(), req.headers()) {
            return refused;
        }
    }
    let public = need.on == On::Public || (need.on == On::Metrics && metrics_public);
    if public {
        let mut req = req;
        req.extensions_mut().insert(Caller(Arc::new(Principal::open())));
        return next.run(req).await;
    }
    let (mut parts, body) = req.into_parts();
    // A counter name may be any bytes: it is read from the path itself, in the
    // escaped form token prefixes are compared in (`tally_core::name`).
    let counter = match template.contains("{name}") {
        true => match super::raw_segment(&parts, "counters") {
            Ok(raw) => Some(tally_core::name::escape(&raw)),
            Err(e) => return e.into_response(),
        },
        false => None,
    };
    let params = match template.contains("{id}") {
        true => match Path::<HashMap<String, String>>::from_request_parts(&mut parts, &()).await {
            Ok(Path(params)) => params,
            Err(e) => {
                return ApiError::new(StatusCode::BAD_REQUEST, codes::INVALID_PATH, e.body_text())
                    .into_response()
            }
        },
        false => HashMap::new(),
    };
    let op = format!("{} {template}", parts.method);
    let counter = counter.as_deref();
    let node = params.get("id").map(String::as_str);
    let attempt = crate::auth::Attempt { transport: "http", op: &op, counter, node };
    let credentials = parts.headers.get(header::AUTHORIZATION).map(HeaderValue::as_bytes);
    let principal = match gate.authenticate(credentials, &attempt) {
        Ok(p) => p,
        Err(e) => return refusal(&e),
    };
    let resource = match need.on {
        On::Counter => Resource::Counter(counter.unwrap_or("")),
        On::Cluster => Resource::Cluster,
        On::Narrowed => Resource::Narrowed,
        On::Metrics | On::AllCounters | On::Public => Resource::AllCounters,
    };
    if let Err(e) = gate.authorize(&principal, need.scope, resource, &attempt) {
        return refusal(&e);
    }
    parts.extensions.insert(Caller(principal.clone()));
    let response = next.run(Request::from_parts(parts, body)).await;
    if let Some(op) = need.admin {
        let code = response.extensions().get::<ErrorCode>().map(|c| c.0.as_ref());
        gate.admin_done(&principal, op, &attempt, response.status().as_u16(), code);
    }
    response
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_table_classifies_every_admin_operation() {
        let admin = [
            (Method::PUT, "/v1/counters/{name}", AdminOp::PutCounter),
            (Method::DELETE, "/v1/counters/{name}", AdminOp::DeleteCounter),
            (Method::POST, "/v1/counters/{name}/reconcile", AdminOp::Reconcile),
            (Method::PUT, "/v1/cluster/members/{id}", AdminOp::AddMember),
            (Method::DELETE, "/v1/cluster/members/{id}", AdminOp::RemoveMember),
            (Method::POST, "/v1/cluster/nodes/{id}/accept-loss", AdminOp::AcceptLoss),
        ];
        for (m, path, op) in admin {
            let n = need(&m, path);
            assert_eq!((n.scope, n.admin), (Scope::Admin, Some(op)), "{m} {path}");
        }
        assert_eq!(need(&Method::POST, "/v1/counters/{name}/increments").scope, Scope::Write);
        // Every read of a counter needs read on it, whichever front end it comes through
        // (RESP's CMS.QUERY and TOPK.LIST need read too).
        for read in ["", "/value", "/distinct", "/frequency", "/top", "/shards", "/reconciliations"] {
            let path = format!("/v1/counters/{{name}}{read}");
            assert_eq!(need(&Method::GET, &path), needs(Scope::Read, On::Counter, None), "GET {path}");
        }
        assert_eq!(need(&Method::GET, "/healthz").on, On::Public);
        assert_eq!(need(&Method::GET, "/metrics").on, On::Metrics);
        // Anything the table does not know fails closed.
        let unknown = need(&Method::POST, "/v1/something/new");
        assert_eq!((unknown.scope, unknown.on), (Scope::Admin, On::AllCounters));
        assert_eq!(need(&Method::POST, "/healthz").on, On::AllCounters);
    }

    #[test]
    fn refusals_carry_the_status_and_the_challenge() {
        let r = refusal(&AuthError::Missing);
        assert_eq!(r.status(), StatusCode::UNAUTHORIZED);
        assert_eq!(r.headers()[header::WWW_AUTHENTICATE], "Bearer realm=\"tally\"");
        let r = refusal(&AuthError::Scope { token: "t".into(), needed: Scope::Admin });
        assert_eq!(r.status(), StatusCode::FORBIDDEN);
        assert!(r.headers()[header::WWW_AUTHENTICATE].to_str().unwrap().contains("insufficient_scope"));
    }
}
