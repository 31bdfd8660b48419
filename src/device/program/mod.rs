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

mod layers;

use super::{Batch, BufId, DeviceKernel, Kernel};
use crate::model::config::ModelConfig;
use crate::model::layers::DecoderBlock;
use crate::model::ops::{AttnShape, CE_CHUNK_ROWS};
use crate::model::reference::Templates;
use crate::{Error, Result};
pub use layers::{block_bwd, block_fwd, head_loss_bwd};
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
    /// Whether weight-gradient GEMMs run in the fixed row blocks of
    /// [`crate::model::ops::grad_blocks`] (the CPU: bits that do not depend on the chunking) or
    /// as one GEMM over a chunk's rows (a GPU: fewer, larger GEMMs).
    fn fixed_grad_blocks(&self) -> bool;
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
    /// Backward of RMSNorm: `dx =` (`dx +=` when `accumulate`: a residual's gradient already
    /// there, added in the same pass), `dw +=`.
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
        accumulate: bool,
    ) -> Result<()>;
    /// RoPE in place on `rows` rows of `heads` heads (`inverse`: the backward); row r is at
    /// position `pos[r]`.
    fn rope(
        &mut self,
        x: Self::P,
        pos: Self::Ids,
        rows: usize,
        heads: usize,
        inverse: bool,
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
    /// onehot)`; a row whose target is [`crate::model::ops::IGNORE`] gets loss 0 and `z = 0`.
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

/// Regions laid end to end in one allocation, each aligned to [`ALIGN`] elements.
#[derive(Default)]
struct Regions {
    end: usize,
}

impl Regions {
    /// The offset of the next region of `len` elements.
    fn take(&mut self, len: usize) -> usize {
        let at = self.end;
        self.end += len.div_ceil(ALIGN) * ALIGN;
        at
    }
}

/// The layer workspace: named scratch regions inside one device allocation. `P` is an address
/// (or, from [`Ws::layout`], an element offset). Shapes in elements, for a micro-batch of
/// `N = B·T` tokens run in chunks of at most `M` rows ([`Shape::chunk_rows`]), hidden size `C`,
/// MLP size `I`, `nh` query and `nkv` key/value heads of `hd` dimensions and a vocabulary of
/// `V`. Only K, V, their gradients and the per-row losses span the micro-batch; the head runs
/// in chunks of `H = min(N, CE_CHUNK_ROWS)` rows.
#[derive(Debug, Clone, Copy)]
pub struct Ws<P> {
    /// `[max(M, H), C]` the first RMSNorm's output (and the head's norm output).
    pub h1: P,
    /// `[max(M, H)]` the first RMSNorm's 1/rms per row (and the head's).
    pub rstd1: P,
    /// `[M, nh·hd]` queries after RoPE.
    pub q: P,
    /// `[N, nkv·hd]` keys after RoPE.
    pub k: P,
    /// `[N, nkv·hd]` values.
    pub v: P,
    /// `[M, nh·hd]` attention output (before the output projection).
    pub att: P,
    /// `[nh, M]` log-sum-exp of each attention row (flash attention's saved statistic).
    pub lse: P,
    /// `[nh, M]` rowsum(dO ⊙ O), the flash attention backward's scratch.
    pub delta: P,
    /// `[M, C]` the residual stream after attention.
    pub x2: P,
    /// `[M, C]` the second RMSNorm's output.
    pub h2: P,
    /// `[M]` the second RMSNorm's 1/rms per row.
    pub rstd2: P,
    /// `[M, I]` the MLP's gate projection.
    pub gate: P,
    /// `[M, I]` the MLP's up projection.
    pub up: P,
    /// `[M, I]` silu(gate) ⊙ up.
    pub act: P,
    /// `[M, I]` dL/d act.
    pub d_i1: P,
    /// `[M, I]` dL/d gate.
    pub d_i2: P,
    /// `[M, I]` dL/d up.
    pub d_i3: P,
    /// `[M, nh·hd]` dL/d att.
    pub d_att: P,
    /// `[max(M, H), C]` dL/d h2 (and the head's dL/d normed x).
    pub d_c: P,
    /// `[M, nh·hd]` dL/d q.
    pub dq: P,
    /// `[N, nkv·hd]` dL/d k.
    pub dk: P,
    /// `[N, nkv·hd]` dL/d v.
    pub dv: P,
    /// `[H, V]` one chunk of logits, then their gradients.
    pub ce: P,
    /// `[N]` per-row cross-entropy loss.
    pub losses: P,
}

impl Ws<usize> {
    /// Offsets of every region for the shape `s`, and the total elements.
    pub fn layout(cfg: &ModelConfig, s: Shape) -> (Self, usize) {
        let (n, m) = (s.n(), s.chunk_rows());
        let (c, qd, kvd, i) = (
            cfg.hidden_size,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.intermediate_size,
        );
        let ce_rows = CE_CHUNK_ROWS.min(n.max(1));
        let mh = m.max(ce_rows);
        let mut regions = Regions::default();
        let mut take = |len: usize| regions.take(len);
        let ws = Ws {
            h1: take(mh * c),
            rstd1: take(mh),
            q: take(m * qd),
            k: take(n * kvd),
            v: take(n * kvd),
            att: take(m * qd),
            lse: take(cfg.num_heads * m),
            delta: take(cfg.num_heads * m),
            x2: take(m * c),
            h2: take(m * c),
            rstd2: take(m),
            gate: take(m * i),
            up: take(m * i),
            act: take(m * i),
            d_i1: take(m * i),
            d_i2: take(m * i),
            d_i3: take(m * i),
            d_att: take(m * qd),
            d_c: take(mh * c),
            dq: take(m * qd),
            dk: take(n * kvd),
            dv: take(n * kvd),
            ce: take(ce_rows * cfg.vocab_size),
            losses: take(n),
        };
        (ws, regions.end)
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
            dq: f(self.dq),
            dk: f(self.dk),
            dv: f(self.dv),
            ce: f(self.ce),
            losses: f(self.losses),
        }
    }
}

