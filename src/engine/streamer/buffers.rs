//! The device buffers a step allocates: each schedule buffer's length, and the bytes of them
//! all (the planned working set the trainer fits beside the layer workspace).

use crate::device::Precision;
use crate::engine::schedule::{
    schedule, ActivationDtype, Activations, DevBuf, LeanPieces, ScheduleSpec,
};
use crate::store::layout::{MasterFormat, StateLayout};

/// The precision of a GPU streaming `layout`'s master: bf16 for planes (their high plane is
/// the bf16 copy), else fp32. What the planned working set assumes ([`device_bytes`]).
fn device_precision(layout: &StateLayout) -> Precision {
    match layout.master {
        MasterFormat::Fp32 => Precision::Fp32,
        MasterFormat::Planes => Precision::Bf16,
    }
}

/// Elements (4-byte words) of schedule buffer `b` for micro-batches of `n` tokens on a GPU
/// streaming `layout`'s master.
pub fn buffer_len(layout: &StateLayout, n: usize, b: DevBuf) -> usize {
    match b {
        DevBuf::W(_) | DevBuf::G(_) => layout.max_unit_numel(),
        DevBuf::GEmb => layout.units[0].numel,
        DevBuf::D(_) | DevBuf::A(_) | DevBuf::S(_) => n * layout.config.hidden_size,
        DevBuf::K(_) => {
            crate::device::program::internals_len(&layout.config, n, device_precision(layout))
        }
    }
}

/// Bytes of device buffers the streamer allocates for this shape (the scheduled working set,
/// the same for any depth with host activations).
pub fn device_bytes(
    layout: &StateLayout,
    batch: usize,
    seq: usize,
    micro_batches: usize,
    (activations, activation_dtype, device_inputs): (Activations, ActivationDtype, usize),
) -> u64 {
    let spec = ScheduleSpec {
        layers: layout.config.num_layers,
        tied: layout.config.tie_word_embeddings,
        micro_batches,
        mode: layout.mode,
        activations,
        activation_dtype,
        device_inputs,
        lean_pieces: LeanPieces::of(layout),
        ranks: 1,
        gather: crate::engine::schedule::Gather::No,
        land: false,
    };
    // A bf16 device (a planes master streams bf16) holds its weights in bf16.
    let weight_bytes = match device_precision(layout) {
        Precision::Fp32 => 4,
        Precision::Bf16 => 2,
    };
    schedule(&spec)
        .buffers
        .iter()
        .map(|b| {
            let elem = match b {
                DevBuf::W(_) => weight_bytes,
                DevBuf::S(_) => 2,
                _ => 4,
            };
            elem * buffer_len(layout, batch * seq, *b) as u64
        })
        .sum()
}
