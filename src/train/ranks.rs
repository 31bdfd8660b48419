//! What a run does differently as one rank of a data-parallel job: its part of the host's CPUs,
//! its outputs (rank 0 writes the job's), the start every rank takes from rank 0, and the
//! settings every rank must share.

use super::config::TrainConfig;
use crate::dist::{Collective, HostShare};
use crate::model::config::ModelConfig;
use crate::store::layout::Mode;
use crate::{Error, Result};
use std::path::PathBuf;

/// Ranks sharing a host share its CPUs, as `torchrun` users set `OMP_NUM_THREADS` to the cores
/// per process: this rank is bound to its own contiguous part of the CPUs it may use — the
/// threads started from here on inherit it (the CPU device's kernels, sized to it unless
/// `RAYON_NUM_THREADS` says otherwise), and the AdamW workers take their node's CPUs within it
/// ([`super::setup::build_streamer`]).
pub(super) fn share_cpus(share: HostShare) -> Result<()> {
    if share.count == 1 {
        return Ok(());
    }
    let cpus = share.cpus(&crate::host::affinity::current_affinity()?);
    crate::host::affinity::pin_current_thread(&cpus)?;
    if std::env::var_os("RAYON_NUM_THREADS").is_none() {
        // Fails only if the pool already started, which setup does not do before this.
        let _ = rayon::ThreadPoolBuilder::new()
            .num_threads(cpus.len())
            .build_global();
    }
    Ok(())
}

/// Rank 0's run id and the checkpoint it resumes, told to every rank. Rank 0 keeps the id; the
/// others take it with their rank appended (their spill files, named by it, must not collide).
pub(super) fn share_start(
    world: &dyn Collective,
    id: &str,
    resume: Option<&PathBuf>,
) -> Result<(String, Option<PathBuf>)> {
    if world.size() == 1 {
        return Ok((id.to_owned(), resume.cloned()));
    }
    let mine = match world.rank() {
        0 => serde_json::json!({ "run_id": id, "resume": resume }).to_string(),
        _ => String::new(),
    };
    let all = world.all_gather_bytes(mine.as_bytes())?;
    let lead: serde_json::Value = all
        .first()
        .and_then(|b| serde_json::from_slice(b).ok())
        .ok_or_else(|| Error::internal("data-parallel start", "rank 0 sent no start"))?;
    let run_id = lead["run_id"].as_str().unwrap_or(id).to_owned();
    let resume = lead["resume"].as_str().map(PathBuf::from);
    Ok(match world.rank() {
        0 => (run_id, resume),
        r => (format!("{run_id}.{r}"), resume),
    })
}

/// The configuration rank `rank` runs: rank 0 (and a process on its own) as given; any other
/// rank without outputs — no metrics, TensorBoard, trace, export, validation or samples; the
/// checkpoint directory only read (rank 0 writes the job's checkpoints, the state being the same
/// on every rank).
pub(super) fn rank_outputs(cfg: &TrainConfig, rank: usize) -> TrainConfig {
    if rank == 0 {
        return cfg.clone();
    }
    TrainConfig {
        metrics: None,
        tensorboard: None,
        trace: None,
        export_hf: None,
        val_data: None,
        val_every: 0,
        sample_every: 0,
        sample_prompt: None,
        ..cfg.clone()
    }
}

/// What decides the order and sizes of the ranks' collectives — the mode, the micro-batches and
/// their shape, the parameters, the step they start at — must be the same on all: the first
/// rank that differs is named.
pub(super) fn check_step_agrees(
    world: &dyn Collective,
    cfg: &TrainConfig,
    mode: Mode,
    model: &ModelConfig,
    start_step: u64,
) -> Result<()> {
    crate::dist::check_same(
        world,
        "the step",
        &format!(
            "{} mode, {} micro-batch(es) of {}×{}, {} parameters, start at step {start_step}",
            mode.name(),
            cfg.grad_accum,
            cfg.batch_size,
            cfg.seq_len,
            model.num_params(),
        ),
    )
}
