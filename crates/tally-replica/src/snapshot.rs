//! A range's snapshot as it travels: the pairs of the range's state tree, read
//! from the tree in bounded frames while the group goes on applying, and written
//! frame by frame into a staging tree on the receiving replica. Nothing holds a
//! whole range in memory, and no size caps a snapshot.
//!
//! # A fuzzy snapshot, made exact by the log
//!
//! A snapshot is named by the log id `L` it was taken at (its meta), but its
//! pairs are read from the live tree, a frame at a time, after `L` was applied:
//! each pair as it stood at some moment at or after `L`. The receiver installs
//! them as the state at `L`, and then applies the log after `L`, which the leader
//! keeps (it purges only what a snapshot covers). Entries carry absolute images
//! with their shard's commit sequence, and an image is applied only over an
//! older one with its dedup changes (`state_machine`'s apply rule), so the replay
//! ends in the exact state, provided that every shard's image is read *before*
//! its dedup records: then the records read are at or after the image read, an
//! entry the replay refuses (its sequence is not above the image's) is already in
//! the image and the records, and one it applies rewrites every record it
//! touches. So a frame stream lists every image of the range first (keys `s…`),
//! then every dedup record (keys `d…`), each part in key order ([`stream_cmp`]).
//! ZooKeeper's fuzzy snapshots rest on the same argument: idempotent
//! transactions replayed from the snapshot's start.
//!
//! # Frames, resumption and retries
//!
//! A frame ([`Frame`]) names the last key of the frame before it (`after`), its
//! pairs, and whether it is the last. A receiver keeps, in its staging tree,
//! exactly the stream up to the last key staged; a frame replaces everything
//! staged after its `after` key. So a frame sent again (its answer was lost), a
//! stream resumed from the last frame a sender knows was received, and a stream
//! started over (`after` none) all leave the staging tree holding one stream in
//! order, whose parts each come from one read of the tree, later parts from later
//! reads: the argument above holds across them. On the wire a frame is one
//! `InstallSnapshotRequest`'s data, at the byte offset of the stream so far.

use crate::state_machine::Shared;
use crate::storage::{prefix_bound, KvError, KvPair, KvStore, KvTree};
use serde::{Deserialize, Serialize};
use std::cmp::Ordering;
use std::io;
use std::ops::Bound;
use std::pin::Pin;
use std::sync::Arc;
use std::task::{Context, Poll};

/// Key prefix of a shard's image in a state tree.
pub(crate) const PREFIX_SHARD: u8 = b's';
/// Key prefix of a shard's dedup records in a state tree.
pub(crate) const PREFIX_DEDUP: u8 = b'd';

/// Most pairs one frame carries (beside its bytes, bounded by the chunk size):
/// bounds the work of one frame on both sides when keys and values are tiny.
pub const FRAME_PAIRS_MAX: usize = 16_384;
/// Largest encoded frame a receiver accepts, in bytes: a chunk of
/// `SNAPSHOT_CHUNK_BYTES`, or one pair larger than a chunk (a shard image with
/// its sketches), always fits.
pub const FRAME_BYTES_MAX: usize = 32 << 20;
/// Bytes of the length that precedes each frame in a byte stream.
const FRAME_LENGTH_BYTES: usize = 4;

/// One frame of a snapshot stream.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Frame {
    /// The last key of the frame before (`None`: the first frame of a stream).
    pub after: Option<Vec<u8>>,
    /// Pairs of the state tree, in stream order.
    pub pairs: Vec<KvPair>,
    /// Whether the stream ends with this frame.
    pub last: bool,
}

impl Frame {
    /// Where the stream stands after this frame: its last key, else where it began.
    pub fn end(&self) -> Option<Vec<u8>> {
        self.pairs.last().map(|(k, _)| k.clone()).or_else(|| self.after.clone())
    }

    /// The frame as bytes: its length (4 bytes, little-endian), then its encoding.
    pub fn to_bytes(&self) -> Vec<u8> {
        let body = tally_core::codec::encode(self);
        let len = u32::try_from(body.len()).expect("a frame is far below 4 GiB");
        let mut bytes = Vec::with_capacity(FRAME_LENGTH_BYTES + body.len());
        bytes.extend_from_slice(&len.to_le_bytes());
        bytes.extend_from_slice(&body);
        bytes
    }
}

/// Which part of a stream a key belongs to: images (0) come before records (1).
fn part(key: &[u8]) -> u8 {
    u8::from(key.first() != Some(&PREFIX_SHARD))
}

