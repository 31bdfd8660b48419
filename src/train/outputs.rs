//! A run's outputs: checked before step 1 (so nothing is found unusable after hours of
//! training), and the metrics log, whose failures are warnings and whose history survives
//! resumes.

use super::config::TrainConfig;
use crate::store::hf::{export_dir_state, ExportDir};
use crate::util::{free_space, human_bytes};
use crate::{Error, Result};
use std::io::Write;
use std::path::{Path, PathBuf};

fn shown(p: &Path) -> String {
    p.display().to_string()
}

/// The directory a new file `path` goes into, created if missing, and checked to accept files.
fn output_parent(key: &'static str, path: &Path) -> Result<PathBuf> {
    let parent = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."))
        .to_owned();
    std::fs::create_dir_all(&parent).map_err(|e| {
        Error::io("create directory", &parent, e)
            .with_fix(format!("choose another --{}", key.replace('_', "-")))
    })?;
    crate::util::check_writable_dir(&parent).map_err(|e| {
        Error::io("write into directory", &parent, e).with_fix(format!(
            "make it writable, or choose another --{}",
            key.replace('_', "-")
        ))
    })?;
    Ok(parent)
}

/// A file output (`metrics`, `trace`): not a directory, in a directory that accepts files.
fn check_file_output(key: &'static str, path: &Path) -> Result<()> {
    if path.is_dir() {
        return Err(Error::bad_input(
            "setting",
            key,
            format!("`{}` is a directory; it must name a file", shown(path)),
            Some(&format!(
                "pass a file path to --{}, e.g. {}",
                key.replace('_', "-"),
                path.join(if key == "trace" {
                    "trace.json"
                } else {
                    "metrics.jsonl"
                })
                .display()
            )),
        ));
    }
    output_parent(key, path).map(|_| ())
}

fn need_space(what: &str, dir: &Path, need: u64, fix: &str) -> Result<()> {
    let free = free_space(dir)?;
    if free < need {
        return Err(Error::bad_input(
            "disk space",
            shown(dir),
            format!(
                "{what} needs {} but the filesystem has {} free",
                human_bytes(need),
                human_bytes(free)
            ),
            Some(fix),
        ));
    }
    Ok(())
}

/// Check every output of `cfg` before training: the metrics and trace files, the HF export
/// directory (absent, empty, or an earlier export of this run `run_id`), and room for one
/// checkpoint (`checkpoint_bytes`) and for the export (`export_bytes`).
pub fn check(
    cfg: &TrainConfig,
    run_id: &str,
    checkpoint_bytes: u64,
    export_bytes: u64,
) -> Result<()> {
    if let Some(p) = &cfg.metrics {
        check_file_output("metrics", p)?;
    }
    if let Some(p) = &cfg.trace {
        check_file_output("trace", p)?;
    }
    if let Some(out) = &cfg.export_hf {
        match export_dir_state(out)? {
            ExportDir::Absent | ExportDir::Empty => {}
            ExportDir::Export { run_id: Some(id) } if id == run_id => {}
            ExportDir::Export { .. } | ExportDir::Other => {
                return Err(Error::bad_input(
                    "export directory",
                    shown(out),
                    "already holds files that are not an export of this run; exporting would mix with them",
                    Some("choose a new or empty --export-hf directory, or remove the old one"),
                ));
            }
        }
        let parent = output_parent("export_hf", out)?;
        need_space(
            "the HF export",
            &parent,
            export_bytes,
            "free space there, or choose another --export-hf directory",
        )?;
    }
    if let Some(root) = &cfg.checkpoint_dir {
        need_space(
            "one checkpoint",
            root,
            checkpoint_bytes,
            "free space there, or choose another --checkpoint-dir",
        )?;
    }
    Ok(())
}

