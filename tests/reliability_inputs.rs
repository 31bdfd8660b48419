//! Nothing lost, part two: outputs that would clobber inputs, writes that would replace what the
//! user pointed at, tokenizer settings and file names that would train on something other than
//! the data, and the errors that must say what, why and the fix — each through the real binary
//! (docs/RELIABILITY.md lists them).
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

use common::cli::{fixture, last_line, run, s, small_rows};
use std::os::unix::fs::FileTypeExt;
use std::path::Path;
use std::process::Command;

fn megatrain() -> Command {
    common::megatrain()
}

/// `megatrain prepare --tokenizer T --input I --out O`.
fn prepare(tokenizer: &Path, input: &Path, out: &Path) -> Command {
    let mut c = megatrain();
    c.arg("prepare")
        .arg("--tokenizer")
        .arg(tokenizer)
        .arg("--input")
        .arg(input)
        .arg("--out")
        .arg(out);
    c
}

fn digest(p: &Path) -> Vec<u8> {
    std::fs::read(p).unwrap()
}

/// Every output is compared with every input and output before anything is written: the same
/// file by any name, or inside what another output replaces or prunes, is refused by name and
/// nothing is touched.
#[test]
fn an_output_naming_an_input_or_another_output_is_refused_and_nothing_is_touched() {
    let f = fixture();
    let val = f.path("val.bin");
    std::fs::copy(&f.data, &val).unwrap();
    let hard = f.path("hard.bin");
    std::fs::hard_link(&f.data, &hard).unwrap();
    let link = f.path("link.bin");
    std::os::unix::fs::symlink(&f.data, &link).unwrap();
    let export = f.path("hf");
    let svg = f.path("curve.svg");
    let ck = f.path("ck");
    // A run to resume: one checkpoint in `ck`.
    let (rc, err) = run(f.train(&["--steps", "2", "--checkpoint-dir", s(&ck)]));
    assert_eq!(rc, 0, "{err}");
    let step = std::fs::read_dir(&ck)
        .unwrap()
        .flatten()
        .find(|e| e.file_name().to_string_lossy().starts_with("step-"))
        .unwrap()
        .path();
    let state = step.join("state.json");
    let before: Vec<(std::path::PathBuf, Vec<u8>)> = [&f.data, &val, &f.model, &state]
        .iter()
        .map(|p| (p.to_path_buf(), digest(p)))
        .collect();
    let in_export = format!("{}/m.jsonl", s(&export));
    let here = f.dir.path().join(".");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (vec!["--metrics", s(&f.data)], "--data"),
        (vec!["--metrics", s(&hard)], "--data"),
        (vec!["--metrics", s(&link)], "--data"),
        (
            vec!["--val-data", s(&val), "--trace", s(&val)],
            "--val-data",
        ),
        (vec!["--metrics", s(&f.model)], "--model"),
        (
            vec![
                "--resume",
                "--checkpoint-dir",
                s(&ck),
                "--metrics",
                s(&state),
            ],
            "lies inside",
        ),
        (vec!["--metrics", s(&svg)], "loss curve"),
        (
            vec!["--export-hf", s(&export), "--metrics", &in_export],
            "lies inside",
        ),
        (vec!["--export-hf", s(&here)], "lies inside"),
        (
            vec!["--checkpoint-dir", s(&export), "--export-hf", s(&export)],
            "same",
        ),
    ];
    for (extra, needle) in cases {
        let mut args = vec!["--steps", "2"];
        args.extend(extra.iter().copied());
        let (rc, err) = run(f.train(&args));
        assert_eq!(rc, 2, "{extra:?}: {err}");
        let line = last_line(&err);
        assert!(
            line.starts_with("error: ") && line.contains(needle),
            "{extra:?}: {err}"
        );
        assert!(!err.contains("training "), "refused before training: {err}");
        for (p, bytes) in &before {
            assert_eq!(&digest(p), bytes, "{extra:?} changed {}", p.display());
        }
        assert!(!export.exists() && !svg.exists());
    }
    // export --out where the checkpoint directory's run would prune it, or take its name.
    for out in [ck.join("step-00000099"), step.join("hf")] {
        let mut c = megatrain();
        c.args(["export", "--checkpoint", s(&ck), "--out", s(&out)]);
        let (rc, err) = run(c);
        assert_eq!(rc, 2, "{err}");
        assert!(last_line(&err).contains("lies inside"), "{err}");
        assert!(!out.exists());
    }
    // prepare --out naming its input.
    let text = f.path("doc.txt");
    std::fs::write(&text, "hello world").unwrap();
    let tok = f.path("tokenizer.json");
    std::fs::write(&tok, TOKENIZER).unwrap();
    let (rc, err) = run(prepare(&tok, &text, &text));
    assert_eq!(rc, 2, "{err}");
    assert!(last_line(&err).contains("--input"), "{err}");
    assert_eq!(std::fs::read_to_string(&text).unwrap(), "hello world");
}

