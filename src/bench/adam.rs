//! `megatrain bench adam`: AdamW throughput of the real engine (host store + per-node pool) next
//! to a STREAM triad measured in the same run, on the same node and the same threads.
//!
//! The two are timed alternately so a noisy neighbour slows both alike. Byte accounting: AdamW
//! moves 28 B/param (reads p, g, m, v; writes p, m, v); the triad `a = b + s·c` moves 12 B/element (STREAM's count; its SIMD paths use
//! non-temporal stores, so no write-allocate read of `a` goes uncounted). AdamW writes only lines it
//! has just read, so its 28 B are its real traffic too.

use crate::host::{PageKind, Region, RegionSpec};
use crate::model::config::{Architecture, ModelConfig};
use crate::optim::adamw::{AdamWConfig, Isa};
use crate::optim::{unit_segments, AdamPool};
use crate::store::layout::{Mode, StateLayout};
use crate::store::placement::{NodePlan, Placement};
use crate::store::{HostStore, StoreOptions};
use crate::topology::{Machine, NumaNode};
use crate::{Error, Result};
use serde::Serialize;
use std::time::Instant;

/// What to run.
#[derive(Debug, Clone)]
pub struct AdamBenchArgs {
    /// Parameters to update per iteration (rounded to whole layers of a Llama-shaped model).
    pub params: usize,
    /// Worker threads (default: every CPU of the node).
    pub threads: Option<usize>,
    /// NUMA node (default: the first node with CPUs).
    pub node: Option<u32>,
    /// Timed repetitions (the median is reported).
    pub reps: usize,
    /// Force an implementation (default: the best this CPU has).
    pub isa: Option<Isa>,
}

/// One measured kernel.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct Measured {
    /// Median seconds per iteration.
    pub median_s: f64,
    /// Fastest iteration, seconds.
    pub min_s: f64,
    /// Bytes moved per iteration (by the accounting above).
    pub bytes: u64,
    /// bytes / median_s, in GB/s (1e9).
    pub gbytes_per_s: f64,
}

/// The result of `bench adam`.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct AdamBenchReport {
    /// CPU model.
    pub cpu: Option<String>,
    /// NUMA node.
    pub node: u32,
    /// Worker threads.
    pub threads: usize,
    /// Implementation.
    pub isa: Isa,
    /// Parameters per iteration.
    pub params: usize,
    /// Units (jobs) per iteration.
    pub units: usize,
    /// Timed repetitions.
    pub reps: usize,
    /// AdamW.
    pub adam: Measured,
    /// Parameters per second.
    pub params_per_s: f64,
    /// STREAM triad on the same node and threads.
    pub triad: Measured,
    /// adam GB/s ÷ triad GB/s.
    pub ratio: f64,
}

/// Time `a` and `b` alternately (`reps` times each, after one warm-up of each), so drift on a
/// shared machine affects both alike; report the medians.
fn measure_pair(
    reps: usize,
    bytes: (u64, u64),
    mut a: impl FnMut() -> Result<()>,
    mut b: impl FnMut() -> Result<()>,
) -> Result<(Measured, Measured)> {
    a()?;
    b()?;
    let (mut ta, mut tb) = (Vec::new(), Vec::new());
    for _ in 0..reps.max(1) {
        let s = Instant::now();
        a()?;
        ta.push(s.elapsed().as_secs_f64());
        let s = Instant::now();
        b()?;
        tb.push(s.elapsed().as_secs_f64());
    }
    let summarize = |mut t: Vec<f64>, bytes: u64| {
        t.sort_by(f64::total_cmp);
        let median = t[t.len() / 2];
        Measured {
            median_s: median,
            min_s: t[0],
            bytes,
            gbytes_per_s: bytes as f64 / median / 1e9,
        }
    };
    Ok((summarize(ta, bytes.0), summarize(tb, bytes.1)))
}

/// A Llama-shaped model of about `params` parameters in 8 layers (tiny vocabulary), so the
/// benchmark updates units of realistic size and count.
fn bench_model(params: usize) -> Result<ModelConfig> {
    let layers = 8;
    // params_per_layer ≈ 4C² (attention) + 3·C·(8C/3) (MLP) = 12C².
    let c = (((params / layers) as f64 / 12.0).sqrt() as usize / 64).max(1) * 64;
    Ok(ModelConfig {
        architecture: Architecture::Llama,
        vocab_size: 256,
        hidden_size: c,
        intermediate_size: c * 8 / 3 / 64 * 64,
        num_layers: layers,
        num_heads: c / 64,
        num_kv_heads: c / 64,
        head_dim: 64,
        rms_norm_eps: 1e-5,
        rope_theta: 10000.0,
        max_position_embeddings: 2048,
        tie_word_embeddings: true,
        qkv_bias: false,
        o_bias: false,
        sliding_window: None,
    })
}

