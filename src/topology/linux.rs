//! Live-machine facts that hwloc does not report, read from Linux (sysfs, procfs, syscalls).
//!
//! Every reader tolerates a missing file (containers hide parts of sysfs): the field stays `None`.

use super::{BlockDevice, HostMemory, HugePages, IoUringStatus, LinkKind, Machine, MemlockLimit};
use std::collections::BTreeMap;
use std::fs;
use std::path::{Path, PathBuf};

fn read_trim(path: impl AsRef<Path>) -> Option<String> {
    fs::read_to_string(path)
        .ok()
        .map(|s| s.trim().to_owned())
        .filter(|s| !s.is_empty())
}

fn read_u64(path: impl AsRef<Path>) -> Option<u64> {
    read_trim(path)?.parse().ok()
}

/// Fill in everything only the live machine can tell.
pub fn complete_live(m: &mut Machine) {
    let single_node = m.numa_nodes.len() == 1;
    let mem_available = meminfo("/proc/meminfo", "MemAvailable:");
    for node in &mut m.numa_nodes {
        let dir = PathBuf::from(format!("/sys/devices/system/node/node{}", node.os_index));
        node.free_bytes = node_meminfo(&dir, "MemFree:");
        // Free, plus the page cache and slab the kernel can reclaim (the node's share of what
        // MemAvailable counts machine-wide).
        node.available_bytes = node.free_bytes.map(|free| {
            free + ["Active(file):", "Inactive(file):", "SReclaimable:"]
                .iter()
                .filter_map(|k| node_meminfo(&dir, k))
                .sum::<u64>()
        });
        if single_node {
            // One node: /proc/meminfo is authoritative. (On some VMs the per-node counters miss
            // hot-plugged memory: this one's node0 reports 4.2 GiB of its 23.5 GiB.)
            if let Some(total) = meminfo("/proc/meminfo", "MemTotal:") {
                node.memory_bytes = total;
            }
            node.free_bytes = meminfo("/proc/meminfo", "MemFree:").or(node.free_bytes);
            node.available_bytes = mem_available.or(node.available_bytes);
        }
        let hp = huge_pages_in(&dir.join("hugepages"));
        if !hp.is_empty() {
            node.huge_pages = hp;
        }
    }
    // Several nodes: the per-node estimates never add up to more than MemAvailable (which
    // keeps the kernel's low watermarks back).
    if !single_node {
        let sum: u64 = m.numa_nodes.iter().filter_map(|n| n.available_bytes).sum();
        if let Some(avail) = mem_available.filter(|&a| sum > a && sum > 0) {
            for n in &mut m.numa_nodes {
                n.available_bytes = n
                    .available_bytes
                    .map(|b| (b as f64 * avail as f64 / sum as f64) as u64);
            }
        }
    }
    m.memory = HostMemory {
        huge_pages: huge_pages_in(Path::new("/sys/kernel/mm/hugepages")),
        transparent_huge_pages: read_trim("/sys/kernel/mm/transparent_hugepage/enabled")
            .and_then(|s| bracketed(&s)),
        memlock: memlock(),
        cgroup: cgroup_memory(Path::new("/proc/self/cgroup"), Path::new("/sys/fs/cgroup")),
    };
    m.io_uring = Some(io_uring_status());
    let driver = nvidia_driver_version();
    coherent_gpus(
        m,
        Path::new("/proc/driver/nvidia"),
        Path::new("/sys/devices/system/node"),
    );
    for gpu in &mut m.gpus {
        gpu.driver_version.clone_from(&driver);
        if gpu.link.kind == LinkKind::CoherentNvlink {
            continue;
        }
        if let Some((generation, width)) = pcie_link(&gpu.pci_bus_id) {
            gpu.link.kind = LinkKind::Pcie;
            gpu.link.pcie_generation = Some(generation);
            gpu.link.pcie_width = Some(width);
            gpu.link.inferred = false;
        }
    }
    if let Some(devs) = block_devices() {
        m.block_devices = devs;
    }
}

