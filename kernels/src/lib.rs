//! mosaickv-kernels: filled in by later work.
