//! Placement of the host state on NUMA nodes: a pure function of the machine description, the
//! state layout, the GPU and a RAM budget.
//!
//! Rules (DESIGN.md §1): what the GPU streams every step — the params it computes with and, in
//! exact mode, the gradients it writes back — goes on the GPU-local node(s) first, then on the
//! nodes nearest to them. Adam m/v are spread over all nodes in proportion to their CPUs, keeping
//! one unit's optimizer state on one node so that node's worker threads update it locally.

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
    pub shard_node: Vec<[Option<u32>; ShardKind::COUNT]>,
    /// Node of the lean-mode gradient buffers (GPU-local), if any.
    pub lean_buffers_node: Option<u32>,
    /// Node order for streamed data: GPU-local first, then by distance.
    pub stream_order: Vec<u32>,
    /// What lives on NVMe instead of RAM, if anything.
    pub spill: Option<SpillPlan>,
}

/// The NVMe part of a placement: which units' optimizer state spills, and its RAM staging.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct SpillPlan {
    /// Units whose `kinds` live on NVMe.
    pub units: Vec<usize>,
    /// Spilled kinds (Adam m and v).
    pub kinds: Vec<ShardKind>,
    /// Node of the staging slots; the spilled units' AdamW workers run there.
    pub node: u32,
    /// Staging slots.
    pub slots: usize,
    /// Bytes per slot (the largest spilled unit's m+v).
    pub slot_bytes: u64,
    /// Bytes on NVMe (one copy; the files hold two slots per extent).
    pub nvme_bytes: u64,
}

/// When optimizer state may go to NVMe.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum SpillPolicy {
    /// Never: a state that does not fit in RAM is an error.
    #[default]
    Never,
    /// Spill as few units' m/v as needed to fit the RAM budget.
    Auto,
    /// Spill every unit's m/v.
    All,
}

/// The spill part of a placement request.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub struct SpillRequest {
    /// When to spill.
    pub policy: SpillPolicy,
    /// Staging slots (at least 1; 3 overlaps read, update and write-back).
    pub slots: usize,
}

impl Default for SpillRequest {
    fn default() -> Self {
        SpillRequest {
            policy: SpillPolicy::Never,
            slots: 3,
        }
    }
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
    let mut k = vec![ShardKind::Params];
    if layout.mode == Mode::Exact {
        k.push(ShardKind::Grads);
    }
    k
}

fn optimizer_kinds(layout: &StateLayout) -> Vec<ShardKind> {
    let _ = layout;
    vec![ShardKind::AdamM, ShardKind::AdamV]
}

/// Place `layout` on `machine` with everything in RAM. `gpu` is the index into `machine.gpus`
/// the run uses, if any.
pub fn place(
    machine: &Machine,
    layout: &StateLayout,
    gpu: Option<usize>,
    budget: RamBudget,
) -> Result<Placement> {
    place_with_spill(machine, layout, gpu, budget, SpillRequest::default())
}

/// The units whose m/v spill under `req` given `capacity` bytes of RAM, and the staging bytes
/// that costs (`None`: nothing spills). The planner (`megatrain plan`) uses the same choice. Blocks spill first, from the last layer down (the first to be updated in a step,
/// so their reads start earliest), then the head and the embedding.
pub fn choose_spill(
    layout: &StateLayout,
    req: SpillRequest,
    capacity: u64,
) -> Option<(Vec<usize>, u64)> {
    let mv = |u: usize| (layout.units[u].shard_bytes() + layout.units[u].shard_bytes()) as u64;
    let need = layout.total_bytes();
    let order = spill_order(layout);
    let slots = req.slots.max(1) as u64;
    match req.policy {
        SpillPolicy::Never => None,
        SpillPolicy::All => {
            let staging = staging_bytes(layout, &order, req.slots);
            Some((order, staging))
        }
        SpillPolicy::Auto => {
            if need <= capacity {
                return None;
            }
            let (mut chosen, mut freed, mut biggest) = (Vec::new(), 0u64, 0u64);
            for u in order {
                chosen.push(u);
                freed += mv(u);
                biggest = biggest.max(mv(u));
                if need - freed + slots * biggest <= capacity {
                    return Some((chosen, slots * biggest));
                }
            }
            // Even spilling everything does not fit: report the full spill (the caller errors).
            Some((chosen, slots * biggest))
        }
    }
}

