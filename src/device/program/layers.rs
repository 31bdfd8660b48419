//! The layer ops composed from [`Backend`] primitives, op for op as [`crate::model::layers`]:
//! a block's forward and its backward with recompute, the fused LM head + loss.

use super::{Backend, Gemm, Shape, Ws};
use crate::model::config::ModelConfig;
use crate::model::layers::DecoderBlock;
use crate::model::ops::{AttnShape, CE_CHUNK_ROWS};
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

/// Forward internals of a block up to the MLP activation (as `DecoderBlock::internals`); `pos`
/// the tokens' positions in their documents.
#[allow(clippy::too_many_arguments)]
fn internals<B: Backend>(
    be: &mut B,
    blk: &DecoderBlock,
    p: B::P,
    x: B::P,
    pos: B::Ids,
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
    be.rope(ws.q, pos, n, blk.nh, false)?;
    be.rope(ws.k, pos, n, blk.nkv, false)?;
    be.attention_fwd(ws.att, ws.lse, ws.q, ws.k, ws.v, pos, attn_shape(blk, s))?;
    linear_fwd(be, ws.x2, ws.att, w(blk.wo), blk.bo.map(w), n, qd, c)?;
    be.add(ws.x2, x, n * c)?;
    be.rmsnorm_fwd(ws.h2, ws.rstd2, ws.x2, w(blk.ln2), n, c, blk.eps)?;
    linear_fwd(be, ws.gate, ws.h2, w(blk.wg), None, n, c, i)?;
    linear_fwd(be, ws.up, ws.h2, w(blk.wu), None, n, c, i)?;
    be.swiglu_fwd(ws.act, ws.gate, ws.up, n * i)
}

/// `y = block(x)` with the unit's weights at `p`.
#[allow(clippy::too_many_arguments)]
pub fn block_fwd<B: Backend>(
    be: &mut B,
    blk: &DecoderBlock,
    p: B::P,
    x: B::P,
    y: B::P,
    pos: B::Ids,
    ws: &Ws<B::P>,
    s: Shape,
) -> Result<()> {
    let (n, c, i) = (s.n(), blk.c, blk.inter);
    internals(be, blk, p, x, pos, ws, s)?;
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
    pos: B::Ids,
    ws: &Ws<B::P>,
    s: Shape,
) -> Result<()> {
    internals(be, blk, p, x, pos, ws, s)?;
    mlp_bwd(be, blk, p, g, dy, ws, s.n())?;
    attention_bwd(be, blk, p, g, x, dx, pos, ws, s)
}

/// The MLP half of [`block_bwd`]: from dL/dy, the MLP's and second norm's gradients and
/// `ws.d_c2` = dL/dx2.
#[allow(clippy::too_many_arguments)]
fn mlp_bwd<B: Backend>(
    be: &mut B,
    blk: &DecoderBlock,
    p: B::P,
    g: B::P,
    dy: B::P,
    ws: &Ws<B::P>,
    n: usize,
) -> Result<()> {
    let (c, i) = (blk.c, blk.inter);
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
    be.add(ws.d_c2, dy, n * c)
}

/// The attention half of [`block_bwd`]: from `ws.d_c2` = dL/dx2, the attention's and first
/// norm's gradients and dL/dx into `dx`.
#[allow(clippy::too_many_arguments)]
fn attention_bwd<B: Backend>(
    be: &mut B,
    blk: &DecoderBlock,
    p: B::P,
    g: B::P,
    x: B::P,
    dx: B::P,
    pos: B::Ids,
    ws: &Ws<B::P>,
    s: Shape,
) -> Result<()> {
    let (n, c) = (s.n(), blk.c);
    let (qd, kvd) = (blk.nh * blk.hd, blk.nkv * blk.hd);
    let w = |o: usize| B::off(p, o);
    let gw = |o: usize| B::off(g, o);
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
        pos,
        attn_shape(blk, s),
    )?;
    be.rope(ws.dq, pos, n, blk.nh, true)?;
    be.rope(ws.dk, pos, n, blk.nkv, true)?;
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
