//! Placement of the host state on NUMA nodes: a pure function of the machine description, the
//! state layout, the GPU and a RAM budget.
//!
//! Rules (DESIGN.md §1): what the GPU streams every step — the params it computes with (fp32, or
//! the bf16 shadow in bf16 mode) and, in exact mode, the gradients it writes back — goes on the
//! GPU-local node(s) first, then on the nodes nearest to them. Adam m/v (and the fp32 params when
//! only the shadow is streamed) are spread over all nodes in proportion to their CPUs, keeping one
//! unit's optimizer state on one node so that node's worker threads update it locally.

use super::layout::{Mode, ShardKind, StateLayout};
use crate::topology::{Machine, MemoryKind};
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

/// What one NUMA node holds and who works there.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct NodePlan {
    /// OS index.
    pub node: u32,
    /// Bytes the budget allows on this node.
    pub capacity: u64,
    /// Bytes placed on this node.
    pub bytes: u64,
    /// CPUs of the AdamW workers for the optimizer state on this node (empty: none placed).
    pub adam_cpus: Vec<usize>,
}

/// The placement.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Placement {
    /// Per node, in OS index order.
    pub nodes: Vec<NodePlan>,
    /// `shard_node[unit][kind.index()]`: the node holding that shard, `None` if the kind is absent.
    pub shard_node: Vec<[Option<u32>; 5]>,
    /// Node of the lean-mode gradient buffers (GPU-local), if any.
    pub lean_buffers_node: Option<u32>,
    /// Node order for streamed data: GPU-local first, then by distance.
    pub stream_order: Vec<u32>,
}

impl Placement {
    /// The node holding `unit`'s `kind` shard.
    pub fn node_of(&self, unit: usize, kind: ShardKind) -> Option<u32> {
        self.shard_node.get(unit)?[kind.index()]
    }

    /// The node whose workers update `unit` (where its Adam moments live).
    pub fn worker_node(&self, unit: usize) -> Option<u32> {
        self.node_of(unit, ShardKind::AdamM)
    }
}

fn streamed_kinds(layout: &StateLayout) -> Vec<ShardKind> {
    let mut k = vec![if layout.bf16_shadow {
        ShardKind::Bf16Shadow
    } else {
        ShardKind::Params
    }];
    if layout.mode == Mode::Exact {
        k.push(ShardKind::Grads);
    }
    k
}

fn optimizer_kinds(layout: &StateLayout) -> Vec<ShardKind> {
    let mut k = vec![ShardKind::AdamM, ShardKind::AdamV];
    if layout.bf16_shadow {
        k.push(ShardKind::Params);
    }
    k
}

