//! The MPI world (feature `mpi`, the `mpi` crate over the distribution's Open MPI or MPICH): MPI
//! moves the bytes, the sums are ours ([`super::sum_in_rank_order`], in place).
//!
//! `sum_f32` is a reduce-scatter then an all-gather, both as data movement: the buffer is cut
//! into one slice per rank ([`super::order::slice_of`]); `MPI_Alltoallv` hands rank r every
//! rank's copy of slice r; rank r adds them in rank order; `MPI_Allgatherv` hands every rank
//! every summed slice (`reduce_f32`: `MPI_Gatherv` hands them to its root alone). Each rank sends and receives (N−1)/N of the buffer twice, as a ring
//! all-reduce does, and the result is the same bits whatever algorithm MPI picks. Buffers go in
//! chunks of [`CHUNK`] elements into one receive buffer kept for the job's life (one chunk, 16
//! MiB, whatever the unit's size): a fresh buffer per call cost more in page faults and zeroing
//! than the exchange.

use super::order::{slice_of, sum_in_rank_order_in_place, totals_in_rank_order};
use super::shared::SharedSum;
use super::{Collective, StallWatch};
use crate::{Error, Result};
use mpi::datatype::{Partition, PartitionMut};
use mpi::environment::Universe;
use mpi::request::StaticScope;
use mpi::topology::SimpleCommunicator;
use mpi::traits::*;
use mpi::{Count, Threading};
use std::sync::Mutex;

/// Bytes per message of a broadcast or send (counts are 32-bit).
const MESSAGE: usize = 1 << 30;

/// Elements summed per exchange (16 MiB of f32).
const CHUNK: usize = 1 << 22;

/// The job's world communicator.
pub(super) struct MpiWorld {
    world: SimpleCommunicator,
    rank: usize,
    size: usize,
    host: String,
    /// Every call on `world` holds it (MPI provides at least `MPI_THREAD_SERIALIZED`), and with
    /// it the receive buffer of `sum_f32`.
    lock: Mutex<Vec<f32>>,
    /// The collective being waited in and since when ([`Collective::watch`]).
    busy: StallWatch,
    /// A duplicate of the world for the watchdogs' roll calls, which run while a collective
    /// is in progress on the main thread: present when MPI provides `MPI_THREAD_MULTIPLE`.
    roll: Option<SimpleCommunicator>,
    /// Every rank's host, in rank order.
    hosts: Vec<String>,
    /// The sum through a shared window, when every rank runs on this host (dropped — the
    /// window freed — before MPI is finalised: fields drop in order).
    shared: Option<SharedSum>,
    /// Finalises MPI when dropped, after the communicator's last use.
    _universe: Universe,
}

// SAFETY: MPI was initialised with at least MPI_THREAD_SERIALIZED (checked in `init`), which
// allows calls from any thread as long as no two are concurrent: every call on `world` holds
// `lock`, and so does every use of `shared` (its communicator, window and segments). `roll`
// exists only when MPI provided MPI_THREAD_MULTIPLE, under which calls on it may run beside
// those. The communicator handles are plain values valid on every thread until MPI
// is finalised, which happens only when this value (owning the `Universe`) is dropped.
unsafe impl Send for MpiWorld {}
// SAFETY: as for `Send`: shared use of `world` is serialised by `lock`; `roll` needs none.
unsafe impl Sync for MpiWorld {}

impl std::fmt::Debug for MpiWorld {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "MpiWorld(rank {} of {} on {})",
            self.rank, self.size, self.host
        )
    }
}

fn count(n: usize) -> Result<Count> {
    Count::try_from(n).map_err(|_| Error::internal("mpi", format!("{n} elements in one call")))
}

