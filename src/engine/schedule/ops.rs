//! The vocabulary of a schedule: the device buffers and resources its ops name, the ops
//! themselves, where they run, and the tasks a schedule lists.

use crate::device::{Kernel, StreamKind};
use serde::Serialize;

/// A device buffer of the schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum DevBuf {
    /// Weights of a unit (two, alternating).
    W(usize),
    /// Gradients of a unit (two, alternating).
    G(usize),
    /// The tied embedding's gradient, alive from the head's backward to the embedding's.
    GEmb,
    /// dx/dy of the backward (two, alternating).
    D(usize),
    /// Layer-boundary activation `i` (device activations) or buffer `i % 2` (host ones).
    A(usize),
    /// Block `i`'s forward internals, kept for its backward ([`Activations::Keep`]).
    K(usize),
    /// Layer input `i` stored in bf16 ([`ActivationDtype::Bf16`]): kept there (device
    /// activations), or staging buffer `i % 2` of the copies to and from the host (host ones).
    S(usize),
}

/// A resource an op touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Res {
    /// A device buffer.
    Dev(DevBuf),
    /// Unit u's params in the host store.
    Params(usize),
    /// Unit u's gradient shard on the host (exact mode).
    Grads(usize),
    /// Lean gradient buffer k on the host.
    Lean(usize),
    /// The host copy of layer-boundary activation i.
    Act(usize),
    /// The step's Σg² (exact: from the gradient shards; lean: from the AdamW jobs).
    Norm,
    /// The clip coefficient the step's updates use.
    Coef,
    /// Host buffer `k` another rank's params are gathered into (ZeRO stage 3).
    Gathered(usize),
    /// Host buffer `k` another rank's unit's gradients land in (ZeRO stage 3, sharded
    /// gradients).
    Landed(usize),
}

/// How ZeRO stage 3 brings a unit's params from the rank holding them to every rank's device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Gather {
    /// Nothing to gather: every rank holds every unit's params.
    No,
    /// Into a host buffer over the job's engine ([`Op::Gather`], MPI), then across the link
    /// as usual: every rank copies every unit in.
    Host,
    /// Device to device: the owner copies the unit in, and its device broadcasts it to the
    /// others' ([`crate::device::Cmd::Broadcast`], NCCL) — each rank copies only its own units
    /// across its link.
    Device,
}

/// One op of the schedule.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum Op {
    /// Copy unit u's params into weight buffer `to` (ZeRO stage 3: from the host buffer the
    /// [`Op::Gather`] before it filled, on every rank but the unit's owner; or, with
    /// `broadcast`, on the owner alone, its device then broadcasting `to` to every rank's).
    CopyWeights {
        /// The unit.
        unit: usize,
        /// A `W` buffer.
        to: DevBuf,
        /// [`Gather::Device`]: the owner copies, the devices broadcast.
        broadcast: bool,
    },
    /// Host, ZeRO stage 3: unit u's params (as the device streams them) from the rank holding
    /// them into host buffer `slot` of every other rank
    /// ([`crate::dist::Collective::broadcast_bytes`]), before each copy of them to the device.
    /// Every rank runs the same schedule, so the ranks' broadcasts come in the same order.
    Gather {
        /// The unit.
        unit: usize,
        /// The host buffer (the weight buffer's index).
        slot: usize,
    },
    /// Copy activation `index` from the host into device buffer `to`.
    LoadActivation {
        /// Layer-boundary index.
        index: usize,
        /// An `A` buffer.
        to: DevBuf,
    },
    /// Copy activation `index` from device buffer `from` to the host.
    SaveActivation {
        /// Layer-boundary index.
        index: usize,
        /// An `A` buffer.
        from: DevBuf,
    },
    /// Copy unit u's gradients to the host (`accumulate`: add to what is there, for micro-batches
    /// after the first — sharded gradients land as they are, their [`Op::Reduce`] adds them),
    /// into its shard or, in lean mode, piece `piece` of them into lean buffer `lean`
    /// ([`crate::store::layout::StateLayout::lean_piece`]).
    CopyGrads {
        /// The unit.
        unit: usize,
        /// A `G` buffer (or `GEmb`).
        from: DevBuf,
        /// `+=` instead of `=`.
        accumulate: bool,
        /// Lean buffer, in lean mode.
        lean: Option<usize>,
        /// The piece (0: the whole unit in exact mode).
        piece: usize,
        /// Sharded gradients (exact mode): the landing buffer they go to on a rank that does
        /// not hold the unit's gradient shard, and on its owner for micro-batches after the
        /// first (the first goes into the shard); never added to what is there.
        landing: Option<usize>,
    },
    /// A layer op of micro-batch `batch`.
    Kernel(Kernel<DevBuf, usize>),
    /// Host: start reading unit u's optimizer state from NVMe if it is spilled (a hint: a no-op
    /// for a unit in RAM).
    Prefetch {
        /// The unit.
        unit: usize,
    },
    /// Host: add unit u's Σg² to the step's norm (exact mode).
    Norm {
        /// The unit.
        unit: usize,
    },
    /// Host: the clip coefficient from the norm (exact: this step's; lean: the previous step's).
    Clip,
    /// Host: start unit u's AdamW update on its node's pool (asynchronous), of piece `piece`
    /// in lean mode.
    Adam {
        /// The unit.
        unit: usize,
        /// Lean buffer holding its gradients, in lean mode.
        lean: Option<usize>,
        /// The piece (0: the whole unit in exact mode).
        piece: usize,
    },
    /// Host, lean mode: the step's norm from its AdamW jobs (so waits for all of them).
    LeanNorm,
    /// Host, data parallel: sum unit u's step gradients across the ranks, in rank order
    /// ([`crate::dist::Collective::sum_f32`]): its shard (exact mode) or piece `piece` of them in
    /// lean buffer `lean`. Every rank runs the same schedule, so the ranks' collectives come in
    /// the same order. Sharded gradients: one micro-batch's, each summed where its
    /// [`Op::CopyGrads`] put them — landing buffer `landing`, or the owner's shard for the
    /// first micro-batch — and, for a later micro-batch (`accumulate`), added to the owner's
    /// shard.
    Reduce {
        /// The unit.
        unit: usize,
        /// Lean buffer holding its gradients, in lean mode.
        lean: Option<usize>,
        /// The piece (0: the whole unit in exact mode).
        piece: usize,
        /// Sharded gradients: the landing buffer of this micro-batch's.
        landing: Option<usize>,
        /// Sharded gradients of a micro-batch after the first: the sum is added to the
        /// owner's shard.
        accumulate: bool,
    },
}

/// Where an op runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Lane {
    /// A device stream.
    Stream(StreamKind),
    /// The host thread that drives the schedule.
    Host,
}

/// An op with its resources and its dependencies.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Task {
    /// Where it runs.
    pub lane: Lane,
    /// What it does.
    pub op: Op,
    /// What it reads.
    pub reads: Vec<Res>,
    /// What it writes.
    pub writes: Vec<Res>,
    /// Earlier tasks of this step it must wait for (not implied by lane order).
    pub waits: Vec<usize>,
    /// Tasks of the previous step it must wait for (by index in the schedule).
    pub prev_waits: Vec<usize>,
}

/// The schedule of one optimizer step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Schedule {
    /// Tasks in submission order.
    pub tasks: Vec<Task>,
    /// Device buffers the schedule uses.
    pub buffers: Vec<DevBuf>,
}
