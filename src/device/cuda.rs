//! The CUDA runtime (feature `cuda`): driver checks, one context, the kernels compiled by NVRTC
//! for the device's compute capability and every module loaded up front, cuBLAS; and
//! `megatrain selftest --device cuda`, which checks every kernel and GEMM against the CPU
//! reference on fresh random inputs and measures the link.
//!
//! Nothing here has run on a GPU yet (this project has had none): the code compiles in CI with
//! the kernels it launches, and the self-test is the one command that proves it on a GPU machine.
//! The streaming `Device` implementation on top of it is not built yet.

use super::kernels::FILES;
use super::launch::{self, AttnShape};
use super::nvrtc;
use super::selftest::{compare, Check};
use crate::{Error, Result};
use cudarc::driver::{
    CudaContext, CudaFunction, CudaSlice, CudaStream, LaunchConfig, PushKernelArg,
};
use std::collections::HashMap;
use std::sync::Arc;

/// Flags of an event that can be timed (`cuEventElapsedTime` fails on cudarc's default,
/// `CU_EVENT_DISABLE_TIMING`).
pub const TIMED: cudarc::driver::sys::CUevent_flags =
    cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;

/// The CUDA version the bindings are built for (cudarc feature `cuda-12080`).
pub const MIN_DRIVER: i32 = 12080;

/// An open device with every kernel loaded.
#[derive(Debug)]
pub struct CudaRuntime {
    /// The context.
    pub ctx: Arc<CudaContext>,
    /// The stream the self-test uses.
    pub stream: Arc<CudaStream>,
    /// Device name.
    pub name: String,
    /// Compute capability.
    pub cc: (i32, i32),
    /// Multiprocessors.
    pub sms: u32,
    /// Driver version (e.g. 12080).
    pub driver: i32,
    /// PCI address, `dddd:bb:dd.0` (how the topology knows this GPU).
    pub pci_bus_id: String,
    functions: HashMap<&'static str, CudaFunction>,
}

pub(crate) fn drv<T>(
    r: std::result::Result<T, cudarc::driver::DriverError>,
    op: &str,
) -> Result<T> {
    r.map_err(|e| Error::system("CUDA driver", op, format!("{e:?}")))
}

impl CudaRuntime {
    /// Open GPU `ordinal`: check the driver, create the context, compile and load every kernel.
    pub fn open(ordinal: usize) -> Result<Self> {
        let mut rt = Self::open_context(ordinal)?;
        let tc = nvrtc::locate()?;
        nvrtc::load(&tc)?;
        let arch = format!("sm_{}{}", rt.cc.0, rt.cc.1);
        for (f, c) in FILES.iter().zip(nvrtc::compile_all(&tc, &arch)?) {
            let module = drv(
                rt.ctx.load_module(cudarc::nvrtc::Ptx::from_src(c.ptx)),
                &format!("load {}", f.file),
            )?;
            for s in f.symbols {
                rt.functions
                    .insert(*s, drv(module.load_function(s), &format!("find {s}"))?);
            }
        }
        Ok(rt)
    }

    /// Open GPU `ordinal` without the kernels (copies only: `bench link`).
    pub fn open_context(ordinal: usize) -> Result<Self> {
        // SAFETY: only probes for the library; cudarc panics on first use without it.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(Error::system(
                "CUDA driver",
                "load libcuda.so.1",
                "no NVIDIA driver on this machine",
            )
            .with_fix(
                "run on a machine with an NVIDIA GPU and its driver (nvidia-smi must work)",
            ));
        }
        let mut v = 0;
        // SAFETY: writes one int.
        let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS || v < MIN_DRIVER {
            return Err(Error::system(
                "CUDA driver",
                "version",
                format!(
                    "driver supports CUDA {}.{}, megatrain needs {}.{}",
                    v / 1000,
                    v % 1000 / 10,
                    MIN_DRIVER / 1000,
                    MIN_DRIVER % 1000 / 10
                ),
            )
            .with_fix("update the NVIDIA driver"));
        }
        let count = drv(CudaContext::device_count(), "count devices")?;
        if ordinal >= count.max(0) as usize {
            return Err(Error::bad_input(
                "GPU",
                ordinal.to_string(),
                format!("the driver sees {count} device(s)"),
                Some("check nvidia-smi and CUDA_VISIBLE_DEVICES"),
            ));
        }
        let ctx = drv(CudaContext::new(ordinal), "create a context")?;
        let name = drv(ctx.name(), "device name")?;
        let cc = drv(ctx.compute_capability(), "compute capability")?;
        let sms = drv(
            ctx.attribute(
                cudarc::driver::sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            ),
            "multiprocessor count",
        )? as u32;
        use cudarc::driver::sys::CUdevice_attribute as A;
        let attr = |a: A| drv(ctx.attribute(a), "PCI address");
        let pci_bus_id = format!(
            "{:04x}:{:02x}:{:02x}.0",
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
        );
        let stream = drv(ctx.new_stream(), "create a stream")?;
        Ok(CudaRuntime {
            ctx,
            stream,
            name,
            cc,
            sms,
            driver: v,
            pci_bus_id,
            functions: HashMap::new(),
        })
    }

    /// A loaded kernel by name.
    pub fn function(&self, name: &str) -> Result<&CudaFunction> {
        self.functions
            .get(name)
            .ok_or_else(|| Error::system("CUDA", "find kernel", format!("{name} is not loaded")))
    }

    fn upload(&self, x: &[f32]) -> Result<CudaSlice<f32>> {
        drv(self.stream.clone_htod(x), "copy to the device")
    }

    fn upload_bf16(&self, x: &[f32]) -> Result<CudaSlice<u16>> {
        let bits: Vec<u16> = x
            .iter()
            .map(|v| crate::optim::adamw::f32_to_bf16(*v))
            .collect();
        drv(self.stream.clone_htod(&bits), "copy to the device")
    }

    fn download(&self, x: &CudaSlice<f32>) -> Result<Vec<f32>> {
        drv(self.stream.clone_dtoh(x), "copy to the host")
    }

    fn download_bf16(&self, x: &CudaSlice<u16>) -> Result<Vec<f32>> {
        Ok(drv(self.stream.clone_dtoh(x), "copy to the host")?
            .into_iter()
            .map(crate::optim::adamw::bf16_to_f32)
            .collect())
    }
}