/// The order of keys in a snapshot stream: every image, then every dedup record,
/// each part in key order.
pub fn stream_cmp(a: &[u8], b: &[u8]) -> Ordering {
    (part(a), a).cmp(&(part(b), b))
}

/// Whether a state tree key travels in snapshots (shard data, not the apply
/// position, which the snapshot's meta carries).
pub(crate) fn is_shard_data(key: &[u8]) -> bool {
    matches!(key.first(), Some(&PREFIX_SHARD) | Some(&PREFIX_DEDUP))
}

/// Reads the frame that follows `after` from `tree`: pairs in stream order, at
/// most [`FRAME_PAIRS_MAX`] and about `bytes_max` bytes (at least one pair).
pub(crate) fn read_frame(
    tree: &dyn KvTree,
    after: Option<Vec<u8>>,
    bytes_max: usize,
) -> Result<Frame, KvError> {
    let mut pairs: Vec<KvPair> = Vec::new();
    let mut bytes = 0usize;
    let in_images = after.as_ref().is_none_or(|k| part(k) == 0);
    if in_images {
        let from = after.clone().map_or(Bound::Included(vec![PREFIX_SHARD]), Bound::Excluded);
        let page = tree.scan_page(from, prefix_bound(&[PREFIX_SHARD]), FRAME_PAIRS_MAX, bytes_max)?;
        bytes += page.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>();
        pairs.extend(page);
        if pairs.len() >= FRAME_PAIRS_MAX || bytes >= bytes_max {
            return Ok(Frame { after, pairs, last: false });
        }
    }
    let from = match &after {
        Some(k) if !in_images => Bound::Excluded(k.clone()),
        _ => Bound::Included(vec![PREFIX_DEDUP]),
    };
    let (pairs_left, bytes_left) = (FRAME_PAIRS_MAX - pairs.len(), bytes_max - bytes);
    let page = tree.scan_page(from, prefix_bound(&[PREFIX_DEDUP]), pairs_left, bytes_left)?;
    let page_bytes = page.iter().map(|(k, v)| k.len() + v.len()).sum::<usize>();
    let full = page.len() >= pairs_left || (!page.is_empty() && page_bytes >= bytes_left);
    pairs.extend(page);
    Ok(Frame { after, pairs, last: !full })
}

fn io_err(e: impl std::fmt::Display) -> io::Error {
    io::Error::other(e.to_string())
}

// ------------------------------------------------------------------- sending

/// The sending side: frames read from the live state tree of one replica.
pub struct SnapshotSource {
    shared: Arc<Shared>,
    /// The generation of the state tree the snapshot was taken from: a replica
    /// that installed another snapshot since has another tree, and this one ends.
    generation: u64,
    /// Bytes of a frame read for [`tokio::io::AsyncRead`].
    chunk_bytes: usize,
    /// Where the byte stream of [`tokio::io::AsyncRead`] stands: the stream's last
    /// key read, the frame being read out and how far.
    after: Option<Vec<u8>>,
    ended: bool,
    buffer: Vec<u8>,
    read: usize,
    position: u64,
}

impl SnapshotSource {
    pub(crate) fn new(shared: Arc<Shared>, generation: u64, chunk_bytes: usize) -> Self {
        Self {
            shared,
            generation,
            chunk_bytes,
            after: None,
            ended: false,
            buffer: Vec::new(),
            read: 0,
            position: 0,
        }
    }

    /// The frame that follows `after`, of about `bytes_max` bytes of pairs.
    pub fn frame(&self, after: Option<Vec<u8>>, bytes_max: usize) -> io::Result<Frame> {
        self.shared
            .read_generation(self.generation, |tree| read_frame(tree, after, bytes_max))
            .map_err(io_err)?
            .map_err(io_err)
    }
}

// ----------------------------------------------------------------- receiving

/// The receiving side: frames staged in a tree of their own, which an install
/// makes the range's state tree.
pub struct SnapshotSink {
    kv: Arc<dyn KvStore>,
    /// The staging tree (the state tree's next generation) and its generation.
    pub(crate) tree: Arc<dyn KvTree>,
    pub(crate) generation: u64,
    /// The stream's last key staged (`None`: nothing yet).
    staged_through: Option<Vec<u8>>,
    /// Whether the last frame was staged (and nothing after it replaced).
    pub(crate) complete: bool,
    /// Bytes written but not yet a whole frame.
    pending: Vec<u8>,
    /// The byte position of the stream.
    position: u64,
    /// Bytes of frames staged.
    pub(crate) bytes: u64,
}

