//! NCCL (`libnccl.so.2`), emulated across the processes of one job: what a multi-rank CUDA
//! program needs to run its collectives without GPUs.
//!
//! - `ncclGetUniqueId` names a shared-memory segment (`/dev/shm/cuemu-nccl-…`). Every rank's
//!   `ncclCommInitRank` with that id maps it and waits until all `nranks` ranks have joined,
//!   as NCCL's does; the program moves the id between its processes itself (over MPI, a
//!   launcher's store), as it must with NCCL. The segment's name is removed once all have
//!   joined.
//! - A collective is a command on the stream the program names. Its buffers are checked
//!   against their allocations when it is enqueued, and its device accesses join the stream
//!   hazard checks as a kernel's do: the send buffer read, the receive buffer written.
//! - When the stream reaches it, the rank posts what it called (collective, element count,
//!   type, operation, root, and how many collectives it made before on this communicator) and
//!   meets the other ranks. A rank whose call differs — a hang or silent corruption under
//!   NCCL — is reported with both calls, and the collective fails on every rank.
//! - The data moves through the segment, 1 MiB per rank at a time. Reductions are taken in
//!   rank order, `((x₀ ∘ x₁) ∘ x₂) ∘ …`, the same bits on every rank; NCCL's own order depends
//!   on its algorithm (ring, tree) and the rank count, and is not this one.
//! - `ncclCommAbort` on one rank makes the others' waiting collectives fail (`ncclRemoteError`)
//!   instead of hanging, as does a rank whose context fails (its collectives will not run); a
//!   rank that waits longer than `CUEMU_NCCL_TIMEOUT` seconds (600) for the others fails its
//!   call and aborts the communicator, naming the ranks it waited for.
//! - A rank's collectives run one at a time in the order they were called, whichever streams
//!   they are on (NCCL's rule for one communicator).
//! - A failed collective is reported on stderr and makes the context fail, as a GPU fault
//!   would (a real one would hang or leave the comm's asynchronous error set, which
//!   `ncclCommGetAsyncError` also returns here).
//!
//! Point-to-point calls (`ncclSend`, `ncclRecv`) and the newer API are not emulated: the
//! generated stubs log them and return `ncclInvalidUsage`.

use crate::api::{self, cu, nccl as code, Lib, Sticky};
use crate::memory::{mem, poisoned_words};
use crate::stream::{Cmd, Stream, Touch, Work};
use crate::{config, report};
use std::collections::HashMap;
use std::ffi::{c_char, c_int, c_void};
use std::sync::atomic::{AtomicI32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, OnceLock};
use std::time::Instant;

/// The emulated NCCL version: 2.28.9, as `ncclGetVersion` encodes it.
const VERSION: c_int = 22809;
/// What the first bytes of an emulated unique id hold.
const MAGIC: &[u8; 16] = b"cuemu-nccl-id-1\0";
/// Bytes each rank moves through the segment at a time.
const CHUNK: usize = 1 << 20;
/// Ranks a communicator may have.
const MAX_RANKS: usize = 256;
/// Words of one posted call.
const POST: usize = 8;

/// The segment's header; each rank's chunk follows at [`data_offset`].
#[repr(C)]
struct Header {
    nranks: AtomicU64,
    joined: AtomicU64,
    arrived: AtomicU64,
    generation: AtomicU64,
    /// 0, or 1 + the rank that aborted the communicator.
    aborted: AtomicU64,
    /// Each rank's current call: `[seq + 1, kind, count, type, op, root, send, recv]`.
    posts: [[AtomicU64; POST]; MAX_RANKS],
    /// 1 once a process joined as that rank.
    claimed: [AtomicU64; MAX_RANKS],
}

fn data_offset() -> usize {
    std::mem::size_of::<Header>().next_multiple_of(4096)
}

/// One rank's communicator.
struct Comm {
    map: *mut u8,
    len: usize,
    rank: usize,
    nranks: usize,
    /// Collectives enqueued on it so far.
    calls: AtomicU64,
    /// Collectives run so far: the next to run is the one called as this (one at a time, in
    /// call order, whatever their streams).
    turn: AtomicU64,
    /// `ncclCommGetAsyncError`'s answer.
    async_error: AtomicI32,
}

// SAFETY: the mapping is shared memory owned by the communicator, read and written only through
// atomics (the header) or by the stream thread running this rank's collective, whose turns are
// ordered by the barrier.
unsafe impl Send for Comm {}
// SAFETY: as above.
unsafe impl Sync for Comm {}

impl Drop for Comm {
    fn drop(&mut self) {
        // SAFETY: the mapping made in `ncclCommInitRank`, unmapped once (the last reference).
        unsafe { libc::munmap(self.map.cast(), self.len) };
    }
}

impl Comm {
    fn header(&self) -> &Header {
        // SAFETY: the mapping starts with a header, zeroed by the kernel when created.
        unsafe { &*(self.map as *const Header) }
    }

    /// Rank `r`'s chunk of the segment.
    fn slot(&self, r: usize) -> *mut u8 {
        // SAFETY: within the mapping, sized for `nranks` chunks after the header.
        unsafe { self.map.add(data_offset() + r * CHUNK) }
    }

    /// Mark the communicator aborted by this rank (the others' waits fail).
    fn abort(&self) {
        self.header()
            .aborted
            .compare_exchange(0, self.rank as u64 + 1, Ordering::AcqRel, Ordering::Acquire)
            .ok();
    }

