//! The CUDA path run by cuemu, the CUDA emulator (`tools/cuemu.sh`): the emulator's teeth, and
//! megatrain's CUDA failure paths.
//!
//! This binary is its own runner (`harness = false`). Without `CUEMU_SCENARIO` it is the parent:
//! each check starts a child through `tools/cuemu.sh` — `megatrain` itself, or this binary with
//! `CUEMU_SCENARIO=<name>`, which then drives the CUDA driver, NVRTC and cuBLAS directly — and
//! reads what the child and the emulator printed. Arguments that do not start with `-` filter
//! the checks by name.
//!
//! The teeth: each of seven bugs is applied to a copy of a kernel or a launch and must be
//! reported by the emulator by kind, with the kernel (or GEMM, or call) named — not just show as
//! a wrong number — while the same scenario without the bug must run clean. These need the
//! emulator even on a GPU machine; so do the checks of megatrain's failure paths, which use its
//! fault injection. The checks that hold on real hardware (the self-test, training against
//! PyTorch) are in `tests/cuda_gpu.rs` and `tests/train_golden.rs`, and run on a GPU with
//! `MEGATRAIN_GPU=1`.
#![allow(
    clippy::unwrap_used,
    clippy::print_stderr,
    clippy::print_stdout,
    clippy::exit
)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::time::{Duration, Instant};

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn megatrain() -> &'static str {
    env!("CARGO_BIN_EXE_megatrain")
}

/// A command run through the emulator (built on first use by tools/cuemu.sh).
fn emulated(program: &Path) -> Command {
    let mut c = Command::new(root().join("tools/cuemu.sh"));
    c.arg(program);
    c
}

/// Run `c` with a time limit; a hang is a failure, not a stuck test suite.
fn run(mut c: Command, limit: Duration) -> Result<Output, String> {
    c.stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = c.spawn().map_err(|e| format!("cannot start {c:?}: {e}"))?;
    let t0 = Instant::now();
    loop {
        if child.try_wait().map_err(|e| e.to_string())?.is_some() {
            return child.wait_with_output().map_err(|e| e.to_string());
        }
        if t0.elapsed() > limit {
            let _ = child.kill();
            let out = child.wait_with_output().map_err(|e| e.to_string())?;
            return Err(format!(
                "still running after {limit:?} (a hang); stderr:\n{}",
                String::from_utf8_lossy(&out.stderr)
            ));
        }
        std::thread::sleep(Duration::from_millis(50));
    }
}

fn text(o: &Output) -> (String, String) {
    (
        String::from_utf8_lossy(&o.stdout).into_owned(),
        String::from_utf8_lossy(&o.stderr).into_owned(),
    )
}

/// The emulator's error reports in `stderr`.
fn reports(stderr: &str) -> Vec<&str> {
    stderr
        .lines()
        .filter(|l| l.starts_with("cuemu: error:"))
        .collect()
}

// ---- megatrain on the emulated GPU -----------------------------------------------------------------

const CASE: &str = "tests/golden/train_accum";

/// `megatrain train --device cuda` on the accumulation golden case (tiny, 4 steps).
fn train(extra: &[&str]) -> Command {
    let mut c = emulated(Path::new(megatrain()));
    let d = root().join(CASE);
    c.args(["train", "--device", "cuda", "--init-from"])
        .arg(d.join("init"))
        .arg("--data")
        .arg(d.join("data.bin"))
        .args(["--seq-len", "20", "--batch-size", "2", "--grad-accum", "2"])
        .args(["--steps", "4", "--device-memory", "268435456"])
        .args(extra);
    c
}

fn expect_clean_failure(out: &Output, needle: &str) -> Result<(), String> {
    let (_, err) = text(out);
    if out.status.success() {
        return Err(format!("exited 0; stderr:\n{err}"));
    }
    if err.contains("panicked") {
        return Err(format!("panicked:\n{err}"));
    }
    if !reports(&err).is_empty() {
        return Err(format!(
            "the emulator found defects on the failure path:\n{}",
            reports(&err).join("\n")
        ));
    }
    if !err.contains(needle) {
        return Err(format!("stderr does not name `{needle}`:\n{err}"));
    }
    Ok(())
}

/// A driver 12.8 cannot JIT the PTX ISA 8.8 that NVRTC 12.9 emits: megatrain loads the CUBIN
/// for the device instead, so it runs there.
fn runs_on_a_cuda_12_8_driver() -> Result<(), String> {
    let mut c = train(&[]);
    c.env("CUEMU_DRIVER", "12080");
    let out = run(c, Duration::from_secs(300))?;
    let (_, err) = text(&out);
    if !out.status.success() || !reports(&err).is_empty() {
        return Err(format!("failed on an emulated 12.8 driver:\n{err}"));
    }
    Ok(())
}

/// Without libcublas the device open is a clean one-line error naming the library, where it
/// looked, and a fix that works without network.
fn a_missing_cublas_is_named() -> Result<(), String> {
    let mut c = train(&[]);
    c.env("CUEMU_NO_CUBLAS", "1");
    let out = run(c, Duration::from_secs(300))?;
    for needle in [
        "cuBLAS `libcublas.so.13 or libcublas.so.12`: not found (looked in:",
        "the dynamic linker's path",
        "MEGATRAIN_CUDA_VENV",
        "no network needed",
    ] {
        expect_clean_failure(&out, needle)?;
    }
    let (_, err) = text(&out);
    let lines = err.lines().filter(|l| l.starts_with("error:")).count();
    if lines != 1 {
        return Err(format!("{lines} error lines, not one:\n{err}"));
    }
    if out.status.code() != Some(2) {
        return Err(format!(
            "exit status {:?}, not 2 (bad input)",
            out.status.code()
        ));
    }
    Ok(())
}

