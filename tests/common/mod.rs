//! Helpers shared by the integration tests: golden files.
#![allow(dead_code, clippy::unwrap_used, clippy::print_stderr)]

pub mod cli;

use std::collections::HashMap;
use std::path::PathBuf;

/// The `megatrain` binary under test as a command, through `MEGATRAIN_TEST_RUNNER` when it is
/// set (tools/test_aarch64.sh sets `qemu-aarch64-static` to run the aarch64 build's tests).
pub fn megatrain() -> std::process::Command {
    let bin = env!("CARGO_BIN_EXE_megatrain");
    match std::env::var_os("MEGATRAIN_TEST_RUNNER") {
        Some(runner) if !runner.is_empty() => {
            let mut c = std::process::Command::new(runner);
            c.arg(bin);
            c
        }
        _ => std::process::Command::new(bin),
    }
}

/// Magic string in every golden file's metadata.
pub const MAGIC: &str = "megatrain-golden";
/// Golden format version this code reads.
pub const VERSION: &str = "1";

/// A golden file: named f32 (or u8, as f32) tensors plus string metadata.
pub struct Golden {
    pub meta: HashMap<String, String>,
    pub tensors: HashMap<String, (Vec<usize>, Vec<f32>)>,
}

impl Golden {
    /// Open `tests/golden/{name}`, checking magic and version.
    pub fn open(name: &str) -> Golden {
        let path = PathBuf::from(env!("CARGO_MANIFEST_DIR"))
            .join("tests/golden")
            .join(name);
        let bytes = std::fs::read(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        let (_, header) = safetensors::SafeTensors::read_metadata(&bytes).unwrap();
        let meta = header.metadata().clone().unwrap_or_default();
        assert_eq!(
            meta.get("magic").map(String::as_str),
            Some(MAGIC),
            "{name}: not a megatrain golden"
        );
        assert_eq!(
            meta.get("version").map(String::as_str),
            Some(VERSION),
            "{name}: golden version"
        );
        let tensors = st
            .tensors()
            .into_iter()
            .map(|(k, v)| {
                // f32 tensors, and u8 ones (int8 Adam codes) as their values.
                let data = match v.dtype() {
                    safetensors::Dtype::F32 => v
                        .data()
                        .chunks_exact(4)
                        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
                        .collect(),
                    safetensors::Dtype::U8 => v.data().iter().map(|b| f32::from(*b)).collect(),
                    other => panic!("{k}: {other:?}"),
                };
                (k, (v.shape().to_vec(), data))
            })
            .collect();
        Golden { meta, tensors }
    }

    /// A tensor's data.
    pub fn get(&self, name: &str) -> &[f32] {
        &self
            .tensors
            .get(name)
            .unwrap_or_else(|| panic!("golden has no `{name}`"))
            .1
    }

    /// A tensor's shape.
    pub fn shape(&self, name: &str) -> &[usize] {
        &self
            .tensors
            .get(name)
            .unwrap_or_else(|| panic!("golden has no `{name}`"))
            .0
    }
}

/// max |a − b| / max(max |b|, floor): one relative error for a whole tensor.
pub fn rel_err(a: &[f32], b: &[f32], floor: f32) -> f32 {
    assert_eq!(a.len(), b.len());
    let scale = b.iter().fold(floor, |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

/// `megatrain` on the CUDA device: directly on a real GPU when `MEGATRAIN_GPU=1`, else through
/// `tools/cuemu.sh` (the CUDA emulator). The same test, either way.
pub fn megatrain_cuda() -> std::process::Command {
    let bin = env!("CARGO_BIN_EXE_megatrain");
    if std::env::var("MEGATRAIN_GPU").is_ok_and(|v| v == "1") {
        std::process::Command::new(bin)
    } else {
        let mut c = std::process::Command::new(
            PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("tools/cuemu.sh"),
        );
        c.arg(bin);
        c
    }
}
