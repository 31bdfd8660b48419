//! The layer ops as a sequence of kernel calls, written once for every device.
//!
//! A [`Backend`] offers the primitives a GPU has — a GEMM, RMSNorm, RoPE, flash attention, SwiGLU,
//! the embedding gather/scatter, cross-entropy over a chunk of logits, bias and residual adds —
//! on device addresses (`Backend::P`). This module composes them into the layer ops of
//! [`Kernel`]: a block's forward, its backward with recompute, the fused LM head + loss, the
//! embedding. The composition mirrors the CPU reference ([`crate::model::layers`]) op for op, in
//! the same order and with the same accumulation, so the CPU device running this program through
//! [`super::host_backend::HostBackend`] reproduces the reference bit for bit (tested): what is
//! left to prove on a GPU is only that each CUDA kernel matches its CPU op, which `megatrain
//! selftest --device cuda` checks.

mod head;
mod layers;
mod shape;
mod workspace;

use super::{Batch, BufId, DeviceKernel, Kernel, Precision};
use crate::model::config::MlpActivation;
use crate::model::layers::DecoderBlock;
use crate::model::ops::{AttnShape, AuxGrad, ExpertLoad, MoeShape};
use crate::model::reference::Templates;
use crate::{Error, Result};
pub use head::{head_loss_bwd, head_loss_fwd};
use head::{run_head, run_head_loss, HeadBuffers};
pub use layers::{block_bwd, block_fwd};
pub use shape::{Chunk, Shape, CHUNK_ALIGN};
use std::sync::{Arc, Mutex};
pub use workspace::{
    bf16_device_bytes, bf16_operand_bytes, bf16_operand_elems, bf16_staging_bytes, internals_len,
    max_unit_numel, moe_scratch_bytes, workspace_bytes, Ws,
};

/// `C[m, n] (= or +=) op(A)·op(B)`, row-major and packed: `A` is `m×k` (stored `k×m` when
/// `ta`), `B` is `k×n` (stored `n×k` when `tb`).
#[derive(Debug, Clone, Copy)]
pub struct Gemm<P> {
    /// Output.
    pub c: P,
    /// Left operand.
    pub a: P,
    /// `A` is stored transposed.
    pub ta: bool,
    /// Right operand.
    pub b: P,
    /// `B` is stored transposed.
    pub tb: bool,
    /// Rows of C.
    pub m: usize,
    /// Inner dimension.
    pub k: usize,
    /// Columns of C.
    pub n: usize,
    /// `C +=` instead of `C =`.
    pub accumulate: bool,
}

/// Where a mixture-of-experts MLP's three tensors are (weights or their gradients).
#[derive(Debug, Clone, Copy)]
pub struct MoeAt<P> {
    /// Router `[E, C]`.
    pub router: P,
    /// Experts' gate and up projections `[E, 2I, C]`.
    pub gate_up: P,
    /// Experts' down projections `[E, C, I]`.
    pub down: P,
    /// The router's, gate/up's and down's biases (GPT-OSS).
    pub biases: Option<[P; 3]>,
}

/// The primitives a device offers. Addresses are `P` (f32 elements); token ids are `Ids`. Every
/// output range is disjoint from every other range of the same call; lengths are in elements.
#[allow(clippy::too_many_arguments)]
pub trait Backend {
    /// A device address of f32 elements.
    type P: Copy + std::fmt::Debug;
    /// A device address of u32 token ids.
    type Ids: Copy + std::fmt::Debug;

    /// `p` advanced by `elems` elements.
    fn off(p: Self::P, elems: usize) -> Self::P;
    /// The region at `p` as the bf16 recipe stores an activation that only GEMMs and attention
    /// read (only called under [`Precision::Bf16`]): bf16 values, rounded to nearest even when
    /// written — on a GPU 2-byte elements, on the CPU the fp32 storage of the rounded values.
    /// Only [`Backend::rmsnorm_fwd`], [`Backend::gated_fwd`], [`Backend::gated_bwd`],
    /// [`Backend::rope`] and [`Backend::store_bf16`] write one; only [`Backend::gemm`] reads one, and attention its
    /// inputs (Q, K, V, dO), which are always one under bf16. Offsets from it count its
    /// elements.
    fn as_bf16(p: Self::P) -> Self::P;
    /// `ids` advanced by `n` ids.
    fn ids_off(ids: Self::Ids, n: usize) -> Self::Ids;
    /// Make host token ids visible to the kernels that follow (in stream order).
    fn upload_ids(&mut self, ids: &[u32]) -> Result<Self::Ids>;
    /// Make a micro-batch's positions visible to the kernels that follow; a device may keep
    /// them while the same micro-batch's blocks run (one upload per micro-batch, not per layer).
    fn upload_positions(&mut self, positions: &Arc<[u32]>) -> Result<Self::Ids>;

