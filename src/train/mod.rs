//! The trainer: data, the streamed training loop, validation, checkpoints, metrics, exports.
//!
//! Library code: it reports progress through [`Progress`] and never prints; the CLI decides how
//! to show it.

pub mod checkpoint;
pub mod config;
pub mod corpus;
pub mod data;
pub mod plot;
pub mod prepare;

use crate::device::cpu::{CpuDevice, CpuDeviceConfig};
use crate::engine::{Checkpoints, MicroBatch, StepMetrics, Streamer, StreamerConfig};
use crate::model::config::ModelConfig;
use crate::model::layers::Workspace;
use crate::model::reference::{eval_loss, Templates};
use crate::optim::{AdamPool, AdamWConfig};
use crate::store::layout::{Mode, StateLayout};
use crate::store::placement::{place_with_spill, RamBudget, SpillPolicy, SpillRequest};
use crate::store::{HostStore, SpillOptions, StoreOptions};
use crate::topology::{probe, TopologySource};
use crate::{Error, Result};
use checkpoint::TrainState;
use config::TrainConfig;
use data::{Cursor, Loader, TokenFile};
use serde::Serialize;
use std::io::Write;
use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// What the trainer tells its caller.
pub trait Progress {
    /// Training is about to start at `first_step` (> 1 when resumed) of `total`.
    fn start(&mut self, _first_step: u64, _total: u64, _params: usize) {}
    /// A step finished.
    fn step(&mut self, _m: &StepMetrics, _val_loss: Option<f64>) {}
    /// A checkpoint was written.
    fn checkpoint(&mut self, _dir: &std::path::Path) {}
    /// A one-line note (resumed from, exported to, ...).
    fn note(&mut self, _line: &str) {}
}

/// Where the run's outputs went.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    /// Steps done in total.
    pub steps: u64,
    /// First and last training loss of this run.
    pub first_loss: Option<f64>,
    /// Last training loss.
    pub last_loss: Option<f64>,
    /// Last validation loss.
    pub val_loss: Option<f64>,
    /// Mean tokens/s over this run's steps.
    pub tokens_per_s: f64,
    /// Newest checkpoint.
    pub checkpoint: Option<PathBuf>,
    /// HF export.
    pub export: Option<PathBuf>,
    /// Metrics file.
    pub metrics: Option<PathBuf>,
    /// Loss curve.
    pub plot: Option<PathBuf>,
    /// Chrome trace.
    pub trace: Option<PathBuf>,
    /// Stopped early by an interrupt.
    pub interrupted: bool,
}

/// Deterministic N(0, σ²) samples (splitmix64 + Box–Muller).
fn normal_fill(x: &mut [f32], seed: u64, std: f32) {
    let mut s = seed;
    let mut next = || {
        s = s.wrapping_add(0x9E37_79B9_7F4A_7C15);
        let mut z = s;
        z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
        z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
        ((z ^ (z >> 31)) >> 11) as f64 / (1u64 << 53) as f64
    };
    for pair in x.chunks_mut(2) {
        let (u1, u2) = (next().max(1e-300), next());
        let r = (-2.0 * u1.ln()).sqrt();
        let t = 2.0 * std::f64::consts::PI * u2;
        pair[0] = (r * t.cos()) as f32 * std;
        if pair.len() > 1 {
            pair[1] = (r * t.sin()) as f32 * std;
        }
    }
}

/// Random init as HF does for Llama: N(0, 0.02) for matrices and embeddings, 1 for norm weights,
/// 0 for biases; seeded per tensor.
fn random_init(store: &HostStore, seed: u64) -> Result<()> {
    let layout = store.layout().clone();
    for (u, unit) in layout.units.iter().enumerate() {
        let mut g = store.take(u)?;
        let p = g.params();
        for (i, t) in unit.tensors.iter().enumerate() {
            let dst = &mut p[t.offset..t.offset + t.numel()];
            if t.name.ends_with("norm.weight") {
                dst.fill(1.0);
            } else if t.name.ends_with(".bias") {
                dst.fill(0.0);
            } else {
                normal_fill(
                    dst,
                    seed ^ ((u as u64) << 32 | i as u64).wrapping_mul(0xD134_2543_DE82_EF95),
                    0.02,
                );
            }
        }
    }
    Ok(())
}

