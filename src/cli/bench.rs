//! `megatrain bench adam|engine|nvme|io|link|attention|kernels`: measured next to the physical limit measured in
//! the same run. `--json` prints a report `megatrain plan --calibration` reads back.

use super::print_report;
use clap::{Args, Subcommand};
use megatrain::bench::Report;
use megatrain::topology::{self, TopologySource};
use megatrain::Result;
use std::path::PathBuf;

/// Run a bench command.
pub fn run(c: &BenchCommand) -> Result<()> {
    match c {
        BenchCommand::Adam(a) => bench_adam(a),
        BenchCommand::Engine(a) => bench_engine(a),
        BenchCommand::Nvme(a) => bench_nvme(a),
        BenchCommand::Io(a) => bench_io(a),
        BenchCommand::Link(a) => bench_link(a),
        BenchCommand::Attention(a) => bench_attention(a),
        BenchCommand::Kernels(a) => bench_kernels(a),
        BenchCommand::Collective(a) => bench_collective(a),
    }
}

#[derive(Debug, Subcommand)]
pub enum BenchCommand {
    /// CPU AdamW (the real store and worker pool) vs a STREAM triad on the same node and threads.
    Adam(BenchAdamArgs),
    /// The streaming pipeline on the CPU device with an emulated link: step time vs the serial sum
    /// and the ideal max(compute, transfer, AdamW), for link-, compute- and AdamW-bound cases.
    Engine(BenchEngineArgs),
    /// Sequential write/read GB/s of the spill I/O engine per block size and queue depth.
    Nvme(BenchNvmeArgs),
    /// A checkpoint written, a resume reading it, an HF export, `--init-from` reading it: each
    /// through the trainer's code, next to `dd` with O_DIRECT on the same directory.
    Io(BenchIoArgs),
    /// Copy bandwidth: host memcpy between every NUMA node pair; host↔device cases (waived
    /// without a CUDA device, with the reason).
    Link(BenchLinkArgs),
    /// The CPU device's causal attention, forward and forward + backward, at long sequences
    /// (tools/bench_attention_cpu.py sets it beside PyTorch's scaled_dot_product_attention).
    Attention(BenchAttentionArgs),
    /// The GPU's kernels (CUDA build): the layer GEMMs in fp32 and bf16 (cuBLAS) and the
    /// attention kernels (SIMT fp32, tensor cores), TFLOP/s per shape next to the datasheet peak.
    /// Under tools/cuemu.sh it runs and labels every number emulated.
    Kernels(BenchKernelsArgs),
    /// The data-parallel gradient sum (reduce-scatter + all-gather, summed in rank order) next to
    /// the MPI library's own all-reduce, bus GB/s per size; with `--device cuda`, NCCL's
    /// reduce-scatter, all-gather, all-reduce and broadcast between the ranks' GPUs too. Run it under the
    /// launcher: `mpirun -np 2 megatrain bench collective` (a `--features mpi` build; `cuda,mpi`
    /// for the GPUs).
    Collective(BenchCollectiveArgs),
}

#[derive(Debug, Args)]
pub struct BenchCollectiveArgs {
    /// Bytes per rank (comma-separated; K/M/G suffixes, powers of 1000).
    #[arg(long, value_delimiter = ',', default_value = "1M,16M,64M", value_parser = megatrain::util::size::parse_count)]
    sizes: Vec<usize>,
    /// Timed repetitions per size and side (the median is reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    /// `cuda`: also NCCL between the ranks' GPUs (local rank i on visible GPU i mod their count;
    /// NCCL needs a GPU per rank).
    #[arg(long, value_enum, default_value = "cpu")]
    device: megatrain::train::config::DeviceKind,
    #[arg(long)]
    json: bool,
}

