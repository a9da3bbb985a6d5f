//! Fuzzes the cache file reader (SPEC.md section 15): any input must give
//! `Ok` or an error, never a panic, and whatever loads must save and load back
//! to the same bytes.
#![no_main]

use libfuzzer_sys::fuzz_target;
use mosaickv_spec::persist::{read_cache, read_dense, write_cache};

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
});
