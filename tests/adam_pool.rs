//! The AdamW pool on the real host store: every unit updated by the pool equals the scalar
//! reference on a copy, bit for bit, in exact and lean mode; units stay exclusive while in flight.
#![allow(clippy::unwrap_used)]

use megatrain::model::config::ModelConfig;
use megatrain::optim::adamw::{self, AdamSlices, AdamWConfig, Isa};
use megatrain::optim::{unit_segments, AdamPool};
use megatrain::store::layout::{Mode, StateLayout};
use megatrain::store::placement::{place, RamBudget};
use megatrain::store::{HostBuffer, HostStore, StoreOptions};
use megatrain::topology::{probe, TopologySource};

fn rand(n: usize, seed: u64) -> Vec<f32> {
    megatrain::util::uniform(n, seed, 1.0)
}

fn store(mode: Mode) -> HostStore {
    // Odd sizes so chunks and tensors end inside SIMD vectors.
    let cfg = ModelConfig::from_json_str(
        r#"{"architectures":["Qwen2ForCausalLM"],"hidden_size":72,"intermediate_size":200,
        "num_hidden_layers":3,"num_attention_heads":6,"num_key_value_heads":2,"vocab_size":333}"#,
        "t",
    )
    .unwrap();
    let layout = StateLayout::new(&cfg, mode);
    let machine = probe(&TopologySource::Live).unwrap();
    let p = place(&machine, &layout, None, RamBudget::default()).unwrap();
    HostStore::allocate(layout, p, &StoreOptions::default()).unwrap()
}

#[test]
fn pool_equals_scalar_reference_exact_and_lean() {
    let cfg = AdamWConfig {
        lr: 2e-3,
        weight_decay: 0.1,
        ..Default::default()
    };
    for mode in [Mode::Exact, Mode::Lean] {
        let s = store(mode);
        let pool = AdamPool::for_placement(s.placement(), Some(3)).unwrap();
        let mut expected = Vec::new();
        let mut jobs = Vec::new();
        for u in 0..s.num_units() {
            let mut guard = s.take(u).unwrap();
            let n = guard.numel();
            let (p0, g0, m0, v0) = (
                rand(n, 4 * u as u64),
                rand(n, 4 * u as u64 + 1),
                rand(n, 4 * u as u64 + 2),
                rand(n, 4 * u as u64 + 3),
            );
            let v0: Vec<f32> = v0.iter().map(|x| x * x).collect();
            let sh = guard.shards().unwrap();
            sh.params.copy_from_slice(&p0);
            sh.m.copy_from_slice(&m0);
            sh.v.copy_from_slice(&v0);
            let buffer = match sh.grads {
                Some(g) => {
                    g.copy_from_slice(&g0);
                    None
                }
                None => {
                    let mut b =
                        HostBuffer::allocate("lean gradient buffer", n, None, vec![]).unwrap();
                    b.as_mut_slice().copy_from_slice(&g0);
                    Some(b)
                }
            };
            let segs = unit_segments(s.layout(), u, &cfg, 3, 0.5, false);
            // The reference, segment by segment, on copies.
            let (mut p, mut m, mut v) = (p0.clone(), m0.clone(), v0.clone());
            let mut sumsq = 0.0;
            for seg in &segs {
                let r = seg.start..seg.end;
                sumsq += adamw::step_with(
                    Isa::Scalar,
                    AdamSlices {
                        p: &mut p[r.clone()],
                        g: &g0[r.clone()],
                        m: &mut m[r.clone()],
                        v: &mut v[r],
                    },
                    &seg.scalars,
                );
            }
            expected.push((p, m, v, sumsq));
            let node = s.placement().worker_node(u).unwrap();
            jobs.push(pool.submit(node, guard, buffer, segs).unwrap());
            // The unit belongs to the job until it is waited on.
            assert!(s.take(u).is_err());
        }
        for (u, job) in jobs.into_iter().enumerate() {
            let mut done = job.wait().unwrap();
            assert_eq!(done.guard.unit(), u);
            assert_eq!(done.grads.is_some(), mode == Mode::Lean);
            let (p, m, v, sumsq) = &expected[u];
            let got = done.guard.shards().unwrap();
            assert!(
                got.params
                    .iter()
                    .zip(p)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "{mode:?} unit {u} params"
            );
            assert!(
                got.m.iter().zip(m).all(|(a, b)| a.to_bits() == b.to_bits()),
                "unit {u} m"
            );
            assert!(
                got.v.iter().zip(v).all(|(a, b)| a.to_bits() == b.to_bits()),
                "unit {u} v"
            );
            assert!(
                (done.sumsq - sumsq).abs() <= 1e-9 * sumsq,
                "unit {u} sumsq {} vs {sumsq}",
                done.sumsq
            );
            drop(done);
            assert!(s.take(u).is_ok());
        }
    }
}

#[test]
fn lean_job_without_buffer_is_an_error() {
    let s = store(Mode::Lean);
    let pool = AdamPool::for_placement(s.placement(), Some(1)).unwrap();
    let g = s.take(1).unwrap();
    let segs = unit_segments(s.layout(), 1, &AdamWConfig::default(), 1, 1.0, true);
    let e = pool.submit(0, g, None, segs).unwrap_err();
    assert!(e.to_string().contains("gradient buffer"), "{e}");
    // The guard was dropped with the failed submit: the unit is free again.
    assert!(s.take(1).is_ok());
}
