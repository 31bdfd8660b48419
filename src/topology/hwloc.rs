//! hwloc → [`Machine`]: loading a topology (live, XML, synthetic) and reading it into plain data.

use super::links::{self, Hop, LinkClass, PciPath};
use super::pci_ids::{self, NVIDIA_VENDOR};
use super::{
    BlockDevice, Gpu, GpuLink, GpuNumaLink, HostMemory, HugePages, LinkKind, Machine, MemoryKind,
    NumaDistances, NumaNode, Package, Source, TopologySource, SCHEMA_VERSION,
};
use crate::{Error, Result};
use hwlocality::bitmap::Bitmap;
use hwlocality::cpu::cpuset::CpuSet;
use hwlocality::object::attributes::ObjectAttributes;
use hwlocality::object::types::{BridgeType, OSDeviceType, ObjectType};
use hwlocality::object::TopologyObject;
use hwlocality::topology::builder::TypeFilter;
use hwlocality::topology::export::xml::XMLExportFlags;
use hwlocality::Topology;
use std::path::Path;

/// The hwloc major version whose XML we can read: hwloc 2.x reads XML versions 1.0 and 2.0.
const MAX_XML_MAJOR: u32 = 2;

/// Load a topology from `source`, keeping every PCI device and bridge (the affinity matrices need
/// the bridges).
pub fn load(source: &TopologySource) -> Result<Topology> {
    let builder = Topology::builder()
        .with_io_type_filter(TypeFilter::KeepAll)
        .map_err(|e| Error::system("hwloc", "set I/O type filter", e))?;
    match source {
        TopologySource::Live => builder
            .build()
            .map_err(|e| Error::system("hwloc", "probe this machine", e)),
        TopologySource::XmlFile(path) => {
            let xml = read_topology_xml(path)?;
            let shown = path.display().to_string();
            let builder = builder.from_xml(&xml).map_err(|e| {
                Error::bad_input(
                    "topology file",
                    &shown,
                    format!("hwloc could not parse it ({e}): truncated, corrupt, or not an hwloc export"),
                    Some("re-export the machine with `megatrain probe --export-xml FILE` or `lstopo-no-graphics --of xml FILE`"),
                )
            })?;
            builder.build().map_err(|e| {
                Error::bad_input(
                    "topology file",
                    &shown,
                    format!("hwloc could not import it ({e}); it is not a valid hwloc XML export"),
                    Some("export the machine with `lstopo-no-graphics --of xml FILE` (hwloc 2.x) or `megatrain probe --export-xml FILE`"),
                )
            })
        }
        TopologySource::Synthetic(desc) => {
            let leaves = synthetic_leaves(desc);
            if leaves > MAX_SYNTHETIC_LEAVES {
                return Err(Error::bad_input(
                    "synthetic topology",
                    desc,
                    format!(
                        "describes {leaves} objects at its last level; megatrain models machines of up to {MAX_SYNTHETIC_LEAVES}"
                    ),
                    Some("describe fewer (the largest servers have a few thousand hardware threads)"),
                ));
            }
            let builder = builder.from_synthetic(desc).map_err(|e| {
                Error::bad_input(
                    "synthetic topology",
                    desc,
                    format!("hwloc rejected the description ({e})"),
                    Some("use hwloc's synthetic syntax, e.g. \"pack:2 numa:2 core:8 pu:2\""),
                )
            })?;
            builder
                .build()
                .map_err(|e| Error::bad_input("synthetic topology", desc, e.to_string(), None))
        }
    }
}

/// Most objects a synthetic topology may have at its last level (10^5 take hwloc a minute and
/// gigabytes; the largest real machines have a few thousand hardware threads).
pub const MAX_SYNTHETIC_LEAVES: u64 = 16_384;

