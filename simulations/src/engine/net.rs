//! The node-to-node transport of a tier-2 cluster: a [`Placement`] whose calls go
//! through the wire codec both ways and meet the run's faults — loss of a request or
//! of its answer, delay (so reordering), duplicated requests, partitions in one or
//! both directions, paused nodes, and crashed senders and receivers. A lost or cut
//! message is never answered: the caller's timeout ends the call, as over TCP.

use super::world::{lock, node_name, Shared};
use crate::history::FaultKind;
use futures::future::BoxFuture;
use std::sync::Arc;
use std::time::Duration;
use tally_core::codec;
use tally_core::ring::Ring;
use tally_core::{NodeId, ShardId};
use tally_engine::{Placement, ShardRequest, ShardResponse, TallyError};

/// A node-to-node call not answered within this fails (the engine's call timeout).
pub(crate) const CALL_TIMEOUT_MS: u64 = 150;

/// The index of a node name.
pub(crate) fn node_index(id: &NodeId) -> Option<u8> {
    id.as_str().strip_prefix("node")?.parse::<u8>().ok()?.checked_sub(1)
}

/// One incarnation of one node's view of placement and its outgoing link. The view
/// is the node's applied placement in the world's log.
pub(crate) struct SimPlacement {
    pub(crate) world: Shared,
    pub(crate) me: u8,
    pub(crate) incarnation: u64,
    /// Set when shards are replicated: owners are range leaders, membership fixed.
    pub(crate) replication: Option<Arc<tally_replica::Replication>>,
}

fn unavailable(node: &NodeId, reason: &str) -> TallyError {
    TallyError::Unavailable { shard: node.to_string(), reason: reason.into() }
}

/// A message in the trace: hashed as its encoding, printed as itself.
struct Wire<'a, T>(&'a [u8], &'a T);

impl<T> std::hash::Hash for Wire<'_, T> {
    fn hash<H: std::hash::Hasher>(&self, h: &mut H) {
        self.0.hash(h);
    }
}

impl<T: std::fmt::Debug> std::fmt::Debug for Wire<'_, T> {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        self.1.fmt(f)
    }
}

/// What became of one message.
pub(crate) enum Fate {
    Deliver(u64),
    Lost,
    Cut,
}

/// Records that a call goes unanswered from now until its caller's timeout and one
/// more rollup tick.
fn unanswered(w: &mut super::world::World) {
    let now = w.now();
    let to_ms = now + CALL_TIMEOUT_MS + crate::config::ROLLUP_TICK_MS;
    match w.history.unanswered_calls.last_mut() {
        Some(last) if last.to_ms >= now => last.to_ms = last.to_ms.max(to_ms),
        _ => w.history.unanswered_calls.push(crate::history::Disturbance { from_ms: now, to_ms }),
    }
}

/// Whether a copy of `request` may be delivered twice. Every request carries an id
/// its owner deduplicates or is idempotent (reads, seals, sketch merges), except a
/// direct submission without an event id: the engine sends it once and relies on the
/// cluster transport (one TCP connection per peer, no resend) to deliver it at most
/// once, so the simulated link never duplicates it either.
fn idempotent(request: &ShardRequest) -> bool {
    !matches!(
        request,
        ShardRequest::Submit { sub: tally_core::shard::Submission::Single { event_id: None, .. }, .. }
    )
}

/// Draws the fate of a message from `from` to `to`.
pub(crate) fn fate(world: &Shared, from: u8, to: u8) -> Fate {
    let mut w = lock(world);
    if w.cut.contains_key(&(from, to)) {
        w.count(FaultKind::MessageCut);
        unanswered(&mut w);
        return Fate::Cut;
    }
    if w.lost() {
        w.count(FaultKind::MessageLost);
        unanswered(&mut w);
        return Fate::Lost;
    }
    Fate::Deliver(w.delay())
}

/// Waits while node `n` is paused.
pub(crate) async fn wait_unpaused(world: &Shared, n: u8) {
    loop {
        let (now, until) = {
            let w = lock(world);
            (w.now(), w.nodes[usize::from(n)].paused_until)
        };
        if until <= now {
            return;
        }
        tokio::time::sleep(Duration::from_millis(until - now)).await;
    }
}

/// Carries one message from `from` to `to`: it leaves once `from` is not paused,
/// meets the link's fate and delay, and arrives; a lost or cut message never
/// arrives (the future never ends: the caller's timeout ends the call).
pub(crate) async fn cross(world: &Shared, from: u8, to: u8) {
    wait_unpaused(world, from).await;
    match fate(world, from, to) {
        Fate::Deliver(d) => tokio::time::sleep(Duration::from_millis(d)).await,
        Fate::Lost | Fate::Cut => std::future::pending().await,
    }
}

