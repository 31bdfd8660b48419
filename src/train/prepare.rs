//! `megatrain prepare`: tokenize a corpus with a Hugging Face tokenizer (the `tokenizers` crate)
//! into what `megatrain train --data` reads.
//!
//! - `text`: plain text is one document, JSON Lines one per line (`text_key`); documents are
//!   followed by the EOS token and written as one flat token stream, every token trained.
//! - `prompt-completion`: JSON Lines `{"prompt": …, "completion": …}` → `ids(prompt) +
//!   ids(completion) + [eos]`, the loss on the completion and the EOS only.
//! - `chat`: JSON Lines `{"messages": [{"role": …, "content": …}, …]}` rendered with the model's
//!   own chat template ([`super::chat`]), the loss on the assistant messages' tokens.
//!
//! The last two write a document file ([`super::documents`]): tokens, loss mask and document
//! boundaries, packed into rows by the trainer.

use super::chat::{check_messages, load_template, ChatError, ChatTemplate};
use super::chat_worker::{ChatWorker, WorkerError};
use super::config::DataDtype;
use super::documents::{self, Document};
use super::input_text::{read_input, Reading};
use super::table_input::TableInput;
use super::tokenizer::Tok;
use crate::util::progress::{Meter, Unit};
use crate::{Error, Result};
use serde_json::Value as Json;
use std::collections::BTreeMap;
use std::path::{Path, PathBuf};

/// The input's format.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Format {
    /// Plain text or JSON Lines of text, every token trained (a flat token file).
    #[default]
    Text,
    /// JSON Lines of `{"prompt", "completion"}`, trained on the completion.
    PromptCompletion,
    /// JSON Lines of `{"messages": […]}`, trained on the assistant's messages.
    Chat,
}

/// Which tokens of a prompt-completion or chat sample train.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum TrainOn {
    /// The completion (and EOS), or the assistant messages.
    #[default]
    Response,
    /// Every token.
    All,
}

/// What to prepare.
#[derive(Debug, Clone)]
pub struct PrepareArgs {
    /// `tokenizer.json`, or a model directory holding it (with `tokenizer_config.json`).
    pub tokenizer: PathBuf,
    /// Input `.txt` or `.jsonl`.
    pub input: PathBuf,
    /// Output file.
    pub out: PathBuf,
    /// Element type (default: u16 when the vocabulary fits, else u32).
    pub dtype: Option<DataDtype>,
    /// Input format.
    pub format: Format,
    /// JSON Lines field holding the text (`text` format).
    pub text_key: String,
    /// EOS token (default: the tokenizer config's `eos_token`, else the first of
    /// `<|endoftext|>`, `</s>`, `<|end_of_text|>`, `<eos>` the tokenizer knows).
    pub eos: Option<String>,
    /// Which tokens train (prompt-completion and chat).
    pub train_on: TrainOn,
    /// A Jinja chat template file overriding the model's.
    pub chat_template: Option<PathBuf>,
    /// Render chat templates in a child process, `PATH __render-chat`, capped in memory (a
    /// megatrain binary: the CLI passes itself); `None`: in this process, bounded by fuel only.
    pub renderer: Option<PathBuf>,
}

/// What was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PrepareReport {
    /// Documents written.
    pub documents: usize,
    /// Tokens written.
    pub tokens: usize,
    /// Trained targets (prompt-completion and chat; every token but the first for text).
    pub trained: usize,
    /// Samples skipped, by reason, with their count.
    pub skipped: BTreeMap<&'static str, usize>,
    /// Element type used.
    pub dtype: DataDtype,
    /// Tokenizer vocabulary (with added tokens).
    pub vocab: usize,
    /// EOS id, if any.
    pub eos_id: Option<u32>,
    /// How the input was read and what of the tokenizer's settings was not applied, for the
    /// user.
    pub notes: Vec<String>,
}

