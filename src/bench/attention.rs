//! `megatrain bench attention`: the CPU device's causal attention (forward, and forward +
//! backward) at long sequence lengths, in causal TFLOP/s; with `--window W`, each length also
//! under a sliding window of W keys, and how many times faster that runs. `tools/bench_attention_cpu.py` runs it
//! beside PyTorch's `scaled_dot_product_attention` on the same shapes and threads.

use crate::model::ops::{attention_bwd, attention_fwd, flat_positions, AttnShape};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::time::Instant;

/// What to measure.
#[derive(Debug, Clone)]
pub struct AttnBenchArgs {
    /// Sequence lengths.
    pub seqs: Vec<usize>,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Timed repetitions per case (the median is reported).
    pub reps: usize,
    /// A sliding window to time beside full causal attention.
    pub window: Option<usize>,
}

/// One shape's figures.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AttnCase {
    /// Sequence length.
    pub t: usize,
    /// Query heads.
    pub heads: usize,
    /// Key/value heads.
    pub kv_heads: usize,
    /// Head dimension.
    pub head_dim: usize,
    /// Sliding window (none: full causal attention).
    #[serde(default)]
    pub window: Option<usize>,
    /// Forward, seconds (median).
    pub fwd_s: f64,
    /// Forward + backward, seconds (median).
    pub fwd_bwd_s: f64,
    /// Useful forward FLOPs: 2 GEMMs over the keys each query sees (causal: the lower
    /// triangle, 2·T²·hd·heads; windowed: only the window's keys).
    pub fwd_flops: f64,
}

/// The report.
#[derive(Debug, Clone, Serialize, Deserialize)]
pub struct AttnBenchReport {
    /// Rayon threads used.
    pub threads: usize,
    /// One per sequence length.
    pub cases: Vec<AttnCase>,
}

/// Time the CPU attention at each sequence length (batch 1, random inputs).
pub fn run(a: &AttnBenchArgs) -> Result<AttnBenchReport> {
    if a.heads == 0 || a.kv_heads == 0 || !a.heads.is_multiple_of(a.kv_heads) || a.head_dim == 0 {
        return Err(Error::bad_input(
            "attention shape",
            format!(
                "{} heads, {} kv heads, head dim {}",
                a.heads, a.kv_heads, a.head_dim
            ),
            "heads must be a positive multiple of kv heads, head dim positive",
            None,
        ));
    }
    super::check_count("--reps", a.reps, 1, super::MAX_REPS)?;
    if let Some(w) = a.window {
        super::check_count("--window", w, 1, 1 << 24)?;
    }
    if a.seqs.is_empty() {
        return Err(Error::bad_input(
            "--seq",
            "",
            "no sequence length",
            Some("pass --seq 4096,8192"),
        ));
    }
    for &t in &a.seqs {
        super::check_count("--seq", t, 1, 1 << 24)?;
        // q, d_o, o, dq (heads) and k, v, dk, dv (kv heads) of t × head dim, lse and delta
        // (heads × t), positions.
        let bytes = (|| {
            let per_token = 4u64
                .checked_mul(a.heads as u64)?
                .checked_add(4 * a.kv_heads as u64)?
                .checked_mul(a.head_dim as u64)?
                .checked_add(2 * a.heads as u64 + 2)?;
            per_token.checked_mul(4)?.checked_mul(t as u64)
        })();
        super::check_memory(
            &format!("attention at --seq {t}"),
            bytes,
            "pass a shorter --seq (or fewer heads)",
        )?;
    }
    let mut cases = Vec::new();
    let windows: Vec<Option<usize>> = std::iter::once(None).chain(a.window.map(Some)).collect();
    for (&t, &window) in a
        .seqs
        .iter()
        .flat_map(|t| windows.iter().map(move |w| (t, w)))
    {
        let s = AttnShape::causal(1, t, a.heads, a.kv_heads, a.head_dim).windowed(window);
        // The keys a query sees, summed over the queries.
        let keys = (0..t)
            .map(|i| window.map_or(i + 1, |w| (i + 1).min(w)) as f64)
            .sum::<f64>();
        let (qn, kn) = (t * a.heads * a.head_dim, t * a.kv_heads * a.head_dim);
        let (q, k, v, d_o) = (
            crate::util::uniform(qn, 1, 1.0),
            crate::util::uniform(kn, 2, 1.0),
            crate::util::uniform(kn, 3, 1.0),
            crate::util::uniform(qn, 4, 1.0),
        );
        let pos = flat_positions(1, t);
        let (mut o, mut lse) = (vec![0.0f32; qn], vec![0.0f32; a.heads * t]);
        let (mut dq, mut dk, mut dv) = (vec![0.0f32; qn], vec![0.0f32; kn], vec![0.0f32; kn]);
        let mut delta = vec![0.0f32; a.heads * t];
        let median = |f: &mut dyn FnMut()| {
            f(); // warm-up
            crate::util::median(
                (0..a.reps)
                    .map(|_| {
                        let t0 = Instant::now();
                        f();
                        t0.elapsed().as_secs_f64()
                    })
                    .collect(),
            )
        };
        let fwd_s = median(&mut || attention_fwd(&mut o, &mut lse, &q, &k, &v, &pos, s));
        let fwd_bwd_s = median(&mut || {
            attention_fwd(&mut o, &mut lse, &q, &k, &v, &pos, s);
            dk.fill(0.0);
            dv.fill(0.0);
            attention_bwd(
                &mut dq, &mut dk, &mut dv, &mut delta, &d_o, &q, &k, &v, &o, &lse, &pos, s,
            );
        });
        cases.push(AttnCase {
            t,
            heads: a.heads,
            kv_heads: a.kv_heads,
            head_dim: a.head_dim,
            window,
            fwd_s,
            fwd_bwd_s,
            fwd_flops: 4.0 * keys * (a.head_dim * a.heads) as f64,
        });
    }
    Ok(AttnBenchReport {
        threads: rayon::current_num_threads(),
        cases,
    })
}

/// The report as a table: causal TFLOP/s (the backward counted as 2.5 forwards, as
/// FlashAttention's benchmarks count it).
pub fn render(r: &AttnBenchReport) -> String {
    let mut out = format!(
        "CPU causal attention, {} threads (TFLOP/s over the causal lower triangle; backward = 2.5× forward)\n",
        r.threads
    );
    out.push_str(
        "      T  window  heads kv  hd    fwd ms  fwd TFLOP/s   fwd+bwd ms  fwd+bwd TFLOP/s  vs full\n",
    );
    for c in &r.cases {
        // A windowed case beside the full one of its length: how many times faster.
        let full = r
            .cases
            .iter()
            .find(|f| f.t == c.t && f.window.is_none() && f.heads == c.heads);
        let speedup = match (c.window, full) {
            (Some(_), Some(f)) => format!("{:>7.1}×", f.fwd_bwd_s / c.fwd_bwd_s),
            _ => String::new(),
        };
        out.push_str(&format!(
            "{:>7} {:>7} {:>6} {:>3} {:>3} {:>9.1} {:>12.4} {:>12.1} {:>16.4} {}\n",
            c.t,
            c.window.map_or("-".to_owned(), |w| w.to_string()),
            c.heads,
            c.kv_heads,
            c.head_dim,
            c.fwd_s * 1e3,
            c.fwd_flops / c.fwd_s / 1e12,
            c.fwd_bwd_s * 1e3,
            3.5 * c.fwd_flops / c.fwd_bwd_s / 1e12,
            speedup,
        ));
    }
    out
}
