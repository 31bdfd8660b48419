//! The device program's primitives on a GPU (feature `cuda`): the NVRTC-compiled kernels of
//! `kernels/*.cu` and cuBLAS, all on the compute stream. Addresses are raw `CUdeviceptr`s.
//!
//! Everything here is asynchronous: a call enqueues work and returns. Token ids go through a
//! page-locked bounce buffer into one device ids buffer (both reused in stream order); per-row
//! losses come back through a page-locked buffer and a host function that adds their sum to the
//! step's loss once the kernels before it are done.
//!
//! Every kernel it launches is checked against the CPU reference by `megatrain selftest --device
//! cuda`, and the program that calls it is checked bit for bit against the reference layers on
//! the CPU backend.

use super::launches::{i32_of, AttnArgs, Dtype, Launcher};
use super::pinned::{host_fn, Pinned};
use super::runtime::{drv, CudaRuntime, DevPtr};
use crate::device::launch;
use crate::device::program::{Backend, Gemm};
use crate::device::Precision;
use crate::model::ops::{AttnShape, Rope};
use crate::{Error, Result};
use cudarc::cublas::sys::{cublasMath_t, cublasOperation_t as Op};
use cudarc::cublas::CudaBlas;
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr};
use std::sync::{Arc, Mutex};

/// A raw pointer handed to a host function.
#[derive(Clone, Copy)]
struct SendPtr<T>(*mut T);
// SAFETY: the memory it points to is kept alive and ordered by the stream the function runs in.
unsafe impl<T> Send for SendPtr<T> {}

const F32: Dtype = Dtype::F32;

/// The CUDA backend of the device program.
#[derive(Debug)]
pub struct CudaBackend {
    rt: Arc<CudaRuntime>,
    stream: Arc<CudaStream>,
    blas: CudaBlas,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
    head_dim: usize,
    ids: IdsBuffer,
    positions: IdsBuffer,
    /// The micro-batch whose positions `positions` holds (kept alive, so its address is not
    /// reused by another).
    positions_of: Option<Arc<[u32]>>,
    losses: Pinned,
    smem: usize,
    /// Under bf16: two bf16 buffers for a GEMM's operands (and a tensor being rounded).
    bf16: Option<Bf16Operands>,
}

/// The bf16 copies of a GEMM's two operands ([`crate::device::program::bf16_operand_elems`]
/// elements each).
#[derive(Debug)]
struct Bf16Operands {
    a: CudaSlice<u16>,
    b: CudaSlice<u16>,
    elems: usize,
}

impl CudaBackend {
    /// A backend on `stream` for micro-batches of up to `n` tokens, rotating with `rope`.
    /// `tf32` lets cuBLAS use TF32 tensor cores for the fp32 GEMMs. `bf16_operands`: the bf16
    /// recipe, with operand buffers of this many elements; `None`: fp32.
    pub fn new(
        rt: Arc<CudaRuntime>,
        stream: Arc<CudaStream>,
        rope: &Rope,
        n: usize,
        (tf32, bf16_operands): (bool, Option<usize>),
    ) -> Result<Self> {
        let blas = CudaBlas::new(stream.clone()).map_err(|e| Error::cuda("create a handle", e))?;
        let mode = if tf32 {
            cublasMath_t::CUBLAS_TF32_TENSOR_OP_MATH
        } else {
            cublasMath_t::CUBLAS_DEFAULT_MATH
        };
        // SAFETY: a valid handle owned by `blas`.
        let r = unsafe { cudarc::cublas::sys::cublasSetMathMode(*blas.handle(), mode) };
        r.result()
            .map_err(|e| Error::cuda("set the math mode", e))?;
        let (c, s) = rope.tables();
        let cos = drv(stream.clone_htod(c), "upload the RoPE tables")?;
        let sin = drv(stream.clone_htod(s), "upload the RoPE tables")?;
        let ids = IdsBuffer::new(&rt, &stream, n)?;
        let positions = IdsBuffer::new(&rt, &stream, n)?;
        let losses = Pinned::new(&rt.ctx, 4 * n.max(1))?;
        let bf16 = match bf16_operands {
            Some(elems) => {
                let alloc = || {
                    drv(
                        stream.alloc_zeros::<u16>(elems.max(1)),
                        "allocate the bf16 GEMM operands",
                    )
                };
                Some(Bf16Operands {
                    a: alloc()?,
                    b: alloc()?,
                    elems,
                })
            }
            None => None,
        };
        // Every kernel is opted in to the device's largest block (`CudaRuntime::open`).
        let smem = rt.smem_optin.max(launch::DEFAULT_SMEM);
        Ok(CudaBackend {
            rt,
            stream,
            blas,
            cos,
            sin,
            head_dim: rope.head_dim,
            ids,
            positions,
            positions_of: None,
            losses,
            smem,
            bf16,
        })
    }

