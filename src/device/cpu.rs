//! The CPU device: a fixed-capacity arena of buffers, one worker thread per stream, events that
//! order work across streams, the layer ops run as the device program ([`super::program`], the
//! same one the CUDA device runs) on the CPU reference kernels, and an optional
//! link model (bandwidth and latency per direction) that makes copies take as long as they would
//! over PCIe or NVLink-C2C. Random per-command delays can be injected to shake out ordering bugs.

use super::host_backend::{bf16_value, HostBackend, HostP};
use super::program::{self, Shape, Ws};
use super::{
    Access, BufId, Cmd, Device, DeviceKernel, Event, GradLink, MemStats, OpRecord, Precision,
    StreamKind,
};
use crate::model::reference::Templates;
use crate::util::lock;
use crate::{Error, Result};
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// An emulated host link.
#[derive(Debug, Clone, Copy, PartialEq, serde::Serialize, serde::Deserialize)]
pub struct LinkModel {
    /// Host → device GB/s.
    pub htod_gbps: f64,
    /// Device → host GB/s.
    pub dtoh_gbps: f64,
    /// Per-copy latency, microseconds.
    pub latency_us: f64,
}

impl LinkModel {
    fn duration(&self, bytes: u64, htod: bool) -> Duration {
        let bw = if htod { self.htod_gbps } else { self.dtoh_gbps };
        Duration::from_secs_f64(bytes as f64 / (bw * 1e9) + self.latency_us * 1e-6)
    }
}

/// How to build a [`CpuDevice`].
#[derive(Debug, Clone)]
pub struct CpuDeviceConfig {
    /// Arena capacity in bytes (allocations past it fail).
    pub capacity_bytes: u64,
    /// Emulated link, if any.
    pub link: Option<LinkModel>,
    /// Random delay of up to this many microseconds before every command (seeded per stream).
    pub jitter: Option<(u64, u64)>,
    /// Micro-batch shape (and token chunks) the kernels run on.
    pub shape: Shape,
    /// The precision the kernels compute in.
    pub precision: Precision,
}

/// A device buffer with a run-time borrow flag: streams that touch the same buffer at the same
/// time are a scheduling bug, reported as an error instead of a data race.
#[derive(Debug)]
struct BufCell {
    data: std::cell::UnsafeCell<Vec<f32>>,
    /// Readers (> 0), a writer (-1), or free (0).
    state: std::sync::atomic::AtomicIsize,
    label: String,
    len: usize,
    /// Bytes charged against the capacity: 4 per element, 2 for a bf16 device's weights.
    bytes: u64,
}

// SAFETY: all access to `data` goes through ReadView/WriteView, whose acquisition through the
// atomic `state` excludes a writer concurrent with anyone else.
unsafe impl Sync for BufCell {}

type Buffer = Arc<BufCell>;

struct ReadView<'a>(&'a BufCell);
struct WriteView<'a>(&'a BufCell);

impl BufCell {
    fn read(&self) -> Result<ReadView<'_>> {
        use std::sync::atomic::Ordering::*;
        let mut s = self.state.load(Acquire);
        loop {
            if s < 0 {
                return Err(Error::internal(
                    "CPU device",
                    format!(
                        "buffer `{}` read while another stream writes it (missing event)",
                        self.label
                    ),
                ));
            }
            match self.state.compare_exchange_weak(s, s + 1, Acquire, Acquire) {
                Ok(_) => return Ok(ReadView(self)),
                Err(now) => s = now,
            }
        }
    }

    fn write(&self) -> Result<WriteView<'_>> {
        use std::sync::atomic::Ordering::*;
        self.state
            .compare_exchange(0, -1, Acquire, Acquire)
            .map(|_| WriteView(self))
            .map_err(|_| {
                Error::internal(
                    "CPU device",
                    format!(
                        "buffer `{}` written while another stream uses it (missing event)",
                        self.label
                    ),
                )
            })
    }
}

impl std::ops::Deref for ReadView<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: state > 0 while this view lives: no writer exists.
        unsafe { &*self.0.data.get() }
    }
}

impl Drop for ReadView<'_> {
    fn drop(&mut self) {
        self.0
            .state
            .fetch_sub(1, std::sync::atomic::Ordering::Release);
    }
}

impl std::ops::Deref for WriteView<'_> {
    type Target = [f32];
    fn deref(&self) -> &[f32] {
        // SAFETY: state == -1 while this view lives: it is the only accessor.
        unsafe { &*self.0.data.get() }
    }
}

