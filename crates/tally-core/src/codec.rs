//! The one place that knows the byte encoding of what is stored and what crosses the
//! wire. Everything is bincode 2 (standard configuration) over serde; swapping the
//! format means changing this module only.

use serde::{de::DeserializeOwned, Serialize};

/// Largest value the codec will decode, in bytes. Anything bigger is refused before
/// allocation, so a corrupt length prefix cannot exhaust memory.
pub const DECODE_BYTES_MAX: usize = 64 << 20;

/// Largest request or reply body one node sends another over the node-to-node
/// transport, in bytes: the transport refuses bigger ones, so whatever travels in
/// one request (a raft append of a range group, a snapshot frame) is bounded to
/// fit, with room for the envelopes around it.
pub const NODE_MESSAGE_BYTES_MAX: usize = 8 << 20;

/// Why bytes could not be decoded.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("cannot decode {what}: {reason}")]
pub struct DecodeError {
    /// What was being decoded.
    pub what: &'static str,
    /// The decoder's explanation.
    pub reason: String,
}

fn config() -> impl bincode::config::Config {
    bincode::config::standard().with_limit::<DECODE_BYTES_MAX>()
}

/// Encodes `value`. Encoding plain data into a `Vec` cannot fail.
pub fn encode<T: Serialize>(value: &T) -> Vec<u8> {
    bincode::serde::encode_to_vec(value, config()).expect("encoding plain data into a Vec cannot fail")
}

/// How many bytes [`encode`] makes of `value`, counted without building them.
pub fn encoded_len<T: Serialize>(value: &T) -> usize {
    let mut size = bincode::enc::write::SizeWriter::default();
    bincode::serde::encode_into_writer(value, &mut size, config())
        .expect("encoding plain data into a counter cannot fail");
    size.bytes_written
}

/// Decodes a `T` that must span all of `bytes`.
pub fn decode<T: DeserializeOwned>(what: &'static str, bytes: &[u8]) -> Result<T, DecodeError> {
    let (value, used) = bincode::serde::decode_from_slice(bytes, config())
        .map_err(|e| DecodeError { what, reason: e.to_string() })?;
    if used != bytes.len() {
        return Err(DecodeError { what, reason: format!("{} trailing bytes", bytes.len() - used) });
    }
    Ok(value)
}

/// Decodes a `T` at the start of `bytes`; returns it and how many bytes it took (the
/// rest is the caller's: a record followed by another one).
pub fn decode_prefix<T: DeserializeOwned>(
    what: &'static str,
    bytes: &[u8],
) -> Result<(T, usize), DecodeError> {
    bincode::serde::decode_from_slice(bytes, config())
        .map_err(|e| DecodeError { what, reason: e.to_string() })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn round_trips_and_refuses_garbage() {
        let v: (u32, String, i64) = (7, "likes".into(), -3);
        let bytes = encode(&v);
        assert_eq!(decode::<(u32, String, i64)>("tuple", &bytes), Ok(v.clone()));
        assert!(decode::<(u32, String, i64)>("tuple", &bytes[..bytes.len() - 1]).is_err());
        let mut long = bytes.clone();
        long.push(0);
        assert!(decode::<(u32, String, i64)>("tuple", &long).is_err());
        assert_eq!(decode_prefix::<(u32, String, i64)>("tuple", &long), Ok((v.clone(), bytes.len())));
        assert_eq!(encoded_len(&v), bytes.len());
    }
}
