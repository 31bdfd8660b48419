//! The model out as a Hugging Face checkpoint: `config.json` + safetensors shards + index,
//! which `transformers` loads unchanged, in fp32 or bf16, read unit by unit from a
//! [`ParamSource`] (the host store, or a training checkpoint's params file) so that no more than
//! one shard's units are in memory at once.

use super::super::layout::StateLayout;
use super::super::{HostStore, Master};
use super::INDEX;
use crate::model::units::{stored_tensors, StoredTensor};
use crate::optim::adamw::f32_to_bf16;
use crate::{Error, Result};
use safetensors::{Dtype, View};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
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

/// Where an export reads each unit's parameters (fp32, in the unit's layout order).
pub trait ParamSource {
    /// Unit `u`'s parameters.
    fn unit(&mut self, u: usize) -> Result<Vec<f32>>;
}

/// The host store's masters (a bf16-planes master joined into fp32).
impl ParamSource for &HostStore {
    fn unit(&mut self, u: usize) -> Result<Vec<f32>> {
        let mut g = self.take(u)?;
        Ok(match g.master() {
            Master::Fp32(p) => p.to_vec(),
            planes => planes.to_vec(),
        })
    }
}

/// A tensor for the safetensors writer: a borrowed fp32 slice, or its bf16 bits.
enum TensorView<'a> {
    F32(Vec<usize>, &'a [f32]),
    Bf16(Vec<usize>, Vec<u16>),
}

impl View for TensorView<'_> {
    fn dtype(&self) -> Dtype {
        match self {
            TensorView::F32(..) => Dtype::F32,
            TensorView::Bf16(..) => Dtype::BF16,
        }
    }
    fn shape(&self) -> &[usize] {
        match self {
            TensorView::F32(s, _) | TensorView::Bf16(s, _) => s,
        }
    }
    fn data(&self) -> Cow<'_, [u8]> {
        // SAFETY: f32 and u16 have no padding or invalid bit patterns as bytes; safetensors is
        // little-endian, and so is this host (see the compile_error! guard in hf.rs).
        Cow::Borrowed(unsafe {
            match self {
                TensorView::F32(_, d) => {
                    std::slice::from_raw_parts(d.as_ptr().cast::<u8>(), d.len() * 4)
                }
                TensorView::Bf16(_, d) => {
                    std::slice::from_raw_parts(d.as_ptr().cast::<u8>(), d.len() * 2)
                }
            }
        })
    }
    fn data_len(&self) -> usize {
        match self {
            TensorView::F32(_, d) => d.len() * 4,
            TensorView::Bf16(_, d) => d.len() * 2,
        }
    }
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

/// [`export`] of the host store's params.
pub fn export_store(
    store: &HostStore,
    out: &Path,
    max_shard_bytes: u64,
    (run_id, dtype): (Option<&str>, ExportDtype),
) -> Result<()> {
    let mut source = store;
    export(
        &mut source,
        store.layout(),
        out,
        max_shard_bytes,
        (run_id, dtype),
    )
}

/// Write the params `source` gives for `layout` as an HF checkpoint directory `out`
/// (config.json, safetensors shards of at most `max_shard_bytes` in `dtype`, and the index),
/// through a temporary directory renamed into place. `out` must be absent or empty — or, when
/// `run_id` is given, an earlier export of that run, which is replaced only once the new one is
/// complete. Holds one shard's units at a time.
pub fn export(
    source: &mut dyn ParamSource,
    layout: &StateLayout,
    out: &Path,
    max_shard_bytes: u64,
    (run_id, dtype): (Option<&str>, ExportDtype),
) -> Result<()> {
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
    let result = write_export(source, layout, &files).and_then(|()| {
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
    let mut weight_map = BTreeMap::new();
    let mut total = 0u64;
    // The unit the previous shard ended in, kept for the next shard when it continues there.
    let mut carried: Option<(usize, Vec<f32>)> = None;
    for (k, shard) in shards.iter().enumerate() {
        let file = format!("model-{:05}-of-{n:05}.safetensors", k + 1);
        let path = dir.join(&file);
        let mut params: HashMap<usize, Vec<f32>> = HashMap::new();
        if let Some((u, p)) = carried.take() {
            if shard.iter().any(|(v, _)| *v == u) {
                params.insert(u, p);
            }
        }
        for &(u, _) in shard {
            if let std::collections::hash_map::Entry::Vacant(e) = params.entry(u) {
                e.insert(source.unit(u)?);
            }
        }
        let mut views: Vec<(String, TensorView<'_>)> = Vec::new();
        for (u, t) in shard {
            let (_, spec) = layout.tensor(&t.tensor)?;
            let start = spec.offset + t.offset;
            let data = &params[u][start..start + t.numel()];
            weight_map.insert(t.name.clone(), file.clone());
            total += f.dtype.bytes() * t.numel() as u64;
            let view = match f.dtype {
                ExportDtype::Fp32 => TensorView::F32(t.shape.clone(), data),
                ExportDtype::Bf16 => TensorView::Bf16(
                    t.shape.clone(),
                    data.iter().map(|&x| f32_to_bf16(x)).collect(),
                ),
            };
            views.push((t.name.clone(), view));
        }
        let meta: HashMap<String, String> = [("format".to_owned(), "pt".to_owned())].into();
        safetensors::serialize_to_file(views, Some(meta), &path).map_err(|e| {
            Error::io(
                "write safetensors",
                &path,
                std::io::Error::other(e.to_string()),
            )
        })?;
        std::fs::File::open(&path)
            .and_then(|f| f.sync_all())
            .map_err(|e| Error::io("fsync", &path, e))?;
        // A unit split across shards is read once.
        if let Some(&(last, _)) = shard.last() {
            carried = params.remove(&last).map(|p| (last, p));
        }
    }
    let index =
        serde_json::json!({ "metadata": { "total_size": total }, "weight_map": weight_map });
    crate::util::write_atomic(
        &dir.join(INDEX),
        serde_json::to_string_pretty(&index)
            .unwrap_or_default()
            .as_bytes(),
    )
}
