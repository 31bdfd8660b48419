//! What every exported function goes through: the result codes of the three libraries, the
//! context's sticky error (after a fault every call fails, as on a GPU), the rule that a host
//! function must not call CUDA, injected faults (`CUEMU_FAIL`), and a panic barrier (no unwind
//! crosses into C).

use crate::{config, report};
use std::cell::RefCell;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::Mutex;

/// `CUresult` values.
pub mod cu {
    pub const SUCCESS: i32 = 0;
    pub const INVALID_VALUE: i32 = 1;
    pub const OUT_OF_MEMORY: i32 = 2;
    pub const NOT_INITIALIZED: i32 = 3;
    pub const INVALID_DEVICE: i32 = 101;
    pub const INVALID_IMAGE: i32 = 200;
    pub const INVALID_CONTEXT: i32 = 201;
    pub const NO_BINARY_FOR_GPU: i32 = 209;
    pub const UNSUPPORTED_PTX_VERSION: i32 = 222;
    pub const INVALID_HANDLE: i32 = 400;
    pub const NOT_FOUND: i32 = 500;
    pub const NOT_READY: i32 = 600;
    pub const ILLEGAL_ADDRESS: i32 = 700;
    pub const LAUNCH_OUT_OF_RESOURCES: i32 = 701;
    pub const ASSERT: i32 = 710;
    pub const HOST_MEMORY_ALREADY_REGISTERED: i32 = 712;
    pub const HOST_MEMORY_NOT_REGISTERED: i32 = 713;
    pub const LAUNCH_FAILED: i32 = 719;
    pub const NOT_PERMITTED: i32 = 800;
    pub const NOT_SUPPORTED: i32 = 801;
    pub const UNKNOWN: i32 = 999;
}

/// `cublasStatus_t` values.
pub mod blas {
    pub const SUCCESS: i32 = 0;
    pub const NOT_INITIALIZED: i32 = 1;
    pub const INVALID_VALUE: i32 = 7;
    pub const EXECUTION_FAILED: i32 = 13;
    pub const NOT_SUPPORTED: i32 = 15;
}

/// `ncclResult_t` values.
pub mod nccl {
    pub const SUCCESS: i32 = 0;
    pub const UNHANDLED_CUDA_ERROR: i32 = 1;
    pub const SYSTEM_ERROR: i32 = 2;
    pub const INTERNAL_ERROR: i32 = 3;
    pub const INVALID_ARGUMENT: i32 = 4;
    pub const INVALID_USAGE: i32 = 5;
    pub const REMOTE_ERROR: i32 = 6;
}

/// `nvrtcResult` values.
pub mod nv {
    pub const SUCCESS: i32 = 0;
    pub const INVALID_INPUT: i32 = 3;
    pub const INVALID_PROGRAM: i32 = 4;
    pub const COMPILATION: i32 = 6;
    pub const INTERNAL_ERROR: i32 = 11;
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Lib {
    Driver,
    Cublas,
    Nvrtc,
    Nccl,
}

impl Lib {
    fn name(self) -> &'static str {
        match self {
            Lib::Driver => "libcuda",
            Lib::Cublas => "libcublas",
            Lib::Nvrtc => "libnvrtc",
            Lib::Nccl => "libnccl",
        }
    }

    fn unsupported_code(self) -> i32 {
        match self {
            Lib::Driver => cu::NOT_SUPPORTED,
            Lib::Cublas => blas::NOT_SUPPORTED,
            Lib::Nvrtc => nv::INTERNAL_ERROR,
            Lib::Nccl => nccl::INVALID_USAGE,
        }
    }
}

/// A function the emulator does not implement (the generated stubs): logged once.
pub fn unsupported(name: &str, lib: Lib) -> i32 {
    report::once(
        name,
        &format!(
            "unsupported: {name} ({}) is not emulated; it returned an error",
            lib.name()
        ),
    );
    lib.unsupported_code()
}

static STICKY: Mutex<Option<i32>> = Mutex::new(None);

/// Make the context fail from now on with `code` (a fault in a kernel or copy).
pub fn set_sticky(code: i32) {
    let mut g = STICKY.lock().unwrap_or_else(|e| e.into_inner());
    if g.is_none() {
        *g = Some(code);
        drop(g);
        // Its collectives will not run now: the other ranks' fail instead of waiting for them.
        crate::nccl::abort_all();
    }
}

pub fn sticky() -> Option<i32> {
    *STICKY.lock().unwrap_or_else(|e| e.into_inner())
}

thread_local! {
    /// Set while a host function (`cuLaunchHostFunc`) runs on this thread: what it is.
    static IN_HOST_FN: RefCell<Option<String>> = const { RefCell::new(None) };
}

/// Run `f` as host function `what` (no CUDA call may be made from it).
pub fn as_host_function(what: String, f: impl FnOnce()) {
    IN_HOST_FN.with(|c| *c.borrow_mut() = Some(what));
    f();
    IN_HOST_FN.with(|c| *c.borrow_mut() = None);
}

/// How a call treats the sticky error.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Sticky {
    /// Fail at once with it.
    Fail,
    /// Do the work (releasing resources), then return it.
    After,
    /// Unaffected (version and device queries, error strings).
    Ignore,
}

fn thread_name() -> String {
    let mut buf = [0 as libc::c_char; 64];
    // SAFETY: a buffer of 64 bytes for the calling thread's name (glibc writes at most 16).
    let r = unsafe { libc::pthread_getname_np(libc::pthread_self(), buf.as_mut_ptr(), buf.len()) };
    if r != 0 {
        return String::new();
    }
    // SAFETY: NUL-terminated by pthread_getname_np.
    unsafe { std::ffi::CStr::from_ptr(buf.as_ptr()) }
        .to_string_lossy()
        .into_owned()
}

