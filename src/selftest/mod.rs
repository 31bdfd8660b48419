//! `megatrain selftest`: what it checks on a device, written so the harness itself runs (and is
//! tested) on the CPU — every kernel and GEMM against the CPU reference ([`cuda`]), and a few
//! training steps of a small model on the device under test against the same steps on the CPU
//! device, compared step by step. It sits above the engine (it trains through the streamer).

#[cfg(feature = "cuda")]
pub mod cuda;
pub mod generation;
pub mod goldens;

use crate::device::Device;
use crate::engine::{ActivationDtype, Activations, MicroBatch, Streamer, StreamerConfig};
use crate::model::config::ModelConfig;
use crate::model::reference::Templates;
use crate::optim::adamw::AdamWConfig;
use crate::optim::AdamPool;
use crate::store::layout::{Mode, StateLayout};
use crate::store::placement::{place, RamBudget};
use crate::store::{HostStore, SharedRegistrar, StoreOptions};
use crate::topology::Machine;
use crate::Result;
use std::sync::Arc;

/// One self-test line.
#[derive(Debug, Clone, serde::Serialize)]
pub struct Check {
    /// What was checked.
    pub name: String,
    /// Largest relative error (|gpu − cpu| / max(|cpu|, 1e-3·max|cpu|)).
    pub max_rel_err: f64,
    /// The tolerance for its dtype.
    pub tolerance: f64,
    /// Within tolerance.
    pub pass: bool,
}

/// Largest relative error of `got` against `want` (relative to each value, floored at 1e-3 of
/// the largest |want| so near-zero entries do not dominate); any NaN fails.
pub fn compare(name: &str, got: &[f32], want: &[f32], tol: f64) -> Check {
    let scale = want.iter().fold(0.0f64, |a, x| a.max(f64::from(x.abs())));
    let floor = (1e-3 * scale).max(1e-12);
    let err = if got.len() != want.len() {
        f64::INFINITY
    } else {
        got.iter()
            .zip(want)
            .map(|(g, w)| {
                let (g, w) = (f64::from(*g), f64::from(*w));
                if g.is_nan() || w.is_nan() {
                    f64::INFINITY
                } else {
                    (g - w).abs() / w.abs().max(floor)
                }
            })
            .fold(0.0, f64::max)
    };
    Check {
        name: name.to_owned(),
        max_rel_err: err,
        tolerance: tol,
        pass: err <= tol,
    }
}

/// `device`'s device→host copies of `n` values against what they must land, bit for bit:
/// plain, accumulated (`+=`), and bf16 gradients (`=` and `+=`: rounded to nearest even on the
/// device, widened on the host; every 5th value an exact tie). The reference is the optimizer's
/// scalar bf16 rounding, not the devices' own.
pub fn landings(gpu: &dyn Device, n: usize, seed: u64) -> Result<Vec<Check>> {
    use crate::device::{Cmd, Event, GradLink, HostRef, StreamKind};
    use crate::optim::adamw::{bf16_to_f32, f32_to_bf16};
    // Gradient-like values, every 5th an exact tie between two bf16 values (low half 0x8000,
    // odd and even high halves alike), and a base to accumulate onto.
    let mut state = seed ^ 0x5eed_1a4d;
    let mut next = || {
        state = state
            .wrapping_mul(6_364_136_223_846_793_005)
            .wrapping_add(1_442_695_040_888_963_407);
        ((state >> 33) as f32 / (1u64 << 31) as f32 - 0.5) * 0.02
    };
    let values: Vec<f32> = (0..n)
        .map(|i| {
            let v = next();
            if i % 5 == 0 {
                f32::from_bits((v.to_bits() & 0xffff_0000) | 0x8000)
            } else {
                v
            }
        })
        .collect();
    let base: Vec<f32> = (0..n).map(|_| next()).collect();
    let mut src = values.clone();
    let buf = gpu.alloc(n, "selftest landings")?;
    let cases = [
        ("fp32 copy", false, GradLink::Fp32),
        ("fp32 accumulated", true, GradLink::Fp32),
        ("bf16 gradients", false, GradLink::Bf16),
        ("bf16 gradients accumulated", true, GradLink::Bf16),
    ];
    let mut outs: Vec<Vec<f32>> = cases.iter().map(|_| base.clone()).collect();
    let (copied, landed) = (Event::new(), Event::new());
    // SAFETY: `src` and `outs` outlive the copies: `landed` is waited on below, before either
    // is read or dropped, and nothing else touches them meanwhile.
    let source = unsafe { HostRef::from_slice(&mut src) };
    gpu.submit(
        StreamKind::CopyIn,
        Cmd::HtoD {
            dst: buf,
            offset: 0,
            src: source,
            label: "values".into(),
        },
    );
    gpu.submit(StreamKind::CopyIn, Cmd::Record(copied.clone()));
    gpu.submit(StreamKind::CopyOut, Cmd::Wait(copied));
    for ((name, accumulate, link), out) in cases.iter().zip(outs.iter_mut()) {
        gpu.submit(
            StreamKind::CopyOut,
            Cmd::DtoH {
                // SAFETY: as above.
                dst: unsafe { HostRef::from_slice(out) },
                src: buf,
                offset: 0,
                accumulate: *accumulate,
                link: *link,
                label: (*name).into(),
            },
        );
    }
    gpu.submit(StreamKind::CopyOut, Cmd::Record(landed.clone()));
    landed.synchronize();
    gpu.synchronize();
    if let Some(e) = gpu.take_error() {
        return Err(e);
    }
    gpu.free(buf);
    let crossed = |v: f32, link: GradLink| match link {
        GradLink::Fp32 => v,
        GradLink::Bf16 => bf16_to_f32(f32_to_bf16(v)),
    };
    Ok(cases
        .iter()
        .zip(&outs)
        .map(|((name, accumulate, link), got)| {
            let want: Vec<f32> = values
                .iter()
                .zip(&base)
                .map(|(v, b)| {
                    let v = crossed(*v, *link);
                    if *accumulate {
                        b + v
                    } else {
                        v
                    }
                })
                .collect();
            let mut c = compare(&format!("device→host: {name} (bit-exact)"), got, &want, 0.0);
            c.pass = got
                .iter()
                .zip(&want)
                .all(|(a, b)| a.to_bits() == b.to_bits());
            c
        })
        .collect())
}

