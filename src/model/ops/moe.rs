//! The mixture-of-experts MLP on the CPU, forward and explicit backward, as transformers 5
//! computes it: router logits `h·Wrᵀ (+ b)`; Mixtral and Qwen3-MoE take the softmax over every
//! expert (fp32) and its `top_k` largest probabilities (renormalised when asked), GPT-OSS the
//! `top_k` largest logits and the softmax over them; each chosen expert's gated MLP on the rows
//! routed to it (GPT-OSS: transposed weights with biases, gate and up in alternating columns, a
//! clamped SwiGLU); the outputs weighted and added per token in ascending expert order
//! (transformers' `index_add_` loop). Tokens are grouped by expert (a stable, deterministic
//! permutation) and each expert's rows go through GEMMs together; experts run in parallel.
//! The backward recomputes the forward (nothing is kept between calls) and gives the router's
//! gradient through the renormalisation and the softmax; an expert no token chose gets none.
//! The load-balancing loss ([`RouterTally`]) adds its gradient at the router's logits.

use super::{gated_bwd, gated_fwd, gemm, linear_fwd, MlpActivation};
use rayon::prelude::*;
use serde::{Deserialize, Serialize};

mod balance;
mod expert_gemm;
mod routing;
mod scratch;
pub use balance::{AuxGrad, ExpertLoad, RouterTally};
#[cfg(test)]
use expert_gemm::transpose;
use expert_gemm::{expert_fwd_transposed, mm, TRANSPOSE_BELOW, TRANSPOSE_FROM};
pub use routing::{group_by_expert, route, Routing};

/// How the router picks and weights a token's experts.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum Router {
    /// Softmax over every expert's logit, then the `k` largest probabilities (Mixtral,
    /// Qwen3-MoE; renormalised to sum 1 when [`MoeShape::norm_topk`]).
    #[default]
    SoftmaxTopK,
    /// The `k` largest logits, then the softmax over them (GPT-OSS).
    TopKSoftmax,
}

/// How an expert's weights are laid out.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum ExpertLayout {
    /// As Linear weights: gate and up `[E, 2I, C]` (per expert the gate's `I` rows, then the up
    /// projection's), down `[E, C, I]`; no biases (Mixtral, Qwen3-MoE).
    #[default]
    GateUpRows,
    /// Transposed with biases: gate and up `[E, C, 2I]` in alternating columns (gate even, up
    /// odd) plus `[E, 2I]`, down `[E, I, C]` plus `[E, C]`; the router has a bias `[E]`
    /// (GPT-OSS).
    InterleavedColumns,
}

/// An expert's activation of gate and up.
#[derive(Debug, Clone, Copy, PartialEq)]
pub enum ExpertAct {
    /// `act(gate)·up` ([`MlpActivation`]).
    Gated(MlpActivation),
    /// GPT-OSS: `g = min(gate, limit)`, `u = clamp(up, −limit, limit)`, `(u + 1)·g·σ(α·g)`.
    ClampedSwiglu {
        /// α.
        alpha: f32,
        /// The clamp.
        limit: f32,
    },
}

/// An MoE MLP's shape.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct MoeShape {
    /// Model width C.
    pub c: usize,
    /// Experts E.
    pub experts: usize,
    /// Experts per token k.
    pub top_k: usize,
    /// Each expert's MLP width I.
    pub inter: usize,
    /// The k weights renormalised to sum 1 ([`Router::SoftmaxTopK`]).
    pub norm_topk: bool,
    /// How the router picks.
    pub router: Router,
    /// How the experts' weights are laid out (and whether they have biases).
    pub layout: ExpertLayout,
    /// The experts' activation.
    pub act: ExpertAct,
}

impl MoeShape {
    /// Whether the router and the experts have biases.
    pub fn biases(&self) -> bool {
        self.layout == ExpertLayout::InterleavedColumns
    }
}

