//! Device→host copies through two page-locked bounce chunks in turn, finished on the host by a
//! host function on their own stream (split over the host's cores), so one chunk's copy overlaps
//! the previous chunk's landing:
//! - accumulating copies (gradient accumulation): `dst += device`;
//! - bf16 gradients on the link ([`GradLink::Bf16`]): each chunk is rounded to bf16 (nearest
//!   even) on the device, crosses as 2 B per element and is widened exactly into `dst` (`=` or
//!   `+=`).

use super::{CudaDevice, Inner};
use crate::device::cuda::launches::Launcher;
use crate::device::cuda::pinned::{host_fn, Pinned};
use crate::device::cuda::runtime::{drv, CudaRuntime, DevPtr};
use crate::device::{launch, GradLink, BOUNCE_CHUNK_ELEMS};
use crate::optim::adamw::bf16_to_f32;
use crate::{Error, Result};
use cudarc::driver::{CudaEvent, CudaStream};
use std::sync::Arc;

/// Bounce chunks: one fills while the other lands.
const BOUNCES: usize = 2;
/// Elements each worker lands at a time within a chunk.
const LAND_SLICE: usize = 64 << 10;

/// The bounced copies' own stream and the events that pass each bounce chunk between it and the
/// copy-out stream: `filled[b]` after a chunk lands in bounce `b`, `freed[b]` after it was
/// landed on the host (re-recorded at each use: a wait takes the latest record).
#[derive(Debug)]
pub(super) struct Bounce {
    pub(super) stream: Arc<CudaStream>,
    filled: [CudaEvent; BOUNCES],
    freed: [CudaEvent; BOUNCES],
}

impl Bounce {
    pub(super) fn new(rt: &CudaRuntime) -> Result<Self> {
        let event = || drv(rt.ctx.new_event(None), "create an event");
        Ok(Bounce {
            stream: drv(rt.ctx.new_stream(), "create the bounce stream")?,
            filled: [event()?, event()?],
            freed: [event()?, event()?],
        })
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
        drv(
            stream.wait(&self.bounce.freed[g.next_bounce]),
            "wait for a bounce chunk",
        )
    }

    /// `dst[..len]` from `device[from..]` as `landing` says, in order on `stream`: each chunk is
    /// copied (under bf16, first rounded into the gradient staging) into a page-locked bounce
    /// chunk (two in turn) on `stream` and landed on the bounce stream, so the next chunk's copy
    /// overlaps this one's landing; `stream` then waits for the last landing.
    pub(super) fn bounce_dtoh(
        &self,
        g: &mut Inner,
        stream: &CudaStream,
        (dst, from, len): (*mut f32, DevPtr, usize),
        landing: Landing,
    ) -> Result<()> {
        // The bounce chunks belong to the device alone (freed when the device drops, after its
        // streams are drained): a host function never holds one, so none can free page-locked
        // memory — a CUDA call — from inside the driver's callback.
        while g.bounces.len() < BOUNCES {
            g.bounces
                .push(Pinned::new(&self.rt.ctx, 4 * BOUNCE_CHUNK_ELEMS)?);
        }
        let elem = landing.link.elem_bytes() as usize;
        #[derive(Clone, Copy)]
        struct Span(*mut f32, *const u8, usize);
        // SAFETY: the pointers stay valid until the host function runs: `dst` by the HostRef
        // contract, the bounce chunk because the device keeps it until its streams are drained.
        unsafe impl Send for Span {}
        let a = &self.bounce;
        for at in (0..len).step_by(BOUNCE_CHUNK_ELEMS) {
            let n = BOUNCE_CHUNK_ELEMS.min(len - at);
            let b = g.next_bounce;
            g.next_bounce = (b + 1) % BOUNCES;
            let bounce = g.bounces[b].as_ptr();
            // The chunk's previous landing must be done before the copy overwrites it (a wait
            // on an event never recorded returns at once).
            drv(stream.wait(&a.freed[b]), "wait for a bounce chunk")?;
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
            drv(a.filled[b].record(stream), "record a filled bounce chunk")?;
            drv(
                a.stream.wait(&a.filled[b]),
                "wait for a filled bounce chunk",
            )?;
            let span = Span(dst.wrapping_add(at), bounce.cast_const(), n);
            host_fn(&a.stream, move || {
                let span = span;
                let d = (span.0, span.2);
                // SAFETY: see `Span`; the copy into the bounce chunk completed (the wait), and
                // it holds `n` elements of the link's format.
                unsafe {
                    match landing.link {
                        GradLink::Fp32 => land(d, span.1.cast::<f32>(), landing.accumulate, |x| x),
                        GradLink::Bf16 => {
                            land(d, span.1.cast::<u16>(), landing.accumulate, bf16_to_f32)
                        }
                    }
                }
            })?;
            drv(a.freed[b].record(&a.stream), "record a freed bounce chunk")?;
        }
        // What `stream` does next (the command's end, a Record) follows the last landing.
        let last = (g.next_bounce + BOUNCES - 1) % BOUNCES;
        drv(stream.wait(&a.freed[last]), "wait for the last landing")
    }
}

/// `d = widen(s)` or `d += widen(s)` over `n` elements, split over the host's cores (rayon) in
/// slices of [`LAND_SLICE`]: plain memory work, no CUDA call, so it may run inside a host
/// function.
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
