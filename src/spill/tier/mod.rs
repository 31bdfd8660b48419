//! The NVMe tier of the host store: shards that do not fit in RAM live in an [`ExtentStore`] and
//! are staged through a bounded set of RAM slots.
//!
//! One slot holds all of one unit's spilled shards (Adam m and v). A unit is *leased* while the
//! AdamW pool updates it; releasing a lease writes the slot back asynchronously. One I/O thread
//! owns the extent store and serves reads (prefetches) and write-backs in order, so while unit i
//! is updated, unit i+1 is read and unit i−1 written back — with three slots nothing waits on I/O
//! unless the device is slower than AdamW.
//!
//! Slot life cycle (`State::slots`): Free → Reading(u) → Ready(u) → Leased(u) → Writing(u) →
//! Clean(u) (a cached copy, reusable without a read) → evicted for another unit. A failed write
//! leaves the slot Failed(u): the data stays in RAM, the last good copy stays on disk, and every
//! later use of the unit reports the error.

use super::extents::{ExtentStore, SpillConfig};
use crate::host::{PageKind, Region, RegionSpec};
use crate::{Error, Result};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::{channel, Receiver, Sender};
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::Instant;

/// One unit whose shards live in the tier: what the store tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TierUnit {
    /// The unit's index in the store.
    pub unit: usize,
    /// How errors name it ("layer 3").
    pub label: String,
    /// Its spilled shards, in order: (name for errors, e.g. "adam_m"; bytes, a multiple of
    /// 4 KiB). A lease addresses them by position.
    pub shards: Vec<(&'static str, usize)>,
}

/// Where one spilled shard lives.
#[derive(Debug, Clone)]
struct SpilledShard {
    name: &'static str,
    first_extent: usize,
    bytes: usize,
    /// Offset inside a staging slot.
    slot_offset: usize,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Phase {
    Free,
    Reading(usize),
    Ready(usize),
    Leased(usize),
    Writing(usize),
    Clean(usize),
    Failed(usize),
}

impl Phase {
    fn unit(self) -> Option<usize> {
        match self {
            Phase::Free => None,
            Phase::Reading(u)
            | Phase::Ready(u)
            | Phase::Leased(u)
            | Phase::Writing(u)
            | Phase::Clean(u)
            | Phase::Failed(u) => Some(u),
        }
    }
}

#[derive(Debug)]
struct State {
    phase: Vec<Phase>,
    last_used: Vec<u64>,
    tick: u64,
    /// Units whose shards are on disk (never-written units stage as zeros, like RAM shards).
    written: Vec<bool>,
    /// The error that made a unit unusable, if any.
    error: Vec<Option<String>>,
}

enum Cmd {
    Read {
        unit: usize,
        slot: usize,
        zero: bool,
    },
    Write {
        unit: usize,
        slot: usize,
    },
    Sync(Sender<Result<()>>),
}

/// Counters since creation.
#[derive(Debug, Clone, Copy, Default, PartialEq)]
pub struct SpillStats {
    /// Bytes read from the spill files.
    pub bytes_read: u64,
    /// Bytes written to the spill files.
    pub bytes_written: u64,
    /// Seconds the I/O thread spent in reads and writes.
    pub io_seconds: f64,
    /// Seconds callers waited in [`SpillTier::lease`] for data to arrive.
    pub wait_seconds: f64,
    /// Leases served from a slot without a read (prefetched or cached).
    pub hits: u64,
    /// Leases that had to wait for a read they started themselves.
    pub misses: u64,
}

#[derive(Debug, Default)]
struct Counters {
    read: AtomicU64,
    written: AtomicU64,
    io_ns: AtomicU64,
    wait_ns: AtomicU64,
    hits: AtomicU64,
    misses: AtomicU64,
}

struct Shared {
    units: Vec<Vec<SpilledShard>>,
    names: Vec<String>,
    slots: Vec<Region>,
    slot_bytes: usize,
    state: Mutex<State>,
    cv: Condvar,
    tx: Mutex<Option<Sender<Cmd>>>,
    counters: Counters,
    /// Test seam: the next write-back fails half-way with this OS error.
    inject: AtomicU64,
}

impl std::fmt::Debug for Shared {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Shared")
            .field("slots", &self.slots.len())
            .field("slot_bytes", &self.slot_bytes)
            .finish()
    }
}