impl std::ops::DerefMut for WriteView<'_> {
    fn deref_mut(&mut self) -> &mut [f32] {
        // SAFETY: state == -1 while this view lives: it is the only accessor.
        unsafe { &mut *self.0.data.get() }
    }
}

impl Drop for WriteView<'_> {
    fn drop(&mut self) {
        self.0.state.store(0, std::sync::atomic::Ordering::Release);
    }
}

#[derive(Debug, Default)]
struct Arena {
    buffers: Vec<Option<Buffer>>,
    in_use: u64,
    peak: u64,
}

#[derive(Debug)]
struct Shared {
    arena: Mutex<Arena>,
    capacity: u64,
    records: Mutex<Vec<OpRecord>>,
    error: Mutex<Option<Error>>,
    epoch: Instant,
}

impl Shared {
    fn buffer(&self, id: BufId) -> Result<Buffer> {
        let a = lock(&self.arena);
        a.buffers
            .get(id)
            .and_then(|b| b.as_ref())
            .cloned()
            .ok_or_else(|| {
                Error::internal(
                    "CPU device",
                    format!("device buffer {id} does not exist (freed or never allocated)"),
                )
            })
    }

    /// Keep the first error.
    fn fail(&self, e: Error) {
        let mut first = lock(&self.error);
        if first.is_none() {
            *first = Some(e);
        }
    }
}

/// The CPU device.
#[derive(Debug)]
pub struct CpuDevice {
    shared: Arc<Shared>,
    senders: Vec<Sender<Cmd>>,
    handles: Vec<JoinHandle<()>>,
    workspace_bytes: u64,
    shape: Shape,
    precision: Precision,
}

fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

/// `len` zeros, or an error (not an abort) when the host cannot provide them: the CPU device's
/// memory is host memory.
fn zeroed(len: usize, label: &str) -> Result<Vec<f32>> {
    let mut v = Vec::new();
    v.try_reserve_exact(len).map_err(|_| {
        Error::system(
            "CPU device",
            format!("allocate {label}"),
            format!(
                "the host cannot provide {}",
                crate::util::human_bytes(4 * len as u64)
            ),
        )
        .with_fix("lower --device-memory, --batch-size or --seq-len")
    })?;
    v.resize(len, 0.0);
    Ok(v)
}

