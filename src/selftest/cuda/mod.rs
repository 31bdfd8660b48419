//! `megatrain selftest --device cuda`: every kernel and GEMM on fresh random inputs against the
//! CPU reference ([`kernels`]), a few training steps on the CUDA device against the CPU device,
//! and the page-locked link.

mod kernels;

pub use kernels::kernels;

use super::{compare_runs, small_model, train_steps, Check, GradMetric, BATCH, SEQ};
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

/// The training check: [`super::STEPS`] steps of the self-test model on GPU `ordinal` against
/// the same steps on the CPU device, in fp32 and in bf16 (the tensor-core attention, the bf16
/// GEMMs, the bf16 weight stream).
pub fn training(ordinal: usize, seed: u64) -> Result<Vec<Check>> {
    let mut checks = training_at(ordinal, seed, Precision::Fp32)?;
    checks.extend(training_at(ordinal, seed, Precision::Bf16)?);
    Ok(checks)
}

fn training_at(ordinal: usize, seed: u64, precision: Precision) -> Result<Vec<Check>> {
    let cfg = small_model()?;
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
            tf32: false,
            precision,
        },
        tm.clone(),
    )?);
    let got = train_steps(&machine, gpu, tm, seed)?;
    Ok(match precision {
        Precision::Fp32 => compare_runs(
            "training",
            &got,
            &want,
            TOL_TRAINING,
            GradMetric::Elementwise,
        ),
        Precision::Bf16 => compare_runs(
            "training bf16",
            &got,
            &want,
            TOL_TRAINING_BF16,
            GradMetric::Norm,
        ),
    })
}

/// The CUDA device's device→host copies against what they must land, bit for bit: plain,
/// accumulated (`+=`), and bf16 gradients (`=` and `+=`: rounded to nearest even on the device,
/// widened on the host), over a unit of one bounce chunk and a bit, so the two bounce chunks
/// take turns and the last is partial.
pub fn landings(ordinal: usize, seed: u64) -> Result<Vec<Check>> {
    use crate::device::{Cmd, Device, Event, GradLink, HostRef, StreamKind, BOUNCE_CHUNK_ELEMS};
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
            tf32: false,
            precision: Precision::Bf16,
        },
        tm,
    )?;
    // Gradient-like values, every 5th an exact tie between two bf16 values (low half 0x8000,
    // odd and even high halves alike), and a base to accumulate onto.
    let mut state = seed ^ 0x5eed_1a4d;
    let mut next = || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((state >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 0.02
    };
    let values: Vec<f32> = (0..n)
        .map(|i| {
            let v = next();
            if i % 5 == 0 {
                f32::from_bits((v.to_bits() & 0xffff_0000) | 0x8000)
            } else {
                v
            }
        })
        .collect();
    let base: Vec<f32> = (0..n).map(|_| next()).collect();
    let mut src = values.clone();
    let buf = gpu.alloc(n, "selftest landings")?;
    let cases = [
        ("fp32 copy", false, GradLink::Fp32),
        ("fp32 accumulated", true, GradLink::Fp32),
        ("bf16 gradients", false, GradLink::Bf16),
        ("bf16 gradients accumulated", true, GradLink::Bf16),
    ];
    let mut outs: Vec<Vec<f32>> = cases.iter().map(|_| base.clone()).collect();
    let (copied, landed) = (Event::new(), Event::new());
    // SAFETY: `src` and `outs` outlive the copies: `landed` is waited on below, before either
    // is read or dropped, and nothing else touches them meanwhile.
    let source = unsafe { HostRef::from_slice(&mut src) };
    gpu.submit(
        StreamKind::CopyIn,
        Cmd::HtoD {
            dst: buf,
            offset: 0,
            src: source,
            label: "values".into(),
        },
    );
    gpu.submit(StreamKind::CopyIn, Cmd::Record(copied.clone()));
    gpu.submit(StreamKind::CopyOut, Cmd::Wait(copied));
    for ((name, accumulate, link), out) in cases.iter().zip(outs.iter_mut()) {
        gpu.submit(
            StreamKind::CopyOut,
            Cmd::DtoH {
                // SAFETY: as above.
                dst: unsafe { HostRef::from_slice(out) },
                src: buf,
                offset: 0,
                accumulate: *accumulate,
                link: *link,
                label: (*name).into(),
            },
        );
    }
    gpu.submit(StreamKind::CopyOut, Cmd::Record(landed.clone()));
    landed.synchronize();
    gpu.synchronize();
    if let Some(e) = gpu.take_error() {
        return Err(e);
    }
    gpu.free(buf);
    let crossed = |v: f32, link: GradLink| match link {
        GradLink::Fp32 => v,
        GradLink::Bf16 => crate::device::host_backend::bf16_value(v),
    };
    Ok(cases
        .iter()
        .zip(&outs)
        .map(|((name, accumulate, link), got)| {
            let want: Vec<f32> = values
                .iter()
                .zip(&base)
                .map(|(v, b)| {
                    let v = crossed(*v, *link);
                    if *accumulate {
                        b + v
                    } else {
                        v
                    }
                })
                .collect();
            let mut c =
                super::compare(&format!("device→host: {name} (bit-exact)"), got, &want, 0.0);
            c.pass = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            c
        })
        .collect())
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
