//! Reading `config.json`'s fields as transformers reads them: the architecture, the features
//! refused by name, RoPE and its scaling, sliding windows per layer, the attention heads, and
//! typed access to a key with its error.

use super::{Architecture, MlpActivation, RopeParams};
use crate::model::ops::RopeScaling;
use crate::{Error, Result};
use serde_json::Value;

/// The architecture `architectures[0]` names (or `model_type` implies), and the config to read
/// it from: the text model's of a `Gemma3ForConditionalGeneration` (its `text_config`), with
/// Gemma 3's defaults under every key it leaves out, as transformers' `Gemma3TextConfig` has them.
pub(super) fn architecture(v: &Value, origin: &str) -> Result<(Architecture, Value)> {
    let arch_name = match v.get("architectures") {
        Some(Value::Array(a)) if !a.is_empty() => a[0].as_str().unwrap_or("").to_owned(),
        _ => match v.get("model_type").and_then(Value::as_str) {
            Some("llama") => "LlamaForCausalLM".into(),
            Some("mistral") => "MistralForCausalLM".into(),
            Some("ministral") => "MinistralForCausalLM".into(),
            Some("qwen2") => "Qwen2ForCausalLM".into(),
            Some("qwen3") => "Qwen3ForCausalLM".into(),
            Some("gemma3_text") => "Gemma3ForCausalLM".into(),
            Some("gemma2") => "Gemma2ForCausalLM".into(),
            Some("gemma3") => "Gemma3ForConditionalGeneration".into(),
            Some("mixtral") => "MixtralForCausalLM".into(),
            Some("qwen3_moe") => "Qwen3MoeForCausalLM".into(),
            Some("gpt_oss") => "GptOssForCausalLM".into(),
            Some(other) => other.to_owned(),
            None => {
                return Err(bad(
                    origin,
                    "neither `architectures` nor `model_type` is set",
                ))
            }
        },
    };
    let arch = match arch_name.as_str() {
        "LlamaForCausalLM" => Architecture::Llama,
        "MistralForCausalLM" => Architecture::Mistral,
        "MinistralForCausalLM" => Architecture::Ministral,
        "Qwen2ForCausalLM" => Architecture::Qwen2,
        "Qwen3ForCausalLM" => Architecture::Qwen3,
        "Gemma2ForCausalLM" => Architecture::Gemma2,
        "Gemma3ForCausalLM" | "Gemma3ForConditionalGeneration" => Architecture::Gemma3,
        "MixtralForCausalLM" => Architecture::Mixtral,
        "Qwen3MoeForCausalLM" => Architecture::Qwen3Moe,
        "GptOssForCausalLM" => Architecture::GptOss,
        other => return Err(Error::bad_input(
            "model config",
            origin,
            format!("architecture `{other}` is not supported"),
            Some("megatrain implements LlamaForCausalLM, MistralForCausalLM, MinistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM, Gemma2ForCausalLM, Gemma3ForCausalLM, the text model of Gemma3ForConditionalGeneration, MixtralForCausalLM, Qwen3MoeForCausalLM and GptOssForCausalLM"),
        )),
    };
    if arch == Architecture::Gemma2 {
        // transformers' `Gemma2Config` class defaults (soft caps on unless set to null).
        let defaults = serde_json::json!({
            "vocab_size": 256_000, "hidden_size": 2304, "intermediate_size": 9216,
            "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
            "head_dim": 256, "max_position_embeddings": 8192, "rms_norm_eps": 1e-6,
            "tie_word_embeddings": true, "query_pre_attn_scalar": 256, "pad_token_id": 0,
            "final_logit_softcapping": 30.0, "attn_logit_softcapping": 50.0,
        });
        return Ok((arch, with_defaults(defaults, v)));
    }
    if arch == Architecture::GptOss {
        // transformers' `GptOssConfig` class defaults (YaRN ×32 over 4096 positions, θ 150000;
        // sliding-window layers of 128 alternating with full ones: `layer_types`).
        let mut defaults = serde_json::json!({
            "vocab_size": 201_088, "hidden_size": 2880, "intermediate_size": 2880,
            "num_hidden_layers": 36, "num_attention_heads": 64, "num_key_value_heads": 8,
            "head_dim": 64, "sliding_window": 128, "max_position_embeddings": 131_072,
            "rms_norm_eps": 1e-5, "tie_word_embeddings": false, "attention_bias": true,
            "num_local_experts": 128, "num_experts_per_tok": 4,
            "swiglu_alpha": 1.702, "swiglu_limit": 7.0,
        });
        let yarn = serde_json::json!({"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0,
            "beta_slow": 1.0, "truncate": false, "original_max_position_embeddings": 4096,
            "rope_theta": 150_000.0});
        let has_rope = ["rope_parameters", "rope_scaling"]
            .iter()
            .any(|k| v.get(*k).is_some_and(|x| !x.is_null()));
        if !has_rope {
            defaults["rope_parameters"] = yarn;
        }
        if v.get("rope_theta").is_none() {
            defaults["rope_theta"] = serde_json::json!(150_000.0);
        }
        let mut merged = with_defaults(defaults, v);
        if merged.get("layer_types").is_none_or(Value::is_null) {
            let layers = merged["num_hidden_layers"]
                .as_u64()
                .unwrap_or(0)
                .min(1 << 16);
            let types: Vec<&str> = (0..layers)
                .map(|i| match (i + 1) % 2 {
                    1 => "sliding_attention",
                    _ => "full_attention",
                })
                .collect();
            merged["layer_types"] = serde_json::json!(types);
        }
        return Ok((arch, merged));
    }
    if arch != Architecture::Gemma3 {
        return Ok((arch, v.clone()));
    }
    let text = if arch_name == "Gemma3ForConditionalGeneration" {
        match v.get("text_config") {
            Some(t @ Value::Object(_)) => t,
            _ => {
                return Err(bad(
                    origin,
                    "a Gemma3ForConditionalGeneration config without a `text_config` object",
                ))
            }
        }
    } else {
        v
    };
    // transformers' `Gemma3TextConfig` class defaults.
    let defaults = serde_json::json!({
        "vocab_size": 262_208, "hidden_size": 2304, "intermediate_size": 9216,
        "num_hidden_layers": 26, "num_attention_heads": 8, "num_key_value_heads": 4,
        "head_dim": 256, "max_position_embeddings": 131_072, "rms_norm_eps": 1e-6,
        "tie_word_embeddings": true, "query_pre_attn_scalar": 256, "pad_token_id": 0,
    });
    Ok((arch, with_defaults(defaults, text)))
}