/// One JSON line per step in the metrics file. On resume it keeps every line up to the step
/// resumed from and drops the later ones (a run that died after its last checkpoint logged
/// steps that will run again). A failed write is a warning: training goes on.
#[derive(Debug)]
pub struct MetricsLog {
    path: PathBuf,
    file: std::fs::File,
    /// The last write failed part-way: start the next line on a fresh line.
    torn: bool,
    /// Writes that failed.
    pub failed_writes: u64,
    /// (step, loss) of every line, the kept history included.
    pub curve: Vec<(u64, f64)>,
    /// (step, validation loss).
    pub val_curve: Vec<(u64, f64)>,
}

impl MetricsLog {
    /// Open `path`: truncated for a fresh run, or its history kept up to `resume_step`. Returns
    /// notes worth telling the user.
    pub fn open(path: &Path, resume_step: Option<u64>) -> Result<(Self, Vec<String>)> {
        let mut notes = Vec::new();
        let (mut curve, mut val_curve) = (Vec::new(), Vec::new());
        let regular = std::fs::metadata(path).is_ok_and(|m| m.is_file());
        if let (Some(upto), true) = (resume_step, regular) {
            let text = std::fs::read(path).map_err(|e| Error::io("read metrics", path, e))?;
            let text = String::from_utf8_lossy(&text);
            let mut kept = String::new();
            let (mut dropped, mut garbled) = (0usize, 0usize);
            for line in text.lines().filter(|l| !l.trim().is_empty()) {
                let Ok(v) = serde_json::from_str::<serde_json::Value>(line) else {
                    garbled += 1;
                    continue;
                };
                let Some(step) = v["step"].as_u64() else {
                    garbled += 1;
                    continue;
                };
                if step > upto {
                    dropped += 1;
                    continue;
                }
                if let Some(l) = v["loss"].as_f64() {
                    curve.push((step, l));
                }
                if let Some(l) = v["val_loss"].as_f64() {
                    val_curve.push((step, l));
                }
                kept.push_str(line);
                kept.push('\n');
            }
            if dropped + garbled > 0 {
                notes.push(format!(
                    "metrics: kept {} line(s) up to step {upto} and dropped {dropped} line(s) of later steps (they run again){}",
                    curve.len(),
                    if garbled > 0 {
                        format!(" and {garbled} unreadable line(s)")
                    } else {
                        String::new()
                    }
                ));
                crate::util::write_atomic(path, kept.as_bytes())?;
            }
        }
        let file = std::fs::OpenOptions::new()
            .create(true)
            .append(resume_step.is_some())
            .write(true)
            .truncate(resume_step.is_none())
            .open(path)
            .map_err(|e| Error::io("open metrics", path, e))?;
        Ok((
            MetricsLog {
                path: path.to_owned(),
                file,
                torn: false,
                failed_writes: 0,
                curve,
                val_curve,
            },
            notes,
        ))
    }

    /// The file.
    pub fn path(&self) -> &Path {
        &self.path
    }

    /// Append one step's line. `Some(warning)` on the first failure (later ones are counted).
    pub fn append(
        &mut self,
        step: u64,
        loss: f64,
        val: Option<f64>,
        line: &serde_json::Value,
    ) -> Option<String> {
        self.curve.push((step, loss));
        if let Some(v) = val {
            self.val_curve.push((step, v));
        }
        let mut text = String::new();
        if self.torn {
            text.push('\n');
        }
        text.push_str(&line.to_string());
        text.push('\n');
        // One write of the whole line (no buffering): a failure leaves at most one torn line,
        // which the next line starts after and a resume drops.
        match self.file.write_all(text.as_bytes()) {
            Ok(()) => {
                self.torn = false;
                None
            }
            Err(e) => {
                self.torn = true;
                self.failed_writes += 1;
                (self.failed_writes == 1).then(|| {
                    format!(
                        "warning: writing metrics to {} failed ({e}); training goes on, later failures are counted",
                        self.path.display()
                    )
                })
            }
        }
    }
}
