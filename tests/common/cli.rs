//! A small model and its data, and running the `megatrain` binary on them: shared by the
//! tests that go through the real binary, files and signals.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output};
use std::time::{Duration, Instant};

pub const MODEL: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":32,"intermediate_size":72,
  "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":61,"tie_word_embeddings":true}"#;

/// Rows and device memory of the small runs: 2 sequences of 16 tokens, `device_memory`.
pub fn small_rows(device_memory: &str) -> [&str; 6] {
    [
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--device-memory",
        device_memory,
    ]
}

pub struct Fixture {
    pub dir: tempfile::TempDir,
    pub model: PathBuf,
    pub data: PathBuf,
}

pub fn fixture() -> Fixture {
    let dir = tempfile::tempdir().unwrap();
    let model = dir.path().join("model.json");
    std::fs::write(&model, MODEL).unwrap();
    let data = dir.path().join("train.bin");
    let mut s = 12345u64;
    let bytes: Vec<u8> = (0..20_000)
        .flat_map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s % 61) as u16).to_le_bytes()
        })
        .collect();
    std::fs::write(&data, bytes).unwrap();
    Fixture { dir, model, data }
}

impl Fixture {
    pub fn path(&self, name: &str) -> PathBuf {
        self.dir.path().join(name)
    }

    /// `megatrain train` on the small model with `extra` flags.
    pub fn train(&self, extra: &[&str]) -> Command {
        let mut c = super::megatrain();
        c.current_dir(self.dir.path())
            .args(["train", "--model"])
            .arg(&self.model)
            .arg("--data")
            .arg(&self.data)
            .args(small_rows("64Mi"))
            .args(extra);
        c
    }
}

pub fn run(mut c: Command) -> (i32, String) {
    let out: Output = c.output().unwrap();
    (
        out.status.code().unwrap_or(-1),
        String::from_utf8_lossy(&out.stderr).into_owned(),
    )
}

pub fn last_line(err: &str) -> &str {
    err.lines().last().unwrap_or("")
}

pub fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// Wait for `cond` up to a minute (start-up time varies with the build and the machine's load).
pub fn wait_for(mut cond: impl FnMut() -> bool) {
    let t0 = Instant::now();
    while !cond() {
        assert!(t0.elapsed() < Duration::from_secs(60), "timed out");
        std::thread::sleep(Duration::from_millis(20));
    }
}

pub fn kill(mut child: Child) {
    let _ = child.kill();
    let _ = child.wait();
}

pub fn steps_in_metrics(p: &Path) -> Vec<u64> {
    std::fs::read_to_string(p)
        .unwrap()
        .lines()
        .map(|l| {
            serde_json::from_str::<serde_json::Value>(l).unwrap()["step"]
                .as_u64()
                .unwrap()
        })
        .collect()
}

/// `megatrain ARGS` in `dir`, which must succeed; its stderr.
pub fn megatrain_ok(dir: &Path, args: &[&str]) -> String {
    let out = super::megatrain()
        .current_dir(dir)
        .args(args)
        .output()
        .unwrap();
    let err = String::from_utf8_lossy(&out.stderr).into_owned();
    assert!(out.status.success(), "{args:?}: {err}");
    err
}