/// The product of a synthetic description's arities (`pack:2 numa:2 core:8 pu:2` → 64): how
/// many objects its last level has. Tokens without a readable count count 1 (hwloc judges them).
pub fn synthetic_leaves(desc: &str) -> u64 {
    desc.split_whitespace()
        .filter_map(|tok| {
            let digits: String = tok
                .split_once(':')?
                .1
                .chars()
                .take_while(char::is_ascii_digit)
                .collect();
            match digits.parse::<u64>() {
                Ok(n) => Some(n),
                Err(_) if digits.is_empty() => None,
                Err(_) => Some(u64::MAX), // beyond 64 bits
            }
        })
        .fold(1u64, u64::saturating_mul)
}

/// Describe the XML file `path` in a child process (`exe __vet-topology FILE [--export-xml OUT]`,
/// where `exe` is a megatrain binary, which prints the [`Machine`] as JSON) and never load it in
/// this one. hwloc is C and trusts its input: a malformed file can crash it — a `Machine` object
/// without `complete_nodeset` segfaults hwloc 2.9 inside `hwloc_topology_load` — and some
/// malformed files make it fail an assertion only sometimes (it reads memory the file left
/// unset), so a child that survived once does not make loading it here safe. A crash, a hang
/// and an ordinary error of the child are each reported as an error naming the file.
pub fn describe_in_child(
    exe: &Path,
    path: &Path,
    export_xml: Option<&Path>,
) -> Result<crate::topology::Machine> {
    use std::io::Read;
    use std::os::unix::process::ExitStatusExt;
    let mut cmd = std::process::Command::new(exe);
    cmd.arg("__vet-topology").arg(path);
    if let Some(out) = export_xml {
        cmd.arg("--export-xml").arg(out);
    }
    let mut child = cmd
        .stdin(std::process::Stdio::null())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .map_err(|e| Error::io("start a child to read the topology file", exe, e))?;
    // Drain both pipes while waiting, so a large description cannot block the child.
    let drain = |pipe: Option<Box<dyn Read + Send>>| {
        std::thread::spawn(move || {
            let mut text = String::new();
            if let Some(mut p) = pipe {
                let _ = p.read_to_string(&mut text);
            }
            text
        })
    };
    let out = drain(
        child
            .stdout
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let err = drain(
        child
            .stderr
            .take()
            .map(|p| Box::new(p) as Box<dyn Read + Send>),
    );
    let shown = path.display().to_string();
    let fix = "re-export the machine with `megatrain probe --export-xml FILE` or `lstopo-no-graphics --of xml FILE`";
    let deadline = std::time::Instant::now() + std::time::Duration::from_secs(60);
    let status = loop {
        match child.try_wait() {
            Ok(Some(status)) => break status,
            Ok(None) if std::time::Instant::now() < deadline => {
                std::thread::sleep(std::time::Duration::from_millis(2));
            }
            Ok(None) => {
                let _ = child.kill();
                let _ = child.wait();
                return Err(Error::bad_input(
                    "topology file",
                    shown,
                    "hwloc did not finish reading it within 60 s: the file is malformed",
                    Some(fix),
                ));
            }
            Err(e) => return Err(Error::io("wait for the topology reader", exe, e)),
        }
    };
    let (out, err) = (
        out.join().unwrap_or_default(),
        err.join().unwrap_or_default(),
    );
    if let Some(sig) = status.signal() {
        return Err(Error::bad_input(
            "topology file",
            shown,
            format!("hwloc crashed reading it (signal {sig}): the file is malformed, e.g. an object without the cpuset/nodeset attributes hwloc requires"),
            Some(fix),
        ));
    }
    if !status.success() {
        // The child's own error, its last line: "error: …".
        let why = err
            .lines()
            .last()
            .map(|l| l.trim_start_matches("error: ").to_owned())
            .unwrap_or_else(|| format!("the topology reader exited with {status}"));
        return Err(Error::bad_input("topology file", shown, why, None));
    }
    crate::topology::Machine::from_json(&out, &shown)
}

/// Read an hwloc XML file and check, before hwloc sees it, that it is an XML topology of a
/// version hwloc 2.x can import — hwloc itself only says "invalid".
fn read_topology_xml(path: &Path) -> Result<String> {
    let shown = path.display().to_string();
    let bytes = std::fs::read(path).map_err(|e| {
        let fix = match e.kind() {
            std::io::ErrorKind::NotFound => {
                "check the path; export a topology with `megatrain probe --export-xml FILE`"
            }
            std::io::ErrorKind::IsADirectory => {
                "pass the XML file inside the directory, not the directory"
            }
            _ => "check the file's permissions",
        };
        Error::io("read topology file", path, e).with_fix(fix)
    })?;
    let text = String::from_utf8(bytes).map_err(|_| {
        Error::bad_input(
            "topology file",
            &shown,
            "not text (not UTF-8): not an hwloc XML export",
            Some("pass a file written by `lstopo --of xml` or `megatrain probe --export-xml`"),
        )
    })?;
    let head = text.trim_start();
    let Some(start) = head.find("<topology") else {
        let reason = if head.starts_with('<') {
            "XML without a <topology> element: not an hwloc topology export"
        } else {
            "not XML"
        };
        return Err(Error::bad_input(
            "topology file",
            &shown,
            reason,
            Some("pass a file written by `lstopo --of xml` or `megatrain probe --export-xml`"),
        ));
    };
    if let Some(version) = xml_attr(&head[start..], "version") {
        let major = version
            .split('.')
            .next()
            .and_then(|m| m.parse::<u32>().ok());
        if major.is_some_and(|m| m > MAX_XML_MAJOR) {
            return Err(Error::bad_input(
                "topology file",
                &shown,
                format!(
                    "hwloc XML version {version}, written by hwloc 3 or newer; this build uses hwloc 2.x, which reads versions up to 2.0"
                ),
                Some("re-export it with hwloc 2.x (`lstopo-no-graphics --of xml FILE`)"),
            ));
        }
    }
    Ok(text)
}

/// Value of attribute `name` in the first tag of `tag_text`.
fn xml_attr<'a>(tag_text: &'a str, name: &str) -> Option<&'a str> {
    let end = tag_text.find('>')?;
    let tag = &tag_text[..end];
    let pat = format!("{name}=\"");
    let at = tag.find(&pat)? + pat.len();
    let len = tag[at..].find('"')?;
    Some(&tag[at..at + len])
}