impl CpuDevice {
    /// Start the device's three stream threads. `templates` are the layer ops it runs.
    pub fn new(cfg: CpuDeviceConfig, templates: Arc<Templates>) -> Result<Self> {
        // Held in fp32 (bf16 values in fp32 storage), charged as a GPU holds it.
        let (layout, elems) = Ws::layout(&templates.config, cfg.shape, Precision::Fp32);
        let workspace_bytes = program::workspace_bytes(&templates.config, cfg.shape, cfg.precision);
        if workspace_bytes > cfg.capacity_bytes {
            return Err(Error::system(
                "CPU device",
                "allocate the layer workspace",
                format!(
                    "needs {} but the device has {}",
                    crate::util::human_bytes(workspace_bytes),
                    crate::util::human_bytes(cfg.capacity_bytes)
                ),
            ));
        }
        let shared = Arc::new(Shared {
            arena: Mutex::new(Arena {
                in_use: workspace_bytes,
                peak: workspace_bytes,
                ..Arena::default()
            }),
            capacity: cfg.capacity_bytes,
            records: Mutex::new(Vec::new()),
            error: Mutex::new(None),
            epoch: Instant::now(),
        });
        let mut senders = Vec::new();
        let mut handles = Vec::new();
        let mut ws = Some(Workspace {
            layout,
            mem: zeroed(elems, "the layer workspace")?,
            precision: cfg.precision,
        });
        for stream in StreamKind::ALL {
            let (tx, rx) = channel::<Cmd>();
            let shared = shared.clone();
            let templates = templates.clone();
            let mut ws = if stream == StreamKind::Compute {
                ws.take()
            } else {
                None
            };
            let link = cfg.link;
            let mut jitter = cfg.jitter.map(|(seed, max)| {
                (
                    seed.wrapping_mul(31).wrapping_add(stream as u64 + 1) | 1,
                    max,
                )
            });
            let shape = cfg.shape;
            let h = std::thread::Builder::new()
                .name(format!("cpu-device-{}", stream.name()))
                .spawn(move || {
                    while let Ok(cmd) = rx.recv() {
                        if let Some((state, max)) = jitter.as_mut() {
                            let d = xorshift(state) % (*max + 1);
                            std::thread::sleep(Duration::from_micros(d));
                        }
                        let start = shared.epoch.elapsed().as_secs_f64();
                        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                            execute(&shared, stream, cmd, link, &templates, ws.as_mut(), shape)
                        }));
                        match r {
                            Ok(Ok(Some((name, bytes)))) => {
                                let end = shared.epoch.elapsed().as_secs_f64();
                                lock(&shared.records).push(OpRecord {
                                    stream,
                                    name,
                                    start,
                                    end,
                                    bytes,
                                });
                            }
                            Ok(Ok(None)) => {}
                            Ok(Err(e)) => shared.fail(e),
                            Err(_) => shared.fail(Error::internal(
                                "CPU device",
                                format!("a kernel panicked on the {} stream", stream.name()),
                            )),
                        }
                    }
                })
                .map_err(|e| Error::system("std::thread", "spawn device stream", e))?;
            senders.push(tx);
            handles.push(h);
        }
        Ok(CpuDevice {
            shared,
            senders,
            handles,
            workspace_bytes,
            shape: cfg.shape,
            precision: cfg.precision,
        })
    }

    /// `len` elements, charged `bytes` against the capacity.
    fn allocate(&self, len: usize, label: &str, bytes: u64) -> Result<BufId> {
        let mut a = lock(&self.shared.arena);
        if a.in_use + bytes > self.shared.capacity {
            return Err(Error::system(
                "CPU device",
                format!("allocate {label} ({})", crate::util::human_bytes(bytes)),
                format!(
                    "out of device memory: {} in use of {}",
                    crate::util::human_bytes(a.in_use),
                    crate::util::human_bytes(self.shared.capacity)
                ),
            ));
        }
        a.in_use += bytes;
        a.peak = a.peak.max(a.in_use);
        a.buffers.push(Some(Arc::new(BufCell {
            data: std::cell::UnsafeCell::new(zeroed(len, label)?),
            state: std::sync::atomic::AtomicIsize::new(0),
            label: label.to_owned(),
            len,
            bytes,
        })));
        Ok(a.buffers.len() - 1)
    }

    /// Bytes of the layer workspace (part of `memory().in_use` from the start).
    pub fn workspace_bytes(&self) -> u64 {
        self.workspace_bytes
    }

    /// Copy a device buffer to a Vec (tests; synchronizes first).
    pub fn read(&self, buf: BufId) -> Result<Vec<f32>> {
        self.synchronize();
        let b = self.shared.buffer(buf)?;
        let v = b.read()?.to_vec();
        Ok(v)
    }
}

#[allow(clippy::too_many_arguments)]
fn execute(
    shared: &Shared,
    stream: StreamKind,
    cmd: Cmd,
    link: Option<LinkModel>,
    tm: &Templates,
    ws: Option<&mut Workspace>,
    shape: Shape,
) -> Result<Option<(String, u64)>> {
    match cmd {
        Cmd::Record(e) => {
            e.signal();
            Ok(None)
        }
        Cmd::Wait(e) => {
            e.synchronize();
            Ok(None)
        }
        Cmd::HtoD {
            dst,
            offset,
            src,
            label,
        } => copy_in(shared, link, (dst, offset), &src, &label, |x| x),
        // bf16 weights, widened exactly into the fp32 buffer.
        Cmd::HtoDBf16 {
            dst,
            offset,
            src,
            label,
        } => copy_in(
            shared,
            link,
            (dst, offset),
            &src,
            &label,
            crate::store::planes::hi_to_f32,
        ),
        Cmd::DtoH {
            dst,
            src,
            offset,
            accumulate,
            link: wire,
            label,
        } => {
            // What lands on the host: the device's values, or their bf16 roundings.
            let crossed = |v: f32| match wire {
                GradLink::Fp32 => v,
                GradLink::Bf16 => bf16_value(v),
            };
            let at = (label.as_str(), wire.elem_bytes());
            match accumulate {
                true => copy_out(shared, link, (src, offset), &dst, at, |a, v| {
                    *a += crossed(v)
                }),
                false => copy_out(shared, link, (src, offset), &dst, at, |a, v| {
                    *a = crossed(v)
                }),
            }
        }
        // A bf16 buffer holds its values widened: each is its high half exactly.
        Cmd::DtoHBf16 {
            dst,
            src,
            offset,
            label,
        } => copy_out(shared, link, (src, offset), &dst, (&label, 2), |a, v| {
            *a = (v.to_bits() >> 16) as u16
        }),
        // Never scheduled for it: its ranks exchange through host memory.
        Cmd::Broadcast { label, .. } => Err(Error::internal(
            "CPU device",
            format!("broadcast {label}: the CPU device has no collective engine"),
        )),
        Cmd::Kernel(k) => {
            if stream != StreamKind::Compute {
                return Err(Error::internal(
                    "CPU device",
                    format!("{} submitted off the compute stream", k.name()),
                ));
            }
            let ws =
                ws.ok_or_else(|| Error::internal("CPU device", "no workspace on this stream"))?;
            let name = k.name();
            run_kernel(shared, k, tm, ws, shape)?;
            Ok(Some((name, 0)))
        }
    }
}

