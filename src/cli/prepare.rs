//! `megatrain prepare`: text into a token file for `--data`.

use clap::Args;
use megatrain::Result;
use std::path::PathBuf;

#[derive(Debug, Args)]
#[command(after_help = "Examples:
  megatrain prepare --tokenizer ./Llama-3.2-1B --input corpus.jsonl --out train.bin
  megatrain prepare --format prompt-completion --tokenizer ./Qwen2.5-0.5B --input pairs.jsonl --out sft.bin
  megatrain prepare --format chat --tokenizer ./Qwen2.5-0.5B-Instruct --input chat.jsonl --out sft.bin")]
pub struct PrepareArgs {
    /// A Hugging Face tokenizer.json, or a model directory holding it (with tokenizer_config.json:
    /// special tokens, chat template).
    #[arg(long, value_name = "tokenizer.json|DIR")]
    tokenizer: PathBuf,
    /// Input: .txt (one document) or .jsonl (one sample per line).
    #[arg(long, value_name = "FILE")]
    input: PathBuf,
    /// Output file (text: flat tokens; prompt-completion and chat: a document file with loss
    /// masks).
    #[arg(long, value_name = "FILE")]
    out: PathBuf,
    /// Input format: text (every token trained), prompt-completion ({"prompt", "completion"}:
    /// the loss on the completion and EOS), chat ({"messages": [...]}, rendered with the model's
    /// chat template: the loss on the assistant's messages).
    #[arg(long, value_enum, default_value = "text")]
    format: megatrain::train::prepare::Format,
    /// prompt-completion and chat: train on the response only, or on every token.
    #[arg(long, value_enum, default_value = "response")]
    train_on: megatrain::train::prepare::TrainOn,
    /// chat: a Jinja chat template file instead of the model's.
    #[arg(long, value_name = "FILE")]
    chat_template: Option<PathBuf>,
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
        format: a.format,
        text_key: a.text_key.clone(),
        eos: a.eos.clone(),
        train_on: a.train_on,
        chat_template: a.chat_template.clone(),
        renderer: std::env::current_exe().ok(),
    })?;
    for n in &r.notes {
        eprintln!("note: {n}");
    }
    eprintln!(
        "wrote {} document(s), {} tokens ({} trained; {:?}, vocab {}) to {}; {}{}",
        r.documents,
        r.tokens,
        r.trained,
        r.dtype,
        r.vocab,
        a.out.display(),
        megatrain::train::prepare::skipped_text(&r.skipped),
        r.eos_id
            .map_or(String::new(), |e| format!("; EOS is token {e}"))
    );
    Ok(())
}
