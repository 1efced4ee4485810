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
//! * **Dense form:** 2^14 = 16,384 one-byte registers ([`HLL_PRECISION`]); register
//!   index = the mixed hash's top 14 bits, value = 1 + leading zeros of the remaining 50
//!   bits (at most 51). Standard error `1.04 / sqrt(16384)` ≈ 0.81 %.
//! * **Sparse form for small sets** (the HyperLogLog++ idea): a sorted list of the
//!   non-zero registers of a precision-25 sketch, one `u32` each. An empty sketch
//!   allocates nothing and a sketch of a few members costs a few bytes, which matters
//!   when one node holds a million counters. Each entry converts *exactly* into the
//!   precision-14 register it implies, so sparse and dense forms merge losslessly. The
//!   sketch turns dense when the list would outgrow the dense registers
//!   ([`SPARSE_ENTRIES_MAX`] entries = 16 KiB). Below that the estimate is close to
//!   exact (collisions among 2^25 slots are rare).
//! * **Canonical state.** Which form a sketch is in depends only on the *set* of hashes
//!   inserted (dense once more than [`SPARSE_ENTRIES_MAX`] distinct precision-25
//!   slots are occupied), never on insertion or merge order. So two sketches of the
//!   same set are equal and serialize to identical bytes, whatever order built them.
//! * **Estimator:** Otmar Ertl's "improved raw estimator" (*New cardinality estimation
//!   algorithms for HyperLogLog sketches*, 2017), applied to the register histogram. It
//!   is accurate over the whole range without empirical bias tables or a switch to
//!   linear counting, and it uses only `+ * /` and `sqrt`, which IEEE 754 rounds
//!   exactly, so every machine computes the same estimate from the same registers.
//! * **Bytes:** a version byte, the precision, the form, the body, and an XXH3-64
//!   checksum. Decoding checks every field (lengths, entry order, register range,
//!   checksum) before building anything and never allocates more than the fixed
//!   dense size, so corrupt bytes are an error, never a panic or a huge allocation.
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
//!   it is built on tagged pointers and `unsafe`.
//! * `hyperloglockless` 0.5 has fast dense HLLs (1 byte per register, 16 KiB at
//!   precision 14 even when empty) and `insert_hash`. Rejected because bytes are only
//!   available through its `serde` feature (not enabled in the workspace) or
//!   `parts`/`from_parts`, which trust the stored zero count and sum and *panic* on a
//!   bad length; a register value above 65 from corrupt input indexes past its
//!   `INV_POW2` table (panic); the sparse `HyperLogLogPlus` has no validated byte form
//!   and its encoding depends on when its insert buffer was flushed; the default
//!   constructor draws a random SipHash key per instance.
//!
//! Neither gives stable, validated bytes; a plain HyperLogLog with a sparse list is a
//! few hundred lines that we can state invariants about, so it is written here.

use crate::hash::{hash64, MEMBER_SEED};
use serde::{Deserialize, Serialize};
use std::fmt;

/// Register-index bits of the dense sketch: 2^14 registers, standard error ≈ 0.81 %.
/// Changing it changes every stored sketch: it is part of the byte format.
pub const HLL_PRECISION: u8 = 14;

/// Number of dense registers (one byte each), `2^HLL_PRECISION`.
pub const HLL_REGISTERS: usize = 1 << HLL_PRECISION;

/// Most entries the sparse form holds before turning dense: at 4 bytes an entry,
/// the point where the list would cost as much as the 16 KiB of dense registers.
pub const SPARSE_ENTRIES_MAX: usize = HLL_REGISTERS / 4;

/// Index bits of the sparse form. 25 index bits plus a 6-bit value fill a `u32` entry,
/// and 2^25 slots make collisions among a few thousand members negligible.
const SPARSE_PRECISION: u8 = 25;

/// Number of slots the sparse form's entries index, `2^SPARSE_PRECISION`.
const SPARSE_SLOTS: usize = 1 << SPARSE_PRECISION;

