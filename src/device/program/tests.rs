//! The program against the reference layers, and its range checks.

use super::layers::*;
use super::*;
use crate::device::host_backend::{HostBackend, HostP};
use crate::model::config::ModelConfig;
use crate::model::layers::Workspace;
use crate::store::layout::Mode;
use crate::store::layout::StateLayout;

fn model(tied: bool) -> ModelConfig {
    model_with(tied, true)
}

fn model_with(tied: bool, bias: bool) -> ModelConfig {
    ModelConfig::from_json_str(
        &format!(
            r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":48,"intermediate_size":80,
            "num_hidden_layers":2,"num_attention_heads":6,"num_key_value_heads":2,"vocab_size":53,
            "attention_bias":{bias},"tie_word_embeddings":{tied}}}"#
        ),
        "t",
    )
    .unwrap()
}

/// A Qwen3 block (QK-norm) with heads of 10 where hidden / heads is 8, with or without biases.
fn qwen3(bias: bool) -> ModelConfig {
    ModelConfig::from_json_str(
        &format!(
            r#"{{"architectures":["Qwen3ForCausalLM"],"hidden_size":48,"intermediate_size":80,
            "num_hidden_layers":2,"num_attention_heads":6,"num_key_value_heads":2,"head_dim":10,
            "vocab_size":53,"attention_bias":{bias},"tie_word_embeddings":false}}"#
        ),
        "t",
    )
    .unwrap()
}

/// A Gemma 3 block: `1 + w` and sandwich norms, QK-norm, GELU-tanh, attention scale
/// `query_pre_attn_scalar^-½`, layer 0 local (a window of 70 and its own RoPE θ), untied.
fn gemma3() -> ModelConfig {
    ModelConfig::from_json_str(
        r#"{"architectures":["Gemma3ForCausalLM"],"hidden_size":48,"intermediate_size":80,
        "num_hidden_layers":2,"num_attention_heads":6,"num_key_value_heads":2,"head_dim":10,
        "vocab_size":53,"tie_word_embeddings":false,"query_pre_attn_scalar":30,
        "sliding_window":70,"layer_types":["sliding_attention","full_attention"],
        "rope_local_base_freq":100.0}"#,
        "t",
    )
    .unwrap()
}

/// A Gemma 2 block: Gemma's without QK-norm, scores and logits soft-capped (at values these
/// small models' scores and logits reach), layer 0 local (a window of 70), untied.
fn gemma2() -> ModelConfig {
    ModelConfig::from_json_str(
        r#"{"architectures":["Gemma2ForCausalLM"],"hidden_size":48,"intermediate_size":80,
        "num_hidden_layers":2,"num_attention_heads":6,"num_key_value_heads":2,"head_dim":10,
        "vocab_size":53,"tie_word_embeddings":false,"query_pre_attn_scalar":30,
        "sliding_window":70,"attn_logit_softcapping":0.3,"final_logit_softcapping":0.5}"#,
        "t",
    )
    .unwrap()
}

/// What one program run produced: block output, gradients and dx; head gradients, dx and loss.
struct Outputs {
    y: Vec<f32>,
    g: Vec<f32>,
    dx: Vec<f32>,
    hg: Vec<f32>,
    dxh: Vec<f32>,
    loss: f64,
}

/// The inputs of one comparison: a block's and the head's weights and gradients, x, dy, positions
/// and targets for `b`×`t` tokens.
struct Case {
    cfg: ModelConfig,
    tm: Templates,
    b: usize,
    t: usize,
    p: Vec<f32>,
    g0: Vec<f32>,
    x: Vec<f32>,
    dy: Vec<f32>,
    pos: Vec<u32>,
    hp: Vec<f32>,
    hg0: Vec<f32>,
    targets: Vec<u32>,
}

impl Case {
    /// The model `cfg` over `b`×`t` tokens: sequence 0 one flat document; the others
    /// documents of `docs` tokens (summing to `t`).
    fn of(cfg: ModelConfig, b: usize, t: usize, docs: &[usize]) -> Self {
        let layout = StateLayout::new(&cfg, Mode::Exact);
        let tm = Templates::new(&layout.config, t).unwrap();
        let (n, c) = (b * t, cfg.hidden_size);
        let numel = layout.units[1].numel;
        let head_numel = layout.units[3].numel;
        let lens: Vec<usize> = std::iter::once(t)
            .chain((1..b).flat_map(|_| docs.iter().copied()))
            .collect();
        let targets = (0..n)
            .map(|i| match i % 9 {
                4 => crate::model::ops::IGNORE,
                _ => (i * 7 % 53) as u32,
            })
            .collect();
        Case {
            p: crate::util::uniform(numel, 1, 0.2),
            g0: crate::util::uniform(numel, 4, 0.1),
            x: crate::util::uniform(n * c, 2, 1.0),
            dy: crate::util::uniform(n * c, 3, 1.0),
            pos: crate::model::ops::document_positions(&lens),
            hp: crate::util::uniform(head_numel, 5, 0.3),
            hg0: crate::util::uniform(head_numel, 6, 0.1),
            targets,
            cfg,
            tm,
            b,
            t,
        }
    }

