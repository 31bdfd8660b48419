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

use super::blas::Blas;
use super::launches::{i32_of, AttnArgs, Dtype, Launcher};
use super::pinned::{host_fn, Pinned};
use super::runtime::{drv, CudaRuntime, DevPtr};
use crate::device::launch;
use crate::device::program::{Backend, Gemm, MoeAt};
use crate::device::Precision;
use crate::model::config::MlpActivation;
use crate::model::ops::{AttnShape, AuxGrad, ExpertLoad, MoeShape, Rope};
use crate::{Error, Result};
use cudarc::cublas::sys::cublasOperation_t as Op;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::sync::{Arc, Mutex};

mod ids;
mod moe;
mod sinks;
use ids::IdsBuffer;

/// A raw pointer handed to a host function.
#[derive(Clone, Copy)]
struct SendPtr<T>(*mut T);
// SAFETY: the memory it points to is kept alive and ordered by the stream the function runs in.
unsafe impl<T> Send for SendPtr<T> {}

const F32: Dtype = Dtype::F32;

/// A device address as the program passes it: of f32 elements, or of the bf16 elements of a
/// bf16 device's weight buffer (what [`Backend::off`] steps by, and which kernel family reads
/// it).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DevP {
    /// The raw address.
    pub addr: DevPtr,
    /// bf16 elements.
    pub bf16: bool,
}

impl DevP {
    /// f32 elements at `addr`.
    pub fn f32(addr: DevPtr) -> Self {
        DevP { addr, bf16: false }
    }

    /// bf16 elements at `addr`.
    pub fn bf16(addr: DevPtr) -> Self {
        DevP { addr, bf16: true }
    }
}

/// The CUDA backend of the device program.
#[derive(Debug)]
pub struct CudaBackend {
    rt: Arc<CudaRuntime>,
    stream: Arc<CudaStream>,
    blas: Blas,
    cos: CudaSlice<f32>,
    sin: CudaSlice<f32>,
    head_dim: usize,
    /// RoPE tables uploaded, and the positions each covers.
    rope_tables: usize,
    rope_rows: usize,
    ids: IdsBuffer,
    positions: IdsBuffer,
    /// The micro-batch's tokens grouped for the embedding gradient (`launch::group_tokens`).
    groups: IdsBuffer,
    /// The micro-batch whose positions `positions` holds (kept alive, so its address is not
    /// reused by another).
    positions_of: Option<Arc<[u32]>>,
    losses: Pinned,
    /// Where [`Backend::read_back`] lands, once it was asked.
    read_back: Option<Pinned>,
    smem: usize,
    /// Under bf16: two bf16 buffers for a GEMM's operands.
    bf16: Option<Bf16Operands>,
    /// The mixture-of-experts MLP's scratch, once one ran.
    moe: Option<moe::MoeScratch>,
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
        let blas = Blas::new(&stream, tf32)?;
        let (c, s) = rope.tables();
        let cos = drv(stream.clone_htod(c), "upload the RoPE tables")?;
        let sin = drv(stream.clone_htod(s), "upload the RoPE tables")?;
        let ids = IdsBuffer::new(&rt, &stream, n)?;
        let groups = IdsBuffer::new(&rt, &stream, 3 * n + 1)?;
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
            rope_tables: rope.tables,
            rope_rows: rope.max_pos,
            ids,
            groups,
            positions,
            positions_of: None,
            losses,
            read_back: None,
            smem,
            bf16,
            moe: None,
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
    /// An operand already in bf16 (a bf16 device's weight) is used as it is.
    fn gemm_bf16(&mut self, g: Gemm<DevP>, c: launch::ColMajorGemm) -> Result<()> {
        use cudarc::cublas::sys::{cublasComputeType_t, cublasGemmAlgo_t, cudaDataType_t};
        let [gc] = f32s([g.c], "gemm output")?;
        let (a_len, b_len) = (g.m * g.k, g.k * g.n);
        // Room for the operands to cast (a bf16 one is used as it is).
        let cast_len = |x: DevP, len: usize| if x.bf16 { 0 } else { len };
        let room = cast_len(g.a, a_len).max(cast_len(g.b, b_len));
        let (a_buf, b_buf) = self.bf16_operands(room, "gemm")?;
        let sms = self.sms();
        let operand = |x: DevP, len: usize, buf: DevPtr| -> Result<DevPtr> {
            if x.bf16 {
                return Ok(x.addr);
            }
            self.k()
                .cast_f32_bf16(launch::elementwise(len, sms), buf, x.addr, len as i64)?;
            Ok(buf)
        };
        let a16 = operand(g.a, a_len, a_buf)?;
        let b16 = operand(g.b, b_len, b_buf)?;
        let op = |t: bool| if t { Op::CUBLAS_OP_T } else { Op::CUBLAS_OP_N };
        let (alpha, beta) = (1.0f32, if g.accumulate { 1.0f32 } else { 0.0 });
        // SAFETY: A (m·k) and B (k·n) are bf16 (weights as held, or copies written before this
        // call on the same stream); C holds m·n fp32 (checked by the program).
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
                gc as *mut _,
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

    /// The tensor-core attention's geometry when it takes `s`: under bf16 (its inputs are in
    /// bf16 there; in fp32 they are not) and for a head dim it is instantiated for.
    fn flash(&self, s: AttnShape) -> Result<Option<launch::FlashLaunch>> {
        match self.bf16 {
            Some(_) => launch::flash(s),
            None => Ok(None),
        }
    }

    /// The attention kernels' family for inputs `ins` (Q, K, V and dO) and their addresses:
    /// `f32i16` under bf16, where the program stores them in bf16, else `f32`. Inputs in the
    /// other precision are a bug in the program.
    fn attention_inputs<const N: usize>(
        &self,
        ins: [DevP; N],
        what: &str,
    ) -> Result<(Dtype, [DevPtr; N])> {
        let bf16 = self.bf16.is_some();
        if ins.iter().any(|p| p.bf16 != bf16) {
            return Err(Error::internal(
                "CUDA backend",
                format!("{what}: attention inputs not all in the recipe's storage"),
            ));
        }
        let dt = if bf16 { Dtype::F32I16 } else { F32 };
        Ok((dt, ins.map(|p| p.addr)))
    }

    /// The cos and sin rows of RoPE table `table` (tables lie end to end, `rope_rows` rows of
    /// `hd/2` each).
    fn tables(&self, table: usize) -> Result<(DevPtr, DevPtr)> {
        if table >= self.rope_tables {
            return Err(Error::internal(
                "CUDA backend",
                format!("rope: table {table} of {}", self.rope_tables),
            ));
        }
        let (c, _g1) = self.cos.device_ptr(&self.stream);
        let (s, _g2) = self.sin.device_ptr(&self.stream);
        let skip = 4 * (table * self.rope_rows * (self.head_dim / 2)) as u64;
        Ok((c + skip, s + skip))
    }
}

impl Backend for CudaBackend {
    type P = DevP;
    type Ids = DevPtr;

