//! Machine and model presets for `megatrain plan`. Machine figures are datasheet peaks for the
//! GPU and, for links and memory, measurements published by others where we know of them; each
//! preset names its sources. They are inputs to a prediction, not our measurements.

use super::Hardware;
use crate::model::config::{Architecture, ModelConfig};
use crate::model::ops::RopeScaling;

const GB: u64 = 1_000_000_000;
const GIB: u64 = 1 << 30;

/// A machine preset by name.
pub fn machine(name: &str) -> Option<Hardware> {
    let h = |name: &str,
             gpu: &str,
             mem: u64,
             fp32: f64,
             bf16: f64,
             htod: f64,
             dtoh: f64,
             ram: u64,
             adam: f64,
             gpus: u64,
             nic: Option<f64>,
             nvlink: Option<f64>,
             src: &str| Hardware {
        name: name.into(),
        gpu: gpu.into(),
        gpu_memory_bytes: mem,
        fp32_tflops: fp32,
        bf16_tflops: bf16,
        htod_gbps: htod,
        dtoh_gbps: dtoh,
        host_ram_bytes: ram,
        adam_gbps: adam,
        nvme_gbps: None,
        sources: src.into(),
        measured_bf16: None,
        measured_fp32: None,
        gpus,
        host_sum_gbps: super::ASSUMED_HOST_SUM_GBPS,
        nic_gbps: nic,
        nvlink_gbps: nvlink,
    };
    Some(match name {
        "h200-1.5tb" => h(
            name,
            "H200 SXM 141GB",
            141 * GB,
            67.0,
            989.0,
            55.0,
            55.0,
            1536 * GIB,
            400.0,
            8,
            Some(400.0),
            Some(350.0),
            "GPU: NVIDIA H200 datasheet (dense fp32 67 TF, bf16 989 TF); link: ~55 GB/s pinned H2D on PCIe5 H100/H200 hosts (nvbandwidth, DESIGN.md §1); host: 2-socket DDR5, AdamW assumed 0.9 × ~450 GB/s triad; 8 GPUs and 8 × 400 Gb/s NICs (400 GB/s per direction) as in NVIDIA's HGX H200 reference design; NCCL over NVLink 4 (900 GB/s per GPU) assumed 350 GB/s bus",
        ),
        "gh200-480gb" => h(
            name,
            "GH200 (H100 96GB)",
            96 * GB,
            67.0,
            989.0,
            340.0,
            300.0,
            480 * GB,
            350.0,
            1,
            Some(50.0),
            None,
            "GPU: NVIDIA GH200 datasheet; link: NVLink-C2C ~340 GB/s H2D measured (nvbandwidth reports, DESIGN.md §1), D2H assumed 300; host: Grace LPDDR5X 480 GB, AdamW assumed 0.9 × ~390 GB/s triad; one GH200 per machine with one 400 Gb/s NIC (50 GB/s), assumed",
        ),
        "h100-512gb" => h(
            name,
            "H100 SXM 80GB",
            80 * GB,
            67.0,
            989.0,
            55.0,
            55.0,
            512 * GIB,
            200.0,
            4,
            Some(100.0),
            Some(350.0),
            "GPU: NVIDIA H100 SXM datasheet; link: ~55 GB/s PCIe5 (nvbandwidth); host: 1-socket DDR5 512 GB, AdamW assumed 0.9 × ~220 GB/s triad; 4 GPUs and 2 × 400 Gb/s NICs (100 GB/s), assumed; NCCL over NVLink 4 assumed 350 GB/s bus",
        ),
        "rtx4090-256gb" => h(
            name,
            "GeForce RTX 4090 24GB",
            24 * GB,
            82.6,
            165.2,
            25.0,
            25.0,
            256 * GIB,
            70.0,
            2,
            None,
            None,
            "GPU: NVIDIA Ada whitepaper (fp32 82.6 TF, bf16 with fp32 accumulate 165 TF dense); link: PCIe4 x16 ~25 GB/s; host: workstation DDR5 256 GB, AdamW assumed 0.9 × ~80 GB/s; 2 GPUs and no network between machines, assumed",
        ),
        _ => return None,
    })
}

/// Machine preset names.
pub const MACHINES: [&str; 4] = ["h200-1.5tb", "gh200-480gb", "h100-512gb", "rtx4090-256gb"];

