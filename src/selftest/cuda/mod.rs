//! `megatrain selftest --device cuda`: every kernel and GEMM on fresh random inputs against the
//! CPU reference ([`kernels`]), a few training steps on the CUDA device against the CPU device,
//! and the page-locked link.

mod kernels;
mod moe;

pub use kernels::kernels;
pub use moe::{moe_ops, TOL_MOE_BF16};

use super::{
    compare_runs, small_gpt_oss_model, small_model, small_moe_model, train_steps, Check,
    GradMetric, BATCH, SEQ,
};
use crate::device::cuda::pinned::PageLock;
use crate::device::cuda::{drv, CudaDevice, CudaDeviceConfig, CudaRuntime};
use crate::device::Precision;
use crate::Result;
use std::sync::Arc;

/// Tolerance of the training check: fp32 on both sides, differing only in summation order
/// (cuBLAS) compounded over a few steps.
pub const TOL_TRAINING: f64 = 1e-3;
/// Tolerance of the bf16 training check (losses and norms per step; gradients norm-wise). Both
/// devices round at the same points (docs/precision.md), but a sum in another order lands an
/// operand on the other side of a bf16 rounding now and then, and a flipped rounding (2⁻⁸ of the
/// value) is carried into everything after it.
pub const TOL_TRAINING_BF16: f64 = 1e-2;
/// Tolerance of the bf16 training check of the mixture-of-experts models. A flipped rounding
/// upstream of a router can send a token to another expert (a top-k near-tie), which changes
/// that token's whole MLP output: on the emulated GPU the first step's routing differed by one
/// token's choice in one layer of each model (the CPU's and the GPU's expert loads), and the
/// step-1 gradients by 1.3–3.3% norm-wise where the dense model's differ by 0.3–0.5%. The op
/// itself is checked alone to 10⁻⁴ ([`TOL_MOE_BF16`], the same routing on both).
pub const TOL_TRAINING_MOE_BF16: f64 = 5e-2;

/// The training check: [`super::STEPS`] steps of the self-test model on GPU `ordinal` against
/// the same steps on the CPU device, in fp32 and in bf16 (the tensor-core attention, the bf16
/// GEMMs, the bf16 weight stream); then the mixture-of-experts models (Qwen3-MoE, GPT-OSS) in
/// both.
pub fn training(ordinal: usize, seed: u64) -> Result<Vec<Check>> {
    let mut checks = Vec::new();
    for precision in [Precision::Fp32, Precision::Bf16] {
        for cfg in [small_model()?, small_moe_model()?, small_gpt_oss_model()?] {
            checks.extend(training_at(cfg, ordinal, seed, precision)?);
        }
    }
    Ok(checks)
}

fn training_at(
    cfg: crate::model::config::ModelConfig,
    ordinal: usize,
    seed: u64,
    precision: Precision,
) -> Result<Vec<Check>> {
    let moe = cfg.moe.is_some();
    let name = match (&cfg.moe, cfg.attention_sinks, precision) {
        (None, _, Precision::Fp32) => "training",
        (None, _, Precision::Bf16) => "training bf16",
        (Some(_), false, Precision::Fp32) => "training moe",
        (Some(_), false, Precision::Bf16) => "training moe bf16",
        (Some(_), true, Precision::Fp32) => "training gpt-oss",
        (Some(_), true, Precision::Bf16) => "training gpt-oss bf16",
    };
    let tm = Arc::new(crate::model::reference::Templates::new(&cfg, SEQ)?);
    let machine = crate::topology::probe(&crate::topology::TopologySource::Live)?;
    let cpu = Arc::new(crate::device::cpu::CpuDevice::new(
        crate::device::cpu::CpuDeviceConfig {
            capacity_bytes: 1 << 30,
            link: None,
            jitter: None,
            shape: crate::device::program::Shape::whole(BATCH, SEQ),
            precision,
        },
        tm.clone(),
    )?);
    let want = train_steps(&machine, cpu, tm.clone(), seed)?;
    let gpu = Arc::new(CudaDevice::open(
        CudaDeviceConfig {
            ordinal,
            // Token chunks of 256 and 44 tokens (queries 256..300 over all 300 keys): the
            // chunked program against the CPU's whole one.
            shape: crate::device::program::Shape::chunked(BATCH, SEQ, 256)?,
            reserve_bytes: 0,
            capacity_bytes: None,
            shared_by: 1,
            tf32: false,
            precision,
            ranks: None,
        },
        tm.clone(),
    )?);
    let got = train_steps(&machine, gpu, tm, seed)?;
    Ok(match precision {
        Precision::Fp32 => compare_runs(name, &got, &want, TOL_TRAINING, GradMetric::Elementwise),
        Precision::Bf16 => {
            let tol = match moe {
                true => TOL_TRAINING_MOE_BF16,
                false => TOL_TRAINING_BF16,
            };
            compare_runs(name, &got, &want, tol, GradMetric::Norm)
        }
    })
}

/// The CUDA device's device→host copies ([`super::landings`]) over a unit of one bounce chunk
/// and a bit, so the two bounce chunks take turns and the last is partial.
pub fn landings(ordinal: usize, seed: u64) -> Result<Vec<Check>> {
    use crate::device::BOUNCE_CHUNK_ELEMS;
    // The embedding is the largest unit, and the bf16 gradient staging holds one chunk of it.
    let mut cfg = small_model()?;
    cfg.vocab_size = BOUNCE_CHUNK_ELEMS / cfg.hidden_size + 200;
    let n = cfg.vocab_size * cfg.hidden_size;
    let tm = Arc::new(crate::model::reference::Templates::new(&cfg, SEQ)?);
    let gpu = CudaDevice::open(
        CudaDeviceConfig {
            ordinal,
            shape: crate::device::program::Shape::whole(BATCH, SEQ),
            reserve_bytes: 0,
            capacity_bytes: None,
            shared_by: 1,
            tf32: false,
            precision: Precision::Bf16,
            ranks: None,
        },
        tm,
    )?;
    super::landings(&gpu, n, seed)
}

/// Host→device and device→host GB/s of a 256 MiB copy from page-locked host memory, median of
/// 5, timed with events.
pub fn link(rt: &CudaRuntime) -> Result<(f64, f64)> {
    let n = 64usize << 20; // f32 elements: 256 MiB
    let host = crate::host::Region::allocate(crate::host::RegionSpec::scratch(
        "selftest pinned buffer",
        n * 4,
    ))?;
    let _locked = PageLock::region(&rt.ctx, &host)?;
    // SAFETY: the region holds n f32 and is page-locked while `_locked` lives.
    let hs = unsafe { std::slice::from_raw_parts_mut(host.as_ptr().cast::<f32>(), n) };
    let mut dev = drv(rt.stream.alloc_zeros::<f32>(n), "allocate 256 MiB")?;
    let gbps = |ms: f64| (n * 4) as f64 / (ms * 1e-3) / 1e9;
    let htod = rt.time_ms(None, 5, &mut || {
        drv(rt.stream.memcpy_htod(&*hs, &mut dev), "copy host to device")
    })?;
    let dtoh = rt.time_ms(None, 5, &mut || {
        drv(rt.stream.memcpy_dtoh(&dev, &mut *hs), "copy device to host")
    })?;
    Ok((gbps(htod), gbps(dtoh)))
}
