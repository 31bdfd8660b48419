//! The trainer: data, the streamed training loop, validation, checkpoints, metrics, exports.
//!
//! Library code: it reports progress through [`Progress`] and never prints; the CLI decides how
//! to show it.

pub mod chat;
pub mod chat_worker;
pub mod checkpoint;
pub mod config;
pub mod corpus;
pub mod data;
mod device_fit;
pub mod documents;
pub mod generate;
mod input_text;
pub mod outputs;
pub mod plot;
pub mod prepare;
mod ranks;
pub use ranks::join;
pub mod run_dir;
mod setup;
mod step_log;
pub mod table_input;
pub mod tensorboard;
pub mod tokenizer;

use crate::engine::{MicroBatch, StepMetrics, Streamer};
use crate::store::hf::ExportDtype;
use crate::{Error, Result};
use checkpoint::TrainState;
use config::TrainConfig;
use data::Loader;
use serde::Serialize;
use setup::{setup, Session};
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::Arc;

/// What the trainer tells its caller.
pub trait Progress {
    /// Training is about to start at `first_step` (> 1 when resumed) of `total`.
    fn start(&mut self, _first_step: u64, _total: u64, _params: usize) {}
    /// A step finished.
    fn step(&mut self, _m: &StepMetrics, _val_loss: Option<f64>) {}
    /// A checkpoint was written.
    fn checkpoint(&mut self, _dir: &std::path::Path) {}
    /// A one-line note (resumed from, exported to, ...).
    fn note(&mut self, _line: &str) {}
}

/// Where the run's outputs went.
#[derive(Debug, Clone, Default, Serialize)]
pub struct Summary {
    /// Steps done in total.
    pub steps: u64,
    /// First and last training loss of this run.
    pub first_loss: Option<f64>,
    /// Last training loss.
    pub last_loss: Option<f64>,
    /// Last validation loss.
    pub val_loss: Option<f64>,
    /// Mean tokens/s over this run's steps.
    pub tokens_per_s: f64,
    /// Newest checkpoint.
    pub checkpoint: Option<PathBuf>,
    /// HF export.
    pub export: Option<PathBuf>,
    /// Metrics file.
    pub metrics: Option<PathBuf>,
    /// TensorBoard directory (`tensorboard --logdir` it).
    pub tensorboard: Option<PathBuf>,
    /// Loss curve.
    pub plot: Option<PathBuf>,
    /// Chrome trace.
    pub trace: Option<PathBuf>,
    /// Stopped early by an interrupt.
    pub interrupted: bool,
    /// Metrics lines that could not be written (each failure was a warning).
    pub metrics_failures: u64,
    /// TensorBoard events that could not be written (each failure was a warning).
    pub tensorboard_failures: u64,
    /// What the run held in host memory at its end.
    pub host_memory: crate::engine::HostMemory,
    /// The process's peak resident set (`getrusage`), through every phase of the run.
    pub peak_rss: Option<u64>,
}

/// Validation loss (mean per trained token) over `batches` micro-batches of `loader`: each a
/// forward-only pass of the training device over the host store's current weights
/// ([`Streamer::evaluate`]: no copy of the model, in the run's precision and token chunks).
fn validate(streamer: &mut Streamer, loader: &mut Loader, batches: usize) -> Result<f64> {
    let (mut total, mut trained) = (0.0, 0usize);
    for _ in 0..batches.max(1) {
        let mb = loader.next_batch();
        total += streamer.evaluate(&mb)?;
        trained += mb.trained_tokens();
    }
    if trained == 0 {
        // Every packed row holds a document with a trained target.
        return Err(Error::internal(
            "validation",
            "no trained token in the validation batches",
        ));
    }
    Ok(total / trained as f64)
}

/// Why the loop stopped early.
enum Stop {
    /// A step failed: the state may be mid-update, the last checkpoint is what survives.
    Step(Error),
    /// Something after a completed step failed (checkpoint write, validation): the state is
    /// whole and is saved before the error is reported.
    AfterStep(Error),
}

/// Run training as `cfg` says. `interrupt` is polled after every step: when set, the trainer
/// finishes the step, writes a checkpoint (with a checkpoint directory) and returns.
///
/// Every input and output is checked before step 1; a failure after training has progressed
/// saves the trained state first and names where (`Error::StateSaved`).
pub fn run(
    cfg: &TrainConfig,
    interrupt: Arc<AtomicBool>,
    progress: &mut dyn Progress,
) -> Result<Summary> {
    run_in(cfg, crate::dist::solo(), interrupt, progress)
}