/// Tokenize `args.input` into `args.out`.
pub fn prepare(args: &PrepareArgs) -> Result<PrepareReport> {
    use crate::util::paths::{check_disjoint, PathUse, Use};
    let mut uses = if args.tokenizer.is_dir() {
        crate::util::paths::read_dir_uses("--tokenizer", &args.tokenizer, |n| {
            matches!(
                n,
                "tokenizer.json" | "tokenizer_config.json" | "chat_template.jinja"
            )
        })
    } else {
        vec![PathUse::new("--tokenizer", &args.tokenizer, Use::ReadFile)]
    };
    let input_use = match args.input.is_dir() {
        true => Use::ReadDir,
        false => Use::ReadFile,
    };
    uses.push(PathUse::new("--input", &args.input, input_use));
    uses.push(PathUse::new("--out", &args.out, Use::WriteFile));
    if let Some(t) = &args.chat_template {
        uses.push(PathUse::new("--chat-template", t, Use::ReadFile));
    }
    check_disjoint(&uses)?;
    crate::util::output::target(&args.out)?;
    let tok = Tok::load(&args.tokenizer)?;
    let vocab = tok.tk.get_vocab_size(true);
    let dtype = choose_dtype(&tok.tk, args.dtype)?;
    let specials = tok.specials()?;
    let eos_id = match (&args.eos, specials.get("eos_token")) {
        (Some(t), _) => Some(tok.id(t, "--eos")?),
        (None, Some(t)) => Some(tok.id(t, "tokenizer_config.json eos_token")?),
        (None, None) => ["<|endoftext|>", "</s>", "<|end_of_text|>", "<eos>"]
            .iter()
            .find_map(|t| tok.tk.token_to_id(t)),
    };
    let mut report = PrepareReport {
        documents: 0,
        tokens: 0,
        trained: 0,
        skipped: BTreeMap::new(),
        dtype,
        vocab,
        eos_id,
        notes: tok.notes.clone(),
    };
    let out = Outputs {
        dtype,
        eos_id,
        // Document files pad their rows; a token file has no padding.
        pad_id: match (args.format, specials.get("pad_token")) {
            (Format::Text, _) => 0,
            (_, Some(p)) => tok.id(p, "tokenizer_config.json pad_token")?,
            (_, None) => eos_id.unwrap_or(0),
        },
    };
    if let Some(table) = TableInput::detect(&args.input)? {
        report.notes.push(table.describe());
        return prepare_table(&tok, args, &table, &specials, &out, report);
    }
    let (text, notes) = read_input(&args.input)?;
    report.notes.splice(0..0, notes);
    let reading = Reading::of(&args.input, &text)?;
    report.notes.push(reading.describe(&args.input));
    if args.format == Format::Text {
        let mut w = FlatTokens::create(&args.out, &out)?;
        if reading == Reading::PlainText {
            w.documents(&tok, &[text.as_str()])?;
        } else {
            let meter = records_meter(&text, reading);
            let mut batch: Vec<(String, Json)> = Vec::with_capacity(TOKENIZE_BATCH);
            for record in reading.records(&text, &args.input) {
                batch.push(record?);
                if batch.len() == TOKENIZE_BATCH {
                    w.documents(&tok, &texts_of(&batch, &args.text_key)?)?;
                    meter.add(batch.len() as u64);
                    batch.clear();
                }
            }
            w.documents(&tok, &texts_of(&batch, &args.text_key)?)?;
            meter.add(batch.len() as u64);
            meter.finish();
        }
        w.finish(&args.input, &mut report)?;
        return Ok(report);
    }
    if reading == Reading::PlainText {
        return Err(Error::bad_input(
            "input",
            args.input.display().to_string(),
            format!(
                "--format {} reads JSON Lines (one JSON object per line), and this is plain text",
                format_name(args.format)
            ),
            Some("convert it to JSON Lines, or use --format text"),
        ));
    }
    let largest_line = text.lines().map(str::len).max().unwrap_or(0);
    let mut make = Samples::new(&tok, args, &specials, eos_id, largest_line)?;
    let mut docs = Vec::new();
    let meter = records_meter(&text, reading);
    for record in reading.records(&text, &args.input) {
        let (at, v) = record?;
        add_sample(&mut make, &at, &v, &mut docs, &mut report)?;
        meter.add(1);
    }
    meter.finish();
    write_documents(args, &docs, &out, &mut report)?;
    Ok(report)
}

