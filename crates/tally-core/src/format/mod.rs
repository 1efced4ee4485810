//! Format versions: which layout wrote a store, and which protocol a peer speaks.
//!
//! Every store a node keeps carries a *format marker*, and every node-to-node frame and
//! raft RPC carries a *protocol version*. A node reads the formats in its readable
//! range and speaks exactly one protocol; anything else is refused with a message that
//! names both versions and the fix, never decoded into something else.
//!
//! The first releases wrote no marker: a store without one that already holds data is
//! of [`FIRST_FORMAT`]. So the marker's absence means "new" only for an empty store.
//!
//! This module only decides; the store and transport layers read and write the markers.
//! [`v1`] holds format 1's records, frozen, and their upgrade to today's; [`v2`] the
//! distinct-sketch bytes of format 2 and theirs; [`v3`] the records of formats 2 and 3
//! that format 4 laid out anew; [`v4`] the records of format 4 that format 5 laid out
//! anew; [`v5`] the records of format 5 that format 6 laid out anew; [`v6`] the
//! records of format 6 (and 7) that format 8 laid out anew; [`v8`] the records of
//! engine store format 8 (raft store formats 7 and 8) that engine store format 9
//! (raft store format 9) laid out anew.

use std::ops::RangeInclusive;

pub mod v1;
pub mod v2;
pub mod v3;
pub mod v4;
pub mod v5;
pub mod v6;
pub mod v8;

/// The format of a store that predates format markers.
pub const FIRST_FORMAT: u32 = 1;

/// The engine store's layout (shard trees, key layout, the codec of images and dedup
/// records) written by this release. Format 2 added fields to shard images and
/// counter specs (see [`v1`]); format 3 packed distinct sketches' registers at 6 bits
/// in sparse-or-dense segments (see [`v2`]); format 4 added sliding windows to counter
/// specs and shard images (see [`v3`]); format 5 added bounded counters: a `min` and a
/// `max` in counter specs, and the escrow ledger in shard images (see [`v4`]); format 6
/// added window limits: a `limit` in counter specs (see [`v5`]); format 7 lets a shard
/// image's value carry, after the image, the dedup records its write put after it, so
/// a shard write needs no atomic batch (its records are restored from the image when
/// a crash lost them). Format 6's values are format 7's values that carry nothing, so
/// its upgrade only writes the marker; a release that reads at most format 6 refuses
/// a format 7 store instead of reading carried records as corruption. Format 8 added
/// a counter's own replica count: `replicas` in counter specs (see [`v6`]); the ids
/// of shards of such counters carry it in their generation's word, and every id of
/// a counter without one encodes as before. Format 9 added a counter's expiry:
/// `expires_at_ms` in counter metadata (see [`v8`]), and records of namespaces under
/// a key prefix of their own.
pub const STORE_FORMAT: u32 = 9;
/// The engine store formats this release opens: it upgrades the older ones in place.
pub const STORE_FORMATS_READABLE: RangeInclusive<u32> = FIRST_FORMAT..=STORE_FORMAT;

/// The metadata raft store's layout (log, vote, state machine, identity) written by
/// this release. Format 2 added fields to counter specs (see [`v1`]); format 3 added
/// sliding windows to them (see [`v3`]); format 4 added their bounds, `min` and `max`
/// (see [`v4`]); format 5 added the auto bounds of counters whose shard count follows
/// contention (kept in the state and its snapshots, and set by two new requests);
/// format 6 added window limits, a `limit` in counter specs and spec patches (see
/// [`v5`]); format 7 added a counter's own replica count, `replicas` in counter specs
/// and spec patches (see [`v6`]), and tombstones name a deleted counter's generations
/// by their words, which carry that count (a counter without one: the generation);
/// format 8 added the proposal book to the state and its snapshots, and a request
/// (and an answer) after the others: a proposal under its proposer's identity,
/// applied once however often it is resent; format 9 added a counter's expiry, `expires_at_ms` in counter metadata (see
/// [`v8`]) and in the answers the proposal book keeps, and the namespaces table to
/// the state and its snapshots; its entries may hold the requests that set them and
/// the commands that expire, persist or reclaim a counter (added after the earlier
/// ones, so the entries of formats 7 and 8 decode as they are); format 10 keeps each
/// answer of the proposal book in a record of its own (a proposal wrote its
/// proposer's whole book before), and its entries may create many counters at once
/// (a request and an answer added after the others).
pub const RAFT_STORE_FORMAT: u32 = 10;
/// The raft store formats this release opens.
pub const RAFT_STORE_FORMATS_READABLE: RangeInclusive<u32> = FIRST_FORMAT..=RAFT_STORE_FORMAT;