    /// Wait until every rank has arrived here (or fail: an abort, the timeout), within call
    /// `seq`.
    fn barrier(&self, seq: u64) -> Result<(), String> {
        let h = self.header();
        let gen = h.generation.load(Ordering::Acquire);
        if h.arrived.fetch_add(1, Ordering::AcqRel) + 1 == self.nranks as u64 {
            h.arrived.store(0, Ordering::Release);
            h.generation.fetch_add(1, Ordering::AcqRel);
            return Ok(());
        }
        self.wait_for(
            || h.generation.load(Ordering::Acquire) != gen,
            "reach the same collective",
            Some(seq),
        )
    }

    /// The ranks whose posted call is behind `seq` (the ones a waiting rank waits for).
    fn behind(&self, seq: u64) -> Vec<usize> {
        let h = self.header();
        (0..self.nranks)
            .filter(|&r| h.posts[r][0].load(Ordering::Acquire) < seq + 1)
            .collect()
    }

    /// Spin, then sleep, until `done`; fail on an abort or after the timeout (which aborts).
    fn wait(&self, done: impl Fn() -> bool, what: &str) -> Result<(), String> {
        self.wait_for(done, what, None)
    }

    /// [`Comm::wait`], naming on a timeout the ranks behind call `seq` (a collective's wait).
    fn wait_for(
        &self,
        done: impl Fn() -> bool,
        what: &str,
        seq: Option<u64>,
    ) -> Result<(), String> {
        let h = self.header();
        let timeout = config::get().nccl_timeout;
        let t0 = Instant::now();
        let mut spins = 0u32;
        loop {
            if done() {
                return Ok(());
            }
            let a = h.aborted.load(Ordering::Acquire);
            if a != 0 {
                return Err(format!(
                    "rank {} aborted the communicator (ncclCommAbort, its context failed, or its own timeout)",
                    a - 1
                ));
            }
            if t0.elapsed() > timeout {
                self.abort();
                let behind = match seq.map(|s| self.behind(s)) {
                    Some(b) if !b.is_empty() => format!(
                        " (rank{} {} not there yet)",
                        if b.len() > 1 { "s" } else { "" },
                        b.iter()
                            .map(|r| r.to_string())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                    _ => String::new(),
                };
                return Err(format!(
                    "rank {} waited {:.0} s (CUEMU_NCCL_TIMEOUT) for the other ranks to {what}{behind} (the emulated NCCL joins only processes of one host: its ranks meet in /dev/shm)",
                    self.rank,
                    timeout.as_secs_f64()
                ));
            }
            spins += 1;
            if spins < 2000 {
                std::hint::spin_loop();
            } else if spins < 4000 {
                std::thread::yield_now();
            } else {
                std::thread::sleep(std::time::Duration::from_micros(50));
            }
        }
    }
}

fn comms() -> MutexGuard<'static, HashMap<usize, Arc<Comm>>> {
    static C: OnceLock<Mutex<HashMap<usize, Arc<Comm>>>> = OnceLock::new();
    C.get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Abort every live communicator of this process: its context failed, so its collectives will
/// not run, and the other ranks' fail instead of waiting for them.
pub fn abort_all() {
    for c in comms().values() {
        c.abort();
    }
}

fn comm(handle: *mut c_void, name: &str) -> Result<Arc<Comm>, i32> {
    comms().get(&(handle as usize)).cloned().ok_or_else(|| {
        report::error(
            "invalid NCCL communicator",
            &format!(
                "{name}: {handle:?} is not a live communicator (never initialised, or destroyed)"
            ),
        );
        code::INVALID_ARGUMENT
    })
}

fn nccl_call(name: &str, f: impl FnOnce() -> Result<(), i32>) -> c_int {
    api::call(name, Lib::Nccl, Sticky::Fail, f)
}

fn invalid(name: &str, why: String) -> i32 {
    report::error(
        "invalid NCCL argument",
        &format!("{name}: {why}: ncclInvalidArgument, as NCCL returns"),
    );
    code::INVALID_ARGUMENT
}

#[no_mangle]
pub extern "C" fn ncclGetVersion(version: *mut c_int) -> c_int {
    api::call("ncclGetVersion", Lib::Nccl, Sticky::Ignore, || {
        // SAFETY: null or a writable int, the caller's contract.
        unsafe { api::out(version, VERSION) }.map_err(|_| code::INVALID_ARGUMENT)
    })
}

#[no_mangle]
pub extern "C" fn ncclGetErrorString(result: c_int) -> *const c_char {
    let s: &'static std::ffi::CStr = match result {
        0 => c"no error",
        1 => c"unhandled cuda error (run with NCCL_DEBUG=INFO for details)",
        2 => c"unhandled system error (run with NCCL_DEBUG=INFO for details)",
        3 => c"internal error - please report this issue to the NCCL developers",
        4 => c"invalid argument (run with NCCL_DEBUG=WARN for details)",
        5 => c"invalid usage (run with NCCL_DEBUG=WARN for details)",
        6 => c"remote process exited or there was a network error",
        7 => c"NCCL operation in progress",
        _ => c"unknown result code",
    };
    s.as_ptr()
}

#[no_mangle]
pub extern "C" fn ncclGetLastError(_comm: *mut c_void) -> *const c_char {
    c"see the cuemu: error lines on stderr".as_ptr()
}

