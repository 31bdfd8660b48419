//! The AdamW pool on the real host store: every unit updated by the pool equals a plain
//! element-by-element reference on a copy, bit for bit, for every moment format
//! (`--adam-state fp32|bf16|int8`), every SIMD path this CPU has, exact and lean mode, and both
//! master formats (fp32, and bf16 hi/lo planes, which must give the fp32 update's exact bits);
//! units stay exclusive while in flight.
#![allow(clippy::unwrap_used)]

use megatrain::model::config::ModelConfig;
use megatrain::optim::adamw::{self, AdamSlices, AdamWConfig, Isa};
use megatrain::optim::moments::{self, bf16_stochastic, hash32, Quantizer};
use megatrain::optim::{piece_segments, unit_segments, AdamPool, Salts, Segment};
use megatrain::store::layout::{AdamState, MasterFormat, Mode, StateLayout, INT8_BLOCK};
use megatrain::store::placement::{place, RamBudget};
use megatrain::store::{planes, HostBuffer, HostStore, StoreOptions};
use megatrain::topology::{probe, TopologySource};

fn rand(n: usize, seed: u64) -> Vec<f32> {
    megatrain::util::uniform(n, seed, 1.0)
}

fn store(mode: Mode, state: AdamState, master: MasterFormat) -> HostStore {
    // Odd sizes so chunks and tensors end inside SIMD vectors and inside int8 blocks.
    let cfg = ModelConfig::from_json_str(
        r#"{"architectures":["Qwen2ForCausalLM"],"hidden_size":72,"intermediate_size":200,
        "num_hidden_layers":3,"num_attention_heads":6,"num_key_value_heads":2,"vocab_size":333}"#,
        "t",
    )
    .unwrap();
    let layout = StateLayout::new(&cfg, mode)
        .with_adam_state(state)
        .with_master(master);
    let machine = probe(&TopologySource::Live).unwrap();
    let p = place(&machine, &layout, None, RamBudget::default()).unwrap();
    HostStore::allocate(layout, p, &StoreOptions::default()).unwrap()
}

/// One element's fp32 AdamW update (the scalar kernel on one element).
fn update_one(p: &mut f32, g: f32, m: &mut f32, v: &mut f32, seg: &Segment) {
    adamw::step_with(
        Isa::Scalar,
        AdamSlices {
            p: std::slice::from_mut(p),
            g: &[g],
            m: std::slice::from_mut(m),
            v: std::slice::from_mut(v),
        },
        &seg.scalars,
    );
}

/// The plain reference of a compact update: every moment expanded to fp32, each element
/// updated alone, then stored back: bf16 by stochastic rounding with the element's own random
/// bits, int8 per block of 2,048 by its new absmax and the nearest map value (binary search).
fn reference(
    state: AdamState,
    (p, g): (&mut [f32], &[f32]),
    (m, v): (&mut [u8], &mut [u8]),
    segs: &[Segment],
    salts: Salts,
) {
    let n = p.len();
    let mut m32 = moments::to_f32(state, m, n, true);
    let mut v32 = moments::to_f32(state, v, n, false);
    for seg in segs {
        for i in seg.start..seg.end {
            update_one(&mut p[i], g[i], &mut m32[i], &mut v32[i], seg);
        }
    }
    match state {
        AdamState::Fp32 => {
            for i in 0..n {
                m[4 * i..4 * i + 4].copy_from_slice(&m32[i].to_le_bytes());
                v[4 * i..4 * i + 4].copy_from_slice(&v32[i].to_le_bytes());
            }
        }
        AdamState::Bf16 => {
            for i in 0..n {
                let rm = bf16_stochastic(m32[i], hash32(i as u32 ^ salts.m));
                let rv = bf16_stochastic(v32[i], hash32(i as u32 ^ salts.v));
                m[2 * i..2 * i + 2].copy_from_slice(&rm.to_le_bytes());
                v[2 * i..2 * i + 2].copy_from_slice(&rv.to_le_bytes());
            }
        }
        AdamState::Int8 => {
            let quantise = |q: &Quantizer, x: &[f32], bytes: &mut [u8]| {
                let scales = AdamState::int8_scales_offset(n);
                for (b, block) in x.chunks(INT8_BLOCK).enumerate() {
                    let absmax = block.iter().fold(0f32, |a, x| a.max(x.abs()));
                    for (i, x) in block.iter().enumerate() {
                        bytes[b * INT8_BLOCK + i] = if absmax == 0.0 {
                            q.code_reference(0.0)
                        } else {
                            q.code_reference(x * (1.0 / absmax))
                        };
                    }
                    bytes[scales + 4 * b..scales + 4 * b + 4]
                        .copy_from_slice(&absmax.to_le_bytes());
                }
            };
            quantise(moments::signed(), &m32, m);
            quantise(moments::unsigned(), &v32, v);
        }
    }
}

