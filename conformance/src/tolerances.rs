//! Every floating-point tolerance of the conformance suite, in one place
//! (STYLE.md convention 4). Bit layouts, rotated queries, block scores and
//! selections (SPEC.md sections 6 and 8: exact by construction) are compared
//! bit for bit and have no entry here.
//!
//! The reference computes in f64 (SPEC.md sections 8-9); optimized backends
//! accumulate in f32. f32 has a unit roundoff of u = 2^-24 ~ 6e-8; a dot
//! product of length D accumulates at most ~D*u relative error in the worst
//! case and ~sqrt(D)*u typically. Bounds below are the worst case for the
//! largest head_dim we test (256), with a 4x margin, unless stated.

/// Attention output (SPEC 9), relative L2 against the reference's f64
/// output, for a given selection. Errors: the f32 logits (a length-Dt dot
/// product, up to ~6e-5 relative at Dt = 256, entering the softmax weights
/// multiplicatively through exp; the reference uses the unrounded f64 rotated
/// query), f32 online-softmax rescaling (a few u per merge), the value
/// back-rotation (another length-D dot product). Logits here are O(1-10), so
/// a 6e-5 relative logit error moves weights by up to ~6e-4 relative: 1e-3.
pub const ATTEND_REL_L2: f64 = 1e-3;

/// Rotation from the fit stage (SPEC 3), max abs entry difference per
/// column, compared only for columns whose eigenvalue is separated from its
/// neighbours by >= 1e-3 of the largest (other columns are not well defined):
/// covariance summation order differs between backends (f64, relative
/// ~1e-13), an eigenvector moves by about error / gap = 1e-13 / 1e-3 = 1e-10,
/// then f32 storage rounding adds up to 6e-8.
pub const ROTATION_ABS: f64 = 1e-6;

/// Fit loss (SPEC 11.1), absolute: a ratio of f64 sums, plus the rotation
/// difference above entering squared terms: 1e-9.
pub const FIT_LOSS_ABS: f64 = 1e-9;
