//! A Hugging Face tokenizer as `prepare` and generation use it: `tokenizer.json` through the
//! `tokenizers` crate, with its `tokenizer_config.json` (special tokens, chat template).

use crate::{Error, Result};
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// A tokenizer with its `tokenizer_config.json` (special tokens, chat template), if any.
#[derive(Debug)]
pub struct Tok {
    /// The tokenizer.
    pub tk: tokenizers::Tokenizer,
    /// Its directory (where `tokenizer_config.json` and a chat template are looked for).
    pub dir: PathBuf,
    /// Its `tokenizer_config.json`, when there is one.
    pub config: Option<Json>,
    /// Settings of the tokenizer file not applied.
    pub notes: Vec<String>,
}

impl Tok {
    /// `tokenizer.json` at `path` (the file, or the directory holding it) with the
    /// `tokenizer_config.json` beside it, truncation and padding switched off.
    pub fn load(path: &Path) -> Result<Self> {
        let (file, dir) = if path.is_dir() {
            (path.join("tokenizer.json"), path.to_owned())
        } else {
            let dir = path
                .parent()
                .map_or_else(|| PathBuf::from("."), Path::to_owned);
            (path.to_owned(), dir)
        };
        let mut tk = tokenizers::Tokenizer::from_file(&file).map_err(|e| {
            Error::bad_input(
                "tokenizer",
                file.display().to_string(),
                format!("cannot load: {e}"),
                Some("pass a Hugging Face tokenizer.json, or the model directory holding it"),
            )
        })?;
        // transformers applies neither unless a call asks: a stored truncation would cut every
        // document to `max_length`, a stored padding would train on pad tokens.
        let mut notes = Vec::new();
        if let Some(t) = tk.get_truncation() {
            notes.push(format!(
                "{}: its truncation (max_length {}) is not applied: documents are tokenized whole, as transformers does unless asked",
                file.display(),
                t.max_length
            ));
        }
        if tk.get_padding().is_some() {
            notes.push(format!(
                "{}: its padding is not applied: no pad token is added to any document",
                file.display()
            ));
        }
        tk.with_truncation(None)
            .map_err(|e| Error::system("tokenizers", "disable truncation", e))?;
        tk.with_padding(None);
        let cfg_path = dir.join("tokenizer_config.json");
        let config = match cfg_path.is_file() {
            true => {
                let text = std::fs::read_to_string(&cfg_path)
                    .map_err(|e| Error::io("read tokenizer config", &cfg_path, e))?;
                Some(serde_json::from_str::<Json>(&text).map_err(|e| {
                    Error::bad_input(
                        "tokenizer config",
                        cfg_path.display().to_string(),
                        format!("not JSON: {e}"),
                        None,
                    )
                })?)
            }
            false => None,
        };
        if let Some(c) = &config {
            if !c.is_object() {
                return Err(Error::bad_input(
                    "tokenizer config",
                    cfg_path.display().to_string(),
                    "is JSON but not an object of settings",
                    Some("restore the model's tokenizer_config.json, or remove it"),
                ));
            }
        }
        Ok(Tok {
            tk,
            dir,
            config,
            notes,
        })
    }

    /// The config's special tokens by name (`bos_token`, …): a string or `{"content": …}`
    /// (absent or null: none); anything else is an error naming the setting.
    pub fn specials(&self) -> Result<BTreeMap<String, String>> {
        let mut out = BTreeMap::new();
        for key in ["bos_token", "eos_token", "pad_token", "unk_token"] {
            let Some(v) = self.config.as_ref().and_then(|c| c.get(key)) else {
                continue;
            };
            if v.is_null() {
                continue;
            }
            let s = v
                .as_str()
                .or_else(|| v.get("content").and_then(Json::as_str))
                .ok_or_else(|| {
                    Error::bad_input(
                        "tokenizer config",
                        self.dir.join("tokenizer_config.json").display().to_string(),
                        format!(
                            "`{key}` is {v}, neither a token string nor {{\"content\": token}}"
                        ),
                        Some("fix that setting (or pass --eos TOKEN for the EOS token)"),
                    )
                })?;
            out.insert(key.to_owned(), s.to_owned());
        }
        Ok(out)
    }

    /// The id of `token` (`flag`: the setting that named it).
    pub fn id(&self, token: &str, flag: &str) -> Result<u32> {
        self.tk.token_to_id(token).ok_or_else(|| {
            Error::bad_input(
                "token",
                token,
                format!("is not a token of this tokenizer ({flag})"),
                None,
            )
        })
    }

    /// `text`'s encoding, with the post-processor's special tokens when `special`.
    pub fn encode(&self, text: &str, special: bool) -> Result<tokenizers::Encoding> {
        self.tk
            .encode(text, special)
            .map_err(|e| Error::system("tokenizers", "encode", e))
    }
}
