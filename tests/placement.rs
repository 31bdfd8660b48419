//! Placement on recorded real servers (tests/fixtures/topologies) and synthetic machines.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

use megatrain::model::config::ModelConfig;
use megatrain::store::layout::{Mode, ShardKind, StateLayout};
use megatrain::store::placement::{place, RamBudget};
use megatrain::topology::{probe, Machine, TopologySource};
use std::path::Path;

/// A recorded real server (`tests/fixtures/topologies`, sources in its SOURCES.md).
fn recorded(name: &str) -> Machine {
    let path = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/topologies")
        .join(name);
    probe(&TopologySource::XmlFile(path)).unwrap()
}

fn llama(hidden: usize, inter: usize, layers: usize, heads: usize, kv: usize) -> ModelConfig {
    ModelConfig::from_json_str(
        &format!(
            r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":{hidden},"intermediate_size":{inter},
            "num_hidden_layers":{layers},"num_attention_heads":{heads},"num_key_value_heads":{kv},
            "vocab_size":128256}}"#
        ),
        "llama",
    )
    .unwrap()
}

#[test]
fn ipa20_streams_from_the_gpu_node_and_spreads_adam_state() {
    let m = recorded("ipa20.xml");
    let gpu = m.gpus.iter().position(|g| g.numa_nodes == vec![1]).unwrap();
    let layout = StateLayout::new(&llama(4096, 14336, 32, 32, 8), Mode::Exact);
    let p = place(&m, &layout, Some(gpu), RamBudget::default()).unwrap();
    assert_eq!(p.stream_order[0], 1);
    // Same-socket nodes (distance 12) come before the other socket (21).
    assert_eq!(&p.stream_order[1..4], &[0, 2, 3]);
    for u in 0..layout.units.len() {
        assert_eq!(p.node_of(u, ShardKind::Params), Some(1), "unit {u} params");
        assert_eq!(p.node_of(u, ShardKind::Grads), Some(1), "unit {u} grads");
        assert_eq!(
            p.node_of(u, ShardKind::AdamM),
            p.node_of(u, ShardKind::AdamV)
        );
    }
    // Adam state is spread over all 8 nodes (equal CPUs: equal shares, to within one unit).
    let workers: Vec<u32> = p
        .nodes
        .iter()
        .filter(|n| !n.adam_cpus.is_empty())
        .map(|n| n.node)
        .collect();
    assert_eq!(workers.len(), 8, "{workers:?}");
    let mv = |node: u32| -> u64 {
        (0..layout.units.len())
            .filter(|&u| p.node_of(u, ShardKind::AdamM) == Some(node))
            .map(|u| layout.moment_bytes(u))
            .sum()
    };
    let per_node: Vec<u64> = (0..8).map(mv).collect();
    let biggest_unit = (0..layout.units.len())
        .map(|u| layout.moment_bytes(u))
        .max()
        .unwrap();
    let (lo, hi) = (
        per_node.iter().min().unwrap(),
        per_node.iter().max().unwrap(),
    );
    assert!(hi - lo <= biggest_unit, "unbalanced: {per_node:?}");
    assert!(p
        .nodes
        .iter()
        .all(|n| n.adam_cpus.is_empty() || n.adam_cpus.len() == 28));
}

#[test]
fn ipa20_70b_overflows_to_the_nearest_nodes_and_405b_needs_nvme() {
    let m = recorded("ipa20.xml");
    let gpu = m.gpus.iter().position(|g| g.numa_nodes == vec![1]).unwrap();
    let l70 = StateLayout::new(&llama(8192, 28672, 80, 64, 8), Mode::Exact);
    let p = place(&m, &l70, Some(gpu), RamBudget::default()).unwrap();
    let streamed: std::collections::BTreeSet<u32> = (0..l70.units.len())
        .flat_map(|u| {
            [
                p.node_of(u, ShardKind::Params),
                p.node_of(u, ShardKind::Grads),
            ]
        })
        .flatten()
        .collect();
    assert!(streamed.contains(&1) && streamed.len() > 1, "{streamed:?}");
    assert!(
        streamed.iter().all(|n| *n < 4),
        "streamed data stays on the GPU's socket: {streamed:?}"
    );

    let l405 = StateLayout::new(&llama(16384, 53248, 126, 128, 8), Mode::Exact);
    let msg = place(&m, &l405, Some(gpu), RamBudget::default())
        .unwrap_err()
        .to_string();
    eprintln!("{msg}");
    assert!(msg.contains("missing"), "{msg}");
    assert!(msg.contains("--nvme DIR"), "{msg}");
}

#[test]
fn power9_never_places_state_in_gpu_memory_nodes() {
    let m = recorded("nvidiagpunumanodes-kept.xml");
    let layout = StateLayout::new(&llama(1024, 4096, 4, 16, 16), Mode::Lean);
    let p = place(&m, &layout, Some(0), RamBudget::default()).unwrap();
    assert!(
        p.nodes.iter().all(|n| n.node == 0 || n.node == 8),
        "{:?}",
        p.nodes
    );
    assert_eq!(p.stream_order[0], m.gpus[0].numa_nodes[0]);
}

#[test]
fn synthetic_two_and_four_node_machines_balance_adam_state() {
    for (desc, nodes) in [
        ("pack:2 numa:1 core:4 pu:1", 2usize),
        ("pack:2 numa:2 core:4 pu:1", 4),
    ] {
        let mut m = probe(&TopologySource::Synthetic(desc.into())).unwrap();
        for n in &mut m.numa_nodes {
            n.memory_bytes = 8 << 30;
        }
        assert_eq!(m.numa_nodes.len(), nodes, "{desc}");
        let layout = StateLayout::new(&llama(512, 1024, 16, 8, 8), Mode::Exact);
        let p = place(&m, &layout, None, RamBudget::default()).unwrap();
        let mv: Vec<u64> = p
            .nodes
            .iter()
            .map(|n| {
                (0..layout.units.len())
                    .filter(|&u| p.node_of(u, ShardKind::AdamM) == Some(n.node))
                    .map(|u| layout.moment_bytes(u))
                    .sum()
            })
            .collect();
        assert!(
            mv.iter().all(|b| *b > 0),
            "{desc}: every node gets Adam state {mv:?}"
        );
    }
}

/// A CUDA device finds itself in the topology by PCI address: on the Xeon SNC4 server with four
/// H100s, each GPU's host state goes to its own sub-NUMA node.
#[test]
fn gpus_are_found_by_pci_address_and_stream_from_their_node() {
    let m = recorded("ipa20.xml");
    assert!(m.gpus.len() >= 2, "{} GPUs", m.gpus.len());
    for (i, g) in m.gpus.iter().enumerate() {
        assert_eq!(m.gpu_by_pci_bus_id(&g.pci_bus_id.to_uppercase()), Some(i));
        let layout = StateLayout::new(&llama(1024, 2816, 4, 16, 8), Mode::Exact);
        let p = place(&m, &layout, Some(i), RamBudget::default()).unwrap();
        assert_eq!(
            p.node_of(1, ShardKind::Params),
            g.numa_nodes.first().copied(),
            "GPU {i} at {}",
            g.pci_bus_id
        );
    }
    assert_eq!(m.gpu_by_pci_bus_id("0000:ff:1f.7"), None);
}
