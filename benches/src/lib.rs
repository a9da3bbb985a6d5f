//! mosaickv-benches: filled in by later work.
