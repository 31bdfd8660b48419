//! The layer templates against Hugging Face transformers (goldens from tools/golden_model.py):
//! logits, loss, every gradient, and a few AdamW steps, for MHA, GQA, MQA, tied, Qwen2 bias and
//! Mistral configs at sequence lengths that are not a multiple of the attention tile.
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

use common::{rel_err, Golden};
use megatrain::model::config::ModelConfig;
use megatrain::model::layers::Workspace;
use megatrain::model::ops::flat_positions;
use megatrain::model::reference::{forward_logits, step_resident, Templates};
use megatrain::optim::adamw::{self, AdamSlices, AdamWConfig};
use megatrain::optim::unit_segments;
use megatrain::store::layout::{Mode, StateLayout};

const TOL: f32 = 1e-5;

struct Case {
    g: Golden,
    layout: StateLayout,
    b: usize,
    t: usize,
}

fn load(case: &str) -> Case {
    let g = Golden::open(&format!("model_{case}.safetensors"));
    let cfg = ModelConfig::from_json_str(&g.meta["config"], case).unwrap();
    let layout = StateLayout::new(&cfg, Mode::Exact);
    let (b, t) = (
        g.meta["batch"].parse().unwrap(),
        g.meta["seq"].parse().unwrap(),
    );
    Case { g, layout, b, t }
}

/// Unit shards filled from the golden's `{prefix}.{hf_name}` tensors.
fn units(c: &Case, prefix: &str) -> Vec<Vec<f32>> {
    let mut u: Vec<Vec<f32>> = c.layout.units.iter().map(|u| vec![0.0; u.numel]).collect();
    let names: Vec<String> = serde_json::from_str(&c.g.meta["params"]).unwrap();
    assert_eq!(
        names.len(),
        c.layout.manifest.len(),
        "parameter sets differ"
    );
    for name in names {
        let (unit, spec) = c.layout.tensor(&name).unwrap();
        let key = format!("{prefix}.{name}");
        assert_eq!(c.g.shape(&key), &spec.shape[..], "{name}");
        u[unit][spec.offset..spec.offset + spec.numel()].copy_from_slice(c.g.get(&key));
    }
    u
}

fn tokens(c: &Case, key: &str) -> Vec<u32> {
    c.g.get(key).iter().map(|&x| x as u32).collect()
}

/// One resident forward + backward over the golden batch: mean loss, gradients into `grads`.
fn mean_loss_and_grads(
    c: &Case,
    tm: &Templates,
    params: &[Vec<f32>],
    grads: &mut [Vec<f32>],
    toks: &[u32],
    tgts: &[u32],
    ws: &mut Workspace,
) -> f64 {
    let n = c.b * c.t;
    let refs: Vec<&[f32]> = params.iter().map(|v| &v[..]).collect();
    let mut gr: Vec<&mut [f32]> = grads.iter_mut().map(|v| &mut v[..]).collect();
    let pos = flat_positions(c.b, c.t);
    step_resident(
        tm,
        &refs,
        &mut gr,
        toks,
        tgts,
        &pos,
        c.b,
        c.t,
        1.0 / n as f32,
        ws,
    )
    .unwrap()
        / n as f64
}

/// The worst relative error of the logits and of every gradient against the golden's.
fn worst_error(c: &Case) -> f32 {
    let tm = Templates::new(&c.layout.config, c.t).unwrap();
    let mut ws = Workspace::new(&c.layout.config, c.b, c.t);
    let params = units(c, "param");
    let (toks, tgts) = (tokens(c, "tokens"), tokens(c, "targets"));
    let refs: Vec<&[f32]> = params.iter().map(|v| &v[..]).collect();
    let pos = flat_positions(c.b, c.t);
    let logits = forward_logits(&tm, &refs, &toks, &pos, c.b, c.t, &mut ws).unwrap();
    let mut worst = rel_err(&logits, c.g.get("logits"), 1e-6);
    let mut grads: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
    mean_loss_and_grads(c, &tm, &params, &mut grads, &toks, &tgts, &mut ws);
    for (name, loc) in &c.layout.manifest {
        let spec = &c.layout.units[loc.unit].tensors[loc.index];
        let ours = &grads[loc.unit][spec.offset..spec.offset + spec.numel()];
        worst = worst.max(rel_err(ours, c.g.get(&format!("grad.{name}")), 1e-6));
    }
    worst
}

