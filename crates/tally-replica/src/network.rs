//! Raft messages between the replicas of range groups, multiplexed by range: every
//! group of a node sends through one [`RangeNetwork`], so one connection per node
//! pair carries every group's traffic, and the receiving node hands each message to
//! the group it names ([`RangeInbound`]).
//!
//! [`MemRouter`] is the in-memory implementation, for tests and the simulator: it
//! delivers by replica id with a fixed latency and can cut links, isolate a replica
//! or drop it. Messages and replies are serde types with a byte encoding
//! ([`encode_envelope`], [`decode_reply`], …) for a byte transport; the router can
//! send everything through it ([`MemRouter::encode_messages`]).

// openraft's RPC error types are large and its network trait returns them; the
// helpers here return the same types rather than boxing and unboxing them.
#![allow(clippy::result_large_err)]

use crate::types::{RangeConfig, ReplicaId, ReplicaNode};
use futures::future::BoxFuture;
use openraft::error::{
    Fatal, InstallSnapshotError, NetworkError, PayloadTooLarge, RPCError, RaftError, RemoteError,
    ReplicationClosed, StreamingError, Unreachable,
};
use openraft::network::RPCOption;
use openraft::raft::SnapshotResponse;
use openraft::raft::{
    AppendEntriesRequest, AppendEntriesResponse, InstallSnapshotRequest, InstallSnapshotResponse,
    VoteRequest, VoteResponse,
};
use openraft::{
    AnyError, ErrorSubject, ErrorVerb, OptionalSend, RaftNetwork, RaftNetworkFactory, Snapshot, StorageError,
    StorageIOError, Vote,
};
use parking_lot::Mutex;
use serde::{Deserialize, Serialize};
use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::sync::{Arc, Weak};
use std::time::Duration;
use tally_core::ranges::RangeId;

/// One-way latency of a [`MemRouter`] link, in milliseconds.
pub const MEM_LINK_LATENCY_MS: u64 = 1;
/// Pause before openraft retries a replica that was unreachable, in milliseconds.
pub const UNREACHABLE_BACKOFF_MS: u64 = 100;

/// A raft message for one group.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub enum RangeRpc {
    /// Log replication and heartbeats.
    Append(AppendEntriesRequest<RangeConfig>),
    /// An election.
    Vote(VoteRequest<ReplicaId>),
    /// A chunk of a snapshot.
    Snapshot(InstallSnapshotRequest<RangeConfig>),
}

/// The answer of the receiving group's raft.
#[derive(Debug, Serialize, Deserialize)]
pub enum RangeReply {
    /// To [`RangeRpc::Append`].
    Append(Result<AppendEntriesResponse<ReplicaId>, RaftError<ReplicaId>>),
    /// To [`RangeRpc::Vote`].
    Vote(Result<VoteResponse<ReplicaId>, RaftError<ReplicaId>>),
    /// To [`RangeRpc::Snapshot`].
    Snapshot(Result<InstallSnapshotResponse<ReplicaId>, RaftError<ReplicaId, InstallSnapshotError>>),
}

/// A message for one group, addressed to one replica (an id is one store
/// incarnation: a node that now runs another store refuses it).
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct RangeEnvelope {
    /// The sending replica.
    pub from: ReplicaId,
    /// The replica it is meant for.
    pub to: ReplicaId,
    /// The group.
    pub range: RangeId,
    /// The raft message.
    pub rpc: RangeRpc,
}

/// Largest encoded message or reply a byte transport should accept.
pub const MESSAGE_BYTES_MAX: usize = 256 << 20;

/// Bytes a node-to-node request adds around an encoded range message (the peer
/// request's tag, the transport's envelope with the sender's name).
pub const ENVELOPE_HEADROOM_BYTES: usize = 64 << 10;
/// Largest encoded range message sent to another node, in bytes: what fits in one
/// node-to-node request with its envelopes.
pub const RANGE_MESSAGE_BYTES_MAX: usize =
    tally_core::codec::NODE_MESSAGE_BYTES_MAX - ENVELOPE_HEADROOM_BYTES;

/// The bytes of `envelope`, for a byte transport.
pub fn encode_envelope(envelope: &RangeEnvelope) -> Vec<u8> {
    tally_core::codec::encode(envelope)
}

