//! The layer ops composed from [`Backend`] primitives, op for op as [`crate::model::layers`]:
//! a block's forward and its backward with recompute, the fused LM head + loss. Blocks run over
//! token chunks ([`Shape::chunks`]): only K, V and their gradients span the micro-batch, every
//! other intermediate is one chunk's.

use super::{Backend, Chunk, Gemm, MoeAt, Precision, Shape, Ws};
use crate::model::layers::{DecoderBlock, MoeMlp};
use crate::model::ops::{self, AttnShape, AuxGrad, ExpertLoad};
use crate::Result;

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

/// A query or key projection of the normed input `h1` into `y`: under QK-norm (`norm`: the
/// norm's weight offset, and the regions for the projection before it and its 1/rms) the
/// projection lands in `raw` and the per-head RMSNorm writes `y`.
#[allow(clippy::too_many_arguments)]
fn qk_projection<B: Backend>(
    be: &mut B,
    blk: &DecoderBlock,
    p: B::P,
    y: B::P,
    h1: B::P,
    (wt, bias): (usize, Option<usize>),
    norm: Option<(usize, B::P, B::P)>,
    (n, heads): (usize, usize),
) -> Result<()> {
    let (c, hd) = (blk.c, blk.hd);
    let w = |o: usize| B::off(p, o);
    match norm {
        None => linear_fwd(be, y, h1, w(wt), bias.map(w), n, c, heads * hd),
        Some((wn, raw, rstd)) => {
            linear_fwd(be, raw, h1, w(wt), bias.map(w), n, c, heads * hd)?;
            be.rmsnorm_fwd(
                y,
                rstd,
                raw,
                (w(wn), blk.norm_offset),
                n * heads,
                hd,
                blk.eps,
            )
        }
    }
}

/// dQ or dK `d` (fp32, after the attention backward) to what the projection's backward reads:
/// RoPE⁻¹, then under QK-norm (`norm` as [`qk_projection`]'s) the norm's backward into the
/// fp32 `scratch` (its weight gradient `+=` into `g`). Returns the GEMMs' operand
/// ([`gemm_grad`], stored in `spare` under bf16) and its fp32 values for a bias gradient.
#[allow(clippy::too_many_arguments)]
fn qk_grad<B: Backend>(
    be: &mut B,
    blk: &DecoderBlock,
    (p, g): (B::P, B::P),
    d: B::P,
    (scratch, spare): (B::P, B::P),
    norm: Option<(usize, B::P, B::P)>,
    bias: bool,
    pos: B::Ids,
    (n, heads): (usize, usize),
) -> Result<(B::P, B::P)> {
    let hd = blk.hd;
    match norm {
        None => Ok((
            unrotated_gemm_grad(be, d, spare, bias, pos, (n, heads, hd), blk.rope_table)?,
            d,
        )),
        Some((wn, raw, rstd)) => {
            be.rope(d, d, pos, (n, heads), true, blk.rope_table)?;
            let (w, gw) = (B::off(p, wn), B::off(g, wn));
            let w = (w, blk.norm_offset);
            be.rmsnorm_bwd(scratch, gw, d, raw, w, rstd, n * heads, hd, false)?;
            Ok((gemm_grad(be, scratch, spare, n * heads * hd)?, scratch))
        }
    }
}

/// `dW += dyᵀ·x` over `rows` rows made of runs of `period` (see [`ops::weight_grad`]): in its
/// fixed row blocks where the backend asks for them, else as one GEMM.
#[allow(clippy::too_many_arguments)]
fn weight_grad<B: Backend>(
    be: &mut B,
    dw: B::P,
    dy: B::P,
    x: B::P,
    rows: usize,
    period: usize,
    din: usize,
    dout: usize,
) -> Result<()> {
    let block = |be: &mut B, r0: usize, r1: usize| {
        be.gemm(Gemm {
            c: dw,
            a: B::off(dy, r0 * dout),
            ta: true,
            b: B::off(x, r0 * din),
            tb: false,
            m: dout,
            k: r1 - r0,
            n: din,
            accumulate: true,
        })
    };
    if be.fixed_grad_blocks() {
        for (r0, r1) in ops::grad_blocks(rows, period) {
            block(be, r0, r1)?;
        }
        Ok(())
    } else {
        block(be, 0, rows)
    }
}

