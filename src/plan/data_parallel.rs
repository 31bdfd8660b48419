//! Data parallel in the plan (`plan --gpus G --nodes M`): N = G·M ranks, one per GPU, as the
//! trainer runs them (`mpirun -np N megatrain train …`, [`crate::dist`]). Every rank holds the
//! whole host state (it is replicated, not sharded), streams the whole model over its own link
//! and trains 1/N of the step's sequences; a node's G ranks share its RAM, its AdamW bandwidth
//! and its NVMe. Each unit's fp32 gradients are summed across the ranks in host memory on the
//! rank's host thread ([`crate::engine::schedule::Op::Reduce`]): a reduce-scatter then an
//! all-gather, so each rank moves 2(N−1)/N of the unit's bytes, at the bus bandwidth a node's
//! ranks reach in host memory (`bench collective`), and across nodes a node's network carries
//! its G ranks' share of the traffic that leaves it.

use super::memory::{memory, shortfalls};
use super::{resolve, Hardware, PlanRequest};
use crate::model::config::ModelConfig;
use serde::Serialize;

/// The most machines a plan spreads over.
pub const MAX_NODES: u64 = 1 << 16;

/// How many GPUs and machines a plan spreads over, and how the host state is spread over
/// their ranks.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DataParallel {
    /// GPUs (ranks) per machine.
    pub gpus: u64,
    /// Machines.
    pub nodes: u64,
    /// `--zero-stage`: 0 every rank holds the whole state; 1 each unit's Adam moments on one
    /// rank, which broadcasts the unit's params after its update; 3 its params there too, each
    /// rank gathering a unit's params before each copy to its GPU
    /// ([`crate::store::layout::UnitOwners`]).
    pub zero_stage: u8,
    /// Stage 3: the GPUs gather the params (the owner copies a unit to its GPU, NCCL broadcasts
    /// it: `train --param-gather nccl`), else through host memory.
    pub gpu_gather: bool,
}

impl Default for DataParallel {
    fn default() -> Self {
        DataParallel::new(1, 1)
    }
}

impl DataParallel {
    /// `gpus` ranks on each of `nodes` machines, every rank holding the whole state.
    pub fn new(gpus: u64, nodes: u64) -> Self {
        DataParallel {
            gpus,
            nodes,
            zero_stage: 0,
            gpu_gather: false,
        }
    }

    /// The stage that applies: none for one rank (sharding needs ranks, as the trainer says).
    pub fn sharding(&self) -> u8 {
        match self.ranks() {
            1 => 0,
            _ => self.zero_stage,
        }
    }

    /// Seconds to broadcast `bytes` from one rank to every other: each rank receives
    /// (N−1)/N of them through host memory at `host_sum_gbps` of bus bandwidth, and a
    /// machine's network carries its ranks' share of what comes from other machines,
    /// G·(N−G)/N of them. The slower of the two (half an all-reduce's traffic).
    pub fn broadcast_s(&self, hw: &Hardware, bytes: f64) -> f64 {
        self.sum_s(hw, bytes) / 2.0
    }

    /// Seconds for NCCL to broadcast `bytes` from one GPU to every other (the GPUs gathering a
    /// unit's params): within a machine at NVLink's bus bandwidth (a broadcast's bus bandwidth
    /// is its algorithm bandwidth, as nccl-tests counts it), or, without NVLink, the PCIe
    /// link's; across machines each receives the bytes once through its network. The slower.
    pub fn gpu_broadcast_s(&self, hw: &Hardware, bytes: f64) -> f64 {
        if self.ranks() <= 1 {
            return 0.0;
        }
        let inside = bytes / (hw.gpu_to_gpu_gbps().max(1e-9) * 1e9);
        let net = match (self.nodes > 1, hw.nic_gbps) {
            (true, Some(nic)) => bytes / (nic.max(1e-9) * 1e9),
            _ => 0.0,
        };
        inside.max(net)
    }

