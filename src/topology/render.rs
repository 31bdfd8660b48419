//! The human-readable `megatrain probe` report (lstopo summary + `nvidia-smi topo -m`).

use super::{links, LinkKind, Machine, MemoryKind, Source};
use crate::util::human_bytes;
use std::fmt::Write;

fn or_na<T: ToString>(v: Option<T>) -> String {
    v.map_or_else(|| "n/a".to_owned(), |v| v.to_string())
}

fn kind_name(k: MemoryKind) -> &'static str {
    match k {
        MemoryKind::Dram => "DRAM",
        MemoryKind::Hbm => "HBM",
        MemoryKind::GpuMemory => "GPU-mem",
        MemoryKind::Other => "other",
    }
}

/// Render `m` as the probe's text report.
pub fn report(m: &Machine) -> String {
    let mut s = String::new();
    // Writing to a String cannot fail; the `let _ =` keeps the fmt::Result out of the way.
    let _ = write_report(&mut s, m);
    s
}

fn write_report(s: &mut String, m: &Machine) -> std::fmt::Result {
    write_head(s, m)?;
    write_numa(s, m)?;
    write_gpus(s, m)?;
    if !m.gpus.is_empty() {
        write_gpu_matrices(s, m)?;
    }
    write_block_devices(s, m)?;
    write_host(s, m)
}

/// The source, the host and the packages.
fn write_head(s: &mut String, m: &Machine) -> std::fmt::Result {
    let src = match &m.source {
        Source::Live => "this machine".to_owned(),
        Source::Xml { path } => format!("hwloc XML {path}"),
        Source::Synthetic { description } => format!("synthetic \"{description}\""),
    };
    writeln!(s, "megatrain probe — {src}")?;
    writeln!(
        s,
        "host {}  ·  {}  ·  {}",
        or_na(m.hostname.as_deref()),
        or_na(m.os.as_deref()),
        or_na(m.architecture.as_deref())
    )?;
    let dram = m.memory_bytes(MemoryKind::Dram) + m.memory_bytes(MemoryKind::Hbm);
    writeln!(
        s,
        "{} package(s), {} cores, {} hardware threads, {} NUMA node(s), {} host memory",
        m.packages.len(),
        m.cores,
        m.hardware_threads,
        m.numa_nodes.len(),
        human_bytes(dram)
    )?;
    for p in &m.packages {
        writeln!(
            s,
            "  package P#{}: {} cores / {} threads, NUMA {:?}  {}",
            p.os_index,
            p.cores,
            p.hardware_threads,
            p.numa_nodes,
            p.cpu_model.as_deref().unwrap_or("")
        )?;
    }
    Ok(())
}

/// NUMA nodes and their distances.
fn write_numa(s: &mut String, m: &Machine) -> std::fmt::Result {
    writeln!(s, "\nNUMA nodes")?;
    writeln!(
        s,
        "  {:<6} {:<4} {:<8} {:>11} {:>11} {:>11} {:>6} {:<24} huge pages (free/total)",
        "node", "pkg", "kind", "memory", "free", "available", "cores", "cpus"
    )?;
    for n in &m.numa_nodes {
        let hp: Vec<String> = n
            .huge_pages
            .iter()
            .map(|h| {
                format!(
                    "{}:{}/{}",
                    human_bytes(h.page_bytes),
                    or_na(h.free),
                    h.total
                )
            })
            .collect();
        let kind = kind_name(n.kind);
        let owner = n
            .pci_bus_id
            .as_ref()
            .map_or(String::new(), |b| format!("  memory of GPU {b}"));
        writeln!(
            s,
            "  P#{:<4} {:<4} {:<8} {:>11} {:>11} {:>11} {:>6} {:<24} {}{}",
            n.os_index,
            n.package.map_or("-".to_owned(), |p| p.to_string()),
            kind,
            human_bytes(n.memory_bytes),
            n.free_bytes.map_or("n/a".to_owned(), human_bytes),
            n.available_bytes.map_or("n/a".to_owned(), human_bytes),
            n.cores,
            n.cpus,
            if hp.is_empty() {
                "none".to_owned()
            } else {
                hp.join(" ")
            },
            owner
        )?;
    }

    if let Some(d) = &m.numa_distances {
        writeln!(s, "\nNUMA distances ({}; 10 = local)", d.name)?;
        write!(s, "  {:<6}", "")?;
        for n in &d.nodes {
            write!(s, "{:>6}", format!("P#{n}"))?;
        }
        writeln!(s)?;
        for (i, row) in d.values.iter().enumerate() {
            write!(s, "  {:<6}", format!("P#{}", d.nodes[i]))?;
            for v in row {
                write!(s, "{v:>6}")?;
            }
            writeln!(s)?;
        }
    }
    Ok(())
}