/// Largest error of `got` against `want` relative to each element's own error scale `scale`
/// (for TF32, Σ|x·w| of its dot product); any NaN fails.
pub fn compare_bounded(name: &str, got: &[f32], want: &[f32], scale: &[f32], tol: f64) -> Check {
    let err = if got.len() != want.len() || got.len() != scale.len() {
        f64::INFINITY
    } else {
        got.iter()
            .zip(want)
            .zip(scale)
            .map(|((g, w), s)| {
                let (g, w, s) = (f64::from(*g), f64::from(*w), f64::from(*s));
                if g.is_nan() || w.is_nan() {
                    f64::INFINITY
                } else {
                    (g - w).abs() / s.max(1e-30)
                }
            })
            .fold(0.0, f64::max)
    };
    Check {
        name: name.to_owned(),
        max_rel_err: err,
        tolerance: tol,
        pass: err <= tol,
    }
}

/// The self-test's model: Llama-style with q/k/v/o biases (every kernel family runs), untied
/// head, GQA, a vocabulary larger than one logit chunk's rows.
pub fn small_model() -> Result<ModelConfig> {
    ModelConfig::from_json_str(
        r#"{"architectures":["LlamaForCausalLM"],"hidden_size":128,"intermediate_size":320,
        "num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":700,
        "attention_bias":true,"tie_word_embeddings":false}"#,
        "the self-test model",
    )
}

/// The self-test's mixture-of-experts model: Qwen3-MoE with 8 experts of width 32, top-2
/// renormalised, on layers 0 and 2 (layer 1 dense), a vocabulary larger than one logit chunk's
/// rows, the load-balancing loss trained (weight 0.1); on the GPU its 300 tokens route in token
/// chunks of 256 and 44.
pub fn small_moe_model() -> Result<ModelConfig> {
    ModelConfig::from_json_str(
        r#"{"architectures":["Qwen3MoeForCausalLM"],"hidden_size":128,"intermediate_size":320,
        "moe_intermediate_size":32,"num_experts":8,"num_experts_per_tok":2,"norm_topk_prob":true,
        "mlp_only_layers":[1],"num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,
        "head_dim":32,"vocab_size":700,"tie_word_embeddings":false,
        "output_router_logits":true,"router_aux_loss_coef":0.1}"#,
        "the self-test MoE model",
    )
}

/// The self-test's GPT-OSS model: attention sinks and biases, a window of 64 on layer 0, 8
/// biased experts of width 32 with interleaved gate/up and the clamped SwiGLU, top-2 logits
/// then their softmax, the load-balancing loss trained (weight 0.1).
pub fn small_gpt_oss_model() -> Result<ModelConfig> {
    ModelConfig::from_json_str(
        r#"{"architectures":["GptOssForCausalLM"],"hidden_size":128,"intermediate_size":32,
        "num_local_experts":8,"num_experts_per_tok":2,"num_hidden_layers":2,
        "num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,"sliding_window":64,
        "vocab_size":700,"swiglu_limit":1.0,"output_router_logits":true,
        "router_aux_loss_coef":0.1}"#,
        "the self-test GPT-OSS model",
    )
}