/// The order units spill in: blocks from the last layer down (the first to be updated in a
/// step, so their reads start earliest), then the head and the embedding.
fn spill_order(layout: &StateLayout) -> Vec<usize> {
    let n = layout.units.len();
    let mut order: Vec<usize> = (1..n.saturating_sub(1)).rev().collect();
    order.extend([n - 1, 0].into_iter().filter(|&u| u < n));
    order.dedup();
    order
}

/// RAM staging for spilling `units`: `slots` slots of the largest one's m+v.
fn staging_bytes(layout: &StateLayout, units: &[usize], slots: usize) -> u64 {
    slots.max(1) as u64
        * units
            .iter()
            .map(|&u| (layout.units[u].shard_bytes() + layout.units[u].shard_bytes()) as u64)
            .max()
            .unwrap_or(0)
}

/// Place `layout` on `machine`, spilling Adam m/v to NVMe as `spill` allows. When it does not
/// fit, the error lists the changes that would fit, each checked by placing again with it.
pub fn place_with_spill(
    machine: &Machine,
    layout: &StateLayout,
    gpu: Option<usize>,
    budget: RamBudget,
    spill: SpillRequest,
) -> Result<Placement> {
    place_advised(machine, layout, gpu, budget, spill, true)
}

/// Whether `layout` places under `budget` and `spill` (no advice is computed).
pub fn fits(
    machine: &Machine,
    layout: &StateLayout,
    gpu: Option<usize>,
    budget: RamBudget,
    spill: SpillRequest,
) -> bool {
    place_inner(machine, layout, gpu, budget, spill).is_ok()
}

/// [`place_with_spill`], with `lean_ok = false` when lean mode is not an option (gradient
/// accumulation needs exact mode), so the advice never suggests it.
pub fn place_advised(
    machine: &Machine,
    layout: &StateLayout,
    gpu: Option<usize>,
    budget: RamBudget,
    spill: SpillRequest,
    lean_ok: bool,
) -> Result<Placement> {
    place_inner(machine, layout, gpu, budget, spill).map_err(|shortage| match shortage {
        Shortage::Other(e) => e,
        Shortage::Ram { need, capacity } => {
            let fixes = fixes(machine, layout, gpu, budget, spill, lean_ok);
            not_enough_ram(layout, need, capacity, &fixes)
        }
    })
}

/// A change to the request that makes the state fit, as the flags that say it.
#[derive(Debug, Clone, PartialEq)]
pub struct Fix {
    /// The flags, e.g. `--mode lean --nvme DIR`.
    pub flags: String,
    /// The mode with the fix.
    pub mode: Mode,
    /// The spill policy with the fix.
    pub spill: SpillPolicy,
    /// The RAM budget with the fix (`None`: unchanged).
    pub ram_budget: Option<u64>,
}

