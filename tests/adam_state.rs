//! Compact Adam state (`--adam-state bf16|int8`) through the whole trainer: runs are
//! reproducible, a resumed run is bit-identical to a straight one, spilling m/v to NVMe changes
//! no bit, checkpoints record the format, resuming with another format converts and says so, and
//! an export reads a compact checkpoint.
#![allow(clippy::unwrap_used)]

mod common;

use megatrain::store::layout::AdamState;
use megatrain::store::placement::SpillPolicy;
use megatrain::train::checkpoint;
use megatrain::train::config::{LrSchedule, Resume, TrainConfig};
use megatrain::train::{run, Progress};
use std::path::{Path, PathBuf};
use std::sync::atomic::AtomicBool;
use std::sync::Arc;

/// Collects the run's notes.
#[derive(Default)]
struct Notes(Vec<String>);
impl Progress for Notes {
    fn note(&mut self, line: &str) {
        self.0.push(line.to_owned());
    }
}

/// Stops the run after step `.1` (as Ctrl-C does).
struct StopAt(Arc<AtomicBool>, u64);
impl Progress for StopAt {
    fn step(&mut self, m: &megatrain::engine::StepMetrics, _: Option<f64>) {
        if m.step == self.1 {
            self.0.store(true, std::sync::atomic::Ordering::SeqCst);
        }
    }
}

const MODEL: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":48,"intermediate_size":136,
  "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":67,"tie_word_embeddings":false}"#;

fn setup(dir: &Path) -> (PathBuf, PathBuf) {
    let model = dir.join("model.json");
    std::fs::write(&model, MODEL).unwrap();
    let data = dir.join("train.bin");
    let mut s = 99u64;
    let bytes: Vec<u8> = (0..6000)
        .flat_map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s % 67) as u16).to_le_bytes()
        })
        .collect();
    std::fs::write(&data, bytes).unwrap();
    (model, data)
}

fn cfg(
    dir: &Path,
    (model, data): &(PathBuf, PathBuf),
    state: AdamState,
    steps: u64,
) -> TrainConfig {
    TrainConfig {
        model: Some(model.clone()),
        data: Some(data.clone()),
        seq_len: 16,
        batch_size: 2,
        steps,
        lr: 3e-3,
        lr_schedule: LrSchedule::Cosine,
        warmup_steps: 2,
        shuffle: true,
        seed: 5,
        adam_state: Some(state),
        checkpoint_dir: Some(dir.join("ckpt")),
        metrics: Some(dir.join("metrics.jsonl")),
        device_memory: 256 << 20,
        ..TrainConfig::default()
    }
}

fn go(c: &TrainConfig, progress: &mut dyn Progress) -> megatrain::train::Summary {
    run(c, Arc::new(AtomicBool::new(false)), progress).unwrap()
}

fn files(state: AdamState) -> [String; 3] {
    let ext = match state {
        AdamState::Fp32 => "f32",
        AdamState::Bf16 => "bf16",
        AdamState::Int8 => "int8",
    };
    [
        "params.f32".into(),
        format!("adam_m.{ext}"),
        format!("adam_v.{ext}"),
    ]
}

fn same_files(a: &Path, b: &Path, state: AdamState, what: &str) {
    for f in files(state) {
        let (x, y) = (
            std::fs::read(a.join(&f)).unwrap(),
            std::fs::read(b.join(&f)).unwrap(),
        );
        assert!(x == y, "{what}: {f} differs");
    }
}

#[test]
fn compact_runs_are_reproducible_resumable_and_spillable_bit_for_bit() {
    for state in [AdamState::Bf16, AdamState::Int8] {
        let a = tempfile::tempdir().unwrap();
        let inputs = setup(a.path());
        let straight = go(&cfg(a.path(), &inputs, state, 6), &mut Notes::default());
        let want = straight.checkpoint.unwrap();
        let st = checkpoint::read_state(&want).unwrap();
        assert_eq!(st.config.adam_state, Some(state));
        // The moment files hold what the store held: the format's size.
        let m = std::fs::metadata(want.join(&files(state)[1]))
            .unwrap()
            .len();
        let p = std::fs::metadata(want.join("params.f32")).unwrap().len();
        let ratio = m as f64 / p as f64;
        let expect = if state == AdamState::Bf16 { 0.5 } else { 0.25 };
        assert!(
            (ratio - expect).abs() < 0.02,
            "{state:?}: moments/params bytes {ratio}"
        );

        // The same run again: the same bits (the stochastic rounding is seeded).
        let b = tempfile::tempdir().unwrap();
        let again = go(&cfg(b.path(), &inputs, state, 6), &mut Notes::default());
        same_files(&want, &again.checkpoint.unwrap(), state, "a second run");

        // Interrupted after step 3, resumed (the format taken from the checkpoint).
        let c = tempfile::tempdir().unwrap();
        let h = cfg(c.path(), &inputs, state, 6);
        let flag = Arc::new(AtomicBool::new(false));
        let s = run(&h, flag.clone(), &mut StopAt(flag, 3)).unwrap();
        assert!(s.interrupted && s.steps == 3);
        let resumed = TrainConfig {
            resume: Resume::Always,
            adam_state: None,
            ..h
        };
        let r = go(&resumed, &mut Notes::default());
        assert_eq!(r.steps, 6);
        same_files(&want, &r.checkpoint.unwrap(), state, "resumed");

        // m/v of every unit on NVMe: the same bits; resumed from step 2 too.
        let d = tempfile::tempdir().unwrap();
        let spilled = TrainConfig {
            nvme: vec![d.path().join("nvme")],
            spill: SpillPolicy::All,
            spill_staging: 2,
            checkpoint_every: 2,
            ..cfg(d.path(), &inputs, state, 6)
        };
        let got = go(&spilled, &mut Notes::default()).checkpoint.unwrap();
        same_files(&want, &got, state, "spilled");
        std::fs::remove_dir_all(&got).unwrap();
        std::fs::remove_dir_all(d.path().join("ckpt/step-00000006")).ok();
        let again = TrainConfig {
            resume: Resume::Always,
            ..spilled
        };
        let got = go(&again, &mut Notes::default()).checkpoint.unwrap();
        same_files(&want, &got, state, "spilled, resumed");
    }
}

