use super::*;
use crate::model::ops::bf16_value;

fn rand_vec(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    crate::util::uniform(n, seed, scale)
}

#[derive(Clone)]
struct Case {
    s: MoeShape,
    n: usize,
    h: Vec<f32>,
    router: Vec<f32>,
    gate_up: Vec<f32>,
    down: Vec<f32>,
    /// Router, gate/up and down biases (GPT-OSS's layout only).
    biases: [Vec<f32>; 3],
}

fn case(norm_topk: bool, act: MlpActivation) -> Case {
    let s = MoeShape {
        c: 12,
        experts: 10,
        top_k: 2,
        inter: 8,
        norm_topk,
        router: Router::SoftmaxTopK,
        layout: ExpertLayout::GateUpRows,
        act: ExpertAct::Gated(act),
    };
    let n = 4;
    Case {
        s,
        n,
        h: rand_vec(n * s.c, 1, 1.0),
        router: rand_vec(s.experts * s.c, 2, 0.8),
        gate_up: rand_vec(s.experts * 2 * s.inter * s.c, 3, 0.3),
        down: rand_vec(s.experts * s.c * s.inter, 4, 0.3),
        biases: [Vec::new(), Vec::new(), Vec::new()],
    }
}

/// GPT-OSS's variant: top-k logits then their softmax, transposed interleaved experts with
/// biases, the SwiGLU clamped where these activations reach (0.25).
fn gpt_oss_case() -> Case {
    let mut c = case(false, MlpActivation::Silu);
    c.s.router = Router::TopKSoftmax;
    c.s.layout = ExpertLayout::InterleavedColumns;
    c.s.act = ExpertAct::ClampedSwiglu {
        alpha: 1.702,
        limit: 0.25,
    };
    let (e, i, cc) = (c.s.experts, c.s.inter, c.s.c);
    c.biases = [
        rand_vec(e, 5, 0.3),
        rand_vec(e * 2 * i, 6, 0.3),
        rand_vec(e * cc, 7, 0.3),
    ];
    c
}

impl Case {
    fn weights(&self) -> MoeWeights<'_> {
        let [b0, b1, b2] = &self.biases;
        MoeWeights {
            router: &self.router,
            gate_up: &self.gate_up,
            down: &self.down,
            biases: self.s.biases().then_some([&b0[..], &b1[..], &b2[..]]),
            bf16_recipe: false,
        }
    }

    /// Σ out ⊙ r for a fixed r: a scalar loss.
    fn loss(&self, r: &[f32]) -> f64 {
        let mut out = vec![0f32; self.n * self.s.c];
        moe_fwd(&mut out, &self.h, &self.weights(), self.n, self.s);
        out.iter().zip(r).map(|(a, b)| *a as f64 * *b as f64).sum()
    }
}

/// The gradients of one backward.
struct Grads {
    dh: Vec<f32>,
    router: Vec<f32>,
    gate_up: Vec<f32>,
    down: Vec<f32>,
    biases: [Vec<f32>; 3],
}

impl Case {
    /// `moe_bwd` of `Σ out ⊙ r` (plus the load-balancing term `aux`) from zeroed gradients.
    fn backward(&self, r: &[f32], aux: Option<AuxGrad<'_>>) -> Grads {
        let s = self.s;
        let mut g = Grads {
            dh: vec![0f32; self.n * s.c],
            router: vec![0f32; self.router.len()],
            gate_up: vec![0f32; self.gate_up.len()],
            down: vec![0f32; self.down.len()],
            biases: self.biases.clone().map(|b| vec![0f32; b.len()]),
        };
        let [b0, b1, b2] = &mut g.biases;
        let grads = MoeGrads {
            router: &mut g.router,
            gate_up: &mut g.gate_up,
            down: &mut g.down,
            biases: s
                .biases()
                .then_some([&mut b0[..], &mut b1[..], &mut b2[..]]),
        };
        moe_bwd(
            &mut g.dh,
            grads,
            r,
            &self.h,
            &self.weights(),
            self.n,
            s,
            aux,
        );
        g
    }
}

