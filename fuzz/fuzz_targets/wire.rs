//! Node-to-node messages: every type a node decodes from a peer's bytes (the
//! transport's envelope and the shard requests and answers inside it). Decoding
//! must fail cleanly or give a value that encodes to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tally_core::codec::{decode, encode};
use tally_engine::{ShardRequest, ShardResponse};
use tally_transport::wire::{WireReply, WireRequest};

fuzz_target!(|data: &[u8]| {
    if let Ok(v) = decode::<WireRequest>("fuzz", data) {
        assert_eq!(encode(&v), data, "a transport request does not re-encode to its bytes");
    }
    if let Ok(v) = decode::<WireReply>("fuzz", data) {
        assert_eq!(encode(&v), data, "a transport reply does not re-encode to its bytes");
    }
    let _ = decode::<ShardRequest>("fuzz", data);
    let _ = decode::<ShardResponse>("fuzz", data);
});
