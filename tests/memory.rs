//! Memory is the product, in every phase: a 0.40B-parameter model (fewer layers where the disk
//! cannot hold its checkpoints: see `layers_for_disk`) trained for two steps with
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

/// Up to 12 layers of hidden 1536 (GQA 12/4 heads, SwiGLU 4096), a 32k vocabulary, untied:
/// 0.40B parameters at 12 layers.
fn model(layers: usize) -> String {
    format!(
        r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":1536,"intermediate_size":4096,
  "num_hidden_layers":{layers},"num_attention_heads":12,"num_key_value_heads":4,"vocab_size":32000,
  "tie_word_embeddings":false,"max_position_embeddings":256}}"#
    )
}
const VOCAB: usize = 32000;
const HIDDEN: usize = 1536;
const MAX_LAYERS: usize = 12;
/// Parameters of the embedding and the untied LM head, and of one layer.
const EMBED_PARAMS: u64 = 2 * (VOCAB * HIDDEN) as u64;
const LAYER_PARAMS: u64 = (2 * 1536 * 1536 + 2 * 1536 * 512 + 3 * 1536 * 4096 + 2 * 1536) as u64;
/// Disk bytes per parameter at the test's peak: the resume writes its int8-moment checkpoint
/// (6 bytes per parameter) beside the one it read.
const DISK_BYTES_PER_PARAM: u64 = 12;
/// The token files and the filesystem's slack.
const DISK_MARGIN: u64 = 256 << 20;

/// The most layers (up to 12) whose checkpoints fit the free space of `dir`'s filesystem: CI
/// machines come with anything from tens of GiB free to less than 3 GiB, and RSS beyond the
/// host state is what is measured, a constant whatever the depth. Fails, naming the disk, when
/// not even one layer fits.
fn layers_for_disk(dir: &std::path::Path) -> usize {
    let free = megatrain::util::free_space(dir).unwrap();
    let fits = |layers: usize| {
        (EMBED_PARAMS + layers as u64 * LAYER_PARAMS) * DISK_BYTES_PER_PARAM + DISK_MARGIN <= free
    };
    let layers = (1..=MAX_LAYERS)
        .rev()
        .find(|&l| fits(l))
        .unwrap_or_else(|| {
            panic!(
                "{}: {free} bytes free; the memory test needs {} (one layer)",
                dir.display(),
                (EMBED_PARAMS + LAYER_PARAMS) * DISK_BYTES_PER_PARAM + DISK_MARGIN
            )
        });
    eprintln!(
        "{layers} layers, {:.2}B parameters ({:.1} GiB free at {})",
        (EMBED_PARAMS + layers as u64 * LAYER_PARAMS) as f64 * 1e-9,
        free as f64 / (1u64 << 30) as f64,
        dir.display()
    );
    layers
}

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
    let layers = layers_for_disk(dir);
    std::fs::write(dir.join("model.json"), model(layers)).unwrap();
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
    // int8 moments, one checkpoint kept: the disk holds two checkpoints of 6 bytes per
    // parameter at most (the resume's, written beside the one it read).
    let state = ["--adam-state", "int8", "--keep-checkpoints", "1"];
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
    // Two steps, each validated, a checkpoint, and an export of the final model (streamed in
    // 4 MiB pieces: no tensor is held whole, the embedding's 188 MiB included).
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
    check("train, validation, checkpoint, export", &err, 0.0);
    // Its disk space is the resume's.
    std::fs::remove_dir_all(dir.join("hf")).unwrap();
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
    // Export from the checkpoint: no store at all, 4 MiB at a time.
    let err = megatrain(dir, &["export", "--checkpoint", "ck", "--out", "hf2"]);
    let rss = bytes_of(
        err.split("(peak RSS ")
            .nth(1)
            .unwrap()
            .trim_end_matches([')', '\n']),
    );
    eprintln!("export: peak RSS {:.1} MiB", rss / 1048576.0);
    assert!(
        rss <= EXCESS_BYTES,
        "export: peak RSS {rss:.0} for {} bytes of weights",
        4 * (EMBED_PARAMS + layers as u64 * LAYER_PARAMS)
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