/// Largest dense register value: 1 + the 50 bits after the index all zero.
const DENSE_RANK_MAX: u8 = 64 - HLL_PRECISION + 1;

/// Largest sparse entry value: 1 + the 39 bits after the sparse index all zero.
const SPARSE_RANK_MAX: u8 = 64 - SPARSE_PRECISION + 1;

/// Bits of a sparse entry that hold its value (the rest hold the slot index).
const SPARSE_RANK_BITS: u32 = 6;

/// Sparse index bits that refine a dense register index (25 − 14).
const SPARSE_EXTRA_BITS: u32 = (SPARSE_PRECISION - HLL_PRECISION) as u32;

/// Version byte that starts every encoded sketch.
const FORMAT_VERSION: u8 = 1;
/// Form byte of a sparse body: entry count (`u32` LE) then the entries (`u32` LE each).
const FORM_SPARSE: u8 = 0;
/// Form byte of a dense body: [`HLL_REGISTERS`] register bytes.
const FORM_DENSE: u8 = 1;
/// Version, precision and form bytes.
const HEADER_LEN_BYTES: usize = 3;
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

/// Why bytes were not accepted as a sketch.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SketchError {
    /// Fewer bytes than a header and checksum.
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
    /// Neither the sparse nor the dense form.
    #[error("unknown sketch form {0}")]
    Form(u8),
    /// The body is not the length its form and count imply.
    #[error("sketch body is {len} bytes; {expected} expected")]
    BodyLength {
        /// Body bytes present.
        len: usize,
        /// Body bytes the header implies.
        expected: usize,
    },
    /// A sparse form claiming more entries than [`SPARSE_ENTRIES_MAX`].
    #[error("sparse sketch has {count} entries; the limit is {SPARSE_ENTRIES_MAX}")]
    TooManyEntries {
        /// Entries claimed.
        count: u64,
    },
    /// A sparse entry out of range or out of order.
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
}

/// A mergeable estimate of how many distinct members were inserted.
///
/// `Default` is the empty sketch, which allocates nothing.
#[derive(Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(try_from = "Vec<u8>", into = "Vec<u8>")]
pub struct DistinctSketch {
    /// Sparse or dense registers; which one is a function of the inserted set.
    repr: Repr,
}

/// The two forms of the registers.
#[derive(Clone, PartialEq, Eq)]
enum Repr {
    /// Non-zero precision-25 registers as `slot << 6 | value`, sorted by slot, one per
    /// slot, at most [`SPARSE_ENTRIES_MAX`].
    Sparse(Vec<u32>),
    /// All [`HLL_REGISTERS`] precision-14 registers.
    Dense(Box<[u8]>),
}

