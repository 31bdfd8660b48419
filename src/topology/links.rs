//! Connection classes between PCI devices, with the legend of `nvidia-smi topo -m`.
//!
//! A pure function over [`PciPath`]s (the chain of I/O objects above a device), so it is tested
//! without hwloc. The hwloc side ([`super::hwloc`]) only extracts the paths.

use serde::{Deserialize, Serialize};
use std::fmt;

/// One step on the way from a PCI device up to the CPUs.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Hop {
    /// A PCI-to-PCI bridge (a switch port or a root port), identified by a unique id.
    Bridge(u64),
    /// A host bridge (PCI root complex), identified by a unique id.
    HostBridge(u64),
}

/// The I/O path of one PCI device: bridges from nearest to farthest, then the NUMA nodes local to
/// the CPU-side object the path ends at.
#[derive(Debug, Clone, PartialEq, Eq, Default)]
pub struct PciPath {
    /// Bridges above the device, nearest first.
    pub hops: Vec<Hop>,
    /// OS indices of the CPU-attached NUMA nodes local to where the path meets the CPUs.
    pub local_numa: Vec<u32>,
}

/// Connection class, as in `nvidia-smi topo -m`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum LinkClass {
    /// Self (or, GPU ↔ NUMA: the GPU's own memory).
    X,
    /// NVLink between two GPUs with this many GB/s (from hwloc's NVLinkBandwidth matrix).
    #[serde(rename = "NV")]
    Nv(u32),
    /// At most one PCIe bridge (the same switch).
    #[serde(rename = "PIX")]
    Pix,
    /// Several PCIe bridges, without a host bridge.
    #[serde(rename = "PXB")]
    Pxb,
    /// Through a PCIe host bridge (the CPU), within one NUMA node.
    #[serde(rename = "PHB")]
    Phb,
    /// Between PCIe host bridges within one NUMA node.
    #[serde(rename = "NODE")]
    Node,
    /// Across the SMP interconnect between NUMA nodes or sockets.
    #[serde(rename = "SYS")]
    Sys,
}

impl fmt::Display for LinkClass {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LinkClass::X => f.write_str("X"),
            LinkClass::Nv(gbs) => write!(f, "NV{gbs}"),
            LinkClass::Pix => f.write_str("PIX"),
            LinkClass::Pxb => f.write_str("PXB"),
            LinkClass::Phb => f.write_str("PHB"),
            LinkClass::Node => f.write_str("NODE"),
            LinkClass::Sys => f.write_str("SYS"),
        }
    }
}

/// The legend printed under the matrices.
pub const LEGEND: &str = "  X    = self (GPU x NUMA: the GPU's own memory, exposed as a NUMA node)
  SYS  = crosses the SMP interconnect between NUMA nodes (QPI/UPI, Infinity Fabric, SNC/NPS boundary)
  NODE = crosses the interconnect between PCIe host bridges within one NUMA node
  PHB  = crosses a PCIe host bridge (GPU x NUMA: the node local to the GPU's PCIe root)
  PXB  = crosses several PCIe bridges without crossing a host bridge
  PIX  = crosses at most one PCIe bridge (the same switch)
  NV<n> = NVLink, n GB/s between the two GPUs (hwloc NVLinkBandwidth; nvidia-smi counts links instead)
  GPU x NUMA cells carry the NUMA distance from the GPU's local node (10 = local)";

/// Class of the PCIe connection between two distinct devices.
pub fn classify(a: &PciPath, b: &PciPath) -> LinkClass {
    // The first bridge of `a` that is also on `b`'s path is their lowest common I/O ancestor.
    for (ia, hop) in a.hops.iter().enumerate() {
        if let Some(ib) = b.hops.iter().position(|h| h == hop) {
            return match hop {
                Hop::HostBridge(_) => LinkClass::Phb,
                // Under a common switch upstream port each device sits below at most one
                // downstream port: that is one switch. Deeper trees cross several.
                Hop::Bridge(_) if ia <= 1 && ib <= 1 => LinkClass::Pix,
                Hop::Bridge(_) => LinkClass::Pxb,
            };
        }
    }
    let same_node = a.local_numa.iter().any(|n| b.local_numa.contains(n));
    if same_node {
        LinkClass::Node
    } else {
        LinkClass::Sys
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn path(hops: &[Hop], numa: &[u32]) -> PciPath {
        PciPath {
            hops: hops.to_vec(),
            local_numa: numa.to_vec(),
        }
    }

    #[test]
    fn same_switch_is_pix() {
        // dev -> downstream port (1 / 2) -> upstream port 10 -> root port 20 -> host bridge 30
        let a = path(
            &[
                Hop::Bridge(1),
                Hop::Bridge(10),
                Hop::Bridge(20),
                Hop::HostBridge(30),
            ],
            &[1],
        );
        let b = path(
            &[
                Hop::Bridge(2),
                Hop::Bridge(10),
                Hop::Bridge(20),
                Hop::HostBridge(30),
            ],
            &[1],
        );
        assert_eq!(classify(&a, &b), LinkClass::Pix);
    }

    #[test]
    fn two_level_switch_is_pxb_and_root_is_phb() {
        let a = path(
            &[
                Hop::Bridge(1),
                Hop::Bridge(5),
                Hop::Bridge(6),
                Hop::Bridge(10),
                Hop::HostBridge(30),
            ],
            &[0],
        );
        let b = path(
            &[
                Hop::Bridge(2),
                Hop::Bridge(7),
                Hop::Bridge(8),
                Hop::Bridge(10),
                Hop::HostBridge(30),
            ],
            &[0],
        );
        assert_eq!(classify(&a, &b), LinkClass::Pxb);
        let c = path(&[Hop::Bridge(3), Hop::HostBridge(30)], &[0]);
        assert_eq!(classify(&a, &c), LinkClass::Phb);
    }

    #[test]
    fn host_bridges_in_same_or_other_node() {
        let a = path(&[Hop::Bridge(1), Hop::HostBridge(30)], &[0]);
        let b = path(&[Hop::Bridge(2), Hop::HostBridge(31)], &[0]);
        let c = path(&[Hop::Bridge(3), Hop::HostBridge(32)], &[1]);
        assert_eq!(classify(&a, &b), LinkClass::Node);
        assert_eq!(classify(&a, &c), LinkClass::Sys);
    }

    #[test]
    fn serde_uses_nvidia_smi_spelling() {
        let v = serde_json::to_string(&[LinkClass::Pix, LinkClass::Sys, LinkClass::X]).unwrap();
        assert_eq!(v, r#"["PIX","SYS","X"]"#);
        let back: Vec<LinkClass> = serde_json::from_str(&v).unwrap();
        assert_eq!(back, vec![LinkClass::Pix, LinkClass::Sys, LinkClass::X]);
        let nv = serde_json::to_string(&LinkClass::Nv(150)).unwrap();
        assert_eq!(nv, r#"{"NV":150}"#);
        assert_eq!(LinkClass::Nv(150).to_string(), "NV150");
    }
}
