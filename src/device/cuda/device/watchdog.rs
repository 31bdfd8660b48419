//! What the submitting thread and the watchdog share, and the watchdog thread: it signals each
//! host event once its CUDA event has completed (`cuEventQuery`, no host function per event),
//! and looks for asynchronous faults; a failure drains the streams and waits for the lander
//! before anything waiting on the device is released.

use super::bounce;
use super::Inner;
use crate::device::{Event, StreamKind};
use crate::util::lock;
use crate::{Error, Result};
use cudarc::driver::{CudaContext, CudaEvent, CudaStream};
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex};
use std::time::Instant;

/// A host event's CUDA event. Cross-stream order always goes through the CUDA event
/// (`cuStreamWaitEvent`), never through "the host event already fired": the driver then
/// orders the streams itself, and a checker of stream order (the CUDA emulator) sees every
/// edge. `done` is set only by the submitting thread's own `cuEventQuery`, so a wait it then
/// skips is one that thread has observed completed.
#[derive(Debug)]
pub(super) struct Recorded {
    pub(super) event: Event,
    pub(super) cuda: Arc<CudaEvent>,
    pub(super) done: bool,
}

/// Whether `e` completed (`cuEventQuery`); an asynchronous fault is an error.
pub(super) fn completed(e: &CudaEvent) -> Result<bool> {
    // SAFETY: a live event.
    match unsafe { cudarc::driver::result::event::query(e.cu_event()) } {
        Ok(()) => Ok(true),
        Err(x) if x.0 == cudarc::driver::sys::CUresult::CUDA_ERROR_NOT_READY => Ok(false),
        Err(x) => Err(Error::cuda("run the step (an asynchronous fault)", x)),
    }
}

/// What the submitting thread and the watchdog share.
#[derive(Debug)]
pub(super) struct Shared {
    pub(super) inner: Mutex<Inner>,
    pub(super) error: Mutex<Option<Error>>,
    /// The device's streams (copy-in, compute, copy-out), drained before anything waiting on
    /// them is released.
    pub(super) streams: [Arc<CudaStream>; 3],
    /// The lander's first failure ([`bounce`]), which the watchdog turns into the device's.
    pub(super) lander_failure: Arc<Mutex<Option<Error>>>,
    /// The lander's chunks handed over and finished: a failing device waits for every one
    /// before it releases anyone's memory (the lander writes into the host's gradients).
    pub(super) landings: Arc<bounce::Landings>,
    /// Host events whose CUDA event has not completed yet, in record order, with their stream:
    /// the poller signals each when its `cuEventQuery` succeeds (no host function per event).
    /// Locked after `inner`, never before it.
    pub(super) pending: Mutex<Vec<(StreamKind, Arc<CudaEvent>, Event)>>,
    /// Wakes the poller when `pending` gains an event.
    pub(super) wake: std::sync::Condvar,
}

