//! Device→host copies through two page-locked bounce chunks in turn, landed on the host by the
//! device's lander thread (split over the host's cores), so one chunk's copy overlaps the
//! previous chunk's landing:
//! - accumulating copies (gradient accumulation): `dst += device`;
//! - bf16 gradients on the link ([`GradLink::Bf16`]): each chunk is rounded to bf16 (nearest
//!   even) on the device, crosses as 2 B per element and is widened exactly into `dst` (`=` or
//!   `+=`).
//!
//! No CUDA host function is involved: a real driver runs every host function of a context on one
//! thread, so a landing there would hold up every other stream's host function, and work that
//! blocks (a thread pool busy with AdamW) would stall the streams behind it. Instead, for each
//! chunk the copy-out stream records an event after the copy and hands the chunk to the lander;
//! the lander waits for the event on its own thread, lands the chunk, and writes the chunk's
//! sequence number into a page-locked flag the GPU can read. Before the stream fills that chunk
//! again — and before anything after the copy — it waits for the flag
//! (`cuStreamWaitValue32`, `GEQ`): the GPU waits for the host, without the host waiting inside
//! the driver. Jobs land in order, one at a time, so the flags only grow.

use super::{CudaDevice, Inner};
use crate::device::cuda::launches::Launcher;
use crate::device::cuda::pinned::Pinned;
use crate::device::cuda::runtime::{drv, CudaRuntime, DevPtr};
use crate::device::{launch, GradLink, BOUNCE_CHUNK_ELEMS};
use crate::optim::adamw::bf16_to_f32;
use crate::{Error, Result};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Mutex};

/// Bounce chunks: one fills while the other lands.
pub(super) const BOUNCES: usize = 2;
/// Elements each worker lands at a time within a chunk.
const LAND_SLICE: usize = 64 << 10;

/// One chunk to land: wait for `copied`, then land `n` elements of the bounce chunk into `dst`,
/// then write `seq` into the chunk's flag.
struct Job {
    copied: CudaEvent,
    dst: *mut f32,
    src: *const u8,
    n: usize,
    landing: Landing,
    flag: *mut u32,
    seq: u32,
}

// SAFETY: the pointers stay valid until the job is done: `dst` by the HostRef contract (its
// owner waits for an event recorded after the flag this job writes), the bounce chunk and the
// flags because the device keeps them until its streams are drained and the lander has stopped.
unsafe impl Send for Job {}

/// How many chunks were handed to the lander and how many it has finished (landed, or given up
/// on after a failure, its flag written either way): what a failing device waits for before it
/// lets anyone release the memory the lander writes.
#[derive(Debug, Default)]
pub(super) struct Landings {
    counts: Mutex<(u64, u64)>,
    done: std::sync::Condvar,
}

impl Landings {
    fn sent(&self, n: i64) {
        let mut c = crate::util::lock(&self.counts);
        c.0 = c.0.saturating_add_signed(n);
    }

    fn landed(&self) {
        crate::util::lock(&self.counts).1 += 1;
        self.done.notify_all();
    }

    /// Wait until every chunk handed over is finished. Ends: the lander finishes every job it
    /// is given (it catches a panicking landing and writes the flag anyway).
    pub(super) fn wait_all(&self) {
        let mut c = crate::util::lock(&self.counts);
        while c.1 < c.0 {
            c = self.done.wait(c).unwrap_or_else(|e| e.into_inner());
        }
    }
}

/// The bounced copies' landing: the flags the GPU reads, the lander thread and its queue, and
/// the events the jobs are timed by (reused).
#[derive(Debug)]
pub(super) struct Bounce {
    /// One `u32` flag per bounce chunk (page-locked, device-mapped): the sequence number of its
    /// last landing.
    flags: Pinned,
    /// The flags' device address.
    flags_dev: DevPtr,
    jobs: Option<Sender<Job>>,
    lander: Option<std::thread::JoinHandle<()>>,
    /// Events done with, for the next jobs.
    events: Arc<Mutex<Vec<CudaEvent>>>,
    /// The first failure of the lander (a fault seen by its event wait), for the device to
    /// report.
    pub(super) failure: Arc<Mutex<Option<Error>>>,
    /// Chunks handed over and finished.
    pub(super) landings: Arc<Landings>,
}

impl Bounce {
    pub(super) fn new(rt: &CudaRuntime) -> Result<Self> {
        let (flags, flags_dev) = Pinned::mapped(&rt.ctx, 4 * BOUNCES)?;
        // SAFETY: `flags` holds BOUNCES u32s; nothing reads them yet.
        unsafe { std::ptr::write_bytes(flags.as_ptr(), 0, 4 * BOUNCES) };
        let (tx, rx) = channel::<Job>();
        let events = Arc::new(Mutex::new(Vec::new()));
        let failure = Arc::new(Mutex::new(None));
        let landings = Arc::new(Landings::default());
        let lander = {
            let (ctx, events, failure, landings) = (
                rt.ctx.clone(),
                events.clone(),
                failure.clone(),
                landings.clone(),
            );
            std::thread::Builder::new()
                .name("cuda-lander".into())
                .spawn(move || land_jobs(&ctx, &rx, (&events, &failure, &landings)))
                .map_err(|e| Error::system("std::thread", "spawn the CUDA lander", e))?
        };
        Ok(Bounce {
            flags,
            flags_dev,
            jobs: Some(tx),
            lander: Some(lander),
            events,
            failure,
            landings,
        })
    }

