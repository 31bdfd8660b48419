//! The trainer end to end: resume is bit-identical, a killed checkpoint write leaves the previous
//! checkpoint loadable, bad input is refused cleanly, and the outputs are written.
#![allow(clippy::unwrap_used)]

mod common;

use megatrain::train::checkpoint;
use megatrain::train::config::{LrSchedule, Resume, TrainConfig};
use megatrain::train::{run, Progress};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

struct Quiet;
impl Progress for Quiet {}

const MODEL: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":32,"intermediate_size":72,
  "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":61,"tie_word_embeddings":true}"#;

fn setup(dir: &Path, tokens: usize) -> (PathBuf, PathBuf) {
    let model = dir.join("model.json");
    std::fs::write(&model, MODEL).unwrap();
    let data = dir.join("train.bin");
    let mut s = 12345u64;
    let bytes: Vec<u8> = (0..tokens)
        .flat_map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s % 61) as u16).to_le_bytes()
        })
        .collect();
    std::fs::write(&data, bytes).unwrap();
    (model, data)
}

fn cfg(dir: &Path, model: PathBuf, data: PathBuf, steps: u64) -> TrainConfig {
    TrainConfig {
        model: Some(model),
        data: Some(data),
        seq_len: 16,
        batch_size: 2,
        grad_accum: 2,
        steps,
        lr: 3e-3,
        lr_schedule: LrSchedule::Cosine,
        warmup_steps: 2,
        shuffle: true,
        seed: 7,
        checkpoint_dir: Some(dir.join("ckpt")),
        metrics: Some(dir.join("metrics.jsonl")),
        device_memory: 256 << 20,
        ..TrainConfig::default()
    }
}

fn read(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap()
}

#[test]
fn resume_is_bit_identical() {
    let a = tempfile::tempdir().unwrap();
    let (m, d) = setup(a.path(), 4000);
    let straight = cfg(a.path(), m.clone(), d.clone(), 6);
    let s1 = run(&straight, Arc::new(AtomicBool::new(false)), &mut Quiet).unwrap();
    assert!(s1.last_loss.unwrap() < s1.first_loss.unwrap(), "loss falls");

    // The same 6-step run, stopped after step 3 by an interrupt (as Ctrl-C does), then resumed.
    let b = tempfile::tempdir().unwrap();
    let h = cfg(b.path(), m.clone(), d.clone(), 6);
    struct StopAt3(Arc<AtomicBool>);
    impl Progress for StopAt3 {
        fn step(&mut self, m: &megatrain::engine::StepMetrics, _: Option<f64>) {
            if m.step == 3 {
                self.0.store(true, std::sync::atomic::Ordering::SeqCst);
            }
        }
    }
    let flag = Arc::new(AtomicBool::new(false));
    let s2 = run(&h, flag.clone(), &mut StopAt3(flag)).unwrap();
    assert!(s2.interrupted && s2.steps == 3);
    let resumed = TrainConfig {
        resume: Resume::Always,
        ..h
    };
    let s3 = run(&resumed, Arc::new(AtomicBool::new(false)), &mut Quiet).unwrap();
    assert_eq!(s3.steps, 6);
    let (ca, cb) = (s1.checkpoint.unwrap(), s3.checkpoint.unwrap());
    for f in ["params.f32", "adam_m.f32", "adam_v.f32"] {
        assert!(
            read(&ca.join(f)) == read(&cb.join(f)),
            "{f} differs after resume"
        );
    }
    // Per-step losses agree bit for bit too.
    let losses = |p: &Path| -> Vec<String> {
        std::fs::read_to_string(p)
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                format!("{}:{}", v["step"], v["loss"])
            })
            .collect()
    };
    assert_eq!(
        losses(&a.path().join("metrics.jsonl")),
        losses(&b.path().join("metrics.jsonl"))
    );
    assert!(a.path().join("metrics.svg").exists());
}

