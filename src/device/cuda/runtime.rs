//! The CUDA runtime: the CUDA stack chosen and checked (driver ≥ 12.8, NVRTC and cuBLAS of a
//! release the driver runs, headers of NVRTC's release; [`crate::device::stack`]), cudarc bound
//! to exactly those libraries, one context on an sm_80+ GPU with the synchronisation the host
//! needs, the kernels compiled for the device (once per process, cached on disk) with every
//! function looked up up front, and event timing.

use super::binding;
use super::nvrtc::{self, Provenance, Toolchain};
use crate::device::kernels::FILES;
use crate::device::stack::{self, Driver, Stack};
use crate::{Error, Result};
use cudarc::driver::{CudaContext, CudaFunction, CudaStream};
use std::collections::HashMap;
use std::sync::Arc;

/// A device address.
pub type DevPtr = u64;

/// Flags of an event that can be timed (`cuEventElapsedTime` fails on cudarc's default,
/// `CU_EVENT_DISABLE_TIMING`).
pub const TIMED: cudarc::driver::sys::CUevent_flags =
    cudarc::driver::sys::CUevent_flags::CU_EVENT_DEFAULT;

/// The oldest driver megatrain runs on (CUDA 12.8).
pub const MIN_DRIVER: i32 = stack::MIN_DRIVER;

/// The oldest GPU the kernels are written for: sm_80 (bf16 tensor-core `mma.sync`, 163 KiB of
/// shared memory per block).
pub const MIN_CC: (i32, i32) = (8, 0);

/// A driver result as the crate's error, naming what was being done.
pub fn drv<T>(r: std::result::Result<T, cudarc::driver::DriverError>, op: &str) -> Result<T> {
    r.map_err(|e| Error::cuda(op, e))
}

/// How a host thread waits for the GPU (`cuStreamSynchronize`, `cuEventSynchronize`):
/// `MEGATRAIN_CUDA_SYNC=block|spin|yield`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum SyncMode {
    /// Sleep until the GPU is done (`CU_CTX_SCHED_BLOCKING_SYNC`): the default, so a waiting
    /// thread leaves its core to the AdamW workers. The streamer itself never blocks in the
    /// driver (its poller queries events), so only whole-device waits use this.
    Block,
    /// Spin (`CU_CTX_SCHED_SPIN`): the lowest wake-up latency, one core busy per waiting thread.
    Spin,
    /// Spin, yielding the core between checks (`CU_CTX_SCHED_YIELD`).
    Yield,
}

impl SyncMode {
    /// From `MEGATRAIN_CUDA_SYNC` (unset: [`SyncMode::Block`]).
    pub fn from_env() -> Result<SyncMode> {
        match std::env::var("MEGATRAIN_CUDA_SYNC").as_deref() {
            Err(_) | Ok("") | Ok("block") => Ok(SyncMode::Block),
            Ok("spin") => Ok(SyncMode::Spin),
            Ok("yield") => Ok(SyncMode::Yield),
            Ok(other) => Err(Error::bad_input(
                "MEGATRAIN_CUDA_SYNC",
                other,
                "not a synchronisation mode",
                Some("use block (the default), spin or yield"),
            )),
        }
    }

    fn flag(self) -> u32 {
        use cudarc::driver::sys::CUctx_flags as F;
        (match self {
            SyncMode::Block => F::CU_CTX_SCHED_BLOCKING_SYNC,
            SyncMode::Spin => F::CU_CTX_SCHED_SPIN,
            SyncMode::Yield => F::CU_CTX_SCHED_YIELD,
        }) as u32
    }

    /// Its name.
    pub fn name(self) -> &'static str {
        match self {
            SyncMode::Block => "blocking",
            SyncMode::Spin => "spinning",
            SyncMode::Yield => "yielding",
        }
    }
}