/// Sequences per micro-batch of the training check.
pub const BATCH: usize = 1;
/// Tokens per sequence of the training check (300 rows: two logit chunks, and on the GPU two
/// token chunks of 256 and 44 tokens).
pub const SEQ: usize = 300;
/// Micro-batches per step (the gradient-accumulating copies run).
pub const MICRO_BATCHES: usize = 2;
/// Steps.
pub const STEPS: usize = 3;

/// What one training run produced: per step the loss and gradient norm, and every unit's
/// gradients after the first step.
#[derive(Debug, Clone)]
pub struct Run {
    /// Loss per step.
    pub losses: Vec<f64>,
    /// Global gradient norm per step.
    pub norms: Vec<f64>,
    /// Gradients of every unit after step 1.
    pub grads: Vec<Vec<f32>>,
}

/// Train [`STEPS`] steps of [`small_model`] from a seeded init on `device` (exact mode,
/// activations kept on the host, [`MICRO_BATCHES`] accumulated micro-batches), page-locking the store
/// with the device's registrar when it has one.
pub fn train_steps(
    machine: &Machine,
    device: Arc<dyn Device>,
    templates: Arc<Templates>,
    seed: u64,
) -> Result<Run> {
    let cfg = templates.config.clone();
    // bf16 devices stream the high plane of a master stored as planes.
    let master = match device.precision() {
        crate::device::Precision::Fp32 => crate::store::layout::MasterFormat::Fp32,
        crate::device::Precision::Bf16 => crate::store::layout::MasterFormat::Planes,
    };
    let layout = StateLayout::new(&cfg, Mode::Exact).with_master(master);
    let placement = place(machine, &layout, None, RamBudget::default())?;
    let store = HostStore::allocate(
        layout.clone(),
        placement,
        &StoreOptions {
            registrar: device.registrar().map(SharedRegistrar),
            ..StoreOptions::default()
        },
    )?;
    for (u, unit) in layout.units.iter().enumerate() {
        let mut g = store.take(u)?;
        let mut p = crate::util::uniform(unit.numel, seed + u as u64, 0.08);
        for t in &unit.tensors {
            if t.shape.len() == 1 && t.name.contains("norm") {
                p[t.offset..t.offset + t.numel()]
                    .iter_mut()
                    .for_each(|x| *x += 1.0);
            }
        }
        g.master().write(0, &p);
    }
    let pool = AdamPool::for_placement(store.placement(), Some(2))?;
    let mut streamer = Streamer::new(
        device,
        store,
        pool,
        templates,
        StreamerConfig {
            batch: BATCH,
            seq: SEQ,
            micro_batches: MICRO_BATCHES,
            activations: Activations::Host,
            // Under bf16 the layer inputs cross stored in bf16, as `train` does by default.
            activation_dtype: match master {
                crate::store::layout::MasterFormat::Planes => ActivationDtype::Bf16,
                crate::store::layout::MasterFormat::Fp32 => ActivationDtype::Fp32,
            },
            // The last block's input stays on the device, the others cross the link: both
            // ways of keeping an input run.
            device_inputs: 1,
            adam: AdamWConfig {
                weight_decay: 0.1,
                ..AdamWConfig::default()
            },
            grad_clip: 1.0,
            decay_norms: true,
            seed: 0,
            grad_link: crate::device::GradLink::Fp32,
        },
    )?;
    let vocab = cfg.vocab_size as u32;
    let mut run = Run {
        losses: Vec::new(),
        norms: Vec::new(),
        grads: Vec::new(),
    };
    // The same micro-batches every step: the loss must fall as the model memorises them.
    let batches: Vec<MicroBatch> = (0..MICRO_BATCHES)
        .map(|j| {
            let s = seed.wrapping_mul(1000) + j as u64;
            let ids: Vec<u32> = crate::util::uniform(BATCH * SEQ + 1, s, 1.0)
                .iter()
                .map(|x| ((x.abs() * 1e6) as u32) % vocab)
                .collect();
            MicroBatch::flat(ids[..BATCH * SEQ].to_vec(), ids[1..].to_vec(), SEQ)
        })
        .collect();
    for step in 0..STEPS {
        let m = streamer.step(&batches, 3e-3)?;
        run.losses.push(m.loss);
        run.norms.push(m.grad_norm);
        if step == 0 {
            streamer.finish()?;
            for u in 0..streamer.store().num_units() {
                let mut g = streamer.store().take(u)?;
                run.grads
                    .push(g.grads().map(|x| x.to_vec()).unwrap_or_default());
            }
        }
    }
    streamer.finish()?;
    Ok(run)
}