/// The GPUs, one line each.
fn write_gpus(s: &mut String, m: &Machine) -> std::fmt::Result {
    writeln!(s, "\nGPUs: {}", m.gpus.len())?;
    if !m.gpus.is_empty() {
        writeln!(
            s,
            "  {:<5} {:<26} {:>10} {:>4} {:<13} {:<22} {:<10} {:<8} source",
            "gpu", "name", "memory", "cc", "bus id", "link", "numa", "driver"
        )?;
    }
    for g in &m.gpus {
        let link = match g.link.kind {
            LinkKind::CoherentNvlink => {
                if m.architecture.as_deref() == Some("aarch64") {
                    "NVLink-C2C".to_owned()
                } else {
                    "NVLink-CPU".to_owned()
                }
            }
            LinkKind::Pcie => {
                let gw = match (g.link.pcie_generation, g.link.pcie_width) {
                    (Some(gn), Some(w)) => {
                        format!("Gen{gn} x{w}{}", if g.link.inferred { "?" } else { "" })
                    }
                    _ => "PCIe".to_owned(),
                };
                match g.link.gbytes_per_s {
                    Some(b) => format!("{gw} {b:.1} GB/s"),
                    None => gw,
                }
            }
            LinkKind::Unknown => "unknown".to_owned(),
        };
        let numa = g
            .numa_nodes
            .iter()
            .map(|n| format!("P#{n}"))
            .collect::<Vec<_>>()
            .join(",");
        writeln!(
            s,
            "  GPU{:<2} {:<26} {:>10} {:>4} {:<13} {:<22} {:<10} {:<8} {}",
            g.index,
            g.name.as_deref().unwrap_or(if g.vendor_id == 0 {
                "GPU (PCI ids scrubbed)"
            } else {
                "NVIDIA (unknown model)"
            }),
            g.memory_bytes.map_or("n/a".to_owned(), human_bytes),
            or_na(g.compute_capability.as_deref()),
            g.pci_bus_id,
            link,
            numa,
            or_na(g.driver_version.as_deref()),
            g.discovered_by
        )?;
    }
    if m.gpus.iter().any(|g| g.link.inferred) {
        writeln!(
            s,
            "  (Gen?/x? inferred from hwloc's link speed; the widest matching link is shown)"
        )?;
    }
    Ok(())
}

/// GPU × GPU (`nvidia-smi topo -m` classes) and GPU × NUMA node matrices.
fn write_gpu_matrices(s: &mut String, m: &Machine) -> std::fmt::Result {
    writeln!(s, "\nGPU topology (nvidia-smi topo -m legend)")?;
    write!(s, "  {:<6}", "")?;
    for g in &m.gpus {
        write!(s, "{:>7}", format!("GPU{}", g.index))?;
    }
    writeln!(s, "  {:<24} NUMA affinity", "CPU affinity")?;
    for (i, row) in m.gpu_links.iter().enumerate() {
        write!(s, "  {:<6}", format!("GPU{i}"))?;
        for c in row {
            write!(s, "{:>7}", c.to_string())?;
        }
        let g = &m.gpus[i];
        writeln!(
            s,
            "  {:<24} {}",
            g.cpus,
            g.numa_nodes
                .iter()
                .map(u32::to_string)
                .collect::<Vec<_>>()
                .join(",")
        )?;
    }
    writeln!(
        s,
        "\nGPU x NUMA node (class, NUMA distance from the GPU's local node)"
    )?;
    write!(s, "  {:<6}", "")?;
    for n in &m.numa_nodes {
        write!(s, "{:>9}", format!("P#{}", n.os_index))?;
    }
    writeln!(s)?;
    for (i, row) in m.gpu_numa.iter().enumerate() {
        write!(s, "  {:<6}", format!("GPU{i}"))?;
        for c in row {
            let cell = match c.distance {
                Some(d) => format!("{} {d}", c.class),
                None => c.class.to_string(),
            };
            write!(s, "{cell:>9}")?;
        }
        writeln!(s)?;
    }
    writeln!(s, "\nLegend:\n{}", links::LEGEND)?;
    Ok(())
}