impl Default for Repr {
    fn default() -> Self {
        Repr::Sparse(Vec::new())
    }
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
        match &mut self.repr {
            Repr::Sparse(entries) => {
                let changed = sparse_insert(entries, sparse_entry(h));
                if entries.len() > SPARSE_ENTRIES_MAX {
                    self.repr = Repr::Dense(densify(entries));
                }
                changed
            }
            Repr::Dense(registers) => {
                let (index, rank) = dense_register(h);
                raise(&mut registers[index], rank)
            }
        }
    }

    /// Folds `other` into `self`: afterwards `self` is exactly the sketch of the union
    /// of both inputs. Commutative, associative and idempotent.
    pub fn merge(&mut self, other: &DistinctSketch) {
        match (&mut self.repr, &other.repr) {
            (Repr::Sparse(ours), Repr::Sparse(theirs)) => {
                let union = sparse_union(ours, theirs);
                self.repr = if union.len() > SPARSE_ENTRIES_MAX {
                    Repr::Dense(densify(&union))
                } else {
                    Repr::Sparse(union)
                };
            }
            (Repr::Dense(ours), Repr::Sparse(theirs)) => {
                for &entry in theirs {
                    let (index, rank) = sparse_to_dense(entry);
                    raise(&mut ours[index], rank);
                }
            }
            (Repr::Sparse(ours), Repr::Dense(theirs)) => {
                let mut registers = theirs.clone();
                for &entry in ours.iter() {
                    let (index, rank) = sparse_to_dense(entry);
                    raise(&mut registers[index], rank);
                }
                self.repr = Repr::Dense(registers);
            }
            (Repr::Dense(ours), Repr::Dense(theirs)) => {
                for (o, &t) in ours.iter_mut().zip(theirs.iter()) {
                    raise(o, t);
                }
            }
        }
    }

    /// Estimated number of distinct members inserted: 0 for an empty sketch, close to
    /// exact while sparse, within [`DistinctSketch::relative_error`] (one standard
    /// error) about two times in three once dense.
    pub fn estimate(&self) -> u64 {
        let estimate = match &self.repr {
            Repr::Sparse(entries) => {
                if entries.is_empty() {
                    return 0;
                }
                let mut histogram = [0u32; SPARSE_RANK_MAX as usize + 1];
                for &entry in entries {
                    histogram[(entry & sparse_rank_mask()) as usize] += 1;
                }
                // Entries are at most SPARSE_ENTRIES_MAX, far below 2^25.
                histogram[0] = (SPARSE_SLOTS - entries.len()) as u32;
                ertl_estimate(&histogram, SPARSE_SLOTS)
            }
            Repr::Dense(registers) => {
                let mut histogram = [0u32; DENSE_RANK_MAX as usize + 1];
                for &r in registers.iter() {
                    histogram[usize::from(r)] += 1;
                }
                if histogram[0] as usize == HLL_REGISTERS {
                    return 0;
                }
                ertl_estimate(&histogram, HLL_REGISTERS)
            }
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
        match &self.repr {
            Repr::Sparse(entries) => entries.is_empty(),
            Repr::Dense(registers) => registers.iter().all(|&r| r == 0),
        }
    }

    /// Bytes this sketch occupies in memory (inline part plus heap), for the
    /// per-counter memory report. `to_bytes().len()` is its stored size.
    pub fn size_bytes(&self) -> usize {
        let heap = match &self.repr {
            Repr::Sparse(entries) => entries.capacity() * std::mem::size_of::<u32>(),
            Repr::Dense(registers) => registers.len(),
        };
        std::mem::size_of::<Self>() + heap
    }

    /// The stable byte encoding: version, precision, form, body, checksum. Equal
    /// sketches encode to equal bytes in every process and build.
    pub fn to_bytes(&self) -> Vec<u8> {
        let mut out;
        match &self.repr {
            Repr::Sparse(entries) => {
                out = Vec::with_capacity(HEADER_LEN_BYTES + 4 + entries.len() * 4 + CHECKSUM_LEN_BYTES);
                out.extend_from_slice(&[FORMAT_VERSION, HLL_PRECISION, FORM_SPARSE]);
                let count = u32::try_from(entries.len()).expect("at most SPARSE_ENTRIES_MAX");
                out.extend_from_slice(&count.to_le_bytes());
                for entry in entries {
                    out.extend_from_slice(&entry.to_le_bytes());
                }
            }
            Repr::Dense(registers) => {
                out = Vec::with_capacity(HEADER_LEN_BYTES + HLL_REGISTERS + CHECKSUM_LEN_BYTES);
                out.extend_from_slice(&[FORMAT_VERSION, HLL_PRECISION, FORM_DENSE]);
                out.extend_from_slice(registers);
            }
        }
        let checksum = hash64(CHECKSUM_SEED, &out);
        out.extend_from_slice(&checksum.to_le_bytes());
        out
    }

    /// Decodes [`DistinctSketch::to_bytes`] output, checking every field first.
    /// Allocates at most the dense size whatever the input claims.
    pub fn from_bytes(bytes: &[u8]) -> Result<Self, SketchError> {
        let min = HEADER_LEN_BYTES + CHECKSUM_LEN_BYTES;
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
        match header[2] {
            FORM_SPARSE => decode_sparse(body),
            FORM_DENSE => decode_dense(body),
            other => Err(SketchError::Form(other)),
        }
    }
}

