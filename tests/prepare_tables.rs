//! `megatrain prepare` on datasets as users have them: Parquet written by `pyarrow` (several
//! row groups, shards under `data/` as the hub lays them out) and by `datasets`' `to_parquet`,
//! and `datasets`' `save_to_disk` folders (Arrow IPC streams) give byte for byte the files the
//! JSON Lines route gives, for text, prompt-completion and chat; bad files (cut short, a column
//! of the wrong type, nulls, a missing column, a DatasetDict) are errors naming the file, the
//! row group and the column. The writers come from tools/setup-data-venv.sh.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

use std::path::{Path, PathBuf};
use std::process::Command;

fn root() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
}

/// The data venv's python (made once by tools/setup-data-venv.sh).
fn python() -> PathBuf {
    let out = Command::new("bash")
        .arg(root().join("tools/setup-data-venv.sh"))
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "tools/setup-data-venv.sh failed (it needs the PyPI registry once): {}",
        String::from_utf8_lossy(&out.stderr)
    );
    PathBuf::from(String::from_utf8(out.stdout).unwrap().trim())
}

/// Run `script` with the data venv's python, `args` after it.
fn py(script: &str, args: &[&Path]) {
    let out = Command::new(python())
        .arg("-c")
        .arg(script)
        .args(args)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "python failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
}

fn prepare(input: &Path, out: &Path, extra: &[&str]) -> (i32, String) {
    let mut c = common::megatrain();
    c.args(["prepare", "--tokenizer"])
        .arg(root().join("tests/fixtures/chat/gen"))
        .arg("--input")
        .arg(input)
        .arg("--out")
        .arg(out)
        .args(extra);
    common::cli::run(c)
}

fn prepare_ok(input: &Path, out: &Path, extra: &[&str]) -> Vec<u8> {
    let (code, err) = prepare(input, out, extra);
    assert_eq!(code, 0, "{err}");
    std::fs::read(out).unwrap()
}

/// 300 documents of varied text as JSON Lines, and as Parquet in two shards under `data/` of
/// row groups of 64 rows, and one shard with a `large_string` column.
const WRITE_TEXT: &str = r#"
import json, sys, pyarrow as pa, pyarrow.parquet as pq
d = sys.argv[1]
docs = [f"document {i}: " + " ".join(f"w{(i * 7 + j) % 50}" for j in range(i % 23)) + ("\n" if i % 3 else "") for i in range(300)]
with open(f"{d}/docs.jsonl", "w") as f:
    for i, t in enumerate(docs):
        f.write(json.dumps({"id": i, "text": t}) + "\n")
import os
os.makedirs(f"{d}/hub/data")
for k, part in enumerate([docs[:170], docs[170:]]):
    t = pa.table({"id": list(range(len(part))), "text": part})
    pq.write_table(t, f"{d}/hub/data/train-{k:05d}-of-00002.parquet", row_group_size=64)
pq.write_table(pa.table({"text": pa.array(docs, pa.large_string())}), f"{d}/large.parquet", row_group_size=100)
"#;

#[test]
fn parquet_text_equals_json_lines() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    py(WRITE_TEXT, &[d]);
    let want = prepare_ok(&d.join("docs.jsonl"), &d.join("a.bin"), &[]);
    assert!(want.len() > 1000);
    // Progress: every phase's end with MEGATRAIN_PROGRESS=all (here: not a terminal).
    let out = common::megatrain()
        .env("MEGATRAIN_PROGRESS", "all")
        .args(["prepare", "--tokenizer"])
        .arg(root().join("tests/fixtures/chat/gen"))
        .arg("--input")
        .arg(d.join("hub"))
        .arg("--out")
        .arg(d.join("p.bin"))
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.lines()
            .any(|l| l.starts_with("prepare: 300 records in") && l.ends_with("records/s)")),
        "{err}"
    );
    assert_eq!(prepare_ok(&d.join("hub"), &d.join("b.bin"), &[]), want);
    assert_eq!(
        prepare_ok(&d.join("large.parquet"), &d.join("c.bin"), &[]),
        want
    );
    // A hub folder holding two splits is refused naming them; a split is named by its prefix.
    py(
        "import sys, shutil; shutil.copy(sys.argv[1] + '/hub/data/train-00001-of-00002.parquet', sys.argv[1] + '/hub/data/test-00000-of-00001.parquet')",
        &[d],
    );
    let (code, err) = prepare(&d.join("hub"), &d.join("s.bin"), &[]);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("test, train") && err.contains("data/train"),
        "{err}"
    );
    assert_eq!(
        prepare_ok(&d.join("hub/data/train"), &d.join("t.bin"), &[]),
        want
    );
    // A single shard is a file of its own.
    let one = prepare_ok(
        &d.join("hub/data/train-00000-of-00002.parquet"),
        &d.join("d.bin"),
        &[],
    );
    assert!(one.len() < want.len() && want.starts_with(&one));
}

