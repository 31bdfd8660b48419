//! The CUDA streaming device (feature `cuda`): the [`Device`] contract on one GPU.
//!
//! - Three CUDA streams (copy-in, compute, copy-out). `submit` enqueues at once on the caller's
//!   thread and returns: copies are `cuMemcpy*Async` from the host memory the streamer hands over
//!   (the store's params/grads regions are registered with `cuMemHostRegister` through
//!   [`HostRegistrar`], so those copies are DMA that overlaps compute); kernels are the device
//!   program ([`super::program`]) on [`CudaBackend`].
//! - `Record(e)` records a CUDA event on the stream; the poller thread signals `e` (what the
//!   streamer's host side waits on) once `cuEventQuery` says it completed — no host function
//!   per event, so no driver callback serialises the streams. `Wait(e)` on another stream
//!   becomes `cuStreamWaitEvent` on that CUDA event (or nothing, when `e` already fired).
//! - `DtoH` with `accumulate` (gradient accumulation), or with bf16 gradients on the link,
//!   copies through two page-locked bounce chunks in turn; the adds (or the widenings) run on the
//!   device's lander thread (split over the host's cores; never inside a CUDA host function), so
//!   the copy of one chunk overlaps the landing of the one before, and the copy-out stream waits
//!   (`cuStreamWaitValue32` on a flag the lander writes) only before refilling a chunk and after
//!   the last.
//! - Buffers are `cuMemAlloc` allocations counted against the capacity the schedule's buffers
//!   were checked against (free memory at start-up, less a reserve for cuBLAS and the driver); the layer
//!   workspace is allocated once up front. Every timed command is bracketed by two CUDA events,
//!   turned into the timeline by `take_records`.
//!
//! What is proven without a GPU: the program it runs is bit-identical to the reference on the
//! CPU backend, every kernel compiles through NVRTC, and the streamer's use of events and buffers
//! is exercised against the CPU device's checks.

use super::backend::{CudaBackend, DevP};
use super::pinned::{CudaRegistrar, Pinned};

mod bounce;
mod copies;
mod ranks;
mod watchdog;
use super::runtime::{drv, CudaRuntime, DevPtr, TIMED};
use crate::device::program::{self, Shape, Ws};
use crate::device::{
    BufId, Cmd, Device, DeviceKernel, Event, GradLink, MemStats, OpRecord, Precision, StreamKind,
};
use crate::host::HostRegistrar;
use crate::model::reference::Templates;
use crate::util::lock;
use crate::{Error, Result};
use bounce::{Bounce, Landing};
use cudarc::driver::{CudaEvent, CudaStream};
use std::sync::{Arc, Mutex};
use std::time::Instant;
use watchdog::{completed, Recorded, Shared};

/// Device memory kept free for cuBLAS' workspace, the context and the kernels' modules.
pub const RESERVE_BYTES: u64 = 768 << 20;

/// How to open a [`CudaDevice`].
#[derive(Debug, Clone)]
pub struct CudaDeviceConfig {
    /// GPU ordinal.
    pub ordinal: usize,
    /// Micro-batch shape (and the largest token chunks) the kernels run on: smaller chunks when
    /// the workspace does not fit beside `reserve_bytes`.
    pub shape: Shape,
    /// Device memory the engine allocates beside the layer workspace.
    pub reserve_bytes: u64,
    /// Capacity in bytes; `None`: free memory at start-up less [`RESERVE_BYTES`], and no more
    /// than this process's share of the GPU (`shared_by`).
    pub capacity_bytes: Option<u64>,
    /// Processes using this GPU at once (data-parallel ranks that share one): each takes at
    /// most `1/shared_by` of its memory, whichever rank starts first. 1 alone.
    pub shared_by: usize,
    /// TF32 tensor cores for the fp32 GEMMs (cuBLAS `CUBLAS_TF32_TENSOR_OP_MATH`).
    pub tf32: bool,
    /// The precision the kernels compute in.
    pub precision: Precision,
    /// A data-parallel job whose GPUs exchange device to device ([`Cmd::Broadcast`]): the GPU
    /// joins the job's NCCL communicator as it opens, before its memory is sized, so NCCL's own
    /// buffers are already taken. `None`: the GPU exchanges nothing.
    pub ranks: Option<Arc<dyn crate::dist::Collective>>,
}

