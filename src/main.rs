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
    /// Train a model (every key of CONFIG.toml is also a flag; flags win).
    Train(Box<TrainArgs>),
    /// Write a training checkpoint as a Hugging Face model (config.json + safetensors).
    Export(ExportArgs),
    /// Tokenize text (.txt, or .jsonl with one document per line) into a token file for --data.
    Prepare(PrepareCliArgs),
    /// Will it fit, and how fast will it go: memory per tier and a predicted step time.
    Plan(PlanArgs),
    /// Check a device on this machine: every CUDA kernel and GEMM against the CPU reference on
    /// fresh random inputs, then the host↔device bandwidth (needs a GPU and `--features cuda`).
    Selftest(SelftestArgs),
    /// Load an hwloc XML file and exit: `probe --topology` runs this in a child process first,
    /// so a file that crashes hwloc (C, trusting its input) is an error, not a crash.
    #[command(name = "__vet-topology", hide = true)]
    VetTopology {
        /// The XML file.
        file: PathBuf,
    },
}

#[derive(Debug, Args)]
struct SelftestArgs {
    /// The device to check.
    #[arg(long, value_enum)]
    device: megatrain::train::config::DeviceKind,
    /// GPU index.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 1)]
    seed: u64,
}

#[cfg(not(feature = "cuda"))]
fn selftest(a: &SelftestArgs) -> Result<()> {
    Err(megatrain::Error::bad_input(
        "selftest",
        format!("--device {:?}", a.device).to_lowercase(),
        "this binary was built without CUDA support",
        Some("build with `cargo build --release --features cuda` (no toolkit needed to build) and run on a GPU machine"),
    ))
}

#[cfg(feature = "cuda")]
fn selftest(a: &SelftestArgs) -> Result<()> {
    use megatrain::device::cuda::CudaRuntime;
    use megatrain::selftest::{cuda, Check};
    if a.device != megatrain::train::config::DeviceKind::Cuda {
        return Err(megatrain::Error::bad_input(
            "selftest",
            "--device cpu",
            "the CPU device is the reference itself; it is checked by the test suite",
            Some("use --device cuda"),
        ));
    }
    let rt = CudaRuntime::open(a.gpu)?;
    println!(
        "megatrain selftest — {} (sm_{}{}, {} SMs), driver {}.{}, kernels compiled by NVRTC at start-up\n",
        rt.name,
        rt.cc.0,
        rt.cc.1,
        rt.sms,
        rt.driver / 1000,
        rt.driver % 1000 / 10
    );
    let print = |checks: &[Check]| {
        for c in checks {
            println!(
                "{:<44} {:>12.3e} {:>10.0e}  {}",
                c.name,
                c.max_rel_err,
                c.tolerance,
                if c.pass { "pass" } else { "FAIL" }
            );
        }
    };
    println!(
        "{:<44} {:>12} {:>10}  result",
        "check", "max rel err", "tolerance"
    );
    let mut checks = cuda::kernels(&rt, a.seed)?;
    print(&checks);
    // Training steps through the streaming CUDA device against the CPU device; an error there
    // is a failed check, printed, and the link is still measured.
    let training = match cuda::training(a.gpu, a.seed) {
        Ok(c) => c,
        Err(e) => {
            println!("training steps on the CUDA device stopped: {e}");
            vec![Check {
                name: "training: steps ran".into(),
                max_rel_err: f64::INFINITY,
                tolerance: cuda::TOL_TRAINING,
                pass: false,
            }]
        }
    };
    print(&training);
    checks.extend(training);
    let (htod, dtoh) = cuda::link(&rt)?;
    println!("\nlink (256 MiB, page-locked, median of 5): host→device {htod:.1} GB/s, device→host {dtoh:.1} GB/s");
    let failed = checks.iter().filter(|c| !c.pass).count();
    if failed > 0 {
        return Err(megatrain::Error::system(
            "selftest",
            "checks",
            format!("{failed} of {} checks failed", checks.len()),
        ));
    }
    Ok(())
}

