//! The in-memory backend: several nodes in one process, no sockets.
//!
//! A [`MemNetwork`] is the set of nodes started on it with [`crate::Transport::start_in`],
//! by node id, and the [`Links`] between them. Everything above the sockets is the real
//! transport: `call` makes the same checks, requests and replies are the same encoded
//! frames, the callee's gateway serves them with the same logic as the ractor actor
//! (`Gateway::serve`: fingerprint and sender checks, the in-flight limit, panics, reply
//! size), and the same heartbeat feeds the same failure detector. What replaces ractor_cluster
//! is [`MemNode::exchange`]: one request frame carried to a gateway and its reply frame
//! carried back, each after the delay (or to the loss) the links decide.
//!
//! A "session" to a peer is the peer's current start on the network: it exists while the
//! peer runs there with the same secret and lists the caller as a peer (as a ractor_cluster
//! session would be authenticated and admitted), and every start is a new one, so a restarted
//! peer is a reconnect to the failure detector. A node that leaves (shuts down) closes its
//! sessions: calls in flight to or from it fail as `Disconnected`. Frames bigger than
//! [`FRAME_BYTES_MAX`] close the session as ractor_cluster's reader does: the call fails as
//! `Disconnected`. Not modelled: the detector tearing a session down after missed pings
//! only makes the next answered ping count as a new session; calls in flight on it run on
//! to their answer or timeout.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;

use tokio::sync::{oneshot, watch};
use tokio::time::Instant;

use crate::config::TransportConfig;
use crate::error::TransportError;
use crate::gateway::{Gateway, GatewayState};
use crate::wire::FRAME_BYTES_MAX;

/// What a link does to one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkFate {
    /// The message arrives after this long (tokio time).
    Deliver(Duration),
    /// The message never arrives: its call waits out its timeout.
    Lose,
}

/// The simulator's say over every message between two nodes (node ids as in
/// [`TransportConfig`]): asked once for a request and once for its answer (`from` = the
/// answer's sender), and for each heartbeat ping and pong. Calls a node makes to itself do
/// not cross a link. Called from inside the transport (sometimes under a gateway's lock), so
/// it must answer at once and must not call back into a [`crate::Transport`].
pub trait Links: Send + Sync + 'static {
    /// The fate of one message from `from` to `to`.
    fn fate(&self, from: &str, to: &str) -> LinkFate;
}

/// The nodes started in memory (by node id, each with its handler) and the links between
/// them. Cheap to clone; clones are the same network.
#[derive(Clone)]
pub struct MemNetwork {
    inner: Arc<Network>,
}

struct Network {
    links: Arc<dyn Links>,
    nodes: Mutex<BTreeMap<String, Arc<MemNode>>>,
    /// Numbers the starts of nodes, so each start is a session of its own.
    starts: AtomicU64,
}

impl std::fmt::Debug for MemNetwork {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let nodes: Vec<String> = self.lock_nodes().keys().cloned().collect();
        f.debug_struct("MemNetwork").field("nodes", &nodes).finish_non_exhaustive()
    }
}

impl MemNetwork {
    /// An empty network whose messages fare as `links` says.
    pub fn new(links: Arc<dyn Links>) -> Self {
        MemNetwork {
            inner: Arc::new(Network { links, nodes: Mutex::new(BTreeMap::new()), starts: AtomicU64::new(0) }),
        }
    }

    fn lock_nodes(&self) -> MutexGuard<'_, BTreeMap<String, Arc<MemNode>>> {
        self.inner.nodes.lock().unwrap_or_else(|p| p.into_inner())
    }

    /// Puts the node `cfg` describes on the network, served by `gateway`; fails while a node
    /// with its id runs there (as binding a taken address would).
    pub(crate) fn join(
        &self,
        cfg: &TransportConfig,
        gateway: Gateway,
    ) -> Result<Arc<MemNode>, TransportError> {
        let mut nodes = self.lock_nodes();
        if nodes.get(&cfg.node_id).is_some_and(|n| n.is_live()) {
            return Err(TransportError::Listen {
                addr: cfg.listen,
                reason: format!("node {} is already running on this in-memory network", cfg.node_id),
            });
        }
        let node = Arc::new(MemNode {
            gateway,
            state: Mutex::new(GatewayState::new()),
            secret: cfg.secret.clone(),
            session: self.inner.starts.fetch_add(1, Ordering::Relaxed) + 1,
            stopped: watch::Sender::new(false),
            links: Arc::clone(&self.inner.links),
        });
        nodes.insert(cfg.node_id.clone(), Arc::clone(&node));
        Ok(node)
    }

    /// Ends the network: every node still on it is taken off (its exchanges end as if
    /// it left), and later calls find no one. A simulation closes its network when a
    /// run ends, so that a node it did not stop (one still starting) holds nothing
    /// past the run.
    pub fn close(&self) {
        let nodes = std::mem::take(&mut *self.lock_nodes());
        for node in nodes.values() {
            node.stopped.send_replace(true);
        }
    }

    /// Takes `node` off the network: messages to it are no longer delivered and its id is free.
    pub(crate) fn leave(&self, node: &Arc<MemNode>) {
        node.stopped.send_replace(true);
        let mut nodes = self.lock_nodes();
        if nodes.get(node.node_id()).is_some_and(|n| Arc::ptr_eq(n, node)) {
            nodes.remove(node.node_id());
        }
    }

    /// `peer` as `from` can reach it: running, with the same secret, and listing `from`
    /// among its peers (what it takes for a ractor_cluster session to authenticate and be
    /// admitted).
    pub(crate) fn route(&self, from: &MemNode, peer: &str) -> Option<Arc<MemNode>> {
        let to = self.lock_nodes().get(peer).cloned()?;
        let admitted = to.is_live() && to.secret == from.secret && to.gateway.peers.contains(from.node_id());
        admitted.then_some(to)
    }
}

