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

/// The architecture `architectures[0]` names (or `model_type` implies).
fn architecture(v: &Value, origin: &str) -> Result<Architecture> {
    let arch_name = match v.get("architectures") {
        Some(Value::Array(a)) if !a.is_empty() => a[0].as_str().unwrap_or("").to_owned(),
        _ => match v.get("model_type").and_then(Value::as_str) {
            Some("llama") => "LlamaForCausalLM".into(),
            Some("mistral") => "MistralForCausalLM".into(),
            Some("qwen2") => "Qwen2ForCausalLM".into(),
            Some("qwen3") => "Qwen3ForCausalLM".into(),
            Some(other) => other.to_owned(),
            None => {
                return Err(bad(
                    origin,
                    "neither `architectures` nor `model_type` is set",
                ))
            }
        },
    };
    match arch_name.as_str() {
        "LlamaForCausalLM" => Ok(Architecture::Llama),
        "MistralForCausalLM" => Ok(Architecture::Mistral),
        "Qwen2ForCausalLM" => Ok(Architecture::Qwen2),
        "Qwen3ForCausalLM" => Ok(Architecture::Qwen3),
        other => Err(Error::bad_input(
            "model config",
            origin,
            format!("architecture `{other}` is not supported"),
            Some("megatrain implements LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM and Qwen3ForCausalLM"),
        )),
    }
}

/// Refuse the features the layers do not implement: activations other than SiLU, MLP biases.
fn check_supported_features(v: &Value, origin: &str) -> Result<()> {
    if let Some(act) = v.get("hidden_act").and_then(Value::as_str) {
        if act != "silu" {
            return Err(bad(
                origin,
                format!("hidden_act `{act}` is not supported (only `silu`)"),
            ));
        }
    }
    if get_bool(v, "mlp_bias", origin)? == Some(true) {
        return Err(bad(origin, "`mlp_bias: true` is not supported"));
    }
    Ok(())
}

