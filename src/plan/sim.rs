//! The step-time model: the engine's own step schedule ([`crate::engine::schedule::schedule`])
//! replayed on modelled resources, with a duration for every op.
//!
//! Resources are the three device streams and the host thread (each runs its ops in schedule
//! order), the AdamW pool and the NVMe I/O thread (each serves requests in arrival order). An op
//! starts once its resource is free and everything it waits for has finished: the schedule's
//! waits within the step and across steps — the same ones the streamer follows (a wait on an
//! AdamW op is its job's completion). The NVMe tier is modelled here: a spilled unit's read is
//! issued at its prefetch op and needs a staging slot whose write-back is done; its update waits
//! for the read; its write-back follows the update. Six consecutive steps are replayed and the
//! mean period of the last three is the prediction, so exact mode's AdamW overlapping the next
//! forward and lean mode's AdamW chasing the backward are both in it.

use crate::device::{Kernel, StreamKind};
use crate::engine::schedule::{Lane, Op, Schedule};
use serde::Serialize;

/// Seconds per kernel kind (one micro-batch).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct KernelCosts {
    /// Embedding gather.
    pub embed_fwd: f64,
    /// One decoder block forward.
    pub block_fwd: f64,
    /// Final norm + LM head + loss + their backward.
    pub head: f64,
    /// One decoder block backward (with its recompute).
    pub block_bwd: f64,
    /// Embedding gradient scatter.
    pub embed_bwd: f64,
    /// Zeroing one gradient buffer.
    pub zero: f64,
    /// Storing one layer input in bf16, or widening it back.
    pub cast: f64,
}

/// The duration of everything the plan does.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Costs {
    /// Elements per unit.
    pub unit_numel: Vec<usize>,
    /// Lean mode: the elements of a gradient piece ([`crate::store::layout::StateLayout::lean_piece_elems`]);
    /// `None`: every unit whole.
    pub lean_piece_elems: Option<usize>,
    /// Bytes per streamed weight element (4 fp32, 2 bf16).
    pub weight_elem_bytes: f64,
    /// Bytes per gradient element on the way back (4 fp32, 2 with `--grad-link bf16`).
    pub grad_elem_bytes: f64,
    /// Bytes of one layer-boundary activation.
    pub activation_bytes: f64,
    /// Host→device bytes/s.
    pub htod_bps: f64,
    /// Device→host bytes/s.
    pub dtoh_bps: f64,
    /// Fixed cost per copy, s.
    pub copy_latency_s: f64,
    /// Bytes/s of host memory traffic the landing of a bounced gradient copy gets (a GPU's
    /// accumulating or bf16 copies: each chunk crosses into a page-locked bounce buffer and is
    /// added or widened into the gradient shard by the host's cores, overlapping the next
    /// chunk's copy), so such a copy takes the longer of its link time and its landing's
    /// traffic ([`landing_bytes_per_elem`]) at this rate. `None`: gradients land by the copy
    /// alone (the CPU device).
    pub land_bps: Option<f64>,
    /// Kernels.
    pub kernels: KernelCosts,
    /// AdamW seconds per unit.
    pub adam_s: Vec<f64>,
    /// Σg² seconds per unit (exact mode's norm, on the host thread).
    pub norm_s: Vec<f64>,
    /// NVMe read seconds per unit (0: not spilled).
    pub nvme_read_s: Vec<f64>,
    /// NVMe write seconds per unit.
    pub nvme_write_s: Vec<f64>,
    /// Seconds to sum each unit's gradients across the ranks (data parallel, on the host
    /// thread; empty or zeros for one rank).
    pub reduce_s: Vec<f64>,
    /// Per unit: seconds to gather its params from the rank holding them (ZeRO stage 3: on the
    /// host thread before each copy of them, or, gathered by the GPUs, NCCL's broadcast on the
    /// weight stream after the owner's copy; empty: free).
    pub gather_s: Vec<f64>,
    /// Per unit: whether the rank planned holds its params (empty: every unit). Where the GPUs
    /// gather, only those cross its link.
    pub held: Vec<bool>,
    /// Staging slots of the NVMe tier.
    pub staging_slots: usize,
    /// When compute kernels and AdamW run on the same CPU cores (the CPU device), how they
    /// share them; `None` for a GPU, whose kernels do not compete with the host's AdamW.
    pub shared_cores: Option<SharedCores>,
}

