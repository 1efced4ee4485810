//! The crate's error type.

/// Why a metadata-group operation failed. Domain refusals (a bad spec, a stale
/// generation) are not errors: they are part of the applied [`crate::Response`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum RaftError {
    /// The configuration is inconsistent (e.g. this node is not a voter).
    #[error("invalid raft config: {0}")]
    Config(String),
    /// The sled database or its raft trees could not be opened or read.
    #[error("raft storage: {0}")]
    Storage(String),
    /// The raft address could not be bound.
    #[error("cannot serve raft endpoints on {addr}: {reason}")]
    Bind {
        /// The address.
        addr: String,
        /// The operating system's explanation.
        reason: String,
    },
    /// This node's raft has stopped (shut down, or a storage failure stopped it);
    /// restart the node.
    #[error("raft node stopped: {0}")]
    Stopped(String),
    /// No leader accepted the operation within the bound. For a write the outcome is
    /// unknown: it may still be applied (once: `MetaRaft::write` resends a proposal
    /// under one identity, which the state machine applies once). A caller that
    /// writes again makes a new proposal.
    #[error("no leader completed the operation within {waited_ms} ms (last problem: {last})")]
    Timeout {
        /// How long it was tried, in milliseconds.
        waited_ms: u64,
        /// The last reason for retrying.
        last: String,
    },
    /// openraft refused the operation for a reason retrying will not fix.
    #[error("raft refused: {0}")]
    Refused(String),
}

/// Why a transport did not bring back an answer (see [`crate::network::CallError`]).
#[derive(Debug)]
pub(crate) enum Transport {
    /// [`crate::network::CallError::Connect`]: the request was not delivered.
    Connect(String),
    /// [`crate::network::CallError::Failed`]: it may have been.
    Failed(String),
}