/// One start of a node on a [`MemNetwork`]: its gateway, and whether it still runs.
pub(crate) struct MemNode {
    gateway: Gateway,
    state: Mutex<GatewayState>,
    secret: String,
    session: u64,
    /// Set when the node leaves the network; every exchange with it then ends.
    stopped: watch::Sender<bool>,
    links: Arc<dyn Links>,
}

/// How a request's answer came back to the caller.
enum Answer {
    /// The reply frame arrived.
    Frame(Vec<u8>),
    /// The links lost it: the caller waits out its timeout.
    Lost,
}

impl MemNode {
    fn node_id(&self) -> &str {
        &self.gateway.node_id
    }

    fn is_live(&self) -> bool {
        !*self.stopped.borrow()
    }

    /// Resolves once the node has left the network.
    async fn left(&self) {
        let _ = self.stopped.subscribe().wait_for(|stopped| *stopped).await;
    }

    /// This start's session number (distinct for every start on the network).
    pub(crate) fn session(&self) -> u64 {
        self.session
    }

    /// Runs the gateway on one request frame; `reply` gets the reply frame.
    fn serve(&self, frame: &[u8], reply: impl FnOnce(Vec<u8>) + Send + 'static) {
        let mut state = self.state.lock().unwrap_or_else(|p| p.into_inner());
        self.gateway.serve(&mut state, frame, reply);
    }

    /// Sends the request frame `request` from node `from` to this node's gateway and returns
    /// the reply frame, with the errors the ractor backend gives: `Unreachable` if this node
    /// no longer runs (nothing was sent), `Timeout` when the request or the answer is lost or
    /// late, `Disconnected` when either node leaves the network (their session closes) or a
    /// frame is too big while the request is in flight. A request that reached the gateway is
    /// served even if the caller gave up.
    pub(crate) async fn exchange(
        self: &Arc<Self>,
        from: &MemNode,
        request: Vec<u8>,
        timeout: Duration,
    ) -> Result<Vec<u8>, TransportError> {
        let node = self.node_id().to_string();
        let deadline = Instant::now() + timeout;
        if !self.is_live() {
            return Err(TransportError::Unreachable(node));
        }
        let (tx, rx) = oneshot::channel();
        // `None`: the request is lost, so no answer ever comes.
        let rx = if from.node_id() == node {
            // A call to this node itself crosses no link, as a local actor call.
            self.serve(&request, move |frame| {
                let _ = tx.send(Answer::Frame(frame));
            });
            Some(rx)
        } else {
            match self.links.fate(from.node_id(), &node) {
                LinkFate::Lose => None,
                LinkFate::Deliver(delay) => {
                    tokio::spawn(Arc::clone(self).deliver(from.node_id().to_string(), request, delay, tx));
                    Some(rx)
                }
            }
        };
        let answered = async {
            match rx {
                Some(rx) => match rx.await {
                    Ok(Answer::Frame(frame)) => Ok(frame),
                    Ok(Answer::Lost) => std::future::pending().await,
                    // The answer was dropped on the way: the session closed during the call.
                    Err(_) => Err(TransportError::Disconnected(node.clone())),
                },
                None => std::future::pending().await,
            }
        };
        tokio::select! {
            outcome = tokio::time::timeout_at(deadline, answered) => outcome.unwrap_or_else(|_| {
                Err(TransportError::Timeout { node: node.clone(), timeout_ms: timeout.as_millis() as u64 })
            }),
            () = self.left() => Err(TransportError::Disconnected(node.clone())),
            () = from.left() => Err(TransportError::Disconnected(node.clone())),
        }
    }

    /// Carries a request to this node after `delay`, serves it, and carries the answer back
    /// to `from` as the links say. Dropping `answer` tells the caller the session closed.
    async fn deliver(
        self: Arc<Self>,
        from: String,
        request: Vec<u8>,
        delay: Duration,
        answer: oneshot::Sender<Answer>,
    ) {
        tokio::time::sleep(delay).await;
        if !self.is_live() || !frame_fits(self.node_id(), &from, &request) {
            return;
        }
        let callee = Arc::clone(&self);
        self.serve(&request, move |frame| {
            // A node that stopped sends nothing, not even answers its handler finished.
            if !callee.is_live() {
                return;
            }
            match callee.links.fate(callee.node_id(), &from) {
                LinkFate::Lose => {
                    let _ = answer.send(Answer::Lost);
                }
                LinkFate::Deliver(delay) => {
                    tokio::spawn(async move {
                        tokio::time::sleep(delay).await;
                        if frame_fits(&from, callee.node_id(), &frame) {
                            let _ = answer.send(Answer::Frame(frame));
                        }
                    });
                }
            }
        });
    }
}