/// The store's streamed regions page-locked in pieces as small as a shard (one
/// `cuMemHostRegister` per shard): every copy still lies in one registration — the emulator
/// reports a copy from memory that is not page-locked — and training runs as before.
fn registered_in_pieces_every_copy_is_page_locked() -> Result<(), String> {
    let mut c = train(&[]);
    c.env("MEGATRAIN_REGISTER_PIECE", "1")
        .env("CUEMU_COUNTS", "1");
    let out = run(c, Duration::from_secs(300))?;
    let (_, err) = text(&out);
    if !out.status.success() || !reports(&err).is_empty() {
        return Err(format!("failed with one registration per shard:\n{err}"));
    }
    let registrations: u64 = err
        .lines()
        .find_map(|l| l.strip_prefix("cuemu: count cuMemHostRegister_v2 "))
        .and_then(|n| n.trim().parse().ok())
        .unwrap_or(0);
    // The golden model: 4 units (embedding, 2 blocks, final norm) × params and grads.
    if registrations < 8 {
        return Err(format!(
            "only {registrations} cuMemHostRegister calls: the regions were not cut at shards"
        ));
    }
    Ok(())
}

/// `megatrain selftest --device cuda --stack-only` through the emulator, with `env`.
fn stack_only(env: &[(&str, &str)]) -> Result<Output, String> {
    let mut c = emulated(Path::new(megatrain()));
    c.args(["selftest", "--device", "cuda", "--stack-only"]);
    for (k, v) in env {
        c.env(k, v);
    }
    run(c, Duration::from_secs(300))
}

/// A driver for CUDA 12.4 is refused up front, by version, with the fix.
fn refuses_a_driver_older_than_cuda_12_8() -> Result<(), String> {
    let out = stack_only(&[("CUEMU_DRIVER", "12040")])?;
    expect_clean_failure(
        &out,
        "it supports CUDA 12.4; megatrain needs CUDA 12.8 or newer",
    )?;
    expect_clean_failure(&out, "update the NVIDIA driver")
}

/// An sm_75 GPU (a T4) is refused by name before any kernel is compiled for it.
fn refuses_an_sm_75_gpu_by_name() -> Result<(), String> {
    let out = stack_only(&[("CUEMU_DEVICE", "t4")])?;
    expect_clean_failure(
        &out,
        "GPU `0 (Tesla T4 (cuemu))`: compute capability 7.5 (sm_75)",
    )?;
    expect_clean_failure(&out, "sm_80 or newer")
}

/// The emulator as a CUDA 13 stack (sonames `.so.13` only) under a CUDA 12 driver: the CUDA 13
/// libraries are passed over, saying why.
fn cuda_13_libraries_on_a_cuda_12_driver_are_passed_over() -> Result<(), String> {
    let out = stack_only(&[("CUEMU_CUDA", "13"), ("CUEMU_DRIVER", "12090")])?;
    expect_clean_failure(&out, "is CUDA 13, newer than the driver's CUDA 12")
}

/// Under CUDA 13 (no unversioned names), an unversioned `libnvrtc.so` of another release
/// first on the loader's path is what cudarc's lookup would bind: caught and named, not run
/// with two NVRTCs.
fn an_unversioned_library_first_on_the_path_is_caught() -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let real = std::env::var("MEGATRAIN_NVRTC_LIB")
        .map_err(|_| "MEGATRAIN_NVRTC_LIB (a real CUDA 12 NVRTC) is not set".to_owned())?;
    if !real.ends_with(".so.12") {
        return Err(format!("MEGATRAIN_NVRTC_LIB={real} is not a CUDA 12 NVRTC"));
    }
    std::os::unix::fs::symlink(&real, dir.path().join("libnvrtc.so")).map_err(|e| e.to_string())?;
    let path = format!(
        "{}:{}",
        dir.path().display(),
        std::env::var("LD_LIBRARY_PATH").unwrap_or_default()
    );
    let out = stack_only(&[("CUEMU_CUDA", "13"), ("LD_LIBRARY_PATH", &path)])?;
    expect_clean_failure(
        &out,
        &format!(
            "the dynamic linker gave cudarc {}/libnvrtc.so instead",
            dir.path().display()
        ),
    )
}