/// A checkpoint written while the next step runs (`--checkpoint-every 1`: every one but the
/// last) is exactly its step's state: the same bytes as the checkpoint the same run interrupted
/// after that step writes (waited for, nothing running beside it), and resuming from it ends bit-identical to the run that
/// wrote it. With the bf16 recipe's split master and int8 moments too.
#[test]
fn overlapped_checkpoints_hold_exactly_their_step() {
    use megatrain::device::Precision;
    use megatrain::store::layout::AdamState;
    let dir = tempfile::tempdir().unwrap();
    let (m, d) = setup(dir.path(), 4000);
    for (precision, adam_state) in [(None, None), (Some(Precision::Bf16), Some(AdamState::Int8))] {
        // A run of 5 steps, or (`stop_after`) the same run interrupted after that step (the
        // checkpoint written then is waited for: nothing runs after it).
        let run_in = |sub: &str, stop_after: Option<u64>, resume: Resume| {
            let base = dir.path().join(sub);
            std::fs::create_dir_all(&base).unwrap();
            let c = TrainConfig {
                precision,
                adam_state,
                checkpoint_every: 1,
                keep_checkpoints: 10,
                resume,
                ..cfg(&base, m.clone(), d.clone(), 5)
            };
            struct StopAfter(Arc<AtomicBool>, Option<u64>);
            impl Progress for StopAfter {
                fn step(&mut self, m: &megatrain::engine::StepMetrics, _: Option<f64>) {
                    if Some(m.step) == self.1 {
                        self.0.store(true, std::sync::atomic::Ordering::SeqCst);
                    }
                }
            }
            let flag = Arc::new(AtomicBool::new(false));
            run(&c, flag.clone(), &mut StopAfter(flag, stop_after)).unwrap();
            base.join("ckpt")
        };
        let tag = format!("{precision:?}-{adam_state:?}");
        let long = run_in(&format!("long-{tag}"), None, Resume::Never);
        let short = run_in(&format!("short-{tag}"), Some(3), Resume::Never);
        let names: Vec<String> = std::fs::read_dir(short.join("step-00000003"))
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .filter(|n| n.starts_with("params") || n.starts_with("adam_"))
            .collect();
        assert_eq!(names.len(), 3, "{tag}: {names:?}");
        for f in &names {
            assert!(
                read(&long.join("step-00000003").join(f))
                    == read(&short.join("step-00000003").join(f)),
                "{tag}: the overlapped step-3 checkpoint's {f} differs from step 3's state"
            );
        }
        // The same run through the CLI with a writer slowed to 80 ms per unit: updates of the
        // next step have to wait for their unit (how many depends on the machine's speed:
        // under qemu a step can outlast the write), and still both checkpoints are exact.
        let slow = dir.path().join(format!("slow-{tag}"));
        std::fs::create_dir_all(&slow).unwrap();
        let toml_path = slow.join("train.toml");
        let c = TrainConfig {
            precision,
            adam_state,
            checkpoint_every: 1,
            keep_checkpoints: 10,
            ..cfg(&slow, m.clone(), d.clone(), 5)
        };
        std::fs::write(&toml_path, toml::to_string(&c).unwrap()).unwrap();
        let out = common::megatrain()
            .args(["train", toml_path.to_str().unwrap()])
            .env("MEGATRAIN_FAILPOINTS", "checkpoint-unit=sleep80")
            .output()
            .unwrap();
        let stderr = String::from_utf8_lossy(&out.stderr);
        assert!(out.status.success(), "{tag}: {stderr}");
        let waits: Vec<f64> = stderr
            .lines()
            .filter_map(|l| {
                l.split_once("it waited ")?
                    .1
                    .split_once(" s")?
                    .0
                    .parse()
                    .ok()
            })
            .collect();
        assert_eq!(
            waits.len(),
            4,
            "{tag}: 4 overlapped checkpoints in {stderr}"
        );
        assert!(
            waits.iter().filter(|&&w| w > 0.01).count() >= 2,
            "{tag}: updates waited for the slowed writer: {waits:?}"
        );
        for (step, want) in [(3, &short), (5, &long)] {
            let name = format!("step-{step:08}");
            for f in &names {
                assert!(
                    read(&slow.join("ckpt").join(&name).join(f)) == read(&want.join(&name).join(f)),
                    "{tag}: with a slow writer, step {step}'s {f} differs"
                );
            }
        }
        // Resume from the overlapped step-3 checkpoint alone.
        let again = dir.path().join(format!("again-{tag}"));
        std::fs::create_dir_all(again.join("ckpt/step-00000003")).unwrap();
        for e in std::fs::read_dir(long.join("step-00000003")).unwrap() {
            let e = e.unwrap();
            std::fs::copy(
                e.path(),
                again.join("ckpt/step-00000003").join(e.file_name()),
            )
            .unwrap();
        }
        let resumed = run_in(&format!("again-{tag}"), None, Resume::Always);
        for f in &names {
            assert!(
                read(&long.join("step-00000005").join(f))
                    == read(&resumed.join("step-00000005").join(f)),
                "{tag}: resumed from the overlapped checkpoint, step 5's {f} differs"
            );
        }
    }
}