/// The envelope in `bytes`, refusing more than [`MESSAGE_BYTES_MAX`].
pub fn decode_envelope(bytes: &[u8]) -> Result<RangeEnvelope, NetError> {
    if bytes.len() > MESSAGE_BYTES_MAX {
        return Err(NetError::Undecodable(format!("{} bytes; at most {MESSAGE_BYTES_MAX}", bytes.len())));
    }
    tally_core::codec::decode("range message", bytes).map_err(|e| NetError::Undecodable(e.to_string()))
}

/// The bytes of an answer.
pub fn encode_reply(reply: &Result<RangeReply, NetError>) -> Vec<u8> {
    tally_core::codec::encode(reply)
}

/// The answer in `bytes`, refusing more than [`MESSAGE_BYTES_MAX`].
pub fn decode_reply(bytes: &[u8]) -> Result<RangeReply, NetError> {
    if bytes.len() > MESSAGE_BYTES_MAX {
        return Err(NetError::Undecodable(format!("{} bytes; at most {MESSAGE_BYTES_MAX}", bytes.len())));
    }
    tally_core::codec::decode::<Result<RangeReply, NetError>>("range reply", bytes)
        .map_err(|e| NetError::Undecodable(e.to_string()))?
}

/// Why a message was not answered.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum NetError {
    /// The replica cannot be reached (down, partitioned, or no longer this id: a
    /// node with a new store answers to a new id only).
    #[error("replica {0} is unreachable")]
    Unreachable(ReplicaId),
    /// The replica's node does not run this range's group.
    #[error("replica {to} runs no group for {range}")]
    NoGroup {
        /// The replica.
        to: ReplicaId,
        /// The range.
        range: RangeId,
    },
    /// No answer within the deadline.
    #[error("no answer from replica {0} in time")]
    Timeout(ReplicaId),
    /// The answer was of another kind than the message.
    #[error("replica {0} answered with another kind of reply")]
    Mismatch(ReplicaId),
    /// The node runs another replica (its store was replaced): the message was
    /// for an incarnation that no longer exists.
    #[error("message for replica {asked} reached replica {own}")]
    NotThisReplica {
        /// The replica the message was for.
        asked: ReplicaId,
        /// The replica the node runs.
        own: ReplicaId,
    },
    /// The bytes of a message or answer did not decode.
    #[error("undecodable range message: {0}")]
    Undecodable(String),
    /// The message is larger than one node-to-node message may be: sent again as
    /// it is, it would be refused again.
    #[error("range message of {bytes} bytes; at most {bytes_max}")]
    TooLarge {
        /// The message's size.
        bytes: usize,
        /// The most a message may carry ([`RANGE_MESSAGE_BYTES_MAX`]).
        bytes_max: usize,
    },
}

/// Sends a group's messages to other replicas.
pub trait RangeNetwork: Send + Sync + 'static {
    /// Delivers `envelope` to replica `envelope.to`, which runs on `node`, and
    /// waits for its answer.
    fn call(
        &self,
        node: &ReplicaNode,
        envelope: RangeEnvelope,
    ) -> BoxFuture<'static, Result<RangeReply, NetError>>;
}

/// The receiving side: a node's groups, by range.
pub trait RangeInbound: Send + Sync + 'static {
    /// Hands the message to the group it names, if it is meant for this node's
    /// replica ([`NetError::NotThisReplica`] otherwise).
    fn handle(&self, envelope: RangeEnvelope) -> BoxFuture<'static, Result<RangeReply, NetError>>;
}

/// Bytes an append request adds around its entries (vote, log ids, the envelope;
/// a test measures the largest).
pub const APPEND_OVERHEAD_BYTES: usize = 512;
/// Whether the planted bug that sends appends unbounded, and reports their refusal
/// as an unreachable replica, is on.
fn planted_oversized() -> bool {
    #[cfg(feature = "planted-bugs")]
    if tally_core::planted::active(tally_core::planted::Bug::OversizedAppendUnreachable) {
        return true;
    }
    false
}

/// How many of `entries`, from the first, fit in one append message of at most
/// `bytes_max`, if not all of them (at least one: no entry is larger than the
/// group's entry bound).
fn entries_that_fit(entries: &[crate::types::Entry], bytes_max: usize) -> Option<u64> {
    if entries.len() <= 1 {
        return None;
    }
    let mut bytes = APPEND_OVERHEAD_BYTES;
    for (n, e) in entries.iter().enumerate() {
        bytes += tally_core::codec::encoded_len(e);
        if bytes > bytes_max {
            return Some((n as u64).max(1));
        }
    }
    None
}

