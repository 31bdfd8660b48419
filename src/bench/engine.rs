//! `megatrain bench engine`: the streaming pipeline on the CPU device with an emulated link, for
//! link-, compute-, AdamW- and NVMe-spill-bound configurations in exact and lean mode. Each reports
//! the measured step time next to the serial sum of its parts, the ideal
//! `max(compute, htod, dtoh, AdamW)`, and the **planner's prediction** ([`crate::plan::sim`]):
//! the same step schedule replayed with component costs calibrated *in isolation* (kernels timed
//! alone, AdamW timed alone on the same threads, the spill store timed alone, the emulated link's
//! own figures) — so the prediction tests the model of overlap and dependencies, not a fit.
//!
//! On the CPU device, compute kernels and AdamW share the same cores, so their overlap is limited
//! by the machine, not by the schedule; the link is emulated (copies sleep to the modelled time),
//! so it overlaps freely. The `moe` case is a mixture of experts shaped like the ones users bring
//! (many experts, few active): every expert's weights cross the link and every parameter is
//! updated each step while little is computed, so the link and AdamW bound it at once.

use crate::device::cpu::{CpuDevice, CpuDeviceConfig, LinkModel};
use crate::engine::schedule::{self, Activations, LeanPieces, ScheduleSpec};
use crate::engine::{MicroBatch, StepMetrics, Streamer, StreamerConfig};
use crate::model::config::{Architecture, ModelConfig};
use crate::model::reference::Templates;
use crate::optim::adamw::Isa;
use crate::optim::adamw::{self, AdamSlices, StepScalars};
use crate::optim::{AdamPool, AdamWConfig};
use crate::plan::sim::{self, Costs, KernelCosts};
use crate::spill::extents::{ExtentStore, SpillConfig};
use crate::spill::io::EngineKind;
use crate::store::layout::{Mode, StateLayout};
use crate::store::placement::{place_with_spill, RamBudget, SpillPolicy, SpillRequest};
use crate::store::{HostStore, SpillOptions, StoreOptions};
use crate::topology::Machine;
use crate::util::median;
use crate::Result;
use serde::Serialize;
use std::sync::Arc;
use std::time::Instant;

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
    /// The dependency bound: the step's schedule replayed with the component times this run
    /// measured (each resource's durations scaled to its measured total, no core sharing: the
    /// measured times already include it), so the best step the schedule's dependencies allow
    /// with these durations — exact mode's AdamW waits for the global norm, lean mode's next
    /// forward for the last unit's update.
    pub bound_s: f64,
    /// step / bound.
    pub ratio_to_bound: f64,
    /// step / serial.
    pub ratio_to_serial: f64,
    /// Device peak bytes.
    pub device_peak_bytes: u64,
    /// Adam m/v on NVMe.
    pub spilled: bool,
    /// Median NVMe bytes (read + written) per step.
    pub nvme_bytes: u64,
    /// Median time the NVMe I/O thread was busy per step, s.
    pub nvme_s: f64,
    /// The planner's predicted step, s.
    pub predicted_s: f64,
    /// What the planner says bounds the step.
    pub predicted_bottleneck: String,
    /// The planner's per-resource busy seconds per step (compute, htod, dtoh, AdamW, NVMe).
    pub predicted_parts: [f64; 5],
    /// step / predicted.
    pub ratio_to_prediction: f64,
}

fn model() -> ModelConfig {
    ModelConfig::dense(
        Architecture::Llama,
        2048,
        (256, 704, 6),
        (4, 4),
        false,
        10000.0,
    )
}

/// The `moe` case's model: [`model`]'s width and depth with Qwen3-MoE layers of 16 experts of
/// 176 (top-2): 2.7× the parameters, 4.3M of 15.6M active (the embeddings included).
fn moe_model() -> Result<ModelConfig> {
    ModelConfig::from_json_str(
        r#"{"architectures":["Qwen3MoeForCausalLM"],"hidden_size":256,"intermediate_size":704,
        "moe_intermediate_size":176,"num_experts":16,"num_experts_per_tok":2,"norm_topk_prob":true,
        "num_hidden_layers":6,"num_attention_heads":4,"num_key_value_heads":4,"head_dim":64,
        "vocab_size":2048,"tie_word_embeddings":false,"rope_theta":10000.0}"#,
        "the engine bench's MoE model",
    )
}