fn check_case(case: &str) {
    let c = load(case);
    let tm = Templates::new(&c.layout.config, c.t).unwrap();
    let mut ws = Workspace::new(&c.layout.config, c.b, c.t);
    let mut params = units(&c, "param");
    let (toks, tgts) = (tokens(&c, "tokens"), tokens(&c, "targets"));

    let refs: Vec<&[f32]> = params.iter().map(|v| &v[..]).collect();
    let pos = flat_positions(c.b, c.t);
    let logits = forward_logits(&tm, &refs, &toks, &pos, c.b, c.t, &mut ws).unwrap();
    let e = rel_err(&logits, c.g.get("logits"), 1e-6);
    assert!(e < TOL, "{case}: logits rel err {e:e}");

    let mut grads: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
    let loss = mean_loss_and_grads(&c, &tm, &params, &mut grads, &toks, &tgts, &mut ws);
    let want = f64::from(c.g.get("loss")[0]);
    assert!(
        ((loss - want) / want).abs() < 1e-6,
        "{case}: loss {loss} vs {want}"
    );
    let mut worst = 0.0f32;
    for (name, loc) in &c.layout.manifest {
        let spec = &c.layout.units[loc.unit].tensors[loc.index];
        let ours = &grads[loc.unit][spec.offset..spec.offset + spec.numel()];
        let e = rel_err(ours, c.g.get(&format!("grad.{name}")), 1e-6);
        assert!(e < TOL, "{case}: grad {name} rel err {e:e}");
        worst = worst.max(e);
    }
    eprintln!(
        "{case}: loss {loss:.6} (torch {want:.6}), logits err {:e}, worst grad err {worst:e}",
        rel_err(&logits, c.g.get("logits"), 1e-6)
    );

    // A few AdamW steps on the same batch.
    let a: serde_json::Value = serde_json::from_str(&c.g.meta["adamw"]).unwrap();
    let cfg = AdamWConfig {
        lr: a["lr"].as_f64().unwrap(),
        beta1: a["betas"][0].as_f64().unwrap(),
        beta2: a["betas"][1].as_f64().unwrap(),
        eps: a["eps"].as_f64().unwrap(),
        weight_decay: a["weight_decay"].as_f64().unwrap(),
    };
    let mut m: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
    let mut v = m.clone();
    let step_loss = c.g.get("step_loss").to_vec();
    for (s, want) in step_loss.iter().enumerate() {
        grads.iter_mut().for_each(|g| g.fill(0.0));
        let loss = mean_loss_and_grads(&c, &tm, &params, &mut grads, &toks, &tgts, &mut ws);
        assert!(
            ((loss - f64::from(*want)) / f64::from(*want)).abs() < 1e-5,
            "{case}: step {s} loss {loss} vs {want}"
        );
        for u in 0..params.len() {
            for seg in unit_segments(&c.layout, u, &cfg, s as u64 + 1, 1.0, true) {
                let r = seg.start..seg.end;
                adamw::step(
                    AdamSlices {
                        p: &mut params[u][r.clone()],
                        g: &grads[u][r.clone()],
                        m: &mut m[u][r.clone()],
                        v: &mut v[u][r],
                    },
                    &seg.scalars,
                );
            }
        }
    }
    // AdamW divides each gradient element by its own running RMS, so an element whose gradient is
    // near eps (1e-8; here down to 1e-8 while the fp32 gradients agree to ~5e-9 absolute) turns
    // rounding noise into a visible fraction of its ±lr step. Such ill-conditioned elements
    // (|g| < 1e-4·max|g|) are held to the size of their updates; all others to 1e-5 relative.
    let fin = units(&c, "final");
    let mut ill = 0usize;
    for (name, loc) in &c.layout.manifest {
        let spec = &c.layout.units[loc.unit].tensors[loc.index];
        let r = spec.offset..spec.offset + spec.numel();
        let (ours, want) = (&params[loc.unit][r.clone()], &fin[loc.unit][r]);
        let g0 = c.g.get(&format!("grad.{name}"));
        let gmax = g0.iter().fold(0.0f32, |m, x| m.max(x.abs()));
        let pmax = want.iter().fold(1e-6f32, |m, x| m.max(x.abs()));
        for i in 0..ours.len() {
            let err = (ours[i] - want[i]).abs();
            if g0[i].abs() < 1e-4 * gmax {
                ill += 1;
                let bound = 2.0 * step_loss.len() as f32 * cfg.lr as f32;
                assert!(
                    err <= bound,
                    "{case}: final {name}[{i}] off by {err:e} > update bound {bound:e}"
                );
            } else {
                assert!(
                    err <= TOL * pmax,
                    "{case}: final {name}[{i}] rel err {:e} (g={:e})",
                    err / pmax,
                    g0[i]
                );
            }
        }
    }
    eprintln!("{case}: {ill} ill-conditioned elements held to the update size");
}

