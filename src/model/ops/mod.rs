//! CPU kernels of the Llama family, forward and explicit backward: the reference every other
//! backend is checked against. Shapes are written beside the code (`// [N, C]`); matrices are
//! row-major; a Linear weight is `[out, in]` and `y = x·Wᵀ` (HF convention).

use rayon::prelude::*;

/// C[m, n] (row-major) = (accumulate ? C : 0) + A·B, where A is m×k and B is k×n, each given by
/// its row and column strides (so a transpose is just swapped strides).
#[allow(clippy::too_many_arguments)]
pub fn gemm(
    c: &mut [f32],
    a: &[f32],
    (a_rs, a_cs): (usize, usize),
    b: &[f32],
    (b_rs, b_cs): (usize, usize),
    m: usize,
    k: usize,
    n: usize,
    accumulate: bool,
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
            if m * n * k >= 1 << 15 {
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

/// db += Σ_rows dy, dy `[n, db.len()]`.
pub fn bias_bwd(db: &mut [f32], dy: &[f32], n: usize) {
    let dout = db.len();
    db.par_iter_mut().enumerate().for_each(|(o, d)| {
        let mut s = 0.0f32;
        for r in 0..n {
            s += dy[r * dout + o];
        }
        *d += s;
    });
}

/// Backward of [`linear_fwd`]: dx (= or +=) dy·W, dW += dyᵀ·x, db += Σ_rows dy.
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
    din: usize,
    dout: usize,
) {
    gemm(dx, dy, (dout, 1), w, (din, 1), n, dout, din, dx_accumulate);
    // dW[out, in] += dyᵀ[out, N] · x[N, in]
    gemm(dw, dy, (1, dout), x, (din, 1), dout, n, din, true);
    if let Some(db) = db {
        bias_bwd(&mut db[..dout], dy, n);
    }
}

/// RMSNorm: y = w ⊙ (x · rsqrt(mean(x²) + eps)) per row; stores 1/rms per row in `rstd`.
pub fn rmsnorm_fwd(y: &mut [f32], rstd: &mut [f32], x: &[f32], w: &[f32], c: usize, eps: f32) {
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
                *o = *wv * (*xv * inv);
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
    w: &[f32],
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
                .map(|((g, xv), wv)| f64::from(*g * *wv) * f64::from(*xv))
                .sum();
            let k = (dot / c as f64) as f32 * r * r * r;
            for (((o, g), xv), wv) in dxr.iter_mut().zip(dyr).zip(xr).zip(w) {
                let v = *r * (*wv * *g) - k * *xv;
                if dx_accumulate {
                    *o += v;
                } else {
                    *o = v;
                }
            }
        });
    // dw: reduce over rows, parallel over columns.
    let rows = rstd.len();
    dw.par_iter_mut().enumerate().for_each(|(j, d)| {
        let mut s = 0.0f32;
        for r in 0..rows {
            s += dy[r * c + j] * x[r * c + j] * rstd[r];
        }
        *d += s;
    });
}

/// Rotary position embedding tables, computed as HF does in fp32:
/// `inv_freq[i] = 1 / θ^(2i/hd)`, `angle = pos · inv_freq[i]`.
#[derive(Debug, Clone)]
pub struct Rope {
    /// Head dimension.
    pub head_dim: usize,
    /// Positions covered.
    pub max_pos: usize,
    cos: Vec<f32>, // [max_pos, hd/2]
    sin: Vec<f32>, // [max_pos, hd/2]
}

