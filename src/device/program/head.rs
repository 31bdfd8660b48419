//! The head: final norm, LM head and the loss, with its backward (training) or alone
//! (validation), in chunks of [`ce_chunk`] rows.

use super::layers::stored;
use super::{Backend, Gemm, Ranges, Ws};
use crate::device::{Batch, BufId, LogitsRow};
use crate::model::config::ModelConfig;
use crate::model::ops::ce_chunk;
use crate::model::reference::Templates;
use crate::{Error, Result};

/// The buffers of a [`Kernel::HeadLossBwd`].
pub(super) struct HeadBuffers {
    pub(super) w: BufId,
    pub(super) g: BufId,
    pub(super) tied: Option<(BufId, BufId)>,
    pub(super) x: BufId,
    pub(super) dx: BufId,
}

/// Where the LM head (or its gradient) is: the tied embedding's buffer `tied` from its start,
/// or the head unit's buffer `head` at its tensor's offset.
fn lm_head_at(tm: &Templates, tied: Option<BufId>, head: BufId) -> Result<(BufId, usize)> {
    match (tied, tm.head.lm_head) {
        (Some(t), _) => Ok((t, 0)),
        (None, Some(off)) => Ok((head, off)),
        (None, None) => Err(Error::internal(
            "device program",
            "an untied head without an LM head tensor",
        )),
    }
}

/// One chunk of rows `r0..r0 + m` of `x`: its final norm into `ws.h1` (1/rms into
/// `ws.rstd1`), logits into `ws.ce`, per-row losses into `ws.losses` — and in `ws.ce` the
/// loss's gradient scaled by `grad_scale`.
#[allow(clippy::too_many_arguments)]
fn logits_and_loss<B: Backend>(
    be: &mut B,
    cfg: &ModelConfig,
    norm_w: B::P,
    lm_w: B::P,
    x: B::P,
    targets: B::Ids,
    ws: &Ws<B::P>,
    (r0, m): (usize, usize),
    grad_scale: f32,
    read: Option<&LogitsRow>,
) -> Result<()> {
    let (c, vocab, eps) = (cfg.hidden_size, cfg.vocab_size, cfg.rms_norm_eps as f32);
    let h = stored(be, ws.h1);
    let norm = (norm_w, cfg.norm_weight.offset());
    be.rmsnorm_fwd(h, ws.rstd1, B::off(x, r0 * c), norm, m, c, eps)?;
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
    // The row asked for, before the loss overwrites the logits with their gradient.
    if let Some(r) = read.filter(|r| (r0..r0 + m).contains(&r.row)) {
        be.read_back(B::off(ws.ce, (r.row - r0) * vocab), vocab, r.into.clone())?;
    }
    be.cross_entropy(
        ws.ce,
        B::off(ws.losses, r0),
        B::ids_off(targets, r0),
        m,
        vocab,
        (grad_scale, cfg.final_logit_softcapping.map(|c| c as f32)),
    )
}

/// The fused head + loss: the LM head is the tied embedding's unit or the head unit's own
/// tensor, whose gradient must not overlap the norm's.
pub(super) fn run_head<B: Backend>(
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
    let lm_w = lm_head_at(tm, h.tied.map(|(tw, _)| tw), h.w)?;
    let lm_g = lm_head_at(tm, h.tied.map(|(_, tg)| tg), h.g)?;
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

/// Final norm + LM head + loss over the rows of `x` (as `Head::loss_backward`), in chunks of
/// [`ce_chunk`] rows: per-row losses into `ws.losses`, `dx` written, gradients `+=`.
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
    let (c, vocab) = (cfg.hidden_size, cfg.vocab_size);
    let norm = (norm_w, cfg.norm_weight.offset());
    let rows = ce_chunk(vocab, n);
    for r0 in (0..n).step_by(rows) {
        let m = (r0 + rows).min(n) - r0;
        logits_and_loss(
            be,
            cfg,
            norm_w,
            lm_w,
            x,
            targets,
            ws,
            (r0, m),
            grad_scale,
            None,
        )?;
        let (x, dx) = (B::off(x, r0 * c), B::off(dx, r0 * c));
        let h = stored(be, ws.h1);
        // dh = dlogits·W;  dW += dlogitsᵀ·h.
        be.gemm(Gemm {
            c: ws.d_c,
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
        be.rmsnorm_bwd(dx, norm_g, ws.d_c, x, norm, ws.rstd1, m, c, false)?;
    }
    Ok(())
}

/// Final norm + LM head + loss over the rows of `x`, forward only (validation): per-row losses
/// into `ws.losses`, chunk by chunk as [`head_loss_bwd`] computes them (the same bits); the
/// logits of the row `read` names copied back on the way (generation).
#[allow(clippy::too_many_arguments)]
pub fn head_loss_fwd<B: Backend>(
    be: &mut B,
    cfg: &ModelConfig,
    norm_w: B::P,
    lm_w: B::P,
    x: B::P,
    targets: B::Ids,
    ws: &Ws<B::P>,
    n: usize,
    read: Option<&LogitsRow>,
) -> Result<()> {
    if let Some(r) = read.filter(|r| r.row >= n) {
        return Err(Error::internal(
            "device program",
            format!("logits of row {} of {n}", r.row),
        ));
    }
    let rows = ce_chunk(cfg.vocab_size, n);
    for r0 in (0..n).step_by(rows) {
        let m = (r0 + rows).min(n) - r0;
        // The loss's gradient lands in the logits' scratch, unread.
        logits_and_loss(be, cfg, norm_w, lm_w, x, targets, ws, (r0, m), 0.0, read)?;
    }
    Ok(())
}

/// The head's loss alone ([`crate::device::Kernel::HeadLoss`]): the LM head is the tied
/// embedding's unit (`tied`) or the head unit's own tensor.
#[allow(clippy::too_many_arguments)]
pub(super) fn run_head_loss<B: Backend>(
    be: &mut B,
    tm: &Templates,
    at: &Ranges<'_, B>,
    (w, tied, x): (BufId, Option<BufId>, BufId),
    batch: &Batch,
    ws: &Ws<B::P>,
    n: usize,
) -> Result<()> {
    let (c, v) = (tm.config.hidden_size, tm.config.vocab_size);
    at.ids(&batch.targets, n, "targets")?;
    let nr = tm.head.norm_range();
    let norm_w = at.range(w, nr.start, c, "norm weight")?;
    let lm = lm_head_at(tm, tied, w)?;
    let lw = at.range(lm.0, lm.1, v * c, "LM head")?;
    let x = at.range(x, 0, n * c, "x")?;
    let ids = be.upload_ids(&batch.targets)?;
    head_loss_fwd(
        be,
        &tm.config,
        norm_w,
        lw,
        x,
        ids,
        ws,
        n,
        batch.logits.as_ref(),
    )?;
    be.add_loss(ws.losses, n, batch.loss.clone())
}
