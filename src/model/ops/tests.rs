use super::*;

pub(crate) fn rnd(n: usize, seed: u64) -> Vec<f32> {
    crate::util::uniform(n, seed, 1.0)
}

fn max_rel(a: &[f32], b: &[f32]) -> f32 {
    let scale = b.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
    a.iter()
        .zip(b)
        .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
        / scale
}

/// Central finite difference of a scalar f64 loss in f64-accumulated fp32 code.
fn fd_check(
    name: &str,
    x: &mut [f32],
    analytic: &[f32],
    mut loss: impl FnMut(&[f32]) -> f64,
    picks: usize,
) {
    let eps = 1e-2f32;
    let mut worst = 0.0f64;
    for p in 0..picks {
        let i = (p * 7919 + 13) % x.len();
        let orig = x[i];
        x[i] = orig + eps;
        let lp = loss(x);
        x[i] = orig - eps;
        let lm = loss(x);
        x[i] = orig;
        let num = (lp - lm) / (2.0 * f64::from(eps));
        let err = (num - f64::from(analytic[i])).abs()
            / (num.abs().max(f64::from(analytic[i]).abs()).max(1e-2));
        worst = worst.max(err);
    }
    assert!(worst < 2e-2, "{name}: finite-difference rel err {worst}");
}

#[test]
fn gemm_transposes_match_naive() {
    let (m, k, n) = (5, 7, 3);
    let a = rnd(m * k, 1);
    let b = rnd(k * n, 2);
    let mut c = vec![0.0; m * n];
    gemm(&mut c, &a, (k, 1), &b, (n, 1), m, k, n, false);
    for i in 0..m {
        for j in 0..n {
            let want: f32 = (0..k).map(|x| a[i * k + x] * b[x * n + j]).sum();
            assert!((c[i * n + j] - want).abs() < 1e-5);
        }
    }
    // Aᵀ stored as [k, m].
    let at: Vec<f32> = (0..k * m).map(|idx| a[(idx % m) * k + idx / m]).collect();
    let mut c2 = vec![0.0; m * n];
    gemm(&mut c2, &at, (1, m), &b, (n, 1), m, k, n, false);
    assert!(max_rel(&c2, &c) < 1e-6);
}

#[test]
fn tiled_attention_matches_naive_on_ragged_lengths() {
    for (t, nh, nkv) in [(1, 2, 1), (63, 4, 2), (65, 4, 4), (130, 6, 1)] {
        let s = AttnShape::causal(2, t, nh, nkv, 16);
        let (q, k, v) = (
            rnd(2 * t * nh * 16, 1),
            rnd(2 * t * nkv * 16, 2),
            rnd(2 * t * nkv * 16, 3),
        );
        // Flat rows, and a second row of documents (one of a single token) across tiles.
        let docs = [t / 3, 1, t - t / 3 - 1];
        let lens: Vec<usize> = std::iter::once(t)
            .chain(docs.into_iter().filter(|&l| l > 0))
            .collect();
        for pos in [flat_positions(2, t), document_positions(&lens)] {
            let (mut o1, mut o2) = (vec![0.0; q.len()], vec![0.0; q.len()]);
            let mut lse = vec![0.0; 2 * nh * t];
            attention_fwd(&mut o1, &mut lse, &q, &k, &v, &pos, s);
            attention_naive(&mut o2, &q, &k, &v, &pos, s);
            assert!(max_rel(&o1, &o2) < 1e-5, "t={t}: {}", max_rel(&o1, &o2));
        }
    }
}

