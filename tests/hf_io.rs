//! Hugging Face checkpoints: a real sharded checkpoint written by transformers loads into the
//! store; export → import is bit-exact; broken checkpoints give errors naming tensor and file.
#![allow(clippy::unwrap_used)]

mod common;

use common::Golden;
use megatrain::store::hf;
use megatrain::store::layout::{Mode, StateLayout};
use megatrain::store::placement::{place, RamBudget};
use megatrain::store::{HostStore, StoreOptions};
use megatrain::topology::{probe, TopologySource};
use std::path::{Path, PathBuf};

fn hf_dir() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/hf_gqa")
}

fn store_for(dir: &Path) -> HostStore {
    let cfg = hf::load_config(dir).unwrap();
    let layout = StateLayout::new(&cfg, Mode::Lean);
    let m = probe(&TopologySource::Live).unwrap();
    let p = place(&m, &layout, None, RamBudget::default()).unwrap();
    HostStore::allocate(layout, p, &StoreOptions::default()).unwrap()
}

fn params(store: &HostStore) -> Vec<Vec<f32>> {
    (0..store.num_units())
        .map(|u| store.take(u).unwrap().master().to_vec())
        .collect()
}

#[test]
fn transformers_checkpoint_loads_exactly() {
    let store = store_for(&hf_dir());
    let r = hf::load_into_store(&hf_dir(), &store).unwrap();
    assert_eq!(r.files, 4, "the golden checkpoint is sharded");
    assert_eq!(r.tensors, store.layout().manifest.len());
    let g = Golden::open("model_gqa.safetensors");
    let p = params(&store);
    for (name, loc) in &store.layout().manifest {
        let t = &store.layout().units[loc.unit].tensors[loc.index];
        let ours = &p[loc.unit][t.offset..t.offset + t.numel()];
        let want = g.get(&format!("param.{name}"));
        assert!(
            ours.iter()
                .zip(want)
                .all(|(a, b)| a.to_bits() == b.to_bits()),
            "{name}"
        );
    }
}

#[test]
fn export_then_import_is_bit_exact_and_refuses_to_overwrite() {
    let store = store_for(&hf_dir());
    hf::load_into_store(&hf_dir(), &store).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("export");
    hf::export_store(
        &store,
        &out,
        20_000,
        hf::ExportOptions::new(hf::ExportDtype::Fp32),
    )
    .unwrap();
    let files = hf::checkpoint_files(&out).unwrap();
    assert!(files.len() > 1, "small shard limit gives several shards");
    let cfg = hf::load_config(&out).unwrap();
    assert_eq!(&cfg, &store.layout().config);
    let again = store_for(&out);
    hf::load_into_store(&out, &again).unwrap();
    assert_eq!(
        params(&store)
            .iter()
            .map(|u| u.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
            .collect::<Vec<_>>(),
        params(&again)
            .iter()
            .map(|u| u.iter().map(|x| x.to_bits()).collect::<Vec<_>>())
            .collect::<Vec<_>>()
    );
    // A second export to the same place is refused and the first stays intact.
    let e = hf::export_store(
        &store,
        &out,
        20_000,
        hf::ExportOptions::new(hf::ExportDtype::Fp32),
    )
    .unwrap_err();
    assert!(e.to_string().contains("refusing to overwrite"), "{e}");
    hf::load_into_store(&out, &again).unwrap();
    // No temporary directories are left behind.
    assert_eq!(std::fs::read_dir(tmp.path()).unwrap().count(), 1);
    // For tools/check_hf_export.py (transformers loads the export unchanged).
    if let Some(keep) = std::env::var_os("MEGATRAIN_KEEP_EXPORT") {
        hf::export_store(
            &store,
            Path::new(&keep),
            20_000,
            hf::ExportOptions::new(hf::ExportDtype::Fp32),
        )
        .unwrap();
    }
}

/// `--export-dtype bf16`: every tensor BF16, the master rounded to nearest-even, the config
/// saying so; shards planned at 2 bytes per element; importing it gives those values.
#[test]
fn a_bf16_export_rounds_the_master_and_loads_back() {
    use megatrain::optim::adamw::{bf16_to_f32, f32_to_bf16};
    let store = store_for(&hf_dir());
    hf::load_into_store(&hf_dir(), &store).unwrap();
    let tmp = tempfile::tempdir().unwrap();
    let (out16, out32) = (tmp.path().join("bf16"), tmp.path().join("fp32"));
    hf::export_store(
        &store,
        &out16,
        20_000,
        hf::ExportOptions::new(hf::ExportDtype::Bf16),
    )
    .unwrap();
    hf::export_store(
        &store,
        &out32,
        20_000,
        hf::ExportOptions::new(hf::ExportDtype::Fp32),
    )
    .unwrap();
    let files = hf::checkpoint_files(&out16).unwrap();
    assert!(files.len() < hf::checkpoint_files(&out32).unwrap().len());
    let mut tensors = 0;
    for f in &files {
        let bytes = std::fs::read(f).unwrap();
        let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
        for (name, t) in st.tensors() {
            assert_eq!(t.dtype(), safetensors::Dtype::BF16, "{name}");
            tensors += 1;
        }
    }
    assert_eq!(tensors, store.layout().manifest.len());
    let config: serde_json::Value =
        serde_json::from_slice(&std::fs::read(out16.join("config.json")).unwrap()).unwrap();
    assert_eq!(config["torch_dtype"], "bfloat16");
    let again = store_for(&out16);
    hf::load_into_store(&out16, &again).unwrap();
    let want: Vec<Vec<u32>> = params(&store)
        .iter()
        .map(|u| {
            u.iter()
                .map(|&x| bf16_to_f32(f32_to_bf16(x)).to_bits())
                .collect()
        })
        .collect();
    let got: Vec<Vec<u32>> = params(&again)
        .iter()
        .map(|u| u.iter().map(|x| x.to_bits()).collect())
        .collect();
    assert_eq!(got, want);
    // The rounding is real: the fp32 master is not all bf16 values.
    assert_ne!(params(&store), params(&again));
}

/// Copy the golden checkpoint, let `edit` break it, and return the load error text.
fn broken(edit: impl FnOnce(&Path)) -> String {
    let tmp = tempfile::tempdir().unwrap();
    for e in std::fs::read_dir(hf_dir()).unwrap() {
        let e = e.unwrap();
        std::fs::copy(e.path(), tmp.path().join(e.file_name())).unwrap();
    }
    edit(tmp.path());
    let store = store_for(&hf_dir());
    hf::load_into_store(tmp.path(), &store)
        .unwrap_err()
        .to_string()
}

fn shard_with(dir: &Path, name: &str) -> PathBuf {
    let idx: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join(hf::INDEX)).unwrap()).unwrap();
    dir.join(idx["weight_map"][name].as_str().unwrap())
}

