//! The machine description: what `megatrain probe` shows and what the planner reads.
//!
//! [`Machine`] is plain data (serde, versioned by [`SCHEMA_VERSION`]); `docs/probe-schema.md`
//! documents every field. It is built from hwloc ([`hwloc`]: the live machine, an XML export or a
//! synthetic description), completed on the live machine by Linux facts that hwloc does not report
//! ([`linux`]: free memory, huge pages, THP, memlock, io_uring, block devices) and, with the `cuda`
//! feature, by the CUDA driver ([`cuda`]). The affinity matrices come from [`links`], a pure
//! function over PCI paths.

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod hwloc;
pub mod links;
pub mod linux;
pub mod pci_ids;
pub mod render;

use serde::{Deserialize, Serialize};

pub use links::LinkClass;

/// Version of the JSON schema of [`Machine`]. Bump on any incompatible change.
pub const SCHEMA_VERSION: u32 = 1;

/// Where a [`Machine`] description came from.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
#[serde(tag = "kind", rename_all = "snake_case")]
pub enum Source {
    /// Probed on the machine that runs megatrain.
    Live,
    /// Read from an hwloc XML export.
    Xml {
        /// The file it was read from.
        path: String,
    },
    /// Built from an hwloc synthetic description.
    Synthetic {
        /// The description string.
        description: String,
    },
}

impl Source {
    /// True for the live machine (the only source with free memory, mounts, limits, ...).
    pub fn is_live(&self) -> bool {
        matches!(self, Source::Live)
    }
}

/// A whole machine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Machine {
    /// [`SCHEMA_VERSION`] of the writer.
    pub schema_version: u32,
    /// Where this description came from.
    pub source: Source,
    /// Host name, when known.
    pub hostname: Option<String>,
    /// Operating system and release, when known (e.g. "Linux 6.1.0").
    pub os: Option<String>,
    /// CPU architecture (e.g. "x86_64", "aarch64", "ppc64le"), when known.
    pub architecture: Option<String>,
    /// CPU packages (sockets).
    pub packages: Vec<Package>,
    /// Physical cores in the machine.
    pub cores: usize,
    /// Hardware threads (hwloc PUs) in the machine.
    pub hardware_threads: usize,
    /// NUMA nodes, in OS index order. Includes CPU-less nodes (GPU memory, HBM, CXL).
    pub numa_nodes: Vec<NumaNode>,
    /// Relative distances between NUMA nodes (ACPI SLIT: 10 = local), when the source has them.
    pub numa_distances: Option<NumaDistances>,
    /// Host-memory facts that matter for pinning and huge pages (live machine only).
    pub memory: HostMemory,
    /// io_uring support (live machine only).
    pub io_uring: Option<IoUringStatus>,
    /// The CUDA driver's answer (live machine, `cuda` feature only).
    pub cuda: Option<CudaStatus>,
    /// NVIDIA GPUs, ordered by PCI bus id (the order `CUDA_DEVICE_ORDER=PCI_BUS_ID` uses).
    pub gpus: Vec<Gpu>,
    /// GPU × GPU connection class, `nvidia-smi topo -m` legend; `gpu_links[i][j]` for GPUs i, j.
    pub gpu_links: Vec<Vec<LinkClass>>,
    /// GPU × NUMA node affinity; `gpu_numa[i][k]` for GPU i and `numa_nodes[k]`.
    pub gpu_numa: Vec<Vec<GpuNumaLink>>,
    /// Block devices (NVMe first), with their NUMA locality.
    pub block_devices: Vec<BlockDevice>,
}

/// A CPU package (socket).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct Package {
    /// OS index of the package.
    pub os_index: u32,
    /// CPU model string, when known.
    pub cpu_model: Option<String>,
    /// Physical cores in the package.
    pub cores: usize,
    /// Hardware threads in the package.
    pub hardware_threads: usize,
    /// OS indices of the NUMA nodes inside the package.
    pub numa_nodes: Vec<u32>,
}