#[test]
fn mha() {
    check_case("mha");
}
#[test]
fn gqa() {
    check_case("gqa");
}
#[test]
fn mqa() {
    check_case("mqa");
}
#[test]
fn tied() {
    check_case("tied");
}
#[test]
fn qwen2_bias() {
    check_case("qwen2");
}
#[test]
fn mistral() {
    check_case("mistral");
}

/// Llama 3.1's RoPE scaling (`rope_type` llama3) over a 64-token pretraining context.
#[test]
fn llama31_rope_scaling() {
    check_case("llama31");
}

/// YaRN (Qwen2 with `rope_type` yarn over 32 tokens: blended frequencies, cos and sin × 1.139).
#[test]
fn yarn_rope_scaling() {
    check_case("yarn");
}

/// Qwen3: QK-norm (a per-head RMSNorm of q and k before RoPE, weights far from 1) and a head
/// dimension (12) that is not hidden / heads (8).
#[test]
fn qwen3_qk_norm() {
    check_case("qwen3");
}

/// Mistral with a sliding window of 7 over 40 tokens: every query from the 8th on sees only
/// its window.
#[test]
fn mistral_sliding_window() {
    check_case("mistral_window");
}

/// Qwen2 with `use_sliding_window` and `max_window_layers` 1: layer 0 full, layer 1 a window of
/// 5 over 50 tokens.
#[test]
fn qwen2_window_on_some_layers() {
    check_case("qwen2_window");
}

/// Ministral: the window (7 of 40) on layer 0 only, as `layer_types` says.
#[test]
fn ministral_window_on_some_layers() {
    check_case("ministral_window");
}

/// Gemma 3 text: `1 + w` norms (weights around 0), sandwich norms, QK-norm, GELU-tanh,
/// embeddings × √hidden, attention scale `query_pre_attn_scalar^-½`, a local layer (window 7
/// of 40, its own RoPE θ) and a global one (linear RoPE), tied, padding index 0.
#[test]
fn gemma3_text() {
    check_case("gemma3");
}

/// Each Gemma 3 feature moves the numbers: the golden fails with any one of them switched off.
#[test]
fn gemma3_golden_fails_without_each_feature() {
    use megatrain::model::config::{MlpActivation, NormWeight};
    let base = load("gemma3").layout.config;
    let off: Vec<(&str, ModelConfig)> = vec![
        (
            "1 + w norms",
            ModelConfig {
                norm_weight: NormWeight::Scale,
                ..base.clone()
            },
        ),
        (
            "GELU-tanh",
            ModelConfig {
                mlp_activation: MlpActivation::Silu,
                ..base.clone()
            },
        ),
        (
            "embedding scale",
            ModelConfig {
                scale_embeddings: false,
                ..base.clone()
            },
        ),
        (
            "attention scale",
            ModelConfig {
                query_pre_attn_scalar: None,
                ..base.clone()
            },
        ),
        (
            "local RoPE",
            ModelConfig {
                local_rope: None,
                ..base.clone()
            },
        ),
        (
            "sliding window",
            ModelConfig {
                sliding_window: None,
                ..base.clone()
            },
        ),
        (
            "padding index",
            ModelConfig {
                pad_token_id: None,
                ..base.clone()
            },
        ),
    ];
    fails_without("gemma3", off);
}

