//! The streaming engine on the CPU device: streamed steps equal the resident reference bit for
//! bit, device memory is the planned working set whatever the depth, random per-op delays change
//! nothing, and exact and lean modes agree.
#![allow(clippy::unwrap_used)]

use megatrain::device::cpu::{CpuDevice, CpuDeviceConfig};
use megatrain::device::program::Shape;
use megatrain::device::{Device, Precision};
use megatrain::engine::schedule::Op;
use megatrain::engine::{ActivationDtype, Activations, MicroBatch, Streamer, StreamerConfig};
use megatrain::model::config::ModelConfig;
use megatrain::model::layers::Workspace;
use megatrain::model::reference::{eval_loss, step_resident, Templates};
use megatrain::optim::adamw::{self, AdamSlices, AdamWConfig};
use megatrain::optim::{unit_segments, AdamPool};
use megatrain::spill::io::EngineKind;
use megatrain::store::layout::{MasterFormat, Mode, StateLayout};
use megatrain::store::placement::{place_with_spill, RamBudget, SpillPolicy, SpillRequest};
use megatrain::store::{HostStore, SpillOptions, StoreOptions};
use megatrain::topology::{probe, TopologySource};
use std::sync::Arc;

const B: usize = 2;
const T: usize = 24;

fn cfg(layers: usize, tied: bool) -> ModelConfig {
    cfg_vocab(layers, tied, 61)
}

/// With a vocabulary of 700, the embedding and head (22,400 parameters) are larger than a block
/// (about 10,000): lean mode drains and updates them in pieces of one block.
fn cfg_vocab(layers: usize, tied: bool, vocab: usize) -> ModelConfig {
    ModelConfig::from_json_str(
        &format!(
            r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":32,"intermediate_size":72,
            "num_hidden_layers":{layers},"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":{vocab},
            "tie_word_embeddings":{tied}}}"#
        ),
        "t",
    )
    .unwrap()
}

fn rand(n: usize, seed: u64, scale: f32) -> Vec<f32> {
    megatrain::util::uniform(n, seed, scale)
}

/// Random initial params per unit (norm weights near 1).
fn init(layout: &StateLayout) -> Vec<Vec<f32>> {
    layout
        .units
        .iter()
        .enumerate()
        .map(|(u, unit)| {
            let mut p = rand(unit.numel, u as u64 + 1, 0.1);
            for t in &unit.tensors {
                if t.shape.len() == 1 {
                    p[t.offset..t.offset + t.numel()]
                        .iter_mut()
                        .for_each(|x| *x += 1.0);
                }
            }
            p
        })
        .collect()
}

/// A micro-batch of packed documents, as the loader makes them: each row holds documents of
/// seeded lengths (positions restart at 0), a document's last token and a seeded share of its
/// prompt-like tokens have no target.
fn batch(seed: u64, vocab: u32) -> MicroBatch {
    let r = rand(3 * B * T + 1, seed, 1.0);
    let toks: Vec<u32> = r[..=B * T]
        .iter()
        .map(|x| ((x.abs() * 1000.0) as u32) % vocab)
        .collect();
    let mut lens = Vec::new();
    for row in 0..B {
        let mut left = T;
        let mut k = 0;
        while left > 0 {
            let l = (((r[B * T + row * T + k].abs() * 1e4) as usize) % T + 1).min(left);
            lens.push(l);
            left -= l;
            k += 1;
        }
    }
    let positions = megatrain::model::ops::document_positions(&lens);
    let targets: Vec<u32> = (0..B * T)
        .map(|i| {
            let last = i + 1 == B * T || positions[i + 1] == 0;
            let masked = r[2 * B * T + i] > 0.6;
            match last || masked {
                true => megatrain::model::ops::IGNORE,
                false => toks[i + 1],
            }
        })
        .collect();
    MicroBatch {
        tokens: toks[..B * T].to_vec().into(),
        targets: targets.into(),
        positions: positions.into(),
        pad: None,
    }
}

struct Rig {
    streamer: Streamer,
    device: Arc<CpuDevice>,
}

fn rig(
    c: &ModelConfig,
    mode: Mode,
    mbs: usize,
    cp: Activations,
    clip: f64,
    jitter: Option<(u64, u64)>,
    params: &[Vec<f32>],
) -> Rig {
    let shape = Shape::whole(B, T);
    rig_spill(
        c,
        mode,
        mbs,
        (cp, ActivationDtype::Fp32, 0),
        clip,
        jitter,
        params,
        None,
        (shape, Precision::Fp32),
    )
}

/// Where the NVMe tier goes, how many slots, which engine.
struct Spill<'a> {
    dir: &'a std::path::Path,
    policy: SpillPolicy,
    slots: usize,
    engine: EngineKind,
    budget: Option<u64>,
}

