//! `megatrain bench kernels` (feature `cuda`): the GEMMs of one transformer layer (cuBLAS, fp32
//! and bf16 with fp32 accumulation) and the attention kernels (the fp32 SIMT kernels and the
//! tensor-core ones), in TFLOP/s per shape next to the GPU's datasheet peak — llm.c's `dev/cuda`
//! sweeps for this project's kernels. Under the CUDA emulator (`tools/cuemu.sh`) every time is
//! host time: the report says so, and the numbers are not GPU figures.

use super::kernel_report::{KernelReport, KernelRow};
use crate::device::cuda::launches::{AttnArgs, Dtype, Launcher};
use crate::device::cuda::{drv, CudaRuntime};
use crate::device::launch::{self, AttnShape};
use crate::{Error, Result};
use cudarc::cublas::sys::{
    cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t as Op, cudaDataType_t,
};
use cudarc::driver::{CudaSlice, DevicePtr};

/// What to measure.
#[derive(Debug, Clone)]
pub struct KernelBenchArgs {
    /// GPU ordinal.
    pub ordinal: usize,
    /// Tokens per GEMM (rows of the activations).
    pub tokens: usize,
    /// Hidden size.
    pub hidden: usize,
    /// MLP intermediate size.
    pub ffn: usize,
    /// Query heads, key/value heads, head dim of the attention cases.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Sequence lengths of the attention cases (one sequence each).
    pub seqs: Vec<usize>,
    /// Timed repetitions per case (median).
    pub reps: usize,
}

/// Run every case.
pub fn run(a: &KernelBenchArgs) -> Result<KernelReport> {
    use super::check_count;
    check_count("--reps", a.reps, 1, super::MAX_REPS)?;
    for (flag, v) in [
        ("--tokens", a.tokens),
        ("--hidden", a.hidden),
        ("--ffn", a.ffn),
        ("--heads", a.heads),
        ("--kv-heads", a.kv_heads),
        ("--head-dim", a.head_dim),
    ] {
        check_count(flag, v, 1, 1 << 20)?;
    }
    for &t in &a.seqs {
        check_count("--seq", t, 1, 1 << 24)?;
    }
    if !a.heads.is_multiple_of(a.kv_heads) {
        return Err(crate::Error::bad_input(
            "--heads",
            a.heads.to_string(),
            format!("is not a multiple of --kv-heads {}", a.kv_heads),
            None,
        ));
    }
    let rt = CudaRuntime::open(a.ordinal)?;
    let peaks = crate::plan::gpu_peaks(&rt.name);
    let mut rows = Vec::new();
    let m = a.tokens;
    let kv = a.kv_heads * a.head_dim;
    let gemms = [
        ("qkv", a.hidden, a.hidden + 2 * kv),
        ("attention out", a.hidden, a.hidden),
        ("gate+up", a.hidden, 2 * a.ffn),
        ("down", a.ffn, a.hidden),
    ];
    let blas = crate::device::cuda::blas::Blas::new(&rt.stream, false)?;
    for (name, k, n) in gemms {
        for bf16 in [false, true] {
            let ms = time_gemm(&rt, &blas, m, k, n, bf16, a.reps)?;
            let flops = 2.0 * (m * k * n) as f64;
            rows.push(row(
                if bf16 {
                    "gemm bf16 (fp32 accumulate)"
                } else {
                    "gemm fp32"
                },
                format!("{name}: [{m}, {k}] · [{k}, {n}]"),
                flops,
                ms,
                peaks.map(|(f32_peak, bf16_peak)| if bf16 { bf16_peak } else { f32_peak }),
            ));
        }
    }
    for &t in &a.seqs {
        let s = AttnShape::causal(1, t, a.heads, a.kv_heads, a.head_dim);
        // Causal: half of the T×T scores, 2 GEMMs forward (QKᵀ, PV), 5 backward (FA2's count).
        let fwd = 2.0 * 2.0 * (t * t / 2 * a.heads * a.head_dim) as f64;
        let shape = format!(
            "T {t}, {} heads ({} kv), hd {}",
            a.heads, a.kv_heads, a.head_dim
        );
        let (simt_fwd, flash) = time_attention(&rt, s, a.reps)?;
        rows.push(row(
            "attention fwd (fp32 SIMT)",
            shape.clone(),
            fwd,
            simt_fwd,
            peaks.map(|p| p.0),
        ));
        if let Some((f, fb)) = flash {
            let peak = peaks.map(|p| p.1);
            rows.push(row(
                "attention fwd (tensor cores)",
                shape.clone(),
                fwd,
                f,
                peak,
            ));
            rows.push(row(
                "attention fwd+bwd (tensor cores)",
                shape.clone(),
                3.5 * fwd,
                fb,
                peak,
            ));
        }
    }
    Ok(KernelReport {
        device: rt.name.clone(),
        emulated: rt.emulated(),
        rows,
    })
}

