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

use super::{BufId, DeviceKernel, Kernel};
use crate::model::config::ModelConfig;
use crate::model::layers::DecoderBlock;
use crate::model::ops::{AttnShape, CE_CHUNK_ROWS};
use crate::model::reference::Templates;
use crate::{Error, Result};
use std::sync::{Arc, Mutex};

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
    /// `ids` advanced by `n` ids.
    fn ids_off(ids: Self::Ids, n: usize) -> Self::Ids;
    /// Make host token ids visible to the kernels that follow (in stream order).
    fn upload_ids(&mut self, ids: &[u32]) -> Result<Self::Ids>;

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
    /// RMSNorm of `rows` rows of `c`; 1/rms per row into `rstd`.
    fn rmsnorm_fwd(
        &mut self,
        y: Self::P,
        rstd: Self::P,
        x: Self::P,
        w: Self::P,
        rows: usize,
        c: usize,
        eps: f32,
    ) -> Result<()>;
    /// Backward of RMSNorm: `dx =`, `dw +=`.
    fn rmsnorm_bwd(
        &mut self,
        dx: Self::P,
        dw: Self::P,
        dy: Self::P,
        x: Self::P,
        w: Self::P,
        rstd: Self::P,
        rows: usize,
        c: usize,
    ) -> Result<()>;
    /// RoPE in place on `rows` rows of `heads` heads (`inverse`: the backward); position = row
    /// mod `t`.
    fn rope(
        &mut self,
        x: Self::P,
        rows: usize,
        t: usize,
        heads: usize,
        inverse: bool,
    ) -> Result<()>;
    /// Causal GQA attention; `lse` [B, NH, T].
    fn attention_fwd(
        &mut self,
        o: Self::P,
        lse: Self::P,
        q: Self::P,
        k: Self::P,
        v: Self::P,
        s: AttnShape,
    ) -> Result<()>;
    /// Its backward: dq, dk, dv written; `delta` [B, NH, T] is scratch.
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
        s: AttnShape,
    ) -> Result<()>;
    /// `h = silu(g)·u`.
    fn swiglu_fwd(&mut self, h: Self::P, g: Self::P, u: Self::P, len: usize) -> Result<()>;
    /// Its backward.
    fn swiglu_bwd(
        &mut self,
        dg: Self::P,
        du: Self::P,
        dh: Self::P,
        g: Self::P,
        u: Self::P,
        len: usize,
    ) -> Result<()>;
    /// `x[r] = E[ids[r]]` (`E` is `[V, c]`).
    fn embed_fwd(
        &mut self,
        x: Self::P,
        e: Self::P,
        ids: Self::Ids,
        rows: usize,
        c: usize,
        vocab: usize,
    ) -> Result<()>;
    /// `dE[ids[r]] += dx[r]`.
    fn embed_bwd(
        &mut self,
        de: Self::P,
        ids: Self::Ids,
        dx: Self::P,
        rows: usize,
        c: usize,
        vocab: usize,
    ) -> Result<()>;
    /// Per-row loss `lse(z) − z[target]` into `losses`, and in place `z = scale·(softmax(z) −
    /// onehot)`.
    fn cross_entropy(
        &mut self,
        logits: Self::P,
        losses: Self::P,
        targets: Self::Ids,
        rows: usize,
        vocab: usize,
        scale: f32,
    ) -> Result<()>;
    /// Add `Σ losses[..rows]` (summed in order, in f64) to `into` once the kernels before it
    /// are done.
    fn add_loss(&mut self, losses: Self::P, rows: usize, into: Arc<Mutex<f64>>) -> Result<()>;
}

/// Alignment of workspace regions, in elements (256 bytes: what cuBLAS and vector loads like).
const ALIGN: usize = 64;

