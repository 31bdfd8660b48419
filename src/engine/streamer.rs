//! The streamer: runs a [`Schedule`] on any [`Device`] with the host store and the AdamW pool.
//!
//! The host thread submits device ops in schedule order, turning the schedule's waits into
//! stream waits on events. Host ops (prefetch hints, gradient norms, the clip coefficient, AdamW
//! launches) are queued and run as soon as what they wait for has finished, without holding up
//! submission; a device op that waits for a host op (a copy of weights that AdamW is still
//! updating) makes the host finish it first. Every wait — within a step and across steps — is
//! the schedule's; nothing is ordered by hand here. The device state is the schedule's fixed set
//! of buffers, allocated once: nothing grows with depth (with host activations) or with the
//! number of steps.

use super::metrics::StepMetrics;
use super::schedule::{
    evaluation, evaluation_fits, schedule, ActivationDtype, Activations, DevBuf, Gather, Lane,
    LeanPieces, Op, Schedule, ScheduleSpec, Task,
};
use super::trace::{Span, Timeline};
use crate::device::{
    Batch, BufId, Cmd, Device, DeviceKernel, Event, GradLink, HostRef, Kernel, Precision,
    StreamKind,
};
use crate::dist::Collective;
use crate::model::reference::Templates;
use crate::optim::adamw::AdamWConfig;
use crate::optim::{piece_segments, unit_segments, AdamJob, AdamPool, Salts};
use crate::store::layout::{MasterFormat, Mode};
use crate::store::{HostBuffer, HostStore, MasterRef, UnitGuard};
use crate::{Error, Result};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Instant;

mod buffers;
mod evaluate;
mod memory;
mod ranks;

pub use buffers::{buffer_len, device_bytes};
pub use memory::HostMemory;

/// How the streamer runs.
#[derive(Debug, Clone)]
pub struct StreamerConfig {
    /// Sequences per micro-batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Micro-batches per optimizer step.
    pub micro_batches: usize,
    /// Where the layer-boundary activations live.
    pub activations: Activations,
    /// How the layer inputs are stored (bf16 only on a bf16 device).
    pub activation_dtype: ActivationDtype,
    /// Host activations: the last blocks whose inputs stay on the device all the same
    /// ([`ScheduleSpec::device_inputs`]).
    pub device_inputs: usize,
    /// AdamW hyperparameters (lr is overridden per step by [`Streamer::step`]).
    pub adam: AdamWConfig,
    /// Global-norm clipping threshold (0 = off).
    pub grad_clip: f64,
    /// Also decay 1-D tensors (norm weights, biases).
    pub decay_norms: bool,
    /// The run's seed (the stochastic rounding of bf16 Adam moments).
    pub seed: u64,
    /// How weight gradients cross to the host.
    pub grad_link: GradLink,
}

/// One micro-batch, `batch × seq` each: input tokens, next-token targets
/// ([`crate::model::ops::IGNORE`] where nothing is trained) and each token's position in its
/// document (see [`crate::model::reference::Templates::check_batch`]).
#[derive(Debug, Clone)]
pub struct MicroBatch {
    /// Inputs.
    pub tokens: Arc<[u32]>,
    /// Targets.
    pub targets: Arc<[u32]>,
    /// Positions.
    pub positions: Arc<[u32]>,
    /// Which tokens are padding (non-zero), when some are (see [`crate::device::Batch::pad`]).
    pub pad: Option<Arc<[u8]>>,
}

impl MicroBatch {
    /// Rows of `seq` tokens that are each one sequence (positions 0..seq), every target trained.
    pub fn flat(tokens: Vec<u32>, targets: Vec<u32>, seq: usize) -> Self {
        let positions = crate::model::ops::flat_positions(tokens.len() / seq.max(1), seq);
        MicroBatch {
            tokens: tokens.into(),
            targets: targets.into(),
            positions: positions.into(),
            pad: None,
        }
    }

    /// Targets that train (not [`crate::model::ops::IGNORE`]).
    pub fn trained_tokens(&self) -> usize {
        self.targets
            .iter()
            .filter(|&&y| y != crate::model::ops::IGNORE)
            .count()
    }
}

struct PendingAdam {
    job: AdamJob,
    lean: Option<usize>,
    submitted: f64,
}