/// A block's forward internals kept for its backward ([`crate::engine::Activations::Keep`]):
/// offsets, for `n` tokens (the whole micro-batch), of the [`Ws`] regions the forward writes
/// and the backward reads — h1, rstd1, q, k, v, att, lse, x2, h2, rstd2, gate, up, act — in one
/// buffer of [`internals_len`] elements.
#[derive(Debug, Clone, Copy)]
struct Internals {
    h1: usize,
    rstd1: usize,
    q: usize,
    k: usize,
    v: usize,
    att: usize,
    lse: usize,
    x2: usize,
    h2: usize,
    rstd2: usize,
    gate: usize,
    up: usize,
    act: usize,
}

impl Internals {
    fn layout(cfg: &ModelConfig, n: usize) -> (Self, usize) {
        let (c, qd, kvd, i) = (
            cfg.hidden_size,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.intermediate_size,
        );
        let mut regions = Regions::default();
        let mut take = |len: usize| regions.take(len);
        let r = Internals {
            h1: take(n * c),
            rstd1: take(n),
            q: take(n * qd),
            k: take(n * kvd),
            v: take(n * kvd),
            att: take(n * qd),
            lse: take(cfg.num_heads * n),
            x2: take(n * c),
            h2: take(n * c),
            rstd2: take(n),
            gate: take(n * i),
            up: take(n * i),
            act: take(n * i),
        };
        (r, regions.end)
    }
}

/// Elements of one block's kept internals for micro-batches of `n` tokens.
pub fn internals_len(cfg: &ModelConfig, n: usize) -> usize {
    Internals::layout(cfg, n).1
}

impl<P: Copy> Ws<P> {
    /// These regions with the forward internals in `kept` (a buffer of [`internals_len`]
    /// elements) instead of the workspace: a forward run on it leaves them for the backward.
    pub fn keeping<B: Backend<P = P>>(&self, cfg: &ModelConfig, n: usize, kept: P) -> Self {
        let (r, _) = Internals::layout(cfg, n);
        let f = |o: usize| B::off(kept, o);
        Ws {
            h1: f(r.h1),
            rstd1: f(r.rstd1),
            q: f(r.q),
            k: f(r.k),
            v: f(r.v),
            att: f(r.att),
            lse: f(r.lse),
            x2: f(r.x2),
            h2: f(r.h2),
            rstd2: f(r.rstd2),
            gate: f(r.gate),
            up: f(r.up),
            act: f(r.act),
            ..*self
        }
    }
}