/// The layer workspace: named scratch regions inside one device allocation. `P` is an address
/// (or, from [`Ws::layout`], an element offset).
#[derive(Debug, Clone, Copy)]
#[allow(missing_docs)]
pub struct Ws<P> {
    pub h1: P,
    pub rstd1: P,
    pub q: P,
    pub k: P,
    pub v: P,
    pub att: P,
    pub lse: P,
    pub delta: P,
    pub x2: P,
    pub h2: P,
    pub rstd2: P,
    pub gate: P,
    pub up: P,
    pub act: P,
    pub d_i1: P,
    pub d_i2: P,
    pub d_i3: P,
    pub d_att: P,
    pub d_c: P,
    pub d_c2: P,
    pub dq: P,
    pub dk: P,
    pub dv: P,
    pub ce: P,
    pub losses: P,
}

impl Ws<usize> {
    /// Offsets of every region for micro-batches of `b`×`t` tokens, and the total elements.
    pub fn layout(cfg: &ModelConfig, b: usize, t: usize) -> (Self, usize) {
        let n = b * t;
        let (c, qd, kvd, i) = (
            cfg.hidden_size,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.intermediate_size,
        );
        let heads_t = b * cfg.num_heads * t;
        let ce_rows = CE_CHUNK_ROWS.min(n.max(1));
        let mut end = 0usize;
        let mut take = |len: usize| {
            let at = end;
            end += len.div_ceil(ALIGN) * ALIGN;
            at
        };
        let ws = Ws {
            h1: take(n * c),
            rstd1: take(n),
            q: take(n * qd),
            k: take(n * kvd),
            v: take(n * kvd),
            att: take(n * qd),
            lse: take(heads_t),
            delta: take(heads_t),
            x2: take(n * c),
            h2: take(n * c),
            rstd2: take(n),
            gate: take(n * i),
            up: take(n * i),
            act: take(n * i),
            d_i1: take(n * i),
            d_i2: take(n * i),
            d_i3: take(n * i),
            d_att: take(n * qd),
            d_c: take(n * c),
            d_c2: take(n * c),
            dq: take(n * qd),
            dk: take(n * kvd),
            dv: take(n * kvd),
            ce: take(ce_rows * cfg.vocab_size),
            losses: take(n),
        };
        (ws, end)
    }

    /// The regions at `base`.
    pub fn at<B: Backend>(&self, base: B::P) -> Ws<B::P> {
        let f = |o: usize| B::off(base, o);
        Ws {
            h1: f(self.h1),
            rstd1: f(self.rstd1),
            q: f(self.q),
            k: f(self.k),
            v: f(self.v),
            att: f(self.att),
            lse: f(self.lse),
            delta: f(self.delta),
            x2: f(self.x2),
            h2: f(self.h2),
            rstd2: f(self.rstd2),
            gate: f(self.gate),
            up: f(self.up),
            act: f(self.act),
            d_i1: f(self.d_i1),
            d_i2: f(self.d_i2),
            d_i3: f(self.d_i3),
            d_att: f(self.d_att),
            d_c: f(self.d_c),
            d_c2: f(self.d_c2),
            dq: f(self.dq),
            dk: f(self.dk),
            dv: f(self.dv),
            ce: f(self.ce),
            losses: f(self.losses),
        }
    }
}

/// Bytes of the layer workspace for micro-batches of `b`×`t` tokens.
pub fn workspace_bytes(cfg: &ModelConfig, b: usize, t: usize) -> u64 {
    4 * Ws::layout(cfg, b, t).1 as u64
}

/// The shape of one program run.
#[derive(Debug, Clone, Copy)]
pub struct Shape {
    /// Sequences per micro-batch.
    pub b: usize,
    /// Tokens per sequence.
    pub t: usize,
}

impl Shape {
    fn n(&self) -> usize {
        self.b * self.t
    }
}

/// `y = x·Wᵀ (+ bias)`, W `[dout, din]`.
#[allow(clippy::too_many_arguments)]
fn linear_fwd<B: Backend>(
    be: &mut B,
    y: B::P,
    x: B::P,
    w: B::P,
    bias: Option<B::P>,
    n: usize,
    din: usize,
    dout: usize,
) -> Result<()> {
    be.gemm(Gemm {
        c: y,
        a: x,
        ta: false,
        b: w,
        tb: true,
        m: n,
        k: din,
        n: dout,
        accumulate: false,
    })?;
    if let Some(b) = bias {
        be.bias_fwd(y, b, n, dout)?;
    }
    Ok(())
}

