//! The kernel cost model of `megatrain plan`: the share of the peak each kind of kernel is
//! assumed to reach (sourced, printed by every plan), the bytes the memory-bound passes move,
//! and one micro-batch's kernel times split into GEMMs, attention and elementwise kernels.

use super::{Hardware, PlanRequest};
use crate::model::config::ModelConfig;
use serde::{Deserialize, Serialize};

/// The share of the peak each kind of kernel is assumed to reach, and where the figures come
/// from: inputs to a prediction — sourced assumptions, or what `megatrain bench kernels` measured
/// on the GPU (`plan --calibration`, [`Hardware::measured_bf16`]).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct KernelEfficiency {
    /// The layers' GEMMs (cuBLAS).
    pub gemm: f64,
    /// A mixture of experts' expert GEMMs: under bf16 the grouped kernels
    /// (`kernels/expert_gemm.cu`), under fp32 one cuBLAS SGEMM per expert. Absent from a
    /// measurement that did not time them: [`efficiency`] then takes the assumed figure.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub expert_gemm: Option<f64>,
    /// Attention forward, useful FLOPs (the causal half) over the peak.
    pub attention_fwd: f64,
    /// Attention backward, likewise.
    pub attention_bwd: f64,
    /// GPU memory TB/s the elementwise kernels (norms, RoPE, SwiGLU, residual adds, casts,
    /// cross-entropy) reach: they are bound by it.
    pub memory_tbps: f64,
    /// Where each figure comes from.
    pub source: String,
}

/// Datasheet GPU memory bandwidth, TB/s, of GPUs the probe can name.
fn gpu_memory_tbps(gpu: &str) -> Option<f64> {
    let n = gpu.to_ascii_lowercase();
    [
        ("gh200", 4.0),
        ("h200", 4.8),
        ("h100", 3.35),
        ("a100", 2.0),
        ("4090", 1.008),
        ("l40s", 0.864),
        ("b200", 8.0),
    ]
    .into_iter()
    .find(|(k, _)| n.contains(k))
    .map(|(_, tbps)| tbps)
}

/// Share of the datasheet memory bandwidth a streaming kernel reaches (assumed: STREAM-like
/// kernels on HBM GPUs reach about 90%).
const MEMORY_SHARE: f64 = 0.9;

/// Approximate GPU memory bytes the elementwise kernels move per token through one block's
/// forward (activations fp32): three RMSNorms (the first runs for the K/V pass and again for the
/// queries; read and write C each), two residual adds (two reads and a write), RoPE on Q and K,
/// SwiGLU or GeGLU (read 2F, write F), and under sandwich norms two more norms. Under bf16: RoPE writes Q and K in bf16 (2 bytes less per
/// element), V is stored by a cast (read 4, write 2 bytes per element) and the attention output
/// cast for its GEMM (the same); less 2 bytes per element of the GEMM inputs written in bf16 instead of fp32 (the first
/// norm's output twice, the second's once, the SwiGLU output); the weights need no cast (the
/// device holds them in bf16). A count of the program's passes, not a measurement.
pub fn elementwise_bytes_per_token(model: &ModelConfig, bf16: bool) -> f64 {
    // A token's MLP width: an MoE layer's top-k experts (the mean over the layers).
    let layers = model.num_layers.max(1);
    let width: usize = (0..layers).map(|l| model.active_mlp_params(l)).sum();
    let (c, f, kv) = (
        model.hidden_size as f64,
        width as f64 / (3 * layers * model.hidden_size.max(1)) as f64,
        model.kv_dim() as f64,
    );
    let q = model.q_dim() as f64;
    // Sandwich norms (Gemma): two more norms of C, each reading and writing a row.
    let sandwich = if model.sandwich_norms { 4.0 * c } else { 0.0 };
    let fp32 = 4.0 * (6.0 * c + 6.0 * c + 2.0 * (q + kv) + 3.0 * f + sandwich);
    let recipe = if bf16 {
        -2.0 * (q + kv) + 6.0 * kv + 6.0 * q - 2.0 * (3.0 * c + f)
    } else {
        0.0
    };
    fp32 + recipe
}