/// The golden of `case` fails (100× its tolerance) under each of `variants` (what is switched
/// off, and the config without it).
fn fails_without(case: &str, variants: Vec<(&str, ModelConfig)>) {
    let c = load(case);
    for (what, cfg) in variants {
        let layout = StateLayout::new(&cfg, Mode::Exact);
        let changed = Case {
            g: Golden::open(&format!("model_{case}.safetensors")),
            layout,
            b: c.b,
            t: c.t,
        };
        let err = worst_error(&changed);
        assert!(
            err > 100.0 * TOL,
            "{case}: {what} switched off still matches ({err:e})"
        );
    }
}

/// Gemma 2: Gemma 3's block without QK-norm, one RoPE, attention scores and logits soft-capped
/// (at 0.2 and 0.5: these scores and logits bend there); the golden fails with either cap off.
#[test]
fn gemma2_soft_capping() {
    check_case("gemma2");
    let base = load("gemma2").layout.config;
    let off = vec![
        (
            "attention soft cap",
            ModelConfig {
                attn_logit_softcapping: None,
                ..base.clone()
            },
        ),
        (
            "logit soft cap",
            ModelConfig {
                final_logit_softcapping: None,
                ..base
            },
        ),
    ];
    fails_without("gemma2", off);
}

/// RoPE at long positions (up to 2^19, beyond 2^16) against transformers' LlamaRotaryEmbedding
/// (tools/golden_rope.py): the angle is one fp32 product as there, so the tables agree to the
/// last bits of cos/sin (two libraries' fp32 cos/sin of the same argument).
#[test]
fn rope_at_long_positions_matches_transformers() {
    let g = common::Golden::open("rope_long.safetensors");
    for (case, hd, theta) in [("hd128_theta5e5", 128, 5e5), ("hd64_theta1e4", 64, 1e4)] {
        let positions = g.get(&format!("{case}.positions"));
        let (want_cos, want_sin) = (g.get(&format!("{case}.cos")), g.get(&format!("{case}.sin")));
        let half = hd / 2;
        let mut worst = 0.0f32;
        for (r, &p) in positions.iter().enumerate() {
            let (cos, sin) =
                megatrain::model::ops::Rope::angles(hd, theta, &Default::default(), p as usize);
            for i in 0..half {
                worst = worst
                    .max((cos[i] - want_cos[r * half + i]).abs())
                    .max((sin[i] - want_sin[r * half + i]).abs());
            }
        }
        assert!(worst < 2e-6, "{case}: max |Δ| {worst:e}");
        eprintln!(
            "{case}: {} positions up to {}, max |Δ| {worst:e}",
            positions.len(),
            positions[positions.len() - 1]
        );
    }
}

/// Scaled RoPE (Llama 3.1 and 3.2's `llama3`, `linear`, YaRN as Qwen2.5's long-context configs
/// set it, YaRN with `mscale`/`mscale_all_dim` and no truncation) at positions up to 2^19 against
/// transformers' rotary embedding (tools/golden_rope.py): each case's config.json is parsed as a
/// user's, and the tables, YaRN's attention factor in them, agree to the last bits of cos/sin —
/// within what one ulp of a frequency makes of the angle (torch's SLEEF `pow` and the C
/// library's `powf` differ in the last bit for some θ^(2i/hd): measured 7.3e-6 at 2^19).
/// Unscaled tables are far off (the scaling matters at these positions).
#[test]
fn scaled_rope_matches_transformers() {
    use megatrain::model::config::ModelConfig;
    use megatrain::model::ops::{Rope, RopeScaling};
    let g = common::Golden::open("rope_scaled.safetensors");
    for case in ["llama3_1", "llama3_2", "linear", "yarn_qwen", "yarn_mscale"] {
        let cfg = ModelConfig::from_json_str(&g.meta[&format!("{case}.config")], case).unwrap();
        assert_ne!(cfg.rope_scaling, RopeScaling::Default, "{case}");
        let hd = cfg.head_dim;
        let positions = g.get(&format!("{case}.positions"));
        let (want_cos, want_sin) = (g.get(&format!("{case}.cos")), g.get(&format!("{case}.sin")));
        let half = hd / 2;
        let (inv, _) = cfg.rope_scaling.frequencies(hd, cfg.rope_theta);
        let (mut worst, mut unscaled, mut excess) = (0.0f32, 0.0f32, 0.0f32);
        for (r, &p) in positions.iter().enumerate() {
            let (cos, sin) = Rope::angles(hd, cfg.rope_theta, &cfg.rope_scaling, p as usize);
            let (c0, s0) = Rope::angles(hd, cfg.rope_theta, &RopeScaling::Default, p as usize);
            for i in 0..half {
                let (wc, ws) = (want_cos[r * half + i], want_sin[r * half + i]);
                let err = (cos[i] - wc).abs().max((sin[i] - ws).abs());
                worst = worst.max(err);
                // torch's pow (SLEEF, 1 ulp) and the C library's may differ in the last bit of
                // θ^(2i/hd): an ulp of a frequency moves the angle by an ulp of the angle.
                let allowed = 3e-6 + 2.0 * f32::EPSILON * p * inv[i];
                excess = excess.max(err - allowed);
                unscaled = unscaled.max((c0[i] - wc).abs()).max((s0[i] - ws).abs());
            }
        }
        eprintln!(
            "{case} ({}): max |Δ| {worst:e} (unscaled: {unscaled:e})",
            cfg.rope_scaling.name()
        );
        assert!(
            excess <= 0.0,
            "{case}: max |Δ| {worst:e}, beyond an ulp of the frequency"
        );
        assert!(unscaled > 0.1, "{case}: the scaling does not matter here");
    }
}

