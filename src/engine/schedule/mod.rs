//! The step schedule, a pure plan: which op runs where, on which buffers, after what — within a
//! step and across steps.
//!
//! [`schedule`] lists the ops of one optimizer step in submission order, each with the resources
//! it reads and writes (device buffers, host shards, the norm and the clip coefficient). A hazard
//! tracker (`hazards.rs`) then derives every dependency: an op waits for the last writer of what
//! it reads and for the readers and writer of what it writes, unless FIFO order on the same lane
//! already implies it. Run over two consecutive steps, the same tracker derives the waits *across*
//! steps ([`Task::prev_waits`]): the next step's copy of a unit's weights waits for its previous
//! update, a lean gradient buffer is refilled only after the update that used it, the clip
//! coefficient of a lean step waits for the previous step's norm. Nothing about ordering is
//! coded anywhere else: the streamer and the step-time model only follow these waits.
//!
//! Wait semantics, for both: a wait on a device op is its completion; on [`Op::Adam`], the
//! AdamW job's completion (not its submission); every device op of a step completes before the
//! step returns, so the device ops a next step waits for are already done.

mod evaluation;
mod hazards;
mod ops;

pub use evaluation::{evaluation, evaluation_fits};
use hazards::track_hazards;
pub use ops::{DevBuf, Gather, Lane, Op, Res, Schedule, Task};

use crate::device::{Access, Kernel, StreamKind};
use crate::store::layout::{Mode, StateLayout};
use serde::{Deserialize, Serialize};

/// Where the layer-boundary activations (the inputs each block's backward recomputes from) live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Activations {
    /// All L+1 on the device: no copies, device memory grows with depth.
    Device,
    /// Offloaded to host memory: two device buffers whatever the depth.
    Host,
    /// All L+1 on the device and every block's forward internals too, so the backward
    /// recomputes nothing (as PyTorch without checkpointing): the most device memory, the least
    /// compute.
    Keep,
}

/// How the layer inputs the backward recomputes from are stored (`--activation-dtype`): as the
/// forward computed them, or rounded to bf16 (nearest even) — half the bytes, on the device, on
/// the link and on the host. Under bf16 the backward of every block then recomputes from the
/// bf16 rounding of its input (the forward is unchanged): a recipe of its own, golden-tested
/// against PyTorch storing the same (tools/golden_train_bf16.py). Kept internals
/// ([`Activations::Keep`]) store no inputs, so the dtype does not apply to them.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, Hash, Default, Serialize, Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum ActivationDtype {
    /// fp32: the backward recomputes from exactly the forward's input.
    #[default]
    Fp32,
    /// bf16 (nearest even): 2 B per element (only with `--precision bf16`).
    Bf16,
}

impl ActivationDtype {
    /// The name the flag takes.
    pub fn name(self) -> &'static str {
        match self {
            ActivationDtype::Fp32 => "fp32",
            ActivationDtype::Bf16 => "bf16",
        }
    }

    /// Bytes per stored element.
    pub fn elem_bytes(self) -> u64 {
        match self {
            ActivationDtype::Fp32 => 4,
            ActivationDtype::Bf16 => 2,
        }
    }
}

/// What the schedule is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ScheduleSpec {
    /// Decoder layers L (units are 0 = embedding, 1..=L blocks, L+1 head).
    pub layers: usize,
    /// Tied embeddings.
    pub tied: bool,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Exact or lean.
    pub mode: Mode,
    /// Where the layer-boundary activations live.
    pub activations: Activations,
    /// How the layer inputs are stored (device and host activations).
    pub activation_dtype: ActivationDtype,
    /// Host activations: how many of the last blocks' inputs stay on the device all the same
    /// (as many as its memory holds; 0: every input offloaded). The last blocks' are the ones
    /// the backward needs first, so they cost no wait; the earlier ones' copies overlap the
    /// forward and the later blocks' backward. Ignored by device and kept activations.
    pub device_inputs: usize,
    /// Lean mode: how many pieces each unit's gradients leave the device and are updated in.
    pub lean_pieces: LeanPieces,
    /// Data-parallel ranks (1: one process). With more, each unit's step gradients are summed
    /// across ranks ([`Op::Reduce`]) once they are on the host, before their norm or update.
    pub ranks: usize,
    /// ZeRO stage 3: how each copy of a unit's params to the device gets them from the rank
    /// holding them.
    pub gather: Gather,
    /// ZeRO stage 3 with sharded gradients (exact mode): each micro-batch's gradients of a unit
    /// leave the device into a landing buffer ([`Res::Landed`], two in turn; the owner's first
    /// micro-batch's into its shard), are summed across the ranks there at once, added to the
    /// owner's shard and dropped elsewhere.
    pub land: bool,
}