/// Compiled kernels are kept on disk: a second process compiles nothing, and a damaged entry is
/// compiled again (and replaced), never loaded.
fn compiled_kernels_are_cached_and_checked() -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let cache = dir.path().to_str().unwrap();
    let line = |out: &Output| -> Result<String, String> {
        let (o, e) = text(out);
        if !out.status.success() {
            return Err(format!("failed:\n{o}\n{e}"));
        }
        o.lines()
            .find(|l| l.trim_start().starts_with("kernels "))
            .map(str::to_owned)
            .ok_or_else(|| format!("no kernels line:\n{o}"))
    };
    // One program per kernel file.
    let files = megatrain::device::kernels::FILES.len();
    let first = line(&stack_only(&[("MEGATRAIN_KERNEL_CACHE", cache)])?)?;
    if !first.contains(&format!("{files} compiled now, 0 from the disk cache")) {
        return Err(format!("first run: {first}"));
    }
    let second = line(&stack_only(&[("MEGATRAIN_KERNEL_CACHE", cache)])?)?;
    if !second.contains(&format!("0 compiled now, {files} from the disk cache")) {
        return Err(format!("second run: {second}"));
    }
    let entry = std::fs::read_dir(dir.path())
        .map_err(|e| e.to_string())?
        .filter_map(|e| e.ok())
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|x| x == "kc"))
        .ok_or("no cache entry written")?;
    let mut b = std::fs::read(&entry).map_err(|e| e.to_string())?;
    let mid = b.len() / 2;
    b[mid] ^= 0x55;
    std::fs::write(&entry, &b).map_err(|e| e.to_string())?;
    let third = line(&stack_only(&[("MEGATRAIN_KERNEL_CACHE", cache)])?)?;
    if !third.contains(&format!(
        "1 compiled now, {} from the disk cache",
        files - 1
    )) {
        return Err(format!("after damaging an entry: {third}"));
    }
    // An entry that checks out but holds a CUBIN the driver refuses (here: one the emulator
    // never compiled) is compiled again, not a failed start.
    let b = std::fs::read(&entry).map_err(|e| e.to_string())?;
    let len = |i: usize| u64::from_le_bytes(b[16 + 8 * i..24 + 8 * i].try_into().unwrap()) as usize;
    let (cubin_len, ptx_len, log_len) = (len(0), len(1), len(2));
    let mut body = b[..40 + cubin_len + ptx_len + log_len].to_vec();
    // A byte of the ELF image's last section: the header (and so its architecture) stands.
    body[40 + cubin_len - 1] ^= 0x01;
    let crc = crc32c::crc32c(&body);
    body.extend_from_slice(&crc.to_le_bytes());
    std::fs::write(&entry, &body).map_err(|e| e.to_string())?;
    let fourth = line(&stack_only(&[("MEGATRAIN_KERNEL_CACHE", cache)])?)?;
    if !fourth.contains("1 cached ones refused by the driver and compiled again") {
        return Err(format!("after an entry the driver refuses: {fourth}"));
    }
    Ok(())
}

/// An enqueue failure mid-step, with the streams still busy (random delays): a clean error, and
/// no host memory released, no buffer reused and no CUDA call made from a host function while
/// copies are in flight.
fn an_enqueue_failure_drains_before_releasing() -> Result<(), String> {
    for n in [20, 45, 75] {
        let mut c = train(&[]);
        c.env("CUEMU_DELAYS", "3000")
            .env("CUEMU_FAIL", format!("cuMemcpyHtoDAsync_v2:{n}"));
        let out = run(c, Duration::from_secs(300))?;
        expect_clean_failure(&out, "host to device copy of")
            .map_err(|e| format!("copy {n}: {e}"))?;
    }
    Ok(())
}

/// The watchdog thread cannot bind the context: the run fails saying so (it used to go on
/// without one, and the first fault would have hung it).
fn a_watchdog_without_context_fails_the_run() -> Result<(), String> {
    let mut c = train(&[]);
    c.env("CUEMU_FAIL", "cuCtxSetCurrent@cuda-watchdog");
    let out = run(c, Duration::from_secs(300))?;
    expect_clean_failure(&out, "watchdog")
}

/// A kernel faulting asynchronously ends the run with the fault, without hanging.
fn an_asynchronous_fault_ends_the_run() -> Result<(), String> {
    let mut c = train(&[]);
    c.env("CUEMU_FAIL", "launch:40");
    let out = run(c, Duration::from_secs(300))?;
    expect_clean_failure(&out, "asynchronous fault")
}

/// After ten hours of uptime an f32 millisecond count since start-up is 4 ms coarse; the
/// timeline's durations are measured within the step, so they stay exact.
fn durations_stay_exact_after_hours_of_uptime() -> Result<(), String> {
    let dir = tempfile::tempdir().map_err(|e| e.to_string())?;
    let metrics = dir.path().join("m.jsonl");
    let mut c = train(&["--metrics", metrics.to_str().unwrap()]);
    c.env("CUEMU_CLOCK_SKIP", "36000");
    let out = run(c, Duration::from_secs(300))?;
    if !out.status.success() {
        return Err(text(&out).1);
    }
    let lines = std::fs::read_to_string(&metrics).map_err(|e| e.to_string())?;
    for l in lines.lines() {
        let v: serde_json::Value = serde_json::from_str(l).map_err(|e| e.to_string())?;
        for key in ["compute_s", "transfer_s"] {
            let s = v[key].as_f64().unwrap_or(0.0);
            let quanta = s / 0.004;
            if s <= 0.0 || (quanta - quanta.round()).abs() < 1e-6 {
                return Err(format!(
                    "step {}: {key} = {s} s, a multiple of the 4 ms an f32 count of 10 h has",
                    v["step"]
                ));
            }
        }
    }
    Ok(())
}

// ---- the teeth -------------------------------------------------------------------------------------

