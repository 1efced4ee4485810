//! Node-to-node messages: every type a node decodes from a peer's bytes (the
//! transport's envelope and the shard requests and answers inside it). Decoding
//! must fail cleanly or give a value whose canonical encoding round-trips
//! (bincode accepts non-minimal varints, so the input bytes themselves need not).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tally_core::codec::{decode, encode};
use tally_engine::{ShardRequest, ShardResponse};
use tally_transport::wire::{WireReply, WireRequest};

fuzz_target!(|data: &[u8]| {
    if let Ok(v) = decode::<WireRequest>("fuzz", data) {
        let canonical = encode(&v);
        let again = decode::<WireRequest>("fuzz", &canonical).map(|v| encode(&v));
        assert_eq!(again, Ok(canonical), "a transport request does not survive a round trip: the canonical encoding must decode and encode to itself");
    }
    if let Ok(v) = decode::<WireReply>("fuzz", data) {
        let canonical = encode(&v);
        let again = decode::<WireReply>("fuzz", &canonical).map(|v| encode(&v));
        assert_eq!(again, Ok(canonical), "a transport reply does not survive a round trip: the canonical encoding must decode and encode to itself");
    }
    let _ = decode::<ShardRequest>("fuzz", data);
    let _ = decode::<ShardResponse>("fuzz", data);
});
