//! Per-NUMA-node AdamW worker pools.
//!
//! Each node that holds optimizer state gets worker threads pinned to its CPUs. One unit's update
//! is one job: [`AdamPool::submit`] takes the unit's [`UnitGuard`] (and, in lean mode, the
//! gradient buffer), splits the unit into one contiguous chunk per worker, and returns an
//! [`AdamJob`] the streamer can poll or wait on. The guard travels with the job, so the shards are
//! exclusively the pool's until the job completes and hands them back.

use super::adamw::{self, AdamWConfig, Isa, StepScalars};
use super::moments::{self, MomentPtrs, ParamPtr, Piece, Salts};
use crate::store::layout::{AdamState, StateLayout, INT8_BLOCK};
use crate::store::placement::Placement;
use crate::store::{HostBuffer, UnitGuard};
use crate::{Error, Result};
use std::ops::Range;
use std::sync::mpsc::{channel, Sender};
use std::sync::{Arc, Condvar, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// Chunks handed to workers start at multiples of this many elements (256 B: whole cache lines
/// and SIMD vectors, so workers never share a line).
const CHUNK_ALIGN: usize = 64;

/// An update's Σg² is taken per block of this many elements from the job's first (a multiple
/// of every chunk alignment), and the blocks' sums are added in order: the same bits however
/// many workers split the job — so ranks with different CPU shares, and a run on another
/// machine, compute the same lean-mode norm. Workers' chunks are whole blocks.
const SUM_BLOCK: usize = 1 << 14;
const _: () =
    assert!(SUM_BLOCK.is_multiple_of(INT8_BLOCK) && SUM_BLOCK.is_multiple_of(CHUNK_ALIGN));

/// The chunk alignment of an update with moments stored as `state`: int8 moments at whole
/// quantisation blocks.
fn chunk_align(state: AdamState) -> usize {
    match state {
        AdamState::Int8 => INT8_BLOCK,
        AdamState::Fp32 | AdamState::Bf16 => CHUNK_ALIGN,
    }
}

/// A range of a unit updated with one set of scalars (one tensor, with its padding).
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Segment {
    /// First element.
    pub start: usize,
    /// One past the last element.
    pub end: usize,
    /// The step's scalars for this tensor.
    pub scalars: StepScalars,
}

/// The per-tensor scalars of one unit's update at step `t`.
///
/// `decay_norms = false` exempts 1-D tensors (norm weights, biases) from weight decay.
pub fn unit_segments(
    layout: &StateLayout,
    unit: usize,
    cfg: &AdamWConfig,
    t: u64,
    grad_scale: f32,
    decay_norms: bool,
) -> Vec<Segment> {
    let u = &layout.units[unit];
    u.tensors
        .iter()
        .enumerate()
        .map(|(i, tensor)| Segment {
            start: tensor.offset,
            end: u.tensors.get(i + 1).map_or(u.numel, |n| n.offset),
            scalars: StepScalars::new(cfg, t, decay_norms || tensor.shape.len() > 1, grad_scale),
        })
        .collect()
}

/// `segments` (of a whole unit) cut to the elements `range`: the segments of a piece's update.
pub fn piece_segments(segments: &[Segment], range: Range<usize>) -> Vec<Segment> {
    segments
        .iter()
        .filter(|s| s.start < range.end && s.end > range.start)
        .map(|s| Segment {
            start: s.start.max(range.start),
            end: s.end.min(range.end),
            scalars: s.scalars,
        })
        .collect()
}

#[derive(Debug, Clone, Copy)]
struct Ptrs {
    p: ParamPtr,
    /// The gradient of element `first`, the job's first (a lean piece's buffer starts there).
    g: *const f32,
    first: usize,
    moments: MomentPtrs,
}

// SAFETY: the pointers target shards that the submitting job keeps alive and exclusive (it holds
// the unit guard and the gradient buffer) until every task has reported completion; tasks work on
// disjoint ranges.
unsafe impl Send for Ptrs {}

#[derive(Debug)]
enum Work {
    Adam {
        ptrs: Ptrs,
        segments: Arc<[Segment]>,
    },
    /// STREAM triad a = b + s·c, for the bandwidth reference.
    Triad {
        a: *mut f32,
        b: *const f32,
        c: *const f32,
        s: f32,
    },
}

// SAFETY: as for `Ptrs`: the submitter keeps the memory alive until completion; ranges disjoint.
unsafe impl Send for Work {}

#[derive(Debug)]
struct Task {
    work: Work,
    start: usize,
    end: usize,
    isa: Isa,
    /// Its index in the job: partial sums are added in this order, whatever order tasks end in.
    part: usize,
    /// The job's first element: Σg² blocks ([`SUM_BLOCK`]) count from it.
    first: usize,
    done: Arc<Completion>,
}

#[derive(Debug, Default)]
struct State {
    remaining: usize,
    /// Each task's Σ g² of each of its [`SUM_BLOCK`]s, by part.
    sums: Vec<Vec<f64>>,
    failure: Option<String>,
    /// The unit, when the job handed it to the stager (spilled units).
    guard: Option<UnitGuard>,
}

/// What runs when the last task of a job finishes (staged jobs: unstage and hand back), with the
/// job's blocks' Σ g² in order.
type OnDone = Box<dyn FnOnce(Vec<f64>, Option<String>) + Send>;

struct Completion {
    state: Mutex<State>,
    cv: Condvar,
    started: Instant,
    on_done: Mutex<Option<OnDone>>,
}

impl std::fmt::Debug for Completion {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Completion").finish_non_exhaustive()
    }
}

