//! The model out as a Hugging Face checkpoint: `config.json` + safetensors shards + index,
//! which `transformers` loads unchanged, in fp32 or bf16, each tensor read from a
//! [`ParamSource`] (the host store, or a training checkpoint's params file) 4 MiB at a time as
//! its shard is written (`O_DIRECT`, at the disk's rate): one piece in memory, not a tensor.

use super::super::layout::StateLayout;
use super::super::HostStore;
use super::INDEX;
use crate::model::units::{stored_tensors, StoredTensor};
use crate::optim::adamw::f32_to_bf16;
use crate::util::direct::DirectWriter;
use crate::util::progress::{Meter, Unit};
use crate::{Error, Result};
use safetensors::tensor::{Metadata, TensorInfo};
use safetensors::Dtype;
use std::collections::{BTreeMap, HashMap};
use std::io::Write;
use std::ops::Range;
use std::path::Path;

/// The element type of an export's tensors.
#[derive(
    Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize, clap::ValueEnum,
)]
#[serde(rename_all = "lowercase")]
pub enum ExportDtype {
    /// The fp32 master as it is.
    Fp32,
    /// The master rounded to bf16 (nearest-even): half the bytes, what models are served in.
    Bf16,
}

impl ExportDtype {
    /// Above this many parameters an export is bf16 unless fp32 is asked for.
    pub const BF16_ABOVE_PARAMS: u64 = 1_000_000_000;

    /// The default for a model of `params` parameters: fp32 up to [`Self::BF16_ABOVE_PARAMS`],
    /// bf16 above.
    pub fn default_for(params: u64) -> Self {
        match params > Self::BF16_ABOVE_PARAMS {
            true => ExportDtype::Bf16,
            false => ExportDtype::Fp32,
        }
    }

    fn bytes(self) -> u64 {
        match self {
            ExportDtype::Fp32 => 4,
            ExportDtype::Bf16 => 2,
        }
    }

    /// transformers' name of the dtype (`config.json`'s `torch_dtype`).
    pub fn torch_name(self) -> &'static str {
        match self {
            ExportDtype::Fp32 => "float32",
            ExportDtype::Bf16 => "bfloat16",
        }
    }
}

/// Where an export reads the parameters (fp32, in each unit's layout order).
pub trait ParamSource {
    /// Unit `u`'s parameters from element `start` into `dst`.
    fn read(&mut self, u: usize, start: usize, dst: &mut [f32]) -> Result<()>;
}

/// The host store's masters (a bf16-planes master's fp32 values).
impl ParamSource for &HostStore {
    fn read(&mut self, u: usize, start: usize, dst: &mut [f32]) -> Result<()> {
        let mut g = self.take(u)?;
        let master = g.master();
        if start + dst.len() > master.len() {
            return Err(Error::internal(
                "export",
                format!(
                    "unit {u}: {} elements at {start} of {}",
                    dst.len(),
                    master.len()
                ),
            ));
        }
        master.read(start, dst);
        Ok(())
    }
}

/// Elements read from the source at once while a tensor is written (1M: 4 MiB).
const READ_CHUNK: usize = 1 << 20;

/// One tensor of a shard: where its elements are in the source.
struct ShardTensor {
    name: String,
    unit: usize,
    range: Range<usize>,
    shape: Vec<usize>,
}

