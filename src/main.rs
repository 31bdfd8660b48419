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
    };
    match result {
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}