/// Backward of [`linear_fwd`] over `rows` rows in runs of `period`: `dx (= or +=) dy·W`,
/// `dW += dyᵀ·x`, and with a bias `(db, dy32)`, `db += Σ dy32`: the fp32 dy, where `dy` may be
/// its [`stored`] copy (the GEMMs would round it to that).
#[allow(clippy::too_many_arguments)]
fn linear_bwd<B: Backend>(
    be: &mut B,
    dx: B::P,
    dx_accumulate: bool,
    dw: B::P,
    bias: Option<(B::P, B::P)>,
    dy: B::P,
    x: B::P,
    w: B::P,
    (rows, period): (usize, usize),
    din: usize,
    dout: usize,
) -> Result<()> {
    be.gemm(Gemm {
        c: dx,
        a: dy,
        ta: false,
        b: w,
        tb: false,
        m: rows,
        k: dout,
        n: din,
        accumulate: dx_accumulate,
    })?;
    weight_grad(be, dw, dy, x, rows, period, din, dout)?;
    if let Some((db, dy32)) = bias {
        be.bias_bwd(db, dy32, rows, dout)?;
    }
    Ok(())
}

/// What a projection's backward GEMMs read of its output gradient `d` (fp32, `len` elements,
/// left as it is for a bias gradient): under [`Precision::Bf16`] `d` stored in `spare` (a
/// stored region free at that point), else `d`.
fn gemm_grad<B: Backend>(be: &mut B, d: B::P, spare: B::P, len: usize) -> Result<B::P> {
    match be.precision() {
        Precision::Bf16 => {
            let s = B::as_bf16(spare);
            be.store_bf16(s, d, len)?;
            Ok(s)
        }
        Precision::Fp32 => Ok(d),
    }
}

/// [`gemm_grad`] of dQ or dK `d` after RoPE⁻¹ with table `table` (`rows` rows of `heads`
/// heads of `hd`). Under
/// [`Precision::Bf16`] RoPE⁻¹ writes it to `spare` directly, unless a bias gradient needs the
/// fp32 values (`bias`): then they are rotated in place and stored. In fp32, rotated in place.
#[allow(clippy::too_many_arguments)]
fn unrotated_gemm_grad<B: Backend>(
    be: &mut B,
    d: B::P,
    spare: B::P,
    bias: bool,
    pos: B::Ids,
    (rows, heads, hd): (usize, usize, usize),
    table: usize,
) -> Result<B::P> {
    if be.precision() == Precision::Bf16 && !bias {
        let s = B::as_bf16(spare);
        be.rope(s, d, pos, (rows, heads), true, table)?;
        return Ok(s);
    }
    be.rope(d, d, pos, (rows, heads), true, table)?;
    gemm_grad(be, d, spare, rows * heads * hd)
}

/// The chunk's view of the block's buffers: its rows of `[N, ·]` tensors.
struct At<B: Backend> {
    /// The chunk's first row in the micro-batch.
    r0: usize,
    /// Its rows.
    rows: usize,
    /// Rows per run of its weight-gradient blocks (a sequence, or the chunk inside one).
    period: usize,
    /// Its tokens' positions.
    pos: B::Ids,
    /// Its attention: keys of its sequences, its queries.
    attn: AttnShape,
    /// Where its sequences start (keys, values, positions), in rows.
    seq0: usize,
}

impl<B: Backend> At<B> {
    fn new(blk: &DecoderBlock, s: Shape, ch: Chunk, pos: B::Ids) -> Self {
        let r0 = ch.b0 * s.t + ch.q0;
        At {
            r0,
            rows: ch.rows(),
            period: ch.q1 - ch.q0,
            pos: B::ids_off(pos, r0),
            attn: AttnShape::causal(ch.nb, s.t, blk.nh, blk.nkv, blk.hd)
                .windowed(blk.window)
                .scaled(blk.attn_scale)
                .softcapped(blk.attn_softcap)
                .queries(ch.q0, ch.q1),
            seq0: ch.b0 * s.t,
        }
    }

