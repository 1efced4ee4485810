//! Connections and calls a node refused before they could do anything, counted by
//! listener and reason for `tally_listener_refusals_total`.
//!
//! Client tokens have their own family (`tally_auth_refusals_total`); this one
//! counts what is refused below them: a TLS handshake that failed or never came (a
//! plaintext client, a certificate from another CA), a raft RPC without the proof
//! of the cluster secret, an inbound node-to-node session that closed before it
//! authenticated (a wrong cluster secret) or came from a node not in the peer list.
//!
//! The counts are process-wide, as the listeners are: every listener of a node
//! counts into the same table, whichever crate runs it, and the metrics endpoint
//! reads it ([`snapshot`]). Tests that share a process compare differences.

use std::sync::atomic::{AtomicU64, Ordering};

/// The tracing target of the audit trail, where every listener logs what it refused.
pub const AUDIT_TARGET: &str = "tally::audit";

/// What refused it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Listener {
    /// The client HTTP listener.
    Http,
    /// The client Redis-protocol listener.
    Resp,
    /// The node-to-node session listener.
    Node,
    /// The raft RPC listener.
    Raft,
}

impl Listener {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::Http => "http",
            Self::Resp => "resp",
            Self::Node => "node",
            Self::Raft => "raft",
        }
    }

    /// How logs name it.
    pub fn describe(self) -> &'static str {
        match self {
            Self::Http => "HTTP",
            Self::Resp => "RESP",
            Self::Node => "node-to-node",
            Self::Raft => "raft",
        }
    }
}

/// Why it was refused.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Reason {
    /// The TLS handshake failed: plaintext, an unknown CA, no client certificate.
    TlsHandshake,
    /// No TLS handshake completed within the listener's handshake timeout.
    TlsTimeout,
    /// A raft RPC carried no proof of the cluster secret.
    ProofMissing,
    /// A raft RPC carried a proof of another secret.
    ProofWrong,
    /// An inbound node-to-node session closed before it authenticated (the
    /// challenge–response on the cluster secret failed or never finished).
    Unauthenticated,
    /// An inbound node-to-node session authenticated as a node not in the peer list.
    UnknownPeer,
}

impl Reason {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::TlsHandshake => "tls_handshake",
            Self::TlsTimeout => "tls_timeout",
            Self::ProofMissing => "proof_missing",
            Self::ProofWrong => "proof_wrong",
            Self::Unauthenticated => "unauthenticated",
            Self::UnknownPeer => "unknown_peer",
        }
    }
}

/// Every (listener, reason) pair a node can count, in label order: only pairs that
/// can happen, each exported from the start (at zero) so a rate never starts from a
/// missing series.
pub const PAIRS: [(Listener, Reason); 12] = [
    (Listener::Http, Reason::TlsHandshake),
    (Listener::Http, Reason::TlsTimeout),
    (Listener::Resp, Reason::TlsHandshake),
    (Listener::Resp, Reason::TlsTimeout),
    (Listener::Node, Reason::TlsHandshake),
    (Listener::Node, Reason::TlsTimeout),
    (Listener::Node, Reason::Unauthenticated),
    (Listener::Node, Reason::UnknownPeer),
    (Listener::Raft, Reason::TlsHandshake),
    (Listener::Raft, Reason::TlsTimeout),
    (Listener::Raft, Reason::ProofMissing),
    (Listener::Raft, Reason::ProofWrong),
];

static COUNTS: [AtomicU64; PAIRS.len()] = [const { AtomicU64::new(0) }; PAIRS.len()];

/// Counts one refusal. A pair outside [`PAIRS`] is a programming error, counted
/// nowhere (and caught by the tests that name every call site's pair).
pub fn count(listener: Listener, reason: Reason) {
    if let Some(i) = PAIRS.iter().position(|p| *p == (listener, reason)) {
        COUNTS[i].fetch_add(1, Ordering::Relaxed);
    } else {
        debug_assert!(false, "no refusal series for {listener:?}/{reason:?}");
    }
}

/// The refusals counted so far by this process, pair by pair in [`PAIRS`] order.
pub fn snapshot() -> [((Listener, Reason), u64); PAIRS.len()] {
    std::array::from_fn(|i| (PAIRS[i], COUNTS[i].load(Ordering::Relaxed)))
}

/// The count of one pair (0 for a pair outside [`PAIRS`]).
pub fn get(listener: Listener, reason: Reason) -> u64 {
    PAIRS.iter().position(|p| *p == (listener, reason)).map_or(0, |i| COUNTS[i].load(Ordering::Relaxed))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_refusal_counts_in_its_own_series_only() {
        let before = snapshot();
        count(Listener::Raft, Reason::ProofWrong);
        count(Listener::Raft, Reason::ProofWrong);
        let after = snapshot();
        // No other test of this crate refuses a raft proof, so the difference is exact.
        for ((pair, was), (_, now)) in before.iter().zip(after.iter()) {
            if *pair == (Listener::Raft, Reason::ProofWrong) {
                assert_eq!(now - was, 2, "{pair:?}");
            }
        }
        assert_eq!(get(Listener::Raft, Reason::ProofWrong), after[11].1);
    }

    #[test]
    fn pairs_are_distinct_and_labels_unique() {
        let labels: std::collections::BTreeSet<(&str, &str)> =
            PAIRS.iter().map(|(l, r)| (l.as_str(), r.as_str())).collect();
        assert_eq!(labels.len(), PAIRS.len());
    }
}
