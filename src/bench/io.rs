//! `megatrain bench io`: every phase that moves a model between disk and memory — a checkpoint
//! written, a resume reading it back, an HF export, `--init-from` reading that export — timed
//! through the trainer's own code on a model of the size asked for, next to what `dd` with
//! O_DIRECT writes and reads on the same directory in the same run (the disk's sequential rate:
//! the limit each phase is measured against, right after it: writing as many bytes, or reading
//! the same files). Reads start from a cold page cache (each file's cached pages are dropped
//! first, after its fsync), so a read phase is the disk's.

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
use std::os::unix::fs::OpenOptionsExt;
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
    /// Passes of every phase; each phase's median pass is reported.
    pub reps: usize,
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
    /// `dd`'s GB/s right after the phase: writing as many bytes to the same directory, or
    /// reading the same files (the disk's rate then, whatever its drift over the run).
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
    /// Passes (each phase's median pass, by ratio, is reported).
    pub reps: usize,
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
    for file in files_under(path)? {
        let f = std::fs::File::open(&file).map_err(|e| Error::io("open", &file, e))?;
        f.sync_all().map_err(|e| Error::io("fsync", &file, e))?;
        // SAFETY: a plain advice call on an open descriptor.
        let r = unsafe { libc::posix_fadvise(f.as_raw_fd(), 0, 0, libc::POSIX_FADV_DONTNEED) };
        if r != 0 {
            return Err(Error::io(
                "drop cached pages",
                &file,
                std::io::Error::from_raw_os_error(r),
            ));
        }
    }
    Ok(())
}

/// Bytes of the files under `path`.
fn size_of(path: &Path) -> Result<u64> {
    files_under(path)?
        .iter()
        .map(|f| {
            std::fs::metadata(f)
                .map(|m| m.len())
                .map_err(|e| Error::io("stat", f, e))
        })
        .sum()
}