    /// The chunk's rows of a `[N, width]` tensor.
    fn rows_of(&self, p: B::P, width: usize) -> B::P {
        B::off(p, self.r0 * width)
    }

    /// The chunk's padding flags, of the micro-batch's `pad` (`[N]`, checked with the batch).
    fn pad<'a>(&self, pad: Option<&'a [u8]>) -> Option<&'a [u8]> {
        pad.and_then(|p| p.get(self.r0..self.r0 + self.rows))
    }
}

/// Pass one of a block: K and V `[N, nkv·hd]` for the chunk's rows (RoPE on K), from its
/// normed input.
fn keys_values<B: Backend>(
    be: &mut B,
    blk: &DecoderBlock,
    p: B::P,
    x: B::P,
    ws: &Ws<B::P>,
    at: &At<B>,
) -> Result<()> {
    let (n, c, kvd) = (at.rows, blk.c, blk.nkv * blk.hd);
    let w = |o: usize| B::off(p, o);
    let h1 = stored(be, ws.h1);
    let ln1 = (w(blk.ln1), blk.norm_offset);
    be.rmsnorm_fwd(h1, ws.rstd1, at.rows_of(x, c), ln1, n, c, blk.eps)?;
    // Under bf16 each is computed in the attention output's region (free until the queries
    // run), then stored: K by its RoPE, V by a cast.
    let k = at.rows_of(stored(be, ws.k), kvd);
    let y = computed_in(be, k, ws.att);
    let norm = blk.kn.map(|o| (o, ws.k_raw, ws.rstd_k));
    qk_projection(be, blk, p, y, h1, (blk.wk, blk.bk), norm, (n, blk.nkv))?;
    be.rope(k, y, at.pos, (n, blk.nkv), false, blk.rope_table)?;
    let v = at.rows_of(stored(be, ws.v), kvd);
    let y = computed_in(be, v, ws.att);
    linear_fwd(be, y, h1, w(blk.wv), blk.bv.map(w), n, c, kvd)?;
    store(be, v, y, n * kvd)
}

/// The region at `p` as the recipe stores an activation that only GEMMs and attention read
/// (the norms' outputs, Q, K, V, the SwiGLU output, its gradients and the attention output's
/// gradient): in bf16 under [`Precision::Bf16`] — rounded once when written, the value every
/// GEMM reading it would round it to — else in fp32.
pub(super) fn stored<B: Backend>(be: &B, p: B::P) -> B::P {
    match be.precision() {
        Precision::Bf16 => B::as_bf16(p),
        Precision::Fp32 => p,
    }
}

/// Where a [`stored`] tensor that a GEMM computes (Q, K, V, dO) is computed: under
/// [`Precision::Bf16`] in fp32 `scratch`, then stored by RoPE or [`store`]; else in place.
fn computed_in<B: Backend>(be: &B, dst: B::P, scratch: B::P) -> B::P {
    match be.precision() {
        Precision::Bf16 => scratch,
        Precision::Fp32 => dst,
    }
}

/// `dst = src` (`len` elements) rounded to bf16 under [`Precision::Bf16`]; nothing in fp32,
/// where [`computed_in`] computed it in place.
fn store<B: Backend>(be: &mut B, dst: B::P, src: B::P, len: usize) -> Result<()> {
    match be.precision() {
        Precision::Bf16 => be.store_bf16(dst, src, len),
        Precision::Fp32 => Ok(()),
    }
}

