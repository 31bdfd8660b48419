//! The training configuration: a TOML file and command-line flags with the same names (flags
//! win). Unknown keys are errors.

use crate::store::layout::Mode;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Learning-rate schedule.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum LrSchedule {
    /// Constant after warm-up.
    Constant,
    /// Cosine decay to 0 after warm-up.
    Cosine,
    /// Linear decay to 0 after warm-up.
    Linear,
}

/// Token file element type.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DataDtype {
    /// Little-endian u16.
    U16,
    /// Little-endian u32.
    U32,
}

/// Compute device.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum DeviceKind {
    /// The CPU device.
    Cpu,
    /// A CUDA GPU.
    Cuda,
}

/// Streaming precision.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Precision {
    /// fp32 weights streamed.
    Fp32,
    /// bf16 shadow streamed.
    Bf16,
}

/// Where layer-boundary activations (the recompute checkpoints) live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Activations {
    /// All L+1 on the device: no copies, device memory grows with depth.
    Device,
    /// Offloaded to host memory: two device slots whatever the depth.
    Host,
}

/// Every setting of a training run.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TrainConfig {
    /// HF checkpoint directory to start from.
    pub init_from: Option<PathBuf>,
    /// HF config.json for a random init.
    pub model: Option<PathBuf>,
    /// Training tokens.
    pub data: Option<PathBuf>,
    /// Token file element type.
    pub data_dtype: DataDtype,
    /// Validation tokens.
    pub val_data: Option<PathBuf>,
    /// Tokens per sequence.
    pub seq_len: usize,
    /// Sequences per micro-batch.
    pub batch_size: usize,
    /// Micro-batches per optimizer step.
    pub grad_accum: usize,
    /// Optimizer steps.
    pub steps: u64,
    /// Peak learning rate.
    pub lr: f64,
    /// AdamW β1.
    pub beta1: f64,
    /// AdamW β2.
    pub beta2: f64,
    /// AdamW ε.
    pub eps: f64,
    /// Decoupled weight decay.
    pub weight_decay: f64,
    /// Decay 1-D tensors (norm weights, biases) too.
    pub decay_norms: bool,
    /// Global-norm clipping threshold (0 disables).
    pub grad_clip: f64,
    /// Learning-rate schedule.
    pub lr_schedule: LrSchedule,
    /// Linear warm-up steps.
    pub warmup_steps: u64,
    /// Seed of the random init and the shuffle.
    pub seed: u64,
    /// Shuffle rows (a seeded permutation per epoch).
    pub shuffle: bool,
    /// Metrics JSONL file.
    pub metrics: Option<PathBuf>,
    /// Checkpoint directory.
    pub checkpoint_dir: Option<PathBuf>,
    /// Checkpoint every N steps (0: only at the end).
    pub checkpoint_every: u64,
    /// Checkpoints kept.
    pub keep_checkpoints: usize,
    /// Resume from the newest checkpoint in `checkpoint_dir`.
    pub resume: bool,
    /// Export the final model as an HF checkpoint here.
    pub export_hf: Option<PathBuf>,
    /// Compute device.
    pub device: DeviceKind,
    /// Device memory budget (bytes) of the CPU device (the CUDA device uses the GPU's free
    /// memory).
    pub device_memory: u64,
    /// CUDA: let cuBLAS use TF32 tensor cores for the fp32 GEMMs (faster, ~1e-3 relative error
    /// per GEMM instead of fp32's ~1e-6).
    pub tf32: bool,
    /// Pages backing the host store: transparent, or reserved hugetlbfs pages (2m, 1g).
    pub huge_pages: crate::host::PageKind,
    /// mlock the host store (needs a memlock limit ≥ the store, or CAP_IPC_LOCK).
    pub lock_memory: bool,
    /// Directories for the NVMe spill tier (one per device).
    pub nvme: Vec<PathBuf>,
    /// When Adam m/v go to NVMe: never, auto (only as many units as the RAM budget needs; the
    /// default, and only with `nvme` set), all.
    pub spill: crate::store::placement::SpillPolicy,
    /// RAM staging slots of the spill tier (each one unit's m+v; 3 overlaps read, update and
    /// write-back).
    pub spill_staging: usize,
    /// Spill I/O engine: auto (io_uring, else pread/pwrite threads), uring, sync.
    pub io_engine: crate::spill::io::EngineKind,
    /// O_DIRECT for the spill files (off: buffered I/O).
    pub direct_io: bool,
    /// Cap on the host RAM the state may use, bytes (default: 90% of free memory).
    pub ram_budget: Option<u64>,
    /// Where activation checkpoints live; unset: on the device when they fit its memory beside
    /// the working set, else offloaded to host.
    pub activations: Option<Activations>,
    /// Streaming precision.
    pub precision: Precision,
    /// Exact or lean; unset: exact if the exact state fits the RAM budget, else lean if that
    /// fits (and there is no gradient accumulation), else exact with m/v spilled.
    pub mode: Option<Mode>,
    /// Chrome trace of every step.
    pub trace: Option<PathBuf>,
    /// Validate every N steps (0: only at the end).
    pub val_every: u64,
    /// Sequences used per validation.
    pub val_batches: usize,
}

