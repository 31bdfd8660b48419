//! Memory per tier: the host state (and the Adam moments spilled to NVMe), where the
//! layer-input checkpoints go (the GPU, the host, or split), the GPU working set, and what a plan
//! lacks.

use super::{Hardware, PlanRequest, USABLE};
use crate::device::program::{
    bf16_device_bytes, bf16_staging_bytes, workspace_bytes, Shape, CHUNK_ALIGN,
};
use crate::device::Precision;
use crate::engine::schedule::{ActivationDtype, Activations};
use crate::model::config::ModelConfig;
use serde::Serialize;

/// Bytes per tier.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct MemoryPlan {
    /// Host bytes of the training state (params, grads, m, v, lean buffers).
    pub host_state_bytes: u64,
    /// Where the layer-input checkpoints go: on the GPU when they fit beside its working set
    /// (or as asked), else to host memory.
    pub activations: Activations,
    /// Under host activations, how many of the last blocks' inputs stay on the GPU all the
    /// same (as many as its memory holds beside the working set).
    pub device_inputs: usize,
    /// How they are stored.
    pub activation_dtype: ActivationDtype,
    /// Their bytes, wherever they are.
    pub activation_bytes: u64,
    /// Host bytes of the checkpoints when offloaded (0 on the GPU).
    pub host_activation_bytes: u64,
    /// Device working set: double buffers of weights and gradients, one layer's activations,
    /// the layer workspace, and the checkpoints when they are on the GPU.
    pub device_bytes: u64,
    /// Tokens a layer runs at once on the device: the micro-batch, or the largest token chunk
    /// whose workspace fits.
    pub layer_chunk_tokens: u64,
    /// NVMe bytes (spilled Adam moments).
    pub nvme_bytes: u64,
    /// Units whose m/v spill (of `units`).
    pub nvme_units: usize,
    /// Units in the layout.
    pub units: usize,
    /// Host bytes per parameter.
    pub host_bytes_per_param: f64,
}

/// The units whose Adam m/v go to NVMe under `req` on `hw`: the placement's own choice (the last
/// layers first, only what the usable host RAM lacks once activations are paid for), with the
/// staging bytes it costs.
pub fn spilled_units(model: &ModelConfig, req: &PlanRequest, hw: &Hardware) -> (Vec<usize>, u64) {
    if !req.spill_moments {
        return (Vec::new(), 0);
    }
    spilled_beside(
        model,
        req,
        hw,
        device_side(model, req, hw).host_activation_bytes,
    )
}

/// [`spilled_units`] beside `activations` bytes of host-kept checkpoints.
fn spilled_beside(
    model: &ModelConfig,
    req: &PlanRequest,
    hw: &Hardware,
    activations: u64,
) -> (Vec<usize>, u64) {
    if !req.spill_moments {
        return (Vec::new(), 0);
    }
    let layout = req.layout(model);
    let capacity = ((hw.host_ram_bytes as f64 * USABLE) as u64).saturating_sub(activations);
    crate::store::placement::choose_spill(
        &layout,
        crate::store::placement::SpillRequest {
            policy: crate::store::placement::SpillPolicy::Auto,
            slots: 3,
        },
        capacity,
    )
    .map(|(mut u, staging)| {
        u.sort_unstable();
        (u, staging)
    })
    .unwrap_or_default()
}

/// The device side of a plan: the working set with the checkpoints where they go, and their
/// host bytes when offloaded.
pub(super) struct DeviceSide {
    pub(super) activations: Activations,
    pub(super) device_inputs: usize,
    activation_bytes: u64,
    host_activation_bytes: u64,
    device_bytes: u64,
    layer_chunk_tokens: u64,
}

/// Where the layer-input checkpoints go and what the GPU holds: the layer workspace is fitted
/// beside the buffers of offloaded checkpoints (as the trainer fits it), then the checkpoints
/// stay on the GPU if the rest holds them (or as `req` asks).
pub(super) fn device_side(model: &ModelConfig, req: &PlanRequest, hw: &Hardware) -> DeviceSide {
    let layout = req.layout(model);
    let c = model.hidden_size as u64;
    let l = model.num_layers as u64;
    let tokens_mb = req.micro_tokens();
    // Two buffers of weights (bf16 under bf16: the device holds them as they cross) and of
    // fp32 gradients.
    let precision = if req.bf16 {
        Precision::Bf16
    } else {
        Precision::Fp32
    };
    let weight_bytes = match precision {
        Precision::Fp32 => 4,
        Precision::Bf16 => 2,
    };
    let double_buffers = 2 * layout.max_unit_numel() as u64 * (weight_bytes + 4);
    // bf16: the gradient staging is set aside; the GEMM operand buffers grow with the chunk and
    // are fitted with it, as the CUDA device does.
    let staging = bf16_staging_bytes(model, precision);
    // dx/dy and the two fp32 boundary buffers; under bf16 inputs two bf16 staging buffers of
    // the copies to and from the host. Then the device program's layer workspace (what the
    // devices allocate) in the largest token chunks that fit beside them.
    let input = tokens_mb * c * req.activation_dtype.elem_bytes();
    let offload_staging = match req.activation_dtype {
        ActivationDtype::Fp32 => 0,
        ActivationDtype::Bf16 => 2 * input,
    };
    let boundary = 4 * tokens_mb * c * 4 + offload_staging;
    let gpu_budget = (hw.gpu_memory_bytes as f64 * USABLE) as u64;
    let shape = layer_chunks(
        model,
        (req, precision),
        gpu_budget.saturating_sub(double_buffers + boundary + staging),
    );
    let offloaded = double_buffers
        + workspace_bytes(model, shape, precision)
        + boundary
        + bf16_device_bytes(model, shape, precision);
    // On the GPU: fp32 inputs are the L+1 boundary buffers themselves (replacing the two),
    // bf16 ones L bf16 buffers beside the two (replacing the staging).
    let stored = l * input;
    let on_gpu = match req.activation_dtype {
        ActivationDtype::Fp32 => offloaded - 2 * tokens_mb * c * 4 + (l + 1) * input,
        ActivationDtype::Bf16 => offloaded - offload_staging + stored,
    };
    // Under host activations, the last k blocks' inputs kept on the GPU beside the offloaded
    // ones' buffers: k buffers of their own (fp32: and the head's input).
    let kept_bytes = |k: u64| match (req.activation_dtype, k) {
        (_, 0) => 0,
        (ActivationDtype::Fp32, k) => (k + 1) * input,
        (ActivationDtype::Bf16, k) => k * input,
    };
    let (activations, kept) = match req.activations {
        Some(Activations::Host) => (Activations::Host, 0),
        Some(a) => (a, l),
        None if on_gpu <= gpu_budget => (Activations::Device, l),
        None => {
            let room = gpu_budget.saturating_sub(offloaded) / input.max(1);
            let k = match req.activation_dtype {
                ActivationDtype::Fp32 => room.saturating_sub(1),
                ActivationDtype::Bf16 => room,
            };
            (Activations::Host, k.min(l.saturating_sub(1)))
        }
    };
    let (host_activation_bytes, device_bytes) = match activations {
        Activations::Host => ((l - kept) * input, offloaded + kept_bytes(kept)),
        _ => (0, on_gpu),
    };
    DeviceSide {
        activations,
        device_inputs: kept as usize,
        activation_bytes: stored,
        host_activation_bytes,
        device_bytes,
        layer_chunk_tokens: shape.chunk_rows() as u64,
    }
}