impl Rope {
    /// Tables for positions `0..max_pos`.
    pub fn new(head_dim: usize, theta: f64, max_pos: usize) -> Self {
        let half = head_dim / 2;
        let base = theta as f32;
        let inv: Vec<f32> = (0..half)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / head_dim as f32))
            .collect();
        let mut cos = Vec::with_capacity(max_pos * half);
        let mut sin = Vec::with_capacity(max_pos * half);
        for p in 0..max_pos {
            for f in &inv {
                let a = p as f32 * f;
                cos.push(a.cos());
                sin.push(a.sin());
            }
        }
        Rope {
            head_dim,
            max_pos,
            cos,
            sin,
        }
    }

    /// The tables, `[max_pos, hd/2]` each: (cos, sin).
    pub fn tables(&self) -> (&[f32], &[f32]) {
        (&self.cos, &self.sin)
    }

    /// Rotate `x` [B·T, heads·hd] in place, row r by the angle of position `positions[r]`
    /// (`inverse` = the backward, Rᵀ).
    pub fn apply(&self, x: &mut [f32], positions: &[u32], heads: usize, inverse: bool) {
        let hd = self.head_dim;
        let half = hd / 2;
        assert_eq!(
            x.len(),
            positions.len() * heads * hd,
            "rope: one position per row"
        );
        assert!(
            positions.iter().all(|&p| (p as usize) < self.max_pos),
            "position beyond the RoPE table"
        );
        x.par_chunks_mut(heads * hd)
            .zip(positions.par_iter())
            .for_each(|(xr, &pos)| {
                let pos = pos as usize;
                let (c, s) = (
                    &self.cos[pos * half..(pos + 1) * half],
                    &self.sin[pos * half..(pos + 1) * half],
                );
                for h in xr.chunks_mut(hd) {
                    for i in 0..half {
                        let (a, b) = (h[i], h[i + half]);
                        if inverse {
                            h[i] = a * c[i] + b * s[i];
                            h[i + half] = b * c[i] - a * s[i];
                        } else {
                            h[i] = a * c[i] - b * s[i];
                            h[i + half] = b * c[i] + a * s[i];
                        }
                    }
                }
            });
    }
}

/// SwiGLU: h = silu(g) ⊙ u.
pub fn swiglu_fwd(h: &mut [f32], g: &[f32], u: &[f32]) {
    h.par_iter_mut()
        .zip(g.par_iter().zip(u.par_iter()))
        .for_each(|(o, (g, u))| {
            *o = *g / (1.0 + (-*g).exp()) * *u;
        });
}

/// Backward of [`swiglu_fwd`]: writes dg and du.
pub fn swiglu_bwd(dg: &mut [f32], du: &mut [f32], dh: &[f32], g: &[f32], u: &[f32]) {
    dg.par_iter_mut()
        .zip(du.par_iter_mut())
        .zip(dh.par_iter().zip(g.par_iter().zip(u.par_iter())))
        .for_each(|((dg, du), (dh, (g, u)))| {
            let sig = 1.0 / (1.0 + (-*g).exp());
            let silu = *g * sig;
            *du = *dh * silu;
            *dg = *dh * *u * (sig * (1.0 + *g * (1.0 - sig)));
        });
}

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