    /// The reference layers.
    fn reference(&self) -> Outputs {
        let (b, t, cfg, tm) = (self.b, self.t, &self.cfg, &self.tm);
        let (n, c, v) = (b * t, cfg.hidden_size, cfg.vocab_size);
        let blk = &tm.blocks[0];
        let mut ws = Workspace::new(cfg, b, t);
        let mut y = vec![0.0; n * c];
        blk.forward(&self.p, &self.x, &mut y, &mut ws, &tm.rope, &self.pos, b, t);
        let (mut g, mut dx) = (self.g0.clone(), vec![0.0; n * c]);
        let (p, x, dy, pos) = (&self.p, &self.x, &self.dy, &self.pos);
        blk.backward(p, &mut g, x, dy, &mut dx, &mut ws, &tm.rope, pos, b, t);
        let (nr, off) = (tm.head.norm_range(), tm.head.lm_head.unwrap());
        let mut hg = self.hg0.clone();
        let (lo, hi) = hg.split_at_mut(off);
        let mut dxh = vec![0.0; n * c];
        let loss = tm.head.loss_backward(
            &self.hp[nr.clone()],
            &mut lo[nr.clone()],
            &self.hp[off..off + v * c],
            &mut hi[..v * c],
            &self.x,
            &self.targets,
            &mut dxh,
            0.01,
            &mut ws,
        );
        Outputs {
            y,
            g,
            dx,
            hg,
            dxh,
            loss,
        }
    }

    /// The program on the CPU backend with the shape `s`, the forward's internals kept for the
    /// backward when `keep` (else recomputed).
    fn program(&self, s: Shape, keep: bool) -> Outputs {
        self.program_in(s, keep, Precision::Fp32)
    }

    /// [`Self::program`] in `precision`.
    fn program_in(&self, s: Shape, keep: bool, precision: Precision) -> Outputs {
        let (cfg, tm) = (&self.cfg, &self.tm);
        let (n, c) = (s.n(), cfg.hidden_size);
        let blk = &tm.blocks[0];
        let (lay, elems) = Ws::layout(cfg, s, Precision::Fp32);
        let mut mem = vec![0.0f32; elems];
        let mut kept = vec![0.0f32; internals_len(cfg, n, Precision::Fp32)];
        let mut be = HostBackend::with_precision(&tm.rope, precision);
        let (mut y, mut g, mut dx) = (vec![0.0; n * c], self.g0.clone(), vec![0.0; n * c]);
        let mut dy = self.dy.clone(); // consumed by the backward
        let (mut hg, mut dxh) = (self.hg0.clone(), vec![0.0; n * c]);
        // SAFETY: every buffer outlives the calls below and is used by nothing else meanwhile.
        let (ws, keptp, pp, xp, yp, dyp, gp, dxp, hpp, hgp, dxhp) = unsafe {
            (
                lay.at::<HostBackend<'_>>(HostP::write(&mut mem)),
                HostP::write(&mut kept),
                HostP::read(&self.p),
                HostP::read(&self.x),
                HostP::write(&mut y),
                HostP::write(&mut dy),
                HostP::write(&mut g),
                HostP::write(&mut dx),
                HostP::read(&self.hp),
                HostP::write(&mut hg),
                HostP::write(&mut dxh),
            )
        };
        let pos = be.upload_ids(&self.pos).unwrap();
        let bws = match keep {
            true => ws.keeping::<HostBackend<'_>>(cfg, n, keptp, Precision::Fp32),
            false => ws,
        };
        block_fwd(&mut be, blk, pp, xp, yp, (pos, None), &bws, s).unwrap();
        block_bwd(
            &mut be, blk, pp, gp, xp, dyp, dxp, pos, &bws, s, !keep, None,
        )
        .unwrap();
        let (nr, off) = (tm.head.norm_range(), tm.head.lm_head.unwrap());
        let loss = Arc::new(Mutex::new(0.0f64));
        let ids = be.upload_ids(&self.targets).unwrap();
        head_loss_bwd(
            &mut be,
            cfg,
            HostBackend::off(hpp, nr.start),
            HostBackend::off(hgp, nr.start),
            HostBackend::off(hpp, off),
            HostBackend::off(hgp, off),
            xp,
            ids,
            dxhp,
            0.01,
            &ws,
            n,
        )
        .unwrap();
        be.add_loss(ws.losses, n, loss.clone()).unwrap();
        let loss = *loss.lock().unwrap();
        Outputs {
            y,
            g,
            dx,
            hg,
            dxh,
            loss,
        }
    }
}

