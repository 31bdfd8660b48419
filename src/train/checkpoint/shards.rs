//! The checkpoint of a job whose state is sharded (ZeRO stage 1 or 3), written by its ranks at
//! once. Where every rank sees the checkpoint's directory (ranks of one host, or hosts sharing a
//! filesystem, as DeepSpeed's sharded checkpoints ask), each rank writes the units it holds —
//! their params, m and v — straight into the checkpoint's three files at the units' offsets
//! ([`DirectWriter::region`]), on a thread of its own beside the next steps (each unit frozen
//! until written, as a process alone writes beside them), and then tells rank 0 each unit's
//! crc32c per file ([`JobInFlight::finish`], collective); rank 0 combines them
//! into each file's checksum and seals the checkpoint (state, manifest, rename) as a process
//! alone does. So the checkpoint is the one-process format byte for byte — it resumes on any
//! number of ranks, re-sharded as it loads, and exports without any rank — and each rank writes
//! its 1/N at its own disk's (or link's) rate instead of sending it through rank 0. Where a rank
//! does not see the directory (hosts with disks of their own), rank 0 takes the units it lacks
//! from their ranks and writes them itself ([`send_moments`]), and the report names the rank.

use super::write::{
    prune, seal, temporary, unit_pieces, write, write_state, yield_to_training, Written, STATE_FILE,
};
use super::{files, TrainState};
use crate::dist::Collective;
use crate::store::layout::{AdamState, ShardKind, StateLayout};
use crate::store::{HostStore, Snapshot};
use crate::util::direct::DirectWriter;
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

/// The file rank 0 leaves in the temporary directory for the others to find: a filesystem they
/// share holds it with rank 0's token.
const PROBE: &str = ".ranks-probe";

/// Rank 0's offer: where the checkpoint of which step is being written, and the token its
/// probe holds.
#[derive(Debug, Clone, Serialize, Deserialize)]
struct Offer {
    dir: PathBuf,
    step: u64,
    token: String,
}

/// A rank's report in the temporary directory once its writes have ended: `part-R.json`.
fn part_file(dir: &Path, rank: usize) -> PathBuf {
    dir.join(format!("part-{rank}.json"))
}

/// The claim of the rank that seals the checkpoint being written in `tmp`
/// (`.step-N.tmp-PID` → `.step-N.sealing-PID`, beside it in the checkpoint root): created
/// exclusively, and kept until every rank has reported (rank 0 removes it then; a dead job's,
/// [`super::remove_leftovers`]), so one rank alone seals.
fn claim_path(tmp: &Path) -> PathBuf {
    let name = tmp
        .file_name()
        .map(|n| n.to_string_lossy().replace(".tmp-", ".sealing-"))
        .unwrap_or_default();
    tmp.with_file_name(name)
}

/// What a rank wrote: each unit it holds with the crc32c of its bytes in each file, and the
/// seconds its writes took; or why it could not.
type Wrote = std::result::Result<(Vec<(usize, [u32; 3])>, f64), String>;

/// A rank's report when the ranks meet ([`JobInFlight::finish`]): what it wrote, and whether it
/// sealed the checkpoint (its writes ended last).
#[derive(Debug, Serialize, Deserialize)]
struct Report {
    wrote: Wrote,
    sealed: bool,
}

/// Each unit's byte range (offset, length) in each of the three files of a checkpoint whose
/// moments are stored as `adam`: the params (fp32), m, v — units in order, as a process alone
/// writes them.
pub(super) fn ranges(layout: &StateLayout, adam: AdamState) -> Vec<[(u64, u64); 3]> {
    let mut at = [0u64; 3];
    layout
        .units
        .iter()
        .map(|u| {
            let moment = adam.moment_bytes_unaligned(u.numel) as u64;
            let lens = [4 * u.numel as u64, moment, moment];
            std::array::from_fn(|k| {
                at[k] += lens[k];
                (at[k] - lens[k], lens[k])
            })
        })
        .collect()
}

