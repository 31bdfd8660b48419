//! `megatrain generate` against transformers' greedy `generate` (goldens from
//! tools/golden_generate.py: a plain prompt with the tokenizer's BOS, and a chat prompt through
//! the template), on the CPU device and (feature `cuda`) on the CUDA device through the emulator;
//! a checkpoint and its export continue a prompt alike; `--sample-every` samples while training.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

use serde_json::Value as Json;
use std::path::PathBuf;
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

fn tokenizer() -> PathBuf {
    root().join("tests/fixtures/chat/gen")
}

/// Run `c`, which must succeed; its stdout parsed as JSON.
fn json_of(mut c: Command) -> Json {
    let out = c.output().unwrap();
    let (stdout, stderr) = (
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr),
    );
    assert!(out.status.success(), "failed:\n{stdout}\n{stderr}");
    serde_json::from_str(&stdout).unwrap_or_else(|e| panic!("{e}: {stdout}\n{stderr}"))
}

fn ids(v: &Json) -> Vec<u64> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap())
        .collect()
}

/// `generate` of golden `case` with `megatrain` (a command to add arguments to) equals
/// transformers' prompt ids and greedy tokens.
fn check_golden(case: &str, mut c: Command, extra: &[&str]) {
    let dir = root().join("tests/golden").join(format!("generate_{case}"));
    let expected: Json =
        serde_json::from_str(&std::fs::read_to_string(dir.join("expected.json")).unwrap()).unwrap();
    let max_new = expected["max_new_tokens"].as_u64().unwrap().to_string();
    // The model directory holds its tokenizer.
    c.args(["generate", "--model"])
        .arg(dir.join("model"))
        .args(["--prompt", expected["prompt"].as_str().unwrap()])
        .args(["--max-new-tokens", &max_new, "--json"])
        .args(extra);
    if expected["chat"].as_bool().unwrap() {
        c.arg("--chat");
    }
    let got = json_of(c);
    assert_eq!(
        ids(&got["prompt_ids"]),
        ids(&expected["prompt_ids"]),
        "prompt"
    );
    assert_eq!(ids(&got["tokens"]), ids(&expected["tokens"]), "{case}");
    let stop = if got["tokens"].as_array().unwrap().len() < max_new.parse::<usize>().unwrap() {
        "eos"
    } else {
        "max_new_tokens"
    };
    assert_eq!(got["stop"], stop);
}

fn megatrain() -> Command {
    common::megatrain()
}

#[test]
fn greedy_llama_plain_prompt_matches_transformers() {
    check_golden("llama", megatrain(), &[]);
}

#[test]
fn greedy_qwen3_chat_prompt_matches_transformers() {
    check_golden("qwen3", megatrain(), &[]);
}

#[test]
fn sampling_is_seeded_and_errors_name_the_setting() {
    let dir = root().join("tests/golden/generate_llama/model");
    let run = |seed: &str| {
        let mut c = megatrain();
        c.args(["generate", "--model"])
            .arg(&dir)
            .arg("--tokenizer")
            .arg(tokenizer())
            .args(["--prompt", "Hello", "--max-new-tokens", "12", "--json"])
            .args(["--temperature", "1.5", "--top-k", "50", "--seed", seed]);
        ids(&json_of(c)["tokens"])
    };
    assert_eq!(run("1"), run("1"));
    assert_ne!(run("1"), run("2"));
    // A negative temperature; a chat prompt without a template; more tokens than positions.
    for (args, needle) in [
        (vec!["--temperature", "-1"], "--temperature"),
        (vec!["--tokenizer", "bytes", "--chat"], "chat template"),
        (vec!["--max-new-tokens", "400"], "max_position_embeddings"),
    ] {
        let mut c = megatrain();
        c.args(["generate", "--model"])
            .arg(&dir)
            .args(["--prompt", "Hello"]);
        if !args.contains(&"--tokenizer") {
            c.arg("--tokenizer").arg(tokenizer());
        }
        let (code, err) = common::cli::run({
            c.args(&args);
            c
        });
        assert_eq!(code, 2, "{args:?}: {err}");
        assert!(err.contains(needle), "{args:?}: {err}");
    }
}

/// Samples while training: at the steps asked and at the end, in the notes and in TensorBoard's
/// text; then `generate` from the run's checkpoint and from its export give the same tokens.
#[test]
fn samples_while_training_and_a_checkpoint_generates_as_its_export() {
    let tmp = tempfile::tempdir().unwrap();
    let t = tmp.path();
    let out = megatrain()
        .env("MEGATRAIN_PROGRESS", "all")
        .args(["train", "--demo", "--demo-dir"])
        .arg(t)
        .args([
            "--steps",
            "3",
            "--val-every",
            "0",
            "--checkpoint-every",
            "3",
        ])
        .args([
            "--sample-every",
            "2",
            "--sample-prompt",
            "fn main",
            "--sample-tokens",
            "6",
        ])
        .arg("--tensorboard")
        .arg(t.join("tb"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    let samples: Vec<&str> = err
        .lines()
        .filter(|l| l.starts_with("sample at step"))
        .collect();
    assert_eq!(samples.len(), 2, "{err}");
    assert!(
        samples[0].starts_with("sample at step 2: \"fn main"),
        "{err}"
    );
    assert!(
        samples[1].starts_with("sample at step 3: \"fn main"),
        "{err}"
    );
    // The long phases' ends (MEGATRAIN_PROGRESS=all shows even short ones).
    for phase in ["placement: ", "checkpoint write: ", "export: "] {
        assert!(err.lines().any(|l| l.starts_with(phase)), "{phase}: {err}");
    }
    let events = std::fs::read_dir(t.join("tb")).unwrap().next().unwrap();
    let bytes = std::fs::read(events.unwrap().path()).unwrap();
    let has = |needle: &[u8]| bytes.windows(needle.len()).any(|w| w == needle);
    assert!(has(b"samples/text_summary"));
    let run = t.join("demo");
    let from = |source: &[&str]| {
        let mut c = megatrain();
        c.arg("generate")
            .args(source)
            .args(["--tokenizer", "bytes", "--prompt", "fn main", "--json"])
            .args(["--max-new-tokens", "8"]);
        ids(&json_of(c)["tokens"])
    };
    let ckpt = from(&["--checkpoint", run.join("checkpoints").to_str().unwrap()]);
    let export = from(&["--model", run.join("hf").to_str().unwrap()]);
    assert_eq!(ckpt.len(), 8);
    assert_eq!(ckpt, export);
    // The demo's checkpoint names its tokenizer (bytes): no --tokenizer needed.
    let mut c = megatrain();
    c.args(["generate", "--checkpoint"])
        .arg(run.join("checkpoints"))
        .args(["--prompt", "fn main", "--max-new-tokens", "8", "--json"]);
    assert_eq!(ids(&json_of(c)["tokens"]), ckpt);
}

#[cfg(feature = "cuda")]
mod cuda {
    use super::{check_golden, common};

    #[test]
    fn greedy_llama_on_the_cuda_device() {
        let mut c = common::megatrain_cuda();
        c.env("CUEMU_DELAYS", "300");
        check_golden("llama", c, &["--device", "cuda", "--precision", "fp32"]);
    }

    #[test]
    fn greedy_qwen3_chat_on_the_cuda_device() {
        check_golden(
            "qwen3",
            common::megatrain_cuda(),
            &["--device", "cuda", "--precision", "fp32"],
        );
    }
}
