//! How the CPU op runs an expert's GEMMs: the `gemm` crate packs a column-major operand (a
//! Linear-layout weight used as `Wᵀ`) slowly when few rows come with it, so such products are
//! transposed — the weight itself ([`mm`]), or, for Linear-layout experts, the whole expert
//! ([`expert_fwd_transposed`]: two transposes of its rows instead of three of its weights).

#[cfg(doc)]
use super::MoeWeights;
use super::{gated_fwd, gemm, scratch, MlpActivation, MoeShape};

/// Rows below which a GEMM whose B is a Linear-layout weight (`B = Wᵀ`, column-major) of at
/// least [`TRANSPOSE_FROM`] elements first transposes it (see [`mm`]).
pub(super) const TRANSPOSE_BELOW: usize = 2048;
/// Elements of B from which the transpose pays (`benches/moe.rs`, two cores: the `wide`
/// shape's 512 K-element weights go from 98 to 129 GFLOP/s for the whole layer, the `small`
/// shape's 32 K lose a tenth).
pub(super) const TRANSPOSE_FROM: usize = 1 << 18;

/// A GEMM inside the loop over experts ([`gemm`]'s arguments, `(m, k, n)` together): on the
/// calling thread when the experts alone keep every thread busy, else itself parallel. A
/// column-major B (an expert's Linear-layout weight used as `Wᵀ`) is transposed into a
/// row-major copy first when the expert has few rows: the `gemm` crate packs such an operand
/// slowly, a cost only a tall A amortises (one core, 128 rows × 1024 → 512: 50 GFLOP/s as is,
/// 92 with the transpose, 106 for a row-major weight; all alike from 4096 rows on).
#[allow(clippy::too_many_arguments)]
pub(super) fn mm(
    s: MoeShape,
    c: &mut [f32],
    a: &[f32],
    a_st: (usize, usize),
    b: &[f32],
    b_st: (usize, usize),
    (m, k, n): (usize, usize, usize),
    accumulate: bool,
) {
    if b_st == (1, k) && m < TRANSPOSE_BELOW && k * n >= TRANSPOSE_FROM {
        let mut bt = scratch::take(k * n);
        transpose(&mut bt, b, n, k);
        mm_as_is(s, c, a, a_st, &bt, (n, 1), (m, k, n), accumulate);
        scratch::give(bt);
        return;
    }
    mm_as_is(s, c, a, a_st, b, b_st, (m, k, n), accumulate)
}

/// `dst` `[k, n]` = the transpose of `src` `[n, k]` (row-major), in 16×16 tiles read and
/// written a row at a time.
pub(super) fn transpose(dst: &mut [f32], src: &[f32], n: usize, k: usize) {
    const T: usize = 16;
    let mut tile = [[0f32; T]; T];
    for j0 in (0..n).step_by(T) {
        let jn = T.min(n - j0);
        for p0 in (0..k).step_by(T) {
            let pn = T.min(k - p0);
            for j in 0..jn {
                let row = &src[(j0 + j) * k + p0..(j0 + j) * k + p0 + pn];
                for (p, &v) in row.iter().enumerate() {
                    tile[p][j] = v;
                }
            }
            for (p, t) in tile.iter().enumerate().take(pn) {
                dst[(p0 + p) * n + j0..(p0 + p) * n + j0 + jn].copy_from_slice(&t[..jn]);
            }
        }
    }
}

/// [`mm`] without the transpose.
#[allow(clippy::too_many_arguments)]
fn mm_as_is(
    s: MoeShape,
    c: &mut [f32],
    a: &[f32],
    a_st: (usize, usize),
    b: &[f32],
    b_st: (usize, usize),
    (m, k, n): (usize, usize, usize),
    accumulate: bool,
) {
    match s.experts >= 2 * rayon::current_num_threads() {
        true => crate::model::ops::gemm_serial(c, a, a_st, b, b_st, m, k, n, accumulate),
        false => gemm(c, a, a_st, b, b_st, m, k, n, accumulate),
    }
}

/// [`expert_fwd`] of Linear-layout experts on few rows, computed transposed: `gᵀ = Wg·xᵀ`,
/// `uᵀ = Wu·xᵀ`, `aᵀ = act(gᵀ)·uᵀ`, `yᵀ = Wd·aᵀ` — every GEMM with row-major operands, the
/// layout the `gemm` crate runs at full speed for any number of rows (see [`mm`]), for two
/// transposes of the expert's `m` rows instead of three of its weights. `keep`: the gate, up
/// and activation rows are written too (the backward's recompute); `round`: the activation is
/// rounded to bf16 before the down projection (the bf16 recipe, [`MoeWeights::bf16_recipe`]).
pub(super) fn expert_fwd_transposed(
    s: MoeShape,
    (wgu, wd): (&[f32], &[f32]),
    act: MlpActivation,
    xe: &[f32],
    (g, u, a, ye): (&mut [f32], &mut [f32], &mut [f32], &mut [f32]),
    (m, keep, round): (usize, bool, bool),
) {
    let (c, i) = (s.c, s.inter);
    let mut xt = scratch::take(c * m);
    transpose(&mut xt, xe, m, c);
    let (mut gt, mut ut, mut at) = (
        scratch::take(i * m),
        scratch::take(i * m),
        scratch::take(i * m),
    );
    mm_as_is(
        s,
        &mut gt,
        &wgu[..i * c],
        (c, 1),
        &xt,
        (m, 1),
        (i, c, m),
        false,
    );
    mm_as_is(
        s,
        &mut ut,
        &wgu[i * c..],
        (c, 1),
        &xt,
        (m, 1),
        (i, c, m),
        false,
    );
    gated_fwd(act, &mut at, &gt, &ut);
    if round {
        crate::model::ops::round_bf16(&mut at);
    }
    // yᵀ [C, m] in xt's buffer (x is no longer needed).
    mm_as_is(s, &mut xt, wd, (i, 1), &at, (m, 1), (c, i, m), false);
    transpose(ye, &xt, c, m);
    if keep {
        transpose(g, &gt, i, m);
        transpose(u, &ut, i, m);
        transpose(a, &at, i, m);
    }
    for v in [xt, gt, ut, at] {
        scratch::give(v);
    }
}
