//! The self-test's kernel cases: every kernel and GEMM on fresh random inputs against the CPU
//! reference (a table of cases, each a reference, a launch and a tolerance).

mod attention;
mod bf16;
mod expert_gemm;

use super::super::{compare, compare_bounded, Check};
use crate::device::cuda::launches::{Dtype, Launcher};
use crate::device::cuda::{drv, CudaRuntime, DevPtr};
use crate::device::launch;
use crate::model::config::MlpActivation;
use crate::model::ops;
use crate::optim::adamw::{bf16_to_f32, f32_to_bf16};
use crate::{Error, Result};
use attention::{attention_bf16, attention_bf16_inputs, attention_f32};
use bf16::{bf16_stored_activations, bf16_weights};
use cudarc::driver::{CudaSlice, DevicePtr, DeviceRepr, ValidAsZeroBits};
use expert_gemm::expert_gemms;

/// fp32 kernels differ from the CPU only in summation order and FMA.
const TOL_F32: f64 = 1e-4;
/// bf16 storage rounds every stored value to 8 bits of mantissa.
const TOL_BF16: f64 = 3e-2;
/// TF32 keeps 10 bits of each input's mantissa (rounded or truncated, by implementation), so a
/// product is within 2·2⁻¹⁰ of its fp32 value: the GEMM's error is bounded by that times
/// Σ|x·w| of its dot product (plus fp32 accumulation), which is what the TF32 check measures.
const TOL_TF32: f64 = 2.0 / 1024.0;
/// The attention backward recomputes the softmax with the fast exponential (`__expf`: 2 ulp plus
/// about 1.2·|x| ulp) and sums T products per entry in tiles, in another order than the CPU;
/// entries near zero (floored at 1e-3 of the largest) carry errors of a few fp32 ulps of the
/// largest entry.
const TOL_ATTN_BWD: f64 = 1e-3;
/// The tensor-core attention multiplies P and dS as two bf16 halves (hi + lo: 16 bits of
/// mantissa, 2⁻¹⁸ relative, where fp32 has 2⁻²⁴), so an entry's error is ~2⁻¹⁸ of the sum of its
/// terms' magnitudes. Relative to the comparison's floor (10⁻³ of the largest entry), that is
/// ~2·10⁻³ for entries near zero on these shapes (measured 1.2–2.1·10⁻³; the SIMT kernels' 64×
/// finer rounding gives 4·10⁻⁵–2·10⁻⁴ on the same inputs). A wrong mask or tile is O(1).
const TOL_FLASH: f64 = 5e-3;
/// The experts' grouped GEMMs multiply bf16 values exactly and sum in fp32 in another order
/// than the f64 reference: relative to Σ|a·b| an element's error is a few fp32 ulps (≤ 2⁻²⁴
/// per sum of the ≤ 300 terms here). A wrong fragment, tile or expert is O(1).
const TOL_EXPERT_GEMM: f64 = 1e-5;
/// What the CPU reference sees of a bf16-stored input: the value rounded to bf16 (RNE).
fn round_bf16(v: &[f32]) -> Vec<f32> {
    v.iter().map(|x| bf16_to_f32(f32_to_bf16(*x))).collect()
}

/// The GPU side of a case: uploads, downloads and launches on the runtime's stream.
struct Gpu<'a> {
    rt: &'a CudaRuntime,
    seed: u64,
}

