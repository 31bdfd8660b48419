//! `megatrain selftest --device cuda`: every kernel and GEMM against the CPU reference,
//! training steps against the CPU device, the link.

use clap::Args;
use megatrain::Result;

#[derive(Debug, Args)]
#[command(after_help = "Examples:
  megatrain selftest --device cuda                             kernels, GEMMs, steps vs the CPU, the link
  megatrain selftest --device cuda --only kernels,landings     the kernels alone (seconds on a GPU)
  megatrain selftest --device cuda --goldens tests/golden      the training goldens vs PyTorch")]
pub struct SelftestArgs {
    /// The device to check.
    #[arg(long, value_enum)]
    device: megatrain::train::config::DeviceKind,
    /// GPU index.
    #[arg(long, default_value_t = 0)]
    gpu: usize,
    /// Seed of the random inputs.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// Only find and open the CUDA stack (driver, NVRTC, headers, cuBLAS), compile and load the
    /// kernels, and say which files and versions are in use.
    #[arg(long)]
    stack_only: bool,
    /// Instead of the kernel and training checks: train every `train_*` golden case in DIR
    /// (`tests/golden`) on the device and compare with PyTorch at the test suite's tolerances,
    /// and run the first case twice for the same bits. Also on `--device cpu`.
    #[arg(long, value_name = "DIR")]
    goldens: Option<std::path::PathBuf>,
    /// Run only these parts of the check (comma-separated; default: all of them, in this order).
    #[arg(long, value_enum, value_delimiter = ',', value_name = "PART", conflicts_with_all = ["goldens", "stack_only"])]
    only: Vec<Part>,
}

/// A part of `selftest --device cuda`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
enum Part {
    /// Every kernel and cuBLAS GEMM against the CPU reference, and the mixture-of-experts op.
    Kernels,
    /// A few training steps of a dense and two mixture-of-experts models, fp32 and bf16,
    /// against the CPU device.
    Training,
    /// Device→host copies landing bit for bit.
    Landings,
    /// The page-locked link's bandwidth each way.
    Link,
}

/// One self-test line.
fn print_checks(checks: &[megatrain::selftest::Check]) {
    for c in checks {
        println!(
            "{:<60} {:>12.3e} {:>10.0e}  {}",
            c.name,
            c.max_rel_err,
            c.tolerance,
            if c.pass { "pass" } else { "FAIL" }
        );
    }
}

/// The verdict over `checks`.
fn verdict(checks: &[megatrain::selftest::Check]) -> Result<()> {
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

/// `--goldens DIR`: every case on the device, then the first one again for the same bits.
fn goldens(dir: &std::path::Path, device: megatrain::train::config::DeviceKind) -> Result<()> {
    use megatrain::selftest::goldens;
    let cases = goldens::cases(dir)?;
    let scratch = std::env::temp_dir().join(format!("megatrain-goldens-{}", std::process::id()));
    let fresh = |i: usize| -> Result<std::path::PathBuf> {
        let d = scratch.join(i.to_string());
        std::fs::create_dir_all(&d).map_err(|e| megatrain::Error::io("create", &d, e))?;
        Ok(d)
    };
    println!(
        "training goldens (PyTorch + transformers) on the {} device: {} cases from {}\n",
        format!("{device:?}").to_lowercase(),
        cases.len(),
        dir.display()
    );
    println!(
        "{:<60} {:>12} {:>10}  result",
        "check", "max rel err", "tolerance"
    );
    let result = (|| {
        let mut checks = Vec::new();
        let mut first = None;
        for (i, case) in cases.iter().enumerate() {
            let t0 = std::time::Instant::now();
            let run = goldens::run_case(case, device, &fresh(i)?)?;
            print_checks(&run.checks);
            eprintln!("{}: {:.1} s", run.name, t0.elapsed().as_secs_f64());
            checks.extend(run.checks.clone());
            first.get_or_insert(run);
        }
        if let Some(a) = first {
            let again = goldens::run_case(&cases[0], device, &fresh(cases.len())?)?;
            let c = goldens::same_bits(&a, &again);
            print_checks(std::slice::from_ref(&c));
            checks.push(c);
        }
        // Generation: transformers' greedy tokens.
        for case in megatrain::selftest::generation::cases(dir)? {
            let t0 = std::time::Instant::now();
            let c = megatrain::selftest::generation::run_case(&case, device)?;
            print_checks(std::slice::from_ref(&c));
            eprintln!("{}: {:.1} s", case.display(), t0.elapsed().as_secs_f64());
            checks.push(c);
        }
        verdict(&checks)
    })();
    let _ = std::fs::remove_dir_all(&scratch);
    result
}

#[cfg(not(feature = "cuda"))]
pub fn run(a: &SelftestArgs) -> Result<()> {
    if let (Some(dir), megatrain::train::config::DeviceKind::Cpu) = (&a.goldens, a.device) {
        return goldens(dir, a.device);
    }
    Err(megatrain::Error::bad_input(
        "selftest",
        format!("--device {:?}", a.device).to_lowercase(),
        "this binary was built without CUDA support",
        Some("build with `cargo build --release --features cuda` (no toolkit needed to build) and run on a GPU machine"),
    ))
}

#[cfg(feature = "cuda")]
pub fn run(a: &SelftestArgs) -> Result<()> {
    use megatrain::device::cuda::CudaRuntime;
    use megatrain::selftest::{cuda, Check};
    if let Some(dir) = &a.goldens {
        return goldens(dir, a.device);
    }
    if a.device != megatrain::train::config::DeviceKind::Cuda {
        return Err(megatrain::Error::bad_input(
            "selftest",
            "--device cpu",
            "the CPU device is the reference itself; it is checked by the test suite",
            Some("use --device cuda"),
        ));
    }
    let t0 = std::time::Instant::now();
    let rt = CudaRuntime::open(a.gpu)?;
    println!("megatrain selftest");
    for l in rt.describe() {
        println!("  {l}");
    }
    println!(
        "  opened in {:.1} s{}\n",
        t0.elapsed().as_secs_f64(),
        if rt.emulated() {
            " (emulated: cuemu)"
        } else {
            ""
        }
    );
    if a.stack_only {
        return Ok(());
    }
    let print = print_checks;
    let part = |p: Part| a.only.is_empty() || a.only.contains(&p);
    println!(
        "{:<60} {:>12} {:>10}  result",
        "check", "max rel err", "tolerance"
    );
    let mut checks = Vec::new();
    if part(Part::Kernels) {
        let mut kernels = cuda::kernels(&rt, a.seed)?;
        kernels.extend(cuda::moe_ops(a.gpu, a.seed)?);
        print(&kernels);
        checks.extend(kernels);
    }
    if part(Part::Training) {
        // Training steps through the streaming CUDA device against the CPU device; an error
        // there is a failed check, printed, and the rest still runs.
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
    }
    if part(Part::Landings) {
        let landings = cuda::landings(a.gpu, a.seed)?;
        print(&landings);
        checks.extend(landings);
    }
    if part(Part::Link) {
        let (htod, dtoh) = cuda::link(&rt)?;
        let label = if rt.emulated() {
            "emulated by cuemu: host memory copies, not a GPU link"
        } else {
            "256 MiB, page-locked, median of 5"
        };
        println!("\nlink ({label}): host→device {htod:.1} GB/s, device→host {dtoh:.1} GB/s");
    }
    verdict(&checks)
}