impl MpiWorld {
    /// Initialise MPI (once per process) and take its world.
    pub(super) fn init() -> Result<Self> {
        let (universe, provided) = mpi::initialize_with_threading(Threading::Multiple)
            .ok_or_else(|| Error::internal("mpi", "MPI was already initialised"))?;
        if provided < Threading::Serialized {
            return Err(Error::system(
                "mpi",
                "MPI_Init_thread",
                format!("the MPI library provides {provided:?} threading, below the Serialized megatrain needs"),
            )
            .with_fix("use an MPI library built with thread support (Debian's Open MPI and MPICH are)"));
        }
        let world = universe.world();
        let rank = usize::try_from(world.rank()).unwrap_or(0);
        let size = usize::try_from(world.size()).unwrap_or(1);
        let host = mpi::environment::processor_name().unwrap_or_else(|_| super::hostname());
        // Collective: every rank duplicates the world, or none does (the same library).
        let roll = (provided >= Threading::Multiple).then(|| world.duplicate());
        let mut w = MpiWorld {
            world,
            rank,
            size,
            host: host.clone(),
            lock: Mutex::new(Vec::new()),
            busy: StallWatch::default(),
            roll,
            hosts: Vec::new(),
            shared: None,
            _universe: universe,
        };
        w.hosts = w
            .all_gather_bytes(host.as_bytes())?
            .iter()
            .map(|h| String::from_utf8_lossy(h).into_owned())
            .collect();
        // Through shared memory unless a rank's MEGATRAIN_SHARED_SUM=0 says otherwise (every
        // rank must take the same path: they agree on it first).
        let off = std::env::var("MEGATRAIN_SHARED_SUM").is_ok_and(|v| v == "0");
        let all_on = w
            .all_gather_bytes(&[u8::from(!off)])?
            .iter()
            .all(|b| b.first() == Some(&1));
        if all_on {
            w.shared = SharedSum::map(&w.world, CHUNK)?;
        }
        Ok(w)
    }

    /// Rank `r` of the job, as MPI counts ranks.
    fn peer(&self, r: usize) -> Result<Count> {
        match r < self.size {
            true => count(r),
            false => Err(Error::internal(
                "mpi",
                format!("rank {r} of a job of {} ranks", self.size),
            )),
        }
    }

    /// Hold the MPI lock for collective `what`, marked busy (for the watchdog) until dropped.
    fn enter(&self, what: &'static str) -> Busy<'_> {
        let serial = crate::util::lock(&self.lock);
        self.busy.set(Some(what));
        Busy {
            world: self,
            serial,
        }
    }

    /// One chunk of `sum_f32` (`to`: `None`), or of `reduce_f32` to rank `to`: every rank's
    /// summed slice handed to every rank, or gathered to that one.
    fn sum_chunk(&self, chunk: &mut [f32], recv: &mut Vec<f32>, to: Option<usize>) -> Result<()> {
        let (m, n) = (chunk.len(), self.size);
        let mut counts = Vec::with_capacity(n);
        let mut displs = Vec::with_capacity(n);
        for r in 0..n {
            let s = slice_of(m, n, r);
            counts.push(count(s.len())?);
            displs.push(count(s.start)?);
        }
        let mine = slice_of(m, n, self.rank).len();
        // Grown once (its zeroing and page faults paid once); every element is written below.
        if recv.len() < mine * n {
            recv.resize(mine * n, 0.0);
        }
        let recv = &mut recv[..mine * n];
        let recv_counts = vec![count(mine)?; n];
        let recv_displs = (0..n)
            .map(|k| count(k * mine))
            .collect::<Result<Vec<_>>>()?;
        {
            let send = Partition::new(&*chunk, &counts[..], &displs[..]);
            let mut into = PartitionMut::new(&mut *recv, &recv_counts[..], &recv_displs[..]);
            self.world.all_to_all_varcount_into(&send, &mut into);
        }
        sum_in_rank_order_in_place(recv, mine);
        match to {
            None => {
                let mut into = PartitionMut::new(chunk, &counts[..], &displs[..]);
                self.world
                    .all_gather_varcount_into(&recv[..mine], &mut into);
            }
            Some(root) => {
                let at = self.world.process_at_rank(self.peer(root)?);
                match root == self.rank {
                    true => {
                        let mut into = PartitionMut::new(chunk, &counts[..], &displs[..]);
                        at.gather_varcount_into_root(&recv[..mine], &mut into);
                    }
                    false => at.gather_varcount_into(&recv[..mine]),
                }
            }
        }
        Ok(())
    }
}

impl MpiWorld {
    /// `sum_f32` (`to`: `None`) or `reduce_f32` to rank `to`, chunk by chunk.
    fn sum_to(&self, buf: &mut [f32], to: Option<usize>) -> Result<()> {
        let mut busy = self.enter("the gradients' sum");
        match &self.shared {
            Some(shared) => {
                for chunk in buf.chunks_mut(shared.capacity()) {
                    shared.sum(chunk, to)?;
                }
            }
            None => {
                for chunk in buf.chunks_mut(CHUNK) {
                    self.sum_chunk(chunk, &mut busy.serial, to)?;
                }
            }
        }
        Ok(())
    }
}

/// A collective in progress: the MPI lock held, the watchdog told.
struct Busy<'a> {
    world: &'a MpiWorld,
    /// The lock, and `sum_f32`'s receive buffer.
    serial: std::sync::MutexGuard<'a, Vec<f32>>,
}