pub(crate) fn cfg(l: launch::Launch) -> LaunchConfig {
    LaunchConfig {
        grid_dim: l.grid,
        block_dim: (l.block, 1, 1),
        shared_mem_bytes: l.smem,
    }
}

/// Launch a loaded kernel on the runtime's stream with the given arguments, in order.
macro_rules! launch {
    ($rt:expr, $name:expr, $l:expr, $($arg:expr),* $(,)?) => {{
        let f = $rt.function($name)?;
        let mut b = $rt.stream.launch_builder(f);
        $( b.arg($arg); )*
        // SAFETY: every launch passes the kernel's exact parameter list (kernels/*.cu) with
        // buffers of the sizes the kernel indexes for the given shape.
        drv(unsafe { b.launch(cfg($l)) }, $name)?;
    }};
}

/// What the CPU reference sees of a bf16-stored input: the value rounded to bf16 (RNE).
fn round_bf16(v: &[f32]) -> Vec<f32> {
    use crate::optim::adamw::{bf16_to_f32, f32_to_bf16};
    v.iter().map(|x| bf16_to_f32(f32_to_bf16(*x))).collect()
}

/// The attention kernels' scalar arguments: t, nh, nkv, hd, tile, softmax scale.
pub(crate) fn attn_args(s: AttnShape, g: &launch::AttnLaunch) -> (i32, i32, i32, i32, i32, f32) {
    (
        s.t as i32,
        s.nh as i32,
        s.nkv as i32,
        s.hd as i32,
        g.tile as i32,
        1.0 / (s.hd as f32).sqrt(),
    )
}

/// Tolerances: fp32 kernels differ from the CPU only in summation order and FMA; bf16 storage
/// rounds every stored value to 8 bits of mantissa.
const TOL_F32: f64 = 1e-4;
const TOL_BF16: f64 = 3e-2;
const TOL_TF32: f64 = 1e-2;

