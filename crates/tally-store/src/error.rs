//! The one error type of the storage layer.

use tally_core::codec::DecodeError;

/// Why a storage operation failed.
///
/// Every variant carries owned, printable data (no `sled::Error`, no `io::Error`) so the
/// error is `Clone + PartialEq`: the engine can hand one failure to every caller waiting
/// on a group commit, and tests can compare errors directly.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum StoreError {
    /// The storage engine failed to read or write (disk error, full disk, a sled bug it
    /// reported). The operation may or may not have taken effect on disk; the caller
    /// must not acknowledge anything that depended on it.
    #[error("storage I/O failed during {op}: {message}")]
    Io {
        /// The store operation that failed, e.g. `"commit"`.
        op: &'static str,
        /// The storage engine's description of the failure.
        message: String,
    },

    /// Bytes read back from the store could not be decoded: the data is corrupt or was
    /// written by an incompatible version. Reported instead of panicking so a node can
    /// refuse the one shard and keep serving the others.
    #[error("corrupt data at {location}: {source}")]
    Corrupt {
        /// Where the bad bytes were found, e.g. `shard "likes"#g0/3 image`.
        location: String,
        /// What was being decoded and why it failed.
        #[source]
        source: DecodeError,
    },

    /// A fault injected on purpose by a test (a `fail` failpoint or a
    /// [`MemStore`](crate::MemStore) fault); nothing was changed.
    #[error("injected fault at {0}")]
    Injected(&'static str),

    /// The store was written in a format this release does not read (see
    /// [`tally_core::format`]); nothing was read or written.
    #[error(transparent)]
    Format(#[from] tally_core::format::FormatError),

    /// A replicated store could not take the write or serve the read here: this node
    /// does not lead the shard's replica group, no quorum answered in time, or the
    /// shard's writer must reload first (another writer committed since it loaded).
    /// A write that failed this way may still take effect (a quorum may have it):
    /// nothing that depended on it is acknowledged, and retrying with the same
    /// event ids is safe.
    #[error("replica group unavailable during {op}: {reason}")]
    Unavailable {
        /// The store operation, e.g. `"commit"`.
        op: &'static str,
        /// Why.
        reason: String,
    },

    /// The store was closed (its simulated node shut down or crashed) and refuses every
    /// operation until it is restarted.
    #[error("the store is closed: its node has shut down or crashed")]
    Closed,
}

impl StoreError {
    /// Wraps a sled failure of operation `op`. sled's own corruption report becomes
    /// [`StoreError::Corrupt`]; everything else is [`StoreError::Io`].
    pub(crate) fn sled(op: &'static str, err: sled::Error) -> Self {
        match err {
            sled::Error::Corruption { at, .. } => StoreError::Corrupt {
                location: format!("sled log during {op}"),
                source: DecodeError {
                    what: "sled page",
                    reason: match at {
                        Some(ptr) => format!("sled detected corruption at {ptr:?}"),
                        None => "sled detected corruption".to_owned(),
                    },
                },
            },
            other => StoreError::Io { op, message: other.to_string() },
        }
    }

    /// Wraps a decoding failure of the bytes found at `location`.
    pub(crate) fn corrupt(location: impl Into<String>, source: DecodeError) -> Self {
        StoreError::Corrupt { location: location.into(), source }
    }

    /// True for faults that a retry may cure (I/O errors and injected faults), false for
    /// corrupt data and a closed store, which a retry will only hit again.
    pub fn is_transient(&self) -> bool {
        matches!(self, StoreError::Io { .. } | StoreError::Injected(_))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn messages_name_the_operation_and_the_cause() {
        let e = StoreError::Io { op: "flush", message: "disk full".into() };
        assert_eq!(e.to_string(), "storage I/O failed during flush: disk full");
        let e = StoreError::corrupt(
            "shard \"likes\"#g0/1 image",
            DecodeError { what: "shard image", reason: "unexpected end".into() },
        );
        assert_eq!(
            e.to_string(),
            "corrupt data at shard \"likes\"#g0/1 image: cannot decode shard image: unexpected end"
        );
        assert_eq!(StoreError::Injected("store::commit").to_string(), "injected fault at store::commit");
        assert!(StoreError::Injected("x").is_transient());
        assert!(!StoreError::Closed.is_transient());
    }
}
