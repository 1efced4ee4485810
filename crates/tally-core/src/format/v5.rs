//! The stored records of format 5 whose layout changed in format 6, frozen, and their
//! upgrade to today's.
//!
//! Format 6 added window limits: a `limit` field (at most `max` per one of the
//! counter's sliding windows) in counter specs and spec patches. Format 5's records
//! are format 4's plus the bounds (see [`super::v4`]); raft store formats 4 and 5 laid
//! out their counter specs and spec patches the same way (format 5 only added auto
//! bounds beside them). Shard images did not change. A converted record has no limit,
//! which is what it meant. Nothing here is ever edited: a later format adds a module.

use crate::codec::DecodeError;
use crate::frequency::FrequencySpec;
use crate::meta::{CounterMeta, Layout, MetaCommand};
use crate::spec::{CounterSpec, Durability, RouterPolicy, SpecPatch};
use crate::window::WindowSet;
use serde::{Deserialize, Serialize};

/// [`CounterSpec`] as format 5 (raft store formats 4 and 5) stored it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterSpecV5 {
    /// See [`CounterSpec::shards`].
    pub shards: u16,
    /// See [`CounterSpec::durability`].
    pub durability: Durability,
    /// See [`CounterSpec::flush_ms`].
    pub flush_ms: u32,
    /// See [`CounterSpec::rollup_ms`].
    pub rollup_ms: u32,
    /// See [`CounterSpec::router`].
    pub router: RouterPolicy,
    /// See [`CounterSpec::distinct`].
    pub distinct: bool,
    /// See [`CounterSpec::dedup_window_s`].
    pub dedup_window_s: u32,
    /// See [`CounterSpec::frequency`].
    pub frequency: Option<FrequencySpec>,
    /// See [`CounterSpec::windows`].
    pub windows: WindowSet,
    /// See [`CounterSpec::min`].
    pub min: Option<i64>,
    /// See [`CounterSpec::max`].
    pub max: Option<i64>,
}

impl From<CounterSpecV5> for CounterSpec {
    fn from(v: CounterSpecV5) -> Self {
        let CounterSpecV5 {
            shards,
            durability,
            flush_ms,
            rollup_ms,
            router,
            distinct,
            dedup_window_s,
            frequency,
            windows,
            min,
            max,
        } = v;
        // Format 5 had no window limits.
        CounterSpec {
            shards,
            durability,
            flush_ms,
            rollup_ms,
            router,
            distinct,
            dedup_window_s,
            frequency,
            windows,
            min,
            max,
            limit: None,
            replicas: None,
        }
    }
}

/// [`SpecPatch`] as raft store formats 4 and 5 stored it (inside raft log entries).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecPatchV5 {
    /// See [`SpecPatch::shards`].
    pub shards: Option<u16>,
    /// See [`SpecPatch::durability`].
    pub durability: Option<Durability>,
    /// See [`SpecPatch::flush_ms`].
    pub flush_ms: Option<u32>,
    /// See [`SpecPatch::rollup_ms`].
    pub rollup_ms: Option<u32>,
    /// See [`SpecPatch::router`].
    pub router: Option<RouterPolicy>,
    /// See [`SpecPatch::distinct`].
    pub distinct: Option<bool>,
    /// See [`SpecPatch::dedup_window_s`].
    pub dedup_window_s: Option<u32>,
    /// See [`SpecPatch::frequency`].
    pub frequency: Option<FrequencySpec>,
    /// See [`SpecPatch::windows`].
    pub windows: Option<WindowSet>,
    /// See [`SpecPatch::min`].
    pub min: Option<i64>,
    /// See [`SpecPatch::max`].
    pub max: Option<i64>,
}

impl From<SpecPatchV5> for SpecPatch {
    fn from(v: SpecPatchV5) -> Self {
        let SpecPatchV5 {
            shards,
            durability,
            flush_ms,
            rollup_ms,
            router,
            distinct,
            dedup_window_s,
            frequency,
            windows,
            min,
            max,
        } = v;
        SpecPatch {
            shards,
            durability,
            flush_ms,
            rollup_ms,
            router,
            distinct,
            dedup_window_s,
            frequency,
            windows,
            min,
            max,
            limit: None,
            replicas: None,
        }
    }
}

/// [`CounterMeta`] as format 5 (raft store formats 4 and 5) stored it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterMetaV5 {
    /// See [`CounterMeta::spec`].
    pub spec: CounterSpecV5,
    /// See [`CounterMeta::layout`].
    pub layout: Layout,
    /// See [`CounterMeta::created_at_ms`].
    pub created_at_ms: u64,
    /// See [`CounterMeta::version`].
    pub version: u64,
}

impl From<CounterMetaV5> for CounterMeta {
    fn from(v: CounterMetaV5) -> Self {
        CounterMeta {
            spec: v.spec.into(),
            layout: v.layout,
            created_at_ms: v.created_at_ms,
            version: v.version,
            expires_at_ms: None,
        }
    }
}

/// [`MetaCommand`] as raft store formats 4 and 5 stored it (inside raft log entries).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MetaCommandV5 {
    /// See [`MetaCommand::Put`].
    Put(SpecPatchV5),
    /// See [`MetaCommand::Ensure`].
    Ensure,
    /// See [`MetaCommand::CompleteReshard`].
    CompleteReshard {
        /// The sealed generation.
        generation: u32,
        /// Sum of its final shard values.
        sealed_sum: i128,
    },
    /// See [`MetaCommand::PruneSealed`].
    PruneSealed,
    /// See [`MetaCommand::Delete`].
    Delete,
}

