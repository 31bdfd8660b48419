//! `ModelConfig` from config.json: the spellings, the limits, RoPE scaling, round trips.

use super::*;

const LLAMA3_8B: &str = r#"{
  "architectures": ["LlamaForCausalLM"], "attention_bias": false, "bos_token_id": 128000,
  "hidden_act": "silu", "hidden_size": 4096, "intermediate_size": 14336,
  "max_position_embeddings": 8192, "model_type": "llama", "num_attention_heads": 32,
  "num_hidden_layers": 32, "num_key_value_heads": 8, "rms_norm_eps": 1e-05,
  "rope_scaling": null, "rope_theta": 500000.0, "tie_word_embeddings": false,
  "torch_dtype": "bfloat16", "vocab_size": 128256
}"#;

#[test]
fn llama3_8b_counts_8_03b_params() {
    let c = ModelConfig::from_json_str(LLAMA3_8B, "llama3").unwrap();
    assert_eq!(c.num_params(), 8_030_261_248);
    assert_eq!(c.head_dim, 128);
    assert_eq!(c.rope_theta, 500000.0);
}

#[test]
fn transformers5_spelling() {
    let t5 = LLAMA3_8B
        .replace(
            "\"rope_theta\": 500000.0,",
            "\"rope_parameters\": {\"rope_type\": \"default\", \"rope_theta\": 250000.0},",
        )
        .replace("torch_dtype", "dtype");
    let c = ModelConfig::from_json_str(&t5, "t5").unwrap();
    assert_eq!(c.rope_theta, 250000.0);
}

#[test]
fn qwen2_has_qkv_bias_and_unsupported_things_are_named() {
    let q = r#"{"architectures":["Qwen2ForCausalLM"],"hidden_size":64,"intermediate_size":128,
        "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":100,
        "tie_word_embeddings":true}"#;
    let c = ModelConfig::from_json_str(q, "q").unwrap();
    assert!(c.qkv_bias && !c.o_bias && c.tie_word_embeddings);
    let e = ModelConfig::from_json_str(&q.replace("Qwen2ForCausalLM", "GPT2LMHeadModel"), "g")
        .unwrap_err();
    assert!(e.to_string().contains("GPT2LMHeadModel"), "{e}");
    let e =
        ModelConfig::from_json_str("{\"architectures\":[\"LlamaForCausalLM\"]}", "x").unwrap_err();
    assert!(e.to_string().contains("hidden_size"), "{e}");
}

