//! The driver API (`libcuda.so.1`): the subset CUDA programs like megatrain use, with CUDA's
//! semantics — one device per profile, its primary context (current per thread), device and
//! page-locked memory, copies, streams, events, host functions, modules and launches. Every
//! other function the bindings know is a generated stub (`build.rs`).

use crate::api::{self, cu, out, Sticky};
use crate::clock;
use crate::launch;
use crate::memory::{self, mem, poisoned_words, AllocError, HostKind};
use crate::simt::Dim3;
use crate::stream::{Cmd, Event, Stream, Touch, Work};
use crate::{config, report};
use std::cell::Cell;
use std::ffi::{c_char, c_int, c_uint, c_void, CStr};
use std::sync::atomic::{AtomicBool, AtomicI64, Ordering};
use std::sync::Arc;

type CUresult = c_int;
type CUdevice = c_int;
type CUdeviceptr = u64;
type Handle = *mut c_void;

/// The primary context's handle (any non-null value the program can compare).
const PRIMARY: usize = 0x00c0_de00_0001;
static INITIALISED: AtomicBool = AtomicBool::new(false);
static RETAINED: AtomicI64 = AtomicI64::new(0);
/// The primary context's flags (`cuDevicePrimaryCtxSetFlags`): its scheduling mode.
static PRIMARY_FLAGS: std::sync::atomic::AtomicU32 = std::sync::atomic::AtomicU32::new(0);

thread_local! {
    static CURRENT: Cell<usize> = const { Cell::new(0) };
}

fn initialised() -> Result<(), i32> {
    if INITIALISED.load(Ordering::Acquire) {
        Ok(())
    } else {
        Err(cu::NOT_INITIALIZED)
    }
}

/// The calling thread must have the context current (as on a real driver).
pub fn context() -> Result<(), i32> {
    initialised()?;
    if CURRENT.with(Cell::get) == PRIMARY {
        Ok(())
    } else {
        Err(cu::INVALID_CONTEXT)
    }
}

fn device(dev: CUdevice) -> Result<(), i32> {
    initialised()?;
    if dev == 0 {
        Ok(())
    } else {
        Err(cu::INVALID_DEVICE)
    }
}

// ---- initialisation, versions, errors -----------------------------------------------------------

