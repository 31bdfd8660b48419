//! Token ids and positions on the device: a device buffer refilled from the host through a ring
//! of page-locked bounce buffers, in stream order.

use super::super::pinned::Pinned;
use super::super::runtime::{drv, CudaRuntime, DevPtr};
use crate::{Error, Result};
use cudarc::driver::{CudaEvent, CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;

/// Page-locked bounce buffers per [`IdsBuffer`]: the host may run this many uploads ahead of
/// the stream before it waits for the oldest one to have left its buffer.
const ID_BOUNCES: usize = 4;

/// A device buffer of u32 ids filled from the host through a ring of page-locked bounce
/// buffers, in the stream's order. The device buffer is rewritten in stream order (after the
/// kernels that read the previous ids); a bounce buffer only once its last copy has run.
#[derive(Debug)]
pub(super) struct IdsBuffer {
    dev: CudaSlice<u32>,
    bounce: Vec<Pinned>,
    /// Per bounce buffer, the event after its last copy.
    copied: Vec<Option<CudaEvent>>,
    next: usize,
}

impl IdsBuffer {
    /// Room for `n` ids.
    pub(super) fn new(rt: &CudaRuntime, stream: &Arc<CudaStream>, n: usize) -> Result<Self> {
        Ok(IdsBuffer {
            dev: drv(
                stream.alloc_zeros::<u32>(n.max(1)),
                "allocate the token ids",
            )?,
            bounce: (0..ID_BOUNCES)
                .map(|_| Pinned::new(&rt.ctx, 4 * n.max(1)))
                .collect::<Result<_>>()?,
            copied: (0..ID_BOUNCES).map(|_| None).collect(),
            next: 0,
        })
    }

    pub(super) fn device_ptr(&self, stream: &Arc<CudaStream>) -> DevPtr {
        self.dev.device_ptr(stream).0
    }

    /// Copy `ids` in after everything already on `stream`; `what` names them in errors.
    pub(super) fn upload(
        &mut self,
        stream: &Arc<CudaStream>,
        ids: &[u32],
        what: &str,
    ) -> Result<DevPtr> {
        let k = self.next;
        self.next = (k + 1) % ID_BOUNCES;
        let bounce = &self.bounce[k];
        if 4 * ids.len() > bounce.bytes() {
            return Err(Error::internal(
                "CUDA backend",
                format!(
                    "{} {what} for a buffer of {}",
                    ids.len(),
                    bounce.bytes() / 4
                ),
            ));
        }
        // This bounce buffer's last upload must have left it before it is rewritten (the
        // host waits only when it runs ID_BOUNCES uploads ahead of the stream).
        if let Some(e) = self.copied[k].take() {
            drv(
                e.synchronize(),
                &format!("wait for an earlier upload of {what}"),
            )?;
        }
        // SAFETY: the bounce buffer holds ≥ ids.len() u32 (checked) and no copy reads it now.
        unsafe {
            std::ptr::copy_nonoverlapping(ids.as_ptr(), bounce.as_ptr().cast::<u32>(), ids.len())
        };
        let dst = self.device_ptr(stream);
        // SAFETY: page-locked source and a device buffer both of ≥ 4·len bytes.
        let r = unsafe {
            cudarc::driver::sys::cuMemcpyHtoDAsync_v2(
                dst,
                bounce.as_ptr().cast(),
                4 * ids.len(),
                stream.cu_stream(),
            )
        };
        drv(r.result(), &format!("host to device copy of {what}"))?;
        self.copied[k] = Some(drv(
            stream.record_event(None),
            &format!("record the upload of {what}"),
        )?);
        Ok(dst)
    }
}