/// FlashAttention-2's causal forward on an H100 (head dim 128, long sequences), TFLOP/s: the
/// FlashAttention-3 paper's comparison, as quoted in issue #17. Of the 989 TFLOP/s peak.
const FA2_H100_CAUSAL_FWD_TFLOPS: f64 = 335.0;
/// Tensor-core work of our attention per FA2's (kernels/flash.cu: P and dS enter their products
/// as bf16 hi + lo pairs, a second MMA each): forward 3 MMAs where FA2 has 2; backward 10 where it
/// has 5 (S and dP are formed in both the dq and the dk/dv kernel).
const FLASH_MMA_FACTOR_FWD: f64 = 1.5;
const FLASH_MMA_FACTOR_BWD: f64 = 2.0;
/// Attention backward FLOPs per forward FLOP (FA2's count: 5 products of the forward's 2).
const ATTENTION_BWD_PER_FWD: f64 = 2.5;
/// Share of the fp32 peak assumed for fp32 SGEMM and the SIMT attention (no sourced figure).
const FP32_ASSUMED: f64 = 0.6;

/// The grouped expert GEMMs (`kernels/expert_gemm.cu`: mma.sync, cp.async, ldmatrix) measured on
/// an H100 in a step of two Qwen3-30B-A3B-wide layers (docs/gpu.md, "The experts' GEMMs in one
/// launch", 2026-11-27): 24 launches of 824 GFLOP, 18 of the forward kernel at 3.78 ms and 6 of
/// the weight-gradient kernel at 3.35 ms, 224 TFLOP/s together, of the 989 peak.
const EXPERT_GEMM_H100_TFLOPS: f64 = 224.0;
/// The dense bf16 GEMMs' rate on an H100 the plan assumes (MAMF, [`mamf_share`]): the grouped
/// kernels' ratio to it is carried to GPUs they were not measured on.
const DENSE_GEMM_H100_TFLOPS: f64 = 792.1;

/// The share of the bf16 peak the grouped expert GEMMs reach on `gpu`, and its source, for a GPU
/// whose dense GEMMs reach `gemm`.
fn expert_gemm_share(gpu: &str, gemm: f64) -> (f64, String) {
    let n = gpu.to_ascii_lowercase();
    if ["gh200", "h200", "h100"].iter().any(|k| n.contains(k)) {
        (
            EXPERT_GEMM_H100_TFLOPS / 989.0,
            format!("experts' GEMMs: the grouped kernels measured at {EXPERT_GEMM_H100_TFLOPS} of 989 TF on an H100 (docs/gpu.md)"),
        )
    } else {
        let ratio = EXPERT_GEMM_H100_TFLOPS / DENSE_GEMM_H100_TFLOPS;
        (
            gemm * ratio,
            format!(
                "experts' GEMMs: {ratio:.3}× the dense share, the ratio an H100 measured (assumed)"
            ),
        )
    }
}

/// Maximum achievable matmul FLOPS (bf16, best shape) over the datasheet peak, by GPU: Stas
/// Bekman's MAMF table (ml-engineering, compute/accelerator, measured with mamf-finder.py).
fn mamf_share(gpu: &str) -> Option<(f64, &'static str)> {
    let n = gpu.to_ascii_lowercase();
    // GH200 before H100: its name carries the H100 it holds.
    [
        ("gh200", 821.0 / 989.0, "GH200 MAMF 821.0 of 989 TF (CUDA 12.5)"),
        ("h200", 792.1 / 989.0, "H100 SXM MAMF 792.1 of 989 TF (CUDA 12.1; the H200 is not in the table, its compute is the H100's)"),
        ("h100", 792.1 / 989.0, "H100 SXM MAMF 792.1 of 989 TF (CUDA 12.1)"),
        ("a100", 267.9 / 312.0, "A100 SXM MAMF 267.9 of 312 TF (CUDA 12.1)"),
    ]
    .into_iter()
    .find(|(k, _, _)| n.contains(k))
    .map(|(_, share, src)| (share, src))
}

