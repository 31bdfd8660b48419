//! Causal grouped-query attention on the CPU, FlashAttention-2 style: tiles of queries × keys as
//! small GEMMs (the `gemm` crate's SIMD kernels, one thread per tile), an online softmax with a
//! vectorised exponential, no T×T matrix. Documents packed into one row never see each other:
//! query i attends to keys `i − pos[i] ..= i` (see [`first_key`]).
//!
//! Work is split so no two threads write the same memory: the forward by (sequence, head, query
//! tile); the backward by (sequence, query head) over its whole lower triangle — `D = rowsum(dO ⊙
//! O)` first, then per tile pair the probabilities recomputed from the forward's log-sum-exp and
//! five GEMMs (S, dP, dV, dK, dQ) — with each head's share of dK/dV summed over its GQA group in
//! head order at the end. Every sum runs in a fixed order, so results do not depend on the thread
//! count.

use super::gemm_serial;
use rayon::prelude::*;

/// Attention shape: B sequences of T tokens, NH query heads, NKV kv heads, head dim HD.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct AttnShape {
    /// Batch.
    pub b: usize,
    /// Sequence length.
    pub t: usize,
    /// Query heads.
    pub nh: usize,
    /// Key/value heads.
    pub nkv: usize,
    /// Head dimension.
    pub hd: usize,
}

/// Query rows per tile.
pub const ATTN_TILE: usize = 128;
/// Keys per tile.
const KEY_TILE: usize = 256;

/// The target of a token that trains nothing (Hugging Face's label −100): its loss and gradient
/// are zero and it does not count in the step's token count.
pub const IGNORE: u32 = u32::MAX;

/// Positions `[B·T]` of flat rows: token i of each sequence is at position i, so attention is
/// plain causal attention over the whole row.
pub fn flat_positions(b: usize, t: usize) -> Vec<u32> {
    (0..b * t).map(|r| (r % t) as u32).collect()
}

/// Positions of documents of `lens` tokens laid end to end: 0, 1, … restarting at each document.
pub fn document_positions(lens: &[usize]) -> Vec<u32> {
    lens.iter().flat_map(|&l| 0..l as u32).collect()
}

/// The first key query `i` of sequence `bi` attends to: its document's first token. `pos`
/// `[B·T]` holds each token's position in its document (0 at a document's first token), so
/// documents packed into one row never attend to each other; with [`flat_positions`] it is 0.
/// First keys never decrease along a sequence.
#[inline]
fn first_key(pos: &[u32], bi: usize, t: usize, i: usize) -> usize {
    i.saturating_sub(pos[bi * t + i] as usize)
}

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: used only to hand disjoint row ranges of one buffer to parallel tasks (see callers).
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// `len` elements at `offset`, which the caller's task alone writes.
    ///
    /// # Safety
    /// The range is inside the buffer and no other live reference covers it.
    unsafe fn slice<'a>(&self, offset: usize, len: usize) -> &'a mut [f32] {
        // SAFETY: forwarded contract.
        unsafe { std::slice::from_raw_parts_mut(self.0.add(offset), len) }
    }
}

/// One tile's scratch: scaled queries, scores/probabilities, their gradient, accumulators.
struct Scratch {
    q: Vec<f32>,   // [ATTN_TILE, hd] queries × 1/√hd
    s: Vec<f32>,   // [ATTN_TILE, KEY_TILE] scores, then probabilities
    dp: Vec<f32>,  // [ATTN_TILE, KEY_TILE] dO·Vᵀ, then dS
    acc: Vec<f32>, // [max(ATTN_TILE, KEY_TILE), hd] output / dQ / dK accumulator
    do_: Vec<f32>, // [ATTN_TILE, hd] dO rows, contiguous
    mx: Vec<f32>,  // [ATTN_TILE] running max / log-sum-exp
    l: Vec<f32>,   // [ATTN_TILE] running sum / delta
}

impl Scratch {
    fn new(hd: usize) -> Self {
        let rows = ATTN_TILE.max(KEY_TILE);
        Scratch {
            q: vec![0.0; ATTN_TILE * hd],
            s: vec![0.0; ATTN_TILE * KEY_TILE],
            dp: vec![0.0; ATTN_TILE * KEY_TILE],
            acc: vec![0.0; rows * hd],
            do_: vec![0.0; ATTN_TILE * hd],
            mx: vec![0.0; ATTN_TILE],
            l: vec![0.0; ATTN_TILE],
        }
    }
}