/// `got` and `want` hold the same bits; else a short report (how many differ, the first one).
fn same_bits(got: &[f32], want: &[f32], what: &str) {
    assert_eq!(got.len(), want.len(), "{what}: lengths");
    let diff: Vec<usize> = (0..got.len())
        .filter(|&i| got[i].to_bits() != want[i].to_bits())
        .collect();
    if let Some(&i) = diff.first() {
        panic!(
            "{what}: {} of {} differ, the first at {i}: {} vs {}",
            diff.len(),
            got.len(),
            got[i],
            want[i]
        );
    }
}

fn assert_same(got: &Outputs, want: &Outputs, what: &str) {
    same_bits(&got.y, &want.y, &format!("{what}: block forward"));
    same_bits(&got.g, &want.g, &format!("{what}: block gradients"));
    same_bits(&got.dx, &want.dx, &format!("{what}: block dx"));
    assert_eq!(got.loss, want.loss, "{what}: head loss");
    same_bits(&got.hg, &want.hg, &format!("{what}: head gradients"));
    same_bits(&got.dxh, &want.dxh, &format!("{what}: head dx"));
}

/// The program on the CPU backend equals the reference layers bit for bit: a block with
/// q/k/v/o biases forward and backward, and the head over more rows than one logit chunk.
#[test]
fn program_matches_the_reference_layers_bit_for_bit() {
    // 300 rows: two cross-entropy chunks; one flat sequence, one of three documents.
    // Also a Qwen3 block: QK-norm, head_dim ≠ hidden / heads; and a Gemma 3 one.
    for cfg in [model(false), qwen3(true), gemma3(), gemma2()] {
        let case = Case::of(cfg, 2, 150, &[60, 1, 89]);
        let want = case.reference();
        assert_same(&case.program(Shape::whole(2, 150), false), &want, "whole");
        // Internals kept by the forward instead of recomputed: the same bits.
        assert_same(&case.program(Shape::whole(2, 150), true), &want, "kept");
    }
}

/// Token chunks give the same bits as the whole micro-batch at once: chunks of one and of both
/// sequences, chunks that divide the sequence and ones that do not (a last chunk of one row),
/// with documents crossing chunk boundaries.
#[test]
fn every_chunking_gives_the_same_bits() {
    for (b, t, docs, cfg) in [
        (2usize, 513usize, &[255usize, 3, 254, 1][..], model(false)),
        (3, 700, &[1, 300, 399][..], model(false)),
        (2, 513, &[255, 3, 254, 1][..], qwen3(false)),
        (2, 513, &[255, 3, 254, 1][..], gemma3()),
        (2, 513, &[255, 3, 254, 1][..], gemma2()),
    ] {
        let case = Case::of(cfg, b, t, docs);
        let want = case.reference();
        let mut chunks = vec![b * t, 2 * t, t];
        chunks.extend((1..t.div_ceil(CHUNK_ALIGN)).map(|k| k * CHUNK_ALIGN));
        for chunk in chunks {
            let s = Shape::chunked(b, t, chunk).unwrap();
            assert_same(
                &case.program(s, false),
                &want,
                &format!("t {t}, chunk {chunk}"),
            );
        }
    }
}