    /// Stop the lander once it has landed every job handed to it (the streams are drained
    /// first: a stream may be waiting for a flag it writes).
    pub(super) fn stop(&mut self) {
        self.jobs = None;
        if let Some(t) = self.lander.take() {
            let _ = t.join();
        }
    }

    /// The flag of bounce chunk `b`, on the host.
    fn flag(&self, b: usize) -> *mut u32 {
        self.flags.as_ptr().cast::<u32>().wrapping_add(b)
    }

    /// Hold `stream` until bounce chunk `b` has landed landing number `seq`.
    fn wait_landed(&self, stream: &CudaStream, b: usize, seq: u32) -> Result<()> {
        use cudarc::driver::sys;
        // SAFETY: the flag is device-mapped page-locked memory the device keeps; a GEQ wait
        // reads it until it is ≥ seq (the lander writes it, in order).
        let r = unsafe {
            sys::cuStreamWaitValue32_v2(
                stream.cu_stream(),
                self.flags_dev + 4 * b as u64,
                seq,
                sys::CUstreamWaitValue_flags::CU_STREAM_WAIT_VALUE_GEQ as u32,
            )
        };
        drv(r.result(), "wait for a bounce chunk's landing")
    }
}

impl Drop for Bounce {
    fn drop(&mut self) {
        self.stop();
    }
}

/// The lander thread: each job in order — wait for its copy (on this thread, not the driver's;
/// the event sleeps, `CU_EVENT_BLOCKING_SYNC`), land it, release its chunk. It never stops
/// releasing chunks: after a failure (a fault, a panicking landing) it records the error and
/// writes the flag anyway, so no stream waits forever, and counts the job finished.
fn land_jobs(
    ctx: &Arc<CudaContext>,
    jobs: &Receiver<Job>,
    (events, failure, landings): (&Mutex<Vec<CudaEvent>>, &Mutex<Option<Error>>, &Landings),
) {
    let bound = ctx.bind_to_thread();
    while let Ok(job) = jobs.recv() {
        let ok = match &bound {
            Ok(()) => job
                .copied
                .synchronize()
                .map_err(|e| Error::cuda("wait for a bounced copy", e)),
            Err(e) => Err(Error::cuda(
                "bind the context on the CUDA lander thread",
                *e,
            )),
        };
        let ok = ok.and_then(|()| {
            let (d, src, landing) = ((job.dst, job.n), job.src, job.landing);
            std::panic::catch_unwind(move || {
                // SAFETY: see `Job`; the copy into the bounce chunk completed (the event), and it
                // holds `n` elements of the link's format; nobody else touches either meanwhile
                // (the stream refills the chunk only after the flag below).
                unsafe {
                    match landing.link {
                        GradLink::Fp32 => land(d, src.cast::<f32>(), landing.accumulate, |x| x),
                        GradLink::Bf16 => {
                            land(d, src.cast::<u16>(), landing.accumulate, bf16_to_f32)
                        }
                    }
                }
            })
            .map_err(|_| Error::internal("CUDA lander", "a landing panicked"))
        });
        if let Err(e) = ok {
            crate::util::lock(failure).get_or_insert(e);
        }
        std::sync::atomic::fence(std::sync::atomic::Ordering::Release);
        // SAFETY: the flag is page-locked memory the device keeps until this thread stops; the
        // GPU only reads it.
        unsafe { std::ptr::write_volatile(job.flag, job.seq) };
        crate::util::lock(events).push(job.copied);
        landings.landed();
    }
}

/// What a bounced copy does with each chunk on the host.
#[derive(Debug, Clone, Copy)]
pub(super) struct Landing {
    /// `+=` into the destination (else `=`).
    pub(super) accumulate: bool,
    /// The elements' format on the link.
    pub(super) link: GradLink,
}

impl CudaDevice {
    /// Hold `stream` until the bounce chunk the next bounced copy fills has been landed.
    pub(super) fn wait_for_bounce(&self, g: &Inner, stream: &CudaStream) -> Result<()> {
        let b = g.next_bounce;
        self.bounce.wait_landed(stream, b, g.bounce_seq[b])
    }

