//! The mixture-of-experts MLP on checked host ranges (`model::ops::moe_fwd`/`moe_bwd`). Under
//! the bf16 recipe its input is the norm's bf16-kept output and the op rounds its GEMMs'
//! operands ([`MoeWeights::bf16_recipe`]).

use super::{views, HostP};
use crate::device::program::MoeAt;
use crate::model::ops::{self, AuxGrad, ExpertLoad, MoeGrads, MoeShape, MoeWeights};
use crate::Result;

/// See [`crate::device::program::Backend::moe_fwd`].
pub(super) fn forward(
    out: HostP,
    h: HostP,
    w: MoeAt<HostP>,
    rows: usize,
    (s, pad): (MoeShape, Option<&[u8]>),
    bf16: bool,
) -> Result<ExpertLoad> {
    let c = s.c;
    let h = moe_input(h, bf16)?;
    let [wr, wgu, wd, br, bgu, bd] = moe_ranges(w, s);
    let ([out], [h, router, gate_up, down, b_r, b_gu, b_d]) = views(
        "moe_fwd",
        [(out, rows * c)],
        [(h, rows * c), wr, wgu, wd, br, bgu, bd],
    )?;
    let w = weights(s, [router, gate_up, down, b_r, b_gu, b_d], bf16);
    let r = ops::moe_fwd(out, h, &w, rows, s);
    Ok(ExpertLoad::of(&r.expert, &r.probs, rows, s.experts, pad))
}

/// See [`crate::device::program::Backend::moe_bwd`].
#[allow(clippy::too_many_arguments)]
pub(super) fn backward(
    dh: HostP,
    g: MoeAt<HostP>,
    d_out: HostP,
    h: HostP,
    w: MoeAt<HostP>,
    rows: usize,
    (s, bf16): (MoeShape, bool),
    aux: Option<AuxGrad<'_>>,
) -> Result<()> {
    let c = s.c;
    let h = moe_input(h, bf16)?;
    if aux
        .is_some_and(|a| a.per_expert.len() != s.experts || a.pad.is_some_and(|p| p.len() != rows))
    {
        return Err(crate::Error::internal(
            "moe_bwd",
            "the load-balancing gradient is not one value per expert and a padding mask per row",
        ));
    }
    let [gr, ggu, gd, gbr, gbgu, gbd] = moe_ranges(g, s);
    let [wr, wgu, wd, br, bgu, bd] = moe_ranges(w, s);
    let (
        [dh, g_r, g_gu, g_d, g_br, g_bgu, g_bd],
        [d_out, h, router, gate_up, down, b_r, b_gu, b_d],
    ) = views(
        "moe_bwd",
        [(dh, rows * c), gr, ggu, gd, gbr, gbgu, gbd],
        [(d_out, rows * c), (h, rows * c), wr, wgu, wd, br, bgu, bd],
    )?;
    let grads = MoeGrads {
        router: g_r,
        gate_up: g_gu,
        down: g_d,
        biases: s.biases().then_some([g_br, g_bgu, g_bd]),
    };
    let w = weights(s, [router, gate_up, down, b_r, b_gu, b_d], bf16);
    ops::moe_bwd(dh, grads, d_out, h, &w, rows, s, aux);
    Ok(())
}

/// The weights from their six views ([`moe_ranges`]' order); `bf16_recipe`: the backend's.
fn weights<'a>(
    s: MoeShape,
    [router, gate_up, down, b_r, b_gu, b_d]: [&'a [f32]; 6],
    bf16_recipe: bool,
) -> MoeWeights<'a> {
    MoeWeights {
        router,
        gate_up,
        down,
        biases: s.biases().then_some([b_r, b_gu, b_d]),
        bf16_recipe,
    }
}

/// The MoE input as the op reads it: bf16-kept exactly under the bf16 recipe (the norm's
/// output, which only GEMMs read), read as the values it holds.
fn moe_input(h: HostP, bf16: bool) -> Result<HostP> {
    let (h, kept16) = h.plain();
    if kept16 != bf16 {
        return Err(crate::Error::internal(
            "moe",
            "the input is bf16-kept exactly under the bf16 recipe",
        ));
    }
    Ok(h)
}

/// An MoE MLP's six ranges at `at` (router, gate/up, down, and their biases — empty without
/// biases).
fn moe_ranges(at: MoeAt<HostP>, s: MoeShape) -> [(HostP, usize); 6] {
    let (e, c, i) = (s.experts, s.c, s.inter);
    let (b, lens) = match at.biases {
        Some(b) => (b, [e, e * 2 * i, e * c]),
        None => ([at.router; 3], [0; 3]),
    };
    [
        (at.router, e * c),
        (at.gate_up, e * 2 * i * c),
        (at.down, e * c * i),
        (b[0], lens[0]),
        (b[1], lens[1]),
        (b[2], lens[2]),
    ]
}