/// What rank 0 brings to a sharded job's checkpoint: where, the state it holds, how many of
/// the run's to keep.
#[derive(Debug)]
pub struct JobCheckpoint {
    /// The checkpoint directory (`step-N` goes under it).
    pub root: PathBuf,
    /// Everything besides the tensors.
    pub state: TrainState,
    /// The run's newest checkpoints kept.
    pub keep: usize,
}

/// A sharded job's checkpoint as [`start_job`] left it.
#[derive(Debug)]
pub enum JobStarted {
    /// Every rank is writing the units it holds beside the next steps;
    /// [`JobInFlight::finish`] ends it.
    Writing(Box<JobInFlight>),
    /// A rank does not see the directory (`why`: which, and why): rank 0 wrote it all (`dir`,
    /// on rank 0) from the units the others sent, while training waited.
    Gathered {
        /// The checkpoint (rank 0).
        dir: Option<PathBuf>,
        /// The ranks that could not write into the directory, and why.
        why: String,
    },
}

/// Start the checkpoint of a sharded job (ZeRO stage 1 or 3) on every rank at once (`writer`:
/// rank 0's part; `None` on the others): rank 0 makes the checkpoint's three files and a probe
/// in a temporary directory, each rank checks it sees them, and then every rank writes the
/// units it holds into them on a thread of its own beside the next steps, each unit frozen
/// until written ([`HostStore::snapshot_units`]) — or, where a rank does not see them, rank 0
/// writes it all now from the units the others send. Every unit must be idle on every rank.
/// `waited_to_start`: what the caller waited for the units to be idle.
pub fn start_job(
    writer: Option<JobCheckpoint>,
    store: &HostStore,
    world: &dyn Collective,
    waited_to_start: Duration,
) -> Result<JobStarted> {
    let names = files(store.layout().adam);
    let ranges = ranges(store.layout(), store.layout().adam);
    let owners = store.layout().owners.clone().ok_or_else(|| {
        Error::internal("checkpoint", "a job's checkpoint needs the units' owners")
    })?;
    let sealing = match writer {
        Some(w) => Some(prepare(w, &names, &ranges)?),
        None => None,
    };
    let offer = match &sealing {
        Some(s) => serde_json::to_vec(&s.offer)
            .map_err(|e| Error::system("serde_json", "the checkpoint's offer", e))?,
        None => Vec::new(),
    };
    let offers = world.all_gather_bytes(&offer)?;
    let offer: Offer = serde_json::from_slice(offers.first().map_or(&[][..], |o| &o[..]))
        .map_err(|e| Error::internal("checkpoint", format!("rank 0's offer: {e}")))?;
    let verdict = match sealing.is_some() {
        true => String::new(),
        false => sees(&offer, &names)
            .err()
            .map_or_else(String::new, |e| e.to_string()),
    };
    let verdicts = world.all_gather_bytes(verdict.as_bytes())?;
    let _ = sealing
        .as_ref()
        .map(|s| std::fs::remove_file(s.tmp.join(PROBE)));
    let hosts = world.hosts();
    let refused: Vec<String> = verdicts
        .iter()
        .enumerate()
        .filter(|(_, v)| !v.is_empty())
        .map(|(r, v)| {
            let host = hosts.get(r).map_or("?", String::as_str);
            format!("rank {r} (on {host}) {}", String::from_utf8_lossy(v))
        })
        .collect();
    if !refused.is_empty() {
        let why = refused.join("; ");
        let Some(s) = sealing else {
            send_moments(store, world)?;
            return Ok(JobStarted::Gathered { dir: None, why });
        };
        let _ = std::fs::remove_dir_all(&s.tmp);
        let dir = write(
            &s.root,
            store.snapshot()?,
            &s.state,
            s.keep,
            true,
            Some(world),
        )?;
        return Ok(JobStarted::Gathered {
            dir: Some(dir),
            why,
        });
    }
    let snapshot = store.snapshot_units(|u| owners.holds(u))?;
    let waited_before = store.snapshot_wait();
    let (rank, ranks) = (world.rank(), world.size());
    let (offer_, names_, ranges_) = (offer.clone(), names.clone(), ranges.clone());
    let thread = std::thread::Builder::new()
        .name("checkpoint".into())
        .spawn(move || {
            yield_to_training();
            let t0 = Instant::now();
            let wrote: Wrote = write_units(snapshot, &offer_.dir, &names_, &ranges_)
                .map(|w| (w, t0.elapsed().as_secs_f64()))
                .map_err(|e| e.to_string());
            // Told through the directory too: the rank whose writes end last seals it there
            // and then, so it is whole even if a later step fails before the ranks meet.
            let told = encode(&wrote)
                .and_then(|b| crate::util::write_atomic(&part_file(&offer_.dir, rank), &b));
            let sealed = told.is_ok()
                && wrote.is_ok()
                && seal_if_last(&offer_, ranks, &names_, &ranges_).unwrap_or(false);
            Report { wrote, sealed }
        })
        .map_err(|e| Error::system("checkpoint", "start the writer thread", e))?;
    Ok(JobStarted::Writing(Box::new(JobInFlight {
        store: store.clone(),
        thread,
        waited_before,
        waited_to_start,
        sealing,
    })))
}