/// How a unit's step-1 gradients are compared.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GradMetric {
    /// The largest error relative to each element (floored at 10⁻³ of the largest): fp32 runs.
    Elementwise,
    /// ‖got − want‖₂ / ‖want‖₂: bf16 runs, where a sum in another order flips a bf16 rounding now
    /// and then, and a flipped element's error (2⁻⁸ of it) spreads to everything after it.
    Norm,
}

/// ‖got − want‖₂ / ‖want‖₂ (infinite on a length mismatch, nothing to compare, or a NaN).
pub fn compare_norm(name: &str, got: &[f32], want: &[f32], tol: f64) -> Check {
    let (mut diff, mut base) = (0.0f64, 0.0f64);
    for (g, w) in got.iter().zip(want) {
        let (g, w) = (f64::from(*g), f64::from(*w));
        diff += (g - w) * (g - w);
        base += w * w;
    }
    let err = if got.len() != want.len() || want.is_empty() || diff.is_nan() {
        f64::INFINITY
    } else {
        diff.sqrt() / base.sqrt().max(1e-30)
    };
    Check {
        name: name.to_owned(),
        max_rel_err: err,
        tolerance: tol,
        pass: err <= tol,
    }
}

/// Compare a device's run with the CPU device's: losses and norms per step, and every unit's
/// gradients after step 1 (by `metric`), within `tol`; the checks are named `{label}: …`.
pub fn compare_runs(
    label: &str,
    got: &Run,
    want: &Run,
    tol: f64,
    metric: GradMetric,
) -> Vec<Check> {
    let f = |v: &[f64]| v.iter().map(|x| *x as f32).collect::<Vec<_>>();
    let mut out = vec![
        compare(
            &format!("{label}: loss per step"),
            &f(&got.losses),
            &f(&want.losses),
            tol,
        ),
        compare(
            &format!("{label}: grad norm per step"),
            &f(&got.norms),
            &f(&want.norms),
            tol,
        ),
    ];
    let n = want.grads.len();
    for (u, (g, w)) in got.grads.iter().zip(&want.grads).enumerate() {
        let name = match u {
            0 => format!("{label}: step-1 grads, embedding"),
            u if u + 1 == n => format!("{label}: step-1 grads, head"),
            u => format!("{label}: step-1 grads, block {}", u - 1),
        };
        out.push(match metric {
            GradMetric::Elementwise => compare(&name, g, w, tol),
            GradMetric::Norm => compare_norm(&format!("{name} (‖Δ‖/‖g‖)"), g, w, tol),
        });
    }
    if got.grads.len() != n {
        out.push(Check {
            name: format!("{label}: units with gradients"),
            max_rel_err: f64::INFINITY,
            tolerance: 0.0,
            pass: false,
        });
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::device::cpu::{CpuDevice, CpuDeviceConfig};
    use crate::topology::{probe, TopologySource};

    fn cpu(tm: &Arc<Templates>, jitter: Option<(u64, u64)>) -> Arc<dyn Device> {
        Arc::new(
            CpuDevice::new(
                CpuDeviceConfig {
                    capacity_bytes: 256 << 20,
                    link: None,
                    jitter,
                    shape: crate::device::program::Shape::whole(BATCH, SEQ),
                    precision: crate::device::Precision::Fp32,
                },
                tm.clone(),
            )
            .unwrap(),
        )
    }

    /// The harness `selftest --device cuda` runs: two CPU devices (one with random delays on
    /// every stream) agree exactly, and a run from another init is told apart.
    #[test]
    fn training_check_passes_on_agreeing_devices_and_fails_otherwise() {
        let machine = probe(&TopologySource::Live).unwrap();
        let cfg = small_model().unwrap();
        let layout = StateLayout::new(&cfg, Mode::Exact);
        let tm = Arc::new(Templates::new(&layout.config, SEQ).unwrap());
        let a = train_steps(&machine, cpu(&tm, None), tm.clone(), 7).unwrap();
        let b = train_steps(&machine, cpu(&tm, Some((3, 200))), tm.clone(), 7).unwrap();
        assert_eq!(a.losses.len(), STEPS);
        assert!(
            a.losses[STEPS - 1] < a.losses[0],
            "it trains: {:?}",
            a.losses
        );
        let checks = compare_runs("training", &b, &a, 0.0, GradMetric::Elementwise);
        assert_eq!(checks.len(), 2 + layout.units.len());
        assert!(checks.iter().all(|c| c.pass), "{checks:?}");
        let c = train_steps(&machine, cpu(&tm, None), tm.clone(), 8).unwrap();
        assert!(
            compare_runs("training", &c, &a, 1e-3, GradMetric::Elementwise)
                .iter()
                .any(|c| !c.pass)
        );
    }
}