/// Body of a sparse sketch: count, then strictly increasing, in-range entries.
fn decode_sparse(body: &[u8]) -> Result<DistinctSketch, SketchError> {
    let Some((count, entries)) = body.split_first_chunk::<4>() else {
        return Err(SketchError::BodyLength { len: body.len(), expected: 4 });
    };
    let count = u32::from_le_bytes(*count);
    if count as usize > SPARSE_ENTRIES_MAX {
        return Err(SketchError::TooManyEntries { count: u64::from(count) });
    }
    let expected = count as usize * 4;
    if entries.len() != expected {
        return Err(SketchError::BodyLength { len: body.len(), expected: 4 + expected });
    }
    let mut out: Vec<u32> = Vec::with_capacity(count as usize);
    for (at, chunk) in entries.chunks_exact(4).enumerate() {
        let entry = u32::from_le_bytes(chunk.try_into().expect("chunks of 4"));
        let rank = entry & sparse_rank_mask();
        let slot = entry >> SPARSE_RANK_BITS;
        let in_range = rank >= 1 && rank <= u32::from(SPARSE_RANK_MAX) && (slot as usize) < SPARSE_SLOTS;
        let ordered = out.last().is_none_or(|&prev| (prev >> SPARSE_RANK_BITS) < slot);
        if !in_range || !ordered {
            return Err(SketchError::Entry { at });
        }
        out.push(entry);
    }
    Ok(DistinctSketch { repr: Repr::Sparse(out) })
}