/// A fresh run replaces an existing metrics file, loss curve or trace only when megatrain wrote
/// it; anything else is refused by name (and a run's own outputs are replaced as before).
#[test]
fn a_run_never_overwrites_a_file_it_did_not_write() {
    let f = fixture();
    for (flag, name, mine, what) in [
        (
            "--metrics",
            "notes.jsonl",
            "my notes, not metrics\n",
            "metrics log",
        ),
        ("--trace", "t.json", "{\"mine\": 1}", "trace"),
    ] {
        let p = f.path(name);
        std::fs::write(&p, mine).unwrap();
        let (rc, err) = run(f.train(&["--steps", "1", flag, s(&p)]));
        assert_eq!(rc, 2, "{err}");
        assert!(
            last_line(&err).contains(&format!("not a {what} megatrain wrote")),
            "{err}"
        );
        assert_eq!(std::fs::read_to_string(&p).unwrap(), mine);
    }
    // Our own outputs: replaced by the next run.
    let own = f.path("own.jsonl");
    let own_trace = f.path("own-trace.json");
    for _ in 0..2 {
        let (rc, err) = run(f.train(&[
            "--steps",
            "1",
            "--metrics",
            s(&own),
            "--trace",
            s(&own_trace),
        ]));
        assert_eq!(rc, 0, "{err}");
    }
    assert_eq!(std::fs::read_to_string(&own).unwrap().lines().count(), 1);
}

/// Outputs that are device nodes, FIFOs or symlinks are written through, never replaced.
#[test]
fn prepare_and_probe_write_through_devices_and_symlinks() {
    let f = fixture();
    let text = f.path("doc.txt");
    std::fs::write(&text, "hello world hello").unwrap();
    let tok = f.path("tokenizer.json");
    std::fs::write(&tok, TOKENIZER).unwrap();
    let to = |out: &Path| run(prepare(&tok, &text, out));
    let (rc, err) = to(Path::new("/dev/null"));
    assert_eq!(rc, 0, "{err}");
    assert!(std::fs::metadata("/dev/null")
        .unwrap()
        .file_type()
        .is_char_device());
    let (rc, err) = to(Path::new("/dev/full"));
    assert_eq!(rc, 1, "{err}");
    assert!(last_line(&err).contains("/dev/full"), "{err}");
    assert!(std::fs::metadata("/dev/full")
        .unwrap()
        .file_type()
        .is_char_device());
    // /dev/stdout on a pipe: the tokens come through it (not a rename in /proc).
    let o = prepare(&tok, &text, Path::new("/dev/stdout"))
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(o.stdout.len(), 8);
    // Metrics to a pipe: lines arrive, no loss curve is attempted beside it, nothing hangs.
    let o = f
        .train(&["--steps", "2", "--metrics", "/dev/stdout"])
        .output()
        .unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(String::from_utf8_lossy(&o.stdout).lines().count(), 2);
    // A symlink is written through: the link stays, its target gets the tokens.
    let target = f.path("target.bin");
    let link = f.path("out-link.bin");
    std::os::unix::fs::symlink(&target, &link).unwrap();
    let (rc, err) = to(&link);
    assert_eq!(rc, 0, "{err}");
    assert!(std::fs::symlink_metadata(&link)
        .unwrap()
        .file_type()
        .is_symlink());
    assert_eq!(std::fs::metadata(&target).unwrap().len(), 8); // 3 words + EOS, u16
    let (rc, err) = run({
        let mut c = megatrain();
        c.args([
            "probe",
            "--synthetic",
            "pack:1 core:2 pu:1",
            "--export-xml",
            "/dev/full",
        ]);
        c
    });
    assert_ne!(rc, 0, "{err}");
    assert!(std::fs::metadata("/dev/full")
        .unwrap()
        .file_type()
        .is_char_device());
}

