//! The embedded default job's corpus: this repository's own documentation and source, compiled
//! into the binary (text we wrote, free to ship), read as bytes (vocabulary 256).

/// The corpus files, in a fixed order.
pub const FILES: &[(&str, &str)] = &[
    ("README.md", include_str!("../../README.md")),
    (
        "docs/ARCHITECTURE.md",
        include_str!("../../docs/ARCHITECTURE.md"),
    ),
    (
        "docs/probe-schema.md",
        include_str!("../../docs/probe-schema.md"),
    ),
    ("src/error.rs", include_str!("../error.rs")),
    ("src/util/mod.rs", include_str!("../util/mod.rs")),
    ("src/topology/mod.rs", include_str!("../topology/mod.rs")),
    (
        "src/topology/hwloc.rs",
        include_str!("../topology/hwloc.rs"),
    ),
    (
        "src/topology/links.rs",
        include_str!("../topology/links.rs"),
    ),
    (
        "src/topology/linux.rs",
        include_str!("../topology/linux.rs"),
    ),
    (
        "src/topology/render.rs",
        include_str!("../topology/render.rs"),
    ),
    ("src/host/region.rs", include_str!("../host/region.rs")),
    ("src/store/layout.rs", include_str!("../store/layout.rs")),
    (
        "src/store/placement/mod.rs",
        include_str!("../store/placement/mod.rs"),
    ),
    ("src/store/mod.rs", include_str!("../store/mod.rs")),
    ("src/optim/adamw.rs", include_str!("../optim/adamw.rs")),
    ("src/optim/pool.rs", include_str!("../optim/pool.rs")),
    ("src/model/config.rs", include_str!("../model/config.rs")),
    ("src/model/ops/mod.rs", include_str!("../model/ops/mod.rs")),
    ("src/model/layers.rs", include_str!("../model/layers.rs")),
    ("src/store/hf.rs", include_str!("../store/hf.rs")),
    ("src/device/mod.rs", include_str!("../device/mod.rs")),
    ("src/device/cpu.rs", include_str!("../device/cpu.rs")),
    (
        "src/engine/schedule/mod.rs",
        include_str!("../engine/schedule/mod.rs"),
    ),
    (
        "src/engine/streamer.rs",
        include_str!("../engine/streamer.rs"),
    ),
];

/// The corpus as byte tokens.
pub fn bytes() -> Vec<u8> {
    let mut v = Vec::new();
    for (_, text) in FILES {
        v.extend_from_slice(text.as_bytes());
        v.push(b'\n');
    }
    v
}

/// The default model: a small Llama with a byte vocabulary (about 3.3M parameters).
pub const MODEL_JSON: &str = r#"{
  "architectures": ["LlamaForCausalLM"],
  "model_type": "llama",
  "vocab_size": 256,
  "hidden_size": 256,
  "intermediate_size": 688,
  "num_hidden_layers": 4,
  "num_attention_heads": 8,
  "num_key_value_heads": 4,
  "max_position_embeddings": 1024,
  "rms_norm_eps": 1e-5,
  "rope_theta": 10000.0,
  "tie_word_embeddings": true,
  "hidden_act": "silu"
}"#;

/// What [`demo`] wrote.
#[derive(Debug, Clone)]
pub struct Demo {
    /// The configuration of the embedded default job.
    pub config: super::config::TrainConfig,
    /// Its directory (`dir/demo`).
    pub dir: std::path::PathBuf,
    /// Corpus bytes: for training, for validation.
    pub split: (usize, usize),
}

/// Prepare the embedded default job in `dir/demo` and return its configuration: the corpus as
/// byte tokens (95% train, 5% validation), the model's config.json, and where the checkpoints,
/// metrics and export go. The files are rewritten (identically) each time, so `--demo --resume`
/// continues a demo run.
pub fn demo(dir: &std::path::Path) -> crate::Result<Demo> {
    use super::config::{LrSchedule, TrainConfig};
    let run = dir.join("demo");
    let data = run.join("data");
    std::fs::create_dir_all(&data).map_err(|e| crate::Error::io("create directory", &data, e))?;
    let bytes = bytes();
    let split = bytes.len() * 95 / 100;
    let tokens = |b: &[u8]| {
        b.iter()
            .flat_map(|&x| u16::from(x).to_le_bytes())
            .collect::<Vec<u8>>()
    };
    crate::util::write_atomic(&data.join("train.bin"), &tokens(&bytes[..split]))?;
    crate::util::write_atomic(&data.join("val.bin"), &tokens(&bytes[split..]))?;
    crate::util::write_atomic(&run.join("model.json"), MODEL_JSON.as_bytes())?;
    let config = TrainConfig {
        model: Some(run.join("model.json")),
        data: Some(data.join("train.bin")),
        val_data: Some(data.join("val.bin")),
        seq_len: 128,
        batch_size: 8,
        steps: 600,
        lr: 2e-3,
        lr_schedule: LrSchedule::Cosine,
        warmup_steps: 20,
        weight_decay: 0.1,
        grad_clip: 1.0,
        shuffle: true,
        metrics: Some(run.join("metrics.jsonl")),
        checkpoint_dir: Some(run.join("checkpoints")),
        checkpoint_every: 200,
        export_hf: Some(run.join("hf")),
        val_every: 100,
        val_batches: 8,
        tokenizer: Some("bytes".into()),
        ..TrainConfig::default()
    };
    Ok(Demo {
        config,
        dir: run,
        split: (split, bytes.len() - split),
    })
}