    /// The bf16 operand buffers' addresses, when `elems` fit them (`what` names the use).
    fn bf16_operands(&self, elems: usize, what: &str) -> Result<(DevPtr, DevPtr)> {
        let o = self.bf16.as_ref().ok_or_else(|| {
            Error::internal("CUDA backend", format!("{what}: bf16 on an fp32 backend"))
        })?;
        if elems > o.elems {
            return Err(Error::internal(
                "CUDA backend",
                format!("{what}: {elems} elements for bf16 buffers of {}", o.elems),
            ));
        }
        let (a, _ga) = o.a.device_ptr(&self.stream);
        let (b, _gb) = o.b.device_ptr(&self.stream);
        Ok((a, b))
    }

    /// `C = op(A)·op(B)` on bf16 copies of A and B, fp32 sums and result (`cublasGemmEx`).
    fn gemm_bf16(&mut self, g: Gemm<DevPtr>, c: launch::ColMajorGemm) -> Result<()> {
        use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType_t};
        let (a_len, b_len) = (g.m * g.k, g.k * g.n);
        let (a16, b16) = self.bf16_operands(a_len.max(b_len), "gemm")?;
        let sms = self.sms();
        self.k()
            .cast_f32_bf16(launch::elementwise(a_len, sms), a16, g.a, a_len as i64)?;
        self.k()
            .cast_f32_bf16(launch::elementwise(b_len, sms), b16, g.b, b_len as i64)?;
        let op = |t: bool| if t { Op::CUBLAS_OP_T } else { Op::CUBLAS_OP_N };
        let (alpha, beta) = (1.0f32, if g.accumulate { 1.0f32 } else { 0.0 });
        // SAFETY: the operand buffers hold the bf16 copies of A (m·k) and B (k·n), written
        // before this call on the same stream; C holds m·n fp32 (checked by the program).
        unsafe {
            cudarc::cublas::result::gemm_ex(
                *self.blas.handle(),
                op(c.trans_first),
                op(c.trans_second),
                i32_of(c.m, "gemm m")?,
                i32_of(c.n, "gemm n")?,
                i32_of(c.k, "gemm k")?,
                (&alpha as *const f32).cast(),
                b16 as *const _,
                cudaDataType_t::CUDA_R_16BF,
                i32_of(c.ld_first, "gemm ld")?,
                a16 as *const _,
                cudaDataType_t::CUDA_R_16BF,
                i32_of(c.ld_second, "gemm ld")?,
                (&beta as *const f32).cast(),
                g.c as *mut _,
                cudaDataType_t::CUDA_R_32F,
                i32_of(c.ldc, "gemm ld")?,
                cublasComputeType_t::CUBLAS_COMPUTE_32F,
                cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
        .map_err(|e| Error::cuda("gemm_ex bf16", e))
    }

    fn sms(&self) -> u32 {
        self.rt.sms
    }

    fn k(&self) -> Launcher<'_> {
        Launcher {
            rt: &self.rt,
            stream: &self.stream,
        }
    }

    /// The tensor-core attention's geometry when it takes `s`: under bf16 (its inputs are bf16
    /// values there; in fp32 they are not) and for a head dim it is instantiated for.
    fn flash(&self, s: AttnShape) -> Result<Option<launch::FlashLaunch>> {
        match self.bf16 {
            Some(_) => launch::flash(s),
            None => Ok(None),
        }
    }

    fn tables(&self) -> (DevPtr, DevPtr) {
        let (c, _g1) = self.cos.device_ptr(&self.stream);
        let (s, _g2) = self.sin.device_ptr(&self.stream);
        (c, s)
    }
}

/// Page-locked bounce buffers per [`IdsBuffer`]: the host may run this many uploads ahead of
/// the stream before it waits for the oldest one to have left its buffer.
const ID_BOUNCES: usize = 4;

/// A device buffer of u32 ids filled from the host through a ring of page-locked bounce
/// buffers, in the stream's order. The device buffer is rewritten in stream order (after the
/// kernels that read the previous ids); a bounce buffer only once its last copy has run.
#[derive(Debug)]
struct IdsBuffer {
    dev: CudaSlice<u32>,
    bounce: Vec<Pinned>,
    /// Per bounce buffer, the event after its last copy.
    copied: Vec<Option<CudaEvent>>,
    next: usize,
}

