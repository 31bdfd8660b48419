//! The step schedule as a pure plan: which op runs where, on which buffers, after what.
//!
//! The planner lists the ops of one optimizer step in submission order, each with the resources it
//! reads and writes (device slots, host shards). A hazard tracker then derives every dependency:
//! an op waits for the last writer of what it reads and for the readers and writer of what it
//! writes, unless FIFO order on the same stream already implies it. So slot reuse is ordered by
//! construction, and the tests check the plan's properties without running anything.

use crate::device::StreamKind;
use crate::store::layout::Mode;
use serde::Serialize;
use std::collections::HashMap;

/// Where layer-boundary checkpoints live.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Checkpoints {
    /// All L+1 on the device (fastest; grows with depth).
    Device,
    /// Offloaded to host memory; two device slots (device memory independent of depth).
    Host,
}

/// A device buffer of the plan.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum DevBuf {
    /// Weight slot (double-buffered).
    W(usize),
    /// Gradient slot (double-buffered).
    G(usize),
    /// The tied embedding's gradient, alive from the head's backward to the embedding's.
    GEmb,
    /// dx/dy ping-pong.
    D(usize),
    /// Activation: checkpoint i (device policy) or slot i (host policy).
    A(usize),
}

/// A resource an op touches.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize)]
pub enum Res {
    /// A device buffer.
    Dev(DevBuf),
    /// Unit u's params in the host store.
    Params(usize),
    /// Unit u's gradient destination on the host (store shard, or lean buffer).
    Grads(usize),
    /// Lean gradient buffer k.
    Lean(usize),
    /// Host copy of checkpoint i.
    Ckpt(usize),
}

/// A device kernel of the plan (micro-batch `mb`).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum KernelOp {
    /// x_0 = E\[tokens\].
    EmbedFwd { mb: usize, w: DevBuf, x: DevBuf },
    /// x_{i+1} = block_i(x_i).
    BlockFwd {
        mb: usize,
        layer: usize,
        w: DevBuf,
        x: DevBuf,
        y: DevBuf,
    },
    /// Loss, head backward; `lm_w`/`lm_g` are the embedding's slot and gradient when tied.
    HeadLossBwd {
        mb: usize,
        w: DevBuf,
        g: DevBuf,
        lm_w: Option<DevBuf>,
        lm_g: Option<DevBuf>,
        x: DevBuf,
        dx: DevBuf,
    },
    /// Block backward.
    BlockBwd {
        mb: usize,
        layer: usize,
        w: DevBuf,
        g: DevBuf,
        x: DevBuf,
        dy: DevBuf,
        dx: DevBuf,
    },
    /// dE\[tokens\] += dx.
    EmbedBwd { mb: usize, g: DevBuf, dx: DevBuf },
    /// Zero a gradient buffer.
    Zero { buf: DevBuf },
}

/// One op of the plan.
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub enum Op {
    /// Copy unit u's params into a weight slot.
    CopyWeights { unit: usize, slot: DevBuf },
    /// Copy checkpoint i from the host into an activation slot.
    CkptIn { index: usize, slot: DevBuf },
    /// Copy checkpoint i from an activation slot to the host.
    CkptOut { index: usize, slot: DevBuf },
    /// Copy a unit's gradients to the host (`accumulate` into what is there for later micro-batches).
    CopyGrads {
        unit: usize,
        from: DevBuf,
        accumulate: bool,
        lean: Option<usize>,
    },
    /// A kernel.
    Kernel(KernelOp),
    /// Host: add unit u's Σg² to the step's global norm (exact mode).
    Norm { unit: usize },
    /// Host: the global norm is complete; compute the clip coefficient.
    Clip,
    /// Host: start unit u's AdamW update on its node's pool (asynchronous).
    Adam { unit: usize, lean: Option<usize> },
}

/// Where an op runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize)]
pub enum Lane {
    /// A device stream.
    Stream(StreamKind),
    /// The host thread that drives the plan.
    Host,
}

/// An op with its dependencies (indices of earlier steps).
#[derive(Debug, Clone, PartialEq, Eq, Serialize)]
pub struct Step {
    /// Where it runs.
    pub lane: Lane,
    /// What it does.
    pub op: Op,
    /// What it reads.
    pub reads: Vec<Res>,
    /// What it writes.
    pub writes: Vec<Res>,
    /// Earlier steps it must wait for (not implied by stream order).
    pub waits: Vec<usize>,
}

/// The plan of one optimizer step.
#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct Plan {
    /// Ops in submission order.
    pub steps: Vec<Step>,
    /// Device buffers the plan uses.
    pub buffers: Vec<DevBuf>,
}

