//! `megatrain bench link` (after NVIDIA's nvbandwidth): the host side — memcpy bandwidth between
//! every pair of NUMA nodes, source memory bound to one node, destination to the other, copy
//! threads pinned to the destination node's CPUs — and the host↔device cases, which need a CUDA
//! device and are reported as waived (with the reason) where there is none.

use crate::host::{affinity, PageKind, Region, RegionSpec};
use crate::topology::{Machine, MemoryKind};
use crate::{Error, Result};
use serde::Serialize;
use std::time::Instant;

/// The report.
#[derive(Debug, Clone, Serialize)]
pub struct LinkReport {
    /// Bytes per copy.
    pub bytes: u64,
    /// Copies per case (median reported).
    pub reps: usize,
    /// NUMA nodes (OS indices), the matrix order.
    pub nodes: Vec<u32>,
    /// `memcpy_gbps[i][j]`: from node i's memory to node j's.
    pub memcpy_gbps: Vec<Vec<f64>>,
    /// GPU cases and why they did not run.
    pub waived: Vec<String>,
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
            let mut t: Vec<f64> = (0..reps.max(1))
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
        Some(c) if c.available => None,
        Some(c) => Some(c.detail.clone()),
        None => Some("built without the `cuda` feature".to_owned()),
    };
    let waived = match why {
        Some(w) => [
            "host→device (pinned)",
            "device→host (pinned)",
            "bidirectional",
            "host→device (pageable)",
        ]
        .iter()
        .map(|c| format!("{c}: WAIVED — no CUDA device ({w})"))
        .collect(),
        None => {
            vec!["host↔device cases: the CUDA device is not wired into megatrain yet".to_owned()]
        }
    };
    Ok(LinkReport {
        bytes: bytes as u64,
        reps,
        nodes: nodes.iter().map(|n| n.os_index).collect(),
        memcpy_gbps: m,
        waived,
    })
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
    for w in &r.waived {
        s += &format!("{w}\n");
    }
    s
}