impl ScheduleSpec {
    /// Whether the layer inputs are stored in bf16 (device or host activations under
    /// [`ActivationDtype::Bf16`]; kept internals store no inputs).
    pub fn stores_bf16(&self) -> bool {
        self.activation_dtype == ActivationDtype::Bf16 && self.activations != Activations::Keep
    }

    /// Blocks whose inputs are offloaded to the host: the first ones.
    pub fn offloaded_inputs(&self) -> usize {
        match self.activations {
            Activations::Host => self.layers.saturating_sub(self.device_inputs),
            Activations::Device | Activations::Keep => 0,
        }
    }
}

/// Lean mode: the pieces of each kind of unit ([`StateLayout::lean_pieces`]); one each in
/// exact mode.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct LeanPieces {
    /// The embedding's.
    pub embedding: usize,
    /// Each decoder block's.
    pub block: usize,
    /// The head's.
    pub head: usize,
}

impl LeanPieces {
    /// One piece per unit.
    pub const WHOLE: LeanPieces = LeanPieces {
        embedding: 1,
        block: 1,
        head: 1,
    };

    /// The pieces `layout` updates its units in.
    pub fn of(layout: &StateLayout) -> Self {
        let last = layout.units.len().saturating_sub(1);
        LeanPieces {
            embedding: layout.lean_pieces(0),
            block: if last > 1 { layout.lean_pieces(1) } else { 1 },
            head: layout.lean_pieces(last),
        }
    }

    /// Unit u's pieces, of a model with `layers` blocks.
    fn of_unit(self, unit: usize, layers: usize) -> usize {
        match unit {
            0 => self.embedding,
            u if u == layers + 1 => self.head,
            _ => self.block,
        }
    }
}

/// Lean gradient buffers rotating between the device drain and AdamW.
pub const LEAN_BUFFERS: usize = 2;

struct Builder {
    tasks: Vec<Task>,
    w_content: [Option<usize>; 2],
    next_w: usize,
    next_g: usize,
    next_lean: usize,
    /// Lean pieces (unit, gradient buffer, piece) held back until the next kernel is submitted:
    /// a piece that refills the lean buffer of the same unit's piece before it waits for that
    /// piece's AdamW job, and the device must have work queued meanwhile.
    deferred: std::collections::VecDeque<(usize, DevBuf, usize)>,
    /// Units in update order (lean: as their gradients land; exact: 0..=L+1 after the clip).
    updates: Vec<usize>,
    /// Data-parallel ranks ([`ScheduleSpec::ranks`]).
    ranks: usize,
    /// How params are gathered ([`ScheduleSpec::gather`]).
    gather: Gather,
    /// Gradients landed in turn ([`ScheduleSpec::land`]).
    land: bool,
    next_landing: usize,
}

impl Builder {
    fn new() -> Self {
        Builder {
            tasks: Vec::new(),
            w_content: [None, None],
            next_w: 0,
            next_g: 0,
            next_lean: 0,
            deferred: std::collections::VecDeque::new(),
            updates: Vec::new(),
            ranks: 1,
            gather: Gather::No,
            land: false,
            next_landing: 0,
        }
    }

    fn push(&mut self, lane: Lane, op: Op, reads: Vec<Res>, writes: Vec<Res>) {
        self.tasks.push(Task {
            lane,
            op,
            reads,
            writes,
            waits: Vec::new(),
            prev_waits: Vec::new(),
        });
    }

    fn host(&mut self, op: Op, reads: Vec<Res>, writes: Vec<Res>) {
        self.push(Lane::Host, op, reads, writes);
    }

