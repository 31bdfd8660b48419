//! Modules, functions and kernel launches.
//!
//! `cuModuleLoadData` takes the PTX or CUBIN the emulated NVRTC produced (checking the PTX
//! version against the driver and a CUBIN's architecture against the device, as a driver
//! does) and finds the host build of the same program. `cuLaunchKernel` checks the launch
//! against the device's limits, copies the arguments, resolves every pointer argument to an
//! allocation (so the stream order can be checked and the kernel named if it faults), and
//! enqueues it. On its stream the grid runs block by block on a pool of host threads; with
//! `CUEMU_SCHEDULES` > 1 it runs again under other thread schedules and shared-memory poisons,
//! and results that differ mean a missing barrier, a race or a read of memory nothing wrote.

use crate::api::cu;
use crate::hostbuild::{self, Elem, Param, Program};
use crate::memory::mem;
use crate::profile::Profile;
use crate::simt::{self, BlockArgs, BlockResult, Dim3};
use crate::stream::{Cmd, Stream, Touch, Work};
use crate::{api, config, ptx, report};
use std::collections::HashMap;
use std::ffi::c_void;
use std::sync::atomic::{AtomicBool, AtomicU64, AtomicUsize, Ordering};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};

pub struct Module {
    pub program: Arc<Program>,
}

pub struct Function {
    pub program: Arc<Program>,
    pub index: usize,
    /// `CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES`.
    pub max_dynamic: AtomicUsize,
}

impl Function {
    pub fn kernel(&self) -> &hostbuild::Kernel {
        &self.program.kernels[self.index]
    }
}

fn modules() -> MutexGuard<'static, HashMap<usize, Arc<Module>>> {
    static M: OnceLock<Mutex<HashMap<usize, Arc<Module>>>> = OnceLock::new();
    M.get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

fn functions() -> MutexGuard<'static, HashMap<usize, Arc<Function>>> {
    static F: OnceLock<Mutex<HashMap<usize, Arc<Function>>>> = OnceLock::new();
    F.get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// Load a module image (PTX text or a CUBIN) for the emulated device.
///
/// # Safety
/// `image` points to a NUL-terminated PTX string or a complete ELF image.
pub unsafe fn load_module(image: *const u8) -> Result<usize, i32> {
    if image.is_null() {
        return Err(cu::INVALID_VALUE);
    }
    let c = config::get();
    let (cc_major, cc_minor) = c.profile.cc;
    let program = if let Some((sm, len)) = ptx::cubin(image) {
        let (major, minor) = (sm / 10, sm % 10);
        if major != cc_major as u32 || minor > cc_minor as u32 {
            report::warning(&format!(
                "cuModuleLoadData: a CUBIN for sm_{sm} cannot run on this sm_{cc_major}{cc_minor} device"
            ));
            return Err(cu::NO_BINARY_FOR_GPU);
        }
        // SAFETY: the ELF header says the image is `len` bytes long.
        let bytes = unsafe { std::slice::from_raw_parts(image, len) };
        hostbuild::program_for_image(bytes)
    } else {
        // SAFETY: the caller's contract: a NUL-terminated string.
        let text = unsafe { std::ffi::CStr::from_ptr(image.cast()) };
        let info = ptx::parse(&text.to_string_lossy()).map_err(|e| {
            report::warning(&format!("cuModuleLoadData: not PTX or a CUBIN ({e})"));
            cu::INVALID_IMAGE
        })?;
        let max = Profile::max_ptx(c.driver);
        if info.version > max {
            report::warning(&format!(
                "cuModuleLoadData: PTX ISA {}.{} is newer than this driver (CUDA {}.{}) can JIT \
                 (at most {}.{}): CUDA_ERROR_UNSUPPORTED_PTX_VERSION, as on a real driver",
                info.version.0,
                info.version.1,
                c.driver / 1000,
                c.driver % 1000 / 10,
                max.0,
                max.1
            ));
            return Err(cu::UNSUPPORTED_PTX_VERSION);
        }
        let sm: u32 = info
            .target
            .trim_start_matches("sm_")
            .trim_start_matches("compute_")
            .trim_end_matches(['a', 'f'])
            .parse()
            .unwrap_or(0);
        if sm > (cc_major * 10 + cc_minor) as u32 {
            report::warning(&format!(
                "cuModuleLoadData: PTX for {} cannot be JIT-compiled for this sm_{cc_major}{cc_minor} device",
                info.target
            ));
            return Err(cu::NO_BINARY_FOR_GPU);
        }
        hostbuild::program_for_image(text.to_bytes())
    };
    let Some(program) = program else {
        // Not a defect of the program (a real driver runs any valid image): the emulator's limit.
        report::warning(
            "cuModuleLoadData got a module the emulated NVRTC never compiled (in this process, or \
             in an earlier one with the same CUEMU_CACHE): CUDA_ERROR_INVALID_IMAGE; cuemu can only \
             run kernels whose source it has seen",
        );
        return Err(cu::INVALID_IMAGE);
    };
    let m = Arc::new(Module { program });
    let h = Arc::as_ptr(&m) as usize;
    modules().insert(h, m);
    Ok(h)
}

