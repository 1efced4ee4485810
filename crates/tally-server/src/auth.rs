//! [`Gate`]: the node's client authentication and authorization, shared by every
//! listener that serves clients (HTTP today; a RESP listener's `AUTH` uses the same
//! gate), with its audit trail and metrics.
//!
//! The decisions are `tally_auth`'s ([`Tokens::authenticate`], [`authorize`]); the
//! gate adds what a running node needs around them: every refusal and every admin
//! operation becomes a structured event on the [`AUDIT_TARGET`] tracing target —
//! the token's *name* (never the token), the operation, the counter or node, the
//! outcome — and a count in [`AuthStats`] (`tally_auth_refusals_total{reason}`,
//! `tally_admin_operations_total{op,outcome}`). Nothing here knows about HTTP: the
//! router's layer in `http::access` is a shell over [`Gate::authenticate`],
//! [`Gate::authorize`] and [`Gate::admin_done`].
//!
//! The tokens can be replaced while the node runs ([`Gate::reload`], what `tallyd`
//! does on SIGHUP): every HTTP request presents its token, so it is decided by the
//! set in force when it arrives; a RESP connection authenticated once, so it checks
//! [`Gate::generation`] before each command and, after a reload, runs as a new
//! connection would (it must `AUTH` again on a node with tokens).

use crate::config::{Config, ConfigError};
use crate::metrics::{AdminOp, AdminOutcome, AuthStats};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, RwLock};
pub use tally_auth::{authorize, AuthError, Principal, Resource, Scope, Tokens};

/// The tracing target of audit events: filter on it (`RUST_LOG=tally::audit=info`)
/// or route it to its own sink.
pub const AUDIT_TARGET: &str = tally_tls::refusals::AUDIT_TARGET;

/// What a request asks, for the audit trail.
#[derive(Debug, Clone, Copy)]
pub struct Attempt<'a> {
    /// The listener it came through: `http` or `resp`.
    pub transport: &'static str,
    /// The operation, e.g. `DELETE /v1/counters/{name}` or a RESP command.
    pub op: &'a str,
    /// The counter it names, if any.
    pub counter: Option<&'a str>,
    /// The node it names (membership changes), if any.
    pub node: Option<&'a str>,
}

/// The node's tokens, metrics and audit trail. Cheap to share (`Arc`).
#[derive(Debug, Default)]
pub struct Gate {
    tokens: RwLock<Arc<Tokens>>,
    /// How many times the tokens were replaced ([`Gate::reload`]).
    generation: AtomicU64,
    stats: AuthStats,
}

impl Gate {
    /// The gate of a node with `config`'s `[[tokens]]`.
    pub fn from_config(config: &Config) -> Result<Self, ConfigError> {
        Ok(Self::new(Tokens::from_config(&config.tokens)?))
    }

    /// The gate of a node without tokens: every request is let through.
    pub fn open() -> Self {
        Self::default()
    }

    /// A gate over `tokens` (tests and embedders).
    pub fn new(tokens: Tokens) -> Self {
        Self {
            tokens: RwLock::new(Arc::new(tokens)),
            generation: AtomicU64::new(0),
            stats: AuthStats::default(),
        }
    }

