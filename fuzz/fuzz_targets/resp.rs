//! What a Redis client sends: RESP frames and inline commands as the RESP listener's
//! read loop takes them off its buffer (`resp::wire::next_request_spans`, a
//! pipeline of them), then the arguments parsed into commands
//! (`resp::command::parse_named`).
//!
//! Two sets of limits: the defaults of `[resp]`, and small ones the fuzzer reaches
//! (a bulk string or an array just over them is refused before it is buffered).
#![no_main]

use libfuzzer_sys::fuzz_target;
use tally_server::config::RespConfig;
use tally_server::resp::wire::{next_request_spans, WireLimits, INLINE_BYTES_MAX};
use tally_server::resp::{command, PIPELINE_COMMANDS_MAX};

/// Small limits, within reach of short inputs.
const SMALL: WireLimits = WireLimits { request_bytes_max: 64, args_max: 4, arg_bytes_max: 32 };

fn pipeline(data: &[u8], limits: &WireLimits) {
    let mut buf = data;
    for _ in 0..PIPELINE_COMMANDS_MAX {
        let mut spans = Vec::new();
        match next_request_spans(buf, limits, &mut spans) {
            Ok(Some(used)) => {
                assert!(used > 0 && used <= buf.len(), "a request takes 1..=len bytes");
                assert!(spans.len() <= INLINE_BYTES_MAX, "an inline line holds fewer words than bytes");
                assert!(spans.iter().all(|s| s.start <= s.end && s.end <= used), "arguments lie in the request");
                let args: Vec<&[u8]> = spans.iter().map(|s| &buf[s.clone()]).collect();
                let bytes: usize = args.iter().map(|a| a.len()).sum();
                assert!(bytes <= used, "arguments come from the request's bytes");
                if buf[0] == b'*' {
                    assert!(args.len() <= limits.args_max, "an array within resp.args_max");
                    assert!(args.iter().all(|a| a.len() <= limits.request_bytes_max));
                }
                if !args.is_empty() {
                    let _ = command::parse_named(&args);
                }
                buf = &buf[used..];
            }
            Ok(None) | Err(_) => return,
        }
    }
}

fuzz_target!(|data: &[u8]| {
    let defaults = RespConfig::default();
    let limits = WireLimits {
        request_bytes_max: defaults.request_limit_bytes(),
        args_max: defaults.args_limit(),
        arg_bytes_max: defaults.arg_limit_bytes(),
    };
    pipeline(data, &limits);
    pipeline(data, &SMALL);
});