#[allow(clippy::too_many_arguments)]
fn rig_spill(
    c: &ModelConfig,
    mode: Mode,
    mbs: usize,
    (cp, dtype, device_inputs): (Activations, ActivationDtype, usize),
    clip: f64,
    jitter: Option<(u64, u64)>,
    params: &[Vec<f32>],
    spill: Option<Spill<'_>>,
    (shape, precision): (Shape, Precision),
) -> Rig {
    // bf16 streams the high plane of a master stored as planes, as `train` sets it up.
    let master = match precision {
        Precision::Fp32 => MasterFormat::Fp32,
        Precision::Bf16 => MasterFormat::Planes,
    };
    let layout = StateLayout::new(c, mode).with_master(master);
    let machine = probe(&TopologySource::Live).unwrap();
    let (req, opts, budget) = match &spill {
        Some(s) => (
            SpillRequest {
                policy: s.policy,
                slots: s.slots,
            },
            StoreOptions {
                spill: Some(SpillOptions {
                    engine: s.engine,
                    extent_bytes: 64 << 10,
                    ..SpillOptions::new(vec![s.dir.join("nvme0"), s.dir.join("nvme1")])
                }),
                ..StoreOptions::default()
            },
            RamBudget {
                total_bytes: s.budget,
                ..RamBudget::default()
            },
        ),
        None => (
            SpillRequest::default(),
            StoreOptions::default(),
            RamBudget::default(),
        ),
    };
    let placement = place_with_spill(&machine, &layout, None, budget, req).unwrap();
    assert_eq!(placement.spill.is_some(), spill.is_some());
    let store = HostStore::allocate(layout.clone(), placement, &opts).unwrap();
    for (u, p) in params.iter().enumerate() {
        store.take(u).unwrap().master().write(0, p);
    }
    let pool = AdamPool::for_placement(store.placement(), Some(2)).unwrap();
    let tm = Arc::new(Templates::new(&layout.config, shape.t).unwrap());
    let device = Arc::new(
        CpuDevice::new(
            CpuDeviceConfig {
                capacity_bytes: 64 << 20,
                link: None,
                jitter,
                shape,
                precision,
            },
            tm.clone(),
        )
        .unwrap(),
    );
    let streamer = Streamer::new(
        device.clone(),
        store,
        pool,
        tm,
        StreamerConfig {
            batch: shape.b,
            seq: shape.t,
            micro_batches: mbs,
            activations: cp,
            activation_dtype: dtype,
            device_inputs,
            adam: AdamWConfig {
                weight_decay: 0.1,
                ..Default::default()
            },
            grad_clip: clip,
            decay_norms: true,
            seed: 0,
            grad_link: megatrain::device::GradLink::Fp32,
        },
    )
    .unwrap();
    Rig { streamer, device }
}

fn unit_params(s: &mut Streamer) -> Vec<Vec<f32>> {
    s.finish().unwrap();
    (0..s.store().num_units())
        .map(|u| s.store().take(u).unwrap().master().to_vec())
        .collect()
}

fn bits(v: &[Vec<f32>]) -> Vec<Vec<u32>> {
    v.iter()
        .map(|u| u.iter().map(|x| x.to_bits()).collect())
        .collect()
}

/// The resident reference: per micro-batch grads in zeroed buffers, summed on the host in order,
/// global-norm clipping, then AdamW on every unit.
fn reference(
    c: &ModelConfig,
    params: &[Vec<f32>],
    batches: &[MicroBatch],
    clip: f64,
    lr: f64,
) -> (f64, Vec<Vec<f32>>, Vec<Vec<f32>>) {
    let layout = StateLayout::new(c, Mode::Exact);
    let tm = Templates::new(&layout.config, T).unwrap();
    let mut ws = Workspace::new(c, B, T);
    let total = batches
        .iter()
        .map(MicroBatch::trained_tokens)
        .sum::<usize>() as f32;
    let mut grads: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
    let mut loss = 0.0;
    for (j, mb) in batches.iter().enumerate() {
        let mut g1: Vec<Vec<f32>> = params.iter().map(|p| vec![0.0; p.len()]).collect();
        let refs: Vec<&[f32]> = params.iter().map(|v| &v[..]).collect();
        let mut gr: Vec<&mut [f32]> = g1.iter_mut().map(|v| &mut v[..]).collect();
        loss += step_resident(
            &tm,
            &refs,
            &mut gr,
            &mb.tokens,
            &mb.targets,
            &mb.positions,
            B,
            T,
            1.0 / total,
            &mut ws,
        )
        .unwrap();
        for (a, b) in grads.iter_mut().zip(&g1) {
            if j == 0 {
                a.copy_from_slice(b);
            } else {
                a.iter_mut().zip(b).for_each(|(x, y)| *x += *y);
            }
        }
    }
    let norm: f64 = grads.iter().map(|g| adamw::sumsq(g)).sum::<f64>().sqrt();
    let coef = if clip > 0.0 {
        (clip / (norm + 1e-6)).min(1.0)
    } else {
        1.0
    };
    let cfg = AdamWConfig {
        lr,
        weight_decay: 0.1,
        ..Default::default()
    };
    let mut p = params.to_vec();
    for u in 0..p.len() {
        let (mut m, mut v) = (vec![0.0; p[u].len()], vec![0.0; p[u].len()]);
        for seg in unit_segments(&layout, u, &cfg, 1, coef as f32, true) {
            let r = seg.start..seg.end;
            adamw::step(
                AdamSlices {
                    p: &mut p[u][r.clone()],
                    g: &grads[u][r.clone()],
                    m: &mut m[r.clone()],
                    v: &mut v[r],
                },
                &seg.scalars,
            );
        }
    }
    (loss / total as f64, grads, p)
}