/// Write `topo` as an hwloc v2 XML file.
pub fn export_xml(topo: &Topology, path: &Path) -> Result<()> {
    let xml = topo
        .export_xml(XMLExportFlags::empty())
        .map_err(|e| Error::system("hwloc", "export XML", e))?;
    crate::util::write_atomic(path, xml.as_str().as_bytes())
}

fn info(obj: &TopologyObject, key: &str) -> Option<String> {
    obj.info(key)
        .map(|v| v.to_string_lossy().trim().to_owned())
        .filter(|v| !v.is_empty())
}

/// A cpuset in Linux list format ("0-13,112-125").
fn cpu_list(set: &CpuSet) -> String {
    let bitmap: &Bitmap = set.as_ref();
    bitmap.to_string()
}

fn os_index(obj: &TopologyObject) -> u32 {
    obj.os_index()
        .and_then(|i| u32::try_from(i).ok())
        .unwrap_or(u32::MAX)
}

/// Read the topology into a [`Machine`]. Live-only facts are left empty; see [`super::linux`].
pub fn describe(topo: &Topology, source: &TopologySource) -> Result<Machine> {
    let root = topo.root_object();
    let source = match source {
        TopologySource::Live => Source::Live,
        TopologySource::XmlFile(p) => Source::Xml {
            path: p.display().to_string(),
        },
        TopologySource::Synthetic(d) => Source::Synthetic {
            description: d.clone(),
        },
    };
    let os = match (info(root, "OSName"), info(root, "OSRelease")) {
        (Some(n), Some(r)) => Some(format!("{n} {r}")),
        (n, _) => n,
    };

    let cores: Vec<&TopologyObject> = topo.objects_with_type(ObjectType::Core).collect();
    let numa_nodes = numa_nodes(topo, &cores);
    let packages = topo
        .objects_with_type(ObjectType::Package)
        .map(|p| {
            let cpuset = p.cpuset();
            Package {
                os_index: os_index(p),
                cpu_model: info(p, "CPUModel"),
                cores: cpuset.as_ref().map_or(0, |set| {
                    cores.iter().filter(|c| c.is_inside_cpuset(&**set)).count()
                }),
                hardware_threads: cpuset.and_then(|s| s.weight()).unwrap_or(0),
                numa_nodes: numa_nodes
                    .iter()
                    .filter(|n| n.package == p.os_index().and_then(|i| u32::try_from(i).ok()))
                    .map(|n| n.os_index)
                    .collect(),
            }
        })
        .collect();

    let numa_distances = numa_distances(topo);
    let gpu_scan = gpus(topo, &numa_nodes);
    let gpu_links = gpu_link_matrix(topo, &gpu_scan);
    let gpu_numa = gpu_numa_matrix(&gpu_scan, &numa_nodes, numa_distances.as_ref());
    let block_devices = block_devices(topo, &numa_nodes);

    Ok(Machine {
        schema_version: SCHEMA_VERSION,
        source,
        hostname: info(root, "HostName"),
        os,
        architecture: info(root, "Architecture"),
        packages,
        cores: cores.len(),
        hardware_threads: topo.objects_with_type(ObjectType::PU).count(),
        numa_nodes,
        numa_distances,
        memory: HostMemory::default(),
        io_uring: None,
        cuda: None,
        gpus: gpu_scan.into_iter().map(|g| g.gpu).collect(),
        gpu_links,
        gpu_numa,
        block_devices,
    })
}

