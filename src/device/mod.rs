//! The device abstraction, with CUDA's semantics: buffers from a bounded pool, FIFO streams,
//! events that order work across streams, async copies from registered host memory, and the layer
//! ops as kernels. [`cpu::CpuDevice`] implements it for real (one worker thread per stream); the
//! CUDA device ([`cuda`], feature `cuda`) adds CUDA streams, events and copies, not new control
//! flow. Both run the layer ops as the same [`program`] on their own [`program::Backend`].

pub mod cpu;
#[cfg(feature = "cuda")]
pub mod cuda;
pub mod host_backend;
pub mod kernels;
pub mod launch;
pub mod program;
pub mod stack;

use crate::{Error, Result};
use std::sync::{Arc, Condvar, Mutex};
use std::time::Instant;

/// A device buffer (f32 elements), by id.
pub type BufId = usize;

/// The three streams of the pipeline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum StreamKind {
    /// Host → device copies (weights, activations).
    CopyIn = 0,
    /// Kernels.
    Compute = 1,
    /// Device → host copies (gradients, activations).
    CopyOut = 2,
}

impl StreamKind {
    /// All streams.
    pub const ALL: [StreamKind; 3] = [StreamKind::CopyIn, StreamKind::Compute, StreamKind::CopyOut];

    /// Name for traces.
    pub fn name(self) -> &'static str {
        match self {
            StreamKind::CopyIn => "copy-in (htod)",
            StreamKind::Compute => "compute",
            StreamKind::CopyOut => "copy-out (dtoh)",
        }
    }
}

/// A one-shot event: recorded on one stream, waited on by others or by the host.
#[derive(Debug, Clone, Default)]
pub struct Event(Arc<(Mutex<bool>, Condvar)>);

impl Event {
    /// A new, unsignalled event.
    pub fn new() -> Self {
        Self::default()
    }

    /// Mark done and wake waiters.
    pub fn signal(&self) {
        let (m, cv) = &*self.0;
        *crate::util::lock(m) = true;
        cv.notify_all();
    }

    /// True once signalled.
    pub fn query(&self) -> bool {
        *crate::util::lock(&self.0 .0)
    }

    /// True if `other` is this very event (a clone of it).
    pub fn same(&self, other: &Event) -> bool {
        Arc::ptr_eq(&self.0, &other.0)
    }

    /// Block until signalled.
    pub fn synchronize(&self) {
        let (m, cv) = &*self.0;
        let mut done = crate::util::lock(m);
        while !*done {
            done = cv.wait(done).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// The precision a device computes in (`--precision`).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// fp32 weights streamed, every op in fp32.
    #[default]
    Fp32,
    /// Mixed precision (docs/precision.md): bf16 weights streamed from an exact fp32 master
    /// stored as planes; GEMMs on bf16 operands with fp32 sums and results; attention on
    /// bf16-stored Q, K, V and output gradient; everything else fp32; fp32 gradients to the host.
    Bf16,
}

impl Precision {
    /// The name the flag takes.
    pub fn name(self) -> &'static str {
        match self {
            Precision::Fp32 => "fp32",
            Precision::Bf16 => "bf16",
        }
    }
}

/// Elements per chunk of a device→host copy that lands through the host's page-locked bounce
/// chunks (accumulating copies, bf16 gradients): 16 MiB of fp32.
pub const BOUNCE_CHUNK_ELEMS: usize = 4 << 20;

/// How weight gradients cross the link to the host (`--grad-link`).
#[derive(
    Debug,
    Clone,
    Copy,
    PartialEq,
    Eq,
    Default,
    serde::Serialize,
    serde::Deserialize,
    clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum GradLink {
    /// fp32, exactly as the device summed them: 4 B per element.
    #[default]
    Fp32,
    /// Rounded to bf16 (nearest even) on the device, widened exactly on the host, where they are
    /// accumulated in fp32: 2 B per element, for steps the device→host link bounds
    /// (docs/precision.md measures what it costs in accuracy).
    Bf16,
}

impl GradLink {
    /// The name the flag takes.
    pub fn name(self) -> &'static str {
        match self {
            GradLink::Fp32 => "fp32",
            GradLink::Bf16 => "bf16",
        }
    }

