//! One micro-batch's forward and backward with every unit resident in memory: the reference the
//! streamed engine must reproduce bit for bit, and the path the goldens check.

use super::config::ModelConfig;
use super::layers::{DecoderBlock, Embedding, Head, Workspace};
use super::ops::{Rope, IGNORE};
use crate::{Error, Result};

/// The templates of every unit of a model, plus its RoPE tables.
#[derive(Debug, Clone)]
pub struct Templates {
    /// The model.
    pub config: ModelConfig,
    /// Unit 0.
    pub embedding: Embedding,
    /// Units 1..=L.
    pub blocks: Vec<DecoderBlock>,
    /// Unit L+1.
    pub head: Head,
    /// RoPE tables up to the sequence length.
    pub rope: Rope,
}

/// RoPE tables of `cfg` up to `max_t`: the global one, and the local layers' own where they
/// have one ([`ModelConfig::layer_rope`]).
pub fn rope_tables(cfg: &ModelConfig, max_t: usize) -> Rope {
    let global = (cfg.rope_theta, &cfg.rope_scaling);
    match &cfg.local_rope {
        None => Rope::with_tables(cfg.head_dim, &[global], max_t),
        Some(l) => Rope::with_tables(cfg.head_dim, &[global, (l.theta, &l.scaling)], max_t),
    }
}

impl Templates {
    /// Templates for `cfg`, for sequences of up to `max_t` tokens.
    pub fn new(cfg: &ModelConfig, max_t: usize) -> Result<Self> {
        let units = super::units::units(cfg);
        let l = cfg.num_layers;
        Ok(Templates {
            config: cfg.clone(),
            embedding: Embedding::new(cfg),
            blocks: (0..l)
                .map(|i| DecoderBlock::new(cfg, &units[1 + i]))
                .collect::<Result<_>>()?,
            head: Head::new(cfg, &units[l + 1])?,
            rope: rope_tables(cfg, max_t),
        })
    }

    /// Check token ids against the vocabulary.
    pub fn check_tokens(&self, tokens: &[u32], what: &str) -> Result<()> {
        if let Some(bad) = tokens
            .iter()
            .find(|&&t| t as usize >= self.config.vocab_size)
        {
            return Err(Error::bad_input(
                "token id",
                bad.to_string(),
                format!("in {what}: ≥ vocab size {}", self.config.vocab_size),
                Some("tokenize with the model's tokenizer, or raise vocab_size"),
            ));
        }
        Ok(())
    }

    /// Check one micro-batch of `b` sequences of `t` tokens: input ids and targets against the
    /// vocabulary (a target may be [`IGNORE`]), and positions: one per token, each sequence
    /// starting a document at 0, then counting up by one or restarting at 0 (a new document).
    pub fn check_batch(
        &self,
        tokens: &[u32],
        targets: &[u32],
        positions: &[u32],
        b: usize,
        t: usize,
    ) -> Result<()> {
        let n = b * t;
        if tokens.len() != n || targets.len() != n || positions.len() != n {
            return Err(Error::bad_input(
                "batch",
                format!("{b}×{t}"),
                format!(
                    "got {} tokens, {} targets and {} positions",
                    tokens.len(),
                    targets.len(),
                    positions.len()
                ),
                None,
            ));
        }
        self.check_tokens(tokens, "inputs")?;
        if let Some(bad) = targets
            .iter()
            .find(|&&y| y != IGNORE && y as usize >= self.config.vocab_size)
        {
            return Err(Error::bad_input(
                "token id",
                bad.to_string(),
                format!("in targets: ≥ vocab size {}", self.config.vocab_size),
                Some("tokenize with the model's tokenizer, or raise vocab_size"),
            ));
        }
        self.check_positions(positions, t)
    }

    /// Check positions of sequences of `t` tokens: each sequence starts a document at 0, then
    /// positions count up by one or restart at 0 (a new document).
    pub fn check_positions(&self, positions: &[u32], t: usize) -> Result<()> {
        for (r, row) in positions.chunks(t.max(1)).enumerate() {
            let mut prev: Option<u32> = None;
            for (i, &p) in row.iter().enumerate() {
                let ok = p == 0 || prev.is_some_and(|q| q.checked_add(1) == Some(p));
                if !ok {
                    return Err(Error::bad_input(
                        "positions",
                        format!("sequence {r}, token {i}"),
                        format!(
                            "position {p} after {}: positions restart at 0 for each document and count up by one",
                            prev.map_or("the start of the sequence".into(), |q| q.to_string())
                        ),
                        None,
                    ));
                }
                prev = Some(p);
            }
        }
        Ok(())
    }
}