    /// See [`Gemm`].
    fn gemm(&mut self, g: Gemm<Self::P>) -> Result<()>;
    /// `y[r, :] += b` for `rows` rows of `cols`.
    fn bias_fwd(&mut self, y: Self::P, b: Self::P, rows: usize, cols: usize) -> Result<()>;
    /// `db += Σ_rows dy`.
    fn bias_bwd(&mut self, db: Self::P, dy: Self::P, rows: usize, cols: usize) -> Result<()>;
    /// `y += x` over `len` elements.
    fn add(&mut self, y: Self::P, x: Self::P, len: usize) -> Result<()>;
    /// `dst = 0` over `len` elements.
    fn zero(&mut self, dst: Self::P, len: usize) -> Result<()>;
    /// The precision the backend computes in: under [`Precision::Bf16`] its GEMMs round their
    /// operands to bf16 (fp32 sums and results), and the program stores attention's Q, K, V
    /// and output gradient in bf16 ([`Backend::store_bf16`]).
    fn precision(&self) -> Precision;
    /// How the backend holds the regions the recipe stores ([`Backend::as_bf16`]): a GPU in
    /// its precision (2-byte elements under bf16), the CPU in fp32. What [`Ws::layout`] and
    /// [`internals_len`] take as `stored`.
    fn stored(&self) -> Precision;
    /// `dst = src` rounded to bf16 (nearest even) over `len` elements, `dst` a region as the
    /// bf16 recipe stores it ([`Backend::as_bf16`]), `src` fp32. Only called under
    /// [`Precision::Bf16`].
    fn store_bf16(&mut self, dst: Self::P, src: Self::P, len: usize) -> Result<()>;
    /// `dst = src` widened exactly to fp32 over `len` elements, `src` a region as the bf16
    /// recipe stores it ([`Backend::as_bf16`]), `dst` fp32: a layer input stored in bf16, read
    /// back for the backward that recomputes from it. Only called under [`Precision::Bf16`].
    fn load_bf16(&mut self, dst: Self::P, src: Self::P, len: usize) -> Result<()>;
    /// Whether weight-gradient GEMMs run in the fixed row blocks of
    /// [`crate::model::ops::grad_blocks`] (the CPU: bits that do not depend on the chunking) or
    /// as one GEMM over a chunk's rows (a GPU: fewer, larger GEMMs).
    fn fixed_grad_blocks(&self) -> bool;
    /// RMSNorm of `rows` rows of `c` with weights `(w, offset)`: `y = (offset + w) ⊙ x̂`;
    /// 1/rms per row into `rstd`.
    fn rmsnorm_fwd(
        &mut self,
        y: Self::P,
        rstd: Self::P,
        x: Self::P,
        w: (Self::P, f32),
        rows: usize,
        c: usize,
        eps: f32,
    ) -> Result<()>;
    /// Backward of RMSNorm: `dx =` (`dx +=` when `accumulate`: a residual's gradient already
    /// there, added in the same pass), `dw +=`.
    fn rmsnorm_bwd(
        &mut self,
        dx: Self::P,
        dw: Self::P,
        dy: Self::P,
        x: Self::P,
        w: (Self::P, f32),
        rstd: Self::P,
        rows: usize,
        c: usize,
        accumulate: bool,
    ) -> Result<()>;
    /// `y = RoPE(x)` with RoPE table `table` ([`crate::model::ops::Rope`]) on `rows` rows of
    /// `heads` heads (`inverse`: the backward); row r is at position `pos[r]`. `x` is fp32;
    /// `y` is `x` itself (in place) or a region the recipe stores ([`Backend::as_bf16`])
    /// disjoint from it.
    fn rope(
        &mut self,
        y: Self::P,
        x: Self::P,
        pos: Self::Ids,
        rows_heads: (usize, usize),
        inverse: bool,
        table: usize,
    ) -> Result<()>;
    /// Causal GQA attention inside documents for the queries `s.q0..s.q1` of each sequence
    /// (layouts in [`AttnShape`]): query i attends to keys `i − pos[i] ..= i` of its sequence
    /// (`pos` [B·T], each token's position in its document); `lse` [B, NH, q1−q0].
    fn attention_fwd(
        &mut self,
        o: Self::P,
        lse: Self::P,
        q: Self::P,
        k: Self::P,
        v: Self::P,
        pos: Self::Ids,
        s: AttnShape,
    ) -> Result<()>;
    /// Its backward: dq written, dk and dv accumulated (`+=`); `delta` [B, NH, q1−q0] is
    /// scratch.
    fn attention_bwd(
        &mut self,
        dq: Self::P,
        dk: Self::P,
        dv: Self::P,
        delta: Self::P,
        d_o: Self::P,
        q: Self::P,
        k: Self::P,
        v: Self::P,
        o: Self::P,
        lse: Self::P,
        pos: Self::Ids,
        s: AttnShape,
    ) -> Result<()>;
    /// Attention sinks after [`Backend::attention_fwd`] ([`crate::model::ops::sinks_fwd`]): the
    /// output `o` and log-sum-exp `lse` rescaled in place; `sinks` `[NH]`.
    fn attn_sinks_fwd(
        &mut self,
        o: Self::P,
        lse: Self::P,
        sinks: Self::P,
        s: AttnShape,
    ) -> Result<()>;
    /// Their gradient `dsinks +=` ([`crate::model::ops::sinks_bwd`]) from the rescaled `o` and
    /// `lse` and the output gradient `d_o` (as stored: bf16 under the bf16 recipe, what the
    /// attention's backward reads too).
    fn attn_sinks_bwd(
        &mut self,
        dsinks: Self::P,
        d_o: Self::P,
        o: Self::P,
        lse: Self::P,
        sinks: Self::P,
        s: AttnShape,
    ) -> Result<()>;
    /// The gated MLP's `h = act(g)·u`.
    fn gated_fwd(
        &mut self,
        act: MlpActivation,
        h: Self::P,
        g: Self::P,
        u: Self::P,
        len: usize,
    ) -> Result<()>;
    /// Its backward.
    fn gated_bwd(
        &mut self,
        act: MlpActivation,
        dg: Self::P,
        du: Self::P,
        dh: Self::P,
        g: Self::P,
        u: Self::P,
        len: usize,
    ) -> Result<()>;
    /// The mixture-of-experts MLP of `rows` rows of `h` into `out` (`[rows, C]` each), weights
    /// at `w` ([`crate::model::ops::moe_fwd`]: router, top-k, the experts' gated MLPs, the
    /// weighted sum). Under the bf16 recipe `h` is the norm's bf16-stored output and the
    /// experts' GEMMs take bf16 operands ([`crate::model::ops::MoeWeights::bf16_recipe`]).
    /// Returns what it routed over the rows that are not padding (`pad` `[rows]`, non-zero:
    /// padding; `None`: none is) — tokens per expert, the router probabilities' sums — which the
    /// load-balancing loss and the metrics read.
    fn moe_fwd(
        &mut self,
        out: Self::P,
        h: Self::P,
        w: MoeAt<Self::P>,
        rows: usize,
        s: MoeShape,
        pad: Option<&[u8]>,
    ) -> Result<ExpertLoad>;
    /// Its backward ([`crate::model::ops::moe_bwd`], the forward recomputed from `h`): `dh`
    /// written, the router's and experts' gradients at `g` added to; `aux`: the load-balancing
    /// loss's dL/dp per expert ([`crate::model::ops::RouterTally::aux_grad`]) and the rows that
    /// are padding (which take none of it).
    fn moe_bwd(
        &mut self,
        dh: Self::P,
        g: MoeAt<Self::P>,
        d_out: Self::P,
        h: Self::P,
        w: MoeAt<Self::P>,
        rows: usize,
        s: MoeShape,
        aux: Option<AuxGrad<'_>>,
    ) -> Result<()>;
    /// `x[r] = E[ids[r]]·scale` (`E` is `[V, c]`).
    fn embed_fwd(
        &mut self,
        x: Self::P,
        e: Self::P,
        ids: Self::Ids,
        rows_c_vocab: (usize, usize, usize),
        scale: f32,
    ) -> Result<()>;
    /// `dE[tokens[r]] += dx[r]·scale` but for the rows of token `pad` (the padding index),
    /// each row of `dE` summed in row order (the same bits on every run and every device). The
    /// tokens are the host's: a GPU groups them by id first.
    fn embed_bwd(
        &mut self,
        de: Self::P,
        tokens: &[u32],
        dx: Self::P,
        rows_c_vocab: (usize, usize, usize),
        scale: f32,
        pad: Option<u32>,
    ) -> Result<()>;
    /// Per-row loss `lse(z) − z[target]` into `losses`, and in place `z = scale·(softmax(z) −
    /// onehot)`; a row whose target is [`crate::model::ops::IGNORE`] gets loss 0 and `z = 0`.
    /// With a soft cap, of `z' = cap·tanh(z / cap)`, the gradient taken back through the cap.
    fn cross_entropy(
        &mut self,
        logits: Self::P,
        losses: Self::P,
        targets: Self::Ids,
        rows: usize,
        vocab: usize,
        scale_softcap: (f32, Option<f32>),
    ) -> Result<()>;
    /// Add `Σ losses[..rows]` (summed in order, in f64) to `into` once the kernels before it
    /// are done.
    fn add_loss(&mut self, losses: Self::P, rows: usize, into: Arc<Mutex<f64>>) -> Result<()>;
    /// Copy `len` values of `src` into `into` (replacing what it held) once the kernels before
    /// it are done: one row of logits read back for generation.
    fn read_back(&mut self, src: Self::P, len: usize, into: Arc<Mutex<Vec<f32>>>) -> Result<()>;
}

