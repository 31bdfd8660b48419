//! The program against the reference layers, and its range checks.

use super::layers::*;
use super::*;
use crate::device::host_backend::{HostBackend, HostP};
use crate::model::layers::Workspace;
use crate::store::layout::Mode;
use crate::store::layout::StateLayout;

fn model(tied: bool) -> ModelConfig {
    ModelConfig::from_json_str(
        &format!(
            r#"{{"architectures":["LlamaForCausalLM"],"hidden_size":48,"intermediate_size":80,
            "num_hidden_layers":2,"num_attention_heads":6,"num_key_value_heads":2,"vocab_size":53,
            "attention_bias":true,"tie_word_embeddings":{tied}}}"#
        ),
        "t",
    )
    .unwrap()
}

fn bits(v: &[f32]) -> Vec<u32> {
    v.iter().map(|x| x.to_bits()).collect()
}

/// The program on the CPU backend equals the reference layers bit for bit: a block with
/// q/k/v/o biases forward and backward, and the head over more rows than one logit chunk.
#[test]
fn program_matches_the_reference_layers_bit_for_bit() {
    let (b, t) = (2usize, 150usize); // 300 rows: two cross-entropy chunks
    let cfg = model(false);
    let layout = StateLayout::new(&cfg, Mode::Exact);
    let tm = Templates::new(&layout.config, t).unwrap();
    let (n, c) = (b * t, cfg.hidden_size);
    let blk = &tm.blocks[0];
    let numel = layout.units[1].numel;
    let p = crate::util::uniform(numel, 1, 0.2);
    let x = crate::util::uniform(n * c, 2, 1.0);
    let dy = crate::util::uniform(n * c, 3, 1.0);
    let g0 = crate::util::uniform(numel, 4, 0.1);

    let mut ws_ref = Workspace::new(&cfg, b, t);
    let mut y_ref = vec![0.0; n * c];
    // One flat sequence, one of three documents.
    let pos = crate::model::ops::document_positions(&[t, 60, 1, t - 61]);
    blk.forward(&p, &x, &mut y_ref, &mut ws_ref, &tm.rope, &pos, b, t);
    let (mut g_ref, mut dx_ref) = (g0.clone(), vec![0.0; n * c]);
    blk.backward(
        &p,
        &mut g_ref,
        &x,
        &dy,
        &mut dx_ref,
        &mut ws_ref,
        &tm.rope,
        &pos,
        b,
        t,
    );

    let (lay, elems) = Ws::layout(&cfg, b, t);
    let mut mem = vec![0.0f32; elems];
    let mut be = HostBackend::new(&tm.rope);
    let (mut y, mut g, mut dx) = (vec![0.0; n * c], g0.clone(), vec![0.0; n * c]);
    // SAFETY: every buffer outlives the calls below and is used by nothing else meanwhile.
    let (ws, pp, xp, yp, dyp, gp, dxp) = unsafe {
        (
            lay.at::<HostBackend<'_>>(HostP::write(&mut mem)),
            HostP::read(&p),
            HostP::read(&x),
            HostP::write(&mut y),
            HostP::read(&dy),
            HostP::write(&mut g),
            HostP::write(&mut dx),
        )
    };
    let s = Shape { b, t };
    let pos_ids = be.upload_ids(&pos).unwrap();
    block_fwd(&mut be, blk, pp, xp, yp, pos_ids, &ws, s).unwrap();
    block_bwd(&mut be, blk, pp, gp, xp, dyp, dxp, pos_ids, &ws, s).unwrap();
    assert_eq!(bits(&y), bits(&y_ref), "block forward");
    assert_eq!(bits(&g), bits(&g_ref), "block weight and bias gradients");
    assert_eq!(bits(&dx), bits(&dx_ref), "block dx");

    // Head: norm weight and LM head in one shard, as for an untied model.
    let head_numel = layout.units[3].numel;
    let hp = crate::util::uniform(head_numel, 5, 0.3);
    let hg0 = crate::util::uniform(head_numel, 6, 0.1);
    // Some rows train nothing.
    let targets: Vec<u32> = (0..n)
        .map(|i| match i % 9 {
            4 => crate::model::ops::IGNORE,
            _ => (i * 7 % 53) as u32,
        })
        .collect();
    let nr = tm.head.norm_range();
    let off = tm.head.lm_head.unwrap();
    let v = cfg.vocab_size;
    let mut hg_ref = hg0.clone();
    let (lo, hi) = hg_ref.split_at_mut(off);
    let mut dxh_ref = vec![0.0; n * c];
    let loss_ref = tm.head.loss_backward(
        &hp[nr.clone()],
        &mut lo[nr.clone()],
        &hp[off..off + v * c],
        &mut hi[..v * c],
        &x,
        &targets,
        &mut dxh_ref,
        0.01,
        &mut ws_ref,
    );
    let (mut hg, mut dxh) = (hg0.clone(), vec![0.0; n * c]);
    let loss = Arc::new(Mutex::new(0.0f64));
    // SAFETY: as above.
    let (hpp, hgp, dxhp) = unsafe {
        (
            HostP::read(&hp),
            HostP::write(&mut hg),
            HostP::write(&mut dxh),
        )
    };
    let ids = be.upload_ids(&targets).unwrap();
    head_loss_bwd(
        &mut be,
        &cfg,
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
    assert_eq!(*loss.lock().unwrap(), loss_ref, "head loss");
    assert_eq!(bits(&hg), bits(&hg_ref), "head gradients");
    assert_eq!(bits(&dxh), bits(&dxh_ref), "head dx");
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
