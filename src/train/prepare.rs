//! `megatrain prepare`: tokenize text with a Hugging Face `tokenizer.json` (the `tokenizers`
//! crate) into the flat token file `megatrain train --data` reads. Plain text is one document;
//! JSON Lines give one document per line (`text_key`); documents are separated by the EOS token.

use super::config::DataDtype;
use crate::{Error, Result};
use std::path::{Path, PathBuf};

/// What to prepare.
#[derive(Debug, Clone)]
pub struct PrepareArgs {
    /// `tokenizer.json`.
    pub tokenizer: PathBuf,
    /// Input `.txt` or `.jsonl`.
    pub input: PathBuf,
    /// Output token file.
    pub out: PathBuf,
    /// Element type (default: u16 when the vocabulary fits, else u32).
    pub dtype: Option<DataDtype>,
    /// JSON Lines field holding the text.
    pub text_key: String,
    /// EOS token (default: the first of `<|endoftext|>`, `</s>`, `<|end_of_text|>`, `<eos>` the
    /// tokenizer knows); documents are followed by it.
    pub eos: Option<String>,
}

/// What was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrepareReport {
    /// Documents tokenized.
    pub documents: usize,
    /// Tokens written.
    pub tokens: usize,
    /// Element type used.
    pub dtype: DataDtype,
    /// Tokenizer vocabulary (with added tokens).
    pub vocab: usize,
    /// EOS id appended after each document, if any.
    pub eos_id: Option<u32>,
}

/// Tokenize `args.input` into `args.out`.
pub fn prepare(args: &PrepareArgs) -> Result<PrepareReport> {
    let tk = tokenizers::Tokenizer::from_file(&args.tokenizer).map_err(|e| {
        Error::bad_input(
            "tokenizer",
            args.tokenizer.display().to_string(),
            format!("cannot load: {e}"),
            Some("pass a Hugging Face tokenizer.json"),
        )
    })?;
    let vocab = tk.get_vocab_size(true);
    // The dtype must hold the largest id the tokenizer can emit, which can exceed its vocabulary
    // count (ids need not be contiguous).
    let max_id = tk
        .get_vocab(true)
        .values()
        .copied()
        .chain(tk.get_added_tokens_decoder().keys().copied())
        .max()
        .unwrap_or(0);
    let fits_u16 = max_id <= u32::from(u16::MAX);
    let dtype = match args.dtype {
        Some(DataDtype::U16) if !fits_u16 => {
            return Err(Error::bad_input(
                "--dtype",
                "u16",
                format!("the tokenizer emits ids up to {max_id}, more than u16 holds (65535)"),
                Some("use --dtype u32, or leave --dtype unset"),
            ))
        }
        Some(d) => d,
        None if fits_u16 => DataDtype::U16,
        None => DataDtype::U32,
    };
    let eos_id = match &args.eos {
        Some(t) => Some(tk.token_to_id(t).ok_or_else(|| {
            Error::bad_input("--eos", t, "is not a token of this tokenizer", None)
        })?),
        None => ["<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"]
            .iter()
            .find_map(|t| tk.token_to_id(t)),
    };
    let text = std::fs::read_to_string(&args.input)
        .map_err(|e| Error::io("read input", &args.input, e))?;
    let docs: Vec<String> = if args.input.extension().and_then(|e| e.to_str()) == Some("jsonl") {
        text.lines()
            .enumerate()
            .filter(|(_, l)| !l.trim().is_empty())
            .map(|(i, l)| {
                let v: serde_json::Value = serde_json::from_str(l).map_err(|e| {
                    Error::bad_input(
                        "input",
                        format!("{}:{}", args.input.display(), i + 1),
                        format!("not JSON: {e}"),
                        None,
                    )
                })?;
                v.get(&args.text_key)
                    .and_then(|t| t.as_str())
                    .map(str::to_owned)
                    .ok_or_else(|| {
                        Error::bad_input(
                            "input",
                            format!("{}:{}", args.input.display(), i + 1),
                            format!("has no string field `{}`", args.text_key),
                            Some("set --text-key"),
                        )
                    })
            })
            .collect::<Result<_>>()?
    } else {
        vec![text]
    };
    let mut ids: Vec<u32> = Vec::new();
    for d in &docs {
        let enc = tk
            .encode(d.as_str(), false)
            .map_err(|e| Error::system("tokenizers", "encode", e))?;
        ids.extend_from_slice(enc.get_ids());
        ids.extend(eos_id);
    }
    let bytes: Vec<u8> = match dtype {
        DataDtype::U16 => {
            let mut out = Vec::with_capacity(ids.len() * 2);
            for &i in &ids {
                let narrow = u16::try_from(i).map_err(|_| {
                    Error::bad_input(
                        "--dtype",
                        "u16",
                        format!("the tokenizer produced id {i}, more than u16 holds"),
                        Some("use --dtype u32"),
                    )
                })?;
                out.extend_from_slice(&narrow.to_le_bytes());
            }
            out
        }
        DataDtype::U32 => ids.iter().flat_map(|&i| i.to_le_bytes()).collect(),
    };
    write_out(&args.out, &bytes)?;
    Ok(PrepareReport {
        documents: docs.len(),
        tokens: ids.len(),
        dtype,
        vocab,
        eos_id,
    })
}

