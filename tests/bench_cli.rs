//! The CLI's bench commands run and report what they claim (small sizes; speed is not asserted).
#![allow(clippy::unwrap_used)]

use std::process::Command;

fn json(args: &[&str]) -> serde_json::Value {
    let out = Command::new(env!("CARGO_BIN_EXE_megatrain"))
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

#[test]
fn bench_nvme_sweeps_blocks_and_depths() {
    let d = tempfile::tempdir().unwrap();
    let v = json(&[
        "bench",
        "nvme",
        "--dir",
        d.path().to_str().unwrap(),
        "--size",
        "8M",
        "--reps",
        "1",
        "--json",
    ]);
    let cases = v["cases"].as_array().unwrap();
    assert_eq!(cases.len(), 15);
    assert!(
        cases
            .iter()
            .all(|c| c["write_gbps"].as_f64().unwrap() > 0.0
                && c["read_gbps"].as_f64().unwrap() > 0.0)
    );
    assert_eq!(
        std::fs::read_dir(d.path()).unwrap().count(),
        0,
        "the bench removes its files"
    );
}

#[test]
fn bench_adam_reports_both_kernels() {
    let v = json(&["bench", "adam", "--params", "2M", "--reps", "2", "--json"]);
    assert!(v["adam"]["gbytes_per_s"].as_f64().unwrap() > 0.0);
    assert!(v["triad"]["gbytes_per_s"].as_f64().unwrap() > 0.0);
    assert!(v["ratio"].as_f64().unwrap() > 0.0);
}

#[test]
fn bench_link_measures_every_numa_pair_and_waives_gpu_cases() {
    let v = json(&["bench", "link", "--size", "16M", "--reps", "2", "--json"]);
    let nodes = v["nodes"].as_array().unwrap().len();
    let m = v["memcpy_gbps"].as_array().unwrap();
    assert_eq!(m.len(), nodes);
    assert!(m.iter().all(|row| row
        .as_array()
        .unwrap()
        .iter()
        .all(|x| x.as_f64().unwrap() > 0.0)));
    let waived = v["waived"].as_array().unwrap();
    assert!(!waived.is_empty(), "host↔device cases must be reported");
}

/// Without a GPU, `megatrain selftest --device cuda` exits non-zero with one line saying why (no
/// CUDA in this build, or no driver on this machine).
#[test]
#[allow(clippy::print_stderr)]
fn selftest_without_a_gpu_says_why() {
    if std::path::Path::new("/dev/nvidia0").exists() {
        eprintln!("SKIP: this machine has a GPU; run `megatrain selftest --device cuda` itself");
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_megatrain"))
        .args(["selftest", "--device", "cuda"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(
        err.starts_with("error: ")
            && (err.contains("without CUDA support") || err.contains("no NVIDIA driver")),
        "{err}"
    );
}