#[test]
fn streamed_step_is_bit_identical_to_resident() {
    for (tied, cp, mbs, clip) in [
        (false, Activations::Host, 1, 0.0),
        (true, Activations::Host, 2, 0.5),
        (false, Activations::Device, 2, 0.0),
        (true, Activations::Device, 1, 1e-3),
        (false, Activations::Keep, 2, 0.5),
        (true, Activations::Keep, 1, 0.0),
    ] {
        let c = cfg(3, tied);
        let params = init(&StateLayout::new(&c, Mode::Exact));
        let batches: Vec<MicroBatch> = (0..mbs).map(|j| batch(10 + j as u64, 61)).collect();
        let (loss, grads, after) = reference(&c, &params, &batches, clip, 1e-3);
        let mut r = rig(&c, Mode::Exact, mbs, cp, clip, None, &params);
        let m = r.streamer.step(&batches, 1e-3).unwrap();
        assert_eq!(m.loss.to_bits(), loss.to_bits(), "{tied} {cp:?}: loss");
        let got_grads: Vec<Vec<f32>> = {
            r.streamer.finish().unwrap();
            (0..r.streamer.store().num_units())
                .map(|u| {
                    r.streamer
                        .store()
                        .take(u)
                        .unwrap()
                        .grads()
                        .unwrap()
                        .to_vec()
                })
                .collect()
        };
        assert_eq!(bits(&got_grads), bits(&grads), "{tied} {cp:?}: grads");
        assert_eq!(
            bits(&unit_params(&mut r.streamer)),
            bits(&after),
            "{tied} {cp:?}: params after AdamW"
        );
        assert!(m.clip_coef <= 1.0 && m.grad_norm > 0.0);
    }
}

#[test]
fn device_peak_is_the_planned_working_set_for_any_depth() {
    let mut peaks = Vec::new();
    for layers in [2, 32] {
        let c = cfg(layers, false);
        let params = init(&StateLayout::new(&c, Mode::Exact));
        let mut r = rig(&c, Mode::Exact, 1, Activations::Host, 0.0, None, &params);
        let planned: u64 = r.device.memory().in_use;
        let m = r.streamer.step(&[batch(1, 61)], 1e-3).unwrap();
        assert_eq!(
            m.device_peak_bytes, planned,
            "{layers} layers: peak equals the allocation made up front"
        );
        peaks.push(m.device_peak_bytes);
    }
    assert_eq!(peaks[0], peaks[1], "device memory must not grow with depth");
}

/// With token chunks the device peak grows with the sequence only by what attention keeps for the
/// whole sequence (K, V and their gradients, one loss per token) and the layer-boundary buffers
/// (x and its gradient, two each): `4·(4·kv_dim + 1) + 4·4·hidden` bytes per token, 772 here —
/// from the head's chunk on (`ce_chunk_rows`: 4096 rows for this vocabulary; below it the chunk
/// is the micro-batch). Steps at 4k and 8k tokens allocate nothing beyond what is set up front;
/// 16k and 32k are set up.
#[test]
fn device_peak_grows_with_the_sequence_only_by_what_attention_keeps() {
    let c = cfg(2, false);
    let params = init(&StateLayout::new(&c, Mode::Exact));
    let per_token = 4 * (4 * c.kv_dim() as u64 + 1) + 4 * 4 * c.hidden_size as u64;
    assert_eq!(per_token, 772);
    assert_eq!(megatrain::model::ops::ce_chunk_rows(c.vocab_size), 4096);
    let mut peaks = Vec::new();
    for t in [4096usize, 8192, 16384, 32768] {
        let shape = Shape::chunked(1, t, 512).unwrap();
        let mut r = rig_spill(
            &c,
            Mode::Exact,
            1,
            (Activations::Host, ActivationDtype::Fp32, 0),
            0.0,
            None,
            &params,
            None,
            (shape, Precision::Fp32),
        );
        let planned = r.device.memory().in_use;
        if t <= 8192 {
            let toks: Vec<u32> = (0..=t as u32).map(|i| (i * 7 + i / 5) % 61).collect();
            let mb = MicroBatch {
                tokens: toks[..t].to_vec().into(),
                targets: toks[1..].to_vec().into(),
                positions: megatrain::model::ops::flat_positions(1, t).into(),
                pad: None,
            };
            let m = r.streamer.step(&[mb], 1e-3).unwrap();
            assert!(m.loss.is_finite());
            assert_eq!(
                m.device_peak_bytes, planned,
                "T {t}: the step allocates nothing more"
            );
        }
        peaks.push((t as u64, planned));
    }
    for w in peaks.windows(2) {
        let ((t0, p0), (t1, p1)) = (w[0], w[1]);
        assert_eq!(p1 - p0, per_token * (t1 - t0), "from {t0} to {t1} tokens");
    }
}