impl Completion {
    fn new(tasks: usize) -> Arc<Self> {
        Self::with_on_done(tasks, None)
    }

    fn with_on_done(tasks: usize, on_done: Option<OnDone>) -> Arc<Self> {
        Arc::new(Completion {
            state: Mutex::new(State {
                remaining: tasks,
                sums: vec![Vec::new(); tasks],
                ..State::default()
            }),
            cv: Condvar::new(),
            started: Instant::now(),
            on_done: Mutex::new(on_done),
        })
    }

    /// Task `part` is done, with the Σ g² of each of its blocks.
    fn finish(&self, part: usize, sumsq: Vec<f64>, failure: Option<String>) {
        let mut s = crate::util::lock(&self.state);
        s.remaining -= 1;
        if let Some(x) = s.sums.get_mut(part) {
            *x = sumsq;
        }
        if s.failure.is_none() {
            s.failure = failure;
        }
        if s.remaining == 0 {
            let cb = crate::util::lock(&self.on_done).take();
            match cb {
                Some(cb) => {
                    let (sumsq, failure) = (s.sums.concat(), s.failure.take());
                    drop(s);
                    cb(sumsq, failure);
                }
                None => self.cv.notify_all(),
            }
        }
    }

    /// Hand the unit back to whoever waits on this completion.
    fn put_guard(&self, g: UnitGuard) {
        crate::util::lock(&self.state).guard = Some(g);
    }

    fn take_guard(&self) -> Option<UnitGuard> {
        crate::util::lock(&self.state).guard.take()
    }

    fn wait(&self) -> (f64, Option<String>) {
        let mut s = crate::util::lock(&self.state);
        while s.remaining > 0 {
            s = self.cv.wait(s).unwrap_or_else(|e| e.into_inner());
        }
        // Block by block, in order (a left fold): the same bits whatever the split.
        (s.sums.iter().flatten().sum(), s.failure.take())
    }

    fn is_done(&self) -> bool {
        self.state.lock().map_or(true, |s| s.remaining == 0)
    }
}

