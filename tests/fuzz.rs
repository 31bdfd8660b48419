//! Fuzzing in the normal test suite, bounded (about a minute on 2 cores) and deterministic (a
//! fixed seed): thousands of mutated `config.json`, TOML, safetensors headers and hwloc XML
//! files go through the code paths the CLI runs, and not one may panic, abort or die by a
//! signal. The mutants start from real files and from a corpus of inputs that crashed earlier
//! versions (docs/RELIABILITY.md).
#![allow(clippy::unwrap_used, clippy::print_stderr)]

use megatrain::model::config::ModelConfig;
use megatrain::train::config::{Resume, TrainConfig};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Once};

/// Panics in any thread of this process (device and worker threads included), but those
/// contained as errors (`megatrain::util::contain`: a third-party decoder's, counted apart).
static PANICS: AtomicUsize = AtomicUsize::new(0);
/// Panics of third-party decoders contained as errors.
static CONTAINED: AtomicUsize = AtomicUsize::new(0);

/// The fuzz tests run one at a time, so each one's panic count is its own.
static SERIAL: std::sync::Mutex<()> = std::sync::Mutex::new(());

fn serial() -> std::sync::MutexGuard<'static, ()> {
    SERIAL.lock().unwrap_or_else(|e| e.into_inner())
}

fn count_panics() {
    static HOOK: Once = Once::new();
    HOOK.call_once(|| {
        let default = std::panic::take_hook();
        std::panic::set_hook(Box::new(move |info| {
            if megatrain::util::contain::is_contained() {
                CONTAINED.fetch_add(1, Ordering::SeqCst);
                return;
            }
            PANICS.fetch_add(1, Ordering::SeqCst);
            default(info);
        }));
    });
}

/// xorshift64*: the mutation source, seeded per test.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n.max(1) as u64) as usize
    }
    fn pick<'a, T>(&mut self, xs: &'a [T]) -> &'a T {
        &xs[self.below(xs.len())]
    }
}

/// Values that break naive size arithmetic or parsing.
const EXTREMES: &[&str] = &[
    "0",
    "1",
    "-1",
    "2",
    "3",
    "7",
    "65535",
    "65536",
    "4294967295",
    "4294967296",
    "9007199254740993",
    "4611686018427387904",
    "9223372036854775807",
    "9223372036854775808",
    "18446744073709551615",
    "18446744073709551616",
    "1e12",
    "1e300",
    "-1e300",
    "0.5",
    "1.5",
    "NaN",
    "\"x\"",
    "\"\"",
    "null",
    "true",
    "false",
    "[]",
    "{}",
    "[1,2]",
    "{\"a\":1}",
];

fn extreme(rng: &mut Rng) -> &'static str {
    EXTREMES[rng.below(EXTREMES.len())]
}

/// A byte-level mutation: flip, insert, delete or duplicate a few bytes.
fn mutate_bytes(rng: &mut Rng, mut b: Vec<u8>) -> Vec<u8> {
    for _ in 0..1 + rng.below(4) {
        if b.is_empty() {
            b.push(b'{');
        }
        let i = rng.below(b.len());
        match rng.below(5) {
            0 => b[i] ^= 1 << rng.below(8),
            1 => b.insert(i, *rng.pick(b"{}[]\",:0123456789-e.\\\n\x00\xff<>=/ ")),
            2 => {
                b.remove(i);
            }
            3 => {
                let j = (i + rng.below(64)).min(b.len());
                let chunk = b[i..j].to_vec();
                b.splice(i..i, chunk);
            }
            _ => b.truncate(i),
        }
    }
    b
}

/// A structural mutation of a JSON object: a key set to an extreme value, removed, or added.
fn mutate_json(rng: &mut Rng, v: &serde_json::Value, keys: &[&str]) -> String {
    let mut v = v.clone();
    for _ in 0..1 + rng.below(3) {
        let key = *rng.pick(keys);
        match rng.below(4) {
            0 => {
                if let Some(o) = v.as_object_mut() {
                    o.remove(key);
                }
            }
            _ => {
                let val: serde_json::Value =
                    serde_json::from_str(extreme(rng)).unwrap_or(serde_json::Value::Null);
                v[key] = val;
            }
        }
    }
    v.to_string()
}

