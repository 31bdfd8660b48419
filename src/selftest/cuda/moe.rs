//! The mixture-of-experts op on the GPU (`CudaBackend::moe_fwd`/`moe_bwd`: routing, the
//! grouped rows, every expert's GEMMs, the weighted sum, their backward with the load-balancing
//! gradient) against the CPU's (`model::ops::moe_fwd`/`moe_bwd`) on random inputs, one call
//! each, in fp32 and in the bf16 recipe — the op alone, where the training check compares
//! whole models whose routing a sum in another order can flip.

use super::super::{compare_norm, Check};
use crate::device::cuda::{drv, CudaBackend, CudaRuntime, DevP};
use crate::device::program::{Backend, MoeAt};
use crate::model::config::MlpActivation;
use crate::model::ops::{
    self, bf16_value, AuxGrad, ExpertAct, ExpertLayout, ExpertLoad, MoeGrads, MoeShape, MoeWeights,
    Router,
};
use crate::optim::adamw::f32_to_bf16;
use crate::Result;
use cudarc::driver::{CudaSlice, CudaStream, DevicePtr};
use std::sync::Arc;

/// The bf16 recipe's op against the CPU's, norm-wise: the same bf16 operands on both, fp32
/// sums in another order, so an element whose rounding lands the other way now and then (2⁻⁸
/// of it) is all that differs.
pub const TOL_MOE_BF16: f64 = 1e-4;
/// The fp32 op, norm-wise: sums in another order (the router's gradient sums every token's
/// mixed-sign terms, so elementwise its small entries carry the order's error).
pub const TOL_MOE_F32: f64 = 1e-5;

/// Tokens per call: more than one token chunk's worth of rows per expert on average.
const ROWS: usize = 300;