/// Run scenario `name` in a child under the emulator; with `bug`, expect a report of `kind`
/// naming every string of `names`; without, expect a clean run.
fn scenario(
    name: &str,
    bug: bool,
    kind: &str,
    names: &[&str],
    env: &[(&str, &str)],
) -> Result<(), String> {
    let exe = std::env::current_exe().map_err(|e| e.to_string())?;
    let mut c = emulated(&exe);
    c.env("CUEMU_SCENARIO", name)
        .env("CUEMU_SCENARIO_BUG", if bug { "1" } else { "0" });
    for (k, v) in env {
        c.env(k, v);
    }
    let out = run(c, Duration::from_secs(300))?;
    let (o, err) = text(&out);
    let found = reports(&err);
    if !bug {
        if !found.is_empty() || !out.status.success() {
            return Err(format!(
                "{name} without the bug is not clean (exit {:?}):\n{o}{err}",
                out.status.code()
            ));
        }
        return Ok(());
    }
    let hit = found
        .iter()
        .find(|l| l.contains(&format!("cuemu: error: {kind}")))
        .ok_or_else(|| format!("{name}: no `{kind}` report; stderr:\n{err}"))?;
    if let Some(missing) = names.iter().find(|n| !hit.contains(*n)) {
        return Err(format!(
            "{name}: the report does not name `{missing}`: {hit}"
        ));
    }
    Ok(())
}

fn teeth_deleted_syncthreads_in_attention() -> Result<(), String> {
    let env = [("CUEMU_SCHEDULES", "3")];
    scenario("attention", false, "", &[], &env)?;
    scenario(
        "attention",
        true,
        "schedule-dependent result",
        &["attention_fwd_f32", "launch #"],
        &env,
    )
}

fn teeth_block_not_a_multiple_of_32_in_a_warp_reduction() -> Result<(), String> {
    scenario("rmsnorm-block", false, "", &[], &[])?;
    scenario(
        "rmsnorm-block",
        true,
        "warp operation",
        &["rmsnorm_fwd_f32", "launch #", "does not exist"],
        &[],
    )
}

fn teeth_grid_one_block_short() -> Result<(), String> {
    scenario("rmsnorm-grid", false, "", &[], &[])?;
    scenario(
        "rmsnorm-grid",
        true,
        "read of never-written device memory",
        &["rmsnorm_fwd_f32", "launch #"],
        &[],
    )
}

fn teeth_out_of_bounds_write() -> Result<(), String> {
    scenario("rmsnorm-oob", false, "", &[], &[])?;
    scenario(
        "rmsnorm-oob",
        true,
        "out-of-bounds",
        &["rmsnorm_fwd_f32", "launch #"],
        &[],
    )
}

fn teeth_wrong_leading_dimension_in_a_gemm() -> Result<(), String> {
    scenario("gemm-lda", false, "", &[], &[])?;
    scenario(
        "gemm-lda",
        true,
        "invalid cuBLAS argument",
        &["cublasSgemm_v2", "lda"],
        &[],
    )
}

fn teeth_removed_stream_wait_between_copy_in_and_compute() -> Result<(), String> {
    scenario("stream-wait", false, "", &[], &[])?;
    scenario(
        "stream-wait",
        true,
        "stream hazard",
        &["rmsnorm_fwd_f32", "cuMemcpyHtoDAsync"],
        &[],
    )
}

fn teeth_host_function_calling_cuda() -> Result<(), String> {
    scenario("host-function", false, "", &[], &[])?;
    scenario(
        "host-function",
        true,
        "CUDA call from a host function",
        &["cuMemAlloc_v2", "host function"],
        &[],
    )
}

/// The emulated tensor-core instruction follows the PTX ISA's fragment layouts: a kernel that
/// loads A, B and C into fragments by the documented formulas and stores D back gets
/// D = A·B + C.
fn mma_follows_the_ptx_fragment_layouts() -> Result<(), String> {
    scenario("mma", false, "", &[], &[])
}

// ---- the runner ------------------------------------------------------------------------------------