#[no_mangle]
pub extern "C" fn ncclGetUniqueId(id: *mut [u8; 128]) -> c_int {
    nccl_call("ncclGetUniqueId", || {
        let mut token = [0u8; 16];
        // SAFETY: a 16-byte buffer for getrandom to fill.
        let got = unsafe { libc::getrandom(token.as_mut_ptr().cast(), token.len(), 0) };
        if got != token.len() as isize {
            report::error(
                "NCCL unique id",
                &format!(
                    "ncclGetUniqueId: getrandom: {}",
                    std::io::Error::last_os_error()
                ),
            );
            return Err(code::SYSTEM_ERROR);
        }
        let mut v = [0u8; 128];
        v[..16].copy_from_slice(MAGIC);
        v[16..32].copy_from_slice(&token);
        // SAFETY: null or 128 writable bytes (`ncclUniqueId`), the caller's contract.
        unsafe { api::out(id, v) }.map_err(|_| code::INVALID_ARGUMENT)
    })
}

/// The segment's name for an id.
fn segment(id: &[u8; 128]) -> std::ffi::CString {
    let hex: String = id[16..32].iter().map(|b| format!("{b:02x}")).collect();
    std::ffi::CString::new(format!("/cuemu-nccl-{hex}")).expect("hex has no NUL")
}

/// `ncclUniqueId`, passed by value as the C struct is.
#[repr(C)]
pub struct UniqueId {
    internal: [u8; 128],
}

#[no_mangle]
pub extern "C" fn ncclCommInitRank(
    out: *mut *mut c_void,
    nranks: c_int,
    id: UniqueId,
    rank: c_int,
) -> c_int {
    const NAME: &str = "ncclCommInitRank";
    let id = id.internal;
    nccl_call(NAME, || {
        if out.is_null() {
            return Err(invalid(NAME, "comm is null".into()));
        }
        if !(1..=MAX_RANKS as c_int).contains(&nranks) || !(0..nranks).contains(&rank) {
            return Err(invalid(
                NAME,
                format!(
                    "rank {rank} of nranks {nranks} (the emulator takes 1 to {MAX_RANKS} ranks)"
                ),
            ));
        }
        if &id[..16] != MAGIC {
            return Err(invalid(
                NAME,
                "the unique id did not come from this emulator's ncclGetUniqueId (not moved between the ranks whole?)".into(),
            ));
        }
        // NCCL takes the device of the calling thread's current context.
        crate::driver::context().map_err(|_| {
            report::error(
                "NCCL without a CUDA context",
                &format!("{NAME} on a thread without a current context (NCCL uses its device)"),
            );
            code::UNHANDLED_CUDA_ERROR
        })?;
        let (nranks, rank) = (nranks as usize, rank as usize);
        let name = segment(&id);
        let len = data_offset() + nranks * CHUNK;
        // SAFETY: a valid name; the descriptor is closed below.
        let fd = unsafe { libc::shm_open(name.as_ptr(), libc::O_CREAT | libc::O_RDWR, 0o600) };
        if fd < 0 {
            report::error(
                "NCCL initialisation failed",
                &format!(
                    "{NAME}: shm_open {name:?}: {}",
                    std::io::Error::last_os_error()
                ),
            );
            return Err(code::SYSTEM_ERROR);
        }
        let map = map_segment(fd, len);
        // SAFETY: the descriptor opened above; the mapping keeps the memory.
        unsafe { libc::close(fd) };
        let map = map.map_err(|why| {
            report::error("NCCL initialisation failed", &format!("{NAME}: {why}"));
            code::SYSTEM_ERROR
        })?;
        let c = Comm {
            map,
            len,
            rank,
            nranks,
            calls: AtomicU64::new(0),
            turn: AtomicU64::new(0),
            async_error: AtomicI32::new(0),
        };
        let h = c.header();
        let refused = |why: String| {
            // The others fail at once instead of waiting for a rank that will not join.
            c.abort();
            // SAFETY: a valid name; the other ranks' mappings stay valid without it.
            unsafe { libc::shm_unlink(name.as_ptr()) };
            invalid(NAME, why)
        };
        if let Err(theirs) =
            h.nranks
                .compare_exchange(0, nranks as u64, Ordering::AcqRel, Ordering::Acquire)
        {
            if theirs != nranks as u64 {
                return Err(refused(format!(
                    "rank {rank} gives nranks {nranks}, another rank of this id gave {theirs}"
                )));
            }
        }
        if h.claimed[rank]
            .compare_exchange(0, 1, Ordering::AcqRel, Ordering::Acquire)
            .is_err()
        {
            return Err(refused(format!(
                "two processes joined this id as rank {rank} (each must be another rank)"
            )));
        }
        h.joined.fetch_add(1, Ordering::AcqRel);
        let joined = c.wait(
            || h.joined.load(Ordering::Acquire) >= nranks as u64,
            "join (ncclCommInitRank with this id)",
        );
        if rank == 0 || joined.is_err() {
            // SAFETY: a valid name; the mappings stay valid without it.
            unsafe { libc::shm_unlink(name.as_ptr()) };
        }
        if let Err(why) = joined {
            report::error("NCCL initialisation failed", &format!("{NAME}: {why}"));
            return Err(code::SYSTEM_ERROR);
        }
        let handle = Box::into_raw(Box::new(0u8)) as usize;
        comms().insert(handle, Arc::new(c));
        // SAFETY: checked non-null above; the caller's contract makes it writable.
        unsafe { out.write(handle as *mut c_void) };
        Ok(())
    })
}

