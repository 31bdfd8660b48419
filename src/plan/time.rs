//! The step's time: the schedule simulated over the costs of this model on this machine
//! ([`sim`]), the gradient sum and the params between ranks of a data-parallel job, and what
//! bounds the step. Every figure is a prediction.

use super::kernels::{self, KernelParts};
use super::memory::{device_side, spilled_units};
use super::{sim, ComputeSplit, Hardware, PlanRequest};
use crate::model::config::ModelConfig;
use crate::optim::moments;
use crate::store::layout::Mode;
use serde::Serialize;

/// Predicted step time, seconds per component.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct TimePlan {
    /// GPU compute (forward, recompute, backward).
    pub compute_s: f64,
    /// Host→device (weights twice per step).
    pub htod_s: f64,
    /// Device→host (gradients once).
    pub dtoh_s: f64,
    /// CPU AdamW.
    pub adam_s: f64,
    /// NVMe traffic of spilled moments.
    pub nvme_s: f64,
    /// Summing the gradients across the ranks (data parallel; 0 for one rank).
    pub sum_s: f64,
    /// Params moved between ranks (ZeRO stage 1: the owners' updates broadcast after the
    /// step's schedule, added to it; stage 3: the gathers before each copy to the GPU, on the
    /// host thread within the schedule).
    pub params_s: f64,
    /// The bytes of params a rank takes from other ranks per step, for [`Self::params_s`].
    pub params_bytes: u64,
    /// Predicted step: the slowest component (the pipeline overlaps the rest).
    pub step_s: f64,
    /// Which component bounds it.
    pub bottleneck: String,
    /// Tokens per second (of the whole job, from [`plan`]; of a rank, from [`time`]).
    pub tokens_per_s: f64,
    /// Model FLOPs utilization: 6·N·tokens / (step · peak).
    pub mfu: f64,
    /// Where the GPU compute goes.
    pub compute_split: ComputeSplit,
}

/// FLOPs of one step: 2·N per token for the forward, again for the recompute, 4·N for the
/// backward (8·N in all), plus causal attention (4·T·d per token per layer forward, ×4; T the
/// keys a query sees: [`kernels::mean_keys_per_query`]).
pub fn step_flops(model: &ModelConfig, tokens: u64, seq: u64) -> f64 {
    let n = model.active_params() as f64;
    let keys = kernels::mean_keys_per_query(model, seq);
    let attn = 4.0 * keys * model.q_dim() as f64 * model.num_layers as f64;
    tokens as f64 * (8.0 * n + 4.0 * attn)
}

