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

/// `megatrain plan` for Llama-3-8B on the H100 preset.
const LLAMA_ON_H100: [&str; 5] = ["plan", "--model", "llama-3-8b", "--machine", "h100-512gb"];

/// `megatrain plan` for Llama-3-8B on the H100 preset with `calibration`, which must be refused
/// as bad input: its stderr.
fn plan_refuses(calibration: &std::path::Path) -> String {
    let out = Command::new(env!("CARGO_BIN_EXE_megatrain"))
        .args(LLAMA_ON_H100)
        .arg("--calibration")
        .arg(calibration)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    String::from_utf8_lossy(&out.stderr).into_owned()
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
fn bench_io_times_every_phase_next_to_dd() {
    let d = tempfile::tempdir().unwrap();
    let v = json(&[
        "bench",
        "io",
        "--dir",
        d.path().to_str().unwrap(),
        "--params",
        "20M",
        "--adam-state",
        "bf16",
        "--reps",
        "2",
        "--json",
    ]);
    assert_eq!(v["reps"], 2);
    let phases: Vec<&str> = v["phases"]
        .as_array()
        .unwrap()
        .iter()
        .map(|p| p["phase"].as_str().unwrap())
        .collect();
    assert_eq!(
        phases,
        [
            "checkpoint write",
            "resume read",
            "export (bf16)",
            "--init-from read"
        ]
    );
    let params = v["params"].as_f64().unwrap();
    assert!((20e6..30e6).contains(&params), "{params}");
    let phase = |i: usize| &v["phases"][i];
    // The checkpoint holds the fp32 master and bf16 moments (8 bytes per parameter), the
    // export bf16 weights (2): the bytes are the files'.
    let ck = phase(0)["bytes"].as_f64().unwrap();
    assert!(
        ck >= 8.0 * params && ck < 8.0 * params + (1 << 20) as f64,
        "{ck}"
    );
    assert_eq!(phase(1)["bytes"], phase(0)["bytes"]);
    let hf = phase(2)["bytes"].as_f64().unwrap();
    assert!(
        hf >= 2.0 * params && hf < 2.0 * params + (1 << 20) as f64,
        "{hf}"
    );
    for i in 0..4 {
        let (gbps, limit, ratio) = (
            phase(i)["gbps"].as_f64().unwrap(),
            phase(i)["limit_gbps"].as_f64().unwrap(),
            phase(i)["ratio"].as_f64().unwrap(),
        );
        assert!(gbps > 0.0 && limit > 0.0, "{}", phase(i));
        assert!((ratio - gbps / limit).abs() < 1e-9 * ratio);
    }
    assert!(v["dd_mode"].as_str().unwrap().starts_with("dd bs=8M"));
    assert_eq!(
        std::fs::read_dir(d.path()).unwrap().count(),
        0,
        "the bench removes its files"
    );
}

#[test]
fn bench_adam_reports_every_state_format_beside_the_triad() {
    let v = json(&["bench", "adam", "--params", "2M", "--reps", "2", "--json"]);
    assert!(v["triad"]["gbytes_per_s"].as_f64().unwrap() > 0.0);
    let cases = v["adam"].as_array().unwrap();
    let formats: Vec<(&str, &str)> = cases
        .iter()
        .map(|c| (c["state"].as_str().unwrap(), c["master"].as_str().unwrap()))
        .collect();
    // Every moment format with each master format: fp32, then bf16 planes (same bytes).
    assert_eq!(
        formats,
        [
            ("fp32", "fp32"),
            ("bf16", "fp32"),
            ("int8", "fp32"),
            ("fp32", "planes"),
            ("bf16", "planes"),
            ("int8", "planes")
        ]
    );
    for (a, b) in cases[..3].iter().zip(&cases[3..]) {
        assert_eq!(a["bytes_per_param"], b["bytes_per_param"]);
    }
    for c in cases {
        assert!(c["measured"]["gbytes_per_s"].as_f64().unwrap() > 0.0, "{c}");
        assert!(c["params_per_s"].as_f64().unwrap() > 0.0, "{c}");
        assert!(c["ratio"].as_f64().unwrap() > 0.0, "{c}");
    }
    // The bytes each format moves per parameter: 28 (fp32), 20 (bf16), 16 + scales (int8).
    let bytes: Vec<f64> = cases
        .iter()
        .map(|c| c["bytes_per_param"].as_f64().unwrap())
        .collect();
    assert_eq!(bytes[0], 28.0);
    assert_eq!(bytes[1], 20.0);
    assert!(bytes[2] > 16.0 && bytes[2] < 16.01, "{bytes:?}");
    // One format on request.
    let v = json(&[
        "bench",
        "adam",
        "--params",
        "1M",
        "--reps",
        "1",
        "--adam-state",
        "int8",
        "--master",
        "planes",
        "--json",
    ]);
    assert_eq!(v["adam"].as_array().unwrap().len(), 1);
    assert_eq!(v["adam"][0]["master"], "planes");
    assert_eq!(v["adam"][0]["state"], "int8");
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

/// `plan --calibration` takes the bench commands' own JSON: the AdamW and NVMe rates measured
/// here replace the preset's, and a host-only link report (no GPU cases) is refused by name.
#[test]
fn plan_calibrates_from_bench_json() {
    let d = tempfile::tempdir().unwrap();
    let adam = json(&["bench", "adam", "--params", "1M", "--reps", "1", "--json"]);
    let nvme = json(&[
        "bench",
        "nvme",
        "--dir",
        d.path().to_str().unwrap(),
        "--size",
        "4M",
        "--reps",
        "1",
        "--block",
        "1Mi",
        "--qd",
        "4",
        "--json",
    ]);
    let (pa, pn) = (d.path().join("adam.json"), d.path().join("nvme.json"));
    std::fs::write(&pa, adam.to_string()).unwrap();
    std::fs::write(&pn, nvme.to_string()).unwrap();
    let v = json(&[
        "plan",
        "--model",
        "llama-3-8b",
        "--machine",
        "h100-512gb",
        "--calibration",
        pa.to_str().unwrap(),
        "--calibration",
        pn.to_str().unwrap(),
        "--precision",
        "fp32",
        "--json",
    ]);
    // `bench adam` measures fp32, bf16 and int8 moments over an fp32 master, then over planes.
    let case = |state: &str, master: &str| {
        adam["adam"]
            .as_array()
            .unwrap()
            .iter()
            .find(|c| c["state"] == state && c["master"] == master)
            .unwrap()["measured"]["gbytes_per_s"]
            .clone()
    };
    assert_eq!(
        v["machine"]["adam_gbps"],
        case("fp32", "fp32"),
        "the fp32 case calibrates an fp32 plan"
    );
    let plan_with = |extra: &[&str]| {
        let mut args = vec![
            "plan",
            "--model",
            "llama-3-8b",
            "--machine",
            "h100-512gb",
            "--calibration",
            pa.to_str().unwrap(),
            "--json",
        ];
        args.extend_from_slice(extra);
        json(&args)
    };
    assert_eq!(
        plan_with(&["--adam-state", "int8", "--precision", "fp32"])["machine"]["adam_gbps"],
        case("int8", "fp32"),
        "the int8 case calibrates an int8 plan"
    );
    assert_eq!(
        plan_with(&[])["machine"]["adam_gbps"],
        case("fp32", "planes"),
        "a bf16 plan (the default) is calibrated by AdamW over the planes master it updates"
    );
    let c = &nvme["cases"][0];
    let want = c["read_gbps"]
        .as_f64()
        .unwrap()
        .min(c["write_gbps"].as_f64().unwrap());
    assert_eq!(v["machine"]["nvme_gbps"].as_f64().unwrap(), want);
    assert_eq!(v["request"]["spill_moments"], true);

    let link = d.path().join("link.json");
    let host_only = json(&["bench", "link", "--size", "1M", "--reps", "1", "--json"]);
    std::fs::write(&link, host_only.to_string()).unwrap();
    let err = plan_refuses(&link);
    assert!(
        err.contains("host-only link report") && err.contains("link.json"),
        "{err}"
    );
    // Something that is not a benchmark report is refused by name too.
    let other = d.path().join("other.json");
    std::fs::write(&other, "{\"cases\": []}").unwrap();
    let err = plan_refuses(&other);
    assert!(
        err.contains("not a `megatrain bench") && err.contains("other.json"),
        "{err}"
    );
}

/// `plan --calibration` takes a GPU's `bench kernels --json` (what `tools/gpu_check.sh` records):
/// the measured GEMM and attention shares of the peak replace the sourced assumptions, and the
/// predicted compute follows them; an emulated report (host times) is refused.
#[test]
fn plan_calibrates_kernels_from_a_gpu_report() {
    let d = tempfile::tempdir().unwrap();
    // A report as `bench kernels --json` writes it (the figures are a test's inputs, not a GPU
    // measurement): the best bf16 GEMM at half the peak, attention forward at 20%.
    let t = "T 8192, 32 heads (8 kv), hd 128";
    let f = 2.0 * 2.0 * (8192.0 * 8192.0 / 2.0 * 32.0 * 128.0);
    let row = |kernel: &str, shape: &str, flops: f64, tflops: f64, peak: f64| {
        serde_json::json!({"kernel": kernel, "shape": shape, "flops": flops,
            "ms": flops / (tflops * 1e12) * 1e3, "tflops": tflops, "peak_tflops": peak})
    };
    let report = |emulated: bool| {
        serde_json::json!({"bench": "kernels", "device": "NVIDIA H100 80GB HBM3", "emulated": emulated,
        "rows": [
            row("gemm fp32", "down", 1e12, 40.2, 67.0),
            row("gemm bf16 (fp32 accumulate)", "qkv", 1e12, 400.0, 989.0),
            row("gemm bf16 (fp32 accumulate)", "down", 1e12, 494.5, 989.0),
            row("attention fwd (fp32 SIMT)", t, f, 13.4, 67.0),
            row("attention fwd (tensor cores)", t, f, 197.8, 989.0),
            row("attention fwd+bwd (tensor cores)", t, 3.5 * f, 3.5 * f / (f / 197.8 + 2.5 * f / 98.9), 989.0),
        ]})
    };
    let p = d.path().join("kernels.json");
    std::fs::write(&p, report(false).to_string()).unwrap();
    let plan = |extra: &[&str]| {
        let mut args = vec![
            "plan",
            "--model",
            "llama-3-8b",
            "--machine",
            "h100-512gb",
            "--json",
        ];
        args.extend_from_slice(extra);
        json(&args)
    };
    let base = plan(&[]);
    let cal = plan(&["--calibration", p.to_str().unwrap()]);
    let e = &cal["kernel_efficiency"];
    let near = |v: &serde_json::Value, want: f64| (v.as_f64().unwrap() - want).abs() < 1e-6;
    assert!(near(&e["gemm"], 0.5), "{e}");
    assert!(near(&e["attention_fwd"], 0.2), "{e}");
    assert!(near(&e["attention_bwd"], 0.1), "{e}");
    assert!(e["source"]
        .as_str()
        .unwrap()
        .contains("measured by `megatrain bench kernels`"));
    assert!(
        cal["assumptions"]
            .to_string()
            .contains("kernels calibrated"),
        "{cal}"
    );
    // A recorded GPU run's bench.json (tools/gpu_check.sh): an array of reports, read the same.
    let array = d.path().join("bench.json");
    std::fs::write(&array, serde_json::json!([report(false)]).to_string()).unwrap();
    let from_array = plan(&["--calibration", array.to_str().unwrap()]);
    assert_eq!(from_array["kernel_efficiency"], cal["kernel_efficiency"]);
    // A run whose every bench failed leaves an empty array: refused, not silently uncalibrated.
    std::fs::write(&array, "[]").unwrap();
    assert!(plan_refuses(&array).contains("an empty array"));
    // Slower kernels than the assumptions (MAMF's 80% GEMMs): more compute time.
    let compute = |v: &serde_json::Value| v["plan"]["time"]["compute_s"].as_f64().unwrap();
    assert!(
        compute(&cal) > compute(&base) * 1.2,
        "{} vs {}",
        compute(&cal),
        compute(&base)
    );
    // An emulated report is host time: refused by name.
    std::fs::write(&p, report(true).to_string()).unwrap();
    let err = plan_refuses(&p);
    assert!(
        err.contains("an emulated report") && err.contains("kernels.json"),
        "{err}"
    );
}

/// `bench kernels` without a GPU (or a CUDA build) fails cleanly and says why.
#[test]
#[allow(clippy::print_stderr)]
fn bench_kernels_without_a_gpu_says_why() {
    if std::path::Path::new("/dev/nvidia0").exists() {
        eprintln!("SKIP: this machine has a GPU; run `megatrain bench kernels` itself");
        return;
    }
    let out = Command::new(env!("CARGO_BIN_EXE_megatrain"))
        .args(["bench", "kernels", "--reps", "1"])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success());
    assert!(!err.contains("panicked"), "{err}");
    assert!(
        err.starts_with("error: ")
            && (err.contains("without CUDA support") || err.contains("no NVIDIA driver")),
        "{err}"
    );
}

/// `megatrain plan` for Llama-3-8B on the H100 preset at --seq-len 4096, then `extra`.
fn plan_with<'a>(extra: &[&'a str]) -> Vec<&'a str> {
    let mut args = LLAMA_ON_H100.to_vec();
    args.extend_from_slice(&["--seq-len", "4096"]);
    args.extend_from_slice(extra);
    args
}

