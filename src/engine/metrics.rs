//! What one step did: the figures the streamer reports per step, from the device's records of
//! its streams, the AdamW jobs' intervals and the spill tier's counters.

use crate::device::{Batch, OpRecord, StreamKind};
use crate::model::ops::ExpertLoad;
use serde::Serialize;

/// What one step did.
#[derive(Debug, Clone, Default, Serialize)]
pub struct StepMetrics {
    /// 1-based optimizer step.
    pub step: u64,
    /// Mean loss over the step's trained tokens (all its micro-batches together).
    pub loss: f64,
    /// Global gradient norm before clipping (lean mode: from the AdamW pass).
    pub grad_norm: f64,
    /// Clip coefficient applied (1 = none).
    pub clip_coef: f64,
    /// Learning rate used.
    pub lr: f64,
    /// Tokens processed (padding included).
    pub tokens: u64,
    /// Tokens whose target trained (the loss's denominator).
    pub trained_tokens: u64,
    /// Wall time of `step`, seconds.
    pub wall_s: f64,
    /// Σ compute-stream op time, seconds.
    pub compute_s: f64,
    /// Σ host→device copy time, seconds.
    pub htod_s: f64,
    /// Σ device→host copy time, seconds.
    pub dtoh_s: f64,
    /// Time the AdamW pools were busy with jobs that completed during this step (the union of the
    /// jobs' submit→done intervals: jobs queue on the same workers), seconds.
    pub optimizer_s: f64,
    /// Time the host thread spent blocked on the device or on AdamW, seconds.
    pub host_wait_s: f64,
    /// Bytes host→device.
    pub htod_bytes: u64,
    /// Bytes device→host.
    pub dtoh_bytes: u64,
    /// ZeRO stage 3 with the devices gathering: Σ time of the broadcasts between the ranks'
    /// GPUs (NCCL, on the weight stream), seconds; not in `htod_s`.
    pub broadcast_s: f64,
    /// Bytes those broadcasts delivered to this rank's GPU (not in `htod_bytes`).
    pub broadcast_bytes: u64,
    /// Device memory high-water mark, bytes.
    pub device_peak_bytes: u64,
    /// Bytes read from the NVMe spill tier during the step.
    pub nvme_read_bytes: u64,
    /// Bytes written to the NVMe spill tier during the step.
    pub nvme_write_bytes: u64,
    /// Time AdamW jobs waited for spilled state to arrive from NVMe, seconds.
    pub nvme_wait_s: f64,
    /// Time the NVMe I/O thread was busy during the step, seconds.
    pub nvme_busy_s: f64,
    /// A mixture of experts' load-balancing loss (transformers' `aux_loss`, before its
    /// coefficient), the mean over the step's micro-batches; `loss` includes
    /// `router_aux_loss_coef ·` it when the config trains it (`output_router_logits`).
    pub aux_loss: Option<f64>,
    /// Each MoE layer's routing over the step.
    pub expert_load: Vec<LayerLoad>,
}

/// How evenly one MoE layer spread the step's tokens over its experts.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct LayerLoad {
    /// Decoder layer.
    pub layer: usize,
    /// The most-loaded expert's tokens over the mean: 1 is balanced, E/k a collapse onto k
    /// experts.
    pub max_over_mean: f64,
    /// Experts no token chose.
    pub unused: usize,
}

/// The routing of a step's micro-batches.
#[derive(Debug, Clone, Default)]
pub struct StepRouting {
    /// The mean load-balancing loss (None without MoE layers).
    pub aux_loss: Option<f64>,
    /// Per MoE layer, over every micro-batch.
    pub layers: Vec<LayerLoad>,
}

impl StepRouting {
    /// From the micro-batches' tallies.
    pub fn of(batches: &[Batch]) -> StepRouting {
        let mut per_layer = std::collections::BTreeMap::<usize, ExpertLoad>::new();
        let mut aux = Vec::new();
        for b in batches {
            let t = crate::util::lock(&b.router);
            if t.layers.is_empty() {
                continue;
            }
            aux.push(t.aux_loss());
            for (&l, load) in &t.layers {
                per_layer.entry(l).or_default().add(load);
            }
        }
        StepRouting {
            aux_loss: (!aux.is_empty()).then(|| aux.iter().sum::<f64>() / aux.len() as f64),
            layers: per_layer
                .into_iter()
                .map(|(layer, l)| LayerLoad {
                    layer,
                    max_over_mean: l.max_over_mean(),
                    unused: l.unused(),
                })
                .collect(),
        }
    }

    /// What the trained load-balancing loss adds to the step's loss: Σ over micro-batches of
    /// its scale times its aux loss.
    pub fn trained_aux(batches: &[Batch]) -> f64 {
        batches
            .iter()
            .filter(|b| b.aux_scale > 0.0)
            .map(|b| b.aux_scale * crate::util::lock(&b.router).aux_loss())
            .sum()
    }
}

impl StepMetrics {
    /// Add the device's records of a step: Σ time and bytes per stream.
    pub fn add_device_records(&mut self, records: &[OpRecord]) {
        for r in records {
            let d = r.end - r.start;
            match r.stream {
                StreamKind::Compute => self.compute_s += d,
                StreamKind::CopyIn if r.name.starts_with(crate::device::BROADCAST_RECORD) => {
                    self.broadcast_s += d;
                    self.broadcast_bytes += r.bytes;
                }
                StreamKind::CopyIn => {
                    self.htod_s += d;
                    self.htod_bytes += r.bytes;
                }
                StreamKind::CopyOut => {
                    self.dtoh_s += d;
                    self.dtoh_bytes += r.bytes;
                }
            }
        }
    }
}

/// Total length covered by a set of intervals.
pub fn union_length(mut v: Vec<(f64, f64)>) -> f64 {
    v.sort_by(|a, b| a.0.total_cmp(&b.0));
    let mut total = 0.0;
    let mut cur: Option<(f64, f64)> = None;
    for (a, b) in v {
        cur = match cur {
            Some((s, e)) if a <= e => Some((s, e.max(b))),
            Some((s, e)) => {
                total += e - s;
                Some((a, b))
            }
            None => Some((a, b)),
        };
    }
    total + cur.map_or(0.0, |(s, e)| e - s)
}
