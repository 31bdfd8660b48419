//! `megatrain bench adam`: AdamW throughput of the real engine (host store + per-node pool), for
//! each `--adam-state` format, next to a STREAM triad measured in the same run, on the same node
//! and the same threads.
//!
//! The cases are timed in turn, repetition by repetition, so a noisy neighbour slows all alike.
//! Byte accounting per parameter: AdamW reads p, g, m, v and writes p, m, v: 28 B with fp32
//! moments, 20 B with bf16, 16 B with int8 (plus 16 B of block scales per 2,048 elements); the
//! triad `a = b + s·c` moves 12 B/element (STREAM's count; its SIMD paths use non-temporal stores,
//! so no write-allocate read of `a` goes uncounted). AdamW writes only lines it has just read, so
//! its bytes are its real traffic too. At the memory-bandwidth limit, params/s scale inversely
//! with the bytes: compact moments are faster by 28/20 and 28/16.
//!
//! A master stored as bf16 planes (`--master planes`) moves the same bytes as fp32: it reads and
//! writes the two 2-byte planes instead of one 4-byte value, and the bf16 copy the device streams
//! is the high plane itself (no shadow write). Its extra cost is the join and split in L1.

use crate::host::{PageKind, Region, RegionSpec};
use crate::model::config::{Architecture, ModelConfig};
use crate::optim::adamw::{AdamWConfig, Isa};
use crate::optim::moments;
use crate::optim::{unit_segments, AdamPool, Salts};
use crate::store::layout::{AdamState, MasterFormat, Mode, StateLayout};
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
    /// The moment formats to measure (each in its own store).
    pub states: Vec<AdamState>,
    /// The master formats to measure, each with every moment format.
    pub masters: Vec<MasterFormat>,
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

/// AdamW with one moment format.
#[derive(Debug, Clone, Serialize, serde::Deserialize)]
pub struct AdamCase {
    /// The moment format.
    pub state: AdamState,
    /// The master's format.
    #[serde(default)]
    pub master: MasterFormat,
    /// The timing, bytes by the accounting above.
    pub measured: Measured,
    /// Bytes moved per parameter.
    pub bytes_per_param: f64,
    /// Parameters per second.
    pub params_per_s: f64,
    /// GB/s ÷ the triad's GB/s.
    pub ratio: f64,
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
    /// AdamW, per moment format.
    pub adam: Vec<AdamCase>,
    /// STREAM triad on the same node and threads.
    pub triad: Measured,
}

impl AdamBenchReport {
    /// The case of `state` moments with an fp32 master, if measured.
    pub fn case(&self, state: AdamState) -> Option<&AdamCase> {
        self.case_of(state, MasterFormat::Fp32)
    }

    /// The case of `state` moments with a `master` master, if measured.
    pub fn case_of(&self, state: AdamState, master: MasterFormat) -> Option<&AdamCase> {
        self.adam
            .iter()
            .find(|c| c.state == state && c.master == master)
    }
}

/// A case to time: its bytes per run and the run.
type Case<'a> = (u64, Box<dyn FnMut() -> Result<()> + 'a>);

/// Time `cases` in turn (`reps` times each, after one warm-up of each), so drift on a shared
/// machine affects all alike; report the medians.
fn measure_in_turn(reps: usize, mut cases: Vec<Case<'_>>) -> Result<Vec<Measured>> {
    for (_, run) in &mut cases {
        run()?;
    }
    let mut times = vec![Vec::new(); cases.len()];
    for _ in 0..reps.max(1) {
        for ((_, run), t) in cases.iter_mut().zip(&mut times) {
            let s = Instant::now();
            run()?;
            t.push(s.elapsed().as_secs_f64());
        }
    }
    Ok(cases
        .iter()
        .zip(times)
        .map(|((bytes, _), mut t)| {
            t.sort_by(f64::total_cmp);
            let median = t[t.len() / 2];
            Measured {
                median_s: median,
                min_s: t[0],
                bytes: *bytes,
                gbytes_per_s: *bytes as f64 / median / 1e9,
            }
        })
        .collect())
}