/// The streaming engine.
#[derive(Debug)]
pub struct Streamer {
    device: Arc<dyn Device>,
    store: HostStore,
    pool: AdamPool,
    templates: Arc<Templates>,
    cfg: StreamerConfig,
    /// What the step schedule was built for (`ranks` set by [`Streamer::with_world`]).
    spec: ScheduleSpec,
    schedule: Schedule,
    /// The forward-only pass of one micro-batch on the step's buffers ([`Streamer::evaluate`]).
    evaluation: Schedule,
    bufs: HashMap<DevBuf, BufId>,
    /// Host copies of the layer-boundary activations (host activations).
    saved: Vec<HostBuffer>,
    lean: Vec<Option<HostBuffer>>,
    /// ZeRO stage 3: the host buffers other ranks' params are gathered into, one per weight
    /// buffer ([`Op::Gather`]).
    gathered: Vec<HostBuffer>,
    /// ZeRO stage 3 with sharded gradients: the host buffers a micro-batch's gradients of a
    /// unit land in ([`Res::Landed`](super::schedule::Res::Landed)) to be summed across the
    /// ranks ([`Op::Reduce`]).
    landing: Vec<HostBuffer>,
    guards: Vec<Option<UnitGuard>>,
    pending: HashMap<usize, PendingAdam>,
    step: u64,
    prev_norm: Option<f64>,
    timeline: Timeline,
    adam_spans: Vec<(f64, f64)>,
    /// Lean mode: each unit's Σg² from its AdamW job this step, summed in unit order (jobs
    /// finish in any order; the norm, and the next step's clipping, must not depend on it).
    lean_sumsq: Vec<f64>,
    spill_seen: crate::spill::tier::SpillStats,
    /// The data-parallel job this streamer is a rank of ([`crate::dist::Solo`] alone).
    world: Arc<dyn Collective>,
}

/// What one step is doing while it runs: its tasks' events, which host tasks ran, the norm
/// and coefficient so far.
struct StepRun {
    events: Vec<Option<Event>>,
    host_done: Vec<bool>,
    host_queue: VecDeque<usize>,
    norm_sq: f64,
    /// Sharded gradients: each unit's Σg² in the order the norm adds them (this rank's units';
    /// 0 for the others until the clip sums them across the ranks).
    norm_parts: Vec<(usize, f64)>,
    coef: f64,
    host_wait: f64,
    adam: AdamWConfig,
    batches: Vec<Batch>,
    /// Trained tokens of the step.
    trained: usize,
}

/// `min(1, max_norm / (norm + 1e-6))`, torch's `clip_grad_norm_`; 1 when clipping is off.
pub fn clip_coef(max_norm: f64, norm: f64) -> f64 {
    if max_norm > 0.0 {
        (max_norm / (norm + 1e-6)).min(1.0)
    } else {
        1.0
    }
}

impl std::fmt::Debug for PendingAdam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingAdam")
            .field("lean", &self.lean)
            .finish()
    }
}