fn memory_kind(node: &TopologyObject) -> MemoryKind {
    let subtype = node
        .subtype()
        .map(|s| s.to_string_lossy().to_ascii_lowercase());
    match subtype.as_deref() {
        Some("gpumemory") => MemoryKind::GpuMemory,
        Some("mcdram" | "hbm") => MemoryKind::Hbm,
        Some(_) => MemoryKind::Other,
        None => MemoryKind::Dram,
    }
}

fn numa_nodes(topo: &Topology, cores: &[&TopologyObject]) -> Vec<NumaNode> {
    let mut nodes: Vec<NumaNode> = topo
        .objects_with_type(ObjectType::NUMANode)
        .map(|n| {
            let cpuset = n.cpuset();
            let huge_pages = match n.attributes() {
                // The smallest page type is the base page (4 KiB on x86, 64 KiB on POWER).
                Some(ObjectAttributes::NUMANode(attr)) => attr
                    .page_types()
                    .iter()
                    .skip(1)
                    .map(|pt| HugePages {
                        page_bytes: pt.size().get(),
                        total: pt.count(),
                        free: None,
                    })
                    .collect(),
                _ => Vec::new(),
            };
            NumaNode {
                os_index: os_index(n),
                kind: memory_kind(n),
                package: n
                    .first_ancestor_with_type(ObjectType::Package)
                    .map(os_index),
                memory_bytes: match n.attributes() {
                    Some(ObjectAttributes::NUMANode(attr)) => {
                        attr.local_memory().map_or(0, |m| m.get())
                    }
                    _ => 0,
                },
                free_bytes: None,
                available_bytes: None,
                cpus: cpuset.as_ref().map(|s| cpu_list(s)).unwrap_or_default(),
                hardware_threads: cpuset.as_ref().and_then(|s| s.weight()).unwrap_or(0),
                cores: cpuset.as_ref().map_or(0, |set| {
                    cores.iter().filter(|c| c.is_inside_cpuset(&**set)).count()
                }),
                pci_bus_id: info(n, "PCIBusID").map(|s| s.to_ascii_lowercase()),
                huge_pages,
            }
        })
        .collect();
    nodes.sort_by_key(|n| n.os_index);
    nodes
}

