//! `megatrain probe`: the live machine, recorded real servers, JSON round trip, bad input.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

use megatrain::topology::{self, LinkClass, LinkKind, Machine, MemoryKind, TopologySource};
use std::path::{Path, PathBuf};
use std::process::Command;

const GIB: f64 = 1024.0 * 1024.0 * 1024.0;

/// Recorded real servers, copied from the team's topology collection with their sources
/// (`tests/fixtures/topologies/SOURCES.md`).
fn topologies() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/topologies")
}

fn recorded(name: &str) -> Machine {
    let path = topologies().join(name);
    topology::probe(&TopologySource::XmlFile(path)).unwrap()
}

fn megatrain(args: &[&str]) -> (i32, String, String) {
    let out = Command::new(env!("CARGO_BIN_EXE_megatrain"))
        .args(args)
        .output()
        .unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stdout).into_owned(),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

#[test]
fn live_machine() {
    let m = topology::probe(&TopologySource::Live).unwrap();
    assert!(m.source.is_live());
    assert!(m.cores >= 1 && m.hardware_threads >= m.cores);
    assert!(!m.numa_nodes.is_empty());
    let cpus_in_nodes: usize = m
        .numa_nodes
        .iter()
        .filter(|n| n.kind == MemoryKind::Dram)
        .map(|n| n.hardware_threads)
        .sum();
    assert_eq!(cpus_in_nodes, m.hardware_threads);
    for n in &m.numa_nodes {
        assert!(n.memory_bytes > 0, "node {} has no memory", n.os_index);
        let free = n.free_bytes.expect("live free memory");
        assert!(free <= n.memory_bytes);
    }
    assert!(m.memory.memlock.is_some());
    assert!(
        m.memory.transparent_huge_pages.is_some()
            || !Path::new("/sys/kernel/mm/transparent_hugepage").exists()
    );
    assert!(m.io_uring.is_some());
    // The root filesystem lives on some block device, and we find its mount.
    assert!(
        m.block_devices
            .iter()
            .any(|b| b.mount_points.iter().any(|p| p == "/"))
            || m.block_devices.is_empty(),
        "no block device mounted on /: {:?}",
        m.block_devices
    );
    // Round trip through JSON.
    let back = Machine::from_json(&m.to_json(), "live").unwrap();
    assert_eq!(back, m);
}

#[test]
fn ipa20_four_h100_on_odd_snc_nodes() {
    let m = recorded("ipa20.xml");
    assert_eq!(m.packages.len(), 2);
    assert_eq!(m.numa_nodes.len(), 8);
    assert_eq!(m.cores, 112);
    assert_eq!(m.hardware_threads, 224);
    for n in &m.numa_nodes {
        let gib = n.memory_bytes as f64 / GIB;
        assert!(
            (500.0..506.0).contains(&gib),
            "node {} has {gib} GiB",
            n.os_index
        );
        assert_eq!(n.cores, 14);
    }
    assert_eq!(m.packages[0].numa_nodes, vec![0, 1, 2, 3]);
    assert_eq!(m.gpus.len(), 4);
    let mut local: Vec<u32> = m.gpus.iter().flat_map(|g| g.numa_nodes.clone()).collect();
    local.sort();
    assert_eq!(local, vec![1, 3, 5, 7]);
    for g in &m.gpus {
        assert_eq!((g.vendor_id, g.device_id), (0x10de, 0x2330));
        assert_eq!(g.name.as_deref(), Some("NVIDIA H100 80GB HBM3"));
        assert_eq!(g.compute_capability.as_deref(), Some("9.0"));
        assert_eq!(g.link.kind, LinkKind::Pcie);
        assert_eq!(
            (g.link.pcie_generation, g.link.pcie_width),
            (Some(5), Some(16))
        );
        assert_eq!(g.multiprocessors, Some(132));
        assert!(g.memory_bytes.unwrap() > 79 * (1 << 30));
    }
    // NVLink between every pair (hwloc's NVLinkBandwidth: 150 GB/s).
    for (i, row) in m.gpu_links.iter().enumerate() {
        for (j, c) in row.iter().enumerate() {
            let want = if i == j {
                LinkClass::X
            } else {
                LinkClass::Nv(150)
            };
            assert_eq!(*c, want);
        }
    }
    // GPU0 (4e:00.0) hangs off P#3: local there, 12 to its socket's other nodes, 21 across.
    let g0 = &m.gpus[0];
    assert_eq!(g0.pci_bus_id, "0000:4e:00.0");
    assert_eq!(g0.numa_nodes, vec![3]);
    let row = &m.gpu_numa[0];
    assert_eq!(row[3].class, LinkClass::Phb);
    assert_eq!(row[3].distance, Some(10));
    assert_eq!((row[0].class, row[0].distance), (LinkClass::Sys, Some(12)));
    assert_eq!((row[4].class, row[4].distance), (LinkClass::Sys, Some(21)));
    let dist = m.numa_distances.as_ref().unwrap();
    assert_eq!(dist.between(0, 4), Some(21));
    // The NVMe drive sits behind the same switch as GPU0, on P#3.
    let nvme = m
        .block_devices
        .iter()
        .find(|b| b.transport == "nvme")
        .unwrap();
    assert_eq!(nvme.numa_node, Some(3));
    assert_eq!(nvme.pci_bus_id.as_deref(), Some("0000:4b:00.0"));
}

