//! Generation: a prompt continued token by token on the training device. Each new token is one
//! forward-only pass of the whole sequence so far ([`Streamer::logits`]: the program validation
//! runs, the weights streamed from the host store) — recomputed, no KV cache: `n` new tokens cost
//! `n` forward passes of the micro-batch. The sequence sits in the first row of a micro-batch of
//! the streamer's shape (the rest is padding the causal attention never lets it see).
//!
//! The choice of each token follows transformers' `generate`: the logits soft-capped where the
//! model caps them; greedy takes the first most likely token (`do_sample=False`); with a
//! temperature, the logits divided by it, the `top_k` largest kept, one token drawn from their
//! softmax (a seeded generator: the same seed, the same text).

mod session;

pub use session::{generate, GenerateArgs, Generation, ModelSource};

use super::tokenizer::Tok;
use crate::engine::{MicroBatch, Streamer};
use crate::model::ops::IGNORE;
use crate::{Error, Result};
use serde::Serialize;
use serde_json::Value as Json;
use std::path::Path;

/// How tokens are chosen, and how many.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Sampling {
    /// Tokens generated at most.
    pub max_new_tokens: usize,
    /// 0: greedy; else the logits are divided by it and a token drawn.
    pub temperature: f64,
    /// With a temperature: draw among the `top_k` most likely tokens only (0: among all).
    pub top_k: usize,
    /// The draw's seed.
    pub seed: u64,
}

/// Why generation stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
#[serde(rename_all = "snake_case")]
pub enum Stop {
    /// An end-of-sequence token was generated (it is the last token).
    Eos,
    /// `max_new_tokens` were generated.
    MaxNewTokens,
    /// The sequence filled the micro-batch's row.
    Context,
}

/// What [`continue_ids`] generated.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Continuation {
    /// The new tokens (an EOS that stopped it included).
    pub tokens: Vec<u32>,
    /// Why it stopped.
    pub stop: Stop,
}

/// Continue `prompt` (token ids) under the streamer's current weights, with the model's own
/// settings `model` (its EOS ids, its repetition penalty).
pub fn continue_ids(
    streamer: &mut Streamer,
    prompt: &[u32],
    s: &Sampling,
    model: &ModelDefaults,
) -> Result<Continuation> {
    let (b, t) = streamer.micro_batch_shape();
    let cfg = &streamer.store().layout().config;
    let (vocab, softcap) = (cfg.vocab_size, cfg.final_logit_softcapping);
    if prompt.is_empty() {
        return Err(Error::bad_input(
            "prompt",
            "",
            "encodes to no tokens",
            Some("give a prompt with some text"),
        ));
    }
    if let Some(bad) = prompt.iter().find(|&&id| id as usize >= vocab) {
        return Err(Error::bad_input(
            "prompt",
            bad.to_string(),
            format!("is a token id ≥ the model's vocabulary of {vocab}"),
            Some("use the model's own tokenizer"),
        ));
    }
    if prompt.len() > t {
        return Err(Error::bad_input(
            "prompt",
            format!("{} tokens", prompt.len()),
            format!("is longer than the {t} tokens a sequence holds"),
            Some("shorten the prompt (or raise --seq-len)"),
        ));
    }
    let mut seq = prompt.to_vec();
    let mut rng = s.seed ^ 0x5EED_0F5A_4D1E;
    let mut tokens = Vec::new();
    let stop = loop {
        if tokens.len() == s.max_new_tokens {
            break Stop::MaxNewTokens;
        }
        if seq.len() == t {
            break Stop::Context;
        }
        let mb = row_zero(&seq, b, t);
        let mut logits = streamer.logits(&mb, seq.len() - 1)?;
        check_finite(&logits)?;
        // transformers' order: the model's soft cap, then the processors (the repetition
        // penalty), then the warpers (temperature, top-k) of a draw.
        if let Some(cap) = softcap {
            soft_cap(&mut logits, cap);
        }
        penalize(&mut logits, &seq, model.repetition_penalty);
        let next = pick(&logits, s, &mut rng)?;
        seq.push(next);
        tokens.push(next);
        if model.eos.contains(&next) {
            break Stop::Eos;
        }
    };
    Ok(Continuation { tokens, stop })
}