/// Under bf16 too (Q, K, V and dO computed in scratch regions, then stored in bf16; dQ, dK,
/// dV stored for their GEMMs, by RoPE⁻¹ directly without a bias): token chunks and kept
/// internals give the bits of the whole micro-batch recomputed, which differ from fp32's.
#[test]
fn bf16_program_gives_the_same_bits_in_every_chunking() {
    let (b, t) = (2, 513);
    let cases = [
        (true, model_with(false, true)),
        (false, model_with(false, false)),
        (true, qwen3(true)),
        (false, qwen3(false)),
        (false, gemma3()),
        (false, gemma2()),
    ];
    for (bias, cfg) in cases {
        let qk_norm = cfg.qk_norm;
        let case = Case::of(cfg, b, t, &[255, 3, 254, 1]);
        let whole = Shape::whole(b, t);
        let want = case.program_in(whole, false, Precision::Bf16);
        assert_ne!(
            case.program(whole, false).y,
            want.y,
            "bf16 rounds what fp32 keeps"
        );
        let kept = case.program_in(whole, true, Precision::Bf16);
        assert_same(&kept, &want, &format!("bias {bias}, kept"));
        for chunk in [t, 256, 512] {
            let s = Shape::chunked(b, t, chunk).unwrap();
            let got = case.program_in(s, false, Precision::Bf16);
            assert_same(
                &got,
                &want,
                &format!("bias {bias}, QK-norm {qk_norm}, chunk {chunk}"),
            );
        }
    }
}

/// A GPU's bf16 workspace holds the stored regions in half the words, the rest as in fp32;
/// every region is aligned and disjoint from the others.
#[test]
fn bf16_workspace_halves_the_stored_regions() {
    let cfg = model(false);
    let s = Shape::chunked(2, 700, 256).unwrap();
    let regions = |p: Precision| {
        let (ws, end) = Ws::layout(&cfg, s, p);
        let starts = [
            ws.h1, ws.rstd1, ws.q, ws.k, ws.v, ws.att, ws.lse, ws.delta, ws.x2, ws.h2, ws.rstd2,
            ws.gate, ws.up, ws.act, ws.d_i1, ws.d_i2, ws.d_i3, ws.d_att, ws.d_c, ws.dq, ws.dk,
            ws.dv, ws.ce, ws.losses,
        ];
        // Laid out in field order: each region ends where the next starts.
        let ends: Vec<usize> = starts.iter().skip(1).copied().chain([end]).collect();
        assert!(starts.iter().all(|o| o % 64 == 0), "aligned");
        starts
            .iter()
            .zip(ends)
            .map(|(a, b)| b.checked_sub(*a).unwrap())
            .collect::<Vec<usize>>()
    };
    let (f32_words, bf16_words) = (regions(Precision::Fp32), regions(Precision::Bf16));
    let (m, n) = (s.chunk_rows(), s.n());
    let (c, i, qd, kvd) = (
        cfg.hidden_size,
        cfg.intermediate_size,
        cfg.q_dim(),
        cfg.kv_dim(),
    );
    let mh = m.max(n.min(crate::model::ops::ce_chunk_rows(cfg.vocab_size)));
    // (region, elements): h1, q, k, v, h2, act, d_i2, d_i3, d_att.
    let stored = [
        (0, mh * c),
        (2, m * qd),
        (3, n * kvd),
        (4, n * kvd),
        (9, m * c),
        (13, m * i),
        (15, m * i),
        (16, m * i),
        (17, m * qd),
    ];
    for (r, (a, b)) in f32_words.iter().zip(&bf16_words).enumerate() {
        match stored.iter().find(|(s, _)| *s == r) {
            Some(&(_, len)) => {
                assert_eq!(*a, len.div_ceil(64) * 64, "region {r} in fp32");
                assert_eq!(*b, len.div_ceil(2).div_ceil(64) * 64, "region {r} in bf16");
            }
            None => assert_eq!(a, b, "region {r}"),
        }
    }
    assert_eq!(
        workspace_bytes(&cfg, s, Precision::Bf16),
        4 * bf16_words.iter().sum::<usize>() as u64
    );
}

/// With token chunks a GPU's workspace grows with the sequence only by what attention keeps for
/// all of it: K and V (2 B per element under bf16), dK and dV (4 B) and a loss (4 B) per token
/// — once the micro-batch fills the head's chunk ([`crate::model::ops::ce_chunk_rows`] rows).
#[test]
fn workspace_grows_with_the_sequence_by_keys_values_and_their_gradients() {
    let cfg = model(false);
    let kvd = cfg.kv_dim() as u64;
    for (precision, kv_bytes) in [(Precision::Fp32, 4), (Precision::Bf16, 2)] {
        let bytes = |t: usize| workspace_bytes(&cfg, Shape::chunked(2, t, 256).unwrap(), precision);
        let per_token = 2 * kv_bytes * kvd + 2 * 4 * kvd + 4;
        let full = crate::model::ops::ce_chunk_rows(cfg.vocab_size) / 2;
        for (t1, t2) in [(full, 2 * full), (2 * full, 8 * full)] {
            assert_eq!(
                bytes(t2) - bytes(t1),
                2 * (t2 - t1) as u64 * per_token,
                "{precision:?}: {t1} → {t2} tokens a sequence"
            );
        }
    }
}

