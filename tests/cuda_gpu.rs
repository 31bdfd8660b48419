//! The CUDA path end to end, as a GPU would run it: `megatrain selftest --device cuda` (every
//! kernel and GEMM against the CPU reference, training steps against the CPU device, the link)
//! — on the CUDA emulator (tools/cuemu.sh), or on a real GPU with `MEGATRAIN_GPU=1`.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

/// The self-test. Under the emulator (where test.sh runs every launch under three thread
/// schedules and shared-memory poisons) its kernel, landing and link parts: the training part
/// is the same kernels on other data, minutes per schedule, and runs in full (one schedule) in
/// `gpu_check_passes_every_stage`. On a GPU, all of it.
#[test]
fn selftest_passes() {
    let mut c = common::megatrain_cuda();
    c.args(["selftest", "--device", "cuda"]);
    if std::env::var("MEGATRAIN_GPU").is_err() {
        c.args(["--only", "kernels,landings,link"]);
    }
    let out = c.output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    eprintln!("{stdout}");
    assert!(out.status.success(), "selftest failed:\n{stdout}\n{stderr}");
    assert!(
        !stderr.contains("cuemu: error"),
        "the emulator reported defects:\n{stderr}"
    );
    let checks = stdout.lines().filter(|l| l.ends_with("pass")).count();
    assert!(checks >= 30, "only {checks} checks passed:\n{stdout}");
    if std::env::var("MEGATRAIN_GPU").is_err() {
        assert!(
            stdout.contains("emulated"),
            "the link figures must say they are emulated:\n{stdout}"
        );
    }
}

/// `megatrain bench kernels` on small shapes: every GEMM and attention case is measured, the
/// tensor-core rows appear for a head dim they are built for, and under the emulator the report
/// says its times are not GPU figures.
#[test]
fn bench_kernels_reports_every_case() {
    let out = common::megatrain_cuda()
        .args([
            "bench", "kernels", "--tokens", "64", "--hidden", "128", "--ffn", "256",
        ])
        .args([
            "--heads",
            "2",
            "--kv-heads",
            "1",
            "--head-dim",
            "64",
            "--seq",
            "96",
        ])
        .args(["--reps", "1", "--json"])
        .output()
        .unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(
        out.status.success(),
        "bench kernels failed:\n{stdout}\n{stderr}"
    );
    assert!(!stderr.contains("cuemu: error"), "{stderr}");
    let r: serde_json::Value = serde_json::from_str(&stdout).unwrap();
    let rows = r["rows"].as_array().unwrap();
    // 4 GEMMs × 2 precisions, then SIMT forward, tensor-core forward and forward + backward.
    assert_eq!(rows.len(), 11, "{stdout}");
    for row in rows {
        let (ms, tflops) = (row["ms"].as_f64().unwrap(), row["tflops"].as_f64().unwrap());
        assert!(ms > 0.0 && tflops > 0.0, "{row}");
        // H100 datasheet peaks (the emulator's default profile).
        assert!(row["peak_tflops"].as_f64().is_some(), "{row}");
    }
    assert!(rows[10]["kernel"]
        .as_str()
        .unwrap()
        .contains("tensor cores"));
    // 2 · 2 · (96·96/2) · 2 heads · 64 = 2,359,296 forward FLOPs; 3.5× that forward + backward.
    assert_eq!(rows[9]["flops"].as_f64().unwrap(), 2_359_296.0);
    assert_eq!(rows[10]["flops"].as_f64().unwrap(), 3.5 * 2_359_296.0);
    if std::env::var("MEGATRAIN_GPU").is_err() {
        assert_eq!(r["emulated"], serde_json::Value::Bool(true), "{stdout}");
    }
}

