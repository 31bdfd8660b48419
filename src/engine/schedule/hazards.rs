//! The hazard tracker: every wait of a step's tasks, derived from what each reads and writes
//! (within a step, and over two steps for the waits across them; the module docs of
//! [`super`] give the semantics).

use super::{Lane, Op, Res, Task};
use std::collections::HashMap;

/// Per resource, its last writer and the readers since.
#[derive(Default, Clone)]
struct Holders {
    writer: Option<usize>,
    readers: Vec<usize>,
}

/// The waits of task `i` given the holders so far, and the holders updated by it.
fn hazards(tasks: &[Task], i: usize, st: &mut HashMap<Res, Holders>) -> Vec<usize> {
    let lane = tasks[i].lane;
    let mut waits: Vec<usize> = Vec::new();
    let mut need = |j: usize| {
        if tasks[j].lane != lane {
            waits.push(j);
        }
    };
    for r in &tasks[i].reads {
        if let Some(w) = st.get(r).and_then(|s| s.writer) {
            need(w);
        }
    }
    for r in &tasks[i].writes {
        if let Some(s) = st.get(r) {
            if let Some(w) = s.writer {
                need(w);
            }
            for &rd in &s.readers {
                need(rd);
            }
        }
    }
    for r in &tasks[i].reads {
        st.entry(*r).or_default().readers.push(i);
    }
    for r in &tasks[i].writes {
        let s = st.entry(*r).or_default();
        s.writer = Some(i);
        s.readers.clear();
    }
    waits.sort_unstable();
    waits.dedup();
    waits
}

/// Fill in `waits` (read-after-write, write-after-read and write-after-write across lanes; each
/// lane runs in submission order) and `prev_waits`: the same tracking over this step following
/// another, keeping the waits that point into the previous one. The host lane counts as one
/// lane, but an `Adam` wait means its job's completion, so host tasks wait on it too.
pub(super) fn track_hazards(tasks: &mut [Task]) {
    let n = tasks.len();
    let mut st: HashMap<Res, Holders> = HashMap::new();
    for i in 0..n {
        let mut w = hazards(tasks, i, &mut st);
        w.extend(adam_waits_on_host(tasks, i));
        w.sort_unstable();
        w.dedup();
        tasks[i].waits = w;
    }
    // A second step, as indices n..2n, after the state the first one left.
    let twice: Vec<Task> = tasks.iter().chain(tasks.iter()).cloned().collect();
    for i in 0..n {
        let w = hazards(&twice, n + i, &mut st);
        let mut prev: Vec<usize> = w.iter().copied().filter(|&j| j < n).collect();
        prev.extend(
            adam_holders(tasks, i)
                .into_iter()
                .filter(|&j| matches!(tasks[j].op, Op::Adam { .. })),
        );
        prev.sort_unstable();
        prev.dedup();
        tasks[i].prev_waits = prev;
    }
}

/// What an AdamW job holds while it runs: what its task reads and writes, except the clip
/// coefficient (read once, when the job is submitted).
fn job_holds(t: &Task) -> impl Iterator<Item = &Res> {
    t.reads.iter().chain(&t.writes).filter(|r| **r != Res::Coef)
}

/// Whether task `t` reads or overwrites what the job of `adam` holds.
pub(super) fn touches_job(adam: &Task, t: &Task) -> bool {
    adam.writes.iter().any(|r| t.reads.contains(r)) || job_holds(adam).any(|r| t.writes.contains(r))
}

/// On the host lane, lane order implies an Adam task was *submitted* before a later host task
/// runs, not that its job finished: a host task that reads or overwrites what an Adam job holds
/// must wait for that job explicitly.
fn adam_waits_on_host(tasks: &[Task], i: usize) -> Vec<usize> {
    if tasks[i].lane != Lane::Host {
        return Vec::new();
    }
    (0..i)
        .filter(|&j| matches!(tasks[j].op, Op::Adam { .. }) && touches_job(&tasks[j], &tasks[i]))
        .collect()
}

/// The previous step's Adam tasks whose jobs host task `i` of the next step touches: the host
/// lane's order does not cover a job still running.
fn adam_holders(tasks: &[Task], i: usize) -> Vec<usize> {
    if tasks[i].lane != Lane::Host {
        return Vec::new();
    }
    (0..tasks.len())
        .filter(|&j| matches!(tasks[j].op, Op::Adam { .. }) && touches_job(&tasks[j], &tasks[i]))
        .collect()
}
