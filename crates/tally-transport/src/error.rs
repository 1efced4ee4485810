//! Every way starting the transport or calling a peer can fail.

use std::net::SocketAddr;

/// Why a transport operation failed. The call errors split in two: those where the request
/// certainly was not handled (`Unreachable`, `UnknownNode`, `Refused`, `Overloaded`,
/// `TooLarge`, `ShutDown`) and those where it may have been ([`Self::outcome_unknown`]):
/// the data plane retries the latter with the same idempotency key.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum TransportError {
    /// The configuration is unusable; the message says which field and why.
    #[error("invalid transport config: {0}")]
    Config(String),
    /// ractor's registries (process groups, pids) are process-global, so a second transport
    /// in the same process would see the first one's peers as its own.
    #[error("a transport is already running in this process (one process hosts one node)")]
    AlreadyRunning,
    /// The ractor_cluster listener could not bind.
    #[error("cannot listen on {addr}: {reason}")]
    Listen {
        /// The configured listen address.
        addr: SocketAddr,
        /// The underlying error.
        reason: String,
    },
    /// A local actor could not be spawned.
    #[error("cannot start the {what}: {reason}")]
    Start {
        /// Which actor.
        what: &'static str,
        /// The underlying error.
        reason: String,
    },
    /// The node is not in this node's peer list.
    #[error("unknown node {0:?}")]
    UnknownNode(String),
    /// The node is `Down` or has no session: the request was not sent.
    #[error("node {0} is unreachable")]
    Unreachable(String),
    /// No answer before the deadline; the request may or may not have been handled.
    #[error("call to {node} timed out after {timeout_ms} ms")]
    Timeout {
        /// The callee.
        node: String,
        /// The deadline that passed, in ms.
        timeout_ms: u64,
    },
    /// The session closed while the request was in flight; it may or may not have been handled.
    #[error("session to {0} closed during the call")]
    Disconnected(String),
    /// The callee refused to serve us: cluster-config fingerprint mismatch or unknown sender.
    #[error("node {node} refused the request: {reason}")]
    Refused {
        /// The callee.
        node: String,
        /// Why, as the callee put it.
        reason: String,
    },
    /// The callee has too many requests in flight; retry later.
    #[error("node {0} is overloaded")]
    Overloaded(String),
    /// The request or reply exceeds the transport's size limit.
    #[error("{what} of {bytes} bytes exceeds the limit of {bytes_max} bytes")]
    TooLarge {
        /// `"request"` or `"reply"`.
        what: &'static str,
        /// Its size.
        bytes: usize,
        /// The limit.
        bytes_max: usize,
    },
    /// The callee answered with something this version cannot understand.
    #[error("protocol error talking to {node}: {reason}")]
    Protocol {
        /// The callee.
        node: String,
        /// What was wrong.
        reason: String,
    },
    /// The callee's handler panicked; the request may have been partly handled.
    #[error("the handler on {0} failed")]
    HandlerFailed(String),
    /// [`crate::Transport::shutdown`] was called.
    #[error("the transport is shut down")]
    ShutDown,
}

impl TransportError {
    /// True when the request may have been handled despite the error, so a retry must reuse
    /// the same idempotency key (and an oracle must count it as "unknown", not "absent").
    pub fn outcome_unknown(&self) -> bool {
        matches!(
            self,
            TransportError::Timeout { .. }
                | TransportError::Disconnected(_)
                | TransportError::HandlerFailed(_)
        )
    }
}
