//! Streams, events and the order between them.
//!
//! A stream is a FIFO queue run by its own thread: a command starts when the one before it on
//! the same stream has finished (and, for a wait, when the awaited event's command has). With
//! `CUEMU_DELAYS` each command first sleeps a seeded random time, so a program that works only
//! because one stream happened to be faster stops working here.
//!
//! Every command is checked when it is enqueued, against the happens-before order the program
//! built ([`crate::clock`]): a command touching an allocation that another stream writes (or,
//! for a write, reads) with no event ordering them is a stream hazard, reported with both
//! commands.

use crate::api::{self, cu};
use crate::clock::{self, Access, Clock};
use crate::memory;
use crate::{config, report};
use std::collections::{HashMap, VecDeque};
use std::sync::{Arc, Condvar, Mutex, MutexGuard, OnceLock};
use std::time::{Duration, Instant};

/// Work that runs when the stream reaches it (a copy, a kernel, a GEMM).
pub trait Work: Send {
    /// Do it; an error is already reported (and made sticky) by the time this returns.
    fn run(self: Box<Self>, stream: &Stream);
}

pub enum Cmd {
    Work(Box<dyn Work>),
    HostFn {
        f: unsafe extern "C" fn(*mut libc::c_void),
        data: usize,
    },
    /// Timestamp an event's recording.
    Record(Arc<Mutex<Option<Instant>>>),
    /// Hold the stream until `stream` completed command `seq`.
    Wait {
        stream: Arc<Stream>,
        seq: u64,
    },
}

struct Queued {
    seq: u64,
    cmd: Cmd,
    what: Arc<str>,
    /// Allocation bases and host range bases whose pending count this command holds.
    allocs: Vec<u64>,
    hosts: Vec<usize>,
}

struct State {
    queue: VecDeque<Queued>,
    enqueued: u64,
    completed: u64,
    clock: Clock,
    destroyed: bool,
    rng: u64,
}

pub struct Stream {
    pub agent: usize,
    pub name: String,
    state: Mutex<State>,
    work: Condvar,
    done: Condvar,
}

/// One device access of a command: the allocation (by base) and whether it writes.
#[derive(Debug, Clone, Copy)]
pub struct Touch {
    pub base: u64,
    pub write: bool,
}

fn registry() -> MutexGuard<'static, HashMap<usize, Arc<Stream>>> {
    static R: OnceLock<Mutex<HashMap<usize, Arc<Stream>>>> = OnceLock::new();
    R.get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

/// The handle of the default (null) stream's emulation; CUDA's 0, `CU_STREAM_LEGACY` (1) and
/// `CU_STREAM_PER_THREAD` (2) all map to it.
fn default_stream() -> Arc<Stream> {
    static D: OnceLock<Arc<Stream>> = OnceLock::new();
    D.get_or_init(|| Stream::spawn("the default stream".into()))
        .clone()
}