impl Drop for Busy<'_> {
    fn drop(&mut self) {
        self.world.busy.set(None);
    }
}

impl Collective for MpiWorld {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn host(&self) -> &str {
        &self.host
    }
    fn hosts(&self) -> &[String] {
        &self.hosts
    }

    fn sum_f32(&self, buf: &mut [f32]) -> Result<()> {
        self.sum_to(buf, None)
    }

    fn reduce_f32(&self, root: usize, buf: &mut [f32]) -> Result<()> {
        self.peer(root)?;
        self.sum_to(buf, Some(root))
    }

    fn sum_f64(&self, buf: &mut [f64]) -> Result<()> {
        let _busy = self.enter("a step's totals");
        let n = buf.len();
        let mut all = vec![0.0f64; n * self.size];
        self.world.all_gather_into(&*buf, &mut all[..]);
        totals_in_rank_order(&all, buf);
        Ok(())
    }

    fn all_gather_bytes(&self, bytes: &[u8]) -> Result<Vec<Vec<u8>>> {
        let _busy = self.enter("an exchange of settings");
        let mut lens = vec![0u64; self.size];
        self.world
            .all_gather_into(&(bytes.len() as u64), &mut lens[..]);
        let counts = lens
            .iter()
            .map(|&l| count(l as usize))
            .collect::<Result<Vec<_>>>()?;
        let mut displs = Vec::with_capacity(self.size);
        let mut total = 0usize;
        for &l in &lens {
            displs.push(count(total)?);
            total += l as usize;
        }
        // Neither buffer may be an empty slice's dangling pointer: 0x1 is Open MPI's
        // MPI_IN_PLACE, and a receive buffer "in place" is an invalid argument. Empty slices
        // of real allocations instead.
        let mut all = vec![0u8; total.max(1)];
        let send = match bytes.is_empty() {
            true => vec![0u8; 1],
            false => Vec::new(),
        };
        let bytes = match bytes.is_empty() {
            true => &send[..0],
            false => bytes,
        };
        {
            let mut into = PartitionMut::new(&mut all[..total], &counts[..], &displs[..]);
            self.world.all_gather_varcount_into(bytes, &mut into);
        }
        let mut out = Vec::with_capacity(self.size);
        let mut at = 0usize;
        for &l in &lens {
            out.push(all[at..at + l as usize].to_vec());
            at += l as usize;
        }
        Ok(out)
    }

    fn broadcast_bytes(&self, root: usize, buf: &mut [u8]) -> Result<()> {
        let _busy = self.enter("a broadcast of a unit's state");
        let from = self.world.process_at_rank(self.peer(root)?);
        for chunk in buf.chunks_mut(MESSAGE) {
            from.broadcast_into(chunk);
        }
        Ok(())
    }

    fn send_bytes(&self, to: usize, buf: &[u8]) -> Result<()> {
        let _busy = self.enter("sending a unit's state to another rank");
        let dest = self.world.process_at_rank(self.peer(to)?);
        for chunk in buf.chunks(MESSAGE) {
            dest.send(chunk);
        }
        Ok(())
    }