impl Gpu<'_> {
    fn k(&self) -> Launcher<'_> {
        Launcher {
            rt: self.rt,
            stream: &self.rt.stream,
        }
    }

    fn rnd(&self, n: usize, k: u64, scale: f32) -> Vec<f32> {
        crate::util::uniform(n, self.seed.wrapping_add(k), scale)
    }

    fn up<T: DeviceRepr>(&self, x: &[T]) -> Result<CudaSlice<T>> {
        drv(self.rt.stream.clone_htod(x), "copy to the device")
    }

    fn up16(&self, x: &[f32]) -> Result<CudaSlice<u16>> {
        let bits: Vec<u16> = x.iter().map(|v| f32_to_bf16(*v)).collect();
        self.up(&bits)
    }

    fn zeros<T: DeviceRepr + ValidAsZeroBits>(&self, n: usize) -> Result<CudaSlice<T>> {
        drv(self.rt.stream.alloc_zeros::<T>(n), "allocate")
    }

    fn down(&self, x: &CudaSlice<f32>) -> Result<Vec<f32>> {
        drv(self.rt.stream.clone_dtoh(x), "copy to the host")
    }

    fn down16(&self, x: &CudaSlice<u16>) -> Result<Vec<f32>> {
        Ok(drv(self.rt.stream.clone_dtoh(x), "copy to the host")?
            .into_iter()
            .map(bf16_to_f32)
            .collect())
    }

    fn p<T>(&self, x: &CudaSlice<T>) -> DevPtr {
        x.device_ptr(&self.rt.stream).0
    }

    fn sms(&self) -> u32 {
        self.rt.sms
    }
}

/// One output compared: its label, what the GPU produced, what the CPU reference did, and how.
struct Out {
    label: String,
    got: Vec<f32>,
    want: Vec<f32>,
    /// Each element's error bound scale (the error is reported relative to it), instead of the
    /// reference value: for TF32, Σ|x·w| over the dot product.
    scale: Option<Vec<f32>>,
    /// This output's tolerance, where it differs from its case's.
    tolerance: Option<f64>,
}

impl Out {
    fn new(label: &str, got: Vec<f32>, want: Vec<f32>) -> Self {
        Out {
            label: label.to_owned(),
            got,
            want,
            scale: None,
            tolerance: None,
        }
    }

    fn tolerance(self, tolerance: f64) -> Self {
        Out {
            tolerance: Some(tolerance),
            ..self
        }
    }

    /// The same output with `prefix` before its label.
    fn label(self, prefix: &str) -> Self {
        Out {
            label: format!("{prefix}{}", self.label),
            ..self
        }
    }
}

