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
        assert_eq!(encode(&image), data, "a shard image does not re-encode to its bytes");
        if let Some(sketch) = &image.sketch {
            let _ = DistinctSketch::from_bytes(sketch);
        }
    }
    if let Ok(record) = decode::<DedupRecord>("fuzz", data) {
        assert_eq!(encode(&record), data, "a dedup record does not re-encode to its bytes");
    }
    let _ = decode::<CounterMeta>("fuzz", data);
    let _ = decode::<Vec<(u32, u16)>>("fuzz", data);
    let _ = decode::<CountMin>("fuzz", data);
    if let Ok(sketch) = DistinctSketch::from_bytes(data) {
        let _ = sketch.estimate();
    }
});