    /// Bytes per element on the link.
    pub fn elem_bytes(self) -> u64 {
        match self {
            GradLink::Fp32 => 4,
            GradLink::Bf16 => 2,
        }
    }
}

/// A view of registered host memory that a copy reads or writes.
///
/// Like a pointer handed to `cudaMemcpyAsync`: whoever builds one promises the memory stays valid
/// and untouched by anyone else until the copy's completion event fires.
/// Elements are `T`: f32, or u16 for bf16 values.
#[derive(Debug, Clone, Copy)]
pub struct HostRef<T = f32> {
    ptr: *mut T,
    len: usize,
}

// SAFETY: a HostRef is only dereferenced by the stream that executes the copy, while its creator
// keeps the memory alive and unaliased (the contract of `HostRef::new`).
unsafe impl<T: Send> Send for HostRef<T> {}

impl<T> HostRef<T> {
    /// # Safety
    /// `ptr..ptr+len` must stay valid, and not be accessed by anyone else, until every device
    /// command using this view has completed (its stream's following event has fired).
    pub unsafe fn new(ptr: *mut T, len: usize) -> Self {
        HostRef { ptr, len }
    }

    /// From a mutable slice.
    ///
    /// # Safety
    /// As for [`HostRef::new`]: the slice's memory must outlive the copies, untouched meanwhile.
    pub unsafe fn from_slice(s: &mut [T]) -> Self {
        HostRef {
            ptr: s.as_mut_ptr(),
            len: s.len(),
        }
    }

    /// From a shared slice, for a copy that only reads it (a host-to-device source): others
    /// may read the memory meanwhile (a checkpoint snapshot), nobody may write it.
    ///
    /// # Safety
    /// The slice's memory must outlive the copies and not be written meanwhile; the view must
    /// only be a copy's source.
    pub unsafe fn from_shared(s: &[T]) -> Self {
        HostRef {
            ptr: s.as_ptr().cast_mut(),
            len: s.len(),
        }
    }

    /// Elements.
    pub fn len(&self) -> usize {
        self.len
    }

    /// True if empty.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// The start of the memory (for a device's DMA).
    pub fn as_ptr(&self) -> *mut T {
        self.ptr
    }

    /// # Safety
    /// See [`HostRef::new`].
    pub(crate) unsafe fn slice<'a>(&self) -> &'a mut [T] {
        // SAFETY: forwarded contract.
        unsafe { std::slice::from_raw_parts_mut(self.ptr, self.len) }
    }
}

/// Check that a copy (`what`: "htod weights unit 3", …) of `n` elements at `offset` fits device
/// buffer `buf` of `have` elements.
pub(crate) fn check_copy(
    what: &str,
    n: usize,
    offset: usize,
    buf: BufId,
    have: usize,
) -> Result<()> {
    if offset + n > have {
        return Err(Error::internal(
            "device copy",
            format!("{what}: {n} elements at {offset} overflow buffer {buf} of {have}"),
        ));
    }
    Ok(())
}

/// Whether an op reads or writes a buffer.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, serde::Serialize)]
pub enum Access {
    /// Reads it.
    Read,
    /// Writes it (maybe reading it too).
    Write,
}

