//! CPU kernels of the Llama family, forward and explicit backward: the reference every other
//! backend is checked against. Shapes are written beside the code (`// [N, C]`); matrices are
//! row-major; a Linear weight is `[out, in]` and `y = x·Wᵀ` (HF convention).

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// C[m, n] (row-major) = (accumulate ? C : 0) + A·B, where A is m×k and B is k×n, each given by
/// its row and column strides (so a transpose is just swapped strides). Large products use every
/// thread.
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    c: &mut [f32],
    a: &[f32],
    a_st: (usize, usize),
    b: &[f32],
    b_st: (usize, usize),
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
) {
    let par = m * n * k >= 1 << 15;
    gemm_on(c, a, a_st, b, b_st, m, k, n, accumulate, par);
}

/// [`gemm`] on the calling thread only (for tiles inside an already parallel loop).
#[allow(clippy::too_many_arguments)]
pub fn gemm_serial(
    c: &mut [f32],
    a: &[f32],
    a_st: (usize, usize),
    b: &[f32],
    b_st: (usize, usize),
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
) {
    gemm_on(c, a, a_st, b, b_st, m, k, n, accumulate, false);
}

/// Outputs up to which the `gemm` crate switches to dot-product kernels (see [`gemm_on`]).
const SMALL_GEMM: usize = 16 * 16;
/// Sides up to which the `gemm` crate blocks k by [`MAX_KC`] instead of its balanced blocks.
const SMALL_SIDE: usize = 64;
/// The `gemm` crate's k block for small products.
const MAX_KC: usize = 512;

#[allow(clippy::too_many_arguments)]
fn gemm_on(
    c: &mut [f32],
    a: &[f32],
    (a_rs, a_cs): (usize, usize),
    b: &[f32],
    (b_rs, b_cs): (usize, usize),
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
    parallel: bool,
) {
    assert!(c.len() >= m * n, "gemm: C too small");
    if m == 0 || n == 0 {
        return;
    }
    if k == 0 {
        if !accumulate {
            c[..m * n].fill(0.0);
        }
        return;
    }
    assert!(
        (m - 1) * a_rs + (k - 1) * a_cs < a.len(),
        "gemm: A too small"
    );
    assert!(
        (k - 1) * b_rs + (n - 1) * b_cs < b.len(),
        "gemm: B too small"
    );
    let small_block = m <= SMALL_SIDE && n <= SMALL_SIDE && k > MAX_KC;
    if k > 2 && (m == 1 || m * n <= SMALL_GEMM || small_block) {
        // The `gemm` crate computes a single row as a GEMV, products of up to 16×16 outputs
        // with dot-product kernels, and products of at most 64×64 with k split into 512-deep
        // blocks (larger ones into balanced blocks): their sums run in another order than the
        // same rows inside a taller product, so a row's bits would depend on how many rows came
        // with it (the token-chunked program relies on they do not). Zero rows below make it a
        // product of the usual kind.
        let rows = 2
            .max(SMALL_GEMM / n + 1)
            .max(if small_block { SMALL_SIDE + 1 } else { 0 });
        let mut a2 = vec![0.0f32; rows * k];
        for (i, row) in a2.chunks_exact_mut(k).take(m).enumerate() {
            for (j, x) in row.iter_mut().enumerate() {
                *x = a[i * a_rs + j * a_cs];
            }
        }
        let mut c2 = vec![0.0f32; rows * n];
        c2[..m * n].copy_from_slice(&c[..m * n]);
        gemm_on(
            &mut c2,
            &a2,
            (k, 1),
            b,
            (b_rs, b_cs),
            rows,
            k,
            n,
            accumulate,
            parallel,
        );
        c[..m * n].copy_from_slice(&c2[..m * n]);
        return;
    }
    // SAFETY: the asserts above bound every index gemm reads or writes; C does not alias A or B
    // (distinct borrows).
    unsafe {
        gemm::gemm(
            m,
            n,
            k,
            c.as_mut_ptr(),
            1,
            n as isize,
            accumulate,
            a.as_ptr(),
            a_cs as isize,
            a_rs as isize,
            b.as_ptr(),
            b_cs as isize,
            b_rs as isize,
            1.0,
            1.0,
            false,
            false,
            false,
            if parallel {
                gemm::Parallelism::Rayon(0)
            } else {
                gemm::Parallelism::None
            },
        );
    }
}

/// y[N, out] = x[N, in]·Wᵀ (+ b), W is `[out, in]`.
pub fn linear_fwd(
    y: &mut [f32],
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    n: usize,
    din: usize,
    dout: usize,
) {
    gemm(y, x, (din, 1), w, (1, din), n, din, dout, false);
    if let Some(b) = bias {
        bias_fwd(&mut y[..n * dout], b);
    }
}