/// Backward of [`linear_fwd`]: `dx (= or +=) dy·W`, `dW += dyᵀ·x`, `db += Σ dy`.
#[allow(clippy::too_many_arguments)]
fn linear_bwd<B: Backend>(
    be: &mut B,
    dx: B::P,
    dx_accumulate: bool,
    dw: B::P,
    db: Option<B::P>,
    dy: B::P,
    x: B::P,
    w: B::P,
    n: usize,
    din: usize,
    dout: usize,
) -> Result<()> {
    be.gemm(Gemm {
        c: dx,
        a: dy,
        ta: false,
        b: w,
        tb: false,
        m: n,
        k: dout,
        n: din,
        accumulate: dx_accumulate,
    })?;
    be.gemm(Gemm {
        c: dw,
        a: dy,
        ta: true,
        b: x,
        tb: false,
        m: dout,
        k: n,
        n: din,
        accumulate: true,
    })?;
    if let Some(db) = db {
        be.bias_bwd(db, dy, n, dout)?;
    }
    Ok(())
}

fn attn_shape(blk: &DecoderBlock, s: Shape) -> AttnShape {
    AttnShape {
        b: s.b,
        t: s.t,
        nh: blk.nh,
        nkv: blk.nkv,
        hd: blk.hd,
    }
}

/// Forward internals of a block up to the MLP activation (as `DecoderBlock::internals`).
fn internals<B: Backend>(
    be: &mut B,
    blk: &DecoderBlock,
    p: B::P,
    x: B::P,
    ws: &Ws<B::P>,
    s: Shape,
) -> Result<()> {
    let (n, c, i) = (s.n(), blk.c, blk.inter);
    let (qd, kvd) = (blk.nh * blk.hd, blk.nkv * blk.hd);
    let w = |o: usize| B::off(p, o);
    be.rmsnorm_fwd(ws.h1, ws.rstd1, x, w(blk.ln1), n, c, blk.eps)?;
    linear_fwd(be, ws.q, ws.h1, w(blk.wq), blk.bq.map(w), n, c, qd)?;
    linear_fwd(be, ws.k, ws.h1, w(blk.wk), blk.bk.map(w), n, c, kvd)?;
    linear_fwd(be, ws.v, ws.h1, w(blk.wv), blk.bv.map(w), n, c, kvd)?;
    be.rope(ws.q, n, s.t, blk.nh, false)?;
    be.rope(ws.k, n, s.t, blk.nkv, false)?;
    be.attention_fwd(ws.att, ws.lse, ws.q, ws.k, ws.v, attn_shape(blk, s))?;
    linear_fwd(be, ws.x2, ws.att, w(blk.wo), blk.bo.map(w), n, qd, c)?;
    be.add(ws.x2, x, n * c)?;
    be.rmsnorm_fwd(ws.h2, ws.rstd2, ws.x2, w(blk.ln2), n, c, blk.eps)?;
    linear_fwd(be, ws.gate, ws.h2, w(blk.wg), None, n, c, i)?;
    linear_fwd(be, ws.up, ws.h2, w(blk.wu), None, n, c, i)?;
    be.swiglu_fwd(ws.act, ws.gate, ws.up, n * i)
}

/// `y = block(x)` with the unit's weights at `p`.
pub fn block_fwd<B: Backend>(
    be: &mut B,
    blk: &DecoderBlock,
    p: B::P,
    x: B::P,
    y: B::P,
    ws: &Ws<B::P>,
    s: Shape,
) -> Result<()> {
    let (n, c, i) = (s.n(), blk.c, blk.inter);
    internals(be, blk, p, x, ws, s)?;
    linear_fwd(be, y, ws.act, B::off(p, blk.wd), None, n, i, c)?;
    be.add(y, ws.x2, n * c)
}