impl Default for TrainConfig {
    fn default() -> Self {
        TrainConfig {
            init_from: None,
            model: None,
            data: None,
            data_dtype: DataDtype::U16,
            val_data: None,
            seq_len: 128,
            batch_size: 8,
            grad_accum: 1,
            steps: 100,
            lr: 3e-4,
            beta1: 0.9,
            beta2: 0.999,
            eps: 1e-8,
            weight_decay: 0.01,
            decay_norms: true,
            grad_clip: 1.0,
            lr_schedule: LrSchedule::Constant,
            warmup_steps: 0,
            seed: 0,
            shuffle: false,
            metrics: None,
            checkpoint_dir: None,
            checkpoint_every: 0,
            keep_checkpoints: 3,
            resume: false,
            export_hf: None,
            device: DeviceKind::Cpu,
            device_memory: 2 << 30,
            tf32: false,
            huge_pages: crate::host::PageKind::Transparent,
            lock_memory: false,
            nvme: Vec::new(),
            spill: crate::store::placement::SpillPolicy::Auto,
            spill_staging: 3,
            io_engine: crate::spill::io::EngineKind::Auto,
            direct_io: true,
            ram_budget: None,
            activations: None,
            precision: Precision::Fp32,
            mode: None,
            trace: None,
            val_every: 0,
            val_batches: 8,
        }
    }
}

