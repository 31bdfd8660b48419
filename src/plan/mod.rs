//! `megatrain plan`: the memory plan and the performance model, as pure functions over a
//! hardware description and a model. Every time it prints is a **prediction** from the figures
//! below (or from a calibration measured with `megatrain bench`), never a measurement.

mod checkpoint;
pub mod data_parallel;
pub mod grad_link;
pub mod kernels;
mod memory;
pub mod presets;
mod render;
pub mod sim;
mod time;
pub use checkpoint::{checkpoint, CheckpointPlan, ASSUMED_CHECKPOINT_GBPS};
pub use data_parallel::{DataParallel, DataParallelPlan};
use memory::shortfalls;
pub use memory::{memory, spilled_units, MemoryPlan};
pub use render::render;
pub use time::{step_flops, time, TimePlan};

pub use grad_link::{pick_grad_link, GradLinkChoice, GRAD_LINK_MIN_GAIN};
pub use kernels::{
    efficiency, elementwise_bytes_per_token, kernel_efficiency, ComputeSplit, KernelEfficiency,
};

use crate::device::GradLink;
use crate::engine::schedule::{ActivationDtype, Activations};
use crate::model::config::ModelConfig;
use crate::store::layout::{AdamState, MasterFormat, Mode, StateLayout, UnitOwners};
use serde::{Deserialize, Serialize};

/// What the performance model needs to know about a machine.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Hardware {
    /// Preset name or "live".
    pub name: String,
    /// GPU model.
    pub gpu: String,
    /// GPU memory, bytes.
    pub gpu_memory_bytes: u64,
    /// Dense fp32 (CUDA-core) TFLOP/s.
    pub fp32_tflops: f64,
    /// Dense bf16 tensor-core TFLOP/s (fp32 accumulate).
    pub bf16_tflops: f64,
    /// Host→device GB/s (pinned, measured where known).
    pub htod_gbps: f64,
    /// Device→host GB/s.
    pub dtoh_gbps: f64,
    /// Host RAM usable for the state, bytes.
    pub host_ram_bytes: u64,
    /// GB/s the CPU AdamW engine reaches over all sockets (≈ 0.9 × STREAM triad).
    pub adam_gbps: f64,
    /// NVMe GB/s (read = write) over the spill directories, if any.
    pub nvme_gbps: Option<f64>,
    /// Where the figures come from.
    pub sources: String,
    /// The kernel efficiencies `megatrain bench kernels` measured on this GPU in bf16, replacing
    /// the sourced assumptions (`plan --calibration`).
    #[serde(default)]
    pub measured_bf16: Option<KernelEfficiency>,
    /// The same in fp32.
    #[serde(default)]
    pub measured_fp32: Option<KernelEfficiency>,
    /// GPUs in one machine (`plan --gpus` takes up to this many).
    #[serde(default = "one_gpu")]
    pub gpus: u64,
    /// Bus GB/s (as nccl-tests counts it) of the ranks' gradient sum in host memory within one
    /// machine (`megatrain bench collective` measures it).
    #[serde(default = "assumed_host_sum_gbps")]
    pub host_sum_gbps: f64,
    /// The machine's network GB/s per direction, all its NICs together (`plan --nodes` above 1
    /// needs it).
    #[serde(default)]
    pub nic_gbps: Option<f64>,
    /// Bus GB/s NCCL reaches between the machine's GPUs over NVLink (nccl-tests' busbw);
    /// `None`: no NVLink (NCCL goes through PCIe, at the link's rate).
    #[serde(default)]
    pub nvlink_gbps: Option<f64>,
}

impl Hardware {
    /// GB/s NCCL reaches between the machine's GPUs: NVLink's bus bandwidth, else the PCIe
    /// link's (the slower direction).
    pub fn gpu_to_gpu_gbps(&self) -> f64 {
        self.nvlink_gbps
            .unwrap_or_else(|| self.htod_gbps.min(self.dtoh_gbps))
    }
}

fn one_gpu() -> u64 {
    1
}

/// Bus GB/s assumed for the ranks' gradient sum in host memory where it was not measured:
/// `bench collective` measured 1.1–5.1 GB/s with 2–8 ranks on an H200 host's 16 cores
/// (docs/gpu.md), so a figure near its low end.
pub const ASSUMED_HOST_SUM_GBPS: f64 = 2.0;