/// An open device with every kernel loaded.
#[derive(Debug)]
pub struct CudaRuntime {
    /// The context.
    pub ctx: Arc<CudaContext>,
    /// A stream for one-off work (the self-test, link measurements).
    pub stream: Arc<CudaStream>,
    /// Device name.
    pub name: String,
    /// Compute capability.
    pub cc: (i32, i32),
    /// Multiprocessors.
    pub sms: u32,
    /// Shared memory a block may use once a kernel opts in (`MAX_SHARED_MEMORY_PER_BLOCK_OPTIN`:
    /// 227 KiB on an H100, 163 KiB on an A100); [`CudaRuntime::open`] opts every kernel in.
    pub smem_optin: usize,
    /// The driver.
    pub driver: Driver,
    /// The libraries in use (`None` when opened for copies only, [`CudaRuntime::open_context`]).
    pub stack: Option<Stack>,
    /// How the kernels came to be (compiled now, from the disk cache, or earlier in the process).
    pub kernels: Option<Provenance>,
    /// How host threads wait for the GPU.
    pub sync: SyncMode,
    /// PCI address, `dddd:bb:dd.0` (how the topology knows this GPU).
    pub pci_bus_id: String,
    functions: HashMap<&'static str, CudaFunction>,
}

/// The architectures this NVRTC compiles for (`nvrtcGetSupportedArchs`: 80, 86, 90, …).
fn nvrtc_archs() -> Vec<i32> {
    use cudarc::nvrtc::sys;
    let mut n = 0;
    // SAFETY: writes one int.
    if unsafe { sys::nvrtcGetNumSupportedArchs(&mut n) } != sys::nvrtcResult::NVRTC_SUCCESS {
        return Vec::new();
    }
    let mut v = vec![0; n.max(0) as usize];
    // SAFETY: `v` holds the `n` ints NVRTC reported.
    if unsafe { sys::nvrtcGetSupportedArchs(v.as_mut_ptr()) } != sys::nvrtcResult::NVRTC_SUCCESS {
        return Vec::new();
    }
    v
}

impl CudaRuntime {
    /// Open GPU `ordinal`: the CUDA stack found and checked, the context, every kernel
    /// compiled (or taken from the cache) and loaded.
    pub fn open(ordinal: usize) -> Result<Self> {
        let stack = Stack::open()?;
        binding::bind(&binding::DRIVER, &stack.driver.path)?;
        binding::bind(&binding::NVRTC, &stack.nvrtc.path)?;
        binding::bind(&binding::CUBLAS, &stack.cublas.path)?;
        let mut rt = Self::context(ordinal, stack.driver.clone())?;
        let arch = format!("sm_{}{}", rt.cc.0, rt.cc.1);
        let archs = nvrtc_archs();
        if !archs.is_empty() && !archs.contains(&(rt.cc.0 * 10 + rt.cc.1)) {
            return Err(Error::system(
                "NVRTC",
                stack.nvrtc.path.display().to_string(),
                format!(
                    "NVRTC {} cannot compile for {arch} ({}): it knows sm_{}",
                    stack.nvrtc.version,
                    rt.name,
                    archs
                        .iter()
                        .map(i32::to_string)
                        .collect::<Vec<_>>()
                        .join(", sm_")
                ),
            )
            .with_fix("use a newer NVRTC (MEGATRAIN_NVRTC_LIB or MEGATRAIN_CUDA_VENV)"));
        }
        let tc = Toolchain::new(&stack.nvrtc, &stack.headers);
        let (compiled, mut provenance) = nvrtc::compile_all_cached(&tc, &arch)?;
        for (i, (f, c)) in FILES.iter().zip(compiled.iter()).enumerate() {
            // The CUBIN for this device, not the PTX: a driver older than NVRTC cannot JIT
            // its PTX ISA (CUDA_ERROR_UNSUPPORTED_PTX_VERSION), but runs its CUBIN.
            let load = |cubin: &[u8]| {
                rt.ctx
                    .load_module(cudarc::nvrtc::Ptx::from_binary(cubin.to_vec()))
            };
            // What a driver says of an image it cannot run: a CUBIN from the cache it refuses is
            // compiled afresh, once (any other error is the error).
            let refused = |e: &cudarc::driver::DriverError| {
                use cudarc::driver::sys::CUresult as R;
                matches!(
                    e.0,
                    R::CUDA_ERROR_INVALID_IMAGE
                        | R::CUDA_ERROR_NO_BINARY_FOR_GPU
                        | R::CUDA_ERROR_INVALID_PTX
                        | R::CUDA_ERROR_UNSUPPORTED_PTX_VERSION
                        | R::CUDA_ERROR_INVALID_SOURCE
                )
            };
            let module = match load(&c.cubin) {
                Ok(m) => m,
                Err(e) if c.from_disk && refused(&e) => {
                    let fresh = nvrtc::refresh(&tc, &arch, i)?;
                    provenance.refreshed += 1;
                    drv(
                        load(&fresh.cubin),
                        &format!("load {} (CUBIN for {arch}, compiled afresh)", f.file),
                    )?
                }
                Err(e) => drv(Err(e), &format!("load {} (CUBIN for {arch})", f.file))?,
            };
            for k in f.kernels {
                let func = drv(module.load_function(k.name), &format!("find {}", k.name))?;
                // Opt in to the device's largest dynamic shared memory (beside the kernel's
                // static arrays): launches above 48 KiB fail without it.
                use cudarc::driver::sys::CUfunction_attribute as F;
                let fixed = drv(func.shared_size_bytes(), "static shared memory")?.max(0);
                let dynamic = (rt.smem_optin as i32).saturating_sub(fixed);
                drv(
                    func.set_attribute(F::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES, dynamic),
                    &format!("opt {} in to {dynamic} B of shared memory", k.name),
                )?;
                rt.functions.insert(k.name, func);
            }
        }
        rt.stack = Some(stack);
        rt.kernels = Some(provenance);
        Ok(rt)
    }