/// Mixtral: 4 experts of width 24 on both layers, top-2 renormalised (every expert gets tokens).
#[test]
fn mixtral_mixture_of_experts() {
    check_case("mixtral");
}

/// Qwen3-MoE: QK-norm, 32 experts of width 16, top-3 not renormalised on layers 0 and 2 (layer 1
/// dense): most experts get no token and no gradient.
#[test]
fn qwen3_moe_mixture_of_experts() {
    check_case("qwen3_moe");
}

/// Routing matters: each golden fails with the renormalisation flipped or another k.
#[test]
fn moe_goldens_fail_without_their_routing() {
    for (case, flips) in [("mixtral", true), ("qwen3_moe", false)] {
        let base = load(case).layout.config;
        let m = base.moe.clone().unwrap();
        let with = |moe: megatrain::model::config::MoeConfig| ModelConfig {
            moe: Some(moe),
            ..base.clone()
        };
        let off = vec![
            (
                "norm_topk_prob flipped",
                with(megatrain::model::config::MoeConfig {
                    norm_topk_prob: !flips,
                    ..m.clone()
                }),
            ),
            (
                "top_k + 1",
                with(megatrain::model::config::MoeConfig {
                    top_k: m.top_k + 1,
                    ..m.clone()
                }),
            ),
        ];
        fails_without(case, off);
    }
}

/// GPT-OSS: q/k/v/o biases, attention sinks, a window of 7 on layer 0, YaRN; 8 experts, a
/// biased top-2-then-softmax router, biased transposed experts with interleaved gate/up and a
/// SwiGLU clamped at 0.3.
#[test]
fn gpt_oss_mixture_of_experts() {
    check_case("gpt_oss");
}

/// Each GPT-OSS feature moves the numbers: the golden fails with the clamp, the router's order
/// (top-k then softmax) or the window switched off. (The sinks are parameters: without them the
/// golden's parameter set differs; `model::ops::sinks` tests them against their definition.)
#[test]
fn gpt_oss_golden_fails_without_each_feature() {
    use megatrain::model::config::MoeConfig;
    use megatrain::model::ops::Router;
    let base = load("gpt_oss").layout.config;
    let m = base.moe.clone().unwrap();
    let with = |moe: MoeConfig| ModelConfig {
        moe: Some(moe),
        ..base.clone()
    };
    let off = vec![
        (
            "the SwiGLU clamp",
            with(MoeConfig {
                swiglu_clamp: Some((1.702, 1e9)),
                ..m.clone()
            }),
        ),
        (
            "top-k then softmax",
            with(MoeConfig {
                router: Router::SoftmaxTopK,
                ..m.clone()
            }),
        ),
        (
            "the window",
            ModelConfig {
                sliding_window: None,
                ..base.clone()
            },
        ),
    ];
    fails_without("gpt_oss", off);
}