// ------------------------------------------------------------ openraft adapters

/// openraft's network factory of one group: every client goes through the node's
/// shared [`RangeNetwork`].
#[derive(Clone)]
pub struct GroupNetworkFactory {
    pub(crate) me: ReplicaId,
    pub(crate) range: RangeId,
    pub(crate) net: Arc<dyn RangeNetwork>,
    /// The group's message bound ([`crate::GroupsConfig::message_bytes_max`]).
    pub(crate) message_bytes_max: usize,
}

/// openraft's connection to one replica of a group.
pub struct GroupNetwork {
    factory: GroupNetworkFactory,
    target: ReplicaId,
    node: ReplicaNode,
    /// Where the last snapshot sent to the target stopped, if it did not finish:
    /// the next attempt at the same snapshot resumes there.
    resume: Option<Resume>,
}

/// The point a snapshot stream reached: its id, the byte offset and the last key
/// of the frames the receiver acknowledged.
#[derive(Debug, Clone, PartialEq, Eq)]
struct Resume {
    snapshot_id: String,
    offset: u64,
    after: Option<Vec<u8>>,
}

/// Consecutive failed attempts at one snapshot frame before the stream gives up
/// (openraft tries again later, and the stream resumes from the last frame
/// received).
pub const SNAPSHOT_FRAME_ATTEMPTS_MAX: u32 = 5;
/// Pause before a snapshot frame is sent again, in milliseconds.
pub const SNAPSHOT_FRAME_RETRY_MS: u64 = 100;

impl RaftNetworkFactory<RangeConfig> for GroupNetworkFactory {
    type Network = GroupNetwork;

    async fn new_client(&mut self, target: ReplicaId, node: &ReplicaNode) -> GroupNetwork {
        GroupNetwork { factory: self.clone(), target, node: node.clone(), resume: None }
    }
}

type Rpc<T, E = openraft::error::Infallible> =
    Result<T, RPCError<ReplicaId, ReplicaNode, RaftError<ReplicaId, E>>>;

impl GroupNetwork {
    async fn send(&self, rpc: RangeRpc, option: &RPCOption) -> Result<RangeReply, NetError> {
        let f = &self.factory;
        let envelope = RangeEnvelope { from: f.me, to: self.target, range: f.range, rpc };
        let call = f.net.call(&self.node, envelope);
        match tokio::time::timeout(option.hard_ttl(), call).await {
            Ok(r) => r,
            Err(_) => Err(NetError::Timeout(self.target)),
        }
    }

    fn net_err<E: std::error::Error>(
        &self,
        e: NetError,
    ) -> RPCError<ReplicaId, ReplicaNode, RaftError<ReplicaId, E>> {
        match e {
            NetError::Unreachable(_) | NetError::NoGroup { .. } | NetError::NotThisReplica { .. } => {
                RPCError::Unreachable(Unreachable::new(&e))
            }
            NetError::Timeout(_)
            | NetError::Mismatch(_)
            | NetError::Undecodable(_)
            | NetError::TooLarge { .. } => RPCError::Network(NetworkError::new(&e)),
        }
    }

    fn remote<T, E: std::error::Error>(&self, r: Result<T, RaftError<ReplicaId, E>>) -> Rpc<T, E> {
        r.map_err(|e| RPCError::RemoteError(RemoteError::new_with_node(self.target, self.node.clone(), e)))
    }
}

impl RaftNetwork<RangeConfig> for GroupNetwork {
    async fn append_entries(
        &mut self,
        rpc: AppendEntriesRequest<RangeConfig>,
        option: RPCOption,
    ) -> Rpc<AppendEntriesResponse<ReplicaId>> {
        // openraft hands over up to `max_payload_entries` entries at once; sent whole
        // they may exceed what one message carries. The ones that fit go, the rest
        // follow: openraft sends again at once with the entries hinted.
        let bytes_max = self.factory.message_bytes_max;
        let planted = planted_oversized();
        if let Some(fit) = entries_that_fit(&rpc.entries, bytes_max).filter(|_| !planted) {
            let e = NetError::TooLarge { bytes: tally_core::codec::encoded_len(&rpc.entries), bytes_max };
            return Err(RPCError::PayloadTooLarge(
                PayloadTooLarge::new_entries_hint(fit).with_source_error(&e),
            ));
        }
        let entries = rpc.entries.len();
        match self.send(RangeRpc::Append(rpc), &option).await {
            Err(e @ NetError::TooLarge { .. }) if planted => Err(RPCError::Unreachable(Unreachable::new(&e))),
            Err(e @ NetError::TooLarge { .. }) => {
                // Refused by the transport after all: fewer entries next time.
                let hint = (entries as u64 / 2).max(1);
                Err(RPCError::PayloadTooLarge(PayloadTooLarge::new_entries_hint(hint).with_source_error(&e)))
            }
            Err(e) => Err(self.net_err(e)),
            Ok(reply) => match reply {
                RangeReply::Append(r) => self.remote(r),
                _ => Err(self.net_err(NetError::Mismatch(self.target))),
            },
        }
    }