/// Grow the segment to `len` if another rank has not yet, and map it.
fn map_segment(fd: c_int, len: usize) -> Result<*mut u8, String> {
    let mut st = std::mem::MaybeUninit::<libc::stat>::zeroed();
    // SAFETY: fstat fills `st` for an open descriptor.
    if unsafe { libc::fstat(fd, st.as_mut_ptr()) } != 0 {
        return Err(format!("fstat: {}", std::io::Error::last_os_error()));
    }
    // SAFETY: filled by fstat.
    let size = unsafe { st.assume_init() }.st_size as usize;
    // Only ever grown: shrinking it under another rank's mapping would fault there. Allocated,
    // not only sized: a full /dev/shm is an error here, not a SIGBUS at the first write.
    if size < len {
        // SAFETY: posix_fallocate on an open descriptor; it returns the error number.
        let e = unsafe { libc::posix_fallocate(fd, 0, len as libc::off_t) };
        if e != 0 {
            return Err(format!(
                "allocating {len} bytes of shared memory: {} (enlarge /dev/shm: docker run --shm-size)",
                std::io::Error::from_raw_os_error(e)
            ));
        }
    }
    // SAFETY: a shared mapping of `len` bytes of the segment, at least that long now.
    let p = unsafe {
        libc::mmap(
            std::ptr::null_mut(),
            len,
            libc::PROT_READ | libc::PROT_WRITE,
            libc::MAP_SHARED,
            fd,
            0,
        )
    };
    if p == libc::MAP_FAILED {
        return Err(format!("mmap: {}", std::io::Error::last_os_error()));
    }
    Ok(p.cast())
}

/// Destroy (or abort) a communicator: its handle goes; the mapping goes when the last queued
/// collective using it has run.
fn release(handle: *mut c_void, name: &str, abort: bool) -> Result<(), i32> {
    let c = comms().remove(&(handle as usize)).ok_or_else(|| {
        report::error(
            "invalid NCCL communicator",
            &format!("{name}: {handle:?} is not a live communicator"),
        );
        code::INVALID_ARGUMENT
    })?;
    if abort {
        c.abort();
    }
    // SAFETY: the handle was made by Box::into_raw in ncclCommInitRank and is freed once (it
    // was just removed from the registry).
    drop(unsafe { Box::from_raw(handle as *mut u8) });
    Ok(())
}

#[no_mangle]
pub extern "C" fn ncclCommDestroy(comm: *mut c_void) -> c_int {
    api::call("ncclCommDestroy", Lib::Nccl, Sticky::After, || {
        release(comm, "ncclCommDestroy", false)
    })
}

#[no_mangle]
pub extern "C" fn ncclCommAbort(comm: *mut c_void) -> c_int {
    api::call("ncclCommAbort", Lib::Nccl, Sticky::Ignore, || {
        release(comm, "ncclCommAbort", true)
    })
}

#[no_mangle]
pub extern "C" fn ncclCommGetAsyncError(comm_: *mut c_void, err: *mut c_int) -> c_int {
    api::call("ncclCommGetAsyncError", Lib::Nccl, Sticky::Ignore, || {
        let c = comm(comm_, "ncclCommGetAsyncError")?;
        // SAFETY: null or writable, the caller's contract.
        unsafe { api::out(err, c.async_error.load(Ordering::Acquire)) }
            .map_err(|_| code::INVALID_ARGUMENT)
    })
}

#[no_mangle]
pub extern "C" fn ncclCommCount(comm_: *mut c_void, count: *mut c_int) -> c_int {
    nccl_call("ncclCommCount", || {
        let c = comm(comm_, "ncclCommCount")?;
        // SAFETY: null or writable, the caller's contract.
        unsafe { api::out(count, c.nranks as c_int) }.map_err(|_| code::INVALID_ARGUMENT)
    })
}

#[no_mangle]
pub extern "C" fn ncclCommUserRank(comm_: *mut c_void, rank: *mut c_int) -> c_int {
    nccl_call("ncclCommUserRank", || {
        let c = comm(comm_, "ncclCommUserRank")?;
        // SAFETY: null or writable, the caller's contract.
        unsafe { api::out(rank, c.rank as c_int) }.map_err(|_| code::INVALID_ARGUMENT)
    })
}

#[no_mangle]
pub extern "C" fn ncclCommCuDevice(comm_: *mut c_void, device: *mut c_int) -> c_int {
    nccl_call("ncclCommCuDevice", || {
        comm(comm_, "ncclCommCuDevice")?;
        // SAFETY: null or writable, the caller's contract.
        unsafe { api::out(device, 0) }.map_err(|_| code::INVALID_ARGUMENT)
    })
}

thread_local! {
    /// `ncclGroupStart` depth on this thread.
    static GROUP: std::cell::Cell<u32> = const { std::cell::Cell::new(0) };
}

/// Collectives in a group are enqueued as they are called: each is a whole collective here,
/// so fusing them changes nothing but speed (groups matter for point-to-point calls, which are
/// not emulated).
#[no_mangle]
pub extern "C" fn ncclGroupStart() -> c_int {
    nccl_call("ncclGroupStart", || {
        GROUP.with(|g| g.set(g.get() + 1));
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn ncclGroupEnd() -> c_int {
    nccl_call("ncclGroupEnd", || {
        GROUP.with(|g| match g.get() {
            0 => Err(invalid("ncclGroupEnd", "without ncclGroupStart".into())),
            n => {
                g.set(n - 1);
                Ok(())
            }
        })
    })
}

/// An element type (`ncclDataType_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Ty {
    I8 = 0,
    U8 = 1,
    I32 = 2,
    U32 = 3,
    I64 = 4,
    U64 = 5,
    F16 = 6,
    F32 = 7,
    F64 = 8,
    Bf16 = 9,
    F8e4m3 = 10,
    F8e5m2 = 11,
}

impl Ty {
    fn of(v: c_int) -> Option<Ty> {
        use Ty::*;
        Some(match v {
            0 => I8,
            1 => U8,
            2 => I32,
            3 => U32,
            4 => I64,
            5 => U64,
            6 => F16,
            7 => F32,
            8 => F64,
            9 => Bf16,
            10 => F8e4m3,
            11 => F8e5m2,
            _ => return None,
        })
    }

    fn bytes(self) -> usize {
        use Ty::*;
        match self {
            I8 | U8 | F8e4m3 | F8e5m2 => 1,
            F16 | Bf16 => 2,
            I32 | U32 | F32 => 4,
            I64 | U64 | F64 => 8,
        }
    }

    fn name(self) -> &'static str {
        use Ty::*;
        match self {
            I8 => "ncclInt8",
            U8 => "ncclUint8",
            I32 => "ncclInt32",
            U32 => "ncclUint32",
            I64 => "ncclInt64",
            U64 => "ncclUint64",
            F16 => "ncclFloat16",
            F32 => "ncclFloat32",
            F64 => "ncclFloat64",
            Bf16 => "ncclBfloat16",
            F8e4m3 => "ncclFloat8e4m3",
            F8e5m2 => "ncclFloat8e5m2",
        }
    }
}

/// A reduction (`ncclRedOp_t`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Sum,
    Prod,
    Max,
    Min,
    Avg,
}

