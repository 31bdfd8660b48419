//! Stateless layer templates: code plus shapes. Weights and gradient buffers are the unit's flat
//! shards, bound per call; scratch lives in a caller-owned [`Workspace`] reused by every layer.
//! Nothing persists between calls. Backward recomputes a block's internals from its input
//! activation, the only one kept between forward and backward.

use super::config::{MlpActivation, ModelConfig};
use super::ops::{self, AttnShape, Rope};
use super::units::{UnitKind, UnitLayout};
use crate::{Error, Result};

mod embedding;
mod head;
mod moe;
mod workspace;
pub use embedding::Embedding;
pub use head::Head;
pub use moe::{moe_router_name, MoeMlp};
pub use workspace::Workspace;

fn offset(unit: &UnitLayout, suffix: &str) -> Result<usize> {
    unit.tensor(suffix).map(|t| t.offset).ok_or_else(|| {
        Error::bad_input("unit layout", suffix, "tensor missing from the unit", None)
    })
}

fn opt_offset(unit: &UnitLayout, suffix: &str, present: bool) -> Result<Option<usize>> {
    if present {
        offset(unit, suffix).map(Some)
    } else {
        Ok(None)
    }
}

/// The offset of a dense MLP tensor, or 0 in a mixture-of-experts layer (which has none).
fn dense_offset(unit: &UnitLayout, suffix: &str, dense: bool) -> Result<usize> {
    Ok(opt_offset(unit, suffix, dense)?.unwrap_or(0))
}

/// One decoder layer: RMSNorm → GQA attention with RoPE (after a per-head RMSNorm of q and k
/// under QK-norm) (→ RMSNorm under sandwich norms) → residual → RMSNorm → gated MLP (→ RMSNorm)
/// → residual. Every norm applies its weight as [`ModelConfig::norm_weight`] says.
#[derive(Debug, Clone)]
pub struct DecoderBlock {
    pub(crate) c: usize,
    pub(crate) nh: usize,
    pub(crate) nkv: usize,
    pub(crate) hd: usize,
    pub(crate) inter: usize,
    pub(crate) eps: f32,
    pub(crate) ln1: usize,
    pub(crate) wq: usize,
    pub(crate) wk: usize,
    pub(crate) wv: usize,
    pub(crate) bq: Option<usize>,
    pub(crate) bk: Option<usize>,
    pub(crate) bv: Option<usize>,
    pub(crate) wo: usize,
    pub(crate) bo: Option<usize>,
    /// The sliding window of this layer's attention.
    pub(crate) window: Option<usize>,
    /// Attention sinks `[nh]` (GPT-OSS).
    pub(crate) sinks: Option<usize>,
    /// QK-norm weights `[hd]` of q and k.
    pub(crate) qn: Option<usize>,
    pub(crate) kn: Option<usize>,
    /// The MLP's input norm.
    pub(crate) ln2: usize,
    pub(crate) wg: usize,
    pub(crate) wu: usize,
    pub(crate) wd: usize,
    /// The mixture-of-experts MLP in place of the dense one (`wg`, `wu`, `wd` and `inter`
    /// unused then).
    pub(crate) moe: Option<MoeMlp>,
    /// Sandwich norms: of the attention's output and of the MLP's.
    pub(crate) post_attn_norm: Option<usize>,
    pub(crate) post_mlp_norm: Option<usize>,
    /// What every norm adds to its weight (0, or 1 for `1 + w`).
    pub(crate) norm_offset: f32,
    /// The gated MLP's activation.
    pub(crate) act: MlpActivation,
    /// The attention's softmax scale where it is not `hd^-½`.
    pub(crate) attn_scale: Option<f32>,
    /// The RoPE table this layer rotates with ([`ModelConfig::layer_rope`]).
    pub(crate) rope_table: usize,
    /// The attention scores' soft cap (Gemma 2's `attn_logit_softcapping`).
    pub(crate) attn_softcap: Option<f32>,
    /// Elements of the unit's shard.
    pub(crate) numel: usize,
}

