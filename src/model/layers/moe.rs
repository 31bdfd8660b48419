//! A decoder layer's mixture-of-experts MLP: where its tensors are in the unit, its shape, and
//! its weights and gradients as the op takes them.

use super::{offset, ModelConfig};
use crate::model::ops::{ExpertLayout, MoeGrads, MoeShape, MoeWeights};
use crate::model::units::UnitLayout;
use crate::Result;

/// The router's tensor (`weight` or `bias`): `mlp.router.*` in GPT-OSS, `mlp.gate.*` elsewhere.
pub fn moe_router_name(cfg: &ModelConfig, what: &str) -> &'static str {
    match (
        cfg.architecture == crate::model::config::Architecture::GptOss,
        what,
    ) {
        (true, "bias") => "mlp.router.bias",
        (true, _) => "mlp.router.weight",
        (false, _) => "mlp.gate.weight",
    }
}

/// A layer's mixture-of-experts MLP: where its tensors are in the unit, and its shape.
#[derive(Debug, Clone, Copy)]
pub struct MoeMlp {
    /// Router `[E, C]`.
    pub router: usize,
    /// Experts' gate and up projections `[E, 2I, C]`.
    pub gate_up: usize,
    /// Experts' down projections `[E, C, I]`.
    pub down: usize,
    /// The router's, gate/up's and down's biases (GPT-OSS).
    pub biases: Option<[usize; 3]>,
    /// The shape.
    pub shape: MoeShape,
}

impl MoeMlp {
    /// The MoE MLP of decoder layer `layer` (a unit of `cfg`), if that layer has one.
    pub fn of(cfg: &ModelConfig, unit: &UnitLayout, layer: usize) -> Result<Option<Self>> {
        Ok(match cfg.moe.as_ref().filter(|m| m.is_sparse(layer)) {
            None => None,
            Some(m) => Some(MoeMlp {
                router: offset(unit, moe_router_name(cfg, "weight"))?,
                gate_up: offset(unit, "mlp.experts.gate_up_proj")?,
                down: offset(unit, "mlp.experts.down_proj")?,
                biases: match m.layout {
                    ExpertLayout::GateUpRows => None,
                    ExpertLayout::InterleavedColumns => Some([
                        offset(unit, moe_router_name(cfg, "bias"))?,
                        offset(unit, "mlp.experts.gate_up_proj_bias")?,
                        offset(unit, "mlp.experts.down_proj_bias")?,
                    ]),
                },
                shape: m.shape(cfg.hidden_size, cfg.mlp_activation),
            }),
        })
    }

    /// Its weights in the unit's params `p`.
    pub fn weights<'a>(&self, p: &'a [f32]) -> MoeWeights<'a> {
        let s = self.shape;
        let (e, c, i) = (s.experts, s.c, s.inter);
        MoeWeights {
            router: &p[self.router..self.router + e * c],
            gate_up: &p[self.gate_up..self.gate_up + e * 2 * i * c],
            down: &p[self.down..self.down + e * c * i],
            biases: self
                .biases
                .map(|[r, gu, d]| [&p[r..r + e], &p[gu..gu + e * 2 * i], &p[d..d + e * c]]),
            bf16_recipe: false,
        }
    }

    /// Their gradients in the unit's gradients `g` (disjoint ranges).
    pub fn grads<'a>(&self, g: &'a mut [f32]) -> MoeGrads<'a> {
        let s = self.shape;
        let (e, c, i) = (s.experts, s.c, s.inter);
        let mut ranges = vec![
            (self.router, e * c),
            (self.gate_up, e * 2 * i * c),
            (self.down, e * c * i),
        ];
        if let Some([r, gu, d]) = self.biases {
            ranges.extend([(r, e), (gu, e * 2 * i), (d, e * c)]);
        }
        let mut parts = disjoint_mut(g, &ranges).into_iter();
        let mut next = || parts.next().unwrap_or_default();
        let (router, gate_up, down) = (next(), next(), next());
        let biases = self.biases.map(|_| [next(), next(), next()]);
        MoeGrads {
            router,
            gate_up,
            down,
            biases,
        }
    }
}

/// Disjoint `(offset, len)` ranges of `g` as mutable slices, in the order given.
fn disjoint_mut<'a>(g: &'a mut [f32], ranges: &[(usize, usize)]) -> Vec<&'a mut [f32]> {
    let mut order: Vec<usize> = (0..ranges.len()).collect();
    order.sort_by_key(|&k| ranges[k].0);
    let mut out: Vec<Option<&'a mut [f32]>> = (0..ranges.len()).map(|_| None).collect();
    let (mut rest, mut at) = (g, 0usize);
    for k in order {
        let (off, len) = ranges[k];
        let (_, tail) = std::mem::take(&mut rest).split_at_mut(off - at);
        let (piece, tail) = tail.split_at_mut(len);
        out[k] = Some(piece);
        rest = tail;
        at = off + len;
    }
    out.into_iter().map(Option::unwrap_or_default).collect()
}
