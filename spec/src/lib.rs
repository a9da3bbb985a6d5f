//! mosaickv-spec: filled in by later work.
