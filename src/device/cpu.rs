//! The CPU device: a fixed-capacity arena of buffers, one worker thread per stream, events that
//! order work across streams, the layer ops run by the CPU reference kernels, and an optional
//! link model (bandwidth and latency per direction) that makes copies take as long as they would
//! over PCIe or NVLink-C2C. Random per-command delays can be injected to shake out ordering bugs.

use super::{BufId, Cmd, Device, Event, Kernel, MemStats, OpRecord, StreamKind};
use crate::model::layers::Workspace;
use crate::model::reference::Templates;
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
    /// Micro-batch shape the kernels run on.
    pub batch: usize,
    /// Sequence length.
    pub seq: usize,
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
}

// SAFETY: all access to `data` goes through ReadView/WriteView, whose acquisition through the
// atomic `state` excludes a writer concurrent with anyone else.
unsafe impl Sync for BufCell {}

type Buffer = Arc<BufCell>;

struct ReadView<'a>(&'a BufCell);
struct WriteView<'a>(&'a BufCell);

impl BufCell {
    fn read(&self) -> std::result::Result<ReadView<'_>, String> {
        use std::sync::atomic::Ordering::*;
        let mut s = self.state.load(Acquire);
        loop {
            if s < 0 {
                return Err(format!(
                    "buffer `{}` read while another stream writes it (missing event)",
                    self.label
                ));
            }
            match self.state.compare_exchange_weak(s, s + 1, Acquire, Acquire) {
                Ok(_) => return Ok(ReadView(self)),
                Err(now) => s = now,
            }
        }
    }

    fn write(&self) -> std::result::Result<WriteView<'_>, String> {
        use std::sync::atomic::Ordering::*;
        self.state
            .compare_exchange(0, -1, Acquire, Acquire)
            .map(|_| WriteView(self))
            .map_err(|_| {
                format!(
                    "buffer `{}` written while another stream uses it (missing event)",
                    self.label
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
    error: Mutex<Option<String>>,
    epoch: Instant,
}

impl Shared {
    fn buffer(&self, id: BufId) -> std::result::Result<Buffer, String> {
        let a = self.arena.lock().unwrap_or_else(|e| e.into_inner());
        a.buffers
            .get(id)
            .and_then(|b| b.as_ref())
            .cloned()
            .ok_or_else(|| format!("device buffer {id} does not exist (freed or never allocated)"))
    }

    fn fail(&self, msg: String) {
        let mut e = self.error.lock().unwrap_or_else(|e| e.into_inner());
        if e.is_none() {
            *e = Some(msg);
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
}

fn xorshift(s: &mut u64) -> u64 {
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    *s
}

impl CpuDevice {
    /// Start the device's three stream threads. `templates` are the layer ops it runs.
    pub fn new(cfg: CpuDeviceConfig, templates: Arc<Templates>) -> Result<Self> {
        let ws = Workspace::new(&templates.config, cfg.batch, cfg.seq);
        let workspace_bytes = ws.bytes() as u64
            + 4 * (crate::model::ops::CE_CHUNK_ROWS.min(cfg.batch * cfg.seq)
                * templates.config.vocab_size) as u64;
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
        let mut ws = Some(ws);
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
            let (b, t) = (cfg.batch, cfg.seq);
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
                            execute(&shared, stream, cmd, link, &templates, ws.as_mut(), b, t)
                        }));
                        match r {
                            Ok(Ok(Some((name, bytes)))) => {
                                let end = shared.epoch.elapsed().as_secs_f64();
                                shared
                                    .records
                                    .lock()
                                    .unwrap_or_else(|e| e.into_inner())
                                    .push(OpRecord {
                                        stream,
                                        name,
                                        start,
                                        end,
                                        bytes,
                                    });
                            }
                            Ok(Ok(None)) => {}
                            Ok(Err(msg)) => shared.fail(format!("{}: {msg}", stream.name())),
                            Err(_) => shared.fail(format!("{}: a kernel panicked", stream.name())),
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
        })
    }

    /// Bytes of the layer workspace (part of `memory().in_use` from the start).
    pub fn workspace_bytes(&self) -> u64 {
        self.workspace_bytes
    }

    /// Copy a device buffer to a Vec (tests; synchronizes first).
    pub fn read(&self, buf: BufId) -> Result<Vec<f32>> {
        self.synchronize();
        let b = self
            .shared
            .buffer(buf)
            .map_err(|e| Error::system("CPU device", "read", e))?;
        let v = b
            .read()
            .map_err(|e| Error::system("CPU device", "read", e))?
            .to_vec();
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
    b: usize,
    t: usize,
) -> std::result::Result<Option<(String, u64)>, String> {
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
        } => {
            let began = Instant::now();
            let buf = shared.buffer(dst)?;
            let mut d = buf.write()?;
            if offset + src.len() > d.len() {
                return Err(format!(
                    "htod {label}: {} elements at {offset} overflow buffer {dst} of {}",
                    src.len(),
                    d.len()
                ));
            }
            // SAFETY: HostRef's contract: valid and unaliased until this command completes.
            d[offset..offset + src.len()].copy_from_slice(unsafe { src.slice() });
            drop(d);
            let bytes = 4 * src.len() as u64;
            if let Some(m) = link {
                let want = m.duration(bytes, true);
                if let Some(rest) = want.checked_sub(began.elapsed()) {
                    std::thread::sleep(rest);
                }
            }
            Ok(Some((format!("htod {label}"), bytes)))
        }
        Cmd::DtoH {
            dst,
            src,
            offset,
            accumulate,
            label,
        } => {
            let began = Instant::now();
            let buf = shared.buffer(src)?;
            let s = buf.read()?;
            if offset + dst.len() > s.len() {
                return Err(format!(
                    "dtoh {label}: {} elements at {offset} overflow buffer {src} of {}",
                    dst.len(),
                    s.len()
                ));
            }
            // SAFETY: HostRef's contract: valid and unaliased until this command completes.
            let h = unsafe { dst.slice() };
            if accumulate {
                for (a, v) in h.iter_mut().zip(&s[offset..offset + dst.len()]) {
                    *a += *v;
                }
            } else {
                h.copy_from_slice(&s[offset..offset + dst.len()]);
            }
            drop(s);
            let bytes = 4 * dst.len() as u64;
            if let Some(m) = link {
                let want = m.duration(bytes, false);
                if let Some(rest) = want.checked_sub(began.elapsed()) {
                    std::thread::sleep(rest);
                }
            }
            Ok(Some((format!("dtoh {label}"), bytes)))
        }
        Cmd::Kernel(k) => {
            if stream != StreamKind::Compute {
                return Err("kernels run on the compute stream".into());
            }
            let ws = ws.ok_or("no workspace on this stream")?;
            let name = k.name();
            run_kernel(shared, k, tm, ws, b, t)?;
            Ok(Some((name, 0)))
        }
    }
}

