//! The trainer: data, the streamed training loop, validation, checkpoints, metrics, exports.
//!
//! Library code: it reports progress through [`Progress`] and never prints; the CLI decides how
//! to show it.

pub mod checkpoint;
pub mod config;
pub mod corpus;
pub mod data;
pub mod outputs;
pub mod plot;
pub mod prepare;
pub mod run_dir;

use crate::device::cpu::{CpuDevice, CpuDeviceConfig};
use crate::engine::{Activations, MicroBatch, StepMetrics, Streamer, StreamerConfig};
use crate::model::config::ModelConfig;
use crate::model::layers::Workspace;
use crate::model::reference::{eval_loss, Templates};
use crate::optim::{AdamPool, AdamWConfig};
use crate::store::layout::{Mode, StateLayout};
use crate::store::placement::{place_with_spill, RamBudget, SpillPolicy, SpillRequest};
use crate::store::{HostStore, SpillOptions, StoreOptions};
use crate::topology::{probe, Machine, TopologySource};
use crate::util::human_bytes;
use crate::{Error, Result};
use checkpoint::{ConfigChange, TrainState};
use config::TrainConfig;
use data::{Cursor, Loader, TokenFile};
use outputs::MetricsLog;
use run_dir::RunDir;
use serde::Serialize;
use std::path::{Path, PathBuf};
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
    /// Metrics lines that could not be written (each failure was a warning).
    pub metrics_failures: u64,
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
        config::DeviceKind::Cuda => Ok(Arc::new(crate::device::cuda::CudaDevice::open(
            crate::device::cuda::CudaDeviceConfig {
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

/// Everything a run needs once set up: the resolved configuration, the streamer over the host
/// store and the device, the data, and where its outputs go.
struct Session {
    cfg: TrainConfig,
    model: ModelConfig,
    run_id: String,
    /// The checkpoint directory this run holds (locked for its life).
    run_dir: Option<RunDir>,
    /// Settings changed on each resume (recorded in every checkpoint).
    changes: Vec<ConfigChange>,
    tm: Arc<Templates>,
    streamer: Streamer,
    loader: Loader,
    val_loader: Option<Loader>,
    /// The validation workspace, allocated at the first validation.
    val_ws: Option<Workspace>,
    metrics: Option<MetricsLog>,
    start_step: u64,
    /// The last step whose state is in a checkpoint on disk, and where.
    saved: Option<(u64, PathBuf)>,
}

/// Why the loop stopped early.
enum Stop {
    /// A step failed: the state may be mid-update, the last checkpoint is what survives.
    Step(Error),
    /// Something after a completed step failed (checkpoint write, validation): the state is
    /// whole and is saved before the error is reported.
    AfterStep(Error),
}

/// Run training as `cfg` says. `interrupt` is polled after every step: when set, the trainer
/// finishes the step, writes a checkpoint (with a checkpoint directory) and returns.
///
/// Every input and output is checked before step 1; a failure after training has progressed
/// saves the trained state first and names where (`Error::StateSaved`).
pub fn run(
    cfg: &TrainConfig,
    interrupt: Arc<AtomicBool>,
    progress: &mut dyn Progress,
) -> Result<Summary> {
    let mut s = setup(cfg, progress)?;
    let mut summary = Summary {
        steps: s.start_step,
        metrics: s.metrics.as_ref().map(|m| m.path().to_owned()),
        ..Summary::default()
    };
    progress.start(s.start_step + 1, s.cfg.steps, s.model.num_params());
    match train_loop(&mut s, &interrupt, progress, &mut summary) {
        Ok(()) => {}
        Err(Stop::Step(e)) => return Err(e),
        Err(Stop::AfterStep(e)) => return Err(rescue(&mut s, summary.steps, e, progress)),
    }
    if let Err(e) = write_final_outputs(&mut s, &mut summary) {
        return Err(rescue(&mut s, summary.steps, e, progress));
    }
    summary.metrics_failures = s.metrics.as_ref().map_or(0, |m| m.failed_writes);
    Ok(summary)
}

/// Check the configuration, claim the checkpoint directory, resolve the model and the mode,
/// check the outputs and the memory, then build the store, the device and the streamer.
fn setup(cfg: &TrainConfig, progress: &mut dyn Progress) -> Result<Session> {
    cfg.validate()?;
    let data_path = cfg.data.clone().ok_or_else(|| {
        Error::bad_input(
            "setting",
            "data",
            "no training data given",
            Some("pass --data FILE (or run `megatrain train --demo`)"),
        )
    })?;
    let run_dir = run_dir::claim(cfg)?;
    let resumed = run_dir.as_ref().and_then(|r| r.resume_from.clone());
    if cfg.resume == config::Resume::Auto && resumed.is_none() {
        progress.note("resume auto: no checkpoint yet, starting fresh");
    }
    let model = resolve_model(cfg, resumed.as_ref().map(|(_, st)| st))?;
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
    // Data next: bad data must fail before anything big is allocated.
    let train_file = TokenFile::open(&data_path, cfg.data_dtype, model.vocab_size)?;
    let val_file = match &cfg.val_data {
        Some(p) => Some(TokenFile::open(p, cfg.data_dtype, model.vocab_size)?),
        None => None,
    };
    let run_id = resumed
        .as_ref()
        .and_then(|(_, st)| st.run_id.clone())
        .unwrap_or_else(crate::util::lock::random_id);

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
    let mode = choose_mode(cfg, resumed.as_ref(), &machine, &model, budget, progress);
    let cfg = TrainConfig {
        mode: Some(mode),
        ..cfg.clone()
    };
    cfg.validate()?;
    let mut changes = resumed
        .as_ref()
        .map(|(_, st)| st.changes.clone())
        .unwrap_or_default();
    if let Some((_, st)) = &resumed {
        let now = run_dir::changed_settings(&st.config, &cfg);
        if !now.is_empty() {
            progress.note(&format!(
                "changed on resume: {}",
                now.iter()
                    .map(|(k, a, b)| format!("{k} {a} → {b}"))
                    .collect::<Vec<_>>()
                    .join(", ")
            ));
        }
        changes.extend(now.into_iter().map(|(key, from, to)| ConfigChange {
            step: st.step,
            key,
            from,
            to,
        }));
    }

    // Every output, and the host and device memory, before anything big is allocated.
    let layout = StateLayout::new(&model, mode);
    let params = layout.num_params() as u64;
    outputs::check(
        &cfg,
        &run_id,
        12 * params + (1 << 20),
        4 * params + (1 << 20),
    )?;
    let prelim = crate::store::placement::place_advised(
        &machine,
        &layout,
        None,
        budget,
        spill_req,
        cfg.grad_accum == 1,
    )?;
    // The CPU device's memory is host memory too: what the machine has free beside the state
    // (the RAM budget caps the state alone).
    let placed: u64 = prelim.nodes.iter().map(|n| n.bytes).sum();
    let host_room = machine
        .numa_nodes
        .iter()
        .map(|n| n.free_bytes.unwrap_or(n.memory_bytes))
        .sum::<u64>()
        .saturating_sub(placed);
    check_device_budget(&cfg, &layout, host_room)?;

    let tm = Arc::new(Templates::new(&layout.config, t)?);
    let device = open_device(&cfg, &tm, b, t)?;
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
            "spilling Adam m/v of {} of {} units to NVMe ({} of moments, {} slots x {} staging in RAM)",
            p.units.len(),
            layout.units.len(),
            human_bytes(p.nvme_bytes),
            p.slots,
            human_bytes(p.slot_bytes)
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
                run_id: Some(run_id.clone()),
                ..SpillOptions::new(cfg.nvme.clone())
            }),
        },
    )?;
    if let Some(tier) = store.spill() {
        progress.note(&format!(
            "spill files: {} on disk",
            human_bytes(tier.disk_bytes())
        ));
        for w in &tier.warnings {
            progress.note(&format!("warning: {w}"));
        }
    }
    let (start_step, cursor, prev_norm) = match &resumed {
        Some((dir, _)) => {
            let st = checkpoint::load(dir, &store)?;
            progress.note(&format!(
                "resumed from {} (step {})",
                dir.display(),
                st.step
            ));
            (st.step, st.cursor, st.prev_norm)
        }
        None => {
            match &cfg.init_from {
                Some(dir) => {
                    let r = crate::store::hf::load_into_store(dir, &store)?;
                    progress.note(&format!(
                        "loaded {} tensors from {}",
                        r.tensors,
                        dir.display()
                    ));
                }
                None => random_init(&store, cfg.seed)?,
            }
            (0, Cursor::default(), None)
        }
    };
    let loader = Loader::new(train_file, t, b, cfg.shuffle, cfg.seed, cursor)?;
    let val_loader = match val_file {
        Some(f) => Some(Loader::new(f, t, b, false, cfg.seed, Cursor::default())?),
        None => None,
    };
    let activations = choose_activations(&cfg, device.as_ref(), &layout, progress);
    // Recorded, so a resumed run and the checkpoint's configuration say what was used.
    let cfg = TrainConfig {
        activations: Some(activations),
        ..cfg
    };
    check_working_set(&cfg, device.as_ref(), &layout, activations)?;
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
            activations,
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
    let metrics = match &cfg.metrics {
        Some(p) => {
            let (log, notes) = MetricsLog::open(p, resumed.as_ref().map(|(_, st)| st.step))?;
            for n in notes {
                progress.note(&n);
            }
            Some(log)
        }
        None => None,
    };
    Ok(Session {
        saved: resumed.as_ref().map(|(d, st)| (st.step, d.clone())),
        cfg,
        model,
        run_id,
        run_dir,
        changes,
        tm,
        streamer,
        loader,
        val_loader,
        val_ws: None,
        metrics,
        start_step,
    })
}