/// Host → device: `src` (elements of `T`, each widened to f32) into buffer `dst` at `offset`,
/// paced by the emulated link at `size_of::<T>()` bytes per element.
fn copy_in<T: Copy>(
    shared: &Shared,
    link: Option<LinkModel>,
    (dst, offset): (BufId, usize),
    src: &super::HostRef<T>,
    label: &str,
    widen: impl Fn(T) -> f32,
) -> Result<Option<(String, u64)>> {
    let began = Instant::now();
    let buf = shared.buffer(dst)?;
    let mut d = buf.write()?;
    super::check_copy(&format!("htod {label}"), src.len(), offset, dst, d.len())?;
    // SAFETY: HostRef's contract: valid and unaliased until this command completes.
    let s = unsafe { src.slice() };
    for (w, x) in d[offset..offset + s.len()].iter_mut().zip(s.iter()) {
        *w = widen(*x);
    }
    drop(d);
    let bytes = std::mem::size_of_val(s) as u64;
    pace(link, began, bytes, true);
    Ok(Some((format!("htod {label}"), bytes)))
}

/// `dst.len()` elements of device buffer `src` from `offset`, each landed on its host element
/// by `land`; paced on the link at `elem_bytes` per element.
fn copy_out<T>(
    shared: &Shared,
    link: Option<LinkModel>,
    (src, offset): (BufId, usize),
    dst: &super::HostRef<T>,
    (label, elem_bytes): (&str, u64),
    land: impl Fn(&mut T, f32),
) -> Result<Option<(String, u64)>> {
    let began = Instant::now();
    let buf = shared.buffer(src)?;
    let guard = buf.read()?;
    let s = &*guard;
    super::check_copy(&format!("dtoh {label}"), dst.len(), offset, src, s.len())?;
    // SAFETY: HostRef's contract: valid and unaliased until this command completes.
    let h = unsafe { dst.slice() };
    h.iter_mut()
        .zip(&s[offset..offset + dst.len()])
        .for_each(|(a, v)| land(a, *v));
    drop(guard);
    let bytes = elem_bytes * dst.len() as u64;
    pace(link, began, bytes, false);
    Ok(Some((format!("dtoh {label}"), bytes)))
}

/// Hold a copy of `bytes` begun at `began` until the emulated link (if any) would have carried
/// it (`to_device`: host → device).
fn pace(link: Option<LinkModel>, began: Instant, bytes: u64, to_device: bool) {
    if let Some(m) = link {
        if let Some(rest) = m.duration(bytes, to_device).checked_sub(began.elapsed()) {
            std::thread::sleep(rest);
        }
    }
}

/// The compute stream's layer workspace: the program's scratch regions in one buffer, and the
/// precision its kernels compute in.
#[derive(Debug)]
struct Workspace {
    layout: Ws<usize>,
    mem: Vec<f32>,
    precision: Precision,
}