/// A run on the CUDA device is the same bits every time, whatever the streams' timing: three
/// runs (fp32 and bf16; tied embeddings, 3 accumulated micro-batches, under different random
/// stream delays) give the same per-step gradient norms and byte-identical final weights. Every
/// gradient is summed in a fixed order: the weight-gradient column sums, the embedding gradient
/// (grouped by token, no atomics) and the accumulating copies.
#[test]
fn runs_are_bitwise_reproducible_under_random_stream_delays() {
    let golden = std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/train_accum");
    for precision in ["fp32", "bf16"] {
        let runs: Vec<(String, Vec<u8>)> = (1..=3)
            .map(|seed| {
                let dir = tempfile::tempdir().unwrap();
                let metrics = dir.path().join("m.jsonl");
                let mut c = common::megatrain_cuda();
                if std::env::var("MEGATRAIN_GPU").is_err() {
                    c.env("CUEMU_DELAYS", "300")
                        .env("CUEMU_SEED", seed.to_string());
                }
                let out = c
                    .args(["train", "--device", "cuda", "--precision", precision])
                    .arg("--init-from")
                    .arg(golden.join("init"))
                    .arg("--data")
                    .arg(golden.join("data.bin"))
                    .args(["--seq-len", "12", "--batch-size", "2", "--grad-accum", "3"])
                    .args(["--steps", "3", "--lr", "3e-3", "--grad-clip", "1.0"])
                    .args(["--device-memory", "268435456"])
                    .arg("--metrics")
                    .arg(&metrics)
                    .arg("--export-hf")
                    .arg(dir.path().join("hf"))
                    .output()
                    .unwrap();
                let stderr = String::from_utf8_lossy(&out.stderr);
                assert!(out.status.success(), "{precision} run {seed}:\n{stderr}");
                assert!(!stderr.contains("cuemu: error"), "{stderr}");
                let norms: Vec<String> = std::fs::read_to_string(&metrics)
                    .unwrap()
                    .lines()
                    .map(|l| {
                        let v: serde_json::Value = serde_json::from_str(l).unwrap();
                        format!("{}/{}", v["loss"], v["grad_norm"])
                    })
                    .collect();
                let weights =
                    std::fs::read(dir.path().join("hf/model-00001-of-00001.safetensors")).unwrap();
                (norms.join(" "), weights)
            })
            .collect();
        for (i, r) in runs.iter().enumerate().skip(1) {
            assert_eq!(r.0, runs[0].0, "{precision}: run {} losses/norms", i + 1);
            assert!(r.1 == runs[0].1, "{precision}: run {} final weights", i + 1);
        }
    }
}

/// `tools/gpu_check.sh` (`--emulated --big` here, on the GPU with `MEGATRAIN_GPU=1`), with the
/// emulator presenting CUDA 13: every stage passes, each writes its row, and at most 8 files come
/// back, summary.md first.
#[test]
fn gpu_check_passes_every_stage() {
    let out_dir = tempfile::tempdir().unwrap();
    let real = std::env::var("MEGATRAIN_GPU").is_ok_and(|v| v == "1");
    let mut c = std::process::Command::new(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/gpu_check.sh"),
    );
    if !real {
        // Every stage, --big's too (on a GPU that one is minutes and 59 GB of host RAM: run it
        // with the script itself).
        c.args(["--emulated", "--big"]).env("CUEMU_CUDA", "13");
    }
    let out = c
        .arg(out_dir.path())
        .env("MEGATRAIN_BIN", env!("CARGO_BIN_EXE_megatrain"))
        // One schedule: the self-test's own test runs the emulator's three.
        .env_remove("CUEMU_SCHEDULES")
        .output()
        .unwrap();
    let summary = std::fs::read_to_string(out_dir.path().join("summary.md")).unwrap_or_default();
    assert!(
        out.status.success(),
        "gpu_check failed:\n{summary}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    for stage in ["stack", "selftest", "goldens", "bench", "step", "moe"] {
        assert!(
            summary.contains(&format!("| {stage} | PASS |")),
            "{stage} did not pass:\n{summary}"
        );
    }
    if !real {
        // The emulator's findings (a race, a hazard, a bad warp mask) fail no call: they are
        // lines on stderr, which the script keeps in run.log.
        let log = std::fs::read_to_string(out_dir.path().join("run.log")).unwrap();
        assert!(
            !log.contains("cuemu: error"),
            "the emulator reported defects:\n{log}"
        );
        assert!(summary.contains("| big | PASS |"), "{summary}");
        // The emulator's NCCL (a GPU server may have none: SKIP there).
        assert!(summary.contains("| nccl | PASS | NCCL 2."), "{summary}");
        assert!(summary.contains("**emulated**"), "{summary}");
        assert!(summary.contains("NVRTC 13.0, cuBLAS 13.1"), "{summary}");
    }
    let files: Vec<String> = std::fs::read_dir(out_dir.path())
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(files.len() <= 8, "{files:?}");
}