/// The node-to-node protocol (transport frames and the engine's shard requests).
/// Protocol 2: a shard's answer to a read says whether the shard is sealed, a
/// hand-off page whether it is sealed, and the distinct sketches that shard images
/// and sketch merges carry are in store format 3's encoding. Protocol 3: an
/// increment a node forwards carries its writer's sequence number. Protocol 4: a
/// request names what it is for (a shard's owner, a range group's raft message, or
/// the question whether a node's group of a range is formed). Protocol 5: shard images
/// (in reads, seals and hand-off pages) carry the shard's window buckets, and counter
/// specs their windows. Protocol 6: counter specs carry their bounds, shard images the
/// shard's escrow ledger, a shard's answer to an increment may be that it would take a
/// bounded counter past its bound (`BoundExceeded`), and shards of a bounded counter
/// send each other escrow messages (a request kind of its own). Protocol 7: a node may
/// ask another what it has seen of an auto counter (a request for the node, not a
/// shard). Protocol 8: counter specs carry their window limit (`limit`). Protocol 9:
/// a node may ask a range's leader whether its group still lists a replica, and a
/// leader leaving its range may ask a voter to stand for election. Protocol 10: a
/// shard's failed answer names the shard's owner when the answering node knows it
/// is another node. Protocol 11: counter specs carry the counter's own replica
/// count (`replicas`), and a shard id's generation word its replica class.
/// Protocol 12: a request to delete a shard says whether it prunes a sealed
/// generation, and of which incarnation of its counter.
/// Protocol 13: a shard's answer to a submission carries the value that submission
/// left the shard at (`ShardReply::Done::after`).
/// Protocol 14: a node asks the owner of a counter's first shard to run a
/// reconciliation of the counter (`ShardRequest::Reconcile`), so that the runs of
/// one counter go one at a time across the cluster.
/// Protocol 15: a shard read and a submission name the incarnation of the counter
/// they are for (`born_ms`), and the owner serves them only if the latest metadata
/// gives the shard to that incarnation.
pub const PEER_PROTOCOL: u32 = 15;
/// The raft RPC protocol (paths, envelopes, answers). Protocol 2 added the proof of
/// the cluster secret every RPC carries (`tally_raft::auth`). Protocol 3: counter specs
/// and spec patches in entries and snapshots carry sliding windows. Protocol 4: they
/// carry bounds (`min`, `max`) too. Protocol 5: snapshots carry counters' auto bounds,
/// and entries may set them or reshard an auto counter. Protocol 6: counter specs and
/// spec patches carry a window limit (`limit`). Protocol 7: they carry a replica
/// count (`replicas`). Protocol 8: entries may be proposals under their proposer's
/// identity, snapshots carry the proposal book, and an answer may be `Forgotten`.
/// Protocol 9: counter metadata carries its expiry, snapshots the namespaces, and
/// entries may expire, persist or reclaim a counter, or declare and drop namespaces.
/// Protocol 10: entries may create many counters at once (`EnsureMany`), answered
/// per counter.
pub const RAFT_PROTOCOL: u32 = 10;

/// Turns one record's bytes of an earlier format into today's bytes.
pub type Rewrite<'a> = &'a dyn Fn(&[u8]) -> Result<Vec<u8>, crate::codec::DecodeError>;

/// Bytes of an encoded marker or protocol version: a `u32`, little-endian.
pub const VERSION_BYTES: usize = 4;

/// What opening a store must do about its marker.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Verdict {
    /// The format the store holds.
    pub found: u32,
    /// Whether the caller must write the current marker (a new store, a store of an
    /// older readable format, or one that predates markers).
    pub write_marker: bool,
}

/// Why a store or peer is refused.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FormatError {
    /// The store was written in a format this release does not read.
    #[error(
        "the {what} was written in format {found}; this release reads formats {}..={}: \
         run a release that reads format {found}, or move this data directory away to start empty",
        readable.start(), readable.end()
    )]
    UnknownStore {
        /// Which store.
        what: &'static str,
        /// Its marker.
        found: u32,
        /// What this release reads.
        readable: RangeInclusive<u32>,
    },
    /// The marker is not a version at all.
    #[error("the {what}'s format marker is {len} bytes, not {VERSION_BYTES}: the store is corrupt")]
    CorruptMarker {
        /// Which store.
        what: &'static str,
        /// The marker's length.
        len: usize,
    },
    /// A peer speaks another protocol.
    #[error(
        "{what} protocol mismatch: the peer speaks version {theirs}, this node speaks {ours}; \
         run the same release on every node"
    )]
    Protocol {
        /// Which protocol.
        what: &'static str,
        /// This node's version.
        ours: u32,
        /// The peer's, as received.
        theirs: u32,
    },
}

/// Encodes a marker or protocol version.
pub fn encode_version(version: u32) -> [u8; VERSION_BYTES] {
    version.to_le_bytes()
}