/// The model: the resumed checkpoint's (a `--model`/`--init-from` given beside `--resume` must
/// describe the same shapes), an HF checkpoint's, or a `config.json`'s.
fn resolve_model(cfg: &TrainConfig, resumed: Option<&TrainState>) -> Result<ModelConfig> {
    let given = match (&cfg.init_from, &cfg.model) {
        (Some(dir), _) => Some(crate::store::hf::load_config(dir)?),
        (None, Some(path)) => Some(ModelConfig::from_file(path)?),
        (None, None) => None,
    };
    match (resumed, given) {
        (Some(st), Some(g)) if g != st.model => {
            let (Ok(a), Ok(b)) = (serde_json::to_value(&st.model), serde_json::to_value(&g)) else {
                return Err(Error::system(
                    "serde_json",
                    "compare model configs",
                    "unserialisable",
                ));
            };
            let diffs: Vec<String> = a
                .as_object()
                .into_iter()
                .flatten()
                .filter(|(k, v)| b.get(k.as_str()) != Some(*v))
                .map(|(k, v)| {
                    format!(
                        "{k} {v} → {}",
                        b.get(k.as_str()).cloned().unwrap_or_default()
                    )
                })
                .collect();
            Err(Error::bad_input(
                "resume",
                cfg.checkpoint_dir
                    .as_deref()
                    .map(|p| p.display().to_string())
                    .unwrap_or_default(),
                format!(
                    "the checkpoint's model differs from the one given: {}",
                    diffs.join(", ")
                ),
                Some("resume with the checkpoint's own model (drop --model/--init-from), or start a new run in another --checkpoint-dir"),
            ))
        }
        (Some(st), _) => Ok(st.model.clone()),
        (None, Some(g)) => Ok(g),
        (None, None) => Err(Error::bad_input(
            "setting",
            "model",
            "no model given",
            Some("pass --model config.json (random init) or --init-from HF_DIR"),
        )),
    }
}