impl IdsBuffer {
    /// Room for `n` ids.
    fn new(rt: &CudaRuntime, stream: &Arc<CudaStream>, n: usize) -> Result<Self> {
        Ok(IdsBuffer {
            dev: drv(
                stream.alloc_zeros::<u32>(n.max(1)),
                "allocate the token ids",
            )?,
            bounce: (0..ID_BOUNCES)
                .map(|_| Pinned::new(&rt.ctx, 4 * n.max(1)))
                .collect::<Result<_>>()?,
            copied: (0..ID_BOUNCES).map(|_| None).collect(),
            next: 0,
        })
    }

    fn device_ptr(&self, stream: &Arc<CudaStream>) -> DevPtr {
        self.dev.device_ptr(stream).0
    }

    /// Copy `ids` in after everything already on `stream`; `what` names them in errors.
    fn upload(&mut self, stream: &Arc<CudaStream>, ids: &[u32], what: &str) -> Result<DevPtr> {
        let k = self.next;
        self.next = (k + 1) % ID_BOUNCES;
        let bounce = &self.bounce[k];
        if 4 * ids.len() > bounce.bytes() {
            return Err(Error::internal(
                "CUDA backend",
                format!(
                    "{} {what} for a buffer of {}",
                    ids.len(),
                    bounce.bytes() / 4
                ),
            ));
        }
        // This bounce buffer's last upload must have left it before it is rewritten (the
        // host waits only when it runs ID_BOUNCES uploads ahead of the stream).
        if let Some(e) = self.copied[k].take() {
            drv(
                e.synchronize(),
                &format!("wait for an earlier upload of {what}"),
            )?;
        }
        // SAFETY: the bounce buffer holds ≥ ids.len() u32 (checked) and no copy reads it now.
        unsafe {
            std::ptr::copy_nonoverlapping(ids.as_ptr(), bounce.as_ptr().cast::<u32>(), ids.len())
        };
        let dst = self.device_ptr(stream);
        // SAFETY: page-locked source and a device buffer both of ≥ 4·len bytes.
        let r = unsafe {
            cudarc::driver::sys::cuMemcpyHtoDAsync_v2(
                dst,
                bounce.as_ptr().cast(),
                4 * ids.len(),
                stream.cu_stream(),
            )
        };
        drv(r.result(), &format!("host to device copy of {what}"))?;
        self.copied[k] = Some(drv(
            stream.record_event(None),
            &format!("record the upload of {what}"),
        )?);
        Ok(dst)
    }
}

impl Backend for CudaBackend {
    type P = DevPtr;
    type Ids = DevPtr;

    fn off(p: DevPtr, elems: usize) -> DevPtr {
        p + 4 * elems as u64
    }

    fn ids_off(ids: DevPtr, n: usize) -> DevPtr {
        ids + 4 * n as u64
    }

    fn upload_ids(&mut self, ids: &[u32]) -> Result<DevPtr> {
        self.ids.upload(&self.stream, ids, "token ids")
    }

    fn upload_positions(&mut self, positions: &Arc<[u32]>) -> Result<DevPtr> {
        // Once per micro-batch: every block of its forward and backward reads the same ones.
        match &self.positions_of {
            Some(p) if Arc::ptr_eq(p, positions) => Ok(self.positions.device_ptr(&self.stream)),
            _ => {
                let at = self
                    .positions
                    .upload(&self.stream, positions, "token positions")?;
                self.positions_of = Some(positions.clone());
                Ok(at)
            }
        }
    }

    fn gemm(&mut self, g: Gemm<DevPtr>) -> Result<()> {
        if g.m == 0 || g.n == 0 {
            return Ok(());
        }
        let c = launch::row_major_gemm(g.m, g.k, g.n, g.ta, g.tb);
        if self.bf16.is_some() {
            return self.gemm_bf16(g, c);
        }
        let op = |t: bool| if t { Op::CUBLAS_OP_T } else { Op::CUBLAS_OP_N };
        let (alpha, beta) = (1.0f32, if g.accumulate { 1.0f32 } else { 0.0 });
        // SAFETY: the program checked that A, B and C hold m·k, k·n and m·n elements.
        unsafe {
            cudarc::cublas::result::sgemm(
                *self.blas.handle(),
                op(c.trans_first),
                op(c.trans_second),
                i32_of(c.m, "gemm m")?,
                i32_of(c.n, "gemm n")?,
                i32_of(c.k, "gemm k")?,
                &alpha,
                g.b as *const f32,
                i32_of(c.ld_first, "gemm ld")?,
                g.a as *const f32,
                i32_of(c.ld_second, "gemm ld")?,
                &beta,
                g.c as *mut f32,
                i32_of(c.ldc, "gemm ld")?,
            )
        }
        .map_err(|e| Error::cuda("sgemm", e))
    }

