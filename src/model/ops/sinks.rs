//! Attention sinks (GPT-OSS): a learned logit per query head that takes part in every query's
//! softmax and whose probability is then dropped, so a query may attend to "nothing". Computed
//! around the attention without sinks: the forward rescales its output and log-sum-exp
//! (`lse' = log(e^lse + e^sink)`, `O' = O·e^(lse − lse')`); given `O'` and `lse'`, the attention's
//! own backward is already the right one for Q, K and V (its probabilities `e^(s − lse')` are the
//! sink-including ones and its `D = rowsum(dO ⊙ O')`), and the sink's gradient is
//! `−Σ_rows e^(sink − lse')·rowsum(dO ⊙ O')`.
//!
//! Layouts as [`AttnShape`]: `o`, `d_o` `[B·(q1−q0), NH·HD]`, `lse` `[B, NH, q1−q0]`, `sinks`
//! `[NH]`.

use super::AttnShape;

/// `(lse', e^(lse − lse'))` for one row: the log-sum-exp with the sink, and the factor on `O`.
#[inline]
fn with_sink(lse: f32, sink: f32) -> (f32, f32) {
    let m = lse.max(sink);
    let lse2 = m + ((lse - m).exp() + (sink - m).exp()).ln();
    (lse2, (lse - lse2).exp())
}

/// The sinks' forward on the attention's output `o` and log-sum-exp `lse` (both rewritten).
pub fn sinks_fwd(o: &mut [f32], lse: &mut [f32], sinks: &[f32], s: AttnShape) {
    let (rows, hd) = (s.q1 - s.q0, s.hd);
    let width = s.nh * hd;
    for b in 0..s.b {
        for h in 0..s.nh {
            for r in 0..rows {
                let l = &mut lse[(b * s.nh + h) * rows + r];
                let (lse2, factor) = with_sink(*l, sinks[h]);
                *l = lse2;
                let row = (b * rows + r) * width + h * hd;
                for v in &mut o[row..row + hd] {
                    *v *= factor;
                }
            }
        }
    }
}

/// The sinks' gradient `dsinks += −Σ_rows e^(sink − lse')·rowsum(dO ⊙ O')`, rows in order, from
/// the forward's rewritten `o` and `lse`.
pub fn sinks_bwd(
    dsinks: &mut [f32],
    d_o: &[f32],
    o: &[f32],
    lse: &[f32],
    sinks: &[f32],
    s: AttnShape,
) {
    let (rows, hd) = (s.q1 - s.q0, s.hd);
    let width = s.nh * hd;
    for (h, ds) in dsinks.iter_mut().enumerate().take(s.nh) {
        let mut acc = 0f32;
        for b in 0..s.b {
            for r in 0..rows {
                let row = (b * rows + r) * width + h * hd;
                let delta: f32 = d_o[row..row + hd]
                    .iter()
                    .zip(&o[row..row + hd])
                    .map(|(a, c)| a * c)
                    .sum();
                let p_sink = (sinks[h] - lse[(b * s.nh + h) * rows + r]).exp();
                acc += p_sink * delta;
            }
        }
        *ds -= acc;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Against the definition: a softmax over [scores, sink] with the sink's column dropped,
    /// on one head of explicit scores.
    #[test]
    fn the_rescaled_output_is_the_softmax_with_the_sink_column_dropped() {
        let scores = [0.3f32, -1.2, 0.8];
        let values = [[1.0f32, 2.0], [-0.5, 0.25], [3.0, -1.0]];
        let sink = 0.7f32;
        let lse0 = scores.iter().map(|s| s.exp()).sum::<f32>().ln();
        let mut o: Vec<f32> = (0..2)
            .map(|d| {
                (0..3)
                    .map(|j| (scores[j] - lse0).exp() * values[j][d])
                    .sum()
            })
            .collect();
        let mut lse = [lse0];
        let s = AttnShape::causal(1, 1, 1, 1, 2);
        sinks_fwd(&mut o, &mut lse, &[sink], s);
        let z: f32 = scores.iter().map(|s| s.exp()).sum::<f32>() + sink.exp();
        for d in 0..2 {
            let want: f32 = (0..3).map(|j| scores[j].exp() / z * values[j][d]).sum();
            assert!((o[d] - want).abs() < 1e-6, "{} vs {want}", o[d]);
        }
        assert!((lse[0] - z.ln()).abs() < 1e-6);
        // d sink of L = Σ dO·O': −p_sink·Σ dO ⊙ O' (finite difference of the definition).
        let d_o = [0.4f32, -0.9];
        let loss = |sink: f32| -> f64 {
            let z: f64 =
                scores.iter().map(|s| (*s as f64).exp()).sum::<f64>() + (sink as f64).exp();
            (0..2)
                .map(|d| {
                    d_o[d] as f64
                        * (0..3)
                            .map(|j| (scores[j] as f64).exp() / z * values[j][d] as f64)
                            .sum::<f64>()
                })
                .sum()
        };
        let numeric = (loss(sink + 1e-3) - loss(sink - 1e-3)) / 2e-3;
        let mut ds = [0f32];
        sinks_bwd(&mut ds, &d_o, &o, &lse, &[sink], s);
        assert!(
            (ds[0] as f64 - numeric).abs() < 1e-4,
            "{} vs {numeric}",
            ds[0]
        );
    }
}