pub fn unload_module(h: usize) -> Result<(), i32> {
    modules().remove(&h).map(|_| ()).ok_or(cu::INVALID_HANDLE)
}

pub fn get_function(module: usize, name: &str) -> Result<usize, i32> {
    let m = modules().get(&module).cloned().ok_or(cu::INVALID_HANDLE)?;
    let index = m
        .program
        .kernels
        .iter()
        .position(|k| k.name == name)
        .ok_or(cu::NOT_FOUND)?;
    // One handle per (module, kernel): a second lookup returns the same function.
    let mut f = functions();
    if let Some((h, _)) = f
        .iter()
        .find(|(_, x)| Arc::ptr_eq(&x.program, &m.program) && x.index == index)
    {
        return Ok(*h);
    }
    let func = Arc::new(Function {
        program: m.program.clone(),
        index,
        max_dynamic: AtomicUsize::new(0),
    });
    let h = Arc::as_ptr(&func) as usize;
    f.insert(h, func);
    Ok(h)
}

pub fn function(h: usize) -> Result<Arc<Function>, i32> {
    functions().get(&h).cloned().ok_or(cu::INVALID_HANDLE)
}

/// A launch, ready to run on its stream.
struct Launch {
    func: Arc<Function>,
    grid: Dim3,
    block: Dim3,
    dynamic: usize,
    capacity: usize,
    /// Each argument's bytes (8-byte aligned storage).
    args: Vec<Vec<u64>>,
    what: Arc<str>,
    /// Allocations the pointer arguments point into: base, written, element type.
    allocs: Vec<(u64, bool, Elem)>,
}

static LAUNCHES: AtomicU64 = AtomicU64::new(0);

fn launch_error(what: &str, detail: String) -> i32 {
    report::error("invalid launch", &format!("{what}: {detail}"));
    cu::INVALID_VALUE
}

