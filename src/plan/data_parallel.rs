//! Data parallel in the plan (`plan --gpus G --nodes M`): N = G·M ranks, one per GPU, as the
//! trainer runs them (`mpirun -np N megatrain train …`, [`crate::dist`]). Every rank holds the
//! whole host state (it is replicated, not sharded), streams the whole model over its own link
//! and trains 1/N of the step's sequences; a node's G ranks share its RAM, its AdamW bandwidth
//! and its NVMe. Each unit's fp32 gradients are summed across the ranks in host memory on the
//! rank's host thread ([`crate::engine::schedule::Op::Reduce`]): a reduce-scatter then an
//! all-gather, so each rank moves 2(N−1)/N of the unit's bytes, at the bus bandwidth a node's
//! ranks reach in host memory (`bench collective`), and across nodes a node's network carries
//! its G ranks' share of the traffic that leaves it.

use super::Hardware;
use serde::Serialize;

/// The most machines a plan spreads over.
pub const MAX_NODES: u64 = 1 << 16;

/// How many GPUs and machines a plan spreads over.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub struct DataParallel {
    /// GPUs (ranks) per machine.
    pub gpus: u64,
    /// Machines.
    pub nodes: u64,
}

impl Default for DataParallel {
    fn default() -> Self {
        DataParallel { gpus: 1, nodes: 1 }
    }
}

impl DataParallel {
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
    /// Host bytes one rank holds (its whole host state and host activations).
    pub host_bytes_per_rank: u64,
    /// Host bytes of one machine: its ranks' together.
    pub host_bytes_per_node: u64,
    /// A machine's RAM.
    pub node_ram_bytes: u64,
    /// fp32 gradient bytes each rank sums per step.
    pub sum_bytes_per_step: u64,
    /// Bus GB/s of the sum in host memory within a machine.
    pub host_sum_gbps: f64,
    /// A machine's network GB/s, when several machines are planned.
    pub nic_gbps: Option<f64>,
    /// Tokens per second of the whole job.
    pub job_tokens_per_s: f64,
}