/// Run a layer op through the device program on the CPU backend, holding every buffer it touches
/// (for writing where it writes) while it runs.
fn run_kernel(
    shared: &Shared,
    k: DeviceKernel,
    tm: &Templates,
    ws: &mut Workspace,
    shape: Shape,
) -> Result<()> {
    let mut ids: Vec<(BufId, bool)> = k
        .buffers()
        .into_iter()
        .map(|(id, a)| (id, a == Access::Write))
        .collect();
    ids.sort_unstable();
    ids.dedup_by(|later, first| {
        // Same buffer: held for writing if any use writes it.
        if later.0 == first.0 {
            first.1 |= later.1;
            true
        } else {
            false
        }
    });
    let cells = ids
        .iter()
        .map(|(id, _)| shared.buffer(*id))
        .collect::<Result<Vec<_>>>()?;
    let mut reads = Vec::new();
    let mut writes = Vec::new();
    let mut ptrs: Vec<(BufId, HostP)> = Vec::new();
    for ((id, w), cell) in ids.iter().zip(&cells) {
        if *w {
            let mut v = cell.write()?;
            // SAFETY: the write view is held (exclusive) until the program returns.
            ptrs.push((*id, unsafe { HostP::write(&mut v) }));
            writes.push(v);
        } else {
            let v = cell.read()?;
            // SAFETY: the read view is held (no writer) until the program returns.
            ptrs.push((*id, unsafe { HostP::read(&v) }));
            reads.push(v);
        }
    }
    let lens: Vec<usize> = cells.iter().map(|c| c.len).collect();
    let resolve = |id: BufId| -> Result<(HostP, usize)> {
        ptrs.iter()
            .zip(&lens)
            .find(|((i, _), _)| *i == id)
            .map(|((_, p), len)| (*p, *len))
            .ok_or_else(|| {
                Error::internal("CPU device", format!("{}: buffer {id} not held", k.name()))
            })
    };
    // SAFETY: the workspace belongs to the compute stream's thread, which runs this.
    let base = unsafe { HostP::write(&mut ws.mem) };
    let w = ws.layout.at::<HostBackend<'_>>(base);
    let mut be = HostBackend::with_precision(&tm.rope, ws.precision);
    let r = program::run(&mut be, tm, &k, &resolve, &w, shape);
    drop(writes);
    drop(reads);
    r
}

impl Device for CpuDevice {
    fn name(&self) -> String {
        "cpu".into()
    }

    fn shape(&self) -> Shape {
        self.shape
    }

    fn precision(&self) -> Precision {
        self.precision
    }

    fn alloc(&self, len: usize, label: &str) -> Result<BufId> {
        self.allocate(len, label, 4 * len as u64)
    }

    /// Weights held as a bf16 GPU holds them: charged 2 B per element under bf16 (stored as the
    /// widened fp32 values here, which are the same numbers).
    fn alloc_weights(&self, len: usize, label: &str) -> Result<BufId> {
        let elem = match self.precision {
            Precision::Fp32 => 4,
            Precision::Bf16 => 2,
        };
        self.allocate(len, label, elem * len as u64)
    }

    fn alloc_stored(&self, words: &dyn Fn(Precision) -> usize, label: &str) -> Result<BufId> {
        self.allocate(
            words(Precision::Fp32),
            label,
            4 * words(self.precision) as u64,
        )
    }

    fn free(&self, buf: BufId) {
        let mut a = lock(&self.shared.arena);
        if let Some(slot) = a.buffers.get_mut(buf) {
            if let Some(b) = slot.take() {
                a.in_use -= b.bytes;
            }
        }
    }

    fn submit(&self, stream: StreamKind, cmd: Cmd) {
        if self.senders[stream as usize].send(cmd).is_err() {
            self.shared.fail(Error::internal(
                "CPU device",
                format!("the {} stream is gone", stream.name()),
            ));
        }
    }

    fn synchronize(&self) {
        let events: Vec<Event> = StreamKind::ALL
            .iter()
            .map(|&s| {
                let e = Event::new();
                self.submit(s, Cmd::Record(e.clone()));
                e
            })
            .collect();
        for e in events {
            e.synchronize();
        }
    }

    fn memory_in_host(&self) -> bool {
        true
    }

    fn memory(&self) -> MemStats {
        let a = lock(&self.shared.arena);
        MemStats {
            in_use: a.in_use,
            peak: a.peak,
            capacity: self.shared.capacity,
        }
    }

    fn reset_peak(&self) {
        let mut a = lock(&self.shared.arena);
        a.peak = a.in_use;
    }

    fn take_records(&self) -> Vec<OpRecord> {
        std::mem::take(&mut *lock(&self.shared.records))
    }

    fn epoch(&self) -> Instant {
        self.shared.epoch
    }

    fn take_error(&self) -> Option<Error> {
        lock(&self.shared.error).take()
    }
}

impl Drop for CpuDevice {
    fn drop(&mut self) {
        self.senders.clear();
        for h in self.handles.drain(..) {
            let _ = h.join();
        }
    }
}
