//! The mixture-of-experts MLP on the CPU, forward and explicit backward, as transformers 5
//! computes it (Mixtral, Qwen3-MoE): router logits `h·Wrᵀ`, softmax in fp32, the `top_k`
//! largest probabilities (renormalised when asked), each chosen expert's gated MLP on the rows
//! routed to it, and the outputs weighted and added per token in ascending expert order
//! (transformers' `index_add_` loop). Tokens are grouped by expert (a stable, deterministic
//! permutation) and each expert's rows go through GEMMs together; experts run in parallel.
//! The backward recomputes the forward (nothing is kept between calls) and gives the router's
//! gradient through the renormalisation and the softmax; an expert no token chose gets none.

use super::{gated_bwd, gated_fwd, gemm, linear_fwd, MlpActivation};
use rayon::prelude::*;

/// An MoE MLP's shape.
#[derive(Debug, Clone, Copy)]
pub struct MoeShape {
    /// Model width C.
    pub c: usize,
    /// Experts E.
    pub experts: usize,
    /// Experts per token k.
    pub top_k: usize,
    /// Each expert's MLP width I.
    pub inter: usize,
    /// The k weights renormalised to sum 1.
    pub norm_topk: bool,
    /// The experts' gate activation.
    pub act: MlpActivation,
}

/// The weights of an MoE MLP (HF layout): router `[E, C]`, fused gate/up `[E, 2I, C]` (per
/// expert the gate's `I` rows, then the up projection's), down `[E, C, I]`.
#[derive(Debug, Clone, Copy)]
pub struct MoeWeights<'a> {
    /// Router `[E, C]`.
    pub router: &'a [f32],
    /// Gate and up projections `[E, 2I, C]`.
    pub gate_up: &'a [f32],
    /// Down projections `[E, C, I]`.
    pub down: &'a [f32],
}

/// Their gradients, added to.
#[derive(Debug)]
pub struct MoeGrads<'a> {
    /// `[E, C]`.
    pub router: &'a mut [f32],
    /// `[E, 2I, C]`.
    pub gate_up: &'a mut [f32],
    /// `[E, C, I]`.
    pub down: &'a mut [f32],
}

/// The router's decisions for `n` tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// Softmax of the router logits `[n, E]`.
    pub probs: Vec<f32>,
    /// The chosen experts `[n, k]`, by descending probability (ties: the lower index first).
    pub expert: Vec<u32>,
    /// Their weights `[n, k]`.
    pub weight: Vec<f32>,
    /// Where each expert's rows start in [`Routing::slots`] (`E + 1` entries).
    pub offsets: Vec<usize>,
    /// The slots (`token·k + j`) grouped by expert, tokens ascending within an expert.
    pub slots: Vec<u32>,
    /// For each slot `token·k + j`, its row in the grouped order.
    pub row_of: Vec<u32>,
}

impl Routing {
    /// Tokens each expert received.
    pub fn counts(&self) -> Vec<usize> {
        self.offsets.windows(2).map(|w| w[1] - w[0]).collect()
    }
}

/// Softmax over each row of `logits` `[n, E]` (max-shifted, fp32), then the top k of each row
/// and their weights; the rows grouped by expert.
pub fn route(logits: &[f32], n: usize, s: MoeShape) -> Routing {
    let (e, k) = (s.experts, s.top_k);
    let mut probs = vec![0f32; n * e];
    let mut expert = vec![0u32; n * k];
    let mut weight = vec![0f32; n * k];
    probs
        .par_chunks_mut(e)
        .zip(expert.par_chunks_mut(k))
        .zip(weight.par_chunks_mut(k))
        .enumerate()
        .for_each(|(t, ((p, ex), w))| {
            let z = &logits[t * e..(t + 1) * e];
            let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
            let mut sum = 0f32;
            for (pi, zi) in p.iter_mut().zip(z) {
                *pi = (zi - max).exp();
                sum += *pi;
            }
            for pi in p.iter_mut() {
                *pi /= sum;
            }
            let mut order: Vec<u32> = (0..e as u32).collect();
            // Descending probability; among equal ones the lower index first (stable).
            order.sort_by(|&a, &b| p[b as usize].total_cmp(&p[a as usize]));
            ex.copy_from_slice(&order[..k]);
            for (wj, &x) in w.iter_mut().zip(ex.iter()) {
                *wj = p[x as usize];
            }
            if s.norm_topk {
                let total: f32 = w.iter().sum();
                for wj in w.iter_mut() {
                    *wj /= total;
                }
            }
        });
    let (offsets, slots, row_of) = group(&expert, e);
    Routing {
        probs,
        expert,
        weight,
        offsets,
        slots,
        row_of,
    }
}