/// The weights of an MoE MLP (HF layout, [`ExpertLayout`]).
#[derive(Debug, Clone, Copy)]
pub struct MoeWeights<'a> {
    /// Router `[E, C]`.
    pub router: &'a [f32],
    /// Gate and up projections (`[E, 2I, C]` or `[E, C, 2I]`).
    pub gate_up: &'a [f32],
    /// Down projections (`[E, C, I]` or `[E, I, C]`).
    pub down: &'a [f32],
    /// The router's, gate/up's and down's biases `[E]`, `[E, 2I]`, `[E, C]`
    /// ([`MoeShape::biases`]).
    pub biases: Option<[&'a [f32]; 3]>,
    /// The bf16 recipe (docs/precision.md): the weights are bf16 values (the master's high
    /// plane, as a bf16 device holds them) and every GEMM's other operand is rounded to bf16
    /// (nearest even) first — the input rows, the activation, dY, d gate/up and d logits — with
    /// fp32 sums and results; the bias gradients sum the fp32 values.
    pub bf16_recipe: bool,
}

/// Their gradients, added to.
#[derive(Debug)]
pub struct MoeGrads<'a> {
    /// Router.
    pub router: &'a mut [f32],
    /// Gate and up projections.
    pub gate_up: &'a mut [f32],
    /// Down projections.
    pub down: &'a mut [f32],
    /// The biases' gradients (router, gate/up, down).
    pub biases: Option<[&'a mut [f32]; 3]>,
}

/// The clamped SwiGLU of GPT-OSS over interleaved `gu` `[R, 2I]` (gate even, up odd) into
/// `out` `[R, I]`, in transformers' order.
fn clamped_swiglu_fwd(out: &mut [f32], gu: &[f32], alpha: f32, limit: f32) {
    out.par_iter_mut().enumerate().for_each(|(j, o)| {
        let g = gu[2 * j].min(limit);
        let u = gu[2 * j + 1].clamp(-limit, limit);
        let glu = g * sigmoid(g * alpha);
        *o = (u + 1.0) * glu;
    });
}

/// Its backward: `dgu` `[R, 2I]` from `d_out` `[R, I]` (no gradient where a clamp holds,
/// torch's `clamp` backward: the bounds themselves pass).
fn clamped_swiglu_bwd(dgu: &mut [f32], d_out: &[f32], gu: &[f32], alpha: f32, limit: f32) {
    dgu.par_chunks_mut(2).enumerate().for_each(|(j, d)| {
        let (gate, up) = (gu[2 * j], gu[2 * j + 1]);
        let g = gate.min(limit);
        let u = up.clamp(-limit, limit);
        let sg = sigmoid(g * alpha);
        let glu = g * sg;
        let dglu = d_out[j] * (u + 1.0);
        d[0] = if gate <= limit {
            dglu * (sg + g * alpha * sg * (1.0 - sg))
        } else {
            0.0
        };
        d[1] = if (-limit..=limit).contains(&up) {
            d_out[j] * glu
        } else {
            0.0
        };
    });
}

fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
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

impl Drop for Internals {
    /// The buffers go back for the next call ([`scratch`]).
    fn drop(&mut self) {
        for v in [
            &mut self.x,
            &mut self.gate,
            &mut self.up,
            &mut self.act,
            &mut self.y,
        ] {
            scratch::give(std::mem::take(v));
        }
    }
}

/// Expert `e`'s gate/up weights and down weights (its slices of the fused tensors).
fn expert_weights<'a>(w: &MoeWeights<'a>, s: MoeShape, e: usize) -> (&'a [f32], &'a [f32]) {
    let (c, i) = (s.c, s.inter);
    (
        &w.gate_up[e * 2 * i * c..(e + 1) * 2 * i * c],
        &w.down[e * c * i..(e + 1) * c * i],
    )
}

/// `x` rounded to bf16 in place where `bf16` (the bf16 recipe's GEMM operands).
fn round_if(bf16: bool, x: &mut [f32]) {
    if bf16 {
        super::round_bf16(x);
    }
}