/// [`run`] as rank `world.rank()` of a data-parallel job (every rank runs this with the same
/// configuration). Each step's micro-batches are the job's: `grad_accum × world.size()` drawn in
/// order, rank r training the r-th `grad_accum` of them, their gradients summed across ranks in
/// rank order before the update (every rank's, or with `--zero-stage 1` the unit's owner's) — so N ranks equal one process accumulating N
/// times as many micro-batches. Rank 0 writes every output (checkpoints, metrics, validation,
/// samples, the export); the others write nothing and resume from rank 0's checkpoint.
pub fn run_in(
    cfg: &TrainConfig,
    world: Arc<dyn crate::dist::Collective>,
    interrupt: Arc<AtomicBool>,
    progress: &mut dyn Progress,
) -> Result<Summary> {
    let mut s = setup(cfg, world, progress)?;
    let mut summary = Summary {
        steps: s.start_step,
        metrics: s.metrics.as_ref().map(|m| m.path().to_owned()),
        tensorboard: s.tensorboard.as_ref().and(s.cfg.tensorboard.clone()),
        ..Summary::default()
    };
    progress.start(s.start_step + 1, s.cfg.steps, s.model.num_params());
    match train_loop(&mut s, &interrupt, progress, &mut summary) {
        Ok(()) => {}
        Err(Stop::Step(e)) => {
            // The checkpoint being written holds the state before the failed step, whole: it
            // is finished (or, failing, named) before the error is reported. A sharded job's
            // rank finishes its own writes (the other ranks may be gone): the rank whose
            // writes end last seals it.
            if let Err(w) = settle_checkpoint(&mut s, true, progress, &mut summary) {
                progress.note(&format!("  the checkpoint being written failed too: {w}"));
            }
            if let Some(w) = s.job_writing.take() {
                w.end_alone();
            }
            return Err(e);
        }
        Err(Stop::AfterStep(e)) => {
            if let Err(w) = settle_checkpoint(&mut s, true, progress, &mut summary) {
                progress.note(&format!("  the checkpoint being written failed: {w}"));
            }
            if let Some(w) = s.job_writing.take() {
                w.end_alone();
            }
            return Err(rescue(&mut s, summary.steps, e, progress));
        }
    }
    if let Err(e) = write_final_outputs(&mut s, &mut summary) {
        return Err(rescue(&mut s, summary.steps, e, progress));
    }
    summary.metrics_failures = s.metrics.as_ref().map_or(0, |m| m.failed_writes);
    summary.tensorboard_failures = s.tensorboard.as_ref().map_or(0, |t| t.failed_writes);
    summary.host_memory = s.streamer.host_memory();
    summary.peak_rss = crate::util::peak_rss_bytes();
    Ok(summary)
}

