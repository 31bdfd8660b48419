//! The training configuration: a TOML file and command-line flags with the same names (flags
//! win). Unknown keys are errors.

use crate::store::layout::{AdamState, Mode};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::path::{Path, PathBuf};

/// Bounds on the counts a run may ask for. Within them every size derived from the
/// configuration fits in 64 bits, and what the trainer builds per step (the step schedule, the
/// micro-batches' token lists) stays bounded.
pub mod limits {
    /// Longest sequence.
    pub const MAX_SEQ_LEN: usize = 1 << 24;
    /// Most tokens in one micro-batch (batch_size × seq_len).
    pub const MAX_MICRO_BATCH_TOKENS: usize = 1 << 26;
    /// Most micro-batches per step (the step schedule holds O(grad_accum × layers) tasks).
    pub const MAX_GRAD_ACCUM: usize = 4096;
    /// Most tokens per optimizer step (grad_accum × batch_size × seq_len).
    pub const MAX_STEP_TOKENS: usize = 1 << 28;
    /// Most optimizer steps.
    pub const MAX_STEPS: u64 = 1 << 40;
    /// Most validation micro-batches.
    pub const MAX_VAL_BATCHES: usize = 1 << 16;
    /// Most staging slots of the spill tier.
    pub const MAX_SPILL_STAGING: usize = 64;
}

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

/// How documents of a document file fill the rows of `seq_len` tokens.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Packing {
    /// Greedily, in order, several per row; they never attend to each other.
    #[default]
    On,
    /// One document per row, the rest padding.
    Off,
}

/// What happens to a document longer than a row.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum Overlong {
    /// Keep its first `seq_len` tokens (dropped if none of them is trained).
    #[default]
    Truncate,
    /// Leave it out.
    Drop,
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

pub use crate::device::{GradLink, Precision};

/// How the GPUs of a job with sharded params (`--zero-stage 3`) get a unit's params from the
/// rank holding them.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum ParamGather {
    /// NCCL where every rank has a GPU of its own and every rank finds NCCL, else host.
    #[default]
    Auto,
    /// The owner copies the unit to its GPU, which broadcasts it to the others' over NCCL:
    /// each rank copies only its own units across its link. Needs a GPU per rank.
    Nccl,
    /// Every rank takes the unit into host memory over MPI and copies it to its GPU.
    Host,
}

/// Whether a run continues from the newest checkpoint in its checkpoint directory.
///
/// In TOML: `resume = true` (always), `resume = false` (never, the default) or
/// `resume = "auto"`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Resume {
    /// A fresh run: the checkpoint directory must hold no checkpoints.
    #[default]
    Never,
    /// Continue from the newest checkpoint; an error when there is none.
    Always,
    /// Continue when there is a checkpoint, else start fresh (preemptible jobs).
    Auto,
}

impl Serialize for Resume {
    fn serialize<S: serde::Serializer>(&self, s: S) -> std::result::Result<S::Ok, S::Error> {
        match self {
            Resume::Never => s.serialize_bool(false),
            Resume::Always => s.serialize_bool(true),
            Resume::Auto => s.serialize_str("auto"),
        }
    }
}

impl<'de> Deserialize<'de> for Resume {
    fn deserialize<D: serde::Deserializer<'de>>(d: D) -> std::result::Result<Self, D::Error> {
        #[derive(Deserialize)]
        #[serde(untagged)]
        enum Spelling {
            Flag(bool),
            Word(String),
        }
        match Spelling::deserialize(d)? {
            Spelling::Flag(true) => Ok(Resume::Always),
            Spelling::Flag(false) => Ok(Resume::Never),
            Spelling::Word(w) => match w.as_str() {
                "auto" => Ok(Resume::Auto),
                "always" => Ok(Resume::Always),
                "never" => Ok(Resume::Never),
                other => Err(serde::de::Error::custom(format!(
                    "resume `{other}`: expected true, false or \"auto\""
                ))),
            },
        }
    }
}

pub use crate::engine::{ActivationDtype, Activations};

