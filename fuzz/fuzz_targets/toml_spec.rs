//! TOML model specs: `from_toml_spec`, then the inventory at token counts
//! from 0 to `u64::MAX` in every format (see `kvwire_fuzz::exercise_model`).
#![no_main]

use kvwire_core::layout::from_toml_spec;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Ok(text) = std::str::from_utf8(data) else {
        return;
    };
    if let Ok(model) = from_toml_spec("fuzz", text) {
        kvwire_fuzz::exercise_model(&model);
    }
});
