//! What crosses the wire between two gateways, and the one ractor message that carries it.
//!
//! ractor_cluster forwards a remote call as `SerializedMessage::Call { variant, args, reply }`
//! with a `RpcReplyPort<Vec<u8>>`. [`GatewayMsg`] is exactly that shape, so it needs no
//! bridging task and no `BytesConvertable` (whose `from_bytes` cannot fail and would panic on
//! malformed input). The payload is a [`WireRequest`] / [`WireReply`] encoded with
//! `tally_core::codec`; decoding happens in the gateway and in the caller, where a bad frame
//! becomes a typed error instead of a silently dropped message.

use ractor::message::{BoxedDowncastErr, SerializedMessage};
use ractor::RpcReplyPort;
use serde::{Deserialize, Serialize};
use tally_core::codec::{decode, encode, DecodeError};
use tally_core::format::{split_versioned, versioned, FormatError, PEER_PROTOCOL};

/// Variant tag of [`GatewayMsg`] on the wire; bump the suffix on an incompatible change.
pub const GATEWAY_VARIANT: &str = "tally.transport.v1";

/// Largest request body a caller may send, in bytes (what the callers bound their
/// messages to: [`tally_core::codec::NODE_MESSAGE_BYTES_MAX`]).
pub const REQUEST_BYTES_MAX: usize = tally_core::codec::NODE_MESSAGE_BYTES_MAX;
/// Largest reply body a handler may return, in bytes (a bigger one is replaced by an error).
pub const REPLY_BYTES_MAX: usize = tally_core::codec::NODE_MESSAGE_BYTES_MAX;
/// Largest inbound ractor_cluster frame, in bytes: a body plus envelope must fit.
pub const FRAME_BYTES_MAX: u64 = 16 << 20;

/// A request from one gateway to another.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireRequest {
    /// An opaque request for the callee's [`crate::Handler`].
    Call {
        /// The caller's node id (the handler sees it as `from`).
        from: String,
        /// The caller's cluster-config fingerprint.
        fingerprint: u64,
        /// The caller-encoded request.
        body: Vec<u8>,
    },
    /// A heartbeat.
    Ping {
        /// The pinger's node id.
        from: String,
        /// The pinger's cluster-config fingerprint.
        fingerprint: u64,
        /// Echoed in the pong, so a reply cannot be mistaken for another's.
        nonce: u64,
    },
}

/// Why a gateway refused a request.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum Refusal {
    /// The caller's cluster-config fingerprint differs from ours.
    FingerprintMismatch {
        /// The callee's fingerprint.
        ours: u64,
        /// The caller's fingerprint as received.
        theirs: u64,
    },
    /// The caller's node id is not in the callee's peer list.
    UnknownSender(String),
    /// The caller speaks another node-to-node protocol version.
    ProtocolMismatch {
        /// The callee's version.
        ours: u32,
        /// The caller's, as received.
        theirs: u32,
    },
}

impl std::fmt::Display for Refusal {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            // From the callee's point of view: "ours" is the callee's.
            Refusal::FingerprintMismatch { ours, theirs } => {
                write!(f, "cluster-config fingerprint mismatch (callee {ours:#018x}, caller {theirs:#018x})")
            }
            Refusal::UnknownSender(who) => write!(f, "{who:?} is not in the callee's peer list"),
            Refusal::ProtocolMismatch { ours, theirs } => write!(
                f,
                "node-to-node protocol mismatch (callee speaks {ours}, caller {theirs}); \
                 run the same release on every node"
            ),
        }
    }
}

/// A gateway's answer.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub enum WireReply {
    /// The handler's reply to a `Call`.
    Reply(Vec<u8>),
    /// The answer to a `Ping`.
    Pong {
        /// The answering node's id.
        node: String,
        /// The answering node's fingerprint.
        fingerprint: u64,
        /// The ping's nonce.
        nonce: u64,
    },
    /// The request was not served.
    Refused(Refusal),
    /// Too many requests in flight at the callee.
    Overloaded,
    /// The handler panicked.
    HandlerFailed,
    /// The handler's reply exceeded [`REPLY_BYTES_MAX`].
    ReplyTooLarge(u64),
    /// The request could not be decoded.
    Malformed(String),
}