/// Copy `m` rows of `hd` (row stride `stride`) from `src` into `dst`, times `scale`.
fn gather_rows(dst: &mut [f32], src: &[f32], stride: usize, m: usize, hd: usize, scale: f32) {
    for (r, d) in dst[..m * hd].chunks_exact_mut(hd).enumerate() {
        for (x, y) in d.iter_mut().zip(&src[r * stride..r * stride + hd]) {
            *x = *y * scale;
        }
    }
}

/// The columns of a score row that query `i` may see, for keys `j0..j0 + n`: `[lo, hi)`.
#[inline]
fn visible(pos: &[u32], bi: usize, t: usize, i: usize, j0: usize, n: usize) -> (usize, usize) {
    let lo = first_key(pos, bi, t, i).saturating_sub(j0).min(n);
    let hi = (i + 1).saturating_sub(j0).min(n);
    (lo, hi.max(lo))
}

/// Causal GQA attention over documents. q [B·T, NH·HD], k/v [B·T, NKV·HD], o [B·T, NH·HD]; `pos`
/// [B·T] each token's position in its document: query i attends to keys `i − pos[i] ..= i` (its
/// own document's, up to itself). `lse` [B, NH, T] receives the row log-sum-exp for the
/// backward. Query head h reads kv head h / (NH/NKV).
#[allow(clippy::too_many_arguments)]
pub fn attention_fwd(
    o: &mut [f32],
    lse: &mut [f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    pos: &[u32],
    s: AttnShape,
) {
    let AttnShape { b, t, nh, nkv, hd } = s;
    assert_eq!(pos.len(), b * t, "attention: one position per token");
    assert!(
        o.len() >= b * t * nh * hd && lse.len() >= b * nh * t,
        "attention: outputs too small"
    );
    let group = nh / nkv;
    let scale = 1.0 / (hd as f32).sqrt();
    let (qs, kvs) = (nh * hd, nkv * hd);
    let qtiles = t.div_ceil(ATTN_TILE);
    let (optr, lptr) = (SendPtr(o.as_mut_ptr()), SendPtr(lse.as_mut_ptr()));
    (0..b * nh * qtiles).into_par_iter().for_each_init(
        || Scratch::new(hd),
        |sc, task| {
            let (bh, qt) = (task / qtiles, task % qtiles);
            let (bi, h) = (bh / nh, bh % nh);
            let kh = h / group;
            let (i0, i1) = (qt * ATTN_TILE, ((qt + 1) * ATTN_TILE).min(t));
            let m = i1 - i0;
            gather_rows(
                &mut sc.q,
                &q[(bi * t + i0) * qs + h * hd..],
                qs,
                m,
                hd,
                scale,
            );
            sc.acc[..m * hd].fill(0.0);
            sc.mx[..m].fill(f32::NEG_INFINITY);
            sc.l[..m].fill(0.0);
            let mut j0 = first_key(pos, bi, t, i0);
            while j0 < i1 {
                let n = KEY_TILE.min(i1 - j0);
                let kv0 = (bi * t + j0) * kvs + kh * hd;
                // S[m, n] = Qs · K[j0..j0+n]ᵀ
                gemm_serial(
                    &mut sc.s[..m * n],
                    &sc.q,
                    (hd, 1),
                    &k[kv0..],
                    (1, kvs),
                    m,
                    hd,
                    n,
                    false,
                );
                for r in 0..m {
                    let (lo, hi) = visible(pos, bi, t, i0 + r, j0, n);
                    let row = &mut sc.s[r * n..(r + 1) * n];
                    if lo == hi {
                        row.fill(0.0);
                        continue;
                    }
                    let m_new = sc.mx[r].max(row_max(&row[lo..hi]));
                    let corr = (sc.mx[r] - m_new).exp();
                    row[..lo].fill(0.0);
                    row[hi..].fill(0.0);
                    let sum = exp_shifted(&mut row[lo..hi], m_new);
                    sc.l[r] = sc.l[r] * corr + sum;
                    sc.mx[r] = m_new;
                    if corr != 1.0 {
                        sc.acc[r * hd..(r + 1) * hd]
                            .iter_mut()
                            .for_each(|x| *x *= corr);
                    }
                }
                // acc[m, hd] += P[m, n] · V[j0..j0+n]
                gemm_serial(
                    &mut sc.acc[..m * hd],
                    &sc.s[..m * n],
                    (n, 1),
                    &v[kv0..],
                    (kvs, 1),
                    m,
                    n,
                    hd,
                    true,
                );
                j0 += n;
            }
            for r in 0..m {
                let inv = 1.0 / sc.l[r];
                // SAFETY: row (bi, i0 + r), head h of `o` and its lse entry: this task
                // (bi, h, qt) is their only writer.
                let (orow, l) = unsafe {
                    (
                        optr.slice((bi * t + i0 + r) * qs + h * hd, hd),
                        lptr.slice((bi * nh + h) * t + i0 + r, 1),
                    )
                };
                for (x, a) in orow.iter_mut().zip(&sc.acc[r * hd..(r + 1) * hd]) {
                    *x = *a * inv;
                }
                l[0] = sc.mx[r] + sc.l[r].ln();
            }
        },
    );
}

/// Backward of [`attention_fwd`], recomputing the probabilities tile by tile from q, k and `lse`.
/// Writes dq, dk, dv (not accumulating).
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    d_o: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f32],
    lse: &[f32],
    pos: &[u32],
    s: AttnShape,
) {
    let AttnShape { b, t, nh, nkv, hd } = s;
    assert_eq!(pos.len(), b * t, "attention: one position per token");
    let group = nh / nkv;
    let scale = 1.0 / (hd as f32).sqrt();
    let (qs, kvs) = (nh * hd, nkv * hd);
    // D[b, h, i] = dO_i · O_i
    let mut delta = vec![0.0f32; b * nh * t];
    delta.par_chunks_mut(t).enumerate().for_each(|(bh, d)| {
        let (bi, h) = (bh / nh, bh % nh);
        for (i, x) in d.iter_mut().enumerate() {
            let r = (bi * t + i) * qs + h * hd;
            *x = dot(&d_o[r..r + hd], &o[r..r + hd]);
        }
    });
    let delta = &delta;
    let tile = Tile {
        q,
        k,
        v,
        d_o,
        lse,
        delta,
        pos,
        s,
        scale,
    };
    // One task per (sequence, query head), over its whole lower triangle: dQ of its rows, and
    // its share of dK/dV, summed over the group's heads afterwards in head order.
    let per_head = t * hd;
    let mut dk_h = vec![0.0f32; b * nh * per_head];
    let mut dv_h = vec![0.0f32; b * nh * per_head];
    let qtiles = t.div_ceil(ATTN_TILE);
    let dqp = SendPtr(dq.as_mut_ptr());
    dk_h.par_chunks_mut(per_head)
        .zip(dv_h.par_chunks_mut(per_head))
        .enumerate()
        .for_each_init(
            || (Scratch::new(hd), vec![0.0f32; per_head]),
            |(sc, dq_acc), (bh, (dkh, dvh))| {
                let (bi, h) = (bh / nh, bh % nh);
                let kh = h / group;
                dq_acc.fill(0.0);
                for qt in 0..qtiles {
                    let (i0, i1) = (qt * ATTN_TILE, ((qt + 1) * ATTN_TILE).min(t));
                    let m = i1 - i0;
                    let mut j0 = first_key(pos, bi, t, i0);
                    while j0 < i1 {
                        let n = KEY_TILE.min(i1 - j0);
                        let kv0 = (bi * t + j0) * kvs + kh * hd;
                        tile.probabilities_and_ds(
                            sc,
                            bi,
                            h,
                            i0,
                            m,
                            j0,
                            n,
                            j0 == first_key(pos, bi, t, i0),
                        );
                        let (p, ds) = (&sc.s[..m * n], &sc.dp[..m * n]);
                        // dV[n, hd] += Pᵀ · dO;  dK[n, hd] += dSᵀ · Qs;  dQ[m, hd] += dS · K
                        gemm_serial(
                            &mut dvh[j0 * hd..(j0 + n) * hd],
                            p,
                            (1, n),
                            &sc.do_,
                            (hd, 1),
                            n,
                            m,
                            hd,
                            true,
                        );
                        gemm_serial(
                            &mut dkh[j0 * hd..(j0 + n) * hd],
                            ds,
                            (1, n),
                            &sc.q,
                            (hd, 1),
                            n,
                            m,
                            hd,
                            true,
                        );
                        gemm_serial(
                            &mut dq_acc[i0 * hd..i1 * hd],
                            ds,
                            (n, 1),
                            &k[kv0..],
                            (kvs, 1),
                            m,
                            n,
                            hd,
                            true,
                        );
                        j0 += n;
                    }
                    for r in 0..m {
                        // SAFETY: dq row (bi, i0 + r), head h: this task alone writes it.
                        let dqr = unsafe { dqp.slice((bi * t + i0 + r) * qs + h * hd, hd) };
                        for (x, a) in dqr
                            .iter_mut()
                            .zip(&dq_acc[(i0 + r) * hd..(i0 + r + 1) * hd])
                        {
                            *x = *a * scale;
                        }
                    }
                }
            },
        );
    // dK, dV of kv head kh = Σ over its query heads, in head order.
    let (dk_h, dv_h) = (&dk_h, &dv_h);
    dk.par_chunks_mut(kvs)
        .zip(dv.par_chunks_mut(kvs))
        .enumerate()
        .for_each(|(row, (dkr, dvr))| {
            let (bi, j) = (row / t, row % t);
            for kh in 0..nkv {
                let (dks, dvs) = (
                    &mut dkr[kh * hd..(kh + 1) * hd],
                    &mut dvr[kh * hd..(kh + 1) * hd],
                );
                dks.fill(0.0);
                dvs.fill(0.0);
                for h in kh * group..(kh + 1) * group {
                    let at = (bi * nh + h) * per_head + j * hd;
                    for ((x, y), (a, c)) in dks
                        .iter_mut()
                        .zip(dvs.iter_mut())
                        .zip(dk_h[at..at + hd].iter().zip(&dv_h[at..at + hd]))
                    {
                        *x += *a;
                        *y += *c;
                    }
                }
            }
        });
}

