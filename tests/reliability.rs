//! Nothing is lost, nothing crashes: one regression test per way a user could lose work or see
//! a crash (docs/RELIABILITY.md lists them), through the real `megatrain` binary and real
//! processes, files, locks and signals.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

use common::cli::{fixture, kill, last_line, run, s, steps_in_metrics, wait_for, MODEL};
use megatrain::train::checkpoint;
use std::path::Path;
use std::process::Stdio;
use std::time::{Duration, Instant};

/// Issue item 1: A second run on a directory in use is refused at once, naming the holder's PID and host.
#[test]
fn a_second_run_on_a_checkpoint_directory_in_use_is_refused_naming_the_holder() {
    let f = fixture();
    let ck = f.path("ck");
    let first = f
        .train(&["--steps", "1000000", "--checkpoint-dir", s(&ck)])
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let lock = ck.join(megatrain::util::lock::LOCK_FILE);
    wait_for(|| std::fs::read_to_string(&lock).is_ok_and(|t| t.contains("host")));
    let t0 = Instant::now();
    let (rc, err) = run(f.train(&[
        "--steps",
        "3",
        "--checkpoint-dir",
        s(&ck),
        "--resume",
        "auto",
    ]));
    let pid = first.id();
    kill(first);
    assert_eq!(rc, 2, "{err}");
    assert!(t0.elapsed() < Duration::from_secs(30), "refused at once");
    let line = last_line(&err);
    assert!(
        line.contains("is in use by megatrain")
            && line.contains(&format!("PID {pid}"))
            && line.contains(&megatrain::util::lock::hostname()),
        "{err}"
    );
}

/// Issue item 1: A fresh run into a directory holding checkpoints is refused; pruning never deletes another
/// run's checkpoints.
#[test]
fn a_run_never_mixes_with_or_prunes_another_runs_checkpoints() {
    let f = fixture();
    let (a, b) = (f.path("a"), f.path("b"));
    let (rc, err) = run(f.train(&[
        "--steps",
        "3",
        "--checkpoint-dir",
        s(&a),
        "--checkpoint-every",
        "1",
    ]));
    assert_eq!(rc, 0, "{err}");
    let (rc, err) = run(f.train(&["--steps", "3", "--checkpoint-dir", s(&a)]));
    assert_eq!(rc, 2);
    assert!(
        last_line(&err).contains("already holds") && last_line(&err).contains("--resume"),
        "{err}"
    );
    // Run B writes steps 1..=5 (keeping 2); run A's three checkpoints are moved beside them.
    let (rc, err) = run(f.train(&[
        "--steps",
        "5",
        "--checkpoint-dir",
        s(&b),
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "2",
    ]));
    assert_eq!(rc, 0, "{err}");
    // Run A's checkpoints (steps 1..=3) moved beside run B's (4 and 5).
    for e in std::fs::read_dir(&a).unwrap().flatten() {
        let name = e.file_name();
        if name.to_string_lossy().starts_with("step-") {
            std::fs::rename(e.path(), b.join(name)).unwrap();
        }
    }
    assert_eq!(checkpoint::list(&b).unwrap().len(), 5);
    let (rc, err) = run(f.train(&[
        "--steps",
        "8",
        "--checkpoint-dir",
        s(&b),
        "--checkpoint-every",
        "1",
        "--keep-checkpoints",
        "2",
        "--resume",
    ]));
    assert_eq!(rc, 0, "{err}");
    let run_ids: Vec<(u64, Option<String>)> = checkpoint::list(&b)
        .unwrap()
        .into_iter()
        .map(|(step, d)| (step, checkpoint::read_state(&d).unwrap().run_id))
        .collect();
    let mut ids: Vec<&Option<String>> = run_ids.iter().map(|(_, id)| id).collect();
    ids.sort();
    ids.dedup();
    assert_eq!(ids.len(), 2, "both runs' checkpoints remain: {run_ids:?}");
    let newest = run_ids.iter().max_by_key(|(s, _)| *s).unwrap();
    let mine = run_ids.iter().filter(|(_, id)| *id == newest.1).count();
    assert_eq!(mine, 2, "the resumed run keeps 2 of its own: {run_ids:?}");
}