/// Block devices.
fn write_block_devices(s: &mut String, m: &Machine) -> std::fmt::Result {
    writeln!(s, "\nBlock devices: {}", m.block_devices.len())?;
    if !m.block_devices.is_empty() {
        writeln!(
            s,
            "  {:<10} {:<7} {:<24} {:>10} {:<10} {:<5} {:<13} mounted on",
            "device", "kind", "model", "size", "media", "numa", "pci"
        )?;
    }
    for b in &m.block_devices {
        writeln!(
            s,
            "  {:<10} {:<7} {:<24} {:>10} {:<10} {:<5} {:<13} {}",
            b.name,
            b.transport,
            b.model.as_deref().unwrap_or("n/a"),
            b.size_bytes.map_or("n/a".to_owned(), human_bytes),
            match b.rotational {
                Some(true) => "rotating",
                Some(false) => "solid",
                None => "n/a",
            },
            b.numa_node.map_or("n/a".to_owned(), |n| format!("P#{n}")),
            b.pci_bus_id.as_deref().unwrap_or("n/a"),
            if b.mount_points.is_empty() {
                "-".to_owned()
            } else {
                b.mount_points.join(", ")
            }
        )?;
    }
    Ok(())
}

/// Huge pages, THP, memlock, io_uring and the CUDA driver (live machines only).
fn write_host(s: &mut String, m: &Machine) -> std::fmt::Result {
    writeln!(s, "\nHost memory and I/O")?;
    if m.source.is_live() {
        let hp: Vec<String> = m
            .memory
            .huge_pages
            .iter()
            .map(|h| {
                format!(
                    "{} pages: {} free of {}",
                    human_bytes(h.page_bytes),
                    or_na(h.free),
                    h.total
                )
            })
            .collect();
        writeln!(
            s,
            "  huge pages:   {}",
            if hp.is_empty() {
                "not supported".to_owned()
            } else {
                hp.join("; ")
            }
        )?;
        writeln!(
            s,
            "  THP:          {}",
            or_na(m.memory.transparent_huge_pages.as_deref())
        )?;
        let lim = |v: Option<u64>| v.map_or("unlimited".to_owned(), human_bytes);
        match m.memory.memlock {
            Some(l) => writeln!(
                s,
                "  memlock:      soft {}, hard {}{}",
                lim(l.soft_bytes),
                lim(l.hard_bytes),
                if l.soft_bytes.is_some() {
                    "  (page-locking the model store needs `ulimit -l unlimited` or CAP_IPC_LOCK)"
                } else {
                    ""
                }
            )?,
            None => writeln!(s, "  memlock:      n/a")?,
        }
        match &m.memory.cgroup {
            Some(c) => writeln!(
                s,
                "  cgroup:       limit {}, using {} ({} of it reclaimable page cache): {} of room  ({})",
                human_bytes(c.limit_bytes),
                human_bytes(c.usage_bytes),
                human_bytes(c.reclaimable_bytes),
                human_bytes(c.room_bytes()),
                c.path
            )?,
            None => writeln!(s, "  cgroup:       no memory limit")?,
        }
        match &m.io_uring {
            Some(u) => writeln!(
                s,
                "  io_uring:     {} ({})",
                if u.available {
                    "available"
                } else {
                    "UNAVAILABLE"
                },
                u.detail
            )?,
            None => writeln!(s, "  io_uring:     n/a")?,
        }
        match &m.cuda {
            Some(c) => writeln!(
                s,
                "  CUDA driver:  {} ({})",
                c.driver_api_version.as_deref().unwrap_or("unavailable"),
                c.detail
            )?,
            None => writeln!(
                s,
                "  CUDA driver:  not queried (built without the `cuda` feature; GPUs above come from the PCI tree)"
            )?,
        }
    } else {
        writeln!(
            s,
            "  (free and available memory, huge pages, THP, memlock, cgroup limits and io_uring are read on the live machine only)"
        )?;
    }
    Ok(())
}
