//! The streaming engine: the step schedule (pure), the streamer that runs it on a device, and
//! the timeline it records.

pub mod metrics;
pub mod schedule;
pub mod streamer;
pub mod trace;

pub use metrics::{LayerLoad, StepMetrics};
pub use schedule::{ActivationDtype, Activations};
pub use streamer::{clip_coef, device_bytes, HostMemory, MicroBatch, Streamer, StreamerConfig};