    async fn install_snapshot(
        &mut self,
        rpc: InstallSnapshotRequest<RangeConfig>,
        option: RPCOption,
    ) -> Rpc<InstallSnapshotResponse<ReplicaId>, InstallSnapshotError> {
        match self.send(RangeRpc::Snapshot(rpc), &option).await.map_err(|e| self.net_err(e))? {
            RangeReply::Snapshot(r) => self.remote(r),
            _ => Err(self.net_err(NetError::Mismatch(self.target))),
        }
    }

    async fn vote(&mut self, rpc: VoteRequest<ReplicaId>, option: RPCOption) -> Rpc<VoteResponse<ReplicaId>> {
        match self.send(RangeRpc::Vote(rpc), &option).await.map_err(|e| self.net_err(e))? {
            RangeReply::Vote(r) => self.remote(r),
            _ => Err(self.net_err(NetError::Mismatch(self.target))),
        }
    }

    /// Streams the snapshot frame by frame ([`crate::snapshot`]): each frame is
    /// one `install_snapshot` call at the stream's byte offset, sent again after a
    /// failure; a stream that gives up is resumed from its last acknowledged frame
    /// by the next attempt at the same snapshot, and one the receiver lost track
    /// of (it restarted) starts over.
    async fn full_snapshot(
        &mut self,
        vote: Vote<ReplicaId>,
        snapshot: Snapshot<RangeConfig>,
        cancel: impl Future<Output = ReplicationClosed> + OptionalSend + 'static,
        option: RPCOption,
    ) -> Result<SnapshotResponse<ReplicaId>, StreamingError<RangeConfig, Fatal<ReplicaId>>> {
        let Snapshot { meta, snapshot } = snapshot;
        let subject = || ErrorSubject::Snapshot(Some(meta.signature()));
        let Some(source) = snapshot.into_source() else {
            let e = std::io::Error::other("a snapshot to send must be read from a state tree");
            return Err(StorageError::from(StorageIOError::new(
                subject(),
                ErrorVerb::Read,
                AnyError::new(&e),
            ))
            .into());
        };
        let chunk = option.snapshot_chunk_size().unwrap_or(crate::types::SNAPSHOT_CHUNK_BYTES as usize);
        let mut at = match self.resume.take() {
            Some(r) if r.snapshot_id == meta.snapshot_id => r,
            _ => Resume { snapshot_id: meta.snapshot_id.clone(), offset: 0, after: None },
        };
        let mut cancel = std::pin::pin!(cancel);
        'stream: loop {
            let frame = source.frame(at.after.clone(), chunk).map_err(|e| {
                StorageError::from(StorageIOError::new(subject(), ErrorVerb::Read, AnyError::new(&e)))
            })?;
            let (last, end) = (frame.last, frame.end());
            let data = frame.to_bytes();
            let len = data.len() as u64;
            let req =
                InstallSnapshotRequest { vote, meta: meta.clone(), offset: at.offset, data, done: last };
            let mut failures = 0;
            let resp = loop {
                if let Some(closed) = futures::FutureExt::now_or_never(cancel.as_mut()) {
                    self.resume = Some(at);
                    return Err(closed.into());
                }
                let err = match self.install_snapshot(req.clone(), option.clone()).await {
                    Ok(resp) => break resp,
                    Err(RPCError::RemoteError(RemoteError {
                        source: RaftError::APIError(InstallSnapshotError::SnapshotMismatch(_)),
                        ..
                    })) if at.offset > 0 => {
                        // The receiver lost the stream (it restarted): start over.
                        tracing::info!(range = %self.factory.range, target = self.target, "snapshot stream starts over");
                        (at.offset, at.after) = (0, None);
                        continue 'stream;
                    }
                    Err(RPCError::RemoteError(e)) => match e.source {
                        RaftError::Fatal(f) => {
                            return Err(RemoteError {
                                target: e.target,
                                target_node: e.target_node,
                                source: f,
                            }
                            .into())
                        }
                        RaftError::APIError(api) => {
                            return Err(NetworkError::new(&api).into());
                        }
                    },
                    Err(RPCError::PayloadTooLarge(e)) => return Err(NetworkError::new(&e).into()),
                    Err(RPCError::Timeout(e)) => StreamingError::Timeout(e),
                    Err(RPCError::Unreachable(e)) => StreamingError::Unreachable(e),
                    Err(RPCError::Network(e)) => StreamingError::Network(e),
                };
                failures += 1;
                if failures >= SNAPSHOT_FRAME_ATTEMPTS_MAX {
                    self.resume = Some(at);
                    return Err(err);
                }
                tokio::time::sleep(Duration::from_millis(SNAPSHOT_FRAME_RETRY_MS)).await;
            };
            if resp.vote > vote || last {
                return Ok(SnapshotResponse::new(resp.vote));
            }
            at.offset += len;
            at.after = end;
        }
    }

    fn backoff(&self) -> openraft::network::Backoff {
        openraft::network::Backoff::new(std::iter::repeat(Duration::from_millis(UNREACHABLE_BACKOFF_MS)))
    }
}