/// Whether an injected fault (`CUEMU_FAIL`) hits this call of `name`: its code.
pub fn injected(name: &str) -> Option<i32> {
    static COUNTS: Mutex<Vec<u64>> = Mutex::new(Vec::new());
    let points = &config::get().fail;
    if points.is_empty() {
        return None;
    }
    let mut counts = COUNTS.lock().unwrap_or_else(|e| e.into_inner());
    counts.resize(points.len(), 0);
    let thread = thread_name();
    for (i, p) in points.iter().enumerate() {
        if p.function != name || p.thread.as_deref().is_some_and(|t| t != thread) {
            continue;
        }
        counts[i] += 1;
        if counts[i] == p.nth {
            report::warning(&format!(
                "injected failure: call {} to {name}{} returns {} (CUEMU_FAIL)",
                p.nth,
                if thread.is_empty() {
                    String::new()
                } else {
                    format!(" on thread {thread}")
                },
                p.code
            ));
            return Some(p.code);
        }
    }
    None
}

static CALLS: AtomicU64 = AtomicU64::new(0);

/// Calls per entry point (`CUEMU_COUNTS=1`).
static COUNTS: std::sync::Mutex<std::collections::BTreeMap<String, u64>> =
    std::sync::Mutex::new(std::collections::BTreeMap::new());

/// Count a call to `name`; the first one registers the report at exit.
fn count(name: &str) {
    static AT_EXIT: std::sync::Once = std::sync::Once::new();
    AT_EXIT.call_once(|| {
        // SAFETY: registers a plain `extern "C" fn()` with the C runtime.
        unsafe { libc::atexit(print_counts) };
    });
    let mut c = COUNTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    *c.entry(name.to_owned()).or_insert(0) += 1;
}

/// At exit: one line per entry point, `cuemu: count NAME N`, the most called first.
extern "C" fn print_counts() {
    let c = COUNTS
        .lock()
        .unwrap_or_else(std::sync::PoisonError::into_inner);
    let mut v: Vec<(&String, &u64)> = c.iter().collect();
    v.sort_by(|a, b| b.1.cmp(a.1).then(a.0.cmp(b.0)));
    for (name, n) in v {
        eprintln!("cuemu: count {name} {n}");
    }
}

/// The wrapper of every implemented entry point of `lib`.
pub fn call(name: &str, lib: Lib, sticky: Sticky, f: impl FnOnce() -> Result<(), i32>) -> i32 {
    CALLS.fetch_add(1, Ordering::Relaxed);
    if crate::config::get().counts {
        count(name);
    }
    let success = match lib {
        Lib::Driver => cu::SUCCESS,
        Lib::Cublas => blas::SUCCESS,
        Lib::Nvrtc => nv::SUCCESS,
        Lib::Nccl => nccl::SUCCESS,
    };
    if lib != Lib::Nvrtc {
        if let Some(what) = IN_HOST_FN.with(|c| c.borrow().clone()) {
            report::error(
                "CUDA call from a host function",
                &format!(
                    "{name} called from {what}; a host function must not call CUDA (CUDA returns \
                     cudaErrorNotPermitted or deadlocks)"
                ),
            );
            return match lib {
                Lib::Cublas => blas::EXECUTION_FAILED,
                Lib::Nccl => nccl::INVALID_USAGE,
                _ => cu::NOT_PERMITTED,
            };
        }
    }
    if let Some(code) = injected(name) {
        return code;
    }
    let pending = if lib == Lib::Nvrtc {
        None
    } else {
        sticky_code()
    };
    if let (Some(code), Sticky::Fail) = (pending, sticky) {
        return match lib {
            Lib::Cublas => blas::EXECUTION_FAILED,
            Lib::Nccl => nccl::UNHANDLED_CUDA_ERROR,
            _ => code,
        };
    }
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(f));
    let code = match r {
        Ok(Ok(())) => success,
        Ok(Err(code)) => code,
        Err(p) => {
            let msg = p
                .downcast_ref::<String>()
                .cloned()
                .or_else(|| p.downcast_ref::<&str>().map(|s| (*s).to_owned()))
                .unwrap_or_default();
            report::error(
                "internal emulator error",
                &format!("{name} panicked: {msg} (a bug in cuemu)"),
            );
            match lib {
                Lib::Driver => cu::UNKNOWN,
                Lib::Cublas => blas::EXECUTION_FAILED,
                Lib::Nvrtc => nv::INTERNAL_ERROR,
                Lib::Nccl => nccl::INTERNAL_ERROR,
            }
        }
    };
    match (pending.or_else(sticky_code), sticky, code == success) {
        (Some(s), Sticky::After | Sticky::Fail, true) if lib == Lib::Driver => s,
        _ => code,
    }
}

fn sticky_code() -> Option<i32> {
    sticky()
}

/// Shorthand for a driver entry point.
pub fn driver(name: &str, f: impl FnOnce() -> Result<(), i32>) -> i32 {
    call(name, Lib::Driver, Sticky::Fail, f)
}

/// Write `v` through an out-pointer the caller gave, or fail with `CUDA_ERROR_INVALID_VALUE`.
///
/// # Safety
/// `p` is null or valid for a write of `T`.
pub unsafe fn out<T>(p: *mut T, v: T) -> Result<(), i32> {
    if p.is_null() {
        return Err(cu::INVALID_VALUE);
    }
    // SAFETY: non-null, and the caller's contract makes it writable.
    unsafe { p.write(v) };
    Ok(())
}