/// y[r, :] += b for every row of y (rows of `b.len()`).
pub fn bias_fwd(y: &mut [f32], b: &[f32]) {
    y.par_chunks_mut(b.len()).for_each(|row| {
        for (v, bb) in row.iter_mut().zip(b) {
            *v += *bb;
        }
    });
}

/// db += Σ_rows dy, dy `[n, db.len()]`, added row by row in order onto db (so summing the rows
/// in consecutive parts gives the same bits as summing them at once).
pub fn bias_bwd(db: &mut [f32], dy: &[f32], n: usize) {
    let dout = db.len();
    db.par_iter_mut().enumerate().for_each(|(o, d)| {
        let mut s = *d;
        for r in 0..n {
            s += dy[r * dout + o];
        }
        *d = s;
    });
}

/// Rows per weight-gradient GEMM: `dW += dyᵀ·x` is summed over blocks of at most this many
/// rows, in order, a block never crossing a sequence's start and each starting a multiple of it
/// from one ([`grad_blocks`]). A token-chunked program whose chunks start at such multiples sums
/// the same blocks in the same order, so its gradients are bit-identical for any chunk size.
pub const GRAD_ROWS: usize = 256;

/// The row blocks `[r0, r1)` of `rows` rows made of runs of `period` rows (sequences, or a chunk
/// of one): [`GRAD_ROWS`] at a time from each run's start.
pub fn grad_blocks(rows: usize, period: usize) -> impl Iterator<Item = (usize, usize)> {
    let period = period.max(1);
    (0..rows).step_by(period).flat_map(move |s0| {
        let s1 = (s0 + period).min(rows);
        (s0..s1)
            .step_by(GRAD_ROWS)
            .map(move |r0| (r0, (r0 + GRAD_ROWS).min(s1)))
    })
}

/// `dW[out, in] += dyᵀ·x` over rows in [`grad_blocks`] of runs of `period` rows.
#[allow(clippy::too_many_arguments)]
pub fn weight_grad(
    dw: &mut [f32],
    dy: &[f32],
    x: &[f32],
    n: usize,
    period: usize,
    din: usize,
    dout: usize,
) {
    for (r0, r1) in grad_blocks(n, period) {
        gemm(
            dw,
            &dy[r0 * dout..r1 * dout],
            (1, dout),
            &x[r0 * din..r1 * din],
            (din, 1),
            dout,
            r1 - r0,
            din,
            true,
        );
    }
}

/// Backward of [`linear_fwd`] over `n` rows made of runs (sequences) of `period`: dx (= or +=)
/// dy·W, dW += dyᵀ·x (see [`weight_grad`]), db += Σ_rows dy.
#[allow(clippy::too_many_arguments)]
pub fn linear_bwd(
    dx: &mut [f32],
    dx_accumulate: bool,
    dw: &mut [f32],
    db: Option<&mut [f32]>,
    dy: &[f32],
    x: &[f32],
    w: &[f32],
    n: usize,
    period: usize,
    din: usize,
    dout: usize,
) {
    gemm(dx, dy, (dout, 1), w, (din, 1), n, dout, din, dx_accumulate);
    // dW[out, in] += dyᵀ[out, N] · x[N, in]
    weight_grad(dw, dy, x, n, period, din, dout);
    if let Some(db) = db {
        bias_bwd(&mut db[..dout], dy, n);
    }
}

/// RMSNorm: y = (w_offset + w) ⊙ (x · rsqrt(mean(x²) + eps)) per row (`w_offset` 0, or 1 for
/// Gemma's `1 + w`); stores 1/rms per row in `rstd`.
pub fn rmsnorm_fwd(
    y: &mut [f32],
    rstd: &mut [f32],
    x: &[f32],
    (w, w_offset): (&[f32], f32),
    c: usize,
    eps: f32,
) {
    y.par_chunks_mut(c)
        .zip(rstd.par_iter_mut())
        .zip(x.par_chunks(c))
        .for_each(|((yr, r), xr)| {
            let ms = xr
                .iter()
                .map(|v| f64::from(*v) * f64::from(*v))
                .sum::<f64>()
                / c as f64;
            let inv = 1.0 / ((ms as f32) + eps).sqrt();
            *r = inv;
            for ((o, xv), wv) in yr.iter_mut().zip(xr).zip(w) {
                *o = (w_offset + *wv) * (*xv * inv);
            }
        });
}

