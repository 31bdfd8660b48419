//! Decoder-only model configuration, read from a Hugging Face `config.json`: one description of
//! the decoder block (its norms and their kind, the attention variant, the MLP's activation, the
//! embedding scale, RoPE per layer type) from which every layer program follows.
//!
//! Accepts Llama, Mistral, Qwen2 (q/k/v bias), Qwen3 (QK-norm) and Gemma 3 text (`1 + w` norms,
//! sandwich norms, GELU-tanh, scaled embeddings, local/global layers), tied embeddings, and both transformers-4 and
//! transformers-5 spellings (`torch_dtype`/`dtype`, top-level `rope_theta` or
//! `rope_parameters.rope_theta`). Anything we do not implement — another architecture, a RoPE
//! scaling type, an activation other than SiLU, MLP bias — is an error naming it, never silently
//! wrong. Keys we do not use (token ids, dtype, ...) are ignored: HF configs carry many.

pub use super::ops::MlpActivation;
use super::ops::{ExpertLayout, RopeScaling};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::Path;

mod hf_json;
mod moe;
mod parse;
pub use moe::{MoeConfig, MAX_EXPERTS};
use parse::*;

/// The largest sizes a config may have. Real models are far inside them (Llama-3-405B: hidden
/// 16384, MLP 53248, 126 layers, vocab 128256); within them every size megatrain derives fits
/// in 64 bits, so a hostile or mistyped config is refused by name instead of overflowing.
pub mod limits {
    /// Vocabulary.
    pub const MAX_VOCAB: usize = 1 << 26;
    /// Model width.
    pub const MAX_HIDDEN: usize = 1 << 20;
    /// MLP width.
    pub const MAX_INTERMEDIATE: usize = 1 << 22;
    /// Decoder layers.
    pub const MAX_LAYERS: usize = 1 << 16;
    /// Query heads.
    pub const MAX_HEADS: usize = 1 << 16;
    /// Head dimension.
    pub const MAX_HEAD_DIM: usize = 4096;
    /// Positions.
    pub const MAX_POSITIONS: usize = 1 << 32;
    /// Parameters in all (16 B/param of this is 256 TiB: no host holds it).
    pub const MAX_PARAMS: u64 = 1 << 44;
}

/// Architectures we implement, by their `architectures[0]` name.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Architecture {
    /// `LlamaForCausalLM`.
    Llama,
    /// `MistralForCausalLM` (Llama with an optional sliding window).
    Mistral,
    /// `MinistralForCausalLM` (Mistral with a window on the layers `layer_types` names).
    Ministral,
    /// `Qwen2ForCausalLM` (Llama with q/k/v bias).
    Qwen2,
    /// `Qwen3ForCausalLM` (Llama with QK-norm: a per-head RMSNorm on q and k before RoPE).
    Qwen3,
    /// `Gemma2ForCausalLM`: `1 + w` RMSNorms, four per block, GELU-tanh MLP, embeddings scaled
    /// by √hidden, local sliding-window layers between global ones, soft-capped attention scores
    /// and logits.
    Gemma2,
    /// `Gemma3ForCausalLM` (and the text part of `Gemma3ForConditionalGeneration`): `1 + w`
    /// RMSNorms, four per block, QK-norm, GELU-tanh MLP, embeddings scaled by √hidden, local
    /// sliding-window layers with their own RoPE between global ones.
    Gemma3,
    /// `MixtralForCausalLM`: Mistral's block with a mixture-of-experts MLP (softmax router,
    /// top-k renormalised).
    Mixtral,
    /// `Qwen3MoeForCausalLM`: Qwen3's block (QK-norm) with a mixture-of-experts MLP on the
    /// layers `decoder_sparse_step` and `mlp_only_layers` choose.
    Qwen3Moe,
    /// `GptOssForCausalLM`: biased q/k/v/o, attention sinks, sliding-window layers alternating
    /// with full ones, YaRN; a mixture of experts with a biased router (top-k logits, then their
    /// softmax) and biased, transposed experts (gate and up interleaved, a clamped SwiGLU).
    GptOss,
}