/// Declares every training setting once: [`TrainConfig`] (the resolved configuration, recorded
/// in checkpoints), its defaults, and [`TrainOverrides`] — the same settings, each optional, read
/// from a TOML file or from `megatrain train`'s flags (clap `flatten`) — with
/// [`TrainConfig::apply`] laying them over a configuration. A setting added here is a TOML key
/// and a flag at once; none can be forgotten.
///
/// Per setting: doc, `kind name: Type = default => FlagType [clap attributes]`, where the kind
/// says how a given flag applies: `value` replaces, `some` sets an optional setting, `list`
/// replaces a non-empty list.
macro_rules! settings {
    ($(
        $(#[doc = $doc:literal])*
        $kind:ident $field:ident : $ty:ty = $default:expr => $flag:ty [$($arg:tt)*];
    )*) => {
        /// Every setting of a training run.
        #[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
        #[serde(deny_unknown_fields, default)]
        pub struct TrainConfig {
            $( $(#[doc = $doc])* pub $field: $ty, )*
        }

        impl Default for TrainConfig {
            fn default() -> Self {
                TrainConfig { $( $field: $default, )* }
            }
        }

        /// The settings a TOML file or the command line gives: each optional, laid over a
        /// [`TrainConfig`] by [`TrainConfig::apply`]. Unknown TOML keys are errors.
        #[derive(Debug, Clone, Default, PartialEq, Deserialize, clap::Args)]
        #[serde(deny_unknown_fields, default)]
        pub struct TrainOverrides {
            $( $(#[doc = $doc])* #[arg(long, $($arg)*)] pub $field: $flag, )*
        }

        /// A refused setting `key`: `why`, and the `fix` to apply.
fn bad_setting(key: &str, why: &str, fix: &str) -> Result<()> {
    Err(Error::bad_input("setting", key, why, Some(fix)))
}

impl TrainConfig {
            /// `o`'s given settings over these.
            #[must_use]
            pub fn apply(mut self, o: TrainOverrides) -> Self {
                $( settings!(@apply $kind, self.$field, o.$field); )*
                self
            }
        }
    };
    (@apply value, $s:expr, $f:expr) => { if let Some(v) = $f { $s = v.into(); } };
    (@apply some, $s:expr, $f:expr) => { if let Some(v) = $f { $s = Some(v.into()); } };
    (@apply list, $s:expr, $f:expr) => { if !$f.is_empty() { $s = $f; } };
}

use crate::host::PageKind;
use crate::spill::io::EngineKind;
use crate::store::hf::ExportDtype;
use crate::store::placement::SpillPolicy;
use crate::util::size::ByteSize;

settings! {
    /// HF checkpoint directory to start from.
    some init_from: Option<PathBuf> = None => Option<PathBuf> [value_name = "DIR"];
    /// HF config.json for a random init.
    some model: Option<PathBuf> = None => Option<PathBuf> [value_name = "CONFIG.json"];
    /// Training tokens.
    some data: Option<PathBuf> = None => Option<PathBuf> [value_name = "FILE"];
    /// Token file element type.
    value data_dtype: DataDtype = DataDtype::U16 => Option<DataDtype> [value_enum];
    /// Validation tokens.
    some val_data: Option<PathBuf> = None => Option<PathBuf> [value_name = "FILE"];
    /// Document files (`prepare --format prompt-completion|chat`): several documents per row
    /// (on) or one (off); they never attend to each other.
    value packing: Packing = Packing::On => Option<Packing> [value_enum];
    /// Document files: a document longer than `seq_len` is truncated or dropped (counted).
    value overlong: Overlong = Overlong::Truncate => Option<Overlong> [value_enum];
    /// Tokens per sequence.
    value seq_len: usize = 128 => Option<usize> [];
    /// Sequences per micro-batch.
    value batch_size: usize = 8 => Option<usize> [];
    /// Micro-batches per optimizer step.
    value grad_accum: usize = 1 => Option<usize> [];
    /// Optimizer steps.
    value steps: u64 = 100 => Option<u64> [];
    /// Peak learning rate.
    value lr: f64 = 3e-4 => Option<f64> [allow_negative_numbers = true];
    /// AdamW β1.
    value beta1: f64 = 0.9 => Option<f64> [allow_negative_numbers = true];
    /// AdamW β2.
    value beta2: f64 = 0.999 => Option<f64> [allow_negative_numbers = true];
    /// AdamW ε.
    value eps: f64 = 1e-8 => Option<f64> [allow_negative_numbers = true];
    /// Decoupled weight decay.
    value weight_decay: f64 = 0.01 => Option<f64> [allow_negative_numbers = true];
    /// Decay 1-D tensors (norm weights, biases) too.
    value decay_norms: bool = true => Option<bool> [num_args = 0..=1, default_missing_value = "true"];
    /// Global-norm clipping threshold (0 disables).
    value grad_clip: f64 = 1.0 => Option<f64> [allow_negative_numbers = true];
    /// Learning-rate schedule.
    value lr_schedule: LrSchedule = LrSchedule::Constant => Option<LrSchedule> [value_enum];
    /// Linear warm-up steps.
    value warmup_steps: u64 = 0 => Option<u64> [];
    /// Seed of the random init and the shuffle.
    value seed: u64 = 0 => Option<u64> [];
    /// Shuffle rows (a seeded permutation per epoch).
    value shuffle: bool = false => Option<bool> [num_args = 0..=1, default_missing_value = "true"];
    /// Metrics JSONL file (a loss curve SVG is written beside it).
    some metrics: Option<PathBuf> = None => Option<PathBuf> [value_name = "FILE.jsonl"];
    /// TensorBoard directory: an event file per run start (scalars per step, the configuration
    /// as text); `tensorboard --logdir DIR` shows it. A resumed run replaces the steps logged
    /// after its checkpoint.
    some tensorboard: Option<PathBuf> = None => Option<PathBuf> [value_name = "DIR"];
    /// Checkpoint directory (the run holds it locked).
    some checkpoint_dir: Option<PathBuf> = None => Option<PathBuf> [value_name = "DIR"];
    /// Checkpoint every N steps (0: only at the end).
    value checkpoint_every: u64 = 0 => Option<u64> [];
    /// Checkpoints of this run kept.
    value keep_checkpoints: usize = 3 => Option<usize> [];
    /// Continue from the newest checkpoint in `checkpoint_dir`: never, always (an error when
    /// there is none; what `--resume` alone means), auto (when there is one).
    value resume: Resume = Resume::Never => Option<Resume> [value_enum, num_args = 0..=1, default_missing_value = "always", value_name = "WHEN"];
    /// Export the final model as an HF checkpoint here.
    some export_hf: Option<PathBuf> = None => Option<PathBuf> [value_name = "DIR"];
    /// The export's tensors: fp32 (the master as is) or bf16 (rounded to nearest-even; half the
    /// bytes). Default: fp32 up to 1B parameters, bf16 above (checkpoints keep the fp32 master
    /// either way).
    some export_dtype: Option<ExportDtype> = None => Option<ExportDtype> [value_enum];
    /// Compute device.
    value device: DeviceKind = DeviceKind::Cpu => Option<DeviceKind> [value_enum];
    /// Device memory budget of the CPU device, bytes or a size with a unit (e.g. 64MiB; the
    /// CUDA device uses the GPU's free memory).
    value device_memory: u64 = 2 << 30 => Option<ByteSize> [value_name = "SIZE"];
    /// CUDA: let cuBLAS use TF32 tensor cores for the fp32 GEMMs (faster, ~1e-3 relative error
    /// per GEMM instead of fp32's ~1e-6).
    value tf32: bool = false => Option<bool> [num_args = 0..=1, default_missing_value = "true"];
    /// Pages backing the host store: transparent, or reserved hugetlbfs pages (2m, 1g).
    value huge_pages: PageKind = PageKind::Transparent => Option<PageKind> [value_enum];
    /// mlock the host store (needs a memlock limit ≥ the store, or CAP_IPC_LOCK).
    value lock_memory: bool = false => Option<bool> [num_args = 0..=1, default_missing_value = "true"];
    /// Directories for the NVMe spill tier (repeat the flag, one per device).
    list nvme: Vec<PathBuf> = Vec::new() => Vec<PathBuf> [value_name = "DIR"];
    /// When Adam m/v go to NVMe: never, auto (only as many units as the RAM budget needs; the
    /// default, and only with `nvme` set), all.
    value spill: SpillPolicy = SpillPolicy::Auto => Option<SpillPolicy> [value_enum];
    /// RAM staging slots of the spill tier (each one unit's m+v; 3 overlaps read, update and
    /// write-back).
    value spill_staging: usize = 3 => Option<usize> [];
    /// Spill I/O engine: auto (io_uring, else pread/pwrite threads), uring, sync.
    value io_engine: EngineKind = EngineKind::Auto => Option<EngineKind> [];
    /// O_DIRECT for the spill files (false: buffered I/O).
    value direct_io: bool = true => Option<bool> [num_args = 0..=1, default_missing_value = "true"];
    /// Cap on the host RAM the state may use, bytes or a size with a unit (default: 90% of
    /// free memory).
    some ram_budget: Option<u64> = None => Option<ByteSize> [value_name = "SIZE"];
    /// Where the activations live: `keep` (every layer's internals on the device, no recompute),
    /// `device` (the layer inputs on the device) or `host` (offloaded); unset: the first that fits
    /// the device memory beside the working set (`keep` only when the layers run unchunked).
    some activations: Option<Activations> = None => Option<Activations> [value_enum];
    /// How the layer inputs the backward recomputes from are stored (device and host
    /// activations): fp32, or bf16 (half the device, link and host bytes; the backward of each
    /// block recomputes from the bf16 rounding of its input: docs/precision.md); unset: the
    /// resumed run's, else bf16 under --precision bf16 and fp32 under fp32 (which takes only
    /// fp32). `keep` stores no inputs.
    some activation_dtype: Option<ActivationDtype> = None => Option<ActivationDtype> [value_enum];
    /// What the device computes in: fp32, or bf16 (bf16 weights streamed from an exact fp32
    /// master, GEMMs on bf16 operands with fp32 sums, tensor-core attention, fp32 gradients;
    /// docs/precision.md); unset: bf16 on the CUDA device, fp32 on the CPU device.
    some precision: Option<Precision> = None => Option<Precision> [value_enum];
    /// How weight gradients cross to the host: fp32 (exact), or bf16 (half the device→host
    /// bytes: rounded to nearest even on the device, accumulated in fp32 on the host; with
    /// --precision bf16 only; `megatrain plan` says when the link makes it pay;
    /// docs/precision.md measures its accuracy).
    value grad_link: GradLink = GradLink::Fp32 => Option<GradLink> [value_enum];
    /// Exact or lean; unset: exact if the exact state fits the RAM budget, else lean if that
    /// fits (and there is no gradient accumulation), else exact with m/v spilled.
    some mode: Option<Mode> = None => Option<Mode> [value_enum];
    /// How Adam m and v are stored: fp32 (exactly torch.optim.AdamW, 8 B/param), bf16 (stochastic
    /// rounding, 4 B/param) or int8 (blockwise 8-bit, ≈ 2 B/param); unset: the resumed
    /// checkpoint's, else fp32. Resuming with another one converts the checkpoint's moments.
    some adam_state: Option<AdamState> = None => Option<AdamState> [value_enum];
    /// Chrome trace of every step.
    some trace: Option<PathBuf> = None => Option<PathBuf> [value_name = "FILE"];
    /// Validate every N steps (0: only at the end).
    value val_every: u64 = 0 => Option<u64> [];
    /// Sequences used per validation.
    value val_batches: usize = 8 => Option<usize> [];
    /// Print (and log to TensorBoard) a continuation of `sample_prompt` every N steps and at the
    /// end (0: never); each new token is a forward pass of a micro-batch (no KV cache).
    value sample_every: u64 = 0 => Option<u64> [];
    /// The text samples continue.
    some sample_prompt: Option<String> = None => Option<String> [value_name = "TEXT"];
    /// Tokens per sample.
    value sample_tokens: usize = 32 => Option<usize> [];
    /// Samples: 0 greedy, else drawn at this temperature.
    value sample_temperature: f64 = 0.0 => Option<f64> [];
    /// The tokenizer of samples and `megatrain generate` (`bytes`: one token per byte, the
    /// demo's); unset: the `init_from` directory's.
    some tokenizer: Option<PathBuf> = None => Option<PathBuf> [value_name = "DIR"];
    /// Data parallel: seconds a rank waits in one collective before it ends the job (a rank that
    /// hangs without dying; rank 0's validation, checkpoints and export make the others wait).
    value collective_timeout: u64 = 1800 => Option<u64> [value_name = "SECONDS"];
    /// Data parallel: 1 shards the Adam state across the ranks (ZeRO stage 1: each unit's
    /// moments live on one rank, which alone updates the unit and sends the others its params;
    /// the same bits as 0), 3 the params too (each rank takes a unit's params from its owner
    /// each time its device needs them; the same bits), 0 keeps all of it on every rank.
    /// Checkpoints of a sharded job are written while training waits.
    value zero_stage: u8 = 0 => Option<u8> [value_name = "0|1|3"];
    /// With --zero-stage 3 on GPUs: `nccl` has the unit's owner copy it to its GPU and NCCL
    /// broadcast it GPU to GPU (each rank copies only its own units across its link; a GPU per
    /// rank), `host` has every rank take it through host memory over MPI; `auto` takes NCCL
    /// where every rank has a GPU of its own and finds NCCL. The same bits either way.
    value param_gather: ParamGather = ParamGather::Auto => Option<ParamGather> [value_enum];
}

impl TrainConfig {
    /// Read a TOML file (unknown keys are errors) over the defaults.
    pub fn from_toml_file(path: &Path) -> Result<Self> {
        let text = std::fs::read_to_string(path).map_err(|e| Error::io("read config", path, e))?;
        Self::from_toml_str(&text, &path.display().to_string())
    }

    /// Parse TOML text over the defaults; `origin` names it in errors, which give the line and
    /// the key.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Self> {
        TrainOverrides::from_toml_str(text, origin).map(|o| TrainConfig::default().apply(o))
    }
}

impl TrainOverrides {
    /// Parse TOML text; `origin` names it in errors, which give the line and the key.
    pub fn from_toml_str(text: &str, origin: &str) -> Result<Self> {
        toml::from_str(text).map_err(|e| {
            let at = e.span().map(|span| {
                let start = span.start.min(text.len());
                let line_no = text[..start].matches('\n').count() + 1;
                let line_start = text[..start].rfind('\n').map_or(0, |i| i + 1);
                let line = text[line_start..].lines().next().unwrap_or("");
                let key = line
                    .split_once('=')
                    .map(|(k, _)| k.trim().trim_matches('"').to_owned())
                    .filter(|k| !k.is_empty() && !k.starts_with('['));
                match key {
                    Some(k) => format!("line {line_no}, key `{k}`: "),
                    None => format!("line {line_no}: "),
                }
            });
            Error::bad_input(
                "config file",
                origin,
                format!("{}{}", at.unwrap_or_default(), e.message()),
                Some("keys are the flag names with `_` for `-` (see `megatrain train --help`)"),
            )
        })
    }
}

impl TrainConfig {
    /// `precision`, or the device's default: bf16 on the CUDA device (tensor cores), fp32 on
    /// the CPU device (whose bf16 twin rounds operands and still multiplies in fp32: slower).
    pub fn resolved_precision(&self) -> Precision {
        self.precision.unwrap_or(match self.device {
            DeviceKind::Cuda => Precision::Bf16,
            DeviceKind::Cpu => Precision::Fp32,
        })
    }

    /// `--grad-link bf16` rounds the gradients of the bf16 recipe: an fp32 run keeps fp32
    /// gradients. Checked once the precision is resolved (a resumed run keeps its own).
    pub fn check_grad_link(&self) -> Result<()> {
        if self.grad_link == GradLink::Bf16 && self.resolved_precision() == Precision::Fp32 {
            return bad_setting(
                "grad_link",
                "bf16 gradients on the link belong to the bf16 recipe, and this run computes in fp32",
                "pass --precision bf16, or drop --grad-link",
            );
        }
        Ok(())
    }

    /// `activation_dtype`, or the precision's: bf16 layer inputs under the bf16 recipe.
    pub fn resolved_activation_dtype(&self) -> ActivationDtype {
        self.activation_dtype
            .unwrap_or(match self.resolved_precision() {
                Precision::Bf16 => ActivationDtype::Bf16,
                Precision::Fp32 => ActivationDtype::Fp32,
            })
    }

    /// bf16 layer inputs belong to the bf16 recipe, like bf16 gradients on the link.
    pub fn check_activation_dtype(&self) -> Result<()> {
        if self.resolved_activation_dtype() == ActivationDtype::Bf16
            && self.resolved_precision() == Precision::Fp32
        {
            return bad_setting(
                "activation_dtype",
                "bf16 layer inputs belong to the bf16 recipe, and this run computes in fp32",
                "pass --precision bf16, or drop --activation-dtype",
            );
        }
        Ok(())
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

    /// Check values that are wrong whatever the data: every count within [`limits`], every
    /// real number finite and in its range, settings that exclude each other.
    pub fn validate(&self) -> Result<()> {
        self.check_counts()?;
        self.check_optimizer()?;
        self.check_combinations()?;
        self.check_samples()?;
        self.check_paths_are_utf8()
    }

    /// Samples: a prompt when they are asked for, a length, a usable temperature.
    fn check_samples(&self) -> Result<()> {
        if self.sample_every == 0 {
            return Ok(());
        }
        if self.sample_prompt.as_deref().is_none_or(str::is_empty) {
            return bad_setting(
                "sample_every",
                "samples need a prompt to continue",
                "pass --sample-prompt TEXT",
            );
        }
        if self.sample_tokens == 0 || self.sample_tokens > self.seq_len {
            return bad_setting(
                "sample_tokens",
                &format!(
                    "is {}; it must be between 1 and --seq-len",
                    self.sample_tokens
                ),
                "e.g. --sample-tokens 32",
            );
        }
        if !(self.sample_temperature.is_finite() && self.sample_temperature >= 0.0) {
            return bad_setting(
                "sample_temperature",
                "must be a number ≥ 0 (0: greedy)",
                "e.g. --sample-temperature 0.8",
            );
        }
        if self.param_gather == ParamGather::Nccl
            && (self.zero_stage != 3 || self.device != DeviceKind::Cuda)
        {
            return bad_setting(
                "param_gather",
                "nccl gathers the params of a job that shards them (--zero-stage 3) on GPUs (--device cuda)",
                "drop --param-gather, or pass --zero-stage 3 --device cuda",
            );
        }
        if !matches!(self.zero_stage, 0 | 1 | 3) {
            return bad_setting(
                "zero_stage",
                "must be 0 (every rank holds the whole state), 1 (the Adam state sharded) or 3 (the params and the Adam state sharded)",
                "--zero-stage 1",
            );
        }
        Ok(())
    }

    /// Every count within its limit, micro-batches and steps within the token limits.
    fn check_counts(&self) -> Result<()> {
        let count = |k: &str, v: u64, max: u64| -> Result<()> {
            if v == 0 || v > max {
                return Err(Error::bad_input(
                    "setting",
                    k,
                    format!("is {v}; it must be between 1 and {max}"),
                    Some(&format!("set --{} within that range", k.replace('_', "-"))),
                ));
            }
            Ok(())
        };
        count("seq_len", self.seq_len as u64, limits::MAX_SEQ_LEN as u64)?;
        count(
            "batch_size",
            self.batch_size as u64,
            limits::MAX_MICRO_BATCH_TOKENS as u64,
        )?;
        count(
            "grad_accum",
            self.grad_accum as u64,
            limits::MAX_GRAD_ACCUM as u64,
        )?;
        count("steps", self.steps, limits::MAX_STEPS)?;
        count(
            "val_batches",
            self.val_batches as u64,
            limits::MAX_VAL_BATCHES as u64,
        )?;
        count("keep_checkpoints", self.keep_checkpoints as u64, 1 << 20)?;
        count("collective_timeout", self.collective_timeout, 7 * 24 * 3600)?;
        count(
            "spill_staging",
            self.spill_staging as u64,
            limits::MAX_SPILL_STAGING as u64,
        )?;
        let micro = self.batch_size as u128 * self.seq_len as u128;
        if micro > limits::MAX_MICRO_BATCH_TOKENS as u128 {
            return bad_setting(
                "batch_size × seq_len",
                &format!(
                    "is {micro} tokens per micro-batch, more than {}",
                    limits::MAX_MICRO_BATCH_TOKENS
                ),
                "lower --batch-size or --seq-len (and raise --grad-accum)",
            );
        }
        let step = micro * self.grad_accum as u128;
        if step > limits::MAX_STEP_TOKENS as u128 {
            return bad_setting(
                "grad_accum × batch_size × seq_len",
                &format!(
                    "is {step} tokens per step, more than {}",
                    limits::MAX_STEP_TOKENS
                ),
                "lower --grad-accum, --batch-size or --seq-len",
            );
        }
        Ok(())
    }

    /// The optimizer's numbers finite and in range.
    fn check_optimizer(&self) -> Result<()> {
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return bad_setting("lr", "must be a positive number", "e.g. --lr 3e-4");
        }
        let unit = |x: f64| x.is_finite() && (0.0..1.0).contains(&x);
        if !unit(self.beta1) || !unit(self.beta2) {
            return bad_setting(
                "beta1/beta2",
                "must be in [0, 1)",
                "e.g. --beta1 0.9 --beta2 0.95",
            );
        }
        if !(self.eps.is_finite() && self.eps > 0.0) {
            return bad_setting(
                "eps",
                "must be a positive number (AdamW divides by √v + eps)",
                "e.g. --eps 1e-8",
            );
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return bad_setting(
                "weight_decay",
                "must be a number ≥ 0",
                "e.g. --weight-decay 0.1 (0 disables it)",
            );
        }
        if !(self.grad_clip.is_finite() && self.grad_clip >= 0.0) {
            return bad_setting(
                "grad_clip",
                "must be a number ≥ 0",
                "e.g. --grad-clip 1.0 (0 disables clipping)",
            );
        }
        Ok(())
    }

    /// Settings that only make sense together, or that this build cannot honour.
    fn check_combinations(&self) -> Result<()> {
        if self.device_memory < 4096 {
            return bad_setting(
                "device_memory",
                "must be at least 4 KiB",
                "e.g. --device-memory 2G",
            );
        }
        if self.ram_budget == Some(0) {
            return bad_setting("ram_budget", "must be positive", "e.g. --ram-budget 64G");
        }
        if self.init_from.is_some() && self.model.is_some() {
            return bad_setting(
                "init_from/model",
                "give one: a checkpoint to start from or a config for a random init",
                "drop one of them",
            );
        }
        if self.spill == crate::store::placement::SpillPolicy::All && self.nvme.is_empty() {
            return bad_setting(
                "spill",
                "`all` needs a spill directory",
                "pass --nvme DIR (one per NVMe device)",
            );
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
            return bad_setting(
                "tf32",
                "TF32 tensor cores exist only on the CUDA device",
                "drop --tf32 or pass --device cuda",
            );
        }
        if self.mode == Some(Mode::Lean) && self.grad_accum > 1 {
            return Err(Error::bad_input(
                "--grad-accum",
                self.grad_accum.to_string(),
                "lean mode consumes each unit's gradients as they land, so it cannot accumulate micro-batches",
                Some("use --mode exact for gradient accumulation"),
            ));
        }
        if self.resume != Resume::Never && self.checkpoint_dir.is_none() {
            return bad_setting(
                "resume",
                "needs a checkpoint directory",
                "add --checkpoint-dir DIR",
            );
        }
        Ok(())
    }

    /// Every path setting, with its key.
    pub fn paths(&self) -> Vec<(&'static str, &Path)> {
        let mut v: Vec<(&'static str, &Path)> = [
            ("init_from", &self.init_from),
            ("model", &self.model),
            ("data", &self.data),
            ("val_data", &self.val_data),
            ("metrics", &self.metrics),
            ("tensorboard", &self.tensorboard),
            ("checkpoint_dir", &self.checkpoint_dir),
            ("export_hf", &self.export_hf),
            ("trace", &self.trace),
        ]
        .into_iter()
        .filter_map(|(k, p)| p.as_deref().map(|p| (k, p)))
        .collect();
        v.extend(self.nvme.iter().map(|p| ("nvme", p.as_path())));
        v
    }

    /// Paths are recorded in checkpoints as text: a path that is not UTF-8 is refused up front
    /// (naming the setting) instead of failing when the first checkpoint is written.
    fn check_paths_are_utf8(&self) -> Result<()> {
        for (key, p) in self.paths() {
            if p.to_str().is_none() {
                return Err(Error::bad_input(
                    "setting",
                    key,
                    format!(
                        "the path `{}` is not valid UTF-8; megatrain records paths in its checkpoints as text",
                        p.display()
                    ),
                    Some("rename the file or directory (or use a symlink) with a UTF-8 name"),
                ));
            }
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

    /// Values wrong whatever the data are refused by key: non-positive eps, negative weight
    /// decay or clip, zero or unbounded counts, non-finite numbers.
    #[test]
    fn out_of_range_values_are_refused_by_key() {
        let ok = TrainConfig::default();
        ok.validate().unwrap();
        let cases: Vec<(TrainConfig, &str)> = vec![
            (
                TrainConfig {
                    eps: 0.0,
                    ..ok.clone()
                },
                "eps",
            ),
            (
                TrainConfig {
                    eps: -1e-8,
                    ..ok.clone()
                },
                "eps",
            ),
            (
                TrainConfig {
                    weight_decay: -0.1,
                    ..ok.clone()
                },
                "weight_decay",
            ),
            (
                TrainConfig {
                    grad_clip: -1.0,
                    ..ok.clone()
                },
                "grad_clip",
            ),
            (
                TrainConfig {
                    grad_clip: f64::INFINITY,
                    ..ok.clone()
                },
                "grad_clip",
            ),
            (
                TrainConfig {
                    lr: f64::NAN,
                    ..ok.clone()
                },
                "lr",
            ),
            (
                TrainConfig {
                    beta1: f64::NAN,
                    ..ok.clone()
                },
                "beta1/beta2",
            ),
            (
                TrainConfig {
                    steps: 0,
                    ..ok.clone()
                },
                "steps",
            ),
            (
                TrainConfig {
                    grad_accum: 1 << 40,
                    ..ok.clone()
                },
                "grad_accum",
            ),
            (
                TrainConfig {
                    seq_len: 0,
                    ..ok.clone()
                },
                "seq_len",
            ),
            (
                TrainConfig {
                    batch_size: 1 << 20,
                    seq_len: 1 << 10,
                    ..ok.clone()
                },
                "batch_size × seq_len",
            ),
            (
                TrainConfig {
                    keep_checkpoints: 0,
                    ..ok.clone()
                },
                "keep_checkpoints",
            ),
            (
                TrainConfig {
                    resume: Resume::Auto,
                    ..ok.clone()
                },
                "resume",
            ),
        ];
        for (c, key) in cases {
            let e = c.validate().unwrap_err().to_string();
            assert!(e.starts_with(&format!("setting `{key}`")), "{key}: {e}");
        }
    }

    /// TOML errors name the line and the key; `resume` takes true, false or "auto".
    #[test]
    fn toml_errors_name_line_and_key_and_resume_spellings() {
        let e = TrainConfig::from_toml_str("steps = 5\nlr = \"fast\"\n", "run.toml")
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("run.toml") && e.contains("line 2, key `lr`"),
            "{e}"
        );
        let e = TrainConfig::from_toml_str("batch_size = -3\n", "run.toml")
            .unwrap_err()
            .to_string();
        assert!(e.contains("line 1, key `batch_size`"), "{e}");
        for (text, want) in [
            ("resume = true", Resume::Always),
            ("resume = false", Resume::Never),
            ("resume = \"auto\"", Resume::Auto),
        ] {
            assert_eq!(TrainConfig::from_toml_str(text, "t").unwrap().resume, want);
        }
        assert!(TrainConfig::from_toml_str("resume = \"maybe\"", "t").is_err());
        let back: TrainConfig = toml::from_str(
            &toml::to_string(&TrainConfig {
                resume: Resume::Auto,
                ..TrainConfig::default()
            })
            .unwrap(),
        )
        .unwrap();
        assert_eq!(back.resume, Resume::Auto);
    }
}
