//! The stored records of engine store format 8 (raft store formats 7 and 8) whose
//! layout changed in format 9 (raft store format 9), frozen, and their upgrade to
//! today's.
//!
//! Format 9 added a counter's expiry: `expires_at_ms` in counter metadata. Counter
//! specs, spec patches and shard images did not change, and a raft log entry of
//! formats 7 and 8 holds a command today's release decodes as it is (later commands were
//! added after the earlier ones). A converted record has no deadline, which is what
//! it meant. Nothing here is ever edited: a later format adds a module.

use crate::codec::DecodeError;
use crate::meta::{CounterMeta, Layout};
use crate::spec::CounterSpec;
use serde::{Deserialize, Serialize};

/// [`CounterMeta`] as engine store format 8 (raft store formats 7 and 8) stored it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterMetaV8 {
    /// See [`CounterMeta::spec`].
    pub spec: CounterSpec,
    /// See [`CounterMeta::layout`].
    pub layout: Layout,
    /// See [`CounterMeta::created_at_ms`].
    pub created_at_ms: u64,
    /// See [`CounterMeta::version`].
    pub version: u64,
}

impl From<CounterMetaV8> for CounterMeta {
    fn from(v: CounterMetaV8) -> Self {
        // Format 8 had no expiry.
        CounterMeta {
            spec: v.spec,
            layout: v.layout,
            created_at_ms: v.created_at_ms,
            version: v.version,
            expires_at_ms: None,
        }
    }
}

/// A counter's metadata of engine store format 8 (or a raft store format 7 or 8
/// counter record), as today's bytes.
pub fn upgrade_counter_meta(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    super::v1::upgrade::<CounterMetaV8, CounterMeta>("format-8 counter metadata", bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{decode, encode};

    fn layout() -> Layout {
        Layout { generation: 1, shards: 4, base: -3, sealed: vec![], resharding: Some(8) }
    }

    #[test]
    fn format_eight_records_upgrade_without_a_deadline() {
        let spec = CounterSpec { replicas: Some(3), min: Some(0), ..CounterSpec::default() };
        let meta = CounterMetaV8 { spec, layout: layout(), created_at_ms: 7, version: 9 };
        let bytes = upgrade_counter_meta(&encode(&meta)).unwrap();
        let up: CounterMeta = decode("meta", &bytes).unwrap();
        assert_eq!((up.spec, &up.layout, up.created_at_ms, up.version), (spec, &layout(), 7, 9));
        assert_eq!(up.expires_at_ms, None);
        assert_eq!(bytes, encode(&CounterMeta::from(meta.clone())), "today's bytes exactly");
        assert!(decode::<CounterMeta>("meta", &encode(&meta)).is_err(), "format 8's bytes are not today's");
    }

    #[test]
    fn todays_records_are_not_format_eight() {
        let today = CounterMeta {
            spec: CounterSpec::default(),
            layout: layout(),
            created_at_ms: 1,
            version: 1,
            expires_at_ms: Some(5),
        };
        assert!(upgrade_counter_meta(&encode(&today)).is_err(), "a trailing field is refused");
        assert!(upgrade_counter_meta(&[0xff; 4]).is_err());
    }
}