/// The compute device the configuration names, for micro-batches of `b`×`t` tokens.
fn open_device(
    cfg: &TrainConfig,
    tm: &Arc<Templates>,
    b: usize,
    t: usize,
) -> Result<Arc<dyn crate::device::Device>> {
    match cfg.device {
        config::DeviceKind::Cpu => Ok(Arc::new(CpuDevice::new(
            CpuDeviceConfig {
                capacity_bytes: cfg.device_memory,
                link: None,
                jitter: None,
                batch: b,
                seq: t,
            },
            tm.clone(),
        )?)),
        #[cfg(feature = "cuda")]
        config::DeviceKind::Cuda => Ok(Arc::new(crate::device::cuda_device::CudaDevice::open(
            crate::device::cuda_device::CudaDeviceConfig {
                ordinal: 0,
                batch: b,
                seq: t,
                capacity_bytes: None,
                tf32: cfg.tf32,
            },
            tm.clone(),
        )?)),
        #[cfg(not(feature = "cuda"))]
        config::DeviceKind::Cuda => Err(Error::bad_input(
            "device",
            "cuda",
            "this megatrain was built without CUDA support",
            Some("rebuild with `cargo build --release --features cuda`"),
        )),
    }
}

/// Validation loss (mean per token) over `batches` micro-batches of `loader`, with the current
/// params resident on the host (the streamer must be idle).
fn validate(
    streamer: &mut Streamer,
    tm: &Templates,
    loader: &mut Loader,
    batches: usize,
    b: usize,
    t: usize,
    ws: &mut Workspace,
) -> Result<f64> {
    streamer.finish()?;
    let store = streamer.store();
    let mut guards: Vec<_> = (0..store.num_units())
        .map(|u| store.take(u))
        .collect::<Result<_>>()?;
    let params: Vec<Vec<f32>> = guards.iter_mut().map(|g| g.params().to_vec()).collect();
    drop(guards);
    let refs: Vec<&[f32]> = params.iter().map(|p| &p[..]).collect();
    let mut total = 0.0;
    for _ in 0..batches.max(1) {
        let (x, y) = loader.next_batch();
        total += eval_loss(tm, &refs, &x, &y, b, t, ws)?;
    }
    Ok(total / (batches.max(1) * b * t) as f64)
}