fn run_kernel(
    shared: &Shared,
    k: Kernel,
    tm: &Templates,
    ws: &mut Workspace,
    b: usize,
    t: usize,
) -> std::result::Result<(), String> {
    let n = b * t;
    let c = tm.config.hidden_size;
    let v = tm.config.vocab_size;
    let get = |id| shared.buffer(id);
    match k {
        Kernel::Zero { buf, len } => {
            let bb = get(buf)?;
            let mut d = bb.write()?;
            let len = len.min(d.len());
            d[..len].fill(0.0);
        }
        Kernel::EmbedFwd { w, tokens, x } => {
            let (wb, xb) = (get(w.0)?, get(x)?);
            let (wv, mut xv) = (wb.read()?, xb.write()?);
            tm.embedding.forward(&wv[w.1..], &tokens, &mut xv[..n * c]);
        }
        Kernel::BlockFwd { layer, w, x, y } => {
            let (wb, xb, yb) = (get(w)?, get(x)?, get(y)?);
            let (wv, xv, mut yv) = (wb.read()?, xb.read()?, yb.write()?);
            tm.blocks[layer].forward(&wv, &xv[..n * c], &mut yv[..n * c], ws, &tm.rope, b, t);
        }
        Kernel::BlockBwd {
            layer,
            w,
            g,
            x,
            dy,
            dx,
        } => {
            let (wb, gb, xb, dyb, dxb) = (get(w)?, get(g)?, get(x)?, get(dy)?, get(dx)?);
            let (wv, mut gv, xv, dyv, mut dxv) = (
                wb.read()?,
                gb.write()?,
                xb.read()?,
                dyb.read()?,
                dxb.write()?,
            );
            tm.blocks[layer].backward(
                &wv,
                &mut gv,
                &xv[..n * c],
                &dyv[..n * c],
                &mut dxv[..n * c],
                ws,
                &tm.rope,
                b,
                t,
            );
        }
        Kernel::HeadLossBwd {
            head_w,
            head_g,
            lm_w,
            lm_g,
            x,
            targets,
            dx,
            grad_scale,
            loss,
        } => {
            let nr = tm.head.norm_range();
            let (hwb, lwb, xb, dxb) = (get(head_w)?, get(lm_w.0)?, get(x)?, get(dx)?);
            let hwv = hwb.read()?;
            let lwv = if lm_w.0 == head_w {
                None
            } else {
                Some(lwb.read()?)
            };
            let lw: &[f32] = lwv.as_deref().unwrap_or(&hwv);
            let (xv, mut dxv) = (xb.read()?, dxb.write()?);
            let hgb = get(head_g)?;
            let mut hgv = hgb.write()?;
            let s = if lm_g.0 == head_g {
                // Untied: norm weight [0, C) and LM head [off, off+V·C) in the same shard.
                if lm_g.1 < nr.end {
                    return Err("LM head gradient overlaps the norm gradient".into());
                }
                let (lo, hi) = hgv.split_at_mut(lm_g.1);
                tm.head.loss_backward(
                    &hwv[nr.clone()],
                    &mut lo[nr],
                    &lw[lm_w.1..lm_w.1 + v * c],
                    &mut hi[..v * c],
                    &xv[..n * c],
                    &targets,
                    &mut dxv[..n * c],
                    grad_scale,
                    ws,
                )
            } else {
                let lgb = get(lm_g.0)?;
                let mut lgv = lgb.write()?;
                tm.head.loss_backward(
                    &hwv[nr.clone()],
                    &mut hgv[nr],
                    &lw[lm_w.1..lm_w.1 + v * c],
                    &mut lgv[lm_g.1..lm_g.1 + v * c],
                    &xv[..n * c],
                    &targets,
                    &mut dxv[..n * c],
                    grad_scale,
                    ws,
                )
            };
            *loss.lock().unwrap_or_else(|e| e.into_inner()) += s;
        }
        Kernel::EmbedBwd { g, tokens, dx } => {
            let (gb, dxb) = (get(g.0)?, get(dx)?);
            let (mut gv, dxv) = (gb.write()?, dxb.read()?);
            tm.embedding
                .backward(&mut gv[g.1..], &tokens, &dxv[..n * c]);
        }
    }
    Ok(())
}

