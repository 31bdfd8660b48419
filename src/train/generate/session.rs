//! `megatrain generate`: a model (a Hugging Face directory or a megatrain checkpoint) loaded into
//! a host store and streamed through the device of training, one sequence of the prompt plus the
//! tokens asked for, continued by [`super::continue_ids`].

use super::{continue_ids, Continuation, ModelDefaults, Sampling, TextCodec};
use crate::device::Precision;
use crate::engine::Activations;
use crate::model::reference::Templates;
use crate::store::layout::{AdamState, MasterFormat, Mode, StateLayout};
use crate::store::placement::{RamBudget, SpillRequest};
use crate::train::checkpoint;
use crate::train::config::{DeviceKind, TrainConfig};
use crate::train::device_fit::check_working_set;
use crate::train::setup::{allocate_store, build_streamer, open_device};
use crate::train::Progress;
use crate::{Error, Result};
use serde::Serialize;
use std::path::PathBuf;
use std::sync::Arc;

/// Where the weights come from.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ModelSource {
    /// A Hugging Face model directory (`config.json` and safetensors).
    Hf(PathBuf),
    /// A megatrain checkpoint (`step-…`), or a run's checkpoint directory (its newest).
    Checkpoint(PathBuf),
}

/// A generation request.
#[derive(Debug, Clone)]
pub struct GenerateArgs {
    /// The model.
    pub source: ModelSource,
    /// The tokenizer (`bytes`: one token per byte); `None`: the model directory's, or the
    /// checkpoint's run's (its `--tokenizer`, else its `--init-from` directory).
    pub tokenizer: Option<PathBuf>,
    /// The prompt's text.
    pub prompt: String,
    /// Render the prompt as a user message with the chat template.
    pub chat: bool,
    /// How tokens are chosen.
    pub sampling: Sampling,
    /// The device.
    pub device: DeviceKind,
    /// Its precision (unset: bf16 on CUDA, fp32 on the CPU).
    pub precision: Option<Precision>,
    /// The CPU device's memory budget, bytes.
    pub device_memory: u64,
    /// Cap on the host RAM the weights may use.
    pub ram_budget: Option<u64>,
}

/// What [`generate`] produced.
#[derive(Debug, Clone, Serialize)]
pub struct Generation {
    /// The prompt as the model saw it (token ids).
    pub prompt_ids: Vec<u32>,
    /// The new tokens and why they stopped.
    #[serde(flatten)]
    pub continuation: Continuation,
    /// Their text (what they add after the prompt's).
    pub text: String,
    /// New tokens per second (each a forward pass of the whole sequence).
    pub tokens_per_s: f64,
    /// The model's parameters.
    pub params: usize,
}