fn bench_collective(a: &BenchCollectiveArgs) -> Result<()> {
    let world = megatrain::train::join(megatrain::dist::Launch::from_env()?.as_ref(), a.device)?;
    // As in training: ranks on one host each take their part of its CPUs.
    megatrain::dist::HostShare::of(world.as_ref()).bind()?;
    let sizes: Vec<u64> = a.sizes.iter().map(|&s| s as u64).collect();
    let measured =
        megatrain::bench::collective::run(world.as_ref(), &sizes, a.reps).and_then(|mut r| {
            if a.device == megatrain::train::config::DeviceKind::Cuda {
                r.nccl = Some(nccl_collectives(world.as_ref(), &sizes, a.reps)?);
            }
            Ok(r)
        });
    let r = match measured {
        Ok(r) => r,
        Err(e) if world.size() > 1 => {
            eprintln!("error: rank {} of {}: {e}", world.rank(), world.size());
            world.abort(i32::from(e.exit_code()))
        }
        Err(e) => return Err(e),
    };
    if world.rank() == 0 {
        // Tagged like every bench report, so `plan --calibration` takes it.
        let r = megatrain::bench::Report::Collective(r);
        let text = if a.json {
            serde_json::to_string_pretty(&r).unwrap_or_default()
        } else {
            r.render()
        };
        println!("{}", text.trim_end());
    }
    Ok(())
}

#[cfg(feature = "cuda")]
fn nccl_collectives(
    world: &dyn megatrain::dist::Collective,
    sizes: &[u64],
    reps: usize,
) -> Result<megatrain::bench::collective::nccl::NcclReport> {
    megatrain::bench::collective::nccl::run(world, sizes, reps)
}

#[cfg(not(feature = "cuda"))]
fn nccl_collectives(
    _: &dyn megatrain::dist::Collective,
    _: &[u64],
    _: usize,
) -> Result<megatrain::bench::collective::nccl::NcclReport> {
    Err(megatrain::Error::bad_input(
        "bench collective --device cuda",
        "NCCL between the GPUs",
        "this binary was built without CUDA support",
        Some("build with `cargo build --release --features cuda,mpi` (no toolkit needed to build) and run on a GPU machine, or under tools/cuemu.sh"),
    ))
}

#[derive(Debug, Args)]
pub struct BenchKernelsArgs {
    /// GPU index.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// Tokens per GEMM (rows of the activations).
    #[arg(long, default_value_t = 4096)]
    tokens: usize,
    /// Hidden size (Llama-3-8B's by default).
    #[arg(long, default_value_t = 4096)]
    hidden: usize,
    /// MLP intermediate size.
    #[arg(long, default_value_t = 14336)]
    ffn: usize,
    /// Query heads of the attention cases.
    #[arg(long, default_value_t = 32)]
    heads: usize,
    /// Key/value heads.
    #[arg(long, default_value_t = 8)]
    kv_heads: usize,
    /// Head dimension (32, 64 and 128 have tensor-core kernels).
    #[arg(long, default_value_t = 128)]
    head_dim: usize,
    /// Sequence lengths of the attention cases (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "2048,8192")]
    seq: Vec<usize>,
    /// Timed repetitions per case (the median is reported).
    #[arg(long, default_value_t = 5)]
    reps: usize,
    #[arg(long)]
    json: bool,
}

#[cfg(not(feature = "cuda"))]
fn bench_kernels(_: &BenchKernelsArgs) -> Result<()> {
    Err(megatrain::Error::bad_input(
        "bench kernels",
        "the CUDA kernels",
        "this binary was built without CUDA support",
        Some("build with `cargo build --release --features cuda` (no toolkit needed to build) and run on a GPU machine, or under tools/cuemu.sh"),
    ))
}

#[cfg(feature = "cuda")]
fn bench_kernels(a: &BenchKernelsArgs) -> Result<()> {
    let r = megatrain::bench::kernels::run(&megatrain::bench::kernels::KernelBenchArgs {
        ordinal: a.gpu,
        tokens: a.tokens,
        hidden: a.hidden,
        ffn: a.ffn,
        heads: a.heads,
        kv_heads: a.kv_heads,
        head_dim: a.head_dim,
        seqs: a.seq.clone(),
        reps: a.reps,
    })?;
    print_report(
        a.json,
        &megatrain::bench::Report::Kernels(r),
        megatrain::bench::Report::render,
    );
    Ok(())
}