    fn bias_fwd(&mut self, y: DevPtr, b: DevPtr, rows: usize, cols: usize) -> Result<()> {
        let (r, c) = (i32_of(rows, "rows")?, i32_of(cols, "cols")?);
        let l = launch::elementwise(rows * cols, self.sms());
        self.k().bias_fwd(F32, l, y, b, r, c)
    }

    fn bias_bwd(&mut self, db: DevPtr, dy: DevPtr, rows: usize, cols: usize) -> Result<()> {
        let (r, c) = (i32_of(rows, "rows")?, i32_of(cols, "cols")?);
        self.k()
            .bias_bwd(F32, launch::per_column(cols), db, dy, r, c)
    }

    fn add(&mut self, y: DevPtr, x: DevPtr, len: usize) -> Result<()> {
        let l = launch::elementwise(len, self.sms());
        self.k().add(F32, l, y, x, len as i64)
    }

    fn zero(&mut self, dst: DevPtr, len: usize) -> Result<()> {
        // SAFETY: the range was checked by the program; stream-ordered.
        let r =
            unsafe { cudarc::driver::sys::cuMemsetD32Async(dst, 0, len, self.stream.cu_stream()) };
        drv(r.result(), "zero a device buffer")
    }

    fn fixed_grad_blocks(&self) -> bool {
        false
    }

    fn precision(&self) -> Precision {
        match self.bf16 {
            Some(_) => Precision::Bf16,
            None => Precision::Fp32,
        }
    }

    fn round_bf16(&mut self, p: DevPtr, len: usize) -> Result<()> {
        // To bf16 (nearest even) in the first operand buffer, and back.
        let (a16, _) = self.bf16_operands(len, "round_bf16")?;
        let l = launch::elementwise(len, self.sms());
        self.k().cast_f32_bf16(l, a16, p, len as i64)?;
        self.k().cast_bf16_f32(l, p, a16, len as i64)
    }

    fn rmsnorm_fwd(
        &mut self,
        y: DevPtr,
        rstd: DevPtr,
        x: DevPtr,
        w: DevPtr,
        rows: usize,
        c: usize,
        eps: f32,
    ) -> Result<()> {
        let (r, ci) = (i32_of(rows, "rows")?, i32_of(c, "hidden")?);
        let l = launch::per_row(rows, c)?;
        self.k().rmsnorm_fwd(F32, l, y, rstd, x, w, r, ci, eps)
    }

    fn rmsnorm_bwd(
        &mut self,
        dx: DevPtr,
        dw: DevPtr,
        dy: DevPtr,
        x: DevPtr,
        w: DevPtr,
        rstd: DevPtr,
        rows: usize,
        c: usize,
        accumulate: bool,
    ) -> Result<()> {
        let (r, ci) = (i32_of(rows, "rows")?, i32_of(c, "hidden")?);
        let l = launch::per_row(rows, c)?;
        self.k()
            .rmsnorm_bwd(F32, l, dx, dy, x, w, rstd, r, ci, accumulate)?;
        self.k()
            .rmsnorm_bwd_dw(F32, launch::per_column(c), dw, dy, x, rstd, r, ci)
    }

    fn rope(
        &mut self,
        x: DevPtr,
        pos: DevPtr,
        rows: usize,
        heads: usize,
        inverse: bool,
    ) -> Result<()> {
        // Positions were checked on the host (`Templates::check_batch`: each < T ≤ the table).
        let (cos, sin) = self.tables();
        let (n, h, hd) = (
            i32_of(rows, "rows")?,
            i32_of(heads, "heads")?,
            i32_of(self.head_dim, "head_dim")?,
        );
        let l = launch::elementwise(rows * heads * self.head_dim / 2, self.sms());
        self.k().rope(F32, inverse, l, x, cos, sin, pos, n, h, hd)
    }

    fn attention_fwd(
        &mut self,
        o: DevPtr,
        lse: DevPtr,
        q: DevPtr,
        kk: DevPtr,
        v: DevPtr,
        pos: DevPtr,
        s: AttnShape,
    ) -> Result<()> {
        let a = AttnArgs::new(s, pos)?;
        if let Some(g) = self.flash(s)? {
            return self.k().flash_fwd(&g, o, lse, q, kk, v, a);
        }
        let g = launch::attention(s, self.smem)?;
        self.k().attention_fwd(F32, &g, o, lse, q, kk, v, a)
    }