    /// Open GPU `ordinal` without the kernels or cuBLAS (copies only: `bench link`).
    pub fn open_context(ordinal: usize) -> Result<Self> {
        let driver = stack::supported_driver()?;
        binding::bind(&binding::DRIVER, &driver.path)?;
        Self::context(ordinal, driver)
    }

    /// The GPUs the driver shows this process, in ordinal order, each by its UUID (as
    /// `nvidia-smi -L` writes it, `GPU-…`): what data-parallel ranks compare to learn which of
    /// them share a GPU — `CUDA_VISIBLE_DEVICES` renumbers GPUs, a UUID names one.
    pub fn visible_gpus() -> Result<Vec<String>> {
        use cudarc::driver::result;
        let driver = stack::supported_driver()?;
        binding::bind(&binding::DRIVER, &driver.path)?;
        drv(result::init(), "initialise the driver")?;
        let count = drv(CudaContext::device_count(), "count devices")?;
        (0..count)
            .map(|i| {
                let dev = drv(result::device::get(i), "get the device")?;
                let id = drv(result::device::get_uuid(dev), "read the device's UUID")?;
                let b: Vec<u8> = id.bytes.iter().map(|&c| c as u8).collect();
                let hex = |r: std::ops::Range<usize>| {
                    b[r].iter().map(|x| format!("{x:02x}")).collect::<String>()
                };
                Ok(format!(
                    "GPU-{}-{}-{}-{}-{}",
                    hex(0..4),
                    hex(4..6),
                    hex(6..8),
                    hex(8..10),
                    hex(10..16)
                ))
            })
            .collect()
    }