/// Seal the checkpoint `offer` names if every one of the `ranks` has reported writing its
/// units, each without error, and no other rank has claimed the sealing: the files' checksums
/// combined from the reports, the manifest written, the directory renamed into place. Whether
/// this call sealed it.
fn seal_if_last(
    offer: &Offer,
    ranks: usize,
    names: &[(String, ShardKind); 3],
    ranges: &[[(u64, u64); 3]],
) -> Result<bool> {
    let mut reports = Vec::new();
    for r in 0..ranks {
        match std::fs::read(part_file(&offer.dir, r)) {
            Ok(b) => reports.push(b),
            Err(_) => return Ok(false),
        }
    }
    let reports: Vec<Wrote> = reports
        .iter()
        .map(|b| serde_json::from_slice(b))
        .collect::<std::result::Result<_, _>>()
        .map_err(|e| Error::internal("checkpoint", format!("a rank's report: {e}")))?;
    if reports.iter().any(|w| w.is_err()) {
        return Ok(false);
    }
    let claim = std::fs::OpenOptions::new()
        .write(true)
        .create_new(true)
        .open(claim_path(&offer.dir));
    if claim.is_err() {
        return Ok(false);
    }
    let root = offer.dir.parent().unwrap_or(Path::new("."));
    let mut files = combine(&reports, names, ranges, &[])?.1;
    tidy(&offer.dir, ranks);
    let state = std::fs::read(offer.dir.join(STATE_FILE))
        .map_err(|e| Error::io("read", offer.dir.join(STATE_FILE), e))?;
    files.push((
        STATE_FILE.into(),
        state.len() as u64,
        crc32c::crc32c(&state),
    ));
    seal(root, &offer.dir, offer.step, files)?;
    Ok(true)
}

/// A file's manifest entry: name, size, crc32c.
type ManifestEntry = (String, u64, u32);

/// Remove the ranks' reports and the probe from the temporary directory `dir`: a checkpoint
/// holds the files its manifest lists, no others.
fn tidy(dir: &Path, ranks: usize) {
    for r in 0..ranks {
        let _ = std::fs::remove_file(part_file(dir, r));
    }
    let _ = std::fs::remove_file(dir.join(PROBE));
}

