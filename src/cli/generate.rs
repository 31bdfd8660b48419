//! `megatrain generate`: continue a prompt with a Hugging Face model or a training checkpoint.

use clap::Args;
use megatrain::train::config::DeviceKind;
use megatrain::train::generate::{self, GenerateArgs as Request, ModelSource, Sampling};
use megatrain::util::size::ByteSize;
use megatrain::Result;
use std::io::Write as _;
use std::path::PathBuf;

#[derive(Debug, Args)]
#[command(after_help = "Examples:
  megatrain generate --model ./Qwen2.5-0.5B-Instruct --chat --prompt 'Name three primes.'
  megatrain generate --checkpoint ./ckpt --prompt 'fn main' --max-new-tokens 64 --temperature 0.8")]
pub struct GenerateArgs {
    /// A Hugging Face model directory (config.json + safetensors).
    #[arg(
        long,
        value_name = "DIR",
        conflicts_with = "checkpoint",
        required_unless_present = "checkpoint"
    )]
    model: Option<PathBuf>,
    /// A training checkpoint (`.../step-…`) or a run's --checkpoint-dir (its newest).
    #[arg(long, value_name = "DIR")]
    checkpoint: Option<PathBuf>,
    /// The tokenizer (its directory or tokenizer.json; `bytes`: one token per byte, the demo's).
    /// Default: the model directory's, or the checkpoint's run's.
    #[arg(long, value_name = "DIR")]
    tokenizer: Option<PathBuf>,
    /// The text to continue.
    #[arg(long, value_name = "TEXT")]
    prompt: String,
    /// Send the prompt as a user message through the model's chat template.
    #[arg(long)]
    chat: bool,
    /// Tokens to generate at most (fewer when an end-of-sequence token comes first).
    #[arg(long, default_value_t = 32)]
    max_new_tokens: usize,
    /// 0: greedy (transformers' do_sample=False, with the model's repetition_penalty); else
    /// sample at this temperature.
    #[arg(long, default_value_t = 0.0, allow_negative_numbers = true)]
    temperature: f64,
    /// With a temperature: sample among the K most likely tokens only (0: all; 50 as
    /// transformers' default).
    #[arg(long, default_value_t = 50, value_name = "K")]
    top_k: usize,
    /// The sampling seed.
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Compute device.
    #[arg(long, value_enum, default_value = "cpu")]
    device: DeviceKind,
    /// fp32 or bf16 (default: bf16 on CUDA, fp32 on the CPU).
    #[arg(long, value_enum)]
    precision: Option<megatrain::device::Precision>,
    /// The CPU device's memory budget.
    #[arg(long, value_name = "SIZE", default_value = "2GiB")]
    device_memory: ByteSize,
    /// Cap on the host RAM the weights may use.
    #[arg(long, value_name = "SIZE")]
    ram_budget: Option<ByteSize>,
    /// Print the result as JSON (prompt ids, new token ids, text, why it stopped).
    #[arg(long)]
    json: bool,
}

/// Notes to stderr.
struct Notes;

impl megatrain::train::Progress for Notes {
    fn note(&mut self, line: &str) {
        let _ = writeln!(std::io::stderr(), "{line}");
    }
}

pub fn run(args: &GenerateArgs) -> Result<()> {
    if !(args.temperature.is_finite() && args.temperature >= 0.0) {
        return Err(megatrain::Error::bad_input(
            "--temperature",
            args.temperature.to_string(),
            "must be a number ≥ 0 (0: greedy)",
            Some("e.g. --temperature 0.8"),
        ));
    }
    if args.max_new_tokens == 0 {
        return Err(megatrain::Error::bad_input(
            "--max-new-tokens",
            "0",
            "asks for nothing",
            Some("e.g. --max-new-tokens 32"),
        ));
    }
    let source = match (&args.model, &args.checkpoint) {
        (Some(m), _) => ModelSource::Hf(m.clone()),
        (None, Some(c)) => ModelSource::Checkpoint(c.clone()),
        (None, None) => {
            return Err(megatrain::Error::bad_input(
                "model",
                "",
                "no model given",
                Some("pass --model HF_DIR or --checkpoint DIR"),
            ))
        }
    };
    let request = Request {
        source,
        tokenizer: args.tokenizer.clone(),
        prompt: args.prompt.clone(),
        chat: args.chat,
        sampling: Sampling {
            max_new_tokens: args.max_new_tokens,
            temperature: args.temperature,
            top_k: args.top_k,
            seed: args.seed,
        },
        device: args.device,
        precision: args.precision,
        device_memory: args.device_memory.0,
        ram_budget: args.ram_budget.map(|b| b.0),
    };
    let g = generate::generate(&request, &mut Notes)?;
    let mut out = std::io::stdout().lock();
    let written = if args.json {
        let json = serde_json::to_string_pretty(&g)
            .map_err(|e| megatrain::Error::system("serde_json", "the result", e))?;
        writeln!(out, "{json}")
    } else {
        writeln!(out, "{}{}", args.prompt, g.text)
    };
    written.map_err(|e| megatrain::Error::io("write", std::path::Path::new("stdout"), e))?;
    let _ = writeln!(
        std::io::stderr(),
        "{} new tokens ({:?}), {:.1} tokens/s ({} parameters; each token a forward pass of the whole sequence, no KV cache)",
        g.continuation.tokens.len(),
        g.continuation.stop,
        g.tokens_per_s,
        g.params
    );
    Ok(())
}
