//! How a model's parameters are grouped and packed: the *units* the streamer moves as one piece
//! (the embedding, one decoder layer, the head) and, inside each, the tensors at fixed offsets.
//!
//! Tensors are packed in a fixed order at 16-element (64-byte) boundaries, so one offset
//! addresses a parameter in every per-unit buffer (params, gradients, Adam moments). Pure shapes:
//! the host store lays its shards out by these units, the layer templates find their weights by
//! these offsets.

use super::config::ModelConfig;
use super::ops::ExpertLayout;
use crate::host::SHARD_ALIGN;
use serde::{Deserialize, Serialize};

/// Tensors inside a unit start at multiples of this many elements (64 bytes of fp32: one cache
/// line, and whole SIMD vectors).
pub const TENSOR_ALIGN_ELEMS: usize = 16;

/// Which piece of the model a unit is.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum UnitKind {
    /// Token embedding (and, when tied, the LM head).
    Embedding,
    /// Decoder layer i.
    Block(usize),
    /// Final norm (and the LM head when not tied).
    Head,
}

impl UnitKind {
    /// A short human name: "embedding", "layer 3", "head".
    pub fn describe(self) -> String {
        match self {
            UnitKind::Embedding => "embedding".into(),
            UnitKind::Block(i) => format!("layer {i}"),
            UnitKind::Head => "head".into(),
        }
    }
}

/// One tensor inside a unit.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct TensorSpec {
    /// Hugging Face name (`model.layers.3.self_attn.q_proj.weight`).
    pub name: String,
    /// Shape, HF convention (Linear weights are `[out, in]`).
    pub shape: Vec<usize>,
    /// First element inside the unit.
    pub offset: usize,
}

impl TensorSpec {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }
}

/// A unit: its tensors and its element count.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct UnitLayout {
    /// Which unit.
    pub kind: UnitKind,
    /// Tensors, in packing order.
    pub tensors: Vec<TensorSpec>,
    /// Elements including the padding between tensors (what a shard holds).
    pub numel: usize,
    /// Real parameters (without padding).
    pub params: usize,
}

impl UnitLayout {
    /// Bytes of one f32 buffer of this unit (its params, gradients, or an fp32 Adam moment;
    /// a moment in any format: [`StateLayout::shard_bytes`](crate::store::layout::StateLayout::shard_bytes)),
    /// rounded up to [`SHARD_ALIGN`] so each starts page-aligned (DMA and O_DIRECT).
    pub fn shard_bytes(&self) -> usize {
        (self.numel * 4).div_ceil(SHARD_ALIGN) * SHARD_ALIGN
    }

    /// A tensor by its suffix after the layer prefix (`self_attn.q_proj.weight`) or full name.
    pub fn tensor(&self, suffix: &str) -> Option<&TensorSpec> {
        self.tensors
            .iter()
            .find(|t| t.name == suffix || t.name.ends_with(&format!(".{suffix}")))
    }
}

fn pack(kind: UnitKind, tensors: Vec<(String, Vec<usize>)>) -> UnitLayout {
    let mut offset = 0;
    let mut params = 0;
    let tensors = tensors
        .into_iter()
        .map(|(name, shape)| {
            let t = TensorSpec {
                name,
                shape,
                offset,
            };
            params += t.numel();
            offset += t.numel().div_ceil(TENSOR_ALIGN_ELEMS) * TENSOR_ALIGN_ELEMS;
            t
        })
        .collect();
    UnitLayout {
        kind,
        tensors,
        numel: offset,
        params,
    }
}