    fn attention_bwd(
        &mut self,
        dq: DevPtr,
        dk: DevPtr,
        dv: DevPtr,
        delta: DevPtr,
        d_o: DevPtr,
        q: DevPtr,
        kk: DevPtr,
        v: DevPtr,
        o: DevPtr,
        lse: DevPtr,
        pos: DevPtr,
        s: AttnShape,
    ) -> Result<()> {
        let a = AttnArgs::new(s, pos)?;
        if let Some(g) = self.flash(s)? {
            self.k()
                .flash_bwd(&g, dq, delta, d_o, o, q, kk, v, lse, a)?;
            return self
                .k()
                .flash_bwd_kv(&g, dk, dv, d_o, q, kk, v, lse, delta, a);
        }
        let g = launch::attention(s, self.smem)?;
        self.k()
            .attention_bwd(F32, &g, dq, delta, d_o, o, q, kk, v, lse, a)?;
        self.k()
            .attention_bwd_kv(F32, &g, dk, dv, d_o, q, kk, v, lse, delta, a)
    }

    fn swiglu_fwd(&mut self, h: DevPtr, g: DevPtr, u: DevPtr, len: usize) -> Result<()> {
        let l = launch::elementwise(len, self.sms());
        self.k().swiglu_fwd(F32, l, h, g, u, len as i64)
    }

    fn swiglu_bwd(
        &mut self,
        dg: DevPtr,
        du: DevPtr,
        dh: DevPtr,
        g: DevPtr,
        u: DevPtr,
        len: usize,
    ) -> Result<()> {
        let l = launch::elementwise(len, self.sms());
        self.k().swiglu_bwd(F32, l, dg, du, dh, g, u, len as i64)
    }

    fn embed_fwd(
        &mut self,
        x: DevPtr,
        e: DevPtr,
        ids: DevPtr,
        rows: usize,
        c: usize,
        _vocab: usize,
    ) -> Result<()> {
        let (n, ci) = (i32_of(rows, "rows")?, i32_of(c, "hidden")?);
        let l = launch::elementwise(rows * c, self.sms());
        self.k().embedding_fwd(F32, l, x, e, ids, n, ci)
    }

    fn embed_bwd(
        &mut self,
        de: DevPtr,
        ids: DevPtr,
        dx: DevPtr,
        rows: usize,
        c: usize,
        _vocab: usize,
    ) -> Result<()> {
        let (n, ci) = (i32_of(rows, "rows")?, i32_of(c, "hidden")?);
        let l = launch::elementwise(rows * c, self.sms());
        self.k().embedding_bwd(F32, l, de, dx, ids, n, ci)
    }

    fn cross_entropy(
        &mut self,
        logits: DevPtr,
        losses: DevPtr,
        targets: DevPtr,
        rows: usize,
        vocab: usize,
        scale: f32,
    ) -> Result<()> {
        let (r, v) = (i32_of(rows, "rows")?, i32_of(vocab, "vocab")?);
        let l = launch::per_row(rows, vocab)?;
        self.k()
            .cross_entropy_bwd(F32, l, logits, losses, targets, r, v, scale)
    }

    fn add_loss(&mut self, losses: DevPtr, rows: usize, into: Arc<Mutex<f64>>) -> Result<()> {
        if 4 * rows > self.losses.bytes() {
            return Err(Error::internal(
                "CUDA backend",
                format!(
                    "losses of {rows} rows for a buffer of {}",
                    self.losses.bytes() / 4
                ),
            ));
        }
        let host = SendPtr(self.losses.as_ptr().cast::<f32>());
        // SAFETY: page-locked destination of ≥ 4·rows bytes; the host function below reads it
        // before anything later on this stream (the next copy into it) runs.
        let r = unsafe {
            cudarc::driver::sys::cuMemcpyDtoHAsync_v2(
                host.0.cast(),
                losses,
                4 * rows,
                self.stream.cu_stream(),
            )
        };
        drv(r.result(), "copy the losses to the host")?;
        host_fn(&self.stream, move || {
            let host = host;
            // SAFETY: the copy above completed (stream order) and nothing else writes it now.
            let l = unsafe { std::slice::from_raw_parts(host.0, rows) };
            let s: f64 = l.iter().map(|x| f64::from(*x)).sum();
            *crate::util::lock(&into) += s;
        })
    }
}