/// A GPU's dense datasheet peaks (no sparsity), TFLOP/s: what a run's MFU is measured against.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct PeakTflops {
    /// FP32 on the CUDA cores.
    pub fp32: f64,
    /// TF32 tensor cores (fp32 GEMMs with `--tf32`).
    pub tf32: f64,
    /// BF16 tensor cores with fp32 accumulation.
    pub bf16: f64,
}

/// The datasheet peaks of the GPU a device name contains (`cuda:NVIDIA H100 80GB HBM3 (sm_90)`),
/// where the GPU is one we know; NVIDIA's datasheets for each.
pub fn datasheet_peak(device_name: &str) -> Option<PeakTflops> {
    let p = |fp32, tf32, bf16| PeakTflops { fp32, tf32, bf16 };
    // Most specific first: "GH200" contains "H200", "H100 PCIe" contains "H100".
    let table = [
        ("GH200", p(67.0, 494.0, 989.0)),
        ("H200 NVL", p(60.0, 418.0, 835.0)),
        ("H200", p(67.0, 494.0, 989.0)),
        ("H100 PCIe", p(51.0, 378.0, 756.0)),
        ("H100 NVL", p(60.0, 418.0, 835.0)),
        ("H100", p(67.0, 494.0, 989.0)),
        ("A100", p(19.5, 156.0, 312.0)),
        ("L40S", p(91.6, 183.0, 362.0)),
        ("RTX 4090", p(82.6, 82.6, 165.2)),
    ];
    table
        .into_iter()
        .find(|(name, _)| device_name.contains(name))
        .map(|(_, peak)| peak)
}

/// A Llama-style dense model ([`ModelConfig::dense`]).
#[allow(clippy::too_many_arguments)]
fn llama_like(
    arch: Architecture,
    v: usize,
    h: usize,
    i: usize,
    l: usize,
    nh: usize,
    nkv: usize,
    tied: bool,
    theta: f64,
) -> ModelConfig {
    ModelConfig {
        max_position_embeddings: 131072,
        ..ModelConfig::dense(arch, v, (h, i, l), (nh, nkv), tied, theta)
    }
}

/// `m` with Llama 3.1's RoPE scaling (its config.json's `rope_scaling`).
fn llama31(m: ModelConfig) -> ModelConfig {
    ModelConfig {
        rope_scaling: RopeScaling::Llama3 {
            factor: 8.0,
            low_freq_factor: 1.0,
            high_freq_factor: 4.0,
            original_max_position_embeddings: 8192,
        },
        ..m
    }
}

/// Qwen3 dense: QK-norm, 128-wide heads whatever the width, θ 1e6, eps 1e-6, 40960 positions.
#[allow(clippy::too_many_arguments)]
fn qwen3(h: usize, i: usize, l: usize, nh: usize, nkv: usize, tied: bool) -> ModelConfig {
    ModelConfig {
        head_dim: 128,
        rms_norm_eps: 1e-6,
        max_position_embeddings: 40960,
        qk_norm: true,
        ..llama_like(
            Architecture::Qwen3,
            151936,
            h,
            i,
            l,
            nh,
            nkv,
            tied,
            1000000.0,
        )
    }
}

/// gemma-3-27b's text model as its published `config.json` describes it (the other keys are
/// transformers' `Gemma3TextConfig` defaults: vocabulary 262208, θ 10⁶ global / 10⁴ local, every
/// sixth layer global, tied, padding index 0).
const GEMMA3_27B_TEXT: &str = r#"{"architectures": ["Gemma3ForCausalLM"], "head_dim": 128,
    "hidden_size": 5376, "intermediate_size": 21504, "num_attention_heads": 32,
    "num_hidden_layers": 62, "num_key_value_heads": 16, "query_pre_attn_scalar": 168,
    "rope_scaling": {"factor": 8.0, "rope_type": "linear"}, "sliding_window": 1024}"#;

/// Mixture-of-experts presets as their published `config.json`s describe them (the keys that
/// shape the model; the rest are transformers' defaults).
const MIXTRAL_8X7B: &str = r#"{"architectures": ["MixtralForCausalLM"], "vocab_size": 32000,
    "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "rope_theta": 1000000.0, "max_position_embeddings": 32768,
    "rms_norm_eps": 1e-5, "sliding_window": null}"#;
const MIXTRAL_8X22B: &str = r#"{"architectures": ["MixtralForCausalLM"], "vocab_size": 32768,
    "hidden_size": 6144, "intermediate_size": 16384, "num_hidden_layers": 56,
    "num_attention_heads": 48, "num_key_value_heads": 8, "num_local_experts": 8,
    "num_experts_per_tok": 2, "rope_theta": 1000000.0, "max_position_embeddings": 65536,
    "rms_norm_eps": 1e-5, "sliding_window": null}"#;
