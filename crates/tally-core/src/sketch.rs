//! HyperLogLog distinct-count sketches: one per shard, merged register-wise at read.
//!
//! A counter with `distinct` enabled keeps, in every shard, a sketch of the members
//! that shard has seen. A distinct read merges the shards' sketches by taking the
//! register-wise maximum; that merge loses nothing, so the merged sketch is *bit for
//! bit* the sketch a single shard would have built from all members, and the estimate
//! does not depend on the shard count (invariant 7).
//!
//! # Design
//!
//! * **Hashing is the caller's.** Members are hashed once, on the writer side, with
//!   [`member_hash`] (XXH3-64 under the fixed [`MEMBER_SEED`]); the sketch only ever
//!   sees 64-bit hashes. Nothing is seeded per instance or per process, so sketches
//!   built on different nodes, processes and builds merge. Each hash first goes
//!   through a fixed bijective mixer (MurmurHash3's `fmix64`), so distinct hashes
//!   stay distinct and a caller passing weak values (small integers in tests, say)
//!   still spreads them over the registers; with XXH3 input it costs no accuracy.
//! * **Registers:** 2^14 = 16,384 of them ([`HLL_PRECISION`]), packed at 6 bits
//!   ([`REGISTER_BITS`]) as Redis packs them: 12 KiB when every register is in use.
//!   Register index = the mixed hash's top 14 bits, value = 1 + leading zeros of the
//!   remaining 50 bits (at most 51). Standard error `1.04 / sqrt(16384)` ≈ 0.81 %.
//! * **Segments.** The registers fall into [`SEGMENTS`] = 64 segments of 256
//!   registers (the top 6 bits of the index). Each segment is on its own either
//!   *sparse* — a sorted list of the non-zero registers of a precision-20 sketch, one
//!   `u32` entry each, in the HyperLogLog++ way — or *dense* — its 256 registers,
//!   192 bytes. A segment turns dense when its list would outgrow its registers in
//!   memory ([`SEGMENT_SPARSE_MAX`] entries of 4 bytes = 192 bytes). So an empty
//!   sketch allocates nothing, a sketch of a thousand members costs about 1.7 KB
//!   stored, a full one 12 KiB, and a sketch whose members all fall in a few segments
//!   costs only those segments. The last is what lets a counter's shards share out
//!   the registers (members route to the shard that owns their segment, see
//!   [`shard_of_member`]) so that 64 shards cost about one sketch, not 64.
//! * **Exact merge.** Each sparse entry converts *exactly* into the precision-14
//!   register it implies, so sparse and dense segments merge losslessly.
//! * **Canonical state.** Which form a segment is in depends only on the *set* of
//!   hashes inserted into it (dense once more than [`SEGMENT_SPARSE_MAX`] distinct
//!   precision-20 slots of the segment are occupied), never on insertion or merge
//!   order or on which shard saw which member. So two sketches of the same set are
//!   equal and serialize to identical bytes, whatever order or layout built them.
//! * **Estimator:** Otmar Ertl's "improved raw estimator" (*New cardinality estimation
//!   algorithms for HyperLogLog sketches*, 2017), applied to the register histogram:
//!   to the 2^20 precision-20 slots while every segment is sparse (close to exact for
//!   a few thousand members), to the 2^14 registers once any is dense. It is accurate
//!   over the whole range without empirical bias tables or a switch to linear
//!   counting, and it uses only `+ * /` and `sqrt`, which IEEE 754 rounds exactly, so
//!   every machine computes the same estimate from the same registers.
//! * **Bytes:** a version byte, the precision, a 64-bit map of the dense segments,
//!   their packed registers, the sparse entries (a count, then each entry's slot gap
//!   Rice-coded and its value in unary: about 14 bits an entry at a thousand
//!   members), and an XXH3-64 checksum. Decoding checks every field (lengths, map,
//!   entry order and range, per-segment counts, register range, padding, checksum)
//!   before building anything and never allocates more than the dense size, so
//!   corrupt bytes are an error, never a panic or a huge allocation.
//!
//! # Why not a crate
//!
//! Both maintained crates were inspected (sources in `~/.cargo/registry`):
//!
//! * `cardinality-estimator` 1.0.3 (Cloudflare) has the right shape — a tiny inline
//!   form for ≤ 2 items, an array up to 128, then packed 6-bit registers (12 KiB at
//!   precision 14) — and takes pre-hashed `u64`s. Rejected because its serde form
//!   writes the *raw heap pointer* (a tagged `usize`) next to the data, so equal
//!   sketches serialize to different bytes in every process; decoding checks only the
//!   slice length and trusts the stored zero count and `f32` harmonic sum, so corrupt
//!   bytes give absurd estimates instead of an error, and a corrupt array form with
//!   repeated entries counts them twice; the harmonic sum is updated incrementally in
//!   `f32`, so the estimate of the same register set can depend on insertion order;
//!   it is built on tagged pointers and `unsafe`. It has no partial (per-segment)
//!   dense form either, so 64 shards would still cost 64 sketches.
//! * `hyperloglockless` 0.5 has fast dense HLLs (1 byte per register, 16 KiB at
//!   precision 14 even when empty) and `insert_hash`. Rejected because bytes are only
//!   available through its `serde` feature (not enabled in the workspace) or
//!   `parts`/`from_parts`, which trust the stored zero count and sum and *panic* on a
//!   bad length; a register value above 65 from corrupt input indexes past its
//!   `INV_POW2` table (panic); the sparse `HyperLogLogPlus` has no validated byte form
//!   and its encoding depends on when its insert buffer was flushed; the default
//!   constructor draws a random SipHash key per instance.
//!
//! Neither gives stable, validated bytes or a sketch a shard can hold part of; a
//! HyperLogLog with segment-wise sparse lists is a few hundred lines that we can state
//! invariants about, so it is written here.

use crate::hash::{hash64, MEMBER_SEED};
use serde::{Deserialize, Serialize};
use std::fmt;
use std::ops::Range;

/// Register-index bits: 2^14 registers, standard error ≈ 0.81 %. Changing it changes
/// every stored sketch: it is part of the byte format.
pub const HLL_PRECISION: u8 = 14;

/// Number of registers, `2^HLL_PRECISION`.
pub const HLL_REGISTERS: usize = 1 << HLL_PRECISION;

/// Bits of one packed register (values reach 51, which needs 6).
pub const REGISTER_BITS: usize = 6;

/// Bytes of every register packed: 12 KiB, the size of a dense Redis HyperLogLog.
pub const DENSE_BYTES: usize = HLL_REGISTERS * REGISTER_BITS / 8;

/// Index bits that choose a segment.
const SEGMENT_BITS: u32 = 6;

/// Segments the registers fall into; each is sparse or dense on its own.
pub const SEGMENTS: usize = 1 << SEGMENT_BITS;

/// Registers of one segment.
pub const SEGMENT_REGISTERS: usize = HLL_REGISTERS / SEGMENTS;

/// Bytes of one dense segment's packed registers.
pub const SEGMENT_BYTES: usize = SEGMENT_REGISTERS * REGISTER_BITS / 8;