    fn recv_bytes(&self, from: usize, buf: &mut [u8]) -> Result<()> {
        let _busy = self.enter("receiving a unit's state from another rank");
        let src = self.world.process_at_rank(self.peer(from)?);
        for chunk in buf.chunks_mut(MESSAGE) {
            src.receive_into(chunk);
        }
        Ok(())
    }

    fn library_sum_f32(&self, buf: &mut [f32]) -> Result<()> {
        let _busy = self.enter("the library's all-reduce");
        let mut out = vec![0.0f32; buf.len()];
        for (src, dst) in buf.chunks(CHUNK).zip(out.chunks_mut(CHUNK)) {
            self.world
                .all_reduce_into(src, dst, mpi::collective::SystemOperation::sum());
        }
        buf.copy_from_slice(&out);
        Ok(())
    }

    fn library(&self) -> String {
        let v = mpi::environment::library_version().unwrap_or_default();
        // Open MPI's first line names it and its version; MPICH's first line too, with a tab
        // ("MPICH Version:\t4.0.2"): whitespace runs as one space.
        let first = v.lines().next().unwrap_or("MPI");
        first.split_whitespace().collect::<Vec<_>>().join(" ")
    }

    fn sum_path(&self) -> &'static str {
        match self.shared {
            Some(_) => "a shared-memory window (every rank on one host)",
            None => "MPI_Alltoallv + MPI_Allgatherv",
        }
    }

    fn abort(&self, code: i32) -> ! {
        self.world.abort(code)
    }

    fn watch(&self) -> StallWatch {
        self.busy.clone()
    }

    fn answer_roll_calls(&self) {
        let Some(roll) = &self.roll else { return };
        while let Some((msg, status)) = roll.any_process().immediate_matched_probe_with_tag(CALL) {
            let _: (u8, _) = msg.matched_receive();
            let req = roll
                .process_at_rank(status.source_rank())
                .immediate_send_with_tag(StaticScope, &HERE, ANSWER);
            // A tiny message to a rank that is waiting: sent at once (eagerly), or never needed
            // (that rank is ending its process).
            if let Err(pending) = req.test() {
                std::mem::forget(pending);
            }
        }
    }

    fn no_roll_call(&self) -> &'static str {
        "this MPI cannot ask which: no MPI_THREAD_MULTIPLE"
    }

    fn roll_call(&self, within: std::time::Duration) -> Option<Vec<(usize, String)>> {
        let roll = self.roll.as_ref()?;
        let mut pending = Vec::new();
        for r in (0..self.size).filter(|&r| r != self.rank) {
            let Ok(to) = Count::try_from(r) else { continue };
            pending.push(roll.process_at_rank(to).immediate_send_with_tag(
                StaticScope,
                &HERE,
                CALL,
            ));
        }
        let mut answered = vec![false; self.size];
        answered[self.rank] = true;
        let t0 = std::time::Instant::now();
        while t0.elapsed() < within && answered.iter().any(|a| !a) {
            self.answer_roll_calls();
            while let Some((msg, status)) =
                roll.any_process().immediate_matched_probe_with_tag(ANSWER)
            {
                let _: (u8, _) = msg.matched_receive();
                if let Some(a) = usize::try_from(status.source_rank())
                    .ok()
                    .and_then(|r| answered.get_mut(r))
                {
                    *a = true;
                }
            }
            std::thread::sleep(std::time::Duration::from_millis(20));
        }
        // Calls to a rank that never took them stay queued; this process is ending.
        for p in pending {
            if let Err(p) = p.test() {
                std::mem::forget(p);
            }
        }
        Some(
            (0..self.size)
                .filter(|&r| !answered[r])
                .map(|r| (r, self.hosts.get(r).cloned().unwrap_or_default()))
                .collect(),
        )
    }
}

/// Tags of the roll call on its own communicator: a waiting rank's call, and the answer.
const CALL: mpi::Tag = 1;
const ANSWER: mpi::Tag = 2;
/// The one byte a call or an answer carries.
static HERE: u8 = 1;
