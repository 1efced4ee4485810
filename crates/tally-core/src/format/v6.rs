//! The stored records of format 6 whose layout changed in format 8, frozen, and their
//! upgrade to today's.
//!
//! Format 8 (raft store format 7) added a counter's own replica count: a `replicas`
//! field in counter specs and spec patches. Engine store formats 6 and 7 laid out
//! their counter specs the same way (format 7 only let shard images carry dedup
//! records), as did raft store format 6. Shard images did not change, and neither
//! did the encoding of a shard's id: a counter without a replica count of its own
//! is in the cluster's class, whose ids encode as they always did. A converted record
//! has no replica count of its own, which is what it meant. Nothing here is ever
//! edited: a later format adds a module.

use crate::codec::DecodeError;
use crate::frequency::FrequencySpec;
use crate::meta::{CounterMeta, Layout, MetaCommand};
use crate::spec::{CounterSpec, Durability, RouterPolicy, SpecPatch, WindowLimit};
use crate::window::WindowSet;
use serde::{Deserialize, Serialize};

/// [`CounterSpec`] as engine store formats 6 and 7 (raft store format 6) stored it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterSpecV6 {
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
    /// See [`CounterSpec::limit`].
    pub limit: Option<WindowLimit>,
}

impl From<CounterSpecV6> for CounterSpec {
    fn from(v: CounterSpecV6) -> Self {
        let CounterSpecV6 {
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
            limit,
        } = v;
        // Format 6 had no replica counts of counters' own.
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
            limit,
            replicas: None,
        }
    }
}

/// [`SpecPatch`] as raft store format 6 stored it (inside raft log entries).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecPatchV6 {
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
    /// See [`SpecPatch::limit`].
    pub limit: Option<WindowLimit>,
}

impl From<SpecPatchV6> for SpecPatch {
    fn from(v: SpecPatchV6) -> Self {
        let SpecPatchV6 {
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
            limit,
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
            limit,
            replicas: None,
        }
    }
}

/// [`CounterMeta`] as engine store formats 6 and 7 (raft store format 6) stored it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterMetaV6 {
    /// See [`CounterMeta::spec`].
    pub spec: CounterSpecV6,
    /// See [`CounterMeta::layout`].
    pub layout: Layout,
    /// See [`CounterMeta::created_at_ms`].
    pub created_at_ms: u64,
    /// See [`CounterMeta::version`].
    pub version: u64,
}

impl From<CounterMetaV6> for CounterMeta {
    fn from(v: CounterMetaV6) -> Self {
        CounterMeta {
            spec: v.spec.into(),
            layout: v.layout,
            created_at_ms: v.created_at_ms,
            version: v.version,
            expires_at_ms: None,
        }
    }
}

/// [`MetaCommand`] as raft store format 6 stored it (inside raft log entries).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MetaCommandV6 {
    /// See [`MetaCommand::Put`].
    Put(SpecPatchV6),
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

impl From<MetaCommandV6> for MetaCommand {
    fn from(v: MetaCommandV6) -> Self {
        match v {
            MetaCommandV6::Put(p) => MetaCommand::Put(p.into()),
            MetaCommandV6::Ensure => MetaCommand::Ensure,
            MetaCommandV6::CompleteReshard { generation, sealed_sum } => {
                MetaCommand::CompleteReshard { generation, sealed_sum }
            }
            MetaCommandV6::PruneSealed => MetaCommand::PruneSealed,
            MetaCommandV6::Delete => MetaCommand::Delete,
        }
    }
}

/// A counter's metadata of engine store format 6 or 7 (or a raft store format 6
/// counter record), as today's bytes.
pub fn upgrade_counter_meta(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    super::v1::upgrade::<CounterMetaV6, CounterMeta>("format-6 counter metadata", bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{decode, encode};

    fn spec_v6() -> CounterSpecV6 {
        CounterSpecV6 {
            shards: 4,
            durability: Durability::Sync,
            flush_ms: 10,
            rollup_ms: 0,
            router: RouterPolicy::Event,
            distinct: true,
            dedup_window_s: 60,
            frequency: Some(FrequencySpec { epsilon: 0.01, delta: 0.001 }),
            windows: WindowSet::parse(&["1m", "1h"]).unwrap(),
            min: None,
            max: None,
            limit: Some(WindowLimit::parse("1m", 100).unwrap()),
        }
    }

    fn layout() -> Layout {
        Layout { generation: 2, shards: 4, base: 3, sealed: vec![], resharding: None }
    }

    #[test]
    fn format_six_records_upgrade_with_their_limit_and_the_clusters_replicas() {
        let spec = spec_v6();
        let meta = CounterMetaV6 { spec, layout: layout(), created_at_ms: 1, version: 2 };
        let bytes = upgrade_counter_meta(&encode(&meta)).unwrap();
        let up: CounterMeta = decode("meta", &bytes).unwrap();
        assert_eq!((up.spec.shards, up.spec.frequency, up.spec.windows), (4, spec.frequency, spec.windows));
        assert_eq!((up.spec.router, up.spec.distinct, &up.layout), (RouterPolicy::Event, true, &layout()));
        assert_eq!((up.spec.limit, up.spec.replicas), (spec.limit, None));
        assert_eq!(up.spec.replica_class(), crate::ids::CLUSTER_REPLICAS);
        assert_eq!((up.created_at_ms, up.version), (1, 2));
        assert_eq!(bytes, encode(&CounterMeta::from(meta.clone())), "today's bytes exactly");
        assert!(decode::<CounterMeta>("meta", &encode(&meta)).is_err(), "format 6's bytes are not today's");

        let patch = SpecPatchV6 { distinct: Some(true), limit: spec.limit, ..Default::default() };
        let MetaCommand::Put(p) = MetaCommand::from(MetaCommandV6::Put(patch)) else {
            panic!("a put stays a put")
        };
        assert_eq!((p.distinct, p.limit, p.replicas), (Some(true), spec.limit, None));
        let done = MetaCommandV6::CompleteReshard { generation: 3, sealed_sum: -5 };
        assert_eq!(MetaCommand::from(done), MetaCommand::CompleteReshard { generation: 3, sealed_sum: -5 });
        assert_eq!(MetaCommand::from(MetaCommandV6::Delete), MetaCommand::Delete);
    }

    #[test]
    fn records_of_other_formats_are_not_format_six() {
        let spec = CounterSpec { replicas: Some(3), ..CounterSpec::default() };
        let today = CounterMeta { spec, layout: layout(), created_at_ms: 1, version: 1, expires_at_ms: None };
        assert!(upgrade_counter_meta(&encode(&today)).is_err(), "today's record is refused");
        let plain = CounterMeta {
            spec: CounterSpec::default(),
            layout: layout(),
            created_at_ms: 1,
            version: 1,
            expires_at_ms: None,
        };
        assert!(upgrade_counter_meta(&encode(&plain)).is_err(), "today's record without replicas too");
        let format_5 = super::super::v5::CounterMetaV5 {
            spec: super::super::v5::CounterSpecV5 {
                shards: 4,
                durability: Durability::Sync,
                flush_ms: 10,
                rollup_ms: 0,
                router: RouterPolicy::Event,
                distinct: false,
                dedup_window_s: 60,
                frequency: None,
                windows: WindowSet::NONE,
                min: None,
                max: None,
            },
            layout: layout(),
            created_at_ms: 1,
            version: 1,
        };
        assert!(upgrade_counter_meta(&encode(&format_5)).is_err(), "format 5's record is refused");
        assert!(upgrade_counter_meta(&[0xff; 4]).is_err());
    }
}