/// Most entries a sparse segment holds before turning dense: at 4 bytes an entry in
/// memory, the point where its list would cost as much as its packed registers.
pub const SEGMENT_SPARSE_MAX: usize = SEGMENT_BYTES / 4;

/// Most sparse entries a whole sketch can hold (every segment just below dense).
pub const SPARSE_ENTRIES_MAX: usize = SEGMENTS * SEGMENT_SPARSE_MAX;

/// Index bits of the sparse form. 20 index bits plus a 6-bit value fit a `u32`
/// entry, and 2^20 slots make collisions among a few thousand members negligible.
const SPARSE_PRECISION: u8 = 20;

/// Number of slots the sparse form's entries index, `2^SPARSE_PRECISION`.
const SPARSE_SLOTS: usize = 1 << SPARSE_PRECISION;

/// Largest dense register value: 1 + the 50 bits after the index all zero.
const DENSE_RANK_MAX: u8 = 64 - HLL_PRECISION + 1;

/// Largest sparse entry value: 1 + the 44 bits after the sparse index all zero.
const SPARSE_RANK_MAX: u8 = 64 - SPARSE_PRECISION + 1;

/// Bits of a sparse entry that hold its value (the rest hold the slot index).
const SPARSE_RANK_BITS: u32 = 6;

/// Sparse index bits that refine a dense register index (20 − 14).
const SPARSE_EXTRA_BITS: u32 = (SPARSE_PRECISION - HLL_PRECISION) as u32;

/// Shift from a sparse entry to its segment.
const ENTRY_SEGMENT_SHIFT: u32 = SPARSE_RANK_BITS + SPARSE_PRECISION as u32 - SEGMENT_BITS;

/// Version byte that starts every encoded sketch. Version 1 (8-bit registers, one
/// precision-25 list) is read only by the store upgrade, in [`crate::format::v2`].
const FORMAT_VERSION: u8 = 2;
/// Version, precision and dense-map bytes.
const HEADER_LEN_BYTES: usize = 2 + 8;
/// Bytes of the sparse entry count (`u16` LE).
const COUNT_LEN_BYTES: usize = 2;
/// XXH3-64 of everything before it, little-endian.
const CHECKSUM_LEN_BYTES: usize = 8;
/// Seed of the encoded-sketch checksum ("tallyskc"); part of the byte format.
const CHECKSUM_SEED: u64 = 0x7461_6c6c_7973_6b63;

/// Bound on the iterations of the estimator's series; they converge in well under
/// 70 steps for any input (see `sigma` and `tau`), the bound only rules out a loop.
const SERIES_ITERATIONS_MAX: u32 = 128;

/// `1 / (2 ln 2)`, the bias constant of Ertl's estimator for many registers.
const ALPHA_INF: f64 = 0.721_347_520_444_481_7;

/// Hash of a distinct-count member, computed by the writer before the member reaches
/// any sketch. Fixed seed: every node, process and build hashes a member identically,
/// which is what lets sketches from different shards merge.
pub fn member_hash(member: &str) -> u64 {
    hash64(MEMBER_SEED, member.as_bytes())
}

/// The shard (`0..shards`) whose slice of the registers a member's hash falls in:
/// shard `s` of `n` owns registers `s·2^14/n .. (s+1)·2^14/n`. A counter that sends
/// each member to this shard keeps every register in one shard only, so its shards'
/// sketches together cost about one sketch. `shards` must be non-zero.
pub fn shard_of_member(hash: u64, shards: u16) -> u16 {
    assert!(shards > 0, "a layout has at least one shard");
    let index = mix(hash) >> (64 - HLL_PRECISION);
    ((index * u64::from(shards)) >> HLL_PRECISION) as u16
}

/// Why bytes were not accepted as a sketch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SketchError {
    /// Fewer bytes than a header, count and checksum.
    #[error("sketch is {len} bytes; at least {min} are needed")]
    TooShort {
        /// Bytes offered.
        len: usize,
        /// Smallest possible encoding.
        min: usize,
    },
    /// The checksum does not match the content.
    #[error("sketch checksum mismatch")]
    Checksum,
    /// An encoding version this build does not know.
    #[error("unknown sketch format version {0}")]
    Version(u8),
    /// A sketch of a different precision: it cannot be merged with ours.
    #[error("sketch precision is {0}; this build uses {HLL_PRECISION}")]
    Precision(u8),
    /// The body is not the length its map and count imply.
    #[error("sketch body is {len} bytes; {expected} expected")]
    BodyLength {
        /// Body bytes present.
        len: usize,
        /// Body bytes the header implies.
        expected: usize,
    },
    /// A sparse part claiming more entries than [`SPARSE_ENTRIES_MAX`].
    #[error("sparse sketch has {count} entries; the limit is {SPARSE_ENTRIES_MAX}")]
    TooManyEntries {
        /// Entries claimed.
        count: u64,
    },
    /// A sparse entry out of range, out of order, in a dense segment, or one too many
    /// for its segment.
    #[error("sparse entry {at} is invalid")]
    Entry {
        /// Position of the entry.
        at: usize,
    },
    /// A dense register above the largest possible value.
    #[error("register {at} holds {value}; at most {DENSE_RANK_MAX} is possible")]
    Register {
        /// Register index.
        at: usize,
        /// Value found.
        value: u8,
    },
    /// A dense segment with every register zero (no set of members makes one).
    #[error("dense segment {0} is empty")]
    EmptySegment(usize),
}

/// The packed registers of one dense segment.
type SegmentRegisters = [u8; SEGMENT_BYTES];

/// A mergeable estimate of how many distinct members were inserted.
///
/// `Default` is the empty sketch, which allocates nothing.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Vec<u8>", into = "Vec<u8>")]
pub struct DistinctSketch {
    /// Non-zero precision-20 registers of the sparse segments as `slot << 6 | value`,
    /// sorted by slot, one per slot, at most [`SEGMENT_SPARSE_MAX`] per segment.
    sparse: Vec<u32>,
    /// Bit `s` set: segment `s` is dense (and has no sparse entries).
    dense_map: u64,
    /// Packed registers of the dense segments, in segment order.
    dense: Vec<SegmentRegisters>,
}

impl DistinctSketch {
    /// The empty sketch.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records one member by its [`member_hash`]. Returns whether the sketch changed,
    /// so a caller can skip rewriting a sketch that a repeated member left unchanged.
    pub fn insert_hash(&mut self, h: u64) -> bool {
        let h = mix(h);
        let segment = (h >> (64 - SEGMENT_BITS)) as usize;
        if let Some(at) = self.dense_position(segment) {
            let (index, rank) = dense_register(h);
            return raise_packed(&mut self.dense[at], index % SEGMENT_REGISTERS, rank);
        }
        if !sparse_insert(&mut self.sparse, sparse_entry(h)) {
            return false;
        }
        let range = segment_range(&self.sparse, segment);
        if range.len() > SEGMENT_SPARSE_MAX {
            let registers = densify(&self.sparse[range.clone()]);
            self.sparse.drain(range);
            if self.sparse.is_empty() {
                self.sparse = Vec::new();
            } else if self.sparse.capacity() > 2 * self.sparse.len() + SEGMENT_SPARSE_MAX {
                self.sparse.shrink_to(self.sparse.len() + SEGMENT_SPARSE_MAX);
            }
            let at = self.dense_rank(segment);
            self.dense.insert(at, registers);
            self.dense_map |= 1 << segment;
        }
        true
    }

