//! A run's outputs: checked before step 1 (so nothing is found unusable after hours of
//! training), and the metrics log, whose failures are warnings and whose history survives
//! resumes.

use super::config::TrainConfig;
use crate::store::hf::{export_dir_state, ExportDir};
use crate::util::output::{target, Target};
use crate::util::paths::{check_disjoint, PathUse, Use};
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

/// The file outputs a run writes, and what a file of each kind holds when megatrain wrote it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum FileOutput {
    /// `--metrics`: JSON lines, each with a `step`.
    Metrics,
    /// The loss curve beside the metrics (`.svg`).
    LossCurve,
    /// `--trace`: a Chrome trace.
    Trace,
}

impl FileOutput {
    fn flag(self) -> &'static str {
        match self {
            FileOutput::Metrics => "--metrics",
            FileOutput::LossCurve => "--metrics (its loss curve, .svg)",
            FileOutput::Trace => "--trace",
        }
    }

    fn noun(self) -> &'static str {
        match self {
            FileOutput::Metrics => "metrics log",
            FileOutput::LossCurve => "loss curve",
            FileOutput::Trace => "trace",
        }
    }

    /// True when `head` (a file's first bytes, at most [`HEAD_BYTES`]) is what megatrain writes
    /// as this output.
    pub fn is_own(self, head: &[u8]) -> bool {
        let text = String::from_utf8_lossy(head);
        match self {
            FileOutput::Metrics => {
                let Some(first) = text.lines().find(|l| !l.trim().is_empty()) else {
                    return true;
                };
                // A first line longer than the head is no metrics line.
                head.contains(&b'\n')
                    && serde_json::from_str::<serde_json::Value>(first)
                        .is_ok_and(|v| v.get("step").is_some_and(serde_json::Value::is_u64))
            }
            FileOutput::LossCurve => {
                text.trim_start().starts_with("<svg")
                    && (text.contains(super::plot::OWN_MARK) || text.contains("megatrain: loss"))
            }
            FileOutput::Trace => {
                text.starts_with("{\"displayTimeUnit\":\"ms\",")
                    && (text.contains(&format!(
                        "\"writer\":\"{}\"",
                        crate::engine::trace::OWN_MARK
                    )) || text.starts_with(
                        "{\"displayTimeUnit\":\"ms\",\"traceEvents\":[{\"args\":{\"name\":",
                    ))
            }
        }
    }
}

/// Bytes of an existing output read to tell whether megatrain wrote it.
pub const HEAD_BYTES: usize = 64 << 10;

/// A file output: not a directory, in a directory that accepts files, and, where a file is
/// there already, one megatrain wrote as this output (a run never replaces anything else).
fn check_file_output(kind: FileOutput, path: &Path) -> Result<()> {
    let key = match kind {
        FileOutput::Trace => "trace",
        _ => "metrics",
    };
    if path.is_dir() {
        return Err(Error::bad_input(
            "setting",
            key,
            format!("`{}` is a directory; it must name a file", shown(path)),
            Some(&format!(
                "pass a file path to --{key}, e.g. {}",
                path.join(if key == "trace" {
                    "trace.json"
                } else {
                    "metrics.jsonl"
                })
                .display()
            )),
        ));
    }
    if crate::util::output::target(path)? == Target::Stream {
        return Ok(()); // a device, a FIFO, a descriptor: written in place, nothing to create
    }
    {
        if let Ok(f) = std::fs::File::open(path) {
            use std::io::Read;
            let mut head = Vec::with_capacity(HEAD_BYTES);
            f.take(HEAD_BYTES as u64)
                .read_to_end(&mut head)
                .map_err(|e| Error::io("read", path, e))?;
            if !head.is_empty() && !kind.is_own(&head) {
                return Err(Error::bad_input(
                    "output path",
                    shown(path),
                    format!(
                        "exists and is not a {} megatrain wrote ({}); a run never overwrites a file it did not write",
                        kind.noun(),
                        kind.flag()
                    ),
                    Some(&format!(
                        "give {} another path, or move the file away if it is no longer needed",
                        kind.flag()
                    )),
                ));
            }
        }
    }
    output_parent(key, path).map(|_| ())
}