#[derive(Debug, Args)]
struct PlanArgs {
    /// A model preset (llama-3-8b, llama-3-70b, llama-3-405b, qwen2.5-14b, qwen2.5-32b,
    /// qwen2.5-72b, llama-120b) or an HF config.json.
    #[arg(long)]
    model: String,
    /// A machine preset (h200-1.5tb, gh200-480gb, h100-512gb, rtx4090-256gb) or a
    /// `megatrain probe --json` file.
    #[arg(long)]
    machine: String,
    /// GPU index within a probed machine.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// Tokens per optimizer step.
    #[arg(long, default_value_t = 65536)]
    tokens_per_step: u64,
    /// Sequence length.
    #[arg(long, default_value_t = 4096)]
    seq_len: u64,
    /// Tokens per micro-batch (default: the largest that fits the GPU).
    #[arg(long)]
    micro_batch_tokens: Option<u64>,
    #[arg(long, value_enum, default_value = "fp32")]
    precision: megatrain::train::config::Precision,
    #[arg(long, value_enum, default_value = "exact")]
    mode: megatrain::store::layout::Mode,
    /// NVMe directories for spilling Adam m/v (each assumed 3 GB/s unless calibrated).
    #[arg(long, value_name = "DIR")]
    nvme: Vec<PathBuf>,
    /// Measurements from the machine (repeatable): `megatrain bench adam --json` sets the AdamW
    /// rate, `megatrain bench nvme --json` the NVMe rate (and allows spilling m/v),
    /// `megatrain bench link --json` on a GPU machine the host↔device rates.
    #[arg(long, value_name = "bench.json")]
    calibration: Vec<PathBuf>,
    #[arg(long)]
    json: bool,
}

fn plan(a: &PlanArgs) -> Result<()> {
    use megatrain::plan::{self as pl, presets};
    let model = match presets::model(&a.model) {
        Some(m) => m,
        None => megatrain::model::config::ModelConfig::from_file(std::path::Path::new(&a.model))
            .map_err(|e| e.with_fix(format!("or use a preset: {}", presets::MODELS.join(", "))))?,
    };
    let (mut adam, mut nvme_measured, mut link_measured) = (None, None, None);
    for p in &a.calibration {
        let text = std::fs::read_to_string(p)
            .map_err(|e| megatrain::Error::io("read calibration", p, e))?;
        let bad = |why: String| {
            megatrain::Error::bad_input(
                "calibration",
                p.display().to_string(),
                why,
                Some("pass the JSON of `megatrain bench adam|nvme|link --json`"),
            )
        };
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| bad(format!("not JSON: {e}")))?;
        if let Some(g) = v["adam"]["gbytes_per_s"].as_f64() {
            adam = Some(g);
        } else if let Some(cases) = v["gpu"]["cases"].as_array() {
            // `bench link` on a GPU machine: the best page-locked copy each way (the store is
            // page-locked and placed GPU-local).
            let best = |dir: &str| {
                cases
                    .iter()
                    .filter(|c| c["direction"] == dir && c["pinned"] == true)
                    .filter_map(|c| c["gbps"].as_f64())
                    .fold(0.0f64, f64::max)
            };
            link_measured = Some((best("htod"), best("dtoh")));
        } else if let Some(cases) = v["cases"]
            .as_array()
            .filter(|c| c.iter().any(|x| x["read_gbps"].is_number()))
        {
            // The spill tier streams large extents at a deep queue: take the best case, and the
            // slower of its read and write (a step does both).
            let best = cases
                .iter()
                .filter_map(|c| Some(c["read_gbps"].as_f64()?.min(c["write_gbps"].as_f64()?)))
                .fold(0.0f64, f64::max);
            nvme_measured = Some(best);
        } else {
            return Err(bad("not an AdamW, NVMe or (GPU) link benchmark".into()));
        }
    }
    let nvme = nvme_measured.or((!a.nvme.is_empty()).then_some(3.0 * a.nvme.len() as f64));
    let mut notes = Vec::new();
    let mut described = None;
    let mut hw = match presets::machine(&a.machine) {
        Some(h) => h,
        None => {
            let path = std::path::Path::new(&a.machine);
            let text = std::fs::read_to_string(path).map_err(|e| {
                megatrain::Error::io("read machine", path, e)
                    .with_fix(format!("or use a preset: {}", presets::MACHINES.join(", ")))
            })?;
            let m = megatrain::topology::Machine::from_json(&text, &a.machine)?;
            let (h, n) = pl::hardware_from_machine(&m, a.gpu, adam, nvme)?;
            notes = n;
            described = Some(m);
            h
        }
    };
    if let Some(g) = adam {
        hw.adam_gbps = g;
    }
    if let Some((h, d)) = link_measured.filter(|(h, d)| *h > 0.0 && *d > 0.0) {
        hw.htod_gbps = h;
        hw.dtoh_gbps = d;
        notes.push(format!(
            "link calibrated: {h:.1} GB/s host→device, {d:.1} GB/s device→host"
        ));
    }
    if nvme.is_some() {
        hw.nvme_gbps = nvme;
        if nvme_measured.is_none() {
            notes.push(format!(
                "NVMe assumed 3 GB/s per directory ({} given); pass --calibration from `megatrain bench nvme --json`",
                a.nvme.len()
            ));
        }
    }
    let req = pl::PlanRequest {
        tokens_per_step: a.tokens_per_step,
        seq_len: a.seq_len,
        bf16: a.precision == megatrain::train::config::Precision::Bf16,
        mode: a.mode,
        spill_moments: nvme.is_some(),
        micro_batch_tokens: a.micro_batch_tokens,
    };
    req.validate()?;
    let p = pl::plan(&model, &hw, &req);
    // Per NUMA node, where the machine is described (a probe), by the trainer's placement.
    let nodes = described
        .as_ref()
        .map(|m| pl::per_node(m, a.gpu, &model, &req).map_err(|e| e.to_string()));
    if a.json {
        let per_node = match &nodes {
            Some(Ok(n)) => serde_json::to_value(n).unwrap_or_default(),
            Some(Err(e)) => serde_json::json!({ "error": e }),
            None => serde_json::Value::Null,
        };
        let v = serde_json::json!({ "model": a.model, "machine": hw, "request": req, "plan": p, "numa_nodes": per_node, "assumptions": notes });
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    } else {
        print!("{}", pl::render(&a.model, &hw, &req, &p));
        match &nodes {
            Some(Ok(n)) => {
                println!("  host state per NUMA node (the trainer's placement):");
                for x in n {
                    println!(
                        "    node {:<3} {:>12} of {:>12} usable{}",
                        x.node,
                        megatrain::util::human_bytes(x.bytes),
                        megatrain::util::human_bytes(x.capacity),
                        if x.adam_cpus.is_empty() {
                            ""
                        } else {
                            ", AdamW workers here"
                        }
                    );
                }
            }
            Some(Err(e)) => println!("  host state per NUMA node: does not place: {e}"),
            None => println!(
                "  host state per NUMA node: give a `megatrain probe --json` machine to see it"
            ),
        }
        for n in &notes {
            println!("  assumption: {n}");
        }
        println!("  sources: {}", hw.sources);
    }
    Ok(())
}