/// `cuLaunchKernel`.
///
/// # Safety
/// `params` holds one valid pointer per kernel parameter, each to a value of its size.
#[allow(clippy::too_many_arguments)]
pub unsafe fn launch(
    f: usize,
    grid: Dim3,
    block: Dim3,
    shared: u32,
    stream: usize,
    params: *mut *mut c_void,
    extra: *mut *mut c_void,
) -> Result<(), i32> {
    let func = function(f)?;
    let stream = Stream::get(stream)?;
    let k = func.kernel();
    let id = LAUNCHES.fetch_add(1, Ordering::Relaxed) + 1;
    let what = format!(
        "kernel {} (launch #{id}, grid {grid}, block {block})",
        k.name
    );
    if !extra.is_null() {
        report::once(
            "launch-extra",
            "unsupported: cuLaunchKernel with `extra` is not emulated",
        );
        return Err(cu::NOT_SUPPORTED);
    }
    let c = config::get();
    let p = &c.profile;
    if block.x == 0 || block.y == 0 || block.z == 0 || grid.x == 0 || grid.y == 0 || grid.z == 0 {
        return Err(launch_error(&what, "a zero grid or block dimension".into()));
    }
    if block.x > 1024 || block.y > 1024 || block.z > 64 || block.count() > 1024 {
        return Err(launch_error(
            &what,
            format!("block {block} exceeds the device's limits (1024 threads, 1024×1024×64)"),
        ));
    }
    if grid.y > 65535 || grid.z > 65535 || grid.x > i32::MAX as u32 {
        return Err(launch_error(
            &what,
            format!("grid {grid} exceeds the device's limits (2^31−1 × 65535 × 65535)"),
        ));
    }
    let dynamic = shared as usize;
    let opted = func.max_dynamic.load(Ordering::Relaxed);
    let capacity = if opted > 0 {
        (k.static_shared + opted).min(p.smem_optin as usize)
    } else {
        p.smem_block as usize
    };
    if k.static_shared + dynamic > capacity {
        return Err(launch_error(
            &what,
            format!(
                "{} bytes of static and {dynamic} bytes of dynamic shared memory exceed the {capacity} bytes a block may use{}",
                k.static_shared,
                if opted == 0 {
                    " (above 48 KiB needs cuFuncSetAttribute(MAX_DYNAMIC_SHARED_SIZE_BYTES))"
                } else {
                    ""
                }
            ),
        ));
    }
    if params.is_null() && !k.params.is_empty() {
        return Err(launch_error(&what, "kernelParams is null".into()));
    }
    let mut args = Vec::with_capacity(k.params.len());
    for (i, &size) in k.sizes.iter().enumerate() {
        // SAFETY: the caller's contract: params[i] points to `size` readable bytes.
        let src = unsafe { *params.add(i) } as *const u8;
        if src.is_null() {
            return Err(launch_error(
                &what,
                format!("argument {i} is a null pointer"),
            ));
        }
        let mut v = vec![0u64; size.div_ceil(8).max(1)];
        // SAFETY: `v` holds at least `size` bytes; `src` has `size` readable bytes.
        unsafe { std::ptr::copy_nonoverlapping(src, v.as_mut_ptr().cast::<u8>(), size) };
        args.push(v);
    }
    // Pointer arguments: in a live allocation (or page-locked host memory), or an error.
    let mut allocs: Vec<(u64, bool, Elem)> = Vec::new();
    {
        let m = mem();
        for (i, param) in k.params.iter().enumerate() {
            let (write, elem) = match *param {
                Param::Read(e) => (false, e),
                Param::Write(e) => (true, e),
                Param::Scalar(_) => continue,
            };
            let ptr = args[i][0];
            if ptr == 0 {
                continue;
            }
            if let Some(a) = m.find(ptr) {
                match allocs.iter_mut().find(|x| x.0 == a.base) {
                    Some(x) => x.1 |= write,
                    None => allocs.push((a.base, write, elem)),
                }
            } else if m.host_containing(ptr as usize, 1).is_none() {
                let why = match m.freed(ptr) {
                    Some(f) => format!("inside {f}, already freed (a use after free)"),
                    None => m.describe(ptr),
                };
                drop(m);
                report::error(
                    "invalid pointer argument",
                    &format!(
                        "{what} on {}: argument {i} = 0x{ptr:x} is {why}",
                        stream.name
                    ),
                );
                api::set_sticky(cu::ILLEGAL_ADDRESS);
                return Err(cu::ILLEGAL_ADDRESS);
            }
        }
    }
    let touches: Vec<Touch> = allocs
        .iter()
        .map(|&(base, write, _)| Touch { base, write })
        .collect();
    let what: Arc<str> = Arc::from(what);
    let l = Launch {
        func: func.clone(),
        grid,
        block,
        dynamic,
        capacity,
        args,
        what: what.clone(),
        allocs,
    };
    stream.enqueue(Cmd::Work(Box::new(l)), what, &touches, &[])?;
    Ok(())
}

/// Snapshot of the allocations a launch writes.
fn snapshot(allocs: &[(u64, bool, Elem)]) -> Vec<(u64, Vec<u8>)> {
    let m = mem();
    allocs
        .iter()
        .filter(|a| a.1)
        .filter_map(|&(base, _, _)| {
            let a = m.find(base)?;
            // SAFETY: a live allocation's bytes.
            let bytes = unsafe { std::slice::from_raw_parts(a.base as *const u8, a.size) };
            Some((base, bytes.to_vec()))
        })
        .collect()
}

fn restore(snap: &[(u64, Vec<u8>)]) {
    for (base, bytes) in snap {
        // SAFETY: the allocation was live when snapshotted and a running launch keeps it
        // pending (cuMemFree waits for it).
        unsafe { std::ptr::copy_nonoverlapping(bytes.as_ptr(), *base as *mut u8, bytes.len()) };
    }
}

