//! The stored records of format 2 whose bytes changed in format 3, frozen, and their
//! upgrade to today's.
//!
//! Format 3 changed no record's layout: a shard image still holds its distinct sketch
//! as opaque bytes. It changed those bytes. Format 2's sketch encoding (sketch
//! version one) kept 2^14 one-byte registers, or one sorted list of precision-25
//! entries while it had at most 4,096 of them; format 3's (sketch version two, see
//! [`crate::sketch`]) packs the registers at 6 bits in 64 segments that are sparse
//! (precision-20 entries) or dense each on its own. So what is frozen here is that
//! decoder, exactly as format 2 validated its bytes, and the conversion: every
//! precision-25 entry implies exactly one precision-20 entry and every one-byte
//! register is a 6-bit value, so an upgraded sketch holds the same registers and gives
//! the same estimate wherever it is dense (a sparse one goes from 2^25 to 2^20 slots:
//! both are close to exact for the few thousand members a sparse sketch holds).
//! Nothing here is ever edited: a later format adds a module.

use crate::codec::{decode, DecodeError};
use crate::hash::hash64;
use crate::shard::ShardImage;
use crate::sketch::DistinctSketch;

/// Version byte of a format-2 sketch.
const SKETCH_VERSION: u8 = 1;
/// Its precision.
const PRECISION: u8 = 14;
/// Its number of dense registers.
const REGISTERS: usize = 1 << PRECISION;
/// Most entries its sparse form held.
const SPARSE_ENTRIES_MAX: usize = REGISTERS / 4;
/// Index bits of its sparse form.
const SPARSE_PRECISION: u32 = 25;
/// Value bits of a sparse entry.
const RANK_BITS: u32 = 6;
/// Largest dense register value.
const DENSE_RANK_MAX: u8 = 64 - PRECISION + 1;
/// Largest sparse entry value.
const SPARSE_RANK_MAX: u32 = 64 - SPARSE_PRECISION + 1;
/// Form byte of a sparse body.
const FORM_SPARSE: u8 = 0;
/// Form byte of a dense body.
const FORM_DENSE: u8 = 1;
/// Version, precision and form bytes.
const HEADER_LEN_BYTES: usize = 3;
/// Trailing XXH3-64 checksum.
const CHECKSUM_LEN_BYTES: usize = 8;
/// Seed of the checksum ("tallyskc").
const CHECKSUM_SEED: u64 = 0x7461_6c6c_7973_6b63;
/// Index bits today's sparse form has (the conversion's target).
const TODAY_SPARSE_PRECISION: u32 = 20;
/// Index bits format 2 had beyond today's.
const DROPPED_BITS: u32 = SPARSE_PRECISION - TODAY_SPARSE_PRECISION;

/// A distinct sketch as format 2 stored it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum SketchV2 {
    /// Non-zero precision-25 registers as `slot << 6 | value`, sorted by slot.
    Sparse(Vec<u32>),
    /// All 2^14 registers, one byte each.
    Dense(Vec<u8>),
}

fn refuse(reason: impl Into<String>) -> DecodeError {
    DecodeError { what: "format-2 sketch", reason: reason.into() }
}