#[derive(Debug, Args)]
struct PrepareCliArgs {
    /// A Hugging Face tokenizer.json.
    #[arg(long, value_name = "tokenizer.json")]
    tokenizer: PathBuf,
    /// Input text: .txt (one document) or .jsonl (one document per line).
    #[arg(long, value_name = "FILE")]
    input: PathBuf,
    /// Output token file.
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
    /// Element type (default: u16 when the vocabulary fits).
    #[arg(long, value_enum)]
    dtype: Option<megatrain::train::config::DataDtype>,
    /// JSON Lines field holding the text.
    #[arg(long, default_value = "text")]
    text_key: String,
    /// EOS token appended after each document (default: the tokenizer's own).
    #[arg(long)]
    eos: Option<String>,
}

fn prepare(a: &PrepareCliArgs) -> Result<()> {
    let r = megatrain::train::prepare::prepare(&megatrain::train::prepare::PrepareArgs {
        tokenizer: a.tokenizer.clone(),
        input: a.input.clone(),
        out: a.out.clone(),
        dtype: a.dtype,
        text_key: a.text_key.clone(),
        eos: a.eos.clone(),
    })?;
    eprintln!(
        "wrote {} tokens ({:?}, vocab {}) from {} document(s) to {}{}",
        r.tokens,
        r.dtype,
        r.vocab,
        r.documents,
        a.out.display(),
        r.eos_id
            .map_or(String::new(), |e| format!("; documents end with token {e}"))
    );
    Ok(())
}

#[derive(Debug, Args)]
struct ExportArgs {
    /// A checkpoint directory (`.../step-00000100`) or a checkpoint root (the newest is used).
    #[arg(long, value_name = "DIR")]
    checkpoint: PathBuf,
    /// Output directory (must not exist or be empty).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
}