const MODEL_KEYS: &[&str] = &[
    "architectures",
    "model_type",
    "vocab_size",
    "hidden_size",
    "intermediate_size",
    "num_hidden_layers",
    "num_attention_heads",
    "num_key_value_heads",
    "head_dim",
    "rms_norm_eps",
    "rope_theta",
    "max_position_embeddings",
    "tie_word_embeddings",
    "attention_bias",
    "mlp_bias",
    "hidden_act",
    "rope_scaling",
    "rope_parameters",
    "sliding_window",
    "use_sliding_window",
];

const TINY: &str = r#"{"architectures":["LlamaForCausalLM"],"hidden_size":32,"intermediate_size":72,
  "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":61,"tie_word_embeddings":true}"#;

/// Inputs that crashed earlier versions (issue #14), kept as seeds.
fn crash_corpus() -> Vec<String> {
    let base: serde_json::Value = serde_json::from_str(TINY).unwrap();
    [
        ("vocab_size", "18446744073709551615"),
        ("intermediate_size", "9223372036854775807"),
        ("hidden_size", "4611686018427387904"),
        ("head_dim", "4611686018427387904"),
        ("vocab_size", "9223372036854775808"),
        ("head_dim", "0"),
        ("hidden_size", "1000000000000"),
    ]
    .iter()
    .map(|(k, v)| {
        let mut c = base.clone();
        c[*k] = serde_json::from_str(v).unwrap();
        c.to_string()
    })
    .collect()
}

fn write_tokens(path: &Path, n: usize, vocab: u64) {
    let mut s = 99u64;
    let bytes: Vec<u8> = (0..n)
        .flat_map(|_| {
            s ^= s << 13;
            s ^= s >> 7;
            s ^= s << 17;
            ((s % vocab) as u16).to_le_bytes()
        })
        .collect();
    std::fs::write(path, bytes).unwrap();
}

struct Quiet;
impl megatrain::train::Progress for Quiet {}

/// Mutated config.json files through `megatrain train`'s own path (`train::run`: parse, size
/// checks, planning, RAM and device checks, and for the small valid ones a real training step).
#[test]
fn mutated_model_configs_never_panic() {
    let _one_at_a_time = serial();
    count_panics();
    let before = PANICS.load(Ordering::SeqCst);
    let d = tempfile::tempdir().unwrap();
    let data = d.path().join("tokens.bin");
    write_tokens(&data, 4000, 2);
    let seeds: Vec<serde_json::Value> = [
        TINY.to_owned(),
        std::fs::read_to_string(
            Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/golden/hf_gqa/config.json"),
        )
        .unwrap(),
    ]
    .iter()
    .map(|t| serde_json::from_str(t).unwrap())
    .collect();
    let mut inputs = crash_corpus();
    let mut rng = Rng(0x5EED_0001);
    for i in 0..1200 {
        let seed = &seeds[i % seeds.len()];
        inputs.push(if rng.below(4) == 0 {
            String::from_utf8_lossy(&mutate_bytes(&mut rng, seed.to_string().into_bytes()))
                .into_owned()
        } else {
            mutate_json(&mut rng, seed, MODEL_KEYS)
        });
    }
    let (mut ok, mut refused) = (0, 0);
    for (i, text) in inputs.iter().enumerate() {
        let path = d.path().join("config.json");
        std::fs::write(&path, text).unwrap();
        let cfg = TrainConfig {
            model: Some(path),
            data: Some(data.clone()),
            seq_len: 8,
            batch_size: 1,
            steps: 1,
            device_memory: 64 << 20,
            ram_budget: Some(256 << 20),
            resume: Resume::Never,
            ..TrainConfig::default()
        };
        let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            megatrain::train::run(
                &cfg,
                Arc::new(std::sync::atomic::AtomicBool::new(false)),
                &mut Quiet,
            )
        }));
        match r {
            Ok(Ok(_)) => ok += 1,
            Ok(Err(e)) => {
                assert!(!e.to_string().is_empty());
                refused += 1;
            }
            Err(_) => panic!("input {i} panicked: {text}"),
        }
    }
    let panics = PANICS.load(Ordering::SeqCst) - before;
    eprintln!(
        "config.json: {} inputs, {ok} trained a step, {refused} refused, {panics} panics",
        inputs.len()
    );
    assert_eq!(panics, 0);
    assert!(ok > 10 && refused > 100, "the mutants exercise both paths");
}

