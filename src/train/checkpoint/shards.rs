//! The checkpoint of a job whose state is sharded (ZeRO stage 1 or 3), written by its ranks at
//! once. Where every rank sees the checkpoint's directory (ranks of one host, or hosts sharing a
//! filesystem, as DeepSpeed's sharded checkpoints ask), each rank writes the units it holds —
//! their params, m and v — straight into the checkpoint's three files at the units' offsets
//! ([`DirectWriter::region`]) and tells rank 0 each unit's crc32c per file; rank 0 combines them
//! into each file's checksum and seals the checkpoint (state, manifest, rename) as a process
//! alone does. So the checkpoint is the one-process format byte for byte — it resumes on any
//! number of ranks, re-sharded as it loads, and exports without any rank — and each rank writes
//! its 1/N at its own disk's (or link's) rate instead of sending it through rank 0. Where a rank
//! does not see the directory (hosts with disks of their own), rank 0 takes the units it lacks
//! from their ranks and writes them itself ([`send_moments`]), and the report names the rank.

use super::write::{prune, seal, temporary, write, MOMENT_CHUNK};
use super::{files, TrainState};
use crate::dist::Collective;
use crate::store::layout::{AdamState, ShardKind, StateLayout};
use crate::store::HostStore;
use crate::util::direct::DirectWriter;
use crate::util::progress::{Meter, Unit};
use crate::{Error, Result};
use serde::{Deserialize, Serialize};
use std::io::Write;
use std::path::{Path, PathBuf};

/// How a sharded job's checkpoint was written.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum JobWrite {
    /// Every rank wrote the units it holds into the checkpoint's files.
    ByRanks,
    /// Rank 0 wrote it all, the units it lacks sent by their ranks: `why` names the ranks that
    /// could not write into the directory.
    Gathered {
        /// Which ranks did not see the directory, and why.
        why: String,
    },
}

impl JobWrite {
    /// How the checkpoint of a job of `ranks` was written, for the line reporting it.
    pub fn describe(&self, ranks: usize) -> String {
        match self {
            JobWrite::ByRanks => format!("each of the {ranks} ranks writing the units it holds"),
            JobWrite::Gathered { why } => format!(
                "rank 0 writing the units the {ranks} ranks sent: {why}, so they could not \
                 write their own"
            ),
        }
    }
}

/// The file rank 0 leaves in the temporary directory for the others to find: a filesystem they
/// share holds it with rank 0's token.
const PROBE: &str = ".ranks-probe";

/// Rank 0's offer: where the checkpoint is being written and the token its probe holds.
#[derive(Debug, Serialize, Deserialize)]
struct Offer {
    dir: PathBuf,
    token: String,
}

/// What a rank wrote: each unit it holds with the crc32c of its bytes in each file, or why it
/// could not.
type Wrote = std::result::Result<Vec<(usize, [u32; 3])>, String>;

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

