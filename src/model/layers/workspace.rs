//! Scratch for one decoder layer's forward and backward, independent of depth.

use crate::model::config::ModelConfig;

/// Scratch for one layer's forward and backward over N = B·T tokens. Sized once for the largest
/// layer; its size does not depend on the number of layers.
#[derive(Debug, Default)]
pub struct Workspace {
    pub(super) h1: Vec<f32>,    // [N, C]   normed input
    pub(super) rstd1: Vec<f32>, // [N]
    pub(super) q: Vec<f32>,     // [N, NH·HD]
    pub(super) k: Vec<f32>,     // [N, NKV·HD]
    pub(super) v: Vec<f32>,     // [N, NKV·HD]
    pub(super) att: Vec<f32>,   // [N, NH·HD] attention output
    pub(super) lse: Vec<f32>,   // [B, NH, T] attention log-sum-exp
    pub(super) delta: Vec<f32>, // [B, NH, T] rowsum(dO ⊙ O), the attention backward's scratch
    pub(super) x2: Vec<f32>,    // [N, C]   after the attention residual
    pub(super) h2: Vec<f32>,    // [N, C]   normed x2
    pub(super) rstd2: Vec<f32>, // [N]
    pub(super) gate: Vec<f32>,  // [N, I]
    pub(super) up: Vec<f32>,    // [N, I]
    pub(super) act: Vec<f32>,   // [N, I]
    // backward
    pub(super) d_i1: Vec<f32>,  // [N, I]   dL/d act
    pub(super) d_i2: Vec<f32>,  // [N, I]   dL/d gate
    pub(super) d_i3: Vec<f32>,  // [N, I]   dL/d up
    pub(super) d_att: Vec<f32>, // [N, NH·HD] dL/d att
    pub(super) d_c: Vec<f32>,   // [N, C]   dL/d h2, then dL/d h1
    pub(super) d_c2: Vec<f32>,  // [N, C]   dL/d x2
    pub(super) dq: Vec<f32>,    // [N, NH·HD] dL/d q
    pub(super) dk: Vec<f32>,    // [N, NKV·HD] dL/d k
    pub(super) dv: Vec<f32>,    // [N, NKV·HD] dL/d v
    pub(super) ce: Vec<f32>,    // [ce_chunk_rows(V), V] one chunk of logits, then their gradients
    // QK-norm only (else empty)
    pub(super) q_raw: Vec<f32>,  // [N, NH·HD] queries before their norm
    pub(super) k_raw: Vec<f32>,  // [N, NKV·HD] keys before their norm
    pub(super) rstd_q: Vec<f32>, // [N·NH]
    pub(super) rstd_k: Vec<f32>, // [N·NKV]
    // sandwich norms only (else empty)
    pub(super) attn_out: Vec<f32>, // [N, C] the attention's output projection, before its norm
    pub(super) rstd_pa: Vec<f32>,  // [N]
    pub(super) mlp_out: Vec<f32>,  // [N, C] the MLP's down projection, before its norm
    pub(super) rstd_pf: Vec<f32>,  // [N]
}

impl Workspace {
    /// Scratch for `n` tokens of `cfg`'s layers.
    pub fn new(cfg: &ModelConfig, b: usize, t: usize) -> Self {
        let n = b * t;
        let (c, qd, kvd, i) = (
            cfg.hidden_size,
            cfg.q_dim(),
            cfg.kv_dim(),
            cfg.intermediate_size,
        );
        let z = |len: usize| vec![0.0f32; len];
        let qk = |len: usize| if cfg.qk_norm { z(len) } else { Vec::new() };
        let sw = |len: usize| {
            if cfg.sandwich_norms {
                z(len)
            } else {
                Vec::new()
            }
        };
        Workspace {
            h1: z(n * c),
            rstd1: z(n),
            q: z(n * qd),
            k: z(n * kvd),
            v: z(n * kvd),
            att: z(n * qd),
            lse: z(b * cfg.num_heads * t),
            delta: z(b * cfg.num_heads * t),
            x2: z(n * c),
            h2: z(n * c),
            rstd2: z(n),
            gate: z(n * i),
            up: z(n * i),
            act: z(n * i),
            d_i1: z(n * i),
            d_i2: z(n * i),
            d_i3: z(n * i),
            d_att: z(n * qd),
            d_c: z(n * c),
            d_c2: z(n * c),
            dq: z(n * qd),
            dk: z(n * kvd),
            dv: z(n * kvd),
            ce: Vec::new(),
            q_raw: qk(n * qd),
            k_raw: qk(n * kvd),
            rstd_q: qk(n * cfg.num_heads),
            rstd_k: qk(n * cfg.num_kv_heads),
            attn_out: sw(n * c),
            rstd_pa: sw(n),
            mlp_out: sw(n * c),
            rstd_pf: sw(n),
        }
    }

    /// Bytes held.
    pub fn bytes(&self) -> usize {
        4 * [
            &self.h1,
            &self.rstd1,
            &self.q,
            &self.k,
            &self.v,
            &self.att,
            &self.lse,
            &self.delta,
            &self.x2,
            &self.h2,
            &self.rstd2,
            &self.gate,
            &self.up,
            &self.act,
            &self.d_i1,
            &self.d_i2,
            &self.d_i3,
            &self.d_att,
            &self.d_c,
            &self.d_c2,
            &self.dq,
            &self.dk,
            &self.dv,
            &self.ce,
            &self.q_raw,
            &self.k_raw,
            &self.rstd_q,
            &self.rstd_k,
            &self.attn_out,
            &self.rstd_pa,
            &self.mlp_out,
            &self.rstd_pf,
        ]
        .iter()
        .map(|v| v.capacity())
        .sum::<usize>()
    }
}