/// Place `layout` on `machine`. `gpu` is the index into `machine.gpus` the run uses, if any.
pub fn place(
    machine: &Machine,
    layout: &StateLayout,
    gpu: Option<usize>,
    budget: RamBudget,
) -> Result<Placement> {
    let hosts: Vec<&crate::topology::NumaNode> = machine
        .numa_nodes
        .iter()
        .filter(|n| matches!(n.kind, MemoryKind::Dram | MemoryKind::Hbm) && n.hardware_threads > 0)
        .collect();
    if hosts.is_empty() {
        return Err(Error::bad_input(
            "machine description",
            "NUMA nodes",
            "no NUMA node with CPUs and memory",
            None,
        ));
    }
    let gpu_local: Vec<u32> = match gpu {
        Some(i) => {
            let g = machine.gpus.get(i).ok_or_else(|| {
                Error::bad_input(
                    "GPU index",
                    i.to_string(),
                    format!("the machine has {} GPU(s)", machine.gpus.len()),
                    Some("pick one listed by `megatrain probe`"),
                )
            })?;
            g.numa_nodes.clone()
        }
        None => Vec::new(),
    };
    let distance = |n: u32| -> u64 {
        let d = machine.numa_distances.as_ref();
        gpu_local
            .iter()
            .filter_map(|&l| d.and_then(|d| d.between(l, n)))
            .min()
            .unwrap_or(if gpu_local.contains(&n) { 10 } else { 100 })
    };
    let mut stream_order: Vec<u32> = hosts.iter().map(|n| n.os_index).collect();
    stream_order.sort_by_key(|&n| (!gpu_local.contains(&n), distance(n), n));

    // Capacity per node.
    let avail: Vec<u64> = hosts
        .iter()
        .map(|n| (n.free_bytes.unwrap_or(n.memory_bytes) as f64 * budget.fraction) as u64)
        .collect();
    let sum: u64 = avail.iter().sum();
    let scale = match budget.total_bytes {
        Some(t) if t < sum => t as f64 / sum as f64,
        _ => 1.0,
    };
    let mut nodes: Vec<NodePlan> = hosts
        .iter()
        .zip(&avail)
        .map(|(n, a)| NodePlan {
            node: n.os_index,
            capacity: (*a as f64 * scale) as u64,
            bytes: 0,
            adam_cpus: Vec::new(),
        })
        .collect();
    let capacity: u64 = nodes.iter().map(|n| n.capacity).sum();
    let need = layout.total_bytes();
    if need > capacity {
        return Err(not_enough_ram(layout, need, capacity));
    }

    let idx = |nodes: &[NodePlan], os: u32| nodes.iter().position(|n| n.node == os);
    let mut shard_node = vec![[None; 5]; layout.units.len()];
    let mut lean_buffers_node = None;
    let lean = layout.lean_grad_buffer_bytes();
    // Streamed data first, in stream order, first fit.
    let place_first_fit = |nodes: &mut Vec<NodePlan>, bytes: u64| -> Option<u32> {
        for &os in &stream_order {
            let i = idx(nodes, os)?;
            if nodes[i].bytes + bytes <= nodes[i].capacity {
                nodes[i].bytes += bytes;
                return Some(os);
            }
        }
        None
    };
    if lean > 0 {
        lean_buffers_node = Some(
            place_first_fit(&mut nodes, lean)
                .ok_or_else(|| not_enough_ram(layout, need, capacity))?,
        );
    }
    for (u, unit) in layout.units.iter().enumerate() {
        for k in streamed_kinds(layout) {
            let bytes = unit.shard_bytes(k) as u64;
            let node = place_first_fit(&mut nodes, bytes)
                .ok_or_else(|| not_enough_ram(layout, need, capacity))?;
            shard_node[u][k.index()] = Some(node);
        }
    }
    // Optimizer state: one unit's kinds together, on the node whose workers have the least
    // optimizer work per CPU so far (AdamW is bandwidth-bound: spreading it over every socket's
    // memory controllers is what makes it fast), among the nodes where it still fits.
    let threads: Vec<u64> = hosts
        .iter()
        .map(|n| n.hardware_threads.max(1) as u64)
        .collect();
    let mut opt_bytes = vec![0u64; nodes.len()];
    for (u, unit) in layout.units.iter().enumerate() {
        let kinds = optimizer_kinds(layout);
        let bytes: u64 = kinds.iter().map(|k| unit.shard_bytes(*k) as u64).sum();
        let best = (0..nodes.len())
            .filter(|&i| nodes[i].bytes + bytes <= nodes[i].capacity)
            .min_by(|&a, &b| {
                // Compare (opt_bytes + bytes) / threads across nodes without floats.
                let ka = u128::from(opt_bytes[a] + bytes) * u128::from(threads[b]);
                let kb = u128::from(opt_bytes[b] + bytes) * u128::from(threads[a]);
                ka.cmp(&kb).then(nodes[a].node.cmp(&nodes[b].node))
            })
            .ok_or_else(|| not_enough_ram(layout, need, capacity))?;
        nodes[best].bytes += bytes;
        opt_bytes[best] += bytes;
        for k in kinds {
            shard_node[u][k.index()] = Some(nodes[best].node);
        }
    }
    for n in &mut nodes {
        let holds_optimizer = shard_node
            .iter()
            .any(|s| s[ShardKind::AdamM.index()] == Some(n.node));
        if holds_optimizer {
            let cpus = machine
                .numa_node(n.node)
                .map(|x| x.cpus.clone())
                .unwrap_or_default();
            n.adam_cpus = crate::host::affinity::parse_cpu_list(&cpus)?;
        }
    }
    Ok(Placement {
        nodes,
        shard_node,
        lean_buffers_node,
        stream_order,
    })
}