/// The kernel efficiencies the plan assumes for `gpu` in bf16 or fp32.
pub fn kernel_efficiency(gpu: &str, bf16: bool) -> KernelEfficiency {
    let (memory_tbps, memory_src) = match gpu_memory_tbps(gpu) {
        Some(t) => (
            MEMORY_SHARE * t,
            format!("memory: {MEMORY_SHARE} of the datasheet {t} TB/s (assumed)"),
        ),
        None => (
            MEMORY_SHARE * 2.0,
            "memory: 2 TB/s assumed (no datasheet figure for this GPU)".to_owned(),
        ),
    };
    if !bf16 {
        return KernelEfficiency {
            gemm: FP32_ASSUMED,
            // One SGEMM per expert, long enough to hide its launch: an H100 ran two
            // Qwen3-30B-A3B-wide layers at 0.97–1.02× this plan, gpt-oss-20b's at 0.79–0.82×.
            expert_gemm: Some(FP32_ASSUMED),
            attention_fwd: FP32_ASSUMED,
            attention_bwd: FP32_ASSUMED,
            memory_tbps,
            source: format!("fp32: {FP32_ASSUMED} of the fp32 peak assumed for every kernel (no sourced figure; the experts' GEMMs, one SGEMM per expert, too); {memory_src}"),
        };
    }
    let (gemm, gemm_src) =
        mamf_share(gpu).unwrap_or((FP32_ASSUMED, "no MAMF figure for this GPU: 0.6 assumed"));
    let fa2 = FA2_H100_CAUSAL_FWD_TFLOPS / 989.0;
    let (expert_gemm, expert_src) = expert_gemm_share(gpu, gemm);
    KernelEfficiency {
        gemm,
        expert_gemm: Some(expert_gemm),
        attention_fwd: fa2 / FLASH_MMA_FACTOR_FWD,
        attention_bwd: fa2 / FLASH_MMA_FACTOR_BWD,
        memory_tbps,
        source: format!(
            "GEMM: {gemm_src}; {expert_src}; attention: FlashAttention-2's causal forward on an H100 ({FA2_H100_CAUSAL_FWD_TFLOPS} TF, FlashAttention-3 paper) over the peak, divided by our kernels' extra MMAs ({FLASH_MMA_FACTOR_FWD}× forward, {FLASH_MMA_FACTOR_BWD}× backward); the backward is assumed to reach the forward's share; {memory_src}"
        ),
    }
}

/// The kernel efficiencies for `hw` in bf16 or fp32: what `bench kernels` measured on it, where
/// the hardware carries that, else the sourced assumptions of [`kernel_efficiency`]; the experts'
/// GEMMs, which `bench kernels` does not time, always have a figure.
pub fn efficiency(hw: &Hardware, bf16: bool) -> KernelEfficiency {
    let measured = if bf16 {
        &hw.measured_bf16
    } else {
        &hw.measured_fp32
    };
    let assumed = kernel_efficiency(&hw.gpu, bf16);
    match measured {
        None => assumed,
        Some(m) if m.expert_gemm.is_some() => m.clone(),
        Some(m) => KernelEfficiency {
            expert_gemm: assumed.expert_gemm,
            source: format!(
                "{}; experts' GEMMs assumed as without a calibration",
                m.source
            ),
            ..m.clone()
        },
    }
}

/// The step's GPU kernel time by kind of kernel (they add up to the kernels' sum, which the
/// GPU compute time equals when nothing stalls it).
#[derive(Debug, Clone, Copy, Default, PartialEq, Serialize)]
pub struct ComputeSplit {
    /// The layers' and the head's GEMMs.
    pub gemm_s: f64,
    /// Attention, forward (twice: the forward and the recompute) and backward.
    pub attention_s: f64,
    /// Memory-bound elementwise kernels and the cross-entropy's logit passes.
    pub elementwise_s: f64,
}

/// The keys a query attends to in sequences of `seq` tokens, averaged over the queries and the
/// layers: `seq / 2` under causal attention (the FLOP convention, as FlashAttention counts
/// it), and under a sliding window of W < seq the exact mean `(W(W+1)/2 + (seq − W)·W) / seq`
/// (a windowed layer's attention costs what its window costs).
pub fn mean_keys_per_query(model: &ModelConfig, seq: u64) -> f64 {
    let t = seq as f64;
    let layers = model.num_layers.max(1);
    (0..layers)
        .map(|i| match model.layer_window(i) {
            Some(w) if (w as u64) < seq => {
                let w = w as f64;
                (w * (w + 1.0) / 2.0 + (t - w) * w) / t
            }
            _ => t / 2.0,
        })
        .sum::<f64>()
        / layers as f64
}

