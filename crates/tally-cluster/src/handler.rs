//! [`ShardHandler`]: what a node answers on its node-to-node sessions.

use crate::replication::PeerRequest;
use std::sync::Arc;
use tally_core::codec;
use tally_engine::{ShardResponse, Tally};
use tally_replica::Replication;
use tally_transport::Handler;

/// A part of a node that other parts reach once it exists, and let go of when the
/// node stops: the engine reaches the placement and the placement the engine (the
/// transport the handler, the handler the engine), and a stopped node must leave no
/// such circle behind (several nodes run in one process in simulation).
pub(crate) struct Slot<T>(parking_lot::RwLock<Option<T>>);

impl<T: Clone> Slot<T> {
    pub(crate) fn new() -> Self {
        Self(parking_lot::RwLock::new(None))
    }

    pub(crate) fn set(&self, value: T) {
        *self.0.write() = Some(value);
    }

    pub(crate) fn get(&self) -> Option<T> {
        self.0.read().clone()
    }

    pub(crate) fn clear(&self) {
        self.0.write().take();
    }
}

/// Serves other nodes' requests: shard requests with the local engine, range
/// messages with the local range groups.
pub(crate) struct ShardHandler {
    pub(crate) engine: Slot<Tally>,
    pub(crate) replication: Slot<Arc<Replication>>,
}

impl Handler for ShardHandler {
    fn handle(&self, from: &str, request: Vec<u8>) -> impl std::future::Future<Output = Vec<u8>> + Send {
        let engine = self.engine.get();
        let replication = self.replication.get();
        let from = from.to_string();
        async move {
            let starting = || ShardResponse::Failed {
                code: "starting".into(),
                message: "node is starting".into(),
                owner: None,
            };
            let response = match codec::decode::<PeerRequest>("node request", &request) {
                Ok(PeerRequest::Shard(req)) => match engine {
                    Some(engine) => engine.serve_shard_request(req).await,
                    None => starting(),
                },
                Ok(PeerRequest::Range(envelope)) => {
                    let reply = match replication {
                        Some(r) => tally_replica::RangeInbound::handle(&**r.groups(), envelope).await,
                        None => {
                            Err(tally_replica::NetError::NoGroup { to: envelope.to, range: envelope.range })
                        }
                    };
                    return tally_replica::network::encode_reply(&reply);
                }
                Ok(PeerRequest::Formed(range)) => {
                    return codec::encode(&replication.is_some_and(|r| r.formed(range)));
                }
                Ok(PeerRequest::Lists(range, replica)) => {
                    return codec::encode(&replication.and_then(|r| r.lists(range, replica)));
                }
                Ok(PeerRequest::Campaign(range, departed)) => {
                    if let Some(r) = replication {
                        r.campaign(range, departed);
                    }
                    return codec::encode(&());
                }
                Err(e) => {
                    tracing::warn!(from = %from, error = %e, "undecodable node request");
                    ShardResponse::Failed { code: "malformed".into(), message: e.to_string(), owner: None }
                }
            };
            codec::encode(&response)
        }
    }
}
