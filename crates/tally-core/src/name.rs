//! Counter names and event ids: the only strings a client chooses.
//!
//! Event ids (and writer ids, node ids, token names) are bounded and restricted to
//! a small alphabet, `[A-Za-z0-9._:-]`, so they can be used as storage keys, metric
//! labels and URL path segments without escaping.
//!
//! A counter name is any byte string of 1 to [`NAME_BYTES_MAX`] bytes: a Redis key
//! (spaces, `{hash tags}`, `@`, `/`, UTF-8, any byte), or an HTTP path segment once
//! percent-decoded. [`CounterName`] holds it in its **escaped form**: the bytes of
//! that alphabet as they are, every other byte as `%` and two uppercase hex digits
//! (`a b` is `a%20b`, `ü` is `%C3%BC`, `%` itself `%25`). The escaped form is
//! unique for each name (an escape never stands for a byte of the alphabet, and hex
//! is uppercase), so the name's bytes come back exactly ([`CounterName::bytes`]);
//! it is ASCII, so store keys, metadata, metric labels and URL paths carry it as
//! they carried names before; and a name made only of the alphabet — every name
//! before names were widened — is its own escaped form, so data written then is
//! read unchanged. Escaping byte by byte keeps prefixes: the escaped form of a
//! prefix of a name is a prefix of the name's, which namespaces, listings and
//! token prefixes rely on.

use serde::{Deserialize, Serialize};
use std::fmt;

/// Longest accepted counter name, in bytes of the name itself (a RESP key, or an
/// HTTP path segment percent-decoded). Redis allows far longer keys; 512 B holds
/// any realistic key (Redis's docs advise short ones) while keeping a name's store
/// keys and metadata records small.
pub const NAME_BYTES_MAX: usize = 512;
/// Longest escaped form of a counter name, in bytes: each byte of a name takes at
/// most three (`%XX`).
pub const NAME_LEN_MAX: usize = 3 * NAME_BYTES_MAX;
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
    /// An escaped counter name that is not the escaped form of any name: a byte
    /// outside the alphabet unescaped, or an escape that is not `%` and two
    /// uppercase hex digits of a byte outside it.
    #[error(
        "an escaped counter name holds A-Z a-z 0-9 . _ : - and %XX (uppercase hex) for every other byte \
         (found {found:?} at byte {at})"
    )]
    BadEscape {
        /// What was found there.
        found: String,
        /// Its byte offset.
        at: usize,
    },
    /// A percent-encoded path segment with a `%` not followed by two hex digits.
    #[error("a % in a path segment must be followed by two hex digits (found {found:?} at byte {at})")]
    BadPercent {
        /// What was found there.
        found: String,
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

const HEX: &[u8; 16] = b"0123456789ABCDEF";

/// The escaped form of the bytes `raw` (see the module docs), unchecked for length.
pub fn escape(raw: &[u8]) -> String {
    let mut out = String::with_capacity(raw.len());
    for &b in raw {
        if allowed(b) {
            out.push(b as char);
        } else {
            out.push('%');
            out.push(HEX[usize::from(b >> 4)] as char);
            out.push(HEX[usize::from(b & 15)] as char);
        }
    }
    out
}

fn hex_digit(b: u8) -> Option<u8> {
    match b {
        b'0'..=b'9' => Some(b - b'0'),
        b'A'..=b'F' => Some(b - b'A' + 10),
        _ => None,
    }
}

/// The bytes an escaped form stands for, or where it is not one.
fn unescape(s: &str) -> Result<Vec<u8>, NameError> {
    let bytes = s.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        let b = bytes[i];
        if allowed(b) {
            out.push(b);
            i += 1;
            continue;
        }
        let escaped = match (
            b,
            bytes.get(i + 1).copied().and_then(hex_digit),
            bytes.get(i + 2).copied().and_then(hex_digit),
        ) {
            (b'%', Some(hi), Some(lo)) => Some(hi << 4 | lo).filter(|&v| !allowed(v)),
            _ => None,
        };
        match escaped {
            Some(v) => {
                out.push(v);
                i += 3;
            }
            None => {
                let end = (i + 3).min(bytes.len());
                let found = String::from_utf8_lossy(&bytes[i..end]).into_owned();
                return Err(NameError::BadEscape { found, at: i });
            }
        }
    }
    Ok(out)
}