/// A block's backward from its input `x`: recompute, gradients `+=` into `g`, `dx` written.
#[allow(clippy::too_many_arguments)]
pub fn block_bwd<B: Backend>(
    be: &mut B,
    blk: &DecoderBlock,
    p: B::P,
    g: B::P,
    x: B::P,
    dy: B::P,
    dx: B::P,
    ws: &Ws<B::P>,
    s: Shape,
) -> Result<()> {
    let (n, c, i) = (s.n(), blk.c, blk.inter);
    let (qd, kvd) = (blk.nh * blk.hd, blk.nkv * blk.hd);
    internals(be, blk, p, x, ws, s)?;
    let w = |o: usize| B::off(p, o);
    let gw = |o: usize| B::off(g, o);
    // MLP: y = x2 + act·Wdᵀ, act = silu(gate) ⊙ up.
    linear_bwd(
        be,
        ws.d_i1,
        false,
        gw(blk.wd),
        None,
        dy,
        ws.act,
        w(blk.wd),
        n,
        i,
        c,
    )?;
    be.swiglu_bwd(ws.d_i2, ws.d_i3, ws.d_i1, ws.gate, ws.up, n * i)?;
    linear_bwd(
        be,
        ws.d_c,
        false,
        gw(blk.wg),
        None,
        ws.d_i2,
        ws.h2,
        w(blk.wg),
        n,
        c,
        i,
    )?;
    linear_bwd(
        be,
        ws.d_c,
        true,
        gw(blk.wu),
        None,
        ws.d_i3,
        ws.h2,
        w(blk.wu),
        n,
        c,
        i,
    )?;
    // dx2 = rmsnorm_bwd(dh2) + dy.
    be.rmsnorm_bwd(
        ws.d_c2,
        gw(blk.ln2),
        ws.d_c,
        ws.x2,
        w(blk.ln2),
        ws.rstd2,
        n,
        c,
    )?;
    be.add(ws.d_c2, dy, n * c)?;
    // Attention: x2 = x + att·Woᵀ (+ bo).
    linear_bwd(
        be,
        ws.d_att,
        false,
        gw(blk.wo),
        blk.bo.map(gw),
        ws.d_c2,
        ws.att,
        w(blk.wo),
        n,
        qd,
        c,
    )?;
    be.attention_bwd(
        ws.dq,
        ws.dk,
        ws.dv,
        ws.delta,
        ws.d_att,
        ws.q,
        ws.k,
        ws.v,
        ws.att,
        ws.lse,
        attn_shape(blk, s),
    )?;
    be.rope(ws.dq, n, s.t, blk.nh, true)?;
    be.rope(ws.dk, n, s.t, blk.nkv, true)?;
    // dh1 = dq·Wq + dk·Wk + dv·Wv, with the weight and bias gradients.
    for (first, wo, bias, d, dout) in [
        (true, blk.wq, blk.bq, ws.dq, qd),
        (false, blk.wk, blk.bk, ws.dk, kvd),
        (false, blk.wv, blk.bv, ws.dv, kvd),
    ] {
        linear_bwd(
            be,
            ws.d_c,
            !first,
            gw(wo),
            bias.map(gw),
            d,
            ws.h1,
            w(wo),
            n,
            c,
            dout,
        )?;
    }
    // dx = rmsnorm_bwd(dh1) + dx2.
    be.rmsnorm_bwd(dx, gw(blk.ln1), ws.d_c, x, w(blk.ln1), ws.rstd1, n, c)?;
    be.add(dx, ws.d_c2, n * c)
}

