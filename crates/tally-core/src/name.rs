//! Counter names and event ids: the only strings a client chooses.
//!
//! Both are bounded and restricted to a small alphabet so that they can be used as
//! storage keys, metric labels and URL path segments without escaping.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Longest accepted counter name, in bytes.
pub const NAME_LEN_MAX: usize = 255;
/// Longest accepted event id, in bytes. Event ids are stored once per applied
/// increment for the dedup window, so they are kept short.
pub const EVENT_ID_LEN_MAX: usize = 255;
/// Longest accepted writer id, in bytes.
pub const WRITER_LEN_MAX: usize = 255;
/// Longest accepted distinct-count member, in bytes (members are hashed, never stored).
pub const MEMBER_LEN_MAX: usize = 1024;

/// Why a client-chosen string was refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum NameError {
    /// The string was empty.
    #[error("{what} must not be empty")]
    Empty {
        /// Which field.
        what: &'static str,
    },
    /// The string was longer than its limit.
    #[error("{what} is {len} bytes long; the limit is {max}")]
    TooLong {
        /// Which field.
        what: &'static str,
        /// Its length in bytes.
        len: usize,
        /// The limit in bytes.
        max: usize,
    },
    /// The string held a byte outside `[A-Za-z0-9._:-]`.
    #[error("{what} may only contain A-Z a-z 0-9 . _ : - (found {found:?} at byte {at})")]
    BadChar {
        /// Which field.
        what: &'static str,
        /// The offending character.
        found: char,
        /// Its byte offset.
        at: usize,
    },
}

/// True for the bytes allowed in names and event ids.
fn allowed(b: u8) -> bool {
    b.is_ascii_alphanumeric() || matches!(b, b'.' | b'_' | b':' | b'-')
}

/// Checks `s` against the name alphabet and a length limit.
pub fn check_token(what: &'static str, s: &str, max: usize) -> Result<(), NameError> {
    if s.is_empty() {
        return Err(NameError::Empty { what });
    }
    if s.len() > max {
        return Err(NameError::TooLong { what, len: s.len(), max });
    }
    if let Some((at, b)) = s.bytes().enumerate().find(|(_, b)| !allowed(*b)) {
        let found = s[at..].chars().next().unwrap_or(b as char);
        return Err(NameError::BadChar { what, found, at });
    }
    Ok(())
}

/// Checks a free-form client string (writer id, member) for length only.
pub fn check_len(what: &'static str, s: &str, max: usize) -> Result<(), NameError> {
    if s.is_empty() {
        return Err(NameError::Empty { what });
    }
    if s.len() > max {
        return Err(NameError::TooLong { what, len: s.len(), max });
    }
    Ok(())
}

/// A validated counter name: 1–255 bytes of `[A-Za-z0-9._:-]`.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct CounterName(String);

impl CounterName {
    /// Validates and wraps a name.
    pub fn new(s: impl Into<String>) -> Result<Self, NameError> {
        let s = s.into();
        check_token("counter name", &s, NAME_LEN_MAX)?;
        Ok(Self(s))
    }

    /// The name as a string slice.
    pub fn as_str(&self) -> &str {
        &self.0
    }
}

impl TryFrom<String> for CounterName {
    type Error = NameError;
    fn try_from(s: String) -> Result<Self, NameError> {
        Self::new(s)
    }
}

impl From<CounterName> for String {
    fn from(n: CounterName) -> String {
        n.0
    }
}

impl fmt::Display for CounterName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(&self.0)
    }
}

impl fmt::Debug for CounterName {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "{:?}", self.0)
    }
}

// Hash and Eq of `CounterName` are those of its `String`, so maps keyed by names can
// be searched with a plain `&str` and no allocation on the hot path.
impl std::borrow::Borrow<str> for CounterName {
    fn borrow(&self) -> &str {
        &self.0
    }
}

impl AsRef<str> for CounterName {
    fn as_ref(&self) -> &str {
        &self.0
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_the_documented_alphabet() {
        assert!(CounterName::new("likes:42").is_ok());
        assert!(CounterName::new("a.b_c-d:E9").is_ok());
        assert!(CounterName::new("x".repeat(NAME_LEN_MAX)).is_ok());
    }

    #[test]
    fn refuses_empty_long_and_foreign_bytes() {
        assert_eq!(CounterName::new(""), Err(NameError::Empty { what: "counter name" }));
        assert!(matches!(
            CounterName::new("x".repeat(NAME_LEN_MAX + 1)),
            Err(NameError::TooLong { len: 256, .. })
        ));
        for bad in ["a b", "a/b", "é", "a\0", "a%2F", "💥"] {
            assert!(matches!(CounterName::new(bad), Err(NameError::BadChar { .. })), "{bad:?} was accepted");
        }
    }

    #[test]
    fn deserialization_validates() {
        let ok: Result<CounterName, _> = serde_json::from_str("\"likes:1\"");
        assert!(ok.is_ok());
        let bad: Result<CounterName, _> = serde_json::from_str("\"no spaces\"");
        assert!(bad.is_err());
    }
}
