//! Training checkpoints: fp32 params and Adam m/v of every unit, the step, the data cursor and the
//! configuration. Written into a temporary directory, every file fsynced and checksummed (crc32c)
//! in a manifest written last, then renamed into place; the last K are kept. A checkpoint whose
//! manifest is missing or whose files do not match it is never loaded.

use super::config::TrainConfig;
use super::data::Cursor;
use crate::model::config::ModelConfig;
use crate::store::layout::ShardKind;
use crate::store::HostStore;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::io::{Read, Write};
use std::path::{Path, PathBuf};

/// Checkpoint format version.
pub const FORMAT: u32 = 1;
const MANIFEST: &str = "MANIFEST.json";
const FILES: [(&str, ShardKind); 3] = [
    ("params.f32", ShardKind::Params),
    ("adam_m.f32", ShardKind::AdamM),
    ("adam_v.f32", ShardKind::AdamV),
];

/// Everything besides the tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Format version.
    pub format: u32,
    /// Optimizer steps done.
    pub step: u64,
    /// Data position after `step`.
    pub cursor: Cursor,
    /// Last global gradient norm (lean clipping uses it).
    pub prev_norm: Option<f64>,
    /// The model.
    pub model: ModelConfig,
    /// The run's configuration.
    pub config: TrainConfig,
}

#[derive(Debug, Serialize, Deserialize)]
struct Manifest {
    format: u32,
    files: Vec<(String, u64, u32)>,
}

fn dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

fn fsync_dir(d: &Path) {
    if let Ok(f) = std::fs::File::open(d) {
        let _ = f.sync_all();
    }
}

/// Write a checkpoint of `store` and `state` under `root`; keep the newest `keep`.
pub fn save(root: &Path, store: &HostStore, state: &TrainState, keep: usize) -> Result<PathBuf> {
    std::fs::create_dir_all(root).map_err(|e| Error::io("create checkpoint directory", root, e))?;
    let final_dir = root.join(dir_name(state.step));
    let tmp = root.join(format!(
        ".{}.tmp-{}",
        dir_name(state.step),
        std::process::id()
    ));
    let _ = std::fs::remove_dir_all(&tmp);
    let result = (|| -> Result<()> {
        std::fs::create_dir(&tmp).map_err(|e| Error::io("create", &tmp, e))?;
        // One pass over the units, all three files at once: a spilled unit's m/v are staged
        // (read from NVMe) once, not once per file.
        struct Out {
            path: PathBuf,
            w: std::io::BufWriter<std::fs::File>,
            crc: u32,
            size: u64,
        }
        let mut outs = Vec::new();
        for (name, _) in FILES {
            let path = tmp.join(name);
            let f = std::fs::File::create(&path).map_err(|e| Error::io("create", &path, e))?;
            outs.push(Out {
                path,
                w: std::io::BufWriter::with_capacity(1 << 20, f),
                crc: 0,
                size: 0,
            });
        }
        for u in 0..store.num_units() {
            let mut g = store.take(u)?;
            g.stage()?; // optimizer state on NVMe: read it in (no-op in RAM)
            for (o, (_, kind)) in outs.iter_mut().zip(FILES) {
                let data: &[f32] = match kind {
                    ShardKind::Params => g.params(),
                    ShardKind::AdamM => g.shards()?.m,
                    _ => g.shards()?.v,
                };
                // SAFETY: f32 → bytes view of the same memory (no padding, any bit pattern valid);
                // the file is little-endian like the host (see hf.rs's guard).
                let bytes = unsafe {
                    std::slice::from_raw_parts(data.as_ptr().cast::<u8>(), data.len() * 4)
                };
                o.crc = crc32c::crc32c_append(o.crc, bytes);
                o.size += bytes.len() as u64;
                o.w.write_all(bytes)
                    .map_err(|e| Error::io("write", &o.path, e))?;
            }
            g.unstage_clean();
        }
        let mut files = Vec::new();
        for (o, (name, _)) in outs.into_iter().zip(FILES) {
            let f =
                o.w.into_inner()
                    .map_err(|e| Error::io("write", &o.path, e.into_error()))?;
            f.sync_all().map_err(|e| Error::io("fsync", &o.path, e))?;
            files.push((name.to_owned(), o.size, o.crc));
        }
        let state_json = serde_json::to_vec_pretty(state)
            .map_err(|e| Error::system("serde_json", "checkpoint state", e))?;
        let sp = tmp.join("state.json");
        crate::util::write_atomic(&sp, &state_json)?;
        files.push((
            "state.json".into(),
            state_json.len() as u64,
            crc32c::crc32c(&state_json),
        ));
        let manifest = serde_json::to_vec_pretty(&Manifest {
            format: FORMAT,
            files,
        })
        .map_err(|e| Error::system("serde_json", "manifest", e))?;
        crate::util::write_atomic(&tmp.join(MANIFEST), &manifest)?;
        fsync_dir(&tmp);
        if final_dir.exists() {
            std::fs::remove_dir_all(&final_dir)
                .map_err(|e| Error::io("replace checkpoint", &final_dir, e))?;
        }
        std::fs::rename(&tmp, &final_dir)
            .map_err(|e| Error::io("rename checkpoint into place", &final_dir, e))?;
        fsync_dir(root);
        Ok(())
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result?;
    // Keep the newest `keep` checkpoints, and clean temporary directories of dead writers.
    let mut all = list(root)?;
    all.sort();
    while all.len() > keep.max(1) {
        let (_, d) = all.remove(0);
        let _ = std::fs::remove_dir_all(d);
    }
    if let Ok(rd) = std::fs::read_dir(root) {
        for e in rd.flatten() {
            let n = e.file_name().to_string_lossy().into_owned();
            if n.starts_with(".step-") && !n.ends_with(&format!("-{}", std::process::id())) {
                let _ = std::fs::remove_dir_all(e.path());
            }
        }
    }
    Ok(final_dir)
}

/// Finished checkpoint directories under `root`, as (step, path).
fn list(root: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let rd = match std::fs::read_dir(root) {
        Ok(r) => r,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("list checkpoints", root, e)),
    };
    Ok(rd
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            let step = n.strip_prefix("step-")?.parse::<u64>().ok()?;
            Some((step, e.path()))
        })
        .collect())
}