impl Streamer {
    /// Plan the step and allocate its device buffers.
    pub fn new(
        device: Arc<dyn Device>,
        store: HostStore,
        pool: AdamPool,
        templates: Arc<Templates>,
        cfg: StreamerConfig,
    ) -> Result<Self> {
        let layout = store.layout().clone();
        let c = &layout.config;
        if layout.mode == Mode::Lean && cfg.micro_batches > 1 {
            return Err(Error::bad_input(
                "--grad-accum",
                cfg.micro_batches.to_string(),
                "lean mode consumes each unit's gradients as they land, so it cannot accumulate micro-batches",
                Some("use --mode exact for gradient accumulation"),
            ));
        }
        // bf16 streams the high plane of a planes master, and only a bf16 device takes it.
        let streams_bf16 = layout.master == MasterFormat::Planes;
        if streams_bf16 != (device.precision() == Precision::Bf16) {
            return Err(Error::bad_input(
                "precision",
                device.precision().name(),
                format!(
                    "the device computes in {} but the master is stored as {} (bf16 needs planes, fp32 an fp32 master)",
                    device.precision().name(),
                    layout.master.name()
                ),
                Some("open the store and the device with the same --precision"),
            ));
        }
        if cfg.micro_batches == 0 || cfg.batch == 0 || cfg.seq == 0 {
            return Err(Error::bad_input(
                "batch shape",
                format!("{}×{}×{}", cfg.micro_batches, cfg.batch, cfg.seq),
                "must be positive",
                None,
            ));
        }
        let spec = ScheduleSpec {
            layers: c.num_layers,
            tied: c.tie_word_embeddings,
            micro_batches: cfg.micro_batches,
            mode: layout.mode,
            activations: cfg.activations,
            activation_dtype: cfg.activation_dtype,
            device_inputs: cfg.device_inputs,
            lean_pieces: LeanPieces::of(&layout),
            ranks: 1,
            gather: match (layout.gathers_params(), layout.gathers_on_device()) {
                (false, _) => Gather::No,
                (true, false) => Gather::Host,
                (true, true) => Gather::Device,
            },
            land: layout.lands_grads(),
        };
        if cfg.activation_dtype == ActivationDtype::Bf16 && !streams_bf16 {
            return Err(Error::bad_input(
                "--activation-dtype",
                "bf16",
                "layer inputs are stored in bf16 only by the bf16 recipe, and this run computes in fp32",
                Some("pass --precision bf16, or --activation-dtype fp32"),
            ));
        }
        let schedule = schedule(&spec);
        let evaluation = evaluation(&spec);
        if !evaluation_fits(&evaluation, &schedule) {
            return Err(Error::internal(
                "streamer",
                "the forward-only schedule uses a buffer the step does not allocate",
            ));
        }
        let n = cfg.batch * cfg.seq;
        let piece = layout.lean_piece_elems();
        let mut bufs = HashMap::new();
        for b in &schedule.buffers {
            let label = format!("{b:?}");
            let config = &layout.config;
            // Kept internals are sized by the device's storage, not by the planned GPU's.
            let id = match b {
                // Stored layer inputs are bf16 values, as a bf16 device holds its weights.
                DevBuf::W(_) | DevBuf::S(_) => {
                    device.alloc_weights(buffer_len(&layout, n, *b), &label)?
                }
                DevBuf::K(_) => device.alloc_stored(
                    &|stored| crate::device::program::internals_len(config, n, stored),
                    &label,
                )?,
                _ => device.alloc(buffer_len(&layout, n, *b), &label)?,
            };
            bufs.insert(*b, id);
        }
        // Host buffers the device copies to and from: near the GPU, page-locked by the device
        // when it needs that for asynchronous copies.
        let registrar = device.registrar();
        let near = store.placement().lean_buffers_node;
        let host_buffer = |label: String, len: usize| -> Result<HostBuffer> {
            let mut b = HostBuffer::allocate(&label, len, near, Vec::new())?;
            if let Some(r) = &registrar {
                b.register_with(r.as_ref())?;
            }
            Ok(b)
        };
        // bf16 inputs take half the words.
        let saved_words = match spec.stores_bf16() {
            true => (n * c.hidden_size).div_ceil(2),
            false => n * c.hidden_size,
        };
        // The offloaded inputs: the first blocks'.
        let saved = (0..spec.offloaded_inputs())
            .map(|i| host_buffer(format!("activation of layer {i}"), saved_words))
            .collect::<Result<_>>()?;
        let lean = match layout.mode {
            Mode::Lean => (0..super::schedule::LEAN_BUFFERS)
                .map(|k| host_buffer(format!("lean gradient buffer {k}"), piece).map(Some))
                .collect::<Result<_>>()?,
            Mode::Exact => Vec::new(),
        };
        let gathered = match layout.gathers_params() && !layout.gathers_on_device() {
            true => {
                let words = (0..layout.units.len())
                    .map(|u| layout.streamed_bytes(u).div_ceil(4))
                    .max()
                    .unwrap_or(0);
                (0..crate::store::layout::GATHER_BUFFERS)
                    .map(|k| host_buffer(format!("gathered params buffer {k}"), words))
                    .collect::<Result<_>>()?
            }
            false => Vec::new(),
        };
        let landing = match layout.lands_grads() {
            true => (0..crate::store::layout::LANDING_BUFFERS)
                .map(|k| {
                    host_buffer(
                        format!("gradient landing buffer {k}"),
                        layout.max_unit_numel(),
                    )
                })
                .collect::<Result<_>>()?,
            false => Vec::new(),
        };
        let units = store.num_units();
        let timeline = Timeline::new(device.epoch());
        let spill_seen = store.spill_stats();
        Ok(Streamer {
            device,
            store,
            pool,
            templates,
            cfg,
            spec,
            schedule,
            evaluation,
            bufs,
            saved,
            lean,
            gathered,
            landing,
            guards: (0..units).map(|_| None).collect(),
            pending: HashMap::new(),
            step: 0,
            prev_norm: None,
            timeline,
            adam_spans: Vec::new(),
            lean_sumsq: Vec::new(),
            spill_seen,
            world: crate::dist::solo(),
        })
    }

    /// Continue a resumed run: the next step is `steps_done + 1` (AdamW's bias correction counts
    /// from it), and lean clipping uses `prev_norm`.
    pub fn resume_at(&mut self, steps_done: u64, prev_norm: Option<f64>) {
        self.step = steps_done;
        self.prev_norm = prev_norm;
    }

    /// Last global gradient norm.
    pub fn prev_norm(&self) -> Option<f64> {
        self.prev_norm
    }

    /// A micro-batch's shape: sequences, tokens per sequence.
    pub fn micro_batch_shape(&self) -> (usize, usize) {
        (self.cfg.batch, self.cfg.seq)
    }

    /// The schedule being run.
    pub fn schedule(&self) -> &Schedule {
        &self.schedule
    }

    /// The host store.
    pub fn store(&self) -> &HostStore {
        &self.store
    }

    /// The recorded timeline (device streams and AdamW pools) so far.
    pub fn timeline(&self) -> &Timeline {
        &self.timeline
    }

    fn buf(&self, b: DevBuf) -> BufId {
        self.bufs[&b]
    }

