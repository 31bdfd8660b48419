//! `megatrain bench link` (after NVIDIA's nvbandwidth): the host side — memcpy bandwidth between
//! every pair of NUMA nodes, source memory bound to one node, destination to the other, copy
//! threads pinned to the destination node's CPUs — and the host↔device cases, which need a CUDA
//! device and are reported as waived (with the reason) where there is none.

use crate::host::{affinity, PageKind, Region, RegionSpec};
use crate::topology::{Machine, MemoryKind};
use crate::{Error, Result};
use serde::Serialize;
use std::time::Instant;

/// One host↔device case.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct LinkCase {
    /// Host NUMA node of the buffer (and of the thread issuing the copies).
    pub node: u32,
    /// "htod", "dtoh", "bidirectional" (both at once; GB/s of both directions summed).
    pub direction: String,
    /// Page-locked (cuMemHostRegister) or pageable host memory.
    pub pinned: bool,
    /// Bytes per copy.
    pub bytes: usize,
    /// Median GB/s.
    pub gbps: f64,
}

/// The report.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct LinkReport {
    /// Bytes per copy.
    pub bytes: u64,
    /// Copies per case (median reported).
    pub reps: usize,
    /// NUMA nodes (OS indices), the matrix order.
    pub nodes: Vec<u32>,
    /// `memcpy_gbps[i][j]`: from node i's memory to node j's.
    pub memcpy_gbps: Vec<Vec<f64>>,
    /// The GPU measured, its link as the probe sees it, and the host↔device cases.
    pub gpu: Option<GpuLinkReport>,
    /// GPU cases and why they did not run.
    pub waived: Vec<String>,
}

/// The host↔device part.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct GpuLinkReport {
    /// Device name.
    pub name: String,
    /// "NVLink-C2C" or "PCIe Gen5 x16" (from the probe).
    pub link: String,
    /// Every case.
    pub cases: Vec<LinkCase>,
}

fn region(node: u32, bytes: usize, cpus: &[usize], label: &str) -> Result<Region> {
    Region::allocate(RegionSpec {
        label: label.to_owned(),
        bytes,
        node: Some(node),
        prefault_cpus: cpus.to_vec(),
        pages: PageKind::Transparent,
        lock: false,
    })
}

/// Copy `src` to `dst` with one thread per CPU in `cpus`, each pinned, on disjoint chunks.
fn parallel_copy(dst: &Region, src: &Region, bytes: usize, cpus: &[usize]) {
    let threads = cpus.len().max(1);
    let chunk = bytes.div_ceil(threads).div_ceil(4096) * 4096;
    let (d, s) = (dst.as_ptr() as usize, src.as_ptr() as usize);
    std::thread::scope(|sc| {
        for t in 0..threads {
            let (lo, hi) = (t * chunk, ((t + 1) * chunk).min(bytes));
            if lo >= hi {
                continue;
            }
            let cpu = cpus.get(t).copied();
            sc.spawn(move || {
                if let Some(c) = cpu {
                    let _ = affinity::pin_current_thread(&[c]);
                }
                // SAFETY: [lo, hi) lies inside both regions (each ≥ bytes long), the regions are
                // distinct, and the threads copy disjoint ranges.
                unsafe {
                    std::ptr::copy_nonoverlapping(
                        (s + lo) as *const u8,
                        (d + lo) as *mut u8,
                        hi - lo,
                    )
                };
            });
        }
    });
}