/// The same run with Adam m/v on NVMe (all units, or what a RAM budget forces out) writes the
/// same checkpoints bit for bit, and resuming a spilled run is bit-identical too.
#[test]
fn spilling_to_nvme_changes_no_bit_and_resumes() {
    let a = tempfile::tempdir().unwrap();
    let (m, d) = setup(a.path(), 4000);
    let plain = run(
        &cfg(a.path(), m.clone(), d.clone(), 4),
        Arc::new(AtomicBool::new(false)),
        &mut Quiet,
    )
    .unwrap();
    let want = plain.checkpoint.unwrap();
    let layout = megatrain::store::layout::StateLayout::new(
        &megatrain::model::config::ModelConfig::from_json_str(MODEL, "t").unwrap(),
        megatrain::store::layout::Mode::Exact,
    );
    for (policy, budget) in [
        (megatrain::store::placement::SpillPolicy::All, None),
        (
            megatrain::store::placement::SpillPolicy::Auto,
            Some(layout.total_bytes() - 4096),
        ),
    ] {
        let b = tempfile::tempdir().unwrap();
        let c = TrainConfig {
            nvme: vec![b.path().join("nvme")],
            spill: policy,
            ram_budget: budget,
            spill_staging: 2,
            checkpoint_every: 2,
            ..cfg(b.path(), m.clone(), d.clone(), 4)
        };
        let got = run(&c, Arc::new(AtomicBool::new(false)), &mut Quiet)
            .unwrap()
            .checkpoint
            .unwrap();
        for f in ["params.f32", "adam_m.f32", "adam_v.f32"] {
            assert!(read(&want.join(f)) == read(&got.join(f)), "{policy:?}: {f}");
        }
        // Resume from step 2 with the spill tier (m/v come back from the checkpoint).
        std::fs::remove_dir_all(&got).unwrap();
        let again = run(
            &TrainConfig {
                resume: Resume::Always,
                ..c
            },
            Arc::new(AtomicBool::new(false)),
            &mut Quiet,
        )
        .unwrap();
        assert_eq!(again.steps, 4);
        let got = again.checkpoint.unwrap();
        for f in ["params.f32", "adam_m.f32", "adam_v.f32"] {
            assert!(
                read(&want.join(f)) == read(&got.join(f)),
                "{policy:?} resumed: {f}"
            );
        }
    }
}

