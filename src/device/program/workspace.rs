//! The layer workspace: the program's scratch regions in one device allocation, and the block
//! internals [`crate::engine::Activations::Keep`] keeps for the backward.

use super::{Backend, Precision, Shape};
use crate::model::config::ModelConfig;
use crate::model::ops::ce_chunk;

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
/// (or, from [`Ws::layout`], an offset in 4-byte words). Shapes in elements, for a micro-batch
/// of `N = B·T` tokens run in chunks of at most `M` rows ([`Shape::chunk_rows`]), hidden size
/// `C`, MLP size `I`, `nh` query and `nkv` key/value heads of `hd` dimensions and a vocabulary
/// of `V`. Only K, V, their gradients and the per-row losses span the micro-batch; the head
/// runs in chunks of `H = ce_chunk(V, N)` rows.
///
/// The regions marked *stored* hold what the recipe stores in bf16 under
/// [`Precision::Bf16`] ([`Backend::as_bf16`]): a GPU holds them in 2-byte elements, half the
/// words of an fp32 region.
#[derive(Debug, Clone, Copy)]
pub struct Ws<P> {
    /// `[max(M, H), C]` the first RMSNorm's output (and the head's norm output); stored.
    pub h1: P,
    /// `[max(M, H)]` the first RMSNorm's 1/rms per row (and the head's).
    pub rstd1: P,
    /// `[M, nh·hd]` queries after RoPE; stored.
    pub q: P,
    /// `[N, nkv·hd]` keys after RoPE; stored.
    pub k: P,
    /// `[N, nkv·hd]` values; stored.
    pub v: P,
    /// `[M, nh·hd]` attention output (before the output projection).
    pub att: P,
    /// `[nh, M]` log-sum-exp of each attention row (flash attention's saved statistic).
    pub lse: P,
    /// `[nh, M]` rowsum(dO ⊙ O), the flash attention backward's scratch.
    pub delta: P,
    /// `[M, C]` the residual stream after attention.
    pub x2: P,
    /// `[M, C]` the second RMSNorm's output; stored.
    pub h2: P,
    /// `[M]` the second RMSNorm's 1/rms per row.
    pub rstd2: P,
    /// `[M, I]` the MLP's gate projection.
    pub gate: P,
    /// `[M, I]` the MLP's up projection.
    pub up: P,
    /// `[M, I]` silu(gate) ⊙ up; stored.
    pub act: P,
    /// `[M, I]` dL/d act.
    pub d_i1: P,
    /// `[M, I]` dL/d gate; stored.
    pub d_i2: P,
    /// `[M, I]` dL/d up; stored.
    pub d_i3: P,
    /// `[M, nh·hd]` dL/d att; stored.
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
    /// QK-norm (else empty): `[M, nh·hd]` the queries before their norm.
    pub q_raw: P,
    /// QK-norm: `[M, nkv·hd]` the chunk's keys before their norm.
    pub k_raw: P,
    /// QK-norm: `[M·nh]` the query norms' 1/rms per row and head.
    pub rstd_q: P,
    /// QK-norm: `[M·nkv]` the key norms' 1/rms.
    pub rstd_k: P,
    /// QK-norm: `[M, nh·hd]` dL/d q_raw, then dL/d k_raw (fp32, for the projections'
    /// backward).
    pub d_raw: P,
    /// Sandwich norms (else empty): `[M, C]` the attention's output projection before its norm.
    pub attn_out: P,
    /// Sandwich norms: `[M]` its norm's 1/rms.
    pub rstd_pa: P,
    /// Sandwich norms: `[M, C]` the MLP's down projection before its norm.
    pub mlp_out: P,
    /// Sandwich norms: `[M]` its norm's 1/rms.
    pub rstd_pf: P,
}