/// The host data of one micro-batch the kernels use: token ids, next-token targets and
/// positions (shared with the device like a kernel argument upload), the loss gradient's scale
/// (1 / trained tokens of the step) and the accumulator the summed loss is added to.
#[derive(Debug, Clone)]
pub struct Batch {
    /// Input token ids, `batch × seq`.
    pub tokens: Arc<[u32]>,
    /// Target ids, `batch × seq` ([`crate::model::ops::IGNORE`] where nothing is trained).
    pub targets: Arc<[u32]>,
    /// Each token's position in its document, `batch × seq` (RoPE angle; attention stays
    /// inside the document).
    pub positions: Arc<[u32]>,
    /// Which tokens are padding (non-zero), `batch × seq`, when some are: they count in no
    /// mixture of experts' load-balancing loss (transformers' `attention_mask`).
    pub pad: Option<Arc<[u8]>>,
    /// Scale of the loss gradient.
    pub grad_scale: f32,
    /// Σ loss of the step, added to by the head.
    pub loss: Arc<Mutex<f64>>,
    /// What this micro-batch's MoE layers routed, added to by their forward.
    pub router: Arc<Mutex<crate::model::ops::RouterTally>>,
    /// The load-balancing loss's weight in this micro-batch's gradient (`router_aux_loss_coef`
    /// over the step's micro-batches; 0: the loss is not trained).
    pub aux_scale: f64,
    /// A forward-only pass's row of logits to read back (generation); none in a step.
    pub logits: Option<LogitsRow>,
}

/// Which row of a forward-only pass's logits comes back to the host, and where it lands: the
/// head's logits of token `row` of the micro-batch (`[vocab]`, before any soft cap).
#[derive(Debug, Clone)]
pub struct LogitsRow {
    /// The token (row of the micro-batch's `batch × seq`).
    pub row: usize,
    /// Replaced by the row's `vocab` logits once the head has run.
    pub into: Arc<Mutex<Vec<f32>>>,
}

/// The layer ops, as data, over buffers `B` with micro-batch data `D`: the step schedule names
/// them with its buffer names and micro-batch indices, the devices run them with device buffers
/// and a [`Batch`]. Their buffers are declared once, by [`Kernel::buffers`].
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub enum Kernel<B, D> {
    /// `x = E[tokens]`; the embedding weights at `w`.
    EmbedFwd {
        /// The micro-batch.
        batch: D,
        /// Embedding weights (the unit).
        w: B,
        /// Output activations `[N, C]`.
        x: B,
    },
    /// `y = block(x)` with the layer's weights at `w`.
    BlockFwd {
        /// The micro-batch (its positions).
        batch: D,
        /// Decoder layer.
        layer: usize,
        /// The unit's weights.
        w: B,
        /// Input `[N, C]`.
        x: B,
        /// Output `[N, C]`.
        y: B,
        /// Where to keep the block's internals for its backward (see
        /// [`program::internals_len`]), or `None` (the backward recomputes them).
        keep: Option<B>,
    },
    /// Final norm, LM head, loss and their backward: the head unit's weights at `w`, its
    /// gradients into `g`; when tied, the embedding's weights and gradient (`tied`) are the LM
    /// head; `dx` written, Σ loss added to the batch's accumulator.
    HeadLossBwd {
        /// The micro-batch.
        batch: D,
        /// The head unit's weights.
        w: B,
        /// The head unit's gradients.
        g: B,
        /// Tied embeddings: (embedding weights, embedding gradient).
        tied: Option<(B, B)>,
        /// Input `[N, C]`.
        x: B,
        /// Gradient of the input `[N, C]`.
        dx: B,
    },
    /// Final norm, LM head and loss only (validation): the head unit's weights at `w`, the
    /// tied embedding's weights (`tied`) as the LM head; Σ loss added to the batch's
    /// accumulator.
    HeadLoss {
        /// The micro-batch.
        batch: D,
        /// The head unit's weights.
        w: B,
        /// Tied embeddings: the embedding's weights.
        tied: Option<B>,
        /// Input `[N, C]`.
        x: B,
    },
    /// Block backward (recomputing its internals from `x`): gradients accumulate into `g`,
    /// `dx` written, `dy` consumed (the program keeps intermediate sums there).
    BlockBwd {
        /// The micro-batch (its positions).
        batch: D,
        /// Decoder layer.
        layer: usize,
        /// The unit's weights.
        w: B,
        /// The unit's gradients.
        g: B,
        /// The layer's input `[N, C]`.
        x: B,
        /// Gradient of its output `[N, C]`.
        dy: B,
        /// Gradient of its input `[N, C]`.
        dx: B,
        /// The internals its forward kept, or `None` (recompute them from `x`).
        kept: Option<B>,
    },
    /// `dE[tokens] += dx`.
    EmbedBwd {
        /// The micro-batch.
        batch: D,
        /// The embedding's gradient.
        g: B,
        /// Gradient of the embedding's output `[N, C]`.
        dx: B,
    },
    /// `buf = 0`.
    Zero {
        /// The buffer.
        buf: B,
    },
    /// `to = bf16(x)` (nearest even) over the micro-batch's `[N, C]`: a layer input stored
    /// in bf16 for the backward that recomputes from it (`--activation-dtype bf16`); `to` a
    /// buffer of bf16 values.
    Narrow {
        /// The fp32 layer input `[N, C]`.
        x: B,
        /// Its bf16 copy.
        to: B,
    },
    /// `x = from` widened exactly to fp32 over `[N, C]`: the stored layer input, read back.
    Widen {
        /// The bf16 layer input.
        from: B,
        /// The fp32 buffer the backward reads.
        x: B,
    },
}