/// `config` over `defaults`: every key `config` sets wins (null included).
fn with_defaults(mut defaults: Value, config: &Value) -> Value {
    if let (Some(m), Some(c)) = (defaults.as_object_mut(), config.as_object()) {
        for (k, x) in c {
            m.insert(k.clone(), x.clone());
        }
    }
    defaults
}

/// The attention scores' and the logits' soft caps (`attn_logit_softcapping`,
/// `final_logit_softcapping`): null or absent none, else a positive number.
pub(super) fn softcapping(v: &Value, origin: &str) -> Result<(Option<f64>, Option<f64>)> {
    let cap = |key: &str| -> Result<Option<f64>> {
        match get_f64(v, key, origin)? {
            Some(c) if !(c.is_finite() && c > 0.0) => Err(bad(
                origin,
                format!("`{key}` is {c}; a soft cap is a positive number"),
            )),
            c => Ok(c),
        }
    };
    Ok((
        cap("attn_logit_softcapping")?,
        cap("final_logit_softcapping")?,
    ))
}

/// Refuse the features the layers do not implement (MLP biases, an activation other than the
/// architecture's: SiLU, or Gemma's GELU-tanh; logit soft-capping, bidirectional attention);
/// the MLP's activation.
pub(super) fn check_supported_features(
    v: &Value,
    arch: Architecture,
    origin: &str,
) -> Result<MlpActivation> {
    // Quantised checkpoints: GPT-OSS's MXFP4 experts are read (dequantised to the fp32
    // master); other methods' packed weights are not.
    if let Some(q) = v.get("quantization_config").filter(|q| !q.is_null()) {
        let method = q.get("quant_method").and_then(Value::as_str).unwrap_or("?");
        if !(method == "mxfp4" && arch == Architecture::GptOss) {
            return Err(Error::bad_input(
                "model config",
                origin,
                format!("`quantization_config` names `{method}` weights, which megatrain does not read"),
                Some("start from the full-precision (bf16/fp32) checkpoint of this model; MXFP4 is read for GPT-OSS only"),
            ));
        }
    }
    if get_bool(v, "mlp_bias", origin)? == Some(true) {
        return Err(bad(origin, "`mlp_bias: true` is not supported"));
    }
    if !matches!(arch, Architecture::Gemma2 | Architecture::Gemma3) {
        for key in ["attn_logit_softcapping", "final_logit_softcapping"] {
            if v.get(key).is_some_and(|x| !x.is_null()) {
                return Err(bad(
                    origin,
                    format!(
                        "`{key}` (logit soft-capping) is not part of {}",
                        arch.hf_name()
                    ),
                ));
            }
        }
        if let Some(act) = v.get("hidden_act").and_then(Value::as_str) {
            if act != "silu" {
                return Err(bad(
                    origin,
                    format!("hidden_act `{act}` is not supported (only `silu`)"),
                ));
            }
        }
        return Ok(MlpActivation::Silu);
    }
    if get_bool(v, "use_bidirectional_attention", origin)? == Some(true) {
        return Err(bad(
            origin,
            "`use_bidirectional_attention: true` is not supported (megatrain trains causal LMs)",
        ));
    }
    // transformers' Gemma reads `hidden_activation` (default gelu_pytorch_tanh).
    match v.get("hidden_activation").and_then(Value::as_str) {
        None | Some("gelu_pytorch_tanh") => Ok(MlpActivation::GeluTanh),
        Some(other) => Err(bad(
            origin,
            format!("hidden_activation `{other}` is not supported (only `gelu_pytorch_tanh`)"),
        )),
    }
}