/// Task `task`'s work, with the Σ g² of each of its [`SUM_BLOCK`]s (none for a triad).
fn run_task(task: &Task) -> Vec<f64> {
    match &task.work {
        Work::Adam { ptrs, segments } => {
            let pieces: Vec<Piece<'_>> = segments
                .iter()
                .filter(|seg| seg.start < task.end && seg.end > task.start)
                .map(|seg| Piece {
                    range: seg.start..seg.end,
                    scalars: &seg.scalars,
                })
                .collect();
            let mut sums = Vec::with_capacity((task.end - task.start).div_ceil(SUM_BLOCK));
            let mut at = task.start;
            while at < task.end {
                let end =
                    (task.first + ((at - task.first) / SUM_BLOCK + 1) * SUM_BLOCK).min(task.end);
                // SAFETY: the task's range lies inside the job's (segments tile it), so its
                // gradients are `at - first` past the job's first; each block starts on a chunk
                // boundary or a SUM_BLOCK boundary from the job's first (whole int8 blocks), and
                // no other task touches it; the memory is kept alive and exclusive by the job.
                sums.push(unsafe {
                    moments::step_range(
                        task.isa,
                        ptrs.p,
                        ptrs.g.add(at - ptrs.first),
                        ptrs.moments,
                        at..end,
                        &pieces,
                    )
                });
                at = end;
            }
            sums
        }
        Work::Triad { a, b, c, s } => {
            let n = task.end - task.start;
            // SAFETY: the range is this task's alone; the bench keeps the arrays alive.
            let (a, b, c) = unsafe {
                (
                    std::slice::from_raw_parts_mut(a.add(task.start), n),
                    std::slice::from_raw_parts(b.add(task.start), n),
                    std::slice::from_raw_parts(c.add(task.start), n),
                )
            };
            adamw::triad(task.isa, a, b, c, *s);
            Vec::new()
        }
    }
}

#[derive(Debug)]
struct NodeWorkers {
    node: u32,
    senders: Vec<Sender<Task>>,
    handles: Vec<JoinHandle<()>>,
}

/// A job for a unit whose optimizer state is on NVMe: the stager stages it, then dispatches.
struct StageJob {
    guard: UnitGuard,
    /// Lean-mode gradient buffer (null: the unit's own gradient shard).
    grads: GradPtr,
    /// The elements it updates (a lean piece, or the whole unit).
    range: Range<usize>,
    segments: Arc<[Segment]>,
    salts: Salts,
    senders: Vec<Sender<Task>>,
    isa: Isa,
    outer: Arc<Completion>,
}

#[derive(Debug, Clone, Copy)]
struct GradPtr(*const f32);

// SAFETY: the buffer behind it is owned by the job's `AdamJob`, which waits for completion
// before releasing it.
unsafe impl Send for GradPtr {}

/// Worker pools, one per NUMA node holding optimizer state, plus the stager for spilled units.
#[derive(Debug)]
pub struct AdamPool {
    nodes: Vec<NodeWorkers>,
    isa: Isa,
    stager: Option<Sender<StageJob>>,
    stager_thread: Option<JoinHandle<()>>,
}

impl std::fmt::Debug for StageJob {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StageJob")
            .field("unit", &self.guard.unit())
            .finish_non_exhaustive()
    }
}

/// Split the elements `range` (starting at a multiple of `align`) into one range per worker,
/// each starting at a multiple of `align` elements, and send the tasks.
fn dispatch_on(
    senders: &[Sender<Task>],
    isa: Isa,
    (range, align): (Range<usize>, usize),
    work: impl Fn() -> Work,
    on_done: Option<OnDone>,
) -> Arc<Completion> {
    let chunk = range.len().div_ceil(senders.len().max(1)).div_ceil(align) * align;
    let at = |i: usize| (range.start + i * chunk).min(range.end);
    let ranges: Vec<(usize, usize)> = (0..senders.len())
        .map(|i| (at(i), at(i + 1)))
        .filter(|(a, b)| a < b)
        .collect();
    let completion = Completion::with_on_done(ranges.len().max(1), on_done);
    if ranges.is_empty() {
        completion.finish(0, Vec::new(), None);
    }
    for (i, (start, end)) in ranges.into_iter().enumerate() {
        let task = Task {
            work: work(),
            start,
            end,
            isa,
            part: i,
            first: range.start,
            done: completion.clone(),
        };
        if senders[i].send(task).is_err() {
            completion.finish(i, Vec::new(), Some("worker thread is gone".into()));
        }
    }
    completion
}