/// Query/key tile edge of the flash-style kernels.
pub const ATTN_TILE: usize = 64;

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
#[inline]
fn first_key(pos: &[u32], bi: usize, t: usize, i: usize) -> usize {
    i.saturating_sub(pos[bi * t + i] as usize)
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

#[derive(Clone, Copy)]
struct SendPtr(*mut f32);
// SAFETY: used only to hand disjoint head slices of one buffer to parallel tasks (see callers).
unsafe impl Send for SendPtr {}
// SAFETY: as above.
unsafe impl Sync for SendPtr {}

impl SendPtr {
    /// The pointer (a method, so closures capture the whole `SendPtr`, not its raw field).
    fn at(&self, offset: usize) -> *mut f32 {
        self.0.wrapping_add(offset)
    }
}

/// Causal GQA attention over documents, tiled with an online softmax: no T×T matrix exists.
/// q [B·T, NH·HD], k/v [B·T, NKV·HD], o [B·T, NH·HD]; `pos` [B·T] each token's position in its
/// document: query i attends to keys `i − pos[i] ..= i` (its own document's, up to itself).
/// `lse` [B, NH, T] receives the row log-sum-exp for the backward. Query head h reads kv head
/// h / (NH/NKV).
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
    assert_eq!(pos.len(), s.b * s.t, "attention: one position per token");
    let AttnShape { t, nh, nkv, hd, .. } = s;
    let group = nh / nkv;
    let scale = 1.0 / (hd as f32).sqrt();
    let (qs, kvs) = (nh * hd, nkv * hd);
    let optr = SendPtr(o.as_mut_ptr());
    let tiles = t.div_ceil(ATTN_TILE);
    lse.par_chunks_mut(t).enumerate().for_each(|(bh, lse_row)| {
        let (bi, h) = (bh / nh, bh % nh);
        let kh = h / group;
        let mut sc = vec![0.0f32; ATTN_TILE];
        let mut acc = vec![0.0f32; ATTN_TILE * hd];
        for qt in 0..tiles {
            let (i0, i1) = (qt * ATTN_TILE, ((qt + 1) * ATTN_TILE).min(t));
            let mut mx = [f32::NEG_INFINITY; ATTN_TILE];
            let mut l = [0.0f32; ATTN_TILE];
            acc.fill(0.0);
            // First keys never fall as i grows: the tile's first query has the lowest.
            for kt in first_key(pos, bi, t, i0) / ATTN_TILE..=qt {
                let (j0, j1) = (kt * ATTN_TILE, ((kt + 1) * ATTN_TILE).min(t));
                for i in i0..i1 {
                    let qi = &q[(bi * t + i) * qs + h * hd..][..hd];
                    let jstart = j0.max(first_key(pos, bi, t, i));
                    let jend = j1.min(i + 1);
                    if jend <= jstart {
                        continue;
                    }
                    let mut m_new = mx[i - i0];
                    for j in jstart..jend {
                        let kj = &k[(bi * t + j) * kvs + kh * hd..][..hd];
                        sc[j - j0] = dot(qi, kj) * scale;
                        m_new = m_new.max(sc[j - j0]);
                    }
                    let corr = (mx[i - i0] - m_new).exp();
                    let a = &mut acc[(i - i0) * hd..][..hd];
                    if corr != 1.0 {
                        a.iter_mut().for_each(|x| *x *= corr);
                    }
                    let mut lsum = l[i - i0] * corr;
                    for j in jstart..jend {
                        let p = (sc[j - j0] - m_new).exp();
                        lsum += p;
                        let vj = &v[(bi * t + j) * kvs + kh * hd..][..hd];
                        for (x, vv) in a.iter_mut().zip(vj) {
                            *x += p * *vv;
                        }
                    }
                    l[i - i0] = lsum;
                    mx[i - i0] = m_new;
                }
            }
            for i in i0..i1 {
                let inv = 1.0 / l[i - i0];
                // SAFETY: row (bi, i), head h of `o`: this task (bi, h) is its only writer.
                let orow = unsafe {
                    std::slice::from_raw_parts_mut(optr.at((bi * t + i) * qs + h * hd), hd)
                };
                for (x, a) in orow.iter_mut().zip(&acc[(i - i0) * hd..][..hd]) {
                    *x = *a * inv;
                }
                lse_row[i] = mx[i - i0] + l[i - i0].ln();
            }
        }
    });
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
    dq.fill(0.0);
    dk.fill(0.0);
    dv.fill(0.0);
    let (dqp, dkp, dvp) = (
        SendPtr(dq.as_mut_ptr()),
        SendPtr(dk.as_mut_ptr()),
        SendPtr(dv.as_mut_ptr()),
    );
    // One task per (sequence, kv head): it alone writes that kv head's dk/dv and its query
    // heads' dq.
    (0..b * nkv).into_par_iter().for_each(|task| {
        let (bi, kh) = (task / nkv, task % nkv);
        let mut dd = vec![0.0f32; t];
        for h in kh * group..(kh + 1) * group {
            for (i, d) in dd.iter_mut().enumerate() {
                let r = (bi * t + i) * qs + h * hd;
                *d = dot(&d_o[r..r + hd], &o[r..r + hd]);
            }
            for i in 0..t {
                let r = (bi * t + i) * qs + h * hd;
                let (qi, doi) = (&q[r..r + hd], &d_o[r..r + hd]);
                let li = lse[(bi * nh + h) * t + i];
                // SAFETY: dq row (bi, i) head h belongs to this task only.
                let dqi = unsafe { std::slice::from_raw_parts_mut(dqp.at(r), hd) };
                for j in first_key(pos, bi, t, i)..=i {
                    let c = (bi * t + j) * kvs + kh * hd;
                    let (kj, vj) = (&k[c..c + hd], &v[c..c + hd]);
                    let p = (dot(qi, kj) * scale - li).exp();
                    let dp = dot(doi, vj);
                    let ds = p * (dp - dd[i]) * scale;
                    // SAFETY: dk/dv rows (bi, j) head kh belong to this task only.
                    let (dkj, dvj) = unsafe {
                        (
                            std::slice::from_raw_parts_mut(dkp.at(c), hd),
                            std::slice::from_raw_parts_mut(dvp.at(c), hd),
                        )
                    };
                    for x in 0..hd {
                        dvj[x] += p * doi[x];
                        dqi[x] += ds * kj[x];
                        dkj[x] += ds * qi[x];
                    }
                }
            }
        }
    });
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
                let sc: Vec<f32> = (j0..=i)
                    .map(|j| dot(qi, &k[(bi * t + j) * kvs + kh * hd..][..hd]) * scale)
                    .collect();
                let mx = sc.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let e: Vec<f32> = sc.iter().map(|x| (x - mx).exp()).collect();
                let z: f32 = e.iter().sum();
                let orow = &mut o[(bi * t + i) * qs + h * hd..][..hd];
                orow.fill(0.0);
                for (j, p) in (j0..=i).zip(&e) {
                    let vj = &v[(bi * t + j) * kvs + kh * hd..][..hd];
                    for (x, vv) in orow.iter_mut().zip(vj) {
                        *x += p / z * vv;
                    }
                }
            }
        }
    }
}

