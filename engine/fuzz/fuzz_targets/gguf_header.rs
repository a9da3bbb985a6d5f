//! Fuzzes the GGUF header reader (`mosaickv_engine::gguf`, issue 13 item 6): any input must
//! give `Ok` or a typed error, never a panic, an abort or an allocation sized by the input
//! (libFuzzer's malloc limit reports one). Whatever it accepts goes on through the rest of what
//! `Model::load` does with a header: the configuration check, the tokenizer, and candle's read
//! and dequantization of every tensor.
#![no_main]

use candle_core::Device;
use libfuzzer_sys::fuzz_target;
use mosaickv_engine::gguf::read_content_from_bytes;
use mosaickv_engine::{Config, Tok};

fuzz_target!(|data: &[u8]| {
    let Ok(content) = read_content_from_bytes(data) else {
        return;
    };
    let _ = Config::from_gguf(&content);
    let _ = Tok::from_gguf(&content);
    let mut file = std::io::Cursor::new(data);
    for name in content.tensor_infos.keys() {
        if let Ok(t) = content.tensor(&mut file, name, &Device::Cpu) {
            let _ = t.dequantize(&Device::Cpu);
        }
    }
});
