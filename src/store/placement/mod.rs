//! Placement of the host state on NUMA nodes: a pure function of the machine description, the
//! state layout, the GPU and a RAM budget.
//!
//! Rules (DESIGN.md §1): what the GPU streams every step — the params it computes with and, in
//! exact mode, the gradients it writes back — goes on the GPU-local node(s) first, then on the
//! nodes nearest to them. Adam m/v are spread over all nodes in proportion to their CPUs, keeping
//! one unit's optimizer state on one node so that node's worker threads update it locally.

use super::layout::{AdamState, Mode, ShardKind, StateLayout};
use crate::topology::{Machine, MemoryKind, NumaNode};
use crate::util::human_bytes;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};

mod budget;
use budget::node_capacities;
pub use budget::RamBudget;

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
    /// Bytes on NVMe (one copy; the files hold two copies per extent).
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

    /// The nodes that hold optimizer state, each with the CPUs of its AdamW workers.
    pub fn adam_nodes(&self) -> Vec<(u32, Vec<usize>)> {
        self.nodes
            .iter()
            .filter(|n| !n.adam_cpus.is_empty())
            .map(|n| (n.node, n.adam_cpus.clone()))
            .collect()
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
    let mv = |u: usize| layout.moment_bytes(u);
    let need = layout.total_bytes();
    // Only moments this process holds can spill (ZeRO stage 1: another rank's are not here).
    let order: Vec<usize> = spill_order(layout)
        .into_iter()
        .filter(|&u| layout.holds_moments(u))
        .collect();
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
            .map(|&u| layout.moment_bytes(u))
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
    /// The Adam state format with the fix.
    pub adam: AdamState,
    /// The spill policy with the fix.
    pub spill: SpillPolicy,
    /// The RAM budget with the fix (`None`: unchanged).
    pub ram_budget: Option<u64>,
}