/// How to build the tier.
#[derive(Debug, Clone)]
pub struct TierConfig {
    /// Files, engine, O_DIRECT, queue depth and extent size (`extents` is computed).
    pub io: SpillConfig,
    /// Staging slots (each holds one unit's spilled shards); at least 1, 3 to overlap fully.
    pub slots: usize,
    /// NUMA node for the staging slots (where the AdamW workers for spilled units run).
    pub node: Option<u32>,
    /// CPUs that prefault the slots.
    pub cpus: Vec<usize>,
    /// Page kind of the slots.
    pub pages: PageKind,
}

/// The tier. Cheap to share by reference; dropping it stops its I/O thread.
#[derive(Debug)]
pub struct SpillTier {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
    /// Fallbacks taken (io_uring, O_DIRECT) and notes (no fixed buffers, stale files
    /// removed), one line each.
    pub warnings: Vec<String>,
    /// Bytes the spill files occupy on disk (preallocated: two copies per extent).
    disk_bytes: u64,
    /// The spill files (deleted when the tier is dropped).
    files: Vec<std::path::PathBuf>,
    uring: bool,
    direct: bool,
}

/// Exclusive use of one unit's staged shards; dropping it releases them (written back if
/// marked dirty, which is the default).
#[derive(Debug)]
pub struct Lease {
    shared: Arc<Shared>,
    unit: usize,
    slot: usize,
    dirty: bool,
}

fn lock(m: &Mutex<State>) -> MutexGuard<'_, State> {
    crate::util::lock(m)
}

/// Bytes of one staging slot: the largest unit's spilled shards.
pub fn slot_bytes(units: &[TierUnit]) -> usize {
    units
        .iter()
        .map(|u| u.shards.iter().map(|(_, b)| b).sum())
        .max()
        .unwrap_or(0)
}

impl SpillTier {
    /// Create the spill files for the shards of `units` (of a store of `total_units`; the
    /// others stay in RAM), allocate the staging slots and start the I/O thread.
    pub fn create(units: &[TierUnit], total_units: usize, cfg: &TierConfig) -> Result<Self> {
        let eb = cfg.io.extent_bytes;
        let mut spilled = vec![Vec::new(); total_units];
        let mut names = vec![String::new(); total_units];
        let mut next_extent = 0;
        for tu in units {
            let slot = spilled.get_mut(tu.unit).ok_or_else(|| {
                Error::bad_input(
                    "spill",
                    format!("unit {}", tu.unit),
                    format!("the store has {total_units} units"),
                    None,
                )
            })?;
            names[tu.unit].clone_from(&tu.label);
            let mut off = 0;
            for &(name, bytes) in &tu.shards {
                slot.push(SpilledShard {
                    name,
                    first_extent: next_extent,
                    bytes,
                    slot_offset: off,
                });
                next_extent += bytes.div_ceil(eb);
                off += bytes;
            }
        }
        let slot_bytes = slot_bytes(units).max(4096);
        let nslots = cfg.slots.max(1);
        let mut slots = Vec::with_capacity(nslots);
        for i in 0..nslots {
            slots.push(Region::allocate(RegionSpec {
                label: format!("NVMe staging slot {i}"),
                bytes: slot_bytes,
                node: cfg.node,
                prefault_cpus: cfg.cpus.clone(),
                pages: cfg.pages,
                lock: false,
            })?);
        }
        let mut io = cfg.io.clone();
        io.extents = next_extent.max(1);
        let mut store = ExtentStore::create(&io)?;
        let (disk_bytes, files) = (store.disk_bytes(), store.paths());
        let ranges: Vec<(*mut u8, usize)> = slots.iter().map(|r| (r.as_ptr(), r.len())).collect();
        let mut warnings = store.warnings.clone();
        // SAFETY: the slots live in `Shared`, which the I/O thread (owner of `store`) keeps alive
        // until after it drops `store`.
        if let Err(why) = unsafe { store.register(&ranges) } {
            if store.uses_uring() {
                warnings.push(format!(
                    "spill I/O: staging slots not registered with io_uring ({why}); using plain reads and writes"
                ));
            }
        }
        let (uring, direct) = (store.uses_uring(), store.is_direct());
        let (tx, rx) = channel();
        let n = total_units;
        let shared = Arc::new(Shared {
            units: spilled,
            names,
            slots,
            slot_bytes,
            state: Mutex::new(State {
                phase: vec![Phase::Free; nslots],
                last_used: vec![0; nslots],
                tick: 0,
                written: vec![false; n],
                error: vec![None; n],
            }),
            cv: Condvar::new(),
            tx: Mutex::new(Some(tx)),
            counters: Counters::default(),
            inject: AtomicU64::new(0),
        });
        let s2 = shared.clone();
        let thread = std::thread::Builder::new()
            .name("spill-io".into())
            .spawn(move || io_thread(&s2, store, &rx))
            .map_err(|e| Error::system("std::thread", "spawn the spill I/O thread", e))?;
        Ok(SpillTier {
            shared,
            thread: Some(thread),
            warnings,
            disk_bytes,
            files,
            uring,
            direct,
        })
    }