/// With the mode unset, the planner picks lean when only the lean state fits the RAM budget (and
/// records it, so a resume keeps it); with room, exact.
#[test]
fn the_planner_chooses_the_mode_when_it_is_unset() {
    let a = tempfile::tempdir().unwrap();
    let (m, d) = setup(a.path(), 4000);
    let model = megatrain::model::config::ModelConfig::from_json_str(MODEL, "t").unwrap();
    let bytes = |mode| megatrain::store::layout::StateLayout::new(&model, mode).total_bytes();
    let (exact, lean) = (
        bytes(megatrain::store::layout::Mode::Exact),
        bytes(megatrain::store::layout::Mode::Lean),
    );
    assert!(lean < exact);
    for (budget, want) in [(None, "exact"), (Some(lean + (exact - lean) / 2), "lean")] {
        let b = tempfile::tempdir().unwrap();
        let c = TrainConfig {
            grad_accum: 1,
            ram_budget: budget,
            ..cfg(b.path(), m.clone(), d.clone(), 2)
        };
        assert_eq!(c.mode, None);
        let s = run(&c, Arc::new(AtomicBool::new(false)), &mut Quiet).unwrap();
        let st = checkpoint::read_state(&s.checkpoint.unwrap()).unwrap();
        assert_eq!(
            serde_json::to_value(st.config.mode).unwrap(),
            serde_json::json!(want),
            "budget {budget:?}"
        );
        // Every layer's internals of this tiny model fit the 256 MiB device: kept there.
        assert_eq!(
            serde_json::to_value(st.config.activations).unwrap(),
            serde_json::json!("keep")
        );
    }
    // A device with room for the host-offloaded working set but not for all checkpoints.
    let layout =
        megatrain::store::layout::StateLayout::new(&model, megatrain::store::layout::Mode::Exact);
    let need = |cp| {
        megatrain::engine::device_bytes(
            &layout,
            2,
            16,
            1,
            (cp, megatrain::engine::ActivationDtype::Fp32, 0),
        )
    };
    let (keep, dev, host) = (
        need(megatrain::engine::Activations::Keep),
        need(megatrain::engine::Activations::Device),
        need(megatrain::engine::Activations::Host),
    );
    assert!(host < dev && dev < keep);
    // The CPU device's own layer workspace.
    let workspace = megatrain::device::program::workspace_bytes(
        &model,
        megatrain::device::program::Shape::whole(2, 16),
        megatrain::device::Precision::Fp32,
    );
    // Room for the layer inputs but not every internal: inputs on the device; room for the
    // host-offloaded working set only: offloaded.
    for (room, want) in [
        (dev + (keep - dev) / 2, "device"),
        (host + (dev - host) / 2, "host"),
    ] {
        let b = tempfile::tempdir().unwrap();
        let small = TrainConfig {
            device_memory: workspace + room,
            grad_accum: 1,
            ..cfg(b.path(), m.clone(), d.clone(), 2)
        };
        let s = run(&small, Arc::new(AtomicBool::new(false)), &mut Quiet).unwrap();
        let st = checkpoint::read_state(&s.checkpoint.unwrap()).unwrap();
        assert_eq!(
            serde_json::to_value(st.config.activations).unwrap(),
            serde_json::json!(want)
        );
    }
    // Four layers: room for the offloaded working set and one input more keeps the last
    // block's input on the device and offloads the rest; room for the offloaded set only,
    // every input.
    struct Notes(Vec<String>);
    impl Progress for Notes {
        fn note(&mut self, line: &str) {
            self.0.push(line.to_owned());
        }
    }
    let deep = MODEL.replace("\"num_hidden_layers\":2", "\"num_hidden_layers\":4");
    let deep_model = a.path().join("deep.json");
    std::fs::write(&deep_model, &deep).unwrap();
    let layout = megatrain::store::layout::StateLayout::new(
        &megatrain::model::config::ModelConfig::from_json_str(&deep, "t").unwrap(),
        megatrain::store::layout::Mode::Exact,
    );
    let place = |a, k| {
        megatrain::engine::device_bytes(
            &layout,
            2,
            16,
            1,
            (a, megatrain::engine::ActivationDtype::Fp32, k),
        )
    };
    let host = megatrain::engine::Activations::Host;
    assert!(place(host, 0) < place(host, 1) && place(host, 1) < place(host, 2));
    assert!(place(host, 3) <= place(megatrain::engine::Activations::Device, 0));
    for (room, says) in [
        (place(host, 1), "the last 1 of 4 blocks' on the device"),
        (place(host, 0), "layer inputs offloaded to host"),
    ] {
        let b = tempfile::tempdir().unwrap();
        let small = TrainConfig {
            device_memory: workspace + room,
            grad_accum: 1,
            ..cfg(b.path(), deep_model.clone(), d.clone(), 2)
        };
        let mut notes = Notes(Vec::new());
        run(&small, Arc::new(AtomicBool::new(false)), &mut notes).unwrap();
        assert!(
            notes
                .0
                .iter()
                .any(|n| n.starts_with("activations:") && n.contains(says)),
            "{says}: {:?}",
            notes.0
        );
    }
}