/// The inputs of the backward's tile recomputation.
struct Tile<'a> {
    q: &'a [f32],
    k: &'a [f32],
    v: &'a [f32],
    d_o: &'a [f32],
    lse: &'a [f32],
    delta: &'a [f32],
    pos: &'a [u32],
    s: AttnShape,
    scale: f32,
}

impl Tile<'_> {
    /// For queries `i0..i0+m` of head `h` and keys `j0..j0+n`: `sc.q` = Q·scale, `sc.do_` = dO
    /// (gathered when `gather`: the first key tile of a query tile), `sc.s` = P (0 where not
    /// visible), `sc.dp` = dS = P ⊙ (dO·Vᵀ − D).
    #[allow(clippy::too_many_arguments)]
    fn probabilities_and_ds(
        &self,
        sc: &mut Scratch,
        bi: usize,
        h: usize,
        i0: usize,
        m: usize,
        j0: usize,
        n: usize,
        gather: bool,
    ) {
        let AttnShape { t, nh, nkv, hd, .. } = self.s;
        let (qs, kvs) = (nh * hd, nkv * hd);
        let kh = h / (nh / nkv);
        let q0 = (bi * t + i0) * qs + h * hd;
        let kv0 = (bi * t + j0) * kvs + kh * hd;
        if gather {
            gather_rows(&mut sc.q, &self.q[q0..], qs, m, hd, self.scale);
            gather_rows(&mut sc.do_, &self.d_o[q0..], qs, m, hd, 1.0);
        }
        gemm_serial(
            &mut sc.s[..m * n],
            &sc.q,
            (hd, 1),
            &self.k[kv0..],
            (1, kvs),
            m,
            hd,
            n,
            false,
        );
        gemm_serial(
            &mut sc.dp[..m * n],
            &sc.do_,
            (hd, 1),
            &self.v[kv0..],
            (1, kvs),
            m,
            hd,
            n,
            false,
        );
        for r in 0..m {
            let i = i0 + r;
            let (lo, hi) = visible(self.pos, bi, t, i, j0, n);
            let (li, di) = (
                self.lse[(bi * nh + h) * t + i],
                self.delta[(bi * nh + h) * t + i],
            );
            let (p, ds) = (
                &mut sc.s[r * n..(r + 1) * n],
                &mut sc.dp[r * n..(r + 1) * n],
            );
            p[..lo].fill(0.0);
            p[hi..].fill(0.0);
            exp_shifted(&mut p[lo..hi], li);
            for (d, pp) in ds.iter_mut().zip(p.iter()) {
                *d = *pp * (*d - di);
            }
        }
    }
}