fn numa_distances(topo: &Topology) -> Option<NumaDistances> {
    let all = topo.distances(None).ok()?;
    all.iter().find_map(|d| {
        let objs: Vec<&TopologyObject> = d.objects().collect::<Option<Vec<_>>>()?;
        if objs.is_empty() || objs.iter().any(|o| o.object_type() != ObjectType::NUMANode) {
            return None;
        }
        let n = objs.len();
        let raw = d.distances();
        let nodes: Vec<u32> = objs.iter().map(|o| os_index(o)).collect();
        let mut order: Vec<usize> = (0..n).collect();
        order.sort_by_key(|&i| nodes[i]);
        Some(NumaDistances {
            name: d.name().map_or_else(
                || "NUMA distances".to_owned(),
                |s| s.to_string_lossy().into_owned(),
            ),
            nodes: order.iter().map(|&i| nodes[i]).collect(),
            values: order
                .iter()
                .map(|&i| order.iter().map(|&j| raw[i * n + j]).collect())
                .collect(),
        })
    })
}

fn bus_id(obj: &TopologyObject) -> Option<String> {
    match obj.attributes() {
        Some(ObjectAttributes::PCIDevice(p)) => Some(format!(
            "{:04x}:{:02x}:{:02x}.{:x}",
            p.domain(),
            p.bus_id(),
            p.bus_device(),
            p.function()
        )),
        _ => None,
    }
}

/// The PCI path of an I/O object and the CPU-attached NUMA nodes where it meets the CPUs.
fn pci_path(obj: &TopologyObject, numa: &[NumaNode]) -> (PciPath, String) {
    let mut hops = Vec::new();
    let mut cpus = String::new();
    let mut local_numa = Vec::new();
    for anc in obj.ancestors() {
        if anc.object_type() == ObjectType::Bridge {
            let id = anc.global_persistent_index();
            let host = matches!(anc.attributes(),
                Some(ObjectAttributes::Bridge(b)) if b.upstream_type() == BridgeType::Host);
            hops.push(if host {
                Hop::HostBridge(id)
            } else {
                Hop::Bridge(id)
            });
        } else if !anc.object_type().is_io() {
            if let Some(set) = anc.cpuset() {
                cpus = cpu_list(&set);
            }
            if let Some(nodeset) = anc.nodeset() {
                local_numa = nodeset
                    .iter_set()
                    .filter_map(|i| u32::try_from(usize::from(i)).ok())
                    .filter(|i| {
                        numa.iter()
                            .any(|n| n.os_index == *i && n.kind != MemoryKind::GpuMemory)
                    })
                    .collect();
            }
            break;
        }
    }
    (PciPath { hops, local_numa }, cpus)
}

struct GpuScan {
    gpu: Gpu,
    path: PciPath,
    gp_index: u64,
}

fn gpus(topo: &Topology, numa: &[NumaNode]) -> Vec<GpuScan> {
    let mut found: Vec<GpuScan> = Vec::new();
    for dev in topo.pci_devices() {
        let Some(ObjectAttributes::PCIDevice(attr)) = dev.attributes() else {
            continue;
        };
        let Some(bus) = bus_id(dev) else { continue };
        let display_class = attr.class_id() >> 8 == 0x03;
        let memory_node = numa
            .iter()
            .find(|n| n.kind == MemoryKind::GpuMemory && n.pci_bus_id.as_deref() == Some(&bus));
        if !display_class || !(attr.vendor_id() == NVIDIA_VENDOR || memory_node.is_some()) {
            continue;
        }
        let (path, cpus) = pci_path(dev, numa);
        // hwloc's CUDA/NVML/OpenCL OS devices below the PCI device carry the driver's facts.
        let osdev_info = |key: &str| dev.io_children().find_map(|c| info(c, key));
        let model =
            pci_ids::nvidia_model(attr.device_id()).filter(|_| attr.vendor_id() == NVIDIA_VENDOR);
        let speed = f64::from(attr.link_speed());
        let link = if memory_node.is_some() {
            GpuLink::coherent_nvlink()
        } else {
            let inferred = pci_ids::infer_pcie(speed);
            GpuLink {
                kind: if speed > 0.0 {
                    LinkKind::Pcie
                } else {
                    LinkKind::Unknown
                },
                pcie_generation: inferred.map(|(g, _)| g),
                pcie_width: inferred.map(|(_, w)| w),
                gbytes_per_s: (speed > 0.0).then_some(speed),
                inferred: inferred.is_some(),
            }
        };
        let gpu = Gpu {
            index: 0,
            pci_bus_id: bus,
            vendor_id: attr.vendor_id(),
            device_id: attr.device_id(),
            name: osdev_info("GPUModel").or_else(|| model.map(|m| m.name.to_owned())),
            // hwloc's CUDA backend reports KiB.
            memory_bytes: osdev_info("CUDAGlobalMemorySize")
                .and_then(|v| v.parse::<u64>().ok())
                .map(|kib| kib * 1024)
                .or(memory_node.map(|n| n.memory_bytes)),
            compute_capability: model.map(|m| m.compute_capability.to_owned()),
            multiprocessors: osdev_info("CUDAMultiProcessors").and_then(|v| v.parse().ok()),
            link,
            driver_version: None,
            numa_nodes: path.local_numa.clone(),
            cpus,
            memory_numa_node: memory_node.map(|n| n.os_index),
            discovered_by: "pci".to_owned(),
        };
        found.push(GpuScan {
            gpu,
            path,
            gp_index: dev.global_persistent_index(),
        });
    }
    found.sort_by(|a, b| a.gpu.pci_bus_id.cmp(&b.gpu.pci_bus_id));
    for (i, g) in found.iter_mut().enumerate() {
        g.gpu.index = i;
    }
    found
}