/// The `--tensorboard` directory: a directory (created if missing) that accepts new files.
fn check_tensorboard_dir(dir: &Path) -> Result<()> {
    if dir.exists() && !dir.is_dir() {
        return Err(Error::bad_input(
            "setting",
            "tensorboard",
            format!("`{}` is a file; it must name a directory", shown(dir)),
            Some("pass a directory to --tensorboard, e.g. runs/NAME"),
        ));
    }
    std::fs::create_dir_all(dir).map_err(|e| {
        Error::io("create directory", dir, e).with_fix("choose another --tensorboard")
    })?;
    crate::util::check_writable_dir(dir).map_err(|e| {
        Error::io("write into directory", dir, e)
            .with_fix("make it writable, or choose another --tensorboard")
    })
}

/// The loss curve written beside the metrics file `metrics`; none when the metrics go to a
/// device, a FIFO or a descriptor (`/dev/stdout`), which have no "beside".
pub fn loss_curve_path(metrics: &Path) -> Option<PathBuf> {
    match target(metrics) {
        Ok(Target::Stream) => None,
        _ => Some(metrics.with_extension("svg")),
    }
}

/// Every path of `cfg`, as the flag that names it and how the run uses it.
pub fn path_uses(cfg: &TrainConfig) -> Vec<PathUse> {
    let mut uses = Vec::new();
    let add = |uses: &mut Vec<PathUse>, flag: &str, p: &Option<PathBuf>, used: Use| {
        if let Some(p) = p {
            uses.push(PathUse::new(flag, p, used));
        }
    };
    add(&mut uses, "--data", &cfg.data, Use::ReadFile);
    add(&mut uses, "--val-data", &cfg.val_data, Use::ReadFile);
    add(&mut uses, "--model", &cfg.model, Use::ReadFile);
    if let Some(dir) = &cfg.init_from {
        uses.extend(crate::util::paths::read_dir_uses("--init-from", dir, |n| {
            n == "config.json"
                || n.ends_with(".safetensors")
                || n.ends_with(".safetensors.index.json")
        }));
    }
    add(&mut uses, "--metrics", &cfg.metrics, Use::WriteFile);
    add(
        &mut uses,
        FileOutput::LossCurve.flag(),
        &cfg.metrics.as_deref().and_then(loss_curve_path),
        Use::WriteFile,
    );
    add(&mut uses, "--trace", &cfg.trace, Use::WriteFile);
    add(
        &mut uses,
        "--tensorboard",
        &cfg.tensorboard,
        Use::OwnedDir {
            owns: super::tensorboard::owns,
        },
    );
    add(
        &mut uses,
        "--checkpoint-dir",
        &cfg.checkpoint_dir,
        Use::OwnedDir {
            owns: super::checkpoint::owns,
        },
    );
    add(&mut uses, "--export-hf", &cfg.export_hf, Use::ReplacedDir);
    uses
}

/// Refuse, by name, an output of `cfg` that is an input or another output, or lies where one is
/// replaced or pruned; checked before anything is created.
pub fn check_paths(cfg: &TrainConfig) -> Result<()> {
    check_disjoint(&path_uses(cfg))
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
        check_file_output(FileOutput::Metrics, p)?;
        if let Some(svg) = loss_curve_path(p) {
            check_file_output(FileOutput::LossCurve, &svg)?;
        }
    }
    if let Some(p) = &cfg.trace {
        check_file_output(FileOutput::Trace, p)?;
    }
    if let Some(dir) = &cfg.tensorboard {
        check_tensorboard_dir(dir)?;
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
        let stream = target(path)? == Target::Stream;
        let regular = !stream && std::fs::metadata(path).is_ok_and(|m| m.is_file());
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
        let file = if stream {
            crate::util::output::open_stream(path)
        } else {
            std::fs::OpenOptions::new()
                .create(true)
                .append(resume_step.is_some())
                .write(true)
                .truncate(resume_step.is_none())
                .open(path)
        }
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
