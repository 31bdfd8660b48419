//! The embedding unit's template: the token lookup (scaled where the model says) and its
//! gradient (none for the padding index).

use crate::model::config::ModelConfig;

/// Token embedding.
#[derive(Debug, Clone)]
pub struct Embedding {
    c: usize,
    vocab: usize,
    /// The factor on every embedding ([`ModelConfig::embed_scale`]: 1, or Gemma's √hidden).
    pub(crate) scale: f32,
    /// The padding index, whose row the lookup leaves without gradient.
    pub(crate) pad: Option<u32>,
}

impl Embedding {
    /// The template for `cfg`.
    pub fn new(cfg: &ModelConfig) -> Self {
        Embedding {
            c: cfg.hidden_size,
            vocab: cfg.vocab_size,
            scale: cfg.embed_scale(),
            pad: cfg.pad_token_id,
        }
    }

    /// x[N, C] = E\[tokens\]·scale.
    pub fn forward(&self, p: &[f32], tokens: &[u32], x: &mut [f32]) {
        for (row, &tok) in x.chunks_mut(self.c).zip(tokens) {
            let t = tok as usize;
            for (o, e) in row.iter_mut().zip(&p[t * self.c..(t + 1) * self.c]) {
                *o = *e * self.scale;
            }
        }
    }

    /// dE\[tokens\] += dx·scale, but for the padding index's rows.
    pub fn backward(&self, g: &mut [f32], tokens: &[u32], dx: &[f32]) {
        for (row, &tok) in dx.chunks(self.c).zip(tokens) {
            if Some(tok) == self.pad {
                continue;
            }
            let t = tok as usize;
            debug_assert!(t < self.vocab);
            for (d, v) in g[t * self.c..(t + 1) * self.c].iter_mut().zip(row) {
                *d += *v * self.scale;
            }
        }
    }
}