    /// Take unit u back from a running AdamW job, if one has it.
    fn finish_adam(&mut self, u: usize) -> Result<f64> {
        let Some(p) = self.pending.remove(&u) else {
            return Ok(0.0);
        };
        let t0 = Instant::now();
        let done = p.job.wait()?;
        let waited = t0.elapsed().as_secs_f64();
        self.adam_spans
            .push((p.submitted, p.submitted + done.elapsed.as_secs_f64()));
        self.timeline.push(Span {
            track: format!(
                "adamw node {}",
                self.store.placement().worker_node(u).unwrap_or(0)
            ),
            name: format!("adamw unit {u}"),
            start: p.submitted,
            end: p.submitted + done.elapsed.as_secs_f64(),
        });
        if let (Some(k), Some(b)) = (p.lean, done.grads) {
            self.lean[k] = Some(b);
        }
        if self.store.layout().mode == Mode::Lean {
            // Pieces finish in order: their sums add in the same order every run.
            self.lean_sumsq[u] += done.sumsq;
        }
        self.guards[u] = Some(done.guard);
        Ok(waited)
    }

    fn guard(&mut self, u: usize) -> Result<&mut UnitGuard> {
        if self.guards[u].is_none() {
            if self.pending.contains_key(&u) {
                self.finish_adam(u)?;
            } else {
                self.guards[u] = Some(self.store.take(u)?);
            }
        }
        self.guards[u]
            .as_mut()
            .ok_or_else(|| Error::internal("streamer", format!("unit {u}'s guard is missing")))
    }

    /// Wait for every running AdamW job (end of training, checkpoints, tests).
    pub fn finish(&mut self) -> Result<()> {
        let units: Vec<usize> = self.pending.keys().copied().collect();
        for u in units {
            self.finish_adam(u)?;
        }
        self.guards.iter_mut().for_each(|g| *g = None);
        Ok(())
    }

    /// Make this streamer rank `world.rank()` of a data-parallel job: each step's gradients are
    /// summed across the ranks ([`Op::Reduce`]) before their norm and update, and the step's
    /// loss and trained tokens are the job's. Every rank must run the same steps.
    pub fn with_world(mut self, world: Arc<dyn Collective>) -> Self {
        self.spec.ranks = world.size();
        self.schedule = schedule(&self.spec);
        self.world = world;
        self
    }

    /// The data-parallel job this streamer is a rank of.
    pub fn world(&self) -> &Arc<dyn Collective> {
        &self.world
    }

    /// Run one optimizer step over `batches` (one per micro-batch) with learning rate `lr`.
    pub fn step(&mut self, batches: &[MicroBatch], lr: f64) -> Result<StepMetrics> {
        let r = self.run_step(batches, lr);
        if r.is_err() {
            // The other ranks' devices may wait for this one's broadcasts: end them, so this
            // rank's streams drain and it can report and end the job.
            self.device.abort_exchanges();
        }
        r
    }

    fn run_step(&mut self, batches: &[MicroBatch], lr: f64) -> Result<StepMetrics> {
        let wall = Instant::now();
        let mut run = self.start_step(batches, lr)?;
        let tasks = self.schedule.tasks.clone();
        for (i, t) in tasks.iter().enumerate() {
            match t.lane {
                Lane::Host => run.host_queue.push_back(i),
                Lane::Stream(stream) => self.submit(&tasks, i, stream, &mut run)?,
            }
            self.run_host(&tasks, &mut run, None)?;
        }
        self.run_host(&tasks, &mut run, Some(tasks.len()))?;
        // All device work of this step is done once its last events fire.
        let t0 = Instant::now();
        for e in run.events.iter().flatten() {
            e.synchronize();
        }
        run.host_wait += t0.elapsed().as_secs_f64();
        if let Some(e) = self.device.take_error() {
            return Err(e);
        }
        if let Some(owners) = self.store.layout().owners.clone() {
            self.share_updates(&owners.owner)?;
        }
        let grad_norm = match self.store.layout().mode {
            // The norm came out of the AdamW pass (the schedule's LeanNorm waited for it).
            Mode::Lean => self.lean_sumsq.iter().sum::<f64>().sqrt(),
            Mode::Exact => run.norm_sq.sqrt(),
        };
        self.prev_norm = Some(grad_norm);
        let mut m = self.metrics(&run, grad_norm, lr)?;
        self.store.check_spill()?;
        m.wall_s = wall.elapsed().as_secs_f64();
        Ok(m)
    }

    /// Check a micro-batch against the model and the streamer's shape.
    fn check(&self, mb: &MicroBatch) -> Result<()> {
        let (b, t) = (self.cfg.batch, self.cfg.seq);
        self.templates
            .check_batch(&mb.tokens, &mb.targets, &mb.positions, b, t)?;
        match mb.pad.as_deref().map(<[u8]>::len) {
            Some(len) if len != b * t => Err(Error::internal(
                "streamer",
                format!("{len} padding flags for a micro-batch of {} tokens", b * t),
            )),
            _ => Ok(()),
        }
    }