/// Why a frame could not be read.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum FrameError {
    /// The frame's protocol version is not [`PEER_PROTOCOL`].
    #[error(transparent)]
    Protocol(#[from] FormatError),
    /// The frame's body does not decode.
    #[error(transparent)]
    Decode(#[from] DecodeError),
}

/// A request frame: the protocol version ([`PEER_PROTOCOL`], 4 bytes little-endian)
/// and the encoded [`WireRequest`]. The version comes first and is never encoded
/// differently, so a node of any release can tell that a peer speaks another one.
pub fn encode_request(request: &WireRequest) -> Vec<u8> {
    versioned(PEER_PROTOCOL, encode(request))
}

/// Reads a request frame (see [`encode_request`]).
pub fn decode_request(frame: &[u8]) -> Result<WireRequest, FrameError> {
    let body = split_versioned("node-to-node", PEER_PROTOCOL, frame)?;
    Ok(decode("transport request", body)?)
}

/// A reply frame: the protocol version and the encoded [`WireReply`].
pub fn encode_reply(reply: &WireReply) -> Vec<u8> {
    versioned(PEER_PROTOCOL, encode(reply))
}

/// Reads a reply frame (see [`encode_reply`]).
pub fn decode_reply(frame: &[u8]) -> Result<WireReply, FrameError> {
    let body = split_versioned("node-to-node", PEER_PROTOCOL, frame)?;
    Ok(decode("transport reply", body)?)
}

/// The gateway actor's only message: an encoded [`WireRequest`] and where the encoded
/// [`WireReply`] goes. Local and remote callers send the same thing.
#[derive(Debug)]
pub struct GatewayMsg {
    /// A request frame ([`encode_request`]).
    pub request: Vec<u8>,
    /// Receives a reply frame ([`encode_reply`]).
    pub reply: RpcReplyPort<Vec<u8>>,
}

impl ractor::Message for GatewayMsg {
    fn serializable() -> bool {
        true
    }

    fn serialize(self) -> Result<SerializedMessage, BoxedDowncastErr> {
        Ok(SerializedMessage::Call {
            variant: GATEWAY_VARIANT.to_string(),
            args: self.request,
            reply: self.reply,
            metadata: None,
        })
    }

    fn deserialize(message: SerializedMessage) -> Result<Self, BoxedDowncastErr> {
        match message {
            SerializedMessage::Call { variant, args, reply, .. } if variant == GATEWAY_VARIANT => {
                Ok(GatewayMsg { request: args, reply })
            }
            // Casts, replies and unknown variants are not ours; ractor drops them.
            _ => Err(BoxedDowncastErr),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use ractor::Message;
    use tally_core::codec::{decode, encode};

    #[test]
    fn gateway_msg_round_trips_through_serialized_form() {
        let (tx, _rx) = ractor::concurrency::oneshot();
        let msg = GatewayMsg { request: vec![1, 2, 3], reply: tx.into() };
        let ser = msg.serialize().unwrap();
        let back = GatewayMsg::deserialize(ser).unwrap();
        assert_eq!(back.request, vec![1, 2, 3]);
    }

    #[test]
    fn foreign_variants_and_casts_are_refused_not_panicked() {
        let (tx, _rx) = ractor::concurrency::oneshot();
        let other =
            SerializedMessage::Call { variant: "x".into(), args: vec![], reply: tx.into(), metadata: None };
        assert!(GatewayMsg::deserialize(other).is_err());
        let cast = SerializedMessage::Cast { variant: GATEWAY_VARIANT.into(), args: vec![], metadata: None };
        assert!(GatewayMsg::deserialize(cast).is_err());
        assert!(GatewayMsg::deserialize(SerializedMessage::CallReply(1, vec![])).is_err());
    }

    #[test]
    fn wire_types_round_trip_and_garbage_is_an_error() {
        let req = WireRequest::Call { from: "node1".into(), fingerprint: 9, body: b"hi".to_vec() };
        assert_eq!(decode::<WireRequest>("req", &encode(&req)), Ok(req));
        let rep = WireReply::Refused(Refusal::FingerprintMismatch { ours: 1, theirs: 2 });
        assert_eq!(decode::<WireReply>("rep", &encode(&rep)), Ok(rep));
        assert!(decode::<WireRequest>("req", &[0xff, 0xff, 0xff, 0xff, 0xff]).is_err());
        assert!(decode::<WireReply>("rep", &[]).is_err());
    }

    #[test]
    fn frames_lead_with_the_protocol_and_other_versions_are_named() {
        let req = WireRequest::Ping { from: "node1".into(), fingerprint: 9, nonce: 3 };
        let frame = encode_request(&req);
        assert_eq!(frame[..4], PEER_PROTOCOL.to_le_bytes());
        assert_eq!(decode_request(&frame), Ok(req));
        let rep = WireReply::Overloaded;
        assert_eq!(decode_reply(&encode_reply(&rep)), Ok(rep));

        // Another release's frame: refused by version before its body is looked at.
        let mut other = encode_request(&WireRequest::Ping { from: "n".into(), fingerprint: 1, nonce: 1 });
        other[..4].copy_from_slice(&(PEER_PROTOCOL + 1).to_le_bytes());
        let err = decode_request(&other).unwrap_err();
        assert_eq!(
            err,
            FrameError::Protocol(FormatError::Protocol {
                what: "node-to-node",
                ours: PEER_PROTOCOL,
                theirs: PEER_PROTOCOL + 1
            })
        );
        // A release before versioned frames sent the bare request: also refused by
        // version (its first bytes are no version of ours), never misread.
        let bare = encode(&WireRequest::Call { from: "node1".into(), fingerprint: 9, body: vec![] });
        assert!(matches!(decode_request(&bare), Err(FrameError::Protocol(_))));
        assert!(matches!(decode_reply(&[1, 0]), Err(FrameError::Protocol(_))));
        // The right version with a garbage body is a decode error.
        assert!(matches!(
            decode_request(&versioned(PEER_PROTOCOL, vec![0xff; 6])),
            Err(FrameError::Decode(_))
        ));
    }
}
