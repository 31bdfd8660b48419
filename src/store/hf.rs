//! Hugging Face checkpoints in and out: safetensors (one file, or shards with
//! `model.safetensors.index.json`) into the layer-major host store, and the store back out as
//! `config.json` + sharded fp32 safetensors + index, which `transformers` loads unchanged.
//!
//! Files are memory-mapped; each tensor is copied once, straight into its unit's params shard
//! (bf16/fp16 checkpoints are widened to fp32 on the way). No whole-model copy is made.

use super::layout::StateLayout;
use super::mxfp4;
use super::{HostStore, UnitGuard};
use crate::model::config::{Architecture, ModelConfig};
use crate::model::units::{stored_tensors, StoredTensor};
use crate::util::progress::{Meter, Unit};
use crate::{Error, Result};
use safetensors::{Dtype, SafeTensors};
use std::borrow::Cow;
use std::collections::{BTreeMap, HashMap};
use std::path::{Path, PathBuf};

#[cfg(not(target_endian = "little"))]
compile_error!("safetensors I/O here assumes a little-endian host");

/// Index file name of sharded checkpoints.
pub const INDEX: &str = "model.safetensors.index.json";
/// Single-file checkpoint name.
pub const SINGLE: &str = "model.safetensors";

/// The safetensors files of a checkpoint directory (or a single file path).
pub fn checkpoint_files(path: &Path) -> Result<Vec<PathBuf>> {
    if path.is_file() {
        return Ok(vec![path.to_owned()]);
    }
    if !path.is_dir() {
        return Err(Error::io(
            "open checkpoint",
            path,
            std::io::Error::new(std::io::ErrorKind::NotFound, "no such file or directory"),
        ));
    }
    let index = path.join(INDEX);
    if index.is_file() {
        let text = std::fs::read_to_string(&index).map_err(|e| Error::io("read", &index, e))?;
        let v: serde_json::Value = serde_json::from_str(&text).map_err(|e| {
            Error::bad_input(
                "checkpoint index",
                index.display().to_string(),
                format!("not valid JSON: {e}"),
                None,
            )
        })?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| {
                Error::bad_input(
                    "checkpoint index",
                    index.display().to_string(),
                    "has no `weight_map` object",
                    None,
                )
            })?;
        let mut files: Vec<String> = map
            .values()
            .filter_map(|f| f.as_str().map(str::to_owned))
            .collect();
        files.sort();
        files.dedup();
        let files: Vec<PathBuf> = files.iter().map(|f| path.join(f)).collect();
        if let Some(missing) = files.iter().find(|f| !f.is_file()) {
            return Err(Error::bad_input(
                "checkpoint",
                path.display().to_string(),
                format!(
                    "the index names shard `{}`, which is missing",
                    missing.display()
                ),
                Some("download or copy the complete checkpoint"),
            ));
        }
        return Ok(files);
    }
    let single = path.join(SINGLE);
    if single.is_file() {
        return Ok(vec![single]);
    }
    Err(Error::bad_input(
        "checkpoint",
        path.display().to_string(),
        format!("contains neither {SINGLE} nor {INDEX}"),
        Some("point at a Hugging Face model directory (config.json + safetensors)"),
    ))
}

/// Read `config.json` of a checkpoint directory.
pub fn load_config(dir: &Path) -> Result<ModelConfig> {
    ModelConfig::from_file(&dir.join("config.json"))
}

/// Widen `bytes` of `dtype` into `out`; `Err` carries a dtype that is not F32, BF16 or F16.
fn widen(dtype: Dtype, bytes: &[u8], out: &mut [f32]) -> std::result::Result<(), Dtype> {
    match dtype {
        Dtype::F32 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(4)) {
                *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
            }
        }
        Dtype::BF16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes([c[0], c[1]])) << 16);
            }
        }
        Dtype::F16 => {
            for (o, c) in out.iter_mut().zip(bytes.chunks_exact(2)) {
                *o = f16_to_f32(u16::from_le_bytes([c[0], c[1]]));
            }
        }
        other => return Err(other),
    }
    Ok(())
}