/// One micro-batch's kernel times, by unit kind and kind of kernel.
pub(super) struct KernelParts {
    /// A block's forward: GEMMs, attention, elementwise.
    pub(super) block_fwd: [f64; 3],
    /// A block's backward with its recompute.
    pub(super) block_bwd: [f64; 3],
    /// The head (forward and backward): GEMMs, logit passes.
    pub(super) head: [f64; 2],
    /// Storing a layer input in bf16, or widening it back: an fp32 and a bf16 pass.
    pub(super) cast: f64,
}

impl KernelParts {
    pub(super) fn new(
        model: &ModelConfig,
        hw: &Hardware,
        req: &PlanRequest,
        tokens_mb: u64,
    ) -> Self {
        let peak = if req.bf16 {
            hw.bf16_tflops
        } else {
            hw.fp32_tflops
        } * 1e12;
        let eff = efficiency(hw, req.bf16);
        let (gemm, expert_gemm, attn_fwd, attn_bwd, memory) = (
            peak * eff.gemm,
            peak * eff.expert_gemm.unwrap_or(eff.gemm),
            peak * eff.attention_fwd,
            peak * eff.attention_bwd,
            eff.memory_tbps * 1e12,
        );
        let tk = tokens_mb as f64;
        // The elementwise passes of a block's forward; its backward (with the recompute) moves
        // about three times as much. The head's cross-entropy reads and writes the fp32 logits.
        let elementwise = elementwise_bytes_per_token(model, req.bf16) * tk / memory;
        let logits = 4.0 * 4.0 * model.vocab_size as f64 * tk / memory;
        // What one token's GEMMs compute with in a mean block (the router and its top-k
        // experts of an MoE layer).
        let layers = model.num_layers.max(1);
        let mean =
            |f: &dyn Fn(usize) -> usize| (0..layers).map(f).sum::<usize>() as f64 / layers as f64;
        // Of those, the experts' weights run through the expert GEMMs, the rest (attention's
        // projections, the router, a dense MLP) through the dense ones.
        let experts = mean(&|l| model.active_expert_params(l));
        let block = mean(&|l| model.active_layer_params(l)) - experts;
        let attn = 4.0 * mean_keys_per_query(model, req.seq_len) * model.q_dim() as f64 * tk;
        let head = (model.vocab_size * model.hidden_size) as f64;
        // Under sandwich norms the MLP's backward recomputes its down projection (for the
        // norm after it).
        let down = match model.sandwich_norms {
            true => (model.intermediate_size * model.hidden_size) as f64,
            false => 0.0,
        };
        let cast = 6.0 * model.hidden_size as f64 * tk / memory;
        KernelParts {
            block_fwd: [
                2.0 * block * tk / gemm + 2.0 * experts * tk / expert_gemm,
                attn / attn_fwd,
                elementwise,
            ],
            // The recompute (a forward) and the backward.
            block_bwd: [
                (6.0 * block + 2.0 * down) * tk / gemm + 6.0 * experts * tk / expert_gemm,
                attn / attn_fwd + ATTENTION_BWD_PER_FWD * attn / attn_bwd,
                3.0 * elementwise,
            ],
            head: [6.0 * head * tk / gemm, logits],
            cast,
        }
    }

    /// The split of `micro_batches` micro-batches of `layers` blocks.
    pub(super) fn split(&self, layers: usize, micro_batches: f64) -> ComputeSplit {
        let l = layers as f64;
        let block = |k: usize| l * (self.block_fwd[k] + self.block_bwd[k]);
        ComputeSplit {
            gemm_s: micro_batches * (block(0) + self.head[0]),
            attention_s: micro_batches * block(1),
            elementwise_s: micro_batches * (block(2) + self.head[1]),
        }
    }
}