/// The slots of `expert` (`[n, k]`, every id below `e`) grouped by expert, tokens ascending
/// within one: each expert's first row (`e + 1` entries), the slot of each row, the row of
/// each slot.
fn group(expert: &[u32], e: usize) -> (Vec<usize>, Vec<u32>, Vec<u32>) {
    let mut offsets = vec![0usize; e + 1];
    for &x in expert {
        offsets[x as usize + 1] += 1;
    }
    for i in 0..e {
        offsets[i + 1] += offsets[i];
    }
    let mut next = offsets.clone();
    let mut slots = vec![0u32; expert.len()];
    let mut row_of = vec![0u32; expert.len()];
    for (slot, &x) in expert.iter().enumerate() {
        let r = next[x as usize];
        next[x as usize] += 1;
        slots[r] = slot as u32;
        row_of[slot] = r as u32;
    }
    (offsets, slots, row_of)
}

/// [`group`] for experts a device chose: an id not below `e` is an error, not a panic.
pub fn group_by_expert(
    expert: &[u32],
    e: usize,
) -> crate::Result<(Vec<usize>, Vec<u32>, Vec<u32>)> {
    if let Some(bad) = expert.iter().find(|&&x| x as usize >= e) {
        return Err(crate::Error::internal(
            "mixture of experts",
            format!("the router chose expert {bad} of {e}"),
        ));
    }
    Ok(group(expert, e))
}

/// What the forward computes per grouped row (`n·k` rows, grouped by expert): the gathered
/// input `[R, C]`, gate and up `[R, I]`, the activation `[R, I]`, the expert's output `[R, C]`.
struct Internals {
    routing: Routing,
    x: Vec<f32>,
    gate: Vec<f32>,
    up: Vec<f32>,
    act: Vec<f32>,
    y: Vec<f32>,
}

/// Expert `e`'s gate and up projections `[I, C]` each, and its down projection `[C, I]`.
fn expert_weights<'a>(
    w: &MoeWeights<'a>,
    s: MoeShape,
    e: usize,
) -> (&'a [f32], &'a [f32], &'a [f32]) {
    let (c, i) = (s.c, s.inter);
    let gu = &w.gate_up[e * 2 * i * c..(e + 1) * 2 * i * c];
    (
        &gu[..i * c],
        &gu[i * c..],
        &w.down[e * c * i..(e + 1) * c * i],
    )
}

/// The router and every expert on `h` `[n, C]`.
fn internals(h: &[f32], w: &MoeWeights<'_>, n: usize, s: MoeShape) -> Internals {
    let (c, i, e) = (s.c, s.inter, s.experts);
    let mut logits = vec![0f32; n * e];
    linear_fwd(&mut logits, &h[..n * c], w.router, None, n, c, e);
    let routing = route(&logits, n, s);
    let rows = n * s.top_k;
    let mut x = vec![0f32; rows * c];
    for (r, xr) in x.chunks_mut(c).enumerate() {
        let t = routing.slots[r] as usize / s.top_k;
        xr.copy_from_slice(&h[t * c..(t + 1) * c]);
    }
    let (mut gate, mut up, mut act) = (
        vec![0f32; rows * i],
        vec![0f32; rows * i],
        vec![0f32; rows * i],
    );
    let mut y = vec![0f32; rows * c];
    let bounds = &routing.offsets;
    split_rows(&mut gate, bounds, i)
        .into_par_iter()
        .zip(split_rows(&mut up, bounds, i))
        .zip(split_rows(&mut act, bounds, i))
        .zip(split_rows(&mut y, bounds, c))
        .enumerate()
        .for_each(|(ex, (((g, u), a), ye))| {
            let m = g.len() / i.max(1);
            if m == 0 {
                return;
            }
            let xe = &x[bounds[ex] * c..bounds[ex + 1] * c];
            let (wg, wu, wd) = expert_weights(w, s, ex);
            linear_fwd(g, xe, wg, None, m, c, i);
            linear_fwd(u, xe, wu, None, m, c, i);
            gated_fwd(s.act, a, g, u);
            linear_fwd(ye, a, wd, None, m, i, c);
        });
    Internals {
        routing,
        x,
        gate,
        up,
        act,
        y,
    }
}

