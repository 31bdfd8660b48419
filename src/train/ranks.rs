//! What a run does differently as one rank of a data-parallel job: its outputs (rank 0 writes
//! the job's), the start every rank takes from rank 0, the settings every rank must share, its
//! share of a sharded job's state, and its GPU. (Its part of the host's CPUs:
//! [`crate::dist::HostShare::bind`].)

use super::config::{DeviceKind, ParamGather, TrainConfig};
use super::Progress;
use crate::dist::Collective;
use crate::model::config::ModelConfig;
use crate::store::layout::{Mode, ShardKind, StateLayout, UnitOwners};
use crate::{Error, Result};
use std::path::PathBuf;

/// Join the job a launcher started this process in, for ranks that train on `device`: alone
/// ([`crate::dist::solo`]) when no launcher started several; over MPI under `mpirun` and
/// `srun` ([`crate::dist::join`]); under `torchrun`, which starts its ranks without MPI, at its
/// store and over NCCL between the ranks' GPUs (`--device cuda`,
/// [`crate::device::cuda::world`]). CPU-device ranks need MPI: under torchrun they are
/// refused with the reason.
pub fn join(
    launch: Option<&crate::dist::Launch>,
    device: DeviceKind,
) -> Result<std::sync::Arc<dyn Collective>> {
    let Some(l) = launch.filter(|l| l.size > 1) else {
        return Ok(crate::dist::solo());
    };
    if l.launcher != crate::dist::launch::TORCHRUN {
        return crate::dist::join(l);
    }
    #[cfg(feature = "cuda")]
    if device == DeviceKind::Cuda {
        return crate::device::cuda::world::join_torchrun(l);
    }
    let why = match device {
        DeviceKind::Cuda => "this megatrain was built without CUDA: torchrun's ranks reach each other through NCCL between their GPUs",
        _ => "torchrun starts its ranks without MPI, and ranks on the CPU device exchange through MPI (torchrun's ranks reach each other through NCCL, between GPUs: --device cuda)",
    };
    Err(Error::bad_input(
        "launch",
        format!("torchrun (rank {} of {})", l.rank, l.size),
        why,
        Some("start CPU-device ranks with `mpirun -np N megatrain train …` or `srun megatrain train …` (a build with --features mpi); start GPU ranks with torchrun from a build with --features cuda"),
    ))
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
/// on every rank). `gathers_params` (ZeRO stage 3): every rank validates and draws the samples
/// (rank 0 alone reports them), since each pass gathers every unit's params from the rank
/// holding them; the ranks compute the same logits, so they draw the same tokens and make the
/// same passes.
pub(super) fn rank_outputs(cfg: &TrainConfig, rank: usize, gathers_params: bool) -> TrainConfig {
    if rank == 0 {
        return cfg.clone();
    }
    let passes = match gathers_params {
        true => (
            cfg.val_data.clone(),
            cfg.val_every,
            cfg.sample_every,
            cfg.sample_prompt.clone(),
        ),
        false => (None, 0, 0, None),
    };
    let (val_data, val_every, sample_every, sample_prompt) = passes;
    TrainConfig {
        metrics: None,
        tensorboard: None,
        trace: None,
        export_hf: None,
        val_data,
        val_every,
        sample_every,
        sample_prompt,
        ..cfg.clone()
    }
}

/// What rank 0 of a job whose params are sharded (ZeRO stage 3) cannot do alone: export from
/// the store (it exports from the final checkpoint instead, which needs a checkpoint
/// directory).
pub(super) fn check_sharded_outputs(cfg: &TrainConfig) -> Result<()> {
    if cfg.export_hf.is_some() && cfg.checkpoint_dir.is_none() {
        return Err(Error::bad_input(
                "setting",
                "export_hf",
                "a job whose params are sharded (--zero-stage 3) exports from its final checkpoint, so it needs --checkpoint-dir",
                Some("add --checkpoint-dir DIR"),
            ));
    }
    Ok(())
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
            "{} mode on the {} device in {}, {} Adam state, ZeRO stage {} (params gathered: {:?}), {} micro-batch(es) of {}×{}, {} parameters, start at step {start_step}",
            mode.name(),
            format!("{:?}", cfg.device).to_lowercase(),
            cfg.resolved_precision().name(),
            cfg.adam_state.unwrap_or_default().name(),
            cfg.zero_stage,
            cfg.param_gather,
            cfg.grad_accum,
            cfg.batch_size,
            cfg.seq_len,
            model.num_params(),
        ),
    )
}

/// The GPU a rank computes on, and how many ranks of the job compute on it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct GpuSlot {
    /// The GPU's ordinal among those this process sees.
    pub ordinal: usize,
    /// Ranks of the job on this GPU (they split its memory), 1 alone.
    pub shared_by: usize,
}

