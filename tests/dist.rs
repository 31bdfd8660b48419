//! Data parallelism through the real CLI under `mpirun` (Open MPI or MPICH from the distribution):
//! N ranks of one micro-batch equal one process accumulating N, bit for bit run to run; a
//! checkpoint of 3 ranks resumes on 2 and on 1; a rank that dies ends the job with its
//! checkpoints intact, and `--resume auto` carries on. Needs the `mpi` feature.
#![cfg(feature = "mpi")]
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

const MODEL: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":32,"intermediate_size":72,
  "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":61,"tie_word_embeddings":true}"#;

fn bin() -> &'static str {
    env!("CARGO_BIN_EXE_megatrain")
}

/// A model and token file in `dir`.
fn inputs(dir: &Path) -> (PathBuf, PathBuf) {
    let model = dir.join("model.json");
    std::fs::write(&model, MODEL).unwrap();
    let data = dir.join("train.bin");
    let mut s = 12345u64;
    // A learnable pattern (steps of 3), one token in 8 random.
    let bytes: Vec<u8> = (0..20_000u64)
        .flat_map(|i| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            let t = if i % 8 == 7 { s % 61 } else { (3 * i) % 61 };
            (t as u16).to_le_bytes()
        })
        .collect();
    std::fs::write(&data, bytes).unwrap();
    (model, data)
}

/// `megatrain train` flags of a run writing into `out` (checkpoints every 2 steps, metrics).
/// Clipping at 0.5 is active in these steps, so the norm (of the summed gradients) matters.
fn train_args(dir: &Path, out: &Path, steps: u64, grad_accum: usize) -> Vec<String> {
    let (model, data) = (dir.join("model.json"), dir.join("train.bin"));
    [
        "train",
        "--model",
        model.to_str().unwrap(),
        "--data",
        data.to_str().unwrap(),
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--grad-accum",
        &grad_accum.to_string(),
        "--steps",
        &steps.to_string(),
        "--lr",
        "3e-3",
        "--lr-schedule",
        "cosine",
        "--warmup-steps",
        "2",
        "--grad-clip",
        "0.5",
        "--shuffle",
        "--seed",
        "7",
        "--mode",
        "exact",
        "--device-memory",
        "256MiB",
        "--checkpoint-every",
        "2",
        "--checkpoint-dir",
        out.join("ckpt").to_str().unwrap(),
        "--metrics",
        out.join("metrics.jsonl").to_str().unwrap(),
    ]
    .iter()
    .map(|s| s.to_string())
    .collect()
}

/// `mpirun -np N` (as root it needs leave; oversubscribed on a small machine).
fn mpirun(n: usize) -> Command {
    let mut c = Command::new("mpirun");
    c.args([
        "--allow-run-as-root",
        "--oversubscribe",
        "-np",
        &n.to_string(),
    ]);
    // Each rank on one thread: the machine's cores are shared by the ranks.
    c.env("RAYON_NUM_THREADS", "1");
    c
}

fn check(out: Output, what: &str) -> Output {
    assert!(
        out.status.success(),
        "{what}: {:?}\nstdout:\n{}\nstderr:\n{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn run_ranks(n: usize, args: &[String]) -> Output {
    let out = mpirun(n).arg(bin()).args(args).output().unwrap();
    check(out, &format!("mpirun -np {n}"))
}

fn run_one(args: &[String]) -> Output {
    let out = Command::new(bin())
        .env("RAYON_NUM_THREADS", "1")
        .args(args)
        .output()
        .unwrap();
    check(out, "one process")
}

/// (step, loss, grad norm) per metrics line.
fn metrics(out: &Path) -> Vec<(u64, f64, f64)> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (
                v["step"].as_u64().unwrap(),
                v["loss"].as_f64().unwrap(),
                v["grad_norm"].as_f64().unwrap(),
            )
        })
        .collect()
}

/// The newest checkpoint under `out/ckpt`.
fn newest(out: &Path) -> PathBuf {
    megatrain::train::checkpoint::latest(&out.join("ckpt"))
        .unwrap()
        .unwrap()
}

fn floats(p: &Path) -> Vec<f32> {
    std::fs::read(p)
        .unwrap()
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes([b[0], b[1], b[2], b[3]]))
        .collect()
}

fn close(a: f64, b: f64, tol: f64) -> bool {
    (a - b).abs() <= tol * a.abs().max(b.abs()).max(1e-30)
}

/// Losses, norms and final weights of two runs agree to 1e-6 relative; returns whether they
/// are the same bits.
fn assert_equal_runs(a: &Path, b: &Path, what: &str) -> bool {
    let (ma, mb) = (metrics(a), metrics(b));
    assert_eq!(ma.len(), mb.len(), "{what}: steps");
    for (x, y) in ma.iter().zip(&mb) {
        assert_eq!(x.0, y.0);
        assert!(
            close(x.1, y.1, 1e-6),
            "{what}: loss at step {}: {} vs {}",
            x.0,
            x.1,
            y.1
        );
        assert!(
            close(x.2, y.2, 1e-6),
            "{what}: norm at step {}: {} vs {}",
            x.0,
            x.2,
            y.2
        );
    }
    let (ca, cb) = (newest(a), newest(b));
    let mut same = true;
    for f in ["params.f32", "adam_m.f32", "adam_v.f32"] {
        let (pa, pb) = (floats(&ca.join(f)), floats(&cb.join(f)));
        assert_eq!(pa.len(), pb.len());
        let scale = pa.iter().fold(0f32, |m, x| m.max(x.abs())) as f64;
        for (i, (x, y)) in pa.iter().zip(&pb).enumerate() {
            assert!(
                ((*x as f64) - (*y as f64)).abs() <= 1e-6 * scale.max(1e-30),
                "{what}: {f}[{i}] {x} vs {y}"
            );
        }
        same &= pa
            .iter()
            .map(|x| x.to_bits())
            .eq(pb.iter().map(|x| x.to_bits()));
    }
    same
}