/// Run one [`Kernel`] on a backend. `buf` resolves a device buffer to its address and length in
/// elements; every range the kernel touches is checked against it first.
pub fn run<B: Backend>(
    be: &mut B,
    tm: &Templates,
    k: &DeviceKernel,
    buf: &dyn Fn(BufId) -> Result<(B::P, usize)>,
    ws: &Ws<B::P>,
    s: Shape,
) -> Result<()> {
    let cfg = &tm.config;
    let (n, c, v) = (s.n(), cfg.hidden_size, cfg.vocab_size);
    let at = Ranges { kernel: k, buf };
    match k {
        Kernel::Zero { buf: id } => {
            let (p, have) = buf(*id)?;
            be.zero(p, have)
        }
        Kernel::Narrow { x, to } => {
            let x = at.range(*x, 0, n * c, "x")?;
            let to = B::as_bf16(at.range(*to, 0, n * c, "bf16 x")?);
            be.store_bf16(to, x, n * c)
        }
        Kernel::Widen { from, x } => {
            let from = B::as_bf16(at.range(*from, 0, n * c, "bf16 x")?);
            let x = at.range(*x, 0, n * c, "x")?;
            be.load_bf16(x, from, n * c)
        }
        Kernel::EmbedFwd { batch, w, x } => {
            at.ids(&batch.tokens, n, "tokens")?;
            let e = at.range(*w, 0, v * c, "embedding")?;
            let x = at.range(*x, 0, n * c, "x")?;
            let ids = be.upload_ids(&batch.tokens)?;
            be.embed_fwd(x, e, ids, (n, c, v), tm.embedding.scale)
        }
        Kernel::EmbedBwd { batch, g, dx } => {
            at.ids(&batch.tokens, n, "tokens")?;
            let de = at.range(*g, 0, v * c, "embedding grads")?;
            let dx = at.range(*dx, 0, n * c, "dx")?;
            let emb = &tm.embedding;
            be.embed_bwd(de, &batch.tokens, dx, (n, c, v), emb.scale, emb.pad)
        }
        Kernel::BlockFwd {
            batch,
            layer,
            w,
            x,
            y,
            keep,
        } => {
            let blk = block(tm, *layer)?;
            let p = at.range(*w, 0, blk.numel, "weights")?;
            let (x, y) = (at.range(*x, 0, n * c, "x")?, at.range(*y, 0, n * c, "y")?);
            let pos = positions(be, tm, &at, batch, s)?;
            let pad = padding(&at, batch, n)?;
            let ws = at.kept(*keep, tm, ws, s, be.stored())?;
            if let Some(load) = block_fwd(be, blk, p, x, y, (pos, pad), &ws, s)? {
                crate::util::lock(&batch.router).add(*layer, &load);
            }
            Ok(())
        }
        Kernel::BlockBwd {
            batch,
            layer,
            w,
            g,
            x,
            dy,
            dx,
            kept,
        } => {
            let blk = block(tm, *layer)?;
            let p = at.range(*w, 0, blk.numel, "weights")?;
            let gr = at.range(*g, 0, blk.numel, "grads")?;
            let (x, dy, dx) = (
                at.range(*x, 0, n * c, "x")?,
                at.range(*dy, 0, n * c, "dy")?,
                at.range(*dx, 0, n * c, "dx")?,
            );
            let pos = positions(be, tm, &at, batch, s)?;
            let recompute = kept.is_none();
            let ws = at.kept(*kept, tm, ws, s, be.stored())?;
            // The load-balancing gradient needs the whole forward's routing: done by now.
            let per_expert = (blk.moe.is_some() && batch.aux_scale > 0.0)
                .then(|| crate::util::lock(&batch.router).aux_grad(batch.aux_scale));
            let pad = padding(&at, batch, n)?;
            let aux = per_expert
                .as_deref()
                .map(|per_expert| AuxGrad { per_expert, pad });
            block_bwd(be, blk, p, gr, x, dy, dx, pos, &ws, s, recompute, aux)
        }
        Kernel::HeadLossBwd {
            batch,
            w,
            g,
            tied,
            x,
            dx,
        } => {
            let head = HeadBuffers {
                w: *w,
                g: *g,
                tied: *tied,
                x: *x,
                dx: *dx,
            };
            run_head(be, tm, &at, head, batch, ws, n)
        }
        Kernel::HeadLoss { batch, w, tied, x } => {
            run_head_loss(be, tm, &at, (*w, *tied, *x), batch, ws, n)
        }
    }
}

