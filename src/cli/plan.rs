//! `megatrain plan`: will it fit, and how fast will it go (predictions, from datasheet figures or
//! from the machine's own `megatrain bench` reports).

use clap::Args;
use megatrain::bench::Report;
use megatrain::store::layout::{AdamState, MasterFormat};
use megatrain::train::config::Precision;
use megatrain::Result;
use std::path::{Path, PathBuf};

/// Rates measured on the machine, from `megatrain bench … --json` reports.
#[derive(Debug, Default)]
struct Calibration {
    /// AdamW GB/s (`bench adam`), per moment format and master format measured.
    adam_gbps: Vec<(AdamState, MasterFormat, f64)>,
    /// NVMe GB/s: the slower of read and write in the best case (`bench nvme`).
    nvme_gbps: Option<f64>,
    /// Best page-locked host→device and device→host GB/s (`bench link` on a GPU machine).
    link_gbps: Option<(f64, f64)>,
    /// The GPU's kernels (`bench kernels` on it).
    kernels: Option<(PathBuf, megatrain::bench::kernel_report::KernelReport)>,
    /// Bus GB/s of the ranks' gradient sum within one machine (`bench collective` there): the
    /// largest buffer's, and the ranks it was measured with.
    host_sum: Option<(f64, usize)>,
    /// NCCL's all-gather bus GB/s between a machine's GPUs, and the ranks that measured it.
    nccl_gbps: Option<(f64, usize)>,
}

impl Calibration {
    /// The AdamW rate measured for `state` over `master` (planes under bf16), else for `state`
    /// over any master, else for fp32 moments (the same DRAM rate, if the compact update keeps up
    /// with it), else for any case measured.
    fn adam_gbps(&self, state: AdamState, master: MasterFormat) -> Option<f64> {
        let find = |ok: &dyn Fn(AdamState, MasterFormat) -> bool| {
            self.adam_gbps
                .iter()
                .find(|(s, m, _)| ok(*s, *m))
                .map(|(_, _, g)| *g)
        };
        find(&|s, m| s == state && m == master)
            .or_else(|| find(&|s, _| s == state))
            .or_else(|| find(&|s, _| s == AdamState::Fp32))
            .or_else(|| self.adam_gbps.first().map(|(_, _, g)| *g))
    }

