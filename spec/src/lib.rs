//! # mosaickv-spec: the MosaicKV contract
//!
//! Shapes, the configuration, per-segment strategies, the packed byte layout,
//! the error enum and the traits every backend implements. The normative text
//! is `spec/SPEC.md`; section numbers in doc comments refer to it.

pub mod atomic;
pub mod cache;
pub mod check;
pub mod coded;
pub mod config;
pub mod error;
pub mod kvq;
pub mod layout;
pub mod method;
pub mod metrics;
pub mod persist;
pub mod persist_baseline;
pub mod query;
pub mod rules;
pub mod traits;
pub mod turboquant;
pub mod validate;

pub use cache::{CompressedCache, DenseRows, HeadSegment, MemoryReport, Segment, SegmentState};
pub use config::{ceil_to, ChannelPolicy, CompressConfig, KvShape, LossPolicy};
pub use error::{MosaicError, Result};
pub use half::f16;
pub use kvq::KvqFormat;
pub use layout::{
    meta_quant_max, meta_quant_min, meta_scale, BlockMeta, PackedRows, RecordLayout, SideStrategy,
    Strategy, ValueDtype,
};
pub use method::{Implementation, Method};
pub use query::QueryStats;
pub use traits::{Availability, Backend, KvCache, Selection, Side};
