//! # mosaickv-reference: the readable oracle of SPEC.md
//!
//! One module per step of `spec/SPEC.md`, one plain function per step, each
//! doc comment naming its section. Arithmetic is f64 wherever SPEC.md says
//! "reference: f64"; storage is f16 exactly as the contract says. Nothing
//! here is tuned for speed beyond avoiding needless asymptotic waste: this
//! crate is what every other backend is checked against.
//!
//! | module | SPEC.md |
//! |---|---|
//! | [`round`] | notation: f64 -> f16 round-to-nearest-even |
//! | [`rotation`] | 3 (rotation fit) |
//! | [`topr`] | 4 (truncation), 5 (per-vector top-r) |
//! | [`packed`] | 6 (record encode / decode) |
//! | [`meta`] | 7 (block metadata) |
//! | [`checks`] | 6, 7, 14, 15.4 (structural checks of a cache and a selection before they are read) |
//! | [`select`] | 8 (rotated query, block score, top-k under a token budget) |
//! | [`attention`] | 9 (PackedAttention) |
//! | [`lifecycle`] | 10 (segments, update buffer, close rule) |
//! | [`strategy`] | 11 (loss, (r, g), block size) |
//! | [`loss`] | 11.1 (attention loss) |
//! | [`baselines`] | 12 (Full, Quest, naive 2-D) |
//! | [`metrics`] (re-exported from `mosaickv-spec`) | 16 (relative L2, recall@k) |
//! | [`turboquant`] | 12 (vLLM's TurboQuant) |
//! | [`synthetic`] | test data with realistic structure (not normative) |

pub mod attention;
pub mod backend;
pub mod baselines;
pub mod checks;
pub mod lifecycle;
pub mod loss;
pub mod meta;
pub use mosaickv_spec::metrics;
pub mod packed;
pub mod rotation;
pub mod round;
pub mod select;
pub mod strategy;
pub mod synthetic;
pub mod topr;
pub mod turboquant;

pub use backend::ReferenceBackend;
pub use baselines::{FullCache, Naive2dCache, QuestCache};
pub use lifecycle::MosaicCache;
pub use rotation::fit_rotation_f64;
pub use strategy::side_loss;