/// Elements widened per task by [`widen_par`] (4 MiB of fp32).
const WIDEN_CHUNK: usize = 1 << 20;

/// [`widen`] in pieces on the rayon pool: a mapped tensor's pages fault in from the file, and
/// are converted, on every core instead of one (the widening off the read's critical path).
fn widen_par(dtype: Dtype, bytes: &[u8], out: &mut [f32]) -> std::result::Result<(), Dtype> {
    use rayon::prelude::*;
    let elem = match dtype {
        Dtype::F32 => 4,
        Dtype::BF16 | Dtype::F16 => 2,
        other => return Err(other),
    };
    out.par_chunks_mut(WIDEN_CHUNK)
        .zip(bytes.par_chunks(WIDEN_CHUNK * elem))
        .try_for_each(|(o, b)| widen(dtype, b, o))
}

fn f16_to_f32(h: u16) -> f32 {
    let sign = u32::from(h >> 15) << 31;
    let exp = u32::from((h >> 10) & 0x1f);
    let man = u32::from(h & 0x3ff);
    let bits = match (exp, man) {
        (0, 0) => sign,
        (0, m) => {
            // Subnormal: normalize.
            let mut e = 127 - 15 + 1;
            let mut m = m;
            while m & 0x400 == 0 {
                m <<= 1;
                e -= 1;
            }
            sign | (e << 23) | ((m & 0x3ff) << 13)
        }
        (0x1f, m) => sign | 0x7f80_0000 | (m << 13),
        (e, m) => sign | ((e + 127 - 15) << 23) | (m << 13),
    };
    f32::from_bits(bits)
}

/// What a load did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct LoadReport {
    /// Files read.
    pub files: usize,
    /// Tensors loaded.
    pub tensors: usize,
    /// Tensors skipped on purpose (RoPE buffers, a tied `lm_head.weight`, a multimodal
    /// checkpoint's vision tower).
    pub skipped: Vec<String>,
}

/// The name a checkpoint's tensor has in the text model megatrain trains: itself, or for a
/// Gemma 3 multimodal checkpoint (`Gemma3ForConditionalGeneration`) the language model's tensor
/// under its causal-LM name (transformers 5's `model.language_model.*`, earlier releases'
/// `language_model.model.*` and `language_model.lm_head.*`); `None` for its vision tower and
/// projector, which are not trained (and not exported).
fn text_model_name<'a>(name: &'a str, cfg: &ModelConfig) -> Option<Cow<'a, str>> {
    if cfg.architecture != Architecture::Gemma3 {
        return Some(Cow::Borrowed(name));
    }
    for (from, to) in [
        ("model.language_model.", "model."),
        ("language_model.model.", "model."),
        ("language_model.lm_head.", "lm_head."),
    ] {
        if let Some(rest) = name.strip_prefix(from) {
            return Some(Cow::Owned(format!("{to}{rest}")));
        }
    }
    let vision = [
        "model.vision_tower.",
        "vision_tower.",
        "model.multi_modal_projector.",
        "multi_modal_projector.",
    ];
    if vision.iter().any(|p| name.starts_with(p)) {
        return None;
    }
    Some(Cow::Borrowed(name))
}

/// The error for a checkpoint tensor the model has no parameter for.
fn not_ours(name: &str, shown: &str, layout: &StateLayout) -> Error {
    Error::bad_input(
        "checkpoint tensor",
        name,
        format!(
            "in {shown} is not a parameter of this model ({} layers, config.json)",
            layout.config.num_layers
        ),
        Some("check that config.json belongs to these weights"),
    )
}

/// `file` mapped read-only.
fn map_file(file: &Path) -> Result<memmap2::Mmap> {
    let f = std::fs::File::open(file).map_err(|e| Error::io("open", file, e))?;
    // SAFETY: the mapping is read-only and private to the loader; a concurrent writer to the
    // checkpoint file would change what we read but cannot break memory safety of the byte
    // slices we copy from (they stay mapped while the map lives).
    unsafe { memmap2::Mmap::map(&f) }.map_err(|e| Error::io("mmap", file, e))
}