#[test]
fn ranks_equal_gradient_accumulation_and_repeat_bit_for_bit() {
    let d = tempfile::tempdir().unwrap();
    inputs(d.path());
    for n in [2usize, 3] {
        let (ranks, one) = (
            d.path().join(format!("ranks{n}")),
            d.path().join(format!("accum{n}")),
        );
        let out = run_ranks(n, &train_args(d.path(), &ranks, 6, 1));
        let said = String::from_utf8_lossy(&out.stderr);
        assert!(
            said.contains(&format!("data parallel: {n} ranks")),
            "{said}"
        );
        run_one(&train_args(d.path(), &one, 6, n));
        // The same sums in the same order: the same bits.
        assert!(
            assert_equal_runs(&ranks, &one, &format!("{n} ranks vs accumulation {n}")),
            "{n} ranks are within 1e-6 of accumulating {n} but not the same bits"
        );
        let m = metrics(&ranks);
        assert!(m.last().unwrap().1 < m[0].1, "the loss falls: {m:?}");
    }
    // The exchange through MPI's messages (what a job across hosts takes) sums the same bits
    // as the shared window these ranks on one host take.
    let messages = d.path().join("ranks3-messages");
    let out = mpirun(3)
        .env("MEGATRAIN_SHARED_SUM", "0")
        .arg(bin())
        .args(train_args(d.path(), &messages, 6, 1))
        .output()
        .unwrap();
    check(out, "mpirun -np 3, MEGATRAIN_SHARED_SUM=0");
    assert!(
        assert_equal_runs(
            &messages,
            &d.path().join("ranks3"),
            "3 ranks: MPI's messages vs the shared window"
        ),
        "the two sums are within 1e-6 but not the same bits"
    );
    // Run to run: the same bits.
    let again = d.path().join("ranks2-again");
    run_ranks(2, &train_args(d.path(), &again, 6, 1));
    assert!(assert_equal_runs(
        &again,
        &d.path().join("ranks2"),
        "two runs of 2 ranks"
    ));
}

#[test]
fn a_checkpoint_of_three_ranks_resumes_on_two_and_on_one() {
    let d = tempfile::tempdir().unwrap();
    inputs(d.path());
    // A constant rate: the runs stopping at step 4 and going to 8 share their first steps.
    let train_args = |dir: &Path, out: &Path, steps: u64, accum: usize| -> Vec<String> {
        train_args(dir, out, steps, accum)
            .into_iter()
            .map(|a| if a == "cosine" { "constant".into() } else { a })
            .collect()
    };
    let three = d.path().join("three");
    run_ranks(3, &train_args(d.path(), &three, 4, 1));
    let copy = |to: &str| {
        let to = d.path().join(to);
        std::fs::create_dir_all(to.join("ckpt")).unwrap();
        let c = newest(&three);
        let dst = to.join("ckpt").join(c.file_name().unwrap());
        std::fs::create_dir_all(&dst).unwrap();
        for e in std::fs::read_dir(&c).unwrap() {
            let e = e.unwrap();
            std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
        }
        std::fs::copy(three.join("metrics.jsonl"), to.join("metrics.jsonl")).unwrap();
        to
    };
    let resume = |args: Vec<String>| -> Vec<String> {
        args.into_iter().chain(["--resume".to_string()]).collect()
    };
    // On one process accumulating 3: the same as 3 ranks all along.
    let on_one = copy("on-one");
    run_one(&resume(train_args(d.path(), &on_one, 8, 3)));
    let straight = d.path().join("straight");
    run_ranks(3, &train_args(d.path(), &straight, 8, 1));
    assert_equal_runs(&on_one, &straight, "resumed on 1 vs 3 ranks straight");
    // On two ranks (a batch of 2 from here): as one process accumulating 2 from the checkpoint.
    let on_two = copy("on-two");
    run_ranks(2, &resume(train_args(d.path(), &on_two, 8, 1)));
    let two_ref = copy("two-ref");
    run_one(&resume(train_args(d.path(), &two_ref, 8, 2)));
    assert_equal_runs(&on_two, &two_ref, "resumed on 2 ranks vs accumulation 2");
    assert_eq!(metrics(&on_two).last().unwrap().0, 8);
}

#[test]
fn ranks_that_disagree_are_refused_naming_the_rank() {
    let d = tempfile::tempdir().unwrap();
    inputs(d.path());
    let (a, b) = (d.path().join("a"), d.path().join("b"));
    let mut c = Command::new("mpirun");
    c.args(["--allow-run-as-root", "--oversubscribe", "-np", "1", bin()])
        .args(train_args(d.path(), &a, 4, 1))
        .args([":", "-np", "1", bin()])
        .args(train_args(d.path(), &b, 4, 2));
    let out = c.output().unwrap();
    assert!(!out.status.success());
    let said = String::from_utf8_lossy(&out.stderr);
    assert!(
        said.contains("rank 1") && said.contains("micro-batch"),
        "{said}"
    );
}

/// A 2-rank job of `steps` steps writing into `out`, rank 1 started through a shell that records
/// its pid; once 5 steps are logged, rank 1 gets `signal`. Returns the job's exit status, its
/// stderr, and the seconds from the signal to the job's end.
fn signal_rank_one(
    d: &Path,
    out: &Path,
    extra: &[&str],
    signal: i32,
    ranks: usize,
) -> (std::process::ExitStatus, String, f64) {
    let pid_file = d.join("rank1.pid");
    let _ = std::fs::remove_file(&pid_file);
    let args: Vec<String> = train_args(d, out, 400, 1)
        .into_iter()
        .chain(extra.iter().map(|s| s.to_string()))
        .collect();
    let script = format!(
        "echo $$ > {}; exec {} {}",
        pid_file.display(),
        bin(),
        args.iter()
            .map(|a| format!("'{a}'"))
            .collect::<Vec<_>>()
            .join(" ")
    );
    let mut job = Command::new("mpirun");
    job.args(["--allow-run-as-root", "--oversubscribe", "-np", "1", bin()])
        .args(&args)
        .args([":", "-np", "1", "sh", "-c", &script]);
    if ranks > 2 {
        let more = (ranks - 2).to_string();
        job.args([":", "-np", more.as_str(), bin()]).args(&args);
    }
    let mut job = job
        .env("RAYON_NUM_THREADS", "1")
        .stdout(Stdio::null())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = Instant::now();
    loop {
        let steps = std::fs::read_to_string(out.join("metrics.jsonl"))
            .map(|s| s.lines().count())
            .unwrap_or(0);
        if steps >= 5 {
            break;
        }
        assert!(t0.elapsed() < Duration::from_secs(120), "no progress");
        std::thread::sleep(Duration::from_millis(50));
    }
    let pid: i32 = std::fs::read_to_string(&pid_file)
        .unwrap()
        .trim()
        .parse()
        .unwrap();
    // SAFETY: kill only sends a signal to the rank's process.
    assert_eq!(unsafe { libc::kill(pid, signal) }, 0);
    let t1 = Instant::now();
    let status = loop {
        if let Some(s) = job.try_wait().unwrap() {
            break s;
        }
        if t1.elapsed() > Duration::from_secs(60) {
            let _ = job.kill();
            // SAFETY: as above (a stopped rank left behind is killed).
            unsafe { libc::kill(pid, libc::SIGKILL) };
            panic!("the job outlived its signalled rank by 60 s");
        }
        std::thread::sleep(Duration::from_millis(100));
    };
    let secs = t1.elapsed().as_secs_f64();
    // SAFETY: as above: a stopped rank must not outlive the test.
    unsafe { libc::kill(pid, libc::SIGKILL) };
    let mut err = String::new();
    std::io::Read::read_to_string(&mut job.stderr.take().unwrap(), &mut err).unwrap();
    (status, err, secs)
}