/// Bytes of the layer workspace for the shape `s`.
pub fn workspace_bytes(cfg: &ModelConfig, s: Shape) -> u64 {
    4 * Ws::layout(cfg, s).1 as u64
}

/// Granularity of chunks shorter than a sequence, in tokens: a multiple of the CPU attention's
/// query tile ([`crate::model::ops::ATTN_TILE`]) and of the weight-gradient row block
/// ([`crate::model::ops::GRAD_ROWS`]), so the CPU device's results are the same bits for every
/// chunk size.
pub const CHUNK_ALIGN: usize = 256;

/// The shape of one program run: micro-batches of `b` sequences of `t` tokens, whose blocks run
/// `chunk` tokens at a time (see [`Shape::chunks`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Sequences per micro-batch.
    pub b: usize,
    /// Tokens per sequence.
    pub t: usize,
    /// Tokens per chunk: whole sequences when ≥ `t`, else a multiple of [`CHUNK_ALIGN`].
    chunk: usize,
}

/// A run of rows a block handles at once: queries `q0..q1` of sequences `b0..b0 + nb` (either
/// whole sequences, or a part of one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// First sequence.
    pub b0: usize,
    /// Sequences.
    pub nb: usize,
    /// First token of each.
    pub q0: usize,
    /// One past the last.
    pub q1: usize,
}

impl Chunk {
    /// Rows of the chunk.
    pub fn rows(&self) -> usize {
        self.nb * (self.q1 - self.q0)
    }
}

impl Shape {
    /// The whole micro-batch at once.
    pub fn whole(b: usize, t: usize) -> Self {
        Shape {
            b,
            t,
            chunk: (b * t).max(1),
        }
    }

    /// Chunks of `chunk` tokens: whole sequences when `chunk ≥ t`, else a multiple of
    /// [`CHUNK_ALIGN`].
    pub fn chunked(b: usize, t: usize, chunk: usize) -> Result<Self> {
        if chunk == 0 || (chunk < t && !chunk.is_multiple_of(CHUNK_ALIGN)) {
            return Err(Error::bad_input(
                "token chunk",
                chunk.to_string(),
                format!(
                    "must be at least the sequence length ({t}) or a positive multiple of {CHUNK_ALIGN}"
                ),
                Some("let megatrain choose it from --device-memory"),
            ));
        }
        Ok(Shape { b, t, chunk })
    }

    /// The largest chunking of at most this shape's chunk whose workspace fits in `budget`
    /// bytes (the whole micro-batch, fewer whole sequences, then parts of a sequence), or an
    /// error naming the smallest workspace and `what` the budget is.
    pub fn fit(self, cfg: &ModelConfig, budget: u64, what: &str) -> Result<Self> {
        let (b, t) = (self.b, self.t);
        let whole = (1..=b.max(1)).rev().map(|nb| nb * t);
        let parts = (1..t.div_ceil(CHUNK_ALIGN)).rev().map(|k| k * CHUNK_ALIGN);
        let mut smallest = self;
        for chunk in whole.chain(parts).filter(|&c| c <= self.chunk) {
            let Ok(s) = Shape::chunked(b, t, chunk) else {
                continue;
            };
            if workspace_bytes(cfg, s) <= budget {
                return Ok(s);
            }
            smallest = s;
        }
        Err(Error::bad_input(
            "device memory",
            what.to_owned(),
            format!(
                "the layer workspace needs at least {} (chunks of {} tokens), {} is left for it",
                crate::util::human_bytes(workspace_bytes(cfg, smallest)),
                smallest.chunk_rows(),
                crate::util::human_bytes(budget)
            ),
            Some("raise the device memory, or lower --batch-size / --seq-len"),
        ))
    }

    /// Tokens per chunk as set.
    pub fn chunk(&self) -> usize {
        self.chunk
    }

    pub(crate) fn n(&self) -> usize {
        self.b * self.t
    }

    /// Rows of the largest chunk.
    pub fn chunk_rows(&self) -> usize {
        if self.chunk >= self.t {
            (self.chunk / self.t.max(1)).clamp(1, self.b.max(1)) * self.t
        } else {
            self.chunk
        }
    }