/// RoPE's θ (10000 unless set) and its scaling. transformers 4 puts `rope_theta` and
/// `rope_scaling` at the top level; transformers 5 nests both in `rope_parameters`. The scalings
/// implemented are read with transformers' defaults (`original_max_position_embeddings` from
/// the top level first, else the dict, else `max_position_embeddings`; yarn's `factor` from the
/// context ratio, `attention_factor` from `factor`, `mscale` and `mscale_all_dim`); any other
/// type, per-layer parameters and partial rotation are refused by name.
fn rope(v: &Value, origin: &str) -> Result<(f64, RopeScaling)> {
    let rope_params = v.get("rope_parameters").filter(|x| !x.is_null());
    if let Some(rp) = rope_params {
        let nested = rp
            .as_object()
            .is_some_and(|o| !o.is_empty() && o.values().all(Value::is_object));
        if nested {
            return Err(bad(
                origin,
                "RoPE parameters per layer type (`rope_parameters` holding one dict per layer type) are not supported",
            ));
        }
    }
    let rope_theta = match rope_params {
        Some(rp) => get_f64(rp, "rope_theta", origin)?,
        None => None,
    }
    .or(get_f64(v, "rope_theta", origin)?)
    .unwrap_or(10000.0);
    let partial = match rope_params {
        Some(rp) => get_f64(rp, "partial_rotary_factor", origin)?,
        None => None,
    }
    .or(get_f64(v, "partial_rotary_factor", origin)?);
    if partial.is_some_and(|p| p != 1.0) {
        return Err(bad(
            origin,
            "`partial_rotary_factor` below 1 (RoPE on part of each head) is not supported",
        ));
    }
    // The dict that scales: the first of transformers 4's `rope_scaling` and transformers 5's
    // `rope_parameters` that names a type other than the default.
    let kind = |s: &Value| {
        s.get("rope_type")
            .or_else(|| s.get("type"))
            .and_then(Value::as_str)
            .unwrap_or("default")
            .to_owned()
    };
    // transformers reads `rope_scaling or rope_parameters`: the transformers-4 key wins.
    let scaling = [v.get("rope_scaling").filter(|x| !x.is_null()), rope_params]
        .into_iter()
        .flatten()
        .find(|s| kind(s) != "default");
    let Some(s) = scaling else {
        return Ok((rope_theta, RopeScaling::Default));
    };
    let field = |key: &str| -> Result<Option<f64>> {
        match s.get(key) {
            None | Some(Value::Null) => Ok(None),
            Some(x) => x
                .as_f64()
                .filter(|f| f.is_finite())
                .map(Some)
                .ok_or_else(|| {
                    bad(
                        origin,
                        format!("RoPE scaling `{key}` is {x}, not a finite number"),
                    )
                }),
        }
    };
    let need = |key: &str| -> Result<f64> {
        field(key)?.ok_or_else(|| bad(origin, format!("RoPE scaling `{}` needs `{key}`", kind(s))))
    };
    let positive = |key: &str, x: f64| -> Result<f64> {
        if x > 0.0 {
            Ok(x)
        } else {
            Err(bad(
                origin,
                format!("RoPE scaling `{key}` must be positive, not {x}"),
            ))
        }
    };
    let max_pos = get_usize(v, "max_position_embeddings", origin)?.unwrap_or(2048) as f64;
    let original = match get_f64(v, "original_max_position_embeddings", origin)? {
        Some(top) => top,
        None => field("original_max_position_embeddings")?.unwrap_or(max_pos),
    };
    if !(original >= 1.0 && original.fract() == 0.0 && original <= (1u64 << 40) as f64) {
        return Err(bad(
            origin,
            format!("`original_max_position_embeddings` must be a positive whole number, not {original}"),
        ));
    }
    let original = original as usize;
    let scaling = match kind(s).as_str() {
        "linear" => RopeScaling::Linear {
            factor: positive("factor", need("factor")?)?,
        },
        "llama3" => {
            let (low, high) = (need("low_freq_factor")?, need("high_freq_factor")?);
            if !(high > low && low > 0.0) {
                return Err(bad(
                    origin,
                    format!("RoPE scaling llama3 needs 0 < low_freq_factor < high_freq_factor, not {low} and {high}"),
                ));
            }
            RopeScaling::Llama3 {
                factor: positive("factor", need("factor")?)?,
                low_freq_factor: low,
                high_freq_factor: high,
                original_max_position_embeddings: original,
            }
        }
        "yarn" => {
            let factor = positive(
                "factor",
                field("factor")?.unwrap_or(max_pos / original as f64),
            )?;
            let mscale = |scale: f64, m: f64| {
                if scale <= 1.0 {
                    1.0
                } else {
                    0.1 * m * scale.ln() + 1.0
                }
            };
            let attention_factor = match field("attention_factor")? {
                Some(a) => positive("attention_factor", a)?,
                None => match (field("mscale")?, field("mscale_all_dim")?) {
                    (Some(m), Some(all)) if m != 0.0 && all != 0.0 => {
                        mscale(factor, m) / mscale(factor, all)
                    }
                    _ => mscale(factor, 1.0),
                },
            };
            // transformers: `beta_fast or 32`, `beta_slow or 1` (0 and null take the default).
            let or = |x: Option<f64>, d: f64| x.filter(|&b| b != 0.0).unwrap_or(d);
            // transformers: `rope_parameters.get("truncate", True)`: absent is true, null false.
            let truncate = match s.get("truncate") {
                None => true,
                Some(Value::Null) => false,
                Some(Value::Bool(b)) => *b,
                Some(x) => return Err(bad(origin, format!("RoPE scaling `truncate` is {x}, not true or false"))),
            };
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings: original,
                beta_fast: or(field("beta_fast")?, 32.0),
                beta_slow: or(field("beta_slow")?, 1.0),
                attention_factor,
                truncate,
            }
        }
        other => {
            return Err(bad(
                origin,
                format!("RoPE scaling type `{other}` is not supported (default, linear, llama3 and yarn are)"),
            ))
        }
    };
    Ok((rope_theta, scaling))
}

