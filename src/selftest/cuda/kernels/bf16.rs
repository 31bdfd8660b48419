//! The bf16 device's kernel families against their fp32 ones: the kernels that read bf16
//! weights (`f32w16`), and those that write a GEMM's or attention's input in bf16 (`f32w16o16`,
//! `f32o16`), bit for bit.

use super::{round_bf16, Gpu, Out};
use crate::device::cuda::launches::Dtype;
use crate::device::cuda::DevPtr;
use crate::device::launch;
use crate::model::config::MlpActivation;
use crate::model::ops;
use crate::Result;
use cudarc::driver::CudaSlice;

/// The kernels that read a bf16 device's weights (`f32w16`: fp32 activations, bf16 weights)
/// against the fp32 kernels on the same weights widened to fp32: the same bits, as the weights
/// are the same numbers.
pub(super) fn bf16_weights(g: &Gpu<'_>) -> Result<Vec<Out>> {
    let (n, c, vocab, eps) = (50usize, 96usize, 40usize, 1e-5f32);
    let (ni, ci) = (n as i32, c as i32);
    let x = g.rnd(n * c, 30, 2.0);
    let dy = g.rnd(n * c, 31, 1.0);
    let tokens: Vec<u32> = (0..n).map(|i| (i * 7 % 13) as u32).collect();
    let norm: Vec<f32> = g.rnd(c, 32, 0.5).iter().map(|v| v + 1.0).collect();
    let (wte, bias) = (g.rnd(vocab * c, 33, 1.0), g.rnd(c, 34, 1.0));
    // Each output from both families: bf16 weights, and the same weights widened to fp32.
    let run = |dt: Dtype, [nw, ew, bw]: [DevPtr; 3]| -> Result<[Vec<f32>; 4]> {
        let (xd, dyd, td) = (g.up(&x)?, g.up(&dy)?, g.up(&tokens)?);
        let (yd, rd, dxd, ed, bd) = (
            g.zeros::<f32>(n * c)?,
            g.zeros::<f32>(n)?,
            g.zeros::<f32>(n * c)?,
            g.zeros::<f32>(n * c)?,
            g.up(&dy)?,
        );
        let (l, k) = (launch::per_row(n, c)?, g.k());
        // Gemma's `1 + w` norm: the offset added to the bf16 weights as to fp32 ones.
        let nw = (nw, 1.0);
        k.rmsnorm_fwd(dt, l, g.p(&yd), g.p(&rd), g.p(&xd), nw, ni, ci, eps)?;
        let (dx, r) = (g.p(&dxd), g.p(&rd));
        k.rmsnorm_bwd(dt, l, dx, g.p(&dyd), g.p(&xd), nw, r, ni, ci, false)?;
        let l = launch::elementwise(n * c, g.sms());
        k.embedding_fwd(dt, l, g.p(&ed), ew, g.p(&td), (ni, ci), 1.0)?;
        k.bias_fwd(dt, l, g.p(&bd), bw, ni, ci)?;
        Ok([g.down(&yd)?, g.down(&dxd)?, g.down(&ed)?, g.down(&bd)?])
    };
    let held = [g.up16(&norm)?, g.up16(&wte)?, g.up16(&bias)?];
    let bf16 = run(Dtype::F32W16, held.each_ref().map(|d| g.p(d)));
    let widened = [
        g.up(&round_bf16(&norm))?,
        g.up(&round_bf16(&wte))?,
        g.up(&round_bf16(&bias))?,
    ];
    let widened = run(Dtype::F32, widened.each_ref().map(|d| g.p(d)));
    let (bf16, widened) = (bf16?, widened?);
    Ok([
        "RMSNorm forward",
        "RMSNorm dx",
        "embedding forward",
        "bias forward",
    ]
    .iter()
    .zip(bf16.into_iter().zip(widened))
    .map(|(label, (got, want))| Out::new(label, got, want))
    .collect())
}