    /// The chunks in row order: groups of whole sequences, or each sequence's tokens `chunk`
    /// at a time (the last one shorter when `chunk` does not divide `t`).
    pub fn chunks(&self) -> impl Iterator<Item = Chunk> + '_ {
        let t = self.t;
        let (per_seq, seqs) = if self.chunk >= t {
            (t.max(1), (self.chunk / t.max(1)).clamp(1, self.b.max(1)))
        } else {
            (self.chunk, 1)
        };
        (0..self.b).step_by(seqs).flat_map(move |b0| {
            let nb = seqs.min(self.b - b0);
            (0..t).step_by(per_seq).map(move |q0| Chunk {
                b0,
                nb,
                q0,
                q1: (q0 + per_seq).min(t),
            })
        })
    }
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
        Kernel::EmbedFwd { batch, w, x } => {
            at.ids(&batch.tokens, n, "tokens")?;
            let e = at.range(*w, 0, v * c, "embedding")?;
            let x = at.range(*x, 0, n * c, "x")?;
            let ids = be.upload_ids(&batch.tokens)?;
            be.embed_fwd(x, e, ids, n, c, v)
        }
        Kernel::EmbedBwd { batch, g, dx } => {
            at.ids(&batch.tokens, n, "tokens")?;
            let de = at.range(*g, 0, v * c, "embedding grads")?;
            let dx = at.range(*dx, 0, n * c, "dx")?;
            let ids = be.upload_ids(&batch.tokens)?;
            be.embed_bwd(de, ids, dx, n, c, v)
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
            let ws = at.kept(*keep, tm, ws, s)?;
            block_fwd(be, blk, p, x, y, pos, &ws, s)
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
            let ws = at.kept(*kept, tm, ws, s)?;
            block_bwd(be, blk, p, gr, x, dy, dx, pos, &ws, s, recompute)
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

/// The buffers of a [`Kernel::HeadLossBwd`].
struct HeadBuffers {
    w: BufId,
    g: BufId,
    tied: Option<(BufId, BufId)>,
    x: BufId,
    dx: BufId,
}

/// The fused head + loss: the LM head is the tied embedding's unit or the head unit's own
/// tensor, whose gradient must not overlap the norm's.
fn run_head<B: Backend>(
    be: &mut B,
    tm: &Templates,
    at: &Ranges<'_, B>,
    h: HeadBuffers,
    batch: &Batch,
    ws: &Ws<B::P>,
    n: usize,
) -> Result<()> {
    let (c, v) = (tm.config.hidden_size, tm.config.vocab_size);
    at.ids(&batch.targets, n, "targets")?;
    let nr = tm.head.norm_range();
    let norm_w = at.range(h.w, nr.start, c, "norm weight")?;
    let norm_g = at.range(h.g, nr.start, c, "norm grads")?;
    let (lm_w, lm_g) = match (h.tied, tm.head.lm_head) {
        (Some((tw, tg)), _) => ((tw, 0), (tg, 0)),
        (None, Some(off)) => ((h.w, off), (h.g, off)),
        (None, None) => {
            return Err(Error::internal(
                "device program",
                "an untied head without an LM head tensor",
            ))
        }
    };
    let lw = at.range(lm_w.0, lm_w.1, v * c, "LM head")?;
    let lg = at.range(lm_g.0, lm_g.1, v * c, "LM head grads")?;
    if lm_g.0 == h.g && lm_g.1 < nr.end && nr.start < lm_g.1 + v * c {
        return Err(Error::internal(
            "device program",
            "head_loss_bwd: the LM head gradient overlaps the norm gradient",
        ));
    }
    let (x, dx) = (
        at.range(h.x, 0, n * c, "x")?,
        at.range(h.dx, 0, n * c, "dx")?,
    );
    let ids = be.upload_ids(&batch.targets)?;
    head_loss_bwd(
        be,
        &tm.config,
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
    /// them for the whole micro-batch: the shape is one chunk), else `ws` itself.
    fn kept(
        &self,
        kept: Option<BufId>,
        tm: &Templates,
        ws: &Ws<B::P>,
        s: Shape,
    ) -> Result<Ws<B::P>> {
        let Some(id) = kept else {
            return Ok(*ws);
        };
        if s.chunk_rows() < s.n() {
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
        let len = internals_len(&tm.config, s.n());
        let base = self.range(id, 0, len, "kept internals")?;
        Ok(ws.keeping::<B>(&tm.config, s.n(), base))
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