#[derive(Debug, Args)]
struct TrainArgs {
    /// TOML file with any of the settings below (keys use `_`).
    config: Option<PathBuf>,
    /// Train the embedded default: a 3M-parameter byte-level Llama on this repository's own docs
    /// and source, through the full streaming pipeline, about 3 minutes on 2 cores. Its outputs
    /// go to DEMO_DIR/demo; `--demo --resume` continues it.
    #[arg(long)]
    demo: bool,
    /// Where the demo writes its outputs (in a `demo` directory inside).
    #[arg(long, value_name = "DIR", default_value = "out")]
    demo_dir: PathBuf,
    #[arg(long, value_name = "DIR")]
    init_from: Option<PathBuf>,
    #[arg(long, value_name = "CONFIG.json")]
    model: Option<PathBuf>,
    #[arg(long, value_name = "FILE")]
    data: Option<PathBuf>,
    #[arg(long, value_enum)]
    data_dtype: Option<megatrain::train::config::DataDtype>,
    #[arg(long, value_name = "FILE")]
    val_data: Option<PathBuf>,
    #[arg(long)]
    seq_len: Option<usize>,
    #[arg(long)]
    batch_size: Option<usize>,
    #[arg(long)]
    grad_accum: Option<usize>,
    #[arg(long)]
    steps: Option<u64>,
    #[arg(long, allow_negative_numbers = true)]
    lr: Option<f64>,
    #[arg(long, allow_negative_numbers = true)]
    beta1: Option<f64>,
    #[arg(long, allow_negative_numbers = true)]
    beta2: Option<f64>,
    #[arg(long, allow_negative_numbers = true)]
    eps: Option<f64>,
    #[arg(long, allow_negative_numbers = true)]
    weight_decay: Option<f64>,
    #[arg(long)]
    decay_norms: Option<bool>,
    /// Global-norm clipping (0 disables).
    #[arg(long, allow_negative_numbers = true)]
    grad_clip: Option<f64>,
    #[arg(long, value_enum)]
    lr_schedule: Option<megatrain::train::config::LrSchedule>,
    #[arg(long)]
    warmup_steps: Option<u64>,
    #[arg(long)]
    seed: Option<u64>,
    #[arg(long)]
    shuffle: bool,
    #[arg(long, value_name = "FILE.jsonl")]
    metrics: Option<PathBuf>,
    #[arg(long, value_name = "DIR")]
    checkpoint_dir: Option<PathBuf>,
    #[arg(long)]
    checkpoint_every: Option<u64>,
    #[arg(long)]
    keep_checkpoints: Option<usize>,
    /// Continue from the newest checkpoint in --checkpoint-dir (an error when there is none);
    /// `--resume auto`: continue if there is one, else start fresh (preemptible jobs).
    #[arg(long, value_enum, num_args = 0..=1, default_missing_value = "always", value_name = "WHEN")]
    resume: Option<megatrain::train::config::Resume>,
    #[arg(long, value_name = "DIR")]
    export_hf: Option<PathBuf>,
    #[arg(long, value_enum)]
    device: Option<megatrain::train::config::DeviceKind>,
    /// Device memory budget of the CPU device, bytes (K/M/G or Ki/Mi/Gi suffixes).
    #[arg(long, value_parser = megatrain::bench::parse_count)]
    device_memory: Option<usize>,
    /// CUDA: TF32 tensor cores for the fp32 GEMMs.
    #[arg(long)]
    tf32: bool,
    /// Pages backing the host store (2m/1g need reserved hugetlbfs pages).
    #[arg(long, value_enum)]
    huge_pages: Option<megatrain::host::PageKind>,
    /// mlock the host store.
    #[arg(long)]
    lock_memory: bool,
    /// Directory for the NVMe spill tier (repeat, one per device).
    #[arg(long, value_name = "DIR")]
    nvme: Vec<PathBuf>,
    /// When Adam m/v go to NVMe (auto: only what RAM lacks, and only with --nvme).
    #[arg(long, value_enum)]
    spill: Option<megatrain::store::placement::SpillPolicy>,
    /// RAM staging slots of the spill tier.
    #[arg(long)]
    spill_staging: Option<usize>,
    /// Spill I/O engine: auto, uring, sync (pread/pwrite threads).
    #[arg(long)]
    io_engine: Option<megatrain::spill::io::EngineKind>,
    /// Buffered spill I/O instead of O_DIRECT.
    #[arg(long)]
    no_direct_io: bool,
    /// Cap on the host RAM the state may use (K/M/G suffixes).
    #[arg(long, value_parser = megatrain::bench::parse_count)]
    ram_budget: Option<usize>,
    /// Where activation checkpoints live (default: device when they fit, else host).
    #[arg(long, value_enum)]
    activations: Option<megatrain::train::config::Activations>,
    #[arg(long, value_enum)]
    precision: Option<megatrain::train::config::Precision>,
    #[arg(long, value_enum)]
    mode: Option<megatrain::store::layout::Mode>,
    #[arg(long, value_name = "FILE")]
    trace: Option<PathBuf>,
    #[arg(long)]
    val_every: Option<u64>,
    #[arg(long)]
    val_batches: Option<usize>,
}