fn assumed_host_sum_gbps() -> f64 {
    ASSUMED_HOST_SUM_GBPS
}

/// What to plan.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct PlanRequest {
    /// Tokens per optimizer step (all micro-batches).
    pub tokens_per_step: u64,
    /// Sequence length.
    pub seq_len: u64,
    /// Stream bf16 weights (and compute in bf16) instead of fp32.
    pub bf16: bool,
    /// Exact or lean.
    pub mode: Mode,
    /// How Adam m and v are stored.
    pub adam_state: AdamState,
    /// Allow spilling Adam m/v to NVMe: the units the host RAM lacks room for, last layers first
    /// (the placement's own choice).
    pub spill_moments: bool,
    /// Tokens per micro-batch; `None` lets [`plan`] pick the largest whole number of sequences
    /// (dividing the step) whose device working set fits. Weights cross the link twice per
    /// micro-batch, so larger micro-batches cost device memory and save link time.
    pub micro_batch_tokens: Option<u64>,
    /// How gradients cross back to the host; `None` lets [`plan`] pick ([`pick_grad_link`]).
    pub grad_link: Option<GradLink>,
    /// Where the layer-input checkpoints go (`Device` or `Host`); `None` lets [`plan`] choose
    /// as the trainer does: the GPU when they fit beside its working set, else host memory.
    pub activations: Option<Activations>,
    /// How they are stored: bf16 (half the bytes) only under bf16.
    pub activation_dtype: ActivationDtype,
    /// GPUs per machine and machines, one rank per GPU ([`data_parallel`]): `tokens_per_step`
    /// is the job's, `micro_batch_tokens` a rank's.
    pub data_parallel: DataParallel,
}

impl PlanRequest {
    /// Check the counts (each flag named): sequence length up to 2^24 tokens, a step of at
    /// least one sequence and at most 2^40 tokens, micro-batches within the step.
    pub fn validate(&self) -> crate::Result<()> {
        let bad = |flag: &str, v: u64, why: String| {
            Err(crate::Error::bad_input(
                "plan",
                format!("{flag} {v}"),
                why,
                Some("see `megatrain plan --help`"),
            ))
        };
        if self.seq_len == 0 || self.seq_len > 1 << 24 {
            return bad(
                "--seq-len",
                self.seq_len,
                "must be between 1 and 16777216".into(),
            );
        }
        // At least one sequence for each rank.
        let ranks = self.data_parallel.ranks();
        let grain = self.seq_len.saturating_mul(ranks);
        if self.tokens_per_step < grain || self.tokens_per_step > 1 << 40 {
            return bad(
                "--tokens-per-step",
                self.tokens_per_step,
                match ranks {
                    1 => format!(
                        "must be between the sequence length ({}) and 2^40",
                        self.seq_len
                    ),
                    _ => format!(
                        "must be between one sequence for each of the {ranks} ranks ({grain}) and 2^40"
                    ),
                },
            );
        }
        if self.grad_link == Some(GradLink::Bf16) && !self.bf16 {
            return Err(crate::Error::bad_input(
                "plan",
                "--grad-link bf16",
                "bf16 gradients on the link belong to the bf16 recipe, and this plan is for fp32",
                Some("pass --precision bf16, or drop --grad-link"),
            ));
        }
        if self.activation_dtype == ActivationDtype::Bf16 && !self.bf16 {
            return Err(crate::Error::bad_input(
                "plan",
                "--activation-dtype bf16",
                "bf16 layer inputs belong to the bf16 recipe, and this plan is for fp32",
                Some("pass --precision bf16, or drop --activation-dtype"),
            ));
        }
        if self.activations == Some(Activations::Keep) {
            return Err(crate::Error::bad_input(
                "plan",
                "--activations keep",
                "the plan models steps that recompute each block from its input (keeping every block's internals is for models far smaller than the GPU)",
                Some("pass --activations device or host, or leave it unset"),
            ));
        }
        // Each rank trains whole sequences, as many as every other.
        if !self.tokens_per_step.is_multiple_of(grain) {
            return bad(
                "--tokens-per-step",
                self.tokens_per_step,
                format!(
                    "is not a whole number of sequences of --seq-len {}{} (a step trains whole sequences): use {} or {}",
                    self.seq_len,
                    if ranks > 1 { format!(" for each of the {ranks} ranks") } else { String::new() },
                    self.tokens_per_step / grain * grain,
                    self.tokens_per_step.div_ceil(grain) * grain
                ),
            );
        }
        let per_rank = self.tokens_per_step / ranks;
        if let Some(m) = self.micro_batch_tokens {
            if m < self.seq_len || m > per_rank || !m.is_multiple_of(self.seq_len) {
                return bad(
                    "--micro-batch-tokens",
                    m,
                    format!(
                        "must be a whole number of sequences of --seq-len {}, at most {} {per_rank}",
                        self.seq_len,
                        if ranks > 1 { "a rank's share of the step," } else { "--tokens-per-step" },
                    ),
                );
            }
        }
        Ok(())
    }

