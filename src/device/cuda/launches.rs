//! One typed launch wrapper per kernel of `kernels/*.cu`. Each passes its arguments as the
//! kernel's C signature declares them, and every launch is checked against the declared
//! [`Signature`](crate::device::kernels::Signature) before it reaches the driver — which the test
//! suite checks against the compiled PTX — so an argument list cannot drift from its kernel.

use super::runtime::{CudaRuntime, DevPtr};
use crate::device::kernels::{signature, Param};
use crate::device::launch::{AttnLaunch, AttnShape, FlashLaunch, Launch};
use crate::model::config::MlpActivation;
use crate::{Error, Result};
use cudarc::driver::CudaStream;

mod moe;
pub use moe::{ExpertRows, ExpertSums};

/// The storage type of a kernel family (the symbol's `_f32`/`_bf16`/`_f32w16` suffix); math is
/// fp32.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Dtype {
    /// fp32 storage.
    F32,
    /// bf16 storage.
    Bf16,
    /// fp32 activations and bf16 weights (a bf16 device's weight buffers): the kernels that read
    /// weights (embedding forward, RMSNorm forward and dx, bias forward).
    F32W16,
    /// RMSNorm forward from fp32 input and bf16 weights into a bf16 output (a GEMM's input).
    F32W16O16,
    /// SwiGLU forward and backward, RoPE: fp32 inputs into a bf16 output (a GEMM's or
    /// attention's input).
    F32O16,
    /// Attention from bf16 inputs (Q, K, V, dO: the bf16 recipe stores them in bf16) into fp32
    /// outputs (O, dQ, dK, dV).
    F32I16,
}

impl Dtype {
    fn symbol(self, stem: &str) -> String {
        match self {
            Dtype::F32 => format!("{stem}_f32"),
            Dtype::Bf16 => format!("{stem}_bf16"),
            Dtype::F32W16 => format!("{stem}_f32w16"),
            Dtype::F32W16O16 => format!("{stem}_f32w16o16"),
            Dtype::F32O16 => format!("{stem}_f32o16"),
            Dtype::F32I16 => format!("{stem}_f32i16"),
        }
    }
}

/// A kernel argument by value.
#[derive(Debug, Clone, Copy)]
enum Arg {
    Ptr(DevPtr),
    I32(i32),
    I64(i64),
    F32(f32),
}

impl Arg {
    fn param(self) -> Param {
        match self {
            Arg::Ptr(_) => Param::Ptr,
            Arg::I32(_) => Param::I32,
            Arg::I64(_) => Param::I64,
            Arg::F32(_) => Param::F32,
        }
    }

    /// Where the value lives, as `cuLaunchKernel` takes it.
    fn as_mut_ptr(&mut self) -> *mut std::ffi::c_void {
        match self {
            Arg::Ptr(v) => (v as *mut u64).cast(),
            Arg::I32(v) => (v as *mut i32).cast(),
            Arg::I64(v) => (v as *mut i64).cast(),
            Arg::F32(v) => (v as *mut f32).cast(),
        }
    }
}

/// The arguments every attention kernel takes: the tokens' positions in their documents
/// (`[B·T]` u32) and the scalars.
#[derive(Debug, Clone, Copy)]
pub struct AttnArgs {
    pos: DevPtr,
    t: i32,
    /// The sliding window (0: none; a window as long as the sequence is none).
    window: i32,
    q0: i32,
    q1: i32,
    nh: i32,
    nkv: i32,
    hd: i32,
    scale: f32,
    /// The scores' soft cap (0: none).
    softcap: f32,
}

impl AttnArgs {
    /// For `s` with positions `pos`: softmax scale [`AttnShape::softmax_scale`], its soft cap.
    pub fn new(s: AttnShape, pos: DevPtr) -> Result<Self> {
        Ok(AttnArgs {
            pos,
            t: i32_of(s.t, "sequence length")?,
            window: match s.window {
                Some(w) if w < s.t => i32_of(w, "sliding window")?,
                _ => 0,
            },
            q0: i32_of(s.q0, "first query")?,
            q1: i32_of(s.q1, "last query")?,
            nh: i32_of(s.nh, "heads")?,
            nkv: i32_of(s.nkv, "kv heads")?,
            hd: i32_of(s.hd, "head dim")?,
            scale: s.softmax_scale(),
            softcap: s.softcap.unwrap_or(0.0),
        })
    }

