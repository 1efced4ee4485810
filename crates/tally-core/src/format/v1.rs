//! The stored records of format 1, frozen, and their upgrade to today's records.
//!
//! The codec is positional (bincode): a struct that gains a field no longer decodes
//! the bytes an earlier release wrote. So every type a store holds whose layout
//! changed since format 1 has a frozen copy here, exactly as format 1 encoded it, and
//! a conversion into today's type (new fields take the value that means "as before").
//! Types whose layout never changed (layouts, sealed generations, dedup records) are
//! used as they are. Nothing here is ever edited: a later format adds a module.
//!
//! The `upgrade_*` functions turn format-1 bytes into today's bytes; a store runs them
//! over its records when it opens a format-1 directory (see `tally_store` and
//! `tally_raft`).

use crate::codec::{decode, encode, DecodeError};
use crate::meta::{CounterMeta, Layout, MetaCommand};
use crate::shard::ShardImage;
use crate::spec::{CounterSpec, Durability, RouterPolicy, SpecPatch};
use serde::{Deserialize, Serialize};

/// [`CounterSpec`] as format 1 stored it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterSpecV1 {
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
}

impl From<CounterSpecV1> for CounterSpec {
    fn from(v: CounterSpecV1) -> Self {
        let CounterSpecV1 { shards, durability, flush_ms, rollup_ms, router, distinct, dedup_window_s } = v;
        // Format 1 had no frequencies.
        CounterSpec {
            shards,
            durability,
            flush_ms,
            rollup_ms,
            router,
            distinct,
            dedup_window_s,
            frequency: None,
            windows: crate::window::WindowSet::NONE,
            min: None,
            max: None,
            limit: None,
            replicas: None,
        }
    }
}

/// [`SpecPatch`] as format 1 stored it (inside raft log entries).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpecPatchV1 {
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
}

impl From<SpecPatchV1> for SpecPatch {
    fn from(v: SpecPatchV1) -> Self {
        let SpecPatchV1 { shards, durability, flush_ms, rollup_ms, router, distinct, dedup_window_s } = v;
        SpecPatch {
            shards,
            durability,
            flush_ms,
            rollup_ms,
            router,
            distinct,
            dedup_window_s,
            frequency: None,
            windows: None,
            min: None,
            max: None,
            limit: None,
            replicas: None,
        }
    }
}

/// [`CounterMeta`] as format 1 stored it.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CounterMetaV1 {
    /// See [`CounterMeta::spec`].
    pub spec: CounterSpecV1,
    /// See [`CounterMeta::layout`].
    pub layout: Layout,
    /// See [`CounterMeta::created_at_ms`].
    pub created_at_ms: u64,
    /// See [`CounterMeta::version`].
    pub version: u64,
}

impl From<CounterMetaV1> for CounterMeta {
    fn from(v: CounterMetaV1) -> Self {
        CounterMeta {
            spec: v.spec.into(),
            layout: v.layout,
            created_at_ms: v.created_at_ms,
            version: v.version,
            expires_at_ms: None,
        }
    }
}

/// [`MetaCommand`] as format 1 stored it (inside raft log entries).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum MetaCommandV1 {
    /// See [`MetaCommand::Put`].
    Put(SpecPatchV1),
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

impl From<MetaCommandV1> for MetaCommand {
    fn from(v: MetaCommandV1) -> Self {
        match v {
            MetaCommandV1::Put(p) => MetaCommand::Put(p.into()),
            MetaCommandV1::Ensure => MetaCommand::Ensure,
            MetaCommandV1::CompleteReshard { generation, sealed_sum } => {
                MetaCommand::CompleteReshard { generation, sealed_sum }
            }
            MetaCommandV1::PruneSealed => MetaCommand::PruneSealed,
            MetaCommandV1::Delete => MetaCommand::Delete,
        }
    }
}

/// [`ShardImage`] as format 1 stored it.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct ShardImageV1 {
    /// See [`ShardImage::value`].
    pub value: i64,
    /// See [`ShardImage::sketch`].
    pub sketch: Option<Vec<u8>>,
}

impl From<ShardImageV1> for ShardImage {
    fn from(v: ShardImageV1) -> Self {
        ShardImage { value: v.value, sketch: v.sketch, frequency: None, windows: None, escrow: None }
    }
}

/// Decodes format-1 bytes of `V` and encodes them as today's `T`.
pub fn upgrade<V, T>(what: &'static str, bytes: &[u8]) -> Result<Vec<u8>, DecodeError>
where
    V: serde::de::DeserializeOwned + Into<T>,
    T: Serialize,
{
    let old: V = decode(what, bytes)?;
    Ok(encode(&old.into()))
}

/// A format-1 shard image, as today's bytes.
pub fn upgrade_shard_image(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    upgrade::<ShardImageV1, ShardImage>("format-1 shard image", bytes)
}

/// A format-1 counter's metadata, as today's bytes.
pub fn upgrade_counter_meta(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    upgrade::<CounterMetaV1, CounterMeta>("format-1 counter metadata", bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn format_one_records_upgrade_field_for_field() {
        let image = ShardImageV1 { value: -42, sketch: Some(vec![1, 2, 3]) };
        let up: ShardImage = decode("image", &upgrade_shard_image(&encode(&image)).unwrap()).unwrap();
        assert_eq!((up.value, up.sketch), (-42, Some(vec![1, 2, 3])));

        let spec = CounterSpecV1 {
            shards: 16,
            durability: Durability::Sync,
            flush_ms: 50,
            rollup_ms: 250,
            router: RouterPolicy::RoundRobin,
            distinct: true,
            dedup_window_s: 3_600,
        };
        let layout = Layout { generation: 3, shards: 16, base: -7, sealed: vec![], resharding: Some(4) };
        let meta = CounterMetaV1 { spec, layout: layout.clone(), created_at_ms: 5, version: 9 };
        let up: CounterMeta = decode("meta", &upgrade_counter_meta(&encode(&meta)).unwrap()).unwrap();
        assert_eq!(up.spec.shards, 16);
        assert_eq!(up.spec.durability, Durability::Sync);
        assert_eq!((up.spec.flush_ms, up.spec.rollup_ms, up.spec.dedup_window_s), (50, 250, 3_600));
        assert_eq!((up.spec.router, up.spec.distinct), (RouterPolicy::RoundRobin, true));
        assert_eq!((up.layout, up.created_at_ms, up.version), (layout, 5, 9));
        assert_eq!((up.spec.frequency, up.spec.min, up.spec.max), (None, None, None));

        let put =
            MetaCommandV1::Put(SpecPatchV1 { shards: Some(3), distinct: Some(false), ..Default::default() });
        let MetaCommand::Put(p) = MetaCommand::from(put) else { panic!("a put stays a put") };
        assert_eq!((p.shards, p.distinct, p.durability), (Some(3), Some(false), None));
    }

    #[test]
    fn bytes_that_are_not_format_one_are_an_error() {
        assert!(upgrade_shard_image(&[0xff; 3]).is_err());
        assert!(upgrade_counter_meta(&[]).is_err());
        // Trailing bytes are refused too: a record is never half-read.
        let mut image = encode(&ShardImageV1 { value: 1, sketch: None });
        image.push(0);
        assert!(upgrade_shard_image(&image).is_err());
    }
}