// ------------------------------------------------------------------ in memory

#[derive(Default)]
struct RouterState {
    nodes: BTreeMap<ReplicaId, Weak<dyn RangeInbound>>,
    /// Cut links, both directions, stored as (smaller, larger).
    cut: BTreeSet<(ReplicaId, ReplicaId)>,
    isolated: BTreeSet<ReplicaId>,
    /// Whether messages and answers travel as bytes.
    encode: bool,
    /// Snapshot frames sent so far (numbered from 0 in the order sent).
    snapshot_frames: u64,
    /// Append requests (heartbeats included) sent so far.
    appends: u64,
    /// The largest append sent as bytes so far, in bytes.
    append_bytes_max: usize,
    /// Numbers of the snapshot frames whose message is lost on the way.
    lost_frames: BTreeSet<u64>,
    /// Numbers of the snapshot frames delivered whose answer is lost.
    lost_frame_answers: BTreeSet<u64>,
}

impl RouterState {
    fn linked(&self, a: ReplicaId, b: ReplicaId) -> bool {
        !self.isolated.contains(&a)
            && !self.isolated.contains(&b)
            && !self.cut.contains(&(a.min(b), a.max(b)))
    }
}

/// The in-memory network: replicas register their node's groups under their id;
/// a message is delivered after [`MEM_LINK_LATENCY_MS`], and its answer after as
/// long again, if the link is up at both moments.
#[derive(Clone, Default)]
pub struct MemRouter {
    state: Arc<Mutex<RouterState>>,
}

impl MemRouter {
    /// A router with no replica.
    pub fn new() -> Self {
        Self::default()
    }

    /// Delivers messages for `id` to `node` from now on (held weakly: a dropped
    /// node is unreachable).
    pub fn register(&self, id: ReplicaId, node: Weak<dyn RangeInbound>) {
        self.state.lock().nodes.insert(id, node);
    }

    /// Stops delivering to `id` (the node crashed or was stopped).
    pub fn drop_replica(&self, id: ReplicaId) {
        self.state.lock().nodes.remove(&id);
    }

    /// Cuts the link between `a` and `b`, both ways.
    pub fn cut(&self, a: ReplicaId, b: ReplicaId) {
        self.state.lock().cut.insert((a.min(b), a.max(b)));
    }

    /// Restores the link between `a` and `b`.
    pub fn heal(&self, a: ReplicaId, b: ReplicaId) {
        self.state.lock().cut.remove(&(a.min(b), a.max(b)));
    }

    /// Cuts every link of `id`.
    pub fn isolate(&self, id: ReplicaId) {
        self.state.lock().isolated.insert(id);
    }

    /// Sends every message and answer through [`encode_envelope`] and
    /// [`encode_reply`] and back, as a byte transport would.
    pub fn encode_messages(&self, on: bool) {
        self.state.lock().encode = on;
    }