/// Forward and backward of one micro-batch of `b` sequences of `t` tokens with every unit
/// resident; `positions` are the tokens' positions in their documents (see
/// [`Templates::check_batch`]). `params[u]`/`grads[u]` are unit u's shards; gradients
/// accumulate. Returns Σ loss over the micro-batch's trained tokens; `grad_scale` is 1/(trained
/// tokens in the whole step).
#[allow(clippy::too_many_arguments)]
pub fn step_resident(
    tm: &Templates,
    params: &[&[f32]],
    grads: &mut [&mut [f32]],
    tokens: &[u32],
    targets: &[u32],
    positions: &[u32],
    b: usize,
    t: usize,
    grad_scale: f32,
    ws: &mut Workspace,
) -> Result<f64> {
    let (n, c, l) = (b * t, tm.config.hidden_size, tm.blocks.len());
    tm.check_batch(tokens, targets, positions, b, t)?;
    // Layer-boundary activations x_0..x_L.
    let mut xs = vec![vec![0.0f32; n * c]; l + 1];
    tm.embedding.forward(params[0], tokens, &mut xs[0]);
    for (i, blk) in tm.blocks.iter().enumerate() {
        let (done, rest) = xs.split_at_mut(i + 1);
        blk.forward(
            params[1 + i],
            &done[i],
            &mut rest[0],
            ws,
            &tm.rope,
            positions,
            b,
            t,
        );
    }
    let mut dx = vec![0.0f32; n * c];
    let mut dnext = vec![0.0f32; n * c];
    let head_unit = l + 1;
    let nr = tm.head.norm_range();
    let p_head = params[head_unit];
    let loss = match tm.head.lm_head {
        Some(off) => {
            // lm_head.weight follows the norm in the head unit's shard.
            let v = tm.config.vocab_size;
            let (g_lo, g_w) = grads[head_unit].split_at_mut(off);
            tm.head.loss_backward(
                &p_head[nr.clone()],
                &mut g_lo[nr],
                &p_head[off..off + v * c],
                &mut g_w[..v * c],
                &xs[l],
                targets,
                &mut dx,
                grad_scale,
                ws,
            )
        }
        None => {
            // Tied: the LM head is the embedding matrix (unit 0).
            let (first, rest) = grads.split_at_mut(1);
            let g_head = &mut *rest[head_unit - 1];
            tm.head.loss_backward(
                &p_head[nr.clone()],
                &mut g_head[nr],
                params[0],
                first[0],
                &xs[l],
                targets,
                &mut dx,
                grad_scale,
                ws,
            )
        }
    };
    for i in (0..l).rev() {
        tm.blocks[i].backward(
            params[1 + i],
            grads[1 + i],
            &xs[i],
            &dx,
            &mut dnext,
            ws,
            &tm.rope,
            positions,
            b,
            t,
        );
        std::mem::swap(&mut dx, &mut dnext);
    }
    tm.embedding.backward(grads[0], tokens, &dx);
    Ok(loss)
}

/// x_L (the final hidden states, before the final norm) and the LM-head weight slice, with every
/// unit resident.
fn forward_hidden<'p>(
    tm: &Templates,
    params: &[&'p [f32]],
    tokens: &[u32],
    positions: &[u32],
    b: usize,
    t: usize,
    ws: &mut Workspace,
) -> Result<(Vec<f32>, &'p [f32])> {
    let (n, c, l, v) = (
        b * t,
        tm.config.hidden_size,
        tm.blocks.len(),
        tm.config.vocab_size,
    );
    if tokens.len() != n || positions.len() != n {
        return Err(Error::bad_input(
            "batch",
            format!("{b}×{t}"),
            format!(
                "got {} tokens and {} positions",
                tokens.len(),
                positions.len()
            ),
            None,
        ));
    }
    tm.check_tokens(tokens, "inputs")?;
    tm.check_positions(positions, t)?;
    let mut x = vec![0.0f32; n * c];
    let mut y = vec![0.0f32; n * c];
    tm.embedding.forward(params[0], tokens, &mut x);
    for (i, blk) in tm.blocks.iter().enumerate() {
        blk.forward(params[1 + i], &x, &mut y, ws, &tm.rope, positions, b, t);
        std::mem::swap(&mut x, &mut y);
    }
    let p_head = params[l + 1];
    let w = match tm.head.lm_head {
        Some(off) => &p_head[off..off + v * c],
        None => &params[0][..v * c],
    };
    Ok((x, w))
}

/// Logits [B·T, V] with every unit resident (tests and evaluation; training never builds them).
pub fn forward_logits(
    tm: &Templates,
    params: &[&[f32]],
    tokens: &[u32],
    positions: &[u32],
    b: usize,
    t: usize,
    ws: &mut Workspace,
) -> Result<Vec<f32>> {
    let (n, v) = (b * t, tm.config.vocab_size);
    let (x, w) = forward_hidden(tm, params, tokens, positions, b, t, ws)?;
    let mut out = vec![0.0f32; n * v];
    tm.head
        .logits(params[tm.blocks.len() + 1], w, &x, n, &mut out);
    Ok(out)
}

/// Σ loss over the trained tokens of a batch with every unit resident, without materialising
/// more than 256 rows of logits (validation).
#[allow(clippy::too_many_arguments)]
pub fn eval_loss(
    tm: &Templates,
    params: &[&[f32]],
    tokens: &[u32],
    targets: &[u32],
    positions: &[u32],
    b: usize,
    t: usize,
    ws: &mut Workspace,
) -> Result<f64> {
    let (n, c) = (b * t, tm.config.hidden_size);
    tm.check_batch(tokens, targets, positions, b, t)?;
    let (x, w) = forward_hidden(tm, params, tokens, positions, b, t, ws)?;
    let p_head = params[tm.blocks.len() + 1];
    let rows = super::ops::ce_chunk_rows(tm.config.vocab_size);
    let mut total = 0.0;
    for r0 in (0..n).step_by(rows) {
        let r1 = (r0 + rows).min(n);
        total += tm
            .head
            .loss(p_head, w, &x[r0 * c..r1 * c], &targets[r0..r1]);
    }
    Ok(total)
}
