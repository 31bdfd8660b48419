//! A checkpoint's fp32 params read tensor by tensor from its params file, without a host store
//! (an export needs neither the moments nor the rest of the model in memory).

use super::PARAMS_FILE;
use crate::store::hf::ParamSource;
use crate::store::layout::StateLayout;
use crate::{Error, Result};
use std::os::unix::fs::FileExt;
use std::path::{Path, PathBuf};

/// The params file of a checkpoint, each unit at its offset (units in order, fp32).
#[derive(Debug)]
pub struct CheckpointParams {
    file: std::fs::File,
    path: PathBuf,
    /// Per unit: its first byte and its elements.
    units: Vec<(u64, usize)>,
}

impl CheckpointParams {
    /// The params file of checkpoint `dir` (verified by [`super::open`]) for `layout`.
    pub fn open(dir: &Path, layout: &StateLayout) -> Result<Self> {
        let path = dir.join(PARAMS_FILE);
        let file = std::fs::File::open(&path).map_err(|e| Error::io("open", &path, e))?;
        let mut units = Vec::with_capacity(layout.units.len());
        let mut at = 0u64;
        for u in &layout.units {
            units.push((at, u.numel));
            at += 4 * u.numel as u64;
        }
        let len = file
            .metadata()
            .map_err(|e| Error::io("stat", &path, e))?
            .len();
        if len != at {
            return Err(Error::bad_input(
                "checkpoint",
                path.display().to_string(),
                format!("holds {len} bytes of params where the model has {at}"),
                Some("the checkpoint is damaged or of another model: use an earlier one"),
            ));
        }
        Ok(CheckpointParams { file, path, units })
    }
}

impl ParamSource for CheckpointParams {
    fn read(&mut self, u: usize, start: usize, dst: &mut [f32]) -> Result<()> {
        let &(at, _) = self
            .units
            .get(u)
            .filter(|&&(_, numel)| start + dst.len() <= numel)
            .ok_or_else(|| {
                Error::internal(
                    "checkpoint params",
                    format!("unit {u}, {} elements at {start}", dst.len()),
                )
            })?;
        // SAFETY: byte view of an f32 slice (any bytes form valid f32s).
        let bytes =
            unsafe { std::slice::from_raw_parts_mut(dst.as_mut_ptr().cast::<u8>(), dst.len() * 4) };
        self.file
            .read_exact_at(bytes, at + 4 * start as u64)
            .map_err(|e| Error::io("read", &self.path, e))
    }
}