/// Run every kernel and GEMM on fresh random inputs against the CPU reference.
pub fn selftest_kernels(rt: &CudaRuntime, seed: u64) -> Result<Vec<Check>> {
    use crate::model::ops;
    let mut out = Vec::new();
    let rnd = |n: usize, k: u64, s: f32| crate::util::uniform(n, seed.wrapping_add(k), s);
    let st = &rt.stream;

    // RMSNorm forward and backward, f32 and bf16.
    let (n, c) = (64usize, 1000usize);
    let x = rnd(n * c, 1, 2.0);
    let w: Vec<f32> = rnd(c, 2, 0.5).iter().map(|v| v + 1.0).collect();
    let dy = rnd(n * c, 3, 1.0);
    let (mut y_ref, mut rstd_ref) = (vec![0.0; n * c], vec![0.0; n]);
    ops::rmsnorm_fwd(&mut y_ref, &mut rstd_ref, &x, &w, c, 1e-5);
    let (mut dx_ref, mut dw_ref) = (vec![0.0; n * c], vec![0.0; c]);
    ops::rmsnorm_bwd(&mut dx_ref, false, &mut dw_ref, &dy, &x, &w, &rstd_ref, c);
    {
        let (xd, wd, dyd) = (rt.upload(&x)?, rt.upload(&w)?, rt.upload(&dy)?);
        let mut yd = drv(st.alloc_zeros::<f32>(n * c), "alloc")?;
        let mut rd = drv(st.alloc_zeros::<f32>(n), "alloc")?;
        let l = launch::per_row(n, c)?;
        let (ni, ci, eps) = (n as i32, c as i32, 1e-5f32);
        launch!(
            rt,
            "rmsnorm_fwd_f32",
            l,
            &mut yd,
            &mut rd,
            &xd,
            &wd,
            &ni,
            &ci,
            &eps
        );
        out.push(compare(
            "rmsnorm_fwd_f32",
            &rt.download(&yd)?,
            &y_ref,
            TOL_F32,
        ));
        let mut dxd = drv(st.alloc_zeros::<f32>(n * c), "alloc")?;
        let mut dwd = drv(st.alloc_zeros::<f32>(c), "alloc")?;
        launch!(
            rt,
            "rmsnorm_bwd_f32",
            l,
            &mut dxd,
            &mut dwd,
            &dyd,
            &xd,
            &wd,
            &rd,
            &ni,
            &ci
        );
        out.push(compare(
            "rmsnorm_bwd_f32 dx",
            &rt.download(&dxd)?,
            &dx_ref,
            TOL_F32,
        ));
        out.push(compare(
            "rmsnorm_bwd_f32 dw",
            &rt.download(&dwd)?,
            &dw_ref,
            TOL_F32,
        ));
        // bf16 storage: the reference sees the same rounded inputs.
        let (x16, w16) = (round_bf16(&x), round_bf16(&w));
        let mut y16_ref = vec![0.0; n * c];
        ops::rmsnorm_fwd(&mut y16_ref, &mut rstd_ref, &x16, &w16, c, 1e-5);
        let (xb, wb) = (rt.upload_bf16(&x)?, rt.upload_bf16(&w)?);
        let mut yb = drv(st.alloc_zeros::<u16>(n * c), "alloc")?;
        launch!(
            rt,
            "rmsnorm_fwd_bf16",
            l,
            &mut yb,
            &mut rd,
            &xb,
            &wb,
            &ni,
            &ci,
            &eps
        );
        out.push(compare(
            "rmsnorm_fwd_bf16",
            &rt.download_bf16(&yb)?,
            &y16_ref,
            TOL_BF16,
        ));
    }

    // SwiGLU forward and backward.
    let m = 100_003usize;
    let (g, u, dh) = (rnd(m, 4, 3.0), rnd(m, 5, 1.0), rnd(m, 6, 1.0));
    {
        let mut h_ref = vec![0.0; m];
        ops::swiglu_fwd(&mut h_ref, &g, &u);
        let (mut dg_ref, mut du_ref) = (vec![0.0; m], vec![0.0; m]);
        ops::swiglu_bwd(&mut dg_ref, &mut du_ref, &dh, &g, &u);
        let (gd, ud, dhd) = (rt.upload(&g)?, rt.upload(&u)?, rt.upload(&dh)?);
        let mut hd = drv(st.alloc_zeros::<f32>(m), "alloc")?;
        let l = launch::elementwise(m, rt.sms);
        let mi = m as i64;
        launch!(rt, "swiglu_fwd_f32", l, &mut hd, &gd, &ud, &mi);
        out.push(compare(
            "swiglu_fwd_f32",
            &rt.download(&hd)?,
            &h_ref,
            TOL_F32,
        ));
        let mut dgd = drv(st.alloc_zeros::<f32>(m), "alloc")?;
        let mut dud = drv(st.alloc_zeros::<f32>(m), "alloc")?;
        launch!(
            rt,
            "swiglu_bwd_f32",
            l,
            &mut dgd,
            &mut dud,
            &dhd,
            &gd,
            &ud,
            &mi
        );
        out.push(compare(
            "swiglu_bwd_f32 dgate",
            &rt.download(&dgd)?,
            &dg_ref,
            TOL_F32,
        ));
        out.push(compare(
            "swiglu_bwd_f32 dup",
            &rt.download(&dud)?,
            &du_ref,
            TOL_F32,
        ));
    }

    // RoPE forward and backward (in place).
    let (bt, t, heads, hd) = (2 * 37usize, 37usize, 6usize, 64usize);
    {
        let rope = ops::Rope::new(hd, 10_000.0, t);
        let (cos, sin) = rope.tables();
        let q = rnd(bt * heads * hd, 7, 1.0);
        for (name, inverse) in [("rope_fwd_f32", false), ("rope_bwd_f32", true)] {
            let mut want = q.clone();
            rope.apply(&mut want, t, heads, inverse);
            let mut qd = rt.upload(&q)?;
            let (cd, sd) = (rt.upload(cos)?, rt.upload(sin)?);
            let l = launch::elementwise(bt * heads * hd / 2, rt.sms);
            let (ni, ti, hi, hdi) = (bt as i32, t as i32, heads as i32, hd as i32);
            launch!(rt, name, l, &mut qd, &cd, &sd, &ni, &ti, &hi, &hdi);
            out.push(compare(name, &rt.download(&qd)?, &want, TOL_F32));
        }
    }

    // Attention forward and backward, GQA, T not a multiple of the tile.
    {
        let s = AttnShape {
            b: 2,
            t: 70,
            nh: 8,
            nkv: 2,
            hd: 64,
        };
        let (qn, kn) = (s.b * s.t * s.nh * s.hd, s.b * s.t * s.nkv * s.hd);
        let (q, k, v, d_o) = (
            rnd(qn, 8, 1.0),
            rnd(kn, 9, 1.0),
            rnd(kn, 10, 1.0),
            rnd(qn, 11, 1.0),
        );
        let (mut o_ref, mut lse_ref) = (vec![0.0; qn], vec![0.0; s.b * s.nh * s.t]);
        ops::attention_fwd(&mut o_ref, &mut lse_ref, &q, &k, &v, s);
        let (mut dq_ref, mut dk_ref, mut dv_ref) = (vec![0.0; qn], vec![0.0; kn], vec![0.0; kn]);
        ops::attention_bwd(
            &mut dq_ref,
            &mut dk_ref,
            &mut dv_ref,
            &d_o,
            &q,
            &k,
            &v,
            &o_ref,
            &lse_ref,
            s,
        );
        let g = launch::attention(s, launch::DEFAULT_SMEM)?;
        let (qd, kd, vd, dod) = (
            rt.upload(&q)?,
            rt.upload(&k)?,
            rt.upload(&v)?,
            rt.upload(&d_o)?,
        );
        let mut od = drv(st.alloc_zeros::<f32>(qn), "alloc")?;
        let mut lsed = drv(st.alloc_zeros::<f32>(s.b * s.nh * s.t), "alloc")?;
        let (ti, nhi, nkvi, hdi, tile, scale) = attn_args(s, &g);
        launch!(
            rt,
            "attention_fwd_f32",
            g.rows,
            &mut od,
            &mut lsed,
            &qd,
            &kd,
            &vd,
            &ti,
            &nhi,
            &nkvi,
            &hdi,
            &tile,
            &scale
        );
        out.push(compare(
            "attention_fwd_f32 out",
            &rt.download(&od)?,
            &o_ref,
            TOL_F32,
        ));
        out.push(compare(
            "attention_fwd_f32 lse",
            &rt.download(&lsed)?,
            &lse_ref,
            TOL_F32,
        ));
        let mut dqd = drv(st.alloc_zeros::<f32>(qn), "alloc")?;
        let mut deltad = drv(st.alloc_zeros::<f32>(s.b * s.nh * s.t), "alloc")?;
        launch!(
            rt,
            "attention_bwd_f32",
            g.rows,
            &mut dqd,
            &mut deltad,
            &dod,
            &od,
            &qd,
            &kd,
            &vd,
            &lsed,
            &ti,
            &nhi,
            &nkvi,
            &hdi,
            &tile,
            &scale
        );
        let mut dkd = drv(st.alloc_zeros::<f32>(kn), "alloc")?;
        let mut dvd = drv(st.alloc_zeros::<f32>(kn), "alloc")?;
        launch!(
            rt,
            "attention_bwd_kv_f32",
            g.kv,
            &mut dkd,
            &mut dvd,
            &dod,
            &qd,
            &kd,
            &vd,
            &lsed,
            &deltad,
            &ti,
            &nhi,
            &nkvi,
            &hdi,
            &tile,
            &scale
        );
        out.push(compare(
            "attention_bwd_f32 dq",
            &rt.download(&dqd)?,
            &dq_ref,
            TOL_F32,
        ));
        out.push(compare(
            "attention_bwd_kv_f32 dk",
            &rt.download(&dkd)?,
            &dk_ref,
            TOL_F32,
        ));
        out.push(compare(
            "attention_bwd_kv_f32 dv",
            &rt.download(&dvd)?,
            &dv_ref,
            TOL_F32,
        ));
    }

    // Cross-entropy: loss and gradient of a chunk of logits.
    {
        let (rows, vocab) = (33usize, 5003usize);
        let z = rnd(rows * vocab, 12, 4.0);
        let targets: Vec<u32> = (0..rows).map(|r| (r * 131 % vocab) as u32).collect();
        let scale = 0.25f32;
        let mut loss_ref = vec![0.0f32; rows];
        let mut grad_ref = vec![0.0f32; rows * vocab];
        for r in 0..rows {
            let zr = &z[r * vocab..(r + 1) * vocab];
            let mx = zr.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b));
            let lse = mx + zr.iter().map(|x| (x - mx).exp()).sum::<f32>().ln();
            loss_ref[r] = lse - zr[targets[r] as usize];
            for (j, g) in grad_ref[r * vocab..(r + 1) * vocab].iter_mut().enumerate() {
                *g = scale
                    * ((zr[j] - lse).exp() - if j == targets[r] as usize { 1.0 } else { 0.0 });
            }
        }
        let mut zd = rt.upload(&z)?;
        let td = drv(st.clone_htod(&targets), "copy to the device")?;
        let mut ld = drv(st.alloc_zeros::<f32>(rows), "alloc")?;
        let l = launch::per_row(rows, vocab)?;
        let (ri, vi) = (rows as i32, vocab as i32);
        launch!(
            rt,
            "cross_entropy_bwd_f32",
            l,
            &mut zd,
            &mut ld,
            &td,
            &ri,
            &vi,
            &scale
        );
        out.push(compare(
            "cross_entropy_bwd_f32 loss",
            &rt.download(&ld)?,
            &loss_ref,
            TOL_F32,
        ));
        out.push(compare(
            "cross_entropy_bwd_f32 grad",
            &rt.download(&zd)?,
            &grad_ref,
            TOL_F32,
        ));
    }

    // Σx² (global norm) and the casts.
    {
        let x = rnd(1 << 20, 13, 1.0);
        let want = crate::optim::adamw::sumsq(&x);
        let xd = rt.upload(&x)?;
        let mut sd = drv(st.alloc_zeros::<f64>(1), "alloc")?;
        let ni = x.len() as i64;
        let l = launch::elementwise(x.len(), rt.sms);
        launch!(rt, "sumsq_fwd_f32", l, &mut sd, &xd, &ni);
        let got = drv(st.clone_dtoh(&sd), "copy to the host")?[0];
        out.push(compare(
            "sumsq_fwd_f32",
            &[got as f32],
            &[want as f32],
            TOL_F32,
        ));
        let mut bd = drv(st.alloc_zeros::<u16>(x.len()), "alloc")?;
        launch!(rt, "cast_fwd_f32_bf16", l, &mut bd, &xd, &ni);
        let want16 = round_bf16(&x);
        // Round-to-nearest-even on both sides: bit-exact.
        out.push(compare(
            "cast_fwd_f32_bf16",
            &rt.download_bf16(&bd)?,
            &want16,
            0.0,
        ));
    }

    // GEMMs through cuBLAS: y[M, N] = x[M, K] · w[N, K]ᵀ (a Linear), fp32 and TF32.
    {
        use cudarc::cublas::{sys::cublasOperation_t as Op, CudaBlas, Gemm, GemmConfig};
        let (mm, nn, kk) = (129usize, 257usize, 511usize);
        let (x, w) = (rnd(mm * kk, 14, 1.0), rnd(nn * kk, 15, 1.0));
        let mut want = vec![0.0f32; mm * nn];
        ops::linear_fwd(&mut want, &x, &w, None, mm, kk, nn);
        let blas = CudaBlas::new(st.clone())
            .map_err(|e| Error::system("cuBLAS", "create a handle", format!("{e:?}")))?;
        let (xd, wd) = (rt.upload(&x)?, rt.upload(&w)?);
        // Row-major y = x·wᵀ is column-major yᵀ = w·xᵀ: A = w (transposed), B = x.
        let g = GemmConfig {
            transa: Op::CUBLAS_OP_T,
            transb: Op::CUBLAS_OP_N,
            m: nn as i32,
            n: mm as i32,
            k: kk as i32,
            alpha: 1.0f32,
            lda: kk as i32,
            ldb: kk as i32,
            beta: 0.0f32,
            ldc: nn as i32,
        };
        for (name, tf32, tol) in [("gemm_f32", false, TOL_F32), ("gemm_tf32", true, TOL_TF32)] {
            let mode = if tf32 {
                cudarc::cublas::sys::cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH
            } else {
                cudarc::cublas::sys::cublasMath_t::CUBLAS_DEFAULT_MATH
            };
            // SAFETY: a valid handle owned by `blas`.
            unsafe { cudarc::cublas::sys::cublasSetMathMode(*blas.handle(), mode) };
            let mut yd = drv(st.alloc_zeros::<f32>(mm * nn), "alloc")?;
            // SAFETY: the buffers hold M·K, N·K and M·N elements as the config describes.
            unsafe { blas.gemm(g, &wd, &xd, &mut yd) }
                .map_err(|e| Error::system("cuBLAS", "sgemm", format!("{e:?}")))?;
            out.push(compare(name, &rt.download(&yd)?, &want, tol));
        }
    }
    // The same Linear in bf16 with fp32 accumulation and an fp32 result (cublasGemmEx).
    {
        use cudarc::cublas::sys::{
            cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t as Op, cudaDataType_t,
        };
        use cudarc::driver::{DevicePtr, DevicePtrMut};
        let (mm, nn, kk) = (65usize, 130usize, 257usize);
        let (x, w) = (rnd(mm * kk, 16, 1.0), rnd(nn * kk, 17, 1.0));
        let mut want = vec![0.0f32; mm * nn];
        ops::linear_fwd(
            &mut want,
            &round_bf16(&x),
            &round_bf16(&w),
            None,
            mm,
            kk,
            nn,
        );
        let blas = cudarc::cublas::CudaBlas::new(st.clone())
            .map_err(|e| Error::system("cuBLAS", "create a handle", format!("{e:?}")))?;
        let (xd, wd) = (rt.upload_bf16(&x)?, rt.upload_bf16(&w)?);
        let mut yd = drv(st.alloc_zeros::<f32>(mm * nn), "alloc")?;
        let (alpha, beta) = (1.0f32, 0.0f32);
        {
            let (a, _ra) = wd.device_ptr(st);
            let (b, _rb) = xd.device_ptr(st);
            let (c, _rc) = yd.device_ptr_mut(st);
            // SAFETY: A = w [N, K] bf16, B = x [M, K] bf16, C = y [M, N] fp32, as described.
            unsafe {
                cudarc::cublas::result::gemm_ex(
                    *blas.handle(),
                    Op::CUBLAS_OP_T,
                    Op::CUBLAS_OP_N,
                    nn as i32,
                    mm as i32,
                    kk as i32,
                    (&alpha as *const f32).cast(),
                    a as *const _,
                    cudaDataType_t::CUDA_R_16BF,
                    kk as i32,
                    b as *const _,
                    cudaDataType_t::CUDA_R_16BF,
                    kk as i32,
                    (&beta as *const f32).cast(),
                    c as *mut _,
                    cudaDataType_t::CUDA_R_32F,
                    nn as i32,
                    cublasComputeType_t::CUBLAS_COMPUTE_32F,
                    cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
                )
            }
            .map_err(|e| Error::system("cuBLAS", "gemm_ex bf16", format!("{e:?}")))?;
        }
        out.push(compare(
            "gemm_bf16 (fp32 accumulate)",
            &rt.download(&yd)?,
            &want,
            10.0 * TOL_F32,
        ));
    }

    // Embedding gather and scatter-add (repeated tokens), bias and residual adds.
    {
        let (n, c, vocab) = (50usize, 96usize, 40usize);
        let wte = rnd(vocab * c, 18, 1.0);
        let tokens: Vec<u32> = (0..n).map(|i| (i * 7 % 13) as u32).collect();
        let dy = rnd(n * c, 19, 1.0);
        let mut x_ref = vec![0.0f32; n * c];
        let mut dw_ref = vec![0.0f32; vocab * c];
        for (r, &t) in tokens.iter().enumerate() {
            let t = t as usize;
            x_ref[r * c..(r + 1) * c].copy_from_slice(&wte[t * c..(t + 1) * c]);
            for j in 0..c {
                dw_ref[t * c + j] += dy[r * c + j];
            }
        }
        let (wd, dyd) = (rt.upload(&wte)?, rt.upload(&dy)?);
        let td = drv(st.clone_htod(&tokens), "copy to the device")?;
        let mut xd = drv(st.alloc_zeros::<f32>(n * c), "alloc")?;
        let mut dwd = drv(st.alloc_zeros::<f32>(vocab * c), "alloc")?;
        let l = launch::elementwise(n * c, rt.sms);
        let (ni, ci) = (n as i32, c as i32);
        launch!(rt, "embedding_fwd_f32", l, &mut xd, &wd, &td, &ni, &ci);
        launch!(rt, "embedding_bwd_f32", l, &mut dwd, &dyd, &td, &ni, &ci);
        out.push(compare(
            "embedding_fwd_f32",
            &rt.download(&xd)?,
            &x_ref,
            0.0,
        ));
        out.push(compare(
            "embedding_bwd_f32",
            &rt.download(&dwd)?,
            &dw_ref,
            TOL_F32,
        ));

        let bias = rnd(c, 20, 1.0);
        let mut y_ref = dy.clone();
        let mut db_ref = vec![0.0f32; c];
        for r in 0..n {
            for j in 0..c {
                y_ref[r * c + j] += bias[j] + x_ref[r * c + j];
                db_ref[j] += dy[r * c + j];
            }
        }
        let bd = rt.upload(&bias)?;
        let mut yd = rt.upload(&dy)?;
        let mut dbd = drv(st.alloc_zeros::<f32>(c), "alloc")?;
        let total = (n * c) as i64;
        launch!(rt, "bias_fwd_f32", l, &mut yd, &bd, &ni, &ci);
        launch!(rt, "add_fwd_f32", l, &mut yd, &xd, &total);
        launch!(
            rt,
            "bias_bwd_f32",
            launch::per_column(c),
            &mut dbd,
            &dyd,
            &ni,
            &ci
        );
        out.push(compare(
            "bias_fwd_f32 + add_fwd_f32",
            &rt.download(&yd)?,
            &y_ref,
            TOL_F32,
        ));
        out.push(compare(
            "bias_bwd_f32",
            &rt.download(&dbd)?,
            &db_ref,
            TOL_F32,
        ));
    }

    // bf16 storage of the attention, SwiGLU and cross-entropy kernels (fp32 math inside).
    {
        let s = AttnShape {
            b: 1,
            t: 45,
            nh: 4,
            nkv: 4,
            hd: 128,
        };
        let (qn, kn) = (s.b * s.t * s.nh * s.hd, s.b * s.t * s.nkv * s.hd);
        let (q, k, v) = (rnd(qn, 21, 1.0), rnd(kn, 22, 1.0), rnd(kn, 23, 1.0));
        let (mut o_ref, mut lse_ref) = (vec![0.0; qn], vec![0.0; s.b * s.nh * s.t]);
        ops::attention_fwd(
            &mut o_ref,
            &mut lse_ref,
            &round_bf16(&q),
            &round_bf16(&k),
            &round_bf16(&v),
            s,
        );
        let g = launch::attention(s, launch::DEFAULT_SMEM)?;
        let (qd, kd, vd) = (
            rt.upload_bf16(&q)?,
            rt.upload_bf16(&k)?,
            rt.upload_bf16(&v)?,
        );
        let mut od = drv(st.alloc_zeros::<u16>(qn), "alloc")?;
        let mut lsed = drv(st.alloc_zeros::<f32>(s.b * s.nh * s.t), "alloc")?;
        let (ti, nhi, nkvi, hdi, tile, scale) = attn_args(s, &g);
        launch!(
            rt,
            "attention_fwd_bf16",
            g.rows,
            &mut od,
            &mut lsed,
            &qd,
            &kd,
            &vd,
            &ti,
            &nhi,
            &nkvi,
            &hdi,
            &tile,
            &scale
        );
        out.push(compare(
            "attention_fwd_bf16 out",
            &rt.download_bf16(&od)?,
            &o_ref,
            TOL_BF16,
        ));

        let m = 4099usize;
        let (gg, u) = (rnd(m, 24, 3.0), rnd(m, 25, 1.0));
        let mut h_ref = vec![0.0; m];
        ops::swiglu_fwd(&mut h_ref, &round_bf16(&gg), &round_bf16(&u));
        let (gd, ud) = (rt.upload_bf16(&gg)?, rt.upload_bf16(&u)?);
        let mut hd = drv(st.alloc_zeros::<u16>(m), "alloc")?;
        let mi = m as i64;
        launch!(
            rt,
            "swiglu_fwd_bf16",
            launch::elementwise(m, rt.sms),
            &mut hd,
            &gd,
            &ud,
            &mi
        );
        out.push(compare(
            "swiglu_fwd_bf16",
            &rt.download_bf16(&hd)?,
            &h_ref,
            TOL_BF16,
        ));

        let (rows, vocab) = (9usize, 1001usize);
        let z = rnd(rows * vocab, 26, 4.0);
        let z16 = round_bf16(&z);
        let targets: Vec<u32> = (0..rows).map(|r| (r * 37 % vocab) as u32).collect();
        let loss_ref: Vec<f32> = (0..rows)
            .map(|r| {
                let zr = &z16[r * vocab..(r + 1) * vocab];
                let mx = zr.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b));
                mx + zr.iter().map(|x| (x - mx).exp()).sum::<f32>().ln() - zr[targets[r] as usize]
            })
            .collect();
        let zd = rt.upload_bf16(&z)?;
        let td = drv(st.clone_htod(&targets), "copy to the device")?;
        let mut ld = drv(st.alloc_zeros::<f32>(rows), "alloc")?;
        let (ri, vi) = (rows as i32, vocab as i32);
        launch!(
            rt,
            "cross_entropy_fwd_bf16",
            launch::per_row(rows, vocab)?,
            &mut ld,
            &zd,
            &td,
            &ri,
            &vi
        );
        out.push(compare(
            "cross_entropy_fwd_bf16",
            &rt.download(&ld)?,
            &loss_ref,
            TOL_F32 * 10.0,
        ));
    }
    drv(st.synchronize(), "synchronize")?;
    Ok(out)
}

