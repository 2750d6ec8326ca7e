//! The daemon's TOML config: `Config::from_toml`, then `validate`.
#![no_main]

use kvwired::config::Config;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    let Ok(config) = Config::from_toml("fuzz.toml", text) else {
        return;
    };
    if config.validate().is_ok() {
        // What validate promises: a usable node name and at most 200 slots.
        assert!(!config.node.is_empty() && config.node.len() <= 64);
        assert!((1..=200).contains(&config.limits.max_inflight_transfers));
        assert!(config.control_socket.as_os_str().len() <= 100);
    }
});
