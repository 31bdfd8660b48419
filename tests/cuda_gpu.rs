//! The CUDA path end to end, as a GPU would run it: `megatrain selftest --device cuda` (every
//! kernel and GEMM against the CPU reference, training steps against the CPU device, the link)
//! — on the CUDA emulator (tools/cuemu.sh), or on a real GPU with `MEGATRAIN_GPU=1`.
#![cfg(feature = "cuda")]
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

#[test]
fn selftest_passes() {
    let out = common::megatrain_cuda()
        .args(["selftest", "--device", "cuda"])
        .output()
        .unwrap();
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
