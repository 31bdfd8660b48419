//! The collectives of a job `torchrun` started, over NCCL between the ranks' GPUs.
//!
//! `torchrun` starts one process per GPU without MPI. Such a job meets at the launcher's store
//! ([`crate::dist::store`]): every rank says its host there, rank 0 puts its NCCL unique id
//! there, and every rank joins the communicator on its GPU (the i-th rank of a host on visible
//! GPU i mod their count: torchrun's `cuda:LOCAL_RANK` where ranks fill hosts in order). From
//! then on every collective of [`crate::dist::Collective`] is NCCL's, the host buffers staged
//! through the GPU a part at a time (`CHUNK / N` bytes from each of the N ranks):
//! - `sum_f32` all-gathers every rank's part and adds the parts on the host in rank order,
//!   `((x₀ + x₁) + x₂) + …`: the same bits as the MPI world's sum and as one process
//!   accumulating N micro-batches, whatever algorithm NCCL picks. Each rank receives N times
//!   its buffer where a ring all-reduce moves about 2 times: NCCL's own reductions are not in
//!   rank order, and the all-to-all of the MPI world's scheme would take NCCL's point-to-point
//!   calls, which the CUDA emulator does not run (so nothing here could test them);
//! - `all_gather_bytes` and `sum_f64` are all-gathers, `broadcast_bytes` NCCL's broadcast;
//! - `send_bytes`/`recv_bytes` (rank 0 writing a checkpoint for ranks that do not see its
//!   directory) are refused with the reason.
//!
//! The staging buffers sit on each GPU beside `--device-memory`: [`CHUNK`] bytes to receive
//! and `CHUNK / N` to send, whatever N.

use super::nccl::{unique_id, unique_id_from, unique_id_message, NcclComm};
use super::{drv, CudaRuntime};
use crate::dist::store::{Store, StoreAddress};
use crate::dist::{
    sum_in_rank_order, totals_in_rank_order, Collective, HostShare, Launch, StallWatch,
};
use crate::{Error, Result};
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr, DevicePtrMut, DeviceRepr};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// Bytes every rank's parts of one exchange take together, on each GPU and host.
const CHUNK: usize = 4 << 20;

/// How long a rank waits at the store for the others (torch's default store timeout).
const STORE_TIMEOUT: Duration = Duration::from_secs(300);

/// The GPU side of the staging: the communicator and its buffers.
struct Gpu {
    comm: NcclComm,
    rt: CudaRuntime,
    /// [`Gpu::part`] bytes: this rank's part.
    send: CudaSlice<u8>,
    /// N × [`Gpu::part`] bytes: every rank's part (a broadcast's piece).
    recv: CudaSlice<u8>,
    /// The bytes of one rank's part: `CHUNK / N`, whole f64s.
    part: usize,
}

/// What every collective holds: the GPU side, and every rank's parts of a sum on the host.
struct Staging {
    gpu: Gpu,
    /// N × [`Gpu::part`] bytes, as f32.
    parts: Vec<f32>,
}

/// A torchrun job's world: NCCL between its GPUs, met through the launcher's store.
pub struct NcclWorld {
    rank: usize,
    size: usize,
    host: String,
    hosts: Vec<String>,
    /// What [`Collective::library`] says.
    library: String,
    staging: Mutex<Staging>,
    busy: StallWatch,
}

impl std::fmt::Debug for NcclWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "NcclWorld(rank {} of {} on {})",
            self.rank, self.size, self.host
        )
    }
}