/// The changes (Adam state format, mode, spilling, RAM budget) under which `layout` fits,
/// smallest first — compact moments (global clipping stays exact), then lean mode, then both,
/// then NVMe (whose disk would bound the step), as `megatrain plan` orders them; each one is
/// checked by placing with it. With `--nvme` given (`spill.policy` is not `Never`), spilling is
/// not suggested again; `--spill all` never is (auto already spills as much as needed).
pub fn fixes(
    machine: &Machine,
    layout: &StateLayout,
    gpu: Option<usize>,
    budget: RamBudget,
    spill: SpillRequest,
    lean_ok: bool,
) -> Vec<Fix> {
    let exact = layout.mode == Mode::Exact;
    let lean = exact && lean_ok;
    let no_spill = spill.policy == SpillPolicy::Never;
    let compact = layout.adam.more_compact();
    let state_flag = |s: AdamState| format!("--adam-state {}", s.name());
    let mut candidates: Vec<(String, Mode, AdamState, SpillPolicy)> = Vec::new();
    for &s in &compact {
        candidates.push((state_flag(s), layout.mode, s, spill.policy));
    }
    if lean {
        candidates.push(("--mode lean".into(), Mode::Lean, layout.adam, spill.policy));
        for &s in &compact {
            let flags = format!("--mode lean {}", state_flag(s));
            candidates.push((flags, Mode::Lean, s, spill.policy));
        }
    }
    if no_spill {
        candidates.push((
            "--nvme DIR".into(),
            layout.mode,
            layout.adam,
            SpillPolicy::Auto,
        ));
        if lean {
            candidates.push((
                "--mode lean --nvme DIR".into(),
                Mode::Lean,
                layout.adam,
                SpillPolicy::Auto,
            ));
        }
    }
    let mut out = Vec::new();
    let try_fit = |mode: Mode, adam: AdamState, policy: SpillPolicy, b: RamBudget| {
        let l = if (mode, adam) == (layout.mode, layout.adam) {
            std::borrow::Cow::Borrowed(layout)
        } else {
            let mut l = layout.clone().with_adam_state(adam);
            l.mode = mode;
            std::borrow::Cow::Owned(l)
        };
        place_inner(machine, &l, gpu, b, SpillRequest { policy, ..spill }).is_ok()
    };
    for (flags, mode, adam, policy) in candidates {
        if try_fit(mode, adam, policy, budget) {
            out.push(Fix {
                flags,
                mode,
                adam,
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
        if try_fit(layout.mode, layout.adam, spill.policy, roomy) {
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
                if try_fit(layout.mode, layout.adam, spill.policy, b) {
                    hi = mid;
                } else {
                    lo = mid;
                }
            }
            out.push(Fix {
                flags: format!("--ram-budget {}Mi", hi.div_ceil(1 << 20)),
                mode: layout.mode,
                adam: layout.adam,
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
    let hosts: Vec<&NumaNode> = machine
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
    let stream_order = stream_order(machine, gpu, &hosts)?;
    let nodes =
        node_capacities(&hosts, budget, machine.memory.cgroup.as_ref()).map_err(Shortage::Other)?;
    let capacity: u64 = nodes.iter().map(|n| n.capacity).sum();
    let first = choose_spill(layout, spill, capacity);
    let place = |spilled: Option<(Vec<usize>, u64)>| {
        let packer = Packer::new(layout, nodes.clone(), stream_order.clone());
        packer.place(machine, &hosts, spilled, spill.slots)
    };
    match first.clone().filter(|_| spill.policy == SpillPolicy::Auto) {
        Some((chosen, _)) => fewest_spilled_units(layout, chosen.len(), spill.slots, place),
        None => place(first),
    }
}

/// The host nodes in the order streamed shards fill them: the GPU's own nodes first, then by
/// NUMA distance from them, then by number.
fn stream_order(
    machine: &Machine,
    gpu: Option<usize>,
    hosts: &[&NumaNode],
) -> std::result::Result<Vec<u32>, Shortage> {
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
    let mut order: Vec<u32> = hosts.iter().map(|n| n.os_index).collect();
    order.sort_by_key(|&n| (!gpu_local.contains(&n), distance(n), n));
    Ok(order)
}

/// Auto spill: the fewest units (in spill order) whose placement succeeds, starting from the
/// `guess` that counted bytes over all nodes (per-node packing can need more). Spilling more
/// frees more RAM, so the count is found by doubling then bisection: O(log units) placements.
fn fewest_spilled_units(
    layout: &StateLayout,
    guess: usize,
    slots: usize,
    place: impl Fn(Option<(Vec<usize>, u64)>) -> std::result::Result<Placement, Shortage>,
) -> std::result::Result<Placement, Shortage> {
    let order = spill_order(layout);
    let attempt = |k: usize| {
        let units = order[..k].to_vec();
        let staging = staging_bytes(layout, &units, slots);
        place(Some((units, staging)))
    };
    let (mut fail, mut step) = (guess, 1usize);
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

/// A placement being packed: the nodes with what they hold so far, and each shard's node.
struct Packer<'a> {
    layout: &'a StateLayout,
    nodes: Vec<NodePlan>,
    stream_order: Vec<u32>,
    shard_node: Vec<[Option<u32>; ShardKind::COUNT]>,
    /// Optimizer bytes per node (in `nodes` order), to spread AdamW's work.
    opt_bytes: Vec<u64>,
}

impl<'a> Packer<'a> {
    fn new(layout: &'a StateLayout, nodes: Vec<NodePlan>, stream_order: Vec<u32>) -> Self {
        Packer {
            layout,
            opt_bytes: vec![0; nodes.len()],
            nodes,
            stream_order,
            shard_node: vec![[None; ShardKind::COUNT]; layout.units.len()],
        }
    }

    /// What a refusal reports: the whole state against the whole budget.
    fn short(&self) -> Shortage {
        Shortage::Ram {
            need: self.layout.total_bytes(),
            capacity: self.nodes.iter().map(|n| n.capacity).sum(),
        }
    }

    /// Place with `spilled` (units whose m/v go to NVMe, and the staging bytes) decided:
    /// streamed data first, then the staging slots, then the optimizer state.
    fn place(
        mut self,
        machine: &Machine,
        hosts: &[&NumaNode],
        spilled: Option<(Vec<usize>, u64)>,
        slots: usize,
    ) -> std::result::Result<Placement, Shortage> {
        let layout = self.layout;
        let mut is_spilled = vec![false; layout.units.len()];
        for &u in spilled.iter().flat_map(|(s, _)| s) {
            if let Some(m) = is_spilled.get_mut(u) {
                *m = true;
            }
        }
        let spilled_bytes: u64 = (0..layout.units.len())
            .filter(|&u| is_spilled[u])
            .map(|u| layout.moment_bytes(u))
            .sum();
        let staging = spilled.as_ref().map_or(0, |(_, s)| *s);
        let capacity: u64 = self.nodes.iter().map(|n| n.capacity).sum();
        if layout.total_bytes() - spilled_bytes + staging > capacity {
            return Err(self.short());
        }
        let lean_buffers_node = self.place_streamed()?;
        // AdamW is bandwidth-bound: its work is spread by memory per hardware thread.
        let threads: Vec<u64> = hosts
            .iter()
            .map(|n| n.hardware_threads.max(1) as u64)
            .collect();
        let spill = match &spilled {
            Some((units, staging)) => {
                Some(self.place_staging(units, *staging, slots, spilled_bytes, &threads)?)
            }
            None => None,
        };
        self.place_optimizer(&is_spilled, spill.as_ref(), &threads)?;
        self.assign_adam_cpus(machine)?;
        Ok(Placement {
            nodes: self.nodes,
            shard_node: self.shard_node,
            lean_buffers_node,
            stream_order: self.stream_order,
            spill,
        })
    }

    /// The first node in stream order with room for `bytes`, charged with them.
    fn first_fit(&mut self, bytes: u64) -> std::result::Result<u32, Shortage> {
        for &os in &self.stream_order {
            let Some(i) = self.nodes.iter().position(|n| n.node == os) else {
                break;
            };
            if self.nodes[i].bytes + bytes <= self.nodes[i].capacity {
                self.nodes[i].bytes += bytes;
                return Ok(os);
            }
        }
        Err(self.short())
    }

    /// The lean gradient buffers (if any), then every unit's streamed shards, first fit in
    /// stream order; the lean buffers' node.
    fn place_streamed(&mut self) -> std::result::Result<Option<u32>, Shortage> {
        let layout = self.layout;
        // ZeRO stage 3's gathered params buffers sit beside the lean buffers (both near the
        // GPU: the device copies from them).
        let lean = layout.lean_grad_buffer_bytes()
            + layout.gather_buffer_bytes()
            + layout.landing_buffer_bytes();
        let lean_node = if lean > 0 {
            Some(self.first_fit(lean)?)
        } else {
            None
        };
        for u in 0..layout.units.len() {
            for k in streamed_kinds(layout) {
                let node = self.first_fit(layout.shard_bytes(u, k) as u64)?;
                self.shard_node[u][k.index()] = Some(node);
            }
        }
        Ok(lean_node)
    }

    /// The staging slots of the spilled `units` (one block of memory), on the node with the
    /// most hardware threads (then the most room) that holds them: the spilled units' AdamW
    /// workers run there.
    fn place_staging(
        &mut self,
        units: &[usize],
        staging: u64,
        slots: usize,
        nvme_bytes: u64,
        threads: &[u64],
    ) -> std::result::Result<SpillPlan, Shortage> {
        let nodes = &self.nodes;
        let best = (0..nodes.len())
            .filter(|&i| nodes[i].bytes + staging <= nodes[i].capacity)
            .max_by_key(|&i| (threads[i], nodes[i].capacity - nodes[i].bytes))
            .ok_or_else(|| self.short())?;
        self.nodes[best].bytes += staging;
        self.opt_bytes[best] += staging;
        let mut sorted = units.to_vec();
        sorted.sort_unstable();
        Ok(SpillPlan {
            units: sorted,
            kinds: vec![ShardKind::AdamM, ShardKind::AdamV],
            node: self.nodes[best].node,
            slots: slots.max(1),
            slot_bytes: staging / slots.max(1) as u64,
            nvme_bytes,
        })
    }

    /// Each unit's optimizer shards together, on the node whose workers have the least
    /// optimizer work per CPU so far (spreading AdamW over every socket's memory controllers is
    /// what makes it fast), among the nodes where they still fit. Spilled m and v are recorded
    /// on the staging node.
    fn place_optimizer(
        &mut self,
        is_spilled: &[bool],
        spill: Option<&SpillPlan>,
        threads: &[u64],
    ) -> std::result::Result<(), Shortage> {
        let layout = self.layout;
        let moments = |k: &ShardKind| matches!(k, ShardKind::AdamM | ShardKind::AdamV);
        for (u, &spilled) in is_spilled.iter().enumerate().take(layout.units.len()) {
            let kinds: Vec<ShardKind> = optimizer_kinds(layout)
                .into_iter()
                .filter(|k| !(spilled && moments(k)))
                .collect();
            if let (true, Some(p)) = (spilled, spill) {
                for k in [ShardKind::AdamM, ShardKind::AdamV] {
                    self.shard_node[u][k.index()] = Some(p.node);
                }
            }
            if kinds.is_empty() {
                continue;
            }
            let bytes: u64 = kinds.iter().map(|&k| layout.shard_bytes(u, k) as u64).sum();
            let (nodes, opt_bytes) = (&self.nodes, &self.opt_bytes);
            let best = (0..nodes.len())
                .filter(|&i| nodes[i].bytes + bytes <= nodes[i].capacity)
                .min_by(|&a, &b| {
                    // Compare (opt_bytes + bytes) / threads across nodes without floats.
                    let ka = u128::from(opt_bytes[a] + bytes) * u128::from(threads[b]);
                    let kb = u128::from(opt_bytes[b] + bytes) * u128::from(threads[a]);
                    ka.cmp(&kb).then(nodes[a].node.cmp(&nodes[b].node))
                })
                .ok_or_else(|| self.short())?;
            self.nodes[best].bytes += bytes;
            self.opt_bytes[best] += bytes;
            for k in kinds {
                self.shard_node[u][k.index()] = Some(self.nodes[best].node);
            }
        }
        Ok(())
    }

    /// The AdamW workers' CPUs: those of every node holding optimizer state.
    fn assign_adam_cpus(&mut self, machine: &Machine) -> std::result::Result<(), Shortage> {
        for n in &mut self.nodes {
            let holds_optimizer = self
                .shard_node
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
        Ok(())
    }
}

fn not_enough_ram(layout: &StateLayout, need: u64, capacity: u64, fixes: &[Fix]) -> Error {
    let fix = if fixes.is_empty() {
        format!(
            "no mode, Adam state or spill setting fits this machine: use one with more RAM (this state needs {}), or a smaller model",
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
mod tests;