impl TrainArgs {
    /// Flags over the file's values.
    fn merge(
        &self,
        mut c: megatrain::train::config::TrainConfig,
    ) -> megatrain::train::config::TrainConfig {
        macro_rules! set {
            ($($f:ident),*) => { $( if let Some(v) = &self.$f { c.$f = v.clone().into(); } )* };
        }
        set!(
            init_from,
            model,
            data,
            val_data,
            metrics,
            checkpoint_dir,
            export_hf,
            trace
        );
        macro_rules! setv {
            ($($f:ident),*) => { $( if let Some(v) = self.$f { c.$f = v; } )* };
        }
        setv!(
            data_dtype,
            seq_len,
            batch_size,
            grad_accum,
            steps,
            lr,
            beta1,
            beta2,
            eps,
            weight_decay,
            decay_norms,
            grad_clip,
            lr_schedule,
            warmup_steps,
            seed,
            checkpoint_every,
            keep_checkpoints,
            device,
            huge_pages,
            spill,
            spill_staging,
            io_engine,
            precision,
            val_every,
            val_batches
        );
        if !self.nvme.is_empty() {
            c.nvme = self.nvme.clone();
        }
        if let Some(m) = self.mode {
            c.mode = Some(m);
        }
        if let Some(a) = self.activations {
            c.activations = Some(a);
        }
        if let Some(b) = self.ram_budget {
            c.ram_budget = Some(b as u64);
        }
        if let Some(b) = self.device_memory {
            c.device_memory = b as u64;
        }
        c.direct_io &= !self.no_direct_io;
        c.shuffle |= self.shuffle;
        if let Some(r) = self.resume {
            c.resume = r;
        }
        c.lock_memory |= self.lock_memory;
        c.tf32 |= self.tf32;
        c
    }
}

struct Reporter {
    bar: Option<indicatif::ProgressBar>,
    total: u64,
    last_plain: std::time::Instant,
}

impl megatrain::train::Progress for Reporter {
    fn start(&mut self, first: u64, total: u64, params: usize) {
        self.total = total;
        eprintln!("training {params} parameters, steps {first}..={total}");
        if std::io::IsTerminal::is_terminal(&std::io::stderr()) {
            let bar = indicatif::ProgressBar::new(total);
            bar.set_position(first.saturating_sub(1));
            if let Ok(style) =
                indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} {msg} eta {eta}")
            {
                bar.set_style(style);
            }
            self.bar = Some(bar);
        }
    }
    fn step(&mut self, m: &megatrain::engine::StepMetrics, val: Option<f64>) {
        let msg = format!(
            "loss {:.4}{} · {:.0} tok/s · lr {:.2e}",
            m.loss,
            val.map_or(String::new(), |v| format!(" (val {v:.4})")),
            m.tokens as f64 / m.wall_s,
            m.lr
        );
        match &self.bar {
            Some(b) => {
                b.set_position(m.step);
                b.set_message(msg);
            }
            None => {
                if m.step == 1
                    || m.step == self.total
                    || val.is_some()
                    || self.last_plain.elapsed().as_secs() >= 5
                {
                    eprintln!("step {}/{} {msg}", m.step, self.total);
                    self.last_plain = std::time::Instant::now();
                }
            }
        }
    }
    fn checkpoint(&mut self, d: &std::path::Path) {
        let line = format!("checkpoint {}", d.display());
        match &self.bar {
            Some(b) => b.println(line),
            None => eprintln!("{line}"),
        }
    }
    fn note(&mut self, line: &str) {
        eprintln!("{line}");
    }
}

/// Prepare the embedded default job in `dir/demo` and return its configuration. The data are
/// rewritten (identically) each time, so `--demo --resume` continues a demo run.
fn demo_config(dir: &std::path::Path) -> Result<megatrain::train::config::TrainConfig> {
    use megatrain::train::config::{LrSchedule, TrainConfig};
    let run = dir.join("demo");
    let data = run.join("data");
    std::fs::create_dir_all(&data)
        .map_err(|e| megatrain::Error::io("create directory", &data, e))?;
    let bytes = megatrain::train::corpus::bytes();
    let split = bytes.len() * 95 / 100;
    let tokens = |b: &[u8]| {
        b.iter()
            .flat_map(|&x| u16::from(x).to_le_bytes())
            .collect::<Vec<u8>>()
    };
    megatrain::util::write_atomic(&data.join("train.bin"), &tokens(&bytes[..split]))?;
    megatrain::util::write_atomic(&data.join("val.bin"), &tokens(&bytes[split..]))?;
    megatrain::util::write_atomic(
        &run.join("model.json"),
        megatrain::train::corpus::MODEL_JSON.as_bytes(),
    )?;
    eprintln!(
        "demo: {} bytes of this repository's docs and source as byte tokens ({} train / {} validation) in {}",
        bytes.len(),
        split,
        bytes.len() - split,
        run.display()
    );
    Ok(TrainConfig {
        model: Some(run.join("model.json")),
        data: Some(data.join("train.bin")),
        val_data: Some(data.join("val.bin")),
        seq_len: 128,
        batch_size: 8,
        steps: 600,
        lr: 2e-3,
        lr_schedule: LrSchedule::Cosine,
        warmup_steps: 20,
        weight_decay: 0.1,
        grad_clip: 1.0,
        shuffle: true,
        metrics: Some(run.join("metrics.jsonl")),
        checkpoint_dir: Some(run.join("checkpoints")),
        checkpoint_every: 200,
        export_hf: Some(run.join("hf")),
        val_every: 100,
        val_batches: 8,
        ..TrainConfig::default()
    })
}