/// Drop `bytes` — a tensor of `map`, copied into the store — from the process's resident set
/// (the file's pages stay in the page cache): loading a checkpoint holds the state plus about
/// one tensor of it, not the whole mapped file. Best effort: a refusal only keeps the pages.
fn release(map: &memmap2::Mmap, bytes: &[u8]) {
    let Some(offset) = (bytes.as_ptr() as usize).checked_sub(map.as_ptr() as usize) else {
        return;
    };
    if offset + bytes.len() > map.len() {
        return;
    }
    // SAFETY: the map is a read-only private file mapping no one writes through: after
    // MADV_DONTNEED its pages fault back in from the file with the same bytes, so every slice
    // borrowed from it (the header, tensors not read yet) stays valid.
    let _ = unsafe {
        map.unchecked_advise_range(memmap2::UncheckedAdvice::DontNeed, offset, bytes.len())
    };
}

/// Start reading `bytes` of `map` from the file (`MADV_WILLNEED`: asynchronous readahead of
/// the whole range). Best effort: a refusal only leaves the pages to fault in.
fn prefetch(map: &memmap2::Mmap, bytes: &[u8]) {
    let Some(offset) = (bytes.as_ptr() as usize).checked_sub(map.as_ptr() as usize) else {
        return;
    };
    if offset + bytes.len() <= map.len() {
        let _ = map.advise_range(memmap2::Advice::WillNeed, offset, bytes.len());
    }
}

/// The safetensors file in `map` (read from `file`).
fn safetensors_of<'a>(map: &'a memmap2::Mmap, file: &Path) -> Result<SafeTensors<'a>> {
    SafeTensors::deserialize(map).map_err(|e| {
        Error::bad_input(
            "safetensors file",
            file.display().to_string(),
            format!("corrupt or truncated: {e}"),
            Some("re-download or re-export the checkpoint"),
        )
    })
}