/// A checkpoint of a sharded job by its rank 0, while every other rank runs
/// [`write_job_shard`]: the job's whole state in the one-process format, written by the ranks
/// into one directory where they all see it, else gathered by rank 0 (see the module). Every
/// unit must be idle on every rank.
pub fn save_job(
    root: &Path,
    store: &HostStore,
    state: &TrainState,
    keep: usize,
    world: &dyn Collective,
) -> Result<(PathBuf, JobWrite)> {
    std::fs::create_dir_all(root).map_err(|e| Error::io("create checkpoint directory", root, e))?;
    let (tmp, final_dir) = temporary(root, state.step);
    let names = files(store.layout().adam);
    let ranges = ranges(store.layout(), store.layout().adam);
    let token = crate::util::lock::random_id();
    let _ = std::fs::remove_dir_all(&tmp);
    let prepared = (|| -> Result<()> {
        std::fs::create_dir(&tmp).map_err(|e| Error::io("create", &tmp, e))?;
        for (k, (name, _)) in names.iter().enumerate() {
            let path = tmp.join(name);
            let total = ranges.last().map_or(0, |r| r[k].0 + r[k].1);
            std::fs::File::create(&path)
                .and_then(|f| f.set_len(total))
                .map_err(|e| Error::io("create", &path, e))?;
        }
        let probe = tmp.join(PROBE);
        std::fs::write(&probe, &token).map_err(|e| Error::io("write", &probe, e))
    })();
    if let Err(e) = prepared {
        let _ = std::fs::remove_dir_all(&tmp);
        return Err(e);
    }
    let offer = serde_json::to_vec(&Offer {
        dir: tmp.clone(),
        token,
    })
    .map_err(|e| Error::system("serde_json", "the checkpoint's offer", e))?;
    world.all_gather_bytes(&offer)?;
    let verdicts = world.all_gather_bytes(&[])?;
    let _ = std::fs::remove_file(tmp.join(PROBE));
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
        let _ = std::fs::remove_dir_all(&tmp);
        let dir = write(root, store.snapshot()?, state, keep, true, Some(world))?;
        return Ok((
            dir,
            JobWrite::Gathered {
                why: refused.join("; "),
            },
        ));
    }
    let mine = write_units(store, &tmp, &names, &ranges, true).map_err(|e| e.to_string());
    let all = world.all_gather_bytes(&encode(&mine)?)?;
    let result = (|| -> Result<()> {
        let mut crcs: Vec<Option<[u32; 3]>> = vec![None; ranges.len()];
        for (r, bytes) in all.iter().enumerate() {
            let wrote: Wrote = serde_json::from_slice(bytes)
                .map_err(|e| Error::internal("checkpoint", format!("rank {r}'s report: {e}")))?;
            let host = hosts.get(r).map_or("?", String::as_str);
            let units = wrote.map_err(|why| {
                Error::system(
                    "checkpoint",
                    format!(
                        "rank {r} (on {host}) write its units into {}",
                        tmp.display()
                    ),
                    why,
                )
                .with_fix(format!(
                    "make room on (or repair) the disk rank {r} writes to on {host}; the earlier \
                     checkpoints are whole, and `--resume auto` carries on from the newest"
                ))
            })?;
            for (u, c) in units {
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
                let c = crcs[u].ok_or_else(|| {
                    Error::internal("checkpoint", format!("no rank wrote unit {u}"))
                })?;
                crc = crc32c::crc32c_combine(crc, c[k], range[k].1 as usize);
                size += range[k].1;
            }
            files.push((name.clone(), size, crc));
        }
        seal(root, &tmp, state, files)
    })();
    if result.is_err() {
        let _ = std::fs::remove_dir_all(&tmp);
    }
    result?;
    prune(root, state, keep)?;
    Ok((final_dir, JobWrite::ByRanks))
}

/// A rank other than 0 of a sharded job while rank 0 runs [`save_job`]: see rank 0's directory
/// and write the units this rank holds into it, or, where any rank cannot, send them to rank 0
/// ([`send_moments`]). A failure to write is reported to rank 0, which fails the checkpoint
/// naming this rank. Every unit must be idle.
pub fn write_job_shard(store: &HostStore, world: &dyn Collective) -> Result<()> {
    let offers = world.all_gather_bytes(&[])?;
    let offer: Offer = serde_json::from_slice(offers.first().map_or(&[][..], |o| &o[..]))
        .map_err(|e| Error::internal("checkpoint", format!("rank 0's offer: {e}")))?;
    let names = files(store.layout().adam);
    let verdict = match sees(&offer, &names) {
        Ok(()) => String::new(),
        Err(why) => why,
    };
    let verdicts = world.all_gather_bytes(verdict.as_bytes())?;
    if verdicts.iter().any(|v| !v.is_empty()) {
        return send_moments(store, world);
    }
    let ranges = ranges(store.layout(), store.layout().adam);
    let mine = write_units(store, &offer.dir, &names, &ranges, false).map_err(|e| e.to_string());
    world.all_gather_bytes(&encode(&mine)?)?;
    Ok(())
}

fn encode(wrote: &Wrote) -> Result<Vec<u8>> {
    serde_json::to_vec(wrote).map_err(|e| Error::system("serde_json", "a rank's report", e))
}

/// Whether this rank sees rank 0's offered directory: its probe with rank 0's token, and the
/// tensor files open for writing. `Err`: why not, said after "rank R (on HOST)".
fn sees(offer: &Offer, names: &[(String, ShardKind); 3]) -> std::result::Result<(), String> {
    let probe = offer.dir.join(PROBE);
    let token = crate::util::failpoint::check("checkpoint-shared")
        .and_then(|()| std::fs::read_to_string(&probe))
        .map_err(|e| format!("does not see {}: {e}", probe.display()))?;
    if token != offer.token {
        return Err(format!(
            "sees another {} there (its own filesystem at the same path)",
            probe.display()
        ));
    }
    for (name, _) in names {
        let path = offer.dir.join(name);
        std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .map_err(|e| format!("cannot write {}: {e}", path.display()))?;
    }
    Ok(())
}

