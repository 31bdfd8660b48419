//! Snapshots: a consistent image of every unit's params and Adam moments, read while training
//! goes on (checkpoints that do not stop training).
//!
//! [`HostStore::snapshot`] freezes every unit at once, between two steps. A frozen unit's params
//! and moments are written by nobody: whatever would write them — an AdamW update, through
//! [`UnitGuard::stage`](super::UnitGuard::stage), [`UnitGuard::shards`](super::UnitGuard::shards)
//! or [`UnitGuard::master`](super::UnitGuard::master) — waits until the snapshot thaws the unit.
//! Reads go on: the next step's device copies of the weights
//! ([`UnitGuard::master_ref`](super::UnitGuard::master_ref)) and its gradients (a shard the
//! snapshot does not hold) do not wait. The snapshot's reader takes the units one at a time
//! ([`Snapshot::read`]); each is thawed when its [`FrozenUnit`] is dropped, and every unit not
//! yet read when the snapshot is (a failed write holds nothing up).
//!
//! So the image is exactly the state between the two steps, with no second copy of it: a unit
//! is read before its next update starts, and that update waits only for its own unit.

use super::{HostStore, MasterRef};
use crate::spill::tier::Lease;
use crate::store::layout::ShardKind;
use crate::{Error, Result};
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Condvar, Mutex};
use std::time::{Duration, Instant};

/// Which units are frozen, and the wait for a thaw.
#[derive(Debug)]
pub(super) struct Frozen {
    units: Vec<AtomicBool>,
    lock: Mutex<()>,
    thawed: Condvar,
    waited_ns: AtomicU64,
}

impl Frozen {
    pub(super) fn new(units: usize) -> Self {
        Frozen {
            units: (0..units).map(|_| AtomicBool::new(false)).collect(),
            lock: Mutex::new(()),
            thawed: Condvar::new(),
            waited_ns: AtomicU64::new(0),
        }
    }

    fn is_frozen(&self, unit: usize) -> bool {
        self.units
            .get(unit)
            .is_some_and(|f| f.load(Ordering::Acquire))
    }

    /// Block while `unit` is frozen.
    pub(super) fn wait(&self, unit: usize) {
        if !self.is_frozen(unit) {
            return;
        }
        let t0 = Instant::now();
        // A poisoned lock guards no data (`()`): waiting on is still right.
        let mut g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        while self.is_frozen(unit) {
            g = self.thawed.wait(g).unwrap_or_else(|e| e.into_inner());
        }
        self.waited_ns
            .fetch_add(t0.elapsed().as_nanos() as u64, Ordering::Relaxed);
    }

    fn thaw(&self, unit: usize) {
        if let Some(f) = self.units.get(unit) {
            f.store(false, Ordering::Release);
        }
        // Taken after the store: a waiter that saw the unit frozen is already waiting.
        let _g = self.lock.lock().unwrap_or_else(|e| e.into_inner());
        self.thawed.notify_all();
    }

    pub(super) fn waited(&self) -> Duration {
        Duration::from_nanos(self.waited_ns.load(Ordering::Relaxed))
    }
}

/// Every unit frozen at one point between steps, read one unit at a time.
#[derive(Debug)]
pub struct Snapshot {
    store: HostStore,
    /// Units still frozen by this snapshot.
    holds: Vec<bool>,
}

impl HostStore {
    /// Freeze every unit. No unit may be in use (its update running): call between steps,
    /// once every update has finished.
    pub fn snapshot(&self) -> Result<Snapshot> {
        self.snapshot_units(|_| true)
    }

    /// Freeze the units `which` says (a sharded job's rank: the units it writes into a
    /// checkpoint); the others stay writable. As [`HostStore::snapshot`], between steps.
    pub fn snapshot_units(&self, which: impl Fn(usize) -> bool) -> Result<Snapshot> {
        let frozen = &self.inner.frozen;
        if let Some(u) = (0..self.num_units()).find(|&u| frozen.is_frozen(u)) {
            return Err(Error::internal(
                "host store",
                format!("unit {u} is already frozen by another snapshot"),
            ));
        }
        if let Some(u) = (0..self.num_units()).find(|&u| self.inner.busy[u].load(Ordering::Acquire))
        {
            return Err(Error::internal(
                "host store",
                format!("snapshot while unit {u} is in use (its update may be running)"),
            ));
        }
        let holds: Vec<bool> = (0..self.num_units()).map(which).collect();
        for (f, _) in frozen.units.iter().zip(&holds).filter(|(_, &h)| h) {
            f.store(true, Ordering::Release);
        }
        Ok(Snapshot {
            store: self.clone(),
            holds,
        })
    }
}

impl Snapshot {
    /// The store.
    pub fn store(&self) -> &HostStore {
        &self.store
    }

    /// Read `unit` (once): its params and moments as they were when the snapshot was taken;
    /// spilled moments are staged from NVMe. Dropping the result thaws the unit.
    pub fn read(&mut self, unit: usize) -> Result<FrozenUnit<'_>> {
        if !self.holds.get(unit).copied().unwrap_or(false) {
            return Err(Error::internal(
                "snapshot",
                format!("unit {unit} is not held (read twice, or out of range)"),
            ));
        }
        self.holds[unit] = false;
        let mut frozen = FrozenUnit {
            store: &self.store,
            unit,
            lease: None,
        };
        if let Some(t) = self.store.spill().filter(|t| t.holds(unit)) {
            frozen.lease = Some(t.lease(unit)?);
        }
        Ok(frozen)
    }
}