/// GPUs whose memory the NVIDIA driver onlined as a NUMA node (`driver/gpus/<bus id>/numa_status`
/// names it: `Node: N`) reach the host over cache-coherent NVLink-C2C (GH200, GB200). hwloc 2.11
/// marks such a node `GPUMemory` (read in `hwloc.rs`), but hwloc before 2.11 — Debian 12 ships
/// 2.9 — hides it on Grace Hopper, and the GPU then looks like a PCIe device; the driver's file
/// says what it is either way, as hwloc itself reads it. `nodes`: sysfs's node directory (the
/// node must exist, as hwloc requires).
fn coherent_gpus(m: &mut Machine, driver: &Path, nodes: &Path) {
    for gpu in &mut m.gpus {
        if gpu.link.kind == LinkKind::CoherentNvlink {
            continue;
        }
        let status = driver
            .join("gpus")
            .join(gpu.pci_bus_id.to_lowercase())
            .join("numa_status");
        let Some(node) = fs::read_to_string(status)
            .ok()
            .and_then(|t| numa_status_node(&t))
            .filter(|n| nodes.join(format!("node{n}")).is_dir())
        else {
            continue;
        };
        gpu.memory_numa_node = Some(node);
        gpu.link = super::GpuLink::coherent_nvlink();
    }
}

/// The node of a `numa_status` file's `Node: N` line (`-1`, or no such line: none).
fn numa_status_node(text: &str) -> Option<u32> {
    let value = text.lines().find_map(|l| l.trim().strip_prefix("Node:"))?;
    value
        .trim()
        .parse::<i64>()
        .ok()
        .and_then(|n| u32::try_from(n).ok())
}

/// The memory limit of the cgroup this process runs in (`cgroup_file`: `/proc/self/cgroup`),
/// under the cgroup filesystem at `root`: the tightest `memory.max` (v2) among the cgroup and its
/// ancestors, else the v1 `memory.limit_in_bytes`; `None` when no limit is set.
pub fn cgroup_memory(cgroup_file: &Path, root: &Path) -> Option<super::CgroupMemory> {
    let text = fs::read_to_string(cgroup_file).ok()?;
    let limit_of = |s: Option<String>| -> Option<u64> {
        // "max" (v2) or a page-rounded i64::MAX (v1) mean no limit.
        s?.parse::<u64>().ok().filter(|&b| b < (1u64 << 62))
    };
    let reclaimable = |dir: &Path, keys: &[&str]| -> u64 {
        fs::read_to_string(dir.join("memory.stat"))
            .map(|t| {
                t.lines()
                    .filter_map(|l| {
                        let (k, v) = l.split_once(' ')?;
                        keys.contains(&k).then(|| v.trim().parse::<u64>().ok())?
                    })
                    .sum()
            })
            .unwrap_or(0)
    };
    let mut best: Option<super::CgroupMemory> = None;
    for line in text.lines() {
        let mut parts = line.splitn(3, ':');
        let (_, controllers, path) = (parts.next()?, parts.next()?, parts.next()?);
        let rel = path.trim_start_matches('/');
        let (base, v2) = if controllers.is_empty() {
            (root.to_path_buf(), true)
        } else if controllers.split(',').any(|c| c == "memory") {
            (root.join("memory"), false)
        } else {
            continue;
        };
        // The cgroup and each ancestor up to the root: the tightest limit binds.
        let mut dir = base.join(rel);
        loop {
            let (limit, usage, reclaim) = if v2 {
                (
                    limit_of(read_trim(dir.join("memory.max"))),
                    read_u64(dir.join("memory.current")),
                    reclaimable(&dir, &["inactive_file", "active_file"]),
                )
            } else {
                (
                    limit_of(read_trim(dir.join("memory.limit_in_bytes"))),
                    read_u64(dir.join("memory.usage_in_bytes")),
                    reclaimable(&dir, &["total_inactive_file", "total_active_file"]),
                )
            };
            if let (Some(limit), Some(usage)) = (limit, usage) {
                let c = super::CgroupMemory {
                    path: dir.display().to_string(),
                    limit_bytes: limit,
                    usage_bytes: usage,
                    reclaimable_bytes: reclaim.min(usage),
                };
                if best
                    .as_ref()
                    .is_none_or(|b| c.room_bytes() < b.room_bytes())
                {
                    best = Some(c);
                }
            }
            if dir == base || !dir.pop() || !dir.starts_with(&base) {
                break;
            }
        }
    }
    best
}

