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
                        let mut fixed = l.clone().with_adam_state(f.adam);
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
                        assert!(
                            err.contains("no mode, Adam state or spill setting fits"),
                            "{err}"
                        );
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
    let mv = |u: usize| l.moment_bytes(u);
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

/// The default ceiling is what the OS can give (available memory, a cgroup's room), and
/// `--ram-budget` raises it up to the nodes' RAM — never past the RAM or the cgroup's limit.
#[test]
fn the_budget_follows_available_memory_and_a_given_total_raises_it() {
    let mut m = synthetic("pack:1 numa:2 core:2 pu:1", 4);
    for n in &mut m.numa_nodes {
        n.free_bytes = Some(1 << 30);
        n.available_bytes = Some(2 << 30);
    }
    let l = StateLayout::new(&tiny(8), Mode::Exact);
    let caps = |m: &Machine, b: RamBudget| -> Result<Vec<u64>> {
        let hosts: Vec<&NumaNode> = m.numa_nodes.iter().collect();
        Ok(node_capacities(&hosts, b, m.memory.cgroup.as_ref())?
            .iter()
            .map(|n| n.capacity)
            .collect())
    };
    let gib = 1u64 << 30;
    // Available memory (page cache included), not free memory.
    let d = RamBudget::default();
    assert_eq!(caps(&m, d).unwrap(), vec![(2 * gib) * 9 / 10; 2]);
    // Lowered and raised by a total; each node at most its RAM.
    let with = |t| RamBudget {
        total_bytes: Some(t),
        ..d
    };
    assert_eq!(caps(&m, with(2 * gib)).unwrap(), vec![gib; 2]);
    let raised = caps(&m, with(6 * gib)).unwrap();
    assert!(
        raised.iter().all(|&c| c.abs_diff(3 * gib) < 16),
        "{raised:?}"
    );
    assert_eq!(caps(&m, with(8 * gib)).unwrap(), vec![4 * gib; 2]);
    let e = caps(&m, with(9 * gib)).unwrap_err().to_string();
    assert!(e.contains("more than the 8.0 GiB of RAM"), "{e}");
    // A cgroup holds the default under its room, and a total past its limit is refused.
    m.memory.cgroup = Some(crate::topology::CgroupMemory {
        path: "/sys/fs/cgroup/job".into(),
        limit_bytes: 3 * gib,
        usage_bytes: gib,
        reclaimable_bytes: 0,
    });
    let c = caps(&m, d).unwrap();
    assert!(
        c.iter().sum::<u64>().abs_diff(2 * gib * 9 / 10) < 16,
        "{c:?}"
    );
    let e = caps(&m, with(4 * gib)).unwrap_err().to_string();
    assert!(
        e.contains("memory limit 3.0 GiB of cgroup /sys/fs/cgroup/job"),
        "{e}"
    );
    // Placement itself reports it.
    let e = place(&m, &l, None, with(4 * gib)).unwrap_err().to_string();
    assert!(e.contains("--ram-budget"), "{e}");
}