/// One configuration.
#[derive(Debug, Clone)]
struct Case {
    name: &'static str,
    bound: &'static str,
    model: ModelConfig,
    batch: usize,
    seq: usize,
    link_gbps: f64,
    adam_threads: usize,
    scalar_adam: bool,
    mode: Mode,
    spill: bool,
}

fn time_it(reps: usize, mut f: impl FnMut()) -> f64 {
    f(); // warm-up
    median(
        (0..reps.max(1))
            .map(|_| {
                let t = Instant::now();
                f();
                t.elapsed().as_secs_f64()
            })
            .collect(),
    )
}

/// Kernel costs of one micro-batch, each kernel timed alone on the CPU device's templates.
fn calibrate_kernels(tm: &Templates, layout: &StateLayout, b: usize, t: usize) -> KernelCosts {
    let cfg = &layout.config;
    let (n, c) = (b * t, cfg.hidden_size);
    let unit = |u: usize| -> Vec<f32> {
        (0..layout.units[u].numel)
            .map(|i| ((i % 101) as f32 - 50.0) * 1e-3 + if i % 7 == 0 { 1.0 } else { 0.0 })
            .collect()
    };
    let (pe, pb, ph) = (unit(0), unit(1), unit(layout.units.len() - 1));
    let mut gb = vec![0.0f32; pb.len()];
    let mut ge = vec![0.0f32; pe.len()];
    let mut gh = vec![0.0f32; ph.len()];
    let tokens: Vec<u32> = (0..n).map(|i| (i * 7 % cfg.vocab_size) as u32).collect();
    let pos = crate::model::ops::flat_positions(b, t);
    let mut ws = crate::model::layers::Workspace::new(cfg, b, t);
    let x: Vec<f32> = (0..n * c).map(|i| ((i % 13) as f32 - 6.0) * 0.05).collect();
    let mut y = vec![0.0f32; n * c];
    let mut dx = vec![0.0f32; n * c];
    let blk = &tm.blocks[0];
    let reps = 9;
    let embed_fwd = time_it(reps, || tm.embedding.forward(&pe, &tokens, &mut y));
    let block_fwd = time_it(reps, || {
        blk.forward(&pb, &x, &mut y, &mut ws, &tm.rope, &pos, b, t)
    });
    let block_bwd = time_it(reps, || {
        blk.backward(&pb, &mut gb, &x, &y, &mut dx, &mut ws, &tm.rope, &pos, b, t)
    });
    let nr = tm.head.norm_range();
    let head = time_it(reps, || {
        let (g_lo, g_w) = gh.split_at_mut(nr.end);
        let (w, g_w): (&[f32], &mut [f32]) = match tm.head.lm_head {
            Some(off) => (&ph[off..], &mut g_w[off - nr.end..]),
            None => (&pe[..], &mut ge[..]),
        };
        tm.head.loss_backward(
            &ph[nr.clone()],
            &mut g_lo[nr.clone()],
            w,
            g_w,
            &x,
            &tokens,
            &mut dx,
            1.0,
            &mut ws,
        );
    });
    let embed_bwd = time_it(reps, || tm.embedding.backward(&mut ge, &tokens, &dx));
    let zero = time_it(reps, || gb.fill(0.0));
    KernelCosts {
        embed_fwd,
        block_fwd,
        head,
        block_bwd,
        embed_bwd,
        zero,
        // The engine bench stores fp32 layer inputs: no casts are scheduled.
        cast: 0.0,
    }
}

