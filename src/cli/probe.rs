//! `megatrain probe`: the machine (or an hwloc XML / synthetic topology) as a report or JSON.

use clap::Args;
use megatrain::topology::{self, TopologySource};
use megatrain::Result;
use std::io::Write;
use std::path::PathBuf;

#[derive(Debug, Args)]
#[command(after_help = "Examples:
  megatrain probe                          this machine: NUMA nodes, GPUs, NVMe, what is close to what
  megatrain probe --json > machine.json    for `megatrain plan --machine machine.json`
  megatrain probe --topology server.xml    an hwloc XML export of another machine")]
pub struct ProbeArgs {
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

pub fn run(args: &ProbeArgs) -> Result<()> {
    let source = match (&args.topology, &args.synthetic) {
        (Some(path), _) => TopologySource::XmlFile(path.clone()),
        (None, Some(desc)) => TopologySource::Synthetic(desc.clone()),
        (None, None) => TopologySource::Live,
    };
    let machine = match &source {
        // An XML file is read in a child process only (hwloc may crash on a malformed one).
        TopologySource::XmlFile(path) => {
            let exe = std::env::current_exe()
                .map_err(|e| megatrain::Error::system("megatrain", "find its own executable", e))?;
            topology::hwloc::describe_in_child(&exe, path, args.export_xml.as_deref())?
        }
        _ => {
            let topo = topology::hwloc::load(&source)?;
            let machine = topology::describe(&topo, &source)?;
            if let Some(path) = &args.export_xml {
                topology::hwloc::export_xml(&topo, path)?;
            }
            machine
        }
    };
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

/// Load `file` with hwloc, describe it as JSON on stdout and export it to `export_xml` if given
/// (run in a child by `probe --topology`).
pub fn vet(file: &std::path::Path, export_xml: Option<&std::path::Path>) -> Result<()> {
    let source = TopologySource::XmlFile(file.to_owned());
    let topo = topology::hwloc::load(&source)?;
    let machine = topology::describe(&topo, &source)?;
    if let Some(path) = export_xml {
        topology::hwloc::export_xml(&topo, path)?;
    }
    let _ = writeln!(std::io::stdout().lock(), "{}", machine.to_json());
    Ok(())
}
