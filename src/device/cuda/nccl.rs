//! NCCL on the CUDA device: a communicator between the GPUs of a data-parallel job, one rank
//! per process, and the collectives on its buffers, enqueued on a stream.
//!
//! The library is the file [`crate::device::stack::nccl::find`] chose (a wheel's, a
//! toolkit's, the system's), opened by path; its entry points are bound here with cudarc's
//! NCCL types (`cudarc::nccl::sys`), because cudarc's own loader asks for sonames the wheels do
//! not have (`libnccl.so`, `libnccl.so.<CUDA major>`; NCCL's is `libnccl.so.2`).
//!
//! The rendezvous is NCCL's: rank 0 makes the unique id ([`unique_id`]), the caller moves it to
//! the other ranks (over MPI, the job's engine), and each rank joins with it ([`NcclComm::join`]).

use super::drv;
use crate::device::stack::nccl as find;
use crate::{Error, Result};
use cudarc::driver::{CudaContext, CudaSlice, CudaStream, DevicePtr, DevicePtrMut};
use cudarc::nccl::sys::{cudaStream_t, ncclComm_t, ncclDataType_t, ncclRedOp_t, ncclUniqueId};
use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::{Arc, Mutex};

type Reduce = unsafe extern "C" fn(
    *const c_void,
    *mut c_void,
    usize,
    ncclDataType_t,
    ncclRedOp_t,
    ncclComm_t,
    cudaStream_t,
) -> c_int;

/// The entry points megatrain calls.
struct Api {
    get_version: unsafe extern "C" fn(*mut c_int) -> c_int,
    get_unique_id: unsafe extern "C" fn(*mut ncclUniqueId) -> c_int,
    comm_init_rank: unsafe extern "C" fn(*mut ncclComm_t, c_int, ncclUniqueId, c_int) -> c_int,
    comm_destroy: unsafe extern "C" fn(ncclComm_t) -> c_int,
    comm_abort: unsafe extern "C" fn(ncclComm_t) -> c_int,
    get_error_string: unsafe extern "C" fn(c_int) -> *const c_char,
    all_reduce: Reduce,
    reduce_scatter: Reduce,
    all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        ncclComm_t,
        cudaStream_t,
    ) -> c_int,
    broadcast: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        ncclDataType_t,
        c_int,
        ncclComm_t,
        cudaStream_t,
    ) -> c_int,
    /// Keeps the entry points above loaded.
    _lib: libloading::Library,
}

/// The NCCL library in use.
pub struct Nccl {
    api: Api,
    /// Where it was found.
    pub found: find::Found,
    /// Its version (`2.28.9`).
    pub version: String,
}

impl std::fmt::Debug for Nccl {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NCCL {} ({})", self.version, self.found.path.display())
    }
}

/// NCCL, found and loaded once for the process.
pub fn library() -> Result<&'static Nccl> {
    static LOADED: Mutex<Option<&'static Nccl>> = Mutex::new(None);
    let mut g = crate::util::lock(&LOADED);
    if let Some(n) = *g {
        return Ok(n);
    }
    let found = find::find()?;
    let failed = |why: String| Error::system("NCCL", format!("load {}", found.path.display()), why);
    // SAFETY: loading the NCCL library found above, which runs its initialisers (NCCL's own).
    let lib =
        unsafe { libloading::Library::new(&found.path) }.map_err(|e| failed(e.to_string()))?;
    macro_rules! sym {
        ($name:literal) => {
            // SAFETY: the symbol's type is NCCL's C signature for that name (nccl.h), as
            // cudarc's bindings declare it; the library outlives the copy (kept in `Api`).
            *unsafe { lib.get($name.as_bytes()) }
                .map_err(|e| failed(format!("no `{}`: {e}", $name)))?
        };
    }
    let api = Api {
        get_version: sym!("ncclGetVersion"),
        get_unique_id: sym!("ncclGetUniqueId"),
        comm_init_rank: sym!("ncclCommInitRank"),
        comm_destroy: sym!("ncclCommDestroy"),
        comm_abort: sym!("ncclCommAbort"),
        get_error_string: sym!("ncclGetErrorString"),
        all_reduce: sym!("ncclAllReduce"),
        reduce_scatter: sym!("ncclReduceScatter"),
        all_gather: sym!("ncclAllGather"),
        broadcast: sym!("ncclBroadcast"),
        _lib: lib,
    };
    let mut v: c_int = 0;
    // SAFETY: an int for the version.
    let r = unsafe { (api.get_version)(&mut v) };
    if r != 0 {
        return Err(failed(format!("ncclGetVersion returned {r}")));
    }
    // NCCL_VERSION_CODE: major·10000 + minor·100 + patch since 2.9.
    let version = format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100);
    let n: &'static Nccl = Box::leak(Box::new(Nccl {
        api,
        found,
        version,
    }));
    *g = Some(n);
    Ok(n)
}

