//! What the PCI ids of NVIDIA data-centre GPUs tell us, for sources without a driver (XML exports,
//! machines where CUDA is absent), and PCIe generation/width inference from hwloc's link speed.

/// Facts about a GPU model known from its PCI device id.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GpuModel {
    /// Marketing name.
    pub name: &'static str,
    /// Compute capability "major.minor".
    pub compute_capability: &'static str,
}

/// NVIDIA's PCI vendor id.
pub const NVIDIA_VENDOR: u16 = 0x10de;

const MODELS: &[(u16, GpuModel)] = &[
    (0x1db1, m("Tesla V100-SXM2-16GB", "7.0")),
    (0x1db4, m("Tesla V100-PCIE-16GB", "7.0")),
    (0x1db5, m("Tesla V100-SXM2-32GB", "7.0")),
    (0x1db8, m("Tesla V100-SXM3-32GB", "7.0")),
    (0x1eb8, m("Tesla T4", "7.5")),
    (0x20b0, m("A100-SXM4-40GB", "8.0")),
    (0x20b2, m("A100-SXM4-80GB", "8.0")),
    (0x20b5, m("A100 80GB PCIe", "8.0")),
    (0x20f1, m("A100-PCIE-40GB", "8.0")),
    (0x2321, m("H100 NVL", "9.0")),
    (0x2330, m("H100 SXM5 80GB", "9.0")),
    (0x2331, m("H100 PCIe", "9.0")),
    (0x2335, m("H200 SXM 141GB", "9.0")),
    (0x233b, m("H200 NVL", "9.0")),
    (0x2342, m("GH200 480GB", "9.0")),
    (0x2348, m("GH200 144G HBM3e", "9.0")),
    (0x2684, m("GeForce RTX 4090", "8.9")),
    (0x26b5, m("L40", "8.9")),
    (0x26b9, m("L40S", "8.9")),
    (0x27b8, m("L4", "8.9")),
    (0x2901, m("B200", "10.0")),
];

const fn m(name: &'static str, compute_capability: &'static str) -> GpuModel {
    GpuModel {
        name,
        compute_capability,
    }
}

/// The model for an NVIDIA PCI device id, if we know it.
pub fn nvidia_model(device_id: u16) -> Option<GpuModel> {
    MODELS
        .iter()
        .find(|(id, _)| *id == device_id)
        .map(|(_, model)| *model)
}

/// Per-lane payload bandwidth in GB/s for PCIe generations 1–6, as hwloc computes link speed
/// (transfer rate × encoding efficiency / 8).
const LANE_GBPS: [(u8, f64); 6] = [
    (1, 2.5 * 0.8 / 8.0),
    (2, 5.0 * 0.8 / 8.0),
    (3, 8.0 * 128.0 / 130.0 / 8.0),
    (4, 16.0 * 128.0 / 130.0 / 8.0),
    (5, 32.0 * 128.0 / 130.0 / 8.0),
    (6, 64.0 * 242.0 / 256.0 / 8.0),
];

/// Infer (generation, width) from hwloc's link speed in GB/s. Several pairs give the same speed
/// (Gen5 x8 = Gen4 x16); the widest link wins, since GPUs and NVMe drives sit in full-width
/// slots far more often than in degraded ones. `None` when nothing matches within 1%.
pub fn infer_pcie(gbytes_per_s: f64) -> Option<(u8, u8)> {
    if gbytes_per_s <= 0.0 {
        return None;
    }
    for width in [16u8, 8, 4, 2, 1] {
        for (generation, lane) in LANE_GBPS {
            let expect = lane * f64::from(width);
            if ((gbytes_per_s - expect) / expect).abs() < 0.01 {
                return Some((generation, width));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn infers_common_links() {
        assert_eq!(infer_pcie(63.015385), Some((5, 16)));
        assert_eq!(infer_pcie(31.507692), Some((4, 16)));
        assert_eq!(infer_pcie(15.753846), Some((3, 16)));
        // Gen3 x8 and Gen4 x4 give the same speed: the wider link is reported.
        assert_eq!(infer_pcie(7.876923), Some((3, 8)));
        assert_eq!(infer_pcie(0.0), None);
        assert_eq!(infer_pcie(12.345), None);
    }

    #[test]
    fn knows_h100_and_t4() {
        assert_eq!(
            nvidia_model(0x2330).map(|m| m.compute_capability),
            Some("9.0")
        );
        assert_eq!(nvidia_model(0x1eb8).map(|m| m.name), Some("Tesla T4"));
        assert_eq!(nvidia_model(0xffff), None);
    }
}