impl<B: Copy, D> Kernel<B, D> {
    /// Name for traces.
    pub fn name(&self) -> String {
        match self {
            Kernel::EmbedFwd { .. } => "embed_fwd".into(),
            Kernel::BlockFwd { layer, .. } => format!("block{layer}_fwd"),
            Kernel::HeadLossBwd { .. } => "head_loss_bwd".into(),
            Kernel::HeadLoss { .. } => "head_loss".into(),
            Kernel::BlockBwd { layer, .. } => format!("block{layer}_bwd"),
            Kernel::EmbedBwd { .. } => "embed_bwd".into(),
            Kernel::Zero { .. } => "zero".into(),
            Kernel::Narrow { .. } => "narrow_input".into(),
            Kernel::Widen { .. } => "widen_input".into(),
        }
    }

    /// The buffers it touches and how: declared once, here.
    pub fn buffers(&self) -> Vec<(B, Access)> {
        use Access::{Read, Write};
        match self {
            Kernel::EmbedFwd { w, x, .. } => vec![(*w, Read), (*x, Write)],
            Kernel::BlockFwd { w, x, y, keep, .. } => {
                let mut v = vec![(*w, Read), (*x, Read), (*y, Write)];
                v.extend(keep.map(|k| (k, Write)));
                v
            }
            Kernel::HeadLossBwd {
                w, g, tied, x, dx, ..
            } => {
                let mut v = vec![(*w, Read), (*x, Read), (*g, Write), (*dx, Write)];
                if let Some((tw, tg)) = tied {
                    v.extend([(*tw, Read), (*tg, Write)]);
                }
                v
            }
            Kernel::HeadLoss { w, tied, x, .. } => {
                let mut v = vec![(*w, Read), (*x, Read)];
                v.extend(tied.map(|t| (t, Read)));
                v
            }
            Kernel::BlockBwd {
                w,
                g,
                x,
                dy,
                dx,
                kept,
                ..
            } => {
                let mut v = vec![
                    (*w, Read),
                    (*x, Read),
                    (*dy, Write),
                    (*g, Write),
                    (*dx, Write),
                ];
                v.extend(kept.map(|k| (k, Read)));
                v
            }
            Kernel::EmbedBwd { g, dx, .. } => vec![(*dx, Read), (*g, Write)],
            Kernel::Zero { buf } => vec![(*buf, Write)],
            Kernel::Narrow { x, to } => vec![(*x, Read), (*to, Write)],
            Kernel::Widen { from, x } => vec![(*from, Read), (*x, Write)],
        }
    }