/// A field of a node's `meminfo` ("Node 0 MemFree:   12345 kB"), in bytes.
fn node_meminfo(dir: &Path, key: &str) -> Option<u64> {
    let text = fs::read_to_string(dir.join("meminfo")).ok()?;
    text.lines().find_map(|l| {
        let mut it = l.split_whitespace().skip(2);
        (it.next()? == key)
            .then(|| it.next()?.parse::<u64>().ok())
            .flatten()
            .map(|kib| kib * 1024)
    })
}

/// A field of `/proc/meminfo` ("MemTotal:   12345 kB"), in bytes.
/// The kernel's estimate of the memory a new allocation can get without swapping
/// (`MemAvailable`), bytes.
pub fn mem_available() -> Option<u64> {
    meminfo("/proc/meminfo", "MemAvailable:")
}

fn meminfo(path: &str, key: &str) -> Option<u64> {
    let text = fs::read_to_string(path).ok()?;
    text.lines().find_map(|l| {
        let rest = l.strip_prefix(key)?;
        rest.split_whitespace()
            .next()?
            .parse::<u64>()
            .ok()
            .map(|k| k * 1024)
    })
}

/// Huge pages below a `hugepages/` directory (`hugepages-2048kB/nr_hugepages`, ...).
fn huge_pages_in(dir: &Path) -> Vec<HugePages> {
    let Ok(rd) = fs::read_dir(dir) else {
        return Vec::new();
    };
    let mut out: Vec<HugePages> = rd
        .filter_map(|e| {
            let e = e.ok()?;
            let name = e.file_name().into_string().ok()?;
            let kib: u64 = name
                .strip_prefix("hugepages-")?
                .strip_suffix("kB")?
                .parse()
                .ok()?;
            Some(HugePages {
                page_bytes: kib * 1024,
                total: read_u64(e.path().join("nr_hugepages")).unwrap_or(0),
                free: read_u64(e.path().join("free_hugepages")),
            })
        })
        .collect();
    out.sort_by_key(|h| h.page_bytes);
    out
}

/// The bracketed choice in a sysfs selector such as "always [madvise] never".
fn bracketed(s: &str) -> Option<String> {
    let a = s.find('[')?;
    let b = s[a..].find(']')? + a;
    Some(s[a + 1..b].to_owned())
}

/// This process's `RLIMIT_MEMLOCK`.
pub fn memlock() -> Option<MemlockLimit> {
    let mut lim = libc::rlimit {
        rlim_cur: 0,
        rlim_max: 0,
    };
    // SAFETY: getrlimit writes one rlimit struct through a valid, exclusive pointer.
    let rc = unsafe { libc::getrlimit(libc::RLIMIT_MEMLOCK, &mut lim) };
    if rc != 0 {
        return None;
    }
    let conv = |v: libc::rlim_t| (v != libc::RLIM_INFINITY).then_some(v);
    Some(MemlockLimit {
        soft_bytes: conv(lim.rlim_cur),
        hard_bytes: conv(lim.rlim_max),
    })
}