/// The sliding window and the layers it applies to, as transformers reads them: Mistral's
/// `sliding_window` on every layer (4096 when the key is absent, none when it is null;
/// `layer_types` ignored); Qwen2's and Qwen3's only under `use_sliding_window` (the same
/// default), on the layers `layer_types` names `sliding_attention` (else those from
/// `max_window_layers` on, 28 unless set); Llama's `layer_types` must be all `full_attention`.
/// Empty layers: every layer.
fn sliding_window(
    v: &Value,
    arch: Architecture,
    layers: usize,
    origin: &str,
) -> Result<(Option<usize>, Vec<bool>)> {
    // transformers' configs default the window to 4096; an explicit null means none.
    let size = || -> Result<Option<usize>> {
        match v.get("sliding_window") {
            None => Ok(Some(4096)),
            Some(Value::Null) => Ok(None),
            Some(_) => match get_usize(v, "sliding_window", origin)? {
                Some(0) => Err(bad(
                    origin,
                    "`sliding_window` is 0; a window holds at least the query itself",
                )),
                w => Ok(w),
            },
        }
    };
    if arch == Architecture::Mistral {
        return Ok((size()?, Vec::new()));
    }
    let types = match v.get("layer_types").filter(|x| !x.is_null()) {
        None => None,
        Some(Value::Array(a)) => Some(
            a.iter()
                .map(|t| match t.as_str() {
                    Some("full_attention") => Ok(false),
                    Some("sliding_attention") => Ok(true),
                    _ => Err(bad(
                        origin,
                        format!("`layer_types` names {t}: full_attention and sliding_attention are supported"),
                    )),
                })
                .collect::<Result<Vec<bool>>>()?,
        ),
        Some(other) => return Err(bad(origin, format!("`layer_types` is {other}, not a list"))),
    };
    if let Some(t) = &types {
        if t.len() != layers {
            return Err(bad(
                origin,
                format!("`layer_types` has {} entries for {layers} layers", t.len()),
            ));
        }
    }
    match arch {
        Architecture::Qwen2 | Architecture::Qwen3 => {
            if get_bool(v, "use_sliding_window", origin)? != Some(true) {
                return Ok((None, Vec::new()));
            }
            let Some(w) = size()? else {
                return Ok((None, Vec::new()));
            };
            let windowed = match types {
                Some(t) => t,
                None => {
                    let from = get_usize(v, "max_window_layers", origin)?.unwrap_or(28);
                    (0..layers).map(|i| i >= from).collect()
                }
            };
            if !windowed.contains(&true) {
                return Ok((None, Vec::new()));
            }
            Ok((Some(w), windowed))
        }
        _ => {
            if types.is_some_and(|t| t.contains(&true)) {
                return Err(bad(
                    origin,
                    format!(
                        "`layer_types` names sliding_attention layers, which {} does not have",
                        arch.hf_name()
                    ),
                ));
            }
            Ok((None, Vec::new()))
        }
    }
}

/// Query heads, key/value heads and the head dimension: heads a positive multiple of key/value
/// heads, the head dimension even (RoPE rotates pairs).
fn attention_heads(v: &Value, hidden_size: usize, origin: &str) -> Result<(usize, usize, usize)> {
    let num_heads = need_usize(v, "num_attention_heads", origin)?;
    let num_kv_heads = get_usize(v, "num_key_value_heads", origin)?.unwrap_or(num_heads);
    if num_heads == 0 || num_kv_heads == 0 || num_heads % num_kv_heads != 0 {
        return Err(bad(
            origin,
            format!("num_attention_heads ({num_heads}) must be a positive multiple of num_key_value_heads ({num_kv_heads})"),
        ));
    }
    let head_dim = match get_usize(v, "head_dim", origin)? {
        Some(hd) => hd,
        None if hidden_size.is_multiple_of(num_heads) => hidden_size / num_heads,
        None => {
            return Err(bad(
                origin,
                "hidden_size is not a multiple of num_attention_heads and head_dim is unset",
            ))
        }
    };
    if head_dim % 2 != 0 {
        return Err(bad(
            origin,
            format!("head_dim {head_dim} is odd; RoPE needs an even head dimension"),
        ));
    }
    Ok((num_heads, num_kv_heads, head_dim))
}

fn bad(origin: &str, reason: impl Into<String>) -> Error {
    Error::bad_input("model config", origin, reason, None)
}

fn get_usize(v: &Value, key: &str, origin: &str) -> Result<Option<usize>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_u64()
            .and_then(|n| usize::try_from(n).ok())
            .map(Some)
            .ok_or_else(|| {
                bad(
                    origin,
                    format!("`{key}` must be a non-negative integer, found {x}"),
                )
            }),
    }
}

fn need_usize(v: &Value, key: &str, origin: &str) -> Result<usize> {
    get_usize(v, key, origin)?.ok_or_else(|| bad(origin, format!("`{key}` is missing")))
}

fn get_f64(v: &Value, key: &str, origin: &str) -> Result<Option<f64>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_f64()
            .map(Some)
            .ok_or_else(|| bad(origin, format!("`{key}` must be a number, found {x}"))),
    }
}

fn get_bool(v: &Value, key: &str, origin: &str) -> Result<Option<bool>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_bool()
            .map(Some)
            .ok_or_else(|| bad(origin, format!("`{key}` must be true or false, found {x}"))),
    }
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