/// Whether `receiver` accepts a frame of this size from `sender`: ractor_cluster's reader
/// closes a session on a frame over [`FRAME_BYTES_MAX`].
fn frame_fits(receiver: &str, sender: &str, frame: &[u8]) -> bool {
    let fits = frame.len() as u64 <= FRAME_BYTES_MAX;
    if !fits {
        tracing::warn!(
            node = %receiver, peer = %sender, bytes = frame.len(),
            "frame from {sender} exceeds {FRAME_BYTES_MAX} bytes; closing the session"
        );
    }
    fits
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::config::tests::sample;
    use crate::gateway::{Erased, Handler};
    use crate::wire::{decode_reply, encode_request, WireReply, WireRequest};

    struct Echo;

    impl Handler for Echo {
        async fn handle(&self, _from: &str, request: Vec<u8>) -> Vec<u8> {
            request
        }
    }

    struct FastLinks;

    impl Links for FastLinks {
        fn fate(&self, _from: &str, _to: &str) -> LinkFate {
            LinkFate::Deliver(Duration::from_millis(1))
        }
    }

    fn join(net: &MemNetwork, cfg: &TransportConfig) -> Arc<MemNode> {
        net.join(cfg, Gateway::new(cfg, Arc::new(Erased(Arc::new(Echo))))).expect("join")
    }

    /// `node1` of the sample config, and `node2`, its peer.
    fn pair(net: &MemNetwork) -> (Arc<MemNode>, Arc<MemNode>) {
        let mut cfg2 = sample();
        cfg2.node_id = "node2".into();
        cfg2.peers = [("node1".to_string(), sample().listen)].into();
        (join(net, &sample()), join(net, &cfg2))
    }

    fn call(body: &[u8]) -> Vec<u8> {
        encode_request(&WireRequest::Call { from: "node2".into(), fingerprint: 0xfeed, body: body.to_vec() })
    }

    #[tokio::test(start_paused = true)]
    async fn frames_are_served_by_the_gateway_and_bad_ones_answered_as_such() {
        let net = MemNetwork::new(Arc::new(FastLinks));
        let (node, peer) = pair(&net);
        let second = Duration::from_secs(1);
        let reply = node.exchange(&peer, call(b"hi"), second).await.expect("answer");
        assert_eq!(decode_reply(&reply), Ok(WireReply::Reply(b"hi".to_vec())));
        let garbage = tally_core::format::versioned(tally_core::format::PEER_PROTOCOL, vec![0xff; 9]);
        let reply = node.exchange(&peer, garbage, second).await.expect("answer");
        assert!(matches!(decode_reply(&reply), Ok(WireReply::Malformed(_))), "{reply:?}");
    }

    #[tokio::test(start_paused = true)]
    async fn an_oversized_frame_closes_the_session() {
        let net = MemNetwork::new(Arc::new(FastLinks));
        let (node, peer) = pair(&net);
        let frame = vec![0; FRAME_BYTES_MAX as usize + 1];
        let started = Instant::now();
        assert_eq!(
            node.exchange(&peer, frame, Duration::from_secs(1)).await,
            Err(TransportError::Disconnected("node1".into()))
        );
        assert_eq!(started.elapsed(), Duration::from_millis(1));
    }

    #[tokio::test(start_paused = true)]
    async fn a_node_that_leaves_ends_its_exchanges_and_frees_its_id() {
        let net = MemNetwork::new(Arc::new(FastLinks));
        let (node, peer) = pair(&net);
        assert!(matches!(
            net.join(&sample(), Gateway::new(&sample(), Arc::new(Erased(Arc::new(Echo))))),
            Err(TransportError::Listen { .. })
        ));
        // A request in flight when the callee leaves: the session closes under it.
        let started = Instant::now();
        let in_flight = tokio::spawn({
            let (node, peer) = (Arc::clone(&node), Arc::clone(&peer));
            async move { node.exchange(&peer, call(b"hi"), Duration::from_secs(1)).await }
        });
        tokio::task::yield_now().await;
        net.leave(&node);
        assert_eq!(in_flight.await.unwrap(), Err(TransportError::Disconnected("node1".into())));
        assert_eq!(started.elapsed(), Duration::ZERO);
        // Afterwards nothing is sent.
        assert_eq!(
            node.exchange(&peer, call(b"hi"), Duration::from_secs(1)).await,
            Err(TransportError::Unreachable("node1".into()))
        );
        assert!(net.route(&peer, "node1").is_none());
        let again = join(&net, &sample());
        assert_ne!(again.session(), node.session());
        assert!(net.route(&peer, "node1").is_some_and(|to| Arc::ptr_eq(&to, &again)));
    }
}
