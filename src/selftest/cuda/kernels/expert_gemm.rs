//! The experts' grouped GEMMs (`kernels/expert_gemm.cu`) against a plain f64 loop over each
//! expert's rows: uneven experts (none, one, several 128-row tiles), widths that are and are
//! not multiples of 8 (the 16-byte and the element-wise loads), both weight layouts, and
//! accumulation onto what C holds.

use super::{round_bf16, Gpu, Out};
use crate::device::cuda::launches::{ExpertRows, ExpertSums};
use crate::Result;

/// Rows per expert: empty experts, a single row, and ones spanning several row tiles and k tiles.
const COUNTS: [usize; 6] = [0, 1, 300, 0, 129, 37];

/// Each expert's first row, `[G + 1]`.
fn offsets() -> Vec<u32> {
    let mut o = vec![0u32];
    for c in COUNTS {
        o.push(o[o.len() - 1] + c as u32);
    }
    o
}

/// `(n, k, kmajor)` of the row GEMMs: 16-byte loads with a partial column tile, the [K, N]
/// weight layout, and element-wise loads (odd widths) in both layouts.
const ROW_SHAPES: [(usize, usize, bool); 4] = [
    (136, 64, true),
    (72, 40, false),
    (33, 19, true),
    (21, 35, false),
];
/// `(m, n)` of the weight gradients: 16-byte loads, then element-wise.
const SUM_SHAPES: [(usize, usize); 2] = [(40, 136), (20, 33)];

/// Every shape of both kernels; the outputs compared with Σ|a·b| (plus |C|) as each element's
/// scale (bf16 × bf16 products are exact in fp32: only the order of the fp32 sums differs).
pub fn expert_gemms(g: &Gpu<'_>) -> Result<Vec<Out>> {
    let offs = offsets();
    let (groups, rows) = (COUNTS.len(), offs[COUNTS.len()] as usize);
    let od = g.up(&offs)?;
    let mut out = Vec::new();
    for (case, &(n, k, kmajor)) in ROW_SHAPES.iter().enumerate() {
        let seed = 10 * case as u64;
        let a = round_bf16(&g.rnd(rows * k, 700 + seed, 1.0));
        let b = round_bf16(&g.rnd(groups * n * k, 701 + seed, 1.0));
        // Every other shape adds onto what C holds.
        let accumulate = case % 2 == 1;
        let c0 = if accumulate {
            g.rnd(rows * n, 702 + seed, 1.0)
        } else {
            vec![0.0; rows * n]
        };
        let (mut want, mut scale) = (vec![0.0f32; rows * n], vec![0.0f32; rows * n]);
        for (ex, w) in offs.windows(2).enumerate() {
            for r in w[0] as usize..w[1] as usize {
                for col in 0..n {
                    let (mut s, mut s_abs) =
                        (f64::from(c0[r * n + col]), f64::from(c0[r * n + col].abs()));
                    for kk in 0..k {
                        let bw = match kmajor {
                            true => b[ex * n * k + col * k + kk],
                            false => b[ex * n * k + kk * n + col],
                        };
                        let t = f64::from(a[r * k + kk]) * f64::from(bw);
                        s += t;
                        s_abs += t.abs();
                    }
                    want[r * n + col] = s as f32;
                    scale[r * n + col] = s_abs as f32;
                }
            }
        }
        let (ad, bd, cd) = (g.up16(&a)?, g.up16(&b)?, g.up(&c0)?);
        let spec = ExpertRows {
            c: g.p(&cd),
            a: g.p(&ad),
            b: g.p(&bd),
            b_stride: n * k,
            b_kmajor: kmajor,
            n,
            k,
            accumulate,
        };
        g.k().expert_gemm_rows(spec, g.p(&od), rows, groups)?;
        let label = format!(
            "rows n {n} k {k}{}",
            if kmajor { " [N, K]" } else { " [K, N]" }
        );
        out.push(Out {
            scale: Some(scale),
            ..Out::new(&label, g.down(&cd)?, want)
        });
    }
    for (case, &(m, n)) in SUM_SHAPES.iter().enumerate() {
        let seed = 10 * case as u64;
        let a = round_bf16(&g.rnd(rows * m, 800 + seed, 1.0));
        let b = round_bf16(&g.rnd(rows * n, 801 + seed, 1.0));
        let c0 = g.rnd(groups * m * n, 802 + seed, 1.0);
        let (mut want, mut scale) = (vec![0.0f32; c0.len()], vec![0.0f32; c0.len()]);
        for (ex, w) in offs.windows(2).enumerate() {
            for i in 0..m {
                for j in 0..n {
                    let at = ex * m * n + i * n + j;
                    let (mut s, mut s_abs) = (f64::from(c0[at]), f64::from(c0[at].abs()));
                    for r in w[0] as usize..w[1] as usize {
                        let t = f64::from(a[r * m + i]) * f64::from(b[r * n + j]);
                        s += t;
                        s_abs += t.abs();
                    }
                    want[at] = s as f32;
                    scale[at] = s_abs as f32;
                }
            }
        }
        let (ad, bd, cd) = (g.up16(&a)?, g.up16(&b)?, g.up(&c0)?);
        let spec = ExpertSums {
            c: g.p(&cd),
            c_stride: m * n,
            a: g.p(&ad),
            b: g.p(&bd),
            m,
            n,
            accumulate: true,
        };
        g.k().expert_gemm_sums(spec, g.p(&od), groups)?;
        out.push(Out {
            scale: Some(scale),
            ..Out::new(&format!("sums m {m} n {n}"), g.down(&cd)?, want)
        });
    }
    Ok(out)
}