impl GpuSlot {
    /// A process on its own: the first GPU it sees, all of it.
    pub const ALONE: GpuSlot = GpuSlot {
        ordinal: 0,
        shared_by: 1,
    };
}

/// How many of the ranks' GPU keys (`host/UUID`, in rank order) are `rank`'s.
#[cfg_attr(not(feature = "cuda"), allow(dead_code))]
fn sharing(keys: &[String], rank: usize) -> usize {
    keys.get(rank)
        .map_or(1, |mine| keys.iter().filter(|k| *k == mine).count())
}

/// This rank's GPU ([`crate::dist::HostShare::gpu`]) and how many ranks share it, on the `device` the run
/// trains on: every rank of a CUDA job tells the others its GPU's UUID and host, so ranks that
/// the launcher or the rule above put on one GPU — a UUID names a GPU, where
/// `CUDA_VISIBLE_DEVICES` renumbers them — each take their share of its memory. Collective for
/// a CUDA job ([`check_step_agrees`] has checked every rank runs on the same device); a rank
/// that cannot list its GPUs is named to the others. Alone, or on the CPU device:
/// [`GpuSlot::ALONE`] (as in a build without CUDA, which refuses the CUDA device).
pub(super) fn gpu_slot(world: &dyn Collective, device: DeviceKind) -> Result<GpuSlot> {
    if device != DeviceKind::Cuda || world.size() == 1 {
        return Ok(GpuSlot::ALONE);
    }
    #[cfg(feature = "cuda")]
    return shared_gpu(world);
    #[cfg(not(feature = "cuda"))]
    Ok(GpuSlot::ALONE)
}

/// [`gpu_slot`] of a rank of a CUDA job.
#[cfg(feature = "cuda")]
fn shared_gpu(world: &dyn Collective) -> Result<GpuSlot> {
    let share = crate::dist::HostShare::of(world);
    let mine = crate::device::cuda::CudaRuntime::visible_gpus().and_then(|gpus| {
        if gpus.is_empty() {
            return Err(Error::bad_input(
                "GPU",
                format!("rank {} on {}", world.rank(), world.host()),
                "the driver sees no GPU",
                Some("check nvidia-smi and CUDA_VISIBLE_DEVICES"),
            ));
        }
        let ordinal = share.gpu(gpus.len());
        Ok((ordinal, format!("{}/{}", world.host(), gpus[ordinal])))
    });
    let said = match &mine {
        Ok((_, key)) => format!("ok {key}"),
        Err(e) => format!("error {e}"),
    };
    let all = world.all_gather_bytes(said.as_bytes())?;
    let (ordinal, _) = mine?;
    let mut keys = Vec::with_capacity(all.len());
    for (r, b) in all.iter().enumerate() {
        let s = String::from_utf8_lossy(b);
        match s.split_once(' ') {
            Some(("ok", key)) => keys.push(key.to_owned()),
            _ => {
                return Err(Error::system(
                    "CUDA",
                    format!("rank {r} (on {}) opening its GPU", world.hosts()[r]),
                    s.trim_start_matches("error "),
                ))
            }
        }
    }
    Ok(GpuSlot {
        ordinal,
        shared_by: sharing(&keys, world.rank()),
    })
}

/// This rank's share of a sharded job's state (`--zero-stage` over several ranks): the units
/// [`UnitOwners::deal`] gives it, whose Adam moments it holds and updates — at stage 3 their
/// params too (gathered GPU to GPU where `device_gather`, else through host memory for
/// `host_gather_why`), and in exact mode their gradients — with notes of what it holds and how
/// the params travel.
pub(super) fn shard_state(
    world: &dyn Collective,
    cfg: &TrainConfig,
    layout: StateLayout,
    device_gather: bool,
    host_gather_why: Option<String>,
    progress: &mut dyn Progress,
) -> StateLayout {
    let owners = UnitOwners::deal(&layout, world.size(), world.rank());
    let owners = match (cfg.zero_stage, device_gather) {
        (3, true) => owners.with_params().with_device_gather(),
        (3, false) => owners.with_params(),
        _ => owners,
    };
    // Exact mode: the gradients too (each micro-batch's summed across the ranks at once,
    // on their owner's shard).
    let owners = match owners.params && layout.mode == Mode::Exact {
        true => owners.with_grads(),
        false => owners,
    };
    let kinds: &[ShardKind] = match (owners.params, owners.grads) {
        (true, true) => &[
            ShardKind::Params,
            ShardKind::Grads,
            ShardKind::AdamM,
            ShardKind::AdamV,
        ],
        (true, false) => &[ShardKind::Params, ShardKind::AdamM, ShardKind::AdamV],
        _ => &[ShardKind::AdamM, ShardKind::AdamV],
    };
    let sharded_bytes = |l: &StateLayout| kinds.iter().map(|&k| l.kind_bytes(k)).sum::<u64>();
    let job = sharded_bytes(&layout);
    let held = (0..layout.units.len()).filter(|&u| owners.holds(u)).count();
    let layout = layout.with_owners(owners);
    progress.note(&format!(
        "ZeRO stage {}: rank {} holds and updates the {} of {held} of {} units ({} of the job's {} bytes)",
        cfg.zero_stage,
        world.rank(),
        match (cfg.zero_stage, layout.lands_grads()) {
            (3, true) => "params, gradients and Adam moments",
            (3, false) => "params and Adam moments",
            _ => "Adam moments",
        },
        layout.units.len(),
        sharded_bytes(&layout),
        job
    ));
    if layout.gathers_params() {
        let through = match world.on_gpus() {
            true => "host memory (NCCL, staged through the GPUs)",
            false => "host memory (MPI)",
        };
        progress.note(&match (layout.gathers_on_device(), host_gather_why) {
            (true, _) => "params gathered GPU to GPU: each unit's owner copies it to its GPU, NCCL broadcasts it to the others'".to_owned(),
            (false, Some(why)) => format!("params gathered through {through}: {why}"),
            (false, None) => format!("params gathered through {through}"),
        });
    }
    layout
}