#[derive(Debug)]
struct Buf {
    ptr: DevPtr,
    /// Elements.
    len: usize,
    /// bf16 elements (a bf16 device's weights), else f32.
    bf16: bool,
    label: String,
}

impl Buf {
    fn bytes(&self) -> u64 {
        if self.bf16 {
            2 * self.len as u64
        } else {
            4 * self.len as u64
        }
    }
}

#[derive(Debug)]
struct Timed {
    stream: StreamKind,
    name: String,
    bytes: u64,
    start: CudaEvent,
    end: CudaEvent,
}

#[derive(Debug)]
struct Inner {
    bufs: Vec<Option<Buf>>,
    in_use: u64,
    peak: u64,
    backend: CudaBackend,
    /// CUDA events recorded for host events still needed by a later `Wait`.
    recorded: Vec<Recorded>,
    timed: Vec<Timed>,
    /// The bounced copies' (accumulating, bf16 gradients) bounce chunks (allocated on first
    /// use) and the next to fill.
    bounces: Vec<Pinned>,
    next_bounce: usize,
    /// Per bounce chunk, the number of its last landing handed to the lander (what a stream
    /// waits for before refilling it).
    bounce_seq: [u32; bounce::BOUNCES],
    /// Events done with, for reuse (creating one per command is a driver call each): timing
    /// events (the commands' spans) and plain ones (`Record`s).
    timing_pool: Vec<CudaEvent>,
    sync_pool: Vec<CudaEvent>,
}

impl Inner {
    /// A pooled (or new) event recorded on `stream`: a timing one, or a plain one.
    fn event_on(&mut self, stream: &CudaStream, timing: bool) -> Result<CudaEvent> {
        let pool = if timing {
            &mut self.timing_pool
        } else {
            &mut self.sync_pool
        };
        let e = match pool.pop() {
            Some(e) => e,
            None => {
                let ctx = stream.context();
                drv(ctx.new_event(timing.then_some(TIMED)), "create an event")?
            }
        };
        drv(e.record(stream), "record an event")?;
        Ok(e)
    }
}

/// The CUDA device.
#[derive(Debug)]
pub struct CudaDevice {
    rt: Arc<CudaRuntime>,
    streams: [Arc<CudaStream>; 3],
    shared: Arc<Shared>,
    stop: Arc<std::sync::atomic::AtomicBool>,
    watchdog: Option<std::thread::JoinHandle<()>>,
    capacity: u64,
    templates: Arc<Templates>,
    shape: Shape,
    ws_layout: Ws<usize>,
    ws: DevPtr,
    /// What the program computes in: under bf16 the weight buffers hold bf16.
    precision: Precision,
    /// Under bf16: where a chunk of gradients is rounded to bf16 before it crosses the link
    /// (at most [`crate::device::BOUNCE_CHUNK_ELEMS`] elements, the copy-out stream's), and its
    /// capacity in elements.
    grad_staging: Option<(DevPtr, usize)>,
    epoch: Instant,
    epoch_event: CudaEvent,
    /// The event the last batch of records was measured from, and its seconds since the epoch.
    anchor: Mutex<Option<(CudaEvent, f64)>>,
    /// Where bounced copies (accumulating, or bf16 gradients) land.
    bounce: Bounce,
    /// The NCCL communicator of a data-parallel job's GPUs ([`CudaDeviceConfig::ranks`]).
    ranks: Mutex<Option<super::nccl::NcclComm>>,
}

/// A device allocation freed on drop unless released: what `open` holds until it succeeds.
struct RawAlloc(DevPtr);

impl RawAlloc {
    fn new(bytes: usize, label: &str, free: u64) -> Result<Self> {
        alloc_raw(bytes, label, free).map(RawAlloc)
    }

    /// The pointer, now the caller's to free.
    fn release(self) -> DevPtr {
        let p = self.0;
        std::mem::forget(self);
        p
    }
}