/// Token by token, in f64: softmax, top k, each chosen expert's MLP. `bf16`: the bf16 recipe's
/// roundings ([`MoeWeights::bf16_recipe`]: the weights are taken as bf16 values already) — the
/// input and the activation rounded to bf16, as fp32 values, before their GEMMs.
fn naive(c: &Case, bf16: bool) -> Vec<f64> {
    let s = c.s;
    let (cc, i, e) = (s.c, s.inter, s.experts);
    let round = |v: f32| if bf16 { bf16_value(v) } else { v };
    let mut out = vec![0f64; c.n * cc];
    for t in 0..c.n {
        let h: Vec<f32> = c.h[t * cc..(t + 1) * cc]
            .iter()
            .map(|v| round(*v))
            .collect();
        let z: Vec<f64> = (0..e)
            .map(|x| {
                (0..cc)
                    .map(|j| h[j] as f64 * c.router[x * cc + j] as f64)
                    .sum()
            })
            .collect();
        let max = z.iter().cloned().fold(f64::MIN, f64::max);
        let p: Vec<f64> = z.iter().map(|v| (v - max).exp()).collect();
        let sum: f64 = p.iter().sum();
        let p: Vec<f64> = p.iter().map(|v| v / sum).collect();
        let mut order: Vec<usize> = (0..e).collect();
        order.sort_by(|a, b| p[*b].total_cmp(&p[*a]));
        let chosen = &order[..s.top_k];
        let total: f64 = chosen.iter().map(|&x| p[x]).sum();
        for &x in chosen {
            let wt = if s.norm_topk { p[x] / total } else { p[x] };
            let gu = &c.gate_up[x * 2 * i * cc..];
            let act: Vec<f64> = (0..i)
                .map(|r| {
                    let g: f64 = (0..cc).map(|j| h[j] as f64 * gu[r * cc + j] as f64).sum();
                    let u: f64 = (0..cc)
                        .map(|j| h[j] as f64 * gu[(i + r) * cc + j] as f64)
                        .sum();
                    match s.act {
                        ExpertAct::Gated(MlpActivation::Silu) => g / (1.0 + (-g).exp()) * u,
                        ExpertAct::Gated(MlpActivation::GeluTanh) => {
                            super::super::gelu_tanh(g as f32) as f64 * u
                        }
                        ExpertAct::ClampedSwiglu { .. } => unreachable!("not in these cases"),
                    }
                })
                .map(|a| round(a as f32) as f64)
                .collect();
            let d = &c.down[x * cc * i..];
            for o in 0..cc {
                let y: f64 = (0..i).map(|r| act[r] * d[o * i + r] as f64).sum();
                out[t * cc + o] += wt * y;
            }
        }
    }
    out
}

#[test]
fn forward_matches_a_token_by_token_computation() {
    for norm in [false, true] {
        let c = case(norm, MlpActivation::Silu);
        let mut out = vec![0f32; c.n * c.s.c];
        let r = moe_fwd(&mut out, &c.h, &c.weights(), c.n, c.s);
        let want = naive(&c, false);
        for (a, b) in out.iter().zip(&want) {
            assert!((*a as f64 - b).abs() < 1e-5 * (1.0 + b.abs()), "{a} vs {b}");
        }
        assert_eq!(r.counts().iter().sum::<usize>(), c.n * c.s.top_k);
        let chosen_once = (0..c.n).all(|t| r.expert[t * 2] != r.expert[t * 2 + 1]);
        assert!(chosen_once);
    }
}

/// The bf16 recipe: the input rows and the activation rounded before their GEMMs (weights
/// already bf16 values), equal to the token-by-token recipe and not to the fp32 op.
#[test]
fn the_bf16_recipe_rounds_the_input_and_the_activation() {
    for norm in [false, true] {
        let mut c = case(norm, MlpActivation::Silu);
        for w in [&mut c.router, &mut c.gate_up, &mut c.down] {
            w.iter_mut().for_each(|v| *v = bf16_value(*v));
        }
        let run = |bf16: bool| {
            let mut out = vec![0f32; c.n * c.s.c];
            let w = MoeWeights {
                bf16_recipe: bf16,
                ..c.weights()
            };
            moe_fwd(&mut out, &c.h, &w, c.n, c.s);
            out
        };
        let (got, fp32) = (run(true), run(false));
        let want = naive(&c, true);
        let far = |a: &[f32], tol: f64| {
            a.iter()
                .zip(&want)
                .any(|(a, b)| (*a as f64 - b).abs() > tol * (1.0 + b.abs()))
        };
        assert!(!far(&got, 1e-5), "{got:?} vs {want:?}");
        assert!(far(&fp32, 1e-4), "the roundings matter in this case");
    }
}