/// Decides what to do with a store whose marker is `marker` (`None`: absent).
/// `holds_data` says whether the store was written before (a marker's absence then
/// means [`FIRST_FORMAT`]).
pub fn judge_store(
    what: &'static str,
    marker: Option<&[u8]>,
    holds_data: bool,
    readable: RangeInclusive<u32>,
) -> Result<Verdict, FormatError> {
    let current = *readable.end();
    let found = match marker {
        None if !holds_data => return Ok(Verdict { found: current, write_marker: true }),
        None => FIRST_FORMAT,
        Some(bytes) => {
            let bytes: [u8; VERSION_BYTES] =
                bytes.try_into().map_err(|_| FormatError::CorruptMarker { what, len: bytes.len() })?;
            u32::from_le_bytes(bytes)
        }
    };
    if !readable.contains(&found) {
        return Err(FormatError::UnknownStore { what, found, readable });
    }
    Ok(Verdict { found, write_marker: marker.is_none() || found != current })
}

/// Splits a frame into its leading protocol version and the rest, refusing any version
/// but `ours`. A frame too short to hold a version is refused as version 0.
pub fn split_versioned<'a>(what: &'static str, ours: u32, frame: &'a [u8]) -> Result<&'a [u8], FormatError> {
    if frame.len() < VERSION_BYTES {
        return Err(FormatError::Protocol { what, ours, theirs: 0 });
    }
    let (version, rest) = frame.split_at(VERSION_BYTES);
    let theirs = u32::from_le_bytes(version.try_into().expect("split at VERSION_BYTES"));
    check_protocol(what, ours, theirs)?;
    Ok(rest)
}

/// Refuses a peer's protocol version unless it is `ours`.
pub fn check_protocol(what: &'static str, ours: u32, theirs: u32) -> Result<(), FormatError> {
    if theirs == ours {
        Ok(())
    } else {
        Err(FormatError::Protocol { what, ours, theirs })
    }
}

/// `body` behind the protocol version `ours`.
pub fn versioned(ours: u32, mut body: Vec<u8>) -> Vec<u8> {
    body.splice(0..0, encode_version(ours));
    body
}

#[cfg(test)]
mod tests {
    use super::*;

    const READABLE: RangeInclusive<u32> = 2..=3;

    #[test]
    fn a_new_store_is_marked_with_the_current_format() {
        assert_eq!(judge_store("store", None, false, READABLE), Ok(Verdict { found: 3, write_marker: true }));
    }

    #[test]
    fn a_store_without_a_marker_that_holds_data_is_of_the_first_format() {
        assert_eq!(
            judge_store("store", None, true, FIRST_FORMAT..=2),
            Ok(Verdict { found: FIRST_FORMAT, write_marker: true })
        );
        // …which a release that no longer reads it refuses, rather than taking it
        // for a new store.
        assert!(matches!(
            judge_store("store", None, true, READABLE),
            Err(FormatError::UnknownStore { found: FIRST_FORMAT, .. })
        ));
    }

    #[test]
    fn readable_formats_open_and_older_ones_are_remarked() {
        let m = |v: u32| encode_version(v);
        assert_eq!(
            judge_store("store", Some(&m(3)), true, READABLE),
            Ok(Verdict { found: 3, write_marker: false })
        );
        assert_eq!(
            judge_store("store", Some(&m(2)), true, READABLE),
            Ok(Verdict { found: 2, write_marker: true })
        );
        // A marker is binding even on an otherwise empty store.
        assert_eq!(
            judge_store("store", Some(&m(3)), false, READABLE),
            Ok(Verdict { found: 3, write_marker: false })
        );
    }

    #[test]
    fn unknown_and_corrupt_markers_are_refused_with_the_fix() {
        let newer = judge_store("engine store", Some(&encode_version(4)), true, READABLE).unwrap_err();
        let text = newer.to_string();
        assert!(text.contains("format 4") && text.contains("2..=3") && text.contains("release"), "{text}");
        assert!(matches!(
            judge_store("store", Some(&[1, 0, 0]), true, READABLE),
            Err(FormatError::CorruptMarker { len: 3, .. })
        ));
        assert!(matches!(
            judge_store("store", Some(&[0; 5]), true, READABLE),
            Err(FormatError::CorruptMarker { len: 5, .. })
        ));
    }

    #[test]
    fn frames_carry_their_protocol_first() {
        let frame = versioned(7, vec![0xaa, 0xbb]);
        assert_eq!(frame, [7, 0, 0, 0, 0xaa, 0xbb]);
        assert_eq!(split_versioned("peer", 7, &frame), Ok(&[0xaa, 0xbb][..]));
        assert_eq!(split_versioned("peer", 7, &versioned(7, Vec::new())), Ok(&[][..]));
        let err = split_versioned("peer", 8, &frame).unwrap_err();
        assert_eq!(err, FormatError::Protocol { what: "peer", ours: 8, theirs: 7 });
        assert!(err.to_string().contains("version 7") && err.to_string().contains("speaks 8"));
        assert_eq!(
            split_versioned("peer", 7, &[7, 0]),
            Err(FormatError::Protocol { what: "peer", ours: 7, theirs: 0 })
        );
    }
}