#[test]
fn damaged_checkpoints_are_refused_naming_the_newest_good_one() {
    let a = tempfile::tempdir().unwrap();
    let (m, d) = setup(a.path(), 4000);
    let c = TrainConfig {
        checkpoint_every: 1,
        keep_checkpoints: 5,
        ..cfg(a.path(), m, d, 3)
    };
    run(&c, Arc::new(AtomicBool::new(false)), &mut Quiet).unwrap();
    let root = a.path().join("ckpt");
    let newest = checkpoint::latest(&root).unwrap().unwrap();
    assert!(newest.ends_with("step-00000003"));
    // A crashed writer's temporary directory is ignored.
    std::fs::create_dir(root.join(".step-00000004.tmp-1")).unwrap();
    assert_eq!(checkpoint::latest(&root).unwrap().unwrap(), newest);
    // Flip one byte of the newest: its contents fail verification; choosing it reads only its
    // listing, and the resume, which checks each file as it reads it (once), refuses it
    // before training, naming step 2 as the newest good one.
    let p = newest.join("adam_v.f32");
    let mut b = read(&p);
    b[17] ^= 0x40;
    std::fs::write(&p, &b).unwrap();
    assert_eq!(
        checkpoint::verify(&newest),
        Err(checkpoint::Damage::Corrupt("adam_v.f32".into()))
    );
    assert_eq!(checkpoint::latest(&root).unwrap().unwrap(), newest);
    let resumed = TrainConfig {
        resume: Resume::Always,
        steps: 4,
        ..c
    };
    let e = run(&resumed, Arc::new(AtomicBool::new(false)), &mut Quiet)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("step-00000003") && e.contains("crc32c") && e.contains("step-00000002"),
        "{e}"
    );
    // A file cut short is refused at the choice, before anything is allocated.
    std::fs::write(&p, &b[..b.len() - 4]).unwrap();
    let e = checkpoint::latest(&root).unwrap_err().to_string();
    assert!(
        e.contains("adam_v.f32") && e.contains("step-00000002"),
        "{e}"
    );
}

