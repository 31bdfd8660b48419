//! Llama-family models: configuration, the units the parameters are packed in, the CPU kernels
//! (the reference), the stateless layer templates and the resident reference step.

pub mod config;
pub mod layers;
pub mod ops;
pub mod reference;
pub mod units;