fn row(kernel: &str, shape: String, flops: f64, ms: f64, peak: Option<f64>) -> KernelRow {
    KernelRow {
        kernel: kernel.to_owned(),
        shape,
        flops,
        ms,
        tflops: flops / (ms * 1e-3) / 1e12,
        peak_tflops: peak,
    }
}

fn zeros<T: cudarc::driver::DeviceRepr + cudarc::driver::ValidAsZeroBits>(
    rt: &CudaRuntime,
    n: usize,
) -> Result<CudaSlice<T>> {
    drv(
        rt.stream.alloc_zeros::<T>(n.max(1)),
        "allocate device memory",
    )
}

fn ptr<T>(rt: &CudaRuntime, s: &CudaSlice<T>) -> u64 {
    s.device_ptr(&rt.stream).0
}

fn int(v: usize, what: &str) -> Result<i32> {
    crate::device::cuda::launches::i32_of(v, what)
}

/// y [M, N] = x [M, K] · wᵀ (w [N, K]), the layers' GEMM, in fp32 or bf16 inputs with fp32
/// accumulation and output.
fn time_gemm(
    rt: &CudaRuntime,
    blas: &crate::device::cuda::blas::Blas,
    m: usize,
    k: usize,
    n: usize,
    bf16: bool,
    reps: usize,
) -> Result<f64> {
    let (mi, ki, ni) = (
        int(m, "tokens")?,
        int(k, "GEMM depth")?,
        int(n, "GEMM width")?,
    );
    let input = if bf16 {
        cudaDataType_t::CUDA_R_16BF
    } else {
        cudaDataType_t::CUDA_R_32F
    };
    // Inputs as u16 or f32 buffers of the right byte size (contents do not change the time).
    let elem = if bf16 { 1 } else { 2 };
    let (x, w, y) = (
        zeros::<u16>(rt, m * k * elem)?,
        zeros::<u16>(rt, n * k * elem)?,
        zeros::<f32>(rt, m * n)?,
    );
    let (px, pw, py) = (ptr(rt, &x), ptr(rt, &w), ptr(rt, &y));
    let (alpha, beta) = (1.0f32, 0.0f32);
    rt.time_ms(None, reps, &mut || {
        // SAFETY: A = w [N, K], B = x [M, K], C = y [M, N] (column-major views of the row-major
        // tensors), each allocated above with those extents in the named type.
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *blas.handle(),
                Op::CUBLAS_OP_T,
                Op::CUBLAS_OP_N,
                ni,
                mi,
                ki,
                (&alpha as *const f32).cast(),
                pw as *const _,
                input,
                ki,
                px as *const _,
                input,
                ki,
                (&beta as *const f32).cast(),
                py as *mut _,
                cudaDataType_t::CUDA_R_32F,
                ni,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| Error::cuda("gemm_ex", e))
    })
}