    /// Bytes the spill files occupy on disk, preallocation included.
    pub fn disk_bytes(&self) -> u64 {
        self.disk_bytes
    }

    /// The spill files (this run's, locked while it runs, deleted with the tier).
    pub fn files(&self) -> &[std::path::PathBuf] {
        &self.files
    }

    /// True when `unit` has shards in this tier.
    pub fn holds(&self, unit: usize) -> bool {
        self.shared.units.get(unit).is_some_and(|s| !s.is_empty())
    }

    /// Staging bytes (slots × slot size).
    pub fn staging_bytes(&self) -> u64 {
        (self.shared.slots.len() * self.shared.slot_bytes) as u64
    }

    /// Number of staging slots.
    pub fn slots(&self) -> usize {
        self.shared.slots.len()
    }

    /// True when io_uring is in use (else the pread/pwrite threads).
    pub fn uses_uring(&self) -> bool {
        self.uring
    }

    /// True when the spill files use O_DIRECT.
    pub fn is_direct(&self) -> bool {
        self.direct
    }

    /// Counters since creation.
    pub fn stats(&self) -> SpillStats {
        let c = &self.shared.counters;
        SpillStats {
            bytes_read: c.read.load(Ordering::Relaxed),
            bytes_written: c.written.load(Ordering::Relaxed),
            io_seconds: c.io_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            wait_seconds: c.wait_ns.load(Ordering::Relaxed) as f64 * 1e-9,
            hits: c.hits.load(Ordering::Relaxed),
            misses: c.misses.load(Ordering::Relaxed),
        }
    }

    /// Start reading `unit` into a free (or cached, clean) slot if one is available; never waits
    /// and never evicts data that is needed. At most `slots − 1` units are prefetched ahead, so a
    /// lease never has to evict a prefetch (which would be read twice). Returns whether the unit
    /// is (or will be) staged.
    pub fn prefetch(&self, unit: usize) -> bool {
        if !self.holds(unit) {
            return false;
        }
        let mut st = lock(&self.shared.state);
        if st.phase.iter().any(|p| p.unit() == Some(unit)) {
            return true;
        }
        let ahead = st
            .phase
            .iter()
            .filter(|p| matches!(p, Phase::Reading(_) | Phase::Ready(_)))
            .count();
        if ahead + 1 >= st.phase.len() {
            return false;
        }
        match pick_slot(&st, false) {
            Some(slot) => self.start_read(&mut st, unit, slot).is_ok(),
            None => false,
        }
    }

    fn start_read(&self, st: &mut State, unit: usize, slot: usize) -> Result<()> {
        st.phase[slot] = Phase::Reading(unit);
        let zero = !st.written[unit];
        send(&self.shared, Cmd::Read { unit, slot, zero })
    }