/// Every unit: random params, gradients and moments (stored in the format), the pool's update
/// against the reference, bit for bit; Σ g² against the reference's.
fn pool_equals_reference(
    (mode, state, master): (Mode, AdamState, MasterFormat),
    isa: Isa,
    threads: usize,
) {
    let cfg = AdamWConfig {
        lr: 2e-3,
        weight_decay: 0.1,
        ..Default::default()
    };
    let s = store(mode, state, master);
    let pool = AdamPool::with_isa(&s.placement().adam_nodes(), Some(threads), isa).unwrap();
    let mut expected = Vec::new();
    let mut jobs = Vec::new();
    for u in 0..s.num_units() {
        let mut guard = s.take(u).unwrap();
        let n = guard.numel();
        let seed = 4 * u as u64;
        let (p0, g0, m0, v0) = (
            rand(n, seed),
            rand(n, seed + 1),
            rand(n, seed + 2),
            rand(n, seed + 3),
        );
        let v0: Vec<f32> = v0.iter().map(|x| x * x).collect();
        let mut sh = guard.shards().unwrap();
        sh.params.write(0, &p0);
        // The master holds p0 exactly in either format.
        assert_eq!(sh.params.to_vec(), p0);
        moments::from_f32(state, &m0, sh.m, true);
        moments::from_f32(state, &v0, sh.v, false);
        let (mb, vb) = (sh.m.to_vec(), sh.v.to_vec());
        let buffer = match sh.grads {
            Some(g) => {
                g.copy_from_slice(&g0);
                None
            }
            None => {
                let mut b = HostBuffer::allocate("lean gradient buffer", n, None, vec![]).unwrap();
                b.as_mut_slice().copy_from_slice(&g0);
                Some(b)
            }
        };
        let segs = unit_segments(s.layout(), u, &cfg, 3, 0.5, false);
        let salts = Salts::new(11, 3, u);
        let (mut p, mut m, mut v) = (p0.clone(), mb, vb);
        reference(state, (&mut p, &g0), (&mut m, &mut v), &segs, salts);
        let sumsq: f64 = g0.iter().map(|x| f64::from(*x) * f64::from(*x)).sum();
        expected.push((p, m, v, sumsq));
        let node = s.placement().worker_node(u).unwrap();
        jobs.push(pool.submit(node, guard, buffer, segs, salts).unwrap());
        // The unit belongs to the job until it is waited on.
        assert!(s.take(u).is_err());
    }
    let what = format!("{mode:?} {state:?} {master:?} {isa:?} {threads} thread(s)");
    for (u, job) in jobs.into_iter().enumerate() {
        let mut done = job.wait().unwrap();
        assert_eq!(done.guard.unit(), u);
        assert_eq!(done.grads.is_some(), mode == Mode::Lean);
        let (p, m, v, sumsq) = &expected[u];
        let mut got = done.guard.shards().unwrap();
        let same_bits = got
            .params
            .to_vec()
            .iter()
            .zip(p)
            .all(|(a, b)| a.to_bits() == b.to_bits());
        assert!(same_bits, "{what}: unit {u} params");
        if let Some(hi) = got.params.hi_plane() {
            // The streamed plane is the updated value rounded to bf16.
            assert!(hi.iter().zip(p).all(|(h, x)| *h == planes::split(*x).0));
        }
        assert!(got.m == &m[..], "{what}: unit {u} m");
        assert!(got.v == &v[..], "{what}: unit {u} v");
        assert!(
            (done.sumsq - sumsq).abs() <= 1e-9 * sumsq,
            "{what}: unit {u} sumsq {} vs {sumsq}",
            done.sumsq
        );
        drop(done);
        assert!(s.take(u).is_ok());
    }
}