/// `buf` (rows of `width`) cut at the row bounds `bounds` (one piece per expert).
fn split_rows<'a>(buf: &'a mut [f32], bounds: &[usize], width: usize) -> Vec<&'a mut [f32]> {
    let mut out = Vec::with_capacity(bounds.len().saturating_sub(1));
    let mut rest = buf;
    for w in bounds.windows(2) {
        let (piece, tail) = rest.split_at_mut((w[1] - w[0]) * width);
        out.push(piece);
        rest = tail;
    }
    out
}

/// Each token's k grouped rows with their weights and slot numbers, in ascending expert order
/// (the order transformers adds the experts' outputs in).
fn token_rows(r: &Routing, t: usize, k: usize) -> Vec<(usize, f32, usize)> {
    let mut v: Vec<(u32, usize, f32, usize)> = (0..k)
        .map(|j| {
            let slot = t * k + j;
            (
                r.expert[slot],
                r.row_of[slot] as usize,
                r.weight[slot],
                slot,
            )
        })
        .collect();
    v.sort_by_key(|x| x.0);
    v.into_iter()
        .map(|(_, row, w, slot)| (row, w, slot))
        .collect()
}

/// `out` `[n, C]` = the MoE MLP of `h` `[n, C]`; returns the routing (for counts and tests).
pub fn moe_fwd(out: &mut [f32], h: &[f32], w: &MoeWeights<'_>, n: usize, s: MoeShape) -> Routing {
    let c = s.c;
    let f = internals(h, w, n, s);
    out[..n * c]
        .par_chunks_mut(c)
        .enumerate()
        .for_each(|(t, o)| {
            o.fill(0.0);
            for (row, wt, _) in token_rows(&f.routing, t, s.top_k) {
                for (ov, yv) in o.iter_mut().zip(&f.y[row * c..(row + 1) * c]) {
                    *ov += yv * wt;
                }
            }
        });
    f.routing
}