/// Final norm + LM head + loss over the rows of `x` (as `Head::loss_backward`, logits in chunks
/// of [`CE_CHUNK_ROWS`]): per-row losses into `ws.losses`, `dx` written, gradients `+=`.
#[allow(clippy::too_many_arguments)]
pub fn head_loss_bwd<B: Backend>(
    be: &mut B,
    cfg: &ModelConfig,
    norm_w: B::P,
    norm_g: B::P,
    lm_w: B::P,
    lm_g: B::P,
    x: B::P,
    targets: B::Ids,
    dx: B::P,
    grad_scale: f32,
    ws: &Ws<B::P>,
    n: usize,
) -> Result<()> {
    let (c, vocab, eps) = (cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps as f32);
    be.rmsnorm_fwd(ws.h1, ws.rstd1, x, norm_w, n, c, eps)?;
    let rows = CE_CHUNK_ROWS.min(n.max(1));
    for r0 in (0..n).step_by(rows) {
        let m = (r0 + rows).min(n) - r0;
        let h = B::off(ws.h1, r0 * c);
        be.gemm(Gemm {
            c: ws.ce,
            a: h,
            ta: false,
            b: lm_w,
            tb: true,
            m,
            k: c,
            n: vocab,
            accumulate: false,
        })?;
        be.cross_entropy(
            ws.ce,
            B::off(ws.losses, r0),
            B::ids_off(targets, r0),
            m,
            vocab,
            grad_scale,
        )?;
        // dh = dlogits·W;  dW += dlogitsᵀ·h.
        be.gemm(Gemm {
            c: B::off(ws.d_c, r0 * c),
            a: ws.ce,
            ta: false,
            b: lm_w,
            tb: false,
            m,
            k: vocab,
            n: c,
            accumulate: false,
        })?;
        be.gemm(Gemm {
            c: lm_g,
            a: ws.ce,
            ta: true,
            b: h,
            tb: false,
            m: vocab,
            k: m,
            n: c,
            accumulate: true,
        })?;
    }
    be.rmsnorm_bwd(dx, norm_g, ws.d_c, x, norm_w, ws.rstd1, n, c)
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
    // The address of `len` elements at `off` in buffer `id`, checked.
    let at = |id: BufId, off: usize, len: usize, what: &str| -> Result<B::P> {
        let (p, have) = buf(id)?;
        if off + len > have {
            return Err(Error::internal(
                "device program",
                format!(
                    "{} {what} needs {len} elements at {off} of buffer {id}, which holds {have}",
                    k.name()
                ),
            ));
        }
        Ok(B::off(p, off))
    };
    let ids_len = |ids: &[u32], what: &str| -> Result<()> {
        if ids.len() != n {
            return Err(Error::internal(
                "device program",
                format!(
                    "{} {what}: {} ids for a micro-batch of {n} tokens",
                    k.name(),
                    ids.len()
                ),
            ));
        }
        Ok(())
    };
    match k {
        Kernel::Zero { buf: id } => {
            let (p, have) = buf(*id)?;
            be.zero(p, have)
        }
        Kernel::EmbedFwd { batch, w, x } => {
            ids_len(&batch.tokens, "tokens")?;
            let e = at(*w, 0, v * c, "embedding")?;
            let x = at(*x, 0, n * c, "x")?;
            let ids = be.upload_ids(&batch.tokens)?;
            be.embed_fwd(x, e, ids, n, c, v)
        }
        Kernel::EmbedBwd { batch, g, dx } => {
            ids_len(&batch.tokens, "tokens")?;
            let de = at(*g, 0, v * c, "embedding grads")?;
            let dx = at(*dx, 0, n * c, "dx")?;
            let ids = be.upload_ids(&batch.tokens)?;
            be.embed_bwd(de, ids, dx, n, c, v)
        }
        Kernel::BlockFwd { layer, w, x, y } => {
            let blk = block(tm, *layer)?;
            let p = at(*w, 0, blk.numel, "weights")?;
            let (x, y) = (at(*x, 0, n * c, "x")?, at(*y, 0, n * c, "y")?);
            block_fwd(be, blk, p, x, y, ws, s)
        }
        Kernel::BlockBwd {
            layer,
            w,
            g,
            x,
            dy,
            dx,
        } => {
            let blk = block(tm, *layer)?;
            let p = at(*w, 0, blk.numel, "weights")?;
            let gr = at(*g, 0, blk.numel, "grads")?;
            let (x, dy, dx) = (
                at(*x, 0, n * c, "x")?,
                at(*dy, 0, n * c, "dy")?,
                at(*dx, 0, n * c, "dx")?,
            );
            block_bwd(be, blk, p, gr, x, dy, dx, ws, s)
        }
        Kernel::HeadLossBwd {
            batch,
            w,
            g,
            tied,
            x,
            dx,
        } => {
            ids_len(&batch.targets, "targets")?;
            let nr = tm.head.norm_range();
            let norm_w = at(*w, nr.start, c, "norm weight")?;
            let norm_g = at(*g, nr.start, c, "norm grads")?;
            // The LM head: the tied embedding's unit, or the head unit's own tensor.
            let (lm_w, lm_g) = match (tied, tm.head.lm_head) {
                (Some((tw, tg)), _) => ((*tw, 0), (*tg, 0)),
                (None, Some(off)) => ((*w, off), (*g, off)),
                (None, None) => {
                    return Err(Error::internal(
                        "device program",
                        "an untied head without an LM head tensor",
                    ))
                }
            };
            let lw = at(lm_w.0, lm_w.1, v * c, "LM head")?;
            let lg = at(lm_g.0, lm_g.1, v * c, "LM head grads")?;
            if lm_g.0 == *g && lm_g.1 < nr.end && nr.start < lm_g.1 + v * c {
                return Err(Error::internal(
                    "device program",
                    "head_loss_bwd: the LM head gradient overlaps the norm gradient",
                ));
            }
            let (x, dx) = (at(*x, 0, n * c, "x")?, at(*dx, 0, n * c, "dx")?);
            let ids = be.upload_ids(&batch.targets)?;
            head_loss_bwd(
                be,
                cfg,
                norm_w,
                norm_g,
                lw,
                lg,
                x,
                ids,
                dx,
                batch.grad_scale,
                ws,
                n,
            )?;
            be.add_loss(ws.losses, n, batch.loss.clone())
        }
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
mod tests {
    use super::*;
    use crate::device::host_backend::{HostBackend, HostP};
    use crate::model::layers::Workspace;
    use crate::store::layout::Mode;
    use crate::store::layout::StateLayout;

    fn model(tied: bool) -> ModelConfig {
        ModelConfig::from_json_str(
            &format!(
                r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":48,"intermediate_size":80,
                "num_hidden_layers":2,"num_attention_heads":6,"num_key_value_heads":2,"vocab_size":53,
                "attention_bias":true,"tie_word_embeddings":{tied}}}"#
            ),
            "t",
        )
        .unwrap()
    }

    fn bits(v: &[f32]) -> Vec<u32> {
        v.iter().map(|x| x.to_bits()).collect()
    }

    /// The program on the CPU backend equals the reference layers bit for bit: a block with
    /// q/k/v/o biases forward and backward, and the head over more rows than one logit chunk.
    #[test]
    fn program_matches_the_reference_layers_bit_for_bit() {
        let (b, t) = (2usize, 150usize); // 300 rows: two cross-entropy chunks
        let cfg = model(false);
        let layout = StateLayout::new(&cfg, Mode::Exact);
        let tm = Templates::new(&layout.config, t).unwrap();
        let (n, c) = (b * t, cfg.hidden_size);
        let blk = &tm.blocks[0];
        let numel = layout.units[1].numel;
        let p = crate::util::uniform(numel, 1, 0.2);
        let x = crate::util::uniform(n * c, 2, 1.0);
        let dy = crate::util::uniform(n * c, 3, 1.0);
        let g0 = crate::util::uniform(numel, 4, 0.1);

        let mut ws_ref = Workspace::new(&cfg, b, t);
        let mut y_ref = vec![0.0; n * c];
        blk.forward(&p, &x, &mut y_ref, &mut ws_ref, &tm.rope, b, t);
        let (mut g_ref, mut dx_ref) = (g0.clone(), vec![0.0; n * c]);
        blk.backward(
            &p,
            &mut g_ref,
            &x,
            &dy,
            &mut dx_ref,
            &mut ws_ref,
            &tm.rope,
            b,
            t,
        );

        let (lay, elems) = Ws::layout(&cfg, b, t);
        let mut mem = vec![0.0f32; elems];
        let mut be = HostBackend::new(&tm.rope);
        let (mut y, mut g, mut dx) = (vec![0.0; n * c], g0.clone(), vec![0.0; n * c]);
        // SAFETY: every buffer outlives the calls below and is used by nothing else meanwhile.
        let (ws, pp, xp, yp, dyp, gp, dxp) = unsafe {
            (
                lay.at::<HostBackend<'_>>(HostP::write(&mut mem)),
                HostP::read(&p),
                HostP::read(&x),
                HostP::write(&mut y),
                HostP::read(&dy),
                HostP::write(&mut g),
                HostP::write(&mut dx),
            )
        };
        let s = Shape { b, t };
        block_fwd(&mut be, blk, pp, xp, yp, &ws, s).unwrap();
        block_bwd(&mut be, blk, pp, gp, xp, dyp, dxp, &ws, s).unwrap();
        assert_eq!(bits(&y), bits(&y_ref), "block forward");
        assert_eq!(bits(&g), bits(&g_ref), "block weight and bias gradients");
        assert_eq!(bits(&dx), bits(&dx_ref), "block dx");

        // Head: norm weight and LM head in one shard, as for an untied model.
        let head_numel = layout.units[3].numel;
        let hp = crate::util::uniform(head_numel, 5, 0.3);
        let hg0 = crate::util::uniform(head_numel, 6, 0.1);
        let targets: Vec<u32> = (0..n).map(|i| (i * 7 % 53) as u32).collect();
        let nr = tm.head.norm_range();
        let off = tm.head.lm_head.unwrap();
        let v = cfg.vocab_size;
        let mut hg_ref = hg0.clone();
        let (lo, hi) = hg_ref.split_at_mut(off);
        let mut dxh_ref = vec![0.0; n * c];
        let loss_ref = tm.head.loss_backward(
            &hp[nr.clone()],
            &mut lo[nr.clone()],
            &hp[off..off + v * c],
            &mut hi[..v * c],
            &x,
            &targets,
            &mut dxh_ref,
            0.01,
            &mut ws_ref,
        );
        let (mut hg, mut dxh) = (hg0.clone(), vec![0.0; n * c]);
        let loss = Arc::new(Mutex::new(0.0f64));
        // SAFETY: as above.
        let (hpp, hgp, dxhp) = unsafe {
            (
                HostP::read(&hp),
                HostP::write(&mut hg),
                HostP::write(&mut dxh),
            )
        };
        let ids = be.upload_ids(&targets).unwrap();
        head_loss_bwd(
            &mut be,
            &cfg,
            HostBackend::off(hpp, nr.start),
            HostBackend::off(hgp, nr.start),
            HostBackend::off(hpp, off),
            HostBackend::off(hgp, off),
            xp,
            ids,
            dxhp,
            0.01,
            &ws,
            n,
        )
        .unwrap();
        be.add_loss(ws.losses, n, loss.clone()).unwrap();
        assert_eq!(*loss.lock().unwrap(), loss_ref, "head loss");
        assert_eq!(bits(&hg), bits(&hg_ref), "head gradients");
        assert_eq!(bits(&dxh), bits(&dxh_ref), "head dx");
    }

    /// A range the program gets wrong is an error on the CPU backend, not corrupted memory.
    #[test]
    fn bad_ranges_are_caught() {
        let cfg = model(true);
        let rope = crate::model::ops::Rope::new(cfg.head_dim, 1e4, 8);
        let mut be = HostBackend::new(&rope);
        let mut a = vec![0.0f32; 100];
        let r = vec![1.0f32; 100];
        // SAFETY: the buffers outlive the calls.
        let (ap, rp) = unsafe { (HostP::write(&mut a), HostP::read(&r)) };
        let e = be.add(ap, rp, 101).unwrap_err().to_string();
        assert!(e.contains("overflow"), "{e}");
        let e = be
            .add(ap, HostBackend::off(ap, 10), 20)
            .unwrap_err()
            .to_string();
        assert!(e.contains("overlaps"), "{e}");
        let e = be.add(rp, ap, 10).unwrap_err().to_string();
        assert!(e.contains("reading only"), "{e}");
        be.add(ap, HostBackend::off(ap, 50), 50).unwrap();
    }
}