#[test]
fn a_killed_rank_ends_the_job_and_resume_auto_carries_on() {
    let d = tempfile::tempdir().unwrap();
    inputs(d.path());
    let out = d.path().join("run");
    let (status, _, _) = signal_rank_one(d.path(), &out, &[], libc::SIGKILL, 2);
    assert!(!status.success());
    // The checkpoints on disk are whole, and `--resume auto` finishes the job.
    let c = newest(&out);
    megatrain::train::checkpoint::verify(&c).unwrap();
    let resumed: Vec<String> = train_args(d.path(), &out, 40, 1)
        .into_iter()
        .chain(["--resume".into(), "auto".into()])
        .collect();
    run_ranks(2, &resumed);
    assert_eq!(metrics(&out).last().unwrap().0, 40);
}

#[test]
fn a_hung_rank_ends_the_job_within_the_collective_timeout() {
    let d = tempfile::tempdir().unwrap();
    inputs(d.path());
    let out = d.path().join("run");
    // Rank 1 of 3 stopped (SIGSTOP: alive, silent): ranks 0 and 2 wait in their next
    // collective, time out, and ask who still answers: they name rank 1.
    let (status, err, secs) = signal_rank_one(
        d.path(),
        &out,
        &["--collective-timeout", "3"],
        libc::SIGSTOP,
        3,
    );
    assert!(!status.success());
    assert!(
        err.contains(" of 3 (on ") && err.contains("--collective-timeout 3"),
        "{err}"
    );
    assert!(
        err.contains("rank 1 (on ") && err.contains("did not answer"),
        "the hung rank is not named: {err}"
    );
    assert!(
        (2.0..30.0).contains(&secs),
        "the job ended {secs:.1} s after the hang"
    );
    megatrain::train::checkpoint::verify(&newest(&out)).unwrap();
}

#[test]
fn lean_mode_ranks_equal_one_process_with_their_rows() {
    // Lean mode takes one micro-batch a step, so the reference is one process whose micro-batch
    // holds both ranks' rows (the loader draws rows in order: rank 0's 2, then rank 1's 2).
    let d = tempfile::tempdir().unwrap();
    inputs(d.path());
    let lean = |args: Vec<String>, batch: &str| -> Vec<String> {
        let mut out = Vec::new();
        let mut it = args.into_iter();
        while let Some(a) = it.next() {
            match a.as_str() {
                "exact" => out.push("lean".into()),
                "--batch-size" => {
                    it.next();
                    out.extend(["--batch-size".into(), batch.into()]);
                }
                _ => out.push(a),
            }
        }
        out
    };
    let (ranks, one) = (d.path().join("ranks"), d.path().join("one"));
    run_ranks(2, &lean(train_args(d.path(), &ranks, 6, 1), "2"));
    run_one(&lean(train_args(d.path(), &one, 6, 1), "4"));
    // Within a micro-batch the rows' gradients add in another grouping: equal to 1e-6, not
    // necessarily the same bits.
    assert_equal_runs(&ranks, &one, "2 lean ranks vs one process with their rows");
}

#[test]
fn bench_collective_checks_and_times_both_sums() {
    let out = mpirun(3)
        .arg(bin())
        .args([
            "bench",
            "collective",
            "--sizes",
            // Slices of unequal length (not a multiple of 3 elements), several blocks of the
            // shared window's threads, and two chunks (over 16 MiB); the largest not last.
            "4K,17M,4100K",
            "--reps",
            "2",
            "--json",
        ])
        .output()
        .unwrap();
    let out = check(out, "mpirun -np 3 bench collective");
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["ranks"], 3);
    assert_eq!(r["hosts"], 1);
    // Ranks on one host sum through the shared window.
    assert!(
        r["ours_path"]
            .as_str()
            .unwrap()
            .contains("shared-memory window"),
        "{r}"
    );
    let rows = r["rows"].as_array().unwrap();
    assert_eq!(rows.len(), 3);
    for row in rows {
        for k in ["ours_busbw_gbs", "library_busbw_gbs", "reduce_s"] {
            assert!(row[k].as_f64().unwrap() > 0.0, "{k}: {row}");
        }
    }
    // `plan --calibration` takes the report: the largest buffer's bus bandwidth becomes the
    // ranks' gradient sum of the plan.
    assert_eq!(r["bench"], "collective");
    let dir = tempfile::tempdir().unwrap();
    let report = dir.path().join("collective.json");
    std::fs::write(&report, &out.stdout).unwrap();
    let out = Command::new(bin())
        .args(["plan", "--model", "llama-3.1-8b", "--machine", "h200-1.5tb"])
        .args(["--gpus", "3", "--tokens-per-step", "12288", "--json"])
        .arg("--calibration")
        .arg(&report)
        .output()
        .unwrap();
    let out = check(out, "plan --calibration collective.json");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let largest = rows.iter().max_by_key(|r| r["bytes"].as_u64()).unwrap();
    assert_eq!(largest["bytes"], 17_000_000);
    assert_eq!(v["machine"]["host_sum_gbps"], largest["ours_busbw_gbs"]);
    assert_eq!(
        v["plan"]["data_parallel"]["host_sum_gbps"],
        largest["ours_busbw_gbs"]
    );
    // With NCCL's rows (`--device cuda` on GPUs; here written in), the largest broadcast's
    // bus bandwidth becomes the GPUs' broadcasts of a stage-3 plan; emulated rows are not a GPU's.
    let row = |bytes: u64, gbs: f64| {
        serde_json::json!({"bytes": bytes, "reduce_scatter_s": 1.0, "reduce_scatter_busbw_gbs": 1.0,
            "all_gather_s": 1.0, "all_gather_busbw_gbs": 1.0, "all_reduce_s": 1.0, "all_reduce_busbw_gbs": 1.0,
            "broadcast_s": 1.0, "broadcast_busbw_gbs": gbs})
    };
    for (emulated, want) in [
        (false, serde_json::json!(123.5)),
        (true, serde_json::Value::Null),
    ] {
        let mut with_nccl = r.clone();
        with_nccl["nccl"] = serde_json::json!({"library": "NCCL 2.28.9", "gpus": ["H200", "H200", "H200"],
            "emulated": emulated, "rows": [row(1 << 20, 50.0), row(64 << 20, 123.5)]});
        std::fs::write(&report, with_nccl.to_string()).unwrap();
        let out = Command::new(bin())
            .args(["plan", "--model", "llama-3.1-8b", "--machine", "h200-1.5tb"])
            .args([
                "--gpus",
                "3",
                "--zero-stage",
                "3",
                "--json",
                "--calibration",
            ])
            .arg(&report)
            .output()
            .unwrap();
        let out = check(out, "plan --calibration with NCCL rows");
        let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
        let nvlink = &v["machine"]["nvlink_gbps"];
        match emulated {
            false => assert_eq!(nvlink, &want, "{v}"),
            // The preset's assumption stays.
            true => assert_eq!(nvlink, &serde_json::json!(350.0), "{v}"),
        }
        assert_eq!(v["plan"]["data_parallel"]["gpu_gather"], true);
    }
}

