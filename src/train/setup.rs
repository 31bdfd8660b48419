//! Setting a run up: the configuration checked, the checkpoint directory claimed, the model and
//! data resolved, every output and the memory checked before anything big is allocated, then the
//! device, the host store, the restored state and the streamer.

use super::checkpoint::{self, ConfigChange, TrainState};
use super::config::{self, TrainConfig};
use super::data::{Cursor, DataFile, Loader, RowSpec};
use super::device_fit::{
    check_device_budget, check_working_set, choose_activations, cpu_shape, note_chunks,
};
use super::generate::TrainingSamples;
use super::outputs::{self, MetricsLog};
use super::ranks::{self, share_start};
use super::run_dir::{self, RunDir};
use super::step_log::FlopRate;
use super::tensorboard::TensorBoardLog;
use super::Progress;
use crate::device::cpu::{CpuDevice, CpuDeviceConfig};
use crate::device::Precision;
use crate::dist::{Collective, HostShare};
use crate::engine::{Activations, Streamer, StreamerConfig};
use crate::model::config::ModelConfig;
use crate::model::reference::Templates;
use crate::optim::{AdamPool, AdamWConfig};
use crate::store::layout::{MasterFormat, Mode, StateLayout, UnitOwners};
use crate::store::placement::{place_with_spill, RamBudget, SpillPolicy, SpillRequest};
use crate::store::{HostStore, SpillOptions, StoreOptions};
use crate::topology::{probe, Machine, TopologySource};
use crate::util::human_bytes;
use crate::{Error, Result};
use std::path::PathBuf;
use std::sync::Arc;

/// Everything a run needs once set up: the resolved configuration, the streamer over the host
/// store and the device, the data, and where its outputs go.
pub(super) struct Session {
    pub(super) cfg: TrainConfig,
    pub(super) model: ModelConfig,
    pub(super) run_id: String,
    /// The checkpoint directory this run holds (locked for its life).
    pub(super) run_dir: Option<RunDir>,
    /// Settings changed on each resume (recorded in every checkpoint).
    pub(super) changes: Vec<ConfigChange>,
    pub(super) streamer: Streamer,
    pub(super) loader: Loader,
    pub(super) val_loader: Option<Loader>,
    pub(super) metrics: Option<MetricsLog>,
    /// `--tensorboard`'s event file of this run start.
    pub(super) tensorboard: Option<TensorBoardLog>,
    /// What a step's model FLOP rate is measured against.
    pub(super) flop_rate: FlopRate,
    pub(super) start_step: u64,
    /// The last step whose state is in a checkpoint on disk, and where.
    pub(super) saved: Option<(u64, PathBuf)>,
    /// The checkpoint being written while the next step runs.
    pub(super) writing: Option<super::checkpoint::InFlight>,
    /// A sharded job's checkpoint being written by every rank (the same on every rank).
    pub(super) job_writing: Option<super::checkpoint::JobInFlight>,
    /// A job with its Adam state sharded (`--zero-stage 1`) whose rank 0 writes checkpoints:
    /// every rank takes part in each (rank 0 lacks the other ranks' moments).
    pub(super) joint_checkpoints: bool,
    /// `--sample-every`'s samples.
    pub(super) samples: Option<TrainingSamples>,
}

/// What a run starts from: its checkpoint directory, the checkpoint it resumes (if any), the
/// model, the data, its identity.
struct Inputs {
    run_dir: Option<RunDir>,
    resumed: Option<(PathBuf, TrainState)>,
    model: ModelConfig,
    train_file: DataFile,
    val_file: Option<DataFile>,
    run_id: String,
}

