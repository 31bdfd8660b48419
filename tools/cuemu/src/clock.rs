//! Happens-before, as the program established it: a vector clock per agent (each stream, each
//! host thread that calls the driver). Stream order ticks the stream's own component; an event
//! carries the clock of its stream at record; `cuStreamWaitEvent` merges it into the waiting
//! stream; a host synchronisation (stream, event, context) merges it into the host thread's
//! clock, which every command that thread enqueues inherits. Two commands are ordered only
//! through these edges — not because one happened to finish first.
//!
//! Each device allocation keeps its last write and the reads since; a command that touches it
//! while an unordered write (or, for a write, an unordered read) exists is a stream hazard.

use std::cell::RefCell;
use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

/// A vector clock over agents.
#[derive(Clone, Default, Debug)]
pub struct Clock(Vec<u64>);

impl Clock {
    pub fn get(&self, agent: usize) -> u64 {
        self.0.get(agent).copied().unwrap_or(0)
    }

    /// Advance `agent`'s own component; its new value.
    pub fn tick(&mut self, agent: usize) -> u64 {
        if self.0.len() <= agent {
            self.0.resize(agent + 1, 0);
        }
        self.0[agent] += 1;
        self.0[agent]
    }

    pub fn merge(&mut self, other: &Clock) {
        if self.0.len() < other.0.len() {
            self.0.resize(other.0.len(), 0);
        }
        for (a, b) in self.0.iter_mut().zip(&other.0) {
            *a = (*a).max(*b);
        }
    }

    /// Whether the command `agent` did at `time` happens before whoever holds this clock.
    pub fn covers(&self, agent: usize, time: u64) -> bool {
        self.get(agent) >= time
    }
}

static AGENTS: AtomicUsize = AtomicUsize::new(0);

/// A fresh agent index (a stream or a host thread).
pub fn new_agent() -> usize {
    AGENTS.fetch_add(1, Ordering::Relaxed)
}

thread_local! {
    static HOST: RefCell<Option<(usize, Clock)>> = const { RefCell::new(None) };
}

/// The calling host thread's clock (created on first use).
pub fn host_clock() -> Clock {
    HOST.with(|h| {
        h.borrow_mut()
            .get_or_insert_with(|| (new_agent(), Clock::default()))
            .1
            .clone()
    })
}

/// Merge `c` into the calling host thread's clock: it has observed everything `c` covers.
pub fn host_observes(c: &Clock) {
    HOST.with(|h| {
        h.borrow_mut()
            .get_or_insert_with(|| (new_agent(), Clock::default()))
            .1
            .merge(c)
    });
}

/// One command's access to an allocation.
#[derive(Clone, Debug)]
pub struct Access {
    pub agent: usize,
    pub time: u64,
    /// The command, for reports ("kernel rmsnorm_fwd_f32 (launch #12) on stream 2").
    pub what: Arc<str>,
}

/// The accesses to one allocation that a later command must be ordered after.
#[derive(Debug, Default)]
pub struct AccessLog {
    last_write: Option<Access>,
    /// Reads since the last write, the latest per agent.
    reads: Vec<Access>,
}

/// An unordered pair: the earlier access, and whether it wrote.
pub struct Conflict {
    pub earlier: Access,
    pub earlier_wrote: bool,
}

impl AccessLog {
    /// Record `acc` (which holds `clock`), reading or writing; the first earlier access it is
    /// not ordered after and conflicts with.
    pub fn record(&mut self, acc: Access, clock: &Clock, write: bool) -> Option<Conflict> {
        let mut conflict = None;
        if let Some(w) = &self.last_write {
            if w.agent != acc.agent && !clock.covers(w.agent, w.time) {
                conflict = Some(Conflict {
                    earlier: w.clone(),
                    earlier_wrote: true,
                });
            }
        }
        if write && conflict.is_none() {
            conflict = self
                .reads
                .iter()
                .find(|r| r.agent != acc.agent && !clock.covers(r.agent, r.time))
                .map(|r| Conflict {
                    earlier: r.clone(),
                    earlier_wrote: false,
                });
        }
        if write {
            self.last_write = Some(acc);
            self.reads.clear();
        } else if let Some(r) = self.reads.iter_mut().find(|r| r.agent == acc.agent) {
            *r = acc;
        } else {
            self.reads.push(acc);
        }
        conflict
    }
}