/// Rewrite the shard holding `name` with `f` applied to its tensor list.
fn rewrite(
    dir: &Path,
    name: &str,
    f: impl FnOnce(&mut Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)>),
) {
    let path = shard_with(dir, name);
    let bytes = std::fs::read(&path).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let mut ts: Vec<(String, safetensors::Dtype, Vec<usize>, Vec<u8>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n, v.dtype(), v.shape().to_vec(), v.data().to_vec()))
        .collect();
    f(&mut ts);
    let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = ts
        .iter()
        .map(|(n, d, s, b)| {
            (
                n.clone(),
                safetensors::tensor::TensorView::new(*d, s.clone(), b).unwrap(),
            )
        })
        .collect();
    safetensors::serialize_to_file(views, None, &path).unwrap();
}

const Q: &str = "model.layers.1.self_attn.q_proj.weight";

#[test]
fn missing_tensor_is_named() {
    let msg = broken(|d| rewrite(d, Q, |ts| ts.retain(|t| t.0 != Q)));
    assert!(msg.contains(Q) && msg.contains("missing"), "{msg}");
}

#[test]
fn wrong_shape_names_tensor_and_file() {
    let msg = broken(|d| {
        rewrite(d, Q, |ts| {
            let t = ts.iter_mut().find(|t| t.0 == Q).unwrap();
            t.2[0] /= 2;
            t.3.truncate(t.3.len() / 2);
        })
    });
    assert!(
        msg.contains(Q) && msg.contains("shape") && msg.contains(".safetensors"),
        "{msg}"
    );
}

#[test]
fn wrong_dtype_is_named() {
    let msg = broken(|d| {
        rewrite(d, Q, |ts| {
            let t = ts.iter_mut().find(|t| t.0 == Q).unwrap();
            t.1 = safetensors::Dtype::I32;
        })
    });
    assert!(msg.contains(Q) && msg.contains("I32"), "{msg}");
}

