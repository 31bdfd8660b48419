//! criterion: the mixture-of-experts MLP's forward on the CPU against one dense GEMM of the same
//! FLOPs in the same run (the experts' three projections as one `[N·k, C] × [C, 3I]` product, W
//! stored as a Linear's, like the experts' weights), all reported as FLOP/s ("elem/s"), for two
//! Qwen3-MoE-like shapes (32 experts, top-4, 1024 tokens): `small` (width 256, experts of 128)
//! and `wide` (width 1024, experts of 512). `experts_forward` is the whole layer (router,
//! grouping, gather, GEMMs, activation, weighted sum: `ops::moe_fwd`); `expert_gemms_as_stored`
//! the experts' three GEMMs alone as a plain `x·Wᵀ` on the weights as stored (128 rows each,
//! experts in parallel, each GEMM on its thread) — what the op's layout choices (`ops::moe`'s
//! `mm`, `expert_fwd_transposed`) improve on.
#![allow(clippy::unwrap_used)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use megatrain::model::config::MlpActivation;
use megatrain::model::ops::{self, ExpertAct, ExpertLayout, MoeShape, MoeWeights, Router};
use rayon::prelude::*;

fn bench_shape(c: &mut Criterion, name: &str, width: usize, inter: usize) {
    let s = MoeShape {
        c: width,
        experts: 32,
        top_k: 4,
        inter,
        norm_topk: true,
        router: Router::SoftmaxTopK,
        layout: ExpertLayout::GateUpRows,
        act: ExpertAct::Gated(MlpActivation::Silu),
    };
    let n = 1024;
    let fill = |len: usize, k: usize| -> Vec<f32> {
        (0..len)
            .map(|i| (((i * k) % 97) as f32 - 48.0) * 1e-3)
            .collect()
    };
    let (h, router) = (fill(n * s.c, 3), fill(s.experts * s.c, 5));
    let (gate_up, down) = (
        fill(s.experts * 2 * s.inter * s.c, 7),
        fill(s.experts * s.c * s.inter, 11),
    );
    let w = MoeWeights {
        router: &router,
        gate_up: &gate_up,
        down: &down,
        biases: None,
        bf16_recipe: false,
    };
    // The experts' GEMM FLOPs: 2·(N·k)·C·3I (gate, up, down).
    let rows = n * s.top_k;
    let flops = 2 * rows as u64 * s.c as u64 * 3 * s.inter as u64;
    let mut g = c.benchmark_group(format!("moe_{name}"));
    g.throughput(Throughput::Elements(flops));
    let mut out = vec![0f32; n * s.c];
    g.bench_function("experts_forward", |b| {
        b.iter(|| ops::moe_fwd(&mut out, &h, &w, n, s))
    });
    let x = fill(rows * s.c, 13);
    let wd = fill(s.c * 3 * s.inter, 17);
    let mut y = vec![0f32; rows * 3 * s.inter];
    g.bench_function("dense_gemm_same_flops", |b| {
        b.iter(|| {
            ops::gemm(
                &mut y,
                &x,
                (s.c, 1),
                &wd,
                (1, s.c),
                rows,
                s.c,
                3 * s.inter,
                false,
            )
        })
    });
    let per = rows / s.experts;
    let (ci, ii) = (s.c, s.inter);
    let mut bufs: Vec<(Vec<f32>, Vec<f32>, Vec<f32>)> = (0..s.experts)
        .map(|_| {
            (
                vec![0f32; per * ii],
                vec![0f32; per * ii],
                vec![0f32; per * ci],
            )
        })
        .collect();
    g.bench_function("expert_gemms_as_stored", |b| {
        b.iter(|| {
            bufs.par_iter_mut()
                .enumerate()
                .for_each(|(ex, (gt, up, y))| {
                    let xe = &x[ex * per * ci..(ex + 1) * per * ci];
                    let wgu = &gate_up[ex * 2 * ii * ci..(ex + 1) * 2 * ii * ci];
                    let wd = &down[ex * ci * ii..(ex + 1) * ci * ii];
                    ops::gemm(
                        gt,
                        xe,
                        (ci, 1),
                        &wgu[..ii * ci],
                        (1, ci),
                        per,
                        ci,
                        ii,
                        false,
                    );
                    ops::gemm(
                        up,
                        xe,
                        (ci, 1),
                        &wgu[ii * ci..],
                        (1, ci),
                        per,
                        ci,
                        ii,
                        false,
                    );
                    ops::gemm(y, gt, (ii, 1), wd, (1, ii), per, ii, ci, false);
                })
        })
    });
    g.finish();
}

fn bench(c: &mut Criterion) {
    bench_shape(c, "small", 256, 128);
    bench_shape(c, "wide", 1024, 512);
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench
}
criterion_main!(benches);