/// The kernels that write a GEMM's or attention's input in bf16 (RMSNorm `f32w16o16`, SwiGLU
/// forward and backward and RoPE `f32o16`) against their fp32-output kernels followed by the
/// cast a GEMM would apply (the one that stores V and dO): the same bits.
pub(super) fn bf16_stored_activations(g: &Gpu<'_>) -> Result<Vec<Out>> {
    let (n, c, eps) = (50usize, 96usize, 1e-5f32);
    let (ni, ci, len) = (n as i32, c as i32, n * c);
    let x = g.rnd(len, 40, 2.0);
    let norm: Vec<f32> = g.rnd(c, 41, 0.5).iter().map(|v| v + 1.0).collect();
    let (gate, up) = (g.rnd(len, 42, 3.0), g.rnd(len, 43, 1.0));
    let (xd, wd, gd, ud) = (g.up(&x)?, g.up16(&norm)?, g.up(&gate)?, g.up(&up)?);
    let (y16, h16) = (g.zeros::<u16>(len)?, g.zeros::<u16>(len)?);
    let (y32, h32, rd) = (
        g.zeros::<f32>(len)?,
        g.zeros::<f32>(len)?,
        g.zeros::<f32>(n)?,
    );
    let (cast16, l) = (g.zeros::<u16>(len)?, launch::per_row(n, c)?);
    let k = g.k();
    let (xp, wp, rp) = (g.p(&xd), (g.p(&wd), 0.0), g.p(&rd));
    k.rmsnorm_fwd(Dtype::F32W16O16, l, g.p(&y16), rp, xp, wp, ni, ci, eps)?;
    k.rmsnorm_fwd(Dtype::F32W16, l, g.p(&y32), rp, xp, wp, ni, ci, eps)?;
    let e = launch::elementwise(len, g.sms());
    k.cast_f32_bf16(e, g.p(&cast16), g.p(&y32), len as i64)?;
    let norm_cast = g.down16(&cast16)?;
    let (gp, up_p) = (g.p(&gd), g.p(&ud));
    let mut out = vec![Out::new("RMSNorm output", g.down16(&y16)?, norm_cast)];
    // The backward's d gate and d up, from the output's gradient.
    let dh = g.up(&g.rnd(len, 44, 1.0))?;
    let (dg16, du16) = (g.zeros::<u16>(len)?, g.zeros::<u16>(len)?);
    let (dg32, du32) = (g.zeros::<f32>(len)?, g.zeros::<f32>(len)?);
    let (dhp, n64) = (g.p(&dh), len as i64);
    let cast = |x: &CudaSlice<f32>| -> Result<Vec<f32>> {
        k.cast_f32_bf16(e, g.p(&cast16), g.p(x), n64)?;
        g.down16(&cast16)
    };
    for (act, name) in [
        (MlpActivation::Silu, "SwiGLU"),
        (MlpActivation::GeluTanh, "GeGLU"),
    ] {
        k.gated_fwd(act, Dtype::F32O16, e, g.p(&h16), gp, up_p, n64)?;
        k.gated_fwd(act, Dtype::F32, e, g.p(&h32), gp, up_p, n64)?;
        let h_cast = cast(&h32)?;
        let (dg, du) = (g.p(&dg16), g.p(&du16));
        k.gated_bwd(act, Dtype::F32O16, e, dg, du, dhp, gp, up_p, n64)?;
        let (dg, du) = (g.p(&dg32), g.p(&du32));
        k.gated_bwd(act, Dtype::F32, e, dg, du, dhp, gp, up_p, n64)?;
        let (dg_cast, du_cast) = (cast(&dg32)?, cast(&du32)?);
        out.extend([
            Out::new(&format!("{name} output"), g.down16(&h16)?, h_cast),
            Out::new(&format!("{name} d gate"), g.down16(&dg16)?, dg_cast),
            Out::new(&format!("{name} d up"), g.down16(&du16)?, du_cast),
        ]);
    }
    // RoPE storing Q (or K) from its fp32 projection: `len` = 50 rows of 3 heads of 32.
    let (heads, hd) = (3usize, 32usize);
    let rope = ops::Rope::new(hd, 10_000.0, n);
    let (cos, sin) = rope.tables();
    let pos = ops::document_positions(&[20, 1, 29]);
    let (cd, sd, pd) = (g.up(cos)?, g.up(sin)?, g.up(&pos)?);
    let (r16, r32) = (g.zeros::<u16>(len)?, g.zeros::<f32>(len)?);
    let l = launch::elementwise(len / 2, g.sms());
    let (cp, sp, pp, hi) = (g.p(&cd), g.p(&sd), g.p(&pd), heads as i32);
    for inverse in [false, true] {
        let rope_into =
            |dt: Dtype, y: DevPtr| k.rope(dt, inverse, l, y, xp, cp, sp, pp, ni, hi, hd as i32);
        rope_into(Dtype::F32O16, g.p(&r16))?;
        rope_into(Dtype::F32, g.p(&r32))?;
        let label = if inverse {
            "RoPE⁻¹ output"
        } else {
            "RoPE output"
        };
        out.push(Out::new(label, g.down16(&r16)?, cast(&r32)?));
    }
    Ok(out)
}
