//! mosaickv-conformance: filled in by later work.