/// One self-test case: a family of kernels (or a GEMM) on fresh inputs.
struct Case {
    name: &'static str,
    tolerance: f64,
    run: fn(&Gpu<'_>) -> Result<Vec<Out>>,
}

const CASES: &[Case] = &[
    Case {
        name: "rmsnorm f32",
        tolerance: TOL_F32,
        run: rmsnorm_f32,
    },
    Case {
        name: "rmsnorm (1 + w) f32",
        tolerance: TOL_F32,
        run: rmsnorm_one_plus_f32,
    },
    Case {
        name: "rmsnorm bf16",
        tolerance: TOL_BF16,
        run: rmsnorm_bf16,
    },
    Case {
        name: "swiglu f32",
        tolerance: TOL_F32,
        run: swiglu_f32,
    },
    Case {
        name: "geglu (tanh) f32",
        tolerance: TOL_F32,
        run: geglu_f32,
    },
    Case {
        name: "swiglu bf16",
        tolerance: TOL_BF16,
        run: swiglu_bf16,
    },
    Case {
        name: "rope f32",
        tolerance: TOL_F32,
        run: rope_f32,
    },
    Case {
        name: "attention f32",
        tolerance: TOL_F32,
        run: attention_f32,
    },
    Case {
        name: "attention on bf16 inputs (tensor cores; SIMT)",
        tolerance: TOL_FLASH,
        run: attention_bf16_inputs,
    },
    Case {
        name: "attention bf16",
        tolerance: TOL_BF16,
        run: attention_bf16,
    },
    Case {
        name: "cross-entropy f32",
        tolerance: TOL_F32,
        run: cross_entropy_f32,
    },
    Case {
        name: "cross-entropy bf16",
        tolerance: 10.0 * TOL_F32,
        run: cross_entropy_bf16,
    },
    Case {
        name: "sumsq",
        tolerance: TOL_F32,
        run: sumsq,
    },
    Case {
        name: "cast f32→bf16 (bit-exact)",
        tolerance: 0.0,
        run: cast,
    },
    Case {
        name: "embedding and bias/add f32",
        tolerance: TOL_F32,
        run: embedding_bias_add,
    },
    Case {
        name: "weights held in bf16 (f32w16, bit-exact)",
        tolerance: 0.0,
        run: bf16_weights,
    },
    Case {
        name: "activations stored in bf16 (bit-exact)",
        tolerance: 0.0,
        run: bf16_stored_activations,
    },
    Case {
        name: "gemm f32",
        tolerance: TOL_F32,
        run: gemm_f32,
    },
    Case {
        name: "gemm tf32",
        tolerance: TOL_TF32,
        run: gemm_tf32,
    },
    Case {
        name: "gemm bf16 (fp32 accumulate)",
        tolerance: 10.0 * TOL_F32,
        run: gemm_bf16,
    },
    Case {
        name: "expert GEMMs, grouped (tensor cores)",
        tolerance: TOL_EXPERT_GEMM,
        run: expert_gemms,
    },
];

/// Run every case on fresh random inputs (`seed`) against the CPU reference.
pub fn kernels(rt: &CudaRuntime, seed: u64) -> Result<Vec<Check>> {
    let gpu = Gpu { rt, seed };
    let mut out = Vec::new();
    for case in CASES {
        for o in (case.run)(&gpu)? {
            let name = format!("{}: {}", case.name, o.label);
            let tolerance = o.tolerance.unwrap_or(case.tolerance);
            out.push(match &o.scale {
                None => compare(&name, &o.got, &o.want, tolerance),
                Some(scale) => compare_bounded(&name, &o.got, &o.want, scale, tolerance),
            });
        }
    }
    drv(rt.stream.synchronize(), "synchronize")?;
    Ok(out)
}

const RMS: (usize, usize, f32) = (64, 1000, 1e-5);

fn rmsnorm_f32(g: &Gpu<'_>) -> Result<Vec<Out>> {
    rmsnorm_f32_with(g, 0.0)
}

/// Gemma's norm: weights near 0, applied as `1 + w`.
fn rmsnorm_one_plus_f32(g: &Gpu<'_>) -> Result<Vec<Out>> {
    rmsnorm_f32_with(g, 1.0)
}

/// RMSNorm forward and backward with weights `w_offset + w` (`w` near `1 − w_offset`).
fn rmsnorm_f32_with(g: &Gpu<'_>, w_offset: f32) -> Result<Vec<Out>> {
    let (n, c, eps) = RMS;
    let x = g.rnd(n * c, 1, 2.0);
    let w: Vec<f32> = g
        .rnd(c, 2, 0.5)
        .iter()
        .map(|v| v + 1.0 - w_offset)
        .collect();
    let dy = g.rnd(n * c, 3, 1.0);
    let (mut y_ref, mut rstd_ref) = (vec![0.0; n * c], vec![0.0; n]);
    ops::rmsnorm_fwd(&mut y_ref, &mut rstd_ref, &x, (&w, w_offset), c, eps);
    let mut dw_ref = vec![0.0; c];
    // dx accumulated onto a residual already there (the fused residual add).
    let residual = g.rnd(n * c, 4, 1.0);
    let mut dx_ref = residual.clone();
    let wo = (&w[..], w_offset);
    ops::rmsnorm_bwd(&mut dx_ref, true, &mut dw_ref, &dy, &x, wo, &rstd_ref, c);
    let (xd, wd, dyd) = (g.up(&x)?, g.up(&w)?, g.up(&dy)?);
    let (yd, rd) = (g.zeros::<f32>(n * c)?, g.zeros::<f32>(n)?);
    let (dxd, dwd) = (g.up(&residual)?, g.zeros::<f32>(c)?);
    let l = launch::per_row(n, c)?;
    let (ni, ci) = (n as i32, c as i32);
    let k = g.k();
    k.rmsnorm_fwd(
        Dtype::F32,
        l,
        g.p(&yd),
        g.p(&rd),
        g.p(&xd),
        (g.p(&wd), w_offset),
        ni,
        ci,
        eps,
    )?;
    k.rmsnorm_bwd(
        Dtype::F32,
        l,
        g.p(&dxd),
        g.p(&dyd),
        g.p(&xd),
        (g.p(&wd), w_offset),
        g.p(&rd),
        ni,
        ci,
        true,
    )?;
    k.rmsnorm_bwd_dw(
        Dtype::F32,
        launch::per_column(c),
        g.p(&dwd),
        g.p(&dyd),
        g.p(&xd),
        g.p(&rd),
        ni,
        ci,
    )?;
    Ok(vec![
        Out::new("forward", g.down(&yd)?, y_ref),
        Out::new("backward dx", g.down(&dxd)?, dx_ref),
        Out::new("backward dw", g.down(&dwd)?, dw_ref),
    ])
}

fn rmsnorm_bf16(g: &Gpu<'_>) -> Result<Vec<Out>> {
    let (n, c, eps) = RMS;
    let x = g.rnd(n * c, 1, 2.0);
    let w: Vec<f32> = g.rnd(c, 2, 0.5).iter().map(|v| v + 1.0).collect();
    // The reference sees the same rounded inputs.
    let (mut y_ref, mut rstd_ref) = (vec![0.0; n * c], vec![0.0; n]);
    ops::rmsnorm_fwd(
        &mut y_ref,
        &mut rstd_ref,
        &round_bf16(&x),
        (&round_bf16(&w), 0.0),
        c,
        eps,
    );
    let (xb, wb) = (g.up16(&x)?, g.up16(&w)?);
    let (yb, rd) = (g.zeros::<u16>(n * c)?, g.zeros::<f32>(n)?);
    let l = launch::per_row(n, c)?;
    g.k().rmsnorm_fwd(
        Dtype::Bf16,
        l,
        g.p(&yb),
        g.p(&rd),
        g.p(&xb),
        (g.p(&wb), 0.0),
        n as i32,
        c as i32,
        eps,
    )?;
    Ok(vec![Out::new("forward", g.down16(&yb)?, y_ref)])
}

const SWIGLU_N: usize = 100_003;

fn swiglu_f32(g: &Gpu<'_>) -> Result<Vec<Out>> {
    gated_f32(g, MlpActivation::Silu)
}

fn geglu_f32(g: &Gpu<'_>) -> Result<Vec<Out>> {
    gated_f32(g, MlpActivation::GeluTanh)
}

/// The gated MLP's activation `act`, forward and backward.
fn gated_f32(g: &Gpu<'_>, act: MlpActivation) -> Result<Vec<Out>> {
    let m = SWIGLU_N;
    let (gate, up, dh) = (g.rnd(m, 4, 3.0), g.rnd(m, 5, 1.0), g.rnd(m, 6, 1.0));
    let mut h_ref = vec![0.0; m];
    ops::gated_fwd(act, &mut h_ref, &gate, &up);
    let (mut dg_ref, mut du_ref) = (vec![0.0; m], vec![0.0; m]);
    ops::gated_bwd(act, &mut dg_ref, &mut du_ref, &dh, &gate, &up);
    let (gd, ud, dhd) = (g.up(&gate)?, g.up(&up)?, g.up(&dh)?);
    let (hd, dgd, dud) = (g.zeros::<f32>(m)?, g.zeros::<f32>(m)?, g.zeros::<f32>(m)?);
    let l = launch::elementwise(m, g.sms());
    let k = g.k();
    k.gated_fwd(act, Dtype::F32, l, g.p(&hd), g.p(&gd), g.p(&ud), m as i64)?;
    k.gated_bwd(
        act,
        Dtype::F32,
        l,
        g.p(&dgd),
        g.p(&dud),
        g.p(&dhd),
        g.p(&gd),
        g.p(&ud),
        m as i64,
    )?;
    Ok(vec![
        Out::new("forward", g.down(&hd)?, h_ref),
        Out::new("backward dgate", g.down(&dgd)?, dg_ref),
        Out::new("backward dup", g.down(&dud)?, du_ref),
    ])
}

fn swiglu_bf16(g: &Gpu<'_>) -> Result<Vec<Out>> {
    let m = 4099usize;
    let (gate, up) = (g.rnd(m, 24, 3.0), g.rnd(m, 25, 1.0));
    let mut h_ref = vec![0.0; m];
    ops::swiglu_fwd(&mut h_ref, &round_bf16(&gate), &round_bf16(&up));
    let (gd, ud, hd) = (g.up16(&gate)?, g.up16(&up)?, g.zeros::<u16>(m)?);
    let l = launch::elementwise(m, g.sms());
    let silu = MlpActivation::Silu;
    g.k()
        .gated_fwd(silu, Dtype::Bf16, l, g.p(&hd), g.p(&gd), g.p(&ud), m as i64)?;
    Ok(vec![Out::new("forward", g.down16(&hd)?, h_ref)])
}

fn rope_f32(g: &Gpu<'_>) -> Result<Vec<Out>> {
    let (bt, t, heads, hd) = (2 * 37usize, 37usize, 6usize, 64usize);
    let rope = ops::Rope::new(hd, 10_000.0, t);
    let (cos, sin) = rope.tables();
    let q = g.rnd(bt * heads * hd, 7, 1.0);
    // A flat sequence, then one of three documents.
    let pos = ops::document_positions(&[37, 5, 1, 31]);
    let mut out = Vec::new();
    for inverse in [false, true] {
        let mut want = q.clone();
        rope.apply(&mut want, &pos, heads, inverse);
        let (qd, cd, sd, pd) = (g.up(&q)?, g.up(cos)?, g.up(sin)?, g.up(&pos)?);
        let l = launch::elementwise(bt * heads * hd / 2, g.sms());
        g.k().rope(
            Dtype::F32,
            inverse,
            l,
            g.p(&qd),
            g.p(&qd),
            g.p(&cd),
            g.p(&sd),
            g.p(&pd),
            bt as i32,
            heads as i32,
            hd as i32,
        )?;
        let label = if inverse { "backward" } else { "forward" };
        out.push(Out::new(label, g.down(&qd)?, want));
    }
    Ok(out)
}

/// Loss and `scale·(softmax − onehot)` of each row of `z`, in f32 (0 and 0 for an ignored row);
/// with `softcap` of `cap·tanh(z / cap)`, the gradient times `1 − tanh²`.
fn cross_entropy_ref(
    z: &[f32],
    targets: &[u32],
    vocab: usize,
    scale: f32,
    softcap: Option<f32>,
) -> (Vec<f32>, Vec<f32>) {
    let rows = targets.len();
    let (mut loss, mut grad) = (vec![0.0f32; rows], vec![0.0f32; rows * vocab]);
    let th = |x: f32| softcap.map_or(1.0, |c| (x / c).tanh());
    let cap = |x: f32| softcap.map_or(x, |c| (x / c).tanh() * c);
    for r in (0..rows).filter(|&r| targets[r] != ops::IGNORE) {
        let raw = &z[r * vocab..(r + 1) * vocab];
        let zr: Vec<f32> = raw.iter().map(|x| cap(*x)).collect();
        let mx = zr.iter().fold(f32::NEG_INFINITY, |a, b| a.max(*b));
        let lse = mx + zr.iter().map(|x| (x - mx).exp()).sum::<f32>().ln();
        loss[r] = lse - zr[targets[r] as usize];
        for (j, gr) in grad[r * vocab..(r + 1) * vocab].iter_mut().enumerate() {
            let onehot = if j == targets[r] as usize { 1.0 } else { 0.0 };
            let dcap = if softcap.is_some() {
                1.0 - th(raw[j]) * th(raw[j])
            } else {
                1.0
            };
            *gr = scale * ((zr[j] - lse).exp() - onehot) * dcap;
        }
    }
    (loss, grad)
}

fn cross_entropy_f32(g: &Gpu<'_>) -> Result<Vec<Out>> {
    let (rows, vocab, scale) = (33usize, 5003usize, 0.25f32);
    let z = g.rnd(rows * vocab, 12, 4.0);
    // Every fifth row trains nothing.
    let targets: Vec<u32> = (0..rows)
        .map(|r| match r % 5 {
            3 => ops::IGNORE,
            _ => (r * 131 % vocab) as u32,
        })
        .collect();
    let mut out = Vec::new();
    // Plain, and soft-capped at 3 (Gemma 2's final_logit_softcapping; these logits reach ±4).
    for (softcap, what) in [(None, ""), (Some(3.0f32), "soft-capped ")] {
        let (loss_ref, grad_ref) = cross_entropy_ref(&z, &targets, vocab, scale, softcap);
        let (zd, td, ld) = (g.up(&z)?, g.up(&targets)?, g.zeros::<f32>(rows)?);
        g.k().cross_entropy_bwd(
            Dtype::F32,
            launch::per_row(rows, vocab)?,
            g.p(&zd),
            g.p(&ld),
            g.p(&td),
            (rows as i32, vocab as i32),
            scale,
            softcap.unwrap_or(0.0),
        )?;
        out.push(Out::new(&format!("{what}loss"), g.down(&ld)?, loss_ref));
        out.push(Out::new(&format!("{what}gradient"), g.down(&zd)?, grad_ref));
    }
    Ok(out)
}

fn cross_entropy_bf16(g: &Gpu<'_>) -> Result<Vec<Out>> {
    let (rows, vocab) = (9usize, 1001usize);
    let z = g.rnd(rows * vocab, 26, 4.0);
    let mut targets: Vec<u32> = (0..rows).map(|r| (r * 37 % vocab) as u32).collect();
    targets[4] = ops::IGNORE;
    let (loss_ref, _) = cross_entropy_ref(&round_bf16(&z), &targets, vocab, 1.0, None);
    let (zd, td, ld) = (g.up16(&z)?, g.up(&targets)?, g.zeros::<f32>(rows)?);
    g.k().cross_entropy_fwd(
        Dtype::Bf16,
        launch::per_row(rows, vocab)?,
        g.p(&ld),
        g.p(&zd),
        g.p(&td),
        (rows as i32, vocab as i32),
        0.0,
    )?;
    Ok(vec![Out::new("loss", g.down(&ld)?, loss_ref)])
}

fn sumsq(g: &Gpu<'_>) -> Result<Vec<Out>> {
    let x = g.rnd(1 << 20, 13, 1.0);
    let want = crate::optim::adamw::sumsq(&x);
    let (xd, sd) = (g.up(&x)?, g.zeros::<f64>(1)?);
    let l = launch::elementwise(x.len(), g.sms());
    g.k().sumsq(l, g.p(&sd), g.p(&xd), x.len() as i64)?;
    let got = drv(g.rt.stream.clone_dtoh(&sd), "copy to the host")?[0];
    Ok(vec![Out::new("Σx²", vec![got as f32], vec![want as f32])])
}

fn cast(g: &Gpu<'_>) -> Result<Vec<Out>> {
    let x = g.rnd(1 << 20, 13, 1.0);
    let (xd, bd) = (g.up(&x)?, g.zeros::<u16>(x.len())?);
    let l = launch::elementwise(x.len(), g.sms());
    g.k().cast_f32_bf16(l, g.p(&bd), g.p(&xd), x.len() as i64)?;
    // Round-to-nearest-even on both sides: bit-exact.
    Ok(vec![Out::new("values", g.down16(&bd)?, round_bf16(&x))])
}

fn embedding_bias_add(g: &Gpu<'_>) -> Result<Vec<Out>> {
    let (n, c, vocab) = (50usize, 96usize, 40usize);
    let wte = g.rnd(vocab * c, 18, 1.0);
    let tokens: Vec<u32> = (0..n).map(|i| (i * 7 % 13) as u32).collect();
    let dy = g.rnd(n * c, 19, 1.0);
    let bias = g.rnd(c, 20, 1.0);
    let mut x_ref = vec![0.0f32; n * c];
    // The gradient already holds something (a tied head's part): each row adds onto it.
    let dw_base = g.rnd(vocab * c, 21, 1.0);
    let mut dw_ref = dw_base.clone();
    // Gemma's embedding scale √c (1 leaves the values as they are).
    let scale = (c as f64).sqrt() as f32;
    for (r, &t) in tokens.iter().enumerate() {
        let t = t as usize;
        for j in 0..c {
            x_ref[r * c + j] = wte[t * c + j] * scale;
            dw_ref[t * c + j] += dy[r * c + j] * scale;
        }
    }
    let mut y_ref = dy.clone();
    let mut db_ref = vec![0.0f32; c];
    for r in 0..n {
        for j in 0..c {
            y_ref[r * c + j] += bias[j] + x_ref[r * c + j];
            db_ref[j] += dy[r * c + j];
        }
    }
    let (wd, dyd, td, bd) = (g.up(&wte)?, g.up(&dy)?, g.up(&tokens)?, g.up(&bias)?);
    let (xd, dwd, dbd, yd) = (
        g.zeros::<f32>(n * c)?,
        g.up(&dw_base)?,
        g.zeros::<f32>(c)?,
        g.up(&dy)?,
    );
    let grouped = launch::group_tokens(&tokens, vocab, None)?;
    let gd = g.up(&grouped.packed)?;
    let u = grouped.groups as i32;
    let l = launch::elementwise(n * c, g.sms());
    let (ni, ci) = (n as i32, c as i32);
    let k = g.k();
    k.embedding_fwd(Dtype::F32, l, g.p(&xd), g.p(&wd), g.p(&td), (ni, ci), scale)?;
    let lg = launch::elementwise(grouped.groups * c, g.sms());
    let (dw, dy, groups) = (g.p(&dwd), g.p(&dyd), g.p(&gd));
    k.embedding_bwd(Dtype::F32, lg, dw, dy, groups, (ni, u), ci, scale)?;
    k.bias_fwd(Dtype::F32, l, g.p(&yd), g.p(&bd), ni, ci)?;
    k.add(Dtype::F32, l, g.p(&yd), g.p(&xd), (n * c) as i64)?;
    k.bias_bwd(
        Dtype::F32,
        launch::per_column(c),
        g.p(&dbd),
        g.p(&dyd),
        ni,
        ci,
    )?;
    Ok(vec![
        Out::new("embedding forward", g.down(&xd)?, x_ref),
        // Each row added in row order, as the reference: bit for bit.
        Out::new("embedding backward (bit-exact)", g.down(&dwd)?, dw_ref).tolerance(0.0),
        Out::new("bias + residual forward", g.down(&yd)?, y_ref),
        Out::new("bias backward", g.down(&dbd)?, db_ref),
    ])
}

/// `y[M, N] = x[M, K] · w[N, K]ᵀ` (a Linear) through cuBLAS in fp32 or TF32.
fn gemm_sgemm(g: &Gpu<'_>, tf32: bool) -> Result<Vec<Out>> {
    use cudarc::cublas::{sys::cublasOperation_t as Op, Gemm, GemmConfig};
    let (mm, nn, kk) = (129usize, 257usize, 511usize);
    let (x, w) = (g.rnd(mm * kk, 14, 1.0), g.rnd(nn * kk, 15, 1.0));
    let mut want = vec![0.0f32; mm * nn];
    ops::linear_fwd(&mut want, &x, &w, None, mm, kk, nn);
    let blas = crate::device::cuda::blas::Blas::new(&g.rt.stream, tf32)?;
    let (xd, wd) = (g.up(&x)?, g.up(&w)?);
    let mut yd = g.zeros::<f32>(mm * nn)?;
    // Row-major y = x·wᵀ is column-major yᵀ = w·xᵀ: A = w (transposed), B = x.
    let cfg = GemmConfig {
        transa: Op::CUBLAS_OP_T,
        transb: Op::CUBLAS_OP_N,
        m: nn as i32,
        n: mm as i32,
        k: kk as i32,
        alpha: 1.0f32,
        lda: kk as i32,
        ldb: kk as i32,
        beta: 0.0f32,
        ldc: nn as i32,
    };
    // SAFETY: the buffers hold M·K, N·K and M·N elements as the config describes.
    unsafe { blas.cudarc().gemm(cfg, &wd, &xd, &mut yd) }.map_err(|e| Error::cuda("sgemm", e))?;
    // The error bound's scale: Σ|x·w| per output. cuBLAS sums in another order than the CPU
    // reference, so an output near cancellation differs by rounding far above its own size
    // (measured on an H200: 2.4e-4 of a near-zero output, 4e-8 of Σ|x·w|). fp32's bound is a
    // few ulps of Σ|x·w| (1e-5 still catches TF32 slipping in: 6.8e-5); TF32's is 2^-11.
    let abs = |v: &[f32]| v.iter().map(|x| x.abs()).collect::<Vec<f32>>();
    let mut scale = vec![0.0f32; mm * nn];
    ops::linear_fwd(&mut scale, &abs(&x), &abs(&w), None, mm, kk, nn);
    let out = Out {
        scale: Some(scale),
        ..Out::new("y = x·wᵀ (error over Σ|x·w|)", g.down(&yd)?, want)
    };
    Ok(vec![if tf32 { out } else { out.tolerance(1e-5) }])
}

fn gemm_f32(g: &Gpu<'_>) -> Result<Vec<Out>> {
    gemm_sgemm(g, false)
}

fn gemm_tf32(g: &Gpu<'_>) -> Result<Vec<Out>> {
    gemm_sgemm(g, true)
}

/// The same Linear in bf16 with fp32 accumulation and an fp32 result (`cublasGemmEx`).
fn gemm_bf16(g: &Gpu<'_>) -> Result<Vec<Out>> {
    use cudarc::cublas::sys::{
        cublasComputeType_t, cublasGemmAlgo_t, cublasOperation_t as Op, cudaDataType_t,
    };
    let (mm, nn, kk) = (65usize, 130usize, 257usize);
    let (x, w) = (g.rnd(mm * kk, 16, 1.0), g.rnd(nn * kk, 17, 1.0));
    let mut want = vec![0.0f32; mm * nn];
    ops::linear_fwd(
        &mut want,
        &round_bf16(&x),
        &round_bf16(&w),
        None,
        mm,
        kk,
        nn,
    );
    let blas = crate::device::cuda::blas::Blas::new(&g.rt.stream, false)?;
    let (xd, wd, yd) = (g.up16(&x)?, g.up16(&w)?, g.zeros::<f32>(mm * nn)?);
    let (alpha, beta) = (1.0f32, 0.0f32);
    // SAFETY: A = w [N, K] bf16, B = x [M, K] bf16, C = y [M, N] fp32, as described.
    unsafe {
        cudarc::cublas::result::gemm_ex(
            *blas.handle(),
            Op::CUBLAS_OP_T,
            Op::CUBLAS_OP_N,
            nn as i32,
            mm as i32,
            kk as i32,
            (&alpha as *const f32).cast(),
            g.p(&wd) as *const _,
            cudaDataType_t::CUDA_R_16BF,
            kk as i32,
            g.p(&xd) as *const _,
            cudaDataType_t::CUDA_R_16BF,
            kk as i32,
            (&beta as *const f32).cast(),
            g.p(&yd) as *mut _,
            cudaDataType_t::CUDA_R_32F,
            nn as i32,
            cublasComputeType_t::CUBLAS_COMPUTE_32F,
            cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
        )
    }
    .map_err(|e| Error::cuda("gemm_ex bf16", e))?;
    Ok(vec![Out::new("y = x·wᵀ", g.down(&yd)?, want)])
}
