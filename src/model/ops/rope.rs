//! Rotary position embeddings: the tables of cos and sin per position, and the frequency
//! scalings of the models users bring (`rope_type` default, linear, llama3 and yarn), each
//! computed in fp32 step for step as transformers' `modeling_rope_utils` computes it, so the
//! tables agree with transformers' rotary embedding to the last bits of cos/sin
//! (tests/model_golden.rs, goldens from tools/golden_rope.py, positions up to 2^19).

use rayon::prelude::*;
use serde::{Deserialize, Serialize};

/// How RoPE's frequencies are scaled (`rope_scaling` / `rope_parameters` of a `config.json`).
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(tag = "rope_type", rename_all = "lowercase")]
pub enum RopeScaling {
    /// `1 / θ^(2i/hd)`.
    #[default]
    Default,
    /// Every frequency divided by `factor` (position interpolation).
    Linear {
        /// The divisor.
        factor: f64,
    },
    /// Llama 3.1: frequencies whose wavelength is beyond `original_max_position_embeddings /
    /// low_freq_factor` divided by `factor`, those below `… / high_freq_factor` kept, a smooth
    /// blend between.
    Llama3 {
        /// The divisor of the low frequencies.
        factor: f64,
        /// Sets the low-frequency wavelength bound.
        low_freq_factor: f64,
        /// Sets the high-frequency wavelength bound.
        high_freq_factor: f64,
        /// The pretraining context.
        original_max_position_embeddings: usize,
    },
    /// YaRN: interpolated (÷ `factor`) and extrapolated frequencies blended by a linear ramp over
    /// the dimensions between the correction range of `beta_fast` and `beta_slow` rotations;
    /// cos and sin scaled by `attention_factor`.
    Yarn {
        /// The context extension.
        factor: f64,
        /// The pretraining context.
        original_max_position_embeddings: usize,
        /// Rotations bounding extrapolation (default 32).
        beta_fast: f64,
        /// Rotations bounding interpolation (default 1).
        beta_slow: f64,
        /// The factor on cos and sin (resolved from `factor`, `mscale`, `mscale_all_dim` when
        /// not given).
        attention_factor: f64,
        /// Round the correction range outward to whole dimensions (default true).
        truncate: bool,
    },
}

impl RopeScaling {
    /// The name `config.json` uses.
    pub fn name(&self) -> &'static str {
        match self {
            RopeScaling::Default => "default",
            RopeScaling::Linear { .. } => "linear",
            RopeScaling::Llama3 { .. } => "llama3",
            RopeScaling::Yarn { .. } => "yarn",
        }
    }

    /// The inverse frequencies `[hd/2]` and the factor on cos and sin, for `head_dim` and base
    /// `theta`: fp32 arithmetic in transformers' order (a Python scalar meets an fp32 tensor as
    /// an fp32 value; `scalar / tensor` is the tensor's reciprocal times the scalar).
    pub fn frequencies(&self, head_dim: usize, theta: f64) -> (Vec<f32>, f32) {
        let base = theta as f32;
        let pos_freqs: Vec<f32> = (0..head_dim / 2)
            .map(|i| base.powf((2 * i) as f32 / head_dim as f32))
            .collect();
        let default: Vec<f32> = pos_freqs.iter().map(|p| 1.0 / p).collect();
        match *self {
            RopeScaling::Default => (default, 1.0),
            RopeScaling::Linear { factor } => {
                let f = factor as f32;
                (default.iter().map(|x| x / f).collect(), 1.0)
            }
            RopeScaling::Llama3 {
                factor,
                low_freq_factor,
                high_freq_factor,
                original_max_position_embeddings,
            } => {
                let old = original_max_position_embeddings as f64;
                let (f, low) = (factor as f32, low_freq_factor as f32);
                let low_wavelen = (old / low_freq_factor) as f32;
                let high_wavelen = (old / high_freq_factor) as f32;
                let span = (high_freq_factor - low_freq_factor) as f32;
                let two_pi = (2.0 * std::f64::consts::PI) as f32;
                let inv = default
                    .iter()
                    .map(|&x| {
                        let wavelen = (1.0 / x) * two_pi;
                        let scaled = if wavelen > low_wavelen { x / f } else { x };
                        let smooth = ((1.0 / wavelen) * old as f32 - low) / span;
                        let smoothed = (1.0 - smooth) * scaled / f + smooth * scaled;
                        let medium = wavelen >= high_wavelen && wavelen <= low_wavelen; // never NaN
                        if medium {
                            smoothed
                        } else {
                            scaled
                        }
                    })
                    .collect();
                (inv, 1.0)
            }
            RopeScaling::Yarn {
                factor,
                original_max_position_embeddings,
                beta_fast,
                beta_slow,
                attention_factor,
                truncate,
            } => {
                let (dim, old) = (head_dim as f64, original_max_position_embeddings as f64);
                let correction_dim = |rotations: f64| {
                    (dim * (old / (rotations * 2.0 * std::f64::consts::PI)).ln())
                        / (2.0 * theta.ln())
                };
                let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
                if truncate {
                    low = low.floor();
                    high = high.ceil();
                }
                let (low, mut high) = (low.max(0.0), high.min(dim - 1.0));
                if low == high {
                    high += 0.001; // transformers' guard against a zero-width ramp
                }
                let (lo32, width) = (low as f32, (high - low) as f32);
                let f = factor as f32;
                let inv = pos_freqs
                    .iter()
                    .enumerate()
                    .map(|(i, &p)| {
                        let ramp = ((i as f32 - lo32) / width).clamp(0.0, 1.0);
                        let extrapolation = 1.0 - ramp;
                        let interpolated = 1.0 / (f * p);
                        let extrapolated = 1.0 / p;
                        interpolated * (1.0 - extrapolation) + extrapolated * extrapolation
                    })
                    .collect();
                (inv, attention_factor as f32)
            }
        }
    }
}