impl Ws<usize> {
    /// Offsets of every region for the shape `s`, and the total, in 4-byte words. `stored` is
    /// how the device holds the stored regions: a GPU's precision (2-byte elements under
    /// bf16); [`Precision::Fp32`] for the CPU device, which holds bf16 values in fp32 storage
    /// (and charges a GPU's bytes: [`workspace_bytes`]).
    pub fn layout(cfg: &ModelConfig, s: Shape, stored: Precision) -> (Self, usize) {
        let (n, m) = (s.n(), s.chunk_rows());
        let (c, qd, kvd, i) = (
            cfg.hidden_size,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.intermediate_size,
        );
        let ce_rows = ce_chunk(cfg.vocab_size, n);
        let mh = m.max(ce_rows);
        let mut regions = Regions::default();
        let half = |len: usize| words(len, stored);
        let qk = |len: usize| if cfg.qk_norm { len } else { 0 };
        let sw = |len: usize| if cfg.sandwich_norms { len } else { 0 };
        let mut take = |len: usize| regions.take(len);
        let ws = Ws {
            h1: take(half(mh * c)),
            rstd1: take(mh),
            q: take(half(m * qd)),
            k: take(half(n * kvd)),
            v: take(half(n * kvd)),
            att: take(m * qd),
            lse: take(cfg.num_heads * m),
            delta: take(cfg.num_heads * m),
            x2: take(m * c),
            h2: take(half(m * c)),
            rstd2: take(m),
            gate: take(m * i),
            up: take(m * i),
            act: take(half(m * i)),
            d_i1: take(m * i),
            d_i2: take(half(m * i)),
            d_i3: take(half(m * i)),
            d_att: take(half(m * qd)),
            d_c: take(mh * c),
            dq: take(m * qd),
            dk: take(n * kvd),
            dv: take(n * kvd),
            ce: take(ce_rows * cfg.vocab_size),
            losses: take(n),
            q_raw: take(qk(m * qd)),
            k_raw: take(qk(m * kvd)),
            rstd_q: take(qk(m * cfg.num_heads)),
            rstd_k: take(qk(m * cfg.num_kv_heads)),
            d_raw: take(qk(m * qd)),
            attn_out: take(sw(m * c)),
            rstd_pa: take(sw(m)),
            mlp_out: take(sw(m * c)),
            rstd_pf: take(sw(m)),
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
            q_raw: f(self.q_raw),
            k_raw: f(self.k_raw),
            rstd_q: f(self.rstd_q),
            rstd_k: f(self.rstd_k),
            d_raw: f(self.d_raw),
            attn_out: f(self.attn_out),
            rstd_pa: f(self.rstd_pa),
            mlp_out: f(self.mlp_out),
            rstd_pf: f(self.rstd_pf),
        }
    }
}

/// A block's forward internals kept for its backward ([`crate::engine::Activations::Keep`]):
/// offsets, for `n` tokens (the whole micro-batch), of the [`Ws`] regions the forward writes
/// and the backward reads — h1, rstd1, q, k, v, att, lse, x2, h2, rstd2, gate, up, act, under
/// QK-norm q_raw, k_raw, rstd_q, rstd_k, under sandwich norms attn_out, rstd_pa — in one
/// buffer of [`internals_len`] 4-byte words; the stored ones (h1, q, k, v, h2, act) as
/// [`Ws::layout`] holds them.
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
    q_raw: usize,
    k_raw: usize,
    rstd_q: usize,
    rstd_k: usize,
    attn_out: usize,
    rstd_pa: usize,
}

impl Internals {
    fn layout(cfg: &ModelConfig, n: usize, stored: Precision) -> (Self, usize) {
        let (c, qd, kvd, i) = (
            cfg.hidden_size,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.intermediate_size,
        );
        let qk = |len: usize| if cfg.qk_norm { len } else { 0 };
        let sw = |len: usize| if cfg.sandwich_norms { len } else { 0 };
        let mut regions = Regions::default();
        let mut take = |len: usize| regions.take(len);
        let r = Internals {
            h1: take(words(n * c, stored)),
            rstd1: take(n),
            q: take(words(n * qd, stored)),
            k: take(words(n * kvd, stored)),
            v: take(words(n * kvd, stored)),
            att: take(n * qd),
            lse: take(cfg.num_heads * n),
            x2: take(n * c),
            h2: take(words(n * c, stored)),
            rstd2: take(n),
            gate: take(n * i),
            up: take(n * i),
            act: take(words(n * i, stored)),
            q_raw: take(qk(n * qd)),
            k_raw: take(qk(n * kvd)),
            rstd_q: take(qk(n * cfg.num_heads)),
            rstd_k: take(qk(n * cfg.num_kv_heads)),
            attn_out: take(sw(n * c)),
            rstd_pa: take(sw(n)),
        };
        (r, regions.end)
    }
}

/// Words of a stored region of `len` elements held as `stored` says ([`Ws::layout`]).
fn words(len: usize, stored: Precision) -> usize {
    match stored {
        Precision::Fp32 => len,
        Precision::Bf16 => len.div_ceil(2),
    }
}

/// 4-byte words of one block's kept internals for micro-batches of `n` tokens, the stored
/// regions held as `stored` says ([`Ws::layout`]).
pub fn internals_len(cfg: &ModelConfig, n: usize, stored: Precision) -> usize {
    Internals::layout(cfg, n, stored).1
}

impl<P: Copy> Ws<P> {
    /// These regions with the forward internals in `kept` (a buffer of [`internals_len`]
    /// words, `stored` as the workspace's) instead of the workspace: a forward run on it
    /// leaves them for the backward.
    pub fn keeping<B: Backend<P = P>>(
        &self,
        cfg: &ModelConfig,
        n: usize,
        kept: P,
        stored: Precision,
    ) -> Self {
        let (r, _) = Internals::layout(cfg, n, stored);
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
            q_raw: f(r.q_raw),
            k_raw: f(r.k_raw),
            rstd_q: f(r.rstd_q),
            rstd_k: f(r.rstd_k),
            attn_out: f(r.attn_out),
            rstd_pa: f(r.rstd_pa),
            ..*self
        }
    }
}