/// Watch SIGINT and SIGTERM (what SLURM and Kubernetes send before SIGKILL): the first sets
/// `interrupt` (the trainer finishes its step, checkpoints and returns), a second exits at once
/// (the last checkpoint on disk is intact). Returns the signal received, 0 while none.
fn watch_signals(
    interrupt: std::sync::Arc<std::sync::atomic::AtomicBool>,
    saves: bool,
) -> Result<std::sync::Arc<std::sync::atomic::AtomicI32>> {
    use signal_hook::consts::{SIGINT, SIGTERM};
    use std::sync::atomic::Ordering;
    let mut signals = signal_hook::iterator::Signals::new([SIGINT, SIGTERM])
        .map_err(|e| megatrain::Error::system("signal-hook", "install signal handlers", e))?;
    let which = std::sync::Arc::new(std::sync::atomic::AtomicI32::new(0));
    let seen = which.clone();
    std::thread::spawn(move || {
        for sig in signals.forever() {
            let name = if sig == SIGTERM {
                "SIGTERM"
            } else {
                "interrupt"
            };
            if interrupt.swap(true, Ordering::SeqCst) {
                std::process::exit(128 + sig);
            }
            seen.store(sig, Ordering::SeqCst);
            eprintln!(
                "\n{name}: finishing this step, then {} (send it again to stop now)",
                if saves {
                    "writing a checkpoint and stopping"
                } else {
                    "stopping; nothing will be saved (no --checkpoint-dir)"
                }
            );
        }
    });
    Ok(which)
}

fn train(args: &TrainArgs) -> Result<u8> {
    let base = match (&args.config, args.demo) {
        (Some(p), _) => megatrain::train::config::TrainConfig::from_toml_file(p)?,
        (None, true) => demo_config(&args.demo_dir)?,
        (None, false) => megatrain::train::config::TrainConfig::default(),
    };
    let cfg = args.merge(base);
    cfg.validate()?;
    eprint!("{}", cfg.table());
    let interrupt = std::sync::Arc::new(std::sync::atomic::AtomicBool::new(false));
    let signal = watch_signals(interrupt.clone(), cfg.checkpoint_dir.is_some())?;
    let mut rep = Reporter {
        bar: None,
        total: 0,
        last_plain: std::time::Instant::now(),
    };
    let s = megatrain::train::run(&cfg, interrupt, &mut rep)?;
    if let Some(b) = &rep.bar {
        b.finish();
    }
    eprintln!(
        "\n{}: {} steps, loss {} → {}{}, {:.0} tokens/s",
        if s.interrupted { "stopped" } else { "done" },
        s.steps,
        s.first_loss.map_or("-".into(), |l| format!("{l:.4}")),
        s.last_loss.map_or("-".into(), |l| format!("{l:.4}")),
        s.val_loss
            .map_or(String::new(), |v| format!(" (validation {v:.4})")),
        s.tokens_per_s
    );
    for (what, p) in [
        ("checkpoint", &s.checkpoint),
        ("HF export", &s.export),
        ("metrics", &s.metrics),
        ("loss curve", &s.plot),
        ("trace", &s.trace),
    ] {
        if let Some(p) = p {
            eprintln!("  {what:<11} {}", p.display());
        }
    }
    if s.metrics_failures > 0 {
        eprintln!(
            "  warning: {} metrics line(s) could not be written",
            s.metrics_failures
        );
    }
    if s.interrupted {
        let sig = signal.load(std::sync::atomic::Ordering::SeqCst);
        let sig = if sig == 0 {
            signal_hook::consts::SIGINT
        } else {
            sig
        };
        eprintln!(
            "interrupted after step {}: {}",
            s.steps,
            match (&s.checkpoint, cfg.checkpoint_dir.is_some()) {
                (Some(c), _) => format!("checkpoint {} (continue with --resume)", c.display()),
                (None, true) => "no checkpoint was written".to_owned(),
                (None, false) => "nothing was saved (no --checkpoint-dir)".to_owned(),
            }
        );
        return Ok(u8::try_from(128 + sig).unwrap_or(130));
    }
    Ok(0)
}

