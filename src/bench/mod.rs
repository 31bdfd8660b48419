//! The CLI's `bench` commands: measured throughput next to the physical limit measured in the
//! same run (or, for the GPU kernels, the datasheet peak).

pub mod adam;
pub mod attention;
pub mod collective;
pub mod engine;
pub mod io;
pub mod kernel_report;
#[cfg(feature = "cuda")]
pub mod kernels;
pub mod link;
pub mod nvme;

use crate::{Error, Result};

/// Most timed repetitions (or steps) a benchmark takes.
pub const MAX_REPS: usize = 100_000;

/// `value` of `flag` within `min..=max`, else an error naming the flag, the range and the fix.
pub fn check_count(flag: &str, value: usize, min: usize, max: usize) -> Result<()> {
    if (min..=max).contains(&value) {
        return Ok(());
    }
    Err(Error::BadInput {
        what: "benchmark setting",
        subject: format!("{flag} {value}"),
        reason: format!("must be between {min} and {max}"),
        fix: Some(format!("pass {flag} within that range")),
    })
}

/// Refuse a benchmark whose buffers (`bytes`, or `None` when the size overflows 64 bits) need
/// more memory than the machine has available, before anything is allocated.
pub fn check_memory(what: &str, bytes: Option<u64>, fix: &str) -> Result<()> {
    let available = crate::topology::linux::mem_available();
    match (bytes, available) {
        (Some(b), Some(a)) if b <= a => Ok(()),
        (Some(_), None) => Ok(()),
        (b, a) => Err(Error::BadInput {
            what: "benchmark size",
            subject: what.to_owned(),
            reason: format!(
                "needs {} of memory{}",
                b.map_or_else(
                    || "more than 2^64 bytes".to_owned(),
                    crate::util::human_bytes
                ),
                a.map_or_else(String::new, |a| format!(
                    ", and {} is available",
                    crate::util::human_bytes(a)
                ))
            ),
            fix: Some(fix.to_owned()),
        }),
    }
}

/// A benchmark report in JSON, tagged by the benchmark (`"bench": "adam"`): what `megatrain bench
/// adam|nvme|link|kernels|collective --json` prints and `megatrain plan --calibration` reads back, by type.
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
    /// `bench collective` (ranks of a `--features mpi` build under their launcher).
    Collective(collective::CollectiveReport),
}

impl Report {
    /// The report as its text table.
    pub fn render(&self) -> String {
        match self {
            Report::Adam(r) => adam::render(r),
            Report::Nvme(r) => nvme::render(r),
            Report::Link(r) => link::render(r),
            Report::Kernels(r) => kernel_report::render(r),
            Report::Collective(r) => collective::render(r),
        }
    }
}