    /// Folds `other` into `self`: afterwards `self` is exactly the sketch of the union
    /// of both inputs. Commutative, associative and idempotent.
    pub fn merge(&mut self, other: &DistinctSketch) {
        if other.is_empty() {
            return;
        }
        let mut out = DistinctSketch {
            sparse: Vec::with_capacity(self.sparse.len() + other.sparse.len()),
            dense_map: 0,
            dense: Vec::with_capacity((self.dense_map | other.dense_map).count_ones() as usize),
        };
        for segment in 0..SEGMENTS {
            let ours = &self.sparse[segment_range(&self.sparse, segment)];
            let theirs = &other.sparse[segment_range(&other.sparse, segment)];
            let dense = match (self.dense_segment(segment), other.dense_segment(segment)) {
                (None, None) => {
                    let union = sparse_union(ours, theirs);
                    if union.len() <= SEGMENT_SPARSE_MAX {
                        out.sparse.extend_from_slice(&union);
                        continue;
                    }
                    densify(&union)
                }
                (Some(a), Some(b)) => {
                    let mut registers = *a;
                    for j in 0..SEGMENT_REGISTERS {
                        raise_packed(&mut registers, j, get_packed(b, j));
                    }
                    registers
                }
                (Some(d), None) | (None, Some(d)) => {
                    let mut registers = *d;
                    for &entry in ours.iter().chain(theirs) {
                        let (index, rank) = sparse_to_dense(entry);
                        raise_packed(&mut registers, index % SEGMENT_REGISTERS, rank);
                    }
                    registers
                }
            };
            out.dense.push(dense);
            out.dense_map |= 1 << segment;
        }
        *self = out;
    }

    /// Estimated number of distinct members inserted: 0 for an empty sketch, close to
    /// exact while every segment is sparse, within [`DistinctSketch::relative_error`]
    /// (one standard error) about two times in three otherwise.
    pub fn estimate(&self) -> u64 {
        if self.is_empty() {
            return 0;
        }
        let estimate = if self.dense_map == 0 {
            let mut histogram = [0u32; SPARSE_RANK_MAX as usize + 1];
            for &entry in &self.sparse {
                histogram[(entry & sparse_rank_mask()) as usize] += 1;
            }
            // Entries are at most SPARSE_ENTRIES_MAX, far below 2^20.
            histogram[0] = (SPARSE_SLOTS - self.sparse.len()) as u32;
            ertl_estimate(&histogram, SPARSE_SLOTS)
        } else {
            let mut histogram = [0u32; DENSE_RANK_MAX as usize + 1];
            for segment in 0..SEGMENTS {
                let registers = match self.dense_segment(segment) {
                    Some(d) => *d,
                    None => {
                        let mut registers = [0u8; SEGMENT_BYTES];
                        for &entry in &self.sparse[segment_range(&self.sparse, segment)] {
                            let (index, rank) = sparse_to_dense(entry);
                            raise_packed(&mut registers, index % SEGMENT_REGISTERS, rank);
                        }
                        registers
                    }
                };
                for j in 0..SEGMENT_REGISTERS {
                    histogram[usize::from(get_packed(&registers, j))] += 1;
                }
            }
            ertl_estimate(&histogram, HLL_REGISTERS)
        };
        // Saturating float-to-int conversion; only a sketch with every register at its
        // maximum (about 2^64 members) gets near the top.
        estimate.round() as u64
    }

    /// The dense sketch's stated standard error, `1.04 / sqrt(2^HLL_PRECISION)`
    /// ≈ 0.0081, reported next to every distinct estimate.
    pub fn relative_error() -> f64 {
        1.04 / (HLL_REGISTERS as f64).sqrt()
    }

    /// True when nothing was ever inserted (or merged in).
    pub fn is_empty(&self) -> bool {
        self.sparse.is_empty() && self.dense_map == 0
    }

    /// How many of the [`SEGMENTS`] segments are dense.
    pub fn dense_segments(&self) -> u32 {
        self.dense_map.count_ones()
    }

    /// Bytes this sketch occupies in memory (inline part plus heap), for the
    /// per-counter memory report. [`DistinctSketch::encoded_len`] is its stored size.
    pub fn size_bytes(&self) -> usize {
        std::mem::size_of::<Self>()
            + self.sparse.capacity() * std::mem::size_of::<u32>()
            + self.dense.capacity() * SEGMENT_BYTES
    }

    /// Bytes of [`DistinctSketch::to_bytes`]: what the sketch costs stored.
    pub fn encoded_len(&self) -> usize {
        self.to_bytes().len()
    }

