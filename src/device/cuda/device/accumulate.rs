//! Accumulating device→host copies (gradient accumulation): `dst += device` through two
//! page-locked bounce chunks in turn, the adds on their own stream as host functions split over
//! the host's cores, so one chunk's copy overlaps the previous chunk's add.

use super::{CudaDevice, Inner};
use crate::device::cuda::pinned::{host_fn, Pinned};
use crate::device::cuda::runtime::{drv, CudaRuntime, DevPtr};
use crate::Result;
use cudarc::driver::{CudaEvent, CudaStream};
use std::sync::Arc;

/// Elements per chunk of an accumulating device→host copy (a 16 MiB bounce chunk).
const ACCUM_CHUNK: usize = 4 << 20;
/// Bounce chunks of an accumulating copy: one fills while the other is added.
const ACCUM_BOUNCES: usize = 2;
/// Elements each worker adds at a time within a chunk.
const ACCUM_SLICE: usize = 64 << 10;

/// The accumulating copies' own stream and the events that pass each bounce chunk between it
/// and the copy-out stream: `filled[b]` after a chunk lands in bounce `b`, `freed[b]` after it
/// was added (re-recorded at each use: a wait takes the latest record).
#[derive(Debug)]
pub(super) struct Accumulate {
    pub(super) stream: Arc<CudaStream>,
    filled: [CudaEvent; ACCUM_BOUNCES],
    freed: [CudaEvent; ACCUM_BOUNCES],
}

impl Accumulate {
    pub(super) fn new(rt: &CudaRuntime) -> Result<Self> {
        let event = || drv(rt.ctx.new_event(None), "create an event");
        Ok(Accumulate {
            stream: drv(rt.ctx.new_stream(), "create the accumulate stream")?,
            filled: [event()?, event()?],
            freed: [event()?, event()?],
        })
    }
}

impl CudaDevice {
    /// `dst[..len] += device[from..]`, in order on `stream`: each chunk is copied into a
    /// page-locked bounce chunk (two in turn) on `stream` and added on the accumulate stream, so
    /// the next chunk's copy overlaps this one's add; `stream` then waits for the last add.
    pub(super) fn accumulate_dtoh(
        &self,
        g: &mut Inner,
        stream: &CudaStream,
        dst: *mut f32,
        from: DevPtr,
        len: usize,
    ) -> Result<()> {
        // The bounce chunks belong to the device alone (freed when the device drops, after its
        // streams are drained): a host function never holds one, so none can free page-locked
        // memory — a CUDA call — from inside the driver's callback.
        while g.bounces.len() < ACCUM_BOUNCES {
            g.bounces.push(Pinned::new(&self.rt.ctx, 4 * ACCUM_CHUNK)?);
        }
        #[derive(Clone, Copy)]
        struct Span(*mut f32, *const f32, usize);
        // SAFETY: the pointers stay valid until the host function runs: `dst` by the HostRef
        // contract, the bounce chunk because the device keeps it until its streams are drained.
        unsafe impl Send for Span {}
        let a = &self.accum;
        for at in (0..len).step_by(ACCUM_CHUNK) {
            let n = ACCUM_CHUNK.min(len - at);
            let b = g.next_bounce;
            g.next_bounce = (b + 1) % ACCUM_BOUNCES;
            let bounce = g.bounces[b].as_ptr().cast::<f32>();
            // The chunk's previous add must be done before the copy overwrites it (a wait on an
            // event never recorded returns at once).
            drv(stream.wait(&a.freed[b]), "wait for a bounce chunk")?;
            // SAFETY: the chunk holds ACCUM_CHUNK f32 and no add reads it any more (the wait).
            let r = unsafe {
                cudarc::driver::sys::cuMemcpyDtoHAsync_v2(
                    bounce.cast(),
                    from + 4 * at as u64,
                    4 * n,
                    stream.cu_stream(),
                )
            };
            drv(r.result(), "device to host copy (accumulate)")?;
            drv(a.filled[b].record(stream), "record a filled bounce chunk")?;
            drv(
                a.stream.wait(&a.filled[b]),
                "wait for a filled bounce chunk",
            )?;
            let span = Span(dst.wrapping_add(at), bounce, n);
            host_fn(&a.stream, move || {
                let span = span;
                // SAFETY: see `Span`; the copy into the bounce chunk completed (the wait).
                let (d, s) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(span.0, span.2),
                        std::slice::from_raw_parts(span.1, span.2),
                    )
                };
                add_parallel(d, s);
            })?;
            drv(a.freed[b].record(&a.stream), "record a freed bounce chunk")?;
        }
        // What `stream` does next (the command's end, a Record) follows the last add.
        let last = (g.next_bounce + ACCUM_BOUNCES - 1) % ACCUM_BOUNCES;
        drv(stream.wait(&a.freed[last]), "wait for the last add")
    }
}

/// `d += s`, split over the host's cores (rayon) in slices of [`ACCUM_SLICE`]: the add is
/// plain memory work, no CUDA call, so it may run inside a host function.
fn add_parallel(d: &mut [f32], s: &[f32]) {
    use rayon::prelude::*;
    d.par_chunks_mut(ACCUM_SLICE)
        .zip(s.par_chunks(ACCUM_SLICE))
        .for_each(|(d, s)| {
            for (a, b) in d.iter_mut().zip(s) {
                *a += *b;
            }
        });
}