/// NVLink bandwidth in MB/s between GPUs i and j, from hwloc's "NVLinkBandwidth" matrix (whose
/// objects are the GPUs' NVML OS devices).
fn nvlink_matrix(topo: &Topology, gpus: &[GpuScan]) -> Vec<Vec<u64>> {
    let n = gpus.len();
    let mut bw = vec![vec![0u64; n]; n];
    let Ok(all) = topo.distances(None) else {
        return bw;
    };
    for d in &all {
        if d.name().map(|s| s.to_string_lossy()) != Some("NVLinkBandwidth".into()) {
            continue;
        }
        let gpu_of: Vec<Option<usize>> = d
            .objects()
            .map(|o| {
                let pci = o?
                    .ancestors()
                    .find(|a| a.object_type() == ObjectType::PCIDevice)?;
                gpus.iter()
                    .position(|g| g.gp_index == pci.global_persistent_index())
            })
            .collect();
        let m = gpu_of.len();
        let raw = d.distances();
        for (a, ga) in gpu_of.iter().enumerate() {
            for (b, gb) in gpu_of.iter().enumerate() {
                if let (Some(i), Some(j)) = (ga, gb) {
                    if i != j {
                        bw[*i][*j] = raw[a * m + b];
                    }
                }
            }
        }
    }
    bw
}

fn gpu_link_matrix(topo: &Topology, gpus: &[GpuScan]) -> Vec<Vec<LinkClass>> {
    let nvlink = nvlink_matrix(topo, gpus);
    gpus.iter()
        .enumerate()
        .map(|(i, a)| {
            gpus.iter()
                .enumerate()
                .map(|(j, b)| {
                    if i == j {
                        LinkClass::X
                    } else if nvlink[i][j] > 0 {
                        LinkClass::Nv(u32::try_from(nvlink[i][j] / 1000).unwrap_or(u32::MAX))
                    } else {
                        links::classify(&a.path, &b.path)
                    }
                })
                .collect()
        })
        .collect()
}

fn gpu_numa_matrix(
    gpus: &[GpuScan],
    numa: &[NumaNode],
    distances: Option<&NumaDistances>,
) -> Vec<Vec<GpuNumaLink>> {
    gpus.iter()
        .map(|g| {
            numa.iter()
                .map(|n| {
                    let class = if g.gpu.memory_numa_node == Some(n.os_index) {
                        LinkClass::X
                    } else if g.gpu.numa_nodes.contains(&n.os_index) {
                        LinkClass::Phb
                    } else {
                        LinkClass::Sys
                    };
                    let distance = distances.and_then(|d| {
                        g.gpu
                            .numa_nodes
                            .iter()
                            .filter_map(|&l| d.between(l, n.os_index))
                            .min()
                    });
                    GpuNumaLink { class, distance }
                })
                .collect()
        })
        .collect()
}