/// What the plan is for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct PlanSpec {
    /// Decoder layers L (units are 0 = embedding, 1..=L blocks, L+1 head).
    pub layers: usize,
    /// Tied embeddings.
    pub tied: bool,
    /// Micro-batches per step.
    pub micro_batches: usize,
    /// Exact or lean.
    pub mode: Mode,
    /// Checkpoint placement.
    pub checkpoints: Checkpoints,
}

/// Lean gradient buffers rotating between the device drain and AdamW.
pub const LEAN_BUFFERS: usize = 2;

struct Builder {
    steps: Vec<Step>,
    w_content: [Option<usize>; 2],
    next_w: usize,
    next_g: usize,
    next_lean: usize,
}

impl Builder {
    fn push(&mut self, lane: Lane, op: Op, reads: Vec<Res>, writes: Vec<Res>) {
        self.steps.push(Step {
            lane,
            op,
            reads,
            writes,
            waits: Vec::new(),
        });
    }

    /// Weight slot holding `unit`, copying it in unless already resident.
    fn weights(&mut self, unit: usize, keep: Option<DevBuf>) -> DevBuf {
        if let Some(s) = self.w_content.iter().position(|c| *c == Some(unit)) {
            // The next copy goes to the other slot: the one this unit's user is not about to read.
            self.next_w = 1 - s;
            return DevBuf::W(s);
        }
        let mut s = self.next_w;
        if keep == Some(DevBuf::W(s)) {
            s = 1 - s;
        }
        self.next_w = 1 - s;
        self.w_content[s] = Some(unit);
        let slot = DevBuf::W(s);
        self.push(
            Lane::Stream(StreamKind::CopyIn),
            Op::CopyWeights { unit, slot },
            vec![Res::Params(unit)],
            vec![Res::Dev(slot)],
        );
        slot
    }

    fn grad_slot(&mut self) -> DevBuf {
        let g = DevBuf::G(self.next_g);
        self.next_g = 1 - self.next_g;
        g
    }

    fn kernel(&mut self, k: KernelOp, reads: Vec<DevBuf>, writes: Vec<DevBuf>) {
        self.push(
            Lane::Stream(StreamKind::Compute),
            Op::Kernel(k),
            reads.into_iter().map(Res::Dev).collect(),
            writes.into_iter().map(Res::Dev).collect(),
        );
    }

    fn drain(&mut self, unit: usize, from: DevBuf, spec: &PlanSpec, mb: usize) {
        let last = mb + 1 == spec.micro_batches;
        let lean = (spec.mode == Mode::Lean && last).then(|| {
            let k = self.next_lean;
            self.next_lean = (k + 1) % LEAN_BUFFERS;
            k
        });
        let dest = lean.map_or(Res::Grads(unit), Res::Lean);
        self.push(
            Lane::Stream(StreamKind::CopyOut),
            Op::CopyGrads {
                unit,
                from,
                accumulate: mb > 0,
                lean,
            },
            vec![Res::Dev(from)],
            vec![dest],
        );
        if last {
            match spec.mode {
                Mode::Lean => {
                    let k = lean.unwrap_or(0);
                    self.push(
                        Lane::Host,
                        Op::Adam {
                            unit,
                            lean: Some(k),
                        },
                        vec![Res::Lean(k)],
                        vec![Res::Params(unit)],
                    );
                }
                Mode::Exact => self.push(
                    Lane::Host,
                    Op::Norm { unit },
                    vec![Res::Grads(unit)],
                    vec![],
                ),
            }
        }
    }
}