/// A Llama-shaped model of about `params` parameters in 8 layers (tiny vocabulary), so the
/// benchmark updates units of realistic size and count.
fn bench_model(params: usize) -> Result<ModelConfig> {
    let layers = 8;
    // layer_params ≈ 4C² (attention) + 3·C·(8C/3) (MLP) = 12C².
    let c = (((params / layers) as f64 / 12.0).sqrt() as usize / 64).max(1) * 64;
    Ok(ModelConfig {
        max_position_embeddings: 2048,
        ..ModelConfig::dense(
            Architecture::Llama,
            256,
            (c, c * 8 / 3 / 64 * 64, layers),
            (c / 64, c / 64),
            true,
            10000.0,
        )
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
    super::check_count("--reps", args.reps, 1, super::MAX_REPS)?;
    if let Some(t) = args.threads {
        super::check_count("--threads", t, 1, 1 << 16)?;
    }
    // One store at a time: fp32 params and gradients, at most 8 bytes of moments, and the
    // planes' split copy.
    super::check_memory(
        &format!("AdamW over --params {}", args.params),
        (args.params as u64).checked_mul(24),
        "pass a smaller --params",
    )?;

    if args.states.is_empty() || args.masters.is_empty() {
        return Err(Error::bad_input(
            if args.states.is_empty() {
                "--adam-state"
            } else {
                "--master"
            },
            "",
            "no format to measure",
            Some("pass --adam-state fp32, bf16 and/or int8, and --master fp32 and/or planes"),
        ));
    }
    let formats: Vec<(AdamState, MasterFormat)> = args
        .masters
        .iter()
        .flat_map(|m| args.states.iter().map(move |s| (*s, *m)))
        .collect();
    let stores = filled_stores(node, &cpus, args.params, &formats)?;
    let pool = match args.isa {
        Some(isa) => AdamPool::with_isa(&[(node.os_index, cpus.clone())], Some(threads), isa)?,
        None => AdamPool::new(&[(node.os_index, cpus.clone())], Some(threads))?,
    };
    let layout = stores[0].layout();
    let (n, units) = (layout.num_params(), layout.units.len());
    let numel: usize = layout.units.iter().map(|u| u.numel).sum();
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
    let mut cases: Vec<Case<'_>> = Vec::new();
    for store in &stores {
        let bytes = (moments::update_bytes_per_param(store.layout().adam) * numel as f64) as u64;
        let mut t = 0u64;
        let (pool, node) = (&pool, node.os_index);
        cases.push((
            bytes,
            Box::new(move || {
                t += 1;
                update_all(pool, node, store, t)
            }),
        ));
    }
    cases.push((
        12 * numel as u64,
        Box::new(|| {
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
        }),
    ));
    let mut measured = measure_in_turn(args.reps, cases)?;
    let triad = measured
        .pop()
        .ok_or_else(|| Error::internal("bench adam", "no triad"))?;
    let adam = stores
        .iter()
        .zip(measured)
        .map(|(store, m)| AdamCase {
            state: store.layout().adam,
            master: store.layout().master,
            bytes_per_param: moments::update_bytes_per_param(store.layout().adam),
            params_per_s: numel as f64 / m.median_s,
            ratio: m.gbytes_per_s / triad.gbytes_per_s,
            measured: m,
        })
        .collect();
    Ok(AdamBenchReport {
        cpu: machine.packages.first().and_then(|p| p.cpu_model.clone()),
        node: node.os_index,
        threads,
        isa: pool.isa(),
        params: n,
        units,
        reps: args.reps,
        adam,
        triad,
    })
}

/// One AdamW step (number `t`) over every unit of `store`, all units in flight at once.
fn update_all(pool: &AdamPool, node: u32, store: &HostStore, t: u64) -> Result<()> {
    let cfg = AdamWConfig::default();
    let mut jobs = Vec::with_capacity(store.num_units());
    for u in 0..store.num_units() {
        let segs = unit_segments(store.layout(), u, &cfg, t, 1.0, true);
        let salts = Salts::new(0, t, u);
        jobs.push(pool.submit(node, store.take(u)?, None, segs, salts)?);
    }
    for j in jobs {
        j.wait()?;
    }
    Ok(())
}

/// One store per format of a `params`-parameter model on `node` alone, with realistic values
/// (v > 0, gradients of mixed sign); refused when they and the triad's arrays do not fit the
/// node's free memory.
fn filled_stores(
    node: &NumaNode,
    cpus: &[usize],
    params: usize,
    formats: &[(AdamState, MasterFormat)],
) -> Result<Vec<HostStore>> {
    let cfg = bench_model(params)?;
    let layouts: Vec<StateLayout> = formats
        .iter()
        .map(|(s, m)| {
            StateLayout::new(&cfg, Mode::Exact)
                .with_adam_state(*s)
                .with_master(*m)
        })
        .collect();
    let need = layouts.iter().map(StateLayout::total_bytes).sum::<u64>()
        + 3 * 4 * layouts[0].num_params() as u64;
    let avail = node
        .available_bytes
        .or(node.free_bytes)
        .unwrap_or(node.memory_bytes);
    if need > avail {
        return Err(Error::bad_input(
            "--params",
            params.to_string(),
            format!(
                "needs {} on node {} but {} is available",
                crate::util::human_bytes(need),
                node.os_index,
                crate::util::human_bytes(avail)
            ),
            Some("lower --params, or measure fewer --adam-state or --master formats"),
        ));
    }
    layouts
        .into_iter()
        .map(|layout| filled_store(node, cpus, avail, layout))
        .collect()
}

/// A store of `layout` on `node` alone, filled.
fn filled_store(
    node: &NumaNode,
    cpus: &[usize],
    avail: u64,
    layout: StateLayout,
) -> Result<HostStore> {
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
    let state = store.layout().adam;
    for u in 0..store.num_units() {
        let mut g = store.take(u)?;
        let numel = g.numel();
        let mut sh = g.shards()?;
        let p: Vec<f32> = (0..numel)
            .map(|i| ((i % 97) as f32 - 48.0) * 1e-3)
            .collect();
        sh.params.write(0, &p);
        if let Some(gr) = sh.grads {
            for (i, x) in gr.iter_mut().enumerate() {
                *x = ((i % 89) as f32 - 44.0) * 1e-4;
            }
        }
        moments::from_f32(state, &vec![1e-6; numel], sh.v, false);
    }
    Ok(store)
}

/// The report as text.
pub fn render(r: &AdamBenchReport) -> String {
    let mut out = format!(
        "megatrain bench adam — node {} · {} thread(s) · {:?} · {}\n\
         {} params in {} units (Llama-shaped), median of {} runs in turn after a warm-up\n\n\
         {:<30} {:>10} {:>9} {:>7} {:>10} {:>9}\n",
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
        "G param/s",
        "÷ triad",
    );
    for c in &r.adam {
        out += &format!(
            "{:<30} {:>10.3} {:>9.2} {:>7.2} {:>10.3} {:>8.1}%\n",
            format!("adamw, {} m/v, {} master", c.state.name(), c.master.name()),
            c.measured.median_s * 1e3,
            c.measured.gbytes_per_s,
            c.bytes_per_param,
            c.params_per_s / 1e9,
            100.0 * c.ratio
        );
    }
    out += &format!(
        "{:<30} {:>10.3} {:>9.2} {:>7} {:>10} {:>9}\n",
        "stream triad",
        r.triad.median_s * 1e3,
        r.triad.gbytes_per_s,
        12,
        "",
        ""
    );
    for c in r.adam.iter().filter(|c| c.master == MasterFormat::Planes) {
        if let Some(fp32) = r.case(c.state) {
            out += &format!(
                "\nplanes master, {} m/v: {:.2}x the params/s of an fp32 master (the bytes predict 1.00x)",
                c.state.name(),
                c.params_per_s / fp32.params_per_s,
            );
        }
    }
    if let Some(fp32) = r.case(AdamState::Fp32) {
        for c in r
            .adam
            .iter()
            .filter(|c| c.state != AdamState::Fp32 && c.master == MasterFormat::Fp32)
        {
            out += &format!(
                "\n{} moments: {:.2}x the params/s of fp32 (the bytes predict {:.2}x)",
                c.state.name(),
                c.params_per_s / fp32.params_per_s,
                fp32.bytes_per_param / c.bytes_per_param
            );
        }
    }
    out.push('\n');
    out
}
