//! The RAM budget: how much each host node offers the state — a share of what the OS can give
//! there (available memory, within the cgroup's room), lowered or raised by `--ram-budget` up to
//! the nodes' RAM.

use super::NodePlan;
use crate::topology::NumaNode;
use crate::util::human_bytes;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

/// How much of the machine's RAM the state may use.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RamBudget {
    /// Fraction of each node's available memory (free on the live machine, total otherwise).
    pub fraction: f64,
    /// Optional cap on the total, spread over nodes in proportion to their share.
    pub total_bytes: Option<u64>,
}

impl Default for RamBudget {
    fn default() -> Self {
        RamBudget {
            fraction: 0.9,
            total_bytes: None,
        }
    }
}

/// Each host node with its share of `budget`, nothing placed yet. By default a node offers
/// `fraction` of what the OS can give there (its available memory: free plus reclaimable page
/// cache; its size on a recorded topology), the sum held under `fraction` of the room the
/// process's cgroup leaves. A `total_bytes` budget below that scales every node down; above it,
/// it raises them (a VM whose RAM grows on use, memory a cache will give back) up to the RAM
/// each node holds — but never past the machine's RAM or the cgroup's limit, which are errors.
pub(super) fn node_capacities(
    hosts: &[&NumaNode],
    budget: RamBudget,
    cgroup: Option<&crate::topology::CgroupMemory>,
) -> Result<Vec<NodePlan>> {
    let avail: Vec<f64> = hosts
        .iter()
        .map(|n| {
            n.available_bytes
                .or(n.free_bytes)
                .unwrap_or(n.memory_bytes)
                .min(n.memory_bytes) as f64
                * budget.fraction
        })
        .collect();
    let mut sum: f64 = avail.iter().sum();
    let mut default = avail.clone();
    if let Some(c) = cgroup {
        let room = c.room_bytes() as f64 * budget.fraction;
        if sum > room && sum > 0.0 {
            default.iter_mut().for_each(|a| *a *= room / sum);
            sum = room;
        }
    }
    let physical: u64 = hosts.iter().map(|n| n.memory_bytes).sum();
    let caps: Vec<f64> = match budget.total_bytes {
        None => default,
        Some(t) if (t as f64) <= sum => {
            let scale = if sum > 0.0 { t as f64 / sum } else { 0.0 };
            default.iter().map(|a| a * scale).collect()
        }
        Some(t) => {
            if t > physical {
                return Err(Error::bad_input(
                    "--ram-budget",
                    human_bytes(t),
                    format!("more than the {} of RAM this machine's NUMA nodes hold", human_bytes(physical)),
                    Some("a budget raises the default (90% of what the OS has available) up to the machine's RAM, not beyond it; spill Adam moments to NVMe (--nvme DIR) for more"),
                ));
            }
            if let Some(c) = cgroup.filter(|c| t > c.limit_bytes) {
                return Err(Error::bad_input(
                    "--ram-budget",
                    human_bytes(t),
                    format!(
                        "more than the memory limit {} of cgroup {} (the kernel would kill the run)",
                        human_bytes(c.limit_bytes),
                        c.path
                    ),
                    Some("raise the job's or container's memory limit, or lower --ram-budget"),
                ));
            }
            // Raise each node towards its RAM, in proportion to the headroom it has.
            let head: Vec<f64> = hosts
                .iter()
                .zip(&default)
                .map(|(n, a)| (n.memory_bytes as f64 - a).max(0.0))
                .collect();
            let total_head: f64 = head.iter().sum();
            let extra = t as f64 - sum;
            default
                .iter()
                .zip(&head)
                .map(|(a, h)| {
                    if total_head > 0.0 {
                        a + extra * h / total_head
                    } else {
                        *a
                    }
                })
                .collect()
        }
    };
    Ok(hosts
        .iter()
        .zip(&caps)
        .map(|(n, c)| NodePlan {
            node: n.os_index,
            capacity: (*c as u64).min(n.memory_bytes),
            bytes: 0,
            adam_cpus: Vec::new(),
        })
        .collect())
}