    /// The SIMT kernels' trailing arguments, with their shared-memory `tile`.
    fn simt(self, tile: u32) -> [Arg; 11] {
        [
            Arg::Ptr(self.pos),
            Arg::I32(self.t),
            Arg::I32(self.window),
            Arg::I32(self.q0),
            Arg::I32(self.q1),
            Arg::I32(self.nh),
            Arg::I32(self.nkv),
            Arg::I32(self.hd),
            Arg::I32(tile as i32),
            Arg::F32(self.scale),
            Arg::F32(self.softcap),
        ]
    }

    /// The tensor-core kernels' trailing arguments (the head dim and tiles are compiled in; they
    /// take no soft cap: [`crate::device::launch::flash`]).
    fn flash(self) -> [Arg; 8] {
        [
            Arg::Ptr(self.pos),
            Arg::I32(self.t),
            Arg::I32(self.window),
            Arg::I32(self.q0),
            Arg::I32(self.q1),
            Arg::I32(self.nh),
            Arg::I32(self.nkv),
            Arg::F32(self.scale),
        ]
    }
}

/// The eight pointers that open both attention backward kernels' argument lists.
fn attn_bwd_ptrs(p: [DevPtr; 8]) -> Vec<Arg> {
    p.into_iter().map(Arg::Ptr).collect()
}

/// `v` as a kernel's 32-bit count, or an error naming `what`.
pub fn i32_of(v: usize, what: &str) -> Result<i32> {
    i32::try_from(v).map_err(|_| {
        Error::bad_input(
            "CUDA kernel argument",
            what.to_owned(),
            format!("{v} exceeds the kernels' 32-bit index"),
            Some("lower --batch-size / --seq-len"),
        )
    })
}

/// Launches on one stream.
#[derive(Debug, Clone, Copy)]
pub struct Launcher<'a> {
    /// Where the kernels are loaded.
    pub rt: &'a CudaRuntime,
    /// The stream they run on.
    pub stream: &'a CudaStream,
}

use Arg::{Ptr, F32, I32, I64};