/// Whether an io_uring can be created here, and why not.
pub fn io_uring_status() -> IoUringStatus {
    let sysctl = read_trim("/proc/sys/kernel/io_uring_disabled").and_then(|s| s.parse().ok());
    match io_uring::IoUring::new(8) {
        Ok(_) => IoUringStatus {
            available: true,
            sysctl_disabled: sysctl,
            detail: "io_uring_setup succeeded".to_owned(),
        },
        Err(e) => {
            let why = match e.raw_os_error() {
                Some(libc::ENOSYS) => "the kernel has no io_uring (ENOSYS)".to_owned(),
                Some(libc::EPERM) => format!(
                    "io_uring is not permitted (EPERM; kernel.io_uring_disabled={}; seccomp or container policy may also block it)",
                    sysctl.map_or("?".to_owned(), |v: u8| v.to_string())
                ),
                _ => format!("io_uring_setup failed: {e}"),
            };
            IoUringStatus {
                available: false,
                sysctl_disabled: sysctl,
                detail: why,
            }
        }
    }
}

/// The NVIDIA kernel module's version, from `/proc/driver/nvidia/version`
/// ("NVRM version: NVIDIA UNIX x86_64 Kernel Module  550.54.15  ...").
pub fn nvidia_driver_version() -> Option<String> {
    parse_driver_version(&fs::read_to_string("/proc/driver/nvidia/version").ok()?)
}

/// The version in `/proc/driver/nvidia/version`'s first line
/// (`NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  …`).
fn parse_driver_version(text: &str) -> Option<String> {
    let line = text.lines().next()?;
    let after = line.split("Kernel Module").nth(1)?;
    after.split_whitespace().next().map(str::to_owned)
}

/// PCIe generation from a sysfs link speed such as "32.0 GT/s PCIe".
fn pcie_generation(speed: &str) -> Option<u8> {
    let gts: f64 = speed.split_whitespace().next()?.parse().ok()?;
    [
        (2.5, 1),
        (5.0, 2),
        (8.0, 3),
        (16.0, 4),
        (32.0, 5),
        (64.0, 6),
    ]
    .iter()
    .find(|(v, _)| (gts - v).abs() < 0.1)
    .map(|&(_, g)| g)
}

/// The generation and width the link to a PCI device trains to under load: the minimum of the
/// device's and its upstream port's maxima. (The *current* speed of an idle NVIDIA GPU is often
/// Gen1: it downclocks its link to save power.)
pub fn pcie_link(bus_id: &str) -> Option<(u8, u8)> {
    let dev = fs::canonicalize(format!("/sys/bus/pci/devices/{bus_id}")).ok()?;
    let one = |dir: &Path| -> Option<(u8, u8)> {
        let generation = pcie_generation(&read_trim(dir.join("max_link_speed"))?)?;
        let width: u8 = read_trim(dir.join("max_link_width"))?.parse().ok()?;
        Some((generation, width))
    };
    let (mut g, mut w) = one(&dev)?;
    if let Some((pg, pw)) = dev.parent().and_then(one) {
        g = g.min(pg);
        w = w.min(pw);
    }
    Some((g, w))
}

fn looks_like_bus_id(s: &str) -> bool {
    let b = s.as_bytes();
    b.len() == 12
        && b[4] == b':'
        && b[7] == b':'
        && b[10] == b'.'
        && s.chars()
            .enumerate()
            .all(|(i, c)| matches!(i, 4 | 7 | 10) || c.is_ascii_hexdigit())
}