/// Pass two of a block, up to the MLP activation for the chunk's rows (as
/// `DecoderBlock::internals`), its queries attending over the whole K and V.
fn query_internals<B: Backend>(
    be: &mut B,
    blk: &DecoderBlock,
    p: B::P,
    x: B::P,
    ws: &Ws<B::P>,
    at: &At<B>,
    pos: B::Ids,
) -> Result<()> {
    let (n, c, i, qd) = (at.rows, blk.c, blk.inter, blk.nh * blk.hd);
    let w = |o: usize| B::off(p, o);
    let x = at.rows_of(x, c);
    let (h1, h2, act) = (stored(be, ws.h1), stored(be, ws.h2), stored(be, ws.act));
    let norm_w = |o: usize| (w(o), blk.norm_offset);
    be.rmsnorm_fwd(h1, ws.rstd1, x, norm_w(blk.ln1), n, c, blk.eps)?;
    // Under bf16 the queries are computed where the attention writes its output, then stored
    // by their RoPE.
    let q = stored(be, ws.q);
    let y = computed_in(be, q, ws.att);
    let norm = blk.qn.map(|o| (o, ws.q_raw, ws.rstd_q));
    qk_projection(be, blk, p, y, h1, (blk.wq, blk.bq), norm, (n, blk.nh))?;
    be.rope(q, y, at.pos, (n, blk.nh), false, blk.rope_table)?;
    let (k, v) = sequence_keys_values(be, blk, ws, at);
    let seq_pos = B::ids_off(pos, at.seq0);
    be.attention_fwd(ws.att, ws.lse, q, k, v, seq_pos, at.attn)?;
    if let Some(o) = blk.sinks {
        be.attn_sinks_fwd(ws.att, ws.lse, w(o), at.attn)?;
    }
    // x2 = x + att·Woᵀ (+ bo), the projection normed first under sandwich norms.
    match blk.post_attn_norm {
        None => linear_fwd(be, ws.x2, ws.att, w(blk.wo), blk.bo.map(w), n, qd, c)?,
        Some(pa) => {
            linear_fwd(be, ws.attn_out, ws.att, w(blk.wo), blk.bo.map(w), n, qd, c)?;
            be.rmsnorm_fwd(ws.x2, ws.rstd_pa, ws.attn_out, norm_w(pa), n, c, blk.eps)?;
        }
    }
    be.add(ws.x2, x, n * c)?;
    be.rmsnorm_fwd(h2, ws.rstd2, ws.x2, norm_w(blk.ln2), n, c, blk.eps)?;
    if blk.moe.is_some() {
        return Ok(());
    }
    linear_fwd(be, ws.gate, h2, w(blk.wg), None, n, c, i)?;
    linear_fwd(be, ws.up, h2, w(blk.wu), None, n, c, i)?;
    be.gated_fwd(blk.act, act, ws.gate, ws.up, n * i)
}

/// The MLP's down projection of the chunk's `act` into `out` (`[rows, C]`), or under sandwich
/// norms into `ws.mlp_out` and its norm into `out` (1/rms into `ws.rstd_pf`). A mixture of
/// experts returns what it routed over the rows `pad` does not mark as padding.
fn mlp_output<B: Backend>(
    be: &mut B,
    blk: &DecoderBlock,
    p: B::P,
    out: B::P,
    ws: &Ws<B::P>,
    (rows, pad): (usize, Option<&[u8]>),
) -> Result<Option<ExpertLoad>> {
    let (c, i) = (blk.c, blk.inter);
    let act = stored(be, ws.act);
    let wd = B::off(p, blk.wd);
    let project = |be: &mut B, out: B::P| match &blk.moe {
        Some(m) => be
            .moe_fwd(
                out,
                stored(be, ws.h2),
                moe_at::<B>(p, m),
                rows,
                m.shape,
                pad,
            )
            .map(Some),
        None => linear_fwd(be, out, act, wd, None, rows, i, c).map(|()| None),
    };
    match blk.post_mlp_norm {
        None => project(be, out),
        Some(pf) => {
            let load = project(be, ws.mlp_out)?;
            let w = (B::off(p, pf), blk.norm_offset);
            be.rmsnorm_fwd(out, ws.rstd_pf, ws.mlp_out, w, rows, c, blk.eps)?;
            Ok(load)
        }
    }
}

/// A mixture-of-experts MLP's tensors in a unit's buffer at `base` (params or gradients).
fn moe_at<B: Backend>(base: B::P, m: &MoeMlp) -> MoeAt<B::P> {
    MoeAt {
        router: B::off(base, m.router),
        gate_up: B::off(base, m.gate_up),
        down: B::off(base, m.down),
        biases: m.biases.map(|b| b.map(|o| B::off(base, o))),
    }
}

/// K and V `[B, T, nkv·hd]` of the chunk's sequences, as the recipe stores them.
fn sequence_keys_values<B: Backend>(
    be: &B,
    blk: &DecoderBlock,
    ws: &Ws<B::P>,
    at: &At<B>,
) -> (B::P, B::P) {
    let at_seq = |p: B::P| B::off(stored(be, p), at.seq0 * blk.nkv * blk.hd);
    (at_seq(ws.k), at_seq(ws.v))
}