    /// Check the micro-batches and start the step: its counters, the device's peak, the spill
    /// tier's health.
    fn start_step(&mut self, batches: &[MicroBatch], lr: f64) -> Result<StepRun> {
        if batches.len() != self.cfg.micro_batches {
            return Err(Error::internal(
                "streamer",
                format!(
                    "{} micro-batches for a schedule of {}",
                    batches.len(),
                    self.cfg.micro_batches
                ),
            ));
        }
        for mb in batches {
            self.check(mb)?;
        }
        // The loss is the mean over every trained token of the step, across its micro-batches
        // (as transformers' Trainer since 4.46), not a mean of per-micro-batch means.
        // Data parallel: the job's trained tokens, so every rank scales its gradients alike.
        let mut job_trained = [batches
            .iter()
            .map(MicroBatch::trained_tokens)
            .sum::<usize>() as f64];
        self.world.sum_f64(&mut job_trained)?;
        let trained = job_trained[0] as usize;
        if trained == 0 {
            return Err(Error::bad_input(
                "training step",
                format!("step {}", self.step + 1),
                "has no trained token (every target is masked)",
                Some("check the loss mask of the data (`megatrain prepare` drops such documents)"),
            ));
        }
        self.step += 1;
        self.device.reset_peak();
        // Write-backs run on after a step returns: one that failed since then stops this step.
        self.store.check_spill()?;
        if self.store.layout().mode == Mode::Lean {
            self.lean_sumsq = vec![0.0; self.store.num_units()];
        }
        let loss = Arc::new(Mutex::new(0.0f64));
        let grad_scale = (1.0 / trained as f64) as f32;
        // The load-balancing loss, where the config trains it: each micro-batch's (transformers
        // computes it per forward call) weighted by the coefficient, averaged over the step's
        // micro-batches.
        let aux_scale = self
            .templates
            .config
            .moe
            .as_ref()
            .filter(|m| m.aux_loss)
            .map_or(0.0, |m| {
                m.router_aux_loss_coef / (batches.len() * self.world.size()) as f64
            });
        let nt = self.schedule.tasks.len();
        Ok(StepRun {
            events: vec![None; nt],
            host_done: vec![false; nt],
            host_queue: VecDeque::new(),
            norm_sq: 0.0,
            norm_parts: Vec::new(),
            coef: 1.0,
            host_wait: 0.0,
            adam: AdamWConfig {
                lr,
                ..self.cfg.adam
            },
            trained,
            batches: batches
                .iter()
                .map(|mb| Batch {
                    tokens: mb.tokens.clone(),
                    targets: mb.targets.clone(),
                    positions: mb.positions.clone(),
                    pad: mb.pad.clone(),
                    grad_scale,
                    loss: loss.clone(),
                    router: Default::default(),
                    aux_scale,
                    logits: None,
                })
                .collect(),
        })
    }

    /// Submit device task `i` on `stream`: first what it waits for on the host (host tasks run,
    /// AdamW jobs of this or the previous step finished), then stream waits on the events of
    /// other streams' tasks, then the command and its completion event.
    fn submit(
        &mut self,
        tasks: &[Task],
        i: usize,
        stream: StreamKind,
        run: &mut StepRun,
    ) -> Result<()> {
        let t = &tasks[i];
        let host_deps: Vec<usize> = t
            .waits
            .iter()
            .copied()
            .filter(|&w| tasks[w].lane == Lane::Host)
            .collect();
        if let Some(&last) = host_deps.iter().max() {
            self.run_host(tasks, run, Some(last))?;
        }
        let t0 = Instant::now();
        for &w in host_deps.iter().chain(&t.prev_waits) {
            if let Op::Adam { unit, .. } = tasks[w].op {
                self.finish_adam(unit)?;
            }
        }
        run.host_wait += t0.elapsed().as_secs_f64();
        for &w in &t.waits {
            if let (Lane::Stream(s), Some(e)) = (tasks[w].lane, &run.events[w]) {
                if s != stream {
                    self.device.submit(stream, Cmd::Wait(e.clone()));
                }
            }
        }
        for cmd in self.commands(&t.op, &run.batches)? {
            self.device.submit(stream, cmd);
        }
        let e = Event::new();
        self.device.submit(stream, Cmd::Record(e.clone()));
        run.events[i] = Some(e);
        Ok(())
    }

    /// Run queued host tasks in order while what they wait for is done — or, up to task `upto`,
    /// wait for it.
    fn run_host(&mut self, tasks: &[Task], run: &mut StepRun, upto: Option<usize>) -> Result<()> {
        while let Some(&i) = run.host_queue.front() {
            let must = upto.is_some_and(|u| i <= u);
            if !must && !self.host_ready(tasks, run, i) {
                break;
            }
            let t0 = Instant::now();
            for &w in &tasks[i].waits {
                match (tasks[w].lane, &tasks[w].op, &run.events[w]) {
                    (Lane::Stream(_), _, Some(e)) => e.synchronize(),
                    (Lane::Host, Op::Adam { unit, .. }, _) => {
                        let u = *unit;
                        self.finish_adam(u)?;
                    }
                    _ => {}
                }
            }
            for &w in &tasks[i].prev_waits {
                if let Op::Adam { unit, .. } = tasks[w].op {
                    self.finish_adam(unit)?;
                }
            }
            run.host_wait += t0.elapsed().as_secs_f64();
            if let Some(e) = self.device.take_error() {
                return Err(e);
            }
            self.host_op(&tasks[i].op, run)?;
            run.host_done[i] = true;
            run.host_queue.pop_front();
        }
        Ok(())
    }