impl From<MetaCommandV5> for MetaCommand {
    fn from(v: MetaCommandV5) -> Self {
        match v {
            MetaCommandV5::Put(p) => MetaCommand::Put(p.into()),
            MetaCommandV5::Ensure => MetaCommand::Ensure,
            MetaCommandV5::CompleteReshard { generation, sealed_sum } => {
                MetaCommand::CompleteReshard { generation, sealed_sum }
            }
            MetaCommandV5::PruneSealed => MetaCommand::PruneSealed,
            MetaCommandV5::Delete => MetaCommand::Delete,
        }
    }
}

/// A format-5 counter's metadata (or a raft store format 4 or 5 counter record), as
/// today's bytes.
pub fn upgrade_counter_meta(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    super::v1::upgrade::<CounterMetaV5, CounterMeta>("format-5 counter metadata", bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{decode, encode};
    use crate::spec::WindowLimit;

    fn spec_v5() -> CounterSpecV5 {
        CounterSpecV5 {
            shards: 4,
            durability: Durability::Sync,
            flush_ms: 10,
            rollup_ms: 0,
            router: RouterPolicy::Event,
            distinct: true,
            dedup_window_s: 60,
            frequency: Some(FrequencySpec { epsilon: 0.01, delta: 0.001 }),
            windows: WindowSet::parse(&["1m", "1h"]).unwrap(),
            min: Some(-5),
            max: Some(1_000),
        }
    }

    fn layout() -> Layout {
        Layout { generation: 2, shards: 4, base: 3, sealed: vec![], resharding: None }
    }

    #[test]
    fn format_five_records_upgrade_with_their_bounds_and_no_limit() {
        let spec = spec_v5();
        let meta = CounterMetaV5 { spec, layout: layout(), created_at_ms: 1, version: 2 };
        let bytes = upgrade_counter_meta(&encode(&meta)).unwrap();
        let up: CounterMeta = decode("meta", &bytes).unwrap();
        assert_eq!((up.spec.shards, up.spec.frequency, up.spec.windows), (4, spec.frequency, spec.windows));
        assert_eq!((up.spec.router, up.spec.distinct, &up.layout), (RouterPolicy::Event, true, &layout()));
        assert_eq!((up.spec.min, up.spec.max, up.spec.limit), (Some(-5), Some(1_000), None));
        assert_eq!((up.created_at_ms, up.version), (1, 2));
        assert_eq!(bytes, encode(&CounterMeta::from(meta.clone())), "today's bytes exactly");
        assert!(decode::<CounterMeta>("meta", &encode(&meta)).is_err(), "format 5's bytes are not today's");

        let windows = Some(WindowSet::parse(&["1d"]).unwrap());
        let patch = SpecPatchV5 { distinct: Some(true), windows, min: Some(0), ..Default::default() };
        let MetaCommand::Put(p) = MetaCommand::from(MetaCommandV5::Put(patch)) else {
            panic!("a put stays a put")
        };
        assert_eq!(
            (p.distinct, p.windows, p.min, p.max, p.limit),
            (Some(true), windows, Some(0), None, None)
        );
        let done = MetaCommandV5::CompleteReshard { generation: 3, sealed_sum: -5 };
        assert_eq!(MetaCommand::from(done), MetaCommand::CompleteReshard { generation: 3, sealed_sum: -5 });
        assert_eq!(MetaCommand::from(MetaCommandV5::Delete), MetaCommand::Delete);
    }

    #[test]
    fn records_of_other_formats_are_not_format_five() {
        // Today's spec has a field more, format 4's two fewer: both refused.
        let windows = WindowSet::parse(&["1m"]).unwrap();
        let limit = Some(WindowLimit::parse("1m", 100).unwrap());
        let spec = CounterSpec { durability: Durability::Sync, windows, limit, ..CounterSpec::default() };
        let limited =
            CounterMeta { spec, layout: layout(), created_at_ms: 1, version: 1, expires_at_ms: None };
        assert!(upgrade_counter_meta(&encode(&limited)).is_err(), "today's record is refused");
        let plain = CounterMeta {
            spec: CounterSpec::default(),
            layout: layout(),
            created_at_ms: 1,
            version: 1,
            expires_at_ms: None,
        };
        assert!(upgrade_counter_meta(&encode(&plain)).is_err(), "today's record without a limit too");
        let format_4 = super::super::v4::CounterMetaV4 {
            spec: super::super::v4::CounterSpecV4 {
                shards: 4,
                durability: Durability::Sync,
                flush_ms: 10,
                rollup_ms: 0,
                router: RouterPolicy::Event,
                distinct: false,
                dedup_window_s: 60,
                frequency: None,
                windows: WindowSet::NONE,
            },
            layout: layout(),
            created_at_ms: 1,
            version: 1,
        };
        assert!(upgrade_counter_meta(&encode(&format_4)).is_err(), "format 4's record is refused");
        assert!(upgrade_counter_meta(&[0xff; 4]).is_err());
    }
}