/// `y = block(x)` with the unit's weights at `p`, chunk by chunk: K and V for every chunk,
/// then each chunk's queries to its output. A mixture of experts returns what it routed over
/// every chunk, but for the tokens `pad` `[N]` marks as padding.
#[allow(clippy::too_many_arguments)]
pub fn block_fwd<B: Backend>(
    be: &mut B,
    blk: &DecoderBlock,
    p: B::P,
    x: B::P,
    y: B::P,
    (pos, pad): (B::Ids, Option<&[u8]>),
    ws: &Ws<B::P>,
    s: Shape,
) -> Result<Option<ExpertLoad>> {
    let c = blk.c;
    for ch in s.chunks() {
        keys_values(be, blk, p, x, ws, &At::<B>::new(blk, s, ch, pos))?;
    }
    let mut routed: Option<ExpertLoad> = None;
    for ch in s.chunks() {
        let at = At::<B>::new(blk, s, ch, pos);
        query_internals(be, blk, p, x, ws, &at, pos)?;
        let y = at.rows_of(y, c);
        if let Some(load) = mlp_output(be, blk, p, y, ws, (at.rows, at.pad(pad)))? {
            routed.get_or_insert_with(ExpertLoad::default).add(&load);
        }
        be.add(y, ws.x2, at.rows * c)?;
    }
    Ok(routed)
}

