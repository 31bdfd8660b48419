//! The `megatrain` command line.
#![allow(clippy::print_stdout, clippy::print_stderr, clippy::exit)]

use clap::{Args, Parser, Subcommand};
use megatrain::topology::{self, TopologySource};
use megatrain::Result;
use std::io::Write;
use std::path::PathBuf;
use std::process::ExitCode;

/// Full-precision LLM training on one GPU, with the training state in host memory.
#[derive(Debug, Parser)]
#[command(name = "megatrain", version, about, propagate_version = true)]
struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Show the machine: packages, NUMA nodes, GPUs, NVMe, and what is close to what.
    Probe(ProbeArgs),
    /// Measure a component next to the physical limit measured in the same run.
    #[command(subcommand)]
    Bench(BenchCommand),
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// CPU AdamW (the real store and worker pool) vs a STREAM triad on the same node and threads.
    Adam(BenchAdamArgs),
    /// The streaming pipeline on the CPU device with an emulated link: step time vs the serial sum
    /// and the ideal max(compute, transfer, AdamW), for link-, compute- and AdamW-bound cases.
    Engine(BenchEngineArgs),
}

#[derive(Debug, Args)]
struct BenchEngineArgs {
    /// Measured steps per configuration (after one warm-up step).
    #[arg(long, default_value_t = 5)]
    steps: usize,
    /// Write each configuration's timeline (Chrome trace JSON, opens in Perfetto) into this directory.
    #[arg(long, value_name = "DIR")]
    trace_dir: Option<PathBuf>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

fn bench_engine(args: &BenchEngineArgs) -> Result<()> {
    let machine = topology::probe(&TopologySource::Live)?;
    let cases =
        megatrain::bench::engine::run(&machine, args.steps.max(1), args.trace_dir.as_deref())?;
    let text = if args.json {
        serde_json::to_string_pretty(&cases).unwrap_or_default()
    } else {
        megatrain::bench::engine::render(&cases)
    };
    println!("{}", text.trim_end());
    Ok(())
}

#[derive(Debug, Args)]
struct BenchAdamArgs {
    /// Parameters per iteration (K/M/G suffixes allowed).
    #[arg(long, default_value = "64M", value_parser = megatrain::bench::parse_count)]
    params: usize,
    /// Worker threads (default: every CPU of the node).
    #[arg(long)]
    threads: Option<usize>,
    /// NUMA node (default: the first node with CPUs).
    #[arg(long)]
    node: Option<u32>,
    /// Also write the bf16 shadow of the parameters (30 B/param).
    #[arg(long)]
    shadow: bool,
    /// Timed repetitions; the median is reported.
    #[arg(long, default_value_t = 10)]
    reps: usize,
    /// Force an implementation instead of the best this CPU has.
    #[arg(long, value_enum)]
    isa: Option<IsaArg>,
    /// Print JSON.
    #[arg(long)]
    json: bool,
}

#[derive(Debug, Clone, Copy, clap::ValueEnum)]
enum IsaArg {
    Scalar,
    Avx2,
    Avx512,
    Neon,
}

fn bench_adam(args: &BenchAdamArgs) -> Result<()> {
    use megatrain::optim::adamw::Isa;
    let isa = args.isa.map(|i| match i {
        IsaArg::Scalar => Isa::Scalar,
        IsaArg::Avx2 => Isa::Avx2,
        IsaArg::Avx512 => Isa::Avx512,
        IsaArg::Neon => Isa::Neon,
    });
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
            shadow: args.shadow,
            reps: args.reps,
            isa,
        },
    )?;
    let text = if args.json {
        serde_json::to_string_pretty(&report).unwrap_or_default()
    } else {
        megatrain::bench::adam::render(&report)
    };
    println!("{}", text.trim_end());
    Ok(())
}

#[derive(Debug, Args)]
struct ProbeArgs {
    /// Print the machine description as JSON (schema: docs/probe-schema.md).
    #[arg(long)]
    json: bool,
    /// Read an hwloc XML export instead of probing this machine.
    #[arg(long, value_name = "FILE.xml", conflicts_with = "synthetic")]
    topology: Option<PathBuf>,
    /// Build an hwloc synthetic topology, e.g. "pack:2 numa:4 core:8 pu:2".
    #[arg(long, value_name = "DESC")]
    synthetic: Option<String>,
    /// Also write the topology as hwloc XML (attach it to a bug report).
    #[arg(long, value_name = "FILE")]
    export_xml: Option<PathBuf>,
}

fn probe(args: &ProbeArgs) -> Result<()> {
    let source = match (&args.topology, &args.synthetic) {
        (Some(path), _) => TopologySource::XmlFile(path.clone()),
        (None, Some(desc)) => TopologySource::Synthetic(desc.clone()),
        (None, None) => TopologySource::Live,
    };
    let topo = topology::hwloc::load(&source)?;
    let machine = topology::describe(&topo, &source)?;
    if let Some(path) = &args.export_xml {
        topology::hwloc::export_xml(&topo, path)?;
    }
    let text = if args.json {
        machine.to_json()
    } else {
        topology::render::report(&machine)
    };
    let mut out = std::io::stdout().lock();
    // A closed pipe (`megatrain probe | head`) is not an error worth reporting.
    let _ = writeln!(out, "{}", text.trim_end());
    if let Some(path) = &args.export_xml {
        eprintln!("wrote hwloc XML to {}", path.display());
    }
    Ok(())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Probe(args) => probe(args),
        Command::Bench(BenchCommand::Adam(args)) => bench_adam(args),
        Command::Bench(BenchCommand::Engine(args)) => bench_engine(args),
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