/// `path` itself if it is a file, else every file below it.
fn files_under(path: &Path) -> Result<Vec<PathBuf>> {
    let mut out = Vec::new();
    collect_files(path, &mut out)?;
    Ok(out)
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

/// Whether this directory takes `O_DIRECT` (tmpfs does not): `dd` runs with it where it does.
fn takes_direct(dir: &Path) -> bool {
    let probe = dir.join("dd-probe.bin");
    let ok = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .custom_flags(libc::O_DIRECT)
        .open(&probe)
        .is_ok();
    let _ = std::fs::remove_file(&probe);
    ok
}

/// `dd` writing `bytes` (whole 8 MiB blocks, at least as many) to a new file in `dir`, fsynced:
/// GB/s.
fn dd_write(dir: &Path, bytes: u64, direct: bool) -> Result<f64> {
    const BLOCK: u64 = 8 << 20;
    let count = bytes.div_ceil(BLOCK).max(1);
    let file = dir.join("dd.bin");
    let mut args = vec![
        "if=/dev/zero".to_owned(),
        format!("of={}", file.display()),
        "bs=8M".into(),
        format!("count={count}"),
        "conv=fsync".into(),
    ];
    if direct {
        args.push("oflag=direct".into());
    }
    let secs = dd(&args)?;
    std::fs::remove_file(&file).map_err(|e| Error::io("remove", &file, e))?;
    Ok((count * BLOCK) as f64 / secs / 1e9)
}

/// `dd` reading every file under `path` (8 MiB blocks, from a dropped page cache): GB/s.
fn dd_read(path: &Path, direct: bool) -> Result<f64> {
    let (mut secs, mut bytes) = (0.0, 0u64);
    for f in files_under(path)? {
        drop_cache(&f)?;
        let mut args = vec![
            format!("if={}", f.display()),
            "of=/dev/null".to_owned(),
            "bs=8M".into(),
        ];
        if direct {
            args.push("iflag=direct".into());
        }
        secs += dd(&args)?;
        bytes += size_of(&f)?;
    }
    Ok(bytes as f64 / secs.max(1e-9) / 1e9)
}

fn collect_files(path: &Path, out: &mut Vec<PathBuf>) -> Result<()> {
    if !path.is_dir() {
        out.push(path.to_owned());
        return Ok(());
    }
    for e in std::fs::read_dir(path).map_err(|e| Error::io("list", path, e))? {
        collect_files(&e.map_err(|e| Error::io("list", path, e))?.path(), out)?;
    }
    Ok(())
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
    let result = (0..b.reps.max(1))
        .map(|_| phases(&store, &model, b, &work))
        .collect::<Result<Vec<_>>>();
    let _ = std::fs::remove_dir_all(&work);
    let passes = result?;
    let dd_mode = passes[0].1.clone();
    // Per phase, the median pass (by ratio: each ratio is a phase and its dd run side by side).
    let phases = (0..passes[0].0.len())
        .map(|i| {
            let mut runs: Vec<IoPhase> = passes.iter().map(|(p, _)| p[i].clone()).collect();
            runs.sort_by(|a, b| a.ratio.total_cmp(&b.ratio));
            runs[runs.len() / 2].clone()
        })
        .collect();
    Ok(IoReport {
        dir: b.dir.clone(),
        params: model.num_params() as u64,
        reps: b.reps.max(1),
        dd_mode,
        phases,
    })
}

fn phases(
    store: &HostStore,
    model: &ModelConfig,
    b: &IoBench,
    work: &Path,
) -> Result<(Vec<IoPhase>, String)> {
    let direct = takes_direct(work);
    let mut out = Vec::new();
    let mut phase = |name: &str, bytes: u64, secs: f64, limit_gbps: f64| {
        let gbps = bytes as f64 / secs.max(1e-9) / 1e9;
        out.push(IoPhase {
            phase: name.into(),
            bytes,
            secs,
            gbps,
            limit_gbps,
            ratio: gbps / limit_gbps,
        });
    };
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
    let secs = t0.elapsed().as_secs_f64();
    let ck_bytes = size_of(&ck)?;
    phase(
        "checkpoint write",
        ck_bytes,
        secs,
        dd_write(work, ck_bytes, direct)?,
    );
    drop_cache(&ck)?;
    let t0 = Instant::now();
    checkpoint::load(&ck, store)?;
    let secs = t0.elapsed().as_secs_f64();
    phase("resume read", ck_bytes, secs, dd_read(&ck, direct)?);
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
    let secs = t0.elapsed().as_secs_f64();
    let hf_bytes = size_of(&hf)?;
    let name = match b.export_dtype {
        ExportDtype::Bf16 => "export (bf16)",
        ExportDtype::Fp32 => "export (fp32)",
    };
    phase(name, hf_bytes, secs, dd_write(work, hf_bytes, direct)?);
    drop_cache(&hf)?;
    let t0 = Instant::now();
    crate::store::hf::load_into_store(&hf, store)?;
    let secs = t0.elapsed().as_secs_f64();
    phase("--init-from read", hf_bytes, secs, dd_read(&hf, direct)?);
    std::fs::remove_dir_all(&hf).map_err(|e| Error::io("remove", &hf, e))?;
    let how = match direct {
        true => "dd bs=8M oflag=direct conv=fsync (writes) / iflag=direct (reads of the same files)",
        false => "dd bs=8M conv=fsync (writes) / reads of the same files from a dropped page cache (no O_DIRECT here)",
    };
    Ok((out, how.into()))
}

/// The report as a table.
pub fn render(r: &IoReport) -> String {
    let mut s = format!(
        "bench io: {} ({:.2}B parameters, median of {} pass(es))\nlimit: {}, right after each phase\n\n{:<18} {:>10} {:>8} {:>8} {:>8} {:>8}\n",
        r.dir.display(),
        r.params as f64 / 1e9,
        r.reps,
        r.dd_mode,
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
