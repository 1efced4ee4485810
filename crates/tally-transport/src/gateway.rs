//! The gateway: the one remote-capable actor per node. Peers find it in the process group
//! `tally.gw.<node_id>` (scope [`PG_SCOPE`]) once their session has synchronized groups, and
//! send it [`GatewayMsg`]s. It answers pings inline and runs each call on its own task, so a
//! slow handler never delays a heartbeat. What it does with a request is
//! `Gateway::serve`, which the in-memory backend (`mem.rs`, [`crate::MemNetwork`]) runs too.

use std::collections::{BTreeMap, BTreeSet};
use std::future::Future;
use std::pin::Pin;
use std::sync::Arc;

use ractor::{Actor, ActorProcessingErr, ActorRef};
use tally_core::format::FormatError;
use tokio::sync::Semaphore;

use crate::backoff::{unix_ms, LogLimiter};
use crate::config::TransportConfig;
use crate::wire::{
    decode_request, encode_reply, FrameError, GatewayMsg, Refusal, WireReply, WireRequest, REPLY_BYTES_MAX,
};

/// ractor process-group scope holding every node's gateway.
pub const PG_SCOPE: &str = "tally.transport";
/// Calls a gateway runs at once; beyond this it answers `Overloaded` instead of queueing
/// without bound.
pub const INFLIGHT_CALLS_MAX: usize = 1024;
/// Spacing of repeated refusal log lines per sender, in ms.
pub const REFUSAL_LOG_INTERVAL_MS: u64 = 10_000;

/// The process-group name under which `node`'s gateway is registered.
pub fn gateway_group(node: &str) -> String {
    format!("tally.gw.{node}")
}

/// Serves the requests other nodes send to this one. The transport is payload-agnostic: the
/// caller encodes its request as bytes, the handler decodes, acts and encodes the reply.
pub trait Handler: Send + Sync + 'static {
    /// Serves one request from node `from`; the returned bytes go back to the caller.
    /// Requests run concurrently (up to [`INFLIGHT_CALLS_MAX`]); a panic becomes
    /// [`crate::TransportError::HandlerFailed`] at the caller. `from` is the caller's node id
    /// as it states it: the cluster secret is what authenticates peers, and the gateway only
    /// admits names from its peer list (and this node itself).
    fn handle(&self, from: &str, request: Vec<u8>) -> impl Future<Output = Vec<u8>> + Send;
}

type BoxFuture = Pin<Box<dyn Future<Output = Vec<u8>> + Send>>;

/// Object-safe form of [`Handler`], so the transport need not be generic.
pub(crate) trait DynHandler: Send + Sync + 'static {
    fn handle_boxed(&self, from: String, request: Vec<u8>) -> BoxFuture;
}

/// Adapts an `Arc<H: Handler>` to [`DynHandler`].
pub(crate) struct Erased<H>(pub(crate) Arc<H>);

impl<H: Handler> DynHandler for Erased<H> {
    fn handle_boxed(&self, from: String, request: Vec<u8>) -> BoxFuture {
        let handler = Arc::clone(&self.0);
        Box::pin(async move { handler.handle(&from, request).await })
    }
}

/// The gateway actor's read-only configuration.
pub(crate) struct Gateway {
    pub(crate) node_id: String,
    pub(crate) fingerprint: u64,
    pub(crate) peers: BTreeSet<String>,
    pub(crate) handler: Arc<dyn DynHandler>,
}

/// Mutable gateway state: the in-flight limit and per-sender refusal log limiters.
pub(crate) struct GatewayState {
    inflight: Arc<Semaphore>,
    refusal_logs: BTreeMap<String, LogLimiter>,
}

impl Gateway {
    /// Checks a request's sender and fingerprint; `Some(refusal)` means do not serve it.
    fn admit(&self, state: &mut GatewayState, from: &str, fingerprint: u64) -> Option<Refusal> {
        let refusal = if from != self.node_id && !self.peers.contains(from) {
            Refusal::UnknownSender(from.to_string())
        } else if fingerprint != self.fingerprint {
            Refusal::FingerprintMismatch { ours: self.fingerprint, theirs: fingerprint }
        } else {
            return None;
        };
        // Bound the limiter map: unknown senders share one entry.
        let key = if self.peers.contains(from) { from.to_string() } else { String::from("<unknown>") };
        let limiter =
            state.refusal_logs.entry(key).or_insert_with(|| LogLimiter::new(REFUSAL_LOG_INTERVAL_MS));
        if let Some(suppressed) = limiter.allow(unix_ms()) {
            match &refusal {
                Refusal::FingerprintMismatch { ours, theirs } => tracing::error!(
                    node = %self.node_id, peer = %from, ours = format_args!("{ours:#018x}"),
                    theirs = format_args!("{theirs:#018x}"), suppressed,
                    "refusing peer {from}: cluster-config fingerprint mismatch (ours {ours:#018x}, \
                     theirs {theirs:#018x}); the nodes were started with different cluster configs"
                ),
                Refusal::UnknownSender(who) => tracing::warn!(
                    node = %self.node_id, suppressed, "refusing request from {who:?}: not in the peer list"
                ),
                // Refused before a sender is known (see `handle`).
                Refusal::ProtocolMismatch { .. } => {}
            }
        }
        Some(refusal)
    }
}