    fn off(p: DevP, elems: usize) -> DevP {
        let elem = if p.bf16 { 2 } else { 4 };
        DevP {
            addr: p.addr + elem * elems as u64,
            bf16: p.bf16,
        }
    }

    fn as_bf16(p: DevP) -> DevP {
        DevP::bf16(p.addr)
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

    fn gemm(&mut self, g: Gemm<DevP>) -> Result<()> {
        if g.m == 0 || g.n == 0 {
            return Ok(());
        }
        let c = launch::row_major_gemm(g.m, g.k, g.n, g.ta, g.tb);
        if self.bf16.is_some() {
            return self.gemm_bf16(g, c);
        }
        let [gc, ga, gb] = f32s([g.c, g.a, g.b], "gemm")?;
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
                gb as *const f32,
                i32_of(c.ld_first, "gemm ld")?,
                ga as *const f32,
                i32_of(c.ld_second, "gemm ld")?,
                &beta,
                gc as *mut f32,
                i32_of(c.ldc, "gemm ld")?,
            )
        }
        .map_err(|e| Error::cuda("sgemm", e))
    }

    fn bias_fwd(&mut self, y: DevP, b: DevP, rows: usize, cols: usize) -> Result<()> {
        let [y] = f32s([y], "bias_fwd")?;
        let (r, c) = (i32_of(rows, "rows")?, i32_of(cols, "cols")?);
        let l = launch::elementwise(rows * cols, self.sms());
        self.k().bias_fwd(weight_dtype(b), l, y, b.addr, r, c)
    }

    fn bias_bwd(&mut self, db: DevP, dy: DevP, rows: usize, cols: usize) -> Result<()> {
        let [db, dy] = f32s([db, dy], "bias_bwd")?;
        let (r, c) = (i32_of(rows, "rows")?, i32_of(cols, "cols")?);
        self.k()
            .bias_bwd(F32, launch::per_column(cols), db, dy, r, c)
    }