    /// Exclusive use of `unit`'s staged shards, waiting for a read if needed.
    pub fn lease(&self, unit: usize) -> Result<Lease> {
        if !self.holds(unit) {
            return Err(Error::bad_input(
                "spill",
                format!("unit {unit}"),
                "has no spilled shards",
                None,
            ));
        }
        let t0 = Instant::now();
        let mut started = false;
        let mut st = lock(&self.shared.state);
        loop {
            if let Some(e) = &st.error[unit] {
                return Err(Error::system(
                    "NVMe spill tier",
                    format!("stage {}", self.shared.names[unit]),
                    e.clone(),
                ));
            }
            match st.phase.iter().position(|p| p.unit() == Some(unit)) {
                Some(slot) => match st.phase[slot] {
                    Phase::Ready(_) | Phase::Clean(_) => {
                        st.phase[slot] = Phase::Leased(unit);
                        st.tick += 1;
                        st.last_used[slot] = st.tick;
                        let c = &self.shared.counters;
                        if started {
                            c.misses.fetch_add(1, Ordering::Relaxed);
                        } else {
                            c.hits.fetch_add(1, Ordering::Relaxed);
                        }
                        c.wait_ns
                            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
                        return Ok(Lease {
                            shared: self.shared.clone(),
                            unit,
                            slot,
                            dirty: true,
                        });
                    }
                    Phase::Leased(_) => {
                        return Err(Error::system(
                            "NVMe spill tier",
                            format!("stage {}", self.shared.names[unit]),
                            "it is already leased",
                        ))
                    }
                    Phase::Failed(_) => {
                        return Err(Error::system(
                            "NVMe spill tier",
                            format!("stage {}", self.shared.names[unit]),
                            "its last write-back failed",
                        ))
                    }
                    // A read or a write-back of this unit is in flight: wait for it.
                    _ => {}
                },
                None => {
                    if let Some(slot) = pick_slot(&st, true) {
                        self.start_read(&mut st, unit, slot)?;
                        started = true;
                        continue;
                    }
                }
            }
            st = self.shared.cv.wait(st).unwrap_or_else(|e| e.into_inner());
        }
    }

    /// Wait until no read or write-back is in flight, then fdatasync the spill files. Returns the
    /// first write-back error, if any unit has one.
    pub fn flush(&self) -> Result<()> {
        {
            let mut st = lock(&self.shared.state);
            while st
                .phase
                .iter()
                .any(|p| matches!(p, Phase::Reading(_) | Phase::Writing(_)))
            {
                st = self.shared.cv.wait(st).unwrap_or_else(|e| e.into_inner());
            }
            self.check_locked(&st)?;
        }
        let (tx, rx) = channel();
        send(&self.shared, Cmd::Sync(tx))?;
        rx.recv()
            .map_err(|_| Error::system("NVMe spill tier", "sync", "the I/O thread is gone"))?
    }

    /// Test seam: make the next write-back fail half-way with OS error `errno` (e.g. ENOSPC).
    pub fn inject_write_error(&self, errno: i32) {
        self.shared.inject.store(errno as u64, Ordering::Relaxed);
    }

    /// The first write-back error, if any (reads fail the lease that needed them).
    pub fn check(&self) -> Result<()> {
        self.check_locked(&lock(&self.shared.state))
    }

    fn check_locked(&self, st: &State) -> Result<()> {
        for (slot, p) in st.phase.iter().enumerate() {
            if let Phase::Failed(u) = p {
                let why = st.error[*u].clone().unwrap_or_default();
                return Err(Error::system(
                    "NVMe spill tier",
                    format!("write back {} (slot {slot})", self.shared.names[*u]),
                    why,
                ));
            }
        }
        Ok(())
    }
}

/// A slot for a new unit: a free one, else the least recently used clean (cached) one, else —
/// when `evict_prefetched` — the least recently used prefetched one nobody has leased yet.
fn pick_slot(st: &State, evict_prefetched: bool) -> Option<usize> {
    if let Some(i) = st.phase.iter().position(|p| *p == Phase::Free) {
        return Some(i);
    }
    let lru = |f: &dyn Fn(Phase) -> bool| {
        (0..st.phase.len())
            .filter(|&i| f(st.phase[i]))
            .min_by_key(|&i| st.last_used[i])
    };
    lru(&|p| matches!(p, Phase::Clean(_)))
        .or_else(|| evict_prefetched.then(|| lru(&|p| matches!(p, Phase::Ready(_))))?)
}

fn send(shared: &Shared, cmd: Cmd) -> Result<()> {
    let tx = crate::util::lock(&shared.tx);
    tx.as_ref()
        .and_then(|t| t.send(cmd).ok())
        .ok_or_else(|| Error::system("NVMe spill tier", "queue I/O", "the I/O thread has stopped"))
}

impl Lease {
    /// The unit.
    pub fn unit(&self) -> usize {
        self.unit
    }

    /// The staged shard at position `index` of the unit's [`TierUnit::shards`], all its bytes
    /// as f32 words (shard bytes are a multiple of 4 KiB).
    pub fn shard(&mut self, index: usize) -> Option<&mut [f32]> {
        let p = self.shard_ptr(index)?;
        let words = self.shared.units[self.unit].get(index)?.bytes / 4;
        // SAFETY: the shard's bytes lie inside the slot past its offset; the slot is 4 KiB
        // aligned, as is every offset; the lease is the slot's only user while it is Leased, and
        // `&mut self` makes the view exclusive.
        Some(unsafe { std::slice::from_raw_parts_mut(p, words) })
    }