/// A micro-batch of `b × t` tokens whose first row starts with `seq` (positions from 0), the
/// rest padding: nothing trained, no loss.
fn row_zero(seq: &[u32], b: usize, t: usize) -> MicroBatch {
    let mut tokens = vec![0u32; b * t];
    tokens[..seq.len()].copy_from_slice(seq);
    let mut pad = vec![1u8; b * t];
    pad[..seq.len()].fill(0);
    MicroBatch {
        tokens: tokens.into(),
        targets: vec![IGNORE; b * t].into(),
        positions: crate::model::ops::flat_positions(b, t).into(),
        pad: Some(pad.into()),
    }
}

fn check_finite(logits: &[f32]) -> Result<()> {
    if logits.iter().any(|z| !z.is_finite()) {
        return Err(Error::bad_input(
            "model",
            "logits",
            "are not finite (NaN or infinite): the weights are damaged or diverged",
            Some("generate from an earlier checkpoint"),
        ));
    }
    Ok(())
}

/// `z = cap·tanh(z / cap)` (Gemma 2's `final_logit_softcapping`).
pub fn soft_cap(logits: &mut [f32], cap: f64) {
    let cap = cap as f32;
    logits.iter_mut().for_each(|z| *z = (*z / cap).tanh() * cap);
}

/// transformers' `RepetitionPenaltyLogitsProcessor`: every token of `context` made less likely
/// (a positive logit divided by `penalty`, a negative one multiplied); 1: none.
pub fn penalize(logits: &mut [f32], context: &[u32], penalty: f32) {
    if penalty == 1.0 {
        return;
    }
    let mut seen = std::collections::HashSet::new();
    for &t in context {
        if let Some(z) = logits.get_mut(t as usize).filter(|_| seen.insert(t)) {
            *z = if *z < 0.0 { *z * penalty } else { *z / penalty };
        }
    }
}

/// The next token from one row of (finite) logits, as transformers' `generate` chooses it:
/// greedy, or drawn at a temperature among the `top_k` most likely.
pub fn pick(logits: &[f32], s: &Sampling, rng: &mut u64) -> Result<u32> {
    if s.temperature <= 0.0 {
        // The first of the largest, as torch.argmax.
        let mut best = 0;
        for (i, &z) in logits.iter().enumerate() {
            if z > logits[best] {
                best = i;
            }
        }
        return Ok(best as u32);
    }
    // transformers' top-k keeps every logit ≥ the k-th largest (ties included).
    let floor = match s.top_k {
        k if k > 0 && k < logits.len() => {
            let mut sorted = logits.to_vec();
            sorted.sort_unstable_by(|a, b| b.total_cmp(a));
            sorted[k - 1]
        }
        _ => f32::NEG_INFINITY,
    };
    // softmax(z / T) over the kept logits, in f64 from the unscaled ones (a tiny temperature
    // cannot overflow 1/T).
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let weights: Vec<f64> = logits
        .iter()
        .map(|&z| match z >= floor {
            true => (f64::from(z - max) / s.temperature).exp(),
            false => 0.0,
        })
        .collect();
    let total: f64 = weights.iter().sum();
    if !(total.is_finite() && total > 0.0) {
        return Err(Error::bad_input(
            "temperature",
            s.temperature.to_string(),
            "leaves no token with a usable probability",
            Some("use a temperature around 0.1–2, or 0 for greedy"),
        ));
    }
    let u = (crate::util::splitmix64(rng) >> 11) as f64 / (1u64 << 53) as f64 * total;
    let mut acc = 0.0;
    for (i, w) in weights.iter().enumerate() {
        acc += w;
        if u < acc {
            return Ok(i as u32);
        }
    }
    // Rounding left `u` at the very top: the last token with any weight (the max has weight 1).
    Ok(weights.iter().rposition(|&w| w > 0.0).unwrap_or(0) as u32)
}

/// Text to token ids and back: a Hugging Face tokenizer, or one token per byte (the demo's).
#[derive(Debug)]
pub enum TextCodec {
    /// Byte `b` is token `b` (vocabulary 256).
    Bytes,
    /// A Hugging Face tokenizer.
    Hf(Box<Tok>),
}