    fn add(&mut self, y: DevP, x: DevP, len: usize) -> Result<()> {
        let [y, x] = f32s([y, x], "add")?;
        let l = launch::elementwise(len, self.sms());
        self.k().add(F32, l, y, x, len as i64)
    }

    fn zero(&mut self, dst: DevP, len: usize) -> Result<()> {
        let [dst] = f32s([dst], "zero")?;
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

    fn stored(&self) -> Precision {
        self.precision()
    }

    fn store_bf16(&mut self, dst: DevP, src: DevP, len: usize) -> Result<()> {
        if !dst.bf16 {
            return Err(Error::internal(
                "CUDA backend",
                "store_bf16: an fp32 destination",
            ));
        }
        let [src] = f32s([src], "store_bf16")?;
        let l = launch::elementwise(len, self.sms());
        self.k().cast_f32_bf16(l, dst.addr, src, len as i64)
    }

    fn load_bf16(&mut self, dst: DevP, src: DevP, len: usize) -> Result<()> {
        if !src.bf16 {
            return Err(Error::internal("CUDA backend", "load_bf16: an fp32 source"));
        }
        let [dst] = f32s([dst], "load_bf16")?;
        let l = launch::elementwise(len, self.sms());
        self.k().cast_bf16_f32(l, dst, src.addr, len as i64)
    }

    fn rmsnorm_fwd(
        &mut self,
        y: DevP,
        rstd: DevP,
        x: DevP,
        (w, w_offset): (DevP, f32),
        rows: usize,
        c: usize,
        eps: f32,
    ) -> Result<()> {
        // A bf16 output is a GEMM's input, kept in bf16 (with bf16 weights: a bf16 device's).
        let dt = match (y.bf16, w.bf16) {
            (true, true) => Dtype::F32W16O16,
            (true, false) => {
                return Err(Error::internal(
                    "CUDA backend",
                    "rmsnorm_fwd: a bf16 output with fp32 weights",
                ))
            }
            (false, _) => weight_dtype(w),
        };
        let [rstd, x] = f32s([rstd, x], "rmsnorm_fwd")?;
        let (r, ci) = (i32_of(rows, "rows")?, i32_of(c, "hidden")?);
        let l = launch::per_row(rows, c)?;
        self.k()
            .rmsnorm_fwd(dt, l, y.addr, rstd, x, (w.addr, w_offset), r, ci, eps)
    }

    fn rmsnorm_bwd(
        &mut self,
        dx: DevP,
        dw: DevP,
        dy: DevP,
        x: DevP,
        (w, w_offset): (DevP, f32),
        rstd: DevP,
        rows: usize,
        c: usize,
        accumulate: bool,
    ) -> Result<()> {
        let [dx, dw, dy, x, rstd] = f32s([dx, dw, dy, x, rstd], "rmsnorm_bwd")?;
        let (r, ci) = (i32_of(rows, "rows")?, i32_of(c, "hidden")?);
        let l = launch::per_row(rows, c)?;
        self.k().rmsnorm_bwd(
            weight_dtype(w),
            l,
            dx,
            dy,
            x,
            (w.addr, w_offset),
            rstd,
            r,
            ci,
            accumulate,
        )?;
        self.k()
            .rmsnorm_bwd_dw(F32, launch::per_column(c), dw, dy, x, rstd, r, ci)
    }

    fn rope(
        &mut self,
        y: DevP,
        x: DevP,
        pos: DevPtr,
        (rows, heads): (usize, usize),
        inverse: bool,
        table: usize,
    ) -> Result<()> {
        let [x] = f32s([x], "rope")?;
        // A bf16 output is a stored Q or K (or dQ, dK for their GEMMs).
        let dt = if y.bf16 { Dtype::F32O16 } else { F32 };
        // Positions were checked on the host (`Templates::check_batch`: each < T ≤ the table).
        let (cos, sin) = self.tables(table)?;
        let (n, h, hd) = (
            i32_of(rows, "rows")?,
            i32_of(heads, "heads")?,
            i32_of(self.head_dim, "head_dim")?,
        );
        let l = launch::elementwise(rows * heads * self.head_dim / 2, self.sms());
        self.k()
            .rope(dt, inverse, l, y.addr, x, cos, sin, pos, n, h, hd)
    }

    fn attention_fwd(
        &mut self,
        o: DevP,
        lse: DevP,
        q: DevP,
        kk: DevP,
        v: DevP,
        pos: DevPtr,
        s: AttnShape,
    ) -> Result<()> {
        let [o, lse] = f32s([o, lse], "attention_fwd")?;
        let (dt, [q, kk, v]) = self.attention_inputs([q, kk, v], "attention_fwd")?;
        let a = AttnArgs::new(s, pos)?;
        if let Some(g) = self.flash(s)? {
            return self.k().flash_fwd(&g, o, lse, q, kk, v, a);
        }
        let g = launch::attention(s, self.smem)?;
        self.k().attention_fwd(dt, &g, o, lse, q, kk, v, a)
    }

    fn attention_bwd(
        &mut self,
        dq: DevP,
        dk: DevP,
        dv: DevP,
        delta: DevP,
        d_o: DevP,
        q: DevP,
        kk: DevP,
        v: DevP,
        o: DevP,
        lse: DevP,
        pos: DevPtr,
        s: AttnShape,
    ) -> Result<()> {
        let [dq, dk, dv, delta, o, lse] = f32s([dq, dk, dv, delta, o, lse], "attention_bwd")?;
        let (dt, [d_o, q, kk, v]) = self.attention_inputs([d_o, q, kk, v], "attention_bwd")?;
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
            .attention_bwd(dt, &g, dq, delta, d_o, o, q, kk, v, lse, a)?;
        self.k()
            .attention_bwd_kv(dt, &g, dk, dv, d_o, q, kk, v, lse, delta, a)
    }

    fn gated_fwd(
        &mut self,
        act: MlpActivation,
        h: DevP,
        g: DevP,
        u: DevP,
        len: usize,
    ) -> Result<()> {
        // A bf16 output is the down projection's input, kept in bf16.
        let dt = if h.bf16 { Dtype::F32O16 } else { F32 };
        let [g, u] = f32s([g, u], "gated_fwd")?;
        let l = launch::elementwise(len, self.sms());
        self.k().gated_fwd(act, dt, l, h.addr, g, u, len as i64)
    }

    fn attn_sinks_fwd(&mut self, o: DevP, lse: DevP, sinks: DevP, s: AttnShape) -> Result<()> {
        self.sinks_forward(o, lse, sinks, s)
    }

    fn attn_sinks_bwd(
        &mut self,
        ds: DevP,
        d_o: DevP,
        o: DevP,
        lse: DevP,
        sinks: DevP,
        s: AttnShape,
    ) -> Result<()> {
        self.sinks_backward(ds, (d_o, o, lse, sinks), s)
    }

    fn moe_fwd(
        &mut self,
        out: DevP,
        h: DevP,
        w: MoeAt<DevP>,
        rows: usize,
        s: MoeShape,
        pad: Option<&[u8]>,
    ) -> Result<ExpertLoad> {
        self.moe_forward(out, h, w, rows, s, pad)
    }

    fn moe_bwd(
        &mut self,
        dh: DevP,
        g: MoeAt<DevP>,
        d_out: DevP,
        h: DevP,
        w: MoeAt<DevP>,
        rows: usize,
        s: MoeShape,
        aux: Option<AuxGrad<'_>>,
    ) -> Result<()> {
        self.moe_backward(dh, g, d_out, h, w, rows, s, aux)
    }

    fn gated_bwd(
        &mut self,
        act: MlpActivation,
        dg: DevP,
        du: DevP,
        dh: DevP,
        g: DevP,
        u: DevP,
        len: usize,
    ) -> Result<()> {
        // bf16 outputs are GEMM inputs, kept in bf16 (both or neither).
        let dt = match (dg.bf16, du.bf16) {
            (true, true) => Dtype::F32O16,
            (false, false) => F32,
            _ => {
                return Err(Error::internal(
                    "CUDA backend",
                    "gated_bwd: one output in bf16, the other in fp32",
                ))
            }
        };
        let [dh, g, u] = f32s([dh, g, u], "gated_bwd")?;
        let l = launch::elementwise(len, self.sms());
        self.k()
            .gated_bwd(act, dt, l, dg.addr, du.addr, dh, g, u, len as i64)
    }

    fn embed_fwd(
        &mut self,
        x: DevP,
        e: DevP,
        ids: DevPtr,
        (rows, c, _vocab): (usize, usize, usize),
        scale: f32,
    ) -> Result<()> {
        let [x] = f32s([x], "embed_fwd")?;
        let (n, ci) = (i32_of(rows, "rows")?, i32_of(c, "hidden")?);
        let l = launch::elementwise(rows * c, self.sms());
        self.k()
            .embedding_fwd(weight_dtype(e), l, x, e.addr, ids, (n, ci), scale)
    }

    fn embed_bwd(
        &mut self,
        de: DevP,
        tokens: &[u32],
        dx: DevP,
        (rows, c, vocab): (usize, usize, usize),
        scale: f32,
        pad: Option<u32>,
    ) -> Result<()> {
        let [de, dx] = f32s([de, dx], "embed_bwd")?;
        let tokens = tokens.get(..rows).ok_or_else(|| {
            Error::internal(
                "CUDA backend",
                format!("embed_bwd: {} token ids for {rows} rows", tokens.len()),
            )
        })?;
        let g = launch::group_tokens(tokens, vocab, pad)?;
        let groups = self
            .groups
            .upload(&self.stream, &g.packed, "grouped token ids")?;
        let (n, u, ci) = (
            i32_of(rows, "rows")?,
            i32_of(g.groups, "distinct tokens")?,
            i32_of(c, "hidden")?,
        );
        let l = launch::elementwise(g.groups * c, self.sms());
        self.k()
            .embedding_bwd(F32, l, de, dx, groups, (n, u), ci, scale)
    }

    fn cross_entropy(
        &mut self,
        logits: DevP,
        losses: DevP,
        targets: DevPtr,
        rows: usize,
        vocab: usize,
        (scale, softcap): (f32, Option<f32>),
    ) -> Result<()> {
        let [logits, losses] = f32s([logits, losses], "cross_entropy")?;
        let (r, v) = (i32_of(rows, "rows")?, i32_of(vocab, "vocab")?);
        let l = launch::per_row(rows, vocab)?;
        let cap = softcap.unwrap_or(0.0);
        self.k()
            .cross_entropy_bwd(F32, l, logits, losses, targets, (r, v), scale, cap)
    }

    fn add_loss(&mut self, losses: DevP, rows: usize, into: Arc<Mutex<f64>>) -> Result<()> {
        let [losses] = f32s([losses], "add_loss")?;
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

    fn read_back(&mut self, src: DevP, len: usize, into: Arc<Mutex<Vec<f32>>>) -> Result<()> {
        let [src] = f32s([src], "read_back")?;
        // One page-locked buffer of the first length asked (a model's vocabulary), kept.
        if self.read_back.is_none() {
            self.read_back = Some(Pinned::new(&self.rt.ctx, 4 * len.max(1))?);
        }
        let pinned = match &self.read_back {
            Some(p) if p.bytes() >= 4 * len => p,
            p => {
                return Err(Error::internal(
                    "CUDA backend",
                    format!(
                        "read back {len} values into a buffer of {}",
                        p.as_ref().map_or(0, |p| p.bytes() / 4)
                    ),
                ))
            }
        };
        let host = SendPtr(pinned.as_ptr().cast::<f32>());
        // SAFETY: page-locked destination of ≥ 4·len bytes; the host function below reads it
        // before anything later on this stream (the next copy into it) runs.
        let r = unsafe {
            cudarc::driver::sys::cuMemcpyDtoHAsync_v2(
                host.0.cast(),
                src,
                4 * len,
                self.stream.cu_stream(),
            )
        };
        drv(r.result(), "copy a row of logits to the host")?;
        host_fn(&self.stream, move || {
            let host = host;
            // SAFETY: the copy above completed (stream order) and nothing else writes it now.
            let x = unsafe { std::slice::from_raw_parts(host.0, len) };
            let mut dst = crate::util::lock(&into);
            dst.clear();
            dst.extend_from_slice(x);
        })
    }
}

/// The addresses of tensors an op reads and writes as fp32 (`what` names the op): a bf16 weight
/// among them is a bug in the program, not a value to misread.
fn f32s<const N: usize>(ps: [DevP; N], what: &str) -> Result<[DevPtr; N]> {
    if ps.iter().any(|p| p.bf16) {
        return Err(Error::internal(
            "CUDA backend",
            format!("{what}: bf16 weights where fp32 is read or written"),
        ));
    }
    Ok(ps.map(|p| p.addr))
}

/// The kernel family for fp32 activations and weights `w`: `f32w16` when `w` is a bf16
/// device's weight.
fn weight_dtype(w: DevP) -> Dtype {
    if w.bf16 {
        Dtype::F32W16
    } else {
        F32
    }
}
