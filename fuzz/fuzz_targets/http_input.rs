//! What an HTTP client sends: the JSON bodies of every endpoint that takes one
//! (parsed as the handlers parse them, then validated), the batch-size pre-check,
//! and counter names as they arrive in paths.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tally_core::name::CounterName;
use tally_server::http::body::{batch_len, BatchBody, IncrementBody, ReconcileBody, SpecBody};

fuzz_target!(|data: &[u8]| {
    if let Ok(body) = serde_json::from_slice::<IncrementBody>(data) {
        let _ = body.into_increment();
    }
    if let Ok(body) = serde_json::from_slice::<BatchBody>(data) {
        let _ = body.into_items();
    }
    let _ = batch_len(data);
    if let Ok(body) = serde_json::from_slice::<ReconcileBody>(data) {
        let _ = body.authoritative();
    }
    if let Ok(body) = serde_json::from_slice::<SpecBody>(data) {
        let _ = body.into_patch();
    }
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(name) = CounterName::new(text) {
            assert_eq!(name.as_str(), text);
            assert!(text.len() <= tally_core::name::NAME_LEN_MAX);
        }
    }
});
