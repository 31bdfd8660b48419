//! The `megatrain` command line: one module per subcommand, each its clap arguments and the
//! function that runs it. The only code that prints or exits.

mod bench;
mod export;
mod generate;
mod plan;
mod prepare;
mod probe;
mod progress;
mod selftest;
mod train;

use clap::{Parser, Subcommand};
use std::process::ExitCode;

/// Full-precision LLM training on one GPU, with the training state in host memory.
#[derive(Debug, Parser)]
#[command(
    name = "megatrain",
    version,
    about,
    propagate_version = true,
    after_help = "Examples (one per command; `megatrain COMMAND --help` for its settings):
  megatrain train --demo                                  train the embedded default model
  megatrain train --init-from ./Llama-3.2-1B --data train.bin --steps 1000 --checkpoint-dir ckpt
  megatrain prepare --format chat --tokenizer ./Llama-3.2-1B --input chat.jsonl --out sft.bin
  megatrain generate --checkpoint ckpt --prompt 'Once upon a time' --max-new-tokens 64
  megatrain export --checkpoint ckpt --out hf --dtype bf16
  megatrain plan --model llama-120b --machine h200-1.5tb --adam-state int8
  megatrain probe --json > machine.json
  megatrain bench adam --params 64M
  megatrain selftest --device cuda"
)]
pub struct Cli {
    #[command(subcommand)]
    command: Command,
}

#[derive(Debug, Subcommand)]
enum Command {
    /// Show the machine: packages, NUMA nodes, GPUs, NVMe, and what is close to what.
    Probe(probe::ProbeArgs),
    /// Measure a component next to the physical limit measured in the same run.
    #[command(
        subcommand,
        after_help = "Examples:
  megatrain bench adam --params 64M            AdamW against the memory bandwidth
  megatrain bench io --dir /nvme/ckpt          checkpoint, resume, export, load against dd
  megatrain bench nvme --dir /nvme/spill       the spill tier against fio-style raw I/O
  megatrain bench engine                       streamed steps against the planner's prediction
  megatrain bench link                         host↔GPU copies (a CUDA build, a GPU)"
    )]
    Bench(bench::BenchCommand),
    /// Train a model (every key of CONFIG.toml is also a flag; flags win).
    Train(Box<train::TrainArgs>),
    /// Write a training checkpoint as a Hugging Face model (config.json + safetensors).
    Export(export::ExportArgs),
    /// Continue a prompt with a Hugging Face model or a training checkpoint (greedy or sampled,
    /// on the training device, no KV cache: each token is a forward pass of the sequence).
    Generate(generate::GenerateArgs),
    /// Tokenize a dataset (.txt, JSON Lines, Parquet shards, Arrow / `save_to_disk` folders) into a token or document file for --data.
    Prepare(prepare::PrepareArgs),
    /// Will it fit, and how fast will it go: memory per tier and a predicted step time.
    Plan(plan::PlanArgs),
    /// Check a device on this machine: every CUDA kernel and GEMM against the CPU reference on
    /// fresh random inputs, training steps against the CPU device, then the host↔device
    /// bandwidth (needs a GPU and `--features cuda`).
    Selftest(selftest::SelftestArgs),
    /// Describe an hwloc XML file as JSON: `probe --topology` runs this in a child process, so a
    /// file that crashes hwloc (C, trusting its input) is an error, not a crash.
    #[command(name = "__vet-topology", hide = true)]
    VetTopology {
        /// The XML file.
        file: std::path::PathBuf,
        /// Also write it back as hwloc XML.
        #[arg(long)]
        export_xml: Option<std::path::PathBuf>,
    },
    /// Render chat templates for `prepare` in a child process capped at LIMIT bytes of data
    /// (JSON lines on stdin and stdout), so a template that builds huge strings is an error.
    #[command(name = "__render-chat", hide = true)]
    RenderChat {
        /// Memory cap, bytes.
        limit: u64,
    },
}

/// Parse the command line, run the command, and turn its outcome into the exit status: 0, the
/// error's status (2 bad input, 1 machine or library) after one `error:` line, or 128+signal
/// for a run stopped by a signal.
pub fn main() -> ExitCode {
    megatrain::util::contain::quiet_hook();
    progress::install();
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Probe(a) => probe::run(a).map(|()| 0),
        Command::Bench(b) => bench::run(b).map(|()| 0),
        Command::Train(a) => train::run(a),
        Command::Export(a) => export::run(a).map(|()| 0),
        Command::Generate(a) => generate::run(a).map(|()| 0),
        Command::Prepare(a) => prepare::run(a).map(|()| 0),
        Command::Plan(a) => plan::run(a).map(|()| 0),
        Command::Selftest(a) => selftest::run(a).map(|()| 0),
        Command::VetTopology { file, export_xml } => {
            probe::vet(file, export_xml.as_deref()).map(|()| 0)
        }
        Command::RenderChat { limit } => megatrain::train::chat_worker::serve(
            *limit,
            std::io::stdin().lock(),
            std::io::stdout().lock(),
        )
        .map(|()| 0),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            // Never a panic: stderr may be a terminal that hung up.
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr(), "error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

/// Print a report as JSON (`--json`) or as its text table.
fn print_report<T: serde::Serialize + ?Sized>(
    json: bool,
    report: &T,
    render: impl Fn(&T) -> String,
) {
    let text = if json {
        serde_json::to_string_pretty(report).unwrap_or_default()
    } else {
        render(report)
    };
    println!("{}", text.trim_end());
}