    /// Ranks in the job (at least one: [`DataParallel::check`] refuses a job of none).
    pub fn ranks(&self) -> u64 {
        self.gpus.saturating_mul(self.nodes).max(1)
    }

    /// Check the job against the machine: at least one GPU and one machine, no more GPUs per
    /// machine than it has, a network to cross when there are several machines.
    pub fn check(&self, hw: &Hardware) -> crate::Result<()> {
        let bad = |what: String, why: String, fix: &str| {
            Err(crate::Error::bad_input("plan", what, why, Some(fix)))
        };
        if self.gpus == 0 || self.nodes == 0 {
            return bad(
                format!("--gpus {} --nodes {}", self.gpus, self.nodes),
                "a job needs at least one GPU on at least one machine".into(),
                "pass --gpus 1 or more and --nodes 1 or more",
            );
        }
        if self.nodes > MAX_NODES {
            return bad(
                format!("--nodes {}", self.nodes),
                format!("plans at most {MAX_NODES} machines"),
                "pass fewer machines",
            );
        }
        if self.gpus > hw.gpus {
            return bad(
                format!("--gpus {}", self.gpus),
                format!("{} has {} GPU(s) per machine", hw.name, hw.gpus),
                "pass at most that many, or describe the machine with `megatrain probe --json`",
            );
        }
        if self.nodes > 1 && hw.nic_gbps.is_none() {
            return bad(
                format!("--nodes {}", self.nodes),
                format!(
                    "the description of {} names no network between machines",
                    hw.name
                ),
                "pass --nic-gbps with the machine's network bandwidth per direction (all its NICs)",
            );
        }
        Ok(())
    }

    /// One rank's share of a machine: its RAM, AdamW bandwidth and NVMe divided among the
    /// machine's ranks (each rank's host state is placed, and its AdamW runs, on its share of the
    /// CPUs: [`crate::dist::HostShare`]). The GPU and its link are the rank's own.
    pub fn rank_share(&self, hw: &Hardware) -> Hardware {
        let g = self.gpus.max(1);
        Hardware {
            host_ram_bytes: hw.host_ram_bytes / g,
            adam_gbps: hw.adam_gbps / g as f64,
            nvme_gbps: hw.nvme_gbps.map(|x| x / g as f64),
            ..hw.clone()
        }
    }

    /// Seconds to sum `bytes` of fp32 gradients per rank across the job: each rank sends and
    /// receives 2(N−1)/N of them through host memory at `host_sum_gbps` of bus bandwidth, and a
    /// machine's network carries its ranks' share of what crosses to other machines,
    /// G · 2(N−G)/N of them. The slower of the two.
    pub fn sum_s(&self, hw: &Hardware, bytes: f64) -> f64 {
        let n = self.ranks() as f64;
        if n <= 1.0 {
            return 0.0;
        }
        let g = self.gpus.max(1) as f64;
        let host = 2.0 * (n - 1.0) / n * bytes / (hw.host_sum_gbps.max(1e-9) * 1e9);
        let net = match (self.nodes > 1, hw.nic_gbps) {
            (true, Some(nic)) => g * 2.0 * (n - g) / n * bytes / (nic.max(1e-9) * 1e9),
            _ => 0.0,
        };
        host.max(net)
    }
}