/// Block devices from `/sys/block`, with their mounts. `None` if sysfs is not readable.
pub fn block_devices() -> Option<Vec<BlockDevice>> {
    let mounts = mounts_by_dev();
    let mut out = Vec::new();
    for e in fs::read_dir("/sys/block").ok()?.flatten() {
        let Ok(name) = e.file_name().into_string() else {
            continue;
        };
        if ["loop", "ram", "zram", "sr", "fd"]
            .iter()
            .any(|p| name.starts_with(p))
        {
            continue;
        }
        let dir = e.path();
        let real = fs::canonicalize(&dir).unwrap_or_else(|_| dir.clone());
        let pci_bus_id = real
            .components()
            .rev()
            .filter_map(|c| c.as_os_str().to_str())
            .find(|c| looks_like_bus_id(c))
            .map(str::to_owned);
        let numa_node = pci_bus_id.as_ref().and_then(|b| {
            read_trim(format!("/sys/bus/pci/devices/{b}/numa_node"))?
                .parse::<i64>()
                .ok()
                .and_then(|n| u32::try_from(n).ok())
        });
        // The device itself and its partitions (sda1, nvme0n1p1) may be mounted.
        let mut devnums = vec![read_trim(dir.join("dev"))];
        if let Ok(parts) = fs::read_dir(&dir) {
            for p in parts.flatten() {
                if p.file_name().to_string_lossy().starts_with(&name) {
                    devnums.push(read_trim(p.path().join("dev")));
                }
            }
        }
        let mut mount_points: Vec<String> = devnums
            .into_iter()
            .flatten()
            .flat_map(|d| mounts.get(&d).cloned().unwrap_or_default())
            .collect();
        mount_points.sort();
        mount_points.dedup();
        out.push(BlockDevice {
            transport: super::hwloc::transport_of(&name).to_owned(),
            model: read_trim(dir.join("device/model")),
            size_bytes: read_u64(dir.join("size")).map(|s| s * 512),
            rotational: read_u64(dir.join("queue/rotational")).map(|r| r == 1),
            numa_node,
            pci_bus_id,
            mount_points,
            name,
        });
    }
    super::hwloc::sort_block_devices(&mut out);
    Some(out)
}

/// "major:minor" → mount points, from /proc/self/mountinfo.
fn mounts_by_dev() -> BTreeMap<String, Vec<String>> {
    let mut map: BTreeMap<String, Vec<String>> = BTreeMap::new();
    if let Ok(text) = fs::read_to_string("/proc/self/mountinfo") {
        for line in text.lines() {
            let f: Vec<&str> = line.split_whitespace().collect();
            if f.len() > 4 {
                map.entry(f[2].to_owned())
                    .or_default()
                    .push(f[4].replace("\\040", " "));
            }
        }
    }
    map
}

#[cfg(test)]
mod tests {
    use super::*;

    fn write(p: &Path, text: &str) {
        fs::create_dir_all(p.parent().unwrap()).unwrap();
        fs::write(p, text).unwrap();
    }

    /// A GPU whose memory the driver onlined as a NUMA node is on NVLink-C2C with that node as its
    /// memory, though the hwloc description (2.9 hides the node on GH200) had it on PCIe; a
    /// `Node: -1`, a node sysfs does not have and a missing file change nothing.
    #[test]
    fn the_drivers_numa_status_marks_a_coherent_gpu() {
        let fixture =
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/topologies/ipa20.xml");
        let mut m =
            crate::topology::probe(&crate::topology::TopologySource::XmlFile(fixture)).unwrap();
        assert!(m.gpus.len() >= 3 && m.gpus.iter().all(|g| g.link.kind == LinkKind::Pcie));
        let t = tempfile::tempdir().unwrap();
        let (driver, nodes) = (t.path().join("nvidia"), t.path().join("node"));
        fs::create_dir_all(nodes.join("node1")).unwrap();
        let status = |i: usize, text: &str| {
            let bus = &m.gpus[i].pci_bus_id;
            write(&driver.join("gpus").join(bus).join("numa_status"), text);
        };
        status(0, "Node: 1\nStatus: online\n");
        status(1, "Node: -1\nStatus: disabled\n");
        status(2, "Node: 7\n");
        coherent_gpus(&mut m, &driver, &nodes);
        assert_eq!(m.gpus[0].link.kind, LinkKind::CoherentNvlink);
        assert_eq!(m.gpus[0].memory_numa_node, Some(1));
        assert_eq!(m.gpus[0].link.pcie_generation, None);
        for g in &m.gpus[1..] {
            assert_eq!((g.link.kind, g.memory_numa_node), (LinkKind::Pcie, None));
        }
        assert_eq!(numa_status_node("  Node:\t3 \n"), Some(3));
        assert_eq!(numa_status_node("Status: online"), None);
    }

