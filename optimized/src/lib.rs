//! mosaickv-optimized: filled in by later work.