/// Backward of [`rmsnorm_fwd`]: dx (+)= ..., dw += Σ_rows dy ⊙ x · rstd.
#[allow(clippy::too_many_arguments)]
pub fn rmsnorm_bwd(
    dx: &mut [f32],
    dx_accumulate: bool,
    dw: &mut [f32],
    dy: &[f32],
    x: &[f32],
    (w, w_offset): (&[f32], f32),
    rstd: &[f32],
    c: usize,
) {
    dx.par_chunks_mut(c)
        .zip(dy.par_chunks(c))
        .zip(x.par_chunks(c))
        .zip(rstd.par_iter())
        .for_each(|(((dxr, dyr), xr), r)| {
            let dot: f64 = dyr
                .iter()
                .zip(xr)
                .zip(w)
                .map(|((g, xv), wv)| f64::from(*g * (w_offset + *wv)) * f64::from(*xv))
                .sum();
            let k = (dot / c as f64) as f32 * r * r * r;
            for (((o, g), xv), wv) in dxr.iter_mut().zip(dyr).zip(xr).zip(w) {
                let v = *r * ((w_offset + *wv) * *g) - k * *xv;
                if dx_accumulate {
                    *o += v;
                } else {
                    *o = v;
                }
            }
        });
    // dw: reduce over rows, parallel over columns, added row by row onto dw (consecutive parts
    // of the rows give the same bits as all at once).
    let rows = rstd.len();
    dw.par_iter_mut().enumerate().for_each(|(j, d)| {
        let mut s = *d;
        for r in 0..rows {
            s += dy[r * c + j] * x[r * c + j] * rstd[r];
        }
        *d = s;
    });
}

/// Elements per task of the elementwise ops.
const ELEMENTWISE: usize = 1 << 14;

/// The gate's activation of the gated MLP `down(act(gate(x)) ⊙ up(x))`.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MlpActivation {
    /// SiLU, `g·σ(g)` (SwiGLU: `hidden_act: silu`).
    #[default]
    Silu,
    /// GELU's tanh approximation (GeGLU: `gelu_pytorch_tanh`, Gemma).
    GeluTanh,
}

/// The gated MLP's activation `h = act(g) ⊙ u` for `act`: [`swiglu_fwd`] or [`geglu_fwd`].
pub fn gated_fwd(act: MlpActivation, h: &mut [f32], g: &[f32], u: &[f32]) {
    match act {
        MlpActivation::Silu => swiglu_fwd(h, g, u),
        MlpActivation::GeluTanh => geglu_fwd(h, g, u),
    }
}

/// Backward of [`gated_fwd`]: writes dg and du.
pub fn gated_bwd(
    act: MlpActivation,
    dg: &mut [f32],
    du: &mut [f32],
    dh: &[f32],
    g: &[f32],
    u: &[f32],
) {
    match act {
        MlpActivation::Silu => swiglu_bwd(dg, du, dh, g, u),
        MlpActivation::GeluTanh => geglu_bwd(dg, du, dh, g, u),
    }
}

/// √(2/π), PyTorch's `kBeta` of GELU's tanh approximation (`M_SQRT2 · M_2_SQRTPI · 0.5`).
const GELU_BETA: f32 = (std::f64::consts::SQRT_2 * std::f64::consts::FRAC_2_SQRT_PI * 0.5) as f32;
/// PyTorch's `kKappa`.
const GELU_KAPPA: f32 = 0.044715;

/// GELU, tanh approximation, in PyTorch's order: `0.5·x·(1 + tanh(β(x + κx³)))`.
pub fn gelu_tanh(x: f32) -> f32 {
    let inner = GELU_BETA * (x + GELU_KAPPA * (x * x * x));
    0.5 * x * (1.0 + inner.tanh())
}

/// Its derivative, in PyTorch's order (`GeluBackward`, approximate = tanh).
pub fn gelu_tanh_grad(x: f32) -> f32 {
    let x_sq = x * x;
    let inner = GELU_BETA * (x + GELU_KAPPA * (x_sq * x));
    let t = inner.tanh();
    let left_derivative = 0.5 * (1.0 + t);
    let right_derivative = 0.5 * x * (1.0 - t * t) * (GELU_BETA * (1.0 + 3.0 * GELU_KAPPA * x_sq));
    left_derivative + right_derivative
}

/// GeGLU (tanh GELU): h = gelu_tanh(g) ⊙ u.
pub fn geglu_fwd(h: &mut [f32], g: &[f32], u: &[f32]) {
    h.par_chunks_mut(ELEMENTWISE)
        .zip(g.par_chunks(ELEMENTWISE).zip(u.par_chunks(ELEMENTWISE)))
        .for_each(|(h, (g, u))| {
            for ((o, g), u) in h.iter_mut().zip(g).zip(u) {
                *o = gelu_tanh(*g) * *u;
            }
        });
}