impl DecoderBlock {
    /// The template for a block unit of `cfg`.
    pub fn new(cfg: &ModelConfig, unit: &UnitLayout) -> Result<Self> {
        let layer = match unit.kind {
            UnitKind::Block(i) => i,
            other => {
                return Err(Error::internal(
                    "layer templates",
                    format!("a decoder block for the {} unit", other.describe()),
                ))
            }
        };
        let sandwich = cfg.sandwich_norms;
        let moe = MoeMlp::of(cfg, unit, layer)?;
        Ok(DecoderBlock {
            c: cfg.hidden_size,
            nh: cfg.num_heads,
            nkv: cfg.num_kv_heads,
            hd: cfg.head_dim,
            inter: cfg.intermediate_size,
            eps: cfg.rms_norm_eps as f32,
            ln1: offset(unit, "input_layernorm.weight")?,
            wq: offset(unit, "self_attn.q_proj.weight")?,
            wk: offset(unit, "self_attn.k_proj.weight")?,
            wv: offset(unit, "self_attn.v_proj.weight")?,
            bq: opt_offset(unit, "self_attn.q_proj.bias", cfg.qkv_bias)?,
            bk: opt_offset(unit, "self_attn.k_proj.bias", cfg.qkv_bias)?,
            bv: opt_offset(unit, "self_attn.v_proj.bias", cfg.qkv_bias)?,
            wo: offset(unit, "self_attn.o_proj.weight")?,
            bo: opt_offset(unit, "self_attn.o_proj.bias", cfg.o_bias)?,
            window: cfg.layer_window(layer),
            sinks: opt_offset(unit, "self_attn.sinks", cfg.attention_sinks)?,
            qn: opt_offset(unit, "self_attn.q_norm.weight", cfg.qk_norm)?,
            kn: opt_offset(unit, "self_attn.k_norm.weight", cfg.qk_norm)?,
            ln2: offset(
                unit,
                if sandwich {
                    "pre_feedforward_layernorm.weight"
                } else {
                    "post_attention_layernorm.weight"
                },
            )?,
            wg: dense_offset(unit, "mlp.gate_proj.weight", moe.is_none())?,
            wu: dense_offset(unit, "mlp.up_proj.weight", moe.is_none())?,
            wd: dense_offset(unit, "mlp.down_proj.weight", moe.is_none())?,
            moe,
            post_attn_norm: opt_offset(unit, "post_attention_layernorm.weight", sandwich)?,
            post_mlp_norm: opt_offset(unit, "post_feedforward_layernorm.weight", sandwich)?,
            norm_offset: cfg.norm_weight.offset(),
            act: cfg.mlp_activation,
            attn_scale: cfg.attn_scale(),
            rope_table: cfg.layer_rope(layer),
            attn_softcap: cfg.attn_logit_softcapping.map(|c| c as f32),
            numel: unit.numel,
        })
    }

    fn qd(&self) -> usize {
        self.nh * self.hd
    }

    fn kvd(&self) -> usize {
        self.nkv * self.hd
    }

    /// The attention's shape over `b` sequences of `t`.
    fn attn_shape(&self, b: usize, t: usize) -> AttnShape {
        AttnShape::causal(b, t, self.nh, self.nkv, self.hd)
            .windowed(self.window)
            .scaled(self.attn_scale)
            .softcapped(self.attn_softcap)
    }