#[test]
fn gradients_match_finite_differences_and_an_unchosen_expert_gets_none() {
    for c in [
        case(true, MlpActivation::Silu),
        case(false, MlpActivation::GeluTanh),
        gpt_oss_case(),
    ] {
        let s = c.s;
        let r = rand_vec(c.n * s.c, 9, 1.0);
        let routing = moe_fwd(&mut vec![0f32; c.n * s.c], &c.h, &c.weights(), c.n, s);
        let Grads {
            dh,
            router: gr,
            gate_up: ggu,
            down: gd,
            biases: gb,
        } = c.backward(&r, None);
        assert!(routing.counts().contains(&0), "{:?}", routing.counts());
        for (ex, &count) in routing.counts().iter().enumerate() {
            let block = 2 * s.inter * s.c;
            let zero = ggu[ex * block..(ex + 1) * block].iter().all(|&g| g == 0.0);
            assert_eq!(zero, count == 0, "expert {ex} with {count} tokens");
        }
        // Central differences (f32 forward, steps small enough to keep every routing).
        let eps = 1e-3f32;
        let check = |c: &Case, which: usize, idx: usize, analytic: f32| {
            let at = |delta: f32| {
                let mut d = c.clone();
                let t = match which {
                    0 => &mut d.h,
                    1 => &mut d.router,
                    2 => &mut d.gate_up,
                    3 => &mut d.down,
                    b => &mut d.biases[b - 4],
                };
                t[idx] += delta;
                d.loss(&r)
            };
            let numeric = (at(eps) - at(-eps)) / (2.0 * eps as f64);
            assert!(
                (numeric - analytic as f64).abs() < 2e-2 * (1.0 + numeric.abs()),
                "tensor {which}[{idx}]: numeric {numeric} analytic {analytic}"
            );
        };
        for idx in [0, 5, 13, 40, 77] {
            check(&c, 0, idx % dh.len(), dh[idx % dh.len()]);
            check(&c, 1, idx % c.router.len(), gr[idx % gr.len()]);
            check(&c, 2, idx * 7 % ggu.len(), ggu[idx * 7 % ggu.len()]);
            check(&c, 3, idx * 5 % gd.len(), gd[idx * 5 % gd.len()]);
            if s.biases() {
                for (b, g) in gb.iter().enumerate() {
                    check(&c, 4 + b, idx * 3 % g.len(), g[idx * 3 % g.len()]);
                }
            }
        }
    }
}

/// The load-balancing loss at its two ends: every expert equally loaded with uniform
/// probabilities gives k, every token on the same k experts (probability 1/k each) gives E —
/// transformers' `E·Σ f_e·P_e` over the rows of two layers.
#[test]
fn aux_loss_is_k_when_balanced_and_e_when_collapsed() {
    let (e, k, n) = (8usize, 2usize, 16usize);
    let uniform = vec![1.0 / e as f32; n * e];
    let balanced: Vec<u32> = (0..n * k).map(|s| (s % e) as u32).collect();
    let mut t = RouterTally::default();
    for layer in [0, 3] {
        t.add(layer, &ExpertLoad::of(&balanced, &uniform, n, e, None));
    }
    assert!((t.aux_loss() - k as f64).abs() < 1e-6, "{}", t.aux_loss());
    assert_eq!(t.layers[&3].max_over_mean(), 1.0);
    assert_eq!(t.layers[&3].unused(), 0);
    let collapsed: Vec<u32> = (0..n * k).map(|s| (s % k) as u32).collect();
    let mut probs = vec![0f32; n * e];
    for row in probs.chunks_mut(e) {
        row[..k].fill(1.0 / k as f32);
    }
    let mut t = RouterTally::default();
    t.add(0, &ExpertLoad::of(&collapsed, &probs, n, e, None));
    assert!((t.aux_loss() - e as f64).abs() < 1e-6, "{}", t.aux_loss());
    assert_eq!(t.layers[&0].max_over_mean(), (e / k) as f64);
    assert_eq!(t.layers[&0].unused(), e - k);
}