impl GatewayState {
    /// A gateway with nothing in flight and nothing logged yet.
    pub(crate) fn new() -> Self {
        GatewayState { inflight: Arc::new(Semaphore::new(INFLIGHT_CALLS_MAX)), refusal_logs: BTreeMap::new() }
    }
}

impl Gateway {
    /// Builds the gateway of the node `cfg` describes, serving calls on `handler`.
    pub(crate) fn new(cfg: &TransportConfig, handler: Arc<dyn DynHandler>) -> Self {
        Gateway {
            node_id: cfg.node_id.clone(),
            fingerprint: cfg.fingerprint,
            peers: cfg.peers.keys().cloned().collect(),
            handler,
        }
    }

    /// Serves one request frame ([`crate::wire::encode_request`]) and hands the reply frame
    /// to `reply`: at once for pings, refusals and bad frames, from the call's own task
    /// once the handler is done for calls. Every backend's gateway runs this.
    pub(crate) fn serve<R>(&self, state: &mut GatewayState, request: &[u8], reply: R)
    where
        R: FnOnce(Vec<u8>) + Send + 'static,
    {
        let immediate = match decode_request(request) {
            Err(FrameError::Protocol(FormatError::Protocol { ours, theirs, .. })) => {
                let limiter = state
                    .refusal_logs
                    .entry(String::from("<other protocol>"))
                    .or_insert_with(|| LogLimiter::new(REFUSAL_LOG_INTERVAL_MS));
                if let Some(suppressed) = limiter.allow(unix_ms()) {
                    tracing::error!(
                        node = %self.node_id, ours, theirs, suppressed,
                        "refusing a peer that speaks node-to-node protocol {theirs} (this node speaks \
                         {ours}): run the same release on every node"
                    );
                }
                WireReply::Refused(Refusal::ProtocolMismatch { ours, theirs })
            }
            Err(e) => {
                tracing::debug!(node = %self.node_id, "malformed request: {e}");
                WireReply::Malformed(e.to_string())
            }
            Ok(WireRequest::Ping { from, fingerprint, nonce }) => match self.admit(state, &from, fingerprint)
            {
                Some(refusal) => WireReply::Refused(refusal),
                None => WireReply::Pong { node: self.node_id.clone(), fingerprint: self.fingerprint, nonce },
            },
            Ok(WireRequest::Call { from, fingerprint, body }) => {
                if let Some(refusal) = self.admit(state, &from, fingerprint) {
                    WireReply::Refused(refusal)
                } else if let Ok(permit) = Arc::clone(&state.inflight).try_acquire_owned() {
                    let work = self.handler.handle_boxed(from, body);
                    tokio::spawn(async move {
                        // The handler runs on its own task so a panic is caught by its JoinHandle.
                        let outcome = tokio::spawn(work).await;
                        drop(permit);
                        let wire = match outcome {
                            Ok(bytes) if bytes.len() > REPLY_BYTES_MAX => {
                                WireReply::ReplyTooLarge(bytes.len() as u64)
                            }
                            Ok(bytes) => WireReply::Reply(bytes),
                            Err(e) => {
                                tracing::error!("transport handler failed: {e}");
                                WireReply::HandlerFailed
                            }
                        };
                        reply(encode_reply(&wire));
                    });
                    return;
                } else {
                    WireReply::Overloaded
                }
            }
        };
        reply(encode_reply(&immediate));
    }
}

impl Actor for Gateway {
    type Msg = GatewayMsg;
    type State = GatewayState;
    type Arguments = ();

    async fn pre_start(
        &self,
        _myself: ActorRef<Self::Msg>,
        _: (),
    ) -> Result<Self::State, ActorProcessingErr> {
        Ok(GatewayState::new())
    }