/// Page-lock `region` with `cuMemHostRegister` (portable), so copies from it are truly async.
fn page_lock(region: &crate::host::Region) -> Result<()> {
    // SAFETY: registering our own mapped region; callers unregister (`unlock`) before it is
    // unmapped.
    unsafe { host_register(region.as_ptr(), region.len()) }
}

/// Page-lock `len` bytes at `ptr` for the GPU (`cuMemHostRegister`, portable, not
/// write-combined), with the memlock fix in the error.
///
/// # Safety
/// `ptr..ptr+len` must stay mapped until `cuMemHostUnregister(ptr)`.
pub(crate) unsafe fn host_register(ptr: *mut u8, len: usize) -> Result<()> {
    // SAFETY: forwarded contract.
    let r = unsafe {
        cudarc::driver::sys::cuMemHostRegister_v2(
            ptr.cast(),
            len,
            cudarc::driver::sys::CU_MEMHOSTREGISTER_PORTABLE,
        )
    };
    if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS {
        return Err(Error::system(
            "CUDA driver",
            format!(
                "page-lock {} with cuMemHostRegister",
                crate::util::human_bytes(len as u64)
            ),
            format!("{r:?}"),
        )
        .with_fix(
            "raise the memlock limit (`ulimit -l unlimited`, LimitMEMLOCK=infinity for a service) or run with CAP_IPC_LOCK",
        ));
    }
    Ok(())
}