/// Documents packed into one row: each gets what it gets alone (forward and backward, to
/// rounding: the key tiles fall differently), and changing one document's inputs changes no bit of
/// another's outputs or gradients: nothing crosses a document boundary.
#[test]
fn packed_documents_equal_separate_runs_and_never_mix() {
    let (nh, nkv, hd) = (4, 2, 8);
    let lens = [50usize, 1, 77, 2];
    let t: usize = lens.iter().sum();
    let shape = |t| AttnShape::causal(1, t, nh, nkv, hd);
    let run = |q: &[f32], k: &[f32], v: &[f32], d_o: &[f32], pos: &[u32], t: usize| {
        let s = shape(t);
        let (mut o, mut lse) = (vec![0.0; q.len()], vec![0.0; nh * t]);
        attention_fwd(&mut o, &mut lse, q, k, v, pos, s);
        let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
        let mut delta = vec![0.0; nh * t];
        attention_bwd(
            &mut dq, &mut dk, &mut dv, &mut delta, d_o, q, k, v, &o, &lse, pos, s,
        );
        [o, dq, dk, dv]
    };
    let inputs = |seed: u64| {
        (
            rnd(t * nh * hd, seed),
            rnd(t * nkv * hd, seed + 1),
            rnd(t * nkv * hd, seed + 2),
            rnd(t * nh * hd, seed + 3),
        )
    };
    let pos = document_positions(&lens);
    let (q, k, v, d_o) = inputs(11);
    let packed = run(&q, &k, &v, &d_o, &pos, t);
    // The third document's inputs replaced: the others' results keep every bit.
    let (q2, k2, v2, d_o2) = inputs(21);
    let (a, b) = (51, 128);
    let mix = |x: &[f32], y: &[f32], w: usize| -> Vec<f32> {
        let mut m = x.to_vec();
        m[a * w..b * w].copy_from_slice(&y[a * w..b * w]);
        m
    };
    let other = run(
        &mix(&q, &q2, nh * hd),
        &mix(&k, &k2, nkv * hd),
        &mix(&v, &v2, nkv * hd),
        &mix(&d_o, &d_o2, nh * hd),
        &pos,
        t,
    );
    let mut start = 0;
    for &l in &lens {
        let (qs, kvs) = (
            start * nh * hd..(start + l) * nh * hd,
            start * nkv * hd..(start + l) * nkv * hd,
        );
        let alone = run(
            &q[qs.clone()],
            &k[kvs.clone()],
            &v[kvs.clone()],
            &d_o[qs.clone()],
            &flat_positions(1, l),
            l,
        );
        for (i, ((p, o), al)) in packed.iter().zip(&other).zip(&alone).enumerate() {
            let range = if i < 2 { qs.clone() } else { kvs.clone() };
            // Relative to the whole output's scale: a one-token document's dQ is 0 up to rounding.
            let scale = p.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
            let e = p[range.clone()]
                .iter()
                .zip(al)
                .fold(0.0f32, |m, (x, y)| m.max((x - y).abs()))
                / scale;
            assert!(e < 1e-5, "document at {start} (len {l}), output {i}: {e}");
            if start != a {
                let bits = |x: &[f32]| x.iter().map(|f| f.to_bits()).collect::<Vec<_>>();
                assert_eq!(
                    bits(&p[range.clone()]),
                    bits(&o[range]),
                    "document at {start} saw another"
                );
            }
        }
        start += l;
    }
}

/// The attention backward of shape `s` (one sequence, heads 4 / kv 2 of 8) over documents of
/// `lens`, against central finite differences of Σ w ⊙ o (`seed` picks the inputs).
fn attention_fd(s: AttnShape, lens: &[usize], seed: u64) {
    let t = s.t;
    let (qn, kn) = (t * s.nh * s.hd, t * s.nkv * s.hd);
    let (mut q, mut k, mut v) = (rnd(qn, seed), rnd(kn, seed + 1), rnd(kn, seed + 2));
    let w = rnd(qn, seed + 3); // loss = Σ w ⊙ o
    let pos = document_positions(lens);
    let fwd = |q: &[f32], k: &[f32], v: &[f32]| {
        let mut o = vec![0.0; q.len()];
        let mut lse = vec![0.0; s.nh * t];
        attention_fwd(&mut o, &mut lse, q, k, v, &pos, s);
        (o, lse)
    };
    let (o, lse) = fwd(&q, &k, &v);
    let (mut dq, mut dk, mut dv) = (vec![0.0; q.len()], vec![0.0; k.len()], vec![0.0; v.len()]);
    let mut delta = vec![0.0; s.nh * t];
    attention_bwd(
        &mut dq, &mut dk, &mut dv, &mut delta, &w, &q, &k, &v, &o, &lse, &pos, s,
    );
    let loss = |o: &[f32]| {
        o.iter()
            .zip(&w)
            .map(|(a, b)| f64::from(*a) * f64::from(*b))
            .sum::<f64>()
    };
    let (k0, v0) = (k.clone(), v.clone());
    fd_check("dq", &mut q, &dq, |q| loss(&fwd(q, &k0, &v0).0), 40);
    let q0 = q.clone();
    fd_check("dk", &mut k, &dk, |k| loss(&fwd(&q0, k, &v0).0), 40);
    fd_check("dv", &mut v, &dv, |v| loss(&fwd(&q0, &k0, v).0), 40);
}