/// Join the job torchrun started (`launch`): meet at its store, open this rank's GPU, join the
/// NCCL communicator rank 0 made.
pub fn join_torchrun(launch: &Launch) -> Result<Arc<dyn Collective>> {
    let (rank, size) = (launch.rank, launch.size);
    let address = StoreAddress::from_env()?;
    let mut store = Store::connect(&address, STORE_TIMEOUT)?;
    let host = crate::dist::hostname();
    store.set(&format!("host/{rank}"), host.as_bytes())?;
    let keys: Vec<String> = (0..size).map(|r| format!("host/{r}")).collect();
    let hosts: Vec<String> = store
        .get_all(&keys)?
        .iter()
        .map(|h| String::from_utf8_lossy(h).into_owned())
        .collect();
    let rt = CudaRuntime::visible_gpus().and_then(|gpus| {
        if gpus.is_empty() {
            return Err(Error::bad_input(
                "GPU",
                format!("rank {rank} on {host}"),
                "the driver sees no GPU: torchrun's ranks reach each other through NCCL, one GPU each",
                Some("check nvidia-smi and CUDA_VISIBLE_DEVICES; start ranks on the CPU device with mpirun or srun"),
            ));
        }
        CudaRuntime::open_context(HostShare::among(&hosts, rank).gpu(gpus.len()))
    });
    if rank == 0 {
        let made = match &rt {
            Ok(_) => unique_id(),
            Err(e) => Err(Error::system(
                "CUDA",
                "rank 0 opening its GPU for NCCL",
                e.to_string(),
            )),
        };
        store.set("nccl-id", &unique_id_message(&made))?;
    }
    let rt = rt?;
    let id = unique_id_from(&store.get("nccl-id")?, rank)?;
    drop(store);
    let comm = NcclComm::join(&rt.ctx, id, rank, size)?;
    let part = (CHUNK / size / 8 * 8).max(8);
    let alloc = |n: usize| {
        drv(
            rt.stream.alloc_zeros::<u8>(n),
            "allocate NCCL's staging buffers",
        )
    };
    let (send, recv) = (alloc(part)?, alloc(part * size)?);
    let library = format!("{:?}, met at torchrun's store {address}", comm.library());
    let world = NcclWorld {
        rank,
        size,
        host,
        hosts,
        library,
        staging: Mutex::new(Staging {
            gpu: Gpu {
                comm,
                rt,
                send,
                recv,
                part,
            },
            parts: vec![0.0; part / 4 * size],
        }),
        busy: StallWatch::default(),
    };
    // Every GPU reached the communicator (NCCL connects its peers at the first collective).
    let mut one = [1.0f64];
    world.sum_f64(&mut one)?;
    if one[0] != size as f64 {
        return Err(Error::system(
            "NCCL",
            format!("rank {rank}: a first sum of 1 from every rank"),
            format!("it summed to {}, not {size}", one[0]),
        ));
    }
    Ok(Arc::new(world))
}

/// Waits for the stream when dropped: no copy from or into a caller's buffer (page-locked
/// ones are copied asynchronously) outlives the call, an early return on an error included.
struct Drained<'a>(&'a CudaStream);

impl Drop for Drained<'_> {
    fn drop(&mut self) {
        // A failed wait leaves the context failed, which the next call reports.
        let _ = self.0.synchronize();
    }
}

impl Gpu {
    /// The elements of `T` in one rank's part.
    fn fits<T>(&self) -> usize {
        self.part / std::mem::size_of::<T>()
    }

    /// Every rank's `part` (at most [`Gpu::part`] bytes, as long on every rank) into `out`, in
    /// rank order (`out` holds N parts), through the GPU; waited for.
    fn all_gather<T: DeviceRepr>(&mut self, part: &[T], out: &mut [T]) -> Result<()> {
        let bytes = std::mem::size_of_val(part);
        if bytes > self.part || out.len() != part.len() * self.comm.size() {
            return Err(Error::internal(
                "NCCL world",
                format!("an all-gather of {bytes} bytes into {} elements", out.len()),
            ));
        }
        let stream = self.rt.stream.clone();
        let raw = stream.cu_stream();
        let _drained = Drained(&stream);
        let (s, _gs) = self.send.device_ptr(&stream);
        let (r, _gr) = self.recv.device_ptr_mut(&stream);
        // SAFETY: `send` holds `self.part` ≥ `bytes` bytes; `part` stays borrowed until the
        // stream is drained (`_drained`, on every return).
        let copied = unsafe { cudarc::driver::result::memcpy_htod_async(s, part, raw) };
        drv(copied, "copy a part to the GPU")?;
        // SAFETY: `send` holds `bytes`, `recv` N × `self.part` ≥ N × `bytes` bytes of this
        // communicator's GPU, used by nothing else (the staging lock is held).
        unsafe { self.comm.all_gather_raw(s, r, bytes, &stream)? };
        // SAFETY: `out` is N × `bytes` bytes, as many as the all-gather wrote at `r`; it stays
        // borrowed until the stream is drained.
        let copied = unsafe { cudarc::driver::result::memcpy_dtoh_async(out, r, raw) };
        drv(copied, "copy the parts from the GPU")?;
        drv(stream.synchronize(), "wait for NCCL's all-gather")
    }
}