/// Compute kernels and AdamW workers sharing `cores` CPU cores: while both run, every thread
/// gets `cores / (compute_threads + adam_threads)` of a core (fair scheduling), so each side
/// slows by what it loses.
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct SharedCores {
    /// Cores.
    pub cores: f64,
    /// Threads the compute kernels use.
    pub compute_threads: f64,
    /// AdamW worker threads.
    pub adam_threads: f64,
    /// Share of the NVMe I/O thread's time that is CPU work (checksums), 0 for pure waiting.
    pub io_cpu_fraction: f64,
}

impl SharedCores {
    /// Rates (compute, AdamW, I/O) relative to running alone, given which of them run.
    fn rates(&self, compute: bool, adam: bool, io: bool) -> (f64, f64, f64) {
        let ct = if compute { self.compute_threads } else { 0.0 };
        let at = if adam { self.adam_threads } else { 0.0 };
        let it = if io { self.io_cpu_fraction } else { 0.0 };
        let total = ct + at + it;
        if total <= self.cores {
            return (1.0, 1.0, 1.0);
        }
        let share = self.cores / total;
        let alone = |t: f64| t.min(self.cores).max(1e-9);
        let f = self.io_cpu_fraction;
        (
            (self.compute_threads * share / alone(self.compute_threads)).min(1.0),
            (self.adam_threads * share / alone(self.adam_threads)).min(1.0),
            1.0 / ((1.0 - f) + f / share.min(1.0)),
        )
    }
}

/// Predicted step time and each resource's busy time per step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Prediction {
    /// Steady-state step period, s.
    pub step_s: f64,
    /// Compute stream busy, s per step.
    pub compute_s: f64,
    /// Copy-in stream busy.
    pub htod_s: f64,
    /// Copy-out stream busy.
    pub dtoh_s: f64,
    /// AdamW pool busy.
    pub adam_s: f64,
    /// NVMe I/O busy.
    pub nvme_s: f64,
    /// The busiest resource.
    pub bottleneck: &'static str,
}

const COPY_IN: usize = 0;
const COMPUTE: usize = 1;
const COPY_OUT: usize = 2;
const HOST: usize = 3;
const POOL: usize = 4;
const IO: usize = 5;
const NAMES: [&str; 6] = [
    "host→device",
    "GPU compute",
    "device→host",
    "host thread",
    "CPU AdamW",
    "NVMe",
];

#[derive(Debug)]
struct Task {
    res: usize,
    dur: f64,
    deps: Vec<usize>,
    step: usize,
}

fn push_task(tasks: &mut Vec<Task>, res: usize, dur: f64, deps: Vec<usize>, step: usize) -> usize {
    tasks.push(Task {
        res,
        dur: dur.max(0.0),
        deps,
        step,
    });
    tasks.len() - 1
}