/// A block's backward from its input `x`, recomputing its internals chunk by chunk (unless
/// `recompute` is false: the forward kept them in `ws`, for a shape of one chunk): gradients
/// `+=` into `g`, `dx` written, `dy` consumed (it holds dL/dh1's query part between the passes).
///
/// Pass one recomputes K and V; pass two, per chunk, the chunk's internals, the MLP's and the
/// attention output's backward, the attention backward for its queries (dK and dV summed over
/// the chunks) and dL/dh1's query part; pass three, per chunk, the rest of dL/dh1 from the
/// finished dK and dV and the first norm's backward. `aux`: a mixture of experts'
/// load-balancing gradient per expert and the micro-batch's padding flags `[N]`
/// ([`Backend::moe_bwd`]).
#[allow(clippy::too_many_arguments)]
pub fn block_bwd<B: Backend>(
    be: &mut B,
    blk: &DecoderBlock,
    p: B::P,
    g: B::P,
    x: B::P,
    dy: B::P,
    dx: B::P,
    pos: B::Ids,
    ws: &Ws<B::P>,
    s: Shape,
    recompute: bool,
    aux: Option<AuxGrad<'_>>,
) -> Result<()> {
    let (c, qd, kvd) = (blk.c, blk.nh * blk.hd, blk.nkv * blk.hd);
    let w = |o: usize| B::off(p, o);
    let gw = |o: usize| B::off(g, o);
    be.zero(ws.dk, s.n() * kvd)?;
    be.zero(ws.dv, s.n() * kvd)?;
    if recompute {
        for ch in s.chunks() {
            keys_values(be, blk, p, x, ws, &At::<B>::new(blk, s, ch, pos))?;
        }
    }
    for ch in s.chunks() {
        let at = At::<B>::new(blk, s, ch, pos);
        let (n, rows) = (at.rows, (at.rows, at.period));
        let (dy, dx) = (at.rows_of(dy, c), at.rows_of(dx, c));
        if recompute {
            query_internals(be, blk, p, x, ws, &at, pos)?;
        }
        // dx = dx2 + rmsnorm_bwd(dh1): dx2 now (into dx), the rest in pass three.
        let aux = aux.map(|a| AuxGrad {
            pad: at.pad(a.pad),
            ..a
        });
        mlp_bwd(be, blk, p, g, dy, dx, ws, rows, aux)?;
        // Attention: x2 = x + att·Woᵀ (+ bo), under sandwich norms x + norm(att·Woᵀ (+ bo)):
        // dL/d(att·Woᵀ) through d_c (free here). Under bf16 dO is computed where the attention
        // backward writes dQ, then stored.
        let d_proj = match blk.post_attn_norm {
            None => dx,
            Some(pa) => {
                let wn = (w(pa), blk.norm_offset);
                be.rmsnorm_bwd(ws.d_c, gw(pa), dx, ws.attn_out, wn, ws.rstd_pa, n, c, false)?;
                ws.d_c
            }
        };
        let d_att = stored(be, ws.d_att);
        let d_att_f32 = computed_in(be, d_att, ws.dq);
        linear_bwd(
            be,
            d_att_f32,
            false,
            gw(blk.wo),
            blk.bo.map(|o| (gw(o), d_proj)),
            d_proj,
            ws.att,
            w(blk.wo),
            rows,
            qd,
            c,
        )?;
        let (dk, dv) = (B::off(ws.dk, at.seq0 * kvd), B::off(ws.dv, at.seq0 * kvd));
        store(be, d_att, d_att_f32, n * qd)?;
        // The sinks' gradient from dO as stored (as the attention's backward reads it).
        if let Some(o) = blk.sinks {
            be.attn_sinks_bwd(gw(o), d_att, ws.att, ws.lse, w(o), at.attn)?;
        }
        let (k, v) = sequence_keys_values(be, blk, ws, &at);
        be.attention_bwd(
            ws.dq,
            dk,
            dv,
            ws.delta,
            d_att,
            stored(be, ws.q),
            k,
            v,
            ws.att,
            ws.lse,
            B::ids_off(pos, at.seq0),
            at.attn,
        )?;
        // Under bf16 the GEMMs read dQ stored where dO was (read by the attention backward).
        let norm = blk.qn.map(|o| (o, ws.q_raw, ws.rstd_q));
        let (bq, pq) = (blk.bq.is_some(), (p, g));
        let (dq, dq32) = qk_grad(
            be,
            blk,
            pq,
            ws.dq,
            (ws.d_raw, ws.d_att),
            norm,
            bq,
            at.pos,
            (n, blk.nh),
        )?;
        // dh1 = dq·Wq (+ dk·Wk + dv·Wv in pass three), kept where this chunk's dy was.
        linear_bwd(
            be,
            dy,
            false,
            gw(blk.wq),
            blk.bq.map(|o| (gw(o), dq32)),
            dq,
            stored(be, ws.h1),
            w(blk.wq),
            rows,
            c,
            qd,
        )?;
    }
    for ch in s.chunks() {
        let at = At::<B>::new(blk, s, ch, pos);
        let (n, rows) = (at.rows, (at.rows, at.period));
        let (x, dy, dx) = (at.rows_of(x, c), at.rows_of(dy, c), at.rows_of(dx, c));
        let (dk, dv) = (at.rows_of(ws.dk, kvd), at.rows_of(ws.dv, kvd));
        let h1 = stored(be, ws.h1);
        let ln1 = (w(blk.ln1), blk.norm_offset);
        if recompute {
            be.rmsnorm_fwd(h1, ws.rstd1, x, ln1, n, c, blk.eps)?;
        }
        // Under bf16 the GEMMs read dK and dV stored where dO and dQ were (free now, and in
        // the workspace: kept internals are read-only here). QK-norm's backward needs the
        // chunk's keys before their norm (recomputed, unless kept; the recomputed norm's output
        // is not needed: written to d_raw, which the backward then overwrites).
        let norm = blk.kn.map(|o| (o, ws.k_raw, ws.rstd_k));
        if let (Some((kn, raw, rstd)), true) = (norm, recompute) {
            linear_fwd(be, raw, h1, w(blk.wk), blk.bk.map(w), n, c, kvd)?;
            let kn = (w(kn), blk.norm_offset);
            be.rmsnorm_fwd(ws.d_raw, rstd, raw, kn, n * blk.nkv, blk.hd, blk.eps)?;
        }
        let (bk, pk) = (blk.bk.is_some(), (p, g));
        let (dk16, dk32) = qk_grad(
            be,
            blk,
            pk,
            dk,
            (ws.d_raw, ws.d_att),
            norm,
            bk,
            at.pos,
            (n, blk.nkv),
        )?;
        let dv16 = gemm_grad(be, dv, ws.dq, n * kvd)?;
        for (wo, bias, d32, d) in [(blk.wk, blk.bk, dk32, dk16), (blk.wv, blk.bv, dv, dv16)] {
            linear_bwd(
                be,
                dy,
                true,
                gw(wo),
                bias.map(|o| (gw(o), d32)),
                d,
                h1,
                w(wo),
                rows,
                c,
                kvd,
            )?;
        }
        be.rmsnorm_bwd(dx, gw(blk.ln1), dy, x, ln1, ws.rstd1, n, c, true)?;
    }
    Ok(())
}

