//! `megatrain prepare`: text into a token file for `--data`.

use clap::Args;
use megatrain::Result;
use std::path::PathBuf;

#[derive(Debug, Args)]
pub struct PrepareArgs {
    /// A Hugging Face tokenizer.json.
    #[arg(long, value_name = "tokenizer.json")]
    tokenizer: PathBuf,
    /// Input text: .txt (one document) or .jsonl (one document per line).
    #[arg(long, value_name = "FILE")]
    input: PathBuf,
    /// Output token file.
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
    /// Element type (default: u16 when the vocabulary fits).
    #[arg(long, value_enum)]
    dtype: Option<megatrain::train::config::DataDtype>,
    /// JSON Lines field holding the text.
    #[arg(long, default_value = "text")]
    text_key: String,
    /// EOS token appended after each document (default: the tokenizer's own).
    #[arg(long)]
    eos: Option<String>,
}

pub fn run(a: &PrepareArgs) -> Result<()> {
    let r = megatrain::train::prepare::prepare(&megatrain::train::prepare::PrepareArgs {
        tokenizer: a.tokenizer.clone(),
        input: a.input.clone(),
        out: a.out.clone(),
        dtype: a.dtype,
        text_key: a.text_key.clone(),
        eos: a.eos.clone(),
    })?;
    eprintln!(
        "wrote {} tokens ({:?}, vocab {}) from {} document(s) to {}{}",
        r.tokens,
        r.dtype,
        r.vocab,
        r.documents,
        a.out.display(),
        r.eos_id
            .map_or(String::new(), |e| format!("; documents end with token {e}"))
    );
    Ok(())
}
