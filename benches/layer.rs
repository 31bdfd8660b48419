//! criterion: forward + backward (with recompute) of one decoder layer on the CPU, as tokens/s and
//! as GFLOP/s (reported as "elem/s" of FLOPs), next to the GEMM crate's own rate on a square
//! matrix in the same run.
#![allow(clippy::unwrap_used)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use megatrain::model::config::ModelConfig;
use megatrain::model::layers::{DecoderBlock, Workspace};
use megatrain::model::ops::{self, Rope};
use megatrain::store::layout::{Mode, StateLayout};

fn bench(c: &mut Criterion) {
    let cfg = ModelConfig::from_json_str(
        r#"{"architectures":["LlamaForCausalLM"],"hidden_size":1024,"intermediate_size":2816,
        "num_hidden_layers":1,"num_attention_heads":16,"num_key_value_heads":4,"vocab_size":1000}"#,
        "bench",
    )
    .unwrap();
    let (b, t) = (1usize, 512usize);
    let n = b * t;
    let layout = StateLayout::new(&cfg, Mode::Exact);
    let unit = &layout.units[1];
    let blk = DecoderBlock::new(&cfg, unit).unwrap();
    let p: Vec<f32> = (0..unit.numel)
        .map(|i| ((i % 113) as f32 - 56.0) * 1e-3)
        .collect();
    let mut g = vec![0.0f32; unit.numel];
    let x: Vec<f32> = (0..n * 1024)
        .map(|i| ((i % 97) as f32 - 48.0) * 1e-2)
        .collect();
    let (mut y, mut dx) = (vec![0.0f32; n * 1024], vec![0.0f32; n * 1024]);
    let dy = x.clone();
    let rope = Rope::new(cfg.head_dim, cfg.rope_theta, t);
    let mut ws = Workspace::new(&cfg, b, t);
    let pos = megatrain::model::ops::flat_positions(b, t);

    // FLOPs: matmuls 2·N·P forward; attention 2·2·N·(T/2)·(NH·HD) forward (causal half);
    // training = forward + recompute + backward (2× forward) = 4× forward.
    let p_mm = cfg.layer_params(0) as u64;
    let fwd = 2 * n as u64 * p_mm + 4 * n as u64 * (t as u64 / 2) * cfg.q_dim() as u64;
    let train_flops = 4 * fwd;

    let mut grp = c.benchmark_group("layer");
    grp.sample_size(10);
    grp.throughput(Throughput::Elements(n as u64));
    grp.bench_function("cpu_decoder_fwd_bwd_tokens", |bn| {
        bn.iter(|| {
            blk.forward(&p, &x, &mut y, &mut ws, &rope, &pos, b, t);
            blk.backward(&p, &mut g, &x, &dy, &mut dx, &mut ws, &rope, &pos, b, t);
        })
    });
    grp.throughput(Throughput::Elements(train_flops));
    grp.bench_function("cpu_decoder_fwd_bwd_flops", |bn| {
        bn.iter(|| {
            blk.forward(&p, &x, &mut y, &mut ws, &rope, &pos, b, t);
            blk.backward(&p, &mut g, &x, &dy, &mut dx, &mut ws, &rope, &pos, b, t);
        })
    });
    let m = 1024usize;
    let (a, bb) = (vec![0.5f32; m * m], vec![0.25f32; m * m]);
    let mut cc = vec![0.0f32; m * m];
    grp.throughput(Throughput::Elements(2 * (m * m * m) as u64));
    grp.bench_function("cpu_gemm_1024_flops", |bn| {
        bn.iter(|| ops::gemm(&mut cc, &a, (m, 1), &bb, (m, 1), m, m, m, false))
    });
    grp.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