    /// The stable byte encoding: version, precision, dense map, dense segments,
    /// sparse entries, checksum. Equal sketches encode to equal bytes in every
    /// process and build.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out = Vec::with_capacity(
            HEADER_LEN_BYTES
                + self.dense.len() * SEGMENT_BYTES
                + COUNT_LEN_BYTES
                + self.sparse.len() * 2
                + CHECKSUM_LEN_BYTES,
        );
        out.extend_from_slice(&[FORMAT_VERSION, HLL_PRECISION]);
        out.extend_from_slice(&self.dense_map.to_le_bytes());
        for registers in &self.dense {
            out.extend_from_slice(registers);
        }
        let count = u16::try_from(self.sparse.len()).expect("at most SPARSE_ENTRIES_MAX");
        out.extend_from_slice(&count.to_le_bytes());
        let k = rice_parameter(self.sparse.len());
        let mut bits = BitWriter { out: &mut out, acc: 0, len: 0 };
        let mut next_slot = 0u32;
        for &entry in &self.sparse {
            let slot = entry >> SPARSE_RANK_BITS;
            let gap = slot - next_slot;
            bits.unary(gap >> k);
            bits.bits(gap & ((1 << k) - 1), k);
            bits.unary((entry & sparse_rank_mask()) - 1);
            next_slot = slot + 1;
        }
        bits.finish();
        let checksum = hash64(CHECKSUM_SEED, &out);
        out.extend_from_slice(&checksum.to_le_bytes());
        out
    }

    /// Decodes [`DistinctSketch::to_bytes`] output, checking every field first.
    /// Allocates at most the dense size whatever the input claims.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, SketchError> {
        let min = HEADER_LEN_BYTES + COUNT_LEN_BYTES + CHECKSUM_LEN_BYTES;
        if bytes.len() < min {
            return Err(SketchError::TooShort { len: bytes.len(), min });
        }
        let (content, checksum) = bytes.split_at(bytes.len() - CHECKSUM_LEN_BYTES);
        let checksum = u64::from_le_bytes(checksum.try_into().expect("split at 8 bytes"));
        if hash64(CHECKSUM_SEED, content) != checksum {
            return Err(SketchError::Checksum);
        }
        let (header, body) = content.split_at(HEADER_LEN_BYTES);
        if header[0] != FORMAT_VERSION {
            return Err(SketchError::Version(header[0]));
        }
        if header[1] != HLL_PRECISION {
            return Err(SketchError::Precision(header[1]));
        }
        let dense_map = u64::from_le_bytes(header[2..10].try_into().expect("8 map bytes"));
        let dense_len = dense_map.count_ones() as usize * SEGMENT_BYTES;
        if body.len() < dense_len + COUNT_LEN_BYTES {
            return Err(SketchError::BodyLength { len: body.len(), expected: dense_len + COUNT_LEN_BYTES });
        }
        let (dense_bytes, rest) = body.split_at(dense_len);
        let mut dense = Vec::with_capacity(dense_map.count_ones() as usize);
        for (n, chunk) in dense_bytes.chunks_exact(SEGMENT_BYTES).enumerate() {
            let registers: SegmentRegisters = chunk.try_into().expect("chunks of SEGMENT_BYTES");
            let segment = nth_set_bit(dense_map, n);
            let mut any = false;
            for j in 0..SEGMENT_REGISTERS {
                let value = get_packed(&registers, j);
                if value > DENSE_RANK_MAX {
                    return Err(SketchError::Register { at: segment * SEGMENT_REGISTERS + j, value });
                }
                any |= value != 0;
            }
            if !any {
                return Err(SketchError::EmptySegment(segment));
            }
            dense.push(registers);
        }
        let (count, stream) = rest.split_at(COUNT_LEN_BYTES);
        let count = usize::from(u16::from_le_bytes(count.try_into().expect("2 count bytes")));
        if count > SPARSE_ENTRIES_MAX {
            return Err(SketchError::TooManyEntries { count: count as u64 });
        }
        let sparse = decode_sparse(stream, count, dense_map)?;
        Ok(DistinctSketch { sparse, dense_map, dense })
    }

    /// A sketch from registers and precision-20 entries of an older encoding, made
    /// canonical (each segment sparse or dense by the rule above). `registers` holds
    /// one value per register (at most [`HLL_REGISTERS`], each at most 51) or is empty;
    /// `entries` are `slot << 6 | value` precision-20 entries, in any order.
    pub(crate) fn from_parts(registers: &[u8], entries: &[u32]) -> Self {
        let mut sparse = entries.to_vec();
        sparse.sort_unstable();
        // One entry per slot, the larger value (sorted, so the last of each slot).
        sparse.dedup_by(|later, earlier| {
            let same = (*later >> SPARSE_RANK_BITS) == (*earlier >> SPARSE_RANK_BITS);
            if same {
                *earlier = (*earlier).max(*later);
            }
            same
        });
        // Not canonical yet: the merge splits it into sparse and dense segments.
        let raw = DistinctSketch { sparse, dense_map: 0, dense: Vec::new() };
        let mut out = DistinctSketch::new();
        out.merge(&raw);
        if registers.iter().any(|&r| r != 0) {
            let mut full = DistinctSketch::new();
            for segment in 0..SEGMENTS {
                let mut packed = [0u8; SEGMENT_BYTES];
                let base = segment * SEGMENT_REGISTERS;
                let mut any = false;
                for j in 0..SEGMENT_REGISTERS {
                    let value = registers.get(base + j).copied().unwrap_or(0).min(DENSE_RANK_MAX);
                    any |= value != 0;
                    raise_packed(&mut packed, j, value);
                }
                if any {
                    full.dense.push(packed);
                    full.dense_map |= 1 << segment;
                }
            }
            out.merge(&full);
        }
        out
    }

    /// Position in `dense` of segment `segment`, if it is dense.
    fn dense_position(&self, segment: usize) -> Option<usize> {
        (self.dense_map & (1 << segment) != 0).then(|| self.dense_rank(segment))
    }

    /// How many dense segments come before `segment`.
    fn dense_rank(&self, segment: usize) -> usize {
        (self.dense_map & ((1u64 << segment) - 1)).count_ones() as usize
    }

    /// The packed registers of segment `segment`, if it is dense.
    fn dense_segment(&self, segment: usize) -> Option<&SegmentRegisters> {
        self.dense_position(segment).map(|at| &self.dense[at])
    }
}

/// The sparse entries of a sketch's body: `count` entries, each a Rice-coded gap to
/// its slot and its value in unary, then zero padding to the byte.
fn decode_sparse(stream: &[u8], count: usize, dense_map: u64) -> Result<Vec<u32>, SketchError> {
    let k = rice_parameter(count);
    let mut bits = BitReader { bytes: stream, at: 0 };
    let mut out: Vec<u32> = Vec::with_capacity(count);
    let mut next_slot = 0usize;
    let mut in_segment = (usize::MAX, 0usize);
    for at in 0..count {
        let err = SketchError::Entry { at };
        // A gap never reaches SPARSE_SLOTS, which bounds the unary part.
        let high = bits.unary(SPARSE_SLOTS >> k).ok_or(err.clone())?;
        let low = bits.bits(k).ok_or(err.clone())?;
        let slot = next_slot + ((high << k) | low as usize);
        let rank = bits.unary(usize::from(SPARSE_RANK_MAX) - 1).ok_or(err.clone())? + 1;
        if slot >= SPARSE_SLOTS {
            return Err(err);
        }
        let segment = slot >> (SPARSE_PRECISION as u32 - SEGMENT_BITS);
        if dense_map & (1 << segment) != 0 {
            return Err(err);
        }
        in_segment = if in_segment.0 == segment { (segment, in_segment.1 + 1) } else { (segment, 1) };
        if in_segment.1 > SEGMENT_SPARSE_MAX {
            return Err(err);
        }
        // slot < 2^20 and rank ≤ 45: the entry fits.
        out.push(((slot as u32) << SPARSE_RANK_BITS) | rank as u32);
        next_slot = slot + 1;
    }
    let used = bits.at.div_ceil(8);
    if used != stream.len() {
        return Err(SketchError::BodyLength { len: stream.len(), expected: used });
    }
    if bits.at % 8 != 0 && stream[used - 1] >> (bits.at % 8) != 0 {
        return Err(SketchError::Entry { at: count.saturating_sub(1) });
    }
    Ok(out)
}

/// Rice parameter of the slot gaps of `count` entries: the floor of log2 of their mean
/// gap. A function of the count alone, so equal sketches encode equally.
fn rice_parameter(count: usize) -> u32 {
    let mean_gap = SPARSE_SLOTS / (count + 1);
    usize::BITS - 1 - mean_gap.max(1).leading_zeros()
}

/// Appends bits to a byte vector, least significant first.
struct BitWriter<'a> {
    out: &'a mut Vec<u8>,
    acc: u64,
    len: u32,
}

impl BitWriter<'_> {
    /// The low `n` (≤ 32) bits of `value`.
    fn bits(&mut self, value: u32, n: u32) {
        self.acc |= u64::from(value) << self.len;
        self.len += n;
        while self.len >= 8 {
            self.out.push(self.acc as u8);
            self.acc >>= 8;
            self.len -= 8;
        }
    }

    /// `n` one bits and a zero.
    fn unary(&mut self, mut n: u32) {
        while n >= 16 {
            self.bits(0xffff, 16);
            n -= 16;
        }
        self.bits((1 << n) - 1, n + 1);
    }

    /// Writes the last partial byte, zero-padded.
    fn finish(self) {
        if self.len > 0 {
            self.out.push(self.acc as u8);
        }
    }
}