impl Stream {
    fn spawn(name: String) -> Arc<Stream> {
        static NEXT: Mutex<u64> = Mutex::new(0);
        let n = {
            let mut g = NEXT.lock().unwrap_or_else(|e| e.into_inner());
            *g += 1;
            *g
        };
        let s = Arc::new(Stream {
            agent: clock::new_agent(),
            name,
            state: Mutex::new(State {
                queue: VecDeque::new(),
                enqueued: 0,
                completed: 0,
                clock: Clock::default(),
                destroyed: false,
                rng: config::get().seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) ^ n,
            }),
            work: Condvar::new(),
            done: Condvar::new(),
        });
        let worker = s.clone();
        let _ = std::thread::Builder::new()
            .name(format!("cuemu-stream-{n}"))
            .spawn(move || worker.run_worker());
        s
    }

    fn lock(&self) -> MutexGuard<'_, State> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// The stream behind a handle (0/1/2: the default stream).
    pub fn get(handle: usize) -> Result<Arc<Stream>, i32> {
        if handle <= 2 {
            return Ok(default_stream());
        }
        registry().get(&handle).cloned().ok_or(cu::INVALID_HANDLE)
    }

    /// Destroy: the stream finishes what it holds, then its thread ends.
    pub fn destroy(handle: usize) -> Result<(), i32> {
        let s = registry().remove(&handle).ok_or(cu::INVALID_HANDLE)?;
        s.lock().destroyed = true;
        s.work.notify_all();
        Ok(())
    }

    fn run_worker(self: Arc<Self>) {
        loop {
            let (seq, cmd, what) = {
                let mut g = self.lock();
                loop {
                    if let Some(q) = g.queue.front_mut() {
                        let cmd = std::mem::replace(&mut q.cmd, Cmd::Record(Arc::default()));
                        break (q.seq, cmd, q.what.clone());
                    }
                    if g.destroyed {
                        return;
                    }
                    g = self.work.wait(g).unwrap_or_else(|e| e.into_inner());
                }
            };
            self.delay();
            if api::sticky().is_none() {
                self.execute(cmd, &what);
            }
            // The command's holds on memory are released before its completion is published: a
            // host thread that sees the stream done (a synchronisation) and then frees what the
            // command used must find it free.
            let (allocs, hosts) = {
                let mut g = self.lock();
                match g.queue.front_mut() {
                    Some(q) => (std::mem::take(&mut q.allocs), std::mem::take(&mut q.hosts)),
                    None => (Vec::new(), Vec::new()),
                }
            };
            {
                let mut m = memory::mem();
                for b in allocs {
                    if let Some(a) = m.by_base_mut(b) {
                        a.pending = a.pending.saturating_sub(1);
                    }
                }
                for h in hosts {
                    if let Some(r) = m.host_containing_mut(h, 1) {
                        r.pending = r.pending.saturating_sub(1);
                    }
                }
            }
            {
                let mut g = self.lock();
                g.queue.pop_front();
                g.completed = seq;
            }
            self.done.notify_all();
        }
    }

    fn delay(&self) {
        let max = config::get().delay_us;
        if max == 0 {
            return;
        }
        let us = {
            let mut g = self.lock();
            g.rng ^= g.rng << 13;
            g.rng ^= g.rng >> 7;
            g.rng ^= g.rng << 17;
            g.rng % (max + 1)
        };
        std::thread::sleep(Duration::from_micros(us));
    }

    fn execute(&self, cmd: Cmd, what: &str) {
        match cmd {
            Cmd::Work(w) => w.run(self),
            Cmd::HostFn { f, data } => {
                api::as_host_function(format!("{what} on {}", self.name), || {
                    // SAFETY: the program gave this function and its argument to
                    // cuLaunchHostFunc, to be called once in stream order.
                    unsafe { f(data as *mut libc::c_void) }
                })
            }
            Cmd::Record(slot) => {
                *slot.lock().unwrap_or_else(|e| e.into_inner()) = Some(event_clock());
            }
            Cmd::Wait { stream, seq } => stream.wait_for(seq),
        }
    }

    /// Block until command `seq` of this stream has completed.
    pub fn wait_for(&self, seq: u64) {
        let mut g = self.lock();
        while g.completed < seq {
            g = self.done.wait(g).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Commands enqueued so far, and whether all have completed.
    pub fn progress(&self) -> (u64, bool) {
        let g = self.lock();
        (g.enqueued, g.completed >= g.enqueued)
    }

    pub fn completed(&self, seq: u64) -> bool {
        self.lock().completed >= seq
    }

    /// The stream's clock now (everything enqueued so far).
    pub fn clock(&self) -> Clock {
        self.lock().clock.clone()
    }

    /// Wait for everything enqueued so far; the calling host thread then knows it happened.
    pub fn synchronize(&self) {
        let (seq, clock) = {
            let g = self.lock();
            (g.enqueued, g.clock.clone())
        };
        self.wait_for(seq);
        clock::host_observes(&clock);
    }

    /// Make this stream wait for what `clock` covers (`cuStreamWaitEvent`).
    pub fn inherit(&self, clock: &Clock) {
        self.lock().clock.merge(clock);
    }

    /// Enqueue `cmd`, checking its accesses against the happens-before order. Returns its
    /// sequence number and the stream's clock after it.
    pub fn enqueue(
        self: &Arc<Self>,
        cmd: Cmd,
        what: Arc<str>,
        touches: &[Touch],
        hosts: &[usize],
    ) -> Result<(u64, Clock), i32> {
        let mut g = self.lock();
        if g.destroyed {
            return Err(cu::INVALID_HANDLE);
        }
        g.clock.merge(&clock::host_clock());
        let time = g.clock.tick(self.agent);
        let mut hazard = None;
        let mut freed_use = None;
        let mut allocs = Vec::new();
        let mut host_bases = Vec::new();
        {
            let mut m = memory::mem();
            for t in touches {
                let Some(a) = m.by_base_mut(t.base) else {
                    continue;
                };
                if a.freeing {
                    freed_use.get_or_insert(a.name());
                    continue;
                }
                let acc = Access {
                    agent: self.agent,
                    time,
                    what: Arc::from(format!("{what} on {}", self.name)),
                };
                if let Some(c) = a.log.record(acc, &g.clock, t.write) {
                    hazard.get_or_insert((a.name(), t.write, c));
                }
                a.pending += 1;
                allocs.push(t.base);
                if t.write {
                    a.last_writer = Some(what.clone());
                }
            }
            for &h in hosts {
                if let Some(r) = m.host_containing_mut(h, 1) {
                    r.pending += 1;
                    host_bases.push(r.base);
                }
            }
        }
        if let Some(alloc) = &freed_use {
            report::error(
                "use after free",
                &format!(
                    "{what} on {} uses {alloc}, which cuMemFreeAsync frees earlier in stream order",
                    self.name
                ),
            );
            api::set_sticky(cu::LAUNCH_FAILED);
        }
        let found = hazard.is_some() || freed_use.is_some();
        if let Some((alloc, write, c)) = hazard {
            report::error(
                "stream hazard",
                &format!(
                    "{what} on {} {} {alloc}, which {} {} with no event ordering the two \
                     (a missing cuStreamWaitEvent or synchronisation)",
                    self.name,
                    if write { "writes" } else { "reads" },
                    c.earlier.what,
                    if c.earlier_wrote { "writes" } else { "reads" },
                ),
            );
            api::set_sticky(cu::LAUNCH_FAILED);
            // The command still counts as enqueued, so the stream's bookkeeping stays exact.
        }
        g.enqueued += 1;
        let seq = g.enqueued;
        g.queue.push_back(Queued {
            seq,
            cmd,
            what,
            allocs,
            hosts: host_bases,
        });
        let clock = g.clock.clone();
        drop(g);
        self.work.notify_all();
        if found {
            return Err(cu::LAUNCH_FAILED);
        }
        Ok((seq, clock))
    }

    /// Register a stream created by [`Stream::create`].
    fn register(s: Arc<Stream>) -> usize {
        let h = Arc::as_ptr(&s) as usize;
        registry().insert(h, s);
        h
    }

    /// Create a stream and return its handle.
    pub fn new_handle() -> usize {
        static N: Mutex<u64> = Mutex::new(0);
        let n = {
            let mut g = N.lock().unwrap_or_else(|e| e.into_inner());
            *g += 1;
            *g
        };
        Stream::register(Stream::spawn(format!("stream {n}")))
    }
}

static SYNCHRONIZED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// The time an event records: now, plus `CUEMU_CLOCK_SKIP` once the program has synchronised on
/// an event.
fn event_clock() -> Instant {
    let skip = config::get().clock_skip;
    let now = Instant::now();
    if skip > 0.0 && SYNCHRONIZED.load(std::sync::atomic::Ordering::Acquire) {
        now + Duration::from_secs_f64(skip)
    } else {
        now
    }
}

/// The recording of an event: where and when in stream order.
#[derive(Clone)]
pub struct Recording {
    pub stream: Arc<Stream>,
    pub seq: u64,
    pub clock: Clock,
    pub time: Arc<Mutex<Option<Instant>>>,
}

pub struct Event {
    pub flags: u32,
    pub rec: Mutex<Option<Recording>>,
}

fn events() -> MutexGuard<'static, HashMap<usize, Arc<Event>>> {
    static E: OnceLock<Mutex<HashMap<usize, Arc<Event>>>> = OnceLock::new();
    E.get_or_init(|| Mutex::new(HashMap::new()))
        .lock()
        .unwrap_or_else(|e| e.into_inner())
}