impl Launcher<'_> {
    fn launch(&self, name: &str, l: Launch, args: &[Arg]) -> Result<()> {
        let sig = signature(name)
            .ok_or_else(|| Error::internal("CUDA launch", format!("no kernel {name}")))?;
        let given: Vec<Param> = args.iter().map(|a| a.param()).collect();
        if given != sig.params {
            return Err(Error::internal(
                "CUDA launch",
                format!("{name} takes {:?}, the launch passes {given:?}", sig.params),
            ));
        }
        let f = self.rt.function(name)?;
        let mut values = args.to_vec();
        let mut ptrs: Vec<*mut std::ffi::c_void> = values.iter_mut().map(Arg::as_mut_ptr).collect();
        super::runtime::drv(self.rt.ctx.bind_to_thread(), "bind the context")?;
        // SAFETY: the argument list matches the kernel's declared (and PTX-checked) parameter
        // types one for one; `values` outlives the call; every pointer argument addresses a
        // device range the caller sized for this shape.
        unsafe {
            cudarc::driver::result::launch_kernel(
                f.cu_function(),
                l.grid,
                (l.block, 1, 1),
                l.smem,
                self.stream.cu_stream(),
                &mut ptrs,
            )
        }
        .map_err(|e| Error::cuda(format!("launch {name}"), e))
    }

    /// `out[r] = wte[tokens[r]]·scale`.
    #[allow(clippy::too_many_arguments)]
    pub fn embedding_fwd(
        &self,
        dt: Dtype,
        l: Launch,
        out: DevPtr,
        wte: DevPtr,
        tokens: DevPtr,
        (n, c): (i32, i32),
        scale: f32,
    ) -> Result<()> {
        self.launch(
            &dt.symbol("embedding_fwd"),
            l,
            &[Ptr(out), Ptr(wte), Ptr(tokens), I32(n), I32(c), F32(scale)],
        )
    }

    /// `dwte[t] += Σ dout[r]·scale` over each token's rows in order (fp32 accumulator), from
    /// the tokens grouped by [`crate::device::launch::group_tokens`] (`u` groups).
    #[allow(clippy::too_many_arguments)]
    pub fn embedding_bwd(
        &self,
        dt: Dtype,
        l: Launch,
        dwte: DevPtr,
        dout: DevPtr,
        groups: DevPtr,
        (n, u): (i32, i32),
        c: i32,
        scale: f32,
    ) -> Result<()> {
        self.launch(
            &dt.symbol("embedding_bwd"),
            l,
            &[
                Ptr(dwte),
                Ptr(dout),
                Ptr(groups),
                I32(n),
                I32(u),
                I32(c),
                F32(scale),
            ],
        )
    }

    /// RMSNorm forward with weights `w_offset + w`; `rstd` [N].
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_fwd(
        &self,
        dt: Dtype,
        l: Launch,
        out: DevPtr,
        rstd: DevPtr,
        x: DevPtr,
        (w, w_offset): (DevPtr, f32),
        n: i32,
        c: i32,
        eps: f32,
    ) -> Result<()> {
        self.launch(
            &dt.symbol("rmsnorm_fwd"),
            l,
            &[
                Ptr(out),
                Ptr(rstd),
                Ptr(x),
                Ptr(w),
                I32(n),
                I32(c),
                F32(eps),
                F32(w_offset),
            ],
        )
    }

    /// RMSNorm backward, dx: `dx =` (`+=` when `accumulate`).
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_bwd(
        &self,
        dt: Dtype,
        l: Launch,
        dx: DevPtr,
        dout: DevPtr,
        x: DevPtr,
        (w, w_offset): (DevPtr, f32),
        rstd: DevPtr,
        n: i32,
        c: i32,
        accumulate: bool,
    ) -> Result<()> {
        self.launch(
            &dt.symbol("rmsnorm_bwd"),
            l,
            &[
                Ptr(dx),
                Ptr(dout),
                Ptr(x),
                Ptr(w),
                Ptr(rstd),
                I32(n),
                I32(c),
                I32(i32::from(accumulate)),
                F32(w_offset),
            ],
        )
    }

    /// RMSNorm backward, dw: `dw += Σ_rows dout ⊙ x · rstd` by column tiles (no atomics).
    #[allow(clippy::too_many_arguments)]
    pub fn rmsnorm_bwd_dw(
        &self,
        dt: Dtype,
        l: Launch,
        dw: DevPtr,
        dout: DevPtr,
        x: DevPtr,
        rstd: DevPtr,
        n: i32,
        c: i32,
    ) -> Result<()> {
        self.launch(
            &dt.symbol("rmsnorm_bwd_dw"),
            l,
            &[Ptr(dw), Ptr(dout), Ptr(x), Ptr(rstd), I32(n), I32(c)],
        )
    }

    /// `y = RoPE(x)` (`inverse`: the backward; `y` may be `x`); row r at position `pos[r]`
    /// (u32).
    #[allow(clippy::too_many_arguments)]
    pub fn rope(
        &self,
        dt: Dtype,
        inverse: bool,
        l: Launch,
        y: DevPtr,
        x: DevPtr,
        cos: DevPtr,
        sin: DevPtr,
        pos: DevPtr,
        n: i32,
        h: i32,
        hd: i32,
    ) -> Result<()> {
        let stem = if inverse { "rope_bwd" } else { "rope_fwd" };
        self.launch(
            &dt.symbol(stem),
            l,
            &[
                Ptr(y),
                Ptr(x),
                Ptr(cos),
                Ptr(sin),
                Ptr(pos),
                I32(n),
                I32(h),
                I32(hd),
            ],
        )
    }

    /// `out = act(gate)·up` over `n` elements (`swiglu_fwd` or `geglu_fwd`).
    #[allow(clippy::too_many_arguments)]
    pub fn gated_fwd(
        &self,
        act: MlpActivation,
        dt: Dtype,
        l: Launch,
        out: DevPtr,
        gate: DevPtr,
        up: DevPtr,
        n: i64,
    ) -> Result<()> {
        self.launch(
            &dt.symbol(gated_stem(act, "fwd")),
            l,
            &[Ptr(out), Ptr(gate), Ptr(up), I64(n)],
        )
    }

    /// Its backward.
    #[allow(clippy::too_many_arguments)]
    pub fn gated_bwd(
        &self,
        act: MlpActivation,
        dt: Dtype,
        l: Launch,
        dgate: DevPtr,
        dup: DevPtr,
        dout: DevPtr,
        gate: DevPtr,
        up: DevPtr,
        n: i64,
    ) -> Result<()> {
        self.launch(
            &dt.symbol(gated_stem(act, "bwd")),
            l,
            &[Ptr(dgate), Ptr(dup), Ptr(dout), Ptr(gate), Ptr(up), I64(n)],
        )
    }

    /// Causal GQA attention forward for queries q0..q1; `lse` [B, NH, q1−q0] fp32.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_fwd(
        &self,
        dt: Dtype,
        g: &AttnLaunch,
        out: DevPtr,
        lse: DevPtr,
        q: DevPtr,
        k: DevPtr,
        v: DevPtr,
        a: AttnArgs,
    ) -> Result<()> {
        let mut args = vec![Ptr(out), Ptr(lse), Ptr(q), Ptr(k), Ptr(v)];
        args.extend(a.simt(g.tile));
        self.launch(&dt.symbol("attention_fwd"), g.rows, &args)
    }

    /// Attention backward, dq (and `delta` [B, NH, q1−q0], fp32 scratch).
    #[allow(clippy::too_many_arguments)]
    pub fn attention_bwd(
        &self,
        dt: Dtype,
        g: &AttnLaunch,
        dq: DevPtr,
        delta: DevPtr,
        dout: DevPtr,
        out: DevPtr,
        q: DevPtr,
        k: DevPtr,
        v: DevPtr,
        lse: DevPtr,
        a: AttnArgs,
    ) -> Result<()> {
        let mut args = attn_bwd_ptrs([dq, delta, dout, out, q, k, v, lse]);
        args.extend(a.simt(g.tile));
        self.launch(&dt.symbol("attention_bwd"), g.rows, &args)
    }

    /// Attention backward, dk and dv accumulated.
    #[allow(clippy::too_many_arguments)]
    pub fn attention_bwd_kv(
        &self,
        dt: Dtype,
        g: &AttnLaunch,
        dk: DevPtr,
        dv: DevPtr,
        dout: DevPtr,
        q: DevPtr,
        k: DevPtr,
        v: DevPtr,
        lse: DevPtr,
        delta: DevPtr,
        a: AttnArgs,
    ) -> Result<()> {
        let mut args = attn_bwd_ptrs([dk, dv, dout, q, k, v, lse, delta]);
        args.extend(a.simt(g.tile));
        self.launch(&dt.symbol("attention_bwd_kv"), g.kv, &args)
    }

    /// [`Self::attention_fwd`] on the tensor cores (`flash{hd}_fwd_f32i16`): q, k, v in bf16.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_fwd(
        &self,
        g: &FlashLaunch,
        out: DevPtr,
        lse: DevPtr,
        q: DevPtr,
        k: DevPtr,
        v: DevPtr,
        a: AttnArgs,
    ) -> Result<()> {
        let mut args = vec![Ptr(out), Ptr(lse), Ptr(q), Ptr(k), Ptr(v)];
        args.extend(a.flash());
        self.launch(&format!("flash{}_fwd_f32i16", g.hd), g.fwd, &args)
    }

    /// [`Self::attention_bwd`] on the tensor cores (`flash{hd}_bwd_f32i16`): dout in bf16 too.
    #[allow(clippy::too_many_arguments)]
    pub fn flash_bwd(
        &self,
        g: &FlashLaunch,
        dq: DevPtr,
        delta: DevPtr,
        dout: DevPtr,
        out: DevPtr,
        q: DevPtr,
        k: DevPtr,
        v: DevPtr,
        lse: DevPtr,
        a: AttnArgs,
    ) -> Result<()> {
        let mut args = attn_bwd_ptrs([dq, delta, dout, out, q, k, v, lse]);
        args.extend(a.flash());
        self.launch(&format!("flash{}_bwd_f32i16", g.hd), g.dq, &args)
    }

    /// [`Self::attention_bwd_kv`] on the tensor cores (`flash{hd}_bwd_kv_f32i16`).
    #[allow(clippy::too_many_arguments)]
    pub fn flash_bwd_kv(
        &self,
        g: &FlashLaunch,
        dk: DevPtr,
        dv: DevPtr,
        dout: DevPtr,
        q: DevPtr,
        k: DevPtr,
        v: DevPtr,
        lse: DevPtr,
        delta: DevPtr,
        a: AttnArgs,
    ) -> Result<()> {
        let mut args = attn_bwd_ptrs([dk, dv, dout, q, k, v, lse, delta]);
        args.extend(a.flash());
        self.launch(&format!("flash{}_bwd_kv_f32i16", g.hd), g.kv, &args)
    }

    /// Per-row loss of a chunk of logits (soft-capped at `softcap` > 0).
    #[allow(clippy::too_many_arguments)]
    pub fn cross_entropy_fwd(
        &self,
        dt: Dtype,
        l: Launch,
        losses: DevPtr,
        logits: DevPtr,
        targets: DevPtr,
        (rows, vocab): (i32, i32),
        softcap: f32,
    ) -> Result<()> {
        self.launch(
            &dt.symbol("cross_entropy_fwd"),
            l,
            &[
                Ptr(losses),
                Ptr(logits),
                Ptr(targets),
                I32(rows),
                I32(vocab),
                F32(softcap),
            ],
        )
    }

    /// Per-row loss, and the logits replaced by `scale·(softmax − onehot)` (of the logits
    /// soft-capped at `softcap` > 0, taken back through the cap).
    #[allow(clippy::too_many_arguments)]
    pub fn cross_entropy_bwd(
        &self,
        dt: Dtype,
        l: Launch,
        logits: DevPtr,
        losses: DevPtr,
        targets: DevPtr,
        (rows, vocab): (i32, i32),
        scale: f32,
        softcap: f32,
    ) -> Result<()> {
        self.launch(
            &dt.symbol("cross_entropy_bwd"),
            l,
            &[
                Ptr(logits),
                Ptr(losses),
                Ptr(targets),
                I32(rows),
                I32(vocab),
                F32(scale),
                F32(softcap),
            ],
        )
    }

    /// fp32 → bf16, nearest-even.
    pub fn cast_f32_bf16(&self, l: Launch, out: DevPtr, x: DevPtr, n: i64) -> Result<()> {
        self.launch("cast_fwd_f32_bf16", l, &[Ptr(out), Ptr(x), I64(n)])
    }

    /// bf16 → fp32, exact.
    pub fn cast_bf16_f32(&self, l: Launch, out: DevPtr, x: DevPtr, n: i64) -> Result<()> {
        self.launch("cast_bwd_bf16_f32", l, &[Ptr(out), Ptr(x), I64(n)])
    }

    /// `*out += Σ x²` (f64 accumulator).
    pub fn sumsq(&self, l: Launch, out: DevPtr, x: DevPtr, n: i64) -> Result<()> {
        self.launch("sumsq_fwd_f32", l, &[Ptr(out), Ptr(x), I64(n)])
    }

    /// `y[r, :] += b`.
    pub fn bias_fwd(
        &self,
        dt: Dtype,
        l: Launch,
        y: DevPtr,
        b: DevPtr,
        n: i32,
        c: i32,
    ) -> Result<()> {
        self.launch(&dt.symbol("bias_fwd"), l, &[Ptr(y), Ptr(b), I32(n), I32(c)])
    }

    /// `db += Σ_rows dy` (fp32 accumulator).
    pub fn bias_bwd(
        &self,
        dt: Dtype,
        l: Launch,
        db: DevPtr,
        dy: DevPtr,
        n: i32,
        c: i32,
    ) -> Result<()> {
        self.launch(
            &dt.symbol("bias_bwd"),
            l,
            &[Ptr(db), Ptr(dy), I32(n), I32(c)],
        )
    }

    /// `y += x` over `n` elements.
    pub fn add(&self, dt: Dtype, l: Launch, y: DevPtr, x: DevPtr, n: i64) -> Result<()> {
        self.launch(&dt.symbol("add_fwd"), l, &[Ptr(y), Ptr(x), I64(n)])
    }
}