/// The progress of reading `text`'s records (as many as JSON Lines has lines; unknown for an
/// array).
fn records_meter(text: &str, reading: Reading) -> Meter {
    let total = match reading {
        Reading::JsonLines => text.lines().filter(|l| !l.trim().is_empty()).count() as u64,
        _ => 0,
    };
    Meter::start("prepare", total, Unit::Records)
}

/// Documents tokenized at once (in parallel, by the tokenizer's own thread pool).
const TOKENIZE_BATCH: usize = 1024;

/// What the output files take from the tokenizer.
struct Outputs {
    dtype: DataDtype,
    eos_id: Option<u32>,
    pad_id: u32,
}

/// The `text_key` strings of JSON records (each with its location), or an error naming the
/// record without one.
fn texts_of<'r>(records: &'r [(String, Json)], key: &str) -> Result<Vec<&'r str>> {
    records
        .iter()
        .map(|(at, v)| {
            v.get(key).and_then(Json::as_str).ok_or_else(|| {
                Error::bad_input(
                    "input",
                    at,
                    format!("has no string field `{key}`"),
                    Some("set --text-key"),
                )
            })
        })
        .collect()
}

/// One JSON sample (`at`: where) made a document, or counted as skipped.
fn add_sample(
    make: &mut Samples<'_>,
    at: &str,
    v: &Json,
    docs: &mut Vec<Document>,
    report: &mut PrepareReport,
) -> Result<()> {
    let doc = make.document(v).map_err(|e| match e {
        SampleError::Bad(why) => Error::bad_input("input", at, why, None),
        SampleError::Other(e) => e,
    })?;
    match doc {
        Sample::Train(d) => {
            report.documents += 1;
            report.tokens += d.tokens.len();
            report.trained += d.trained();
            docs.push(d);
        }
        Sample::Skip(reason) => *report.skipped.entry(reason).or_default() += 1,
    }
    Ok(())
}

/// The document file of `docs` (refused when there is none).
fn write_documents(
    args: &PrepareArgs,
    docs: &[Document],
    out: &Outputs,
    report: &mut PrepareReport,
) -> Result<()> {
    if docs.is_empty() {
        return Err(Error::bad_input(
            "input",
            args.input.display().to_string(),
            format!("no sample to train on ({})", skipped_text(&report.skipped)),
            None,
        ));
    }
    let width = match out.dtype {
        DataDtype::U16 => 2,
        DataDtype::U32 => 4,
    };
    write_out(&args.out, &documents::encode(docs, width, out.pad_id)?)
}