impl Architecture {
    /// The HF class name.
    pub fn hf_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Mistral => "MistralForCausalLM",
            Architecture::Ministral => "MinistralForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Qwen3 => "Qwen3ForCausalLM",
            Architecture::Gemma2 => "Gemma2ForCausalLM",
            Architecture::Gemma3 => "Gemma3ForCausalLM",
            Architecture::Mixtral => "MixtralForCausalLM",
            Architecture::Qwen3Moe => "Qwen3MoeForCausalLM",
            Architecture::GptOss => "GptOssForCausalLM",
        }
    }

    /// The HF `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Mistral => "mistral",
            Architecture::Ministral => "ministral",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Gemma2 => "gemma2",
            Architecture::Gemma3 => "gemma3_text",
            Architecture::Mixtral => "mixtral",
            Architecture::Qwen3Moe => "qwen3_moe",
            Architecture::GptOss => "gpt_oss",
        }
    }
}

/// How an RMSNorm applies its weight to the normalised row `x̂ = x·rsqrt(mean(x²) + eps)`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum NormWeight {
    /// `w ⊙ x̂` (Llama, Mistral, Qwen; weights start at 1).
    #[default]
    Scale,
    /// `(1 + w) ⊙ x̂` (Gemma; weights start at 0).
    OnePlus,
}

impl NormWeight {
    /// What the kernels add to each weight: 0 or 1.
    pub fn offset(self) -> f32 {
        match self {
            NormWeight::Scale => 0.0,
            NormWeight::OnePlus => 1.0,
        }
    }
}

/// RoPE of one layer type: base θ and frequency scaling.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RopeParams {
    /// Base θ.
    pub theta: f64,
    /// Frequency scaling.
    pub scaling: RopeScaling,
}

/// The shape of a Llama-family decoder.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    /// Which architecture.
    pub architecture: Architecture,
    /// Vocabulary size V.
    pub vocab_size: usize,
    /// Model width C.
    pub hidden_size: usize,
    /// MLP width I.
    pub intermediate_size: usize,
    /// Decoder layers L.
    pub num_layers: usize,
    /// Query heads NH.
    pub num_heads: usize,
    /// Key/value heads NKV (NH = MHA, 1 = MQA, else GQA).
    pub num_kv_heads: usize,
    /// Head dimension HD (usually C / NH).
    pub head_dim: usize,
    /// RMSNorm epsilon.
    pub rms_norm_eps: f64,
    /// RoPE base θ.
    pub rope_theta: f64,
    /// How RoPE's frequencies are scaled (absent in checkpoints written before it: default).
    #[serde(default)]
    pub rope_scaling: RopeScaling,
    /// Longest position the model was configured for.
    pub max_position_embeddings: usize,
    /// LM head shares the embedding matrix.
    pub tie_word_embeddings: bool,
    /// q/k/v projections have a bias (Qwen2, or Llama with `attention_bias`).
    pub qkv_bias: bool,
    /// o projection has a bias (Llama with `attention_bias`).
    pub o_bias: bool,
    /// QK-norm: an RMSNorm over each head's `head_dim` of q and of k (weights `[head_dim]`,
    /// the model's eps) between their projections and RoPE (Qwen3).
    #[serde(default)]
    pub qk_norm: bool,
    /// Sliding-window attention: each query of a windowed layer sees itself and the
    /// `sliding_window − 1` tokens before it (Mistral; Qwen2 and Qwen3 with
    /// `use_sliding_window`).
    pub sliding_window: Option<usize>,
    /// Which layers the window applies to (`layer_types` naming `sliding_attention`, or
    /// Qwen2's layers from `max_window_layers` on); empty: every layer.
    #[serde(default, skip_serializing_if = "Vec::is_empty")]
    pub windowed_layers: Vec<bool>,
    /// How every RMSNorm (blocks, QK-norm, final) applies its weight.
    #[serde(default)]
    pub norm_weight: NormWeight,
    /// Sandwich norms (Gemma): the attention's and the MLP's outputs are normed before their
    /// residual adds (`post_attention_layernorm`, `post_feedforward_layernorm`), the MLP's
    /// input by `pre_feedforward_layernorm`.
    #[serde(default)]
    pub sandwich_norms: bool,
    /// The gated MLP's activation.
    #[serde(default)]
    pub mlp_activation: MlpActivation,
    /// Embeddings are multiplied by √hidden (in fp32, as transformers' `embed_scale`) (Gemma).
    #[serde(default)]
    pub scale_embeddings: bool,
    /// Attention scores are scaled by `query_pre_attn_scalar^-½` instead of `head_dim^-½`
    /// (Gemma).
    #[serde(default)]
    pub query_pre_attn_scalar: Option<f64>,
    /// RoPE of the sliding-window layers where it differs from the global layers' (Gemma 3's
    /// `rope_local_base_freq`, or `rope_parameters.sliding_attention`).
    #[serde(default)]
    pub local_rope: Option<RopeParams>,
    /// The embedding's padding index (`pad_token_id`, transformers' `nn.Embedding(padding_idx)`):
    /// its row gets no gradient from the lookup (a tied head still trains it).
    #[serde(default)]
    pub pad_token_id: Option<u32>,
    /// Attention scores soft-capped as `cap·tanh(s / cap)` before the softmax (Gemma 2).
    #[serde(default)]
    pub attn_logit_softcapping: Option<f64>,
    /// Logits soft-capped as `cap·tanh(z / cap)` (Gemma 2).
    #[serde(default)]
    pub final_logit_softcapping: Option<f64>,
    /// The mixture-of-experts MLP (Mixtral, Qwen3-MoE, GPT-OSS), on the layers it names.
    #[serde(default)]
    pub moe: Option<MoeConfig>,
    /// A learned logit per query head in every softmax of the attention, its probability
    /// dropped (GPT-OSS's `sinks`).
    #[serde(default)]
    pub attention_sinks: bool,
}