/// The MLP half of a chunk's backward: from dL/dy, the MLP's and second norm's gradients and
/// `dx2` = dL/dx2.
#[allow(clippy::too_many_arguments)]
fn mlp_bwd<B: Backend>(
    be: &mut B,
    blk: &DecoderBlock,
    p: B::P,
    g: B::P,
    dy: B::P,
    dx2: B::P,
    ws: &Ws<B::P>,
    rows: (usize, usize),
    aux: Option<AuxGrad<'_>>,
) -> Result<()> {
    let (n, c, i) = (rows.0, blk.c, blk.inter);
    let w = |o: usize| B::off(p, o);
    let gw = |o: usize| B::off(g, o);
    // MLP: y = x2 + act·Wdᵀ, act = act(gate) ⊙ up; under sandwich norms y = x2 +
    // norm(act·Wdᵀ): its backward (the projection and its 1/rms recomputed; the norm's output,
    // not needed, lands in d_c) gives dL/d(act·Wdᵀ) in d_c.
    let d_out = match blk.post_mlp_norm {
        None => dy,
        Some(pf) => {
            mlp_output(be, blk, p, ws.d_c, ws, (n, None))?;
            let wn = (w(pf), blk.norm_offset);
            be.rmsnorm_bwd(ws.d_c, gw(pf), dy, ws.mlp_out, wn, ws.rstd_pf, n, c, false)?;
            ws.d_c
        }
    };
    if let Some(m) = &blk.moe {
        be.moe_bwd(
            ws.d_c,
            moe_at::<B>(g, m),
            d_out,
            stored(be, ws.h2),
            moe_at::<B>(p, m),
            n,
            m.shape,
            aux,
        )?;
        return norm2_bwd(be, blk, p, g, dy, dx2, ws, n);
    }
    linear_bwd(
        be,
        ws.d_i1,
        false,
        gw(blk.wd),
        None,
        d_out,
        stored(be, ws.act),
        w(blk.wd),
        rows,
        i,
        c,
    )?;
    // d gate and d up are read only by the GEMMs below (the MLP has no biases).
    let (d_gate, d_up) = (stored(be, ws.d_i2), stored(be, ws.d_i3));
    be.gated_bwd(blk.act, d_gate, d_up, ws.d_i1, ws.gate, ws.up, n * i)?;
    linear_bwd(
        be,
        ws.d_c,
        false,
        gw(blk.wg),
        None,
        d_gate,
        stored(be, ws.h2),
        w(blk.wg),
        rows,
        c,
        i,
    )?;
    linear_bwd(
        be,
        ws.d_c,
        true,
        gw(blk.wu),
        None,
        d_up,
        stored(be, ws.h2),
        w(blk.wu),
        rows,
        c,
        i,
    )?;
    norm2_bwd(be, blk, p, g, dy, dx2, ws, n)
}

/// `dx2` = the MLP input norm's backward of `ws.d_c` = dL/dh2, plus `dy`.
#[allow(clippy::too_many_arguments)]
fn norm2_bwd<B: Backend>(
    be: &mut B,
    blk: &DecoderBlock,
    p: B::P,
    g: B::P,
    dy: B::P,
    dx2: B::P,
    ws: &Ws<B::P>,
    n: usize,
) -> Result<()> {
    let c = blk.c;
    let (w, gw) = (|o: usize| B::off(p, o), |o: usize| B::off(g, o));
    // dx2 = rmsnorm_bwd(dh2) + dy.
    be.rmsnorm_bwd(
        dx2,
        gw(blk.ln2),
        ws.d_c,
        ws.x2,
        (w(blk.ln2), blk.norm_offset),
        ws.rstd2,
        n,
        c,
        false,
    )?;
    be.add(dx2, dy, n * c)
}