    /// Read every report in `files`, by its tagged type.
    fn read(files: &[PathBuf]) -> Result<Self> {
        let mut c = Calibration::default();
        for (p, report) in files
            .iter()
            .map(|p| read_reports(p).map(|v| v.into_iter().map(move |r| (p, r))))
            .collect::<Result<Vec<_>>>()?
            .into_iter()
            .flatten()
        {
            match report {
                Report::Adam(r) => {
                    c.adam_gbps = r
                        .adam
                        .iter()
                        .map(|x| (x.state, x.master, x.measured.gbytes_per_s))
                        .collect();
                }
                Report::Nvme(r) => {
                    // The spill tier streams large extents at a deep queue: the best case, and
                    // the slower of its read and write (a step does both).
                    c.nvme_gbps = Some(
                        r.cases
                            .iter()
                            .map(|x| x.read_gbps.min(x.write_gbps))
                            .fold(0.0f64, f64::max),
                    );
                }
                Report::Link(r) => {
                    let gpu = r.gpu.ok_or_else(|| {
                        bad_calibration(
                            p,
                            "a host-only link report (run `megatrain bench link --json` on the GPU machine)",
                        )
                    })?;
                    // The store is page-locked and placed GPU-local: the best pinned copy.
                    let best = |dir: &str| {
                        gpu.cases
                            .iter()
                            .filter(|x| x.direction == dir && x.pinned)
                            .map(|x| x.gbps)
                            .fold(0.0f64, f64::max)
                    };
                    c.link_gbps = Some((best("htod"), best("dtoh")));
                }
                Report::Kernels(r) => {
                    if r.emulated {
                        return Err(bad_calibration(
                            p,
                            "an emulated report (tools/cuemu.sh): its times are host times, not a GPU's",
                        ));
                    }
                    c.kernels = Some((p.clone(), r));
                }
                Report::Collective(r) => {
                    if r.ranks < 2 {
                        return Err(bad_calibration(
                            p,
                            "a report of one rank, which sums nothing (run it under the launcher: `mpirun -np 2 megatrain bench collective --json` or more ranks)",
                        ));
                    }
                    if r.hosts != 1 {
                        return Err(bad_calibration(
                            p,
                            "a report of ranks on several machines: the plan takes the sum within one (run `mpirun -np N megatrain bench collective --json` on one machine)",
                        ));
                    }
                    // The trainer sums whole units: the largest buffer measured is the closest.
                    let row = r.rows.iter().max_by_key(|x| x.bytes).ok_or_else(|| {
                        bad_calibration(p, "a collective report without a measured size")
                    })?;
                    if !(row.ours_busbw_gbs.is_finite() && row.ours_busbw_gbs > 0.0) {
                        return Err(bad_calibration(
                            p,
                            &format!(
                                "a collective report whose sum measured {} GB/s",
                                row.ours_busbw_gbs
                            ),
                        ));
                    }
                    c.host_sum = Some((row.ours_busbw_gbs, r.ranks));
                    // NCCL between the GPUs (`--device cuda`): its broadcast at the largest size
                    // is how stage 3's GPUs gather params. An emulated report is not a GPU's.
                    if let Some(n) = r.nccl.as_ref().filter(|n| !n.emulated) {
                        if let Some(g) = n
                            .rows
                            .iter()
                            .max_by_key(|x| x.bytes)
                            .map(|x| x.broadcast_busbw_gbs)
                            .filter(|g| g.is_finite() && *g > 0.0)
                        {
                            c.nccl_gbps = Some((g, r.ranks));
                        }
                    }
                }
            }
        }
        Ok(c)
    }
}

fn bad_calibration(p: &Path, why: &str) -> megatrain::Error {
    megatrain::Error::bad_input(
        "calibration",
        p.display().to_string(),
        why,
        Some("pass the JSON of `megatrain bench adam|nvme|link|kernels|collective --json`"),
    )
}

/// The reports in `p`: one report, or a JSON array of them (`tools/gpu_check.sh`'s
/// `bench.json`, the bench stage of a recorded GPU run).
fn read_reports(p: &Path) -> Result<Vec<Report>> {
    let text =
        std::fs::read_to_string(p).map_err(|e| megatrain::Error::io("read calibration", p, e))?;
    let bad = |e: serde_json::Error| {
        bad_calibration(
            p,
            &format!("not a `megatrain bench adam|nvme|link|kernels|collective --json` report, nor an array of them: {e}"),
        )
    };
    match serde_json::from_str::<serde_json::Value>(&text).map_err(bad)? {
        serde_json::Value::Array(v) if v.is_empty() => Err(bad_calibration(
            p,
            "an empty array: no benchmark report in it (did every bench of the run fail?)",
        )),
        serde_json::Value::Array(v) => v
            .into_iter()
            .map(|x| serde_json::from_value(x).map_err(bad))
            .collect(),
        x => Ok(vec![serde_json::from_value(x).map_err(bad)?]),
    }
}

#[derive(Debug, Args)]
#[command(after_help = "Examples:
  megatrain plan --model llama-120b --machine h200-1.5tb --adam-state int8 --tokens-per-step 16384
  megatrain plan --model config.json --machine probe.json --calibration bench-adam.json
  megatrain plan --model llama-3.1-8b --machine h200-1.5tb --gpus 8 --tokens-per-step 262144
  megatrain plan --model llama-3.1-405b --machine h200-1.5tb --gpus 8 --nodes 4")]