const TOML_KEYS: &[&str] = &[
    "seq_len",
    "batch_size",
    "grad_accum",
    "steps",
    "lr",
    "beta1",
    "beta2",
    "eps",
    "weight_decay",
    "grad_clip",
    "lr_schedule",
    "warmup_steps",
    "seed",
    "checkpoint_every",
    "keep_checkpoints",
    "resume",
    "device",
    "device_memory",
    "spill",
    "spill_staging",
    "io_engine",
    "ram_budget",
    "activations",
    "precision",
    "mode",
    "val_every",
    "val_batches",
    "data",
    "metrics",
    "nvme",
    "shuffle",
    "decay_norms",
];

/// Mutated run.toml files through the CLI's reading and validation.
#[test]
fn mutated_toml_configs_never_panic() {
    let _one_at_a_time = serial();
    count_panics();
    let before = PANICS.load(Ordering::SeqCst);
    let seed = "seq_len = 128\nbatch_size = 8\ngrad_accum = 2\nsteps = 100\nlr = 3e-4\n\
                lr_schedule = \"cosine\"\nwarmup_steps = 10\nresume = \"auto\"\n\
                checkpoint_dir = \"ck\"\nmetrics = \"m.jsonl\"\nnvme = [\"a\"]\n";
    let mut rng = Rng(0x5EED_0002);
    let (mut valid, mut refused) = (0, 0);
    for _ in 0..5000 {
        let text = if rng.below(2) == 0 {
            String::from_utf8_lossy(&mutate_bytes(&mut rng, seed.as_bytes().to_vec())).into_owned()
        } else {
            let key = rng.pick(TOML_KEYS);
            let raw = *rng.pick(EXTREMES);
            let value = match raw {
                "null" => "\"null\"".to_owned(),
                "{}" => "{}".to_owned(),
                "NaN" => "nan".to_owned(),
                other => other.replace("e300", "e30"),
            };
            format!("{seed}{key} = {value}\n")
        };
        let r = std::panic::catch_unwind(|| {
            TrainConfig::from_toml_str(&text, "fuzz.toml").and_then(|c| c.validate())
        });
        match r {
            Ok(Ok(())) => valid += 1,
            Ok(Err(_)) => refused += 1,
            Err(_) => panic!("panicked on: {text}"),
        }
    }
    let panics = PANICS.load(Ordering::SeqCst) - before;
    eprintln!("TOML: 5000 inputs, {valid} valid, {refused} refused, {panics} panics");
    assert_eq!(panics, 0);
    assert!(valid > 50 && refused > 500);
}

/// Mutated safetensors headers (and bodies) through `--init-from`'s loader into a real store.
#[test]
fn mutated_safetensors_never_panic() {
    let _one_at_a_time = serial();
    count_panics();
    let before = PANICS.load(Ordering::SeqCst);
    let cfg = ModelConfig::from_json_str(TINY, "tiny").unwrap();
    let layout =
        megatrain::store::layout::StateLayout::new(&cfg, megatrain::store::layout::Mode::Lean);
    let machine = megatrain::topology::probe(&megatrain::topology::TopologySource::Live).unwrap();
    let placement = megatrain::store::placement::place(
        &machine,
        &layout,
        None,
        megatrain::store::placement::RamBudget::default(),
    )
    .unwrap();
    let store =
        megatrain::store::HostStore::allocate(layout.clone(), placement, &Default::default())
            .unwrap();
    // A valid file of the tiny model: written by our own export.
    let d = tempfile::tempdir().unwrap();
    let export = d.path().join("export");
    megatrain::store::hf::export_store(
        &store,
        &export,
        1 << 30,
        megatrain::store::hf::ExportOptions::new(megatrain::store::hf::ExportDtype::Fp32),
    )
    .unwrap();
    let file = std::fs::read(export.join("model-00001-of-00001.safetensors")).unwrap();
    let n = u64::from_le_bytes(file[..8].try_into().unwrap()) as usize;
    let header: serde_json::Value = serde_json::from_slice(&file[8..8 + n]).unwrap();
    let body = &file[8 + n..];
    let names: Vec<String> = header.as_object().unwrap().keys().cloned().collect();
    let dir = d.path().join("in");
    std::fs::create_dir(&dir).unwrap();
    std::fs::write(dir.join("config.json"), TINY).unwrap();
    let mut rng = Rng(0x5EED_0003);
    let (mut loaded, mut refused) = (0, 0);
    for _ in 0..2500 {
        let bytes = match rng.below(3) {
            0 => mutate_bytes(&mut rng, file.clone()),
            _ => {
                let mut h = header.clone();
                let name = rng.pick(&names).clone();
                let field = *rng.pick(&["dtype", "shape", "data_offsets", "__metadata__"]);
                let val: serde_json::Value = match rng.below(4) {
                    0 => serde_json::json!(
                        rng.pick(&["F32", "BF16", "F16", "I64", "U8", "F64", "Q4"])
                    ),
                    1 => serde_json::json!([rng.next() % 100, rng.next() >> rng.below(64)]),
                    2 => serde_json::json!([rng.next() >> rng.below(64)]),
                    _ => serde_json::from_str(extreme(&mut rng)).unwrap_or_default(),
                };
                if field == "__metadata__" {
                    h[field] = val;
                } else {
                    h[&name][field] = val;
                }
                let text = h.to_string().into_bytes();
                let mut out = (text.len() as u64).to_le_bytes().to_vec();
                out.extend(text);
                out.extend_from_slice(body);
                out
            }
        };
        std::fs::write(dir.join("model.safetensors"), &bytes).unwrap();
        match std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
            megatrain::store::hf::load_into_store(&dir, &store)
        })) {
            Ok(Ok(_)) => loaded += 1,
            Ok(Err(_)) => refused += 1,
            Err(_) => panic!("panicked on a mutated safetensors file"),
        }
    }
    let panics = PANICS.load(Ordering::SeqCst) - before;
    eprintln!("safetensors: 2500 inputs, {loaded} loaded, {refused} refused, {panics} panics");
    assert_eq!(panics, 0);
    assert!(loaded > 10 && refused > 500);
}