/// `h` as the GEMMs read it: under the bf16 recipe a rounded copy (give it back to
/// [`scratch`]), else `None` (`h` itself).
fn gemm_input(h: &[f32], w: &MoeWeights<'_>) -> Option<Vec<f32>> {
    w.bf16_recipe.then(|| {
        let mut v = scratch::take(h.len());
        super::round_into(&mut v, h);
        v
    })
}

/// Width of the gate/up buffer's rows: `I` each for [`ExpertLayout::GateUpRows`] (gate and up
/// apart), `2I` interleaved for [`ExpertLayout::InterleavedColumns`] (up unused).
fn gate_width(s: MoeShape) -> (usize, usize) {
    match s.layout {
        ExpertLayout::GateUpRows => (s.inter, s.inter),
        ExpertLayout::InterleavedColumns => (2 * s.inter, 0),
    }
}

/// `y[r, :] += b` for every row of `y`.
fn add_rows(y: &mut [f32], b: &[f32]) {
    for row in y.chunks_mut(b.len()) {
        for (v, bv) in row.iter_mut().zip(b) {
            *v += *bv;
        }
    }
}

/// One expert's forward on its `m` rows `xe`: gate/up (or interleaved gu), the activation, its
/// output `ye`.
#[allow(clippy::too_many_arguments)]
fn expert_fwd(
    w: &MoeWeights<'_>,
    s: MoeShape,
    ex: usize,
    xe: &[f32],
    (g, u, a, ye): (&mut [f32], &mut [f32], &mut [f32], &mut [f32]),
    (m, keep): (usize, bool),
) {
    let (c, i) = (s.c, s.inter);
    let (wgu, wd) = expert_weights(w, s, ex);
    if let (ExpertLayout::GateUpRows, ExpertAct::Gated(act)) = (s.layout, s.act) {
        if m < TRANSPOSE_BELOW && i * c >= TRANSPOSE_FROM {
            let round = w.bf16_recipe;
            return expert_fwd_transposed(s, (wgu, wd), act, xe, (g, u, a, ye), (m, keep, round));
        }
    }
    match s.layout {
        ExpertLayout::GateUpRows => {
            mm(s, g, xe, (c, 1), &wgu[..i * c], (1, c), (m, c, i), false);
            mm(s, u, xe, (c, 1), &wgu[i * c..], (1, c), (m, c, i), false);
        }
        ExpertLayout::InterleavedColumns => {
            // gu [m, 2I] = x [m, C] · W [C, 2I] + b.
            mm(s, g, xe, (c, 1), wgu, (2 * i, 1), (m, c, 2 * i), false);
            if let Some([_, bgu, _]) = w.biases {
                add_rows(g, &bgu[ex * 2 * i..(ex + 1) * 2 * i]);
            }
        }
    }
    match s.act {
        ExpertAct::Gated(act) => gated_fwd(act, a, g, u),
        ExpertAct::ClampedSwiglu { alpha, limit } => clamped_swiglu_fwd(a, g, alpha, limit),
    }
    round_if(w.bf16_recipe, a);
    match s.layout {
        ExpertLayout::GateUpRows => mm(s, ye, a, (i, 1), wd, (1, i), (m, i, c), false),
        ExpertLayout::InterleavedColumns => {
            // y [m, C] = a [m, I] · Wd [I, C] + b.
            mm(s, ye, a, (i, 1), wd, (c, 1), (m, i, c), false);
            if let Some([_, _, bd]) = w.biases {
                add_rows(ye, &bd[ex * c..(ex + 1) * c]);
            }
        }
    }
}