/// The two kinds of MoE MLP: Qwen3-MoE's (softmax then top-k renormalised, gate/up rows) and
/// GPT-OSS's (top-k logits then their softmax, interleaved biased experts, the clamp engaged).
fn shapes() -> [(&'static str, MoeShape); 2] {
    let base = MoeShape {
        c: 128,
        experts: 8,
        top_k: 2,
        inter: 32,
        norm_topk: true,
        router: Router::SoftmaxTopK,
        layout: ExpertLayout::GateUpRows,
        act: ExpertAct::Gated(MlpActivation::Silu),
    };
    let gpt_oss = MoeShape {
        norm_topk: false,
        router: Router::TopKSoftmax,
        layout: ExpertLayout::InterleavedColumns,
        act: ExpertAct::ClampedSwiglu {
            alpha: 1.702,
            limit: 0.5,
        },
        ..base
    };
    [("moe op", base), ("moe op gpt-oss", gpt_oss)]
}

/// Every case in fp32 and in the bf16 recipe on GPU `ordinal`.
pub fn moe_ops(ordinal: usize, seed: u64) -> Result<Vec<Check>> {
    let rt = Arc::new(CudaRuntime::open(ordinal)?);
    let mut checks = Vec::new();
    for (name, s) in shapes() {
        for bf16 in [false, true] {
            checks.extend(case(&rt, name, s, bf16, seed)?);
        }
    }
    Ok(checks)
}

/// One op's inputs: `[h, router, gate_up, down, b_router, b_gate_up, b_down, d_out]`.
fn inputs(s: MoeShape, seed: u64, bf16: bool) -> [Vec<f32>; 8] {
    let (n, c, e, i) = (ROWS, s.c, s.experts, s.inter);
    let biased = s.biases();
    let lens = [
        n * c,
        e * c,
        e * 2 * i * c,
        e * c * i,
        if biased { e } else { 0 },
        if biased { e * 2 * i } else { 0 },
        if biased { e * c } else { 0 },
        n * c,
    ];
    let scales = [1.0, 0.3, 0.15, 0.15, 0.3, 0.3, 0.3, 1.0];
    std::array::from_fn(|k| {
        let mut v = crate::util::uniform(lens[k], seed.wrapping_add(101 + k as u64), scales[k]);
        // Under the bf16 recipe the input and the weights are bf16 values (the norm's stored
        // output, the master's high plane); d_out (the last) stays fp32.
        if bf16 && k < 7 {
            v.iter_mut().for_each(|x| *x = bf16_value(*x));
        }
        v
    })
}

/// One forward and backward on both devices; every output compared.
fn case(
    rt: &Arc<CudaRuntime>,
    name: &str,
    s: MoeShape,
    bf16: bool,
    seed: u64,
) -> Result<Vec<Check>> {
    let (n, c, e) = (ROWS, s.c, s.experts);
    let x = inputs(s, seed, bf16);
    let [h, router, gate_up, down, br, bgu, bd, d_out] = &x;
    // The load-balancing gradient, one value per expert, and every fifth token padding (no
    // part of the load, no share of that gradient).
    let aux = crate::util::uniform(e, seed.wrapping_add(200), 0.05);
    let pad: Vec<u8> = (0..n).map(|r| u8::from(r % 5 == 4)).collect();
    let aux_grad = AuxGrad {
        per_expert: &aux,
        pad: Some(&pad),
    };
    // The CPU.
    let w = MoeWeights {
        router,
        gate_up,
        down,
        biases: s.biases().then_some([&br[..], &bgu[..], &bd[..]]),
        bf16_recipe: bf16,
    };
    let mut want_out = vec![0f32; n * c];
    let routing = ops::moe_fwd(&mut want_out, h, &w, n, s);
    let mut want_dh = vec![0f32; n * c];
    let mut want_g = [router, gate_up, down, br, bgu, bd].map(|t| vec![0f32; t.len()]);
    {
        let [gr, ggu, gd, gbr, gbgu, gbd] = &mut want_g;
        let grads = MoeGrads {
            router: gr,
            gate_up: ggu,
            down: gd,
            biases: s
                .biases()
                .then_some([&mut gbr[..], &mut gbgu[..], &mut gbd[..]]),
        };
        ops::moe_bwd(&mut want_dh, grads, d_out, h, &w, n, s, Some(aux_grad));
    }
    // The GPU: the input and the weights as a bf16 device holds them under the recipe.
    let stream = rt.stream.clone();
    let elems = n * c.max(2 * s.inter).max(e);
    let rope = ops::Rope::new(32, 10_000.0, 16);
    let mut be = CudaBackend::new(
        rt.clone(),
        stream.clone(),
        &rope,
        n,
        (false, bf16.then_some(elems)),
    )?;
    let held: Vec<Held> = x[..7]
        .iter()
        .map(|v| Held::up(&stream, v, bf16))
        .collect::<Result<_>>()?;
    let p = |k: usize| held[k].p(&stream);
    let at = |base: usize| MoeAt {
        router: p(base),
        gate_up: p(base + 1),
        down: p(base + 2),
        biases: s.biases().then(|| [p(base + 3), p(base + 4), p(base + 5)]),
    };
    let w_at = at(1);
    let d_out_d = Held::up(&stream, d_out, false)?;
    let zeros = |len: usize| Held::up(&stream, &vec![0f32; len.max(1)], false);
    let (out_d, dh_d) = (zeros(n * c)?, zeros(n * c)?);
    let g_d: Vec<Held> = want_g
        .iter()
        .map(|t| zeros(t.len()))
        .collect::<Result<_>>()?;
    let gp = |k: usize| g_d[k].p(&stream);
    let g_at = MoeAt {
        router: gp(0),
        gate_up: gp(1),
        down: gp(2),
        biases: s.biases().then(|| [gp(3), gp(4), gp(5)]),
    };
    let load = be.moe_fwd(out_d.p(&stream), p(0), w_at, n, s, Some(&pad))?;
    be.moe_bwd(
        dh_d.p(&stream),
        g_at,
        d_out_d.p(&stream),
        p(0),
        w_at,
        n,
        s,
        Some(aux_grad),
    )?;
    drv(stream.synchronize(), "wait for the MoE op")?;
    let recipe = if bf16 { "bf16" } else { "fp32" };
    let cmp = |label: &str, got: Vec<f32>, want: &[f32]| match bf16 {
        true => compare_norm(
            &format!("{name} {recipe}: {label} (‖Δ‖/‖x‖)"),
            &got,
            want,
            TOL_MOE_BF16,
        ),
        false => compare_norm(
            &format!("{name} {recipe}: {label} (‖Δ‖/‖x‖)"),
            &got,
            want,
            TOL_MOE_F32,
        ),
    };
    let want_load = ExpertLoad::of(&routing.expert, &routing.probs, n, e, Some(&pad));
    let same_routing = (&load.tokens, load.rows) == (&want_load.tokens, want_load.rows);
    let mut out = vec![Check {
        name: format!("{name} {recipe}: tokens per expert (padding left out)"),
        max_rel_err: if same_routing { 0.0 } else { f64::INFINITY },
        tolerance: 0.0,
        pass: same_routing,
    }];
    let sums = |l: &ExpertLoad| l.prob_sums.iter().map(|&x| x as f32).collect::<Vec<_>>();
    out.push(cmp(
        "router probability sums",
        sums(&load),
        &sums(&want_load),
    ));
    out.push(cmp("output", out_d.down(&stream)?, &want_out));
    out.push(cmp("dh", dh_d.down(&stream)?, &want_dh));
    let labels = [
        "d router",
        "d gate/up",
        "d down",
        "d router bias",
        "d gate/up bias",
        "d down bias",
    ];
    for (k, label) in labels
        .iter()
        .enumerate()
        .take(if s.biases() { 6 } else { 3 })
    {
        out.push(cmp(label, g_d[k].down(&stream)?, &want_g[k]));
    }
    Ok(out)
}

/// A device copy of a host tensor: fp32, or its bf16 bits.
enum Held {
    F32(CudaSlice<f32>),
    Bf16(CudaSlice<u16>),
}

impl Held {
    fn up(stream: &Arc<CudaStream>, v: &[f32], bf16: bool) -> Result<Self> {
        let v = if v.is_empty() { &[0.0][..] } else { v };
        Ok(match bf16 {
            true => {
                let bits: Vec<u16> = v.iter().map(|x| f32_to_bf16(*x)).collect();
                Held::Bf16(drv(stream.clone_htod(&bits), "copy to the device")?)
            }
            false => Held::F32(drv(stream.clone_htod(v), "copy to the device")?),
        })
    }

    fn p(&self, stream: &Arc<CudaStream>) -> DevP {
        match self {
            Held::F32(d) => DevP::f32(d.device_ptr(stream).0),
            Held::Bf16(d) => DevP::bf16(d.device_ptr(stream).0),
        }
    }

    fn down(&self, stream: &Arc<CudaStream>) -> Result<Vec<f32>> {
        match self {
            Held::F32(d) => drv(stream.clone_dtoh(d), "copy to the host"),
            Held::Bf16(_) => Err(crate::Error::internal("selftest", "an fp32 output")),
        }
    }
}