/// Backward of [`moe_fwd`] (its forward recomputed from `h`): `dh` `[n, C]` = dL/dh, the
/// router's and the experts' gradients added to `g`.
pub fn moe_bwd(
    dh: &mut [f32],
    g: MoeGrads<'_>,
    d_out: &[f32],
    h: &[f32],
    w: &MoeWeights<'_>,
    n: usize,
    s: MoeShape,
) {
    let (c, i, e, k) = (s.c, s.inter, s.experts, s.top_k);
    let f = internals(h, w, n, s);
    let r = &f.routing;
    let rows = n * k;
    // dL/d(weight of slot) = <dy_t, y_row>; dL/dy_row = weight · dy_t.
    let mut d_weight = vec![0f32; rows];
    let mut dy = vec![0f32; rows * c];
    dy.par_chunks_mut(c).enumerate().for_each(|(row, d)| {
        let slot = r.slots[row] as usize;
        let t = slot / k;
        let wt = r.weight[slot];
        for (dv, ov) in d.iter_mut().zip(&d_out[t * c..(t + 1) * c]) {
            *dv = ov * wt;
        }
    });
    d_weight.par_iter_mut().enumerate().for_each(|(slot, dw)| {
        let t = slot / k;
        let row = r.row_of[slot] as usize;
        *dw = d_out[t * c..(t + 1) * c]
            .iter()
            .zip(&f.y[row * c..(row + 1) * c])
            .map(|(a, b)| a * b)
            .sum();
    });
    // Per expert: the down projection, the gate, the up projection, and dL/dx of its rows.
    let mut dx = vec![0f32; rows * c];
    let bounds = &r.offsets;
    let g_gu: Vec<&mut [f32]> = g.gate_up.chunks_mut(2 * i * c).collect();
    let g_d: Vec<&mut [f32]> = g.down.chunks_mut(c * i).collect();
    split_rows(&mut dx, bounds, c)
        .into_par_iter()
        .zip(g_gu)
        .zip(g_d)
        .enumerate()
        .for_each(|(ex, ((dxe, ggu), gd))| {
            let (lo, hi) = (bounds[ex], bounds[ex + 1]);
            let m = hi - lo;
            if m == 0 {
                return;
            }
            let (wg, wu, wd) = expert_weights(w, s, ex);
            let rows_of = |b: &[f32], width: usize| b[lo * width..hi * width].to_vec();
            let (dye, xe, a) = (rows_of(&dy, c), rows_of(&f.x, c), rows_of(&f.act, i));
            // dA [m, I] = dY [m, C] · Wd [C, I]; dWd [C, I] += dYᵀ · A.
            let mut da = vec![0f32; m * i];
            gemm(&mut da, &dye, (c, 1), wd, (i, 1), m, c, i, false);
            gemm(gd, &dye, (1, c), &a, (i, 1), c, m, i, true);
            let (mut dgate, mut dup) = (vec![0f32; m * i], vec![0f32; m * i]);
            gated_bwd(
                s.act,
                &mut dgate,
                &mut dup,
                &da,
                &f.gate[lo * i..hi * i],
                &f.up[lo * i..hi * i],
            );
            let (ggate, gup) = ggu.split_at_mut(i * c);
            gemm(ggate, &dgate, (1, i), &xe, (c, 1), i, m, c, true);
            gemm(gup, &dup, (1, i), &xe, (c, 1), i, m, c, true);
            gemm(dxe, &dgate, (i, 1), wg, (c, 1), m, i, c, false);
            gemm(dxe, &dup, (i, 1), wu, (c, 1), m, i, c, true);
        });
    // The router: through the renormalisation and the softmax.
    let mut d_logits = vec![0f32; n * e];
    d_logits.par_chunks_mut(e).enumerate().for_each(|(t, dz)| {
        let p = &r.probs[t * e..(t + 1) * e];
        let mut dp = vec![0f32; e];
        let chosen = &r.expert[t * k..(t + 1) * k];
        let dw = &d_weight[t * k..(t + 1) * k];
        if s.norm_topk {
            let total: f32 = chosen.iter().map(|&x| p[x as usize]).sum();
            let cross: f32 = chosen.iter().zip(dw).map(|(&x, d)| d * p[x as usize]).sum();
            for (&x, d) in chosen.iter().zip(dw) {
                dp[x as usize] = d / total - cross / (total * total);
            }
        } else {
            for (&x, d) in chosen.iter().zip(dw) {
                dp[x as usize] = *d;
            }
        }
        let dot: f32 = p.iter().zip(&dp).map(|(a, b)| a * b).sum();
        for ((z, pv), dpv) in dz.iter_mut().zip(p).zip(&dp) {
            *z = pv * (dpv - dot);
        }
    });
    // dWr [E, C] += dZᵀ · h; dh = Σ the experts' dx (ascending expert) + dZ · Wr.
    gemm(
        g.router,
        &d_logits,
        (1, e),
        &h[..n * c],
        (c, 1),
        e,
        n,
        c,
        true,
    );
    dh[..n * c]
        .par_chunks_mut(c)
        .enumerate()
        .for_each(|(t, d)| {
            d.fill(0.0);
            for (row, _, _) in token_rows(r, t, k) {
                for (dv, xv) in d.iter_mut().zip(&dx[row * c..(row + 1) * c]) {
                    *dv += xv;
                }
            }
        });
    gemm(
        &mut dh[..n * c],
        &d_logits,
        (e, 1),
        w.router,
        (c, 1),
        n,
        e,
        c,
        true,
    );
}

#[cfg(test)]
mod tests;