/// Undo [`page_lock`].
fn unlock(region: &crate::host::Region) {
    // SAFETY: the region was registered by `page_lock` and is still mapped.
    unsafe { cudarc::driver::sys::cuMemHostUnregister(region.as_ptr().cast()) };
}

/// Median milliseconds of `reps` runs of `f` on `stream` (after one warm-up), timed with events
/// recorded around it; `other` is made to wait for the start so it can join in.
fn time_ms(
    rt: &CudaRuntime,
    other: Option<&CudaStream>,
    reps: usize,
    f: &mut dyn FnMut() -> Result<()>,
) -> Result<f64> {
    let mut v = Vec::new();
    for _ in 0..=reps.max(1) {
        // Timing needs events created with timing on (cudarc's default disables it).
        let a = drv(rt.ctx.new_event(Some(TIMED)), "event")?;
        let b = drv(rt.ctx.new_event(Some(TIMED)), "event")?;
        drv(a.record(&rt.stream), "record")?;
        if let Some(o) = other {
            drv(o.wait(&a), "wait")?;
        }
        f()?;
        drv(b.record(&rt.stream), "record")?;
        drv(b.synchronize(), "synchronize")?;
        v.push(f64::from(drv(a.elapsed_ms(&b), "elapsed")?));
    }
    v.remove(0); // warm-up
    Ok(crate::bench::median(v))
}