/// Issue item 2: `--resume` means resume; `--resume auto` starts fresh when there is nothing.
#[test]
fn resume_on_a_missing_or_empty_directory_is_an_error_and_auto_starts_fresh() {
    let f = fixture();
    let missing = f.path("no-such-dir");
    let (rc, err) = run(f.train(&["--steps", "2", "--checkpoint-dir", s(&missing), "--resume"]));
    assert_eq!(rc, 2);
    assert!(
        last_line(&err).contains("no-such-dir") && last_line(&err).contains("--resume auto"),
        "{err}"
    );
    assert!(!missing.exists(), "a mistyped directory is not created");
    let empty = f.path("empty");
    std::fs::create_dir(&empty).unwrap();
    let (rc, err) = run(f.train(&["--steps", "2", "--checkpoint-dir", s(&empty), "--resume"]));
    assert_eq!(rc, 2);
    assert!(last_line(&err).contains("no checkpoint"), "{err}");
    let (rc, err) = run(f.train(&[
        "--steps",
        "2",
        "--checkpoint-dir",
        s(&empty),
        "--resume",
        "auto",
    ]));
    assert_eq!(rc, 0, "{err}");
    assert!(err.contains("starting fresh"), "{err}");
    let (rc, err) = run(f.train(&[
        "--steps",
        "4",
        "--checkpoint-dir",
        s(&empty),
        "--resume",
        "auto",
    ]));
    assert_eq!(rc, 0, "{err}");
    assert!(err.contains("resumed from"), "{err}");
}

/// Issue item 2: Resuming keeps the metrics history: lines up to the checkpoint stay, the later ones
/// (steps that run again) go, no step appears twice, and the plot covers the whole run.
#[test]
fn resume_keeps_every_earlier_metrics_line_without_duplicates() {
    let f = fixture();
    let (ck, metrics) = (f.path("ck"), f.path("m/metrics.jsonl"));
    let args = [
        "--checkpoint-dir",
        s(&ck),
        "--metrics",
        s(&metrics),
        "--checkpoint-every",
        "2",
    ];
    let (rc, err) = run(f.train(&[&["--steps", "5"][..], &args].concat()));
    assert_eq!(rc, 0, "{err}");
    assert_eq!(steps_in_metrics(&metrics), vec![1, 2, 3, 4, 5]);
    // The run "died" after step 5 but before its last checkpoint: only step 4's survives.
    std::fs::remove_dir_all(ck.join("step-00000005")).unwrap();
    let (rc, err) = run(f.train(&[&["--steps", "7", "--resume"][..], &args].concat()));
    assert_eq!(rc, 0, "{err}");
    assert!(err.contains("dropped 1 line"), "{err}");
    assert_eq!(steps_in_metrics(&metrics), vec![1, 2, 3, 4, 5, 6, 7]);
    let svg = std::fs::read_to_string(metrics.with_extension("svg")).unwrap();
    assert!(svg.contains("<svg"), "the plot is written");
}

/// Issue item 2: `--demo` writes to a fixed directory and can be resumed.
#[test]
fn the_demo_is_resumable() {
    let d = tempfile::tempdir().unwrap();
    let demo = |extra: &[&str]| {
        let mut c = common::megatrain();
        c.args([
            "train",
            "--demo",
            "--demo-dir",
            s(d.path()),
            "--val-every",
            "0",
            "--device-memory",
            "256Mi",
        ])
        .args(extra);
        run(c)
    };
    let (rc, err) = demo(&["--steps", "2"]);
    assert_eq!(rc, 0, "{err}");
    let (rc, err) = demo(&["--steps", "3"]);
    assert_eq!(rc, 2, "a second fresh demo would mix with the first: {err}");
    let (rc, err) = demo(&["--steps", "3", "--resume"]);
    assert_eq!(rc, 0, "{err}");
    assert!(
        err.contains("resumed from") && err.contains("step 2"),
        "{err}"
    );
    assert!(d.path().join("demo/checkpoints/step-00000003").is_dir());
}