/// Memory per tier for `model` under `req` on `hw`.
pub fn memory(model: &ModelConfig, req: &PlanRequest, hw: &Hardware) -> MemoryPlan {
    let layout = req.layout(model);
    let mut host = layout.total_bytes();
    let dev = device_side(model, req, hw);
    let (spilled, staging) = spilled_beside(model, req, hw, dev.host_activation_bytes);
    let nvme: u64 = spilled.iter().map(|&u| layout.moment_bytes(u)).sum();
    // The spill tier's staging slots (read ahead, update, write back) replace what spills.
    host = host - nvme + staging;
    MemoryPlan {
        host_state_bytes: host,
        activations: dev.activations,
        device_inputs: dev.device_inputs,
        activation_dtype: req.activation_dtype,
        activation_bytes: dev.activation_bytes,
        host_activation_bytes: dev.host_activation_bytes,
        device_bytes: dev.device_bytes,
        layer_chunk_tokens: dev.layer_chunk_tokens,
        nvme_bytes: nvme,
        nvme_units: spilled.len(),
        units: layout.units.len(),
        host_bytes_per_param: host as f64 / layout.num_params().max(1) as f64,
    }
}

/// The micro-batch's shape, unchunked.
fn micro_shape(req: &PlanRequest) -> Shape {
    let t = req.seq_len.min(req.micro_tokens()) as usize;
    let b = (req.micro_tokens() as usize / t.max(1)).max(1);
    Shape::whole(b, t)
}

/// The micro-batch's shape on the device: the largest token chunks whose layer workspace fits
/// `budget` bytes, or the smallest chunks when none does (the plan then reports the shortfall).
fn layer_chunks(
    model: &ModelConfig,
    (req, precision): (&PlanRequest, Precision),
    budget: u64,
) -> Shape {
    let whole = micro_shape(req);
    let (b, t) = (whole.b, whole.t);
    whole
        .fit(model, precision, budget, "the GPU")
        .unwrap_or_else(|_| {
            Shape::chunked(b, t, CHUNK_ALIGN.min(t.max(1))).unwrap_or(Shape::whole(b, t))
        })
}

/// What `m` lacks on `hw`, one line per exhausted memory (empty when it fits). `hw` is one
/// rank's share of its machine; `ranks_per_node` only changes how the host's lack is said (for
/// the machine's ranks together).
pub(super) fn shortfalls(m: &MemoryPlan, hw: &Hardware, ranks_per_node: u64) -> Vec<String> {
    let host_cap = (hw.host_ram_bytes as f64 * USABLE) as u64;
    let dev_cap = (hw.gpu_memory_bytes as f64 * USABLE) as u64;
    let host_need = m.host_state_bytes + m.host_activation_bytes;
    let mut why = Vec::new();
    let hb = crate::util::human_bytes;
    if host_need > host_cap {
        // `hw` is one rank's share of its machine: say it for the machine's ranks together.
        let k = ranks_per_node.max(1);
        why.push(match k {
            1 => format!(
                "host needs {} of {} usable: {} missing",
                hb(host_need),
                hb(host_cap),
                hb(host_need - host_cap)
            ),
            k => format!(
                "host needs {} per rank, {} for the {k} ranks of a machine, of {} usable: {} missing",
                hb(host_need),
                hb(host_need.saturating_mul(k)),
                hb(host_cap.saturating_mul(k)),
                hb((host_need - host_cap).saturating_mul(k))
            ),
        });
    }
    if m.device_bytes > dev_cap {
        why.push(format!(
            "GPU needs {} of {} usable: {} missing",
            crate::util::human_bytes(m.device_bytes),
            crate::util::human_bytes(dev_cap),
            crate::util::human_bytes(m.device_bytes - dev_cap)
        ));
    }
    why
}