fn not_enough_ram(layout: &StateLayout, need: u64, capacity: u64) -> Error {
    let grads = layout.kind_bytes(ShardKind::Grads);
    let mv = layout.kind_bytes(ShardKind::AdamM) + layout.kind_bytes(ShardKind::AdamV);
    let lean_extra = {
        let mut l = layout.clone();
        l.mode = Mode::Lean;
        l.lean_grad_buffer_bytes()
    };
    let mut options = Vec::new();
    let mut consider = |what: &str, bytes: u64| {
        let verdict = if bytes <= capacity {
            "fits"
        } else {
            "still short"
        };
        options.push(format!("{what}: {} ({verdict})", human_bytes(bytes)));
    };
    if layout.mode == Mode::Exact {
        consider("--mode lean", need - grads + lean_extra);
    }
    consider("spill Adam m/v to NVMe", need - mv);
    if layout.mode == Mode::Exact {
        consider("--mode lean and spill m/v", need - grads + lean_extra - mv);
    }
    Error::bad_input(
        "host memory",
        format!(
            "{} params, {:.1} B/param",
            layout.num_params(),
            layout.bytes_per_param()
        ),
        format!(
            "the state needs {} but the RAM budget is {}: {} missing",
            human_bytes(need),
            human_bytes(capacity),
            human_bytes(need - capacity)
        ),
        Some(&options.join("; ")),
    )
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::model::config::ModelConfig;
    use crate::topology::{probe, TopologySource};

    fn tiny(layers: usize) -> ModelConfig {
        let json = format!(
            r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":256,"intermediate_size":512,
            "num_hidden_layers":{layers},"num_attention_heads":4,"vocab_size":1000}}"#
        );
        ModelConfig::from_json_str(&json, "t").unwrap()
    }

    fn synthetic(desc: &str, gib_per_node: u64) -> Machine {
        let mut m = probe(&TopologySource::Synthetic(desc.into())).unwrap();
        for n in &mut m.numa_nodes {
            n.memory_bytes = gib_per_node << 30;
        }
        m
    }

    #[test]
    fn every_shard_is_placed_and_capacity_respected() {
        let m = synthetic("pack:2 numa:2 core:4 pu:1", 1);
        let l = StateLayout::new(&tiny(8), Mode::Exact, false);
        let p = place(&m, &l, None, RamBudget::default()).unwrap();
        for (u, s) in p.shard_node.iter().enumerate() {
            for k in l.kinds() {
                assert!(s[k.index()].is_some(), "unit {u} {k:?}");
            }
            assert!(s[ShardKind::Bf16Shadow.index()].is_none());
        }
        let placed: u64 = p.nodes.iter().map(|n| n.bytes).sum();
        assert_eq!(placed, l.total_bytes());
        assert!(p.nodes.iter().all(|n| n.bytes <= n.capacity));
        // m/v spread: more than one node hosts optimizer state, each with its node's CPUs.
        let with_workers: Vec<_> = p.nodes.iter().filter(|n| !n.adam_cpus.is_empty()).collect();
        assert!(with_workers.len() > 1);
        assert!(with_workers.iter().all(|n| n.adam_cpus.len() == 4));
    }

    #[test]
    fn budget_too_small_names_the_missing_bytes_and_options() {
        let m = synthetic("pack:1 numa:1 core:2 pu:1", 1);
        let l = StateLayout::new(&tiny(8), Mode::Exact, false);
        let budget = RamBudget {
            fraction: 1.0,
            total_bytes: Some(l.total_bytes() * 3 / 4),
        };
        let msg = place(&m, &l, None, budget).unwrap_err().to_string();
        assert!(msg.contains("missing"), "{msg}");
        assert!(msg.contains("--mode lean"), "{msg}");
        assert!(msg.contains("spill Adam m/v to NVMe"), "{msg}");
        assert!(msg.contains("fits"), "{msg}");
    }

    #[test]
    fn unknown_gpu_index_is_an_error() {
        let m = synthetic("pack:1 numa:1 core:2 pu:1", 1);
        let l = StateLayout::new(&tiny(2), Mode::Lean, false);
        let e = place(&m, &l, Some(3), RamBudget::default()).unwrap_err();
        assert!(e.to_string().contains("0 GPU"), "{e}");
    }
}