type Check = (&'static str, fn() -> Result<(), String>);

const CHECKS: &[Check] = &[
    (
        "teeth_deleted_syncthreads_in_attention",
        teeth_deleted_syncthreads_in_attention,
    ),
    (
        "teeth_block_not_a_multiple_of_32_in_a_warp_reduction",
        teeth_block_not_a_multiple_of_32_in_a_warp_reduction,
    ),
    ("teeth_grid_one_block_short", teeth_grid_one_block_short),
    ("teeth_out_of_bounds_write", teeth_out_of_bounds_write),
    (
        "teeth_wrong_leading_dimension_in_a_gemm",
        teeth_wrong_leading_dimension_in_a_gemm,
    ),
    (
        "teeth_removed_stream_wait_between_copy_in_and_compute",
        teeth_removed_stream_wait_between_copy_in_and_compute,
    ),
    (
        "teeth_host_function_calling_cuda",
        teeth_host_function_calling_cuda,
    ),
    (
        "mma_follows_the_ptx_fragment_layouts",
        mma_follows_the_ptx_fragment_layouts,
    ),
    ("runs_on_a_cuda_12_8_driver", runs_on_a_cuda_12_8_driver),
    ("a_missing_cublas_is_named", a_missing_cublas_is_named),
    (
        "registered_in_pieces_every_copy_is_page_locked",
        registered_in_pieces_every_copy_is_page_locked,
    ),
    (
        "refuses_a_driver_older_than_cuda_12_8",
        refuses_a_driver_older_than_cuda_12_8,
    ),
    ("refuses_an_sm_75_gpu_by_name", refuses_an_sm_75_gpu_by_name),
    (
        "cuda_13_libraries_on_a_cuda_12_driver_are_passed_over",
        cuda_13_libraries_on_a_cuda_12_driver_are_passed_over,
    ),
    (
        "an_unversioned_library_first_on_the_path_is_caught",
        an_unversioned_library_first_on_the_path_is_caught,
    ),
    (
        "compiled_kernels_are_cached_and_checked",
        compiled_kernels_are_cached_and_checked,
    ),
    (
        "an_enqueue_failure_drains_before_releasing",
        an_enqueue_failure_drains_before_releasing,
    ),
    (
        "a_watchdog_without_context_fails_the_run",
        a_watchdog_without_context_fails_the_run,
    ),
    (
        "an_asynchronous_fault_ends_the_run",
        an_asynchronous_fault_ends_the_run,
    ),
    (
        "durations_stay_exact_after_hours_of_uptime",
        durations_stay_exact_after_hours_of_uptime,
    ),
];

fn main() {
    if let Ok(name) = std::env::var("CUEMU_SCENARIO") {
        let bug = std::env::var("CUEMU_SCENARIO_BUG").is_ok_and(|v| v == "1");
        std::process::exit(match scenarios::run(&name, bug) {
            Ok(()) => 0,
            Err(e) => {
                eprintln!("scenario {name}: {e}");
                1
            }
        });
    }
    let filters: Vec<String> = std::env::args()
        .skip(1)
        .filter(|a| !a.starts_with('-'))
        .collect();
    let chosen: Vec<&Check> = CHECKS
        .iter()
        .filter(|(n, _)| filters.is_empty() || filters.iter().any(|f| n.contains(f.as_str())))
        .collect();
    println!("\nrunning {} checks", chosen.len());
    let mut failed = Vec::new();
    for (name, check) in chosen {
        let t0 = Instant::now();
        let r = check();
        let secs = t0.elapsed().as_secs_f64();
        match r {
            Ok(()) => println!("check {name} ... ok ({secs:.1} s)"),
            Err(e) => {
                println!("check {name} ... FAILED ({secs:.1} s)\n{e}\n");
                failed.push(name);
            }
        }
    }
    if failed.is_empty() {
        println!("\ncheck result: ok");
    } else {
        println!(
            "\ncheck result: FAILED: {}",
            failed.iter().map(|s| **s).collect::<Vec<_>>().join(", ")
        );
        std::process::exit(1);
    }
}

/// The children: small programs on the CUDA driver, NVRTC and cuBLAS (the emulator's, here),
/// each with or without one bug. They use the raw driver API (cudarc's `sys`/`result`) so that
/// no layer adds the waits or checks whose absence is the point.
mod scenarios {
    use cudarc::driver::{result, sys, CudaContext};
    use megatrain::device::kernels::FILES;
    use std::ffi::c_void;

    type R<T> = Result<T, String>;

    fn ck(r: sys::CUresult, what: &str) -> R<()> {
        if r == sys::CUresult::CUDA_SUCCESS {
            Ok(())
        } else {
            Err(format!("{what}: {r:?}"))
        }
    }

    fn source(file: &str) -> R<String> {
        FILES
            .iter()
            .find(|f| f.file == file)
            .map(|f| f.program())
            .ok_or_else(|| format!("no kernel file {file}"))
    }

    /// Compile `src` (NVRTC, sm_90) and load `kernel`.
    fn kernel(ctx: &std::sync::Arc<CudaContext>, src: &str, kernel: &str) -> R<sys::CUfunction> {
        let include =
            std::env::var("MEGATRAIN_CUDA_INCLUDE").map_err(|_| "MEGATRAIN_CUDA_INCLUDE unset")?;
        let ptx = cudarc::nvrtc::compile_ptx_with_opts(
            src,
            cudarc::nvrtc::CompileOptions {
                arch: Some("sm_90"),
                include_paths: vec![include],
                options: vec!["--std=c++17".into()],
                ..Default::default()
            },
        )
        .map_err(|e| format!("NVRTC: {e:?}"))?;
        let m = ctx.load_module(ptx).map_err(|e| format!("load: {e:?}"))?;
        let f = m
            .load_function(kernel)
            .map_err(|e| format!("function: {e:?}"))?;
        let raw = f.cu_function();
        std::mem::forget(m);
        Ok(raw)
    }

    fn alloc(bytes: usize) -> R<u64> {
        let mut p = 0u64;
        // SAFETY: writes one device pointer.
        ck(unsafe { sys::cuMemAlloc_v2(&mut p, bytes) }, "cuMemAlloc")?;
        Ok(p)
    }

    fn stream() -> R<sys::CUstream> {
        result::stream::create(result::stream::StreamKind::NonBlocking)
            .map_err(|e| format!("{e:?}"))
    }

    fn upload(dst: u64, v: &[f32], s: sys::CUstream) -> R<()> {
        // SAFETY: `dst` holds v.len() floats; a pageable source is staged by the call.
        let r = unsafe { sys::cuMemcpyHtoDAsync_v2(dst, v.as_ptr().cast(), 4 * v.len(), s) };
        ck(r, "copy in")
    }

    fn download(v: &mut [f32], src: u64, s: sys::CUstream) -> R<()> {
        // SAFETY: `src` holds v.len() floats; a pageable destination makes the call synchronous.
        let r = unsafe { sys::cuMemcpyDtoHAsync_v2(v.as_mut_ptr().cast(), src, 4 * v.len(), s) };
        ck(r, "copy out")?;
        // SAFETY: a live stream.
        ck(unsafe { sys::cuStreamSynchronize(s) }, "synchronize")
    }

    fn launch(
        f: sys::CUfunction,
        grid: (u32, u32, u32),
        block: u32,
        smem: u32,
        s: sys::CUstream,
        args: &mut [*mut c_void],
    ) -> R<()> {
        // SAFETY: the arguments match the kernel's parameters one for one.
        unsafe { result::launch_kernel(f, grid, (block, 1, 1), smem, s, args) }
            .map_err(|e| format!("launch: {e:?}"))
    }

    /// RMSNorm rows: `rows × cols` inputs on the device; returns (out, rstd, x, w, rows, cols).
    struct Norm {
        out: u64,
        rstd: u64,
        x: u64,
        w: u64,
        rows: i32,
        cols: i32,
        eps: f32,
        w_offset: f32,
    }

    impl Norm {
        fn new(s: sys::CUstream) -> R<Norm> {
            let (rows, cols) = (6usize, 100usize);
            let x: Vec<f32> = (0..rows * cols)
                .map(|i| ((i * 37 % 101) as f32 - 50.0) / 25.0)
                .collect();
            let w: Vec<f32> = (0..cols).map(|i| 1.0 + i as f32 / 100.0).collect();
            let n = Norm {
                out: alloc(4 * rows * cols)?,
                rstd: alloc(4 * rows)?,
                x: alloc(4 * rows * cols)?,
                w: alloc(4 * cols)?,
                rows: rows as i32,
                cols: cols as i32,
                eps: 1e-5,
                w_offset: 0.0,
            };
            upload(n.x, &x, s)?;
            upload(n.w, &w, s)?;
            Ok(n)
        }

        fn launch(&mut self, f: sys::CUfunction, grid: u32, block: u32, s: sys::CUstream) -> R<()> {
            let mut args: [*mut c_void; 8] = [
                (&mut self.out as *mut u64).cast(),
                (&mut self.rstd as *mut u64).cast(),
                (&mut self.x as *mut u64).cast(),
                (&mut self.w as *mut u64).cast(),
                (&mut self.rows as *mut i32).cast(),
                (&mut self.cols as *mut i32).cast(),
                (&mut self.eps as *mut f32).cast(),
                (&mut self.w_offset as *mut f32).cast(),
            ];
            launch(f, (grid, 1, 1), block, 0, s, &mut args)
        }

        fn download(&self, s: sys::CUstream) -> R<Vec<f32>> {
            let mut v = vec![0f32; (self.rows * self.cols) as usize];
            download(&mut v, self.out, s)?;
            Ok(v)
        }
    }

    pub fn run(name: &str, bug: bool) -> R<()> {
        let ctx = CudaContext::new(0).map_err(|e| format!("context: {e:?}"))?;
        let s = stream()?;
        match name {
            "attention" => attention(&ctx, s, bug),
            "rmsnorm-block" => {
                let f = kernel(&ctx, &source("rmsnorm.cu")?, "rmsnorm_fwd_f32")?;
                let mut n = Norm::new(s)?;
                // A warp reduction needs whole warps: 48 threads leave lanes 16..31 of the
                // second warp absent from its full-mask shuffles.
                n.launch(f, n.rows as u32, if bug { 48 } else { 64 }, s)?;
                n.download(s).map(|_| ())
            }
            "rmsnorm-grid" => {
                let f = kernel(&ctx, &source("rmsnorm.cu")?, "rmsnorm_fwd_f32")?;
                let mut n = Norm::new(s)?;
                let grid = n.rows as u32 - u32::from(bug);
                n.launch(f, grid, 64, s)?;
                n.download(s).map(|_| ())
            }
            "rmsnorm-oob" => {
                let mut src = source("rmsnorm.cu")?;
                if bug {
                    let (a, b) = ("rstd[row] = r;", "rstd[row + 1] = r;");
                    if !src.contains(a) {
                        return Err("the rmsnorm source changed: cannot apply the bug".into());
                    }
                    src = src.replacen(a, b, 1);
                }
                let f = kernel(&ctx, &src, "rmsnorm_fwd_f32")?;
                let mut n = Norm::new(s)?;
                n.launch(f, n.rows as u32, 64, s)?;
                n.download(s).map(|_| ())
            }
            "gemm-lda" => gemm(&ctx, s, bug),
            "stream-wait" => stream_wait(&ctx, s, bug),
            "host-function" => host_function(s, bug),
            "mma" => mma(&ctx, s),
            _ => Err(format!("no scenario {name}")),
        }
    }

    fn attention(ctx: &std::sync::Arc<CudaContext>, s: sys::CUstream, bug: bool) -> R<()> {
        use megatrain::device::launch::{attention, AttnShape, DEFAULT_SMEM};
        let mut src = source("attention.cu")?;
        if bug {
            // The barrier between loading a K/V tile and reading it, in the forward kernel.
            let a =
                "        load_tile(vs, v, b, 0, t, nkv, g, hd, j0, tile);\n        __syncthreads();\n";
            if !src.contains(a) {
                return Err("the attention source changed: cannot apply the bug".into());
            }
            src = src.replacen(
                a,
                "        load_tile(vs, v, b, 0, t, nkv, g, hd, j0, tile);\n",
                1,
            );
        }
        let f = kernel(ctx, &src, "attention_fwd_f32")?;
        let shape = AttnShape::causal(1, 20, 2, 1, 32);
        let l = attention(shape, DEFAULT_SMEM).map_err(|e| e.to_string())?;
        let (q_len, kv_len) = (
            shape.t * shape.nh * shape.hd,
            shape.t * shape.nkv * shape.hd,
        );
        let val = |n: usize, k: usize| -> Vec<f32> {
            (0..n)
                .map(|i| (((i * 7 + k) % 23) as f32 - 11.0) / 11.0)
                .collect()
        };
        let (mut out, mut lse) = (alloc(4 * q_len)?, alloc(4 * shape.t * shape.nh)?);
        let (mut q, mut k, mut v) = (alloc(4 * q_len)?, alloc(4 * kv_len)?, alloc(4 * kv_len)?);
        upload(q, &val(q_len, 1), s)?;
        upload(k, &val(kv_len, 2), s)?;
        upload(v, &val(kv_len, 3), s)?;
        // Two documents of 12 and 8 tokens (positions as u32; upload copies their bytes).
        let positions: Vec<f32> = megatrain::model::ops::document_positions(&[12, 8])
            .into_iter()
            .map(f32::from_bits)
            .collect();
        let mut pos = alloc(4 * shape.t)?;
        upload(pos, &positions, s)?;
        let (mut t, mut q0, mut q1, mut nh, mut nkv, mut hd) = (
            shape.t as i32,
            shape.q0 as i32,
            shape.q1 as i32,
            shape.nh as i32,
            shape.nkv as i32,
            shape.hd as i32,
        );
        let (mut tile, mut scale) = (l.tile as i32, 1.0f32 / (shape.hd as f32).sqrt());
        // No sliding window, no soft cap.
        let (mut window, mut softcap) = (0i32, 0.0f32);
        let mut args: [*mut c_void; 16] = [
            (&mut out as *mut u64).cast(),
            (&mut lse as *mut u64).cast(),
            (&mut q as *mut u64).cast(),
            (&mut k as *mut u64).cast(),
            (&mut v as *mut u64).cast(),
            (&mut pos as *mut u64).cast(),
            (&mut t as *mut i32).cast(),
            (&mut window as *mut i32).cast(),
            (&mut q0 as *mut i32).cast(),
            (&mut q1 as *mut i32).cast(),
            (&mut nh as *mut i32).cast(),
            (&mut nkv as *mut i32).cast(),
            (&mut hd as *mut i32).cast(),
            (&mut tile as *mut i32).cast(),
            (&mut scale as *mut f32).cast(),
            (&mut softcap as *mut f32).cast(),
        ];
        launch(f, l.rows.grid, l.rows.block, l.rows.smem, s, &mut args)?;
        let mut o = vec![0f32; q_len];
        download(&mut o, out, s)
    }

    fn gemm(ctx: &std::sync::Arc<CudaContext>, s: sys::CUstream, bug: bool) -> R<()> {
        use cudarc::cublas::sys as b;
        let _ = ctx;
        let (m, n, k) = (8i32, 6i32, 32i32);
        let (a, bm, c) = (
            alloc(4 * (m * k) as usize)?,
            alloc(4 * (k * n) as usize)?,
            alloc(4 * (m * n) as usize)?,
        );
        upload(a, &vec![0.5; (m * k) as usize], s)?;
        upload(bm, &vec![0.25; (k * n) as usize], s)?;
        let mut h: b::cublasHandle_t = std::ptr::null_mut();
        // SAFETY: cuBLAS handle creation and use with valid pointers; A is k × m stored (op T).
        unsafe {
            let st = b::cublasCreate_v2(&mut h);
            if st != b::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(format!("cublasCreate: {st:?}"));
            }
            b::cublasSetStream_v2(h, s as _);
            let (alpha, beta) = (1.0f32, 0.0f32);
            // op(A) = Aᵀ with A stored k × m: lda must be at least k.
            let lda = if bug { k - 1 } else { k };
            let st = b::cublasSgemm_v2(
                h,
                b::cublasOperation_t::CUBLAS_OP_T,
                b::cublasOperation_t::CUBLAS_OP_N,
                m,
                n,
                k,
                &alpha,
                a as *const f32,
                lda,
                bm as *const f32,
                k,
                &beta,
                c as *mut f32,
                m,
            );
            if st != b::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(format!("cublasSgemm: {st:?}"));
            }
            b::cublasDestroy_v2(h);
        }
        let mut out = vec![0f32; (m * n) as usize];
        download(&mut out, c, s)?;
        if out.iter().any(|x| (x - 4.0).abs() > 1e-5) {
            return Err(format!("wrong GEMM result {}", out[0]));
        }
        Ok(())
    }

    fn stream_wait(ctx: &std::sync::Arc<CudaContext>, compute: sys::CUstream, bug: bool) -> R<()> {
        let f = kernel(ctx, &source("rmsnorm.cu")?, "rmsnorm_fwd_f32")?;
        let copy_in = stream()?;
        let mut n = Norm::new(copy_in)?;
        // SAFETY: a fresh event on a live stream.
        let ev = result::event::create(sys::CUevent_flags::CU_EVENT_DISABLE_TIMING)
            .map_err(|e| format!("{e:?}"))?;
        // SAFETY: live event and stream.
        unsafe { result::event::record(ev, copy_in) }.map_err(|e| format!("{e:?}"))?;
        if !bug {
            // SAFETY: live stream and event.
            ck(unsafe { sys::cuStreamWaitEvent(compute, ev, 0) }, "wait")?;
        }
        n.launch(f, n.rows as u32, 64, compute)?;
        n.download(compute).map(|_| ())
    }

    /// One warp: fragments gathered by the PTX ISA's formulas for mma.m16n8k16 (bf16 A row-major,
    /// B column-major, fp32 C/D), the product through common.cuh's wrapper, D scattered back.
    const MMA_KERNEL: &str = r#"