#[test]
fn attention_backward_finite_differences() {
    attention_fd(AttnShape::causal(1, 70, 4, 2, 8), &[30, 1, 39], 4);
}

#[test]
fn chunked_ce_matches_naive_and_finite_differences() {
    // Plain, and with the logits soft-capped at 0.5 (Gemma 2's final_logit_softcapping).
    for softcap in [None, Some(0.5f32)] {
        chunked_ce_case(softcap);
    }
}

fn chunked_ce_case(softcap: Option<f32>) {
    let (n, c, vocab) = (ce_chunk_rows(50) + 37, 12, 50);
    let (mut h, w) = (rnd(n * c, 1), rnd(vocab * c, 2));
    // Every seventh row is masked out (trains nothing, counts nothing).
    let targets: Vec<u32> = (0..n)
        .map(|i| match i % 7 {
            3 => IGNORE,
            _ => (i * 31 % vocab) as u32,
        })
        .collect();
    let trained = targets.iter().filter(|&&y| y != IGNORE).count();
    let (mut dh, mut dw, mut scratch) = (vec![0.0; n * c], vec![0.0; vocab * c], Vec::new());
    let scale = 1.0 / trained as f32;
    let loss = lm_head_ce(
        &mut dh,
        &mut dw,
        &h,
        &w,
        &targets,
        n,
        c,
        (vocab, softcap),
        scale,
        &mut scratch,
    ) / trained as f64;
    // Naive: full logits, log-softmax in f64.
    let naive = |h: &[f32]| {
        let mut lg = vec![0.0; n * vocab];
        logits(&mut lg, h, &w, n, c, vocab);
        if let Some(cap) = softcap {
            softcap_logits(&mut lg, cap);
        }
        (0..n)
            .filter(|&i| targets[i] != IGNORE)
            .map(|i| {
                let row = &lg[i * vocab..(i + 1) * vocab];
                let mx = row.iter().copied().fold(f32::NEG_INFINITY, f32::max) as f64;
                let z: f64 = row.iter().map(|x| (f64::from(*x) - mx).exp()).sum();
                mx + z.ln() - f64::from(row[targets[i] as usize])
            })
            .sum::<f64>()
            / trained as f64
    };
    assert!(
        (loss - naive(&h)).abs() < 1e-5 * loss.abs(),
        "{loss} vs {}",
        naive(&h)
    );
    fd_check("dh", &mut h, &dh, naive, 30);
}