pub struct PlanArgs {
    /// A model preset (llama-3-8b, llama-3.1-70b, qwen2.5-72b, qwen3-32b, gemma-3-27b,
    /// mistral-large-2, llama-120b, mixtral-8x7b, qwen3-30b-a3b, gpt-oss-120b, … : README lists
    /// them all) or an HF config.json
    #[arg(long)]
    model: String,
    /// A machine preset (h200-1.5tb, gh200-480gb, h100-512gb, rtx4090-256gb) or a
    /// `megatrain probe --json` file.
    #[arg(long)]
    machine: String,
    /// GPU index within a probed machine.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// Tokens per optimizer step (of the whole job: each of --gpus × --nodes ranks trains its
    /// share) [default: 65536 rounded up to whole sequences for each rank]
    #[arg(long)]
    tokens_per_step: Option<u64>,
    /// GPUs per machine, one data-parallel rank each (as `mpirun -np N megatrain train` runs
    /// them: every rank holds the whole host state unless --zero-stage shards it).
    #[arg(long, default_value_t = 1)]
    gpus: u64,
    /// Machines, each with --gpus ranks.
    #[arg(long, default_value_t = 1)]
    nodes: u64,
    /// Shard the host state across the ranks, as `train --zero-stage` does: 1 the Adam moments,
    /// 3 the params too (each rank gathers a unit's params before each copy to its GPU).
    #[arg(long, default_value_t = 0, value_name = "0|1|3", value_parser = zero_stage)]
    zero_stage: u8,
    /// With --zero-stage 3, how each rank gets a unit's params, as `train --param-gather`:
    /// `nccl` (the default `auto` on a plan, whose ranks each have a GPU) has the owner copy it
    /// to its GPU and NCCL broadcast it (over NVLink where the machine has it, else the PCIe
    /// link; across machines their network); `host` through host memory.
    #[arg(long, value_enum, default_value = "auto")]
    param_gather: megatrain::train::config::ParamGather,
    /// The network between machines, GB/s per direction per machine (all its NICs); a preset
    /// names its own.
    #[arg(long, value_name = "GB/s")]
    nic_gbps: Option<f64>,
    /// NCCL's bus GB/s between a machine's GPUs over NVLink (nccl-tests' busbw; `bench
    /// collective --device cuda` measures it); a preset names its own, a probed machine none
    /// (NCCL planned at the PCIe link's rate).
    #[arg(long, value_name = "GB/s")]
    nvlink_gbps: Option<f64>,
    /// Sequence length.
    #[arg(long, default_value_t = 4096)]
    seq_len: u64,
    /// Tokens per micro-batch of a rank (default: the largest that fits the GPU).
    #[arg(long)]
    micro_batch_tokens: Option<u64>,
    /// What the GPU computes in: bf16 (the default on a GPU, as `train --device cuda`) or fp32.
    #[arg(long, value_enum, default_value = "bf16")]
    precision: megatrain::train::config::Precision,
    /// How gradients cross back to the host: fp32 or bf16 (`train --grad-link`); unset: bf16
    /// where the plan is bf16 and it shortens the step by 5% or more, else fp32.
    #[arg(long, value_enum)]
    grad_link: Option<megatrain::device::GradLink>,
    /// Where the layer-input checkpoints go: device (the GPU) or host; unset: the GPU when
    /// they fit beside its working set, else host memory (as `train` chooses).
    #[arg(long, value_enum)]
    activations: Option<megatrain::engine::Activations>,
    /// How they are stored: fp32 or bf16 (`train --activation-dtype`); unset: bf16 under
    /// --precision bf16, else fp32.
    #[arg(long, value_enum)]
    activation_dtype: Option<megatrain::engine::ActivationDtype>,
    #[arg(long, value_enum, default_value = "exact")]
    mode: megatrain::store::layout::Mode,
    /// How Adam m and v are stored: fp32 (8 B/param), bf16 (4 B/param), int8 (≈ 2 B/param).
    #[arg(long, value_enum, default_value = "fp32")]
    adam_state: megatrain::store::layout::AdamState,
    /// NVMe directories for spilling Adam m/v (each assumed 3 GB/s unless calibrated).
    #[arg(long, value_name = "DIR")]
    nvme: Vec<PathBuf>,
    /// Measurements from the machine (repeatable): `megatrain bench adam --json` sets the AdamW
    /// rate, `megatrain bench nvme --json` the NVMe rate (and allows spilling m/v),
    /// `megatrain bench link --json` on a GPU machine the host↔device rates, `megatrain bench
    /// kernels --json` on the GPU its GEMM and attention efficiencies, `mpirun -np N megatrain
    /// bench collective --json` the ranks' gradient sum within a machine; a file may hold an
    /// array of reports (tools/gpu_check.sh's bench.json: a recorded GPU run's three).
    #[arg(long, value_name = "bench.json")]
    calibration: Vec<PathBuf>,
    #[arg(long)]
    json: bool,
}