#[test]
fn chunks_cover_every_row_once_in_order() {
    for (b, t, chunk) in [
        (3, 700, 256),
        (3, 700, 1400),
        (3, 700, 5000),
        (1, 5, 5),
        (4, 1, 2),
    ] {
        let s = Shape::chunked(b, t, chunk).unwrap();
        let mut next = 0;
        for ch in s.chunks() {
            assert_eq!(ch.b0 * t + ch.q0, next, "{b}×{t} by {chunk}");
            assert!(ch.rows() <= s.chunk_rows() && ch.rows() > 0);
            assert!(ch.nb == 1 || (ch.q0, ch.q1) == (0, t));
            next += ch.rows();
        }
        assert_eq!(next, b * t);
    }
    assert!(Shape::chunked(2, 700, 300).is_err());
    assert!(Shape::chunked(2, 700, 0).is_err());
    assert!(Shape::chunked(2, 200, 300).is_ok());
}

/// A range the program gets wrong is an error on the CPU backend, not corrupted memory.
#[test]
fn bad_ranges_are_caught() {
    let cfg = model(true);
    let rope = crate::model::ops::Rope::new(cfg.head_dim, 1e4, 8);
    let mut be = HostBackend::new(&rope);
    let mut a = vec![0.0f32; 100];
    let r = vec![1.0f32; 100];
    // SAFETY: the buffers outlive the calls.
    let (ap, rp) = unsafe { (HostP::write(&mut a), HostP::read(&r)) };
    let e = be.add(ap, rp, 101).unwrap_err().to_string();
    assert!(e.contains("overflow"), "{e}");
    let e = be
        .add(ap, HostBackend::off(ap, 10), 20)
        .unwrap_err()
        .to_string();
    assert!(e.contains("overlaps"), "{e}");
    let e = be.add(rp, ap, 10).unwrap_err().to_string();
    assert!(e.contains("reading only"), "{e}");
    be.add(ap, HostBackend::off(ap, 50), 50).unwrap();
}

/// The mixture-of-experts scratch is in the workspace's bytes (what fits a chunking and what the
/// planner counts): none for a dense model, growing with the chunk's tokens for a MoE one.
#[test]
fn the_moe_scratch_is_charged_with_the_workspace() {
    let moe = ModelConfig::from_json_str(
        r#"{"architectures":["Qwen3MoeForCausalLM"],"hidden_size":128,"intermediate_size":320,
        "moe_intermediate_size":32,"num_experts":8,"num_experts_per_tok":2,"num_hidden_layers":2,
        "num_attention_heads":4,"num_key_value_heads":2,"head_dim":32,"vocab_size":700}"#,
        "moe",
    )
    .unwrap();
    let (whole, chunked) = (Shape::whole(1, 512), Shape::chunked(1, 512, 256).unwrap());
    assert_eq!(moe_scratch_bytes(&model(false), whole, Precision::Fp32), 0);
    let (a, b) = (
        moe_scratch_bytes(&moe, whole, Precision::Fp32),
        moe_scratch_bytes(&moe, chunked, Precision::Fp32),
    );
    // Per expert 12 bytes (its probability sum and load-balancing gradient) whatever the tokens.
    let per_expert = 12 * moe.moe.as_ref().unwrap().num_experts as u64;
    assert!(a > 0 && a - per_expert == 2 * (b - per_expert), "{a} {b}");
    // 512 tokens × top-2 rows × (3·C + 2·2I + 4·I) words, plus the router's and the slots',
    // and a padding byte per token.
    let m = moe.moe.clone().unwrap();
    let rows = 512 * m.top_k as u64;
    let per_row = 3 * 128 + 4 * m.expert_intermediate as u64 + 4 * m.expert_intermediate as u64 + 5;
    assert_eq!(
        a,
        4 * (rows * per_row + 2 * 512 * m.num_experts as u64) + 512 + per_expert
    );
    assert_eq!(
        workspace_bytes(&moe, whole, Precision::Fp32),
        4 * Ws::layout(&moe, whole, Precision::Fp32).1 as u64 + a
    );
    // Under bf16 the GEMMs' bf16 copies of the activation, dY and d gate/up per row.
    let copies = 2 * rows * (3 * m.expert_intermediate as u64 + 128);
    assert_eq!(moe_scratch_bytes(&moe, whole, Precision::Bf16), a + copies);
}