/// Build the plan of one step.
pub fn plan(spec: &PlanSpec) -> Plan {
    let l = spec.layers;
    let head = l + 1;
    let mut b = Builder {
        steps: Vec::new(),
        w_content: [None, None],
        next_w: 0,
        next_g: 0,
        next_lean: 0,
    };
    let act = |i: usize| match spec.checkpoints {
        Checkpoints::Device => DevBuf::A(i),
        Checkpoints::Host => DevBuf::A(i % 2),
    };
    for mb in 0..spec.micro_batches {
        // Forward: x_0 .. x_L, weights streamed through the two slots.
        let w = b.weights(0, None);
        b.kernel(
            KernelOp::EmbedFwd { mb, w, x: act(0) },
            vec![w],
            vec![act(0)],
        );
        for i in 0..l {
            if spec.checkpoints == Checkpoints::Host {
                b.push(
                    Lane::Stream(StreamKind::CopyOut),
                    Op::CkptOut {
                        index: i,
                        slot: act(i),
                    },
                    vec![Res::Dev(act(i))],
                    vec![Res::Ckpt(i)],
                );
            }
            let w = b.weights(1 + i, None);
            b.kernel(
                KernelOp::BlockFwd {
                    mb,
                    layer: i,
                    w,
                    x: act(i),
                    y: act(i + 1),
                },
                vec![w, act(i)],
                vec![act(i + 1)],
            );
        }
        // Head: loss and backward (tied: the embedding matrix is the LM head).
        let hw = b.weights(head, None);
        let (lm_w, lm_g) = if spec.tied {
            (Some(b.weights(0, Some(hw))), Some(DevBuf::GEmb))
        } else {
            (None, None)
        };
        let hg = b.grad_slot();
        b.kernel(KernelOp::Zero { buf: hg }, vec![], vec![hg]);
        if let Some(ge) = lm_g {
            b.kernel(KernelOp::Zero { buf: ge }, vec![], vec![ge]);
        }
        let mut reads = vec![hw, act(l)];
        reads.extend(lm_w);
        let mut writes = vec![hg, DevBuf::D(0)];
        writes.extend(lm_g);
        b.kernel(
            KernelOp::HeadLossBwd {
                mb,
                w: hw,
                g: hg,
                lm_w,
                lm_g,
                x: act(l),
                dx: DevBuf::D(0),
            },
            reads,
            writes,
        );
        b.drain(head, hg, spec, mb);
        // Blocks in reverse; checkpoint x_i must be on the device.
        let mut d = 0;
        for i in (0..l).rev() {
            let x = act(i);
            let resident = spec.checkpoints == Checkpoints::Device || i + 1 == l;
            if !resident {
                b.push(
                    Lane::Stream(StreamKind::CopyIn),
                    Op::CkptIn { index: i, slot: x },
                    vec![Res::Ckpt(i)],
                    vec![Res::Dev(x)],
                );
            }
            let w = b.weights(1 + i, None);
            let g = b.grad_slot();
            b.kernel(KernelOp::Zero { buf: g }, vec![], vec![g]);
            let (dy, dx) = (DevBuf::D(d), DevBuf::D(1 - d));
            b.kernel(
                KernelOp::BlockBwd {
                    mb,
                    layer: i,
                    w,
                    g,
                    x,
                    dy,
                    dx,
                },
                vec![w, x, dy],
                vec![g, dx],
            );
            d = 1 - d;
            b.drain(1 + i, g, spec, mb);
        }
        // Embedding: only its gradient (tied: accumulated onto the head's).
        let g = match spec.tied {
            true => DevBuf::GEmb,
            false => {
                let g = b.grad_slot();
                b.kernel(KernelOp::Zero { buf: g }, vec![], vec![g]);
                g
            }
        };
        b.kernel(
            KernelOp::EmbedBwd {
                mb,
                g,
                dx: DevBuf::D(d),
            },
            vec![DevBuf::D(d)],
            vec![g],
        );
        b.drain(0, g, spec, mb);
        b.w_content = [None, None];
    }
    if spec.mode == Mode::Exact {
        b.push(Lane::Host, Op::Clip, vec![], vec![]);
        for u in 0..=head {
            b.push(
                Lane::Host,
                Op::Adam {
                    unit: u,
                    lean: None,
                },
                vec![Res::Grads(u)],
                vec![Res::Params(u)],
            );
        }
    }
    let mut steps = b.steps;
    track_hazards(&mut steps);
    let mut buffers: Vec<DevBuf> = steps
        .iter()
        .flat_map(|s| s.reads.iter().chain(&s.writes))
        .filter_map(|r| match r {
            Res::Dev(d) => Some(*d),
            _ => None,
        })
        .collect();
    buffers.sort();
    buffers.dedup();
    Plan { steps, buffers }
}