fn megatrain(args: &[&str]) -> (i32, String) {
    let out = common::megatrain().args(args).output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

/// `megatrain train` on the small model with a step count it will never reach (the test stops it).
fn endless_run(m: &Path, d: &Path, ck: &Path, extra: &[&str]) -> Command {
    let mut c = common::megatrain();
    c.args([
        "train",
        "--model",
        m.to_str().unwrap(),
        "--data",
        d.to_str().unwrap(),
    ])
    .args(["--seq-len", "16", "--batch-size", "2", "--steps", "100000"])
    .args([
        "--checkpoint-dir",
        ck.to_str().unwrap(),
        "--device-memory",
        "268435456",
    ])
    .args(extra);
    c
}

#[test]
fn kill_9_during_checkpoint_writes_leaves_a_loadable_checkpoint() {
    let a = tempfile::tempdir().unwrap();
    let (m, d) = setup(a.path(), 20000);
    let ck = a.path().join("ckpt");
    for (attempt, delay_ms) in [(0, 900u64), (1, 1300), (2, 1700)] {
        let mut extra = vec!["--checkpoint-every", "1"];
        if attempt > 0 {
            extra.push("--resume");
        }
        let mut child = endless_run(&m, &d, &ck, &extra)
            .stderr(std::process::Stdio::null())
            .spawn()
            .unwrap();
        // Wait until checkpoints are being written (startup time varies with the build and the
        // machine's load), then kill at an arbitrary point of the write loop.
        let t0 = std::time::Instant::now();
        while checkpoint::latest(&ck).ok().flatten().is_none() && t0.elapsed().as_secs() < 60 {
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        std::thread::sleep(std::time::Duration::from_millis(delay_ms / 10));
        child.kill().unwrap(); // SIGKILL
        child.wait().unwrap();
        let newest = checkpoint::latest(&ck)
            .unwrap()
            .expect("a checkpoint survives the kill");
        checkpoint::verify(&newest).unwrap();
    }
}

#[test]
fn bad_inputs_exit_nonzero_with_one_clear_line() {
    let a = tempfile::tempdir().unwrap();
    let (m, d) = setup(a.path(), 400);
    let (m, d) = (
        m.to_str().unwrap().to_owned(),
        d.to_str().unwrap().to_owned(),
    );
    let toml = a.path().join("c.toml");
    std::fs::write(&toml, "lr = 1e-3\nlearning_rate = 2\n").unwrap();
    let odd = a.path().join("odd.bin");
    std::fs::write(&odd, [1u8, 2, 3]).unwrap();
    let big = a.path().join("big.bin");
    std::fs::write(&big, [1u8, 0, 200, 0]).unwrap();
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["train", toml.to_str().unwrap()], "learning_rate"),
        (
            vec!["train", "--model", &m, "--data", "/nonexistent/x.bin"],
            "/nonexistent/x.bin",
        ),
        (
            vec!["train", "--model", &m, "--data", odd.to_str().unwrap()],
            "multiple of 2",
        ),
        (
            vec!["train", "--model", &m, "--data", big.to_str().unwrap()],
            "vocab",
        ),
        (
            vec![
                "train",
                "--model",
                &m,
                "--data",
                &d,
                "--seq-len",
                "200",
                "--batch-size",
                "4",
            ],
            "fewer than one batch",
        ),
        (
            vec!["train", "--model", &m, "--data", &d, "--device", "cuda"],
            "cuda",
        ),
        (vec!["train", "--data", &d], "model"),
        (
            vec!["train", "--model", &m, "--data", &d, "--spill", "all"],
            "--nvme",
        ),
        (
            vec![
                "train",
                "--model",
                &m,
                "--data",
                &d,
                "--seq-len",
                "16",
                "--batch-size",
                "2",
                "--ram-budget",
                "20K",
            ],
            "--ram-budget",
        ),
        (
            vec![
                "train",
                "--model",
                &m,
                "--data",
                &d,
                "--seq-len",
                "16",
                "--batch-size",
                "2",
                "--huge-pages",
                "1g",
            ],
            "nr_hugepages",
        ),
        (
            vec![
                "train",
                "--model",
                &m,
                "--data",
                &d,
                "--seq-len",
                "16",
                "--batch-size",
                "2",
                "--mode",
                "lean",
                "--grad-accum",
                "2",
            ],
            "lean",
        ),
    ];
    for (args, needle) in cases {
        let (rc, err) = megatrain(&args);
        assert_ne!(rc, 0, "{args:?}");
        assert!(!err.contains("panicked"), "{args:?}: {err}");
        let last = err.lines().last().unwrap_or("");
        assert!(
            last.starts_with("error: ") && last.contains(needle),
            "{args:?}: {err}"
        );
    }
    let (rc, _) = megatrain(&["train", "--no-such-flag"]);
    assert_eq!(rc, 2);
}

#[test]
fn ctrl_c_finishes_the_step_writes_a_checkpoint_and_exits() {
    let a = tempfile::tempdir().unwrap();
    let (m, d) = setup(a.path(), 20000);
    let ck = a.path().join("ckpt");
    let metrics = a.path().join("m.jsonl");
    let child = endless_run(&m, &d, &ck, &["--metrics", metrics.to_str().unwrap()])
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    let t0 = std::time::Instant::now();
    // Wait until training is under way (a first metrics line), whatever the startup time.
    while std::fs::metadata(&metrics).map_or(true, |m| m.len() == 0) && t0.elapsed().as_secs() < 60
    {
        std::thread::sleep(std::time::Duration::from_millis(20));
    }
    // SAFETY: sending SIGINT to our own child process.
    unsafe { libc::kill(child.id() as libc::pid_t, libc::SIGINT) };
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "{err}");
    assert!(
        err.contains("interrupt") && err.contains("--resume"),
        "{err}"
    );
    let newest = checkpoint::latest(&ck)
        .unwrap()
        .expect("a checkpoint on Ctrl-C");
    checkpoint::verify(&newest).unwrap();
}