impl Nccl {
    fn check(&self, r: c_int, op: &str) -> Result<()> {
        if r == 0 {
            return Ok(());
        }
        // SAFETY: NCCL returns a static string for any code.
        let text = unsafe { CStr::from_ptr((self.api.get_error_string)(r)) }.to_string_lossy();
        Err(
            Error::system("NCCL", op.to_owned(), format!("{text} (ncclResult_t {r})")).with_fix(
                "run with NCCL_DEBUG=WARN for NCCL's own account; every rank needs its own GPU",
            ),
        )
    }
}

/// A new unique id for a communicator (rank 0 makes it; every rank joins with the same bytes).
pub fn unique_id() -> Result<[u8; 128]> {
    let n = library()?;
    let mut id = ncclUniqueId { internal: [0; 128] };
    // SAFETY: a writable ncclUniqueId.
    n.check(unsafe { (n.api.get_unique_id)(&mut id) }, "ncclGetUniqueId")?;
    Ok(id.internal.map(|c| c as u8))
}

/// Rank 0's unique id, or why it has none, as the bytes the job's rendezvous moves to every
/// rank: every rank learns either, so none is left waiting in NCCL's initialisation for a rank
/// 0 that failed. [`unique_id_from`] reads it.
pub fn unique_id_message(made: &Result<[u8; 128]>) -> Vec<u8> {
    match made {
        Ok(id) => [&[1u8][..], &id[..]].concat(),
        Err(why) => [&[0u8][..], why.to_string().as_bytes()].concat(),
    }
}

/// The unique id in rank 0's [`unique_id_message`], or rank 0's reason as this rank's error.
pub fn unique_id_from(msg: &[u8], rank: usize) -> Result<[u8; 128]> {
    match msg.split_first() {
        Some((1, id)) => id
            .try_into()
            .map_err(|_| Error::internal("NCCL", "rank 0's unique id is not 128 bytes")),
        _ => Err(Error::system(
            "NCCL",
            format!("rank {rank}: join the job's communicator"),
            format!(
                "rank 0 could not make its unique id: {}",
                String::from_utf8_lossy(msg.get(1..).unwrap_or_default())
            ),
        )),
    }
}

/// One rank's NCCL communicator. Its collectives are enqueued on the stream each call names
/// (NCCL's ops on one communicator must be enqueued in the same order on every rank).
pub struct NcclComm {
    nccl: &'static Nccl,
    comm: ncclComm_t,
    rank: usize,
    size: usize,
    /// Ended by [`NcclComm::abort`]: nothing more is enqueued, nothing destroyed on drop.
    aborted: bool,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time: it is moved
// between threads, never shared (`&self` calls go through the owner's lock).
unsafe impl Send for NcclComm {}

impl std::fmt::Debug for NcclComm {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "NcclComm(rank {} of {})", self.rank, self.size)
    }
}

impl Drop for NcclComm {
    fn drop(&mut self) {
        if self.aborted {
            return;
        }
        // NCCL finalises first: the collectives already enqueued complete.
        // SAFETY: the communicator made in `join`, destroyed once.
        unsafe { (self.nccl.api.comm_destroy)(self.comm) };
    }
}

/// Which element type a buffer holds.
pub trait NcclElement: cudarc::driver::DeviceRepr {
    /// Its `ncclDataType_t`.
    const TYPE: ncclDataType_t;
}

impl NcclElement for f32 {
    const TYPE: ncclDataType_t = ncclDataType_t::ncclFloat32;
}

impl NcclElement for u8 {
    const TYPE: ncclDataType_t = ncclDataType_t::ncclUint8;
}

fn raw(stream: &CudaStream) -> cudaStream_t {
    stream.cu_stream() as cudaStream_t
}

