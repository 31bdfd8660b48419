//! Progress of the long phases around a step — preparing data, loading a model, placing the
//! store, writing and reading checkpoints, exporting — reported by the library to whoever listens
//! (the command line draws it: a bar with a rate and an ETA on a terminal, plain lines
//! otherwise), without the library printing. With no listener a [`Meter`] costs an atomic add.

use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::time::{Duration, Instant};

/// What a phase counts.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Unit {
    /// Bytes.
    Bytes,
    /// Records (documents, rows).
    Records,
}

/// One report about a phase.
#[derive(Debug, Clone, Copy)]
pub struct Event<'a> {
    /// The phase ("checkpoint write", …).
    pub phase: &'a str,
    /// Done so far.
    pub done: u64,
    /// The whole (0: not known).
    pub total: u64,
    /// What is counted.
    pub unit: Unit,
    /// Since the phase started.
    pub elapsed: Duration,
    /// Running, or how it ended (its last report).
    pub state: State,
}

/// Where a phase is.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum State {
    /// Under way.
    Running,
    /// Finished ([`Meter::finish`]).
    Done,
    /// Stopped before it finished (an error).
    Stopped,
}

type Sink = Box<dyn Fn(&Event<'_>) + Send + Sync>;

static SINK: OnceLock<Sink> = OnceLock::new();

/// Send every phase's reports to `sink` (the first call wins; the command line makes it).
pub fn set_sink(sink: impl Fn(&Event<'_>) + Send + Sync + 'static) {
    let _ = SINK.set(Box::new(sink));
}

/// Reports between two of a meter's at most this often (its end is always reported).
const EVERY: Duration = Duration::from_millis(200);

/// A running phase: [`Meter::add`] as work is done, [`Meter::finish`] at its end (dropped
/// unfinished, it reports that it stopped).
#[derive(Debug)]
pub struct Meter {
    phase: String,
    total: u64,
    unit: Unit,
    started: Instant,
    done: AtomicU64,
    last: Mutex<Instant>,
    ended: bool,
}

impl Meter {
    /// Start phase `phase` of `total` `unit`s (0: unknown).
    pub fn start(phase: impl Into<String>, total: u64, unit: Unit) -> Self {
        let now = Instant::now();
        let m = Meter {
            phase: phase.into(),
            total,
            unit,
            started: now,
            done: AtomicU64::new(0),
            last: Mutex::new(now),
            ended: false,
        };
        m.report(0, State::Running);
        m
    }

    /// `n` more done (callable from any thread).
    pub fn add(&self, n: u64) {
        let done = self.done.fetch_add(n, Ordering::Relaxed) + n;
        if SINK.get().is_none() {
            return;
        }
        let now = Instant::now();
        let mut last = crate::util::lock(&self.last);
        if now.duration_since(*last) >= EVERY {
            *last = now;
            drop(last);
            self.report(done, State::Running);
        }
    }

    /// The phase is done.
    pub fn finish(mut self) {
        self.ended = true;
        self.report(self.done.load(Ordering::Relaxed), State::Done);
    }

    fn report(&self, done: u64, state: State) {
        if let Some(sink) = SINK.get() {
            sink(&Event {
                phase: &self.phase,
                done,
                total: self.total,
                unit: self.unit,
                elapsed: self.started.elapsed(),
                state,
            });
        }
    }
}

impl Drop for Meter {
    fn drop(&mut self) {
        if !self.ended {
            self.report(self.done.load(Ordering::Relaxed), State::Stopped);
        }
    }
}