#[test]
fn random_delays_on_every_stream_change_no_bits() {
    let c = cfg(3, true);
    let params = init(&StateLayout::new(&c, Mode::Exact));
    let batches: Vec<Vec<MicroBatch>> = (0..3)
        .map(|s| vec![batch(100 + s, 61), batch(200 + s, 61)])
        .collect();
    let run = |jitter: Option<(u64, u64)>, cp: Activations| {
        let mut r = rig(&c, Mode::Exact, 2, cp, 1.0, jitter, &params);
        let losses: Vec<u64> = batches
            .iter()
            .map(|b| r.streamer.step(b, 1e-3).unwrap().loss.to_bits())
            .collect();
        (losses, bits(&unit_params(&mut r.streamer)))
    };
    let want = run(None, Activations::Host);
    for seed in 1..=12 {
        // Kept internals (no recompute) give the same bits too, under the same random delays.
        let cp = [Activations::Host, Activations::Keep][seed as usize % 2];
        assert_eq!(
            run(Some((seed, 300)), cp),
            want,
            "jitter seed {seed}, {cp:?}"
        );
    }
}

/// Lean mode (its embedding and head in pieces with the large vocabulary, tied or not) trains
/// to the exact mode's bits when nothing is clipped.
#[test]
fn exact_and_lean_agree_without_clipping() {
    for (vocab, tied, pieces) in [(61, false, 1), (700, false, 3), (700, true, 3)] {
        let c = cfg_vocab(2, tied, vocab);
        let lean = StateLayout::new(&c, Mode::Lean);
        assert_eq!(lean.lean_pieces(0), pieces, "vocab {vocab}");
        assert!(lean.lean_piece_elems() < lean.max_unit_numel() || pieces == 1);
        let params = init(&StateLayout::new(&c, Mode::Exact));
        let b = vec![batch(7, vocab as u32)];
        let mut ex = rig(&c, Mode::Exact, 1, Activations::Host, 0.0, None, &params);
        let mut le = rig(&c, Mode::Lean, 1, Activations::Host, 0.0, None, &params);
        for _ in 0..3 {
            let a = ex.streamer.step(&b, 1e-3).unwrap();
            let l = le.streamer.step(&b, 1e-3).unwrap();
            assert_eq!(a.loss.to_bits(), l.loss.to_bits());
            assert!((a.grad_norm - l.grad_norm).abs() <= 1e-9 * a.grad_norm);
        }
        assert_eq!(
            bits(&unit_params(&mut ex.streamer)),
            bits(&unit_params(&mut le.streamer)),
            "vocab {vocab} tied {tied}"
        );
    }
}

#[test]
fn lean_mode_refuses_gradient_accumulation_and_bad_batches_are_named() {
    let c = cfg(2, false);
    let layout = StateLayout::new(&c, Mode::Lean);
    let params = init(&layout);
    let r =
        std::panic::catch_unwind(|| rig(&c, Mode::Lean, 2, Activations::Host, 0.0, None, &params));
    assert!(r.is_err(), "lean + grad accumulation must be refused");
    let mut ok = rig(&c, Mode::Exact, 1, Activations::Host, 0.0, None, &params);
    let mut bad = batch(1, 61);
    let mut t = bad.tokens.to_vec();
    t[3] = 999;
    bad.tokens = t.into();
    let e = ok.streamer.step(&[bad], 1e-3).unwrap_err().to_string();
    assert!(e.contains("999") && e.contains("vocab"), "{e}");
}

#[test]
fn metrics_count_the_bytes_and_the_trace_has_every_track() {
    let c = cfg(3, false);
    let layout = StateLayout::new(&c, Mode::Exact);
    let params = init(&layout);
    let mut r = rig(&c, Mode::Exact, 1, Activations::Host, 0.0, None, &params);
    let m1 = r.streamer.step(&[batch(1, 61)], 1e-3).unwrap();
    let m2 = r.streamer.step(&[batch(2, 61)], 1e-3).unwrap();
    r.streamer.finish().unwrap();
    // Weights: every unit in the forward, all but the resident last block again in the backward
    // (the head once: loss and backward are one kernel). Checkpoints x0..x(L-2) come back in.
    let unit_bytes: Vec<u64> = layout.units.iter().map(|u| 4 * u.numel as u64).collect();
    let l = c.num_layers;
    let act = 4 * (B * T * c.hidden_size) as u64;
    let weights_in: u64 = unit_bytes.iter().sum::<u64>() + unit_bytes[1..l].iter().sum::<u64>();
    assert_eq!(m1.htod_bytes, weights_in + (l as u64 - 1) * act);
    // Out: every unit's gradients once, checkpoints x0..x(L-1).
    assert_eq!(
        m1.dtoh_bytes,
        unit_bytes.iter().sum::<u64>() + l as u64 * act
    );
    assert_eq!(m2.htod_bytes, m1.htod_bytes);
    assert!(m2.compute_s > 0.0 && m2.wall_s > 0.0);
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.json");
    r.streamer.timeline().write_chrome(&path).unwrap();
    let v: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(&path).unwrap()).unwrap();
    let tracks: Vec<String> = v["traceEvents"]
        .as_array()
        .unwrap()
        .iter()
        .filter(|e| e["ph"] == "M")
        .map(|e| e["args"]["name"].as_str().unwrap().to_owned())
        .collect();
    for want in [
        "compute",
        "copy-in (htod)",
        "copy-out (dtoh)",
        "adamw node 0",
    ] {
        assert!(
            tracks.iter().any(|t| t == want),
            "track {want} missing from {tracks:?}"
        );
    }
}