impl NcclComm {
    /// Join the communicator `id` names as `rank` of `size`, on `ctx`'s GPU (every rank calls
    /// it; it returns when all have).
    pub fn join(ctx: &Arc<CudaContext>, id: [u8; 128], rank: usize, size: usize) -> Result<Self> {
        let nccl = library()?;
        let (r, n) = (
            c_int::try_from(rank).map_err(|_| Error::internal("NCCL", "rank too large"))?,
            c_int::try_from(size).map_err(|_| Error::internal("NCCL", "size too large"))?,
        );
        // NCCL takes the GPU of the calling thread's current context.
        drv(ctx.bind_to_thread(), "make the context current")?;
        let id = ncclUniqueId {
            internal: id.map(|b| b as c_char),
        };
        let mut comm: ncclComm_t = std::ptr::null_mut();
        // SAFETY: a writable communicator handle, and the id by value as nccl.h declares.
        let r = unsafe { (nccl.api.comm_init_rank)(&mut comm, n, id, r) };
        nccl.check(r, &format!("ncclCommInitRank (rank {rank} of {size})"))?;
        Ok(NcclComm {
            nccl,
            comm,
            rank,
            size,
            aborted: false,
        })
    }

    /// End the communicator at once (a rank that failed): its collectives still waiting for
    /// other ranks end, so its streams drain; no collective runs on it afterwards.
    pub fn abort(&mut self) {
        if !self.aborted {
            self.aborted = true;
            // SAFETY: the communicator made in `join`, aborted once and never destroyed after.
            unsafe { (self.nccl.api.comm_abort)(self.comm) };
        }
    }

    fn live(&self, what: &str) -> Result<()> {
        match self.aborted {
            false => Ok(()),
            true => Err(Error::internal(
                "NCCL",
                format!("{what} on an aborted communicator"),
            )),
        }
    }

