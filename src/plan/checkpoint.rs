//! What a checkpoint written beside a step costs the run: its bytes at the disk's rate against
//! the window before the next step's first update.

use super::{Hardware, PlanRequest, TimePlan};
use crate::model::config::ModelConfig;
use serde::Serialize;

/// A checkpoint written beside the next step (`--checkpoint-every`): what it costs the run.
/// Units are written first to last and updated last to first, so the next step's first
/// update (the last unit's, after the last micro-batch's backward of the head) waits for the
/// whole write: what does not fit before it is added to that step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct CheckpointPlan {
    /// Tensor bytes (fp32 params, Adam m and v as held).
    pub bytes: u64,
    /// The checkpoint disk's write rate (GB/s).
    pub disk_gbps: f64,
    /// Whether that rate is assumed (no NVMe rate given).
    pub disk_assumed: bool,
    /// Seconds to write it.
    pub write_s: f64,
    /// Seconds from the step's start to its first update.
    pub window_s: f64,
    /// Seconds a checkpoint adds to the step it is written beside.
    pub stall_s: f64,
    /// The fraction of the write hidden behind the step.
    pub hidden: f64,
}

/// The write rate assumed for the checkpoint disk when none is given: one PCIe 4 NVMe drive.
pub const ASSUMED_CHECKPOINT_GBPS: f64 = 3.0;

/// The checkpoint of `model` under `req` beside a step predicted as `time`.
pub fn checkpoint(
    model: &ModelConfig,
    hw: &Hardware,
    req: &PlanRequest,
    time: &TimePlan,
) -> CheckpointPlan {
    let bytes = req.layout(model).checkpoint_bytes();
    let disk_gbps = hw.nvme_gbps.unwrap_or(ASSUMED_CHECKPOINT_GBPS);
    let write_s = bytes as f64 / (disk_gbps * 1e9);
    // The last micro-batch's backward (≈ 2/3 of its share of the step) comes after the
    // first update's wait.
    let micro = req.micro_batches().max(1) as f64;
    let window_s = time.step_s * (1.0 - 2.0 / (3.0 * micro));
    CheckpointPlan {
        bytes,
        disk_gbps,
        disk_assumed: hw.nvme_gbps.is_none(),
        write_s,
        window_s,
        stall_s: (write_s - window_s).max(0.0),
        hidden: if write_s > 0.0 {
            (window_s / write_s).min(1.0)
        } else {
            1.0
        },
    }
}
