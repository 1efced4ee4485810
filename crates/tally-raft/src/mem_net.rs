//! An in-memory network for the metadata group: several [`MetaRaft`](crate::MetaRaft)s in one
//! process (a simulation's, on a current-thread runtime with paused time) call each
//! other without sockets.
//!
//! A node started with [`MetaRaft::start_in`](crate::MetaRaft::start_in) registers its router
//! ([`crate::raft_router`]) in a [`MemRaftNet`] under its raft address, and every
//! call it makes — openraft's RPCs, identity probes, rejoins, forwarded writes and
//! reads — goes through the same code a call over a socket runs (`post_json`): the
//! same JSON, the same request with its headers (raft protocol, content type, the
//! proof of the secret if one is configured), the same judgement of the answer.
//! Only the step that carries the request and brings back the answer differs: the
//! router is called with `tower::ServiceExt::oneshot`, in a task of its own (a
//! server finishes a request its caller gave up on), with the middleware a socket
//! server runs (protocol check, authentication, body limit, incarnation guard).
//!
//! The network asks its [`RaftLinks`] what happens to every request (from caller to
//! callee) and again to every answer (from callee to caller): delivered after a
//! delay of tokio time, or lost — then the caller hears nothing and runs into its
//! timeout, as over a socket (`no answer within … ms`). A call to an address where
//! no router is registered (the node is down) fails at once as a connection error,
//! which openraft takes for an unreachable node; no fate is asked for it.
//!
//! Addresses are matched as written in the nodes' `voters`.

use crate::error::Transport;
use crate::types::NodeId;
use axum::body::Body;
use axum::http;
use axum::Router;
use std::collections::BTreeMap;
use std::net::SocketAddr;
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// What a link does to one message.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LinkFate {
    /// Delivered after this long (tokio time).
    Deliver(Duration),
    /// Never delivered: the caller waits out its timeout.
    Lose,
    /// Never delivered, and the connection breaks at once: the caller learns that
    /// the call failed but not whether its request was served (a request whose
    /// answer is reset was).
    Reset,
}

/// Which message of an RPC a link carries.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct RaftMessage<'a> {
    /// The RPC's path ([`crate::rpc`]: `PATH_APPEND`, `PATH_CLIENT_WRITE`, ...).
    pub rpc: &'a str,
    /// Whether it is the answer (from callee to caller) rather than the request.
    pub answer: bool,
}

/// The simulator's say over every message: called once for a request (from caller to callee)
/// and once for its answer (from callee to caller). Raft ids.
pub trait RaftLinks: Send + Sync + 'static {
    /// What happens to `message` from `from` to `to`.
    fn fate(&self, from: NodeId, to: NodeId, message: RaftMessage<'_>) -> LinkFate;
}

/// A router registered under an address.
#[derive(Clone)]
struct Served {
    node: NodeId,
    router: Router,
    /// Which registration this is, so that a node shutting down never unregisters
    /// the one that restarted under its address.
    key: u64,
}

struct Inner {
    links: Arc<dyn RaftLinks>,
    served: Mutex<BTreeMap<String, Served>>,
    registrations: std::sync::atomic::AtomicU64,
}

/// Routers of the nodes started in memory, by raft address, and the links between them. Clone = same network.
#[derive(Clone)]
pub struct MemRaftNet {
    inner: Arc<Inner>,
}

impl std::fmt::Debug for MemRaftNet {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let addrs: Vec<String> = self.served().keys().cloned().collect();
        f.debug_struct("MemRaftNet").field("serving", &addrs).finish()
    }
}

impl MemRaftNet {
    /// A network with no node, whose messages fare as `links` says.
    pub fn new(links: Arc<dyn RaftLinks>) -> Self {
        let inner = Inner { links, served: Mutex::default(), registrations: Default::default() };
        Self { inner: Arc::new(inner) }
    }