impl Op {
    fn of(v: c_int) -> Option<Op> {
        Some(match v {
            0 => Op::Sum,
            1 => Op::Prod,
            2 => Op::Max,
            3 => Op::Min,
            4 => Op::Avg,
            _ => return None,
        })
    }
}

/// A collective.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    AllReduce,
    ReduceScatter,
    AllGather,
    Broadcast,
}

impl Kind {
    fn of(v: u64) -> &'static str {
        match v {
            0 => "ncclAllReduce",
            1 => "ncclReduceScatter",
            2 => "ncclAllGather",
            3 => "ncclBroadcast",
            _ => "?",
        }
    }
}

/// One rank's collective, run when its stream reaches it.
struct Collective {
    comm: Arc<Comm>,
    kind: Kind,
    send: u64,
    recv: u64,
    count: usize,
    ty: Ty,
    op: Option<Op>,
    root: usize,
    seq: u64,
    what: Arc<str>,
}

impl Work for Collective {
    fn run(self: Box<Self>, stream: &Stream) {
        if let Err(why) = self.exchange() {
            report::error(
                "NCCL collective failed",
                &format!(
                    "{} on {} (rank {}): {why}",
                    self.what, stream.name, self.comm.rank
                ),
            );
            self.comm
                .async_error
                .store(code::REMOTE_ERROR, Ordering::Release);
            api::set_sticky(cu::LAUNCH_FAILED);
        }
    }
}

impl Collective {
    fn describe(post: &[u64; POST]) -> String {
        let ty = Ty::of(post[3] as c_int).map_or("?", Ty::name);
        format!(
            "call {} on this communicator, {} of {} × {ty}{}{}",
            post[0].saturating_sub(1),
            Kind::of(post[1]),
            post[2],
            match post[4] {
                u64::MAX => String::new(),
                op => format!(", op {op}"),
            },
            match post[5] {
                u64::MAX => String::new(),
                root => format!(", root {root}"),
            }
        )
    }

    fn exchange(&self) -> Result<(), String> {
        let c = &self.comm;
        // This communicator's collectives one at a time, in call order (two streams may hold
        // them); the turn passes on when this one fails too.
        c.wait(
            || c.turn.load(Ordering::Acquire) == self.seq,
            "run this rank's earlier collectives",
        )?;
        let r = self.exchange_turn();
        c.turn.fetch_add(1, Ordering::AcqRel);
        r
    }

    fn exchange_turn(&self) -> Result<(), String> {
        let c = &self.comm;
        let h = c.header();
        let mine: [u64; POST] = [
            self.seq + 1,
            self.kind as u64,
            self.count as u64,
            self.ty as u64,
            self.op.map_or(u64::MAX, |o| o as u64),
            match self.kind {
                Kind::Broadcast => self.root as u64,
                _ => u64::MAX,
            },
            0,
            0,
        ];
        for (slot, v) in h.posts[c.rank].iter().zip(mine) {
            slot.store(v, Ordering::Release);
        }
        c.barrier(self.seq)?;
        for r in 0..c.nranks {
            let theirs: [u64; POST] =
                std::array::from_fn(|i| h.posts[r].get(i).map_or(0, |w| w.load(Ordering::Acquire)));
            if theirs[..6] != mine[..6] {
                return Err(format!(
                    "rank {}'s {} met rank {r}'s {} (every rank must make the same collectives, with the same counts, types, operations and roots, in the same order)",
                    c.rank,
                    Self::describe(&mine),
                    Self::describe(&theirs)
                ));
            }
        }
        c.barrier(self.seq)?;
        let size = self.ty.bytes();
        let bytes = self.count * size;
        // Chunks hold whole elements.
        let chunk = CHUNK / size * size;
        let mut off = 0;
        match self.kind {
            Kind::AllReduce => {
                while off < bytes {
                    let len = chunk.min(bytes - off);
                    self.post_from(self.send as usize + off, len)?;
                    self.reduce_into(self.recv as usize + off, len);
                    c.barrier(self.seq)?;
                    off += len;
                }
            }
            Kind::ReduceScatter => {
                for dest in 0..c.nranks {
                    let mut off = 0;
                    while off < bytes {
                        let len = chunk.min(bytes - off);
                        self.post_from(self.send as usize + dest * bytes + off, len)?;
                        if dest == c.rank {
                            self.reduce_into(self.recv as usize + off, len);
                        }
                        c.barrier(self.seq)?;
                        off += len;
                    }
                }
            }
            Kind::AllGather => {
                while off < bytes {
                    let len = chunk.min(bytes - off);
                    self.post_from(self.send as usize + off, len)?;
                    for r in 0..c.nranks {
                        // SAFETY: rank r's chunk holds `len` bytes posted before the barrier;
                        // the receive range was checked against its allocation at the call.
                        unsafe {
                            std::ptr::copy_nonoverlapping(
                                c.slot(r),
                                (self.recv as usize + r * bytes + off) as *mut u8,
                                len,
                            )
                        };
                    }
                    c.barrier(self.seq)?;
                    off += len;
                }
            }
            Kind::Broadcast => {
                while off < bytes {
                    let len = chunk.min(bytes - off);
                    if c.rank == self.root {
                        self.post_from(self.send as usize + off, len)?;
                    } else {
                        c.barrier(self.seq)?;
                    }
                    // SAFETY: the root's chunk holds `len` bytes posted before the barrier;
                    // the receive range was checked at the call.
                    unsafe {
                        std::ptr::copy_nonoverlapping(
                            c.slot(self.root),
                            (self.recv as usize + off) as *mut u8,
                            len,
                        )
                    };
                    c.barrier(self.seq)?;
                    off += len;
                }
            }
        }
        Ok(())
    }

