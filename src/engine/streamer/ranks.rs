//! What a streamer does as one rank of a data-parallel job, beside its step: the gradient sum
//! ([`Op::Reduce`](crate::engine::schedule::Op::Reduce)), and under ZeRO the owners' updates
//! shared after the step (stage 1), the params gathered before each copy (stage 3) and the
//! job's norm from each unit's owner (stage 3 with sharded gradients).

use super::{StepRun, Streamer};
use crate::device::{Batch, Cmd};
use crate::engine::schedule::{DevBuf, Op};
use crate::store::layout::Mode;
use crate::{Error, Result};

impl Streamer {
    /// ZeRO stage 1, at the end of a step: each unit's updated params go from the rank that
    /// updated it (`owner[u]`, which waits for its update here) to every other rank, last unit
    /// first (the order the updates start in); in lean mode the units' Σg², each from its
    /// owner's update and 0 elsewhere, are summed across the ranks (adding zeros is exact; a
    /// unit's Σg² itself is its owner's, whose bits follow its AdamW workers' split as in any
    /// process). Stage 3 sends no params here: each rank gathers a unit's when it next needs
    /// them ([`Op::Gather`]).
    pub(super) fn share_updates(&mut self, owner: &[usize]) -> Result<()> {
        let world = self.world.clone();
        let params = !self.store.layout().gathers_params();
        for u in (0..self.store.num_units()).rev().filter(|_| params) {
            let root = owner
                .get(u)
                .copied()
                .ok_or_else(|| Error::internal("streamer", format!("unit {u} has no owner")))?;
            world.broadcast_bytes(root, self.guard(u)?.params_bytes())?;
        }
        if self.store.layout().mode == Mode::Lean {
            world.sum_f64(&mut self.lean_sumsq)?;
        }
        Ok(())
    }

    /// Sum unit u's step gradients across the ranks: its shard, or (lean mode) piece `piece` of
    /// them in lean buffer `lean`, or (sharded gradients) one micro-batch's where they landed —
    /// landing buffer `landing`, or the owner's shard for the first micro-batch — the sum added
    /// to the owner's shard for a later micro-batch (`accumulate`).
    pub(super) fn reduce(
        &mut self,
        unit: usize,
        (lean, piece): (Option<usize>, usize),
        (landing, accumulate): (Option<usize>, bool),
    ) -> Result<()> {
        let world = self.world.clone();
        let holds = self.store.layout().holds_grads(unit);
        match (lean, landing) {
            (Some(k), _) => {
                let len = self.store.layout().lean_piece(unit, piece).len();
                let b = self.lean[k].as_mut().ok_or_else(|| {
                    Error::internal("streamer", format!("lean buffer {k} is owned by AdamW"))
                })?;
                world.sum_f32(&mut b.as_mut_slice()[..len])
            }
            (None, Some(k)) if accumulate || !holds => {
                let numel = self.store.layout().units[unit].numel;
                let b = self
                    .landing
                    .get_mut(k)
                    .ok_or_else(|| Error::internal("streamer", format!("no landing buffer {k}")))?;
                let landed = &mut b.as_mut_slice()[..numel];
                // Only the unit's owner needs the sum.
                world.reduce_f32(self.store.layout().owner(unit), landed)?;
                if !holds {
                    return Ok(());
                }
                // The owner's later micro-batch: added to its shard, as a process alone adds
                // its micro-batches' gradients.
                self.guard(unit)?;
                let grads = self.guards[unit]
                    .as_mut()
                    .and_then(|g| g.grads())
                    .ok_or_else(|| {
                        Error::internal("streamer", "exact mode without a gradient shard")
                    })?;
                let landed = &self.landing[k].as_mut_slice()[..numel];
                // Element by element over the rank's threads: the same bits for any split.
                use rayon::prelude::*;
                grads
                    .par_chunks_mut(1 << 16)
                    .zip(landed.par_chunks(1 << 16))
                    .for_each(|(g, x)| {
                        for (g, x) in g.iter_mut().zip(x) {
                            *g += *x;
                        }
                    });
                Ok(())
            }
            (None, landing) => {
                let owner = self.store.layout().owner(unit);
                let grads = self.guard(unit)?.grads().ok_or_else(|| {
                    Error::internal("streamer", "exact mode without a gradient shard")
                })?;
                match landing {
                    // The owner's first micro-batch, in its shard: the others' landed.
                    Some(_) => world.reduce_f32(owner, grads),
                    None => world.sum_f32(grads),
                }
            }
        }
    }

    /// Sharded gradients, before the clip: every unit's Σg² from the rank holding it (0 from the
    /// others: adding zeros is exact) summed across the ranks, then added in the order the norm
    /// adds them — the bits of a rank holding every unit.
    pub(super) fn job_norm(&mut self, run: &mut StepRun) -> Result<()> {
        let mut by_unit = vec![0.0f64; self.store.num_units()];
        for &(u, s) in &run.norm_parts {
            if let Some(x) = by_unit.get_mut(u) {
                *x = s;
            }
        }
        self.world.sum_f64(&mut by_unit)?;
        run.norm_sq = run.norm_parts.iter().map(|&(u, _)| by_unit[u]).sum();
        Ok(())
    }

    /// ZeRO stage 3: unit u's params as the device streams them (fp32, or the high plane of
    /// planes), from the rank holding them into host buffer `slot` of every other rank. The
    /// holder sends straight from its store (the schedule ordered the unit's update before).
    pub(super) fn gather(&mut self, unit: usize, slot: usize) -> Result<()> {
        let world = self.world.clone();
        let layout = self.store.layout();
        let (root, bytes) = (layout.owner(unit), layout.streamed_bytes(unit));
        if layout.holds_params(unit) {
            let held = self.guard(unit)?.params_bytes();
            let held = held.get_mut(..bytes).ok_or_else(|| {
                Error::internal("streamer", format!("unit {unit}'s params are short"))
            })?;
            return world.broadcast_bytes(root, held);
        }
        let buf = self.gathered.get_mut(slot).ok_or_else(|| {
            Error::internal("streamer", format!("no gathered params buffer {slot}"))
        })?;
        let words = buf.as_mut_slice();
        // SAFETY: byte view of the buffer's f32 words (any bytes form valid f32s; the buffer
        // holds at least the largest unit's streamed bytes).
        let dst = unsafe {
            std::slice::from_raw_parts_mut(words.as_mut_ptr().cast::<u8>(), words.len() * 4)
        };
        let dst = dst.get_mut(..bytes).ok_or_else(|| {
            Error::internal(
                "streamer",
                format!("gathered params buffer {slot} is short"),
            )
        })?;
        world.broadcast_bytes(root, dst)
    }

    /// ZeRO stage 3 with the devices gathering ([`crate::engine::schedule::Gather::Device`]):
    /// unit u's copy into weight buffer `to` on the rank holding it, then the broadcast of
    /// that buffer from it on every rank.
    pub(super) fn gathered_weights(
        &mut self,
        unit: usize,
        to: DevBuf,
        batches: &[Batch],
    ) -> Result<Vec<Cmd>> {
        let layout = self.store.layout();
        let (root, len) = (layout.owner(unit), layout.units[unit].numel);
        let mut cmds = Vec::with_capacity(2);
        if layout.holds_params(unit) {
            let copy = Op::CopyWeights {
                unit,
                to,
                broadcast: false,
            };
            cmds.push(self.command(&copy, batches)?);
        }
        cmds.push(Cmd::Broadcast {
            buf: self.buf(to),
            len,
            root,
            label: format!("weights unit {unit} from rank {root}"),
        });
        Ok(cmds)
    }
}