/// The first element where two runs' results differ beyond rounding: (offset, a, b).
fn differ(elem: Elem, a: &[u8], b: &[u8]) -> Option<(usize, String, String)> {
    fn check<T: Copy + std::fmt::Display>(
        a: &[u8],
        b: &[u8],
        n: usize,
        get: impl Fn(&[u8]) -> T,
        as_f64: impl Fn(T) -> f64,
    ) -> Option<(usize, String, String)> {
        let scale = a
            .chunks_exact(n)
            .map(|c| as_f64(get(c)).abs())
            .filter(|x| x.is_finite())
            .fold(1e-30f64, f64::max);
        for (i, (x, y)) in a.chunks_exact(n).zip(b.chunks_exact(n)).enumerate() {
            let (p, q) = (as_f64(get(x)), as_f64(get(y)));
            let same = if p.is_nan() || q.is_nan() {
                p.is_nan() && q.is_nan()
            } else {
                (p - q).abs() <= 1e-3 * scale || p == q
            };
            if !same {
                return Some((i * n, get(x).to_string(), get(y).to_string()));
            }
        }
        None
    }
    match elem {
        Elem::F32 => check(
            a,
            b,
            4,
            |c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]),
            f64::from,
        ),
        Elem::F64 => check(
            a,
            b,
            8,
            |c| {
                let mut v = [0u8; 8];
                v.copy_from_slice(c);
                f64::from_le_bytes(v)
            },
            |x| x,
        ),
        Elem::Bf16 => check(
            a,
            b,
            2,
            |c| f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16),
            f64::from,
        ),
        _ => a
            .iter()
            .zip(b)
            .position(|(x, y)| x != y)
            .map(|i| (i, format!("0x{:02x}", a[i]), format!("0x{:02x}", b[i]))),
    }
}

const POISONS: [u8; 3] = [0xFF, 0x7F, 0x3F];
const SCHEDULE_NAMES: [&str; 3] = ["forward", "reverse", "random"];

impl Launch {
    /// Run the grid once under `schedule`; the first block error.
    fn run_grid(&self, schedule: u32) -> Result<u64, Box<(Dim3, BlockResult)>> {
        let rt = match simt::runtime() {
            Ok(r) => r,
            Err(e) => {
                let mut r = BlockResult::new();
                r.code = 7;
                for (d, s) in r.message.iter_mut().zip(e.bytes()) {
                    *d = s as libc::c_char;
                }
                return Err(Box::new((Dim3::default(), r)));
            }
        };
        let k = self.func.kernel();
        let ptrs: Vec<usize> = self.args.iter().map(|a| a.as_ptr() as usize).collect();
        let (grid, block) = (self.grid, self.block);
        let total = grid.count();
        let job = BlockJob {
            run_block: rt.run_block,
            kernel: k.run,
            ptrs,
            grid,
            block,
            capacity: self.capacity,
            dynamic: self.dynamic,
            schedule,
            seed: config::get().seed,
            poison: POISONS[schedule as usize % 3],
            error: Mutex::new(None),
            switches: AtomicU64::new(0),
        };
        let job = Arc::new(job);
        let j = job.clone();
        pool().run(total, Arc::new(move |i| j.block(i)));
        let err = job.error.lock().unwrap_or_else(|e| e.into_inner()).take();
        match err {
            Some(e) => Err(Box::new(e)),
            None => Ok(job.switches.load(Ordering::Relaxed)),
        }
    }

    fn fail(&self, stream: &Stream, block: Dim3, r: &BlockResult) {
        let code = r.code;
        let msg = r.message();
        let at = format!(
            "{} on {}, block {block}, thread {}",
            self.what, stream.name, r.thread
        );
        match code {
            simt::FAULT => {
                let addr = r.fault_address;
                let place = if (r.shared_base..r.shared_end + 4096).contains(&addr) {
                    if addr >= r.shared_end {
                        format!(
                            "{} bytes past the end of the block's dynamic shared memory",
                            addr - r.shared_end
                        )
                    } else {
                        "in the block's shared memory".to_owned()
                    }
                } else {
                    mem().describe(addr)
                };
                report::error(
                    "out-of-bounds access",
                    &format!("{at}: memory fault at 0x{addr:x}, {place}"),
                );
                api::set_sticky(cu::ILLEGAL_ADDRESS);
            }
            simt::TRAP => {
                report::error("trap", &format!("{at}: {msg}"));
                api::set_sticky(cu::ASSERT);
            }
            simt::SHARED_OVERFLOW => {
                report::error("shared memory over the limit", &format!("{at}: {msg}"));
                api::set_sticky(cu::LAUNCH_OUT_OF_RESOURCES);
            }
            _ => {
                let kind = match code {
                    1 => "divergent barrier",
                    2 => "deadlock",
                    3 => "warp operation",
                    _ => "kernel error",
                };
                report::error(kind, &format!("{at}: {msg}"));
                api::set_sticky(cu::LAUNCH_FAILED);
            }
        }
    }