#[test]
fn rmsnorm_gated_rope_backward_finite_differences() {
    let (rows, c) = (5, 24);
    // The weights `w` and Gemma's `1 + w` (weights near 0, as it starts them).
    for w_offset in [0.0f32, 1.0] {
        let (mut x, mut w) = (rnd(rows * c, 1), rnd(c, 2));
        let gy = rnd(rows * c, 3);
        let f = |x: &[f32], w: &[f32]| {
            let (mut y, mut r) = (vec![0.0; rows * c], vec![0.0; rows]);
            rmsnorm_fwd(&mut y, &mut r, x, (w, w_offset), c, 1e-5);
            (y, r)
        };
        let (_, r) = f(&x, &w);
        let (mut dx, mut dw) = (vec![0.0; rows * c], vec![0.0; c]);
        rmsnorm_bwd(&mut dx, false, &mut dw, &gy, &x, (&w, w_offset), &r, c);
        let loss = |y: &[f32]| {
            y.iter()
                .zip(&gy)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum::<f64>()
        };
        let w0 = w.clone();
        fd_check("rmsnorm dx", &mut x, &dx, |x| loss(&f(x, &w0).0), 30);
        let x0 = x.clone();
        fd_check("rmsnorm dw", &mut w, &dw, |w| loss(&f(&x0, w).0), 20);
    }
    // The offset is the norm's: y = (1 + w)·x̂, not w·x̂.
    let (x, w) = (rnd(c, 7), rnd(c, 8));
    let (mut y0, mut y1, mut r) = (vec![0.0; c], vec![0.0; c], vec![0.0; 1]);
    rmsnorm_fwd(&mut y0, &mut r, &x, (&w, 0.0), c, 1e-5);
    rmsnorm_fwd(&mut y1, &mut r, &x, (&w, 1.0), c, 1e-5);
    for j in 0..c {
        assert!((y1[j] - y0[j] - x[j] * r[0]).abs() < 1e-5, "column {j}");
    }

    for act in [MlpActivation::Silu, MlpActivation::GeluTanh] {
        let (mut g, mut u) = (rnd(60, 4), rnd(60, 5));
        let dh = rnd(60, 6);
        let (mut dg, mut du) = (vec![0.0; 60], vec![0.0; 60]);
        gated_bwd(act, &mut dg, &mut du, &dh, &g, &u);
        let sw = |g: &[f32], u: &[f32]| {
            let mut h = vec![0.0; 60];
            gated_fwd(act, &mut h, g, u);
            h.iter()
                .zip(&dh)
                .map(|(a, b)| f64::from(*a) * f64::from(*b))
                .sum::<f64>()
        };
        let u0 = u.clone();
        fd_check(&format!("{act:?} dg"), &mut g, &dg, |g| sw(g, &u0), 30);
        let g0 = g.clone();
        fd_check(&format!("{act:?} du"), &mut u, &du, |u| sw(&g0, u), 30);
    }
    // GELU-tanh against its definition at a few points (f64), and against erf GELU's shape.
    for x in [-3.0f32, -1.0, -0.1, 0.0, 0.5, 2.0, 4.0] {
        let xd = f64::from(x);
        let want = 0.5
            * xd
            * (1.0 + ((2.0 / std::f64::consts::PI).sqrt() * (xd + 0.044715 * xd.powi(3))).tanh());
        assert!(
            (f64::from(gelu_tanh(x)) - want).abs() < 1e-6,
            "gelu_tanh({x})"
        );
    }

    // RoPE is a rotation: backward(forward(x)) = x, and it preserves norms.
    let rope = Rope::new(8, 10000.0, 16);
    let x0 = rnd(2 * 16 * 3 * 8, 9);
    let mut y = x0.clone();
    rope.apply(&mut y, &flat_positions(2, 16), 3, false);
    let n0: f32 = x0.iter().map(|v| v * v).sum();
    let n1: f32 = y.iter().map(|v| v * v).sum();
    assert!((n0 - n1).abs() < 1e-4 * n0);
    rope.apply(&mut y, &flat_positions(2, 16), 3, true);
    assert!(max_rel(&y, &x0) < 1e-6);
}

#[test]
fn linear_backward_finite_differences() {
    let (n, din, dout) = (4, 6, 5);
    let (mut x, mut w, mut b) = (rnd(n * din, 1), rnd(dout * din, 2), rnd(dout, 3));
    let gy = rnd(n * dout, 4);
    let f = |x: &[f32], w: &[f32], b: &[f32]| {
        let mut y = vec![0.0; n * dout];
        linear_fwd(&mut y, x, w, Some(b), n, din, dout);
        y.iter()
            .zip(&gy)
            .map(|(a, g)| f64::from(*a) * f64::from(*g))
            .sum::<f64>()
    };
    let (mut dx, mut dw, mut db) = (vec![0.0; n * din], vec![0.0; dout * din], vec![0.0; dout]);
    linear_bwd(
        &mut dx,
        false,
        &mut dw,
        Some(&mut db),
        &gy,
        &x,
        &w,
        n,
        n,
        din,
        dout,
    );
    let (w0, b0) = (w.clone(), b.clone());
    fd_check("linear dx", &mut x, &dx, |x| f(x, &w0, &b0), 20);
    let x0 = x.clone();
    fd_check("linear dw", &mut w, &dw, |w| f(&x0, w, &b0), 20);
    fd_check("linear db", &mut b, &db, |b| f(&x0, &w0, b), 5);
}

/// A row of a product has the same bits however many rows come with it (the token-chunked
/// program depends on it): single rows and products of few outputs take the GEMM kernels too.
#[test]
fn gemm_rows_do_not_depend_on_how_many_rows_come_with_them() {
    for (k, n, transposed) in [
        (48usize, 48usize, true),
        (48, 16, true),
        (80, 53, false),
        // Deeper than one 512 block with an output of ≤ 64 columns.
        (576, 64, true),
        (896, 40, false),
    ] {
        let big = 1026;
        let a = rnd(big * k, 1);
        let b = rnd(k * n, 2);
        let b_st = if transposed { (1, k) } else { (n, 1) };
        for accumulate in [false, true] {
            let c0 = rnd(big * n, 3);
            let mut c_big = c0.clone();
            gemm(&mut c_big, &a, (k, 1), &b, b_st, big, k, n, accumulate);
            for m in [1usize, 2, 3, 7, 16, 47, 64, 513] {
                for r0 in [0usize, 512, 513] {
                    let mut c = c0[r0 * n..(r0 + m) * n].to_vec();
                    gemm(&mut c, &a[r0 * k..], (k, 1), &b, b_st, m, k, n, accumulate);
                    let want = &c_big[r0 * n..(r0 + m) * n];
                    assert!(
                        c.iter().zip(want).all(|(x, y)| x.to_bits() == y.to_bits()),
                        "k {k} n {n} m {m} at row {r0}"
                    );
                }
            }
        }
    }
}