impl RopeParams {
    /// "RoPE θ 500000, llama3 ×8 over 8192 positions", for people.
    pub fn describe(&self) -> String {
        let rope = format!("RoPE θ {}", self.theta);
        match &self.scaling {
            RopeScaling::Default => rope,
            RopeScaling::Linear { factor } => format!("{rope}, linear ÷{factor}"),
            RopeScaling::Llama3 {
                factor,
                original_max_position_embeddings,
                ..
            } => format!(
                "{rope}, llama3 ×{factor} over {original_max_position_embeddings} positions"
            ),
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                attention_factor,
                ..
            } => format!(
                "{rope}, yarn ×{factor} over {original_max_position_embeddings} positions (attention ×{attention_factor:.3})"
            ),
        }
    }
}

impl ModelConfig {
    /// A Llama-style dense decoder of `arch` (Qwen2's q/k/v bias included): vocabulary `v`,
    /// width, MLP width and layers `(h, i, l)`, `(nh, nkv)` heads of `h / nh`, RMSNorm eps 1e-5,
    /// RoPE θ `theta` unscaled, 4096 positions; no window, Llama's norms and SiLU. For presets
    /// and benchmarks; a `config.json` goes through [`ModelConfig::from_json_str`].
    pub fn dense(
        arch: Architecture,
        v: usize,
        (h, i, l): (usize, usize, usize),
        (nh, nkv): (usize, usize),
        tied: bool,
        theta: f64,
    ) -> Self {
        ModelConfig {
            architecture: arch,
            vocab_size: v,
            hidden_size: h,
            intermediate_size: i,
            num_layers: l,
            num_heads: nh,
            num_kv_heads: nkv,
            head_dim: h / nh.max(1),
            rms_norm_eps: 1e-5,
            rope_theta: theta,
            rope_scaling: RopeScaling::Default,
            max_position_embeddings: 4096,
            tie_word_embeddings: tied,
            qkv_bias: arch == Architecture::Qwen2,
            o_bias: false,
            qk_norm: false,
            sliding_window: None,
            windowed_layers: Vec::new(),
            norm_weight: NormWeight::Scale,
            sandwich_norms: false,
            mlp_activation: MlpActivation::Silu,
            scale_embeddings: false,
            query_pre_attn_scalar: None,
            local_rope: None,
            pad_token_id: None,
            attn_logit_softcapping: None,
            final_logit_softcapping: None,
            moe: None,
            attention_sinks: false,
        }
    }