const QWEN3_30B_A3B: &str = r#"{"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936,
    "hidden_size": 2048, "intermediate_size": 6144, "moe_intermediate_size": 768,
    "num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": true,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1000000.0,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": false}"#;
const QWEN3_235B_A22B: &str = r#"{"architectures": ["Qwen3MoeForCausalLM"], "vocab_size": 151936,
    "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
    "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4,
    "head_dim": 128, "num_experts": 128, "num_experts_per_tok": 8, "norm_topk_prob": true,
    "decoder_sparse_step": 1, "mlp_only_layers": [], "rope_theta": 1000000.0,
    "max_position_embeddings": 40960, "rms_norm_eps": 1e-6, "tie_word_embeddings": false}"#;

const GPT_OSS_120B: &str = r#"{"architectures": ["GptOssForCausalLM"], "num_hidden_layers": 36,
    "num_local_experts": 128, "num_experts_per_tok": 4,
    "hidden_size": 2880, "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64,
    "num_key_value_heads": 8, "sliding_window": 128, "vocab_size": 201088}"#;
const GPT_OSS_20B: &str = r#"{"architectures": ["GptOssForCausalLM"], "num_hidden_layers": 24,
    "num_local_experts": 32, "num_experts_per_tok": 4, "hidden_size": 2880,
    "intermediate_size": 2880, "head_dim": 64, "num_attention_heads": 64,
    "num_key_value_heads": 8, "sliding_window": 128, "vocab_size": 201088}"#;

/// A model preset by name (configurations as published on the Hugging Face Hub).
pub fn model(name: &str) -> Option<ModelConfig> {
    use Architecture::{Llama, Mistral, Qwen2};
    Some(match name {
        "llama-3-8b" => llama_like(Llama, 128256, 4096, 14336, 32, 32, 8, false, 500000.0),
        "llama-3-70b" => llama_like(Llama, 128256, 8192, 28672, 80, 64, 8, false, 500000.0),
        "llama-3-405b" => llama_like(Llama, 128256, 16384, 53248, 126, 128, 8, false, 500000.0),
        // Llama 3.1 and 3.3: the Llama 3 shapes with Llama 3.1's RoPE scaling (factor 8 over an
        // 8192-token pretraining context), 128k positions.
        "llama-3.1-8b" => llama31(llama_like(
            Llama, 128256, 4096, 14336, 32, 32, 8, false, 500000.0,
        )),
        "llama-3.1-70b" | "llama-3.3-70b" => llama31(llama_like(
            Llama, 128256, 8192, 28672, 80, 64, 8, false, 500000.0,
        )),
        "llama-3.1-405b" => llama31(llama_like(
            Llama, 128256, 16384, 53248, 126, 128, 8, false, 500000.0,
        )),
        "qwen2.5-7b" => llama_like(Qwen2, 152064, 3584, 18944, 28, 28, 4, false, 1000000.0),
        "qwen2.5-14b" => llama_like(Qwen2, 152064, 5120, 13824, 48, 40, 8, false, 1000000.0),
        "qwen2.5-32b" => llama_like(Qwen2, 152064, 5120, 27648, 64, 40, 8, false, 1000000.0),
        "qwen2.5-72b" => llama_like(Qwen2, 152064, 8192, 29568, 80, 64, 8, false, 1000000.0),
        // Mistral Large 2 (Mistral-Large-Instruct-2407; Devstral 2's shape): 123B dense, no
        // window, 32768-token vocabulary.
        "mistral-large-2" => llama_like(Mistral, 32768, 12288, 28672, 88, 96, 8, false, 1000000.0),
        "qwen3-8b" => qwen3(4096, 12288, 36, 32, 8, false),
        "qwen3-32b" => qwen3(5120, 25600, 64, 64, 8, false),
        "gemma-3-27b" => ModelConfig::from_json_str(GEMMA3_27B_TEXT, "gemma-3-27b").ok()?,
        "mixtral-8x7b" => ModelConfig::from_json_str(MIXTRAL_8X7B, name).ok()?,
        "mixtral-8x22b" => ModelConfig::from_json_str(MIXTRAL_8X22B, name).ok()?,
        "qwen3-30b-a3b" => ModelConfig::from_json_str(QWEN3_30B_A3B, name).ok()?,
        "qwen3-235b-a22b" => ModelConfig::from_json_str(QWEN3_235B_A22B, name).ok()?,
        "gpt-oss-20b" => ModelConfig::from_json_str(GPT_OSS_20B, name).ok()?,
        "gpt-oss-120b" => ModelConfig::from_json_str(GPT_OSS_120B, name).ok()?,
        // Our own 120B configuration (MegaTrain reports a 120B model without publishing its
        // config): Llama-3 style, d = 12288, 74 layers.
        "llama-120b" => llama_like(Llama, 128256, 12288, 33792, 74, 96, 8, false, 500000.0),
        _ => return None,
    })
}