impl SketchV2 {
    /// Decodes format-2 sketch bytes, with format 2's checks.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, DecodeError> {
        if bytes.len() < HEADER_LEN_BYTES + CHECKSUM_LEN_BYTES {
            return Err(refuse(format!("{} bytes", bytes.len())));
        }
        let (content, checksum) = bytes.split_at(bytes.len() - CHECKSUM_LEN_BYTES);
        let checksum = u64::from_le_bytes(checksum.try_into().expect("split at 8 bytes"));
        if hash64(CHECKSUM_SEED, content) != checksum {
            return Err(refuse("checksum mismatch"));
        }
        let (header, body) = content.split_at(HEADER_LEN_BYTES);
        if header[0] != SKETCH_VERSION || header[1] != PRECISION {
            return Err(refuse(format!("version {} precision {}", header[0], header[1])));
        }
        match header[2] {
            FORM_SPARSE => {
                let Some((count, entries)) = body.split_first_chunk::<4>() else {
                    return Err(refuse("no entry count"));
                };
                let count = u32::from_le_bytes(*count) as usize;
                if count > SPARSE_ENTRIES_MAX || entries.len() != count * 4 {
                    return Err(refuse(format!("{count} entries in {} bytes", entries.len())));
                }
                let mut out: Vec<u32> = Vec::with_capacity(count);
                for (at, chunk) in entries.chunks_exact(4).enumerate() {
                    let entry = u32::from_le_bytes(chunk.try_into().expect("chunks of 4"));
                    let rank = entry & ((1 << RANK_BITS) - 1);
                    let slot = entry >> RANK_BITS;
                    let ordered = out.last().is_none_or(|&prev| (prev >> RANK_BITS) < slot);
                    if rank == 0 || rank > SPARSE_RANK_MAX || slot >= 1 << SPARSE_PRECISION || !ordered {
                        return Err(refuse(format!("sparse entry {at} is invalid")));
                    }
                    out.push(entry);
                }
                Ok(SketchV2::Sparse(out))
            }
            FORM_DENSE => {
                if body.len() != REGISTERS {
                    return Err(refuse(format!("dense body of {} bytes", body.len())));
                }
                if let Some(at) = body.iter().position(|&r| r > DENSE_RANK_MAX) {
                    return Err(refuse(format!("register {at} holds {}", body[at])));
                }
                Ok(SketchV2::Dense(body.to_vec()))
            }
            other => Err(refuse(format!("form {other}"))),
        }
    }
}

/// The precision-20 entry a precision-25 entry implies: the 5 dropped slot bits are
/// the first bits the precision-20 value counts zeros in.
fn narrow(entry: u32) -> u32 {
    let slot = entry >> RANK_BITS;
    let dropped = slot & ((1 << DROPPED_BITS) - 1);
    let rank = if dropped != 0 {
        dropped.leading_zeros() - (32 - DROPPED_BITS) + 1
    } else {
        DROPPED_BITS + (entry & ((1 << RANK_BITS) - 1))
    };
    ((slot >> DROPPED_BITS) << RANK_BITS) | rank
}

impl From<SketchV2> for DistinctSketch {
    fn from(v: SketchV2) -> Self {
        match v {
            SketchV2::Sparse(entries) => {
                let narrowed: Vec<u32> = entries.into_iter().map(narrow).collect();
                DistinctSketch::from_parts(&[], &narrowed)
            }
            SketchV2::Dense(registers) => DistinctSketch::from_parts(&registers, &[]),
        }
    }
}

/// A format-2 shard image (today's layout) with its sketch in today's bytes.
pub fn upgrade_shard_image(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    // Format 2's layout is format 3's (see `super::v3`).
    let image = super::v3::decode_shard_image("format-2 shard image", bytes)?;
    upgrade_sketch(image)
}

/// Today's bytes of an image whose sketch is in format 2's encoding.
fn upgrade_sketch(mut image: ShardImage) -> Result<Vec<u8>, DecodeError> {
    if let Some(sketch) = image.sketch.take() {
        let today: DistinctSketch = SketchV2::from_bytes(&sketch)?.into();
        image.sketch = Some(today.to_bytes());
    }
    Ok(super::v3::encode_shard_image(&image))
}