/// Write `tensors` as the safetensors file `path`: the header as the safetensors crate lays it
/// out (its `Metadata`, tensors sorted by name, padded to 8 bytes), then each tensor's bytes
/// read from `source` [`READ_CHUNK`] elements at a time, converted to `dtype`, through an
/// `O_DIRECT` writer (past the page cache, at the disk's rate), fsynced. Holds one piece.
fn write_shard(
    source: &mut dyn ParamSource,
    path: &Path,
    mut tensors: Vec<ShardTensor>,
    dtype: ExportDtype,
    meter: &Meter,
) -> Result<()> {
    let st_dtype = match dtype {
        ExportDtype::Fp32 => Dtype::F32,
        ExportDtype::Bf16 => Dtype::BF16,
    };
    tensors.sort_by(|a, b| a.name.cmp(&b.name));
    let mut offset = 0usize;
    let infos = tensors
        .iter()
        .map(|t| {
            let n = t.range.len() * dtype.bytes() as usize;
            offset += n;
            let info = TensorInfo {
                dtype: st_dtype,
                shape: t.shape.clone(),
                data_offsets: (offset - n, offset),
            };
            (t.name.clone(), info)
        })
        .collect();
    let meta: HashMap<String, String> = [("format".to_owned(), "pt".to_owned())].into();
    let bad = |e: String| Error::io("write safetensors", path, std::io::Error::other(e));
    let metadata = Metadata::new(Some(meta), infos).map_err(|e| bad(e.to_string()))?;
    let mut header = serde_json::to_vec(&metadata).map_err(|e| bad(e.to_string()))?;
    header.resize(header.len().next_multiple_of(8), b' ');
    let io = |e: std::io::Error| Error::io("write safetensors", path, e);
    let mut w = DirectWriter::create(path).map_err(io)?;
    w.write_all(&(header.len() as u64).to_le_bytes())
        .map_err(io)?;
    w.write_all(&header).map_err(io)?;
    let mut chunk = vec![0f32; READ_CHUNK];
    let mut bytes = Vec::with_capacity(READ_CHUNK * 4);
    for t in &tensors {
        let mut at = t.range.start;
        while at < t.range.end {
            let part = &mut chunk[..READ_CHUNK.min(t.range.end - at)];
            source.read(t.unit, at, part)?;
            bytes.clear();
            // Little-endian, as safetensors is (and this host: see hf.rs).
            match dtype {
                ExportDtype::Fp32 => bytes.extend(part.iter().flat_map(|x| x.to_le_bytes())),
                ExportDtype::Bf16 => {
                    bytes.extend(part.iter().flat_map(|&x| f32_to_bf16(x).to_le_bytes()))
                }
            }
            w.write_all(&bytes).map_err(io)?;
            meter.add(bytes.len() as u64);
            at += part.len();
        }
    }
    w.finish().map_err(io)?;
    Ok(())
}

/// Plan the shards: tensors in layout order, a new shard when the next tensor would pass
/// `max_shard_bytes` at `elem` bytes per element (a tensor larger than the limit gets a shard
/// of its own).
fn plan_shards(
    layout: &StateLayout,
    max_shard_bytes: u64,
    elem: u64,
) -> Vec<Vec<(usize, StoredTensor)>> {
    let mut shards: Vec<Vec<(usize, StoredTensor)>> = vec![Vec::new()];
    let mut size = 0u64;
    for (u, unit) in layout.units.iter().enumerate() {
        for t in stored_tensors(&layout.config, unit) {
            let bytes = elem * t.numel() as u64;
            if size > 0 && size + bytes > max_shard_bytes {
                shards.push(Vec::new());
                size = 0;
            }
            if let Some(s) = shards.last_mut() {
                s.push((u, t));
            }
            size += bytes;
        }
    }
    shards
}

/// What an export directory holds now.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum ExportDir {
    /// Nothing there.
    Absent,
    /// An empty directory.
    Empty,
    /// An earlier megatrain export (with the run that wrote it, when recorded).
    Export {
        /// The run id in its marker file.
        run_id: Option<String>,
    },
    /// Anything else.
    Other,
}

/// The marker file megatrain writes into an export: `{"run_id": …}`.
pub const EXPORT_MARKER: &str = "megatrain-export.json";

/// Look at `out` before exporting there.
pub fn export_dir_state(out: &Path) -> Result<ExportDir> {
    if !out.exists() {
        return Ok(ExportDir::Absent);
    }
    if !out.is_dir() {
        return Ok(ExportDir::Other);
    }
    let mut entries = std::fs::read_dir(out).map_err(|e| Error::io("read directory", out, e))?;
    if entries.next().is_none() {
        return Ok(ExportDir::Empty);
    }
    match std::fs::read(out.join(EXPORT_MARKER)) {
        Ok(bytes) => {
            let v: serde_json::Value = serde_json::from_slice(&bytes).unwrap_or_default();
            Ok(ExportDir::Export {
                run_id: v["run_id"].as_str().map(str::to_owned),
            })
        }
        Err(_) => Ok(ExportDir::Other),
    }
}

/// The files of a Hugging Face model directory besides its weights and `config.json` that
/// serving it needs — the tokenizer (every format transformers saves), its chat template, the
/// generation config — which an export copies from the directory the model was started from.
pub const SERVING_FILES: &[&str] = &[
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "spiece.model",
    "vocab.json",
    "vocab.txt",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
    "generation_config.json",
];