/// The changes (mode, spilling, RAM budget) under which `layout` fits, smallest first; each
/// one is checked by placing with it. With `--nvme` given (`spill.policy` is not `Never`),
/// spilling is not suggested again; `--spill all` never is (auto already spills as much as
/// needed).
pub fn fixes(
    machine: &Machine,
    layout: &StateLayout,
    gpu: Option<usize>,
    budget: RamBudget,
    spill: SpillRequest,
    lean_ok: bool,
) -> Vec<Fix> {
    let mut candidates: Vec<(String, Mode, SpillPolicy)> = Vec::new();
    let exact = layout.mode == Mode::Exact;
    let no_spill = spill.policy == SpillPolicy::Never;
    if exact && lean_ok {
        candidates.push(("--mode lean".into(), Mode::Lean, spill.policy));
    }
    if no_spill {
        candidates.push(("--nvme DIR".into(), layout.mode, SpillPolicy::Auto));
        if exact && lean_ok {
            candidates.push((
                "--mode lean --nvme DIR".into(),
                Mode::Lean,
                SpillPolicy::Auto,
            ));
        }
    }
    let mut out = Vec::new();
    let lean_layout = (exact && lean_ok).then(|| {
        let mut l = layout.clone();
        l.mode = Mode::Lean;
        l
    });
    let try_fit = |mode: Mode, policy: SpillPolicy, b: RamBudget| {
        let l = match (&lean_layout, mode == layout.mode) {
            (Some(lean), false) => lean,
            _ => layout,
        };
        place_inner(machine, l, gpu, b, SpillRequest { policy, ..spill }).is_ok()
    };
    for (flags, mode, policy) in candidates {
        if try_fit(mode, policy, budget) {
            out.push(Fix {
                flags,
                mode,
                spill: policy,
                ram_budget: None,
            });
        }
    }
    // A --ram-budget below what the machine has: the smallest budget that fits, if one does.
    if let Some(cap) = budget.total_bytes {
        let roomy = RamBudget {
            total_bytes: None,
            ..budget
        };
        if try_fit(layout.mode, spill.policy, roomy) {
            let (mut lo, mut hi) = (cap, u64::MAX / 2);
            if let Ok(p) = place_inner(machine, layout, gpu, roomy, spill) {
                hi = p.nodes.iter().map(|n| n.capacity).sum::<u64>().max(cap);
            }
            // The smallest total budget that places, to 1 MiB or 0.1%.
            while hi - lo > (1 << 20).max(hi / 1000) {
                let mid = lo + (hi - lo) / 2;
                let b = RamBudget {
                    total_bytes: Some(mid),
                    ..budget
                };
                if try_fit(layout.mode, spill.policy, b) {
                    hi = mid;
                } else {
                    lo = mid;
                }
            }
            out.push(Fix {
                flags: format!("--ram-budget {}Mi", hi.div_ceil(1 << 20)),
                mode: layout.mode,
                spill: spill.policy,
                ram_budget: Some(hi.div_ceil(1 << 20) << 20),
            });
        }
    }
    out
}

/// Why a placement failed: short of RAM (the caller adds advice), or anything else.
enum Shortage {
    Ram { need: u64, capacity: u64 },
    Other(Error),
}

impl From<Error> for Shortage {
    fn from(e: Error) -> Self {
        Shortage::Other(e)
    }
}

fn place_inner(
    machine: &Machine,
    layout: &StateLayout,
    gpu: Option<usize>,
    budget: RamBudget,
    spill: SpillRequest,
) -> std::result::Result<Placement, Shortage> {
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
        )
        .into());
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
    let nodes: Vec<NodePlan> = hosts
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
    let first = choose_spill(layout, spill, capacity);
    let Some((chosen, _)) = first.clone().filter(|_| spill.policy == SpillPolicy::Auto) else {
        return place_spilled(
            machine,
            layout,
            &hosts,
            nodes,
            stream_order,
            first,
            spill.slots,
        );
    };
    // Auto: the fewest units (in spill order) whose placement succeeds. The first guess counts
    // bytes over all nodes; per-node packing can need more. Spilling more frees more RAM, so
    // the count is found by doubling then bisection: O(log units) placements.
    let order = spill_order(layout);
    let attempt = |k: usize| {
        let units = order[..k].to_vec();
        let staging = staging_bytes(layout, &units, spill.slots);
        place_spilled(
            machine,
            layout,
            &hosts,
            nodes.clone(),
            stream_order.clone(),
            Some((units, staging)),
            spill.slots,
        )
    };
    let (mut fail, mut step) = (chosen.len(), 1usize);
    match attempt(fail) {
        Err(Shortage::Ram { .. }) if fail < order.len() => {}
        other => return other,
    }
    let mut good = loop {
        let k = (fail + step).min(order.len());
        match attempt(k) {
            Ok(p) => break (k, p),
            Err(Shortage::Ram { .. }) if k < order.len() => {
                fail = k;
                step *= 2;
            }
            Err(e) => return Err(e),
        }
    };
    while good.0 - fail > 1 {
        let mid = fail + (good.0 - fail) / 2;
        match attempt(mid) {
            Ok(p) => good = (mid, p),
            Err(Shortage::Ram { .. }) => fail = mid,
            Err(e) => return Err(e),
        }
    }
    Ok(good.1)
}