/// AdamW seconds per element on `threads` threads with `isa`, timed alone on a block-sized
/// buffer (each thread a contiguous chunk, as the pool splits a unit).
fn calibrate_adam(numel: usize, threads: usize, isa: Isa) -> f64 {
    let threads = threads.max(1);
    let chunk = numel.div_ceil(threads);
    let mut p = vec![0.01f32; numel];
    let g = vec![0.001f32; numel];
    let mut m = vec![0.0f32; numel];
    let mut v = vec![1e-6f32; numel];
    let sc = StepScalars::new(&AdamWConfig::default(), 3, true, 1.0);
    let t = time_it(3, || {
        std::thread::scope(|s| {
            for (((p, g), m), v) in p
                .chunks_mut(chunk)
                .zip(g.chunks(chunk))
                .zip(m.chunks_mut(chunk))
                .zip(v.chunks_mut(chunk))
            {
                let sc = &sc;
                s.spawn(move || adamw::step_with(isa, AdamSlices { p, g, m, v }, sc));
            }
        });
    });
    t / numel as f64
}

/// Seconds per byte to write and to read one unit's m and v through the spill store (two calls
/// of `shard_bytes` each, as the tier makes them), timed alone, and the share of that time the
/// checksums take (CPU work).
fn calibrate_nvme(dir: &std::path::Path, shard_bytes: usize) -> Result<(f64, f64, f64)> {
    let bytes = shard_bytes.div_ceil(4096) * 4096;
    let d = dir.join(format!(".megatrain-calib-{}", std::process::id()));
    let eb = 1 << 20;
    let per = bytes.div_ceil(eb);
    let mut store = ExtentStore::create(&SpillConfig {
        dirs: vec![d.clone()],
        extent_bytes: eb,
        extents: 2 * per,
        engine: EngineKind::Auto,
        direct: true,
        queue_depth: 32,
        run_id: None,
    })?;
    let buf = crate::host::Region::allocate(crate::host::RegionSpec::scratch(
        "nvme calibration",
        2 * bytes,
    ))?;
    // SAFETY: a fresh region of 2·bytes bytes, only used here.
    let data = unsafe { std::slice::from_raw_parts_mut(buf.as_ptr(), 2 * bytes) };
    data.fill(7);
    let (m, v) = data.split_at_mut(bytes);
    // The tier interleaves reads (prefetch) and write-backs: time them the same way, a write of
    // one unit's m and v then a read of another's, and split the pair's time by bytes.
    let mut err = None;
    let pair = time_it(9, || {
        for (first, x) in [(0, &*m), (per, &*v)] {
            if let Err(e) = store.write(first, x, "calibration") {
                err.get_or_insert(e);
            }
        }
        for (first, x) in [(0, &mut *m), (per, &mut *v)] {
            if let Err(e) = store.read(first, x, "calibration") {
                err.get_or_insert(e);
            }
        }
    });
    let (w, r) = (pair / 2.0, pair / 2.0);
    let crc = time_it(5, || {
        std::hint::black_box(crc32c::crc32c(m));
        std::hint::black_box(crc32c::crc32c(v));
    });
    drop(store);
    let _ = std::fs::remove_dir_all(&d);
    match err {
        Some(e) => Err(e),
        None => Ok((
            w / (2 * bytes) as f64,
            r / (2 * bytes) as f64,
            (2.0 * crc / (w + r)).min(1.0),
        )),
    }
}

/// Run `case` for `steps` measured steps (after one warm-up step) and set its figures beside
/// the planner's prediction.
fn run_case(
    machine: &Machine,
    case: &Case,
    steps: usize,
    nvme_dir: &std::path::Path,
    trace: Option<&std::path::Path>,
) -> Result<EngineCase> {
    let layout = StateLayout::new(&case.model, case.mode);
    let isa = if case.scalar_adam {
        Isa::Scalar
    } else {
        adamw::detect()
    };
    let spill_dir = nvme_dir.join(format!(".megatrain-bench-engine-{}", std::process::id()));
    let rows = build_streamer(machine, case, &layout, isa, &spill_dir)
        .and_then(|s| measure(s, case, steps, trace));
    let _ = std::fs::remove_dir_all(&spill_dir);
    let planned = plan_case(case, &layout, isa, nvme_dir)?;
    Ok(summarize(case, &rows?, &planned))
}

