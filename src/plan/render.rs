//! A plan as the text `megatrain plan` prints: the model and its features, memory per tier,
//! the predicted step and its parts, the assumptions and their sources.

use super::{grad_link, Hardware, Plan, PlanRequest};
use crate::engine::schedule::Activations;

/// The plan as text.
pub fn render(model_name: &str, hw: &Hardware, req: &PlanRequest, p: &Plan) -> String {
    let hb = crate::util::human_bytes;
    let t = &p.time;
    let ms = |s: f64| {
        if s.is_finite() {
            format!("{:.1} ms", s * 1e3)
        } else {
            "∞ (no NVMe given)".into()
        }
    };
    let placed = format!(
        "layer-input checkpoints in {}, {}",
        p.memory.activation_dtype.name(),
        match (
            p.memory.activations,
            req.activations.is_some(),
            p.memory.device_inputs
        ) {
            (Activations::Host, true, _) => "in host memory, as asked".to_owned(),
            (Activations::Host, false, 0) =>
                "in host memory: the GPU lacks room for them".to_owned(),
            (Activations::Host, false, k) => format!(
                "{} on the GPU, the rest ({}) in host memory: the GPU lacks room for all",
                match k {
                    1 => "the last block's".to_owned(),
                    k => format!("the last {k} blocks'"),
                },
                crate::util::human_bytes(p.memory.host_activation_bytes)
            ),
            (_, true, _) => "on the GPU, as asked".to_owned(),
            (_, false, _) => "on the GPU: they fit beside its working set".to_owned(),
        }
    );
    let mut s = format!(
        "megatrain plan — {model_name} ({:.2}B params{}) on {} ({})\n\
         model: {}\n\
         {} tokens/step{} in micro-batches of {}, seq {}, {}, {} mode, {} Adam state{}\n\n\
         memory{}\n  host state       {:>12}  ({:.1} B/param)\n  activations      {:>12}  ({})\n  GPU working set  {:>12}  of {}{}\n  NVMe             {:>12}\n  fits: {}\n",
        p.params as f64 / 1e9,
        match p.active_params < p.params {
            true => format!(", {:.2}B active", p.active_params as f64 / 1e9),
            false => String::new(),
        },
        hw.name,
        hw.gpu,
        p.features.join(", "),
        req.tokens_per_step,
        match &p.data_parallel {
            Some(d) => format!(
                " ({} per rank on each of {} ranks: {} GPU(s) × {} machine(s))",
                d.tokens_per_rank, d.ranks, d.gpus_per_node, d.nodes
            ),
            None => String::new(),
        },
        p.micro_batch_tokens,
        req.seq_len,
        if req.bf16 { "bf16 streaming" } else { "fp32" },
        req.mode.name(),
        req.adam_state.name(),
        if p.memory.nvme_units > 0 {
            format!(", Adam m/v of {} of {} units on NVMe", p.memory.nvme_units, p.memory.units)
        } else {
            String::new()
        },
        if p.data_parallel.is_some() {
            " (of one rank)"
        } else {
            ""
        },
        hb(p.memory.host_state_bytes),
        p.memory.host_bytes_per_param,
        hb(p.memory.activation_bytes),
        placed,
        hb(p.memory.device_bytes),
        hb(hw.gpu_memory_bytes),
        if p.memory.layer_chunk_tokens < p.micro_batch_tokens {
            format!(
                "  (layers in chunks of {} tokens)",
                p.memory.layer_chunk_tokens
            )
        } else {
            String::new()
        },
        hb(p.memory.nvme_bytes),
        if p.fits { "yes".to_owned() } else { format!("NO — {}", p.missing.clone().unwrap_or_default()) },
    );
    if let Some(sg) = &p.suggestion {
        s += &format!("  smallest change that fits: {sg}\n");
    }
    if let Some(d) = &p.data_parallel {
        s += &format!(
            "\ndata parallel: {} ranks, {}\n  host per rank    {:>12}\n  host per machine {:>12}  of {} usable ({} ranks)\n",
            d.ranks,
            match d.zero_stage {
                1 => "ZeRO stage 1: each unit's Adam moments on one rank (the fullest rank planned)",
                3 if req.mode == crate::store::layout::Mode::Exact && p.micro_batch_tokens < d.tokens_per_rank => "ZeRO stage 3: each unit's params and Adam moments on one rank (the fullest rank planned; with several micro-batches every rank keeps every unit's gradients)",
                3 if req.mode == crate::store::layout::Mode::Exact => "ZeRO stage 3: each unit's params, gradients and Adam moments on one rank (the fullest rank planned)",
                3 => "ZeRO stage 3: each unit's params and Adam moments on one rank (the fullest rank planned)",
                _ => "every rank holding the whole host state (--zero-stage 1 or 3 shards it)",
            },
            hb(d.host_bytes_per_rank),
            hb(d.host_bytes_per_node),
            hb((d.node_ram_bytes as f64 * super::USABLE) as u64),
            d.gpus_per_node,
        );
    }
    s += &format!(
        "\npredicted step (a model, not a measurement)\n  GPU compute {}  (GEMM {}, attention {}, elementwise {})\n  host→device {}\n  device→host {}\n  CPU AdamW   {}\n  NVMe        {}\n{}  step        {}  bound by {}\n  {:.0} tokens/s{}, MFU {:.1}%\n",
        ms(t.compute_s),
        ms(t.compute_split.gemm_s),
        ms(t.compute_split.attention_s),
        ms(t.compute_split.elementwise_s),
        ms(t.htod_s),
        ms(t.dtoh_s),
        ms(t.adam_s),
        ms(t.nvme_s),
        match &p.data_parallel {
            Some(d) => format!(
                "  grad sum    {}  ({} of fp32 gradients per rank in host memory at {:.2} GB/s bus{}, on each rank's host thread)\n",
                ms(t.sum_s),
                hb(d.sum_bytes_per_step),
                d.host_sum_gbps,
                d.nic_gbps
                    .map_or_else(String::new, |n| format!(", across machines at {n:.1} GB/s each"))
            ),
            None => String::new(),
        } + &match p.data_parallel.as_ref().filter(|d| d.zero_stage > 0) {
            Some(d) => format!(
                "  params      {}  ({} per rank from the ranks holding them, {})\n",
                ms(t.params_s),
                hb(d.params_bytes_per_step),
                match (d.zero_stage, d.gpu_gather) {
                    (3, true) => "each owner's copy broadcast GPU to GPU by NCCL, on the weight stream",
                    (3, false) => "gathered before each copy to the GPU, on the host thread",
                    _ => "the owners' updates broadcast after the step",
                }
            ),
            None => String::new(),
        },
        ms(t.step_s),
        t.bottleneck,
        t.tokens_per_s,
        if p.data_parallel.is_some() {
            " (the job's)"
        } else {
            ""
        },
        100.0 * t.mfu
    );
    s += &format!(
        "  gradients   {}\n",
        grad_link::grad_link_line(&p.grad_link, ms)
    );
    let c = &p.checkpoint;
    s += &format!(
        "  checkpoint  {} at {:.1} GB/s{}: {} to write beside the next step, whose first update comes {} in: {:.0}% hidden, {} added per checkpoint\n",
        hb(c.bytes),
        c.disk_gbps,
        if c.disk_assumed { " (assumed: one NVMe drive; `bench nvme --json` as --calibration measures it)" } else { "" },
        ms(c.write_s),
        ms(c.window_s),
        100.0 * c.hidden,
        ms(c.stall_s),
    );
    if p.active_params < p.params {
        s += match req.bf16 {
            true => "  note        the experts' GEMMs (one grouped launch per projection for all experts) are predicted at the rate an \
                     H100 measured for them, 224 TFLOP/s (23% of its peak, 0.28× a dense GEMM; docs/gpu.md), from the FLOPs of the \
                     active experts: the GEMM time above is mostly theirs, and Hopper's wgmma path would shorten it\n",
            false => "  note        the experts' GEMMs run one expert at a time, predicted at the dense GEMMs' efficiency from the FLOPs \
                      of the active parameters (docs/gpu.md: an H100 measured 0.97–1.02× this for Qwen3-30B-A3B's layers, 0.79–0.82× for gpt-oss-20b's)\n",
        };
    }
    s
}