    /// Copy `len` bytes at device address `src` into this rank's chunk and wait for the others'.
    fn post_from(&self, src: usize, len: usize) -> Result<(), String> {
        // SAFETY: a device range checked against its allocation when the collective was
        // enqueued, kept alive by it.
        let from = unsafe { std::slice::from_raw_parts(src as *const u8, len) };
        if let Some((at, words)) = poisoned_words(from) {
            report::error(
                "read of never-written device memory",
                &format!(
                    "{} sends {words} word(s) that nothing wrote since cuMemAlloc, first at byte {at} of its chunk at {src:#x}",
                    self.what
                ),
            );
        }
        // SAFETY: this rank's chunk holds CHUNK ≥ len bytes; no other rank writes it.
        unsafe {
            std::ptr::copy_nonoverlapping(from.as_ptr(), self.comm.slot(self.comm.rank), len)
        };
        self.comm.barrier(self.seq)
    }

    /// Reduce every rank's chunk (`len` bytes), in rank order, into device address `dst`.
    fn reduce_into(&self, dst: usize, len: usize) {
        let c = &self.comm;
        let op = self.op.unwrap_or(Op::Sum);
        let n = len / self.ty.bytes();
        // SAFETY: each rank's chunk holds `len` bytes posted before the barrier, not written
        // again before the next one.
        let slots: Vec<&[u8]> = (0..c.nranks)
            .map(|r| unsafe { std::slice::from_raw_parts(c.slot(r), len) })
            .collect();
        // SAFETY: a device range checked at the call; this stream alone writes it now.
        let out = unsafe { std::slice::from_raw_parts_mut(dst as *mut u8, len) };
        macro_rules! fold {
            ($t:ty, $w:expr, $from:expr, $to:expr, $avg:expr) => {{
                for i in 0..n {
                    let at = i * $w;
                    let get = |s: &[u8]| -> $t {
                        $from(<[u8; $w]>::try_from(&s[at..at + $w]).expect("whole element"))
                    };
                    let mut acc = get(slots[0]);
                    for s in &slots[1..] {
                        let x = get(s);
                        acc = match op {
                            Op::Sum | Op::Avg => acc + x,
                            Op::Prod => acc * x,
                            Op::Max => {
                                if x > acc {
                                    x
                                } else {
                                    acc
                                }
                            }
                            Op::Min => {
                                if x < acc {
                                    x
                                } else {
                                    acc
                                }
                            }
                        };
                    }
                    if op == Op::Avg {
                        acc = $avg(acc, c.nranks);
                    }
                    out[at..at + $w].copy_from_slice(&$to(acc));
                }
            }};
        }
        fn no_avg<T>(x: T, _n: usize) -> T {
            x
        }
        match self.ty {
            Ty::I8 => fold!(i8, 1, i8::from_le_bytes, |v: i8| v.to_le_bytes(), no_avg),
            Ty::U8 => fold!(u8, 1, u8::from_le_bytes, |v: u8| v.to_le_bytes(), no_avg),
            Ty::I32 => fold!(i32, 4, i32::from_le_bytes, |v: i32| v.to_le_bytes(), no_avg),
            Ty::U32 => fold!(u32, 4, u32::from_le_bytes, |v: u32| v.to_le_bytes(), no_avg),
            Ty::I64 => fold!(i64, 8, i64::from_le_bytes, |v: i64| v.to_le_bytes(), no_avg),
            Ty::U64 => fold!(u64, 8, u64::from_le_bytes, |v: u64| v.to_le_bytes(), no_avg),
            Ty::F32 => fold!(
                f32,
                4,
                f32::from_le_bytes,
                |v: f32| v.to_le_bytes(),
                |v: f32, n: usize| v / n as f32
            ),
            Ty::F64 => fold!(
                f64,
                8,
                f64::from_le_bytes,
                |v: f64| v.to_le_bytes(),
                |v: f64, n: usize| v / n as f64
            ),
            // bf16: each step in f32, rounded back to bf16 (to nearest even).
            Ty::Bf16 => fold!(
                Bf16,
                2,
                |b: [u8; 2]| Bf16(u16::from_le_bytes(b)),
                |v: Bf16| v.0.to_le_bytes(),
                |v: Bf16, n: usize| Bf16::from_f32(v.f32() / n as f32)
            ),
            // Refused when enqueued.
            Ty::F16 | Ty::F8e4m3 | Ty::F8e5m2 => {}
        }
    }
}