impl Shared {
    pub(super) fn lock(&self) -> std::sync::MutexGuard<'_, Inner> {
        lock(&self.inner)
    }

    /// Keep the first error, and fire every host event still pending: a stream that failed
    /// never reaches them, and the host must not wait forever (it reads the error next).
    /// Call without the `inner` lock held.
    ///
    /// The streams are drained first: until the work already queued has finished (or the
    /// context has failed, which stops it), the host must not treat buffers the GPU still reads
    /// or writes as free — firing the events early would let it reuse or release them under a
    /// copy in flight. After a failure nothing new is enqueued ([`CudaDevice::submit`]).
    pub(super) fn fail(&self, e: Error) {
        {
            let mut first = lock(&self.error);
            if first.is_none() {
                *first = Some(e);
            }
        }
        self.drain();
        // A faulted context returns from the drain at once, and a bounced copy that failed half
        // way never waited for its landings: the lander may still be writing into the host's
        // gradients, which the events below let their owner release.
        self.landings.wait_all();
        for r in self.lock().recorded.drain(..) {
            r.event.signal();
        }
    }

    /// Wait for everything queued on the streams (a failed context returns at once).
    pub(super) fn drain(&self) {
        for s in &self.streams {
            let _ = s.synchronize();
        }
    }

    pub(super) fn failed(&self) -> bool {
        lock(&self.error).is_some()
    }

    /// Signal every pending host event whose CUDA event has completed. A stream's events
    /// complete in its order, so each stream's are queried only up to its first incomplete one.
    /// Returns the first fault seen, how many were signalled, and how many are still pending.
    pub(super) fn signal_completed(&self) -> (Option<Error>, usize, usize) {
        let mut fault = None;
        let mut blocked = [false; 3];
        let mut pending = lock(&self.pending);
        let before = pending.len();
        pending.retain(|(kind, cuda, event)| {
            if blocked[*kind as usize] {
                return true;
            }
            match completed(cuda) {
                Ok(true) => {
                    event.signal();
                    false
                }
                Ok(false) => {
                    blocked[*kind as usize] = true;
                    true
                }
                Err(e) => {
                    fault.get_or_insert(e);
                    blocked[*kind as usize] = true;
                    true
                }
            }
        });
        (fault, before - pending.len(), pending.len())
    }

    /// Look for an asynchronous fault (a kernel's illegal address, …): it surfaces as an error
    /// from querying any pending event.
    pub(super) fn check(&self) {
        // Taken first, its lock released: `fail` waits for the lander, which may need it.
        let lander = lock(&self.lander_failure).take();
        if let Some(e) = lander {
            self.fail(e);
            return;
        }
        // A fault is sticky: every later query reports it, so the oldest pending event is
        // enough (and keeps the lock short). The watchdog only looks; it prunes nothing (what it
        // observes, the submitting thread has not).
        let fault = {
            let g = self.lock();
            g.recorded
                .iter()
                .find(|r| !r.done)
                .and_then(|r| completed(&r.cuda).err())
        };
        if let Some(e) = fault {
            self.fail(e);
        }
    }
}

/// How often the watchdog looks for asynchronous faults (and waits, idle, for a new event).
const WATCHDOG: std::time::Duration = std::time::Duration::from_millis(20);
/// How often it queries pending events while some are outstanding: every POLL after an event
/// completed, backing off by doubling to POLL_MAX while none does (a long kernel costs a few
/// hundred queries a second, not tens of thousands).
const POLL: std::time::Duration = std::time::Duration::from_micros(20);
const POLL_MAX: std::time::Duration = std::time::Duration::from_millis(1);

/// Start the watchdog thread on `shared`, until `stop`.
pub(super) fn spawn(
    shared: Arc<Shared>,
    stop: Arc<AtomicBool>,
    ctx: Arc<CudaContext>,
) -> Result<std::thread::JoinHandle<()>> {
    std::thread::Builder::new()
        .name("cuda-watchdog".into())
        .spawn(move || {
        // Without its context the watchdog cannot see a fault, and the first one
        // would leave the streamer waiting forever: the device fails instead.
        if let Err(e) = ctx.bind_to_thread() {
            shared.fail(
                Error::cuda("bind the context on the CUDA watchdog thread", e)
                    .with_fix("check the GPU with nvidia-smi; the driver refused a context it had just created"),
            );
            return;
        }
        // The poller: signals host events as their CUDA events complete, and looks
        // for faults every WATCHDOG.
        let (mut checked, mut nap) = (Instant::now(), POLL);
        while !stop.load(std::sync::atomic::Ordering::Acquire) {
            let (fault, signalled, left) = shared.signal_completed();
            if let Some(e) = fault {
                shared.fail(e);
            }
            if checked.elapsed() >= WATCHDOG {
                shared.check();
                checked = Instant::now();
            }
            nap = if signalled > 0 { POLL } else { (nap * 2).min(POLL_MAX) };
            if left == 0 {
                nap = POLL;
                let pending = lock(&shared.pending);
                if pending.is_empty() {
                    let _ = shared.wake.wait_timeout(pending, WATCHDOG);
                }
            } else {
                std::thread::sleep(nap);
            }
        }
        })
        .map_err(|e| Error::system("std::thread", "spawn the CUDA watchdog", e))
}
