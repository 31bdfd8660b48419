//! The schedule of a forward-only pass (validation): one micro-batch through the weight
//! buffers of the step, nothing kept for a backward, no gradient, no update.

use super::{track_hazards, Builder, DevBuf, Schedule, ScheduleSpec};
use crate::device::Kernel;

/// The ops of one forward-only micro-batch (index 0): the embedding, every block from the two
/// boundary buffers `A(0)`/`A(1)` in turn (whatever the step keeps: a forward needs only its
/// input and output), the final norm, LM head and loss; each unit's params gathered first
/// under ZeRO stage 3. Its buffers are a subset of the step's
/// ([`evaluation_fits`]), so it runs on the step's allocation.
pub fn evaluation(spec: &ScheduleSpec) -> Schedule {
    let l = spec.layers;
    let mut b = Builder::new();
    b.gather = spec.gather;
    let act = |i: usize| DevBuf::A(i % 2);
    let w = b.weights(0, None);
    b.kernel(Kernel::EmbedFwd {
        batch: 0,
        w,
        x: act(0),
    });
    for i in 0..l {
        let w = b.weights(1 + i, None);
        b.kernel(Kernel::BlockFwd {
            batch: 0,
            layer: i,
            w,
            x: act(i),
            y: act(i + 1),
            keep: None,
        });
    }
    let hw = b.weights(l + 1, None);
    let tied = spec.tied.then(|| b.weights(0, Some(hw)));
    b.kernel(Kernel::HeadLoss {
        batch: 0,
        w: hw,
        tied,
        x: act(l),
    });
    let mut tasks = b.tasks;
    track_hazards(&mut tasks);
    Schedule::of(tasks)
}

/// Whether `eval` uses only buffers `step` allocates.
pub fn evaluation_fits(eval: &Schedule, step: &Schedule) -> bool {
    eval.buffers.iter().all(|b| step.buffers.contains(b))
}