impl TextCodec {
    /// The codec `spec` names: `bytes`, or a tokenizer (its `tokenizer.json` or the directory).
    pub fn open(spec: &Path) -> Result<Self> {
        match spec.as_os_str() == "bytes" {
            true => Ok(TextCodec::Bytes),
            false => Ok(TextCodec::Hf(Box::new(Tok::load(spec)?))),
        }
    }

    /// The ids of `prompt`: as the tokenizer encodes a text (its special tokens added, as
    /// `tokenizer(prompt)`), or with `chat` as a user message rendered by the model's chat
    /// template with the generation prompt (`apply_chat_template(…, add_generation_prompt=True)`,
    /// encoded without special tokens).
    pub fn prompt_ids(&self, prompt: &str, chat: bool) -> Result<Vec<u32>> {
        match (self, chat) {
            (TextCodec::Bytes, false) => Ok(prompt.bytes().map(u32::from).collect()),
            (TextCodec::Bytes, true) => Err(Error::bad_input(
                "--chat",
                "bytes",
                "a byte-level model has no chat template",
                Some("drop --chat, or pass the --tokenizer of a chat model"),
            )),
            (TextCodec::Hf(tok), false) => Ok(tok.encode(prompt, true)?.get_ids().to_vec()),
            (TextCodec::Hf(tok), true) => {
                let source = super::chat::load_template(&tok.dir, tok.config.as_ref())?
                    .ok_or_else(|| {
                        Error::bad_input(
                            "--chat",
                            tok.dir.display().to_string(),
                            "the tokenizer has no chat template (no chat_template.jinja, none in tokenizer_config.json)",
                            Some("drop --chat, or pass the --tokenizer of a chat model"),
                        )
                    })?;
                let chat_error = |e: super::chat::ChatError| {
                    Error::bad_input(
                        "chat template",
                        tok.dir.display().to_string(),
                        e.to_string(),
                        None,
                    )
                };
                let template =
                    super::chat::ChatTemplate::new(&source, tok.specials()?).map_err(chat_error)?;
                let message = serde_json::json!({"role": "user", "content": prompt});
                let text = template.render_prompt(&[message]).map_err(chat_error)?;
                Ok(tok.encode(&text, false)?.get_ids().to_vec())
            }
        }
    }

    /// The text of `ids` (special tokens left out; bytes that are not UTF-8 shown as U+FFFD).
    pub fn decode(&self, ids: &[u32]) -> Result<String> {
        match self {
            TextCodec::Bytes => {
                let bytes: Vec<u8> = ids
                    .iter()
                    .map(|&i| u8::try_from(i).unwrap_or(b'?'))
                    .collect();
                Ok(String::from_utf8_lossy(&bytes).into_owned())
            }
            TextCodec::Hf(tok) => tok
                .tk
                .decode(ids, true)
                .map_err(|e| Error::system("tokenizers", "decode", e)),
        }
    }

    /// The text `new` adds after `prompt`: the two decoded together, less the prompt's own
    /// decoding (a SentencePiece tokenizer drops a leading space when a piece is decoded on its
    /// own), as transformers' `TextStreamer` prints it.
    pub fn continuation(&self, prompt: &[u32], new: &[u32]) -> Result<String> {
        let before = self.decode(prompt)?;
        let all = self.decode(&[prompt, new].concat())?;
        Ok(match all.strip_prefix(&before) {
            Some(rest) => rest.to_owned(),
            None => self.decode(new)?,
        })
    }

    /// The tokenizer's own end-of-sequence token (`eos_token`), if it has one.
    pub fn eos_id(&self) -> Option<u32> {
        match self {
            TextCodec::Bytes => None,
            TextCodec::Hf(tok) => tok
                .specials()
                .ok()
                .and_then(|s| s.get("eos_token").and_then(|t| tok.tk.token_to_id(t))),
        }
    }
}

/// What a model directory says about generating from it (`generation_config.json`, else
/// `config.json`) that greedy decoding honours as transformers' `generate` does.
#[derive(Debug, Clone, PartialEq)]
pub struct ModelDefaults {
    /// The tokens that end a generation: `eos_token_id` (a number or a list), else the
    /// tokenizer's EOS.
    pub eos: Vec<u32>,
    /// `repetition_penalty` (1: none).
    pub repetition_penalty: f32,
    /// Settings of `generation_config.json` not applied (sampling is chosen by the flags).
    pub ignored: Vec<String>,
}

