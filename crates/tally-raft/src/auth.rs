//! Proof of the cluster secret on every raft RPC.
//!
//! The raft endpoints can append entries, grant votes, install snapshots and take
//! forwarded writes (create, delete, membership): whoever reaches a node's raft
//! address must prove it holds `cluster.secret`, with TLS or without. Every RPC
//! carries [`AUTH_HEADER`] with the hex SHA-256 of a fixed domain string and the
//! secret ([`RaftSecret`]); the server compares it with its own in constant time
//! ([`subtle`]) and refuses anything else with 401 before the body is read, logging
//! the refusal on the audit target ([`AUDIT_TARGET`]) with the path and the peer.
//!
//! The proof is a digest rather than the secret so that someone who reads a
//! plaintext raft exchange learns no more than this proof: not the secret the
//! node-to-node sessions' challenge–response handshake uses. On a plaintext raft
//! link an on-path observer can still replay the proof; TLS (`[tls]`) is what
//! protects the link itself.

use axum::extract::{ConnectInfo, Request, State};
use axum::http::{HeaderValue, StatusCode};
use axum::middleware::Next;
use axum::response::{IntoResponse, Response};
use sha2::{Digest, Sha256};
use std::net::SocketAddr;
use std::sync::Arc;
use subtle::ConstantTimeEq;
use tally_tls::refusals::{self, Listener, Reason};

/// The header every raft RPC carries its proof of the cluster secret in.
pub const AUTH_HEADER: &str = "tally-raft-auth";
/// The tracing target refusals are logged on: the server's audit trail
/// (`tally_server::auth::AUDIT_TARGET`).
pub const AUDIT_TARGET: &str = refusals::AUDIT_TARGET;
/// What the secret is hashed behind, so the proof is of no use anywhere else.
const DOMAIN: &[u8] = b"tally raft rpc v1\0";

/// The proof of one cluster secret, as sent and as checked.
#[derive(Clone)]
pub struct RaftSecret {
    proof: HeaderValue,
}

impl std::fmt::Debug for RaftSecret {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("RaftSecret(..)")
    }
}

/// Why an RPC was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Refusal {
    /// It carried no proof.
    Missing,
    /// Its proof is not this cluster's.
    Wrong,
}

impl RaftSecret {
    /// The proof of `secret` (the cluster's `cluster.secret`).
    pub fn new(secret: &str) -> Self {
        let mut hash = Sha256::new();
        hash.update(DOMAIN);
        hash.update(secret.as_bytes());
        let proof = HeaderValue::from_str(&hex::encode(hash.finalize()))
            .unwrap_or_else(|_| HeaderValue::from_static(""));
        Self { proof }
    }

    /// The header value a caller sends.
    pub fn header_value(&self) -> &HeaderValue {
        &self.proof
    }

    /// Whether `got` (the request's [`AUTH_HEADER`]) proves the secret; compared in
    /// constant time.
    pub fn check(&self, got: Option<&HeaderValue>) -> Result<(), Refusal> {
        let got = got.ok_or(Refusal::Missing)?;
        if bool::from(self.proof.as_bytes().ct_eq(got.as_bytes())) {
            Ok(())
        } else {
            Err(Refusal::Wrong)
        }
    }
}

/// The address a raft RPC came from, for refusals: [`crate::server::serve`] puts
/// it in every request's extensions (as `ConnectInfo<RaftPeer>`).
#[derive(Debug, Clone, Copy)]
pub struct RaftPeer(pub SocketAddr);

/// The middleware in front of every raft endpoint: serves a request only if it
/// proves the secret (every request when the node runs without one).
pub(crate) async fn authenticated(
    State(secret): State<Option<Arc<RaftSecret>>>,
    request: Request,
    next: Next,
) -> Response {
    let Some(secret) = secret else { return next.run(request).await };
    match secret.check(request.headers().get(AUTH_HEADER)) {
        Ok(()) => next.run(request).await,
        Err(refusal) => {
            let peer = request.extensions().get::<ConnectInfo<RaftPeer>>().map(|c| c.0 .0.to_string());
            let path = request.uri().path();
            let peer = peer.as_deref().unwrap_or("unknown");
            let text = match refusal {
                Refusal::Missing => "refused a raft RPC: no proof of the cluster secret",
                Refusal::Wrong => "refused a raft RPC: wrong proof of the cluster secret",
            };
            let reason = match refusal {
                Refusal::Missing => Reason::ProofMissing,
                Refusal::Wrong => Reason::ProofWrong,
            };
            refusals::count(Listener::Raft, reason);
            let reason = reason.as_str();
            refusals::log_limited(
                || tracing::warn!(target: AUDIT_TARGET, %path, %peer, reason, outcome = "refused", "{text}"),
            );
            (StatusCode::UNAUTHORIZED, "the raft RPC does not prove this cluster's secret (cluster.secret)")
                .into_response()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn only_the_same_secrets_proof_passes() {
        let ours = RaftSecret::new("a-long-enough-secret");
        assert_eq!(ours.check(Some(RaftSecret::new("a-long-enough-secret").header_value())), Ok(()));
        assert_eq!(ours.check(Some(RaftSecret::new("another-secret-1").header_value())), Err(Refusal::Wrong));
        assert_eq!(ours.check(None), Err(Refusal::Missing));
        assert_eq!(ours.check(Some(&HeaderValue::from_static("a-long-enough-secret"))), Err(Refusal::Wrong));
        assert_eq!(ours.check(Some(&HeaderValue::from_static(""))), Err(Refusal::Wrong));
        // The proof is a hex digest, never the secret, and the Debug form hides it.
        assert_eq!(ours.header_value().len(), 64);
        assert!(!ours.header_value().to_str().unwrap_or_default().contains("secret"));
        assert_eq!(format!("{ours:?}"), "RaftSecret(..)");
    }
}
