//! The stored records of format 4 whose layout changed in format 5, frozen, and their
//! upgrade to today's.
//!
//! Format 5 added bounded counters: `min` and `max` fields in counter specs and spec
//! patches, and the shard's escrow ledger (its shares of the counter's headroom) in
//! shard images. Format 4's records are format 3's plus the sliding windows (see
//! [`super::v3`]); raft store format 3 laid out its counter specs and spec patches the
//! same way. A converted record has no bounds and no ledger, which is what it meant.
//! Nothing here is ever edited: a later format adds a module.

use crate::codec::DecodeError;
use crate::frequency::FrequencySpec;
use crate::meta::{CounterMeta, Layout, MetaCommand};
use crate::shard::ShardImage;
use crate::spec::{CounterSpec, Durability, RouterPolicy, SpecPatch};
use crate::window::WindowSet;
use serde::{Deserialize, Serialize};

/// [`CounterSpec`] as format 4 (raft store format 3) stored it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterSpecV4 {
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
}

impl From<CounterSpecV4> for CounterSpec {
    fn from(v: CounterSpecV4) -> Self {
        let CounterSpecV4 {
            shards,
            durability,
            flush_ms,
            rollup_ms,
            router,
            distinct,
            dedup_window_s,
            frequency,
            windows,
        } = v;
        // Format 4 had no bounds.
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
            min: None,
            max: None,
            limit: None,
            replicas: None,
        }
    }
}

/// [`SpecPatch`] as raft store format 3 stored it (inside raft log entries).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecPatchV4 {
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
}

impl From<SpecPatchV4> for SpecPatch {
    fn from(v: SpecPatchV4) -> Self {
        let SpecPatchV4 {
            shards,
            durability,
            flush_ms,
            rollup_ms,
            router,
            distinct,
            dedup_window_s,
            frequency,
            windows,
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
            min: None,
            max: None,
            limit: None,
            replicas: None,
        }
    }
}

/// [`CounterMeta`] as format 4 (raft store format 3) stored it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterMetaV4 {
    /// See [`CounterMeta::spec`].
    pub spec: CounterSpecV4,
    /// See [`CounterMeta::layout`].
    pub layout: Layout,
    /// See [`CounterMeta::created_at_ms`].
    pub created_at_ms: u64,
    /// See [`CounterMeta::version`].
    pub version: u64,
}

impl From<CounterMetaV4> for CounterMeta {
    fn from(v: CounterMetaV4) -> Self {
        CounterMeta {
            spec: v.spec.into(),
            layout: v.layout,
            created_at_ms: v.created_at_ms,
            version: v.version,
            expires_at_ms: None,
        }
    }
}

/// [`MetaCommand`] as raft store format 3 stored it (inside raft log entries).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MetaCommandV4 {
    /// See [`MetaCommand::Put`].
    Put(SpecPatchV4),
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

impl From<MetaCommandV4> for MetaCommand {
    fn from(v: MetaCommandV4) -> Self {
        match v {
            MetaCommandV4::Put(p) => MetaCommand::Put(p.into()),
            MetaCommandV4::Ensure => MetaCommand::Ensure,
            MetaCommandV4::CompleteReshard { generation, sealed_sum } => {
                MetaCommand::CompleteReshard { generation, sealed_sum }
            }
            MetaCommandV4::PruneSealed => MetaCommand::PruneSealed,
            MetaCommandV4::Delete => MetaCommand::Delete,
        }
    }
}

/// [`ShardImage`] as format 4 stored it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardImageV4 {
    /// See [`ShardImage::value`].
    pub value: i64,
    /// See [`ShardImage::sketch`].
    pub sketch: Option<Vec<u8>>,
    /// See [`ShardImage::frequency`].
    pub frequency: Option<Vec<u8>>,
    /// See [`ShardImage::windows`].
    pub windows: Option<Vec<u8>>,
}

impl From<ShardImageV4> for ShardImage {
    fn from(v: ShardImageV4) -> Self {
        ShardImage {
            value: v.value,
            sketch: v.sketch,
            frequency: v.frequency,
            windows: v.windows,
            escrow: None,
        }
    }
}

