//! Training checkpoints: fp32 params and Adam m/v of every unit (in the run's `--adam-state`
//! format, exactly as held: a resumed run is bit-identical), the step, the data cursor, the
//! configuration and the run's identity. Written into a temporary directory, every file fsynced
//! and checksummed (crc32c) in a manifest written last, then renamed into place; the run's last K
//! are kept (another run's are never touched). A checkpoint whose manifest is missing, omits a
//! file, or whose files do not match it is never loaded, and why is named: missing, unreadable
//! (permissions), truncated or corrupt, each with its own fix.

use super::config::TrainConfig;
use super::data::Cursor;
use crate::model::config::ModelConfig;
use crate::optim::moments;
use crate::store::layout::{AdamState, ShardKind};
use crate::store::HostStore;
use crate::util::progress::{Meter, Unit};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::io::Read;
use std::path::{Path, PathBuf};

/// Checkpoint format version written (2: run identity and configuration history; 3: moment
/// files named by their format).
pub const FORMAT: u32 = 3;
mod params;
mod shards;
mod verify;
mod write;

pub use params::CheckpointParams;
pub use shards::{send_moments, start_job, JobCheckpoint, JobInFlight, JobStarted};
pub use verify::{check_complete, verify, verify_params, Damage};
use verify::{manifest, refuse, refuse_naming_older, Manifest, MANIFEST};
pub use write::{owns, remove_leftovers, save, start, InFlight, Written};

const PARAMS_FILE: &str = "params.f32";

/// The tensor files of a checkpoint whose moments are stored as `state`: the params, then m and
/// v (per unit, the bytes the host store holds: fp32, bf16, or int8 codes then block scales).
fn files(state: AdamState) -> [(String, ShardKind); 3] {
    let ext = match state {
        AdamState::Fp32 => "f32",
        AdamState::Bf16 => "bf16",
        AdamState::Int8 => "int8",
    };
    [
        (PARAMS_FILE.to_owned(), ShardKind::Params),
        (format!("adam_m.{ext}"), ShardKind::AdamM),
        (format!("adam_v.{ext}"), ShardKind::AdamV),
    ]
}

/// One setting changed when a run was resumed.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ConfigChange {
    /// The step the resumed run started after.
    pub step: u64,
    /// The setting.
    pub key: String,
    /// Its value before (as JSON text).
    pub from: String,
    /// Its value after.
    pub to: String,
}

/// Everything besides the tensors.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct TrainState {
    /// Format version.
    pub format: u32,
    /// The run that wrote it (absent in format 1). A run prunes only its own checkpoints.
    #[serde(default)]
    pub run_id: Option<String>,
    /// Optimizer steps done.
    pub step: u64,
    /// Data position after `step`.
    pub cursor: Cursor,
    /// Last global gradient norm (lean clipping uses it).
    pub prev_norm: Option<f64>,
    /// The model.
    pub model: ModelConfig,
    /// The run's configuration.
    pub config: TrainConfig,
    /// Settings changed on each resume, oldest first.
    #[serde(default)]
    pub changes: Vec<ConfigChange>,
}

/// Finished checkpoint directories under `root`, as (step, path), in no particular order.
pub fn list(root: &Path) -> Result<Vec<(u64, PathBuf)>> {
    let rd = match std::fs::read_dir(root) {
        Ok(r) => r,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(Error::io("list checkpoints", root, e)),
    };
    Ok(rd
        .flatten()
        .filter_map(|e| {
            let n = e.file_name().to_string_lossy().into_owned();
            let step = n.strip_prefix("step-")?.parse::<u64>().ok()?;
            Some((step, e.path()))
        })
        .collect())
}

/// The newest checkpoint under `root`, verified. `Ok(None)` if there is none; an error naming
/// the newest good one if the newest is damaged or unreadable.
pub fn latest(root: &Path) -> Result<Option<PathBuf>> {
    // A live run may prune the newest seen between listing and reading: list again.
    for _ in 0..3 {
        if let Some(found) = latest_once(root)? {
            return Ok(found);
        }
    }
    Err(refuse(root, &Damage::Gone, None))
}