/// The streamer of `case`: its store (spilled under `spill_dir` if the case spills) with
/// deterministic weights, AdamW pool and CPU device behind the emulated link.
fn build_streamer(
    machine: &Machine,
    case: &Case,
    layout: &StateLayout,
    isa: Isa,
    spill_dir: &std::path::Path,
) -> Result<Streamer> {
    let policy = if case.spill {
        SpillPolicy::All
    } else {
        SpillPolicy::Never
    };
    let placement = place_with_spill(
        machine,
        layout,
        None,
        RamBudget::default(),
        SpillRequest { policy, slots: 3 },
    )?;
    let store = HostStore::allocate(
        layout.clone(),
        placement,
        &StoreOptions {
            spill: case.spill.then(|| SpillOptions {
                extent_bytes: 1 << 20,
                ..SpillOptions::new(vec![spill_dir.to_owned()])
            }),
            ..StoreOptions::default()
        },
    )?;
    for u in 0..store.num_units() {
        let mut g = store.take(u)?;
        let p: Vec<f32> = (0..g.numel())
            .map(|i| ((i % 101) as f32 - 50.0) * 1e-3)
            .collect();
        g.master().write(0, &p);
    }
    let pool = AdamPool::with_isa(
        &store.placement().adam_nodes(),
        Some(case.adam_threads),
        isa,
    )?;
    let tm = Arc::new(Templates::new(&layout.config, case.seq)?);
    let link = LinkModel {
        htod_gbps: case.link_gbps,
        dtoh_gbps: case.link_gbps,
        latency_us: 10.0,
    };
    let device = Arc::new(CpuDevice::new(
        CpuDeviceConfig {
            capacity_bytes: 4 << 30,
            link: Some(link),
            jitter: None,
            shape: crate::device::program::Shape::whole(case.batch, case.seq),
            precision: crate::device::Precision::Fp32,
        },
        tm.clone(),
    )?);
    Streamer::new(
        device,
        store,
        pool,
        tm,
        StreamerConfig {
            batch: case.batch,
            seq: case.seq,
            micro_batches: 1,
            activations: Activations::Host,
            activation_dtype: crate::engine::ActivationDtype::Fp32,
            device_inputs: 0,
            adam: AdamWConfig::default(),
            grad_clip: 1.0,
            decay_norms: true,
            seed: 0,
            grad_link: crate::device::GradLink::Fp32,
        },
    )
}

/// Step `s` once to warm up, then `steps` times on deterministic tokens; the measured steps'
/// metrics (the timeline written to `trace` if given).
fn measure(
    mut s: Streamer,
    case: &Case,
    steps: usize,
    trace: Option<&std::path::Path>,
) -> Result<Vec<StepMetrics>> {
    let n = case.batch * case.seq;
    let vocab = case.model.vocab_size;
    let micro_batch = |k: usize| {
        let toks: Vec<u32> = (0..=n).map(|i| ((i * 7 + k * 13) % vocab) as u32).collect();
        MicroBatch::flat(toks[..n].to_vec(), toks[1..].to_vec(), case.seq)
    };
    let mut rows = Vec::new();
    for k in 0..steps + 1 {
        let m = s.step(&[micro_batch(k)], 1e-4)?;
        if k > 0 {
            rows.push(m); // the first step warms up (and its AdamW overlaps step 2's forward)
        }
    }
    s.finish()?;
    if let Some(dir) = trace {
        s.timeline()
            .write_chrome(&dir.join(format!("engine-{}.trace.json", case.name)))?;
    }
    Ok(rows)
}

/// The planner's view of a case: its step schedule and component costs calibrated alone.
struct Planned {
    schedule: schedule::Schedule,
    costs: Costs,
}