#[test]
fn truncated_and_corrupt_files_are_named() {
    let msg = broken(|d| {
        let p = shard_with(d, Q);
        let b = std::fs::read(&p).unwrap();
        std::fs::write(&p, &b[..b.len() - 100]).unwrap();
    });
    assert!(
        msg.contains("corrupt or truncated") && msg.contains(".safetensors"),
        "{msg}"
    );
    let msg = broken(|d| {
        std::fs::write(shard_with(d, Q), b"\xff\xff\xff\xff\xff\xff\xff\x7fgarbage").unwrap()
    });
    assert!(msg.contains("corrupt or truncated"), "{msg}");
    let msg = broken(|d| std::fs::remove_file(shard_with(d, Q)).unwrap());
    assert!(
        msg.contains("missing") && msg.contains(".safetensors"),
        "{msg}"
    );
}

#[test]
fn directory_without_weights_is_a_clear_error() {
    let tmp = tempfile::tempdir().unwrap();
    let e = hf::checkpoint_files(tmp.path()).unwrap_err().to_string();
    assert!(e.contains("model.safetensors"), "{e}");
}

/// Gemma 3: transformers' own checkpoint (tests/golden/train_gemma3/init) loads, exports and
/// reads back bit-exact; the same weights as a `Gemma3ForConditionalGeneration` checkpoint
/// (`model.language_model.*` names, a vision tower, the text config nested) load to the same
/// text model, the vision tower skipped by name.
#[test]
fn gemma3_checkpoint_round_trips_and_its_multimodal_form_loads_the_text_model() {
    let init = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/train_gemma3/init");
    let store = store_for(&init);
    hf::load_into_store(&init, &store).unwrap();
    let want = params(&store);
    let tmp = tempfile::tempdir().unwrap();
    let out = tmp.path().join("export");
    hf::export_store(
        &store,
        &out,
        1 << 30,
        hf::ExportOptions::new(hf::ExportDtype::Fp32),
    )
    .unwrap();
    let again = store_for(&out);
    hf::load_into_store(&out, &again).unwrap();
    assert_eq!(params(&again), want, "export → import");
    if let Some(keep) = std::env::var_os("MEGATRAIN_KEEP_GEMMA3_EXPORT") {
        hf::export_store(
            &store,
            Path::new(&keep),
            1 << 30,
            hf::ExportOptions::new(hf::ExportDtype::Fp32),
        )
        .unwrap();
    }

    let mm = tmp.path().join("multimodal");
    std::fs::create_dir(&mm).unwrap();
    let text: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(init.join("config.json")).unwrap()).unwrap();
    let config = serde_json::json!({
        "architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3",
        "text_config": text, "vision_config": {"model_type": "siglip_vision_model"},
    });
    std::fs::write(mm.join("config.json"), config.to_string()).unwrap();
    let bytes = std::fs::read(init.join(hf::SINGLE)).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let vision = [0u8; 4 * 6];
    let mut views: Vec<(String, safetensors::tensor::TensorView<'_>)> = st
        .tensors()
        .into_iter()
        .map(|(n, v)| (n.replacen("model.", "model.language_model.", 1), v))
        .collect();
    views.push((
        "model.vision_tower.vision_model.post_layernorm.weight".into(),
        safetensors::tensor::TensorView::new(safetensors::Dtype::F32, vec![6], &vision).unwrap(),
    ));
    safetensors::serialize_to_file(views, None, &mm.join(hf::SINGLE)).unwrap();
    let text_model = store_for(&mm);
    let report = hf::load_into_store(&mm, &text_model).unwrap();
    assert_eq!(
        params(&text_model),
        want,
        "the multimodal checkpoint's text model"
    );
    assert!(
        report.skipped.iter().any(|n| n.contains("vision_tower")),
        "{:?}",
        report.skipped
    );
}

/// A GPT-OSS checkpoint with MXFP4 experts (`_blocks` / `_scales`, as released; made by
/// tools/make_mxfp4_checkpoint.py) loads exactly as its twin dequantised by transformers'
/// `convert_moe_packed_tensors`; a missing `_scales` is named.
#[test]
fn gpt_oss_mxfp4_experts_load_as_their_dequantised_twin() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/gpt_oss_mxfp4");
    let (mx, twin) = (store_for(&dir), store_for(&dir.join("twin")));
    hf::load_into_store(&dir, &mx).unwrap();
    hf::load_into_store(&dir.join("twin"), &twin).unwrap();
    let (a, b) = (params(&mx), params(&twin));
    assert_eq!(a.len(), b.len());
    for (u, (x, y)) in a.iter().zip(&b).enumerate() {
        assert!(
            x.iter().zip(y).all(|(p, q)| p.to_bits() == q.to_bits()),
            "unit {u} differs"
        );
    }
    let e = broken_copy(&dir, |name| {
        name.ends_with("layers.1.mlp.experts.down_proj_scales")
    });
    assert!(
        e.contains("down_proj_scales") && e.contains("incomplete"),
        "{e}"
    );
    // Another quantisation method is refused by name.
    let cfg = std::fs::read_to_string(dir.join("config.json"))
        .unwrap()
        .replace("\"mxfp4\"", "\"gptq\"");
    let e = megatrain::model::config::ModelConfig::from_json_str(&cfg, "c")
        .unwrap_err()
        .to_string();
    assert!(e.contains("gptq"), "{e}");
}