    /// Start of the staged shard at `index` (for views whose lifetime the caller ties to the
    /// lease).
    pub fn shard_ptr(&self, index: usize) -> Option<*mut f32> {
        let s = self.shared.units[self.unit].get(index)?;
        // SAFETY: slot_offset < slot size, inside the slot region.
        Some(unsafe { self.shared.slots[self.slot].as_ptr().add(s.slot_offset) }.cast())
    }

    /// Release without writing back (the data was only read).
    pub fn release_clean(mut self) {
        self.dirty = false;
    }
}

impl Drop for Lease {
    fn drop(&mut self) {
        let mut st = lock(&self.shared.state);
        if self.dirty {
            st.phase[self.slot] = Phase::Writing(self.unit);
            if send(
                &self.shared,
                Cmd::Write {
                    unit: self.unit,
                    slot: self.slot,
                },
            )
            .is_err()
            {
                st.phase[self.slot] = Phase::Failed(self.unit);
                st.error[self.unit] = Some("the spill I/O thread has stopped".into());
            }
        } else {
            st.phase[self.slot] = Phase::Clean(self.unit);
        }
        self.shared.cv.notify_all();
    }
}

impl Drop for SpillTier {
    fn drop(&mut self) {
        // Closing the channel ends the I/O thread after the queued work.
        crate::util::lock(&self.shared.tx).take();
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn io_thread(shared: &Shared, mut store: ExtentStore, rx: &Receiver<Cmd>) {
    while let Ok(cmd) = rx.recv() {
        let t0 = Instant::now();
        match cmd {
            Cmd::Sync(reply) => {
                let _ = reply.send(store.sync());
            }
            Cmd::Read { unit, slot, zero } => {
                let r = if zero {
                    let r = &shared.slots[slot];
                    // SAFETY: the slot is Reading: this thread is its only user until it sets
                    // the phase under the state lock; the region holds slot_bytes bytes.
                    unsafe { std::slice::from_raw_parts_mut(r.as_ptr(), shared.slot_bytes) }
                        .fill(0);
                    Ok(())
                } else {
                    shard_io(shared, &mut store, unit, slot, false)
                };
                let mut st = lock(&shared.state);
                match r {
                    Ok(()) => st.phase[slot] = Phase::Ready(unit),
                    Err(e) => {
                        st.phase[slot] = Phase::Free;
                        st.error[unit] = Some(e.to_string());
                    }
                }
                shared.cv.notify_all();
            }
            Cmd::Write { unit, slot } => {
                let r = shard_io(shared, &mut store, unit, slot, true);
                let mut st = lock(&shared.state);
                match r {
                    Ok(()) => {
                        st.phase[slot] = Phase::Clean(unit);
                        st.written[unit] = true;
                    }
                    Err(e) => {
                        st.phase[slot] = Phase::Failed(unit);
                        st.error[unit] = Some(e.to_string());
                    }
                }
                shared.cv.notify_all();
            }
        }
        shared
            .counters
            .io_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }
    // `store` (and its ring with the slots registered) drops here, before `shared` can.
}

fn shard_io(
    shared: &Shared,
    store: &mut ExtentStore,
    unit: usize,
    slot: usize,
    write: bool,
) -> Result<()> {
    if write {
        let e = shared.inject.swap(0, Ordering::Relaxed);
        if e != 0 {
            store.inject_write_error = Some(e as i32);
        }
    }
    let r = &shared.slots[slot];
    // SAFETY: the slot is Reading or Writing (the I/O thread calls this): its only user until
    // the phase changes under the state lock; the region holds slot_bytes bytes.
    let bytes = unsafe { std::slice::from_raw_parts_mut(r.as_ptr(), shared.slot_bytes) };
    for s in &shared.units[unit] {
        let label = format!("{} of {}", s.name, shared.names[unit]);
        let buf = &mut bytes[s.slot_offset..s.slot_offset + s.bytes];
        if write {
            store.write(s.first_extent, buf, &label)?;
            shared
                .counters
                .written
                .fetch_add(s.bytes as u64, Ordering::Relaxed);
        } else {
            store.read(s.first_extent, buf, &label)?;
            shared
                .counters
                .read
                .fetch_add(s.bytes as u64, Ordering::Relaxed);
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests;