/// Steps from the session's start to `cfg.steps`: a step, its metrics line, validation when
/// due, a checkpoint when due, and the interrupt flag.
fn train_loop(
    s: &mut Session,
    interrupt: &AtomicBool,
    progress: &mut dyn Progress,
    summary: &mut Summary,
) -> std::result::Result<(), Stop> {
    let (mut tokens, mut secs) = (0u64, 0.0f64);
    let world = s.streamer.world().clone();
    let (rank, ranks) = (world.rank(), world.size());
    for step in s.start_step + 1..=s.cfg.steps {
        // The job's micro-batches in order (every rank draws them all, so every rank's cursor
        // is the job's); this rank trains its own `grad_accum` of them.
        let mut batches: Vec<MicroBatch> = (0..s.cfg.grad_accum * ranks)
            .map(|_| s.loader.next_batch())
            .collect();
        batches.drain(..rank * s.cfg.grad_accum);
        batches.truncate(s.cfg.grad_accum);
        let m = s
            .streamer
            .step(&batches, s.cfg.lr_at(step))
            .map_err(Stop::Step)?;
        if !m.loss.is_finite() {
            return Err(Stop::Step(
                Error::system("trainer", format!("step {step}"), format!("loss is {} (diverged)", m.loss))
                    .with_fix("lower --lr, raise --warmup-steps, or enable --grad-clip; earlier checkpoints are intact"),
            ));
        }
        tokens += m.tokens;
        secs += m.wall_s;
        summary.tokens_per_s = if secs > 0.0 {
            tokens as f64 / secs
        } else {
            0.0
        };
        summary.first_loss.get_or_insert(m.loss);
        summary.last_loss = Some(m.loss);
        summary.steps = step;
        let val = validate_if_due(s, step).map_err(Stop::AfterStep)?;
        if val.is_some() {
            summary.val_loss = val;
        }
        // A sample is a diagnostic: skipped once interrupted, a failure only warned about.
        if !interrupt.load(Ordering::SeqCst) {
            sample_if_due(s, step, progress);
        }
        step_log::log_step(s, &m, val, progress);
        progress.step(&m, val);
        // The previous step's checkpoint, if its write has ended meanwhile.
        settle_checkpoint(s, false, progress, summary).map_err(Stop::AfterStep)?;
        // An interrupt seen by any rank stops every rank after this same step.
        let stop = crate::dist::any(world.as_ref(), interrupt.load(Ordering::SeqCst))
            .map_err(Stop::Step)?;
        let due = s.cfg.checkpoint_every > 0 && step.is_multiple_of(s.cfg.checkpoint_every);
        if s.streamer.store().layout().owners.is_some() {
            // Sharded Adam state: every rank takes part in each checkpoint, each writing its
            // own units beside the next steps; the last one is waited for.
            if s.joint_checkpoints {
                settle_job_checkpoint(s, false, false, progress, summary)
                    .map_err(Stop::AfterStep)?;
                let last = step == s.cfg.steps || stop;
                if due || last {
                    start_job_checkpoint(s, step, progress, summary).map_err(Stop::AfterStep)?;
                }
                if last {
                    settle_job_checkpoint(s, true, true, progress, summary)
                        .map_err(Stop::AfterStep)?;
                }
            }
        } else if let Some(root) = s.run_dir.as_ref().map(|r| r.root.clone()) {
            if step == s.cfg.steps || stop {
                // The last one: nothing to overlap it with.
                let t0 = std::time::Instant::now();
                settle_checkpoint(s, true, progress, summary).map_err(Stop::AfterStep)?;
                let d = save_checkpoint(s, &root, step).map_err(Stop::AfterStep)?;
                waited_for(s, &d, t0, "", progress, summary);
            } else if due {
                start_checkpoint(s, &root, step, progress, summary).map_err(Stop::AfterStep)?;
            }
        }
        if stop {
            summary.interrupted = true;
            break;
        }
    }
    settle_checkpoint(s, true, progress, summary).map_err(Stop::AfterStep)?;
    settle_job_checkpoint(s, true, false, progress, summary).map_err(Stop::AfterStep)?;
    s.streamer.finish().map_err(Stop::Step)
}

/// Start writing the checkpoint of the state after `step` under `root` while the next steps
/// run (the previous one, if still being written, is finished first).
fn start_checkpoint(
    s: &mut Session,
    root: &Path,
    step: u64,
    progress: &mut dyn Progress,
    summary: &mut Summary,
) -> Result<()> {
    settle_checkpoint(s, true, progress, summary)?;
    // Every update of `step` ends before its units are frozen.
    let t0 = std::time::Instant::now();
    s.streamer.finish()?;
    let state = train_state(s, step);
    s.writing = Some(checkpoint::start(
        root,
        s.streamer.store(),
        state,
        s.cfg.keep_checkpoints,
        t0.elapsed(),
    )?);
    Ok(())
}

/// Finish the checkpoint being written, if any: when its write has ended, or (`wait`) waiting
/// for it. Reports it (bytes, rate, how much of it training did not wait for).
fn settle_checkpoint(
    s: &mut Session,
    wait: bool,
    progress: &mut dyn Progress,
    summary: &mut Summary,
) -> Result<()> {
    if !s.writing.as_ref().is_some_and(|w| wait || w.is_finished()) {
        return Ok(());
    }
    let Some(w) = s.writing.take() else {
        return Ok(());
    };
    let done = w.join()?;
    report_written(s, done, "", false, progress, summary);
    Ok(())
}

/// Report checkpoint `done`, written while training went on, or (`at_once`: the last one)
/// waited for as soon as it started (`how`: said after its rate).
fn report_written(
    s: &mut Session,
    done: checkpoint::Written,
    how: &str,
    at_once: bool,
    progress: &mut dyn Progress,
    summary: &mut Summary,
) {
    progress.checkpoint(&done.dir);
    let (size, rate) = (
        crate::util::human_bytes(done.bytes),
        done.bytes as f64 / done.secs.max(1e-9) / 1e9,
    );
    progress.note(&match at_once {
        true => format!(
            "  {size} written in {:.3} s ({rate:.2} GB/s{how}; training waited for it)",
            done.secs
        ),
        false => format!(
            "  {size} written in {:.3} s ({rate:.2} GB/s{how}) while training went on; it waited {:.3} s for the write ({:.0}% hidden)",
            done.secs,
            done.waited,
            100.0 * done.hidden()
        ),
    });
    s.saved = Some((done.step, done.dir.clone()));
    summary.checkpoint = Some(done.dir);
}