/// The micro-batch's padding flags (`[N]`, non-zero where a token is padding), if it has any.
fn padding<'a, B: Backend>(
    at: &Ranges<'_, B>,
    batch: &'a Batch,
    n: usize,
) -> Result<Option<&'a [u8]>> {
    match batch.pad.as_deref() {
        None => Ok(None),
        Some(p) if p.len() == n => Ok(Some(p)),
        Some(p) => Err(Error::internal(
            "device program",
            format!(
                "{}: {} padding flags for a micro-batch of {n} tokens",
                at.kernel.name(),
                p.len()
            ),
        )),
    }
}

/// The micro-batch's positions on the device: one per token, inside the RoPE tables (each is
/// below `t`, checked with the batch by `Templates::check_batch`).
fn positions<B: Backend>(
    be: &mut B,
    tm: &Templates,
    at: &Ranges<'_, B>,
    batch: &Batch,
    s: Shape,
) -> Result<B::Ids> {
    at.ids(&batch.positions, s.n(), "positions")?;
    if s.t > tm.rope.max_pos {
        return Err(Error::internal(
            "device program",
            format!(
                "sequences of {} tokens beyond the RoPE tables' {}",
                s.t, tm.rope.max_pos
            ),
        ));
    }
    be.upload_positions(&batch.positions)
}

