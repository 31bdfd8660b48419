//! criterion: the AdamW kernel per implementation, next to the STREAM triad on the same buffers
//! size (`cpu_adamw_*` at 28 B/param, `cpu_triad_*` at 12 B/element). Single thread; the pooled,
//! multi-threaded figure is `megatrain bench adam`.
#![allow(clippy::unwrap_used)]

use criterion::{criterion_group, criterion_main, Criterion, Throughput};
use megatrain::optim::adamw::{self, AdamSlices, AdamWConfig, Isa, StepScalars};

const N: usize = 8 << 20; // 8M elements: 224 MB of AdamW state, far beyond any cache

fn bench(c: &mut Criterion) {
    let mut g = c.benchmark_group("adam");
    g.sample_size(10);
    let s = StepScalars::new(&AdamWConfig::default(), 10, true, 1.0);
    let mut p = vec![0.01f32; N];
    let grad = vec![0.001f32; N];
    let mut m = vec![0.0f32; N];
    let mut v = vec![1e-6f32; N];
    let (mut a, b, cc) = (vec![0.0f32; N], vec![1.0f32; N], vec![2.0f32; N]);
    for isa in [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon] {
        if !adamw::supported(isa) {
            continue;
        }
        let name = format!("{isa:?}").to_lowercase();
        g.throughput(Throughput::Bytes(28 * N as u64));
        g.bench_function(format!("cpu_adamw_{name}"), |bn| {
            bn.iter(|| {
                adamw::step_with(
                    isa,
                    AdamSlices {
                        p: &mut p,
                        g: &grad,
                        m: &mut m,
                        v: &mut v,
                    },
                    &s,
                )
            })
        });
        g.throughput(Throughput::Bytes(12 * N as u64));
        g.bench_function(format!("cpu_triad_{name}"), |bn| {
            bn.iter(|| adamw::triad(isa, &mut a, &b, &cc, 1.5))
        });
    }
    g.finish();
}

criterion_group!(benches, bench);
criterion_main!(benches);