/// Check the configuration, claim the checkpoint directory, resolve the model and the mode,
/// check the outputs and the memory, then build the device, the store and the streamer.
pub(super) fn setup(
    cfg: &TrainConfig,
    world: Arc<dyn Collective>,
    progress: &mut dyn Progress,
) -> Result<Session> {
    cfg.validate()?;
    // Ranks sharing a host share its CPUs (the AdamW workers take their node's CPUs within
    // this rank's part: `build_streamer`).
    HostShare::of(world.as_ref()).bind()?;
    let gathers_params = cfg.zero_stage == 3 && world.size() > 1;
    if gathers_params {
        ranks::check_sharded_outputs(cfg)?;
    }
    let cfg = &ranks::rank_outputs(cfg, world.rank(), gathers_params);
    outputs::check_paths(cfg)?;
    let inputs = inputs(cfg, world.as_ref(), progress)?;
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
    let resumed = inputs.resumed.as_ref();
    let adam_state = cfg
        .adam_state
        .or_else(|| resumed.map(|(_, st)| checkpoint::adam_state_of(st)))
        .unwrap_or_default();
    // A resumed run keeps the precision it was trained in unless `--precision` says otherwise.
    let precision = cfg
        .precision
        .or_else(|| resumed.and_then(|(_, st)| st.config.precision))
        .unwrap_or_else(|| cfg.resolved_precision());
    let cfg = TrainConfig {
        adam_state: Some(adam_state),
        precision: Some(precision),
        ..cfg.clone()
    };
    // So do its layer inputs' storage (else the precision's).
    let activation_dtype = cfg
        .activation_dtype
        .or_else(|| resumed.and_then(|(_, st)| st.config.activation_dtype))
        .unwrap_or_else(|| cfg.resolved_activation_dtype());
    let cfg = TrainConfig {
        activation_dtype: Some(activation_dtype),
        ..cfg
    };
    cfg.check_grad_link()?;
    cfg.check_activation_dtype()?;
    let sharded = cfg.zero_stage > 0 && world.size() > 1;
    if cfg.zero_stage > 0 && !sharded {
        progress.note(&format!(
            "--zero-stage {}: one process holds the whole state (sharding needs ranks)",
            cfg.zero_stage
        ));
    }
    let mode = choose_mode(
        &cfg,
        resumed,
        &machine,
        &inputs.model,
        budget,
        sharded.then(|| (world.size(), cfg.zero_stage)),
        progress,
    );
    let cfg = TrainConfig {
        mode: Some(mode),
        ..cfg
    };
    ranks::check_step_agrees(
        world.as_ref(),
        &cfg,
        mode,
        &inputs.model,
        resumed.map_or(0, |(_, st)| st.step),
    )?;
    let changes = settings_changed(&cfg, resumed, progress);
    let samples = TrainingSamples::for_run(&cfg, inputs.model.vocab_size)?;
    // Every output, and the host and device memory, before anything big is allocated.
    // bf16 streams the high plane of a master stored as planes (exact fp32, no shadow copy).
    let master = match cfg.resolved_precision() {
        Precision::Fp32 => MasterFormat::Fp32,
        Precision::Bf16 => MasterFormat::Planes,
    };
    let mut layout = StateLayout::new(&inputs.model, mode)
        .with_adam_state(adam_state)
        .with_master(master);
    let gpu = ranks::gpu_slot(world.as_ref(), cfg.device)?;
    let (device_gather, host_gather_why) = ranks::gathers_on_device(world.as_ref(), &cfg, gpu)?;
    if sharded {
        layout = ranks::shard_state(
            world.as_ref(),
            &cfg,
            layout,
            device_gather,
            host_gather_why,
            progress,
        );
    }
    // Whether rank 0 writes checkpoints, told to every rank (a sharded job's all take part).
    let joint_checkpoints = sharded && crate::dist::any(world.as_ref(), inputs.run_dir.is_some())?;
    check_before_allocating(&cfg, &layout, &machine, budget, spill_req, &inputs.run_id)?;
    let tm = Arc::new(Templates::new(&layout.config, cfg.seq_len)?);
    if gpu != ranks::GpuSlot::ALONE {
        progress.note(&format!(
            "GPU {} of this host's visible ones{}",
            gpu.ordinal,
            match gpu.shared_by {
                1 => String::new(),
                n => format!(", shared by {n} ranks (each takes 1/{n} of its memory)"),
            }
        ));
    }
    let joined = layout.gathers_on_device().then(|| world.clone());
    let device = open_device(&cfg, &tm, &layout, (gpu, joined))?;
    note_chunks(device.as_ref(), progress);
    let flop_rate = FlopRate::of(&inputs.model, &cfg, &device.name());
    let store = allocate_store(
        &cfg,
        layout,
        &machine,
        &*device,
        (budget, spill_req),
        &inputs.run_id,
        progress,
    )?;
    let (start_step, cursor, prev_norm) = restore(&cfg, resumed, &store, world.as_ref(), progress)?;
    let (activations, device_inputs) =
        choose_activations(&cfg, device.as_ref(), store.layout(), progress);
    // Recorded, so a resumed run and the checkpoint's configuration say what was used.
    let cfg = TrainConfig {
        activations: Some(activations),
        ..cfg
    };
    let placed = (activations, device_inputs);
    check_working_set(&cfg, device.as_ref(), store.layout(), placed)?;
    let mut streamer = build_streamer(&cfg, device, store, tm.clone(), placed)?.with_world(world);
    streamer.resume_at(start_step, prev_norm);
    let (b, t) = (cfg.batch_size, cfg.seq_len);
    let rows = RowSpec {
        seq: t,
        batch: b,
        packing: cfg.packing,
        overlong: cfg.overlong,
    };
    let loader = Loader::new(inputs.train_file, rows, cfg.shuffle, cfg.seed, cursor)?;
    let val_loader = match inputs.val_file {
        Some(f) => Some(Loader::new(f, rows, false, cfg.seed, Cursor::default())?),
        None => None,
    };
    for (what, l) in [
        ("training", Some(&loader)),
        ("validation", val_loader.as_ref()),
    ] {
        if let Some(r) = l.and_then(Loader::packed) {
            progress.note(
                &format!("{what} data: {r} (packing {:?}, rows of {t})", cfg.packing)
                    .to_lowercase(),
            );
        }
    }
    let metrics = match &cfg.metrics {
        Some(p) => {
            let (log, notes) = MetricsLog::open(p, resumed.map(|(_, st)| st.step))?;
            for n in notes {
                progress.note(&n);
            }
            Some(log)
        }
        None => None,
    };
    let tensorboard = match &cfg.tensorboard {
        Some(dir) => Some(TensorBoardLog::create(dir, start_step + 1, &cfg.table())?),
        None => None,
    };
    Ok(Session {
        saved: resumed.map(|(d, st)| (st.step, d.clone())),
        writing: None,
        job_writing: None,
        joint_checkpoints,
        cfg,
        model: inputs.model,
        run_id: inputs.run_id,
        run_dir: inputs.run_dir,
        changes,
        streamer,
        loader,
        val_loader,
        metrics,
        tensorboard,
        flop_rate,
        start_step,
        samples,
    })
}