    /// Whether host task `i` can run without blocking.
    fn host_ready(&self, tasks: &[Task], run: &StepRun, i: usize) -> bool {
        let job_done = |w: usize| match tasks[w].op {
            Op::Adam { unit, .. } => !self.pending.contains_key(&unit),
            _ => true,
        };
        tasks[i].waits.iter().all(|&w| match tasks[w].lane {
            Lane::Host => run.host_done[w] && job_done(w),
            Lane::Stream(_) => run.events[w].as_ref().is_some_and(Event::query),
        }) && tasks[i].prev_waits.iter().all(|&w| job_done(w))
    }

    /// One host op.
    fn host_op(&mut self, op: &Op, run: &mut StepRun) -> Result<()> {
        match op {
            Op::Prefetch { unit } => self.store.prefetch(*unit),
            Op::Norm { unit } => {
                let g = self.guard(*unit)?;
                let s = g
                    .grads()
                    .map_or(0.0, |x| crate::optim::adamw::sumsq_parallel(x));
                run.norm_sq += s;
                run.norm_parts.push((*unit, s));
            }
            Op::Clip => {
                if self.store.layout().lands_grads() {
                    self.job_norm(run)?;
                }
                let norm = match self.store.layout().mode {
                    Mode::Exact => Some(run.norm_sq.sqrt()),
                    // The previous step's norm (none yet on the first step: no clipping).
                    Mode::Lean => self.prev_norm,
                };
                run.coef = norm.map_or(1.0, |n| clip_coef(self.cfg.grad_clip, n));
            }
            Op::Adam { unit, lean, piece } => self.submit_adam(*unit, (*lean, *piece), run)?,
            Op::Reduce {
                unit,
                lean,
                piece,
                landing,
                accumulate,
            } => self.reduce(*unit, (*lean, *piece), (*landing, *accumulate))?,
            Op::Gather { unit, slot } => self.gather(*unit, *slot)?,
            // The schedule made this wait for every update of the step; their Σg² is summed.
            Op::LeanNorm => {}
            other => {
                return Err(Error::internal(
                    "streamer",
                    format!("{other:?} scheduled on the host"),
                ))
            }
        }
        Ok(())
    }

    /// Start unit u's AdamW update on its node's pool: in lean mode of piece `piece`, from lean
    /// buffer `lean`.
    fn submit_adam(
        &mut self,
        unit: usize,
        (lean, piece): (Option<usize>, usize),
        run: &StepRun,
    ) -> Result<()> {
        if !self.store.layout().holds_moments(unit) {
            // ZeRO stage 1: the rank holding its moments updates it ([`Streamer::share_updates`]).
            return Ok(());
        }
        // The schedule ordered every copy of this unit's params and gradients before this.
        let guard = match self.guards[unit].take() {
            Some(g) => g,
            None => self.store.take(unit)?,
        };
        let buf = match lean {
            Some(k) => Some(self.lean[k].take().ok_or_else(|| {
                Error::internal("streamer", format!("lean buffer {k} is still in use"))
            })?),
            None => None,
        };
        let segs = unit_segments(
            self.store.layout(),
            unit,
            &run.adam,
            self.step,
            run.coef as f32,
            self.cfg.decay_norms,
        );
        let segs = piece_segments(&segs, self.store.layout().lean_piece(unit, piece));
        let node = self.store.placement().worker_node(unit).unwrap_or(0);
        let submitted = self.device.epoch().elapsed().as_secs_f64();
        let salts = Salts::new(self.cfg.seed, self.step, unit);
        let job = self.pool.submit(node, guard, buf, segs, salts)?;
        self.pending.insert(
            unit,
            PendingAdam {
                job,
                lean,
                submitted,
            },
        );
        Ok(())
    }