/// Place with `spilled` (units whose m/v go to NVMe, and the staging bytes) decided.
fn place_spilled(
    machine: &Machine,
    layout: &StateLayout,
    hosts: &[&crate::topology::NumaNode],
    mut nodes: Vec<NodePlan>,
    stream_order: Vec<u32>,
    spilled: Option<(Vec<usize>, u64)>,
    slots: usize,
) -> std::result::Result<Placement, Shortage> {
    let capacity: u64 = nodes.iter().map(|n| n.capacity).sum();
    let full = layout.total_bytes();
    let spill = SpillRequest {
        policy: SpillPolicy::Never,
        slots,
    };
    let mut spilled_mask = vec![false; layout.units.len()];
    for &u in spilled.iter().flat_map(|(s, _)| s) {
        if let Some(m) = spilled_mask.get_mut(u) {
            *m = true;
        }
    }
    let is_spilled = |u: usize| spilled_mask[u];
    let spilled_bytes: u64 = (0..layout.units.len())
        .filter(|&u| is_spilled(u))
        .map(|u| (layout.units[u].shard_bytes() + layout.units[u].shard_bytes()) as u64)
        .sum();
    let staging = spilled.as_ref().map_or(0, |(_, s)| *s);
    let need = full - spilled_bytes + staging;
    let short = Shortage::Ram {
        need: full,
        capacity,
    };
    if need > capacity {
        return Err(short);
    }

    let idx = |nodes: &[NodePlan], os: u32| nodes.iter().position(|n| n.node == os);
    let mut shard_node = vec![[None; ShardKind::COUNT]; layout.units.len()];
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
        lean_buffers_node = Some(place_first_fit(&mut nodes, lean).ok_or(Shortage::Ram {
            need: full,
            capacity,
        })?);
    }
    for (u, unit) in layout.units.iter().enumerate() {
        for k in streamed_kinds(layout) {
            let bytes = unit.shard_bytes() as u64;
            let node = place_first_fit(&mut nodes, bytes).ok_or(Shortage::Ram {
                need: full,
                capacity,
            })?;
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
    // The staging slots first (they are one block of memory), where the AdamW workers of the
    // spilled units will run.
    let mut spill_plan = None;
    if let Some((units, staging)) = &spilled {
        let best = (0..nodes.len())
            .filter(|&i| nodes[i].bytes + staging <= nodes[i].capacity)
            .max_by_key(|&i| (threads[i], nodes[i].capacity - nodes[i].bytes))
            .ok_or(Shortage::Ram {
                need: full,
                capacity,
            })?;
        nodes[best].bytes += staging;
        opt_bytes[best] += staging;
        let mut sorted = units.clone();
        sorted.sort_unstable();
        spill_plan = Some(SpillPlan {
            units: sorted,
            kinds: vec![ShardKind::AdamM, ShardKind::AdamV],
            node: nodes[best].node,
            slots: spill.slots.max(1),
            slot_bytes: staging / spill.slots.max(1) as u64,
            nvme_bytes: spilled_bytes,
        });
    }
    for (u, unit) in layout.units.iter().enumerate() {
        let kinds: Vec<ShardKind> = optimizer_kinds(layout)
            .into_iter()
            .filter(|k| !(is_spilled(u) && matches!(k, ShardKind::AdamM | ShardKind::AdamV)))
            .collect();
        if let (true, Some(p)) = (is_spilled(u), &spill_plan) {
            for k in [ShardKind::AdamM, ShardKind::AdamV] {
                shard_node[u][k.index()] = Some(p.node);
            }
        }
        if kinds.is_empty() {
            continue;
        }
        let bytes: u64 = kinds.len() as u64 * unit.shard_bytes() as u64;
        let best = (0..nodes.len())
            .filter(|&i| nodes[i].bytes + bytes <= nodes[i].capacity)
            .min_by(|&a, &b| {
                // Compare (opt_bytes + bytes) / threads across nodes without floats.
                let ka = u128::from(opt_bytes[a] + bytes) * u128::from(threads[b]);
                let kb = u128::from(opt_bytes[b] + bytes) * u128::from(threads[a]);
                ka.cmp(&kb).then(nodes[a].node.cmp(&nodes[b].node))
            })
            .ok_or(Shortage::Ram {
                need: full,
                capacity,
            })?;
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
        spill: spill_plan,
    })
}