/// The planner's view of `case`: the same schedule, with component costs calibrated alone
/// (kernels, AdamW and the norm's Σg² on the same threads, the spill store).
fn plan_case(
    case: &Case,
    layout: &StateLayout,
    isa: Isa,
    nvme_dir: &std::path::Path,
) -> Result<Planned> {
    let cfg = &layout.config;
    let tm = Templates::new(cfg, case.seq)?;
    let kernels = calibrate_kernels(&tm, layout, case.batch, case.seq);
    let numel: Vec<usize> = layout.units.iter().map(|u| u.numel).collect();
    let adam_per_elem = calibrate_adam(numel[1], case.adam_threads, isa);
    let sumsq_per_elem = {
        let x = vec![0.5f32; numel[1]];
        time_it(3, || {
            std::hint::black_box(adamw::sumsq_parallel(&x));
        }) / numel[1] as f64
    };
    let (w_per_byte, r_per_byte, io_cpu) = if case.spill {
        calibrate_nvme(nvme_dir, 4 * numel[1])?
    } else {
        (0.0, 0.0, 0.0)
    };
    let per_unit = |rate: f64| -> Vec<f64> { numel.iter().map(|&k| k as f64 * rate).collect() };
    let costs = Costs {
        weight_elem_bytes: 4.0,
        grad_elem_bytes: 4.0,
        activation_bytes: (case.batch * case.seq * cfg.hidden_size * 4) as f64,
        htod_bps: case.link_gbps * 1e9,
        dtoh_bps: case.link_gbps * 1e9,
        copy_latency_s: 10e-6,
        // The CPU device's gradient copies land by themselves (no bounce).
        land_bps: None,
        kernels,
        adam_s: per_unit(adam_per_elem),
        norm_s: per_unit(sumsq_per_elem),
        // m + v of each unit, both zero rates without a spill.
        nvme_read_s: per_unit(8.0 * r_per_byte),
        nvme_write_s: per_unit(8.0 * w_per_byte),
        // One process: nothing to sum across ranks.
        reduce_s: Vec::new(),
        gather_s: Vec::new(),
        held: Vec::new(),
        staging_slots: 3,
        unit_numel: numel,
        lean_piece_elems: (layout.mode == Mode::Lean).then(|| layout.lean_piece_elems()),
        // The CPU device's kernels (rayon, every core) and the AdamW workers share the cores.
        shared_cores: Some(sim::SharedCores {
            cores: rayon::current_num_threads() as f64,
            compute_threads: rayon::current_num_threads() as f64,
            adam_threads: case.adam_threads as f64,
            io_cpu_fraction: io_cpu,
        }),
    };
    let spec = ScheduleSpec {
        layers: cfg.num_layers,
        tied: cfg.tie_word_embeddings,
        micro_batches: 1,
        mode: case.mode,
        activations: Activations::Host,
        activation_dtype: crate::engine::ActivationDtype::Fp32,
        device_inputs: 0,
        lean_pieces: LeanPieces::of(layout),
        ranks: 1,
        gather: crate::engine::schedule::Gather::No,
        land: false,
    };
    Ok(Planned {
        schedule: schedule::schedule(&spec),
        costs,
    })
}

/// `case`'s medians over `rows`, its bounds and ratios, beside the planner's prediction.
fn summarize(case: &Case, rows: &[StepMetrics], planned: &Planned) -> EngineCase {
    let pred = sim::simulate(&planned.schedule, &planned.costs);
    let med = |f: fn(&StepMetrics) -> f64| median(rows.iter().map(f).collect());
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
    let nvme_s = med(|m| m.nvme_busy_s);
    // The dependency bound: the schedule replayed with each resource's calibrated durations
    // scaled to what this run measured (AdamW without its waits for NVMe, which the I/O
    // resource carries), without core sharing (the measured times already include it).
    let alone = Costs {
        shared_cores: None,
        ..planned.costs.clone()
    };
    let costed = sim::simulate(&planned.schedule, &alone);
    let factor = |measured: f64, calibrated: f64| {
        if calibrated > 0.0 {
            measured / calibrated
        } else {
            1.0
        }
    };
    let scale = sim::Scale {
        compute: factor(compute_s, costed.compute_s),
        htod: factor(htod_s, costed.htod_s),
        dtoh: factor(dtoh_s, costed.dtoh_s),
        adam: factor((adam_s - med(|m| m.nvme_wait_s)).max(0.0), costed.adam_s),
        nvme: factor(nvme_s, costed.nvme_s),
    };
    let bound_s = sim::simulate_scaled(&planned.schedule, &alone, scale)
        .step_s
        .max(ideal_s);
    EngineCase {
        name: case.name.to_owned(),
        bound: case.bound.to_owned(),
        tokens: case.batch * case.seq,
        link_gbps: case.link_gbps,
        adam_threads: case.adam_threads,
        scalar_adam: case.scalar_adam,
        mode: case.mode,
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
        spilled: case.spill,
        nvme_bytes: med(|m| (m.nvme_read_bytes + m.nvme_write_bytes) as f64) as u64,
        nvme_s,
        predicted_s: pred.step_s,
        predicted_bottleneck: pred.bottleneck.to_owned(),
        predicted_parts: [
            pred.compute_s,
            pred.htod_s,
            pred.dtoh_s,
            pred.adam_s,
            pred.nvme_s,
        ],
        ratio_to_prediction: step_s / pred.step_s,
    }
}

