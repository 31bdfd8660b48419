//! The copy commands: host → device (fp32, and a bf16 device's bf16 weights) and device →
//! host (a direct copy, or through the bounce chunks: [`super::bounce`]).

use super::bounce::Landing;
use super::{span, CudaDevice, Inner, Span};
use crate::device::cuda::runtime::drv;
use crate::device::{BufId, GradLink, HostRef};
use crate::{Error, Result};
use cudarc::driver::CudaStream;

impl CudaDevice {
    /// `dst.len()` elements of device buffer `src` from `offset` to `dst`, landing as
    /// `landing` says: a plain copy for fp32 `=`, else through the bounce chunks.
    pub(super) fn dtoh(
        &self,
        g: &mut Inner,
        stream: &CudaStream,
        (dst, src, offset): (&HostRef, BufId, usize),
        landing: Landing,
        label: &str,
    ) -> Result<Option<Span>> {
        let (p, len) = g.f32_buf(src, &format!("dtoh {label}"))?;
        crate::device::check_copy(&format!("dtoh {label}"), dst.len(), offset, src, len)?;
        let bytes = landing.link.elem_bytes() * dst.len() as u64;
        let bounced = landing.accumulate || landing.link == GradLink::Bf16;
        if bounced {
            // The timed span starts once its first bounce chunk is free: waiting for an earlier
            // copy's landing is not this copy's time.
            self.wait_for_bounce(g, stream)?;
        }
        let start = span(g, stream, format!("dtoh {label}"), bytes)?;
        let from = p + 4 * offset as u64;
        if bounced {
            self.bounce_dtoh(g, stream, (dst.as_ptr(), from, dst.len()), landing)?;
        } else {
            // SAFETY: as for HtoD; the destination is the HostRef's memory.
            let r = unsafe {
                cudarc::driver::sys::cuMemcpyDtoHAsync_v2(
                    dst.as_ptr().cast(),
                    from,
                    4 * dst.len(),
                    stream.cu_stream(),
                )
            };
            drv(r.result(), &format!("device to host copy of {label}"))?;
        }
        Ok(Some(start))
    }

    /// bf16 weights into bf16 weight buffer `dst` at `offset`: one copy, half the bytes of
    /// fp32, nothing widened (the kernels read bf16 weights).
    pub(super) fn htod_bf16(
        &self,
        g: &mut Inner,
        stream: &CudaStream,
        dst: BufId,
        offset: usize,
        src: &HostRef<u16>,
        label: &str,
    ) -> Result<Option<Span>> {
        let (p, len) = g.buf(dst)?;
        crate::device::check_copy(&format!("htod {label}"), src.len(), offset, dst, len)?;
        if !p.bf16 {
            return Err(Error::internal(
                "CUDA device",
                format!("{label}: bf16 weights into an fp32 buffer"),
            ));
        }
        let start = span(g, stream, format!("htod {label}"), 2 * src.len() as u64)?;
        // SAFETY: HostRef's contract keeps the source valid and unwritten until the stream's next
        // event fires; the destination range was checked (bf16 elements).
        let r = unsafe {
            cudarc::driver::sys::cuMemcpyHtoDAsync_v2(
                p.addr + 2 * offset as u64,
                src.as_ptr().cast_const().cast(),
                2 * src.len(),
                stream.cu_stream(),
            )
        };
        drv(r.result(), &format!("host to device copy of {label}"))?;
        Ok(Some(start))
    }
}

impl CudaDevice {
    /// `dst.len()` bf16 values of bf16 buffer `src` from `offset` to `dst`: one copy, 2 B per
    /// element, as stored.
    pub(super) fn dtoh_bf16(
        &self,
        g: &mut Inner,
        stream: &CudaStream,
        (dst, src, offset): (&HostRef<u16>, BufId, usize),
        label: &str,
    ) -> Result<Option<Span>> {
        let (p, len) = g.buf(src)?;
        crate::device::check_copy(&format!("dtoh {label}"), dst.len(), offset, src, len)?;
        if !p.bf16 {
            return Err(Error::internal(
                "CUDA device",
                format!("{label}: bf16 values out of an fp32 buffer"),
            ));
        }
        let start = span(g, stream, format!("dtoh {label}"), 2 * dst.len() as u64)?;
        // SAFETY: HostRef's contract keeps the destination valid and untouched until the
        // stream's next event fires; the source range was checked (bf16 elements).
        let r = unsafe {
            cudarc::driver::sys::cuMemcpyDtoHAsync_v2(
                dst.as_ptr().cast(),
                p.addr + 2 * offset as u64,
                2 * dst.len(),
                stream.cu_stream(),
            )
        };
        drv(r.result(), &format!("device to host copy of {label}"))?;
        Ok(Some(start))
    }
}

/// `src` into device buffer `dst` at element `offset`.
pub(super) fn htod(
    g: &mut Inner,
    stream: &CudaStream,
    dst: BufId,
    offset: usize,
    src: &HostRef,
    label: &str,
) -> Result<Option<Span>> {
    let (p, len) = g.f32_buf(dst, &format!("htod {label}"))?;
    crate::device::check_copy(&format!("htod {label}"), src.len(), offset, dst, len)?;
    let start = span(g, stream, format!("htod {label}"), 4 * src.len() as u64)?;
    // SAFETY: HostRef's contract keeps the source valid and unwritten until the stream's next
    // event fires; the destination range was checked.
    let r = unsafe {
        cudarc::driver::sys::cuMemcpyHtoDAsync_v2(
            p + 4 * offset as u64,
            src.as_ptr().cast_const().cast(),
            4 * src.len(),
            stream.cu_stream(),
        )
    };
    drv(r.result(), &format!("host to device copy of {label}"))?;
    Ok(Some(start))
}