/// A bf16 value with the arithmetic a reduction needs, each result rounded to bf16.
#[derive(Debug, Clone, Copy)]
struct Bf16(u16);

impl Bf16 {
    fn f32(self) -> f32 {
        f32::from_bits((self.0 as u32) << 16)
    }

    fn from_f32(v: f32) -> Bf16 {
        let b = v.to_bits();
        if v.is_nan() {
            return Bf16(((b >> 16) as u16) | 0x40);
        }
        let round = 0x7fff + ((b >> 16) & 1);
        Bf16((b.wrapping_add(round) >> 16) as u16)
    }
}

impl std::ops::Add for Bf16 {
    type Output = Bf16;
    fn add(self, o: Bf16) -> Bf16 {
        Bf16::from_f32(self.f32() + o.f32())
    }
}

impl std::ops::Mul for Bf16 {
    type Output = Bf16;
    fn mul(self, o: Bf16) -> Bf16 {
        Bf16::from_f32(self.f32() * o.f32())
    }
}

impl PartialOrd for Bf16 {
    fn partial_cmp(&self, o: &Bf16) -> Option<std::cmp::Ordering> {
        self.f32().partial_cmp(&o.f32())
    }
}

impl PartialEq for Bf16 {
    fn eq(&self, o: &Bf16) -> bool {
        self.f32() == o.f32()
    }
}

/// Validate and enqueue one collective on `stream`.
#[allow(clippy::too_many_arguments)]
fn enqueue(
    name: &'static str,
    kind: Kind,
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    datatype: c_int,
    op: Option<c_int>,
    root: c_int,
    comm_: *mut c_void,
    stream: *mut c_void,
) -> Result<(), i32> {
    let c = comm(comm_, name)?;
    let ty = Ty::of(datatype).ok_or_else(|| invalid(name, format!("datatype {datatype}")))?;
    let op = match op {
        None => None,
        Some(v) => {
            let o = Op::of(v).ok_or_else(|| {
                invalid(
                    name,
                    format!("op {v} (PreMulSum and custom operations are not emulated)"),
                )
            })?;
            if matches!(ty, Ty::F16 | Ty::F8e4m3 | Ty::F8e5m2) {
                report::once(
                    &format!("{name}-{}", ty.name()),
                    &format!("unsupported: {name} reductions of {} are not emulated; it returned an error", ty.name()),
                );
                return Err(code::INVALID_USAGE);
            }
            if o == Op::Avg && !matches!(ty, Ty::F32 | Ty::F64 | Ty::Bf16) {
                return Err(invalid(name, format!("ncclAvg of {}", ty.name())));
            }
            Some(o)
        }
    };
    if kind == Kind::Broadcast && !(0..c.nranks as c_int).contains(&root) {
        return Err(invalid(name, format!("root {root} of {} ranks", c.nranks)));
    }
    let n = c.nranks;
    let too_large = || invalid(name, format!("count {count} × {n} ranks: too large"));
    let bytes = count.checked_mul(ty.bytes()).ok_or_else(too_large)?;
    let all = bytes.checked_mul(n).ok_or_else(too_large)?;
    // What each side spans, as NCCL documents it.
    let (send_bytes, recv_bytes) = match kind {
        Kind::AllReduce => (bytes, bytes),
        Kind::ReduceScatter => (all, bytes),
        Kind::AllGather => (bytes, all),
        Kind::Broadcast => (if c.rank == root as usize { bytes } else { 0 }, bytes),
    };
    let what: Arc<str> = Arc::from(format!(
        "{name} ({count} × {}{}, rank {} of {n})",
        ty.name(),
        match kind {
            Kind::Broadcast => format!(", root {root}"),
            _ => String::new(),
        },
        c.rank
    ));
    let s = Stream::get(stream as usize)
        .map_err(|_| invalid(name, format!("stream {stream:?} is not a live stream")))?;
    let mut touches: Vec<Touch> = Vec::new();
    {
        let m = mem();
        let mut check = |which: &str, p: u64, len: usize, write: bool| -> Result<(), String> {
            if len == 0 {
                return Ok(());
            }
            let a = m
                .range(p, len)
                .map_err(|why| format!("{which} ({len} bytes at {p:#x}): {why}"))?;
            match touches.iter_mut().find(|t| t.base == a.base) {
                Some(t) => t.write |= write,
                None => touches.push(Touch {
                    base: a.base,
                    write,
                }),
            }
            Ok(())
        };
        let r = check("sendbuff", send as u64, send_bytes, false)
            .and_then(|()| check("recvbuff", recv as u64, recv_bytes, true));
        if let Err(why) = r {
            drop(m);
            report::error(
                "out-of-bounds NCCL collective",
                &format!("{what} on {}: {why}", s.name),
            );
            api::set_sticky(cu::ILLEGAL_ADDRESS);
            return Err(code::INVALID_ARGUMENT);
        }
    }
    let seq = c.calls.fetch_add(1, Ordering::AcqRel);
    let work = Collective {
        comm: c,
        kind,
        send: send as u64,
        recv: recv as u64,
        count,
        ty,
        op,
        root: root.max(0) as usize,
        seq,
        what: what.clone(),
    };
    s.enqueue(Cmd::Work(Box::new(work)), what.clone(), &touches, &[])
        .map(|_| ())
        .map_err(|e| {
            report::error(
                "NCCL collective not enqueued",
                &format!("{what} on {}: the stream refused it (CUresult {e})", s.name),
            );
            code::UNHANDLED_CUDA_ERROR
        })
}