/// Gemma 3's RoPE per layer type: the global layers' θ (10⁶ unless set) and scaling, and the
/// local (sliding-window) layers' (θ 10⁴ unless set, default frequencies): transformers 5's
/// `rope_parameters` holding one dict per layer type, or transformers 4's `rope_theta`,
/// `rope_scaling` (the global layers') and `rope_local_base_freq`.
pub(super) fn gemma3_rope(
    v: &Value,
    origin: &str,
) -> Result<((f64, RopeScaling), Option<RopeParams>)> {
    let one = |d: Option<&Value>, default_theta: f64| -> Result<RopeParams> {
        let Some(d) = d.filter(|d| !d.is_null()) else {
            return Ok(RopeParams {
                theta: default_theta,
                scaling: RopeScaling::Default,
            });
        };
        if !d.is_object() {
            return Err(bad(
                origin,
                format!("RoPE parameters {d} are not an object"),
            ));
        }
        Ok(RopeParams {
            theta: get_f64(d, "rope_theta", origin)?.unwrap_or(default_theta),
            scaling: if scaling_kind(d) == "default" {
                RopeScaling::Default
            } else {
                scaling_from(d, v, origin)?
            },
        })
    };
    let (global, local) = match v.get("rope_parameters").filter(|x| !x.is_null()) {
        Some(rp) => {
            let nested =
                rp.get("full_attention").is_some() || rp.get("sliding_attention").is_some();
            if !nested {
                return Err(bad(
                    origin,
                    "Gemma 3's `rope_parameters` must hold `full_attention` and `sliding_attention` dicts",
                ));
            }
            (
                one(rp.get("full_attention"), 1e6)?,
                one(rp.get("sliding_attention"), 1e4)?,
            )
        }
        None => {
            let mut global = one(v.get("rope_scaling"), 1e6)?;
            global.theta = get_f64(v, "rope_theta", origin)?.unwrap_or(1e6);
            let local = RopeParams {
                theta: get_f64(v, "rope_local_base_freq", origin)?.unwrap_or(1e4),
                scaling: RopeScaling::Default,
            };
            (global, local)
        }
    };
    Ok(((global.theta, global.scaling), Some(local)))
}

/// RoPE's θ (10000 unless set) and its scaling. transformers 4 puts `rope_theta` and
/// `rope_scaling` at the top level; transformers 5 nests both in `rope_parameters`. The scalings
/// implemented are read with transformers' defaults (`original_max_position_embeddings` from
/// the top level first, else the dict, else `max_position_embeddings`; yarn's `factor` from the
/// context ratio, `attention_factor` from `factor`, `mscale` and `mscale_all_dim`); any other
/// type, per-layer parameters and partial rotation are refused by name.
pub(super) fn rope(v: &Value, origin: &str) -> Result<(f64, RopeScaling)> {
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
    // transformers reads `rope_scaling or rope_parameters`: the transformers-4 key wins.
    let scaling = [v.get("rope_scaling").filter(|x| !x.is_null()), rope_params]
        .into_iter()
        .flatten()
        .find(|s| scaling_kind(s) != "default");
    let Some(s) = scaling else {
        return Ok((rope_theta, RopeScaling::Default));
    };
    Ok((rope_theta, scaling_from(s, v, origin)?))
}

/// The `rope_type` (or `type`) a RoPE dict names; `default` when it names none.
fn scaling_kind(s: &Value) -> String {
    s.get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default")
        .to_owned()
}

/// The scaling the RoPE dict `s` of config `v` describes (a type other than the default), with
/// transformers' defaults.
fn scaling_from(s: &Value, v: &Value, origin: &str) -> Result<RopeScaling> {
    let kind = scaling_kind;
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
    Ok(scaling)
}

