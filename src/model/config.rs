//! Llama-family model configuration, read from a Hugging Face `config.json`.
//!
//! Accepts Llama, Mistral, Qwen2 (q/k/v bias) and Qwen3 (QK-norm), tied embeddings, and both transformers-4 and
//! transformers-5 spellings (`torch_dtype`/`dtype`, top-level `rope_theta` or
//! `rope_parameters.rope_theta`). Anything we do not implement — another architecture, a RoPE
//! scaling type, an activation other than SiLU, MLP bias — is an error naming it, never silently
//! wrong. Keys we do not use (token ids, dtype, ...) are ignored: HF configs carry many.

use super::ops::RopeScaling;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use serde_json::Value;
use std::path::Path;

mod parse;
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
    /// `Qwen2ForCausalLM` (Llama with q/k/v bias).
    Qwen2,
    /// `Qwen3ForCausalLM` (Llama with QK-norm: a per-head RMSNorm on q and k before RoPE).
    Qwen3,
}

impl Architecture {
    /// The HF class name.
    pub fn hf_name(self) -> &'static str {
        match self {
            Architecture::Llama => "LlamaForCausalLM",
            Architecture::Mistral => "MistralForCausalLM",
            Architecture::Qwen2 => "Qwen2ForCausalLM",
            Architecture::Qwen3 => "Qwen3ForCausalLM",
        }
    }

    /// The HF `model_type`.
    pub fn model_type(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Mistral => "mistral",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
        }
    }
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
}

impl ModelConfig {
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
        let architecture = architecture(&v, origin)?;
        check_supported_features(&v, origin)?;
        let (rope_theta, rope_scaling) = rope(&v, origin)?;
        let hidden_size = need_usize(&v, "hidden_size", origin)?;
        let (num_heads, num_kv_heads, head_dim) = attention_heads(&v, hidden_size, origin)?;
        let attention_bias = get_bool(&v, "attention_bias", origin)?.unwrap_or(false);
        let (qkv_bias, o_bias) = match architecture {
            Architecture::Qwen2 => (true, false),
            _ => (attention_bias, attention_bias),
        };
        let num_layers = need_usize(&v, "num_hidden_layers", origin)?;
        let (sliding_window, windowed_layers) =
            sliding_window(&v, architecture, num_layers, origin)?;
        let cfg = ModelConfig {
            architecture,
            vocab_size: need_usize(&v, "vocab_size", origin)?,
            hidden_size,
            intermediate_size: need_usize(&v, "intermediate_size", origin)?,
            num_layers,
            num_heads,
            num_kv_heads,
            head_dim,
            rms_norm_eps: get_f64(&v, "rms_norm_eps", origin)?.unwrap_or(1e-6),
            rope_theta,
            rope_scaling,
            max_position_embeddings: get_usize(&v, "max_position_embeddings", origin)?
                .unwrap_or(2048),
            tie_word_embeddings: get_bool(&v, "tie_word_embeddings", origin)?.unwrap_or(false),
            qkv_bias,
            o_bias,
            qk_norm: architecture == Architecture::Qwen3,
            sliding_window,
            windowed_layers,
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
        for (key, v) in [
            ("rms_norm_eps", self.rms_norm_eps),
            ("rope_theta", self.rope_theta),
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
        let mut layer = 2 * c + q * c + 2 * kv * c + c * q + 3 * i * c;
        if self.qkv_bias {
            layer += q + 2 * kv;
        }
        if self.o_bias {
            layer += c;
        }
        if self.qk_norm {
            layer += 2 * self.head_dim as u128;
        }
        let head = if self.tie_word_embeddings { 0 } else { v * c };
        v * c + self.num_layers as u128 * layer + c + head
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
        let rope = format!("RoPE θ {}", self.rope_theta);
        f.push(match &self.rope_scaling {
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

    /// The `config.json` that transformers loads unchanged (transformers-4 spelling, which
    /// transformers 5 also reads).
    pub fn to_hf_json(&self) -> String {
        let mut v = serde_json::json!({
            "architectures": [self.architecture.hf_name()],
            "model_type": self.architecture.model_type(),
            "vocab_size": self.vocab_size,
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "rope_theta": self.rope_theta,
            "max_position_embeddings": self.max_position_embeddings,
            "tie_word_embeddings": self.tie_word_embeddings,
            "torch_dtype": "float32",
        });
        if self.architecture != Architecture::Qwen2 {
            v["attention_bias"] = Value::Bool(self.qkv_bias);
        }
        if matches!(
            self.architecture,
            Architecture::Llama | Architecture::Mistral
        ) {
            v["mlp_bias"] = Value::Bool(false);
        }
        if matches!(self.architecture, Architecture::Qwen2 | Architecture::Qwen3) {
            v["use_sliding_window"] = Value::Bool(self.sliding_window.is_some());
            if let Some(w) = self.sliding_window {
                v["sliding_window"] = Value::from(w);
                let types: Vec<&str> = (0..self.num_layers)
                    .map(|i| match self.layer_window(i) {
                        Some(_) => "sliding_attention",
                        None => "full_attention",
                    })
                    .collect();
                v["layer_types"] = serde_json::json!(types);
                // transformers before `layer_types` read the windowed layers from here.
                let first = (0..self.num_layers).find(|&i| self.layer_window(i).is_some());
                v["max_window_layers"] = Value::from(first.unwrap_or(self.num_layers));
            }
        }
        if self.architecture == Architecture::Mistral {
            v["sliding_window"] = self.sliding_window.map_or(Value::Null, Value::from);
        }
        if self.rope_scaling != RopeScaling::Default {
            // The same fields transformers reads back (its `rope_type` tag included).
            v["rope_scaling"] = serde_json::to_value(&self.rope_scaling).unwrap_or(Value::Null);
        }
        serde_json::to_string_pretty(&v).unwrap_or_default()
    }

    /// The sliding window of layer `layer`'s attention, if it has one.
    pub fn layer_window(&self, layer: usize) -> Option<usize> {
        let w = self.sliding_window?;
        match self.windowed_layers.get(layer) {
            Some(false) => None,
            _ => Some(w),
        }
    }

    /// q projection output width NH·HD.
    pub fn q_dim(&self) -> usize {
        self.num_heads * self.head_dim
    }

    /// k/v projection output width NKV·HD.
    pub fn kv_dim(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Parameters of one decoder layer.
    pub fn params_per_layer(&self) -> usize {
        let c = self.hidden_size;
        let mut n = 2 * c // two norms
            + self.q_dim() * c
            + 2 * self.kv_dim() * c
            + c * self.q_dim()
            + 3 * self.intermediate_size * c;
        if self.qkv_bias {
            n += self.q_dim() + 2 * self.kv_dim();
        }
        if self.o_bias {
            n += c;
        }
        if self.qk_norm {
            n += 2 * self.head_dim;
        }
        n
    }

    /// All parameters (tied embeddings counted once).
    pub fn num_params(&self) -> usize {
        let emb = self.vocab_size * self.hidden_size;
        let head = if self.tie_word_embeddings { 0 } else { emb };
        emb + self.num_layers * self.params_per_layer() + self.hidden_size + head
    }
}

#[cfg(test)]
mod tests;