    async fn handle(
        &self,
        _myself: ActorRef<Self::Msg>,
        message: Self::Msg,
        state: &mut Self::State,
    ) -> Result<(), ActorProcessingErr> {
        let GatewayMsg { request, reply } = message;
        // A failed send only means the caller gave up.
        self.serve(state, &request, move |frame| {
            let _ = reply.send(frame);
        });
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    use ractor::rpc::CallResult;

    /// Echoes, except that the body `panic` makes it panic and `big` makes it reply too much.
    struct TestHandler;

    impl Handler for TestHandler {
        async fn handle(&self, from: &str, request: Vec<u8>) -> Vec<u8> {
            match request.as_slice() {
                b"panic" => panic!("handler asked to panic"),
                b"big" => vec![0; REPLY_BYTES_MAX + 1],
                _ => [from.as_bytes(), b":", &request].concat(),
            }
        }
    }

    async fn gateway() -> ActorRef<GatewayMsg> {
        let gw = Gateway {
            node_id: "node1".into(),
            fingerprint: 7,
            peers: ["node2".to_string()].into_iter().collect(),
            handler: Arc::new(Erased(Arc::new(TestHandler))),
        };
        Actor::spawn(None, gw, ()).await.expect("spawn gateway").0
    }

    async fn ask(gw: &ActorRef<GatewayMsg>, request: Vec<u8>) -> WireReply {
        match gw.call(|reply| GatewayMsg { request, reply }, Some(Duration::from_secs(5))).await {
            Ok(CallResult::Success(bytes)) => crate::wire::decode_reply(&bytes).expect("decodable reply"),
            other => panic!("no reply: {other:?}"),
        }
    }

    fn call(from: &str, fingerprint: u64, body: &[u8]) -> Vec<u8> {
        crate::wire::encode_request(&WireRequest::Call {
            from: from.into(),
            fingerprint,
            body: body.to_vec(),
        })
    }

    #[tokio::test]
    async fn serves_calls_and_pings_from_known_peers() {
        let gw = gateway().await;
        assert_eq!(ask(&gw, call("node2", 7, b"hi")).await, WireReply::Reply(b"node2:hi".to_vec()));
        let ping = crate::wire::encode_request(&WireRequest::Ping {
            from: "node2".into(),
            fingerprint: 7,
            nonce: 42,
        });
        assert_eq!(ask(&gw, ping).await, WireReply::Pong { node: "node1".into(), fingerprint: 7, nonce: 42 });
        // A node may call itself.
        assert_eq!(ask(&gw, call("node1", 7, b"me")).await, WireReply::Reply(b"node1:me".to_vec()));
        gw.stop(None);
    }

    #[tokio::test]
    async fn refuses_other_fingerprints_and_strangers() {
        let gw = gateway().await;
        assert_eq!(
            ask(&gw, call("node2", 8, b"hi")).await,
            WireReply::Refused(Refusal::FingerprintMismatch { ours: 7, theirs: 8 })
        );
        let ping = crate::wire::encode_request(&WireRequest::Ping {
            from: "node2".into(),
            fingerprint: 9,
            nonce: 1,
        });
        assert_eq!(
            ask(&gw, ping).await,
            WireReply::Refused(Refusal::FingerprintMismatch { ours: 7, theirs: 9 })
        );
        assert_eq!(
            ask(&gw, call("mallory", 7, b"hi")).await,
            WireReply::Refused(Refusal::UnknownSender("mallory".into()))
        );
        gw.stop(None);
    }

    #[tokio::test]
    async fn refuses_a_peer_of_another_protocol_by_version() {
        let gw = gateway().await;
        let ours = tally_core::format::PEER_PROTOCOL;
        let mut frame = call("node2", 7, b"hi");
        frame[..4].copy_from_slice(&(ours + 1).to_le_bytes());
        let reply = ask(&gw, frame).await;
        assert_eq!(reply, WireReply::Refused(Refusal::ProtocolMismatch { ours, theirs: ours + 1 }));
        let WireReply::Refused(refusal) = reply else { unreachable!() };
        assert!(refusal.to_string().contains("same release"), "{refusal}");
        gw.stop(None);
    }

    #[tokio::test]
    async fn garbage_panics_and_oversized_replies_become_typed_answers() {
        let gw = gateway().await;
        let ours = tally_core::format::PEER_PROTOCOL;
        let garbage = tally_core::format::versioned(ours, vec![0xff; 9]);
        assert!(matches!(ask(&gw, garbage).await, WireReply::Malformed(_)));
        assert!(matches!(
            ask(&gw, tally_core::format::versioned(ours, Vec::new())).await,
            WireReply::Malformed(_)
        ));
        // Bytes that do not even start with our protocol version: refused as another
        // protocol, by version.
        assert_eq!(
            ask(&gw, vec![0xff; 9]).await,
            WireReply::Refused(Refusal::ProtocolMismatch { ours, theirs: u32::MAX })
        );
        assert_eq!(
            ask(&gw, Vec::new()).await,
            WireReply::Refused(Refusal::ProtocolMismatch { ours, theirs: 0 })
        );
        assert_eq!(ask(&gw, call("node2", 7, b"panic")).await, WireReply::HandlerFailed);
        assert_eq!(
            ask(&gw, call("node2", 7, b"big")).await,
            WireReply::ReplyTooLarge(REPLY_BYTES_MAX as u64 + 1)
        );
        // Still serving afterwards.
        assert_eq!(ask(&gw, call("node2", 7, b"ok")).await, WireReply::Reply(b"node2:ok".to_vec()));
        gw.stop(None);
    }
}