/// The sliding window and the layers it applies to, as transformers reads them: Mistral's
/// `sliding_window` on every layer (4096 when the key is absent, none when it is null;
/// `layer_types` ignored); Qwen2's and Qwen3's only under `use_sliding_window` (the same
/// default), on the layers `layer_types` names `sliding_attention` (else those from
/// `max_window_layers` on, 28 unless set); Ministral's on the layers `layer_types` names (else
/// every layer); Gemma 3's on the layers `layer_types` names (else
/// all but every `sliding_window_pattern`-th), every layer's type returned even without a
/// window (they choose the RoPE); Llama's `layer_types` must be all `full_attention`.
/// Empty layers: every layer.
pub(super) fn sliding_window(
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
    match arch {
        Architecture::Mistral => return Ok((size()?, Vec::new())),
        // transformers' Mixtral has no window unless set.
        Architecture::Mixtral if v.get("sliding_window").is_none() => {
            return Ok((None, Vec::new()))
        }
        Architecture::Mixtral => return Ok((size()?, Vec::new())),
        // Qwen3-MoE: every layer windowed under `use_sliding_window` (no `layer_types`).
        Architecture::Qwen3Moe => {
            return match get_bool(v, "use_sliding_window", origin)? {
                Some(true) => Ok((size()?, Vec::new())),
                _ => Ok((None, Vec::new())),
            }
        }
        _ => {}
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
        Architecture::Gemma2 | Architecture::Gemma3 => {
            // Every layer's type, also without a window: Gemma 3's local layers keep their own
            // RoPE.
            let windowed = match types {
                Some(t) => t,
                None => {
                    // transformers: Gemma 2 alternates (every second layer global); Gemma 3
                    // reads `sliding_window_pattern` (6 unless set): every sixth layer global.
                    let pattern = match arch {
                        Architecture::Gemma2 => 2,
                        _ => get_usize(v, "sliding_window_pattern", origin)?.unwrap_or(6),
                    };
                    if pattern == 0 {
                        return Err(bad(origin, "`sliding_window_pattern` is 0"));
                    }
                    (0..layers).map(|i| (i + 1) % pattern != 0).collect()
                }
            };
            Ok((size()?, windowed))
        }
        Architecture::Ministral | Architecture::GptOss => {
            // transformers: `layer_types`, else every layer sliding when there is a window.
            let Some(w) = size()? else {
                if types.is_some_and(|t| t.contains(&true)) {
                    return Err(bad(
                        origin,
                        "`layer_types` names sliding_attention layers but `sliding_window` is null",
                    ));
                }
                return Ok((None, Vec::new()));
            };
            Ok((Some(w), types.unwrap_or_default()))
        }
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
pub(super) fn attention_heads(
    v: &Value,
    hidden_size: usize,
    origin: &str,
) -> Result<(usize, usize, usize)> {
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

/// `pad_token_id` as `nn.Embedding` takes it: absent or null none, negative counted from the
/// vocabulary's end; an id outside the vocabulary pads nothing.
pub(super) fn pad_token_id(v: &Value, vocab: usize, origin: &str) -> Result<Option<u32>> {
    let id = match v.get("pad_token_id") {
        None | Some(Value::Null) => return Ok(None),
        Some(x) => x.as_i64().ok_or_else(|| {
            bad(
                origin,
                format!("`pad_token_id` must be an integer, found {x}"),
            )
        })?,
    };
    let id = if id < 0 { vocab as i64 + id } else { id };
    Ok(u32::try_from(id).ok().filter(|&i| (i as usize) < vocab))
}

pub(super) fn bad(origin: &str, reason: impl Into<String>) -> Error {
    Error::bad_input("model config", origin, reason, None)
}

pub(super) fn get_usize(v: &Value, key: &str, origin: &str) -> Result<Option<usize>> {
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

pub(super) fn need_usize(v: &Value, key: &str, origin: &str) -> Result<usize> {
    get_usize(v, key, origin)?.ok_or_else(|| bad(origin, format!("`{key}` is missing")))
}

pub(super) fn get_f64(v: &Value, key: &str, origin: &str) -> Result<Option<f64>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_f64()
            .map(Some)
            .ok_or_else(|| bad(origin, format!("`{key}` must be a number, found {x}"))),
    }
}

pub(super) fn get_bool(v: &Value, key: &str, origin: &str) -> Result<Option<bool>> {
    match v.get(key) {
        None | Some(Value::Null) => Ok(None),
        Some(x) => x
            .as_bool()
            .map(Some)
            .ok_or_else(|| bad(origin, format!("`{key}` must be true or false, found {x}"))),
    }
}