impl ModelDefaults {
    /// Read from `model_dir` (none: the tokenizer's EOS only).
    pub fn read(model_dir: Option<&Path>, codec: &TextCodec) -> Self {
        let json = |name: &str| -> Option<Json> {
            let text = std::fs::read_to_string(model_dir?.join(name)).ok()?;
            serde_json::from_str(&text).ok()
        };
        let (generation, config) = (json("generation_config.json"), json("config.json"));
        let eos_of = |v: &Json| -> Option<Vec<u32>> {
            match v.get("eos_token_id")? {
                Json::Number(n) => Some(vec![u32::try_from(n.as_u64()?).ok()?]),
                Json::Array(list) => list
                    .iter()
                    .map(|n| n.as_u64().and_then(|n| u32::try_from(n).ok()))
                    .collect(),
                _ => None,
            }
        };
        let eos = generation
            .as_ref()
            .and_then(eos_of)
            .or_else(|| config.as_ref().and_then(eos_of))
            .or_else(|| codec.eos_id().map(|e| vec![e]))
            .unwrap_or_default();
        let repetition_penalty = generation
            .as_ref()
            .and_then(|g| g.get("repetition_penalty")?.as_f64())
            .filter(|p| p.is_finite() && *p > 0.0)
            .map_or(1.0, |p| p as f32);
        let ignored = generation
            .as_ref()
            .map(|g| {
                ["do_sample", "temperature", "top_k", "top_p", "min_p"]
                    .into_iter()
                    .filter_map(|k| Some(format!("{k}={}", g.get(k)?)))
                    .collect()
            })
            .unwrap_or_default();
        ModelDefaults {
            eos,
            repetition_penalty,
            ignored,
        }
    }
}

/// Samples while training (`--sample-every`): the prompt encoded once, continued on the
/// training device under the weights of the step just done.
#[derive(Debug)]
pub struct TrainingSamples {
    every: u64,
    prompt: String,
    prompt_ids: Vec<u32>,
    codec: TextCodec,
    sampling: Sampling,
    model: ModelDefaults,
}

impl TrainingSamples {
    /// The samples `cfg` asks for (none without `sample_every`), checked before training: the
    /// tokenizer loads, the prompt and its continuation fit a sequence.
    pub fn for_run(cfg: &super::config::TrainConfig, vocab: usize) -> Result<Option<Self>> {
        let (every, Some(prompt)) = (cfg.sample_every, &cfg.sample_prompt) else {
            return Ok(None);
        };
        if every == 0 {
            return Ok(None);
        }
        let spec = cfg.tokenizer.clone().or_else(|| cfg.init_from.clone()).ok_or_else(|| {
            Error::bad_input(
                "--sample-every",
                every.to_string(),
                "samples need the model's tokenizer, and the run names none (no --tokenizer, no --init-from)",
                Some("pass --tokenizer DIR (or `--tokenizer bytes` for a byte-level model)"),
            )
        })?;
        let codec = TextCodec::open(&spec)?;
        let prompt_ids = codec.prompt_ids(prompt, false)?;
        if let Some(bad) = prompt_ids.iter().find(|&&id| id as usize >= vocab) {
            return Err(Error::bad_input(
                "--tokenizer",
                spec.display().to_string(),
                format!("gives token {bad} for the sample prompt, beyond the model's vocabulary of {vocab}"),
                Some("pass the model's own tokenizer"),
            ));
        }
        if prompt_ids.len() + cfg.sample_tokens > cfg.seq_len {
            return Err(Error::bad_input(
                "--sample-prompt",
                format!("{} tokens", prompt_ids.len()),
                format!(
                    "with --sample-tokens {} does not fit a sequence of --seq-len {}",
                    cfg.sample_tokens, cfg.seq_len
                ),
                Some("shorten the prompt or lower --sample-tokens"),
            ));
        }
        if prompt_ids.is_empty() {
            return Err(Error::bad_input(
                "--sample-prompt",
                prompt,
                "encodes to no tokens",
                Some("give a prompt with some text"),
            ));
        }
        let model = ModelDefaults::read(cfg.init_from.as_deref().or(Some(spec.as_path())), &codec);
        Ok(Some(TrainingSamples {
            every,
            prompt: prompt.clone(),
            prompt_ids,
            codec,
            sampling: Sampling {
                max_new_tokens: cfg.sample_tokens,
                temperature: cfg.sample_temperature,
                top_k: 50,
                seed: cfg.seed,
            },
            model,
        }))
    }