/// Issue item 3: Resume checks the model (differing fields named) and reports changed settings, which
/// the checkpoint records.
#[test]
fn resume_refuses_another_model_and_records_changed_settings() {
    let f = fixture();
    let ck = f.path("ck");
    let (rc, err) = run(f.train(&["--steps", "2", "--checkpoint-dir", s(&ck)]));
    assert_eq!(rc, 0, "{err}");
    let other = f.path("other.json");
    std::fs::write(
        &other,
        MODEL.replace("\"intermediate_size\":72", "\"intermediate_size\":80"),
    )
    .unwrap();
    let mut c = common::megatrain();
    c.args([
        "train",
        "--model",
        s(&other),
        "--data",
        s(&f.data),
        "--seq-len",
        "16",
    ])
    .args([
        "--batch-size",
        "2",
        "--steps",
        "3",
        "--checkpoint-dir",
        s(&ck),
        "--resume",
    ]);
    let (rc, err) = run(c);
    assert_eq!(rc, 2, "{err}");
    assert!(
        last_line(&err).contains("intermediate_size 72 → 80"),
        "{err}"
    );
    let (rc, err) = run(f.train(&[
        "--steps",
        "4",
        "--checkpoint-dir",
        s(&ck),
        "--resume",
        "--lr",
        "1e-4",
    ]));
    assert_eq!(rc, 0, "{err}");
    assert!(
        err.contains("changed on resume: lr 0.0003 → 0.0001, steps 2 → 4"),
        "{err}"
    );
    let st = checkpoint::read_state(&ck.join("step-00000004")).unwrap();
    let keys: Vec<&str> = st.changes.iter().map(|c| c.key.as_str()).collect();
    assert_eq!(keys, vec!["lr", "steps"]);
    assert_eq!(
        (st.changes[0].step, st.changes[0].to.as_str()),
        (2, "0.0001")
    );
}

/// Issue item 4: Every output is checked before step 1: nothing trains, nothing is written.
#[test]
fn unusable_outputs_are_refused_before_training() {
    let f = fixture();
    let export = f.path("export");
    std::fs::create_dir(&export).unwrap();
    std::fs::write(export.join("notes.txt"), "mine").unwrap();
    let trace_dir = f.path("trace-dir");
    std::fs::create_dir(&trace_dir).unwrap();
    let metrics = f.path("metrics.jsonl");
    // A model whose one checkpoint (12 B/param) is larger than any disk: 1.4e13 parameters.
    let huge = f.path("huge.json");
    std::fs::write(
        &huge,
        MODEL
            .replace("\"hidden_size\":32", "\"hidden_size\":65536")
            .replace("\"intermediate_size\":72", "\"intermediate_size\":262144")
            .replace("\"num_hidden_layers\":2", "\"num_hidden_layers\":200")
            .replace("\"num_attention_heads\":4", "\"num_attention_heads\":512"),
    )
    .unwrap();
    let ck = f.path("ck");
    let cases: Vec<(Vec<&str>, &str)> = vec![
        (
            vec!["--model", s(&huge), "--checkpoint-dir", s(&ck)],
            "one checkpoint needs",
        ),
        (vec!["--export-hf", s(&export)], "not an export of this run"),
        (vec!["--trace", s(&trace_dir)], "is a directory"),
        (
            vec!["--checkpoint-dir", "/proc/megatrain-ckpt"],
            "/proc/megatrain-ckpt",
        ),
        (
            vec!["--metrics", "/proc/megatrain/metrics.jsonl"],
            "/proc/megatrain",
        ),
    ];
    for (extra, needle) in cases {
        let mut args = vec!["--steps", "2", "--metrics", s(&metrics)];
        if extra[0] == "--metrics" {
            args.clear();
            args.extend(["--steps", "2"]);
        }
        args.extend(extra.iter().copied());
        let cmd = if extra[0] == "--model" {
            let mut c = common::megatrain();
            c.args(["train", "--data", s(&f.data)]).args(&args);
            c
        } else {
            f.train(&args)
        };
        let (rc, err) = run(cmd);
        assert_eq!(rc, 2, "{extra:?}: {err}");
        assert!(
            last_line(&err).starts_with("error: ") && last_line(&err).contains(needle),
            "{extra:?}: {err}"
        );
        assert!(!err.contains("training "), "refused before training: {err}");
        assert!(!metrics.exists(), "nothing written: {extra:?}");
    }
    assert_eq!(
        std::fs::read_to_string(export.join("notes.txt")).unwrap(),
        "mine"
    );
}