/// Host→device and device→host GB/s of a 256 MiB copy from page-locked (registered) host memory,
/// median of 5, timed with events.
pub fn selftest_link(rt: &CudaRuntime) -> Result<(f64, f64)> {
    let n = 64usize << 20; // f32 elements: 256 MiB
    let host = crate::host::Region::allocate(crate::host::RegionSpec::scratch(
        "selftest pinned buffer",
        n * 4,
    ))?;
    page_lock(&host)?;
    // SAFETY: the region holds n f32 and is registered.
    let hs = unsafe { std::slice::from_raw_parts_mut(host.as_ptr().cast::<f32>(), n) };
    let mut dev = drv(rt.stream.alloc_zeros::<f32>(n), "alloc 256 MiB")?;
    let gbps = |ms: f64| (n * 4) as f64 / (ms * 1e-3) / 1e9;
    let htod = time_ms(rt, None, 5, &mut || {
        drv(rt.stream.memcpy_htod(&*hs, &mut dev), "htod")
    });
    let dtoh = time_ms(rt, None, 5, &mut || {
        drv(rt.stream.memcpy_dtoh(&dev, &mut *hs), "dtoh")
    });
    unlock(&host);
    Ok((gbps(htod?), gbps(dtoh?)))
}

/// Host↔device copies per NUMA node (memory bound there, calling thread pinned there),
/// page-locked and pageable, for each size in `sizes`, median of `reps` timed with events.
pub fn bench_link(
    ordinal: usize,
    nodes: &[(u32, Vec<usize>)],
    sizes: &[usize],
    reps: usize,
) -> Result<(String, Vec<crate::bench::link::LinkCase>)> {
    let rt = CudaRuntime::open_context(ordinal)?;
    let other = drv(rt.ctx.new_stream(), "create a stream")?;
    let max = sizes.iter().copied().max().unwrap_or(0).div_ceil(4) * 4;
    let mut dev = drv(
        rt.stream.alloc_zeros::<f32>(max / 4),
        "allocate the device buffer",
    )?;
    let dev2 = drv(
        other.alloc_zeros::<f32>(max / 4),
        "allocate the device buffer",
    )?;
    let mut out = Vec::new();
    for (node, cpus) in nodes {
        // Best effort: a cgroup may forbid it; the copies are still measured.
        let _ = crate::host::affinity::pin_current_thread(cpus);
        let buffer = || {
            crate::host::Region::allocate(crate::host::RegionSpec {
                node: Some(*node),
                prefault_cpus: cpus.clone(),
                ..crate::host::RegionSpec::scratch(format!("link bench buffer on node {node}"), max)
            })
        };
        let (host, host2) = (buffer()?, buffer()?);
        for pinned in [true, false] {
            if pinned {
                page_lock(&host)?;
                if let Err(e) = page_lock(&host2) {
                    unlock(&host);
                    return Err(e);
                }
            }
            for &bytes in sizes {
                let n = bytes / 4;
                // SAFETY: both regions hold `max` ≥ bytes bytes; nothing else touches them.
                let (h1, h2) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(host.as_ptr().cast::<f32>(), n),
                        std::slice::from_raw_parts_mut(host2.as_ptr().cast::<f32>(), n),
                    )
                };
                for direction in ["htod", "dtoh", "bidirectional"] {
                    let ms = time_ms(&rt, Some(&other), reps, &mut || {
                        let mut d1 = dev.slice_mut(..n);
                        match direction {
                            "htod" => drv(rt.stream.memcpy_htod(&*h1, &mut d1), "htod"),
                            "dtoh" => drv(rt.stream.memcpy_dtoh(&d1, &mut *h1), "dtoh"),
                            _ => {
                                drv(rt.stream.memcpy_htod(&*h1, &mut d1), "htod")?;
                                drv(other.memcpy_dtoh(&dev2.slice(..n), &mut *h2), "dtoh")?;
                                drv(rt.stream.join(&other), "join")
                            }
                        }
                    });
                    let ms = match ms {
                        Ok(ms) => ms,
                        Err(e) => {
                            if pinned {
                                unlock(&host);
                                unlock(&host2);
                            }
                            return Err(e);
                        }
                    };
                    let moved = if direction == "bidirectional" {
                        2 * bytes
                    } else {
                        bytes
                    };
                    out.push(crate::bench::link::LinkCase {
                        node: *node,
                        direction,
                        pinned,
                        bytes,
                        gbps: moved as f64 / (ms * 1e-3) / 1e9,
                    });
                }
            }
            if pinned {
                unlock(&host);
                unlock(&host2);
            }
        }
    }
    Ok((rt.name.clone(), out))
}