/// Load the model, encode the prompt, continue it.
pub fn generate(args: &GenerateArgs, progress: &mut dyn Progress) -> Result<Generation> {
    let (model, from) = match &args.source {
        ModelSource::Hf(dir) => (
            crate::store::hf::load_config(dir)?,
            Weights::Hf(dir.clone()),
        ),
        ModelSource::Checkpoint(path) => {
            let dir = checkpoint::one_or_latest(path)?;
            let state = checkpoint::open(&dir)?;
            (
                state.model,
                Weights::Checkpoint(dir, Box::new(state.config)),
            )
        }
    };
    // The model's own directory: its tokenizer, its generation config.
    let model_dir = match &from {
        Weights::Hf(dir) => Some(dir.clone()),
        Weights::Checkpoint(_, cfg) => cfg.init_from.clone(),
    };
    let tokenizer = match (&args.tokenizer, &from) {
        (Some(t), _) => t.clone(),
        (None, Weights::Hf(dir)) => dir.clone(),
        (None, Weights::Checkpoint(dir, cfg)) => {
            let recorded = cfg.tokenizer.clone().or_else(|| cfg.init_from.clone());
            match recorded {
                Some(t) if t.as_os_str() == "bytes" || t.exists() => t,
                Some(t) => {
                    return Err(Error::bad_input(
                        "--tokenizer",
                        t.display().to_string(),
                        format!(
                            "the tokenizer the run of {} recorded is not there (a path relative to where it ran, or moved)",
                            dir.display()
                        ),
                        Some("pass --tokenizer DIR (the model's tokenizer.json)"),
                    ))
                }
                None => {
                    return Err(Error::bad_input(
                        "--tokenizer",
                        dir.display().to_string(),
                        "the checkpoint's run named no tokenizer (nor an --init-from directory)",
                        Some("pass --tokenizer DIR (the model's tokenizer.json), or `--tokenizer bytes` for a byte-level model"),
                    ))
                }
            }
        }
    };
    let codec = TextCodec::open(&tokenizer)?;
    let prompt_ids = codec.prompt_ids(&args.prompt, args.chat)?;
    let model_dir = model_dir.filter(|d| d.is_dir());
    let defaults = ModelDefaults::read(model_dir.as_deref().or(Some(tokenizer.as_path())), &codec);
    if defaults.eos.is_empty() {
        progress.note("note: no end-of-sequence token is known (no generation_config.json, config.json or tokenizer EOS): generation stops at --max-new-tokens");
    }
    if !defaults.ignored.is_empty() && args.sampling.temperature == 0.0 {
        progress.note(&format!(
            "note: greedy (the model's generation_config.json sets {}; pass --temperature/--top-k to sample)",
            defaults.ignored.join(", ")
        ));
    }
    let seq = prompt_ids.len() + args.sampling.max_new_tokens;
    if seq > model.max_position_embeddings {
        return Err(Error::bad_input(
            "--max-new-tokens",
            args.sampling.max_new_tokens.to_string(),
            format!(
                "with the prompt's {} tokens exceeds the model's max_position_embeddings {}",
                prompt_ids.len(),
                model.max_position_embeddings
            ),
            Some("ask for fewer tokens, or shorten the prompt"),
        ));
    }
    // One sequence; the smallest state a store has (lean, int8 moments: never read here).
    let cfg = TrainConfig {
        device: args.device,
        precision: args.precision,
        device_memory: args.device_memory,
        ram_budget: args.ram_budget,
        batch_size: 1,
        seq_len: seq,
        grad_accum: 1,
        mode: Some(Mode::Lean),
        adam_state: Some(AdamState::Int8),
        activations: Some(Activations::Host),
        ..TrainConfig::default()
    };
    let master = match cfg.resolved_precision() {
        Precision::Fp32 => MasterFormat::Fp32,
        Precision::Bf16 => MasterFormat::Planes,
    };
    let layout = StateLayout::new(&model, Mode::Lean)
        .with_adam_state(AdamState::Int8)
        .with_master(master);
    let machine = crate::topology::probe(&crate::topology::TopologySource::Live)?;
    let tm = Arc::new(Templates::new(&layout.config, seq)?);
    let device = open_device(
        &cfg,
        &tm,
        &layout,
        (crate::train::ranks::GpuSlot::ALONE, None),
    )?;
    let budget = RamBudget {
        total_bytes: cfg.ram_budget,
        ..RamBudget::default()
    };
    let store = allocate_store(
        &cfg,
        layout,
        &machine,
        &*device,
        (budget, SpillRequest::default()),
        "generate",
        progress,
    )?;
    match &from {
        Weights::Hf(dir) => {
            let r = crate::store::hf::load_into_store(dir, &store)?;
            progress.note(&format!(
                "loaded {} tensors from {}",
                r.tensors,
                dir.display()
            ));
        }
        Weights::Checkpoint(dir, _) => {
            let st = checkpoint::load_params(dir, &store)?;
            progress.note(&format!(
                "loaded the weights of {} (step {})",
                dir.display(),
                st.step
            ));
        }
    }
    check_working_set(
        &cfg,
        device.as_ref(),
        store.layout(),
        (Activations::Host, 0),
    )?;
    let params = store.layout().num_params();
    let mut streamer = build_streamer(&cfg, device, store, tm, (Activations::Host, 0))?;
    let started = std::time::Instant::now();
    let continuation = continue_ids(&mut streamer, &prompt_ids, &args.sampling, &defaults)?;
    let secs = started.elapsed().as_secs_f64();
    let text = codec.continuation(&prompt_ids, &continuation.tokens)?;
    Ok(Generation {
        prompt_ids,
        tokens_per_s: continuation.tokens.len() as f64 / secs.max(1e-9),
        continuation,
        text,
        params,
    })
}

/// The weights to load: a model directory's, or a checkpoint's (with its run's settings).
enum Weights {
    Hf(PathBuf),
    Checkpoint(PathBuf, Box<TrainConfig>),
}
