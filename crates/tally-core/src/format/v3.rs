//! The stored records of formats 2 and 3 whose layout changed in format 4, frozen, and
//! their upgrade to today's.
//!
//! Format 4 added the counter's sliding windows: a `windows` field in counter specs and
//! spec patches, and the shard's window buckets in shard images. Formats 2 and 3 laid
//! these records out the same way (format 3 changed only the bytes of a distinct
//! sketch, see [`super::v2`]), so one frozen copy serves both; a converted record has
//! no windows, which is what it meant. Nothing here is ever edited: a later format adds
//! a module.

use crate::codec::{decode, encode, DecodeError};
use crate::frequency::FrequencySpec;
use crate::meta::{CounterMeta, Layout, MetaCommand};
use crate::shard::ShardImage;
use crate::spec::{CounterSpec, Durability, RouterPolicy, SpecPatch};
use crate::window::WindowSet;
use serde::{Deserialize, Serialize};

/// [`CounterSpec`] as formats 2 and 3 stored it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterSpecV3 {
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
}

impl From<CounterSpecV3> for CounterSpec {
    fn from(v: CounterSpecV3) -> Self {
        let CounterSpecV3 {
            shards,
            durability,
            flush_ms,
            rollup_ms,
            router,
            distinct,
            dedup_window_s,
            frequency,
        } = v;
        // Formats 2 and 3 had no windows.
        CounterSpec {
            shards,
            durability,
            flush_ms,
            rollup_ms,
            router,
            distinct,
            dedup_window_s,
            frequency,
            windows: WindowSet::NONE,
            min: None,
            max: None,
            limit: None,
            replicas: None,
        }
    }
}

/// [`SpecPatch`] as formats 2 and 3 stored it (inside raft log entries).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecPatchV3 {
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
}

impl From<SpecPatchV3> for SpecPatch {
    fn from(v: SpecPatchV3) -> Self {
        let SpecPatchV3 {
            shards,
            durability,
            flush_ms,
            rollup_ms,
            router,
            distinct,
            dedup_window_s,
            frequency,
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
            windows: None,
            min: None,
            max: None,
            limit: None,
            replicas: None,
        }
    }
}

/// [`CounterMeta`] as formats 2 and 3 stored it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterMetaV3 {
    /// See [`CounterMeta::spec`].
    pub spec: CounterSpecV3,
    /// See [`CounterMeta::layout`].
    pub layout: Layout,
    /// See [`CounterMeta::created_at_ms`].
    pub created_at_ms: u64,
    /// See [`CounterMeta::version`].
    pub version: u64,
}

impl From<CounterMetaV3> for CounterMeta {
    fn from(v: CounterMetaV3) -> Self {
        CounterMeta {
            spec: v.spec.into(),
            layout: v.layout,
            created_at_ms: v.created_at_ms,
            version: v.version,
            expires_at_ms: None,
        }
    }
}

/// [`MetaCommand`] as formats 2 and 3 stored it (inside raft log entries).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MetaCommandV3 {
    /// See [`MetaCommand::Put`].
    Put(SpecPatchV3),
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

impl From<MetaCommandV3> for MetaCommand {
    fn from(v: MetaCommandV3) -> Self {
        match v {
            MetaCommandV3::Put(p) => MetaCommand::Put(p.into()),
            MetaCommandV3::Ensure => MetaCommand::Ensure,
            MetaCommandV3::CompleteReshard { generation, sealed_sum } => {
                MetaCommand::CompleteReshard { generation, sealed_sum }
            }
            MetaCommandV3::PruneSealed => MetaCommand::PruneSealed,
            MetaCommandV3::Delete => MetaCommand::Delete,
        }
    }
}

/// [`ShardImage`] as formats 2 and 3 stored it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardImageV3 {
    /// See [`ShardImage::value`].
    pub value: i64,
    /// See [`ShardImage::sketch`].
    pub sketch: Option<Vec<u8>>,
    /// See [`ShardImage::frequency`].
    pub frequency: Option<Vec<u8>>,
}

impl From<ShardImageV3> for ShardImage {
    fn from(v: ShardImageV3) -> Self {
        ShardImage { value: v.value, sketch: v.sketch, frequency: v.frequency, windows: None, escrow: None }
    }
}

/// A format-3 shard image, as today's bytes.
pub fn upgrade_shard_image(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    super::v1::upgrade::<ShardImageV3, ShardImage>("format-3 shard image", bytes)
}

/// A format-2 or format-3 counter's metadata, as today's bytes.
pub fn upgrade_counter_meta(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    super::v1::upgrade::<CounterMetaV3, CounterMeta>("format-3 counter metadata", bytes)
}

/// A format-2 or format-3 shard image decoded into today's type (its sketch bytes
/// as stored).
pub(crate) fn decode_shard_image(what: &'static str, bytes: &[u8]) -> Result<ShardImage, DecodeError> {
    decode::<ShardImageV3>(what, bytes).map(Into::into)
}

/// Today's bytes of a converted image.
pub(crate) fn encode_shard_image(image: &ShardImage) -> Vec<u8> {
    encode(image)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_three_records_upgrade_with_no_windows() {
        let image = ShardImageV3 { value: 9, sketch: Some(vec![4]), frequency: Some(vec![5, 6]) };
        let up: ShardImage = decode("image", &upgrade_shard_image(&encode(&image)).unwrap()).unwrap();
        assert_eq!(
            up,
            ShardImage {
                value: 9,
                sketch: Some(vec![4]),
                frequency: Some(vec![5, 6]),
                windows: None,
                escrow: None
            }
        );

        let f = FrequencySpec { epsilon: 0.01, delta: 0.001 };
        let spec = CounterSpecV3 {
            shards: 4,
            durability: Durability::Sync,
            flush_ms: 10,
            rollup_ms: 0,
            router: RouterPolicy::Event,
            distinct: true,
            dedup_window_s: 60,
            frequency: Some(f),
        };
        let layout = Layout { generation: 2, shards: 4, base: 3, sealed: vec![], resharding: None };
        let meta = CounterMetaV3 { spec, layout: layout.clone(), created_at_ms: 1, version: 2 };
        let up: CounterMeta = decode("meta", &upgrade_counter_meta(&encode(&meta)).unwrap()).unwrap();
        assert_eq!((up.spec.shards, up.spec.frequency, up.spec.windows), (4, Some(f), WindowSet::NONE));
        assert_eq!((up.spec.router, up.spec.distinct, up.layout), (RouterPolicy::Event, true, layout));
        assert_eq!((up.spec.min, up.spec.max), (None, None));

        let put = MetaCommandV3::Put(SpecPatchV3 { distinct: Some(true), ..Default::default() });
        let MetaCommand::Put(p) = MetaCommand::from(put) else { panic!("a put stays a put") };
        assert_eq!((p.distinct, p.windows), (Some(true), None));
    }

    #[test]
    fn todays_records_are_not_format_three() {
        let today =
            ShardImage { value: 1, sketch: None, frequency: None, windows: Some(vec![1]), escrow: None };
        assert!(upgrade_shard_image(&encode(&today)).is_err(), "a trailing field is refused");
        assert!(upgrade_counter_meta(&[0xff; 4]).is_err());
    }
}