/// Transport of a block device, from its kernel name.
pub fn transport_of(name: &str) -> &'static str {
    if name.starts_with("nvme") {
        "nvme"
    } else if name.starts_with("sd") {
        "scsi"
    } else if name.starts_with("vd") {
        "virtio"
    } else {
        "other"
    }
}

fn block_devices(topo: &Topology, numa: &[NumaNode]) -> Vec<BlockDevice> {
    let mut devs: Vec<BlockDevice> = topo
        .objects_with_type(ObjectType::OSDevice)
        .filter(|o| {
            matches!(o.attributes(),
                Some(ObjectAttributes::OSDevice(a)) if a.device_type() == OSDeviceType::Storage)
        })
        .map(|o| {
            let name = o
                .name()
                .map(|n| n.to_string_lossy().into_owned())
                .unwrap_or_default();
            let pci = o
                .ancestors()
                .find(|a| a.object_type() == ObjectType::PCIDevice);
            let (path, _) = pci_path(o, numa);
            BlockDevice {
                transport: transport_of(&name).to_owned(),
                model: info(o, "Model"),
                // hwloc reports KiB.
                size_bytes: info(o, "Size")
                    .and_then(|v| v.parse::<u64>().ok())
                    .map(|k| k * 1024),
                rotational: None,
                numa_node: pci.and(match path.local_numa.as_slice() {
                    [one] => Some(*one),
                    _ => None,
                }),
                pci_bus_id: pci.and_then(bus_id),
                mount_points: Vec::new(),
                name,
            }
        })
        .collect();
    sort_block_devices(&mut devs);
    devs
}

/// NVMe first, then by name: the order users scan for spill targets.
pub fn sort_block_devices(devs: &mut [BlockDevice]) {
    devs.sort_by(|a, b| (a.transport != "nvme", &a.name).cmp(&(b.transport != "nvme", &b.name)));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn xml_version_attribute() {
        assert_eq!(
            xml_attr("<topology version=\"3.0\">", "version"),
            Some("3.0")
        );
        assert_eq!(xml_attr("<topology>", "version"), None);
    }

    #[test]
    fn synthetic_topologies_are_bounded_before_hwloc_builds_them() {
        assert_eq!(synthetic_leaves("pack:2 numa:2 core:8 pu:2"), 64);
        assert_eq!(synthetic_leaves("pack:2 numa:2(memory=1GB) pu:3"), 12);
        assert_eq!(synthetic_leaves("pack:x"), 1);
        assert_eq!(synthetic_leaves("core:99999999999999999999999"), u64::MAX);
        let started = std::time::Instant::now();
        let e = load(&TopologySource::Synthetic("pack:10 core:10000 pu:1".into()))
            .err()
            .map(|e| e.to_string())
            .unwrap_or_default();
        assert!(e.contains("100000 objects"), "{e}");
        assert!(started.elapsed().as_secs() < 5);
    }

    #[test]
    fn synthetic_machine_has_numa_and_cores() {
        let src = TopologySource::Synthetic("pack:2 numa:2 core:4 pu:2".into());
        let topo = load(&src).unwrap();
        let m = describe(&topo, &src).unwrap();
        assert_eq!(m.packages.len(), 2);
        assert_eq!(m.numa_nodes.len(), 4);
        assert_eq!(m.cores, 16);
        assert_eq!(m.hardware_threads, 32);
        assert!(m.numa_nodes.iter().all(|n| n.cores == 4));
        assert_eq!(m.packages[1].numa_nodes, vec![2, 3]);
        assert!(m.gpus.is_empty());
    }

    #[test]
    fn transports() {
        assert_eq!(transport_of("nvme0n1"), "nvme");
        assert_eq!(transport_of("vda"), "virtio");
        assert_eq!(transport_of("sdb"), "scsi");
        assert_eq!(transport_of("mmcblk0"), "other");
    }
}