    fn served(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Served>> {
        self.inner.served.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn lookup(&self, addr: &str) -> Option<Served> {
        self.served().get(addr).cloned()
    }

    /// Serves `router`, node `node`'s, at `addr` from now on, in place of whatever
    /// was registered there; answers the registration's key for [`Self::unregister`].
    pub(crate) fn register(&self, addr: String, node: NodeId, router: Router) -> u64 {
        let key = self.inner.registrations.fetch_add(1, std::sync::atomic::Ordering::Relaxed) + 1;
        self.served().insert(addr, Served { node, router, key });
        key
    }

    /// Stops serving registration `key` at `addr` (if it is still the one there).
    pub(crate) fn unregister(&self, addr: &str, key: u64) {
        let mut served = self.served();
        if served.get(addr).is_some_and(|s| s.key == key) {
            served.remove(addr);
        }
    }

    /// Ends the network: every node still served on it is dropped, and later calls
    /// fail to connect. A simulation closes its network when a run ends, so that a
    /// node it did not stop (one still starting) holds nothing past the run.
    pub fn close(&self) {
        let served = std::mem::take(&mut *self.served());
        drop(served);
    }

    /// The end of node `me`, at raft address `addr`, that its calls leave from.
    pub(crate) fn end(&self, me: NodeId, addr: SocketAddr) -> MemEnd {
        MemEnd { net: self.clone(), me, addr }
    }

    /// Waits as `fate` says, forever if the message is lost; a reset connection
    /// fails at once.
    async fn carry(&self, from: NodeId, to: NodeId, message: RaftMessage<'_>) -> Result<(), Transport> {
        match self.inner.links.fate(from, to, message) {
            LinkFate::Deliver(delay) => {
                if !delay.is_zero() {
                    tokio::time::sleep(delay).await;
                }
                Ok(())
            }
            LinkFate::Lose => std::future::pending().await,
            LinkFate::Reset => Err(Transport::Failed("connection reset".into())),
        }
    }
}

/// One node's end of a [`MemRaftNet`]: what its [`crate::network::PeerClient`] sends
/// through.
#[derive(Clone, Debug)]
pub(crate) struct MemEnd {
    net: MemRaftNet,
    me: NodeId,
    addr: SocketAddr,
}

impl MemEnd {
    /// Carries `request` to the router at `to`, runs it there in a task of its own
    /// and carries its answer back, as the links say.
    pub(crate) async fn send(
        &self,
        to: &str,
        mut request: http::Request<Body>,
    ) -> Result<http::Response<Body>, Transport> {
        let down = || Transport::Connect(format!("no node serves {to}"));
        let target = self.net.lookup(to).ok_or_else(down)?.node;
        let rpc = request.uri().path().to_owned();
        self.net.carry(self.me, target, RaftMessage { rpc: &rpc, answer: false }).await?;
        // It went down while the request travelled: nothing took it.
        let served = self.net.lookup(to).ok_or_else(down)?;
        request.extensions_mut().insert(axum::extract::ConnectInfo(crate::auth::RaftPeer(self.addr)));
        let handling = tokio::spawn(async move {
            let Ok(resp) = tower::ServiceExt::oneshot(served.router, request).await;
            let (parts, body) = resp.into_parts();
            let bytes = axum::body::to_bytes(body, usize::MAX).await.map_err(|e| e.to_string())?;
            Ok::<_, String>(http::Response::from_parts(parts, Body::from(bytes)))
        });
        let answer = match handling.await {
            Ok(Ok(resp)) => Ok(resp),
            Ok(Err(e)) => Err(Transport::Failed(format!("the answer broke off: {e}"))),
            Err(e) => Err(Transport::Failed(format!("connection closed by the peer: {e}"))),
        };
        self.net.carry(served.node, self.me, RaftMessage { rpc: &rpc, answer: true }).await?;
        answer
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::network::{post_json, CallError, PeerClient};
    use std::sync::atomic::{AtomicU64, Ordering};

    /// Requests from 1 fare as `request`, answers to 1 as `answer`.
    struct Fates {
        request: LinkFate,
        answer: LinkFate,
        asked: Mutex<Vec<(NodeId, NodeId)>>,
    }

    impl RaftLinks for Fates {
        fn fate(&self, from: NodeId, to: NodeId, message: RaftMessage<'_>) -> LinkFate {
            assert_eq!(message, RaftMessage { rpc: "/count", answer: from != 1 });
            self.asked.lock().unwrap().push((from, to));
            if from == 1 {
                self.request
            } else {
                self.answer
            }
        }
    }

    const TWO: &str = "10.0.0.2:7100";

    /// A network where node 2 serves `/count`, which counts its calls and answers
    /// the count, behind the raft protocol check; and node 1's client on it.
    fn setup(request: LinkFate, answer: LinkFate) -> (MemRaftNet, Arc<Fates>, PeerClient, Arc<AtomicU64>) {
        let fates = Arc::new(Fates { request, answer, asked: Mutex::default() });
        let net = MemRaftNet::new(fates.clone());
        let served = Arc::new(AtomicU64::new(0));
        let count = served.clone();
        let router = Router::new()
            .route(
                "/count",
                axum::routing::post(move |axum::Json(n): axum::Json<u64>| async move {
                    axum::Json(count.fetch_add(n, Ordering::SeqCst) + n)
                }),
            )
            .layer(axum::middleware::from_fn(crate::server::same_protocol));
        net.register(TWO.into(), 2, router);
        let client = PeerClient::in_memory(net.end(1, "10.0.0.1:7100".parse().unwrap()), None);
        (net, fates, client, served)
    }

    async fn call(client: &PeerClient, addr: &str) -> Result<u64, CallError> {
        post_json(client, addr, "/count", &1u64, Duration::from_millis(500)).await
    }

    #[tokio::test(start_paused = true)]
    async fn a_delivered_call_takes_both_delays_and_runs_the_router() {
        let deliver = LinkFate::Deliver(Duration::from_millis(7));
        let (_net, fates, client, served) = setup(deliver, LinkFate::Deliver(Duration::from_millis(5)));
        let started = tokio::time::Instant::now();
        assert_eq!(call(&client, TWO).await.unwrap(), 1);
        assert_eq!(started.elapsed(), Duration::from_millis(12));
        assert_eq!(served.load(Ordering::SeqCst), 1);
        assert_eq!(*fates.asked.lock().unwrap(), [(1, 2), (2, 1)]);
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_to_no_node_fails_at_once_to_connect() {
        let (net, fates, client, _) =
            setup(LinkFate::Deliver(Duration::ZERO), LinkFate::Deliver(Duration::ZERO));
        let started = tokio::time::Instant::now();
        let err = call(&client, "10.0.0.3:7100").await.unwrap_err();
        assert!(matches!(err, CallError::Connect { .. }), "{err}");
        // Unregistered by another key: still served; by its own: gone.
        net.unregister(TWO, 0);
        assert_eq!(call(&client, TWO).await.unwrap(), 1);
        let key = net.lookup(TWO).unwrap().key;
        net.unregister(TWO, key);
        let err = call(&client, TWO).await.unwrap_err();
        assert!(matches!(err, CallError::Connect { .. }), "{err}");
        assert_eq!(started.elapsed(), Duration::ZERO);
        assert_eq!(fates.asked.lock().unwrap().len(), 2);
    }

    #[tokio::test(start_paused = true)]
    async fn a_lost_request_or_answer_times_out_and_a_lost_answer_was_served() {
        let (_net, _, client, served) = setup(LinkFate::Lose, LinkFate::Deliver(Duration::ZERO));
        let started = tokio::time::Instant::now();
        let err = call(&client, TWO).await.unwrap_err();
        assert!(err.to_string().contains("no answer within 500 ms"), "{err}");
        assert_eq!(started.elapsed(), Duration::from_millis(500));
        assert_eq!(served.load(Ordering::SeqCst), 0);

        let (_net, _, client, served) = setup(LinkFate::Deliver(Duration::ZERO), LinkFate::Lose);
        let err = call(&client, TWO).await.unwrap_err();
        assert!(
            matches!(err, CallError::Failed { .. }) && err.to_string().contains("no answer within"),
            "{err}"
        );
        assert_eq!(served.load(Ordering::SeqCst), 1);
    }

    #[tokio::test(start_paused = true)]
    async fn a_reset_fails_the_call_at_once_and_a_reset_answer_was_served() {
        let (_net, _, client, served) = setup(LinkFate::Reset, LinkFate::Deliver(Duration::ZERO));
        let started = tokio::time::Instant::now();
        let err = call(&client, TWO).await.unwrap_err();
        assert!(err.to_string().contains("connection reset"), "{err}");
        assert_eq!(served.load(Ordering::SeqCst), 0);

        let (_net, _, client, served) = setup(LinkFate::Deliver(Duration::ZERO), LinkFate::Reset);
        let err = call(&client, TWO).await.unwrap_err();
        assert!(err.to_string().contains("connection reset"), "{err}");
        assert_eq!(served.load(Ordering::SeqCst), 1);
        assert_eq!(started.elapsed(), Duration::ZERO);
    }

    #[tokio::test(start_paused = true)]
    async fn a_refusal_of_the_router_is_a_refusal_of_the_call() {
        let (net, _, _, served) = setup(LinkFate::Deliver(Duration::ZERO), LinkFate::Deliver(Duration::ZERO));
        // A caller whose requests carry a proof the router does not check still
        // passes; a router that checks a secret refuses a caller without one.
        let guarded = Router::new()
            .route("/count", axum::routing::post(|| async { axum::Json(0u64) }))
            .layer(axum::middleware::from_fn_with_state(
                Some(Arc::new(crate::RaftSecret::new("a-long-enough-secret"))),
                crate::auth::authenticated,
            ));
        net.register("10.0.0.3:7100".into(), 3, guarded);
        let client = PeerClient::in_memory(net.end(1, "10.0.0.1:7100".parse().unwrap()), None);
        let err = call(&client, "10.0.0.3:7100").await.unwrap_err();
        assert!(matches!(err, CallError::Refused { .. }), "{err}");
        let signed = PeerClient::in_memory(
            net.end(1, "10.0.0.1:7100".parse().unwrap()),
            Some(Arc::new(crate::RaftSecret::new("a-long-enough-secret"))),
        );
        assert_eq!(call(&signed, "10.0.0.3:7100").await.unwrap(), 0);
        assert_eq!(call(&signed, TWO).await.unwrap(), 1);
        assert_eq!(served.load(Ordering::SeqCst), 1);
    }
}
