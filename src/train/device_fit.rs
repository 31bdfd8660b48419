//! What the step needs of the device's memory, decided before anything is built: the CPU
//! device's token chunks within `--device-memory` (and the host memory beside the state), where
//! the layer-boundary activations go, and the working set beside the layer workspace.

use super::config::{self, TrainConfig};
use super::Progress;
use crate::device::program::Shape;
use crate::device::Precision;
use crate::engine::Activations;
use crate::store::layout::{MasterFormat, StateLayout};
use crate::util::human_bytes;
use crate::{Error, Result};

/// The CPU device's memory is allocated on the host: the token chunks whose layer workspace fits
/// `--device-memory` beside the schedule's buffers ([`step_buffers`]), checked against the host
/// memory free beside the state (`host_room`), before the templates and the device are built.
pub(super) fn check_device_budget(
    cfg: &TrainConfig,
    layout: &StateLayout,
    host_room: u64,
) -> Result<()> {
    if cfg.device != config::DeviceKind::Cpu {
        return Ok(());
    }
    let shape = cpu_shape(cfg, layout)?;
    // The CPU device holds in fp32 what a bf16 GPU holds in bf16 (the stored workspace regions
    // and kept internals, the weights): it charges a GPU's bytes, the host gives fp32's.
    let held = layout.clone().with_master(MasterFormat::Fp32);
    let need = crate::device::program::workspace_bytes(&layout.config, shape, Precision::Fp32)
        + step_buffers(cfg, &held);
    if need > host_room {
        return Err(Error::bad_input(
            "host memory",
            human_bytes(host_room),
            format!(
                "the CPU device's working set needs {} of host memory, but only {} is free beside the training state",
                human_bytes(need),
                human_bytes(host_room)
            ),
            Some("lower --batch-size or --seq-len"),
        ));
    }
    Ok(())
}

/// Device bytes of the step's buffers with the activations as set, else offloaded (the least the
/// schedule needs): the token chunks are fitted beside them.
pub(super) fn step_buffers(cfg: &TrainConfig, layout: &StateLayout) -> u64 {
    crate::engine::device_bytes(
        layout,
        cfg.batch_size,
        cfg.seq_len,
        cfg.grad_accum,
        (
            cfg.activations.unwrap_or(Activations::Host),
            cfg.resolved_activation_dtype(),
            0,
        ),
    )
}

/// The CPU device's shape: the largest token chunks whose workspace fits `--device-memory`
/// beside the step's buffers.
pub(super) fn cpu_shape(cfg: &TrainConfig, layout: &StateLayout) -> Result<Shape> {
    let reserve = step_buffers(cfg, layout);
    let drop_keep = if cfg.activations == Some(Activations::Keep) {
        ", or drop --activations keep (the layer inputs alone, recomputed in the backward, need far less)"
    } else {
        ""
    };
    if reserve >= cfg.device_memory {
        return Err(Error::bad_input(
            "--device-memory",
            human_bytes(cfg.device_memory),
            format!(
                "is less than the step's weight, gradient and activation buffers alone ({}), before any layer workspace",
                human_bytes(reserve)
            ),
            Some(&format!(
                "raise --device-memory above {}, or lower --batch-size / --seq-len{drop_keep}",
                human_bytes(reserve)
            )),
        ));
    }
    Shape::whole(cfg.batch_size, cfg.seq_len)
        .fit(
            &layout.config,
            // As in fp32 (no smaller in bf16): the CPU device holds bf16 values in fp32 storage
            // and rounds bf16 operands in host scratch, outside its arena.
            Precision::Fp32,
            cfg.device_memory.saturating_sub(reserve),
            &format!(
                "--device-memory {}, {} of it for the step's weight, gradient and activation buffers",
                human_bytes(cfg.device_memory),
                human_bytes(reserve)
            ),
        )
        .map_err(|e| {
            e.with_fix(format!(
                "raise --device-memory, or lower --batch-size / --seq-len{drop_keep}"
            ))
        })
}