/// The tensors of decoder layer `i`, HF names and shapes, in packing order.
pub fn block_tensors(c: &ModelConfig, i: usize) -> Vec<(String, Vec<usize>)> {
    let p = format!("model.layers.{i}");
    let (h, q, kv, im) = (c.hidden_size, c.q_dim(), c.kv_dim(), c.intermediate_size);
    let mut t = vec![
        (format!("{p}.input_layernorm.weight"), vec![h]),
        (format!("{p}.self_attn.q_proj.weight"), vec![q, h]),
        (format!("{p}.self_attn.k_proj.weight"), vec![kv, h]),
        (format!("{p}.self_attn.v_proj.weight"), vec![kv, h]),
    ];
    if c.qkv_bias {
        t.push((format!("{p}.self_attn.q_proj.bias"), vec![q]));
        t.push((format!("{p}.self_attn.k_proj.bias"), vec![kv]));
        t.push((format!("{p}.self_attn.v_proj.bias"), vec![kv]));
    }
    t.push((format!("{p}.self_attn.o_proj.weight"), vec![h, q]));
    if c.o_bias {
        t.push((format!("{p}.self_attn.o_proj.bias"), vec![h]));
    }
    if c.qk_norm {
        t.push((format!("{p}.self_attn.q_norm.weight"), vec![c.head_dim]));
        t.push((format!("{p}.self_attn.k_norm.weight"), vec![c.head_dim]));
    }
    if c.attention_sinks {
        t.push((format!("{p}.self_attn.sinks"), vec![c.num_heads]));
    }
    // Llama's `post_attention_layernorm` is the MLP's input norm; under sandwich norms it norms
    // the attention's output, `pre_feedforward_layernorm` the MLP's input.
    t.push((format!("{p}.post_attention_layernorm.weight"), vec![h]));
    if c.sandwich_norms {
        t.push((format!("{p}.pre_feedforward_layernorm.weight"), vec![h]));
    }
    match c.moe.as_ref().filter(|m| m.is_sparse(i)) {
        // GPT-OSS: a biased router; experts transposed, gate and up in alternating columns.
        Some(m) if m.layout == ExpertLayout::InterleavedColumns => {
            let (e, mi) = (m.num_experts, m.expert_intermediate);
            t.extend([
                (format!("{p}.mlp.router.weight"), vec![e, h]),
                (format!("{p}.mlp.router.bias"), vec![e]),
                (format!("{p}.mlp.experts.gate_up_proj"), vec![e, h, 2 * mi]),
                (
                    format!("{p}.mlp.experts.gate_up_proj_bias"),
                    vec![e, 2 * mi],
                ),
                (format!("{p}.mlp.experts.down_proj"), vec![e, mi, h]),
                (format!("{p}.mlp.experts.down_proj_bias"), vec![e, h]),
            ])
        }
        // transformers 5's fused experts: gate rows then up rows per expert, as a Linear's.
        Some(m) => t.extend([
            (format!("{p}.mlp.gate.weight"), vec![m.num_experts, h]),
            (
                format!("{p}.mlp.experts.gate_up_proj"),
                vec![m.num_experts, 2 * m.expert_intermediate, h],
            ),
            (
                format!("{p}.mlp.experts.down_proj"),
                vec![m.num_experts, h, m.expert_intermediate],
            ),
        ]),
        None => t.extend([
            (format!("{p}.mlp.gate_proj.weight"), vec![im, h]),
            (format!("{p}.mlp.up_proj.weight"), vec![im, h]),
            (format!("{p}.mlp.down_proj.weight"), vec![h, im]),
        ]),
    }
    if c.sandwich_norms {
        t.push((format!("{p}.post_feedforward_layernorm.weight"), vec![h]));
    }
    t
}

/// The units of `config`, in streaming order: embedding, blocks 0..L-1, head.
pub fn units(config: &ModelConfig) -> Vec<UnitLayout> {
    let (v, h) = (config.vocab_size, config.hidden_size);
    let mut units = vec![pack(
        UnitKind::Embedding,
        vec![("model.embed_tokens.weight".into(), vec![v, h])],
    )];
    for i in 0..config.num_layers {
        units.push(pack(UnitKind::Block(i), block_tensors(config, i)));
    }
    let mut head = vec![("model.norm.weight".to_owned(), vec![h])];
    if !config.tie_word_embeddings {
        head.push(("lm_head.weight".into(), vec![v, h]));
    }
    units.push(pack(UnitKind::Head, head));
    units
}

/// A tensor as a checkpoint stores it: a unit's tensor whole, or one expert's projection — a
/// contiguous piece of a fused expert tensor, under the per-expert name that transformers'
/// `save_pretrained` writes and released checkpoints use (`….experts.3.gate_proj.weight`,
/// Mixtral's `….block_sparse_moe.experts.3.w1.weight`).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct StoredTensor {
    /// The name in the checkpoint.
    pub name: String,
    /// The unit's tensor it is (part of).
    pub tensor: String,
    /// Its first element inside that tensor.
    pub offset: usize,
    /// Its shape.
    pub shape: Vec<usize>,
}