/// The checkpoint directory (claimed), what it resumes, the model, the data (opened and scanned
/// before anything big is allocated) and the run's identity.
fn inputs(
    cfg: &TrainConfig,
    world: &dyn Collective,
    progress: &mut dyn Progress,
) -> Result<Inputs> {
    let data_path = cfg.data.clone().ok_or_else(|| {
        Error::bad_input(
            "setting",
            "data",
            "no training data given",
            Some("pass --data FILE (or run `megatrain train --demo`)"),
        )
    })?;
    // Rank 0 owns the checkpoint directory; the others resume from what it chose.
    let run_dir = match world.rank() {
        0 => run_dir::claim(cfg)?,
        _ => None,
    };
    let mut resumed = run_dir.as_ref().and_then(|r| r.resume_from.clone());
    let lead_id = resumed
        .as_ref()
        .and_then(|(_, st)| st.run_id.clone())
        .unwrap_or_else(crate::util::lock::random_id);
    let (run_id, resume_path) = share_start(world, &lead_id, resumed.as_ref().map(|(d, _)| d))?;
    if world.rank() != 0 {
        resumed = match resume_path {
            Some(dir) => Some((dir.clone(), checkpoint::open(&dir)?)),
            None => None,
        };
    }
    if cfg.resume == config::Resume::Auto && resumed.is_none() {
        progress.note("resume auto: no checkpoint yet, starting fresh");
    }
    if let Some((_, st)) = resumed.as_ref().filter(|(_, st)| st.step == cfg.steps) {
        progress.note(&format!(
            "the checkpoint resumed is at step {} = --steps: nothing left to train (raise --steps to train further)",
            st.step
        ));
    }

    let model = resolve_model(cfg, resumed.as_ref().map(|(_, st)| st))?;
    if cfg.seq_len > model.max_position_embeddings {
        return Err(Error::bad_input(
            "--seq-len",
            cfg.seq_len.to_string(),
            format!(
                "exceeds max_position_embeddings {}",
                model.max_position_embeddings
            ),
            None,
        ));
    }
    let train_file = DataFile::open(&data_path, cfg.data_dtype, model.vocab_size)?;
    let val_file = match &cfg.val_data {
        Some(p) => Some(DataFile::open(p, cfg.data_dtype, model.vocab_size)?),
        None => None,
    };
    Ok(Inputs {
        run_dir,
        resumed,
        model,
        train_file,
        val_file,
        run_id,
    })
}