impl NcclWorld {
    /// Hold the staging for collective `what`, marked busy (for the watchdog).
    fn enter(&self, what: &'static str) -> Busy<'_> {
        let staging = crate::util::lock(&self.staging);
        self.busy.set(Some(what));
        Busy {
            busy: &self.busy,
            staging,
        }
    }
}

/// A collective in progress: the staging held, the watchdog told.
struct Busy<'a> {
    busy: &'a StallWatch,
    staging: std::sync::MutexGuard<'a, Staging>,
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.busy.set(None);
    }
}

impl Collective for NcclWorld {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn host(&self) -> &str {
        &self.host
    }
    fn hosts(&self) -> &[String] {
        &self.hosts
    }

    fn sum_f32(&self, buf: &mut [f32]) -> Result<()> {
        let mut b = self.enter("the gradients' sum");
        let Staging { gpu, parts } = &mut *b.staging;
        for part in buf.chunks_mut(gpu.fits::<f32>()) {
            let n = part.len();
            let all = &mut parts[..n * self.size];
            gpu.all_gather(part, all)?;
            let each: Vec<&[f32]> = all.chunks_exact(n).collect();
            sum_in_rank_order(&each, part);
        }
        Ok(())
    }

    fn sum_f64(&self, buf: &mut [f64]) -> Result<()> {
        let mut b = self.enter("a step's totals");
        let gpu = &mut b.staging.gpu;
        for part in buf.chunks_mut(gpu.fits::<f64>()) {
            let n = part.len();
            let mut all = vec![0.0f64; n * self.size];
            gpu.all_gather(part, &mut all)?;
            totals_in_rank_order(&all, part);
        }
        Ok(())
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        let mut b = self.enter("an exchange of settings");
        let gpu = &mut b.staging.gpu;
        let mut lens = vec![0u64; self.size];
        gpu.all_gather(&[bytes.len() as u64], &mut lens)?;
        let longest = lens.iter().copied().max().unwrap_or(0) as usize;
        let mut out: Vec<Vec<u8>> = lens.iter().map(|_| Vec::new()).collect();
        let mut at = 0usize;
        while at < longest {
            let m = gpu.part.min(longest - at);
            let mut mine = vec![0u8; m];
            // A shorter message than the longest sends zeros once it has ended.
            let rest = bytes.get(at..).unwrap_or_default();
            let have = rest.len().min(m);
            mine[..have].copy_from_slice(&rest[..have]);
            let mut all = vec![0u8; m * self.size];
            gpu.all_gather(&mine, &mut all)?;
            for ((o, &len), theirs) in out.iter_mut().zip(&lens).zip(all.chunks_exact(m)) {
                let keep = (len as usize).saturating_sub(at).min(m);
                o.extend_from_slice(&theirs[..keep]);
            }
            at += m;
        }
        Ok(out)
    }