fn export(args: &ExportArgs) -> Result<()> {
    use megatrain::train::checkpoint;
    let is_one = args.checkpoint.join("MANIFEST.json").exists()
        || args.checkpoint.join("params.f32").exists();
    let dir = if is_one {
        args.checkpoint.clone()
    } else {
        checkpoint::latest(&args.checkpoint)?.ok_or_else(|| {
            megatrain::Error::bad_input(
                "checkpoint",
                args.checkpoint.display().to_string(),
                "contains no checkpoint",
                Some("pass a checkpoint directory (step-…) or the --checkpoint-dir of a run"),
            )
        })?
    };
    // Verified before anything in it is parsed.
    let state = checkpoint::open(&dir)?;
    let layout = megatrain::store::layout::StateLayout::new(
        &state.model,
        megatrain::store::layout::Mode::Lean,
    );
    let machine = topology::probe(&TopologySource::Live)?;
    let placement =
        megatrain::store::placement::place(&machine, &layout, None, Default::default())?;
    let store = megatrain::store::HostStore::allocate(layout, placement, &Default::default())?;
    checkpoint::load(&dir, &store)?;
    megatrain::store::hf::export_store(&store, &args.out, 2 << 30, None)?;
    eprintln!(
        "exported {} (step {}) to {}",
        dir.display(),
        state.step,
        args.out.display()
    );
    Ok(())
}

#[derive(Debug, Subcommand)]
enum BenchCommand {
    /// CPU AdamW (the real store and worker pool) vs a STREAM triad on the same node and threads.
    Adam(BenchAdamArgs),
    /// The streaming pipeline on the CPU device with an emulated link: step time vs the serial sum
    /// and the ideal max(compute, transfer, AdamW), for link-, compute- and AdamW-bound cases.
    Engine(BenchEngineArgs),
    /// Sequential write/read GB/s of the spill I/O engine per block size and queue depth.
    Nvme(BenchNvmeArgs),
    /// Copy bandwidth: host memcpy between every NUMA node pair; host↔device cases (waived
    /// without a CUDA device, with the reason).
    Link(BenchLinkArgs),
}

#[derive(Debug, Args)]
struct BenchLinkArgs {
    /// Bytes per copy (K/M/G suffixes, powers of 1000).
    #[arg(long, default_value = "256M", value_parser = megatrain::bench::parse_count)]
    size: usize,
    /// Copies per case; the median is reported.
    #[arg(long, default_value_t = 5)]
    reps: usize,
    #[arg(long)]
    json: bool,
}

fn bench_link(a: &BenchLinkArgs) -> Result<()> {
    let machine = topology::probe(&TopologySource::Live)?;
    let r = megatrain::bench::link::run(&machine, a.size.max(4096), a.reps)?;
    print_report(a.json, &r, megatrain::bench::link::render);
    Ok(())
}

#[derive(Debug, Args)]
struct BenchNvmeArgs {
    /// Directory on the device to test (repeat for several devices; blocks are striped).
    #[arg(long, required = true)]
    dir: Vec<PathBuf>,
    /// Bytes per pass (K/M/G suffixes, powers of 1000).
    #[arg(long, default_value = "512M", value_parser = megatrain::bench::parse_count)]
    size: usize,
    /// Passes per case; the median is reported.
    #[arg(long, default_value_t = 3)]
    reps: usize,
    /// Use the pread/pwrite fallback instead of io_uring.
    #[arg(long)]
    no_uring: bool,
    /// Block sizes to test (comma-separated, K/M suffixes).
    #[arg(long, value_delimiter = ',', default_value = "128Ki,1Mi,4Mi", value_parser = megatrain::bench::parse_count)]
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
    if let Some(b) = a.block.iter().find(|b| **b == 0 || !b.is_multiple_of(4096)) {
        return Err(megatrain::Error::bad_input(
            "--block",
            b.to_string(),
            "must be a positive multiple of 4 KiB (O_DIRECT)",
            Some("e.g. --block 128Ki,1Mi,4Mi"),
        ));
    }
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
    print_report(a.json, &r, megatrain::bench::nvme::render);
    Ok(())
}

#[derive(Debug, Args)]
struct BenchEngineArgs {
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
    let cases = megatrain::bench::engine::run(
        &machine,
        args.steps.max(1),
        &nvme,
        args.trace_dir.as_deref(),
    )?;
    print_report(
        args.json,
        cases.as_slice(),
        megatrain::bench::engine::render,
    );
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

/// Print a bench report as JSON (`--json`) or as its text table.
fn print_report<T: serde::Serialize + ?Sized>(json: bool, report: &T, render: fn(&T) -> String) {
    let text = if json {
        serde_json::to_string_pretty(report).unwrap_or_default()
    } else {
        render(report)
    };
    println!("{}", text.trim_end());
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
            reps: args.reps,
            isa,
        },
    )?;
    print_report(args.json, &report, megatrain::bench::adam::render);
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
    if let TopologySource::XmlFile(path) = &source {
        let exe = std::env::current_exe()
            .map_err(|e| megatrain::Error::system("megatrain", "find its own executable", e))?;
        topology::hwloc::vet_in_child(&exe, path)?;
    }
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

fn vet_topology(file: &std::path::Path) -> Result<()> {
    let source = TopologySource::XmlFile(file.to_owned());
    let topo = topology::hwloc::load(&source)?;
    topology::describe(&topo, &source).map(|_| ())
}