/// A device memory too small for the whole micro-batch's layer workspace runs the layers in
/// token chunks, with the same bits: per-step losses and the final weights and moments equal
/// the unchunked run's. Too small even for the smallest chunks is refused, naming the need.
#[test]
fn token_chunks_change_no_bit() {
    use megatrain::device::program::{workspace_bytes, Shape};
    use megatrain::device::Precision;
    use megatrain::engine::{device_bytes, ActivationDtype, Activations};
    use megatrain::model::config::ModelConfig;
    use megatrain::store::layout::{Mode, StateLayout};
    struct Notes(Vec<String>);
    impl Progress for Notes {
        fn note(&mut self, line: &str) {
            self.0.push(line.to_owned());
        }
    }
    let (b, t) = (2usize, 600usize);
    let run_as = |dir: &Path, device_memory: u64, activations: Activations| {
        let (m, d) = setup(dir, 8000);
        let c = TrainConfig {
            seq_len: t,
            batch_size: b,
            grad_accum: 1,
            mode: Some(megatrain::store::layout::Mode::Exact),
            activations: Some(activations),
            device_memory,
            ..cfg(dir, m, d, 3)
        };
        let mut notes = Notes(Vec::new());
        let s = run(&c, Arc::new(AtomicBool::new(false)), &mut notes);
        (s, notes.0)
    };
    let run_with = |dir: &Path, device_memory: u64| run_as(dir, device_memory, Activations::Host);
    let model = ModelConfig::from_json_str(MODEL, "model.json").unwrap();
    let layout = StateLayout::new(&model, Mode::Exact);
    let buffers = device_bytes(
        &layout,
        b,
        t,
        1,
        (Activations::Host, ActivationDtype::Fp32, 0),
    );
    let chunked = Shape::chunked(b, t, 256).unwrap();
    let tight = workspace_bytes(&model, chunked, Precision::Fp32) + buffers;
    assert!(tight < workspace_bytes(&model, Shape::whole(b, t), Precision::Fp32) + buffers);

    let (whole_dir, chunk_dir) = (tempfile::tempdir().unwrap(), tempfile::tempdir().unwrap());
    let (s1, notes1) = run_with(whole_dir.path(), 256 << 20);
    let (s2, notes2) = run_with(chunk_dir.path(), tight);
    let (s1, s2) = (s1.unwrap(), s2.unwrap());
    assert!(
        !notes1.iter().any(|n| n.contains("token chunks")),
        "{notes1:?}"
    );
    assert!(
        notes2
            .iter()
            .any(|n| n.contains("layers run 256 tokens at a time")),
        "{notes2:?}"
    );
    let (ca, cb) = (s1.checkpoint.unwrap(), s2.checkpoint.unwrap());
    for f in ["params.f32", "adam_m.f32", "adam_v.f32"] {
        assert!(read(&ca.join(f)) == read(&cb.join(f)), "{f} differs");
    }
    let metrics = |p: &Path| -> Vec<String> {
        std::fs::read_to_string(p.join("metrics.jsonl"))
            .unwrap()
            .lines()
            .map(|l| {
                let v: serde_json::Value = serde_json::from_str(l).unwrap();
                format!("{}:{}:{}", v["step"], v["loss"], v["grad_norm"])
            })
            .collect()
    };
    assert_eq!(metrics(whole_dir.path()), metrics(chunk_dir.path()));

    // Kept internals need the layers unchunked: with room for them beside chunks only,
    // refused, naming the fix.
    let keep = tempfile::tempdir().unwrap();
    let keep_tight = workspace_bytes(&model, chunked, Precision::Fp32)
        + device_bytes(
            &layout,
            b,
            t,
            1,
            (Activations::Keep, ActivationDtype::Fp32, 0),
        );
    let e = run_as(keep.path(), keep_tight, Activations::Keep)
        .0
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("--activations") && e.contains("unchunked"),
        "{e}"
    );
    // Unchunked, they change no bit either.
    let keep2 = tempfile::tempdir().unwrap();
    run_as(keep2.path(), 256 << 20, Activations::Keep)
        .0
        .unwrap();
    assert_eq!(metrics(whole_dir.path()), metrics(keep2.path()));

    let small = tempfile::tempdir().unwrap();
    let e = run_with(small.path(), tight - 1024)
        .0
        .unwrap_err()
        .to_string();
    assert!(e.contains("layer workspace needs at least"), "{e}");
    assert!(e.contains("--device-memory"), "{e}");
}