/// Run the host-side matrix on `machine` (the live one).
pub fn run(machine: &Machine, bytes: usize, reps: usize) -> Result<LinkReport> {
    super::check_count("--size", bytes, 4096, usize::MAX)?;
    super::check_count("--reps", reps, 1, super::MAX_REPS)?;
    super::check_memory(
        &format!("copies of --size {bytes}"),
        (bytes as u64).checked_mul(2),
        "pass a smaller --size",
    )?;
    let nodes: Vec<&crate::topology::NumaNode> = machine
        .numa_nodes
        .iter()
        .filter(|n| matches!(n.kind, MemoryKind::Dram | MemoryKind::Hbm))
        .collect();
    if nodes.is_empty() {
        return Err(Error::system(
            "bench link",
            "find NUMA nodes",
            "none with memory",
        ));
    }
    let mut m = vec![vec![0.0; nodes.len()]; nodes.len()];
    for (i, a) in nodes.iter().enumerate() {
        let src_cpus = affinity::parse_cpu_list(&a.cpus)?;
        let src = region(a.os_index, bytes, &src_cpus, "link bench source")?;
        for (j, b) in nodes.iter().enumerate() {
            let cpus = affinity::parse_cpu_list(&b.cpus)?;
            let dst = region(b.os_index, bytes, &cpus, "link bench destination")?;
            parallel_copy(&dst, &src, bytes, &cpus); // warm-up, outside the timing
            let mut t: Vec<f64> = (0..reps)
                .map(|_| {
                    let s = Instant::now();
                    parallel_copy(&dst, &src, bytes, &cpus);
                    s.elapsed().as_secs_f64()
                })
                .collect();
            t.sort_by(f64::total_cmp);
            m[i][j] = bytes as f64 / t[t.len() / 2] / 1e9;
        }
    }
    let why = match &machine.cuda {
        Some(c) if c.available && !machine.gpus.is_empty() => None,
        Some(c) => Some(c.detail.clone()),
        None => Some("built without the `cuda` feature".to_owned()),
    };
    let (gpu, waived) = match why {
        Some(w) => (
            None,
            [
                "host→device (pinned)",
                "device→host (pinned)",
                "bidirectional",
                "host→device (pageable)",
            ]
            .iter()
            .map(|c| format!("{c}: WAIVED — no CUDA device ({w})"))
            .collect(),
        ),
        None => (Some(gpu_cases(machine, &nodes, bytes, reps)?), Vec::new()),
    };
    Ok(LinkReport {
        bytes: bytes as u64,
        reps,
        nodes: nodes.iter().map(|n| n.os_index).collect(),
        memcpy_gbps: m,
        gpu,
        waived,
    })
}

#[cfg(feature = "cuda")]
fn gpu_cases(
    machine: &Machine,
    nodes: &[&crate::topology::NumaNode],
    bytes: usize,
    reps: usize,
) -> Result<GpuLinkReport> {
    let g = &machine.gpus[0];
    let link = match g.link.kind {
        crate::topology::LinkKind::CoherentNvlink => "NVLink-C2C".to_owned(),
        _ => match (g.link.pcie_generation, g.link.pcie_width) {
            (Some(gen), Some(w)) => format!("PCIe Gen{gen} x{w}"),
            _ => "PCIe".to_owned(),
        },
    };
    let mut on = Vec::new();
    for n in nodes
        .iter()
        .filter(|n| n.kind == MemoryKind::Dram && n.hardware_threads > 0)
    {
        on.push((n.os_index, affinity::parse_cpu_list(&n.cpus)?));
    }
    // 1 MiB … 1 GiB by ×16, up to the requested size.
    let sizes: Vec<usize> = [1usize << 20, 16 << 20, 256 << 20, 1 << 30]
        .into_iter()
        .filter(|s| *s <= bytes.max(1 << 20))
        .collect();
    let (name, cases) = gpu_copies(0, &on, &sizes, reps)?;
    Ok(GpuLinkReport { name, link, cases })
}

/// Host↔device copies per NUMA node (memory bound there, calling thread pinned there),
/// page-locked and pageable, for each size in `sizes`, median of `reps` timed with events.
#[cfg(feature = "cuda")]
fn gpu_copies(
    ordinal: usize,
    nodes: &[(u32, Vec<usize>)],
    sizes: &[usize],
    reps: usize,
) -> Result<(String, Vec<LinkCase>)> {
    use crate::device::cuda::{drv, pinned::PageLock, CudaRuntime};
    let rt = CudaRuntime::open_context(ordinal)?;
    let other = drv(rt.ctx.new_stream(), "create a stream")?;
    let max = sizes.iter().copied().max().unwrap_or(0).div_ceil(4) * 4;
    let mut dev = drv(
        rt.stream.alloc_zeros::<f32>(max / 4),
        "allocate the device buffer",
    )?;
    let dev2 = drv(
        other.alloc_zeros::<f32>(max / 4),
        "allocate the device buffer",
    )?;
    let mut out = Vec::new();
    for (node, cpus) in nodes {
        // Best effort: a cgroup may forbid it; the copies are still measured.
        let _ = affinity::pin_current_thread(cpus);
        let buffer = || {
            crate::host::Region::allocate(crate::host::RegionSpec {
                node: Some(*node),
                prefault_cpus: cpus.clone(),
                ..crate::host::RegionSpec::scratch(format!("link bench buffer on node {node}"), max)
            })
        };
        let (host, host2) = (buffer()?, buffer()?);
        for pinned in [true, false] {
            // Page-locked for the pinned cases, unlocked (dropped) before the pageable ones.
            let _locks = if pinned {
                Some((
                    PageLock::region(&rt.ctx, &host)?,
                    PageLock::region(&rt.ctx, &host2)?,
                ))
            } else {
                None
            };
            for &bytes in sizes {
                let n = bytes / 4;
                // SAFETY: both regions hold `max` ≥ bytes bytes; nothing else touches them.
                let (h1, h2) = unsafe {
                    (
                        std::slice::from_raw_parts_mut(host.as_ptr().cast::<f32>(), n),
                        std::slice::from_raw_parts_mut(host2.as_ptr().cast::<f32>(), n),
                    )
                };
                for direction in ["htod", "dtoh", "bidirectional"] {
                    let ms = rt.time_ms(Some(&other), reps, &mut || {
                        let mut d1 = dev.slice_mut(..n);
                        match direction {
                            "htod" => {
                                drv(rt.stream.memcpy_htod(&*h1, &mut d1), "copy host to device")
                            }
                            "dtoh" => {
                                drv(rt.stream.memcpy_dtoh(&d1, &mut *h1), "copy device to host")
                            }
                            _ => {
                                drv(rt.stream.memcpy_htod(&*h1, &mut d1), "copy host to device")?;
                                drv(
                                    other.memcpy_dtoh(&dev2.slice(..n), &mut *h2),
                                    "copy device to host",
                                )?;
                                drv(rt.stream.join(&other), "join the streams")
                            }
                        }
                    })?;
                    let moved = if direction == "bidirectional" {
                        2 * bytes
                    } else {
                        bytes
                    };
                    out.push(LinkCase {
                        node: *node,
                        direction: direction.to_owned(),
                        pinned,
                        bytes,
                        gbps: moved as f64 / (ms * 1e-3) / 1e9,
                    });
                }
            }
        }
    }
    Ok((rt.name.clone(), out))
}