/// Adam m/v on NVMe (through the io_uring tier or the pread/pwrite threads, 1 to 3 staging
/// slots, every unit or only what a RAM budget forces out) change no bit of training, in exact
/// and lean mode; the metrics show the NVMe traffic.
#[test]
fn spilled_optimizer_state_trains_bit_identically() {
    for vocab in [61, 700] {
        spilled_state_trains_bit_identically(vocab);
    }
}

/// The spill check for one vocabulary (700: the embedding and head spill and, in lean mode, are
/// updated in pieces, staged once for all of them).
fn spilled_state_trains_bit_identically(vocab: usize) {
    let c = cfg_vocab(4, false, vocab);
    let params = init(&StateLayout::new(&c, Mode::Exact));
    let batches: Vec<Vec<MicroBatch>> =
        (0..4).map(|s| vec![batch(300 + s, vocab as u32)]).collect();
    let run = |mode: Mode, spill: Option<Spill<'_>>| {
        let spilled = spill.is_some();
        let mut r = rig_spill(
            &c,
            mode,
            1,
            (Activations::Host, ActivationDtype::Fp32, 0),
            0.5,
            None,
            &params,
            spill,
            (Shape::whole(B, T), Precision::Fp32),
        );
        let mut nvme = (0u64, 0u64);
        let losses: Vec<u64> = batches
            .iter()
            .map(|b| {
                let m = r.streamer.step(b, 1e-3).unwrap();
                nvme.0 += m.nvme_read_bytes;
                nvme.1 += m.nvme_write_bytes;
                m.loss.to_bits()
            })
            .collect();
        let p = bits(&unit_params(&mut r.streamer));
        let store = r.streamer.store();
        let n_spilled = (0..store.num_units())
            .filter(|&u| store.is_spilled(u))
            .count();
        if spilled {
            store.spill().unwrap().flush().unwrap();
            assert!(nvme.1 > 0, "write-backs counted in the step metrics");
        } else {
            assert_eq!(nvme, (0, 0));
        }
        // Everything written over the run, the last write-backs included.
        let written = store.spill_stats().bytes_written;
        ((losses, p), (n_spilled, written))
    };
    // NVMe bytes written with every unit spilled, per mode: each unit is written back once per
    // step, however many pieces lean mode updates it in.
    let mut written = Vec::new();
    for mode in [Mode::Exact, Mode::Lean] {
        let (want, _) = run(mode, None);
        for (slots, engine, policy) in [
            (3, EngineKind::Auto, SpillPolicy::All),
            (1, EngineKind::Sync, SpillPolicy::All),
            (2, EngineKind::Auto, SpillPolicy::Auto),
        ] {
            let d = tempfile::tempdir().unwrap();
            let layout = StateLayout::new(&c, mode);
            // Auto: a budget 8 KiB short of the whole state forces some units out, not all.
            let budget = (policy == SpillPolicy::Auto).then(|| layout.total_bytes() - 8192);
            let (got, (n_spilled, bytes)) = run(
                mode,
                Some(Spill {
                    dir: d.path(),
                    policy,
                    slots,
                    engine,
                    budget,
                }),
            );
            assert_eq!(
                got, want,
                "vocab {vocab} {mode:?} slots={slots} {engine:?} {policy:?}"
            );
            let units = layout.units.len();
            if (slots, policy) == (3, SpillPolicy::All) {
                written.push(bytes);
            }
            match policy {
                SpillPolicy::All => assert_eq!(n_spilled, units),
                _ => assert!(n_spilled > 0 && n_spilled < units, "{n_spilled} of {units}"),
            }
        }
    }
    assert_eq!(
        written[0], written[1],
        "vocab {vocab}: NVMe bytes written, exact vs lean"
    );
}

/// `--precision bf16` through the streamer: the weights cross the link as the master's bf16
/// high plane (half the bytes of fp32; the gradients stay fp32), the master stays exact fp32
/// (planes), training tracks the fp32 run to bf16's precision, and two bf16 runs are identical.
#[test]
fn bf16_streams_half_the_weight_bytes_and_tracks_fp32() {
    let c = cfg(2, false);
    let params = init(&StateLayout::new(&c, Mode::Exact));
    let batches: Vec<Vec<MicroBatch>> = (0..3).map(|s| vec![batch(500 + s, 61)]).collect();
    let run = |precision: Precision| {
        let mut r = rig_spill(
            &c,
            Mode::Exact,
            1,
            (Activations::Host, ActivationDtype::Fp32, 0),
            1.0,
            None,
            &params,
            None,
            (Shape::whole(B, T), precision),
        );
        let m: Vec<_> = batches
            .iter()
            .map(|b| r.streamer.step(b, 1e-3).unwrap())
            .collect();
        // The weight elements a step copies in (a unit may cross twice).
        let units = &r.streamer.store().layout().units;
        let crossed: u64 = (r.streamer.schedule().tasks.iter())
            .filter_map(|t| match t.op {
                Op::CopyWeights { unit, .. } => Some(units[unit].numel as u64),
                _ => None,
            })
            .sum();
        (m, unit_params(&mut r.streamer), crossed)
    };
    let (m32, p32, crossed) = run(Precision::Fp32);
    let (m16, p16, _) = run(Precision::Bf16);
    let (again, p16b, _) = run(Precision::Bf16);
    assert!(crossed > 0);
    for ((a, b), c2) in m32.iter().zip(&m16).zip(&again) {
        // 4 bytes per weight element in fp32, 2 in bf16; the activations' copies are the same.
        assert_eq!(
            a.htod_bytes - b.htod_bytes,
            2 * crossed,
            "bf16 halves the weight bytes"
        );
        assert_eq!(a.dtoh_bytes, b.dtoh_bytes, "gradients cross in fp32");
        let rel = ((a.loss - b.loss) / a.loss).abs();
        assert!(
            rel > 0.0 && rel < 1e-2,
            "bf16 loss {} vs fp32 {}",
            b.loss,
            a.loss
        );
        assert_eq!(
            b.loss.to_bits(),
            c2.loss.to_bits(),
            "bf16 runs are deterministic"
        );
    }
    assert_eq!(bits(&p16), bits(&p16b));
    // The updates differ (bf16 forward and backward), but by little.
    let (mut num, mut den) = (0f64, 0f64);
    for ((a, b), p0) in p32.iter().zip(&p16).zip(&params) {
        for ((x, y), z) in a.iter().zip(b).zip(p0) {
            num += f64::from(x - y).powi(2);
            den += f64::from(x - z).powi(2);
        }
    }
    assert!(
        num.sqrt() < 0.1 * den.sqrt(),
        "update difference {} of {}",
        num.sqrt(),
        den.sqrt()
    );
}