/// The chat fixture and prompt-completion pairs through `datasets`: `to_parquet` and
/// `save_to_disk` (Arrow IPC streams) of `Dataset.from_list` over the JSON Lines' records.
const WRITE_DATASETS: &str = r#"
import json, sys, datasets
src, d = sys.argv[1], sys.argv[2]
rows = [json.loads(l) for l in open(src) if l.strip()]
ds = datasets.Dataset.from_list(rows)
ds.to_parquet(f"{d}/chat.parquet")
ds.save_to_disk(f"{d}/chat_saved", num_shards=2)
pc = [{"prompt": f"Q{i}: what is {i} plus {i}?", "completion": f" {2 * i}."} for i in range(40)]
with open(f"{d}/pc.jsonl", "w") as f:
    for r in pc:
        f.write(json.dumps(r) + "\n")
datasets.Dataset.from_list(pc).save_to_disk(f"{d}/pc_saved")
datasets.DatasetDict({"train": datasets.Dataset.from_list(pc), "test": datasets.Dataset.from_list(pc[:4])}).save_to_disk(f"{d}/dict")
"#;

#[test]
fn datasets_parquet_and_save_to_disk_equal_json_lines() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let chat = root().join("tests/fixtures/chat/conversations.jsonl");
    py(WRITE_DATASETS, &[&chat, d]);
    let fmt = ["--format", "chat"];
    let want = prepare_ok(&chat, &d.join("a.bin"), &fmt);
    assert_eq!(
        prepare_ok(&d.join("chat.parquet"), &d.join("b.bin"), &fmt),
        want
    );
    assert_eq!(
        prepare_ok(&d.join("chat_saved"), &d.join("c.bin"), &fmt),
        want
    );
    let fmt = ["--format", "prompt-completion"];
    let want = prepare_ok(&d.join("pc.jsonl"), &d.join("d.bin"), &fmt);
    assert_eq!(
        prepare_ok(&d.join("pc_saved"), &d.join("e.bin"), &fmt),
        want
    );
    let (code, err) = prepare(&d.join("dict"), &d.join("f.bin"), &fmt);
    assert_eq!(code, 2, "{err}");
    assert!(
        err.contains("DatasetDict") && err.contains("train"),
        "{err}"
    );
}

/// Bad files: each error names what is wrong and where; nothing is written.
const WRITE_BAD: &str = r#"
import sys, pyarrow as pa, pyarrow.parquet as pq
d = sys.argv[1]
pq.write_table(pa.table({"text": ["a b", "c d"] * 100}), f"{d}/good.parquet", row_group_size=50)
data = open(f"{d}/good.parquet", "rb").read()
open(f"{d}/cut.parquet", "wb").write(data[: len(data) // 2])
pq.write_table(pa.table({"text": list(range(100))}), f"{d}/ints.parquet", row_group_size=40)
pq.write_table(pa.table({"text": ["x"] * 60 + [None] + ["y"] * 9}), f"{d}/null.parquet", row_group_size=50)
pq.write_table(pa.table({"body": ["x", "y"]}), f"{d}/other.parquet")
"#;

#[test]
fn bad_tables_are_named_by_file_row_group_and_column() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    py(WRITE_BAD, &[d]);
    let out = d.join("out.bin");
    for (file, needles) in [
        (
            "cut.parquet",
            vec!["cut.parquet", "not a readable Parquet file"],
        ),
        (
            "ints.parquet",
            vec!["ints.parquet, row group 0, column `text`", "Int64"],
        ),
        (
            "null.parquet",
            vec!["null.parquet, row group 1, row 10, column `text`", "null"],
        ),
        ("other.parquet", vec!["no column `text`", "body"]),
    ] {
        let (code, err) = prepare(&d.join(file), &out, &[]);
        assert_eq!(code, 2, "{file}: {err}");
        for n in needles {
            assert!(err.contains(n), "{file}: `{n}` not in {err}");
        }
        assert!(!out.exists(), "{file}: an output was left");
    }
    // The column named by --text-key.
    let (code, err) = prepare(&d.join("other.parquet"), &out, &["--text-key", "body"]);
    assert_eq!(code, 0, "{err}");
}