/// What kind of memory a NUMA node holds.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum MemoryKind {
    /// Ordinary DRAM next to CPUs.
    Dram,
    /// High-bandwidth memory in the CPU package (Xeon Max flat mode, KNL MCDRAM).
    Hbm,
    /// A GPU's memory exposed as a CPU-less NUMA node (GH200, POWER9 + V100).
    GpuMemory,
    /// A CPU-less node of unknown kind (CXL memory, NVDIMM, ...).
    Other,
}

/// A NUMA node.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NumaNode {
    /// OS index (`P#` in lstopo, `nodeN` in sysfs, the number `numactl -m` takes).
    pub os_index: u32,
    /// What kind of memory it holds.
    pub kind: MemoryKind,
    /// OS index of the package it belongs to, if any.
    pub package: Option<u32>,
    /// Memory in bytes.
    pub memory_bytes: u64,
    /// Free memory in bytes (live machine only).
    pub free_bytes: Option<u64>,
    /// Memory the OS can give a new allocation on this node (live machine only): free memory
    /// plus the page cache and slab it can reclaim — the kernel's `MemAvailable` on one node,
    /// an estimate from the node's own counters on several, scaled to `MemAvailable`.
    #[serde(default)]
    pub available_bytes: Option<u64>,
    /// CPUs local to the node, in Linux list format ("0-13,112-125"); empty for CPU-less nodes.
    pub cpus: String,
    /// Number of hardware threads in `cpus`.
    pub hardware_threads: usize,
    /// Number of physical cores local to the node.
    pub cores: usize,
    /// For GPU memory nodes: the PCI bus id of the GPU that owns it.
    pub pci_bus_id: Option<String>,
    /// Huge pages of this node, one entry per page size.
    pub huge_pages: Vec<HugePages>,
}

/// A NUMA distance matrix.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct NumaDistances {
    /// hwloc's name of the matrix (e.g. "NUMALatency").
    pub name: String,
    /// OS indices of the nodes, the row/column order of `values`.
    pub nodes: Vec<u32>,
    /// `values[i][j]`: distance from `nodes[i]` to `nodes[j]`.
    pub values: Vec<Vec<u64>>,
}

impl NumaDistances {
    /// Distance between two nodes given by OS index.
    pub fn between(&self, a: u32, b: u32) -> Option<u64> {
        let i = self.nodes.iter().position(|&n| n == a)?;
        let j = self.nodes.iter().position(|&n| n == b)?;
        self.values.get(i)?.get(j).copied()
    }
}

/// Huge pages of one size.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct HugePages {
    /// Page size in bytes.
    pub page_bytes: u64,
    /// Pages reserved (`nr_hugepages`).
    pub total: u64,
    /// Pages free (live machine only).
    pub free: Option<u64>,
}

/// Host-memory facts (live machine only; `None`/empty from XML or synthetic sources).
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize, Deserialize)]
pub struct HostMemory {
    /// Machine-wide huge pages per page size.
    pub huge_pages: Vec<HugePages>,
    /// Transparent huge page mode (`always`, `madvise` or `never`).
    pub transparent_huge_pages: Option<String>,
    /// `RLIMIT_MEMLOCK` of this process.
    pub memlock: Option<MemlockLimit>,
    /// The memory limit of this process's cgroup, where one is set (a container, a Slurm job, a
    /// systemd slice).
    #[serde(default)]
    pub cgroup: Option<CgroupMemory>,
}

/// A cgroup's memory limit and use: the tightest limit among the process's cgroup and its
/// ancestors (v2 `memory.max`, v1 `memory.limit_in_bytes`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CgroupMemory {
    /// The cgroup that sets the limit (`/sys/fs/cgroup/...`).
    pub path: String,
    /// The limit in bytes.
    pub limit_bytes: u64,
    /// What the cgroup uses now (`memory.current`, v1 `memory.usage_in_bytes`).
    pub usage_bytes: u64,
    /// Of that, page cache the kernel can reclaim (`memory.stat`'s `inactive_file` +
    /// `active_file`).
    pub reclaimable_bytes: u64,
}

impl CgroupMemory {
    /// What a new allocation can still get under the limit.
    pub fn room_bytes(&self) -> u64 {
        self.limit_bytes
            .saturating_sub(self.usage_bytes.saturating_sub(self.reclaimable_bytes))
    }
}