#[cfg(not(feature = "cuda"))]
fn gpu_cases(
    _: &Machine,
    _: &[&crate::topology::NumaNode],
    _: usize,
    _: usize,
) -> Result<GpuLinkReport> {
    Err(Error::system(
        "bench link",
        "host↔device cases",
        "this build has no CUDA support",
    ))
}

/// nvbandwidth-style matrix.
pub fn render(r: &LinkReport) -> String {
    let mut s = format!(
        "megatrain bench link — host memcpy between NUMA nodes, {} per copy, median of {} (GB/s)\n\
         rows: source node (memory bound there); columns: destination node (memory and copy threads there)\n\n{:>8}",
        crate::util::human_bytes(r.bytes),
        r.reps,
        ""
    );
    for n in &r.nodes {
        s += &format!("{:>9}", format!("P#{n}"));
    }
    s += "\n";
    for (i, row) in r.memcpy_gbps.iter().enumerate() {
        s += &format!("{:>8}", format!("P#{}", r.nodes[i]));
        for v in row {
            s += &format!("{v:>9.2}");
        }
        s += "\n";
    }
    s += "\n";
    if let Some(g) = &r.gpu {
        let largest = g.cases.iter().map(|c| c.bytes).max().unwrap_or(0);
        s += &format!(
            "host↔device — {}{} over {}, {} per copy, median of {} (GB/s; bidirectional = both ways summed)\n{:>8} {:>13} {:>13} {:>13} {:>15} {:>15}\n",
            g.name,
            if g.name.contains("(cuemu)") {
                " [EMULATED: host memory copies, not GPU figures]"
            } else {
                ""
            },
            g.link,
            crate::util::human_bytes(largest as u64),
            r.reps,
            "node",
            "htod pinned",
            "dtoh pinned",
            "bidir pinned",
            "htod pageable",
            "dtoh pageable"
        );
        for n in &r.nodes {
            let get = |d: &str, p: bool| {
                g.cases
                    .iter()
                    .find(|c| {
                        c.node == *n && c.direction == d && c.pinned == p && c.bytes == largest
                    })
                    .map_or("-".to_owned(), |c| format!("{:.1}", c.gbps))
            };
            s += &format!(
                "{:>8} {:>13} {:>13} {:>13} {:>15} {:>15}\n",
                format!("P#{n}"),
                get("htod", true),
                get("dtoh", true),
                get("bidirectional", true),
                get("htod", false),
                get("dtoh", false)
            );
        }
        s += "\npinned host→device by size (first node):\n";
        if let Some(first) = r.nodes.first() {
            for c in g
                .cases
                .iter()
                .filter(|c| c.node == *first && c.direction == "htod" && c.pinned)
            {
                s += &format!(
                    "  {:>10}  {:.1} GB/s\n",
                    crate::util::human_bytes(c.bytes as u64),
                    c.gbps
                );
            }
        }
    }
    for w in &r.waived {
        s += &format!("{w}\n");
    }
    s
}
