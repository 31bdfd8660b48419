//! The shape of a program run: the micro-batch and the token chunks its blocks run in.

use super::{bf16_operand_bytes, workspace_bytes, Precision};
use crate::model::config::ModelConfig;
use crate::{Error, Result};

/// Granularity of chunks shorter than a sequence, in tokens: a multiple of the CPU attention's
/// query tile ([`crate::model::ops::ATTN_TILE`]) and of the weight-gradient row block
/// ([`crate::model::ops::GRAD_ROWS`]), so the CPU device's results are the same bits for every
/// chunk size.
pub const CHUNK_ALIGN: usize = 256;

/// The shape of one program run: micro-batches of `b` sequences of `t` tokens, whose blocks run
/// `chunk` tokens at a time (see [`Shape::chunks`]).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shape {
    /// Sequences per micro-batch.
    pub b: usize,
    /// Tokens per sequence.
    pub t: usize,
    /// Tokens per chunk: whole sequences when ≥ `t`, else a multiple of [`CHUNK_ALIGN`].
    chunk: usize,
}

/// A run of rows a block handles at once: queries `q0..q1` of sequences `b0..b0 + nb` (either
/// whole sequences, or a part of one).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Chunk {
    /// First sequence.
    pub b0: usize,
    /// Sequences.
    pub nb: usize,
    /// First token of each.
    pub q0: usize,
    /// One past the last.
    pub q1: usize,
}

impl Chunk {
    /// Rows of the chunk.
    pub fn rows(&self) -> usize {
        self.nb * (self.q1 - self.q0)
    }
}

impl Shape {
    /// The whole micro-batch at once.
    pub fn whole(b: usize, t: usize) -> Self {
        Shape {
            b,
            t,
            chunk: (b * t).max(1),
        }
    }

    /// Chunks of `chunk` tokens: whole sequences when `chunk ≥ t`, else a multiple of
    /// [`CHUNK_ALIGN`].
    pub fn chunked(b: usize, t: usize, chunk: usize) -> Result<Self> {
        if chunk == 0 || (chunk < t && !chunk.is_multiple_of(CHUNK_ALIGN)) {
            return Err(Error::bad_input(
                "token chunk",
                chunk.to_string(),
                format!(
                    "must be at least the sequence length ({t}) or a positive multiple of {CHUNK_ALIGN}"
                ),
                Some("let megatrain choose it from --device-memory"),
            ));
        }
        Ok(Shape { b, t, chunk })
    }

    /// The largest chunking of at most this shape's chunk whose workspace (with, under bf16, a
    /// GPU's GEMM operand buffers: [`super::bf16_operand_bytes`]) fits in `budget` bytes (the
    /// whole micro-batch, fewer whole sequences, then parts of a sequence), or an error naming
    /// the smallest workspace and `what` the budget is.
    pub fn fit(
        self,
        cfg: &ModelConfig,
        precision: Precision,
        budget: u64,
        what: &str,
    ) -> Result<Self> {
        let bytes =
            |s: Shape| workspace_bytes(cfg, s, precision) + bf16_operand_bytes(cfg, s, precision);
        let (b, t) = (self.b, self.t);
        let whole = (1..=b.max(1)).rev().map(|nb| nb * t);
        let parts = (1..t.div_ceil(CHUNK_ALIGN)).rev().map(|k| k * CHUNK_ALIGN);
        let mut smallest = self;
        for chunk in whole.chain(parts).filter(|&c| c <= self.chunk) {
            let Ok(s) = Shape::chunked(b, t, chunk) else {
                continue;
            };
            if bytes(s) <= budget {
                return Ok(s);
            }
            smallest = s;
        }
        Err(Error::bad_input(
            "device memory",
            what.to_owned(),
            format!(
                "the layer workspace needs at least {} (chunks of {} tokens), {} is left for it",
                crate::util::human_bytes(bytes(smallest)),
                smallest.chunk_rows(),
                crate::util::human_bytes(budget)
            ),
            Some("raise the device memory, or lower --batch-size / --seq-len"),
        ))
    }

    pub(crate) fn n(&self) -> usize {
        self.b * self.t
    }

    /// Whether the blocks run in more than one chunk.
    pub fn is_chunked(&self) -> bool {
        self.chunk_rows() < self.n()
    }

    /// Rows of the largest chunk.
    pub fn chunk_rows(&self) -> usize {
        if self.chunk >= self.t {
            (self.chunk / self.t.max(1)).clamp(1, self.b.max(1)) * self.t
        } else {
            self.chunk
        }
    }

    /// The chunks in row order: groups of whole sequences, or each sequence's tokens `chunk`
    /// at a time (the last one shorter when `chunk` does not divide `t`).
    pub fn chunks(&self) -> impl Iterator<Item = Chunk> + '_ {
        let t = self.t;
        let (per_seq, seqs) = if self.chunk >= t {
            (t.max(1), (self.chunk / t.max(1)).clamp(1, self.b.max(1)))
        } else {
            (self.chunk, 1)
        };
        (0..self.b).step_by(seqs).flat_map(move |b0| {
            let nb = seqs.min(self.b - b0);
            (0..t).step_by(per_seq).map(move |q0| Chunk {
                b0,
                nb,
                q0,
                q1: (q0 + per_seq).min(t),
            })
        })
    }
}