/// [`latest`], or `None` when the newest was deleted while it was read.
fn latest_once(root: &Path) -> Result<Option<Option<PathBuf>>> {
    let mut all = list(root)?;
    all.sort();
    let Some((_, newest)) = all.last().cloned() else {
        return Ok(Some(None));
    };
    match check_complete(&newest) {
        Ok(()) => Ok(Some(Some(newest))),
        Err(Damage::Gone) => Ok(None),
        Err(damage) => Err(refuse_naming_older(&newest, &damage)),
    }
}
/// Whether `path` is one checkpoint (a `step-…` directory) rather than a run's checkpoint
/// directory.
pub fn is_checkpoint(path: &Path) -> bool {
    path.join(MANIFEST).exists() || path.join(PARAMS_FILE).exists()
}

/// The checkpoint `path` names: itself when it is one, else the newest in it (a run's
/// `--checkpoint-dir`), verified as [`latest`] does.
pub fn one_or_latest(path: &Path) -> Result<PathBuf> {
    if !path.exists() {
        return Err(Error::bad_input(
            "checkpoint",
            path.display().to_string(),
            "does not exist",
            Some("check the path: pass a checkpoint directory (step-…) or the --checkpoint-dir of a run"),
        ));
    }
    if is_checkpoint(path) {
        return Ok(path.to_owned());
    }
    latest(path)?.ok_or_else(|| {
        Error::bad_input(
            "checkpoint",
            path.display().to_string(),
            "contains no checkpoint",
            Some("pass a checkpoint directory (step-…) or the --checkpoint-dir of a run"),
        )
    })
}

/// Check the checkpoint in `dir` is complete ([`check_complete`]) and read its state (the
/// tensors are read, and checked against their checksums, by [`load`]).
pub fn open(dir: &Path) -> Result<TrainState> {
    check_complete(dir).map_err(|d| refuse(dir, &d, None))?;
    read_state(dir)
}

/// A checkpoint's `state.json` (step, cursor, model and run configuration), without the tensors.
pub fn read_state(dir: &Path) -> Result<TrainState> {
    let path = dir.join("state.json");
    let bytes = std::fs::read(&path).map_err(|e| Error::io("read", &path, e))?;
    let state: TrainState = serde_json::from_slice(&bytes).map_err(|e| {
        Error::bad_input(
            "checkpoint",
            dir.display().to_string(),
            format!("state.json: {e}"),
            None,
        )
    })?;
    state
        .model
        .check_sizes(&format!("{} (state.json)", dir.display()))?;
    Ok(state)
}

/// How Adam moments were restored.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MomentsRestored {
    /// As saved (bit-identical).
    Exact,
    /// Converted from the checkpoint's format to the run's.
    Converted {
        /// The checkpoint's.
        from: AdamState,
        /// The run's.
        to: AdamState,
    },
}

/// Load the fp32 params of checkpoint `dir` (complete: [`open`]) into `store`'s params alone —
/// its moments are left as they are (generation reads none) — reading the params file once,
/// checked against its size and checksum on the way (a damaged file is refused naming the newest
/// good older checkpoint). Returns the checkpoint's state.
pub fn load_params(dir: &Path, store: &HostStore) -> Result<TrainState> {
    load_files(dir, store, Some(1), &crate::dist::Solo::default()).map(|(state, _)| state)
}

