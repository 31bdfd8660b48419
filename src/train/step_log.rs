//! What a step logs: its metrics line (`--metrics`, JSON Lines) and its TensorBoard scalars
//! (`--tensorboard`), from one record, with the model FLOP rate and MFU both carry.

use super::config::TrainConfig;
use super::setup::Session;
use super::Progress;
use crate::device::Precision;
use crate::engine::StepMetrics;
use crate::model::config::ModelConfig;

/// What a step's model FLOP rate is measured against.
#[derive(Debug, Clone, Copy)]
pub(super) struct FlopRate {
    /// Model FLOPs per token: 6 × the parameters a token computes with (forward 2, backward 4;
    /// a mixture of experts' active part), as the planner and most MFU reports count them.
    flops_per_token: f64,
    /// The device's datasheet peak in the run's precision, FLOP/s, where the device is a GPU we
    /// know ([`crate::plan::presets::datasheet_peak`]); none on the CPU device.
    peak_flops: Option<f64>,
}

impl FlopRate {
    /// For `model` trained as `cfg` says on the device named `device_name`.
    pub(super) fn of(model: &ModelConfig, cfg: &TrainConfig, device_name: &str) -> Self {
        // The CUDA emulator names the GPU it presents ("NVIDIA H100 80GB HBM3 (cuemu)"): its
        // timings are no GPU's, so it has no MFU.
        let emulated = device_name.contains("(cuemu)");
        let known = crate::plan::presets::datasheet_peak(device_name).filter(|_| !emulated);
        let peak = known.map(|p| match (cfg.resolved_precision(), cfg.tf32) {
            (Precision::Bf16, _) => p.bf16,
            (Precision::Fp32, true) => p.tf32,
            (Precision::Fp32, false) => p.fp32,
        });
        FlopRate {
            flops_per_token: 6.0 * model.active_params() as f64,
            peak_flops: peak.map(|t| t * 1e12),
        }
    }

    /// Model TFLOP/s of a step of `tokens` in `wall_s`, and its fraction of the peak.
    fn of_step(&self, tokens: u64, wall_s: f64) -> (f64, Option<f64>) {
        let flops = self.flops_per_token * tokens as f64 / wall_s.max(1e-12);
        (flops / 1e12, self.peak_flops.map(|p| flops / p))
    }
}

/// Log step `m` (validated at `val`) to the run's metrics file and TensorBoard directory.
pub(super) fn log_step(
    s: &mut Session,
    m: &StepMetrics,
    val: Option<f64>,
    progress: &mut dyn Progress,
) {
    let (tflops, mfu) = s.flop_rate.of_step(m.tokens, m.wall_s);
    let tokens_per_s = m.tokens as f64 / m.wall_s;
    let trained_tokens_per_s = m.trained_tokens as f64 / m.wall_s;
    let transfer_s = m.htod_s + m.dtoh_s;
    if let Some(log) = s.metrics.as_mut() {
        let mut line = serde_json::json!({
            "step": m.step, "loss": m.loss, "grad_norm": m.grad_norm, "lr": m.lr,
            "tokens": m.tokens, "trained_tokens": m.trained_tokens,
            "tokens_per_s": tokens_per_s, "trained_tokens_per_s": trained_tokens_per_s,
            "model_tflops": tflops, "mfu": mfu, "device_peak_bytes": m.device_peak_bytes,
            "compute_s": m.compute_s, "transfer_s": transfer_s, "optimizer_s": m.optimizer_s,
            "io_wait_s": m.host_wait_s, "wall_s": m.wall_s, "clip_coef": m.clip_coef,
            "htod_bytes": m.htod_bytes, "dtoh_bytes": m.dtoh_bytes, "val_loss": val,
        });
        if m.broadcast_bytes > 0 {
            line["broadcast_bytes"] = m.broadcast_bytes.into();
            line["broadcast_s"] = m.broadcast_s.into();
        }
        if let Some(aux) = m.aux_loss {
            line["aux_loss"] = aux.into();
            line["expert_load"] = serde_json::json!(m.expert_load);
        }
        if let Some(w) = log.append(m.step, m.loss, val, &line) {
            progress.note(&w);
        }
    }
    if let Some(tb) = s.tensorboard.as_mut() {
        // Each MoE layer's routing: the busiest expert over the mean, and idle experts.
        let routing: Vec<(String, f64)> = m
            .expert_load
            .iter()
            .flat_map(|l| {
                [
                    (
                        format!("experts/layer{}_max_over_mean", l.layer),
                        l.max_over_mean,
                    ),
                    (format!("experts/layer{}_unused", l.layer), l.unused as f64),
                ]
            })
            .collect();
        let mut scalars = vec![
            ("train/loss", m.loss),
            ("train/grad_norm", m.grad_norm),
            ("train/learning_rate", m.lr),
            ("train/clip_coef", m.clip_coef),
            ("throughput/tokens_per_s", tokens_per_s),
            ("throughput/trained_tokens_per_s", trained_tokens_per_s),
            ("throughput/model_tflops", tflops),
            ("time/step_s", m.wall_s),
            ("time/compute_s", m.compute_s),
            ("time/transfer_s", transfer_s),
            ("time/optimizer_s", m.optimizer_s),
            ("time/io_wait_s", m.host_wait_s),
            (
                "memory/device_peak_gib",
                m.device_peak_bytes as f64 / (1u64 << 30) as f64,
            ),
        ];
        if let Some(v) = val {
            scalars.push(("eval/loss", v));
        }
        if let Some(a) = m.aux_loss {
            scalars.push(("train/aux_loss", a));
        }
        if let Some(u) = mfu {
            scalars.push(("throughput/mfu", u));
        }
        scalars.extend(routing.iter().map(|(tag, v)| (tag.as_str(), *v)));
        if let Some(w) = tb.append(m.step, &scalars) {
            progress.note(&w);
        }
    }
}
