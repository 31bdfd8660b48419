//! megatrain: full-precision LLM training on one GPU with the whole training state in host memory.
//!
//! See `docs/ARCHITECTURE.md` for the module map and the data flow of a training step.
#![deny(unsafe_op_in_unsafe_fn)]
#![cfg_attr(test, allow(clippy::unwrap_used))]

pub mod bench;
pub mod device;
pub mod dist;
pub mod engine;
pub mod error;
pub mod host;
pub mod model;
pub mod optim;
pub mod plan;
pub mod selftest;
pub mod spill;
pub mod store;
pub mod topology;
pub mod train;
pub mod util;

pub use error::{Error, Result};
