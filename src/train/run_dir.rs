//! A run owns its checkpoint directory: an exclusive lock for the run's life (a second run on the
//! same directory is refused at once, naming the holder), and the resume rules — `--resume`
//! needs a checkpoint to continue (and `--steps` not below its step), a fresh run needs a
//! directory without one, `--resume auto` takes whichever is there.

use super::checkpoint::{self, TrainState};
use super::config::{Resume, TrainConfig};
use crate::util::lock::DirLock;
use crate::{Error, Result};
use std::path::{Path, PathBuf};

/// The checkpoint directory a run holds, and where it resumes from.
#[derive(Debug)]
pub struct RunDir {
    /// The directory.
    pub root: PathBuf,
    _lock: DirLock,
    /// The verified checkpoint to continue from, with its state.
    pub resume_from: Option<(PathBuf, TrainState)>,
}

fn shown(p: &Path) -> String {
    p.display().to_string()
}

/// Claim `cfg.checkpoint_dir` (if any) for this run and decide where it starts.
pub fn claim(cfg: &TrainConfig) -> Result<Option<RunDir>> {
    let Some(root) = &cfg.checkpoint_dir else {
        return Ok(None);
    };
    if root.exists() && !root.is_dir() {
        return Err(Error::bad_input(
            "checkpoint directory",
            shown(root),
            "exists and is not a directory",
            Some("pass a directory to --checkpoint-dir"),
        ));
    }
    if cfg.resume == Resume::Always && !root.is_dir() {
        return Err(Error::bad_input(
            "checkpoint directory",
            shown(root),
            "does not exist, so there is nothing to resume",
            Some("check the path (a typo?), or pass `--resume auto` to start fresh when there is no checkpoint yet"),
        ));
    }
    std::fs::create_dir_all(root).map_err(|e| Error::io("create checkpoint directory", root, e))?;
    crate::util::check_writable_dir(root).map_err(|e| {
        Error::io("write into checkpoint directory", root, e)
            .with_fix("make it writable, or choose another --checkpoint-dir")
    })?;
    let lock = DirLock::acquire(
        root,
        "checkpoint directory",
        "wait for that run to finish, or give this run another --checkpoint-dir",
    )?;
    // Unfinished and half-pruned checkpoints of runs that died here.
    checkpoint::remove_leftovers(root, None);
    let existing = checkpoint::list(root)?;
    let resume_from = match cfg.resume {
        Resume::Never => {
            if let Some((step, _)) = existing.iter().max() {
                return Err(Error::bad_input(
                    "checkpoint directory",
                    shown(root),
                    format!(
                        "already holds {} checkpoint(s) of an earlier run (up to step {step}); a fresh run would mix with them",
                        existing.len()
                    ),
                    Some("continue that run with --resume, or give this run another --checkpoint-dir (or remove the old checkpoints)"),
                ));
            }
            None
        }
        Resume::Always if existing.is_empty() => {
            return Err(Error::bad_input(
                "checkpoint directory",
                shown(root),
                "holds no checkpoint to resume from",
                Some("check the path (a typo?), or pass `--resume auto` to start fresh when there is no checkpoint yet"),
            ));
        }
        Resume::Always | Resume::Auto => match checkpoint::latest(root)? {
            Some(dir) => {
                let state = checkpoint::open(&dir)?;
                Some((dir, state))
            }
            None => None,
        },
    };
    if let Some((dir, st)) = resume_from.as_ref().filter(|(_, st)| cfg.steps < st.step) {
        return Err(Error::bad_input(
            "--steps",
            cfg.steps.to_string(),
            format!(
                "is below the step of the checkpoint resumed, {} ({}): the run is already past it",
                st.step,
                dir.display()
            ),
            Some(&format!(
                "pass --steps above {} to train further, or export that checkpoint (`megatrain export --checkpoint {}`)",
                st.step,
                dir.display()
            )),
        ));
    }
    Ok(Some(RunDir {
        root: root.clone(),
        _lock: lock,
        resume_from,
    }))
}

/// The settings that differ between the checkpoint's configuration and this run's, as
/// (key, from, to) with JSON-text values. Settings that only say how to start (`resume`) are
/// not compared, nor are the ones chosen automatically when unset (`mode`, `activations`)
/// unless this run sets them.
pub fn changed_settings(before: &TrainConfig, now: &TrainConfig) -> Vec<(String, String, String)> {
    let (Ok(a), Ok(b)) = (serde_json::to_value(before), serde_json::to_value(now)) else {
        return Vec::new();
    };
    let (Some(a), Some(b)) = (a.as_object(), b.as_object()) else {
        return Vec::new();
    };
    b.iter()
        .filter(|(k, v)| {
            k.as_str() != "resume"
                && !(matches!(k.as_str(), "mode" | "activations" | "adam_state") && v.is_null())
        })
        .filter_map(|(k, vb)| {
            let va = a.get(k).cloned().unwrap_or(serde_json::Value::Null);
            (va != *vb).then(|| (k.clone(), show(&va), show(vb)))
        })
        .collect()
}

fn show(v: &serde_json::Value) -> String {
    match v {
        serde_json::Value::Null => "-".into(),
        serde_json::Value::String(s) => s.clone(),
        other => other.to_string(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn changes_are_listed_by_key_and_resume_is_not_one() {
        let a = TrainConfig::default();
        let b = TrainConfig {
            lr: 1e-4,
            batch_size: 4,
            resume: Resume::Always,
            ..a.clone()
        };
        let c = changed_settings(&a, &b);
        assert_eq!(
            c,
            vec![
                ("batch_size".into(), "8".into(), "4".into()),
                ("lr".into(), "0.0003".into(), "0.0001".into())
            ]
        );
    }
}