/// Validation loss when it is due at `step`.
fn validate_if_due(s: &mut Session, step: u64) -> Result<Option<f64>> {
    let Some(vl) = s.val_loader.as_mut() else {
        return Ok(None);
    };
    let every = s.cfg.val_every;
    if !((every > 0 && step.is_multiple_of(every)) || step == s.cfg.steps) {
        return Ok(None);
    }
    validate(&mut s.streamer, vl, s.cfg.val_batches).map(Some)
}

/// A sample of the model's text when one is due at `step`: a note, and text in TensorBoard
/// (a failure is a warning: training goes on).
fn sample_if_due(s: &mut Session, step: u64, progress: &mut dyn Progress) {
    let Some(samples) = s.samples.as_ref().filter(|x| x.due(step, s.cfg.steps)) else {
        return;
    };
    let text = match samples.sample(&mut s.streamer, step) {
        Ok(t) => t,
        Err(e) => {
            progress.note(&format!(
                "warning: the sample at step {step} failed ({e}); training goes on"
            ));
            return;
        }
    };
    progress.note(&format!("sample at step {step}: {text:?}"));
    if let Some(warning) = s
        .tensorboard
        .as_mut()
        .and_then(|tb| tb.append_text(step, "samples", &text))
    {
        progress.note(&warning);
    }
}

/// Start the checkpoint of the state after `step` of a job whose state is sharded (ZeRO stage 1
/// or 3), on every rank at once (the previous one, if still being written, is finished first):
/// each rank writes the units it holds into it beside the next steps where every rank sees its
/// directory, else rank 0 writes it all now, taking each unit it lacks from the rank that holds
/// it, while training waits (`checkpoint::start_job`).
fn start_job_checkpoint(
    s: &mut Session,
    step: u64,
    progress: &mut dyn Progress,
    summary: &mut Summary,
) -> Result<()> {
    settle_job_checkpoint(s, true, false, progress, summary)?;
    let t0 = std::time::Instant::now();
    // Every update of `step` ends before its units are frozen.
    s.streamer.finish()?;
    let world = s.streamer.world().clone();
    let writer = s.run_dir.as_ref().map(|r| checkpoint::JobCheckpoint {
        root: r.root.clone(),
        state: train_state(s, step),
        keep: s.cfg.keep_checkpoints,
    });
    match checkpoint::start_job(writer, s.streamer.store(), world.as_ref(), t0.elapsed())? {
        checkpoint::JobStarted::Writing(w) => s.job_writing = Some(*w),
        checkpoint::JobStarted::Gathered { dir: Some(d), why } => {
            s.saved = Some((step, d.clone()));
            let how = format!(
                ", rank 0 writing the units the {} ranks sent: {why}, so they could not write \
                 their own",
                world.size()
            );
            waited_for(s, &d, t0, &how, progress, summary);
        }
        checkpoint::JobStarted::Gathered { dir: None, .. } => {}
    }
    Ok(())
}

/// Finish a sharded job's checkpoint being written, if any, on every rank at once: when every
/// rank's writes have ended (asked of all ranks), or (`wait`) waiting for them. Rank 0 reports it
/// (`at_once`: the last one, waited for as soon as it started).
fn settle_job_checkpoint(
    s: &mut Session,
    wait: bool,
    at_once: bool,
    progress: &mut dyn Progress,
    summary: &mut Summary,
) -> Result<()> {
    let Some(w) = s.job_writing.as_ref() else {
        return Ok(());
    };
    let world = s.streamer.world().clone();
    if !wait && crate::dist::any(world.as_ref(), !w.is_finished())? {
        return Ok(());
    }
    let Some(w) = s.job_writing.take() else {
        return Ok(());
    };
    if let Some(done) = w.finish(world.as_ref())? {
        report_written(
            s,
            done,
            &format!(
                ", each of the {} ranks writing the units it holds",
                world.size()
            ),
            at_once,
            progress,
            summary,
        );
    }
    Ok(())
}

/// Report checkpoint `d`, written since `t0` while training waited (`how`: said after its rate).
fn waited_for(
    s: &Session,
    d: &Path,
    t0: std::time::Instant,
    how: &str,
    progress: &mut dyn Progress,
    summary: &mut Summary,
) {
    let secs = t0.elapsed().as_secs_f64();
    progress.checkpoint(d);
    let bytes = s.streamer.store().layout().checkpoint_bytes();
    progress.note(&format!(
        "  {} written in {secs:.1} s ({:.2} GB/s{how}; training waited for it)",
        crate::util::human_bytes(bytes),
        bytes as f64 / secs.max(1e-9) / 1e9
    ));
    summary.checkpoint = Some(d.to_path_buf());
}

