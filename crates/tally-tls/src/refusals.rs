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
use std::sync::OnceLock;
use std::time::Instant;

/// Most refusal lines written to the log per second, across every listener of the
/// process. Each refusal is still counted; past this many in one second the lines
/// are suppressed and their number is logged once the second is over, so a client
/// that sends a thousand bad tokens a second fills neither the disk nor the
/// logging pipeline.
pub const REFUSAL_LOG_LINES_PER_S_MAX: u64 = 20;

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
    /// A raft RPC carried a proof of another secret (or of another request).
    ProofWrong,
    /// A raft RPC carried a proof seen before, or one too old: a replay.
    ProofReplayed,
    /// An inbound node-to-node session closed before it authenticated (the
    /// challenge–response on the cluster secret failed or never finished).
    Unauthenticated,
    /// An inbound node-to-node session authenticated as a node not in the peer list.
    UnknownPeer,
    /// A RESP connection sent what a browser sends (`POST`, `Host:`, an HTTP
    /// request line): a web page trying to drive the node across protocols.
    CrossProtocol,
    /// An HTTP request named a `Host` the node does not answer to (a DNS
    /// rebinding attempt, or a name missing from `http.allowed_hosts`).
    HostNotAllowed,
    /// A browser sent a write from a page of another origin.
    CrossOrigin,
    /// A connection that had not sent a request (or authenticated) was closed to
    /// make room for a new one on a full listener ([`crate::admission`]).
    Evicted,
    /// A connection did not authenticate within its listener's deadline.
    AuthTimeout,
    /// A request did not arrive whole within its listener's read timeout (a client
    /// trickling bytes: slowloris).
    ReadTimeout,
}

impl Reason {
    /// The metric label.
    pub fn as_str(self) -> &'static str {
        match self {
            Self::TlsHandshake => "tls_handshake",
            Self::TlsTimeout => "tls_timeout",
            Self::ProofMissing => "proof_missing",
            Self::ProofWrong => "proof_wrong",
            Self::ProofReplayed => "proof_replayed",
            Self::Unauthenticated => "unauthenticated",
            Self::UnknownPeer => "unknown_peer",
            Self::CrossProtocol => "cross_protocol",
            Self::HostNotAllowed => "host_not_allowed",
            Self::CrossOrigin => "cross_origin",
            Self::Evicted => "evicted",
            Self::AuthTimeout => "auth_timeout",
            Self::ReadTimeout => "read_timeout",
        }
    }
}

/// Every (listener, reason) pair a node can count, in label order: only pairs that
/// can happen, each exported from the start (at zero) so a rate never starts from a
/// missing series.
pub const PAIRS: [(Listener, Reason); 21] = [
    (Listener::Http, Reason::TlsHandshake),
    (Listener::Http, Reason::TlsTimeout),
    (Listener::Http, Reason::HostNotAllowed),
    (Listener::Http, Reason::CrossOrigin),
    (Listener::Http, Reason::Evicted),
    (Listener::Resp, Reason::TlsHandshake),
    (Listener::Resp, Reason::TlsTimeout),
    (Listener::Resp, Reason::CrossProtocol),
    (Listener::Resp, Reason::Evicted),
    (Listener::Resp, Reason::AuthTimeout),
    (Listener::Resp, Reason::ReadTimeout),
    (Listener::Node, Reason::TlsHandshake),
    (Listener::Node, Reason::TlsTimeout),
    (Listener::Node, Reason::Unauthenticated),
    (Listener::Node, Reason::UnknownPeer),
    (Listener::Raft, Reason::TlsHandshake),
    (Listener::Raft, Reason::TlsTimeout),
    (Listener::Raft, Reason::ProofMissing),
    (Listener::Raft, Reason::ProofWrong),
    (Listener::Raft, Reason::ProofReplayed),
    (Listener::Raft, Reason::Evicted),
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

/// What [`LineLimiter::admit`] decided for one line.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Admit {
    /// Write the line; `suppressed` lines were dropped in the seconds since the
    /// last one written (say so first when it is not zero).
    Write {
        /// Lines dropped before this one.
        suppressed: u64,
    },
    /// Drop the line: this second's budget is spent.
    Drop,
}