fn write_out(out: &Path, bytes: &[u8]) -> Result<()> {
    if let Some(d) = out.parent().filter(|d| !d.as_os_str().is_empty()) {
        std::fs::create_dir_all(d).map_err(|e| Error::io("create directory", d, e))?;
    }
    crate::util::write_atomic(out, bytes)
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A real (if tiny) Hugging Face tokenizer.json: word-level with whitespace splitting.
    pub(crate) const TOKENIZER: &str = r#"{"version":"1.0","truncation":null,"padding":null,
      "added_tokens":[{"id":0,"content":"<unk>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true},
                      {"id":1,"content":"</s>","single_word":false,"lstrip":false,"rstrip":false,"normalized":false,"special":true}],
      "normalizer":null,"pre_tokenizer":{"type":"Whitespace"},"post_processor":null,"decoder":null,
      "model":{"type":"WordLevel","vocab":{"<unk>":0,"</s>":1,"hello":2,"world":3,"foo":4},"unk_token":"<unk>"}}"#;

    #[test]
    fn jsonl_and_text_are_tokenized_with_eos() {
        let d = tempfile::tempdir().unwrap();
        let tk = d.path().join("tokenizer.json");
        std::fs::write(&tk, TOKENIZER).unwrap();
        let input = d.path().join("in.jsonl");
        std::fs::write(
            &input,
            "{\"text\":\"hello world\"}\n\n{\"text\":\"foo bar hello\"}\n",
        )
        .unwrap();
        let out = d.path().join("out/tokens.bin");
        let a = PrepareArgs {
            tokenizer: tk.clone(),
            input,
            out: out.clone(),
            dtype: None,
            text_key: "text".into(),
            eos: None,
        };
        let r = prepare(&a).unwrap();
        assert_eq!(
            (r.documents, r.tokens, r.dtype, r.eos_id),
            (2, 7, DataDtype::U16, Some(1))
        );
        let ids: Vec<u16> = std::fs::read(&out)
            .unwrap()
            .chunks(2)
            .map(|c| u16::from_le_bytes([c[0], c[1]]))
            .collect();
        assert_eq!(ids, vec![2, 3, 1, 4, 0, 2, 1]);
        let bad = d.path().join("bad.jsonl");
        std::fs::write(&bad, "{\"body\":\"x\"}\n").unwrap();
        let e = prepare(&PrepareArgs {
            input: bad,
            ..a.clone()
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("bad.jsonl:1") && e.contains("`text`"), "{e}");
        let e = prepare(&PrepareArgs {
            tokenizer: d.path().join("nope.json"),
            ..a
        })
        .unwrap_err()
        .to_string();
        assert!(e.contains("nope.json"), "{e}");
    }
}