/// CUDA ranks: `tools/gpu_dp_check.sh` (`--emulated` here: every rank under the CUDA emulator;
/// on GPUs with `MEGATRAIN_GPU=1`): 2 ranks of one micro-batch equal one process accumulating 2
/// bit for bit, in fp32 and in the bf16 recipe, and repeat their bits; so do 2 ranks with the
/// params sharded, gathered through host memory and (a GPU per rank, or emulated) over NCCL. The
/// emulated ranks share the one GPU, each with its share of the memory.
#[cfg(feature = "cuda")]
#[test]
fn cuda_ranks_equal_gradient_accumulation() {
    let out_dir = tempfile::tempdir().unwrap();
    let real = std::env::var("MEGATRAIN_GPU").is_ok_and(|v| v == "1");
    let mut c = Command::new(Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/gpu_dp_check.sh"));
    if !real {
        c.arg("--emulated");
    }
    let out = c
        .arg(out_dir.path())
        .env("MEGATRAIN_BIN", bin())
        .env("MEGATRAIN_TORCHRUN", torchrun())
        .env_remove("CUEMU_SCHEDULES")
        .output()
        .unwrap();
    let summary = std::fs::read_to_string(out_dir.path().join("summary.md")).unwrap_or_default();
    let log = std::fs::read_to_string(out_dir.path().join("dp.log")).unwrap_or_default();
    assert!(
        out.status.success(),
        "gpu_dp_check failed:\n{summary}\n{}\n{log}",
        String::from_utf8_lossy(&out.stderr)
    );
    for precision in ["fp32", "bf16"] {
        for what in [
            "2 ranks vs 1 process accumulating 2",
            "2 ranks, run twice",
            "2 ranks with sharded params (--zero-stage 3) vs 1 process accumulating 2",
            "2 ranks started by torchrun (its store, NCCL between the GPUs) vs 1 process accumulating 2",
            "2 ranks started by torchrun with sharded params (--zero-stage 3) vs 1 process accumulating 2",
        ] {
            assert!(
                summary.contains(&format!("| {precision}: {what} | PASS | same bits")),
                "{precision}: {what}:\n{summary}"
            );
        }
    }
    if !real {
        // The emulator's NCCL runs the ranks of its one GPU (a real NCCL needs a GPU per
        // rank): the params gathered GPU to GPU, each rank copying only its own units across
        // its link.
        for precision in ["fp32", "bf16"] {
            let what = "2 ranks with params gathered over NCCL (--zero-stage 3 --param-gather nccl) vs 1 process accumulating 2";
            assert!(
                summary.contains(&format!("| {precision}: {what} | PASS | same bits"))
                    && summary.contains("copies"),
                "{precision}: {what}:\n{summary}"
            );
        }
        assert!(
            log.contains("shared by 2 ranks"),
            "the ranks did not find they share the GPU:\n{log}"
        );
        assert!(
            !log.contains("cuemu: error"),
            "the emulator reported defects:\n{log}"
        );
    }
}

/// `bench collective --device cuda` under the CUDA emulator: NCCL's reduce-scatter, all-gather
/// and all-reduce between 3 ranks' (emulated) GPUs, the libnccl.so.2 found on the loader's path,
/// every result checked by the bench, with the host sums beside them.
#[cfg(feature = "cuda")]
#[test]
fn cuda_ranks_measure_nccl_collectives_in_bench_collective() {
    // Not a multiple of 3 elements; over the emulator's 1 MiB chunk.
    let r = emulated_bench_collective(
        mpirun(3),
        "4K,3M",
        "mpirun -np 3 cuemu.sh megatrain bench collective --device cuda",
    );
    let nccl = &r["nccl"];
    assert!(
        nccl["library"].as_str().unwrap().starts_with("NCCL 2.")
            && nccl["library"].as_str().unwrap().contains("libnccl.so.2"),
        "{nccl}"
    );
    assert_eq!(nccl["emulated"], true);
    assert_eq!(nccl["gpus"].as_array().unwrap().len(), 3);
    let rows = nccl["rows"].as_array().unwrap();
    // Whole f32 elements, a multiple of the 3 ranks.
    let bytes: Vec<u64> = rows.iter().map(|r| r["bytes"].as_u64().unwrap()).collect();
    assert_eq!(bytes, [3996, 3_000_000]);
    for row in rows {
        for k in [
            "reduce_scatter_busbw_gbs",
            "all_gather_busbw_gbs",
            "all_reduce_busbw_gbs",
            "broadcast_busbw_gbs",
        ] {
            assert!(row[k].as_f64().unwrap() > 0.0, "{k}: {row}");
        }
    }
}

/// CUDA ranks gathering params over NCCL (under the emulator): a GPU fault on rank 1 in step 3
/// ends the job within seconds, naming the rank (its peer's broadcast fails instead of waiting
/// forever), the step-2 checkpoint stays whole, and `--resume auto` finishes the run.
#[cfg(feature = "cuda")]
#[test]
fn cuda_ranks_with_nccl_end_the_job_when_one_faults_and_resume() {
    let emu = emulator();
    let dir = tempfile::tempdir().unwrap();
    inputs(dir.path());
    let out = dir.path().join("out");
    let args = with(
        train_args(dir.path(), &out, 4, 1),
        &[
            "--device",
            "cuda",
            "--zero-stage",
            "3",
            "--param-gather",
            "nccl",
            "--resume",
            "auto",
        ],
    );
    let ranks = |fault: Option<&str>| {
        let mut c = mpirun(1);
        c.arg(&emu).arg(bin()).args(&args);
        c.args([":", "-np", "1"]);
        if let Some(f) = fault {
            c.args(["-x", &format!("CUEMU_FAIL={f}")]);
        }
        c.arg(&emu).arg(bin()).args(&args);
        c.env("CUEMU_SKIP_BUILD", "1").env_remove("CUEMU_SCHEDULES");
        c
    };
    let t0 = Instant::now();
    // Launch 150 of rank 1 is in step 3 (2 steps of this model are fewer launches).
    let failed = ranks(Some("launch:150")).output().unwrap();
    let stderr = String::from_utf8_lossy(&failed.stderr);
    assert!(!failed.status.success(), "{stderr}");
    assert!(
        t0.elapsed() < Duration::from_secs(120),
        "took {:?}",
        t0.elapsed()
    );
    // Named by itself, or by its peer (mpirun may cut one process's line with another's).
    assert!(
        stderr.contains("error: rank 1 of 2") || stderr.contains("rank 1 aborted the communicator"),
        "{stderr}"
    );
    let ckpts: Vec<String> = listing(&out.join("ckpt"))
        .into_iter()
        .filter(|n| n.starts_with("step-"))
        .collect();
    assert_eq!(ckpts, ["step-00000002"], "{stderr}");
    let resumed = ranks(None).output().unwrap();
    check(resumed, "the NCCL job resumed with --resume auto");
    let steps: Vec<u64> = metrics(&out).iter().map(|m| m.0).collect();
    assert_eq!(steps.last(), Some(&4), "{steps:?}");
}

/// PyTorch's `torchrun` (tools/setup-torchrun.sh installs it once).
#[cfg(feature = "cuda")]
fn torchrun() -> PathBuf {
    let out = Command::new("bash")
        .arg(Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/setup-torchrun.sh"))
        .output()
        .unwrap();
    let out = check(
        out,
        "tools/setup-torchrun.sh (it needs the PyPI registry once)",
    );
    PathBuf::from(String::from_utf8_lossy(&out.stdout).trim())
}

/// `torchrun --standalone --no-python --nproc-per-node N` (its store on a free port).
#[cfg(feature = "cuda")]
fn torchrun_ranks(n: usize) -> Command {
    let mut c = Command::new(torchrun());
    c.args([
        "--standalone",
        "--no-python",
        "--nproc-per-node",
        &n.to_string(),
    ]);
    c.env("RAYON_NUM_THREADS", "1");
    c
}

/// torchrun starts ranks without MPI: CUDA ranks meet at its store and exchange through NCCL
/// (under the emulator: `bench collective` checks every sum, and says the store it met at);
/// CPU-device ranks, which exchange through MPI, are refused by every rank with the reason and
/// the launchers that work. (Training under torchrun equals accumulation bit for bit:
/// `cuda_ranks_equal_gradient_accumulation`.)
#[cfg(feature = "cuda")]
#[test]
fn cuda_ranks_under_torchrun_meet_at_its_store() {
    let r = emulated_bench_collective(
        torchrun_ranks(3),
        "4K,5M",
        "torchrun --nproc-per-node 3 cuemu.sh megatrain bench collective --device cuda",
    );
    let library = r["library"].as_str().unwrap();
    assert!(
        library.starts_with("NCCL 2.") && library.contains("torchrun's store"),
        "{r}"
    );
    assert!(
        r["ours_path"].as_str().unwrap().contains("rank order"),
        "{r}"
    );
    assert_eq!(r["rows"].as_array().unwrap().len(), 2, "{r}");

    let dir = tempfile::tempdir().unwrap();
    inputs(dir.path());
    let out = dir.path().join("out");
    let refused = torchrun_ranks(2)
        .arg(bin())
        .args(train_args(dir.path(), &out, 2, 1))
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&refused.stderr);
    assert!(!refused.status.success(), "{stderr}");
    for rank in ["rank 0 of 2", "rank 1 of 2"] {
        assert!(
            stderr.contains(&format!("torchrun ({rank})")) && stderr.contains("mpirun -np N"),
            "{stderr}"
        );
    }
    assert!(!out.join("ckpt").exists(), "{stderr}");
}

/// `bench collective --device cuda --json` of 3 ranks `launcher` starts, each under the CUDA
/// emulator, at `sizes`: its report, the run checked to succeed without the emulator's errors.
#[cfg(feature = "cuda")]
fn emulated_bench_collective(mut launcher: Command, sizes: &str, what: &str) -> serde_json::Value {
    let out = launcher
        .arg(emulator())
        .arg(bin())
        .args(["bench", "collective", "--device", "cuda"])
        .args(["--sizes", sizes, "--reps", "1", "--json"])
        .env("CUEMU_SKIP_BUILD", "1")
        .env_remove("CUEMU_SCHEDULES")
        .output()
        .unwrap();
    let out = check(out, what);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(!stderr.contains("cuemu: error"), "{stderr}");
    let r: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(r["ranks"], 3, "{r}");
    r
}

/// `tools/cuemu.sh`, the emulator built once before the ranks start (each then finds it:
/// `CUEMU_SKIP_BUILD`).
#[cfg(feature = "cuda")]
fn emulator() -> PathBuf {
    let emu = Path::new(env!("CARGO_MANIFEST_DIR")).join("tools/cuemu.sh");
    let build = Command::new(&emu).arg("true").output().unwrap();
    check(build, "tools/cuemu.sh true (build the emulator)");
    emu
}

/// `args` with `flags` appended.
fn with(mut args: Vec<String>, flags: &[&str]) -> Vec<String> {
    args.extend(flags.iter().map(|f| f.to_string()));
    args
}

/// `args` with `from` replaced by `to` (a flag's value).
fn swap(args: Vec<String>, from: &str, to: &str) -> Vec<String> {
    args.into_iter()
        .map(|a| if a == from { to.into() } else { a })
        .collect()
}

/// A constant learning rate (the cosine schedule's depends on the run's length).
fn constant(args: Vec<String>) -> Vec<String> {
    swap(args, "cosine", "constant")
}

/// A new run directory `to` under `d` holding the newest checkpoint and the metrics of run
/// `from`, to resume from.
fn resumable_copy(d: &Path, from: &str, to: &str) -> PathBuf {
    let to = d.join(to);
    let c = newest(&d.join(from));
    let dst = to.join("ckpt").join(c.file_name().unwrap());
    std::fs::create_dir_all(&dst).unwrap();
    for e in std::fs::read_dir(&c).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), dst.join(e.file_name())).unwrap();
    }
    std::fs::copy(d.join(from).join("metrics.jsonl"), to.join("metrics.jsonl")).unwrap();
    to
}