/// The resource and duration of a schedule op (an Adam op's own cost is its submission; its
/// job is a task of its own).
fn op_cost(lane: &Lane, op: &Op, costs: &Costs) -> (usize, f64) {
    let copy = |bytes: f64, bps: f64| costs.copy_latency_s + bytes / bps;
    let unit_bytes = |u: usize, per: f64| costs.unit_numel[u] as f64 * per;
    let piece_bytes =
        |u: usize, piece: usize| costs.piece_len(u, piece) as f64 * costs.grad_elem_bytes;
    match (lane, op) {
        (Lane::Stream(s), op) => {
            let res = match s {
                StreamKind::CopyIn => COPY_IN,
                StreamKind::Compute => COMPUTE,
                StreamKind::CopyOut => COPY_OUT,
            };
            let k = &costs.kernels;
            let dur = match op {
                Op::CopyWeights {
                    unit,
                    broadcast: false,
                    ..
                } => copy(unit_bytes(*unit, costs.weight_elem_bytes), costs.htod_bps),
                // The owner's copy, then every rank's broadcast, on the weight stream.
                Op::CopyWeights { unit, .. } => {
                    let own = match costs.held.get(*unit).copied().unwrap_or(true) {
                        true => copy(unit_bytes(*unit, costs.weight_elem_bytes), costs.htod_bps),
                        false => 0.0,
                    };
                    own + costs.gather_s.get(*unit).map_or(0.0, |s| *s)
                }
                Op::LoadActivation { .. } => copy(costs.activation_bytes, costs.htod_bps),
                Op::SaveActivation { .. } => copy(costs.activation_bytes, costs.dtoh_bps),
                Op::CopyGrads {
                    unit,
                    piece,
                    accumulate,
                    landing,
                    ..
                } => {
                    let link = copy(piece_bytes(*unit, *piece), costs.dtoh_bps);
                    // Sharded gradients land as they are (their Reduce accumulates).
                    let traffic = landing_bytes_per_elem(
                        costs.grad_elem_bytes,
                        *accumulate && landing.is_none(),
                    );
                    match costs.land_bps {
                        Some(bps) if traffic > 0.0 => link.max(
                            costs.copy_latency_s
                                + costs.piece_len(*unit, *piece) as f64 * traffic / bps,
                        ),
                        _ => link,
                    }
                }
                Op::Kernel(Kernel::EmbedFwd { .. }) => k.embed_fwd,
                Op::Kernel(Kernel::BlockFwd { .. }) => k.block_fwd,
                Op::Kernel(Kernel::HeadLossBwd { .. } | Kernel::HeadLoss { .. }) => k.head,
                Op::Kernel(Kernel::BlockBwd { .. }) => k.block_bwd,
                Op::Kernel(Kernel::EmbedBwd { .. }) => k.embed_bwd,
                Op::Kernel(Kernel::Zero { .. }) => k.zero,
                Op::Kernel(Kernel::Narrow { .. } | Kernel::Widen { .. }) => k.cast,
                _ => 0.0,
            };
            (res, dur)
        }
        (Lane::Host, Op::Norm { unit }) => (HOST, costs.norm_s[*unit]),
        (Lane::Host, op @ Op::Reduce { .. }) => (HOST, host_seconds(op, costs)),
        (Lane::Host, Op::Gather { unit, .. }) => {
            (HOST, costs.gather_s.get(*unit).map_or(0.0, |s| *s))
        }
        (Lane::Host, _) => (HOST, 0.0),
    }
}

/// Seconds the host thread spends in a data-parallel [`Op::Reduce`]: its unit's (piece's) share
/// of the sum and, for a later micro-batch's sum of a unit the rank holds (sharded gradients),
/// adding it to the shard (read both, write one: 12 B/element at the landing rate).
pub(super) fn host_seconds(op: &Op, costs: &Costs) -> f64 {
    let Op::Reduce {
        unit,
        piece,
        accumulate,
        ..
    } = op
    else {
        return 0.0;
    };
    let len = costs.piece_len(*unit, *piece) as f64;
    let share = len / costs.unit_numel[*unit].max(1) as f64;
    let sum = costs.reduce_s.get(*unit).map_or(0.0, |s| s * share);
    let held = costs.held.get(*unit).copied().unwrap_or(true);
    let add = match (accumulate, held, costs.land_bps) {
        (true, true, Some(bps)) => len * 12.0 / bps,
        _ => 0.0,
    };
    sum + add
}

/// Host memory bytes per gradient element that landing a bounced copy moves: the bounce
/// buffer read (`link_elem_bytes`), the shard read when accumulating, the shard written. 0 for
/// a copy that is not bounced (fp32 `=`: the DMA writes the shard itself).
pub fn landing_bytes_per_elem(link_elem_bytes: f64, accumulate: bool) -> f64 {
    let bounced = accumulate || link_elem_bytes < 4.0;
    if !bounced {
        return 0.0;
    }
    link_elem_bytes + if accumulate { 4.0 } else { 0.0 } + 4.0
}

impl Costs {
    /// Elements of piece `piece` of unit `unit` (0 past its last).
    fn piece_len(&self, unit: usize, piece: usize) -> usize {
        let numel = self.unit_numel[unit];
        let size = self.lean_piece_elems.unwrap_or(numel).max(1);
        ((piece + 1) * size).min(numel) - (piece * size).min(numel)
    }
}