/// Run the six configurations; spill files go under `nvme_dir`; with `trace_dir`, write each
/// one's timeline there as `engine-{case}.trace.json`.
pub fn run(
    machine: &Machine,
    steps: usize,
    nvme_dir: &std::path::Path,
    trace_dir: Option<&std::path::Path>,
) -> Result<Vec<EngineCase>> {
    super::check_count("--steps", steps, 1, super::MAX_REPS)?;
    let base = Case {
        name: "",
        bound: "",
        model: model(),
        batch: 1,
        seq: 8,
        link_gbps: 200.0,
        adam_threads: 2,
        scalar_adam: false,
        mode: Mode::Exact,
        spill: false,
    };
    let cases = [
        Case {
            name: "link-bound",
            bound: "htod (0.5 GB/s link)",
            seq: 32,
            link_gbps: 0.5,
            ..base.clone()
        },
        Case {
            name: "compute-bound",
            bound: "compute (2048 tokens)",
            batch: 4,
            seq: 512,
            link_gbps: 25.0,
            ..base.clone()
        },
        // A slow optimizer host: one thread running the scalar AdamW path. Exact mode can only
        // overlap AdamW with the next forward (the global norm needs every gradient first); lean
        // mode overlaps it with the backward too.
        Case {
            name: "adamw-bound",
            bound: "AdamW (1 scalar thread), exact",
            adam_threads: 1,
            scalar_adam: true,
            ..base.clone()
        },
        Case {
            name: "adamw-lean",
            bound: "AdamW (1 scalar thread), lean",
            adam_threads: 1,
            scalar_adam: true,
            mode: Mode::Lean,
            ..base.clone()
        },
        Case {
            name: "spill-bound",
            bound: "NVMe (all m/v spilled), exact",
            spill: true,
            ..base.clone()
        },
        Case {
            name: "spill-lean",
            bound: "NVMe (all m/v spilled), lean",
            spill: true,
            mode: Mode::Lean,
            ..base.clone()
        },
        // Every expert crosses the link (2 GB/s) and is updated (exact mode, the scalar AdamW
        // on one thread: the slow host of the AdamW cases) each step, for 8 tokens of compute:
        // the link and AdamW bound it at once.
        Case {
            name: "moe",
            bound: "link + AdamW (MoE), exact",
            model: moe_model()?,
            link_gbps: 2.0,
            adam_threads: 1,
            scalar_adam: true,
            ..base
        },
    ];
    cases
        .iter()
        .map(|c| run_case(machine, c, steps, nvme_dir, trace_dir))
        .collect()
}

