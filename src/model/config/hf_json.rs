//! The `config.json` megatrain writes with an export: the model's description in the spelling
//! transformers reads back.

use super::{moe, Architecture, ModelConfig, RopeParams};
use crate::model::ops::RopeScaling;
use serde_json::Value;

impl ModelConfig {
    /// The `config.json` that transformers loads unchanged (transformers-4 spelling, which
    /// transformers 5 also reads), for fp32 weights.
    pub fn to_hf_json(&self) -> String {
        self.to_hf_json_as("float32")
    }

    /// The same for weights stored as `torch_dtype` (`float32`, `bfloat16`).
    pub fn to_hf_json_as(&self, torch_dtype: &str) -> String {
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
            "torch_dtype": torch_dtype,
            "pad_token_id": self.pad_token_id,
        });
        if !matches!(
            self.architecture,
            Architecture::Qwen2 | Architecture::Ministral
        ) {
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
                v["layer_types"] = self.hf_layer_types();
                // transformers before `layer_types` read the windowed layers from here.
                let first = (0..self.num_layers).find(|&i| self.layer_window(i).is_some());
                v["max_window_layers"] = Value::from(first.unwrap_or(self.num_layers));
            }
        }
        if matches!(
            self.architecture,
            Architecture::Mistral | Architecture::Mixtral
        ) {
            v["sliding_window"] = self.sliding_window.map_or(Value::Null, Value::from);
        }
        if self.architecture == Architecture::Qwen3Moe {
            v["use_sliding_window"] = Value::Bool(self.sliding_window.is_some());
            v["sliding_window"] = self.sliding_window.map_or(Value::Null, Value::from);
        }
        if let (Some(m), Some(o)) = (&self.moe, v.as_object_mut()) {
            moe::hf_fields(m, self.architecture, self.num_layers, o);
        }
        if matches!(
            self.architecture,
            Architecture::Ministral | Architecture::GptOss
        ) {
            v["sliding_window"] = self.sliding_window.map_or(Value::Null, Value::from);
            v["layer_types"] = self.hf_layer_types();
        }
        if matches!(
            self.architecture,
            Architecture::Gemma2 | Architecture::Gemma3
        ) {
            self.gemma_hf_fields(&mut v);
        } else if self.rope_scaling != RopeScaling::Default {
            // The same fields transformers reads back (its `rope_type` tag included).
            v["rope_scaling"] = serde_json::to_value(&self.rope_scaling).unwrap_or(Value::Null);
        }
        serde_json::to_string_pretty(&v).unwrap_or_default()
    }

    /// Gemma's own keys (Gemma 3 in transformers 5's spelling: RoPE per layer type in
    /// `rope_parameters`; Gemma 2 with one RoPE).
    fn gemma_hf_fields(&self, v: &mut Value) {
        let gemma3 = self.architecture == Architecture::Gemma3;
        let layer_types = self.hf_layer_types();
        let Some(o) = v.as_object_mut() else {
            return;
        };
        o.remove("hidden_act");
        if gemma3 {
            o.remove("rope_theta");
        } else if self.rope_scaling != RopeScaling::Default {
            let scaling = serde_json::to_value(&self.rope_scaling).unwrap_or(Value::Null);
            o.insert("rope_scaling".into(), scaling);
        }
        let rope = |r: &RopeParams| {
            let mut d = serde_json::to_value(&r.scaling).unwrap_or(Value::Null);
            d["rope_theta"] = Value::from(r.theta);
            d
        };
        let global = RopeParams {
            theta: self.rope_theta,
            scaling: self.rope_scaling.clone(),
        };
        let local = self.local_rope.clone().unwrap_or(global.clone());
        for (key, value) in [
            ("hidden_activation", Value::from("gelu_pytorch_tanh")),
            (
                // transformers' strict config wants an integer where the value is one.
                "query_pre_attn_scalar",
                match self.query_pre_attn_scalar.unwrap_or(self.head_dim as f64) {
                    s if s.fract() == 0.0 && s.abs() < 1e15 => Value::from(s as i64),
                    s => Value::from(s),
                },
            ),
            (
                "sliding_window",
                self.sliding_window.map_or(Value::Null, Value::from),
            ),
            ("layer_types", layer_types),
            (
                "final_logit_softcapping",
                self.final_logit_softcapping
                    .map_or(Value::Null, Value::from),
            ),
            (
                "attn_logit_softcapping",
                self.attn_logit_softcapping.map_or(Value::Null, Value::from),
            ),
            ("use_bidirectional_attention", Value::Bool(false)),
        ] {
            o.insert(key.to_owned(), value);
        }
        if gemma3 {
            let rope = serde_json::json!({"full_attention": rope(&global), "sliding_attention": rope(&local)});
            o.insert("rope_parameters".into(), rope);
        }
    }
}