/// Reads bits written by [`BitWriter`].
struct BitReader<'a> {
    bytes: &'a [u8],
    at: usize,
}

impl BitReader<'_> {
    fn bit(&mut self) -> Option<bool> {
        let byte = self.bytes.get(self.at / 8)?;
        let bit = byte >> (self.at % 8) & 1 == 1;
        self.at += 1;
        Some(bit)
    }

    /// `n` (≤ 32) bits; `None` past the end.
    fn bits(&mut self, n: u32) -> Option<u32> {
        let mut value = 0u32;
        for i in 0..n {
            value |= u32::from(self.bit()?) << i;
        }
        Some(value)
    }

    /// A unary number of at most `max`; `None` past the end or above `max`.
    fn unary(&mut self, max: usize) -> Option<usize> {
        let mut n = 0;
        while self.bit()? {
            n += 1;
            if n > max {
                return None;
            }
        }
        Some(n)
    }
}

/// The position of the `n`-th set bit of `map` (counting from 0); `map` has more.
fn nth_set_bit(mut map: u64, n: usize) -> usize {
    for _ in 0..n {
        map &= map - 1;
    }
    map.trailing_zeros() as usize
}

/// Register `j` of a segment's packed registers: four registers in three bytes.
fn get_packed(registers: &SegmentRegisters, j: usize) -> u8 {
    let at = j / 4 * 3;
    let word =
        u32::from(registers[at]) | u32::from(registers[at + 1]) << 8 | u32::from(registers[at + 2]) << 16;
    ((word >> (j % 4 * REGISTER_BITS)) & 0x3f) as u8
}

/// Sets register `j` to `value` if that raises it; returns whether it did.
fn raise_packed(registers: &mut SegmentRegisters, j: usize, value: u8) -> bool {
    if value <= get_packed(registers, j) {
        return false;
    }
    let at = j / 4 * 3;
    let shift = j % 4 * REGISTER_BITS;
    let mut word =
        u32::from(registers[at]) | u32::from(registers[at + 1]) << 8 | u32::from(registers[at + 2]) << 16;
    word = (word & !(0x3f << shift)) | u32::from(value) << shift;
    registers[at..at + 3].copy_from_slice(&word.to_le_bytes()[..3]);
    true
}

/// The entries of `segment` in a sorted sparse list.
fn segment_range(entries: &[u32], segment: usize) -> Range<usize> {
    let segment = segment as u32;
    let start = entries.partition_point(|&e| e >> ENTRY_SEGMENT_SHIFT < segment);
    let end = start + entries[start..].partition_point(|&e| e >> ENTRY_SEGMENT_SHIFT == segment);
    start..end
}

impl TryFrom<Vec<u8>> for DistinctSketch {
    type Error = SketchError;
    fn try_from(bytes: Vec<u8>) -> Result<Self, SketchError> {
        Self::from_bytes(&bytes)
    }
}

impl From<DistinctSketch> for Vec<u8> {
    fn from(sketch: DistinctSketch) -> Vec<u8> {
        sketch.to_bytes()
    }
}

impl fmt::Debug for DistinctSketch {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("DistinctSketch")
            .field("sparse_entries", &self.sparse.len())
            .field("dense_segments", &self.dense_segments())
            .field("estimate", &self.estimate())
            .finish()
    }
}

/// MurmurHash3's 64-bit finalizer: a fixed bijection that spreads every input bit
/// over the whole word, so the register index (top bits) depends on all of `h`.
/// Part of the sketch's meaning: changing it changes every stored sketch.
fn mix(mut h: u64) -> u64 {
    h ^= h >> 33;
    h = h.wrapping_mul(0xff51_afd7_ed55_8ccd);
    h ^= h >> 33;
    h = h.wrapping_mul(0xc4ce_b9fe_1a85_ec53);
    h ^= h >> 33;
    h
}

/// The mixer, for the format upgrade's tests.
#[cfg(test)]
pub(crate) mod tests_support {
    /// See `mix`.
    pub(crate) fn mix(h: u64) -> u64 {
        super::mix(h)
    }
}

/// Mask of the value bits of a sparse entry.
const fn sparse_rank_mask() -> u32 {
    (1 << SPARSE_RANK_BITS) - 1
}

/// 1 + leading zeros of the `64 - precision` bits after the index, capped at their
/// count + 1 (all zero).
fn rank(h: u64, precision: u8) -> u8 {
    let rest = h << precision;
    // `rest` has its low `precision` bits zero, so leading_zeros ≤ 63 - precision
    // unless it is zero altogether, which the cap covers.
    let cap = 64 - u32::from(precision) + 1;
    (rest.leading_zeros() + 1).min(cap) as u8
}

/// Dense register index and value of a hash.
fn dense_register(h: u64) -> (usize, u8) {
    ((h >> (64 - HLL_PRECISION)) as usize, rank(h, HLL_PRECISION))
}

/// Sparse entry of a hash: `slot << 6 | value`.
fn sparse_entry(h: u64) -> u32 {
    let slot = (h >> (64 - SPARSE_PRECISION)) as u32;
    (slot << SPARSE_RANK_BITS) | u32::from(rank(h, SPARSE_PRECISION))
}

/// The dense register (index, value) a sparse entry implies, exactly as if the
/// original hash had been inserted into a dense sketch: the 6 slot bits below the
/// dense index are the first bits the dense value counts zeros in.
fn sparse_to_dense(entry: u32) -> (usize, u8) {
    let slot = entry >> SPARSE_RANK_BITS;
    let index = (slot >> SPARSE_EXTRA_BITS) as usize;
    let extra = slot & ((1 << SPARSE_EXTRA_BITS) - 1);
    let rank = if extra != 0 {
        (extra.leading_zeros() - (32 - SPARSE_EXTRA_BITS) + 1) as u8
    } else {
        SPARSE_EXTRA_BITS as u8 + (entry & sparse_rank_mask()) as u8
    };
    (index, rank)
}

/// Inserts `entry` into the sorted list, keeping one entry per slot with the larger
/// value; returns whether the list changed.
fn sparse_insert(entries: &mut Vec<u32>, entry: u32) -> bool {
    let slot = entry >> SPARSE_RANK_BITS;
    match entries.binary_search_by_key(&slot, |e| e >> SPARSE_RANK_BITS) {
        Ok(at) if entries[at] < entry => {
            entries[at] = entry;
            true
        }
        Ok(_) => false,
        Err(at) => {
            entries.insert(at, entry);
            true
        }
    }
}

/// Union of two sorted sparse lists, one entry per slot with the larger value.
fn sparse_union(a: &[u32], b: &[u32]) -> Vec<u32> {
    let mut out = Vec::with_capacity(a.len() + b.len());
    let (mut i, mut j) = (0, 0);
    while i < a.len() && j < b.len() {
        let (sa, sb) = (a[i] >> SPARSE_RANK_BITS, b[j] >> SPARSE_RANK_BITS);
        if sa < sb {
            out.push(a[i]);
            i += 1;
        } else if sb < sa {
            out.push(b[j]);
            j += 1;
        } else {
            // Same slot: the entries differ only in value bits, so max keeps the larger.
            out.push(a[i].max(b[j]));
            i += 1;
            j += 1;
        }
    }
    out.extend_from_slice(&a[i..]);
    out.extend_from_slice(&b[j..]);
    out
}

