//! The CUDA runtime: the driver checked, one context, the kernels compiled by NVRTC for the
//! device's compute capability and every function looked up up front, and event timing.

use super::nvrtc;
use crate::device::kernels::FILES;
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

/// The CUDA version the bindings are built for (cudarc feature `cuda-12080`).
pub const MIN_DRIVER: i32 = 12080;

/// A driver result as the crate's error, naming what was being done.
pub fn drv<T>(r: std::result::Result<T, cudarc::driver::DriverError>, op: &str) -> Result<T> {
    r.map_err(|e| Error::cuda(op, e))
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
    /// Driver version (e.g. 12080).
    pub driver: i32,
    /// PCI address, `dddd:bb:dd.0` (how the topology knows this GPU).
    pub pci_bus_id: String,
    functions: HashMap<&'static str, CudaFunction>,
}

impl CudaRuntime {
    /// Open GPU `ordinal`: check the driver, create the context, compile and load every kernel.
    pub fn open(ordinal: usize) -> Result<Self> {
        let mut rt = Self::open_context(ordinal)?;
        let tc = nvrtc::locate()?;
        nvrtc::load(&tc)?;
        nvrtc::load_cublas()?;
        let arch = format!("sm_{}{}", rt.cc.0, rt.cc.1);
        for (f, c) in FILES.iter().zip(nvrtc::compile_all(&tc, &arch)?) {
            // The CUBIN for this device, not the PTX: a driver older than NVRTC cannot JIT
            // its PTX ISA (CUDA_ERROR_UNSUPPORTED_PTX_VERSION), but runs its CUBIN.
            let module = drv(
                rt.ctx
                    .load_module(cudarc::nvrtc::Ptx::from_binary(c.cubin.clone())),
                &format!("load {} (CUBIN for {arch})", f.file),
            )?;
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
        Ok(rt)
    }

    /// Open GPU `ordinal` without the kernels (copies only: `bench link`).
    pub fn open_context(ordinal: usize) -> Result<Self> {
        // SAFETY: only probes for the library; cudarc panics on first use without it.
        if !unsafe { cudarc::driver::sys::is_culib_present() } {
            return Err(Error::system(
                "CUDA driver",
                "load libcuda.so.1",
                "no NVIDIA driver on this machine",
            )
            .with_fix(
                "run on a machine with an NVIDIA GPU and its driver (nvidia-smi must work)",
            ));
        }
        let mut v = 0;
        // SAFETY: writes one int.
        let r = unsafe { cudarc::driver::sys::cuDriverGetVersion(&mut v) };
        if r != cudarc::driver::sys::CUresult::CUDA_SUCCESS || v < MIN_DRIVER {
            return Err(Error::system(
                "CUDA driver",
                "version",
                format!(
                    "driver supports CUDA {}.{}, megatrain needs {}.{}",
                    v / 1000,
                    v % 1000 / 10,
                    MIN_DRIVER / 1000,
                    MIN_DRIVER % 1000 / 10
                ),
            )
            .with_fix("update the NVIDIA driver"));
        }
        let count = drv(CudaContext::device_count(), "count devices")?;
        if ordinal >= count.max(0) as usize {
            return Err(Error::bad_input(
                "GPU",
                ordinal.to_string(),
                format!("the driver sees {count} device(s)"),
                Some("check nvidia-smi and CUDA_VISIBLE_DEVICES"),
            ));
        }
        let ctx = drv(CudaContext::new(ordinal), "create a context")?;
        let name = drv(ctx.name(), "device name")?;
        let cc = drv(ctx.compute_capability(), "compute capability")?;
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
            driver: v,
            pci_bus_id,
            functions: HashMap::new(),
        })
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