/// Backward of [`geglu_fwd`]: `du = dh·gelu(g)`, `dg = (dh·u)·gelu'(g)` (autograd's order).
pub fn geglu_bwd(dg: &mut [f32], du: &mut [f32], dh: &[f32], g: &[f32], u: &[f32]) {
    dg.par_chunks_mut(ELEMENTWISE)
        .zip(du.par_chunks_mut(ELEMENTWISE))
        .zip(
            dh.par_chunks(ELEMENTWISE)
                .zip(g.par_chunks(ELEMENTWISE).zip(u.par_chunks(ELEMENTWISE))),
        )
        .for_each(|((dg, du), (dh, (g, u)))| {
            for ((((dg, du), dh), g), u) in dg.iter_mut().zip(du.iter_mut()).zip(dh).zip(g).zip(u) {
                *du = *dh * gelu_tanh(*g);
                *dg = (*dh * *u) * gelu_tanh_grad(*g);
            }
        });
}

/// SwiGLU: h = silu(g) ⊙ u, silu(g) = g·σ(g) (σ vectorised, [`exp::sigmoid`]).
pub fn swiglu_fwd(h: &mut [f32], g: &[f32], u: &[f32]) {
    h.par_chunks_mut(ELEMENTWISE)
        .zip(g.par_chunks(ELEMENTWISE).zip(u.par_chunks(ELEMENTWISE)))
        .for_each(|(h, (g, u))| {
            exp::vectorised(|| {
                for ((o, g), u) in h.iter_mut().zip(g).zip(u) {
                    *o = *g * exp::sigmoid(*g) * *u;
                }
            })
        });
}

/// Backward of [`swiglu_fwd`]: writes dg and du.
pub fn swiglu_bwd(dg: &mut [f32], du: &mut [f32], dh: &[f32], g: &[f32], u: &[f32]) {
    dg.par_chunks_mut(ELEMENTWISE)
        .zip(du.par_chunks_mut(ELEMENTWISE))
        .zip(
            dh.par_chunks(ELEMENTWISE)
                .zip(g.par_chunks(ELEMENTWISE).zip(u.par_chunks(ELEMENTWISE))),
        )
        .for_each(|((dg, du), (dh, (g, u)))| {
            exp::vectorised(|| {
                for ((((dg, du), dh), g), u) in
                    dg.iter_mut().zip(du.iter_mut()).zip(dh).zip(g).zip(u)
                {
                    let sig = exp::sigmoid(*g);
                    let silu = *g * sig;
                    *du = *dh * silu;
                    *dg = *dh * *u * (sig * (1.0 + *g * (1.0 - sig)));
                }
            })
        });
}

mod attention;
mod bf16;
mod exp;
mod moe;
mod rope;
mod sinks;
pub use attention::{
    attention_bwd, attention_fwd, attention_naive, document_positions, flat_positions, AttnShape,
    ATTN_TILE, IGNORE,
};
pub use bf16::{bf16_value, round_bf16, round_into};
pub use moe::{
    group_by_expert, moe_bwd, moe_fwd, route, AuxGrad, ExpertAct, ExpertLayout, ExpertLoad,
    MoeGrads, MoeShape, MoeWeights, Router, RouterTally, Routing,
};
pub use rope::{Rope, RopeScaling};
pub use sinks::{sinks_bwd, sinks_fwd};

/// About the fp32 logits materialised at once by the head ([`ce_chunk_rows`]).
pub const CE_CHUNK_BYTES: usize = 1 << 30;

/// The head's chunk (the reference's [`lm_head_ce`] and the device program's alike): the rows
/// whose logits exist at once, a power of two from 256 to 4096 with about [`CE_CHUNK_BYTES`]
/// of logits (`rows × V` floats). Each chunk reads and writes the LM head's whole fp32
/// gradient (`dW += dlogitsᵀ·h`): 256-row chunks of a 152k vocabulary moved 2.5 GB a chunk,
/// a fifth of an H100's MoE step (docs/gpu.md).
pub fn ce_chunk_rows(vocab: usize) -> usize {
    let fit = CE_CHUNK_BYTES / (4 * vocab.max(1));
    (1usize << fit.max(1).ilog2()).clamp(256, 4096)
}

/// The head's chunk for `n` rows: [`ce_chunk_rows`], or all `n` when fewer (at least one).
pub fn ce_chunk(vocab: usize, n: usize) -> usize {
    ce_chunk_rows(vocab).min(n.max(1))
}