/// FIFO in submission order (streams, host thread) or in arrival order (pool, I/O).
fn in_submission_order(res: usize) -> bool {
    res <= HOST
}

/// Factors on each resource's task durations: the same schedule replayed with the component
/// times a run measured instead of those calibrated alone (`bench engine`'s dependency bound).
#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Scale {
    /// Compute kernels.
    pub compute: f64,
    /// Host→device copies.
    pub htod: f64,
    /// Device→host copies.
    pub dtoh: f64,
    /// AdamW jobs.
    pub adam: f64,
    /// NVMe reads and writes.
    pub nvme: f64,
}

impl Scale {
    /// Every duration as costed.
    pub const ONE: Scale = Scale {
        compute: 1.0,
        htod: 1.0,
        dtoh: 1.0,
        adam: 1.0,
        nvme: 1.0,
    };

    fn of(&self, res: usize) -> f64 {
        match res {
            COMPUTE => self.compute,
            COPY_IN => self.htod,
            COPY_OUT => self.dtoh,
            POOL => self.adam,
            IO => self.nvme,
            _ => 1.0,
        }
    }
}

/// Replay `schedule` for six steps under `costs`.
pub fn simulate(schedule: &Schedule, costs: &Costs) -> Prediction {
    simulate_scaled(schedule, costs, Scale::ONE)
}

/// [`simulate`] with each resource's durations multiplied by its factor in `scale`.
pub fn simulate_scaled(schedule: &Schedule, costs: &Costs, scale: Scale) -> Prediction {
    const STEPS: usize = 6;
    const WARM: usize = 3;
    let units = costs.unit_numel.len();
    let mut tasks: Vec<Task> = Vec::new();
    let spilled = |u: usize| costs.nvme_read_s.get(u).is_some_and(|r| *r > 0.0);
    let mut last_write: Vec<Option<usize>> = vec![None; units];
    let mut starts = Vec::new();
    let mut prev_done: Vec<usize> = Vec::new();
    // What each schedule task of the previous step became (an Adam task: its job).
    let mut prev_id: Vec<usize> = Vec::new();
    for step in 0..=STEPS {
        let start = push_task(&mut tasks, HOST, 0.0, prev_done.clone(), step);
        starts.push(start);
        if step == STEPS {
            break;
        }
        let mut id_of = vec![0usize; schedule.tasks.len()];
        let mut done = Vec::new();
        let mut read_of: Vec<Option<usize>> = vec![None; units];
        let mut writes: Vec<usize> = Vec::new();
        for (i, st) in schedule.tasks.iter().enumerate() {
            let mut deps: Vec<usize> = st.waits.iter().map(|&w| id_of[w]).collect();
            deps.extend(
                st.prev_waits
                    .iter()
                    .filter_map(|&w| prev_id.get(w).copied()),
            );
            deps.push(start);
            let (res, dur) = op_cost(&st.lane, &st.op, costs);
            let id = push_task(&mut tasks, res, dur, deps, step);
            id_of[i] = id;
            done.push(id);
            match st.op {
                Op::Prefetch { unit } if spilled(unit) => {
                    // The read needs a staging slot whose write-back is done.
                    let mut rdeps = vec![id];
                    let slots = costs.staging_slots.max(1);
                    if writes.len() + 1 >= slots {
                        rdeps.push(writes[writes.len() + 1 - slots]);
                    } else if let Some(w) = last_write[unit] {
                        rdeps.push(w);
                    }
                    read_of[unit] = Some(push_task(
                        &mut tasks,
                        IO,
                        costs.nvme_read_s[unit],
                        rdeps,
                        step,
                    ));
                }
                Op::Adam { unit, piece, .. } => {
                    // A piece's share of the unit's update; a spilled unit is read before its
                    // first piece and written back after its last.
                    let mut jdeps = vec![id];
                    jdeps.extend(read_of[unit]);
                    let share =
                        costs.piece_len(unit, piece) as f64 / costs.unit_numel[unit].max(1) as f64;
                    let j = push_task(&mut tasks, POOL, costs.adam_s[unit] * share, jdeps, step);
                    id_of[i] = j;
                    let last = costs.piece_len(unit, piece + 1) == 0;
                    if spilled(unit) && last {
                        let w = push_task(&mut tasks, IO, costs.nvme_write_s[unit], vec![j], step);
                        writes.push(w);
                        last_write[unit] = Some(w);
                    }
                }
                _ => {}
            }
        }
        // `step()` returns once every device and host task of the step is done (a lean step's
        // norm waits for its updates; an exact step's updates run on into the next).
        prev_done = done;
        prev_id = id_of;
    }
    for t in &mut tasks {
        t.dur *= scale.of(t.res).max(0.0);
    }
    let (start_t, busy) = replay(&tasks, costs.shared_cores);
    let period = (start_t[starts[STEPS]] - start_t[starts[WARM]]) / (STEPS - WARM) as f64;
    let per_step = |r: usize| {
        busy.iter()
            .filter(|(res, step, _)| *res == r && *step >= WARM)
            .map(|x| x.2)
            .sum::<f64>()
            / (STEPS - WARM) as f64
            + 0.0 // an empty sum is -0.0
    };
    let parts = [
        (COMPUTE, per_step(COMPUTE)),
        (COPY_IN, per_step(COPY_IN)),
        (COPY_OUT, per_step(COPY_OUT)),
        (POOL, per_step(POOL)),
        (IO, per_step(IO)),
    ];
    let bottleneck = parts
        .iter()
        .fold(
            (COMPUTE, -1.0),
            |a, &(r, v)| if v > a.1 { (r, v) } else { a },
        )
        .0;
    Prediction {
        step_s: period,
        compute_s: parts[0].1,
        htod_s: parts[1].1,
        dtoh_s: parts[2].1,
        adam_s: parts[3].1,
        nvme_s: parts[4].1,
        bottleneck: NAMES[bottleneck],
    }
}

