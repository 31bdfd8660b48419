//! `megatrain export`: a training checkpoint as a Hugging Face model.

use clap::Args;
use megatrain::Result;
use std::path::PathBuf;

#[derive(Debug, Args)]
#[command(after_help = "Examples:
  megatrain export --checkpoint ckpt --out hf                     the newest checkpoint
  megatrain export --checkpoint ckpt/step-00000400 --out hf16 --dtype bf16 --tokenizer ./Llama-3.2-1B")]
pub struct ExportArgs {
    /// A checkpoint directory (`.../step-00000100`) or a checkpoint root (the newest is used).
    #[arg(long, value_name = "DIR")]
    checkpoint: PathBuf,
    /// Output directory (must not exist or be empty).
    #[arg(long, value_name = "DIR")]
    out: PathBuf,
    /// The tensors' type: fp32 (the master as is) or bf16 (rounded to nearest-even; half the
    /// bytes). Default: fp32 up to 1B parameters, bf16 above.
    #[arg(long, value_enum, alias = "export-dtype")]
    dtype: Option<megatrain::store::hf::ExportDtype>,
    /// A Hugging Face model directory whose tokenizer files, chat template and generation config
    /// go beside the weights. Default: the directory the run started from (`--init-from`),
    /// if it is still there.
    #[arg(long, value_name = "DIR")]
    tokenizer: Option<PathBuf>,
}

pub fn run(args: &ExportArgs) -> Result<()> {
    use megatrain::train::checkpoint;
    use megatrain::util::paths::{check_disjoint, PathUse, Use};
    let is_one = checkpoint::is_checkpoint(&args.checkpoint);
    // The checkpoint directory (the one given, or the one a step directory is in) is a live
    // run's to prune: the export may not go inside its checkpoints or take one's name.
    let root = match (is_one, args.checkpoint.parent()) {
        (true, Some(p)) => p.to_path_buf(),
        _ => args.checkpoint.clone(),
    };
    check_disjoint(&[
        PathUse::new(
            "--checkpoint (its checkpoint directory)",
            &root,
            Use::OwnedDir {
                owns: checkpoint::owns,
            },
        ),
        PathUse::new("--out", &args.out, Use::ReplacedDir),
    ])?;
    let dir = checkpoint::one_or_latest(&args.checkpoint)?;
    // Verified before anything in it is parsed: complete, and the params (all an export
    // reads) against their checksum.
    checkpoint::verify_params(&dir)?;
    let state = checkpoint::open(&dir)?;
    // The params only, unit by unit from the checkpoint's file: no host store, no moments.
    let layout = megatrain::store::layout::StateLayout::new(
        &state.model,
        megatrain::store::layout::Mode::Lean,
    );
    let mut params = checkpoint::CheckpointParams::open(&dir, &layout)?;
    let dtype = args.dtype.unwrap_or_else(|| {
        megatrain::store::hf::ExportDtype::default_for(layout.num_params() as u64)
    });
    let serving = match (&args.tokenizer, &state.config.init_from) {
        (Some(t), _) if !t.is_dir() => {
            return Err(megatrain::Error::bad_input(
                "--tokenizer",
                t.display().to_string(),
                "is not a directory",
                Some("pass the Hugging Face model directory that holds the tokenizer files"),
            ))
        }
        (Some(t), _) => Some(t.clone()),
        (None, Some(init)) if init.is_dir() => Some(init.clone()),
        (None, Some(init)) => {
            eprintln!(
                "note: the run started from {}, which is gone: the export has no tokenizer (pass --tokenizer DIR)",
                init.display()
            );
            None
        }
        (None, None) => None,
    };
    let opts = megatrain::store::hf::ExportOptions {
        serving_files_from: serving.as_deref(),
        ..megatrain::store::hf::ExportOptions::new(dtype)
    };
    megatrain::store::hf::export(&mut params, &layout, &args.out, 2 << 30, opts)?;
    let copied: Vec<&str> = megatrain::store::hf::SERVING_FILES
        .iter()
        .copied()
        .filter(|f| args.out.join(f).is_file())
        .collect();
    if let Some(from) = serving.as_ref().filter(|_| !copied.is_empty()) {
        eprintln!("with {} from {}", copied.join(", "), from.display());
    }
    eprintln!(
        "exported {} (step {}) to {} as {}{}",
        dir.display(),
        state.step,
        args.out.display(),
        dtype.torch_name(),
        megatrain::util::peak_rss_bytes().map_or(String::new(), |b| format!(
            " (peak RSS {})",
            megatrain::util::human_bytes(b)
        ))
    );
    Ok(())
}