/// The names in directory `d`, sorted.
fn listing(d: &Path) -> Vec<String> {
    let mut v: Vec<String> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    v.sort();
    v
}

/// The "(X of the job's Y bytes)" rank 0 says it holds after `prefix`, checked to be a part.
fn holds_a_part(said: &str, prefix: &str) {
    let line = said
        .lines()
        .find(|l| l.contains(prefix))
        .unwrap_or_else(|| panic!("no {prefix:?} in:\n{said}"));
    let nums: Vec<u64> = line
        .split(|c: char| !c.is_ascii_digit())
        .filter_map(|w| w.parse().ok())
        .collect();
    let (held, job) = (nums[nums.len() - 2], nums[nums.len() - 1]);
    assert!(held > 0 && held < job, "{line}");
}

/// `--zero-stage 1`: each unit's Adam moments live on one rank, which alone updates the unit
/// and sends its params to the others. Sharded ranks train the same bits as gradient
/// accumulation (2 and 3 ranks, exact mode) and as replicated ranks (lean mode); a rank holds
/// part of the moments (rank 0 says how much); the checkpoint is the job's whole state in the
/// one-process format, so 3 sharded ranks resume on 2 sharded ranks and on one process.
#[test]
fn sharded_adam_state_trains_the_same_bits_and_resumes_on_any_ranks() {
    let d = tempfile::tempdir().unwrap();
    inputs(d.path());
    let zero = |args: Vec<String>| with(args, &["--zero-stage", "1"]);
    for n in [2usize, 3] {
        let (ranks, one) = (
            d.path().join(format!("zero{n}")),
            d.path().join(format!("accum{n}")),
        );
        let out = run_ranks(n, &zero(constant(train_args(d.path(), &ranks, 6, 1))));
        // "(X of the job's Y bytes)": a part, not all, and not nothing.
        holds_a_part(
            &String::from_utf8_lossy(&out.stderr),
            "ZeRO stage 1: rank 0 holds",
        );
        run_one(&constant(train_args(d.path(), &one, 6, n)));
        assert!(
            assert_equal_runs(
                &ranks,
                &one,
                &format!("{n} sharded ranks vs accumulation {n}")
            ),
            "{n} sharded ranks are within 1e-6 of accumulating {n} but not the same bits"
        );
    }
    // Lean mode: its norm's Σg² come from each unit's owner.
    let lean = |args: Vec<String>| swap(args, "exact", "lean");
    let (sharded, whole) = (d.path().join("lean-zero"), d.path().join("lean-whole"));
    run_ranks(2, &zero(lean(train_args(d.path(), &sharded, 6, 1))));
    run_ranks(2, &lean(train_args(d.path(), &whole, 6, 1)));
    assert!(
        assert_equal_runs(&sharded, &whole, "2 lean ranks, sharded vs whole"),
        "sharded lean ranks are within 1e-6 of whole ones but not the same bits"
    );
    // The bf16 recipe's master (two 16-bit planes: the broadcast carries both) and bf16
    // moments (stochastic rounding salted by step and unit, whichever rank updates it).
    let bf16 = |args: Vec<String>| with(args, &["--precision", "bf16", "--adam-state", "bf16"]);
    let (sharded, whole) = (d.path().join("bf16-zero"), d.path().join("bf16-whole"));
    run_ranks(2, &zero(bf16(train_args(d.path(), &sharded, 4, 1))));
    run_ranks(2, &bf16(train_args(d.path(), &whole, 4, 1)));
    for f in ["params.f32", "adam_m.bf16", "adam_v.bf16"] {
        let (a, b) = (newest(&sharded).join(f), newest(&whole).join(f));
        assert!(
            std::fs::read(&a).unwrap() == std::fs::read(&b).unwrap(),
            "bf16: {f} differs between sharded and whole ranks"
        );
    }
    assert_eq!(metrics(&sharded), metrics(&whole));
    // The 3 sharded ranks' checkpoint at step 6 resumes on 2 sharded ranks (a batch of 2 from
    // there) as on one process accumulating 2, and on one process accumulating 3 as the 3
    // ranks' own run to step 8.
    let copy = |to: &str| resumable_copy(d.path(), "zero3", to);
    let resume = |args: Vec<String>| with(args, &["--resume"]);
    let on_two = copy("on-two");
    run_ranks(
        2,
        &zero(resume(constant(train_args(d.path(), &on_two, 8, 1)))),
    );
    let two_ref = copy("two-ref");
    run_one(&resume(constant(train_args(d.path(), &two_ref, 8, 2))));
    assert!(assert_equal_runs(
        &on_two,
        &two_ref,
        "resumed on 2 sharded ranks vs accumulation 2"
    ));
    assert_eq!(metrics(&on_two).last().unwrap().0, 8);
    let on_one = copy("on-one");
    run_one(&resume(constant(train_args(d.path(), &on_one, 8, 3))));
    let straight = d.path().join("zero3-straight");
    run_ranks(3, &zero(constant(train_args(d.path(), &straight, 8, 1))));
    assert!(assert_equal_runs(
        &on_one,
        &straight,
        "resumed on 1 vs 3 sharded ranks straight"
    ));
}

