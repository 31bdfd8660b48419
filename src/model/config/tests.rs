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
