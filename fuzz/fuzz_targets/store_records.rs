//! Records read back from disk: shard images, dedup records, counter metadata,
//! tombstones and the sketches inside images. A corrupt record must be an error,
//! never a panic or an allocation beyond `tally_core::codec::DECODE_BYTES_MAX`.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tally_core::cms::CountMin;
use tally_core::codec::{decode, encode};
use tally_core::meta::CounterMeta;
use tally_core::sketch::DistinctSketch;
use tally_store::{DedupRecord, ShardImage};

fuzz_target!(|data: &[u8]| {
    if let Ok(image) = decode::<ShardImage>("fuzz", data) {
        let canonical = encode(&image);
        let again = decode::<ShardImage>("fuzz", &canonical).map(|v| encode(&v));
        assert_eq!(again, Ok(canonical), "a shard image does not survive a round trip: the canonical encoding must decode and encode to itself");
        if let Some(sketch) = &image.sketch {
            let _ = DistinctSketch::from_bytes(sketch);
        }
    }
    if let Ok(record) = decode::<DedupRecord>("fuzz", data) {
        let canonical = encode(&record);
        let again = decode::<DedupRecord>("fuzz", &canonical).map(|v| encode(&v));
        assert_eq!(again, Ok(canonical), "a dedup record does not survive a round trip: the canonical encoding must decode and encode to itself");
    }
    let _ = decode::<CounterMeta>("fuzz", data);
    let _ = decode::<Vec<(u32, u16)>>("fuzz", data);
    let _ = decode::<CountMin>("fuzz", data);
    if let Ok(sketch) = DistinctSketch::from_bytes(data) {
        let _ = sketch.estimate();
    }
});