/// Issue item 4: A path that is not UTF-8 is refused up front, by its setting.
#[test]
fn non_utf8_paths_are_refused_by_name() {
    use std::os::unix::ffi::OsStrExt;
    let f = fixture();
    let bad = f.dir.path().join(std::ffi::OsStr::from_bytes(b"ck-\xff"));
    let mut c = f.train(&["--steps", "2"]);
    c.arg("--checkpoint-dir").arg(&bad);
    let (rc, err) = run(c);
    assert_eq!(rc, 2, "{err}");
    assert!(
        last_line(&err).contains("checkpoint_dir") && last_line(&err).contains("UTF-8"),
        "{err}"
    );
}

/// Issue item 4: A metrics write that fails (a full disk: /dev/full answers ENOSPC) is a warning.
#[test]
fn a_failing_metrics_write_is_a_warning_not_the_end_of_the_run() {
    let f = fixture();
    let ck = f.path("ck");
    let (rc, err) = run(f.train(&[
        "--steps",
        "3",
        "--metrics",
        "/dev/full",
        "--checkpoint-dir",
        s(&ck),
    ]));
    assert_eq!(rc, 0, "{err}");
    assert!(
        err.contains("warning: writing metrics to /dev/full failed"),
        "{err}"
    );
    assert!(
        err.contains("3 metrics line(s) could not be written"),
        "{err}"
    );
    assert!(ck.join("step-00000003").is_dir());
}

/// Issue item 4: A late failure (the export hits ENOSPC) without a checkpoint directory: the trained state
/// is saved to a named rescue checkpoint first, which resumes and exports.
#[test]
fn a_late_failure_saves_the_trained_state_first_and_names_it() {
    let f = fixture();
    let out = f.path("hf");
    let mut c = f.train(&["--steps", "3", "--export-hf", s(&out)]);
    c.env(megatrain::util::failpoint::ENV, "export=ENOSPC");
    let (rc, err) = run(c);
    assert_ne!(rc, 0);
    let line = last_line(&err);
    assert!(
        line.contains("No space left") && line.contains("megatrain-rescue-"),
        "{err}"
    );
    let rescue = std::fs::read_dir(f.dir.path())
        .unwrap()
        .flatten()
        .map(|e| e.path())
        .find(|p| p.to_string_lossy().contains("megatrain-rescue-"))
        .expect("a rescue directory");
    let saved = rescue.join("step-00000003");
    checkpoint::verify(&saved).unwrap();
    assert!(!out.exists(), "no half-written export");
    // The rescue is a checkpoint directory like any other: it exports.
    let mut e = common::megatrain();
    e.args(["export", "--checkpoint", s(&rescue), "--out", s(&out)]);
    let (rc, err) = run(e);
    assert_eq!(rc, 0, "{err}");
    assert!(out.join("config.json").exists());
}

/// Issue item 4: A checkpoint write that fails mid-run (a transient ENOSPC) stops the run only after the
/// state is saved again, and the error names where. The failed write (step 2's) ran beside step
/// 3, so step 3's state is what is saved; nothing of the failed one is left.
#[test]
fn a_failing_checkpoint_write_rescues_the_state() {
    let f = fixture();
    let ck = f.path("ck");
    let mut c = f.train(&[
        "--steps",
        "3",
        "--checkpoint-dir",
        s(&ck),
        "--checkpoint-every",
        "2",
    ]);
    // The first checkpoint write fails once.
    c.env(megatrain::util::failpoint::ENV, "checkpoint=ENOSPC:1");
    let (rc, err) = run(c);
    assert_ne!(rc, 0);
    let line = last_line(&err);
    assert!(
        line.contains("No space left")
            && line.contains("step-00000002")
            && line.contains("the trained state of step 3 is safe in"),
        "{err}"
    );
    checkpoint::verify(&ck.join("step-00000003")).unwrap();
    let left: Vec<_> = std::fs::read_dir(&ck)
        .unwrap()
        .flatten()
        .map(|e| e.file_name().to_string_lossy().into_owned())
        .filter(|n| n != megatrain::util::lock::LOCK_FILE)
        .collect();
    assert_eq!(
        left,
        ["step-00000003"],
        "nothing of the failed write is left"
    );
}