/// The step model's costs for `model` on `hw` with micro-batches of `tokens_mb` tokens: kernels
/// from `parts` (FLOPs and bytes at the sourced shares of peak), copies from the link,
/// AdamW and the norm from the host's AdamW rate, spilled m/v from the NVMe rate.
fn sim_costs(
    model: &ModelConfig,
    hw: &Hardware,
    req: &PlanRequest,
    tokens_mb: u64,
    parts: &KernelParts,
) -> sim::Costs {
    let layout = req.layout(model);
    let tk = tokens_mb as f64;
    let numel: Vec<usize> = layout.units.iter().map(|u| u.numel).collect();
    let weight_bytes = if req.bf16 { 2.0 } else { 4.0 };
    // A planes master moves the bytes of an fp32 one, and its high plane is the bf16 copy.
    let adam_bytes = moments::update_bytes_per_param(req.adam_state);
    let adam_bps = hw.adam_gbps * 1e9;
    let (spilled, _) = spilled_units(model, req, hw);
    let nvme = |u: usize| match (spilled.contains(&u), hw.nvme_gbps) {
        (true, Some(g)) => layout.moment_bytes(u) as f64 / (g * 1e9),
        _ => 0.0,
    };
    sim::Costs {
        weight_elem_bytes: weight_bytes,
        grad_elem_bytes: req.grad_link.unwrap_or_default().elem_bytes() as f64,
        activation_bytes: tk * model.hidden_size as f64 * req.activation_dtype.elem_bytes() as f64,
        htod_bps: hw.htod_gbps * 1e9,
        dtoh_bps: hw.dtoh_gbps * 1e9,
        copy_latency_s: 10e-6,
        // Landings (`+=`, bf16 widening) stream through DRAM like AdamW does.
        land_bps: Some(adam_bps),
        kernels: sim::KernelCosts {
            embed_fwd: 0.0,
            block_fwd: parts.block_fwd.iter().sum(),
            head: parts.head.iter().sum(),
            block_bwd: parts.block_bwd.iter().sum(),
            embed_bwd: 0.0,
            zero: 0.0,
            cast: parts.cast,
        },
        // A sharded rank updates only the units it holds the moments of.
        adam_s: numel
            .iter()
            .enumerate()
            .map(|(u, &k)| match layout.holds_moments(u) {
                true => k as f64 * adam_bytes / adam_bps,
                false => 0.0,
            })
            .collect(),
        norm_s: numel.iter().map(|&k| k as f64 * 4.0 / adam_bps).collect(),
        nvme_read_s: (0..numel.len()).map(nvme).collect(),
        nvme_write_s: (0..numel.len()).map(nvme).collect(),
        // The ranks sum fp32 gradients in host memory, whatever crossed the link. Sharded
        // gradients go to their owner alone (`Collective::reduce_f32`): a rank that does not
        // hold the unit moves fewer bytes, but the ranks meet again at the next unit's sum, so
        // each sum costs the job its owner's time, which moves an all-reduce's bytes (measured
        // 0.80–0.91× of the sum's time, `bench collective`): priced as the sum.
        reduce_s: numel
            .iter()
            .map(|&k| req.data_parallel.sum_s(hw, 4.0 * k as f64))
            .collect(),
        // Stage 3: a unit's params as the GPU streams them, from the rank holding them:
        // through host memory, or GPU to GPU (NCCL).
        gather_s: match (req.data_parallel.sharding(), req.data_parallel.gpu_gather) {
            (3, false) => numel
                .iter()
                .map(|&k| req.data_parallel.broadcast_s(hw, weight_bytes * k as f64))
                .collect(),
            (3, true) => numel
                .iter()
                .map(|&k| {
                    req.data_parallel
                        .gpu_broadcast_s(hw, weight_bytes * k as f64)
                })
                .collect(),
            _ => Vec::new(),
        },
        held: (0..numel.len()).map(|u| layout.holds_params(u)).collect(),
        staging_slots: 3,
        unit_numel: numel,
        lean_piece_elems: (req.mode == Mode::Lean).then(|| layout.lean_piece_elems()),
        shared_cores: None,
    }
}