#[test]
fn resuming_with_another_format_converts_and_says_so() {
    let a = tempfile::tempdir().unwrap();
    let inputs = setup(a.path());
    let first = cfg(a.path(), &inputs, AdamState::Fp32, 3);
    go(&first, &mut Notes::default());
    let mut notes = Notes::default();
    let to_int8 = TrainConfig {
        resume: Resume::Always,
        steps: 5,
        adam_state: Some(AdamState::Int8),
        ..first.clone()
    };
    let s = go(&to_int8, &mut notes);
    let text = notes.0.join("\n");
    assert!(text.contains("adam_state fp32 → int8"), "{text}");
    assert!(
        text.contains("fp32 moments converted to int8 (quantised"),
        "{text}"
    );
    let ck = s.checkpoint.unwrap();
    assert!(ck.join("adam_m.int8").exists() && !ck.join("adam_m.f32").exists());
    let st = checkpoint::read_state(&ck).unwrap();
    assert_eq!(st.config.adam_state, Some(AdamState::Int8));
    assert!(st
        .changes
        .iter()
        .any(|c| c.key == "adam_state" && c.to == "int8"));

    // Unset on resume: the checkpoint's format stays, nothing converts.
    let mut notes = Notes::default();
    let keep = TrainConfig {
        steps: 6,
        adam_state: None,
        ..to_int8.clone()
    };
    let s = go(&keep, &mut notes);
    assert!(!notes.0.join("\n").contains("converted"), "{:?}", notes.0);
    assert!(s.checkpoint.unwrap().join("adam_v.int8").exists());

    // Back to fp32: dequantised, and training goes on with finite losses.
    let mut notes = Notes::default();
    let back = TrainConfig {
        steps: 8,
        adam_state: Some(AdamState::Fp32),
        ..keep
    };
    let s = go(&back, &mut notes);
    let text = notes.0.join("\n");
    assert!(
        text.contains("int8 moments converted to fp32 (dequantised)"),
        "{text}"
    );
    assert!(s.last_loss.unwrap().is_finite());
    assert!(s.checkpoint.unwrap().join("adam_m.f32").exists());
}

#[test]
fn an_int8_checkpoint_exports_like_an_fp32_one() {
    let a = tempfile::tempdir().unwrap();
    let inputs = setup(a.path());
    let s = go(
        &cfg(a.path(), &inputs, AdamState::Int8, 2),
        &mut Notes::default(),
    );
    let out = a.path().join("hf");
    let status = common::megatrain()
        .args(["export", "--checkpoint"])
        .arg(s.checkpoint.as_ref().unwrap())
        .arg("--out")
        .arg(&out)
        .output()
        .unwrap();
    assert!(
        status.status.success(),
        "{}",
        String::from_utf8_lossy(&status.stderr)
    );
    let listed: Vec<String> = std::fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert!(
        listed.iter().any(|f| f.ends_with(".safetensors")),
        "{listed:?}"
    );
    // The export (read unit by unit from the checkpoint's params file, no store) holds the
    // checkpoint's params exactly.
    use megatrain::store::{hf, layout, placement, HostStore};
    let ck = s.checkpoint.unwrap();
    let state = checkpoint::open(&ck).unwrap();
    let store = |l: layout::StateLayout| {
        let m = megatrain::topology::probe(&megatrain::topology::TopologySource::Live).unwrap();
        let p = placement::place(&m, &l, None, Default::default()).unwrap();
        HostStore::allocate(l, p, &Default::default()).unwrap()
    };
    let saved = store(
        layout::StateLayout::new(&state.model, layout::Mode::Lean)
            .with_adam_state(checkpoint::adam_state_of(&state)),
    );
    checkpoint::load(&ck, &saved).unwrap();
    let exported = store(layout::StateLayout::new(
        &hf::load_config(&out).unwrap(),
        layout::Mode::Lean,
    ));
    hf::load_into_store(&out, &exported).unwrap();
    let params = |st: &HostStore| -> Vec<Vec<u32>> {
        (0..st.num_units())
            .map(|u| {
                let v = st.take(u).unwrap().master().to_vec();
                v.iter().map(|x| x.to_bits()).collect()
            })
            .collect()
    };
    assert_eq!(params(&exported), params(&saved));
}
