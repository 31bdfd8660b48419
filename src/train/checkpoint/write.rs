//! Writing checkpoints: into a temporary directory, every file fsynced and checksummed in a
//! manifest written last, renamed into place, the run's last K kept. Either waited for
//! ([`save`]) or overlapped with the next step ([`start`]): a [`Snapshot`] freezes every unit
//! between the steps and the writer thread reads them in order, each unit's next update waiting
//! only for its own unit's write, so the checkpoint is exactly the step's state with no second
//! copy of it. A kill at any point leaves the previous checkpoints whole (the temporary
//! directory is removed by the directory's next owner).

use super::{files, list, read_state, Manifest, TrainState, FORMAT, MANIFEST};
use crate::dist::Collective;
use crate::store::{FrozenUnit, HostStore, MasterRef, Snapshot};
use crate::util::progress::{Meter, Unit};
use crate::{Error, Result};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// True for the entries of a checkpoint directory that its run creates, replaces and deletes:
/// checkpoints (`step-*`), their temporary and pruned forms (`.step-*`), the lock file.
pub fn owns(name: &str) -> bool {
    name.starts_with("step-") || name.starts_with(".step-") || name == crate::util::lock::LOCK_FILE
}

fn dir_name(step: u64) -> String {
    format!("step-{step:08}")
}

fn fsync_dir(d: &Path) {
    if let Ok(f) = std::fs::File::open(d) {
        let _ = f.sync_all();
    }
}

/// Write a checkpoint of `store` and `state` under `root`, waiting for it; keep the newest
/// `keep` of this run (`state.run_id`); checkpoints of other runs are never deleted. Every unit
/// must be idle (no update running). The caller owns `root` (holds its
/// [`crate::util::lock::DirLock`]), so unfinished temporary directories there belong to dead
/// writers and are removed.
pub fn save(root: &Path, store: &HostStore, state: &TrainState, keep: usize) -> Result<PathBuf> {
    let snapshot = store.snapshot()?;
    write(root, snapshot, state, keep, true, None)
}

/// Bytes per message of a unit's state on its way to rank 0 ([`super::send_moments`]): what
/// the writer holds of another rank's state at once.
pub(super) const MOMENT_CHUNK: usize = 64 << 20;

/// A frozen unit's bytes as a checkpoint holds them, to `put(file, bytes)` in pieces of at most
/// [`MOMENT_CHUNK`]: its params in fp32 (file 0, when `params`; bf16 planes joined a piece at a
/// time), then m (1) and v (2), as stored (when `moments`).
pub(super) fn unit_pieces(
    unit: &FrozenUnit<'_>,
    params: bool,
    moments: bool,
    mut put: impl FnMut(usize, &[u8]) -> Result<()>,
) -> Result<()> {
    let bytes = |f: &[f32]| {
        // SAFETY: f32 → bytes of the same memory (no padding, any bit pattern valid); the file
        // is little-endian like the host (see hf.rs's guard).
        unsafe { std::slice::from_raw_parts(f.as_ptr().cast::<u8>(), f.len() * 4) }
    };
    match unit.params() {
        _ if !params => {}
        MasterRef::Fp32(p) => {
            for piece in bytes(p).chunks(MOMENT_CHUNK) {
                put(0, piece)?;
            }
        }
        planes => {
            let mut joined = vec![0f32; (MOMENT_CHUNK / 4).min(planes.len())];
            let mut at = 0;
            while at < planes.len() {
                let n = (planes.len() - at).min(joined.len());
                planes.read(at, &mut joined[..n]);
                put(0, bytes(&joined[..n]))?;
                at += n;
            }
        }
    }
    if moments {
        let (m, v) = unit.moments()?;
        for (k, moment) in [(1, m), (2, v)] {
            for piece in moment.chunks(MOMENT_CHUNK) {
                put(k, piece)?;
            }
        }
    }
    Ok(())
}

/// A checkpoint being written while training goes on ([`start`]).
#[derive(Debug)]
pub struct InFlight {
    step: u64,
    bytes: u64,
    store: HostStore,
    /// The store's snapshot wait when the write started.
    waited_before: Duration,
    /// What training waited before the snapshot could be taken (the step's last updates).
    waited_to_start: Duration,
    /// The checkpoint and how long the writer took.
    thread: JoinHandle<Result<(PathBuf, Duration)>>,
}

/// A finished checkpoint write.
#[derive(Debug, Clone)]
pub struct Written {
    /// The checkpoint.
    pub dir: PathBuf,
    /// Its step.
    pub step: u64,
    /// Tensor bytes written.
    pub bytes: u64,
    /// From the snapshot to the rename into place.
    pub secs: f64,
    /// How long training waited for it: for the step's last updates before the snapshot,
    /// updates waiting for their unit's write, and the wait for the end of the write in
    /// [`InFlight::join`] (an update's wait may overlap device work; what the writer's CPU
    /// time and disk traffic cost the steps beside it is not counted:
    /// `tools/bench_checkpoint_overlap.sh` measures the whole cost).
    pub waited: f64,
}

