//! The head unit's template: the final norm, the LM head and the loss (the logits soft-capped
//! where the model says).

use super::{offset, opt_offset, Workspace};
use crate::model::config::ModelConfig;
use crate::model::ops;
use crate::model::units::UnitLayout;
use crate::Result;

/// Final norm + LM head + loss. The LM head weight is this unit's `lm_head.weight`, or the
/// embedding matrix when tied (the caller binds the right slice).
#[derive(Debug, Clone)]
pub struct Head {
    c: usize,
    vocab: usize,
    eps: f32,
    norm: usize,
    /// What the final norm adds to its weight (0, or 1 for `1 + w`).
    pub(crate) norm_offset: f32,
    /// The logits' soft cap (Gemma 2's `final_logit_softcapping`).
    pub(crate) softcap: Option<f32>,
    /// Offset of `lm_head.weight` in the head unit; `None` when tied to the embedding.
    pub lm_head: Option<usize>,
}

impl Head {
    /// The template for the head unit of `cfg`.
    pub fn new(cfg: &ModelConfig, unit: &UnitLayout) -> Result<Self> {
        Ok(Head {
            c: cfg.hidden_size,
            vocab: cfg.vocab_size,
            eps: cfg.rms_norm_eps as f32,
            norm: offset(unit, "model.norm.weight")?,
            norm_offset: cfg.norm_weight.offset(),
            softcap: cfg.final_logit_softcapping.map(|c| c as f32),
            lm_head: opt_offset(unit, "lm_head.weight", !cfg.tie_word_embeddings)?,
        })
    }

    /// The final norm's weight inside the head unit's shard.
    pub fn norm_range(&self) -> std::ops::Range<usize> {
        self.norm..self.norm + self.c
    }

    /// Σ loss over the N rows of x_L, and the gradients: dx_L written, the norm weight's gradient
    /// into `g_norm`, the LM head's into `g_w` (`grad_scale` = 1/tokens of the step).
    #[allow(clippy::too_many_arguments)]
    pub fn loss_backward(
        &self,
        norm_w: &[f32],
        g_norm: &mut [f32],
        w: &[f32],
        g_w: &mut [f32],
        x: &[f32],
        targets: &[u32],
        dx: &mut [f32],
        grad_scale: f32,
        ws: &mut Workspace,
    ) -> f64 {
        let (n, c, v) = (targets.len(), self.c, self.vocab);
        ops::rmsnorm_fwd(
            &mut ws.h1[..n * c],
            &mut ws.rstd1[..n],
            x,
            (norm_w, self.norm_offset),
            c,
            self.eps,
        );
        let loss = ops::lm_head_ce(
            &mut ws.d_c[..n * c],
            &mut g_w[..v * c],
            &ws.h1[..n * c],
            &w[..v * c],
            targets,
            n,
            c,
            (v, self.softcap),
            grad_scale,
            &mut ws.ce,
        );
        ops::rmsnorm_bwd(
            &mut dx[..n * c],
            false,
            g_norm,
            &ws.d_c[..n * c],
            x,
            (norm_w, self.norm_offset),
            &ws.rstd1[..n],
            c,
        );
        loss
    }

    /// Logits [N, V] of x_L (tests and evaluation; training never materialises them).
    pub fn logits(&self, p_head: &[f32], w: &[f32], x: &[f32], n: usize, out: &mut [f32]) {
        let c = self.c;
        let mut h = vec![0.0; n * c];
        let mut r = vec![0.0; n];
        ops::rmsnorm_fwd(
            &mut h,
            &mut r,
            x,
            (&p_head[self.norm..self.norm + c], self.norm_offset),
            c,
            self.eps,
        );
        ops::logits(out, &h, w, n, c, self.vocab);
        if let Some(cap) = self.softcap {
            ops::softcap_logits(&mut out[..n * self.vocab], cap);
        }
    }

    /// Σ loss only (validation); [`ops::IGNORE`] targets add nothing.
    pub fn loss(&self, p_head: &[f32], w: &[f32], x: &[f32], targets: &[u32]) -> f64 {
        let (n, v) = (targets.len(), self.vocab);
        let mut out = vec![0.0; n * v];
        self.logits(p_head, w, x, n, &mut out);
        out.chunks(v)
            .zip(targets)
            .filter(|&(_, &tg)| tg != ops::IGNORE)
            .map(|(row, &tg)| {
                let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let z: f32 = row.iter().map(|x| (x - mx).exp()).sum();
                f64::from(mx + z.ln() - row[tg as usize])
            })
            .sum()
    }
}