/// The settings this resumed run changes, printed, added to the checkpoint's history.
fn settings_changed(
    cfg: &TrainConfig,
    resumed: Option<&(PathBuf, TrainState)>,
    progress: &mut dyn Progress,
) -> Vec<ConfigChange> {
    let Some((_, st)) = resumed else {
        return Vec::new();
    };
    let mut changes = st.changes.clone();
    let now = run_dir::changed_settings(&st.config, cfg);
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
    changes
}

/// Before anything big is allocated: every output, the state against the RAM budget (placed
/// once without a GPU), the CPU device's working set against the free host memory beside it.
fn check_before_allocating(
    cfg: &TrainConfig,
    layout: &StateLayout,
    machine: &Machine,
    budget: RamBudget,
    spill: SpillRequest,
    run_id: &str,
) -> Result<()> {
    let params = layout.num_params() as u64;
    let checkpoint_bytes = layout.checkpoint_bytes() + (1 << 20);
    outputs::check(cfg, run_id, checkpoint_bytes, 4 * params + (1 << 20))?;
    let prelim = crate::store::placement::place_advised(
        machine,
        layout,
        None,
        budget,
        spill,
        cfg.grad_accum == 1,
    )?;
    // The CPU device's memory is host memory too: what the machine has available beside the state
    // (the RAM budget caps the state alone).
    let placed: u64 = prelim.nodes.iter().map(|n| n.bytes).sum();
    let host_room = machine
        .numa_nodes
        .iter()
        .map(|n| n.available_bytes.or(n.free_bytes).unwrap_or(n.memory_bytes))
        .sum::<u64>()
        .saturating_sub(placed);
    check_device_budget(cfg, layout, host_room)
}