fn main() -> ExitCode {
    let cli = Cli::parse();
    let result = match &cli.command {
        Command::Probe(args) => probe(args).map(|()| 0),
        Command::Bench(BenchCommand::Adam(args)) => bench_adam(args).map(|()| 0),
        Command::Bench(BenchCommand::Engine(args)) => bench_engine(args).map(|()| 0),
        Command::Bench(BenchCommand::Nvme(args)) => bench_nvme(args).map(|()| 0),
        Command::Bench(BenchCommand::Link(args)) => bench_link(args).map(|()| 0),
        Command::Train(args) => train(args),
        Command::Export(args) => export(args).map(|()| 0),
        Command::Prepare(args) => prepare(args).map(|()| 0),
        Command::Plan(args) => plan(args).map(|()| 0),
        Command::Selftest(args) => selftest(args).map(|()| 0),
        Command::VetTopology { file } => vet_topology(file).map(|()| 0),
    };
    match result {
        Ok(code) => ExitCode::from(code),
        Err(e) => {
            eprintln!("error: {e}");
            ExitCode::from(e.exit_code())
        }
    }
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use clap::CommandFactory;

    /// Every key of the training configuration is a flag of `megatrain train`, and setting each
    /// flag changes the merged configuration (a flag without its line in `merge` would be
    /// silently ignored).
    #[test]
    fn every_train_setting_is_a_flag_and_every_flag_is_merged() {
        let cmd = Cli::command();
        let train = cmd.find_subcommand("train").unwrap();
        let flags: Vec<String> = train
            .get_arguments()
            .filter_map(|a| a.get_long().map(str::to_owned))
            .collect();
        let defaults =
            serde_json::to_value(megatrain::train::config::TrainConfig::default()).unwrap();
        for key in defaults.as_object().unwrap().keys() {
            let flag = key.replace('_', "-");
            let negated = format!("no-{flag}");
            assert!(
                flags.contains(&flag) || flags.contains(&negated),
                "setting `{key}` has no --{flag} flag"
            );
        }
        // Each flag with a sample value moves the merged config off the default.
        let samples: &[(&str, &str)] = &[
            ("--init-from", "/x"),
            ("--model", "/x"),
            ("--data", "/x"),
            ("--data-dtype", "u32"),
            ("--val-data", "/x"),
            ("--seq-len", "7"),
            ("--batch-size", "7"),
            ("--grad-accum", "7"),
            ("--steps", "7"),
            ("--lr", "0.5"),
            ("--beta1", "0.5"),
            ("--beta2", "0.5"),
            ("--eps", "0.5"),
            ("--weight-decay", "0.5"),
            ("--decay-norms", "false"),
            ("--grad-clip", "0.5"),
            ("--lr-schedule", "cosine"),
            ("--warmup-steps", "7"),
            ("--seed", "7"),
            ("--metrics", "/x"),
            ("--checkpoint-dir", "/x"),
            ("--checkpoint-every", "7"),
            ("--keep-checkpoints", "7"),
            ("--export-hf", "/x"),
            ("--device", "cuda"),
            ("--device-memory", "7"),
            ("--huge-pages", "2m"),
            ("--nvme", "/x"),
            ("--spill", "all"),
            ("--spill-staging", "7"),
            ("--io-engine", "sync"),
            ("--ram-budget", "7"),
            ("--activations", "host"),
            ("--precision", "bf16"),
            ("--mode", "lean"),
            ("--trace", "/x"),
            ("--val-every", "7"),
            ("--val-batches", "7"),
        ];
        let switches = [
            "--shuffle",
            "--resume",
            "--lock-memory",
            "--no-direct-io",
            "--tf32",
        ];
        let base = megatrain::train::config::TrainConfig::default();
        let merged = |args: &[&str]| {
            let mut v = vec!["megatrain", "train"];
            v.extend_from_slice(args);
            match Cli::try_parse_from(v).unwrap().command {
                Command::Train(a) => a.merge(base.clone()),
                _ => unreachable!(),
            }
        };
        for (flag, value) in samples {
            assert_ne!(
                merged(&[flag, value]),
                base,
                "{flag} {value} is ignored by merge"
            );
        }
        for s in switches {
            assert_ne!(merged(&[s]), base, "{s} is ignored by merge");
        }
        let covered: Vec<&str> = samples
            .iter()
            .map(|(f, _)| *f)
            .chain(switches)
            .map(|f| f.trim_start_matches("--"))
            .collect();
        for f in &flags {
            if !["demo", "demo-dir", "config", "help"].contains(&f.as_str()) {
                assert!(
                    covered.contains(&f.as_str()),
                    "--{f} has no sample in this test"
                );
            }
        }
    }
}