/// Llama 3.1's config.json as published (transformers 4 spelling), Llama 3.2's in
/// transformers 5's, Qwen2.5's YaRN; what is not implemented is named.
#[test]
fn rope_scalings_are_read_round_trip_and_the_rest_is_named() {
    let l31 = LLAMA3_8B.replace(
        "\"rope_scaling\": null",
        r#""rope_scaling": {"factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
           "original_max_position_embeddings": 8192, "rope_type": "llama3"}"#,
    );
    let c = ModelConfig::from_json_str(&l31, "l31").unwrap();
    assert_eq!(
        c.rope_scaling,
        RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192
        }
    );
    let l32 = LLAMA3_8B.replace("\"rope_theta\": 500000.0,", "").replace(
        "\"rope_scaling\": null",
        r#""rope_parameters": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 32.0,
           "low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}"#,
    );
    let c2 = ModelConfig::from_json_str(&l32, "l32").unwrap();
    assert_eq!(c2.rope_theta, 500000.0);
    assert!(matches!(c2.rope_scaling, RopeScaling::Llama3 { factor, .. } if factor == 32.0));
    let yarn = LLAMA3_8B.replace(
        "\"rope_scaling\": null",
        r#""rope_scaling": {"type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32768}"#,
    );
    let y = ModelConfig::from_json_str(&yarn, "yarn").unwrap();
    match y.rope_scaling {
        RopeScaling::Yarn {
            attention_factor,
            beta_fast,
            beta_slow,
            truncate,
            ..
        } => {
            assert!((attention_factor - (0.1 * 4f64.ln() + 1.0)).abs() < 1e-12);
            assert_eq!((beta_fast, beta_slow, truncate), (32.0, 1.0, true));
        }
        other => panic!("{other:?}"),
    }
    // The export says the same, and reads back equal (checkpoints before the field too).
    for c in [&c, &c2, &y] {
        let back = ModelConfig::from_json_str(&c.to_hf_json(), "back").unwrap();
        assert_eq!(&back, c);
    }
    let mut old: serde_json::Value =
        serde_json::to_value(ModelConfig::from_json_str(LLAMA3_8B, "l").unwrap()).unwrap();
    old.as_object_mut().unwrap().remove("rope_scaling");
    let old: ModelConfig = serde_json::from_value(old).unwrap();
    assert_eq!(old.rope_scaling, RopeScaling::Default);
    for (scaling, needle) in [
        (r#"{"rope_type": "dynamic", "factor": 2.0}"#, "dynamic"),
        (r#"{"rope_type": "longrope", "factor": 2.0}"#, "longrope"),
        (
            r#"{"rope_type": "llama3", "factor": 8.0}"#,
            "low_freq_factor",
        ),
        (r#"{"rope_type": "linear"}"#, "factor"),
        (r#"{"rope_type": "linear", "factor": -2}"#, "positive"),
        (
            r#"{"rope_type": "yarn", "factor": 4.0, "truncate": "yes"}"#,
            "truncate",
        ),
    ] {
        let e = ModelConfig::from_json_str(
            &LLAMA3_8B.replace(
                "\"rope_scaling\": null",
                &format!("\"rope_scaling\": {scaling}"),
            ),
            "x",
        )
        .unwrap_err()
        .to_string();
        assert!(e.contains(needle), "{scaling}: {e}");
    }
    let e = ModelConfig::from_json_str(
        &LLAMA3_8B.replace("\"rope_scaling\": null", "\"partial_rotary_factor\": 0.5"),
        "x",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("partial_rotary_factor"), "{e}");
    let e = ModelConfig::from_json_str(
        &LLAMA3_8B.replace(
            "\"rope_scaling\": null",
            r#""rope_parameters": {"full_attention": {"rope_type": "default"}, "sliding_attention": {"rope_type": "default"}}"#,
        ),
        "x",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("per layer type"), "{e}");
}

#[test]
fn hf_json_round_trips() {
    let c = ModelConfig::from_json_str(LLAMA3_8B, "l").unwrap();
    let back = ModelConfig::from_json_str(&c.to_hf_json(), "back").unwrap();
    assert_eq!(back, c);
}

/// Qwen3-8B's config.json as published: QK-norm, heads of 128 whatever the width, all layers
/// full attention; sliding windows per layer as transformers reads them; what is not
/// implemented is named; the export is read back the same.
#[test]
fn qwen3_8b_has_qk_norm_and_counts_8_19b_params() {
    let q3 = r#"{"architectures": ["Qwen3ForCausalLM"], "attention_bias": false,
      "attention_dropout": 0.0, "bos_token_id": 151643, "eos_token_id": 151645, "head_dim": 128,
      "hidden_act": "silu", "hidden_size": 4096, "initializer_range": 0.02,
      "intermediate_size": 12288, "max_position_embeddings": 40960, "max_window_layers": 36,
      "model_type": "qwen3", "num_attention_heads": 32, "num_hidden_layers": 36,
      "num_key_value_heads": 8, "rms_norm_eps": 1e-06, "rope_scaling": null,
      "rope_theta": 1000000, "sliding_window": null, "tie_word_embeddings": false,
      "torch_dtype": "bfloat16", "use_cache": true, "use_sliding_window": false,
      "vocab_size": 151936}"#;
    let c = ModelConfig::from_json_str(q3, "q3").unwrap();
    assert!(c.qk_norm && !c.qkv_bias && !c.o_bias && c.sliding_window.is_none());
    assert_eq!(c.architecture, Architecture::Qwen3);
    assert_eq!((c.head_dim, c.q_dim()), (128, 4096));
    // The bf16 safetensors index's total_size (16 381 470 720 bytes) / 2.
    assert_eq!(c.num_params(), 8_190_735_360);
    assert!(c.features().iter().any(|f| f == "QK-norm"));
    let back = ModelConfig::from_json_str(&c.to_hf_json(), "export").unwrap();
    assert_eq!(back, c);
    // Llama-family configs have no QK-norm.
    assert!(!ModelConfig::from_json_str(LLAMA3_8B, "l").unwrap().qk_norm);
    for (from, to, named) in [
        (
            "\"max_window_layers\": 36,",
            "\"layer_types\": \"full_attention\",",
            "not a list",
        ),
        (
            "\"max_window_layers\": 36,",
            "\"layer_types\": [\"full_attention\"],",
            "1 entries for 36 layers",
        ),
        (
            "\"max_window_layers\": 36,",
            "\"layer_types\": [\"chunked_attention\"],",
            "chunked_attention",
        ),
    ] {
        let e = ModelConfig::from_json_str(&q3.replace(from, to), "q3").unwrap_err();
        assert!(e.to_string().contains(named), "{e}");
    }
    // transformers: `use_sliding_window` with `max_window_layers` 30 windows layers 30..36
    // (4096 tokens unless `sliding_window` says otherwise); without it, sliding_attention
    // layers attend to everything.
    let windowed = q3
        .replace(
            "\"use_sliding_window\": false",
            "\"use_sliding_window\": true",
        )
        .replace("\"max_window_layers\": 36", "\"max_window_layers\": 30")
        .replace("\"sliding_window\": null,", "");
    let c = ModelConfig::from_json_str(&windowed, "q3").unwrap();
    assert_eq!(c.sliding_window, Some(4096));
    assert_eq!(
        (0..36).map(|i| c.layer_window(i)).collect::<Vec<_>>(),
        (0..36)
            .map(|i| (i >= 30).then_some(4096))
            .collect::<Vec<_>>()
    );
    assert!(c
        .features()
        .contains(&"sliding window 4096 on 6 of 36 layers".to_owned()));
    assert_eq!(
        ModelConfig::from_json_str(&c.to_hf_json(), "export").unwrap(),
        c
    );
    let types: String = (0..36)
        .map(|i| {
            if i % 2 == 1 {
                "\"sliding_attention\""
            } else {
                "\"full_attention\""
            }
        })
        .collect::<Vec<_>>()
        .join(",");
    let listed = q3.replace(
        "\"max_window_layers\": 36,",
        &format!("\"layer_types\": [{types}],"),
    );
    assert_eq!(
        ModelConfig::from_json_str(&listed, "q3")
            .unwrap()
            .sliding_window,
        None
    );
    let c = ModelConfig::from_json_str(
        &listed
            .replace(
                "\"use_sliding_window\": false",
                "\"use_sliding_window\": true",
            )
            .replace("\"sliding_window\": null,", "\"sliding_window\": 4096,"),
        "q3",
    )
    .unwrap();
    assert_eq!((c.layer_window(0), c.layer_window(1)), (None, Some(4096)));
    assert_eq!(
        ModelConfig::from_json_str(&c.to_hf_json(), "export").unwrap(),
        c
    );
    // An explicit null is no window, whatever the layers say (transformers).
    let null = windowed.replace(
        "\"rope_scaling\": null,",
        "\"rope_scaling\": null, \"sliding_window\": null,",
    );
    assert_eq!(
        ModelConfig::from_json_str(&null, "q3")
            .unwrap()
            .sliding_window,
        None
    );
    // Mistral windows every layer (4096 when the key is absent, none when null; its
    // `layer_types` ignored); a window of 0 is refused; Llama has no sliding layers.
    let absent = LLAMA3_8B.replace("LlamaForCausalLM", "MistralForCausalLM");
    assert_eq!(
        ModelConfig::from_json_str(&absent, "m")
            .unwrap()
            .sliding_window,
        Some(4096)
    );
    let null = absent.replace(
        "\"rope_scaling\": null,",
        "\"sliding_window\": null, \"layer_types\": 7,",
    );
    assert_eq!(
        ModelConfig::from_json_str(&null, "m")
            .unwrap()
            .sliding_window,
        None
    );
    let m = LLAMA3_8B
        .replace("LlamaForCausalLM", "MistralForCausalLM")
        .replace("\"rope_scaling\": null,", "\"sliding_window\": 4096,");
    let c = ModelConfig::from_json_str(&m, "m").unwrap();
    assert!((0..32).all(|i| c.layer_window(i) == Some(4096)));
    let e = ModelConfig::from_json_str(&m.replace("4096,", "0,"), "m").unwrap_err();
    assert!(e.to_string().contains("sliding_window"), "{e}");
    let llama_types = ["\"sliding_attention\""; 32].join(",");
    let e = ModelConfig::from_json_str(
        &LLAMA3_8B.replace(
            "\"rope_scaling\": null,",
            &format!("\"layer_types\": [{llama_types}],"),
        ),
        "l",
    )
    .unwrap_err();
    assert!(e.to_string().contains("sliding_attention"), "{e}");
}

/// gemma-3-27b-it's `config.json` as published (transformers 4.50: a multimodal model whose
/// text model leaves most keys to `Gemma3TextConfig`'s defaults).
const GEMMA3_27B: &str = r#"{
  "architectures": ["Gemma3ForConditionalGeneration"], "boi_token_index": 255999,
  "eoi_token_index": 256000, "eos_token_id": [1, 106], "image_token_index": 262144,
  "initializer_range": 0.02, "mm_tokens_per_image": 256, "model_type": "gemma3",
  "text_config": {
    "head_dim": 128, "hidden_size": 5376, "intermediate_size": 21504, "model_type": "gemma3_text",
    "num_attention_heads": 32, "num_hidden_layers": 62, "num_key_value_heads": 16,
    "query_pre_attn_scalar": 168, "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
    "sliding_window": 1024
  },
  "torch_dtype": "bfloat16", "transformers_version": "4.50.0.dev0",
  "vision_config": {"hidden_size": 1152, "image_size": 896, "intermediate_size": 4304,
    "model_type": "siglip_vision_model", "num_attention_heads": 16, "num_hidden_layers": 27,
    "patch_size": 14, "vision_use_head": false}
}"#;

#[test]
fn gemma3_27b_reads_its_text_model_with_transformers_defaults() {
    let c = ModelConfig::from_json_str(GEMMA3_27B, "gemma-3-27b-it").unwrap();
    assert_eq!(c.architecture, Architecture::Gemma3);
    assert_eq!(
        (c.vocab_size, c.hidden_size, c.num_layers, c.head_dim),
        (262_208, 5376, 62, 128)
    );
    assert!(c.tie_word_embeddings && c.qk_norm && c.sandwich_norms && c.scale_embeddings);
    assert_eq!(c.norm_weight, NormWeight::OnePlus);
    assert_eq!(c.mlp_activation, MlpActivation::GeluTanh);
    assert_eq!(c.query_pre_attn_scalar, Some(168.0));
    assert_eq!(c.pad_token_id, Some(0));
    // Global layers: θ 10⁶, linear ÷8; local: θ 10⁴, default; every sixth layer global.
    assert_eq!(
        (c.rope_theta, &c.rope_scaling),
        (1e6, &RopeScaling::Linear { factor: 8.0 })
    );
    let local = c.local_rope.clone().unwrap();
    assert_eq!((local.theta, local.scaling), (1e4, RopeScaling::Default));
    assert_eq!(c.sliding_window, Some(1024));
    let global: Vec<usize> = (0..62).filter(|&i| c.layer_window(i).is_none()).collect();
    assert_eq!(global, vec![5, 11, 17, 23, 29, 35, 41, 47, 53, 59]);
    assert_eq!(c.layer_rope(5), 0);
    assert_eq!(c.layer_rope(4), 1);
    // The text model: 27.01 B parameters (the release's 27.4 B adds the 0.4 B SigLIP vision
    // tower, which is not trained).
    assert_eq!(c.num_params(), 27_009_346_304);
    // Exported as the text model transformers loads, in its 5 spelling; read back equal.
    let back = ModelConfig::from_json_str(&c.to_hf_json(), "back").unwrap();
    assert_eq!(back, c);
    let v: serde_json::Value = serde_json::from_str(&c.to_hf_json()).unwrap();
    assert_eq!(v["architectures"][0], "Gemma3ForCausalLM");
    assert_eq!(v["rope_parameters"]["sliding_attention"]["rope_theta"], 1e4);
    assert_eq!(
        v["rope_parameters"]["full_attention"]["rope_type"],
        "linear"
    );
    // transformers 4's spelling of the local θ.
    let t4 = GEMMA3_27B.replace(
        "\"sliding_window\": 1024",
        "\"sliding_window\": 1024, \"rope_local_base_freq\": 5000.0, \"rope_theta\": 2e6",
    );
    let c4 = ModelConfig::from_json_str(&t4, "t4").unwrap();
    assert_eq!((c4.rope_theta, c4.local_rope.unwrap().theta), (2e6, 5000.0));
}

#[test]
fn gemma3_features_it_lacks_are_named() {
    let text = r#"{"architectures": ["Gemma3ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "head_dim": 16, "vocab_size": 100, "sliding_window_pattern": 2 XX}"#;
    let c = ModelConfig::from_json_str(&text.replace(" XX", ""), "g").unwrap();
    assert_eq!(c.windowed_layers, vec![true, false]);
    assert_eq!(c.query_pre_attn_scalar, Some(256.0));
    for (extra, needle) in [
        (", \"attn_logit_softcapping\": 0", "attn_logit_softcapping"),
        (", \"use_bidirectional_attention\": true", "bidirectional"),
        (", \"hidden_activation\": \"relu\"", "relu"),
        (", \"layer_types\": [\"full_attention\"]", "layer_types"),
        (
            ", \"rope_parameters\": {\"rope_theta\": 1e4}",
            "full_attention",
        ),
    ] {
        let e = ModelConfig::from_json_str(&text.replace(" XX", extra), "g")
            .unwrap_err()
            .to_string();
        assert!(e.contains(needle), "{extra}: {e}");
    }
    let e = ModelConfig::from_json_str(
        r#"{"architectures": ["Gemma3ForConditionalGeneration"]}"#,
        "m",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("text_config"), "{e}");
}

#[test]
fn pad_token_id_is_read_as_nn_embedding_takes_it() {
    for (pad, want) in [
        ("null", None),
        ("7", Some(7)),
        ("-1", Some(128_255)),
        ("200000", None),
    ] {
        let j = LLAMA3_8B.replace(
            "\"rope_scaling\": null",
            &format!("\"rope_scaling\": null, \"pad_token_id\": {pad}"),
        );
        assert_eq!(
            ModelConfig::from_json_str(&j, "p").unwrap().pad_token_id,
            want,
            "{pad}"
        );
    }
}

/// gemma-2-9b's `config.json` as published (transformers 4.42).
const GEMMA2_9B: &str = r#"{
  "architectures": ["Gemma2ForCausalLM"], "attention_bias": false, "attention_dropout": 0.0,
  "attn_logit_softcapping": 50.0, "bos_token_id": 2, "cache_implementation": "hybrid",
  "eos_token_id": 1, "final_logit_softcapping": 30.0, "head_dim": 256,
  "hidden_act": "gelu_pytorch_tanh", "hidden_activation": "gelu_pytorch_tanh",
  "hidden_size": 3584, "initializer_range": 0.02, "intermediate_size": 14336,
  "max_position_embeddings": 8192, "model_type": "gemma2", "num_attention_heads": 16,
  "num_hidden_layers": 42, "num_key_value_heads": 8, "pad_token_id": 0,
  "query_pre_attn_scalar": 256, "rms_norm_eps": 1e-06, "rope_theta": 10000.0,
  "sliding_window": 4096, "sliding_window_size": 4096, "torch_dtype": "float32",
  "transformers_version": "4.42.0.dev0", "use_cache": true, "vocab_size": 256000
}"#;