/// The pointers of a job over the unit's elements from `first`; `lean`, a buffer holding the
/// gradients from `first` on.
fn unit_ptrs(
    guard: &mut UnitGuard,
    (lean, first): (Option<*const f32>, usize),
    salts: Salts,
) -> Result<Ptrs> {
    let unit = guard.unit();
    let (state, numel) = (guard.store().layout().adam, guard.numel());
    let mut sh = guard.shards()?;
    let g: *const f32 = match (lean, sh.grads) {
        (Some(b), _) => b,
        (None, Some(g)) => g[first..].as_ptr(),
        (None, None) => {
            return Err(Error::bad_input(
                "AdamW job",
                format!("unit {unit}"),
                "lean mode needs a gradient buffer",
                None,
            ))
        }
    };
    Ok(Ptrs {
        p: ParamPtr::of(&mut sh.params),
        g,
        first,
        moments: MomentPtrs::new(state, sh.m.as_mut_ptr(), sh.v.as_mut_ptr(), numel, salts),
    })
}

/// The stager: stage each spilled unit (waiting for its read), prefetch the next queued one,
/// dispatch the update; the last task unstages (write-back starts) and hands the unit back.
fn stager_loop(rx: &std::sync::mpsc::Receiver<StageJob>) {
    let mut backlog = std::collections::VecDeque::new();
    loop {
        if backlog.is_empty() {
            match rx.recv() {
                Ok(j) => backlog.push_back(j),
                Err(_) => return,
            }
        }
        while let Ok(j) = rx.try_recv() {
            backlog.push_back(j);
        }
        let Some(mut job) = backlog.pop_front() else {
            continue;
        };
        let staged = job.guard.stage();
        if let Some(next) = backlog.front() {
            next.guard.store().prefetch(next.guard.unit());
        }
        let lean = (!job.grads.0.is_null()).then_some(job.grads.0);
        let ptrs = match staged
            .and_then(|()| unit_ptrs(&mut job.guard, (lean, job.range.start), job.salts))
        {
            Ok(p) => p,
            Err(e) => {
                // A piece after the first leaves state its earlier pieces updated: write it back.
                if job.range.start > 0 {
                    job.guard.unstage();
                } else {
                    job.guard.unstage_clean();
                }
                job.outer.put_guard(job.guard);
                job.outer.finish(0, Vec::new(), Some(e.to_string()));
                continue;
            }
        };
        // A piece before the unit's last leaves it staged for the next: it is written back once.
        let last = job.range.end == job.guard.numel();
        // Whole Σg² blocks from the job's first element (which starts on a chunk boundary).
        let sizes = (job.range.clone(), SUM_BLOCK);
        let (mut guard, outer) = (job.guard, job.outer.clone());
        let on_done: OnDone = Box::new(move |sumsq, failure| {
            if last || failure.is_some() {
                guard.unstage();
            }
            outer.put_guard(guard);
            outer.finish(0, sumsq, failure);
        });
        let segments = job.segments.clone();
        dispatch_on(
            &job.senders,
            job.isa,
            sizes,
            || Work::Adam {
                ptrs,
                segments: segments.clone(),
            },
            Some(on_done),
        );
    }
}

/// What a finished job hands back.
#[derive(Debug)]
pub struct AdamDone {
    /// The unit, exclusively the caller's again.
    pub guard: UnitGuard,
    /// The lean-mode gradient buffer, if one was passed in.
    pub grads: Option<HostBuffer>,
    /// Σ g_raw² over the unit (before clipping), f64.
    pub sumsq: f64,
    /// Wall time from submission to completion.
    pub elapsed: Duration,
}

/// One unit's update in flight. Dropping it waits for completion.
#[derive(Debug)]
pub struct AdamJob {
    guard: Option<UnitGuard>,
    grads: Option<HostBuffer>,
    done: Arc<Completion>,
}

impl AdamJob {
    /// True once every worker has finished its chunk.
    pub fn is_done(&self) -> bool {
        self.done.is_done()
    }

