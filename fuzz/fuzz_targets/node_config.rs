//! Node configs: any text is parsed and validated to a config or a clear error.
#![no_main]

use libfuzzer_sys::fuzz_target;
use tally_server::config::Config;

fuzz_target!(|data: &[u8]| {
    if let Ok(text) = std::str::from_utf8(data) {
        if let Ok(config) = Config::from_toml(text) {
            let _ = config.cluster.fingerprint();
            let _ = config.tally_config();
        }
    }
});