/// A real (if tiny) Hugging Face tokenizer.json: word-level, EOS `</s>`.
const TOKENIZER: &str = r#"{"version":"1.0","truncation":null,"padding":null,
  "added_tokens":[{"id":0,"content":"<unk>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true},
                  {"id":1,"content":"</s>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}],
  "normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
  "model":{"type":"WordLevel","vocab":{"<unk>":0,"</s>":1,"hello":2,"world":3,"foo":4},"unk_token":"<unk>"}}"#;

fn ids(p: &Path) -> Vec<u16> {
    std::fs::read(p)
        .unwrap()
        .chunks(2)
        .map(|c| u16::from_le_bytes([c[0], c[1]]))
        .collect()
}

/// `prepare` runs in a directory `d` with `tokenizer` (and `config`, a tokenizer_config.json).
fn prepare_in(
    d: &Path,
    tokenizer: &str,
    config: Option<&str>,
    input: &str,
    name: &str,
    extra: &[&str],
) -> (i32, String, Vec<u16>) {
    std::fs::write(d.join("tokenizer.json"), tokenizer).unwrap();
    match config {
        Some(c) => std::fs::write(d.join("tokenizer_config.json"), c).unwrap(),
        None => {
            let _ = std::fs::remove_file(d.join("tokenizer_config.json"));
        }
    }
    let inp = d.join(name);
    std::fs::write(&inp, input).unwrap();
    let out = d.join("out.bin");
    let _ = std::fs::remove_file(&out);
    let mut c = prepare(d, &inp, &out);
    c.args(extra);
    let (rc, err) = run(c);
    let got = if out.exists() { ids(&out) } else { Vec::new() };
    (rc, err, got)
}

/// The truncation and padding stored in tokenizer.json are not applied (transformers ignores
/// them unless asked); the user is told.
#[test]
fn tokenizer_truncation_and_padding_never_cut_or_pad_documents() {
    let d = tempfile::tempdir().unwrap();
    let tk = TOKENIZER
        .replace(
            "\"truncation\":null",
            "\"truncation\":{\"direction\":\"Right\",\"max_length\":2,\"strategy\":\"LongestFirst\",\"stride\":0}",
        )
        .replace(
            "\"padding\":null",
            "\"padding\":{\"strategy\":{\"Fixed\":8},\"direction\":\"Right\",\"pad_to_multiple_of\":null,\"pad_id\":4,\"pad_type_id\":0,\"pad_token\":\"foo\"}",
        );
    let (rc, err, got) = prepare_in(
        d.path(),
        &tk,
        None,
        "hello world hello world hello",
        "a.txt",
        &[],
    );
    assert_eq!(rc, 0, "{err}");
    assert_eq!(got, vec![2, 3, 2, 3, 2, 1], "{err}");
    assert!(
        err.contains("truncation (max_length 2) is not applied")
            && err.contains("padding is not applied"),
        "{err}"
    );
}

/// JSON Lines is recognised by content whatever the name (`.json` from `Dataset.to_json()`,
/// `.JSONL`, no extension, a pipe), and the reading used is said; plain text stays one document.
#[test]
fn json_lines_are_read_as_records_whatever_the_file_is_called() {
    let d = tempfile::tempdir().unwrap();
    let jsonl = "{\"text\":\"hello world\"}\n{\"text\":\"foo\"}\n";
    for name in ["data.json", "DATA.JSONL", "data", "data.txt"] {
        let (rc, err, got) = prepare_in(d.path(), TOKENIZER, None, jsonl, name, &[]);
        assert_eq!(rc, 0, "{name}: {err}");
        assert_eq!(got, vec![2, 3, 1, 4, 1], "{name}: {err}");
        assert!(err.contains("read as JSON Lines"), "{name}: {err}");
    }
    // A JSON array of records (`.json` written with lines=False).
    let (rc, err, got) = prepare_in(
        d.path(),
        TOKENIZER,
        None,
        "[{\"text\":\"foo\"},{\"text\":\"hello\"}]",
        "arr.json",
        &[],
    );
    assert_eq!((rc, got), (0, vec![4, 1, 2, 1]), "{err}");
    // Text that is not JSON on every line stays plain text.
    let (rc, err, got) = prepare_in(
        d.path(),
        TOKENIZER,
        None,
        "{\"text\":\"hello\"}\nworld\n",
        "mixed.txt",
        &[],
    );
    assert_eq!(rc, 0, "{err}");
    assert!(err.contains("read as plain text"), "{err}");
    assert!(got.len() > 3, "{got:?}");
    // A .jsonl line that is not JSON is named.
    let (rc, err, _) = prepare_in(
        d.path(),
        TOKENIZER,
        None,
        "{\"text\":\"a\"}\nnot json\n",
        "bad.jsonl",
        &[],
    );
    assert_eq!(rc, 2, "{err}");
    assert!(last_line(&err).contains("bad.jsonl:2"), "{err}");
    // From a pipe.
    std::fs::write(d.path().join("tokenizer.json"), TOKENIZER).unwrap();
    let out = d.path().join("piped.bin");
    let mut c = prepare(d.path(), Path::new("/dev/stdin"), &out);
    c.stdin(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped());
    let mut child = c.spawn().unwrap();
    {
        use std::io::Write;
        child
            .stdin
            .take()
            .unwrap()
            .write_all(jsonl.as_bytes())
            .unwrap();
    }
    let o = child.wait_with_output().unwrap();
    assert!(o.status.success(), "{}", String::from_utf8_lossy(&o.stderr));
    assert_eq!(ids(&out), vec![2, 3, 1, 4, 1]);
}

/// No EOS token: documents would run together, so it is refused unless --eos names one; a
/// malformed special token in tokenizer_config.json is an error naming it, not "absent".
#[test]
fn documents_never_run_together_without_an_eos_token() {
    let d = tempfile::tempdir().unwrap();
    let no_eos = TOKENIZER.replace("\"</s>\"", "\"<sep>\"");
    let two = "{\"text\":\"hello\"}\n{\"text\":\"world\"}\n";
    let (rc, err, _) = prepare_in(d.path(), &no_eos, None, two, "a.jsonl", &[]);
    assert_eq!(rc, 2, "{err}");
    assert!(
        last_line(&err).contains("no EOS token") && last_line(&err).contains("--eos"),
        "{err}"
    );
    let (rc, err, got) = prepare_in(d.path(), &no_eos, None, two, "a.jsonl", &["--eos", "<sep>"]);
    assert_eq!((rc, got), (0, vec![2, 1, 3, 1]), "{err}");
    for config in [
        r#"{"eos_token": 7}"#,
        r#"{"eos_token": {"id": 1}}"#,
        "[1, 2]",
    ] {
        let (rc, err, _) = prepare_in(d.path(), TOKENIZER, Some(config), two, "a.jsonl", &[]);
        assert_eq!(rc, 2, "{config}: {err}");
        assert!(
            last_line(&err).contains("tokenizer_config.json"),
            "{config}: {err}"
        );
    }
}

/// Inputs that are compressed, not UTF-8, start with a byte-order mark or hold nothing: each
/// named, with the line where it matters.
#[test]
fn odd_input_files_are_named_not_tokenized_as_garbage() {
    let d = tempfile::tempdir().unwrap();
    let gz = [0x1fu8, 0x8b, 8, 0, 0, 0, 0, 0];
    std::fs::write(d.path().join("tokenizer.json"), TOKENIZER).unwrap();
    let inp = d.path().join("c.jsonl.gz");
    std::fs::write(&inp, gz).unwrap();
    let (rc, err) = run(prepare(d.path(), &inp, &d.path().join("o.bin")));
    assert_eq!(rc, 2, "{err}");
    assert!(
        last_line(&err).contains("gzip-compressed") && last_line(&err).contains("gunzip"),
        "{err}"
    );
    let (rc, err, _) = prepare_in(d.path(), TOKENIZER, None, "hello\nwor\u{0}ld", "x.txt", &[]);
    assert_eq!(rc, 0, "{err}");
    // Invalid UTF-8 on line 3.
    std::fs::write(d.path().join("bad.txt"), b"hello\nworld\nfoo \xff bar\n").unwrap();
    let bad = d.path().join("bad.txt");
    let (rc, err) = run(prepare(d.path(), &bad, &d.path().join("o.bin")));
    assert_eq!(rc, 2, "{err}");
    assert!(
        last_line(&err).contains("bad.txt:3") && last_line(&err).contains("UTF-8"),
        "{err}"
    );
    let (rc, err, got) = prepare_in(
        d.path(),
        TOKENIZER,
        None,
        "\u{feff}hello world",
        "bom.txt",
        &[],
    );
    assert_eq!((rc, got), (0, vec![2, 3, 1]), "{err}");
    assert!(err.contains("byte-order mark"), "{err}");
    let (rc, err, _) = prepare_in(d.path(), TOKENIZER, None, "", "empty.jsonl", &[]);
    assert_eq!(rc, 2, "{err}");
    assert!(last_line(&err).contains("no text to train on"), "{err}");
}

/// Non-finite weights in --init-from are named by tensor before training, not reported later as
/// a diverged loss.
#[test]
fn non_finite_init_weights_are_named_by_tensor() {
    let f = fixture();
    let ck = f.path("ck");
    let good = f.path("hf");
    let (rc, err) = run(f.train(&[
        "--steps",
        "1",
        "--checkpoint-dir",
        s(&ck),
        "--export-hf",
        s(&good),
    ]));
    assert_eq!(rc, 0, "{err}");
    let st = std::fs::read_dir(&good)
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.extension().is_some_and(|e| e == "safetensors"))
        .unwrap();
    let mut bytes = std::fs::read(&st).unwrap();
    let header_len = u64::from_le_bytes(bytes[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&bytes[8..8 + header_len]).unwrap();
    let name = "model.layers.1.mlp.down_proj.weight";
    let start = header[name]["data_offsets"][0].as_u64().unwrap() as usize + 8 + header_len;
    bytes[start + 40..start + 44].copy_from_slice(&f32::NAN.to_le_bytes());
    std::fs::write(&st, bytes).unwrap();
    let mut c = megatrain();
    c.args(["train", "--init-from", s(&good), "--data", s(&f.data)])
        .args(small_rows("64Mi"))
        .args(["--steps", "1"]);
    let (rc, err) = run(c);
    assert_eq!(rc, 2, "{err}");
    assert!(
        last_line(&err).contains(name) && last_line(&err).contains("non-finite"),
        "{err}"
    );
}

/// --steps below the resumed checkpoint's step is an error naming both; equal to it trains
/// nothing and says so.
#[test]
fn resume_with_steps_below_the_checkpoint_is_an_error() {
    let f = fixture();
    let ck = f.path("ck");
    let (rc, err) = run(f.train(&["--steps", "4", "--checkpoint-dir", s(&ck)]));
    assert_eq!(rc, 0, "{err}");
    let (rc, err) = run(f.train(&["--steps", "2", "--checkpoint-dir", s(&ck), "--resume"]));
    assert_eq!(rc, 2, "{err}");
    assert!(
        last_line(&err).contains("--steps") && last_line(&err).contains("already past"),
        "{err}"
    );
    let (rc, err) = run(f.train(&["--steps", "4", "--checkpoint-dir", s(&ck), "--resume"]));
    assert_eq!(rc, 0, "{err}");
    assert!(err.contains("nothing left to train"), "{err}");
}

/// Data errors advise what works: documents longer than every row, data on a pipe, ids beyond
/// the vocabulary that are the other element type, a device budget its buffers exceed, an
/// export of a checkpoint path that does not exist.
#[test]
fn data_and_budget_errors_advise_what_works() {
    let f = fixture();
    // u16 tokens read as u32: ids beyond the vocabulary, which read as u16 are valid.
    let (rc, err) = run(f.train(&["--steps", "1", "--data-dtype", "u32"]));
    assert_eq!(rc, 2, "{err}");
    assert!(last_line(&err).contains("pass --data-dtype u16"), "{err}");
    let fifo = f.path("fifo");
    let c = std::ffi::CString::new(s(&fifo)).unwrap();
    // SAFETY: a NUL-terminated path.
    assert_eq!(unsafe { libc::mkfifo(c.as_ptr(), 0o600) }, 0);
    let mut c = megatrain();
    c.args([
        "train",
        "--model",
        s(&f.model),
        "--data",
        s(&fifo),
        "--steps",
        "1",
    ]);
    let (rc, err) = run(c);
    assert_eq!(rc, 2, "{err}");
    assert!(last_line(&err).contains("not a regular file"), "{err}");
    let small = |extra: &[&str]| {
        let mut c = megatrain();
        c.args([
            "train",
            "--model",
            s(&f.model),
            "--data",
            s(&f.data),
            "--steps",
            "1",
        ])
        .args(small_rows("8Ki"))
        .args(extra);
        run(c)
    };
    let (rc, err) = small(&[]);
    assert_eq!(rc, 2, "{err}");
    assert!(
        last_line(&err).contains("raise --device-memory above"),
        "{err}"
    );
    let (rc, err) = small(&["--activations", "keep"]);
    assert_eq!(rc, 2, "{err}");
    assert!(last_line(&err).contains("drop --activations keep"), "{err}");
    let mut c = megatrain();
    c.args([
        "export",
        "--checkpoint",
        s(&f.path("nope")),
        "--out",
        s(&f.path("o")),
    ]);
    let (rc, err) = run(c);
    assert_eq!(rc, 2, "{err}");
    assert!(last_line(&err).contains("does not exist"), "{err}");
}