    fn broadcast_bytes(&self, root: usize, buf: &mut [u8]) -> Result<()> {
        let mut b = self.enter("a broadcast");
        let gpu = &mut b.staging.gpu;
        let stream = gpu.rt.stream.clone();
        let raw = stream.cu_stream();
        let _drained = Drained(&stream);
        for piece in buf.chunks_mut(gpu.part * self.size) {
            let (r, _gr) = gpu.recv.device_ptr_mut(&stream);
            if self.rank == root {
                // SAFETY: `recv` holds N × part ≥ the piece's bytes; the piece stays borrowed
                // until the stream is drained (`_drained`, on every return).
                let copied = unsafe { cudarc::driver::result::memcpy_htod_async(r, &*piece, raw) };
                drv(copied, "copy a broadcast to the GPU")?;
            }
            // SAFETY: the piece's bytes of `recv`, used by nothing else (the staging is held).
            unsafe { gpu.comm.broadcast_bytes(r, piece.len(), root, &stream)? };
            if self.rank != root {
                // SAFETY: as many bytes as the broadcast wrote; the piece stays borrowed until
                // the stream is drained.
                let copied =
                    unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut *piece, r, raw) };
                drv(copied, "copy a broadcast from the GPU")?;
            }
            drv(stream.synchronize(), "wait for NCCL's broadcast")?;
        }
        Ok(())
    }

    fn send_bytes(&self, to: usize, _buf: &[u8]) -> Result<()> {
        Err(point_to_point(self.rank, to))
    }

    fn recv_bytes(&self, from: usize, _buf: &mut [u8]) -> Result<()> {
        Err(point_to_point(from, self.rank))
    }

    /// Ends this rank's communicator (its collectives waiting for others end) and the process;
    /// torchrun's agent then ends the other ranks (or, with `--max-restarts`, starts the job
    /// again).
    fn abort(&self, code: i32) -> ! {
        if let Ok(mut st) = self.staging.try_lock() {
            st.gpu.comm.abort();
        }
        std::process::exit(code)
    }

    fn library_sum_f32(&self, buf: &mut [f32]) -> Result<()> {
        let mut b = self.enter("NCCL's all-reduce");
        let gpu = &mut b.staging.gpu;
        let stream = gpu.rt.stream.clone();
        let raw = stream.cu_stream();
        let _drained = Drained(&stream);
        for part in buf.chunks_mut(gpu.fits::<f32>()) {
            let (s, _gs) = gpu.send.device_ptr(&stream);
            let (r, _gr) = gpu.recv.device_ptr_mut(&stream);
            // SAFETY: `send` and `recv` hold at least `part` bytes, the part at most; it stays
            // borrowed until the stream is drained (`_drained`, on every return).
            let copied = unsafe { cudarc::driver::result::memcpy_htod_async(s, &*part, raw) };
            drv(copied, "copy a part to the GPU")?;
            // SAFETY: `part.len()` f32 at both addresses of this communicator's GPU.
            unsafe { gpu.comm.all_reduce_f32_raw(s, r, part.len(), &stream)? };
            // SAFETY: as many bytes as the all-reduce wrote; drained before the part is free.
            let copied = unsafe { cudarc::driver::result::memcpy_dtoh_async(&mut *part, r, raw) };
            drv(copied, "copy the sum from the GPU")?;
            drv(stream.synchronize(), "wait for NCCL's all-reduce")?;
        }
        Ok(())
    }

    fn library(&self) -> String {
        self.library.clone()
    }

    fn sum_path(&self) -> &'static str {
        "NCCL all-gather between the GPUs, added on the host in rank order"
    }

    fn watch(&self) -> StallWatch {
        self.busy.clone()
    }

    fn no_roll_call(&self) -> &'static str {
        "NCCL cannot ask which: torchrun's log names a rank that died"
    }

    fn on_gpus(&self) -> bool {
        true
    }
}

/// Why a torchrun job has no point-to-point sends.
fn point_to_point(from: usize, to: usize) -> Error {
    Error::bad_input(
        "checkpoint directory",
        format!("rank {from}'s units for rank {to}"),
        "a job torchrun started moves data through NCCL collectives only, so rank 0 cannot write the units of a rank that does not see its checkpoint directory",
        Some("give every rank the same checkpoint directory (a filesystem every node mounts), or start the job with mpirun or srun"),
    )
}