/// The data-parallel side of a plan of several ranks.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct DataParallelPlan {
    /// GPUs (ranks) per machine.
    pub gpus_per_node: u64,
    /// Machines.
    pub nodes: u64,
    /// Ranks.
    pub ranks: u64,
    /// Tokens each rank trains per step.
    pub tokens_per_rank: u64,
    /// `--zero-stage`: 0 replicated, 1 Adam moments sharded, 3 params too.
    pub zero_stage: u8,
    /// Host bytes one rank holds (its host state — all of it, or its share when sharded — and
    /// host activations).
    pub host_bytes_per_rank: u64,
    /// Host bytes of one machine: its ranks' together.
    pub host_bytes_per_node: u64,
    /// A machine's RAM.
    pub node_ram_bytes: u64,
    /// fp32 gradient bytes each rank sums per step (every micro-batch's with sharded gradients).
    pub sum_bytes_per_step: u64,
    /// Param bytes each rank receives per step from the ranks holding them (stage 1: every
    /// unit's update once; stage 3: every unit's streamed params before each copy to the GPU).
    pub params_bytes_per_step: u64,
    /// Stage 3's params gathered GPU to GPU (NCCL), not through host memory.
    pub gpu_gather: bool,
    /// Bus GB/s of the sum in host memory within a machine.
    pub host_sum_gbps: f64,
    /// A machine's network GB/s, when several machines are planned.
    pub nic_gbps: Option<f64>,
    /// Tokens per second of the whole job.
    pub job_tokens_per_s: f64,
}

/// For a job of several GPUs per machine that does not fit: the most GPUs per machine whose
/// ranks' host state fits (each rank holds all of it), as the flags that say it — with the job's
/// tokens rounded down to whole sequences for each rank where they must change.
pub(super) fn fewer_gpus(
    model: &ModelConfig,
    node: &Hardware,
    req: &PlanRequest,
) -> Option<String> {
    (1..req.data_parallel.gpus).rev().find_map(|gpus| {
        let dp = DataParallel {
            gpus,
            ..req.data_parallel
        };
        let grain = req.seq_len.saturating_mul(dp.ranks()).max(1);
        let tokens = (req.tokens_per_step / grain).max(1).saturating_mul(grain);
        let r = PlanRequest {
            data_parallel: dp,
            tokens_per_step: tokens,
            ..req.clone()
        };
        r.validate().ok()?;
        let hw = dp.rank_share(node);
        let rank = resolve(model, &hw, &r.rank_share());
        shortfalls(&memory(model, &rank, &hw), &hw, gpus)
            .is_empty()
            .then(|| match tokens == req.tokens_per_step {
                true => format!("--gpus {gpus}"),
                false => format!("--gpus {gpus} --tokens-per-step {tokens}"),
            })
    })
}