/// The router and every expert on `h` `[n, C]` (`keep`: the gate, up and activation rows too,
/// else only the outputs are sure to be written). Under the bf16 recipe `h` is rounded already
/// ([`gemm_input`]).
fn internals(h: &[f32], w: &MoeWeights<'_>, n: usize, s: MoeShape, keep: bool) -> Internals {
    let (c, i, e) = (s.c, s.inter, s.experts);
    let mut logits = scratch::take(n * e);
    let router_bias = w.biases.map(|[b, _, _]| b);
    linear_fwd(&mut logits, &h[..n * c], w.router, router_bias, n, c, e);
    let routing = route(&logits, n, s);
    scratch::give(logits);
    let rows = n * s.top_k;
    // Every element of these is written before it is read (gather, GEMMs, activation).
    let mut x = scratch::take(rows * c);
    for (r, xr) in x.chunks_mut(c).enumerate() {
        let t = routing.slots[r] as usize / s.top_k;
        xr.copy_from_slice(&h[t * c..(t + 1) * c]);
    }
    let (gw, uw) = gate_width(s);
    let (mut gate, mut up, mut act) = (
        scratch::take(rows * gw),
        scratch::take(rows * uw),
        scratch::take(rows * i),
    );
    let mut y = scratch::take(rows * c);
    let bounds = &routing.offsets;
    split_rows(&mut gate, bounds, gw)
        .into_par_iter()
        .zip(split_rows(&mut up, bounds, uw))
        .zip(split_rows(&mut act, bounds, i))
        .zip(split_rows(&mut y, bounds, c))
        .enumerate()
        .for_each(|(ex, (((g, u), a), ye))| {
            let m = bounds[ex + 1] - bounds[ex];
            if m == 0 {
                return;
            }
            let xe = &x[bounds[ex] * c..bounds[ex + 1] * c];
            expert_fwd(w, s, ex, xe, (g, u, a, ye), (m, keep));
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
    let hr = gemm_input(&h[..n * c], w);
    let f = internals(hr.as_deref().unwrap_or(h), w, n, s, false);
    if let Some(v) = hr {
        scratch::give(v);
    }
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
    let mut f = f;
    std::mem::replace(&mut f.routing, Routing::empty())
}

/// One expert's forward internals and output gradient, on its rows.
struct ExpertRows<'a> {
    x: &'a [f32],
    gate: &'a [f32],
    up: &'a [f32],
    act: &'a [f32],
    dy: &'a [f32],
}

/// One expert's backward on its rows: its weight (and bias) gradients added to, `dxe` written.
fn expert_bwd(
    w: &MoeWeights<'_>,
    s: MoeShape,
    ex: usize,
    f: ExpertRows<'_>,
    (dxe, ggu, gd): (&mut [f32], &mut [f32], &mut [f32]),
    (gbgu, gbd): (Option<&mut [f32]>, Option<&mut [f32]>),
) {
    let (c, i) = (s.c, s.inter);
    let m = f.x.len() / c;
    let (wgu, wd) = expert_weights(w, s, ex);
    let mut da = scratch::take(m * i);
    // The bias gradient sums dY in fp32; the GEMMs read it rounded under the bf16 recipe.
    if let (ExpertLayout::InterleavedColumns, Some(gbd)) = (s.layout, gbd) {
        super::bias_bwd(gbd, f.dy, m);
    }
    let dy_rounded = gemm_input(f.dy, w);
    let dy = dy_rounded.as_deref().unwrap_or(f.dy);
    match s.layout {
        ExpertLayout::GateUpRows => {
            // dA [m, I] = dY [m, C] · Wd [C, I]; dWd [C, I] += dYᵀ · A.
            mm(s, &mut da, dy, (c, 1), wd, (i, 1), (m, c, i), false);
            mm(s, gd, dy, (1, c), f.act, (i, 1), (c, m, i), true);
        }
        ExpertLayout::InterleavedColumns => {
            // dA [m, I] = dY [m, C] · Wdᵀ (Wd [I, C]); dWd [I, C] += Aᵀ · dY; db += Σ dY.
            mm(s, &mut da, dy, (c, 1), wd, (1, c), (m, c, i), false);
            mm(s, gd, f.act, (1, i), dy, (c, 1), (i, m, c), true);
        }
    }
    if let Some(v) = dy_rounded {
        scratch::give(v);
    }
    match (s.layout, s.act) {
        (ExpertLayout::GateUpRows, ExpertAct::Gated(act)) => {
            let (mut dgate, mut dup) = (scratch::take(m * i), scratch::take(m * i));
            gated_bwd(act, &mut dgate, &mut dup, &da, f.gate, f.up);
            round_if(w.bf16_recipe, &mut dgate);
            round_if(w.bf16_recipe, &mut dup);
            let (wg, wu) = wgu.split_at(i * c);
            let (ggate, gup) = ggu.split_at_mut(i * c);
            mm(s, ggate, &dgate, (1, i), f.x, (c, 1), (i, m, c), true);
            mm(s, gup, &dup, (1, i), f.x, (c, 1), (i, m, c), true);
            mm(s, dxe, &dgate, (i, 1), wg, (c, 1), (m, i, c), false);
            mm(s, dxe, &dup, (i, 1), wu, (c, 1), (m, i, c), true);
            scratch::give(dgate);
            scratch::give(dup);
        }
        (ExpertLayout::InterleavedColumns, act) => {
            let mut dgu = scratch::take(m * 2 * i);
            match act {
                ExpertAct::ClampedSwiglu { alpha, limit } => {
                    clamped_swiglu_bwd(&mut dgu, &da, f.gate, alpha, limit)
                }
                ExpertAct::Gated(a) => {
                    let (g, u): (Vec<f32>, Vec<f32>) =
                        f.gate.chunks(2).map(|p| (p[0], p[1])).unzip();
                    let (mut dg, mut du) = (vec![0f32; m * i], vec![0f32; m * i]);
                    gated_bwd(a, &mut dg, &mut du, &da, &g, &u);
                    for (j, d) in dgu.chunks_mut(2).enumerate() {
                        d[0] = dg[j];
                        d[1] = du[j];
                    }
                }
            }
            // db += Σ dGU (fp32); dW [C, 2I] += Xᵀ · dGU; dX = dGU · Wᵀ.
            if let Some(gbgu) = gbgu {
                super::bias_bwd(gbgu, &dgu, m);
            }
            round_if(w.bf16_recipe, &mut dgu);
            mm(s, ggu, f.x, (1, c), &dgu, (2 * i, 1), (c, m, 2 * i), true);
            mm(
                s,
                dxe,
                &dgu,
                (2 * i, 1),
                wgu,
                (1, 2 * i),
                (m, 2 * i, c),
                false,
            );
            scratch::give(dgu);
        }
        (ExpertLayout::GateUpRows, ExpertAct::ClampedSwiglu { .. }) => {
            unreachable!("a clamped SwiGLU comes with interleaved columns (MoeShape::new)")
        }
    }
    scratch::give(da);
}

/// Backward of [`moe_fwd`] (its forward recomputed from `h`): `dh` `[n, C]` = dL/dh, the
/// router's and the experts' gradients added to `g`. `aux`: dL/dp of the load-balancing loss
/// for each router probability ([`RouterTally::aux_grad`]) on every row but padding, through the
/// softmax too.
#[allow(clippy::too_many_arguments)]
pub fn moe_bwd(
    dh: &mut [f32],
    g: MoeGrads<'_>,
    d_out: &[f32],
    h: &[f32],
    w: &MoeWeights<'_>,
    n: usize,
    s: MoeShape,
    aux: Option<AuxGrad<'_>>,
) {
    let (c, i, e, k) = (s.c, s.inter, s.experts, s.top_k);
    let h_rounded = gemm_input(&h[..n * c], w);
    let h = h_rounded.as_deref().unwrap_or(h);
    let f = internals(h, w, n, s, true);
    let r = &f.routing;
    let rows = n * k;
    // dL/d(weight of slot) = <dy_t, y_row>; dL/dy_row = weight · dy_t.
    let mut d_weight = vec![0f32; rows];
    // dy and dx: every element written before it is read.
    let mut dy = scratch::take(rows * c);
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
    let mut dx = scratch::take(rows * c);
    let bounds = &r.offsets;
    let g_gu: Vec<&mut [f32]> = g.gate_up.chunks_mut(2 * i * c).collect();
    let g_d: Vec<&mut [f32]> = g.down.chunks_mut(c * i).collect();
    let (g_router, mut g_bias) = (g.router, g.biases);
    type PerExpert<'a> = Vec<Option<&'a mut [f32]>>;
    let (g_bgu, g_bd): (PerExpert<'_>, PerExpert<'_>) = match &mut g_bias {
        Some([_, bgu, bd]) => (
            bgu.chunks_mut(2 * i).map(Some).collect(),
            bd.chunks_mut(c).map(Some).collect(),
        ),
        None => (
            (0..e).map(|_| None).collect(),
            (0..e).map(|_| None).collect(),
        ),
    };
    split_rows(&mut dx, bounds, c)
        .into_par_iter()
        .zip(g_gu)
        .zip(g_d)
        .zip(g_bgu)
        .zip(g_bd)
        .enumerate()
        .for_each(|(ex, ((((dxe, ggu), gd), gbgu), gbd))| {
            let (lo, hi) = (bounds[ex], bounds[ex + 1]);
            if hi == lo {
                return;
            }
            fn rows_of(b: &[f32], (lo, hi): (usize, usize), width: usize) -> &[f32] {
                &b[lo * width..hi * width]
            }
            let rows_of = |b, width| rows_of(b, (lo, hi), width);
            let f_rows = ExpertRows {
                x: rows_of(&f.x, c),
                gate: rows_of(&f.gate, gate_width(s).0),
                up: rows_of(&f.up, gate_width(s).1),
                act: rows_of(&f.act, i),
                dy: rows_of(&dy, c),
            };
            expert_bwd(w, s, ex, f_rows, (dxe, ggu, gd), (gbgu, gbd));
        });
    // The router: through the renormalisation and the softmax.
    let mut d_logits = vec![0f32; n * e];
    d_logits.par_chunks_mut(e).enumerate().for_each(|(t, dz)| {
        let chosen = &r.expert[t * k..(t + 1) * k];
        let dw = &d_weight[t * k..(t + 1) * k];
        match s.router {
            Router::SoftmaxTopK => {
                let p = &r.probs[t * e..(t + 1) * e];
                let mut dp = vec![0f32; e];
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
            }
            Router::TopKSoftmax => {
                // The softmax over the chosen logits: dz_j = w_j (dw_j − Σ w·dw); others 0.
                let wt = &r.weight[t * k..(t + 1) * k];
                let dot: f32 = wt.iter().zip(dw).map(|(a, b)| a * b).sum();
                dz.fill(0.0);
                for ((&x, wj), dwj) in chosen.iter().zip(wt).zip(dw) {
                    dz[x as usize] = wj * (dwj - dot);
                }
            }
        }
        if let Some(a) = aux.filter(|a| a.counts(t)) {
            balance::softmax_bwd_add(dz, &r.probs[t * e..(t + 1) * e], a.per_expert);
        }
    });
    if let Some([g_rb, _, _]) = g_bias {
        super::bias_bwd(g_rb, &d_logits, n);
    }
    if w.bf16_recipe {
        super::round_bf16(&mut d_logits);
    }
    // dWr [E, C] += dZᵀ · h; dh = Σ the experts' dx (ascending expert) + dZ · Wr.
    gemm(
        g_router,
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
    scratch::give(dy);
    scratch::give(dx);
    if let Some(v) = h_rounded {
        scratch::give(v);
    }
}

#[cfg(test)]
mod tests;