/// Every kernel with a wrapper above, by symbol: the test suite checks that this list covers
/// every exported kernel.
pub const WRAPPED: &[&str] = &[
    "embedding_fwd",
    "embedding_bwd",
    "rmsnorm_fwd",
    "rmsnorm_bwd",
    "rmsnorm_bwd_dw",
    "rope_fwd",
    "rope_bwd",
    "swiglu_fwd",
    "swiglu_bwd",
    "geglu_fwd",
    "geglu_bwd",
    "attention_fwd",
    "attention_bwd",
    "attention_bwd_kv",
    "flash32_fwd",
    "flash32_bwd",
    "flash32_bwd_kv",
    "flash64_fwd",
    "flash64_bwd",
    "flash64_bwd_kv",
    "flash128_fwd",
    "flash128_bwd",
    "flash128_bwd_kv",
    "cross_entropy_fwd",
    "cross_entropy_bwd",
    "moe_route_fwd",
    "moe_route_bwd",
    "moe_prob_sums_fwd",
    "moe_gather_fwd",
    "moe_bias_fwd",
    "moe_bias_bwd",
    "moe_combine_fwd",
    "moe_combine_bwd",
    "moe_clamped_swiglu_fwd",
    "moe_clamped_swiglu_bwd",
    "expert_gemm_fwd",
    "expert_gemm_bwd",
    "attn_sinks_fwd",
    "attn_sinks_bwd",
    "cast_fwd_f32_bf16",
    "cast_bwd_bf16_f32",
    "sumsq_fwd_f32",
    "bias_fwd",
    "bias_bwd",
    "add_fwd",
];

/// The kernel stem of the gated MLP's activation `act`, `fwd` or `bwd`.
fn gated_stem(act: MlpActivation, pass: &str) -> &'static str {
    match (act, pass) {
        (MlpActivation::Silu, "fwd") => "swiglu_fwd",
        (MlpActivation::Silu, _) => "swiglu_bwd",
        (MlpActivation::GeluTanh, "fwd") => "geglu_fwd",
        (MlpActivation::GeluTanh, _) => "geglu_bwd",
    }
}
