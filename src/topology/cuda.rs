//! GPU facts from the CUDA driver (feature `cuda`): name, memory, compute capability, SM count.
//!
//! cudarc loads libcuda at run time and panics when it is absent, so every entry point first asks
//! `is_culib_present()`. Without a driver the PCI-tree facts from hwloc stand alone.

use super::{CudaStatus, Gpu, GpuLink, LinkKind, Machine};
use cudarc::driver::{result, sys};

/// Query the driver and merge what it says into `m.gpus` (matched by PCI bus id).
pub fn merge_driver_facts(m: &mut Machine) {
    m.cuda = Some(match query() {
        Ok((version, devices)) => {
            let n = devices.len();
            for d in devices {
                merge(m, d);
            }
            CudaStatus {
                available: true,
                driver_api_version: Some(version),
                detail: format!("CUDA driver answered: {n} device(s)"),
            }
        }
        Err(why) => CudaStatus {
            available: false,
            driver_api_version: None,
            detail: why.to_string(),
        },
    });
}

struct DriverDevice {
    bus_id: String,
    name: String,
    memory_bytes: u64,
    compute_capability: String,
    multiprocessors: u32,
}

/// Why the driver could not be asked.
#[derive(Debug, thiserror::Error)]
enum Unanswered {
    #[error("libcuda not found (no NVIDIA driver on this machine, or not on the loader path)")]
    NoDriver,
    #[error("{call} failed: {error:?}")]
    Call {
        call: &'static str,
        error: result::DriverError,
    },
}

/// The `call` that returned `error`.
fn failed(call: &'static str) -> impl Fn(result::DriverError) -> Unanswered {
    move |error| Unanswered::Call { call, error }
}

fn query() -> Result<(String, Vec<DriverDevice>), Unanswered> {
    // SAFETY: only tries to dlopen libcuda; no CUDA call is made.
    if !unsafe { sys::is_culib_present() } {
        return Err(Unanswered::NoDriver);
    }
    result::init().map_err(failed("cuInit"))?;
    let mut v: std::ffi::c_int = 0;
    // SAFETY: cuDriverGetVersion writes one int through a valid pointer; the library is loaded.
    unsafe { sys::cuDriverGetVersion(&mut v) }
        .result()
        .map_err(failed("cuDriverGetVersion"))?;
    let version = format!("{}.{}", v / 1000, (v % 1000) / 10);
    let count = result::device::get_count().map_err(failed("cuDeviceGetCount"))?;
    let mut out = Vec::new();
    for ordinal in 0..count {
        let dev = result::device::get(ordinal).map_err(failed("cuDeviceGet"))?;
        let attr = |a: sys::CUdevice_attribute| -> Result<i32, Unanswered> {
            // SAFETY: `dev` came from cuDeviceGet above.
            unsafe { result::device::get_attribute(dev, a) }.map_err(failed("cuDeviceGetAttribute"))
        };
        use sys::CUdevice_attribute as A;
        let bus_id = format!(
            "{:04x}:{:02x}:{:02x}.0",
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_DOMAIN_ID)?,
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_BUS_ID)?,
            attr(A::CU_DEVICE_ATTRIBUTE_PCI_DEVICE_ID)?
        );
        // SAFETY: `dev` came from cuDeviceGet above.
        let memory =
            unsafe { result::device::total_mem(dev) }.map_err(failed("cuDeviceTotalMem"))?;
        out.push(DriverDevice {
            bus_id,
            name: result::device::get_name(dev).map_err(failed("cuDeviceGetName"))?,
            memory_bytes: memory as u64,
            compute_capability: format!(
                "{}.{}",
                attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MAJOR)?,
                attr(A::CU_DEVICE_ATTRIBUTE_COMPUTE_CAPABILITY_MINOR)?
            ),
            multiprocessors: u32::try_from(attr(A::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)?)
                .unwrap_or(0),
        });
    }
    Ok((version, out))
}

fn merge(m: &mut Machine, d: DriverDevice) {
    let idx = match m.gpus.iter().position(|g| g.pci_bus_id == d.bus_id) {
        Some(i) => i,
        None => {
            // hwloc could not see the PCI tree (e.g. a container without /sys/bus/pci).
            m.gpus.push(Gpu {
                index: m.gpus.len(),
                pci_bus_id: d.bus_id.clone(),
                vendor_id: super::pci_ids::NVIDIA_VENDOR,
                device_id: 0,
                name: None,
                memory_bytes: None,
                compute_capability: None,
                multiprocessors: None,
                link: GpuLink {
                    kind: LinkKind::Unknown,
                    pcie_generation: None,
                    pcie_width: None,
                    gbytes_per_s: None,
                    inferred: false,
                },
                driver_version: None,
                numa_nodes: Vec::new(),
                cpus: String::new(),
                memory_numa_node: None,
                discovered_by: "cuda".to_owned(),
            });
            m.gpus.len() - 1
        }
    };
    let g = &mut m.gpus[idx];
    g.name = Some(d.name);
    g.memory_bytes = Some(d.memory_bytes);
    g.compute_capability = Some(d.compute_capability);
    g.multiprocessors = Some(d.multiprocessors);
    if g.discovered_by == "pci" {
        g.discovered_by = "pci+cuda".to_owned();
    }
}