/// A bf16 device needs a master stored as planes (it streams their high plane), an fp32 device
/// an fp32 master: a mismatch is refused when the streamer opens, naming both.
#[test]
fn device_precision_and_master_format_must_agree() {
    let c = cfg(1, false);
    for (master, precision) in [
        (MasterFormat::Fp32, Precision::Bf16),
        (MasterFormat::Planes, Precision::Fp32),
    ] {
        let layout = StateLayout::new(&c, Mode::Exact).with_master(master);
        let machine = probe(&TopologySource::Live).unwrap();
        let placement = place_with_spill(
            &machine,
            &layout,
            None,
            RamBudget::default(),
            SpillRequest::default(),
        )
        .unwrap();
        let store =
            HostStore::allocate(layout.clone(), placement, &StoreOptions::default()).unwrap();
        let pool = AdamPool::for_placement(store.placement(), Some(1)).unwrap();
        let tm = Arc::new(Templates::new(&layout.config, T).unwrap());
        let device = Arc::new(
            CpuDevice::new(
                CpuDeviceConfig {
                    capacity_bytes: 64 << 20,
                    link: None,
                    jitter: None,
                    shape: Shape::whole(B, T),
                    precision,
                },
                tm.clone(),
            )
            .unwrap(),
        );
        let e = Streamer::new(
            device,
            store,
            pool,
            tm,
            StreamerConfig {
                batch: B,
                seq: T,
                micro_batches: 1,
                activations: Activations::Host,
                activation_dtype: ActivationDtype::Fp32,
                device_inputs: 0,
                adam: AdamWConfig::default(),
                grad_clip: 0.0,
                decay_norms: true,
                seed: 0,
                grad_link: megatrain::device::GradLink::Fp32,
            },
        )
        .unwrap_err()
        .to_string();
        assert!(
            e.contains(precision.name()) && e.contains(master.name()),
            "{e}"
        );
    }
}

/// `--grad-link bf16` on the CPU device: a device→host copy lands each value rounded to bf16
/// (nearest even, ties included) and widened, assigned or added, bit for bit; a plain copy lands
/// the values themselves (the self-test's check, which runs on the CUDA device too).
#[test]
fn bf16_gradients_land_rounded_to_nearest_even() {
    let tm = Arc::new(Templates::new(&cfg(1, false), T).unwrap());
    let device = CpuDevice::new(
        CpuDeviceConfig {
            capacity_bytes: 64 << 20,
            link: None,
            jitter: None,
            shape: Shape::whole(B, T),
            precision: Precision::Bf16,
        },
        tm,
    )
    .unwrap();
    let checks = megatrain::selftest::landings(&device, 10_000, 7).unwrap();
    assert_eq!(checks.len(), 4);
    for c in &checks {
        assert!(c.pass, "{c:?}");
    }
}