/// Rows of logits materialised at once by [`lm_head_ce`]: chunk × V floats.
pub const CE_CHUNK_ROWS: usize = 256;

/// Fused LM head + cross-entropy, chunked over tokens so B·T·V logits never exist at once.
///
/// h [N, C], w [V, C]. Returns Σ loss over the N rows (caller divides by the step's token count).
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
    vocab: usize,
    grad_scale: f32,
    scratch: &mut Vec<f32>,
) -> f64 {
    let rows = CE_CHUNK_ROWS.min(n.max(1));
    scratch.resize(rows * vocab, 0.0);
    let mut losses = [0.0f32; CE_CHUNK_ROWS];
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

/// Cross-entropy over a chunk of logits `[rows, vocab]`: per-row loss `lse(z) − z[target]` into
/// `losses`, and in place `z = scale·(softmax(z) − onehot(target))`; a row whose target is
/// [`IGNORE`] gets loss 0 and gradient 0.
pub fn cross_entropy(
    logits: &mut [f32],
    losses: &mut [f32],
    targets: &[u32],
    vocab: usize,
    scale: f32,
) {
    logits
        .par_chunks_mut(vocab)
        .zip(losses.par_iter_mut())
        .zip(targets.par_iter())
        .for_each(|((row, loss), &tg)| {
            if tg == IGNORE {
                *loss = 0.0;
                row.fill(0.0);
                return;
            }
            let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let z: f32 = row.iter().map(|x| (x - mx).exp()).sum();
            let lse = mx + z.ln();
            *loss = lse - row[tg as usize];
            for x in row.iter_mut() {
                *x = (*x - lse).exp() * scale;
            }
            row[tg as usize] -= scale;
        });
}

/// Logits [N, V] = h·Wᵀ, for tests and inference on small inputs.
pub fn logits(out: &mut [f32], h: &[f32], w: &[f32], n: usize, c: usize, vocab: usize) {
    gemm(out, h, (c, 1), w, (1, c), n, c, vocab, false);
}

#[cfg(test)]
mod tests;
