//! criterion: the mixture-of-experts MLP's forward on the CPU (Qwen3-MoE-shaped: 32 experts of
//! width 128, top-4, 1024 tokens of width 256) against one dense GEMM of the same FLOPs in the
//! same run (the experts' three projections as one `[N·k, C] × [C, 3I]` product), both reported
//! as FLOP/s ("elem/s"): what grouping tokens by expert costs over a dense layer's GEMMs.
#![allow(clippy::unwrap_used)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use megatrain::model::config::MlpActivation;
use megatrain::model::ops::{self, ExpertAct, ExpertLayout, MoeShape, MoeWeights, Router};

fn bench(c: &mut Criterion) {
    let s = MoeShape {
        c: 256,
        experts: 32,
        top_k: 4,
        inter: 128,
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
    };
    // The experts' GEMM FLOPs: 2·(N·k)·C·3I (gate, up, down).
    let rows = n * s.top_k;
    let flops = 2 * rows as u64 * s.c as u64 * 3 * s.inter as u64;
    let mut g = c.benchmark_group("moe");
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
                (3 * s.inter, 1),
                rows,
                s.c,
                3 * s.inter,
                false,
            )
        })
    });
    g.finish();
}

criterion_group! {
    name = benches;
    config = Criterion::default().sample_size(20);
    targets = bench
}
criterion_main!(benches);