    /// Block until the update is complete and take the unit back.
    pub fn wait(mut self) -> Result<AdamDone> {
        let (sumsq, failure) = self.done.wait();
        let elapsed = self.done.started.elapsed();
        let guard = self
            .guard
            .take()
            .or_else(|| self.done.take_guard())
            .ok_or_else(|| Error::system("AdamW pool", "wait", "job already consumed"))?;
        if let Some(f) = failure {
            return Err(Error::system("AdamW worker", "update", f));
        }
        Ok(AdamDone {
            guard,
            grads: self.grads.take(),
            sumsq,
            elapsed,
        })
    }
}

impl Drop for AdamJob {
    fn drop(&mut self) {
        // The guard (and buffer) must outlive the workers' use of the memory.
        self.done.wait();
    }
}

/// A triad run in flight (bench only). Dropping it waits.
#[derive(Debug)]
pub struct TriadJob(Arc<Completion>);

impl TriadJob {
    /// Block until done.
    pub fn wait(self) {
        self.0.wait();
    }
}

impl Drop for TriadJob {
    fn drop(&mut self) {
        self.0.wait();
    }
}

impl AdamPool {
    /// Start `threads` workers (default: one per CPU) for each `(node, cpus)`, worker i pinned to
    /// `cpus[i % len]`. Uses the best SIMD path of this CPU.
    pub fn new(nodes: &[(u32, Vec<usize>)], threads: Option<usize>) -> Result<Self> {
        Self::with_isa(nodes, threads, adamw::detect())
    }