    /// The same op over other buffers and micro-batch data.
    pub fn map<B2, D2>(self, fb: impl Fn(B) -> B2, fd: impl FnOnce(D) -> D2) -> Kernel<B2, D2> {
        match self {
            Kernel::EmbedFwd { batch, w, x } => Kernel::EmbedFwd {
                batch: fd(batch),
                w: fb(w),
                x: fb(x),
            },
            Kernel::BlockFwd {
                batch,
                layer,
                w,
                x,
                y,
                keep,
            } => Kernel::BlockFwd {
                batch: fd(batch),
                layer,
                w: fb(w),
                x: fb(x),
                y: fb(y),
                keep: keep.map(&fb),
            },
            Kernel::HeadLossBwd {
                batch,
                w,
                g,
                tied,
                x,
                dx,
            } => Kernel::HeadLossBwd {
                batch: fd(batch),
                w: fb(w),
                g: fb(g),
                tied: tied.map(|(a, b)| (fb(a), fb(b))),
                x: fb(x),
                dx: fb(dx),
            },
            Kernel::HeadLoss { batch, w, tied, x } => Kernel::HeadLoss {
                batch: fd(batch),
                w: fb(w),
                tied: tied.map(&fb),
                x: fb(x),
            },
            Kernel::BlockBwd {
                batch,
                layer,
                w,
                g,
                x,
                dy,
                dx,
                kept,
            } => Kernel::BlockBwd {
                batch: fd(batch),
                layer,
                w: fb(w),
                g: fb(g),
                x: fb(x),
                dy: fb(dy),
                dx: fb(dx),
                kept: kept.map(&fb),
            },
            Kernel::EmbedBwd { batch, g, dx } => Kernel::EmbedBwd {
                batch: fd(batch),
                g: fb(g),
                dx: fb(dx),
            },
            Kernel::Zero { buf } => Kernel::Zero { buf: fb(buf) },
            Kernel::Narrow { x, to } => Kernel::Narrow {
                x: fb(x),
                to: fb(to),
            },
            Kernel::Widen { from, x } => Kernel::Widen {
                from: fb(from),
                x: fb(x),
            },
        }
    }
}

/// A layer op as a device runs it.
pub type DeviceKernel = Kernel<BufId, Batch>;

/// A command on a stream.
#[derive(Debug)]
pub enum Cmd {
    /// Host → device: `src` into `dst` at element `offset`.
    HtoD {
        dst: BufId,
        offset: usize,
        src: HostRef,
        label: String,
    },
    /// Host → device: bf16 values (the high plane of a master stored as planes) into `dst` at
    /// element `offset`, as the device holds weights under [`Precision::Bf16`]. Half the link
    /// bytes of [`Cmd::HtoD`].
    HtoDBf16 {
        dst: BufId,
        offset: usize,
        src: HostRef<u16>,
        label: String,
    },
    /// Device → host: `len` elements of `src` from `offset` into `dst` (`+=` if `accumulate`),
    /// crossing the link as `link` says: under [`GradLink::Bf16`] each element is rounded to
    /// bf16 (nearest even) on the device and widened exactly on the host.
    DtoH {
        dst: HostRef,
        src: BufId,
        offset: usize,
        accumulate: bool,
        link: GradLink,
        label: String,
    },
    /// Device → host: `dst.len()` bf16 values of bf16 buffer `src` from element `offset`, as
    /// stored (2 B each, nothing rounded or widened): a layer input stored in bf16, offloaded.
    DtoHBf16 {
        dst: HostRef<u16>,
        src: BufId,
        offset: usize,
        label: String,
    },
    /// A layer op.
    Kernel(DeviceKernel),
    /// Every rank's `buf` (its first `len` elements, as the buffer holds them) = rank `root`'s,
    /// device to device (a GPU that joined its job's NCCL communicator as it opened): ZeRO
    /// stage 3's params, copied in by the one rank that holds them. Every rank submits the same
    /// broadcasts in the same order. The CPU device has none (its ranks exchange through host
    /// memory).
    Broadcast {
        buf: BufId,
        len: usize,
        root: usize,
        label: String,
    },
    /// Signal the event when everything before it on this stream is done.
    Record(Event),
    /// Hold this stream until the event fires.
    Wait(Event),
}