/// The mode: as set, as the resumed run had it, or the planner's choice (exact if its state
/// fits the RAM budget, else lean if that fits and nothing accumulates, else exact with spill).
fn choose_mode(
    cfg: &TrainConfig,
    resumed: Option<&(PathBuf, TrainState)>,
    machine: &Machine,
    model: &ModelConfig,
    budget: RamBudget,
    progress: &mut dyn Progress,
) -> Mode {
    if let Some(m) = cfg.mode.or(resumed.and_then(|(_, st)| st.config.mode)) {
        return m;
    }
    let fits = |m: Mode| {
        crate::store::placement::fits(
            machine,
            &StateLayout::new(model, m),
            None,
            budget,
            SpillRequest::default(),
        )
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
            Mode::Exact =>
                "lean does not fit either (or gradient accumulation needs exact); spilling decides",
        }
    ));
    m
}

/// The CPU device's memory is allocated on the host: check the layer workspace and the plan's
/// buffers against `--device-memory`, and against the host memory free beside the state (`host_room`),
/// before the templates and the device are built.
fn check_device_budget(cfg: &TrainConfig, layout: &StateLayout, host_room: u64) -> Result<()> {
    if cfg.device != config::DeviceKind::Cpu {
        return Ok(());
    }
    let (b, t) = (cfg.batch_size, cfg.seq_len);
    let need = crate::device::program::workspace_bytes(&layout.config, b, t)
        + crate::engine::device_bytes(layout, b, t, cfg.grad_accum, Activations::Host);
    if need > cfg.device_memory {
        return Err(Error::bad_input(
            "device memory",
            human_bytes(cfg.device_memory),
            format!(
                "the step needs at least {} (the layer workspace, weight and gradient slots, activations)",
                human_bytes(need)
            ),
            Some("raise --device-memory, or lower --batch-size / --seq-len"),
        ));
    }
    if need > host_room {
        return Err(Error::bad_input(
            "host memory",
            human_bytes(host_room),
            format!(
                "the CPU device's working set needs {} of host memory, but only {} is free beside the training state",
                human_bytes(need),
                human_bytes(host_room)
            ),
            Some("lower --batch-size or --seq-len"),
        ));
    }
    Ok(())
}