/// Checks a counter name's length in bytes of the name itself.
fn check_name_len(len: usize) -> Result<(), NameError> {
    if len == 0 {
        return Err(NameError::Empty { what: "counter name" });
    }
    if len > NAME_BYTES_MAX {
        return Err(NameError::TooLong { what: "counter name", len, max: NAME_BYTES_MAX });
    }
    Ok(())
}

/// A validated counter name, held in its escaped form (see the module docs): 1 to
/// [`NAME_BYTES_MAX`] bytes of any value.
#[derive(Clone, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(try_from = "String", into = "String")]
pub struct CounterName(String);

impl CounterName {
    /// Validates and wraps a name given in its escaped form (a name of
    /// `[A-Za-z0-9._:-]` only is its own escaped form).
    pub fn new(s: impl Into<String>) -> Result<Self, NameError> {
        let s = s.into();
        if s.len() > NAME_LEN_MAX {
            return Err(NameError::TooLong { what: "counter name", len: s.len(), max: NAME_LEN_MAX });
        }
        check_name_len(unescape(&s)?.len())?;
        Ok(Self(s))
    }

    /// The name whose bytes are `raw` (a Redis key, a decoded path segment).
    pub fn from_bytes(raw: &[u8]) -> Result<Self, NameError> {
        check_name_len(raw.len())?;
        Ok(Self(escape(raw)))
    }

    /// The name in its escaped form: what the store, the metadata and URLs carry.
    pub fn as_str(&self) -> &str {
        &self.0
    }

    /// The name's own bytes.
    pub fn bytes(&self) -> Vec<u8> {
        unescape(&self.0).expect("a counter name holds a valid escaped form")
    }
}

/// The bytes of a URL path segment, percent-decoded: `%` and two hex digits of
/// either case stand for that byte, anything else for itself (RFC 3986: `+` is
/// not a space in a path). A `%` not followed by two hex digits is refused.
pub fn percent_decode(segment: &str) -> Result<Vec<u8>, NameError> {
    let bytes = segment.as_bytes();
    let mut out = Vec::with_capacity(bytes.len());
    let mut i = 0;
    while i < bytes.len() {
        if bytes[i] != b'%' {
            out.push(bytes[i]);
            i += 1;
            continue;
        }
        let digit = |j: usize| bytes.get(j).map(u8::to_ascii_uppercase).and_then(hex_digit);
        match (digit(i + 1), digit(i + 2)) {
            (Some(hi), Some(lo)) => {
                out.push(hi << 4 | lo);
                i += 3;
            }
            _ => {
                let end = (i + 3).min(bytes.len());
                let found = String::from_utf8_lossy(&bytes[i..end]).into_owned();
                return Err(NameError::BadPercent { found, at: i });
            }
        }
    }
    Ok(out)
}

/// The bytes an escaped counter name (or a prefix of one) stands for; the text
/// itself if it is not an escaped form.
pub fn unescaped(escaped: &str) -> Vec<u8> {
    unescape(escaped).unwrap_or_else(|_| escaped.as_bytes().to_vec())
}

/// How an escaped counter name (or prefix) is shown in text (JSON bodies, logs):
/// the name itself when it is UTF-8, else its escaped form.
pub fn shown(escaped: &str) -> String {
    String::from_utf8(unescaped(escaped)).unwrap_or_else(|_| escaped.to_owned())
}

