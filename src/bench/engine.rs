//! `megatrain bench engine`: the streaming pipeline on the CPU device with an emulated link, for
//! a link-bound, a compute-bound and an AdamW-bound configuration. Each reports the measured step
//! time next to the serial sum of its parts and the ideal `max(compute, htod, dtoh, AdamW)`.
//!
//! On the CPU device, compute kernels and AdamW share the same cores, so their overlap is limited
//! by the machine, not by the schedule; the link is emulated (copies sleep to the modelled time),
//! so it overlaps freely.

use crate::device::cpu::{CpuDevice, CpuDeviceConfig, LinkModel};
use crate::engine::{Checkpoints, MicroBatch, Streamer, StreamerConfig};
use crate::model::config::{Architecture, ModelConfig};
use crate::model::reference::Templates;
use crate::optim::adamw::Isa;
use crate::optim::{AdamPool, AdamWConfig};
use crate::store::layout::{Mode, StateLayout};
use crate::store::placement::{place, RamBudget};
use crate::store::{HostStore, StoreOptions};
use crate::topology::Machine;
use crate::Result;
use serde::Serialize;
use std::sync::Arc;

/// One configuration's result.
#[derive(Debug, Clone, Serialize)]
pub struct EngineCase {
    /// Name ("link-bound", ...).
    pub name: String,
    /// What bounds it by design.
    pub bound: String,
    /// Tokens per step.
    pub tokens: usize,
    /// Emulated host→device GB/s.
    pub link_gbps: f64,
    /// AdamW threads.
    pub adam_threads: usize,
    /// AdamW forced to the scalar path (to build an AdamW-bound case on a fast link).
    pub scalar_adam: bool,
    /// exact or lean.
    pub mode: Mode,
    /// Median step time, s.
    pub step_s: f64,
    /// Median Σ compute, s.
    pub compute_s: f64,
    /// Median Σ htod, s.
    pub htod_s: f64,
    /// Median Σ dtoh, s.
    pub dtoh_s: f64,
    /// Median Σ AdamW, s.
    pub adam_s: f64,
    /// compute + htod + dtoh + AdamW.
    pub serial_s: f64,
    /// max(compute, htod, dtoh, AdamW).
    pub ideal_s: f64,
    /// step / ideal.
    pub ratio_to_ideal: f64,
    /// Lower bound that respects the step's dependencies: gradients only flow after the forward,
    /// so max(ideal, htod before the loss + dtoh).
    pub bound_s: f64,
    /// step / bound.
    pub ratio_to_bound: f64,
    /// step / serial.
    pub ratio_to_serial: f64,
    /// Device peak bytes.
    pub device_peak_bytes: u64,
}

fn model() -> ModelConfig {
    ModelConfig {
        architecture: Architecture::Llama,
        vocab_size: 2048,
        hidden_size: 256,
        intermediate_size: 704,
        num_layers: 6,
        num_heads: 4,
        num_kv_heads: 4,
        head_dim: 64,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        max_position_embeddings: 4096,
        tie_word_embeddings: false,
        qkv_bias: false,
        o_bias: false,
        sliding_window: None,
    }
}

fn median(mut v: Vec<f64>) -> f64 {
    v.sort_by(f64::total_cmp);
    v[v.len() / 2]
}