/// Write a checkpoint of the current state (after `step`) under `root`, waiting for it.
fn save_checkpoint(s: &mut Session, root: &Path, step: u64) -> Result<PathBuf> {
    s.streamer.finish()?;
    let state = train_state(s, step);
    let d = checkpoint::save(root, s.streamer.store(), &state, s.cfg.keep_checkpoints)?;
    s.saved = Some((step, d.clone()));
    Ok(d)
}

/// Everything a checkpoint of the state after `step` holds besides the tensors.
fn train_state(s: &Session, step: u64) -> TrainState {
    TrainState {
        format: checkpoint::FORMAT,
        run_id: Some(s.run_id.clone()),
        step,
        cursor: s.loader.cursor,
        prev_norm: s.streamer.prev_norm(),
        model: s.model.clone(),
        config: s.cfg.clone(),
        changes: s.changes.clone(),
    }
}

/// The HF export, the loss curve and the trace.
fn write_final_outputs(s: &mut Session, summary: &mut Summary) -> Result<()> {
    if let Some(out) = &s.cfg.export_hf {
        let store = s.streamer.store();
        let dtype = s
            .cfg
            .export_dtype
            .unwrap_or_else(|| ExportDtype::default_for(store.layout().num_params() as u64));
        let opts = crate::store::hf::ExportOptions {
            run_id: Some(&s.run_id),
            dtype,
            // A model started from a Hugging Face directory is served with its tokenizer.
            serving_files_from: s.cfg.init_from.as_deref().filter(|p| p.is_dir()),
        };
        if store.layout().gathers_params() {
            // ZeRO stage 3: this rank holds only its units' params; the final checkpoint holds
            // the job's (written at the last step by every rank).
            let dir = match &s.saved {
                Some((step, dir)) if *step == summary.steps => dir.clone(),
                _ => {
                    return Err(Error::internal(
                        "export",
                        "a job with sharded params has no checkpoint of its final state",
                    ))
                }
            };
            let mut params = checkpoint::CheckpointParams::open(&dir, store.layout())?;
            crate::store::hf::export(&mut params, store.layout(), out, 2 << 30, opts)?;
        } else {
            crate::store::hf::export_store(store, out, 2 << 30, opts)?;
        }
        summary.export = Some(out.clone());
    }
    let curve = s
        .metrics
        .as_ref()
        .and_then(|log| Some((log, outputs::loss_curve_path(log.path())?)));
    if let Some((log, svg)) = curve {
        crate::util::write_atomic(
            &svg,
            plot::loss_svg(&log.curve, &log.val_curve, "megatrain: loss per step").as_bytes(),
        )?;
        summary.plot = Some(svg);
    }
    if let Some(p) = &s.cfg.trace {
        s.streamer.timeline().write_chrome(p)?;
        summary.trace = Some(p.clone());
    }
    Ok(())
}

/// `error` happened after `step` completed: make sure the trained state is in a checkpoint (the
/// run's own if it already is or can be written, else a rescue directory beside the working
/// directory), then return the error naming where.
fn rescue(s: &mut Session, step: u64, error: Error, progress: &mut dyn Progress) -> Error {
    // Rank 0 holds the same state and saves it; the other ranks write nothing. A job whose
    // Adam state is sharded cannot: rank 0 lacks the others' moments, and they may be gone
    // (its last checkpoint stays whole).
    if step <= s.start_step
        || s.streamer.world().rank() != 0
        || s.streamer.store().layout().owners.is_some()
    {
        return error;
    }
    if let Some((saved_step, dir)) = &s.saved {
        if *saved_step == step {
            let root = dir.parent().map(Path::to_path_buf).unwrap_or_default();
            return Error::StateSaved {
                source: Box::new(error),
                step,
                saved: dir.clone(),
                root,
            };
        }
    }
    let mut roots: Vec<PathBuf> = s.run_dir.iter().map(|r| r.root.clone()).collect();
    let rescue_name = format!("megatrain-rescue-{}", s.run_id);
    roots.push(PathBuf::from(&rescue_name));
    roots.push(std::env::temp_dir().join(&rescue_name));
    for root in roots {
        progress.note(&format!(
            "saving the trained state (step {step}) to {} before reporting the error",
            root.display()
        ));
        match save_checkpoint(s, &root, step) {
            Ok(dir) => {
                return Error::StateSaved {
                    source: Box::new(error),
                    step,
                    saved: dir,
                    root,
                }
            }
            Err(e) => progress.note(&format!("  could not: {e}")),
        }
    }
    error
}
