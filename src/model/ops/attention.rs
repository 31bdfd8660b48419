//! Causal grouped-query attention on the CPU, FlashAttention-2 style: tiles of queries × keys as
//! small GEMMs (the `gemm` crate's SIMD kernels, one thread per tile), an online softmax with a
//! vectorised exponential, no T×T matrix. Documents packed into one row never see each other:
//! query i attends to keys `i − pos[i] ..= i` (see [`first_key`]), and under a sliding window of
//! W only to the last W of them (`i + 1 − W ..= i`); key tiles start at a tile's first key, so the
//! work outside a window is never done.
//!
//! Both passes stack the query rows of a GQA group's heads, so each K/V tile is packed once per
//! group and the GEMMs are taller. Work is split so no two threads write the same memory: the
//! forward by (sequence, kv head, query tile); the backward by (sequence, kv head) over its whole
//! lower triangle — `D = rowsum(dO ⊙ O)` first, then per tile pair the probabilities recomputed
//! from the forward's log-sum-exp and five GEMMs (S, dP, dV, dK, dQ; the group's heads summed
//! inside the dK/dV GEMMs). Every sum runs in a fixed order, so results do not depend on the
//! thread count; the backward's parallelism is B × NKV tasks, and its scratch is two [T, hd]
//! accumulators and one tile per task.

use super::exp::{exp_shifted, row_max};
use super::gemm_serial;
use rayon::prelude::*;

/// Attention shape: B sequences of T tokens (keys and values), NH query heads, NKV kv heads,
/// head dim HD; the queries are rows `q0..q1` of every sequence. The query-side buffers (q, o,
/// dO, dq `[B·(q1−q0), NH·HD]`, lse and delta `[B, NH, q1−q0]`) hold only those rows, the
/// key-side ones (k, v, dk, dv `[B·T, NKV·HD]`) and the positions `[B·T]` the whole sequences.
/// Query tiles start at `q0`: a caller that splits a sequence into query ranges starting at
/// multiples of [`ATTN_TILE`] gets the same bits as one call over the whole sequence.
#[derive(Debug, Clone, Copy, PartialEq)]
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
    /// First query row of each sequence.
    pub q0: usize,
    /// One past the last query row (≤ `t`).
    pub q1: usize,
    /// Sliding window: each query sees itself and the `window − 1` keys before it (transformers'
    /// `kv_idx > q_idx − sliding_window`); `None`: every earlier key of its document.
    pub window: Option<usize>,
    /// The softmax scale where it is not `hd^-½` (Gemma's `query_pre_attn_scalar^-½`).
    pub scale: Option<f32>,
    /// Logit soft-capping (Gemma 2's `attn_logit_softcapping`): each scaled score s becomes
    /// `cap·tanh(s / cap)` before the softmax.
    pub softcap: Option<f32>,
}

impl AttnShape {
    /// Every query of B sequences of T tokens.
    pub fn causal(b: usize, t: usize, nh: usize, nkv: usize, hd: usize) -> Self {
        AttnShape {
            b,
            t,
            nh,
            nkv,
            hd,
            q0: 0,
            q1: t,
            window: None,
            scale: None,
            softcap: None,
        }
    }

    /// The same attention with its scores soft-capped at `softcap` (`None`: none).
    pub fn softcapped(self, softcap: Option<f32>) -> Self {
        AttnShape { softcap, ..self }
    }

    /// The same attention with the softmax scale `scale` (`None`: `hd^-½`).
    pub fn scaled(self, scale: Option<f32>) -> Self {
        AttnShape { scale, ..self }
    }

    /// The factor on q·k: [`AttnShape::scale`], else `1/√hd`.
    pub fn softmax_scale(&self) -> f32 {
        self.scale.unwrap_or(1.0 / (self.hd as f32).sqrt())
    }

    /// The same attention with a sliding window of `window` keys (`None`: none).
    pub fn windowed(self, window: Option<usize>) -> Self {
        AttnShape { window, ..self }
    }

    /// The same keys, queries `q0..q1` of each sequence.
    pub fn queries(self, q0: usize, q1: usize) -> Self {
        AttnShape { q0, q1, ..self }
    }