/// Run training as `cfg` says. `interrupt` is polled after every step: when set, the trainer
/// finishes the step, writes a checkpoint and returns.
pub fn run(
    cfg: &TrainConfig,
    interrupt: Arc<AtomicBool>,
    progress: &mut dyn Progress,
) -> Result<Summary> {
    cfg.validate()?;
    let data_path = cfg.data.clone().ok_or_else(|| {
        Error::bad_input(
            "setting",
            "data",
            "no training data given",
            Some("pass --data FILE (or run `megatrain train --demo`)"),
        )
    })?;
    // The model: from the checkpoint being resumed, an HF checkpoint, or a config.json.
    let resume_dir = match (&cfg.checkpoint_dir, cfg.resume) {
        (Some(d), true) => checkpoint::latest(d)?,
        _ => None,
    };
    // The resumed run's state.json, read once: its model and the mode it ran in.
    let resumed = match &resume_dir {
        Some(d) => Some(checkpoint::read_state(d)?),
        None => None,
    };
    let model: ModelConfig = match (&resumed, &cfg.init_from, &cfg.model) {
        (Some(st), _, _) => st.model.clone(),
        (None, Some(dir), _) => crate::model::hf::load_config(dir)?,
        (None, None, Some(path)) => ModelConfig::from_file(path)?,
        (None, None, None) => {
            return Err(Error::bad_input(
                "setting",
                "model",
                "no model given",
                Some("pass --model config.json (random init) or --init-from HF_DIR"),
            ))
        }
    };
    let (b, t) = (cfg.batch_size, cfg.seq_len);
    if t > model.max_position_embeddings {
        return Err(Error::bad_input(
            "--seq-len",
            t.to_string(),
            format!(
                "exceeds max_position_embeddings {}",
                model.max_position_embeddings
            ),
            None,
        ));
    }
    // Data first: bad data must fail before anything big is allocated.
    let train_file = TokenFile::open(&data_path, cfg.data_dtype, model.vocab_size)?;
    let mut val_loader = match &cfg.val_data {
        Some(p) => Some(Loader::new(
            TokenFile::open(p, cfg.data_dtype, model.vocab_size)?,
            t,
            b,
            false,
            cfg.seed,
            Cursor::default(),
        )?),
        None => None,
    };

    let machine = probe(&TopologySource::Live)?;
    let budget = RamBudget {
        total_bytes: cfg.ram_budget,
        ..RamBudget::default()
    };
    let spill_req = SpillRequest {
        policy: if cfg.nvme.is_empty() {
            SpillPolicy::Never
        } else {
            cfg.spill
        },
        slots: cfg.spill_staging,
    };
    // The mode: as set, as the resumed run had it, or the planner's choice.
    let mode = match cfg.mode.or(resumed.as_ref().and_then(|st| st.config.mode)) {
        Some(m) => m,
        None => {
            let fits = |m: Mode| {
                place_with_spill(
                    &machine,
                    &StateLayout::new(&model, m, false),
                    None,
                    budget,
                    SpillRequest::default(),
                )
                .is_ok()
            };
            let exact_fits = fits(Mode::Exact);
            let m = if exact_fits || cfg.grad_accum > 1 || !fits(Mode::Lean) {
                Mode::Exact
            } else {
                Mode::Lean
            };
            progress.note(&format!(
                "mode: {} (chosen: {})",
                match m {
                    Mode::Exact => "exact",
                    Mode::Lean => "lean",
                },
                match m {
                    Mode::Lean => "the exact state does not fit the RAM budget, the lean one does",
                    Mode::Exact if exact_fits => "the whole exact state fits in RAM",
                    Mode::Exact => "lean does not fit either (or gradient accumulation needs exact); spilling decides",
                }
            ));
            m
        }
    };
    let cfg = &TrainConfig {
        mode: Some(mode),
        ..cfg.clone()
    };
    cfg.validate()?;
    let layout = StateLayout::new(&model, mode, false);
    let tm = Arc::new(Templates::new(&layout, t)?);
    let device = open_device(cfg, &tm, b, t)?;
    // A GPU finds its NUMA node by PCI address: params and grads go next to it.
    let pci = device.pci_bus_id();
    let gpu = pci.as_deref().and_then(|id| machine.gpu_by_pci_bus_id(id));
    progress.note(&format!(
        "device: {}{}",
        device.name(),
        match (&pci, gpu) {
            (Some(id), Some(i)) => format!(
                " at {id}: host state streamed from NUMA node(s) {:?}",
                machine.gpus[i].numa_nodes
            ),
            (Some(id), None) =>
                format!(" at {id}: not in the probed topology, placed as for no GPU"),
            _ => String::new(),
        }
    ));
    let placement = place_with_spill(&machine, &layout, gpu, budget, spill_req)?;
    if let Some(p) = &placement.spill {
        progress.note(&format!(
            "spilling Adam m/v of {} of {} units to NVMe ({} on disk, {} slots x {} staging in RAM)",
            p.units.len(),
            layout.units.len(),
            crate::util::human_bytes(p.nvme_bytes),
            p.slots,
            crate::util::human_bytes(p.slot_bytes)
        ));
    }
    let store = HostStore::allocate(
        layout.clone(),
        placement,
        &StoreOptions {
            registrar: device.registrar().map(crate::store::SharedRegistrar),
            pages: cfg.huge_pages,
            lock: cfg.lock_memory,
            unbound: false,
            spill: (!cfg.nvme.is_empty()).then(|| SpillOptions {
                engine: cfg.io_engine,
                direct: cfg.direct_io,
                ..SpillOptions::new(cfg.nvme.clone())
            }),
        },
    )?;
    if let Some(t) = store.spill() {
        for w in &t.warnings {
            progress.note(&format!("warning: {w}"));
        }
    }
    let mut start_step = 0;
    let mut cursor = Cursor::default();
    let mut prev_norm = None;
    if let Some(d) = &resume_dir {
        let st = checkpoint::load(d, &store)?;
        start_step = st.step;
        cursor = st.cursor;
        prev_norm = st.prev_norm;
        progress.note(&format!("resumed from {} (step {})", d.display(), st.step));
    } else if let Some(dir) = &cfg.init_from {
        let r = crate::model::hf::load_into_store(dir, &store)?;
        progress.note(&format!(
            "loaded {} tensors from {}",
            r.tensors,
            dir.display()
        ));
    } else {
        random_init(&store, cfg.seed)?;
    }
    let mut loader = Loader::new(train_file, t, b, cfg.shuffle, cfg.seed, cursor)?;

    // Activation checkpoints: as set, else on the device when they fit beside the working set.
    let checkpoints = match cfg.activations {
        Some(config::Activations::Device) => Checkpoints::Device,
        Some(config::Activations::Host) => Checkpoints::Host,
        None => {
            let mem = crate::device::Device::memory(device.as_ref());
            let need =
                crate::engine::device_bytes(&layout, b, t, cfg.grad_accum, Checkpoints::Device);
            let cp = if mem.in_use + need <= mem.capacity {
                Checkpoints::Device
            } else {
                Checkpoints::Host
            };
            progress.note(&format!(
                "activations: {} (chosen: device needs {} with them there, {} available)",
                match cp {
                    Checkpoints::Device => "on the device",
                    Checkpoints::Host => "offloaded to host",
                },
                crate::util::human_bytes(need),
                crate::util::human_bytes(mem.capacity.saturating_sub(mem.in_use))
            ));
            cp
        }
    };
    // Recorded, so a resumed run and the checkpoint's configuration say what was used.
    let cfg = &TrainConfig {
        activations: Some(match checkpoints {
            Checkpoints::Device => config::Activations::Device,
            Checkpoints::Host => config::Activations::Host,
        }),
        ..cfg.clone()
    };
    {
        let mem = crate::device::Device::memory(device.as_ref());
        let need = crate::engine::device_bytes(&layout, b, t, cfg.grad_accum, checkpoints);
        let free = mem.capacity.saturating_sub(mem.in_use);
        if need > free {
            return Err(Error::bad_input(
                "device memory",
                crate::util::human_bytes(mem.capacity),
                format!(
                    "the step's working set needs {} (weight and gradient slots, activations) but {} is free after the layer workspace",
                    crate::util::human_bytes(need),
                    crate::util::human_bytes(free)
                ),
                Some(&format!(
                    "raise --device-memory by {} or lower --batch-size / --seq-len{}",
                    crate::util::human_bytes(need - free),
                    if checkpoints == Checkpoints::Device { ", or pass --activations host" } else { "" }
                )),
            ));
        }
    }
    let pool = AdamPool::for_placement(store.placement(), None)?;
    let mut streamer = Streamer::new(
        device,
        store,
        pool,
        tm.clone(),
        StreamerConfig {
            batch: b,
            seq: t,
            micro_batches: cfg.grad_accum,
            checkpoints,
            adam: AdamWConfig {
                lr: cfg.lr,
                beta1: cfg.beta1,
                beta2: cfg.beta2,
                eps: cfg.eps,
                weight_decay: cfg.weight_decay,
            },
            grad_clip: cfg.grad_clip,
            decay_norms: cfg.decay_norms,
        },
    )?;
    streamer.resume_at(start_step, prev_norm);
    let mut ws = Workspace::new(&model, b, t);

    let mut metrics_file = match &cfg.metrics {
        Some(p) => {
            if let Some(dir) = p.parent().filter(|d| !d.as_os_str().is_empty()) {
                std::fs::create_dir_all(dir).map_err(|e| Error::io("create directory", dir, e))?;
            }
            let f = std::fs::OpenOptions::new()
                .create(true)
                .append(start_step > 0)
                .write(true)
                .truncate(start_step == 0)
                .open(p)
                .map_err(|e| Error::io("open metrics", p, e))?;
            Some(std::io::BufWriter::new(f))
        }
        None => None,
    };
    let mut summary = Summary {
        steps: start_step,
        metrics: cfg.metrics.clone(),
        ..Summary::default()
    };
    let mut curve: Vec<(u64, f64)> = Vec::new();
    let mut val_curve: Vec<(u64, f64)> = Vec::new();
    let (mut tok, mut secs) = (0u64, 0.0f64);
    progress.start(start_step + 1, cfg.steps, layout.num_params());
    let save = |streamer: &mut Streamer, step: u64, loader: &Loader| -> Result<Option<PathBuf>> {
        let Some(root) = &cfg.checkpoint_dir else {
            return Ok(None);
        };
        streamer.finish()?;
        let state = TrainState {
            format: checkpoint::FORMAT,
            step,
            cursor: loader.cursor,
            prev_norm: streamer.prev_norm(),
            model: model.clone(),
            config: cfg.clone(),
        };
        checkpoint::save(root, streamer.store(), &state, cfg.keep_checkpoints).map(Some)
    };
    for step in start_step + 1..=cfg.steps {
        let batches: Vec<MicroBatch> = (0..cfg.grad_accum)
            .map(|_| {
                let (x, y) = loader.next_batch();
                MicroBatch {
                    tokens: x.into(),
                    targets: y.into(),
                }
            })
            .collect();
        let m = streamer.step(&batches, cfg.lr_at(step))?;
        if !m.loss.is_finite() {
            return Err(Error::system("trainer", format!("step {step}"), format!("loss is {} (diverged)", m.loss))
                .with_fix("lower --lr, raise --warmup-steps, or enable --grad-clip; earlier checkpoints are intact"));
        }
        tok += m.tokens;
        secs += m.wall_s;
        summary.first_loss.get_or_insert(m.loss);
        summary.last_loss = Some(m.loss);
        summary.steps = step;
        curve.push((step, m.loss));
        let val = match (&mut val_loader, cfg.val_every) {
            (Some(vl), every) if (every > 0 && step % every == 0) || step == cfg.steps => {
                let v = validate(&mut streamer, &tm, vl, cfg.val_batches, b, t, &mut ws)?;
                val_curve.push((step, v));
                summary.val_loss = Some(v);
                Some(v)
            }
            _ => None,
        };
        if let Some(f) = metrics_file.as_mut() {
            let line = serde_json::json!({
                "step": m.step, "loss": m.loss, "grad_norm": m.grad_norm, "lr": m.lr,
                "tokens_per_s": m.tokens as f64 / m.wall_s, "device_peak_bytes": m.device_peak_bytes,
                "compute_s": m.compute_s, "transfer_s": m.htod_s + m.dtoh_s, "optimizer_s": m.optimizer_s,
                "io_wait_s": m.host_wait_s, "wall_s": m.wall_s, "clip_coef": m.clip_coef,
                "htod_bytes": m.htod_bytes, "dtoh_bytes": m.dtoh_bytes, "val_loss": val,
            });
            writeln!(f, "{line}").map_err(|e| {
                Error::io("write metrics", cfg.metrics.clone().unwrap_or_default(), e)
            })?;
            f.flush().map_err(|e| {
                Error::io("write metrics", cfg.metrics.clone().unwrap_or_default(), e)
            })?;
        }
        progress.step(&m, val);
        let stop = interrupt.load(Ordering::SeqCst);
        if (cfg.checkpoint_every > 0 && step % cfg.checkpoint_every == 0)
            || step == cfg.steps
            || stop
        {
            if let Some(d) = save(&mut streamer, step, &loader)? {
                progress.checkpoint(&d);
                summary.checkpoint = Some(d);
            }
        }
        if stop {
            summary.interrupted = true;
            break;
        }
    }
    streamer.finish()?;
    summary.tokens_per_s = if secs > 0.0 { tok as f64 / secs } else { 0.0 };
    if let Some(out) = &cfg.export_hf {
        crate::model::hf::export_store(streamer.store(), out, 2 << 30)?;
        summary.export = Some(out.clone());
    }
    if let Some(p) = &cfg.metrics {
        let svg = p.with_extension("svg");
        crate::util::write_atomic(
            &svg,
            plot::loss_svg(&curve, &val_curve, "megatrain: loss per step").as_bytes(),
        )?;
        summary.plot = Some(svg);
    }
    if let Some(p) = &cfg.trace {
        streamer.timeline().write_chrome(p)?;
        summary.trace = Some(p.clone());
    }
    Ok(summary)
}