/// Whether a job with sharded params gathers them GPU to GPU over NCCL (`--param-gather`),
/// and why not where it does not. Every rank must take the same path (the schedule is the
/// job's), so each says whether it can — a GPU of its own (under `auto`), NCCL found — and the
/// job takes NCCL only if every rank can; `nccl` insists, naming the first rank that cannot.
/// Collective for a CUDA job with `--zero-stage 3`.
pub(super) fn gathers_on_device(
    world: &dyn Collective,
    cfg: &TrainConfig,
    gpu: GpuSlot,
) -> Result<(bool, Option<String>)> {
    if cfg.device != DeviceKind::Cuda || cfg.zero_stage != 3 || world.size() == 1 {
        return Ok((false, None));
    }
    if cfg.param_gather == ParamGather::Host {
        return Ok((false, Some("--param-gather host".into())));
    }
    if cfg.param_gather == ParamGather::Auto && world.on_gpus() {
        // Two communicators of the same GPUs, one on the device's streams and one on the
        // world's, could each wait for the other on some rank: taken only when asked for.
        return Ok((false, Some("the job's collectives already run over NCCL (torchrun): a second communicator for the params is taken only with --param-gather nccl".into())));
    }
    let why_not = if cfg.param_gather == ParamGather::Auto && gpu.shared_by > 1 {
        format!(
            "its GPU is shared by {} ranks (NCCL needs a GPU per rank)",
            gpu.shared_by
        )
    } else {
        crate::device::stack::nccl::find().map_or_else(|e| e.to_string(), |_| String::new())
    };
    let all = world.all_gather_bytes(why_not.as_bytes())?;
    let Some((rank, why)) = all.iter().enumerate().find(|(_, b)| !b.is_empty()) else {
        return Ok((true, None));
    };
    let why = format!("rank {rank}: {}", String::from_utf8_lossy(why));
    match cfg.param_gather {
        ParamGather::Nccl => Err(Error::bad_input(
            "--param-gather",
            "nccl",
            why,
            Some("pass --param-gather host (through host memory), or give every rank a GPU of its own and NCCL (`pip install nvidia-nccl-cu13`, or MEGATRAIN_NCCL_LIB)"),
        )),
        _ => Ok((false, Some(why))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ranks_take_their_hosts_gpus_in_turn() {
        let share = |index, count| crate::dist::HostShare { index, count };
        // Enough GPUs: local rank i on GPU i.
        assert_eq!(
            (0..4).map(|i| share(i, 4).gpu(8)).collect::<Vec<_>>(),
            [0, 1, 2, 3]
        );
        // One visible each (the launcher's choice), or fewer than ranks: in turn.
        assert_eq!(share(3, 4).gpu(1), 0);
        assert_eq!(
            (0..4).map(|i| share(i, 4).gpu(3)).collect::<Vec<_>>(),
            [0, 1, 2, 0]
        );
        assert_eq!(share(0, 1).gpu(0), 0);
    }

    #[test]
    fn ranks_on_one_gpu_count_each_other() {
        let keys: Vec<String> = ["a/GPU-1", "a/GPU-2", "a/GPU-1", "b/GPU-1"]
            .iter()
            .map(|s| s.to_string())
            .collect();
        // The same UUID on another host is another GPU.
        assert_eq!(
            (0..4).map(|r| sharing(&keys, r)).collect::<Vec<_>>(),
            [2, 1, 2, 1]
        );
        assert_eq!(sharing(&keys, 9), 1);
    }
}