/// Every rank's report (in rank order) into each tensor file's (name, size, crc32c), the units'
/// checksums combined in unit order; and the slowest rank's seconds. A rank that failed is named
/// (`hosts`: every rank's host).
fn combine(
    reports: &[Wrote],
    names: &[(String, ShardKind); 3],
    ranges: &[[(u64, u64); 3]],
    hosts: &[String],
) -> Result<(f64, Vec<ManifestEntry>)> {
    let mut crcs: Vec<Option<[u32; 3]>> = vec![None; ranges.len()];
    let mut secs = 0f64;
    for (r, wrote) in reports.iter().enumerate() {
        let host = hosts.get(r).map_or("?", String::as_str);
        let (units, took) = wrote.as_ref().map_err(|why| {
            Error::system(
                "checkpoint",
                format!("rank {r} (on {host}) write its units into the checkpoint"),
                why,
            )
            .with_fix(format!(
                "make room on (or repair) the disk rank {r} writes to on {host}; the earlier \
                 checkpoints are whole, and `--resume auto` carries on from the newest"
            ))
        })?;
        secs = secs.max(*took);
        for &(u, c) in units {
            match crcs.get_mut(u) {
                Some(slot @ None) => *slot = Some(c),
                _ => {
                    return Err(Error::internal(
                        "checkpoint",
                        format!("rank {r} wrote unit {u}, which is not its to write"),
                    ))
                }
            }
        }
    }
    let mut files = Vec::new();
    for (k, (name, _)) in names.iter().enumerate() {
        let (mut crc, mut size) = (0u32, 0u64);
        for (u, range) in ranges.iter().enumerate() {
            let c = crcs[u]
                .ok_or_else(|| Error::internal("checkpoint", format!("no rank wrote unit {u}")))?;
            crc = crc32c::crc32c_combine(crc, c[k], range[k].1 as usize);
            size += range[k].1;
        }
        files.push((name.clone(), size, crc));
    }
    Ok((secs, files))
}

/// Rank 0's part of a checkpoint being written: the temporary directory offered to the
/// others, and what sealing it takes.
#[derive(Debug)]
struct Sealing {
    root: PathBuf,
    tmp: PathBuf,
    final_dir: PathBuf,
    state: TrainState,
    keep: usize,
    names: [(String, ShardKind); 3],
    ranges: Vec<[(u64, u64); 3]>,
    offer: Offer,
    /// state.json's manifest entry (written as the directory was made).
    state_entry: ManifestEntry,
}

/// Rank 0: the temporary directory with the three files at their full lengths (the ranks fill
/// them) and the probe holding a fresh token.
fn prepare(
    w: JobCheckpoint,
    names: &[(String, ShardKind); 3],
    ranges: &[[(u64, u64); 3]],
) -> Result<Sealing> {
    let root = &w.root;
    std::fs::create_dir_all(root).map_err(|e| Error::io("create checkpoint directory", root, e))?;
    let (tmp, final_dir) = temporary(root, w.state.step);
    let token = crate::util::lock::random_id();
    let _ = std::fs::remove_dir_all(&tmp);
    let made = (|| -> Result<ManifestEntry> {
        std::fs::create_dir(&tmp).map_err(|e| Error::io("create", &tmp, e))?;
        for (k, (name, _)) in names.iter().enumerate() {
            let path = tmp.join(name);
            let total = ranges.last().map_or(0, |r| r[k].0 + r[k].1);
            std::fs::File::create(&path)
                .and_then(|f| f.set_len(total))
                .map_err(|e| Error::io("create", &path, e))?;
        }
        let state_entry = write_state(&tmp, &w.state)?;
        let probe = tmp.join(PROBE);
        std::fs::write(&probe, &token).map_err(|e| Error::io("write", &probe, e))?;
        Ok(state_entry)
    })();
    let state_entry = made.inspect_err(|_| {
        let _ = std::fs::remove_dir_all(&tmp);
    })?;
    Ok(Sealing {
        state_entry,
        offer: Offer {
            dir: tmp.clone(),
            step: w.state.step,
            token,
        },
        root: w.root,
        tmp,
        final_dir,
        state: w.state,
        keep: w.keep,
        names: names.clone(),
        ranges: ranges.to_vec(),
    })
}

/// A sharded job's checkpoint being written by every rank beside the next steps
/// ([`start_job`]).
#[derive(Debug)]
pub struct JobInFlight {
    store: HostStore,
    /// This rank's units' checksums and how long it took, or why it failed; whether it sealed.
    thread: JoinHandle<Report>,
    /// The store's snapshot wait when the write started.
    waited_before: Duration,
    /// What training waited before the snapshot could be taken.
    waited_to_start: Duration,
    /// Rank 0's part.
    sealing: Option<Sealing>,
}

