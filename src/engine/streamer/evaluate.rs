//! Validation and generation on the training device: a forward-only pass of one micro-batch
//! through the step's own buffers, the weights streamed unit by unit from the host store as in a
//! step — no host copy of the model, no gradient, no update.

use super::{MicroBatch, StepRun, Streamer};
use crate::device::{Batch, LogitsRow};
use crate::engine::schedule::{Lane, Op};
use crate::{Error, Result};
use std::collections::VecDeque;
use std::sync::{Arc, Mutex};

impl Streamer {
    /// The summed loss of micro-batch `mb` (over its trained targets) under the current
    /// weights, by the forward of the training device in its precision (bf16 streams the high
    /// plane, as a step does) and its token chunks. Waits for running AdamW jobs first; leaves
    /// the state, the step count and the step's metrics as they were. A mixture of experts'
    /// load-balancing loss is not part of it (as transformers' evaluation loss).
    pub fn evaluate(&mut self, mb: &MicroBatch) -> Result<f64> {
        self.forward_only(mb, None)
    }

    /// The logits (`[vocab]`, before any soft cap) the model gives token `row` of micro-batch
    /// `mb` (row-major `batch × seq`) under the current weights: the pass of [`Self::evaluate`],
    /// one row of the head's logits read back.
    pub fn logits(&mut self, mb: &MicroBatch, row: usize) -> Result<Vec<f32>> {
        let n = self.cfg.batch * self.cfg.seq;
        if row >= n {
            return Err(Error::internal(
                "streamer",
                format!("logits of token {row} of a micro-batch of {n}"),
            ));
        }
        let into = Arc::new(Mutex::new(Vec::new()));
        self.forward_only(
            mb,
            Some(LogitsRow {
                row,
                into: into.clone(),
            }),
        )?;
        let logits = std::mem::take(&mut *crate::util::lock(&into));
        if logits.len() != self.templates.config.vocab_size {
            return Err(Error::internal(
                "streamer",
                format!(
                    "{} logits read back for a vocabulary of {}",
                    logits.len(),
                    self.templates.config.vocab_size
                ),
            ));
        }
        Ok(logits)
    }

    /// One forward-only pass of `mb`: its summed loss, the row `logits` names read back.
    fn forward_only(&mut self, mb: &MicroBatch, logits: Option<LogitsRow>) -> Result<f64> {
        self.finish()?;
        self.check(mb)?;
        let loss = Arc::new(Mutex::new(0.0f64));
        let batch = Batch {
            tokens: mb.tokens.clone(),
            targets: mb.targets.clone(),
            positions: mb.positions.clone(),
            pad: mb.pad.clone(),
            grad_scale: 0.0,
            loss: loss.clone(),
            router: Default::default(),
            aux_scale: 0.0,
            logits,
        };
        let tasks = self.evaluation.tasks.clone();
        let mut run = StepRun {
            events: vec![None; tasks.len()],
            host_done: vec![false; tasks.len()],
            host_queue: VecDeque::new(),
            norm_sq: 0.0,
            norm_parts: Vec::new(),
            coef: 1.0,
            host_wait: 0.0,
            adam: self.cfg.adam,
            batches: vec![batch],
            trained: mb.trained_tokens(),
        };
        let mut submitted = Ok(());
        for (i, t) in tasks.iter().enumerate() {
            submitted = match (t.lane, &t.op) {
                (Lane::Stream(stream), _) => self.submit(&tasks, i, stream, &mut run),
                // ZeRO stage 3: a unit's params gathered before their copy.
                (Lane::Host, Op::Gather { .. }) => {
                    run.host_queue.push_back(i);
                    Ok(())
                }
                (Lane::Host, op) => Err(Error::internal(
                    "streamer",
                    format!("{op:?} in the forward-only schedule"),
                )),
            }
            .and_then(|()| self.run_host(&tasks, &mut run, None));
            if submitted.is_err() {
                break;
            }
        }
        if submitted.is_ok() {
            submitted = self.run_host(&tasks, &mut run, Some(tasks.len()));
        }
        if submitted.is_err() {
            // As a failed step: broadcasts waiting for other ranks end, so the events fire.
            self.device.abort_exchanges();
        }
        // Every copy from the host store is done before its unit is released.
        for e in run.events.iter().flatten() {
            e.synchronize();
        }
        self.guards.iter_mut().for_each(|g| *g = None);
        // The pass's records are not the next step's.
        let _ = self.device.take_records();
        submitted?;
        if let Some(e) = self.device.take_error() {
            return Err(e);
        }
        let total = *crate::util::lock(&loss);
        Ok(total)
    }
}