/// The packed registers of one segment implied by its sparse entries.
fn densify(entries: &[u32]) -> SegmentRegisters {
    let mut registers = [0u8; SEGMENT_BYTES];
    for &entry in entries {
        let (index, rank) = sparse_to_dense(entry);
        raise_packed(&mut registers, index % SEGMENT_REGISTERS, rank);
    }
    registers
}

/// Ertl's improved raw estimator from the register histogram `c` (`c[k]` = registers
/// holding `k`, for `k` in `0..=q+1`) of a sketch with `m` registers.
fn ertl_estimate(c: &[u32], m: usize) -> f64 {
    let m = m as f64;
    let q = c.len() - 2;
    let mut z = m * tau(1.0 - f64::from(c[q + 1]) / m);
    for k in (1..=q).rev() {
        z = 0.5 * (z + f64::from(c[k]));
    }
    z += m * sigma(f64::from(c[0]) / m);
    ALPHA_INF * m * m / z
}

/// `σ(x) = x + Σ_{k≥1} x^(2^k) 2^(k-1)`: the correction for empty registers.
fn sigma(mut x: f64) -> f64 {
    if x >= 1.0 {
        return f64::INFINITY;
    }
    let mut y = 1.0;
    let mut z = x;
    for _ in 0..SERIES_ITERATIONS_MAX {
        x *= x;
        let previous = z;
        z += x * y;
        y += y;
        if z == previous {
            break;
        }
    }
    z
}

/// `τ(x) = (1 − x − Σ_{k≥1} (1 − x^(2^−k))² 2^−k) / 3`: the correction for saturated
/// registers.
fn tau(mut x: f64) -> f64 {
    if x <= 0.0 || x >= 1.0 {
        return 0.0;
    }
    let mut y = 1.0;
    let mut z = 1.0 - x;
    for _ in 0..SERIES_ITERATIONS_MAX {
        x = x.sqrt();
        let previous = z;
        y *= 0.5;
        z -= (1.0 - x) * (1.0 - x) * y;
        if z == previous {
            break;
        }
    }
    z / 3.0
}

#[cfg(test)]
mod tests {
    use super::*;

    fn sketch_of(range: std::ops::Range<u64>) -> DistinctSketch {
        let mut s = DistinctSketch::new();
        for i in range {
            s.insert_hash(member_hash(&format!("user-{i}")));
        }
        s
    }

    #[test]
    fn empty_sketch_is_zero_and_small() {
        let s = DistinctSketch::new();
        assert_eq!(s.estimate(), 0);
        assert!(s.is_empty());
        assert_eq!(s.size_bytes(), std::mem::size_of::<DistinctSketch>());
        assert!(std::mem::size_of::<DistinctSketch>() <= 64);
        assert_eq!(DistinctSketch::from_bytes(&s.to_bytes()), Ok(s.clone()));
        assert_eq!(s.encoded_len(), HEADER_LEN_BYTES + COUNT_LEN_BYTES + CHECKSUM_LEN_BYTES);
    }

    #[test]
    fn relative_error_is_the_stated_one() {
        assert!((DistinctSketch::relative_error() - 0.008125).abs() < 1e-12);
    }

    #[test]
    fn a_full_sketch_packs_six_bit_registers_into_twelve_kib() {
        assert_eq!(DENSE_BYTES, 12_288);
        assert_eq!(SEGMENTS * SEGMENT_BYTES, DENSE_BYTES);
        let s = sketch_of(0..200_000);
        assert_eq!(s.dense_segments() as usize, SEGMENTS);
        assert_eq!(s.encoded_len(), HEADER_LEN_BYTES + DENSE_BYTES + COUNT_LEN_BYTES + CHECKSUM_LEN_BYTES);
        assert!(s.size_bytes() <= std::mem::size_of::<DistinctSketch>() + DENSE_BYTES);
    }

    #[test]
    fn packed_registers_hold_every_value_independently() {
        let mut r = [0u8; SEGMENT_BYTES];
        for j in 0..SEGMENT_REGISTERS {
            assert!(raise_packed(&mut r, j, (j % 52) as u8) || j % 52 == 0);
        }
        for j in 0..SEGMENT_REGISTERS {
            assert_eq!(get_packed(&r, j), (j % 52) as u8, "register {j}");
        }
        assert!(!raise_packed(&mut r, 5, 1), "lower values never overwrite");
        assert!(raise_packed(&mut r, 5, 63));
        assert_eq!((get_packed(&r, 4), get_packed(&r, 5), get_packed(&r, 6)), (4, 63, 6));
    }

    #[test]
    fn small_sets_are_counted_almost_exactly() {
        for n in [1u64, 2, 3, 10, 100, 1_000] {
            let s = sketch_of(0..n);
            let e = s.estimate();
            assert!(e.abs_diff(n) <= n / 500, "n={n} estimate={e}");
            assert_eq!(s.dense_segments(), 0, "n={n} should still be sparse");
        }
    }

    #[test]
    fn a_thousand_members_cost_under_two_kilobytes_stored() {
        let s = sketch_of(0..1_000);
        assert!(s.encoded_len() < 2_000, "{} bytes", s.encoded_len());
        assert!(s.size_bytes() < 4_200 + std::mem::size_of::<DistinctSketch>());
    }

    #[test]
    fn weak_hashes_are_spread_by_the_mixer() {
        // Small integers share their top bits; the mixer must still tell them apart.
        let mut s = DistinctSketch::new();
        for h in 0..1_000u64 {
            assert!(s.insert_hash(h), "{h} collided");
        }
        assert!(s.estimate().abs_diff(1_000) <= 1, "{}", s.estimate());
        assert_eq!(mix(0), 0);
        assert_ne!(mix(1), 1);
    }

    #[test]
    fn insert_reports_change() {
        let mut s = DistinctSketch::new();
        let h = member_hash("user-1");
        assert!(s.insert_hash(h));
        assert!(!s.insert_hash(h));
        let mut dense = sketch_of(0..20_000);
        assert_eq!(dense.dense_segments() as usize, SEGMENTS);
        let before = dense.clone();
        for i in 0..20_000 {
            assert!(!dense.insert_hash(member_hash(&format!("user-{i}"))));
        }
        assert_eq!(dense, before);
    }