    /// The tokens in force now.
    fn tokens(&self) -> Arc<Tokens> {
        self.tokens.read().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Replaces the tokens with `config`'s `[[tokens]]` (already validated, its
    /// exposure checked); returns how many are in force. Nothing else of `config`
    /// is taken.
    pub fn reload(&self, config: &Config) -> Result<usize, ConfigError> {
        let tokens = Arc::new(Tokens::from_config(&config.tokens)?);
        let n = config.tokens.len();
        *self.tokens.write().unwrap_or_else(|e| e.into_inner()) = tokens;
        self.generation.fetch_add(1, Ordering::AcqRel);
        Ok(n)
    }

    /// How many times the tokens were replaced: a connection that authenticated
    /// under another generation must authenticate again.
    pub fn generation(&self) -> u64 {
        self.generation.load(Ordering::Acquire)
    }

    /// Whether the node declares no token (everything is open).
    pub fn is_open(&self) -> bool {
        self.tokens().is_empty()
    }

    /// The refusal and admin-operation counts, for `/metrics`.
    pub fn stats(&self) -> &AuthStats {
        &self.stats
    }

    /// The principal of a request presenting `credentials` (`Bearer TOKEN`, or
    /// `None`); a refusal is audited and counted.
    pub fn authenticate(
        &self,
        credentials: Option<&[u8]>,
        attempt: &Attempt<'_>,
    ) -> Result<Arc<Principal>, AuthError> {
        self.tokens().authenticate(credentials).inspect_err(|e| self.refused(e, attempt))
    }

    /// The principal of a bare token (RESP `AUTH TOKEN`); a refusal is audited
    /// and counted. On an open node every token is accepted as the open principal.
    pub fn verify(&self, token: &str, attempt: &Attempt<'_>) -> Result<Arc<Principal>, AuthError> {
        let tokens = self.tokens();
        if tokens.is_empty() {
            return Ok(Arc::new(Principal::open()));
        }
        tokens.verify(token).inspect_err(|e| self.refused(e, attempt))
    }

    /// Whether `principal` may use `scope` on `resource`; a refusal is audited and
    /// counted.
    pub fn authorize(
        &self,
        principal: &Principal,
        scope: Scope,
        resource: Resource<'_>,
        attempt: &Attempt<'_>,
    ) -> Result<(), AuthError> {
        authorize(principal, scope, resource).inspect_err(|e| self.refused(e, attempt))
    }

    /// Records `items` refusals of one request at once, with one audit event naming
    /// the first (a batch whose items fall outside the token's prefixes must not
    /// flood the log with one line per item).
    pub fn refused_items(&self, first: &AuthError, attempt: &Attempt<'_>, items: u64) {
        if items == 0 {
            return;
        }
        self.stats.refused_n(first.reason(), items);
        tally_tls::refusals::log_limited(|| {
            tracing::warn!(
                target: AUDIT_TARGET,
                event = "refused",
                transport = attempt.transport,
                token = first.token().unwrap_or("-"),
                reason = first.reason(),
                request = attempt.op,
                counter = attempt.counter.unwrap_or("-"),
                node = attempt.node.unwrap_or("-"),
                items,
                "{items} item(s) of the request refused, the first: {first}"
            )
        });
    }

    /// Records that `principal` ran the admin operation `op`, answered with HTTP
    /// status `status` (and error `code`, if it failed).
    pub fn admin_done(
        &self,
        principal: &Principal,
        op: AdminOp,
        attempt: &Attempt<'_>,
        status: u16,
        code: Option<&str>,
    ) {
        let outcome = AdminOutcome::of_status(status);
        self.stats.admin(op, outcome);
        tracing::info!(
            target: AUDIT_TARGET,
            event = "admin",
            transport = attempt.transport,
            token = principal.label(),
            op = op.as_str(),
            request = attempt.op,
            counter = attempt.counter.unwrap_or("-"),
            node = attempt.node.unwrap_or("-"),
            outcome = outcome.as_str(),
            status,
            code = code.unwrap_or("-"),
            "admin operation"
        );
    }

    /// Counts a refusal and logs it, at most
    /// `tally_tls::refusals::REFUSAL_LOG_LINES_PER_S_MAX` lines a second across the
    /// process (a client sending bad tokens in a loop must not fill the disk; the
    /// count on `/metrics` stays exact).
    fn refused(&self, e: &AuthError, attempt: &Attempt<'_>) {
        self.stats.refused(e.reason());
        tally_tls::refusals::log_limited(|| {
            tracing::warn!(
                target: AUDIT_TARGET,
                event = "refused",
                transport = attempt.transport,
                token = e.token().unwrap_or("-"),
                reason = e.reason(),
                request = attempt.op,
                counter = attempt.counter.unwrap_or("-"),
                node = attempt.node.unwrap_or("-"),
                "request refused: {e}"
            );
        });
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::metrics::PromWriter;

    fn gate() -> Gate {
        let config = [tally_auth::TokenConfig {
            name: "reader".into(),
            hash: tally_auth::TokenHash::of("tok-read").to_config(),
            scopes: vec![Scope::Read],
            prefixes: vec!["likes:".into()],
        }];
        Gate::new(Tokens::from_config(&config).expect("valid"))
    }

    const ATTEMPT: Attempt<'static> =
        Attempt { transport: "http", op: "GET /v1/counters/{name}", counter: Some("likes:1"), node: None };

    fn exposition(g: &Gate) -> String {
        let mut w = PromWriter::new();
        g.stats().write(&mut w);
        w.finish()
    }

    #[test]
    fn a_reload_replaces_the_tokens_and_moves_the_generation() {
        let g = gate();
        assert!(g.authenticate(Some(b"Bearer tok-read"), &ATTEMPT).is_ok());
        let mut config = Config::single_node().expect("built-in");
        config.tokens = vec![tally_auth::TokenConfig {
            name: "writer".into(),
            hash: tally_auth::TokenHash::of("tok-write").to_config(),
            scopes: vec![Scope::Write],
            prefixes: vec![],
        }];
        assert_eq!(g.generation(), 0);
        assert_eq!(g.reload(&config), Ok(1));
        assert_eq!(g.generation(), 1);
        assert_eq!(
            g.authenticate(Some(b"Bearer tok-read"), &ATTEMPT).map(|_| ()),
            Err(AuthError::UnknownToken)
        );
        assert_eq!(g.verify("tok-write", &ATTEMPT).map(|p| p.label().to_string()), Ok("writer".to_string()));
        config.tokens.clear();
        assert_eq!(g.reload(&config), Ok(0));
        assert!(g.is_open());
    }

    #[test]
    fn refusals_are_counted_by_reason() {
        let g = gate();
        assert!(!g.is_open());
        assert_eq!(g.authenticate(None, &ATTEMPT).map(|_| ()), Err(AuthError::Missing));
        assert_eq!(g.authenticate(Some(b"Bearer nope"), &ATTEMPT).map(|_| ()), Err(AuthError::UnknownToken));
        assert_eq!(g.verify("nope", &ATTEMPT).map(|_| ()), Err(AuthError::UnknownToken));
        let p = g.authenticate(Some(b"Bearer tok-read"), &ATTEMPT).expect("known token");
        assert_eq!(p.label(), "reader");
        assert!(g.authorize(&p, Scope::Write, Resource::Counter("likes:1"), &ATTEMPT).is_err());
        assert!(g.authorize(&p, Scope::Read, Resource::Counter("credits:1"), &ATTEMPT).is_err());
        assert!(g.authorize(&p, Scope::Read, Resource::Counter("likes:1"), &ATTEMPT).is_ok());
        let text = exposition(&g);
        for (reason, n) in
            [("missing", 1), ("malformed", 0), ("unknown_token", 2), ("scope", 1), ("prefix", 1)]
        {
            let line = format!("tally_auth_refusals_total{{reason=\"{reason}\"}} {n}\n");
            assert!(text.contains(&line), "{line} not in\n{text}");
        }
    }

    #[test]
    fn admin_operations_are_counted_by_outcome() {
        let g = Gate::open();
        assert!(g.is_open());
        let p = g.authenticate(None, &ATTEMPT).expect("open");
        assert_eq!(g.verify("anything", &ATTEMPT).map(|p| p.name().is_none()), Ok(true));
        g.admin_done(&p, AdminOp::DeleteCounter, &ATTEMPT, 204, None);
        g.admin_done(&p, AdminOp::DeleteCounter, &ATTEMPT, 404, Some("counter_not_found"));
        g.admin_done(&p, AdminOp::AddMember, &ATTEMPT, 503, Some("unavailable"));
        let text = exposition(&g);
        for line in [
            "tally_admin_operations_total{op=\"delete_counter\",outcome=\"ok\"} 1",
            "tally_admin_operations_total{op=\"delete_counter\",outcome=\"rejected\"} 1",
            "tally_admin_operations_total{op=\"add_member\",outcome=\"failed\"} 1",
            "tally_admin_operations_total{op=\"reconcile\",outcome=\"ok\"} 0",
        ] {
            assert!(text.contains(line), "{line} not in\n{text}");
        }
    }
}