/// Load an HF checkpoint into `store`'s params shards. Every parameter of the layout must be
/// present with the right shape; unknown tensors are errors (a checkpoint for another config).
pub fn load_into_store(path: &Path, store: &HostStore) -> Result<LoadReport> {
    let layout = store.layout();
    let files = checkpoint_files(path)?;
    let mut guards: Vec<UnitGuard> = (0..store.num_units())
        .map(|u| store.take(u))
        .collect::<Result<_>>()?;
    // Every name a checkpoint may hold a parameter under: the layout's own, and the
    // per-expert pieces of fused expert tensors.
    let mut names: HashMap<String, StoredTensor> = HashMap::new();
    for unit in &layout.units {
        for t in &unit.tensors {
            names.insert(t.name.clone(), StoredTensor::whole(t));
        }
        for piece in stored_tensors(&layout.config, unit) {
            names.insert(piece.name.clone(), piece);
        }
    }
    let mut seen: BTreeMap<String, PathBuf> = BTreeMap::new();
    let mut covered: HashMap<String, usize> = HashMap::new();
    let mut skipped = Vec::new();
    // MXFP4 experts (GPT-OSS's releases): where each `_scales` tensor is.
    let mut scales_in: HashMap<String, PathBuf> = HashMap::new();
    for file in &files {
        let map = map_file(file)?;
        for name in safetensors_of(&map, file)?.names() {
            if name.ends_with("_scales") {
                scales_in.insert(name.to_string(), file.clone());
            }
        }
    }
    let total = files
        .iter()
        .map(|f| std::fs::metadata(f).map_or(0, |m| m.len()))
        .sum();
    let meter = Meter::start("model load", total, Unit::Bytes);
    for file in &files {
        let shown = file.display().to_string();
        let map = map_file(file)?;
        let st = safetensors_of(&map, file)?;
        // Front to back through the file (the header's order is a hash map's), each tensor's
        // pages asked for at once before it is copied: the disk reads ahead in large requests
        // instead of faulting the mapping in page by page.
        let mut in_order: Vec<_> = st.iter().collect();
        in_order.sort_by_key(|(_, v)| v.data().as_ptr() as usize);
        if let Some((_, first)) = in_order.first() {
            prefetch(&map, first.data());
        }
        for (i, (stored_name, view)) in in_order.iter().enumerate() {
            let (stored_name, view) = (*stored_name, view);
            if let Some((_, next)) = in_order.get(i + 1) {
                prefetch(&map, next.data());
            }
            meter.add(view.data().len() as u64);
            let Some(name) = text_model_name(stored_name, &layout.config) else {
                skipped.push(stored_name.to_owned());
                continue;
            };
            let name = name.as_ref();
            if let Some(base) = name.strip_suffix("_blocks") {
                let scales_name = stored_name.replace("_blocks", "_scales");
                let Some(scales_file) = scales_in.get(&scales_name) else {
                    return Err(Error::bad_input(
                        "MXFP4 checkpoint tensor",
                        name,
                        format!("in {shown} has no `{scales_name}` beside it"),
                        Some("the checkpoint is incomplete: re-download it"),
                    ));
                };
                let scales_map = map_file(scales_file)?;
                let scales_st = safetensors_of(&scales_map, scales_file)?;
                let scales = scales_st.tensor(&scales_name).map_err(|e| {
                    Error::bad_input("MXFP4 checkpoint tensor", &scales_name, e.to_string(), None)
                })?;
                let stored = names
                    .get(base)
                    .ok_or_else(|| not_ours(base, &shown, layout))?;
                let (unit, spec) = layout.tensor(&stored.tensor)?;
                if view.dtype() != Dtype::U8 || scales.dtype() != Dtype::U8 {
                    return Err(Error::bad_input(
                        "MXFP4 checkpoint tensor",
                        name,
                        format!(
                            "in {shown}: blocks and scales must be U8, found {:?} and {:?}",
                            view.dtype(),
                            scales.dtype()
                        ),
                        None,
                    ));
                }
                mxfp4::check_shapes(name, view.shape(), scales.shape(), &stored.shape)?;
                let (experts, out_rows, groups) =
                    (view.shape()[0], view.shape()[1], view.shape()[2]);
                let per_expert = stored.numel() / experts.max(1);
                // ZeRO stage 3: another rank's unit is loaded by that rank.
                let experts = if layout.holds_params(unit) {
                    experts
                } else {
                    0
                };
                let mut master = guards[unit].master();
                for e in 0..experts {
                    let w = mxfp4::dequantize_expert(
                        name,
                        view.data(),
                        scales.data(),
                        (out_rows, groups),
                        e,
                    )?;
                    master.write(spec.offset + stored.offset + e * per_expert, &w);
                }
                *covered.entry(stored.tensor.clone()).or_default() += stored.numel();
                seen.insert(base.to_owned(), file.clone());
                continue;
            }
            if name.ends_with("_scales") && !names.contains_key(name) {
                // Read with its `_blocks`.
                continue;
            }
            if name.ends_with("rotary_emb.inv_freq")
                || (name == "lm_head.weight" && layout.config.tie_word_embeddings)
            {
                skipped.push(stored_name.to_owned());
                continue;
            }
            let stored = names
                .get(name)
                .ok_or_else(|| not_ours(name, &shown, layout))?;
            let (unit, spec) = layout.tensor(&stored.tensor)?;
            if view.shape() != stored.shape.as_slice() {
                return Err(Error::bad_input(
                    "checkpoint tensor",
                    name,
                    format!(
                        "in {shown} has shape {:?}, the model needs {:?}",
                        view.shape(),
                        stored.shape
                    ),
                    Some("check that config.json belongs to these weights"),
                ));
            }
            *covered.entry(stored.tensor.clone()).or_default() += stored.numel();
            if let Some(prev) = seen.insert(name.to_owned(), file.clone()) {
                return Err(Error::bad_input(
                    "checkpoint tensor",
                    name,
                    format!("appears in both {} and {shown}", prev.display()),
                    None,
                ));
            }
            let unsupported = |dtype: Dtype| {
                Error::bad_input(
                    "checkpoint tensor",
                    name,
                    format!("in {shown}: dtype {dtype:?} is not supported (F32, BF16 or F16)"),
                    None,
                )
            };
            if !layout.holds_params(unit) {
                // ZeRO stage 3: another rank's unit, loaded (and checked) by that rank.
                continue;
            }
            let mut master = guards[unit].master();
            let start = spec.offset + stored.offset;
            let range = start..start + stored.numel();
            // Weights that are not finite would train to a NaN loss; named here instead.
            let check = |values: &[f32]| {
                use rayon::prelude::*;
                if values.par_iter().all(|x| x.is_finite()) {
                    return Ok(());
                }
                match values.iter().position(|x| !x.is_finite()) {
                None => Ok(()),
                Some(at) => Err(Error::bad_input(
                    "checkpoint tensor",
                    name,
                    format!(
                        "in {shown} holds {} non-finite value(s) (the first, {}, at flat index {at})",
                        values.iter().filter(|x| !x.is_finite()).count(),
                        values[at]
                    ),
                    Some("these weights are broken (a diverged run, or a bad conversion): use another checkpoint"),
                )),
            }
            };
            match master.as_fp32() {
                Some(p) => {
                    widen_par(view.dtype(), view.data(), &mut p[range.clone()])
                        .map_err(unsupported)?;
                    check(&p[range])?;
                }
                None => {
                    let mut values = vec![0f32; stored.numel()];
                    widen_par(view.dtype(), view.data(), &mut values).map_err(unsupported)?;
                    check(&values)?;
                    master.write(start, &values);
                }
            }
            release(&map, view.data());
        }
    }
    // Each parameter whole, once: from its own tensor or from every one of its pieces.
    for (name, loc) in &layout.manifest {
        let numel = layout.units[loc.unit].tensors[loc.index].numel();
        match covered.get(name).copied().unwrap_or(0) {
            n if n == numel => {}
            n if n > numel => {
                return Err(Error::bad_input(
                    "checkpoint",
                    path.display().to_string(),
                    format!("tensor `{name}` is stored both whole and as per-expert pieces"),
                    Some("keep one of the two copies"),
                ))
            }
            0 => {}
            _ => {
                return Err(Error::bad_input(
                    "checkpoint",
                    path.display().to_string(),
                    format!("tensor `{name}` is missing some of its experts' pieces"),
                    Some("check that config.json belongs to these weights and the checkpoint is complete"),
                ))
            }
        }
    }
    if let Some(missing) = layout
        .manifest
        .keys()
        .find(|k| !covered.contains_key(k.as_str()))
    {
        return Err(Error::bad_input(
            "checkpoint",
            path.display().to_string(),
            format!(
                "tensor `{missing}` is missing (searched {} file(s))",
                files.len()
            ),
            Some("check that config.json belongs to these weights and the checkpoint is complete"),
        ));
    }
    meter.finish();
    Ok(LoadReport {
        files: files.len(),
        tensors: seen.len(),
        skipped,
    })
}

mod export;

pub use export::{
    export, export_dir_state, export_store, ExportDir, ExportDtype, ExportOptions, ParamSource,
    EXPORT_MARKER, SERVING_FILES,
};

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn f16_widening() {
        assert_eq!(f16_to_f32(0x3c00), 1.0);
        assert_eq!(f16_to_f32(0xc000), -2.0);
        assert_eq!(f16_to_f32(0x0001), 2f32.powi(-24));
        assert!(f16_to_f32(0x7e00).is_nan());
        assert_eq!(f16_to_f32(0x7c00), f32::INFINITY);
    }
}