/// Run the benchmark on `machine` (the live machine).
pub fn run(machine: &Machine, args: &AdamBenchArgs) -> Result<AdamBenchReport> {
    let node = match args.node {
        Some(n) => machine.numa_node(n).ok_or_else(|| {
            Error::bad_input(
                "NUMA node",
                n.to_string(),
                "not on this machine",
                Some("see `megatrain probe`"),
            )
        })?,
        None => machine
            .numa_nodes
            .iter()
            .find(|n| n.hardware_threads > 0)
            .ok_or_else(|| Error::bad_input("machine", "NUMA nodes", "none has CPUs", None))?,
    };
    let cpus = crate::host::affinity::parse_cpu_list(&node.cpus)?;
    let threads = args.threads.unwrap_or(cpus.len()).max(1);
    if args.params < 1024 {
        return Err(Error::bad_input(
            "--params",
            args.params.to_string(),
            "too small to measure",
            Some("use at least 1M"),
        ));
    }

    let store = filled_store(node, &cpus, args.params)?;
    let pool = match args.isa {
        Some(isa) => AdamPool::with_isa(&[(node.os_index, cpus.clone())], Some(threads), isa)?,
        None => AdamPool::new(&[(node.os_index, cpus.clone())], Some(threads))?,
    };
    let n = store.layout().num_params();
    let numel: usize = store.layout().units.iter().map(|u| u.numel).sum();
    let adam_cfg = AdamWConfig::default();
    let mut t = 0u64;
    let per_param = 28;
    let spec = |label: &str| RegionSpec {
        label: label.to_owned(),
        bytes: numel * 4,
        node: Some(node.os_index),
        prefault_cpus: cpus.clone(),
        pages: PageKind::Transparent,
        lock: false,
    };
    let a = Region::allocate(spec("triad a"))?;
    let b = Region::allocate(spec("triad b"))?;
    let c = Region::allocate(spec("triad c"))?;
    let (adam, triad) = measure_pair(
        args.reps,
        (per_param * numel as u64, 12 * numel as u64),
        || {
            t += 1;
            let mut jobs = Vec::with_capacity(store.num_units());
            for u in 0..store.num_units() {
                let segs = unit_segments(store.layout(), u, &adam_cfg, t, 1.0, true);
                jobs.push(pool.submit(node.os_index, store.take(u)?, None, segs)?);
            }
            for j in jobs {
                j.wait()?;
            }
            Ok(())
        },
        || {
            // SAFETY: three distinct regions of ≥ numel f32 each, alive for this closure and
            // touched by no one else; the job is waited before returning.
            let job = unsafe {
                pool.triad(
                    node.os_index,
                    a.as_ptr().cast(),
                    b.as_ptr().cast::<f32>().cast_const(),
                    c.as_ptr().cast::<f32>().cast_const(),
                    1.5,
                    numel,
                )?
            };
            job.wait();
            Ok(())
        },
    )?;

    Ok(AdamBenchReport {
        cpu: machine.packages.first().and_then(|p| p.cpu_model.clone()),
        node: node.os_index,
        threads,
        isa: pool.isa(),
        params: n,
        units: store.num_units(),
        reps: args.reps,
        params_per_s: numel as f64 / adam.median_s,
        ratio: adam.gbytes_per_s / triad.gbytes_per_s,
        adam,
        triad,
    })
}

/// A store of a `params`-parameter model on `node` alone, with realistic values (v > 0,
/// gradients of mixed sign); refused when it and the triad's arrays do not fit the node's free
/// memory.
fn filled_store(node: &NumaNode, cpus: &[usize], params: usize) -> Result<HostStore> {
    let cfg = bench_model(params)?;
    let layout = StateLayout::new(&cfg, Mode::Exact);
    let need = layout.total_bytes() + 3 * 4 * layout.num_params() as u64;
    let avail = node.free_bytes.unwrap_or(node.memory_bytes);
    if need > avail {
        return Err(Error::bad_input(
            "--params",
            params.to_string(),
            format!(
                "needs {} on node {} but {} is free",
                crate::util::human_bytes(need),
                node.os_index,
                crate::util::human_bytes(avail)
            ),
            Some("lower --params"),
        ));
    }
    let placement = Placement {
        nodes: vec![NodePlan {
            node: node.os_index,
            capacity: avail,
            bytes: layout.total_bytes(),
            adam_cpus: cpus.to_vec(),
        }],
        shard_node: vec![
            [Some(node.os_index); crate::store::layout::ShardKind::COUNT];
            layout.units.len()
        ],
        lean_buffers_node: None,
        stream_order: vec![node.os_index],
        spill: None,
    };
    let store = HostStore::allocate(layout, placement, &StoreOptions::default())?;
    // Realistic values: v > 0, gradients of mixed sign.
    for u in 0..store.num_units() {
        let mut g = store.take(u)?;
        let sh = g.shards()?;
        for (i, x) in sh.params.iter_mut().enumerate() {
            *x = ((i % 97) as f32 - 48.0) * 1e-3;
        }
        if let Some(gr) = sh.grads {
            for (i, x) in gr.iter_mut().enumerate() {
                *x = ((i % 89) as f32 - 44.0) * 1e-4;
            }
        }
        sh.v.fill(1e-6);
    }
    Ok(store)
}

/// The report as text.
pub fn render(r: &AdamBenchReport) -> String {
    format!(
        "megatrain bench adam — node {} · {} thread(s) · {:?} · {}\n\
         {} params in {} units (Llama-shaped), median of {} alternating runs after a warm-up\n\n\
         {:<26} {:>12} {:>12} {:>12}\n\
         {:<26} {:>12.3} {:>12.2} {:>12}\n\
         {:<26} {:>12.3} {:>12.2} {:>12}\n\n\
         AdamW: {:.3} G params/s, {:.1}% of the triad bandwidth measured in this run\n",
        r.node,
        r.threads,
        r.isa,
        r.cpu.as_deref().unwrap_or("unknown CPU"),
        r.params,
        r.units,
        r.reps,
        "case",
        "median ms",
        "GB/s",
        "B/elem",
        "adamw (28 B/param)",
        r.adam.median_s * 1e3,
        r.adam.gbytes_per_s,
        28,
        "stream triad (12 B/elem)",
        r.triad.median_s * 1e3,
        r.triad.gbytes_per_s,
        12,
        r.params_per_s / 1e9,
        100.0 * r.ratio
    )
}