    /// Weight buffer holding `unit`, copying it in unless already resident.
    fn weights(&mut self, unit: usize, keep: Option<DevBuf>) -> DevBuf {
        if let Some(s) = self.w_content.iter().position(|c| *c == Some(unit)) {
            // The next copy goes to the other buffer: the one this unit's user is not about to
            // read.
            self.next_w = 1 - s;
            return DevBuf::W(s);
        }
        let mut s = self.next_w;
        if keep == Some(DevBuf::W(s)) {
            s = 1 - s;
        }
        self.next_w = 1 - s;
        self.w_content[s] = Some(unit);
        let to = DevBuf::W(s);
        let mut reads = vec![Res::Params(unit)];
        if self.gather == Gather::Host {
            self.host(
                Op::Gather { unit, slot: s },
                vec![Res::Params(unit)],
                vec![Res::Gathered(s)],
            );
            reads.push(Res::Gathered(s));
        }
        self.push(
            Lane::Stream(StreamKind::CopyIn),
            Op::CopyWeights {
                unit,
                to,
                broadcast: self.gather == Gather::Device,
            },
            reads,
            vec![Res::Dev(to)],
        );
        to
    }

    fn grad_buffer(&mut self) -> DevBuf {
        let g = DevBuf::G(self.next_g);
        self.next_g = 1 - self.next_g;
        g
    }

    /// A layer op on the compute stream, its resources from the op's own declaration.
    fn kernel(&mut self, k: Kernel<DevBuf, usize>) {
        let (mut reads, mut writes) = (Vec::new(), Vec::new());
        for (b, a) in k.buffers() {
            match a {
                Access::Read => reads.push(Res::Dev(b)),
                Access::Write => writes.push(Res::Dev(b)),
            }
        }
        self.push(
            Lane::Stream(StreamKind::Compute),
            Op::Kernel(k),
            reads,
            writes,
        );
    }

    fn zeroed_grads(&mut self) -> DevBuf {
        let g = self.grad_buffer();
        self.kernel(Kernel::Zero { buf: g });
        g
    }

    /// Unit u's gradients leave the device. Exact mode: into its shard (sharded gradients: into
    /// a landing buffer, summed across the ranks at once), and after the last micro-batch its
    /// Σg² is added to the norm. Lean mode (one micro-batch): piece by piece,
    /// each into the next lean buffer and updated at once; pieces past the lean buffers wait
    /// for the next kernel ([`Builder::flush_deferred`]).
    fn drain(&mut self, unit: usize, from: DevBuf, spec: &ScheduleSpec, mb: usize) {
        if spec.mode == Mode::Lean && mb + 1 == spec.micro_batches {
            for piece in 0..spec.lean_pieces.of_unit(unit, spec.layers) {
                if piece < LEAN_BUFFERS {
                    self.drain_piece(unit, from, piece);
                } else {
                    self.deferred.push_back((unit, from, piece));
                }
            }
            return;
        }
        // Sharded gradients: into landing buffer k on the ranks without the unit's shard (and
        // on its owner after the first micro-batch), summed across the ranks there at once —
        // every micro-batch, so no rank keeps another's gradients across micro-batches.
        let landed = self.land.then(|| {
            let k = self.next_landing;
            self.next_landing = 1 - k;
            k
        });
        let held: Vec<Res> = std::iter::once(Res::Grads(unit))
            .chain(landed.map(Res::Landed))
            .collect();
        self.push(
            Lane::Stream(StreamKind::CopyOut),
            Op::CopyGrads {
                unit,
                from,
                accumulate: mb > 0,
                lean: None,
                piece: 0,
                landing: landed,
            },
            vec![Res::Dev(from)],
            held.clone(),
        );
        let last = mb + 1 == spec.micro_batches;
        if spec.ranks > 1 && (last || landed.is_some()) {
            self.host(
                Op::Reduce {
                    unit,
                    lean: None,
                    piece: 0,
                    landing: landed,
                    accumulate: mb > 0 && landed.is_some(),
                },
                held.clone(),
                held,
            );
        }
        if last {
            self.host(
                Op::Norm { unit },
                vec![Res::Grads(unit), Res::Norm],
                vec![Res::Norm],
            );
        }
    }

    /// Piece `piece` of unit u's gradients into the next lean buffer, and its update.
    fn drain_piece(&mut self, unit: usize, from: DevBuf, piece: usize) {
        let k = self.next_lean;
        self.next_lean = (k + 1) % LEAN_BUFFERS;
        self.push(
            Lane::Stream(StreamKind::CopyOut),
            Op::CopyGrads {
                unit,
                from,
                accumulate: false,
                lean: Some(k),
                piece,
                landing: None,
            },
            vec![Res::Dev(from)],
            vec![Res::Lean(k)],
        );
        if self.ranks > 1 {
            self.host(
                Op::Reduce {
                    unit,
                    lean: Some(k),
                    piece,
                    landing: None,
                    accumulate: false,
                },
                vec![Res::Lean(k)],
                vec![Res::Lean(k)],
            );
        }
        self.adam(unit, Some(k), piece);
    }