/// Checked access to a kernel's buffers: every range inside its buffer, every id list one per
/// token; a violation is an internal error naming the kernel.
struct Ranges<'a, B: Backend> {
    kernel: &'a DeviceKernel,
    buf: &'a dyn Fn(BufId) -> Result<(B::P, usize)>,
}

impl<B: Backend> Ranges<'_, B> {
    /// The address of `len` elements at `off` in buffer `id`.
    fn range(&self, id: BufId, off: usize, len: usize, what: &str) -> Result<B::P> {
        let (p, have) = (self.buf)(id)?;
        if off + len > have {
            return Err(Error::internal(
                "device program",
                format!(
                    "{} {what} needs {len} elements at {off} of buffer {id}, which holds {have}",
                    self.kernel.name()
                ),
            ));
        }
        Ok(B::off(p, off))
    }

    /// The workspace with the block's internals in buffer `kept` when given (it must hold
    /// them for the whole micro-batch, the stored ones as `stored` says: the shape is one
    /// chunk), else `ws` itself.
    fn kept(
        &self,
        kept: Option<BufId>,
        tm: &Templates,
        ws: &Ws<B::P>,
        s: Shape,
        stored: Precision,
    ) -> Result<Ws<B::P>> {
        let Some(id) = kept else {
            return Ok(*ws);
        };
        if s.is_chunked() {
            return Err(Error::internal(
                "device program",
                format!(
                    "{}: kept internals with token chunks of {} of {} tokens",
                    self.kernel.name(),
                    s.chunk_rows(),
                    s.n()
                ),
            ));
        }
        let len = internals_len(&tm.config, s.n(), stored);
        let base = self.range(id, 0, len, "kept internals")?;
        Ok(ws.keeping::<B>(&tm.config, s.n(), base, stored))
    }

    /// `ids` holds one id per token of a micro-batch of `n`.
    fn ids(&self, ids: &[u32], n: usize, what: &str) -> Result<()> {
        if ids.len() != n {
            return Err(Error::internal(
                "device program",
                format!(
                    "{} {what}: {} ids for a micro-batch of {n} tokens",
                    self.kernel.name(),
                    ids.len()
                ),
            ));
        }
        Ok(())
    }
}

fn block(tm: &Templates, layer: usize) -> Result<&DecoderBlock> {
    tm.blocks.get(layer).ok_or_else(|| {
        Error::internal(
            "device program",
            format!("block: layer {layer} of a {}-layer model", tm.blocks.len()),
        )
    })
}

#[cfg(test)]
mod tests;