    /// Forward internals up to the MLP activation, kept in `ws` for the backward.
    #[allow(clippy::too_many_arguments)]
    fn internals(
        &self,
        p: &[f32],
        x: &[f32],
        ws: &mut Workspace,
        rope: &Rope,
        pos: &[u32],
        b: usize,
        t: usize,
    ) {
        let (n, c, qd, kvd, i) = (b * t, self.c, self.qd(), self.kvd(), self.inter);
        let w = |off: usize, len: usize| &p[off..off + len];
        ops::rmsnorm_fwd(
            &mut ws.h1[..n * c],
            &mut ws.rstd1[..n],
            x,
            (w(self.ln1, c), self.norm_offset),
            c,
            self.eps,
        );
        let h1 = &ws.h1[..n * c];
        // Under QK-norm the projections land in q_raw / k_raw and their norms write q / k.
        let q_lin = if self.qn.is_some() {
            &mut ws.q_raw[..n * qd]
        } else {
            &mut ws.q[..n * qd]
        };
        ops::linear_fwd(
            q_lin,
            h1,
            w(self.wq, qd * c),
            self.bq.map(|o| w(o, qd)),
            n,
            c,
            qd,
        );
        let k_lin = if self.kn.is_some() {
            &mut ws.k_raw[..n * kvd]
        } else {
            &mut ws.k[..n * kvd]
        };
        ops::linear_fwd(
            k_lin,
            h1,
            w(self.wk, kvd * c),
            self.bk.map(|o| w(o, kvd)),
            n,
            c,
            kvd,
        );
        if let (Some(qn), Some(kn)) = (self.qn, self.kn) {
            let hd = self.hd;
            ops::rmsnorm_fwd(
                &mut ws.q[..n * qd],
                &mut ws.rstd_q[..n * self.nh],
                &ws.q_raw[..n * qd],
                (w(qn, hd), self.norm_offset),
                hd,
                self.eps,
            );
            ops::rmsnorm_fwd(
                &mut ws.k[..n * kvd],
                &mut ws.rstd_k[..n * self.nkv],
                &ws.k_raw[..n * kvd],
                (w(kn, hd), self.norm_offset),
                hd,
                self.eps,
            );
        }
        ops::linear_fwd(
            &mut ws.v[..n * kvd],
            h1,
            w(self.wv, kvd * c),
            self.bv.map(|o| w(o, kvd)),
            n,
            c,
            kvd,
        );
        rope.apply_table(&mut ws.q[..n * qd], pos, self.nh, false, self.rope_table);
        rope.apply_table(&mut ws.k[..n * kvd], pos, self.nkv, false, self.rope_table);
        let shape = self.attn_shape(b, t);
        ops::attention_fwd(
            &mut ws.att[..n * qd],
            &mut ws.lse[..b * self.nh * t],
            &ws.q[..n * qd],
            &ws.k[..n * kvd],
            &ws.v[..n * kvd],
            pos,
            shape,
        );
        if let Some(o) = self.sinks {
            ops::sinks_fwd(
                &mut ws.att[..n * qd],
                &mut ws.lse[..b * self.nh * t],
                w(o, self.nh),
                shape,
            );
        }
        // x2 = x + att·Woᵀ (+ bo), the projection normed first under sandwich norms.
        let proj = match self.post_attn_norm {
            Some(_) => &mut ws.attn_out[..n * c],
            None => &mut ws.x2[..n * c],
        };
        ops::linear_fwd(
            proj,
            &ws.att[..n * qd],
            w(self.wo, c * qd),
            self.bo.map(|o| w(o, c)),
            n,
            qd,
            c,
        );
        if let Some(pa) = self.post_attn_norm {
            ops::rmsnorm_fwd(
                &mut ws.x2[..n * c],
                &mut ws.rstd_pa[..n],
                &ws.attn_out[..n * c],
                (w(pa, c), self.norm_offset),
                c,
                self.eps,
            );
        }
        for (a, xv) in ws.x2[..n * c].iter_mut().zip(x) {
            *a += *xv;
        }
        ops::rmsnorm_fwd(
            &mut ws.h2[..n * c],
            &mut ws.rstd2[..n],
            &ws.x2[..n * c],
            (w(self.ln2, c), self.norm_offset),
            c,
            self.eps,
        );
        if self.moe.is_some() {
            return;
        }
        ops::linear_fwd(
            &mut ws.gate[..n * i],
            &ws.h2[..n * c],
            w(self.wg, i * c),
            None,
            n,
            c,
            i,
        );
        ops::linear_fwd(
            &mut ws.up[..n * i],
            &ws.h2[..n * c],
            w(self.wu, i * c),
            None,
            n,
            c,
            i,
        );
        ops::gated_fwd(
            self.act,
            &mut ws.act[..n * i],
            &ws.gate[..n * i],
            &ws.up[..n * i],
        );
    }