    /// Drain up to `max` held-back lean pieces, oldest first (after a kernel was submitted).
    fn flush_deferred(&mut self, max: usize) {
        for _ in 0..max {
            let Some((unit, from, piece)) = self.deferred.pop_front() else {
                return;
            };
            self.drain_piece(unit, from, piece);
        }
    }

    /// Unit u's update (of one piece in lean mode).
    fn adam(&mut self, unit: usize, lean: Option<usize>, piece: usize) {
        let grads = lean.map_or(Res::Grads(unit), Res::Lean);
        self.host(
            Op::Adam { unit, lean, piece },
            vec![grads, Res::Coef],
            vec![Res::Params(unit)],
        );
        if piece == 0 {
            self.updates.push(unit);
        }
    }
}

/// The order units are updated in: lean mode as their gradients land (head, blocks from the
/// last, embedding), exact mode in unit order after the clip.
fn update_order(spec: &ScheduleSpec) -> Vec<usize> {
    let head = spec.layers + 1;
    match spec.mode {
        Mode::Lean => std::iter::once(head)
            .chain((1..=spec.layers).rev())
            .chain([0])
            .collect(),
        Mode::Exact => (0..=head).collect(),
    }
}

/// Build the schedule of one step.
pub fn schedule(spec: &ScheduleSpec) -> Schedule {
    let l = spec.layers;
    let head = l + 1;
    let mut b = Builder::new();
    b.ranks = spec.ranks;
    b.gather = spec.gather;
    b.land = spec.land && spec.mode == Mode::Exact && spec.ranks > 1;
    let order = update_order(spec);
    // The first unit to be updated: its m/v can come in from NVMe during the forward.
    b.host(Op::Prefetch { unit: order[0] }, vec![], vec![]);
    if spec.mode == Mode::Lean {
        // Lean clipping uses the previous step's global norm (stale by one step).
        b.host(Op::Clip, vec![Res::Norm], vec![Res::Coef]);
    }
    for mb in 0..spec.micro_batches {
        micro_batch(&mut b, spec, mb);
    }
    match spec.mode {
        Mode::Exact => {
            b.host(Op::Clip, vec![Res::Norm], vec![Res::Coef]);
            for u in 0..=head {
                b.adam(u, None, 0);
            }
        }
        Mode::Lean => {
            let reads = (0..=head).map(Res::Params).collect();
            b.host(Op::LeanNorm, reads, vec![Res::Norm]);
        }
    }
    let mut tasks = with_prefetches(b.tasks, &order);
    track_hazards(&mut tasks);
    Schedule::of(tasks)
}

impl Schedule {
    /// The schedule of `tasks` (waits derived), with the device buffers they touch.
    fn of(tasks: Vec<Task>) -> Self {
        let mut buffers: Vec<DevBuf> = tasks
            .iter()
            .flat_map(|t| t.reads.iter().chain(&t.writes))
            .filter_map(|r| match r {
                Res::Dev(d) => Some(*d),
                _ => None,
            })
            .collect();
        buffers.sort();
        buffers.dedup();
        Schedule { tasks, buffers }
    }
}

/// After each unit's (first piece's) update, a hint to read the next unit's spilled state (so
/// NVMe reads unit u+1 while AdamW updates u).
fn with_prefetches(tasks: Vec<Task>, order: &[usize]) -> Vec<Task> {
    let mut out = Vec::with_capacity(tasks.len() + order.len());
    for t in tasks {
        let next = match t.op {
            Op::Adam { unit, piece: 0, .. } => order
                .iter()
                .position(|&u| u == unit)
                .and_then(|k| order.get(k + 1)),
            _ => None,
        };
        out.push(t);
        if let Some(&unit) = next {
            out.push(Task {
                lane: Lane::Host,
                op: Op::Prefetch { unit },
                reads: vec![],
                writes: vec![],
                waits: vec![],
                prev_waits: vec![],
            });
        }
    }
    out
}