/// `--val-data` (the training tokens) checked every 2 steps, and `--export-hf` into `out/hf`.
fn with_outputs(dir: &Path, out: &Path, args: Vec<String>) -> Vec<String> {
    let (data, hf) = (dir.join("train.bin"), out.join("hf"));
    with(
        args,
        &[
            "--val-data",
            data.to_str().unwrap(),
            "--val-every",
            "2",
            "--val-batches",
            "2",
            "--export-hf",
            hf.to_str().unwrap(),
        ],
    )
}

/// Each metrics line's validation loss (`None` where none was taken).
fn val_losses(out: &Path) -> Vec<Option<f64>> {
    std::fs::read_to_string(out.join("metrics.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str::<serde_json::Value>(l).unwrap()["val_loss"].as_f64())
        .collect()
}

/// The same bytes in file `f` of two directories.
fn same_file(a: &Path, b: &Path, f: &str, what: &str) {
    assert!(
        std::fs::read(a.join(f)).unwrap() == std::fs::read(b.join(f)).unwrap(),
        "{what}: {f} differs"
    );
}

#[test]
fn sharded_params_train_the_same_bits_validate_export_and_resume() {
    let d = tempfile::tempdir().unwrap();
    inputs(d.path());
    let zero3 = |args: Vec<String>| with(args, &["--zero-stage", "3"]);
    // Exact mode, clipping active: N ranks holding 1/N of the params, gradients and moments each
    // (the others' gradients landed, summed and dropped; the norm from each unit's owner) equal
    // one process accumulating N, bit for bit; validation (every rank gathers) and the export
    // (from the final checkpoint) equal the process's too.
    for n in [2usize, 3] {
        let (ranks, one) = (
            d.path().join(format!("p{n}")),
            d.path().join(format!("p-accum{n}")),
        );
        let args = with_outputs(d.path(), &ranks, train_args(d.path(), &ranks, 6, 1));
        let out = run_ranks(n, &zero3(constant(args)));
        holds_a_part(
            &String::from_utf8_lossy(&out.stderr),
            "ZeRO stage 3: rank 0 holds and updates the params, gradients and Adam",
        );
        let args = with_outputs(d.path(), &one, train_args(d.path(), &one, 6, n));
        run_one(&constant(args));
        assert!(
            assert_equal_runs(&ranks, &one, &format!("{n} ranks, params sharded")),
            "{n} ranks with sharded params are within 1e-6 of accumulating {n} but not the same bits"
        );
        let vals = val_losses(&ranks);
        assert!(vals.iter().filter(|v| v.is_some()).count() == 3, "{vals:?}");
        assert_eq!(vals, val_losses(&one), "{n} ranks: validation losses");
        for f in std::fs::read_dir(one.join("hf")).unwrap() {
            let name = f.unwrap().file_name().into_string().unwrap();
            if name.ends_with(".safetensors") {
                same_file(&ranks.join("hf"), &one.join("hf"), &name, "export");
            }
        }
    }
    // Through MPI's messages (ranks on several hosts) each unit's sum is gathered to its owner
    // alone (`MPI_Gatherv`; the shared window copies it back to the owner alone): the same
    // bits.
    let messages = d.path().join("p3-messages");
    let out = mpirun(3)
        .env("MEGATRAIN_SHARED_SUM", "0")
        .arg(bin())
        .args(zero3(constant(train_args(d.path(), &messages, 6, 1))))
        .output()
        .unwrap();
    check(out, "mpirun -np 3 --zero-stage 3, MEGATRAIN_SHARED_SUM=0");
    let one = d.path().join("p-accum3");
    assert!(
        assert_equal_runs(&messages, &one, "3 ranks, params sharded, MPI's messages"),
        "3 sharded ranks through MPI's messages are within 1e-6 of accumulating 3 but not the same bits"
    );
    // Micro-batches accumulated on each rank gather every unit again for each of them, and
    // each micro-batch's gradients are summed across the ranks at once onto their owner's
    // shard (no rank keeps the others' across micro-batches): 2 ranks accumulating 2 are within
    // 1e-6 of 2 whole ranks accumulating 2 (the sum's order differs: the micro-batches' sums
    // accumulated, where whole ranks sum their accumulations) and repeat bit for bit.
    let (ranks, again, whole) = (
        d.path().join("p2x2"),
        d.path().join("p2x2-again"),
        d.path().join("whole2x2"),
    );
    let out = run_ranks(2, &zero3(constant(train_args(d.path(), &ranks, 4, 2))));
    holds_a_part(
        &String::from_utf8_lossy(&out.stderr),
        "ZeRO stage 3: rank 0 holds and updates the params, gradients and Adam",
    );
    run_ranks(2, &zero3(constant(train_args(d.path(), &again, 4, 2))));
    assert!(
        assert_equal_runs(
            &ranks,
            &again,
            "2 ranks accumulating 2, params sharded, twice"
        ),
        "2 sharded ranks accumulating 2 do not repeat their bits"
    );
    run_ranks(2, &constant(train_args(d.path(), &whole, 4, 2)));
    assert_equal_runs(
        &ranks,
        &whole,
        "2 ranks accumulating 2, params sharded vs whole",
    );
    // Lean mode (no gradient shard on any rank: each rank holds 1/N of the state) and the bf16
    // recipe (the gather carries the high plane the device streams; the checkpoint the joined
    // fp32) with bf16 moments: the same bytes as whole ranks.
    let lean = |args: Vec<String>| swap(args, "exact", "lean");
    let bf16 = |args: Vec<String>| with(args, &["--precision", "bf16", "--adam-state", "bf16"]);
    let (sharded, whole) = (d.path().join("lean-p"), d.path().join("lean-whole"));
    run_ranks(2, &zero3(lean(train_args(d.path(), &sharded, 6, 1))));
    run_ranks(2, &lean(train_args(d.path(), &whole, 6, 1)));
    assert!(
        assert_equal_runs(&sharded, &whole, "2 lean ranks, params sharded vs whole"),
        "lean ranks with sharded params are within 1e-6 of whole ones but not the same bits"
    );
    let (sharded, whole) = (d.path().join("bf16-p"), d.path().join("bf16-whole"));
    run_ranks(2, &zero3(bf16(train_args(d.path(), &sharded, 4, 1))));
    run_ranks(2, &bf16(train_args(d.path(), &whole, 4, 1)));
    for f in ["params.f32", "adam_m.bf16", "adam_v.bf16"] {
        same_file(
            &newest(&sharded),
            &newest(&whole),
            f,
            "bf16, params sharded",
        );
    }
    assert_eq!(metrics(&sharded), metrics(&whole));
    // The 3 ranks' checkpoint at step 6 resumes on 2 ranks with sharded params as on one process
    // accumulating 2.
    let copy = |to: &str| resumable_copy(d.path(), "p3", to);
    let resume = |args: Vec<String>| with(args, &["--resume"]);
    let on_two = copy("p-on-two");
    run_ranks(
        2,
        &zero3(resume(constant(train_args(d.path(), &on_two, 8, 1)))),
    );
    let two_ref = copy("p-two-ref");
    run_one(&resume(constant(train_args(d.path(), &two_ref, 8, 2))));
    assert!(assert_equal_runs(
        &on_two,
        &two_ref,
        "resumed on 2 ranks with sharded params vs accumulation 2"
    ));
    assert_eq!(metrics(&on_two).last().unwrap().0, 8);
    // Samples: every rank draws them (each pass gathers), rank 0 says them — the same text as
    // ranks holding every param, and training unchanged by them.
    let sampled = |dir: &str, flags: &[&str]| {
        let out = d.path().join(dir);
        let args = with(
            with(constant(train_args(d.path(), &out, 4, 1)), flags),
            &[
                "--sample-every",
                "2",
                "--sample-prompt",
                "0123",
                "--sample-tokens",
                "6",
                "--tokenizer",
                "bytes",
            ],
        );
        let o = run_ranks(2, &args);
        let said = format!(
            "{}{}",
            String::from_utf8_lossy(&o.stdout),
            String::from_utf8_lossy(&o.stderr)
        );
        let samples: Vec<String> = said
            .lines()
            .filter(|l| l.contains("sample at step"))
            .map(str::to_owned)
            .collect();
        (out, samples)
    };
    let (whole_out, whole) = sampled("s-whole", &[]);
    let (sharded_out, sharded) = sampled("s-sharded", &["--zero-stage", "3"]);
    assert_eq!(whole.len(), 2, "{whole:?}");
    assert_eq!(sharded, whole);
    assert!(assert_equal_runs(
        &sharded_out,
        &whole_out,
        "sampled with sharded params vs whole ranks"
    ));
}

/// A sharded job's checkpoint is written by its ranks, each writing the units it holds into the
/// one-process files. Where a rank does not see the directory, rank 0 writes it all from the
/// units the ranks send: the same bytes, the ranks named. A rank whose write fails fails the
/// checkpoint, naming itself; the earlier checkpoint stays whole and `--resume auto` carries on.
#[test]
fn sharded_checkpoints_are_written_by_every_rank() {
    let d = tempfile::tempdir().unwrap();
    inputs(d.path());
    let zero3 = |args: Vec<String>| with(args, &["--zero-stage", "3"]);
    let said = |out: &Output| {
        format!(
            "{}{}",
            String::from_utf8_lossy(&out.stdout),
            String::from_utf8_lossy(&out.stderr)
        )
    };
    let (own, gathered) = (d.path().join("own"), d.path().join("gathered"));
    let out = run_ranks(3, &zero3(constant(train_args(d.path(), &own, 4, 1))));
    let text = said(&out);
    // Step 2's beside steps 3 and 4; step 4's, the last, waited for.
    assert!(
        text.contains("each of the 3 ranks writing the units it holds) while training went on"),
        "{text}"
    );
    assert!(
        text.contains("each of the 3 ranks writing the units it holds; training waited for it"),
        "{text}"
    );
    // CPU ranks gather their params through host memory, and say so.
    assert!(
        text.contains("params gathered through host memory (MPI)") && !text.contains("GPU to GPU"),
        "{text}"
    );
    // A checkpoint holds the files its manifest lists, and nothing of the writing is left
    // beside them (the ranks' reports, the probe, the sealing claim).
    assert_eq!(
        listing(&own.join("ckpt")),
        [".megatrain.lock", "step-00000002", "step-00000004"]
    );
    for step in ["step-00000002", "step-00000004"] {
        assert_eq!(
            listing(&own.join("ckpt").join(step)),
            [
                "MANIFEST.json",
                "adam_m.f32",
                "adam_v.f32",
                "params.f32",
                "state.json"
            ]
        );
    }
    // Ranks 1 and 2 refused the probe: rank 0 gathers.
    let out = mpirun(3)
        .env("MEGATRAIN_FAILPOINTS", "checkpoint-shared=EACCES")
        .arg(bin())
        .args(zero3(constant(train_args(d.path(), &gathered, 4, 1))))
        .output()
        .unwrap();
    let text = said(&check(out, "3 ranks, rank 0 gathering"));
    for r in [1, 2] {
        assert!(
            text.contains(&format!("rank {r} (on ")) && text.contains("does not see"),
            "{text}"
        );
    }
    assert!(text.contains("rank 0 writing the units the 3 ranks sent"));
    for f in ["params.f32", "adam_m.f32", "adam_v.f32"] {
        same_file(
            &newest(&own),
            &newest(&gathered),
            f,
            "written by the ranks vs gathered",
        );
    }
    megatrain::train::checkpoint::verify(&newest(&own)).unwrap();
    // Rank 1's disk fails as it writes the step-6 checkpoint (on 2 ranks: the units dealt anew).
    let out_dir = resumable_copy(d.path(), "own", "failing");
    let args = with(
        zero3(constant(train_args(d.path(), &out_dir, 6, 1))),
        &["--resume", "auto"],
    );
    let mut c = mpirun(1);
    c.arg(bin()).args(&args).args([":", "-np", "1"]);
    c.args(["-x", "MEGATRAIN_FAILPOINTS=checkpoint=ENOSPC"]);
    let failed = c.arg(bin()).args(&args).output().unwrap();
    let text = said(&failed);
    assert!(!failed.status.success(), "{text}");
    assert!(
        text.contains("rank 1 (on ") && text.contains("No space left"),
        "{text}"
    );
    let entries: Vec<String> = listing(&out_dir.join("ckpt"))
        .into_iter()
        .filter(|n| n.contains("step-"))
        .collect();
    assert_eq!(entries, ["step-00000004"], "{text}");
    megatrain::train::checkpoint::verify(&newest(&out_dir)).unwrap();
    run_ranks(2, &args);
    assert_eq!(metrics(&out_dir).last().unwrap().0, 6);
    // A resuming rank reads only the units it holds, and the ranks check each file together:
    // a byte changed anywhere in a moment file is caught, whichever rank read it.
    for at in [0.1, 0.5, 0.99] {
        let bad = resumable_copy(d.path(), "own", &format!("corrupt-{at}"));
        let f = newest(&bad).join("adam_v.f32");
        let mut bytes = std::fs::read(&f).unwrap();
        let i = (bytes.len() as f64 * at) as usize;
        bytes[i] ^= 0x10;
        std::fs::write(&f, bytes).unwrap();
        let args = with(
            zero3(constant(train_args(d.path(), &bad, 6, 1))),
            &["--resume"],
        );
        let out = mpirun(2).arg(bin()).args(&args).output().unwrap();
        let text = said(&out);
        assert!(!out.status.success(), "{text}");
        assert!(text.contains("adam_v.f32 fails its crc32c check"), "{text}");
    }
}