#[test]
fn pool_equals_the_reference_in_every_format_isa_and_mode() {
    let isas: Vec<Isa> = [Isa::Scalar, Isa::Avx2, Isa::Avx512, Isa::Neon]
        .into_iter()
        .filter(|i| adamw::supported(*i))
        .collect();
    for master in [MasterFormat::Fp32, MasterFormat::Planes] {
        for state in [AdamState::Fp32, AdamState::Bf16, AdamState::Int8] {
            for &isa in &isas {
                pool_equals_reference((Mode::Exact, state, master), isa, 3);
            }
            pool_equals_reference((Mode::Lean, state, master), adamw::detect(), 2);
            pool_equals_reference((Mode::Exact, state, master), adamw::detect(), 1);
        }
    }
}

#[test]
fn lean_job_without_buffer_is_an_error() {
    let s = store(Mode::Lean, AdamState::Fp32, MasterFormat::Fp32);
    let pool = AdamPool::for_placement(s.placement(), Some(1)).unwrap();
    let g = s.take(1).unwrap();
    let segs = unit_segments(s.layout(), 1, &AdamWConfig::default(), 1, 1.0, true);
    let e = pool.submit(0, g, None, segs, Salts::default()).unwrap_err();
    assert!(e.to_string().contains("gradient buffer"), "{e}");
    // The guard was dropped with the failed submit: the unit is free again.
    assert!(s.take(1).is_ok());
}

/// Lean mode updates a unit larger than its piece in pieces, one job each (the lean buffer
/// holding just that piece's gradients): the same bits as the reference's whole-unit update in
/// every moment and master format (int8 blocks and bf16 rounding indices are the unit's, not
/// the piece's), and the pieces' Σ g² add up to the unit's.
#[test]
fn pieces_give_the_whole_update_in_every_format() {
    let cfg = AdamWConfig {
        lr: 2e-3,
        weight_decay: 0.1,
        ..Default::default()
    };
    // Pieces of two int8 blocks: every unit of the test model but the norms-only ones spans
    // several, the last one shorter.
    let piece = 2 * INT8_BLOCK;
    for master in [MasterFormat::Fp32, MasterFormat::Planes] {
        for state in [AdamState::Fp32, AdamState::Bf16, AdamState::Int8] {
            let s = store(Mode::Lean, state, master);
            let pool = AdamPool::for_placement(s.placement(), Some(2)).unwrap();
            for u in 0..s.num_units() {
                let mut guard = s.take(u).unwrap();
                let n = guard.numel();
                let seed = 7 * u as u64 + 1;
                let (p0, g0, m0) = (rand(n, seed), rand(n, seed + 1), rand(n, seed + 2));
                let v0: Vec<f32> = rand(n, seed + 3).iter().map(|x| x * x).collect();
                let mut sh = guard.shards().unwrap();
                sh.params.write(0, &p0);
                moments::from_f32(state, &m0, sh.m, true);
                moments::from_f32(state, &v0, sh.v, false);
                let (mut m, mut v) = (sh.m.to_vec(), sh.v.to_vec());
                let segs = unit_segments(s.layout(), u, &cfg, 2, 1.0, true);
                let salts = Salts::new(5, 2, u);
                let mut p = p0.clone();
                reference(state, (&mut p, &g0), (&mut m, &mut v), &segs, salts);
                let node = s.placement().worker_node(u).unwrap();
                let mut sumsq = 0.0;
                for start in (0..n).step_by(piece) {
                    let r = start..(start + piece).min(n);
                    let mut b = HostBuffer::allocate("lean gradient buffer", r.len(), None, vec![])
                        .unwrap();
                    b.as_mut_slice().copy_from_slice(&g0[r.clone()]);
                    let job = pool
                        .submit(node, guard, Some(b), piece_segments(&segs, r), salts)
                        .unwrap();
                    let done = job.wait().unwrap();
                    sumsq += done.sumsq;
                    guard = done.guard;
                }
                let what = format!("{state:?} {master:?} unit {u}");
                let got = guard.shards().unwrap();
                let same = got
                    .params
                    .to_vec()
                    .iter()
                    .zip(&p)
                    .all(|(a, b)| a.to_bits() == b.to_bits());
                assert!(same, "{what}: params");
                assert!(got.m == &m[..] && got.v == &v[..], "{what}: moments");
                let want: f64 = g0.iter().map(|x| f64::from(*x) * f64::from(*x)).sum();
                assert!(
                    (sumsq - want).abs() <= 1e-9 * want,
                    "{what}: Σg² {sumsq} vs {want}"
                );
                // A piece not starting on a whole int8 block is refused.
                if state == AdamState::Int8 && n > piece {
                    let segs = piece_segments(&segs, 100..n);
                    assert!(pool.submit(node, guard, None, segs, salts).is_err());
                }
            }
        }
    }
}

