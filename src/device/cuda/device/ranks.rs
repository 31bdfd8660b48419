//! The GPUs of a data-parallel job, connected: an NCCL communicator (rank 0's unique id sent to
//! the others through the job's collectives: MPI's, or NCCL's under torchrun) and the broadcast ZeRO stage 3 gathers params with.

use super::{span, CudaDevice, Inner, Span};
use crate::device::cuda::drv;
use crate::device::cuda::nccl::{unique_id, unique_id_from, unique_id_message, NcclComm};
use crate::device::BufId;
use crate::dist::Collective;
use crate::util::lock;
use crate::{Error, Result};
use cudarc::driver::{CudaContext, CudaStream};
use std::sync::Arc;

/// Join the job's NCCL communicator on `ctx`'s GPU (every rank calls it, in the same place).
pub(super) fn join(ctx: &Arc<CudaContext>, world: &dyn Collective) -> Result<NcclComm> {
    let made = match world.rank() {
        0 => unique_id(),
        _ => Ok([0; 128]),
    };
    let all = world.all_gather_bytes(&unique_id_message(&made))?;
    let id = unique_id_from(all.first().map_or(&[][..], Vec::as_slice), world.rank())?;
    let comm = NcclComm::join(ctx, id, world.rank(), world.size())?;
    check_reached(ctx, &comm)?;
    Ok(comm)
}

/// One all-reduce of a 1 from every rank, waited for: every GPU reached the communicator (NCCL
/// connects its peers at the first collective: here, where every rank is known to be, rather
/// than inside a step), and the sum is the rank count.
fn check_reached(ctx: &Arc<CudaContext>, comm: &NcclComm) -> Result<()> {
    let stream = drv(ctx.new_stream(), "create a stream")?;
    let one = drv(stream.clone_htod(&[1.0f32]), "copy to the GPU")?;
    let mut sum = drv(stream.alloc_zeros::<f32>(1), "allocate on the GPU")?;
    comm.all_reduce_sum(&one, &mut sum, &stream)?;
    let got = drv(stream.clone_dtoh(&sum), "copy the sum to the host")?;
    match got.first() {
        Some(&s) if s == comm.size() as f32 => Ok(()),
        other => Err(Error::system(
            "NCCL",
            format!(
                "rank {}: a first all-reduce of 1 from every rank",
                comm.rank()
            ),
            format!("it summed to {other:?}, not {}", comm.size()),
        )),
    }
}

impl CudaDevice {
    /// Rank `root`'s first `len` elements of `buf` into every rank's, in place on `stream`.
    pub(super) fn broadcast(
        &self,
        g: &mut Inner,
        stream: &CudaStream,
        (buf, len, root): (BufId, usize, usize),
        label: &str,
    ) -> Result<Option<Span>> {
        let (p, have) = g.buf(buf)?;
        crate::device::check_copy(&format!("broadcast {label}"), len, 0, buf, have)?;
        let bytes = len * if p.bf16 { 2 } else { 4 };
        let ranks = lock(&self.ranks);
        let comm = ranks.as_ref().ok_or_else(|| {
            Error::internal(
                "CUDA device",
                format!(
                    "broadcast {label}: the GPU joined no other ranks' (CudaDeviceConfig::ranks)"
                ),
            )
        })?;
        let start = span(
            g,
            stream,
            format!("{}{label}", crate::device::BROADCAST_RECORD),
            bytes as u64,
        )?;
        // SAFETY: the range was checked against the buffer; the schedule orders the buffer's
        // other users around this command with events (it is a copy into the buffer).
        unsafe { comm.broadcast_bytes(p.addr, bytes, root, stream)? };
        Ok(Some(start))
    }
}