/// At most `per_s` lines in each whole second, counting what it drops.
#[derive(Debug)]
pub struct LineLimiter {
    per_s: u64,
    /// The second the budget is being spent in.
    second: AtomicU64,
    /// Lines admitted or dropped in that second.
    used: AtomicU64,
    /// Lines dropped since the last one written.
    dropped: AtomicU64,
}

impl LineLimiter {
    /// A limiter of `per_s` lines a second.
    pub const fn new(per_s: u64) -> Self {
        Self { per_s, second: AtomicU64::new(0), used: AtomicU64::new(0), dropped: AtomicU64::new(0) }
    }

    /// Whether a line at `now_s` (whole seconds on any monotonic clock) is written.
    pub fn admit(&self, now_s: u64) -> Admit {
        let second = self.second.load(Ordering::Acquire);
        if now_s > second
            && self.second.compare_exchange(second, now_s, Ordering::AcqRel, Ordering::Acquire).is_ok()
        {
            self.used.store(0, Ordering::Release);
        }
        if self.used.fetch_add(1, Ordering::AcqRel) < self.per_s {
            Admit::Write { suppressed: self.dropped.swap(0, Ordering::AcqRel) }
        } else {
            self.dropped.fetch_add(1, Ordering::AcqRel);
            Admit::Drop
        }
    }
}

static LINES: LineLimiter = LineLimiter::new(REFUSAL_LOG_LINES_PER_S_MAX);

/// Runs `line` (a refusal's log line) unless this second's budget of
/// [`REFUSAL_LOG_LINES_PER_S_MAX`] lines is spent; before the first line written
/// after some were dropped, logs how many.
pub fn log_limited(line: impl FnOnce()) {
    static START: OnceLock<Instant> = OnceLock::new();
    let now_s = START.get_or_init(Instant::now).elapsed().as_secs() + 1;
    match LINES.admit(now_s) {
        Admit::Drop => {}
        Admit::Write { suppressed } => {
            if suppressed > 0 {
                tracing::warn!(
                    target: AUDIT_TARGET,
                    event = "refusals_suppressed",
                    suppressed,
                    "{suppressed} refusal line(s) not logged (more than {REFUSAL_LOG_LINES_PER_S_MAX} a second); \
                     every refusal is still counted on /metrics"
                );
            }
            line();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn at_most_the_budget_of_lines_is_written_each_second_and_the_rest_is_reported() {
        let l = LineLimiter::new(3);
        let first: Vec<Admit> = (0..5).map(|_| l.admit(1)).collect();
        let w = |suppressed| Admit::Write { suppressed };
        assert_eq!(first, [w(0), w(0), w(0), Admit::Drop, Admit::Drop]);
        // The next second: the two dropped lines are reported with the first line.
        assert_eq!(l.admit(2), w(2));
        assert_eq!(l.admit(2), w(0));
        // A second with nothing dropped reports nothing; a clock that goes back spends
        // the current budget.
        assert_eq!(l.admit(9), w(0));
        assert_eq!((l.admit(3), l.admit(9), l.admit(9)), (w(0), w(0), Admit::Drop));
    }

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
        let at = PAIRS.iter().position(|p| *p == (Listener::Raft, Reason::ProofWrong)).expect("a pair");
        assert_eq!(get(Listener::Raft, Reason::ProofWrong), after[at].1);
    }

    #[test]
    fn pairs_are_distinct_and_labels_unique() {
        let labels: std::collections::BTreeSet<(&str, &str)> =
            PAIRS.iter().map(|(l, r)| (l.as_str(), r.as_str())).collect();
        assert_eq!(labels.len(), PAIRS.len());
    }
}