    /// Loses the messages of the snapshot frames numbered `frames` (counted from 0
    /// over every frame this router carries), and the answers to `answers` once
    /// delivered: the sender sees a timeout either way.
    pub fn lose_snapshot_frames(
        &self,
        frames: impl IntoIterator<Item = u64>,
        answers: impl IntoIterator<Item = u64>,
    ) {
        let mut s = self.state.lock();
        s.lost_frames.extend(frames);
        s.lost_frame_answers.extend(answers);
    }

    /// How many snapshot frames this router carried or lost.
    pub fn snapshot_frames(&self) -> u64 {
        self.state.lock().snapshot_frames
    }

    /// How many append requests (heartbeats included) this router carried or lost.
    pub fn appends(&self) -> u64 {
        self.state.lock().appends
    }

    /// The largest append this router carried as bytes ([`MemRouter::encode_messages`]).
    pub fn largest_append(&self) -> usize {
        self.state.lock().append_bytes_max
    }

    /// Restores every cut link and isolated replica.
    pub fn heal_all(&self) {
        let mut s = self.state.lock();
        s.cut.clear();
        s.isolated.clear();
    }
}

impl RangeNetwork for MemRouter {
    fn call(
        &self,
        _node: &ReplicaNode,
        envelope: RangeEnvelope,
    ) -> BoxFuture<'static, Result<RangeReply, NetError>> {
        let state = self.state.clone();
        Box::pin(async move {
            let (from, to) = (envelope.from, envelope.to);
            let latency = Duration::from_millis(MEM_LINK_LATENCY_MS);
            tokio::time::sleep(latency).await;
            let (target, encode, lose_answer) = {
                let mut s = state.lock();
                if !s.linked(from, to) {
                    return Err(NetError::Unreachable(to));
                }
                let mut lose_answer = false;
                if matches!(envelope.rpc, RangeRpc::Append(_)) {
                    s.appends += 1;
                }
                if matches!(envelope.rpc, RangeRpc::Snapshot(_)) {
                    let n = s.snapshot_frames;
                    s.snapshot_frames += 1;
                    if s.lost_frames.contains(&n) {
                        return Err(NetError::Timeout(to));
                    }
                    lose_answer = s.lost_frame_answers.contains(&n);
                }
                (s.nodes.get(&to).and_then(Weak::upgrade), s.encode, lose_answer)
            };
            let target = target.ok_or(NetError::Unreachable(to))?;
            let reply = if encode {
                let bytes = encode_envelope(&envelope);
                if matches!(envelope.rpc, RangeRpc::Append(_)) {
                    let mut s = state.lock();
                    s.append_bytes_max = s.append_bytes_max.max(bytes.len());
                }
                if bytes.len() > RANGE_MESSAGE_BYTES_MAX {
                    // As the node-to-node transport refuses a request too large.
                    return Err(NetError::TooLarge {
                        bytes: bytes.len(),
                        bytes_max: RANGE_MESSAGE_BYTES_MAX,
                    });
                }
                let envelope = decode_envelope(&bytes)?;
                let reply = target.handle(envelope).await;
                decode_reply(&encode_reply(&reply))
            } else {
                target.handle(envelope).await
            };
            tokio::time::sleep(latency).await;
            let s = state.lock();
            if !s.linked(from, to) || !s.nodes.contains_key(&to) {
                return Err(NetError::Unreachable(to));
            }
            if lose_answer {
                return Err(NetError::Timeout(to));
            }
            reply
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use openraft::{CommittedLeaderId, LogId, Vote};

    /// An append of no entries, with every id at its widest, stays within
    /// [`APPEND_OVERHEAD_BYTES`]: the bytes around the entries never push an
    /// append that [`entries_that_fit`] let through past its bound.
    #[test]
    fn an_append_s_overhead_fits_its_bound() {
        let log_id = Some(LogId::new(CommittedLeaderId::new(u64::MAX, u64::MAX), u64::MAX));
        let rpc = RangeRpc::Append(AppendEntriesRequest {
            vote: Vote::new_committed(u64::MAX, u64::MAX),
            prev_log_id: log_id,
            entries: Vec::new(),
            leader_commit: log_id,
        });
        let envelope = RangeEnvelope { from: u64::MAX, to: u64::MAX, range: RangeId(u32::MAX), rpc };
        let bytes = encode_envelope(&envelope).len();
        assert!(bytes <= APPEND_OVERHEAD_BYTES, "{bytes} bytes");
    }
}
