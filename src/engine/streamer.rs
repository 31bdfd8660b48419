//! The streamer: runs a [`Plan`] on any [`Device`] with the host store and the AdamW pool.
//!
//! The host thread submits device ops in plan order, turning the plan's waits into stream waits
//! on events. Host ops (gradient norms, the clip coefficient, AdamW launches) are queued and run as
//! soon as what they wait for has finished, without holding up submission; a device op that needs
//! a host op (a copy of weights that AdamW is still updating) makes the host finish it first. The
//! device state is the plan's fixed set of buffers, allocated once: nothing grows with depth
//! (with host checkpoints) or with the number of steps.

use super::schedule::{plan, Checkpoints, DevBuf, KernelOp, Lane, Op, Plan, PlanSpec, Res};
use super::trace::{Span, Timeline};
use crate::device::{At, BufId, Cmd, Device, Event, HostRef, Kernel, StreamKind};
use crate::model::reference::Templates;
use crate::optim::adamw::AdamWConfig;
use crate::optim::{unit_segments, AdamJob, AdamPool};
use crate::store::layout::{Mode, StateLayout};
use crate::store::{GradBuffer, HostStore, UnitGuard};
use crate::{Error, Result};
use serde::Serialize;
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// How the streamer runs.
#[derive(Debug, Clone)]
pub struct StreamerConfig {
    /// Sequences per micro-batch.
    pub batch: usize,
    /// Tokens per sequence.
    pub seq: usize,
    /// Micro-batches per optimizer step.
    pub micro_batches: usize,
    /// Checkpoint placement.
    pub checkpoints: Checkpoints,
    /// AdamW hyperparameters (lr is overridden per step by [`Streamer::step`]).
    pub adam: AdamWConfig,
    /// Global-norm clipping threshold (0 = off).
    pub grad_clip: f64,
    /// Also decay 1-D tensors (norm weights, biases).
    pub decay_norms: bool,
}

/// One micro-batch: input tokens and next-token targets, `batch × seq` each.
#[derive(Debug, Clone)]
pub struct MicroBatch {
    /// Inputs.
    pub tokens: Arc<[u32]>,
    /// Targets.
    pub targets: Arc<[u32]>,
}

/// What one step did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StepMetrics {
    /// 1-based optimizer step.
    pub step: u64,
    /// Mean loss over the step's tokens.
    pub loss: f64,
    /// Global gradient norm before clipping (lean mode: from the AdamW pass).
    pub grad_norm: f64,
    /// Clip coefficient applied (1 = none).
    pub clip_coef: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Tokens processed.
    pub tokens: u64,
    /// Wall time of `step`, seconds.
    pub wall_s: f64,
    /// Σ compute-stream op time, seconds.
    pub compute_s: f64,
    /// Σ host→device copy time, seconds.
    pub htod_s: f64,
    /// Σ device→host copy time, seconds.
    pub dtoh_s: f64,
    /// Time the AdamW pools were busy with jobs that completed during this step (the union of the
    /// jobs' submit→done intervals: jobs queue on the same workers), seconds.
    pub optimizer_s: f64,
    /// Σ host→device copy time before the loss (the forward's weight stream), seconds. Gradients
    /// only flow after it, so `htod_before_loss_s + dtoh_s` bounds a link-bound step from below.
    pub htod_before_loss_s: f64,
    /// Time the host thread spent blocked on the device or on AdamW, seconds.
    pub host_wait_s: f64,
    /// Bytes host→device.
    pub htod_bytes: u64,
    /// Bytes device→host.
    pub dtoh_bytes: u64,
    /// Device memory high-water mark, bytes.
    pub device_peak_bytes: u64,
    /// Bytes read from the NVMe spill tier during the step.
    pub nvme_read_bytes: u64,
    /// Bytes written to the NVMe spill tier during the step.
    pub nvme_write_bytes: u64,
    /// Time AdamW jobs waited for spilled state to arrive from NVMe, seconds.
    pub nvme_wait_s: f64,
    /// Time the NVMe I/O thread was busy during the step, seconds.
    pub nvme_busy_s: f64,
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
    plan: Plan,
    bufs: HashMap<DevBuf, BufId>,
    ckpt: Vec<GradBuffer>,
    lean: Vec<Option<GradBuffer>>,
    guards: Vec<Option<UnitGuard>>,
    pending: HashMap<usize, PendingAdam>,
    step: u64,
    prev_norm: Option<f64>,
    timeline: Timeline,
    adam_spans: Vec<(f64, f64)>,
    lean_sumsq: f64,
    /// Units in the order the plan updates them (prefetch hints for the NVMe tier).
    adam_order: Vec<usize>,
    spill_seen: crate::spill::tier::SpillStats,
}