impl Written {
    /// The fraction of the write training did not wait for.
    pub fn hidden(&self) -> f64 {
        if self.secs > 0.0 {
            (1.0 - self.waited / self.secs).clamp(0.0, 1.0)
        } else {
            1.0
        }
    }
}

/// Start writing a checkpoint of `store` and `state` under `root` on a thread of its own, as
/// [`save`] does, while training goes on: every unit is frozen now (a
/// [`crate::store::Snapshot`]) and written in order; the next step's update of a unit waits
/// only until that unit is written. Every unit must be idle (no update running).
/// `waited_to_start`: what the caller waited for the units to be idle.
pub fn start(
    root: &Path,
    store: &HostStore,
    state: TrainState,
    keep: usize,
    waited_to_start: Duration,
) -> Result<InFlight> {
    let snapshot = store.snapshot()?;
    let (root, step) = (root.to_owned(), state.step);
    let thread = std::thread::Builder::new()
        .name("checkpoint".into())
        .spawn(move || {
            yield_to_training();
            let t0 = Instant::now();
            write(&root, snapshot, &state, keep, false, None).map(|dir| (dir, t0.elapsed()))
        })
        .map_err(|e| Error::system("checkpoint", "start the writer thread", e))?;
    Ok(InFlight {
        step,
        bytes: store.layout().checkpoint_bytes(),
        store: store.clone(),
        waited_before: store.snapshot_wait(),
        waited_to_start,
        thread,
    })
}

/// Lower this thread's CPU priority (nice 10; the I/O threads it starts inherit it): the writer
/// is background work, and where cores are short (the CPU device computes on all of them) it
/// should take what training leaves rather than an equal share. An update that then has to
/// wait for its unit still waits (and is reported).
pub(super) fn yield_to_training() {
    // SAFETY: gettid has no preconditions; setpriority on this thread's own id only changes its
    // nice value (a failure leaves it as it was, which is harmless).
    unsafe {
        let tid = libc::syscall(libc::SYS_gettid) as libc::id_t;
        libc::setpriority(libc::PRIO_PROCESS, tid, 10);
    }
}

impl InFlight {
    /// The step it holds.
    pub fn step(&self) -> u64 {
        self.step
    }

    /// Whether the write has ended (joining will not wait).
    pub fn is_finished(&self) -> bool {
        self.thread.is_finished()
    }

    /// Wait for the write to end.
    pub fn join(self) -> Result<Written> {
        let t0 = Instant::now();
        let (dir, took) = self
            .thread
            .join()
            .map_err(|_| Error::internal("checkpoint", "the writer thread panicked"))??;
        let joined = t0.elapsed();
        let updates = self
            .store
            .snapshot_wait()
            .saturating_sub(self.waited_before);
        Ok(Written {
            dir,
            step: self.step,
            bytes: self.bytes,
            secs: took.as_secs_f64(),
            waited: (self.waited_to_start + updates + joined).as_secs_f64(),
        })
    }
}