/// The files the ranks read their own units of ([`Source::Held`]), checked by the ranks
/// together: every unit's crc32c from the rank that read it, combined in unit order, against
/// the manifest's checksum of the file. Collective (every rank reads the same files this way).
fn check_held(
    dir: &Path,
    sources: &[(PathBuf, String, Source)],
    ranges: &[[(u64, u64); 3]],
    listed: &Manifest,
    world: &dyn crate::dist::Collective,
) -> Result<()> {
    if !sources.iter().any(|s| matches!(s.2, Source::Held(_))) {
        return Ok(());
    }
    let mine: Vec<(usize, usize, u32)> = sources
        .iter()
        .enumerate()
        .flat_map(|(k, (_, _, source))| match source {
            Source::Held(crcs) => crcs.iter().map(|&(u, c)| (k, u, c)).collect(),
            Source::Whole(_) => Vec::new(),
        })
        .collect();
    let mine = serde_json::to_vec(&mine)
        .map_err(|e| Error::system("serde_json", "the units' checksums", e))?;
    let mut crcs = vec![[None::<u32>; 3]; ranges.len()];
    for (r, theirs) in world.all_gather_bytes(&mine)?.iter().enumerate() {
        let theirs: Vec<(usize, usize, u32)> = serde_json::from_slice(theirs)
            .map_err(|e| Error::internal("checkpoint", format!("rank {r}'s checksums: {e}")))?;
        for (k, u, c) in theirs {
            match crcs.get_mut(u).and_then(|x| x.get_mut(k)) {
                Some(slot @ None) => *slot = Some(c),
                _ => {
                    return Err(Error::internal(
                        "checkpoint",
                        format!("rank {r} read unit {u} of file {k}, which another rank read"),
                    ))
                }
            }
        }
    }
    for (k, (_, name, source)) in sources.iter().enumerate() {
        if !matches!(source, Source::Held(_)) {
            continue;
        }
        let mut crc = 0u32;
        for (u, range) in ranges.iter().enumerate() {
            let c = crcs[u][k].ok_or_else(|| {
                Error::internal("checkpoint", format!("no rank read unit {u} of {name}"))
            })?;
            crc = crc32c::crc32c_combine(crc, c, range[k].1 as usize);
        }
        match listed.files.iter().find(|f| f.0 == *name) {
            None => return Err(refuse_naming_older(dir, &Damage::Incomplete(name.clone()))),
            Some(f) if f.2 != crc => {
                return Err(refuse_naming_older(dir, &Damage::Corrupt(name.clone())))
            }
            Some(_) => {}
        }
    }
    Ok(())
}

/// The moment format a checkpoint's state records (checkpoints before `--adam-state`: fp32).
pub fn adam_state_of(state: &TrainState) -> AdamState {
    state.config.adam_state.unwrap_or_default()
}

/// A checkpoint file read front to back with its crc32c taken on the way.
struct Checksummed {
    name: String,
    r: crate::util::direct::DirectReader,
    crc: u32,
    bytes: u64,
}

impl Checksummed {
    fn new(name: String, r: crate::util::direct::DirectReader) -> Self {
        Checksummed {
            name,
            r,
            crc: 0,
            bytes: 0,
        }
    }

    fn read_exact(&mut self, buf: &mut [u8]) -> std::io::Result<()> {
        self.r.read_exact(buf)?;
        self.crc = crc32c::crc32c_append(self.crc, buf);
        self.bytes += buf.len() as u64;
        Ok(())
    }

    /// The file read to its end against `manifest`'s size and checksum for it: `Err(None)`
    /// when the rest cannot be read.
    fn finish(&mut self, manifest: &Manifest) -> std::result::Result<(), Option<Damage>> {
        let mut rest = vec![0u8; 1 << 16];
        loop {
            match self.r.read(&mut rest) {
                Ok(0) => break,
                Ok(n) => {
                    self.crc = crc32c::crc32c_append(self.crc, &rest[..n]);
                    self.bytes += n as u64;
                }
                Err(e) => return Err(Some(Damage::Unreadable(self.name.clone(), e.to_string()))),
            }
        }
        let Some((_, size, crc)) = manifest.files.iter().find(|(n, _, _)| *n == self.name) else {
            return Err(Some(Damage::Incomplete(self.name.clone())));
        };
        if self.bytes != *size {
            return Err(Some(Damage::WrongSize {
                file: self.name.clone(),
                have: self.bytes,
                want: *size,
            }));
        }
        if self.crc != *crc {
            return Err(Some(Damage::Corrupt(self.name.clone())));
        }
        Ok(())
    }
}

/// Load a complete checkpoint ([`check_complete`]) into `store`, reading each file once and
/// checking it against its size and checksum on the way (a damaged file is refused naming the
/// newest good older checkpoint, before training); returns its state and whether the moments
/// were converted (the checkpoint's `--adam-state` differs from the store's: fp32 → compact
/// quantises, compact → fp32 dequantises).
pub fn load(dir: &Path, store: &HostStore) -> Result<(TrainState, MomentsRestored)> {
    load_job(dir, store, &crate::dist::Solo::default())
}

/// [`load`] by every rank of a job (`world`) at once. A rank whose store holds part of a
/// file's units (ZeRO stage 1's moments; stage 3's params too) reads only those units' bytes,
/// whatever number of ranks wrote the checkpoint (the units dealt anew: re-sharded as it
/// loads), and the ranks check the file's checksum together: each unit's crc32c from the rank
/// that read it, combined in unit order. The job reads each such file once, not once per rank.
pub fn load_job(
    dir: &Path,
    store: &HostStore,
    world: &dyn crate::dist::Collective,
) -> Result<(TrainState, MomentsRestored)> {
    load_files(dir, store, None, world).map_err(|e| match dir.is_dir() {
        true => e,
        false => refuse(dir, &Damage::Gone, None),
    })
}