/// Rotary position embedding tables, computed as HF does in fp32:
/// `inv_freq[i] = 1 / θ^(2i/hd)` (then scaled, [`RopeScaling`]), `angle = pos · inv_freq[i]`,
/// the tables `cos(angle)·s` and `sin(angle)·s` with `s` the scaling's attention factor.
///
/// A model whose layers rotate differently (Gemma 3's local and global layers) has one table per
/// kind, end to end: table `i` is rows `i·max_pos ..` of `cos` and `sin`.
#[derive(Debug, Clone)]
pub struct Rope {
    /// Head dimension.
    pub head_dim: usize,
    /// Positions covered.
    pub max_pos: usize,
    /// Tables.
    pub tables: usize,
    cos: Vec<f32>, // [tables, max_pos, hd/2]
    sin: Vec<f32>, // [tables, max_pos, hd/2]
}

impl Rope {
    /// Unscaled tables for positions `0..max_pos`.
    pub fn new(head_dim: usize, theta: f64, max_pos: usize) -> Self {
        Self::scaled(head_dim, theta, &RopeScaling::Default, max_pos)
    }

    /// Tables for positions `0..max_pos` with `scaling`.
    pub fn scaled(head_dim: usize, theta: f64, scaling: &RopeScaling, max_pos: usize) -> Self {
        Self::with_tables(head_dim, &[(theta, scaling)], max_pos)
    }

    /// One table per `(θ, scaling)`, in order, for positions `0..max_pos`.
    pub fn with_tables(head_dim: usize, kinds: &[(f64, &RopeScaling)], max_pos: usize) -> Self {
        let half = head_dim / 2;
        let mut cos = Vec::with_capacity(kinds.len() * max_pos * half);
        let mut sin = Vec::with_capacity(kinds.len() * max_pos * half);
        for (theta, scaling) in kinds {
            let (inv, factor) = scaling.frequencies(head_dim, *theta);
            for p in 0..max_pos {
                Self::push_row(&inv, factor, p, &mut cos, &mut sin);
            }
        }
        Rope {
            head_dim,
            max_pos,
            tables: kinds.len(),
            cos,
            sin,
        }
    }

    /// The (cos, sin) row of one position, `[hd/2]` each, exactly as [`Rope::new`]'s tables hold
    /// it (for checking long positions without building the whole table).
    pub fn angles(
        head_dim: usize,
        theta: f64,
        scaling: &RopeScaling,
        pos: usize,
    ) -> (Vec<f32>, Vec<f32>) {
        let (mut cos, mut sin) = (Vec::new(), Vec::new());
        let (inv, factor) = scaling.frequencies(head_dim, theta);
        Self::push_row(&inv, factor, pos, &mut cos, &mut sin);
        (cos, sin)
    }

    /// Append position `p`'s row: angle = (p as f32) · inv_freq, one fp32 product (transformers'
    /// `inv_freq @ position_ids.float()`), then its cos and sin times the attention factor (an
    /// fp32 product; 1 leaves them as they are).
    fn push_row(inv: &[f32], factor: f32, p: usize, cos: &mut Vec<f32>, sin: &mut Vec<f32>) {
        for f in inv {
            let a = p as f32 * f;
            cos.push(a.cos() * factor);
            sin.push(a.sin() * factor);
        }
    }

    /// The tables, `[tables, max_pos, hd/2]` each: (cos, sin).
    pub fn tables(&self) -> (&[f32], &[f32]) {
        (&self.cos, &self.sin)
    }

    /// Rotate `x` [B·T, heads·hd] in place, row r by the angle of position `positions[r]`
    /// (`inverse` = the backward, Rᵀ), with the first table.
    pub fn apply(&self, x: &mut [f32], positions: &[u32], heads: usize, inverse: bool) {
        self.apply_table(x, positions, heads, inverse, 0)
    }

    /// [`Rope::apply`] with table `table`.
    pub fn apply_table(
        &self,
        x: &mut [f32],
        positions: &[u32],
        heads: usize,
        inverse: bool,
        table: usize,
    ) {
        let hd = self.head_dim;
        let half = hd / 2;
        assert!(
            table < self.tables,
            "rope: table {table} of {}",
            self.tables
        );
        let base = table * self.max_pos * half;
        let (cos, sin) = (&self.cos[base..], &self.sin[base..]);
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
                    &cos[pos * half..(pos + 1) * half],
                    &sin[pos * half..(pos + 1) * half],
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