    /// The default `--tokens-per-step` of a job of `ranks` ranks of `seq_len`-token sequences:
    /// 65,536 rounded up to whole sequences for each rank.
    pub fn default_tokens_per_step(seq_len: u64, ranks: u64) -> u64 {
        let grain = seq_len.saturating_mul(ranks).max(1);
        65536u64.div_ceil(grain).saturating_mul(grain)
    }

    /// One rank's request: its share of the job's tokens per step (the request itself for a
    /// job of one rank). [`time`], [`memory`] and the micro-batch choice plan a rank.
    pub fn rank_share(&self) -> PlanRequest {
        PlanRequest {
            tokens_per_step: self.tokens_per_step / self.data_parallel.ranks(),
            ..self.clone()
        }
    }

    fn micro_tokens(&self) -> u64 {
        self.micro_batch_tokens
            .unwrap_or(self.seq_len)
            .clamp(1, self.tokens_per_step.max(1))
    }

    fn micro_batches(&self) -> u64 {
        self.tokens_per_step.div_ceil(self.micro_tokens()).max(1)
    }

    /// The host layout of `model` under this request.
    fn layout(&self, model: &ModelConfig) -> StateLayout {
        // bf16 streams the high plane of a master stored as planes: no extra host bytes.
        let master = if self.bf16 {
            MasterFormat::Planes
        } else {
            MasterFormat::Fp32
        };
        let layout = StateLayout::new(model, self.mode)
            .with_adam_state(self.adam_state)
            .with_master(master);
        // A sharded job: the rank holding the most (a plan of one rank is for the fullest).
        match self.data_parallel.sharding() {
            0 => layout,
            stage => {
                let ranks = self.data_parallel.ranks() as usize;
                // Stage 3 in exact mode shards the gradients too.
                let grads = stage == 3 && self.mode == Mode::Exact;
                let fullest = UnitOwners::fullest(&layout, ranks, (stage == 3, grads));
                layout.with_owners(fullest)
            }
        }
    }
}

/// The whole answer.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// Parameters.
    pub params: u64,
    /// Parameters a token computes with (all of a dense model; a mixture of experts' router
    /// and top-k experts): the FLOPs of the step count these.
    pub active_params: u64,
    /// Tokens per micro-batch used (chosen by the planner unless given).
    pub micro_batch_tokens: u64,
    /// Memory per tier.
    pub memory: MemoryPlan,
    /// Whether host state and device working set fit.
    pub fits: bool,
    /// Why not, if not.
    pub missing: Option<String>,
    /// The smallest change that fits, if it does not.
    pub suggestion: Option<String>,
    /// Predicted times.
    pub time: TimePlan,
    /// A checkpoint written beside a step.
    pub checkpoint: CheckpointPlan,
    /// How gradients cross the link, and why.
    pub grad_link: GradLinkChoice,
    /// Several ranks: the machine's memory, the gradient sum and the job's speed.
    pub data_parallel: Option<DataParallelPlan>,
    /// The model's architecture features (attention heads, RoPE and its scaling, biases, …).
    pub features: Vec<String>,
    /// Always "prediction".
    pub kind: &'static str,
}