/// For a job of several ranks that does not fit: `--zero-stage 3` (each rank holds 1/N of the
/// params and moments), alone or with the smallest further change that fits
/// ([`super::suggest`]), as the flags that say it.
pub(super) fn sharded(model: &ModelConfig, node: &Hardware, req: &PlanRequest) -> Option<String> {
    if req.data_parallel.ranks() < 2 || req.data_parallel.zero_stage == 3 {
        return None;
    }
    let r = PlanRequest {
        data_parallel: DataParallel {
            zero_stage: 3,
            ..req.data_parallel
        },
        ..req.clone()
    };
    let hw = r.data_parallel.rank_share(node);
    let rank = resolve(model, &hw, &r.rank_share());
    if shortfalls(&memory(model, &rank, &hw), &hw, r.data_parallel.gpus).is_empty() {
        return Some("--zero-stage 3".to_owned());
    }
    super::suggest(model, &hw, &r.rank_share()).map(|(what, _)| format!("--zero-stage 3 {what}"))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::schedule::ActivationDtype;
    use crate::plan::{plan, presets};
    use crate::store::layout::{AdamState, Mode};

    fn ranks(gpus: u64, nodes: u64, tokens: u64) -> PlanRequest {
        PlanRequest {
            micro_batch_tokens: None,
            data_parallel: DataParallel::new(gpus, nodes),
            tokens_per_step: tokens,
            seq_len: 4096,
            bf16: false,
            mode: Mode::Exact,
            adam_state: AdamState::Fp32,
            spill_moments: false,
            grad_link: None,
            activations: None,
            activation_dtype: ActivationDtype::Fp32,
        }
    }

    /// A job of one rank is the single-GPU plan: no data-parallel part, nothing summed.
    #[test]
    fn one_rank_sums_nothing() {
        let hw = presets::machine("h200-1.5tb").unwrap();
        let m = presets::model("llama-3.1-8b").unwrap();
        let p = plan(&m, &hw, &ranks(1, 1, 65536));
        assert!(p.data_parallel.is_none());
        assert_eq!(p.time.sum_s, 0.0);
        assert_eq!(
            p.time.tokens_per_s,
            65536.0 / p.time.step_s,
            "the job's tokens/s is the rank's"
        );
    }

    /// ZeRO stage 3 in exact mode sums every micro-batch's gradients at once (no rank keeps
    /// another's across micro-batches): with 4 micro-batches a rank, the same host bytes as
    /// with one, and 4 sums a step — the bytes and the seconds (each later micro-batch's sum
    /// also added to the owner's shard) — where stage 1 sums once.
    #[test]
    fn sharded_gradients_are_summed_every_micro_batch() {
        let node = presets::machine("h200-1.5tb").unwrap();
        let m = presets::model("llama-3.1-8b").unwrap();
        let job = |stage: u8, micro: u64| PlanRequest {
            data_parallel: DataParallel {
                zero_stage: stage,
                ..DataParallel::new(4, 1)
            },
            micro_batch_tokens: Some(4096),
            ..ranks(4, 1, 4 * 4096 * micro)
        };
        let (one, four) = (plan(&m, &node, &job(3, 1)), plan(&m, &node, &job(3, 4)));
        let (d1, d4) = (one.data_parallel.unwrap(), four.data_parallel.unwrap());
        assert_eq!(d1.host_bytes_per_rank, d4.host_bytes_per_rank);
        assert_eq!(d4.sum_bytes_per_step, 4 * d1.sum_bytes_per_step);
        let s = (one.time.sum_s, four.time.sum_s);
        assert!(s.1 > 4.0 * s.0 && s.1 < 4.2 * s.0, "{s:?}");
        let (z1, z4) = (plan(&m, &node, &job(1, 1)), plan(&m, &node, &job(1, 4)));
        assert_eq!(
            z4.data_parallel.unwrap().sum_bytes_per_step,
            z1.data_parallel.unwrap().sum_bytes_per_step
        );
        assert!((z4.time.sum_s - z1.time.sum_s).abs() < 1e-9 * z1.time.sum_s);
    }

    /// N ranks: each is the single-GPU plan of its share of the tokens on its share of the machine
    /// (RAM, AdamW bandwidth), plus the sum of every unit's fp32 gradients on its host thread; the
    /// machine holds its ranks' host state side by side, and the job trains N ranks' tokens.
    #[test]
    fn ranks_share_the_machine_and_sum_their_gradients() {
        let node = presets::machine("h200-1.5tb").unwrap();
        let m = presets::model("llama-3.1-8b").unwrap();
        let job = ranks(4, 1, 4 * 16384);
        let p = plan(&m, &node, &job);
        let d = p.data_parallel.clone().unwrap();
        assert_eq!((d.ranks, d.gpus_per_node, d.tokens_per_rank), (4, 4, 16384));
        // The rank alone, on a quarter of the machine, with a sum as free as nothing.
        let share = Hardware {
            host_ram_bytes: node.host_ram_bytes / 4,
            adam_gbps: node.adam_gbps / 4.0,
            host_sum_gbps: 1e12,
            ..node.clone()
        };
        let alone = plan(&m, &share, &ranks(1, 1, 16384));
        assert_eq!(p.memory, alone.memory);
        assert_eq!(d.host_bytes_per_rank, alone.memory.host_state_bytes);
        assert_eq!(d.host_bytes_per_node, 4 * d.host_bytes_per_rank);
        assert_eq!(d.sum_bytes_per_step, 4 * m.num_params() as u64);
        // 2(N−1)/N of each unit's bytes at the bus bandwidth, every unit once a step.
        let layout = job.layout(&m);
        let want: f64 = layout
            .units
            .iter()
            .map(|u| 1.5 * 4.0 * u.numel as f64 / (node.host_sum_gbps * 1e9))
            .sum();
        assert!(
            (p.time.sum_s - want).abs() < 1e-9 * want,
            "{} vs {want}",
            p.time.sum_s
        );
        // The sum blocks the rank's host thread (the device runs on through what was submitted
        // before it): the step is at least the sum, and longer than the rank's step without it.
        assert!(p.time.step_s >= p.time.sum_s, "{:?}", p.time);
        assert!(
            p.time.step_s > alone.time.step_s + 0.1 * p.time.sum_s,
            "{:?} vs {:?}",
            p.time,
            alone.time
        );
        assert!((p.time.tokens_per_s - 4.0 * 16384.0 / p.time.step_s).abs() < 1e-6);
        // With a sum as fast as nothing the job is 4 ranks of the rank's step.
        let free = Hardware {
            host_sum_gbps: 1e12,
            ..node.clone()
        };
        let q = plan(&m, &free, &job);
        assert!(q.time.sum_s < 1e-6);
        let r = (q.time.step_s / alone.time.step_s - 1.0).abs();
        assert!(r < 1e-3, "{} vs {}", q.time.step_s, alone.time.step_s);
    }

    /// Across machines, a machine's network carries its ranks' share of what leaves it:
    /// G·2(N−G)/N of the bytes; the sum takes the slower of that and the host's part.
    #[test]
    fn machines_sum_over_their_network() {
        let node = Hardware {
            nic_gbps: Some(1.0),
            host_sum_gbps: 100.0,
            ..presets::machine("h200-1.5tb").unwrap()
        };
        let dp = DataParallel::new(2, 2);
        let b = 1e9;
        // N = 4, G = 2: the network moves 2·2·2/4 = 2 B at 1 GB/s, the host 1.5 B at 100 GB/s.
        assert!((dp.sum_s(&node, b) - 2.0).abs() < 1e-12);
        let fast_net = Hardware {
            nic_gbps: Some(1e6),
            ..node.clone()
        };
        assert!((dp.sum_s(&fast_net, b) - 1.5 / 100.0).abs() < 1e-12);
        // One machine never crosses the network.
        let one = DataParallel::new(4, 1);
        assert!((one.sum_s(&node, b) - 1.5 / 100.0).abs() < 1e-12);
        let m = presets::model("llama-3.1-8b").unwrap();
        let slow = plan(&m, &node, &ranks(2, 2, 4 * 4096));
        let fast = plan(&m, &fast_net, &ranks(2, 2, 4 * 4096));
        assert!(slow.time.sum_s > 100.0 * fast.time.sum_s);
        assert_eq!(slow.data_parallel.unwrap().nic_gbps, Some(1.0));
    }

    /// Llama-3.1-405B on 4 machines of 8 H200s: replicated, every rank holds the whole 16 B/param
    /// host state, so a machine would need 8 of them; the plan says so, per rank and per machine,
    /// and offers the sharded job that fits — which, applied, fits with its host state per
    /// machine stated.
    #[test]
    fn the_405b_on_32_gpus_fits_sharded_and_says_per_machine() {
        let node = presets::machine("h200-1.5tb").unwrap();
        let m = presets::model("llama-3.1-405b").unwrap();
        let job = ranks(8, 4, 32 * 4096);
        job.validate().unwrap();
        job.data_parallel.check(&node).unwrap();
        let p = plan(&m, &node, &job);
        let d = p.data_parallel.clone().unwrap();
        assert!(!p.fits);
        assert!(d.host_bytes_per_rank >= 16 * m.num_params() as u64);
        assert_eq!(d.host_bytes_per_node, 8 * d.host_bytes_per_rank);
        assert_eq!(d.nic_gbps, Some(400.0));
        let why = p.missing.unwrap();
        assert!(why.contains("for the 8 ranks of a machine"), "{why}");
        // Exact mode, each rank 1/32 of 10 B/param (params 4, gradients 4, int8 moments 2).
        assert_eq!(
            p.suggestion.as_deref(),
            Some("--zero-stage 3 --adam-state int8")
        );
        let exact = PlanRequest {
            data_parallel: DataParallel {
                zero_stage: 3,
                ..job.data_parallel
            },
            adam_state: AdamState::Int8,
            ..job.clone()
        };
        let q = plan(&m, &node, &exact);
        assert!(q.fits, "{:?}", q.missing);
        let d = q.data_parallel.unwrap();
        let share = 10 * m.num_params() as u64 / 32;
        assert!(d.host_bytes_per_rank > share, "{}", d.host_bytes_per_rank);
        // Lean mode with bf16 moments fits too (8 B/param, no gradient shard).
        let sharded = PlanRequest {
            data_parallel: DataParallel {
                zero_stage: 3,
                ..job.data_parallel
            },
            mode: Mode::Lean,
            adam_state: AdamState::Bf16,
            ..job
        };
        let q = plan(&m, &node, &sharded);
        assert!(q.fits, "{:?}", q.missing);
        let d = q.data_parallel.unwrap();
        assert_eq!(d.zero_stage, 3);
        // A rank holds ~1/32 of the 8 B/param (params 4, bf16 m and v 2 + 2) plus its buffers
        // (two lean gradient pieces of a 3.2B-param block, two gathered 2.1B-param embeddings:
        // ~43 GB), a machine 8 ranks' of them, within its usable RAM.
        let share = 8 * m.num_params() as u64 / 32;
        assert!(d.host_bytes_per_rank > share, "{}", d.host_bytes_per_rank);
        assert!(
            d.host_bytes_per_rank < share + 60_000_000_000,
            "{}",
            d.host_bytes_per_rank
        );
        assert_eq!(d.host_bytes_per_node, 8 * d.host_bytes_per_rank);
        assert!(d.host_bytes_per_node as f64 <= node.host_ram_bytes as f64 * super::super::USABLE);
        // Sharded less, it does not fit.
        let stage1 = PlanRequest {
            data_parallel: DataParallel {
                zero_stage: 1,
                ..sharded.data_parallel
            },
            ..sharded.clone()
        };
        assert!(!plan(&m, &node, &stage1).fits);
    }

    /// What the stages cost: stage 1 broadcasts every unit's params (4 B/param) after the step,
    /// stage 3 gathers a unit's streamed params before each copy of it, on the host thread; a
    /// sharded rank updates only its units, and holds less.
    #[test]
    fn sharded_stages_hold_less_and_move_params() {
        let node = presets::machine("h200-1.5tb").unwrap();
        let m = presets::model("llama-3.1-8b").unwrap();
        let at = |zero_stage: u8, bf16: bool| {
            let mut r = ranks(4, 1, 4 * 4096);
            r.data_parallel.zero_stage = zero_stage;
            r.bf16 = bf16;
            plan(&m, &node, &r)
        };
        let (s0, s1, s3) = (at(0, false), at(1, false), at(3, false));
        let held = |p: &crate::plan::Plan| p.data_parallel.as_ref().unwrap().host_bytes_per_rank;
        assert!(held(&s3) < held(&s1) && held(&s1) < held(&s0));
        assert!(s1.time.adam_s < 0.5 * s0.time.adam_s, "{:?}", s1.time);
        let p = m.num_params() as f64;
        assert_eq!(s0.time.params_s, 0.0);
        // Stage 1: every unit's fp32 params once, after the schedule; the rank planned receives
        // those of the units it does not hold.
        let mut r1 = ranks(4, 1, 4 * 4096);
        r1.data_parallel.zero_stage = 1;
        let l1 = r1.layout(&m);
        let others: usize = (0..l1.units.len())
            .filter(|&u| !l1.holds_moments(u))
            .map(|u| l1.units[u].numel)
            .sum();
        assert_eq!(s1.time.params_bytes, 4 * others as u64);
        assert!(others > m.num_params() / 2 && others < m.num_params());
        let dp = DataParallel::new(4, 1);
        let want: f64 = s1_units(&m)
            .iter()
            .map(|&k| dp.broadcast_s(&node, 4.0 * k as f64))
            .sum();
        assert!((s1.time.params_s - want).abs() < 1e-9 * want);
        // Stage 3: each copy of another rank's unit (forward and backward, at most twice), as
        // the GPU streams it: fp32 or the bf16 plane.
        let b3 = at(3, true);
        for (q, elem) in [(&s3, 4.0), (&b3, 2.0)] {
            let moved = q.time.params_bytes as f64 / elem;
            assert!(moved > 0.5 * p && moved < 2.0 * p, "{moved} vs {p}");
            assert!(q.time.params_s > 0.0);
        }
        assert!((b3.time.params_bytes as f64 / s3.time.params_bytes as f64 - 0.5).abs() < 1e-9);
        // The gathers hold up the host thread: with a faster host the step is not longer.
        let fast = Hardware {
            host_sum_gbps: 1e6,
            ..node.clone()
        };
        let mut r = ranks(4, 1, 4 * 4096);
        r.data_parallel.zero_stage = 3;
        assert!(plan(&m, &fast, &r).time.step_s <= s3.time.step_s);
    }

    /// Stage 3 with the GPUs gathering: the rank planned copies only the units it holds across
    /// its link (the others come by NCCL's broadcast at NVLink's rate, on the weight stream), so
    /// its host→device time falls by about its share of the units; the same bytes arrive, and
    /// without NVLink the broadcast runs at the PCIe link's rate.
    #[test]
    fn gpus_gathering_copy_only_their_units_across_the_link() {
        let node = presets::machine("h200-1.5tb").unwrap();
        let m = presets::model("llama-3.1-8b").unwrap();
        let at = |gpu_gather: bool, hw: &Hardware| {
            let mut r = ranks(4, 1, 4 * 4096);
            r.data_parallel.zero_stage = 3;
            r.data_parallel.gpu_gather = gpu_gather;
            plan(&m, hw, &r)
        };
        let (host, gpus) = (at(false, &node), at(true, &node));
        assert!(gpus.data_parallel.as_ref().unwrap().gpu_gather);
        assert!(!host.data_parallel.as_ref().unwrap().gpu_gather);
        assert_eq!(gpus.time.params_bytes, host.time.params_bytes);
        // The fullest of 4 ranks holds about a quarter of the units: under half of the link's
        // copies are left (the broadcasts are on the same stream, but at NVLink's rate).
        assert!(
            gpus.time.htod_s < 0.6 * host.time.htod_s,
            "{:?} vs {:?}",
            gpus.time,
            host.time
        );
        let dp = DataParallel {
            zero_stage: 3,
            gpu_gather: true,
            ..DataParallel::new(4, 1)
        };
        let b = 4.0 * 1e9;
        assert!((dp.gpu_broadcast_s(&node, b) - b / 350e9).abs() < 1e-12);
        let pcie = Hardware {
            nvlink_gbps: None,
            ..node.clone()
        };
        assert!((dp.gpu_broadcast_s(&pcie, b) - b / 55e9).abs() < 1e-12);
        assert!(at(true, &pcie).time.params_s > gpus.time.params_s);
        // Across machines each receives the bytes once through its network.
        let two = DataParallel { nodes: 2, ..dp };
        let slow_net = Hardware {
            nic_gbps: Some(10.0),
            ..node.clone()
        };
        assert!((two.gpu_broadcast_s(&slow_net, b) - b / 10e9).abs() < 1e-12);
    }

    fn s1_units(m: &ModelConfig) -> Vec<usize> {
        crate::store::layout::StateLayout::new(m, Mode::Exact)
            .units
            .iter()
            .map(|u| u.numel)
            .collect()
    }

    /// Sharding is offered first where it fits, then fewer GPUs per machine: Llama-3.1-70B's
    /// 1 TiB of host state fits an H200 machine once, not 8 times.
    #[test]
    fn fewer_gpus_is_suggested_when_only_that_fits() {
        let node = presets::machine("h200-1.5tb").unwrap();
        let m = presets::model("llama-3.1-70b").unwrap();
        let job = ranks(8, 1, 8 * 4096);
        let p = plan(&m, &node, &job);
        assert!(!p.fits);
        // Sharded over 8 ranks, exact mode fits (16 B/param / 8 each, gradients included).
        assert_eq!(p.suggestion.as_deref(), Some("--zero-stage 3"));
        assert_eq!(fewer_gpus(&m, &node, &job).as_deref(), Some("--gpus 1"));
        assert!(plan(&m, &node, &ranks(1, 1, 8 * 4096)).fits);
        // Llama-3.1-8B fits 8 times.
        let small = presets::model("llama-3.1-8b").unwrap();
        assert!(plan(&small, &node, &ranks(8, 1, 8 * 4096)).fits);
        // Gemma-3-27B's 432 GB fits 3 times (not 4): 3 ranks need whole sequences each, so the
        // job's 32,768 tokens become 24,576 — and the flags, applied, fit.
        let gemma = presets::model("gemma-3-27b").unwrap();
        let job = ranks(8, 1, 8 * 4096);
        assert_eq!(
            fewer_gpus(&gemma, &node, &job).as_deref(),
            Some("--gpus 3 --tokens-per-step 24576")
        );
        let applied = ranks(3, 1, 24576);
        applied.validate().unwrap();
        assert!(plan(&gemma, &node, &applied).fits);
        assert!(!plan(&gemma, &node, &ranks(4, 1, 4 * 4096)).fits);
    }

    /// The job is checked against the machine and its tokens against its ranks, each flag named.
    #[test]
    fn data_parallel_requests_are_checked() {
        let node = presets::machine("h200-1.5tb").unwrap();
        let err = |r: crate::Result<()>| r.unwrap_err().to_string();
        let e = err(DataParallel::new(9, 1).check(&node));
        assert!(e.contains("--gpus 9") && e.contains("8 GPU(s)"), "{e}");
        let e = err(DataParallel::new(0, 1).check(&node));
        assert!(e.contains("at least one GPU"), "{e}");
        let no_net = Hardware {
            nic_gbps: None,
            ..node.clone()
        };
        let e = err(DataParallel::new(1, 2).check(&no_net));
        assert!(e.contains("--nodes 2") && e.contains("--nic-gbps"), "{e}");
        DataParallel::new(8, 2).check(&node).unwrap();
        // 3 ranks of 4096-token sequences: 16384 tokens are not whole sequences for each.
        let e = err(ranks(3, 1, 16384).validate());
        assert!(
            e.contains("for each of the 3 ranks") && e.contains("12288 or 24576"),
            "{e}"
        );
        let e = err(ranks(8, 4, 4096).validate());
        assert!(
            e.contains("one sequence for each of the 32 ranks (131072)"),
            "{e}"
        );
        let e = err(DataParallel::new(8, u64::MAX).check(&node));
        assert!(e.contains("--nodes") && e.contains("at most"), "{e}");
        // The default step: 65,536 tokens rounded up to whole sequences for each rank.
        assert_eq!(PlanRequest::default_tokens_per_step(4096, 1), 65536);
        assert_eq!(PlanRequest::default_tokens_per_step(4096, 3), 73728);
        assert_eq!(PlanRequest::default_tokens_per_step(4096, 32), 131072);
        for n in 1..=64 {
            let t = PlanRequest::default_tokens_per_step(4096, n);
            ranks(n, 1, t).validate().unwrap();
        }
        // A micro-batch is a rank's: at most its share.
        let e = err(PlanRequest {
            micro_batch_tokens: Some(16384),
            ..ranks(2, 1, 16384)
        }
        .validate());
        assert!(e.contains("a rank's share of the step, 8192"), "{e}");
    }
}