/// Model preset names.
pub const MODELS: [&str; 22] = [
    "llama-3-8b",
    "llama-3-70b",
    "llama-3-405b",
    "llama-3.1-8b",
    "llama-3.1-70b",
    "llama-3.1-405b",
    "llama-3.3-70b",
    "qwen2.5-7b",
    "qwen2.5-14b",
    "qwen2.5-32b",
    "qwen2.5-72b",
    "qwen3-8b",
    "qwen3-32b",
    "gemma-3-27b",
    "mistral-large-2",
    "llama-120b",
    "mixtral-8x7b",
    "mixtral-8x22b",
    "qwen3-30b-a3b",
    "qwen3-235b-a22b",
    "gpt-oss-20b",
    "gpt-oss-120b",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parameter_counts_match_published_totals() {
        // Totals from the models' Hub pages / safetensors indexes (parameters, not bytes).
        for (name, published) in [
            ("llama-3-8b", 8_030_261_248u64),
            ("llama-3-70b", 70_553_706_496),
            ("llama-3-405b", 405_853_388_800),
            ("llama-3.1-8b", 8_030_261_248),
            ("llama-3.1-70b", 70_553_706_496),
            ("llama-3.1-405b", 405_853_388_800),
            ("llama-3.3-70b", 70_553_706_496),
            ("qwen2.5-7b", 7_615_616_512),
            ("qwen2.5-14b", 14_770_033_664),
            ("qwen2.5-32b", 32_763_876_352),
            ("qwen2.5-72b", 72_706_203_648),
            // Qwen3: the bf16 safetensors index's total_size / 2 (16 381 470 720 and
            // 65 524 246 528 bytes).
            ("qwen3-8b", 8_190_735_360),
            ("qwen3-32b", 32_762_123_264),
        ] {
            let n = model(name).unwrap().num_params() as u64;
            assert_eq!(n, published, "{name}");
        }
        // Mistral Large 2: published as 123B; its config.json's shapes give this count.
        assert_eq!(
            model("mistral-large-2").unwrap().num_params(),
            122_610_069_504
        );
        // Gemma 3 27B: published as 27.4B with its 0.4B SigLIP vision tower; the text model
        // megatrain trains counts this many.
        assert_eq!(model("gemma-3-27b").unwrap().num_params(), 27_009_346_304);
        // Mixtral 8x7B: its bf16 safetensors index's total_size / 2 (93 405 585 408 bytes);
        // the others published rounded (total / active, billions).
        assert_eq!(model("mixtral-8x7b").unwrap().num_params(), 46_702_792_704);
        for (name, total, active) in [
            ("mixtral-8x7b", 46.7, 12.9),
            ("mixtral-8x22b", 140.6, 39.2),
            ("qwen3-30b-a3b", 30.5, 3.3),
            ("qwen3-235b-a22b", 235.1, 22.2),
            // OpenAI's model card: 116.83B / 5.13B and 20.91B / 3.61B (its active count leaves
            // the input embedding out, 0.58B).
            ("gpt-oss-120b", 116.83, 5.13 + 0.58),
            ("gpt-oss-20b", 20.91, 3.61 + 0.58),
        ] {
            let m = model(name).unwrap();
            let (n, a) = (m.num_params() as f64 / 1e9, m.active_params() as f64 / 1e9);
            assert!(
                (n - total).abs() < 0.05 * total / 10.0,
                "{name}: {n}B total"
            );
            assert!((a - active).abs() < 0.03 * active, "{name}: {a}B active");
        }
        let n = model("llama-120b").unwrap().num_params() as f64;
        assert!((n / 1e9 - 120.0).abs() < 2.0, "{n}");
        for m in MACHINES {
            assert!(machine(m).is_some());
        }
    }
}