#[allow(clippy::too_many_arguments)]
fn run_case(
    machine: &Machine,
    name: &str,
    bound: &str,
    batch: usize,
    seq: usize,
    link_gbps: f64,
    adam_threads: usize,
    scalar_adam: bool,
    mode: Mode,
    steps: usize,
    trace: Option<&std::path::Path>,
) -> Result<EngineCase> {
    let cfg = model();
    let layout = StateLayout::new(&cfg, mode, false);
    let placement = place(machine, &layout, None, RamBudget::default())?;
    let store = HostStore::allocate(layout.clone(), placement, &StoreOptions::default())?;
    for u in 0..store.num_units() {
        let mut g = store.take(u)?;
        for (i, x) in g.params().iter_mut().enumerate() {
            *x = ((i % 101) as f32 - 50.0) * 1e-3;
        }
    }
    let nodes: Vec<(u32, Vec<usize>)> = store
        .placement()
        .nodes
        .iter()
        .filter(|n| !n.adam_cpus.is_empty())
        .map(|n| (n.node, n.adam_cpus.clone()))
        .collect();
    let isa = if scalar_adam {
        Isa::Scalar
    } else {
        crate::optim::adamw::detect()
    };
    let pool = AdamPool::with_isa(&nodes, Some(adam_threads), isa)?;
    let tm = Arc::new(Templates::new(&layout, seq)?);
    let link = LinkModel {
        htod_gbps: link_gbps,
        dtoh_gbps: link_gbps,
        latency_us: 10.0,
    };
    let device = Arc::new(CpuDevice::new(
        CpuDeviceConfig {
            capacity_bytes: 4 << 30,
            link: Some(link),
            jitter: None,
            batch,
            seq,
        },
        tm.clone(),
    )?);
    let mut s = Streamer::new(
        device,
        store,
        pool,
        tm,
        StreamerConfig {
            batch,
            seq,
            micro_batches: 1,
            checkpoints: Checkpoints::Host,
            adam: AdamWConfig::default(),
            grad_clip: 1.0,
            decay_norms: true,
        },
    )?;
    let n = batch * seq;
    let mb = |k: usize| {
        let toks: Vec<u32> = (0..=n)
            .map(|i| ((i * 7 + k * 13) % cfg.vocab_size) as u32)
            .collect();
        MicroBatch {
            tokens: toks[..n].to_vec().into(),
            targets: toks[1..].to_vec().into(),
        }
    };
    let mut rows = Vec::new();
    for k in 0..steps + 1 {
        let m = s.step(&[mb(k)], 1e-4)?;
        if k > 0 {
            rows.push(m); // the first step warms up (and its AdamW overlaps step 2's forward)
        }
    }
    s.finish()?;
    if let Some(dir) = trace {
        s.timeline()
            .write_chrome(&dir.join(format!("engine-{name}.trace.json")))?;
    }
    let med = |f: fn(&crate::engine::StepMetrics) -> f64| median(rows.iter().map(f).collect());
    let (step_s, compute_s, htod_s, dtoh_s) = (
        med(|m| m.wall_s),
        med(|m| m.compute_s),
        med(|m| m.htod_s),
        med(|m| m.dtoh_s),
    );
    // AdamW of step k completes during step k+1: its time is reported with the later step.
    let adam_s = med(|m| m.optimizer_s);
    let serial_s = compute_s + htod_s + dtoh_s + adam_s;
    let ideal_s = compute_s.max(htod_s).max(dtoh_s).max(adam_s);
    let bound_s = ideal_s.max(med(|m| m.htod_before_loss_s) + dtoh_s);
    Ok(EngineCase {
        name: name.to_owned(),
        bound: bound.to_owned(),
        tokens: n,
        link_gbps,
        adam_threads,
        scalar_adam,
        mode,
        step_s,
        compute_s,
        htod_s,
        dtoh_s,
        adam_s,
        serial_s,
        ideal_s,
        ratio_to_ideal: step_s / ideal_s,
        bound_s,
        ratio_to_bound: step_s / bound_s,
        ratio_to_serial: step_s / serial_s,
        device_peak_bytes: rows.iter().map(|m| m.device_peak_bytes).max().unwrap_or(0),
    })
}

/// Run the three configurations; with `trace_dir`, write each one's timeline there as
/// `engine-{case}.trace.json`.
pub fn run(
    machine: &Machine,
    steps: usize,
    trace_dir: Option<&std::path::Path>,
) -> Result<Vec<EngineCase>> {
    Ok(vec![
        run_case(
            machine,
            "link-bound",
            "htod (0.5 GB/s link)",
            1,
            32,
            0.5,
            2,
            false,
            Mode::Exact,
            steps,
            trace_dir,
        )?,
        run_case(
            machine,
            "compute-bound",
            "compute (2048 tokens)",
            4,
            512,
            25.0,
            2,
            false,
            Mode::Exact,
            steps,
            trace_dir,
        )?,
        // A slow optimizer host: one thread running the scalar AdamW path. Exact mode can only
        // overlap AdamW with the next forward (the global norm needs every gradient first); lean
        // mode overlaps it with the backward too.
        run_case(
            machine,
            "adamw-bound",
            "AdamW (1 scalar thread), exact",
            1,
            8,
            200.0,
            1,
            true,
            Mode::Exact,
            steps,
            trace_dir,
        )?,
        run_case(
            machine,
            "adamw-lean",
            "AdamW (1 scalar thread), lean",
            1,
            8,
            200.0,
            1,
            true,
            Mode::Lean,
            steps,
            trace_dir,
        )?,
    ])
}

/// Text table.
pub fn render(cases: &[EngineCase]) -> String {
    let mut s = format!(
        "megatrain bench engine — CPU device, emulated link, model {} params in {} units, host checkpoints\n\
         times are medians over the measured steps, in ms; ideal = max(compute, htod, dtoh, adamw);\n\
         bound = max(ideal, htod before the loss + dtoh): gradients cannot leave before the forward ends\n\n\
         {:<14} {:>7} {:>7} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>8} {:>10} {:>10} {:>11}\n",
        model().num_params(),
        model().num_layers + 2,
        "case", "tokens", "GB/s", "compute", "htod", "dtoh", "adamw", "serial", "ideal", "bound", "step", "step/ideal", "step/bound", "step/serial"
    );
    for c in cases {
        s += &format!(
            "{:<14} {:>7} {:>7.1} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>8.2} {:>10.3} {:>10.3} {:>11.3}\n",
            c.name,
            c.tokens,
            c.link_gbps,
            c.compute_s * 1e3,
            c.htod_s * 1e3,
            c.dtoh_s * 1e3,
            c.adam_s * 1e3,
            c.serial_s * 1e3,
            c.ideal_s * 1e3,
            c.bound_s * 1e3,
            c.step_s * 1e3,
            c.ratio_to_ideal,
            c.ratio_to_bound,
            c.ratio_to_serial
        );
    }
    s
}