    /// As [`AdamPool::new`] with a chosen implementation (benchmarks and tests).
    pub fn with_isa(nodes: &[(u32, Vec<usize>)], threads: Option<usize>, isa: Isa) -> Result<Self> {
        let mut out = Vec::new();
        for (node, cpus) in nodes {
            let n = threads.unwrap_or(cpus.len()).max(1);
            let mut senders = Vec::new();
            let mut handles = Vec::new();
            for i in 0..n {
                let (tx, rx) = channel::<Task>();
                let cpu = cpus.get(i % cpus.len().max(1)).copied();
                let h = std::thread::Builder::new()
                    .name(format!("adamw-n{node}-{i}"))
                    .spawn(move || {
                        if let Some(cpu) = cpu {
                            // Best effort: a cgroup may forbid it; the work is still correct.
                            let _ = crate::host::affinity::pin_current_thread(&[cpu]);
                        }
                        while let Ok(task) = rx.recv() {
                            let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| {
                                run_task(&task)
                            }));
                            match r {
                                Ok(s) => task.done.finish(task.part, s, None),
                                Err(_) => task.done.finish(
                                    task.part,
                                    Vec::new(),
                                    Some("worker panicked".into()),
                                ),
                            }
                        }
                    })
                    .map_err(|e| Error::system("std::thread", "spawn AdamW worker", e))?;
                senders.push(tx);
                handles.push(h);
            }
            out.push(NodeWorkers {
                node: *node,
                senders,
                handles,
            });
        }
        let (tx, rx) = channel::<StageJob>();
        let stager = std::thread::Builder::new()
            .name("adamw-stager".into())
            .spawn(move || stager_loop(&rx))
            .map_err(|e| Error::system("std::thread", "spawn the AdamW stager", e))?;
        Ok(AdamPool {
            nodes: out,
            isa,
            stager: Some(tx),
            stager_thread: Some(stager),
        })
    }

    /// One pool per node that holds optimizer state in `placement`.
    pub fn for_placement(placement: &Placement, threads: Option<usize>) -> Result<Self> {
        Self::new(&placement.adam_nodes(), threads)
    }

    /// The SIMD path the workers use.
    pub fn isa(&self) -> Isa {
        self.isa
    }

    /// Workers on `node`.
    pub fn threads_on(&self, node: u32) -> usize {
        self.nodes
            .iter()
            .find(|n| n.node == node)
            .map_or(0, |n| n.senders.len())
    }

    fn workers(&self, node: u32) -> Result<&NodeWorkers> {
        self.nodes.iter().find(|n| n.node == node).ok_or_else(|| {
            Error::bad_input("AdamW pool", format!("node {node}"), "has no workers", None)
        })
    }

    fn dispatch(
        &self,
        node: u32,
        sizes: (Range<usize>, usize),
        work: impl Fn() -> Work,
    ) -> Result<Arc<Completion>> {
        let w = self.workers(node)?;
        Ok(dispatch_on(&w.senders, self.isa, sizes, work, None))
    }

    /// Update one unit, or a piece of it, on `node`'s workers. `segments` come from
    /// [`unit_segments`], whole or [`piece_segments`]: the job updates the elements they cover.
    /// `grads` is the lean-mode buffer holding those elements' gradients from its start; `None`
    /// uses the unit's gradient shard (exact mode). `salts` seed the stochastic rounding of bf16
    /// moments ([`Salts::new`]). A spilled unit updated in pieces stays staged from its first
    /// piece to its last, and is written back once.
    pub fn submit(
        &self,
        node: u32,
        mut guard: UnitGuard,
        grads: Option<HostBuffer>,
        segments: Vec<Segment>,
        salts: Salts,
    ) -> Result<AdamJob> {
        let (numel, unit) = (guard.numel(), guard.unit());
        let align = chunk_align(guard.store().layout().adam);
        let range = segments.first().map_or(0, |s| s.start)..segments.last().map_or(0, |s| s.end);
        let tiled = segments.windows(2).all(|w| w[0].end == w[1].start);
        if range.is_empty() || range.end > numel || !tiled || range.start % align != 0 {
            return Err(Error::bad_input(
                "AdamW segments",
                format!("unit {unit}"),
                format!(
                    "cover {range:?} of its {numel} elements: not one run from a multiple of {align}"
                ),
                None,
            ));
        }
        if let Some(b) = &grads {
            if b.len() < range.len() {
                return Err(Error::bad_input(
                    "gradient buffer",
                    format!("unit {unit}"),
                    format!(
                        "holds {} elements, the update needs {}",
                        b.len(),
                        range.len()
                    ),
                    None,
                ));
            }
        }
        let segments: Arc<[Segment]> = segments.into();
        if guard.store().is_spilled(guard.unit()) {
            let senders = self.workers(node)?.senders.clone();
            let outer = Completion::new(1);
            let job = StageJob {
                grads: GradPtr(grads.as_ref().map_or(std::ptr::null(), |b| b.as_ptr())),
                range,
                guard,
                segments,
                salts,
                senders,
                isa: self.isa,
                outer: outer.clone(),
            };
            self.stager
                .as_ref()
                .and_then(|s| s.send(job).ok())
                .ok_or_else(|| Error::system("AdamW pool", "submit", "the stager is gone"))?;
            return Ok(AdamJob {
                guard: None,
                grads,
                done: outer,
            });
        }
        let lean = grads.as_ref().map(|b| b.as_ptr());
        let ptrs = unit_ptrs(&mut guard, (lean, range.start), salts)?;
        // Whole Σg² blocks from the job's first element (checked on a chunk boundary above).
        let done = self.dispatch(node, (range, SUM_BLOCK), || Work::Adam {
            ptrs,
            segments: segments.clone(),
        })?;
        Ok(AdamJob {
            guard: Some(guard),
            grads,
            done,
        })
    }

    /// STREAM triad `a = b + s·c` over `n` elements on `node`'s workers (the bandwidth reference
    /// for `bench adam`).
    ///
    /// # Safety
    /// `a`, `b`, `c` must be valid for `n` elements, `a` must not overlap `b` or `c`, and all three
    /// must stay alive and untouched by anyone else until the returned job is dropped or waited.
    pub unsafe fn triad(
        &self,
        node: u32,
        a: *mut f32,
        b: *const f32,
        c: *const f32,
        s: f32,
        n: usize,
    ) -> Result<TriadJob> {
        let done = self.dispatch(node, (0..n, CHUNK_ALIGN), || Work::Triad { a, b, c, s })?;
        Ok(TriadJob(done))
    }
}

impl Drop for AdamPool {
    fn drop(&mut self) {
        self.stager = None; // the stager exits once its queue is empty
        if let Some(h) = self.stager_thread.take() {
            let _ = h.join();
        }
        for n in &mut self.nodes {
            n.senders.clear(); // closes the channels; workers exit their loops
            for h in n.handles.drain(..) {
                let _ = h.join();
            }
        }
    }
}