    /// Query rows per sequence.
    pub fn nq(&self) -> usize {
        self.q1 - self.q0
    }
}

/// Query rows per tile (the most: see [`query_tile`]).
pub const ATTN_TILE: usize = 128;

/// Query rows per tile for shape `s`: [`ATTN_TILE`], or under a sliding window of W fewer —
/// W/32 rounded up to a power of two, at least 16 — since a tile computes scores for W + rows − 1
/// keys of which each row sees W (at W = 1024, 32 rows: 3% more than the window where 128 rows
/// did 12%). Every tile size divides [`ATTN_TILE`], so query ranges split at its multiples
/// still give the bits of one call.
pub fn query_tile(s: AttnShape) -> usize {
    match s.window {
        Some(w) if w < s.t => (w / 32).next_power_of_two().clamp(16, ATTN_TILE),
        _ => ATTN_TILE,
    }
}
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

/// The first key query `i` of sequence `bi` attends to: its document's first token, or under a
/// sliding window of W the W-th key back (itself the first), whichever comes later. `pos`
/// `[B·T]` holds each token's position in its document (0 at a document's first token), so
/// documents packed into one row never attend to each other; with [`flat_positions`] and no
/// window it is 0. First keys never decrease along a sequence.
#[inline]
fn first_key(pos: &[u32], s: AttnShape, bi: usize, i: usize) -> usize {
    let t = s.t;
    debug_assert!(
        i == 0
            || i.saturating_sub(pos[bi * t + i] as usize)
                >= (i - 1).saturating_sub(pos[bi * t + i - 1] as usize),
        "first keys must not decrease (Templates::check_batch)"
    );
    let doc = i.saturating_sub(pos[bi * t + i] as usize);
    match s.window {
        Some(w) => doc.max((i + 1).saturating_sub(w)),
        None => doc,
    }
}