/// How an escaped counter name (or prefix) is quoted in a message (errors over
/// HTTP and RESP, logs): [`shown`] in double quotes, its `"`, `\` and control
/// characters escaped with a backslash, so a message stays one line whatever the
/// name holds (`a b` is `"a b"`, `ü` is `"ü"`, the byte `FF` is `"%FF"`).
pub fn quoted(escaped: &str) -> String {
    format!("{:?}", shown(escaped))
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
        assert!(CounterName::new("x".repeat(NAME_BYTES_MAX)).is_ok());
    }

    #[test]
    fn refuses_empty_long_and_unescaped_bytes() {
        assert_eq!(CounterName::new(""), Err(NameError::Empty { what: "counter name" }));
        assert!(matches!(
            CounterName::new("x".repeat(NAME_BYTES_MAX + 1)),
            Err(NameError::TooLong { len: 513, max: NAME_BYTES_MAX, .. })
        ));
        // Escaped forms that stand for no name, or not uniquely.
        for bad in ["a b", "a/b", "é", "a\0", "💥", "a%2f", "a%2", "%41", "%", "a%G0"] {
            assert!(
                matches!(CounterName::new(bad), Err(NameError::BadEscape { .. })),
                "{bad:?} was accepted"
            );
        }
    }

    #[test]
    fn any_bytes_make_a_name_and_come_back_exactly() {
        let keys: [&[u8]; 8] = [
            b"user:{42}:hits",
            b"a b",
            b"a/b@c",
            "ключ:üñí".as_bytes(),
            b"100%",
            b"\x00\xff\r\n",
            b"likes:42",
            b"%41",
        ];
        for raw in keys {
            let name = CounterName::from_bytes(raw).unwrap();
            assert_eq!(name.bytes(), raw);
            assert!(name.as_str().is_ascii());
            assert_eq!(CounterName::new(name.as_str()).unwrap(), name, "the escaped form is accepted back");
        }
        assert_eq!(CounterName::from_bytes(b"likes:42").unwrap().as_str(), "likes:42", "old names unchanged");
        assert_eq!(CounterName::from_bytes(b"a b/%").unwrap().as_str(), "a%20b%2F%25");
        assert!(CounterName::from_bytes(&[0xC3; NAME_BYTES_MAX]).is_ok());
        assert!(matches!(
            CounterName::from_bytes(&[b'x'; NAME_BYTES_MAX + 1]),
            Err(NameError::TooLong { len: 513, .. })
        ));
        assert_eq!(CounterName::from_bytes(b""), Err(NameError::Empty { what: "counter name" }));
        // A prefix's escaped form is a prefix of the name's.
        let name = CounterName::from_bytes("tenant/ä:1".as_bytes()).unwrap();
        assert!(name.as_str().starts_with(&escape("tenant/ä".as_bytes())));
        assert_eq!(shown(name.as_str()), "tenant/ä:1");
        assert_eq!(shown("a%FF"), "a%FF", "not UTF-8: shown escaped");
        assert_eq!(quoted("a%20b"), r#""a b""#);
        assert_eq!(quoted("say%20%22hi%22%0A"), r#""say \"hi\"\n""#);
        assert_eq!(quoted("%C3%BC%25"), r#""ü%""#);
        assert_eq!(quoted("a%FF"), r#""a%FF""#);
    }

    #[test]
    fn a_path_segment_decodes_to_the_bytes_it_stands_for() {
        assert_eq!(percent_decode("a%20b%2fc%FF+").unwrap(), b"a b/c\xff+");
        assert_eq!(percent_decode("likes:42").unwrap(), b"likes:42");
        assert!(matches!(percent_decode("a%2"), Err(NameError::BadPercent { at: 1, .. })));
        assert!(matches!(percent_decode("%zz"), Err(NameError::BadPercent { at: 0, .. })));
        let name = CounterName::from_bytes(&percent_decode("%7Bu%7D%40x%C3%BC").unwrap()).unwrap();
        assert_eq!(name.bytes(), "{u}@xü".as_bytes());
    }

    #[test]
    fn deserialization_validates() {
        let ok: Result<CounterName, _> = serde_json::from_str("\"likes:1\"");
        assert!(ok.is_ok());
        let bad: Result<CounterName, _> = serde_json::from_str("\"no spaces\"");
        assert!(bad.is_err());
    }
}