/// Datasheet peaks (dense TFLOP/s fp32, bf16) of GPUs the probe can name.
pub fn gpu_peaks(name: &str) -> Option<(f64, f64)> {
    let n = name.to_ascii_lowercase();
    [
        ("h200", 67.0, 989.0),
        ("gh200", 67.0, 989.0),
        ("h100", 67.0, 989.0),
        ("a100", 19.5, 312.0),
        ("4090", 82.6, 165.2),
        ("l40s", 91.6, 362.0),
        ("b200", 80.0, 2250.0),
    ]
    .iter()
    .find(|(k, _, _)| n.contains(k))
    .map(|&(_, a, b)| (a, b))
}

/// Hardware from a probe description (`megatrain probe --json`): GPU `gpu`'s peaks from its name,
/// its link from the PCIe generation × width (or NVLink-C2C), host RAM from the DRAM nodes, and
/// an AdamW rate of 5 GB/s per core unless `adam_gbps` (from `megatrain bench adam --json`) is
/// given. Returns the assumptions made, to print beside the plan.
pub fn hardware_from_machine(
    m: &crate::topology::Machine,
    gpu: usize,
    adam_gbps: Option<f64>,
    nvme_gbps: Option<f64>,
) -> crate::Result<(Hardware, Vec<String>)> {
    let mut notes = Vec::new();
    let g = m.gpus.get(gpu).ok_or_else(|| {
        crate::Error::bad_input(
            "--machine",
            "GPUs",
            format!(
                "the description has {} GPU(s), GPU {gpu} was asked for",
                m.gpus.len()
            ),
            Some("use a machine preset, or a probe of a machine with a GPU"),
        )
    })?;
    let name = g.name.clone().unwrap_or_else(|| "unknown GPU".into());
    let (fp32, bf16) = gpu_peaks(&name).ok_or_else(|| {
        crate::Error::bad_input(
            "--machine",
            name.clone(),
            "no datasheet figures for this GPU",
            Some("use a machine preset"),
        )
    })?;
    let link = match (g.link.kind, g.link.pcie_generation, g.link.pcie_width) {
        (crate::topology::LinkKind::CoherentNvlink, _, _) => 340.0,
        (_, Some(gen), Some(w)) => {
            // ~87% of the raw link rate is what pinned copies reach (nvbandwidth on Gen4/Gen5).
            let lane = [0.25, 0.5, 0.985, 1.969, 3.938, 7.56][usize::from(gen.clamp(1, 6)) - 1];
            0.87 * lane * f64::from(w)
        }
        _ => {
            notes.push("link unknown: assumed PCIe Gen4 x16 (27 GB/s)".into());
            27.0
        }
    };
    let adam = adam_gbps.unwrap_or_else(|| {
        notes.push(format!("AdamW rate assumed 5 GB/s per core ({} cores); pass --calibration from `megatrain bench adam --json`", m.cores));
        5.0 * m.cores as f64
    });
    Ok((
        Hardware {
            name: m
                .hostname
                .clone()
                .unwrap_or_else(|| "probed machine".into()),
            gpu: name,
            gpu_memory_bytes: g.memory_bytes.unwrap_or(0),
            fp32_tflops: fp32,
            bf16_tflops: bf16,
            htod_gbps: link,
            dtoh_gbps: link,
            host_ram_bytes: m.memory_bytes(crate::topology::MemoryKind::Dram)
                + m.memory_bytes(crate::topology::MemoryKind::Hbm),
            adam_gbps: adam,
            nvme_gbps,
            sources: "probe description + datasheet peaks".into(),
            measured_bf16: None,
            measured_fp32: None,
            gpus: m.gpus.len() as u64,
            host_sum_gbps: ASSUMED_HOST_SUM_GBPS,
            // A probe describes no network between machines: `plan --nic-gbps` gives it.
            nic_gbps: None,
            // Nor NVLink's bandwidth: NCCL planned at the PCIe link's.
            nvlink_gbps: None,
        },
        notes,
    ))
}

/// Share of host RAM and GPU memory the plan may use.
pub const USABLE: f64 = 0.9;