/// How a device's record of a [`Cmd::Broadcast`] begins (`broadcast weights unit 3 …`):
/// metrics count them apart from the copies across the link.
pub const BROADCAST_RECORD: &str = "broadcast ";

/// One executed command, for metrics and traces.
#[derive(Debug, Clone, serde::Serialize)]
pub struct OpRecord {
    /// Stream.
    pub stream: StreamKind,
    /// What ran.
    pub name: String,
    /// Start, seconds since the device's epoch.
    pub start: f64,
    /// End, seconds since the device's epoch.
    pub end: f64,
    /// Bytes copied (copies only).
    pub bytes: u64,
}

/// Device memory accounting.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize)]
pub struct MemStats {
    /// Bytes allocated now.
    pub in_use: u64,
    /// High-water mark since creation (or the last reset).
    pub peak: u64,
    /// The pool's capacity.
    pub capacity: u64,
}

/// A compute device.
pub trait Device: Send + Sync + std::fmt::Debug {
    /// Human-readable name.
    fn name(&self) -> String;
    /// Allocate `len` f32 elements from the bounded pool (fails like cudaMalloc past capacity).
    fn alloc(&self, len: usize, label: &str) -> Result<BufId>;
    /// Allocate a buffer for `len` elements of a unit's weights, held as the device computes
    /// on them: bf16 (2 B/element, filled by [`Cmd::HtoDBf16`] only) on a [`Precision::Bf16`]
    /// device, else f32 as [`Device::alloc`].
    fn alloc_weights(&self, len: usize, label: &str) -> Result<BufId> {
        self.alloc(len, label)
    }
    /// Allocate a buffer that holds regions the recipe stores in bf16 (one block's kept
    /// internals, [`program::internals_len`]): `words(stored)` 4-byte words, `stored` being how
    /// the device holds such regions ([`program::Backend::stored`]: a GPU in its precision, the
    /// CPU device in fp32, charged as a GPU of its precision would hold them).
    fn alloc_stored(&self, words: &dyn Fn(Precision) -> usize, label: &str) -> Result<BufId>;
    /// Return a buffer to the pool.
    fn free(&self, buf: BufId);
    /// Enqueue a command on a stream (FIFO per stream).
    fn submit(&self, stream: StreamKind, cmd: Cmd);
    /// Block until every stream is idle.
    fn synchronize(&self);
    /// Memory accounting.
    fn memory(&self) -> MemStats;
    /// Whether the device's memory is this process's host memory (the CPU device's), so that
    /// it counts in the process's resident set.
    fn memory_in_host(&self) -> bool {
        false
    }
    /// The micro-batch shape and token chunks its layer program runs.
    fn shape(&self) -> program::Shape;
    /// The precision its layer program computes in.
    fn precision(&self) -> Precision;
    /// Reset the peak to the current use.
    fn reset_peak(&self);
    /// Executed commands since the last call (the device's timeline), emptied.
    fn take_records(&self) -> Vec<OpRecord>;
    /// The instant record times are relative to.
    fn epoch(&self) -> Instant;
    /// The first error a stream hit (an op on bad buffers, a kernel panic, a GPU fault), if any.
    fn take_error(&self) -> Option<Error>;
    /// The GPU's PCI address (`dddd:bb:dd.f`), for placing host state near it; `None` for the
    /// CPU device.
    fn pci_bus_id(&self) -> Option<String> {
        None
    }
    /// What page-locks host memory for this device's copies (none: copies need no pinning).
    fn registrar(&self) -> Option<Arc<dyn crate::host::HostRegistrar + Send + Sync>> {
        None
    }
    /// What the device runs on, one line each (a GPU: the GPU, and the driver and libraries in
    /// use with their files); empty for the CPU device.
    fn describe(&self) -> Vec<String> {
        Vec::new()
    }
    /// A rank that failed: end the device's exchanges with the other ranks' devices at once
    /// ([`Cmd::Broadcast`]s still waiting for a peer end), so its streams drain and the rank can
    /// report and end the job. Nothing for a device without such exchanges.
    fn abort_exchanges(&self) {}
}