/// Activation checkpoints: as set, else on the device when they fit beside the working set.
fn choose_activations(
    cfg: &TrainConfig,
    device: &dyn crate::device::Device,
    layout: &StateLayout,
    progress: &mut dyn Progress,
) -> Activations {
    match cfg.activations {
        Some(a) => a,
        None => {
            let mem = device.memory();
            let need = crate::engine::device_bytes(
                layout,
                cfg.batch_size,
                cfg.seq_len,
                cfg.grad_accum,
                Activations::Device,
            );
            let cp = if mem.in_use + need <= mem.capacity {
                Activations::Device
            } else {
                Activations::Host
            };
            progress.note(&format!(
                "activations: {} (chosen: device needs {} with them there, {} available)",
                match cp {
                    Activations::Device => "on the device",
                    Activations::Host => "offloaded to host",
                },
                human_bytes(need),
                human_bytes(mem.capacity.saturating_sub(mem.in_use))
            ));
            cp
        }
    }
}

/// The step's working set must fit the device beside its layer workspace.
fn check_working_set(
    cfg: &TrainConfig,
    device: &dyn crate::device::Device,
    layout: &StateLayout,
    activations: Activations,
) -> Result<()> {
    let mem = device.memory();
    let need = crate::engine::device_bytes(
        layout,
        cfg.batch_size,
        cfg.seq_len,
        cfg.grad_accum,
        activations,
    );
    let free = mem.capacity.saturating_sub(mem.in_use);
    if need <= free {
        return Ok(());
    }
    Err(Error::bad_input(
        "device memory",
        human_bytes(mem.capacity),
        format!(
            "the step's working set needs {} (weight and gradient slots, activations) but {} is free after the layer workspace",
            human_bytes(need),
            human_bytes(free)
        ),
        Some(&format!(
            "raise --device-memory by {} or lower --batch-size / --seq-len{}",
            human_bytes(need - free),
            if activations == Activations::Device {
                ", or pass --activations host"
            } else {
                ""
            }
        )),
    ))
}

/// Steps from the session's start to `cfg.steps`: a step, its metrics line, validation when
/// due, a checkpoint when due, and the interrupt flag.
fn train_loop(
    s: &mut Session,
    interrupt: &AtomicBool,
    progress: &mut dyn Progress,
    summary: &mut Summary,
) -> std::result::Result<(), Stop> {
    let (mut tokens, mut secs) = (0u64, 0.0f64);
    for step in s.start_step + 1..=s.cfg.steps {
        let batches: Vec<MicroBatch> = (0..s.cfg.grad_accum)
            .map(|_| {
                let (x, y) = s.loader.next_batch();
                MicroBatch {
                    tokens: x.into(),
                    targets: y.into(),
                }
            })
            .collect();
        let m = s
            .streamer
            .step(&batches, s.cfg.lr_at(step))
            .map_err(Stop::Step)?;
        if !m.loss.is_finite() {
            return Err(Stop::Step(
                Error::system("trainer", format!("step {step}"), format!("loss is {} (diverged)", m.loss))
                    .with_fix("lower --lr, raise --warmup-steps, or enable --grad-clip; earlier checkpoints are intact"),
            ));
        }
        tokens += m.tokens;
        secs += m.wall_s;
        summary.tokens_per_s = if secs > 0.0 {
            tokens as f64 / secs
        } else {
            0.0
        };
        summary.first_loss.get_or_insert(m.loss);
        summary.last_loss = Some(m.loss);
        summary.steps = step;
        let val = validate_if_due(s, step).map_err(Stop::AfterStep)?;
        if val.is_some() {
            summary.val_loss = val;
        }
        if let Some(log) = s.metrics.as_mut() {
            let line = serde_json::json!({
                "step": m.step, "loss": m.loss, "grad_norm": m.grad_norm, "lr": m.lr,
                "tokens_per_s": m.tokens as f64 / m.wall_s, "device_peak_bytes": m.device_peak_bytes,
                "compute_s": m.compute_s, "transfer_s": m.htod_s + m.dtoh_s, "optimizer_s": m.optimizer_s,
                "io_wait_s": m.host_wait_s, "wall_s": m.wall_s, "clip_coef": m.clip_coef,
                "htod_bytes": m.htod_bytes, "dtoh_bytes": m.dtoh_bytes, "val_loss": val,
            });
            if let Some(w) = log.append(step, m.loss, val, &line) {
                progress.note(&w);
            }
        }
        progress.step(&m, val);
        let stop = interrupt.load(Ordering::SeqCst);
        let due = s.cfg.checkpoint_every > 0 && step.is_multiple_of(s.cfg.checkpoint_every);
        if due || step == s.cfg.steps || stop {
            if let Some(root) = s.run_dir.as_ref().map(|r| r.root.clone()) {
                let d = save_checkpoint(s, &root, step).map_err(Stop::AfterStep)?;
                progress.checkpoint(&d);
                summary.checkpoint = Some(d);
            }
        }
        if stop {
            summary.interrupted = true;
            break;
        }
    }
    s.streamer.finish().map_err(Stop::Step)
}