fn not_enough_ram(layout: &StateLayout, need: u64, capacity: u64, fixes: &[Fix]) -> Error {
    let fix = if fixes.is_empty() {
        format!(
            "no mode or spill setting fits this machine: use one with more RAM (this state needs {}), or a smaller model",
            human_bytes(need)
        )
    } else {
        format!(
            "any of these fits: {}",
            fixes
                .iter()
                .map(|f| f.flags.as_str())
                .collect::<Vec<_>>()
                .join("; ")
        )
    };
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
            human_bytes(need.saturating_sub(capacity))
        ),
        Some(&fix),
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
        let l = StateLayout::new(&tiny(8), Mode::Exact);
        let p = place(&m, &l, None, RamBudget::default()).unwrap();
        for (u, s) in p.shard_node.iter().enumerate() {
            for k in l.kinds() {
                assert!(s[k.index()].is_some(), "unit {u} {k:?}");
            }
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
        let l = StateLayout::new(&tiny(8), Mode::Exact);
        let budget = RamBudget {
            fraction: 1.0,
            total_bytes: Some(l.total_bytes() * 3 / 4),
        };
        let msg = place(&m, &l, None, budget).unwrap_err().to_string();
        assert!(msg.contains("missing"), "{msg}");
        assert!(msg.contains("--mode lean"), "{msg}");
        assert!(msg.contains("--nvme DIR"), "{msg}");
        assert!(msg.contains("--ram-budget"), "{msg}");
        assert!(msg.contains("fits"), "{msg}");
    }

    /// The advice is true: over budgets from far too small to almost enough, both modes, with
    /// and without a spill directory, and with lean allowed or not, every suggested fix is
    /// applied and the state then places; spilling is never suggested when it is already on,
    /// nor lean when it is not allowed.
    #[test]
    fn every_suggested_fix_fits_when_applied() {
        let m = synthetic("pack:1 numa:2 core:2 pu:1", 1);
        let mut suggested = 0;
        for mode in [Mode::Exact, Mode::Lean] {
            let l = StateLayout::new(&tiny(8), mode);
            for policy in [SpillPolicy::Never, SpillPolicy::Auto, SpillPolicy::All] {
                for lean_ok in [true, false] {
                    for pct in [5u64, 20, 40, 55, 70, 85, 95, 99] {
                        let budget = RamBudget {
                            fraction: 1.0,
                            total_bytes: Some(l.total_bytes() * pct / 100),
                        };
                        let req = SpillRequest { policy, slots: 3 };
                        if place_with_spill(&m, &l, None, budget, req).is_ok() {
                            continue;
                        }
                        let err = place_advised(&m, &l, None, budget, req, lean_ok)
                            .unwrap_err()
                            .to_string();
                        let fixes = fixes(&m, &l, None, budget, req, lean_ok);
                        for f in &fixes {
                            assert!(err.contains(&f.flags), "{err} lacks {}", f.flags);
                            assert!(
                                !(policy != SpillPolicy::Never && f.flags.contains("--nvme")),
                                "{f:?} with --nvme already given"
                            );
                            assert!(!(f.mode == Mode::Lean && mode == Mode::Exact && !lean_ok));
                            assert!(!f.flags.contains("--spill all"));
                            let mut fixed = l.clone();
                            fixed.mode = f.mode;
                            let b = RamBudget {
                                total_bytes: f.ram_budget.or(budget.total_bytes),
                                ..budget
                            };
                            let r = SpillRequest {
                                policy: f.spill,
                                slots: 3,
                            };
                            assert!(
                                place_with_spill(&m, &fixed, None, b, r).is_ok(),
                                "{} suggested at {pct}% ({mode:?}, {policy:?}) does not fit",
                                f.flags
                            );
                            suggested += 1;
                        }
                        if fixes.is_empty() {
                            assert!(err.contains("no mode or spill setting fits"), "{err}");
                        }
                    }
                }
            }
        }
        assert!(
            suggested > 20,
            "the sweep exercised the advice ({suggested})"
        );
    }

    #[test]
    fn unknown_gpu_index_is_an_error() {
        let m = synthetic("pack:1 numa:1 core:2 pu:1", 1);
        let l = StateLayout::new(&tiny(2), Mode::Lean);
        let e = place(&m, &l, Some(3), RamBudget::default()).unwrap_err();
        assert!(e.to_string().contains("0 GPU"), "{e}");
    }

    #[test]
    fn spill_auto_moves_only_what_the_budget_lacks_and_all_moves_everything() {
        let m = synthetic("pack:1 numa:2 core:2 pu:1", 1);
        let l = StateLayout::new(&tiny(8), Mode::Exact);
        let mv = |u: usize| (l.units[u].shard_bytes() + l.units[u].shard_bytes()) as u64;
        let total = l.total_bytes();
        // Two blocks' m/v short: with three slots of staging to pay for, five blocks must spill.
        let budget = RamBudget {
            fraction: 1.0,
            total_bytes: Some(total - 2 * mv(1)),
        };
        let req = |policy| SpillRequest { policy, slots: 3 };
        assert!(
            place(&m, &l, None, budget).is_err(),
            "does not fit without spilling"
        );
        let p = place_with_spill(&m, &l, None, budget, req(SpillPolicy::Auto)).unwrap();
        let sp = p.spill.clone().unwrap();
        assert_eq!(
            sp.units,
            vec![4, 5, 6, 7, 8],
            "the last layers first, only what is needed"
        );
        assert_eq!(sp.slot_bytes, mv(8));
        assert_eq!(sp.nvme_bytes, 5 * mv(8));
        let placed: u64 = p.nodes.iter().map(|n| n.bytes).sum();
        assert_eq!(
            placed,
            total - sp.nvme_bytes + 3 * sp.slot_bytes,
            "staging is charged"
        );
        assert!(p.nodes.iter().all(|n| n.bytes <= n.capacity));
        // Spilled units are updated where their staging slots are.
        for &u in &sp.units {
            assert_eq!(p.worker_node(u), Some(sp.node));
        }
        let holds = |n: u32| p.nodes.iter().find(|x| x.node == n).unwrap();
        assert!(!holds(sp.node).adam_cpus.is_empty());
        // Auto with room to spare spills nothing; All spills every unit.
        let roomy = place_with_spill(&m, &l, None, RamBudget::default(), req(SpillPolicy::Auto));
        assert!(roomy.unwrap().spill.is_none());
        let all = place_with_spill(&m, &l, None, RamBudget::default(), req(SpillPolicy::All))
            .unwrap()
            .spill
            .unwrap();
        assert_eq!(all.units, (0..l.units.len()).collect::<Vec<_>>());
        // Not even a full spill fits: the error still names the missing bytes.
        let tiny_budget = RamBudget {
            fraction: 1.0,
            total_bytes: Some(4096),
        };
        let e = place_with_spill(&m, &l, None, tiny_budget, req(SpillPolicy::Auto)).unwrap_err();
        assert!(e.to_string().contains("missing"), "{e}");
    }
}