/// Mutated hwloc XML through `megatrain probe --topology` (a process each: hwloc is C, and a
/// crash must come back as an error, exit 2 — never a signal or a panic).
#[test]
fn mutated_topology_xml_never_crashes_the_cli() {
    let _one_at_a_time = serial();
    let src = std::fs::read(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("tests/fixtures/topologies/nvidiagpunumanodes-kept.xml"),
    )
    .unwrap();
    let text = String::from_utf8(src.clone()).unwrap();
    let attrs = [
        "cpuset",
        "complete_cpuset",
        "nodeset",
        "complete_nodeset",
        "os_index",
        "type",
        "local_memory",
        "gp_index",
        "depth",
        "attr",
    ];
    let d = tempfile::tempdir().unwrap();
    let mut rng = Rng(0x5EED_0004);
    let (mut ok, mut refused) = (0, 0);
    let mut counts = std::collections::BTreeMap::new();
    for i in 0..1500 {
        let bytes = if rng.below(2) == 0 {
            mutate_bytes(&mut rng, src.clone())
        } else {
            // Drop or corrupt one attribute occurrence.
            let attr = rng.pick(&attrs);
            let pat = format!(" {attr}=\"");
            let hits: Vec<usize> = text.match_indices(&pat).map(|(k, _)| k).collect();
            let mut t = text.clone();
            if let Some(&at) = hits.get(rng.below(hits.len())) {
                let end = t[at + pat.len()..]
                    .find('"')
                    .map_or(t.len(), |e| at + pat.len() + e + 1);
                let replacement = match rng.below(3) {
                    0 => String::new(),
                    1 => format!(
                        " {attr}=\"{}\"",
                        rng.pick(&["", "0x", "-1", "0xffffffffffffffffffff", "zz", "0,,0"])
                    ),
                    _ => format!(" {attr}=\"{}\"", rng.next()),
                };
                t.replace_range(at..end, &replacement);
            }
            t.into_bytes()
        };
        let path: PathBuf = d.path().join(format!("t{i}.xml"));
        std::fs::write(&path, &bytes).unwrap();
        let out = std::process::Command::new(env!("CARGO_BIN_EXE_megatrain"))
            .args(["probe", "--json", "--topology"])
            .arg(&path)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        match out.status.code() {
            Some(0) => ok += 1,
            // hwloc may print its own warnings first; ours is the last line.
            Some(2)
                if err.lines().last().is_some_and(|l| l.starts_with("error: "))
                    && !err.contains("panicked") =>
            {
                refused += 1;
                let why = if err.contains("crashed") {
                    "hwloc crashed (caught)"
                } else {
                    "refused"
                };
                *counts.entry(why).or_insert(0) += 1;
            }
            other => panic!("{}: exit {other:?}: {err}", path.display()),
        }
        let _ = std::fs::remove_file(&path);
    }
    eprintln!("topology XML: 1500 inputs, {ok} loaded, {refused} refused ({counts:?}), 0 crashes");
    assert!(ok > 50 && refused > 50);
}