/// A format-1 shard image, as today's bytes: format 1's layout upgrade, then format 2's
/// sketch upgrade (format 1 encoded sketches as format 2 did).
pub fn upgrade_shard_image_from_v1(bytes: &[u8]) -> Result<Vec<u8>, DecodeError> {
    let image: ShardImage = decode("format-1 shard image", &super::v1::upgrade_shard_image(bytes)?)?;
    upgrade_sketch(image)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::codec::encode;
    use crate::format::v3::ShardImageV3;
    use crate::sketch::member_hash;

    /// `sketch_of(0..3)` (members `user-0..2`) as format 2 encoded it.
    const FORMAT_2_SKETCH_OF_THREE: [u8; 27] = [
        1, 14, 0, 3, 0, 0, 0, 66, 181, 219, 23, 2, 170, 209, 114, 195, 8, 55, 120, 35, 58, 156, 137, 23, 208,
        180, 58,
    ];

    fn sketch_of(range: std::ops::Range<u64>) -> DistinctSketch {
        let mut s = DistinctSketch::new();
        for i in range {
            s.insert_hash(member_hash(&format!("user-{i}")));
        }
        s
    }

    /// Format 2's encoding of a sparse list, rebuilt here to test the conversion on
    /// many entries.
    fn format_2_sparse(entries: &[u32]) -> Vec<u8> {
        let mut out = vec![SKETCH_VERSION, PRECISION, FORM_SPARSE];
        out.extend_from_slice(&(entries.len() as u32).to_le_bytes());
        for e in entries {
            out.extend_from_slice(&e.to_le_bytes());
        }
        let checksum = hash64(CHECKSUM_SEED, &out);
        out.extend_from_slice(&checksum.to_le_bytes());
        out
    }

    #[test]
    fn a_format_2_sketch_becomes_the_sketch_of_the_same_members() {
        let old = SketchV2::from_bytes(&FORMAT_2_SKETCH_OF_THREE).unwrap();
        assert!(matches!(&old, SketchV2::Sparse(e) if e.len() == 3));
        assert_eq!(DistinctSketch::from(old), sketch_of(0..3));
    }

    #[test]
    fn precision_25_entries_narrow_exactly() {
        // A precision-25 entry of a hash narrows to the precision-20 entry of that hash:
        // checked through today's sketch, which computes the latter itself.
        for n in [1u64, 500, 2_000, 4_000] {
            let hashes: Vec<u64> = (0..n).map(|i| member_hash(&format!("user-{i}"))).collect();
            let mut entries: Vec<u32> = hashes
                .iter()
                .map(|&h| {
                    let h = crate::sketch::tests_support::mix(h);
                    let slot = (h >> (64 - SPARSE_PRECISION)) as u32;
                    let rank = ((h << SPARSE_PRECISION).leading_zeros() + 1).min(SPARSE_RANK_MAX);
                    (slot << RANK_BITS) | rank
                })
                .collect();
            entries.sort_unstable();
            entries.dedup_by_key(|e| *e >> RANK_BITS);
            let old = SketchV2::from_bytes(&format_2_sparse(&entries)).unwrap();
            assert_eq!(DistinctSketch::from(old), sketch_of(0..n), "n={n}");
        }
    }

    #[test]
    fn shard_images_upgrade_and_bad_sketches_are_an_error() {
        let image =
            ShardImageV3 { value: 9, sketch: Some(FORMAT_2_SKETCH_OF_THREE.to_vec()), frequency: None };
        let up: ShardImage = decode("image", &upgrade_shard_image(&encode(&image)).unwrap()).unwrap();
        assert_eq!(up.value, 9);
        assert_eq!(DistinctSketch::from_bytes(up.sketch.as_deref().unwrap()), Ok(sketch_of(0..3)));
        let plain = ShardImageV3 { value: -1, sketch: None, frequency: None };
        let today = ShardImage { value: -1, sketch: None, frequency: None, windows: None, escrow: None };
        assert_eq!(upgrade_shard_image(&encode(&plain)).unwrap(), encode(&today));

        let mut bad = FORMAT_2_SKETCH_OF_THREE.to_vec();
        bad[8] ^= 1;
        let image = ShardImageV3 { value: 9, sketch: Some(bad), frequency: None };
        assert!(upgrade_shard_image(&encode(&image)).is_err());
        // Today's bytes are not format 2's.
        let image = ShardImageV3 { value: 9, sketch: Some(sketch_of(0..3).to_bytes()), frequency: None };
        assert!(upgrade_shard_image(&encode(&image)).is_err());
        assert!(SketchV2::from_bytes(&[]).is_err());
    }

    #[test]
    fn a_format_1_image_upgrades_through_both() {
        let image =
            super::super::v1::ShardImageV1 { value: 4, sketch: Some(FORMAT_2_SKETCH_OF_THREE.to_vec()) };
        let up: ShardImage = decode("image", &upgrade_shard_image_from_v1(&encode(&image)).unwrap()).unwrap();
        assert_eq!((up.value, up.frequency), (4, None));
        assert_eq!(DistinctSketch::from_bytes(up.sketch.as_deref().unwrap()), Ok(sketch_of(0..3)));
    }
}
