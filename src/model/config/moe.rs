//! A mixture-of-experts MLP as transformers 5 describes it (Mixtral, Qwen3-MoE): a router over
//! `num_experts` experts picks `top_k` per token, each expert is a gated MLP of width
//! `expert_intermediate`; which layers have one.

use super::parse::{bad, get_bool, get_f64, get_usize};
use super::Architecture;
use crate::model::ops::{ExpertAct, ExpertLayout, MlpActivation, MoeShape, Router};
use crate::Result;
use serde::{Deserialize, Serialize};
use serde_json::Value;

/// Experts in one layer at most (a router row and the per-expert counts stay small).
pub const MAX_EXPERTS: usize = 1 << 12;

/// A mixture-of-experts MLP: router `softmax(h·Wrᵀ)` (fp32) over every expert, the `top_k`
/// largest probabilities (renormalised to sum 1 when `norm_topk_prob`) weight the outputs of
/// their experts; each expert is `down(act(h·Wgᵀ) ⊙ h·Wuᵀ)` of width `expert_intermediate`.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    /// Experts per MoE layer (`num_local_experts`, `num_experts`).
    pub num_experts: usize,
    /// Experts each token is sent to (`num_experts_per_tok`).
    pub top_k: usize,
    /// Each expert's MLP width (Mixtral: `intermediate_size`; Qwen3-MoE:
    /// `moe_intermediate_size`).
    pub expert_intermediate: usize,
    /// The top-k probabilities renormalised to sum 1 (always in Mixtral).
    pub norm_topk_prob: bool,
    /// Which layers have the MoE MLP (the others the dense one of `intermediate_size`), one
    /// entry per layer; empty: every layer.
    #[serde(default)]
    pub sparse_layers: Vec<bool>,
    /// `router_aux_loss_coef`: the load-balancing loss's weight in the trained loss.
    pub router_aux_loss_coef: f64,
    /// `output_router_logits`: the load-balancing loss is trained (transformers adds it to the
    /// loss then; else the loss is the cross-entropy alone).
    #[serde(default)]
    pub aux_loss: bool,
    /// How the router picks (GPT-OSS: top-k logits, then their softmax).
    #[serde(default)]
    pub router: Router,
    /// How the experts' weights are laid out (GPT-OSS: transposed, interleaved, with biases).
    #[serde(default)]
    pub layout: ExpertLayout,
    /// GPT-OSS's clamped SwiGLU `(swiglu_alpha, swiglu_limit)`, else the model's gated MLP.
    #[serde(default)]
    pub swiglu_clamp: Option<(f64, f64)>,
}

impl MoeConfig {
    /// Whether layer `layer` has the MoE MLP.
    pub fn is_sparse(&self, layer: usize) -> bool {
        self.sparse_layers.get(layer).copied().unwrap_or(true)
    }

    /// The shape of its MLP in a model of width `c` whose gated MLPs use `act`.
    pub fn shape(&self, c: usize, act: MlpActivation) -> MoeShape {
        MoeShape {
            c,
            experts: self.num_experts,
            top_k: self.top_k,
            inter: self.expert_intermediate,
            norm_topk: self.norm_topk_prob,
            router: self.router,
            layout: self.layout,
            act: match self.swiglu_clamp {
                Some((alpha, limit)) => ExpertAct::ClampedSwiglu {
                    alpha: alpha as f32,
                    limit: limit as f32,
                },
                None => ExpertAct::Gated(act),
            },
        }
    }
}

/// The MoE MLP `v` describes for `arch` (None for a dense architecture), read as transformers
/// reads it; what megatrain does not train yet is refused by name.
pub(super) fn moe(
    v: &Value,
    arch: Architecture,
    layers: usize,
    origin: &str,
) -> Result<Option<MoeConfig>> {
    let (experts_keys, width_key, norm) = match arch {
        Architecture::Mixtral => (
            ["num_local_experts", "num_experts"],
            "intermediate_size",
            Some(true),
        ),
        // transformers 5 writes Qwen3-MoE's `num_experts` as `num_local_experts`.
        Architecture::Qwen3Moe => (
            ["num_experts", "num_local_experts"],
            "moe_intermediate_size",
            None,
        ),
        Architecture::GptOss => (
            ["num_local_experts", "num_experts"],
            "intermediate_size",
            Some(false),
        ),
        _ => return Ok(None),
    };
    let experts_key = experts_keys
        .into_iter()
        .find(|k| v.get(*k).is_some_and(|x| !x.is_null()))
        .unwrap_or(experts_keys[0]);
    let (default_experts, default_k, default_width) = match arch {
        Architecture::Mixtral => (8, 2, 14336),
        Architecture::GptOss => (128, 4, 2880),
        _ => (128, 8, 768),
    };
    let num_experts = get_usize(v, experts_key, origin)?.unwrap_or(default_experts);
    let top_k = get_usize(v, "num_experts_per_tok", origin)?.unwrap_or(default_k);
    let expert_intermediate = get_usize(v, width_key, origin)?.unwrap_or(default_width);
    if num_experts == 0 || num_experts > MAX_EXPERTS {
        return Err(bad(
            origin,
            format!("`{experts_key}` is {num_experts}; megatrain supports 1 to {MAX_EXPERTS}"),
        ));
    }
    if top_k == 0 || top_k > num_experts {
        return Err(bad(
            origin,
            format!(
                "`num_experts_per_tok` is {top_k}; it must be 1 to `{experts_key}` ({num_experts})"
            ),
        ));
    }
    if expert_intermediate == 0 || expert_intermediate > super::limits::MAX_INTERMEDIATE {
        return Err(bad(
            origin,
            format!(
                "`{width_key}` is {expert_intermediate}; megatrain supports 1 to {}",
                super::limits::MAX_INTERMEDIATE
            ),
        ));
    }
    let router_aux_loss_coef = get_f64(v, "router_aux_loss_coef", origin)?.unwrap_or(0.001);
    if !(router_aux_loss_coef.is_finite() && router_aux_loss_coef >= 0.0) {
        return Err(bad(
            origin,
            format!("`router_aux_loss_coef` must be a number ≥ 0, found {router_aux_loss_coef}"),
        ));
    }
    if get_f64(v, "router_jitter_noise", origin)?.is_some_and(|j| j != 0.0) {
        return Err(bad(
            origin,
            "`router_jitter_noise` other than 0 (random input scaling while training) is not supported",
        ));
    }
    let norm_topk_prob = match norm {
        Some(always) => always,
        None => get_bool(v, "norm_topk_prob", origin)?.unwrap_or(false),
    };
    let sparse_layers = match arch {
        Architecture::Qwen3Moe => qwen3_sparse_layers(v, layers, origin)?,
        _ => Vec::new(),
    };
    Ok(Some(MoeConfig {
        num_experts,
        top_k,
        expert_intermediate,
        norm_topk_prob,
        sparse_layers,
        router_aux_loss_coef,
        aux_loss: get_bool(v, "output_router_logits", origin)?.unwrap_or(false),
        router: match arch {
            Architecture::GptOss => Router::TopKSoftmax,
            _ => Router::SoftmaxTopK,
        },
        layout: match arch {
            Architecture::GptOss => ExpertLayout::InterleavedColumns,
            _ => ExpertLayout::GateUpRows,
        },
        swiglu_clamp: match arch {
            Architecture::GptOss => Some(swiglu_clamp(v, origin)?),
            _ => None,
        },
    }))
}