/// Predicted times: the engine's step schedule replayed by [`sim::simulate`]. Steps of many
/// micro-batches are extrapolated from one and two (each further micro-batch adds the same
/// period), so planning a 405B model with thousands of micro-batches stays instant.
pub fn time(model: &ModelConfig, hw: &Hardware, req: &PlanRequest) -> TimePlan {
    // The FLOPs a token costs: a mixture of experts computes with its active part.
    let n = model.active_params() as f64;
    let peak = if req.bf16 {
        hw.bf16_tflops
    } else {
        hw.fp32_tflops
    } * 1e12;
    let micro = req.micro_batches();
    let useful = 6.0 * n * req.tokens_per_step as f64;
    if req.spill_moments && hw.nvme_gbps.is_none() {
        return TimePlan {
            compute_s: 0.0,
            htod_s: 0.0,
            dtoh_s: 0.0,
            adam_s: 0.0,
            nvme_s: f64::INFINITY,
            sum_s: 0.0,
            params_s: 0.0,
            params_bytes: 0,
            step_s: f64::INFINITY,
            bottleneck: "NVMe".into(),
            tokens_per_s: 0.0,
            mfu: 0.0,
            compute_split: ComputeSplit::default(),
        };
    }
    let kernels = KernelParts::new(model, hw, req, req.micro_tokens());
    let costs = sim_costs(model, hw, req, req.micro_tokens(), &kernels);
    let placed = device_side(model, req, hw);
    let layout = req.layout(model);
    let spec_of = |m: u64| crate::engine::schedule::ScheduleSpec {
        layers: model.num_layers,
        tied: model.tie_word_embeddings,
        micro_batches: m as usize,
        mode: req.mode,
        activations: placed.activations,
        activation_dtype: req.activation_dtype,
        device_inputs: placed.device_inputs,
        lean_pieces: crate::engine::schedule::LeanPieces::of(&layout),
        ranks: req.data_parallel.ranks() as usize,
        gather: match (req.data_parallel.sharding(), req.data_parallel.gpu_gather) {
            (3, false) => crate::engine::schedule::Gather::Host,
            (3, true) => crate::engine::schedule::Gather::Device,
            _ => crate::engine::schedule::Gather::No,
        },
        land: layout.lands_grads(),
    };
    let run = |m: u64| sim::simulate(&crate::engine::schedule::schedule(&spec_of(m)), &costs);
    let p1 = run(1);
    let p = if micro <= 1 {
        p1
    } else {
        let p2 = run(2);
        let k = (micro - 1) as f64;
        let ex = |a: f64, b: f64| a + k * (b - a);
        sim::Prediction {
            step_s: ex(p1.step_s, p2.step_s),
            compute_s: ex(p1.compute_s, p2.compute_s),
            htod_s: ex(p1.htod_s, p2.htod_s),
            dtoh_s: ex(p1.dtoh_s, p2.dtoh_s),
            adam_s: p2.adam_s,
            nvme_s: p2.nvme_s,
            bottleneck: p2.bottleneck,
        }
    };
    // The gradients' sums of a step, on the host thread: every unit's once, or (sharded
    // gradients) every micro-batch's — the schedule's Reduce tasks, as the simulation costs
    // them, for 1 and 2 micro-batches and extrapolated.
    let sums = |m: u64| -> f64 {
        crate::engine::schedule::schedule(&spec_of(m))
            .tasks
            .iter()
            .filter(|t| matches!(t.op, crate::engine::schedule::Op::Reduce { .. }))
            .map(|t| sim::host_seconds(&t.op, &costs))
            .sum()
    };
    let sum_s = match micro {
        0 | 1 => sums(1),
        _ => {
            let (s1, s2) = (sums(1), sums(2));
            s1 + micro.saturating_sub(1) as f64 * (s2 - s1)
        }
    };
    // Params between ranks: stage 3's gathers (in the schedule: each copy of a unit), or stage
    // 1's broadcast of every unit's update (params shard: 4 B/param either master format)
    // after it, which the step waits for.
    // The rank planned receives the params of the units it does not hold.
    let received = |u: usize| !layout.holds_moments(u);
    let (params_s, params_bytes) = match req.data_parallel.sharding() {
        3 => {
            // (seconds, elements) of the gathers of a step of `m` micro-batches.
            let gathers = |m: u64| -> (f64, f64) {
                let s = crate::engine::schedule::schedule(&spec_of(m));
                s.tasks
                    .iter()
                    .filter_map(|t| match t.op {
                        crate::engine::schedule::Op::Gather { unit, .. }
                        | crate::engine::schedule::Op::CopyWeights {
                            unit,
                            broadcast: true,
                            ..
                        } => Some((
                            costs.gather_s.get(unit).copied().unwrap_or(0.0),
                            received(unit) as u8 as f64 * costs.unit_numel[unit] as f64,
                        )),
                        _ => None,
                    })
                    .fold((0.0, 0.0), |a, b| (a.0 + b.0, a.1 + b.1))
            };
            let (g1, g2) = (gathers(1), gathers(2));
            let k = micro.saturating_sub(1) as f64;
            let elems = g1.1 + k * (g2.1 - g1.1);
            (g1.0 + k * (g2.0 - g1.0), elems * costs.weight_elem_bytes)
        }
        1 => (
            costs
                .unit_numel
                .iter()
                .map(|&k| req.data_parallel.broadcast_s(hw, 4.0 * k as f64))
                .sum(),
            4.0 * (0..costs.unit_numel.len())
                .filter(|&u| received(u))
                .map(|u| costs.unit_numel[u])
                .sum::<usize>() as f64,
        ),
        _ => (0.0, 0.0),
    };
    let params_bytes = params_bytes as u64;
    let step_s = match req.data_parallel.sharding() {
        1 => p.step_s + params_s,
        _ => p.step_s,
    };
    let parts = [
        ("GPU compute", p.compute_s),
        ("host→device", p.htod_s),
        ("device→host", p.dtoh_s),
        ("CPU AdamW", p.adam_s),
        ("NVMe", p.nvme_s),
        ("gradient sum", sum_s),
        ("params between ranks", params_s),
    ];
    let bottleneck = parts
        .iter()
        .fold(("", -1.0f64), |a, &(k, v)| if v > a.1 { (k, v) } else { a })
        .0;
    TimePlan {
        compute_s: p.compute_s,
        htod_s: p.htod_s,
        dtoh_s: p.dtoh_s,
        adam_s: p.adam_s,
        nvme_s: p.nvme_s,
        sum_s,
        params_s,
        params_bytes,
        step_s,
        bottleneck: bottleneck.to_owned(),
        tokens_per_s: req.tokens_per_step as f64 / step_s,
        mfu: useful / (step_s * peak),
        compute_split: kernels.split(model.num_layers, micro as f64),
    }
}