impl SimPlacement {
    async fn deliver(&self, to: u8, request: ShardRequest) -> Result<ShardResponse, TallyError> {
        let name = node_name(to);
        let bytes = codec::encode(&request);
        let call = {
            let mut w = lock(&self.world);
            if !w.alive(self.me, self.incarnation) {
                return Err(unavailable(&name, "this node is down"));
            }
            w.calls += 1;
            let call = w.calls;
            w.note("call", (call, self.me, to, Wire(&bytes, &request)));
            call
        };
        wait_unpaused(&self.world, self.me).await;
        let d = match fate(&self.world, self.me, to) {
            Fate::Deliver(d) => d,
            Fate::Lost | Fate::Cut => return std::future::pending().await,
        };
        let duplicate = idempotent(&request) && lock(&self.world).duplicated();
        if duplicate {
            let copy = bytes.clone();
            let world = self.world.clone();
            let dd = lock(&self.world).delay();
            lock(&self.world).count(FaultKind::MessageDuplicated);
            tokio::spawn(async move {
                tokio::time::sleep(Duration::from_millis(dd)).await;
                let target = lock(&world).nodes[usize::from(to)].tally.clone();
                if let (Some(t), Ok(req)) = (target, codec::decode::<ShardRequest>("request", &copy)) {
                    let _ = t.serve_shard_request(req).await;
                }
            });
        }
        tokio::time::sleep(Duration::from_millis(d)).await;
        wait_unpaused(&self.world, to).await;
        let (target, target_inc) = {
            let w = lock(&self.world);
            let node = &w.nodes[usize::from(to)];
            (node.tally.clone(), node.incarnation)
        };
        let Some(target) = target else {
            // Nothing listens on a crashed node: the connection is refused.
            return Err(unavailable(&name, "connection refused"));
        };
        let request: ShardRequest =
            codec::decode("request", &bytes).map_err(|e| unavailable(&name, &e.to_string()))?;
        let response = target.serve_shard_request(request).await;
        let bytes = codec::encode(&response);
        let answered = {
            let mut w = lock(&self.world);
            let alive = w.alive(to, target_inc);
            if alive {
                w.note("answer", (call, to, self.me, Wire(&bytes, &response)));
            } else {
                unanswered(&mut w);
            }
            alive
        };
        if !answered {
            return std::future::pending().await;
        }
        cross(&self.world, to, self.me).await;
        if !lock(&self.world).alive(self.me, self.incarnation) {
            return Err(unavailable(&name, "this node is down"));
        }
        codec::decode("response", &bytes).map_err(|e| unavailable(&name, &e.to_string()))
    }
}

impl SimPlacement {
    /// This node's applied placement: its epoch, the ring now and, while a change is
    /// handed off, the ring before it.
    fn view(&self) -> (u64, Arc<Ring>, Option<Arc<Ring>>) {
        let mut w = lock(&self.world);
        let view = w.placement_view(self.me).clone();
        let ring = w.ring(&view.members);
        let previous = (!view.handoff.is_empty()).then(|| w.ring(&view.previous));
        (view.epoch, ring, previous)
    }
}

impl Placement for SimPlacement {
    fn remote_owner(&self, id: &ShardId) -> Option<NodeId> {
        if let Some(r) = &self.replication {
            return Some(r.owner(id)).filter(|owner| node_index(owner) != Some(self.me));
        }
        let (_, ring, _) = self.view();
        let owner = ring.owner(id)?;
        (node_index(owner) != Some(self.me)).then(|| owner.clone())
    }

    fn confirm_local<'a>(&'a self, id: &'a ShardId) -> BoxFuture<'a, Result<(), TallyError>> {
        Box::pin(async move {
            match &self.replication {
                Some(r) => r.confirm(id).await,
                None => Ok(()),
            }
        })
    }

    fn previous_owner(&self, id: &ShardId) -> Option<(NodeId, u64)> {
        if self.replication.is_some() {
            return None;
        }
        let (epoch, ring, previous) = self.view();
        let previous = previous?;
        if node_index(ring.owner(id)?) != Some(self.me) {
            return None;
        }
        previous.owner(id).filter(|before| node_index(before) != Some(self.me)).map(|b| (b.clone(), epoch))
    }

    fn epoch(&self) -> u64 {
        lock(&self.world).placement_view(self.me).epoch
    }

    fn local_node(&self) -> NodeId {
        node_name(self.me)
    }

    fn peers(&self) -> Vec<NodeId> {
        let nodes = lock(&self.world).nodes.len() as u8;
        (0..nodes).filter(|&n| n != self.me).map(node_name).collect()
    }

    fn call<'a>(
        &'a self,
        node: &'a NodeId,
        request: ShardRequest,
    ) -> BoxFuture<'a, Result<ShardResponse, TallyError>> {
        Box::pin(async move {
            let Some(r) = &self.replication else { return self.call_one(node.clone(), request).await };
            let local = {
                let w = lock(&self.world);
                let n = &w.nodes[usize::from(self.me)];
                n.tally.clone().filter(|_| w.alive(self.me, self.incarnation))
            };
            r.call(node, request, local.as_ref(), |to, request| self.call_one(to, request)).await
        })
    }
}

impl SimPlacement {
    /// One call to `node`, ended by the engine's call timeout.
    async fn call_one(&self, node: NodeId, request: ShardRequest) -> Result<ShardResponse, TallyError> {
        let nodes = lock(&self.world).nodes.len();
        let Some(to) = node_index(&node).filter(|&n| usize::from(n) < nodes) else {
            return Err(unavailable(&node, "no such node"));
        };
        match tokio::time::timeout(Duration::from_millis(CALL_TIMEOUT_MS), self.deliver(to, request)).await {
            Ok(r) => r,
            Err(_) => Err(unavailable(&node, "timed out")),
        }
    }
}
