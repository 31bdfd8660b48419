//! The AdamW kernel against torch.optim.AdamW (goldens from tools/golden_adamw.py).
#![allow(clippy::unwrap_used, clippy::print_stderr)]

mod common;

use common::{rel_err, Golden};
use megatrain::optim::adamw::{self, AdamSlices, AdamWConfig, Isa, StepScalars};

const NAMES: [&str; 3] = ["w", "b", "n"];

fn run_case(g: &Golden, case: &str, isa: Isa) -> f32 {
    let cases: serde_json::Value = serde_json::from_str(&g.meta["cases"]).unwrap();
    let c = &cases[case];
    let cfg = AdamWConfig {
        lr: c["lr"].as_f64().unwrap(),
        beta1: c["betas"][0].as_f64().unwrap(),
        beta2: c["betas"][1].as_f64().unwrap(),
        eps: c["eps"].as_f64().unwrap(),
        weight_decay: c["weight_decay"].as_f64().unwrap(),
    };
    let max_norm = c["max_norm"].as_f64().unwrap();
    let decay_norms = c["decay_norms"].as_bool().unwrap();
    let steps = c["steps"].as_u64().unwrap();
    let mut p: Vec<Vec<f32>> = NAMES
        .iter()
        .map(|n| g.get(&format!("{case}.init.{n}")).to_vec())
        .collect();
    let mut m: Vec<Vec<f32>> = p.iter().map(|x| vec![0.0; x.len()]).collect();
    let mut v = m.clone();
    let mut worst = 0.0f32;
    for t in 1..=steps {
        let grads: Vec<&[f32]> = NAMES
            .iter()
            .map(|n| g.get(&format!("{case}.grad.{t}.{n}")))
            .collect();
        let scale = if max_norm > 0.0 {
            let norm = grads.iter().map(|x| adamw::sumsq(x)).sum::<f64>().sqrt();
            let want = f64::from(g.get(&format!("{case}.norm.{t}"))[0]);
            assert!(
                (norm - want).abs() <= 1e-6 * want,
                "step {t} norm {norm} vs torch {want}"
            );
            (max_norm / (norm + 1e-6)).min(1.0) as f32
        } else {
            1.0
        };
        for (i, name) in NAMES.iter().enumerate() {
            let decay = decay_norms || g.shape(&format!("{case}.init.{name}")).len() > 1;
            let s = StepScalars::new(&cfg, t, decay, scale);
            adamw::step_with(
                isa,
                AdamSlices {
                    p: &mut p[i],
                    g: grads[i],
                    m: &mut m[i],
                    v: &mut v[i],
                },
                &s,
            );
            for (what, ours) in [("param", &p[i]), ("m", &m[i]), ("v", &v[i])] {
                let want = g.get(&format!("{case}.{what}.{t}.{name}"));
                let e = rel_err(ours, want, 1e-12);
                assert!(
                    e < 1e-5,
                    "{case} step {t} {what}.{name}: rel err {e:e} ({isa:?})"
                );
                worst = worst.max(e);
            }
        }
    }
    worst
}

#[test]
fn matches_torch_adamw_with_and_without_clipping() {
    let g = Golden::open("adamw.safetensors");
    for isa in [Isa::Scalar, adamw::detect()] {
        for case in ["decay_all", "clip"] {
            let worst = run_case(&g, case, isa);
            eprintln!("{case} {isa:?}: worst relative error {worst:e}");
        }
    }
}
