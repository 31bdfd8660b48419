//! The router's decisions: softmax and top-k per token (or GPT-OSS's top-k logits then their
//! softmax), and the tokens' slots grouped by expert (a stable, deterministic permutation).

use super::{MoeShape, Router};
use rayon::prelude::*;

/// The router's decisions for `n` tokens.
#[derive(Debug, Clone, PartialEq)]
pub struct Routing {
    /// Softmax of the router logits over every expert `[n, E]` (what the load-balancing loss
    /// reads; GPT-OSS picks by the logits themselves).
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
    /// No tokens (what a spent forward's internals keep).
    pub(super) fn empty() -> Routing {
        Routing {
            probs: Vec::new(),
            expert: Vec::new(),
            weight: Vec::new(),
            offsets: Vec::new(),
            slots: Vec::new(),
            row_of: Vec::new(),
        }
    }

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
            match s.router {
                Router::SoftmaxTopK => {
                    softmax_into(p, z);
                    top_k(ex, p);
                    for (wj, &x) in w.iter_mut().zip(ex.iter()) {
                        *wj = p[x as usize];
                    }
                    if s.norm_topk {
                        let total: f32 = w.iter().sum();
                        for wj in w.iter_mut() {
                            *wj /= total;
                        }
                    }
                }
                Router::TopKSoftmax => {
                    // Chosen by the logits themselves; `p` for the load-balancing loss.
                    softmax_into(p, z);
                    top_k(ex, z);
                    let chosen: Vec<f32> = ex.iter().map(|&x| z[x as usize]).collect();
                    softmax_into(w, &chosen);
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

/// The grouping [`route`] makes, for experts a device chose: an id not below `e` is an error,
/// not a panic.
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

/// `p = softmax(z)` (max-shifted, summed in order).
fn softmax_into(p: &mut [f32], z: &[f32]) {
    let max = z.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let mut sum = 0f32;
    for (pi, zi) in p.iter_mut().zip(z) {
        *pi = (zi - max).exp();
        sum += *pi;
    }
    for pi in p.iter_mut() {
        *pi /= sum;
    }
}

/// The indices of the `ex.len()` largest scores, descending (ties: the lower index first).
fn top_k(ex: &mut [u32], scores: &[f32]) {
    let mut order: Vec<u32> = (0..scores.len() as u32).collect();
    order.sort_by(|&a, &b| scores[b as usize].total_cmp(&scores[a as usize]));
    let k = ex.len();
    ex.copy_from_slice(&order[..k]);
}