/// The memlock limit; `None` fields mean unlimited.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct MemlockLimit {
    /// Soft limit in bytes, `None` = unlimited.
    pub soft_bytes: Option<u64>,
    /// Hard limit in bytes, `None` = unlimited.
    pub hard_bytes: Option<u64>,
}

/// Whether io_uring can be used, and why not.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct IoUringStatus {
    /// A ring could be created.
    pub available: bool,
    /// `kernel.io_uring_disabled` (0 allowed, 1 restricted, 2 disabled), when the sysctl exists.
    pub sysctl_disabled: Option<u8>,
    /// One line: what was tried and what happened.
    pub detail: String,
}

/// Whether the CUDA driver could be queried.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct CudaStatus {
    /// The driver answered.
    pub available: bool,
    /// CUDA driver API version ("12.8"), when it answered.
    pub driver_api_version: Option<String>,
    /// One line: what happened.
    pub detail: String,
}

/// The physical link between a GPU and the host.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "kebab-case")]
pub enum LinkKind {
    /// PCI Express.
    Pcie,
    /// Cache-coherent NVLink to the CPU (NVLink-C2C on Grace Hopper/Blackwell; NVLink 2 on POWER9).
    /// The GPU's memory then shows up as a NUMA node.
    CoherentNvlink,
    /// Unknown (e.g. synthetic topologies, scrubbed exports).
    Unknown,
}

/// A GPU's host link.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct GpuLink {
    /// What kind of link.
    pub kind: LinkKind,
    /// PCIe generation (1–6), when known.
    pub pcie_generation: Option<u8>,
    /// PCIe width in lanes, when known.
    pub pcie_width: Option<u8>,
    /// Raw link bandwidth in GB/s per direction as hwloc reports it (after encoding overhead).
    pub gbytes_per_s: Option<f64>,
    /// True when generation/width were inferred from the bandwidth (XML exports carry only that).
    pub inferred: bool,
}

impl GpuLink {
    /// Cache-coherent NVLink to the CPU: the GPU's memory is a NUMA node (no PCIe figures).
    pub fn coherent_nvlink() -> Self {
        GpuLink {
            kind: LinkKind::CoherentNvlink,
            pcie_generation: None,
            pcie_width: None,
            gbytes_per_s: None,
            inferred: false,
        }
    }
}

/// An NVIDIA GPU.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Gpu {
    /// Index in PCI bus order (what `CUDA_DEVICE_ORDER=PCI_BUS_ID` numbers it).
    pub index: usize,
    /// PCI bus id, `dddd:bb:dd.f`.
    pub pci_bus_id: String,
    /// PCI vendor id (0x10de for NVIDIA; 0 where the export scrubbed it).
    pub vendor_id: u16,
    /// PCI device id.
    pub device_id: u16,
    /// Marketing name, from the driver, hwloc, or our PCI id table.
    pub name: Option<String>,
    /// Device memory in bytes, when known.
    pub memory_bytes: Option<u64>,
    /// Compute capability "major.minor", when known.
    pub compute_capability: Option<String>,
    /// Streaming multiprocessors, when known.
    pub multiprocessors: Option<u32>,
    /// Host link.
    pub link: GpuLink,
    /// NVIDIA kernel driver version ("550.54.15"), read on the live machine.
    pub driver_version: Option<String>,
    /// OS indices of the CPU-attached NUMA nodes local to the GPU's PCI root.
    pub numa_nodes: Vec<u32>,
    /// CPUs local to the GPU, Linux list format.
    pub cpus: String,
    /// The NUMA node holding this GPU's own memory, where it is exposed as one (GH200, POWER9).
    pub memory_numa_node: Option<u32>,
    /// Where the facts came from: "pci" (hwloc PCI tree), "pci+cuda" (also the CUDA driver).
    pub discovered_by: String,
}