/// Largest element.
fn row_max(x: &[f32]) -> f32 {
    x.iter().copied().fold(f32::NEG_INFINITY, f32::max)
}

/// `x = exp(x − shift)` in place (every x − shift ≤ 0 up to rounding); returns Σ x, summed in
/// 16 fixed lanes.
fn exp_shifted(x: &mut [f32], shift: f32) -> f32 {
    #[cfg(target_arch = "x86_64")]
    {
        if std::arch::is_x86_feature_detected!("avx512f") {
            // SAFETY: the CPU has AVX-512F (checked).
            return unsafe { exp_shifted_avx512(x, shift) };
        }
        if std::arch::is_x86_feature_detected!("avx2") && std::arch::is_x86_feature_detected!("fma")
        {
            // SAFETY: the CPU has AVX2 and FMA (checked).
            return unsafe { exp_shifted_avx2(x, shift) };
        }
    }
    exp_shifted_body(x, shift)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx512f,avx2,fma")]
unsafe fn exp_shifted_avx512(x: &mut [f32], shift: f32) -> f32 {
    exp_shifted_body(x, shift)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn exp_shifted_avx2(x: &mut [f32], shift: f32) -> f32 {
    exp_shifted_body(x, shift)
}

#[inline(always)]
fn exp_shifted_body(x: &mut [f32], shift: f32) -> f32 {
    for v in x.iter_mut() {
        *v = exp_neg(*v - shift);
    }
    let mut lanes = [0.0f32; 16];
    let mut chunks = x.chunks_exact(16);
    for c in &mut chunks {
        for (l, v) in lanes.iter_mut().zip(c) {
            *l += *v;
        }
    }
    let tail: f32 = chunks.remainder().iter().sum();
    lanes.iter().sum::<f32>() + tail
}

/// e^x for x ≤ 0 (a small positive x from rounding is fine), branch-free so it vectorises:
/// x = n·ln 2 + r with |r| ≤ ln 2 / 2, e^r by its degree-6 Taylor polynomial (relative error
/// < 2e-7), 2^n from the exponent bits; below −87 it returns ≈ 0 (< 2e-38).
#[inline(always)]
fn exp_neg(x: f32) -> f32 {
    const LOG2E: f32 = std::f32::consts::LOG2_E;
    const LN2_HI: f32 = 0.693_145_75;
    const LN2_LO: f32 = 1.428_606_8e-6;
    let x = x.clamp(-87.0, 0.5);
    let n = (x * LOG2E + 0.5).floor();
    let r = x - n * LN2_HI - n * LN2_LO;
    let p = 1.0
        + r * (1.0
            + r * (0.5
                + r * (1.0 / 6.0 + r * (1.0 / 24.0 + r * (1.0 / 120.0 + r * (1.0 / 720.0))))));
    // 2^n without a float → int conversion (which does not vectorise): the biased exponent
    // n + 127 ∈ [2, 128] lands in the mantissa bits of (n + 127) + 2^23.
    let biased = (n + (127.0 + 8_388_608.0)).to_bits() - 0x4B00_0000;
    p * f32::from_bits(biased << 23)
}

#[inline]
fn dot(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0.0f32; 8];
    let n8 = a.len() / 8 * 8;
    for i in (0..n8).step_by(8) {
        for l in 0..8 {
            acc[l] += a[i + l] * b[i + l];
        }
    }
    let mut s = acc.iter().sum::<f32>();
    for i in n8..a.len() {
        s += a[i] * b[i];
    }
    s
}

/// Reference attention with the full T×T score matrix (tests only compare against it).
pub fn attention_naive(o: &mut [f32], q: &[f32], k: &[f32], v: &[f32], pos: &[u32], s: AttnShape) {
    let AttnShape { b, t, nh, nkv, hd } = s;
    let group = nh / nkv;
    let scale = 1.0 / (hd as f32).sqrt();
    let (qs, kvs) = (nh * hd, nkv * hd);
    for bi in 0..b {
        for h in 0..nh {
            let kh = h / group;
            for i in 0..t {
                let qi = &q[(bi * t + i) * qs + h * hd..][..hd];
                let j0 = first_key(pos, bi, t, i);
                let sc: Vec<f64> = (j0..=i)
                    .map(|j| f64::from(dot(qi, &k[(bi * t + j) * kvs + kh * hd..][..hd]) * scale))
                    .collect();
                let mx = sc.iter().copied().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = sc.iter().map(|x| (x - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                let orow = &mut o[(bi * t + i) * qs + h * hd..][..hd];
                let mut acc = vec![0.0f64; hd];
                for (j, p) in (j0..=i).zip(&e) {
                    let vj = &v[(bi * t + j) * kvs + kh * hd..][..hd];
                    for (x, vv) in acc.iter_mut().zip(vj) {
                        *x += p / z * f64::from(*vv);
                    }
                }
                for (x, a) in orow.iter_mut().zip(&acc) {
                    *x = *a as f32;
                }
            }
        }
    }
}