/// How an export is written.
#[derive(Debug, Clone, Copy)]
pub struct ExportOptions<'a> {
    /// The run that writes it (recorded in [`EXPORT_MARKER`]; an earlier export of the same run
    /// is replaced).
    pub run_id: Option<&'a str>,
    /// The tensors' type.
    pub dtype: ExportDtype,
    /// A Hugging Face model directory whose [`SERVING_FILES`] are copied beside the weights
    /// (those it has).
    pub serving_files_from: Option<&'a Path>,
}

impl ExportOptions<'_> {
    /// An export in `dtype`, of no run, with no serving files.
    pub fn new(dtype: ExportDtype) -> Self {
        ExportOptions {
            run_id: None,
            dtype,
            serving_files_from: None,
        }
    }
}

/// [`export`] of the host store's params.
pub fn export_store(
    store: &HostStore,
    out: &Path,
    max_shard_bytes: u64,
    opts: ExportOptions<'_>,
) -> Result<()> {
    let mut source = store;
    export(&mut source, store.layout(), out, max_shard_bytes, opts)
}

/// Write the params `source` gives for `layout` as an HF checkpoint directory `out`
/// (config.json, safetensors shards of at most `max_shard_bytes` in the options' dtype, the
/// index, and the serving files of the directory the options name), through a temporary
/// directory renamed into place. `out` must be absent or empty — or, when a run id is given, an
/// earlier export of that run, which is replaced only once the new one is complete. Holds one
/// tensor at a time.
pub fn export(
    source: &mut dyn ParamSource,
    layout: &StateLayout,
    out: &Path,
    max_shard_bytes: u64,
    opts: ExportOptions<'_>,
) -> Result<()> {
    let ExportOptions {
        run_id,
        dtype,
        serving_files_from,
    } = opts;
    let replace = match export_dir_state(out)? {
        ExportDir::Absent => false,
        ExportDir::Empty => {
            std::fs::remove_dir(out).map_err(|e| Error::io("remove empty directory", out, e))?;
            false
        }
        ExportDir::Export { run_id: Some(id) } if Some(id.as_str()) == run_id => true,
        ExportDir::Export { .. } | ExportDir::Other => {
            return Err(Error::bad_input(
                "export directory",
                out.display().to_string(),
                "already exists and is not empty; refusing to overwrite",
                Some("choose a new directory or remove the old export"),
            ));
        }
    };
    let parent = out
        .parent()
        .filter(|p| !p.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let name = out
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_else(|| "export".into());
    let tmp = parent.join(format!(".{name}.tmp-{}", std::process::id()));
    let old = parent.join(format!(".{name}.old-{}", std::process::id()));
    let files = Files {
        dir: &tmp,
        max_shard_bytes,
        run_id,
        dtype,
    };
    let result = write_export(source, layout, &files)
        .and_then(|()| copy_serving_files(serving_files_from, &tmp))
        .and_then(|()| {
            if replace {
                std::fs::rename(out, &old)
                    .map_err(|e| Error::io("move the old export aside", out, e))?;
            }
            if let Err(e) = std::fs::rename(&tmp, out) {
                if replace {
                    let _ = std::fs::rename(&old, out);
                }
                return Err(Error::io("rename export into place", out, e));
            }
            if replace {
                let _ = std::fs::remove_dir_all(&old);
            }
            // Make the rename durable.
            if let Ok(d) = std::fs::File::open(parent) {
                let _ = d.sync_all();
            }
            Ok(())
        });
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result
}

/// Copy the [`SERVING_FILES`] `from` has into `dir` (durably).
fn copy_serving_files(from: Option<&Path>, dir: &Path) -> Result<()> {
    let Some(from) = from else {
        return Ok(());
    };
    for name in SERVING_FILES {
        let src = from.join(name);
        if !src.is_file() {
            continue;
        }
        let bytes = std::fs::read(&src).map_err(|e| Error::io("read", &src, e))?;
        crate::util::write_atomic(&dir.join(name), &bytes)?;
    }
    Ok(())
}

/// Where and how [`write_export`] writes.
struct Files<'a> {
    dir: &'a Path,
    max_shard_bytes: u64,
    run_id: Option<&'a str>,
    dtype: ExportDtype,
}