impl Drop for RawAlloc {
    fn drop(&mut self) {
        // SAFETY: allocated by `alloc_raw` and used by no stream yet (`open` failed before
        // handing it to one).
        unsafe { cudarc::driver::sys::cuMemFree_v2(self.0) };
    }
}

fn alloc_raw(bytes: usize, label: &str, free: u64) -> Result<DevPtr> {
    let mut p: DevPtr = 0;
    // SAFETY: writes one device pointer.
    let r = unsafe { cudarc::driver::sys::cuMemAlloc_v2(&mut p, bytes.max(4)) };
    r.result().map_err(|e| {
        Error::cuda(
            format!(
                "allocate {label} ({}, {} free on the GPU)",
                crate::util::human_bytes(bytes as u64),
                crate::util::human_bytes(free)
            ),
            e,
        )
        .with_fix("lower --batch-size / --seq-len, pass --activations host, or free the GPU")
    })?;
    Ok(p)
}

fn free_memory() -> Result<(u64, u64)> {
    let (free, total) = drv(cudarc::driver::result::mem_get_info(), "query free memory")?;
    Ok((free as u64, total as u64))
}

impl CudaDevice {
    /// Open GPU `cfg.ordinal`, compile and load every kernel, allocate the layer workspace.
    pub fn open(cfg: CudaDeviceConfig, templates: Arc<Templates>) -> Result<Self> {
        let rt = Arc::new(CudaRuntime::open(cfg.ordinal)?);
        drv(rt.ctx.bind_to_thread(), "bind the context")?;
        let ranks = match &cfg.ranks {
            Some(world) => Some(ranks::join(&rt.ctx, world.as_ref())?),
            None => None,
        };
        let (free, total) = free_memory()?;
        let capacity = cfg.capacity_bytes.unwrap_or(
            free.min(total / cfg.shared_by.max(1) as u64)
                .saturating_sub(RESERVE_BYTES),
        );
        // Under bf16 the gradient staging is set aside, and the workspace is fitted with the
        // GEMM operand buffers (they grow with the chunk).
        let staging = program::bf16_staging_bytes(&templates.config, cfg.precision);
        let shape = cfg.shape.fit(
            &templates.config,
            cfg.precision,
            capacity.saturating_sub(cfg.reserve_bytes + staging),
            &format!(
                "{} usable of {}{}, {} of it for the step's buffers",
                crate::util::human_bytes(capacity),
                crate::util::human_bytes(total),
                match cfg.shared_by {
                    0 | 1 => String::new(),
                    n => format!(" (this rank's share: {n} ranks use this GPU)"),
                },
                crate::util::human_bytes(cfg.reserve_bytes)
            ),
        )?;
        let (ws_layout, elems) = Ws::layout(&templates.config, shape, cfg.precision);
        let bf16_bytes = program::bf16_device_bytes(&templates.config, shape, cfg.precision);
        let ws_bytes = 4 * elems as u64 + bf16_bytes;
        let ws = RawAlloc::new(4 * elems, "the layer workspace", free)?;
        // A chunk of gradients rounded to bf16 (`bf16_staging_bytes`).
        let grad_staging_buf = match cfg.precision {
            Precision::Fp32 => None,
            Precision::Bf16 => {
                let n = program::max_unit_numel(&templates.config);
                let chunk = crate::device::BOUNCE_CHUNK_ELEMS.min(n);
                Some((
                    RawAlloc::new(2 * chunk, "the bf16 gradient staging", free)?,
                    chunk,
                ))
            }
        };
        let streams = [
            drv(rt.ctx.new_stream(), "create the copy-in stream")?,
            drv(rt.ctx.new_stream(), "create the compute stream")?,
            drv(rt.ctx.new_stream(), "create the copy-out stream")?,
        ];
        let bounce = Bounce::new(&rt)?;
        let backend = CudaBackend::new(
            rt.clone(),
            streams[StreamKind::Compute as usize].clone(),
            &templates.rope,
            shape.n(),
            (
                cfg.tf32,
                (cfg.precision == Precision::Bf16)
                    .then(|| program::bf16_operand_elems(&templates.config, shape)),
            ),
        )?;
        let epoch_event = drv(
            streams[StreamKind::Compute as usize].record_event(Some(TIMED)),
            "record the epoch",
        )?;
        drv(epoch_event.synchronize(), "synchronize the epoch")?;
        let epoch = Instant::now();
        let shared = Arc::new(Shared {
            inner: Mutex::new(Inner {
                bufs: Vec::new(),
                in_use: ws_bytes,
                peak: ws_bytes,
                backend,
                recorded: Vec::new(),
                timed: Vec::new(),
                bounces: Vec::new(),
                next_bounce: 0,
                bounce_seq: [0; bounce::BOUNCES],
                timing_pool: Vec::new(),
                sync_pool: Vec::new(),
            }),
            error: Mutex::new(None),
            streams: [streams[0].clone(), streams[1].clone(), streams[2].clone()],
            lander_failure: bounce.failure.clone(),
            landings: bounce.landings.clone(),
            pending: Mutex::new(Vec::new()),
            wake: std::sync::Condvar::new(),
        });
        let stop = Arc::new(std::sync::atomic::AtomicBool::new(false));
        let watchdog = watchdog::spawn(shared.clone(), stop.clone(), rt.ctx.clone())?;
        Ok(CudaDevice {
            rt,
            streams,
            shared,
            stop,
            watchdog: Some(watchdog),
            capacity,
            templates,
            shape,
            ws_layout,
            ws: ws.release(),
            grad_staging: grad_staging_buf.map(|(a, n)| (a.release(), n)),
            precision: cfg.precision,
            epoch,
            epoch_event,
            anchor: Mutex::new(None),
            bounce,
            ranks: Mutex::new(ranks),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        self.shared.lock()
    }

    fn fail(&self, e: Error) {
        self.shared.fail(e);
    }

    fn enqueue(&self, g: &mut Inner, kind: StreamKind, cmd: Cmd) -> Result<()> {
        let stream = &self.streams[kind as usize];
        let timed = match cmd {
            Cmd::Record(e) => record(&self.shared, g, (kind, stream), e)?,
            Cmd::Wait(e) => wait(g, stream, kind, &e)?,
            Cmd::HtoD {
                dst,
                offset,
                src,
                label,
            } => copies::htod(g, stream, dst, offset, &src, &label)?,
            Cmd::HtoDBf16 {
                dst,
                offset,
                src,
                label,
            } => self.htod_bf16(g, stream, dst, offset, &src, &label)?,
            Cmd::DtoHBf16 {
                dst,
                src,
                offset,
                label,
            } => self.dtoh_bf16(g, stream, (&dst, src, offset), &label)?,
            Cmd::DtoH {
                dst,
                src,
                offset,
                accumulate,
                link,
                label,
            } => {
                // The gradient staging is the copy-out stream's (its chunks follow each other
                // in that stream's order).
                if link == GradLink::Bf16 && kind != StreamKind::CopyOut {
                    return Err(Error::internal(
                        "CUDA device",
                        format!("dtoh {label}: bf16 gradients off the copy-out stream"),
                    ));
                }
                self.dtoh(
                    g,
                    stream,
                    (&dst, src, offset),
                    Landing { accumulate, link },
                    &label,
                )?
            }
            Cmd::Kernel(k) => self.kernel(g, stream, kind, &k)?,
            Cmd::Broadcast {
                buf,
                len,
                root,
                label,
            } => self.broadcast(g, stream, (buf, len, root), &label)?,
        };
        if let Some(Span { name, bytes, start }) = timed {
            let end = g.event_on(stream, true)?;
            g.timed.push(Timed {
                stream: kind,
                name,
                bytes,
                start,
                end,
            });
        }
        Ok(())
    }

    /// Layer op `k` on the compute stream, its buffers resolved to device ranges.
    fn kernel(
        &self,
        g: &mut Inner,
        stream: &CudaStream,
        kind: StreamKind,
        k: &DeviceKernel,
    ) -> Result<Option<Span>> {
        if kind != StreamKind::Compute {
            return Err(Error::internal(
                "CUDA device",
                format!("{} submitted off the compute stream", k.name()),
            ));
        }
        let start = span(g, stream, k.name(), 0)?;
        let ids: Vec<(BufId, (DevP, usize))> = k
            .buffers()
            .into_iter()
            .map(|(id, _)| g.buf(id).map(|b| (id, b)))
            .collect::<Result<_>>()?;
        let resolve = |id: BufId| -> Result<(DevP, usize)> {
            ids.iter()
                .find(|(i, _)| *i == id)
                .map(|(_, b)| *b)
                .ok_or_else(|| {
                    Error::internal("CUDA device", format!("{}: buffer {id} unknown", k.name()))
                })
        };
        let ws = self.ws_layout.at::<CudaBackend>(DevP::f32(self.ws));
        program::run(
            &mut g.backend,
            &self.templates,
            k,
            &resolve,
            &ws,
            self.shape,
        )?;
        Ok(Some(start))
    }

    /// `len` elements of bf16 (2 B) or f32 (4 B) from the capacity.
    fn allocate(&self, len: usize, label: &str, bf16: bool) -> Result<BufId> {
        let mut g = self.lock();
        let bytes = if bf16 { 2 } else { 4 } * len as u64;
        if g.in_use + bytes > self.capacity {
            return Err(Error::bad_input(
                "GPU memory",
                format!("allocate {label} ({})", crate::util::human_bytes(bytes)),
                format!(
                    "the working set would need {} of the {} usable on the GPU",
                    crate::util::human_bytes(g.in_use + bytes),
                    crate::util::human_bytes(self.capacity)
                ),
                Some("lower --batch-size / --seq-len, or pass --activations host"),
            ));
        }
        let _ = self.rt.ctx.bind_to_thread();
        let free = free_memory().map(|f| f.0).unwrap_or(0);
        let ptr = alloc_raw(bytes as usize, label, free)?;
        g.in_use += bytes;
        g.peak = g.peak.max(g.in_use);
        g.bufs.push(Some(Buf {
            ptr,
            len,
            bf16,
            label: label.to_owned(),
        }));
        Ok(g.bufs.len() - 1)
    }
}

impl Device for CudaDevice {
    fn name(&self) -> String {
        format!(
            "cuda:{} (sm_{}{})",
            self.rt.name, self.rt.cc.0, self.rt.cc.1
        )
    }

    fn shape(&self) -> Shape {
        self.shape
    }

    fn precision(&self) -> Precision {
        self.precision
    }

    fn alloc(&self, len: usize, label: &str) -> Result<BufId> {
        self.allocate(len, label, false)
    }

    fn alloc_weights(&self, len: usize, label: &str) -> Result<BufId> {
        self.allocate(len, label, self.precision == Precision::Bf16)
    }

    fn alloc_stored(&self, words: &dyn Fn(Precision) -> usize, label: &str) -> Result<BufId> {
        self.allocate(words(self.precision), label, false)
    }

    fn free(&self, buf: BufId) {
        self.synchronize();
        let _ = self.rt.ctx.bind_to_thread();
        let mut g = self.lock();
        if let Some(b) = g.bufs.get_mut(buf).and_then(Option::take) {
            // SAFETY: every stream is idle, so nothing uses the allocation any more.
            let r = unsafe { cudarc::driver::sys::cuMemFree_v2(b.ptr) };
            if let Err(e) = r.result() {
                drop(g);
                self.fail(Error::cuda(format!("free {}", b.label), e));
                return;
            }
            g.in_use -= b.bytes();
        }
    }

    fn submit(&self, stream: StreamKind, cmd: Cmd) {
        let record = match &cmd {
            Cmd::Record(e) => Some(e.clone()),
            _ => None,
        };
        // After a failure nothing more is enqueued: the step is over and reads the error.
        // A record's host event is fired so nothing waits on it forever.
        if self.shared.failed() {
            if let Some(e) = record {
                e.signal();
            }
            return;
        }
        let mut g = self.lock();
        if let Err(e) = drv(self.rt.ctx.bind_to_thread(), "bind the context")
            .and_then(|()| self.enqueue(&mut g, stream, cmd))
        {
            drop(g);
            self.fail(e);
            if let Some(e) = record {
                e.signal();
            }
        }
    }

    fn synchronize(&self) {
        for s in &self.shared.streams {
            if let Err(e) = s.synchronize() {
                self.fail(Error::cuda("synchronize a stream", e));
            }
        }
    }

    fn memory(&self) -> MemStats {
        let g = self.lock();
        MemStats {
            in_use: g.in_use,
            peak: g.peak,
            capacity: self.capacity,
        }
    }

    fn reset_peak(&self) {
        let mut g = self.lock();
        g.peak = g.in_use;
    }

    /// Every time is measured from an anchor in the same batch of records (the first op's
    /// start), as f32 milliseconds over that short span; the anchor's own time is carried
    /// from anchor to anchor in f64 seconds. Measured from one event at start-up instead,
    /// f32 milliseconds would quantise every duration to milliseconds after a few hours.
    fn take_records(&self) -> Vec<OpRecord> {
        let timed = std::mem::take(&mut self.lock().timed);
        let Some(first) = timed.first() else {
            return Vec::new();
        };
        let mut anchor = lock(&self.anchor);
        let (since, since_s) = anchor
            .as_ref()
            .map_or((&self.epoch_event, 0.0), |(e, s)| (e, *s));
        let times = timed
            .iter()
            .try_fold(Vec::with_capacity(timed.len()), |mut v, t| {
                t.end.synchronize()?;
                v.push((
                    first.start.elapsed_ms(&t.start)?,
                    first.start.elapsed_ms(&t.end)?,
                ));
                Ok::<_, cudarc::driver::DriverError>(v)
            })
            .and_then(|v| Ok((since.elapsed_ms(&first.start)?, v)));
        let (anchor_ms, times) = match times {
            Ok(t) => t,
            Err(e) => {
                drop(anchor);
                self.fail(Error::cuda("time the step's commands", e));
                return Vec::new();
            }
        };
        let anchor_s = since_s + f64::from(anchor_ms) * 1e-3;
        let mut out = Vec::with_capacity(timed.len());
        let mut next_anchor = None;
        let mut done = Vec::with_capacity(2 * timed.len());
        for (t, (a, b)) in timed.into_iter().zip(times) {
            out.push(OpRecord {
                stream: t.stream,
                name: t.name,
                start: anchor_s + f64::from(a) * 1e-3,
                end: anchor_s + f64::from(b) * 1e-3,
                bytes: t.bytes,
            });
            // The first command's start anchors the next batch; every other event is free.
            match next_anchor {
                None => next_anchor = Some(t.start),
                Some(_) => done.push(t.start),
            }
            done.push(t.end);
        }
        if let Some((old, _)) = std::mem::replace(&mut *anchor, next_anchor.map(|e| (e, anchor_s)))
        {
            done.push(old);
        }
        drop(anchor);
        self.lock().timing_pool.extend(done);
        out
    }

    fn epoch(&self) -> Instant {
        self.epoch
    }

    fn take_error(&self) -> Option<Error> {
        lock(&self.shared.error).take()
    }

    fn pci_bus_id(&self) -> Option<String> {
        Some(self.rt.pci_bus_id.clone())
    }

    fn describe(&self) -> Vec<String> {
        let mut v = self.rt.describe();
        if let Some(c) = lock(&self.ranks).as_ref() {
            let lib = c.library();
            v.push(format!(
                "NCCL          {:<22} {} (rank {} of {})",
                lib.version,
                lib.found.path.display(),
                c.rank(),
                c.size()
            ));
        }
        v
    }

    fn registrar(&self) -> Option<Arc<dyn HostRegistrar + Send + Sync>> {
        Some(Arc::new(CudaRegistrar(self.rt.ctx.clone())))
    }

    fn abort_exchanges(&self) {
        if let Some(c) = lock(&self.ranks).as_mut() {
            c.abort();
        }
    }
}

impl Drop for CudaDevice {
    fn drop(&mut self) {
        self.stop.store(true, std::sync::atomic::Ordering::Release);
        self.shared.wake.notify_all();
        if let Some(w) = self.watchdog.take() {
            let _ = w.join();
        }
        self.synchronize();
        // NCCL's resources go while the context is whole.
        drop(lock(&self.ranks).take());
        // Every landing done before the bounce chunks go (the streams are idle).
        self.bounce.stop();
        let _ = self.rt.ctx.bind_to_thread();
        let mut g = self.shared.lock();
        for b in g.bufs.drain(..).flatten() {
            // SAFETY: every stream is idle.
            unsafe { cudarc::driver::sys::cuMemFree_v2(b.ptr) };
        }
        // SAFETY: as above; the workspace and the staging were allocated in `open`.
        unsafe { cudarc::driver::sys::cuMemFree_v2(self.ws) };
        if let Some((p, _)) = self.grad_staging {
            // SAFETY: as above.
            unsafe { cudarc::driver::sys::cuMemFree_v2(p) };
        }
    }
}

/// A timed command: its name, bytes moved and the event recorded before it.
struct Span {
    name: String,
    bytes: u64,
    start: CudaEvent,
}

/// Open a [`Span`] on `stream`.
fn span(g: &mut Inner, stream: &CudaStream, name: String, bytes: u64) -> Result<Span> {
    Ok(Span {
        name,
        bytes,
        start: g.event_on(stream, true)?,
    })
}

/// Signal host event `e` once everything before it on `stream` is done. Events this thread
/// sees completed (and whose host event fired) are dropped first.
fn record(
    shared: &Shared,
    g: &mut Inner,
    (kind, stream): (StreamKind, &CudaStream),
    e: Event,
) -> Result<Option<Span>> {
    for r in g.recorded.iter_mut().filter(|r| !r.done) {
        r.done = completed(&r.cuda)?;
    }
    let (gone, kept): (Vec<Recorded>, Vec<Recorded>) = std::mem::take(&mut g.recorded)
        .into_iter()
        .partition(|r| r.done && r.event.query());
    g.recorded = kept;
    // An event the poller no longer holds goes back to the pool.
    g.sync_pool.extend(
        gone.into_iter()
            .filter_map(|r| Arc::try_unwrap(r.cuda).ok()),
    );
    let cuda = Arc::new(g.event_on(stream, false)?);
    // The poller signals the host event when the CUDA event completes.
    lock(&shared.pending).push((kind, cuda.clone(), e.clone()));
    shared.wake.notify_one();
    g.recorded.push(Recorded {
        event: e,
        cuda,
        done: false,
    });
    Ok(None)
}

/// Hold `stream` until host event `e` fires: a `cuStreamWaitEvent` on its CUDA event, unless
/// this thread saw that event complete.
fn wait(g: &mut Inner, stream: &CudaStream, kind: StreamKind, e: &Event) -> Result<Option<Span>> {
    match g.recorded.iter().find(|r| r.event.same(e)) {
        Some(r) if !r.done => drv(stream.wait(&r.cuda), "wait on an event")?,
        Some(_) => {}
        // Dropped by `record` after this thread saw it complete.
        None if e.query() => {}
        None => {
            return Err(Error::internal(
                "CUDA device",
                format!(
                    "a wait on {} for an event never recorded (a Wait submitted before its Record)",
                    kind.name()
                ),
            ))
        }
    }
    Ok(None)
}

impl Inner {
    /// Device buffer `id`'s typed address and length in elements.
    fn buf(&self, id: BufId) -> Result<(DevP, usize)> {
        self.bufs
            .get(id)
            .and_then(|b| b.as_ref())
            .map(|b| {
                let p = if b.bf16 {
                    DevP::bf16(b.ptr)
                } else {
                    DevP::f32(b.ptr)
                };
                (p, b.len)
            })
            .ok_or_else(|| {
                Error::internal(
                    "CUDA device",
                    format!("device buffer {id} does not exist (freed or never allocated)"),
                )
            })
    }

    /// Device buffer `id`'s address and length, which `what` (an fp32 copy) needs in f32.
    fn f32_buf(&self, id: BufId, what: &str) -> Result<(DevPtr, usize)> {
        let (p, len) = self.buf(id)?;
        if p.bf16 {
            return Err(Error::internal(
                "CUDA device",
                format!("{what}: buffer {id} holds bf16 weights"),
            ));
        }
        Ok((p.addr, len))
    }
}