    #[test]
    fn the_kernel_modules_version_is_read() {
        assert_eq!(
            parse_driver_version(
                "NVRM version: NVIDIA UNIX x86_64 Kernel Module  580.159.04  Tue Oct 14 2025\nGCC version: gcc 12\n"
            ),
            Some("580.159.04".into())
        );
        assert_eq!(parse_driver_version("garbage"), None);
    }

    #[test]
    fn the_tightest_cgroup_limit_binds_and_page_cache_counts_as_room() {
        let t = tempfile::tempdir().unwrap();
        let root = t.path().join("cg");
        // v2: a job slice limited to 64 GiB holding the process's cgroup limited to 100 GiB.
        let job = root.join("slurm/job_7");
        write(&root.join("slurm/memory.max"), "max\n");
        write(&job.join("memory.max"), &format!("{}\n", 64u64 << 30));
        write(&job.join("memory.current"), &format!("{}\n", 10u64 << 30));
        write(
            &job.join("memory.stat"),
            &format!(
                "anon 1\ninactive_file {}\nactive_file {}\n",
                3u64 << 30,
                1u64 << 30
            ),
        );
        let leaf = job.join("step_0");
        write(&leaf.join("memory.max"), &format!("{}\n", 100u64 << 30));
        write(&leaf.join("memory.current"), &format!("{}\n", 2u64 << 30));
        let self_cg = t.path().join("self");
        write(&self_cg, "0::/slurm/job_7/step_0\n");
        let c = cgroup_memory(&self_cg, &root).unwrap();
        assert_eq!(c.path, job.display().to_string());
        assert_eq!(c.limit_bytes, 64 << 30);
        // 64 − (10 − 4 of reclaimable page cache) = 58 GiB.
        assert_eq!(c.room_bytes(), 58 << 30);
        // v1: the memory controller's own hierarchy; "no limit" is a huge page-rounded number.
        let v1 = t.path().join("v1");
        let mine = v1.join("memory/process_api/abc");
        write(
            &mine.join("memory.limit_in_bytes"),
            &format!("{}\n", 8u64 << 30),
        );
        write(
            &mine.join("memory.usage_in_bytes"),
            &format!("{}\n", 1u64 << 30),
        );
        write(
            &v1.join("memory/memory.limit_in_bytes"),
            "9223372036854771712\n",
        );
        write(&v1.join("memory/memory.usage_in_bytes"), "5\n");
        write(&self_cg, "4:memory:/process_api/abc\n0::/\n");
        let c = cgroup_memory(&self_cg, &v1).unwrap();
        assert_eq!((c.limit_bytes, c.room_bytes()), (8 << 30, 7 << 30));
        // No limit anywhere.
        write(&mine.join("memory.limit_in_bytes"), "9223372036854771712\n");
        assert_eq!(cgroup_memory(&self_cg, &v1), None);
        assert_eq!(cgroup_memory(&t.path().join("absent"), &v1), None);
    }

    #[test]
    fn parses_selectors_and_speeds() {
        assert_eq!(
            bracketed("always [madvise] never").as_deref(),
            Some("madvise")
        );
        assert_eq!(bracketed("none"), None);
        assert_eq!(pcie_generation("32.0 GT/s PCIe"), Some(5));
        assert_eq!(pcie_generation("2.5 GT/s PCIe"), Some(1));
        assert_eq!(pcie_generation("Unknown"), None);
        assert!(looks_like_bus_id("0000:4e:00.0"));
        assert!(!looks_like_bus_id("pci0000:00"));
    }

    #[test]
    fn live_memlock_and_uring_are_reported() {
        // Both are syscalls that answer on any Linux; the values depend on the machine.
        assert!(memlock().is_some());
        let s = io_uring_status();
        assert!(!s.detail.is_empty());
    }
}