    /// Canaries of every allocation the launch may have written: an overrun inside the slack
    /// (one beyond it faulted on the guard page).
    fn check_canaries(&self, stream: &Stream) -> bool {
        let m = mem();
        let mut ok = true;
        for &(base, _, _) in &self.allocs {
            let Some(a) = m.find(base) else { continue };
            if let Some((off, n)) = a.damaged_canary() {
                report::error(
                    "out-of-bounds write",
                    &format!(
                        "{} on {} wrote {n} byte(s) {} {} (first at offset {off})",
                        self.what,
                        stream.name,
                        if off < 0 {
                            "before the start of"
                        } else {
                            "past the end of"
                        },
                        a.name()
                    ),
                );
                a.reset_canary();
                ok = false;
            }
        }
        ok
    }
}

impl Work for Launch {
    fn run(self: Box<Self>, stream: &Stream) {
        // `CUEMU_FAIL=launch:N`: the Nth kernel to run faults, as a kernel's illegal address
        // would (asynchronously: the launch call itself succeeded).
        if let Some(code) = api::injected("launch") {
            report::warning(&format!(
                "{} on {}: injected asynchronous fault",
                self.what, stream.name
            ));
            api::set_sticky(code);
            return;
        }
        let schedules = &config::get().schedules;
        let snap = if schedules.len() > 1 {
            snapshot(&self.allocs)
        } else {
            Vec::new()
        };
        let mut first: Option<Vec<(u64, Vec<u8>)>> = None;
        for (k, &schedule) in schedules.iter().enumerate() {
            if k > 0 {
                restore(&snap);
            }
            if let Err(e) = self.run_grid(schedule) {
                self.fail(stream, e.0, &e.1);
                return;
            }
            if !self.check_canaries(stream) {
                api::set_sticky(cu::ILLEGAL_ADDRESS);
                return;
            }
            if schedules.len() == 1 {
                break;
            }
            let now = snapshot(&self.allocs);
            match &first {
                None => first = Some(now),
                Some(f) => {
                    for ((base, a), (_, b)) in f.iter().zip(&now) {
                        let elem = self
                            .allocs
                            .iter()
                            .find(|x| x.0 == *base)
                            .map_or(Elem::Int(1), |x| x.2);
                        if let Some((off, x, y)) = differ(elem, a, b) {
                            let name = mem().find(*base).map(|a| a.name()).unwrap_or_default();
                            report::error(
                                "schedule-dependent result",
                                &format!(
                                    "{} on {}: its result depends on the order threads run — a missing __syncthreads, a race, or a read of memory nothing wrote ({} schedule with shared memory poisoned 0x{:02x}: {x}; {} schedule with 0x{:02x}: {y}; at byte {off} of {name})",
                                    self.what,
                                    stream.name,
                                    SCHEDULE_NAMES[0],
                                    POISONS[0],
                                    SCHEDULE_NAMES[schedule as usize % 3],
                                    POISONS[schedule as usize % 3],
                                ),
                            );
                            api::set_sticky(cu::LAUNCH_FAILED);
                            return;
                        }
                    }
                }
            }
        }
    }
}

/// What the block runners share for one grid.
struct BlockJob {
    run_block: unsafe extern "C" fn(*const BlockArgs, *mut BlockResult) -> i32,
    kernel: simt::KernelFn,
    ptrs: Vec<usize>,
    grid: Dim3,
    block: Dim3,
    capacity: usize,
    dynamic: usize,
    schedule: u32,
    seed: u64,
    poison: u8,
    error: Mutex<Option<(Dim3, BlockResult)>>,
    switches: AtomicU64,
}