#[test]
fn g4dnmetal_eight_t4_four_per_socket() {
    let m = recorded("g4dnmetal.xml");
    assert_eq!(m.packages.len(), 2);
    assert_eq!(m.gpus.len(), 8);
    assert!(m.gpus.iter().all(|g| g.name.as_deref() == Some("Tesla T4")));
    for node in [0u32, 1] {
        assert_eq!(
            m.gpus.iter().filter(|g| g.numa_nodes == vec![node]).count(),
            4
        );
    }
    // Across sockets: SYS. Same socket: through host bridges, never SYS.
    for (i, gi) in m.gpus.iter().enumerate() {
        for (j, gj) in m.gpus.iter().enumerate() {
            let c = m.gpu_links[i][j];
            if i == j {
                assert_eq!(c, LinkClass::X);
            } else if gi.numa_nodes == gj.numa_nodes {
                assert!(matches!(
                    c,
                    LinkClass::Phb | LinkClass::Node | LinkClass::Pix | LinkClass::Pxb
                ));
            } else {
                assert_eq!(c, LinkClass::Sys);
            }
        }
    }
}

#[test]
fn jrc0832_eight_nodes_no_gpu() {
    let m = recorded("topo.jrc0832.xml");
    assert_eq!(m.numa_nodes.len(), 8);
    assert!(m.gpus.is_empty());
    assert_eq!(m.cores, 128);
    let d = m.numa_distances.as_ref().unwrap();
    assert_eq!(d.between(0, 0), Some(10));
    assert_eq!(d.between(0, 1), Some(12));
    assert_eq!(d.between(0, 7), Some(32));
}

#[test]
fn jwb0004_a100_on_odd_nps4_nodes() {
    let m = recorded("topo.jwb0004.xml");
    let nodes: Vec<Vec<u32>> = m.gpus.iter().map(|g| g.numa_nodes.clone()).collect();
    assert_eq!(nodes, vec![vec![3], vec![1], vec![7], vec![5]]);
    assert!(m.gpus.iter().all(|g| g.link.pcie_generation == Some(4)));
}

#[test]
fn power9_gpu_memory_as_numa_nodes() {
    let m = recorded("nvidiagpunumanodes-kept.xml");
    let gpu_mem: Vec<_> = m
        .numa_nodes
        .iter()
        .filter(|n| n.kind == MemoryKind::GpuMemory)
        .collect();
    assert_eq!(gpu_mem.len(), 6);
    assert!(gpu_mem.iter().all(|n| n.pci_bus_id.is_some()));
    assert!(gpu_mem
        .iter()
        .all(|n| (n.memory_bytes as f64 / GIB - 15.0).abs() < 0.1));
    assert_eq!(m.gpus.len(), 6);
    for (i, g) in m.gpus.iter().enumerate() {
        assert_eq!(g.link.kind, LinkKind::CoherentNvlink);
        let mem = g.memory_numa_node.expect("GPU memory node");
        let node = m.numa_node(mem).unwrap();
        assert_eq!(node.pci_bus_id.as_deref(), Some(g.pci_bus_id.as_str()));
        let k = m.numa_nodes.iter().position(|n| n.os_index == mem).unwrap();
        assert_eq!(m.gpu_numa[i][k].class, LinkClass::X);
        // Local CPU node: P#0 on socket 0, P#8 on socket 1; never a GPU memory node.
        assert!(g.numa_nodes == vec![0] || g.numa_nodes == vec![8]);
    }
}

#[test]
fn every_recorded_topology_loads_and_round_trips() {
    let dir = topologies();
    let mut n = 0;
    for e in std::fs::read_dir(&dir).unwrap() {
        let path = e.unwrap().path();
        if path.extension().and_then(|x| x.to_str()) != Some("xml") {
            continue;
        }
        let m = topology::probe(&TopologySource::XmlFile(path.clone()))
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        assert!(m.hardware_threads > 0, "{}", path.display());
        assert_eq!(Machine::from_json(&m.to_json(), "t").unwrap(), m);
        assert_eq!(m.gpu_links.len(), m.gpus.len());
        assert!(!topology::render::report(&m).is_empty());
        n += 1;
    }
    assert!(n >= 9, "expected the 9 recorded topologies, found {n}");
}