    #[test]
    fn a_segment_turns_dense_exactly_past_its_sparse_limit() {
        // Members of segment 0 only.
        let mut s = DistinctSketch::new();
        let mut i = 0u64;
        let mut members = Vec::new();
        while s.dense_segments() == 0 {
            let h = member_hash(&format!("m{i}"));
            i += 1;
            if mix(h) >> (64 - SEGMENT_BITS) != 0 {
                continue;
            }
            members.push(h);
            s.insert_hash(h);
            if s.dense_segments() == 0 {
                assert!(s.sparse.len() <= SEGMENT_SPARSE_MAX);
            }
        }
        assert!(s.sparse.is_empty());
        assert_eq!(s.dense_map, 1);
        // Its registers are exactly the dense registers of its members.
        for h in &members {
            let (index, rank) = dense_register(mix(*h));
            assert!(get_packed(&s.dense[0], index) >= rank);
        }
        assert!(
            s.encoded_len() < HEADER_LEN_BYTES + SEGMENT_BYTES + COUNT_LEN_BYTES + CHECKSUM_LEN_BYTES + 1
        );
    }

    #[test]
    fn sparse_entries_convert_to_the_dense_register_of_their_hash() {
        let hashes = [
            0u64,
            u64::MAX,
            1,
            1 << 43,
            1 << 44,
            1 << 49,
            1 << 50,
            0x0000_4000_0000_0000,
            0xdead_beef_cafe_f00d,
            member_hash("user-42"),
        ];
        for h in hashes {
            assert_eq!(sparse_to_dense(sparse_entry(h)), dense_register(h), "hash {h:#x}");
        }
        for i in 0..100_000u64 {
            let h = hash64(7, &i.to_le_bytes());
            assert_eq!(sparse_to_dense(sparse_entry(h)), dense_register(h));
        }
        assert_eq!(dense_register(0), (0, DENSE_RANK_MAX));
        assert_eq!(sparse_entry(0) & sparse_rank_mask(), u32::from(SPARSE_RANK_MAX));
    }

    #[test]
    fn merge_is_commutative_associative_and_idempotent() {
        // Cover every pair of forms: small sparse, mixed, dense.
        let parts = [sketch_of(0..50), sketch_of(25..3_000), sketch_of(2_000..30_000)];
        for a in &parts {
            let mut aa = a.clone();
            aa.merge(a);
            assert_eq!(&aa, a, "merge with itself changes nothing");
            for b in &parts {
                let mut ab = a.clone();
                ab.merge(b);
                let mut ba = b.clone();
                ba.merge(a);
                assert_eq!(ab, ba);
                assert_eq!(ab.to_bytes(), ba.to_bytes());
            }
        }
        let whole = sketch_of(0..30_000);
        let mut left = parts[0].clone();
        left.merge(&parts[1]);
        left.merge(&parts[2]);
        let mut right = parts[2].clone();
        right.merge(&parts[1]);
        right.merge(&parts[0]);
        assert_eq!(left, whole, "merge loses nothing");
        assert_eq!(right, whole);
        let mut empty = DistinctSketch::new();
        empty.merge(&whole);
        assert_eq!(empty, whole);
    }

    #[test]
    fn sparse_halves_merge_into_the_sketch_of_the_whole() {
        let a = sketch_of(0..1_500);
        let b = sketch_of(1_500..3_000);
        let mut ab = a.clone();
        ab.merge(&b);
        let whole = sketch_of(0..3_000);
        assert!(whole.dense_segments() > 0);
        assert_eq!(ab, whole);
    }

    #[test]
    fn shards_owning_register_slices_cost_one_sketch_together() {
        for shards in [1u16, 3, 64] {
            let mut parts = vec![DistinctSketch::new(); usize::from(shards)];
            for i in 0..200_000u64 {
                let h = member_hash(&format!("user-{i}"));
                parts[usize::from(shard_of_member(h, shards))].insert_hash(h);
            }
            let stored: usize = parts.iter().map(DistinctSketch::encoded_len).sum();
            let overhead = usize::from(shards) * (HEADER_LEN_BYTES + COUNT_LEN_BYTES + CHECKSUM_LEN_BYTES);
            // A slice boundary inside a segment costs that segment twice, at most.
            let bound = DENSE_BYTES + overhead + usize::from(shards) * SEGMENT_BYTES;
            assert!(stored <= bound, "{shards} shards: {stored} bytes > {bound}");
            let mut merged = DistinctSketch::new();
            for p in &parts {
                merged.merge(p);
            }
            assert_eq!(merged, sketch_of(0..200_000), "{shards} shards");
        }
        assert_eq!(shard_of_member(0, 64), 0);
        for h in [1u64, u64::MAX, 12_345] {
            assert!(shard_of_member(h, 1024) < 1024);
            assert_eq!(shard_of_member(h, 1), 0);
        }
    }

    #[test]
    fn insertion_order_does_not_matter() {
        let forward = sketch_of(0..10_000);
        let mut backward = DistinctSketch::new();
        for i in (0..10_000u64).rev() {
            backward.insert_hash(member_hash(&format!("user-{i}")));
        }
        assert_eq!(forward.to_bytes(), backward.to_bytes());
        assert_eq!(forward.estimate(), backward.estimate());
    }

    #[test]
    fn bytes_round_trip_in_every_form() {
        for s in [
            DistinctSketch::new(),
            sketch_of(0..1),
            sketch_of(0..1_000),
            sketch_of(0..2_500),
            sketch_of(0..50_000),
        ] {
            let bytes = s.to_bytes();
            let back = DistinctSketch::from_bytes(&bytes).unwrap();
            assert_eq!(back, s);
            assert_eq!(back.estimate(), s.estimate());
            assert_eq!(back.to_bytes(), bytes);
        }
    }

    #[test]
    fn from_parts_is_canonical() {
        let s = sketch_of(0..2_500);
        assert!(s.dense_segments() > 0 && !s.sparse.is_empty(), "a mixed sketch");
        let mut entries = Vec::new();
        for i in 0..2_500u64 {
            entries.push(sparse_entry(mix(member_hash(&format!("user-{i}")))));
        }
        entries.reverse();
        entries.extend_from_slice(&entries.clone()[..10]);
        assert_eq!(DistinctSketch::from_parts(&[], &entries), s);
        let mut registers = vec![0u8; HLL_REGISTERS];
        for i in 0..50_000u64 {
            let (index, rank) = dense_register(mix(member_hash(&format!("user-{i}"))));
            registers[index] = registers[index].max(rank);
        }
        assert_eq!(DistinctSketch::from_parts(&registers, &[]), sketch_of(0..50_000));
        assert_eq!(DistinctSketch::from_parts(&[], &[]), DistinctSketch::new());
    }

    #[test]
    fn serde_goes_through_the_validated_bytes() {
        let s = sketch_of(0..100);
        let encoded = crate::codec::encode(&s);
        assert_eq!(crate::codec::decode::<DistinctSketch>("sketch", &encoded), Ok(s));
        let mut bad = encoded.clone();
        let last = bad.len() - 1;
        bad[last] ^= 1;
        assert!(crate::codec::decode::<DistinctSketch>("sketch", &bad).is_err());
    }

    /// Re-encodes `content` with a valid checksum, to reach the checks behind it.
    fn sealed(mut content: Vec<u8>) -> Vec<u8> {
        let checksum = hash64(CHECKSUM_SEED, &content);
        content.extend_from_slice(&checksum.to_le_bytes());
        content
    }

    fn content(b: &[u8]) -> Vec<u8> {
        b[..b.len() - CHECKSUM_LEN_BYTES].to_vec()
    }