/// How a GPU reaches a NUMA node's memory.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct GpuNumaLink {
    /// `X` (the GPU's own memory), `PHB` (local: the node the GPU's host bridge hangs off) or
    /// `SYS` (crosses the inter-node / inter-socket interconnect).
    pub class: LinkClass,
    /// NUMA distance from the GPU's nearest local node to this node, when known.
    pub distance: Option<u64>,
}

/// A block device.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct BlockDevice {
    /// Kernel name ("nvme0n1", "sda", "vda").
    pub name: String,
    /// Transport: "nvme", "scsi", "virtio", "other".
    pub transport: String,
    /// Model string, when known.
    pub model: Option<String>,
    /// Size in bytes, when known.
    pub size_bytes: Option<u64>,
    /// Rotational (spinning disk), when known.
    pub rotational: Option<bool>,
    /// OS index of the NUMA node its PCI device is attached to, when known.
    pub numa_node: Option<u32>,
    /// PCI bus id of its controller, when known.
    pub pci_bus_id: Option<String>,
    /// Where it (or one of its partitions) is mounted (live machine only).
    pub mount_points: Vec<String>,
}

impl Machine {
    /// The index in `gpus` of the GPU at PCI address `bus_id` (`dddd:bb:dd.f`, any case) — how
    /// a CUDA device (whose ordinal depends on `CUDA_VISIBLE_DEVICES` and `CUDA_DEVICE_ORDER`)
    /// finds its place in the topology.
    pub fn gpu_by_pci_bus_id(&self, bus_id: &str) -> Option<usize> {
        self.gpus
            .iter()
            .position(|g| g.pci_bus_id.eq_ignore_ascii_case(bus_id))
    }

    /// Parse a machine description written by `megatrain probe --json`.
    pub fn from_json(text: &str, origin: &str) -> crate::Result<Self> {
        let m: Machine = serde_json::from_str(text).map_err(|e| {
            crate::Error::bad_input(
                "machine description",
                origin,
                format!("not a megatrain probe JSON: {e}"),
                Some("write one with `megatrain probe --json > machine.json`"),
            )
        })?;
        if m.schema_version != SCHEMA_VERSION {
            return Err(crate::Error::bad_input(
                "machine description",
                origin,
                format!(
                    "schema version {} but this megatrain reads version {SCHEMA_VERSION}",
                    m.schema_version
                ),
                Some("re-run `megatrain probe --json` with this version of megatrain"),
            ));
        }
        Ok(m)
    }

    /// Serialize as pretty JSON (the `--json` output).
    pub fn to_json(&self) -> String {
        // Serialization of plain data with string keys cannot fail.
        serde_json::to_string_pretty(self).unwrap_or_else(|e| format!("{{\"error\":\"{e}\"}}"))
    }

    /// Look up a NUMA node by OS index.
    pub fn numa_node(&self, os_index: u32) -> Option<&NumaNode> {
        self.numa_nodes.iter().find(|n| n.os_index == os_index)
    }

    /// Total memory of all NUMA nodes of the given kind.
    pub fn memory_bytes(&self, kind: MemoryKind) -> u64 {
        self.numa_nodes
            .iter()
            .filter(|n| n.kind == kind)
            .map(|n| n.memory_bytes)
            .sum()
    }
}

/// Where to read a topology from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum TopologySource {
    /// The machine megatrain runs on.
    Live,
    /// An hwloc XML export.
    XmlFile(std::path::PathBuf),
    /// An hwloc synthetic description, e.g. `"pack:2 numa:2 core:4 pu:2"`.
    Synthetic(String),
}

/// Probe a machine description from `source`.
pub fn probe(source: &TopologySource) -> crate::Result<Machine> {
    let topo = hwloc::load(source)?;
    describe(&topo, source)
}

/// Describe an already loaded topology: hwloc's facts, plus the live machine's Linux and CUDA
/// facts when `source` is the live machine.
pub fn describe(topo: &::hwlocality::Topology, source: &TopologySource) -> crate::Result<Machine> {
    let mut machine = hwloc::describe(topo, source)?;
    if machine.source.is_live() {
        linux::complete_live(&mut machine);
        #[cfg(feature = "cuda")]
        cuda::merge_driver_facts(&mut machine);
    }
    Ok(machine)
}
