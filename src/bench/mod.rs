//! The CLI's `bench` commands: measured throughput next to the physical limit measured in the
//! same run (or, for the GPU kernels, the datasheet peak).

pub mod adam;
pub mod attention;
pub mod engine;
pub mod kernel_report;
#[cfg(feature = "cuda")]
pub mod kernels;
pub mod link;
pub mod nvme;

/// A benchmark report in JSON, tagged by the benchmark (`"bench": "adam"`): what `megatrain bench
/// adam|nvme|link|kernels --json` prints and `megatrain plan --calibration` reads back, by type.
#[derive(Debug, Clone, serde::Serialize, serde::Deserialize)]
#[serde(tag = "bench", rename_all = "lowercase")]
pub enum Report {
    /// `bench adam`.
    Adam(adam::AdamBenchReport),
    /// `bench nvme`.
    Nvme(nvme::NvmeReport),
    /// `bench link`.
    Link(link::LinkReport),
    /// `bench kernels` (a CUDA build on a GPU).
    Kernels(kernel_report::KernelReport),
}

impl Report {
    /// The report as its text table.
    pub fn render(&self) -> String {
        match self {
            Report::Adam(r) => adam::render(r),
            Report::Nvme(r) => nvme::render(r),
            Report::Link(r) => link::render(r),
            Report::Kernels(r) => kernel_report::render(r),
        }
    }
}