/// A bf16 device holds the weight double buffers in bf16, and the activations the recipe
/// stores in bf16 (in the layer workspace and in kept internals) at 2 B per element: the
/// planned working set (`engine::device_bytes` of a planes layout, `workspace_bytes`) counts
/// them so, the device charges exactly that (the CPU device holds them in fp32), and a step
/// allocates nothing more.
#[test]
fn bf16_devices_hold_weights_and_stored_activations_in_bf16() {
    use megatrain::device::program::{internals_len, workspace_bytes};
    use megatrain::engine::device_bytes;
    let c = cfg(2, false);
    let params = init(&StateLayout::new(&c, Mode::Exact));
    for activations in [Activations::Host, Activations::Keep] {
        let mut allocated = Vec::new();
        for (precision, master) in [
            (Precision::Fp32, MasterFormat::Fp32),
            (Precision::Bf16, MasterFormat::Planes),
        ] {
            let mut r = rig_spill(
                &c,
                Mode::Exact,
                1,
                (activations, ActivationDtype::Fp32, 0),
                0.0,
                None,
                &params,
                None,
                (Shape::whole(B, T), precision),
            );
            let what = format!("{precision:?}, {activations:?}");
            let workspace = workspace_bytes(&c, Shape::whole(B, T), precision);
            assert_eq!(r.device.workspace_bytes(), workspace, "{what}");
            let layout = StateLayout::new(&c, Mode::Exact).with_master(master);
            let planned = device_bytes(&layout, B, T, 1, (activations, ActivationDtype::Fp32, 0));
            let up_front = r.device.memory().in_use - workspace;
            assert_eq!(up_front, planned, "{what}");
            let m = r.streamer.step(&[batch(1, 61)], 1e-3).unwrap();
            assert_eq!(m.device_peak_bytes, r.device.memory().in_use, "{what}");
            allocated.push((workspace, up_front));
        }
        // Two weight buffers of the largest unit, 2 B per element less; kept internals, one
        // buffer per layer, the stored regions in half the words.
        let unit = StateLayout::new(&c, Mode::Exact).max_unit_numel() as u64;
        let kept = match activations {
            Activations::Keep => {
                let words = |p| internals_len(&c, B * T, p) as u64;
                2 * 4 * (words(Precision::Fp32) - words(Precision::Bf16))
            }
            _ => 0,
        };
        let ((ws32, buf32), (ws16, buf16)) = (allocated[0], allocated[1]);
        assert_eq!(buf32 - buf16, 2 * 2 * unit + kept, "{activations:?}");
        assert!(ws16 < ws32, "{ws16} {ws32}");
    }
    // Layer inputs stored in bf16: the device charges what the plan counts (2 B per stored
    // element), L of them on the device beside two fp32 boundary buffers, two staging buffers
    // when offloaded; and the step's bf16 recipe gives the same on both.
    let layout = StateLayout::new(&c, Mode::Exact).with_master(MasterFormat::Planes);
    let input = (B * T * c.hidden_size) as u64;
    let mut runs = Vec::new();
    for activations in [Activations::Device, Activations::Host] {
        let planned = |dtype| device_bytes(&layout, B, T, 1, (activations, dtype, 0));
        let mut r = rig_spill(
            &c,
            Mode::Exact,
            1,
            (activations, ActivationDtype::Bf16, 0),
            0.0,
            None,
            &params,
            None,
            (Shape::whole(B, T), Precision::Bf16),
        );
        let workspace = workspace_bytes(&c, Shape::whole(B, T), Precision::Bf16);
        let up_front = r.device.memory().in_use - workspace;
        assert_eq!(up_front, planned(ActivationDtype::Bf16), "{activations:?}");
        let saved = match activations {
            // L + 1 fp32 inputs become 2 fp32 buffers and L bf16 ones.
            Activations::Device => {
                4 * input * (c.num_layers as u64 + 1)
                    - (8 * input + 2 * input * c.num_layers as u64)
            }
            // Two bf16 staging buffers more.
            _ => 0,
        };
        let extra = planned(ActivationDtype::Bf16) as i64 - planned(ActivationDtype::Fp32) as i64;
        match activations {
            Activations::Device => assert_eq!(extra, -(saved as i64)),
            _ => assert_eq!(extra, 4 * input as i64),
        }
        let m = r.streamer.step(&[batch(1, 61)], 1e-3).unwrap();
        assert_eq!(
            m.device_peak_bytes,
            r.device.memory().in_use,
            "{activations:?}"
        );
        runs.push((m.loss, m.grad_norm));
    }
    assert_eq!(runs[0], runs[1]);
}