/// On a GPU megatrain cannot use (an sm_75 T4, emulated), the check fails at its first stage with
/// the reason in the summary, skips the rest, and exits non-zero — a run cut short still reports.
#[test]
fn gpu_check_reports_a_refused_gpu() {
    if std::env::var("MEGATRAIN_GPU").is_ok_and(|v| v == "1") {
        eprintln!("SKIP: needs the emulator's T4 profile");
        return;
    }
    let out_dir = tempfile::tempdir().unwrap();
    let out = std::process::Command::new(
        std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/gpu_check.sh"),
    )
    .args(["--emulated"])
    .arg(out_dir.path())
    .env("MEGATRAIN_BIN", env!("CARGO_BIN_EXE_megatrain"))
    .env("CUEMU_DEVICE", "t4")
    .output()
    .unwrap();
    let summary = std::fs::read_to_string(out_dir.path().join("summary.md")).unwrap();
    assert!(!out.status.success(), "{summary}");
    assert!(
        summary.contains("| stack | FAIL |") && summary.contains("sm_80 or newer"),
        "{summary}"
    );
    for stage in ["selftest", "goldens", "bench", "nccl", "step", "moe", "big"] {
        assert!(
            summary.contains(&format!("| {stage} | SKIP |")),
            "{summary}"
        );
    }
}

/// `tools/gpu_step_matrix.sh --emulated`: one row per variant, each run's metrics and trace, and
/// a failing variant (an unknown flag) fails the script with its row still written.
#[test]
fn step_matrix_reports_each_variant() {
    if std::env::var("MEGATRAIN_GPU").is_ok_and(|v| v == "1") {
        eprintln!("SKIP: the emulated shapes; on a GPU run the script itself");
        return;
    }
    let out_dir = tempfile::tempdir().unwrap();
    let run = |variants: &[&str]| {
        std::process::Command::new(
            std::path::Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/gpu_step_matrix.sh"),
        )
        .arg("--emulated")
        .arg(out_dir.path())
        .args(variants)
        .env("MEGATRAIN_BIN", env!("CARGO_BIN_EXE_megatrain"))
        .env("MEGATRAIN_MATRIX_STEPS", "2")
        .env_remove("CUEMU_SCHEDULES")
        .output()
        .unwrap()
    };
    let out = run(&["b1a2:1:2", "b2a1-lean:2:1:--mode,lean"]);
    let matrix = std::fs::read_to_string(out_dir.path().join("matrix.md")).unwrap_or_default();
    assert!(
        out.status.success(),
        "{matrix}\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(matrix.contains("(emulated: host times"), "{matrix}");
    for name in ["b1a2", "b2a1-lean"] {
        let row = matrix
            .lines()
            .find(|l| l.starts_with(&format!("| {name} |")))
            .unwrap_or_else(|| panic!("no row for {name}:\n{matrix}"));
        let cols: Vec<&str> = row.split('|').map(str::trim).collect();
        assert!(row.ends_with("| 0 |"), "{row}");
        // tokens/s, wall, compute, copy time, bytes each way: figures from the run's metrics.
        for c in &cols[2..8] {
            assert!(c.parse::<f64>().is_ok(), "{c:?} in {row}");
        }
        assert!(out_dir.path().join(format!("trace-{name}.json")).is_file());
    }
    let bad = run(&["bad:1:1:--no-such-flag"]);
    let matrix = std::fs::read_to_string(out_dir.path().join("matrix.md")).unwrap();
    assert!(
        !bad.status.success() && matrix.contains("| bad |"),
        "{matrix}"
    );
}