#[no_mangle]
pub extern "C" fn cuInit(flags: c_uint) -> CUresult {
    api::call("cuInit", api::Lib::Driver, Sticky::Ignore, || {
        if flags != 0 {
            return Err(cu::INVALID_VALUE);
        }
        INITIALISED.store(true, Ordering::Release);
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDriverGetVersion(v: *mut c_int) -> CUresult {
    // SAFETY: the caller passes a writable int.
    api::call(
        "cuDriverGetVersion",
        api::Lib::Driver,
        Sticky::Ignore,
        || unsafe { out(v, config::get().driver) },
    )
}

fn error_name(code: c_int) -> Option<(&'static CStr, &'static CStr)> {
    Some(match code {
        0 => (c"CUDA_SUCCESS", c"no error"),
        1 => (c"CUDA_ERROR_INVALID_VALUE", c"invalid argument"),
        2 => (c"CUDA_ERROR_OUT_OF_MEMORY", c"out of memory"),
        3 => (c"CUDA_ERROR_NOT_INITIALIZED", c"initialization error"),
        100 => (
            c"CUDA_ERROR_NO_DEVICE",
            c"no CUDA-capable device is detected",
        ),
        101 => (c"CUDA_ERROR_INVALID_DEVICE", c"invalid device ordinal"),
        200 => (
            c"CUDA_ERROR_INVALID_IMAGE",
            c"device kernel image is invalid",
        ),
        201 => (c"CUDA_ERROR_INVALID_CONTEXT", c"invalid device context"),
        209 => (
            c"CUDA_ERROR_NO_BINARY_FOR_GPU",
            c"no kernel image is available for execution on the device",
        ),
        218 => (c"CUDA_ERROR_INVALID_PTX", c"a PTX JIT compilation failed"),
        222 => (
            c"CUDA_ERROR_UNSUPPORTED_PTX_VERSION",
            c"the provided PTX was compiled with an unsupported toolchain.",
        ),
        400 => (c"CUDA_ERROR_INVALID_HANDLE", c"invalid resource handle"),
        500 => (c"CUDA_ERROR_NOT_FOUND", c"named symbol not found"),
        600 => (c"CUDA_ERROR_NOT_READY", c"device not ready"),
        700 => (
            c"CUDA_ERROR_ILLEGAL_ADDRESS",
            c"an illegal memory access was encountered",
        ),
        701 => (
            c"CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES",
            c"too many resources requested for launch",
        ),
        710 => (c"CUDA_ERROR_ASSERT", c"device-side assert triggered"),
        712 => (
            c"CUDA_ERROR_HOST_MEMORY_ALREADY_REGISTERED",
            c"part or all of the requested memory range is already mapped",
        ),
        713 => (
            c"CUDA_ERROR_HOST_MEMORY_NOT_REGISTERED",
            c"pointer does not correspond to a registered memory region",
        ),
        719 => (c"CUDA_ERROR_LAUNCH_FAILED", c"unspecified launch failure"),
        800 => (c"CUDA_ERROR_NOT_PERMITTED", c"operation not permitted"),
        801 => (c"CUDA_ERROR_NOT_SUPPORTED", c"operation not supported"),
        999 => (c"CUDA_ERROR_UNKNOWN", c"unknown error"),
        _ => return None,
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorString(code: c_int, s: *mut *const c_char) -> CUresult {
    api::call("cuGetErrorString", api::Lib::Driver, Sticky::Ignore, || {
        let (_, text) = error_name(code).ok_or(cu::INVALID_VALUE)?;
        // SAFETY: the caller passes a writable pointer.
        unsafe { out(s, text.as_ptr()) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuGetErrorName(code: c_int, s: *mut *const c_char) -> CUresult {
    api::call("cuGetErrorName", api::Lib::Driver, Sticky::Ignore, || {
        let (name, _) = error_name(code).ok_or(cu::INVALID_VALUE)?;
        // SAFETY: the caller passes a writable pointer.
        unsafe { out(s, name.as_ptr()) }
    })
}

// ---- devices ---------------------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetCount(n: *mut c_int) -> CUresult {
    api::call("cuDeviceGetCount", api::Lib::Driver, Sticky::Ignore, || {
        initialised()?;
        // SAFETY: writable int.
        unsafe { out(n, 1) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGet(d: *mut CUdevice, ordinal: c_int) -> CUresult {
    api::call("cuDeviceGet", api::Lib::Driver, Sticky::Ignore, || {
        device(ordinal)?;
        // SAFETY: writable int.
        unsafe { out(d, 0) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetName(name: *mut c_char, len: c_int, dev: CUdevice) -> CUresult {
    api::call("cuDeviceGetName", api::Lib::Driver, Sticky::Ignore, || {
        device(dev)?;
        if name.is_null() || len <= 0 {
            return Err(cu::INVALID_VALUE);
        }
        let n = config::get().profile.name.as_bytes();
        let k = n.len().min(len as usize - 1);
        // SAFETY: the caller's buffer holds `len` bytes; we write k + 1 ≤ len.
        unsafe {
            std::ptr::copy_nonoverlapping(n.as_ptr().cast(), name, k);
            *name.add(k) = 0;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceTotalMem_v2(bytes: *mut usize, dev: CUdevice) -> CUresult {
    api::call(
        "cuDeviceTotalMem_v2",
        api::Lib::Driver,
        Sticky::Ignore,
        || {
            device(dev)?;
            // SAFETY: writable size_t.
            unsafe { out(bytes, config::get().memory as usize) }
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetAttribute(
    v: *mut c_int,
    attr: c_int,
    dev: CUdevice,
) -> CUresult {
    api::call(
        "cuDeviceGetAttribute",
        api::Lib::Driver,
        Sticky::Ignore,
        || {
            device(dev)?;
            let c = config::get();
            let value = match c.profile.attribute(attr, c.memory) {
                Some(x) => x,
                None if (1..=160).contains(&attr) => {
                    report::once(
                        &format!("attr{attr}"),
                        &format!("note: device attribute {attr} is not modelled; reporting 0"),
                    );
                    0
                }
                None => return Err(cu::INVALID_VALUE),
            };
            // SAFETY: writable int.
            unsafe { out(v, value) }
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetPCIBusId(
    id: *mut c_char,
    len: c_int,
    dev: CUdevice,
) -> CUresult {
    api::call(
        "cuDeviceGetPCIBusId",
        api::Lib::Driver,
        Sticky::Ignore,
        || {
            device(dev)?;
            let (d, b, s) = config::get().profile.pci;
            let text = format!("{d:04x}:{b:02x}:{s:02x}.0");
            if id.is_null() || (len as usize) < text.len() + 1 {
                return Err(cu::INVALID_VALUE);
            }
            // SAFETY: the buffer holds `len` ≥ text + 1 bytes.
            unsafe {
                std::ptr::copy_nonoverlapping(text.as_ptr().cast(), id, text.len());
                *id.add(text.len()) = 0;
            }
            Ok(())
        },
    )
}

unsafe fn uuid(u: *mut u8, dev: CUdevice) -> Result<(), i32> {
    device(dev)?;
    if u.is_null() {
        return Err(cu::INVALID_VALUE);
    }
    let bytes = *b"cuemu-emulated-1";
    // SAFETY: a CUuuid is 16 bytes.
    unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), u, 16) };
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid(u: *mut u8, dev: CUdevice) -> CUresult {
    // SAFETY: forwarded.
    api::call(
        "cuDeviceGetUuid",
        api::Lib::Driver,
        Sticky::Ignore,
        || unsafe { uuid(u, dev) },
    )
}

#[no_mangle]
pub unsafe extern "C" fn cuDeviceGetUuid_v2(u: *mut u8, dev: CUdevice) -> CUresult {
    // SAFETY: forwarded.
    api::call(
        "cuDeviceGetUuid_v2",
        api::Lib::Driver,
        Sticky::Ignore,
        || unsafe { uuid(u, dev) },
    )
}

// ---- the primary context ---------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxRetain(ctx: *mut Handle, dev: CUdevice) -> CUresult {
    api::call(
        "cuDevicePrimaryCtxRetain",
        api::Lib::Driver,
        Sticky::Ignore,
        || {
            device(dev)?;
            RETAINED.fetch_add(1, Ordering::AcqRel);
            // SAFETY: writable pointer.
            unsafe { out(ctx, PRIMARY as Handle) }
        },
    )
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxRelease_v2(dev: CUdevice) -> CUresult {
    api::call(
        "cuDevicePrimaryCtxRelease_v2",
        api::Lib::Driver,
        Sticky::After,
        || {
            device(dev)?;
            if RETAINED.fetch_sub(1, Ordering::AcqRel) <= 0 {
                RETAINED.fetch_add(1, Ordering::AcqRel);
                return Err(cu::INVALID_CONTEXT);
            }
            Ok(())
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn cuDevicePrimaryCtxGetState(
    dev: CUdevice,
    flags: *mut c_uint,
    active: *mut c_int,
) -> CUresult {
    api::call(
        "cuDevicePrimaryCtxGetState",
        api::Lib::Driver,
        Sticky::Ignore,
        || {
            device(dev)?;
            // SAFETY: writable outputs.
            unsafe {
                out(flags, PRIMARY_FLAGS.load(Ordering::Acquire))?;
                out(active, i32::from(RETAINED.load(Ordering::Acquire) > 0))
            }
        },
    )
}

#[no_mangle]
pub extern "C" fn cuDevicePrimaryCtxSetFlags_v2(dev: CUdevice, flags: c_uint) -> CUresult {
    api::call(
        "cuDevicePrimaryCtxSetFlags_v2",
        api::Lib::Driver,
        Sticky::Ignore,
        || {
            device(dev)?;
            // The scheduling mode (`CU_CTX_SCHED_*`, the low 3 bits) is one of auto, spin,
            // yield, blocking sync; anything else there is invalid, as on a driver. It changes
            // nothing here: a host wait in the emulator always sleeps.
            if !matches!(flags & 7, 0 | 1 | 2 | 4) {
                return Err(cu::INVALID_VALUE);
            }
            PRIMARY_FLAGS.store(flags, Ordering::Release);
            Ok(())
        },
    )
}

#[no_mangle]
pub extern "C" fn cuCtxSetCurrent(ctx: Handle) -> CUresult {
    api::call("cuCtxSetCurrent", api::Lib::Driver, Sticky::Ignore, || {
        initialised()?;
        let c = ctx as usize;
        if c != 0 && c != PRIMARY {
            return Err(cu::INVALID_CONTEXT);
        }
        CURRENT.with(|x| x.set(c));
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetCurrent(ctx: *mut Handle) -> CUresult {
    api::call("cuCtxGetCurrent", api::Lib::Driver, Sticky::Ignore, || {
        initialised()?;
        // SAFETY: writable pointer.
        unsafe { out(ctx, CURRENT.with(Cell::get) as Handle) }
    })
}

#[no_mangle]
pub extern "C" fn cuCtxPushCurrent_v2(ctx: Handle) -> CUresult {
    cuCtxSetCurrent(ctx)
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxPopCurrent_v2(ctx: *mut Handle) -> CUresult {
    api::call(
        "cuCtxPopCurrent_v2",
        api::Lib::Driver,
        Sticky::Ignore,
        || {
            initialised()?;
            let c = CURRENT.with(|x| x.replace(0));
            if !ctx.is_null() {
                // SAFETY: writable pointer.
                unsafe { ctx.write(c as Handle) };
            }
            Ok(())
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetDevice(d: *mut CUdevice) -> CUresult {
    api::call("cuCtxGetDevice", api::Lib::Driver, Sticky::Ignore, || {
        context()?;
        // SAFETY: writable int.
        unsafe { out(d, 0) }
    })
}

#[no_mangle]
pub extern "C" fn cuCtxSynchronize() -> CUresult {
    api::driver("cuCtxSynchronize", || {
        context()?;
        crate::stream::synchronize_all();
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuCtxGetStreamPriorityRange(
    least: *mut c_int,
    greatest: *mut c_int,
) -> CUresult {
    api::driver("cuCtxGetStreamPriorityRange", || {
        context()?;
        if !least.is_null() {
            // SAFETY: writable int.
            unsafe { least.write(0) };
        }
        if !greatest.is_null() {
            // SAFETY: writable int.
            unsafe { greatest.write(-5) };
        }
        Ok(())
    })
}

// ---- device memory -----------------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuMemAlloc_v2(p: *mut CUdeviceptr, bytes: usize) -> CUresult {
    api::driver("cuMemAlloc_v2", || {
        context()?;
        if bytes == 0 || p.is_null() {
            return Err(cu::INVALID_VALUE);
        }
        let capacity = config::get().memory;
        let ptr = match mem().alloc(bytes, capacity) {
            Ok(x) => x,
            Err(AllocError::OutOfMemory) => return Err(cu::OUT_OF_MEMORY),
            Err(AllocError::Map) => {
                report::warning(&format!(
                    "cuMemAlloc of {bytes} bytes: the host could not map them"
                ));
                return Err(cu::OUT_OF_MEMORY);
            }
        };
        // SAFETY: writable pointer (checked non-null).
        unsafe { p.write(ptr) };
        Ok(())
    })
}

/// Why `ptr` cannot be freed — not an allocation, inside one rather than at its start, already
/// freed or being freed (a double free) — or `Ok`.
fn freeable(m: &memory::Memory, ptr: CUdeviceptr) -> Result<(), String> {
    match m.find(ptr) {
        Some(a) if a.base != ptr => Err(format!("0x{ptr:x} is inside {}, not its start", a.name())),
        Some(a) if a.freeing => Err(format!(
            "{} is already being freed by cuMemFreeAsync (a double free)",
            a.name()
        )),
        Some(_) => Ok(()),
        None => Err(m.freed(ptr).map_or_else(
            || format!("0x{ptr:x} is {}", m.describe(ptr)),
            |f| format!("{f} was already freed (a double free)"),
        )),
    }
}

#[no_mangle]
pub extern "C" fn cuMemFree_v2(ptr: CUdeviceptr) -> CUresult {
    api::call("cuMemFree_v2", api::Lib::Driver, Sticky::After, || {
        context()?;
        if ptr == 0 {
            return Ok(());
        }
        // cuMemFree synchronises with the work that still uses the allocation.
        loop {
            let mut m = mem();
            if let Err(why) = freeable(&m, ptr) {
                drop(m);
                report::error("invalid cuMemFree", &why);
                return Err(cu::INVALID_VALUE);
            }
            let Some(a) = m.find(ptr) else {
                return Err(cu::INVALID_VALUE);
            };
            if a.pending == 0 {
                if let Some((off, n)) = a.damaged_canary() {
                    let name = a.name();
                    let last = a.last_writer.clone();
                    drop(m);
                    report::error(
                        "out-of-bounds write",
                        &format!(
                            "{n} byte(s) at offset {off} outside {name} were overwritten (found when it was freed; last written by {})",
                            last.as_deref().unwrap_or("no kernel")
                        ),
                    );
                    m = mem();
                }
                m.free(ptr);
                return Ok(());
            }
            drop(m);
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    })
}

/// The command `cuMemFreeAsync` enqueues: frees the allocation when its stream reaches it,
/// once the work it holds is done (as `cuMemFree` waits).
struct FreeInOrder {
    ptr: CUdeviceptr,
}

impl Work for FreeInOrder {
    fn run(self: Box<Self>, _stream: &Stream) {
        loop {
            if api::sticky().is_some() {
                return;
            }
            let mut m = mem();
            let Some(a) = m.find(self.ptr) else {
                return;
            };
            // This command's own hold on it is the one left.
            if a.pending <= 1 {
                m.free(self.ptr);
                return;
            }
            drop(m);
            std::thread::sleep(std::time::Duration::from_micros(100));
        }
    }
}

/// `cuMemAllocAsync`: a stream-ordered allocation, usable by `stream`'s later work (and by other
/// streams ordered after it: the allocation counts as written by this command, so an unordered
/// use elsewhere is a stream hazard, as CUDA's rules make it).
#[no_mangle]
pub unsafe extern "C" fn cuMemAllocAsync(
    p: *mut CUdeviceptr,
    bytes: usize,
    stream: Handle,
) -> CUresult {
    api::driver("cuMemAllocAsync", || {
        context()?;
        if !config::get().memory_pools {
            return Err(cu::NOT_SUPPORTED);
        }
        if p.is_null() {
            return Err(cu::INVALID_VALUE);
        }
        let s = Stream::get(stream as usize)?;
        if bytes == 0 {
            // SAFETY: writable pointer (checked non-null).
            unsafe { p.write(0) };
            return Ok(());
        }
        let ptr = match mem().alloc(bytes, config::get().memory) {
            Ok(x) => x,
            Err(_) => return Err(cu::OUT_OF_MEMORY),
        };
        struct Nothing;
        impl Work for Nothing {
            fn run(self: Box<Self>, _stream: &Stream) {}
        }
        s.enqueue(
            Cmd::Work(Box::new(Nothing)),
            Arc::from(format!("cuMemAllocAsync of {bytes} bytes")),
            &[Touch {
                base: ptr,
                write: true,
            }],
            &[],
        )?;
        // SAFETY: writable pointer (checked non-null).
        unsafe { p.write(ptr) };
        Ok(())
    })
}

/// `cuMemFreeAsync`: frees in `stream`'s order; work on other streams that uses the allocation
/// must be ordered before it (else a stream hazard).
#[no_mangle]
pub extern "C" fn cuMemFreeAsync(ptr: CUdeviceptr, stream: Handle) -> CUresult {
    api::call("cuMemFreeAsync", api::Lib::Driver, Sticky::After, || {
        context()?;
        if !config::get().memory_pools {
            return Err(cu::NOT_SUPPORTED);
        }
        if ptr == 0 {
            return Ok(());
        }
        let s = Stream::get(stream as usize)?;
        {
            let m = mem();
            if let Err(why) = freeable(&m, ptr) {
                drop(m);
                report::error("invalid cuMemFree", &format!("cuMemFreeAsync: {why}"));
                return Err(cu::INVALID_VALUE);
            }
        }
        s.enqueue(
            Cmd::Work(Box::new(FreeInOrder { ptr })),
            Arc::from("cuMemFreeAsync"),
            &[Touch {
                base: ptr,
                write: true,
            }],
            &[],
        )?;
        // From here on, any command that uses it comes after its free.
        if let Some(a) = mem().by_base_mut(ptr) {
            a.freeing = true;
        }
        Ok(())
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemGetInfo_v2(free: *mut usize, total: *mut usize) -> CUresult {
    api::driver("cuMemGetInfo_v2", || {
        context()?;
        let cap = config::get().memory;
        let used = mem().used;
        // SAFETY: writable outputs.
        unsafe {
            out(free, cap.saturating_sub(used) as usize)?;
            out(total, cap as usize)
        }
    })
}

// ---- page-locked host memory -------------------------------------------------------------------------

unsafe fn host_alloc(pp: *mut *mut c_void, bytes: usize) -> Result<(), i32> {
    context()?;
    if pp.is_null() {
        return Err(cu::INVALID_VALUE);
    }
    let p = mem().alloc_pinned(bytes).ok_or(cu::OUT_OF_MEMORY)?;
    // SAFETY: writable pointer.
    unsafe { pp.write(p as *mut c_void) };
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostAlloc(
    pp: *mut *mut c_void,
    bytes: usize,
    _flags: c_uint,
) -> CUresult {
    // SAFETY: forwarded.
    api::driver("cuMemHostAlloc", || unsafe { host_alloc(pp, bytes) })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemAllocHost_v2(pp: *mut *mut c_void, bytes: usize) -> CUresult {
    // SAFETY: forwarded.
    api::driver("cuMemAllocHost_v2", || unsafe { host_alloc(pp, bytes) })
}

fn pending_host_error(call: &str, len: usize, base: usize, pending: u64) {
    report::error(
        "host memory released under a queued copy",
        &format!(
            "{call} of {len} bytes at 0x{base:x} while {pending} queued copy(ies) still use it: \
             the GPU's DMA would read or write memory that is no longer page-locked (drain the \
             streams first)"
        ),
    );
    api::set_sticky(cu::ILLEGAL_ADDRESS);
}

#[no_mangle]
pub extern "C" fn cuMemFreeHost(p: *mut c_void) -> CUresult {
    api::call("cuMemFreeHost", api::Lib::Driver, Sticky::After, || {
        context()?;
        let mut m = mem();
        let base = p as usize;
        match m.host_at(base) {
            Some(h) if matches!(h.kind, HostKind::Pinned { .. }) => {
                let (len, pending) = (h.len, h.pending);
                let r = m.remove_host(base);
                drop(m);
                if pending > 0 {
                    pending_host_error("cuMemFreeHost", len, base, pending);
                }
                if let Some(r) = r {
                    memory::unmap_pinned(r.kind);
                }
                Ok(())
            }
            _ => Err(cu::INVALID_VALUE),
        }
    })
}

#[no_mangle]
pub extern "C" fn cuMemHostRegister_v2(p: *mut c_void, bytes: usize, _flags: c_uint) -> CUresult {
    api::driver("cuMemHostRegister_v2", || {
        context()?;
        if p.is_null() || bytes == 0 {
            return Err(cu::INVALID_VALUE);
        }
        let mut m = mem();
        if m.host_overlaps(p as usize, bytes) {
            return Err(cu::HOST_MEMORY_ALREADY_REGISTERED);
        }
        m.add_host(p as usize, bytes, HostKind::Registered);
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuMemHostUnregister(p: *mut c_void) -> CUresult {
    api::call(
        "cuMemHostUnregister",
        api::Lib::Driver,
        Sticky::After,
        || {
            context()?;
            let mut m = mem();
            let base = p as usize;
            match m.host_at(base) {
                Some(h) if h.kind == HostKind::Registered => {
                    let (len, pending) = (h.len, h.pending);
                    m.remove_host(base);
                    drop(m);
                    if pending > 0 {
                        pending_host_error("cuMemHostUnregister", len, base, pending);
                    }
                    Ok(())
                }
                _ => Err(cu::HOST_MEMORY_NOT_REGISTERED),
            }
        },
    )
}

#[no_mangle]
pub unsafe extern "C" fn cuMemHostGetDevicePointer_v2(
    d: *mut CUdeviceptr,
    p: *mut c_void,
    _f: c_uint,
) -> CUresult {
    api::driver("cuMemHostGetDevicePointer_v2", || {
        context()?;
        if mem().host_containing(p as usize, 1).is_none() {
            return Err(cu::INVALID_VALUE);
        }
        // SAFETY: writable pointer. Unified addressing: the device sees the host address.
        unsafe { out(d, p as u64) }
    })
}

// ---- copies -------------------------------------------------------------------------------------------

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Dir {
    HtoD,
    DtoH,
    DtoD,
}

struct CopyWork {
    dst: u64,
    src: u64,
    bytes: usize,
    dir: Dir,
    /// A pageable source, copied at call time.
    staged: Option<Vec<u8>>,
    /// The registered host range the copy uses (checked when it runs).
    host: Option<(usize, usize)>,
    what: Arc<str>,
}

impl Work for CopyWork {
    fn run(self: Box<Self>, stream: &Stream) {
        if let Some((p, len)) = self.host {
            if mem().host_containing(p, len).is_none() {
                report::error(
                    "copy from unregistered host memory",
                    &format!(
                        "{} on {}: its host memory (0x{p:x}, {len} bytes) was unregistered or freed before the copy ran",
                        self.what, stream.name
                    ),
                );
                api::set_sticky(cu::ILLEGAL_ADDRESS);
                return;
            }
        }
        if self.dir == Dir::DtoH {
            // SAFETY: a device range checked when the copy was enqueued and kept alive by it.
            let src = unsafe { std::slice::from_raw_parts(self.src as *const u8, self.bytes) };
            if let Some((off, words)) = poisoned_words(src) {
                let m = mem();
                let (name, writer) = m.find(self.src).map_or_else(
                    || (String::new(), None),
                    |a| (a.name(), a.last_writer.clone()),
                );
                drop(m);
                report::error(
                    "read of never-written device memory",
                    &format!(
                        "{} on {} copies {words} word(s) to the host that nothing wrote since cuMemAlloc (or that were computed from such words), first at byte {off} of the copy from {name}; its last writer: {}",
                        self.what,
                        stream.name,
                        writer.as_deref().unwrap_or("none")
                    ),
                );
                api::set_sticky(cu::ILLEGAL_ADDRESS);
                return;
            }
        }
        let src = self
            .staged
            .as_ref()
            .map_or(self.src as *const u8, |v| v.as_ptr());
        // SAFETY: both ranges were checked at enqueue (device side inside one allocation,
        // host side registered or staged here) and are kept alive by the pending count.
        unsafe { std::ptr::copy(src, self.dst as *mut u8, self.bytes) };
    }
}

/// Enqueue a copy of `bytes` from `src` to `dst` on `stream`; with `sync`, wait for it.
fn copy(
    name: &str,
    dir: Dir,
    dst: u64,
    src: u64,
    bytes: usize,
    stream: usize,
    sync: bool,
) -> Result<(), i32> {
    context()?;
    if bytes == 0 {
        return Ok(());
    }
    let s = Stream::get(stream)?;
    let (dev, host) = match dir {
        Dir::HtoD => (dst, Some(src)),
        Dir::DtoH => (src, Some(dst)),
        Dir::DtoD => (dst, None),
    };
    let what: Arc<str> = Arc::from(format!(
        "{name} of {bytes} bytes ({})",
        match dir {
            Dir::HtoD => "host to device",
            Dir::DtoH => "device to host",
            Dir::DtoD => "device to device",
        }
    ));
    let mut touches = Vec::new();
    {
        let m = mem();
        let check = |p: u64| m.range(p, bytes).map(|a| a.base);
        let bad = |why: String| {
            report::error(
                "out-of-bounds copy",
                &format!("{what} on {}: {why}", s.name),
            );
            cu::INVALID_VALUE
        };
        let d = check(dev).map_err(bad)?;
        touches.push(Touch {
            base: d,
            write: dir != Dir::DtoH,
        });
        if dir == Dir::DtoD {
            let sb = check(src).map_err(bad)?;
            touches.push(Touch {
                base: sb,
                write: false,
            });
        }
    }
    let host_range = host.and_then(|h| {
        let m = mem();
        m.host_containing(h as usize, bytes)
            .map(|_| (h as usize, bytes))
    });
    let pageable = host.is_some() && host_range.is_none();
    let staged = if pageable && dir == Dir::HtoD {
        // CUDA stages a pageable source before returning: the caller may reuse it at once.
        // SAFETY: the caller's source range of `bytes` bytes.
        Some(unsafe { std::slice::from_raw_parts(src as *const u8, bytes) }.to_vec())
    } else {
        None
    };
    let hosts: Vec<usize> = host_range.map(|(p, _)| p).into_iter().collect();
    let work = CopyWork {
        dst,
        src,
        bytes,
        dir,
        staged,
        host: host_range,
        what: what.clone(),
    };
    let (seq, clock) = s.enqueue(Cmd::Work(Box::new(work)), what, &touches, &hosts)?;
    // A synchronous copy, or an asynchronous one into pageable memory, returns when it is done.
    if sync || (pageable && dir == Dir::DtoH) {
        s.wait_for(seq);
        clock::host_observes(&clock);
        if let Some(code) = api::sticky() {
            return Err(code);
        }
    }
    Ok(())
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoD_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    n: usize,
) -> CUresult {
    api::driver("cuMemcpyHtoD_v2", || {
        copy("cuMemcpyHtoD", Dir::HtoD, dst, src as u64, n, 0, true)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoH_v2(dst: *mut c_void, src: CUdeviceptr, n: usize) -> CUresult {
    api::driver("cuMemcpyDtoH_v2", || {
        copy("cuMemcpyDtoH", Dir::DtoH, dst as u64, src, n, 0, true)
    })
}

#[no_mangle]
pub extern "C" fn cuMemcpyDtoD_v2(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult {
    api::driver("cuMemcpyDtoD_v2", || {
        copy("cuMemcpyDtoD", Dir::DtoD, dst, src, n, 0, true)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyHtoDAsync_v2(
    dst: CUdeviceptr,
    src: *const c_void,
    n: usize,
    s: Handle,
) -> CUresult {
    api::driver("cuMemcpyHtoDAsync_v2", || {
        copy(
            "cuMemcpyHtoDAsync",
            Dir::HtoD,
            dst,
            src as u64,
            n,
            s as usize,
            false,
        )
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuMemcpyDtoHAsync_v2(
    dst: *mut c_void,
    src: CUdeviceptr,
    n: usize,
    s: Handle,
) -> CUresult {
    api::driver("cuMemcpyDtoHAsync_v2", || {
        copy(
            "cuMemcpyDtoHAsync",
            Dir::DtoH,
            dst as u64,
            src,
            n,
            s as usize,
            false,
        )
    })
}

#[no_mangle]
pub extern "C" fn cuMemcpyDtoDAsync_v2(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    n: usize,
    s: Handle,
) -> CUresult {
    api::driver("cuMemcpyDtoDAsync_v2", || {
        copy(
            "cuMemcpyDtoDAsync",
            Dir::DtoD,
            dst,
            src,
            n,
            s as usize,
            false,
        )
    })
}

/// Which way a unified-address copy goes.
fn direction(dst: u64, src: u64) -> Dir {
    let m = mem();
    match (m.find(dst).is_some(), m.find(src).is_some()) {
        (true, true) => Dir::DtoD,
        (true, false) => Dir::HtoD,
        _ => Dir::DtoH,
    }
}

#[no_mangle]
pub extern "C" fn cuMemcpy(dst: CUdeviceptr, src: CUdeviceptr, n: usize) -> CUresult {
    api::driver("cuMemcpy", || {
        copy("cuMemcpy", direction(dst, src), dst, src, n, 0, true)
    })
}

#[no_mangle]
pub extern "C" fn cuMemcpyAsync(
    dst: CUdeviceptr,
    src: CUdeviceptr,
    n: usize,
    s: Handle,
) -> CUresult {
    api::driver("cuMemcpyAsync", || {
        copy(
            "cuMemcpyAsync",
            direction(dst, src),
            dst,
            src,
            n,
            s as usize,
            false,
        )
    })
}

struct MemsetWork {
    dst: u64,
    value: u32,
    elem: usize,
    count: usize,
}

impl Work for MemsetWork {
    fn run(self: Box<Self>, _stream: &Stream) {
        for i in 0..self.count {
            let p = (self.dst as usize + i * self.elem) as *mut u8;
            let v = self.value.to_le_bytes();
            // SAFETY: the range was checked at enqueue and is kept alive by the pending count.
            unsafe { std::ptr::copy_nonoverlapping(v.as_ptr(), p, self.elem) };
        }
    }
}

fn memset(
    name: &str,
    dst: u64,
    value: u32,
    elem: usize,
    count: usize,
    stream: usize,
    sync: bool,
) -> Result<(), i32> {
    context()?;
    if count == 0 {
        return Ok(());
    }
    let s = Stream::get(stream)?;
    let what: Arc<str> = Arc::from(format!("{name} of {count} × {elem} bytes"));
    let base = {
        let m = mem();
        m.range(dst, count * elem).map(|a| a.base).map_err(|why| {
            report::error(
                "out-of-bounds memset",
                &format!("{what} on {}: {why}", s.name),
            );
            cu::INVALID_VALUE
        })?
    };
    let work = MemsetWork {
        dst,
        value,
        elem,
        count,
    };
    let (seq, clock) = s.enqueue(
        Cmd::Work(Box::new(work)),
        what,
        &[Touch { base, write: true }],
        &[],
    )?;
    if sync {
        s.wait_for(seq);
        clock::host_observes(&clock);
    }
    Ok(())
}

#[no_mangle]
pub extern "C" fn cuMemsetD8_v2(d: CUdeviceptr, v: u8, n: usize) -> CUresult {
    api::driver("cuMemsetD8_v2", || {
        memset("cuMemsetD8", d, u32::from(v), 1, n, 0, true)
    })
}

#[no_mangle]
pub extern "C" fn cuMemsetD16_v2(d: CUdeviceptr, v: u16, n: usize) -> CUresult {
    api::driver("cuMemsetD16_v2", || {
        memset("cuMemsetD16", d, u32::from(v), 2, n, 0, true)
    })
}

#[no_mangle]
pub extern "C" fn cuMemsetD32_v2(d: CUdeviceptr, v: u32, n: usize) -> CUresult {
    api::driver("cuMemsetD32_v2", || {
        memset("cuMemsetD32", d, v, 4, n, 0, true)
    })
}

#[no_mangle]
pub extern "C" fn cuMemsetD8Async(d: CUdeviceptr, v: u8, n: usize, s: Handle) -> CUresult {
    api::driver("cuMemsetD8Async", || {
        memset("cuMemsetD8Async", d, u32::from(v), 1, n, s as usize, false)
    })
}

#[no_mangle]
pub extern "C" fn cuMemsetD16Async(d: CUdeviceptr, v: u16, n: usize, s: Handle) -> CUresult {
    api::driver("cuMemsetD16Async", || {
        memset("cuMemsetD16Async", d, u32::from(v), 2, n, s as usize, false)
    })
}

#[no_mangle]
pub extern "C" fn cuMemsetD32Async(d: CUdeviceptr, v: u32, n: usize, s: Handle) -> CUresult {
    api::driver("cuMemsetD32Async", || {
        memset("cuMemsetD32Async", d, v, 4, n, s as usize, false)
    })
}

// ---- streams -------------------------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreate(s: *mut Handle, _flags: c_uint) -> CUresult {
    api::driver("cuStreamCreate", || {
        context()?;
        // SAFETY: writable pointer.
        unsafe { out(s, Stream::new_handle() as Handle) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuStreamCreateWithPriority(
    s: *mut Handle,
    _flags: c_uint,
    _prio: c_int,
) -> CUresult {
    api::driver("cuStreamCreateWithPriority", || {
        context()?;
        // SAFETY: writable pointer.
        unsafe { out(s, Stream::new_handle() as Handle) }
    })
}

#[no_mangle]
pub extern "C" fn cuStreamDestroy_v2(s: Handle) -> CUresult {
    api::call(
        "cuStreamDestroy_v2",
        api::Lib::Driver,
        Sticky::After,
        || {
            context()?;
            Stream::destroy(s as usize)
        },
    )
}

#[no_mangle]
pub extern "C" fn cuStreamSynchronize(s: Handle) -> CUresult {
    api::driver("cuStreamSynchronize", || {
        context()?;
        Stream::get(s as usize)?.synchronize();
        api::sticky().map_or(Ok(()), Err)
    })
}

#[no_mangle]
pub extern "C" fn cuStreamQuery(s: Handle) -> CUresult {
    api::driver("cuStreamQuery", || {
        context()?;
        let st = Stream::get(s as usize)?;
        let clock = st.clock();
        if st.progress().1 {
            clock::host_observes(&clock);
            Ok(())
        } else {
            Err(cu::NOT_READY)
        }
    })
}

#[no_mangle]
pub extern "C" fn cuStreamWaitEvent(s: Handle, e: Handle, _flags: c_uint) -> CUresult {
    api::driver("cuStreamWaitEvent", || {
        context()?;
        let st = Stream::get(s as usize)?;
        let ev = Event::get(e as usize)?;
        if let Some(r) = ev.recording() {
            st.inherit(&r.clock);
            st.enqueue(
                Cmd::Wait {
                    stream: r.stream.clone(),
                    seq: r.seq,
                },
                Arc::from(format!("a wait for an event on {}", r.stream.name)),
                &[],
                &[],
            )?;
        }
        Ok(())
    })
}

/// A stream's wait on a 32-bit word (`cuStreamWaitValue32`): the stream stops until the
/// condition holds, polling the word as the GPU's front end does.
struct WaitValue {
    addr: usize,
    value: u32,
    flags: c_uint,
}

impl WaitValue {
    fn holds(&self) -> bool {
        // SAFETY: checked at enqueue to be 4 bytes of page-locked host memory or of a device
        // allocation, kept alive by the program while the wait is queued (as CUDA requires).
        let x = unsafe { std::ptr::read_volatile(self.addr as *const u32) };
        match self.flags & 0xf {
            // GEQ compares cyclically: (int32)(x - value) >= 0.
            0 => (x.wrapping_sub(self.value) as i32) >= 0,
            1 => x == self.value,
            2 => x & self.value != 0,
            _ => !(x | self.value) != 0,
        }
    }
}

impl Work for WaitValue {
    fn run(self: Box<Self>, _stream: &Stream) {
        let mut nap = 1u64;
        while !self.holds() {
            if api::sticky().is_some() {
                return;
            }
            std::thread::sleep(std::time::Duration::from_micros(nap));
            nap = (nap * 2).min(200);
        }
        std::sync::atomic::fence(Ordering::Acquire);
    }
}

fn wait_value32(name: &str, s: Handle, addr: CUdeviceptr, value: u32, flags: c_uint) -> CUresult {
    api::driver(name, || {
        context()?;
        let st = Stream::get(s as usize)?;
        // GEQ, EQ, AND, NOR; FLUSH (1 << 30) changes nothing here.
        if flags & !(0xf | (1 << 30)) != 0 || flags & 0xf > 3 || !addr.is_multiple_of(4) {
            return Err(cu::INVALID_VALUE);
        }
        {
            let m = mem();
            let host = m.host_containing(addr as usize, 4).is_some();
            if !host && m.range(addr, 4).is_err() {
                let why = m.describe(addr);
                drop(m);
                report::error(
                    "invalid pointer argument",
                    &format!(
                        "{name}: 0x{addr:x} is {why}, not page-locked host memory or device memory"
                    ),
                );
                return Err(cu::INVALID_VALUE);
            }
        }
        st.enqueue(
            Cmd::Work(Box::new(WaitValue {
                addr: addr as usize,
                value,
                flags,
            })),
            Arc::from(format!("a wait for the value at 0x{addr:x} (≥ {value})")),
            &[],
            &[],
        )?;
        Ok(())
    })
}

#[no_mangle]
pub extern "C" fn cuStreamWaitValue32_v2(
    s: Handle,
    addr: CUdeviceptr,
    value: u32,
    flags: c_uint,
) -> CUresult {
    wait_value32("cuStreamWaitValue32_v2", s, addr, value, flags)
}

#[no_mangle]
pub extern "C" fn cuStreamWaitValue32(
    s: Handle,
    addr: CUdeviceptr,
    value: u32,
    flags: c_uint,
) -> CUresult {
    wait_value32("cuStreamWaitValue32", s, addr, value, flags)
}

#[no_mangle]
pub extern "C" fn cuLaunchHostFunc(
    s: Handle,
    f: Option<unsafe extern "C" fn(*mut c_void)>,
    data: *mut c_void,
) -> CUresult {
    api::driver("cuLaunchHostFunc", || {
        context()?;
        let f = f.ok_or(cu::INVALID_VALUE)?;
        let st = Stream::get(s as usize)?;
        st.enqueue(
            Cmd::HostFn {
                f,
                data: data as usize,
            },
            Arc::from("a host function"),
            &[],
            &[],
        )?;
        Ok(())
    })
}

// ---- events --------------------------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuEventCreate(e: *mut Handle, flags: c_uint) -> CUresult {
    api::driver("cuEventCreate", || {
        context()?;
        // SAFETY: writable pointer.
        unsafe { out(e, Event::create(flags) as Handle) }
    })
}

#[no_mangle]
pub extern "C" fn cuEventDestroy_v2(e: Handle) -> CUresult {
    api::call("cuEventDestroy_v2", api::Lib::Driver, Sticky::After, || {
        context()?;
        Event::destroy(e as usize)
    })
}

#[no_mangle]
pub extern "C" fn cuEventRecord(e: Handle, s: Handle) -> CUresult {
    api::driver("cuEventRecord", || {
        context()?;
        Event::get(e as usize)?.record(&Stream::get(s as usize)?)
    })
}

#[no_mangle]
pub extern "C" fn cuEventRecordWithFlags(e: Handle, s: Handle, _flags: c_uint) -> CUresult {
    cuEventRecord(e, s)
}

#[no_mangle]
pub extern "C" fn cuEventQuery(e: Handle) -> CUresult {
    api::driver("cuEventQuery", || {
        context()?;
        if Event::get(e as usize)?.query() {
            Ok(())
        } else {
            Err(cu::NOT_READY)
        }
    })
}

#[no_mangle]
pub extern "C" fn cuEventSynchronize(e: Handle) -> CUresult {
    api::driver("cuEventSynchronize", || {
        context()?;
        Event::get(e as usize)?.synchronize();
        api::sticky().map_or(Ok(()), Err)
    })
}

unsafe fn elapsed(ms: *mut f32, a: Handle, b: Handle) -> Result<(), i32> {
    context()?;
    let (ea, eb) = (Event::get(a as usize)?, Event::get(b as usize)?);
    if (ea.flags | eb.flags) & 2 != 0 {
        return Err(cu::INVALID_HANDLE);
    }
    let (Some(ra), Some(rb)) = (ea.recording(), eb.recording()) else {
        return Err(cu::INVALID_HANDLE);
    };
    if !ra.stream.completed(ra.seq) || !rb.stream.completed(rb.seq) {
        return Err(cu::NOT_READY);
    }
    let ta = *ra.time.lock().unwrap_or_else(|e| e.into_inner());
    let tb = *rb.time.lock().unwrap_or_else(|e| e.into_inner());
    let (Some(ta), Some(tb)) = (ta, tb) else {
        // Completed without running: the context failed.
        return Err(api::sticky().unwrap_or(cu::NOT_READY));
    };
    let v = if tb >= ta {
        tb.duration_since(ta).as_secs_f64()
    } else {
        -ta.duration_since(tb).as_secs_f64()
    };
    // SAFETY: writable float.
    unsafe { out(ms, (v * 1e3) as f32) }
}

#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime(ms: *mut f32, a: Handle, b: Handle) -> CUresult {
    // SAFETY: forwarded.
    api::driver("cuEventElapsedTime", || unsafe { elapsed(ms, a, b) })
}

#[no_mangle]
pub unsafe extern "C" fn cuEventElapsedTime_v2(ms: *mut f32, a: Handle, b: Handle) -> CUresult {
    // SAFETY: forwarded.
    api::driver("cuEventElapsedTime_v2", || unsafe { elapsed(ms, a, b) })
}

// ---- modules and launches ------------------------------------------------------------------------------

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadData(m: *mut Handle, image: *const c_void) -> CUresult {
    api::driver("cuModuleLoadData", || {
        context()?;
        // SAFETY: the caller's image (PTX string or ELF).
        let h = unsafe { launch::load_module(image.cast()) }?;
        // SAFETY: writable pointer.
        unsafe { out(m, h as Handle) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoadDataEx(
    m: *mut Handle,
    image: *const c_void,
    _n: c_uint,
    _opts: *mut c_int,
    _vals: *mut *mut c_void,
) -> CUresult {
    // SAFETY: forwarded.
    unsafe { cuModuleLoadData(m, image) }
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleLoad(m: *mut Handle, path: *const c_char) -> CUresult {
    api::driver("cuModuleLoad", || {
        context()?;
        if path.is_null() {
            return Err(cu::INVALID_VALUE);
        }
        // SAFETY: a NUL-terminated path.
        let p = unsafe { CStr::from_ptr(path) }
            .to_string_lossy()
            .into_owned();
        let mut bytes = std::fs::read(&p).map_err(|_| cu::NOT_FOUND)?;
        bytes.push(0);
        // SAFETY: a complete image, NUL-terminated for the PTX case.
        let h = unsafe { launch::load_module(bytes.as_ptr()) }?;
        // SAFETY: writable pointer.
        unsafe { out(m, h as Handle) }
    })
}

#[no_mangle]
pub extern "C" fn cuModuleUnload(m: Handle) -> CUresult {
    api::call("cuModuleUnload", api::Lib::Driver, Sticky::After, || {
        context()?;
        launch::unload_module(m as usize)
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuModuleGetFunction(
    f: *mut Handle,
    m: Handle,
    name: *const c_char,
) -> CUresult {
    api::driver("cuModuleGetFunction", || {
        context()?;
        if name.is_null() {
            return Err(cu::INVALID_VALUE);
        }
        // SAFETY: a NUL-terminated name.
        let n = unsafe { CStr::from_ptr(name) }.to_string_lossy();
        let h = launch::get_function(m as usize, &n)?;
        // SAFETY: writable pointer.
        unsafe { out(f, h as Handle) }
    })
}

#[no_mangle]
pub unsafe extern "C" fn cuFuncGetAttribute(v: *mut c_int, attr: c_int, f: Handle) -> CUresult {
    api::driver("cuFuncGetAttribute", || {
        let func = launch::function(f as usize)?;
        let k = func.kernel();
        let p = &config::get().profile;
        let x = match attr {
            0 => 1024,
            1 => k.static_shared as i32,
            2 | 3 => 0,
            4 => 32,
            5 => {
                let (a, b) = func.program.ptx.version;
                (a * 10 + b) as i32
            }
            6 => p.cc.0 * 10 + p.cc.1,
            7 => 0,
            8 => {
                let opted = func.max_dynamic.load(Ordering::Relaxed);
                if opted > 0 {
                    opted as i32
                } else {
                    p.smem_block - k.static_shared as i32
                }
            }
            9 => -1,
            _ => return Err(cu::INVALID_VALUE),
        };
        // SAFETY: writable int.
        unsafe { out(v, x) }
    })
}

#[no_mangle]
pub extern "C" fn cuFuncSetAttribute(f: Handle, attr: c_int, value: c_int) -> CUresult {
    api::driver("cuFuncSetAttribute", || {
        let func = launch::function(f as usize)?;
        match attr {
            8 => {
                let p = &config::get().profile;
                if value < 0 || func.kernel().static_shared + value as usize > p.smem_optin as usize
                {
                    return Err(cu::INVALID_VALUE);
                }
                func.max_dynamic.store(value as usize, Ordering::Relaxed);
                Ok(())
            }
            9 => Ok(()),
            _ => Err(cu::INVALID_VALUE),
        }
    })
}

#[no_mangle]
pub extern "C" fn cuFuncSetCacheConfig(_f: Handle, _config: c_int) -> CUresult {
    api::driver("cuFuncSetCacheConfig", || Ok(()))
}

#[no_mangle]
pub unsafe extern "C" fn cuLaunchKernel(
    f: Handle,
    gx: c_uint,
    gy: c_uint,
    gz: c_uint,
    bx: c_uint,
    by: c_uint,
    bz: c_uint,
    shared: c_uint,
    s: Handle,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> CUresult {
    api::driver("cuLaunchKernel", || {
        context()?;
        // SAFETY: the caller's argument array, per the kernel's signature.
        unsafe {
            launch::launch(
                f as usize,
                Dim3 {
                    x: gx,
                    y: gy,
                    z: gz,
                },
                Dim3 {
                    x: bx,
                    y: by,
                    z: bz,
                },
                shared,
                s as usize,
                params,
                extra,
            )
        }
    })
}

/// NVIDIA's NVRTC looks up the driver's private export tables to learn about the installed
/// driver; they are undocumented and not emulated. Reported only with `CUEMU_LOG=1`: NVRTC
/// works without them.
#[no_mangle]
pub extern "C" fn cuGetExportTable(_table: *mut *const c_void, _id: *const c_void) -> CUresult {
    report::note("cuGetExportTable (NVRTC probing the driver): not emulated");
    cu::NOT_SUPPORTED
}