/// Say what the device runs on (a GPU: the driver and libraries in use), and how it runs each
/// layer: the whole micro-batch at once, or in token chunks.
pub(super) fn note_chunks(device: &dyn crate::device::Device, progress: &mut dyn Progress) {
    for line in device.describe() {
        progress.note(&format!("device: {line}"));
    }
    let s = device.shape();
    if s.is_chunked() {
        progress.note(&format!(
            "token chunks: layers run {} tokens at a time ({} sequence(s) of {}; chosen: the largest whose layer workspace fits the device memory)",
            s.chunk_rows(),
            s.b,
            s.t
        ));
    }
}

/// Layer-boundary activations: as set, else every block's internals kept on the device when the
/// layers run unchunked and they fit (no recompute), else the layer inputs on the device when
/// they fit, else offloaded to host — all but the last blocks' inputs that the device still has
/// room for. Returns the choice and how many blocks' inputs stay on the device under `host`.
pub(super) fn choose_activations(
    cfg: &TrainConfig,
    device: &dyn crate::device::Device,
    layout: &StateLayout,
    progress: &mut dyn Progress,
) -> (Activations, usize) {
    if let Some(a) = cfg.activations {
        return (a, 0);
    }
    let mem = device.memory();
    let free = mem.capacity.saturating_sub(mem.in_use);
    let need = |a: Activations, kept: usize| {
        crate::engine::device_bytes(
            layout,
            cfg.batch_size,
            cfg.seq_len,
            cfg.grad_accum,
            (a, cfg.resolved_activation_dtype(), kept),
        )
    };
    let s = device.shape();
    let layers = layout.config.num_layers;
    let (cp, kept) = if !s.is_chunked() && need(Activations::Keep, 0) <= free {
        (Activations::Keep, 0)
    } else if need(Activations::Device, 0) <= free {
        (Activations::Device, 0)
    } else {
        // The most last blocks' inputs that fit beside the offloaded ones' buffers (the bytes
        // grow with the count).
        let kept = (0..layers)
            .rev()
            .find(|&k| need(Activations::Host, k) <= free)
            .unwrap_or(0);
        (Activations::Host, kept)
    };
    let dtype = cfg.resolved_activation_dtype().name();
    progress.note(&format!(
        "activations: {} (chosen: {} needed with them there, {} available)",
        match (cp, kept) {
            (Activations::Keep, _) => "every layer's internals kept on the device (no recompute)".to_owned(),
            (Activations::Device, _) => format!("layer inputs on the device in {dtype} (the backward recomputes)"),
            (Activations::Host, 0) => format!("layer inputs offloaded to host in {dtype} (the backward recomputes)"),
            (Activations::Host, k) => format!(
                "layer inputs in {dtype}: the last {k} of {layers} blocks' on the device, the rest offloaded to host (the backward recomputes)"
            ),
        },
        human_bytes(need(cp, kept)),
        human_bytes(free)
    ));
    (cp, kept)
}

/// The step's working set must fit the device beside its layer workspace.
pub(super) fn check_working_set(
    cfg: &TrainConfig,
    device: &dyn crate::device::Device,
    layout: &StateLayout,
    (activations, device_inputs): (Activations, usize),
) -> Result<()> {
    let s = device.shape();
    if activations == Activations::Keep && s.is_chunked() {
        return Err(Error::bad_input(
            "--activations",
            "keep",
            format!(
                "keeping every layer's internals needs the layers unchunked, but the device runs them {} of {} tokens at a time",
                s.chunk_rows(),
                s.b * s.t
            ),
            Some("raise --device-memory, or pass --activations device or host"),
        ));
    }
    let mem = device.memory();
    let need = crate::engine::device_bytes(
        layout,
        cfg.batch_size,
        cfg.seq_len,
        cfg.grad_accum,
        (activations, cfg.resolved_activation_dtype(), device_inputs),
    );
    let free = mem.capacity.saturating_sub(mem.in_use);
    if need <= free {
        return Ok(());
    }
    Err(Error::bad_input(
        "device memory",
        human_bytes(mem.capacity),
        format!(
            "the step's working set needs {} (weight and gradient buffers, activations) but {} is free after the layer workspace",
            human_bytes(need),
            human_bytes(free)
        ),
        Some(&format!(
            "raise --device-memory by {} or lower --batch-size / --seq-len{}",
            human_bytes(need - free),
            match activations {
                Activations::Keep => ", or drop --activations keep (or pass --activations host)",
                Activations::Device => ", or pass --activations host",
                Activations::Host => "",
            }
        )),
    ))
}
