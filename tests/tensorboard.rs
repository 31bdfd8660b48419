//! `megatrain train --tensorboard DIR`, read back by the `tensorboard` Python package's own
//! reader (`EventAccumulator`, what `tensorboard --logdir` serves): the scalars of every step, the
//! configuration as text, and a resume replacing the steps logged after its checkpoint.
#![allow(clippy::unwrap_used)]

mod common;

use common::cli::{fixture, s};
use std::process::Command;

/// The `tensorboard` package's python (tools/setup-tensorboard.sh makes its venv once).
fn tensorboard_python() -> String {
    let out = Command::new("bash")
        .arg(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/tools/setup-tensorboard.sh"
        ))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tools/setup-tensorboard.sh failed (it needs the PyPI registry once): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout).unwrap().trim().to_owned()
}

/// What TensorBoard's reader finds in `dir`: every scalar tag's (step, value) list, and the
/// texts of the `config` tag.
const READER: &str = r#"
import json, sys
from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
acc = EventAccumulator(sys.argv[1], size_guidance={"scalars": 0, "tensors": 0})
acc.Reload()
tags = acc.Tags()
out = {"scalars": {t: [[e.step, e.value] for e in acc.Scalars(t)] for t in tags["scalars"]},
       "config": [e.tensor_proto.string_val[0].decode() for e in acc.Tensors("config/text_summary")]}
print(json.dumps(out))
"#;

fn read_events(python: &str, dir: &std::path::Path) -> serde_json::Value {
    let out = Command::new(python)
        .args(["-c", READER, s(dir)])
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    serde_json::from_slice(&out.stdout).unwrap()
}

fn metrics(path: &std::path::Path) -> Vec<serde_json::Value> {
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

fn steps(v: &serde_json::Value, tag: &str) -> Vec<u64> {
    v["scalars"][tag]
        .as_array()
        .unwrap_or_else(|| panic!("no {tag}: {v}"))
        .iter()
        .map(|e| e[0].as_u64().unwrap())
        .collect()
}

#[test]
fn tensorboard_reads_every_step_and_a_resume_replaces_the_steps_after_its_checkpoint() {
    let python = tensorboard_python();
    let f = fixture();
    let (tb, ck, m) = (f.path("tb"), f.path("ck"), f.path("metrics.jsonl"));
    let args = |steps: &'static str| -> Vec<String> {
        [
            "--steps",
            steps,
            "--val-data",
            s(&f.data),
            "--val-every",
            "1",
            "--val-batches",
            "1",
            "--checkpoint-dir",
            s(&ck),
            "--checkpoint-every",
            "2",
            "--tensorboard",
            s(&tb),
            "--metrics",
            s(&m),
        ]
        .map(str::to_owned)
        .to_vec()
    };
    let out = f.train(&[]).args(args("3")).output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(err.contains(&format!("tensorboard {}", s(&tb))), "{err}");
    let first = read_events(&python, &tb);
    assert_eq!(steps(&first, "train/loss"), [1, 2, 3]);
    assert_eq!(steps(&first, "eval/loss"), [1, 2, 3]);
    // The scalars are the metrics' values (as f32).
    let lines = metrics(&m);
    for (tag, key) in [
        ("train/loss", "loss"),
        ("eval/loss", "val_loss"),
        ("train/grad_norm", "grad_norm"),
        ("train/learning_rate", "lr"),
        ("throughput/tokens_per_s", "tokens_per_s"),
        ("time/step_s", "wall_s"),
    ] {
        for (e, line) in first["scalars"][tag].as_array().unwrap().iter().zip(&lines) {
            let (got, want) = (e[1].as_f64().unwrap(), line[key].as_f64().unwrap());
            assert!(
                (got - want).abs() <= 1e-6 * want.abs(),
                "{tag} step {}: {got} vs {want}",
                e[0]
            );
        }
    }
    assert!(
        first["scalars"]["throughput/model_tflops"][0][1]
            .as_f64()
            .unwrap()
            > 0.0
    );
    // The CPU device has no datasheet peak: no MFU, in either log.
    assert!(first["scalars"].get("throughput/mfu").is_none());
    assert!(lines[0]["mfu"].is_null());
    let config = first["config"].as_array().unwrap();
    assert_eq!(config.len(), 1);
    let text = config[0].as_str().unwrap();
    assert!(text.contains("resolved configuration"), "{text}");
    assert!(text.contains("    tensorboard"), "{text}");

    // The run dies after its checkpoint at step 2 (the one at step 3 is gone): the resumed run
    // logs steps 3 and 4 again in a file of its own, and TensorBoard shows each step once, the
    // resumed run's.
    std::fs::remove_dir_all(ck.join("step-00000003")).unwrap();
    let before: Vec<_> = std::fs::read_dir(&tb).unwrap().collect();
    let mut resume = args("4");
    resume.push("--resume".into());
    let out = f.train(&[]).args(resume).output().unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert_eq!(std::fs::read_dir(&tb).unwrap().count(), before.len() + 1);
    let resumed = read_events(&python, &tb);
    assert_eq!(steps(&resumed, "train/loss"), [1, 2, 3, 4]);
    assert_eq!(steps(&resumed, "eval/loss"), [1, 2, 3, 4]);
    assert_eq!(resumed["config"].as_array().unwrap().len(), 2);
    let lines = metrics(&m);
    let losses: Vec<f64> = resumed["scalars"]["train/loss"]
        .as_array()
        .unwrap()
        .iter()
        .map(|e| e[1].as_f64().unwrap())
        .collect();
    for (got, line) in losses.iter().zip(&lines) {
        let want = line["loss"].as_f64().unwrap();
        assert!((got - want).abs() <= 1e-6 * want, "{got} vs {want}");
    }
}

#[test]
fn a_tensorboard_path_that_is_a_file_is_refused_before_training() {
    let f = fixture();
    let file = f.path("tb");
    std::fs::write(&file, b"notes").unwrap();
    let out = f
        .train(&["--steps", "1", "--tensorboard", s(&file)])
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(2), "{err}");
    assert!(err.contains("must name a directory"), "{err}");
    assert_eq!(std::fs::read(&file).unwrap(), b"notes");
}
