//! Memory is the product, in every phase: a ~0.44B-parameter model trained for two steps with
//! validation and a checkpoint, resumed, exported, and trained again from its export — each
//! process's peak resident set (`getrusage`, reported by the run) is the host state the run
//! reports plus a constant (docs/ARCHITECTURE.md, "Memory in every phase"): no phase copies the
//! model (validation streams through the device, export and resume go tensor by tensor).
#![allow(clippy::unwrap_used)]
// The figures each phase measured are printed for the record (`--nocapture`).
#![allow(clippy::print_stderr)]

mod common;

use common::cli::megatrain_ok as megatrain;

/// What any phase may hold beyond the host state, the streamer's buffers and the CPU device's
/// memory: the binary, its threads and allocator, the data loader.
const EXCESS_BYTES: f64 = 256.0 * 1048576.0;

/// 12 layers of hidden 1536 (GQA 12/4 heads, SwiGLU 4096), a 32k vocabulary, untied: 0.44B.
const MODEL: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":1536,"intermediate_size":4096,
  "num_hidden_layers":12,"num_attention_heads":12,"num_key_value_heads":4,"vocab_size":32000,
  "tie_word_embeddings":false,"max_position_embeddings":256}"#;
const VOCAB: usize = 32000;
const HIDDEN: usize = 1536;

/// Bytes from `human_bytes`' "12.3 MiB".
fn bytes_of(text: &str) -> f64 {
    let mut it = text.split_whitespace();
    let (n, unit) = (it.next().unwrap(), it.next().unwrap());
    let k = match unit {
        "B" => 1.0,
        "KiB" => 1024.0,
        "MiB" => 1048576.0,
        "GiB" => 1073741824.0,
        "TiB" => 1099511627776.0,
        u => panic!("unit {u}"),
    };
    n.parse::<f64>().unwrap() * k
}

/// A training run's peak RSS and its excess over what it reports holding.
fn train_memory(err: &str) -> (f64, f64) {
    let line = err
        .lines()
        .find(|l| l.trim_start().starts_with("memory"))
        .unwrap_or_else(|| panic!("no memory line: {err}"));
    let rss = bytes_of(line.split("peak RSS ").nth(1).unwrap());
    let other = bytes_of(line.rsplit(" + ").next().unwrap());
    (rss, other)
}

#[test]
fn every_phase_holds_the_host_state_plus_a_constant() {
    let d = tempfile::tempdir().unwrap();
    let dir = d.path();
    std::fs::write(dir.join("model.json"), MODEL).unwrap();
    let mut s = 7u64;
    let mut tokens = |n: usize| -> Vec<u8> {
        (0..n)
            .flat_map(|_| {
                s ^= s << 13;
                s ^= s >> 7;
                s ^= s << 17;
                ((s % VOCAB as u64) as u16).to_le_bytes()
            })
            .collect()
    };
    std::fs::write(dir.join("train.bin"), tokens(20_000)).unwrap();
    std::fs::write(dir.join("val.bin"), tokens(4_000)).unwrap();
    let rows = ["--seq-len", "32", "--batch-size", "1"];
    // bf16 moments, one checkpoint kept: the disk holds two 3.5 GB checkpoints at most.
    let state = ["--adam-state", "bf16", "--keep-checkpoints", "1"];
    let largest_tensor = (4 * VOCAB * HIDDEN) as f64;
    let check = |what: &str, err: &str, allowance: f64| {
        let (rss, other) = train_memory(err);
        eprintln!(
            "{what}: peak RSS {:.1} MiB, beyond what the run holds {:.1} MiB",
            rss / 1048576.0,
            other / 1048576.0
        );
        assert!(
            other <= EXCESS_BYTES + allowance,
            "{what}: peak RSS {rss:.0} exceeds what the run holds by {other:.0} (allowed {})",
            EXCESS_BYTES + allowance
        );
    };
    // Two steps, each validated, a checkpoint, and an export of the final model (tensor by
    // tensor: the largest, as written, is the export's own).
    let err = megatrain(
        dir,
        &[
            &["train", "--model", "model.json", "--data", "train.bin"][..],
            &[
                "--val-data",
                "val.bin",
                "--val-every",
                "1",
                "--val-batches",
                "2",
            ],
            &[
                "--steps",
                "2",
                "--checkpoint-dir",
                "ck",
                "--export-hf",
                "hf",
            ],
            &rows,
            &state,
        ]
        .concat(),
    );
    check(
        "train, validation, checkpoint, export",
        &err,
        2.0 * largest_tensor,
    );
    // Resume (reading the checkpoint) and a third step.
    let err = megatrain(
        dir,
        &[
            &["train", "--model", "model.json", "--data", "train.bin"][..],
            &["--steps", "3", "--checkpoint-dir", "ck", "--resume"],
            &rows,
            &state,
        ]
        .concat(),
    );
    check("resume", &err, 0.0);
    // Export from the checkpoint: no store at all, a tensor at a time.
    let err = megatrain(dir, &["export", "--checkpoint", "ck", "--out", "hf2"]);
    let rss = bytes_of(
        err.split("(peak RSS ")
            .nth(1)
            .unwrap()
            .trim_end_matches([')', '\n']),
    );
    eprintln!("export: peak RSS {:.1} MiB", rss / 1048576.0);
    assert!(
        rss <= EXCESS_BYTES + largest_tensor,
        "export: peak RSS {rss:.0} for {} bytes of weights",
        4 * 440_000_000u64
    );
    // Training from the export (safetensors mapped one file at a time).
    let err = megatrain(
        dir,
        &[
            &[
                "train",
                "--init-from",
                "hf2",
                "--data",
                "train.bin",
                "--steps",
                "1",
            ][..],
            &rows,
            &state,
        ]
        .concat(),
    );
    check("init-from", &err, 0.0);
}