/// Mutated document files (`prepare --format chat|prompt-completion`) through what `train` does
/// with them: open and verify, pack, read every row. Header fields get extreme counts and widths
/// as well as byte flips; none may panic.
#[test]
fn mutated_document_files_never_panic() {
    use megatrain::train::config::{DataDtype, Overlong, Packing};
    use megatrain::train::data::{Cursor, DataFile, Loader, RowSpec};
    use megatrain::train::documents::{encode, Document};
    let _one_at_a_time = serial();
    count_panics();
    let before = PANICS.load(Ordering::SeqCst);
    let docs: Vec<Document> = (0..12)
        .map(|d| {
            let n = 3 + (d * 3) % 11;
            Document {
                tokens: (0..n).map(|i| ((d * 7 + i) % 50) as u32).collect(),
                mask: (0..n).map(|i| i > d % 2).collect(),
            }
        })
        .collect();
    let valid = encode(&docs, 2, 0).unwrap();
    let d = tempfile::tempdir().unwrap();
    let path = d.path().join("docs.bin");
    let mut rng = Rng(0x5EED_0005);
    let (mut read, mut refused) = (0, 0);
    for _ in 0..3000 {
        let mut bytes = valid.clone();
        match rng.below(3) {
            0 => bytes = mutate_bytes(&mut rng, bytes),
            1 => {
                // A header field (width, documents, tokens, pad) set to an extreme value.
                let (at, len) = *rng.pick(&[(12, 4), (16, 8), (24, 8), (32, 4)]);
                let v: u64 = match rng.below(3) {
                    0 => rng.next(),
                    1 => rng.next() >> rng.below(64),
                    _ => *rng.pick(&[0, 1, 2, 3, 4, u64::from(u32::MAX), u64::MAX]),
                };
                bytes[at..at + len].copy_from_slice(&v.to_le_bytes()[..len]);
            }
            _ => {
                // A body byte changed and the checksum fixed, so verification must catch it.
                let i = 40 + rng.below(bytes.len() - 40);
                bytes[i] = rng.next() as u8;
                let crc = crc32c::crc32c(&bytes[40..]);
                bytes[36..40].copy_from_slice(&crc.to_le_bytes());
            }
        }
        std::fs::write(&path, &bytes).unwrap();
        let outcome =
            std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| -> megatrain::Result<()> {
                let file = DataFile::open(&path, DataDtype::U16, 50)?;
                let spec = RowSpec {
                    seq: 1 + rng.below(24),
                    batch: 1,
                    packing: *rng.pick(&[Packing::On, Packing::Off]),
                    overlong: *rng.pick(&[Overlong::Truncate, Overlong::Drop]),
                };
                let mut l = Loader::new(file, spec, true, 1, Cursor::default())?;
                for _ in 0..20 {
                    let mb = l.next_batch();
                    assert_eq!(mb.tokens.len(), spec.seq);
                }
                Ok(())
            }));
        match outcome {
            Ok(Ok(())) => read += 1,
            Ok(Err(_)) => refused += 1,
            Err(_) => panic!("panicked on a mutated document file"),
        }
    }
    let panics = PANICS.load(Ordering::SeqCst) - before;
    eprintln!("document files: 3000 inputs, {read} read, {refused} refused, {panics} panics");
    assert_eq!(panics, 0);
    assert!(
        read > 100 && refused > 1000,
        "{read} read, {refused} refused"
    );
}