    #[test]
    fn corrupt_bytes_are_refused() {
        let sparse = sketch_of(0..100).to_bytes();
        let mixed = sketch_of(0..2_500).to_bytes();
        let dense = sketch_of(0..50_000).to_bytes();
        assert!(matches!(DistinctSketch::from_bytes(&[]), Err(SketchError::TooShort { .. })));
        assert!(matches!(
            DistinctSketch::from_bytes(&sparse[..10]),
            Err(SketchError::TooShort { .. }) | Err(SketchError::Checksum)
        ));
        // Every single-bit flip is caught (by the checksum at the latest).
        for bytes in [&sparse, &mixed, &dense] {
            for at in (0..bytes.len()).step_by(97).chain([0, 1, 2, bytes.len() - 1]) {
                let mut bad = bytes.clone();
                bad[at] ^= 0x10;
                assert!(DistinctSketch::from_bytes(&bad).is_err(), "flip at {at} accepted");
            }
            assert!(DistinctSketch::from_bytes(&bytes[..bytes.len() - 1]).is_err());
            let mut long = bytes.clone();
            long.push(0);
            assert!(DistinctSketch::from_bytes(&long).is_err());
        }

        // Behind a valid checksum, each field is still checked.
        let mut c = content(&sparse);
        c[0] = 9;
        assert_eq!(DistinctSketch::from_bytes(&sealed(c)), Err(SketchError::Version(9)));
        let mut c = content(&sparse);
        c[1] = 12;
        assert_eq!(DistinctSketch::from_bytes(&sealed(c)), Err(SketchError::Precision(12)));
        // A map claiming dense segments the body lacks.
        let mut c = content(&sparse);
        c[2] = 0xff;
        assert!(matches!(DistinctSketch::from_bytes(&sealed(c)), Err(SketchError::BodyLength { .. })));
        // A huge count is refused before any allocation.
        let at = HEADER_LEN_BYTES;
        let mut c = content(&sparse);
        c[at..at + 2].copy_from_slice(&u16::MAX.to_le_bytes());
        assert_eq!(
            DistinctSketch::from_bytes(&sealed(c)),
            Err(SketchError::TooManyEntries { count: u64::from(u16::MAX) })
        );
        // Fewer or more entries than the stream holds.
        let mut c = content(&sparse);
        c[at..at + 2].copy_from_slice(&99u16.to_le_bytes());
        assert!(DistinctSketch::from_bytes(&sealed(c)).is_err());
        let mut c = content(&sparse);
        c[at..at + 2].copy_from_slice(&101u16.to_le_bytes());
        assert!(DistinctSketch::from_bytes(&sealed(c)).is_err());
        // Set padding bits.
        let mut c = content(&sparse);
        let last = c.len() - 1;
        c[last] |= 0x80;
        let padded = DistinctSketch::from_bytes(&sealed(c));
        // Either the top bit was padding (refused) or data (then some entry changed).
        assert!(padded.as_ref().map_or(true, |s| s != &sketch_of(0..100)));
        // A dense register beyond the largest possible value.
        let dense_map = u64::from_le_bytes(dense[2..10].try_into().unwrap());
        assert_eq!(dense_map, u64::MAX);
        let mut c = content(&dense);
        c[HEADER_LEN_BYTES] |= 0x3f;
        assert_eq!(DistinctSketch::from_bytes(&sealed(c)), Err(SketchError::Register { at: 0, value: 63 }));
        // An all-zero dense segment.
        let mut c = content(&dense);
        c[HEADER_LEN_BYTES..HEADER_LEN_BYTES + SEGMENT_BYTES].fill(0);
        assert_eq!(DistinctSketch::from_bytes(&sealed(c)), Err(SketchError::EmptySegment(0)));
        // A sparse entry in a dense segment: mark the first sparse entry's segment dense.
        let s = sketch_of(0..100);
        let segment = (s.sparse[0] >> ENTRY_SEGMENT_SHIFT) as usize;
        let mut c = vec![FORMAT_VERSION, HLL_PRECISION];
        c.extend_from_slice(&(1u64 << segment).to_le_bytes());
        let mut registers = [0u8; SEGMENT_BYTES];
        raise_packed(&mut registers, 0, 1);
        c.extend_from_slice(&registers);
        c.extend_from_slice(&content(&sparse)[HEADER_LEN_BYTES..]);
        assert_eq!(DistinctSketch::from_bytes(&sealed(c)), Err(SketchError::Entry { at: 0 }));
    }

    #[test]
    fn garbage_never_panics() {
        // Deterministic pseudo-random inputs of many lengths, with and without a valid
        // checksum; the decoder must answer, never panic.
        for len in 0..600usize {
            let junk: Vec<u8> = (0..len).map(|i| hash64(len as u64, &i.to_le_bytes()) as u8).collect();
            let _ = DistinctSketch::from_bytes(&junk);
            let mut framed = vec![FORMAT_VERSION, HLL_PRECISION];
            framed.extend_from_slice(&(len as u64 % 4).to_le_bytes());
            framed.extend_from_slice(&junk);
            let _ = DistinctSketch::from_bytes(&sealed(framed.clone()));
            let mut sparse_only = vec![FORMAT_VERSION, HLL_PRECISION];
            sparse_only.extend_from_slice(&0u64.to_le_bytes());
            sparse_only.extend_from_slice(&((len % 300) as u16).to_le_bytes());
            sparse_only.extend_from_slice(&junk);
            if let Ok(s) = DistinctSketch::from_bytes(&sealed(sparse_only)) {
                // Whatever decodes is canonical: it re-encodes to itself.
                assert_eq!(DistinctSketch::from_bytes(&s.to_bytes()), Ok(s.clone()));
                let _ = s.estimate();
            }
        }
    }

    #[test]
    fn extreme_registers_estimate_without_panicking() {
        let mut all_max = vec![FORMAT_VERSION, HLL_PRECISION];
        all_max.extend_from_slice(&u64::MAX.to_le_bytes());
        let mut registers = [0u8; SEGMENT_BYTES];
        for j in 0..SEGMENT_REGISTERS {
            raise_packed(&mut registers, j, DENSE_RANK_MAX);
        }
        for _ in 0..SEGMENTS {
            all_max.extend_from_slice(&registers);
        }
        all_max.extend_from_slice(&0u16.to_le_bytes());
        let s = DistinctSketch::from_bytes(&sealed(all_max)).unwrap();
        assert!(s.estimate() > 1 << 60);
    }

    #[test]
    fn member_hash_is_pinned() {
        // A change here changes every stored sketch's meaning: a format break.
        assert_eq!(member_hash("user-42"), PINNED_MEMBER_HASH);
        assert_eq!(sketch_of(0..3).to_bytes(), PINNED_SKETCH_BYTES);
    }

    const PINNED_MEMBER_HASH: u64 = 0x5385_62c8_60c4_7684;
    const PINNED_SKETCH_BYTES: [u8; 29] = [
        2, 14, 0, 0, 0, 0, 0, 0, 0, 0, 3, 0, 236, 246, 53, 95, 175, 179, 202, 202, 1, 193, 163, 154, 178,
        246, 40, 25, 117,
    ];
}