    /// `dst[..len]` from `device[from..]` as `landing` says, in order on `stream`: each chunk is
    /// copied (under bf16, first rounded into the gradient staging) into a page-locked bounce
    /// chunk (two in turn) and landed by the lander, so the next chunk's copy overlaps this one's
    /// landing; `stream` then waits for the last landing.
    pub(super) fn bounce_dtoh(
        &self,
        g: &mut Inner,
        stream: &CudaStream,
        (dst, from, len): (*mut f32, DevPtr, usize),
        landing: Landing,
    ) -> Result<()> {
        let failed = crate::util::lock(&self.bounce.failure).take();
        if let Some(e) = failed {
            return Err(e);
        }
        // The bounce chunks belong to the device alone (freed when the device drops, after its
        // streams are drained and the lander has stopped).
        while g.bounces.len() < BOUNCES {
            g.bounces
                .push(Pinned::new(&self.rt.ctx, 4 * BOUNCE_CHUNK_ELEMS)?);
        }
        let jobs = self.bounce.jobs.as_ref().ok_or_else(|| {
            Error::internal("CUDA device", "a bounced copy after the lander stopped")
        })?;
        let elem = landing.link.elem_bytes() as usize;
        for at in (0..len).step_by(BOUNCE_CHUNK_ELEMS) {
            let n = BOUNCE_CHUNK_ELEMS.min(len - at);
            let b = g.next_bounce;
            g.next_bounce = (b + 1) % BOUNCES;
            let bounce = g.bounces[b].as_ptr();
            // The chunk's previous landing must be done before the copy overwrites it.
            self.bounce.wait_landed(stream, b, g.bounce_seq[b])?;
            let chunk = from + 4 * at as u64;
            let crossing = match landing.link {
                GradLink::Fp32 => chunk,
                GradLink::Bf16 => {
                    // Rounded into the staging; the next chunk's rounding follows this chunk's
                    // copy on the same stream.
                    let staging = match self.grad_staging {
                        Some((p, room)) if n <= room => p,
                        Some((_, room)) => {
                            return Err(Error::internal(
                                "CUDA device",
                                format!("{n} gradients for a bf16 staging of {room}"),
                            ))
                        }
                        None => {
                            return Err(Error::internal(
                                "CUDA device",
                                "bf16 gradients on an fp32 device",
                            ))
                        }
                    };
                    Launcher {
                        rt: &self.rt,
                        stream,
                    }
                    .cast_f32_bf16(
                        launch::elementwise(n, self.rt.sms),
                        staging,
                        chunk,
                        n as i64,
                    )?;
                    staging
                }
            };
            // SAFETY: the chunk holds 4·BOUNCE_CHUNK_ELEMS bytes ≥ elem·n, and no landing reads
            // it any more (the wait).
            let r = unsafe {
                cudarc::driver::sys::cuMemcpyDtoHAsync_v2(
                    bounce.cast(),
                    crossing,
                    elem * n,
                    stream.cu_stream(),
                )
            };
            drv(r.result(), "device to host copy (bounced)")?;
            // Blocking-sync events: the lander sleeps while it waits (an event without the flag
            // is waited for by spinning, whatever the context's scheduling).
            let pooled = crate::util::lock(&self.bounce.events).pop();
            let copied = match pooled {
                Some(e) => e,
                None => drv(
                    self.rt.ctx.new_event(Some(
                        cudarc::driver::sys::CUevent_flags::CU_EVENT_BLOCKING_SYNC,
                    )),
                    "create an event",
                )?,
            };
            drv(copied.record(stream), "record a filled bounce chunk")?;
            let seq = g.bounce_seq[b].wrapping_add(1);
            self.bounce.landings.sent(1);
            let job = Job {
                copied,
                dst: dst.wrapping_add(at),
                src: bounce.cast_const(),
                n,
                landing,
                flag: self.bounce.flag(b),
                seq,
            };
            if jobs.send(job).is_err() {
                self.bounce.landings.sent(-1);
                return Err(Error::internal(
                    "CUDA device",
                    "the lander thread has stopped",
                ));
            }
            // Counted only once handed over: a stream never waits for a landing nobody has.
            g.bounce_seq[b] = seq;
        }
        // What `stream` does next (the command's end, a Record) follows the last landing (the
        // lander lands in order, so every earlier one too).
        let last = (g.next_bounce + BOUNCES - 1) % BOUNCES;
        self.bounce.wait_landed(stream, last, g.bounce_seq[last])
    }
}

/// `d = widen(s)` or `d += widen(s)` over `n` elements, split over the host's cores (rayon) in
/// slices of [`LAND_SLICE`]. Runs on the lander thread, never inside the driver.
///
/// # Safety
/// `d` must point to `n` writable f32 and `s` to `n` readable `T`, neither touched by anyone
/// else while this runs.
unsafe fn land<T: Copy + Sync>(
    (d, n): (*mut f32, usize),
    s: *const T,
    accumulate: bool,
    widen: impl Fn(T) -> f32 + Sync,
) {
    use rayon::prelude::*;
    // SAFETY: the caller's contract.
    let (d, s) = unsafe {
        (
            std::slice::from_raw_parts_mut(d, n),
            std::slice::from_raw_parts(s, n),
        )
    };
    d.par_chunks_mut(LAND_SLICE)
        .zip(s.par_chunks(LAND_SLICE))
        .for_each(|(d, s)| {
            if accumulate {
                d.iter_mut().zip(s).for_each(|(a, b)| *a += widen(*b));
            } else {
                d.iter_mut().zip(s).for_each(|(a, b)| *a = widen(*b));
            }
        });
}