/// A copy of the checkpoint in `dir` without the tensors `drop` names: the load's error.
fn broken_copy(dir: &Path, drop: impl Fn(&str) -> bool) -> String {
    let tmp = tempfile::tempdir().unwrap();
    std::fs::copy(dir.join("config.json"), tmp.path().join("config.json")).unwrap();
    let bytes = std::fs::read(dir.join("model.safetensors")).unwrap();
    let st = safetensors::SafeTensors::deserialize(&bytes).unwrap();
    let kept: Vec<(String, safetensors::tensor::TensorView<'_>)> =
        st.tensors().into_iter().filter(|(n, _)| !drop(n)).collect();
    safetensors::serialize_to_file(kept, None, &tmp.path().join("model.safetensors")).unwrap();
    let store = store_for(dir);
    hf::load_into_store(tmp.path(), &store)
        .unwrap_err()
        .to_string()
}

/// A model started from a Hugging Face directory is exported with that directory's tokenizer
/// files and generation config beside the weights (`train --export-hf`, and `megatrain export`
/// from its checkpoint, which finds them through the run's `--init-from` or `--tokenizer`), so
/// the export serves from one folder.
#[test]
fn an_export_of_a_model_started_from_hf_carries_its_tokenizer() {
    let tmp = tempfile::tempdir().unwrap();
    let root = Path::new(env!("CARGO_MANIFEST_DIR"));
    let init = tmp.path().join("init");
    std::fs::create_dir(&init).unwrap();
    let golden = root.join("tests/golden/sft_chat/init");
    let tokenizer = root.join("tests/fixtures/chat/gen");
    for (dir, name) in [
        (&golden, "config.json"),
        (&golden, "model.safetensors"),
        (&golden, "generation_config.json"),
        (&tokenizer, "tokenizer.json"),
        (&tokenizer, "tokenizer_config.json"),
    ] {
        std::fs::copy(dir.join(name), init.join(name)).unwrap();
    }
    let vocab = hf::load_config(&init).unwrap().vocab_size as u16;
    let data: Vec<u8> = (0..4000u16)
        .flat_map(|i| (i * 7 % vocab).to_le_bytes())
        .collect();
    std::fs::write(tmp.path().join("data.bin"), data).unwrap();
    let megatrain = |args: &[&str]| common::cli::megatrain_ok(tmp.path(), args);
    megatrain(&[
        "train",
        "--init-from",
        "init",
        "--data",
        "data.bin",
        "--seq-len",
        "16",
        "--batch-size",
        "2",
        "--steps",
        "1",
        "--checkpoint-dir",
        "ck",
        "--export-hf",
        "hf",
    ]);
    let served = [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ];
    let same = |dir: &str| {
        for name in served {
            assert_eq!(
                std::fs::read(tmp.path().join(dir).join(name)).unwrap(),
                std::fs::read(init.join(name)).unwrap(),
                "{dir}/{name}"
            );
        }
    };
    same("hf");
    let err = megatrain(&["export", "--checkpoint", "ck", "--out", "hf2"]);
    assert!(err.contains("tokenizer.json"), "{err}");
    same("hf2");
    // The run's directory gone: the export says so, and --tokenizer names another.
    std::fs::rename(&init, tmp.path().join("moved")).unwrap();
    let err = megatrain(&["export", "--checkpoint", "ck", "--out", "hf3"]);
    assert!(err.contains("pass --tokenizer"), "{err}");
    assert!(!tmp.path().join("hf3/tokenizer.json").exists());
    megatrain(&[
        "export",
        "--checkpoint",
        "ck",
        "--out",
        "hf4",
        "--tokenizer",
        "moved",
    ]);
    std::fs::rename(tmp.path().join("moved"), &init).unwrap();
    same("hf4");
}
