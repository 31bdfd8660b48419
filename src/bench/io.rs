//! `megatrain bench io`: every phase that moves a model between disk and memory — a checkpoint
//! written, a resume reading it back, an HF export, `--init-from` reading that export — timed
//! through the trainer's own code on a model of the size asked for, next to what `dd` with
//! O_DIRECT writes and reads on the same directory in the same run (the disk's sequential rate:
//! the limit each phase is measured against). Reads start from a cold page cache (each file's
//! cached pages are dropped first, after its fsync), so a read phase is the disk's.

use crate::model::config::{Architecture, ModelConfig};
use crate::store::hf::{ExportDtype, ExportOptions};
use crate::store::layout::{AdamState, Mode, StateLayout};
use crate::store::placement::{place_with_spill, RamBudget, SpillPolicy, SpillRequest};
use crate::store::{HostStore, StoreOptions};
use crate::topology::Machine;
use crate::train::checkpoint::{self, TrainState};
use crate::util::human_bytes;
use crate::{Error, Result};
use serde::Serialize;
use std::os::fd::AsRawFd;
use std::path::{Path, PathBuf};
use std::process::Command;
use std::time::Instant;

/// What to measure.
#[derive(Debug, Clone)]
pub struct IoBench {
    /// Directory on the disk to measure (files are created in a fresh subdirectory and removed).
    pub dir: PathBuf,
    /// Parameters of the model (a Llama-shaped dense model of about this size).
    pub params: u64,
    /// The checkpoint's moment format.
    pub adam_state: AdamState,
    /// The export's dtype.
    pub export_dtype: ExportDtype,
}

/// One phase, next to the disk's rate in its direction.
#[derive(Debug, Clone, Serialize)]
pub struct IoPhase {
    /// What moved.
    pub phase: String,
    /// Bytes moved (the files' sizes).
    pub bytes: u64,
    /// Seconds, from the call to the data being on disk (writes) or in the store (reads).
    pub secs: f64,
    /// `bytes / secs`, GB/s.
    pub gbps: f64,
    /// `dd`'s GB/s in the same direction on the same directory.
    pub limit_gbps: f64,
    /// `gbps / limit_gbps`.
    pub ratio: f64,
}

/// The report.
#[derive(Debug, Clone, Serialize)]
pub struct IoReport {
    /// The directory measured.
    pub dir: PathBuf,
    /// The model's parameters.
    pub params: u64,
    /// `dd`'s sequential write, GB/s (8 MiB blocks, O_DIRECT, fsync at the end).
    pub dd_write_gbps: f64,
    /// `dd`'s sequential read, GB/s (8 MiB blocks, O_DIRECT).
    pub dd_read_gbps: f64,
    /// How `dd` ran (`oflag=direct`, or buffered where the filesystem refuses O_DIRECT).
    pub dd_mode: String,
    /// The phases.
    pub phases: Vec<IoPhase>,
}

/// A Llama-shaped dense model of about `params` parameters: hidden 2048 (512 below 250M), as
/// many layers as reach the size.
fn model_of(params: u64) -> ModelConfig {
    let (h, i, heads, kv, v) = if params >= 250_000_000 {
        (2048, 5632, 16, 4, 32000)
    } else {
        (512, 1408, 8, 8, 8000)
    };
    let of =
        |l: usize| ModelConfig::dense(Architecture::Llama, v, (h, i, l), (heads, kv), false, 1e4);
    let layers = (1..=4096)
        .find(|&l| of(l).num_params() as u64 >= params)
        .unwrap_or(4096);
    of(layers)
}

/// Drop the cached pages of every file under `path` (written and fsynced: clean pages go), so
/// the next read comes from the disk.
fn drop_cache(path: &Path) -> Result<()> {
    if path.is_dir() {
        for e in std::fs::read_dir(path).map_err(|e| Error::io("list", path, e))? {
            let e = e.map_err(|e| Error::io("list", path, e))?;
            drop_cache(&e.path())?;
        }
        return Ok(());
    }
    let f = std::fs::File::open(path).map_err(|e| Error::io("open", path, e))?;
    f.sync_all().map_err(|e| Error::io("fsync", path, e))?;
    // SAFETY: a plain advice call on an open descriptor.
    let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
    if r != 0 {
        return Err(Error::io(
            "drop cached pages",
            path,
            std::io::Error::from_raw_os_error(r),
        ));
    }
    Ok(())
}