/// Write every unit this rank holds into the three files under `dir` at its ranges (`meter`:
/// report progress); each unit's crc32c per file.
fn write_units(
    store: &HostStore,
    dir: &Path,
    names: &[(String, ShardKind); 3],
    ranges: &[[(u64, u64); 3]],
    meter: bool,
) -> Result<Vec<(usize, [u32; 3])>> {
    let owners = store.layout().owners.as_ref().ok_or_else(|| {
        Error::internal("checkpoint", "a job's checkpoint needs the units' owners")
    })?;
    let mine: Vec<usize> = (0..ranges.len()).filter(|&u| owners.holds(u)).collect();
    let meter = meter.then(|| {
        let bytes = mine
            .iter()
            .map(|&u| ranges[u].iter().map(|r| r.1).sum::<u64>());
        Meter::start("checkpoint write", bytes.sum(), Unit::Bytes)
    });
    let mut wrote = Vec::new();
    for u in mine {
        crate::util::failpoint::pause("checkpoint-unit");
        let paths: [PathBuf; 3] = std::array::from_fn(|k| dir.join(&names[k].0));
        let mut out = Vec::new();
        for (k, path) in paths.iter().enumerate() {
            let (at, len) = ranges[u][k];
            out.push(DirectWriter::region(path, at, len).map_err(|e| Error::io("open", path, e))?);
        }
        let mut crcs = [0u32; 3];
        unit_pieces(store, u, true, |k, bytes| {
            crcs[k] = crc32c::crc32c_append(crcs[k], bytes);
            crate::util::failpoint::check("checkpoint")
                .and_then(|()| out[k].write_all(bytes))
                .map_err(|e| Error::io("write", &paths[k], e))?;
            if let Some(meter) = &meter {
                meter.add(bytes.len() as u64);
            }
            Ok(())
        })?;
        for (w, path) in out.into_iter().zip(&paths) {
            w.finish()
                .map_err(|e| Error::io("write and fsync", path, e))?;
        }
        wrote.push((u, crcs));
    }
    if let Some(meter) = meter {
        meter.finish();
    }
    Ok(wrote)
}

/// Every byte of `unit` a checkpoint holds, in file order, to `put(file, bytes)`: its fp32
/// params (file 0, when `params`; planes joined), then m (1), then v (2), the moments straight
/// from the store, in pieces of at most [`MOMENT_CHUNK`] bytes. The unit must be idle.
fn unit_pieces(
    store: &HostStore,
    unit: usize,
    params: bool,
    mut put: impl FnMut(usize, &[u8]) -> Result<()>,
) -> Result<()> {
    let mut g = store.take(unit)?;
    g.stage()?;
    {
        let sh = g.shards()?;
        if params {
            let mut joined = vec![0f32; MOMENT_CHUNK / 4];
            let params = sh.params.view();
            let mut at = 0;
            while at < params.len() {
                let n = (params.len() - at).min(joined.len());
                params.read(at, &mut joined[..n]);
                // SAFETY: byte view of an f32 slice (no padding; the file is little-endian like
                // the host).
                let bytes =
                    unsafe { std::slice::from_raw_parts(joined.as_ptr().cast::<u8>(), n * 4) };
                put(0, bytes)?;
                at += n;
            }
        }
        for (k, moment) in [(1, &*sh.m), (2, &*sh.v)] {
            for chunk in moment.chunks(MOMENT_CHUNK) {
                put(k, chunk)?;
            }
        }
    }
    g.unstage_clean();
    Ok(())
}

/// A sharded job's rank other than 0, when rank 0 writes the checkpoint alone (a rank does not
/// see its directory): send rank 0 the state of every unit this rank holds, in unit order —
/// its fp32 params (stage 3; planes joined), then m, then v — in [`MOMENT_CHUNK`] messages, as
/// rank 0's writer takes them. Every unit must be idle.
pub fn send_moments(store: &HostStore, world: &dyn Collective) -> Result<()> {
    let layout = store.layout();
    let Some(owners) = layout.owners.as_ref() else {
        return Ok(());
    };
    for u in (0..store.num_units()).filter(|&u| owners.holds(u) && owners.rank != 0) {
        unit_pieces(store, u, owners.params, |_, bytes| {
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
