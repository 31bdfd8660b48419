//! A cuBLAS handle as megatrain uses one: on one stream, with its math mode, and with an explicit
//! workspace of its own ([`WORKSPACE_BYTES`]). cuBLAS otherwise takes its workspace from a pool
//! it manages itself; NVIDIA's bit-for-bit reproducibility guarantee is stated for a handle used
//! from one stream with a workspace that is not shared — what this gives every GEMM of a run.

use super::runtime::drv;
use crate::{Error, Result};
use cudarc::cublas::sys::cublasMath_t;
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;

/// The workspace each handle gets: 32 MiB, what NVIDIA recommends for Hopper
/// (`CUBLAS_WORKSPACE_CONFIG=:4096:8`, as PyTorch sets it there).
pub const WORKSPACE_BYTES: usize = 32 << 20;

/// A cuBLAS handle on one stream with its own workspace (dropped after the handle).
#[derive(Debug)]
pub struct Blas {
    /// The handle (declared first: dropped, and so destroyed, before the workspace is freed).
    blas: CudaBlas,
    /// Held for the handle's life: cuBLAS uses it through the pointer it was given.
    _workspace: CudaSlice<u8>,
}

impl Blas {
    /// A handle on `stream`, in TF32 tensor-core math for fp32 GEMMs when `tf32`, with a
    /// [`WORKSPACE_BYTES`] workspace.
    pub fn new(stream: &Arc<CudaStream>, tf32: bool) -> Result<Blas> {
        let handle =
            CudaBlas::new(stream.clone()).map_err(|e| Error::cuda("create a cuBLAS handle", e))?;
        let mode = if tf32 {
            cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH
        } else {
            cublasMath_t::CUBLAS_DEFAULT_MATH
        };
        // SAFETY: a valid handle owned by `handle`.
        let r = unsafe { cudarc::cublas::sys::cublasSetMathMode(*handle.handle(), mode) };
        r.result()
            .map_err(|e| Error::cuda("set the cuBLAS math mode", e))?;
        // SAFETY: cuBLAS only writes the workspace before reading it; no one else uses it.
        let workspace = drv(
            unsafe { stream.alloc::<u8>(WORKSPACE_BYTES) },
            "allocate the cuBLAS workspace",
        )?;
        {
            let (ptr, _sync) = workspace.device_ptr(stream);
            // SAFETY: a device allocation of WORKSPACE_BYTES (256-byte aligned, as every
            // allocation is), used by this handle alone on its stream, and freed only after
            // the handle is destroyed (field order).
            let r = unsafe {
                cudarc::cublas::sys::cublasSetWorkspace_v2(
                    *handle.handle(),
                    ptr as *mut std::ffi::c_void,
                    WORKSPACE_BYTES,
                )
            };
            r.result()
                .map_err(|e| Error::cuda("give cuBLAS its workspace", e))?;
        }
        Ok(Blas {
            blas: handle,
            _workspace: workspace,
        })
    }

    /// The raw handle, for cuBLAS calls.
    pub fn handle(&self) -> &cudarc::cublas::sys::cublasHandle_t {
        self.blas.handle()
    }

    /// cudarc's handle, for its safe GEMM API.
    pub fn cudarc(&self) -> &CudaBlas {
        &self.blas
    }
}