/// Bytes of the files under `path`.
fn size_of(path: &Path) -> Result<u64> {
    let m = std::fs::metadata(path).map_err(|e| Error::io("stat", path, e))?;
    if !m.is_dir() {
        return Ok(m.len());
    }
    let mut total = 0;
    for e in std::fs::read_dir(path).map_err(|e| Error::io("list", path, e))? {
        total += size_of(&e.map_err(|e| Error::io("list", path, e))?.path())?;
    }
    Ok(total)
}

/// `dd` with `args`, timed; an error names the command and what it said.
fn dd(args: &[String]) -> Result<f64> {
    let t0 = Instant::now();
    let out = Command::new("dd")
        .args(args)
        .output()
        .map_err(|e| Error::io("run", Path::new("dd"), e).with_fix("install coreutils' dd"))?;
    if !out.status.success() {
        return Err(Error::system(
            "dd",
            args.join(" "),
            String::from_utf8_lossy(&out.stderr).trim().to_owned(),
        ));
    }
    Ok(t0.elapsed().as_secs_f64())
}

/// `dd`'s write and read GB/s for `bytes` (rounded up to 8 MiB blocks) in `dir`, and how it ran.
fn dd_rates(dir: &Path, bytes: u64) -> Result<(f64, f64, String)> {
    const BLOCK: u64 = 8 << 20;
    let count = bytes.div_ceil(BLOCK).max(1);
    let total = count * BLOCK;
    let file = dir.join("dd.bin");
    let of = format!("of={}", file.display());
    let iff = format!("if={}", file.display());
    let base = |a: &str, b: &str| vec![a.to_owned(), b.to_owned(), "bs=8M".to_owned()];
    let mut write = base("if=/dev/zero", &of);
    write.extend([format!("count={count}"), "conv=fsync".into()]);
    let direct_write = [write.clone(), vec!["oflag=direct".into()]].concat();
    let (write_s, mode) = match dd(&direct_write) {
        Ok(s) => (s, "dd bs=8M oflag=direct conv=fsync / iflag=direct"),
        // tmpfs and some network filesystems refuse O_DIRECT.
        Err(_) => (
            dd(&write)?,
            "dd bs=8M conv=fsync / buffered read of dropped pages",
        ),
    };
    drop_cache(&file)?;
    let mut read = base(&iff, "of=/dev/null");
    if mode.contains("iflag=direct") {
        read.push("iflag=direct".into());
    }
    let read_s = dd(&read)?;
    std::fs::remove_file(&file).map_err(|e| Error::io("remove", &file, e))?;
    Ok((
        total as f64 / write_s / 1e9,
        total as f64 / read_s / 1e9,
        mode.into(),
    ))
}

/// Run the phases on `machine`'s memory.
pub fn run(machine: &Machine, b: &IoBench) -> Result<IoReport> {
    let model = model_of(b.params);
    let layout = StateLayout::new(&model, Mode::Exact).with_adam_state(b.adam_state);
    let placement = place_with_spill(
        machine,
        &layout,
        None,
        RamBudget::default(),
        SpillRequest {
            policy: SpillPolicy::Never,
            slots: 3,
        },
    )?;
    let store = HostStore::allocate(layout, placement, &StoreOptions::default())?;
    // Weights that are not all equal (a codec or CRC sees real data).
    for u in 0..store.num_units() {
        let mut g = store.take(u)?;
        let mut master = g.master();
        let numel = master.len();
        let mut piece = vec![0.0f32; 1 << 20];
        for start in (0..numel).step_by(piece.len()) {
            let n = piece.len().min(numel - start);
            for (i, x) in piece[..n].iter_mut().enumerate() {
                *x = (((start + i) % 1021) as f32 - 510.0) * 1e-4;
            }
            master.write(start, &piece[..n]);
        }
    }
    let work = b
        .dir
        .join(format!(".megatrain-bench-io-{}", std::process::id()));
    std::fs::create_dir_all(&work).map_err(|e| Error::io("create directory", &work, e))?;
    let result = phases(&store, &model, b, &work);
    let _ = std::fs::remove_dir_all(&work);
    let (phases, dd) = result?;
    Ok(IoReport {
        dir: b.dir.clone(),
        params: model.num_params() as u64,
        dd_write_gbps: dd.0,
        dd_read_gbps: dd.1,
        dd_mode: dd.2,
        phases,
    })
}