/// Event-driven replay. At each event time, every task whose dependencies have finished starts
/// if its resource is idle (and, on a submission-ordered resource, it is next in order; on the
/// others the earliest-ready waiting task goes first). Running tasks progress at rate 1, except
/// compute and AdamW when they share CPU cores. Returns each task's start time and
/// (resource, step, busy seconds) per task.
fn replay(tasks: &[Task], shared: Option<SharedCores>) -> (Vec<f64>, Vec<(usize, usize, f64)>) {
    let n = tasks.len();
    let mut start = vec![f64::NAN; n];
    let mut end = vec![f64::NAN; n];
    let mut busy_s = vec![0.0f64; n];
    let mut queue: Vec<Vec<usize>> = vec![Vec::new(); 6];
    for (i, t) in tasks.iter().enumerate() {
        queue[t.res].push(i);
    }
    let mut head = [0usize; 6];
    // Per resource: the running task and its remaining work (seconds at rate 1).
    let mut running: [Option<(usize, f64)>; 6] = [None; 6];
    // Arrival-ordered resources: their tasks not yet started.
    let mut waiting: Vec<Vec<usize>> = vec![Vec::new(); 6];
    for (i, t) in tasks.iter().enumerate() {
        if !in_submission_order(t.res) {
            waiting[t.res].push(i);
        }
    }
    let mut now = 0.0f64;
    let mut finished = 0;
    while finished < n {
        // Start what can start now (zero-length tasks finish at once and may unlock more).
        loop {
            let mut started_any = false;
            for r in 0..6 {
                if running[r].is_some() {
                    continue;
                }
                let ready = |i: usize| tasks[i].deps.iter().all(|&d| end[d] <= now);
                let pick = if in_submission_order(r) {
                    queue[r].get(head[r]).copied().filter(|&i| ready(i))
                } else {
                    waiting[r]
                        .iter()
                        .copied()
                        .filter(|&i| ready(i))
                        .min_by(|&a, &b| {
                            let ra = tasks[a].deps.iter().map(|&d| end[d]).fold(0.0, f64::max);
                            let rb = tasks[b].deps.iter().map(|&d| end[d]).fold(0.0, f64::max);
                            ra.total_cmp(&rb).then(a.cmp(&b))
                        })
                };
                if let Some(i) = pick {
                    start[i] = now;
                    if in_submission_order(r) {
                        head[r] += 1;
                    } else {
                        waiting[r].retain(|&x| x != i);
                    }
                    if tasks[i].dur <= 0.0 {
                        end[i] = now;
                        finished += 1;
                    } else {
                        running[r] = Some((i, tasks[i].dur));
                    }
                    started_any = true;
                }
            }
            if !started_any {
                break;
            }
        }
        if finished >= n {
            break;
        }
        // Rates of what runs.
        let mut rate = [1.0f64; 6];
        if let Some(sc) = shared {
            let (c, a, io) = sc.rates(
                running[COMPUTE].is_some(),
                running[POOL].is_some(),
                running[IO].is_some(),
            );
            rate[COMPUTE] = c;
            rate[POOL] = a;
            rate[IO] = io;
        }
        // Advance to the next finish; whatever finishes then (at least one task) ends exactly
        // there, so rounding can never stall the clock.
        let fin: Vec<Option<f64>> = (0..6)
            .map(|r| running[r].map(|(_, rem)| now + rem / rate[r]))
            .collect();
        let next = fin.iter().flatten().fold(f64::INFINITY, |a, &b| a.min(b));
        if !next.is_finite() {
            break; // nothing runs and nothing can start: a cycle (not for engine plans)
        }
        let dt = next - now;
        for r in 0..6 {
            if let (Some((i, rem)), Some(f)) = (running[r], fin[r]) {
                busy_s[i] += dt;
                if f <= next {
                    end[i] = next;
                    finished += 1;
                    running[r] = None;
                } else {
                    running[r] = Some((i, (rem - dt * rate[r]).max(0.0)));
                }
            }
        }
        now = next;
    }
    let busy = tasks
        .iter()
        .enumerate()
        .map(|(i, t)| (t.res, t.step, busy_s[i]))
        .collect();
    (start, busy)
}