/// The ops of micro-batch `mb`: forward through the two weight buffers, head loss and backward,
/// blocks backward in reverse, embedding backward.
fn micro_batch(b: &mut Builder, spec: &ScheduleSpec, mb: usize) {
    let l = spec.layers;
    let head = l + 1;
    let narrow = spec.stores_bf16();
    // Blocks below `offloaded` keep their inputs on the host, in two fp32 boundary buffers
    // (or, in bf16, two staging buffers) taken in turn; the rest keep theirs on the device,
    // each in its own buffer (in bf16, beside two fp32 working buffers). The two sets of
    // buffers never meet: an offloaded block's index is below every kept one's.
    let offloaded = spec.offloaded_inputs();
    let on_device = |i: usize| i >= offloaded;
    let act = |i: usize| match (narrow, i == l) {
        (true, _) => DevBuf::A(i % 2),
        (false, true) if offloaded == l => DevBuf::A(l % 2),
        (false, true) => DevBuf::A(l),
        (false, false) if on_device(i) => DevBuf::A(i),
        (false, false) => DevBuf::A(i % 2),
    };
    let stored = |i: usize| match on_device(i) {
        true => DevBuf::S(i),
        false => DevBuf::S(i % 2),
    };
    let kept = |i: usize| (spec.activations == Activations::Keep).then_some(DevBuf::K(i));
    let w = b.weights(0, None);
    b.kernel(Kernel::EmbedFwd {
        batch: mb,
        w,
        x: act(0),
    });
    for i in 0..l {
        // Block i's input is kept before block i + 1's output overwrites its buffer.
        let from = if narrow {
            b.kernel(Kernel::Narrow {
                x: act(i),
                to: stored(i),
            });
            stored(i)
        } else {
            act(i)
        };
        if !on_device(i) {
            b.push(
                Lane::Stream(StreamKind::CopyOut),
                Op::SaveActivation { index: i, from },
                vec![Res::Dev(from)],
                vec![Res::Act(i)],
            );
        }
        let w = b.weights(1 + i, None);
        b.kernel(Kernel::BlockFwd {
            batch: mb,
            layer: i,
            w,
            x: act(i),
            y: act(i + 1),
            keep: kept(i),
        });
    }
    // Head: loss and backward (tied: the embedding matrix is the LM head).
    let hw = b.weights(head, None);
    let tied = spec.tied.then(|| (b.weights(0, Some(hw)), DevBuf::GEmb));
    let hg = b.zeroed_grads();
    if let Some((_, ge)) = tied {
        b.kernel(Kernel::Zero { buf: ge });
    }
    b.kernel(Kernel::HeadLossBwd {
        batch: mb,
        w: hw,
        g: hg,
        tied,
        x: act(l),
        dx: DevBuf::D(0),
    });
    b.drain(head, hg, spec, mb);
    // Blocks in reverse; activation i must be on the device.
    let mut d = 0;
    for i in (0..l).rev() {
        let x = act(i);
        // The last offloaded block's input is still on the device too (in its staging buffer
        // when stored in bf16): nothing after it wrote that buffer.
        let resident = on_device(i) || i + 1 == offloaded;
        let to = if narrow { stored(i) } else { x };
        if !resident {
            b.push(
                Lane::Stream(StreamKind::CopyIn),
                Op::LoadActivation { index: i, to },
                vec![Res::Act(i)],
                vec![Res::Dev(to)],
            );
        }
        if narrow {
            b.kernel(Kernel::Widen { from: to, x });
        }
        let w = b.weights(1 + i, None);
        let g = b.zeroed_grads();
        let (dy, dx) = (DevBuf::D(d), DevBuf::D(1 - d));
        b.kernel(Kernel::BlockBwd {
            batch: mb,
            layer: i,
            w,
            g,
            x,
            dy,
            dx,
            kept: kept(i),
        });
        // The device has this backward queued while a held-back piece waits for its buffer;
        // one per kernel, so the block's own drain still finds a buffer freed before it.
        b.flush_deferred(LEAN_BUFFERS - 1);
        d = 1 - d;
        b.drain(1 + i, g, spec, mb);
    }
    // Embedding: only its gradient (tied: accumulated onto the head's).
    let g = match spec.tied {
        true => DevBuf::GEmb,
        false => b.zeroed_grads(),
    };
    b.kernel(Kernel::EmbedBwd {
        batch: mb,
        g,
        dx: DevBuf::D(d),
    });
    b.flush_deferred(LEAN_BUFFERS - 1);
    b.drain(0, g, spec, mb);
    // The last kernel of the micro-batch is queued: the rest drain now.
    b.flush_deferred(usize::MAX);
    b.w_content = [None, None];
}

#[cfg(test)]
mod tests;