/// GPT-OSS's `(swiglu_alpha, swiglu_limit)`: positive numbers.
fn swiglu_clamp(v: &Value, origin: &str) -> Result<(f64, f64)> {
    let mut out = [0.0; 2];
    for (slot, (key, default)) in out
        .iter_mut()
        .zip([("swiglu_alpha", 1.702), ("swiglu_limit", 7.0)])
    {
        let x = get_f64(v, key, origin)?.unwrap_or(default);
        if !(x.is_finite() && x > 0.0) {
            return Err(bad(
                origin,
                format!("`{key}` must be a positive number, found {x}"),
            ));
        }
        *slot = x;
    }
    Ok((out[0], out[1]))
}

/// Qwen3-MoE's MoE layers: not in `mlp_only_layers`, and every `decoder_sparse_step`-th
/// (`(i + 1) % step == 0`); empty when that is every layer.
fn qwen3_sparse_layers(v: &Value, layers: usize, origin: &str) -> Result<Vec<bool>> {
    let step = get_usize(v, "decoder_sparse_step", origin)?.unwrap_or(1);
    if step == 0 {
        return Err(bad(origin, "`decoder_sparse_step` is 0"));
    }
    let dense: Vec<usize> = match v.get("mlp_only_layers").filter(|x| !x.is_null()) {
        None => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|x| match x.as_u64() {
                Some(i) if (i as usize) < layers => Ok(i as usize),
                _ => Err(bad(
                    origin,
                    format!(
                        "`mlp_only_layers` names {x}: layer indices 0 to {} are expected",
                        layers.saturating_sub(1)
                    ),
                )),
            })
            .collect::<Result<_>>()?,
        Some(other) => {
            return Err(bad(
                origin,
                format!("`mlp_only_layers` is {other}, not a list"),
            ))
        }
    };
    let sparse: Vec<bool> = (0..layers)
        .map(|i| !dense.contains(&i) && (i + 1) % step == 0)
        .collect();
    Ok(match sparse.iter().all(|&s| s) {
        true => Vec::new(),
        false => sparse,
    })
}

/// transformers' keys for `moe` in `arch`'s spelling (for `config.json` on export).
pub(super) fn hf_fields(
    moe: &MoeConfig,
    arch: Architecture,
    layers: usize,
    o: &mut serde_json::Map<String, Value>,
) {
    o.insert("num_experts_per_tok".into(), Value::from(moe.top_k));
    o.insert("output_router_logits".into(), Value::Bool(moe.aux_loss));
    o.insert(
        "router_aux_loss_coef".into(),
        Value::from(moe.router_aux_loss_coef),
    );
    match arch {
        Architecture::GptOss => {
            o.insert("num_local_experts".into(), Value::from(moe.num_experts));
            o.insert(
                "intermediate_size".into(),
                Value::from(moe.expert_intermediate),
            );
            if let Some((alpha, limit)) = moe.swiglu_clamp {
                o.insert("swiglu_alpha".into(), Value::from(alpha));
                o.insert("swiglu_limit".into(), Value::from(limit));
            }
        }
        Architecture::Mixtral => {
            o.insert("num_local_experts".into(), Value::from(moe.num_experts));
            o.insert(
                "intermediate_size".into(),
                Value::from(moe.expert_intermediate),
            );
            o.insert("router_jitter_noise".into(), Value::from(0.0));
        }
        _ => {
            o.insert("num_experts".into(), Value::from(moe.num_experts));
            o.insert(
                "moe_intermediate_size".into(),
                Value::from(moe.expert_intermediate),
            );
            o.insert("norm_topk_prob".into(), Value::Bool(moe.norm_topk_prob));
            o.insert("decoder_sparse_step".into(), Value::from(1));
            let dense: Vec<usize> = (0..layers).filter(|&i| !moe.is_sparse(i)).collect();
            o.insert("mlp_only_layers".into(), serde_json::json!(dense));
        }
    }
}