#[derive(Debug, Args)]
pub struct BenchAttentionArgs {
    /// Sequence lengths (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "4096,8192,16384")]
    seq: Vec<usize>,
    /// Query heads.
    #[arg(long, default_value_t = 8)]
    heads: usize,
    /// Key/value heads.
    #[arg(long, default_value_t = 2)]
    kv_heads: usize,
    /// Head dimension.
    #[arg(long, default_value_t = 64)]
    head_dim: usize,
    /// Timed repetitions per case (the median is reported).
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Also time each length under a sliding window of this many keys (and the speed-up).
    #[arg(long)]
    window: Option<usize>,
    #[arg(long)]
    json: bool,
}

fn bench_attention(a: &BenchAttentionArgs) -> Result<()> {
    let r = megatrain::bench::attention::run(&megatrain::bench::attention::AttnBenchArgs {
        seqs: a.seq.clone(),
        heads: a.heads,
        kv_heads: a.kv_heads,
        head_dim: a.head_dim,
        reps: a.reps,
        window: a.window,
    })?;
    let text = if a.json {
        serde_json::to_string_pretty(&r).unwrap_or_default()
    } else {
        megatrain::bench::attention::render(&r)
    };
    println!("{}", text.trim_end());
    Ok(())
}

#[derive(Debug, Args)]
pub struct BenchLinkArgs {
    /// Bytes per copy (K/M/G suffixes, powers of 1000).
    #[arg(long, default_value = "256M", value_parser = megatrain::util::size::parse_count)]
    size: usize,
    /// Copies per case; the median is reported.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    #[arg(long)]
    json: bool,
}

fn bench_link(a: &BenchLinkArgs) -> Result<()> {
    let machine = topology::probe(&TopologySource::Live)?;
    let r = megatrain::bench::link::run(&machine, a.size, a.reps)?;
    print_report(a.json, &Report::Link(r), Report::render);
    Ok(())
}

#[derive(Debug, Args)]
pub struct BenchNvmeArgs {
    /// Directory on the device to test (repeat for several devices; blocks are striped).
    #[arg(long, required = true)]
    dir: Vec<PathBuf>,
    /// Bytes per pass (K/M/G suffixes, powers of 1000).
    #[arg(long, default_value = "512M", value_parser = megatrain::util::size::parse_count)]
    size: usize,
    /// Passes per case; the median is reported.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Use the pread/pwrite fallback instead of io_uring.
    #[arg(long)]
    no_uring: bool,
    /// Block sizes to test (comma-separated, K/M suffixes).
    #[arg(long, value_delimiter = ',', default_value = "128Ki,1Mi,4Mi", value_parser = megatrain::util::size::parse_count)]
    block: Vec<usize>,
    /// Queue depths to test (comma-separated).
    #[arg(long, value_delimiter = ',', default_value = "1,4,16,32,64")]
    qd: Vec<usize>,
    /// Pages backing the I/O buffers: transparent (THP, what the spill tier uses) or small
    /// (4 KiB, like fio's malloc'd buffers).
    #[arg(long, default_value = "transparent")]
    pages: megatrain::host::PageKind,
    /// Also run fio (Debian's `fio`) on the same directories and cases and print both.
    #[arg(long)]
    fio: bool,
    #[arg(long)]
    json: bool,
}

fn bench_nvme(a: &BenchNvmeArgs) -> Result<()> {
    use megatrain::spill::io::EngineKind;
    let engine = if a.no_uring {
        EngineKind::Sync
    } else {
        EngineKind::Auto
    };
    let r = megatrain::bench::nvme::run(&megatrain::bench::nvme::NvmeBench {
        dirs: a.dir.clone(),
        size: a.size as u64,
        reps: a.reps,
        engine,
        blocks: a.block.clone(),
        depths: a.qd.clone(),
        pages: a.pages,
        with_fio: a.fio,
    })?;
    print_report(a.json, &Report::Nvme(r), Report::render);
    Ok(())
}