/// A Parquet or Arrow input: `text` streams each row group's documents through the tokenizer
/// into the token file; the other formats make documents of its records.
fn prepare_table(
    tok: &Tok,
    args: &PrepareArgs,
    table: &TableInput,
    specials: &BTreeMap<String, String>,
    out: &Outputs,
    mut report: PrepareReport,
) -> Result<PrepareReport> {
    if args.format == Format::Text {
        let mut w = FlatTokens::create(&args.out, out)?;
        let key = args.text_key.as_str();
        table.for_each_batch(&[key], true, |at, rows| {
            let texts = rows
                .iter()
                .enumerate()
                .map(|(i, v)| {
                    v.get(key).and_then(Json::as_str).ok_or_else(|| {
                        Error::bad_input(
                            "input",
                            format!("{}, column `{key}`", at.row(i)),
                            "is not a string",
                            Some("set --text-key to a text column"),
                        )
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            w.documents(tok, &texts)
        })?;
        w.finish(&args.input, &mut report)?;
        return Ok(report);
    }
    let columns: &[&str] = match args.format {
        Format::PromptCompletion => &["prompt", "completion"],
        _ => &["messages"],
    };
    // The chat renderer's memory cap is sized for conversations of up to 16 MiB of JSON (a
    // table's rows are not all seen before rendering starts).
    let mut make = Samples::new(tok, args, specials, out.eos_id, 16 << 20)?;
    let mut docs = Vec::new();
    table.for_each_batch(columns, false, |at, rows| {
        for (i, v) in rows.iter().enumerate() {
            add_sample(&mut make, &at.row(i), v, &mut docs, &mut report)?;
        }
        Ok(())
    })?;
    write_documents(args, &docs, out, &mut report)?;
    Ok(report)
}

/// The `text` format's token file, written as documents arrive: each document's ids, then EOS.
struct FlatTokens {
    file: std::io::BufWriter<crate::util::output::AtomicFile>,
    dtype: DataDtype,
    eos_id: Option<u32>,
    documents: usize,
    tokens: usize,
    /// Whether any document had text beyond whitespace.
    any_text: bool,
}

impl FlatTokens {
    fn create(path: &Path, out: &Outputs) -> Result<Self> {
        if let Some(d) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(d).map_err(|e| Error::io("create directory", d, e))?;
        }
        Ok(FlatTokens {
            file: std::io::BufWriter::with_capacity(
                8 << 20,
                crate::util::output::AtomicFile::create(path)?,
            ),
            dtype: out.dtype,
            eos_id: out.eos_id,
            documents: 0,
            tokens: 0,
            any_text: false,
        })
    }

    /// Tokenize `texts` (in parallel) and append each document's ids and EOS.
    fn documents(&mut self, tok: &Tok, texts: &[&str]) -> Result<()> {
        if texts.is_empty() {
            return Ok(());
        }
        self.any_text |= texts.iter().any(|t| !t.trim().is_empty());
        self.documents += texts.len();
        if self.documents > 1 && self.eos_id.is_none() {
            return Err(Error::bad_input(
                "tokenizer",
                tok.dir.display().to_string(),
                "has no EOS token, so the documents would run into each other with nothing between them",
                Some("pass --eos TOKEN (the token that ends a document for this model)"),
            ));
        }
        let encodings = tok
            .tk
            .encode_batch_fast(texts.to_vec(), false)
            .map_err(|e| Error::system("tokenizers", "encode", e))?;
        let mut bytes = Vec::new();
        for e in &encodings {
            let ids = e.get_ids().iter().chain(self.eos_id.as_ref());
            bytes.clear();
            for &i in ids {
                match self.dtype {
                    DataDtype::U16 => bytes.extend_from_slice(
                        &u16::try_from(i)
                            .map_err(|_| {
                                Error::bad_input(
                                    "--dtype",
                                    "u16",
                                    format!("the tokenizer produced id {i}, more than u16 holds"),
                                    Some("use --dtype u32"),
                                )
                            })?
                            .to_le_bytes(),
                    ),
                    DataDtype::U32 => bytes.extend_from_slice(&i.to_le_bytes()),
                }
                self.tokens += 1;
            }
            std::io::Write::write_all(&mut self.file, &bytes)
                .map_err(|e| Error::io("write", self.file.get_ref().writing(), e))?;
        }
        Ok(())
    }

    /// Check there was text, then make the file whole (an error leaves any earlier file there).
    fn finish(self, input: &Path, report: &mut PrepareReport) -> Result<()> {
        if !self.any_text {
            return Err(Error::bad_input(
                "input",
                input.display().to_string(),
                format!(
                    "holds no text to train on ({} document(s), all empty)",
                    self.documents
                ),
                Some("check the file (and --text-key for JSON or tabular input)"),
            ));
        }
        report.documents = self.documents;
        report.tokens = self.tokens;
        report.trained = self.tokens.saturating_sub(1);
        let mut w = self.file;
        let path = w.get_ref().writing().to_owned();
        std::io::Write::flush(&mut w).map_err(|e| Error::io("write", &path, e))?;
        let file = w
            .into_inner()
            .map_err(|e| Error::io("write", &path, e.into_error()))?;
        file.commit()
    }
}

/// "3 empty completion, 1 no trained token", or "none skipped".
pub fn skipped_text(skipped: &BTreeMap<&'static str, usize>) -> String {
    if skipped.is_empty() {
        return "none skipped".into();
    }
    let parts: Vec<String> = skipped
        .iter()
        .map(|(why, n)| format!("{n} skipped: {why}"))
        .collect();
    parts.join(", ")
}

fn format_name(f: Format) -> &'static str {
    match f {
        Format::Text => "text",
        Format::PromptCompletion => "prompt-completion",
        Format::Chat => "chat",
    }
}

/// The narrowest element type holding every id the tokenizer can emit (which can exceed its
/// vocabulary count: ids need not be contiguous).
fn choose_dtype(tk: &tokenizers::Tokenizer, asked: Option<DataDtype>) -> Result<DataDtype> {
    let max_id = tk
        .get_vocab(true)
        .values()
        .copied()
        .chain(tk.get_added_tokens_decoder().keys().copied())
        .max()
        .unwrap_or(0);
    let fits_u16 = max_id <= u32::from(u16::MAX);
    match asked {
        Some(DataDtype::U16) if !fits_u16 => Err(Error::bad_input(
            "--dtype",
            "u16",
            format!("the tokenizer emits ids up to {max_id}, more than u16 holds (65535)"),
            Some("use --dtype u32, or leave --dtype unset"),
        )),
        Some(d) => Ok(d),
        None if fits_u16 => Ok(DataDtype::U16),
        None => Ok(DataDtype::U32),
    }
}

/// Why one sample failed: bad input (named with its line by the caller) or anything else.
enum SampleError {
    Bad(String),
    Other(Error),
}

impl From<ChatError> for SampleError {
    fn from(e: ChatError) -> Self {
        SampleError::Bad(e.to_string())
    }
}

impl From<Error> for SampleError {
    fn from(e: Error) -> Self {
        SampleError::Other(e)
    }
}

/// One sample's outcome: a document to train on, or skipped (and counted) for a reason.
enum Sample {
    Train(Document),
    Skip(&'static str),
}

/// Turns JSON samples of one format into documents.
struct Samples<'a> {
    tok: &'a Tok,
    format: Format,
    train_on: TrainOn,
    eos_id: Option<u32>,
    template: Option<ChatTemplate>,
    /// Where the template renders when it runs in a child.
    worker: Option<ChatWorker>,
    /// The template's file, for errors.
    template_file: PathBuf,
}

impl<'a> Samples<'a> {
    /// `largest_line`: bytes of the input's longest line (a conversation), which bounds the
    /// renderer's memory.
    fn new(
        tok: &'a Tok,
        args: &PrepareArgs,
        specials: &BTreeMap<String, String>,
        eos_id: Option<u32>,
        largest_line: usize,
    ) -> Result<Self> {
        let template = match args.format {
            Format::Chat => {
                let source = match &args.chat_template {
                    Some(p) => std::fs::read_to_string(p)
                        .map_err(|e| Error::io("read chat template", p, e))?,
                    None => load_template(&tok.dir, tok.config.as_ref())?.ok_or_else(|| {
                        Error::bad_input(
                            "tokenizer",
                            tok.dir.display().to_string(),
                            "has no chat template (no chat_template.jinja, no `chat_template` in tokenizer_config.json)",
                            Some("pass --chat-template FILE, or the model directory that has one"),
                        )
                    })?,
                };
                let shown = args
                    .chat_template
                    .clone()
                    .unwrap_or_else(|| tok.dir.join("tokenizer_config.json"));
                let compiled = ChatTemplate::new(&source, specials.clone()).map_err(|e| {
                    Error::bad_input(
                        "chat template",
                        shown.display().to_string(),
                        e.to_string(),
                        None,
                    )
                })?;
                let worker = match &args.renderer {
                    Some(exe) => Some(ChatWorker::start(
                        exe,
                        &source,
                        specials,
                        super::chat_worker::memory_limit(largest_line),
                    )?),
                    None => None,
                };
                Some((compiled, worker, shown))
            }
            _ => None,
        };
        let (template, worker, template_file) = match template {
            Some((t, w, f)) => (Some(t), w, f),
            None => (None, None, PathBuf::new()),
        };
        if args.format == Format::PromptCompletion && eos_id.is_none() {
            return Err(Error::bad_input(
                "tokenizer",
                tok.dir.display().to_string(),
                "has no EOS token to end completions with",
                Some("pass --eos TOKEN"),
            ));
        }
        Ok(Samples {
            tok,
            format: args.format,
            train_on: args.train_on,
            eos_id,
            template,
            worker,
            template_file,
        })
    }

    /// One sample as a document, or the reason it is skipped.
    fn document(&mut self, v: &Json) -> Result<Sample, SampleError> {
        let mut doc = match self.format {
            Format::Chat => self.chat(v)?,
            _ => match self.prompt_completion(v)? {
                Some(d) => d,
                None => return Ok(Sample::Skip("empty completion")),
            },
        };
        if let Some(first) = doc.mask.first_mut() {
            *first = false; // nothing predicts a document's first token
        }
        if doc.tokens.len() < 2 {
            return Ok(Sample::Skip("fewer than two tokens"));
        }
        if doc.trained() == 0 {
            return Ok(Sample::Skip("no trained token"));
        }
        Ok(Sample::Train(doc))
    }

    fn field<'v>(v: &'v Json, key: &str) -> Result<&'v Json, SampleError> {
        v.get(key)
            .ok_or_else(|| SampleError::Bad(format!("has no `{key}` field")))
    }

    fn prompt_completion(&self, v: &Json) -> Result<Option<Document>, SampleError> {
        let text = |key| {
            Self::field(v, key)?
                .as_str()
                .ok_or_else(|| SampleError::Bad(format!("`{key}` is not a string")))
        };
        let (prompt, completion) = (text("prompt")?, text("completion")?);
        if completion.is_empty() {
            return Ok(None);
        }
        let p = self.tok.encode(prompt, true)?;
        let c = self.tok.encode(completion, false)?;
        let (p, c) = (p.get_ids(), c.get_ids());
        let mut tokens = Vec::with_capacity(p.len() + c.len() + 1);
        tokens.extend_from_slice(p);
        tokens.extend_from_slice(c);
        tokens.extend(self.eos_id);
        let all = self.train_on == TrainOn::All;
        let mask = (0..tokens.len()).map(|i| all || i >= p.len()).collect();
        Ok(Some(Document { tokens, mask }))
    }

    fn chat(&mut self, v: &Json) -> Result<Document, SampleError> {
        let messages = check_messages(Self::field(v, "messages")?)?;
        // A template's own failure names the template's file (and its line).
        let file = self.template_file.display().to_string();
        let named = |c: ChatError| match c {
            ChatError::Template { .. } => SampleError::Bad(format!("{c} (template {file})")),
            other => SampleError::from(other),
        };
        let r = match (&mut self.worker, &self.template) {
            (Some(w), _) => w.render(messages).map_err(|e| match e {
                WorkerError::Chat(c) => named(c),
                WorkerError::Failed(e) => SampleError::Bad(format!("{e} (template {file})")),
            })?,
            (None, Some(t)) => t.render(messages).map_err(named)?,
            (None, None) => {
                return Err(SampleError::Other(Error::internal(
                    "prepare",
                    "chat format without a template",
                )))
            }
        };
        // The template writes the special tokens (BOS, end of turn) itself, as transformers'
        // apply_chat_template tokenizes without adding any.
        let enc = self.tok.encode(&r.text, false)?;
        let all = self.train_on == TrainOn::All;
        let mask = enc
            .get_offsets()
            .iter()
            .map(|&(a, b)| all || r.trained.iter().any(|s| a < s.end && b > s.start))
            .collect();
        Ok(Document {
            tokens: enc.get_ids().to_vec(),
            mask,
        })
    }
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
            format: Format::Text,
            text_key: "text".into(),
            eos: None,
            train_on: TrainOn::Response,
            chat_template: None,
            renderer: None,
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