    /// The step's metrics from the device's records and the spill tier's counters.
    fn metrics(&mut self, run: &StepRun, grad_norm: f64, lr: f64) -> Result<StepMetrics> {
        let records = self.device.take_records();
        let ranks = self.world.size();
        let total_tokens = (self.cfg.batch * self.cfg.seq * run.batches.len() * ranks) as f64;
        let loss = run
            .batches
            .first()
            .map_or(0.0, |b| *crate::util::lock(&b.loss));
        let mut routing = super::metrics::StepRouting::of(&run.batches);
        // The job's: summed over the ranks (each rank's aux loss is a mean over as many
        // micro-batches as every other's). The expert loads stay this rank's.
        let mut job = [
            loss,
            super::metrics::StepRouting::trained_aux(&run.batches),
            routing.aux_loss.unwrap_or(0.0),
        ];
        self.world.sum_f64(&mut job)?;
        routing.aux_loss = routing.aux_loss.map(|_| job[2] / ranks as f64);
        let mut m = StepMetrics {
            step: self.step,
            loss: job[0] / run.trained as f64 + job[1],
            grad_norm,
            clip_coef: run.coef,
            lr,
            tokens: total_tokens as u64,
            trained_tokens: run.trained as u64,
            optimizer_s: super::metrics::union_length(std::mem::take(&mut self.adam_spans)),
            host_wait_s: run.host_wait,
            device_peak_bytes: self.device.memory().peak,
            aux_loss: routing.aux_loss,
            expert_load: routing.layers,
            ..StepMetrics::default()
        };
        m.add_device_records(&records);
        self.timeline.extend_device(records);
        let spill = self.store.spill_stats();
        m.nvme_read_bytes = spill.bytes_read - self.spill_seen.bytes_read;
        m.nvme_write_bytes = spill.bytes_written - self.spill_seen.bytes_written;
        m.nvme_wait_s = spill.wait_seconds - self.spill_seen.wait_seconds;
        m.nvme_busy_s = spill.io_seconds - self.spill_seen.io_seconds;
        self.spill_seen = spill;
        Ok(m)
    }

    /// The device commands of a device task: one — or, for weights the devices gather (ZeRO
    /// stage 3, [`Gather::Device`]), the owner's copy and every rank's broadcast.
    fn commands(&mut self, op: &Op, batches: &[Batch]) -> Result<Vec<Cmd>> {
        match *op {
            Op::CopyWeights {
                unit,
                to,
                broadcast: true,
            } => self.gathered_weights(unit, to, batches),
            _ => Ok(vec![self.command(op, batches)?]),
        }
    }

    /// The device command of a device task.
    fn command(&mut self, op: &Op, batches: &[Batch]) -> Result<Cmd> {
        let n = self.cfg.batch * self.cfg.seq;
        let c = self.store.layout().config.hidden_size;
        Ok(match op {
            Op::CopyWeights { unit, to, .. } if !self.store.layout().holds_params(*unit) => {
                // ZeRO stage 3: from the host buffer the Gather before filled.
                let dst = self.buf(*to);
                let label = format!("weights unit {unit} (gathered)");
                let numel = self.store.layout().units[*unit].numel;
                let planes = self.store.layout().master == MasterFormat::Planes;
                let slot = match to {
                    DevBuf::W(s) => *s,
                    other => {
                        return Err(Error::internal(
                            "streamer",
                            format!("weights copied into {other:?}"),
                        ))
                    }
                };
                let buf = self.gathered.get_mut(slot).ok_or_else(|| {
                    Error::internal("streamer", format!("no gathered params buffer {slot}"))
                })?;
                // SAFETY: the buffer lives in `self`; the schedule orders the next Gather into
                // it after this copy's completion.
                unsafe { htod_from(buf, numel, planes, dst, label) }
            }
            Op::CopyWeights { unit, to, .. } => {
                let dst = self.buf(*to);
                let g = self.guard(*unit)?;
                let label = format!("weights unit {unit}");
                // Read-only: a checkpoint snapshot of the previous step may be reading them too.
                match g.master_ref() {
                    MasterRef::Fp32(params) => Cmd::HtoD {
                        dst,
                        offset: 0,
                        // SAFETY: the guard stays in `self.guards` until an AdamW op takes it,
                        // and the schedule orders that op after this copy's completion event;
                        // the copy only reads.
                        src: unsafe { HostRef::from_shared(params) },
                        label,
                    },
                    // The high plane is the bf16 copy: it streams as is.
                    MasterRef::Planes { hi, .. } => Cmd::HtoDBf16 {
                        dst,
                        offset: 0,
                        // SAFETY: as for fp32 params.
                        src: unsafe { HostRef::from_shared(hi) },
                        label,
                    },
                }
            }
            // A stored bf16 input crosses as its bf16 values, into and out of a bf16 buffer.
            Op::LoadActivation { index, to } => {
                let label = format!("activation x{index}");
                let dst = self.buf(*to);
                let host = &mut self.saved[*index];
                // SAFETY: the host buffer lives in `self`; the schedule orders its writer
                // (SaveActivation) before this read, and its next writer after this copy.
                unsafe { htod_from(host, n * c, matches!(to, DevBuf::S(_)), dst, label) }
            }
            Op::SaveActivation { index, from } => {
                let label = format!("activation x{index}");
                let src = self.buf(*from);
                let host = &mut self.saved[*index];
                if matches!(from, DevBuf::S(_)) {
                    // SAFETY: as above; readers of this activation are ordered after this copy.
                    let dst = unsafe { HostRef::from_slice(&mut host.as_mut_halves()[..n * c]) };
                    Cmd::DtoHBf16 {
                        dst,
                        src,
                        offset: 0,
                        label,
                    }
                } else {
                    // SAFETY: as above.
                    let dst = unsafe { HostRef::from_slice(&mut host.as_mut_slice()[..n * c]) };
                    Cmd::DtoH {
                        dst,
                        src,
                        offset: 0,
                        accumulate: false,
                        link: GradLink::Fp32,
                        label,
                    }
                }
            }
            Op::CopyGrads {
                unit,
                from,
                accumulate,
                lean,
                piece,
                landing,
            } => self.grads_command(*unit, *from, *accumulate, (*lean, *piece), *landing)?,
            Op::Kernel(k) => Cmd::Kernel(self.kernel(k, batches)?),
            other => {
                return Err(Error::internal(
                    "streamer",
                    format!("{other:?} scheduled on a stream"),
                ))
            }
        })
    }