impl JobInFlight {
    /// Whether this rank's writes have ended (its [`JobInFlight::finish`] will not wait).
    pub fn is_finished(&self) -> bool {
        self.thread.is_finished()
    }

    /// Wait for this rank's writes alone, without the other ranks (a rank ending with an
    /// error): its report goes into the directory, and if the other ranks' writes had ended
    /// already, the checkpoint is sealed there, whole. (The job's abort that follows ends the
    /// others' writes wherever they are: a checkpoint they had not finished is left unsealed,
    /// and the earlier ones stand.) Whether this rank's writes succeeded.
    pub fn end_alone(self) -> bool {
        self.thread.join().is_ok_and(|r| r.wrote.is_ok())
    }

    /// End the checkpoint, on every rank at once: wait for this rank's writes, gather every
    /// rank's checksums; rank 0 combines them, seals the checkpoint (state, manifest, rename)
    /// and reports it (`Some`; the others `None`), or fails it naming a rank whose writes
    /// failed — the earlier checkpoints whole.
    pub fn finish(self, world: &dyn Collective) -> Result<Option<Written>> {
        let t0 = Instant::now();
        let mine = self.thread.join().unwrap_or_else(|_| Report {
            wrote: Err("its checkpoint writer thread panicked".into()),
            sealed: false,
        });
        let joined = t0.elapsed();
        let mine = serde_json::to_vec(&mine)
            .map_err(|e| Error::system("serde_json", "a rank's report", e))?;
        let all = world.all_gather_bytes(&mine)?;
        let Some(s) = self.sealing else {
            return Ok(None);
        };
        let sealed = (|| -> Result<f64> {
            let reports: Vec<Report> = all
                .iter()
                .map(|b| serde_json::from_slice(b))
                .collect::<std::result::Result<_, _>>()
                .map_err(|e| Error::internal("checkpoint", format!("a rank's report: {e}")))?;
            let sealed = reports.iter().any(|r| r.sealed);
            let wrote: Vec<Wrote> = reports.into_iter().map(|r| r.wrote).collect();
            let (secs, mut files) = combine(&wrote, &s.names, &s.ranges, world.hosts())?;
            // Sealed already by the rank whose writes ended last, unless that failed.
            if !sealed {
                tidy(&s.tmp, wrote.len());
                files.push(s.state_entry.clone());
                seal(&s.root, &s.tmp, s.state.step, files)?;
            }
            Ok(secs)
        })();
        let _ = std::fs::remove_file(claim_path(&s.tmp));
        if sealed.is_err() {
            let _ = std::fs::remove_dir_all(&s.tmp);
        }
        let secs = sealed?;
        prune(&s.root, &s.state, s.keep)?;
        let updates = self
            .store
            .snapshot_wait()
            .saturating_sub(self.waited_before);
        Ok(Some(Written {
            dir: s.final_dir,
            step: s.state.step,
            bytes: self.store.layout().checkpoint_bytes(),
            secs,
            waited: (self.waited_to_start + updates + joined).as_secs_f64(),
        }))
    }
}

fn encode(wrote: &Wrote) -> Result<Vec<u8>> {
    serde_json::to_vec(wrote).map_err(|e| Error::system("serde_json", "a rank's report", e))
}

/// Whether this rank sees rank 0's offered directory: its probe with rank 0's token, and the
/// tensor files open for writing. Its error is said after "rank R (on HOST)".
fn sees(offer: &Offer, names: &[(String, ShardKind); 3]) -> Result<()> {
    let probe = offer.dir.join(PROBE);
    let token = crate::util::failpoint::check("checkpoint-shared")
        .and_then(|()| std::fs::read_to_string(&probe))
        .map_err(|e| Error::io("does not see", &probe, e))?;
    if token != offer.token {
        return Err(Error::bad_input(
            "sees another probe",
            probe.display().to_string(),
            "not rank 0's: its own filesystem at the same path",
            None,
        ));
    }
    for (name, _) in names {
        let path = offer.dir.join(name);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(|e| Error::io("cannot write", &path, e))?;
    }
    Ok(())
}