pub fn run(a: &PlanArgs) -> Result<()> {
    use megatrain::plan::{self as pl, presets};
    let model = match presets::model(&a.model) {
        Some(m) => m,
        None => megatrain::model::config::ModelConfig::from_file(Path::new(&a.model))
            .map_err(|e| e.with_fix(format!("or use a preset: {}", presets::MODELS.join(", "))))?,
    };
    let cal = Calibration::read(&a.calibration)?;
    let (hw, described, notes) = hardware(a, &cal)?;
    let req = pl::PlanRequest {
        tokens_per_step: a.tokens_per_step.unwrap_or_else(|| {
            pl::PlanRequest::default_tokens_per_step(a.seq_len, a.gpus.saturating_mul(a.nodes))
        }),
        seq_len: a.seq_len,
        bf16: a.precision == megatrain::train::config::Precision::Bf16,
        mode: a.mode,
        adam_state: a.adam_state,
        spill_moments: hw.nvme_gbps.is_some(),
        micro_batch_tokens: a.micro_batch_tokens,
        grad_link: a.grad_link,
        activations: a.activations,
        activation_dtype: a.activation_dtype.unwrap_or(match a.precision {
            megatrain::train::config::Precision::Bf16 => megatrain::engine::ActivationDtype::Bf16,
            megatrain::train::config::Precision::Fp32 => megatrain::engine::ActivationDtype::Fp32,
        }),
        data_parallel: pl::DataParallel {
            zero_stage: a.zero_stage,
            gpus: a.gpus,
            nodes: a.nodes,
            gpu_gather: a.param_gather != megatrain::train::config::ParamGather::Host,
        },
    };
    req.data_parallel.check(&hw)?;
    req.validate()?;
    let p = pl::plan(&model, &hw, &req);
    // Per NUMA node, where the machine is described (a probe), by the trainer's placement (of
    // one process: ranks each place theirs on their share of the CPUs).
    let nodes = described
        .as_ref()
        .filter(|_| req.data_parallel.ranks() == 1)
        .map(|m| pl::per_node(m, a.gpu, &model, &req).map_err(|e| e.to_string()));
    if a.json {
        let per_node = match &nodes {
            Some(Ok(n)) => serde_json::to_value(n).unwrap_or_default(),
            Some(Err(e)) => serde_json::json!({ "error": e }),
            None => serde_json::Value::Null,
        };
        let eff = pl::efficiency(&hw, req.bf16);
        let v = serde_json::json!({ "model": a.model, "machine": hw, "request": req, "plan": p, "numa_nodes": per_node, "assumptions": notes, "kernel_efficiency": eff });
        println!("{}", serde_json::to_string_pretty(&v).unwrap_or_default());
    } else {
        print!("{}", pl::render(&a.model, &hw, &req, &p));
        if req.data_parallel.ranks() == 1 {
            print_nodes(nodes.as_ref());
        }
        for n in &notes {
            println!("  assumption: {n}");
        }
        let eff = pl::efficiency(&hw, req.bf16);
        let experts = match eff.expert_gemm {
            Some(e) if p.active_params < p.params => format!(", experts' GEMMs {:.1}%", 100.0 * e),
            _ => String::new(),
        };
        println!(
            "  kernels: GEMM {:.1}%{experts}, attention forward {:.1}%, backward {:.1}% of peak; elementwise at {:.2} TB/s ({})",
            100.0 * eff.gemm,
            100.0 * eff.attention_fwd,
            100.0 * eff.attention_bwd,
            eff.memory_tbps,
            eff.source
        );
        println!("  sources: {}", hw.sources);
    }
    Ok(())
}