/// Issue item 5: `prepare` picks the dtype from the largest id the tokenizer can emit.
#[test]
fn prepare_never_truncates_token_ids() {
    let d = tempfile::tempdir().unwrap();
    let tk = d.path().join("tokenizer.json");
    std::fs::write(
        &tk,
        r#"{"version":"1.0","truncation":null,"padding":null,
      "added_tokens":[{"id":0,"content":"<unk>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}],
      "normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
      "model":{"type":"WordLevel","vocab":{"<unk>":0,"hello":70000,"world":3},"unk_token":"<unk>"}}"#,
    )
    .unwrap();
    let input = d.path().join("in.txt");
    std::fs::write(&input, "hello world hello").unwrap();
    let out = d.path().join("out.bin");
    let prep = |extra: &[&str]| {
        let mut c = common::megatrain();
        c.args([
            "prepare",
            "--tokenizer",
            s(&tk),
            "--input",
            s(&input),
            "--out",
            s(&out),
        ])
        .args(extra);
        run(c)
    };
    let (rc, err) = prep(&[]);
    assert_eq!(rc, 0, "{err}");
    let ids: Vec<u32> = std::fs::read(&out)
        .unwrap()
        .chunks(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect();
    assert_eq!(
        ids,
        vec![70000, 3, 70000],
        "u32 chosen for an id over 65535"
    );
    let (rc, err) = prep(&["--dtype", "u16"]);
    assert_eq!(rc, 2);
    assert!(last_line(&err).contains("70000"), "{err}");
}

/// Issue item 6: Two runs on one NVMe directory at once: each its own locked file, both finish with the
/// result of a run alone, and both delete their files on exit.
#[test]
fn two_runs_share_an_nvme_directory_without_touching_each_others_files() {
    let f = fixture();
    let nvme = f.path("nvme");
    let alone = f.path("alone");
    let base = |ck: &Path| {
        f.train(&[
            "--steps",
            "4",
            "--nvme",
            s(&nvme),
            "--spill",
            "all",
            "--checkpoint-dir",
            s(ck),
        ])
    };
    let (rc, err) = run(base(&alone));
    assert_eq!(rc, 0, "{err}");
    let note = err
        .lines()
        .find(|l| l.contains("spill files:"))
        .unwrap_or_default()
        .to_owned();
    assert!(note.contains("on disk"), "{err}");
    let (a, b) = (f.path("a"), f.path("b"));
    let ca = base(&a).stderr(Stdio::piped()).spawn().unwrap();
    let cb = base(&b).stderr(Stdio::piped()).spawn().unwrap();
    let (oa, ob) = (
        ca.wait_with_output().unwrap(),
        cb.wait_with_output().unwrap(),
    );
    assert!(
        oa.status.success(),
        "{}",
        String::from_utf8_lossy(&oa.stderr)
    );
    assert!(
        ob.status.success(),
        "{}",
        String::from_utf8_lossy(&ob.stderr)
    );
    for ck in [&a, &b] {
        for file in ["params.f32", "adam_m.f32", "adam_v.f32"] {
            assert!(
                std::fs::read(alone.join("step-00000004").join(file)).unwrap()
                    == std::fs::read(ck.join("step-00000004").join(file)).unwrap(),
                "{file}"
            );
        }
    }
    assert_eq!(
        std::fs::read_dir(&nvme).unwrap().count(),
        0,
        "spill files deleted on exit"
    );
}

/// Issue item 7, 8: Hostile sizes and counts are clean errors, quickly, with no allocation first.
#[test]
fn hostile_sizes_and_counts_are_clean_errors() {
    let f = fixture();
    let cases: &[(&str, &str, &str)] = &[
        ("vocab_size", "18446744073709551615", "`vocab_size`"),
        (
            "intermediate_size",
            "9223372036854775807",
            "`intermediate_size`",
        ),
        ("hidden_size", "4611686018427387904", "`hidden_size`"),
        ("head_dim", "4611686018427387904", "`head_dim`"),
        ("vocab_size", "9223372036854775808", "`vocab_size`"),
        ("head_dim", "0", "`head_dim`"),
        ("hidden_size", "1000000000000", "`hidden_size`"),
        ("rms_norm_eps", "-1", "`rms_norm_eps`"),
    ];
    for (key, value, needle) in cases {
        let path = f.path(&format!("{key}-{value}.json"));
        let mut v: serde_json::Value = serde_json::from_str(MODEL).unwrap();
        v[*key] = serde_json::from_str(value).unwrap();
        std::fs::write(&path, v.to_string()).unwrap();
        let mut c = common::megatrain();
        c.args([
            "train",
            "--model",
            s(&path),
            "--data",
            s(&f.data),
            "--steps",
            "1",
        ]);
        let (rc, err) = run(c);
        assert_eq!(rc, 2, "{key}={value}: {err}");
        assert!(
            last_line(&err).starts_with("error: ") && last_line(&err).contains(needle),
            "{err}"
        );
    }
    let t0 = Instant::now();
    let (rc, err) = run(f.train(&["--grad-accum", "1000000000000"]));
    assert_eq!(rc, 2);
    assert!(last_line(&err).contains("grad_accum"), "{err}");
    let mut plan = common::megatrain();
    plan.args([
        "plan",
        "--model",
        "llama-3-8b",
        "--machine",
        "h200-1.5tb",
        "--tokens-per-step",
        "1000000000000",
    ]);
    let (rc, err) = run(plan);
    assert_eq!(rc, 0, "a trillion-token step plans: {err}");
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "no per-micro-batch growth"
    );
}

/// Issue item 9: An XML file that crashes hwloc is an error naming the file, not a segfault.
#[test]
fn a_topology_that_crashes_hwloc_is_an_error() {
    let f = fixture();
    let xml = std::fs::read_to_string(
        Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/topologies/g4dnmetal.xml"),
    )
    .unwrap();
    let re = regex_free_strip(&xml, " complete_nodeset=\"");
    let bad = f.path("no-complete-nodeset.xml");
    std::fs::write(&bad, re).unwrap();
    let mut c = common::megatrain();
    c.args(["probe", "--topology", s(&bad)]);
    let (rc, err) = run(c);
    assert_eq!(rc, 2, "{err}");
    assert!(
        last_line(&err).contains("no-complete-nodeset.xml") && last_line(&err).contains("crashed"),
        "{err}"
    );
}

/// `text` without every attribute starting with `attr` (up to its closing quote).
fn regex_free_strip(text: &str, attr: &str) -> String {
    let mut out = String::new();
    let mut rest = text;
    while let Some(i) = rest.find(attr) {
        out.push_str(&rest[..i]);
        let after = &rest[i + attr.len()..];
        rest = after.find('"').map_or("", |j| &after[j + 1..]);
    }
    out.push_str(rest);
    out
}

/// Issue item 10: A checkpoint's problems are told apart, each with its own fix; `export` verifies before
/// it parses.
#[test]
fn checkpoint_problems_are_told_apart() {
    let f = fixture();
    let ck = f.path("ck");
    let (rc, err) = run(f.train(&["--steps", "1", "--checkpoint-dir", s(&ck)]));
    assert_eq!(rc, 0, "{err}");
    let good = ck.join("step-00000001");
    let copy = |name: &str| {
        let d = f.path(name).join("step-00000001");
        std::fs::create_dir_all(&d).unwrap();
        for e in std::fs::read_dir(&good).unwrap().flatten() {
            std::fs::copy(e.path(), d.join(e.file_name())).unwrap();
        }
        d
    };
    let missing = copy("missing");
    std::fs::remove_file(missing.join("adam_v.f32")).unwrap();
    let truncated = copy("truncated");
    let p = truncated.join("params.f32");
    let len = std::fs::metadata(&p).unwrap().len();
    std::fs::OpenOptions::new()
        .write(true)
        .open(&p)
        .unwrap()
        .set_len(len / 2)
        .unwrap();
    let corrupt = copy("corrupt");
    let mut state = std::fs::read(corrupt.join("state.json")).unwrap();
    state[10] ^= 1;
    std::fs::write(corrupt.join("state.json"), state).unwrap();
    let unreadable = copy("unreadable");
    std::fs::remove_file(unreadable.join("adam_m.f32")).unwrap();
    std::fs::create_dir(unreadable.join("adam_m.f32")).unwrap();
    let incomplete = copy("incomplete");
    let m = std::fs::read_to_string(incomplete.join("MANIFEST.json")).unwrap();
    let mut v: serde_json::Value = serde_json::from_str(&m).unwrap();
    v["files"]
        .as_array_mut()
        .unwrap()
        .retain(|x| x[0] != "adam_v.f32");
    std::fs::write(incomplete.join("MANIFEST.json"), v.to_string()).unwrap();
    for (dir, needle, fix) in [
        (
            &missing,
            "adam_v.f32 is missing",
            "restore the missing file",
        ),
        (&truncated, "params.f32 has", "cut short"),
        (
            &corrupt,
            "state.json fails its crc32c check",
            "bytes changed",
        ),
        (&unreadable, "adam_m.f32 cannot be read", "permissions"),
        (
            &incomplete,
            "does not list adam_v.f32",
            "restore the missing file",
        ),
    ] {
        let mut e = common::megatrain();
        e.args(["export", "--checkpoint", s(dir), "--out", s(&f.path("x"))]);
        let (rc, err) = run(e);
        assert_eq!(rc, 2, "{err}");
        assert!(
            last_line(&err).contains(needle) && last_line(&err).contains(fix),
            "{err}"
        );
    }
}

/// Issue item 13: SIGTERM (SLURM, Kubernetes) finishes the step, checkpoints and exits 143 without an
/// `error:` line; so does SIGHUP (a closed ssh session), exiting 129; Ctrl-C without a checkpoint
/// directory promises nothing and exits 130.
#[test]
fn sigterm_sighup_and_ctrl_c_stop_cleanly_with_the_signal_exit_status() {
    let f = fixture();
    // SIGHUP: the ssh session or terminal closed; handled as SIGTERM.
    for (sig, code, with_dir) in [
        (libc::SIGTERM, 143, true),
        (libc::SIGINT, 130, false),
        (libc::SIGHUP, 129, true),
    ] {
        let ck = f.path(&format!("ck{sig}"));
        let metrics = f.path(&format!("m{sig}.jsonl"));
        let mut args = vec!["--steps", "1000000", "--metrics", s(&metrics)];
        if with_dir {
            args.extend(["--checkpoint-dir", s(&ck)]);
        }
        let child = f.train(&args).stderr(Stdio::piped()).spawn().unwrap();
        wait_for(|| std::fs::read_to_string(&metrics).is_ok_and(|t| t.lines().count() >= 2));
        // SAFETY: signalling our own child process.
        unsafe { libc::kill(child.id() as i32, sig) };
        let out = child.wait_with_output().unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert_eq!(out.status.code(), Some(code), "{err}");
        assert!(!err.contains("error:"), "{err}");
        if with_dir {
            assert!(err.contains("writing a checkpoint"), "{err}");
            let newest = checkpoint::latest(&ck).unwrap().unwrap();
            checkpoint::verify(&newest).unwrap();
        } else {
            assert!(
                err.contains("nothing will be saved") && !err.contains("writing a checkpoint"),
                "{err}"
            );
        }
    }
}

/// bf16 gradients on the link belong to the bf16 recipe: an fp32 run or plan refuses them,
/// naming the setting and the fix, before anything is allocated.
#[test]
fn bf16_gradients_without_the_bf16_recipe_are_refused() {
    let f = fixture();
    let (rc, err) = run(f.train(&["--grad-link", "bf16"]));
    assert_eq!(rc, 2, "{err}");
    assert!(
        last_line(&err).contains("grad_link") && last_line(&err).contains("--precision bf16"),
        "{err}"
    );
    let mut plan = common::megatrain();
    plan.args([
        "plan",
        "--model",
        "llama-3-8b",
        "--machine",
        "h100-512gb",
        "--precision",
        "fp32",
        "--grad-link",
        "bf16",
    ]);
    let (rc, err) = run(plan);
    assert_eq!(rc, 2, "{err}");
    assert!(last_line(&err).contains("--grad-link bf16"), "{err}");
}