/// Every benchmark argument is checked before anything is allocated or run: zero, negative,
/// and sizes beyond the machine are clear errors (exit 2) naming the flag, never a panic, an
/// abort or "median of 0 runs".
#[test]
fn bench_arguments_are_checked_before_anything_runs() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().to_str().unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["bench", "nvme", "--dir", dir, "--qd", "0"], "--qd 0"),
        (vec!["bench", "nvme", "--dir", dir, "--size", "0"], "--size"),
        (
            vec!["bench", "nvme", "--dir", dir, "--reps", "0"],
            "--reps 0",
        ),
        (
            vec!["bench", "nvme", "--dir", dir, "--block", "1000"],
            "--block",
        ),
        (
            vec!["bench", "nvme", "--dir", dir, "--qd", "100000"],
            "--qd 100000",
        ),
        (vec!["bench", "attention", "--seq", "100000000"], "--seq"),
        (
            vec![
                "bench",
                "attention",
                "--seq",
                "4096",
                "--head-dim",
                "1000000",
                "--heads",
                "1000000",
                "--kv-heads",
                "1000000",
            ],
            "attention",
        ),
        (vec!["bench", "attention", "--reps", "0"], "--reps 0"),
        (vec!["bench", "attention", "--seq", "0"], "--seq 0"),
        (vec!["bench", "link", "--reps", "0"], "--reps 0"),
        (vec!["bench", "link", "--size", "0"], "--size 0"),
        (vec!["bench", "link", "--size", "1E"], "--size"),
        (vec!["bench", "adam", "--reps", "0"], "--reps 0"),
        (vec!["bench", "adam", "--params", "1E"], "--params"),
        (vec!["bench", "engine", "--steps", "0"], "--steps 0"),
        (
            plan_with(&["--tokens-per-step", "4099"]),
            "--tokens-per-step",
        ),
        (
            plan_with(&["--micro-batch-tokens", "3"]),
            "--micro-batch-tokens",
        ),
    ];
    for (args, needle) in cases {
        let out = Command::new(env!("CARGO_BIN_EXE_megatrain"))
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(2), "{args:?}: {err}");
        assert!(
            err.starts_with("error: ") && err.contains(needle),
            "{args:?}: {err}"
        );
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        assert!(
            !String::from_utf8_lossy(&out.stdout).contains("median"),
            "{args:?}"
        );
    }
}