impl Event {
    pub fn create(flags: u32) -> usize {
        let e = Arc::new(Event {
            flags,
            rec: Mutex::new(None),
        });
        let h = Arc::as_ptr(&e) as usize;
        events().insert(h, e);
        h
    }

    pub fn get(handle: usize) -> Result<Arc<Event>, i32> {
        events().get(&handle).cloned().ok_or(cu::INVALID_HANDLE)
    }

    pub fn destroy(handle: usize) -> Result<(), i32> {
        events()
            .remove(&handle)
            .map(|_| ())
            .ok_or(cu::INVALID_HANDLE)
    }

    pub fn recording(&self) -> Option<Recording> {
        self.rec.lock().unwrap_or_else(|e| e.into_inner()).clone()
    }

    /// Record on `stream`: the event completes when everything enqueued there so far has.
    pub fn record(&self, stream: &Arc<Stream>) -> Result<(), i32> {
        let slot = Arc::new(Mutex::new(None));
        let (seq, clock) = stream.enqueue(
            Cmd::Record(slot.clone()),
            Arc::from("an event record"),
            &[],
            &[],
        )?;
        *self.rec.lock().unwrap_or_else(|e| e.into_inner()) = Some(Recording {
            stream: stream.clone(),
            seq,
            clock,
            time: slot,
        });
        Ok(())
    }

    /// Whether it completed; if so the calling host thread now knows what it covers.
    pub fn query(&self) -> bool {
        match self.recording() {
            None => true,
            Some(r) => {
                let done = r.stream.completed(r.seq);
                if done {
                    clock::host_observes(&r.clock);
                }
                done
            }
        }
    }

    pub fn synchronize(&self) {
        if let Some(r) = self.recording() {
            r.stream.wait_for(r.seq);
            clock::host_observes(&r.clock);
        }
        SYNCHRONIZED.store(true, std::sync::atomic::Ordering::Release);
    }
}

/// `cuCtxSynchronize`: every stream, and the calling thread knows it all happened.
pub fn synchronize_all() {
    let streams: Vec<Arc<Stream>> = registry().values().cloned().collect();
    default_stream().synchronize();
    for s in streams {
        s.synchronize();
    }
}