#[cfg(test)]
pub(crate) mod tests {
    use super::*;
    use crate::engine::schedule::{schedule, Activations, ScheduleSpec};
    use crate::store::layout::Mode;

    /// `units` units of 1M elements, every duration zero, a link too fast to matter.
    pub(crate) fn costs(units: usize) -> Costs {
        Costs {
            unit_numel: vec![1_000_000; units],
            lean_piece_elems: None,
            weight_elem_bytes: 4.0,
            grad_elem_bytes: 4.0,
            activation_bytes: 0.0,
            htod_bps: 1e12,
            dtoh_bps: 1e12,
            copy_latency_s: 0.0,
            land_bps: None,
            kernels: KernelCosts {
                embed_fwd: 0.0,
                block_fwd: 0.0,
                head: 0.0,
                block_bwd: 0.0,
                embed_bwd: 0.0,
                zero: 0.0,
                cast: 0.0,
            },
            adam_s: vec![0.0; units],
            norm_s: vec![0.0; units],
            nvme_read_s: vec![0.0; units],
            nvme_write_s: vec![0.0; units],
            reduce_s: Vec::new(),
            gather_s: Vec::new(),
            held: Vec::new(),
            staging_slots: 3,
            shared_cores: None,
        }
    }

    /// One micro-batch of `layers` blocks, activations on the host, one rank.
    pub(crate) fn spec(layers: usize, mode: Mode) -> ScheduleSpec {
        ScheduleSpec {
            layers,
            tied: false,
            micro_batches: 1,
            mode,
            activations: Activations::Host,
            activation_dtype: crate::engine::ActivationDtype::Fp32,
            device_inputs: 0,
            lean_pieces: crate::engine::schedule::LeanPieces::WHOLE,
            ranks: 1,
            gather: crate::engine::schedule::Gather::No,
            land: false,
        }
    }

