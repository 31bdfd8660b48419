//! The device on one NVIDIA GPU (feature `cuda`): the runtime (driver checks, context, kernels
//! compiled by NVRTC and loaded up front), page-locked memory as owning types, one typed launch
//! wrapper per kernel, the device program's CUDA backend (those kernels and cuBLAS), and the
//! streaming [`CudaDevice`].
//!
//! libcuda, NVRTC and cuBLAS are loaded at run time (cudarc dynamic loading): a binary built
//! with the feature runs, and says why, on machines without them.

mod backend;
pub mod binding;
pub mod blas;
mod device;
pub mod kernel_cache;
pub mod launches;
pub mod nccl;
pub mod nvrtc;
pub mod pinned;
pub mod runtime;
pub mod world;

pub use backend::{CudaBackend, DevP};
pub use device::{CudaDevice, CudaDeviceConfig, RESERVE_BYTES};
pub use runtime::{drv, CudaRuntime, DevPtr, MIN_DRIVER, TIMED};