    /// The MLP's down projection of `ws.act` into `out` (`[N, C]`), or under sandwich norms
    /// into `ws.mlp_out` and its norm into `out` (1/rms into `ws.rstd_pf`).
    fn mlp_output(&self, p: &[f32], out: &mut [f32], ws: &mut Workspace, n: usize) {
        let (c, i) = (self.c, self.inter);
        let wd = &p[self.wd..self.wd + c * i];
        let project = |out: &mut [f32], ws: &Workspace| match &self.moe {
            Some(m) => {
                ops::moe_fwd(out, &ws.h2[..n * c], &m.weights(p), n, m.shape);
            }
            None => ops::linear_fwd(out, &ws.act[..n * i], wd, None, n, i, c),
        };
        match self.post_mlp_norm {
            None => project(&mut out[..n * c], ws),
            Some(pf) => {
                let mut mlp_out = std::mem::take(&mut ws.mlp_out);
                project(&mut mlp_out[..n * c], ws);
                ws.mlp_out = mlp_out;
                ops::rmsnorm_fwd(
                    &mut out[..n * c],
                    &mut ws.rstd_pf[..n],
                    &ws.mlp_out[..n * c],
                    (&p[pf..pf + c], self.norm_offset),
                    c,
                    self.eps,
                );
            }
        }
    }