impl TrainConfig {
    /// Read a TOML file (unknown keys are errors).
    pub fn from_toml_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io("read config", path, e))?;
        toml::from_str(&text).map_err(|e| {
            Error::bad_input(
                "config file",
                path.display().to_string(),
                e.message().to_owned(),
                Some("keys are the flag names with `_` for `-` (see `megatrain train --help`)"),
            )
        })
    }

    /// Learning rate at 1-based step `t`.
    pub fn lr_at(&self, t: u64) -> f64 {
        let t = t.max(1);
        if t <= self.warmup_steps {
            return self.lr * t as f64 / self.warmup_steps as f64;
        }
        let span = self.steps.saturating_sub(self.warmup_steps).max(1) as f64;
        let progress = ((t - self.warmup_steps) as f64 / span).min(1.0);
        match self.lr_schedule {
            LrSchedule::Constant => self.lr,
            LrSchedule::Cosine => self.lr * 0.5 * (1.0 + (std::f64::consts::PI * progress).cos()),
            LrSchedule::Linear => self.lr * (1.0 - progress),
        }
    }

    /// Check values that are wrong whatever the data.
    pub fn validate(&self) -> Result<()> {
        let bad =
            |k: &str, why: &str, fix: &str| Err(Error::bad_input("setting", k, why, Some(fix)));
        if self.seq_len == 0 || self.batch_size == 0 || self.grad_accum == 0 {
            return bad(
                "seq_len/batch_size/grad_accum",
                "must be positive",
                "set them ≥ 1",
            );
        }
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad("lr", "must be a positive number", "e.g. --lr 3e-4");
        }
        if !(0.0..1.0).contains(&self.beta1) || !(0.0..1.0).contains(&self.beta2) {
            return bad(
                "beta1/beta2",
                "must be in [0, 1)",
                "e.g. --beta1 0.9 --beta2 0.95",
            );
        }
        if self.init_from.is_some() && self.model.is_some() {
            return bad(
                "init_from/model",
                "give one: a checkpoint to start from or a config for a random init",
                "drop one of them",
            );
        }
        if self.spill == crate::store::placement::SpillPolicy::All && self.nvme.is_empty() {
            return bad(
                "spill",
                "`all` needs a spill directory",
                "pass --nvme DIR (one per NVMe device)",
            );
        }
        if self.spill_staging == 0 {
            return bad("spill_staging", "must be ≥ 1", "e.g. --spill-staging 3");
        }
        if self.device == DeviceKind::Cuda && !cfg!(feature = "cuda") {
            return Err(Error::bad_input(
                "device",
                "cuda",
                "this megatrain was built without CUDA support",
                Some("rebuild with `cargo build --release --features cuda` (README: Building with CUDA)"),
            ));
        }
        if self.tf32 && self.device != DeviceKind::Cuda {
            return bad(
                "tf32",
                "TF32 tensor cores exist only on the CUDA device",
                "drop --tf32 or pass --device cuda",
            );
        }
        if self.precision == Precision::Bf16 {
            return Err(Error::bad_input(
                "precision",
                "bf16",
                "bf16 streaming is not implemented: the device program runs fp32 (the bf16 CUDA kernels exist and are self-tested, but no device streams bf16 weights yet)",
                Some("use --precision fp32"),
            ));
        }
        if self.mode == Some(Mode::Lean) && self.grad_accum > 1 {
            return Err(Error::bad_input(
                "--grad-accum",
                self.grad_accum.to_string(),
                "lean mode consumes each unit's gradients as they land, so it cannot accumulate micro-batches",
                Some("use --mode exact for gradient accumulation"),
            ));
        }
        if self.resume && self.checkpoint_dir.is_none() {
            return bad(
                "resume",
                "needs a checkpoint directory",
                "add --checkpoint-dir DIR",
            );
        }
        Ok(())
    }

    /// The configuration as a two-column table.
    pub fn table(&self) -> String {
        let v = serde_json::to_value(self).unwrap_or_default();
        let mut s = String::from("resolved configuration\n");
        if let Some(obj) = v.as_object() {
            for (k, val) in obj {
                let shown = match val {
                    serde_json::Value::Null => "-".to_owned(),
                    serde_json::Value::String(x) => x.clone(),
                    other => other.to_string(),
                };
                s += &format!("  {k:<18} {shown}\n");
            }
        }
        s
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn unknown_keys_are_errors_and_schedules_work() {
        let e = toml::from_str::<TrainConfig>("lr = 1e-3\nlearning_rate = 2").unwrap_err();
        assert!(e.to_string().contains("learning_rate"), "{e}");
        let c: TrainConfig =
            toml::from_str("lr = 1.0\nsteps = 10\nwarmup_steps = 2\nlr_schedule = \"cosine\"")
                .unwrap();
        assert_eq!(c.lr_at(1), 0.5);
        assert_eq!(c.lr_at(2), 1.0);
        assert!((c.lr_at(10) - 0.0).abs() < 1e-12);
        let l = TrainConfig {
            lr_schedule: LrSchedule::Linear,
            steps: 4,
            ..c
        };
        assert!((l.lr_at(3) - 0.5).abs() < 1e-12);
        assert!(TrainConfig {
            device: DeviceKind::Cuda,
            ..Default::default()
        }
        .validate()
        .is_err());
    }
}