    /// Unit u's gradients from `from` to its host shard, or piece `piece` of them to lean buffer
    /// `lean`.
    fn grads_command(
        &mut self,
        unit: usize,
        from: DevBuf,
        accumulate: bool,
        (lean, piece): (Option<usize>, usize),
        landing: Option<usize>,
    ) -> Result<Cmd> {
        let elems = self.store.layout().lean_piece(unit, piece);
        let src = self.buf(from);
        let dst = match (lean, landing) {
            // Sharded gradients: another rank's unit's land in buffer k, and so do the owner's
            // after its first micro-batch (the sum is added to its shard then).
            (None, Some(k)) if accumulate || !self.store.layout().holds_grads(unit) => {
                let b = self
                    .landing
                    .get_mut(k)
                    .ok_or_else(|| Error::internal("streamer", format!("no landing buffer {k}")))?;
                // SAFETY: the buffer lives in `self`; the schedule orders the next copy into it
                // after the Reduce that reads this one.
                unsafe { HostRef::from_slice(&mut b.as_mut_slice()[..elems.len()]) }
            }
            _ => match lean {
                Some(k) => {
                    let b = self.lean[k].as_mut().ok_or_else(|| {
                        Error::internal(
                            "streamer",
                            format!("lean buffer {k} is still owned by AdamW"),
                        )
                    })?;
                    // SAFETY: the buffer stays in `self.lean` until the AdamW op that consumes it,
                    // which the schedule orders after this copy.
                    unsafe { HostRef::from_slice(&mut b.as_mut_slice()[..elems.len()]) }
                }
                None => {
                    let g = self.guard(unit)?;
                    let grads = g.grads().ok_or_else(|| {
                        Error::internal("streamer", "exact mode without a gradient shard")
                    })?;
                    // SAFETY: as for CopyWeights: the guard outlives the copy.
                    unsafe { HostRef::from_slice(grads) }
                }
            },
        };
        let label = match lean {
            Some(_) if self.store.layout().lean_pieces(unit) > 1 => {
                format!("grads unit {unit} piece {piece}")
            }
            _ => format!("grads unit {unit}"),
        };
        Ok(Cmd::DtoH {
            dst,
            src,
            offset: elems.start,
            // Sharded gradients are summed (and accumulated) by their Reduce.
            accumulate: accumulate && landing.is_none(),
            link: self.cfg.grad_link,
            label,
        })
    }

    /// A scheduled layer op on this device's buffers and this step's micro-batches.
    fn kernel(&self, k: &Kernel<DevBuf, usize>, batches: &[Batch]) -> Result<DeviceKernel> {
        let mb = match k {
            Kernel::EmbedFwd { batch, .. }
            | Kernel::HeadLossBwd { batch, .. }
            | Kernel::HeadLoss { batch, .. }
            | Kernel::EmbedBwd { batch, .. } => Some(*batch),
            _ => None,
        };
        if let Some(mb) = mb.filter(|&mb| mb >= batches.len()) {
            return Err(Error::internal(
                "streamer",
                format!("micro-batch {mb} of {}", batches.len()),
            ));
        }
        Ok(k.clone().map(|b| self.buf(b), |mb| batches[mb].clone()))
    }
}

impl Drop for Streamer {
    fn drop(&mut self) {
        let _ = self.finish();
        self.device.synchronize();
        for (_, id) in self.bufs.drain() {
            self.device.free(id);
        }
    }
}

/// A copy of the first `len` values of host buffer `host` into device buffer `dst`: bf16 values
/// (the buffer's 16-bit halves) into a bf16 buffer when `bf16`, else fp32.
///
/// # Safety
/// `host` must be neither written nor freed before the copy completes.
unsafe fn htod_from(
    host: &mut HostBuffer,
    len: usize,
    bf16: bool,
    dst: BufId,
    label: String,
) -> Cmd {
    if bf16 {
        // SAFETY: the caller keeps the buffer alive and unwritten until the copy completes.
        let src = unsafe { HostRef::from_slice(&mut host.as_mut_halves()[..len]) };
        Cmd::HtoDBf16 {
            dst,
            offset: 0,
            src,
            label,
        }
    } else {
        // SAFETY: as above.
        let src = unsafe { HostRef::from_slice(&mut host.as_mut_slice()[..len]) };
        Cmd::HtoD {
            dst,
            offset: 0,
            src,
            label,
        }
    }
}