/// Milliseconds of the fp32 SIMT forward, and (when the head dim has them) of the tensor-core
/// forward and forward + backward, over one sequence of random bf16 values (stored in fp32 for
/// the SIMT kernel, in bf16 for the tensor-core ones, as the recipes store them).
fn time_attention(
    rt: &CudaRuntime,
    s: AttnShape,
    reps: usize,
) -> Result<(f64, Option<(f64, f64)>)> {
    use crate::optim::adamw::{bf16_to_f32, f32_to_bf16};
    let (qn, kn, rows) = (s.t * s.nh * s.hd, s.t * s.nkv * s.hd, s.nh * s.t);
    let bits = |n: usize, seed: u64| -> Vec<u16> {
        crate::util::uniform(n, seed, 1.0)
            .iter()
            .map(|x| f32_to_bf16(*x))
            .collect()
    };
    let up32 = |b: &[u16]| -> Result<CudaSlice<f32>> {
        let v: Vec<f32> = b.iter().map(|x| bf16_to_f32(*x)).collect();
        drv(rt.stream.clone_htod(&v), "copy to the device")
    };
    let up16 = |b: &[u16]| drv(rt.stream.clone_htod(b), "copy to the device");
    let inputs = [bits(qn, 1), bits(kn, 2), bits(kn, 3), bits(qn, 4)];
    let [q32, k32, v32] = [&inputs[0], &inputs[1], &inputs[2]].map(|b| up32(b));
    let [q16, k16, v16, do16] = [&inputs[0], &inputs[1], &inputs[2], &inputs[3]].map(|b| up16(b));
    let (q32, k32, v32) = (q32?, k32?, v32?);
    let (q16, k16, v16, do16) = (q16?, k16?, v16?, do16?);
    let pos: Vec<u32> = (0..s.t as u32).collect();
    let pos = drv(rt.stream.clone_htod(&pos), "copy to the device")?;
    let (o, lse, delta, dq, dk, dv) = (
        zeros::<f32>(rt, qn)?,
        zeros::<f32>(rt, rows)?,
        zeros::<f32>(rt, rows)?,
        zeros::<f32>(rt, qn)?,
        zeros::<f32>(rt, kn)?,
        zeros::<f32>(rt, kn)?,
    );
    let o_buf = o;
    let [o, lse, delta, dq, dk, dv, q, k, v] =
        [&o_buf, &lse, &delta, &dq, &dk, &dv, &q32, &k32, &v32].map(|b| ptr(rt, b));
    let a = AttnArgs::new(s, ptr(rt, &pos))?;
    let kk = Launcher {
        rt,
        stream: &rt.stream,
    };
    let simt = launch::attention(s, launch::DEFAULT_SMEM)?;
    let simt_ms = rt.time_ms(None, reps, &mut || {
        kk.attention_fwd(Dtype::F32, &simt, o, lse, q, k, v, a)
    })?;
    let Some(g) = launch::flash(s)? else {
        return Ok((simt_ms, None));
    };
    let [q, k, v, d_o] = [&q16, &k16, &v16, &do16].map(|b| ptr(rt, b));
    let fwd = rt.time_ms(None, reps, &mut || kk.flash_fwd(&g, o, lse, q, k, v, a))?;
    let both = rt.time_ms(None, reps, &mut || {
        kk.flash_fwd(&g, o, lse, q, k, v, a)?;
        kk.flash_bwd(&g, dq, delta, d_o, o, q, k, v, lse, a)?;
        kk.flash_bwd_kv(&g, dk, dv, d_o, q, k, v, lse, delta, a)
    })?;
    check_first_rows(rt, s, &inputs, &o_buf)?;
    Ok((simt_ms, Some((fwd, both))))
}

/// A timing of misread inputs is no timing: the tensor-core forward's first query rows (at
/// most 16, in `o`) against the CPU attention of the same bf16 inputs (`[q, k, v, dO]`),
/// within the self-test's tolerance for these kernels, relative to the largest output.
fn check_first_rows(
    rt: &CudaRuntime,
    s: AttnShape,
    inputs: &[Vec<u16>; 4],
    o: &CudaSlice<f32>,
) -> Result<()> {
    use crate::optim::adamw::bf16_to_f32;
    let widen = |b: &[u16]| -> Vec<f32> { b.iter().map(|x| bf16_to_f32(*x)).collect() };
    let (rows, width) = (s.t.min(16), s.nh * s.hd);
    let q = widen(&inputs[0][..rows * width]);
    let (k, v) = (widen(&inputs[1]), widen(&inputs[2]));
    let pos: Vec<u32> = (0..s.t as u32).collect();
    let (mut want, mut lse) = (vec![0.0f32; rows * width], vec![0.0f32; s.nh * rows]);
    crate::model::ops::attention_fwd(&mut want, &mut lse, &q, &k, &v, &pos, s.queries(0, rows));
    let got = drv(rt.stream.clone_dtoh(o), "copy to the host")?;
    let largest = want.iter().fold(f32::MIN_POSITIVE, |m, x| m.max(x.abs()));
    let bad = got[..rows * width]
        .iter()
        .zip(&want)
        .map(|(g, w)| (g - w).abs() / largest)
        .find(|e| e.is_nan() || *e > 5e-3);
    match bad {
        None => Ok(()),
        Some(e) => Err(Error::internal(
            "bench kernels",
            format!(
                "the tensor-core attention forward is {e:e} off the CPU attention of its inputs"
            ),
        )),
    }
}