    /// The context on GPU `ordinal` (an sm_80+ GPU), with the synchronisation mode set.
    fn context(ordinal: usize, driver: Driver) -> Result<Self> {
        let count = drv(CudaContext::device_count(), "count devices")?;
        if ordinal >= count.max(0) as usize {
            return Err(Error::bad_input(
                "GPU",
                ordinal.to_string(),
                format!("the driver sees {count} device(s)"),
                Some("check nvidia-smi and CUDA_VISIBLE_DEVICES"),
            ));
        }
        let sync = SyncMode::from_env()?;
        {
            use cudarc::driver::{result, sys};
            drv(result::init(), "initialise the driver")?;
            let dev = drv(result::device::get(ordinal as i32), "get the device")?;
            let (mut flags, mut active) = (0u32, 0i32);
            // SAFETY: writes one uint and one int.
            let r = unsafe { sys::cuDevicePrimaryCtxGetState(dev, &mut flags, &mut active) };
            drv(r.result(), "read the primary context's state")?;
            // An active primary context (a second runtime in this process) keeps its flags.
            if active == 0 {
                // SAFETY: a valid device; the primary context is not active yet.
                let r = unsafe { sys::cuDevicePrimaryCtxSetFlags_v2(dev, sync.flag()) };
                drv(r.result(), "set the primary context's synchronisation")?;
            }
        }
        let ctx = drv(CudaContext::new(ordinal), "create a context")?;
        let name = drv(ctx.name(), "device name")?;
        let cc = drv(ctx.compute_capability(), "compute capability")?;
        if cc < MIN_CC {
            return Err(Error::bad_input(
                "GPU",
                format!("{ordinal} ({name})"),
                format!(
                    "compute capability {}.{} (sm_{}{}); megatrain's kernels need sm_80 or newer (A100, A10, L40S, H100, H200, GH200, B200)",
                    cc.0, cc.1, cc.0, cc.1
                ),
                Some("run on an Ampere or newer GPU (choose it with --gpu N or CUDA_VISIBLE_DEVICES)"),
            ));
        }
        use cudarc::driver::sys::CUdevice_attribute as A;
        let attr = |a: A, what: &str| drv(ctx.attribute(a), what);
        let sms = attr(
            A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT,
            "multiprocessor count",
        )? as u32;
        let smem_optin = attr(
            A::CU_DEVICE_ATTRIBUTE_MAX_SHARED_MEMORY_PER_BLOCK_OPTIN,
            "shared memory per block (opt-in)",
        )?
        .max(0) as usize;
        let pci_bus_id = format!(
            "{:04x}:{:02x}:{:02x}.0",
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID, "PCI address")?,
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID, "PCI address")?,
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID, "PCI address")?
        );
        let stream = drv(ctx.new_stream(), "create a stream")?;
        Ok(CudaRuntime {
            ctx,
            stream,
            name,
            cc,
            sms,
            smem_optin,
            driver,
            stack: None,
            kernels: None,
            sync,
            pci_bus_id,
            functions: HashMap::new(),
        })
    }

    /// What this runtime runs on, one line each: the GPU, the driver and libraries with their
    /// files, the kernels' provenance, the synchronisation mode.
    pub fn describe(&self) -> Vec<String> {
        let mut v = vec![format!(
            "GPU {} (sm_{}{}, {} SMs, {})",
            self.name, self.cc.0, self.cc.1, self.sms, self.pci_bus_id
        )];
        match &self.stack {
            Some(s) => v.extend(s.lines()),
            None => v.push(format!(
                "CUDA driver   CUDA {} {}",
                self.driver.cuda,
                self.driver.path.display()
            )),
        }
        if let Some(k) = &self.kernels {
            v.push(format!(
                "kernels       {} compiled now, {} from the disk cache, {} compiled earlier in this process{} ({})",
                k.compiled,
                k.from_disk,
                k.from_process,
                if k.refreshed > 0 {
                    format!(", {} cached ones refused by the driver and compiled again", k.refreshed)
                } else {
                    String::new()
                },
                k.cache
                    .as_ref()
                    .map(|d| format!("cache {}", d.display()))
                    .unwrap_or_else(|| "cache off".into())
            ));
            if let Some(e) = &k.write_error {
                v.push(format!(
                    "              (the cache could not be written: {e})"
                ));
            }
        }
        v.push(format!(
            "host waits    {} (MEGATRAIN_CUDA_SYNC)",
            self.sync.name()
        ));
        v
    }

    /// Whether this is the CUDA emulator's device (`tools/cuemu.sh`), whose times are host
    /// times, never GPU figures.
    pub fn emulated(&self) -> bool {
        self.name.contains("(cuemu)")
    }

    /// A loaded kernel by name.
    pub fn function(&self, name: &str) -> Result<&CudaFunction> {
        self.functions
            .get(name)
            .ok_or_else(|| Error::internal("CUDA runtime", format!("kernel {name} is not loaded")))
    }

    /// Median milliseconds of `reps` runs of `f` on `self.stream` (after one warm-up), timed
    /// with events recorded around it; `other` is made to wait for the start so it can join in.
    pub fn time_ms(
        &self,
        other: Option<&CudaStream>,
        reps: usize,
        f: &mut dyn FnMut() -> Result<()>,
    ) -> Result<f64> {
        let mut v = Vec::new();
        for _ in 0..=reps.max(1) {
            let a = drv(self.ctx.new_event(Some(TIMED)), "create an event")?;
            let b = drv(self.ctx.new_event(Some(TIMED)), "create an event")?;
            drv(a.record(&self.stream), "record an event")?;
            if let Some(o) = other {
                drv(o.wait(&a), "wait on an event")?;
            }
            f()?;
            drv(b.record(&self.stream), "record an event")?;
            drv(b.synchronize(), "synchronize")?;
            v.push(f64::from(drv(a.elapsed_ms(&b), "time an event pair")?));
        }
        v.remove(0); // warm-up
        Ok(crate::util::median(v))
    }
}