    /// Read `config.json` from a file.
    pub fn from_file(path: &Path) -> Result<Self> {
        let text =
            std::fs::read_to_string(path).map_err(|e| Error::io("read model config", path, e))?;
        Self::from_json_str(&text, &path.display().to_string())
    }

    /// Parse the text of a `config.json`; `origin` names it in errors.
    pub fn from_json_str(text: &str, origin: &str) -> Result<Self> {
        let v: Value =
            serde_json::from_str(text).map_err(|e| bad(origin, format!("not valid JSON: {e}")))?;
        if !v.is_object() {
            return Err(bad(origin, "not a JSON object"));
        }
        let (architecture, v) = architecture(&v, origin)?;
        let v = &v;
        let mlp_activation = check_supported_features(v, architecture, origin)?;
        let ((rope_theta, rope_scaling), local_rope) = match architecture {
            Architecture::Gemma3 => gemma3_rope(v, origin)?,
            _ => (rope(v, origin)?, None),
        };
        let (attn_logit_softcapping, final_logit_softcapping) = softcapping(v, origin)?;
        let hidden_size = need_usize(v, "hidden_size", origin)?;
        let (num_heads, num_kv_heads, head_dim) = attention_heads(v, hidden_size, origin)?;
        let attention_bias = get_bool(v, "attention_bias", origin)?.unwrap_or(false);
        let (qkv_bias, o_bias) = match architecture {
            Architecture::Qwen2 => (true, false),
            _ => (attention_bias, attention_bias),
        };
        let num_layers = need_usize(v, "num_hidden_layers", origin)?;
        let (sliding_window, windowed_layers) =
            sliding_window(v, architecture, num_layers, origin)?;
        let gemma = matches!(architecture, Architecture::Gemma2 | Architecture::Gemma3);
        let query_pre_attn_scalar = match gemma {
            true => Some(get_f64(v, "query_pre_attn_scalar", origin)?.unwrap_or(256.0)),
            false => None,
        };
        let cfg = ModelConfig {
            architecture,
            vocab_size: need_usize(v, "vocab_size", origin)?,
            hidden_size,
            intermediate_size: need_usize(v, "intermediate_size", origin)?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: get_f64(v, "rms_norm_eps", origin)?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings: get_usize(v, "max_position_embeddings", origin)?
                .unwrap_or(2048),
            tie_word_embeddings: get_bool(v, "tie_word_embeddings", origin)?.unwrap_or(false),
            qkv_bias,
            o_bias,
            qk_norm: matches!(
                architecture,
                Architecture::Qwen3 | Architecture::Qwen3Moe | Architecture::Gemma3
            ),
            sliding_window,
            windowed_layers,
            norm_weight: if gemma {
                NormWeight::OnePlus
            } else {
                NormWeight::Scale
            },
            sandwich_norms: gemma,
            mlp_activation,
            scale_embeddings: gemma,
            query_pre_attn_scalar,
            local_rope,
            pad_token_id: None,
            attn_logit_softcapping,
            final_logit_softcapping,
            moe: moe::moe(v, architecture, num_layers, origin)?,
            attention_sinks: architecture == Architecture::GptOss,
        };
        let cfg = ModelConfig {
            pad_token_id: pad_token_id(v, cfg.vocab_size, origin)?,
            ..cfg
        };
        cfg.check_sizes(origin)?;
        Ok(cfg)
    }