impl std::fmt::Debug for PendingAdam {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("PendingAdam")
            .field("lean", &self.lean)
            .finish()
    }
}

/// Elements of plan buffer `b` for micro-batches of `n` tokens.
pub fn buffer_len(layout: &StateLayout, n: usize, b: DevBuf) -> usize {
    match b {
        DevBuf::W(_) | DevBuf::G(_) => layout.max_unit_numel(),
        DevBuf::GEmb => layout.units[0].numel,
        DevBuf::D(_) | DevBuf::A(_) => n * layout.config.hidden_size,
    }
}

/// Bytes of device buffers the streamer allocates for this shape (the planned working set, the
/// same for any depth with host checkpoints).
pub fn device_bytes(
    layout: &StateLayout,
    batch: usize,
    seq: usize,
    micro_batches: usize,
    checkpoints: Checkpoints,
) -> u64 {
    let spec = PlanSpec {
        layers: layout.config.num_layers,
        tied: layout.config.tie_word_embeddings,
        micro_batches,
        mode: layout.mode,
        checkpoints,
    };
    plan(&spec)
        .buffers
        .iter()
        .map(|b| 4 * buffer_len(layout, batch * seq, *b) as u64)
        .sum()
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
        if cfg.micro_batches == 0 || cfg.batch == 0 || cfg.seq == 0 {
            return Err(Error::bad_input(
                "batch shape",
                format!("{}×{}×{}", cfg.micro_batches, cfg.batch, cfg.seq),
                "must be positive",
                None,
            ));
        }
        let spec = PlanSpec {
            layers: c.num_layers,
            tied: c.tie_word_embeddings,
            micro_batches: cfg.micro_batches,
            mode: layout.mode,
            checkpoints: cfg.checkpoints,
        };
        let plan = plan(&spec);
        let n = cfg.batch * cfg.seq;
        let max_unit = layout.max_unit_numel();
        let mut bufs = HashMap::new();
        for b in &plan.buffers {
            let len = buffer_len(&layout, n, *b);
            bufs.insert(*b, device.alloc(len, &format!("{b:?}"))?);
        }
        // Host buffers the device copies to and from: near the GPU, page-locked by the device
        // when it needs that for asynchronous copies.
        let registrar = device.registrar();
        let near = store.placement().lean_buffers_node;
        let host_buffer = |len: usize| -> Result<GradBuffer> {
            let mut b = GradBuffer::allocate(len, near, Vec::new())?;
            if let Some(r) = &registrar {
                b.register_with(r.as_ref())?;
            }
            Ok(b)
        };
        let ckpt = match cfg.checkpoints {
            Checkpoints::Host => (0..c.num_layers)
                .map(|_| host_buffer(n * c.hidden_size))
                .collect::<Result<_>>()?,
            Checkpoints::Device => Vec::new(),
        };
        let lean = match layout.mode {
            Mode::Lean => (0..super::schedule::LEAN_BUFFERS)
                .map(|_| host_buffer(max_unit).map(Some))
                .collect::<Result<_>>()?,
            Mode::Exact => Vec::new(),
        };
        let units = store.num_units();
        let timeline = Timeline::new(device.epoch());
        let adam_order: Vec<usize> = plan
            .steps
            .iter()
            .filter_map(|s| match s.op {
                Op::Adam { unit, .. } => Some(unit),
                _ => None,
            })
            .collect();
        let spill_seen = store.spill_stats();
        Ok(Streamer {
            device,
            store,
            pool,
            templates,
            cfg,
            plan,
            bufs,
            ckpt,
            lean,
            guards: (0..units).map(|_| None).collect(),
            pending: HashMap::new(),
            step: 0,
            prev_norm: None,
            timeline,
            adam_spans: Vec::new(),
            lean_sumsq: 0.0,
            adam_order,
            spill_seen,
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

    /// The plan being run.
    pub fn plan(&self) -> &Plan {
        &self.plan
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
            self.lean_sumsq += done.sumsq;
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
            .ok_or_else(|| Error::system("streamer", "unit guard", "missing"))
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

    /// Run one optimizer step over `batches` (one per micro-batch) with learning rate `lr`.
    pub fn step(&mut self, batches: &[MicroBatch], lr: f64) -> Result<StepMetrics> {
        let wall = Instant::now();
        if batches.len() != self.cfg.micro_batches {
            return Err(Error::bad_input(
                "micro-batches",
                batches.len().to_string(),
                format!("the plan expects {}", self.cfg.micro_batches),
                None,
            ));
        }
        let n = self.cfg.batch * self.cfg.seq;
        for mb in batches {
            if mb.tokens.len() != n || mb.targets.len() != n {
                return Err(Error::bad_input(
                    "micro-batch",
                    format!("{} tokens", mb.tokens.len()),
                    format!("expected {n}"),
                    None,
                ));
            }
            self.templates.check_tokens(&mb.tokens, "inputs")?;
            self.templates.check_tokens(&mb.targets, "targets")?;
        }
        self.step += 1;
        self.device.reset_peak();
        // Write-backs run on after a step returns: one that failed since then stops this step.
        self.store.check_spill()?;
        // The first unit to be updated: its m/v can come in from NVMe during the forward.
        if let Some(&u) = self.adam_order.first() {
            self.store.prefetch(u);
        }
        let total_tokens = (n * batches.len()) as f64;
        let loss = Arc::new(Mutex::new(0.0f64));
        let steps = self.plan.steps.clone();
        let mut events: Vec<Option<Event>> = vec![None; steps.len()];
        let mut host_done = vec![false; steps.len()];
        let mut host_queue: VecDeque<usize> = VecDeque::new();
        let mut norm_sq = 0.0f64;
        let mut coef = 1.0f64;
        let mut host_wait = 0.0f64;
        let mut adam_steps: HashMap<usize, usize> = HashMap::new();
        let lean = self.store.layout().mode == Mode::Lean;
        if lean {
            // Lean clipping uses the previous step's global norm (stale by one step).
            if let (Some(prev), true) = (self.prev_norm, self.cfg.grad_clip > 0.0) {
                coef = (self.cfg.grad_clip / (prev + 1e-6)).min(1.0);
            }
            self.lean_sumsq = 0.0;
        }
        let adam_cfg = AdamWConfig {
            lr,
            ..self.cfg.adam
        };

        // Run queued host ops whose waits are done (or all of them up to `upto`, blocking).
        macro_rules! run_host {
            ($upto:expr) => {{
                let upto: Option<usize> = $upto;
                while let Some(&i) = host_queue.front() {
                    let must = upto.is_some_and(|u| i <= u);
                    let ready = steps[i].waits.iter().all(|&w| match steps[w].lane {
                        Lane::Host => {
                            host_done[w]
                                && !adam_steps
                                    .get(&w)
                                    .is_some_and(|u| self.pending.contains_key(u))
                        }
                        Lane::Stream(_) => events[w].as_ref().is_some_and(Event::query),
                    });
                    if !ready && !must {
                        break;
                    }
                    let t0 = Instant::now();
                    for &w in &steps[i].waits {
                        match steps[w].lane {
                            Lane::Stream(_) => {
                                if let Some(e) = &events[w] {
                                    e.synchronize();
                                }
                            }
                            Lane::Host => {
                                if let Some(&u) = adam_steps.get(&w) {
                                    self.finish_adam(u)?;
                                }
                            }
                        }
                    }
                    host_wait += t0.elapsed().as_secs_f64();
                    if let Some(e) = self.device.take_error() {
                        return Err(e);
                    }
                    match steps[i].op.clone() {
                        Op::Norm { unit } => {
                            let g = self.guard(unit)?;
                            norm_sq += g.grads().map_or(0.0, |x| crate::optim::adamw::sumsq(x));
                        }
                        Op::Clip => {
                            let norm = norm_sq.sqrt();
                            if self.cfg.grad_clip > 0.0 {
                                coef = (self.cfg.grad_clip / (norm + 1e-6)).min(1.0);
                            }
                        }
                        Op::Adam { unit, lean } => {
                            // Exact mode's next step may still be copying the previous one's
                            // weights: nothing here, the plan ordered those copies before us.
                            let guard = match self.guards[unit].take() {
                                Some(g) => g,
                                None => self.store.take(unit)?,
                            };
                            let buf = match lean {
                                Some(k) => Some(self.lean[k].take().ok_or_else(|| {
                                    Error::system("streamer", "lean buffer", "in use")
                                })?),
                                None => None,
                            };
                            let segs = unit_segments(
                                self.store.layout(),
                                unit,
                                &adam_cfg,
                                self.step,
                                coef as f32,
                                self.cfg.decay_norms,
                            );
                            let node = self.store.placement().worker_node(unit).unwrap_or(0);
                            let submitted = self.device.epoch().elapsed().as_secs_f64();
                            let job = self.pool.submit(node, guard, buf, segs)?;
                            // Read the next unit's spilled state while this one updates.
                            if let Some(k) = self.adam_order.iter().position(|&x| x == unit) {
                                if let Some(&next) = self.adam_order.get(k + 1) {
                                    self.store.prefetch(next);
                                }
                            }
                            self.pending.insert(
                                unit,
                                PendingAdam {
                                    job,
                                    lean,
                                    submitted,
                                },
                            );
                            adam_steps.insert(i, unit);
                        }
                        other => {
                            return Err(Error::system(
                                "streamer",
                                "host op",
                                format!("{other:?} is not a host op"),
                            ))
                        }
                    }
                    host_done[i] = true;
                    host_queue.pop_front();
                }
            }};
        }

        for (i, st) in steps.iter().enumerate() {
            let Lane::Stream(stream) = st.lane else {
                host_queue.push_back(i);
                run_host!(None);
                continue;
            };
            // Host ops this op depends on must have run (and AdamW jobs finished).
            let host_deps: Vec<usize> = st
                .waits
                .iter()
                .copied()
                .filter(|&w| steps[w].lane == Lane::Host)
                .collect();
            if let Some(&last) = host_deps.iter().max() {
                run_host!(Some(last));
                let t0 = Instant::now();
                for w in &host_deps {
                    if let Some(&u) = adam_steps.get(w) {
                        if self.pending.contains_key(&u) {
                            self.finish_adam(u)?;
                        }
                    }
                }
                host_wait += t0.elapsed().as_secs_f64();
            }
            // Ops touching a unit an AdamW job of the previous step still owns wait for it.
            for r in st.reads.iter().chain(&st.writes) {
                if let Res::Params(u) | Res::Grads(u) = r {
                    if self.pending.contains_key(u) {
                        let t0 = Instant::now();
                        self.finish_adam(*u)?;
                        host_wait += t0.elapsed().as_secs_f64();
                    }
                }
            }
            for &w in &st.waits {
                if let (Lane::Stream(s), Some(e)) = (steps[w].lane, &events[w]) {
                    if s != stream {
                        self.device.submit(stream, Cmd::Wait(e.clone()));
                    }
                }
            }
            let cmd = self.translate(&st.op, batches, &loss, total_tokens)?;
            self.device.submit(stream, cmd);
            let e = Event::new();
            self.device.submit(stream, Cmd::Record(e.clone()));
            events[i] = Some(e);
            run_host!(None);
        }
        run_host!(Some(steps.len()));
        // All device work of this step is done once its last events fire.
        let t0 = Instant::now();
        for e in events.iter().flatten() {
            e.synchronize();
        }
        host_wait += t0.elapsed().as_secs_f64();
        if let Some(e) = self.device.take_error() {
            return Err(e);
        }
        let grad_norm = if lean {
            // The norm comes out of the AdamW pass: wait for the stragglers.
            self.finish()?;
            self.lean_sumsq.sqrt()
        } else {
            norm_sq.sqrt()
        };
        self.prev_norm = Some(grad_norm);
        let records = self.device.take_records();
        let mut m = StepMetrics {
            step: self.step,
            loss: *crate::util::lock(&loss) / total_tokens,
            grad_norm,
            clip_coef: coef,
            lr,
            tokens: total_tokens as u64,
            optimizer_s: union_length(std::mem::take(&mut self.adam_spans)),
            host_wait_s: host_wait,
            device_peak_bytes: self.device.memory().peak,
            ..StepMetrics::default()
        };
        let loss_start = records
            .iter()
            .find(|r| r.name == "head_loss_bwd")
            .map_or(f64::INFINITY, |r| r.start);
        m.htod_before_loss_s = records
            .iter()
            .filter(|r| r.stream == StreamKind::CopyIn && r.start < loss_start)
            .map(|r| r.end - r.start)
            .sum();
        for r in &records {
            let d = r.end - r.start;
            match r.stream {
                StreamKind::Compute => m.compute_s += d,
                StreamKind::CopyIn => {
                    m.htod_s += d;
                    m.htod_bytes += r.bytes;
                }
                StreamKind::CopyOut => {
                    m.dtoh_s += d;
                    m.dtoh_bytes += r.bytes;
                }
            }
        }
        self.timeline.extend_device(records);
        let spill = self.store.spill_stats();
        m.nvme_read_bytes = spill.bytes_read - self.spill_seen.bytes_read;
        m.nvme_write_bytes = spill.bytes_written - self.spill_seen.bytes_written;
        m.nvme_wait_s = spill.wait_seconds - self.spill_seen.wait_seconds;
        m.nvme_busy_s = spill.io_seconds - self.spill_seen.io_seconds;
        self.spill_seen = spill;
        self.store.check_spill()?;
        m.wall_s = wall.elapsed().as_secs_f64();
        Ok(m)
    }

    fn translate(
        &mut self,
        op: &Op,
        batches: &[MicroBatch],
        loss: &Arc<Mutex<f64>>,
        total_tokens: f64,
    ) -> Result<Cmd> {
        let n = self.cfg.batch * self.cfg.seq;
        let c = self.store.layout().config.hidden_size;
        Ok(match op {
            Op::CopyWeights { unit, slot } => {
                let dst = self.buf(*slot);
                let g = self.guard(*unit)?;
                // SAFETY: the guard stays in `self.guards` until an AdamW op takes it, and the plan
                // orders that op after this copy's completion event.
                let src = unsafe { HostRef::from_slice(g.params()) };
                Cmd::HtoD {
                    dst,
                    offset: 0,
                    src,
                    label: format!("weights unit {unit}"),
                }
            }
            Op::CkptIn { index, slot } => {
                // SAFETY: the host checkpoint buffer lives in `self`; the plan orders its writer
                // (CkptOut) before this read.
                let src = unsafe { HostRef::from_slice(self.ckpt[*index].as_mut_slice()) };
                Cmd::HtoD {
                    dst: self.buf(*slot),
                    offset: 0,
                    src,
                    label: format!("checkpoint x{index}"),
                }
            }
            Op::CkptOut { index, slot } => {
                // SAFETY: as above; readers of this checkpoint are ordered after this copy.
                let dst =
                    unsafe { HostRef::from_slice(&mut self.ckpt[*index].as_mut_slice()[..n * c]) };
                Cmd::DtoH {
                    dst,
                    src: self.buf(*slot),
                    offset: 0,
                    accumulate: false,
                    label: format!("checkpoint x{index}"),
                }
            }
            Op::CopyGrads {
                unit,
                from,
                accumulate,
                lean,
            } => {
                let numel = self.store.layout().units[*unit].numel;
                let src = self.buf(*from);
                let dst = match lean {
                    Some(k) => {
                        let b = self.lean[*k].as_mut().ok_or_else(|| {
                            Error::system("streamer", "lean buffer", "still owned by AdamW")
                        })?;
                        // SAFETY: the buffer stays in `self.lean` until the AdamW op that consumes it,
                        // which the plan orders after this copy.
                        unsafe { HostRef::from_slice(&mut b.as_mut_slice()[..numel]) }
                    }
                    None => {
                        let g = self.guard(*unit)?;
                        let grads = g.grads().ok_or_else(|| {
                            Error::system(
                                "streamer",
                                "gradients",
                                "exact mode without a grad shard",
                            )
                        })?;
                        // SAFETY: as for CopyWeights: the guard outlives the copy.
                        unsafe { HostRef::from_slice(grads) }
                    }
                };
                Cmd::DtoH {
                    dst,
                    src,
                    offset: 0,
                    accumulate: *accumulate,
                    label: format!("grads unit {unit}"),
                }
            }
            Op::Kernel(k) => Cmd::Kernel(self.kernel(k, batches, loss, total_tokens)),
            other => {
                return Err(Error::system(
                    "streamer",
                    "device op",
                    format!("{other:?} is a host op"),
                ))
            }
        })
    }

    fn kernel(
        &self,
        k: &KernelOp,
        batches: &[MicroBatch],
        loss: &Arc<Mutex<f64>>,
        total_tokens: f64,
    ) -> Kernel {
        let b = |d: DevBuf| self.buf(d);
        let head_off = self.templates.head.lm_head;
        match k {
            KernelOp::EmbedFwd { mb, w, x } => Kernel::EmbedFwd {
                w: (b(*w), 0),
                tokens: batches[*mb].tokens.clone(),
                x: b(*x),
            },
            KernelOp::BlockFwd { layer, w, x, y, .. } => Kernel::BlockFwd {
                layer: *layer,
                w: b(*w),
                x: b(*x),
                y: b(*y),
            },
            KernelOp::HeadLossBwd {
                mb,
                w,
                g,
                lm_w,
                lm_g,
                x,
                dx,
            } => {
                let (lw, lg): (At, At) = match (lm_w, lm_g, head_off) {
                    (Some(ew), Some(eg), _) => ((b(*ew), 0), (b(*eg), 0)),
                    (_, _, Some(off)) => ((b(*w), off), (b(*g), off)),
                    _ => ((b(*w), 0), (b(*g), 0)),
                };
                Kernel::HeadLossBwd {
                    head_w: b(*w),
                    head_g: b(*g),
                    lm_w: lw,
                    lm_g: lg,
                    x: b(*x),
                    targets: batches[*mb].targets.clone(),
                    dx: b(*dx),
                    grad_scale: (1.0 / total_tokens) as f32,
                    loss: loss.clone(),
                }
            }
            KernelOp::BlockBwd {
                layer,
                w,
                g,
                x,
                dy,
                dx,
                ..
            } => Kernel::BlockBwd {
                layer: *layer,
                w: b(*w),
                g: b(*g),
                x: b(*x),
                dy: b(*dy),
                dx: b(*dx),
            },
            KernelOp::EmbedBwd { mb, g, dx } => Kernel::EmbedBwd {
                g: (b(*g), 0),
                tokens: batches[*mb].tokens.clone(),
                dx: b(*dx),
            },
            KernelOp::Zero { buf } => Kernel::Zero {
                buf: b(*buf),
                len: usize::MAX,
            },
        }
    }
}

/// Total length covered by a set of intervals.
fn union_length(mut v: Vec<(f64, f64)>) -> f64 {
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut total = 0.0;
    let mut cur: Option<(f64, f64)> = None;
    for (a, b) in v {
        cur = match cur {
            Some((s, e)) if a <= e => Some((s, e.max(b))),
            Some((s, e)) => {
                total += e - s;
                Some((a, b))
            }
            None => Some((a, b)),
        };
    }
    total + cur.map_or(0.0, |(s, e)| e - s)
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