    #[test]
    fn compute_bound_step_is_the_sum_of_the_kernels() {
        let mut c = costs(6);
        c.kernels.block_fwd = 1.0;
        c.kernels.block_bwd = 3.0;
        c.kernels.head = 2.0;
        let p = simulate(&schedule(&spec(4, Mode::Exact)), &c);
        assert!((p.step_s - (4.0 + 12.0 + 2.0)).abs() < 1e-3, "{p:?}");
        assert_eq!(p.bottleneck, "GPU compute");
    }

    #[test]
    fn a_scaled_resource_replays_as_if_its_costs_were_scaled() {
        let mut c = costs(6);
        c.kernels.block_fwd = 1.0;
        c.kernels.block_bwd = 3.0;
        c.kernels.head = 2.0;
        let s = schedule(&spec(4, Mode::Exact));
        let scaled = simulate_scaled(
            &s,
            &c,
            Scale {
                compute: 2.0,
                ..Scale::ONE
            },
        );
        c.kernels.block_fwd = 2.0;
        c.kernels.block_bwd = 6.0;
        c.kernels.head = 4.0;
        let costed = simulate(&s, &c);
        assert!((scaled.step_s - 36.0).abs() < 1e-3, "{scaled:?}");
        assert!((scaled.step_s - costed.step_s).abs() < 1e-9);
        assert!((scaled.compute_s - costed.compute_s).abs() < 1e-9);
    }

    #[test]
    fn link_bound_step_is_the_weight_stream_plus_the_gradient_drain_tail() {
        let mut c = costs(6);
        c.htod_bps = 4e6; // 1 s per unit copy
        c.dtoh_bps = 1e12;
        let p = simulate(&schedule(&spec(4, Mode::Exact)), &c);
        // Weights stream in once for the forward and once for the backward (less what is still
        // resident when the backward starts), one unit per second.
        assert!(p.step_s >= 9.0 && p.step_s <= 12.0, "{p:?}");
        assert_eq!(p.bottleneck, "host→device");
    }

    /// Data parallel: each unit's sum runs on the host thread between its gradients' landing
    /// and its update, once a step (lean mode: a piece at a time, the same total), and nothing
    /// runs on the host thread meanwhile.
    #[test]
    fn the_ranks_sum_is_on_the_host_thread_once_per_unit() {
        let mut c = costs(6);
        c.kernels.block_fwd = 0.1;
        c.kernels.block_bwd = 0.1;
        c.reduce_s = vec![1.0; 6];
        for mode in [Mode::Exact, Mode::Lean] {
            let one = simulate(&schedule(&spec(4, mode)), &c);
            let two = simulate(
                &schedule(&ScheduleSpec {
                    ranks: 2,
                    ..spec(4, mode)
                }),
                &c,
            );
            // One rank schedules no sum; two sum 6 units, 1 s each, back to back at most.
            assert!(one.step_s < 1.0, "{mode:?}: {one:?}");
            assert!(
                two.step_s >= 6.0 && two.step_s < 6.0 + 1.0,
                "{mode:?}: {two:?}"
            );
        }
        let mut lean = c.clone();
        lean.lean_piece_elems = Some(400_000);
        let p = simulate(
            &schedule(&ScheduleSpec {
                ranks: 2,
                lean_pieces: crate::engine::schedule::LeanPieces {
                    embedding: 3,
                    block: 3,
                    head: 3,
                },
                ..spec(4, Mode::Lean)
            }),
            &lean,
        );
        // Three pieces a unit (0.4 + 0.4 + 0.2 of its sum): still 6 s in all.
        assert!(p.step_s >= 6.0 && p.step_s < 7.0, "{p:?}");
    }

    #[test]
    fn exact_mode_adamw_overlaps_only_the_next_forward() {
        let mut c = costs(6);
        c.kernels.block_fwd = 1.0;
        c.kernels.block_bwd = 1.0;
        c.adam_s = vec![2.0; 6];
        let ex = simulate(&schedule(&spec(4, Mode::Exact)), &c);
        let le = simulate(&schedule(&spec(4, Mode::Lean)), &c);
        // 12 s of AdamW per step; exact cannot start it before the backward ends (4 s of it),
        // lean starts it as gradients land but must finish it before the step returns.
        assert!(ex.step_s >= 12.0 + 4.0 - 1e-9, "{ex:?}");
        assert!(le.step_s >= 12.0 + 1.0 - 1e-9, "{le:?}");
        assert_eq!(ex.bottleneck, "CPU AdamW");
    }

