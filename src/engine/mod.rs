//! The streaming engine: the step schedule (a pure plan), the streamer that runs it on a device,
//! and the timeline it records.

pub mod schedule;
pub mod streamer;
pub mod trace;

pub use schedule::Checkpoints;
pub use streamer::{device_bytes, MicroBatch, StepMetrics, Streamer, StreamerConfig};
