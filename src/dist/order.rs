//! The fixed order of the data-parallel sums, and how a buffer is cut among ranks.

use std::ops::Range;

/// `out[i] = ((parts[0][i] + parts[1][i]) + parts[2][i]) + …` in f32: the left fold in rank
/// order, which is also the order a single process accumulates its micro-batches' gradients in
/// (the first copied, each next one added), so N ranks of one micro-batch each sum the same
/// bits as one rank accumulating N. Every part is as long as `out`.
pub fn sum_in_rank_order(parts: &[&[f32]], out: &mut [f32]) {
    let Some((first, rest)) = parts.split_first() else {
        out.fill(0.0);
        return;
    };
    out.copy_from_slice(first);
    for p in rest {
        add_into(out, p);
    }
}

/// `out[i] += part[i]`: one step of the fold.
fn add_into(out: &mut [f32], part: &[f32]) {
    for (o, x) in out.iter_mut().zip(part) {
        *o += *x;
    }
}

/// A step's totals from every rank, laid end to end in `all` (`out.len()` each), added into
/// `out` from zero in rank order, `((0 + x₀) + x₁) + …`: the same bits on every rank, whichever
/// world gathered them.
pub fn totals_in_rank_order(all: &[f64], out: &mut [f64]) {
    out.fill(0.0);
    if out.is_empty() {
        return;
    }
    for part in all.chunks_exact(out.len()) {
        for (o, x) in out.iter_mut().zip(part) {
            *o += *x;
        }
    }
}

/// [`sum_in_rank_order`] of the `parts.len() / len` parts of `len` elements laid end to end in
/// `parts`, into the first: the same bits, with no buffer of its own.
pub fn sum_in_rank_order_in_place(parts: &mut [f32], len: usize) {
    if len == 0 {
        return;
    }
    let (out, rest) = parts.split_at_mut(len);
    for p in rest.chunks_exact(len) {
        add_into(out, p);
    }
}

/// Rank r's slice of an `n`-element buffer cut among `ranks`: contiguous, in rank order, the
/// first `n % ranks` one element longer.
pub fn slice_of(n: usize, ranks: usize, r: usize) -> Range<usize> {
    let ranks = ranks.max(1);
    let (base, extra) = (n / ranks, n % ranks);
    let start = r * base + r.min(extra);
    start..start + base + usize::from(r < extra)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slices_cover_the_buffer_in_order() {
        for n in [0usize, 1, 2, 7, 64, 1001] {
            for ranks in 1..=5 {
                let mut next = 0;
                for r in 0..ranks {
                    let s = slice_of(n, ranks, r);
                    assert_eq!(s.start, next);
                    next = s.end;
                }
                assert_eq!(next, n);
            }
        }
    }

    #[test]
    fn the_sum_is_the_left_fold_of_accumulation() {
        // Values of very different magnitudes, so a different order gives different bits.
        let scales = crate::util::uniform(3 * 257, 11, 1.0);
        let parts: Vec<Vec<f32>> = (0..3)
            .map(|k| {
                crate::util::uniform(257, k as u64 + 1, 1.0)
                    .iter()
                    .zip(&scales[k * 257..])
                    .map(|(x, s)| x * 10f32.powi((s.abs() * 8.0) as i32))
                    .collect()
            })
            .collect();
        let refs: Vec<&[f32]> = parts.iter().map(Vec::as_slice).collect();
        let mut out = vec![0.0f32; 257];
        sum_in_rank_order(&refs, &mut out);
        // What gradient accumulation does: copy the first, add each next one in place.
        let mut acc = parts[0].clone();
        for p in &parts[1..] {
            for (a, x) in acc.iter_mut().zip(p) {
                *a += x;
            }
        }
        assert_eq!(
            out.iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            acc.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
        // And the order matters for these values (the test would notice a reordering).
        let mut reversed = parts[2].clone();
        for p in [&parts[1], &parts[0]] {
            for (a, x) in reversed.iter_mut().zip(p.iter()) {
                *a += x;
            }
        }
        assert_ne!(reversed, out);
        // The in-place sum (the MPI world's, over its receive buffer) is the same bits.
        let mut laid: Vec<f32> = parts.concat();
        sum_in_rank_order_in_place(&mut laid, 257);
        assert_eq!(
            laid[..257].iter().map(|x| x.to_bits()).collect::<Vec<_>>(),
            acc.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
        );
    }
}