#[derive(Debug, Args)]
pub struct BenchIoArgs {
    /// Directory on the disk to measure (a scratch subdirectory is made and removed).
    #[arg(long)]
    dir: PathBuf,
    /// Parameters of the model (K/M/G suffixes, powers of 1000): its host state must fit in
    /// RAM, its checkpoint and export on the disk.
    #[arg(long, default_value = "500M", value_parser = megatrain::util::size::parse_count)]
    params: usize,
    /// The checkpoint's Adam moments.
    #[arg(long, value_enum, default_value = "fp32")]
    adam_state: megatrain::store::layout::AdamState,
    /// The export's dtype.
    #[arg(long, value_enum, default_value = "bf16")]
    export_dtype: megatrain::store::hf::ExportDtype,
    /// Passes of every phase (a disk's rate drifts between passes); the median is reported.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn bench_io(a: &BenchIoArgs) -> Result<()> {
    let machine = topology::probe(&TopologySource::Live)?;
    let r = megatrain::bench::io::run(
        &machine,
        &megatrain::bench::io::IoBench {
            dir: a.dir.clone(),
            params: a.params as u64,
            adam_state: a.adam_state,
            export_dtype: a.export_dtype,
            reps: a.reps,
        },
    )?;
    print_report(a.json, &r, megatrain::bench::io::render);
    Ok(())
}

#[derive(Debug, Args)]
pub struct BenchEngineArgs {
    /// Measured steps per configuration (after one warm-up step).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Write each configuration's timeline (Chrome trace JSON, opens in Perfetto) into this directory.
    #[arg(long, value_name = "DIR")]
    trace_dir: Option<PathBuf>,
    /// Directory for the spill-bound cases' files (default: the system temp directory).
    #[arg(long, value_name = "DIR")]
    nvme: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn bench_engine(args: &BenchEngineArgs) -> Result<()> {
    let machine = topology::probe(&TopologySource::Live)?;
    let nvme = args.nvme.clone().unwrap_or_else(std::env::temp_dir);
    let cases =
        megatrain::bench::engine::run(&machine, args.steps, &nvme, args.trace_dir.as_deref())?;
    print_report(
        args.json,
        cases.as_slice(),
        megatrain::bench::engine::render,
    );
    Ok(())
}

#[derive(Debug, Args)]
pub struct BenchAdamArgs {
    /// Parameters per iteration (K/M/G suffixes allowed).
    #[arg(long, default_value = "64M", value_parser = megatrain::util::size::parse_count)]
    params: usize,
    /// Worker threads (default: every CPU of the node).
    #[arg(long)]
    threads: Option<usize>,
    /// NUMA node (default: the first node with CPUs).
    #[arg(long)]
    node: Option<u32>,
    /// Timed repetitions; the median is reported.
    #[arg(long, default_value_t = 10)]
    reps: usize,
    /// Force an implementation instead of the best this CPU has.
    #[arg(long, value_enum)]
    isa: Option<megatrain::optim::adamw::Isa>,
    /// The Adam moment formats to measure, each in its own store (comma-separated).
    #[arg(
        long,
        value_enum,
        value_delimiter = ',',
        default_value = "fp32,bf16,int8"
    )]
    adam_state: Vec<megatrain::store::layout::AdamState>,
    /// How the fp32 master is stored, each measured with every moment format (comma-separated):
    /// fp32, or planes (the bf16 high halves the device streams, then the low halves).
    #[arg(long, value_enum, value_delimiter = ',', default_value = "fp32,planes")]
    master: Vec<megatrain::store::layout::MasterFormat>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn bench_adam(args: &BenchAdamArgs) -> Result<()> {
    let isa = args.isa;
    if let Some(i) = isa {
        if !megatrain::optim::adamw::supported(i) {
            return Err(megatrain::Error::bad_input(
                "--isa",
                format!("{i:?}"),
                "this CPU does not support it",
                None,
            ));
        }
    }
    let machine = topology::probe(&TopologySource::Live)?;
    let report = megatrain::bench::adam::run(
        &machine,
        &megatrain::bench::adam::AdamBenchArgs {
            params: args.params,
            threads: args.threads,
            node: args.node,
            reps: args.reps,
            isa,
            states: args.adam_state.clone(),
            masters: args.master.clone(),
        },
    )?;
    print_report(args.json, &Report::Adam(report), Report::render);
    Ok(())
}