/// Write every unit `snapshot` holds (this rank's) into the three files under `dir` at their
/// ranges, each unit thawed once written; each unit's crc32c per file.
fn write_units(
    mut snapshot: Snapshot,
    dir: &Path,
    names: &[(String, ShardKind); 3],
    ranges: &[[(u64, u64); 3]],
) -> Result<Vec<(usize, [u32; 3])>> {
    let owners = snapshot.store().layout().owners.clone().ok_or_else(|| {
        Error::internal("checkpoint", "a job's checkpoint needs the units' owners")
    })?;
    let mut wrote = Vec::new();
    for u in (0..ranges.len()).filter(|&u| owners.holds(u)) {
        crate::util::failpoint::pause("checkpoint-unit");
        let paths: [PathBuf; 3] = std::array::from_fn(|k| dir.join(&names[k].0));
        let mut out = Vec::new();
        for (k, path) in paths.iter().enumerate() {
            let (at, len) = ranges[u][k];
            out.push(DirectWriter::region(path, at, len).map_err(|e| Error::io("open", path, e))?);
        }
        let mut crcs = [0u32; 3];
        let unit = snapshot.read(u)?;
        unit_pieces(&unit, true, true, |k, bytes| {
            crcs[k] = crc32c::crc32c_append(crcs[k], bytes);
            crate::util::failpoint::check("checkpoint")
                .and_then(|()| out[k].write_all(bytes))
                .map_err(|e| Error::io("write", &paths[k], e))
        })?;
        // Its bytes are in the writers' blocks: thawed, its next update may run.
        drop(unit);
        for (w, path) in out.into_iter().zip(&paths) {
            w.finish()
                .map_err(|e| Error::io("write and fsync", path, e))?;
        }
        wrote.push((u, crcs));
    }
    Ok(wrote)
}

/// A sharded job's rank other than 0, when rank 0 writes the checkpoint alone (a rank does not
/// see its directory): send rank 0 the state of every unit this rank holds, in unit order —
/// its fp32 params (stage 3; planes joined), then m, then v — in [`super::write::MOMENT_CHUNK`] messages, as
/// rank 0's writer takes them. Every unit must be idle.
pub fn send_moments(store: &HostStore, world: &dyn Collective) -> Result<()> {
    let layout = store.layout();
    let Some(owners) = layout.owners.as_ref() else {
        return Ok(());
    };
    let mine = |u: usize| owners.holds(u) && owners.rank != 0;
    let mut snapshot = store.snapshot_units(mine)?;
    for u in (0..store.num_units()).filter(|&u| mine(u)) {
        let unit = snapshot.read(u)?;
        unit_pieces(&unit, owners.params, true, |_, bytes| {
            world.send_bytes(0, bytes)
        })?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The units' ranges tile each file in unit order, of the sizes a process alone writes.
    #[test]
    fn ranges_tile_each_file() {
        use crate::store::layout::Mode;
        let cfg = crate::model::config::ModelConfig::from_json_str(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":100,
            "num_hidden_layers":3,"num_attention_heads":4,"num_key_value_heads":2,
            "vocab_size":1003,"tie_word_embeddings":false}"#,
            "t",
        )
        .unwrap();
        for adam in [AdamState::Fp32, AdamState::Bf16, AdamState::Int8] {
            let layout = StateLayout::new(&cfg, Mode::Exact).with_adam_state(adam);
            let r = ranges(&layout, adam);
            assert_eq!(r.len(), layout.units.len());
            let total: u64 = r.iter().flat_map(|u| u.iter().map(|x| x.1)).sum();
            assert_eq!(total, layout.checkpoint_bytes());
            for k in 0..3 {
                assert_eq!(r[0][k].0, 0);
                for w in r.windows(2) {
                    assert_eq!(w[0][k].0 + w[0][k].1, w[1][k].0);
                }
            }
        }
    }
}