    /// Whether a sample is due after `step` (every `every` steps, and after the last, `last`).
    pub fn due(&self, step: u64, last: u64) -> bool {
        step.is_multiple_of(self.every) || step == last
    }

    /// The prompt and its continuation under the streamer's current weights (drawn with a seed
    /// of the run's and the step's).
    pub fn sample(&self, streamer: &mut Streamer, step: u64) -> Result<String> {
        let sampling = Sampling {
            seed: self.sampling.seed ^ step.wrapping_mul(0x9E37_79B9_7F4A_7C15),
            ..self.sampling
        };
        let c = continue_ids(streamer, &self.prompt_ids, &sampling, &self.model)?;
        let text = self.codec.continuation(&self.prompt_ids, &c.tokens)?;
        Ok(format!("{}{text}", self.prompt))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn greedy() -> Sampling {
        Sampling {
            max_new_tokens: 1,
            temperature: 0.0,
            top_k: 0,
            seed: 0,
        }
    }

    #[test]
    fn greedy_takes_the_first_largest_the_cap_and_penalty_apply_nan_is_refused() {
        let z = vec![0.5, 2.0, -1.0, 2.0];
        assert_eq!(pick(&z, &greedy(), &mut 0).unwrap(), 1);
        assert!(check_finite(&[0.5, f32::NAN]).is_err());
        // A soft cap is monotonic: the same choice, the logits capped.
        let mut z = vec![10.0, 80.0, 79.0];
        soft_cap(&mut z, 30.0);
        assert_eq!(pick(&z, &greedy(), &mut 0).unwrap(), 1);
        assert!(z[1] < 30.0);
        // transformers' repetition penalty: positive logits divided, negative multiplied, each
        // token once however often it occurs.
        let mut z = vec![3.0, -2.0, 2.9, 1.0];
        penalize(&mut z, &[0, 1, 0, 0], 1.5);
        assert_eq!(z, vec![2.0, -3.0, 2.9, 1.0]);
        assert_eq!(pick(&z, &greedy(), &mut 0).unwrap(), 2);
        // A tiny temperature is greedy (the weights in f64: no overflow to NaN and token 0).
        let s = Sampling {
            temperature: 1e-300,
            ..greedy()
        };
        assert_eq!(pick(&[1.0, 5.0, 2.0], &s, &mut 1).unwrap(), 1);
    }

    #[test]
    fn temperature_draws_follow_the_softmax_within_top_k() {
        let s = Sampling {
            temperature: 1.0,
            top_k: 2,
            seed: 7,
            ..greedy()
        };
        let base = [0.0f32, (3.0f32).ln(), -0.5, 5.0f32.ln() - 10.0];
        let mut counts = [0usize; 4];
        let mut rng = 1;
        for _ in 0..20_000 {
            counts[pick(&base, &s, &mut rng).unwrap() as usize] += 1;
        }
        // Only the two largest (weights 1 and 3) are ever drawn, in ratio ≈ 1:3.
        assert_eq!(counts[2] + counts[3], 0);
        let share = counts[1] as f64 / 20_000.0;
        assert!((share - 0.75).abs() < 0.02, "{counts:?}");
        // The same seed, the same draws.
        let draw = |seed: u64| {
            let mut r = seed;
            (0..50)
                .map(|_| pick(&base, &s, &mut r).unwrap())
                .collect::<Vec<_>>()
        };
        assert_eq!(draw(3), draw(3));
        assert_ne!(draw(3), draw(4));
    }

    #[test]
    fn bytes_round_trip_and_have_no_chat() {
        let c = TextCodec::Bytes;
        let ids = c.prompt_ids("fn main() {", false).unwrap();
        assert_eq!(ids.len(), 11);
        assert_eq!(c.decode(&ids).unwrap(), "fn main() {");
        assert!(c.prompt_ids("hi", true).is_err());
    }
}
