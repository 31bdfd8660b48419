//! The CPU AdamW engine: the update kernel (scalar reference + SIMD) and per-node worker pools.

pub mod adamw;
pub mod moments;
pub mod pool;

pub use adamw::{AdamWConfig, StepScalars};
pub use moments::Salts;
pub use pool::{piece_segments, unit_segments, AdamJob, AdamPool, Segment};