/// `plan --gpus G --nodes M`: Llama-3.1-405B on 4 machines of 8 H200s, as the README shows it.
/// Replicated, each rank holds the whole host state, so the plan states it per rank and per
/// machine, says it does not fit and offers the sharded job, which fits; its time has the ranks'
/// gradient sum (and, sharded, the params between ranks). Refusals name their flag.
#[test]
fn plan_spreads_over_gpus_and_machines() {
    let v = json(&[
        "plan",
        "--model",
        "llama-3.1-405b",
        "--machine",
        "h200-1.5tb",
        "--gpus",
        "8",
        "--nodes",
        "4",
        "--json",
    ]);
    let d = &v["plan"]["data_parallel"];
    assert_eq!(d["ranks"], 32);
    // One sequence per rank by default.
    assert_eq!(v["request"]["tokens_per_step"], 32 * 4096);
    assert_eq!(d["tokens_per_rank"], 4096);
    let per_rank = d["host_bytes_per_rank"].as_u64().unwrap();
    assert!(per_rank as f64 >= 16.0 * 405e9, "{d}");
    assert_eq!(d["host_bytes_per_node"].as_u64().unwrap(), 8 * per_rank);
    assert_eq!(v["plan"]["fits"], false);
    assert!(v["plan"]["time"]["sum_s"].as_f64().unwrap() > 0.0);
    assert_eq!(v["plan"]["suggestion"], "--zero-stage 3 --adam-state int8");
    // Sharded as suggested, it fits: each rank holds its share, the machine 8 of them.
    let v = json(&[
        "plan",
        "--model",
        "llama-3.1-405b",
        "--machine",
        "h200-1.5tb",
        "--gpus",
        "8",
        "--nodes",
        "4",
        "--zero-stage",
        "3",
        "--mode",
        "lean",
        "--adam-state",
        "bf16",
        "--json",
    ]);
    let d = &v["plan"]["data_parallel"];
    assert_eq!(v["plan"]["fits"], true, "{v}");
    assert_eq!(d["zero_stage"], 3);
    let per_rank = d["host_bytes_per_rank"].as_u64().unwrap();
    assert!((per_rank as f64) < 1.5 * 8.0 * 405e9 / 32.0, "{d}");
    assert_eq!(d["host_bytes_per_node"].as_u64().unwrap(), 8 * per_rank);
    assert!(v["plan"]["time"]["params_s"].as_f64().unwrap() > 0.0);
    let out = Command::new(env!("CARGO_BIN_EXE_megatrain"))
        .args(["plan", "--model", "llama-3.1-8b", "--machine", "h200-1.5tb"])
        .args(["--gpus", "2", "--zero-stage", "2"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("0 (replicated), 1"));
    // Text: the machine's share said.
    let out = Command::new(env!("CARGO_BIN_EXE_megatrain"))
        .args(["plan", "--model", "llama-3.1-8b", "--machine", "h200-1.5tb"])
        .args(["--gpus", "8", "--tokens-per-step", "262144"])
        .output()
        .unwrap();
    assert!(out.status.success());
    let text = String::from_utf8_lossy(&out.stdout);
    for want in [
        "32768 per rank on each of 8 ranks",
        "host per machine",
        "grad sum",
        "tokens/s (the job's)",
        "fits: yes",
    ] {
        assert!(text.contains(want), "{want}: {text}");
    }
    let refused = |args: &[&str], want: &str| {
        let out = Command::new(env!("CARGO_BIN_EXE_megatrain"))
            .args(["plan", "--model", "llama-3.1-8b"])
            .args(args)
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(want), "{args:?}: {err}");
    };
    refused(&["--machine", "h200-1.5tb", "--gpus", "9"], "--gpus 9");
    refused(
        &["--machine", "rtx4090-256gb", "--nodes", "2"],
        "--nic-gbps",
    );
    refused(
        &[
            "--machine",
            "h200-1.5tb",
            "--gpus",
            "3",
            "--tokens-per-step",
            "16384",
        ],
        "for each of the 3 ranks",
    );
    refused(
        &[
            "--machine",
            "h200-1.5tb",
            "--gpus",
            "8",
            "--nodes",
            "4611686018427387904",
        ],
        "--nodes",
    );
    // Unset, the step is whole sequences for each rank.
    let v = json(&[
        "plan",
        "--model",
        "llama-3.1-8b",
        "--machine",
        "h200-1.5tb",
        "--gpus",
        "3",
        "--json",
    ]);
    assert_eq!(v["request"]["tokens_per_step"], 73728);
    // A collective report of one rank sums nothing: refused, not a rate of 0.
    let dir = tempfile::tempdir().unwrap();
    let solo = dir.path().join("solo.json");
    std::fs::write(
        &solo,
        r#"{"bench":"collective","ranks":1,"hosts":1,"library":"none","ours_path":"one process",
            "rows":[{"bytes":16000000,"ours_s":0.001,"ours_busbw_gbs":0.0,"library_s":0.001,"library_busbw_gbs":0.0}]}"#,
    )
    .unwrap();
    assert!(plan_refuses(&solo).contains("a report of one rank"));
    // A network given makes several machines plannable.
    let v = json(&[
        "plan",
        "--model",
        "llama-3.1-8b",
        "--machine",
        "rtx4090-256gb",
        "--nodes",
        "2",
        "--nic-gbps",
        "12.5",
        "--json",
    ]);
    assert_eq!(v["plan"]["data_parallel"]["nic_gbps"], 12.5);
}