/// Softmax attention of query row i over keys j with `i − j < w`, `j ≤ i` and the same document,
/// in f64 from an explicit mask (no `first_key`): what transformers' sliding-window mask does.
fn windowed_naive(
    q: &[f32],
    k: &[f32],
    v: &[f32],
    pos: &[u32],
    s: AttnShape,
    w: usize,
) -> Vec<f32> {
    let AttnShape {
        b, t, nh, nkv, hd, ..
    } = s;
    let mut o = vec![0.0f32; b * t * nh * hd];
    let scale = 1.0 / (hd as f64).sqrt();
    for bi in 0..b {
        for h in 0..nh {
            let kh = h / (nh / nkv);
            for i in 0..t {
                let doc_start = i - pos[bi * t + i] as usize;
                let keys: Vec<usize> = (0..=i).filter(|&j| j >= doc_start && i - j < w).collect();
                let qi = &q[((bi * t + i) * nh + h) * hd..][..hd];
                let sc: Vec<f64> = keys
                    .iter()
                    .map(|&j| {
                        let kj = &k[((bi * t + j) * nkv + kh) * hd..][..hd];
                        qi.iter()
                            .zip(kj)
                            .map(|(a, b)| f64::from(*a) * f64::from(*b))
                            .sum::<f64>()
                            * scale
                    })
                    .collect();
                let m = sc.iter().fold(f64::NEG_INFINITY, |a, &b| a.max(b));
                let e: Vec<f64> = sc.iter().map(|x| (x - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for d in 0..hd {
                    let acc: f64 = keys
                        .iter()
                        .zip(&e)
                        .map(|(&j, p)| p * f64::from(v[((bi * t + j) * nkv + kh) * hd + d]))
                        .sum();
                    o[((bi * t + i) * nh + h) * hd + d] = (acc / z) as f32;
                }
            }
        }
    }
    o
}

/// Sliding-window attention against an explicit mask: windows of one key, of fewer keys than a
/// tile and of more, over flat rows and packed documents (a document shorter than the window
/// and one starting inside a window); query ranges that start at tile multiples give the bits
/// of one call; a window at least as long as the row is plain causal attention, bit for bit.
#[test]
fn sliding_window_attention_matches_an_explicit_mask() {
    for (t, nh, nkv, w) in [
        (130usize, 4usize, 2usize, 1usize),
        (300, 4, 2, 7),
        (300, 2, 1, 128),
        (600, 4, 1, 257),
    ] {
        let hd = 16;
        let s = AttnShape::causal(2, t, nh, nkv, hd).windowed(Some(w));
        let (q, k, v) = (
            rnd(2 * t * nh * hd, 31),
            rnd(2 * t * nkv * hd, 32),
            rnd(2 * t * nkv * hd, 33),
        );
        let lens = [t, 5, t / 2, t - t / 2 - 5];
        for pos in [flat_positions(2, t), document_positions(&lens)] {
            let (mut o, mut lse) = (vec![0.0; q.len()], vec![0.0; 2 * nh * t]);
            attention_fwd(&mut o, &mut lse, &q, &k, &v, &pos, s);
            let want = windowed_naive(&q, &k, &v, &pos, s, w);
            assert!(
                max_rel(&o, &want) < 1e-5,
                "t {t} w {w}: {}",
                max_rel(&o, &want)
            );
            // Queries in two calls, split at a tile boundary: the same bits.
            let cut = ATTN_TILE.min(t);
            let mut parts = vec![0.0f32; q.len()];
            for (q0, q1) in [(0, cut), (cut, t)] {
                let part = s.queries(q0, q1);
                let rows: Vec<f32> = (0..2)
                    .flat_map(|bi| q[(bi * t + q0) * nh * hd..(bi * t + q1) * nh * hd].to_vec())
                    .collect();
                let mut o_part = vec![0.0; rows.len()];
                let mut lse_part = vec![0.0; 2 * nh * (q1 - q0)];
                attention_fwd(&mut o_part, &mut lse_part, &rows, &k, &v, &pos, part);
                for bi in 0..2 {
                    let n = (q1 - q0) * nh * hd;
                    parts[(bi * t + q0) * nh * hd..][..n].copy_from_slice(&o_part[bi * n..][..n]);
                }
            }
            assert!(
                parts
                    .iter()
                    .zip(&o)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "t {t} w {w}: split queries"
            );
        }
        if w == 1 {
            // Only itself: the output is its own value row.
            let (mut o, mut lse) = (vec![0.0; q.len()], vec![0.0; 2 * nh * t]);
            attention_fwd(&mut o, &mut lse, &q, &k, &v, &flat_positions(2, t), s);
            let own = (nh / nkv, hd);
            for r in 0..2 * t {
                for h in 0..nh {
                    let kh = h / own.0;
                    let (a, b) = (
                        &o[(r * nh + h) * hd..][..hd],
                        &v[(r * nkv + kh) * hd..][..hd],
                    );
                    assert!(a.iter().zip(b).all(|(x, y)| (x - y).abs() < 1e-6));
                }
            }
        }
    }
    let s = AttnShape::causal(1, 200, 4, 2, 8);
    let (q, k, v) = (rnd(200 * 32, 41), rnd(200 * 16, 42), rnd(200 * 16, 43));
    let pos = document_positions(&[120, 80]);
    let run = |s: AttnShape| {
        let (mut o, mut lse) = (vec![0.0; q.len()], vec![0.0; 4 * 200]);
        attention_fwd(&mut o, &mut lse, &q, &k, &v, &pos, s);
        o.iter().map(|x| x.to_bits()).collect::<Vec<_>>()
    };
    assert_eq!(run(s.windowed(Some(200))), run(s));
    assert_ne!(run(s.windowed(Some(50))), run(s));
}

/// The windowed backward by finite differences, across documents and window edges.
#[test]
fn sliding_window_backward_finite_differences() {
    attention_fd(
        AttnShape::causal(1, 90, 4, 2, 8).windowed(Some(9)),
        &[40, 3, 47],
        44,
    );
}

/// Soft-capped scores (Gemma 2's `attn_logit_softcapping`): the tiled forward against the naive
/// one (which caps each score as transformers does), a cap that bends the scores changing the
/// output, and the backward by finite differences — with a window and documents too.
#[test]
fn soft_capped_attention_matches_naive_and_finite_differences() {
    let (t, nh, nkv, hd) = (70, 4, 2, 16);
    let base = AttnShape::causal(2, t, nh, nkv, hd);
    // Scores of order 3 (q, k ~ 2·rnd): a cap of 1 bends them hard.
    let (q, k, v) = (
        rnd(2 * t * nh * hd, 1)
            .iter()
            .map(|x| 8.0 * x)
            .collect::<Vec<_>>(),
        rnd(2 * t * nkv * hd, 2)
            .iter()
            .map(|x| 8.0 * x)
            .collect::<Vec<_>>(),
        rnd(2 * t * nkv * hd, 3),
    );
    let pos = document_positions(&[t, 20, 1, t - 21]);
    let run = |s: AttnShape| {
        let (mut o, mut lse) = (vec![0.0; q.len()], vec![0.0; 2 * nh * t]);
        attention_fwd(&mut o, &mut lse, &q, &k, &v, &pos, s);
        o
    };
    for s in [
        base.softcapped(Some(1.0)),
        base.softcapped(Some(1.0)).windowed(Some(9)),
    ] {
        let mut want = vec![0.0; q.len()];
        attention_naive(&mut want, &q, &k, &v, &pos, s);
        let got = run(s);
        assert!(max_rel(&got, &want) < 1e-5, "{}", max_rel(&got, &want));
        assert!(
            max_rel(&got, &run(s.softcapped(None))) > 1e-2,
            "the cap bends the scores"
        );
    }
    attention_fd(
        AttnShape::causal(1, 90, 4, 2, 8).softcapped(Some(0.3)),
        &[40, 3, 47],
        45,
    );
    attention_fd(
        AttnShape::causal(1, 90, 4, 2, 8)
            .windowed(Some(9))
            .softcapped(Some(0.3)),
        &[90],
        46,
    );
}