/// Padding rows count in no part of the load: the load of a call with padding is the load of
/// its data rows alone.
#[test]
fn padding_rows_are_not_in_the_load() {
    let (e, k, n) = (6usize, 2usize, 10usize);
    let expert: Vec<u32> = (0..n * k).map(|s| ((s * 7 + 3) % e) as u32).collect();
    let probs = rand_vec(n * e, 5, 1.0);
    let pad: Vec<u8> = (0..n).map(|r| u8::from(r % 3 == 1 || r >= 8)).collect();
    let data: Vec<usize> = (0..n).filter(|&r| pad[r] == 0).collect();
    let sub_expert: Vec<u32> = data
        .iter()
        .flat_map(|&r| expert[r * k..(r + 1) * k].to_vec())
        .collect();
    let sub_probs: Vec<f32> = data
        .iter()
        .flat_map(|&r| probs[r * e..(r + 1) * e].to_vec())
        .collect();
    let want = ExpertLoad::of(&sub_expert, &sub_probs, data.len(), e, None);
    assert_eq!(ExpertLoad::of(&expert, &probs, n, e, Some(&pad)), want);
    assert_eq!(want.rows, data.len() as u64);
    let counts = ExpertLoad::counts(&expert, n, e, Some(&pad));
    assert_eq!((counts.tokens, counts.rows), (want.tokens, want.rows));
    // With no padding flagged, every row counts.
    let zeros = vec![0u8; n];
    assert_eq!(
        ExpertLoad::of(&expert, &probs, n, e, Some(&zeros)),
        ExpertLoad::of(&expert, &probs, n, e, None)
    );
}

/// Σ out ⊙ r + λ·aux through `moe_bwd(…, aux)`: the router's (and its bias's) gradient and the
/// input's match central differences of the whole objective, for both routers (the aux loss
/// takes the softmax over every expert even where GPT-OSS picks by the logits), with and
/// without padding rows (which take no part in the aux loss).
#[test]
fn the_load_balancing_gradient_matches_finite_differences() {
    let lambda = 0.7f64;
    for (c, padded) in [
        (case(true, MlpActivation::Silu), false),
        (gpt_oss_case(), false),
        (case(true, MlpActivation::Silu), true),
    ] {
        let s = c.s;
        let r = rand_vec(c.n * s.c, 11, 1.0);
        let pad: Option<Vec<u8>> = padded.then(|| (0..c.n).map(|t| u8::from(t % 2 == 1)).collect());
        let objective = |c: &Case| {
            let mut out = vec![0f32; c.n * s.c];
            let routing = moe_fwd(&mut out, &c.h, &c.weights(), c.n, s);
            let mut t = RouterTally::default();
            t.add(
                0,
                &ExpertLoad::of(
                    &routing.expert,
                    &routing.probs,
                    c.n,
                    s.experts,
                    pad.as_deref(),
                ),
            );
            let main: f64 = out.iter().zip(&r).map(|(a, b)| *a as f64 * *b as f64).sum();
            (main + lambda * t.aux_loss(), t)
        };
        let (_, tally) = objective(&c);
        let aux = tally.aux_grad(lambda);
        let aux = AuxGrad {
            per_expert: &aux,
            pad: pad.as_deref(),
        };
        let Grads {
            dh,
            router: gr,
            biases: gb,
            ..
        } = c.backward(&r, Some(aux));
        let eps = 1e-3f32;
        let fd = |which: usize, idx: usize| {
            let at = |delta: f32| {
                let mut d = c.clone();
                match which {
                    0 => d.h[idx] += delta,
                    1 => d.router[idx] += delta,
                    _ => d.biases[0][idx] += delta,
                }
                objective(&d).0
            };
            (at(eps) - at(-eps)) / (2.0 * eps as f64)
        };
        let mut checked = 0;
        for (which, grads) in [(0, &dh), (1, &gr), (2, &gb[0])] {
            for idx in (0..grads.len()).step_by(7) {
                let (numeric, analytic) = (fd(which, idx), grads[idx] as f64);
                assert!(
                    (numeric - analytic).abs() < 2e-2 * (1.0 + numeric.abs()),
                    "{:?} tensor {which}[{idx}]: numeric {numeric} analytic {analytic}",
                    s.router
                );
                checked += 1;
            }
        }
        assert!(checked > 20);
        // Without the aux term the router's gradient differs: the check above sees it.
        let gr0 = c.backward(&r, None).router;
        let moved = gr
            .iter()
            .zip(&gr0)
            .map(|(a, b)| (a - b).abs())
            .fold(0f32, f32::max);
        assert!(
            moved > 1e-2,
            "the aux term moved the router's gradient by {moved}"
        );
    }
}

#[test]
fn the_tiled_transpose_is_a_transpose() {
    for (n, k) in [(1, 1), (3, 17), (16, 16), (33, 70), (128, 40)] {
        let src = rand_vec(n * k, 21, 1.0);
        let mut dst = vec![0f32; n * k];
        transpose(&mut dst, &src, n, k);
        for j in 0..n {
            for p in 0..k {
                assert_eq!(dst[p * n + j], src[j * k + p], "{n}×{k} at {j},{p}");
            }
        }
    }
}