/// The host store, placed near the device's GPU (found in the topology by PCI address) and
/// page-locked for its copies.
#[allow(clippy::too_many_arguments)]
pub(super) fn allocate_store(
    cfg: &TrainConfig,
    layout: StateLayout,
    machine: &Machine,
    device: &dyn crate::device::Device,
    (budget, spill): (RamBudget, SpillRequest),
    run_id: &str,
    progress: &mut dyn Progress,
) -> Result<HostStore> {
    let pci = device.pci_bus_id();
    let gpu = pci.as_deref().and_then(|id| machine.gpu_by_pci_bus_id(id));
    progress.note(&format!(
        "device: {}{}",
        device.name(),
        match (&pci, gpu) {
            (Some(id), Some(i)) if !machine.gpus[i].numa_nodes.is_empty() => format!(
                " at {id}: host state streamed from NUMA node(s) {:?}",
                machine.gpus[i].numa_nodes
            ),
            (Some(id), Some(_)) => format!(
                " at {id}: the topology does not say which NUMA node it is attached to; placed as for no GPU"
            ),
            (Some(id), None) =>
                format!(" at {id}: not in the probed topology, placed as for no GPU"),
            _ => String::new(),
        }
    ));
    let placement = place_with_spill(machine, &layout, gpu, budget, spill)?;
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
        layout,
        placement,
        &StoreOptions {
            registrar: device.registrar().map(crate::store::SharedRegistrar),
            pages: cfg.huge_pages,
            lock: cfg.lock_memory,
            unbound: false,
            spill: (!cfg.nvme.is_empty()).then(|| SpillOptions {
                engine: cfg.io_engine,
                direct: cfg.direct_io,
                run_id: Some(run_id.to_owned()),
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
    Ok(store)
}

/// The params (and optimizer state) from the checkpoint resumed, an HF checkpoint or a random
/// init; the step done, the data cursor and the lean clipping norm to continue from.
fn restore(
    cfg: &TrainConfig,
    resumed: Option<&(PathBuf, TrainState)>,
    store: &HostStore,
    world: &dyn crate::dist::Collective,
    progress: &mut dyn Progress,
) -> Result<(u64, Cursor, Option<f64>)> {
    if let Some((dir, _)) = resumed {
        let (st, moments) = checkpoint::load_job(dir, store, world)?;
        progress.note(&format!(
            "resumed from {} (step {})",
            dir.display(),
            st.step
        ));
        if let checkpoint::MomentsRestored::Converted { from, to } = moments {
            progress.note(&format!(
                "adam state: the checkpoint's {} moments converted to {} ({})",
                from.name(),
                to.name(),
                if to == crate::store::layout::AdamState::Fp32 {
                    "dequantised"
                } else {
                    "quantised; --adam-state to keep them as they were"
                }
            ));
        }
        return Ok((st.step, st.cursor, st.prev_norm));
    }
    match &cfg.init_from {
        Some(dir) => {
            let r = crate::store::hf::load_into_store(dir, store)?;
            progress.note(&format!(
                "loaded {} tensors from {}",
                r.tensors,
                dir.display()
            ));
        }
        None => random_init(store, cfg.seed)?,
    }
    Ok((0, Cursor::default(), None))
}

/// The streamer over `store` and `device`, with the node AdamW pools.
pub(super) fn build_streamer(
    cfg: &TrainConfig,
    device: Arc<dyn crate::device::Device>,
    store: HostStore,
    tm: Arc<Templates>,
    (activations, device_inputs): (Activations, usize),
) -> Result<Streamer> {
    // The AdamW workers run on the CPUs this process was bound to (`taskset`, a launcher's
    // binding, a rank's share of its host: `HostShare::bind`) where a node has some of them.
    let bound = crate::host::affinity::current_affinity().unwrap_or_default();
    let nodes: Vec<(u32, Vec<usize>)> = store
        .placement()
        .adam_nodes()
        .into_iter()
        .map(|(node, cpus)| {
            let mine: Vec<usize> = cpus.iter().copied().filter(|c| bound.contains(c)).collect();
            (node, if mine.is_empty() { cpus } else { mine })
        })
        .collect();
    let pool = AdamPool::new(&nodes, None)?;
    Streamer::new(
        device,
        store,
        pool,
        tm,
        StreamerConfig {
            batch: cfg.batch_size,
            seq: cfg.seq_len,
            micro_batches: cfg.grad_accum,
            activations,
            activation_dtype: cfg.resolved_activation_dtype(),
            device_inputs,
            adam: AdamWConfig {
                lr: cfg.lr,
                beta1: cfg.beta1,
                beta2: cfg.beta2,
                eps: cfg.eps,
                weight_decay: cfg.weight_decay,
            },
            grad_clip: cfg.grad_clip,
            decay_norms: cfg.decay_norms,
            seed: cfg.seed,
            grad_link: cfg.grad_link,
        },
    )
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
    sharded_ranks: Option<(usize, u8)>,
    progress: &mut dyn Progress,
) -> Mode {
    if let Some(m) = cfg.mode.or(resumed.and_then(|(_, st)| st.config.mode)) {
        return m;
    }
    let fits = |m: Mode| {
        let layout = StateLayout::new(model, m).with_adam_state(cfg.adam_state.unwrap_or_default());
        // A sharded job (ZeRO stage 1 or 3) fits where its fullest rank does (every rank
        // then chooses the same mode).
        let layout = match sharded_ranks {
            Some((ranks, stage)) => {
                // Stage 3 in exact mode shards the gradients too.
                let grads = stage == 3 && m == Mode::Exact;
                let fullest = UnitOwners::fullest(&layout, ranks, (stage == 3, grads));
                layout.with_owners(fullest)
            }
            None => layout,
        };
        crate::store::placement::fits(machine, &layout, None, budget, SpillRequest::default())
    };
    let exact_fits = fits(Mode::Exact);
    let m = if exact_fits || cfg.grad_accum > 1 || !fits(Mode::Lean) {
        Mode::Exact
    } else {
        Mode::Lean
    };
    progress.note(&format!(
        "mode: {} (chosen: {})",
        m.name(),
        match m {
            Mode::Lean => "the exact state does not fit the RAM budget, the lean one does",
            Mode::Exact if exact_fits => "the whole exact state fits in RAM",
            Mode::Exact =>
                "lean does not fit either (or gradient accumulation needs exact); spilling decides",
        }
    ));
    m
}

/// The compute device the configuration names, for its micro-batches, in the largest token
/// chunks that fit; a GPU is `gpu` (which one, and how many ranks share it: a data-parallel
/// rank's is `ranks::gpu_slot`'s).
pub(super) fn open_device(
    cfg: &TrainConfig,
    tm: &Arc<Templates>,
    layout: &StateLayout,
    #[cfg_attr(not(feature = "cuda"), allow(unused_variables))] (gpu, ranks): (
        ranks::GpuSlot,
        Option<Arc<dyn crate::dist::Collective>>,
    ),
) -> Result<Arc<dyn crate::device::Device>> {
    match cfg.device {
        config::DeviceKind::Cpu => Ok(Arc::new(CpuDevice::new(
            CpuDeviceConfig {
                capacity_bytes: cfg.device_memory,
                link: None,
                jitter: None,
                shape: cpu_shape(cfg, layout)?,
                precision: cfg.resolved_precision(),
            },
            tm.clone(),
        )?)),
        #[cfg(feature = "cuda")]
        config::DeviceKind::Cuda => Ok(Arc::new(crate::device::cuda::CudaDevice::open(
            crate::device::cuda::CudaDeviceConfig {
                ordinal: gpu.ordinal,
                shape: crate::device::program::Shape::whole(cfg.batch_size, cfg.seq_len),
                reserve_bytes: super::device_fit::step_buffers(cfg, layout),
                capacity_bytes: None,
                shared_by: gpu.shared_by,
                tf32: cfg.tf32,
                precision: cfg.resolved_precision(),
                ranks,
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

/// Elements per part of [`normal_fill_parallel`] (even: a part starts on a pair).
const NORMAL_PART: usize = 1 << 20;

/// [`normal_fill`] over the host's cores, with its bits: splitmix64's `n`-th draw is a
/// function of `seed + n·γ` alone, so the part starting at element `j` (an even one; each
/// pair draws twice) starts from `seed + j·γ`.
fn normal_fill_parallel(x: &mut [f32], seed: u64, std: f32) {
    use rayon::prelude::*;
    x.par_chunks_mut(NORMAL_PART)
        .enumerate()
        .for_each(|(part, chunk)| {
            let draws = (part * NORMAL_PART) as u64;
            normal_fill(
                chunk,
                seed.wrapping_add(draws.wrapping_mul(crate::util::SPLITMIX64_GAMMA)),
                std,
            );
        });
}

/// Deterministic N(0, σ²) samples (splitmix64 + Box–Muller).
fn normal_fill(x: &mut [f32], seed: u64, std: f32) {
    let mut s = seed;
    let mut next = || (crate::util::splitmix64(&mut s) >> 11) as f64 / (1u64 << 53) as f64;
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

/// Random init as HF does for Llama: N(0, 0.02) for matrices and embeddings, 1 for norm weights
/// (0 for Gemma's `1 + w`),
/// 0 for biases; seeded per tensor.
fn random_init(store: &HostStore, seed: u64) -> Result<()> {
    let layout = store.layout().clone();
    // ZeRO stage 3: each rank fills the units it holds (each tensor's draw is its own).
    let held = layout.units.iter().enumerate();
    for (u, unit) in held.filter(|&(u, _)| layout.holds_params(u)) {
        let mut g = store.take(u)?;
        let mut master = g.master();
        for (i, t) in unit.tensors.iter().enumerate() {
            let fill = |dst: &mut [f32]| {
                if t.name.ends_with("norm.weight") {
                    // w, or 0 where the norm applies 1 + w: the identity either way.
                    dst.fill(1.0 - layout.config.norm_weight.offset());
                } else if t.name.ends_with(".bias") {
                    dst.fill(0.0);
                } else {
                    normal_fill_parallel(
                        dst,
                        seed ^ ((u as u64) << 32 | i as u64).wrapping_mul(0xD134_2543_DE82_EF95),
                        0.02,
                    );
                }
            };
            let range = t.offset..t.offset + t.numel();
            match master.as_fp32() {
                Some(p) => fill(&mut p[range]),
                None => {
                    let mut values = vec![0f32; t.numel()];
                    fill(&mut values);
                    master.write(t.offset, &values);
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The parallel fill draws the sequential fill's bits, part boundaries included.
    #[test]
    fn normal_fill_parallel_equals_the_sequential_fill() {
        for len in [0, 1, 7, NORMAL_PART - 1, NORMAL_PART, 2 * NORMAL_PART + 3] {
            let (mut one, mut many) = (vec![0f32; len], vec![0f32; len]);
            normal_fill(&mut one, 0xABCD ^ len as u64, 0.02);
            normal_fill_parallel(&mut many, 0xABCD ^ len as u64, 0.02);
            let same = one
                .iter()
                .zip(&many)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            assert!(same, "length {len}");
        }
    }
}
