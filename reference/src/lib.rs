//! mosaickv-reference: filled in by later work.