    /// Check every size against [`limits`] before anything is computed from it: within them
    /// every product the layout, the planner and the device program form (tensor elements,
    /// bytes per tier, workspace regions) fits in 64 bits. Each failure names the key.
    pub fn check_sizes(&self, origin: &str) -> Result<()> {
        let within = |key: &str, v: usize, min: usize, max: usize| -> Result<()> {
            if v < min || v > max {
                return Err(Error::bad_input(
                    "model config",
                    origin,
                    format!("`{key}` is {v}; megatrain supports {min} to {max}"),
                    Some("check the config.json"),
                ));
            }
            Ok(())
        };
        within("vocab_size", self.vocab_size, 1, limits::MAX_VOCAB)?;
        within("hidden_size", self.hidden_size, 1, limits::MAX_HIDDEN)?;
        within(
            "intermediate_size",
            self.intermediate_size,
            1,
            limits::MAX_INTERMEDIATE,
        )?;
        within("num_hidden_layers", self.num_layers, 1, limits::MAX_LAYERS)?;
        within("num_attention_heads", self.num_heads, 1, limits::MAX_HEADS)?;
        within("num_key_value_heads", self.num_kv_heads, 1, self.num_heads)?;
        within("head_dim", self.head_dim, 2, limits::MAX_HEAD_DIM)?;
        within(
            "num_attention_heads × head_dim",
            self.num_heads * self.head_dim,
            1,
            limits::MAX_HIDDEN * 4,
        )?;
        within(
            "max_position_embeddings",
            self.max_position_embeddings,
            1,
            limits::MAX_POSITIONS,
        )?;
        let local_theta = self.local_rope.as_ref().map_or(1.0, |r| r.theta);
        let scalar = self.query_pre_attn_scalar.unwrap_or(1.0);
        for (key, v) in [
            ("rms_norm_eps", self.rms_norm_eps),
            ("rope_theta", self.rope_theta),
            ("rope_local_base_freq", local_theta),
            ("query_pre_attn_scalar", scalar),
        ] {
            if !(v.is_finite() && v > 0.0) {
                return Err(bad(
                    origin,
                    format!("`{key}` must be a positive number, found {v}"),
                ));
            }
        }
        let params = self.num_params_u128();
        if params > limits::MAX_PARAMS as u128 {
            return Err(Error::bad_input(
                "model config",
                origin,
                format!(
                    "the model has {params} parameters, more than megatrain supports ({})",
                    limits::MAX_PARAMS
                ),
                Some("check vocab_size, hidden_size, intermediate_size and num_hidden_layers"),
            ));
        }
        Ok(())
    }

    /// [`ModelConfig::num_params`] in 128 bits, for checking configs that are not yet known to
    /// be within [`limits`].
    fn num_params_u128(&self) -> u128 {
        let (v, c, i) = (
            self.vocab_size as u128,
            self.hidden_size as u128,
            self.intermediate_size as u128,
        );
        let (q, kv) = (
            self.num_heads as u128 * self.head_dim as u128,
            self.num_kv_heads as u128 * self.head_dim as u128,
        );
        let norms = if self.sandwich_norms { 4 } else { 2 };
        let mut layer = norms * c + q * c + 2 * kv * c + c * q;
        if self.qkv_bias {
            layer += q + 2 * kv;
        }
        if self.o_bias {
            layer += c;
        }
        if self.qk_norm {
            layer += 2 * self.head_dim as u128;
        }
        if self.attention_sinks {
            layer += self.num_heads as u128;
        }
        let mlps: u128 = match &self.moe {
            None => self.num_layers as u128 * 3 * i * c,
            Some(m) => {
                let sparse = (0..self.num_layers).filter(|&l| m.is_sparse(l)).count() as u128;
                let (experts, mi) = (m.num_experts as u128, m.expert_intermediate as u128);
                let biases = match m.layout {
                    ExpertLayout::InterleavedColumns => experts * (1 + 2 * mi + c),
                    ExpertLayout::GateUpRows => 0,
                };
                let moe = experts * c + experts * 3 * mi * c + biases;
                sparse * moe + (self.num_layers as u128 - sparse) * 3 * i * c
            }
        };
        let head = if self.tie_word_embeddings { 0 } else { v * c };
        v * c + self.num_layers as u128 * layer + mlps + c + head
    }