#[test]
fn gemma2_9b_counts_its_published_9_24b_params_and_soft_caps() {
    let c = ModelConfig::from_json_str(GEMMA2_9B, "gemma-2-9b").unwrap();
    assert_eq!(c.architecture, Architecture::Gemma2);
    assert_eq!(c.num_params(), 9_241_705_984);
    assert_eq!(
        (c.attn_logit_softcapping, c.final_logit_softcapping),
        (Some(50.0), Some(30.0))
    );
    assert!(!c.qk_norm && c.sandwich_norms && c.local_rope.is_none());
    // Layers alternate, the first local.
    assert_eq!(c.layer_window(0), Some(4096));
    assert_eq!(c.layer_window(1), None);
    let back = ModelConfig::from_json_str(&c.to_hf_json(), "back").unwrap();
    assert_eq!(back, c);
    // Absent caps are transformers' defaults (50 and 30); null turns one off; a bad one is named.
    let absent = GEMMA2_9B
        .replace("\"attn_logit_softcapping\": 50.0,", "")
        .replace(
            "\"final_logit_softcapping\": 30.0,",
            "\"final_logit_softcapping\": null,",
        );
    let a = ModelConfig::from_json_str(&absent, "a").unwrap();
    assert_eq!(
        (a.attn_logit_softcapping, a.final_logit_softcapping),
        (Some(50.0), None)
    );
    let e = ModelConfig::from_json_str(
        &GEMMA2_9B.replace(
            "\"attn_logit_softcapping\": 50.0",
            "\"attn_logit_softcapping\": -1",
        ),
        "n",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("attn_logit_softcapping"), "{e}");
    // Llama has no soft caps: named.
    let e = ModelConfig::from_json_str(
        &LLAMA3_8B.replace(
            "\"rope_scaling\": null",
            "\"final_logit_softcapping\": 30.0",
        ),
        "l",
    )
    .unwrap_err()
    .to_string();
    assert!(e.contains("final_logit_softcapping"), "{e}");
}

#[test]
fn ministral_windows_follow_layer_types() {
    let base = r#"{"architectures": ["MinistralForCausalLM"], "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 3, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 100 XX}"#;
    let c = ModelConfig::from_json_str(&base.replace(" XX", ""), "m").unwrap();
    // No key: transformers' 4096 on every layer.
    assert_eq!(
        (0..3).map(|i| c.layer_window(i)).collect::<Vec<_>>(),
        vec![Some(4096); 3]
    );
    let typed = base.replace(
        " XX",
        r#", "sliding_window": 32, "layer_types": ["full_attention", "sliding_attention", "full_attention"]"#,
    );
    let c = ModelConfig::from_json_str(&typed, "m").unwrap();
    assert_eq!(
        (0..3).map(|i| c.layer_window(i)).collect::<Vec<_>>(),
        vec![None, Some(32), None]
    );
    assert_eq!(
        ModelConfig::from_json_str(&c.to_hf_json(), "back").unwrap(),
        c
    );
    let none = ModelConfig::from_json_str(&base.replace(" XX", r#", "sliding_window": null"#), "m")
        .unwrap();
    assert_eq!(none.layer_window(0), None);
}