#[test]
fn synthetic_and_export_round_trip_through_cli() {
    let dir = tempfile::tempdir().unwrap();
    let xml = dir.path().join("synth.xml");
    let (rc, _, err) = megatrain(&[
        "probe",
        "--synthetic",
        "pack:2 numa:2 core:4 pu:2",
        "--export-xml",
        xml.to_str().unwrap(),
    ]);
    assert_eq!(rc, 0, "{err}");
    let (rc, out, err) = megatrain(&["probe", "--json", "--topology", xml.to_str().unwrap()]);
    assert_eq!(rc, 0, "{err}");
    let m = Machine::from_json(&out, "cli").unwrap();
    assert_eq!(m.numa_nodes.len(), 4);
    assert_eq!(m.cores, 16);
    assert_eq!(m.packages.len(), 2);
}

#[test]
fn json_from_cli_equals_library_description() {
    let dir = topologies();
    let path = dir.join("ipa20.xml");
    let (rc, out, err) = megatrain(&["probe", "--json", "--topology", path.to_str().unwrap()]);
    assert_eq!(rc, 0, "{err}");
    let from_cli = Machine::from_json(&out, "cli").unwrap();
    let direct = topology::probe(&TopologySource::XmlFile(path)).unwrap();
    assert_eq!(from_cli, direct);
}

/// Bad input: one `error:` line naming the input and the reason, exit code 2, no panic.
fn assert_clean_failure(args: &[&str], must_mention: &[&str]) {
    let (rc, out, err) = megatrain(args);
    assert_eq!(rc, 2, "args {args:?}: stdout {out} stderr {err}");
    assert!(!err.contains("panicked"), "{err}");
    let lines: Vec<&str> = err.lines().collect();
    assert_eq!(lines.len(), 1, "one error line expected: {err}");
    assert!(lines[0].starts_with("error: "), "{err}");
    for m in must_mention {
        assert!(err.contains(m), "`{m}` missing from: {err}");
    }
}

#[test]
fn bad_inputs_fail_cleanly() {
    let dir = tempfile::tempdir().unwrap();
    let p = |name: &str| dir.path().join(name).to_str().unwrap().to_owned();

    let missing = p("missing.xml");
    assert_clean_failure(
        &["probe", "--topology", &missing],
        &[&missing, "No such file"],
    );

    let text = p("notes.txt");
    std::fs::write(&text, "this is not xml\n").unwrap();
    assert_clean_failure(&["probe", "--topology", &text], &[&text, "not XML"]);

    // An export as hwloc 3 writes it (version="3.0"), which hwloc 2.x refuses.
    let v2 = p("v2.xml");
    let (rc, _, _) = megatrain(&[
        "probe",
        "--synthetic",
        "pack:1 core:2 pu:1",
        "--export-xml",
        &v2,
    ]);
    assert_eq!(rc, 0);
    let v3 = p("v3.xml");
    let body = std::fs::read_to_string(&v2)
        .unwrap()
        .replace("<topology version=\"2.0\">", "<topology version=\"3.0\">");
    assert!(body.contains("version=\"3.0\""));
    std::fs::write(&v3, body).unwrap();
    assert_clean_failure(&["probe", "--topology", &v3], &[&v3, "version 3.0"]);

    let truncated = p("truncated.xml");
    let full = std::fs::read_to_string(&v2).unwrap();
    std::fs::write(&truncated, &full[..full.len() / 2]).unwrap();
    assert_clean_failure(
        &["probe", "--topology", &truncated],
        &[&truncated, "truncated"],
    );

    assert_clean_failure(
        &["probe", "--synthetic", "pack:2 bogus:3"],
        &["pack:2 bogus:3", "synthetic"],
    );

    assert_clean_failure(
        &["probe", "--topology", dir.path().to_str().unwrap()],
        &["directory"],
    );
}

#[test]
fn machine_json_rejects_other_schema_versions() {
    let m = topology::probe(&TopologySource::Synthetic("pack:1 core:2 pu:1".into())).unwrap();
    let text = m
        .to_json()
        .replace("\"schema_version\": 1", "\"schema_version\": 99");
    let e = Machine::from_json(&text, "old.json").unwrap_err();
    assert!(e.to_string().contains("schema version 99"), "{e}");
    let e = Machine::from_json("{}", "empty.json").unwrap_err();
    assert!(e.to_string().contains("empty.json"), "{e}");
}