impl Device for CpuDevice {
    fn name(&self) -> String {
        "cpu".into()
    }

    fn alloc(&self, len: usize, label: &str) -> Result<BufId> {
        let mut a = self.shared.arena.lock().unwrap_or_else(|e| e.into_inner());
        let bytes = 4 * len as u64;
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
            data: std::cell::UnsafeCell::new(vec![0.0f32; len]),
            state: std::sync::atomic::AtomicIsize::new(0),
            label: label.to_owned(),
            len,
        })));
        Ok(a.buffers.len() - 1)
    }

    fn free(&self, buf: BufId) {
        let mut a = self.shared.arena.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(slot) = a.buffers.get_mut(buf) {
            if let Some(b) = slot.take() {
                a.in_use -= 4 * b.len as u64;
            }
        }
    }

    fn submit(&self, stream: StreamKind, cmd: Cmd) {
        if self.senders[stream as usize].send(cmd).is_err() {
            self.shared
                .fail(format!("{} stream is gone", stream.name()));
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

    fn memory(&self) -> MemStats {
        let a = self.shared.arena.lock().unwrap_or_else(|e| e.into_inner());
        MemStats {
            in_use: a.in_use,
            peak: a.peak,
            capacity: self.shared.capacity,
        }
    }

    fn reset_peak(&self) {
        let mut a = self.shared.arena.lock().unwrap_or_else(|e| e.into_inner());
        a.peak = a.in_use;
    }

    fn take_records(&self) -> Vec<OpRecord> {
        std::mem::take(
            &mut *self
                .shared
                .records
                .lock()
                .unwrap_or_else(|e| e.into_inner()),
        )
    }

    fn epoch(&self) -> Instant {
        self.shared.epoch
    }

    fn take_error(&self) -> Option<String> {
        self.shared
            .error
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
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