impl StoredTensor {
    /// Number of elements.
    pub fn numel(&self) -> usize {
        self.shape.iter().product()
    }

    /// `t` whole, under its own name.
    pub fn whole(t: &TensorSpec) -> Self {
        StoredTensor {
            name: t.name.clone(),
            tensor: t.name.clone(),
            offset: 0,
            shape: t.shape.clone(),
        }
    }
}

/// The tensors of `unit` as a checkpoint of `config` stores them: every tensor whole, but an
/// MoE layer's router under its architecture's name and its fused experts one projection per
/// expert (per expert: gate, up, then the down projections).
pub fn stored_tensors(config: &ModelConfig, unit: &UnitLayout) -> Vec<StoredTensor> {
    use super::config::Architecture;
    let mixtral = config.architecture == Architecture::Mixtral;
    // GPT-OSS's checkpoints hold its fused experts as they are.
    if config.architecture == Architecture::GptOss {
        return unit.tensors.iter().map(StoredTensor::whole).collect();
    }
    let (moe_name, gate, up, down) = match mixtral {
        true => ("block_sparse_moe", "w1", "w3", "w2"),
        false => ("mlp", "gate_proj", "up_proj", "down_proj"),
    };
    let mut out = Vec::with_capacity(unit.tensors.len());
    for t in &unit.tensors {
        let Some(prefix) = t
            .name
            .strip_suffix(".mlp.experts.gate_up_proj")
            .or_else(|| t.name.strip_suffix(".mlp.experts.down_proj"))
        else {
            let name = match t.name.strip_suffix(".mlp.gate.weight") {
                Some(p) if mixtral => format!("{p}.block_sparse_moe.gate.weight"),
                _ => t.name.clone(),
            };
            out.push(StoredTensor {
                name,
                ..StoredTensor::whole(t)
            });
            continue;
        };
        let (experts, rows, cols) = (t.shape[0], t.shape[1], t.shape[2]);
        let piece = |e: usize, proj: &str, offset: usize, shape: Vec<usize>| StoredTensor {
            name: format!("{prefix}.{moe_name}.experts.{e}.{proj}.weight"),
            tensor: t.name.clone(),
            offset,
            shape,
        };
        for e in 0..experts {
            if t.name.ends_with("gate_up_proj") {
                let half = rows / 2;
                out.push(piece(e, gate, e * rows * cols, vec![half, cols]));
                out.push(piece(
                    e,
                    up,
                    e * rows * cols + half * cols,
                    vec![half, cols],
                ));
            } else {
                out.push(piece(e, down, e * rows * cols, vec![rows, cols]));
            }
        }
    }
    out
}

/// Put together the tensors of `config` that `tensors` (a checkpoint's, by name) holds in pieces
/// ([`stored_tensors`]: per expert, or renamed): each piece moved to its place in the unit's
/// tensor, under the tensor's own name. `per_elem` values of `tensors` make one element (1 for
/// `f32`s, 4 for their bytes). A piece that is missing or does not fit is left as it is.
pub fn fuse_pieces<T: Copy + Default>(
    config: &ModelConfig,
    tensors: &mut std::collections::HashMap<String, Vec<T>>,
    per_elem: usize,
) {
    for unit in units(config) {
        for piece in stored_tensors(config, &unit) {
            let Some(spec) = unit.tensor(&piece.tensor) else {
                continue;
            };
            if piece.name == piece.tensor || !tensors.contains_key(&piece.name) {
                continue;
            }
            let (at, len) = (piece.offset * per_elem, piece.numel() * per_elem);
            let fused_len = spec.numel() * per_elem;
            let Some(values) = tensors.remove(&piece.name) else {
                continue;
            };
            if values.len() != len || at + len > fused_len {
                tensors.insert(piece.name, values);
                continue;
            }
            let fused = tensors
                .entry(piece.tensor.clone())
                .or_insert_with(|| vec![T::default(); fused_len]);
            fused[at..at + len].copy_from_slice(&values);
        }
    }
}