/// A key range, as `KvTree::scan_page` takes it.
type KeyRange = (Bound<Vec<u8>>, Bound<Vec<u8>>);

/// Removes from `tree` every shard-data key after `after` in stream order, in
/// pages of at most [`FRAME_PAIRS_MAX`] keys (all of them if `after` is none).
fn truncate_after(tree: &dyn KvTree, after: Option<&[u8]>) -> Result<(), KvError> {
    let parts: Vec<KeyRange> = match after {
        None => vec![
            (Bound::Included(vec![PREFIX_SHARD]), prefix_bound(&[PREFIX_SHARD])),
            (Bound::Included(vec![PREFIX_DEDUP]), prefix_bound(&[PREFIX_DEDUP])),
        ],
        Some(k) if part(k) == 0 => vec![
            (Bound::Excluded(k.to_vec()), prefix_bound(&[PREFIX_SHARD])),
            (Bound::Included(vec![PREFIX_DEDUP]), prefix_bound(&[PREFIX_DEDUP])),
        ],
        Some(k) => vec![(Bound::Excluded(k.to_vec()), prefix_bound(&[PREFIX_DEDUP]))],
    };
    for (from, to) in parts {
        loop {
            let page = tree.scan_page(from.clone(), to.clone(), FRAME_PAIRS_MAX, usize::MAX)?;
            if page.is_empty() {
                break;
            }
            tree.apply(page.into_iter().map(|(k, _)| (k, None)).collect())?;
        }
    }
    Ok(())
}

impl SnapshotSink {
    /// A sink that stages into tree `name` (generation `generation` of the state
    /// tree), emptied first.
    pub(crate) fn new(kv: Arc<dyn KvStore>, name: String, generation: u64) -> Result<Self, KvError> {
        kv.drop_tree(&name)?;
        let tree = kv.tree(&name)?;
        Ok(Self {
            kv,
            tree,
            generation,
            staged_through: None,
            complete: false,
            pending: Vec::new(),
            position: 0,
            bytes: 0,
        })
    }

    /// Stages one frame: it replaces whatever was staged after its `after` key.
    pub fn stage(&mut self, frame: Frame) -> io::Result<()> {
        let cmp = match (&frame.after, &self.staged_through) {
            (None, None) => Ordering::Equal,
            (None, Some(_)) => Ordering::Less,
            (Some(_), None) => Ordering::Greater,
            (Some(a), Some(s)) => stream_cmp(a, s),
        };
        match cmp {
            Ordering::Greater => {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!(
                        "snapshot frame after {:?}, but only {:?} is staged",
                        frame.after, self.staged_through
                    ),
                ))
            }
            Ordering::Less => truncate_after(&*self.tree, frame.after.as_deref()).map_err(io_err)?,
            Ordering::Equal => {}
        }
        let mut prev = frame.after.clone();
        for (key, _) in &frame.pairs {
            let ordered = prev.as_deref().is_none_or(|p| stream_cmp(p, key) == Ordering::Less);
            if !ordered || !is_shard_data(key) {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("snapshot key {key:?} out of order"),
                ));
            }
            prev = Some(key.clone());
        }
        self.staged_through = frame.end();
        self.complete = frame.last;
        let writes = frame.pairs.into_iter().map(|(k, v)| (k, Some(v))).collect();
        self.tree.write_in_order(writes).map_err(io_err)
    }

    /// Stages every whole frame of the bytes written so far.
    fn stage_pending(&mut self) -> io::Result<()> {
        loop {
            let Some(head) = self.pending.get(..FRAME_LENGTH_BYTES) else { return Ok(()) };
            let len = u32::from_le_bytes(head.try_into().expect("four bytes")) as usize;
            if len > FRAME_BYTES_MAX {
                return Err(io::Error::new(
                    io::ErrorKind::InvalidData,
                    format!("snapshot frame of {len} bytes; at most {FRAME_BYTES_MAX}"),
                ));
            }
            let Some(body) = self.pending.get(FRAME_LENGTH_BYTES..FRAME_LENGTH_BYTES + len) else {
                return Ok(());
            };
            let frame: Frame = tally_core::codec::decode("snapshot frame", body)
                .map_err(|e| io::Error::new(io::ErrorKind::InvalidData, e))?;
            self.bytes += (FRAME_LENGTH_BYTES + len) as u64;
            self.pending.drain(..FRAME_LENGTH_BYTES + len);
            self.stage(frame)?;
        }
    }

    /// The store the staging tree lives in.
    pub(crate) fn kv(&self) -> &Arc<dyn KvStore> {
        &self.kv
    }
}