/// The master format `precision` trains over (bf16 streams the high plane of planes).
fn master_of(precision: Precision) -> MasterFormat {
    match precision {
        Precision::Fp32 => MasterFormat::Fp32,
        Precision::Bf16 => MasterFormat::Planes,
    }
}

/// The hardware to plan for: a preset, or a probed machine's description, with the
/// calibration's measured rates laid over it; the machine (when described) and the
/// assumptions made.
fn hardware(
    a: &PlanArgs,
    cal: &Calibration,
) -> Result<(
    megatrain::plan::Hardware,
    Option<megatrain::topology::Machine>,
    Vec<String>,
)> {
    use megatrain::plan::{self as pl, presets};
    let nvme = cal
        .nvme_gbps
        .or((!a.nvme.is_empty()).then_some(3.0 * a.nvme.len() as f64));
    let (mut hw, described, mut notes) = match presets::machine(&a.machine) {
        Some(h) => (h, None, Vec::new()),
        None => {
            let path = Path::new(&a.machine);
            let text = std::fs::read_to_string(path).map_err(|e| {
                megatrain::Error::io("read machine", path, e)
                    .with_fix(format!("or use a preset: {}", presets::MACHINES.join(", ")))
            })?;
            let m = megatrain::topology::Machine::from_json(&text, &a.machine)?;
            let (h, n) = pl::hardware_from_machine(
                &m,
                a.gpu,
                cal.adam_gbps(a.adam_state, master_of(a.precision)),
                nvme,
            )?;
            (h, Some(m), n)
        }
    };
    if let Some(g) = cal.adam_gbps(a.adam_state, master_of(a.precision)) {
        hw.adam_gbps = g;
    }
    if let Some((h, d)) = cal.link_gbps.filter(|(h, d)| *h > 0.0 && *d > 0.0) {
        hw.htod_gbps = h;
        hw.dtoh_gbps = d;
        notes.push(format!(
            "link calibrated: {h:.1} GB/s host→device, {d:.1} GB/s device→host"
        ));
    }
    if let Some((path, r)) = &cal.kernels {
        let memory = |bf16| pl::kernel_efficiency(&hw.gpu, bf16).memory_tbps;
        hw.measured_bf16 =
            megatrain::bench::kernel_report::measured_efficiency(r, true, memory(true));
        hw.measured_fp32 =
            megatrain::bench::kernel_report::measured_efficiency(r, false, memory(false));
        if hw.measured_bf16.is_none() && hw.measured_fp32.is_none() {
            return Err(bad_calibration(
                path,
                "a `bench kernels` report without GEMM and attention rows with datasheet peaks to set against",
            ));
        }
        let gpu = hw.gpu.to_ascii_lowercase();
        let same = ["gh200", "h200", "h100", "a100", "b200", "l40s", "4090"]
            .iter()
            .find(|k| gpu.contains(*k))
            .is_none_or(|k| r.device.to_ascii_lowercase().contains(k));
        notes.push(format!(
            "kernels calibrated by `bench kernels` on {}{}",
            r.device,
            if same {
                String::new()
            } else {
                format!(" — not the planned GPU ({})", hw.gpu)
            }
        ));
    }
    if let Some(nic) = a.nic_gbps {
        if !(nic.is_finite() && nic > 0.0) {
            return Err(megatrain::Error::bad_input(
                "plan",
                format!("--nic-gbps {nic}"),
                "must be a positive number of GB/s",
                Some("pass the machine's network bandwidth per direction, e.g. --nic-gbps 400"),
            ));
        }
        hw.nic_gbps = Some(nic);
    }
    if let Some((g, measured)) = cal.nccl_gbps {
        hw.nvlink_gbps = Some(g);
        notes.push(format!(
            "NCCL between the GPUs calibrated: {g:.1} GB/s bus (`bench collective --device cuda`'s broadcast, {measured} ranks)"
        ));
    }
    if let Some(nv) = a.nvlink_gbps {
        if !(nv.is_finite() && nv > 0.0) {
            return Err(megatrain::Error::bad_input(
                "plan",
                format!("--nvlink-gbps {nv}"),
                "must be a positive number of GB/s",
                Some(
                    "pass NCCL's bus bandwidth between the machine's GPUs, e.g. --nvlink-gbps 350",
                ),
            ));
        }
        hw.nvlink_gbps = Some(nv);
    }
    if a.zero_stage == 3 && ranks_of(a) > 1 {
        notes.push(match a.param_gather {
            megatrain::train::config::ParamGather::Host => {
                "params gathered through host memory (--param-gather host)".to_owned()
            }
            _ => format!(
                "params gathered GPU to GPU: each owner's copy, then NCCL's broadcast at {} GB/s{}",
                hw.gpu_to_gpu_gbps(),
                match hw.nvlink_gbps {
                    Some(_) => " (NVLink)",
                    None => " (no NVLink described: the PCIe link's rate)",
                }
            ),
        });
    }
    let ranks = a.gpus.saturating_mul(a.nodes);
    match cal.host_sum {
        Some((g, measured)) => {
            hw.host_sum_gbps = g;
            notes.push(format!(
                "gradient sum calibrated: {g:.2} GB/s bus in host memory (`bench collective`, {measured} ranks{})",
                if measured as u64 == a.gpus {
                    String::new()
                } else {
                    format!(
                        "; this plan has {} per machine, and the rate changes with the ranks",
                        a.gpus
                    )
                }
            ));
        }
        None if ranks > 1 => notes.push(format!(
            "gradient sum in host memory assumed {} GB/s bus; pass --calibration from `mpirun -np {} megatrain bench collective --json` on the machine",
            hw.host_sum_gbps,
            a.gpus.max(2)
        )),
        None => {}
    }
    if nvme.is_some() {
        hw.nvme_gbps = nvme;
        if cal.nvme_gbps.is_none() {
            notes.push(format!(
                "NVMe assumed 3 GB/s per directory ({} given); pass --calibration from `megatrain bench nvme --json`",
                a.nvme.len()
            ));
        }
    }
    Ok((hw, described, notes))
}

/// Host bytes per NUMA node by the trainer's placement, when the machine is described.
fn print_nodes(
    nodes: Option<&std::result::Result<Vec<megatrain::store::placement::NodePlan>, String>>,
) {
    match nodes {
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
}

/// `--zero-stage`: 0, 1 or 3, as the trainer takes it.
fn ranks_of(a: &PlanArgs) -> u64 {
    a.gpus.saturating_mul(a.nodes)
}

fn zero_stage(s: &str) -> megatrain::Result<u8> {
    match s {
        "0" => Ok(0),
        "1" => Ok(1),
        "3" => Ok(3),
        _ => Err(megatrain::Error::bad_input(
            "--zero-stage",
            s,
            "is not a ZeRO stage megatrain runs: 0 (replicated), 1 (Adam moments sharded) or 3 (params too)",
            Some("pass --zero-stage 0, 1 or 3"),
        )),
    }
}