impl BlockJob {
    /// Run block `i` (x fastest); false stops the grid.
    fn block(&self, i: u64) -> bool {
        let g = self.grid;
        let idx = Dim3 {
            x: (i % u64::from(g.x)) as u32,
            y: (i / u64::from(g.x) % u64::from(g.y)) as u32,
            z: (i / (u64::from(g.x) * u64::from(g.y))) as u32,
        };
        let mut params: Vec<*mut c_void> = self.ptrs.iter().map(|&p| p as *mut c_void).collect();
        let args = BlockArgs {
            kernel: self.kernel,
            params: params.as_mut_ptr(),
            grid: g,
            block: self.block,
            block_idx: idx,
            shared_capacity: self.capacity,
            dynamic_shared: self.dynamic,
            schedule: self.schedule,
            seed: self.seed,
            poison: self.poison,
        };
        let mut r = BlockResult::new();
        // SAFETY: the arguments point into the launch's own copies, alive for the grid; the
        // runtime writes only `r`.
        let code = unsafe { (self.run_block)(&args, &mut r) };
        self.switches.fetch_add(r.switches, Ordering::Relaxed);
        if code != 0 {
            let mut e = self.error.lock().unwrap_or_else(|e| e.into_inner());
            if e.is_none() {
                *e = Some((idx, r));
            }
            return false;
        }
        true
    }
}

type Task = Arc<dyn Fn(u64) -> bool + Send + Sync>;

struct Batch {
    task: Task,
    total: u64,
    next: AtomicU64,
    stop: AtomicBool,
    active: Mutex<usize>,
    idle: Condvar,
}

impl Batch {
    fn work(&self) {
        loop {
            if self.stop.load(Ordering::Relaxed) {
                break;
            }
            let i = self.next.fetch_add(1, Ordering::Relaxed);
            if i >= self.total {
                break;
            }
            if !(self.task)(i) {
                self.stop.store(true, Ordering::Relaxed);
            }
        }
        let mut a = self.active.lock().unwrap_or_else(|e| e.into_inner());
        *a -= 1;
        if *a == 0 {
            self.idle.notify_all();
        }
    }
}

/// Host threads running the blocks of one grid at a time (the calling stream thread joins in).
struct Pool {
    helpers: usize,
    slot: Mutex<(u64, Option<Arc<Batch>>)>,
    wake: Condvar,
    one_at_a_time: Mutex<()>,
}

fn pool() -> &'static Pool {
    static P: OnceLock<&'static Pool> = OnceLock::new();
    P.get_or_init(|| {
        let helpers = config::get().threads.saturating_sub(1);
        let p: &'static Pool = Box::leak(Box::new(Pool {
            helpers,
            slot: Mutex::new((0, None)),
            wake: Condvar::new(),
            one_at_a_time: Mutex::new(()),
        }));
        for n in 0..helpers {
            let _ = std::thread::Builder::new()
                .name(format!("cuemu-blocks-{n}"))
                .spawn(move || p.helper());
        }
        p
    })
}

impl Pool {
    fn helper(&self) {
        let mut seen = 0;
        loop {
            let batch = {
                let mut g = self.slot.lock().unwrap_or_else(|e| e.into_inner());
                while g.0 == seen || g.1.is_none() {
                    g = self.wake.wait(g).unwrap_or_else(|e| e.into_inner());
                }
                seen = g.0;
                g.1.clone()
            };
            if let Some(b) = batch {
                b.work();
            }
        }
    }

    fn run(&self, total: u64, task: Task) {
        let _one = self.one_at_a_time.lock().unwrap_or_else(|e| e.into_inner());
        let helpers = self.helpers.min(total.saturating_sub(1) as usize);
        let batch = Arc::new(Batch {
            task,
            total,
            next: AtomicU64::new(0),
            stop: AtomicBool::new(false),
            active: Mutex::new(1 + self.helpers),
            idle: Condvar::new(),
        });
        let _ = helpers;
        {
            let mut g = self.slot.lock().unwrap_or_else(|e| e.into_inner());
            g.0 += 1;
            g.1 = Some(batch.clone());
        }
        self.wake.notify_all();
        batch.work();
        let mut a = batch.active.lock().unwrap_or_else(|e| e.into_inner());
        while *a > 0 {
            a = batch.idle.wait(a).unwrap_or_else(|e| e.into_inner());
        }
        drop(a);
        self.slot.lock().unwrap_or_else(|e| e.into_inner()).1 = None;
    }
}