/// Soft-cap scores in place: `s = cap·tanh(s / cap)` (transformers' order: divide, tanh,
/// multiply).
#[inline]
fn cap_scores(row: &mut [f32], cap: f32) {
    for x in row {
        *x = (*x / cap).tanh() * cap;
    }
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

/// The forward's scratch for one tile of `rows` stacked query rows.
struct FwdScratch {
    q: Vec<f32>,   // [rows, hd] queries × 1/√hd
    s: Vec<f32>,   // [rows, KEY_TILE] scores, then probabilities
    acc: Vec<f32>, // [rows, hd] the output accumulator
    mx: Vec<f32>,  // [rows] running max
    l: Vec<f32>,   // [rows] running sum
}

impl FwdScratch {
    fn new(hd: usize, rows: usize) -> Self {
        FwdScratch {
            q: vec![0.0; rows * hd],
            s: vec![0.0; rows * KEY_TILE],
            acc: vec![0.0; rows * hd],
            mx: vec![0.0; rows],
            l: vec![0.0; rows],
        }
    }
}

/// The backward's scratch for one tile of `rows` stacked query rows.
struct BwdScratch {
    q: Vec<f32>,   // [rows, hd] queries × 1/√hd
    do_: Vec<f32>, // [rows, hd] dO rows, contiguous
    s: Vec<f32>,   // [rows, KEY_TILE] probabilities
    dp: Vec<f32>,  // [rows, KEY_TILE] dO·Vᵀ, then dS
    cap: Vec<f32>, // [KEY_TILE] under soft-capping: one row's 1 − tanh² of its scores
}

impl BwdScratch {
    fn new(hd: usize, rows: usize) -> Self {
        BwdScratch {
            q: vec![0.0; rows * hd],
            do_: vec![0.0; rows * hd],
            s: vec![0.0; rows * KEY_TILE],
            dp: vec![0.0; rows * KEY_TILE],
            cap: vec![0.0; KEY_TILE],
        }
    }
}

/// Stack the query tile `i0..i0+m` of every head of kv head `kh`'s GQA group from `src`
/// (`[B·(q1−q0), NH·HD]`, q or dO) into `dst`, times `scale`: row r is head kh·group + r / m,
/// query i0 + r % m.
#[allow(clippy::too_many_arguments)]
fn gather_group(
    dst: &mut [f32],
    src: &[f32],
    s: AttnShape,
    bi: usize,
    kh: usize,
    i0: usize,
    m: usize,
    scale: f32,
) {
    let (qs, hd, group) = (s.nh * s.hd, s.hd, s.nh / s.nkv);
    for g in 0..group {
        let at = (bi * s.nq() + i0 - s.q0) * qs + (kh * group + g) * hd;
        for (r, d) in dst[g * m * hd..(g + 1) * m * hd]
            .chunks_exact_mut(hd)
            .enumerate()
        {
            for (x, y) in d.iter_mut().zip(&src[at + r * qs..at + r * qs + hd]) {
                *x = *y * scale;
            }
        }
    }
}

/// `c[rows, n] = a[rows, hd] · X[j0..j0+n]ᵀ`, X (k or v) read at its element `x0` = row j0's
/// kv head with row stride `kvs`.
#[allow(clippy::too_many_arguments)]
fn times_tile_t(
    c: &mut [f32],
    a: &[f32],
    x: &[f32],
    x0: usize,
    kvs: usize,
    rows: usize,
    n: usize,
    hd: usize,
) {
    gemm_serial(
        &mut c[..rows * n],
        a,
        (hd, 1),
        &x[x0..],
        (1, kvs),
        rows,
        hd,
        n,
        false,
    );
}

/// `c[rows, hd] += a[rows, n] · X[j0..j0+n]`, X as in [`times_tile_t`].
#[allow(clippy::too_many_arguments)]
fn plus_times_tile(
    c: &mut [f32],
    a: &[f32],
    x: &[f32],
    x0: usize,
    kvs: usize,
    rows: usize,
    n: usize,
    hd: usize,
) {
    gemm_serial(
        &mut c[..rows * hd],
        &a[..rows * n],
        (n, 1),
        &x[x0..],
        (kvs, 1),
        rows,
        n,
        hd,
        true,
    );
}

/// `c[n, hd] += a[rows, n]ᵀ · b[rows, hd]` (a key tile's dK or dV).
fn plus_transposed_times(c: &mut [f32], a: &[f32], b: &[f32], rows: usize, n: usize, hd: usize) {
    gemm_serial(
        &mut c[..n * hd],
        &a[..rows * n],
        (1, n),
        b,
        (hd, 1),
        n,
        rows,
        hd,
        true,
    );
}

/// Check a shape and every buffer's size (name, elements held, elements needed) before any raw
/// access (a safe function must not touch memory out of bounds whatever it is given).
fn check_shape(s: AttnShape, pos: &[u32], outs: &[(&str, usize, usize)]) {
    assert!(
        s.nkv > 0 && s.nh.is_multiple_of(s.nkv),
        "attention: heads must be a multiple of kv heads"
    );
    assert!(
        s.q0 <= s.q1 && s.q1 <= s.t,
        "attention: queries {}..{} of {} tokens",
        s.q0,
        s.q1,
        s.t
    );
    assert_eq!(pos.len(), s.b * s.t, "attention: one position per token");
    for &(what, have, need) in outs {
        assert!(have >= need, "attention: {what} holds {have}, needs {need}");
    }
}

/// The columns of a score row that query `i` may see, for keys `j0..j0 + n`: `[lo, hi)`.
#[inline]
fn visible(pos: &[u32], s: AttnShape, bi: usize, i: usize, j0: usize, n: usize) -> (usize, usize) {
    let lo = first_key(pos, s, bi, i).saturating_sub(j0).min(n);
    let hi = (i + 1).saturating_sub(j0).min(n);
    (lo, hi.max(lo))
}

/// Causal GQA attention over documents, for the queries `s.q0..s.q1` of each sequence (see
/// [`AttnShape`] for the layouts). `pos` [B·T] is each token's position in its document: query
/// i attends to keys `i − pos[i] ..= i` (its own document's, up to itself). `lse` [B, NH, q1−q0]
/// receives the row log-sum-exp for the backward. Query head h reads kv head h / (NH/NKV).
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
    let AttnShape {
        b, t, nh, nkv, hd, ..
    } = s;
    let nq = s.nq();
    let (qn, kn) = (b * nq * nh * hd, b * t * nkv * hd);
    check_shape(
        s,
        pos,
        &[
            ("o", o.len(), qn),
            ("lse", lse.len(), b * nh * nq),
            ("q", q.len(), qn),
            ("k", k.len(), kn),
            ("v", v.len(), kn),
        ],
    );
    let group = nh / nkv;
    let scale = s.softmax_scale();
    let (qs, kvs) = (nh * hd, nkv * hd);
    let tile = query_tile(s);
    let qtiles = nq.div_ceil(tile);
    let (optr, lptr) = (SendPtr(o.as_mut_ptr()), SendPtr(lse.as_mut_ptr()));
    // One task per (sequence, kv head, query tile): the tile's rows of every query head of the
    // GQA group stacked, so each K/V tile is packed once for the group and the GEMMs are taller.
    let rows = group * tile;
    (0..b * nkv * qtiles).into_par_iter().for_each_init(
        || FwdScratch::new(hd, rows),
        |sc, task| {
            let (bk, qt) = (task / qtiles, task % qtiles);
            let (bi, kh) = (bk / nkv, bk % nkv);
            let i0 = s.q0 + qt * tile;
            let i1 = (i0 + tile).min(s.q1);
            let m = i1 - i0;
            let gm = group * m; // stacked row r: head kh·group + r / m, query i0 + r % m
            gather_group(&mut sc.q, q, s, bi, kh, i0, m, scale);
            sc.acc[..gm * hd].fill(0.0);
            sc.mx[..gm].fill(f32::NEG_INFINITY);
            sc.l[..gm].fill(0.0);
            let mut j0 = first_key(pos, s, bi, i0);
            while j0 < i1 {
                let n = KEY_TILE.min(i1 - j0);
                let kv0 = (bi * t + j0) * kvs + kh * hd;
                // S[gm, n] = Qs · K[j0..j0+n]ᵀ
                times_tile_t(&mut sc.s, &sc.q, k, kv0, kvs, gm, n, hd);
                for r in 0..gm {
                    let (lo, hi) = visible(pos, s, bi, i0 + r % m, j0, n);
                    let row = &mut sc.s[r * n..(r + 1) * n];
                    if lo == hi {
                        row.fill(0.0);
                        continue;
                    }
                    if let Some(cap) = s.softcap {
                        cap_scores(&mut row[lo..hi], cap);
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
                // acc[gm, hd] += P[gm, n] · V[j0..j0+n]
                plus_times_tile(&mut sc.acc, &sc.s, v, kv0, kvs, gm, n, hd);
                j0 += n;
            }
            for r in 0..gm {
                let (h, i) = (kh * group + r / m, i0 - s.q0 + r % m);
                let inv = 1.0 / sc.l[r];
                // SAFETY: query row (bi, i), head h of `o` and its lse entry (inside the buffers:
                // checked above): this task (bi, kh, qt) is their only writer.
                let (orow, l) = unsafe {
                    (
                        optr.slice((bi * nq + i) * qs + h * hd, hd),
                        lptr.slice((bi * nh + h) * nq + i, 1),
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

/// Backward of [`attention_fwd`] for its queries `s.q0..s.q1`, recomputing the probabilities tile
/// by tile from q, k and `lse`: dq written; dk and dv **accumulated** (`+=`, so a sequence's key
/// gradients can be summed over query ranges in order: the caller zeroes them first); `delta`
/// `[B, NH, q1−q0]` is scratch.
#[allow(clippy::too_many_arguments)]
pub fn attention_bwd(
    dq: &mut [f32],
    dk: &mut [f32],
    dv: &mut [f32],
    delta: &mut [f32],
    d_o: &[f32],
    q: &[f32],
    k: &[f32],
    v: &[f32],
    o: &[f32],
    lse: &[f32],
    pos: &[u32],
    s: AttnShape,
) {
    let AttnShape {
        b, t, nh, nkv, hd, ..
    } = s;
    let nq = s.nq();
    let (qn, kn) = (b * nq * nh * hd, b * t * nkv * hd);
    check_shape(
        s,
        pos,
        &[
            ("dq", dq.len(), qn),
            ("dk", dk.len(), kn),
            ("dv", dv.len(), kn),
            ("delta", delta.len(), b * nh * nq),
            ("dO", d_o.len(), qn),
            ("q", q.len(), qn),
            ("k", k.len(), kn),
            ("v", v.len(), kn),
            ("o", o.len(), qn),
            ("lse", lse.len(), b * nh * nq),
        ],
    );
    if nq == 0 {
        return;
    }
    let group = nh / nkv;
    let scale = s.softmax_scale();
    let (qs, kvs) = (nh * hd, nkv * hd);
    // D[b, h, i] = dO_i · O_i
    delta[..b * nh * nq]
        .par_chunks_mut(nq)
        .enumerate()
        .for_each(|(bh, d)| {
            let (bi, h) = (bh / nh, bh % nh);
            for (i, x) in d.iter_mut().enumerate() {
                let r = (bi * nq + i) * qs + h * hd;
                *x = dot(&d_o[r..r + hd], &o[r..r + hd]);
            }
        });
    let delta = &*delta;
    let tile = Tile {
        k,
        v,
        lse,
        delta,
        pos,
        s,
    };
    // One task per (sequence, kv head) over its queries' lower triangle, the query tile's rows
    // of every head of the GQA group stacked: it alone writes that kv head's dK/dV (summed over
    // the group inside the GEMMs) and its query heads' dQ. Its keys are those the first query's
    // document starts at up to the last query.
    let qrows = query_tile(s);
    let qtiles = nq.div_ceil(qrows);
    let (dqp, dkp, dvp) = (
        SendPtr(dq.as_mut_ptr()),
        SendPtr(dk.as_mut_ptr()),
        SendPtr(dv.as_mut_ptr()),
    );
    let rows = group * qrows;
    (0..b * nkv).into_par_iter().for_each(|task| {
        let (bi, kh) = (task / nkv, task % nkv);
        let kfirst = first_key(pos, s, bi, s.q0);
        let keys = s.q1 - kfirst;
        let mut sc = BwdScratch::new(hd, rows);
        // The task's keys' dK/dV rows, gathered so the tile GEMMs accumulate onto them.
        let (mut dk_acc, mut dv_acc) = (vec![0.0f32; keys * hd], vec![0.0f32; keys * hd]);
        for j in 0..keys {
            let at = (bi * t + kfirst + j) * kvs + kh * hd;
            // SAFETY: dk/dv rows (bi, kfirst + j), head kh (inside dk/dv: checked above): this
            // task alone touches them.
            let (dkr, dvr) = unsafe { (dkp.slice(at, hd), dvp.slice(at, hd)) };
            dk_acc[j * hd..(j + 1) * hd].copy_from_slice(dkr);
            dv_acc[j * hd..(j + 1) * hd].copy_from_slice(dvr);
        }
        let mut dq_acc = vec![0.0f32; rows * hd];
        for qt in 0..qtiles {
            let i0 = s.q0 + qt * qrows;
            let i1 = (i0 + qrows).min(s.q1);
            let (m, mut j0) = (i1 - i0, first_key(pos, s, bi, i0));
            let gm = group * m;
            gather_group(&mut sc.q, q, s, bi, kh, i0, m, scale);
            gather_group(&mut sc.do_, d_o, s, bi, kh, i0, m, 1.0);
            dq_acc[..gm * hd].fill(0.0);
            while j0 < i1 {
                let n = KEY_TILE.min(i1 - j0);
                let kv0 = (bi * t + j0) * kvs + kh * hd;
                tile.probabilities_and_ds(&mut sc, bi, kh, i0, m, j0, n);
                let (p, ds) = (&sc.s[..gm * n], &sc.dp[..gm * n]);
                let local = (j0 - kfirst) * hd;
                // dV[n, hd] += Pᵀ · dO;  dK[n, hd] += dSᵀ · Qs;  dQ[gm, hd] += dS · K
                plus_transposed_times(&mut dv_acc[local..], p, &sc.do_, gm, n, hd);
                plus_transposed_times(&mut dk_acc[local..], ds, &sc.q, gm, n, hd);
                plus_times_tile(&mut dq_acc, ds, k, kv0, kvs, gm, n, hd);
                j0 += n;
            }
            for r in 0..gm {
                let (h, i) = (kh * group + r / m, i0 - s.q0 + r % m);
                // SAFETY: dq row (bi, i), head h (inside dq: checked above): this task (bi, kh)
                // alone writes it.
                let dqr = unsafe { dqp.slice((bi * nq + i) * qs + h * hd, hd) };
                for (x, a) in dqr.iter_mut().zip(&dq_acc[r * hd..(r + 1) * hd]) {
                    *x = *a * scale;
                }
            }
        }
        for j in 0..keys {
            let at = (bi * t + kfirst + j) * kvs + kh * hd;
            // SAFETY: as above.
            let (dkr, dvr) = unsafe { (dkp.slice(at, hd), dvp.slice(at, hd)) };
            dkr.copy_from_slice(&dk_acc[j * hd..(j + 1) * hd]);
            dvr.copy_from_slice(&dv_acc[j * hd..(j + 1) * hd]);
        }
    });
}

/// The inputs of the backward's tile recomputation.
struct Tile<'a> {
    k: &'a [f32],
    v: &'a [f32],
    lse: &'a [f32],
    delta: &'a [f32],
    pos: &'a [u32],
    s: AttnShape,
}

impl Tile<'_> {
    /// For the gathered rows and keys `j0..j0+n`: `sc.s` = P (0 where not visible), `sc.dp` =
    /// dS = P ⊙ (dO·Vᵀ − D) — under soft-capping times the cap's derivative 1 − tanh².
    #[allow(clippy::too_many_arguments)]
    fn probabilities_and_ds(
        &self,
        sc: &mut BwdScratch,
        bi: usize,
        kh: usize,
        i0: usize,
        m: usize,
        j0: usize,
        n: usize,
    ) {
        let AttnShape {
            t, nh, nkv, hd, q0, ..
        } = self.s;
        let (kvs, group, nq) = (nkv * hd, nh / nkv, self.s.nq());
        let gm = group * m;
        let kv0 = (bi * t + j0) * kvs + kh * hd;
        times_tile_t(&mut sc.s, &sc.q, self.k, kv0, kvs, gm, n, hd);
        times_tile_t(&mut sc.dp, &sc.do_, self.v, kv0, kvs, gm, n, hd);
        for r in 0..gm {
            let (h, i) = (kh * group + r / m, i0 + r % m);
            let (lo, hi) = visible(self.pos, self.s, bi, i, j0, n);
            let at = (bi * nh + h) * nq + i - q0;
            let (li, di) = (self.lse[at], self.delta[at]);
            let (p, ds) = (
                &mut sc.s[r * n..(r + 1) * n],
                &mut sc.dp[r * n..(r + 1) * n],
            );
            p[..lo].fill(0.0);
            p[hi..].fill(0.0);
            if let Some(cap) = self.s.softcap {
                for (c, x) in sc.cap[lo..hi].iter_mut().zip(&mut p[lo..hi]) {
                    let th = (*x / cap).tanh();
                    *c = 1.0 - th * th;
                    *x = th * cap;
                }
            }
            exp_shifted(&mut p[lo..hi], li);
            for (d, pp) in ds.iter_mut().zip(p.iter()) {
                *d = *pp * (*d - di);
            }
            if self.s.softcap.is_some() {
                for (d, c) in ds[lo..hi].iter_mut().zip(&sc.cap[lo..hi]) {
                    *d *= *c;
                }
            }
        }
    }
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
    let AttnShape {
        b, t, nh, nkv, hd, ..
    } = s;
    assert_eq!((s.q0, s.q1), (0, t), "attention_naive: every query");
    let group = nh / nkv;
    let scale = s.softmax_scale();
    let (qs, kvs) = (nh * hd, nkv * hd);
    for bi in 0..b {
        for h in 0..nh {
            let kh = h / group;
            for i in 0..t {
                let qi = &q[(bi * t + i) * qs + h * hd..][..hd];
                let j0 = first_key(pos, s, bi, i);
                let cap = |x: f32| match s.softcap {
                    Some(c) => (x / c).tanh() * c,
                    None => x,
                };
                let sc: Vec<f64> = (j0..=i)
                    .map(|j| {
                        f64::from(cap(
                            dot(qi, &k[(bi * t + j) * kvs + kh * hd..][..hd]) * scale
                        ))
                    })
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