    /// The architecture's features, for people: the attention heads, RoPE and its scaling, the
    /// biases, the tied head, the window ("GQA 32 q / 8 kv heads of 128", "RoPE θ 500000,
    /// llama3 ×8 over 8192 positions", …).
    pub fn features(&self) -> Vec<String> {
        let heads = if self.num_kv_heads == self.num_heads {
            "MHA".to_owned()
        } else if self.num_kv_heads == 1 {
            "MQA".to_owned()
        } else {
            "GQA".to_owned()
        };
        let mut f = vec![
            format!(
                "{}, {} layers",
                self.architecture.hf_name(),
                self.num_layers
            ),
            format!(
                "{heads} {} q / {} kv heads of {}",
                self.num_heads, self.num_kv_heads, self.head_dim
            ),
        ];
        let global = RopeParams {
            theta: self.rope_theta,
            scaling: self.rope_scaling.clone(),
        };
        f.push(match &self.local_rope {
            None => global.describe(),
            Some(local) => format!(
                "{} (global layers), {} (local layers)",
                global.describe(),
                local.describe()
            ),
        });
        if self.qkv_bias {
            f.push("q/k/v bias".into());
        }
        if self.o_bias {
            f.push("o bias".into());
        }
        if self.qk_norm {
            f.push("QK-norm".into());
        }
        if self.tie_word_embeddings {
            f.push("tied embeddings".into());
        }
        if self.norm_weight == NormWeight::OnePlus {
            f.push("RMSNorm (1 + w)".into());
        }
        if let Some(m) = &self.moe {
            let sparse = (0..self.num_layers).filter(|&l| m.is_sparse(l)).count();
            f.push(format!(
                "MoE: {} experts of width {}, top-{}{} on {sparse} of {} layers",
                m.num_experts,
                m.expert_intermediate,
                m.top_k,
                if m.norm_topk_prob {
                    " renormalised"
                } else {
                    ""
                },
                self.num_layers
            ));
        }
        if self.sandwich_norms {
            f.push("sandwich norms (4 per block)".into());
        }
        if self.mlp_activation == MlpActivation::GeluTanh {
            f.push("GELU-tanh MLP".into());
        }
        if self.scale_embeddings {
            f.push("embeddings × √hidden".into());
        }
        if let Some(s) = self.query_pre_attn_scalar {
            f.push(format!("attention scale {s}^-½"));
        }
        if let Some(c) = self.attn_logit_softcapping {
            f.push(format!("attention scores soft-capped at {c}"));
        }
        if let Some(c) = self.final_logit_softcapping {
            f.push(format!("logits soft-capped at {c}"));
        }
        if let Some(w) = self.sliding_window {
            let n = (0..self.num_layers)
                .filter(|&i| self.layer_window(i).is_some())
                .count();
            f.push(if n == self.num_layers {
                format!("sliding window {w}")
            } else {
                format!("sliding window {w} on {n} of {} layers", self.num_layers)
            });
        }
        f
    }

    /// Whether layer `layer` is a local (`sliding_attention`) one: as `windowed_layers` says,
    /// else every layer when there is a window. Gemma's local layers stay local without a
    /// window (their RoPE is theirs); [`ModelConfig::layer_window`] is the window itself.
    fn is_local_layer(&self, layer: usize) -> bool {
        match self.windowed_layers.get(layer) {
            Some(local) => *local,
            None => self.sliding_window.is_some(),
        }
    }

    /// `layer_types` as transformers reads it.
    fn hf_layer_types(&self) -> Value {
        let types: Vec<&str> = (0..self.num_layers)
            .map(|i| match self.is_local_layer(i) {
                true => "sliding_attention",
                false => "full_attention",
            })
            .collect();
        serde_json::json!(types)
    }

    /// Which RoPE table layer `layer` rotates with: 0 the global one, 1 the local one (the
    /// sliding-window layers' own RoPE, [`ModelConfig::local_rope`]).
    pub fn layer_rope(&self, layer: usize) -> usize {
        match (&self.local_rope, self.is_local_layer(layer)) {
            (Some(_), true) => 1,
            _ => 0,
        }
    }

    /// The attention's softmax scale where it is not `head_dim^-½`: `query_pre_attn_scalar^-½`
    /// (transformers' Python float, applied as fp32).
    pub fn attn_scale(&self) -> Option<f32> {
        self.query_pre_attn_scalar.map(|s| s.powf(-0.5) as f32)
    }