/// Fill in `waits`: read-after-write, write-after-read and write-after-write across lanes.
/// (The host lane is ordered too: its ops run in submission order.)
fn track_hazards(steps: &mut [Step]) {
    #[derive(Default)]
    struct State {
        writer: Option<usize>,
        readers: Vec<usize>,
    }
    let mut st: HashMap<Res, State> = HashMap::new();
    for i in 0..steps.len() {
        let lane = steps[i].lane;
        let mut waits: Vec<usize> = Vec::new();
        let mut need = |j: usize, steps: &[Step]| {
            let implied = steps[j].lane == lane && matches!(lane, Lane::Stream(_) | Lane::Host);
            if !implied {
                waits.push(j);
            }
        };
        for r in &steps[i].reads {
            if let Some(w) = st.get(r).and_then(|s| s.writer) {
                need(w, steps);
            }
        }
        for r in &steps[i].writes {
            if let Some(s) = st.get(r) {
                if let Some(w) = s.writer {
                    need(w, steps);
                }
                for &rd in &s.readers {
                    need(rd, steps);
                }
            }
        }
        waits.sort_unstable();
        waits.dedup();
        steps[i].waits = waits;
        let (reads, writes) = (steps[i].reads.clone(), steps[i].writes.clone());
        for r in reads {
            st.entry(r).or_default().readers.push(i);
        }
        for r in writes {
            let s = st.entry(r).or_default();
            s.writer = Some(i);
            s.readers.clear();
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(layers: usize, tied: bool, mb: usize, mode: Mode, cp: Checkpoints) -> PlanSpec {
        PlanSpec {
            layers,
            tied,
            micro_batches: mb,
            mode,
            checkpoints: cp,
        }
    }

    fn all_specs() -> Vec<PlanSpec> {
        let mut v = Vec::new();
        for layers in [1, 2, 5] {
            for tied in [false, true] {
                for cp in [Checkpoints::Device, Checkpoints::Host] {
                    v.push(spec(layers, tied, 1, Mode::Exact, cp));
                    v.push(spec(layers, tied, 3, Mode::Exact, cp));
                    v.push(spec(layers, tied, 1, Mode::Lean, cp));
                }
            }
        }
        v
    }

    #[allow(clippy::needless_range_loop)] // index loops over a dependency matrix read clearer
    /// Every pair of conflicting accesses on different lanes is ordered through the waits
    /// (transitively), and same-lane pairs by submission order.
    #[test]
    fn every_hazard_is_ordered() {
        for s in all_specs() {
            let p = plan(&s);
            let n = p.steps.len();
            // before[i][j]: step j completes before step i starts.
            let mut before = vec![vec![false; n]; n];
            for i in 0..n {
                for j in 0..i {
                    let direct =
                        p.steps[i].waits.contains(&j) || p.steps[j].lane == p.steps[i].lane;
                    if direct {
                        before[i][j] = true;
                    }
                }
                for j in 0..i {
                    if before[i][j] {
                        for k in 0..j {
                            if before[j][k] {
                                before[i][k] = true;
                            }
                        }
                    }
                }
            }
            for i in 0..n {
                for j in 0..i {
                    let (a, b) = (&p.steps[j], &p.steps[i]);
                    let conflict = a
                        .writes
                        .iter()
                        .any(|r| b.reads.contains(r) || b.writes.contains(r))
                        || a.reads.iter().any(|r| b.writes.contains(r));
                    assert!(
                        !conflict || before[i][j],
                        "{s:?}: step {i} {:?} races step {j} {:?}",
                        b.op,
                        a.op
                    );
                }
            }
        }
    }

    #[test]
    fn weights_cross_at_most_twice_per_micro_batch() {
        for s in all_specs() {
            let p = plan(&s);
            for u in 0..s.layers + 2 {
                let n = p
                    .steps
                    .iter()
                    .filter(|x| matches!(x.op, Op::CopyWeights { unit, .. } if unit == u))
                    .count();
                assert!(n <= 2 * s.micro_batches, "{s:?}: unit {u} copied {n} times");
                assert!(n >= s.micro_batches, "{s:?}: unit {u} never copied");
            }
        }
    }

    #[test]
    fn device_buffers_do_not_grow_with_depth_when_checkpoints_offload() {
        let small = plan(&spec(2, false, 1, Mode::Exact, Checkpoints::Host)).buffers;
        let deep = plan(&spec(32, false, 1, Mode::Exact, Checkpoints::Host)).buffers;
        assert_eq!(small, deep);
        let dev = plan(&spec(32, false, 1, Mode::Exact, Checkpoints::Device)).buffers;
        assert_eq!(dev.iter().filter(|b| matches!(b, DevBuf::A(_))).count(), 33);
    }

    #[test]
    fn every_unit_is_updated_once_after_its_gradients() {
        for s in all_specs() {
            let p = plan(&s);
            for u in 0..s.layers + 2 {
                let adam: Vec<usize> = (0..p.steps.len())
                    .filter(|&i| matches!(p.steps[i].op, Op::Adam { unit, .. } if unit == u))
                    .collect();
                assert_eq!(adam.len(), 1, "{s:?} unit {u}");
                let last_drain = (0..p.steps.len())
                    .filter(|&i| matches!(p.steps[i].op, Op::CopyGrads { unit, .. } if unit == u))
                    .max()
                    .unwrap();
                assert!(adam[0] > last_drain);
            }
            if s.mode == Mode::Lean {
                // Lean: the update of the head starts before the embedding's backward is even submitted.
                let adam_head = p
                    .steps
                    .iter()
                    .position(|x| matches!(x.op, Op::Adam { unit, .. } if unit == s.layers + 1))
                    .unwrap();
                let emb_bwd = p
                    .steps
                    .iter()
                    .position(|x| matches!(x.op, Op::Kernel(KernelOp::EmbedBwd { .. })))
                    .unwrap();
                assert!(adam_head < emb_bwd);
            }
        }
    }
}