/// Mutated chat JSON Lines and chat templates through `megatrain prepare --format chat`: a
/// clear error or a written file, never a panic.
#[test]
fn mutated_chat_data_and_templates_never_panic() {
    use megatrain::train::prepare::{prepare, Format, PrepareArgs, TrainOn};
    let _one_at_a_time = serial();
    count_panics();
    let before = PANICS.load(Ordering::SeqCst);
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat");
    let lines = std::fs::read(fixtures.join("conversations.jsonl")).unwrap();
    let config: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(fixtures.join("qwen/tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    let template = config["chat_template"]
        .as_str()
        .unwrap()
        .as_bytes()
        .to_vec();
    let d = tempfile::tempdir().unwrap();
    let (input, tpl) = (d.path().join("c.jsonl"), d.path().join("t.jinja"));
    let mut rng = Rng(0x5EED_0006);
    let (mut written, mut refused) = (0, 0);
    for i in 0..600 {
        let mutate_template = i % 2 == 1;
        let data = match mutate_template {
            true => lines.clone(),
            false => mutate_bytes(&mut rng, lines.clone()),
        };
        let t = match mutate_template {
            true => mutate_bytes(&mut rng, template.clone()),
            false => template.clone(),
        };
        std::fs::write(&input, &data).unwrap();
        std::fs::write(&tpl, &t).unwrap();
        let args = PrepareArgs {
            tokenizer: fixtures.join("gen"),
            input: input.clone(),
            out: d.path().join("o.bin"),
            dtype: None,
            format: Format::Chat,
            text_key: "text".into(),
            eos: None,
            train_on: *rng.pick(&[TrainOn::Response, TrainOn::All]),
            chat_template: Some(tpl.clone()),
            renderer: None,
        };
        match std::panic::catch_unwind(|| prepare(&args)) {
            Ok(Ok(_)) => written += 1,
            Ok(Err(_)) => refused += 1,
            Err(_) => panic!("panicked on mutated chat data or template"),
        }
    }
    let panics = PANICS.load(Ordering::SeqCst) - before;
    eprintln!("chat data: 600 inputs, {written} written, {refused} refused, {panics} panics");
    assert_eq!(panics, 0);
    assert!(
        written > 50 && refused > 50,
        "{written} written, {refused} refused"
    );
}

/// Hostile chat templates (loops without end, strings doubled without bound, deep recursion,
/// huge repetitions and ranges) through the real binary, whose renderer runs in a child capped in
/// memory: each is a clear error (exit 2) naming the template or the sample, never a signal or
/// an abort, and finishes in seconds.
#[test]
fn hostile_chat_templates_are_errors_not_crashes_or_hangs() {
    let _one_at_a_time = serial();
    let exe = env!("CARGO_BIN_EXE_megatrain");
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat");
    let d = tempfile::tempdir().unwrap();
    let tpl = d.path().join("t.jinja");
    let mut rng = Rng(0x5EED_0007);
    let mut cases: Vec<String> = vec![
        "{% for i in range(100000) %}{% for j in range(100000) %}.{% endfor %}{% endfor %}".into(),
        "{% set ns = namespace(s='xy') %}{% for i in range(40) %}{% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s|length }}".into(),
        "{% macro f(n) %}{{ f(n + 1) }}{% endmacro %}{{ f(0) }}".into(),
        "{{ 'x' * 1000000000000 }}".into(),
        "{% for i in range(1000000000000) %}.{% endfor %}".into(),
        "{% set ns = namespace(l=[1]) %}{% for i in range(64) %}{% set ns.l = ns.l + ns.l %}{% endfor %}{{ ns.l|length }}".into(),
    ];
    for _ in 0..8 {
        let doublings = 20 + rng.below(30);
        let inner = 1 + rng.below(1 << 20);
        cases.push(match rng.below(3) {
            0 => format!(
                "{{% set ns = namespace(s=messages[0].content) %}}{{% for i in range({doublings}) %}}{{% set ns.s = ns.s ~ ns.s %}}{{% endfor %}}{{{{ ns.s }}}}"
            ),
            1 => format!(
                "{{% for m in messages %}}{{% for i in range({inner}) %}}{{% for j in range({inner}) %}}{{{{ m.content }}}}{{% endfor %}}{{% endfor %}}{{% endfor %}}"
            ),
            _ => format!(
                "{{% set ns = namespace(s='ab') %}}{{% for i in range({doublings}) %}}{{% set ns.s = ns.s + ns.s|upper %}}{{% endfor %}}{{{{ ns.s[:3] }}}}"
            ),
        });
    }
    let (mut refused, mut written) = (0, 0);
    for (i, t) in cases.iter().enumerate() {
        std::fs::write(&tpl, t).unwrap();
        let started = std::time::Instant::now();
        let out = std::process::Command::new(exe)
            .args(["prepare", "--format", "chat", "--tokenizer"])
            .arg(fixtures.join("gen"))
            .arg("--input")
            .arg(fixtures.join("conversations.jsonl"))
            .arg("--out")
            .arg(d.path().join(format!("o{i}.bin")))
            .arg("--chat-template")
            .arg(&tpl)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        let secs = started.elapsed().as_secs_f64();
        assert!(secs < 60.0, "case {i} took {secs:.0} s: {t}");
        match out.status.code() {
            Some(0) => written += 1,
            Some(2) => {
                assert!(
                    err.starts_with("error: ") && !err.contains("panicked"),
                    "case {i}: {err}"
                );
                // Named: the sample's line, and the template's file when the template failed.
                assert!(err.contains("conversations.jsonl"), "case {i}: {err}");
                if err.contains("chat template") {
                    assert!(err.contains("t.jinja"), "case {i}: {err}");
                }
                refused += 1;
            }
            other => panic!("case {i} ended with {other:?} (a signal?): {t}\n{err}"),
        }
    }
    eprintln!(
        "hostile chat templates: {} cases, {refused} refused, {written} rendered",
        cases.len()
    );
    assert!(refused >= 10, "{refused} refused");
}

/// Random, mostly hostile argument lists for `bench` and `plan` (zero, negative, huge, not a
/// number): every run ends with exit 0, 1 or 2 — never a panic (101), an abort or a signal —
/// and within a minute.
#[test]
fn bench_and_plan_arguments_never_crash() {
    let _one_at_a_time = serial();
    let exe = env!("CARGO_BIN_EXE_megatrain");
    let d = tempfile::tempdir().unwrap();
    let dir = d.path().to_str().unwrap().to_owned();
    let mut rng = Rng(0x5EED_0008);
    let counts = [
        "0",
        "1",
        "2",
        "-1",
        "abc",
        "1000000000",
        "18446744073709551616",
    ];
    let sizes = [
        "0",
        "1",
        "4096",
        "4Ki",
        "1E",
        "-5",
        "1.5M",
        "99999999999999999999",
    ];
    let (mut ok, mut refused) = (0, 0);
    for i in 0..48 {
        let mut args: Vec<String> = Vec::new();
        let flag = |args: &mut Vec<String>, name: &str, pool: &[&str], rng: &mut Rng| {
            if rng.below(4) != 0 {
                args.push(name.to_owned());
                args.push(rng.pick(pool).to_string());
            }
        };
        match i % 6 {
            0 => {
                args.extend(["bench".into(), "attention".into()]);
                flag(
                    &mut args,
                    "--seq",
                    &["0", "1", "16", "100000000", "-3", "x"],
                    &mut rng,
                );
                flag(&mut args, "--reps", &counts, &mut rng);
                flag(&mut args, "--heads", &counts, &mut rng);
                flag(&mut args, "--kv-heads", &counts, &mut rng);
                flag(
                    &mut args,
                    "--head-dim",
                    &["0", "1", "8", "1000000"],
                    &mut rng,
                );
            }
            1 => {
                args.extend(["bench".into(), "nvme".into(), "--dir".into(), dir.clone()]);
                flag(&mut args, "--size", &sizes, &mut rng);
                flag(
                    &mut args,
                    "--block",
                    &["0", "1000", "4096", "4Ki", "2G"],
                    &mut rng,
                );
                flag(&mut args, "--qd", &["0", "1", "5000", "-1"], &mut rng);
                flag(
                    &mut args,
                    "--reps",
                    &["0", "1", "-1", "1000000000"],
                    &mut rng,
                );
            }
            2 => {
                args.extend(["bench".into(), "link".into()]);
                flag(&mut args, "--size", &sizes, &mut rng);
                flag(&mut args, "--reps", &["0", "1", "1000000000"], &mut rng);
            }
            3 => {
                args.extend(["bench".into(), "adam".into()]);
                flag(
                    &mut args,
                    "--params",
                    &["0", "1024", "2000", "1E", "-1"],
                    &mut rng,
                );
                flag(&mut args, "--reps", &["0", "1", "1000000000"], &mut rng);
                flag(&mut args, "--threads", &["0", "1", "1000000"], &mut rng);
            }
            4 => {
                args.extend(["bench".into(), "engine".into(), "--steps".into()]);
                args.push(rng.pick(&["0", "-1", "1000000000", "x"]).to_string());
            }
            _ => {
                args.extend(
                    ["plan", "--model", "llama-3-8b", "--machine", "h100-512gb"].map(String::from),
                );
                flag(
                    &mut args,
                    "--seq-len",
                    &["0", "1", "4096", "1000000000"],
                    &mut rng,
                );
                flag(
                    &mut args,
                    "--tokens-per-step",
                    &["0", "1", "4096", "8192", "4099", "1000000000000000"],
                    &mut rng,
                );
                flag(
                    &mut args,
                    "--micro-batch-tokens",
                    &["0", "3", "4096", "1000000000000000"],
                    &mut rng,
                );
            }
        }
        let started = std::time::Instant::now();
        let out = std::process::Command::new(exe)
            .args(&args)
            .output()
            .unwrap();
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(started.elapsed().as_secs() < 60, "{args:?} took too long");
        match out.status.code() {
            Some(0) => ok += 1,
            Some(1 | 2) => {
                assert!(
                    err.contains("error: ") && !err.contains("panicked"),
                    "{args:?}: {err}"
                );
                refused += 1;
            }
            other => panic!("{args:?} ended with {other:?}: {err}"),
        }
    }
    eprintln!("bench and plan arguments: 48 runs, {ok} ran, {refused} refused");
    assert!(refused > 24, "{refused} refused");
}

/// Mutated Parquet and Arrow IPC files, stream and file format (written here by the Arrow
/// crates: three row groups or batches of a text column) through `megatrain prepare`: a clear
/// error or a written file, never a panic.
#[test]
fn mutated_parquet_and_arrow_files_never_panic() {
    use arrow_array::{RecordBatch, StringArray};
    use megatrain::train::prepare::{prepare, Format, PrepareArgs, TrainOn};
    use std::sync::Arc;
    let _one_at_a_time = serial();
    count_panics();
    let before = PANICS.load(Ordering::SeqCst);
    let contained_before = CONTAINED.load(Ordering::SeqCst);
    let texts: Vec<String> = (0..90)
        .map(|i| format!("row {i} says {}", "a ".repeat(i % 7)))
        .collect();
    let batch = RecordBatch::try_from_iter([(
        "text",
        Arc::new(StringArray::from(texts)) as arrow_array::ArrayRef,
    )])
    .unwrap();
    let mut parquet_bytes = Vec::new();
    {
        let props = parquet::file::properties::WriterProperties::builder()
            .set_max_row_group_row_count(Some(30))
            .set_compression(parquet::basic::Compression::SNAPPY)
            .build();
        let mut w =
            parquet::arrow::ArrowWriter::try_new(&mut parquet_bytes, batch.schema(), Some(props))
                .unwrap();
        w.write(&batch).unwrap();
        w.close().unwrap();
    }
    let mut ipc_bytes = Vec::new();
    {
        let mut w =
            arrow_ipc::writer::StreamWriter::try_new(&mut ipc_bytes, &batch.schema()).unwrap();
        for k in 0..3 {
            w.write(&batch.slice(30 * k, 30)).unwrap();
        }
        w.finish().unwrap();
    }
    let mut ipc_file_bytes = Vec::new();
    {
        let mut w =
            arrow_ipc::writer::FileWriter::try_new(&mut ipc_file_bytes, &batch.schema()).unwrap();
        for k in 0..3 {
            w.write(&batch.slice(30 * k, 30)).unwrap();
        }
        w.finish().unwrap();
    }
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/chat");
    let d = tempfile::tempdir().unwrap();
    let mut rng = Rng(0x5EED_0008);
    const N: usize = 1000;
    let (mut written, mut refused) = (0, 0);
    for i in 0..N {
        let (name, good) = match i % 3 {
            0 => ("t.parquet", &parquet_bytes),
            1 => ("t.arrow", &ipc_bytes),
            _ => ("f.arrow", &ipc_file_bytes),
        };
        let input = d.path().join(name);
        std::fs::write(&input, mutate_bytes(&mut rng, good.clone())).unwrap();
        let args = PrepareArgs {
            tokenizer: fixtures.join("gen"),
            input,
            out: d.path().join("o.bin"),
            dtype: None,
            format: Format::Text,
            text_key: "text".into(),
            eos: None,
            train_on: TrainOn::Response,
            chat_template: None,
            renderer: None,
        };
        match std::panic::catch_unwind(|| prepare(&args)) {
            Ok(Ok(_)) => written += 1,
            Ok(Err(_)) => refused += 1,
            Err(_) => panic!("panicked on a mutated {name}"),
        }
    }
    let panics = PANICS.load(Ordering::SeqCst) - before;
    let contained = CONTAINED.load(Ordering::SeqCst) - contained_before;
    eprintln!(
        "tables: {N} inputs, {written} written, {refused} refused ({contained} of them the Arrow reader's panics, contained), {panics} panics"
    );
    assert_eq!(panics, 0);
    assert!(
        written > 20 && refused > 50,
        "{written} written, {refused} refused"
    );
}