    /// y[N, C] = block(x[N, C]) with this unit's params `p`; `pos` [N] is each token's
    /// position in its document (see [`ops::attention_fwd`]).
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        p: &[f32],
        x: &[f32],
        y: &mut [f32],
        ws: &mut Workspace,
        rope: &Rope,
        pos: &[u32],
        b: usize,
        t: usize,
    ) {
        let (n, c) = (b * t, self.c);
        self.internals(p, x, ws, rope, pos, b, t);
        self.mlp_output(p, y, ws, n);
        for (a, r) in y[..n * c].iter_mut().zip(&ws.x2[..n * c]) {
            *a += *r;
        }
    }

    /// Given the block's input `x` (its kept input activation) and dL/dy, accumulate the unit's gradients into
    /// `g` and write dL/dx into `dx`. Recomputes the forward internals first.
    #[allow(clippy::too_many_arguments)]
    pub fn backward(
        &self,
        p: &[f32],
        g: &mut [f32],
        x: &[f32],
        dy: &[f32],
        dx: &mut [f32],
        ws: &mut Workspace,
        rope: &Rope,
        pos: &[u32],
        b: usize,
        t: usize,
    ) {
        self.internals(p, x, ws, rope, pos, b, t);
        self.mlp_backward(p, g, dy, ws, b, t);
        self.attention_backward(p, g, x, dx, ws, rope, pos, b, t);
    }

    /// The MLP half of [`Self::backward`]: from dL/dy, the MLP's weight gradients and
    /// `ws.d_c2` = dL/dx2 (the residual's share plus the second norm's).
    #[allow(clippy::too_many_arguments)]
    fn mlp_backward(
        &self,
        p: &[f32],
        g: &mut [f32],
        dy: &[f32],
        ws: &mut Workspace,
        b: usize,
        t: usize,
    ) {
        let (n, c, i) = (b * t, self.c, self.inter);
        // MLP: y = x2 + act·Wdᵀ, act = act(gate) ⊙ up; under sandwich norms y = x2 +
        // norm(act·Wdᵀ): its backward (the projection and its 1/rms recomputed; the norm's
        // output, not needed, lands in d_c) gives dL/d(act·Wdᵀ) in d_c.
        let mut d_c = std::mem::take(&mut ws.d_c);
        let d_out: &[f32] = match self.post_mlp_norm {
            None => dy,
            Some(pf) => {
                self.mlp_output(p, &mut d_c, ws, n);
                ops::rmsnorm_bwd(
                    &mut d_c[..n * c],
                    false,
                    &mut g[pf..pf + c],
                    dy,
                    &ws.mlp_out[..n * c],
                    (&p[pf..pf + c], self.norm_offset),
                    &ws.rstd_pf[..n],
                    c,
                );
                &d_c[..n * c]
            }
        };
        let w = |off: usize, len: usize| &p[off..off + len];
        if let Some(m) = &self.moe {
            ops::moe_bwd(
                &mut ws.d_c2[..n * c],
                m.grads(g),
                d_out,
                &ws.h2[..n * c],
                &m.weights(p),
                n,
                m.shape,
                None,
            );
            ws.d_c = d_c;
            ws.d_c[..n * c].copy_from_slice(&ws.d_c2[..n * c]);
            self.norm2_backward(p, g, dy, ws, n);
            return;
        }
        ops::linear_bwd(
            &mut ws.d_i1[..n * i],
            false,
            &mut g[self.wd..self.wd + c * i],
            None,
            d_out,
            &ws.act[..n * i],
            w(self.wd, c * i),
            n,
            t,
            i,
            c,
        );
        ws.d_c = d_c;
        ops::gated_bwd(
            self.act,
            &mut ws.d_i2[..n * i],
            &mut ws.d_i3[..n * i],
            &ws.d_i1[..n * i],
            &ws.gate[..n * i],
            &ws.up[..n * i],
        );
        ops::linear_bwd(
            &mut ws.d_c[..n * c],
            false,
            &mut g[self.wg..self.wg + i * c],
            None,
            &ws.d_i2[..n * i],
            &ws.h2[..n * c],
            w(self.wg, i * c),
            n,
            t,
            c,
            i,
        );
        ops::linear_bwd(
            &mut ws.d_c[..n * c],
            true,
            &mut g[self.wu..self.wu + i * c],
            None,
            &ws.d_i3[..n * i],
            &ws.h2[..n * c],
            w(self.wu, i * c),
            n,
            t,
            c,
            i,
        );
        self.norm2_backward(p, g, dy, ws, n);
    }

    /// `ws.d_c2` = dL/dx2 = dy + the MLP input norm's backward of `ws.d_c` = dL/dh2.
    fn norm2_backward(&self, p: &[f32], g: &mut [f32], dy: &[f32], ws: &mut Workspace, n: usize) {
        let c = self.c;
        ws.d_c2[..n * c].copy_from_slice(&dy[..n * c]);
        ops::rmsnorm_bwd(
            &mut ws.d_c2[..n * c],
            true,
            &mut g[self.ln2..self.ln2 + c],
            &ws.d_c[..n * c],
            &ws.x2[..n * c],
            (&p[self.ln2..self.ln2 + c], self.norm_offset),
            &ws.rstd2[..n],
            c,
        );
    }

    /// The attention half of [`Self::backward`]: from `ws.d_c2` = dL/dx2, the attention's and
    /// first norm's weight gradients and dL/dx into `dx`.
    #[allow(clippy::too_many_arguments)]
    fn attention_backward(
        &self,
        p: &[f32],
        g: &mut [f32],
        x: &[f32],
        dx: &mut [f32],
        ws: &mut Workspace,
        rope: &Rope,
        pos: &[u32],
        b: usize,
        t: usize,
    ) {
        let (n, c, qd, kvd) = (b * t, self.c, self.qd(), self.kvd());
        let w = |off: usize, len: usize| &p[off..off + len];
        // Attention: x2 = x + att·Woᵀ (+ bo), under sandwich norms x + norm(att·Woᵀ (+ bo)):
        // dL/d(att·Woᵀ) through d_c (free here).
        if let Some(pa) = self.post_attn_norm {
            ops::rmsnorm_bwd(
                &mut ws.d_c[..n * c],
                false,
                &mut g[pa..pa + c],
                &ws.d_c2[..n * c],
                &ws.attn_out[..n * c],
                (w(pa, c), self.norm_offset),
                &ws.rstd_pa[..n],
                c,
            );
        }
        {
            let (gw, gb) = split_two(g, (self.wo, c * qd), self.bo.map(|o| (o, c)));
            let d_proj = match self.post_attn_norm {
                Some(_) => &ws.d_c[..n * c],
                None => &ws.d_c2[..n * c],
            };
            ops::linear_bwd(
                &mut ws.d_att[..n * qd],
                false,
                gw,
                gb,
                d_proj,
                &ws.att[..n * qd],
                w(self.wo, c * qd),
                n,
                t,
                qd,
                c,
            );
        }
        let shape = self.attn_shape(b, t);
        if let Some(o) = self.sinks {
            ops::sinks_bwd(
                &mut g[o..o + self.nh],
                &ws.d_att[..n * qd],
                &ws.att[..n * qd],
                &ws.lse[..b * self.nh * t],
                w(o, self.nh),
                shape,
            );
        }
        ws.dk[..n * kvd].fill(0.0);
        ws.dv[..n * kvd].fill(0.0);
        ops::attention_bwd(
            &mut ws.dq[..n * qd],
            &mut ws.dk[..n * kvd],
            &mut ws.dv[..n * kvd],
            &mut ws.delta[..b * self.nh * t],
            &ws.d_att[..n * qd],
            &ws.q[..n * qd],
            &ws.k[..n * kvd],
            &ws.v[..n * kvd],
            &ws.att[..n * qd],
            &ws.lse[..b * self.nh * t],
            pos,
            shape,
        );
        rope.apply_table(&mut ws.dq[..n * qd], pos, self.nh, true, self.rope_table);
        rope.apply_table(&mut ws.dk[..n * kvd], pos, self.nkv, true, self.rope_table);
        // QK-norm: dL/d q_raw and dL/d k_raw (through d_att, free now) replace dq and dk.
        if let (Some(qn), Some(kn)) = (self.qn, self.kn) {
            let hd = self.hd;
            for (d, len, wn, raw, rstd) in [
                (&mut ws.dq, n * qd, qn, &ws.q_raw, &ws.rstd_q[..n * self.nh]),
                (
                    &mut ws.dk,
                    n * kvd,
                    kn,
                    &ws.k_raw,
                    &ws.rstd_k[..n * self.nkv],
                ),
            ] {
                ops::rmsnorm_bwd(
                    &mut ws.d_att[..len],
                    false,
                    &mut g[wn..wn + hd],
                    &d[..len],
                    &raw[..len],
                    (w(wn, hd), self.norm_offset),
                    rstd,
                    hd,
                );
                d[..len].copy_from_slice(&ws.d_att[..len]);
            }
        }
        // dh1 = dq·Wq + dk·Wk + dv·Wv, with the weight and bias gradients.
        for (first, (wo, wl), bias, d) in [
            (
                true,
                (self.wq, qd * c),
                self.bq.map(|o| (o, qd)),
                &ws.dq[..n * qd],
            ),
            (
                false,
                (self.wk, kvd * c),
                self.bk.map(|o| (o, kvd)),
                &ws.dk[..n * kvd],
            ),
            (
                false,
                (self.wv, kvd * c),
                self.bv.map(|o| (o, kvd)),
                &ws.dv[..n * kvd],
            ),
        ] {
            let dout = wl / c;
            let (gw, gb) = split_two(g, (wo, wl), bias);
            ops::linear_bwd(
                &mut ws.d_c[..n * c],
                !first,
                gw,
                gb,
                d,
                &ws.h1[..n * c],
                w(wo, wl),
                n,
                t,
                c,
                dout,
            );
        }
        // dx = dx2 + rmsnorm_bwd(dh1)
        dx[..n * c].copy_from_slice(&ws.d_c2[..n * c]);
        ops::rmsnorm_bwd(
            &mut dx[..n * c],
            true,
            &mut g[self.ln1..self.ln1 + c],
            &ws.d_c[..n * c],
            x,
            (w(self.ln1, c), self.norm_offset),
            &ws.rstd1[..n],
            c,
        );
    }
}

/// Two disjoint mutable ranges of `g` (a weight gradient and an optional bias gradient).
fn split_two(
    g: &mut [f32],
    (wo, wl): (usize, usize),
    bias: Option<(usize, usize)>,
) -> (&mut [f32], Option<&mut [f32]>) {
    match bias {
        None => (&mut g[wo..wo + wl], None),
        Some((bo, bl)) if bo >= wo + wl => {
            let (a, b) = g.split_at_mut(bo);
            (&mut a[wo..wo + wl], Some(&mut b[..bl]))
        }
        Some((bo, bl)) => {
            let (a, b) = g.split_at_mut(wo);
            (&mut b[..wl], Some(&mut a[bo..bo + bl]))
        }
    }
}