/// Check a checkpoint's files against its manifest. `Err(reason)` if it must not be loaded.
pub fn verify(dir: &Path) -> std::result::Result<(), String> {
    let text = std::fs::read(dir.join(MANIFEST))
        .map_err(|_| "no MANIFEST.json (the write did not finish)".to_owned())?;
    let m: Manifest =
        serde_json::from_slice(&text).map_err(|e| format!("MANIFEST.json unreadable: {e}"))?;
    if m.format != FORMAT {
        return Err(format!(
            "format {} (this megatrain reads {FORMAT})",
            m.format
        ));
    }
    for (name, size, crc) in &m.files {
        let p = dir.join(name);
        let mut f = std::fs::File::open(&p).map_err(|e| format!("{name}: {e}"))?;
        let mut buf = vec![0u8; 1 << 20];
        let (mut c, mut n) = (0u32, 0u64);
        loop {
            let k = f.read(&mut buf).map_err(|e| format!("{name}: {e}"))?;
            if k == 0 {
                break;
            }
            c = crc32c::crc32c_append(c, &buf[..k]);
            n += k as u64;
        }
        if n != *size {
            return Err(format!("{name} has {n} bytes, the manifest says {size}"));
        }
        if c != *crc {
            return Err(format!("{name} fails its crc32c check"));
        }
    }
    Ok(())
}

/// The newest checkpoint under `root`, verified. `Ok(None)` if there is none; an error naming
/// the newest good one if the newest is damaged.
pub fn latest(root: &Path) -> Result<Option<PathBuf>> {
    let mut all = list(root)?;
    all.sort();
    let Some((_, newest)) = all.last().cloned() else {
        return Ok(None);
    };
    match verify(&newest) {
        Ok(()) => Ok(Some(newest)),
        Err(why) => {
            let good = all
                .iter()
                .rev()
                .skip(1)
                .find(|(_, d)| verify(d).is_ok())
                .map(|(_, d)| d.clone());
            let fix = match &good {
                Some(g) => format!("the newest good checkpoint is {}: move the damaged one aside to resume from it", g.display()),
                None => "no good checkpoint remains; start without --resume".to_owned(),
            };
            Err(Error::bad_input(
                "checkpoint",
                newest.display().to_string(),
                format!("is damaged: {why}"),
                Some(&fix),
            ))
        }
    }
}

/// A checkpoint's `state.json` (step, cursor, model and run configuration), without the tensors.
pub fn read_state(dir: &Path) -> Result<TrainState> {
    let path = dir.join("state.json");
    let bytes = std::fs::read(&path).map_err(|e| Error::io("read", &path, e))?;
    serde_json::from_slice(&bytes).map_err(|e| {
        Error::bad_input(
            "checkpoint",
            dir.display().to_string(),
            format!("state.json: {e}"),
            None,
        )
    })
}

/// Load a verified checkpoint into `store`; returns its state.
pub fn load(dir: &Path, store: &HostStore) -> Result<TrainState> {
    verify(dir).map_err(|why| {
        Error::bad_input(
            "checkpoint",
            dir.display().to_string(),
            format!("is damaged: {why}"),
            None,
        )
    })?;
    let state = read_state(dir)?;
    if state.model != store.layout().config {
        return Err(Error::bad_input(
            "checkpoint",
            dir.display().to_string(),
            "was written for a different model configuration",
            Some("resume with the checkpoint's own model settings"),
        ));
    }
    // One pass over the units with the three files open: a spilled unit is staged and written
    // back once.
    let mut readers = Vec::new();
    for (name, _) in FILES {
        let path = dir.join(name);
        let f = std::fs::File::open(&path).map_err(|e| Error::io("open", &path, e))?;
        readers.push((path, std::io::BufReader::with_capacity(1 << 20, f)));
    }
    for u in 0..store.num_units() {
        let mut g = store.take(u)?;
        g.stage()?;
        for ((path, f), (_, kind)) in readers.iter_mut().zip(FILES) {
            let data: &mut [f32] = match kind {
                ShardKind::Params => g.params(),
                ShardKind::AdamM => g.shards()?.m,
                _ => g.shards()?.v,
            };
            // SAFETY: byte view of an f32 slice (any bytes form valid f32s).
            let bytes = unsafe {
                std::slice::from_raw_parts_mut(data.as_mut_ptr().cast::<u8>(), data.len() * 4)
            };
            f.read_exact(bytes)
                .map_err(|e| Error::io("read", path.as_path(), e))?;
        }
        g.unstage(); // written back to NVMe if spilled
    }
    Ok(state)
}