    /// The library.
    pub fn library(&self) -> &'static Nccl {
        self.nccl
    }

    /// This rank.
    pub fn rank(&self) -> usize {
        self.rank
    }

    /// Ranks in the communicator.
    pub fn size(&self) -> usize {
        self.size
    }

    fn lengths(&self, what: &str, send: usize, recv: usize, ok: bool) -> Result<()> {
        if ok {
            return Ok(());
        }
        Err(Error::internal(
            "NCCL",
            format!(
                "{what}: send {send} and receive {recv} elements do not fit {} ranks",
                self.size
            ),
        ))
    }

    /// Enqueue `call(send, recv, stream)` — one collective on the slices' device addresses —
    /// once `what`'s lengths are `ok`; its result checked.
    fn enqueue<T: NcclElement>(
        &self,
        what: &str,
        (send, recv): (&CudaSlice<T>, &mut CudaSlice<T>),
        stream: &Arc<CudaStream>,
        ok: bool,
        call: impl FnOnce(*const c_void, *mut c_void, cudaStream_t) -> c_int,
    ) -> Result<()> {
        self.live(what)?;
        self.lengths(what, send.len(), recv.len(), ok)?;
        let (s, _gs) = send.device_ptr(stream);
        let (r, _gr) = recv.device_ptr_mut(stream);
        let code = call(s as *const c_void, r as *mut c_void, raw(stream));
        self.nccl.check(code, what)
    }

    /// `recv = Σ over ranks of send`, element-wise, on `stream` (NCCL's order: its
    /// algorithm's, not rank order).
    pub fn all_reduce_sum<T: NcclElement>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        let (count, ok) = (send.len(), send.len() == recv.len());
        self.enqueue("ncclAllReduce", (send, recv), stream, ok, |s, r, st| {
            // SAFETY: two device buffers of `count` elements on this communicator's GPU, of
            // the type NCCL is told; their guards order `stream` with their other uses.
            unsafe {
                (self.nccl.api.all_reduce)(
                    s,
                    r,
                    count,
                    T::TYPE,
                    ncclRedOp_t::ncclSum,
                    self.comm,
                    st,
                )
            }
        })
    }

    /// Rank r's `recv` = Σ over ranks of `send[r·n .. (r+1)·n]` (`n = recv.len()`), on `stream`.
    pub fn reduce_scatter_sum<T: NcclElement>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        let (count, ok) = (recv.len(), send.len() == recv.len() * self.size);
        self.enqueue("ncclReduceScatter", (send, recv), stream, ok, |s, r, st| {
            // SAFETY: as in all_reduce_sum, with the lengths NCCL requires checked.
            unsafe {
                (self.nccl.api.reduce_scatter)(
                    s,
                    r,
                    count,
                    T::TYPE,
                    ncclRedOp_t::ncclSum,
                    self.comm,
                    st,
                )
            }
        })
    }

    /// `recv[r·n .. (r+1)·n]` = rank r's `send` (`n = send.len()`), on `stream`.
    pub fn all_gather<T: NcclElement>(
        &self,
        send: &CudaSlice<T>,
        recv: &mut CudaSlice<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        let (count, ok) = (send.len(), recv.len() == send.len() * self.size);
        self.enqueue("ncclAllGather", (send, recv), stream, ok, |s, r, st| {
            // SAFETY: as in all_reduce_sum, with the lengths NCCL requires checked.
            unsafe { (self.nccl.api.all_gather)(s, r, count, T::TYPE, self.comm, st) }
        })
    }

    /// `buf` on every rank = rank `root`'s, in place, on `stream`.
    pub fn broadcast<T: NcclElement>(
        &self,
        root: usize,
        buf: &mut CudaSlice<T>,
        stream: &Arc<CudaStream>,
    ) -> Result<()> {
        let bytes = buf.len() * std::mem::size_of::<T>();
        let (p, _g) = buf.device_ptr_mut(stream);
        // SAFETY: the slice's whole range on this communicator's GPU; the guard orders `stream`
        // with its other uses.
        unsafe { self.broadcast_bytes(p, bytes, root, stream) }
    }

    /// `bytes` bytes at device address `at` on every rank = rank `root`'s, in place, on
    /// `stream`.
    ///
    /// # Safety
    /// `at..at + bytes` is device memory of this communicator's GPU that nothing else uses
    /// until `stream` has passed this broadcast (the caller orders its other users with events).
    pub unsafe fn broadcast_bytes(
        &self,
        at: u64,
        bytes: usize,
        root: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        self.live("ncclBroadcast")?;
        let root_c = c_int::try_from(root)
            .ok()
            .filter(|_| root < self.size)
            .ok_or_else(|| Error::internal("NCCL", format!("root {root} of {}", self.size)))?;
        // SAFETY: the caller's contract; in place (NCCL's send and receive buffers the same).
        let code = unsafe {
            (self.nccl.api.broadcast)(
                at as *const c_void,
                at as *mut c_void,
                bytes,
                ncclDataType_t::ncclUint8,
                root_c,
                self.comm,
                raw(stream),
            )
        };
        self.nccl.check(code, "ncclBroadcast")
    }

    /// `bytes` bytes at device address `send` of every rank, in rank order, at `recv`
    /// (N × `bytes`), on `stream`.
    ///
    /// # Safety
    /// `send..send + bytes` and `recv..recv + N·bytes` are device memory of this
    /// communicator's GPU that nothing else uses until `stream` has passed this all-gather.
    pub unsafe fn all_gather_raw(
        &self,
        send: u64,
        recv: u64,
        bytes: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        self.live("ncclAllGather")?;
        // SAFETY: the caller's contract.
        let code = unsafe {
            (self.nccl.api.all_gather)(
                send as *const c_void,
                recv as *mut c_void,
                bytes,
                ncclDataType_t::ncclUint8,
                self.comm,
                raw(stream),
            )
        };
        self.nccl.check(code, "ncclAllGather")
    }

    /// `count` f32 at `recv` = Σ over ranks of their `count` f32 at `send` (NCCL's order), on
    /// `stream`.
    ///
    /// # Safety
    /// Both ranges of `count` f32 are device memory of this communicator's GPU that nothing
    /// else uses until `stream` has passed this all-reduce.
    pub unsafe fn all_reduce_f32_raw(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        stream: &CudaStream,
    ) -> Result<()> {
        self.live("ncclAllReduce")?;
        // SAFETY: the caller's contract.
        let code = unsafe {
            (self.nccl.api.all_reduce)(
                send as *const c_void,
                recv as *mut c_void,
                count,
                ncclDataType_t::ncclFloat32,
                ncclRedOp_t::ncclSum,
                self.comm,
                raw(stream),
            )
        };
        self.nccl.check(code, "ncclAllReduce")
    }
}