/// A job's Σ g² is the same bits however many workers split it (blocks of the job's elements
/// summed in order): ranks on different CPU shares compute the same lean-mode norm. The
/// updates themselves are element-wise, so they match too.
#[test]
fn sumsq_is_the_same_bits_for_any_worker_count() {
    let cfg = AdamWConfig::default();
    let mut seen: Option<Vec<(u64, Vec<u32>)>> = None;
    for threads in [1, 2, 3, 5] {
        let s = store(Mode::Lean, AdamState::Fp32, MasterFormat::Fp32);
        let pool = AdamPool::for_placement(s.placement(), Some(threads)).unwrap();
        let mut got = Vec::new();
        for u in 0..s.num_units() {
            let mut guard = s.take(u).unwrap();
            let n = guard.numel();
            let (p0, g0) = (rand(n, 3 * u as u64), rand(n, 3 * u as u64 + 1));
            guard.shards().unwrap().params.write(0, &p0);
            let mut b = HostBuffer::allocate("lean gradient buffer", n, None, vec![]).unwrap();
            // Magnitudes spread over decades, so the order of the additions shows in the bits.
            for (i, (d, g)) in b.as_mut_slice().iter_mut().zip(&g0).enumerate() {
                *d = g * 10f32.powi((i % 7) as i32 - 3);
            }
            let segs = unit_segments(s.layout(), u, &cfg, 1, 1.0, true);
            let node = s.placement().worker_node(u).unwrap();
            let job = pool
                .submit(node, guard, Some(b), segs, Salts::default())
                .unwrap();
            let mut done = job.wait().unwrap();
            let p = done.guard.shards().unwrap().params.to_vec();
            got.push((
                done.sumsq.to_bits(),
                p.iter().map(|x| x.to_bits()).collect(),
            ));
        }
        match &seen {
            None => seen = Some(got),
            Some(first) => {
                for (u, (a, b)) in first.iter().zip(&got).enumerate() {
                    assert_eq!(a.0, b.0, "unit {u}: Σg² with 1 worker vs {threads}");
                    assert!(a.1 == b.1, "unit {u}: params with 1 worker vs {threads}");
                }
            }
        }
    }
    assert!(seen.is_some_and(|s| s.len() > 2));
}