type DdRates = (f64, f64, String);

fn phases(
    store: &HostStore,
    model: &ModelConfig,
    b: &IoBench,
    work: &Path,
) -> Result<(Vec<IoPhase>, DdRates)> {
    let mut timed: Vec<(String, u64, f64, bool)> = Vec::new();
    // A checkpoint, as a run writes it at a step.
    let state = TrainState {
        format: checkpoint::FORMAT,
        run_id: Some("bench-io".into()),
        step: 1,
        cursor: Default::default(),
        prev_norm: None,
        model: model.clone(),
        // What the files' moment format is read from.
        config: crate::train::config::TrainConfig {
            adam_state: Some(b.adam_state),
            ..Default::default()
        },
        changes: Vec::new(),
    };
    let ck_root = work.join("checkpoints");
    let t0 = Instant::now();
    let ck = checkpoint::save(&ck_root, store, &state, 1)?;
    let write_s = t0.elapsed().as_secs_f64();
    let ck_bytes = size_of(&ck)?;
    timed.push(("checkpoint write".into(), ck_bytes, write_s, true));
    drop_cache(&ck)?;
    let t0 = Instant::now();
    checkpoint::load(&ck, store)?;
    timed.push((
        "resume read".into(),
        ck_bytes,
        t0.elapsed().as_secs_f64(),
        false,
    ));
    std::fs::remove_dir_all(&ck_root).map_err(|e| Error::io("remove", &ck_root, e))?;
    // The export, then a run started from it.
    let hf = work.join("hf");
    let t0 = Instant::now();
    crate::store::hf::export_store(
        store,
        &hf,
        2 << 30,
        ExportOptions {
            run_id: None,
            dtype: b.export_dtype,
            serving_files_from: None,
        },
    )?;
    let export_s = t0.elapsed().as_secs_f64();
    let hf_bytes = size_of(&hf)?;
    let name = match b.export_dtype {
        ExportDtype::Bf16 => "export (bf16)",
        ExportDtype::Fp32 => "export (fp32)",
    };
    timed.push((name.into(), hf_bytes, export_s, true));
    drop_cache(&hf)?;
    let t0 = Instant::now();
    crate::store::hf::load_into_store(&hf, store)?;
    timed.push((
        "--init-from read".into(),
        hf_bytes,
        t0.elapsed().as_secs_f64(),
        false,
    ));
    std::fs::remove_dir_all(&hf).map_err(|e| Error::io("remove", &hf, e))?;
    // The disk, as many bytes as the checkpoint.
    let dd = dd_rates(work, ck_bytes)?;
    let phases = timed
        .into_iter()
        .map(|(phase, bytes, secs, write)| {
            let gbps = bytes as f64 / secs.max(1e-9) / 1e9;
            let limit_gbps = if write { dd.0 } else { dd.1 };
            IoPhase {
                phase,
                bytes,
                secs,
                gbps,
                limit_gbps,
                ratio: gbps / limit_gbps,
            }
        })
        .collect();
    Ok((phases, dd))
}

/// The report as a table.
pub fn render(r: &IoReport) -> String {
    let mut s = format!(
        "bench io: {} ({:.2}B parameters)\ndisk: {} — write {:.2} GB/s, read {:.2} GB/s\n\n{:<18} {:>10} {:>8} {:>8} {:>8} {:>8}\n",
        r.dir.display(),
        r.params as f64 / 1e9,
        r.dd_mode,
        r.dd_write_gbps,
        r.dd_read_gbps,
        "phase",
        "bytes",
        "s",
        "GB/s",
        "dd GB/s",
        "ratio"
    );
    for p in &r.phases {
        s.push_str(&format!(
            "{:<18} {:>10} {:>8.2} {:>8.2} {:>8.2} {:>7.2}x\n",
            p.phase,
            human_bytes(p.bytes),
            p.secs,
            p.gbps,
            p.limit_gbps,
            p.ratio
        ));
    }
    s
}