/// How a rank reads one of a checkpoint's files.
enum Source {
    /// Every byte, front to back, checked here.
    Whole(Checksummed),
    /// The units this rank holds, each through its own range; each one's crc32c, to combine
    /// with the other ranks'.
    Held(Vec<(usize, u32)>),
}

/// [`load`], or with `first: Some(n)` the first `n` of the checkpoint's files alone (1: the
/// params, for [`load_params`]: the store's moments are left as they are).
fn load_files(
    dir: &Path,
    store: &HostStore,
    first: Option<usize>,
    world: &dyn crate::dist::Collective,
) -> Result<(TrainState, MomentsRestored)> {
    let state = open(dir)?;
    if state.model != store.layout().config {
        return Err(Error::bad_input(
            "checkpoint",
            dir.display().to_string(),
            "was written for a different model configuration",
            Some("resume with the checkpoint's own model settings"),
        ));
    }
    let (saved, held) = (adam_state_of(&state), store.layout().adam);
    let layout = store.layout();
    // Each unit's bytes in each file, as the checkpoint holds them.
    let ranges = shards::ranges(layout, saved);
    // Whether this rank holds unit u's bytes of file k (0 params, 1 m, 2 v); whether it holds
    // only some units' of file k (reads them alone: every other file it reads whole).
    let kinds = files(saved).map(|(_, kind)| kind);
    let holds = |u: usize, k: usize| layout.holds(u, kinds[k]);
    let owned = |k: usize| layout.owners.as_ref().is_some_and(|o| k > 0 || o.params);
    // One pass over the units with the three files open: a spilled unit is staged and written
    // back once.
    let listed = manifest(dir).map_err(|d| refuse(dir, &d, None))?;
    let mut sources = Vec::new();
    for (k, (name, _)) in files(saved)
        .into_iter()
        .take(first.unwrap_or(usize::MAX))
        .enumerate()
    {
        let path = dir.join(&name);
        let source = match owned(k) {
            // Its size first: a range past a cut-short file's end is damage, not an I/O error.
            true => {
                let have = std::fs::metadata(&path)
                    .map_err(|e| Error::io("open", &path, e))?
                    .len();
                let want = ranges.last().map_or(0, |r| r[k].0 + r[k].1);
                if have != want {
                    let d = Damage::WrongSize {
                        file: name.clone(),
                        have,
                        want,
                    };
                    return Err(refuse_naming_older(dir, &d));
                }
                Source::Held(Vec::new())
            }
            // Past the page cache in 8 MiB blocks, the next read while this one is consumed;
            // each file's checksum is taken as it is read (the one read of a resume).
            false => Source::Whole(Checksummed::new(
                name.clone(),
                crate::util::direct::DirectReader::open(&path)
                    .map_err(|e| Error::io("open", &path, e))?,
            )),
        };
        sources.push((path, name, source));
    }
    let mut scratch = Vec::new();
    let total: u64 = sources
        .iter()
        .enumerate()
        .map(|(k, (_, name, source))| match source {
            Source::Whole(_) => listed
                .files
                .iter()
                .find(|(n, _, _)| n == name)
                .map_or(0, |f| f.1),
            Source::Held(_) => (0..ranges.len())
                .filter(|&u| holds(u, k))
                .map(|u| ranges[u][k].1)
                .sum(),
        })
        .sum();
    let meter = Meter::start("checkpoint read", total, Unit::Bytes);
    for (u, unit_ranges) in ranges.iter().enumerate() {
        let mut g = store.take(u)?;
        g.stage()?;
        let numel = g.numel();
        let mut sh = g.shards()?;
        // The file holds fp32 params: read in place, or into `fp32` and split into planes.
        let mut fp32 = Vec::new();
        let params: &mut [f32] = match sh.params.as_fp32() {
            Some(p) => p,
            None => {
                fp32.resize(numel, 0f32);
                &mut fp32
            }
        };
        // SAFETY: byte view of an f32 slice (any bytes form valid f32s).
        let params = unsafe {
            std::slice::from_raw_parts_mut(params.as_mut_ptr().cast::<u8>(), params.len() * 4)
        };
        // The moments' map (signed for m, unsigned for v); none for the params.
        let targets = [(params, None), (sh.m, Some(true)), (sh.v, Some(false))];
        for (k, ((path, name, source), (dst, moment))) in
            sources.iter_mut().zip(targets).enumerate()
        {
            // A file this rank reads its own units of: this unit's range, if it holds it.
            let mut range;
            let f = match source {
                Source::Whole(f) => f,
                Source::Held(_) if !holds(u, k) => continue,
                Source::Held(_) => {
                    let (at, len) = unit_ranges[k];
                    range = Checksummed::new(
                        name.clone(),
                        crate::util::direct::DirectReader::range(path, at, len)
                            .map_err(|e| Error::io("open", path.as_path(), e))?,
                    );
                    &mut range
                }
            };
            let before = f.bytes;
            let read = |f: &mut Checksummed, buf: &mut [u8]| {
                f.read_exact(buf)
                    .map_err(|e| Error::io("read", path.as_path(), e))
            };
            // A file read whole is one this rank holds every unit of.
            match moment {
                Some(signed) if saved != held => {
                    scratch.resize(saved.moment_bytes_unaligned(numel), 0);
                    read(f, &mut scratch)?;
                    let x = moments::to_f32(saved, &scratch, numel, signed);
                    moments::from_f32(held, &x, dst, signed);
                }
                _ => read(f, dst)?,
            }
            meter.add(f.bytes - before);
            let crc = f.crc;
            if let Source::Held(crcs) = source {
                crcs.push((u, crc));
            }
        }
        if !fp32.is_empty() && holds(u, 0) {
            sh.params.write(0, &fp32);
        }
        g.unstage(); // written back to NVMe if spilled
    }
    // Every byte of each file read, and what the manifest says it holds.
    for (path, _, source) in &mut sources {
        if let Source::Whole(f) = source {
            f.finish(&listed).map_err(|d| match d {
                Some(d) => refuse_naming_older(dir, &d),
                None => Error::io("read", path.as_path(), std::io::Error::other("read failed")),
            })?;
        }
    }
    check_held(dir, &sources, &ranges, &listed, world)?;
    meter.finish();
    let how = if saved == held {
        MomentsRestored::Exact
    } else {
        MomentsRestored::Converted {
            from: saved,
            to: held,
        }
    };
    Ok((state, how))
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::store::layout::{MasterFormat, Mode, StateLayout};
    use crate::store::placement::{place, RamBudget};
    use crate::store::StoreOptions;
    use crate::topology::{probe, TopologySource};
    use write::discard;

    fn store(master: MasterFormat) -> HostStore {
        let cfg = ModelConfig::from_json_str(
            r#"{"architectures":["LlamaForCausalLM"],"hidden_size":64,"intermediate_size":160,
            "num_hidden_layers":2,"num_attention_heads":4,"num_key_value_heads":2,"vocab_size":301}"#,
            "t",
        )
        .unwrap();
        let layout = StateLayout::new(&cfg, Mode::Exact).with_master(master);
        let machine = probe(&TopologySource::Live).unwrap();
        let p = place(&machine, &layout, None, RamBudget::default()).unwrap();
        HostStore::allocate(layout, p, &StoreOptions::default()).unwrap()
    }

    #[test]
    fn pruning_renames_away_first_and_leftovers_of_dead_writers_are_removed() {
        let root = tempfile::tempdir().unwrap();
        let r = root.path();
        let step = r.join("step-00000004");
        std::fs::create_dir(&step).unwrap();
        std::fs::write(step.join("params.f32"), [0u8; 64]).unwrap();
        discard(r, &step).unwrap();
        assert!(!step.exists());
        assert_eq!(std::fs::read_dir(r).unwrap().count(), 0);
        // What kills leave: an unfinished write, a half-pruned checkpoint; and a live one's.
        let dead = [".step-00000002.pruned-4242", ".step-00000003.tmp-4242"];
        for d in dead {
            std::fs::create_dir(r.join(d)).unwrap();
            std::fs::write(r.join(d).join("adam_m.f32"), [1u8; 8]).unwrap();
        }
        // A sharded job's sealing claim of that unfinished write (a file).
        std::fs::write(r.join(".step-00000003.sealing-4242"), []).unwrap();
        let mine = format!(".step-00000005.tmp-{}", std::process::id());
        std::fs::create_dir(r.join(&mine)).unwrap();
        std::fs::create_dir(r.join("step-00000001")).unwrap();
        assert_eq!(remove_leftovers(r, Some(std::process::id())), 3);
        assert!(!r.join(".step-00000003.sealing-4242").exists());
        assert!(r.join(&mine).exists() && r.join("step-00000001").exists());
        assert_eq!(remove_leftovers(r, None), 1);
        assert!(!r.join(&mine).exists() && r.join("step-00000001").exists());
        // Killed while replacing a checkpoint: the old one, whole, comes back if the new one
        // never took its name; a replaced one whose successor is in place goes.
        std::fs::create_dir(r.join(".step-00000006.replaced-4242")).unwrap();
        std::fs::write(r.join(".step-00000006.replaced-4242/params.f32"), [2u8; 8]).unwrap();
        std::fs::create_dir(r.join(".step-00000001.replaced-4242")).unwrap();
        assert_eq!(remove_leftovers(r, None), 1);
        assert_eq!(
            std::fs::read(r.join("step-00000006/params.f32")).unwrap(),
            [2u8; 8]
        );
        assert!(!r.join(".step-00000001.replaced-4242").exists());
    }

    #[test]
    fn a_checkpoint_deleted_while_read_is_gone_not_damaged() {
        let root = tempfile::tempdir().unwrap();
        let gone = root.path().join("step-00000007");
        assert_eq!(verify(&gone), Err(Damage::Gone));
        assert!(!Damage::Gone.is_damage());
        let e = open(&gone).unwrap_err().to_string();
        assert!(
            e.contains("deleted while it was being read") && e.contains("pruned"),
            "{e}"
        );
        assert!(!e.contains("damaged"), "{e}");
    }

    fn values(u: usize, n: usize) -> Vec<f32> {
        // Every kind of value the planes must carry: random, ties, ±0, ±Inf, the largest.
        let mut v = crate::util::uniform(n, 31 + u as u64, 2.0);
        let special = [
            0.0,
            -0.0,
            f32::INFINITY,
            f32::NEG_INFINITY,
            f32::MAX,
            f32::from_bits(0x3f80_8000),
            f32::from_bits(0xbf7f_8001),
        ];
        v[..special.len()].copy_from_slice(&special);
        v
    }

    fn state(model: &ModelConfig) -> TrainState {
        TrainState {
            format: FORMAT,
            run_id: Some("r".into()),
            step: 3,
            cursor: Cursor::default(),
            prev_norm: None,
            model: model.clone(),
            config: TrainConfig::default(),
            changes: Vec::new(),
        }
    }

    /// A checkpoint holds fp32 params whatever the master's format: the files written from a
    /// planes store equal those from an fp32 store holding the same values, byte for byte, and
    /// either loads into either.
    #[test]
    fn planes_checkpoints_are_the_fp32_bytes() {
        let (fp32, planes) = (store(MasterFormat::Fp32), store(MasterFormat::Planes));
        for s in [&fp32, &planes] {
            for u in 0..s.num_units() {
                let mut g = s.take(u).unwrap();
                let n = g.numel();
                let mut sh = g.shards().unwrap();
                sh.params.write(0, &values(u, n));
                sh.m.fill(7);
                sh.v.fill(9);
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let st = state(&fp32.layout().config);
        let a = save(&dir.path().join("a"), &fp32, &st, 1).unwrap();
        let b = save(&dir.path().join("b"), &planes, &st, 1).unwrap();
        for (name, _) in files(AdamState::Fp32) {
            let (x, y) = (
                std::fs::read(a.join(&name)).unwrap(),
                std::fs::read(b.join(&name)).unwrap(),
            );
            assert!(x == y, "{name} differs");
        }
        let fresh = store(MasterFormat::Planes);
        load(&a, &fresh).unwrap();
        for u in 0..fresh.num_units() {
            let mut g = fresh.take(u).unwrap();
            let got = g.master().to_vec();
            let want = values(u, got.len());
            assert!(
                got.iter()
                    .zip(&want)
                    .all(|(x, y)| x.to_bits() == y.to_bits()),
                "unit {u}"
            );
        }
    }
}