/// Validation streams through the training device ([`Streamer::evaluate`]): its forward-only
/// pass gives the resident reference's loss (fp32: the same ops, to 1e-6 relative) in every
/// activations mode, tied or not, before and after a step (whose AdamW jobs it waits for);
/// it leaves the state and the next step as they were, and in bf16 tracks fp32.
#[test]
fn evaluation_on_the_device_is_the_reference_loss_and_changes_nothing() {
    let reference_loss = |c: &ModelConfig, params: &[Vec<f32>], mb: &MicroBatch| {
        let tm = Templates::new(c, T).unwrap();
        let mut ws = Workspace::new(c, B, T);
        let refs: Vec<&[f32]> = params.iter().map(|v| &v[..]).collect();
        eval_loss(
            &tm,
            &refs,
            &mb.tokens,
            &mb.targets,
            &mb.positions,
            B,
            T,
            &mut ws,
        )
        .unwrap()
    };
    let close = |got: f64, want: f64, what: &str| {
        assert!(
            ((got - want) / want).abs() < 1e-6,
            "{what}: device {got} vs reference {want}"
        );
    };
    let (val, train) = (batch(900, 61), vec![batch(901, 61)]);
    for (tied, cp) in [
        (false, Activations::Host),
        (true, Activations::Device),
        (false, Activations::Keep),
    ] {
        let c = cfg(2, tied);
        let params = init(&StateLayout::new(&c, Mode::Exact));
        let mut r = rig(&c, Mode::Exact, 1, cp, 1.0, None, &params);
        let got = r.streamer.evaluate(&val).unwrap();
        close(got, reference_loss(&c, &params, &val), "before a step");
        assert_eq!(r.streamer.evaluate(&val).unwrap().to_bits(), got.to_bits());
        let m = r.streamer.step(&train, 1e-3).unwrap();
        // Right after the step, its AdamW jobs may still run: the pass waits for them.
        let after = r.streamer.evaluate(&val).unwrap();
        let updated = unit_params(&mut r.streamer);
        close(after, reference_loss(&c, &updated, &val), "after a step");
        assert_ne!(
            after.to_bits(),
            got.to_bits(),
            "the step changed the weights"
        );
        // The same step without the passes: the same loss and weights, bit for bit.
        let mut plain = rig(&c, Mode::Exact, 1, cp, 1.0, None, &params);
        let m2 = plain.streamer.step(&train, 1e-3).unwrap();
        assert_eq!(m.loss.to_bits(), m2.loss.to_bits());
        assert_eq!(bits(&updated), bits(&unit_params(&mut plain.streamer)));
        let next = r.streamer.step(&train, 1e-3).unwrap();
        let next2 = plain.streamer.step(&train, 1e-3).unwrap();
        assert_eq!(next.loss.to_bits(), next2.loss.to_bits());
        assert_eq!(
            next.htod_bytes, next2.htod_bytes,
            "the pass's copies are not the step's"
        );
    }
    // bf16: the forward of the bf16 recipe, near fp32's.
    let c = cfg(2, false);
    let params = init(&StateLayout::new(&c, Mode::Exact));
    let mut r = rig_spill(
        &c,
        Mode::Exact,
        1,
        (Activations::Host, ActivationDtype::Fp32, 0),
        1.0,
        None,
        &params,
        None,
        (Shape::whole(B, T), Precision::Bf16),
    );
    let (got, want) = (
        r.streamer.evaluate(&val).unwrap(),
        reference_loss(&c, &params, &val),
    );
    let rel = ((got - want) / want).abs();
    assert!(rel > 0.0 && rel < 1e-2, "bf16 {got} vs fp32 {want}");
}

/// Host activations with the last blocks' inputs kept on the device (as many as it holds): any
/// split gives the bits of all offloaded and of all on the device, in fp32 and with bf16 inputs
/// (the bf16 recipe), over accumulated micro-batches and steps; the device charges what
/// `engine::device_bytes` plans, which grows with the inputs kept; only the offloaded inputs
/// cross the link.
#[test]
fn inputs_split_between_device_and_host_change_no_bit() {
    let c = cfg(4, false);
    let l = c.num_layers;
    for (precision, master, dtype) in [
        (Precision::Fp32, MasterFormat::Fp32, ActivationDtype::Fp32),
        (Precision::Bf16, MasterFormat::Planes, ActivationDtype::Bf16),
        (Precision::Bf16, MasterFormat::Planes, ActivationDtype::Fp32),
    ] {
        let layout = StateLayout::new(&c, Mode::Exact).with_master(master);
        let params = init(&layout);
        let mut runs = Vec::new();
        let mut planned_bytes = Vec::new();
        let mut loads = Vec::new();
        let placements = [
            (Activations::Host, 0),
            (Activations::Host, 1),
            (Activations::Host, l - 1),
            (Activations::Device, 0),
        ];
        for (activations, kept) in placements {
            let what = format!("{precision:?} {dtype:?} {activations:?} {kept}");
            let mut r = rig_spill(
                &c,
                Mode::Exact,
                2,
                (activations, dtype, kept),
                1.0,
                Some((7, 50)),
                &params,
                None,
                (Shape::whole(B, T), precision),
            );
            let workspace =
                megatrain::device::program::workspace_bytes(&c, Shape::whole(B, T), precision);
            let planned =
                megatrain::engine::device_bytes(&layout, B, T, 2, (activations, dtype, kept));
            assert_eq!(r.device.memory().in_use - workspace, planned, "{what}");
            planned_bytes.push(planned);
            let mut steps = Vec::new();
            for s in 0..2u64 {
                let m = r
                    .streamer
                    .step(&[batch(10 + s, 61), batch(20 + s, 61)], 1e-3)
                    .unwrap();
                // Each offloaded input goes out and comes back, but the last one's (still on
                // the device): the host→device bytes beyond the weights'.
                let offloaded = match activations {
                    Activations::Host => (l - kept) as u64,
                    _ => 0,
                };
                let elem = match dtype {
                    ActivationDtype::Fp32 => 4,
                    ActivationDtype::Bf16 => 2,
                };
                let input = (B * T * c.hidden_size) as u64 * elem;
                steps.push((m.loss, m.grad_norm));
                loads.push((m.htod_bytes, 2 * offloaded.saturating_sub(1) * input));
                steps.push((m.loss, m.grad_norm));
            }
            runs.push((what, steps));
        }
        for (what, steps) in &runs[1..] {
            assert_eq!(steps, &runs[0].1, "{what} vs {}", runs[0].0);
        }
        // The weights' bytes are the device placement's (the last entry per step).
        let weights = loads[loads.len() - 1].0;
        for (htod, inputs) in &loads {
            assert_eq!(*htod, weights + inputs, "{precision:?} {dtype:?}");
        }
        assert!(planned_bytes[0] < planned_bytes[1] && planned_bytes[1] < planned_bytes[2]);
    }
}
