//! Llama-family models: configuration (and, to come, the stateless layer templates).

pub mod config;
pub mod hf;
pub mod layers;
pub mod ops;
pub mod reference;
