//! `--backend`: which implementation `compress` and `attend` run.

/// The implementation behind `compress` and `attend`.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, clap::ValueEnum)]
pub enum Backend {
    /// `mosaickv-optimized`: SIMD kernels, f32 attention on all cores (the default).
    #[default]
    Optimized,
    /// `mosaickv-reference`: the scalar f64 oracle of SPEC.md, for checking the other.
    Reference,
}

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Optimized => "optimized",
            Backend::Reference => "reference",
        }
    }
}