/// Bytes of a GPU's layer workspace for the shape `s` in `precision` (what the CPU device
/// charges too), with the mixture-of-experts MLP's scratch ([`moe_scratch_bytes`]).
pub fn workspace_bytes(cfg: &ModelConfig, s: Shape, precision: Precision) -> u64 {
    4 * Ws::layout(cfg, s, precision).1 as u64 + moe_scratch_bytes(cfg, s, precision)
}

/// Bytes a mixture-of-experts MLP holds besides the workspace for one chunk of `s` (0 for a
/// dense model): per token its router logits and probabilities `[E]`, per grouped row (`k` per
/// token) its expert, weights and slot numbers, the gathered input, the expert's output and its
/// gradient `[C]` each, gate/up and their gradient `[2I]` each, and four more `[I]` (up, the
/// activation, and their gradients), per expert its probability sum (f64) and load-balancing
/// gradient; per token a padding flag (one byte); under bf16 the GEMMs' bf16 copies of the
/// activation `[I]`, dY `[C]` and d gate/up `[2I]` per grouped row — the CUDA backend's
/// `MoeScratch`, about what the CPU op allocates per call.
pub fn moe_scratch_bytes(cfg: &ModelConfig, s: Shape, precision: Precision) -> u64 {
    let Some(m) = &cfg.moe else {
        return 0;
    };
    let (n, e, k) = (s.chunk_rows() as u64, m.num_experts as u64, m.top_k as u64);
    let (c, i) = (cfg.hidden_size as u64, m.expert_intermediate as u64);
    let rows = n * k;
    let copies = match precision {
        Precision::Fp32 => 0,
        Precision::Bf16 => 2 * rows * (i + c + 2 * i),
    };
    4 * (2 * n * e + 5 * rows + 3 * rows * c + 2 * rows * 2 * i + 4 * rows * i)
        + n
        + 12 * e
        + copies
}

/// The elements of the largest unit of `cfg`.
pub fn max_unit_numel(cfg: &ModelConfig) -> usize {
    crate::model::units::units(cfg)
        .iter()
        .map(|u| u.numel)
        .max()
        .unwrap_or(0)
}

/// Device bytes the bf16 recipe adds on a GPU beside the step's buffers, for shape `s`: the
/// gradient staging ([`bf16_staging_bytes`]) and the GEMM operand buffers
/// ([`bf16_operand_bytes`]); 0 in fp32.
pub fn bf16_device_bytes(cfg: &ModelConfig, s: Shape, precision: Precision) -> u64 {
    bf16_staging_bytes(cfg, precision) + bf16_operand_bytes(cfg, s, precision)
}

/// Bytes of a GPU's bf16 gradient staging, whatever the shape (0 in fp32): one bounce chunk
/// of the largest unit in bf16, for `--grad-link bf16`. (The weights need none: a bf16 device
/// holds them in bf16.)
pub fn bf16_staging_bytes(cfg: &ModelConfig, precision: Precision) -> u64 {
    match precision {
        Precision::Fp32 => 0,
        Precision::Bf16 => 2 * crate::device::BOUNCE_CHUNK_ELEMS.min(max_unit_numel(cfg)) as u64,
    }
}

/// Bytes of a GPU's two bf16 GEMM operand buffers for shape `s` ([`bf16_operand_elems`] each);
/// 0 in fp32. They grow with the token chunk, so a chunking is fitted with them.
pub fn bf16_operand_bytes(cfg: &ModelConfig, s: Shape, precision: Precision) -> u64 {
    match precision {
        Precision::Fp32 => 0,
        Precision::Bf16 => 4 * bf16_operand_elems(cfg, s) as u64,
    }
}

/// Under [`crate::device::Precision::Bf16`], the elements of the largest GEMM operand a device
/// casts, for shape `s`: a device that casts operands to bf16 before a bf16 GEMM needs two bf16
/// buffers of this many elements. The operands cast are the fp32 ones: a chunk's attention
/// output (`rows × nh·hd`), the residual's gradient (`rows × C`, the output projections' dy)
/// and a CE chunk's logits gradient (`rows × vocab`); in a mixture of experts the router's
/// d logits (`rows × E`). The weights, the stored activations ([`Ws`]: the MLP's are the only
/// `rows × I` operands), the MoE's operands (its scratch's bf16 copies, [`moe_scratch_bytes`])
/// and the stored dQ, dK and dV are in bf16 already.
pub fn bf16_operand_elems(cfg: &ModelConfig, s: Shape) -> usize {
    let (c, qd, kvd) = (cfg.hidden_size, cfg.q_dim(), cfg.kv_dim());
    let rows = s.chunk_rows();
    let ce_rows = ce_chunk(cfg.vocab_size, s.n());
    let experts = cfg.moe.as_ref().map_or(0, |m| m.num_experts);
    let widest = c.max(qd).max(kvd).max(experts);
    [rows * widest, ce_rows * cfg.vocab_size]
        .into_iter()
        .max()
        .unwrap_or(0)
}