/// Body of a dense sketch: exactly [`HLL_REGISTERS`] bytes, each a possible value.
fn decode_dense(body: &[u8]) -> Result<DistinctSketch, SketchError> {
    if body.len() != HLL_REGISTERS {
        return Err(SketchError::BodyLength { len: body.len(), expected: HLL_REGISTERS });
    }
    if let Some((at, &value)) = body.iter().enumerate().find(|(_, &r)| r > DENSE_RANK_MAX) {
        return Err(SketchError::Register { at, value });
    }
    Ok(DistinctSketch { repr: Repr::Dense(body.into()) })
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
        let (form, entries) = match &self.repr {
            Repr::Sparse(entries) => ("sparse", entries.len()),
            Repr::Dense(registers) => ("dense", registers.iter().filter(|&&r| r != 0).count()),
        };
        f.debug_struct("DistinctSketch")
            .field("form", &form)
            .field("nonzero_registers", &entries)
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
/// original hash had been inserted into a dense sketch: the 11 slot bits below the
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

/// Sets `*register` to `value` if that raises it; returns whether it did.
fn raise(register: &mut u8, value: u8) -> bool {
    if value > *register {
        *register = value;
        true
    } else {
        false
    }
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

/// Dense registers implied by a sparse list.
fn densify(entries: &[u32]) -> Box<[u8]> {
    let mut registers = vec![0u8; HLL_REGISTERS].into_boxed_slice();
    for &entry in entries {
        let (index, rank) = sparse_to_dense(entry);
        raise(&mut registers[index], rank);
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
        assert!(std::mem::size_of::<DistinctSketch>() <= 32);
        assert_eq!(DistinctSketch::from_bytes(&s.to_bytes()), Ok(s.clone()));
        assert_eq!(s.to_bytes().len(), HEADER_LEN_BYTES + 4 + CHECKSUM_LEN_BYTES);
    }

    #[test]
    fn relative_error_is_the_stated_one() {
        assert!((DistinctSketch::relative_error() - 0.008125).abs() < 1e-12);
    }

    #[test]
    fn small_sets_are_counted_almost_exactly() {
        for n in [1u64, 2, 3, 10, 100, 1_000, 4_000] {
            let s = sketch_of(0..n);
            let e = s.estimate();
            assert!(e.abs_diff(n) <= n / 1000, "n={n} estimate={e}");
            assert!(matches!(s.repr, Repr::Sparse(_)), "n={n} should still be sparse");
        }
    }

    #[test]
    fn weak_hashes_are_spread_by_the_mixer() {
        // Small integers share their top bits; the mixer must still tell them apart.
        let mut s = DistinctSketch::new();
        for h in 0..1_000u64 {
            assert!(s.insert_hash(h), "{h} collided");
        }
        assert_eq!(s.estimate(), 1_000);
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
        assert!(matches!(dense.repr, Repr::Dense(_)));
        let before = dense.clone();
        for i in 0..20_000 {
            assert!(!dense.insert_hash(member_hash(&format!("user-{i}"))));
        }
        assert_eq!(dense, before);
    }

    #[test]
    fn turns_dense_exactly_past_the_sparse_limit() {
        let mut s = DistinctSketch::new();
        let mut i = 0;
        while matches!(&s.repr, Repr::Sparse(e) if e.len() < SPARSE_ENTRIES_MAX) {
            s.insert_hash(member_hash(&format!("m{i}")));
            i += 1;
        }
        assert!(matches!(s.repr, Repr::Sparse(_)));
        assert!(s.size_bytes() <= std::mem::size_of::<DistinctSketch>() + HLL_REGISTERS);
        while matches!(s.repr, Repr::Sparse(_)) {
            s.insert_hash(member_hash(&format!("m{i}")));
            i += 1;
        }
        assert_eq!(s.size_bytes(), std::mem::size_of::<DistinctSketch>() + HLL_REGISTERS);
        let e = s.estimate() as f64;
        assert!((e - i as f64).abs() / (i as f64) < 3.0 * DistinctSketch::relative_error());
    }

    #[test]
    fn sparse_entries_convert_to_the_dense_register_of_their_hash() {
        let hashes = [
            0u64,
            u64::MAX,
            1,
            1 << 38,
            1 << 39,
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
        // Cover every pair of forms: small sparse, large sparse, dense.
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
    fn two_sparse_halves_past_the_limit_merge_into_the_dense_whole() {
        let a = sketch_of(0..3_000);
        let b = sketch_of(3_000..6_000);
        assert!(matches!(a.repr, Repr::Sparse(_)) && matches!(b.repr, Repr::Sparse(_)));
        let mut ab = a.clone();
        ab.merge(&b);
        assert!(matches!(ab.repr, Repr::Dense(_)));
        assert_eq!(ab, sketch_of(0..6_000));
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
    fn bytes_round_trip_in_both_forms() {
        for s in [DistinctSketch::new(), sketch_of(0..1), sketch_of(0..1_000), sketch_of(0..50_000)] {
            let bytes = s.to_bytes();
            let back = DistinctSketch::from_bytes(&bytes).unwrap();
            assert_eq!(back, s);
            assert_eq!(back.estimate(), s.estimate());
            assert_eq!(back.to_bytes(), bytes);
        }
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

    #[test]
    fn corrupt_bytes_are_refused() {
        let sparse = sketch_of(0..100).to_bytes();
        let dense = sketch_of(0..50_000).to_bytes();
        assert!(matches!(DistinctSketch::from_bytes(&[]), Err(SketchError::TooShort { .. })));
        assert!(matches!(
            DistinctSketch::from_bytes(&sparse[..10]),
            Err(SketchError::TooShort { .. }) | Err(SketchError::Checksum)
        ));
        // Every single-bit flip is caught (by the checksum at the latest).
        for bytes in [&sparse, &dense] {
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
        let content = |b: &[u8]| b[..b.len() - CHECKSUM_LEN_BYTES].to_vec();
        let mut c = content(&sparse);
        c[0] = 9;
        assert_eq!(DistinctSketch::from_bytes(&sealed(c)), Err(SketchError::Version(9)));
        let mut c = content(&sparse);
        c[1] = 12;
        assert_eq!(DistinctSketch::from_bytes(&sealed(c)), Err(SketchError::Precision(12)));
        let mut c = content(&sparse);
        c[2] = 7;
        assert_eq!(DistinctSketch::from_bytes(&sealed(c)), Err(SketchError::Form(7)));
        // A huge count is refused before any allocation.
        let mut c = content(&sparse);
        c[3..7].copy_from_slice(&u32::MAX.to_le_bytes());
        assert_eq!(
            DistinctSketch::from_bytes(&sealed(c)),
            Err(SketchError::TooManyEntries { count: u64::from(u32::MAX) })
        );
        let mut c = content(&sparse);
        c[3..7].copy_from_slice(&99u32.to_le_bytes());
        assert!(matches!(DistinctSketch::from_bytes(&sealed(c)), Err(SketchError::BodyLength { .. })));
        // Out-of-order, duplicate and zero-valued entries.
        let mut c = content(&sparse);
        let (first, second) = (c[7..11].to_vec(), c[11..15].to_vec());
        c[7..11].copy_from_slice(&second);
        c[11..15].copy_from_slice(&first);
        assert_eq!(DistinctSketch::from_bytes(&sealed(c)), Err(SketchError::Entry { at: 1 }));
        let mut c = content(&sparse);
        let first = c[7..11].to_vec();
        c[11..15].copy_from_slice(&first);
        assert_eq!(DistinctSketch::from_bytes(&sealed(c)), Err(SketchError::Entry { at: 1 }));
        let mut c = content(&sparse);
        c[7] &= !0x3f;
        assert_eq!(DistinctSketch::from_bytes(&sealed(c)), Err(SketchError::Entry { at: 0 }));
        let mut c = content(&sparse);
        c[7] |= 0x3f;
        assert_eq!(DistinctSketch::from_bytes(&sealed(c)), Err(SketchError::Entry { at: 0 }));
        // A dense register beyond the largest possible value.
        let mut c = content(&dense);
        c[HEADER_LEN_BYTES + 5] = DENSE_RANK_MAX + 1;
        assert_eq!(
            DistinctSketch::from_bytes(&sealed(c)),
            Err(SketchError::Register { at: 5, value: DENSE_RANK_MAX + 1 })
        );
        let mut c = content(&dense);
        c.pop();
        assert!(matches!(DistinctSketch::from_bytes(&sealed(c)), Err(SketchError::BodyLength { .. })));
    }

    #[test]
    fn garbage_never_panics() {
        // Deterministic pseudo-random inputs of many lengths, with and without a valid
        // checksum; the decoder must answer, never panic.
        for len in 0..300usize {
            let junk: Vec<u8> = (0..len).map(|i| hash64(len as u64, &i.to_le_bytes()) as u8).collect();
            let _ = DistinctSketch::from_bytes(&junk);
            let mut framed = vec![FORMAT_VERSION, HLL_PRECISION, (len % 2) as u8];
            framed.extend_from_slice(&junk);
            let _ = DistinctSketch::from_bytes(&sealed(framed));
        }
    }

    #[test]
    fn extreme_registers_estimate_without_panicking() {
        let mut all_max = vec![FORMAT_VERSION, HLL_PRECISION, FORM_DENSE];
        all_max.extend(std::iter::repeat_n(DENSE_RANK_MAX, HLL_REGISTERS));
        let s = DistinctSketch::from_bytes(&sealed(all_max)).unwrap();
        assert!(s.estimate() > 1 << 60);
        let mut zeros = vec![FORMAT_VERSION, HLL_PRECISION, FORM_DENSE];
        zeros.extend(std::iter::repeat_n(0, HLL_REGISTERS));
        let s = DistinctSketch::from_bytes(&sealed(zeros)).unwrap();
        assert!(s.is_empty());
        assert_eq!(s.estimate(), 0);
    }

    #[test]
    fn member_hash_is_pinned() {
        // A change here changes every stored sketch's meaning: a format break.
        assert_eq!(member_hash("user-42"), PINNED_MEMBER_HASH);
        assert_eq!(sketch_of(0..3).to_bytes(), PINNED_SKETCH_BYTES);
    }

    const PINNED_MEMBER_HASH: u64 = 0x5385_62c8_60c4_7684;
    const PINNED_SKETCH_BYTES: [u8; 27] = [
        1, 14, 0, 3, 0, 0, 0, 66, 181, 219, 23, 2, 170, 209, 114, 195, 8, 55, 120, 35, 58, 156, 137, 23, 208,
        180, 58,
    ];
}