impl Drop for Snapshot {
    fn drop(&mut self) {
        for (u, held) in self.holds.iter().enumerate() {
            if *held {
                self.store.inner.frozen.thaw(u);
            }
        }
    }
}

/// One unit of a [`Snapshot`], frozen while this lives.
#[derive(Debug)]
pub struct FrozenUnit<'a> {
    store: &'a HostStore,
    unit: usize,
    /// The staged NVMe shards of a spilled unit.
    lease: Option<Lease>,
}

impl FrozenUnit<'_> {
    /// Which unit.
    pub fn unit(&self) -> usize {
        self.unit
    }

    /// The fp32 master params.
    pub fn params(&self) -> MasterRef<'_> {
        self.store.master_ref(self.unit)
    }

    /// Adam m and v, stored as the layout's [`AdamState`](super::layout::AdamState) says.
    pub fn moments(&self) -> Result<(&[u8], &[u8])> {
        let n = self.store.inner.layout.units[self.unit].numel;
        let bytes = self.store.layout().adam.moment_bytes_unaligned(n);
        let view = |kind| -> Result<&[u8]> {
            Ok(
                match self
                    .store
                    .moment_ptr(self.unit, kind, self.lease.as_ref())?
                {
                    // SAFETY: a moment shard (or its staged slot, alive with `self.lease`) holds
                    // ≥ `bytes`; the unit is frozen, so nothing writes it while this borrow of
                    // `self` lives.
                    Some(p) => unsafe { std::slice::from_raw_parts(p, bytes) },
                    None => &[],
                },
            )
        };
        Ok((view(ShardKind::AdamM)?, view(ShardKind::AdamV)?))
    }
}

impl Drop for FrozenUnit<'_> {
    fn drop(&mut self) {
        if let Some(l) = self.lease.take() {
            l.release_clean();
        }
        self.store.inner.frozen.thaw(self.unit);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::layout::Mode;
    use std::sync::Arc;

    fn store() -> HostStore {
        crate::store::tests::store(Mode::Exact)
    }

    /// An update of a frozen unit waits for its thaw, and sees the snapshot's bytes unchanged
    /// until then; a unit the snapshot never read is thawed when it is dropped.
    #[test]
    fn writers_wait_for_their_unit_and_readers_do_not() {
        let store = store();
        {
            let mut g = store.take(1).unwrap();
            g.master().write(0, &[1.5]);
        }
        let mut snap = store.snapshot().unwrap();
        // A reader (a device copy) goes on.
        let reader = store.take(1).unwrap();
        assert_eq!(reader.master_ref().to_vec()[0], 1.5);
        drop(reader);
        let wrote = Arc::new(AtomicBool::new(false));
        let writer = {
            let (store, wrote) = (store.clone(), wrote.clone());
            std::thread::spawn(move || {
                let mut g = store.take(1).unwrap();
                g.master().write(0, &[2.5]);
                wrote.store(true, Ordering::SeqCst);
            })
        };
        let unit = snap.read(1).unwrap();
        std::thread::sleep(Duration::from_millis(200));
        assert!(!wrote.load(Ordering::SeqCst), "the update waited");
        assert_eq!(unit.params().to_vec()[0], 1.5);
        drop(unit);
        writer.join().unwrap();
        assert!(wrote.load(Ordering::SeqCst));
        assert!(store.snapshot_wait() >= Duration::from_millis(150));
        // Unit 0 was never read: dropping the snapshot thaws it.
        let other = {
            let store = store.clone();
            std::thread::spawn(move || store.take(0).unwrap().master().write(0, &[3.0]))
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!other.is_finished());
        drop(snap);
        other.join().unwrap();
        assert_eq!(store.take(0).unwrap().master_ref().to_vec()[0], 3.0);
    }

    /// A snapshot of some units (a sharded job's rank: the units it writes) freezes those
    /// alone: another unit's update goes on, the chosen one's waits; the others cannot be read.
    #[test]
    fn a_snapshot_of_some_units_freezes_those_alone() {
        let store = store();
        let mut snap = store.snapshot_units(|u| u == 1).unwrap();
        store.take(0).unwrap().master().write(0, &[4.0]);
        assert!(snap.read(0).is_err(), "unit 0 is not in the snapshot");
        let writer = {
            let store = store.clone();
            std::thread::spawn(move || store.take(1).unwrap().master().write(0, &[5.0]))
        };
        std::thread::sleep(Duration::from_millis(50));
        assert!(!writer.is_finished(), "unit 1 is frozen");
        drop(snap.read(1).unwrap());
        writer.join().unwrap();
        assert_eq!(store.take(1).unwrap().master_ref().to_vec()[0], 5.0);
    }

    #[test]
    fn a_snapshot_refuses_units_in_use_and_double_reads() {
        let store = store();
        let g = store.take(0).unwrap();
        assert!(store.snapshot().is_err());
        drop(g);
        let mut snap = store.snapshot().unwrap();
        assert!(store.snapshot().is_err(), "one snapshot at a time");
        drop(snap.read(0).unwrap());
        assert!(snap.read(0).is_err());
        assert!(snap.read(store.num_units()).is_err());
    }
}