#[no_mangle]
pub extern "C" fn ncclAllReduce(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    datatype: c_int,
    op: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    nccl_call("ncclAllReduce", || {
        enqueue(
            "ncclAllReduce",
            Kind::AllReduce,
            send,
            recv,
            count,
            datatype,
            Some(op),
            0,
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub extern "C" fn ncclReduceScatter(
    send: *const c_void,
    recv: *mut c_void,
    recvcount: usize,
    datatype: c_int,
    op: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    nccl_call("ncclReduceScatter", || {
        enqueue(
            "ncclReduceScatter",
            Kind::ReduceScatter,
            send,
            recv,
            recvcount,
            datatype,
            Some(op),
            0,
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub extern "C" fn ncclAllGather(
    send: *const c_void,
    recv: *mut c_void,
    sendcount: usize,
    datatype: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    nccl_call("ncclAllGather", || {
        enqueue(
            "ncclAllGather",
            Kind::AllGather,
            send,
            recv,
            sendcount,
            datatype,
            None,
            0,
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub extern "C" fn ncclBroadcast(
    send: *const c_void,
    recv: *mut c_void,
    count: usize,
    datatype: c_int,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    nccl_call("ncclBroadcast", || {
        enqueue(
            "ncclBroadcast",
            Kind::Broadcast,
            send,
            recv,
            count,
            datatype,
            None,
            root,
            comm,
            stream,
        )
    })
}

#[no_mangle]
pub extern "C" fn ncclBcast(
    buf: *mut c_void,
    count: usize,
    datatype: c_int,
    root: c_int,
    comm: *mut c_void,
    stream: *mut c_void,
) -> c_int {
    nccl_call("ncclBcast", || {
        enqueue(
            "ncclBcast",
            Kind::Broadcast,
            buf,
            buf,
            count,
            datatype,
            None,
            root,
            comm,
            stream,
        )
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A communicator of `nranks` over an anonymous mapping, as rank 0 sees it.
    fn comm(nranks: usize) -> Arc<Comm> {
        let len = data_offset() + nranks * CHUNK;
        // SAFETY: a fresh anonymous shared mapping, unmapped by the Comm's drop.
        let p = unsafe {
            libc::mmap(
                std::ptr::null_mut(),
                len,
                libc::PROT_READ | libc::PROT_WRITE,
                libc::MAP_SHARED | libc::MAP_ANONYMOUS,
                -1,
                0,
            )
        };
        assert_ne!(p, libc::MAP_FAILED);
        Arc::new(Comm {
            map: p.cast(),
            len,
            rank: 0,
            nranks,
            calls: AtomicU64::new(0),
            turn: AtomicU64::new(0),
            async_error: AtomicI32::new(0),
        })
    }

    /// Rank r's chunk holds `bytes[r]`; the reduction of them all, as `ty` and `op`.
    fn reduce(ty: Ty, op: Op, bytes: &[Vec<u8>]) -> Vec<u8> {
        let c = comm(bytes.len());
        for (r, b) in bytes.iter().enumerate() {
            // SAFETY: rank r's chunk holds CHUNK bytes.
            unsafe { std::ptr::copy_nonoverlapping(b.as_ptr(), c.slot(r), b.len()) };
        }
        let mut out = vec![0u8; bytes[0].len()];
        let coll = Collective {
            comm: c,
            kind: Kind::AllReduce,
            send: 0,
            recv: 0,
            count: out.len() / ty.bytes(),
            ty,
            op: Some(op),
            root: 0,
            seq: 0,
            what: Arc::from("test"),
        };
        coll.reduce_into(out.as_mut_ptr() as usize, out.len());
        out
    }

    #[test]
    fn reductions_go_in_rank_order_and_bf16_rounds_each_step() {
        // ((1e8 + 1) − 1e8) is 0 in f32; any other order gives 1.
        let f32s = |v: &[f32]| {
            v.iter()
                .map(|x| x.to_le_bytes().to_vec())
                .collect::<Vec<_>>()
        };
        let got = reduce(Ty::F32, Op::Sum, &f32s(&[1e8, 1.0, -1e8]));
        assert_eq!(f32::from_le_bytes(got.try_into().unwrap()), 0.0);
        let got = reduce(Ty::F32, Op::Avg, &f32s(&[1.0, 2.0, 6.0]));
        assert_eq!(f32::from_le_bytes(got.try_into().unwrap()), 3.0);
        // bf16 keeps 8 bits: 256 + 1 rounds to 256 (even) at each step, so 256 + 1 + 1 = 256.
        let bf = |v: &[f32]| {
            v.iter()
                .map(|x| Bf16::from_f32(*x).0.to_le_bytes().to_vec())
                .collect::<Vec<_>>()
        };
        let got = reduce(Ty::Bf16, Op::Sum, &bf(&[256.0, 1.0, 1.0]));
        assert_eq!(
            Bf16(u16::from_le_bytes(got.try_into().unwrap())).f32(),
            256.0
        );
        // Maxima compare values, not bit patterns (a negative bf16's bits are the larger).
        let got = reduce(Ty::Bf16, Op::Max, &bf(&[-2.0, -1.0, -3.0]));
        assert_eq!(
            Bf16(u16::from_le_bytes(got.try_into().unwrap())).f32(),
            -1.0
        );
        let got = reduce(
            Ty::I32,
            Op::Min,
            &[5i32, -7, 3].map(|x| x.to_le_bytes().to_vec()),
        );
        assert_eq!(i32::from_le_bytes(got.try_into().unwrap()), -7);
    }
}