    #[test]
    fn bounced_gradient_copies_take_the_longer_of_link_and_landing() {
        assert_eq!(landing_bytes_per_elem(4.0, false), 0.0);
        assert_eq!(landing_bytes_per_elem(4.0, true), 12.0);
        assert_eq!(landing_bytes_per_elem(2.0, false), 6.0);
        assert_eq!(landing_bytes_per_elem(2.0, true), 10.0);
        let mut c = costs(6);
        c.dtoh_bps = 4e6; // 1 s per unit's fp32 gradients
        let two = ScheduleSpec {
            micro_batches: 2,
            ..spec(4, Mode::Exact)
        };
        let link_only = simulate(&schedule(&two), &c);
        // Landing `+=` moves 12 B per element: at 6 MB/s, 2 s per unit, on the second
        // micro-batch only (the first one's `=` is the DMA's own).
        c.land_bps = Some(6e6);
        let landed = simulate(&schedule(&two), &c);
        assert!(
            (link_only.dtoh_s - 12.0).abs() < 1e-6 && (landed.dtoh_s - 18.0).abs() < 1e-6,
            "{link_only:?} {landed:?}"
        );
        // bf16 gradients halve the link time but are widened on the host on both micro-batches.
        c.grad_elem_bytes = 2.0;
        let bf16 = simulate(&schedule(&two), &c);
        let want = 6.0 * (6.0 / 6.0) + 6.0 * (10.0 / 6.0);
        assert!((bf16.dtoh_s - want).abs() < 1e-6, "{bf16:?}");
    }

    #[test]
    fn spill_bound_step_is_the_nvme_traffic() {
        let mut c = costs(6);
        c.kernels.block_fwd = 0.1;
        c.nvme_read_s = vec![1.0; 6];
        c.nvme_write_s = vec![1.0; 6];
        for mode in [Mode::Exact, Mode::Lean] {
            let p = simulate(&schedule(&spec(4, mode)), &c);
            assert!(p.step_s >= 12.0 - 1e-9 && p.step_s < 14.0, "{mode:?} {p:?}");
            assert_eq!(p.bottleneck, "NVMe");
        }
    }
}

#[cfg(test)]
mod contention_tests {
    use super::*;

    #[test]
    fn shared_cores_slow_both_sides_while_they_overlap() {
        let sc = SharedCores {
            cores: 2.0,
            compute_threads: 2.0,
            adam_threads: 1.0,
            io_cpu_fraction: 0.0,
        };
        let (c, a, _) = sc.rates(true, true, false);
        assert!((c - 2.0 / 3.0).abs() < 1e-12 && (a - 2.0 / 3.0).abs() < 1e-12);
        assert_eq!(sc.rates(true, false, true), (1.0, 1.0, 1.0));
        let free = SharedCores { cores: 4.0, ..sc };
        assert_eq!(free.rates(true, true, false), (1.0, 1.0, 1.0));
        // An I/O thread that is half CPU work, beside 2 compute threads on 2 cores.
        let io = SharedCores {
            io_cpu_fraction: 0.5,
            ..sc
        };
        let (c, _, r) = io.rates(true, false, true);
        assert!((c - 0.8).abs() < 1e-12 && (r - 1.0 / (0.5 + 0.5 / 0.8)).abs() < 1e-12);
        // Two 1 s tasks on compute and pool at once finish together after 1.5 s.
        let tasks = vec![
            Task {
                res: COMPUTE,
                dur: 1.0,
                deps: vec![],
                step: 0,
            },
            Task {
                res: POOL,
                dur: 1.0,
                deps: vec![],
                step: 0,
            },
        ];
        let (_, busy) = replay(&tasks, Some(sc));
        assert!(
            (busy[0].2 - 1.5).abs() < 1e-9 && (busy[1].2 - 1.5).abs() < 1e-9,
            "{busy:?}"
        );
        let (_, alone) = replay(&tasks, None);
        assert!((alone[0].2 - 1.0).abs() < 1e-9);
    }
}