/// Write `snapshot` as the checkpoint of `state` (see [`save`]); `meter`: report progress;
/// `world`: a sharded job's, from whose ranks the moments this process lacks come
/// ([`super::save_job`] where the ranks cannot write into one directory).
pub(super) fn write(
    root: &Path,
    mut snapshot: Snapshot,
    state: &TrainState,
    keep: usize,
    meter: bool,
    world: Option<&dyn Collective>,
) -> Result<PathBuf> {
    let store = snapshot.store().clone();
    if world.is_none() && store.layout().owners.is_some() {
        return Err(Error::internal(
            "checkpoint",
            "a job with sharded Adam state writes its checkpoints with its ranks (save_job)",
        ));
    }
    std::fs::create_dir_all(root).map_err(|e| Error::io("create checkpoint directory", root, e))?;
    let (tmp, final_dir) = temporary(root, state.step);
    let _ = std::fs::remove_dir_all(&tmp);
    let result = (|| -> Result<()> {
        std::fs::create_dir(&tmp).map_err(|e| Error::io("create", &tmp, e))?;
        // One pass over the units, all three files at once: a spilled unit's m/v are staged
        // (read from NVMe) once, not once per file.
        // Written past the page cache (O_DIRECT) where the filesystem allows.
        struct Out {
            path: PathBuf,
            w: crate::util::direct::DirectWriter,
            crc: u32,
            size: u64,
        }
        impl Out {
            /// Append `bytes`, checksummed, counted on `meter`.
            fn put(&mut self, bytes: &[u8], meter: Option<&Meter>) -> Result<()> {
                self.crc = crc32c::crc32c_append(self.crc, bytes);
                self.size += bytes.len() as u64;
                crate::util::failpoint::check("checkpoint")
                    .and_then(|()| self.w.write_all(bytes))
                    .map_err(|e| Error::io("write", &self.path, e))?;
                if let Some(meter) = meter {
                    meter.add(bytes.len() as u64);
                }
                Ok(())
            }
        }
        let mut outs = Vec::new();
        let names = files(store.layout().adam);
        for (name, _) in &names {
            let path = tmp.join(name);
            let w = crate::util::direct::DirectWriter::create(&path)
                .map_err(|e| Error::io("create", &path, e))?;
            outs.push(Out {
                path,
                w,
                crc: 0,
                size: 0,
            });
        }
        let meter = meter.then(|| {
            Meter::start(
                "checkpoint write",
                store.layout().checkpoint_bytes(),
                Unit::Bytes,
            )
        });
        // Another rank's moments pass through here a message at a time.
        let mut chunk = Vec::new();
        for u in 0..store.num_units() {
            crate::util::failpoint::pause("checkpoint-unit");
            // Optimizer state on NVMe is staged (read in) with the unit.
            let unit = snapshot.read(u)?;
            let [p_out, m_out, v_out] = &mut outs[..] else {
                return Err(Error::internal("checkpoint", "three tensor files"));
            };
            // Another rank's shard, from its `send_moments`: `bytes` of it into `out`, a
            // MOMENT_CHUNK message at a time.
            let mut receive = |world: &dyn Collective, from: usize, bytes: usize, out: &mut Out| {
                let mut left = bytes;
                while left > 0 {
                    let n = left.min(MOMENT_CHUNK);
                    if chunk.len() < n {
                        chunk.resize(n, 0);
                    }
                    world.recv_bytes(from, &mut chunk[..n])?;
                    out.put(&chunk[..n], meter.as_ref())?;
                    left -= n;
                }
                Ok::<(), Error>(())
            };
            // The rank holding this unit, where another does (a sharded job whose rank 0 writes
            // it all): its `send_moments` sends the unit's params (stage 3), then m, then v.
            let layout = store.layout();
            let from = world
                .zip(layout.owners.as_ref())
                .filter(|(_, o)| !o.holds(u))
                .map(|(w, o)| (w, o.owner[u]));
            if let Some((world, owner)) = from {
                let numel = layout.units[u].numel;
                if !layout.holds_params(u) {
                    receive(world, owner, 4 * numel, p_out)?;
                }
                let moment = layout.adam.moment_bytes_unaligned(numel);
                for out in [&mut *m_out, &mut *v_out] {
                    receive(world, owner, moment, out)?;
                }
            }
            // This process's own bytes of the unit.
            let mut outs = [p_out, m_out, v_out];
            unit_pieces(&unit, layout.holds_params(u), from.is_none(), |k, bytes| {
                outs[k].put(bytes, meter.as_ref())
            })?;
            // Thawed: step k+1 may update it now.
            drop(unit);
        }
        let mut files = Vec::new();
        for (o, (name, _)) in outs.into_iter().zip(names) {
            o.w.finish()
                .map_err(|e| Error::io("write and fsync", &o.path, e))?;
            files.push((name, o.size, o.crc));
        }
        if let Some(meter) = meter {
            meter.finish();
        }
        files.push(write_state(&tmp, state)?);
        seal(root, &tmp, state.step, files)
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result?;
    prune(root, state, keep)?;
    Ok(final_dir)
}

/// The temporary directory a checkpoint of `step` is written into by this process, and the
/// checkpoint's name once renamed into place.
pub(super) fn temporary(root: &Path, step: u64) -> (PathBuf, PathBuf) {
    let tmp = root.join(format!(".{}.tmp-{}", dir_name(step), std::process::id()));
    (tmp, root.join(dir_name(step)))
}

/// Write `state` as the state.json of the checkpoint in `tmp`; its manifest entry.
pub(super) fn write_state(tmp: &Path, state: &TrainState) -> Result<(String, u64, u32)> {
    let state_json = serde_json::to_vec_pretty(state)
        .map_err(|e| Error::system("serde_json", "checkpoint state", e))?;
    let sp = tmp.join(STATE_FILE);
    crate::util::write_atomic(&sp, &state_json)?;
    Ok((
        STATE_FILE.into(),
        state_json.len() as u64,
        crc32c::crc32c(&state_json),
    ))
}

/// The checkpoint's state file.
pub(super) const STATE_FILE: &str = "state.json";

/// Finish the checkpoint of `step` in `tmp`, whose files (`files`: name, size, crc32c — the
/// tensors and state.json) are written and durable: the manifest, then renamed into place as
/// `root/step-N` (an existing one of the step replaced only once the new one is in place).
pub(super) fn seal(
    root: &Path,
    tmp: &Path,
    step: u64,
    files: Vec<(String, u64, u32)>,
) -> Result<()> {
    let final_dir = temporary(root, step).1;
    let manifest = serde_json::to_vec_pretty(&Manifest {
        format: FORMAT,
        files,
    })
    .map_err(|e| Error::system("serde_json", "manifest", e))?;
    crate::util::write_atomic(&tmp.join(MANIFEST), &manifest)?;
    fsync_dir(tmp);
    // An existing checkpoint of this step is renamed aside, the new one renamed into place,
    // and only then the old one deleted: no moment without a `step-N`.
    let old = final_dir
        .exists()
        .then(|| aside(root, &final_dir, "replaced"));
    if let Some(old) = &old {
        let _ = std::fs::remove_dir_all(old);
        std::fs::rename(&final_dir, old)
            .map_err(|e| Error::io("replace checkpoint", &final_dir, e))?;
    }
    if let Err(e) = std::fs::rename(tmp, &final_dir) {
        if let Some(old) = &old {
            let _ = std::fs::rename(old, &final_dir);
        }
        return Err(Error::io("rename checkpoint into place", &final_dir, e));
    }
    fsync_dir(root);
    if let Some(old) = &old {
        let _ = std::fs::remove_dir_all(old);
    }
    Ok(())
}

/// Keep this run's newest `keep` checkpoints under `root` (`state`'s run), and remove the
/// temporary directories of dead writers.
pub(super) fn prune(root: &Path, state: &TrainState, keep: usize) -> Result<()> {
    let mut ours: Vec<(u64, PathBuf)> = list(root)?
        .into_iter()
        .filter(|(_, d)| {
            read_state(d).is_ok_and(|st| st.run_id.is_some() && st.run_id == state.run_id)
        })
        .collect();
    ours.sort();
    while ours.len() > keep.max(1) {
        let (_, d) = ours.remove(0);
        let _ = discard(root, &d);
    }
    remove_leftovers(root, Some(std::process::id()));
    Ok(())
}

/// Delete the checkpoint `dir` under `root` so that no kill leaves half of it under its name:
/// renamed away first (`.step-….pruned-PID`, which [`remove_leftovers`] finishes if this
/// process dies), then removed.
pub(super) fn discard(root: &Path, dir: &Path) -> std::io::Result<()> {
    let away = aside(root, dir, "pruned");
    let _ = std::fs::remove_dir_all(&away);
    std::fs::rename(dir, &away)?;
    fsync_dir(root);
    std::fs::remove_dir_all(&away)
}

/// Where the checkpoint `dir` under `root` goes while it is deleted (`why` "pruned":
/// `.step-….pruned-PID`, deleted next) or while a new checkpoint of its step takes its name
/// ("replaced": whole until the new one is in place).
fn aside(root: &Path, dir: &Path, why: &str) -> PathBuf {
    let name = dir
        .file_name()
        .map(|n| n.to_string_lossy().into_owned())
        .unwrap_or_default();
    root.join(format!(".{name}.{why}-{}", std::process::id()))
}

/// Remove what dead writers of `root` left: unfinished checkpoints (`.step-….tmp-PID`),
/// half-pruned ones (`.step-….pruned-PID`) and replaced ones (`.step-N.replaced-PID`) —
/// except that a replaced checkpoint whose `step-N` never arrived is renamed back (it is whole)
/// — and nothing of this process's own (`own_pid`) when it may be writing. The caller holds
/// `root`'s lock, so no live process is writing there. Returns how many entries it removed.
pub fn remove_leftovers(root: &Path, own_pid: Option<u32>) -> usize {
    let mut removed = 0;
    let own = own_pid.map(|p| format!("-{p}"));
    let Ok(rd) = std::fs::read_dir(root) else {
        return 0;
    };
    for e in rd.flatten() {
        let n = e.file_name().to_string_lossy().into_owned();
        if !n.starts_with(".step-") || own.as_ref().is_some_and(|o| n.ends_with(o.as_str())) {
            continue;
        }
        if n.contains(".sealing-") {
            // A sharded job's sealing claim (a file).
            if std::fs::remove_file(e.path()).is_ok() {
                removed += 1;
            }
            continue;
        }
        if let Some((step_name, _)) = n[1..].split_once(".replaced-") {
            let step_dir = root.join(step_name);
            if !step_dir.exists() && std::fs::rename(e.path(), &step_dir).is_ok() {
                continue;
            }
        } else if !(n.contains(".tmp-") || n.contains(".pruned-")) {
            continue;
        }
        if std::fs::remove_dir_all(e.path()).is_ok() {
            removed += 1;
        }
    }
    removed
}