/// Validation loss when it is due at `step`.
fn validate_if_due(s: &mut Session, step: u64) -> Result<Option<f64>> {
    let Some(vl) = s.val_loader.as_mut() else {
        return Ok(None);
    };
    let every = s.cfg.val_every;
    if !((every > 0 && step.is_multiple_of(every)) || step == s.cfg.steps) {
        return Ok(None);
    }
    let (b, t) = (s.cfg.batch_size, s.cfg.seq_len);
    let ws = s
        .val_ws
        .get_or_insert_with(|| Workspace::new(&s.model, b, t));
    validate(&mut s.streamer, &s.tm, vl, s.cfg.val_batches, b, t, ws).map(Some)
}

/// Write a checkpoint of the current state (after `step`) under `root`.
fn save_checkpoint(s: &mut Session, root: &Path, step: u64) -> Result<PathBuf> {
    s.streamer.finish()?;
    let state = TrainState {
        format: checkpoint::FORMAT,
        run_id: Some(s.run_id.clone()),
        step,
        cursor: s.loader.cursor,
        prev_norm: s.streamer.prev_norm(),
        model: s.model.clone(),
        config: s.cfg.clone(),
        changes: s.changes.clone(),
    };
    let d = checkpoint::save(root, s.streamer.store(), &state, s.cfg.keep_checkpoints)?;
    s.saved = Some((step, d.clone()));
    Ok(d)
}

/// The HF export, the loss curve and the trace.
fn write_final_outputs(s: &mut Session, summary: &mut Summary) -> Result<()> {
    if let Some(out) = &s.cfg.export_hf {
        crate::store::hf::export_store(s.streamer.store(), out, 2 << 30, Some(&s.run_id))?;
        summary.export = Some(out.clone());
    }
    if let Some(log) = &s.metrics {
        let svg = log.path().with_extension("svg");
        crate::util::write_atomic(
            &svg,
            plot::loss_svg(&log.curve, &log.val_curve, "megatrain: loss per step").as_bytes(),
        )?;
        summary.plot = Some(svg);
    }
    if let Some(p) = &s.cfg.trace {
        s.streamer.timeline().write_chrome(p)?;
        summary.trace = Some(p.clone());
    }
    Ok(())
}

/// `error` happened after `step` completed: make sure the trained state is in a checkpoint (the
/// run's own if it already is or can be written, else a rescue directory beside the working
/// directory), then return the error naming where.
fn rescue(s: &mut Session, step: u64, error: Error, progress: &mut dyn Progress) -> Error {
    if step <= s.start_step {
        return error;
    }
    if let Some((saved_step, dir)) = &s.saved {
        if *saved_step == step {
            let root = dir.parent().map(Path::to_path_buf).unwrap_or_default();
            return Error::StateSaved {
                source: Box::new(error),
                step,
                saved: dir.clone(),
                root,
            };
        }
    }
    let mut roots: Vec<PathBuf> = s.run_dir.iter().map(|r| r.root.clone()).collect();
    let rescue_name = format!("megatrain-rescue-{}", s.run_id);
    roots.push(PathBuf::from(&rescue_name));
    roots.push(std::env::temp_dir().join(&rescue_name));
    for root in roots {
        progress.note(&format!(
            "saving the trained state (step {step}) to {} before reporting the error",
            root.display()
        ));
        match save_checkpoint(s, &root, step) {
            Ok(dir) => {
                return Error::StateSaved {
                    source: Box::new(error),
                    step,
                    saved: dir,
                    root,
                }
            }
            Err(e) => progress.note(&format!("  could not: {e}")),
        }
    }
    error
}