/// Text table.
pub fn render(cases: &[EngineCase]) -> String {
    let moe = moe_model().ok();
    let mut s = format!(
        "megatrain bench engine — CPU device, emulated link, model {} params in {} units \
         (moe: {} params, {} active), host activations\n\
         times are medians over the measured steps, in ms; ideal = max(compute, htod, dtoh, adamw);\n\
         bound = the step's schedule replayed with the durations measured here: what its dependencies\n\
         allow (exact: AdamW waits for the global norm, so it overlaps only the next forward; lean: the\n\
         next forward waits for the first unit's update, the last of the step);\n\
         predicted = the planner's step model (megatrain plan) on the same plan, with each component\n\
         calibrated alone (kernels, AdamW, spill store, link) — a prediction, not a fit\n\n\
         {:<14} {:>6} {:>6} {:>8} {:>7} {:>7} {:>7} {:>7} {:>7} {:>7} {:>8} {:>8} {:>10} {:>10} {:>10} {:>13}\n",
        model().num_params(),
        model().num_layers + 2,
        moe.as_ref().map_or(0, |m| m.num_params()),
        moe.as_ref().map_or(0, |m| m.active_params()),
        "case", "tokens", "GB/s", "compute", "htod", "dtoh", "adamw", "nvme MB", "ideal", "bound", "step", "predicted", "step/ideal", "step/bound", "step/pred", "pred. bound"
    );
    for c in cases {
        s += &format!(
            "{:<14} {:>6} {:>6.1} {:>8.2} {:>7.2} {:>7.2} {:>7.2} {:>7.1} {:>7.2} {:>7.2} {:>8.2} {:>8.2} {:>10.3} {:>10.3} {:>10.3} {:>13}\n",
            c.name,
            c.tokens,
            c.link_gbps,
            c.compute_s * 1e3,
            c.htod_s * 1e3,
            c.dtoh_s * 1e3,
            c.adam_s * 1e3,
            c.nvme_bytes as f64 / 1e6,
            c.ideal_s * 1e3,
            c.bound_s * 1e3,
            c.step_s * 1e3,
            c.predicted_s * 1e3,
            c.ratio_to_ideal,
            c.ratio_to_bound,
            c.ratio_to_prediction,
            c.predicted_bottleneck
        );
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A 4-layer exact plan with round costs: 1 s a block forward, 3 a backward, 2 the head,
    /// 2 s of AdamW a unit, a link too fast to matter.
    fn planned() -> Planned {
        let mut costs = sim::tests::costs(6);
        costs.kernels.block_fwd = 1.0;
        costs.kernels.block_bwd = 3.0;
        costs.kernels.head = 2.0;
        costs.adam_s = vec![2.0; 6];
        // The bound replays without sharing: this must not change it.
        costs.shared_cores = Some(sim::SharedCores {
            cores: 1.0,
            compute_threads: 1.0,
            adam_threads: 1.0,
            io_cpu_fraction: 0.0,
        });
        Planned {
            schedule: schedule::schedule(&sim::tests::spec(4, Mode::Exact)),
            costs,
        }
    }

    fn case() -> Case {
        Case {
            name: "t",
            bound: "",
            model: model(),
            batch: 1,
            seq: 8,
            link_gbps: 200.0,
            adam_threads: 1,
            scalar_adam: false,
            mode: Mode::Exact,
            spill: false,
        }
    }

    #[test]
    fn the_bound_replays_the_schedule_with_the_measured_durations() {
        let p = planned();
        // Compute measured at twice its calibration (18 s → 36 s a step), AdamW as calibrated
        // (12 s): the exact step cannot start AdamW before the backward ends, so the bound is
        // the forward and backward at the measured speed (8 + 24 + 4) plus the AdamW that the
        // next forward does not hide, not the ideal max(36, 12).
        let row = StepMetrics {
            wall_s: 50.0,
            compute_s: 36.0,
            optimizer_s: 12.0,
            ..StepMetrics::default()
        };
        let c = summarize(&case(), &[row.clone(), row], &p);
        let mut doubled = Costs {
            shared_cores: None,
            ..p.costs.clone()
        };
        doubled.kernels.block_fwd *= 2.0;
        doubled.kernels.block_bwd *= 2.0;
        doubled.kernels.head *= 2.0;
        // The row measured no copy time: the bound's copies take none.
        doubled.htod_bps = f64::INFINITY;
        doubled.dtoh_bps = f64::INFINITY;
        let want = sim::simulate(&p.schedule, &doubled).step_s;
        assert!((c.bound_s - want).abs() < 1e-9, "{} vs {want}", c.bound_s);
        assert!(c.bound_s > c.ideal_s + 1.0, "{c:?}");
        assert!((c.ideal_s - 36.0).abs() < 1e-9);
        assert!((c.ratio_to_bound - 50.0 / c.bound_s).abs() < 1e-12);
        // The prediction keeps the calibrated costs and their core sharing.
        assert_eq!(c.predicted_s, sim::simulate(&p.schedule, &p.costs).step_s);
    }
}