/// Fused LM head + cross-entropy, chunked over tokens so B·T·V logits never exist at once.
///
/// h [N, C], w [V, C]; the logits soft-capped at `softcap` where given. Returns Σ loss over the N rows (caller divides by the step's token count).
/// With `grad_scale` = 1/(tokens of the step): dh = dlogits·W is written, dW += dlogitsᵀ·h.
#[allow(clippy::too_many_arguments)]
pub fn lm_head_ce(
    dh: &mut [f32],
    dw: &mut [f32],
    h: &[f32],
    w: &[f32],
    targets: &[u32],
    n: usize,
    c: usize,
    (vocab, softcap): (usize, Option<f32>),
    grad_scale: f32,
    scratch: &mut Vec<f32>,
) -> f64 {
    let rows = ce_chunk(vocab, n);
    scratch.resize(rows * vocab, 0.0);
    let mut losses = vec![0.0f32; rows];
    let mut total = 0.0f64;
    for r0 in (0..n).step_by(rows) {
        let r1 = (r0 + rows).min(n);
        let m = r1 - r0;
        let logits = &mut scratch[..m * vocab]; // [m, V]
        gemm(
            logits,
            &h[r0 * c..r1 * c],
            (c, 1),
            w,
            (1, c),
            m,
            c,
            vocab,
            false,
        );
        cross_entropy(
            logits,
            &mut losses[..m],
            &targets[r0..r1],
            vocab,
            grad_scale,
            softcap,
        );
        // Row by row, in order: the device program sums its per-row losses the same way.
        for l in &losses[..m] {
            total += f64::from(*l);
        }
        // dh[m, C] = dlogits[m, V] · W[V, C];  dW[V, C] += dlogitsᵀ · h
        gemm(
            &mut dh[r0 * c..r1 * c],
            logits,
            (vocab, 1),
            w,
            (c, 1),
            m,
            vocab,
            c,
            false,
        );
        gemm(
            dw,
            logits,
            (1, vocab),
            &h[r0 * c..r1 * c],
            (c, 1),
            vocab,
            m,
            c,
            true,
        );
    }
    total
}

/// Soft-cap logits in place (Gemma 2's `final_logit_softcapping`): `z = cap·tanh(z / cap)`, in
/// transformers' order (divide, tanh, multiply).
pub fn softcap_logits(z: &mut [f32], cap: f32) {
    z.par_chunks_mut(ELEMENTWISE).for_each(|z| {
        for x in z {
            *x = (*x / cap).tanh() * cap;
        }
    });
}

/// Cross-entropy over a chunk of logits `[rows, vocab]`: per-row loss `lse(z) − z[target]` into
/// `losses`, and in place `z = scale·(softmax(z) − onehot(target))`; a row whose target is
/// [`IGNORE`] gets loss 0 and gradient 0. With `softcap`, of the capped logits
/// `z' = cap·tanh(z / cap)`, the gradient taken back through the cap (× `1 − (z'/cap)²`).
pub fn cross_entropy(
    logits: &mut [f32],
    losses: &mut [f32],
    targets: &[u32],
    vocab: usize,
    scale: f32,
    softcap: Option<f32>,
) {
    logits
        .par_chunks_mut(vocab)
        .zip(losses.par_iter_mut())
        .zip(targets.par_iter())
        .for_each_init(Vec::new, |capped, ((row, loss), &tg)| {
            if tg == IGNORE {
                *loss = 0.0;
                row.fill(0.0);
                return;
            }
            if let Some(cap) = softcap {
                for x in row.iter_mut() {
                    *x = (*x / cap).tanh() * cap;
                }
                capped.clear();
                capped.extend_from_slice(row);
            }
            // One vectorised exp pass: row = e^(z − max), Σ = its sum, softmax = row / Σ.
            let (mx, zt) = (exp::row_max(row), row[tg as usize]);
            let sum = exp::exp_shifted(row, mx);
            *loss = mx + sum.ln() - zt;
            let k = scale / sum;
            for x in row.iter_mut() {
                *x *= k;
            }
            row[tg as usize] -= scale;
            if let Some(cap) = softcap {
                for (x, z) in row.iter_mut().zip(capped.iter()) {
                    let th = *z / cap;
                    *x *= 1.0 - th * th;
                }
            }
        });
}

/// Logits [N, V] = h·Wᵀ, for tests and inference on small inputs.
pub fn logits(out: &mut [f32], h: &[f32], w: &[f32], n: usize, c: usize, vocab: usize) {
    gemm(out, h, (c, 1), w, (1, c), n, c, vocab, false);
}

#[cfg(test)]
mod tests;