    /// The factor on the embeddings: √hidden as transformers' fp32 `embed_scale`, else 1.
    pub fn embed_scale(&self) -> f32 {
        if self.scale_embeddings {
            (self.hidden_size as f64).sqrt() as f32
        } else {
            1.0
        }
    }

    /// The sliding window of layer `layer`'s attention, if it has one.
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        let w = self.sliding_window?;
        self.is_local_layer(layer).then_some(w)
    }

    /// q projection output width NH·HD.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// k/v projection output width NKV·HD.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Whether decoder layer `layer` has the mixture-of-experts MLP.
    pub fn is_moe_layer(&self, layer: usize) -> bool {
        self.moe.as_ref().is_some_and(|m| m.is_sparse(layer))
    }

    /// Parameters of the MLP of decoder layer `layer`: the dense one (gate, up, down), or the
    /// router and every expert.
    pub fn mlp_params(&self, layer: usize) -> usize {
        let c = self.hidden_size;
        match &self.moe {
            Some(m) if m.is_sparse(layer) => {
                let biases = match m.layout {
                    ExpertLayout::InterleavedColumns => 1 + 2 * m.expert_intermediate + c,
                    ExpertLayout::GateUpRows => 0,
                };
                m.num_experts * (c * (1 + 3 * m.expert_intermediate) + biases)
            }
            _ => 3 * self.intermediate_size * c,
        }
    }

    /// Parameters of the MLP of decoder layer `layer` that one token computes with: the dense
    /// MLP, or the router and `top_k` experts.
    pub fn active_mlp_params(&self, layer: usize) -> usize {
        let c = self.hidden_size;
        match &self.moe {
            Some(m) if m.is_sparse(layer) => {
                let biases = match m.layout {
                    ExpertLayout::InterleavedColumns => {
                        m.num_experts + m.top_k * (2 * m.expert_intermediate + c)
                    }
                    ExpertLayout::GateUpRows => 0,
                };
                m.num_experts * c + m.top_k * 3 * m.expert_intermediate * c + biases
            }
            _ => 3 * self.intermediate_size * c,
        }
    }

    /// Expert weights one token computes with in decoder layer `layer`: its `top_k` experts'
    /// gate, up and down projections (biases aside), what the experts' GEMMs multiply by; 0 on a
    /// dense layer.
    pub fn active_expert_params(&self, layer: usize) -> usize {
        match &self.moe {
            Some(m) if m.is_sparse(layer) => m.top_k * 3 * m.expert_intermediate * self.hidden_size,
            _ => 0,
        }
    }

    /// Parameters one token computes with (the embedding counted once, as
    /// [`ModelConfig::num_params`] does): all of a dense model, the active part of an MoE one.
    pub fn active_params(&self) -> usize {
        let idle: usize = (0..self.num_layers)
            .map(|l| self.mlp_params(l) - self.active_mlp_params(l))
            .sum();
        self.num_params() - idle
    }

    /// Parameters of decoder layer `layer` that one token computes with.
    pub fn active_layer_params(&self, layer: usize) -> usize {
        self.layer_params(layer) - self.mlp_params(layer) + self.active_mlp_params(layer)
    }

    /// Parameters of decoder layer `layer`.
    pub fn layer_params(&self, layer: usize) -> usize {
        let c = self.hidden_size;
        let norms = if self.sandwich_norms { 4 } else { 2 };
        let mut n = norms * c
            + self.q_dim() * c
            + 2 * self.kv_dim() * c
            + c * self.q_dim()
            + self.mlp_params(layer);
        if self.qkv_bias {
            n += self.q_dim() + 2 * self.kv_dim();
        }
        if self.o_bias {
            n += c;
        }
        if self.qk_norm {
            n += 2 * self.head_dim;
        }
        if self.attention_sinks {
            n += self.num_heads;
        }
        n
    }

    /// All parameters (tied embeddings counted once).
    pub fn num_params(&self) -> usize {
        let emb = self.vocab_size * self.hidden_size;
        let head = if self.tie_word_embeddings { 0 } else { emb };
        let layers: usize = (0..self.num_layers).map(|l| self.layer_params(l)).sum();
        emb + layers + self.hidden_size + head
    }
}

#[cfg(test)]
mod tests;