fn write_export(source: &mut dyn ParamSource, layout: &StateLayout, f: &Files<'_>) -> Result<()> {
    let dir = f.dir;
    std::fs::create_dir_all(dir).map_err(|e| Error::io("create directory", dir, e))?;
    crate::util::failpoint::check("export").map_err(|e| Error::io("write export", dir, e))?;
    if let Some(id) = f.run_id {
        crate::util::write_atomic(
            &dir.join(EXPORT_MARKER),
            serde_json::json!({ "run_id": id }).to_string().as_bytes(),
        )?;
    }
    crate::util::write_atomic(
        &dir.join("config.json"),
        layout.config.to_hf_json_as(f.dtype.torch_name()).as_bytes(),
    )?;
    let shards = plan_shards(layout, f.max_shard_bytes, f.dtype.bytes());
    let n = shards.len();
    let meter = Meter::start(
        "export",
        f.dtype.bytes() * layout.num_params() as u64,
        Unit::Bytes,
    );
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    for (k, shard) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{n:05}.safetensors", k + 1);
        let mut tensors = Vec::with_capacity(shard.len());
        for (u, t) in shard {
            let (_, spec) = layout.tensor(&t.tensor)?;
            let start = spec.offset + t.offset;
            weight_map.insert(t.name.clone(), file.clone());
            total += f.dtype.bytes() * t.numel() as u64;
            tensors.push(ShardTensor {
                name: t.name.clone(),
                unit: *u,
                range: start..start + t.numel(),
                shape: t.shape.clone(),
            });
        }
        write_shard(source, &dir.join(&file), tensors, f.dtype, &meter)?;
    }
    meter.finish();
    let index =
        serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
    crate::util::write_atomic(
        &dir.join(INDEX),
        serde_json::to_string_pretty(&index)
            .unwrap_or_default()
            .as_bytes(),
    )
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Unit `u`'s element `i` is `u + i / 7` (not all representable in bf16).
    struct Ramp;

    impl ParamSource for Ramp {
        fn read(&mut self, u: usize, start: usize, dst: &mut [f32]) -> Result<()> {
            for (i, x) in dst.iter_mut().enumerate() {
                *x = u as f32 + (start + i) as f32 / 7.0;
            }
            Ok(())
        }
    }

    /// The streamed shard is byte for byte what the safetensors crate serializes from the same
    /// tensors, in both dtypes, across a piece boundary.
    #[test]
    fn a_streamed_shard_is_the_safetensors_crates_bytes() {
        let d = tempfile::tempdir().unwrap();
        let specs = [
            (
                "model.layers.0.mlp.up_proj.weight",
                1,
                5..5 + 3 * 5,
                vec![3, 5],
            ),
            ("lm_head.weight", 0, 0..READ_CHUNK + 3, vec![READ_CHUNK + 3]),
            ("model.norm.weight", 2, 0..4, vec![4]),
        ];
        for dtype in [ExportDtype::Fp32, ExportDtype::Bf16] {
            let tensors = specs
                .iter()
                .map(|(name, unit, range, shape)| ShardTensor {
                    name: (*name).into(),
                    unit: *unit,
                    range: range.clone(),
                    shape: shape.clone(),
                })
                .collect();
            let path = d.path().join("shard.safetensors");
            let meter = Meter::start("test", 0, Unit::Bytes);
            write_shard(&mut Ramp, &path, tensors, dtype, &meter).unwrap();
            let owned: Vec<(String, Vec<u8>, Vec<usize>)> = specs
                .iter()
                .map(|(name, unit, range, shape)| {
                    let mut v = vec![0f32; range.len()];
                    Ramp.read(*unit, range.start, &mut v).unwrap();
                    let bytes = match dtype {
                        ExportDtype::Fp32 => v.iter().flat_map(|x| x.to_le_bytes()).collect(),
                        ExportDtype::Bf16 => v
                            .iter()
                            .flat_map(|&x| f32_to_bf16(x).to_le_bytes())
                            .collect(),
                    };
                    ((*name).to_owned(), bytes, shape.clone())
                })
                .collect();
            let st = match dtype {
                ExportDtype::Fp32 => Dtype::F32,
                ExportDtype::Bf16 => Dtype::BF16,
            };
            let views: Vec<(String, safetensors::tensor::TensorView<'_>)> = owned
                .iter()
                .map(|(n, b, s)| {
                    let v = safetensors::tensor::TensorView::new(st, s.clone(), b).unwrap();
                    (n.clone(), v)
                })
                .collect();
            let meta: HashMap<String, String> = [("format".to_owned(), "pt".to_owned())].into();
            let want = safetensors::serialize(views, Some(meta)).unwrap();
            assert_eq!(std::fs::read(&path).unwrap(), want, "{dtype:?}");
        }
    }
}
