//! The generation goldens as a check any build runs on any device: each `generate_*` case under
//! a goldens folder (a tiny model with its tokenizer, a prompt, and the tokens transformers'
//! greedy `generate` appended, from `tools/golden_generate.py`) is continued by
//! [`crate::train::generate::generate`] in fp32, and its prompt ids and new tokens must equal
//! transformers' exactly (the goldens' margins between the first and second choice are far above
//! fp32 rounding). `megatrain selftest --goldens DIR` runs them after the training goldens
//! (`tests/generate.rs` runs the same cases through the command line).

use super::Check;
use crate::device::Precision;
use crate::train::config::DeviceKind;
use crate::train::generate::{generate, GenerateArgs, ModelSource, Sampling};
use crate::{Error, Result};
use serde_json::Value as Json;
use std::path::{Path, PathBuf};

/// The `generate_*` cases under `root`, in name order (none is fine: older goldens folders).
pub fn cases(root: &Path) -> Result<Vec<PathBuf>> {
    let mut out: Vec<PathBuf> = std::fs::read_dir(root)
        .map_err(|e| Error::io("list goldens", root, e))?
        .flatten()
        .map(|e| e.path())
        .filter(|p| {
            p.file_name()
                .and_then(|n| n.to_str())
                .is_some_and(|n| n.starts_with("generate_"))
                && p.join("expected.json").is_file()
        })
        .collect();
    out.sort();
    Ok(out)
}

struct Quiet;
impl crate::train::Progress for Quiet {}

/// Continue case `case`'s prompt greedily on `device` and compare with transformers' tokens:
/// the check's error is the fraction of positions (prompt and new tokens) that differ.
pub fn run_case(case: &Path, device: DeviceKind) -> Result<Check> {
    let name = case
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    let path = case.join("expected.json");
    let text = std::fs::read_to_string(&path).map_err(|e| Error::io("read", &path, e))?;
    let bad = |why: &str| {
        Error::bad_input(
            "generation golden",
            path.display().to_string(),
            why.to_owned(),
            Some("write it again with tools/golden_generate.py"),
        )
    };
    let want: Json = serde_json::from_str(&text).map_err(|_| bad("is not JSON"))?;
    let ids = |key: &str| -> Result<Vec<u64>> {
        want[key]
            .as_array()
            .and_then(|a| a.iter().map(Json::as_u64).collect())
            .ok_or_else(|| bad(&format!("has no list of ids `{key}`")))
    };
    let (want_prompt, want_tokens) = (ids("prompt_ids")?, ids("tokens")?);
    let args = GenerateArgs {
        source: ModelSource::Hf(case.join("model")),
        tokenizer: None,
        prompt: want["prompt"]
            .as_str()
            .ok_or_else(|| bad("has no `prompt`"))?
            .to_owned(),
        chat: want["chat"].as_bool().unwrap_or(false),
        sampling: Sampling {
            max_new_tokens: want["max_new_tokens"]
                .as_u64()
                .ok_or_else(|| bad("has no `max_new_tokens`"))?
                as usize,
            temperature: 0.0,
            top_k: 0,
            seed: 0,
        },
        device,
        precision: Some(Precision::Fp32),
        device_memory: 2 << 30,
        ram_budget: None,
    };
    let got = generate(&args, &mut Quiet)?;
    let got_prompt: Vec<u64> = got.prompt_ids.iter().map(|&i| u64::from(i)).collect();
    let got_tokens: Vec<u64> = got
        .continuation
        .tokens
        .iter()
        .map(|&i| u64::from(i))
        .collect();
    let differ = |a: &[u64], b: &[u64]| {
        a.iter().zip(b).filter(|(x, y)| x != y).count() + a.len().abs_diff(b.len())
    };
    let wrong = differ(&got_prompt, &want_prompt) + differ(&got_tokens, &want_tokens);
    let n = (want_prompt.len() + want_tokens.len()).max(1);
    Ok(Check {
        name: format!("{name}: greedy tokens vs transformers' generate"),
        max_rel_err: wrong as f64 / n as f64,
        tolerance: 0.0,
        pass: wrong == 0,
    })
}
