//! Fuzzes the cache and baseline file readers (SPEC.md section 15): any input must give
//! `Ok` or an error, never a panic, and whatever loads must save and load back
//! to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mosaickv_spec::persist::{read_cache, read_dense, write_cache};
use mosaickv_spec::persist_baseline::{read_baseline, write_baseline};

fuzz_target!(|data: &[u8]| {
    if let Ok((cache, keys, values)) = read_cache(data) {
        let mut first = Vec::new();
        write_cache(&mut first, &cache, &keys, &values).expect("a loaded cache saves");
        let (c2, k2, v2) = read_cache(&first).expect("a saved cache loads");
        let mut second = Vec::new();
        write_cache(&mut second, &c2, &k2, &v2).expect("saves again");
        assert_eq!(first, second);
    }
    let _ = read_dense(data);
    // The baseline files (SPEC.md sections 15.5-15.6): the same promise.
    if let Ok(file) = read_baseline(data) {
        let mut first = Vec::new();
        write_baseline(&mut first, &file).expect("a loaded baseline file saves");
        assert_eq!(read_baseline(&first).expect("a saved baseline file loads"), file);
    }
});
