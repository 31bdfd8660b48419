//! transformers' load-balancing loss for a mixture of experts (`load_balancing_loss_func`, the
//! Switch Transformer's): over the rows `N` of every MoE layer of a micro-batch (each layer's
//! tokens once), `F_e` the share of the `N·k` choices that went to expert `e` (counted per row)
//! and `P_e` the mean router probability of `e` (softmax over every expert),
//! `aux = E · Σ_e (count_e / N)·(Σ p_e / N)`. Only `P` carries a gradient:
//! `∂aux/∂p[r, e] = E·count_e / N²`, the same for every row of every layer — so a layer's
//! backward needs only the counts of the whole forward, which the micro-batch's tally holds.
//!
//! Padding is not data: as transformers with an `attention_mask`, the rows of padding tokens
//! (a packed row's tail) count in neither `F` nor `P` nor `N`, and their probabilities get no
//! gradient from the loss.

use std::collections::BTreeMap;

/// What one MoE layer call routed: tokens per expert and the sum of each expert's router
/// probability over the call's rows (rows ascending, in f64: the same bits on every device).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct ExpertLoad {
    /// Choices per expert `[E]` (each row chooses k experts).
    pub tokens: Vec<u64>,
    /// Σ over rows of each expert's router probability `[E]`.
    pub prob_sums: Vec<f64>,
    /// Rows routed.
    pub rows: u64,
}

impl ExpertLoad {
    /// The load of `rows` rows with their chosen experts `expert` `[rows, k]` and router
    /// probabilities `probs` `[rows, E]`, but for the rows `pad` `[rows]` marks (non-zero:
    /// padding; `None`: no padding).
    pub fn of(
        expert: &[u32],
        probs: &[f32],
        rows: usize,
        e: usize,
        pad: Option<&[u8]>,
    ) -> ExpertLoad {
        let mut prob_sums = vec![0f64; e];
        for (r, row) in probs[..rows * e].chunks(e).enumerate() {
            if is_data(pad, r) {
                for (s, &p) in prob_sums.iter_mut().zip(row) {
                    *s += p as f64;
                }
            }
        }
        ExpertLoad {
            prob_sums,
            ..ExpertLoad::counts(expert, rows, e, pad)
        }
    }

    /// The tokens per expert and the rows of [`ExpertLoad::of`] (no probability sums).
    pub fn counts(expert: &[u32], rows: usize, e: usize, pad: Option<&[u8]>) -> ExpertLoad {
        let k = expert.len() / rows.max(1);
        let mut tokens = vec![0u64; e];
        let mut counted = 0u64;
        for (r, chosen) in expert.chunks(k.max(1)).enumerate().take(rows) {
            if is_data(pad, r) {
                counted += 1;
                for &x in chosen {
                    if let Some(t) = tokens.get_mut(x as usize) {
                        *t += 1;
                    }
                }
            }
        }
        ExpertLoad {
            tokens,
            prob_sums: vec![0.0; e],
            rows: counted,
        }
    }

    /// Add `other` (another chunk of the same layer).
    pub fn add(&mut self, other: &ExpertLoad) {
        if self.tokens.len() < other.tokens.len() {
            self.tokens.resize(other.tokens.len(), 0);
            self.prob_sums.resize(other.prob_sums.len(), 0.0);
        }
        for (a, b) in self.tokens.iter_mut().zip(&other.tokens) {
            *a += b;
        }
        for (a, b) in self.prob_sums.iter_mut().zip(&other.prob_sums) {
            *a += b;
        }
        self.rows += other.rows;
    }

    /// The most-loaded expert's tokens over the mean (1: balanced; E/k: every token to the
    /// same k experts).
    pub fn max_over_mean(&self) -> f64 {
        let total: u64 = self.tokens.iter().sum();
        let max = self.tokens.iter().copied().max().unwrap_or(0);
        match total {
            0 => 0.0,
            t => max as f64 * self.tokens.len() as f64 / t as f64,
        }
    }

    /// Experts no token chose.
    pub fn unused(&self) -> usize {
        self.tokens.iter().filter(|&&t| t == 0).count()
    }
}

/// A micro-batch's routing, per MoE layer (the forward adds each call's load).
#[derive(Debug, Clone, Default, PartialEq)]
pub struct RouterTally {
    /// Layer → its load.
    pub layers: BTreeMap<usize, ExpertLoad>,
}

impl RouterTally {
    /// Add one call's load of `layer`.
    pub fn add(&mut self, layer: usize, load: &ExpertLoad) {
        self.layers.entry(layer).or_default().add(load);
    }

    /// Σ over layers: tokens per expert, probability sums, rows.
    fn totals(&self) -> ExpertLoad {
        let mut t = ExpertLoad::default();
        for l in self.layers.values() {
            t.add(l);
        }
        t
    }

    /// `aux` as transformers computes it (0 with no MoE layer).
    pub fn aux_loss(&self) -> f64 {
        let t = self.totals();
        if t.rows == 0 {
            return 0.0;
        }
        let n = t.rows as f64;
        let e = t.tokens.len() as f64;
        let dot: f64 = t
            .tokens
            .iter()
            .zip(&t.prob_sums)
            .map(|(&c, &p)| (c as f64 / n) * (p / n))
            .sum();
        e * dot
    }

    /// `scale · ∂aux/∂p[r, e]` = `scale · E · count_e / N²` per expert (every row of every layer).
    pub fn aux_grad(&self, scale: f64) -> Vec<f32> {
        let t = self.totals();
        if t.rows == 0 {
            return Vec::new();
        }
        let n = t.rows as f64;
        let e = t.tokens.len() as f64;
        t.tokens
            .iter()
            .map(|&c| (scale * e * c as f64 / (n * n)) as f32)
            .collect()
    }
}

/// The load-balancing loss's gradient in one MoE call: dL/dp per expert
/// ([`RouterTally::aux_grad`]), for every row but those `pad` marks (non-zero: padding).
#[derive(Debug, Clone, Copy)]
pub struct AuxGrad<'a> {
    /// dL/dp `[E]`, the same for every counted row.
    pub per_expert: &'a [f32],
    /// The call's rows that are padding `[rows]` (`None`: none is).
    pub pad: Option<&'a [u8]>,
}

impl AuxGrad<'_> {
    /// Whether row `r` of the call takes the gradient.
    pub fn counts(&self, r: usize) -> bool {
        is_data(self.pad, r)
    }
}

/// Whether row `r` is data (not padding) by the mask `pad` (non-zero: padding).
fn is_data(pad: Option<&[u8]>, r: usize) -> bool {
    pad.is_none_or(|p| p.get(r).is_some_and(|&x| x == 0))
}

/// `dz += p ⊙ (g − ⟨p, g⟩)`: the softmax's backward of `g` = dL/dp added to dL/dz (sums in
/// order, as the CUDA kernel forms them).
pub(super) fn softmax_bwd_add(dz: &mut [f32], p: &[f32], g: &[f32]) {
    let mut dot = 0f32;
    for (pi, gi) in p.iter().zip(g) {
        dot += pi * gi;
    }
    for ((z, pi), gi) in dz.iter_mut().zip(p).zip(g) {
        *z += pi * (gi - dot);
    }
}