/// The micro-batch size [`plan`] picks when none is given: the largest whole number of
/// sequences dividing the step whose device working set and host activations fit (both grow
/// with the micro-batch), found by bisection over the divisors (memory is monotone in the
/// micro-batch), so a step of millions of sequences plans as fast as one of eight.
fn pick_micro_batch(model: &ModelConfig, hw: &Hardware, req: &PlanRequest) -> PlanRequest {
    let with = |k: u64| PlanRequest {
        micro_batch_tokens: Some(k * req.seq_len),
        ..req.clone()
    };
    let seqs = (req.tokens_per_step / req.seq_len.max(1)).max(1);
    let mut divisors: Vec<u64> = Vec::new();
    let mut d = 1u64;
    while d.saturating_mul(d) <= seqs {
        if seqs.is_multiple_of(d) {
            divisors.push(d);
            if d != seqs / d {
                divisors.push(seqs / d);
            }
        }
        d += 1;
    }
    divisors.sort_unstable();
    let per_node = req.data_parallel.gpus;
    let fits_with = |k: u64| shortfalls(&memory(model, &with(k), hw), hw, per_node).is_empty();
    // The largest index whose divisor fits, if any.
    let (mut lo, mut hi) = (0usize, divisors.len());
    if !fits_with(divisors[0]) {
        return with(1);
    }
    while hi - lo > 1 {
        let mid = lo + (hi - lo) / 2;
        if fits_with(divisors[mid]) {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    with(divisors[lo])
}

/// The smallest change to `req` (as the user asked it, micro-batch unresolved; a rank's:
/// [`PlanRequest::rank_share`]) that makes it fit `hw` (the rank's share of its machine:
/// [`DataParallel::rank_share`]), as the flags that say it and the request with it applied and
/// resolved (each alternative alone first, then combined); `None` if nothing tried fits.
pub fn suggest(
    model: &ModelConfig,
    hw: &Hardware,
    req: &PlanRequest,
) -> Option<(String, PlanRequest)> {
    let mut tries: Vec<(String, PlanRequest)> = Vec::new();
    // Lean mode cannot accumulate micro-batches: a switch to it takes the whole step.
    let lean = |r: PlanRequest| PlanRequest {
        mode: Mode::Lean,
        micro_batch_tokens: None,
        ..r
    };
    let state = |r: PlanRequest, adam_state: AdamState| PlanRequest { adam_state, ..r };
    // Compact moments before lean mode (global clipping stays exact), bf16 (near-exact) first;
    // both before NVMe (whose disk would bound the step).
    let compact = req.adam_state.more_compact();
    for s in &compact {
        tries.push((format!("--adam-state {}", s.name()), state(req.clone(), *s)));
    }
    if req.mode == Mode::Exact {
        tries.push(("--mode lean".into(), lean(req.clone())));
        for s in &compact {
            tries.push((
                format!("--mode lean --adam-state {}", s.name()),
                lean(state(req.clone(), *s)),
            ));
        }
    }
    // `--precision` is not offered: it changes no host byte (the master takes 4 B/param as fp32
    // or as bf16 planes).
    if !req.spill_moments {
        tries.push((
            "--nvme DIR".into(),
            PlanRequest {
                spill_moments: true,
                ..req.clone()
            },
        ));
        if req.mode == Mode::Exact {
            tries.push((
                "--mode lean --nvme DIR".into(),
                lean(PlanRequest {
                    spill_moments: true,
                    ..req.clone()
                }),
            ));
        }
    }
    if req.seq_len > 512 {
        tries.push((
            format!(
                "--seq-len {} --tokens-per-step {}",
                req.seq_len / 2,
                // The flag takes the job's tokens.
                req.tokens_per_step / 2 * req.data_parallel.ranks()
            ),
            PlanRequest {
                seq_len: req.seq_len / 2,
                tokens_per_step: req.tokens_per_step / 2,
                micro_batch_tokens: req.micro_batch_tokens.map(|m| (m / 2).max(1)),
                ..req.clone()
            },
        ));
    }
    tries.into_iter().find_map(|(what, r)| {
        // Spilling is planned with an assumed NVMe where none is described.
        let hw = Hardware {
            nvme_gbps: hw.nvme_gbps.or(r.spill_moments.then_some(3.0)),
            ..hw.clone()
        };
        let r = resolve(model, &hw, &r);
        shortfalls(&memory(model, &r, &hw), &hw, r.data_parallel.gpus)
            .is_empty()
            .then_some((what, r))
    })
}

/// `req` with its micro-batch decided: as given, the whole step in lean mode (which cannot
/// accumulate micro-batches), else [`pick_micro_batch`].
pub fn resolve(model: &ModelConfig, hw: &Hardware, req: &PlanRequest) -> PlanRequest {
    match req.micro_batch_tokens {
        Some(_) => req.clone(),
        None if req.mode == Mode::Lean => PlanRequest {
            micro_batch_tokens: Some(req.tokens_per_step),
            ..req.clone()
        },
        None => pick_micro_batch(model, hw, req),
    }
}

/// Plan `model` on `hw`: one rank of the job `req.data_parallel` describes (its share of the
/// machine, its share of the step's tokens), with the job's tokens per second and, for several
/// ranks, the machine's memory and the gradient sum ([`DataParallelPlan`]).
pub fn plan(model: &ModelConfig, hw: &Hardware, req: &PlanRequest) -> Plan {
    let dp = req.data_parallel;
    let node = hw;
    let hw = &dp.rank_share(node);
    let asked = &req.rank_share();
    let (rank, grad_link) = pick_grad_link(model, hw, &resolve(model, hw, asked));
    let rank = &rank;
    let mem = memory(model, rank, hw);
    let shortfalls = shortfalls(&mem, hw, dp.gpus);
    let fits = shortfalls.is_empty();
    let suggestion = (!fits).then(|| {
        suggest(model, hw, asked)
            .map(|(what, _)| what)
            .or_else(|| data_parallel::sharded(model, node, req))
            .or_else(|| data_parallel::fewer_gpus(model, node, req))
            .unwrap_or_else(|| {
                "nothing tried fits: a machine with more host RAM or GPU memory is needed"
                    .to_owned()
            })
    });
    let mut time = time(model, hw, rank);
    time.tokens_per_s *= dp.ranks() as f64;
    let host_per_rank = mem.host_state_bytes + mem.host_activation_bytes;
    let data_parallel = (dp.ranks() > 1).then(|| DataParallelPlan {
        gpus_per_node: dp.gpus,
        nodes: dp.nodes,
        ranks: dp.ranks(),
        tokens_per_rank: rank.tokens_per_step,
        zero_stage: dp.sharding(),
        params_bytes_per_step: time.params_bytes,
        gpu_gather: dp.sharding() == 3 && dp.gpu_gather,
        host_bytes_per_rank: host_per_rank,
        host_bytes_per_node: host_per_rank.saturating_mul(dp.gpus),
        node_ram_bytes: node.host_ram_bytes,
        // Every micro-batch's with sharded gradients (ZeRO stage 3, exact mode).
        sum_bytes_per_step: 4
            * model.num_params() as u64
            * match rank.layout(model).lands_grads() {
                true => rank.micro_batches(),
                false => 1,
            },
        host_sum_gbps: node.host_sum_gbps,
        nic_gbps: node.nic_gbps.filter(|_| dp.nodes > 1),
        job_tokens_per_s: time.tokens_per_s,
    });
    Plan {
        params: model.num_params() as u64,
        active_params: model.active_params() as u64,
        micro_batch_tokens: rank.micro_tokens(),
        // Rank 0 writes the job's checkpoints with the machine's disk; the other ranks wait for
        // it at their next sum.
        checkpoint: checkpoint(model, node, rank, &time),
        time,
        grad_link,
        fits,
        missing: (!fits).then(|| shortfalls.join("; ")),
        suggestion,
        memory: mem,
        data_parallel,
        features: model.features(),
        kind: "prediction",
    }
}

/// Host bytes per NUMA node of a described machine: the trainer's own placement of `model`
/// under `req` (spilling as [`spilled_units`] does), within the usable share of each node.
pub fn per_node(
    machine: &crate::topology::Machine,
    gpu: usize,
    model: &ModelConfig,
    req: &PlanRequest,
) -> crate::Result<Vec<crate::store::placement::NodePlan>> {
    use crate::store::placement::{place_with_spill, RamBudget, SpillPolicy, SpillRequest};
    let layout = req.layout(model);
    let p = place_with_spill(
        machine,
        &layout,
        (gpu < machine.gpus.len()).then_some(gpu),
        RamBudget {
            fraction: USABLE,
            total_bytes: None,
        },
        SpillRequest {
            policy: if req.spill_moments {
                SpillPolicy::Auto
            } else {
                SpillPolicy::Never
            },
            slots: 3,
        },
    )?;
    Ok(p.nodes)
}

#[cfg(test)]
mod tests;