extern "C" __global__ void mma_test(float* d, const unsigned short* a, const unsigned short* b,
                                    const float* c) {
    // a: A [16][16], b: B [16][8] (k, n), c and d: [16][8]; all row-major.
    const unsigned lane = threadIdx.x, grp = lane >> 2, tig = lane & 3;
    unsigned ra[4], rb[2];
    float rc[4], rd[4];
    for (unsigned r = 0; r < 4; r++) {
        unsigned v = 0;
        for (unsigned h = 0; h < 2; h++) {
            const unsigned i = 2 * r + h;
            const unsigned row = grp + ((i == 2 || i == 3 || i == 6 || i == 7) ? 8 : 0);
            const unsigned col = 2 * tig + (i & 1) + (i >= 4 ? 8 : 0);
            v |= (unsigned)a[row * 16 + col] << (16 * h);
        }
        ra[r] = v;
    }
    for (unsigned r = 0; r < 2; r++) {
        unsigned v = 0;
        for (unsigned h = 0; h < 2; h++) {
            const unsigned i = 2 * r + h;
            const unsigned k = 2 * tig + (i & 1) + (i >= 2 ? 8 : 0);
            v |= (unsigned)b[k * 8 + grp] << (16 * h);
        }
        rb[r] = v;
    }
    for (unsigned i = 0; i < 4; i++) rc[i] = c[(grp + (i >= 2 ? 8 : 0)) * 8 + 2 * tig + (i & 1)];
    mma_m16n8k16_bf16(rd, ra, rb, rc);
    for (unsigned i = 0; i < 4; i++) d[(grp + (i >= 2 ? 8 : 0)) * 8 + 2 * tig + (i & 1)] = rd[i];
}
"#;

    fn mma(ctx: &std::sync::Arc<CudaContext>, s: sys::CUstream) -> R<()> {
        let common = std::fs::read_to_string(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("kernels/common.cuh"),
        )
        .map_err(|e| e.to_string())?;
        let f = kernel(ctx, &format!("{common}\n{MMA_KERNEL}"), "mma_test")?;
        // Values exact in bf16 (multiples of 1/8 up to ±2), so every product is exact.
        let val = |i: usize, k: usize| (((i * 13 + k * 7) % 33) as f32 - 16.0) / 8.0;
        let a: Vec<f32> = (0..256).map(|i| val(i, 1)).collect();
        let b: Vec<f32> = (0..128).map(|i| val(i, 2)).collect();
        let c: Vec<f32> = (0..128).map(|i| val(i, 3) * 0.5).collect();
        let bits =
            |v: &[f32]| -> Vec<u16> { v.iter().map(|x| (x.to_bits() >> 16) as u16).collect() };
        let (da, db, dc, dd) = (alloc(512)?, alloc(256)?, alloc(512)?, alloc(512)?);
        let up16 = |dst: u64, v: &[u16]| -> R<()> {
            // SAFETY: `dst` holds v.len() halfwords.
            let r = unsafe { sys::cuMemcpyHtoDAsync_v2(dst, v.as_ptr().cast(), 2 * v.len(), s) };
            ck(r, "copy in")
        };
        up16(da, &bits(&a))?;
        up16(db, &bits(&b))?;
        upload(dc, &c, s)?;
        let (mut pd, mut pa, mut pb, mut pc) = (dd, da, db, dc);
        let mut args: [*mut c_void; 4] = [
            (&mut pd as *mut u64).cast(),
            (&mut pa as *mut u64).cast(),
            (&mut pb as *mut u64).cast(),
            (&mut pc as *mut u64).cast(),
        ];
        launch(f, (1, 1, 1), 32, 0, s, &mut args)?;
        let mut d = vec![0f32; 128];
        download(&mut d, dd, s)?;
        for r in 0..16 {
            for col in 0..8 {
                let want = f64::from(c[r * 8 + col])
                    + (0..16)
                        .map(|k| f64::from(a[r * 16 + k]) * f64::from(b[k * 8 + col]))
                        .sum::<f64>();
                let got = f64::from(d[r * 8 + col]);
                if (got - want).abs() > 1e-5 * want.abs().max(1.0) {
                    return Err(format!("D[{r}][{col}] = {got}, A·B + C = {want}"));
                }
            }
        }
        Ok(())
    }

    unsafe extern "C" fn calls_cuda(_: *mut c_void) {
        let mut p = 0u64;
        // SAFETY: a (forbidden) CUDA call from a host function; it must be refused, not run.
        unsafe { sys::cuMemAlloc_v2(&mut p, 64) };
    }

    unsafe extern "C" fn host_only(data: *mut c_void) {
        // SAFETY: `data` points to the counter `host_function` keeps alive until synchronised.
        unsafe { *data.cast::<u64>() += 1 };
    }

    fn host_function(s: sys::CUstream, bug: bool) -> R<()> {
        let mut counter = 0u64;
        let f: unsafe extern "C" fn(*mut c_void) = if bug { calls_cuda } else { host_only };
        // SAFETY: the counter outlives the stream synchronisation below.
        let r = unsafe { sys::cuLaunchHostFunc(s, Some(f), (&mut counter as *mut u64).cast()) };
        ck(r, "host function")?;
        // SAFETY: a live stream.
        ck(unsafe { sys::cuStreamSynchronize(s) }, "synchronize")?;
        if !bug && counter != 1 {
            return Err("the host function did not run".into());
        }
        Ok(())
    }
}