// ------------------------------------------------------------ the data type

/// openraft's snapshot data of a range group: a [`SnapshotSource`] where a
/// snapshot is sent from, a [`SnapshotSink`] where one is received.
///
/// As a byte stream (what openraft's chunked transfer reads and writes) it is a
/// sequence of frames, each preceded by its length. A source reads its frames
/// from the live tree as the stream is read; it can start over
/// (`SeekFrom::Start(0)`), and its length is not known before its end. A sink
/// stages every whole frame written to it; a seek moves its position (a frame
/// written again starts a frame, and says itself what it replaces).
pub struct RangeSnapshot(pub(crate) Side);

pub(crate) enum Side {
    Source(SnapshotSource),
    Sink(SnapshotSink),
}

impl RangeSnapshot {
    /// The sending side, if this is one.
    pub fn into_source(self) -> Option<SnapshotSource> {
        match self.0 {
            Side::Source(s) => Some(s),
            Side::Sink(_) => None,
        }
    }

    /// The receiving side, if this is one.
    pub fn into_sink(self) -> Option<SnapshotSink> {
        match self.0 {
            Side::Sink(s) => Some(s),
            Side::Source(_) => None,
        }
    }
}

fn unsupported(what: &str) -> io::Error {
    io::Error::new(io::ErrorKind::Unsupported, what.to_owned())
}

impl tokio::io::AsyncRead for RangeSnapshot {
    fn poll_read(
        self: Pin<&mut Self>,
        _cx: &mut Context<'_>,
        buf: &mut tokio::io::ReadBuf<'_>,
    ) -> Poll<io::Result<()>> {
        let Side::Source(s) = &mut self.get_mut().0 else {
            return Poll::Ready(Err(unsupported("a snapshot being received cannot be read")));
        };
        if s.read == s.buffer.len() && !s.ended {
            let frame = match s.frame(s.after.clone(), s.chunk_bytes) {
                Ok(f) => f,
                Err(e) => return Poll::Ready(Err(e)),
            };
            s.after = frame.end();
            s.ended = frame.last;
            s.buffer = frame.to_bytes();
            s.read = 0;
        }
        let n = buf.remaining().min(s.buffer.len() - s.read);
        buf.put_slice(&s.buffer[s.read..s.read + n]);
        s.read += n;
        s.position += n as u64;
        Poll::Ready(Ok(()))
    }
}

impl tokio::io::AsyncWrite for RangeSnapshot {
    fn poll_write(self: Pin<&mut Self>, _cx: &mut Context<'_>, buf: &[u8]) -> Poll<io::Result<usize>> {
        let Side::Sink(s) = &mut self.get_mut().0 else {
            return Poll::Ready(Err(unsupported("a snapshot being sent cannot be written")));
        };
        s.pending.extend_from_slice(buf);
        s.position += buf.len() as u64;
        Poll::Ready(s.stage_pending().map(|()| buf.len()))
    }

    fn poll_flush(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }

    fn poll_shutdown(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<()>> {
        Poll::Ready(Ok(()))
    }
}

impl tokio::io::AsyncSeek for RangeSnapshot {
    fn start_seek(self: Pin<&mut Self>, to: io::SeekFrom) -> io::Result<()> {
        match (&mut self.get_mut().0, to) {
            (_, io::SeekFrom::Current(0)) => Ok(()),
            (Side::Sink(s), io::SeekFrom::Start(p)) => {
                // A write from here starts a frame.
                s.pending.clear();
                s.position = p;
                Ok(())
            }
            (Side::Source(s), io::SeekFrom::Start(0)) => {
                (s.after, s.ended, s.buffer, s.read, s.position) = (None, false, Vec::new(), 0, 0);
                Ok(())
            }
            _ => Err(unsupported("a range snapshot seeks only to where a frame starts")),
        }
    }

    fn poll_complete(self: Pin<&mut Self>, _cx: &mut Context<'_>) -> Poll<io::Result<u64>> {
        Poll::Ready(Ok(match &self.get_mut().0 {
            Side::Sink(s) => s.position,
            Side::Source(s) => s.position,
        }))
    }
}