/// A format-4 shard image, as today's bytes.
pub fn upgrade_shard_image(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    super::v1::upgrade::<ShardImageV4, ShardImage>("format-4 shard image", bytes)
}

/// A format-4 counter's metadata (or a raft store format 3 counter record), as
/// today's bytes.
pub fn upgrade_counter_meta(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    super::v1::upgrade::<CounterMetaV4, CounterMeta>("format-4 counter metadata", bytes)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::{decode, encode};

    fn spec_v4() -> CounterSpecV4 {
        CounterSpecV4 {
            shards: 4,
            durability: Durability::Sync,
            flush_ms: 10,
            rollup_ms: 0,
            router: RouterPolicy::Event,
            distinct: true,
            dedup_window_s: 60,
            frequency: Some(FrequencySpec { epsilon: 0.01, delta: 0.001 }),
            windows: WindowSet::parse(&["1m", "1h"]).unwrap(),
        }
    }

    #[test]
    fn format_four_records_upgrade_with_no_bounds() {
        let image = ShardImageV4 {
            value: 9,
            sketch: Some(vec![4]),
            frequency: Some(vec![5, 6]),
            windows: Some(vec![7, 8, 9]),
        };
        let up: ShardImage = decode("image", &upgrade_shard_image(&encode(&image)).unwrap()).unwrap();
        let want = ShardImage {
            value: 9,
            sketch: Some(vec![4]),
            frequency: Some(vec![5, 6]),
            windows: Some(vec![7, 8, 9]),
            escrow: None,
        };
        assert_eq!(up, want);
        assert_eq!(upgrade_shard_image(&encode(&image)).unwrap(), encode(&want), "today's bytes exactly");

        let spec = spec_v4();
        let layout = Layout { generation: 2, shards: 4, base: 3, sealed: vec![], resharding: None };
        let meta = CounterMetaV4 { spec, layout: layout.clone(), created_at_ms: 1, version: 2 };
        let up: CounterMeta = decode("meta", &upgrade_counter_meta(&encode(&meta)).unwrap()).unwrap();
        assert_eq!((up.spec.shards, up.spec.frequency, up.spec.windows), (4, spec.frequency, spec.windows));
        assert_eq!((up.spec.router, up.spec.distinct, up.layout), (RouterPolicy::Event, true, layout));
        assert_eq!((up.spec.min, up.spec.max, up.spec.bounded()), (None, None, false));
        assert_eq!((up.created_at_ms, up.version), (1, 2));

        let windows = Some(WindowSet::parse(&["1d"]).unwrap());
        let put = MetaCommandV4::Put(SpecPatchV4 { distinct: Some(true), windows, ..Default::default() });
        let MetaCommand::Put(p) = MetaCommand::from(put) else { panic!("a put stays a put") };
        assert_eq!((p.distinct, p.windows, p.min, p.max), (Some(true), windows, None, None));
        let done = MetaCommandV4::CompleteReshard { generation: 3, sealed_sum: -5 };
        assert_eq!(MetaCommand::from(done), MetaCommand::CompleteReshard { generation: 3, sealed_sum: -5 });
    }

    #[test]
    fn records_of_other_formats_are_not_format_four() {
        // Today's image has a trailing field, format 3's lacks one: both refused.
        let today = ShardImage {
            value: 1,
            sketch: None,
            frequency: None,
            windows: Some(vec![1]),
            escrow: Some(vec![2]),
        };
        assert!(upgrade_shard_image(&encode(&today)).is_err(), "a trailing field is refused");
        let format_3 = super::super::v3::ShardImageV3 { value: 1, sketch: None, frequency: None };
        assert!(upgrade_shard_image(&encode(&format_3)).is_err(), "a missing field is refused");
        let bounded = CounterMeta {
            spec: CounterSpec { min: Some(0), durability: Durability::Sync, ..CounterSpec::default() },
            layout: Layout { generation: 0, shards: 8, base: 0, sealed: vec![], resharding: None },
            created_at_ms: 1,
            version: 1,
            expires_at_ms: None,
        };
        assert!(upgrade_counter_meta(&encode(&bounded)).is_err());
        assert!(upgrade_counter_meta(&[0xff; 4]).is_err());
    }
}
